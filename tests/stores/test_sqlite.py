"""What only the SQLite store does: a file that survives, pragmas, refusing foreign files."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import trio

from interlock.core._events import Completed, Event, IntentRecorded, RunStarted, Transitioned
from interlock.core._exceptions import JournalCorrupt, RunNotFound, StoreError
from interlock.stores import (
    CheckProblem,
    CheckReport,
    IndexDamaged,
    MemoryStore,
    SQLiteStore,
    Store,
    open_sqlite_store,
    open_store,
)
from interlock.stores import _sqlite as sqlite_store_module
from interlock.stores._base import COMPLETED, encode_rows, index_updates
from tests.stores._old_schemas import as_version_4
from tests.stores.conftest import index_row


def run_events(run_id: str, ts: float) -> list[Event]:
    return [
        RunStarted(run_id=run_id, seq=1, ts=ts, machine="refund", state="A", inputs={"n": ts}),
        Transitioned(run_id=run_id, seq=2, ts=ts + 1, src="A", dst="B"),
        Transitioned(run_id=run_id, seq=3, ts=ts + 2, src="B", dst="C", delta={"x": 1}),
        Transitioned(run_id=run_id, seq=4, ts=ts + 3, src="C", dst="DONE"),
        Completed(run_id=run_id, seq=5, ts=ts + 4, state="DONE", output=run_id),
    ]


def raw_sql(
    path: Path, statement: str, params: tuple[object, ...] = ()
) -> list[tuple[object, ...]]:
    """Run one statement on the file with a plain sqlite3 connection, bypassing the store."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        return conn.execute(statement, params).fetchall()


def frame_ends(body: bytes) -> list[int]:
    """The offset just past each frame of a chunk: ``[length u32][~length u32][crc u32][payload]``."""
    ends: list[int] = []
    end = 0
    while end < len(body):
        end += 12 + int.from_bytes(body[end : end + 4], "little")
        ends.append(end)
    return ends


def chunk(path: Path, run_id: str, seq: int) -> tuple[int, bytes]:
    """The ``(first_seq, body)`` of the stored chunk that holds ``seq`` of ``run_id``."""
    [(first, body)] = raw_sql(
        path,
        "SELECT first_seq, body FROM chunks WHERE run_id = ? AND first_seq <= ? AND last_seq >= ?",
        (run_id, seq, seq),
    )
    assert isinstance(first, int)
    assert isinstance(body, bytes)
    return first, body


def set_chunk(path: Path, run_id: str, first: int, body: bytes) -> None:
    raw_sql(
        path, "UPDATE chunks SET body = ? WHERE run_id = ? AND first_seq = ?", (body, run_id, first)
    )


async def test_journal_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    events = run_events("r-1", 1.0)
    async with await open_sqlite_store(path) as store:
        await store.append(events[:3])
        await store.append(events[3:])
    async with await open_sqlite_store(path) as store:
        assert await store.load("r-1") == events
        assert (await store.get_run("r-1")).outcome == COMPLETED
        # Appending continues where the journal left off.
        await store.append(run_events("r-2", 9.0))
    async with await open_sqlite_store(path, readonly=True) as store:
        assert [r.run_id for r in await store.list_runs()] == ["r-1", "r-2"]


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL", "full"])
async def test_pragmas_are_in_effect(tmp_path: Path, synchronous: str) -> None:
    async with await open_sqlite_store(tmp_path / "j.db", synchronous=synchronous) as store:
        assert isinstance(store, SQLiteStore)
        assert store.synchronous == synchronous.upper()
        assert await store.pragmas() == {
            "journal_mode": "wal",
            "synchronous": synchronous.upper(),
            "foreign_keys": True,
            "busy_timeout": 5000,
            "schema_version": 6,
        }
    # WAL is a property of the file, so another connection sees it too.
    assert raw_sql(tmp_path / "j.db", "PRAGMA journal_mode") == [("wal",)]


async def test_synchronous_must_be_normal_or_full(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^synchronous must be 'NORMAL' or 'FULL'; got 'OFF'$"):
        await open_sqlite_store(tmp_path / "j.db", synchronous="OFF")
    assert not (tmp_path / "j.db").exists()


async def test_schema_is_created_and_versioned(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path):
        pass
    assert raw_sql(path, "SELECT value FROM meta WHERE name = 'schema_version'") == [("6",)]
    tables = {
        row[0] for row in raw_sql(path, "SELECT name FROM sqlite_master WHERE type = 'table'")
    }
    # moves: the index rows moved and not yet applied (version 6); sqlite_sequence keeps
    # its ids growing
    assert tables == {"meta", "chunks", "intents", "runs", "moves", "sqlite_sequence"}
    # Listing reads (and checks) every row of the runs index: no index on it would serve;
    # the one index is of the unfinished runs, which resume reads (test_sqlite_single_writer).
    assert raw_sql(path, "SELECT name FROM sqlite_master WHERE tbl_name = 'runs'") == [
        ("runs",),
        ("runs_unfinished",),
    ]
    assert [row[1] for row in raw_sql(path, "PRAGMA table_info(runs)")][-2:] == ["crc", "chunk"]
    # Chunks are found by id alone (a run's first one also by run): appends go to the end.
    assert raw_sql(path, "SELECT name FROM sqlite_master WHERE tbl_name = 'chunks'") == [
        ("chunks",),
        ("chunks_first",),
    ]
    assert raw_sql(path, "PRAGMA page_size") == [(8192,)]


async def test_one_chunk_per_run_per_batch(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    one, two = run_events("r-1", 1.0), run_events("r-2", 2.0)
    async with await open_sqlite_store(path) as store:
        # Interleaved runs: each run's events of a batch still make one row.
        await store.append([one[0], two[0], one[1], two[1], one[2]])
        await store.append([two[2], one[3], one[4], two[3], two[4]])
        assert store.bytes_written == sum(len(row[5]) for row in encode_rows(one + two))
        assert await store.load("r-1") == one
        assert await store.load("r-2") == two
    assert raw_sql(path, "SELECT run_id, first_seq, last_seq FROM chunks ORDER BY rowid") == [
        ("r-1", 1, 3),
        ("r-2", 1, 2),
        ("r-2", 3, 5),
        ("r-1", 4, 5),
    ]


async def test_intent_keys_are_unique_in_the_database(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    intent = IntentRecorded(
        run_id="r-1", seq=2, ts=2.0, state="A", tool="pay", args={"n": 1}, key="r-1:A:2"
    )
    async with await open_sqlite_store(path) as store:
        await store.append([run_events("r-1", 1.0)[0], intent])
    assert raw_sql(path, "SELECT key, run_id, seq FROM intents") == [("r-1:A:2", "r-1", 2)]
    with pytest.raises(sqlite3.IntegrityError, match=r"UNIQUE constraint failed: intents\.key"):
        raw_sql(path, "INSERT INTO intents VALUES ('r-1:A:2', 'r-2', 2)")


async def test_corrupt_body_is_reported_with_run_and_seq(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run_events("r-1", 1.0))
    first, body = chunk(path, "r-1", 3)
    flipped = bytearray(body)
    flipped[frame_ends(body)[3 - first] - 1] ^= 0x01
    set_chunk(path, "r-1", first, bytes(flipped))
    async with await open_sqlite_store(path) as store:
        with pytest.raises(
            JournalCorrupt,
            match=r"^journal of run 'r-1' is corrupt \(checksum mismatch\) at seq 3; ",
        ):
            await store.load("r-1")


async def test_torn_body_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run_events("r-1", 1.0))
    first, body = chunk(path, "r-1", 2)
    # Cut inside the header of seq 2's frame.
    set_chunk(path, "r-1", first, body[: frame_ends(body)[0] + 10])
    async with await open_sqlite_store(path) as store:
        with pytest.raises(
            JournalCorrupt, match=r"^journal of run 'r-1' is torn \(cut short\) at seq 2; "
        ):
            await store.load("r-1")


@pytest.mark.parametrize("cut", ["inside the frame", "at a frame boundary"])
async def test_chunk_with_a_torn_tail_reports_the_seq(tmp_path: Path, cut: str) -> None:
    path = tmp_path / "j.db"
    events = run_events("r-1", 1.0)
    async with await open_sqlite_store(path) as store:
        await store.append(events[:2])
        await store.append(events[2:])  # the chunk of seqs 3..5
    first, body = chunk(path, "r-1", 5)
    assert first == 3
    ends = frame_ends(body)
    # Seq 5's frame loses its last bytes, or goes entirely: both are a tail cut short.
    set_chunk(
        path, "r-1", first, body[: ends[2] - 7] if cut == "inside the frame" else body[: ends[1]]
    )
    async with await open_sqlite_store(path) as store:
        with pytest.raises(
            JournalCorrupt,
            match=r"^journal of run 'r-1' is torn \(cut short\) at seq 5; the store was written "
            r"outside interlock or a write was cut short; restore it from a backup$",
        ):
            await store.load("r-1")


async def test_missing_chunk_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    events = run_events("r-1", 1.0)
    async with await open_sqlite_store(path) as store:
        for event in events:
            await store.append([event])
    raw_sql(path, "DELETE FROM chunks WHERE run_id = 'r-1' AND first_seq = 3")
    async with await open_sqlite_store(path) as store:
        with pytest.raises(
            JournalCorrupt,
            match=r"^journal of run 'r-1' is missing or repeating events: seq 4 follows seq 2; ",
        ):
            await store.load("r-1")


async def test_chunk_with_extra_or_misplaced_frames_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run_events("r-1", 1.0))
        await store.append(run_events("r-2", 1.0))
    _first, body = chunk(path, "r-1", 1)
    _first, other = chunk(path, "r-2", 1)
    set_chunk(path, "r-1", 1, body + other[: frame_ends(other)[0]])
    async with await open_sqlite_store(path) as store:
        with pytest.raises(JournalCorrupt, match=r"^journal of run 'r-1' holds more events than"):
            await store.load("r-1")
    set_chunk(path, "r-1", 1, other)
    async with await open_sqlite_store(path) as store:
        with pytest.raises(
            JournalCorrupt,
            match=r"^journal of run 'r-1' holds an event of run 'r-2' seq 1 where seq 1 belongs$",
        ):
            await store.load("r-1")


async def test_wal_is_checkpointed_and_the_thread_ends_on_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "j.db"
    name = f"interlock checkpoint of {path}"
    # The writer never checkpoints itself here, so only the thread can.
    monkeypatch.setattr(sqlite_store_module, "AUTOCHECKPOINT_BYTES", 1 << 40)
    # 300 runs of about 40 kB: the checkpoint thread is due every 4 MiB.
    journals = {
        run_id: [
            msgspec.structs.replace(e, inputs={"pad": "x" * 40_000})
            if isinstance(e, RunStarted)
            else e
            for e in run_events(run_id, float(i))
        ]
        for i, run_id in enumerate(f"r-{i:03d}" for i in range(300))
    }

    def checkpoint_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == name]

    def database_file_grows() -> None:
        # In WAL mode only a checkpoint writes the database file. The thread checkpoints
        # on its own time, so this polls for what it wrote; the timeout bounds a hang.
        give_up = time.monotonic() + 60
        while path.stat().st_size <= 4 * 1024 * 1024:
            assert time.monotonic() < give_up, "the checkpoint thread never wrote the file"
            time.sleep(0.01)

    async with await open_sqlite_store(path, synchronous="FULL") as store:
        assert checkpoint_threads() == [name]
        for events in journals.values():
            await store.append(events)
        await trio.to_thread.run_sync(database_file_grows)
    assert checkpoint_threads() == []
    # The last connection to close checkpoints everything and removes the WAL.
    assert not (tmp_path / "j.db-wal").exists()
    async with await open_sqlite_store(path, readonly=True) as store:
        assert checkpoint_threads() == []
        for run_id, events in journals.items():
            assert await store.load(run_id) == events


def _drop(held: list[object]) -> None:
    """Drop the last reference to what ``held`` holds, and collect."""
    held.clear()
    gc.collect()


async def test_store_dropped_without_close_ends_its_thread(tmp_path: Path) -> None:
    store = await open_sqlite_store(tmp_path / "j.db")
    name = f"interlock checkpoint of {tmp_path / 'j.db'}"
    thread = next(t for t in threading.enumerate() if t.name == name)
    held = [store]
    del store
    with pytest.warns(ResourceWarning, match=r"SQLite store .*j\.db was not closed"):
        _drop(held)
    await trio.to_thread.run_sync(thread.join, 60.0)  # a bound for a hang, not a speed check
    assert not thread.is_alive()
    # Its connection was closed then and there: nothing holds the file's write lock.
    with contextlib.closing(sqlite3.connect(tmp_path / "j.db", timeout=0)) as conn, conn:
        conn.execute("BEGIN IMMEDIATE")


async def test_random_bytes_file_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    content = os.urandom(4096)
    path.write_bytes(content)
    with pytest.raises(StoreError) as info:
        await open_sqlite_store(path)
    assert str(info.value) == (
        f"{path}: not an interlock database (file is not a database); "
        "pass a new path or restore the file"
    )
    assert path.read_bytes() == content
    assert sorted(os.listdir(tmp_path)) == ["junk.db"]


async def test_text_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("interlock notes\nnot a database\n")
    with pytest.raises(
        StoreError, match=r"notes\.txt: not an interlock database \(file is not a database\)"
    ):
        await open_sqlite_store(path)
    assert path.read_text() == "interlock notes\nnot a database\n"


async def test_foreign_sqlite_database_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    raw_sql(path, "CREATE TABLE customers (id INTEGER PRIMARY KEY)")
    content = path.read_bytes()
    with pytest.raises(
        StoreError, match=r"other\.db: not an interlock database \(it holds other tables\)"
    ):
        await open_sqlite_store(path)
    assert path.read_bytes() == content
    assert raw_sql(path, "PRAGMA journal_mode") == [("delete",)]


async def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path):
        pass
    raw_sql(path, "UPDATE meta SET value = '99' WHERE name = 'schema_version'")
    with pytest.raises(
        StoreError,
        match=r"j\.db: database schema version 99 is newer than this interlock supports \(6\); "
        r"upgrade interlock to open it$",
    ):
        await open_sqlite_store(path)


async def test_directory_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r": is a directory; pass the path of a database file$"):
        await open_sqlite_store(tmp_path)


async def test_missing_parent_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "j.db"
    with pytest.raises(
        StoreError,
        match=rf"^{re.escape(str(path))}: directory {re.escape(str(tmp_path / 'missing'))} "
        r"does not exist; create it or pass another path$",
    ):
        await open_sqlite_store(path)
    assert not (tmp_path / "missing").exists()


async def test_readonly_open_of_a_missing_path_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "typo.db"
    with pytest.raises(StoreError, match=rf"^database {re.escape(str(path))} does not exist$"):
        await open_sqlite_store(path, readonly=True)
    with pytest.raises(StoreError, match=rf"^database {re.escape(str(path))} does not exist$"):
        await open_store(str(path), readonly=True)
    assert os.listdir(tmp_path) == []


async def test_readonly_store_refuses_appends(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run_events("r-1", 1.0))
    async with await open_sqlite_store(path, readonly=True) as store:
        assert len(await store.load("r-1")) == 5
        with pytest.raises(
            StoreError, match=r"is read-only; open it without readonly=True to append$"
        ):
            await store.append(run_events("r-2", 2.0))


async def test_open_store_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(await open_store(None), MemoryStore)
    assert isinstance(await open_store(":memory:"), MemoryStore)
    async with await open_store(f"sqlite:///{tmp_path}/a.db") as store:
        assert isinstance(store, SQLiteStore)
        assert store.path == f"{tmp_path}/a.db"
    async with await open_store(str(tmp_path / "b.db")) as store:
        assert isinstance(store, SQLiteStore)
    assert set(os.listdir(tmp_path)) >= {"a.db", "b.db"}


async def test_thousand_runs_in_batches_of_500(tmp_path: Path) -> None:
    journals = {f"run-{i:04d}": run_events(f"run-{i:04d}", float(i)) for i in range(1000)}
    # Step-major order, so most runs continue in a later batch than the one they started in.
    order = [events[step] for step in range(5) for events in journals.values()]
    async with await open_sqlite_store(tmp_path / "j.db") as store:
        for start in range(0, len(order), 500):
            await store.append(order[start : start + 500])
    async with await open_sqlite_store(tmp_path / "j.db") as store:
        for run_id, events in journals.items():
            assert await store.load(run_id) == events
        runs = await store.list_runs(outcome=COMPLETED)
        assert [r.run_id for r in runs] == sorted(journals)
        assert all(r.seq == 5 and r.state == "DONE" for r in runs)


# --- version 1 (a row per event) is upgraded in place -------------------------------------

_V1_SCHEMA = (
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    """CREATE TABLE events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
        ts REAL NOT NULL, key TEXT, body BLOB NOT NULL, PRIMARY KEY (run_id, seq)) WITHOUT ROWID""",
    "CREATE UNIQUE INDEX events_intent_key ON events (key) WHERE kind = 'intent_recorded'",
    """CREATE TABLE runs (run_id TEXT PRIMARY KEY, machine TEXT NOT NULL, state TEXT NOT NULL,
        outcome TEXT NOT NULL, seq INTEGER NOT NULL, started REAL NOT NULL, updated REAL NOT NULL,
        reason TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '') WITHOUT ROWID""",
    "CREATE INDEX runs_started ON runs (started, run_id)",
    "CREATE INDEX runs_outcome ON runs (outcome, started, run_id)",
    "CREATE INDEX runs_machine ON runs (machine, started, run_id)",
    "INSERT INTO meta VALUES ('schema_version', '1')",
)


def write_v1(path: Path, events: list[Event]) -> None:
    """A database as interlock wrote it with schema version 1: one row per event."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in _V1_SCHEMA:
            conn.execute(statement)
        conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", encode_rows(events))
        updates = index_updates(events, {})
        conn.executemany(
            "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [msgspec.structs.astuple(r) for r in updates.values()],
        )


def with_intent(run_id: str, ts: float) -> list[Event]:
    events = run_events(run_id, ts)
    intent = IntentRecorded(
        run_id=run_id, seq=3, ts=ts, state="B", tool="pay", args={}, key=f"{run_id}:B:3"
    )
    return [*events[:2], intent, *[msgspec.structs.replace(e, seq=e.seq + 1) for e in events[2:]]]


async def test_version_1_database_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    one, two, three = with_intent("r-1", 1.0), run_events("r-2", 2.0), run_events("r-3", 3.0)
    write_v1(path, one + two + three)
    # r-3's seq 3 was cut short under version 1; the upgrade keeps it as it is.
    raw_sql(path, "UPDATE events SET body = substr(body, 1, 20) WHERE run_id = 'r-3' AND seq = 3")
    with pytest.raises(StoreError) as info:
        await open_sqlite_store(path, readonly=True)
    assert str(info.value) == (
        f"{path}: database schema version 1 was written by an older interlock; open it once "
        "without readonly=True to upgrade it in place to version 6 (every event is kept)"
    )
    async with await open_sqlite_store(path) as store:
        assert await store.load("r-1") == one
        assert await store.load("r-2") == two
        with pytest.raises(
            JournalCorrupt, match=r"^journal of run 'r-3' is torn \(cut short\) at seq 3; "
        ):
            await store.load("r-3")
        assert [r.run_id for r in await store.list_runs(outcome=COMPLETED)] == ["r-1", "r-2", "r-3"]
        # The intent keys came along: a second intent with r-1's key is refused.
        duplicate = msgspec.structs.replace(with_intent("r-4", 4.0)[2], key="r-1:B:3")
        with pytest.raises(
            StoreError,
            match=r"^idempotency key 'r-1:B:3' was already recorded; nothing was written$",
        ):
            await store.append([*run_events("r-4", 4.0)[:2], duplicate])
        await store.append(run_events("r-4", 4.0))
    tables = {
        row[0] for row in raw_sql(path, "SELECT name FROM sqlite_master WHERE type = 'table'")
    }
    assert tables == {"meta", "chunks", "intents", "runs", "moves", "sqlite_sequence"}
    assert raw_sql(path, "SELECT value FROM meta WHERE name = 'schema_version'") == [("6",)]
    # The upgrade numbered the chunks by run and seq, each chained to its run's one before.
    assert raw_sql(
        path, "SELECT id, run_id, first_seq, last_seq, prev FROM chunks ORDER BY id"
    ) == [
        (1, "r-1", 1, 6, None),
        (2, "r-2", 1, 5, None),
        (3, "r-3", 1, 3, None),
        (4, "r-3", 4, 5, 3),
        (5, "r-4", 1, 5, None),
    ]
    assert raw_sql(path, "SELECT run_id, chunk FROM runs ORDER BY run_id") == [
        ("r-1", 1),
        ("r-2", 2),
        ("r-3", 4),
        ("r-4", 5),
    ]
    # Opened again, it is an ordinary version 6 database.
    async with await open_sqlite_store(path, readonly=True) as store:
        assert await store.load("r-1") == one


async def test_unknown_older_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path):
        pass
    raw_sql(path, "UPDATE meta SET value = '0' WHERE name = 'schema_version'")
    with pytest.raises(StoreError, match=r"j\.db: database schema version 0 is not supported$"):
        await open_sqlite_store(path)


# --- version 2 (no checksums in the runs index) is upgraded in place ------------------------

_V2_RUNS = (
    """CREATE TABLE runs (run_id TEXT PRIMARY KEY, machine TEXT NOT NULL, state TEXT NOT NULL,
        outcome TEXT NOT NULL, seq INTEGER NOT NULL, started REAL NOT NULL, updated REAL NOT NULL,
        reason TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '') WITHOUT ROWID""",
    "CREATE INDEX runs_started ON runs (started, run_id)",
    "CREATE INDEX runs_outcome ON runs (outcome, started, run_id)",
    "CREATE INDEX runs_machine ON runs (machine, started, run_id)",
)


def write_v2(path: Path, runs: list[list[Event]]) -> None:
    """A database as interlock wrote it with schema version 2: no checksums, three indexes."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in (
            sqlite_store_module._META,
            *sqlite_store_module._JOURNAL_V4,
            sqlite_store_module._INTENTS,
            *_V2_RUNS,
        ):
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('schema_version', '2')")
        for events in runs:
            body = b"".join(row[5] for row in encode_rows(events))
            conn.execute(
                "INSERT INTO chunks VALUES (?, 1, ?, ?)", (events[0].run_id, len(events), body)
            )
            [record] = index_updates(events, {}).values()
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                msgspec.structs.astuple(record),
            )


async def test_version_2_database_is_read_as_it_is_then_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    one, two = run_events("r-1", 1.0), run_events("r-2", 2.0)
    write_v2(path, [one, two])
    before = path.read_bytes()
    # Read-only, it reads as it is (its rows have no checksum to check) and stays untouched.
    async with await open_sqlite_store(path, readonly=True) as store:
        assert await store.pragmas() == {
            "journal_mode": "wal",
            "synchronous": "NORMAL",
            "foreign_keys": True,
            "busy_timeout": 5000,
            "schema_version": 2,
        }
        assert await store.load("r-1") == one
        assert [r.run_id for r in await store.list_runs(outcome=COMPLETED)] == ["r-1", "r-2"]
        assert (await store.check()).ok
    assert path.read_bytes() == before
    async with await open_sqlite_store(path) as store:
        assert await store.load("r-2") == two
        assert await store.get_run("r-1") == index_row(one)
        await store.append(run_events("r-3", 3.0))
        assert await store.check() == CheckReport(runs=3, events=15, problems=())
    assert raw_sql(path, "SELECT value FROM meta ORDER BY name") == [("0",), ("3",), ("6",)]
    assert raw_sql(path, "SELECT name FROM sqlite_master WHERE tbl_name = 'runs'") == [
        ("runs",),
        ("runs_unfinished",),
    ]
    # Every row got its checksum: a change behind the store's back is now found.
    raw_sql(path, "UPDATE runs SET state = 'B' WHERE run_id = 'r-2'")
    async with await open_sqlite_store(path, readonly=True) as store:
        with pytest.raises(IndexDamaged, match=r"^runs index row of run 'r-2' is damaged "):
            await store.list_runs()


# --- damage only SQLite can take -------------------------------------------------------------


async def five_runs(path: Path) -> list[list[Event]]:
    runs = [run_events(f"r-{i}", float(i)) for i in range(5)]
    async with await open_sqlite_store(path) as store:
        for i, events in enumerate(runs):
            await store.append(events[: 2 + i % 3])
    # Closed, the store has checkpointed everything into the file: no -wal is left.
    assert not await trio.Path(f"{path}-wal").exists()
    return runs


async def every_read(path: Path) -> list[object]:
    """What the store answers to each read of the runs index, or "damage" if it says so."""
    reads: list[Callable[[Store], Awaitable[object]]] = [
        lambda store: store.list_runs(),
        lambda store: store.list_runs(outcome="running"),
        lambda store: store.list_runs(outcome="completed"),
        *[lambda store, run_id=f"r-{i}": store.get_run(run_id) for i in range(5)],
    ]
    answers: list[object] = []
    async with await open_sqlite_store(path, readonly=True) as store:
        for read in reads:
            try:
                answers.append(await read(store))
            except StoreError:
                answers.append("damage")
    return answers


async def test_every_flipped_byte_of_the_runs_index_is_reported_or_harmless(
    tmp_path: Path,
) -> None:
    """Regression (#14): one flipped byte in the runs index made listing skip a run or show a
    garbled one. Here every byte of the index's (one) page that SQLite reads is flipped in
    turn: each flip must be reported as damage or change no answer. Beside the rows'
    checksums this needs the count of runs started (a flip in the page header hides a row,
    a flipped cell pointer aimed at another row reads that one twice) and a check that a
    lookup finds the row it looked for (a damaged page can lead it to another)."""
    pristine = tmp_path / "pristine.db"
    await five_runs(pristine)
    expected = await every_read(pristine)
    [(root,)] = raw_sql(pristine, "SELECT rootpage FROM sqlite_master WHERE name = 'runs'")
    assert isinstance(root, int)
    data = pristine.read_bytes()
    base = (root - 1) * 8192
    page = data[base : base + 8192]
    assert page[0] == 0x0A  # a leaf of a table without rowid: the whole index
    cells = int.from_bytes(page[3:5], "big")
    pointers = [int.from_bytes(page[8 + 2 * i : 10 + 2 * i], "big") for i in range(cells)]
    content = int.from_bytes(page[5:7], "big")
    flips = [(at, mask) for at in range(8 + 2 * cells) for mask in (0x01, 0x80, 0xFF)]
    flips += [(at, mask) for at in range(content, 8192) for mask in (0x01, 0x80)]
    # A cell pointer aimed at each other cell: the row it points at is read twice.
    flips += [
        (8 + 2 * i + 1, (pointers[i] ^ other) & 0xFF)
        for i in range(cells)
        for other in pointers
        if other != pointers[i] and (pointers[i] ^ other) >> 8 == 0
    ]
    damaged = tmp_path / "damaged.db"
    silent = []
    for at, mask in flips:
        flipped = bytearray(data)
        flipped[base + at] ^= mask
        damaged.write_bytes(flipped)
        try:
            answers = await every_read(damaged)
        except StoreError:
            continue  # refused to open
        # Each read on its own: reported, or the right answer.
        if any(got not in ("damage", right) for got, right in zip(answers, expected, strict=True)):
            silent.append((at, mask))
    assert silent == []
    assert len(flips) > 400


async def test_text_that_is_not_utf8_is_reported_with_its_row(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    await five_runs(path)
    raw_sql(path, "UPDATE runs SET state = CAST(x'c328' AS TEXT) WHERE run_id = 'r-3'")
    message = (
        "runs index row of run 'r-3' is damaged (a text field is not valid text); the "
        "store was written outside interlock or its file is damaged; restore it from a backup"
    )
    async with await open_sqlite_store(path) as store:
        for read in (lambda: store.list_runs(outcome=COMPLETED), lambda: store.get_run("r-3")):
            with pytest.raises(IndexDamaged) as info:
                await read()
            assert str(info.value) == message
        # Appending to the run: SQLite cannot even hand the text to the checksum.
        with pytest.raises(IndexDamaged) as info:
            await store.append([run_events("r-3", 3.0)[2], run_events("r-9", 9.0)[0]])
        assert str(info.value) == message
        with pytest.raises(RunNotFound):
            await store.get_run("r-9")


async def test_integrity_check_findings_are_problems(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    await five_runs(path)
    # Flip a byte of a run id in the index of the runs' first chunks.
    [(root,)] = raw_sql(path, "SELECT rootpage FROM sqlite_master WHERE name = 'chunks_first'")
    assert isinstance(root, int)
    data = bytearray(path.read_bytes())
    at = data.index(b"r-4", (root - 1) * 8192)
    assert at < root * 8192
    data[at + 2] ^= 0x01
    path.write_bytes(data)
    async with await open_sqlite_store(path, readonly=True) as store:
        report = await store.check()
    sqlite_said = [p for p in report.problems if "SQLite integrity check" in p.message]
    assert sqlite_said
    assert all(p.run_id is None and p.seq is None for p in sqlite_said)
    assert sqlite_said[0].message.startswith(f"{path}: SQLite integrity check: ")


async def test_a_run_another_writer_advanced_is_named(tmp_path: Path) -> None:
    """Another store advanced a run past the row this one remembers: its batch is refused
    and names why, and the journal holds the other store's events alone."""
    path = tmp_path / "j.db"
    events = run_events("r-1", 1.0)
    async with await open_sqlite_store(path) as store, await open_sqlite_store(path) as other:
        await store.append(events[:2])
        await other.append(events[2:4])
        with pytest.raises(StoreError) as info:
            await store.append(events[2:])
        assert await store.load("r-1") == events[:4]
        assert (await store.check()).ok
        assert str(info.value) == (
            "run 'r-1' is already at seq 4 in the store, so this batch cannot append seq 3: "
            "another process advanced the run; keep one writer per SQLite journal, and on "
            "PostgreSQL drive runs through leases (a supervisor, `interlock worker` or "
            "`interlock resume` takes them); nothing was written"
        )


async def test_a_full_disk_is_reported_as_a_full_disk(tmp_path: Path) -> None:
    """Regression (#14): a full disk failed the batch with SQLite's words only, and the
    run's next request said the run was not found. Here the database may not grow past its
    pages (``max_page_count``), which SQLite reports exactly as a full disk (SQLITE_FULL)."""
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run_events("r-1", 1.0))
        assert isinstance(store, SQLiteStore)
        pages = await store._call(
            "test", lambda conn: conn.execute("PRAGMA page_count").fetchone()[0]
        )
        await store._call(
            "test", lambda conn: conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()
        )
        big = [
            msgspec.structs.replace(e, run_id="r-2", inputs={"blob": "x" * 200_000})
            if isinstance(e, RunStarted)
            else msgspec.structs.replace(e, run_id="r-2")
            for e in run_events("r-2", 2.0)
        ]
        with pytest.raises(StoreError) as info:
            await store.append(big)
        assert str(info.value) == (
            f"journal {path}: disk is full (database or disk is full), so append wrote "
            f"nothing; free space on the disk holding {tmp_path}, then retry"
        )
        assert [r.run_id for r in await store.list_runs()] == ["r-1"]
        with pytest.raises(RunNotFound):
            await store.load("r-2")
        # Room again: the same batch goes in.
        await store._call("test", lambda conn: conn.execute("PRAGMA max_page_count = 1000000"))
        await store.append(big)
        assert (await store.check()).ok


async def test_the_intents_table_is_checked_against_the_journal(tmp_path: Path) -> None:
    """The intents table is derived too: a key missing from it would let a second intent
    with that key through."""
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(with_intent("r-1", 1.0))
    raw_sql(path, "DELETE FROM intents")
    raw_sql(path, "INSERT INTO intents VALUES ('r-1:X:4', 'r-1', 4)")
    async with await open_sqlite_store(path, readonly=True) as store:
        assert (await store.check()).problems == (
            CheckProblem(
                run_id="r-1",
                seq=3,
                message="the intents table lacks idempotency key 'r-1:B:3' of run 'r-1' seq 3, "
                "so a second intent with that key would not be refused; restore it from a backup",
            ),
            CheckProblem(
                run_id="r-1",
                seq=4,
                message="the intents table holds idempotency key 'r-1:X:4' for run 'r-1' seq 4, "
                "which the run's journal does not record; restore it from a backup",
            ),
        )


async def test_a_check_that_cannot_read_on_says_so(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    await five_runs(path)
    [(root,)] = raw_sql(path, "SELECT rootpage FROM sqlite_master WHERE name = 'chunks'")
    assert isinstance(root, int)
    data = bytearray(path.read_bytes())
    data[(root - 1) * 8192] = 0x00  # no b-tree page type: SQLite refuses to read the table
    path.write_bytes(data)
    async with await open_sqlite_store(path, readonly=True) as store:
        report = await store.check()
    # The five runs' journals were not read, and are not reported missing for that.
    assert report == CheckReport(
        runs=5,
        events=0,
        problems=(
            CheckProblem(
                run_id=None,
                seq=None,
                message=f"{path}: cannot read on past the damage: database disk image is malformed",
            ),
        ),
    )


# --- the index rows a store remembers (moving a row on needs no read) -----------------------


async def test_a_row_changed_behind_the_store_is_moved_on_from_what_is_stored(
    tmp_path: Path,
) -> None:
    """The store moves a run's index row on from the row it last wrote; a row written
    since by someone else (another store of the process, say) is read and checked instead,
    and the batch moves it on as before."""
    path = tmp_path / "j.db"
    events = run_events("r-1", 1.0)
    async with await open_sqlite_store(path) as first, await open_sqlite_store(path) as second:
        await first.append(events[:2])
        await second.append(events[2:3])  # first's memory of r-1 is now stale
        await first.append(events[3:4])
        await second.append(events[4:])
        assert await first.load("r-1") == events
        assert await first.get_run("r-1") == index_row(events)
        assert (await first.check()).ok


async def test_a_remembered_row_damaged_since_is_not_moved_on(tmp_path: Path) -> None:
    """A row that differs in any column from the one the store wrote is read and checked:
    damaged, the batch is refused, and nothing of it is written."""
    path = tmp_path / "j.db"
    events = run_events("r-1", 1.0)
    async with await open_sqlite_store(path) as store:
        await store.append(events[:2])
        assert isinstance(store, SQLiteStore)
        assert store._rows["r-1"][3] == 2  # remembered at seq 2
        raw_sql(path, "UPDATE runs SET updated = 99.5 WHERE run_id = 'r-1'")
        with pytest.raises(IndexDamaged, match=r"^runs index row of run 'r-1' is damaged "):
            await store.append(events[2:3])
        [(seq,)] = raw_sql(path, "SELECT max(last_seq) FROM chunks WHERE run_id = 'r-1'")
        assert seq == 2


async def test_the_store_forgets_finished_runs_and_the_oldest_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store_module, "REMEMBERED_ROWS", 3)
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        await store.append(run_events("r-1", 1.0))  # completed: not remembered
        runs = [f"r-{n}" for n in range(2, 7)]
        await store.append([e for r in runs for e in run_events(r, 2.0)[:2]])
        assert list(store._rows) == runs[-3:]
        # A forgotten run's row is read again, and remembered again.
        await store.append(run_events("r-2", 2.0)[2:3])
        assert list(store._rows) == [*runs[-2:], "r-2"]
        assert (await store.check()).ok


async def test_rows_it_does_not_remember_are_read_in_groups_and_checked(tmp_path: Path) -> None:
    """After a reopen the store remembers nothing: a batch continuing 200 runs reads their
    rows in groups (padded with repeats), checks each, and refuses a damaged one."""
    path = tmp_path / "j.db"
    runs = [f"r-{n:03d}" for n in range(200)]
    events = {r: run_events(r, 1.0) for r in runs}
    async with await open_sqlite_store(path) as store:
        await store.append([e for r in runs for e in events[r][:2]])
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        assert not store._rows
        await store.append([events[r][2] for r in runs])
        assert len(store._rows) == 200
    raw_sql(path, "UPDATE runs SET machine = 'refunds' WHERE run_id = 'r-150'")
    async with await open_sqlite_store(path) as store:
        with pytest.raises(IndexDamaged, match=r"^runs index row of run 'r-150' is damaged "):
            await store.append([events[r][3] for r in runs])
        assert (await store.get_run("r-000")).seq == 3


# --- version 5: chunks appended by id, chained per run ---------------------------------------


async def interleaved(path: Path) -> list[list[Event]]:
    """Three runs appended a step at a time in turns: each run's chunks far apart by id."""
    runs = [run_events(f"r-{i}", float(i)) for i in range(3)]
    async with await open_sqlite_store(path) as store:
        for seq in range(5):
            await store.append([events[seq] for events in runs])
    return runs


async def test_a_runs_chunks_are_chained_from_its_index_row(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    runs = await interleaved(path)
    # Appended in turns: the ids interleave, and each chunk names its run's one before.
    assert raw_sql(path, "SELECT id, run_id, first_seq, prev FROM chunks ORDER BY id")[:6] == [
        (1, "r-0", 1, None),
        (2, "r-1", 1, None),
        (3, "r-2", 1, None),
        (4, "r-0", 2, 1),
        (5, "r-1", 2, 2),
        (6, "r-2", 2, 3),
    ]
    assert raw_sql(path, "SELECT run_id, chunk FROM runs ORDER BY run_id") == [
        ("r-0", 13),
        ("r-1", 14),
        ("r-2", 15),
    ]
    async with await open_sqlite_store(path, readonly=True) as store:
        for events in runs:
            run_id = events[0].run_id
            assert await store.load(run_id) == events
            for seq in range(6):
                assert await store.load_after(run_id, seq) == events[seq:]
        assert await store.check() == CheckReport(runs=3, events=15, problems=())


async def test_a_broken_chain_is_read_by_run_and_reported_by_check(tmp_path: Path) -> None:
    """A damaged link loses nothing: the run is read by its id instead (as version 4 read
    it), and check names the link."""
    path = tmp_path / "j.db"
    runs = await interleaved(path)
    raw_sql(path, "UPDATE chunks SET prev = 2 WHERE run_id = 'r-0' AND first_seq = 3")
    async with await open_sqlite_store(path, readonly=True) as store:
        assert await store.load("r-0") == runs[0]
        assert await store.load_after("r-0", 1) == runs[0][1:]
        assert await store.load_after("r-0", 3) == runs[0][3:]  # the chain is whole up to it
        report = await store.check()
    assert [(p.run_id, p.seq) for p in report.problems] == [("r-0", 3)]
    assert report.problems[0].message == (
        f"{path}: the chunk of run 'r-0' from seq 3 is chained to chunk 2, not to the run's "
        "chunk before it (4); restore the journal from a backup"
    )


async def test_an_index_row_naming_another_chunk_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    runs = await interleaved(path)
    raw_sql(path, "UPDATE runs SET chunk = 14 WHERE run_id = 'r-0'")  # r-1's last chunk
    async with await open_sqlite_store(path, readonly=True) as store:
        assert await store.load("r-0") == runs[0]  # the chain is another run's: read by id
        report = await store.check()
    assert [(p.run_id, p.seq) for p in report.problems] == [("r-0", None)]
    assert report.problems[0].message == (
        f"{path}: the index row of run 'r-0' names chunk 14, not the run's last chunk (13); "
        "restore the journal from a backup"
    )


async def test_a_row_naming_no_chunk_refuses_the_batch(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    events = run_events("r-1", 1.0)
    async with await open_sqlite_store(path) as store:
        await store.append(events[:2])
        raw_sql(path, "UPDATE runs SET chunk = NULL WHERE run_id = 'r-1'")
        with pytest.raises(IndexDamaged) as info:
            await store.append(events[2:3])
        assert str(info.value).startswith(
            "runs index row of run 'r-1' is damaged (its row names no last chunk of the journal)"
        )
        assert await store.load("r-1") == events[:2]  # read by id; nothing appended


async def test_a_version_4_journal_is_read_then_chained_when_opened_for_writing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.db"
    runs = await interleaved(path)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        as_version_4(conn)
    before = path.read_bytes()
    async with await open_sqlite_store(path, readonly=True) as store:
        assert (await store.pragmas())["schema_version"] == 4
        for events in runs:
            assert await store.load(events[0].run_id) == events
            assert await store.load_after(events[0].run_id, 2) == events[2:]
        assert (await store.check()).ok
    assert path.read_bytes() == before
    more = run_events("r-9", 9.0)
    async with await open_sqlite_store(path) as store:
        assert (await store.pragmas())["schema_version"] == 6
        await store.append(more[:2])
        await store.append(more[2:])
        for events in [*runs, more]:
            assert await store.load(events[0].run_id) == events
        assert await store.check() == CheckReport(runs=4, events=20, problems=())
    # Numbered by run and seq, then appended after: r-9's chunks are 16 and 17.
    assert raw_sql(path, "SELECT run_id, chunk FROM runs ORDER BY run_id") == [
        ("r-0", 5),
        ("r-1", 10),
        ("r-2", 15),
        ("r-9", 17),
    ]
