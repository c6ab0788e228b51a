"""The SQLite store: the embedded default. One file, WAL mode, group commit per batch.

The journal is stored in chunks: one row per run per appended batch, holding that
run's consecutive events of the batch as one buffer of frames (``frame_events`` of
their msgpack payloads). A batch of 1,000 events of a few runs is a few rows, not a
thousand, which is what makes the group commit fast. Chunks are appended in id order
and chained per run (schema version 5): each names its run's chunk before, and the run's
index row names its last, so an append writes at the end of one B-tree instead of a page
per run. Idempotency keys of intents have a table of their own, so they stay unique in the
whole database.

The runs index is derived from the journal, and each of its rows carries the crc32 of
its fields (:func:`row_checksum`): a row that fails it is reported (:class:`IndexDamaged`),
never believed. Since schema version 6 a continuing run's row moves lazily: each batch
writes the rows it moves as one row of the ``moves`` table, and the writer applies the
pending moves to the ``runs`` table at most :data:`INDEX_LAG_SECONDS` (or
:data:`INDEX_LAG_BATCHES` batches) later, so a batch of a thousand runs is two inserts,
not a thousand updates. Every read takes a run's latest pending move over its row. Listing runs therefore reads every row, whatever the filters, and counts
them against the number of runs started, kept in ``meta``: one flipped byte in a page
header can hide a row from SQLite itself. The unfinished runs, which resume reads, have a
partial index of their own and a count of their own (schema version 4), so finding them
does not grow with the journal.

One process writes a journal: opening it for writing takes an exclusive ``flock`` on
``<db>.lock`` (:func:`hold_journal`), which the kernel drops when the process dies, and a
second process gets :class:`JournalHeld`, naming the holder, before it writes anything.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import itertools
import json
import math
import os
import shlex
import socket
import sqlite3
import sys
import threading
import time
import urllib.parse
import warnings
import weakref
import zlib
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import trio

from ..core._events import ENCODING_ERRORS, IntentRecorded, RunStarted, Transitioned
from ..core._exceptions import IndexDamaged, RunNotFound, StoreDamaged, StoreError
from ..core._hotpath import FRAMES_OK, frame_events, unframe
from ._base import (
    COMPLETED,
    FAILED,
    INDEX_CHANGES,
    RUNNING,
    RunRecord,
    Store,
    _encode_index_row,
    another_writer,
    check_batch,
    decode_chunks,
    decode_chunks_after,
    index_updates,
    looked_up,
    missing_index_row,
    missing_journal,
    record_checksum,
    row_checksum,
    select_runs,
    stored_record,
    unencodable,
    verified_record,
)
from ._check import Checker, CheckReport

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from ..core._events import Event, JournalEvent

_T = TypeVar("_T")

#: The schema this module writes. A database from a newer version is refused; one from
#: version 1 (a row per event), 2 (no checksums in the runs index), 3 (no index of
#: unfinished runs), 4 (chunks keyed by run) or 5 (no pending index moves) is upgraded in
#: place when opened for writing. Opened read-only, a
#: version 2 database is read as it is (its index rows have no checksum to check), and
#: a version 2 or 3 one finds its unfinished runs by reading every row; one of version 4
#: (chunks keyed by run, not chained) is read by run.
SCHEMA_VERSION = 6

#: Milliseconds a connection waits for another process's write lock before failing.
BUSY_TIMEOUT_MS = 5000

#: Page size of a new database. Chunks are tens of kilobytes, and larger pages mean
#: fewer WAL frames per batch; but a commit writes whole pages, so a one-event batch
#: pays for large ones. 8 KiB balanced the two best when measured (bench_journal).
PAGE_SIZE = 8192

#: WAL bytes (estimated) written between two checkpoints of the checkpoint thread.
CHECKPOINT_BYTES = 4 << 20

#: WAL bytes past which the writer checkpoints itself and the WAL starts over.
AUTOCHECKPOINT_BYTES = 4 * CHECKPOINT_BYTES

#: Seconds a continuing run's index row may wait in the ``moves`` table (version 6) before
#: the writer moves it in ``runs``: a batch applies the pending moves once the oldest is
#: this old, or once this many batches have written moves. Readers take a run's latest
#: pending move over its row, so nothing reads the index behind the journal meanwhile;
#: the lag only bounds the table a reader decodes.
INDEX_LAG_SECONDS = 5.0
INDEX_LAG_BATCHES = 256

#: Upgrading a version-1 database starts a new chunk past this many bytes of frames.
_MIGRATION_CHUNK_BYTES = 1 << 20

_SQLITE_MAGIC = b"SQLite format 3\x00"
_SYNCHRONOUS = ("NORMAL", "FULL")

_META = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID"
#: The journal's tables as version 4 had them (and versions 2 and 3): chunks keyed by run
#: and first seq. The upgrade from version 1 writes these, then goes on to version 5.
_JOURNAL_V4 = (
    """CREATE TABLE IF NOT EXISTS chunks (
        run_id TEXT NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (run_id, first_seq)
    )""",
)
#: Version 5: one row per run per appended batch, the frames of seqs first_seq..last_seq,
#: appended in id order and chained per run (``prev``: the run's chunk before, NULL for
#: its first). Nothing indexes a chunk but its id, so an append writes at the end of one
#: B-tree: keyed by run, as version 4 was, every run of a batch dirtied a page of its own
#: (an 8 KiB page in the WAL, then again in the checkpoint, for each run of a batch). A
#: run's row in ``runs`` names its last chunk (``chunk``), and the partial index of first
#: chunks finds a run's journal without its index row (and keeps a run from being
#: started twice).
_CHUNKS = """CREATE TABLE IF NOT EXISTS chunks (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        prev INTEGER,
        body BLOB NOT NULL
    )"""
_FIRST_CHUNKS = (
    "CREATE UNIQUE INDEX IF NOT EXISTS chunks_first ON chunks (run_id) WHERE prev IS NULL"
)
# NOTE: idempotency keys are unique in the whole database, so a retried or recovered
# intent can never be recorded twice.
_INTENTS = """CREATE TABLE IF NOT EXISTS intents (
        key TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL
    ) WITHOUT ROWID"""
_JOURNAL = (_CHUNKS, _FIRST_CHUNKS, _INTENTS)
#: Version 6: the index rows a batch moved (of runs it continued, not started), one row
#: per batch: a msgpack array of ``[run_id, machine, state, outcome, seq, started,
#: updated, reason, detail, crc, chunk]`` rows, the columns of ``runs`` (each with its
#: checksum, so a damaged move is reported as a damaged row is). The writer applies them
#: to ``runs`` and deletes them (:func:`_flush_moves`); the ids only grow (AUTOINCREMENT),
#: so a reader knows whether the table changed since it last decoded it.
_MOVES = """CREATE TABLE IF NOT EXISTS moves (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        body BLOB NOT NULL
    )"""
# NOTE: listing reads every row of the runs table, to check each one (a filter in SQL
# would silently skip a row whose damage unmatched it). The one index beyond its key is
# of the unfinished runs, which resume reads; see _UNFINISHED_INDEX.
_SCHEMA = (
    _META,
    *_JOURNAL,
    # crc: row_checksum of the columns before it. NULL only where the upgrade from
    # version 2 found a row it could not checksum; that row is reported as damaged.
    # chunk: the id of the run's last chunk (version 5), where its chain starts.
    """CREATE TABLE IF NOT EXISTS runs (
        run_id TEXT PRIMARY KEY,
        machine TEXT NOT NULL,
        state TEXT NOT NULL,
        outcome TEXT NOT NULL,
        seq INTEGER NOT NULL,
        started REAL NOT NULL,
        updated REAL NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        detail TEXT NOT NULL DEFAULT '',
        crc INTEGER,
        chunk INTEGER
    ) WITHOUT ROWID""",
    _MOVES,
)
#: Version 4: the unfinished runs, found without reading the whole index. A partial
#: index holds exactly the rows whose outcome is running (SQLite keeps it in the
#: transaction of every append), in the order unfinished() returns them; and the store
#: keeps their number in ``meta`` in the same transaction (_COUNT_RUNNING), so a row the
#: index lost (a damaged page, a row changed behind the store's back) is noticed, as the
#: runs count notices a row the table lost.
_UNFINISHED_INDEX = (
    "CREATE INDEX IF NOT EXISTS runs_unfinished ON runs (started, run_id) WHERE outcome = 'running'"
)
_RUN_COLUMNS = "run_id, machine, state, outcome, seq, started, updated, reason, detail, crc"
#: The columns a store writes of a row (version 5): the checked ones and the last chunk.
_ROW_COLUMNS = f"{_RUN_COLUMNS}, chunk"
#: The index columns as read: text as BLOBs, so that text damaged into invalid UTF-8
#: is reported with its row instead of failing the whole query.
_READ_COLUMNS = (
    "CAST(run_id AS BLOB), CAST(machine AS BLOB), CAST(state AS BLOB), CAST(outcome AS BLOB), "
    "seq, started, updated, CAST(reason AS BLOB), CAST(detail AS BLOB)"
)
#: The unfinished runs, oldest first, through runs_unfinished (a test reads its plan).
_SELECT_UNFINISHED = (
    f"SELECT {_READ_COLUMNS}, crc FROM runs INDEXED BY runs_unfinished "
    "WHERE outcome = 'running' ORDER BY started, run_id"
)
_RUNNING_COUNTED = "SELECT value FROM meta WHERE name = 'running'"
_COUNT_RUNNING = (
    "UPDATE meta SET value = CAST(CAST(value AS INTEGER) + ? AS TEXT) WHERE name = 'running'"
)
_INSERT_CHUNK = (
    "INSERT INTO chunks (id, run_id, first_seq, last_seq, prev, body) VALUES (?, ?, ?, ?, ?, ?)"
)
_INSERT_CHUNK_V4 = "INSERT INTO chunks (run_id, first_seq, last_seq, body) VALUES (?, ?, ?, ?)"
_LAST_CHUNK = "SELECT max(id) FROM chunks"
_INSERT_INTENT = "INSERT INTO intents (key, run_id, seq) VALUES (?, ?, ?)"
#: A batch's chunks and intents are inserted _MANY rows to a statement (VALUES (...),
#: (...), ...), the rest one row at a time: per row, SQLite then runs one statement step
#: instead of a reset, a step and the module's loop around them, about a fifth of a
#: chunk's insert (benchmarks/gateway_instructions.md). 128 rows of 6 parameters stay
#: under the 999 parameters the oldest SQLite builds allow.
_MANY = 128
_INSERT_CHUNKS = _INSERT_CHUNK.replace(
    "VALUES (?, ?, ?, ?, ?, ?)", "VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?)"] * _MANY)
)
_INSERT_INTENTS = _INSERT_INTENT.replace(
    "VALUES (?, ?, ?)", "VALUES " + ", ".join(["(?, ?, ?)"] * _MANY)
)
_UPSERT_RUN = (
    f"INSERT INTO runs ({_ROW_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id) DO UPDATE SET machine = excluded.machine, state = excluded.state, "
    "outcome = excluded.outcome, seq = excluded.seq, started = excluded.started, "
    "updated = excluded.updated, reason = excluded.reason, detail = excluded.detail, "
    "crc = excluded.crc, chunk = excluded.chunk"
)
_SELECT_RUN = f"SELECT {_READ_COLUMNS}, crc, chunk FROM runs WHERE run_id = ?"
_INSERT_RUN = (
    f"INSERT INTO runs ({_ROW_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id) DO NOTHING"
)
#: The number of runs started, so that a row missing from the index is noticed.
_RUNS_COUNTED = "SELECT value FROM meta WHERE name = 'runs'"
_COUNT_RUNS = "UPDATE meta SET value = CAST(CAST(value AS INTEGER) + ? AS TEXT) WHERE name = 'runs'"
#: A run whose outcome changes has its index row moved at once (version 6; the others'
#: moves wait in the moves table), and only from the row it moves from (the one this store
#: last wrote, or the stored one, read and checked against its checksum): every stored
#: column is compared with that row, so a row damaged or changed since is not moved (and
#: never re-checksummed as good), and the row count tells whether every run was where the
#: batch says it was. The new checksum is computed in Python, once per row. (Pending moves
#: are applied with outcome, reason and detail out of the SET where they stay, so that
#: SQLite leaves the index of unfinished runs alone: it rewrites a partial index whenever
#: a column of its WHERE is set, changed or not.)
#: The row's chunk is compared too: the batch's chunk of the run chains from it.
_MOVE_FROM = (
    "WHERE run_id = ?6 AND machine = ?7 AND state = ?8 AND outcome = ?9 AND seq = ?10 "
    "AND started = ?11 AND updated = ?12 AND reason = ?13 AND detail = ?14 AND crc = ?15 "
    "AND chunk = ?16"
)
_MOVE_ROW_OUTCOME = (
    "UPDATE runs SET seq = ?1, updated = ?2, state = ?3, crc = ?4, chunk = ?5, outcome = ?17, "
    f"reason = ?18, detail = ?19 {_MOVE_FROM}"
)
_INSERT_MOVES = "INSERT INTO moves (body) VALUES (?)"
_SELECT_MOVES = "SELECT id, body FROM moves ORDER BY id"
_MOVES_STATE = "SELECT max(id), count(*) FROM moves"
#: A pending move applied to its row, read and checked in the same write transaction.
_APPLY_MOVE = (
    "UPDATE runs SET seq = ?, updated = ?, state = ?, crc = ?, chunk = ? "
    "WHERE run_id = ? AND crc = ?"
)
_APPLY_MOVE_OUTCOME = (
    "UPDATE runs SET seq = ?, updated = ?, state = ?, crc = ?, chunk = ?, outcome = ?, "
    "reason = ?, detail = ? WHERE run_id = ? AND crc = ?"
)
#: Where each field of INDEX_CHANGES goes in a run of _Batch.runs.
_MOVE_FIELDS = {"state": 4, "outcome": 5, "reason": 6, "detail": 7}
#: Index rows a store remembers (the last it wrote of each run, see SQLiteStore._rows), so
#: that moving one on needs neither a read nor a checksum computed in SQL. About 300 bytes
#: each; past this many, the runs written longest ago are forgotten (and read again). A
#: few thousand runs in flight (the gateway benchmark's 4,000) are all remembered; 100,000 are
#: not, and their rows are read back in groups, so the cache stays a few MB.
REMEMBERED_ROWS = 16_384
#: The rows of runs it does not remember are read up to _READ_GROUP at a time, by one of a
#: few statements (each prepared once), the group padded to its size with repeats.
_READ_SIZES = (1, 8, 32, 128)
_READ_GROUP = _READ_SIZES[-1]
_SELECT_ROWS = {
    size: f"SELECT {_ROW_COLUMNS} FROM runs WHERE run_id IN ({', '.join('?' * size)})"
    for size in _READ_SIZES
}
#: A run's chunks, every one of them: by its key in version 4; in version 5, with no index
#: by run, a scan, read only where a run's chain is broken (to say what is wrong).
_SELECT_CHUNKS = "SELECT first_seq, last_seq, body FROM chunks WHERE run_id = ? ORDER BY first_seq"
_SELECT_CHUNKS_AFTER = (
    "SELECT first_seq, last_seq, body FROM chunks WHERE run_id = ? AND last_seq > ? "
    "ORDER BY first_seq"
)
#: Version 5: a run's chain of chunks, from the last one (?1) back to the one that holds
#: seq ?2 + 1 (0: to its first), newest first. Each step goes to a smaller id of the same
#: run, so a damaged pointer ends the walk (never loops); _chained() checks that it ended
#: where it should have.
_CHAIN = (
    "WITH RECURSIVE chain(id, prev, run_id, first_seq, last_seq, body) AS ("
    "SELECT id, prev, run_id, first_seq, last_seq, body FROM chunks WHERE id = ?1 "
    "UNION ALL SELECT c.id, c.prev, c.run_id, c.first_seq, c.last_seq, c.body "
    "FROM chain JOIN chunks AS c ON c.id = chain.prev "
    "WHERE c.id < chain.id AND c.run_id = chain.run_id AND chain.first_seq > ?2 + 1) "
    "SELECT id, prev, run_id, first_seq, last_seq, body FROM chain"
)
_HAS_CHUNKS = "SELECT 1 FROM chunks WHERE run_id = ? LIMIT 1"
_HAS_FIRST_CHUNK = "SELECT 1 FROM chunks WHERE run_id = ? AND prev IS NULL"
_LAST_SEQ = "SELECT max(last_seq) FROM chunks WHERE run_id = ?"

#: Event types that change a run's row in the runs index beyond its seq and time.
_INDEXED: frozenset[type[Event]] = frozenset({RunStarted, *INDEX_CHANGES})
_encode = msgspec.msgpack.Encoder().encode


class _Batch:
    """One batch, encoded and grouped by run, ready for the writer thread.

    ``chunks`` holds a row per run, ``intents`` a row per intent. ``marks`` is the
    subsequence of the batch that decides the runs index: each run's first event,
    every event that moves the index, and each run's last event (again). Feeding it to
    :func:`index_updates` gives what the whole batch would, for a fraction of the work.
    ``runs`` holds, per run, what :meth:`SQLiteStore._index_fast` moves its index row
    by, gathered in the same pass: ``[first seq, last seq, payloads, last event, state,
    outcome, reason, detail]``, a field None where no event of the batch changes it.
    ``starts`` names the runs whose first event is their ``run_started`` (seq 1);
    ``irregular`` says a ``run_started`` came elsewhere (for the checked path to explain).
    """

    __slots__ = (
        "chunks",
        "contiguous",
        "events",
        "intents",
        "irregular",
        "marks",
        "runs",
        "size",
        "starts",
    )

    def __init__(self, events: Sequence[Event]) -> None:
        encode = _encode
        indexed = _INDEXED
        changes = INDEX_CHANGES
        slots = _MOVE_FIELDS
        transitioned = Transitioned
        runs: dict[str, list[Any]] = {}
        intents: list[tuple[str, str, int]] = []
        marks: list[Event] = []
        starts: list[str] = []
        contiguous = True
        irregular = False
        for event in events:
            run_id = event.run_id
            seq = event.seq
            kind = type(event)
            run = runs.get(run_id)
            if run is None:
                run = runs[run_id] = [seq, seq, [encode(event)], event, None, None, None, None]
                marks.append(event)
                if kind is RunStarted:
                    if seq == 1:
                        starts.append(run_id)
                    else:
                        irregular = True
            else:
                if seq != run[1] + 1:
                    contiguous = False
                run[1] = seq
                run[2].append(encode(event))
                run[3] = event
                if kind in indexed:
                    marks.append(event)
                    if kind is RunStarted:
                        irregular = True
            if kind is transitioned:
                run[4] = event.dst  # type: ignore[attr-defined]
            elif kind in changes:
                for field, value in changes[kind](event).items():
                    run[slots[field]] = value
            elif kind is IntentRecorded:
                intents.append((event.key, run_id, seq))  # type: ignore[attr-defined]
        self.events = events
        self.runs = runs
        self.starts = starts
        self.irregular = irregular
        # NOTE: one loop for the marks, the chunks and the size (each run's last event,
        # its frames, their length): a generator per pass resumed once per run cost more
        # than the loop's own work
        chunks = []
        size = 0
        for run_id, run in runs.items():
            marks.append(run[3])
            body = frame_events(run[2])
            size += len(body)
            chunks.append((run_id, run[0], run[1], body))
            # NOTE: the frames hold the payloads now; the batch lives until it is written,
            # and keeping both copies held every event of a large batch twice.
            run[2] = None
        self.chunks = chunks
        self.intents = intents
        self.marks = marks
        self.contiguous = contiguous and (
            not intents or len({row[0] for row in intents}) == len(intents)
        )
        self.size = size


def _text(value: Any) -> str:
    """A text column read as a BLOB."""
    if type(value) is not bytes:
        raise TypeError("not text")  # NULL, or a number where text belongs
    return value.decode()


def _fields(row: Sequence[Any]) -> list[Any]:
    """The fields of an index row read with _READ_COLUMNS, text decoded (the crc after, if read).

    Raises:
      IndexDamaged: a text column is not valid UTF-8 or not text at all.
    """
    try:
        return [
            _text(row[0]),
            _text(row[1]),
            _text(row[2]),
            _text(row[3]),
            row[4],
            row[5],
            row[6],
            _text(row[7]),
            _text(row[8]),
            *row[9:],
        ]
    except (TypeError, UnicodeDecodeError):
        run_id = row[0].decode(errors="replace") if type(row[0]) is bytes else str(row[0])
        raise IndexDamaged(run_id, "a text field is not valid text") from None


def _verified(row: Sequence[Any]) -> RunRecord:
    """The record of an index row read with ``_READ_COLUMNS, crc``, checked."""
    return verified_record(_fields(row))


def _unverified(row: Sequence[Any]) -> RunRecord:
    """The record of a version 2 index row, which has no checksum to check."""
    return stored_record(_fields(row))


def _index_row(record: RunRecord, chunk: int) -> tuple[Any, ...]:
    """The parameters of _INSERT_RUN and _UPSERT_RUN for ``record``, its last chunk ``chunk``."""
    return (*msgspec.structs.astuple(record), record_checksum(record), chunk)


def _chunk_id(run_id: str, chunk: Any) -> int:
    """The last chunk an index row names, which a new chunk of its run chains from.

    Raises:
      IndexDamaged: the row names none (NULL, or not a number).
    """
    if type(chunk) is not int:
        raise IndexDamaged(run_id, "its row names no last chunk of the journal")
    return chunk


#: An index row as a store remembers it: ``(machine, state, outcome, seq, started, updated,
#: reason, detail, crc, chunk)``, the columns after the run id, in order.
_Row = tuple[Any, ...]
#: Outcomes after which a run's row is not moved again (escalated runs may resume).
_FINISHED = frozenset({COMPLETED, FAILED})


def _stored_rows(conn: sqlite3.Connection, run_ids: list[str]) -> dict[str, _Row]:
    """The index rows of ``run_ids`` as stored, those that are there and pass their checksum."""
    found: dict[str, _Row] = {}
    for at in range(0, len(run_ids), _READ_GROUP):
        group = run_ids[at : at + _READ_GROUP]
        size = next(size for size in _READ_SIZES if size >= len(group))
        group += [group[-1]] * (size - len(group))
        try:
            rows = conn.execute(_SELECT_ROWS[size], group).fetchall()
        except sqlite3.OperationalError:
            return found  # text that is not UTF-8: the checked path says which row
        for row in rows:
            try:
                intact = row_checksum(*row[:9]) == row[9]
            except (TypeError, ValueError, msgspec.EncodeError):
                intact = False
            if intact and type(row[10]) is int:
                found[row[0]] = row[1:]
    return found


def _insert(conn: sqlite3.Connection, many: str, one: str, rows: list[tuple[Any, ...]]) -> None:
    """Insert ``rows``: _MANY at a time with ``many``, what is left with ``one``."""
    whole = len(rows) - len(rows) % _MANY
    for at in range(0, whole, _MANY):
        conn.execute(many, [value for row in rows[at : at + _MANY] for value in row])
    if whole < len(rows):
        conn.executemany(one, rows[whole:])


#: A pending index move as the moves table holds it: ``(run_id, *_Row)``.
_Move = tuple[Any, ...]
_decode_moves = msgspec.msgpack.Decoder(
    list[tuple[str, str, str, str, int, float, float, str, str, int, int]]
).decode


def _decoded_moves(moves_id: int, body: Any) -> list[_Move]:
    """The moves of one row of the moves table, each checked against its checksum.

    Raises:
      IndexDamaged: the row cannot be read, or a move fails its checksum.
    """
    try:
        moves = _decode_moves(body)
    except (msgspec.DecodeError, TypeError):
        raise IndexDamaged(
            None, f"the pending index moves {moves_id} cannot be read (the moves table)"
        ) from None
    for move in moves:
        try:
            intact = row_checksum(*move[:9]) == move[9]
        except (TypeError, ValueError, msgspec.EncodeError):
            intact = False
        if not intact:
            raise IndexDamaged(move[0], "its pending index move fails its checksum")
    return moves


def _pending_moves(conn: sqlite3.Connection) -> dict[str, _Move]:
    """The latest pending index move of each run, as the moves table holds them."""
    latest: dict[str, _Move] = {}
    for moves_id, body in conn.execute(_SELECT_MOVES).fetchall():
        for move in _decoded_moves(moves_id, body):
            latest[move[0]] = move
    return latest


def _flush_moves(
    conn: sqlite3.Connection,
    latest: dict[str, _Move] | None = None,
    known: dict[str, _Row] | None = None,
) -> tuple[dict[str, _Move], dict[str, _Row]]:
    """Apply every pending index move to its run's row, in the caller's write transaction,
    and empty the moves table; return the moves left pending, and the rows now stored of
    the runs it moved.

    A run's latest move replaces its row only if the row as stored is intact (its
    checksum) and behind the move, of the same machine and start: a row damaged, missing
    or changed behind the writer is never overwritten (nor re-checksummed as good); its
    move stays pending, and every read of the run reports the row as it does today.

    Args:
      latest: the latest pending move of each run, as the moves table holds them (read
        from it if None).
      known: rows as stored that the writer wrote itself and no other connection has
        written since (see ``SQLiteStore._stored``); the rest are read and checked. A
        known row is moved only if its checksum is still the one stored; if one is not,
        every row is read and checked instead.
    """
    if latest is None:
        latest = _pending_moves(conn)
    if not latest:
        return latest, {}
    if known is None:
        known = {}
    missing = [run_id for run_id in latest if run_id not in known]
    stored = _stored_rows(conn, missing) if missing else {}
    kept: list[_Move] = []
    same: list[tuple[Any, ...]] = []
    changed: list[tuple[Any, ...]] = []
    written: dict[str, _Row] = {}
    running = 0
    for run_id, move in latest.items():
        row = known.get(run_id) or stored.get(run_id)
        if row is not None and row[0] == move[1] and row[4] == move[5] and row[3] >= move[4]:
            continue  # its row moved past it since (the run's outcome changed): superseded
        if row is None or row[0] != move[1] or row[4] != move[5]:
            kept.append(move)
            continue
        _, _, state, outcome, seq, _, updated, reason, detail, crc, chunk = move
        if outcome == row[2] and reason == row[6] and detail == row[7]:
            same.append((seq, updated, state, crc, chunk, run_id, row[8]))
        else:
            changed.append(
                (seq, updated, state, crc, chunk, outcome, reason, detail, run_id, row[8])
            )
            running += (outcome == RUNNING) - (row[2] == RUNNING)
        written[run_id] = move[1:]
    conn.execute("SAVEPOINT flush")
    moved = conn.executemany(_APPLY_MOVE, same).rowcount if same else 0
    if changed:
        moved += conn.executemany(_APPLY_MOVE_OUTCOME, changed).rowcount
    if moved != len(same) + len(changed):
        # A row known to the writer is not as it wrote it (damage on the disk): undo, and
        # read and check every row instead.
        conn.execute("ROLLBACK TO flush")
        conn.execute("RELEASE flush")
        if not known:  # pragma: no cover - the rows were read in this very transaction
            raise StoreError("the runs index changed while its pending moves were applied")
        return _flush_moves(conn, latest, None)
    conn.execute("RELEASE flush")
    if running:
        conn.execute(_COUNT_RUNNING, (running,))
    conn.execute("DELETE FROM moves")
    if kept:
        conn.execute(_INSERT_MOVES, (bytearray(_encode(kept)),))
    return {move[0]: move for move in kept}, written


def _ahead(row: Any, move: _Move | None) -> _Move | None:
    """``move``, if it is ahead of ``row`` (a run's index row as read: its seq at 4); else
    None. A row whose seq is not a number is damaged: its reader reports it."""
    if move is None or type(row[4]) is not int or move[4] <= row[4]:
        return None
    return move


#: What _move_runs gives: ``(same, changed, written, prevs, running)``.
_Moves = tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], dict[str, _Row], list[int | None], int]


def _move_runs(
    runs: dict[str, list[Any]],
    remembered: dict[str, _Row],
    stored: dict[str, _Row],
    starting: set[str],
    first_chunk: int,
) -> _Moves | None:
    """How :meth:`SQLiteStore._index_fast` moves the rows of the runs a batch continues:
    the pending moves of those that stay in their outcome (``same``, rows of the moves
    table), the parameters of _MOVE_ROW_OUTCOME for those whose outcome changes
    (``changed``), the rows written (as ``_rows`` holds them), each chunk's ``prev`` and
    the change in the number of running runs; or None where a run is not at the seq
    before its first event, neither as remembered nor as stored. ``runs`` is ``_Batch.runs``; the runs
    in ``starting`` begin in the batch."""
    written: dict[str, _Row] = {}
    running = 0
    same: list[tuple[Any, ...]] = []  # pending moves
    changed: list[tuple[Any, ...]] = []  # parameters of _MOVE_ROW_OUTCOME
    crc32 = zlib.crc32
    encode = _encode_index_row
    prevs: list[int | None] = []
    for chunk, (run_id, run) in enumerate(runs.items(), first_chunk):
        first, seq, _, last, state, outcome, reason, detail = run
        if first == 1 and starting and run_id in starting:
            prevs.append(None)
            continue
        before = first - 1
        row = remembered.get(run_id)
        if row is None or row[3] != before:
            row = stored.get(run_id)
            if row is None or row[3] != before:
                return None
        machine, was_state, was, _, started_at, _, was_reason, was_detail, _, prev = row
        prevs.append(prev)
        updated = last.ts
        if state is None:
            state = was_state
        if outcome is None:
            crc = crc32(
                encode(
                    (
                        run_id,
                        machine,
                        state,
                        was,
                        seq,
                        float(started_at),
                        float(updated),
                        was_reason,
                        was_detail,
                    )
                )
            )
            moved = (
                machine,
                state,
                was,
                seq,
                started_at,
                updated,
                was_reason,
                was_detail,
                crc,
                chunk,
            )
            same.append((run_id, *moved))
            written[run_id] = moved
        else:
            if reason is None:
                reason = was_reason
            if detail is None:
                detail = was_detail
            crc = row_checksum(
                run_id, machine, state, outcome, seq, started_at, updated, reason, detail
            )
            changed.append((seq, updated, state, crc, chunk, run_id, *row, outcome, reason, detail))
            written[run_id] = (
                machine,
                state,
                outcome,
                seq,
                started_at,
                updated,
                reason,
                detail,
                crc,
                chunk,
            )
            running += (outcome == RUNNING) - (was == RUNNING)
    return same, changed, written, prevs, running


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        # A failed rollback leaves nothing more to undo: SQLite rolls back on close.
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


class _Checkpointer:
    """Checkpoints the WAL into the database file on a thread and a connection of its own.

    SQLite's automatic checkpoint runs inside the commit that crosses its threshold:
    every few batches, one append also copies megabytes from the WAL into the database
    file and syncs both. Instead, the store tells this thread what each append wrote,
    and every ``CHECKPOINT_BYTES`` (estimated) the thread runs a ``PASSIVE``
    checkpoint, which neither waits for nor blocks the writer or readers, while the
    writer goes on with the next batch. The writer keeps SQLite's own checkpoint at
    ``AUTOCHECKPOINT_BYTES``: it copies what this thread has not yet and lets the WAL
    start over from its beginning, so the WAL stays bounded whatever this thread does.

    Durability is SQLite's own: a checkpoint syncs the WAL before it copies, then the
    database file, as the ``synchronous`` setting says.
    """

    def __init__(self, path: str, synchronous: str) -> None:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            self._page_size: int = conn.execute("PRAGMA page_size").fetchone()[0]
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._pending = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"interlock checkpoint of {path}", daemon=True
        )
        self._thread.start()

    def wrote(self, size: int, rows: int) -> None:
        """Count a commit of ``rows`` chunks of ``size`` bytes; wake the thread when due."""
        # The chunks' bytes, plus the leaves of chunks, intents and the runs index.
        self._pending += size + (rows + 4) * self._page_size
        if self._pending >= CHECKPOINT_BYTES:
            self._pending = 0
            self._wake.set()

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    return
                # A failed checkpoint loses nothing: the frames stay in the WAL for
                # the next one, or the writer's own.
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            self._conn.close()

    def stop(self) -> None:
        """Ask the thread to close its connection and end, after its current checkpoint."""
        self._stopping = True
        self._wake.set()

    def close(self) -> None:
        """Stop the thread and wait for it to end."""
        self.stop()
        self._thread.join()


class JournalHeld(StoreError):
    """Another process holds the journal for writing: one writer per SQLite journal.

    Raised by :func:`open_sqlite_store` (and :func:`hold_journal`) before anything is
    read, written or resumed, so the process that gets it has changed nothing.

    Attributes:
      path: the journal, as given.
      holder: what the holder wrote in the lock file: ``pid``, ``host``, ``command`` and
        ``since`` (a Unix time), or ``{}`` if it had not written it yet.
      who: the holder in words, e.g. ``pid 4242 (interlock resume, since 14:03:11)``.
    """

    def __init__(self, path: str, holder: dict[str, Any], waited: float) -> None:
        self.path = path
        self.holder = holder
        self.who = _describe_holder(holder)
        after = f" (after waiting {waited:g} s)" if waited > 0 else ""
        super().__init__(
            f"journal {path} is held by {self.who}{after}; wait for it to finish or stop it"
        )


#: The lock file of a journal: ``<db>.lock`` beside it.
LOCK_SUFFIX = ".lock"
#: Seconds between two tries to take a lock held by another process, when waiting for it.
_LOCK_POLL = 0.05
#: Seconds a failed try re-reads an empty lock file (its holder may be writing it).
_HOLDER_READ = 0.5


def _describe_holder(holder: dict[str, Any]) -> str:
    """``pid 4242 (interlock resume, since 14:03:11)``, from what a holder wrote."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return "another process (it has not written who it is)"
    words = str(holder.get("command", "")).split()
    # the program and its subcommand: the first word, and the words up to the first option
    name = " ".join(words[:1] + list(itertools.takewhile(lambda w: w[:1] != "-", words[1:3])))
    where = ""
    host = holder.get("host")
    if isinstance(host, str) and host != socket.gethostname():
        where = f" on host {host}"
    since = holder.get("since")
    when = ""
    if isinstance(since, int | float) and math.isfinite(since):
        moment = datetime.datetime.fromtimestamp(since)
        today = datetime.datetime.now().date()
        when = ", since " + moment.strftime(
            "%H:%M:%S" if moment.date() == today else "%Y-%m-%d %H:%M:%S"
        )
    return f"pid {pid}{where} ({name or '?'}{when})"


def _command_line() -> str:
    """This process's command line, as a person would type it."""
    argv = list(sys.argv) or [""]
    program = [os.path.basename(argv[0])]
    if program[0] == "__main__.py":  # python -m interlock
        program = [os.path.basename(os.path.dirname(argv[0])) or "python"]
    elif program[0] in ("", "-c"):  # python -c, or an interpreter with no script
        program = [os.path.basename(sys.executable) or "python", *filter(None, argv[:1])]
    return shlex.join([*program, *argv[1:]])[:500]


class _WriterLock:
    """This process's hold on one journal: an exclusive ``flock`` on ``<db>.lock``.

    The kernel releases a ``flock`` when the last descriptor of its open file is
    closed, so a holder killed even by SIGKILL releases the journal at once, and no
    stale lock can outlive its process (unlike a pid file). The file stays (removing it
    would race with a process about to lock it); what is in it names the holder, for
    the error a second process gets, and means nothing once the lock is free.

    The lock is the process's: stores of one process on one journal share it (counted),
    as SQLite itself lets them; it is other processes that it keeps out.
    """

    __slots__ = ("count", "fd", "key")

    def __init__(self, key: str, fd: int) -> None:
        self.key = key
        self.fd = fd
        self.count = 1

    def release(self) -> None:
        """Let go of one hold; the last one unlocks the journal. Idempotent per hold."""
        with _HELD_GUARD:
            self.count -= 1
            if self.count > 0 or _HELD.get(self.key) is not self:
                return
            del _HELD[self.key]
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)  # the holder it names is gone
            os.close(self.fd)  # releases the flock


#: The journals this process holds, by the real path of their lock file.
_HELD: dict[str, _WriterLock] = {}
_HELD_GUARD = threading.Lock()


def _lock_path(path: str) -> str:
    return os.path.realpath(path) + LOCK_SUFFIX


def _try_lock(path: str) -> _WriterLock | None:
    """Take the journal's lock without waiting: the hold, or None if another process has it."""
    key = _lock_path(path)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None:
            held.count += 1
            return held
        try:
            fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(
                f"{path}: cannot open its lock file {key}: {exc.strerror}; the journal's "
                "directory must be writable to write the journal"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise StoreError(
                f"{path}: cannot lock {key}: {exc.strerror}; put the journal on a local file system"
            ) from exc
        try:
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": _command_line(),
                "since": time.time(),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        held = _HELD[key] = _WriterLock(key, fd)
        return held


def _read_holder(key: str) -> dict[str, Any]:
    """What the lock's holder wrote in it; ``{}`` if it wrote nothing readable yet."""
    deadline = time.monotonic() + _HOLDER_READ
    while True:
        try:
            with open(key, "rb") as file:
                holder = json.loads(file.read() or b"null")
        except (OSError, ValueError):
            holder = None
        if isinstance(holder, dict) or time.monotonic() >= deadline:
            return holder if isinstance(holder, dict) else {}
        time.sleep(0.01)  # the holder took the lock and is writing who it is


async def _take_lock(
    path: str, wait: float, on_wait: Callable[[JournalHeld], object] | None = None
) -> _WriterLock:
    """Take the journal's writer lock, waiting up to ``wait`` seconds for its holder.

    ``on_wait`` is called once, with the error it would raise (not raised), if it waits.

    Raises:
      JournalHeld: another process still holds it after ``wait`` seconds (at once for 0).
      ValueError: ``wait`` is negative or NaN.
    """
    if not wait >= 0:
        raise ValueError(f"wait must be 0 or more seconds (math.inf: no limit); got {wait!r}")
    deadline = trio.current_time() + wait
    waiting = False
    while True:
        held = await trio.to_thread.run_sync(_try_lock, path)
        if held is not None:
            return held
        if trio.current_time() >= deadline:
            holder = await trio.to_thread.run_sync(_read_holder, _lock_path(path))
            raise JournalHeld(path, holder, wait)
        if not waiting and on_wait is not None:
            holder = await trio.to_thread.run_sync(_read_holder, _lock_path(path))
            on_wait(JournalHeld(path, holder, 0.0))
        waiting = True
        await trio.sleep(min(_LOCK_POLL, max(0.0, deadline - trio.current_time())))


@contextlib.asynccontextmanager
async def hold_journal(
    path: str | os.PathLike[str],
    *,
    wait: float = 0.0,
    on_wait: Callable[[JournalHeld], object] | None = None,
) -> AsyncIterator[None]:
    """Hold the SQLite journal at ``path`` for writing, in this process, for the block.

    What :func:`open_sqlite_store` takes when it opens a journal for writing, without
    opening it: a command takes it before it reads what it will resume, so a second
    one waits here (or fails here) before it has read or changed anything. Stores this
    process opens on ``path`` inside the block share the hold.

    Args:
      path: the journal (the file need not exist).
      wait: seconds to wait for another process's hold to end; 0 fails at once,
        ``math.inf`` waits as long as it takes.
      on_wait: called once if it has to wait, with the :class:`JournalHeld` it would
        raise (its ``who`` names the holder), to say so.

    Raises:
      JournalHeld: another process holds it (after ``wait`` seconds); the message names it.
    """
    held = await _take_lock(os.fspath(path), wait, on_wait)
    try:
        yield
    finally:
        held.release()


class SQLiteStore(Store):
    """The journal and the runs index in one SQLite file, in WAL mode.

    One connection serves the store. Every call hops to a worker thread with
    :func:`trio.to_thread.run_sync` and a :class:`trio.Lock` lets one thread at a
    time use the connection. :meth:`append` writes a whole batch in one
    ``BEGIN IMMEDIATE`` transaction: that is the group commit, one fsync (at most)
    per batch, so throughput comes from batching. Each run's events of a batch are
    one row (a chunk of frames), and a thread of the store's own checkpoints the WAL
    into the database file while appends go on.

    Durability, by the ``synchronous`` setting given to :func:`open_sqlite_store`:

    - ``NORMAL`` (the default): in WAL mode a commit survives a crash of the
      process, but the last transactions before a power loss or an OS crash can
      be lost (the WAL is synced at checkpoints, not at each commit). The
      database itself is never corrupted.
    - ``FULL``: the WAL is synced at every commit, so a batch survives a power
      loss once :meth:`append` returns. It costs an fsync per batch.

    Either way, committed batches live in the ``-wal`` file beside the database until
    a checkpoint copies them in: a ``-wal`` lost or damaged before that (a copy of the
    database file alone, say) silently drops them, as SQLite does. :meth:`check` finds
    damage to what is there; of what is gone, only what the ``-shm`` a crashed writer
    left says its ``-wal`` held, read when the store opens (before SQLite rebuilds it;
    a reader leaves it as it is where the ``-wal`` is missing).

    Other processes may read the file while the store writes it (WAL). One process
    writes it: a store opened for writing holds ``<path>.lock`` (:func:`hold_journal`),
    so a second process gets :class:`JournalHeld`, naming the first, before it has read
    or written anything. (Stores of one process share the hold; their batches still
    wait up to ``BUSY_TIMEOUT_MS`` for SQLite's write lock.)
    """

    kind = "sqlite"

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: str,
        *,
        synchronous: str,
        readonly: bool,
        checkpointer: _Checkpointer | None = None,
        checksums: bool = True,
        held: _WriterLock | None = None,
        version: int = SCHEMA_VERSION,
        lost: str | None = None,
    ) -> None:
        """Wrap an open, checked connection; use :func:`open_sqlite_store` instead.

        ``checksums`` is False only for a version 2 database opened read-only; ``held``
        is the writer's lock (None read-only), released when the store closes; ``lost``
        says what committed transactions a crash's -wal lost (:func:`_lost_wal`), for
        :meth:`check` to report.
        """
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._folder = os.path.dirname(os.path.abspath(path))
        self._synchronous = synchronous
        self._checksums = checksums
        # The index row's columns (completed with " FROM runs", or with more columns).
        self._select = f"SELECT {_READ_COLUMNS}{', crc' if checksums else ''}"
        self._read = _verified if checksums else _unverified
        self._readonly = readonly
        self._lost = lost
        self._lock = trio.Lock()
        self._checkpointer = checkpointer
        self._held = held
        # Version 4 keeps the unfinished runs in an index of their own (and counts them).
        self._indexed_unfinished = version >= 4
        # Version 5 chains each run's chunks from its index row (see _CHUNKS).
        self._chained = version >= 5
        # Version 6 moves continuing runs' rows lazily (see _MOVES): the moves table as
        # last decoded, ``(max id, rows, latest move of each run)``, reused while the
        # table is unchanged; and, writing, since when and over how many batches this
        # store has left moves pending (applied once INDEX_LAG_* says so).
        self._lazy = version >= 6
        self._moves: tuple[Any, int, dict[str, _Move]] | None = None
        self._lag_since: float | None = None
        self._lag_batches = 0
        # PRAGMA data_version after this store's last batch (see _append_sync).
        self._data_version: int | None = None
        # The rows as stored in runs that this store wrote itself (no other connection
        # having written since: see _data_version), so that applying pending moves need
        # not read them back; at most REMEMBERED_ROWS, like _rows.
        self._stored: dict[str, _Row] = {}
        # The index row this store last wrote of each run (see _index_fast), at most
        # REMEMBERED_ROWS of them, the oldest forgotten first; written and read only by
        # the thread that appends, holding the lock, and only after a batch committed.
        self._rows: dict[str, _Row] = {}
        # A store dropped without aclose() still ends its checkpoint thread and closes
        # its connection, then and there, with a ResourceWarning (as an unclosed file).
        self._dropped = weakref.finalize(self, _dropped, conn, checkpointer, path, held)

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "NORMAL",
        readonly: bool = False,
        wait: float = 0.0,
    ) -> SQLiteStore:
        """Same as :func:`open_sqlite_store`."""
        return await open_sqlite_store(path, synchronous=synchronous, readonly=readonly, wait=wait)

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
                if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                    raise StoreError(
                        f"journal {self._path}: disk is full ({exc}), so {what} wrote nothing; "
                        f"free space on the disk holding {self._folder}, then retry"
                    ) from exc
                raise StoreError(f"{self._path}: {what} failed: {exc}") from exc

    async def append(self, events: Sequence[Event]) -> None:
        """Append one batch in one transaction; see :meth:`Store.append`.

        Raises:
          StoreError: the store is closed or read-only, a seq or an idempotency key
            is already stored (another process advanced a run, say), or SQLite failed
            (disk full, locked by another writer); nothing of the batch was written.
          IndexDamaged: the index row of a run the batch continues is damaged.
        """
        if self._readonly:
            raise StoreError(
                f"store {self._path} is read-only; open it without readonly=True to append"
            )
        if not events:
            await trio.lowlevel.checkpoint()
            return
        # Encoding, framing and grouping happen here, outside the lock and the
        # thread, so the writer thread only runs SQL.
        try:
            batch = _Batch(events)
        except ENCODING_ERRORS as exc:
            raise unencodable(events, exc) from exc
        await self._call("append", lambda conn: self._append_sync(conn, batch))
        self.bytes_written += batch.size
        if self._checkpointer is not None:
            self._checkpointer.wrote(batch.size, len(batch.chunks))

    async def probe_write(self) -> None:
        """See :meth:`Store.probe_write`: a page-sized row, written to the meta table and
        deleted in one committed transaction (the database must be able to grow by a page,
        and the WAL to take the commit); a full disk fails it as it fails an append."""
        if self._readonly:
            raise StoreError(
                f"store {self._path} is read-only; open it without readonly=True to write"
            )
        await self._call("a write probe", self._probe_sync)

    def _probe_sync(self, conn: sqlite3.Connection) -> None:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "INSERT OR REPLACE INTO meta (name, value) VALUES ('probe', ?)", ("x" * page,)
            )
            conn.execute("DELETE FROM meta WHERE name = 'probe'")
            conn.execute("COMMIT")
        except Exception:
            _rollback(conn)
            raise

    def _append_sync(self, conn: sqlite3.Connection, batch: _Batch) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another connection committed since this store's last batch (another store
            # of the process, or a program writing the file behind interlock's back): the
            # rows this store remembers may be stale, or damaged, so none is moved from
            # without being read and checked (a remembered row is otherwise moved from
            # unread, its move pending in the moves table).
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if version != self._data_version:
                self._rows.clear()
                self._stored.clear()
                self._moves = None
            # The latest pending move of each run, kept up to date through the
            # transaction (and remembered with the table's state once it commits).
            latest = self._pending(conn)
            # The rows this transaction writes in runs, for _stored once it commits.
            staged: dict[str, _Row] = {}
            # The batch's chunks take the ids after the last one, in the order of
            # batch.chunks (and batch.runs); the index rows name them.
            first = (conn.execute(_LAST_CHUNK).fetchone()[0] or 0) + 1
            fast = self._index_fast(conn, batch, first, latest, staged)
            moved: list[_Move] = []
            if fast is None:
                # the checked path reads and writes rows: the moves pending (as the table
                # holds them now: the fast path may have applied them) are applied first
                latest = self._flush(conn, _pending_moves(conn), staged)
                written = self._index_checked(conn, batch, first)
                staged.update(written[0])
            else:
                written, moved, kept = fast
                if kept is not None:  # it applied the moves pending, to read rows
                    latest = kept
            _insert(
                conn,
                _INSERT_CHUNKS,
                _INSERT_CHUNK,
                [
                    # NOTE: a bytearray, not the bytes: sqlite3 binds int, float, str and
                    # bytearray as they are, and asks anything else (bytes too) for an
                    # adapter first, two AttributeErrors raised and cleared per value;
                    # the copy costs less (benchmarks/gateway_instructions.md).
                    (first + at, run_id, first_seq, last_seq, prev, bytearray(body))
                    for at, ((run_id, first_seq, last_seq, body), prev) in enumerate(
                        zip(batch.chunks, written[1], strict=True)
                    )
                ],
            )
            if batch.intents:
                _insert(conn, _INSERT_INTENTS, _INSERT_INTENT, batch.intents)
            lag_since, lag_batches = self._lag_since, self._lag_batches
            if moved:
                conn.execute(_INSERT_MOVES, (bytearray(_encode(moved)),))
                for move in moved:
                    latest[move[0]] = move
                now = time.monotonic()
                if lag_since is None:
                    lag_since = now
                lag_batches += 1
                if lag_batches >= INDEX_LAG_BATCHES or now - lag_since >= INDEX_LAG_SECONDS:
                    latest = self._flush(conn, latest, staged)
                    lag_since, lag_batches = None, 0
            seen = (*conn.execute(_MOVES_STATE).fetchone(), latest) if self._lazy else None
            conn.execute("COMMIT")
        except sqlite3.IntegrityError as exc:
            _rollback(conn)
            self._moves = None
            raise StoreError(self._explain_integrity(conn, exc, batch)) from exc
        except Exception:
            _rollback(conn)
            self._moves = None
            raise
        self._remember(written[0], staged)
        self._moves = seen
        self._lag_since, self._lag_batches = lag_since, lag_batches
        self._data_version = version
        self._keep_stored(staged)

    def _flush(
        self, conn: sqlite3.Connection, latest: dict[str, _Move], staged: dict[str, _Row]
    ) -> dict[str, _Move]:
        """:func:`_flush_moves` in this transaction, with the rows this store knows as
        stored (``_stored`` and those ``staged`` so far); the rows it writes are staged
        too. Returns the moves left pending."""
        known = {**self._stored, **staged} if staged else self._stored
        kept, written = _flush_moves(conn, latest, known)
        staged.update(written)
        return kept

    def _keep_stored(self, staged: dict[str, _Row]) -> None:
        """Remember the rows a committed transaction wrote in runs (see ``_stored``): of
        runs not finished, at most REMEMBERED_ROWS, the oldest forgotten first."""
        stored = self._stored
        for run_id, row in staged.items():
            if row[2] in _FINISHED:
                stored.pop(run_id, None)
            else:
                stored.pop(run_id, None)  # to the end: the most recent last
                stored[run_id] = row
        excess = len(stored) - REMEMBERED_ROWS
        if excess > 0:
            for run_id in list(itertools.islice(stored, excess)):
                del stored[run_id]

    def _pending(self, conn: sqlite3.Connection) -> dict[str, _Move]:
        """The latest pending index move of each run (version 6; none before), decoded
        again only if the moves table changed since this store last saw it. Call it in
        the read transaction of the rows it is taken with."""
        if not self._lazy:
            return {}
        top, count = conn.execute(_MOVES_STATE).fetchone()
        seen = self._moves
        if seen is not None and (top, count) == (seen[0], seen[1]):
            return seen[2]
        latest = _pending_moves(conn) if count else {}
        self._moves = (top, count, latest)
        return latest

    def _apply_moves(self, conn: sqlite3.Connection) -> None:
        """Apply the pending index moves to ``runs`` now (a writer's check, and close)."""
        if not self._lazy or self._readonly:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            staged: dict[str, _Row] = {}
            if conn.execute("PRAGMA data_version").fetchone()[0] != self._data_version:
                self._stored.clear()  # another connection wrote since: read every row
                self._moves = None
            latest = self._flush(conn, self._pending(conn), staged)
            seen = (*conn.execute(_MOVES_STATE).fetchone(), latest)
            conn.execute("COMMIT")
        except Exception:
            _rollback(conn)
            self._moves = None
            raise
        self._moves = seen
        self._lag_since, self._lag_batches = None, 0
        self._keep_stored(staged)

    def _remember(self, written: dict[str, _Row], staged: dict[str, _Row]) -> None:
        """Remember the index rows a batch committed (see ``_rows``); a run that finished
        is among those it wrote in runs (``staged``: a run whose outcome changes moves at
        once)."""
        rows = self._rows
        rows.update(written)
        for run_id in [run_id for run_id, row in staged.items() if row[2] in _FINISHED]:
            rows.pop(run_id, None)
        excess = len(rows) - REMEMBERED_ROWS
        if excess > 0:
            for run_id in list(itertools.islice(rows, excess)):
                del rows[run_id]

    def _index_fast(
        self,
        conn: sqlite3.Connection,
        batch: _Batch,
        first_chunk: int,
        pending: dict[str, _Move],
        staged: dict[str, _Row],
    ) -> (
        tuple[tuple[dict[str, _Row], list[int | None]], list[_Move], dict[str, _Move] | None] | None
    ):
        """Move the runs index without a checksum computed in SQL: the rows written (to
        remember once the batch commits) and each chunk's ``prev`` (the chunk its run's row
        named); the pending moves of the runs the batch continues (for the moves table);
        and, if it applied the moves pending (to read rows of runs it does not remember),
        those left pending. None (and nothing done) if any run is not where the batch says
        it is, for :meth:`_index_checked` to explain. The batch's chunks take ids from
        ``first_chunk`` on, in order.

        A run the batch starts is inserted in ``runs`` at once; any other run's row moves
        from the seq before its first event in the batch, and only in the fields its events
        change. That is what :func:`index_updates` gives from the stored rows. The row moved
        from is the one this store last wrote or moved (``_rows``), or, for a run it does
        not remember, the stored row, read and checked against its checksum here once the
        moves pending are applied; the move itself waits in the moves table (version 6),
        and :func:`_flush_moves` applies it only to the very row it was moved from.
        """
        if not batch.contiguous or batch.irregular:
            return None  # let the checked path say what is wrong
        starting = set(batch.starts)
        remembered = self._rows
        runs = batch.runs
        kept = None
        # NOTE: first from the rows remembered alone (every run of a steady load is): a
        # separate pass to find the runs not remembered cost as much again per run
        moving = _move_runs(runs, remembered, {}, starting, first_chunk)
        if moving is None:
            unknown = [
                run_id
                for run_id, run in runs.items()
                if ((row := remembered.get(run_id)) is None or row[3] != run[0] - 1)
                and not (run[0] == 1 and run_id in starting)
            ]
            if not unknown:
                return None  # pragma: no cover - _move_runs moves every remembered run
            kept = pending = self._flush(conn, pending, staged)  # the stored rows are current
            stored = _stored_rows(conn, [r for r in unknown if r not in kept])
            moving = _move_runs(runs, remembered, stored, starting, first_chunk)
            if moving is None:
                return None
        same, changed, written, prevs, running = moving
        started = [event for event in batch.marks if event.run_id in starting] if starting else ()
        inserted = 0
        if started:
            records = index_updates(started, {}).values()
            running += sum(record.outcome == RUNNING for record in records)
            ids = {run_id: chunk for chunk, run_id in enumerate(runs, first_chunk)}
            rows = []
            for record in records:
                row = _index_row(record, ids[record.run_id])
                rows.append(row)
                written[record.run_id] = staged[record.run_id] = row[1:]
            inserted = conn.executemany(_INSERT_RUN, rows).rowcount
        # NOTE: a run whose outcome (or reason) changes is moved in runs at once, so the
        # index of unfinished runs and their count never lag: only a run going on in the
        # same outcome waits in the moves table. Runs end once; they go on every step.
        settled = self._settle(conn, changed, pending) if changed else 0
        for params in changed:
            staged[params[5]] = written[params[5]]
        if inserted != len(starting) or settled != len(changed):
            # Nothing but these rows was written in the transaction yet (beside moves
            # applied, which the checked path applies again): undo it whole (no savepoint
            # to pay for in every batch) and start over for the checked path.
            conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
            staged.clear()
            return None
        if inserted:
            conn.execute(_COUNT_RUNS, (inserted,))
        if running:
            conn.execute(_COUNT_RUNNING, (running,))
        return (written, prevs), same, kept

    @staticmethod
    def _settle(
        conn: sqlite3.Connection, changed: list[tuple[Any, ...]], pending: dict[str, _Move]
    ) -> int:
        """Move the rows of runs whose outcome changes (``changed``: the parameters of
        _MOVE_ROW_OUTCOME) in ``runs`` now; return how many moved. A run with no move
        pending moves from the row this store wrote, compared column by column as ever;
        one with moves pending (its row behind them) from its row read and checked here."""
        direct = [params for params in changed if params[5] not in pending]
        moved = conn.executemany(_MOVE_ROW_OUTCOME, direct).rowcount if direct else 0
        behind = [params for params in changed if params[5] in pending]
        if behind:
            stored = _stored_rows(conn, [params[5] for params in behind])
            applied = []
            for params in behind:
                seq, updated, state, crc, chunk, run_id = params[:6]
                row = stored.get(run_id)
                if row is None or row[0] != params[6] or row[4] != params[10] or row[3] >= seq:
                    continue  # damaged, missing or changed behind: the checked path says which
                applied.append((seq, updated, state, crc, chunk, *params[-3:], run_id, row[8]))
            if applied:
                moved += conn.executemany(_APPLY_MOVE_OUTCOME, applied).rowcount
        return moved

    @staticmethod
    def _index_checked(
        conn: sqlite3.Connection, batch: _Batch, first_chunk: int
    ) -> tuple[dict[str, _Row], list[int | None]]:
        """Read each run's row, check the batch against it (raising what is wrong), and
        write the rows :func:`index_updates` gives; return them, as ``_rows`` holds them,
        and each chunk's ``prev``, as :meth:`_index_fast` does."""
        current: dict[str, RunRecord] = {}
        prevs: list[int | None] = []
        ids: dict[str, int] = {}
        for chunk, (run_id, *_) in enumerate(batch.chunks, first_chunk):
            row = conn.execute(_SELECT_RUN, (run_id,)).fetchone()
            ids[run_id] = chunk
            if row is not None:
                current[run_id] = looked_up(run_id, _verified(row[:-1]))
                prevs.append(_chunk_id(run_id, row[-1]))
            else:
                prevs.append(None)
        check_batch(batch.events, {run_id: record.seq for run_id, record in current.items()})
        updates = index_updates(batch.marks, current)
        rows = [_index_row(r, ids[r.run_id]) for r in updates.values()]
        conn.executemany(_UPSERT_RUN, rows)
        conn.execute(_COUNT_RUNS, (len(updates) - len(current),))
        running = sum(r.outcome == RUNNING for r in updates.values()) - sum(
            current[run_id].outcome == RUNNING for run_id in updates if run_id in current
        )
        if running:
            conn.execute(_COUNT_RUNNING, (running,))
        return {row[0]: row[1:] for row in rows}, prevs

    def _explain_integrity(
        self, conn: sqlite3.Connection, exc: sqlite3.IntegrityError, batch: _Batch
    ) -> str:
        if "intents.key" in str(exc):
            # The batch was rolled back, so the key found is the one stored before it.
            for key, _run_id, _seq in batch.intents:
                if conn.execute("SELECT 1 FROM intents WHERE key = ?", (key,)).fetchone():
                    return f"idempotency key {key!r} was already recorded; nothing was written"
        if "chunks.run_id" in str(exc):
            # The journal holds the run further than its index row said.
            for run_id, first, _last, _body in batch.chunks:
                if first != 1 and self._chained:
                    continue  # only a run's first chunk is unique (chunks_first)
                stored = conn.execute(_LAST_SEQ, (run_id,)).fetchone()[0]
                if stored is not None and stored >= first:
                    return str(another_writer(run_id, stored, first))
        return f"{self._path}: the batch breaks a constraint ({exc}); nothing was written"

    def _chunks(
        self, conn: sqlite3.Connection, run_id: str, row: Any, after: int
    ) -> list[tuple[int, int, bytes]]:
        """The chunks of ``run_id`` that hold its seqs past ``after`` (0: all of them), the
        index row ``row`` read (with its chunk last), oldest first.

        Version 5 walks the run's chain from the chunk its row names; a chain that does not
        reach back as far as it should (a pointer or a chunk damaged or lost) is read again
        whole, by run id, as version 4 reads it, so that what is wrong is reported at its
        seq just as there.
        """
        if self._chained:
            if row is None:
                if conn.execute(_HAS_FIRST_CHUNK, (run_id,)).fetchone() is None:
                    return []
            elif type(row[-1]) is int:
                chain = conn.execute(_CHAIN, (row[-1], after)).fetchall()
                if chain:
                    oldest = chain[-1]
                    reached = oldest[1] is None or oldest[3] <= after + 1
                    if reached and all(link[2] == run_id for link in chain):
                        return [link[3:] for link in reversed(chain)]
        if after:
            return conn.execute(_SELECT_CHUNKS_AFTER, (run_id, after)).fetchall()
        return conn.execute(_SELECT_CHUNKS, (run_id,)).fetchall()

    async def load(self, run_id: str) -> list[JournalEvent]:
        record, chunks = await self._journal("load", run_id, 0)
        if not chunks:
            raise missing_journal(run_id, record.seq)
        return decode_chunks(run_id, chunks, record.seq)

    async def load_after(self, run_id: str, seq: int) -> list[JournalEvent]:
        """The events of ``run_id`` after seq ``seq`` (a follower's tail read); checked as
        :meth:`load` checks them.

        Raises:
          RunNotFound: no such run.
          JournalCorrupt, IndexDamaged: as :meth:`load`.
        """
        record, chunks = await self._journal("load_after", run_id, max(seq, 0))
        return decode_chunks_after(run_id, chunks, record.seq, seq)

    async def _journal(
        self, what: str, run_id: str, after: int
    ) -> tuple[RunRecord, list[tuple[int, int, bytes]]]:
        """``run_id``'s index record (its pending move taken) and its chunks holding the
        seqs past ``after``, read in one transaction.

        Raises:
          RunNotFound: no such run; IndexDamaged: its chunks are there but its index row
            is not, or the row is damaged.
        """
        select_run = (
            f"{self._select}{', chunk' if self._chained else ''} FROM runs WHERE run_id = ?"
        )

        def read(
            conn: sqlite3.Connection,
        ) -> tuple[Any, _Move | None, list[tuple[int, int, bytes]]]:
            conn.execute("BEGIN")  # the row, its pending move and its chunks as of one moment
            try:
                row = conn.execute(select_run, (run_id,)).fetchone()
                if row is None:  # are there chunks without their row? (all of them, to tell)
                    return None, None, self._chunks(conn, run_id, None, 0)
                move = _ahead(row, self._pending(conn).get(run_id))
                head = row if move is None else (*row[:-1], move[10])
                chunks = self._chunks(conn, run_id, head, after)
            finally:
                conn.execute("COMMIT")
            return (row[:-1] if self._chained else row), move, chunks

        row, move, chunks = await self._call(what, read)
        if row is None:
            if chunks:
                raise missing_index_row(run_id)
            raise RunNotFound(run_id)
        record = looked_up(run_id, self._read(row))
        return (record if move is None else stored_record(move)), chunks

    async def get_run(self, run_id: str) -> RunRecord:
        select_run = f"{self._select} FROM runs WHERE run_id = ?"
        has_chunks = _HAS_FIRST_CHUNK if self._chained else _HAS_CHUNKS

        def read(conn: sqlite3.Connection) -> tuple[Any, _Move | None, bool]:
            conn.execute("BEGIN")  # the row and its pending move as of one moment
            try:
                row = conn.execute(select_run, (run_id,)).fetchone()
                if row is None:
                    journaled = conn.execute(has_chunks, (run_id,)).fetchone() is not None
                    return row, None, journaled
                return row, _ahead(row, self._pending(conn).get(run_id)), False
            finally:
                conn.execute("COMMIT")

        row, move, journaled = await self._call("get_run", read)
        if row is None:
            if journaled:
                raise missing_index_row(run_id)
            raise RunNotFound(run_id)
        record = looked_up(run_id, self._read(row))
        return record if move is None else stored_record(move)

    async def list_runs(
        self,
        *,
        machine: str | None = None,
        state: str | None = None,
        outcome: str | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        def read(conn: sqlite3.Connection) -> tuple[list[Any], Any, dict[str, _Move]]:
            conn.execute("BEGIN")  # the rows, their count and the moves as of one moment
            try:
                return (
                    conn.execute(f"{self._select} FROM runs").fetchall(),
                    conn.execute(_RUNS_COUNTED).fetchone(),
                    self._pending(conn),
                )
            finally:
                conn.execute("COMMIT")

        rows, counted, moves = await self._call("list_runs", read)
        # Counted once each: a damaged page can point twice at one row (and at another never).
        records = {record.run_id: record for record in map(self._read, rows)}
        if self._checksums:
            self._check_count(len(records), counted)
        for run_id, move in moves.items():
            record = records.get(run_id)
            if record is not None and move[4] > record.seq:
                records[run_id] = stored_record(move)
        return select_runs(
            records.values(), machine=machine, state=state, outcome=outcome, limit=limit
        )

    async def count_runs(self, *, outcome: str) -> int:
        """How many runs have ``outcome``, counted by SQLite (see :meth:`Store.count_runs`):
        a run's row moves as soon as its outcome changes, so the pending moves do not
        change the count."""
        rows = await self._call(
            "count_runs",
            lambda conn: conn.execute(
                "SELECT count(*) FROM runs WHERE outcome = ?", (outcome,)
            ).fetchone(),
        )
        return int(rows[0])

    async def unfinished(self) -> list[RunRecord]:
        """Runs that are neither terminal nor escalated, oldest first; see :meth:`Store.unfinished`.

        Read through the index of unfinished runs, so the time it takes grows with their
        number, not with the journal's. Each row is checked as :meth:`list_runs` checks
        it (its checksum), and so is their number, against the count kept beside them.
        A database of schema version 3 or older opened read-only has no such index: its
        runs are all read, as :meth:`list_runs` does.

        Raises:
          IndexDamaged: a row fails its checksum, or the index lists a run that is not
            unfinished or misses one (its count disagrees).
        """
        if not self._indexed_unfinished:
            return await super().unfinished()

        def read(conn: sqlite3.Connection) -> tuple[list[Any], Any, dict[str, _Move], list[Any]]:
            conn.execute("BEGIN")  # the rows, their count and the moves as of one moment
            try:
                unfinished = conn.execute(_SELECT_UNFINISHED).fetchall()
                moves = self._pending(conn)
                # the rows of runs a pending move resumes (not in the index of unfinished
                # runs yet), to check before the move is taken over them
                listed = {row[0] for row in unfinished}
                resumed = [
                    conn.execute(f"{_SELECT_RUN}", (run_id,)).fetchone()
                    for run_id, move in moves.items()
                    if move[3] == RUNNING and run_id.encode() not in listed
                ]
                return unfinished, conn.execute(_RUNNING_COUNTED).fetchone(), moves, resumed
            finally:
                conn.execute("COMMIT")

        rows, counted, moves, resumed = await self._call("unfinished", read)
        records = {record.run_id: record for record in map(_verified, rows)}
        for record in records.values():
            if record.outcome != RUNNING:
                raise IndexDamaged(
                    record.run_id,
                    f"the index of unfinished runs lists it, but its row says {record.outcome}",
                )
        if counted is None or counted[0] != str(len(records)):
            unfinished = "an unknown number" if counted is None else repr(counted[0])
            raise IndexDamaged(
                None,
                f"the index of unfinished runs holds {len(records)}, but {unfinished} runs "
                "are unfinished",
            )
        # The runs the index does not hold yet: where their pending move resumes them.
        for row in resumed:
            if row is not None:
                record = _verified(row[:-1])
                if _ahead(row, moves.get(record.run_id)) is not None:
                    records[record.run_id] = record
        for run_id, move in moves.items():
            current = records.get(run_id)
            if current is not None and move[4] > current.seq:
                if move[3] == RUNNING:
                    records[run_id] = stored_record(move)
                else:
                    del records[run_id]
        return sorted(records.values(), key=lambda r: (r.started, r.run_id))

    @staticmethod
    def _check_count(rows: int, counted: Any) -> None:
        """Raise IndexDamaged unless the index holds a row per run started."""
        if counted is None or counted[0] != str(rows):
            started = "an unknown number" if counted is None else counted[0]
            if not str(started).isdigit():
                started = repr(started)
            raise IndexDamaged(None, f"row count {rows}, but {started} runs were started")

    async def check(self) -> CheckReport:
        def check(conn: sqlite3.Connection) -> CheckReport:
            # A writer applies the moves pending first; what it cannot apply (a move whose
            # row is damaged, or a damaged move) stays pending, for the check to report.
            with contextlib.suppress(IndexDamaged, sqlite3.DatabaseError):
                self._apply_moves(conn)
            return self._check_sync(conn)

        return await self._call("check", check)

    def _check_sync(self, conn: sqlite3.Connection) -> CheckReport:
        # One read transaction: every table as of one moment, even while a writer goes on.
        conn.execute("BEGIN")
        checker = Checker({}, ())
        try:
            index: dict[str, RunRecord] = {}
            damaged: list[IndexDamaged] = []
            for row in conn.execute(f"{self._select} FROM runs"):
                try:
                    record = self._read(row)
                except IndexDamaged as exc:
                    damaged.append(exc)
                else:
                    index[record.run_id] = record
            moves: dict[str, _Move] = {}
            unread: list[IndexDamaged] = []  # a pending move (not a row) that is damaged
            try:
                moves = self._pending(conn)
            except IndexDamaged as exc:
                unread.append(exc)
            # The rows read, intact or not: each is one run started (a pending move moves
            # a row, it adds none).
            started = len(index) + len(damaged)
            for run_id, move in moves.items():
                indexed = index.get(run_id)
                if indexed is None:
                    continue  # a damaged row (reported as such) or a missing one
                if move[1] != indexed.machine or move[5] != indexed.started:
                    damaged.append(
                        IndexDamaged(
                            run_id,
                            f"its pending index move (to seq {move[4]}) is of machine "
                            f"{move[1]!r} started at {move[5]!r}, its row of machine "
                            f"{indexed.machine!r} started at {indexed.started!r}",
                        )
                    )
                elif move[4] > indexed.seq:
                    index[run_id] = stored_record(move)
                # NOTE: else the row moved past the move (the run's outcome changed since,
                # which moves a row at once): the move is superseded, as every read and
                # _flush_moves take it, and waits to be dropped when the writer applies the
                # moves, or at its next open after a crash. Not damage.
            checker = Checker(index, damaged)
            if self._lost is not None:
                checker.problem(None, None, self._lost)
            for problem in unread:
                checker.problem(problem.run_id, None, str(problem))
            if self._checksums:
                try:
                    self._check_count(started, conn.execute(_RUNS_COUNTED).fetchone())
                except IndexDamaged as exc:
                    checker.problem(None, None, str(exc))
            for (line,) in conn.execute("PRAGMA integrity_check"):
                if line != "ok":
                    checker.problem(None, None, f"{self._path}: SQLite integrity check: {line}")
            if self._chained:
                self._check_chains(conn, checker, moves)
            chunks = conn.execute(
                "SELECT run_id, first_seq, last_seq, body FROM chunks ORDER BY run_id, first_seq"
            )
            for run_id, rows in itertools.groupby(chunks, key=lambda row: row[0]):
                checker.run(run_id, [row[1:] for row in rows])
            intents = conn.execute("SELECT key, run_id, seq FROM intents")
            checker.intents_table(intents, "the intents table")
            if self._indexed_unfinished and not checker.problems:
                # Beside other damage of the index, a count that disagrees is one of its
                # consequences (a row lost or changed); alone, it is damage of its own.
                running = sum(record.outcome == RUNNING for record in index.values())
                counted = conn.execute(_RUNNING_COUNTED).fetchone()
                if counted is None or counted[0] != str(running):
                    said = "nothing" if counted is None else repr(counted[0])
                    checker.problem(
                        None,
                        None,
                        f"{self._path}: the count of unfinished runs kept beside their index "
                        f"says {said}, but {running} runs are unfinished; restore it from a "
                        "backup",
                    )
        except sqlite3.DatabaseError as exc:
            checker.stopped(f"{self._path}: cannot read on past the damage: {exc}")
        finally:
            _rollback(conn)
        return checker.report()

    def _check_chains(
        self, conn: sqlite3.Connection, checker: Checker, moves: dict[str, _Move]
    ) -> None:
        """Version 5: each run's chunks chained in seq order from its first, and its index
        row (or its pending move, ahead of it) naming the last one; a link that is not is
        reported at its run and seq."""
        lasts = {
            run_id: (chunk, seq)
            for run_id, chunk, seq in conn.execute(
                "SELECT CAST(run_id AS BLOB), chunk, seq FROM runs"
            ).fetchall()
        }
        for run_id, move in moves.items():
            last = lasts.get(run_id.encode())
            if last is not None and type(last[1]) is int and move[4] > last[1]:
                lasts[run_id.encode()] = (move[10], move[4])
        chunks = conn.execute(
            "SELECT run_id, id, prev, first_seq, last_seq FROM chunks "
            "ORDER BY run_id, first_seq, id"
        )
        for run_id, rows in itertools.groupby(chunks, key=lambda row: row[0]):
            before = None
            seq = 0
            for _, chunk, prev, first_seq, last_seq in rows:
                if first_seq != seq + 1:
                    break  # missing or repeated seqs: reported as such, with the frames
                seq = last_seq
                if prev != before:
                    checker.problem(
                        run_id,
                        first_seq,
                        f"{self._path}: the chunk of run {run_id!r} from seq {first_seq} is "
                        f"chained to chunk {prev}, not to the run's chunk before it "
                        f"({before}); restore the journal from a backup",
                    )
                    break
                before = chunk
            else:
                key = run_id.encode() if isinstance(run_id, str) else run_id
                named, reached = lasts.get(key, (before, seq))
                # (an index row further on or behind than its journal is reported as such)
                if reached == seq and named != before:
                    checker.problem(
                        run_id,
                        None,
                        f"{self._path}: the index row of run {run_id!r} names chunk {named}, "
                        f"not the run's last chunk ({before}); restore the journal from a "
                        "backup",
                    )

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
                conn = self._conn
                if conn is not None and self._lag_since is not None:
                    # Best effort: what is not applied now is applied at the next open.
                    with contextlib.suppress(StoreDamaged, sqlite3.Error):
                        await trio.to_thread.run_sync(self._apply_moves, conn)
                conn, self._conn = self._conn, None
                checkpointer, self._checkpointer = self._checkpointer, None
                held, self._held = self._held, None
                self._dropped.detach()
                try:
                    if conn is not None:
                        await trio.to_thread.run_sync(_close, conn, checkpointer)
                finally:
                    if held is not None:
                        held.release()  # after the connection: nothing of ours writes on


def _close(conn: sqlite3.Connection, checkpointer: _Checkpointer | None) -> None:
    # The checkpointer goes first, so the writer's connection is the last one and
    # SQLite checkpoints the whole WAL (and removes it) when it closes.
    if checkpointer is not None:
        checkpointer.close()
    conn.close()


def _dropped(
    conn: sqlite3.Connection,
    checkpointer: _Checkpointer | None,
    path: str,
    held: _WriterLock | None = None,
) -> None:
    """What aclose() would have done, for a store garbage-collected (or left at exit) open."""
    if checkpointer is not None:
        checkpointer.stop()  # not joined: this may run inside the garbage collector
    warnings.warn(
        f"SQLite store {path} was not closed; closing it now (use `async with` or aclose())",
        ResourceWarning,
        stacklevel=2,
    )
    with contextlib.suppress(sqlite3.Error):
        conn.close()
    if held is not None:
        held.release()


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


#: The -shm header (SQLite's wal-index, in the machine's byte order): two copies of a
#: 48-byte header, then the checkpoint's ``nBackfill``; each field's offset.
_SHM_HEADER = 136
_SHM_VERSION = 3007000


def _lost_wal(path: str) -> str | None:
    """What a crash's -wal lost, read before SQLite opens the file (the first connection
    rebuilds the -shm from the -wal, forgetting what the -wal no longer holds); None if
    nothing is known lost.

    The -shm a writer left names the last committed frame of its -wal (``mxFrame``), its
    salt and checksum, and the frames a checkpoint copied into the file (``nBackfill``).
    Frames past those, which the -wal no longer holds as committed (deleted, cut short,
    replaced), are committed transactions that SQLite silently drops.
    """
    shm, wal = f"{path}-shm", f"{path}-wal"
    for _ in range(3):  # a writer changes both meanwhile: read again
        header = _read(shm, 0, _SHM_HEADER)
        if header is None or len(header) < _SHM_HEADER or header[:48] != header[48:96]:
            return None  # no -shm, or one SQLite would rebuild anyway
        order = sys.byteorder
        version = int.from_bytes(header[0:4], order)
        last = int.from_bytes(header[16:20], order)
        backfilled = int.from_bytes(header[96:100], order)
        if version != _SHM_VERSION or header[12] != 1 or last <= backfilled:
            return None  # not initialised, or every committed frame is in the file
        size = int.from_bytes(header[14:16], order)
        page = (size & 0xFE00) + ((size & 1) << 16)
        salt, checksum = header[32:40], header[24:32]
        frame = 32 + (last - 1) * (page + 24)
        try:
            held = os.path.getsize(wal)
        except FileNotFoundError:
            what: str | None = "is missing"
        else:
            whole = max(held - 32, 0) // (page + 24)
            start = _read(wal, 16, 8)
            tail = _read(wal, frame, 24)
            if whole < last:
                what = f"holds {whole} whole frames of {last}"
            elif start != salt or tail is None or len(tail) < 24:
                what = "was replaced (its salt is not the one committed)"
            elif (
                tail[8:16] != salt
                or int.from_bytes(tail[4:8], "big") == 0
                or [int.from_bytes(tail[16:20], "big"), int.from_bytes(tail[20:24], "big")]
                != [int.from_bytes(checksum[0:4], order), int.from_bytes(checksum[4:8], order)]
            ):
                what = f"does not hold frame {last} as committed"
            else:
                what = None
        if _read(shm, 0, _SHM_HEADER) != header:
            continue
        if what is None:
            return None
        return (
            f"{wal} {what}, but {shm} (SQLite's index of it) says it held "
            f"{last - backfilled} committed frames not yet copied into {path}: committed "
            "transactions are lost; restore the journal and its -wal from a backup"
        )
    return None


def _read(path: str, offset: int, size: int) -> bytes | None:
    """``size`` bytes of a file from ``offset`` (fewer at its end); None if it is missing."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read(size)
    except FileNotFoundError:
        return None


def _connect(
    path: str, synchronous: str, readonly: bool, lost: bool = False
) -> tuple[sqlite3.Connection, _Checkpointer | None, int]:
    """Open and prepare the database; also return its schema version (after any upgrade).

    ``lost``: :func:`_lost_wal` found committed transactions lost with the -wal.
    """
    _check_file(path, readonly=readonly)
    try:
        if readonly:
            uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
            if lost and not os.path.exists(f"{path}-wal"):
                # NOTE: a -wal lost whole leaves SQLite nothing to read but the file: read
                # it alone, so that the -shm that says what is lost stays (for the next
                # check) and no empty -wal appears in its place. No writer is live: a
                # writer keeps its -wal.
                uri += "&immutable=1"
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        else:
            conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open the database: {exc}") from exc
    try:
        version = _prepare(conn, path, synchronous, readonly=readonly)
        if readonly:
            return conn, None, version
        try:
            return conn, _Checkpointer(path, synchronous), version
        except sqlite3.Error as exc:
            raise StoreError(f"{path}: cannot open the database: {exc}") from exc
    except Exception:
        conn.close()
        raise


def _prepare(conn: sqlite3.Connection, path: str, synchronous: str, *, readonly: bool) -> int:
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
    if version is not None and version < SCHEMA_VERSION:
        if version not in (1, 2, 3, 4, 5):
            raise StoreError(f"{path}: database schema version {version} is not supported")
        if readonly and version == 1:
            raise StoreError(
                f"{path}: database schema version 1 was written by an older interlock; open it "
                f"once without readonly=True to upgrade it in place to version {SCHEMA_VERSION} "
                "(every event is kept)"
            )
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        if readonly:
            assert version is not None
            return version
        if version is None and not has_tables:
            # Only a database not yet written takes a page size; it is a no-op otherwise.
            conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(
                f"{path}: cannot switch the database to WAL mode (it stays in {mode} mode); "
                "put it on a local file system"
            )
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute(f"PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_BYTES // page_size}")
        if version is None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in (*_SCHEMA, _UNFINISHED_INDEX):
                    conn.execute(statement)
                conn.execute(
                    "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
                conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('runs', '0')")
                conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('running', '0')")
                conn.execute("COMMIT")
            except Exception:
                _rollback(conn)
                raise
        elif version < SCHEMA_VERSION:
            try:
                _upgrade(conn)
            except sqlite3.Error as exc:
                raise StoreError(
                    f"{path}: cannot upgrade the database from schema version {version}: {exc}; "
                    "nothing was changed"
                ) from exc
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot set up the database: {exc}") from exc
    return SCHEMA_VERSION


def _upgrade(conn: sqlite3.Connection) -> None:
    """Upgrade a version 1, 2, 3, 4 or 5 database to this version, in one transaction.

    A failure rolls everything back.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Another process may have upgraded the file between the check and the lock.
        version = _schema_version(conn)
        if version == 1:
            _chunks_from_events(conn)
        if version in (1, 2):
            _checksum_index(conn)
        if version in (1, 2, 3):
            _index_unfinished(conn)
        if version in (1, 2, 3, 4):
            _chain_chunks(conn)
        if version in (1, 2, 3, 4, 5):
            conn.execute(_MOVES)
            conn.execute(
                "UPDATE meta SET value = ? WHERE name = 'schema_version'", (str(SCHEMA_VERSION),)
            )
        conn.execute("COMMIT")
    except Exception:
        _rollback(conn)
        raise


def _chain_chunks(conn: sqlite3.Connection) -> None:
    """Version 4 to 5: chunks get ids, in the order of their runs and seqs, each chained to
    its run's chunk before; each index row names its run's last chunk.

    Every chunk is copied byte for byte, damage included (as is a row of the index).
    """
    conn.execute("ALTER TABLE chunks RENAME TO chunks_v4")
    conn.execute(_CHUNKS)
    conn.execute(
        "INSERT INTO chunks (id, run_id, first_seq, last_seq, prev, body) "
        "SELECT n, run_id, first_seq, last_seq, "
        "CASE WHEN lag(run_id) OVER w IS run_id THEN n - 1 END, body FROM ("
        "SELECT row_number() OVER (ORDER BY run_id, first_seq) AS n, * FROM chunks_v4) "
        "WINDOW w AS (ORDER BY n) ORDER BY n"
    )
    conn.execute("DROP TABLE chunks_v4")
    conn.execute(_FIRST_CHUNKS)
    conn.execute("ALTER TABLE runs ADD COLUMN chunk INTEGER")
    conn.execute(
        "UPDATE runs SET chunk = last.id FROM (SELECT run_id, max(id) AS id FROM chunks "
        "GROUP BY run_id) AS last WHERE runs.run_id = last.run_id"
    )


def _index_unfinished(conn: sqlite3.Connection) -> None:
    """Version 3 to 4: the index of unfinished runs, and their number in ``meta``."""
    conn.execute(_UNFINISHED_INDEX)
    conn.execute(
        "INSERT OR REPLACE INTO meta (name, value) "
        "SELECT 'running', count(*) FROM runs WHERE outcome = 'running'"
    )


def _checksum_index(conn: sqlite3.Connection) -> None:
    """Version 2 to 3: give every runs-index row its checksum, count the rows, and drop
    the indexes on them.

    A row damaged before this gets a checksum of its damage: :meth:`SQLiteStore.check`
    still finds it, by comparing the row with its run's journal.
    """
    conn.execute("ALTER TABLE runs ADD COLUMN crc INTEGER")
    checksums = []
    for row in conn.execute(f"SELECT {_READ_COLUMNS} FROM runs").fetchall():
        with contextlib.suppress(IndexDamaged, TypeError, ValueError):  # NULL: damaged
            fields = _fields(row)
            checksums.append((row_checksum(*fields), fields[0]))
    conn.executemany("UPDATE runs SET crc = ? WHERE run_id = ?", checksums)
    conn.execute("INSERT INTO meta (name, value) SELECT 'runs', count(*) FROM runs")
    for index in ("runs_started", "runs_outcome", "runs_machine"):
        conn.execute(f"DROP INDEX IF EXISTS {index}")


def _chunks_from_events(conn: sqlite3.Connection) -> None:
    """Version 1 to 2: a row per event becomes chunks (a row per run and batch).

    Every event's frame is copied byte for byte; nothing is decoded, so the upgraded
    journal reads back as the old one did, damage included: a chunk ends after a frame
    that fails its check, so the damage is still reported at its own seq. (A gap in a
    run's seqs, which no interlock writes, ends a chunk too and now reads as missing
    events.)
    """
    for statement in (*_JOURNAL_V4, _INTENTS):
        conn.execute(statement)
    conn.execute(
        "INSERT INTO intents (key, run_id, seq) SELECT key, run_id, seq FROM events "
        "WHERE kind = 'intent_recorded' AND key IS NOT NULL"
    )
    chunk: list[Any] | None = None  # [run_id, first seq, last seq, frames, size]

    def flush() -> None:
        if chunk is not None:
            conn.execute(_INSERT_CHUNK_V4, (chunk[0], chunk[1], chunk[2], b"".join(chunk[3])))

    rows = conn.execute("SELECT run_id, seq, body FROM events ORDER BY run_id, seq")
    for run_id, seq, body in rows:
        if (
            chunk is None
            or chunk[0] != run_id
            or seq != chunk[2] + 1
            or chunk[4] >= _MIGRATION_CHUNK_BYTES
        ):
            flush()
            chunk = [run_id, seq, seq, [body], len(body)]
        else:
            chunk[2] = seq
            chunk[3].append(body)
            chunk[4] += len(body)
        payloads, _end, status = unframe(body)
        if status != FRAMES_OK or len(payloads) != 1:
            # A damaged frame ends its chunk, so nothing after it hides behind it.
            flush()
            chunk = None
    flush()
    conn.execute("DROP TABLE events")


async def open_sqlite_store(
    path: str | os.PathLike[str],
    *,
    synchronous: str = "NORMAL",
    readonly: bool = False,
    wait: float = 0.0,
) -> SQLiteStore:
    """Open (and create, if missing) the SQLite journal at ``path``.

    One process writes a journal: opening it for writing takes an exclusive lock on
    ``<path>.lock`` (see :func:`hold_journal`) before anything is read or written, and
    the store holds it until it closes; the kernel drops it if the process dies.
    Stores of one process share the hold. Read-only stores take no lock: they read
    while another process writes.

    Args:
      path: the database file. A missing file is created with the schema; its
        directory must exist.
      synchronous: ``NORMAL`` (survives a process crash; a power loss can drop
        the last batches) or ``FULL`` (survives a power loss; an fsync per batch).
      readonly: open an existing database for reading only. Nothing is created,
        and :meth:`SQLiteStore.append` raises.
      wait: seconds to wait for another process that holds the journal; 0 (the
        default) fails at once, ``math.inf`` waits as long as it takes.

    Raises:
      JournalHeld: another process holds the journal for writing (after ``wait``
        seconds); the message names it (pid, command, since when).
      StoreError: ``path`` is a directory, its directory is missing, the file is
        not an interlock database, its schema is newer than this interlock, or
        (with ``readonly``) it does not exist.
      ValueError: ``synchronous`` is neither ``NORMAL`` nor ``FULL``, or ``wait`` is negative.
    """
    path = os.fspath(path)
    level = synchronous.upper()
    if level not in _SYNCHRONOUS:
        raise ValueError(f"synchronous must be 'NORMAL' or 'FULL'; got {synchronous!r}")
    held = None
    if not readonly:
        await trio.to_thread.run_sync(lambda: _check_file(path, readonly=False))
        held = await _take_lock(path, wait)
    try:
        # NOTE: before SQLite opens the file: the first connection forgets what is lost.
        lost = await trio.to_thread.run_sync(_lost_wal, path)
        conn, checkpointer, version = await trio.to_thread.run_sync(
            _connect, path, level, readonly, lost is not None
        )
    except BaseException:
        if held is not None:
            held.release()
        raise
    return SQLiteStore(
        conn,
        path,
        synchronous=level,
        readonly=readonly,
        checkpointer=checkpointer,
        checksums=version >= 3,
        held=held,
        version=version,
        lost=lost,
    )
