"""The store interface every journal backend implements (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import msgspec

from .._events import (
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
    encode_event,
)
from .._exceptions import JournalCorrupt, StoreError
from .._hotpath import FRAMES_OK, FRAMES_TORN, frame_event, unframe

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from types import TracebackType

#: Run outcomes, as the runs index and metrics name them.
RUNNING = "running"
COMPLETED = "completed"
ESCALATED = "escalated"
FAILED = "failed"
OUTCOMES = (RUNNING, COMPLETED, ESCALATED, FAILED)


class RunRecord(msgspec.Struct, frozen=True, kw_only=True):
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


class _Row(msgspec.Struct, frozen=True):
    run_id: str
    seq: int
    kind: str
    ts: float
    key: str | None
    body: bytes


def encode_rows(events: Iterable[Event]) -> list[_Row]:
    """Encode and frame events into rows: (run_id, seq, kind, ts, key, framed msgpack)."""
    rows = []
    for event in events:
        key = event.key if isinstance(event, IntentRecorded | ToolCommitted | ToolFailed) else None
        tag = type(event).__struct_config__.tag
        assert isinstance(tag, str)
        rows.append(
            _Row(event.run_id, event.seq, tag, event.ts, key, frame_event(encode_event(event)))
        )
    return rows


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
    try:
        event = decode_event(payloads[0])
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


def index_updates(events: Sequence[Event], current: dict[str, RunRecord]) -> dict[str, RunRecord]:
    """Return the runs-index rows that ``events`` change.

    Args:
      events: one appended batch, in order.
      current: the existing rows of the runs these events touch that do not start in
        this batch (a store looks them up before calling).
    """
    updated: dict[str, RunRecord] = {}
    for event in events:
        record = updated.get(event.run_id) or current.get(event.run_id)
        if isinstance(event, RunStarted):
            record = RunRecord(
                run_id=event.run_id,
                machine=event.machine,
                state=event.state,
                outcome=RUNNING,
                seq=event.seq,
                started=event.ts,
                updated=event.ts,
            )
        elif record is None:
            raise JournalCorrupt(
                f"event {type(event).__name__} seq {event.seq} of run {event.run_id!r} arrived "
                "before the run's run_started event"
            )
        else:
            changes: dict[str, object] = {"seq": event.seq, "updated": event.ts}
            match event:
                case Transitioned(dst=dst):
                    changes["state"] = dst
                case Completed():
                    changes["outcome"] = COMPLETED
                case Escalated(reason=reason, detail=detail):
                    changes.update(outcome=ESCALATED, reason=reason, detail=detail)
                case Failed(reason=reason):
                    changes.update(outcome=FAILED, reason=reason, detail="")
                case Resumed():
                    changes.update(outcome=RUNNING, reason="", detail="")
                case _:
                    pass
            record = msgspec.structs.replace(record, **changes)
        updated[event.run_id] = record
    return updated


class Store(abc.ABC):
    """Where the journal and the runs index live. One writer: the supervisor.

    Every method is async and trio-friendly. ``append`` is the group commit: one
    call per supervisor batch, durable (as the store's settings define) when it
    returns, and all-or-nothing.
    """

    #: A short name for messages and metrics: memory, sqlite, postgresql.
    kind: str = "abstract"

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
