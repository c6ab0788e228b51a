"""The hot path, in pure Python: the readable specification of ``interlock._hot``.

The compiled module (``ext/_hot.pyx``) implements the same names with the same
results and the same error text; ``interlock._hotpath`` picks one. Rejections are
return codes, never exceptions; exceptions here mean the caller misused the API.

Three jobs live here:

* the transition and tool-permission checks on a machine's integer tables;
* journal framing: encoded events are framed as
  ``[length: u32 LE][length ^ 0xFFFFFFFF: u32 LE][crc32(payload): u32 LE][payload]``
  so that a torn tail (the buffer ends inside a frame) and a corrupt frame (any
  single changed byte) are both detected;
* failure compaction over a run's history, and the canonical proposal hash
  used by the repeat breaker (64-bit FNV-1a);
* prompt deltas: the lengths of the prefix and suffix two prompts share, so
  that a model call journals only the part of its prompt that changed.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

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

#: Bytes of frame header before each payload.
HEADER_SIZE = 12
#: At most this many states and this many tools per machine (one bit each in a u64).
MAX_IDS = 64

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


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


def fnv1a64(data: bytes, seed: int = _FNV_OFFSET) -> int:
    """Return the 64-bit FNV-1a hash of ``data``, starting from ``seed``."""
    value = seed & _MASK64
    for byte in data:
        value = ((value ^ byte) * _FNV_PRIME) & _MASK64
    return value


def proposal_hash(tool: bytes, canonical_args: bytes) -> int:
    """Return the repeat breaker's hash of a tool call: FNV-1a of ``tool``, a NUL, then the args.

    ``canonical_args`` must already be canonical (sorted keys, as _view.canonical_args), so that
    equal calls hash equal whatever their key order.
    """
    return fnv1a64(canonical_args, fnv1a64(b"\x00", fnv1a64(tool)))


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
