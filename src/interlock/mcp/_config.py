"""A machine for the MCP proxy declared in a TOML file, with CEL guards: no Python needed.

:func:`load_machine_file` reads and checks the file into a :class:`MachineSpec`;
:func:`build_machine` turns it, with the upstream server's tools (``tools/list``), into a
:class:`~interlock.Machine` whose runs the proxy drives as external runs.

The format (``docs/how-to/mcp-machines.md`` has a full example)::

    [machine]
    name = "memory"                # required
    initial = "PLAN"               # required: a state declared below
    transition_tool = "transition" # optional: a synthetic tool, called {"to": "STATE"}
    reasks = 2                     # optional, the model proxy only: times a refused call
                                   # is asked again of the model (0: the application
                                   # gets the refusal at once)

    [states.PLAN]                  # one table per non-terminal state
    tools = ["read_graph", "create_entities"]  # upstream tool names allowed here
    next = ["RELATE", "FAILED"]    # legal next states; the terminals COMPLETED (or
                                   # DONE), FAILED and ESCALATE need no table
    instructions = "..."           # optional: what the agent is told here

    [tools.create_entities]        # optional: a tool named in a state without a table
                                   # gets the defaults below
    kind = "neither"               # "read-only" | "idempotent" | "neither" (default):
                                   # the upstream's annotations are hints, never trusted
    moves_to = "RELATE"            # optional: a committed call moves the run there
    approval = true                # optional (false): the end user approves each call
    repeatable = false             # optional (false): the same call may commit twice
    schema = { type = "object", properties = { ... } }  # optional: a stricter JSON
                                   # Schema (a table, or a JSON string) replacing the
                                   # upstream's inputSchema; in either, local $defs
                                   # named by $ref are inlined before compiling
    [[tools.create_entities.guards]]
    when = "size(args.entities) <= 3"    # a CEL expression that must be true
    message = "at most 3 entities a call" # optional: the rejection's message
    hint = "split the call"               # optional: what to propose instead
    # or, shorter: guards = ["size(args.entities) <= 3", ...]
    result_guards = ["size(result.entities) == size(args.entities)"]  # optional: checks of
                                   # the server's answer (result, args, state, inputs); one
                                   # that fails is a failed call, not an answer

    [tools.delete_entities.reconcile]     # optional, for a tool of kind "neither"
    tool = "read_graph"                   # a tool declared kind = "read-only"
    applied = "!result.entities.exists(e, e.name in args.entityNames)"

    [budgets]                      # optional, interlock's Budgets, same names
    tokens = 200000                # model tokens a run may use (reported by the proxy)
    steps = 100                    # proposals a run may make
    deadline = 3600.0              # seconds from the run's start

    [breakers]                     # optional, interlock's BreakerPolicy, same names
    consecutive_failures = 3       # rejections and tool failures in a row
    repeats = 3                    # times the same call may be proposed
    circuit_failures = 5           # failures in a row of a tool, across runs, that open its circuit
    circuit_cooldown = 30.0        # seconds an open circuit stays open

A guard's activation: ``args`` (the call's arguments), ``state`` (the run's state),
``history`` (the committed calls in order, each ``{"tool", "args", "result"}``),
``calls`` (tool name -> number of committed calls, 0 for every tool of the machine) and
``inputs`` (the run's inputs). A reconcile's ``applied``: ``result`` (what the reconcile
tool returned), ``args`` (the call in doubt's arguments) and ``key`` (its idempotency
key). Each expression is compiled and type-checked when the file is loaded: a syntax
error, an unknown variable or an expression that cannot be a bool is refused then.

Every error is a :class:`~interlock.errors.ConfigurationError` of one line naming the
file, the key path and the fix: ``memory.toml: states.PLAN.next: unknown state "APLY";
the states are PLAN, APPLY (or write COMPLETED/FAILED/ESCALATE)``.

CEL library: ``cel-expr-python`` (module ``cel_expr_python``), Google's C++ reference
runtime. Chosen over ``common-expression-language`` because it declares the variables
and type-checks at compile time (``undeclared reference to 'nope'`` at line:column, a
guard of type int refused before anything runs), its compile errors carry the position,
its evaluation errors are values (``NOT_FOUND: Key not found in map``), not exceptions,
so each becomes a rejection, and it has no dependencies (the other pulls typer and rich
for its CLI, and its evaluation errors are exceptions of several types).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..core._exceptions import (
    ConfigurationError,
    MachineDefinitionError,
    MissingExtra,
    ToolDefinitionError,
)
from ..core._machine import (
    ESCALATE,
    FAILED,
    SUCCESS_STATES,
    BreakerPolicy,
    Budgets,
    Machine,
    Worker,
)
from ..core._tools import Reject, Tool, ToolContext, compile_schema

if TYPE_CHECKING:
    import os

    from ..core._view import RunView

__all__ = [
    "KINDS",
    "GuardSpec",
    "MachineSpec",
    "ReconcileSpec",
    "StateSpec",
    "ToolSpec",
    "build_machine",
    "load_machine_file",
]

#: The values of a tool's ``kind``.
KINDS = ("read-only", "idempotent", "neither")
_TERMINALS = (*SUCCESS_STATES, FAILED, ESCALATE)
_GUARD_VARIABLES = ("args", "state", "history", "calls", "inputs")
_RECONCILE_VARIABLES = ("result", "args", "key")
_RESULT_VARIABLES = ("result", "args", "state", "inputs")
_TOP_KEYS = ("machine", "states", "tools", "budgets", "breakers")
_MACHINE_KEYS = ("name", "initial", "transition_tool", "reasks")
_STATE_KEYS = ("tools", "next", "instructions")
_TOOL_KEYS = (
    "kind",
    "moves_to",
    "guards",
    "result_guards",
    "schema",
    "approval",
    "repeatable",
    "reconcile",
    "timeout",
)
_GUARD_KEYS = ("when", "message", "hint")
_RECONCILE_KEYS = ("tool", "applied")
_BUDGET_KEYS = {"tokens": int, "steps": int, "deadline": float}
_BREAKER_KEYS = {
    "consecutive_failures": int,
    "repeats": int,
    "circuit_failures": int,
    "circuit_cooldown": float,
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_TOML_POSITION = re.compile(
    r"^(?P<msg>.*?) \((?:at line (?P<line>\d+), column (?P<col>\d+)|(?P<end>at end of document))\)$"
)
_CEL_ERROR = re.compile(r"ERROR: <input>:(?P<line>\d+):(?P<col>\d+): (?P<msg>[^\n]*)")
_STATUS = re.compile(r"^[A-Z_]+: ")


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names) or "none"


# -- CEL ---------------------------------------------------------------------------------


_ENVS: dict[tuple[str, ...], Any] = {}


def _env(variables: tuple[str, ...]) -> Any:
    env = _ENVS.get(variables)
    if env is None:
        try:
            from cel_expr_python import cel  # type: ignore[import-untyped]
        except ImportError:
            raise MissingExtra(
                "CEL guards need cel-expr-python, which is not installed; install the mcp "
                "extra: pip install 'interlock[mcp]'"
            ) from None
        env = _ENVS[variables] = cel.NewEnv(variables=dict.fromkeys(variables, cel.Type.DYN))
    return env


def _compile_cel(expression: str, variables: tuple[str, ...]) -> tuple[Any, str]:
    """The compiled expression, or None and the library's first error as one line."""
    try:
        program = _env(variables).compile(expression)
    except RuntimeError as exc:
        match = _CEL_ERROR.search(str(exc))
        if match is None:  # pragma: no cover - every compile error seen names a position
            return None, _STATUS.sub("", str(exc).splitlines()[0])
        return None, (
            f"CEL error at line {match['line']}, column {match['col']}: {match['msg'].strip()}"
        )
    kind = program.return_type().name()
    if kind not in ("BOOL", "DYN"):
        return None, f"the expression must be a bool; it is of type {kind.lower()}"
    return program, ""


def _evaluate(program: Any, activation: dict[str, Any]) -> tuple[bool | None, str]:
    """``(True | False, "")``, or ``(None, why)`` when it could not be evaluated."""
    try:
        value = program.eval(data=activation)
        kind = value.type().name()
        if kind == "BOOL":
            return bool(value.value()), ""
        if kind == "ERROR":
            return None, _STATUS.sub("", str(value.value()).strip())
        return None, f"it gave {kind.lower()} {value.value()!r}, not a bool"
    except Exception as exc:  # a value the library cannot take; never out of a guard
        return None, _STATUS.sub("", (str(exc).strip() or repr(exc)).splitlines()[0])


def _uses(expression: str, variables: tuple[str, ...]) -> tuple[str, ...]:
    # a superset (a name inside a string literal counts): building one not needed is harmless
    return tuple(v for v in variables if re.search(rf"\b{v}\b", expression))


# -- the spec ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class GuardSpec:
    """A CEL guard of a tool, compiled."""

    when: str
    """The CEL expression; the call passes when it is true."""
    message: str = ""
    """The rejection's message, if the file gives one."""
    hint: str = ""
    """What to propose instead, if the file says."""
    where: str = ""
    """Its key path in the file: ``tools.create_entities.guards[0]``."""
    program: Any = field(default=None, repr=False)
    uses: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True, eq=False)
class ReconcileSpec:
    """How the proxy asks the upstream whether a call in doubt was applied.

    Attributes:
      tool: the read-only upstream tool the proxy calls (with no arguments).
      expression: the CEL expression over ``result``, ``args`` and ``key`` that is true
        when the call was applied.
    """

    tool: str
    expression: str
    program: Any = field(default=None, repr=False)

    def evaluate(self, result: Any, args: Mapping[str, Any], key: str) -> tuple[bool | None, str]:
        """Return ``(applied, "")``, or ``(None, why)`` if the expression could not be evaluated."""
        activation = {"result": _builtins(result), "args": _builtins(args), "key": key}
        return _evaluate(self.program, activation)

    def applied(self, result: Any, args: Mapping[str, Any], key: str) -> bool | None:
        """Whether the call in doubt was applied: True, False, or None when the expression
        could not be evaluated (the run then escalates as in doubt).

        Args:
          result: what the reconcile tool returned (its structured content).
          args: the arguments of the call in doubt.
          key: its idempotency key.
        """
        return self.evaluate(result, args, key)[0]


@dataclass(frozen=True, eq=False)
class ToolSpec:
    """What the file says of a tool (the defaults for one only named in a state)."""

    name: str
    kind: str = "neither"
    moves_to: str | None = None
    guards: tuple[GuardSpec, ...] = ()
    schema: dict[str, Any] | None = None
    approval: bool = False
    repeatable: bool = False
    reconcile: ReconcileSpec | None = None
    result_guards: tuple[GuardSpec, ...] = ()
    """CEL checks of a call's result (``result``, ``args``, ``state``, ``inputs``)."""
    timeout: float = 30.0
    """Seconds the upstream has to answer a call; past it the call is in doubt."""
    where: str = ""
    """The key path where the file first names the tool, for errors."""


@dataclass(frozen=True)
class StateSpec:
    """A non-terminal state: the tools allowed there and the legal next states."""

    name: str
    tools: tuple[str, ...]
    next: tuple[str, ...]
    instructions: str = ""


@dataclass(frozen=True, eq=False)
class MachineSpec:
    """A machine declared in a TOML file, checked; :func:`build_machine` builds it.

    Attributes:
      path: the file, as given, for error messages.
      name: the machine's name.
      initial: the state a run starts in.
      states: the non-terminal states, in the file's order.
      tools: every tool the file names (in a state, a table, or as a reconcile tool).
      budgets: the runs' limits.
      breakers: the breaker thresholds.
      transition_tool: the synthetic tool the agent calls with ``{"to": STATE}`` to
        move the run, or None.
      reasks: for the model proxy, how many times a refused call is asked again of the
        model (None: the proxy's default).
    """

    path: str
    name: str
    initial: str
    states: Mapping[str, StateSpec]
    tools: Mapping[str, ToolSpec]
    budgets: Budgets = field(default_factory=Budgets)
    breakers: BreakerPolicy = field(default_factory=BreakerPolicy)
    transition_tool: str | None = None
    reasks: int | None = None

    def moves_to(self, tool: str) -> str | None:
        """The state a committed call of ``tool`` moves the run to, or None.

        The proxy proposes such a call as ``{"tool", "args", "next": STATE}``: every
        state allowing the tool is built with ``call_and_move``, so the gate verifies
        the call and the move together and the move is made when the call commits.
        """
        spec = self.tools.get(tool)
        return None if spec is None else spec.moves_to

    def approval(self, tool: str) -> bool:
        """Whether the end user must approve each call of ``tool`` (the proxy asks)."""
        spec = self.tools.get(tool)
        return spec is not None and spec.approval

    def reconcile(self, tool: str) -> ReconcileSpec | None:
        """How to reconcile a call of ``tool`` in doubt, or None (it escalates)."""
        spec = self.tools.get(tool)
        return None if spec is None else spec.reconcile

    def check_result(
        self, tool: str, result: Any, args: Mapping[str, Any], state: str, inputs: Any
    ) -> str | None:
        """Why the upstream's ``result`` of a call of ``tool`` fails the file's result
        guards (the first that fails, or that cannot be evaluated), or None."""
        spec = self.tools.get(tool)
        if spec is None or not spec.result_guards:
            return None
        activation = {
            "result": _builtins(result),
            "args": _builtins(args),
            "state": state,
            "inputs": _builtins(inputs),
        }
        for guard in spec.result_guards:
            ok, why = _evaluate(guard.program, activation)
            if ok is True:
                continue
            if ok is None:
                return f"{tool}: the result check `{guard.when}` could not be evaluated: {why}"
            return f"{tool}: {guard.message or f'the result fails `{guard.when}`'}"
        return None

    def transition_schema(self, state: str) -> dict[str, Any]:
        """The inputSchema of the transition tool in ``state``: ``{"to": one of its next}``."""
        return {
            "type": "object",
            "properties": {"to": {"type": "string", "enum": list(self.states[state].next)}},
            "required": ["to"],
            "additionalProperties": False,
        }


# -- reading the file --------------------------------------------------------------------


class _Reader:
    """Checks a parsed file, raising one-line errors that name the file and the key path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> ConfigurationError:
        return ConfigurationError(
            f"{self.path}: {where}: {problem}" if where else f"{self.path}: {problem}"
        )

    def table(self, value: Any, where: str, allowed: Sequence[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be a table ([{where}]); got {_show(value)}")
        for key in value:
            if key not in allowed:
                at = f"{where}.{key}" if where else key
                raise self.fail(at, f"unknown key {_q(key)}; allowed here: {', '.join(allowed)}")
        return value

    def string(self, value: Any, where: str, *, empty: bool = False) -> str:
        if not isinstance(value, str) or (not empty and not value):
            what = "a string" if empty else "a non-empty string"
            raise self.fail(where, f"must be {what}; got {_show(value)}")
        return value

    def flag(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"must be true or false; got {_show(value)}")
        return value

    def names(self, value: Any, where: str, what: str) -> tuple[str, ...]:
        if isinstance(value, str):
            raise self.fail(where, f"must be a list of {what}; write [{_q(value)}]")
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.fail(where, f"must be a list of {what} (strings); got {_show(value)}")
        for name in value:
            if value.count(name) > 1:
                raise self.fail(where, f"{_q(name)} is listed twice")
        return tuple(value)

    def number(self, value: Any, where: str, kind: type) -> int | float:
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            if not ok:
                raise self.fail(where, f"must be a whole number >= 1; got {_show(value)}")
            return int(value)
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and 0 < value < float("inf")
        )
        if not ok:
            raise self.fail(where, f"must be a positive number of seconds; got {_show(value)}")
        return float(value)

    def cel(self, value: Any, where: str, variables: tuple[str, ...]) -> tuple[str, Any]:
        expression = self.string(value, where)
        program, error = _compile_cel(expression, variables)
        if program is None:
            raise self.fail(
                where, f"{error} in {_q(expression)} (the variables are {', '.join(variables)})"
            )
        return expression, program

    def state_name(self, value: Any, where: str, declared: Sequence[str]) -> str:
        name = self.string(value, where)
        if name not in declared and name not in _TERMINALS:
            raise self.fail(
                where,
                f"unknown state {_q(name)}; the states are {_names(declared)} "
                "(or write COMPLETED/FAILED/ESCALATE)",
            )
        return name


def _show(value: Any) -> str:
    if isinstance(value, str):
        return _q(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def load_machine_file(path: str | os.PathLike[str]) -> MachineSpec:
    """Read a machine for the MCP proxy from a TOML file, and check all of it.

    Every CEL expression is compiled here, so a file that loads has no syntax error
    left. Whether the tools exist upstream is checked by :func:`build_machine`.

    Raises:
      ConfigurationError: the file cannot be read, is not TOML (the message gives the
        line and column), or declares something inconsistent; one line naming the file,
        the key path and what to write.
      MissingExtra: cel-expr-python is not installed.
    """
    name = str(path)
    reader = _Reader(name)
    try:
        text = Path(path).read_bytes().decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise reader.fail("", f"cannot read the file: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_POSITION.match(str(exc))
        if match is None:  # pragma: no cover - tomllib always says where
            raise reader.fail("", f"invalid TOML: {exc}") from None
        where = (
            "at the end of the file"
            if match["end"]
            else f"line {match['line']}, column {match['col']}"
        )
        message = match["msg"][:1].lower() + match["msg"][1:]
        raise reader.fail(where, f"invalid TOML: {message}") from None
    return _read(reader, data)


def _read(reader: _Reader, data: dict[str, Any]) -> MachineSpec:
    reader.table(data, "", _TOP_KEYS)
    if "machine" not in data:
        raise reader.fail(
            "machine", 'missing; write [machine] with name = "..." and initial = "..."'
        )
    machine = reader.table(data["machine"], "machine", _MACHINE_KEYS)
    for key in ("name", "initial"):
        if key not in machine:
            raise reader.fail(f"machine.{key}", f'missing; write {key} = "..."')
    machine_name = reader.string(machine["name"], "machine.name")
    if "states" not in data:
        raise reader.fail("states", "missing; declare each state as [states.NAME]")
    states_table = data["states"]
    if not isinstance(states_table, dict):
        raise reader.fail("states", f"must be tables [states.NAME]; got {_show(states_table)}")
    if not states_table:
        raise reader.fail("states", "no state is declared; declare each state as [states.NAME]")
    declared = list(states_table)
    for state in declared:
        if state in _TERMINALS:
            raise reader.fail(
                f"states.{state}",
                f"{state} is a terminal state and takes no table; remove [states.{state}]",
            )
        if not _NAME.match(state):
            raise reader.fail(
                f"states.{state}",
                "a state name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or '_'",
            )
    initial = reader.string(machine["initial"], "machine.initial")
    if initial not in declared:
        raise reader.fail(
            "machine.initial",
            f"unknown state {_q(initial)}; the states are {_names(declared)}",
        )
    tools_table = data.get("tools", {})
    if not isinstance(tools_table, dict):
        raise reader.fail("tools", f"must be a table of [tools.NAME]; got {_show(tools_table)}")
    transition = machine.get("transition_tool")
    if transition is not None:
        transition = reader.string(transition, "machine.transition_tool")
        if not _NAME.match(transition):
            raise reader.fail(
                "machine.transition_tool",
                "a tool name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or '_'",
            )
        if transition in tools_table:
            raise reader.fail(
                f"tools.{transition}",
                f"{_q(transition)} is the transition tool (machine.transition_tool); "
                "rename one of them",
            )

    first_named: dict[str, str] = {}
    states: dict[str, StateSpec] = {}
    for state, raw in states_table.items():
        where = f"states.{state}"
        table = reader.table(raw, where, _STATE_KEYS)
        if "next" not in table:
            raise reader.fail(f"{where}.next", 'missing; write next = ["STATE", ...]')
        next_ = reader.names(table["next"], f"{where}.next", "state names")
        if not next_:
            raise reader.fail(f"{where}.next", "no way out; name at least one next state")
        for dst in next_:
            reader.state_name(dst, f"{where}.next", declared)
        tools = reader.names(table.get("tools", []), f"{where}.tools", "tool names")
        for tool in tools:
            if tool == transition:
                raise reader.fail(
                    f"{where}.tools",
                    f"{_q(tool)} is the transition tool, allowed in every state; remove it here",
                )
            if not _NAME.match(tool):
                raise reader.fail(
                    f"{where}.tools",
                    f"{_q(tool)} cannot be a tool name: use 1-64 letters, digits, '_', '.' or "
                    "'-', starting with a letter or '_'",
                )
            first_named.setdefault(tool, f"{where}.tools")
        instructions = reader.string(
            table.get("instructions", ""), f"{where}.instructions", empty=True
        )
        states[state] = StateSpec(state, tools, next_, instructions)

    reachable = _reachable(initial, states)
    for state in declared:
        if state not in reachable:
            raise reader.fail(
                f"states.{state}",
                f"unreachable from the initial state {_q(initial)}; add {_q(state)} to the "
                "next of a state that is reachable, or remove it",
            )
    if not any(s in reachable for s in SUCCESS_STATES):
        raise reader.fail(
            "states",
            f"no state reachable from {_q(initial)} can move to COMPLETED; add COMPLETED to "
            "a state's next",
        )

    for tool in tools_table:
        if not _NAME.match(tool):
            raise reader.fail(
                f"tools.{tool}",
                "a tool name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or '_'",
            )
        first_named.setdefault(tool, f"tools.{tool}")
    specs: dict[str, ToolSpec] = {}
    reconcile_tools: list[tuple[str, str]] = []
    for tool, raw in tools_table.items():
        where = f"tools.{tool}"
        table = reader.table(raw, where, _TOOL_KEYS)
        kind = table.get("kind", "neither")
        if kind not in KINDS:
            raise reader.fail(
                f"{where}.kind",
                f'unknown kind {_show(kind)}; write "read-only", "idempotent" or "neither"',
            )
        moves_to = None
        if "moves_to" in table:
            moves_to = reader.state_name(table["moves_to"], f"{where}.moves_to", declared)
            allowing = [s for s in states.values() if tool in s.tools]
            if not allowing:
                raise reader.fail(
                    f"{where}.moves_to",
                    f"no state allows {tool}, so no call of it can move the run; list it in "
                    "a state's tools",
                )
            for state in allowing:
                if moves_to not in state.next:
                    raise reader.fail(
                        f"{where}.moves_to",
                        f"state {state.name} allows {tool} but cannot move to {_q(moves_to)}; "
                        f"add {_q(moves_to)} to states.{state.name}.next",
                    )
        guards = _read_guards(reader, table.get("guards", []), f"{where}.guards")
        result_guards = _read_guards(
            reader, table.get("result_guards", []), f"{where}.result_guards", _RESULT_VARIABLES
        )
        schema = None
        if "schema" in table:
            schema = _read_schema(reader, table["schema"], f"{where}.schema", tool)
        reconcile = None
        if "reconcile" in table:
            rwhere = f"{where}.reconcile"
            rtable = reader.table(table["reconcile"], rwhere, _RECONCILE_KEYS)
            for key in _RECONCILE_KEYS:
                if key not in rtable:
                    raise reader.fail(
                        f"{rwhere}.{key}", "missing; a reconcile needs tool and applied"
                    )
            if kind != "neither":
                raise reader.fail(
                    rwhere,
                    f"{tool} is {kind}: a call of it in doubt is simply retried; only a tool "
                    'of kind "neither" is reconciled, so remove the reconcile',
                )
            rtool = reader.string(rtable["tool"], f"{rwhere}.tool")
            expression, program = reader.cel(
                rtable["applied"], f"{rwhere}.applied", _RECONCILE_VARIABLES
            )
            reconcile = ReconcileSpec(rtool, expression, program)
            reconcile_tools.append((rtool, f"{rwhere}.tool"))
            first_named.setdefault(rtool, f"{rwhere}.tool")
        specs[tool] = ToolSpec(
            name=tool,
            kind=kind,
            moves_to=moves_to,
            guards=guards,
            schema=schema,
            approval=reader.flag(table.get("approval", False), f"{where}.approval"),
            repeatable=reader.flag(table.get("repeatable", False), f"{where}.repeatable"),
            reconcile=reconcile,
            result_guards=result_guards,
            timeout=(
                reader.number(table["timeout"], f"{where}.timeout", float)
                if "timeout" in table
                else 30.0
            ),
            where=first_named[tool],
        )
    for rtool, where in reconcile_tools:
        if rtool not in specs or specs[rtool].kind != "read-only":
            raise reader.fail(
                where,
                f"{_q(rtool)} must be declared read-only to reconcile with it; add "
                f'[tools.{rtool}] kind = "read-only"',
            )
    every_tool = {
        name: specs.get(name) or ToolSpec(name, where=w) for name, w in first_named.items()
    }

    return MachineSpec(
        path=reader.path,
        name=machine_name,
        initial=initial,
        states=states,
        tools=every_tool,
        budgets=Budgets(**_read_numbers(reader, data, "budgets", _BUDGET_KEYS)),
        breakers=BreakerPolicy(**_read_numbers(reader, data, "breakers", _BREAKER_KEYS)),
        transition_tool=transition,
        reasks=_read_reasks(reader, machine),
    )


def _read_reasks(reader: _Reader, machine: dict[str, Any]) -> int | None:
    if "reasks" not in machine:
        return None
    value = machine["reasks"]
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100):
        raise reader.fail(
            "machine.reasks",
            f"must be a whole number from 0 to 100 (0: the refusal is answered at once); "
            f"got {_show(value)}",
        )
    return value


def _read_guards(
    reader: _Reader, value: Any, where: str, variables: tuple[str, ...] = _GUARD_VARIABLES
) -> tuple[GuardSpec, ...]:
    if not isinstance(value, list):
        raise reader.fail(
            where, f"must be a list of CEL expressions or [[{where}]] tables; got {_show(value)}"
        )
    guards = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if isinstance(item, str):
            expression, program = reader.cel(item, at, variables)
            guards.append(GuardSpec(expression, where=at, program=program))
            continue
        if not isinstance(item, dict):
            raise reader.fail(
                at, f"must be a CEL expression or a table with when; got {_show(item)}"
            )
        table = reader.table(item, at, _GUARD_KEYS)
        if "when" not in table:
            raise reader.fail(f"{at}.when", 'missing; write when = "CEL expression"')
        expression, program = reader.cel(table["when"], f"{at}.when", variables)
        guards.append(
            GuardSpec(
                expression,
                reader.string(table.get("message", ""), f"{at}.message", empty=True),
                reader.string(table.get("hint", ""), f"{at}.hint", empty=True),
                at,
                program,
            )
        )
    return tuple(
        GuardSpec(g.when, g.message, g.hint, g.where, g.program, _uses(g.when, variables))
        for g in guards
    )


def _read_schema(reader: _Reader, value: Any, where: str, tool: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise reader.fail(where, f"is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise reader.fail(
            where, f"must be a JSON Schema object (a table or a JSON string); got {_show(value)}"
        )
    try:
        schema = _inline_refs(value, tool)
        compile_schema(schema, tool)
    except ToolDefinitionError as exc:
        raise reader.fail(where, _schema_problem(exc, tool)) from None
    return schema


_DEFS = ("$defs", "definitions")
#: What may stand beside a ``$ref`` and be kept: annotations, which check nothing.
_REF_SIBLINGS = frozenset({"$ref", "title", "description", "default", "examples", "$comment"})


def _inline_refs(schema: dict[str, Any], tool: str) -> dict[str, Any]:
    """``schema`` with each local ``$ref`` (``#/$defs/NAME``, ``#/definitions/NAME``)
    replaced by its definition, and the definitions dropped.

    Python MCP servers (pydantic) name every nested model this way; interlock's schema
    compiler takes neither keyword. A recursive definition cannot be inlined, and
    another ``$ref`` is left for the compiler to refuse.

    Raises:
      ToolDefinitionError: a recursive definition, or a ``$ref`` to none.
    """
    defs: dict[str, Any] = {}
    for key in _DEFS:
        found = schema.get(key)
        if isinstance(found, Mapping):
            defs.update({f"#/{key}/{name}": value for name, value in found.items()})
    if not defs:
        return schema

    def inline(node: Any, where: str, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [inline(item, f"{where}[{i}]", seen) for i, item in enumerate(node)]
        if not isinstance(node, Mapping):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            if ref not in defs:
                raise ToolDefinitionError(
                    f"tool {tool!r}: JSON Schema at {where}: $ref {ref!r} names no definition"
                )
            if ref in seen:
                raise ToolDefinitionError(
                    f"tool {tool!r}: JSON Schema at {where}: $ref {ref!r} is recursive, which "
                    "interlock's schema compiler cannot check"
                )
            extra = {k: v for k, v in node.items() if k != "$ref"}
            if set(extra) - _REF_SIBLINGS or not isinstance(defs[ref], Mapping):
                return node  # the compiler refuses the $ref, naming it
            return {**inline(defs[ref], where, (*seen, ref)), **extra}
        return {
            key: inline(value, f"{where}.{key}", seen)
            for key, value in node.items()
            if not (node is schema and key in _DEFS)
        }

    result: dict[str, Any] = inline(schema, "args", ())
    return result


def _schema_problem(exc: ToolDefinitionError, tool: str) -> str:
    return str(exc).removeprefix(f"tool {tool!r}: ").replace(", or a msgspec Struct", "")


def _read_numbers(
    reader: _Reader, data: dict[str, Any], section: str, keys: Mapping[str, type]
) -> dict[str, Any]:
    table = reader.table(data.get(section, {}), section, list(keys))
    return {
        key: reader.number(value, f"{section}.{key}", keys[key]) for key, value in table.items()
    }


def _reachable(initial: str, states: Mapping[str, StateSpec]) -> set[str]:
    seen = {initial}
    todo = [initial]
    while todo:
        spec = states.get(todo.pop())
        for dst in () if spec is None else spec.next:
            if dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return seen


# -- building the machine ----------------------------------------------------------------


def _builtins(value: Any) -> Any:
    if isinstance(value, Mapping) and not isinstance(value, dict):
        value = dict(value)
    if isinstance(value, dict | list | str | int | float | bool) or value is None:
        return value
    return msgspec.to_builtins(value)


class _CelGuard:
    """A tool's CEL guard, as interlock calls it: ``guard(args, view) -> Reject | None``."""

    __slots__ = ("__name__", "_guard", "_tool", "_zeros")

    def __init__(self, tool: str, guard: GuardSpec, tools: Sequence[str]) -> None:
        self.__name__ = guard.where or f"guard of {tool}"
        self._tool = tool
        self._guard = guard
        self._zeros = dict.fromkeys(tools, 0)

    def __call__(self, args: Any, view: RunView) -> Reject | None:
        guard = self._guard
        activation: dict[str, Any] = {}
        for name in guard.uses:
            if name == "args":
                activation["args"] = _builtins(args)
            elif name == "state":
                activation["state"] = view.state
            elif name == "inputs":
                activation["inputs"] = dict(view.inputs)
            elif name == "history":
                activation["history"] = [
                    {"tool": r.tool, "args": r.args, "result": r.result} for r in view.results
                ]
            else:
                activation["calls"] = {**self._zeros, **Counter(r.tool for r in view.results)}
        holds, error = _evaluate(guard.program, activation)
        hint = guard.hint or f"change the arguments so that `{guard.when}` holds"
        if holds is None:
            return Reject(
                f"{self._tool}: guard `{guard.when}` could not be evaluated: {error}", hint
            )
        if holds:
            return None
        if guard.message:
            return Reject(f"{self._tool}: {guard.message}", hint)
        return Reject(f"{self._tool}: guard `{guard.when}` is false", hint)


def _executed_by_the_proxy(name: str) -> Any:
    async def execute(args: Any, ctx: ToolContext) -> Any:
        raise ConfigurationError(
            f"tool {name!r} is called by the MCP proxy, not by interlock: run machines "
            "built by build_machine as external runs"
        )

    execute.__name__ = f"execute_{name}"
    return execute


def _reconciled_by_the_proxy(name: str) -> Any:
    async def reconcile(key: str, args: Any, ctx: ToolContext) -> Any:
        raise ConfigurationError(
            f"a call of {name!r} in doubt is reconciled by the MCP proxy (its reconcile "
            "tool and expression), not by interlock: run machines built by build_machine "
            "as external runs"
        )

    reconcile.__name__ = f"reconcile_{name}"
    return reconcile


def build_machine(spec: MachineSpec, upstream_tools: Mapping[str, Mapping[str, Any]]) -> Machine:
    """Build the interlock machine of ``spec`` over the upstream server's tools.

    Each tool's args are the file's ``schema``, else the upstream's ``inputSchema``;
    its description is the upstream's; read_only / idempotent come from the file's
    ``kind`` (the upstream's annotations are not trusted); its guards are the file's
    CEL guards. Its ``execute`` raises: the proxy's runs are external, the proxy calls
    the upstream. A tool with a ``reconcile`` gets a placeholder: the proxy reconciles
    a call in doubt itself, with :meth:`MachineSpec.reconcile`. A state allowing a tool with
    ``moves_to`` is built with ``call_and_move``.

    Args:
      spec: from :func:`load_machine_file`.
      upstream_tools: the upstream's tools by name, each the MCP tool object as a dict
        (``inputSchema``, ``description``, ``annotations``), as the SDK's
        ``tool.model_dump(by_alias=True, exclude_none=True)`` gives it.

    Raises:
      ConfigurationError: a tool the file names is not upstream, or the upstream's
        inputSchema uses what interlock's schema compiler does not support (give the
        tool a ``schema`` in the file), or the transition tool's name is an upstream
        tool's.
    """
    reader = _Reader(spec.path)
    upstream = sorted(upstream_tools)
    for name, tool in spec.tools.items():
        if name not in upstream_tools:
            raise reader.fail(
                tool.where,
                f"tool {_q(name)} is not among the upstream's tools: {_names(upstream)}",
            )
    if spec.transition_tool is not None and spec.transition_tool in upstream_tools:
        raise reader.fail(
            "machine.transition_tool",
            f"{_q(spec.transition_tool)} is also an upstream tool; choose another name",
        )
    names = list(spec.tools)
    tools = []
    for name, tool in spec.tools.items():
        info = upstream_tools[name]
        schema = tool.schema
        if schema is None:
            schema = info.get("inputSchema", info.get("input_schema")) or {"type": "object"}
            try:
                schema = _inline_refs(dict(schema), name)
                compile_schema(schema, name)
            except ToolDefinitionError as exc:
                raise reader.fail(
                    f"tools.{name}",
                    f"the upstream's inputSchema of {name} cannot be compiled: "
                    f"{_schema_problem(exc, name)}; give the tool a schema in the file "
                    f"([tools.{name}] schema = ...) using the keywords interlock supports",
                ) from None
        try:
            tools.append(
                Tool(
                    name,
                    _executed_by_the_proxy(name),
                    args=schema,
                    description=str(info.get("description") or ""),
                    guards=[_CelGuard(name, guard, names) for guard in tool.guards],
                    read_only=tool.kind == "read-only",
                    idempotent=tool.kind == "idempotent",
                    repeatable=tool.repeatable,
                    timeout=tool.timeout,
                    # marks the tool as one that reconciles, so a call in doubt is
                    # handed back for reconciling (Verdict.reconcile), not escalated
                    reconcile=_reconciled_by_the_proxy(name) if tool.reconcile else None,
                )
            )
        except ToolDefinitionError as exc:
            raise reader.fail(tool.where, str(exc)) from None
    states = {
        state.name: Worker(
            next=state.next,
            tools=state.tools,
            instructions=state.instructions,
            call_and_move=any(spec.tools[t].moves_to is not None for t in state.tools),
        )
        for state in spec.states.values()
    }
    try:
        return Machine(
            spec.name,
            spec.initial,
            states,
            tools=tools,
            budgets=spec.budgets,
            breakers=spec.breakers,
        )
    except MachineDefinitionError as exc:  # pragma: no cover - the file was checked on load
        raise reader.fail("machine", str(exc)) from None
