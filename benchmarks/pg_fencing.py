"""What fencing costs the PostgreSQL group commit: ``append`` against ``append_fenced``.

Both write the same kind of batch through the same store (binary ``COPY`` of the events,
one ``unnest`` upsert of the runs index); ``append_fenced`` also locks the batch's lease
rows (``SELECT ... FOR NO KEY UPDATE``, one statement per batch) and keeps them locked until the
commit. Measured, in one run and one fresh schema, at batch sizes 100, 1,000 and 10,000
events (each batch: a tenth as many runs, ten events each, as a worker's batch carries
several steps of many runs):

- the two modes take turns batch by batch (which goes first alternates), each on its own
  runs, so drift of the shared host hits both alike;
- events/s over all of a mode's batches (wall time of the ``await``, encoding included),
  and the median batch's milliseconds;
- the ratio fenced / plain, the figure to read (absolute figures vary with the load):
  of the events/s, and the median over rounds of the two batches' speed ratio within a
  round (the steadier one on a loaded host).

Then what recovery reads: ``unfinished()`` and claiming every unfinished run, with 3,000
unfinished runs in a journal of 3,000 and of 39,000 runs (the issue's two journals): both
go through partial indexes of the unfinished runs, so neither should grow with the
finished ones.

Run it: ``python -m benchmarks.pg_fencing [--quick]`` (INTERLOCK_PG_DSN, or the CI's
``postgresql://postgres@127.0.0.1:5432/test``); it prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time

import psycopg
import trio
from psycopg import sql

from interlock.core._events import Completed, Event, RunStarted, Transitioned
from interlock.stores import PostgresStore, open_postgres_store

DSN = os.environ.get("INTERLOCK_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SIZES = (100, 1_000, 10_000)
EVENTS_PER_RUN = 10
OWNER = "bench-worker"


class Mode:
    """One side of the comparison: its runs, their seqs, its batch times."""

    def __init__(self, name: str, prefix: str, runs: int, per_run: int = EVENTS_PER_RUN) -> None:
        self.name = name
        self.per_run = per_run
        self.run_ids = [f"{prefix}-{i:05d}" for i in range(runs)]
        self.seq = dict.fromkeys(self.run_ids, 1)
        self.fence: dict[str, int] = {}
        self.times: list[float] = []

    def batch(self) -> list[Event]:
        events: list[Event] = []
        for run_id in self.run_ids:
            seq = self.seq[run_id]
            for n in range(1, self.per_run + 1):
                events.append(
                    Transitioned(
                        run_id=run_id,
                        seq=seq + n,
                        ts=1.0,
                        src="WORK",
                        dst="WORK",
                        delta={"step": seq + n, "note": "x" * 40},
                    )
                )
            self.seq[run_id] = seq + self.per_run
        return events


async def measure(
    store: PostgresStore, size: int, events_per_mode: int, max_rounds: int | None = None
) -> dict[str, Mode]:
    """Both modes in turns on batches of ``size`` events (a batch under ten events is one
    run's), ``events_per_mode`` events each (at least 20 batches, at most ``max_rounds``)."""
    runs = max(1, size // EVENTS_PER_RUN)
    tag = f"b{size}"
    plain = Mode("append", f"{tag}-plain", runs, size // runs)
    fenced = Mode("append_fenced", f"{tag}-fenced", runs, size // runs)
    started = [
        RunStarted(run_id=run_id, seq=1, ts=1.0, machine="bench", state="WORK")
        for run_id in plain.run_ids
    ]
    await store.append(started)
    # The fenced runs are created by the worker itself: it holds them at epoch 1.
    started = [
        RunStarted(run_id=run_id, seq=1, ts=1.0, machine="bench", state="WORK")
        for run_id in fenced.run_ids
    ]
    assert await store.append_fenced(started, {}, OWNER, ttl=3600.0) == frozenset()
    fenced.fence = dict.fromkeys(fenced.run_ids, 1)
    rounds = max(20, events_per_mode // size)
    if max_rounds is not None:
        rounds = min(rounds, max_rounds)
    for n in range(rounds):
        for mode in (plain, fenced) if n % 2 == 0 else (fenced, plain):
            events = mode.batch()
            begin = time.perf_counter()
            if mode is plain:
                await store.append(events)
            else:
                refused = await store.append_fenced(events, mode.fence, OWNER)
                assert not refused, f"the benchmark's own leases were refused: {sorted(refused)}"
            mode.times.append(time.perf_counter() - begin)
    return {"plain": plain, "fenced": fenced}


def compare(size: int, modes: dict[str, Mode]) -> dict[str, float]:
    """One row of the comparison: batches, events/s and median ms of each mode, the ratios."""
    plain, fenced = modes["plain"], modes["fenced"]
    rates = {mode.name: size * len(mode.times) / sum(mode.times) for mode in (plain, fenced)}
    return {
        "batch": size,
        "batches": len(plain.times),
        "append_events_per_s": rates["append"],
        "fenced_events_per_s": rates["append_fenced"],
        "append_median_ms": statistics.median(plain.times) * 1000,
        "fenced_median_ms": statistics.median(fenced.times) * 1000,
        "ratio": rates["append_fenced"] / rates["append"],
        "paired_ratio": statistics.median(
            p / f for p, f in zip(plain.times, fenced.times, strict=True)
        ),
    }


async def recovery(finished: int, unfinished: int = 3_000) -> tuple[float, float, float]:
    """Median seconds of ``unfinished()``, of ``list_runs(outcome="running")`` (what
    ``unfinished()`` was: every row read and checked) and of claiming every unfinished run
    (batches of 100), in a fresh schema of ``unfinished`` running runs and ``finished``
    ended ones."""
    schema = f"interlock_bench_{secrets.token_hex(4)}"
    store = await open_postgres_store(DSN, schema=schema)
    try:
        for at in range(0, finished, 5_000):
            events: list[Event] = []
            for i in range(at, min(at + 5_000, finished)):
                run_id = f"done-{i:06d}"
                events.append(
                    RunStarted(run_id=run_id, seq=1, ts=1.0, machine="bench", state="WORK")
                )
                events.append(Completed(run_id=run_id, seq=2, ts=2.0, state="DONE"))
            await store.append(events)
        await store.append(
            [
                RunStarted(run_id=f"open-{i:05d}", seq=1, ts=3.0, machine="bench", state="WORK")
                for i in range(unfinished)
            ]
        )
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("ANALYZE {}.runs").format(sql.Identifier(schema)))
            conn.execute(sql.SQL("ANALYZE {}.leases").format(sql.Identifier(schema)))
        reads = []
        for _ in range(5):
            begin = time.perf_counter()
            assert len(await store.unfinished()) == unfinished
            reads.append(time.perf_counter() - begin)
        scans = []
        for _ in range(5):
            begin = time.perf_counter()
            assert len(await store.list_runs(outcome="running")) == unfinished
            scans.append(time.perf_counter() - begin)
        claims = []
        for n in range(3):
            begin = time.perf_counter()
            taken = 0
            while leases := await store.claim(f"bench-{n}", limit=100, ttl=3600.0):
                taken += len(leases)
            claims.append(time.perf_counter() - begin)
            assert taken == unfinished
            with psycopg.connect(DSN, autocommit=True) as conn:  # all claimable again
                conn.execute(
                    sql.SQL("UPDATE {}.leases SET expires = '-infinity'").format(
                        sql.Identifier(schema)
                    )
                )
        return statistics.median(reads), statistics.median(scans), statistics.median(claims)
    finally:
        await store.aclose()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.2f}"


async def main(quick: bool) -> None:
    schema = f"interlock_bench_{secrets.token_hex(4)}"
    events_per_mode = 10_000 if quick else 100_000
    rows = []
    store = await open_postgres_store(DSN, schema=schema)
    try:
        for size in SIZES:
            compared = compare(size, await measure(store, size, events_per_mode))
            rows.append(tuple(compared.values()))
    finally:
        await store.aclose()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    print(
        "| batch (events) | batches per mode | append events/s | append_fenced events/s "
        "| append median ms | append_fenced median ms | fenced / plain (events/s) "
        "| fenced / plain (median of paired batches) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, batches, plain_rate, fenced_rate, plain_ms, fenced_ms, ratio, paired in rows:
        print(
            f"| {size:,} | {batches:,} | {_fmt(plain_rate)} | {_fmt(fenced_rate)} "
            f"| {_fmt(plain_ms)} | {_fmt(fenced_ms)} | {ratio:.2f} | {paired:.2f} |"
        )

    print()
    print(
        "| runs in the journal | of them unfinished | unfinished() ms (median of 5) "
        "| every row read: list_runs(outcome='running') ms (median of 5) "
        "| claim them all, 100 a claim, ms (median of 3) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for finished in (0, 36_000):
        read, scan, claim = await recovery(finished)
        print(
            f"| {finished + 3_000:,} | 3,000 | {_fmt(read * 1000)} | {_fmt(scan * 1000)} "
            f"| {_fmt(claim * 1000)} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10,000 events per mode and size")
    args = parser.parse_args(sys.argv[1:])
    trio.run(main, args.quick)
