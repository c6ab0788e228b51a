"""The verification gate: parse -> transition / tool allowed -> schema -> guards -> breakers.

A call identical (tool and canonical args) to one the run already committed is refused
after its schema and before its guards (code ``already_committed``), unless its tool is
read-only or declared ``Tool(repeatable=True)``: running it again would apply its side
effect a second time, under a second key.

In a ``Worker(call_and_move=True)`` state a proposal may both call a tool and name the
state to move to when the call succeeds; the call and the move then go through the same
stages together (tool allowed and transition legal, then the args' and the data's
schemas, then the call's guards and breakers), and the first stage with a violation
rejects the whole proposal.

Pure and deterministic: a decision depends only on the machine, the run's state,
the raw proposal, the clock reading passed in and the shared circuit board. It
never raises for bad input; it returns violations.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Union

import msgspec
import msgspec.structs

from . import _hotpath as hot
from ._breakers import CircuitBoard, Trip, check_budgets, check_repeat
from ._events import (
    ENCODING_ERRORS,
    Violation,
    describe_exception,
    unjournalable,
    unjournalable_violation,
)
from ._hotpath import OK, UNKNOWN_STATE, UNKNOWN_TOOL, hash64, scan_json

# NOTE: Tool at run time: Decision is a msgspec Struct, and help() / pydoc resolve a
# Struct's annotations (it used to fail with "name 'Tool' is not defined").
from ._tools import Reject, Tool, _MsgspecValidator
from ._view import RunView, _call_hash, _short, canonical_encoder

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._machine import Machine
    from ._view import RunState, ToolResult

#: The code of a call refused because the run already committed the same call.
ALREADY_COMMITTED = "already_committed"

_EMPTY_OBJECT = msgspec.Raw(b"{}")
_SHAPE_HINT = (
    'send exactly one JSON object: {"tool": NAME, "args": {...}} to call a tool, or '
    '{"next": STATE, "data": {...}} to move on; no Markdown fences, no trailing commas'
)
_MOVE_SHAPE_HINT = (
    'send exactly one JSON object: {"tool": NAME, "args": {...}} to call a tool, '
    '{"next": STATE, "data": {...}} to move on, or {"tool": NAME, "args": {...}, '
    '"next": STATE, "data": {...}} to call a tool and move on once it succeeds; '
    "no Markdown fences, no trailing commas"
)


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    tool: str | None = None
    args: msgspec.Raw = _EMPTY_OBJECT
    next: str | None = None
    data: msgspec.Raw = _EMPTY_OBJECT


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_dict_decoder = msgspec.json.Decoder(dict[str, Any])
_UNSET = msgspec.UNSET


class _Call:
    """What the gate needs of one tool, computed once per machine and state.

    ``seed`` is the hash of the tool's name, so that
    ``hash64(canonical, seed) == proposal_hash(name.encode(), canonical)``: the hash
    ``_view._call_hash`` recomputes from the journal.
    """

    __slots__ = ("guards", "name", "once", "plain", "seed", "to_builtins", "tool")

    def __init__(self, tool: Tool) -> None:
        self.tool = tool
        self.name = tool.name
        self.guards = tuple(tool.guards)
        # A side-effecting call: one identical to a call the run committed is refused.
        self.once: bool = not (tool.read_only or tool.repeatable)
        self.seed: int = hash64(tool.name.encode())
        validator = tool.validator
        # A plain Struct's fields are its builtins (see _tools.plain_struct): asdict
        # gives to_builtins' dict, and the sorted encoding of the Struct itself is
        # canonical_args of that dict, without going through it.
        self.plain = isinstance(validator, _MsgspecValidator) and validator.plain
        self.to_builtins: Callable[[Any], dict[str, Any]] = (
            msgspec.structs.asdict if self.plain else validator.to_builtins
        )


class _NoTool(msgspec.Struct, tag_field="tool", tag="", forbid_unknown_fields=True):
    """A union member no call decodes into on purpose ('' is no tool name).

    A lone tagged Struct would also decode an object without the tag; in a union
    of two the tag is required, as the envelope's exactly-one-of check wants.
    """

    args: msgspec.Raw = _EMPTY_OBJECT
    data: msgspec.Raw = _EMPTY_OBJECT
    next: None = None


class _Plan:
    """Per machine and state: the proposal cap, the single-decode path and the tools allowed there.

    ``decoder`` decodes a whole call proposal in one pass, through a tagged union of
    one envelope Struct per allowed tool whose schema is a msgspec Struct
    (``{"tool": NAME, "args": {...}}``, optional ``data``, ``next`` only as null, or as
    a string where ``moves``: the state allows call and move). It
    succeeds only on proposals the two-pass path accepts up to the guards and
    breakers, with the same args; anything it refuses goes through the two-pass
    path, which explains the rejection. None when no such tool is allowed.
    """

    __slots__ = ("by_name", "by_type", "decoder", "max_bytes", "moves")

    def __init__(self, machine: Machine, state: str) -> None:
        tables = machine.tables
        state_id = tables.state_id(state)
        spec = machine.states.get(state)
        cap = None if spec is None else spec.max_proposal_bytes
        self.max_bytes: int = machine.max_proposal_bytes if cap is None else cap
        self.moves: bool = bool(getattr(spec, "call_and_move", False))
        self.by_name: dict[str, _Call] = {}
        self.by_type: dict[type, _Call] = {}
        self.decoder: msgspec.json.Decoder[Any] | None = None
        if state_id < 0:
            return
        members: list[type] = []
        for name in tables.allowed_tools(state_id):
            tool = machine.tool_by_name[name]
            call = self.by_name[name] = _Call(tool)
            validator = tool.validator
            struct = validator.struct if isinstance(validator, _MsgspecValidator) else None
            if struct is None:
                continue
            try:
                envelope = msgspec.defstruct(
                    f"_Call_{len(members)}",
                    [
                        ("args", struct | msgspec.UnsetType, _UNSET),
                        ("data", msgspec.Raw, _EMPTY_OBJECT),
                        ("next", (str | None) if self.moves else None, None),
                    ],
                    tag_field="tool",
                    tag=name,
                    forbid_unknown_fields=True,
                )
            except Exception:  # pragma: no cover - then this tool takes the two-pass path
                continue
            members.append(envelope)
            self.by_type[envelope] = call
        if members:
            try:
                self.decoder = msgspec.json.Decoder(Union[(*members, _NoTool)])
            except Exception:  # pragma: no cover - then every call takes the two-pass path
                self.by_type.clear()


def _plan(machine: Machine, state: str) -> _Plan:
    plans = machine.gate_plans
    plan: _Plan | None = plans.get(state)
    if plan is None:
        plan = plans[state] = _Plan(machine, state)
    return plan


class Decision(msgspec.Struct, gc=False):
    """The gate's answer to one proposal.

    Attributes:
      violations: empty when accepted.
      trip: the breaker the proposal tripped, if any (its violation is in ``violations``).
      tool: the tool to call, for an accepted call.
      args: the call's args as JSON builtins, for an accepted call.
      target: the state to move to, for an accepted transition.
      data: the transition's data, for an accepted transition.
      call_hash: the repeat breaker's hash of the call.
      value: the call's validated args (what the guards saw), for an accepted call.
    """

    # A Struct rather than a plain class: one is made per proposal, and a Struct's
    # C-level __init__ costs less than half of a Python __init__ setting seven slots.
    violations: tuple[Violation, ...] = ()
    trip: Trip | None = None
    tool: Tool | None = None
    args: dict[str, Any] = {}
    target: str = ""
    data: dict[str, Any] = {}
    call_hash: int = 0
    value: Any = None

    @property
    def accepted(self) -> bool:
        return not self.violations


def _reject(decision: Decision, *violations: Violation) -> Decision:
    decision.violations = violations
    return decision


def verify(
    machine: Machine,
    run: RunState,
    raw: bytes,
    now: float,
    circuits: CircuitBoard | None = None,
) -> Decision:
    """Verify one proposal for ``run`` in its current state.

    In order: the run's budgets; the state's cap on the proposal's size, before any
    parsing; an exact reading of the bytes (one JSON value, no key named twice in an
    object); the envelope; the tool or transition; the schema; a side-effecting call
    the run already committed; the guards; the repeat breaker and the tool's circuit.
    The first failure is the answer.

    Args:
      machine: the run's machine.
      run: the run's folded state (budgets count the model call being verified).
      raw: the proposal exactly as the provider (or a step) produced it.
      now: the clock reading recorded for this proposal, in seconds.
      circuits: the shared per-tool circuits; None skips the circuit check.

    Returns:
      A :class:`Decision`; never raises for bad input.
    """
    budget = check_budgets(run, machine.budgets, now)
    if budget is not None:
        return Decision((budget[0],), budget[1])
    plan = machine.gate_plans.get(run.state) or _plan(machine, run.state)
    if len(raw) > plan.max_bytes:
        return Decision((_oversized(len(raw), plan.max_bytes, run.state),))
    try:
        # The single-decode path for a call; whatever it refuses, _verify explains. What
        # it accepts is read once more for what msgspec cannot see: a key named twice.
        decoder = plan.decoder
        if decoder is not None:
            try:
                envelope = decoder.decode(raw)
            except msgspec.DecodeError:
                pass
            else:
                call = plan.by_type.get(type(envelope))
                args = envelope.args
                if call is not None and args is not _UNSET and scan_json(raw) is None:
                    target = envelope.next
                    if target is None:
                        return _checked_call(machine, run, call, args, now, circuits)
                    # The call passed its first two stages; the move must pass them too.
                    state_id = machine.tables.state_id(run.state)
                    illegal = _illegal_move(machine, run, target, state_id)
                    if illegal is not None:
                        return Decision((illegal,))
                    data, violations = _move_data(machine, run, envelope.data)
                    if violations:
                        return Decision(violations)
                    return _moving(
                        _checked_call(machine, run, call, args, now, circuits), target, data
                    )
        return _verify(machine, run, raw, now, circuits)
    except RecursionError:
        # msgspec (and pydantic) decode nested JSON recursively; a proposal nested
        # thousands of levels deep exhausts the stack instead of failing to parse.
        return _reject(
            Decision(),
            Violation(
                "malformed",
                "$",
                "proposal is nested too deeply to parse (it exceeds the decoder's recursion limit)",
                _SHAPE_HINT,
            ),
        )


def _verify(
    machine: Machine,
    run: RunState,
    raw: bytes,
    now: float,
    circuits: CircuitBoard | None,
) -> Decision:
    """The two-pass path, within the budgets and the cap: the exact reading of the bytes,
    the envelope with raw args, then the args; every rejection."""
    decision = Decision()
    violation = json_defect(raw)
    if violation is not None:
        return _reject(decision, violation)
    tables = machine.tables
    state_id = tables.state_id(run.state)
    try:
        envelope = _envelope_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        text = str(exc)
        path = "$"
        if "unknown field `" in text:
            path = text.split("`")[1]
        return _reject(
            decision,
            Violation("malformed", path, f"proposal has the wrong shape: {text}", _SHAPE_HINT),
        )
    except msgspec.DecodeError as exc:  # pragma: no cover - scan_json refuses all msgspec does
        return _reject(
            decision, Violation("malformed", "$", f"proposal is not valid JSON: {exc}", _SHAPE_HINT)
        )
    moves = bool(getattr(machine.states.get(run.state), "call_and_move", False))
    if envelope.tool is not None and envelope.next is not None and moves:
        return _verify_call_and_move(machine, run, envelope, decision, state_id, now, circuits)
    if (envelope.tool is None) == (envelope.next is None):
        which = "both" if envelope.tool is not None else "neither"
        return _reject(
            decision,
            Violation(
                "malformed",
                "$",
                f'proposal has {which} of "tool" and "next"; it needs exactly one'
                + (" (or both, to call a tool and move on)" if moves else ""),
                _MOVE_SHAPE_HINT if moves else _SHAPE_HINT,
            ),
        )
    if envelope.tool is not None:
        return _verify_call(machine, run, envelope, decision, state_id, now, circuits)
    return _verify_transition(machine, run, envelope, decision, state_id)


def _verify_call(
    machine: Machine,
    run: RunState,
    envelope: _Envelope,
    decision: Decision,
    state_id: int,
    now: float,
    circuits: CircuitBoard | None,
) -> Decision:
    name = envelope.tool
    assert name is not None
    refused = _tool_refused(machine, run, name, state_id)
    if refused is not None:
        return _reject(decision, refused)
    call = _plan(machine, run.state).by_name[name]
    args, violations = call.tool.validator.validate_json(envelope.args)
    if violations:
        return _reject(decision, *violations)
    return _checked_call(machine, run, call, args, now, circuits)


def _tool_refused(machine: Machine, run: RunState, name: str, state_id: int) -> Violation | None:
    """Why ``name`` may not be called in the run's state, or None when it may."""
    tables = machine.tables
    code = tables.check_call(run.state, name)
    if code == OK:
        return None
    allowed = ", ".join(tables.allowed_tools(state_id)) or "none"
    hint = f"call one of: {allowed}" if allowed != "none" else _next_hint(machine, state_id)
    if code == UNKNOWN_TOOL:
        return Violation(
            "unknown_tool",
            "tool",
            f"tool {name!r} does not exist; tools allowed in state {run.state!r}: {allowed}",
            hint,
        )
    return Violation(
        "tool_not_allowed",
        "tool",
        f"tool {name!r} is not allowed in state {run.state!r}; allowed here: {allowed}",
        hint,
    )


def _verify_call_and_move(
    machine: Machine,
    run: RunState,
    envelope: _Envelope,
    decision: Decision,
    state_id: int,
    now: float,
    circuits: CircuitBoard | None,
) -> Decision:
    """A call that moves on when it succeeds: the call and the move, stage by stage.

    Stage one is the tool allowed here and the transition legal; stage two the args'
    schema and the data's; then the call's guards and breakers. The first stage with a
    violation rejects the proposal with every violation of that stage (the move's name
    ``next`` or ``data`` as their path), so nothing runs.
    """
    name, target = envelope.tool, envelope.next
    assert name is not None
    assert target is not None
    first = [
        v
        for v in (
            _tool_refused(machine, run, name, state_id),
            _illegal_move(machine, run, target, state_id),
        )
        if v is not None
    ]
    if first:
        return _reject(decision, *first)
    call = _plan(machine, run.state).by_name[name]
    args, violations = call.tool.validator.validate_json(envelope.args)
    data, data_violations = _move_data(machine, run, envelope.data)
    if violations or data_violations:
        return _reject(decision, *violations, *data_violations)
    return _moving(_checked_call(machine, run, call, args, now, circuits), target, data)


def _moving(decision: Decision, target: str, data: dict[str, Any]) -> Decision:
    """``decision`` on a call, with the move it makes once it succeeds (if accepted)."""
    if not decision.violations:
        decision.target = target
        decision.data = data
    return decision


_sorted_json = msgspec.json.Encoder(order="sorted")  # for the repeat breaker's message


def _checked_call(
    machine: Machine,
    run: RunState,
    call: _Call,
    args: Any,
    now: float,
    circuits: CircuitBoard | None,
) -> Decision:
    """On a call whose tool is allowed here and whose args are valid: the journal's
    encoding, a side effect already applied (the same call committed before), the
    guards, then the breakers."""
    name = call.name
    builtins = call.to_builtins(args)
    try:
        # The journal's encoding (msgpack), so it also refuses what the journal cannot hold.
        canonical = canonical_encoder.encode(args if call.plain else builtins)
    except ENCODING_ERRORS as exc:
        return Decision((unjournalable_violation("args", str(exc) or type(exc).__name__),))
    call_hash = hash64(canonical, call.seed)
    if call.once and run.committed_before(call_hash):
        done = _committed_call(run, name, call_hash)
        if done is not None:
            return Decision((_already_committed(name, done),))
    if call.guards:
        view = RunView(run)
        guard_violations: list[Violation] = []
        for guard in call.guards:
            try:
                rejected = guard(args, view)
            except INTERRUPTS:
                raise
            except BaseException as exc:  # the guard's failure (see INTERRUPTS)
                guard_violations.append(
                    _guard_failed(guard, name, f"raised {describe_exception(exc)}")
                )
                continue
            if isinstance(rejected, Reject):
                guard_violations.append(
                    Violation("guard", rejected.path, rejected.message, rejected.hint)
                )
            elif rejected is not None:
                returned = f"returned {type(rejected).__name__}, not a Reject or None"
                guard_violations.append(_guard_failed(guard, name, returned))
        if guard_violations:
            return Decision(tuple(guard_violations))
    policy = machine.breakers
    if run.repeats_of(call_hash) >= policy.repeats:
        # The message text (the args as JSON) is built only for a trip.
        text = _sorted_json.encode(args if call.plain else builtins).decode()
        repeat = check_repeat(run, name, call_hash, policy, text)
        if repeat is not None:
            return Decision((repeat[0],), repeat[1])
    if circuits is not None and (type(circuits) is not CircuitBoard or circuits._circuits):
        # A board without any circuit yet has every tool closed: nothing to check.
        circuit = circuits.check(name, now, policy)
        if circuit is not None:
            return Decision((circuit[0],), circuit[1])
    return Decision(tool=call.tool, args=builtins, call_hash=call_hash, value=args)


def _committed_call(run: RunState, tool: str, call_hash: int) -> ToolResult | None:
    """The run's first committed call of ``tool`` whose repeat hash is ``call_hash``."""
    for done in run.results:
        if done.tool == tool and _call_hash(tool, done.args) == call_hash:
            return done
    return None  # pragma: no cover - only a 64-bit hash collision gets here


def _already_committed(tool: str, done: ToolResult) -> Violation:
    """The refusal of a call identical to the committed call ``done``: running it again
    would apply its side effect twice (a second refund, a second email)."""
    return Violation(
        ALREADY_COMMITTED,
        "args",
        f"{tool} was already called with these args in this run: committed at seq "
        f"{done.seq} (key {done.key!r}) with result {_short(done.result)}; calling it "
        "again would apply it twice",
        f"use the result of seq {done.seq} instead of calling {tool} again, or move on",
    )


#: What a guard (or a step, or any code run while a request is decided) raises that is
#: not its failure: the interpreter's Ctrl-C and exit. Anything else it raises (an
#: ExceptionGroup, GeneratorExit, a BaseException of its own, even a trio.Cancelled: the
#: code is synchronous, so no cancellation reaches it) is its failure, and rejects the
#: call it guards (fails the step, ends the run), never the supervisor deciding it.
INTERRUPTS = (KeyboardInterrupt, SystemExit)


def _guard_failed(guard: Callable[..., Any], tool: str, what: str) -> Violation:
    return Violation(
        "guard",
        "args",
        f"guard {getattr(guard, '__name__', guard)!r} of tool {tool!r} {what}",
        "the guard itself failed; this call cannot be verified",
    )


def _next_hint(machine: Machine, state_id: int) -> str:
    legal = ", ".join(machine.tables.legal_next(state_id)) or "none"
    return f"no tools are allowed here; move on with next: one of {legal}"


def _verify_transition(
    machine: Machine, run: RunState, envelope: _Envelope, decision: Decision, state_id: int
) -> Decision:
    target = envelope.next
    assert target is not None
    illegal = _illegal_move(machine, run, target, state_id)
    if illegal is not None:
        return _reject(decision, illegal)
    data, violations = _move_data(machine, run, envelope.data)
    if violations:
        return _reject(decision, *violations)
    decision.data = data
    decision.target = target
    return decision


def _illegal_move(machine: Machine, run: RunState, target: str, state_id: int) -> Violation | None:
    """Why the run may not move to ``target`` from its state, or None when it may."""
    tables = machine.tables
    code = tables.check_transition(state_id, tables.state_id(target))
    if code == OK:
        return None
    legal = ", ".join(tables.legal_next(state_id)) or "none"
    if code == UNKNOWN_STATE:
        message = f"state {target!r} does not exist; legal next states from {run.state!r}: {legal}"
    else:
        message = (
            f"transition {run.state} -> {target} is not allowed; legal next states from "
            f"{run.state!r}: {legal}"
        )
    return Violation("illegal_transition", "next", message, f"propose next: one of {legal}")


def _move_data(
    machine: Machine, run: RunState, raw: msgspec.Raw
) -> tuple[dict[str, Any], tuple[Violation, ...]]:
    """A move's ``data`` as JSON builtins, checked against the state's data schema, or
    its violations (each with a path under ``data``)."""
    validator = machine.data_validators.get(run.state)
    if validator is not None:
        value, violations = validator.validate_json(raw)
        if violations:
            return {}, tuple(
                Violation(
                    v.code,
                    v.path.replace("args", "data", 1),
                    v.message.replace("args", "data", 1),
                    v.hint.replace("args", "data"),
                )
                for v in violations
            )
        data: dict[str, Any] = validator.to_builtins(value)
    else:
        try:
            data = _dict_decoder.decode(raw)
        except msgspec.ValidationError as exc:
            return {}, (
                Violation(
                    "schema", "data", f"data: {exc}", "send data as a JSON object, or leave it out"
                ),
            )
    problem = unjournalable(data, "data")
    if problem is not None:  # as for a call's args (see _checked_call)
        return {}, (unjournalable_violation("data", problem),)
    return data, ()


# -- what keeps a proposal from being read exactly ------------------------------------

_QUOTED = 40  # characters of the text quoted in a message, at most
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CUT_HINT = "send the whole {}, with every string, array and object closed"
_ARGS_HINT = (
    "send the args as exactly one JSON object, as the tool's parameters say; "
    "no Markdown fences, no trailing commas"
)
_SYNTAX: dict[int, tuple[str, str]] = {
    # code: (what is wrong at "byte N (in PATH)", the hint)
    hot.JSON_EXPECTED_VALUE: ("expected a value", _SHAPE_HINT),
    hot.JSON_EXPECTED_KEY: ("expected a key in double quotes", _SHAPE_HINT),
    hot.JSON_EXPECTED_COLON: ("expected ':' after the key", _SHAPE_HINT),
    hot.JSON_BAD_NUMBER: (
        "invalid number",
        "write numbers as JSON does (42, -0.5, 1e3): no leading zeros, '+' or bare '.'",
    ),
    hot.JSON_BAD_ESCAPE: (
        "invalid escape",
        'escape only \\" \\\\ \\/ \\b \\f \\n \\r \\t and \\uXXXX in a string',
    ),
    hot.JSON_LONE_SURROGATE: (
        "unpaired surrogate escape",
        "write the character itself, or a character past U+FFFF as a pair (\\ud83d\\ude00)",
    ),
    hot.JSON_BAD_UTF8: ("invalid UTF-8", "send the text encoded as UTF-8"),
    hot.JSON_CONTROL_CHARACTER: (
        "unescaped control character in a string",
        "escape control characters in strings: \\n for a newline, \\t for a tab",
    ),
}


def proposal_cap(machine: Machine, state: str) -> int:
    """The largest proposal, in bytes, the gate reads in ``state``."""
    plan = machine.gate_plans.get(state) or _plan(machine, state)
    return plan.max_bytes


def verify_unread(machine: Machine, run: RunState, size: int, now: float) -> Decision:
    """The gate's decision on a proposal of ``size`` bytes kept only as an excerpt (see
    ``Oversized``): what :func:`verify` decides before it reads a proposal, the budgets
    and the cap. Under a cap that now reaches ``size`` (replay with a changed machine) it
    cannot be read, and says so."""
    budget = check_budgets(run, machine.budgets, now)
    if budget is not None:
        return Decision((budget[0],), budget[1])
    cap = proposal_cap(machine, run.state)
    if size > cap:
        return Decision((_oversized(size, cap, run.state),))
    return Decision(
        (
            Violation(
                "malformed",
                "$",
                f"proposal is {size:,} bytes, kept only as an excerpt (it was over the cap "
                f"when it was made); it cannot be read under the cap of {cap:,} bytes "
                f"in state {run.state!r}",
                "replay it against the machine that recorded it",
            ),
        )
    )


def _oversized(size: int, cap: int, state: str) -> Violation:
    return Violation(
        "malformed",
        "$",
        f"proposal is {size:,} bytes, over the cap of {cap:,} bytes in state {state!r}; "
        "it was not read",
        f"send a proposal of at most {cap:,} bytes: leave out what this step does not need",
    )


#: The start of a provider's proposal for a native tool call (``providers._wire.to_raw``):
#: ``{"tool":NAME,"args":`` then the model's own arguments text, then ``}``.
_WRAPPER = re.compile(rb'\{"tool":"(?:[^"\\]|\\.)*","args":')


def json_defect(raw: bytes) -> Violation | None:
    """The violation for the first defect that keeps ``raw`` from reading as one JSON
    value (see ``scan_json``), or None when it reads as one.

    Offsets and quotes refer to the text its writer wrote. A proposal made of a native
    tool call (``{"tool":NAME,"args":ARGUMENTS}``, written without spaces, as a
    provider splices the model's arguments in) whose defect is past that start is
    described within ``ARGUMENTS``: "at byte 33 of args", counted from the first byte
    of the args, which is where that text starts whoever wrote the rest. One defect
    stays the whole proposal's: a key named twice at its top level (``"tool"`` again
    after the args), which no reading may hide.
    """
    defect = scan_json(raw)
    if defect is None:
        return None
    code, offset, path = defect
    wrapper = _WRAPPER.match(raw)
    if (
        wrapper is not None
        and raw[-1:] == b"}"
        and offset >= wrapper.end()
        and not (code == hot.JSON_DUPLICATE_KEY and len(path) == 1)
    ):
        text = raw[wrapper.end() : -1]
        inner = scan_json(text)
        if inner is not None:
            return _unreadable(text, inner[0], inner[1], ("args", *inner[2]), args=True)
    return _unreadable(raw, code, offset, path)


def _unreadable(
    raw: bytes, code: int, offset: int, path: tuple[str | int, ...], args: bool = False
) -> Violation:
    """The violation for the first defect ``scan_json`` found in ``raw``: the whole
    proposal, or (``args``) a call's args on their own, offsets counted from their start."""
    where = _where(path)
    if code == hot.JSON_DUPLICATE_KEY:
        key, inside = _key(path[-1]), _where(path[:-1])
        return Violation(
            "malformed",
            where,
            f"duplicate key {key} at {inside}: a JSON object may name each key once",
            f"send {key} once in {inside}, with the one value you mean",
        )
    subject, at = ("args", " of args") if args else ("proposal", "")
    hint = _ARGS_HINT if args else _SHAPE_HINT
    found = _quote(raw, offset)
    if code == hot.JSON_EMPTY:
        message = f"empty {subject}: {len(raw)} bytes of whitespace" if raw else f"empty {subject}"
    elif code == hot.JSON_TRUNCATED:
        message = (
            f"{subject} is cut off: the text ends at byte {offset}{at}, in {where}, "
            "before the JSON is complete"
        )
        hint = _CUT_HINT.format(subject)
    elif code == hot.JSON_TRAILING_TEXT:
        message = f"{subject} has text after its JSON value, at byte {offset}{at}: {found}"
    elif code == hot.JSON_EXPECTED_VALUE and not raw[:offset].strip():
        message = f"{subject} is not JSON: it starts with {found}"
    elif code == hot.JSON_TRAILING_COMMA:
        before = chr(raw[offset])
        message = (
            f"{subject} is not valid JSON: a trailing comma before {before!r} at byte "
            f"{offset}{at} (in {where})"
        )
    elif code == hot.JSON_EXPECTED_COMMA:
        close = "]" if type(path[-1]) is int else "}"
        message = (
            f"{subject} is not valid JSON: expected ',' or {close!r} after {where} "
            f"at byte {offset}{at}, found {found}"
        )
    else:
        what, syntax_hint = _SYNTAX[code]
        hint = syntax_hint if syntax_hint is not _SHAPE_HINT else hint
        message = f"{subject} is not valid JSON: {what} at byte {offset}{at} (in {where}): {found}"
    return Violation("malformed", "$", message, hint)


def _where(path: tuple[str | int, ...]) -> str:
    """``args.items[2].sku`` for a path of keys and indices; ``$`` for the whole proposal."""
    parts = []
    for part in path:
        if type(part) is int:
            parts.append(f"[{part}]")
        elif _IDENTIFIER.fullmatch(str(part)):
            parts.append(f".{part}")
        else:
            parts.append(f"[{_key(part)}]")
    return "".join(parts).removeprefix(".") or "$"


def _key(key: str | int) -> str:
    """A key as JSON writes it, cut to the first characters."""
    text = str(key)
    shown = msgspec.json.encode(text[:_QUOTED]).decode()
    return shown if len(text) <= _QUOTED else shown[:-1] + '..."'


def _quote(raw: bytes, offset: int) -> str:
    """The text from ``offset``, escaped and cut to the first characters."""
    text = raw[offset : offset + 4 * _QUOTED].decode(errors="backslashreplace")
    more = len(text) > _QUOTED or offset + 4 * _QUOTED < len(raw)
    return repr(text[:_QUOTED]) + ("..." if more else "")
