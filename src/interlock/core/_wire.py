"""What every HTTP provider shares: the machine's state as tools, the run's history as a
conversation, a native tool call as a proposal, and the envelope checks.

Nothing here knows a wire format; ``_openai`` and ``_anthropic`` turn these neutral
pieces into request bodies and read the responses back.

A tool call becomes a proposal byte for byte: ``{"tool":NAME,"args":ARGUMENTS}`` with the
model's ``arguments`` text spliced in unchanged, so the gate judges exactly what the model
sent (duplicate keys, the size cap, the schema). A call of the ``transition`` tool is its
arguments alone, ``{"next": ..., "data": ...}``, which is already a move.

In a ``Worker(call_and_move=True)`` state every tool also takes the optional parameters
``next`` (one of the legal next states) and, where the state has a data schema,
``next_data``: a call that sets ``next`` becomes ``{"tool":NAME,"next":...,"data":...,
"args":...}`` (see :func:`split_move`), one model call that both calls and moves. Strict
mode needs every parameter required, so there they are nullable, and null means "no move".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from ._events import TokenUsage, Violation
from ._exceptions import MachineDefinitionError
from ._gate import json_defect
from ._hotpath import scan_json

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._machine import Machine
    from ._view import RunView

#: The default name of the tool that moves the run to its next state.
TRANSITION = "transition"
#: The parameters a tool takes in a call-and-move state: the state to move to once the
#: call succeeds, and the data of that move (only where the state has a data schema).
MOVE_NEXT = "next"
MOVE_DATA = "next_data"

_encode = msgspec.json.encode
_TOOL_PREFIX = b'{"tool":'
_ARGS = ',"args":'


@dataclass(frozen=True)
class ToolSpec:
    """One tool offered to the model: its name, what it does, its JSON Schema."""

    name: str
    description: str
    parameters: dict[str, Any]


class Exchange(msgspec.Struct, frozen=True, gc=False):
    """One step of the conversation as the model sees it.

    ``call``: the assistant's call ``(id, name, arguments)``, or None when the step has
    no call of its own (a note from the runtime: a breaker, an operator, a step state,
    or a reply that held no call). ``reply``: the tool result (or the note) text;
    ``error``: whether it reports a failure. ``extra``: further calls in the same turn,
    ``(id, name, arguments)``, each answered as not run. The arguments of a call that
    was not run (rejected, or extra) are bounded (see :func:`excerpt`); an accepted
    call's are the model's, unchanged.
    """

    call: tuple[str, str, str] | None
    reply: str
    error: bool = False
    extra: tuple[tuple[str, str, str], ...] = ()
    # NOTE: a Struct, not a frozen dataclass: one is made per step of every run, and a
    # frozen dataclass's __init__ sets each field through object.__setattr__ (4x slower).


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
    legal = list(tables.legal_next(sid))
    validator = machine.data_validators.get(state)
    moves = bool(getattr(machine.states.get(state), "call_and_move", False))
    for name in tables.allowed_tools(sid):
        tool = machine.tool_by_name[name]
        schema = tool.validator.json_schema()
        what = f"tool {name!r} of machine {machine.name!r}"
        if strict:
            schema = strict_schema(schema, what)
        description = tool.description or name
        if moves and legal:
            move_data = None
            if validator is not None:
                move_data = validator.json_schema()
                if strict:
                    move_data = strict_schema(
                        move_data, f"the data of state {state!r} of machine {machine.name!r}"
                    )
            schema = _with_move(schema, legal, move_data, strict, f"{what} in state {state!r}")
            description += (
                f" Set {MOVE_NEXT} to move the run to that state once this call succeeds"
                " (no move if it fails)."
            )
        specs.append(ToolSpec(name, description, schema))
    if legal:
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


def _with_move(
    schema: dict[str, Any],
    legal: list[str],
    data: dict[str, Any] | None,
    strict: bool,
    what: str,
) -> dict[str, Any]:
    """A tool's parameters with the optional move (``next``, and ``next_data`` when the
    state has a data schema) added; in strict mode they are required and nullable.

    Raises:
      MachineDefinitionError: the tool has a parameter of one of those names, or its
        parameters are not a JSON Schema object with properties.
    """
    properties = schema.get("properties")
    if schema.get("type") != "object" or not isinstance(properties, dict):
        raise MachineDefinitionError(
            f"{what} cannot take a move (call_and_move): its parameters are not a JSON "
            "Schema object with properties; give it a msgspec Struct or a dataclass as args, "
            "or leave call_and_move off"
        )
    added = [MOVE_NEXT] if data is None else [MOVE_NEXT, MOVE_DATA]
    clash = [name for name in added if name in properties]
    if clash:
        raise MachineDefinitionError(
            f"{what} has a parameter named {clash[0]!r}, the name a call-and-move state "
            f"gives the move; rename the parameter or leave call_and_move off"
        )
    move: dict[str, Any] = {
        "type": "string",
        "enum": legal,
        "description": "the state to move to once this call succeeds; "
        + ("null" if strict else "leave it out")
        + " to stay here",
    }
    extra: dict[str, Any] = {MOVE_NEXT: move}
    if data is not None:
        extra[MOVE_DATA] = {**data, "description": f"the data of that move (with {MOVE_NEXT})"}
    if strict:
        extra = {
            key: {"anyOf": [value, {"type": "null"}], "description": value["description"]}
            for key, value in extra.items()
        }
        for value in extra.values():
            value["anyOf"][0] = {k: v for k, v in value["anyOf"][0].items() if k != "description"}
    required = list(schema.get("required", []))
    return {
        **schema,
        "properties": {**properties, **extra},
        "required": [*required, *extra] if strict else required,
    }


def split_move(raw: str) -> str:
    """The proposal of a call that names its move in its arguments (a call-and-move
    state): ``next`` and ``next_data`` out of ``args``, as the proposal's ``next`` and
    ``data``; a null ``next`` (strict mode) is no move. Anything else is returned as it
    is, and the gate judges it (a defect of the text, an unknown parameter, ...)."""
    if f'"{MOVE_NEXT}"' not in raw and f'"{MOVE_DATA}"' not in raw:
        return raw
    if scan_json(raw.encode()) is not None:
        return raw  # the gate names the defect, in the model's own bytes
    try:
        proposal = msgspec.json.decode(raw)
    except msgspec.DecodeError:  # pragma: no cover - scan_json refuses all msgspec does
        return raw
    if not isinstance(proposal, dict) or not isinstance(proposal.get("args"), dict):
        return raw
    args = proposal["args"]
    if MOVE_NEXT not in args and MOVE_DATA not in args:
        return raw
    target = args.pop(MOVE_NEXT, None)
    data = args.pop(MOVE_DATA, None)
    out: dict[str, Any] = {"tool": proposal.pop("tool", None)}
    if target is not None:
        out["next"] = target
        if data is not None:
            out["data"] = data
    elif data is not None:
        out["data"] = data  # data without a move: the gate reads it as a plain call's (unread)
    proposal.pop("args")
    out.update(proposal)  # anything else the model sent, for the gate to refuse
    out["args"] = args
    return _encode(out).decode()


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
    from ._machine import Worker

    if transition in machine.tool_by_name:
        raise MachineDefinitionError(
            f"machine {machine.name!r} has a tool named {transition!r}, the name the provider "
            "gives the move to the next state; rename the tool or pass transition_tool=..."
        )
    for state, spec in machine.states.items():
        if isinstance(spec, Worker):
            _build_specs(machine, state, transition, strict)


# -- the history as a conversation ----------------------------------------------------------


def system_text(view: RunView, mode: str = "tools") -> str:
    """What the system message says: the task, the state, the run's inputs and data, and
    how to answer (``mode``: by native tool calls, or by one JSON object in the structured
    output's schema).

    Made again only when the state, the data or the mode changed (kept on the view).
    """
    run = view._run
    key = (run.state, run._data_version, mode)
    cache = memo(view)
    found = cache.get("system")
    if found is not None and found[0] == key:
        return str(found[1])
    lines = [
        f"You drive one run of the state machine {view.machine!r}. It is in state {view.state!r}.",
    ]
    if view.instructions:
        lines.append(view.instructions)
    lines.append(f"Inputs: {_encode(dict(view.inputs)).decode()}")
    if view.data:
        lines.append(f"Data so far: {_encode(dict(view.data)).decode()}")
    legal = view.legal_next
    if mode == "json_schema":
        lines.append(
            "Answer each turn with one JSON object, as the response format's schema says: "
            '{"tool": NAME, "args": {...}} to call a tool. '
            + (
                f'To move on, answer {{"next": STATE, "data": {{...}}}} with STATE one of '
                f"{', '.join(legal)}."
                if legal
                else "There is no next state from here."
            )
        )
    else:
        lines.append(
            "Call exactly one tool per turn. "
            + (
                f"To move on, call {TRANSITION!r} with next one of {', '.join(legal)}."
                if legal
                else "There is no next state from here."
            )
        )
    data_schema = view.data_schema
    if legal and data_schema is not None:
        lines.append(
            f"The data of a move must match this JSON Schema: {_encode(data_schema).decode()}"
        )
    if legal and getattr(run.machine.states.get(run.state), "call_and_move", False):
        lines.append(
            f"A tool call may also move on: set its {MOVE_NEXT!r} to the state to move to once "
            "the call succeeds (the run stays here if it fails)."
        )
    text = "\n".join(lines)
    cache["system"] = (key, text)
    return text


def memo(view: RunView) -> dict[Any, Any]:
    """A provider's memo on ``view``: what it derived from the run so far."""
    found = view._memo
    if found is None:
        found = view._memo = {}
    return found


class _Steps:
    """The exchanges worked out so far for a view, and where each began in the turns."""

    __slots__ = ("frames", "generation", "last", "positions", "steps", "turn")

    def __init__(self, generation: int) -> None:
        self.frames = 0
        self.last: Any = None
        """The last frame worked out: redone only if the history's last frame changed."""
        self.turn = 0
        self.steps: list[Exchange] = []
        self.positions: list[int] = []
        self.generation = generation


def exchanges(view: RunView) -> list[Exchange]:
    """The run's history as steps of a conversation, oldest first.

    Each model call whose response was journaled is paired with what came of it (the
    first history frame after it): a rejection or a failure goes back as an error tool
    result with the violation's message and hint, a commit as the result, a move as its
    confirmation. A rejected call goes back bounded (:func:`excerpt`), never a megabyte
    the gate refused resent with every later request. Identical rejections in a row
    arrive compacted, as one step: the latest call, with the summary as its result. What
    no call of the model caused (a breaker, an operator, a step state) is a note.

    Kept on the view from call to call: the history only grows and only its last frame
    can change (a repeated rejection joins it), so a call works out the new steps only.
    The list returned is the memo's own: read it, do not change it.
    """
    return _steps(view).steps


def _steps(view: RunView) -> _Steps:
    run = view._run
    turns = run.turns
    frames = view.history
    cache = memo(view)
    state: _Steps | None = cache.get("exchanges")
    if state is None or state.frames > len(frames):
        state = cache["exchanges"] = _Steps(state.generation + 1 if state is not None else 0)
    steps, positions = state.steps, state.positions
    done, position = state.frames, state.turn
    if done == len(frames) and (not frames or frames[-1] == state.last):
        return state  # no new frame, and the last one stands
    if done and frames[done - 1] != state.last:  # a repeated rejection joined it: redo it
        done -= 1
        position = positions.pop()
        steps.pop()
    for frame in frames[done:]:
        positions.append(position)
        turn = None
        # the latest model call before this frame that no earlier frame answered
        while position < len(turns) and turns[position][0] < frame.seq:
            turn = turns[position]
            position += 1
        steps.append(_exchange(run, frame, turn))
    state.frames, state.turn = len(frames), position
    state.last = frames[-1] if frames else None
    return state


def _exchange(
    run: Any, frame: Any, turn: tuple[int, str, tuple[tuple[str, str], ...]] | None
) -> Exchange:
    text = frame.text
    for violation in frame.violations:
        if violation.hint:
            text += f"\nfix: {violation.hint}"
    error = frame.kind in ("rejected", "tool_failed", "breaker")
    call = None if turn is None else parse_raw(turn[1], turn[0])
    if call is None or turn is None:
        return Exchange(None, f"[{frame.kind}] {text}", error)
    extra = (
        tuple(  # never run: bounded like a rejected call
            (f"{call[0]}_{index}", name, excerpt(arguments))
            for index, (name, arguments) in enumerate(turn[2], 1)
        )
        if turn[2]
        else ()
    )
    if frame.kind not in _ACCEPTED:
        # NOTE: a rejected call goes back bounded, or a 1 MB refusal would be sent again
        # with every later request: the pollution compaction is there to prevent.
        call = (call[0], call[1], excerpt(call[2]))
    if frame.kind == "tool_result":
        reply = _result_text(run, frame.seq)
    elif frame.kind == "transitioned":
        reply = f"moved: {text}"
    else:
        reply = text
    return Exchange(call, reply, error, extra)


#: What came of a call that the gate accepted: the call goes back as the model sent it.
_ACCEPTED = frozenset(("tool_result", "tool_failed", "transitioned"))
#: A rejected call's arguments up to this many bytes go back whole; longer ones as an
#: excerpt (see :func:`excerpt`).
EXCERPT_LIMIT = 2048
_EXCERPT_ENDS = 256  # bytes of the start and of the end an excerpt keeps
_EXCERPT_NEAR = 128  # bytes before and after the defect an excerpt keeps
_EXCERPT_SCAN = 1 << 20  # arguments longer than this are not scanned for their defect


def excerpt(arguments: str) -> str:
    """A rejected call's arguments as they go back to the model: whole up to
    :data:`EXCERPT_LIMIT` bytes; past it, a JSON object (so every API takes it as
    arguments) that gives their size, their first and last bytes, and where their JSON
    first breaks (``defect_at_byte``, counted in the arguments, and the text around it).

    The same arguments give the same excerpt, so a request's prefix stays stable."""
    data = arguments.encode("utf-8", "replace")
    size = len(data)
    if size <= EXCERPT_LIMIT:
        return arguments
    ends = _EXCERPT_ENDS
    shown: dict[str, Any] = {
        "not_sent_back_whole": (
            f"this call was not run, and its arguments were {size:,} bytes: only their "
            f"first and last {ends} bytes are shown here"
        ),
        "size_bytes": size,
        "start": _text(data[:ends]),
        "end": _text(data[-ends:]),
    }
    defect = scan_json(data) if size <= _EXCERPT_SCAN else None
    if defect is not None:
        at = defect[1]
        shown["defect_at_byte"] = at
        shown["near_defect"] = _text(data[max(at - _EXCERPT_NEAR, 0) : at + _EXCERPT_NEAR])
    return _encode(shown).decode()


def _text(data: bytes) -> str:
    """Bytes cut from UTF-8 text, without the characters the cuts split."""
    return data.decode("utf-8", "ignore")


def parts(view: RunView, key: str, render: Callable[[Exchange], bytes]) -> list[bytes]:
    """Every step of the conversation rendered by ``render`` (a provider's wire format),
    each with a comma before it, in a new list: the request body is then one join of
    them with its fixed parts (one copy of the conversation per call, not one per piece).

    Each step is rendered once: the fragments of the steps that can no longer change
    are kept on the view (only the last step can change: a repeated rejection joins it),
    so a call renders its new steps only."""
    state = _steps(view)
    steps = state.steps
    if not steps:
        return []
    cache = memo(view)
    found = cache.get(key)
    if found is None or found[0] != state.generation or len(found[1]) > len(steps) - 1:
        stable: list[bytes] = []
        last_step, last = None, b""
    else:
        _generation, stable, last_step, last = found
    for index in range(len(stable), len(steps) - 1):
        step = steps[index]
        stable.append(last if step is last_step else b"," + render(step))
    final = steps[-1]
    if final is not last_step:
        last = b"," + render(final)
    cache[key] = (state.generation, stable, final, last)
    return [*stable, last]


def joined(view: RunView, key: str, render: Callable[[Exchange], bytes]) -> bytes:
    """The fragments of :func:`parts` joined by commas (b"" for no step)."""
    return b"".join(parts(view, key, render))[1:]


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
            quoted = raw[8:at]
            inner = quoted[1:-1]
            if (
                len(quoted) >= 2
                and quoted[0] == '"' == quoted[-1]
                and '"' not in inner
                and "\\" not in inner
                and inner.isprintable()
            ):
                return (call_id, inner, raw[at + len(_ARGS) : -1])  # what decoding gives
            try:
                name = msgspec.json.decode(quoted)
            except msgspec.DecodeError:
                return _moving_call(call_id, raw)
            if isinstance(name, str):
                return (call_id, name, raw[at + len(_ARGS) : -1])
        return None
    return (call_id, TRANSITION, raw)


def _moving_call(call_id: str, raw: str) -> tuple[str, str, str] | None:
    """The call a :func:`split_move` proposal was made from: its move back in its arguments."""
    try:
        proposal = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    if not isinstance(proposal, dict):
        return None
    name, args = proposal.get("tool"), proposal.get("args")
    if not isinstance(name, str) or not isinstance(args, dict) or "next" not in proposal:
        return None
    arguments = {**args, MOVE_NEXT: proposal["next"]}
    if "data" in proposal:
        arguments[MOVE_DATA] = proposal["data"]
    return (call_id, name, _encode(arguments).decode())


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


def with_defect(message: str, text: str) -> str:
    """``message`` and, when the model's answer ``text`` is not one JSON value, what
    keeps it from being one and where, in the gate's words (offsets count in ``text``)."""
    found = json_defect(text.encode("utf-8", "replace")) if text else None
    return message if found is None else f"{message}; {found.message}"


def clip(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def assemble(head: dict[str, Any], key: str, parts: list[bytes], rest: dict[str, Any]) -> bytes:
    """``head`` and ``rest`` as one JSON object with ``key`` the array of the pre-encoded
    ``parts`` between them: the body is joined, not built and encoded again each call."""
    start = _encode(head)[:-1] if head else b"{"
    tail = _encode(rest)
    joined = b",".join(parts)
    middle = b'"' + key.encode() + b'":[' + joined + b"]"
    if len(tail) > 2:
        return start + (b"," if head else b"") + middle + b"," + tail[1:]
    return start + (b"," if head else b"") + middle + b"}"


def framing(head: dict[str, Any], key: str, rest: dict[str, Any]) -> tuple[bytes, bytes]:
    """The bytes before and after the array in :func:`assemble`: ``opening + b",".join(parts)
    + closing == assemble(head, key, parts, rest)``, so a provider encodes them once."""
    start = _encode(head)[:-1] if head else b"{"
    tail = _encode(rest)
    opening = start + (b"," if head else b"") + b'"' + key.encode() + b'":['
    return opening, (b"]," + tail[1:] if len(tail) > 2 else b"]}")


def cached_closing(
    cache: dict[int, tuple[Any, Any, bytes]],
    specs: tuple[ToolSpec, ...],
    options: Any,
    build: Callable[[], bytes],
) -> bytes:
    """``build()``, kept per ``specs`` (one per state) while ``options`` (the provider's
    settings the bytes depend on) stay equal."""
    found = cache.get(id(specs))
    if found is None or found[0] is not specs or found[1] != options:
        found = cache[id(specs)] = (specs, options, build())
    return found[2]


def encoded_tools(
    cache: dict[int, tuple[Any, bytes]],
    specs: tuple[ToolSpec, ...],
    render: Callable[[ToolSpec], Any],
) -> bytes:
    """The tools of ``specs`` as JSON, encoded once per state (``specs`` is cached too)."""
    found = cache.get(id(specs))
    if found is None or found[0] is not specs:
        found = cache[id(specs)] = (specs, _encode([render(spec) for spec in specs]))
    return found[1]


#: What reading a response gives: the proposal's raw text, the usage, the envelope's
#: violation (or None) and the calls after the first.
Read = tuple[str, "TokenUsage", Violation | None, tuple[tuple[str, str], ...]]


def judge_calls(
    calls: list[tuple[str, str]],
    text: str,
    usage: TokenUsage,
    transition: str,
    *,
    announced: str | None = None,
    mismatch: tuple[str, str] | None = None,
) -> Read:
    """The end of every API's reading: no call (``announced`` says the stop reason claimed
    one), text instead of a call or beside one, a stop reason that does not fit the call
    (``mismatch``: its message and hint), or the first call as the proposal."""
    if not calls:
        if announced:
            return "", usage, envelope(announced, ONE_TOOL_HINT), ()
        if text.strip():
            message = f"the model answered with text instead of a tool call: {clip(text)}"
            return "", usage, envelope(message, ONE_TOOL_HINT), ()
        return (
            "",
            usage,
            envelope("the reply is empty: no tool call and no text", ONE_TOOL_HINT),
            (),
        )
    if text.strip():
        return (
            "",
            usage,
            envelope(
                f"the reply holds text and a tool call together: {clip(text)}",
                "answer with the tool call alone, no text beside it",
            ),
            (),
        )
    if mismatch is not None:
        return "", usage, envelope(*mismatch), ()
    name, arguments = calls[0]
    raw, violation = to_raw(name, arguments, transition)
    return raw, usage, violation, tuple(calls[1:])
