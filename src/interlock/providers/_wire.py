"""What every HTTP provider shares: the machine's state as tools, the run's history as a
conversation, a native tool call as a proposal, and the envelope checks.

Nothing here knows a wire format; ``_openai`` and ``_anthropic`` turn these neutral
pieces into request bodies and read the responses back.

A tool call becomes a proposal byte for byte: ``{"tool":NAME,"args":ARGUMENTS}`` with the
model's ``arguments`` text spliced in unchanged, so the gate judges exactly what the model
sent (duplicate keys, the size cap, the schema). A call of the ``transition`` tool is its
arguments alone, ``{"next": ..., "data": ...}``, which is already a move.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from .._events import Violation
from .._exceptions import MachineDefinitionError

if TYPE_CHECKING:
    from .._machine import Machine
    from .._view import RunView

#: The default name of the tool that moves the run to its next state.
TRANSITION = "transition"

_encode = msgspec.json.encode
_TOOL_PREFIX = b'{"tool":'
_ARGS = ',"args":'


@dataclass(frozen=True)
class ToolSpec:
    """One tool offered to the model: its name, what it does, its JSON Schema."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Exchange:
    """One step of the conversation as the model sees it.

    ``call``: the assistant's call ``(id, name, arguments)``, or None when the step has
    no call of its own (a note from the runtime: a breaker, an operator, a step state,
    or a reply that held no call). ``reply``: the tool result (or the note) text;
    ``error``: whether it reports a failure. ``extra``: further calls in the same turn,
    ``(id, name, arguments)``, each answered as not run.
    """

    call: tuple[str, str, str] | None
    reply: str
    error: bool = False
    extra: tuple[tuple[str, str, str], ...] = ()


ONE_CALL = (
    "not run: one call per turn is allowed; this call was ignored. "
    "Call it again in a turn of its own if it is still needed"
)


# -- the state as tools ---------------------------------------------------------------------

_SPECS: weakref.WeakKeyDictionary[Machine, dict[tuple[str, str, bool], tuple[ToolSpec, ...]]] = (
    weakref.WeakKeyDictionary()
)


def tool_specs(
    view: RunView, transition: str = TRANSITION, strict: bool = False
) -> tuple[ToolSpec, ...]:
    """The tools of the run's current state, plus ``transition`` to its legal next states.

    Made once per machine and state (a step asks for them again and again).
    """
    machine = view.definition
    cache = _SPECS.get(machine)
    if cache is None:
        cache = _SPECS.setdefault(machine, {})
    key = (view.state, transition, strict)
    specs = cache.get(key)
    if specs is None:
        specs = cache[key] = _build_specs(machine, view.state, transition, strict)
    return specs


def _build_specs(
    machine: Machine, state: str, transition: str, strict: bool
) -> tuple[ToolSpec, ...]:
    tables = machine.tables
    sid = tables.state_id(state)
    specs = []
    for name in tables.allowed_tools(sid):
        tool = machine.tool_by_name[name]
        schema = tool.validator.json_schema()
        if strict:
            schema = strict_schema(schema, f"tool {name!r} of machine {machine.name!r}")
        specs.append(ToolSpec(name, tool.description or name, schema))
    legal = list(tables.legal_next(sid))
    if legal:
        validator = machine.data_validators.get(state)
        data: dict[str, Any] = (
            validator.json_schema() if validator is not None else {"type": "object"}
        )
        if strict:
            data = (
                strict_schema(data, f"the data of state {state!r} of machine {machine.name!r}")
                if validator is not None
                else {
                    "type": "object",
                    "properties": {},
                    "required": [],
                    "additionalProperties": False,
                }
            )
        parameters = {
            "type": "object",
            "properties": {
                "next": {"type": "string", "enum": legal, "description": "the state to move to"},
                "data": data,
            },
            "required": ["next", "data"] if strict else ["next"],
            "additionalProperties": False,
        }
        specs.append(
            ToolSpec(
                transition,
                f"Move the run to its next state ({', '.join(legal)}), with data for it.",
                parameters,
            )
        )
    return tuple(specs)


def strict_schema(schema: dict[str, Any], what: str) -> dict[str, Any]:
    """``schema`` as OpenAI's strict mode takes it, or why it cannot be.

    Strict mode needs every object to list all its properties as required and to
    forbid others (``additionalProperties: false``).

    Raises:
      MachineDefinitionError: an object has an optional property or allows others.
    """
    _check_strict(schema, what, "$")
    return schema


def _check_strict(node: Any, what: str, path: str) -> None:
    if isinstance(node, list):
        for index, item in enumerate(node):
            _check_strict(item, what, f"{path}[{index}]")
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "object" or "properties" in node:
        properties = node.get("properties", {})
        missing = [name for name in properties if name not in node.get("required", [])]
        if missing:
            raise MachineDefinitionError(
                f"{what} cannot be strict: {path} has optional properties {missing}; strict "
                "mode needs every property required (give them no default), or pass strict=False"
            )
        if node.get("additionalProperties", True) is not False:
            raise MachineDefinitionError(
                f"{what} cannot be strict: {path} allows properties it does not name; strict "
                "mode needs additionalProperties false (forbid unknown fields), or pass "
                "strict=False"
            )
    for key, value in node.items():
        if isinstance(value, dict | list):
            _check_strict(value, what, f"{path}.{key}")


def check_machine(machine: Machine, transition: str, strict: bool) -> None:
    """Build every worker state's tools once, so a schema strict mode cannot take, or a
    tool named like the transition tool, is found when the machine is registered.

    Raises:
      MachineDefinitionError: naming the tool, the state and the fix.
    """
    from .._machine import Worker

    if transition in machine.tool_by_name:
        raise MachineDefinitionError(
            f"machine {machine.name!r} has a tool named {transition!r}, the name the provider "
            "gives the move to the next state; rename the tool or pass transition_tool=..."
        )
    for state, spec in machine.states.items():
        if isinstance(spec, Worker):
            _build_specs(machine, state, transition, strict)


# -- the history as a conversation ----------------------------------------------------------


def system_text(view: RunView) -> str:
    """What the system message says: the task, the state, the run's inputs and data."""
    lines = [
        f"You drive one run of the state machine {view.machine!r}. It is in state {view.state!r}.",
    ]
    if view.instructions:
        lines.append(view.instructions)
    lines.append(f"Inputs: {_encode(dict(view.inputs)).decode()}")
    if view.data:
        lines.append(f"Data so far: {_encode(dict(view.data)).decode()}")
    legal = view.legal_next
    lines.append(
        "Call exactly one tool per turn. "
        + (
            f"To move on, call {TRANSITION!r} with next one of {', '.join(legal)}."
            if legal
            else "There is no next state from here."
        )
    )
    return "\n".join(lines)


def exchanges(view: RunView) -> list[Exchange]:
    """The run's history as steps of a conversation, oldest first.

    Each model call whose response was journaled is paired with what came of it (the
    first history frame after it): a rejection or a failure goes back as an error tool
    result with the violation's message and hint, a commit as the result, a move as its
    confirmation. Identical rejections in a row arrive compacted, as one step. What no
    call of the model caused (a breaker, an operator, a step state) is a note.
    """
    run = view._run
    turns = run.turns
    result: list[Exchange] = []
    position = 0
    for frame in view.history:
        turn = None
        # the latest model call before this frame that no earlier frame answered
        while position < len(turns) and turns[position][0] < frame.seq:
            turn = turns[position]
            position += 1
        text = frame.text
        for violation in frame.violations:
            if violation.hint:
                text += f"\nfix: {violation.hint}"
        error = frame.kind in ("rejected", "tool_failed", "breaker")
        call = None if turn is None else parse_raw(turn[1], turn[0])
        if call is None:
            result.append(Exchange(None, f"[{frame.kind}] {text}", error))
            continue
        extra = tuple(
            (f"{call[0]}_{index}", name, arguments)
            for index, (name, arguments) in enumerate(turn[2] if turn is not None else (), 1)
        )
        if frame.kind == "tool_result" and run.results:
            reply = _result_text(run, frame.seq)
        elif frame.kind == "transitioned":
            reply = f"moved: {text}"
        else:
            reply = text
        result.append(Exchange(call, reply, error, extra))
    return result


def _result_text(run: Any, seq: int) -> str:
    for done in reversed(run.results):
        if done.seq == seq:
            return _encode(done.result).decode()
    return ""


def parse_raw(raw: str, seq: int) -> tuple[str, str, str] | None:
    """The call ``(id, name, arguments)`` a proposal was made from (see :func:`to_raw`);
    None for a turn that held no call. Ids are made from the seq: stable, so a request's
    prefix stays the same from call to call (and provider caches hit)."""
    if not raw:
        return None
    call_id = f"call_{seq}"
    if raw.startswith('{"tool":'):
        at = raw.find(_ARGS)
        if at > 0:
            try:
                name = msgspec.json.decode(raw[8:at])
            except msgspec.DecodeError:
                return None
            if isinstance(name, str):
                return (call_id, name, raw[at + len(_ARGS) : -1])
        return None
    return (call_id, TRANSITION, raw)


def to_raw(name: str, arguments: str, transition: str = TRANSITION) -> tuple[str, Violation | None]:
    """The proposal a native call makes, or the violation that rules it out.

    A tool call splices ``arguments`` unchanged into ``{"tool":NAME,"args":...}``; the
    transition tool's arguments are the move itself. A transition whose arguments name a
    tool is refused (it would run the tool without calling it).
    """
    if name == transition:
        if '"tool"' in arguments or '"args"' in arguments:
            try:
                decoded = msgspec.json.decode(arguments)
            except msgspec.DecodeError:
                decoded = None
            if isinstance(decoded, dict) and ({"tool", "args"} & decoded.keys()):
                return "", Violation(
                    "envelope",
                    "$.transition",
                    f"the {transition!r} call's arguments name a tool: {arguments[:200]}",
                    f"to call a tool, call it by its name; {transition!r} takes next and data",
                )
        return arguments, None
    return f'{{"tool":{_encode(name).decode()},"args":{arguments}}}', None


def envelope(message: str, hint: str) -> Violation:
    """A violation found in the response's envelope, before the gate."""
    return Violation("envelope", "$", message, hint)


ONE_TOOL_HINT = "answer with exactly one tool call: a tool allowed here, or the transition"


def clip(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."
