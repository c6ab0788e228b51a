"""The verification gate: parse -> transition / tool allowed -> schema -> guards -> breakers.

Pure and deterministic: a decision depends only on the machine, the run's state,
the raw proposal, the clock reading passed in and the shared circuit board. It
never raises for bad input; it returns violations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ._breakers import Trip, check_budgets, check_repeat
from ._events import Violation
from ._hotpath import OK, UNKNOWN_STATE, UNKNOWN_TOOL, proposal_hash
from ._view import RunView, canonical_args

if TYPE_CHECKING:
    from ._breakers import CircuitBoard
    from ._machine import Machine
    from ._tools import Tool
    from ._view import RunState

_EMPTY_OBJECT = msgspec.Raw(b"{}")
_SHAPE_HINT = (
    'send exactly one JSON object: {"tool": NAME, "args": {...}} to call a tool, or '
    '{"next": STATE, "data": {...}} to move on; no Markdown fences, no trailing commas'
)


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    tool: str | None = None
    args: msgspec.Raw = _EMPTY_OBJECT
    next: str | None = None
    data: msgspec.Raw = _EMPTY_OBJECT


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_dict_decoder = msgspec.json.Decoder(dict[str, Any])


class Decision:
    """The gate's answer to one proposal.

    Attributes:
      violations: empty when accepted.
      trip: the breaker the proposal tripped, if any (its violation is in ``violations``).
      tool: the tool to call, for an accepted call.
      args: the call's args as JSON builtins, for an accepted call.
      target: the state to move to, for an accepted transition.
      data: the transition's data, for an accepted transition.
      call_hash: the repeat breaker's hash of the call.
    """

    __slots__ = ("args", "call_hash", "data", "target", "tool", "trip", "violations")

    def __init__(self) -> None:
        self.violations: tuple[Violation, ...] = ()
        self.trip: Trip | None = None
        self.tool: Tool | None = None
        self.args: dict[str, Any] = {}
        self.target = ""
        self.data: dict[str, Any] = {}
        self.call_hash = 0

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

    Args:
      machine: the run's machine.
      run: the run's folded state (budgets count the model call being verified).
      raw: the proposal exactly as the provider (or a step) produced it.
      now: the clock reading recorded for this proposal, in seconds.
      circuits: the shared per-tool circuits; None skips the circuit check.

    Returns:
      A :class:`Decision`; never raises for bad input.
    """
    decision = Decision()
    budget = check_budgets(run, machine.budgets, now)
    if budget is not None:
        decision.trip = budget[1]
        return _reject(decision, budget[0])
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
    except msgspec.DecodeError as exc:
        return _reject(
            decision, Violation("malformed", "$", f"proposal is not valid JSON: {exc}", _SHAPE_HINT)
        )
    if (envelope.tool is None) == (envelope.next is None):
        which = "both" if envelope.tool is not None else "neither"
        return _reject(
            decision,
            Violation(
                "malformed",
                "$",
                f'proposal has {which} of "tool" and "next"; it needs exactly one',
                _SHAPE_HINT,
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
    tables = machine.tables
    name = envelope.tool
    assert name is not None
    code = tables.check_tool(state_id, tables.tool_id(name))
    if code != OK:
        allowed = ", ".join(tables.allowed_tools(state_id)) or "none"
        if code == UNKNOWN_TOOL:
            return _reject(
                decision,
                Violation(
                    "unknown_tool",
                    "tool",
                    f"tool {name!r} does not exist; tools allowed in state {run.state!r}: {allowed}",
                    f"call one of: {allowed}"
                    if allowed != "none"
                    else _next_hint(machine, state_id),
                ),
            )
        return _reject(
            decision,
            Violation(
                "tool_not_allowed",
                "tool",
                f"tool {name!r} is not allowed in state {run.state!r}; allowed here: {allowed}",
                f"call one of: {allowed}" if allowed != "none" else _next_hint(machine, state_id),
            ),
        )
    tool = machine.tool_by_name[name]
    validator = tool.validator
    args, violations = validator.validate_json(envelope.args)
    if violations:
        return _reject(decision, *violations)
    if tool.guards:
        view = RunView(run)
        guard_violations = []
        for guard in tool.guards:
            try:
                rejected = guard(args, view)
            except Exception as exc:
                guard_violations.append(
                    Violation(
                        "guard",
                        "args",
                        f"guard {getattr(guard, '__name__', guard)!r} of tool {name!r} raised "
                        f"{type(exc).__name__}: {exc}",
                        "the guard itself failed; this call cannot be verified",
                    )
                )
                continue
            if rejected is not None:
                guard_violations.append(
                    Violation("guard", rejected.path, rejected.message, rejected.hint)
                )
        if guard_violations:
            return _reject(decision, *guard_violations)
    builtins = validator.to_builtins(args)
    canonical = canonical_args(builtins)
    call_hash = proposal_hash(name.encode(), canonical)
    repeat = check_repeat(run, name, call_hash, machine.breakers, canonical.decode())
    if repeat is not None:
        decision.trip = repeat[1]
        return _reject(decision, repeat[0])
    if circuits is not None:
        circuit = circuits.check(name, now, machine.breakers)
        if circuit is not None:
            decision.trip = circuit[1]
            return _reject(decision, circuit[0])
    decision.tool = tool
    decision.args = builtins
    decision.call_hash = call_hash
    return decision


def _next_hint(machine: Machine, state_id: int) -> str:
    legal = ", ".join(machine.tables.legal_next(state_id)) or "none"
    return f"no tools are allowed here; move on with next: one of {legal}"


def _verify_transition(
    machine: Machine, run: RunState, envelope: _Envelope, decision: Decision, state_id: int
) -> Decision:
    tables = machine.tables
    target = envelope.next
    assert target is not None
    code = tables.check_transition(state_id, tables.state_id(target))
    if code != OK:
        legal = ", ".join(tables.legal_next(state_id)) or "none"
        if code == UNKNOWN_STATE:
            message = (
                f"state {target!r} does not exist; legal next states from {run.state!r}: {legal}"
            )
        else:
            message = (
                f"transition {run.state} -> {target} is not allowed; legal next states from "
                f"{run.state!r}: {legal}"
            )
        return _reject(
            decision,
            Violation("illegal_transition", "next", message, f"propose next: one of {legal}"),
        )
    validator = machine.data_validators.get(run.state)
    if validator is not None:
        data, violations = validator.validate_json(envelope.data)
        if violations:
            return _reject(
                decision,
                *(
                    Violation(
                        v.code,
                        v.path.replace("args", "data", 1),
                        v.message.replace("args", "data", 1),
                        v.hint.replace("args", "data"),
                    )
                    for v in violations
                ),
            )
        decision.data = validator.to_builtins(data)
    else:
        try:
            decision.data = _dict_decoder.decode(envelope.data)
        except msgspec.ValidationError as exc:
            return _reject(
                decision,
                Violation(
                    "schema", "data", f"data: {exc}", "send data as a JSON object, or leave it out"
                ),
            )
    decision.target = target
    return decision
