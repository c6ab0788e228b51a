"""What only the PostgreSQL store does: connection errors, schemas, reconnecting."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import msgspec
import psycopg
import pytest
import trio
from psycopg import sql

from interlock.core._events import IntentRecorded, RunStarted, Transitioned
from interlock.core._exceptions import StoreError
from interlock.stores import (
    CheckProblem,
    IndexDamaged,
    PostgresStore,
    open_postgres_store,
    open_store,
)
from interlock.stores._base import index_updates

from .conftest import PG_DSN, PG_SKIP_REASON

needs_postgres = pytest.mark.skipif(not PG_DSN, reason=PG_SKIP_REASON)


def admin(statement: sql.Composable | str, params: tuple[object, ...] = ()) -> None:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(statement, params)


@pytest.fixture
def schema() -> Iterator[str]:
    """A schema name nobody uses yet; dropped after the test."""
    name = f"interlock_test_{secrets.token_hex(6)}"
    yield name
    admin(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


async def test_refused_connection_names_host_and_database_not_password() -> None:
    dsn = "postgresql://agent:s3cret-pw@127.0.0.1:1/journal"
    with pytest.raises(
        StoreError,
        match=r"^cannot connect to PostgreSQL database 'journal' at 127\.0\.0\.1:1: .*"
        r"check that the server is running and that the DSN's host, port, user, password "
        r"and database are right$",
    ) as info:
        await open_postgres_store(dsn)
    assert "s3cret-pw" not in str(info.value)
    assert "\n" not in str(info.value)


async def test_invalid_dsn_does_not_echo_it() -> None:
    with pytest.raises(
        StoreError,
        match=r"^the PostgreSQL DSN is not valid; "
        r"expected postgresql://USER\[:PASSWORD\]@HOST\[:PORT\]/DBNAME$",
    ) as info:
        await open_store("postgresql://agent:bad pw@host/db")
    assert "bad pw" not in str(info.value)


@pytest.mark.postgres
@needs_postgres
async def test_schema_and_tables_are_created(schema: str) -> None:
    async with await open_postgres_store(PG_DSN, schema=schema) as store:
        assert isinstance(store, PostgresStore)
        assert store.schema == schema
    with psycopg.connect(PG_DSN) as conn:
        tables = {
            row[0]
            for row in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,),
            )
        }
        version = conn.execute(
            sql.SQL("SELECT value FROM {}.meta WHERE name = 'schema_version'").format(
                sql.Identifier(schema)
            )
        ).fetchone()
    assert tables == {"meta", "events", "runs", "leases"}
    assert version == ("3",)


@pytest.mark.postgres
@needs_postgres
async def test_readonly_open_of_a_missing_schema_creates_nothing(schema: str) -> None:
    with pytest.raises(StoreError, match=rf"has no interlock schema '{schema}'; check the DSN"):
        await open_postgres_store(PG_DSN, schema=schema, readonly=True)
    with psycopg.connect(PG_DSN) as conn:
        found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    assert found is None


@pytest.mark.postgres
@needs_postgres
async def test_readonly_store_reads_and_refuses_appends(schema: str) -> None:
    event = RunStarted(run_id="r-1", seq=1, ts=1.0, machine="m", state="A")
    async with await open_postgres_store(PG_DSN, schema=schema) as store:
        await store.append([event])
    async with await open_postgres_store(PG_DSN, schema=schema, readonly=True) as store:
        assert await store.load("r-1") == [event]
        with pytest.raises(StoreError, match=r"is read-only; open it without readonly=True"):
            await store.append([event])


@pytest.mark.postgres
@needs_postgres
async def test_foreign_schema_is_refused(schema: str) -> None:
    admin(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    admin(sql.SQL("CREATE TABLE {}.customers (id int)").format(sql.Identifier(schema)))
    with pytest.raises(StoreError, match=r"holds tables that are not interlock's; pass another"):
        await open_postgres_store(PG_DSN, schema=schema)


@pytest.mark.postgres
@needs_postgres
async def test_newer_schema_version_is_refused(schema: str) -> None:
    async with await open_postgres_store(PG_DSN, schema=schema):
        pass
    admin(
        sql.SQL("UPDATE {}.meta SET value = '99' WHERE name = 'schema_version'").format(
            sql.Identifier(schema)
        )
    )
    with pytest.raises(StoreError, match=r"has schema version 99, newer than this interlock"):
        await open_postgres_store(PG_DSN, schema=schema)


@pytest.mark.postgres
@needs_postgres
async def test_lost_connection_fails_one_call_then_reconnects(schema: str) -> None:
    event = RunStarted(run_id="r-1", seq=1, ts=1.0, machine="m", state="A")
    async with await open_postgres_store(PG_DSN, schema=schema) as store:
        await store.append([event])
        assert isinstance(store, PostgresStore)
        pid = store._conn.info.backend_pid  # type: ignore[union-attr]
        await trio.to_thread.run_sync(admin, "SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(
            StoreError, match=r"the connection was lost and the next call reconnects$"
        ):
            await store.load("r-1")
        assert await store.load("r-1") == [event]


_V1_RUNS = """CREATE TABLE {}.runs (
    run_id text COLLATE "C" PRIMARY KEY, machine text NOT NULL, state text NOT NULL,
    outcome text NOT NULL, seq bigint NOT NULL, started double precision NOT NULL,
    updated double precision NOT NULL, reason text NOT NULL DEFAULT '',
    detail text NOT NULL DEFAULT '')"""


@pytest.mark.postgres
@needs_postgres
async def test_version_1_schema_is_read_as_it_is_then_upgraded(schema: str) -> None:
    """A schema written before the runs index had checksums (version 1)."""
    one = [
        RunStarted(run_id="r-1", seq=1, ts=1.0, machine="m", state="A"),
        Transitioned(run_id="r-1", seq=2, ts=2.0, src="A", dst="B"),
    ]
    async with await open_postgres_store(PG_DSN, schema=schema) as store:
        await store.append(one)
    # Back to version 1: its runs table, its three indexes, its version.
    ident = sql.Identifier(schema)
    admin(sql.SQL("DROP TABLE {}.runs").format(ident))
    admin(sql.SQL(_V1_RUNS).format(ident))
    for name, columns in [
        ("runs_started", "started, run_id"),
        ("runs_outcome", "outcome, started, run_id"),
        ("runs_machine", "machine, started, run_id"),
    ]:
        admin(sql.SQL(f"CREATE INDEX {name} ON {{}}.runs ({columns})").format(ident))
    record = index_updates(one, {})["r-1"]
    admin(
        sql.SQL("INSERT INTO {}.runs VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)").format(ident),
        msgspec.structs.astuple(record),
    )
    admin(sql.SQL("UPDATE {}.meta SET value = '1' WHERE name = 'schema_version'").format(ident))
    async with await open_postgres_store(PG_DSN, schema=schema, readonly=True) as store:
        assert await store.list_runs() == [record]
        assert await store.load("r-1") == one
        assert (await store.check()).ok
    async with await open_postgres_store(PG_DSN, schema=schema) as store:
        assert await store.get_run("r-1") == record
        await store.append([Transitioned(run_id="r-1", seq=3, ts=3.0, src="B", dst="C")])
        assert (await store.get_run("r-1")).state == "C"
    with psycopg.connect(PG_DSN) as conn:
        indexes = conn.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = 'runs'",
            (schema,),
        ).fetchall()
        version = conn.execute(
            sql.SQL("SELECT value FROM {}.meta WHERE name = 'schema_version'").format(ident)
        ).fetchone()
    assert sorted(indexes) == [("runs_pkey",), ("runs_unfinished",)]
    assert version == ("3",)
    # Every row has its checksum now: a change behind the store's back is found.
    admin(sql.SQL("UPDATE {}.runs SET outcome = 'completed'").format(ident))
    async with await open_postgres_store(PG_DSN, schema=schema, readonly=True) as store:
        with pytest.raises(IndexDamaged, match=r"^runs index row of run 'r-1' is damaged "):
            await store.unfinished()


@pytest.mark.postgres
@needs_postgres
async def test_an_event_another_writer_committed_first_is_named(schema: str) -> None:
    """Two writers read a run's row at the same seq; the second one's insert then breaks the
    key (run_id, seq). Here the first writer's event is inserted behind the store's back."""
    events = [
        RunStarted(run_id="r-1", seq=1, ts=1.0, machine="m", state="A"),
        Transitioned(run_id="r-1", seq=2, ts=2.0, src="A", dst="B"),
    ]
    async with await open_postgres_store(PG_DSN, schema=schema) as store:
        await store.append(events[:1])
        admin(
            sql.SQL(
                "INSERT INTO {}.events VALUES ('r-1', 2, 'transitioned', 2.0, NULL, '')"
            ).format(sql.Identifier(schema))
        )
        with pytest.raises(StoreError) as info:
            await store.append(events[1:])
        assert str(info.value) == (
            "run 'r-1' is already at seq 2 in the store, so this batch cannot append seq 2: "
            "another process advanced the run; keep one writer per SQLite journal, and on "
            "PostgreSQL drive runs through leases (a supervisor, `interlock worker` or "
            "`interlock resume` takes them); nothing was written"
        )


@pytest.mark.postgres
@needs_postgres
async def test_the_intent_keys_are_checked_against_the_journal(schema: str) -> None:
    """The kind and key columns of the events table make the keys unique; they are derived
    from the frames, and checked against them."""
    events = [
        RunStarted(run_id="r-1", seq=1, ts=1.0, machine="m", state="A"),
        IntentRecorded(run_id="r-1", seq=2, ts=2.0, state="A", tool="pay", args={}, key="k-1"),
    ]
    async with await open_postgres_store(PG_DSN, schema=schema) as store:
        await store.append(events)
        admin(
            sql.SQL("UPDATE {}.events SET kind = 'transitioned' WHERE seq = 2").format(
                sql.Identifier(schema)
            )
        )
        assert (await store.check()).problems == (
            CheckProblem(
                run_id="r-1",
                seq=2,
                message="the events table's key column lacks idempotency key 'k-1' of run 'r-1' "
                "seq 2, so a second intent with that key would not be refused; restore it from "
                "a backup",
            ),
        )
