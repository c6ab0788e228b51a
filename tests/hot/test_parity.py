"""The compiled hot path and its pure-Python twin agree: same input, same output, same error."""

from __future__ import annotations

import importlib
import os
from array import array
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.json import encode as msgspec_json_encode

from .conftest import near_json as near_json_of

if os.environ.get("INTERLOCK_NO_EXTENSIONS"):
    pytest.skip(
        "INTERLOCK_NO_EXTENSIONS is set: there is no compiled hot path to compare",
        allow_module_level=True,
    )
try:
    compiled: ModuleType = importlib.import_module("interlock.core._hot")
except ImportError as exc:
    pytest.skip(
        f"interlock.core._hot cannot be imported ({exc}); "
        "build it with `python setup.py build_ext --inplace`",
        allow_module_level=True,
    )
python: ModuleType = importlib.import_module("interlock.core._hot_py")

pytestmark = pytest.mark.c_extension

ids = st.integers(min_value=-2, max_value=70)
masks = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=-(2**70), max_value=2**70),
)
names = st.text(max_size=3)
payloads = st.lists(st.binary(max_size=300), max_size=8)
signatures = st.lists(
    st.one_of(
        st.integers(min_value=0, max_value=3),
        st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
        st.integers(min_value=-(2**70), max_value=2**70),
    ),
    max_size=40,
)


def outcome(function: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """What ``function(*args)`` returns, or the type and text of what it raises."""
    try:
        return ("returned", function(*args))
    except Exception as exc:
        return ("raised", type(exc), str(exc))


def same(call: Callable[[ModuleType], Any]) -> Any:
    expected = outcome(call, python)
    assert outcome(call, compiled) == expected
    return expected


@st.composite
def machines(draw: st.DrawFn) -> tuple[list[str], list[str], list[int], list[int], int]:
    n_states = draw(st.integers(min_value=0, max_value=64))
    n_tools = draw(st.integers(min_value=0, max_value=64))
    states = draw(st.lists(names, min_size=n_states, max_size=n_states))
    tools = draw(st.lists(names, min_size=n_tools, max_size=n_tools))
    edges = draw(st.lists(masks, min_size=n_states, max_size=n_states))
    tool_masks = draw(st.lists(masks, min_size=n_states, max_size=n_states))
    return states, tools, edges, tool_masks, draw(masks)


@given(machines(), st.lists(st.tuples(ids, ids), max_size=30), st.lists(names, max_size=5))
def test_tables_agree(
    machine: tuple[list[str], list[str], list[int], list[int], int],
    pairs: list[tuple[int, int]],
    lookups: list[str],
) -> None:
    ours, theirs = compiled.Tables(*machine), python.Tables(*machine)
    for attribute in ("states", "tools", "edges", "tool_masks", "terminal"):
        assert getattr(ours, attribute) == getattr(theirs, attribute)
    for name in [*machine[0], *machine[1], *lookups]:
        assert ours.state_id(name) == theirs.state_id(name)
        assert ours.tool_id(name) == theirs.tool_id(name)
    for state in [*machine[0][:8], *lookups]:
        for tool in [*machine[1][:8], *lookups]:
            assert ours.check_call(state, tool) == theirs.check_call(state, tool)
    for first, second in pairs:
        assert ours.check_transition(first, second) == theirs.check_transition(first, second)
        assert ours.check_tool(first, second) == theirs.check_tool(first, second)
        assert ours.is_terminal(first) is theirs.is_terminal(first)
        for method in ("legal_next", "allowed_tools"):
            assert outcome(getattr(ours, method), first) == outcome(getattr(theirs, method), first)


@given(
    st.lists(names, max_size=70),
    st.lists(names, max_size=70),
    st.lists(masks, max_size=70),
    st.lists(masks, max_size=70),
)
def test_table_shape_errors_agree(
    states: list[str], tools: list[str], edges: list[int], tool_masks: list[int]
) -> None:
    same(lambda m: m.Tables(states, tools, edges, tool_masks, 0).edges)


@given(payloads)
def test_framing_agrees(batch: list[bytes]) -> None:
    buffer = same(lambda m: m.frame_events(batch))[1]
    for payload in batch:
        same(lambda m, payload=payload: m.frame_event(payload))
    assert same(lambda m: m.unframe(buffer)) == ("returned", (batch, len(buffer), 0))


@given(st.binary(max_size=200))
def test_unframe_of_any_bytes_agrees(buffer: bytes) -> None:
    same(lambda m: m.unframe(buffer))


@given(payloads, st.data())
def test_unframe_of_damaged_frames_agrees(batch: list[bytes], data: st.DataObject) -> None:
    buffer = bytearray(python.frame_events(batch))
    if buffer:
        position = data.draw(st.integers(min_value=0, max_value=len(buffer) - 1))
        buffer[position] ^= data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(buffer)))
    same(lambda m: m.unframe(bytes(buffer[:cut])))
    same(lambda m: m.unframe(memoryview(buffer)[:cut]))


@given(signatures)
def test_compaction_agrees(items: list[int]) -> None:
    same(lambda m: m.compact_failures(items))
    same(lambda m: m.compact_failures(tuple(items)))


@given(st.lists(st.one_of(st.booleans(), st.integers(-2, 2), st.floats(-2, 2)), max_size=20))
def test_compaction_of_other_numbers_agrees(items: list[object]) -> None:
    same(lambda m: m.compact_failures(items))


@given(st.binary(max_size=300), st.integers(min_value=-(2**70), max_value=2**70))
def test_hash64_agrees(data: bytes, seed: int) -> None:
    same(lambda m: m.hash64(data))
    same(lambda m: m.hash64(data, seed))
    same(lambda m: m.hash64(bytearray(data), seed))
    same(lambda m: m.hash64(memoryview(data), seed))


@given(st.binary(max_size=60), st.binary(max_size=300))
def test_proposal_hash_agrees(tool: bytes, args: bytes) -> None:
    same(lambda m: m.proposal_hash(tool, args))
    same(lambda m: m.proposal_hash(bytearray(tool), memoryview(args)))


near_json = near_json_of(40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["a", "b", "é"]) | st.text(max_size=2), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def damaged_json(draw: st.DrawFn) -> bytes:
    """A JSON document with one byte changed, dropped or added (and some keys doubled)."""
    document = bytearray(draw(json_values.map(msgspec_json_encode)))
    document = document.replace(b'{"a":', b'{"a":1,"a":', draw(st.integers(0, 1)))
    at = draw(st.integers(min_value=0, max_value=len(document)))
    how = draw(st.sampled_from(["change", "drop", "add"]))
    byte = draw(st.integers(min_value=0, max_value=255))
    if how == "add" or at == len(document):
        document.insert(at, byte)
    elif how == "drop":
        del document[at]
    else:
        document[at] = byte
    return bytes(document)


@settings(max_examples=600)
@given(st.binary(max_size=80) | near_json | damaged_json() | json_values.map(msgspec_json_encode))
def test_scan_json_agrees(data: bytes) -> None:
    same(lambda m: m.scan_json(data))
    same(lambda m: m.scan_json(bytearray(data)))


MISUSE: list[Callable[[ModuleType], Any]] = [
    lambda m: m.Tables(["a"], [], [0], [0], 0).check_transition(0.0, 0),
    lambda m: m.Tables(["a"], [], [0], [0], 0).check_transition(-1.5, 0),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_tool(0, 0.0),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_call([], "t"),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_call("a", {}),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_call({}, []),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_call(0, 0),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_call(b"a", b"t"),
    # Keyword and mixed calls: same answers.
    lambda m: m.Tables(["a", "b"], [], [2, 0], [0, 0], 0).check_transition(src=0, dst=1),
    lambda m: m.Tables(["a", "b"], [], [2, 0], [0, 0], 0).check_transition(1, dst=0),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_tool(state=0, tool=0),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_call("a", tool="t"),
    lambda m: m.Tables(["a"], ["t"], [0], [1], 0).check_call(tool="t", state="b"),
    lambda m: m.Tables(["a"], [], [0], [0], 1).is_terminal(0.0),
    lambda m: m.Tables(["a"], [], [0], [0], 1).is_terminal("0"),
    lambda m: m.Tables(["a"], [], [0], [0], 0).legal_next(slice(None)),
    lambda m: m.Tables(["a"], [], [0], [0], 0).state_id([]),
    lambda m: m.Tables(["a"], [], ["3"], [1.5], True).edges,
    lambda m: m.Tables(None, [], [], [], 0),
    lambda m: m.Tables(["a"] * 65, [], None, None, 0),
    lambda m: m.Tables(["a"], [], [0], None, 0),
    lambda m: m.Tables(["a"], [], [], None, 0),
    lambda m: m.Tables([[]], [], [0], [0], 0),
    lambda m: m.frame_event(3),
    lambda m: m.frame_event("text"),
    lambda m: m.frame_event(memoryview(b"abcd")[::2]),
    lambda m: m.frame_event(array("i", [1, 2])),
    lambda m: m.frame_events(3),
    lambda m: m.frame_events([b"a", None]),
    lambda m: m.unframe(None),
    lambda m: m.unframe(array("i", [7, ~7, 0])),
    lambda m: m.unframe(memoryview(bytes(24)).cast("B", (2, 12))),
    lambda m: m.compact_failures(iter([1, 1])),
    lambda m: m.compact_failures([1, "a", "a", None]),
    lambda m: m.hash64("text"),
    lambda m: m.hash64([1, 2, 300], 7),
    lambda m: m.hash64(None),
    lambda m: m.hash64(b"x", 1.5),
    lambda m: m.hash64(b"x", "7"),
    lambda m: m.hash64(b"x", True),
    lambda m: m.hash64(memoryview(b"abc").cast("c")),
    lambda m: m.hash64(memoryview(b"abcd")[::2]),
    lambda m: m.hash64(array("i", [1, -2])),
    lambda m: m.hash64(data=b"x", seed=3),
    lambda m: m.proposal_hash("tool", b"{}"),
    lambda m: m.proposal_hash(b"tool", None),
    lambda m: m.scan_json('{"a": 1}'),
    lambda m: m.scan_json(None),
    lambda m: m.scan_json(array("i", [1, 2])),
    lambda m: m.scan_json(memoryview(b'{"a": 1, "a": 2}')[::2]),
    lambda m: m.scan_json(data=b"{}"),
]


@pytest.mark.parametrize("call", MISUSE)
def test_odd_inputs_agree(call: Callable[[ModuleType], Any]) -> None:
    same(call)


# Prompts: mostly ASCII, sometimes wider characters, and pairs that share a prefix and a suffix.
prompt_texts = st.text(alphabet=st.sampled_from("ab\n é😀"), max_size=40)


@given(prompt_texts, prompt_texts, prompt_texts, prompt_texts)
def test_common_affixes_agree(head: str, old_middle: str, new_middle: str, tail: str) -> None:
    same(lambda hot: hot.common_affixes(head + old_middle + tail, head + new_middle + tail))
    same(lambda hot: hot.common_affixes(old_middle, new_middle))


# Long runs of few characters, so the compiled scan's word-at-a-time loops (8 bytes: 8, 4
# or 2 characters by the strings' storage width) run and stop at every offset in a word.
long_texts = (
    st.text(alphabet=st.sampled_from("ab"), max_size=200)
    | st.text(alphabet=st.sampled_from("aé"), max_size=200)
    | st.text(alphabet=st.sampled_from("a😀"), max_size=200)
)


@given(long_texts, long_texts, st.text(alphabet="ab\u0101\U0001f600", max_size=3), long_texts)
def test_common_affixes_agree_on_long_texts(head: str, old: str, change: str, tail: str) -> None:
    same(lambda hot: hot.common_affixes(head + old + tail, head + change + old + tail))
    same(lambda hot: hot.common_affixes(head + old + tail, head + old + change + tail))
    same(lambda hot: hot.common_affixes(head + tail, head + tail))


@pytest.mark.parametrize(
    "args", [(b"a", "a"), ("a", None), (1, 2), ("a", "a" * 3)], ids=["bytes", "none", "ints", "ok"]
)
def test_common_affixes_odd_inputs_agree(args: tuple[Any, Any]) -> None:
    same(lambda hot: hot.common_affixes(*args))
