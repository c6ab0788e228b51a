"""The run's folded view: committed calls as ``ToolResult``."""

from __future__ import annotations

import math
import sys
from typing import Any, Literal

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from interlock import Machine, RunView, Tool, ToolResult, Worker
from interlock.core._view import fold
from interlock.core._wire import system_text
from interlock.events import RunStarted, Transitioned
from interlock.providers import render_prompt

# What committed args are: JSON-like builtins, as the gate or the journal hands them over.
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=15,
)
_args = st.dictionaries(st.text(max_size=8), _values, max_size=6)


@given(_args)
def test_args_read_back_equal_and_in_order(args: dict[str, Any]) -> None:
    result = ToolResult("refund", args, {"ok": True}, "r-1:WORK:3", 3)
    assert result.args == args
    assert list(result.args) == list(args)
    assert result.args is not result.args  # a fresh dict each read: the stored one cannot change
    assert result == ToolResult("refund", dict(args), {"ok": True}, "r-1:WORK:3", 3)


def test_args_keep_floats_that_json_cannot_hold() -> None:
    result = ToolResult("t", {"a": math.inf, "b": -0.0, "c": 1e308}, None, "k", 1)
    assert result.args == {"a": math.inf, "b": -0.0, "c": 1e308}
    assert math.copysign(1.0, result.args["b"]) == -1.0


def test_tool_result_is_immutable_and_unhashable() -> None:
    result = ToolResult("t", {"a": 1}, {"x": 2}, "k", 7)
    with pytest.raises(AttributeError, match="ToolResult is immutable; cannot set 'tool'"):
        result.tool = "other"  # type: ignore[misc]
    with pytest.raises(TypeError, match="unhashable"):
        hash(result)
    assert repr(result) == "ToolResult(tool='t', args={'a': 1}, result={'x': 2}, key='k', seq=7)"
    assert result != ToolResult("t", {"a": 2}, {"x": 2}, "k", 7)
    assert result != "t"


@given(_values)
def test_result_reads_back_equal_and_fresh(value: Any) -> None:
    result = ToolResult("t", {}, value, "k", 1)
    assert result.result == value
    assert result == ToolResult("t", {}, value, "k", 1)
    if isinstance(value, (dict, list)):
        # Held packed: each read is a fresh copy, so a caller's change cannot reach it.
        assert result.result is not result.result
        copy = result.result
        if isinstance(copy, list):
            copy.append("x")
        else:
            copy["x"] = 1
        assert result.result == value
    else:
        assert result.result is value  # a scalar is held as it is


def test_container_result_is_held_smaller_than_the_dict() -> None:
    value = {"ok": True, "id": "order-1234", "items": [1, 2, 3]}
    held = ToolResult("t", {}, value, "k", 1)._result
    assert isinstance(held, bytes)
    assert sys.getsizeof(held) < sys.getsizeof(value)


def test_result_msgpack_cannot_hold_is_kept_as_given() -> None:
    # Not from the journal (which holds only what msgpack can): kept, not refused.
    value = {"big": 2**70, "set": {1, 2}}
    result = ToolResult("t", {}, value, "k", 1)
    assert result.result is value
    assert repr(result) == (
        "ToolResult(tool='t', args={}, result={'big': 1180591620717411303424, 'set': {1, 2}}, "
        "key='k', seq=1)"
    )


def _committed(args: dict[str, Any], result: Any) -> Any:
    """A run folded through a call of ``args`` committed with ``result``: its view."""
    from benchmarks._workload import build_machine, run_state
    from interlock import RunView
    from interlock.events import IntentRecorded, ToolCommitted

    run = run_state(build_machine())
    run.apply(
        IntentRecorded(
            run_id=run.run_id, seq=2, ts=2.0, state="WORK", tool="refund", args=args, key="k2"
        )
    )
    run.apply(
        ToolCommitted(run_id=run.run_id, seq=3, ts=3.0, tool="refund", key="k2", result=result)
    )
    return RunView(run)


@given(_args, _values)
def test_a_folded_commit_reads_back_its_args_and_result_whatever_its_frame_shows(
    args: dict[str, Any], value: Any
) -> None:
    # The frame's JSON is the only copy of args and result where it holds them whole
    # (short, and equal when decoded); else they are packed. Either way they read back.
    view = _committed(args, value)
    (done,) = view.results
    assert done.args == args
    assert list(done.args) == list(args)
    assert done.result == value
    assert done == ToolResult("refund", args, value, "k2", 3)
    assert view.history[-1].text.startswith("refund(")


@pytest.mark.parametrize(
    ("args", "result"),
    [
        ({"a": math.inf, "b": -0.0}, {"x": math.inf}),  # JSON shows inf as null
        ({"long": "x" * 300}, ["y" * 300]),  # the frame cuts it at 200 characters
        ({"a": 1}, {"n": [1, 2.5, None, True, "s"]}),  # held in the frame text
        ({"b": b"raw"}, {"c": b"bytes"}),  # JSON shows bytes as base64 text
    ],
)
def test_a_folded_commit_keeps_what_its_frame_text_cannot_hold(
    args: dict[str, Any], result: Any
) -> None:
    view = _committed(args, result)
    (done,) = view.results
    assert done.args == args
    assert done.result == result
    if "b" in args and isinstance(args["b"], float):
        assert math.copysign(1.0, done.args["b"]) == -1.0
    assert done.result is not done.result


def test_a_folded_commit_shares_its_frame_text_instead_of_a_copy() -> None:
    view = _committed({"order_id": "ORD-000001", "tags": ["a"]}, {"ok": True})
    (done,) = view.results
    frame = view.history[-1]
    assert frame.text == 'refund({"order_id":"ORD-000001","tags":["a"]}) -> {"ok":true}'
    assert done._args is frame.text  # one copy of the args and the result: the frame's
    assert done.args == {"order_id": "ORD-000001", "tags": ["a"]}
    assert done.result == {"ok": True}


def test_a_folded_commit_reads_back_its_key_made_by_the_runtime_or_not() -> None:
    view = _committed({"a": 1}, None)
    assert view.results[0].key == "k2"  # not the runtime's form: held as it is
    from benchmarks._workload import build_machine, run_state
    from interlock import RunView
    from interlock.events import IntentRecorded, ToolCommitted

    run = run_state(build_machine(), "r-9")
    key = "r-9:WORK:2"  # the decider's form: {run id}:{state}:{intent seq}
    run.apply(
        IntentRecorded(
            run_id="r-9", seq=2, ts=2.0, state="WORK", tool="refund", args={"a": 1}, key=key
        )
    )
    run.apply(ToolCommitted(run_id="r-9", seq=3, ts=3.0, tool="refund", key=key, result=None))
    (done,) = RunView(run).results
    assert done.key == key
    assert done._key == 2  # only the seq is held
    assert done == ToolResult("refund", {"a": 1}, None, key, 3)
    assert RunView(run).last_result("refund") is None


@given(st.lists(st.sampled_from(["a", "b", "call"]), max_size=24))
def test_history_compacts_rejections_as_a_whole_fold_does(steps: list[str]) -> None:
    # Rejections ("a", "b": two mistakes) between calls: the compacted history read after
    # every step equals the one compacted from scratch (the signatures of every item).
    from benchmarks._workload import build_machine, run_state
    from interlock import RunView
    from interlock.core._hotpath import compact_failures
    from interlock.core._view import violation_signature
    from interlock.events import IntentRecorded, ProposalRejected, ToolCommitted, Violation

    run = run_state(build_machine(), "r")
    view = RunView(run)
    full: list[int] = []
    for step in steps:
        seq = run.seq + 1
        if step == "call":
            key = f"r:WORK:{seq}"
            run.apply(
                IntentRecorded(
                    run_id="r", seq=seq, ts=1.0, state="WORK", tool="refund", args={}, key=key
                )
            )
            run.apply(
                ToolCommitted(run_id="r", seq=seq + 1, ts=1.0, tool="refund", key=key, result=1)
            )
            full.append(0)
        else:
            violations = (Violation(step, f"mistake {step}", "fix it", "$"),)
            run.apply(
                ProposalRejected(run_id="r", seq=seq, ts=1.0, state="WORK", violations=violations)
            )
            full.append(violation_signature(violations))
        fresh = RunView(run).history
        assert view.history == fresh
        assert [(f.kind, f.count) for f in fresh] == [
            ("rejected" if full[first] else "tool_result", count)
            for first, _last, count in compact_failures(full)
        ]


# -- what a move must carry, told before it is tried (issue 32) ----------------------------


class _Classified(msgspec.Struct, forbid_unknown_fields=True):
    category: Literal["billing", "technical"]


async def _nothing(args: Any, ctx: Any) -> None:
    return None


def _triage() -> Machine:
    return Machine(
        "triage",
        initial="INIT",
        states={
            "INIT": Worker(
                next=["ROUTE", "ESCALATE"], tools=["lookup"], data=_Classified, instructions="go"
            ),
            "ROUTE": Worker(next=["DONE"]),
        },
        tools=[Tool("lookup", _nothing, read_only=True)],
    )


_CLASSIFIED_SCHEMA = (
    '{"title":"_Classified","type":"object","properties":{"category":{"enum":'
    '["billing","technical"]}},"required":["category"],"additionalProperties":false}'
)


def _view_in(state: str) -> RunView:
    events: list[Any] = [
        RunStarted(run_id="r-1", seq=1, ts=0.0, machine="triage", state="INIT", inputs={})
    ]
    if state != "INIT":
        events.append(
            Transitioned(
                run_id="r-1", seq=2, ts=0.0, src="INIT", dst=state, delta={"category": "billing"}
            )
        )
    return RunView(fold(_triage(), events))


def test_the_prompt_of_a_state_whose_moves_carry_data_shows_their_schema() -> None:
    """Issue 32: a model reading the text prompt learned the data schema of a move only
    from its rejections."""
    view = _view_in("INIT")
    assert msgspec.json.encode(view.data_schema).decode() == _CLASSIFIED_SCHEMA
    lines = render_prompt(view).split("\n")
    assert lines[lines.index("legal next states: ROUTE, ESCALATE") + 1] == (
        f"data of a move from here: must match the JSON Schema {_CLASSIFIED_SCHEMA}"
    )
    assert f"The data of a move must match this JSON Schema: {_CLASSIFIED_SCHEMA}" in (
        system_text(view).split("\n")
    )
    assert f"The data of a move must match this JSON Schema: {_CLASSIFIED_SCHEMA}" in (
        system_text(view, "json_schema").split("\n")
    )


def test_the_prompt_of_a_state_whose_moves_carry_any_data_shows_no_schema() -> None:
    view = _view_in("ROUTE")
    assert view.data_schema is None
    assert "JSON Schema" not in render_prompt(view)
    assert "JSON Schema" not in system_text(view)
