"""JSON Schema argument schemas: the supported subset, strict, and nothing given dropped."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import (
    Machine,
    Reject,
    RunView,
    Tool,
    ToolDefinitionError,
    Worker,
)
from interlock.core import _schema
from interlock.core._events import RunStarted
from interlock.core._gate import verify
from interlock.core._view import fold


async def nop(args: Any, ctx: Any) -> None:
    return None


def check(schema: dict[str, Any], args: Any) -> Any:
    """What the compiled ``schema`` makes of ``args``: the value, or the violations."""
    value, violations = Tool("t", nop, schema).validator.validate_json(msgspec.json.encode(args))
    if violations:
        return [(v.path, v.message, v.hint) for v in violations]
    return value


def refused(schema: dict[str, Any]) -> str:
    with pytest.raises(ToolDefinitionError) as raised:
        Tool("t", nop, schema)
    return str(raised.value)


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


# -- nothing given is dropped ------------------------------------------------------------

FREE = obj(meta={"type": "object"}, tags={"type": "array"}, anything={})
GIVEN = {"meta": {"a": 1, "b": [1, {"c": None}]}, "tags": ["a", 1, {"b": None}], "anything": [2.5]}


def test_a_free_form_object_and_array_keep_every_value() -> None:
    assert check(FREE, GIVEN) == GIVEN


def test_undeclared_properties_are_kept_unless_refused() -> None:
    order = obj(id={"type": "integer"}, lines={"type": "array", "items": obj(sku={})})
    given = {"id": 1, "note": "rush", "lines": [{"sku": "a", "qty": 2}, {"sku": "b"}]}
    assert check(order, given) == given
    closed = {**order, "additionalProperties": False}
    assert check(closed, given) == [
        (
            "args",
            "args: object contains unknown field `note`",
            "remove the field; allowed fields: id, lines",
        )
    ]


def test_undeclared_properties_are_checked_against_additional_properties() -> None:
    counts = {
        **obj(id={"type": "integer"}),
        "additionalProperties": {"type": "integer", "minimum": 0},
    }
    assert check(counts, {"id": 1, "apples": 2}) == {"id": 1, "apples": 2}
    assert check(counts, {"id": 1, "apples": 2, "pears": -1}) == [
        ("args.pears", "args.pears: expected `int` >= 0", "propose args.pears >= 0")
    ]
    mapping = {"type": "object", "additionalProperties": obj(a={"type": "integer"})}
    assert check(mapping, {"k": {"a": 1, "b": 2}}) == {"k": {"a": 1, "b": 2}}
    assert check(mapping, {"k": {"a": "1"}}) == [
        (
            "args[...].a",  # msgspec does not name a mapping's keys
            "args[...].a: expected `int`, got `str`",
            "send args[...].a as a JSON int, not str",
        )
    ]


def test_defaults_are_filled_in_and_absent_stays_absent() -> None:
    schema = obj(
        a={"type": "boolean", "default": False},
        b={"type": "array", "default": [1]},
        c={"type": "string"},
    )
    assert check(schema, {}) == {"a": False, "b": [1]}
    first = check(schema, {})
    first["b"].append(2)
    assert check(schema, {}) == {"a": False, "b": [1]}  # each call gets its own default


# -- strict --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "args", "expected"),
    [
        ({"type": "integer"}, 5, 5),
        ({"type": "integer"}, "5", "expected `int`, got `str`"),
        ({"type": "integer"}, 5.0, "expected `int`, got `float`"),
        ({"type": "number"}, 5, 5.0),
        ({"type": "number"}, "5", "expected `float`, got `str`"),
        ({"type": "boolean"}, 1, "expected `bool`, got `int`"),
        ({"type": "string"}, 1, "expected `str`, got `int`"),
        ({"type": ["string", "null"]}, None, None),
        ({"type": ["string", "null"]}, "x", "x"),
        ({"type": ["string", "null"]}, 1, "expected `str | null`, got `int`"),
        ({"type": ["integer", "string"], "minimum": 1, "maxLength": 2}, 0, "expected `int` >= 1"),
        (
            {"type": ["integer", "string"], "minimum": 1, "maxLength": 2},
            "abc",
            "expected `str` of length <= 2",
        ),
        ({"type": "string", "enum": ["a", "b"]}, "c", "invalid enum value 'c'"),
        ({"enum": ["a", 1, True, None]}, True, True),
        ({"const": "card"}, "card", "card"),
        ({"const": "card"}, "cash", "invalid enum value 'cash'"),
        ({"type": "integer", "minimum": 1, "exclusiveMaximum": 10}, 10, "expected `int` <= 9"),
        ({"type": "number", "exclusiveMinimum": 0}, 0, "expected `float` > 0.0"),
        ({"type": "integer", "multipleOf": 5}, 7, "expected `int` that's a multiple of 5"),
        (
            {"type": "string", "pattern": "^[A-Z]{3}$"},
            "abc",
            "expected `str` matching regex '^[A-Z]{3}$'",
        ),
        ({"type": "string", "minLength": 2}, "a", "expected `str` of length >= 2"),
        ({"type": "array", "maxItems": 1}, [1, 2], "expected `array` of length <= 1"),
        (
            {"type": "object", "maxProperties": 1},
            {"a": 1, "b": 2},
            "expected `object` of length <= 1",
        ),
        (
            {"type": "string", "format": "date-time"},
            "2024-05-01T12:00:00+00:00",
            "2024-05-01T12:00:00Z",
        ),
        (
            {"type": "string", "format": "date-time"},
            "2024-05-01 noon",
            "invalid RFC3339 encoded datetime",
        ),
        ({"type": "string", "format": "date"}, "2024-02-30", "invalid RFC3339 encoded date"),
        ({"type": "string", "format": "time"}, "12:00:00", "12:00:00"),
        ({"type": "string", "format": "duration"}, "P1D", "P1D"),
        ({"type": "string", "format": "uuid"}, "not-a-uuid", "invalid UUID"),
    ],
)
def test_each_keyword_is_checked(schema: dict[str, Any], args: Any, expected: Any) -> None:
    found = check(obj(x=schema), {"x": args})
    if isinstance(found, dict):
        assert found == {"x": expected}
    else:
        assert found[0][1] == f"args.x: {expected}"


def test_a_format_error_says_what_to_send() -> None:
    assert check(obj(when={"type": "string", "format": "date"}), {"when": "May 1"}) == [
        (
            "args.when",
            "args.when: invalid RFC3339 encoded date",
            "send args.when as a date string, like '2024-05-01'",
        )
    ]


# -- choices -------------------------------------------------------------------------------

PAYMENT = obj(
    pay={
        "oneOf": [
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "card"},
                    "number": {"type": "string", "pattern": "^[0-9]{4}$"},
                },
                "required": ["kind", "number"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "iban"}, "iban": {"type": "string"}},
                "required": ["kind", "iban"],
                "additionalProperties": False,
            },
            {"type": "null"},
        ]
    }
)


@pytest.mark.parametrize(
    ("pay", "expected"),
    [
        ({"kind": "card", "number": "1234", "note": "kept"}, None),
        ({"kind": "iban", "iban": "DE02"}, None),
        (None, None),
        (
            {"kind": "iban", "iban": "DE02", "note": "x"},
            [("args.pay", "args.pay: object contains unknown field `note`", "remove the field")],
        ),
        (
            {"kind": "card", "number": "12"},
            [
                (
                    "args.pay.number",
                    "args.pay.number: expected `str` matching regex '^[0-9]{4}$'",
                    "propose args.pay.number matching regex '^[0-9]{4}$'",
                )
            ],
        ),
        ({"kind": "cash"}, "args.pay.kind: invalid value 'cash'"),
        ("card", "args.pay: expected `object | null`, got `str`"),
    ],
)
def test_one_of_objects_picks_the_choice_by_its_discriminator(pay: Any, expected: Any) -> None:
    found = check(PAYMENT, {"pay": pay})
    if expected is None:
        assert found == {"pay": pay}
    elif isinstance(expected, str):
        assert found[0][1] == expected
    else:
        assert found == expected


def test_any_of_simple_types() -> None:
    schema = obj(id={"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]})
    assert check(schema, {"id": "a"}) == {"id": "a"}
    assert check(schema, {"id": 7}) == {"id": 7}
    assert check(schema, {"id": ""})[0][1] == "args.id: expected `str` of length >= 1"
    assert check(schema, {"id": 1.5})[0][1] == "args.id: expected `int | str`, got `float`"


# -- what is refused at definition ---------------------------------------------------------

KEYWORDS = ", ".join(sorted(_schema.SUPPORTED))


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            obj(a={"$ref": "#/$defs/A"}),
            f"JSON Schema keyword '$ref' at args.a is not supported; use {KEYWORDS}, "
            "or a msgspec Struct",
        ),
        (
            obj(a={"type": "array", "items": {"type": "string", "uniqueItems": True}}),
            f"JSON Schema keyword 'uniqueItems' at args.a[] is not supported; use {KEYWORDS}, "
            "or a msgspec Struct",
        ),
        (
            obj(a={"type": "object", "properties": {"b": {"type": "integer", "nullable": True}}}),
            f"JSON Schema keyword 'nullable' at args.a.b is not supported; use {KEYWORDS}, "
            "or a msgspec Struct",
        ),
        (
            obj(a={"type": "string", "format": "email"}),
            "JSON Schema at args.a: format 'email' is not checked; checked formats: date-time, "
            "date, time, duration, uuid (or use a 'pattern')",
        ),
        (
            obj(a={"type": "string", "minimum": 1}),
            "JSON Schema at args.a: 'minimum' does not apply to type string",
        ),
        (
            obj(a={"maxLength": 1}),
            "JSON Schema at args.a: 'maxLength' needs a 'type' it applies to",
        ),
        (
            obj(a={"type": "strin"}),
            "JSON Schema at args.a: 'type' must be one of string, integer, number, boolean, "
            "null, object, array, or a list of distinct ones; got 'strin'",
        ),
        (
            obj(a={"type": ["string", "string"]}),
            "JSON Schema at args.a: 'type' must be one of string, integer, number, boolean, "
            "null, object, array, or a list of distinct ones; got ['string', 'string']",
        ),
        (obj(a={"enum": []}), "empty enum at args.a"),
        (
            obj(a={"enum": [1.5]}),
            "JSON Schema at args.a: enum value 1.5 is a float; only strings, integers, booleans "
            "and null are supported",
        ),
        (
            obj(a={"type": "string", "enum": ["x", 1]}),
            "JSON Schema at args.a: enum value 1 is not of type string",
        ),
        (
            obj(a={"enum": ["x"], "maxLength": 1}),
            "JSON Schema at args.a: 'enum' cannot be combined with 'maxLength' (put it in each choice)",
        ),
        (
            obj(a={"type": "string", "anyOf": [{"maxLength": 1}]}),
            "JSON Schema at args.a: 'anyOf' cannot be combined with 'type' (put it in each choice)",
        ),
        (
            obj(a={"oneOf": [{"type": "integer"}, {"type": "number"}]}),
            "JSON Schema at args.a: 'oneOf' has choices that overlap (number); each must read a "
            "different JSON type (objects may be several, with a discriminator)",
        ),
        (
            obj(a={"anyOf": [{"type": "string"}, {"type": "string", "pattern": "x"}]}),
            "JSON Schema at args.a: 'anyOf' has choices that overlap (string); each must read a "
            "different JSON type (objects may be several, with a discriminator)",
        ),
        (
            obj(a={"anyOf": [{"type": "object"}, obj(b={})]}),
            "JSON Schema at args.a: 'anyOf' has 2 object choices and no property that each fixes "
            "to a distinct string or integer with 'const' (a discriminator, e.g. \"kind\": "
            '{"const": "card"}); add one',
        ),
        (
            obj(a={"oneOf": []}),
            "JSON Schema at args.a: 'oneOf' must be a non-empty list of schemas",
        ),
        (
            obj(a={"type": "string", "pattern": "("}),
            "JSON Schema at args.a: invalid pattern: missing ), unterminated subpattern at position 0",
        ),
        (
            {**obj(a={}), "minProperties": 1},
            "JSON Schema at args: 'minProperties' applies only to an object without 'properties'",
        ),
        (
            {**obj(a={}), "additionalProperties": "no"},
            "JSON Schema at args: 'additionalProperties' must be true, false or a schema; got 'no'",
        ),
        (
            {**obj(a={}), "required": ["b"]},
            "required field 'b' at args has no entry in 'properties'",
        ),
        (obj(a=3), "JSON Schema at args.a: a schema must be an object; got 3"),
    ],
)
def test_what_is_not_supported_is_refused_at_definition(
    schema: dict[str, Any], message: str
) -> None:
    assert refused(schema) == f"tool 't': {message}"


def test_a_machine_refuses_an_unsupported_data_schema() -> None:
    with pytest.raises(ToolDefinitionError) as raised:
        Machine("m", "A", {"A": Worker(next=["COMPLETED"], data=obj(a={"not": {}}))})
    assert str(raised.value).startswith(
        "tool 'm.A.data': JSON Schema keyword 'not' at args.a is not supported; use "
    )


def test_the_documented_subset_is_what_is_supported() -> None:
    table = (_schema.__doc__ or "").split("=====  =====")[2]
    rows = [line[:26] for line in table.splitlines()]
    documented = set(re.findall(r"``([$\w]+)``", " ".join(rows)))
    assert documented == _schema.SUPPORTED
    format_row = table[table.index("``format``") :].split("``minimum``")[0]
    assert set(re.findall(r"``([\w-]+)``", format_row)) - {"format", "Z"} == set(_schema._FORMATS)


# -- in the gate -------------------------------------------------------------------------------


def _amount_guard(args: dict[str, Any], view: RunView) -> Reject | None:
    # A JSON Schema tool's guards get the JSON: dicts and lists, defaults filled in.
    if args["amount"] > 100:
        return Reject(
            f"args.amount: {args['amount']} is over 100", "propose amount <= 100", "args.amount"
        )
    return None


MACHINE = Machine(
    "m",
    initial="WORK",
    states={
        "WORK": Worker(next=["REVIEW"], tools=["refund"]),
        "REVIEW": Worker(next=["COMPLETED"], data={"type": "object"}),
    },
    tools=[
        Tool(
            "refund",
            nop,
            {
                **obj(
                    amount={"type": "number"},
                    reason={"enum": ["late", "other"], "default": "other"},
                ),
                "required": ["amount"],
            },
            guards=[_amount_guard],
        )
    ],
)


def _run(state: str) -> Any:
    return fold(
        MACHINE, [RunStarted(run_id="r", seq=1, ts=0.0, machine="m", state=state, inputs={})]
    )


def test_a_call_keeps_what_it_was_given_and_guards_see_the_json() -> None:
    raw = b'{"tool": "refund", "args": {"amount": 10, "ticket": {"id": 7}}}'
    decision = verify(MACHINE, _run("WORK"), raw, 0.0)
    assert decision.accepted
    assert decision.args == {"amount": 10.0, "reason": "other", "ticket": {"id": 7}}
    assert decision.value == decision.args
    over = verify(MACHINE, _run("WORK"), b'{"tool": "refund", "args": {"amount": 500}}', 0.0)
    assert [(v.code, v.message) for v in over.violations] == [
        ("guard", "args.amount: 500.0 is over 100")
    ]


def test_free_form_data_is_kept() -> None:
    raw = b'{"next": "COMPLETED", "data": {"a": {"b": [1, {"c": 2}]}}}'
    decision = verify(MACHINE, _run("REVIEW"), raw, 0.0)
    assert decision.data == {"a": {"b": [1, {"c": 2}]}}


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200)
@given(st.dictionaries(st.text(max_size=4), _json, max_size=4))
def test_an_open_object_keeps_any_json_it_is_given(extra: dict[str, Any]) -> None:
    schema = obj(a={"type": "object"}, b={"type": "array"})
    given_ = {"a": extra, "b": list(extra.values()), **{f"x{k}": v for k, v in extra.items()}}
    assert check(schema, given_) == given_
