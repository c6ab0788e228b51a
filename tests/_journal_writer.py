"""The process the check tests kill, check while it writes, or fill the disk under
(tests/test_check.py): a small application of many runs writing one SQLite journal.

``python tests/_journal_writer.py JOURNAL [BATCHES [MAX_PAGES]]`` appends BATCHES batches
(0: until its stdin closes, or it is killed), then closes the store and prints ``done
EVENTS``. Each batch starts runs, moves every live run a step (some through an intent and
its commit), and ends some (completed or escalated), so index moves wait in the moves
table, are applied every few batches and are moved past by runs that end. After each
batch commits it prints ``batch N EVENTS`` (the events committed so far).

A full disk (a small file system, or MAX_PAGES, which caps the database file with ``PRAGMA
max_page_count``) fails an append: the writer then prints ``full EVENTS`` and goes on
running, as a server would, until its stdin closes (or a kill); then it closes the store
and exits 3.
"""

from __future__ import annotations

import sys
import zlib

import trio

from interlock import StoreError
from interlock.core._events import (
    Completed,
    Escalated,
    Event,
    IntentRecorded,
    RunStarted,
    ToolCommitted,
    Transitioned,
)
from interlock.stores import SQLiteStore, _sqlite, open_sqlite_store

#: Applied every few batches, not every 256: a crash finds moves pending, applied, and
#: moved past (a run that ended) at every point of the cycle.
_sqlite.INDEX_LAG_BATCHES = 5
_sqlite.INDEX_LAG_SECONDS = float("inf")

STARTED_PER_BATCH = 12
#: Seconds between two batches, so that a check while it writes reads a journal of
#: hundreds of batches, not tens of thousands.
PAUSE = 0.005


def length(run_id: str) -> int:
    """The steps a run takes before it ends (4 to 15)."""
    return 4 + zlib.crc32(run_id.encode()) % 12


def events_of(run_id: str, seq: int, ts: float) -> list[Event]:
    """The run's events of one batch, from ``seq`` on (a step, or its end)."""
    if seq == 1:
        return [RunStarted(run_id=run_id, seq=1, ts=ts, machine="writer", state="A")]
    if seq >= length(run_id):
        if zlib.crc32(run_id.encode()) % 5 == 0:
            return [Escalated(run_id=run_id, seq=seq, ts=ts, state="A", reason="r", detail="d")]
        return [Completed(run_id=run_id, seq=seq, ts=ts, state="A", output=seq)]
    move = Transitioned(run_id=run_id, seq=seq, ts=ts, src="A", dst="A", delta={"n": seq})
    if seq % 4:
        return [move]
    key = f"{run_id}:A:{seq}"
    return [
        IntentRecorded(run_id=run_id, seq=seq, ts=ts, state="A", tool="t", args={}, key=key),
        ToolCommitted(run_id=run_id, seq=seq + 1, ts=ts, tool="t", key=key, result=seq),
        Transitioned(run_id=run_id, seq=seq + 2, ts=ts, src="A", dst="A", delta={"n": seq}),
    ]


async def main(path: str, batches: int, max_pages: int) -> int:
    store = await open_sqlite_store(path)
    assert isinstance(store, SQLiteStore)
    if max_pages:
        await store._call("cap", lambda conn: conn.execute(f"PRAGMA max_page_count = {max_pages}"))
    stopped = trio.Event()

    async def stop_at_eof() -> None:
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        stopped.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_at_eof)
            committed, full = await write(store, batches, stopped)
            if full:
                # as an application that goes on after a failed write (a server, say)
                print(f"full {committed}", flush=True)
                await stopped.wait()
            nursery.cancel_scope.cancel()
    finally:
        await store.aclose()
    if full:
        return 3
    print(f"done {committed}", flush=True)
    return 0


async def write(store: SQLiteStore, batches: int, stopped: trio.Event) -> tuple[int, bool]:
    """Append the batches; return the events committed, and whether the disk filled up."""
    live: dict[str, int] = {}  # run id -> its next seq
    committed = 0
    number = 0
    while not stopped.is_set() and (not batches or number < batches):
        number += 1
        for at in range(STARTED_PER_BATCH):
            live[f"w-{number:05d}-{at:02d}"] = 1
        batch: list[Event] = []
        for run_id, seq in list(live.items()):
            events = events_of(run_id, seq, float(number))
            batch += events
            if isinstance(events[-1], Completed | Escalated):
                del live[run_id]
            else:
                live[run_id] = events[-1].seq + 1
        try:
            await store.append(batch)
        except StoreError as exc:
            if "disk is full" not in str(exc):
                raise
            return committed, True
        committed += len(batch)
        print(f"batch {number} {committed}", flush=True)
        await trio.sleep(PAUSE)
    return committed, False


if __name__ == "__main__":
    path, batches, max_pages = [*sys.argv[1:], "0", "0"][:3]
    sys.exit(trio.run(main, path, int(batches), int(max_pages)))
