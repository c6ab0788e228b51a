"""Fixtures for the store tests: one ``store`` per backend, each fresh per test; and ways
to damage what a store holds, behind its back, as a disk or another program would."""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import psycopg
import pytest
import trio
from psycopg import sql

from interlock.core._events import (
    Completed,
    Escalated,
    Event,
    Failed,
    Resumed,
    RunStarted,
    Transitioned,
)
from interlock.stores import (
    MemoryStore,
    PostgresStore,
    RunRecord,
    SQLiteStore,
    Store,
    open_postgres_store,
    open_sqlite_store,
)
from interlock.stores._base import COMPLETED, ESCALATED, FAILED, RUNNING

PG_DSN = os.environ.get("INTERLOCK_PG_DSN", "")
PG_SKIP_REASON = (
    "INTERLOCK_PG_DSN is not set; set it to a PostgreSQL DSN to run the PostgreSQL store tests"
)

STORE_PARAMS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "postgresql",
        id="postgresql",
        marks=[pytest.mark.postgres, pytest.mark.skipif(not PG_DSN, reason=PG_SKIP_REASON)],
    ),
]


def _drop_schema(schema: str) -> None:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextlib.asynccontextmanager
async def fresh_store(kind: str, tmp_path: os.PathLike[str]) -> AsyncIterator[Store]:
    """Open an empty store of ``kind``, and close it (dropping its PostgreSQL schema) after."""
    async with open_twice(kind, tmp_path) as (opened, _second):
        yield opened


@contextlib.asynccontextmanager
async def open_twice(kind: str, tmp_path: os.PathLike[str]) -> AsyncIterator[tuple[Store, Store]]:
    """Two store objects on one fresh journal, as two processes would open it. A memory
    store cannot be shared, so there both are the same object."""
    schema = None
    if kind == "memory":
        first: Store = MemoryStore()
        second = first
    elif kind == "sqlite":
        path = os.path.join(tmp_path, f"journal-{secrets.token_hex(4)}.db")
        first = await open_sqlite_store(path)
        second = await open_sqlite_store(path)
    else:
        schema = f"interlock_test_{secrets.token_hex(6)}"
        first = await open_postgres_store(PG_DSN, schema=schema)
        second = await open_postgres_store(PG_DSN, schema=schema)
    try:
        yield first, second
    finally:
        with trio.CancelScope(shield=True):
            await first.aclose()
            await second.aclose()
            if schema is not None:
                await trio.to_thread.run_sync(_drop_schema, schema)


def index_row(journal: Sequence[Event]) -> RunRecord:
    """The runs-index row a whole journal calls for, read off the journal here as the
    index is documented (not with the stores' own ``index_updates``, so that a wrong rule
    there cannot be the expectation as well): the machine and start of its RunStarted;
    the state the last move went to; the outcome of its last end (Completed, Escalated,
    Failed; a Resumed makes it running again); the reason and detail of its last
    escalation, failure or resume (a completion leaves them); its last event's seq and
    time."""
    first, last = journal[0], journal[-1]
    assert isinstance(first, RunStarted)
    moves = [e.dst for e in journal if isinstance(e, Transitioned)]
    ends = [e for e in journal if isinstance(e, Completed | Escalated | Failed | Resumed)]
    outcomes = {Completed: COMPLETED, Escalated: ESCALATED, Failed: FAILED, Resumed: RUNNING}
    why = [e for e in ends if not isinstance(e, Completed)]
    reason, detail = "", ""
    if why and isinstance(why[-1], Escalated):
        reason, detail = why[-1].reason, why[-1].detail
    elif why and isinstance(why[-1], Failed):
        reason = why[-1].reason
    return RunRecord(
        run_id=first.run_id,
        machine=first.machine,
        state=moves[-1] if moves else first.state,
        outcome=outcomes[type(ends[-1])] if ends else RUNNING,
        seq=last.seq,
        started=first.ts,
        updated=last.ts,
        reason=reason,
        detail=detail,
    )


@pytest.fixture(params=STORE_PARAMS)
def store_kind(request: pytest.FixtureRequest) -> str:
    """The backend under test: memory, sqlite or postgresql."""
    kind: str = request.param
    return kind


@pytest.fixture
async def store(store_kind: str, tmp_path: os.PathLike[str]) -> AsyncIterator[Store]:
    """A fresh, empty store: memory, SQLite in ``tmp_path``, or its own PostgreSQL schema."""
    async with fresh_store(store_kind, tmp_path) as opened:
        yield opened


def frames(body: bytes) -> list[bytes]:
    """Split a chunk into its frames: ``[length u32][~length u32][crc u32][payload]`` each."""
    out: list[bytes] = []
    start = 0
    while start < len(body):
        end = start + 12 + int.from_bytes(body[start : start + 4], "little")
        out.append(body[start:end])
        start = end
    return out


def rewrite_event(store: Store, run_id: str, seq: int, change: Callable[[bytes], bytes]) -> None:
    """Replace the stored frame of ``seq`` of ``run_id`` with ``change(frame)``, behind the
    store's back (the store stays open, as when another program writes its file)."""
    if isinstance(store, MemoryStore):
        journal = store._journal[run_id]
        [at] = [i for i, (stored, _body) in enumerate(journal) if stored == seq]
        journal[at] = (seq, change(journal[at][1]))
    elif isinstance(store, SQLiteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as conn, conn:
            first, body = conn.execute(
                "SELECT first_seq, body FROM chunks WHERE run_id = ? AND ? BETWEEN first_seq "
                "AND last_seq",
                (run_id, seq),
            ).fetchone()
            parts = frames(body)
            parts[seq - first] = change(parts[seq - first])
            conn.execute(
                "UPDATE chunks SET body = ? WHERE run_id = ? AND first_seq = ?",
                (b"".join(parts), run_id, first),
            )
    else:
        assert isinstance(store, PostgresStore)
        with _pg(store) as conn:
            [(body,)] = conn.execute(
                "SELECT body FROM events WHERE run_id = %s AND seq = %s", (run_id, seq)
            ).fetchall()
            conn.execute(
                "UPDATE events SET body = %s WHERE run_id = %s AND seq = %s",
                (change(body), run_id, seq),
            )


def delete_event(store: Store, run_id: str, seq: int) -> None:
    """Delete the stored event ``seq`` of ``run_id`` (in SQLite, its chunk must hold only it)."""
    if isinstance(store, MemoryStore):
        store._journal[run_id] = [row for row in store._journal[run_id] if row[0] != seq]
        if not store._journal[run_id]:
            del store._journal[run_id]
    elif isinstance(store, SQLiteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as conn, conn:
            deleted = conn.execute(
                "DELETE FROM chunks WHERE run_id = ? AND first_seq = ? AND last_seq = ?",
                (run_id, seq, seq),
            ).rowcount
            assert deleted == 1, "append the event in a batch of its own"
    else:
        assert isinstance(store, PostgresStore)
        with _pg(store) as conn:
            conn.execute("DELETE FROM events WHERE run_id = %s AND seq = %s", (run_id, seq))


def index_sql(store: Store, statement: str, params: tuple[object, ...]) -> None:
    """Run one statement (``?`` placeholders) on the runs index, behind the store's back."""
    if isinstance(store, SQLiteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as conn, conn:
            assert conn.execute(statement, params).rowcount == 1
    else:
        assert isinstance(store, PostgresStore)
        with _pg(store) as conn:
            assert conn.execute(statement.replace("?", "%s"), params).rowcount == 1


def set_index_column(store: Store, run_id: str, column: str, value: object) -> None:
    """Set one column of a run's runs-index row, its checksum left as it was."""
    index_sql(store, f"UPDATE runs SET {column} = ? WHERE run_id = ?", (value, run_id))


@contextlib.contextmanager
def _pg(store: PostgresStore) -> Any:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(store.schema)))
        yield conn
