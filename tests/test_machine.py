"""Machine definitions: compiled integer tables, and every definition error with its text."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from interlock import (
    ESCALATE,
    FAILED,
    Go,
    Machine,
    MachineDefinitionError,
    ProviderPolicy,
    RetryPolicy,
    Step,
    Tool,
    ToolDefinitionError,
    Worker,
)


async def nop(args: Any, ctx: Any) -> None:
    return None


def finish(view: Any) -> Go:
    return Go("DONE")


def tool(name: str, **kwargs: Any) -> Tool:
    return Tool(name, nop, **kwargs)


def test_compile_assigns_ids_in_declaration_order_then_terminals() -> None:
    machine = Machine(
        "m",
        initial="WORK",
        states={
            "WORK": Worker(next=["REVIEW", "COMPLETED"], tools=["a", "b"]),
            "REVIEW": Step(finish, next=["DONE", "WORK"], tools=["c"]),
        },
        tools=[tool("a"), tool("b"), tool("c")],
    )
    tables = machine.tables
    assert tables.states == ("WORK", "REVIEW", "COMPLETED", "DONE", ESCALATE, FAILED)
    assert tables.tools == ("a", "b", "c")
    assert [tables.state_id(s) for s in tables.states] == [0, 1, 2, 3, 4, 5]
    assert tables.state_id("NOPE") == -1
    assert tables.tool_id("c") == 2
    assert tables.tool_id("nope") == -1


def test_compile_builds_edge_and_tool_bitmasks() -> None:
    machine = Machine(
        "m",
        initial="WORK",
        states={
            "WORK": Worker(next=["REVIEW", "COMPLETED"], tools=["a", "b"]),
            "REVIEW": Step(finish, next=["DONE", "WORK"], tools=["c"]),
        },
        tools=[tool("a"), tool("b"), tool("c")],
    )
    tables = machine.tables
    # WORK -> REVIEW (1), COMPLETED (2); REVIEW -> WORK (0), DONE (3); terminals have no way out
    assert tables.edges == (0b110, 0b1001, 0, 0, 0, 0)
    assert tables.tool_masks == (0b011, 0b100, 0, 0, 0, 0)
    # COMPLETED, DONE, ESCALATE, FAILED
    assert tables.terminal == 0b111100
    assert tables.legal_next(0) == ("REVIEW", "COMPLETED")
    assert tables.allowed_tools(1) == ("c",)
    assert [tables.is_terminal(i) for i in range(6)] == [False, False, True, True, True, True]


def test_compile_includes_declared_success_states_only_when_used() -> None:
    machine = Machine(
        "m",
        initial="WORK",
        states={"WORK": Worker(next=["SHIPPED"])},
        success=["SHIPPED"],
    )
    assert machine.tables.states == ("WORK", "SHIPPED", ESCALATE, FAILED)
    assert machine.success_states == frozenset({"COMPLETED", "DONE", "SHIPPED"})
    assert machine.is_terminal("SHIPPED")
    assert machine.outcome("SHIPPED") == "completed"
    assert machine.outcome(ESCALATE) == "escalated"
    assert machine.outcome(FAILED) == "failed"
    assert machine.outcome("WORK") == "running"


def test_compile_accepts_64_states() -> None:
    # 61 declared states + COMPLETED + ESCALATE + FAILED = 64
    states = {f"S{i}": Worker(next=[f"S{i + 1}" if i < 60 else "COMPLETED"]) for i in range(61)}
    machine = Machine("m", initial="S0", states=states)
    assert len(machine.tables.states) == 64


def test_compile_accepts_a_fallback_reachable_only_through_on_breaker() -> None:
    machine = Machine(
        "m",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"]), "FALLBACK": Step(finish, next=["DONE"])},
        on_breaker="FALLBACK",
    )
    assert machine.tables.states == ("WORK", "FALLBACK", "COMPLETED", "DONE", ESCALATE, FAILED)


MACHINE_ERRORS = [
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next="COMPLETED")}),
        "machine 'm': state 'A': next must be a list of names, not the string 'COMPLETED'; "
        "write next=['COMPLETED']",
        id="next-a-string",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["COMPLETED"], tools="t")}, tools=[tool("t")]),
        "machine 'm': state 'A': tools must be a list of names, not the string 't'; "
        "write tools=['t']",
        id="tools-a-string",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["COMPLETED", 3])}),
        "machine 'm': state 'A': next must be a list of names (str); got ['COMPLETED', 3]",
        id="next-not-names",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Step("finish", next=["DONE"])}),
        "machine 'm': state 'A': Step needs a function view -> Call | Go; got 'finish'",
        id="step-fn-a-string",
    ),
    pytest.param(
        lambda: Machine(
            "m", "A", {"A": Worker(next=["COMPLETED"])}, provider_policy=ProviderPolicy(timeout=0)
        ),
        "machine 'm': provider_policy.timeout must be a positive number of seconds; got 0",
        id="provider-timeout",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["B"])}),
        "machine 'm': edge A -> B names an unknown state 'B'; known states: A, ESCALATE, FAILED",
        id="unknown-state-in-edge",
    ),
    pytest.param(
        lambda: Machine(
            "m", "A", {"A": Worker(next=["COMPLETED"], tools=["x"])}, tools=[tool("t")]
        ),
        "machine 'm': state 'A' allows unknown tool 'x'; declared tools: t",
        id="unknown-tool-in-state",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Step(finish, next=["DONE"], tools=["x"])}),
        "machine 'm': state 'A' allows unknown tool 'x'; declared tools: none",
        id="unknown-tool-no-tools",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["COMPLETED"])}, tools=[tool("t"), tool("t")]),
        "machine 'm': duplicate tool 't'; tool names must be unique",
        id="duplicate-tool",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["COMPLETED", "B"]), "B": Worker(next=[])}),
        "machine 'm': state 'B' has no way out; give it at least one next state",
        id="no-way-out",
    ),
    pytest.param(
        lambda: Machine(
            "m", "A", {"A": Worker(next=["COMPLETED"]), "B": Worker(next=["COMPLETED"])}
        ),
        "machine 'm': state 'B' is unreachable from 'A'",
        id="unreachable-state",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["B", FAILED]), "B": Worker(next=[ESCALATE])}),
        "machine 'm': no success terminal state (COMPLETED, DONE) is reachable from 'A'",
        id="no-reachable-success",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=[FAILED])}, success=["SHIPPED"]),
        "machine 'm': no success terminal state (COMPLETED, DONE, SHIPPED) is reachable from 'A'",
        id="no-reachable-success-declared",
    ),
    pytest.param(
        lambda: Machine("m", "X", {"A": Worker(next=["COMPLETED"])}),
        "machine 'm': initial state 'X' is not declared; declared states: A",
        id="initial-not-declared",
    ),
    pytest.param(
        lambda: Machine("m", "X", {}),
        "machine 'm': initial state 'X' is not declared; declared states: none",
        id="initial-no-states",
    ),
    pytest.param(
        lambda: Machine(
            "m", "A", {"A": Worker(next=["COMPLETED"]), "COMPLETED": Worker(next=["A"])}
        ),
        "machine 'm': state 'COMPLETED' is terminal and cannot have a spec",
        id="terminal-with-spec",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["DONE"]), ESCALATE: Step(finish, next=["A"])}),
        "machine 'm': state 'ESCALATE' is terminal and cannot have a spec",
        id="escalate-with-spec",
    ),
    pytest.param(
        lambda: Machine(
            "m",
            "A",
            {"A": Worker(next=["SHIPPED"]), "SHIPPED": Worker(next=["A"])},
            success=["SHIPPED"],
        ),
        "machine 'm': state 'SHIPPED' is terminal and cannot have a spec",
        id="declared-success-with-spec",
    ),
    pytest.param(
        lambda: Machine(
            "m",
            "A",
            {"A": Worker(next=["COMPLETED", "B"]), "B": Worker(next=["COMPLETED"])},
            on_breaker="B",
        ),
        "machine 'm': on_breaker must be 'ESCALATE' or the name of a Step state; got 'B'",
        id="on-breaker-worker",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": Worker(next=["COMPLETED"])}, on_breaker="NOPE"),
        "machine 'm': on_breaker must be 'ESCALATE' or the name of a Step state; got 'NOPE'",
        id="on-breaker-unknown",
    ),
    pytest.param(
        # 62 declared states + COMPLETED + ESCALATE + FAILED = 65
        lambda: Machine(
            "m",
            "S0",
            {f"S{i}": Worker(next=[f"S{i + 1}" if i < 61 else "COMPLETED"]) for i in range(62)},
        ),
        "machine 'm' has 65 states; at most 64 are supported",
        id="65-states",
    ),
    pytest.param(
        lambda: Machine(
            "m", "A", {"A": Worker(next=["COMPLETED"])}, tools=[tool(f"t{i}") for i in range(65)]
        ),
        "machine 'm' has 65 tools; at most 64 are supported",
        id="65-tools",
    ),
    pytest.param(
        lambda: Machine("", "A", {"A": Worker(next=["COMPLETED"])}),
        "machine name must not be empty",
        id="empty-name",
    ),
    pytest.param(
        lambda: Machine("m", "A", {"A": {"next": ["COMPLETED"]}}),
        "machine 'm': state 'A' must be a Worker or a Step; got dict",
        id="not-a-spec",
    ),
]


@pytest.mark.parametrize(("build", "message"), MACHINE_ERRORS)
def test_machine_definition_error(build: Any, message: str) -> None:
    with pytest.raises(MachineDefinitionError, match=f"^{re.escape(message)}$"):
        build()


def test_machine_definition_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^machine name must not be empty$"):
        Machine("", "A", {"A": Worker(next=["COMPLETED"])})


_NAME_RULE = "use 1-64 letters, digits, '_', '.' or '-', starting with a letter or '_'"
_ARGS_RULE = (
    "args must be a msgspec Struct class, a pydantic model, a pydantic-core schema or a "
    "JSON Schema object"
)


def guard_of_args(args):  # type: ignore[no-untyped-def]
    return None


def guard_with_limit(args, view, limit):  # type: ignore[no-untyped-def]
    return None


async def async_guard(args, view):  # type: ignore[no-untyped-def]
    return None


class _GuardObject:
    def __call__(self, args: Any, view: Any, limit: float = 100.0) -> None:
        return None

    def method(self, args: Any, view: Any) -> None:
        return None


TOOL_ERRORS = [
    pytest.param(
        {"name": "9lives"}, f"tool name '9lives' is invalid; {_NAME_RULE}", id="digit-first"
    ),
    pytest.param({"name": "a b"}, f"tool name 'a b' is invalid; {_NAME_RULE}", id="space"),
    pytest.param({"name": ""}, f"tool name '' is invalid; {_NAME_RULE}", id="empty"),
    pytest.param(
        {"name": "x" * 65}, f"tool name '{'x' * 65}' is invalid; {_NAME_RULE}", id="65-chars"
    ),
    pytest.param(
        {"execute": 5},
        "tool 't': execute must be an async function (async def execute(args, ctx)); got 5",
        id="execute-not-callable",
    ),
    pytest.param(
        {"execute": lambda args, ctx: None},
        "tool 't': execute must be an async function (async def execute(args, ctx)); got the "
        "plain function '<lambda>': make it async, or run blocking work in it with "
        "trio.to_thread.run_sync(..., abandon_on_cancel=True)",
        id="execute-plain-def",
    ),
    pytest.param(
        {"guards": ["within_total"]},
        "tool 't': guards must be functions (args, view) -> Reject | None; got 'within_total': "
        "pass the function itself, not its name",
        id="guard-as-string",
    ),
    pytest.param(
        {"guards": "within_total"},
        "tool 't': guards must be functions (args, view) -> Reject | None; got 'within_total': "
        "pass the function itself, not its name",
        id="guards-a-string",
    ),
    pytest.param(
        {"guards": [guard_of_args]},
        "tool 't': guard 'guard_of_args' takes (args), but a guard is called with two "
        "positional arguments, guard(args, view): write def guard_of_args(args, view) -> "
        "Reject | None",
        id="guard-one-parameter",
    ),
    pytest.param(
        {"guards": [guard_with_limit]},
        "tool 't': guard 'guard_with_limit' takes (args, view, limit), but a guard is called "
        "with two positional arguments, guard(args, view): write def guard_with_limit(args, "
        "view) -> Reject | None",
        id="guard-three-parameters",
    ),
    pytest.param(
        {"guards": [lambda args, *, view: None]},
        "tool 't': guard '<lambda>' takes (args, *, view), but a guard is called with two "
        "positional arguments, guard(args, view): write def <lambda>(args, view) -> "
        "Reject | None",
        id="guard-keyword-only-view",
    ),
    pytest.param(
        {"guards": [async_guard]},
        "tool 't': guard 'async_guard' is async; a guard is a plain function that does no "
        "I/O, called as guard(args, view): write def async_guard(args, view) -> Reject | None",
        id="guard-async",
    ),
    pytest.param(
        {"repeatable": "yes"},
        "tool 't': repeatable must be True or False; got 'yes'",
        id="repeatable-not-a-bool",
    ),
    pytest.param(
        {"reconcile": lambda key, args, ctx: None},
        "tool 't': reconcile must be an async function (async def reconcile(key, args, ctx)); "
        "got '<lambda>'",
        id="reconcile-plain-def",
    ),
    pytest.param(
        {"not_applied": ("ConnectionError",)},
        "tool 't': not_applied must be a tuple of exception types; got ('ConnectionError',)",
        id="not-applied-names",
    ),
    pytest.param(
        {"timeout": 0},
        "tool 't': timeout must be a positive number of seconds; got 0",
        id="timeout-zero",
    ),
    pytest.param(
        {"timeout": -1.5},
        "tool 't': timeout must be a positive number of seconds; got -1.5",
        id="timeout-negative",
    ),
    pytest.param(
        {"timeout": float("inf")},
        "tool 't': timeout must be a positive number of seconds; got inf",
        id="timeout-inf",
    ),
    pytest.param(
        {"timeout": float("nan")},
        "tool 't': timeout must be a positive number of seconds; got nan",
        id="timeout-nan",
    ),
    pytest.param(
        {"timeout": "5"},
        "tool 't': timeout must be a positive number of seconds; got '5'",
        id="timeout-str",
    ),
    pytest.param(
        {"retry": RetryPolicy(attempts=0)},
        "tool 't': retry.attempts must be at least 1; got 0",
        id="retry-attempts",
    ),
    pytest.param({"args": 5}, f"tool 't': {_ARGS_RULE}; got 5", id="schema-int"),
    pytest.param({"args": int}, f"tool 't': {_ARGS_RULE}; got <class 'int'>", id="schema-class"),
    pytest.param(
        {"args": {"type": "object", "properties": {}, "required": ["a"]}},
        "tool 't': required field 'a' at args has no entry in 'properties'",
        id="schema-required-unknown",
    ),
    pytest.param(
        {"args": {"type": "object", "properties": {"a": {"enum": []}}}},
        "tool 't': empty enum at args.a",
        id="schema-empty-enum",
    ),
    pytest.param(
        {"args": {"type": "nope"}},
        "tool 't': invalid pydantic-core schema: Unknown schema type: \"nope\"",
        id="schema-bad-core",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), TOOL_ERRORS)
def test_tool_definition_error(overrides: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {"name": "t", "execute": nop, **overrides}
    with pytest.raises(ToolDefinitionError, match=f"^{re.escape(message)}$"):
        Tool(**kwargs)


@pytest.mark.parametrize(
    "guard",
    [
        lambda args, view: None,
        lambda args, view, limit=1: None,
        lambda *parts: None,
        _GuardObject(),
        _GuardObject().method,
    ],
    ids=["two", "a-default-more", "star-args", "callable-object", "bound-method"],
)
def test_a_guard_callable_as_guard_args_view_is_accepted(guard: Any) -> None:
    """Issue 32: a guard is checked when the tool is built, and only refused when the gate
    could not call it as ``guard(args, view)``."""
    tool = Tool("t", nop, guards=[guard])
    assert tool.guards == (guard,)


def test_tool_definition_error_for_a_worker_data_schema() -> None:
    with pytest.raises(ToolDefinitionError, match=rf"^tool 'm\.A\.data': {_ARGS_RULE}; got 5$"):
        Machine("m", "A", {"A": Worker(next=["COMPLETED"], data=5)})


class Args(msgspec.Struct):
    x: int


@pytest.mark.parametrize(
    "name", ["a", "_private", "lookup_order", "db.write", "http-get", "A" * 64], ids=str
)
def test_tool_accepts_valid_names(name: str) -> None:
    assert Tool(name, nop, Args).name == name


def test_tool_safe_to_repeat() -> None:
    assert not tool("t").safe_to_repeat
    assert tool("t", idempotent=True).safe_to_repeat
    assert tool("t", read_only=True).safe_to_repeat
