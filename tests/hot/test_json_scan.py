"""Reading a proposal exactly: ``scan_json`` finds the first defect in raw JSON bytes."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock.core import _hot_py

from .conftest import near_json as near_json_of

EMPTY = _hot_py.JSON_EMPTY
TRUNCATED = _hot_py.JSON_TRUNCATED
TRAILING_TEXT = _hot_py.JSON_TRAILING_TEXT
EXPECTED_VALUE = _hot_py.JSON_EXPECTED_VALUE
EXPECTED_KEY = _hot_py.JSON_EXPECTED_KEY
EXPECTED_COLON = _hot_py.JSON_EXPECTED_COLON
EXPECTED_COMMA = _hot_py.JSON_EXPECTED_COMMA
TRAILING_COMMA = _hot_py.JSON_TRAILING_COMMA
BAD_NUMBER = _hot_py.JSON_BAD_NUMBER
BAD_ESCAPE = _hot_py.JSON_BAD_ESCAPE
LONE_SURROGATE = _hot_py.JSON_LONE_SURROGATE
BAD_UTF8 = _hot_py.JSON_BAD_UTF8
CONTROL_CHARACTER = _hot_py.JSON_CONTROL_CHARACTER
DUPLICATE_KEY = _hot_py.JSON_DUPLICATE_KEY


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"tool": "count", "args": {}}', None),
        (b' \t\r\n[1, -0.5e+3, "x", true, false, null, {}, []] \n', None),
        (b'"\\ud83d\\ude00 \\u00e9 \\" \\\\ \\/ \\b\\f\\n\\r\\t"', None),
        (b'{"tool": "count", "args": {}, "tool": "wipe"}', (DUPLICATE_KEY, 30, ("tool",))),
        # keys compare as decoded text
        (b'{"tool": "count", "\\u0074ool": "wipe"}', (DUPLICATE_KEY, 18, ("tool",))),
        (b'{"\\u00e9": 1, "\xc3\xa9": 2}', (DUPLICATE_KEY, 14, ("é",))),
        (b'{"\\ud83d\\ude00": 1, "\xf0\x9f\x98\x80": 2}', (DUPLICATE_KEY, 20, ("😀",))),
        (
            b'{"args": {"items": [{"sku": 1}, {"sku": 2}, {"sku": 3, "sku": 4}]}}',
            (DUPLICATE_KEY, 55, ("args", "items", 2, "sku")),
        ),
        # the same key in two objects is no defect; the first defect in the text wins
        (b'[{"a": 1}, {"a": 2}]', None),
        (b'{"a": {"b": 1, "b": 2}, "a": 3}', (DUPLICATE_KEY, 15, ("a", "b"))),
        (b'{"a": 1, "a": 2, "b": x}', (DUPLICATE_KEY, 9, ("a",))),
        (b'{"a": x, "a": 2}', (EXPECTED_VALUE, 6, ("a",))),
        (b"", (EMPTY, 0, ())),
        (b" \n ", (EMPTY, 3, ())),
        (b'{"tool": "x"', (TRUNCATED, 12, ("tool",))),
        (b'{"tool": "x', (TRUNCATED, 11, ("tool",))),
        (b'{"tool": ', (TRUNCATED, 9, ("tool",))),
        (b'{"tool"', (TRUNCATED, 7, ("tool",))),
        (b'{"a": [1, 2', (TRUNCATED, 11, ("a", 1))),
        (b'{"a": [1, 2,', (TRUNCATED, 12, ("a", 2))),
        (b"[tru", (TRUNCATED, 4, (0,))),
        (b"-", (TRUNCATED, 1, ())),
        (b"1.", (TRUNCATED, 2, ())),
        (b"1e+", (TRUNCATED, 3, ())),
        (b'"\\', (TRUNCATED, 2, ())),
        (b'"\\u00', (TRUNCATED, 5, ())),
        (b'"\\ud800', (TRUNCATED, 7, ())),
        (b'"\\ud800\\', (TRUNCATED, 8, ())),
        (b'"\\ud800\\udc', (TRUNCATED, 11, ())),
        (b'{"a": 1} Let me know', (TRAILING_TEXT, 9, ())),
        (b"{}{}", (TRAILING_TEXT, 2, ())),
        (b"Sure! Here is the call:", (EXPECTED_VALUE, 0, ())),
        (b'```json\n{"a": 1}\n```', (EXPECTED_VALUE, 0, ())),
        (b'{"a": True}', (EXPECTED_VALUE, 6, ("a",))),
        (b'{"a": NaN}', (EXPECTED_VALUE, 6, ("a",))),
        (b'{"a": nul}', (EXPECTED_VALUE, 6, ("a",))),
        (b'{"a": }', (EXPECTED_VALUE, 6, ("a",))),
        (b"[}", (EXPECTED_VALUE, 1, (0,))),
        (b"{a: 1}", (EXPECTED_KEY, 1, ())),
        (b'{"a": 1, 2}', (EXPECTED_KEY, 9, ())),
        (b"{'a': 1}", (EXPECTED_KEY, 1, ())),
        (b'{"a" 1}', (EXPECTED_COLON, 5, ("a",))),
        (b'{"a": 1 "b": 2}', (EXPECTED_COMMA, 8, ("a",))),
        (b"[1 2]", (EXPECTED_COMMA, 3, (0,))),
        (b'{"a": 1,}', (TRAILING_COMMA, 8, ())),
        (b"[1, 2, ]", (TRAILING_COMMA, 7, (2,))),
        (b"[01]", (BAD_NUMBER, 1, (0,))),
        (b"-a", (BAD_NUMBER, 0, ())),
        (b"[1.e5]", (BAD_NUMBER, 1, (0,))),
        (b"1e+x", (BAD_NUMBER, 0, ())),
        (b"[+1]", (EXPECTED_VALUE, 1, (0,))),
        (b'"\\x41"', (BAD_ESCAPE, 1, ())),
        (b'"\\u12G4"', (BAD_ESCAPE, 1, ())),
        (b'"ok \\ud800 no"', (LONE_SURROGATE, 4, ())),
        (b'"\\udc00"', (LONE_SURROGATE, 1, ())),
        (b'"\\ud800\\u0041"', (LONE_SURROGATE, 1, ())),
        (b'"\\ud800\\n"', (LONE_SURROGATE, 1, ())),
        (b'"\\ud800\\uZZZZ"', (BAD_ESCAPE, 7, ())),
        (b'{"a": "caf\xe9"}', (BAD_UTF8, 10, ("a",))),
        (b'"\xed\xa0\x80"', (BAD_UTF8, 1, ())),  # a surrogate, encoded
        (b'"\xc0\xaf"', (BAD_UTF8, 1, ())),  # overlong
        (b'"\xf4\x90\x80\x80"', (BAD_UTF8, 1, ())),  # past U+10FFFF
        (b'"ab\xe2\x82', (BAD_UTF8, 3, ())),  # cut inside a character
        (b"\xef\xbb\xbf{}", (EXPECTED_VALUE, 0, ())),  # a byte order mark
        (b'{"a": "line\nbreak"}', (CONTROL_CHARACTER, 11, ("a",))),
        (b'"tab\there"', (CONTROL_CHARACTER, 4, ())),
        (b'"\x7f"', None),  # DEL is no control character to JSON
        (b"[" * 10_000, (TRUNCATED, 10_000, (0,) * 10_000)),  # no recursion limit
    ],
)
def test_examples(hot: ModuleType, data: bytes, expected: Any) -> None:
    assert hot.scan_json(data) == expected


def test_bytes_like_objects(hot: ModuleType) -> None:
    data = b'{"a": 1, "a": 2}'
    assert hot.scan_json(bytearray(data)) == (DUPLICATE_KEY, 9, ("a",))
    assert hot.scan_json(memoryview(data)) == (DUPLICATE_KEY, 9, ("a",))


def test_refuses_what_is_not_bytes(hot: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"^scan_json\(\) needs a bytes-like object, not 'str'$"):
        hot.scan_json('{"a": 1}')


def test_a_million_keys_take_linear_time(hot: ModuleType) -> None:
    keys = b",".join(b'"k%d": 0' % i for i in range(200_000))
    assert hot.scan_json(b"{" + keys + b"}") is None
    assert hot.scan_json(b"{" + keys + b', "k7": 1}') == (DUPLICATE_KEY, len(keys) + 3, ("k7",))


# -- against a reference: the json module, made strict ------------------------------------


class _Refused(Exception):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len(dict(pairs)) != len(pairs):
        raise _Refused
    return dict(pairs)


def _whole_code_points(value: Any) -> None:
    texts = [value] if isinstance(value, str) else []
    if isinstance(value, dict):
        texts = list(value)
        for item in value.values():
            _whole_code_points(item)
    elif isinstance(value, list):
        for item in value:
            _whole_code_points(item)
    for text in texts:
        text.encode()  # an unpaired surrogate cannot be encoded


def reference_accepts(data: bytes) -> bool:
    """Strict JSON: UTF-8, no NaN or Infinity, no key twice, no unpaired surrogate."""
    try:
        value = json.loads(
            data.decode(), object_pairs_hook=_unique, parse_constant=lambda name: 1 / 0
        )
        _whole_code_points(value)
    except (ValueError, ZeroDivisionError, RecursionError, _Refused):
        return False
    return True


_keys = st.sampled_from(["a", "b", "tool", "é", "\u0074", "😀", "\n", ""]) | st.text(max_size=3)
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=15,
)


def _dumped(value: Any, ascii_only: bool, indent: int | None) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()


_documents = st.builds(
    _dumped, _values, st.booleans(), st.sampled_from([None, 0, 2])
) | _values.map(msgspec.json.encode)
_near_json = near_json_of(30)
_damaged = st.tuples(_documents, st.data())


@settings(max_examples=300)
@given(_documents)
def test_valid_documents_have_no_defect(hot: ModuleType, data: bytes) -> None:
    if reference_accepts(data):
        assert hot.scan_json(data) is None
    else:  # a key twice
        assert hot.scan_json(data)[0] == DUPLICATE_KEY


@settings(max_examples=500)
@given(st.binary(max_size=60) | _near_json)
def test_a_defect_exactly_when_strict_json_refuses(hot: ModuleType, data: bytes) -> None:
    assert (hot.scan_json(data) is None) == reference_accepts(data)


@settings(max_examples=300)
@given(_documents, st.data())
def test_a_cut_document_is_truncated_where_it_ends(
    hot: ModuleType, data: bytes, draw: st.DataObject
) -> None:
    cut = data[: draw.draw(st.integers(min_value=0, max_value=len(data)))]
    found = hot.scan_json(cut)
    if found is None or found[0] == DUPLICATE_KEY:
        return
    code, offset, _path = found
    if cut.strip():
        # A cut inside a multi-byte character is invalid UTF-8 where the character starts.
        assert (code, offset) == (TRUNCATED, len(cut)) or code == BAD_UTF8
    else:
        assert (code, offset) == (EMPTY, len(cut))
