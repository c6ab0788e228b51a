"""The PostgreSQL store: the journal for runs spread over several processes or hosts.

Each runs-index row carries the crc32 of its fields (:func:`row_checksum`), as in the
SQLite store: a row that fails it is reported (:class:`IndexDamaged`), never believed.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio

from .._exceptions import IndexDamaged, RunNotFound, StoreError

try:
    import psycopg
    from psycopg import errors, sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo
except ImportError as exc:
    raise StoreError(
        "a postgresql:// store needs psycopg, which is not installed; "
        "install it with pip install 'interlock[postgres]'"
    ) from exc

from ._base import (
    RunRecord,
    Store,
    another_writer,
    check_batch,
    decode_chunks,
    encode_rows,
    index_updates,
    looked_up,
    missing_index_row,
    missing_journal,
    record_checksum,
    row_checksum,
    select_runs,
    stored_record,
    verified_record,
)
from ._check import Checker, CheckReport

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._events import Event, JournalEvent

_T = TypeVar("_T")

#: The schema version this module writes. A database from a newer version is refused;
#: one from version 1 (no checksums in the runs index) is upgraded when opened for
#: writing, and read as it is when opened read-only.
SCHEMA_VERSION = 2

#: Seconds to wait for the server when connecting, unless the DSN sets ``connect_timeout``.
CONNECT_TIMEOUT = 10

# NOTE: run ids use the "C" collation so that ``ORDER BY started, run_id`` sorts
# by code point, as the memory and SQLite stores do, whatever the database locale.
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name text PRIMARY KEY, value text NOT NULL)",
    """CREATE TABLE IF NOT EXISTS events (
        run_id text COLLATE "C" NOT NULL,
        seq bigint NOT NULL,
        kind text NOT NULL,
        ts double precision NOT NULL,
        key text,
        body bytea NOT NULL,
        PRIMARY KEY (run_id, seq)
    )""",
    # NOTE: idempotency keys are unique in the whole schema, whichever worker
    # records them, so a recovered intent can never be recorded twice.
    "CREATE UNIQUE INDEX IF NOT EXISTS events_intent_key ON events (key) "
    "WHERE kind = 'intent_recorded'",
    # crc: row_checksum of the other columns. No index beyond the key: listing reads
    # every row anyway, to check each one (a filter in SQL would silently skip a row
    # whose damage unmatched it).
    """CREATE TABLE IF NOT EXISTS runs (
        run_id text COLLATE "C" PRIMARY KEY,
        machine text NOT NULL,
        state text NOT NULL,
        outcome text NOT NULL,
        seq bigint NOT NULL,
        started double precision NOT NULL,
        updated double precision NOT NULL,
        reason text NOT NULL DEFAULT '',
        detail text NOT NULL DEFAULT '',
        crc bigint
    )""",
)
#: Version 1 to 2: checksums in the runs index (filled in by _checksum_index), and
#: none of the indexes listing no longer uses.
_UPGRADE_FROM_1 = (
    "ALTER TABLE runs ADD COLUMN IF NOT EXISTS crc bigint",
    "DROP INDEX IF EXISTS runs_started",
    "DROP INDEX IF EXISTS runs_outcome",
    "DROP INDEX IF EXISTS runs_machine",
)

_RUN_COLUMNS = "run_id, machine, state, outcome, seq, started, updated, reason, detail"
_COPY_EVENTS = "COPY events (run_id, seq, kind, ts, key, body) FROM STDIN (FORMAT BINARY)"
_COPY_TYPES = ("text", "int8", "text", "float8", "text", "bytea")
_UPSERT_RUNS = (
    f"INSERT INTO runs ({_RUN_COLUMNS}, crc) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::int8[], "
    "%s::float8[], %s::float8[], %s::text[], %s::text[], %s::int8[]) "
    "ON CONFLICT (run_id) DO UPDATE SET machine = EXCLUDED.machine, state = EXCLUDED.state, "
    "outcome = EXCLUDED.outcome, seq = EXCLUDED.seq, started = EXCLUDED.started, "
    "updated = EXCLUDED.updated, reason = EXCLUDED.reason, detail = EXCLUDED.detail, "
    "crc = EXCLUDED.crc"
)
_SELECT_RUNS_IN = f"SELECT {_RUN_COLUMNS}, crc FROM runs WHERE run_id = ANY(%s::text[])"
_LAST_SEQS_IN = "SELECT run_id, max(seq) FROM events WHERE run_id = ANY(%s::text[]) GROUP BY run_id"
_SELECT_KEYS_IN = (
    "SELECT key FROM events WHERE kind = 'intent_recorded' AND key = ANY(%s::text[]) LIMIT 1"
)


def _checksum_index(conn: psycopg.Connection[Any]) -> None:
    """Give every runs-index row that has none its checksum (upgrading from version 1).

    A row damaged before this gets a checksum of its damage: :meth:`PostgresStore.check`
    still finds it, by comparing the row with its run's journal.
    """
    rows = conn.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE crc IS NULL").fetchall()
    if rows:
        conn.execute(
            "UPDATE runs SET crc = u.crc FROM unnest(%s::text[], %s::int8[]) AS u(run_id, crc) "
            "WHERE runs.run_id = u.run_id",
            ([row[0] for row in rows], [row_checksum(*row) for row in rows]),
        )


def _reason(exc: BaseException) -> str:
    """The server's or libpq's message, on one line."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def describe_dsn(dsn: str) -> str:
    """Name the server and database of ``dsn`` for a message, never its password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "PostgreSQL (invalid DSN)"
    host = params.get("host") or os.environ.get("PGHOST") or "the local socket"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or "the default database"
    where = host if str(host).startswith("/") or host == "the local socket" else f"{host}:{port}"
    return f"PostgreSQL database {dbname!r} at {where}"


def _connect(dsn: str, schema: str, readonly: bool) -> tuple[psycopg.Connection[Any], int]:
    """Connect and prepare the schema; also return its version (after any upgrade)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        # NOTE: psycopg's text quotes the offending part, which may be the password.
        raise StoreError(
            "the PostgreSQL DSN is not valid; expected postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME"
        ) from None
    where = describe_dsn(dsn)
    if "connect_timeout" not in params:
        dsn = make_conninfo(dsn, connect_timeout=CONNECT_TIMEOUT)
    try:
        conn = psycopg.connect(dsn, autocommit=True)
    except psycopg.Error as exc:
        raise StoreError(
            f"cannot connect to {where}: {_reason(exc)}; check that the server is running "
            "and that the DSN's host, port, user, password and database are right"
        ) from None
    try:
        return conn, _prepare(conn, where, schema, readonly=readonly)
    except Exception:
        conn.close()
        raise


def _prepare(conn: psycopg.Connection[Any], where: str, schema: str, *, readonly: bool) -> int:
    ident = sql.Identifier(schema)
    try:
        with conn.transaction():
            # Two processes opening a fresh database at once must not race on CREATE.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"interlock:{schema}",))
            tables = {
                row[0]
                for row in conn.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                    (schema,),
                )
            }
            if readonly and "meta" not in tables:
                raise StoreError(
                    f"{where} has no interlock schema {schema!r}; check the DSN and the schema name"
                )
            if tables and "meta" not in tables:
                raise StoreError(
                    f"schema {schema!r} of {where} holds tables that are not interlock's; "
                    "pass another schema"
                )
            if not readonly:
                conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
            conn.execute(sql.SQL("SET search_path TO {}").format(ident))
            if not readonly:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO meta (name, value) VALUES ('schema_version', %s) "
                    "ON CONFLICT (name) DO NOTHING",
                    (str(SCHEMA_VERSION),),
                )
            row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            version = int(row[0]) if row is not None else None
            if version == 1 and not readonly:
                for statement in _UPGRADE_FROM_1:
                    conn.execute(statement)
                _checksum_index(conn)
                conn.execute(
                    "UPDATE meta SET value = %s WHERE name = 'schema_version'",
                    (str(SCHEMA_VERSION),),
                )
                version = SCHEMA_VERSION
        if version is None:
            raise StoreError(
                f"schema {schema!r} of {where} has no schema version; "
                "it was not created by interlock, pass another schema"
            )
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"schema {schema!r} of {where} has schema version {version}, newer than this "
                f"interlock supports ({SCHEMA_VERSION}); upgrade interlock to open it"
            )
        # NOTE: the transaction above ended, and SET (not SET LOCAL) outlives it.
        if readonly:
            conn.execute("SET default_transaction_read_only = on")
    except psycopg.Error as exc:
        raise StoreError(f"cannot set up schema {schema!r} in {where}: {_reason(exc)}") from exc
    return version


class PostgresStore(Store):
    """The journal and the runs index in a PostgreSQL schema.

    psycopg's async connection does not run under trio, so the store uses a sync
    connection from a worker thread (:func:`trio.to_thread.run_sync`), one hop per
    call, with a :class:`trio.Lock` around it. :meth:`append` writes a batch in one
    transaction: events by binary ``COPY``, then one ``INSERT ... ON CONFLICT``
    over ``unnest`` arrays for the runs index. A commit returns once PostgreSQL has
    flushed its WAL (with the server's default ``synchronous_commit = on``).

    A lost connection fails the call with :class:`StoreError`; the next call
    connects again.
    """

    kind = "postgresql"

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        dsn: str,
        *,
        schema: str,
        readonly: bool,
        checksums: bool = True,
    ) -> None:
        """Wrap an open, prepared connection; use :func:`open_postgres_store` instead.

        ``checksums`` is False only for a version 1 schema opened read-only.
        """
        self._conn: psycopg.Connection[Any] | None = conn
        self._dsn = dsn
        self._where = describe_dsn(dsn)
        self._schema = schema
        self._readonly = readonly
        self._lock = trio.Lock()
        self._columns = f"{_RUN_COLUMNS}, crc" if checksums else _RUN_COLUMNS
        self._read = verified_record if checksums else stored_record

    @classmethod
    async def open(
        cls, dsn: str, *, schema: str = "interlock", readonly: bool = False
    ) -> PostgresStore:
        """Same as :func:`open_postgres_store`."""
        return await open_postgres_store(dsn, schema=schema, readonly=readonly)

    @property
    def schema(self) -> str:
        """The PostgreSQL schema holding the store's tables."""
        return self._schema

    @property
    def readonly(self) -> bool:
        """Whether the store was opened read-only."""
        return self._readonly

    def __repr__(self) -> str:
        return f"<PostgresStore {self._where}, schema {self._schema!r}>"

    async def _call(self, what: str, fn: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        """Run ``fn(conn)`` in a worker thread, holding the lock; map psycopg errors."""
        async with self._lock:
            if self._conn is None:
                raise StoreError("store is closed")
            try:
                return await trio.to_thread.run_sync(self._with_connection, fn)
            except errors.DiskFull as exc:
                raise StoreError(
                    f"journal {self._where}, schema {self._schema!r}: disk is full on the "
                    f"server ({_reason(exc)}), so {what} wrote nothing; free space there, "
                    "then retry"
                ) from exc
            except psycopg.Error as exc:
                if self._conn is not None and self._conn.broken:
                    raise StoreError(
                        f"{self._where}: {what} failed: {_reason(exc)}; the connection was "
                        "lost and the next call reconnects"
                    ) from exc
                raise StoreError(f"{self._where}: {what} failed: {_reason(exc)}") from exc

    def _with_connection(self, fn: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        conn = self._conn
        assert conn is not None
        if conn.broken or conn.closed:
            conn.close()
            self._conn = conn = _connect(self._dsn, self._schema, self._readonly)[0]
        return fn(conn)

    async def append(self, events: Sequence[Event]) -> None:
        """Append one batch in one transaction; see :meth:`Store.append`.

        Raises:
          StoreError: the store is closed or read-only, a seq or an idempotency key
            is already stored (another process advanced a run, say), or the server
            failed or went away; nothing of the batch was written.
          IndexDamaged: the index row of a run the batch continues is damaged.
        """
        if self._readonly:
            raise StoreError(
                f"store {self._where}, schema {self._schema!r} is read-only; "
                "open it without readonly=True to append"
            )
        if not events:
            await trio.lowlevel.checkpoint()
            return
        params = encode_rows(events)
        run_ids = list(dict.fromkeys(r[0] for r in params))
        keys = [r[4] for r in params if r[2] == "intent_recorded"]
        await self._call("append", lambda conn: _append_sync(conn, events, params, run_ids, keys))
        self.bytes_written += sum(len(row[5]) for row in params)

    async def load(self, run_id: str) -> list[JournalEvent]:
        select_run = f"SELECT {self._columns} FROM runs WHERE run_id = %s"

        def fetch(conn: psycopg.Connection[Any]) -> tuple[Any, list[tuple[int, int, bytes]]]:
            # The index row first: the journal only grows, so it cannot then be shorter.
            row = conn.execute(select_run, (run_id,)).fetchone()
            with conn.cursor(binary=True) as cursor:
                cursor.execute(
                    "SELECT seq, seq, body FROM events WHERE run_id = %s ORDER BY seq", (run_id,)
                )
                return row, cursor.fetchall()

        row, events = await self._call("load", fetch)
        if row is None:
            if events:
                raise missing_index_row(run_id)
            raise RunNotFound(run_id)
        record = looked_up(run_id, self._read(row))
        if not events:
            raise missing_journal(run_id, record.seq)
        return decode_chunks(run_id, events, record.seq)

    async def get_run(self, run_id: str) -> RunRecord:
        select_run = f"SELECT {self._columns} FROM runs WHERE run_id = %s"

        def fetch(conn: psycopg.Connection[Any]) -> tuple[Any, bool]:
            row = conn.execute(select_run, (run_id,)).fetchone()
            journaled = row is None and (
                conn.execute("SELECT 1 FROM events WHERE run_id = %s LIMIT 1", (run_id,)).fetchone()
                is not None
            )
            return row, journaled

        row, journaled = await self._call("get_run", fetch)
        if row is None:
            if journaled:
                raise missing_index_row(run_id)
            raise RunNotFound(run_id)
        return looked_up(run_id, self._read(row))

    async def list_runs(
        self,
        *,
        machine: str | None = None,
        state: str | None = None,
        outcome: str | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        select = f"SELECT {self._columns} FROM runs"
        rows = await self._call("list_runs", lambda conn: conn.execute(select).fetchall())
        read = self._read
        return select_runs(
            [read(row) for row in rows], machine=machine, state=state, outcome=outcome, limit=limit
        )

    async def check(self) -> CheckReport:
        return await self._call("check", self._check_sync)

    def _check_sync(self, conn: psycopg.Connection[Any]) -> CheckReport:
        # One snapshot of every table, even while writers go on.
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            index: dict[str, RunRecord] = {}
            damaged: list[IndexDamaged] = []
            for row in conn.execute(f"SELECT {self._columns} FROM runs"):
                try:
                    record = self._read(row)
                except IndexDamaged as exc:
                    damaged.append(exc)
                else:
                    index[record.run_id] = record
            checker = Checker(index, damaged)
            with conn.cursor("interlock_check", binary=True) as cursor:
                cursor.execute("SELECT run_id, seq, seq, body FROM events ORDER BY run_id, seq")
                for run_id, rows in itertools.groupby(cursor, key=lambda row: row[0]):
                    checker.run(run_id, [row[1:] for row in rows])
            intents = conn.execute(
                "SELECT key, run_id, seq FROM events WHERE kind = 'intent_recorded'"
            )
            checker.intents_table(intents, "the events table's key column")
        return checker.report()

    async def aclose(self) -> None:
        # NOTE: shielded, so a cancelled caller still closes the connection.
        with trio.CancelScope(shield=True):
            async with self._lock:
                conn, self._conn = self._conn, None
                if conn is not None:
                    await trio.to_thread.run_sync(conn.close)


def _append_sync(
    conn: psycopg.Connection[Any],
    events: Sequence[Event],
    params: list[tuple[Any, ...]],
    run_ids: list[str],
    keys: list[str | None],
) -> None:
    try:
        with conn.transaction(), conn.cursor() as cursor:
            # NOTE: never a prepared statement: its generic plan for ANY(array) scans
            # the whole runs table once PostgreSQL switches to it.
            cursor.execute(_SELECT_RUNS_IN, (run_ids,), prepare=False)
            current = {row[0]: verified_record(row) for row in cursor.fetchall()}
            check_batch(events, {run_id: record.seq for run_id, record in current.items()})
            updates = index_updates(events, current)
            with cursor.copy(_COPY_EVENTS) as copy:
                copy.set_types(list(_COPY_TYPES))
                for row in params:
                    copy.write_row(row)
            rows = [(*msgspec.structs.astuple(r), record_checksum(r)) for r in updates.values()]
            cursor.execute(_UPSERT_RUNS, [list(column) for column in zip(*rows, strict=True)])
    except errors.UniqueViolation as exc:
        if exc.diag.constraint_name == "events_intent_key" and keys:
            found = conn.execute(_SELECT_KEYS_IN, (keys,)).fetchone()
            key = found[0] if found else None
            raise StoreError(
                f"idempotency key {key!r} was already recorded; nothing was written"
            ) from exc
        if exc.diag.constraint_name == "events_pkey":
            # Another writer committed events of a run after this batch read its row.
            first: dict[str, int] = {}
            for event in events:
                first.setdefault(event.run_id, event.seq)
            for run_id, stored in conn.execute(_LAST_SEQS_IN, (run_ids,)).fetchall():
                if stored >= first[run_id]:
                    raise another_writer(run_id, stored, first[run_id]) from exc
        raise StoreError(
            f"the batch breaks a constraint ({_reason(exc)}); nothing was written"
        ) from exc


async def open_postgres_store(
    dsn: str, *, schema: str = "interlock", readonly: bool = False
) -> PostgresStore:
    """Connect to PostgreSQL and open (creating, if missing) the store in ``schema``.

    Args:
      dsn: a libpq connection string or URL, e.g.
        ``postgresql://interlock@db.internal:5432/agents``.
      schema: the PostgreSQL schema holding the tables; created if missing. The
        connection's ``search_path`` is set to it.
      readonly: open an existing schema for reading only: nothing is created and
        :meth:`PostgresStore.append` raises.

    Raises:
      StoreError: the DSN is invalid, the server cannot be reached or refuses the
        login (the message names host and database, never the password), the
        schema holds other tables, or its version is newer than this interlock.
    """
    if not schema:
        raise ValueError("schema must be a non-empty PostgreSQL schema name")
    conn, version = await trio.to_thread.run_sync(_connect, dsn, schema, readonly)
    return PostgresStore(
        conn, dsn, schema=schema, readonly=readonly, checksums=version >= SCHEMA_VERSION
    )
