"""The SQLite store: the embedded default. One file, WAL mode, group commit per batch."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import urllib.parse
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio

from .._exceptions import RunNotFound, StoreError
from ._base import RunRecord, Store, check_batch, decode_body, encode_rows, index_updates

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._events import Event, JournalEvent

_T = TypeVar("_T")

#: The schema this module writes. A database from a newer version is refused.
SCHEMA_VERSION = 1

#: Milliseconds a connection waits for another process's write lock before failing.
BUSY_TIMEOUT_MS = 5000

_SQLITE_MAGIC = b"SQLite format 3\x00"
_SYNCHRONOUS = ("NORMAL", "FULL")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    """CREATE TABLE IF NOT EXISTS events (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        ts REAL NOT NULL,
        key TEXT,
        body BLOB NOT NULL,
        PRIMARY KEY (run_id, seq)
    ) WITHOUT ROWID""",
    # NOTE: idempotency keys are unique in the whole database, so a retried or
    # recovered intent can never be recorded twice.
    "CREATE UNIQUE INDEX IF NOT EXISTS events_intent_key ON events (key) "
    "WHERE kind = 'intent_recorded'",
    """CREATE TABLE IF NOT EXISTS runs (
        run_id TEXT PRIMARY KEY,
        machine TEXT NOT NULL,
        state TEXT NOT NULL,
        outcome TEXT NOT NULL,
        seq INTEGER NOT NULL,
        started REAL NOT NULL,
        updated REAL NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        detail TEXT NOT NULL DEFAULT ''
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS runs_started ON runs (started, run_id)",
    "CREATE INDEX IF NOT EXISTS runs_outcome ON runs (outcome, started, run_id)",
    "CREATE INDEX IF NOT EXISTS runs_machine ON runs (machine, started, run_id)",
)

_RUN_COLUMNS = "run_id, machine, state, outcome, seq, started, updated, reason, detail"
_INSERT_EVENT = "INSERT INTO events (run_id, seq, kind, ts, key, body) VALUES (?, ?, ?, ?, ?, ?)"
_UPSERT_RUN = (
    f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id) DO UPDATE SET machine = excluded.machine, state = excluded.state, "
    "outcome = excluded.outcome, seq = excluded.seq, started = excluded.started, "
    "updated = excluded.updated, reason = excluded.reason, detail = excluded.detail"
)
_SELECT_RUNS_IN = (
    f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id IN (SELECT value FROM json_each(?))"
)
_SELECT_KEYS_IN = (
    "SELECT key FROM events WHERE kind = 'intent_recorded' "
    "AND key IN (SELECT value FROM json_each(?)) LIMIT 1"
)


def _record(row: Sequence[Any]) -> RunRecord:
    return RunRecord(
        run_id=row[0],
        machine=row[1],
        state=row[2],
        outcome=row[3],
        seq=row[4],
        started=row[5],
        updated=row[6],
        reason=row[7],
        detail=row[8],
    )


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        # A failed rollback leaves nothing more to undo: SQLite rolls back on close.
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


class SQLiteStore(Store):
    """The journal and the runs index in one SQLite file, in WAL mode.

    One connection serves the store. Every call hops to a worker thread with
    :func:`trio.to_thread.run_sync` and a :class:`trio.Lock` lets one thread at a
    time use the connection. :meth:`append` writes a whole batch in one
    ``BEGIN IMMEDIATE`` transaction: that is the group commit, one fsync (at most)
    per batch, so throughput comes from batching.

    Durability, by the ``synchronous`` setting given to :func:`open_sqlite_store`:

    - ``NORMAL`` (the default): in WAL mode a commit survives a crash of the
      process, but the last transactions before a power loss or an OS crash can
      be lost (the WAL is synced at checkpoints, not at each commit). The
      database itself is never corrupted.
    - ``FULL``: the WAL is synced at every commit, so a batch survives a power
      loss once :meth:`append` returns. It costs an fsync per batch.

    Other processes may read the file while the store writes it (WAL); a second
    writer waits up to ``BUSY_TIMEOUT_MS`` for the write lock, then fails.
    """

    kind = "sqlite"

    def __init__(
        self, conn: sqlite3.Connection, path: str, *, synchronous: str, readonly: bool
    ) -> None:
        """Wrap an open, checked connection; use :func:`open_sqlite_store` instead."""
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._synchronous = synchronous
        self._readonly = readonly
        self._lock = trio.Lock()

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "NORMAL",
        readonly: bool = False,
    ) -> SQLiteStore:
        """Same as :func:`open_sqlite_store`."""
        return await open_sqlite_store(path, synchronous=synchronous, readonly=readonly)

    @property
    def path(self) -> str:
        """The database file, as given when the store was opened."""
        return self._path

    @property
    def synchronous(self) -> str:
        """``NORMAL`` or ``FULL``; see the class docstring."""
        return self._synchronous

    @property
    def readonly(self) -> bool:
        """Whether the store was opened read-only."""
        return self._readonly

    async def _call(self, what: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn(conn)`` in a worker thread, holding the lock; map sqlite3 errors."""
        async with self._lock:
            conn = self._conn
            if conn is None:
                raise StoreError("store is closed")
            try:
                # NOTE: not abandoned on cancel: the lock must stay held until the
                # thread has let go of the connection.
                return await trio.to_thread.run_sync(fn, conn)
            except sqlite3.Error as exc:
                raise StoreError(f"{self._path}: {what} failed: {exc}") from exc

    async def append(self, events: Sequence[Event]) -> None:
        """Append one batch in one transaction; see :meth:`Store.append`.

        Raises:
          StoreError: the store is closed or read-only, a seq or an idempotency key
            is already stored, or SQLite failed (disk full, locked by another
            writer); nothing of the batch was written.
        """
        if self._readonly:
            raise StoreError(
                f"store {self._path} is read-only; open it without readonly=True to append"
            )
        if not events:
            await trio.lowlevel.checkpoint()
            return
        # Encoding and framing happen here, outside the lock and the thread, so
        # the writer thread only runs SQL.
        params = encode_rows(events)
        run_ids = msgspec.json.encode(list(dict.fromkeys(r[0] for r in params))).decode()
        keys = [r[4] for r in params if r[2] == "intent_recorded"]
        await self._call(
            "append", lambda conn: self._append_sync(conn, events, params, run_ids, keys)
        )
        self.bytes_written += sum(len(row[5]) for row in params)

    def _append_sync(
        self,
        conn: sqlite3.Connection,
        events: Sequence[Event],
        params: list[tuple[Any, ...]],
        run_ids: str,
        keys: list[str | None],
    ) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = {row[0]: _record(row) for row in conn.execute(_SELECT_RUNS_IN, (run_ids,))}
            check_batch(events, {run_id: record.seq for run_id, record in current.items()})
            updates = index_updates(events, current)
            conn.executemany(_INSERT_EVENT, params)
            conn.executemany(_UPSERT_RUN, [msgspec.structs.astuple(r) for r in updates.values()])
            conn.execute("COMMIT")
        except sqlite3.IntegrityError as exc:
            _rollback(conn)
            raise StoreError(self._explain_integrity(conn, exc, keys)) from exc
        except Exception:
            _rollback(conn)
            raise

    def _explain_integrity(
        self, conn: sqlite3.Connection, exc: sqlite3.IntegrityError, keys: list[str | None]
    ) -> str:
        if "events.key" in str(exc) and keys:
            found = conn.execute(_SELECT_KEYS_IN, (msgspec.json.encode(keys).decode(),)).fetchone()
            key = found[0] if found else None
            return f"idempotency key {key!r} was already recorded; nothing was written"
        return f"{self._path}: the batch breaks a constraint ({exc}); nothing was written"

    async def load(self, run_id: str) -> list[JournalEvent]:
        rows: list[tuple[int, bytes]] = await self._call(
            "load",
            lambda conn: conn.execute(
                "SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq", (run_id,)
            ).fetchall(),
        )
        if not rows:
            raise RunNotFound(run_id)
        return [decode_body(run_id, seq, body) for seq, body in rows]

    async def get_run(self, run_id: str) -> RunRecord:
        row = await self._call(
            "get_run",
            lambda conn: conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone(),
        )
        if row is None:
            raise RunNotFound(run_id)
        return _record(row)

    async def list_runs(
        self,
        *,
        machine: str | None = None,
        state: str | None = None,
        outcome: str | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        clauses: list[str] = []
        params: list[object] = []
        for column, value in (("machine", machine), ("state", state), ("outcome", outcome)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        sql = f"SELECT {_RUN_COLUMNS} FROM runs"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY started, run_id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        rows = await self._call("list_runs", lambda conn: conn.execute(sql, params).fetchall())
        return [_record(row) for row in rows]

    async def pragmas(self) -> dict[str, object]:
        """Return the settings in effect on the store's connection, for diagnostics.

        Returns:
          ``journal_mode`` (``wal``), ``synchronous`` (``NORMAL`` or ``FULL``),
          ``foreign_keys`` (bool), ``busy_timeout`` (milliseconds) and
          ``schema_version``.
        """

        def read(conn: sqlite3.Connection) -> dict[str, object]:
            level = conn.execute("PRAGMA synchronous").fetchone()[0]
            return {
                "journal_mode": conn.execute("PRAGMA journal_mode").fetchone()[0],
                "synchronous": {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(level, level),
                "foreign_keys": bool(conn.execute("PRAGMA foreign_keys").fetchone()[0]),
                "busy_timeout": conn.execute("PRAGMA busy_timeout").fetchone()[0],
                "schema_version": _schema_version(conn),
            }

        return await self._call("pragmas", read)

    async def aclose(self) -> None:
        # NOTE: shielded, so a cancelled caller still closes the connection (and
        # SQLite checkpoints the WAL) instead of leaking it.
        with trio.CancelScope(shield=True):
            async with self._lock:
                conn, self._conn = self._conn, None
                if conn is not None:
                    await trio.to_thread.run_sync(conn.close)


def _schema_version(conn: sqlite3.Connection) -> int | None:
    """Return the interlock schema version, or None if the file has no interlock tables."""
    has_meta = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
    ).fetchone()
    if has_meta is None:
        return None
    row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def _not_interlock(path: str, why: str) -> StoreError:
    return StoreError(
        f"{path}: not an interlock database ({why}); pass a new path or restore the file"
    )


def _check_file(path: str, *, readonly: bool) -> None:
    """Check ``path`` before SQLite touches it.

    Nothing is written here: a file that is not a SQLite database must come out
    of a failed open byte for byte as it went in.
    """
    if os.path.isdir(path):
        raise StoreError(f"{path}: is a directory; pass the path of a database file")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise StoreError(
            f"{path}: directory {parent} does not exist; create it or pass another path"
        )
    try:
        with open(path, "rb") as file:
            header = file.read(len(_SQLITE_MAGIC))
    except FileNotFoundError:
        if readonly:
            raise StoreError(f"database {path} does not exist") from None
        return
    except OSError as exc:
        raise StoreError(f"{path}: cannot read the file: {exc.strerror}") from exc
    # An empty file is an empty database to SQLite; anything else must carry its header.
    if header and header != _SQLITE_MAGIC:
        raise _not_interlock(path, "file is not a database")


def _connect(path: str, synchronous: str, readonly: bool) -> sqlite3.Connection:
    _check_file(path, readonly=readonly)
    try:
        if readonly:
            uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        else:
            conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open the database: {exc}") from exc
    try:
        _prepare(conn, path, synchronous, readonly=readonly)
    except Exception:
        conn.close()
        raise
    return conn


def _prepare(conn: sqlite3.Connection, path: str, synchronous: str, *, readonly: bool) -> None:
    # Everything up to the version check only reads, so a foreign file is refused
    # before the first write (even switching to WAL writes the header).
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        version = _schema_version(conn)
        has_tables = conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is not None
    except sqlite3.DatabaseError as exc:
        if "not a database" in str(exc) or "malformed" in str(exc):
            raise _not_interlock(path, str(exc)) from exc
        raise StoreError(f"{path}: cannot read the database: {exc}") from exc
    if version is None and (has_tables or readonly):
        why = "it holds other tables" if has_tables else "it holds no interlock tables"
        raise _not_interlock(path, why)
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(
            f"{path}: database schema version {version} is newer than this interlock "
            f"supports ({SCHEMA_VERSION}); upgrade interlock to open it"
        )
    if version is not None and version < SCHEMA_VERSION:  # pragma: no cover - no older version yet
        raise StoreError(f"{path}: database schema version {version} is not supported")
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        if readonly:
            return
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(
                f"{path}: cannot switch the database to WAL mode (it stays in {mode} mode); "
                "put it on a local file system"
            )
        if version is None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(
                    "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
                conn.execute("COMMIT")
            except Exception:
                _rollback(conn)
                raise
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot set up the database: {exc}") from exc


async def open_sqlite_store(
    path: str | os.PathLike[str],
    *,
    synchronous: str = "NORMAL",
    readonly: bool = False,
) -> SQLiteStore:
    """Open (and create, if missing) the SQLite journal at ``path``.

    Args:
      path: the database file. A missing file is created with the schema; its
        directory must exist.
      synchronous: ``NORMAL`` (survives a process crash; a power loss can drop
        the last batches) or ``FULL`` (survives a power loss; an fsync per batch).
      readonly: open an existing database for reading only. Nothing is created,
        and :meth:`SQLiteStore.append` raises.

    Raises:
      StoreError: ``path`` is a directory, its directory is missing, the file is
        not an interlock database, its schema is newer than this interlock, or
        (with ``readonly``) it does not exist.
      ValueError: ``synchronous`` is neither ``NORMAL`` nor ``FULL``.
    """
    path = os.fspath(path)
    level = synchronous.upper()
    if level not in _SYNCHRONOUS:
        raise ValueError(f"synchronous must be 'NORMAL' or 'FULL'; got {synchronous!r}")
    conn = await trio.to_thread.run_sync(_connect, path, level, readonly)
    return SQLiteStore(conn, path, synchronous=level, readonly=readonly)
