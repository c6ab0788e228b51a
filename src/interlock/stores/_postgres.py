"""The PostgreSQL store: the journal for runs spread over several processes or hosts.

Each runs-index row carries the crc32 of its fields (:func:`row_checksum`), as in the
SQLite store: a row that fails it is reported (:class:`IndexDamaged`), never believed.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio

from ..core._events import RunStarted
from ..core._exceptions import IndexDamaged, RunNotFound, StoreError

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
    RUNNING,
    RunRecord,
    Store,
    another_writer,
    check_batch,
    decode_chunks,
    decode_chunks_after,
    encode_rows,
    index_updates,
    looked_up,
    missing_index_row,
    missing_journal,
    read_chunk,
    record_checksum,
    row_checksum,
    select_runs,
    stored_record,
    verified_record,
)
from ._check import Checker, CheckReport
from ._leases import (
    DEFAULT_CLAIM_LIMIT,
    DEFAULT_TTL,
    Lease,
    check_limit,
    check_owner,
    check_run_ids,
    check_ttl,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

    from ..core._events import Event, JournalEvent

_T = TypeVar("_T")

#: The schema version this module writes. A database from a newer version is refused;
#: one from version 1 (no checksums in the runs index) or 2 (no leases) is upgraded
#: when opened for writing, and read as it is when opened read-only.
SCHEMA_VERSION = 3

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
    # The unfinished runs, so that recovery reads them and not the whole index.
    "CREATE INDEX IF NOT EXISTS runs_unfinished ON runs (started, run_id) "
    "WHERE outcome = 'running'",
    # One row per run, written with its run_started. owner NULL: nobody holds it (never
    # claimed, or released). epoch: the fencing token, +1 on every claim. expires: the
    # server's clock ('-infinity': claimable at once). live: the run's outcome is
    # running; external: its caller drives it, so no worker may claim it.
    """CREATE TABLE IF NOT EXISTS leases (
        run_id text COLLATE "C" PRIMARY KEY,
        owner text,
        epoch bigint NOT NULL DEFAULT 0,
        expires timestamptz NOT NULL DEFAULT '-infinity',
        live boolean NOT NULL,
        external boolean NOT NULL DEFAULT false
    )""",
    # NOTE: the claim's order is the index's order, so a claim reads only the rows it
    # takes (STACK.md: ORDER BY run_id alone rescans every claimed row).
    "CREATE INDEX IF NOT EXISTS leases_claim ON leases (expires, run_id) "
    "WHERE live AND NOT external",
)
#: Version 1 to 2: checksums in the runs index (filled in by _checksum_index), and
#: none of the indexes listing no longer uses.
_UPGRADE_FROM_1 = (
    "ALTER TABLE runs ADD COLUMN IF NOT EXISTS crc bigint",
    "DROP INDEX IF EXISTS runs_started",
    "DROP INDEX IF EXISTS runs_outcome",
    "DROP INDEX IF EXISTS runs_machine",
)

#: Seconds the server lets a session of the store sit idle inside a transaction before it
#: ends it (never, for a process that is not stalled: its statements follow one another).
IDLE_IN_TRANSACTION = 5.0

#: Seconds one statement of a writing session may take before the server cancels it: far
#: more than any of the store's statements needs (a batch's insert takes milliseconds), so
#: only a statement stuck behind another session's locks reaches it.
STATEMENT_TIMEOUT = 10.0

_RUN_COLUMNS = "run_id, machine, state, outcome, seq, started, updated, reason, detail"
# NOTE: one statement holding the whole batch, never COPY FROM STDIN: a writer stopped
# (SIGSTOP, a paused VM) in the middle of a COPY leaves the server waiting for its data,
# where neither statement_timeout nor idle_in_transaction_session_timeout reaches it, and
# the batch's lease rows stay locked (the scale-out chaos test found it). Stopped between
# statements instead, the session is idle in its transaction and the server ends it.
_INSERT_EVENTS = (
    "INSERT INTO events (run_id, seq, kind, ts, key, body) "
    "SELECT * FROM unnest(%s::text[], %s::int8[], %s::text[], %s::float8[], %s::text[], "
    "%s::bytea[])"
)
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

#: The unfinished runs, through both partial indexes (see PostgresStore.unfinished).
_SELECT_UNFINISHED = (
    f"SELECT {_RUN_COLUMNS}, crc FROM runs WHERE outcome = 'running' UNION "
    f"SELECT {_RUN_COLUMNS}, crc FROM runs WHERE run_id IN "
    "(SELECT run_id FROM leases WHERE live AND NOT external)"
)
_RETURN_LEASES = "RETURNING l.run_id, l.owner, l.epoch, extract(epoch FROM l.expires)::float8"
#: New runs' lease rows: ``(run_id, owner, epoch, live, external)`` arrays and a ttl
#: (owner NULL, epoch 0: unowned and claimable at once).
_INSERT_LEASES = (
    "INSERT INTO leases (run_id, owner, epoch, expires, live, external) "
    "SELECT u.run_id, u.owner, u.epoch, CASE WHEN u.owner IS NULL THEN '-infinity' "
    "ELSE now() + make_interval(secs => %s) END, u.live, u.external "
    "FROM unnest(%s::text[], %s::text[], %s::int8[], %s::bool[], %s::bool[]) "
    "AS u(run_id, owner, epoch, live, external)"
)
_SET_LIVE = (
    "UPDATE leases SET live = u.live FROM unnest(%s::text[], %s::bool[]) AS u(run_id, live) "
    "WHERE leases.run_id = u.run_id"
)
# NOTE: the rows are locked in run_id order by every statement that waits for a lock
# (the fence, renew, release), so that two of them never deadlock; a claim skips
# locked rows instead of waiting. The locks are chosen so that a heartbeat never waits
# for a batch (issue 33: a renewal queued behind an open batch of its own worker cut
# calls as stalled at a 2 s ttl). The fence locks FOR KEY SHARE, the weakest lock:
# it conflicts only with FOR UPDATE, which a claim and a release take, so no claim
# can raise an epoch between the fence's check and its commit. A renewal locks FOR NO
# KEY UPDATE (it changes ``expires``, no key), which a fence does not block; and the
# fence's own transaction may then update a row it locked (``live``, when a run ends)
# without waiting for another worker's fence on it (two workers each fencing a run the
# other ends would deadlock under FOR SHARE:
# test_two_workers_each_stale_on_the_others_run_do_not_deadlock). That update of
# ``live`` (when a batch ends or resumes a run) is the batch's last statement, so a
# renewal of such a row waits only for the commit itself.
_FENCE = (
    "SELECT run_id, owner, epoch FROM leases WHERE run_id = ANY(%s::text[]) "
    "ORDER BY run_id FOR KEY SHARE"
)
_CLAIM = (
    "UPDATE leases AS l SET owner = %s, epoch = l.epoch + 1, "
    "expires = now() + make_interval(secs => %s) "
    "FROM (SELECT run_id FROM leases WHERE live AND NOT external AND expires < now() "
    "AND run_id <> ALL(%s::text[]) "
    "ORDER BY expires, run_id LIMIT %s FOR UPDATE SKIP LOCKED) AS c "
    f"WHERE l.run_id = c.run_id {_RETURN_LEASES}"
)
# A claim of named runs (an operator resuming an escalated run): taken unless another
# owner holds an unexpired lease of a live run; a run that is not live (escalated, or
# ended) is driven by nobody, whoever held it last.
_CLAIM_NAMED = (
    "UPDATE leases AS l SET owner = %s, epoch = l.epoch + 1, "
    "expires = now() + make_interval(secs => %s) "
    "FROM (SELECT run_id FROM leases WHERE run_id = ANY(%s::text[]) AND NOT external "
    "AND (NOT live OR owner IS NULL OR owner = %s OR expires < now()) "
    "ORDER BY run_id FOR UPDATE) AS c "
    f"WHERE l.run_id = c.run_id {_RETURN_LEASES}"
)
#: The unfinished runs others hold: live, driven by the runtime, leased and unexpired.
_HELD_ELSEWHERE = (
    "SELECT run_id, owner, epoch, extract(epoch FROM expires)::float8 FROM leases "
    "WHERE live AND NOT external AND owner IS NOT NULL AND owner <> %s AND expires >= now() "
    "ORDER BY expires, run_id"
)
# The runs-index rows of the batch's unfenced runs (external runs, which any gateway may
# drive), locked in run_id order until the commit: two writers of one such run then
# check its seq one after the other, and the second is refused alone, not its batch.
_LOCK_UNFENCED = (
    "SELECT run_id, seq FROM runs WHERE run_id = ANY(%s::text[]) ORDER BY run_id FOR NO KEY UPDATE"
)
_RENEW = (
    "UPDATE leases AS l SET expires = now() + make_interval(secs => %s) "
    "FROM (SELECT run_id FROM leases WHERE run_id = ANY(%s::text[]) AND owner = %s "
    "ORDER BY run_id FOR NO KEY UPDATE) AS h "
    f"WHERE l.run_id = h.run_id {_RETURN_LEASES}"
)
_RELEASE = (
    "UPDATE leases AS l SET owner = NULL, expires = now() "
    "FROM (SELECT run_id FROM leases WHERE run_id = ANY(%s::text[]) AND owner = %s "
    "ORDER BY run_id FOR UPDATE) AS h WHERE l.run_id = h.run_id"
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


def _fill_leases(conn: psycopg.Connection[Any]) -> None:
    """Give every run its lease row, unowned (upgrading from version 2).

    Whether a run is external is read from its run_started event; a run whose first
    event cannot be read is taken as driven by the runtime (``check`` reports it).
    """
    conn.execute(
        "INSERT INTO leases (run_id, live) SELECT run_id, outcome = 'running' FROM runs "
        "ON CONFLICT (run_id) DO NOTHING"
    )
    external: list[str] = []
    with conn.cursor(binary=True) as cursor:
        cursor.execute("SELECT run_id, body FROM events WHERE seq = 1 AND kind = 'run_started'")
        for run_id, body in cursor:
            started, _damage = read_chunk(run_id, 1, 1, bytes(body))
            if started and getattr(started[0], "external", False) is True:
                external.append(run_id)
    if external:
        conn.execute(
            "UPDATE leases SET external = true WHERE run_id = ANY(%s::text[])", (external,)
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
            current = None
            if "meta" in tables:
                found = conn.execute(
                    "SELECT value FROM meta WHERE name = 'schema_version'"
                ).fetchone()
                current = int(found[0]) if found is not None else None
            # NOTE: not even CREATE ... IF NOT EXISTS on a current schema: creating an
            # index waits for a lock on its table, and while it waits in the lock queue
            # every other writer's INSERT waits behind it (a stalled worker's open
            # transaction would hold up every process that connects).
            if not readonly and current != SCHEMA_VERSION:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO meta (name, value) VALUES ('schema_version', %s) "
                    "ON CONFLICT (name) DO NOTHING",
                    (str(SCHEMA_VERSION),),
                )
            row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            version = int(row[0]) if row is not None else None
            if version in (1, 2) and not readonly:
                if version == 1:
                    for statement in _UPGRADE_FROM_1:
                        conn.execute(statement)
                    _checksum_index(conn)
                # Version 2 to 3: the leases (their table and indexes are created above).
                _fill_leases(conn)
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
        # A process stopped inside a transaction (SIGSTOP, a pause) would hold its lease
        # rows locked, and claims skip locked rows: the server ends such a transaction.
        conn.execute(
            sql.SQL("SET idle_in_transaction_session_timeout = {}").format(
                sql.Literal(f"{int(IDLE_IN_TRANSACTION * 1000)}ms")
            )
        )
        if not readonly:
            # ...and a statement that runs too long: the server cancels it, the transaction
            # ends, and its lease rows are free for another worker's claim. (A statement
            # waiting on its client's data would not be reached: see _INSERT_EVENTS.)
            conn.execute(
                sql.SQL("SET statement_timeout = {}").format(
                    sql.Literal(f"{int(STATEMENT_TIMEOUT * 1000)}ms")
                )
            )
    except psycopg.Error as exc:
        raise StoreError(f"cannot set up schema {schema!r} in {where}: {_reason(exc)}") from exc
    return version


class PostgresStore(Store):
    """The journal and the runs index in a PostgreSQL schema.

    psycopg's async connection does not run under trio, so the store uses a sync
    connection from a worker thread (:func:`trio.to_thread.run_sync`), one hop per
    call, with a :class:`trio.Lock` around it. Lease renewals (a worker's heartbeat) use a
    second connection, opened at the first renewal, so that they never wait for the
    journal's writes. :meth:`append` writes a batch in one
    transaction: events by one ``INSERT`` over ``unnest`` arrays, then one
    ``INSERT ... ON CONFLICT`` over ``unnest`` arrays for the runs index. A commit returns once PostgreSQL has
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
        leases: bool = True,
    ) -> None:
        """Wrap an open, prepared connection; use :func:`open_postgres_store` instead.

        ``checksums`` is False only for a version 1 schema opened read-only, ``leases``
        only for a version 1 or 2 schema opened read-only.
        """
        self._conn: psycopg.Connection[Any] | None = conn
        self._dsn = dsn
        self._where = describe_dsn(dsn)
        self._schema = schema
        self._readonly = readonly
        self._lock = trio.Lock()
        # NOTE: renewals have a connection of their own, opened at the first one: on the
        # journal's, a heartbeat waited behind the batch writes and the claimed runs' loads
        # (seconds, under load) while the leases' sure time ran out, and calls were cut
        # as if this process had stalled (issue 33).
        self._renewals: psycopg.Connection[Any] | None = None
        self._renewals_lock = trio.Lock()
        self._columns = f"{_RUN_COLUMNS}, crc" if checksums else _RUN_COLUMNS
        self._read = verified_record if checksums else stored_record
        self._leases = leases
        self._after_fence_check: Callable[[], object] | None = None

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

    async def _call(
        self, what: str, fn: Callable[[psycopg.Connection[Any]], _T], *, renewal: bool = False
    ) -> _T:
        """Run ``fn(conn)`` in a worker thread, holding the connection's lock; map psycopg
        errors. ``renewal``: on the leases' connection (claims and renewals), not the
        journal's."""
        async with self._renewals_lock if renewal else self._lock:
            if self._conn is None:
                raise StoreError("store is closed")
            try:
                return await trio.to_thread.run_sync(self._with_connection, fn, renewal)
            except errors.DiskFull as exc:
                raise StoreError(
                    f"journal {self._where}, schema {self._schema!r}: disk is full on the "
                    f"server ({_reason(exc)}), so {what} wrote nothing; free space there, "
                    "then retry"
                ) from exc
            except psycopg.Error as exc:
                conn = self._renewals if renewal else self._conn
                if conn is not None and conn.broken:
                    raise StoreError(
                        f"{self._where}: {what} failed: {_reason(exc)}; the connection was "
                        "lost and the next call reconnects"
                    ) from exc
                raise StoreError(f"{self._where}: {what} failed: {_reason(exc)}") from exc

    def _with_connection(self, fn: Callable[[psycopg.Connection[Any]], _T], renewal: bool) -> _T:
        conn = self._renewals if renewal else self._conn
        if conn is None or conn.broken or conn.closed:
            if conn is not None:
                conn.close()
            conn = _connect(self._dsn, self._schema, self._readonly)[0]
            if renewal:
                self._renewals = conn
            else:
                self._conn = conn
        return fn(conn)

    async def probe_write(self) -> None:
        """See :meth:`Store.probe_write`: a row written to the meta table and deleted in
        one committed transaction (the server must be able to write and flush it)."""
        if self._readonly:
            raise StoreError(
                f"store {self._where}, schema {self._schema!r} is read-only; "
                "open it without readonly=True to write"
            )
        await self._call("a write probe", _probe_sync)

    async def append(self, events: Sequence[Event]) -> None:
        """Append one batch in one transaction; see :meth:`Store.append`.

        Unfenced: it writes whoever holds the runs' leases. It is the path of a single
        writer, and of runs started with no worker attached (their leases are nobody's,
        so any worker may claim them); a worker appends with :meth:`append_fenced`.

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
        _refused, written = await self._call(
            "append", lambda conn: _append_sync(conn, events, params)
        )
        self.bytes_written += written

    async def append_fenced(
        self,
        events: Sequence[Event],
        fence: Mapping[str, int],
        owner: str,
        *,
        ttl: float = DEFAULT_TTL,
        unfenced: Collection[str] = (),
    ) -> frozenset[str]:
        """Append one batch, each run's events only if ``owner`` still holds its lease.

        The group commit of a worker: one transaction, the lease rows of the batch's
        runs locked (``FOR KEY SHARE``) from their check to the commit, so a claim
        taking one over either skips it until the commit or is seen by the check,
        never both commit; a renewal of those leases does not wait for the commit. The runs whose lease is no longer ``(owner, fence[run_id])`` are
        refused, none of their events written; the others commit, with their
        runs-index rows, as :meth:`append` writes them (seqs checked, intent keys
        unique). A lease past its expiry that no one claimed since is still held.

        A run the batch starts (its first event ``run_started``) needs no entry in
        ``fence``: its lease is taken in the same transaction, ``owner`` holding it at
        epoch 1 for ``ttl`` seconds.

        Args:
          events: one batch, any runs, each run's in seq order.
          fence: the epoch of ``owner``'s lease of each run of the batch (it may hold
            other runs too).
          owner: the worker appending.
          ttl: seconds the lease of a run the batch starts lasts.
          unfenced: runs written with no lease check, only the seq check of
            :meth:`append`: the external runs, whose callers drive them through any
            gateway (two writers of one conflict on a seq, and the second is refused).

        Returns:
          the run ids refused (raise :class:`LeaseLost` for each, and drop them).

        Raises:
          ValueError: ``owner`` or ``ttl`` is unusable, or a run of the batch has no
            fence and does not start in it.
          StoreError: as :meth:`append`, for the runs that were not refused; then
            nothing of the batch was written.
          IndexDamaged: the index row of a run the batch continues is damaged.
        """
        check_owner(owner)
        ttl = check_ttl(ttl)
        self._writable("append_fenced")
        if not events:
            await trio.lowlevel.checkpoint()
            return frozenset()
        seen: set[str] = set()
        for event in events:
            run_id = event.run_id
            if run_id not in seen:
                seen.add(run_id)
                if run_id not in fence and run_id not in unfenced and type(event) is not RunStarted:
                    raise ValueError(
                        f"run {run_id!r} has no epoch in fence, and the batch does not start "
                        "it; pass the epoch of its lease (only a run the batch starts with "
                        "run_started may have none)"
                    )
        params = encode_rows(events)
        guard = _Fence(owner, fence, ttl, frozenset(unfenced), self._after_fence_check)
        refused, written = await self._call(
            "append_fenced", lambda conn: _append_sync(conn, events, params, guard)
        )
        self.bytes_written += written
        return refused

    async def claim(
        self,
        owner: str,
        *,
        limit: int = DEFAULT_CLAIM_LIMIT,
        ttl: float = DEFAULT_TTL,
        run_ids: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
    ) -> list[Lease]:
        """Lease up to ``limit`` claimable runs to ``owner`` for ``ttl`` seconds.

        Claimable: outcome running, driven by the runtime (an external run's caller
        drives it, so no worker claims it), and no lease, a released one or an expired
        one, the longest expired first. One statement, ``FOR UPDATE SKIP LOCKED``, so
        concurrent claims never take the same run; each claim gives its run the next
        epoch. Expiry is the database server's clock.

        With ``run_ids``, only those runs, whether live or not (an escalated run an
        operator resumes), each unless it is live and another owner holds an unexpired
        lease of it;
        ``limit`` does not apply. ``exclude``: runs not to claim (those ``owner`` holds
        already: one past its expiry is renewed, not claimed again).

        Returns:
          the leases granted, by run id (empty when nothing is claimable).

        Raises:
          ValueError: ``owner``, ``limit`` or ``ttl`` is unusable.
          StoreError: the store is closed or read-only, or the server failed.
        """
        check_owner(owner)
        limit = check_limit(limit)
        ttl = check_ttl(ttl)
        self._writable("claim")
        if run_ids is not None:
            ids = check_run_ids(run_ids)
            if not ids:
                await trio.lowlevel.checkpoint()
                return []
            return await self._granted(
                "claim", _CLAIM_NAMED, (owner, ttl, ids, owner), renewal=True
            )
        skip = check_run_ids(exclude)
        # NOTE: on the leases' connection, as renewals are: a claim waiting behind this
        # process's own batch of events (a large one takes seconds on a loaded server)
        # left expired leases untaken for that long (issue 33)
        return await self._granted("claim", _CLAIM, (owner, ttl, skip, limit), renewal=True)

    async def _granted(
        self, what: str, statement: str, params: tuple[Any, ...], *, renewal: bool
    ) -> list[Lease]:
        """The leases a claim or a renewal grants, each with when its statement was sent
        (:attr:`Lease.sent`, trio's clock): the server's ``now()``, from which the
        leases' expiry counts, is no earlier (waiting for the connection is not counted)."""
        # trio's clock is perf_counter() plus an offset. Under another clock (a test's
        # MockClock) the sum is off by the hop's real time: min() keeps it no later than
        # the answer, and a jump of the mock clock during the hop only makes it earlier.
        offset = trio.current_time() - time.perf_counter()
        stamp: list[float] = []

        def run(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
            stamp.append(time.perf_counter())
            return conn.execute(statement, params, prepare=False).fetchall()

        rows = await self._call(what, run, renewal=renewal)
        sent = min(offset + stamp[-1], trio.current_time())
        return _leases_of(rows, sent)

    async def held_elsewhere(self, owner: str) -> list[Lease]:
        """The unfinished runs that owners other than ``owner`` hold leases of, unexpired,
        soonest to expire first: what a resume waits for (a dead process's runs become
        claimable when its leases expire).

        Raises:
          StoreError: the server failed.
        """
        check_owner(owner)
        if not self._leases:
            await trio.lowlevel.checkpoint()
            return []
        rows = await self._call(
            "held_elsewhere", lambda conn: conn.execute(_HELD_ELSEWHERE, (owner,)).fetchall()
        )
        return [
            Lease(run_id=run_id, owner=held_by, epoch=epoch, expires=expires)
            for run_id, held_by, epoch, expires in rows
        ]

    @property
    def leasing(self) -> bool:
        """Whether this store leases runs to writers (schema 3, opened for writing)."""
        return self._leases and not self._readonly

    async def renew(self, owner: str, run_ids: Iterable[str], *, ttl: float) -> list[Lease]:
        """Extend, to ``ttl`` seconds from now, the leases of ``run_ids`` ``owner`` holds.

        A heartbeat: the epochs stay as they are. A lease past its expiry that no one
        claimed since is still ``owner``'s, and renewed. The runs another worker claimed
        (or ``owner`` released) are absent from the result: those are lost.

        Returns:
          the leases renewed, by run id.

        Raises:
          ValueError: ``owner``, ``run_ids`` or ``ttl`` is unusable.
          StoreError: the store is closed or read-only, or the server failed.
        """
        check_owner(owner)
        ids = check_run_ids(run_ids)
        ttl = check_ttl(ttl)
        self._writable("renew")
        if not ids:
            await trio.lowlevel.checkpoint()
            return []
        return await self._granted("renew", _RENEW, (ttl, ids, owner), renewal=True)

    async def release(self, owner: str, run_ids: Iterable[str]) -> None:
        """Give up the leases of ``run_ids`` that ``owner`` holds: they expire now and
        are held by nobody (their epochs stay, so the next claim still raises them),
        and ``owner``'s fenced appends for them are refused from now on.

        Raises:
          ValueError: ``owner`` or ``run_ids`` is unusable.
          StoreError: the store is closed or read-only, or the server failed.
        """
        check_owner(owner)
        ids = check_run_ids(run_ids)
        self._writable("release")
        if not ids:
            await trio.lowlevel.checkpoint()
            return
        await self._call(
            "release", lambda conn: conn.execute(_RELEASE, (ids, owner), prepare=False)
        )

    def _writable(self, what: str) -> None:
        if self._readonly:
            raise StoreError(
                f"store {self._where}, schema {self._schema!r} is read-only; "
                f"open it without readonly=True to {what}"
            )

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

    async def load_after(self, run_id: str, seq: int) -> list[JournalEvent]:
        """The events of ``run_id`` after seq ``seq`` (a follower's tail read); checked as
        :meth:`load` checks them.

        Raises:
          RunNotFound: no such run.
          JournalCorrupt, IndexDamaged: as :meth:`load`.
        """
        select_run = f"SELECT {self._columns} FROM runs WHERE run_id = %s"

        def fetch(conn: psycopg.Connection[Any]) -> tuple[Any, list[tuple[int, int, bytes]]]:
            row = conn.execute(select_run, (run_id,)).fetchone()
            with conn.cursor(binary=True) as cursor:
                cursor.execute(
                    "SELECT seq, seq, body FROM events WHERE run_id = %s AND seq > %s ORDER BY seq",
                    (run_id, seq),
                )
                return row, cursor.fetchall()

        row, events = await self._call("load_after", fetch)
        if row is None:
            if events:
                raise missing_index_row(run_id)
            raise RunNotFound(run_id)
        record = looked_up(run_id, self._read(row))
        return decode_chunks_after(run_id, events, record.seq, seq)

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

    async def count_runs(self, *, outcome: str) -> int:
        """How many runs have ``outcome``, counted by the server (see
        :meth:`Store.count_runs`)."""
        row = await self._call(
            "count_runs",
            lambda conn: conn.execute(
                "SELECT count(*) FROM runs WHERE outcome = %s", (outcome,)
            ).fetchone(),
        )
        return int(row[0]) if row is not None else 0

    async def unfinished(self) -> list[RunRecord]:
        """Runs that are neither terminal nor escalated, oldest first; see
        :meth:`Store.unfinished`.

        Read through the indexes of unfinished runs (``runs_unfinished``, and the
        leases' ``leases_claim`` of the unfinished runs workers drive), so the time
        does not grow with the finished runs. The two are independent copies: a run
        either lists is read and its row checked, so a row whose outcome was damaged
        is still reported (by its checksum). A finished run's row is not read: only
        :meth:`list_runs` and :meth:`check` read every row.
        """
        if not self._leases:  # an old schema opened read-only: no index to read
            return await super().unfinished()
        rows = await self._call(
            "unfinished", lambda conn: conn.execute(_SELECT_UNFINISHED).fetchall()
        )
        return select_runs(
            [verified_record(row) for row in rows],
            machine=None,
            state=None,
            outcome=RUNNING,
            limit=None,
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
            if self._leases:
                _check_leases(checker, conn.execute("SELECT run_id, live FROM leases"))
        return checker.report()

    async def aclose(self) -> None:
        # NOTE: shielded, so a cancelled caller still closes the connection.
        with trio.CancelScope(shield=True):
            async with self._lock:
                conn, self._conn = self._conn, None
                if conn is not None:
                    await trio.to_thread.run_sync(conn.close)
            async with self._renewals_lock:
                conn, self._renewals = self._renewals, None
                if conn is not None:
                    await trio.to_thread.run_sync(conn.close)


def _check_leases(checker: Checker, rows: Iterable[tuple[Any, ...]]) -> None:
    """Compare the leases with the runs index: one lease row per run, ``live`` exactly
    when the run is unfinished (claims and unfinished() trust it). A run whose index row
    or journal already has a problem is not reported again for its lease."""
    live = {run_id: flag for run_id, flag in rows}
    reported = {problem.run_id for problem in checker.problems} | checker.damaged
    for run_id, record in sorted(checker.index.items()):
        flag = live.pop(run_id, None)
        if run_id in reported:
            continue
        if flag is None:
            checker.problem(
                run_id,
                None,
                f"run {run_id!r} has no lease row, so no worker would claim it; "
                "restore it from a backup",
            )
        elif flag != (record.outcome == RUNNING):
            checker.problem(
                run_id,
                None,
                f"the lease row of run {run_id!r} says the run is "
                f"{'unfinished' if flag else 'finished'}, but its runs-index row says "
                f"{record.outcome}; restore it from a backup",
            )
    for run_id in sorted(set(live) - reported - checker.journaled):
        checker.problem(
            run_id,
            None,
            f"the leases table holds a lease of run {run_id!r}, which the runs index does "
            "not hold; restore it from a backup",
        )


def _leases_of(rows: Iterable[tuple[Any, ...]], sent: float) -> list[Lease]:
    leases = [
        Lease(run_id=run_id, owner=owner, epoch=epoch, expires=expires, sent=sent)
        for run_id, owner, epoch, expires in rows
    ]
    leases.sort(key=lambda lease: lease.run_id)
    return leases


class _Fence(msgspec.Struct, frozen=True, gc=False):
    """What a fenced append checks: the worker, its epochs by run, a new run's ttl, and
    the runs it writes checked by seq alone."""

    owner: str
    epochs: Mapping[str, int]
    ttl: float
    unfenced: frozenset[str] = frozenset()
    after_check: Callable[[], object] | None = None
    """Called in the transaction once the lease rows are locked and checked, before
    the writes (tests hold the transaction open with it, to race others against it)."""


def _probe_sync(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        conn.execute(
            "INSERT INTO meta (name, value) VALUES ('probe', md5(random()::text)) "
            "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value"
        )
        conn.execute("DELETE FROM meta WHERE name = 'probe'")


def _append_sync(
    conn: psycopg.Connection[Any],
    events: Sequence[Event],
    params: list[tuple[Any, ...]],
    fence: _Fence | None = None,
) -> tuple[frozenset[str], int]:
    """Write a batch in one transaction; with a ``fence``, only its runs still leased.

    Returns:
      the runs refused by the fence (none of their events written), and the framed
      bytes written.
    """
    run_ids = list(dict.fromkeys(r[0] for r in params))
    refused: frozenset[str] = frozenset()
    try:
        with conn.transaction(), conn.cursor() as cursor:
            if fence is not None:
                checked = [run_id for run_id in run_ids if run_id in fence.epochs]
                if checked:
                    # The lease rows stay locked (see _FENCE) until the commit, so a claim
                    # cannot take one between this check and the events' write: it skips
                    # the row, or this waits for the claim and then sees its epoch. A
                    # renewal does not wait for this lock.
                    cursor.execute(_FENCE, (checked,), prepare=False)
                    held = {
                        run_id
                        for run_id, owner, epoch in cursor.fetchall()
                        if owner == fence.owner and epoch == fence.epochs[run_id]
                    }
                    refused = frozenset(checked).difference(held)
                if fence.unfenced:
                    # Unfenced runs are written only where the batch follows on from the
                    # stored seq; one another writer advanced is refused (returned) alone.
                    first: dict[str, int] = {}
                    for row in params:
                        if row[0] in fence.unfenced:
                            first.setdefault(row[0], row[1])
                    cursor.execute(_LOCK_UNFENCED, (sorted(first),), prepare=False)
                    stored = dict(cursor.fetchall())
                    stale = {
                        run_id
                        for run_id, seq in first.items()
                        if run_id not in stored or stored[run_id] + 1 != seq
                    }
                    refused = refused | stale if stale else refused
                if fence.after_check is not None:
                    fence.after_check()
                if refused:
                    events = [event for event in events if event.run_id not in refused]
                    params = [row for row in params if row[0] not in refused]
                    run_ids = [run_id for run_id in run_ids if run_id not in refused]
                    if not events:
                        return refused, 0
            # NOTE: never a prepared statement: its generic plan for ANY(array) scans
            # the whole runs table once PostgreSQL switches to it.
            cursor.execute(_SELECT_RUNS_IN, (run_ids,), prepare=False)
            current = {row[0]: verified_record(row) for row in cursor.fetchall()}
            check_batch(events, {run_id: record.seq for run_id, record in current.items()})
            updates = index_updates(events, current)
            cursor.execute(_INSERT_EVENTS, [list(column) for column in zip(*params, strict=True)])
            rows = [(*msgspec.structs.astuple(r), record_checksum(r)) for r in updates.values()]
            cursor.execute(_UPSERT_RUNS, [list(column) for column in zip(*rows, strict=True)])
            _write_leases(cursor, events, current, updates, fence)
    except errors.UniqueViolation as exc:
        if exc.diag.constraint_name == "events_intent_key":
            keys = [r[4] for r in params if r[2] == "intent_recorded"]
            found = conn.execute(_SELECT_KEYS_IN, (keys,)).fetchone() if keys else None
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
    return refused, sum(len(row[5]) for row in params)


def _write_leases(
    cursor: psycopg.Cursor[Any],
    events: Sequence[Event],
    current: Mapping[str, RunRecord],
    updates: Mapping[str, RunRecord],
    fence: _Fence | None,
) -> None:
    """Keep the leases in step with a batch: a row for each run it starts (the fence's
    owner holds it at epoch 1; without a fence nobody does, and any worker may claim
    it), and ``live`` for each run whose outcome left or went back to running."""
    started = [
        event for event in events if type(event) is RunStarted and event.run_id not in current
    ]
    if started:
        owner = fence.owner if fence is not None else None
        cursor.execute(
            _INSERT_LEASES,
            (
                fence.ttl if fence is not None else 0.0,
                [event.run_id for event in started],
                [owner] * len(started),
                [0 if owner is None else 1] * len(started),
                [updates[event.run_id].outcome == RUNNING for event in started],
                [event.external is True for event in started],
            ),
        )
    changed = sorted(
        (run_id, record.outcome == RUNNING)
        for run_id, record in updates.items()
        if run_id in current and (current[run_id].outcome == RUNNING) != (record.outcome == RUNNING)
    )
    if changed:
        cursor.execute(_SET_LIVE, ([c[0] for c in changed], [c[1] for c in changed]))


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
        conn, dsn, schema=schema, readonly=readonly, checksums=version >= 2, leases=version >= 3
    )
