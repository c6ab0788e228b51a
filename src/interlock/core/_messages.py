"""The actor <-> supervisor protocol: tagged msgspec Structs, in-process and on the wire.

In one process the Structs themselves travel (no encoding needed); across processes
and through the gateway they travel as msgpack or JSON produced by the module-level
encoders below. Requests are imperative, replies are nouns.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

from ._events import Oversized, TokenUsage, Violation
from ._exceptions import MalformedMessage


class Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Base of every message. Never sent on its own."""

    run_id: str
    seq: int = 0
    """The seq of the run's last journal event as the sender knows it; a stale seq is refused."""


class Start(Msg, frozen=True, tag="start"):
    """Create a run of ``machine`` with ``inputs``."""

    machine: str
    inputs: dict[str, Any] = {}
    external: bool = False
    """The caller drives the run (proposes and reports) instead of an actor."""
    trace: str = ""
    """The ``traceparent`` of the run's first span (tracing on), journaled with the start."""


#: The model name the MCP proxy journals its client's calls under: what an agent asked
#: for, not a model call this process made or was told of (no ``chat`` span is made of it).
CLIENT_MODEL = "mcp-client"


class Propose(Msg, frozen=True, tag="propose"):
    """What a provider (``source="model"``), a step or an operator proposed. Not trusted yet."""

    raw: str
    source: str = "model"
    model: str = ""
    prompt: str = ""
    usage: TokenUsage = TokenUsage()
    latency: float = 0.0
    error: str = ""
    """Set when the provider or step failed to produce anything; ``raw`` is then empty."""
    retryable: bool = True
    """For a provider failure (``error``): False when retrying cannot help."""
    retry_after: float | None = None
    """For a provider failure: seconds the provider asked to wait, if it said."""
    refused: bool = False
    """For a provider failure: the server refused the request's shape (a
    :class:`~interlock.errors.RequestRefused`); the run escalates with ``request_refused``."""
    defect: str = ""
    """Set when the provider answered something that cannot be read as a proposal (not
    text, or text UTF-8 cannot hold); ``raw`` then shows it escaped."""
    legacy: bool = False
    """Replay of a journal written before ``provider_failed`` existed: a failed model
    call is decided as it was then (a ``model_called`` with ``error``, then a
    ``malformed`` rejection), so old runs still reproduce."""
    response: str | None = None
    """The provider's exact response (an HTTP body), journaled with the call."""
    envelope: Violation | None = None
    """The provider found no proposal in the response's envelope: reject with this."""
    extra_calls: tuple[tuple[str, str], ...] = ()
    """Calls after the first in the same response (``(name, arguments)``); not run."""
    oversized: Oversized | None = None
    """Replay of an answer journaled as an excerpt (over its state's cap): ``raw`` and
    ``response`` are the journaled excerpts, and this what the whole answer was."""


class Report(Msg, frozen=True, tag="report"):
    """The outcome of executing the verified call with idempotency key ``key``."""

    key: str
    ok: bool
    result: Any = None
    error: str = ""
    retryable: bool = False
    attempts: int = 1
    latency: float = 0.0
    applied: bool | None = None
    """For a failure: whether the downstream applied the call. ``False`` (certainly not)
    hands the failure back to the model; ``None`` (unknown, the default) or ``True``
    leave a call of a tool that is not safe to repeat in doubt (reconciled or escalated).
    Ignored for idempotent and read-only tools."""


class Reconciliation(Msg, frozen=True, tag="reconciliation"):
    """What the tool's ``reconcile`` said of the call in doubt with idempotency key ``key``.

    ``applied``: True (``result`` is the call's result), False (not applied), or None
    (reconcile raised or timed out; ``error`` says how).
    """

    key: str
    applied: bool | None
    result: Any = None
    error: str = ""
    latency: float = 0.0


class Cancel(Msg, frozen=True, tag="cancel"):
    """Stop a run: it is failed with ``reason``."""

    reason: str = "cancelled"


class Resume(Msg, frozen=True, tag="resume"):
    """An operator resumes an escalated run, in ``to`` (default: where it escalated from),
    optionally with a corrected ``payload`` that is verified like any proposal."""

    by: str
    note: str = ""
    to: str = ""
    payload: str = ""


class Abort(Msg, frozen=True, tag="abort"):
    """An operator ends an escalated run: it moves to FAILED."""

    by: str
    note: str = ""


class Escalate(Msg, frozen=True, tag="escalate"):
    """A driver parks its run in the escalation queue for an operator, for what the
    machine cannot see: ``reason`` names it in a word or two (as a breaker's name does),
    ``detail`` says what happened and what the operator should check. Refused while a
    tool call is in flight (report its outcome first) and once the run ended; a run that
    is escalated already stays as it is."""

    reason: str
    detail: str = ""


class Sync(Msg, frozen=True, tag="sync"):
    """Wait until everything decided so far is durable; answered with the run's verdict."""


class Recover(Msg, frozen=True, tag="recover"):
    """Decide how a run folded from the journal after a restart continues."""


class ToolCall(msgspec.Struct, frozen=True, gc=False):
    """A verified call the actor must now execute, with the key it must pass on."""

    tool: str
    args: dict[str, Any]
    key: str


class Verdict(Msg, frozen=True, tag="verdict"):
    """Supervisor -> actor. Sent only after the batch holding its events is durable."""

    accepted: bool
    state: str
    outcome: str
    """running, completed, escalated or failed."""
    violations: tuple[Violation, ...] = ()
    execute: ToolCall | None = None
    """For an accepted tool call: what to run now."""
    result: Any = None
    """For a call whose key was already committed: the recorded result, reused."""
    reconcile: ToolCall | None = None
    """For a call in doubt whose tool can reconcile: ask its downstream now."""
    retry_in: float = 0.0
    """After a provider failure: seconds to wait before asking the model again."""


Request: TypeAlias = (
    Start | Propose | Report | Reconciliation | Cancel | Escalate | Resume | Abort | Recover | Sync
)
Message: TypeAlias = (
    Start
    | Propose
    | Report
    | Reconciliation
    | Cancel
    | Escalate
    | Resume
    | Abort
    | Recover
    | Sync
    | Verdict
)

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder(Message)
_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(Message)


def encode_message(msg: Msg, *, json: bool = False) -> bytes:
    """Encode a message for another process: msgpack by default, JSON if asked."""
    return _json_encoder.encode(msg) if json else _msgpack_encoder.encode(msg)


def decode_message(data: bytes, *, json: bool = False) -> Message:
    """Decode one message.

    Raises:
      MalformedMessage: the bytes are not a valid message; the text says what is wrong.
    """
    try:
        return _json_decoder.decode(data) if json else _msgpack_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"undecodable message: {exc}") from exc
