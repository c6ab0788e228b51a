"""Fixtures for the store tests: one ``store`` per backend, each fresh per test."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator

import psycopg
import pytest
import trio
from psycopg import sql

from interlock.stores import MemoryStore, Store, open_postgres_store, open_sqlite_store

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
    schema = None
    if kind == "memory":
        opened: Store = MemoryStore()
    elif kind == "sqlite":
        path = os.path.join(tmp_path, f"journal-{secrets.token_hex(4)}.db")
        opened = await open_sqlite_store(path)
    else:
        schema = f"interlock_test_{secrets.token_hex(6)}"
        opened = await open_postgres_store(PG_DSN, schema=schema)
    try:
        yield opened
    finally:
        with trio.CancelScope(shield=True):
            await opened.aclose()
            if schema is not None:
                await trio.to_thread.run_sync(_drop_schema, schema)


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
