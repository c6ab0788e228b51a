"""The verification gate, called directly on run states folded from journal events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import (
    BreakerPolicy,
    Budgets,
    JournalInconsistent,
    Machine,
    MachineDefinitionError,
    Reject,
    RunView,
    Tool,
    Worker,
)
from interlock.core import _gate
from interlock.core._breakers import CircuitBoard
from interlock.core._gate import Decision, verify
from interlock.core._hotpath import proposal_hash
from interlock.core._tools import plain_struct
from interlock.core._view import RunState, _call_hash, canonical_args, fold
from interlock.events import (
    Escalated,
    Event,
    IntentRecorded,
    ModelCalled,
    Resumed,
    RunStarted,
    TokenUsage,
    ToolCommitted,
    ToolFailed,
    Transitioned,
    Violation,
)

CODES = {
    "malformed",
    "unknown_tool",
    "tool_not_allowed",
    "illegal_transition",
    "schema",
    "guard",
    "repeat",
    "already_committed",
    "budget",
    "circuit_open",
}
SHAPE_HINT = (
    'send exactly one JSON object: {"tool": NAME, "args": {...}} to call a tool, or '
    '{"next": STATE, "data": {...}} to move on; no Markdown fences, no trailing commas'
)


async def nop(args: Any, ctx: Any) -> None:
    return None


class LookupArgs(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


class RefundArgs(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    amount: Annotated[float, msgspec.Meta(gt=0, le=1000)]
    reason: Literal["damaged", "late", "other"] = "other"


class PydanticRefundArgs(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    order_id: str
    amount: float = pydantic.Field(gt=0, le=1000)
    reason: Literal["damaged", "late", "other"] = "other"


JSON_SCHEMA_REFUND = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
        "reason": {"enum": ["damaged", "late", "other"], "default": "other"},
    },
    "required": ["order_id", "amount"],
    "additionalProperties": False,
}

CORE_SCHEMA_REFUND = {
    "type": "typed-dict",
    "extra_behavior": "forbid",
    "fields": {
        "order_id": {"type": "typed-dict-field", "schema": {"type": "str"}},
        "amount": {"type": "typed-dict-field", "schema": {"type": "float", "gt": 0, "le": 1000}},
        "reason": {
            "type": "typed-dict-field",
            "required": False,
            "schema": {
                "type": "default",
                "default": "other",
                "schema": {"type": "literal", "expected": ["damaged", "late", "other"]},
            },
        },
    },
}


def within_order_total(args: RefundArgs, view: RunView) -> Reject | None:
    """The refund guard: never refund more than what is left of the looked-up order."""
    order = view.last_result("lookup_order")
    if order is None:
        return Reject(
            f"args.order_id: order {args.order_id} has not been looked up",
            "call lookup_order first",
            "args.order_id",
        )
    refunded = sum(r.args["amount"] for r in view.results_of("refund"))
    left = order["total"] - refunded
    if args.amount > left:
        return Reject(
            f"args.amount: {args.amount} exceeds the order total {order['total']} "
            f"minus {refunded} already refunded",
            f"propose amount <= {left}",
            "args.amount",
        )
    return None


def no_late_refunds(args: RefundArgs, view: RunView) -> Reject | None:
    if args.reason == "late":
        return Reject(
            "args.reason: late deliveries get a voucher", "use reason other", "args.reason"
        )
    return None


def broken_guard(args: Any, view: RunView) -> Reject | None:
    return Reject("never", "never") if 1 / 0 else None


def mutating_guard(args: Any, view: RunView) -> Reject | None:
    view.data["touched"] = True  # type: ignore[index]
    return None


class ReviewData(msgspec.Struct, forbid_unknown_fields=True):
    approved: bool


MACHINE = Machine(
    "refund",
    initial="WORK",
    states={
        "WORK": Worker(
            next=["REVIEW", "COMPLETED"],
            tools=[
                "lookup_order",
                "refund",
                "refund_struct",
                "refund_json",
                "refund_pydantic",
                "refund_core",
                "broken",
                "mutating",
            ],
        ),
        "REVIEW": Worker(next=["COMPLETED", "WORK", "ARCHIVE"], data=ReviewData),
        "ARCHIVE": Worker(next=["COMPLETED"], tools=["archive"]),
    },
    tools=[
        Tool("lookup_order", nop, LookupArgs, read_only=True),
        Tool("refund", nop, RefundArgs, guards=[within_order_total, no_late_refunds]),
        Tool("refund_struct", nop, RefundArgs),
        Tool("refund_json", nop, JSON_SCHEMA_REFUND),
        Tool("refund_pydantic", nop, PydanticRefundArgs),
        Tool("refund_core", nop, CORE_SCHEMA_REFUND),
        Tool("broken", nop, LookupArgs, guards=[broken_guard]),
        Tool("mutating", nop, LookupArgs, guards=[mutating_guard]),
        Tool("archive", nop),
    ],
)


def started(state: str = "WORK", ts: float = 1000.0) -> list[Event]:
    events: list[Event] = [
        RunStarted(run_id="r-1", seq=1, ts=ts, machine="refund", state="WORK", inputs={})
    ]
    if state != "WORK":
        events.append(Transitioned(run_id="r-1", seq=2, ts=ts, src="WORK", dst=state))
    return events


def committed(events: list[Event], tool: str, args: dict[str, Any], result: Any) -> list[Event]:
    """Append an intent and its commit for ``tool`` to ``events``."""
    seq = events[-1].seq
    key = f"r-1:WORK:{seq + 1}"
    return [
        *events,
        IntentRecorded(
            run_id="r-1", seq=seq + 1, ts=1000.0, state="WORK", tool=tool, args=args, key=key
        ),
        ToolCommitted(run_id="r-1", seq=seq + 2, ts=1000.0, tool=tool, key=key, result=result),
    ]


def failed(events: list[Event], tool: str, args: dict[str, Any]) -> list[Event]:
    """Append an intent and its failure (certainly not applied) for ``tool`` to ``events``."""
    seq = events[-1].seq
    key = f"r-1:WORK:{seq + 1}"
    return [
        *events,
        IntentRecorded(
            run_id="r-1", seq=seq + 1, ts=1000.0, state="WORK", tool=tool, args=args, key=key
        ),
        ToolFailed(run_id="r-1", seq=seq + 2, ts=1000.0, tool=tool, key=key, error="refused"),
    ]


def run_in(state: str = "WORK", machine: Machine = MACHINE) -> RunState:
    return fold(machine, started(state))


def rejected(decision: Decision) -> list[tuple[str, str, str, str]]:
    assert not decision.accepted
    return [(v.code, v.path, v.message, v.hint) for v in decision.violations]


# -- malformed ---------------------------------------------------------------------


CUT_HINT = "send the whole proposal, with every string, array and object closed"
GOOD = b'{"tool": "lookup_order", "args": {"order_id": "o1"}}'


@pytest.mark.parametrize(
    ("raw", "path", "message", "hint"),
    [
        pytest.param(b"", "$", "empty proposal", SHAPE_HINT, id="empty-text"),
        pytest.param(
            b" \n\t", "$", "empty proposal: 3 bytes of whitespace", SHAPE_HINT, id="whitespace"
        ),
        pytest.param(
            GOOD[:-1],
            "$",
            "proposal is cut off: the text ends at byte 51, in args, before the JSON is complete",
            CUT_HINT,
            id="truncated",
        ),
        pytest.param(
            GOOD[:-4],
            "$",
            "proposal is cut off: the text ends at byte 48, in args.order_id, "
            "before the JSON is complete",
            CUT_HINT,
            id="truncated-in-a-string",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "o1"},}',
            "$",
            "proposal is not valid JSON: a trailing comma before '}' at byte 52 (in $)",
            SHAPE_HINT,
            id="trailing-comma",
        ),
        pytest.param(
            b'```json\n{"tool": "lookup_order", "args": {"order_id": "o1"}}\n```',
            "$",
            "proposal is not JSON: it starts with "
            '\'```json\\n{"tool": "lookup_order", "args":\'...',
            SHAPE_HINT,
            id="markdown-fence",
        ),
        pytest.param(
            b"Sure! Here it is:",
            "$",
            "proposal is not JSON: it starts with 'Sure! Here it is:'",
            SHAPE_HINT,
            id="prose",
        ),
        pytest.param(
            b"[this is no JSON",
            "$",
            "proposal is not valid JSON: expected a value at byte 1 (in [0]): 'this is no JSON'",
            SHAPE_HINT,
            id="not-json-that-starts-like-an-array",
        ),
        pytest.param(
            GOOD + b" Let me know if you need more!",
            "$",
            "proposal has text after its JSON value, at byte 53: 'Let me know if you need more!'",
            SHAPE_HINT,
            id="text-after",
        ),
        pytest.param(
            GOOD + b'{"next": "COMPLETED"}',
            "$",
            'proposal has text after its JSON value, at byte 52: \'{"next": "COMPLETED"}\'',
            SHAPE_HINT,
            id="two-objects",
        ),
        pytest.param(
            b"{'tool': 'lookup_order'}",
            "$",
            "proposal is not valid JSON: expected a key in double quotes at byte 1 (in $): "
            "\"'tool': 'lookup_order'}\"",
            SHAPE_HINT,
            id="single-quotes",
        ),
        pytest.param(
            b'{"tool": "lookup_order" "args": {}}',
            "$",
            "proposal is not valid JSON: expected ',' or '}' after tool at byte 24, "
            "found '\"args\": {}}'",
            SHAPE_HINT,
            id="missing-comma",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id" "o1"}}',
            "$",
            "proposal is not valid JSON: expected ':' after the key at byte 45 "
            "(in args.order_id): '\"o1\"}}'",
            SHAPE_HINT,
            id="missing-colon",
        ),
        pytest.param(
            b'{"tool": "refund", "args": {"order_id": "o1", "amount": True}}',
            "$",
            "proposal is not valid JSON: expected a value at byte 56 (in args.amount): 'True}}'",
            SHAPE_HINT,
            id="python-literal",
        ),
        pytest.param(
            b'{"tool": "refund", "args": {"order_id": "o1", "amount": 05}}',
            "$",
            "proposal is not valid JSON: invalid number at byte 56 (in args.amount): '05}}'",
            "write numbers as JSON does (42, -0.5, 1e3): no leading zeros, '+' or bare '.'",
            id="leading-zero",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "\\q"}}',
            "$",
            "proposal is not valid JSON: invalid escape at byte 47 (in args.order_id): '\\\\q\"}}'",
            'escape only \\" \\\\ \\/ \\b \\f \\n \\r \\t and \\uXXXX in a string',
            id="bad-escape",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "\\ud800"}}',
            "$",
            "proposal is not valid JSON: unpaired surrogate escape at byte 47 "
            "(in args.order_id): '\\\\ud800\"}}'",
            "write the character itself, or a character past U+FFFF as a pair (\\ud83d\\ude00)",
            id="lone-surrogate",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "caf\xe9"}}',
            "$",
            "proposal is not valid JSON: invalid UTF-8 at byte 50 (in args.order_id): "
            "'\\\\xe9\"}}'",
            "send the text encoded as UTF-8",
            id="latin-1",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "o\n1"}}',
            "$",
            "proposal is not valid JSON: unescaped control character in a string at byte 48 "
            "(in args.order_id): '\\n1\"}}'",
            "escape control characters in strings: \\n for a newline, \\t for a tab",
            id="raw-newline",
        ),
        pytest.param(
            b'[{"tool": "lookup_order"}]',
            "$",
            "proposal has the wrong shape: Expected `object`, got `array`",
            SHAPE_HINT,
            id="array",
        ),
        pytest.param(
            b'"lookup_order"',
            "$",
            "proposal has the wrong shape: Expected `object`, got `str`",
            SHAPE_HINT,
            id="string",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "arguments": {"order_id": "o1"}}',
            "arguments",
            "proposal has the wrong shape: Object contains unknown field `arguments`",
            SHAPE_HINT,
            id="unknown-field",
        ),
        pytest.param(
            b'{"tool": 7}',
            "$",
            "proposal has the wrong shape: Expected `str | null`, got `int` - at `$.tool`",
            SHAPE_HINT,
            id="tool-not-a-string",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "o1"}, "next": "COMPLETED"}',
            "$",
            'proposal has both of "tool" and "next"; it needs exactly one',
            SHAPE_HINT,
            id="both",
        ),
        pytest.param(
            b'{"args": {"order_id": "o1"}}',
            "$",
            'proposal has neither of "tool" and "next"; it needs exactly one',
            SHAPE_HINT,
            id="neither",
        ),
        pytest.param(
            b"{}",
            "$",
            'proposal has neither of "tool" and "next"; it needs exactly one',
            SHAPE_HINT,
            id="empty-object",
        ),
    ],
)
def test_malformed(raw: bytes, path: str, message: str, hint: str) -> None:
    decision = verify(MACHINE, run_in(), raw, 1000.0)
    assert rejected(decision) == [("malformed", path, message, hint)]
    assert decision.trip is None


ARGS_HINT = (
    "send the args as exactly one JSON object, as the tool's parameters say; "
    "no Markdown fences, no trailing commas"
)


def native(arguments: bytes) -> bytes:
    """The proposal a provider makes of a native call of lookup_order (``_wire.to_raw``)."""
    return b'{"tool":"lookup_order","args":' + arguments + b"}"


@pytest.mark.parametrize(
    ("arguments", "message", "hint"),
    [
        pytest.param(
            b'{"order_id": "o1", "qty": NaN}',
            "args is not valid JSON: expected a value at byte 26 of args (in args.qty): 'NaN}'",
            ARGS_HINT,
            id="nan",
        ),
        pytest.param(
            b'{"order_id": "o1"',
            "args is cut off: the text ends at byte 17 of args, in args.order_id, "
            "before the JSON is complete",
            "send the whole args, with every string, array and object closed",
            id="cut-after-a-value",
        ),
        pytest.param(
            b'{"order_id": "o',
            "args is cut off: the text ends at byte 15 of args, in args.order_id, "
            "before the JSON is complete",
            "send the whole args, with every string, array and object closed",
            id="cut-in-a-string",
        ),
        pytest.param(
            b'{"order_id": "o1"} Done.',
            "args has text after its JSON value, at byte 19 of args: 'Done.'",
            ARGS_HINT,
            id="text-after",
        ),
        pytest.param(
            b'{"order_id": "o1"}}',
            "args has text after its JSON value, at byte 18 of args: '}'",
            ARGS_HINT,
            id="one-brace-too-many",
        ),
        pytest.param(b"", "empty args", ARGS_HINT, id="empty"),
        pytest.param(
            b'```json\n{"order_id": "o1"}\n```',
            'args is not JSON: it starts with \'```json\\n{"order_id": "o1"}\\n```\'',
            ARGS_HINT,
            id="fenced",
        ),
        pytest.param(
            b'{"order_id": "\\q"}',
            "args is not valid JSON: invalid escape at byte 14 of args (in args.order_id): "
            "'\\\\q\"}'",
            'escape only \\" \\\\ \\/ \\b \\f \\n \\r \\t and \\uXXXX in a string',
            id="bad-escape",
        ),
    ],
)
def test_a_native_calls_defect_is_placed_in_its_own_args(
    arguments: bytes, message: str, hint: str
) -> None:
    """A provider splices a native call's arguments into ``{"tool":NAME,"args":...}``:
    offsets count from the first byte of those arguments and quotes stop at their end,
    never at the wrapper's closing brace (#32: a NaN at byte 26 of the arguments was
    said to be at byte 50)."""
    decision = verify(MACHINE, run_in(), native(arguments), 1000.0)
    assert rejected(decision) == [("malformed", "$", message, hint)]
    if "NaN" in message:  # the offset points at the defect in the model's own text
        assert arguments[26:29] == b"NaN"


def test_a_proposal_the_agent_wrote_keeps_offsets_from_its_first_byte() -> None:
    """What is not a spliced call (spaces after the colons, a defect in the tool's name,
    a text that does not end with the closing brace) is placed in the whole text, which
    its writer wrote."""
    spaced = b'{"tool": "lookup_order", "args": {"order_id": "o1", "qty": NaN}}'
    assert rejected(verify(MACHINE, run_in(), spaced, 1000.0))[0][2] == (
        "proposal is not valid JSON: expected a value at byte 59 (in args.qty): 'NaN}}'"
    )
    bad_name = b'{"tool":"look\\q","args":{}}'
    assert rejected(verify(MACHINE, run_in(), bad_name, 1000.0))[0][2] == (
        'proposal is not valid JSON: invalid escape at byte 13 (in tool): \'\\\\q","args":{}}\''
    )
    # a second "tool" after the args is the proposal's duplicate key, whoever wrote it
    smuggled = native(b'{"order_id": "o1"}, "tool": "refund"')
    assert rejected(verify(MACHINE, run_in(), smuggled, 1000.0)) == [
        _duplicate("tool", "tool", "$")
    ]
    open_end = b'{"tool":"lookup_order","args":{"order_id": NaN'
    assert rejected(verify(MACHINE, run_in(), open_end, 1000.0))[0][2] == (
        "proposal is not valid JSON: expected a value at byte 43 (in args.order_id): 'NaN'"
    )


def _duplicate(path: str, key: str, inside: str) -> tuple[str, str, str, str]:
    return (
        "malformed",
        path,
        f'duplicate key "{key}" at {inside}: a JSON object may name each key once',
        f'send "{key}" once in {inside}, with the one value you mean',
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "o1"}, "tool": "refund"}',
            _duplicate("tool", "tool", "$"),
            id="envelope",
        ),
        pytest.param(
            # the same key, escaped: a decoder reads both as "tool"
            b'{"tool": "lookup_order", "args": {"order_id": "o1"}, "\\u0074ool": "refund"}',
            _duplicate("tool", "tool", "$"),
            id="envelope-escaped",
        ),
        pytest.param(
            b'{"tool": "lookup_order", "args": {"order_id": "o1", "order_id": "o2"}}',
            _duplicate("args.order_id", "order_id", "args"),
            id="struct-args",
        ),
        pytest.param(
            b'{"tool": "refund_json", "args": {"order_id": "o1", "amount": 5, "amount": 500}}',
            _duplicate("args.amount", "amount", "args"),
            id="json-schema-args",
        ),
        pytest.param(
            b'{"tool": "refund_pydantic", "args": {"order_id": "o1", "amount": 5, "amount": 5}}',
            _duplicate("args.amount", "amount", "args"),
            id="pydantic-args",
        ),
        pytest.param(
            b'{"args": {}, "args": {"order_id": "o1"}, "tool": "lookup_order"}',
            _duplicate("args", "args", "$"),
            id="args-twice",
        ),
        pytest.param(
            b'{"next": "COMPLETED", "data": {"notes": [{"a": 1}, {"a": 1, "a": 2}]}}',
            _duplicate("data.notes[1].a", "a", "data.notes[1]"),
            id="deep-in-data",
        ),
    ],
)
def test_a_key_named_twice_is_malformed(raw: bytes, expected: tuple[str, str, str, str]) -> None:
    decision = verify(MACHINE, run_in(), raw, 1000.0)
    assert rejected(decision) == [expected]
    assert decision.trip is None
    assert verify(MACHINE, run_in(), raw, 1000.0, CircuitBoard()).violations == decision.violations


def test_a_key_named_twice_is_no_call_of_either_tool() -> None:
    # msgspec keeps the last of two equal keys: this read as a call of refund
    raw = b'{"tool": "lookup_order", "tool": "refund", "args": {"order_id": "o1", "amount": 5}}'
    decision = verify(MACHINE, run_in(), raw, 1000.0)
    assert decision.tool is None
    assert rejected(decision) == [_duplicate("tool", "tool", "$")]


def test_the_same_key_in_two_objects_is_no_duplicate() -> None:
    raw = b'{"next": "COMPLETED", "data": {"a": {"next": 1}, "b": {"next": 2}}}'
    decision = verify(MACHINE, run_in(), raw, 1000.0)
    assert decision.accepted
    assert decision.data == {"a": {"next": 1}, "b": {"next": 2}}


def test_a_key_that_only_looks_alike_is_no_duplicate() -> None:
    raw = b'{"tool": "lookup_order", "args": {"order_id": "o1", "order_\\u00efd": "o2"}}'
    assert rejected(verify(MACHINE, run_in(), raw, 1000.0)) == [
        (
            "schema",
            "args",
            "args: object contains unknown field `order_\u00efd`",
            "remove the field; allowed fields: order_id",
        )
    ]


def _capped(machine_cap: int | None = None, state_cap: int | None = None) -> Machine:
    caps = {} if machine_cap is None else {"max_proposal_bytes": machine_cap}
    return Machine(
        "refund",
        initial="WORK",
        states={
            "WORK": Worker(next=["COMPLETED"], tools=["lookup_order"], max_proposal_bytes=state_cap)
        },
        tools=[Tool("lookup_order", nop, LookupArgs)],
        **caps,
    )


def test_the_default_cap_is_256_kib() -> None:
    machine = _capped()
    run = fold(machine, started())
    padded = GOOD[:-2] + b" " * (256 * 1024 - len(GOOD)) + b"}}"
    assert len(padded) == 256 * 1024
    assert verify(machine, run, padded, 1000.0).accepted
    over = padded[:-2] + b" }}"
    assert rejected(verify(machine, run, over, 1000.0)) == [
        (
            "malformed",
            "$",
            "proposal is 262,145 bytes, over the cap of 262,144 bytes in state 'WORK'; "
            "it was not read",
            "send a proposal of at most 262,144 bytes: leave out what this step does not need",
        )
    ]


@pytest.mark.parametrize(
    ("machine_cap", "state_cap", "cap"), [(60, None, 60), (None, 60, 60), (1000, 60, 60)]
)
def test_the_cap_is_checked_before_parsing(
    machine_cap: int | None, state_cap: int | None, cap: int
) -> None:
    machine = _capped(machine_cap, state_cap)
    run = fold(machine, started())
    assert verify(machine, run, GOOD.ljust(cap), 1000.0).accepted
    for raw in (GOOD.ljust(cap + 1), b"x" * (cap + 1), b"[" * 1_000_000):
        violation = verify(machine, run, raw, 1000.0).violations[0]
        assert violation.message == (
            f"proposal is {len(raw):,} bytes, over the cap of {cap} bytes in state 'WORK'; "
            "it was not read"
        )


@pytest.mark.parametrize(
    ("where", "cap", "message"),
    [
        (
            "machine",
            0,
            "machine 'refund': max_proposal_bytes must be a positive int, a number of bytes; "
            "got 0 (the default is 262144, 256 KiB)",
        ),
        (
            "machine",
            1.5,
            "machine 'refund': max_proposal_bytes must be a positive int, a number of bytes; "
            "got 1.5 (the default is 262144, 256 KiB)",
        ),
        (
            "state",
            -1,
            "machine 'refund', state 'WORK': max_proposal_bytes must be a positive int, a number "
            "of bytes; got -1 (leave it None for the machine's cap)",
        ),
        (
            "state",
            True,
            "machine 'refund', state 'WORK': max_proposal_bytes must be a positive int, a number "
            "of bytes; got True (leave it None for the machine's cap)",
        ),
    ],
)
def test_the_cap_is_checked_at_definition(where: str, cap: Any, message: str) -> None:
    with pytest.raises(MachineDefinitionError) as raised:
        _capped(cap, None) if where == "machine" else _capped(None, cap)
    assert str(raised.value) == message


# -- tools and transitions -------------------------------------------------------------

WORK_TOOLS = "lookup_order, refund, refund_struct, refund_json, refund_pydantic, refund_core, broken, mutating"


def test_unknown_tool_lists_the_allowed_tools() -> None:
    decision = verify(MACHINE, run_in(), b'{"tool": "delete_all_records", "args": {}}', 1000.0)
    assert rejected(decision) == [
        (
            "unknown_tool",
            "tool",
            f"tool 'delete_all_records' does not exist; tools allowed in state 'WORK': {WORK_TOOLS}",
            f"call one of: {WORK_TOOLS}",
        )
    ]


def test_unknown_tool_in_a_state_without_tools_hints_at_the_next_states() -> None:
    decision = verify(MACHINE, run_in("REVIEW"), b'{"tool": "nope"}', 1000.0)
    assert rejected(decision) == [
        (
            "unknown_tool",
            "tool",
            "tool 'nope' does not exist; tools allowed in state 'REVIEW': none",
            "no tools are allowed here; move on with next: one of WORK, ARCHIVE, COMPLETED",
        )
    ]


def test_tool_not_allowed() -> None:
    decision = verify(MACHINE, run_in(), b'{"tool": "archive"}', 1000.0)
    assert rejected(decision) == [
        (
            "tool_not_allowed",
            "tool",
            f"tool 'archive' is not allowed in state 'WORK'; allowed here: {WORK_TOOLS}",
            f"call one of: {WORK_TOOLS}",
        )
    ]


def test_tool_not_allowed_in_a_state_without_tools() -> None:
    decision = verify(MACHINE, run_in("REVIEW"), b'{"tool": "lookup_order"}', 1000.0)
    assert rejected(decision) == [
        (
            "tool_not_allowed",
            "tool",
            "tool 'lookup_order' is not allowed in state 'REVIEW'; allowed here: none",
            "no tools are allowed here; move on with next: one of WORK, ARCHIVE, COMPLETED",
        )
    ]


def test_illegal_transition_to_an_unknown_state() -> None:
    decision = verify(MACHINE, run_in(), b'{"next": "FINISHED"}', 1000.0)
    assert rejected(decision) == [
        (
            "illegal_transition",
            "next",
            "state 'FINISHED' does not exist; legal next states from 'WORK': REVIEW, COMPLETED",
            "propose next: one of REVIEW, COMPLETED",
        )
    ]


@pytest.mark.parametrize("target", ["ESCALATE", "ARCHIVE", "WORK"])
def test_illegal_transition_to_an_existing_state(target: str) -> None:
    decision = verify(MACHINE, run_in(), f'{{"next": "{target}"}}'.encode(), 1000.0)
    assert rejected(decision) == [
        (
            "illegal_transition",
            "next",
            f"transition WORK -> {target} is not allowed; legal next states from 'WORK': "
            "REVIEW, COMPLETED",
            "propose next: one of REVIEW, COMPLETED",
        )
    ]


def test_legal_transition_is_accepted_with_its_data() -> None:
    decision = verify(MACHINE, run_in(), b'{"next": "COMPLETED", "data": {"answer": 42}}', 1000.0)
    assert decision.accepted
    assert (decision.target, decision.data, decision.tool) == ("COMPLETED", {"answer": 42}, None)


def test_transition_data_must_be_an_object() -> None:
    decision = verify(MACHINE, run_in(), b'{"next": "COMPLETED", "data": [1]}', 1000.0)
    assert rejected(decision) == [
        (
            "schema",
            "data",
            "data: Expected `object`, got `array`",
            "send data as a JSON object, or leave it out",
        )
    ]


def test_transition_data_is_checked_against_the_state_data_schema() -> None:
    decision = verify(
        MACHINE, run_in("REVIEW"), b'{"next": "COMPLETED", "data": {"approved": "yes"}}', 0.0
    )
    assert rejected(decision) == [
        (
            "schema",
            "data.approved",
            "data.approved: expected `bool`, got `str`",
            "send data.approved as a JSON bool, not str",
        )
    ]
    decision = verify(
        MACHINE, run_in("REVIEW"), b'{"next": "COMPLETED", "data": {"approved": true}}', 0.0
    )
    assert decision.accepted
    assert decision.data == {"approved": True}


# -- schema ----------------------------------------------------------------------------


SCHEMA_CASES = {
    "string-for-number": b'{"order_id": "o1", "amount": "150"}',
    "missing-field": b'{"order_id": "o1"}',
    "enum": b'{"order_id": "o1", "amount": 10, "reason": "bored"}',
    "above-maximum": b'{"order_id": "o1", "amount": 1500}',
    "not-above-exclusive-minimum": b'{"order_id": "o1", "amount": 0}',
    "unknown-field": b'{"order_id": "o1", "amount": 10, "note": "x"}',
}
_STRUCT_EXPECTED = {
    "string-for-number": (
        "args.amount",
        "args.amount: expected `float`, got `str`",
        "send args.amount as a JSON float (> 0, <= 1000), not str",
    ),
    "missing-field": (
        "args",
        "args: object missing required field `amount`",
        "include the required field args.amount",
    ),
    "enum": (
        "args.reason",
        "args.reason: invalid enum value 'bored'",
        "use one of: damaged, late, other",
    ),
    "above-maximum": (
        "args.amount",
        "args.amount: expected `float` <= 1000.0",
        "propose args.amount <= 1000.0",
    ),
    "not-above-exclusive-minimum": (
        "args.amount",
        "args.amount: expected `float` > 0.0",
        "propose args.amount > 0.0",
    ),
    "unknown-field": (
        "args",
        "args: object contains unknown field `note`",
        "remove the field; allowed fields: amount, order_id, reason",
    ),
}
_PYDANTIC_EXPECTED = {
    "string-for-number": (
        "args.amount",
        "args.amount: input should be a valid number (got '150')",
        "fix args.amount: input should be a valid number",
    ),
    "missing-field": (
        "args.amount",
        "args.amount: field required",
        "include the required field args.amount",
    ),
    "enum": (
        "args.reason",
        "args.reason: input should be 'damaged', 'late' or 'other' (got 'bored')",
        "use one of: 'damaged', 'late' or 'other'",
    ),
    "above-maximum": (
        "args.amount",
        "args.amount: input should be less than or equal to 1000 (got 1500)",
        "propose args.amount <= 1000.0",
    ),
    "not-above-exclusive-minimum": (
        "args.amount",
        "args.amount: input should be greater than 0 (got 0)",
        "propose args.amount > 0.0",
    ),
    "unknown-field": (
        "args.note",
        "args.note: extra inputs are not permitted (got 'x')",
        "remove the field",
    ),
}
SCHEMA_TOOLS = {
    "refund_struct": _STRUCT_EXPECTED,
    "refund_json": _STRUCT_EXPECTED,
    "refund_pydantic": _PYDANTIC_EXPECTED,
    "refund_core": _PYDANTIC_EXPECTED,
}


def _schema_params() -> list[Any]:
    params = []
    for tool, expected in SCHEMA_TOOLS.items():
        for case in SCHEMA_CASES:
            params.append(pytest.param(tool, case, expected[case], id=f"{tool}-{case}"))
    return params


def _verify_call(tool: str, args: bytes) -> Decision:
    raw = b'{"tool": "%s", "args": %s}' % (tool.encode(), args)
    return verify(MACHINE, run_in(), raw, 1000.0)


@pytest.mark.parametrize(("tool", "case", "expected"), _schema_params())
def test_schema_violation(tool: str, case: str, expected: tuple[str, str, str]) -> None:
    decision = _verify_call(tool, SCHEMA_CASES[case])
    assert [(v.code, v.path, v.message) for v in decision.violations] == [
        ("schema", expected[0], expected[1])
    ]


@pytest.mark.parametrize(("tool", "case", "expected"), _schema_params())
def test_schema_violation_hint(tool: str, case: str, expected: tuple[str, str, str]) -> None:
    decision = _verify_call(tool, SCHEMA_CASES[case])
    assert [v.hint for v in decision.violations] == [expected[2]]


@pytest.mark.parametrize(
    "tool",
    [
        "refund_struct",
        "refund_json",
        "refund_pydantic",
        "refund_core",
    ],
)
def test_schema_accepts_valid_args_with_defaults_filled_in(tool: str) -> None:
    decision = _verify_call(tool, b'{"amount": 10, "order_id": "o1"}')
    assert decision.accepted, decision.violations
    assert decision.tool is not None
    assert decision.tool.name == tool
    assert decision.args == {"order_id": "o1", "amount": 10.0, "reason": "other"}
    assert decision.call_hash != 0


@pytest.mark.parametrize(
    "tool",
    [
        "refund_struct",
        "refund_json",
    ],
)
def test_schema_rejects_null_for_an_optional_field(tool: str) -> None:
    decision = _verify_call(tool, b'{"order_id": "o1", "amount": 10, "reason": null}')
    assert rejected(decision) == [
        (
            "schema",
            "args.reason",
            "args.reason: expected `str`, got `null`",
            "use one of: damaged, late, other",
        )
    ]


def test_schema_does_not_coerce_a_numeric_string() -> None:
    decision = _verify_call("refund_struct", b'{"order_id": 1, "amount": 10}')
    assert rejected(decision) == [
        (
            "schema",
            "args.order_id",
            "args.order_id: expected `str`, got `int`",
            "send args.order_id as a JSON str, not int",
        )
    ]


# -- guards ----------------------------------------------------------------------------


def test_guard_rejects_a_refund_above_the_order_total() -> None:
    events = committed(
        started(), "lookup_order", {"order_id": "o1"}, {"order_id": "o1", "total": 100.0}
    )
    decision = verify(
        MACHINE,
        fold(MACHINE, events),
        b'{"tool": "refund", "args": {"order_id": "o1", "amount": 150}}',
        1000.0,
    )
    assert rejected(decision) == [
        (
            "guard",
            "args.amount",
            "args.amount: 150.0 exceeds the order total 100.0 minus 0 already refunded",
            "propose amount <= 100.0",
        )
    ]


def test_guard_sees_earlier_commits_of_the_run() -> None:
    events = committed(
        started(), "lookup_order", {"order_id": "o1"}, {"order_id": "o1", "total": 100.0}
    )
    events = committed(events, "refund", {"order_id": "o1", "amount": 30.0}, {"refunded": 30.0})
    run = fold(MACHINE, events)
    over = verify(
        MACHINE, run, b'{"tool": "refund", "args": {"order_id": "o1", "amount": 80}}', 0.0
    )
    assert rejected(over) == [
        (
            "guard",
            "args.amount",
            "args.amount: 80.0 exceeds the order total 100.0 minus 30.0 already refunded",
            "propose amount <= 70.0",
        )
    ]
    exact = verify(
        MACHINE, run, b'{"tool": "refund", "args": {"order_id": "o1", "amount": 70}}', 0.0
    )
    assert exact.accepted
    assert exact.args == {"order_id": "o1", "amount": 70.0, "reason": "other"}


def test_guard_without_a_lookup_rejects() -> None:
    decision = verify(
        MACHINE, run_in(), b'{"tool": "refund", "args": {"order_id": "o1", "amount": 5}}', 0.0
    )
    assert rejected(decision) == [
        (
            "guard",
            "args.order_id",
            "args.order_id: order o1 has not been looked up",
            "call lookup_order first",
        )
    ]


def test_every_failing_guard_is_reported() -> None:
    raw = b'{"tool": "refund", "args": {"order_id": "o1", "amount": 5, "reason": "late"}}'
    decision = verify(MACHINE, run_in(), raw, 0.0)
    assert [v.path for v in decision.violations] == ["args.order_id", "args.reason"]
    assert decision.violations[1] == Violation(
        "guard", "args.reason", "args.reason: late deliveries get a voucher", "use reason other"
    )


def test_guard_that_raises_is_a_guard_violation() -> None:
    decision = verify(MACHINE, run_in(), b'{"tool": "broken", "args": {"order_id": "o1"}}', 0.0)
    assert rejected(decision) == [
        (
            "guard",
            "args",
            "guard 'broken_guard' of tool 'broken' raised ZeroDivisionError: division by zero",
            "the guard itself failed; this call cannot be verified",
        )
    ]


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def _guarded(guard: Any) -> Machine:
    return Machine(
        "guarded",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order"])},
        tools=[Tool("lookup_order", nop, LookupArgs, guards=[guard])],
    )


def _grouped(args: Any, view: RunView) -> Reject | None:
    raise ExceptionGroup(
        "checks failed", [ValueError("a"), ExceptionGroup("inner", [KeyError("b")])]
    )


def _empty(args: Any, view: RunView) -> Reject | None:
    raise ValueError


def _unprintable(args: Any, view: RunView) -> Reject | None:
    raise Unprintable


def _text(args: Any, view: RunView) -> Reject | None:
    return "no"  # type: ignore[return-value]


class OwnBase(BaseException):
    """A guard's own BaseException subclass: not an Exception, still the guard's failure."""


def _own_base(args: Any, view: RunView) -> Reject | None:
    raise OwnBase("no verdict")


def _closing(args: Any, view: RunView) -> Reject | None:
    raise GeneratorExit


@pytest.mark.parametrize(
    ("guard", "what"),
    [
        (
            _grouped,
            "raised ExceptionGroup: checks failed (2 leaves: ValueError: a; KeyError: 'b')",
        ),
        (_empty, "raised ValueError"),
        (_unprintable, "raised Unprintable: (its message cannot be shown)"),
        (_text, "returned str, not a Reject or None"),
        (_own_base, "raised OwnBase: no verdict"),
        (_closing, "raised GeneratorExit"),
    ],
    ids=[
        "exception-group",
        "no-message",
        "unprintable",
        "not-a-reject",
        "base-exception",
        "generator-exit",
    ],
)
def test_a_guard_that_fails_is_a_guard_violation(guard: Any, what: str) -> None:
    machine = _guarded(guard)
    decision = verify(machine, fold(machine, started()), LOOKUP, 1000.0)
    assert rejected(decision) == [
        (
            "guard",
            "args",
            f"guard {guard.__name__!r} of tool 'lookup_order' {what}",
            "the guard itself failed; this call cannot be verified",
        )
    ]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_guard_cannot_swallow_an_interrupt(interrupt: type[BaseException]) -> None:
    def interrupted(args: Any, view: RunView) -> Reject | None:
        raise interrupt

    machine = _guarded(interrupted)
    with pytest.raises(interrupt):
        verify(machine, fold(machine, started()), LOOKUP, 1000.0)


def test_guard_gets_a_read_only_view() -> None:
    run = run_in()
    decision = verify(MACHINE, run, b'{"tool": "mutating", "args": {"order_id": "o1"}}', 0.0)
    assert rejected(decision) == [
        (
            "guard",
            "args",
            "guard 'mutating_guard' of tool 'mutating' raised TypeError: "
            "'mappingproxy' object does not support item assignment",
            "the guard itself failed; this call cannot be verified",
        )
    ]
    assert run.data == {}


# -- breakers --------------------------------------------------------------------------


def test_repeat_rejects_the_same_call_past_the_limit() -> None:
    events = started()
    for _ in range(3):
        # key order differs from the proposal's: the canonical args hash is the same
        events = committed(events, "lookup_order", {"order_id": "o1"}, {"total": 100.0})
    decision = verify(
        MACHINE, fold(MACHINE, events), b'{"tool":"lookup_order","args":{"order_id":"o1"}}', 0.0
    )
    detail = 'lookup_order({"order_id":"o1"}) proposed 4 times in this run; the limit is 3'
    assert rejected(decision) == [
        (
            "repeat",
            "args",
            f"repeated call: {detail}",
            "do not call lookup_order with the same args again; use the recorded result or move on",
        )
    ]
    assert decision.trip is not None
    assert (decision.trip.breaker, decision.trip.value, decision.trip.limit) == ("repeat", 4, 3)
    assert (decision.trip.detail, decision.trip.tool) == (detail, "lookup_order")


def test_repeat_hashes_canonical_args() -> None:
    events = started()
    for _ in range(3):  # intended three times, never applied (so never committed)
        events = failed(
            events, "refund_struct", {"reason": "other", "amount": 10.0, "order_id": "o1"}
        )
    raw = b'{"tool": "refund_struct", "args": {"order_id": "o1", "amount": 10}}'
    decision = verify(MACHINE, fold(MACHINE, events), raw, 0.0)
    assert [v.code for v in decision.violations] == ["repeat"]
    other = b'{"tool": "refund_struct", "args": {"order_id": "o1", "amount": 11}}'
    assert verify(MACHINE, fold(MACHINE, events), other, 0.0).accepted


# -- a side effect already applied -----------------------------------------------------


def test_a_call_identical_to_a_committed_one_is_refused_quoting_its_result() -> None:
    """Issue 32: the same side-effecting call proposed twice in one run ran twice, under
    two keys (a double refund, a double email)."""
    args = {"reason": "other", "amount": 10.0, "order_id": "o1"}
    events = committed(started(), "refund_struct", args, {"refund_id": "rf-1", "new": True})
    run = fold(MACHINE, events)
    # The same call, its args in another order and 10 written as an int: the canonical args.
    raw = b'{"tool": "refund_struct", "args": {"order_id": "o1", "amount": 10}}'
    decision = verify(MACHINE, run, raw, 0.0)
    assert rejected(decision) == [
        (
            "already_committed",
            "args",
            "refund_struct was already called with these args in this run: committed at seq 3 "
            """(key 'r-1:WORK:2') with result {"refund_id":"rf-1","new":true}; calling it """
            "again would apply it twice",
            "use the result of seq 3 instead of calling refund_struct again, or move on",
        )
    ]
    assert decision.trip is None  # a rejection like any other, not a breaker
    other = b'{"tool": "refund_struct", "args": {"order_id": "o1", "amount": 11}}'
    assert verify(MACHINE, run, other, 0.0).accepted


@pytest.mark.parametrize("tool", ["refund_struct", "refund_json", "refund_pydantic", "refund_core"])
def test_every_kind_of_schema_refuses_a_committed_call_again(tool: str) -> None:
    args = {"order_id": "o1", "amount": 10.0, "reason": "other"}
    run = fold(MACHINE, committed(started(), tool, args, "x" * 500))
    raw = msgspec.json.encode({"tool": tool, "args": {"order_id": "o1", "amount": 10.0}})
    (violation,) = verify(MACHINE, run, raw, 0.0).violations
    assert violation.code == "already_committed"
    # The earlier result is quoted, cut to a bounded length.
    assert "with result " + '"' + "x" * 196 + "...; calling" in violation.message
    assert len(violation.message) < 400


def test_the_committed_call_is_refused_before_its_guards() -> None:
    """The refusal names the earlier commit, not what a guard makes of a second refund."""
    events = committed(started(), "lookup_order", {"order_id": "o1"}, {"total": 100.0})
    args = {"order_id": "o1", "amount": 100.0, "reason": "other"}
    events = committed(events, "refund", args, {"refund_id": "rf-1"})
    raw = b'{"tool": "refund", "args": {"order_id": "o1", "amount": 100.0}}'
    (violation,) = verify(MACHINE, fold(MACHINE, events), raw, 0.0).violations
    assert violation.code == "already_committed"
    assert "committed at seq 5 (key 'r-1:WORK:4')" in violation.message


def test_a_read_only_call_may_be_committed_again() -> None:
    events = committed(started(), "lookup_order", {"order_id": "o1"}, {"total": 100.0})
    raw = b'{"tool": "lookup_order", "args": {"order_id": "o1"}}'
    assert verify(MACHINE, fold(MACHINE, events), raw, 0.0).accepted


def test_a_repeatable_tool_may_be_committed_again() -> None:
    machine = Machine(
        "poller",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["remind", "charge"])},
        tools=[
            Tool("remind", nop, LookupArgs, repeatable=True),
            Tool("charge", nop, LookupArgs),
        ],
    )
    events: list[Event] = [
        RunStarted(run_id="r-1", seq=1, ts=1000.0, machine="poller", state="WORK", inputs={})
    ]
    events = committed(events, "remind", {"order_id": "o1"}, None)
    events = committed(events, "charge", {"order_id": "o1"}, None)
    run = fold(machine, events)
    assert verify(machine, run, b'{"tool": "remind", "args": {"order_id": "o1"}}', 0.0).accepted
    (violation,) = verify(
        machine, run, b'{"tool": "charge", "args": {"order_id": "o1"}}', 0.0
    ).violations
    assert violation.code == "already_committed"


def test_a_call_intended_but_not_committed_may_be_made_again() -> None:
    """Only a committed call was applied; one that failed, not applied, may be retried."""
    args = {"order_id": "o1", "amount": 10.0, "reason": "other"}
    run = fold(MACHINE, failed(started(), "refund_struct", args))
    raw = b'{"tool": "refund_struct", "args": {"order_id": "o1", "amount": 10.0}}'
    assert verify(MACHINE, run, raw, 0.0).accepted


def test_the_committed_calls_outlive_a_resume() -> None:
    """What was applied stays applied: a resume clears the repeat counts, not them."""
    args = {"order_id": "o1", "amount": 10.0, "reason": "other"}
    events = committed(started(), "refund_struct", args, {"ok": True})
    events += [
        Transitioned(run_id="r-1", seq=4, ts=1000.0, src="WORK", dst="ESCALATE"),
        Escalated(run_id="r-1", seq=5, ts=1000.0, state="WORK", reason="r", detail="d"),
        Resumed(run_id="r-1", seq=6, ts=1000.0, by="op", note="", to="WORK"),
        Transitioned(run_id="r-1", seq=7, ts=1000.0, src="ESCALATE", dst="WORK"),
    ]
    run = fold(MACHINE, events)
    assert run.repeats_of(_call_hash("refund_struct", args)) == 0
    raw = b'{"tool": "refund_struct", "args": {"order_id": "o1", "amount": 10.0}}'
    (violation,) = verify(MACHINE, run, raw, 0.0).violations
    assert violation.code == "already_committed"


def _model_called(seq: int, prompt: int, completion: int) -> ModelCalled:
    return ModelCalled(
        run_id="r-1",
        seq=seq,
        ts=1000.0,
        state="WORK",
        model="m",
        prompt_hash="",
        prompt="",
        raw="",
        usage=TokenUsage(prompt, completion),
    )


def _budget_machine(**budgets: Any) -> Machine:
    return Machine(
        "refund",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order"])},
        tools=[Tool("lookup_order", nop, LookupArgs)],
        budgets=Budgets(**budgets),
    )


LOOKUP = b'{"tool": "lookup_order", "args": {"order_id": "o1"}}'
NO_MORE = "no further proposals are accepted"


def _budgeted(**budgets: Any) -> Machine:
    """A call state with a Struct tool (the single-decode path) and a JSON Schema tool."""
    return Machine(
        "refund",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order", "lookup_json"])},
        tools=[
            Tool("lookup_order", nop, LookupArgs),
            Tool(
                "lookup_json",
                nop,
                {"type": "object", "properties": {"order_id": {"type": "string"}}},
            ),
        ],
        budgets=Budgets(**budgets),
    )


BUDGETED_PROPOSALS = [
    pytest.param(LOOKUP, id="struct-call"),
    pytest.param(b'{"tool": "lookup_json", "args": {"order_id": "o1"}}', id="json-schema-call"),
    pytest.param(b'{"next": "COMPLETED"}', id="transition"),
]


def _run_using(machine: Machine, tokens: int | None = None, steps: int = 1) -> RunState:
    """A run whose model calls used ``tokens`` tokens (2 a call by default) in ``steps`` proposals."""
    tokens = 2 * steps if tokens is None else tokens
    calls = [_model_called(2 + i, 1, 1) for i in range(steps - 1)]
    calls.append(_model_called(1 + steps, tokens - 2 * (steps - 1) - 1, 1))
    run = fold(machine, [*started(), *calls])
    assert (run.tokens, run.steps) == (tokens, steps)
    return run


@pytest.mark.parametrize(
    ("budget", "run", "now", "breaker", "value", "limit", "message"),
    [
        (
            {"tokens": 100},
            {"tokens": 101},
            1000.0,
            "token_budget",
            101,
            100,
            "token budget exhausted: run used 101 tokens; the budget is 100",
        ),
        (
            {"steps": 2},
            {"steps": 3},
            1000.0,
            "step_budget",
            3,
            2,
            "step budget exhausted: run made 3 proposals; the budget is 2",
        ),
        (
            {"deadline": 60.0},
            {},
            1060.5,
            "deadline",
            60.5,
            60.0,
            "deadline passed: run has been going for 60.500 s; the deadline is 60 s",
        ),
    ],
    ids=["tokens", "steps", "deadline"],
)
@pytest.mark.parametrize("raw", BUDGETED_PROPOSALS)
def test_a_budget_past_its_limit_refuses_every_proposal(
    budget: dict[str, Any],
    run: dict[str, int],
    now: float,
    breaker: str,
    value: float,
    limit: float,
    message: str,
    raw: bytes,
) -> None:
    machine = _budgeted(**budget)
    for proposal in (raw, b"not even JSON", b"x" * 300_000):
        decision = verify(machine, _run_using(machine, **run), proposal, now)
        assert rejected(decision) == [("budget", "$", message, NO_MORE)]
        assert decision.trip is not None
        assert (decision.trip.breaker, decision.trip.value, decision.trip.limit) == (
            breaker,
            value,
            limit,
        )
        assert decision.trip.detail == message.split(": ", 1)[1]


@pytest.mark.parametrize(
    ("budget", "runs", "times"),
    [
        ({"tokens": 100}, [{"tokens": 99}, {"tokens": 100}], [1000.0]),
        ({"steps": 2}, [{"steps": 1}, {"steps": 2}], [1000.0]),
        ({"deadline": 60.0}, [{}], [1059.5, 1060.0]),
    ],
    ids=["tokens", "steps", "deadline"],
)
@pytest.mark.parametrize("raw", BUDGETED_PROPOSALS)
def test_a_budget_at_or_below_its_limit_lets_every_proposal_through(
    budget: dict[str, Any], runs: list[dict[str, int]], times: list[float], raw: bytes
) -> None:
    machine = _budgeted(**budget)
    for run in runs:
        for now in times:
            assert verify(machine, _run_using(machine, **run), raw, now).accepted


def test_circuit_open_then_one_trial_call_after_the_cooldown() -> None:
    policy = BreakerPolicy(circuit_failures=2, circuit_cooldown=30.0)
    machine = Machine(
        "refund",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order"])},
        tools=[Tool("lookup_order", nop, LookupArgs)],
        breakers=policy,
    )
    run = fold(machine, started())
    circuits = CircuitBoard()
    circuits.record("lookup_order", False, 100.0, policy, "HTTPStatusError: 503")
    assert verify(machine, run, LOOKUP, 100.0, circuits).accepted
    circuits.record("lookup_order", False, 100.0, policy, "HTTPStatusError: 503")
    assert circuits.state("lookup_order") == "open"

    decision = verify(machine, run, LOOKUP, 110.0, circuits)
    detail = (
        "circuit of tool 'lookup_order' is open after 2 consecutive failures (last: "
        "HTTPStatusError: 503); it lets a trial call through at 1970-01-01T00:02:10+00:00 "
        "(in 20.0 s)"
    )
    assert rejected(decision) == [
        (
            "circuit_open",
            "tool",
            detail,
            "do not call lookup_order until 1970-01-01T00:02:10+00:00; choose another action or wait",
        )
    ]
    assert decision.trip is not None
    assert (decision.trip.breaker, decision.trip.value, decision.trip.limit) == ("circuit", 2, 2)
    assert decision.trip.tool == "lookup_order"
    # without the shared circuits the gate does not look at them
    assert verify(machine, run, LOOKUP, 110.0).accepted

    assert verify(machine, run, LOOKUP, 130.0, circuits).accepted
    assert circuits.state("lookup_order") == "half_open"
    second = verify(machine, run, LOOKUP, 130.0, circuits)
    assert [v.code for v in second.violations] == ["circuit_open"]
    assert second.violations[0].message.startswith(
        "circuit of tool 'lookup_order' is half_open after 2 consecutive failures"
    )


def test_budgets_are_checked_before_anything_else() -> None:
    machine = _budget_machine(steps=0)
    run = fold(machine, [*started(), _model_called(2, 1, 1)])
    assert [v.code for v in verify(machine, run, b"```", 1000.0).violations] == ["budget"]


def test_fold_refuses_a_broken_journal() -> None:
    with pytest.raises(JournalInconsistent, match=r"^cannot fold an empty journal$"):
        fold(MACHINE, [])
    with pytest.raises(
        JournalInconsistent, match=r"^run 'r-1': journal starts with Transitioned, not run_started$"
    ):
        fold(MACHINE, started("REVIEW")[1:])
    gap = [*started(), Transitioned(run_id="r-1", seq=3, ts=0.0, src="WORK", dst="REVIEW")]
    with pytest.raises(
        JournalInconsistent,
        match=r"^run 'r-1': event seq 3 does not follow 1; "
        r"the journal is missing or repeating events$",
    ):
        fold(MACHINE, gap)


# -- never raises ------------------------------------------------------------------------

RUNS = [run_in("WORK"), run_in("REVIEW")]
_json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_json = st.recursive(
    _json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["order_id", "amount", "reason", "note", "approved"])
            | st.text(max_size=4),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_proposals = st.dictionaries(
    st.sampled_from(["tool", "args", "next", "data", "extra"]),
    st.sampled_from([*MACHINE.tables.tools, *MACHINE.tables.states, "nope"]) | _json,
    max_size=4,
)


def _check_never_raises(raw: bytes, run_index: int) -> None:
    decision = verify(MACHINE, RUNS[run_index], raw, 1000.0, CircuitBoard())
    assert isinstance(decision, Decision)
    if decision.accepted:
        assert (decision.tool is None) != (decision.target == "")
    else:
        for violation in decision.violations:
            assert isinstance(violation, Violation)
            assert violation.code in CODES
            assert violation.message
            assert violation.hint


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=200), run_index=st.sampled_from([0, 1]))
def test_verify_never_raises_on_bytes(raw: bytes, run_index: int) -> None:
    _check_never_raises(raw, run_index)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200), run_index=st.sampled_from([0, 1]))
def test_verify_never_raises_on_text(text: str, run_index: int) -> None:
    _check_never_raises(text.encode(), run_index)


@settings(max_examples=300, deadline=None)
@given(
    inner=st.binary(max_size=120)
    | st.text(max_size=120).map(str.encode)
    | _json.map(msgspec.json.encode),
    wrapper=st.sampled_from(
        [
            *(b'{"tool": "%s", "args": ' % name.encode() for name in MACHINE.tables.tools),
            b'{"next": "COMPLETED", "data": ',
            b'{"next": "ARCHIVE", "data": ',
        ]
    ),
    run_index=st.sampled_from([0, 1]),
)
def test_verify_never_raises_on_bytes_inside_a_proposal(
    inner: bytes, wrapper: bytes, run_index: int
) -> None:
    # Past the envelope: args and data of every kind of schema, guards included.
    _check_never_raises(wrapper + inner + b"}", run_index)


@settings(max_examples=200, deadline=None)
@given(proposal=_proposals, run_index=st.sampled_from([0, 1]))
def test_verify_never_raises_on_json_objects(proposal: dict[str, Any], run_index: int) -> None:
    _check_never_raises(msgspec.json.encode(proposal), run_index)


@pytest.mark.parametrize(
    ("raw", "shallow"),
    [
        (b"[" * 100_000, None),
        (b'{"tool": "refund", "args": ' + b"[" * 5_000, None),
        (
            b'{"tool": "refund", "args": {"order_id": ' + b"[" * 3_000 + b"]" * 3_000 + b"}}",
            b'{"tool": "refund", "args": {"order_id": [[]]}}',
        ),
        (b'{"next": "COMPLETED", "data": ' + b'{"a":' * 3_000, None),
    ],
    ids=["array", "call-args", "call-arg-value", "transition-data"],
)
@pytest.mark.parametrize("run_index", [0, 1])
def test_verify_never_raises_on_deeply_nested_json(
    raw: bytes, shallow: bytes | None, run_index: int
) -> None:
    # The decoders recurse; nesting past their limit used to raise RecursionError.
    _check_never_raises(raw, run_index)
    decision = verify(MACHINE, RUNS[run_index], raw, 1000.0, CircuitBoard())
    expected = {"malformed"}
    if shallow is not None:
        # Well-formed JSON 3,000 deep parses where the interpreter gives C code the stack
        # for it (Python 3.13); then it gets the answer the same proposal gets shallow.
        expected.add(verify(MACHINE, RUNS[run_index], shallow, 1000.0).violations[0].code)
    assert decision.violations[0].code in expected


# -- the single-decode path ---------------------------------------------------------------
# A call to a tool whose schema is a msgspec Struct is decoded once, through a per-state
# tagged union; anything that union refuses goes through the two-pass path
# (``_gate._verify``), which explains the rejection. Both must decide identically.


def _repeated_run() -> RunState:
    events = started()
    for tool, args in (
        ("lookup_order", {"order_id": "o1"}),
        ("refund_struct", {"order_id": "o1", "amount": 10.0, "reason": "other"}),
        ("refund_json", {"order_id": "o1", "amount": 10.0, "reason": "other"}),
    ):
        for _ in range(3):
            events = committed(events, tool, args, {"total": 50.0})
    return fold(MACHINE, events)


PATH_RUNS = [run_in("WORK"), run_in("REVIEW"), run_in("ARCHIVE"), _repeated_run()]


def _open_circuits() -> CircuitBoard:
    circuits = CircuitBoard()
    policy = BreakerPolicy(circuit_failures=1)
    circuits.record("refund_struct", False, 990.0, policy, "HTTPStatusError: 503")
    return circuits


_TOOL_NAMES = [*MACHINE.tables.tools, "nope", "", "WORK"]
_good_args = st.fixed_dictionaries(
    {
        "order_id": st.sampled_from(["o1", "o2"]) | st.text(max_size=3),
        "amount": st.sampled_from([10, 10.0, 11, 0.5, 1000, 1001]) | st.floats(0, 2000),
    },
    optional={"reason": st.sampled_from(["damaged", "late", "other", "bored"])},
)
_call_args = (
    _good_args
    | st.just({"order_id": "o1"})
    | st.just({})
    | st.dictionaries(st.sampled_from(["order_id", "amount", "reason", "note"]), _json, max_size=4)
    | _json
)
_pairs = st.lists(
    st.tuples(st.just("tool"), st.sampled_from(_TOOL_NAMES) | _json)
    | st.tuples(st.just("args"), _call_args)
    | st.tuples(st.just("next"), st.none() | st.sampled_from(["COMPLETED", "REVIEW", "NOPE"]))
    | st.tuples(st.sampled_from(["data", "extra"]), _json),
    max_size=5,
)
_calls = st.tuples(st.sampled_from(_TOOL_NAMES), _call_args).map(
    lambda call: [("tool", call[0]), ("args", call[1])]
)
_extras = st.lists(
    st.sampled_from([("data", {"a": 1}), ("next", None)]), unique_by=lambda pair: pair[0]
)


def _object(pairs: list[tuple[str, Any]]) -> bytes:
    """A JSON object from key/value pairs, in their order, duplicate keys kept."""
    items = (msgspec.json.encode(k) + b":" + msgspec.json.encode(v) for k, v in pairs)
    return b"{" + b",".join(items) + b"}"


# Mostly calls (valid or not, keys in any order, with data or a null next), then
# arbitrary objects with repeated keys, then truncated calls.
_path_proposals = (
    st.tuples(_calls, _extras).map(lambda c: c[0] + c[1]).flatmap(st.permutations).map(_object)
    | _pairs.map(_object)
    | _calls.map(_object).map(lambda raw: raw[:-3])
)


def _described(decision: Decision) -> tuple[Any, ...]:
    return (
        decision,
        list(decision.args.items()),
        repr(decision.args),  # int against float, in order
        list(decision.data.items()),
    )


@settings(max_examples=400, deadline=None)
@given(
    raw=_path_proposals,
    run_index=st.sampled_from(range(len(PATH_RUNS))),
    circuits=st.booleans(),
    now=st.sampled_from([1000.0, 2000.0]),
)
def test_single_decode_and_two_pass_paths_decide_alike(
    raw: bytes, run_index: int, circuits: bool, now: float
) -> None:
    run = PATH_RUNS[run_index]
    fast = verify(MACHINE, run, raw, now, _open_circuits() if circuits else None)
    slow = _gate._verify(MACHINE, run, raw, now, _open_circuits() if circuits else None)
    assert _described(fast) == _described(slow)
    if fast.tool is not None:
        # The hash recovery recomputes from the journaled args, and today's recipe.
        assert fast.call_hash == _call_hash(fast.tool.name, fast.args)
        args = msgspec.json.decode(raw).get("args", {})  # a call may leave args out
        validated, violations = fast.tool.validator.validate_json(msgspec.json.encode(args))
        assert violations == ()
        builtins = (
            msgspec.to_builtins(validated)
            if isinstance(validated, msgspec.Struct)
            else fast.tool.validator.to_builtins(validated)
        )
        assert repr(fast.args) == repr(builtins)
        assert fast.call_hash == proposal_hash(fast.tool.name.encode(), canonical_args(builtins))


def test_a_struct_call_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def two_pass(*args: Any) -> Decision:
        raise AssertionError("the two-pass path ran")

    monkeypatch.setattr(_gate, "_verify", two_pass)
    raw = b'{"args": {"amount": 10, "order_id": "o1"}, "tool": "refund_struct", "next": null}'
    decision = verify(MACHINE, run_in(), raw, 1000.0)
    assert decision.accepted
    assert list(decision.args.items()) == [
        ("order_id", "o1"),
        ("amount", 10.0),
        ("reason", "other"),
    ]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"tool": "refund_pydantic", "args": {"amount": 10, "order_id": "o1"}}',
        # a JSON Schema tool's guards get the JSON, not a Struct
        b'{"tool": "refund_json", "args": {"amount": 10, "order_id": "o1"}}',
        b'{"tool": "archive"}',  # no args: the two-pass path fills in {}
        b'{"next": "COMPLETED"}',
        b'{"tool": "refund_struct", "args": {"amount": 10}}',
    ],
)
def test_other_proposals_take_the_two_pass_path(
    monkeypatch: pytest.MonkeyPatch, raw: bytes
) -> None:
    calls = []
    two_pass = _gate._verify

    def counted(*args: Any) -> Decision:
        calls.append(args)
        return two_pass(*args)

    monkeypatch.setattr(_gate, "_verify", counted)
    verify(MACHINE, run_in(), raw, 1000.0)
    assert len(calls) == 1


def test_a_state_with_one_struct_tool_still_needs_the_tool_field() -> None:
    # A lone tagged Struct would decode an object without its tag; the gate's union must not.
    machine = _budget_machine()
    decision = verify(machine, fold(machine, started()), b'{"args": {"order_id": "o1"}}', 1000.0)
    assert rejected(decision) == [
        (
            "malformed",
            "$",
            'proposal has neither of "tool" and "next"; it needs exactly one',
            SHAPE_HINT,
        )
    ]
    empty_tag = b'{"tool": "", "args": {"order_id": "o1"}}'
    assert [
        v.code for v in verify(machine, fold(machine, started()), empty_tag, 1000.0).violations
    ] == ["unknown_tool"]


def test_plans_are_made_once_per_state() -> None:
    machine = _budget_machine()
    run = fold(machine, started())
    assert verify(machine, run, LOOKUP, 1000.0).accepted
    plan = machine.gate_plans["WORK"]
    assert plan.decoder is not None
    assert verify(machine, run, LOOKUP, 1000.0).accepted
    assert machine.gate_plans["WORK"] is plan


def test_no_plan_for_a_state_without_struct_tools() -> None:
    raw = b'{"next": "COMPLETED", "data": {"approved": true}}'
    assert verify(MACHINE, run_in("REVIEW"), raw, 1000.0).accepted
    assert MACHINE.gate_plans["REVIEW"].decoder is None


def test_decision_defaults() -> None:
    decision = Decision()
    assert decision.accepted
    assert (decision.violations, decision.trip, decision.tool) == ((), None, None)
    assert (decision.args, decision.target, decision.data, decision.call_hash) == ({}, "", {}, 0)
    assert decision.args is not Decision().args  # a fresh dict each


# -- validated args as builtins ----------------------------------------------------------


class Color(msgspec.Struct):
    name: str


class Plain(msgspec.Struct, forbid_unknown_fields=True):
    text: str
    count: int
    ratio: float
    flag: bool
    kind: Literal["a", "b", 3]
    maybe: int | None = None
    tags: list[str] = []
    scores: dict[str, list[float]] = {}
    anything: Any = None
    label: Annotated[str, msgspec.Meta(max_length=5)] = "x"


class Shade(msgspec.Struct, tag=True):
    name: str


class RenamedArgs(msgspec.Struct, rename="camel"):
    first_name: str


class OmitArgs(msgspec.Struct, omit_defaults=True):
    name: str = ""


class ArrayArgs(msgspec.Struct, array_like=True):
    name: str


class Kind(str, __import__("enum").Enum):
    A = "a"


@pytest.mark.parametrize(
    ("fields", "plain"),
    [
        ([("name", str)], True),
        ([("name", str | None, None), ("n", int, 3)], True),
        ([("nested", Color)], False),
        ([("pair", tuple[int, int])], False),
        ([("many", set[str])], False),
        ([("when", __import__("datetime").date)], False),
        ([("kind", Kind)], False),
        ([("blob", bytes)], False),
        ([("maybe", int | msgspec.UnsetType, msgspec.UNSET)], False),
        ([("keys", dict[int, str])], False),
        ([("colors", list[Color])], False),
        ([("default", list[str], msgspec.field(default_factory=lambda: ["x"]))], False),
    ],
)
def test_plain_struct(fields: list[Any], plain: bool) -> None:
    assert plain_struct(msgspec.defstruct("Args", fields)) is plain


@pytest.mark.parametrize("struct", [Plain, RenamedArgs, OmitArgs, ArrayArgs, Shade])
def test_plain_struct_by_config(struct: type) -> None:
    assert plain_struct(struct) is (struct is Plain)


def test_plain_struct_refuses_what_is_not_a_struct() -> None:
    assert plain_struct(dict) is False
    assert plain_struct(int) is False
    assert plain_struct(Annotated[Plain, msgspec.Meta(title="x")]) is False


_plain_values = st.fixed_dictionaries(
    {
        "text": st.text(max_size=5),
        "count": st.integers(),
        "ratio": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-5, 5),
        "flag": st.booleans(),
        "kind": st.sampled_from(["a", "b", 3]),
    },
    optional={
        "maybe": st.none() | st.integers(),
        "tags": st.lists(st.text(max_size=3), max_size=3),
        "scores": st.dictionaries(
            st.text(max_size=3), st.lists(st.floats(allow_nan=False, allow_infinity=False))
        ),
        "anything": _json,
        "label": st.text(max_size=5),
    },
)


@given(_plain_values)
def test_plain_struct_builtins_are_its_fields(value: dict[str, Any]) -> None:
    validator = Tool("plain", nop, Plain).validator
    args, violations = validator.validate_json(msgspec.json.encode(value))
    assert violations == ()
    builtins = validator.to_builtins(args)
    assert repr(builtins) == repr(msgspec.to_builtins(args))
    # The gate hashes the sorted encoding of a plain Struct itself. What it must give is
    # stated here without canonical_args: msgpack of the builtins, every map's keys put
    # in order by hand (the Struct's fields and a dict built from it come in declaration
    # order alike, so comparing the two encodings would not notice a lost sort). What the
    # journal cannot hold (an integer past 64 bits) fails both ways alike.
    try:
        expected = msgspec.msgpack.encode(_keys_in_order(builtins))
    except OverflowError:
        for value in (args, builtins):
            with pytest.raises(OverflowError):
                canonical_args(value)
        return
    assert canonical_args(args) == expected
    assert canonical_args(builtins) == expected


def _keys_in_order(value: Any) -> Any:
    """``value`` with the keys of every dict in it sorted (msgpack keeps a dict's order)."""
    if isinstance(value, dict):
        return {key: _keys_in_order(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_keys_in_order(item) for item in value]
    return value
