"""Journal events: tagged msgspec Structs. This module *is* the on-disk format.

Tags are written out as strings so that renaming a class never changes stored
bytes; ``tests/data/events.msgpack`` pins the encoding. Events are past tense.
Every event carries the run id, a per-run sequence number starting at 1 and the
recorded wall-clock time in seconds since the epoch. Events are never mutated.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator


class Violation(msgspec.Struct, frozen=True, gc=False):
    """Why a proposal was rejected, in terms the model can act on.

    NOTE: ``gc=False`` is safe: every field is a string.
    """

    code: str
    """One of: malformed, unknown_tool, tool_not_allowed, illegal_transition, schema,
    already_committed, guard, repeat, budget, circuit_open."""
    path: str
    """Where in the proposal the problem is (``args.amount``, ``tool``, ``$``)."""
    message: str
    """What is wrong, naming the value and the rule."""
    hint: str
    """What to propose instead."""


class TokenUsage(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Tokens one model call used. NOTE: ``gc=False``: scalar fields only.

    ``prompt`` counts every input token, the cached ones included; ``cached`` says how
    many of them were read from the provider's prompt cache, and ``reasoning`` how many
    of the ``completion`` tokens were hidden reasoning.
    """

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    reasoning: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Base of every journal event. Never written on its own.

    Events (like messages, frames and verdicts) are plain data that never take part in a
    reference cycle, so they are not tracked by the cyclic garbage collector (``gc=False``):
    with thousands of runs in flight, every tracked object is walked again at each
    collection, and every tracked allocation brings the next collection closer.
    """

    run_id: str
    seq: int
    ts: float


class RunStarted(Event, frozen=True, tag="run_started"):
    """A run was created."""

    machine: str
    state: str
    inputs: dict[str, Any] = {}
    external: bool | msgspec.UnsetType = msgspec.UNSET
    """True for a run its caller drives (no actor: the caller proposes and reports, see
    ``Supervisor.submit``); absent for a run the runtime drives."""
    trace: str | msgspec.UnsetType = msgspec.UNSET
    """The W3C ``traceparent`` of the run's first span, when the run was started with
    tracing on (``interlock[otel]``): the trace every later part of the run joins, in
    this process or another; absent otherwise."""


class Oversized(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """What a model call journals of an answer over its state's cap, which the gate
    refuses unread: ``raw`` and ``response`` hold bounded excerpts of it (what goes back
    to the model, see ``providers``), and this what the whole answer was. Replay decides
    the same refusal from ``raw_bytes``."""

    raw_bytes: int
    """The whole proposal's size in bytes (UTF-8)."""
    raw_sha256: str
    """The SHA-256 of the whole proposal (UTF-8), in hex."""
    response_bytes: int = 0
    """The whole response's size in bytes when ``response`` holds only an excerpt of it;
    0 when it is whole (or there is none)."""
    response_sha256: str = ""
    """The SHA-256 of the whole response, when ``response_bytes`` is set."""


class ModelCalled(Event, frozen=True, tag="model_called"):
    """The provider was asked for a proposal in a worker state, and answered.

    The prompt is recorded whole, or as a delta against the run's previous model
    call when the two share most of their text (a run's prompts grow by a history
    line a step): then ``prompt`` holds only the changed middle, and the whole
    prompt is ``base[:prompt_prefix] + prompt + base[len(base) - prompt_suffix:]``
    where ``base`` is the whole prompt of the ``model_called`` event at seq
    ``prompt_base`` of the same run (see :func:`expand_prompt`). ``prompt_hash``
    is always the hash of the whole prompt, so a rebuilt prompt can be checked.
    """

    state: str
    model: str
    prompt_hash: str
    prompt: str
    raw: str
    usage: TokenUsage
    latency: float = 0.0
    """Seconds the provider took."""
    error: str = ""
    """Set when the provider failed to answer (``raw`` is then empty). Journals written
    since ``provider_failed`` exists record such a failure as that event instead."""
    defect: str | msgspec.UnsetType = msgspec.UNSET
    """Set when the provider's answer could not be read as text (not a string, or a
    string with code points UTF-8 cannot hold); ``raw`` then shows it escaped, and
    the proposal is rejected as ``malformed`` with this text. Absent (UNSET) otherwise."""
    prompt_base: int = 0
    """Seq of the earlier model call ``prompt`` is a delta against; 0: ``prompt`` is whole."""
    prompt_prefix: int = 0
    """Leading characters of the base prompt that this prompt starts with."""
    prompt_suffix: int = 0
    """Trailing characters of the base prompt that this prompt ends with."""
    response: str | msgspec.UnsetType = msgspec.UNSET
    """The provider's response exactly as it came (an HTTP provider: the response body);
    absent for a provider that has none. ``prompt`` is then the exact request body."""
    envelope: Violation | msgspec.UnsetType = msgspec.UNSET
    """Set when the response's envelope already rules out a proposal (no call where the
    stop reason says there is one, a refusal, a reply cut at the output limit, ...): the
    proposal is rejected with this violation, in the provider's words."""
    extra_calls: tuple[tuple[str, str], ...] | msgspec.UnsetType = msgspec.UNSET
    """The calls after the first one in the same response, as ``(name, arguments)``: one
    call per turn is proposed, and the model is told the others were not run."""
    oversized: Oversized | msgspec.UnsetType = msgspec.UNSET
    """Set when the answer was over the state's cap (``max_proposal_bytes``): ``raw`` and
    ``response`` then hold bounded excerpts, and this the whole's sizes and hashes, so a
    refused 50 MB answer costs the journal kilobytes, not its size again and again."""


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
    """``proposal``, ``step``, ``breaker``, ``fallback``, ``operator``, ``recovery``,
    ``in_doubt``, ``provider``, or ``call``: the move an ``intent_recorded`` named
    (``next``), made as that call committed."""
    delta_in_proposal: bool | msgspec.UnsetType = msgspec.UNSET
    """True when ``delta`` is left out because it is exactly the ``data`` of the proposal
    journaled just before (the ``raw`` of that ``model_called`` or ``step_proposed``):
    the journal holds it once, and a fold reads it from there. Absent otherwise."""


class IntentRecorded(Event, frozen=True, tag="intent_recorded"):
    """A verified tool call is about to run; durable before it does."""

    state: str
    tool: str
    args: dict[str, Any]
    key: str
    """The idempotency key, ``run_id:state:seq`` of this event."""
    next: str | msgspec.UnsetType = msgspec.UNSET
    """Set for a call that moves on when it succeeds (a ``Worker(call_and_move=True)``
    state): the verified state to move to. The ``tool_committed`` of ``key`` is then
    followed, in the same write, by a ``transitioned`` to it with ``delta`` ``data``; a
    call that fails makes no move. Absent (UNSET) for a plain call, so intents written
    before it exists decode and replay as they were."""
    data: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    """The verified data of that move; absent when it carries none (or there is no move)."""


class ToolCommitted(Event, frozen=True, tag="tool_committed"):
    """The tool call with ``key`` ran and returned ``result``."""

    tool: str
    key: str
    result: Any
    attempts: int = 1
    latency: float = 0.0
    reused: bool = False
    """True when the result was taken from an earlier commit of the same key."""
    reconciled: bool | msgspec.UnsetType = msgspec.UNSET
    """True when the downstream reported the key applied (``reconcile``) and ``result``
    is what it reported; the call was not executed again. Absent (UNSET, falsy) otherwise:
    fields added to an existing event are left out unless set, so the bytes of every
    event written before them stay as they were."""


class ToolInDoubt(Event, frozen=True, tag="tool_in_doubt"):
    """A call of a tool that is not safe to repeat may or may not have been applied.

    An attempt failed after it may have reached the downstream (a timeout, a dropped
    connection, any exception that does not say "not applied"), or a crash came between
    the intent and the outcome. The call stays pending: it is reconciled with the
    downstream if its tool can (``reconciled`` follows), otherwise the run escalates
    with reason ``in_doubt_side_effect``. It is never executed again blindly.
    """

    tool: str
    key: str
    error: str
    attempts: int = 0
    """Attempts made in this process (0 after a crash)."""
    latency: float = 0.0
    after_crash: bool = False


class Reconciled(Event, frozen=True, tag="reconciled"):
    """The tool's ``reconcile`` was asked whether the call with ``key`` was applied.

    ``applied`` is True (a ``tool_committed`` with the reported result follows), False
    (the call is executed once, with the same key) or None (reconcile raised or timed
    out: ``error`` says how; the run escalates as in doubt).
    """

    tool: str
    key: str
    applied: bool | None
    error: str = ""
    latency: float = 0.0


class ProviderFailed(Event, frozen=True, tag="provider_failed"):
    """The provider failed to answer a model call: it raised, timed out or was unavailable.

    Not the model's mistake: it counts toward no rejection, step or breaker. The run
    asks again after ``retry_in`` seconds, or, when the machine's provider policy is
    exhausted (``retry_in`` is None), escalates with reason ``provider_unavailable``
    (or trips the deadline breaker, if the run's deadline has passed).
    """

    state: str
    model: str
    error: str
    attempt: int = 1
    """Failed model calls in a row, this one included."""
    retryable: bool = True
    """False when the provider said retrying cannot help."""
    retry_after: float | None = None
    """Seconds the provider asked to wait (Retry-After), if it said."""
    retry_in: float | None = None
    """Seconds the run waits before it asks again; None when it gave up."""
    latency: float = 0.0
    refused: bool | msgspec.UnsetType = msgspec.UNSET
    """True when the server refused the request's shape (:class:`~interlock.errors.RequestRefused`):
    the run escalated with ``request_refused``. Unset (not written) otherwise, so events
    from before it existed encode as they did."""


class ToolFailed(Event, frozen=True, tag="tool_failed"):
    """The tool call with ``key`` raised, timed out, or exhausted its retries."""

    tool: str
    key: str
    error: str
    retryable: bool = False
    attempts: int = 1
    latency: float = 0.0
    in_doubt: bool | msgspec.UnsetType = msgspec.UNSET
    """True when the call (of a tool that is not safe to repeat) may or may not have been
    applied and the run escalates as in doubt: ``error`` is then the failure that left it
    so (``in doubt after a crash`` when a crash did). Absent (UNSET, falsy) for a failure
    handed back to the model; written False only for such a failure whose ``error`` has
    the form journals from before this field gave an in-doubt failure (see below)."""

    def __post_init__(self) -> None:
        # Decode-time upgrade: journals written before ``in_doubt`` existed marked a call
        # escalated as in doubt only in the text, ``error="in doubt: <the failure>"`` (or
        # exactly "in doubt after a crash"), with the other fields at their defaults (the
        # decider wrote none of them). Such an event reads as the structured form the
        # decider writes now, so an old run folds, counts and replays as a new one does.
        # The decider writes ``in_doubt`` (True, or False, see legacy_in_doubt_text) on
        # every failure whose text has that form, so a new event is never rewritten here.
        if (
            self.in_doubt is msgspec.UNSET
            and legacy_in_doubt_text(self.error)
            and (self.retryable, self.attempts, self.latency) == (False, 1, 0.0)
        ):
            error = self.error
            if error.startswith(_OLD_IN_DOUBT_PREFIX):
                msgspec.structs.force_setattr(self, "error", error[len(_OLD_IN_DOUBT_PREFIX) :])
            msgspec.structs.force_setattr(self, "in_doubt", True)


#: How journals from before ``ToolFailed.in_doubt`` marked an in-doubt failure's text.
_OLD_IN_DOUBT_PREFIX = "in doubt: "
IN_DOUBT_AFTER_CRASH = "in doubt after a crash"


def legacy_in_doubt_text(error: str) -> bool:
    """Whether ``error`` has the form that marked a ``tool_failed`` in doubt before
    ``ToolFailed.in_doubt`` existed: such an event without the field is read as in doubt."""
    return error.startswith(_OLD_IN_DOUBT_PREFIX) or error == IN_DOUBT_AFTER_CRASH


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
    output_in_delta: bool | msgspec.UnsetType = msgspec.UNSET
    """True when ``output`` is left out because it is the delta of the ``transitioned``
    event just before (the journal holds it once); a fold restores it. Absent otherwise."""


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
    | ToolInDoubt
    | Reconciled
    | ProviderFailed
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
    ToolInDoubt,
    Reconciled,
    ProviderFailed,
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


#: What msgspec raises for a value msgpack cannot hold.
ENCODING_ERRORS = (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError)


def unjournalable(value: Any, root: str = "$") -> str | None:
    """Why ``value`` cannot go into a journal event, or None if it can: where in it (a
    path from ``root``) and what it is that cannot be encoded, and why.

    Decoded JSON can hold what msgpack cannot (integers past 64 bits), and a tool can
    return anything (cycles, nesting past the recursion limit, foreign objects, dict keys
    that are tuples). An event must encode as msgpack (the journal) and as JSON (the
    run's view, the event stream), so such a value is refused where it enters, so that
    it never reaches a batch: a batch the store cannot encode would fail every run in it.
    """
    try:
        _encoder.encode(value)
        _json_encoder.encode(value)
    except ENCODING_ERRORS as exc:
        return _unencodable_at(value, root, str(exc) or type(exc).__name__)
    return None


def journalable(value: Any, root: str = "$") -> tuple[Any, str | None]:
    """``value`` (a tool's result, say) as JSON-like builtins, or why it cannot be
    journaled (see :func:`unjournalable`)."""
    try:
        payload = msgspec.to_builtins(value)
    except Exception as exc:  # a foreign object may raise anything while it is read
        return None, _unencodable_at(value, root, str(exc) or type(exc).__name__)
    return payload, unjournalable(payload, root)


#: How deep :func:`_unencodable_at` looks for what cannot be encoded.
_LOOK_DEPTH = 64


def _encoding_problem(value: Any) -> str | None:
    try:
        payload = msgspec.to_builtins(value)
        _encoder.encode(payload)
        _json_encoder.encode(payload)
    except Exception as exc:  # (see journalable)
        return str(exc) or type(exc).__name__
    return None


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a foreign object's repr may raise
        return "(its repr cannot be shown)"
    return text if len(text) <= 60 else text[:57] + "..."


def _step(key: Any) -> str:
    if type(key) is str and key.isidentifier():
        return f".{key}"
    return f"[{_short_repr(key)}]"


def _unencodable_at(value: Any, root: str, reason: str) -> str:
    """Where in ``value``, which failed to encode for ``reason``, the encoder stops: the
    path of the innermost part that fails alone, what it is, and why.

    Only a value that failed gets here: each level encodes its parts until one fails,
    and goes down into it (the parents on the way are kept, so a cycle is named)."""
    path, node = root, value
    parents = {id(value): root}
    for _ in range(_LOOK_DEPTH):
        if isinstance(node, dict):
            parts: Any = node.items()
        elif isinstance(node, list | tuple | set | frozenset):
            parts = enumerate(node)
        else:
            break
        found = None
        for key, part in parts:
            if isinstance(node, dict):
                problem = _encoding_problem({key: None})
                if problem is not None:
                    return (
                        f"the key {_short_repr(key)} of type {type(key).__name__} at {path}: "
                        f"{problem}"
                    )
                step = _step(key)
            else:
                step = f"[{key}]"
            if id(part) in parents:
                return (
                    f"the {type(part).__name__} at {path}{step} is the one at "
                    f"{parents[id(part)]} again: a cycle cannot be encoded"
                )
            problem = _encoding_problem(part)
            if problem is not None:
                found = (step, part, problem)
                break
        if found is None:
            break  # no part fails alone: this one does as a whole (nested too deep)
        step, node, reason = found
        path += step
        parents[id(node)] = path
    return f"the {type(node).__name__} at {path}: {reason}"


def describe_exception(exc: BaseException, limit: int = 500) -> str:
    """How a failure is journaled: ``Type: message``; for an exception group, its own
    message and every leaf, flattened (``ExceptionGroup: fan-out (2 leaves: ValueError: a;
    KeyError: 'b')``). An exception whose ``__str__`` raises is still named. At most
    ``limit`` characters."""
    if isinstance(exc, BaseExceptionGroup):
        leaves: list[str] = []

        def walk(group: BaseExceptionGroup[BaseException]) -> None:
            for inner in group.exceptions:
                if isinstance(inner, BaseExceptionGroup):
                    walk(inner)
                else:
                    leaves.append(_one_exception(inner))

        walk(exc)
        text = f"{type(exc).__name__}: {exc.message} ({len(leaves)} leaves: {'; '.join(leaves)})"
    else:
        text = _one_exception(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_exception(exc: BaseException) -> str:
    kind = type(exc)
    if kind.__name__ == "Cancelled" and kind.__module__.partition(".")[0] == "trio":
        return "Cancelled"  # its text names a task by memory address: not journaled
    try:
        message = str(exc)
    except Exception:  # an exception whose __str__ raises must not break the caller
        message = "(its message cannot be shown)"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def unjournalable_violation(where: str, problem: str) -> Violation:
    """The rejection of a proposal whose ``args`` or ``data`` the journal cannot hold."""
    return Violation(
        "schema",
        where,
        f"{where}: {problem}; the journal cannot hold this value",
        "send plain JSON values; keep integers within 64 bits (-2**63 .. 2**64-1)",
    )


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


_EMPTY_PROMPT_HASH = hashlib.sha256(b"").hexdigest()[:32]

#: Characters of the start and of the end of an oversized answer's response that the
#: journal keeps (see :class:`Oversized`).
RESPONSE_EXCERPT_ENDS = 1024


def oversized_answer(raw: str, shown: str, response: str | None) -> tuple[str | None, Oversized]:
    """What a model call journals of the answer ``raw``, over its state's cap, and of its
    ``response``: the response bounded (None if there is none), and the sizes and hashes
    of the whole. ``shown`` is the excerpt journaled as ``raw``."""
    data = raw.encode()
    cut = Oversized(raw_bytes=len(data), raw_sha256=hashlib.sha256(data).hexdigest())
    ends = RESPONSE_EXCERPT_ENDS
    if response is None or len(response) <= 2 * ends + len(shown):
        return response, cut
    whole = response.encode()
    kept = (
        f"{response[:ends]}[... {len(whole):,} bytes in all, the whole answer was "
        f"{len(data):,} bytes: only the first and last {ends} characters of the response "
        f"are journaled ...]{response[-ends:]}"
    )
    return kept, msgspec.structs.replace(
        cut, response_bytes=len(whole), response_sha256=hashlib.sha256(whole).hexdigest()
    )


def same_answer(event: ModelCalled, raw: str) -> bool:
    """Whether ``raw`` is the answer ``event`` journaled (whole, or as an excerpt)."""
    cut = event.oversized
    if cut is msgspec.UNSET:
        return event.raw == raw
    data = raw.encode("utf-8", "backslashreplace")  # as the journal keeps it (readable_text)
    return len(data) == cut.raw_bytes and hashlib.sha256(data).hexdigest() == cut.raw_sha256


def hash_prompt(prompt: str) -> str:
    """The ``prompt_hash`` of a whole prompt: the first 32 hex digits of its SHA-256."""
    if not prompt:  # providers that record no prompt: skip hashing nothing every call
        return _EMPTY_PROMPT_HASH
    return hashlib.sha256(prompt.encode()).hexdigest()[:32]


#: A prompt's SHA-256 state part-way through: (the prompt, a character offset in it, the
#: hash object having consumed exactly ``prompt[:offset]``).
PromptHashState = tuple[str, int, Any]


def hash_prompt_after(
    state: PromptHashState | None, base: str, prompt: str, shared: int, tail: int
) -> tuple[str, PromptHashState | None]:
    """``hash_prompt(prompt)``, resuming from the hash of the part it shares with ``base``.

    A run's prompts grow at the end (its history), so each one shares a long prefix with
    the previous one: hashing only from where the previous one's new text ended keeps a
    step's hashing O(new text), not O(prompt).

    Args:
      state: what the previous call returned for ``base``, or None.
      base: the run's previous prompt ('' if none); ``state`` is used only if it is
        ``base``'s (the very object) and its offset is within ``shared``.
      prompt: the prompt to hash.
      shared: how many leading characters ``prompt`` shares with ``base``.
      tail: where in ``prompt`` its trailing part shared with ``base`` starts
        (``len(prompt)`` if none); the next prompt is likely to share up to here.

    Returns:
      The hash, and the state to pass along with ``prompt`` next time.
    """
    if not prompt:
        return _EMPTY_PROMPT_HASH, None
    if state is not None and state[0] is base and state[1] <= shared:
        offset = state[1]
        hasher = state[2].copy()
    else:
        offset = 0
        hasher = hashlib.sha256()
    tail = min(max(tail, offset), len(prompt))
    hasher.update(prompt[offset:tail].encode())
    kept = hasher.copy()
    hasher.update(prompt[tail:].encode())
    return hasher.hexdigest()[:32], (prompt, tail, kept)


def expand_prompt(base_seq: int, base: str, event: ModelCalled) -> str:
    """Return the whole prompt of ``event``, given the run's previous model call's.

    Args:
      base_seq: the seq of the run's previous model call (0 if there is none).
      base: that call's whole prompt ('' if there is none).
      event: the model call; ``base_seq``/``base`` are ignored when it records its
        prompt whole (``prompt_base == 0``).

    Raises:
      ValueError: the delta is written against another call (the journal is missing
        events), or does not fit ``base`` (the journal is damaged).
    """
    if not event.prompt_base:
        return event.prompt
    if event.prompt_base != base_seq:
        raise ValueError(
            f"run {event.run_id!r}: model_called {event.seq} is written against the prompt "
            f"at seq {event.prompt_base}, but the previous model call is at seq {base_seq}; "
            "the journal is missing events"
        )
    prefix, suffix = event.prompt_prefix, event.prompt_suffix
    if prefix < 0 or suffix < 0 or prefix + suffix > len(base):
        raise ValueError(
            f"run {event.run_id!r}: model_called {event.seq} keeps {prefix}+{suffix} characters "
            f"of the prompt at seq {event.prompt_base}, which has only {len(base)}; "
            "the journal is damaged or out of order"
        )
    return base[:prefix] + event.prompt + base[len(base) - suffix :]


def whole_prompts(events: Iterable[Event]) -> Iterator[tuple[ModelCalled, str]]:
    """Yield each ``model_called`` event of ``events`` with its whole prompt, rebuilt and checked.

    ``events`` may interleave runs; each run's events must be in seq order.

    Raises:
      ValueError: if a delta names a base that is not the run's previous model call, or
        the rebuilt prompt does not match the recorded ``prompt_hash``.
    """
    last: dict[str, tuple[int, str]] = {}
    for event in events:
        if not isinstance(event, ModelCalled):
            continue
        prompt = expand_prompt(*last.get(event.run_id, (0, "")), event)
        if event.prompt_hash and hash_prompt(prompt) != event.prompt_hash:
            raise ValueError(
                f"run {event.run_id!r}: the prompt of model_called {event.seq} does not match "
                "its recorded hash; the journal is damaged"
            )
        last[event.run_id] = (event.seq, prompt)
        yield event, prompt
