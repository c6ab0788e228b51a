"""A run's state folded from its journal, and the read-only view guards, steps and providers see."""

from __future__ import annotations

from array import array
from collections import Counter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgspec

from ._events import (
    ENCODING_ERRORS,
    BreakerTripped,
    Completed,
    Escalated,
    Event,
    Failed,
    IntentRecorded,
    ModelCalled,
    PromptHashState,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
    Violation,
    expand_prompt,
)
from ._exceptions import JournalInconsistent
from ._hotpath import NO_EXTENSIONS, compact_failures, hash64, proposal_hash

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ._machine import Machine


_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder(dict[str, Any]).decode
_unpack_any = msgspec.msgpack.Decoder().decode
_from_json = msgspec.json.Decoder(dict[str, Any]).decode
_from_json_any = msgspec.json.Decoder().decode

#: How long a value's JSON may be in a history frame before it is cut (see _short).
_SHORT = 200


class ToolResult:
    """A committed tool call, as the run's history holds it.

    A run keeps every committed call for its guards and steps (``view.results``), so
    the call's ``args``, and its ``result`` when that is an object or an array, are held
    encoded, a fraction of the size of a dict of strings, and decoded (to an equal,
    fresh value) each time they are read. A scalar result is held as it is: encoding
    would make ``None``, a bool or a short string bigger.

    The encoding is the JSON the run's history frame of the call already shows
    (``tool(ARGS) -> RESULT``, see :meth:`RunState.apply`), where that text holds it
    whole and decodes back to an equal value: the frame's text is then the only copy.
    Otherwise it is msgpack of its own.
    """

    __slots__ = ("_args", "_key", "_mode", "_result", "_run_id", "_state", "seq", "tool")

    tool: str
    seq: int
    _key: str | int
    """The key, or (an int) the seq of its intent in a key the runtime made: the key is
    then ``{run id}:{state}:{that seq}``, built on read (see :attr:`key`)."""
    _run_id: str
    _state: str
    _args: bytes | str
    """The args as msgpack, or (``_mode & 4``) the frame text holding them as JSON."""
    _result: Any
    _mode: int
    """``tail << 3 | in_text << 2 | packed``: whether ``_args`` is the frame text holding
    the args as JSON (else msgpack) and how many characters follow them there, and how
    the result is held (0: ``_result`` is the result; 1: its msgpack; 2: JSON in the
    frame text, after the args)."""

    def __init__(
        self,
        tool: str,
        args: dict[str, Any],
        result: Any,
        key: str,
        seq: int,
        *,
        _text: str = "",
        _args_json: str = "",
        _result_json: str = "",
        _run_id: str = "",
        _state: str = "",
        _intent_seq: int = 0,
    ) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "tool", tool)
        run_id = state = ""
        if _intent_seq and key == f"{_run_id}:{_state}:{_intent_seq}":
            # The key the decider made for the call: the strings it is made of are the
            # run's own, so only the seq is held (a new string a step otherwise).
            run_id, state = _run_id, _state
            setattr_(self, "_key", _intent_seq)
        else:
            setattr_(self, "_key", key)
        setattr_(self, "_run_id", run_id)
        setattr_(self, "_state", state)
        end = 0
        if (
            _text
            and type(args) is dict
            and len(_args_json) <= _SHORT
            and _from_json(_args_json) == args
        ):
            end = len(tool) + 1 + len(_args_json)
            setattr_(self, "_args", _text)
        else:
            # The journal held these args (the supervisor refuses what msgpack cannot
            # hold), so they pack.
            setattr_(self, "_args", _pack(args))
        packed = 1 if type(result) is dict or type(result) is list else 0
        if packed:
            if end and len(_result_json) <= _SHORT and _from_json_any(_result_json) == result:
                packed, result = 2, None
            else:
                try:
                    result = _pack(result)
                except ENCODING_ERRORS:  # not from the journal: keep it as it was given
                    packed = 0
        setattr_(self, "_result", result)
        tail = len(_text) - end if end else 0
        setattr_(self, "_mode", tail << 3 | (4 if end else 0) | packed)
        setattr_(self, "seq", seq)

    @property
    def key(self) -> str:
        """The call's idempotency key."""
        key = self._key
        if type(key) is str:
            return key
        return f"{self._run_id}:{self._state}:{key}"

    @property
    def args(self) -> dict[str, Any]:
        """The call's args, as journaled."""
        mode = self._mode
        if mode & 4:
            text: str = self._args  # type: ignore[assignment]
            return _from_json(text[len(self.tool) + 1 : len(text) - (mode >> 3)])
        return _unpack(self._args)  # type: ignore[arg-type]

    @property
    def result(self) -> Any:
        """The tool's result, as journaled."""
        packed = self._mode & 3
        if packed == 1:
            return _unpack_any(self._result)
        if packed == 2:
            text: str = self._args  # type: ignore[assignment]
            return _from_json_any(text[len(text) - (self._mode >> 3) + 5 :])  # after ") -> "
        return self._result

    @classmethod
    def _in_frame(
        cls,
        tool: str,
        args: dict[str, Any],
        result: Any,
        key: str,
        seq: int,
        text: str,
        args_json: str,
        result_json: str,
        run_id: str,
        state: str,
        intent_seq: int,
    ) -> ToolResult:
        """What RunState.apply commits: ``ToolResult(..., _text=text, ...)``, its
        arguments positional and its slots set directly (a step's hot path)."""
        if not (type(args) is dict and len(args_json) <= _SHORT and _from_json(args_json) == args):
            return cls(tool, args, result, key, seq)
        self = cls.__new__(cls)
        _set_tool(self, tool)
        _set_seq(self, seq)
        _set_args(self, text)
        end = len(tool) + 1 + len(args_json)
        if intent_seq and key == f"{run_id}:{state}:{intent_seq}":
            _set_key(self, intent_seq)
            _set_run_id(self, run_id)
            _set_state(self, state)
        else:
            _set_key(self, key)
            _set_run_id(self, "")
            _set_state(self, "")
        packed = 1 if type(result) is dict or type(result) is list else 0
        if packed:
            if len(result_json) <= _SHORT and _from_json_any(result_json) == result:
                packed, result = 2, None
            else:
                try:
                    result = _pack(result)
                except ENCODING_ERRORS:
                    packed = 0
        _set_result(self, result)
        # NOTE: the length of what follows the args (") -> " and the result), not where
        # they end: a short result keeps this a small int, which every run shares.
        _set_mode(self, (len(text) - end) << 3 | 4 | packed)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ToolResult is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolResult):
            return NotImplemented
        return (self.tool, self.args, self.result, self.key, self.seq) == (
            other.tool,
            other.args,
            other.result,
            other.key,
            other.seq,
        )

    __hash__ = None  # type: ignore[assignment]  # holds dicts, like the Struct it replaced

    def __repr__(self) -> str:
        return (
            f"ToolResult(tool={self.tool!r}, args={self.args!r}, result={self.result!r}, "
            f"key={self.key!r}, seq={self.seq!r})"
        )


_set_tool = ToolResult.tool.__set__  # type: ignore[attr-defined]
_set_seq = ToolResult.seq.__set__  # type: ignore[attr-defined]
_set_args = ToolResult._args.__set__  # type: ignore[attr-defined]
_set_key = ToolResult._key.__set__  # type: ignore[attr-defined]
_set_run_id = ToolResult._run_id.__set__  # type: ignore[attr-defined]
_set_state = ToolResult._state.__set__  # type: ignore[attr-defined]
_set_result = ToolResult._result.__set__  # type: ignore[attr-defined]
_set_mode = ToolResult._mode.__set__  # type: ignore[attr-defined]


class Frame(msgspec.Struct, frozen=True, gc=False):
    """One item of the history handed to the model; rejections may be compacted.

    ``kind`` is one of ``rejected``, ``tool_result``, ``tool_failed``,
    ``transitioned``, ``breaker``, ``resumed``.
    """

    kind: str
    seq: int
    text: str
    count: int = 1
    """How many consecutive identical rejections this frame stands for."""
    first_seq: int = 0
    violations: tuple[Violation, ...] = ()

    @property
    def compacted(self) -> bool:
        return self.count > 1


def violation_signature(violations: Iterable[Violation]) -> int:
    """Hash of the codes and paths of ``violations``: equal for 'the same mistake again'."""
    text = "|".join(f"{v.code}:{v.path}" for v in violations)
    return hash64(text.encode()) or 1


#: The data of every run that has none (see RunState.data): never changed in place.
_NO_DATA: dict[str, Any] = {}

#: The turns of every run that has none (see RunState.turns): never appended to.
_NO_TURNS: list[tuple[int, str, tuple[tuple[str, str], ...]]] = []


class RunState:
    """Everything the supervisor knows of one run; rebuilt by folding its events.

    The pure-Python twin (``PyRunState``) of the compiled ``interlock.core._decide.RunState``,
    which has the same attributes (its counters, seq and clock readings typed) and the
    same :meth:`apply`; ``RunState`` is the one :data:`DECIDE_IMPLEMENTATION` names.

    Mutated only by :meth:`apply`, so that a live run and a run folded from the
    journal after a crash are the same object state. The exceptions are the caches
    (``_hash_state``): derived from that state, each
    checked against it before use, so a folded run simply starts them empty.
    """

    __slots__ = (
        "_committed_calls",
        "_data_version",
        "_final_delta",
        "_hash_state",
        "_repeats",
        "closed",
        "consecutive_failures",
        "data",
        "doubts",
        "escalation",
        "external",
        "history",
        "inputs",
        "last_ts",
        "machine",
        "output",
        "pending",
        "previous",
        "prompt",
        "prompt_seq",
        "proposal_raw",
        "provider_failures",
        "provider_failures_since",
        "results",
        "run_id",
        "seq",
        "signatures",
        "started_ts",
        "state",
        "steps",
        "tokens",
        "turns",
        "validated",
    )

    def __init__(self, run_id: str, machine: Machine) -> None:
        self.run_id = run_id
        self.machine = machine
        self.state = ""
        self.seq = 0
        self.inputs: dict[str, Any] = {}
        self.data: dict[str, Any] = _NO_DATA
        """Shared by every run without data until its first transition that has some:
        never changed in place then (see apply)."""
        self.started_ts = 0.0
        self.last_ts = 0.0
        self.tokens = 0
        self.steps = 0
        self.consecutive_failures = 0
        self._repeats: array[int] | None = None
        """The repeat breaker's hash of each call the run intended, in order (a run that
        has made none holds None): 8 bytes a call where a dict of counts held ~70."""
        self._committed_calls: array[int] | None = None
        """The repeat hash of each call the run committed, in order (None before the
        first): the gate refuses a side-effecting call identical to one of them. Kept
        across a resume (what was applied stays applied), unlike ``_repeats``."""
        self.history: list[Frame] = []
        self.signatures: list[int] = []
        """The repeat signature of each history item (0 for one that is not a rejection),
        up to the latest rejection: the items after it are 0, and not held (see _push)."""
        self.results: list[ToolResult] = []
        self.pending: IntentRecorded | None = None
        self.validated: Any = None
        """The pending call's args as the guards saw them, when it was decided in this
        process (the tool runs on those); None once folded from the journal."""
        self.doubts = 0
        self.external = False
        """The caller drives this run (``run_started.external``): no actor runs it."""
        """How many times the pending call was found in doubt (``tool_in_doubt``)."""
        self.provider_failures = 0
        """Failed model calls in a row (``provider_failed`` since the last ``model_called``)."""
        self.provider_failures_since = 0.0
        """When the first of those failed (its event's ts)."""
        self.proposal_raw = ""
        """The raw text of the proposal just journaled, until the decision on it is: a
        transition whose delta is that proposal's data refers to it (store once)."""
        self._final_delta: dict[str, Any] | None = None
        """The delta of a transition into a success state, for its ``completed`` event."""
        self.escalation: Escalated | None = None
        self.output: Any = None
        self.previous = ""
        """The state before the latest transition."""
        self.closed = False
        """True once the run's terminal event (completed, escalated, failed) is journaled."""
        self.prompt = ""
        """The whole prompt of the run's latest model call (the base of the next one's delta)."""
        self.prompt_seq = 0
        """The seq of the run's latest model call; 0 before the first."""
        self.turns: list[tuple[int, str, tuple[tuple[str, str], ...]]] = _NO_TURNS
        """The model calls whose response was journaled (HTTP providers): ``(seq, raw,
        extra_calls)``, so a provider can rebuild the conversation from the run alone.
        Empty for providers that journal no response (nothing is kept for them: the
        empty list is one shared by every run until its first turn, never appended to)."""
        self._hash_state: PromptHashState | None = None
        """For the supervisor: the SHA-256 state of ``prompt`` part-way (hash_prompt_after)."""
        self._data_version = 0
        """Counts the changes to ``data`` (render_prompt's head shows it)."""

    @property
    def terminal(self) -> bool:
        return self.machine.is_terminal(self.state)

    @property
    def committed(self) -> dict[str, Any]:
        """Every committed call's result by idempotency key (built from ``results`` on each read)."""
        return {done.key: done.result for done in self.results}

    def repeats_of(self, call_hash: int) -> int:
        """How many times the run intended the call whose repeat hash is ``call_hash``
        (since it was last resumed)."""
        repeats = self._repeats
        return 0 if repeats is None else repeats.count(call_hash)

    def committed_before(self, call_hash: int) -> bool:
        """Whether the run committed a call whose repeat hash is ``call_hash``."""
        done = self._committed_calls
        return done is not None and call_hash in done

    @property
    def repeat_counts(self) -> dict[int, int]:
        """The repeat breaker's counts by call hash (built from the run's calls on each read)."""
        return dict(Counter(self._repeats)) if self._repeats is not None else {}

    def _commit_call(self, intent: IntentRecorded) -> None:
        """Add the repeat hash of ``intent``, the call just committed, to the committed calls."""
        repeats = self._repeats
        # The pending intent's hash is the last one intended: nothing intends a call
        # while one is pending, and a resume (which clears _repeats) needs none pending.
        call = repeats[-1] if repeats else _call_hash(intent.tool, intent.args)
        if self._committed_calls is None:
            self._committed_calls = array("Q")
        self._committed_calls.append(call)

    def _push(self, frame: Frame, signature: int = 0) -> None:
        history = self.history
        history.append(frame)
        if signature:
            signatures = self.signatures
            missing = len(history) - 1 - len(signatures)
            if missing:
                signatures.extend([0] * missing)
            signatures.append(signature)

    def apply(
        self,
        event: Event,
        call_hash: int = 0,
        prompt: str | None = None,
        *,
        validated: Any = None,
    ) -> None:
        """Fold one event into the state.

        What the supervisor already has when it emits an event it passes along, so that
        the live path does not derive it again; a fold from the journal derives it.

        Args:
          event: the run's next event.
          call_hash: for an ``intent_recorded`` event, the repeat breaker's hash of the call
            (the gate computed it); 0 computes it here.
          prompt: for a ``model_called`` event, its whole prompt (what the provider was
            given); None rebuilds it from the event's delta.
          validated: for an ``intent_recorded`` event, the args the gate validated.

        Raises:
          JournalInconsistent: if the event is out of order for this run.
        """
        if event.seq != self.seq + 1:
            raise JournalInconsistent(
                f"run {self.run_id!r}: event seq {event.seq} does not follow {self.seq}; "
                "the journal is missing or repeating events"
            )
        self.seq = event.seq
        self.last_ts = event.ts
        match event:
            case ModelCalled(usage=usage):
                self.tokens += usage.prompt + usage.completion
                self.steps += 1
                self.provider_failures = 0
                self.proposal_raw = event.raw
                if prompt is None:
                    try:
                        prompt = expand_prompt(self.prompt_seq, self.prompt, event)
                    except ValueError as exc:
                        raise JournalInconsistent(str(exc)) from None
                self.prompt = prompt
                self.prompt_seq = event.seq
                if event.response is not msgspec.UNSET:
                    extra = event.extra_calls
                    if self.turns is _NO_TURNS:
                        self.turns = []
                    self.turns.append(
                        (event.seq, event.raw, () if extra is msgspec.UNSET else extra)
                    )
            case StepProposed(source=source):
                if source != "operator":
                    self.steps += 1
                self.proposal_raw = event.raw
            case ProposalRejected(violations=violations):
                self.proposal_raw = ""
                self.consecutive_failures += 1
                text = "; ".join(v.message for v in violations)
                self._push(
                    Frame("rejected", event.seq, text, violations=violations, first_seq=event.seq),
                    violation_signature(violations),
                )
            case IntentRecorded():
                self.proposal_raw = ""
                self.pending = event
                self.validated = validated
                self.doubts = 0
                call = call_hash or _call_hash(event.tool, event.args)
                if self._repeats is None:
                    self._repeats = array("Q")
                self._repeats.append(call)
            case ToolCommitted(key=key, result=result):
                intent = self.pending
                self.pending = None
                self.validated = None
                self.consecutive_failures = 0
                args = intent.args if intent is not None and intent.key == key else {}
                if intent is not None and intent.key == key:
                    self._commit_call(intent)
                args_json, result_json = _json(args), _json(result)
                text = f"{event.tool}({_cut(args_json)}) -> {_cut(result_json)}"
                state = self.state
                if intent is not None and intent.state != state:
                    state = intent.state
                self.results.append(
                    ToolResult._in_frame(
                        event.tool,
                        args,
                        result,
                        key,
                        event.seq,
                        text,
                        args_json,
                        result_json,
                        self.run_id,
                        state,
                        intent.seq if intent is not None else 0,
                    )
                )
                self._push(Frame("tool_result", event.seq, text, first_seq=event.seq))
            case ToolFailed(error=error):
                self.pending = None
                self.validated = None
                self.consecutive_failures += 1
                self._push(
                    Frame(
                        "tool_failed",
                        event.seq,
                        f"{event.tool} failed: {error}",
                        first_seq=event.seq,
                    )
                )
            case Transitioned(src=src, dst=dst, delta=delta):
                if event.delta_in_proposal:
                    delta = proposal_data(self.run_id, event.seq, self.proposal_raw)
                self.proposal_raw = ""
                if dst in self.machine.success_states:
                    self._final_delta = delta
                self.previous = src
                self.state = dst
                self.consecutive_failures = 0
                if delta:
                    if self.data is _NO_DATA:
                        self.data = {}
                    self.data.update(delta)
                    self._data_version += 1
                self._push(Frame("transitioned", event.seq, f"{src} -> {dst}", first_seq=event.seq))
            case BreakerTripped(breaker=breaker, detail=detail):
                self._push(
                    Frame("breaker", event.seq, f"breaker {breaker}: {detail}", first_seq=event.seq)
                )
            case Escalated():
                self.escalation = event
                self.closed = True
            case Resumed(note=note, by=by):
                self.escalation = None
                self.closed = False
                self.consecutive_failures = 0
                self._repeats = None
                self._push(
                    Frame(
                        "resumed",
                        event.seq,
                        f"resumed by {by}: {note}".rstrip(": "),
                        first_seq=event.seq,
                    )
                )
            case Completed(output=output):
                self.output = self._final_delta or None if event.output_in_delta else output
                self._final_delta = None
                self.closed = True
            case ToolInDoubt():
                self.doubts += 1
            case Reconciled():
                pass  # the call stays pending: a commit, an execution or an escalation follows
            case ProviderFailed():
                if not self.provider_failures:
                    self.provider_failures_since = event.ts
                self.provider_failures += 1
            case Failed(reason=reason):
                self.output = {"reason": reason}
                self.closed = True
            case RunStarted(state=state, inputs=inputs):
                self.external = event.external is True
                self.state = state
                # The event's own dict (fresh from check_inputs or the journal; nothing
                # changes it): a copy would be one more dict per live run.
                self.inputs = inputs if type(inputs) is dict else dict(inputs)
                self.started_ts = event.ts
            case _:  # pragma: no cover - the union is closed
                raise JournalInconsistent(f"unknown event {event!r}")


class _ProposalData(msgspec.Struct):
    data: dict[str, Any] = {}


_proposal_data_decoder = msgspec.json.Decoder(_ProposalData)


def proposal_data(run_id: str, seq: int, raw: str) -> dict[str, Any]:
    """The ``data`` of the proposal ``raw``: a ``transitioned`` event with
    ``delta_in_proposal`` refers to it instead of holding a second copy.

    Raises:
      JournalInconsistent: ``raw`` has no such data (the journal is damaged or out of order).
    """
    try:
        return _proposal_data_decoder.decode(raw).data
    except msgspec.DecodeError:
        raise JournalInconsistent(
            f"run {run_id!r}: transitioned {seq} takes its delta from the proposal before it, "
            "which holds no data object; the journal is damaged or out of order"
        ) from None


def fold(machine: Machine, events: Iterable[Event]) -> RunState:
    """Rebuild a run's state from its journal events, in seq order."""
    run: RunState | None = None
    for event in events:
        if run is None:
            if not isinstance(event, RunStarted):
                raise JournalInconsistent(
                    f"run {event.run_id!r}: journal starts with {type(event).__name__}, not run_started"
                )
            run = RunState(event.run_id, machine)
        run.apply(event)
    if run is None:
        raise JournalInconsistent("cannot fold an empty journal")
    return run


#: The encoder of canonical_args; the gate hashes with it directly.
canonical_encoder = msgspec.msgpack.Encoder(order="sorted")


def canonical_args(args: Any) -> bytes:
    """The args as msgpack with sorted keys (and Struct fields): equal calls give equal
    bytes, whether the args are a validated Struct or its builtins. msgpack rather than
    JSON: a float is copied, not formatted, so the repeat hash costs less per proposal."""
    return canonical_encoder.encode(args)


def _call_hash(tool: str, args: Any) -> int:
    return proposal_hash(tool.encode(), canonical_args(args))


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _cut(text: str, limit: int = _SHORT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any, limit: int = _SHORT) -> str:
    return _cut(_json(value), limit)


class RunView:
    """A read-only view of a run, for guards, steps and providers. Cheap to make.

    Reading a view never changes the run. A view may remember what rendering the run's
    prompt produced (``render_prompt``), so the actor keeps one view for a run's life.
    """

    __slots__ = ("_compacted", "_memo", "_rendered", "_run")

    def __init__(self, run: RunState) -> None:
        self._run = run
        self._memo: dict[Any, Any] | None = None
        """For providers: what they derived from the run so far (see providers._wire)."""
        self._compacted: tuple[int, tuple[Frame, ...], int] = (0, (), 0)
        """For history: the run's history size then, its frames, and the index of the
        first item of the last frame's group (the one part that can still change)."""
        self._rendered: tuple[int, str, int, str, int] = (0, "", 0, "", 0)
        """For render_prompt: how many compacted frames it rendered last, the prompt it
        returned, where in it the text of all of them but the last one ends, and the
        state and data version its head shows."""

    @property
    def run_id(self) -> str:
        return self._run.run_id

    @property
    def definition(self) -> Machine:
        """The machine the run follows: its states, tools, budgets and policies."""
        return self._run.machine

    @property
    def machine(self) -> str:
        return self._run.machine.name

    @property
    def state(self) -> str:
        return self._run.state

    @property
    def seq(self) -> int:
        """The seq of the run's last journal event."""
        return self._run.seq

    # NOTE: a read-only proxy made on each read, not kept by the run: two proxies per
    # live run cost more memory than making one costs time (tens of ns per guard).
    @property
    def inputs(self) -> Mapping[str, Any]:
        return MappingProxyType(self._run.inputs)

    @property
    def data(self) -> Mapping[str, Any]:
        """The run's data: what transitions carried (``Go.data``), merged in order."""
        return MappingProxyType(self._run.data)

    @property
    def tokens(self) -> int:
        return self._run.tokens

    @property
    def steps(self) -> int:
        return self._run.steps

    @property
    def results(self) -> tuple[ToolResult, ...]:
        """Every committed tool call of the run, oldest first."""
        return tuple(self._run.results)

    def results_of(self, tool: str) -> list[ToolResult]:
        """The committed calls of ``tool``, oldest first."""
        return [r for r in self._run.results if r.tool == tool]

    def last_result(self, tool: str) -> Any:
        """The result of the latest committed call of ``tool``, or None."""
        for item in reversed(self._run.results):
            if item.tool == tool:
                return item.result
        return None

    @property
    def history(self) -> tuple[Frame, ...]:
        """The run's history as the model sees it: identical rejections compacted."""
        return self._compact()

    def _compact(self) -> tuple[Frame, ...]:
        """The history with runs of identical rejections collapsed into one frame each."""
        run = self._run
        size = len(run.history)
        cached_size, cached, start = self._compacted
        if cached_size == size:
            return cached
        # The history only grows, and a new item can join only the last group: the
        # frames before it stay. Compacting from that group's first item on keeps a
        # step's work O(new items), not O(history).
        history = run.history
        frames: list[Frame] = []
        signatures = run.signatures  # the zeros after the latest rejection are not held
        held = len(signatures)
        if held >= size:
            part = signatures[start:]
        elif start >= held:
            part = [0] * (size - start)
        else:
            part = signatures[start:] + [0] * (size - held)
        for first, last, count in compact_failures(part):
            frame = history[start + last]
            if count > 1:
                frame = Frame(
                    frame.kind,
                    frame.seq,
                    f"{count} attempts rejected: {frame.text}",
                    count=count,
                    first_seq=history[start + first].seq,
                    violations=frame.violations,
                )
            frames.append(frame)
            group = start + first
        result = cached[:-1] + tuple(frames) if cached else tuple(frames)
        self._compacted = (size, result, group)
        return result

    @property
    def last_violations(self) -> tuple[Violation, ...]:
        """The violations of the latest rejection, if the latest history item is one."""
        if self._run.history and self._run.history[-1].kind == "rejected":
            return self._run.history[-1].violations
        return ()

    @property
    def instructions(self) -> str:
        """What the model is told to do in the current state ('' for a step state)."""
        return str(getattr(self._run.machine.states.get(self._run.state), "instructions", ""))

    def tool_schema(self, tool: str) -> dict[str, Any]:
        """The JSON Schema of ``tool``'s args."""
        return self._run.machine.tool_by_name[tool].validator.json_schema()

    @property
    def data_schema(self) -> dict[str, Any] | None:
        """The JSON Schema the ``data`` of a move from the current state must match (the
        state's ``Worker(data=...)``, for every move out of it); None when any JSON object
        will do."""
        validator = self._run.machine.data_validators.get(self._run.state)
        return None if validator is None else validator.json_schema()

    def tool_description(self, tool: str) -> str:
        return self._run.machine.tool_by_name[tool].description

    @property
    def all_states(self) -> tuple[str, ...]:
        return tuple(self._run.machine.tables.states)

    @property
    def allowed_tools(self) -> tuple[str, ...]:
        tables = self._run.machine.tables
        return tables.allowed_tools(tables.state_id(self._run.state))

    @property
    def legal_next(self) -> tuple[str, ...]:
        tables = self._run.machine.tables
        return tables.legal_next(tables.state_id(self._run.state))


# -- the implementation ---------------------------------------------------------------------

#: The pure-Python run state: the twin of the compiled one (``tests/hot/test_decide.py``).
PyRunState = RunState

#: Which run state and decide path are in use: ``compiled`` (``interlock.core._decide``, built
#: from ext/_decide.pyx) or ``python`` (``PyRunState`` and the decider's own paths).
DECIDE_IMPLEMENTATION = "python"

if not NO_EXTENSIONS:
    try:
        from . import _decide
    except ImportError:  # pragma: no cover - only a broken install gets here
        pass
    else:
        # (its fold's helpers, this module's, are given to it by _decider: see Collaborators)
        RunState = _decide.RunState  # type: ignore[misc,assignment]
        DECIDE_IMPLEMENTATION = "compiled"
