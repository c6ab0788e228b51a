"""Version 6 of the SQLite store: a continuing run's index row moves lazily.

Each batch writes the rows it moves (of runs it continues in the same outcome) as one row
of the ``moves`` table; the writer applies the pending moves to ``runs`` at most
``INDEX_LAG_SECONDS`` or ``INDEX_LAG_BATCHES`` later. Every read, the writer's own or a
read-only store's (another process), takes a run's latest pending move over its row, so
no answer lags the journal; a run whose outcome changes moves at once, so the index of
unfinished runs and its count never lag; a crash leaves the moves for readers and for the
next writer, which applies them.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from interlock.core._events import Completed, Event, RunStarted, Transitioned
from interlock.stores import IndexDamaged, SQLiteStore, open_sqlite_store
from interlock.stores import _sqlite as sqlite_store_module
from interlock.stores._base import row_checksum

from .conftest import index_row

ROOT = Path(__file__).resolve().parents[2]


def raw_sql(
    path: Path, statement: str, params: tuple[object, ...] = ()
) -> list[tuple[object, ...]]:
    """One statement on the file with a plain sqlite3 connection, bypassing the store."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        return conn.execute(statement, params).fetchall()


def started(run_id: str, ts: float) -> RunStarted:
    return RunStarted(run_id=run_id, seq=1, ts=ts, machine="loop", state="A")


def step(run_id: str, seq: int, ts: float) -> Transitioned:
    """The run's move at ``seq`` (A -> B -> A ...)."""
    src, dst = ("A", "B") if seq % 2 == 0 else ("B", "A")
    return Transitioned(run_id=run_id, seq=seq, ts=ts, src=src, dst=dst, delta={"n": seq})


RUNS = ["r-1", "r-2", "r-3"]


async def steps(store: SQLiteStore, seqs: range) -> dict[str, list[Event]]:
    """Start RUNS in one batch, then one batch per seq of ``seqs``, a step of each run."""
    journals: dict[str, list[Event]] = {r: [started(r, 1.0)] for r in RUNS}
    await store.append([j[0] for j in journals.values()])
    for seq in seqs:
        batch = [step(r, seq, float(seq)) for r in RUNS]
        await store.append(batch)
        for event in batch:
            journals[event.run_id].append(event)
    return journals


@pytest.fixture
def lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """No lag runs out by itself: the moves stay pending until a test applies them."""
    monkeypatch.setattr(sqlite_store_module, "INDEX_LAG_SECONDS", float("inf"))
    monkeypatch.setattr(sqlite_store_module, "INDEX_LAG_BATCHES", 10**9)


async def every_read(store: SQLiteStore, journals: dict[str, list[Event]]) -> None:
    """Every read of ``store`` answers as of the journal."""
    rows = {run_id: index_row(journal) for run_id, journal in journals.items()}
    for run_id, journal in journals.items():
        assert await store.get_run(run_id) == rows[run_id]
        assert await store.load(run_id) == journal
        assert await store.load_after(run_id, 2) == journal[2:]
    assert sorted(await store.list_runs(), key=lambda r: r.run_id) == [rows[r] for r in RUNS]
    assert await store.list_runs(state=rows["r-1"].state, limit=1) == [rows["r-1"]]
    running = sorted((r for r in rows.values() if r.outcome == "running"), key=lambda r: r.run_id)
    assert await store.unfinished() == running
    assert (await store.check()).ok


async def test_continuing_runs_wait_in_the_moves_table_and_every_read_takes_them(
    tmp_path: Path, lag: None
) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        journals = await steps(store, range(2, 6))
        # The rows are as the batch that started the runs left them; four batches of moves
        # wait, one row each.
        assert raw_sql(path, "SELECT run_id, seq, state FROM runs ORDER BY run_id") == [
            (r, 1, "A") for r in RUNS
        ]
        assert raw_sql(path, "SELECT count(*) FROM moves") == [(4,)]
        # Read by the writer, and by a store on a connection of its own (another process).
        async with await open_sqlite_store(path, readonly=True) as reader:
            assert isinstance(reader, SQLiteStore)
            for each in (store, reader):
                await every_read(each, journals)
    # Closing applied the moves: the rows are the journal's, the table is empty.
    assert raw_sql(path, "SELECT run_id, seq, state FROM runs ORDER BY run_id") == [
        (r, 5, "A") for r in RUNS
    ]
    assert raw_sql(path, "SELECT count(*) FROM moves") == [(0,)]
    async with await open_sqlite_store(path, readonly=True) as reader:
        assert isinstance(reader, SQLiteStore)
        await every_read(reader, journals)


async def test_pending_moves_are_applied_once_the_lag_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store_module, "INDEX_LAG_SECONDS", float("inf"))
    monkeypatch.setattr(sqlite_store_module, "INDEX_LAG_BATCHES", 3)
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        await steps(store, range(2, 4))
        assert raw_sql(path, "SELECT count(*) FROM moves") == [(2,)]
        await store.append([started("s-1", 3.5)])  # no run continued: nothing moved
        assert raw_sql(path, "SELECT count(*) FROM moves") == [(2,)]
        await store.append([step(r, 4, 4.0) for r in ("r-1", "r-2")])
        # the third batch of moves applied every pending one, its own too
        assert raw_sql(path, "SELECT count(*) FROM moves") == [(0,)]
        assert raw_sql(path, "SELECT run_id, seq FROM runs ORDER BY run_id") == [
            ("r-1", 4),
            ("r-2", 4),
            ("r-3", 3),
            ("s-1", 1),
        ]
    monkeypatch.setattr(sqlite_store_module, "INDEX_LAG_SECONDS", 0.0)
    async with await open_sqlite_store(tmp_path / "k.db") as store:
        assert isinstance(store, SQLiteStore)
        journals = await steps(store, range(2, 4))
        # no lag at all: each batch applies its moves as it commits
        assert raw_sql(tmp_path / "k.db", "SELECT count(*) FROM moves") == [(0,)]
        await every_read(store, journals)


async def test_a_run_whose_outcome_changes_moves_its_row_at_once(tmp_path: Path, lag: None) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        journals = await steps(store, range(2, 5))
        end = Completed(run_id="r-2", seq=5, ts=5.0, state="B")
        await store.append([end, step("r-1", 5, 5.0)])
        journals["r-2"].append(end)
        journals["r-1"].append(step("r-1", 5, 5.0))
        # r-2's row moved past its pending moves; the index of unfinished runs and their
        # count are the journal's, with r-1's and r-3's moves still pending
        assert raw_sql(path, "SELECT run_id, seq, outcome FROM runs ORDER BY run_id") == [
            ("r-1", 1, "running"),
            ("r-2", 5, "completed"),
            ("r-3", 1, "running"),
        ]
        assert raw_sql(path, "SELECT value FROM meta WHERE name = 'running'") == [("2",)]
        async with await open_sqlite_store(path, readonly=True) as reader:
            assert isinstance(reader, SQLiteStore)
            for each in (store, reader):
                await every_read(each, journals)
    # applying the moves at close dropped r-2's, which its row had moved past
    assert raw_sql(path, "SELECT run_id, seq, outcome FROM runs ORDER BY run_id") == [
        ("r-1", 5, "running"),
        ("r-2", 5, "completed"),
        ("r-3", 4, "running"),
    ]


async def test_a_damaged_pending_move_is_reported_by_every_read_and_check(
    tmp_path: Path, lag: None
) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await steps(store, range(2, 4))
    raw_sql(path, "DELETE FROM moves")  # closing applied them: lay pending ones again
    async with await open_sqlite_store(path) as store:
        journals = await steps_more(store, 4)
        [(moves_id, body)] = raw_sql(path, "SELECT id, body FROM moves")
        assert isinstance(body, bytes)
        flipped = body.replace(b"r-2", b"r-9", 1)  # the move no longer fits its checksum
        raw_sql(path, "UPDATE moves SET body = ? WHERE id = ?", (flipped, moves_id))
        async with await open_sqlite_store(path, readonly=True) as reader:
            for read in (reader.list_runs, lambda: reader.get_run("r-1"), reader.unfinished):
                with pytest.raises(IndexDamaged, match="pending index move fails its checksum"):
                    await read()
            # the damaged move, then each run it leaves behind its journal (none of their
            # moves can be read)
            report = await reader.check()
            assert [p.run_id for p in report.problems] == ["r-9", "r-1", "r-2", "r-3"]
            assert "pending index move fails its checksum" in report.problems[0].message
            assert "seq 3 where the journal says 4" in report.problems[1].message
        del journals


async def steps_more(store: SQLiteStore, seq: int) -> dict[str, list[Event]]:
    batch = [step(r, seq, float(seq)) for r in RUNS]
    await store.append(batch)
    return {e.run_id: [e] for e in batch}


_CRASH = """
import os, signal, sys, trio
sys.path.insert(0, {root!r})
from interlock.stores import _sqlite, open_sqlite_store
from tests.stores.test_sqlite_moves import steps
_sqlite.INDEX_LAG_SECONDS = float("inf")
_sqlite.INDEX_LAG_BATCHES = 10**9

async def main():
    store = await open_sqlite_store({path!r}, synchronous="FULL")
    await steps(store, range(2, 6))
    os.kill(os.getpid(), signal.SIGKILL)  # with four batches of moves pending

trio.run(main)
"""


async def test_moves_pending_at_a_crash_are_read_and_applied_by_the_next_writer(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.db"
    with trio.fail_after(120):
        child = await trio.run_process(
            [sys.executable, "-c", textwrap.dedent(_CRASH.format(root=str(ROOT), path=str(path)))],
            cwd=ROOT,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert raw_sql(path, "SELECT count(*) FROM moves") == [(4,)]
    journals: dict[str, list[Event]] = {r: [started(r, 1.0)] for r in RUNS}
    for seq in range(2, 6):
        for r in RUNS:
            journals[r].append(step(r, seq, float(seq)))
    async with await open_sqlite_store(path, readonly=True) as reader:
        assert isinstance(reader, SQLiteStore)
        await every_read(reader, journals)
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        await every_read(store, journals)
        await store.append([step(r, 6, 6.0) for r in RUNS])
        for r in RUNS:
            journals[r].append(step(r, 6, 6.0))
        # the batch read the rows of runs it did not remember: the four moves pending were
        # applied first; its own waits
        assert raw_sql(path, "SELECT run_id, seq FROM runs ORDER BY run_id") == [
            (r, 5) for r in RUNS
        ]
        assert raw_sql(path, "SELECT count(*) FROM moves") == [(1,)]
        await every_read(store, journals)


async def test_a_version_5_journal_is_read_as_it_is_then_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        journals = await steps(store, range(2, 4))
    # as version 5 wrote it: no moves table
    raw_sql(path, "DROP TABLE moves")
    raw_sql(path, "UPDATE meta SET value = '5' WHERE name = 'schema_version'")
    before = path.read_bytes()
    async with await open_sqlite_store(path, readonly=True) as reader:
        assert isinstance(reader, SQLiteStore)
        assert (await reader.pragmas())["schema_version"] == 5
        await every_read(reader, journals)
    assert path.read_bytes() == before
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        assert (await store.pragmas())["schema_version"] == 6
        await store.append([step(r, 4, 4.0) for r in RUNS])
        for r in RUNS:
            journals[r].append(step(r, 4, 4.0))
        await every_read(store, journals)


async def test_a_row_damaged_where_the_writer_cannot_see_a_change_is_never_overwritten(
    tmp_path: Path, lag: None
) -> None:
    """The writer applies pending moves to rows it wrote itself without reading them back
    (no other connection wrote since: PRAGMA data_version), each by its checksum; a row
    changed on its own connection (as damage on the disk would be) fails that, so every
    row is read and checked, and the damaged one keeps its move pending and is reported."""
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        assert isinstance(store, SQLiteStore)
        journals = await steps(store, range(2, 4))
        assert set(store._stored) == set(RUNS)  # written by this store, known
        await store._call(
            "damage",
            lambda conn: conn.execute("UPDATE runs SET crc = crc + 1 WHERE run_id = 'r-2'"),
        )
        await store._call("apply", store._apply_moves)
        assert raw_sql(path, "SELECT run_id, seq FROM runs ORDER BY run_id") == [
            ("r-1", 3),
            ("r-2", 1),
            ("r-3", 3),
        ]
        assert raw_sql(path, "SELECT count(*) FROM moves") == [(1,)]  # r-2's, kept
        for read in (lambda: store.get_run("r-2"), lambda: store.load("r-2"), store.list_runs):
            with pytest.raises(IndexDamaged, match=r"^runs index row of run 'r-2' is damaged "):
                await read()
        assert [p.run_id for p in (await store.check()).problems] == ["r-2"]
        assert await store.load("r-1") == journals["r-1"]


async def test_a_pending_move_its_row_moved_past_is_no_damage_to_a_reader(
    tmp_path: Path, lag: None
) -> None:
    """Regression (#33): a run whose outcome changed moved its row past its pending moves,
    which wait in the moves table until the writer applies (drops) them; a reader's check
    in the meantime (another process's, or after a crash) called each such run damaged,
    and counted it twice against the runs started."""
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        journals = await steps(store, range(2, 5))
        end = Completed(run_id="r-2", seq=5, ts=5.0, state="B")
        await store.append([end])
        journals["r-2"].append(end)
        assert raw_sql(path, "SELECT count(*) FROM moves") == [(3,)]
        async with await open_sqlite_store(path, readonly=True) as reader:
            assert isinstance(reader, SQLiteStore)
            report = await reader.check()
            assert (report.runs, report.events, report.problems) == (3, 13, ())
            await every_read(reader, journals)


async def test_a_pending_move_of_another_run_than_its_row_is_damage(
    tmp_path: Path, lag: None
) -> None:
    """A move behind its row is superseded only if it moves that very row (same machine
    and start): one of another is reported, as the writer keeps it pending."""
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await steps(store, range(2, 4))
    raw_sql(path, "DELETE FROM moves")  # closing applied them: lay pending ones again
    async with await open_sqlite_store(path) as store:
        await steps_more(store, 4)
        # r-1's row rewritten whole, checksum and all, as another run of the same id
        [row] = raw_sql(
            path, f"SELECT {sqlite_store_module._RUN_COLUMNS} FROM runs WHERE run_id = 'r-1'"
        )
        fields = (row[0], "other", row[2], row[3], 9, *row[5:9])
        raw_sql(
            path,
            "UPDATE runs SET machine = ?, seq = ?, crc = ? WHERE run_id = 'r-1'",
            ("other", 9, row_checksum(*fields)),
        )
        async with await open_sqlite_store(path, readonly=True) as reader:
            report = await reader.check()
    assert [(p.run_id, p.message) for p in report.problems][:1] == [
        (
            "r-1",
            "runs index row of run 'r-1' is damaged (its pending index move (to seq 4) is of "
            "machine 'loop' started at 1.0, its row of machine 'other' started at 1.0); the "
            "store was written outside interlock or its file is damaged; restore it from a "
            "backup",
        )
    ]
