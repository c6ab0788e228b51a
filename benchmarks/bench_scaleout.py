"""Scale-out on PostgreSQL (#18): worker processes on one journal, their claims, a SIGKILL's
failover, and what fencing costs an append.

Everything runs against ``INTERLOCK_PG_DSN`` (the section is left out without it), each
measurement in a schema of its own with a random name, dropped at the end. The workers
are real processes, ``interlock worker --app benchmarks/scaleout_app.py:app --db
URL?schema=S``, driving the app's ``steps`` machine: five scripted model calls (no
latency) and four calls of a no-op tool per run, so that the runtime and the database are
what is measured, not a model or a tool. Ratios are taken within one run:

- *throughput*: N runs are enqueued with the store's bulk path (one ``append`` of 1,000
  ``run_started`` events per transaction) and held behind a lease of a gate owner; 1, 2 and
  4 workers are started and wait, ready; the gate opens (one ``UPDATE``: every run
  claimable) and the clock runs until no run is unfinished (the runs index, polled every
  20 ms). Per row: runs/s, model calls/s (steps/s), events/s, the events per PostgreSQL
  transaction (``count(*) / count(DISTINCT xmin)`` of the events the workers wrote: the
  group commit's batch), the workers' CPU (``/proc/PID/stat`` over the window, in cores),
  the CPU of the ``postgres`` processes on the host (the server: the workers' backends,
  and other users' that live through the window), the host's busy share of its cores
  (``/proc/stat``: other users' load too), runs per second of the workers' CPU and of
  workers + server; and runs/s against 1 worker of the same round.
  The worker counts take turns (1, 2, 4, then 4, 2, 1) over the rounds. Enqueueing is timed
  apart: ``interlock.enqueue_run`` one run at a time against the bulk path.
- *claims*: ``store.claim(owner, limit=100)`` in process on a journal of 10,000 and of
  100,000 claimable runs, until half are claimed; then the empty claim (every run leased),
  an idle worker's poll, before and after a ``VACUUM`` of the leases. p50/p99 ms.
- *failover*: three workers (``--lease-ttl`` 2, then 5, ``--poll`` 0.5) drive runs of 100
  model calls of 50 ms each (60 in a quick run); once all are claimed and under way, the
  worker holding the most is SIGKILLed (at a random point of the heartbeat's period). For
  each run it held: the seconds from the SIGKILL to the run's next event (written by a
  survivor, its ``ts``), and apart, what was left of its lease at the kill (``expires`` on
  the server's clock, the same host's) and the rest (the claim, the load, one step). A
  dead worker's leases last until their last renewal (every ttl/3) plus the ttl, and a busy
  survivor claims every poll, so expect between 2/3 ttl and ttl, plus up to a poll, plus a
  load and a model call.
- *fencing*: ``append_fenced`` against ``append`` on batches of 1, 100 and 1,000 events in
  turns (``benchmarks/pg_fencing.py``'s comparison, which also goes to 10,000 events and
  times what recovery reads).

Run it alone: ``python -m benchmarks.bench_scaleout [--quick]`` prints the tables.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import ROOT, Progress, child_env, no_progress, quantile, run_alone

NAME = "scaleout"
TITLE = "Scale-out on PostgreSQL: workers, claims, failover, fencing"

DSN_VARIABLE = "INTERLOCK_PG_DSN"
APP = "benchmarks/scaleout_app.py:app"
#: Runs per throughput row (quick, full).
RUNS = (200, 4000)
WORKERS = (1, 2, 4)
#: Rounds of the worker counts, taken in turns (quick, full).
ROUNDS = (1, 5)
#: Claimable runs in the claim journals (quick, full).
CLAIM_TABLES = ((2_000,), (10_000, 100_000))
EMPTY_CLAIMS = (50, 300)
#: (lease ttl, kills) of the failover (quick, full).
FAILOVER = (((2.0, 1),), ((2.0, 5), (5.0, 5)))
FAILOVER_WORKERS = 3
FAILOVER_RUNS = 60
#: Model calls per failover run (quick, full): a run outlasts the kill and the takeover.
FAILOVER_STEPS = (60, 100)
FAILOVER_LATENCY = 0.05
FAILOVER_POLL = 0.5
#: Batch sizes of the fencing comparison, events per mode and most batches (quick, full).
FENCE_SIZES = (1, 100, 1000)
FENCE_EVENTS = (2_000, 50_000)
FENCE_ROUNDS = (100, 1000)
GATE = "bench-gate"
TICK = os.sysconf("SC_CLK_TCK")


def dsn() -> str:
    value = os.environ.get(DSN_VARIABLE, "")
    if not value:
        raise RuntimeError(
            f"the scaleout benchmark needs PostgreSQL: set {DSN_VARIABLE} "
            "(e.g. postgresql://postgres@127.0.0.1:5432/test)"
        )
    return value


def journal_url(base: str, schema: str) -> str:
    return f"{base}{'&' if '?' in base else '?'}schema={schema}"


@contextlib.contextmanager
def fresh_schema(base: str, prefix: str) -> Iterator[str]:
    """A random schema name, dropped (with everything in it) on the way out."""
    import psycopg
    from psycopg import sql

    schema = f"bench_{prefix}_{secrets.token_hex(4)}"
    try:
        yield schema
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def connect(base: str, schema: str) -> Any:
    import psycopg

    conn = psycopg.connect(base, autocommit=True)
    conn.execute(f'SET search_path TO "{schema}"')
    return conn


# -- CPU from /proc -----------------------------------------------------------------------


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) process ``pid`` has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def postgres_cpu() -> dict[int, float]:
    """Seconds of CPU used so far by each process named ``postgres`` on this host, by pid."""
    used: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as file:
                text = file.read()
        except OSError:
            continue
        name, _, rest = text.partition(" (")[2].rpartition(")")
        if name == "postgres":
            fields = rest.split()
            used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICK
    return used


def host_cpu() -> tuple[float, float]:
    """``(busy, total)`` seconds of all the host's cores since boot (``/proc/stat``)."""
    with open("/proc/stat") as file:
        values = [int(v) for v in file.readline().split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return (total - idle) / TICK, total / TICK


class CpuWindow:
    """The CPU the workers, the server and the host spend between ``start`` and ``stop``."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)

    def start(self) -> None:
        self._workers = [process_cpu(pid) for pid in self.pids]
        self._server = postgres_cpu()
        self._host = host_cpu()
        self._wall = time.perf_counter()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        workers = sum(process_cpu(p) - c for p, c in zip(self.pids, self._workers, strict=True))
        # a backend that exits in the window takes its CPU with it (other users' tests:
        # the workers' own backends live through it); one born in it counts from zero
        server = sum(cpu - self._server.get(pid, 0.0) for pid, cpu in postgres_cpu().items())
        busy, total = host_cpu()
        host_busy = busy - self._host[0]
        host_total = total - self._host[1]
        return {
            "wall_s": wall,
            "workers_cpu_s": workers,
            "server_cpu_s": server,
            "workers_cores": workers / wall,
            "server_cores": server / wall,
            "host_busy": host_busy / host_total if host_total else float("nan"),
            # what the host's busy cores spent on neither (other users' tests, mostly)
            "others_cores": max(0.0, (host_busy - workers - server) / wall),
        }


# -- worker processes ---------------------------------------------------------------------


class WorkerProc:
    """``interlock worker`` as a process, its streams in files."""

    def __init__(self, url: str, owner: str, logs: Path, *extra: str, env: dict[str, str]) -> None:
        self.owner = owner
        self.out = logs / f"{owner}.out"
        self.err = logs / f"{owner}.err"
        args = ["worker", "--app", APP, "--db", url, "--owner", owner, "--json", *extra]
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "interlock", *args],
                cwd=ROOT,
                env=child_env(env),
                stdout=out,
                stderr=err,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        give_up = time.monotonic() + timeout
        while f"interlock worker {self.owner}: ready" not in self.stderr():
            if self.popen.poll() is not None or time.monotonic() > give_up:
                self.kill()
                raise RuntimeError(f"worker {self.owner} never got ready:\n{self.stderr()[-2000:]}")
            time.sleep(0.02)

    def drain(self, timeout: float = 60.0) -> dict[str, Any]:
        """SIGTERM, wait, and return its JSON summary."""
        import json

        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"worker {self.owner} did not drain in {timeout:g} s") from None
        try:
            summary: dict[str, Any] = json.loads(self.out.read_text())
        except ValueError:
            raise RuntimeError(
                f"worker {self.owner} exited {self.popen.returncode} without a summary:\n"
                f"{self.stderr()[-2000:]}"
            ) from None
        return summary

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(30)


@contextlib.contextmanager
def workers(
    url: str, count: int, logs: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[list[WorkerProc]]:
    """``count`` workers, ready; SIGKILLed on the way out if still running."""
    procs: list[WorkerProc] = []
    try:
        for n in range(count):
            owner = f"w{n + 1}-{secrets.token_hex(2)}"
            procs.append(WorkerProc(url, owner, logs, *extra, env=env or {}))
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.kill()


def wait_for(what: str, done: Any, timeout: float, interval: float = 0.02) -> None:
    give_up = time.monotonic() + timeout
    while not done():
        if time.monotonic() > give_up:
            raise RuntimeError(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# -- enqueueing ---------------------------------------------------------------------------


def _machine() -> Any:
    from interlock.runtime._app import load_app

    return load_app(APP, base=ROOT).machines["steps"]


async def enqueue_bulk(store: Any, run_ids: Sequence[str], batch: int = 1000) -> None:
    """Create runs with one append of ``batch`` run_started events per transaction."""
    from interlock.core import _decider
    from interlock.core._messages import Start

    machine = _machine()
    inputs = machine.check_inputs(None)
    now = time.time()
    for at in range(0, len(run_ids), batch):
        events: list[Any] = []
        for run_id in run_ids[at : at + batch]:
            _decider.start(
                machine, Start(run_id=run_id, machine="steps", inputs=inputs), now, events
            )
        await store.append(events)


def measure_enqueue(base: str, bulk_runs: int, single_runs: int) -> dict[str, Any]:
    """runs/s of ``enqueue_run`` one at a time and of the bulk path, in one schema."""
    import trio

    from interlock import enqueue_run
    from interlock.stores import open_store

    machine = _machine()

    async def main(url: str) -> dict[str, Any]:
        store = await open_store(url)
        try:
            begin = time.perf_counter()
            for i in range(single_runs):
                await enqueue_run(store, machine, None, run_id=f"one-{i:06d}")
            single = time.perf_counter() - begin
            begin = time.perf_counter()
            await enqueue_bulk(store, [f"bulk-{i:06d}" for i in range(bulk_runs)])
            bulk = time.perf_counter() - begin
        finally:
            await store.aclose()
        return {
            "single_runs": single_runs,
            "single_runs_per_s": single_runs / single,
            "bulk_runs": bulk_runs,
            "bulk_runs_per_s": bulk_runs / bulk,
            "bulk_batch": 1000,
        }

    with fresh_schema(base, "enqueue") as schema:
        return trio.run(main, journal_url(base, schema))


# -- throughput ---------------------------------------------------------------------------


def measure_throughput(base: str, count: int, runs: int, logs: Path) -> dict[str, Any]:
    """``count`` workers drive ``runs`` runs, released at once; see the module."""
    import trio

    from interlock.stores import open_store

    with fresh_schema(base, "tput") as schema:
        url = journal_url(base, schema)

        async def enqueue() -> None:
            store = await open_store(url)
            try:
                await enqueue_bulk(store, [f"run-{i:06d}" for i in range(runs)])
            finally:
                await store.aclose()

        trio.run(enqueue)
        conn = connect(base, schema)
        with conn:
            conn.execute("UPDATE leases SET owner = %s, expires = 'infinity'", (GATE,))
            with workers(url, count, logs, "--lease-ttl", "10", "--poll", "0.1") as procs:
                window = CpuWindow([p.pid for p in procs])
                window.start()
                conn.execute(
                    "UPDATE leases SET owner = NULL, expires = '-infinity' WHERE owner = %s",
                    (GATE,),
                )

                def finished() -> bool:
                    row = conn.execute(
                        "SELECT count(*) FROM runs WHERE outcome = 'running'"
                    ).fetchone()
                    return bool(row[0] == 0)

                wait_for(f"{runs} runs on {count} workers", finished, timeout=600)
                cpu = window.stop()
                summaries = [p.drain() for p in procs]
            outcomes = dict(
                conn.execute("SELECT outcome, count(*) FROM runs GROUP BY outcome").fetchall()
            )
            events, transactions, model_calls = conn.execute(
                "SELECT count(*), count(DISTINCT xmin::text), "
                "count(*) FILTER (WHERE kind = 'model_called') FROM events WHERE seq > 1"
            ).fetchone()
    wall = cpu["wall_s"]
    return {
        "workers": count,
        "runs": runs,
        "outcomes": outcomes,
        **cpu,
        "runs_per_s": runs / wall,
        "model_calls_per_s": model_calls / wall,
        "events_per_s": events / wall,
        "events": events,
        "transactions": transactions,
        "events_per_transaction": events / transactions if transactions else float("nan"),
        "runs_per_worker_cpu_s": runs / cpu["workers_cpu_s"],
        "runs_per_cpu_s": runs / (cpu["workers_cpu_s"] + cpu["server_cpu_s"]),
        "claimed": sorted(s["claimed"] for s in summaries),
        "lost": sum(s["lost"] for s in summaries),
    }


# -- claims -------------------------------------------------------------------------------


def measure_claims(base: str, size: int, empty_claims: int) -> dict[str, Any]:
    """p50/p99 of ``claim(limit=100)`` on ``size`` claimable runs, then of empty claims."""
    import trio

    from interlock.core._events import RunStarted
    from interlock.stores import open_store

    async def main(url: str, conn: Any) -> dict[str, Any]:
        store = await open_store(url)
        try:
            for at in range(0, size, 5000):
                await store.append(
                    [
                        RunStarted(
                            run_id=f"c-{i:07d}", seq=1, ts=1.0, machine="steps", state="WORK"
                        )
                        for i in range(at, min(at + 5000, size))
                    ]
                )
            conn.execute("ANALYZE leases")
            conn.execute("ANALYZE runs")
            full: list[float] = []
            taken = 0
            while taken < size // 2:
                begin = time.perf_counter()
                leases = await store.claim("bench-claimer", limit=100, ttl=3600.0)
                full.append(time.perf_counter() - begin)
                taken += len(leases)
            while await store.claim("bench-claimer", limit=1000, ttl=3600.0):
                pass
            empty: list[float] = []
            for _ in range(empty_claims):
                begin = time.perf_counter()
                leases = await store.claim("bench-idle", limit=100, ttl=3600.0)
                empty.append(time.perf_counter() - begin)
                assert not leases, "a claim found a run after every run was claimed"
            # every claim left a dead row version in the claim index until a vacuum
            conn.execute("VACUUM leases")
            vacuumed: list[float] = []
            for _ in range(empty_claims):
                begin = time.perf_counter()
                await store.claim("bench-idle", limit=100, ttl=3600.0)
                vacuumed.append(time.perf_counter() - begin)
        finally:
            await store.aclose()
        return {
            "runs": size,
            "claims": len(full),
            "claim_p50_ms": quantile(full, 0.5) * 1000,
            "claim_p99_ms": quantile(full, 0.99) * 1000,
            "empty_claims": len(empty),
            "empty_p50_ms": quantile(empty, 0.5) * 1000,
            "empty_p99_ms": quantile(empty, 0.99) * 1000,
            "vacuumed_p50_ms": quantile(vacuumed, 0.5) * 1000,
            "vacuumed_p99_ms": quantile(vacuumed, 0.99) * 1000,
        }

    with fresh_schema(base, "claim") as schema:
        url = journal_url(base, schema)
        # the store creates the schema: open it once before the side connection uses it
        conn = None
        try:

            async def create() -> None:
                store = await open_store(url)
                await store.aclose()

            trio.run(create)
            conn = connect(base, schema)
            return trio.run(main, url, conn)
        finally:
            if conn is not None:
                conn.close()


# -- failover -----------------------------------------------------------------------------


def count(conn: Any, query: str, params: Sequence[Any] = ()) -> int:
    row = conn.execute(query, params).fetchone()
    return int(row[0])


def measure_failover(
    base: str, ttl: float, kills: int, logs: Path, steps: int = FAILOVER_STEPS[1]
) -> dict[str, Any]:
    """``kills`` rounds: three workers, the busiest SIGKILLed, on runs of ``steps`` model
    calls; see the module."""
    import trio

    from interlock.stores import open_store

    delays: list[float] = []
    after: list[float] = []
    per_kill: list[dict[str, Any]] = []
    jitter = random.Random(f"failover {ttl}")
    with fresh_schema(base, "failover") as schema:
        url = journal_url(base, schema)

        async def create() -> None:
            store = await open_store(url)
            await store.aclose()

        trio.run(create)
        with connect(base, schema) as conn:
            for kill in range(kills):
                run_ids = [f"k{kill}-{i:04d}" for i in range(FAILOVER_RUNS)]
                these, past_expiry, row = _one_kill(url, conn, ttl, run_ids, logs, jitter, steps)
                delays += these
                after += past_expiry
                per_kill.append(row)
            outcomes = dict(
                conn.execute("SELECT outcome, count(*) FROM runs GROUP BY outcome").fetchall()
            )
    return {
        "ttl_s": ttl,
        "poll_s": FAILOVER_POLL,
        "kills": kills,
        "runs": len(delays),
        "p50_s": quantile(delays, 0.5),
        "p99_s": quantile(delays, 0.99),
        "min_s": min(delays) if delays else float("nan"),
        "max_s": max(delays) if delays else float("nan"),
        "lease_left_p50_s": quantile([k["lease_left_s"] for k in per_kill], 0.5),
        "after_expiry_p50_s": quantile(after, 0.5),
        "after_expiry_p99_s": quantile(after, 0.99),
        "per_kill": per_kill,
        "outcomes": outcomes,
    }


def _one_kill(
    url: str,
    conn: Any,
    ttl: float,
    run_ids: list[str],
    logs: Path,
    jitter: random.Random,
    steps: int,
) -> tuple[list[float], list[float], dict[str, Any]]:
    """Enqueue ``run_ids``, start the workers, SIGKILL the busiest once all are under way,
    and return the delays to each of its runs' next event."""
    import trio

    from interlock.stores import open_store

    async def enqueue() -> None:
        store = await open_store(url)
        try:
            await enqueue_bulk(store, run_ids)
        finally:
            await store.aclose()

    trio.run(enqueue)
    conn.execute(
        "UPDATE leases SET owner = %s, expires = 'infinity' WHERE run_id = ANY(%s)",
        (GATE, run_ids),
    )
    env = {
        "BENCH_SCALEOUT_STEPS": str(steps),
        "BENCH_SCALEOUT_LATENCY": str(FAILOVER_LATENCY),
    }
    extra = ("--lease-ttl", f"{ttl:g}", "--poll", f"{FAILOVER_POLL:g}", "--max-runs", "40")
    with workers(url, FAILOVER_WORKERS, logs, *extra, env=env) as procs:
        conn.execute(
            "UPDATE leases SET owner = NULL, expires = '-infinity' WHERE owner = %s", (GATE,)
        )
        unclaimed = (
            "SELECT count(*) FROM leases WHERE run_id = ANY(%s) AND live "
            "AND (owner IS NULL OR owner = %s)"
        )
        wait_for("every run claimed", lambda: count(conn, unclaimed, (run_ids, GATE)) == 0, 60)
        # under way: some steps done, most to come; the jitter spreads the kill over the
        # heartbeat's period, so that the leases' time left varies from kill to kill
        time.sleep(1.0 + jitter.uniform(0.0, ttl / 3))
        held = dict(
            conn.execute(
                "SELECT owner, count(*) FROM leases WHERE run_id = ANY(%s) AND live GROUP BY owner",
                (run_ids,),
            ).fetchall()
        )
        victim = max(procs, key=lambda p: held.get(p.owner, 0))
        victim.popen.send_signal(signal.SIGKILL)
        killed_at = time.time()
        victim.popen.wait(30)
        left = dict(
            conn.execute(
                "SELECT run_id, extract(epoch FROM expires)::float8 - %s FROM leases "
                "WHERE owner = %s AND live",
                (killed_at, victim.owner),
            ).fetchall()
        )
        orphans = list(left)
        if not orphans:
            raise RuntimeError(
                f"the killed worker {victim.owner} held no unfinished run (held: {held}); "
                "the runs ended before the kill: make them longer (FAILOVER_STEPS)"
            )
        moved = "SELECT count(DISTINCT run_id) FROM events WHERE run_id = ANY(%s) AND ts > %s"
        wait_for(
            "the killed worker's runs to progress",
            lambda: count(conn, moved, (orphans, killed_at)) == len(orphans),
            60 + ttl,
        )
        first = conn.execute(
            "SELECT run_id, min(ts) FROM events WHERE run_id = ANY(%s) AND ts > %s GROUP BY run_id",
            (orphans, killed_at),
        ).fetchall()
        delays = [ts - killed_at for _run_id, ts in first]
        # what is left of each delay once its lease expired: the claim, the load, a step
        after = [ts - killed_at - left[run_id] for run_id, ts in first]
        running = "SELECT count(*) FROM runs WHERE run_id = ANY(%s) AND outcome = 'running'"
        wait_for("every run to finish", lambda: count(conn, running, (run_ids,)) == 0, 120, 0.1)
        for proc in procs:
            if proc is not victim:
                proc.drain()
    return (
        delays,
        after,
        {
            "orphans": len(orphans),
            "lease_left_s": quantile(list(left.values()), 0.5),
            "held": sorted(held.values()),
            "p50_s": quantile(delays, 0.5),
            "max_s": max(delays) if delays else float("nan"),
        },
    )


# -- fencing ------------------------------------------------------------------------------


def measure_fencing(base: str, quick: bool) -> list[dict[str, Any]]:
    import trio

    from benchmarks import pg_fencing
    from interlock.stores import open_postgres_store

    level = 0 if quick else 1

    async def main(schema: str) -> list[dict[str, Any]]:
        store = await open_postgres_store(base, schema=schema)
        try:
            rows = []
            for size in FENCE_SIZES:
                modes = await pg_fencing.measure(
                    store, size, FENCE_EVENTS[level], max_rounds=FENCE_ROUNDS[level]
                )
                rows.append(pg_fencing.compare(size, modes))
            return rows
        finally:
            await store.aclose()

    with fresh_schema(base, "fence") as schema:
        return trio.run(main, schema)


# -- the section --------------------------------------------------------------------------


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    level = 0 if quick else 1
    base = dsn()
    results: dict[str, Any] = {"quick": quick}
    with tempfile.TemporaryDirectory(prefix="bench-scaleout-") as tmp:
        logs = Path(tmp)
        progress("enqueue: enqueue_run against the bulk path", 0.0)
        results["enqueue"] = measure_enqueue(base, RUNS[level], min(RUNS[level], 500))
        rounds: list[list[dict[str, Any]]] = []
        steps = ROUNDS[level] * len(WORKERS)
        for index in range(ROUNDS[level]):
            order = WORKERS if index % 2 == 0 else tuple(reversed(WORKERS))
            rows: dict[int, dict[str, Any]] = {}
            for count in order:
                done = (index * len(WORKERS) + len(rows)) / steps
                progress(f"throughput: {count} worker(s), round {index + 1}", 0.05 + 0.45 * done)
                rows[count] = measure_throughput(base, count, RUNS[level], logs)
            for row in rows.values():
                row["round"] = index + 1
                row["vs_one_worker"] = row["runs_per_s"] / rows[1]["runs_per_s"]
                row["per_cpu_vs_one_worker"] = (
                    row["runs_per_worker_cpu_s"] / rows[1]["runs_per_worker_cpu_s"]
                )
            rounds.append([rows[count] for count in WORKERS])
        results["throughput"] = [row for rows_ in rounds for row in rows_]
        results["scaling"] = {
            str(count): quantile(
                [r["vs_one_worker"] for r in results["throughput"] if r["workers"] == count], 0.5
            )
            for count in WORKERS
        }
        results["claims"] = []
        for size in CLAIM_TABLES[level]:
            progress(f"claims on {size:,} claimable runs", 0.5)
            results["claims"].append(measure_claims(base, size, EMPTY_CLAIMS[level]))
        results["failover_setup"] = {
            "workers": FAILOVER_WORKERS,
            "runs": FAILOVER_RUNS,
            "steps": FAILOVER_STEPS[level],
            "latency_s": FAILOVER_LATENCY,
        }
        results["failover"] = []
        for ttl, kills in FAILOVER[level]:
            progress(f"failover: lease ttl {ttl:g} s, {kills} kill(s)", 0.6)
            results["failover"].append(
                measure_failover(base, ttl, kills, logs, FAILOVER_STEPS[level])
            )
        progress("fencing: append_fenced against append", 0.9)
        results["fencing"] = measure_fencing(base, quick)
    results["events_per_transaction_min"] = min(
        r["events_per_transaction"] for r in results["throughput"]
    )
    return results


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, table

    enqueue = results["enqueue"]
    setup = results["failover_setup"]
    throughput = table(
        [
            "workers",
            "round",
            "runs/s",
            "model calls/s",
            "events/s",
            "events per transaction",
            "runs/s ÷ 1 worker",
            "workers' CPU (cores)",
            "postgres CPU (cores)",
            "host busy",
            "others' CPU (cores)",
            "runs per worker CPU s",
            "÷ 1 worker",
            "runs per CPU s (workers + postgres)",
            "runs claimed by each worker",
        ],
        [
            (
                r["workers"],
                r["round"],
                f"{r['runs_per_s']:,.0f}",
                f"{r['model_calls_per_s']:,.0f}",
                f"{r['events_per_s']:,.0f}",
                f"{r['events_per_transaction']:,.1f}",
                f"{r['vs_one_worker']:.2f}",
                f"{r['workers_cores']:.2f}",
                f"{r['server_cores']:.2f}",
                f"{r['host_busy']:.0%}",
                num(r.get("others_cores"), 2),
                f"{r['runs_per_worker_cpu_s']:,.0f}",
                f"{r['per_cpu_vs_one_worker']:.2f}",
                f"{r['runs_per_cpu_s']:,.0f}",
                ", ".join(f"{c:,}" for c in r["claimed"]),
            )
            for r in results["throughput"]
        ],
    )
    runs = results["throughput"][0]["runs"]
    scaling = results["scaling"]
    parts = [
        "**Throughput.** "
        f"{runs:,} runs per row (5 model calls, 4 no-op tool calls, 16 events each), released "
        "at once to workers already started; wall time until none is unfinished. "
        "*events per transaction*: the events the workers wrote ÷ the PostgreSQL "
        "transactions that wrote them (distinct `xmin`): the group commit's batch. "
        "*postgres CPU*: the `postgres` processes on the host (the workers' backends; other "
        "users' that outlive the window too); *host busy*: of all "
        f"{os.cpu_count()} cores, other users' load included; *others' CPU*: the busy cores "
        "less the workers and the server (other users' load, in cores). Median runs/s "
        "against 1 worker: "
        + ", ".join(f"{k} workers {v:.2f}×" for k, v in scaling.items() if k != "1")
        + ".",
        "",
        throughput,
        "",
        f"Enqueueing: `interlock.enqueue_run` one run at a time "
        f"{enqueue['single_runs_per_s']:,.0f} runs/s ({enqueue['single_runs']:,} runs); the "
        f"bulk path (`store.append` of {enqueue['bulk_batch']:,} `run_started` per "
        f"transaction) {enqueue['bulk_runs_per_s']:,.0f} runs/s "
        f"({enqueue['bulk_runs_per_s'] / enqueue['single_runs_per_s']:.0f}×).",
        "",
        "**Claims** (`store.claim(owner, limit=100)` in process, until half the runs are "
        "claimed; then the empty claim of an idle worker, every run leased, before and after "
        "a `VACUUM` of the leases: each claim leaves a dead row version in the claim index, "
        "which an empty claim walks past until a vacuum):",
        "",
        table(
            [
                "claimable runs",
                "claims",
                "claim p50 ms",
                "claim p99 ms",
                "empty p50 ms",
                "empty p99 ms",
                "empty after VACUUM p50 / p99 ms",
            ],
            [
                (
                    f"{c['runs']:,}",
                    c["claims"],
                    num(c["claim_p50_ms"], 2),
                    num(c["claim_p99_ms"], 2),
                    num(c["empty_p50_ms"], 2),
                    num(c["empty_p99_ms"], 2),
                    f"{num(c['vacuumed_p50_ms'], 2)} / {num(c['vacuumed_p99_ms'], 2)}",
                )
                for c in results["claims"]
            ],
        ),
        "",
        f"**Failover** ({setup['workers']} workers, {setup['runs']} runs of "
        f"{setup['steps']} model calls of {setup['latency_s'] * 1000:.0f} ms per kill; the worker "
        "holding the most runs SIGKILLed once they are under way; per run it held, the "
        "seconds from the SIGKILL to its next event, written by a survivor):",
        "",
        table(
            [
                "lease ttl s",
                "poll s",
                "kills",
                "runs",
                "p50 s",
                "p99 s",
                "min s",
                "max s",
                "p50 ÷ ttl",
                "lease left at the kill, p50 s",
                "from expiry to next event, p50 / p99 s",
            ],
            [
                (
                    f"{f['ttl_s']:g}",
                    f"{f['poll_s']:g}",
                    f["kills"],
                    f["runs"],
                    num(f["p50_s"], 2),
                    num(f["p99_s"], 2),
                    num(f["min_s"], 2),
                    num(f["max_s"], 2),
                    f"{f['p50_s'] / f['ttl_s']:.2f}",
                    num(f["lease_left_p50_s"], 2),
                    f"{num(f['after_expiry_p50_s'], 2)} / {num(f['after_expiry_p99_s'], 2)}",
                )
                for f in results["failover"]
            ],
        ),
        "",
        "**Fencing** (`append_fenced` against `append`, in turns batch by batch, each on its "
        "own runs; a batch of 1 is one run's event, larger ones ten events per run):",
        "",
        table(
            [
                "batch (events)",
                "batches per mode",
                "append events/s",
                "append_fenced events/s",
                "append median ms",
                "append_fenced median ms",
                "fenced ÷ plain (events/s)",
                "fenced ÷ plain (median of paired batches)",
            ],
            [
                (
                    f"{f['batch']:,}",
                    f"{f['batches']:,}",
                    f"{f['append_events_per_s']:,.0f}",
                    f"{f['fenced_events_per_s']:,.0f}",
                    num(f["append_median_ms"], 2),
                    num(f["fenced_median_ms"], 2),
                    f"{f['ratio']:.2f}",
                    f"{f['paired_ratio']:.2f}",
                )
                for f in results["fencing"]
            ],
        ),
        "",
        "What scales on this host and why: `benchmarks/scaleout.md`. Calls cut as stalled "
        "by three workers under load with no fault, before and after issue 33's fix: "
        "`benchmarks/lease_stalls.md` (`python -m benchmarks.lease_stalls`).",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    run_alone("bench_scaleout", run, render, sys.argv)
