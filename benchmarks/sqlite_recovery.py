"""Finding the unfinished runs of a SQLite journal: the whole runs index against its own index.

What ``interlock resume`` (``Supervisor.resume_unfinished``) does first: ask the store for
the unfinished runs, then load each one's journal to fold it. Before schema version 4 the
store read (and checked) every row of the runs index to answer, so the time grew with the
whole journal; now it reads a partial index of the running rows (``runs_unfinished``)
and checks their number against a count kept beside it.

Measured, in one run, on two journals each holding 3,000 unfinished runs, among 3,000
and 30,000 runs in all (the others completed), built here through the store's own
``append`` in batches of 1,000 runs:

- *find*: ``unfinished()`` through the index (after), against ``Store.unfinished`` of the
  base class, which is ``list_runs(outcome=RUNNING)`` over every row (before: what
  version 3 did, and what a version 3 file opened read-only still does);
- *find + load*: the same, then ``load()`` of every run found (what resume reads before it
  resumes anything);
- what else ``interlock resume`` reads, which this index does not change: the summary it
  prints at the end (``_demo.summarize_store``) lists and loads every run of the journal;
- the cost of the index on the group commit: events/s appending the 30,000-run journal
  with the index, against the same journal into a file whose index was dropped (the
  median of ``REPEATS`` builds of each, in turn).

Each figure is the median of ``REPEATS`` tries, before and after taken in turn, on a
store opened read-only (the OS page cache is warm: this is the CPU and SQLite's work,
not the disk's).

Run it: ``python -m benchmarks.sqlite_recovery [--quick]``; it prints a Markdown table.
"""

from __future__ import annotations

import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from interlock.core._events import Completed, Event, RunStarted, Transitioned
from interlock.stores import Store, open_sqlite_store

UNFINISHED = 3_000
TOTALS = (3_000, 30_000)
REPEATS = 5
RUNS_PER_BATCH = 1_000


def run_events(index: int, finished: bool) -> list[Event]:
    """One run's events: started, one step, and completed unless it is left unfinished."""
    run_id = f"run-{index:06d}"
    ts = 1_000_000.0 + index
    events: list[Event] = [
        RunStarted(
            run_id=run_id, seq=1, ts=ts, machine="refund", state="TRIAGE", inputs={"order": index}
        ),
        Transitioned(run_id=run_id, seq=2, ts=ts, src="TRIAGE", dst="PAY", delta={"n": index}),
    ]
    if finished:
        events.append(Completed(run_id=run_id, seq=3, ts=ts, state="PAY", output={"ok": True}))
    return events


async def build(path: Path, total: int, unfinished: int, *, index: bool = True) -> float:
    """Write a journal of ``total`` runs, ``unfinished`` of them left running (spread
    evenly); return the group commit's events/s."""
    if not index:
        async with await open_sqlite_store(path):
            pass
        with sqlite3.connect(path) as conn:
            conn.execute("DROP INDEX runs_unfinished")
    every = total // unfinished
    written = 0
    elapsed = 0.0
    async with await open_sqlite_store(path) as store:
        for first in range(0, total, RUNS_PER_BATCH):
            batch = [
                event
                for i in range(first, min(total, first + RUNS_PER_BATCH))
                for event in run_events(i, finished=i % every != 0)
            ]
            started = time.perf_counter()
            await store.append(batch)
            elapsed += time.perf_counter() - started
            written += len(batch)
    return written / elapsed


async def _timed(path: Path, *, indexed: bool, load: bool) -> tuple[float, int]:
    async with await open_sqlite_store(path, readonly=True) as store:
        started = time.perf_counter()
        found = await (store.unfinished() if indexed else Store.unfinished(store))
        if load:
            for record in found:
                await store.load(record.run_id)
        return time.perf_counter() - started, len(found)


async def _summary(path: Path) -> float:
    from interlock.demo._run import summarize_store

    async with await open_sqlite_store(path, readonly=True) as store:
        started = time.perf_counter()
        await summarize_store(store, ["refund"])
        return time.perf_counter() - started


async def measure(path: Path, repeats: int) -> dict[str, Any]:
    """Median seconds of find and find + load, before and after, tried in turn."""
    times: dict[tuple[bool, bool], list[float]] = {}
    counts: set[int] = set()
    for _ in range(repeats):
        for load in (False, True):
            for indexed in (False, True):
                seconds, found = await _timed(path, indexed=indexed, load=load)
                times.setdefault((indexed, load), []).append(seconds)
                counts.add(found)
    assert len(counts) == 1, f"before and after found different runs: {counts}"
    median = {key: statistics.median(values) for key, values in times.items()}
    summary = statistics.median([await _summary(path) for _ in range(max(1, repeats // 2))])
    return {"found": counts.pop(), "median": median, "summary": summary}


async def main_async(quick: bool) -> list[dict[str, Any]]:
    unfinished = 300 if quick else UNFINISHED
    totals = tuple(t // 10 for t in TOTALS) if quick else TOTALS
    repeats = 3 if quick else REPEATS
    rows = []
    with tempfile.TemporaryDirectory(prefix="interlock-recovery-") as directory:
        for total in totals:
            path = Path(directory) / f"journal-{total}.db"
            await build(path, total, unfinished)
            result = await measure(path, repeats)
            size = (await trio.Path(path).stat()).st_size  # closed: WAL checkpointed in
            rows.append({"total": total, "bytes": size, **result})
        rates: dict[bool, list[float]] = {True: [], False: []}
        for attempt in range(repeats):
            for index in (False, True):
                path = Path(directory) / f"append-{attempt}-{index}.db"
                rates[index].append(await build(path, totals[-1], unfinished, index=index))
                await trio.Path(path).unlink()
        rows.append(
            {
                "total": totals[-1],
                "append": statistics.median(rates[True]),
                "append_unindexed": statistics.median(rates[False]),
            }
        )
    return rows


def render(rows: list[dict[str, Any]], quick: bool) -> str:
    journals = [row for row in rows if "median" in row]
    lines = [
        "| runs in the journal | unfinished | file MB | find: before ms | find: after ms | "
        "find: ratio | find + load: before ms | find + load: after ms | find + load: ratio | "
        "resume's summary (every run) ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in journals:
        m = row["median"]
        find_before, find_after = m[(False, False)], m[(True, False)]
        load_before, load_after = m[(False, True)], m[(True, True)]
        lines.append(
            f"| {row['total']:,} | {row['found']:,} | {row['bytes'] / 1e6:.1f} | "
            f"{find_before * 1e3:,.1f} | {find_after * 1e3:,.1f} | "
            f"{find_before / find_after:.1f}x | {load_before * 1e3:,.1f} | "
            f"{load_after * 1e3:,.1f} | {load_before / load_after:.2f}x | "
            f"{row['summary'] * 1e3:,.0f} |"
        )
    small, large = journals[0]["median"], journals[-1]["median"]
    lines += [
        "",
        f"Growth from {journals[0]['total']:,} to {journals[-1]['total']:,} runs (same "
        f"{journals[0]['found']:,} unfinished): find before {large[(False, False)] / small[(False, False)]:.1f}x, "
        f"after {large[(True, False)] / small[(True, False)]:.1f}x; find + load before "
        f"{large[(False, True)] / small[(False, True)]:.2f}x, after "
        f"{large[(True, True)] / small[(True, True)]:.2f}x.",
        "",
        f"Group commit of the {journals[-1]['total']:,}-run journal (batches of "
        f"{RUNS_PER_BATCH:,} runs, 2-3 events each): {rows[-1]['append']:,.0f} events/s "
        f"with the index, {rows[-1]['append_unindexed']:,.0f} events/s with it dropped.",
    ]
    if quick:
        lines.append("\n(--quick: a tenth of the runs; not the figures to quote)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    started = time.perf_counter()
    rows = trio.run(main_async, quick)
    print(render(rows, quick))
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
