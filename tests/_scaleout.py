"""Helpers of the scale-out chaos tests (#18): interlock processes, a private PostgreSQL
cluster, and the audit that reads the journal and the downstream tables after a scenario.

The audit is the tests' judge: :func:`audit` returns every violation it finds (a run not
terminal or not finished exactly once, a gap in a run's seqs, a side effect applied twice,
a committed call the downstream does not hold once, a downstream row no intent explains);
an empty list means the scenario held.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from tests._cli import COLUMNS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

ROOT = Path(__file__).resolve().parent.parent
#: How the tests name the application, as a user would (from the repository's root).
APP = "tests/scaleout_app.py:app"
TERMINAL = ("completed", "failed", "escalated")
TERMINAL_KINDS = ("completed", "failed", "escalated")
#: The side-effecting tools of the app and the downstream table each one writes.
EFFECT_TABLES = {"charge": "charges", "notify": "notifications", "reserve": "reservations"}
#: The tools that are not idempotent: one execution per key at most, ever.
ONCE_ONLY = ("charge", "notify")


def _scaleout_app() -> Any:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import scaleout_app
    finally:
        sys.path.remove(str(ROOT / "tests"))
    return scaleout_app


# -- journal URLs and schemas ---------------------------------------------------------


def journal_url(dsn: str, schema: str) -> str:
    separator = "&" if "?" in dsn else "?"
    return f"{dsn}{separator}schema={schema}"


def new_schema(prefix: str = "scale") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def drop_schemas(dsn: str, schema: str) -> None:
    """Drop the journal's schema and the downstream's beside it."""
    import psycopg

    with (
        contextlib.suppress(psycopg.OperationalError),
        psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn,
    ):
        for name in (schema, _scaleout_app().effects_schema(schema)):
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` run with the journal's schema, then the downstream's, on the path."""
    import psycopg

    dsn, schema = _scaleout_app().split_url(url)
    effects = _scaleout_app().effects_schema(schema)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'SET search_path TO "{schema}", "{effects}"')
        return list(conn.execute(sql, params).fetchall())  # type: ignore[arg-type]


def progress(url: str) -> tuple[int, int]:
    """``(terminal, total)`` runs in the journal now (``(0, 0)`` before it exists)."""
    import psycopg

    try:
        ((done, total),) = query(
            url, "SELECT count(*) FILTER (WHERE outcome <> 'running'), count(*) FROM runs"
        )
    except psycopg.Error:
        return 0, 0
    return int(done), int(total)


def enqueue(url: str, indices: Iterable[int]) -> list[str]:
    """Create runs ``order-NNNNNN`` of the app's machine with ``interlock.enqueue_run``."""
    from interlock import enqueue_run
    from interlock.stores._open import open_store

    app = _scaleout_app()

    async def main() -> list[str]:
        store = await open_store(url)
        try:
            return [
                await enqueue_run(store, app.order, app.make_inputs(i), run_id=f"order-{i:06d}")
                for i in indices
            ]
        finally:
            await store.aclose()

    return trio.run(main)


def enqueue_many(url: str, indices: Iterable[int], chunk: int = 1000) -> None:
    """Create runs ``order-NNNNNN`` as :func:`enqueue` does, ``chunk`` runs per write
    (``interlock.enqueue_runs``): a load of thousands of runs in seconds."""
    from interlock import enqueue_runs
    from interlock.stores._open import open_store

    app = _scaleout_app()
    ids = list(indices)

    async def main() -> None:
        store = await open_store(url)
        try:
            for at in range(0, len(ids), chunk):
                part = ids[at : at + chunk]
                await enqueue_runs(
                    store,
                    app.order,
                    [app.make_inputs(i) for i in part],
                    run_ids=[f"order-{i:06d}" for i in part],
                )
        finally:
            await store.aclose()

    trio.run(main)


def stall_cuts(url: str) -> tuple[int, int]:
    """``(escalated, journaled)``: the runs escalated because a call was cut as if its
    worker had stalled past its lease (the cut's text in the escalation's detail), and the
    journaled failures of such cuts (a ``notify`` cut is reconciled, not escalated, but its
    failure is journaled all the same; the framed msgpack holds the text as UTF-8)."""
    from interlock.core._breakers import LEASE_CUT

    escalated = query(
        url,
        "SELECT count(*) FROM runs WHERE outcome = 'escalated' AND position(%s in detail) > 0",
        (LEASE_CUT,),
    )[0][0]
    journaled = query(
        url,
        "SELECT count(*) FROM events WHERE kind IN ('tool_failed', 'tool_in_doubt') "
        "AND position(convert_to(%s, 'UTF8') in body) > 0",
        (LEASE_CUT,),
    )[0][0]
    return int(escalated), int(journaled)


def wait_until(
    what: str,
    done: Callable[[], bool],
    *,
    timeout: float,
    procs: Iterable[Proc] = (),
    explain: Callable[[], str] | None = None,
) -> None:
    """Poll ``done`` until true; past ``timeout`` (a hang guard) fail naming ``what``, what
    ``explain()`` says of the state then, and the stderr tails of ``procs``."""
    give_up = time.monotonic() + timeout
    while not done():
        if time.monotonic() > give_up:
            said = f"{explain()}\n" if explain is not None else ""
            raise AssertionError(
                f"gave up after {timeout:g} s waiting for {what}\n{said}{tails(procs)}"
            )
        time.sleep(0.05)


def tails(procs: Iterable[Proc], chars: int = 1500) -> str:
    return "\n".join(p.describe(chars) for p in procs)


# -- processes ------------------------------------------------------------------------


class Proc:
    """``python -m interlock ARGS`` as a process, its streams in files (never a full pipe)."""

    def __init__(
        self, name: str, args: list[str], logs: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.args = name, args
        self.out_path, self.err_path = logs / f"{name}.out", logs / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "interlock", *args],
                stdout=out,
                stderr=err,
                cwd=ROOT,
                env={**os.environ, "COLUMNS": COLUMNS, **(env or {})},
            )
        self.signals: list[str] = []

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def describe(self, chars: int = 1500) -> str:
        state = "running" if self.popen.poll() is None else f"exit {self.popen.returncode}"
        sent = f", signals {' '.join(self.signals[-6:])}" if self.signals else ""
        if len(self.signals) > 6:
            sent += f" (the last 6 of {len(self.signals)})"
        return (
            f"--- {self.name} (pid {self.pid}, {state}{sent}): interlock {' '.join(self.args)}\n"
            f"stderr tail: {self.stderr()[-chars:]}\nstdout tail: {self.stdout()[-chars:]}"
        )

    def send(self, sig: signal.Signals) -> None:
        self.signals.append(sig.name)
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait_for_stderr(self, text: str, timeout: float = 60.0) -> None:
        """Wait until ``text`` is on stderr (e.g. the worker's ready line)."""
        give_up = time.monotonic() + timeout
        while text not in self.stderr():
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited before writing {text!r}\n{self.describe()}"
                )
            if time.monotonic() > give_up:
                raise AssertionError(
                    f"{self.name} did not write {text!r} in {timeout:g} s\n{self.describe()}"
                )
            time.sleep(0.05)

    def wait(self, timeout: float = 120.0) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.popen.wait(10)
            raise AssertionError(
                f"{self.name} did not exit in {timeout:g} s (a hang guard: killed it)\n"
                + self.describe()
            ) from None

    def exit_ok(self, timeout: float = 120.0) -> None:
        code = self.wait(timeout)
        assert code == 0, f"{self.name} exited {code}\n{self.describe()}"

    def summary(self) -> dict[str, Any]:
        """The --json document it printed on stdout at exit."""
        try:
            value: dict[str, Any] = json.loads(self.stdout())
        except ValueError:
            raise AssertionError(
                f"{self.name} printed no JSON summary\n{self.describe()}"
            ) from None
        return value

    def kill(self) -> None:
        """SIGKILL, and reap."""
        self.send(signal.SIGKILL)
        self.popen.wait(30)

    def stop(self) -> None:
        """SIGKILL what is still running (a test's cleanup)."""
        if self.popen.poll() is None:
            self.send(signal.SIGCONT)
            self.kill()


def worker(
    url: str,
    logs: Path,
    name: str,
    *extra: str,
    ttl: float = 2.0,
    ready: bool = True,
    env: dict[str, str] | None = None,
) -> Proc:
    """Start ``interlock worker --app APP --db URL --lease-ttl TTL --json --owner NAME EXTRA``
    and wait for its ready line."""
    proc = Proc(
        name,
        ["worker", "--app", APP, "--db", url, "--lease-ttl", f"{ttl:g}", "--owner", name,
         "--json", *extra],
        logs,
        env,
    )  # fmt: skip
    if ready:
        proc.wait_for_stderr(f"interlock worker {name}: ready")
    return proc


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """A list the test appends its processes to; whatever still runs at the end is killed."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


# -- a private PostgreSQL cluster -----------------------------------------------------


def _pg_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(candidates[-1]).parent if candidates else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """A PostgreSQL cluster of the test's own (initdb into a temporary directory, pg_ctl on
    a free port), so a test may restart it without touching anyone else's server. As root,
    the server runs as the ``postgres`` user (postgres refuses to run as root)."""

    def __init__(self) -> None:
        bindir = _pg_bin()
        if bindir is None:
            raise RuntimeError("no pg_ctl on PATH nor in /usr/lib/postgresql/*/bin")
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="interlock-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = _free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--no-sync")  # fmt: skip
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self.as_user, str(self.bindir / tool), *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{tool} {' '.join(args)} exited {done.returncode}: {done.stderr}{log}"
            )

    def start(self) -> None:
        # NOTE: synchronous_commit stays on: with it off, the server acknowledges a commit
        # before its WAL is written, and an immediate stop loses acknowledged batches (a
        # run's end the worker counted came back unfinished, and another worker finished
        # it again). fsync=off only risks what an OS crash would, not a server restart.
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                  "-t", "60", "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


# -- the audit ------------------------------------------------------------------------


def audit(url: str, *, runs: int | None = None) -> list[str]:
    """Every violation of the scenario's invariants in the journal ``url`` (a PostgreSQL URL
    with ``schema=S``) and the app's downstream tables beside it; ``[]`` when all hold.

    Checks: the journal holds ``runs`` runs (if given); each run is terminal in the runs
    index, its seqs run 1..N without a gap (and N is the index's seq), and it has exactly
    one terminal event, its last; no key of a tool that is not idempotent was executed
    twice, and no downstream table holds two rows of one such key; every committed call of
    a side-effecting tool is held by its downstream table exactly once; every downstream row
    has its intent in the journal; and no finished run's lease is still live.
    """
    problems: list[str] = []
    index = {
        run_id: (state, outcome, int(seq))
        for run_id, state, outcome, seq in query(
            url, "SELECT run_id, state, outcome, seq FROM runs"
        )
    }
    if runs is not None and len(index) != runs:
        problems.append(f"the journal holds {len(index)} runs, expected {runs}")
    for run_id, (state, outcome, seq) in sorted(index.items()):
        if outcome not in TERMINAL:
            problems.append(
                f"run {run_id} is not terminal: outcome {outcome}, state {state}, seq {seq}"
            )
    seqs: dict[str, list[int]] = defaultdict(list)
    kinds: dict[str, list[str]] = defaultdict(list)
    for run_id, seq, kind in query(
        url, "SELECT run_id, seq, kind FROM events ORDER BY run_id, seq"
    ):
        seqs[run_id].append(int(seq))
        kinds[run_id].append(kind)
    for run_id in sorted(set(index) | set(seqs)):
        got = seqs.get(run_id, [])
        if got != list(range(1, len(got) + 1)):
            missing = sorted(set(range(1, max(got, default=0) + 1)) - set(got))
            problems.append(f"run {run_id}: seqs not contiguous from 1: missing {missing[:10]}")
        if run_id in index and index[run_id][2] != max(got, default=0):
            problems.append(
                f"run {run_id}: the index says seq {index[run_id][2]}, the journal's last is "
                f"{max(got, default=0)}"
            )
        ends = [k for k in kinds.get(run_id, []) if k in TERMINAL_KINDS]
        if len(ends) != 1 or kinds[run_id][-1] not in TERMINAL_KINDS:
            problems.append(
                f"run {run_id}: finished {len(ends)} times ({', '.join(ends) or 'never'}); "
                f"last event {kinds[run_id][-1] if kinds.get(run_id) else 'none'}"
            )
    # Side effects, from the downstream tables themselves.
    executed = Counter()
    by: dict[tuple[str, str], list[str]] = defaultdict(list)
    for tool, key, pid, epoch in query(
        url, "SELECT tool, key, pid, epoch FROM executions ORDER BY id"
    ):
        executed[(tool, key)] += 1
        by[(tool, key)].append(f"pid {pid} epoch {epoch}")
    for (tool, key), count in sorted(executed.items()):
        if tool in ONCE_ONLY and count > 1:
            problems.append(
                f"duplicate side effect: {tool} key {key} executed {count} times (by "
                f"{', '.join(by[(tool, key)])})"
            )
    held: dict[str, Counter[str]] = {}
    for tool, table in EFFECT_TABLES.items():
        held[tool] = Counter(key for (key,) in query(url, f"SELECT key FROM {table}"))
        for key, count in sorted(held[tool].items()):
            if count > 1:
                problems.append(f"duplicate side effect: {table} holds {count} rows of key {key}")
    intents, committed = _calls(url, sorted(index))
    problems.extend(intents.pop("", []))  # runs that cannot be loaded
    for tool, keys in committed.items():
        for key in keys:
            if tool in held and held[tool][key] != 1:
                problems.append(
                    f"committed call {tool} key {key} is held {held[tool][key]} times by "
                    f"{EFFECT_TABLES[tool]}, not once"
                )
    for tool, keys in held.items():
        for key in sorted(set(keys) - set(intents.get(tool, ()))):
            problems.append(
                f"{EFFECT_TABLES[tool]} holds key {key}, for which no intent was journaled"
            )
    with contextlib.suppress(Exception):  # a journal without leases has nothing to check
        for (run_id,) in query(
            url, "SELECT l.run_id FROM leases l JOIN runs r USING (run_id) "
            "WHERE l.live AND r.outcome <> 'running' ORDER BY 1"
        ):  # fmt: skip
            problems.append(f"run {run_id} is finished but its lease is still live")
    return problems


def _calls(url: str, run_ids: list[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``(intents, committed)``: the keys journaled for each tool (intents under ``""``
    lists the runs that could not be loaded)."""
    from interlock.events import IntentRecorded, ToolCommitted
    from interlock.stores._open import open_store

    async def main() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        intents: dict[str, list[str]] = defaultdict(list)
        committed: dict[str, list[str]] = defaultdict(list)
        store = await open_store(url, readonly=True)
        try:
            for run_id in run_ids:
                try:
                    events = await store.load(run_id)
                except Exception as exc:
                    intents[""].append(f"run {run_id} cannot be loaded: {exc}")
                    continue
                for event in events:
                    if isinstance(event, IntentRecorded):
                        intents[event.tool].append(event.key)
                    elif isinstance(event, ToolCommitted):
                        committed[event.tool].append(event.key)
        finally:
            await store.aclose()
        return intents, committed

    return trio.run(main)


def outcomes(url: str) -> Counter[str]:
    return Counter(outcome for (outcome,) in query(url, "SELECT outcome FROM runs"))


def lease_owners(url: str) -> dict[str, str | None]:
    return dict(query(url, "SELECT run_id, owner FROM leases"))  # type: ignore[arg-type]


def replay_all(url: str) -> None:
    """``interlock replay --all`` as a process: exit 0, or fail with what it said."""
    from tests._cli import interlock

    done = interlock("replay", "--all", "--app", APP, "--db", url, cwd=ROOT)
    assert done.returncode == 0, (
        f"replay --all exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    assert " 0 diverged" in done.stdout, done.stdout


def drive_in_process(url: str, indices: Iterable[int]) -> None:
    """Start and finish runs ``order-NNNNNN`` in this process (a supervisor, no worker)."""
    from interlock import open_supervisor
    from interlock.stores._open import open_store

    module = _scaleout_app()

    async def main() -> None:
        store = await open_store(url)
        try:
            async with (
                module.app.open(url),
                open_supervisor(
                    list(module.app.machines.values()), store, provider=module.app.provider
                ) as sup,
            ):
                for i in indices:
                    await sup.start_run("order", module.make_inputs(i), run_id=f"order-{i:06d}")
        finally:
            await store.aclose()

    trio.run(main)


def events_journaled(url: str) -> int:
    """Events journaled so far (the runs index holds each run's last seq)."""
    import psycopg

    try:
        return int(query(url, "SELECT COALESCE(SUM(seq), 0) FROM runs")[0][0])
    except psycopg.Error:
        return 0


def held_by(url: str, owner: str) -> set[str]:
    """The unfinished runs whose lease ``owner`` holds now."""
    return {
        run_id
        for (run_id,) in query(url, "SELECT run_id FROM leases WHERE live AND owner = %s", (owner,))
    }


def check(url: str, runs: int) -> None:
    """The end of every scenario: the audit finds nothing, and every run replays."""
    problems = audit(url, runs=runs)
    assert not problems, f"{len(problems)} violations, e.g.:\n" + "\n".join(problems[:30])
    replay_all(url)


def open_transactions(url: str) -> set[str]:
    """The lock modes held on the journal's ``leases`` table by sessions idle in a
    transaction (a process stopped between two statements of one)."""
    _, schema = _scaleout_app().split_url(url)
    rows = query(
        url,
        "SELECT l.mode FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "JOIN pg_class c ON c.oid = l.relation JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE l.granted AND n.nspname = %s AND c.relname = 'leases' "
        "AND a.state LIKE 'idle in transaction%%' AND a.pid <> pg_backend_pid()",
        (schema,),
    )
    return {mode for (mode,) in rows}


def stop_at(proc: Proc, url: str, *, mid_transaction: bool, attempts: int = 300) -> None:
    """SIGSTOP ``proc`` (the only process writing ``url``) at a moment when it holds an open
    transaction on the leases (``mid_transaction``: e.g. between the fence and the insert
    of an append, its lease rows locked), or when it holds none. Stops and continues it
    until the moment comes."""
    for _ in range(attempts):
        proc.send(signal.SIGSTOP)
        time.sleep(0.05)  # the statement it was running ends; the session goes idle
        if bool(open_transactions(url)) == mid_transaction:
            return
        proc.send(signal.SIGCONT)
        time.sleep(0.005 * (_ % 7))
    raise AssertionError(
        f"{proc.name} was never stopped {'inside' if mid_transaction else 'outside'} a "
        f"transaction in {attempts} tries\n{proc.describe()}"
    )


def in_flight(url: str, state: str) -> int:
    """Calls made in ``state`` whose intent is journaled and whose outcome is not."""
    rows = query(
        url,
        "SELECT count(*) FROM events i WHERE i.kind = 'intent_recorded' AND i.key LIKE %s "
        "AND NOT EXISTS (SELECT 1 FROM events o WHERE o.run_id = i.run_id AND o.key = i.key "
        "AND o.kind <> 'intent_recorded')",
        (f"%:{state}:%",),
    )
    return int(rows[0][0])


def leases_of(url: str, owner: str, limit: int = 5) -> str:
    """The live leases ``owner`` holds, as rows to show in a failure."""
    rows = query(
        url,
        "SELECT l.run_id, l.epoch, l.expires < now() AS expired, r.state, r.seq FROM leases l "
        "JOIN runs r USING (run_id) WHERE l.live AND l.owner = %s ORDER BY 1",
        (owner,),
    )
    return f"{len(rows)} live leases of {owner} (run, epoch, expired, state, seq): {rows[:limit]}"


def lock_holders(url: str) -> str:
    """Who holds locks on the journal's leases table now (pid, state, mode, query), to show
    in a failure."""
    _, schema = _scaleout_app().split_url(url)
    rows = query(
        url,
        "SELECT a.pid, a.state, l.mode, l.granted, left(a.query, 80) FROM pg_locks l "
        "JOIN pg_stat_activity a USING (pid) JOIN pg_class c ON c.oid = l.relation "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
        "AND c.relname = 'leases' AND a.pid <> pg_backend_pid()",
        (schema,),
    )
    return f"sessions locking {schema}.leases: {rows}"


def check_summaries(procs: Iterable[Proc], runs: int) -> list[dict[str, Any]]:
    """The --json summaries of ``procs`` (every process that drove the runs, none killed)
    count every run's end once: their ``finished`` sum to ``runs``, each the sum of its
    outcomes."""
    procs = list(procs)
    summaries = [proc.summary() for proc in procs]
    for proc, s in zip(procs, summaries, strict=True):
        ends = s["completed"] + s["failed"] + s["escalated"]
        assert s["finished"] == ends, (
            f"{proc.name}: finished {s['finished']} != outcomes {ends}: {s}"
        )
    finished = sum(s["finished"] for s in summaries)
    assert finished == runs, (
        f"the workers say they finished {finished} runs, the journal holds {runs}: "
        + "; ".join(f"{p.name} {s}" for p, s in zip(procs, summaries, strict=True))
    )
    return summaries
