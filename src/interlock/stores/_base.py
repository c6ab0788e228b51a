"""The store interface every journal backend implements (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import abc
import zlib
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._events import (
    ENCODING_ERRORS,
    EVENT_TYPES,
    Completed,
    Escalated,
    Event,
    Failed,
    IntentRecorded,
    JournalEvent,
    Resumed,
    RunStarted,
    ToolCommitted,
    ToolFailed,
    Transitioned,
    decode_event,
)
from ..core._exceptions import IndexDamaged, JournalCorrupt, StoreError
from ..core._hotpath import FRAMES_OK, FRAMES_TORN, frame_event, unframe

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence
    from types import TracebackType

    from ._check import CheckReport

#: Run outcomes, as the runs index and metrics name them.
RUNNING = "running"
COMPLETED = "completed"
ESCALATED = "escalated"
FAILED = "failed"
OUTCOMES = (RUNNING, COMPLETED, ESCALATED, FAILED)


class RunRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One row of the runs index: where a run is, without folding its journal."""

    run_id: str
    machine: str
    state: str
    outcome: str
    """running, completed, escalated or failed."""
    seq: int
    """The seq of the run's last event."""
    started: float
    updated: float
    reason: str = ""
    """For an escalated run, why (the breaker or the cause); for a failed run, the reason."""
    detail: str = ""


_encode_index_row = msgspec.msgpack.Encoder().encode


def row_checksum(
    run_id: str,
    machine: str,
    state: str,
    outcome: str,
    seq: int,
    started: float,
    updated: float,
    reason: str,
    detail: str,
) -> int:
    """The crc32 a runs-index row is stored with: of its fields, msgpack-encoded in order.

    The types count (a seq read back as a float does not match), except that the two
    times are taken as floats, as the stores keep them.
    """
    fields = (run_id, machine, state, outcome, seq, float(started), float(updated), reason, detail)
    return zlib.crc32(_encode_index_row(fields))


def record_checksum(record: RunRecord) -> int:
    """:func:`row_checksum` of a record."""
    return row_checksum(*msgspec.structs.astuple(record))


def verified_record(row: Sequence[Any]) -> RunRecord:
    """The record of a stored index row ``(run_id, ..., detail, crc)`` that passes its checksum.

    Raises:
      IndexDamaged: the row's checksum does not match its fields (or a field has a
        type no interlock writes).
    """
    try:
        intact = row_checksum(*row[:9]) == row[9]
    except (TypeError, ValueError, msgspec.EncodeError):
        intact = False
    if not intact:
        raise IndexDamaged(str(row[0]), "checksum mismatch")
    return stored_record(row)


def stored_record(row: Sequence[Any]) -> RunRecord:
    """The record of a stored index row ``(run_id, ..., detail)``, as it is: unchecked."""
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


def looked_up(run_id: str, record: RunRecord) -> RunRecord:
    """``record``, found by looking ``run_id`` up, if it is that run's.

    Raises:
      IndexDamaged: it is another run's row (a damaged b-tree page can lead a lookup to
        another, intact, row).
    """
    if record.run_id != run_id:
        raise IndexDamaged(run_id, f"looking it up finds the row of run {record.run_id!r}")
    return record


def missing_index_row(run_id: str) -> IndexDamaged:
    """The error for a run whose journal holds events but whose index row is missing."""
    return IndexDamaged(run_id, "the row is missing, but the run's journal holds events")


def missing_journal(run_id: str, seq: int) -> JournalCorrupt:
    """The error for a run the runs index holds (at ``seq``) whose journal is missing."""
    return JournalCorrupt(
        f"journal of run {run_id!r} is missing, but the runs index says the run reached seq "
        f"{seq}; restore it from a backup"
    )


def select_runs(
    records: Iterable[RunRecord],
    *,
    machine: str | None,
    state: str | None,
    outcome: str | None,
    limit: int | None,
) -> list[RunRecord]:
    """What :meth:`Store.list_runs` returns from every row of the index.

    The filters run here, on verified rows, rather than in SQL: a row whose damaged
    outcome no longer matches would otherwise be left out silently.
    """
    rows = [
        r
        for r in records
        if (machine is None or r.machine == machine)
        and (state is None or r.state == state)
        and (outcome is None or r.outcome == outcome)
    ]
    rows.sort(key=lambda r: (r.started, r.run_id))
    return rows if limit is None else rows[:limit]


Row = tuple[str, int, str, float, str | None, bytes]
"""One stored event: ``(run_id, seq, kind, ts, key, framed msgpack body)``."""

_KEYED: frozenset[type[Event]] = frozenset({IntentRecorded, ToolCommitted, ToolFailed})
_TAGS: dict[type[Event], str] = {cls: str(cls.__struct_config__.tag) for cls in EVENT_TYPES}
_encode = msgspec.msgpack.Encoder().encode


def unencodable(events: Iterable[Event], exc: BaseException) -> StoreError:
    """The error for a batch holding an event msgpack cannot encode (nothing is written).

    The supervisor refuses such values where they enter (proposals, tool results,
    inputs); this is the store's own guard, so that one bad event fails its batch with
    a :class:`StoreError` instead of an exception no caller expects.
    """
    for event in events:
        try:
            _encode(event)
        except Exception as error:  # any encoding failure: name the event
            return StoreError(
                f"{_TAGS.get(type(event), type(event).__name__)} seq {event.seq} of run "
                f"{event.run_id!r} cannot be encoded ({error}); nothing was written"
            )
    return StoreError(f"the batch cannot be encoded ({exc}); nothing was written")


def encode_rows(events: Iterable[Event]) -> list[Row]:
    """Encode and frame events into rows: ``(run_id, seq, kind, ts, key, framed msgpack)``.

    Raises:
      StoreError: an event holds a value msgpack cannot encode.
    """
    try:
        return _encode_rows(events)
    except ENCODING_ERRORS as exc:
        raise unencodable(events, exc) from exc


def _encode_rows(events: Iterable[Event]) -> list[Row]:
    keyed = _KEYED
    tags = _TAGS
    encode = _encode
    frame = frame_event
    return [
        (
            event.run_id,
            event.seq,
            tags[type(event)],
            event.ts,
            event.key if type(event) in keyed else None,  # type: ignore[attr-defined]
            frame(encode(event)),
        )
        for event in events
    ]


Damage = tuple[int, str]
"""Damage found in a journal: ``(seq, message)``, the message a :class:`JournalCorrupt` carries."""

_RESTORE = (
    "the store was written outside interlock or a write was cut short; restore it from a backup"
)


def read_chunk(
    run_id: str, first_seq: int, last_seq: int, body: bytes
) -> tuple[list[JournalEvent], Damage | None]:
    """Check a stored chunk's frames (seqs first_seq..last_seq) and decode its events.

    A store that keeps a row per event reads each as a chunk of one.

    Returns:
      the events up to the first damage, and that damage (None if there is none).
    """
    payloads, _end, status = unframe(body)
    count = last_seq - first_seq + 1
    if status == FRAMES_OK and len(payloads) < count:
        # Cut short exactly at a frame boundary: the frames left are all good.
        status = FRAMES_TORN
    events: list[JournalEvent] = []
    seq = first_seq
    for payload in payloads[:count]:
        try:
            events.append(decode_payload(run_id, seq, payload))
        except JournalCorrupt as exc:
            return events, (seq, str(exc))
        seq += 1
    if len(payloads) > count:
        return events, (
            last_seq,
            f"journal of run {run_id!r} holds more events than seqs {first_seq} to {last_seq} "
            "in one chunk; the store was written outside interlock; restore it from a backup",
        )
    if status != FRAMES_OK:
        what = "torn (cut short)" if status == FRAMES_TORN else "corrupt (checksum mismatch)"
        return events, (seq, f"journal of run {run_id!r} is {what} at seq {seq}; {_RESTORE}")
    return events, None


def read_chunks(
    run_id: str, rows: Iterable[tuple[int, int, bytes]], after: int = 0
) -> tuple[list[JournalEvent], list[Damage]]:
    """Check a run's chunks, in first_seq order: each one's frames, and that they start at
    seq 1 and follow one another.

    With ``after``, the rows are those holding the events after seq ``after`` (the first
    may start earlier, and must start no later than ``after + 1``), and only those events
    are returned.

    Returns:
      the events (all of them only if there is no damage), and every damage found:
      each chunk is checked on its own, so one damaged chunk does not hide another.
    """
    events: list[JournalEvent] = []
    damages: list[Damage] = []
    expected = 1
    first = True
    for first_seq, last_seq, body in rows:
        if first and after:  # a tail read: the chunk holding seq after + 1 comes first
            expected = first_seq if first_seq <= after + 1 else after + 1
        first = False
        if first_seq != expected:
            damages.append(
                (
                    min(first_seq, expected),
                    f"journal of run {run_id!r} starts at seq {first_seq}, not seq 1; "
                    "restore it from a backup"
                    if expected == 1
                    else f"journal of run {run_id!r} is missing or repeating events: seq "
                    f"{first_seq} follows seq {expected - 1}; restore it from a backup",
                )
            )
        chunk, damage = read_chunk(run_id, first_seq, last_seq, body)
        if damage is not None:
            damages.append(damage)
        if not damages:
            events += chunk if first_seq > after else [e for e in chunk if e.seq > after]
        expected = last_seq + 1
    return events, damages


def decode_chunks(
    run_id: str, rows: Iterable[tuple[int, int, bytes]], indexed_seq: int
) -> list[JournalEvent]:
    """Decode a run's chunks (see :func:`read_chunks`), raising on the first damage.

    Args:
      indexed_seq: the seq of the run's last event by its runs-index row, read before
        the journal (so the journal, which only grows, can only be longer).

    Raises:
      JournalCorrupt: a frame is torn or fails its checksum, events are missing or
        repeated, or the journal ends before the seq the runs index gives.
    """
    events, damages = read_chunks(run_id, rows)
    if damages:
        raise JournalCorrupt(damages[0][1])
    last = events[-1].seq if events else 0
    if last < indexed_seq:
        raise cut_short(run_id, last, indexed_seq)
    return events


def decode_chunks_after(
    run_id: str, rows: Iterable[tuple[int, int, bytes]], indexed_seq: int, after: int
) -> list[JournalEvent]:
    """:func:`decode_chunks` of the rows holding a run's events after seq ``after``."""
    events, damages = read_chunks(run_id, rows, after)
    if damages:
        raise JournalCorrupt(damages[0][1])
    last = events[-1].seq if events else after
    if last < indexed_seq:
        raise cut_short(run_id, last, indexed_seq)
    return events


def cut_short(run_id: str, last: int, indexed_seq: int) -> JournalCorrupt:
    """The error for a journal that ends at ``last``, before its index row's ``indexed_seq``."""
    return JournalCorrupt(
        f"journal of run {run_id!r} ends at seq {last}, but the runs index says the run "
        f"reached seq {indexed_seq}: events are missing; restore it from a backup"
    )


def decode_payload(run_id: str, seq: int, payload: bytes) -> JournalEvent:
    """Decode one unframed event and check it is ``seq`` of ``run_id``.

    Raises:
      JournalCorrupt: the payload is not an event, or another run's or seq's event.
    """
    try:
        event = decode_event(payload)
    except msgspec.DecodeError as exc:
        raise JournalCorrupt(
            f"journal of run {run_id!r} holds an undecodable event at seq {seq}: {exc}"
        ) from exc
    if event.run_id != run_id or event.seq != seq:
        raise JournalCorrupt(
            f"journal of run {run_id!r} holds an event of run {event.run_id!r} seq {event.seq} "
            f"where seq {seq} belongs"
        )
    return event


def check_batch(events: Sequence[Event], last_seqs: Mapping[str, int]) -> None:
    """Check a batch's seqs and intent keys before anything of it is written.

    Each run's events must follow one another by one, from the last stored seq (or from
    a ``run_started`` at seq 1 for a run the store does not hold yet).

    Args:
      events: one batch, in order.
      last_seqs: for each run of the batch that is already stored, the seq of its
        last stored event.

    Raises:
      StoreError: a seq repeats one or leaves a gap, another process advanced a run
        past the batch, a run does not start with ``run_started`` at seq 1, or two
        intents of the batch share an idempotency key.
    """
    last = dict(last_seqs)
    keys: set[str] = set()
    for event in events:
        run_id = event.run_id
        seq = event.seq
        previous = last.get(run_id)
        if previous is None:
            if seq != 1 or type(event) is not RunStarted:
                raise StoreError(
                    f"run {run_id!r} is not stored yet, so its first event must be run_started "
                    f"seq 1, not {_TAGS.get(type(event), type(event).__name__)} seq {seq}; "
                    "nothing was written"
                )
        elif seq != previous + 1 or type(event) is RunStarted:
            raise _out_of_sequence(event, previous, stored=last_seqs.get(run_id) == previous)
        last[run_id] = seq
        if isinstance(event, IntentRecorded):
            if event.key in keys:
                raise StoreError(
                    f"idempotency key {event.key!r} was already recorded; nothing was written"
                )
            keys.add(event.key)


def _out_of_sequence(event: Event, previous: int, *, stored: bool) -> StoreError:
    """The error for ``event`` when its run is at ``previous`` (``stored``, or in the batch)."""
    run_id = event.run_id
    if type(event) is RunStarted:
        return StoreError(
            f"run {run_id!r} already exists (at seq {previous}); run ids name one run each: "
            "start it under another id; nothing was written"
        )
    if stored and event.seq <= previous:
        return another_writer(run_id, previous, event.seq)
    if event.seq <= previous:
        return StoreError(
            f"run {run_id!r} already has seq {previous}; cannot append seq {event.seq}"
        )
    return StoreError(
        f"run {run_id!r} is at seq {previous}; cannot append seq {event.seq} "
        "(seqs must follow one another without gaps)"
    )


def another_writer(run_id: str, stored: int, appended: int) -> StoreError:
    """The error for a batch appending ``appended`` to a run stored up to ``stored``."""
    return StoreError(
        f"run {run_id!r} is already at seq {stored} in the store, so this batch cannot append "
        f"seq {appended}: another process advanced the run; keep one writer per SQLite "
        "journal, and on PostgreSQL drive runs through leases (a supervisor, `interlock "
        "worker` or `interlock resume` takes them); nothing was written"
    )


#: What an event changes in its run's index row beyond ``seq`` and ``updated``, by event
#: type; the types not here change nothing else. Every store's index follows this one map.
INDEX_CHANGES: dict[type[Event], Callable[[Any], dict[str, str]]] = {
    Transitioned: lambda event: {"state": event.dst},
    Completed: lambda event: {"outcome": COMPLETED},
    Escalated: lambda event: {"outcome": ESCALATED, "reason": event.reason, "detail": event.detail},
    Failed: lambda event: {"outcome": FAILED, "reason": event.reason, "detail": ""},
    Resumed: lambda event: {"outcome": RUNNING, "reason": "", "detail": ""},
}


def index_updates(events: Sequence[Event], current: dict[str, RunRecord]) -> dict[str, RunRecord]:
    """Return the runs-index rows that ``events`` change.

    Args:
      events: one appended batch, in order.
      current: the existing rows of the runs these events touch that do not start in
        this batch (a store looks them up before calling).
    """
    # Changes accumulate in one dict per run; each record is built once at the end.
    fields: dict[str, dict[str, Any]] = {}
    for event in events:
        run_id = event.run_id
        kind = type(event)
        row = fields.get(run_id)
        if kind is RunStarted:
            assert isinstance(event, RunStarted)
            fields[run_id] = {
                "run_id": run_id,
                "machine": event.machine,
                "state": event.state,
                "outcome": RUNNING,
                "seq": event.seq,
                "started": event.ts,
                "updated": event.ts,
                "reason": "",
                "detail": "",
            }
            continue
        if row is None:
            record = current.get(run_id)
            if record is None:
                raise JournalCorrupt(
                    f"event {kind.__name__} seq {event.seq} of run {run_id!r} arrived "
                    "before the run's run_started event"
                )
            row = fields[run_id] = msgspec.structs.asdict(record)
        row["seq"] = event.seq
        row["updated"] = event.ts
        change = INDEX_CHANGES.get(kind)
        if change is not None:
            row.update(change(event))
    return {run_id: RunRecord(**row) for run_id, row in fields.items()}


class Store(abc.ABC):
    """Where the journal and the runs index live. One writer: the supervisor.

    Every method is async and trio-friendly. ``append`` is the group commit: one
    call per supervisor batch, durable (as the store's settings define) when it
    returns, and all-or-nothing.
    """

    #: A short name for messages and metrics: memory, sqlite, postgresql.
    kind: str = "abstract"
    #: Framed event bytes this store object has appended (for the journal metrics).
    bytes_written: int = 0

    @abc.abstractmethod
    async def append(self, events: Sequence[Event]) -> None:
        """Append one batch of events (any runs, each run's in seq order), atomically.

        Raises:
          StoreError: the batch could not be written; nothing of it was.
        """

    async def probe_write(self) -> None:
        """Make a write that needs room (a page of the journal) and leaves nothing behind,
        to learn whether the journal can be written now (after a failed append: has the
        full disk got room again?). The default writes nothing: a store that cannot tell.

        Raises:
          StoreError: the write could not be made (a full disk, the database gone).
        """
        await trio.lowlevel.checkpoint()

    @abc.abstractmethod
    async def load(self, run_id: str) -> list[JournalEvent]:
        """Return every event of ``run_id`` in seq order.

        Raises:
          RunNotFound: no such run.
          JournalCorrupt: a stored event fails its checksum, events are missing or
            repeated, or the journal ends before the seq its runs-index row gives.
          IndexDamaged: the run's index row is damaged or missing.
        """

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunRecord:
        """Return the runs-index row of ``run_id``.

        Raises:
          RunNotFound: no such run.
          IndexDamaged: the row fails its checksum, or it is missing while the run's
            journal holds events.
        """

    @abc.abstractmethod
    async def list_runs(
        self,
        *,
        machine: str | None = None,
        state: str | None = None,
        outcome: str | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        """Return runs-index rows matching every filter given, oldest first.

        Every row is read and checked, whatever the filters, so a damaged row is
        reported rather than silently left out.

        Raises:
          IndexDamaged: a row fails its checksum.
        """

    async def escalations(self) -> list[RunRecord]:
        """The escalation queue: runs parked in ESCALATE, oldest first."""
        return await self.list_runs(outcome=ESCALATED)

    async def count_runs(self, *, outcome: str) -> int:
        """How many runs have ``outcome``: a figure for a gauge, not a listing (a backend
        may count in its database, without reading or checking each row)."""
        return len(await self.list_runs(outcome=outcome))

    async def unfinished(self) -> list[RunRecord]:
        """Runs that are neither terminal nor escalated, oldest first."""
        return await self.list_runs(outcome=RUNNING)

    @abc.abstractmethod
    async def check(self) -> CheckReport:
        """Check the whole store for damage, reading everything in it; write nothing.

        Every frame's checksum, each run's seqs (from 1, no gap, no repeat), every
        runs-index row against its checksum and against its run's journal, and what
        else the backend keeps (SQLite: ``PRAGMA integrity_check`` and the intents table).

        Returns:
          what was checked and every problem found; damage is reported, not raised.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the store's connections. Idempotent."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
