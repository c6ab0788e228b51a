"""Transition and tool checks on compiled machine tables."""

from __future__ import annotations

import pickle
from types import ModuleType
from typing import Any

import pytest

STATES = ["draft", "review", "approved", "rejected"]
TOOLS = ["lookup", "refund", "notify"]
# draft -> review; review -> draft, approved, rejected; rejected -> draft.
EDGES = [0b0010, 0b1101, 0b0000, 0b0001]
# draft: lookup; review: lookup, refund; approved: notify; rejected: none.
TOOL_MASKS = [0b001, 0b011, 0b100, 0b000]
TERMINAL = 0b0100

OUT_OF_RANGE = [-1, -2, 4, 5, 63, 64, 70, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**70)]


@pytest.fixture
def tables(hot: ModuleType) -> Any:
    return hot.Tables(STATES, TOOLS, EDGES, TOOL_MASKS, TERMINAL)


def test_codes_and_limits(hot: ModuleType) -> None:
    assert (hot.OK, hot.UNKNOWN_STATE, hot.ILLEGAL_TRANSITION) == (0, 1, 2)
    assert (hot.UNKNOWN_TOOL, hot.TOOL_NOT_ALLOWED) == (1, 2)
    assert (hot.FRAMES_OK, hot.FRAMES_TORN, hot.FRAMES_CORRUPT) == (0, 1, 2)
    assert hot.HEADER_SIZE == 12
    assert hot.MAX_IDS == 64


def test_attributes_read_back_as_tuples(hot: ModuleType, tables: Any) -> None:
    assert tables.states == tuple(STATES)
    assert tables.tools == tuple(TOOLS)
    assert tables.edges == tuple(EDGES)
    assert tables.tool_masks == tuple(TOOL_MASKS)
    assert tables.terminal == TERMINAL
    assert type(tables.terminal) is int
    assert all(type(mask) is int for mask in tables.edges + tables.tool_masks)


def test_ids_by_name(tables: Any) -> None:
    assert [tables.state_id(name) for name in STATES] == [0, 1, 2, 3]
    assert [tables.tool_id(name) for name in TOOLS] == [0, 1, 2]
    assert tables.state_id("nowhere") == -1
    assert tables.tool_id("nothing") == -1
    assert tables.state_id("lookup") == -1
    assert tables.tool_id("draft") == -1


def test_transition_codes(hot: ModuleType, tables: Any) -> None:
    assert tables.check_transition(0, 1) == hot.OK
    assert tables.check_transition(1, 0) == hot.OK
    assert tables.check_transition(1, 2) == hot.OK
    assert tables.check_transition(3, 0) == hot.OK
    assert tables.check_transition(0, 0) == hot.ILLEGAL_TRANSITION
    assert tables.check_transition(0, 2) == hot.ILLEGAL_TRANSITION
    assert tables.check_transition(2, 0) == hot.ILLEGAL_TRANSITION
    assert tables.check_transition(1, 1) == hot.ILLEGAL_TRANSITION


@pytest.mark.parametrize("bad", OUT_OF_RANGE)
def test_transition_with_unknown_state(hot: ModuleType, tables: Any, bad: int) -> None:
    assert tables.check_transition(0, bad) == hot.UNKNOWN_STATE
    assert tables.check_transition(bad, 1) == hot.UNKNOWN_STATE
    assert tables.check_transition(bad, bad) == hot.UNKNOWN_STATE


def test_transition_with_unknown_name(hot: ModuleType, tables: Any) -> None:
    assert tables.check_transition(0, tables.state_id("nowhere")) == hot.UNKNOWN_STATE


def test_tool_codes(hot: ModuleType, tables: Any) -> None:
    assert tables.check_tool(0, 0) == hot.OK
    assert tables.check_tool(1, 1) == hot.OK
    assert tables.check_tool(2, 2) == hot.OK
    assert tables.check_tool(0, 1) == hot.TOOL_NOT_ALLOWED
    assert tables.check_tool(2, 0) == hot.TOOL_NOT_ALLOWED
    assert tables.check_tool(3, 0) == hot.TOOL_NOT_ALLOWED


@pytest.mark.parametrize("bad", OUT_OF_RANGE)
def test_tool_with_unknown_id(hot: ModuleType, tables: Any, bad: int) -> None:
    assert tables.check_tool(1, bad) == hot.UNKNOWN_TOOL
    # An unknown state also answers UNKNOWN_TOOL: nothing is allowed there.
    assert tables.check_tool(bad, 0) == hot.UNKNOWN_TOOL


def test_tool_with_unknown_name(hot: ModuleType, tables: Any) -> None:
    assert tables.check_tool(1, tables.tool_id("nothing")) == hot.UNKNOWN_TOOL


def test_call_codes_by_name(hot: ModuleType, tables: Any) -> None:
    assert tables.check_call("draft", "lookup") == hot.OK
    assert tables.check_call("review", "refund") == hot.OK
    assert tables.check_call("approved", "notify") == hot.OK
    assert tables.check_call("draft", "refund") == hot.TOOL_NOT_ALLOWED
    assert tables.check_call("rejected", "lookup") == hot.TOOL_NOT_ALLOWED
    assert tables.check_call("review", "nothing") == hot.UNKNOWN_TOOL
    # An unknown state also answers UNKNOWN_TOOL, as check_tool does for its id -1.
    assert tables.check_call("nowhere", "lookup") == hot.UNKNOWN_TOOL
    assert tables.check_call("lookup", "draft") == hot.UNKNOWN_TOOL


def test_call_equals_the_tool_check_on_the_ids(tables: Any) -> None:
    for state in [*STATES, "nowhere", "lookup", ""]:
        for tool in [*TOOLS, "nothing", "draft", ""]:
            assert tables.check_call(state, tool) == tables.check_tool(
                tables.state_id(state), tables.tool_id(tool)
            )


def test_call_with_unhashable_names(tables: Any) -> None:
    with pytest.raises(TypeError, match=r"^unhashable type: 'list'$"):
        tables.check_call([], "lookup")
    with pytest.raises(TypeError, match=r"^unhashable type: 'dict'$"):
        tables.check_call("draft", {})
    # The state is looked up first.
    with pytest.raises(TypeError, match=r"^unhashable type: 'list'$"):
        tables.check_call([], {})


def test_bool_ids_act_as_ints(hot: ModuleType, tables: Any) -> None:
    assert tables.check_transition(False, True) == hot.OK
    assert tables.check_tool(True, True) == hot.OK
    assert tables.is_terminal(True) is False


def test_legal_next_in_id_order(tables: Any) -> None:
    assert tables.legal_next(0) == ("review",)
    assert tables.legal_next(1) == ("draft", "approved", "rejected")
    assert tables.legal_next(2) == ()
    assert tables.legal_next(3) == ("draft",)


def test_allowed_tools_in_id_order(tables: Any) -> None:
    assert tables.allowed_tools(0) == ("lookup",)
    assert tables.allowed_tools(1) == ("lookup", "refund")
    assert tables.allowed_tools(2) == ("notify",)
    assert tables.allowed_tools(3) == ()


def test_names_past_the_last_id_are_ignored(hot: ModuleType) -> None:
    tables = hot.Tables(["a", "b"], ["t"], [-1, 0b100], [-1, 0b10], -1)
    assert tables.legal_next(0) == ("a", "b")
    assert tables.legal_next(1) == ()
    assert tables.allowed_tools(0) == ("t",)
    assert tables.allowed_tools(1) == ()
    assert tables.check_transition(1, 2) == hot.UNKNOWN_STATE


@pytest.mark.parametrize("bad", [-1, -2, 4, 64, 2**70])
def test_unknown_state_ids_have_no_next_states_or_tools(tables: Any, bad: int) -> None:
    """state_id() returns -1 for an unknown name; that must never read another state's row."""
    assert tables.legal_next(bad) == ()
    assert tables.allowed_tools(bad) == ()


def test_legal_next_with_a_float(tables: Any) -> None:
    with pytest.raises(TypeError, match=r"^tuple indices must be integers or slices, not float$"):
        tables.legal_next(1.0)


def test_is_terminal(tables: Any) -> None:
    assert [tables.is_terminal(state) for state in range(4)] == [False, False, True, False]
    assert all(tables.is_terminal(bad) is False for bad in OUT_OF_RANGE)
    assert tables.is_terminal(2) is True


def test_masks_are_reduced_to_64_bits(hot: ModuleType) -> None:
    tables = hot.Tables(["a"], ["t"], [-1], [2**64 | 1], 2**70 | 1)
    assert tables.edges == (2**64 - 1,)
    assert tables.tool_masks == (1,)
    assert tables.terminal == 1


def test_64_states_and_tools(hot: ModuleType) -> None:
    names = [f"s{i}" for i in range(64)]
    tools = [f"t{i}" for i in range(64)]
    top = 1 << 63
    edges = [top | 1] * 64
    tables = hot.Tables(names, tools, edges, [top] * 64, top)
    assert tables.check_transition(0, 63) == hot.OK
    assert tables.check_transition(63, 0) == hot.OK
    assert tables.check_transition(5, 62) == hot.ILLEGAL_TRANSITION
    assert tables.check_transition(0, 64) == hot.UNKNOWN_STATE
    assert tables.check_tool(63, 63) == hot.OK
    assert tables.check_tool(63, 62) == hot.TOOL_NOT_ALLOWED
    assert tables.check_tool(63, 64) == hot.UNKNOWN_TOOL
    assert tables.check_call("s63", "t63") == hot.OK
    assert tables.check_call("s0", "t62") == hot.TOOL_NOT_ALLOWED
    assert tables.is_terminal(63) is True
    assert tables.is_terminal(62) is False
    assert tables.legal_next(10) == ("s0", "s63")
    assert tables.allowed_tools(10) == ("t63",)
    assert tables.state_id("s63") == 63


def test_empty_tables(hot: ModuleType) -> None:
    tables = hot.Tables([], [], [], [], 0)
    assert tables.check_transition(0, 0) == hot.UNKNOWN_STATE
    assert tables.check_tool(0, 0) == hot.UNKNOWN_TOOL
    assert tables.check_call("a", "t") == hot.UNKNOWN_TOOL
    assert tables.is_terminal(0) is False
    assert tables.state_id("a") == -1


def test_too_many_states(hot: ModuleType) -> None:
    names = [f"s{i}" for i in range(65)]
    with pytest.raises(
        ValueError,
        match=r"^tables hold at most 64 states and 64 tools; got 65 states and 2 tools$",
    ):
        hot.Tables(names, ["a", "b"], [0] * 65, [0] * 65, 0)


def test_too_many_tools(hot: ModuleType) -> None:
    tools = [f"t{i}" for i in range(70)]
    with pytest.raises(
        ValueError,
        match=r"^tables hold at most 64 states and 64 tools; got 1 states and 70 tools$",
    ):
        hot.Tables(["a"], tools, [0], [0], 0)


def test_edges_per_state(hot: ModuleType) -> None:
    with pytest.raises(
        ValueError,
        match=(
            r"^tables need one edge mask and one tool mask per state; "
            r"got 2 states, 1 edge masks and 2 tool masks$"
        ),
    ):
        hot.Tables(["a", "b"], [], [0], [0, 0], 0)


def test_tool_masks_per_state(hot: ModuleType) -> None:
    with pytest.raises(
        ValueError,
        match=(
            r"^tables need one edge mask and one tool mask per state; "
            r"got 2 states, 2 edge masks and 3 tool masks$"
        ),
    ):
        hot.Tables(["a", "b"], [], [0, 0], [0, 0, 0], 0)


def test_mask_that_is_not_a_number(hot: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^invalid literal for int\(\) with base 10: 'x'$"):
        hot.Tables(["a"], [], ["x"], [0], 0)


def test_survives_pickle(hot: ModuleType, tables: Any) -> None:
    copy = pickle.loads(pickle.dumps(tables))
    assert type(copy) is hot.Tables
    assert (copy.states, copy.tools, copy.edges, copy.tool_masks, copy.terminal) == (
        tables.states,
        tables.tools,
        tables.edges,
        tables.tool_masks,
        tables.terminal,
    )
    assert copy.check_transition(1, 2) == hot.OK
    assert copy.check_call("review", "refund") == hot.OK
    assert copy.state_id("rejected") == 3
