"""Journal events: tagged msgspec Structs. This module *is* the on-disk format.

Tags are written out as strings so that renaming a class never changes stored
bytes; ``tests/data/events.msgpack`` pins the encoding. Events are past tense.
Every event carries the run id, a per-run sequence number starting at 1 and the
recorded wall-clock time in seconds since the epoch. Events are never mutated.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec


class Violation(msgspec.Struct, frozen=True, gc=False):
    """Why a proposal was rejected, in terms the model can act on.

    NOTE: ``gc=False`` is safe: every field is a string.
    """

    code: str
    """One of: malformed, unknown_tool, tool_not_allowed, illegal_transition, schema,
    guard, repeat, budget, circuit_open."""
    path: str
    """Where in the proposal the problem is (``args.amount``, ``tool``, ``$``)."""
    message: str
    """What is wrong, naming the value and the rule."""
    hint: str
    """What to propose instead."""


class TokenUsage(msgspec.Struct, frozen=True, gc=False):
    """Tokens one model call used. NOTE: ``gc=False``: scalar fields only."""

    prompt: int = 0
    completion: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every journal event. Never written on its own."""

    run_id: str
    seq: int
    ts: float


class RunStarted(Event, frozen=True, tag="run_started"):
    """A run was created."""

    machine: str
    state: str
    inputs: dict[str, Any] = {}


class ModelCalled(Event, frozen=True, tag="model_called"):
    """The provider was asked for a proposal in a worker state, and answered."""

    state: str
    model: str
    prompt_hash: str
    prompt: str
    raw: str
    usage: TokenUsage
    latency: float = 0.0
    """Seconds the provider took."""
    error: str = ""
    """Set when the provider failed to answer (``raw`` is then empty)."""


class StepProposed(Event, frozen=True, tag="step_proposed"):
    """A deterministic step (or an operator) produced a proposal; no model was called."""

    state: str
    raw: str
    source: str = "step"
    """``step`` for a step state's function, ``operator`` for a resume with a payload."""
    error: str = ""
    """Set when the step function raised (``raw`` is then empty)."""


class ProposalRejected(Event, frozen=True, tag="proposal_rejected"):
    """The gate rejected a proposal. The run stays in ``state``."""

    state: str
    violations: tuple[Violation, ...]


class Transitioned(Event, frozen=True, tag="transitioned"):
    """The run moved from one state to another."""

    src: str
    dst: str
    delta: dict[str, Any] = {}
    """Changes to the run's data carried by the transition."""
    reason: str = "proposal"
    """``proposal``, ``step``, ``breaker``, ``fallback`` or ``operator``."""


class IntentRecorded(Event, frozen=True, tag="intent_recorded"):
    """A verified tool call is about to run; durable before it does."""

    state: str
    tool: str
    args: dict[str, Any]
    key: str
    """The idempotency key, ``run_id:state:seq`` of this event."""


class ToolCommitted(Event, frozen=True, tag="tool_committed"):
    """The tool call with ``key`` ran and returned ``result``."""

    tool: str
    key: str
    result: Any
    attempts: int = 1
    latency: float = 0.0
    reused: bool = False
    """True when the result was taken from an earlier commit of the same key."""


class ToolFailed(Event, frozen=True, tag="tool_failed"):
    """The tool call with ``key`` raised, timed out, or exhausted its retries."""

    tool: str
    key: str
    error: str
    retryable: bool = False
    attempts: int = 1
    latency: float = 0.0


class BreakerTripped(Event, frozen=True, tag="breaker_tripped"):
    """A breaker stopped the run. ``value`` reached ``limit``."""

    breaker: str
    """consecutive_failures, repeat, token_budget, step_budget, deadline or circuit."""
    state: str
    value: float
    limit: float
    detail: str
    tool: str = ""


class Escalated(Event, frozen=True, tag="escalated"):
    """The run was parked in the escalation queue for a human."""

    state: str
    reason: str
    detail: str


class Resumed(Event, frozen=True, tag="resumed"):
    """An operator resumed an escalated run."""

    by: str
    note: str = ""
    to: str = ""
    payload: str = ""


class Completed(Event, frozen=True, tag="completed"):
    """The run reached a success terminal state."""

    state: str
    output: Any = None


class Failed(Event, frozen=True, tag="failed"):
    """The run reached FAILED (an operator abort, a step that gave up, an unusable tool)."""

    state: str
    reason: str


JournalEvent: TypeAlias = (
    RunStarted
    | ModelCalled
    | StepProposed
    | ProposalRejected
    | Transitioned
    | IntentRecorded
    | ToolCommitted
    | ToolFailed
    | BreakerTripped
    | Escalated
    | Resumed
    | Completed
    | Failed
)

EVENT_TYPES: tuple[type[Event], ...] = (
    RunStarted,
    ModelCalled,
    StepProposed,
    ProposalRejected,
    Transitioned,
    IntentRecorded,
    ToolCommitted,
    ToolFailed,
    BreakerTripped,
    Escalated,
    Resumed,
    Completed,
    Failed,
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(JournalEvent)
_json_encoder = msgspec.json.Encoder()


def encode_event(event: Event) -> bytes:
    """Return the msgpack bytes of ``event`` (the journal's payload format)."""
    return _encoder.encode(event)


def decode_event(data: bytes) -> JournalEvent:
    """Decode one event from its msgpack bytes.

    Raises:
      msgspec.DecodeError: if the bytes are not a valid event.
    """
    return _decoder.decode(data)


def event_to_builtins(event: Event) -> dict[str, Any]:
    """Return ``event`` as a JSON-ready dict, with its ``kind`` tag."""
    result: dict[str, Any] = msgspec.to_builtins(event)
    return result


def event_to_json(event: Event) -> bytes:
    return _json_encoder.encode(event)
