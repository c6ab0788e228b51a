"""The hot path, in pure Python: the readable specification of ``interlock.core._hot``.

The compiled module (``ext/_hot.pyx``) implements the same names with the same
results and the same error text; ``interlock.core._hotpath`` picks one. Rejections are
return codes, never exceptions; exceptions here mean the caller misused the API.

Five jobs live here:

* the transition and tool-permission checks on a machine's integer tables;
* journal framing: encoded events are framed as
  ``[length: u32 LE][length ^ 0xFFFFFFFF: u32 LE][crc32(payload): u32 LE][payload]``
  so that a torn tail (the buffer ends inside a frame) and a corrupt frame (any
  single changed byte) are both detected;
* failure compaction over a run's history, and the canonical proposal hash
  used by the repeat breaker (XXH64, the 64-bit xxHash);
* prompt deltas: the lengths of the prefix and suffix two prompts share, so
  that a model call journals only the part of its prompt that changed;
* reading a proposal exactly: the first defect (a syntax error, or a key named
  twice in one object) that keeps raw bytes from being one JSON value.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

#: Return codes of :meth:`Tables.check_transition`.
OK = 0
UNKNOWN_STATE = 1
ILLEGAL_TRANSITION = 2
#: Return codes of :meth:`Tables.check_tool`.
UNKNOWN_TOOL = 1
TOOL_NOT_ALLOWED = 2
#: Status codes of :func:`unframe`.
FRAMES_OK = 0
FRAMES_TORN = 1
FRAMES_CORRUPT = 2
#: Defect codes of :func:`scan_json`.
JSON_EMPTY = 1  # nothing but whitespace
JSON_TRUNCATED = 2  # the data ends inside a value
JSON_TRAILING_TEXT = 3  # more than whitespace after the value
JSON_EXPECTED_VALUE = 4
JSON_EXPECTED_KEY = 5  # a quoted key
JSON_EXPECTED_COLON = 6
JSON_EXPECTED_COMMA = 7  # or the end of the array or object
JSON_TRAILING_COMMA = 8
JSON_BAD_NUMBER = 9
JSON_BAD_ESCAPE = 10
JSON_LONE_SURROGATE = 11  # a \u escape of half a surrogate pair
JSON_BAD_UTF8 = 12
JSON_CONTROL_CHARACTER = 13  # unescaped, in a string
JSON_DUPLICATE_KEY = 14

#: Bytes of frame header before each payload.
HEADER_SIZE = 12
#: At most this many states and this many tools per machine (one bit each in a u64).
MAX_IDS = 64

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# XXH64's primes (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md).
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5
_WORDS = struct.Struct("<4Q")
_WORD = struct.Struct("<Q")
_HALF = struct.Struct("<I")


class Tables:
    """A machine compiled into integer tables.

    Args:
      states: state names; a state's id is its index.
      tools: tool names; a tool's id is its index.
      edges: per state id, a bitmask of the state ids it may move to.
      tool_masks: per state id, a bitmask of the tool ids allowed there.
      terminal: a bitmask of the terminal state ids.

    Raises:
      ValueError: if the tables do not have one entry per state, or there are
        more than 64 states or tools.
    """

    __slots__ = ("_state_ids", "_tool_ids", "edges", "states", "terminal", "tool_masks", "tools")

    def __init__(
        self,
        states: Sequence[str],
        tools: Sequence[str],
        edges: Sequence[int],
        tool_masks: Sequence[int],
        terminal: int,
    ) -> None:
        if len(states) > MAX_IDS or len(tools) > MAX_IDS:
            raise ValueError(
                f"tables hold at most {MAX_IDS} states and {MAX_IDS} tools; "
                f"got {len(states)} states and {len(tools)} tools"
            )
        if len(edges) != len(states) or len(tool_masks) != len(states):
            raise ValueError(
                f"tables need one edge mask and one tool mask per state; got {len(states)} "
                f"states, {len(edges)} edge masks and {len(tool_masks)} tool masks"
            )
        self.states = tuple(states)
        self.tools = tuple(tools)
        self.edges = tuple(int(mask) & _MASK64 for mask in edges)
        self.tool_masks = tuple(int(mask) & _MASK64 for mask in tool_masks)
        self.terminal = int(terminal) & _MASK64
        self._state_ids = {name: i for i, name in enumerate(self.states)}
        self._tool_ids = {name: i for i, name in enumerate(self.tools)}

    def state_id(self, name: str) -> int:
        """Return the id of state ``name``, or -1 if there is no such state."""
        return self._state_ids.get(name, -1)

    def tool_id(self, name: str) -> int:
        """Return the id of tool ``name``, or -1 if there is no such tool."""
        return self._tool_ids.get(name, -1)

    def check_transition(self, src: int, dst: int) -> int:
        """Return OK, UNKNOWN_STATE (``dst`` < 0 or out of range) or ILLEGAL_TRANSITION."""
        if dst < 0 or dst >= len(self.states) or src < 0 or src >= len(self.states):
            return UNKNOWN_STATE
        if (self.edges[src] >> dst) & 1:
            return OK
        return ILLEGAL_TRANSITION

    def check_tool(self, state: int, tool: int) -> int:
        """Return OK, UNKNOWN_TOOL (``tool`` < 0 or out of range) or TOOL_NOT_ALLOWED."""
        if tool < 0 or tool >= len(self.tools) or state < 0 or state >= len(self.states):
            return UNKNOWN_TOOL
        if (self.tool_masks[state] >> tool) & 1:
            return OK
        return TOOL_NOT_ALLOWED

    def check_call(self, state: str, tool: str) -> int:
        """Return ``check_tool(state_id(state), tool_id(tool))``: the tool check by name."""
        return self.check_tool(self.state_id(state), self.tool_id(tool))

    def is_terminal(self, state: int) -> bool:
        """Return whether ``state`` is a terminal state."""
        return 0 <= state < len(self.states) and bool((self.terminal >> state) & 1)

    def legal_next(self, state: int) -> tuple[str, ...]:
        """Return the names of the states ``state`` may move to, in id order (none for an unknown id)."""
        if type(state) is int and not 0 <= state < len(self.states):
            return ()
        mask = self.edges[state]
        return tuple(name for i, name in enumerate(self.states) if (mask >> i) & 1)

    def allowed_tools(self, state: int) -> tuple[str, ...]:
        """Return the names of the tools allowed in ``state``, in id order (none for an unknown id)."""
        if type(state) is int and not 0 <= state < len(self.states):
            return ()
        mask = self.tool_masks[state]
        return tuple(name for i, name in enumerate(self.tools) if (mask >> i) & 1)


def frame_event(payload: bytes) -> bytes:
    """Return ``payload`` framed with its length, the length's complement and its crc32."""
    size = len(payload)
    if size > _MASK32:
        raise ValueError(f"event payload of {size} bytes exceeds the 4 GiB frame limit")
    crc = zlib.crc32(payload) & _MASK32
    return (
        size.to_bytes(4, "little")
        + (size ^ _MASK32).to_bytes(4, "little")
        + crc.to_bytes(4, "little")
        + bytes(payload)
    )


def frame_events(payloads: Sequence[bytes]) -> bytes:
    """Return all ``payloads`` framed into one contiguous buffer, ready to flush."""
    return b"".join(frame_event(payload) for payload in payloads)


def unframe(buffer: bytes) -> tuple[list[bytes], int, int]:
    """Split a buffer of frames back into payloads.

    Returns:
      ``(payloads, good_end, status)``: the payloads of the leading valid frames,
      the offset just past the last valid frame, and FRAMES_OK, FRAMES_TORN (the
      buffer ends inside a frame: a write was cut short) or FRAMES_CORRUPT (a
      frame's header or checksum does not match). Decoding stops at the first
      bad frame; nothing after it is trusted.
    """
    view = memoryview(buffer)
    total = len(view)
    payloads: list[bytes] = []
    offset = 0
    while offset < total:
        if total - offset < HEADER_SIZE:
            return payloads, offset, FRAMES_TORN
        size = int.from_bytes(view[offset : offset + 4], "little")
        check = int.from_bytes(view[offset + 4 : offset + 8], "little")
        if size ^ check != _MASK32:
            return payloads, offset, FRAMES_CORRUPT
        crc = int.from_bytes(view[offset + 8 : offset + 12], "little")
        start = offset + HEADER_SIZE
        if total - start < size:
            return payloads, offset, FRAMES_TORN
        payload = bytes(view[start : start + size])
        if zlib.crc32(payload) & _MASK32 != crc:
            return payloads, offset, FRAMES_CORRUPT
        payloads.append(payload)
        offset = start + size
    return payloads, offset, FRAMES_OK


def compact_failures(signatures: Sequence[int]) -> list[tuple[int, int, int]]:
    """Collapse runs of identical consecutive failures in a run's history.

    Args:
      signatures: one entry per history item; 0 for an item that is not a
        failure, otherwise the failure's signature (e.g. a hash of code + path).

    Returns:
      A list of ``(first, last, count)`` index groups covering every item in
      order: each maximal run of equal non-zero signatures becomes one group,
      every other item a group of its own.
    """
    groups: list[tuple[int, int, int]] = []
    count = len(signatures)
    i = 0
    while i < count:
        signature = signatures[i]
        j = i
        if signature != 0:
            while j + 1 < count and signatures[j + 1] == signature:
                j += 1
        groups.append((i, j, j - i + 1))
        i = j + 1
    return groups


def _round(acc: int, word: int) -> int:
    acc = (acc + word * _P2) & _MASK64
    return (((acc << 31) | (acc >> 33)) * _P1) & _MASK64


def _merge(acc: int, lane: int) -> int:
    return (((acc ^ _round(0, lane)) * _P1) + _P4) & _MASK64


def hash64(data: bytes, seed: int = 0) -> int:
    """Return the XXH64 hash of ``data`` (a bytes-like object), starting from ``seed``.

    This is xxHash's 64-bit variant, bit for bit: ``hash64(b"") == 0xEF46DB3751D8E999``.
    ``seed`` is reduced to 64 bits (``seed & (2**64 - 1)``).

    Raises:
      TypeError: if ``data`` is not a bytes-like object or ``seed`` is not an int.
    """
    if type(seed) is not int and type(seed) is not bool:
        raise TypeError(f"hash64() seed must be an int, not {type(seed).__name__!r}")
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"hash64() needs a bytes-like object, not {type(data).__name__!r}"
        ) from None
    with view:
        if not view.c_contiguous:
            raise TypeError("hash64() needs a contiguous buffer; copy it with bytes() first")
        raw = view.tobytes()
    seed &= _MASK64
    size = len(raw)
    end = size - size % 32
    if size >= 32:
        v1 = (seed + _P1 + _P2) & _MASK64
        v2 = (seed + _P2) & _MASK64
        v3 = seed
        v4 = (seed - _P1) & _MASK64
        for w1, w2, w3, w4 in _WORDS.iter_unpack(raw[:end]):
            v1, v2, v3, v4 = _round(v1, w1), _round(v2, w2), _round(v3, w3), _round(v4, w4)
        value = (
            ((v1 << 1) | (v1 >> 63))
            + ((v2 << 7) | (v2 >> 57))
            + ((v3 << 12) | (v3 >> 52))
            + ((v4 << 18) | (v4 >> 46))
        ) & _MASK64
        for lane in (v1, v2, v3, v4):
            value = _merge(value, lane)
    else:
        end = 0
        value = (seed + _P5) & _MASK64
    value = (value + size) & _MASK64
    words = (size - end) // 8
    for (word,) in _WORD.iter_unpack(raw[end : end + 8 * words]):
        value ^= _round(0, word)
        value = (((value << 27) | (value >> 37)) * _P1 + _P4) & _MASK64
    at = end + 8 * words
    if size - at >= 4:
        value ^= (_HALF.unpack_from(raw, at)[0] * _P1) & _MASK64
        value = (((value << 23) | (value >> 41)) * _P2 + _P3) & _MASK64
        at += 4
    for byte in raw[at:]:
        value ^= (byte * _P5) & _MASK64
        value = (((value << 11) | (value >> 53)) * _P1) & _MASK64
    value ^= value >> 33
    value = (value * _P2) & _MASK64
    value ^= value >> 29
    value = (value * _P3) & _MASK64
    return value ^ (value >> 32)


def proposal_hash(tool: bytes, canonical_args: bytes) -> int:
    """Return the repeat breaker's hash of a tool call: XXH64 of the args, seeded with the tool's.

    ``canonical_args`` must already be canonical (sorted keys, as _view.canonical_args), so that
    equal calls hash equal whatever their key order.
    """
    return hash64(canonical_args, hash64(tool))


def common_affixes(old: str, new: str) -> tuple[int, int]:
    """Return ``(prefix, suffix)``: how many leading and trailing characters ``new`` shares with ``old``.

    The two never overlap: ``prefix + suffix <= min(len(old), len(new))``, so
    ``new == old[:prefix] + new[prefix:len(new) - suffix] + old[len(old) - suffix:]``.
    The prefix is the longest common one; the suffix is the longest that fits
    after it.

    Raises:
      TypeError: if either argument is not a ``str``.
    """
    if type(old) is not str or type(new) is not str:
        raise TypeError(
            f"common_affixes() takes two str, got {type(old).__name__} and {type(new).__name__}"
        )
    limit = min(len(old), len(new))
    low, high = 0, limit
    while low < high:  # the longest equal prefix, by bisection on C-level comparisons
        middle = (low + high + 1) // 2
        if old[:middle] == new[:middle]:
            low = middle
        else:
            high = middle - 1
    prefix = low
    low, high = 0, limit - prefix
    end_old, end_new = len(old), len(new)
    while low < high:
        middle = (low + high + 1) // 2
        if old[end_old - middle :] == new[end_new - middle :]:
            low = middle
        else:
            high = middle - 1
    return prefix, low


# -- reading a proposal exactly -------------------------------------------------------

_SPACE = b" \t\n\r"
_DIGIT = b"0123456789"
_HEX = b"0123456789abcdefABCDEF"
_SIMPLE_ESCAPES = b'"\\/bfnrt'
_LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}
# A run of string bytes with nothing to look at: no quote, backslash or control character.
_PLAIN = re.compile(rb'[^"\\\x00-\x1f]*')
# What the parser expects next (the states of scan_json's loop).
_VALUE, _FIRST_ITEM, _ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER = range(7)


class _Defect(Exception):
    """The first defect, raised out of the helpers to scan_json's loop."""

    def __init__(self, code: int, offset: int) -> None:
        self.code = code
        self.offset = offset


class _Duplicate(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> None:
    if len(dict(pairs)) != len(pairs):
        raise _Duplicate


def _no_constant(name: str) -> None:
    raise ValueError(name)


# scan_json's shortcut: the json module's C scanner, refusing what _scan refuses.
_strict_json = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def scan_json(data: bytes) -> tuple[int, int, tuple[str | int, ...]] | None:
    """Find the first defect that keeps ``data`` from reading as exactly one JSON value.

    The grammar is RFC 8259's, in UTF-8, and a defect is what a decoder either
    refuses or reads in more than one way: a syntax error, invalid UTF-8, an
    unpaired surrogate escape (``"\\ud800"``), or an object that names a key twice
    (decoders keep the first or the last; keys compare as decoded text, so
    ``"tool"`` and ``"\\u0074ool"`` are the same key). Nesting has no limit here.

    Returns:
      None when ``data`` is one JSON value (with optional surrounding whitespace)
      without a defect. Otherwise ``(code, offset, path)`` for the defect that
      starts first: one of the ``JSON_*`` codes; the byte offset where it starts
      (``len(data)`` for JSON_EMPTY and JSON_TRUNCATED); and the keys (str) and
      array indices (int) from the top-level value down to the member being read
      or just read there. The path of a JSON_DUPLICATE_KEY ends with the key.

    Raises:
      TypeError: if ``data`` is not a bytes-like object.
    """
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"scan_json() needs a bytes-like object, not {type(data).__name__!r}"
        ) from None
    with view:
        raw = view.tobytes()
    if b"\\u" not in raw:
        # A shortcut, not the definition: the json module (in C) reads the text the
        # way _scan does except for \u escapes (it takes unpaired surrogates) and
        # NaN/Infinity (refused here). Whatever it cannot vouch for, _scan decides.
        try:
            _strict_json.decode(raw.decode())
        except (ValueError, RecursionError, _Duplicate):
            pass
        else:
            return None
    return _scan(raw)


def _scan(data: bytes) -> tuple[int, int, tuple[str | int, ...]] | None:
    # One frame per open array or object: [key or index, keys seen] (keys is None for
    # an array). The key is None until an object's first key has been read.
    frames: list[list[Any]] = []
    size = len(data)
    state = _VALUE
    at = 0
    try:
        while True:
            while at < size and data[at] in _SPACE:
                at += 1
            if at == size:
                if state == _AFTER and not frames:
                    return None
                raise _Defect(JSON_EMPTY if state == _VALUE and not frames else JSON_TRUNCATED, at)
            byte = data[at]
            if state == _AFTER:
                if not frames:
                    raise _Defect(JSON_TRAILING_TEXT, at)
                frame = frames[-1]
                is_object = frame[1] is not None
                if byte == ord(","):
                    if is_object:
                        frame[0] = None
                        state = _KEY
                    else:
                        frame[0] += 1
                        state = _ITEM
                    at += 1
                elif byte == (ord("}") if is_object else ord("]")):
                    frames.pop()
                    at += 1
                else:
                    raise _Defect(JSON_EXPECTED_COMMA, at)
            elif state == _COLON:
                if byte != ord(":"):
                    raise _Defect(JSON_EXPECTED_COLON, at)
                state = _VALUE
                at += 1
            elif state in (_FIRST_KEY, _KEY):
                if byte == ord("}"):
                    if state == _KEY:
                        raise _Defect(JSON_TRAILING_COMMA, at)
                    frames.pop()
                    state = _AFTER
                    at += 1
                    continue
                if byte != ord('"'):
                    raise _Defect(JSON_EXPECTED_KEY, at)
                end, escaped = _string(data, at)
                key = (
                    json.loads(data[at:end].decode())
                    if escaped
                    else data[at + 1 : end - 1].decode()
                )
                frame = frames[-1]
                frame[0] = key
                if key in frame[1]:
                    raise _Defect(JSON_DUPLICATE_KEY, at)
                frame[1].add(key)
                state = _COLON
                at = end
            elif byte == ord("]") and state in (_FIRST_ITEM, _ITEM):
                if state == _ITEM:
                    raise _Defect(JSON_TRAILING_COMMA, at)
                frames.pop()
                state = _AFTER
                at += 1
            elif byte == ord("{"):
                frames.append([None, set()])
                state = _FIRST_KEY
                at += 1
            elif byte == ord("["):
                frames.append([0, None])
                state = _FIRST_ITEM
                at += 1
            else:
                at = _scalar(data, at)
                state = _AFTER
    except _Defect as defect:
        path = tuple(frame[0] for frame in frames if frame[0] is not None)
        return defect.code, defect.offset, path


def _scalar(data: bytes, at: int) -> int:
    """Read the string, number or literal at ``at``; return the offset just past it."""
    byte = data[at]
    if byte == ord('"'):
        return _string(data, at)[0]
    if byte == ord("-") or byte in _DIGIT:
        return _number(data, at)
    word = _LITERALS.get(byte)
    if word is None:
        raise _Defect(JSON_EXPECTED_VALUE, at)
    end = min(at + len(word), len(data))
    if data[at:end] != word[: end - at]:
        raise _Defect(JSON_EXPECTED_VALUE, at)
    if end - at < len(word):
        raise _Defect(JSON_TRUNCATED, len(data))
    return end


def _number(data: bytes, start: int) -> int:
    """Read the number at ``start``: ``-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?``."""
    size = len(data)
    at = start + 1 if data[start] == ord("-") else start
    if at < size and data[at] == ord("0"):
        at += 1
        if at < size and data[at] in _DIGIT:
            raise _Defect(JSON_BAD_NUMBER, start)  # a leading zero, as in 01
    else:
        at = _digits(data, at, start)
    if at < size and data[at] == ord("."):
        at = _digits(data, at + 1, start)
    if at < size and data[at] in b"eE":
        at += 1
        if at < size and data[at] in b"+-":
            at += 1
        at = _digits(data, at, start)
    return at


def _digits(data: bytes, at: int, start: int) -> int:
    """Read the one or more digits at ``at`` of the number at ``start``."""
    size = len(data)
    if at == size:
        raise _Defect(JSON_TRUNCATED, at)
    if data[at] not in _DIGIT:
        raise _Defect(JSON_BAD_NUMBER, start)
    while at < size and data[at] in _DIGIT:
        at += 1
    return at


def _string(data: bytes, start: int) -> tuple[int, bool]:
    """Read the string at ``start``; return the offset past it and whether it has escapes."""
    size = len(data)
    at = start + 1
    escaped = False
    while True:
        end = _PLAIN.match(data, at).end()  # type: ignore[union-attr]
        try:
            data[at:end].decode()
        except UnicodeDecodeError as error:
            raise _Defect(JSON_BAD_UTF8, at + error.start) from None
        if end == size:
            raise _Defect(JSON_TRUNCATED, size)
        if data[end] == ord('"'):
            return end + 1, escaped
        if data[end] != ord("\\"):
            raise _Defect(JSON_CONTROL_CHARACTER, end)
        escaped = True
        at = _escape(data, end)


def _escape(data: bytes, at: int) -> int:
    """Read the escape at ``at`` (a backslash); return the offset past it."""
    if at + 1 == len(data):
        raise _Defect(JSON_TRUNCATED, at + 1)
    kind = data[at + 1]
    if kind in _SIMPLE_ESCAPES:
        return at + 2
    if kind != ord("u"):
        raise _Defect(JSON_BAD_ESCAPE, at)
    code = _hex4(data, at)
    if 0xDC00 <= code <= 0xDFFF:
        raise _Defect(JSON_LONE_SURROGATE, at)
    if code < 0xD800 or code > 0xDBFF:
        return at + 6
    # A high surrogate: only a low one may follow, as \uDC00-\uDFFF.
    follow = data[at + 6 : at + 8]
    if follow != b"\\u":
        if len(follow) < 2 and b"\\u".startswith(follow):
            raise _Defect(JSON_TRUNCATED, len(data))
        raise _Defect(JSON_LONE_SURROGATE, at)
    if not 0xDC00 <= _hex4(data, at + 6) <= 0xDFFF:
        raise _Defect(JSON_LONE_SURROGATE, at)
    return at + 12


def _hex4(data: bytes, at: int) -> int:
    """The value of the \\uXXXX escape at ``at``."""
    for digit in range(at + 2, at + 6):
        if digit == len(data):
            raise _Defect(JSON_TRUNCATED, digit)
        if data[digit] not in _HEX:
            raise _Defect(JSON_BAD_ESCAPE, at)
    return int(data[at + 2 : at + 6], 16)
