"""What only the SQLite store does: a file that survives, pragmas, refusing foreign files."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from pathlib import Path

import pytest

from interlock._events import Completed, Event, RunStarted, Transitioned
from interlock._exceptions import JournalCorrupt, StoreError
from interlock.stores import (
    COMPLETED,
    MemoryStore,
    SQLiteStore,
    open_sqlite_store,
    open_store,
)


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
            "schema_version": 1,
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
    assert raw_sql(path, "SELECT value FROM meta WHERE name = 'schema_version'") == [("1",)]
    indexes = {
        row[0] for row in raw_sql(path, "SELECT name FROM sqlite_master WHERE type = 'index'")
    }
    assert {"events_intent_key", "runs_outcome", "runs_machine"} <= indexes


async def test_corrupt_body_is_reported_with_run_and_seq(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run_events("r-1", 1.0))
    [(body,)] = raw_sql(path, "SELECT body FROM events WHERE run_id = 'r-1' AND seq = 3")
    assert isinstance(body, bytes)
    flipped = bytearray(body)
    flipped[-1] ^= 0x01
    raw_sql(path, "UPDATE events SET body = ? WHERE run_id = 'r-1' AND seq = 3", (bytes(flipped),))
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
    raw_sql(path, "UPDATE events SET body = substr(body, 1, 10) WHERE seq = 2")
    async with await open_sqlite_store(path) as store:
        with pytest.raises(
            JournalCorrupt, match=r"^journal of run 'r-1' is torn \(cut short\) at seq 2; "
        ):
            await store.load("r-1")


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
        match=r"j\.db: database schema version 99 is newer than this interlock supports \(1\); "
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
