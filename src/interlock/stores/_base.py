"""The store interface every journal backend implements (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import msgspec

from .._events import (
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
from .._exceptions import JournalCorrupt, StoreError
from .._hotpath import FRAMES_OK, FRAMES_TORN, frame_event, unframe

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence
    from types import TracebackType

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


def decode_body(run_id: str, seq: int, body: bytes) -> JournalEvent:
    """Check a stored frame and decode its event.

    Raises:
      JournalCorrupt: the frame is torn or its checksum does not match, or the payload
        is not an event.
    """
    payloads, _end, status = unframe(body)
    if status != FRAMES_OK or len(payloads) != 1:
        what = "torn (cut short)" if status == FRAMES_TORN else "corrupt (checksum mismatch)"
        raise JournalCorrupt(
            f"journal of run {run_id!r} is {what} at seq {seq}; the store was written outside "
            "interlock or a write was cut short; restore it from a backup"
        )
    return decode_payload(run_id, seq, payloads[0])


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

    Args:
      events: one batch, in order.
      last_seqs: for each run of the batch that is already stored, the seq of its
        last stored event.

    Raises:
      StoreError: a run's seqs do not increase past the last stored one and along
        the batch, or two intents of the batch share an idempotency key.
    """
    last = dict(last_seqs)
    keys: set[str] = set()
    for event in events:
        previous = last.get(event.run_id)
        if previous is not None and event.seq <= previous:
            raise StoreError(
                f"run {event.run_id!r} already has seq {previous}; cannot append seq {event.seq}"
            )
        last[event.run_id] = event.seq
        if isinstance(event, IntentRecorded):
            if event.key in keys:
                raise StoreError(
                    f"idempotency key {event.key!r} was already recorded; nothing was written"
                )
            keys.add(event.key)


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


def runs_query(
    columns: str,
    placeholder: str,
    *,
    machine: str | None,
    state: str | None,
    outcome: str | None,
    limit: int | None,
) -> tuple[str, list[object]]:
    """The SQL and parameters of :meth:`Store.list_runs` for a store whose driver uses
    ``placeholder`` (``?`` for sqlite3, ``%s`` for psycopg)."""
    clauses: list[str] = []
    params: list[object] = []
    for column, value in (("machine", machine), ("state", state), ("outcome", outcome)):
        if value is not None:
            clauses.append(f"{column} = {placeholder}")
            params.append(value)
    sql = f"SELECT {columns} FROM runs"
    if clauses:
        sql += " WHERE " + " AND ".join(clauses)
    sql += " ORDER BY started, run_id"
    if limit is not None:
        sql += f" LIMIT {placeholder}"
        params.append(limit)
    return sql, params


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

    @abc.abstractmethod
    async def load(self, run_id: str) -> list[JournalEvent]:
        """Return every event of ``run_id`` in seq order.

        Raises:
          RunNotFound: no such run.
          JournalCorrupt: a stored event fails its checksum.
        """

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunRecord:
        """Return the runs-index row of ``run_id``.

        Raises:
          RunNotFound: no such run.
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
        """Return runs-index rows matching every filter given, oldest first."""

    async def escalations(self) -> list[RunRecord]:
        """The escalation queue: runs parked in ESCALATE, oldest first."""
        return await self.list_runs(outcome=ESCALATED)

    async def unfinished(self) -> list[RunRecord]:
        """Runs that are neither terminal nor escalated, oldest first."""
        return await self.list_runs(outcome=RUNNING)

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
