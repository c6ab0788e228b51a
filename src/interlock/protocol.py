"""The gateway's wire protocol: every request and response body of its HTTP API and its
streaming channel, as msgspec Structs (public: the gateway and the clients share it).

The HTTP app, the streaming channel and the clients all use these Structs, and the
OpenAPI document is generated from them, so there is one definition of the wire format.
JSON is the default encoding; msgpack carries the same fields (content negotiation).

Request bodies forbid unknown fields: a misspelt field is a 422 problem that names it,
never silently ignored.
"""

from __future__ import annotations

import struct
import types as _types
from typing import Annotated, Any, Final, Literal

import msgspec

from .core import _exceptions as _errors

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DEFAULT_MAX_IN_FLIGHT",
    "HEADER",
    "MAX_BATCH",
    "MAX_PROPOSAL",
    "OPS",
    "PROBLEM_ERRORS",
    "AbortIn",
    "CallOut",
    "ChannelHello",
    "ChannelRequest",
    "ChannelWelcome",
    "EscalationOut",
    "EscalationPage",
    "EventOut",
    "EventPage",
    "FrameId",
    "HealthOut",
    "NonNegative",
    "Problem",
    "ProposalIn",
    "ReadyOut",
    "ResultIn",
    "ResumeIn",
    "RunCreate",
    "RunId",
    "RunOut",
    "RunPage",
    "RunSummary",
    "ToolSpec",
    "Usage",
    "VerdictOut",
    "VerifyIn",
    "VerifyItem",
    "VerifyOut",
    "ViolationOut",
    "problem_slug",
]

Mode = Literal["hosted", "external"]
DrivenBy = Literal["gateway", "worker", "caller"]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
RunId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]*$",
        description="letters, digits and . _ : - (starting with a letter or digit)",
    ),
]
#: The largest proposal (the model's raw text) the gateway accepts, in characters.
MAX_PROPOSAL = 1_000_000
#: The most items one POST /v1/verify may carry.
MAX_BATCH = 10_000


class _In(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of request bodies: unknown fields are refused."""


class _Out(msgspec.Struct, kw_only=True):
    """Base of response bodies."""


class Usage(_In):
    """Tokens the caller's model call used (counted into the run's token budget)."""

    prompt: NonNegative = 0
    completion: NonNegative = 0
    cached: NonNegative = 0
    reasoning: NonNegative = 0


class ViolationOut(_Out):
    """Why a proposal was rejected, in terms the model can act on."""

    code: str
    """malformed, unknown_tool, tool_not_allowed, illegal_transition, schema,
    already_committed, guard, repeat, budget or circuit_open."""
    path: str
    """Where in the proposal: ``args.amount``, ``tool``, ``$``."""
    message: str
    hint: str


class ToolSpec(_Out):
    """A tool the run may call in its current state."""

    name: str
    description: str
    schema: dict[str, Any]
    """The JSON Schema of the tool's ``args``."""


class CallOut(_Out):
    """A verified tool call: execute it (or reconcile it) with ``key``, then report."""

    key: str
    """The idempotency key: pass it to the downstream; report the outcome with it."""
    tool: str
    args: dict[str, Any]


# -- runs ---------------------------------------------------------------------------------


class RunCreate(_In):
    """``POST /v1/runs``: start a run.

    Retrying with the same ``run_id`` (and the same machine and inputs) returns the run
    that the first request created, never a second one.
    """

    machine: str
    inputs: dict[str, Any] = {}
    run_id: RunId | None = None
    """The run's id; generated when omitted (then a retry starts another run)."""
    mode: Mode = "hosted"
    """``hosted``: the runtime drives the model and the tools. ``external``: the caller
    sends each proposal and reports each tool call's outcome."""


class RunOut(_Out):
    """A run: where it is and what it may do next."""

    id: str
    machine: str
    mode: Mode
    state: str
    seq: int
    """The seq of the run's last journal event: send it as ``expected_seq``."""
    outcome: str
    """running, completed, escalated or failed."""
    tools: list[ToolSpec] = []
    """The tools the run may call in its state, with their argument schemas."""
    next: list[str] = []
    """The states the run may move to from its state."""
    data_schema: dict[str, Any] | None = None
    """The JSON Schema the ``data`` of a move to any of ``next`` must match (the state's
    data schema); None when any JSON object will do."""
    context: str = ""
    """The rendered context for the model in a worker state: the instructions, what is
    allowed and the history, failed attempts compacted ('' elsewhere)."""
    pending: CallOut | None = None
    """An accepted call whose outcome the run waits for (report it with its key)."""
    output: Any = None
    """A completed run's output."""
    reason: str = ""
    """Why an escalated or failed run stopped."""
    driven_by: DrivenBy = "gateway"
    """Who drives the run: ``caller`` (an external run: its caller, through any gateway
    instance), ``gateway`` (a hosted run this gateway's process drives: on SQLite) or
    ``worker`` (a hosted run on PostgreSQL: an ``interlock worker`` claims and drives it;
    until one does, it waits in its initial state)."""


class RunSummary(_Out):
    """One row of the runs index."""

    id: str
    machine: str
    state: str
    outcome: str
    seq: int
    started: float
    updated: float
    reason: str = ""


class RunPage(_Out):
    """``GET /v1/runs``: a page of runs, oldest first; pass ``cursor`` for the next page."""

    runs: list[RunSummary]
    cursor: str | None = None
    """Give it as ``?cursor=`` to read on; None on the last page."""


class EventOut(_Out):
    """One journal event of a run."""

    run_id: str
    seq: int
    ts: float
    kind: str
    """run_started, model_called, proposal_rejected, intent_recorded, tool_committed,
    transitioned, escalated, completed, ... (the journal's event kinds)."""
    data: dict[str, Any]
    """The event's other fields, as journaled."""


class EventPage(_Out):
    """``GET /v1/runs/{id}/events?after=SEQ``: the events after ``after``."""

    run_id: str
    events: list[EventOut]
    last_seq: int
    """The seq of the last event returned (``after`` if none): the next ``after``."""
    more: bool = False
    """True when the page was cut at ``limit``: ask again with ``after=last_seq``."""


# -- proposals and results ----------------------------------------------------------------


class ProposalIn(_In):
    """``POST /v1/runs/{id}/proposals``: the model's raw text, verified by the gate.

    With ``expected_seq`` the request is safe to retry: the same proposal at the same
    ``expected_seq`` gets the recorded verdict; another client's advance gets a 409.
    """

    proposal: Annotated[str, msgspec.Meta(max_length=MAX_PROPOSAL)]
    """The model's raw answer: a tool call ``{"tool": ..., "args": {...}}`` or a move
    ``{"next": STATE, "data": {...}}``, byte for byte as the model produced it."""
    usage: Usage | None = None
    expected_seq: NonNegative | None = None
    """The run's seq as the caller last saw it (RunOut.seq / VerdictOut.seq)."""
    model: Annotated[str, msgspec.Meta(max_length=200)] = ""
    """The model's name, journaled with the call."""


class Problem(_Out):
    """An error, as ``application/problem+json`` (RFC 9457)."""

    type: str
    """A URI naming the kind of problem (``https://interlock.dev/problems/<slug>``)."""
    title: str
    status: int
    detail: str
    """What was wrong and how to fix it."""
    violations: list[ViolationOut] = []


#: The problem types that name one interlock exception, by slug (what follows
#: ``https://interlock.dev/problems/`` in a :class:`Problem`'s ``type``): the gateway
#: answers each exception with its slug, and the clients raise the exception again.
#: A slug not here (``conflict``, ``unprocessable-content``, ...) names no exception.
PROBLEM_ERRORS: Final = _types.MappingProxyType(
    {
        "run-not-found": _errors.RunNotFound,
        "stale-seq": _errors.StaleSeq,
        "run-ended": _errors.RunEnded,
        "run-exists": _errors.RunExists,
        "out-of-turn": _errors.OutOfTurn,
        "not-external": _errors.NotExternal,
        "run-leased": _errors.RunLeased,
        "invalid-run-id": _errors.InvalidRunId,
        "malformed-message": _errors.MalformedMessage,
        "store-damaged": _errors.StoreDamaged,
    }
)

_SLUGS: Final[dict[type, str]] = {cls: slug for slug, cls in PROBLEM_ERRORS.items()}


def problem_slug(exc: BaseException, default: str) -> str:
    """The slug of the problem type that names ``exc``: that of its most specific class
    in :data:`PROBLEM_ERRORS` (a :class:`~interlock.errors.JournalInconsistent` is
    ``store-damaged``), else ``default``."""
    for cls in type(exc).__mro__:
        slug = _SLUGS.get(cls)
        if slug is not None:
            return slug
    return default


class VerdictOut(_Out):
    """The gate's answer to a proposal or a result.

    Accepted tool calls carry ``key``, ``tool`` and ``args``: the intent is durable
    before this answer is sent; execute the call with the key and report it.
    """

    run_id: str
    accepted: bool
    outcome: str
    """running, completed, escalated or failed."""
    state: str
    seq: int
    """The run's seq after this verdict: the next request's ``expected_seq``."""
    violations: list[ViolationOut] = []
    key: str | None = None
    tool: str | None = None
    args: dict[str, Any] | None = None
    reconcile: CallOut | None = None
    """A call in doubt whose tool can reconcile: ask the downstream whether ``key`` was
    applied, and report that as the result (``applied``)."""
    result: Any = None
    """For a result whose key was already committed: the recorded result."""
    retry_in: float = 0.0
    replayed: bool = False
    """True when this is the recorded answer to an earlier identical request."""
    problem: Problem | None = None
    """Only in a batch (``POST /v1/verify``): the item got no verdict, and this says why."""


class ResultIn(_In):
    """``POST /v1/runs/{id}/results``: how the accepted call with ``key`` went.

    ``{key, result}`` for a success; ``{key, error, retryable?, applied?}`` for a
    failure. Retrying with the same key returns the recorded answer.
    """

    key: Annotated[str, msgspec.Meta(min_length=1, max_length=500)]
    result: Any = None
    error: str | None = None
    """Set for a failure: what went wrong."""
    retryable: bool = False
    applied: bool | None = None
    """For a failure: did the downstream apply the call? ``false`` (certainly not) hands
    the failure back to the model; unknown (null) or ``true`` leaves a call of a tool
    that is not safe to repeat in doubt. For a reconciliation (``VerdictOut.reconcile``):
    what the downstream said, with ``result`` when it was applied."""
    attempts: Annotated[int, msgspec.Meta(ge=1)] = 1
    latency: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class VerifyItem(_In):
    """One proposal of a batch."""

    run_id: str
    proposal: Annotated[str, msgspec.Meta(max_length=MAX_PROPOSAL)]
    usage: Usage | None = None
    expected_seq: NonNegative | None = None
    model: Annotated[str, msgspec.Meta(max_length=200)] = ""


class VerifyIn(_In):
    """``POST /v1/verify``: proposals for many external runs, journaled in one group commit."""

    items: Annotated[list[VerifyItem], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class VerifyOut(_Out):
    """One verdict per item, in order; an item that got none has ``problem`` set."""

    verdicts: list[VerdictOut]


# -- escalations --------------------------------------------------------------------------


class EscalationOut(_Out):
    """A run parked in the escalation queue."""

    id: str
    machine: str
    reason: str
    """The breaker or cause: consecutive_failures, repeat, in_doubt_side_effect, ..."""
    detail: str
    seq: int
    since: float
    """When it escalated (seconds since the epoch)."""
    from_state: str = ""
    """Where it escalated from: the default state to resume in."""
    targets: list[str] = []
    """The states it may be resumed in (``to``)."""


class EscalationPage(_Out):
    escalations: list[EscalationOut]


class ResumeIn(_In):
    """``POST /v1/escalations/{id}/resume``: resume in ``to`` (default: where it escalated
    from), or with a corrected ``payload`` (a proposal, verified like any other). Once
    resumed, the same resume (``to``, ``payload``) gets the run as it is; after an abort,
    or another resume, 409."""

    by: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    note: str = ""
    payload: str | None = None
    to: str | None = None


class AbortIn(_In):
    """``POST /v1/escalations/{id}/abort``: end the run in FAILED. Once aborted, a repeat
    gets the failed run; after a resume, 409."""

    by: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    note: str = ""


# -- health -------------------------------------------------------------------------------


class HealthOut(_Out):
    status: str = "ok"


class ReadyOut(_Out):
    """``GET /readyz``: the store answers, the journal can be written and keeps up."""

    ready: bool
    store: str
    waiting: int
    """Requests waiting on the journal now."""
    detail: str = ""


# The streaming channel (``interlock serve --channel``): length-prefixed msgpack frames.

#: A frame's header: its body's length, big-endian.
HEADER: Final = struct.Struct(">I")
#: The largest frame (its msgpack body) a connection accepts by default, in bytes.
DEFAULT_MAX_FRAME: Final = 8 << 20
#: The most requests of one connection the server holds unanswered by default.
DEFAULT_MAX_IN_FLIGHT: Final = 4096
#: The operations a request frame may name.
OPS: Final = ("hello", "create_run", "get_run", "propose", "report", "verify")
FrameId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class ChannelRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One request frame."""

    id: FrameId
    """The caller's correlation id, echoed in the answer (unique among its requests in
    flight)."""
    op: str
    """hello, create_run, get_run, propose, report or verify."""
    run_id: str | None = None
    """The run, for get_run, propose and report."""
    body: msgspec.Raw = msgspec.Raw(b"\xc0")
    """The operation's body: the HTTP API's request Struct for it (nil for get_run)."""


class ChannelHello(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The body of ``hello``: the API key (needed first when the server has keys)."""

    key: str | None = None
    traceparent: str | None = None
    """A W3C ``traceparent`` for the connection (a server tracing in OpenTelemetry): the
    runs it creates continue it, and each verdict on its proposals is a span under it, as
    the HTTP API's ``traceparent`` header does for one request. Malformed: ignored."""


class ChannelWelcome(msgspec.Struct, kw_only=True):
    """The answer to ``hello``: who the connection is and the server's limits."""

    principal: str
    max_in_flight: int
    max_frame: int
    ops: list[str]
