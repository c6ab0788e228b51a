"""Journal framing: round trips, torn tails and corrupt frames."""

from __future__ import annotations

import random
import struct
import zlib
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

PAYLOADS = [b"first event", b"", b"\x00\xff" * 40]


def _frame_ends(hot: ModuleType, payloads: list[bytes]) -> list[int]:
    ends = [0]
    for payload in payloads:
        ends.append(ends[-1] + hot.HEADER_SIZE + len(payload))
    return ends


def test_frame_layout(hot: ModuleType) -> None:
    payload = b"hello, journal"
    framed = hot.frame_event(payload)
    assert type(framed) is bytes
    assert len(framed) == hot.HEADER_SIZE + len(payload)
    size, check, crc = struct.unpack_from("<III", framed)
    assert size == len(payload)
    assert check == len(payload) ^ 0xFFFFFFFF
    assert crc == zlib.crc32(payload)
    assert framed[hot.HEADER_SIZE :] == payload


@pytest.mark.parametrize("size", [*range(41), 255, 256, 4095, 65537])
def test_checksum_is_zlib_crc32(hot: ModuleType, size: int) -> None:
    payload = random.Random(size).randbytes(size)
    (crc,) = struct.unpack_from("<I", hot.frame_event(payload), 8)
    assert crc == zlib.crc32(payload)


def test_round_trip(hot: ModuleType) -> None:
    buffer = hot.frame_events(PAYLOADS)
    assert buffer == b"".join(hot.frame_event(payload) for payload in PAYLOADS)
    assert hot.unframe(buffer) == (PAYLOADS, len(buffer), hot.FRAMES_OK)


def test_round_trip_of_one_empty_payload(hot: ModuleType) -> None:
    buffer = hot.frame_event(b"")
    assert len(buffer) == hot.HEADER_SIZE
    assert hot.unframe(buffer) == ([b""], hot.HEADER_SIZE, hot.FRAMES_OK)


def test_empty_batch(hot: ModuleType) -> None:
    assert hot.frame_events([]) == b""
    assert hot.unframe(b"") == ([], 0, hot.FRAMES_OK)


def test_frame_events_takes_any_iterable(hot: ModuleType) -> None:
    expected = hot.frame_events(PAYLOADS)
    assert hot.frame_events(tuple(PAYLOADS)) == expected
    assert hot.frame_events(payload for payload in PAYLOADS) == expected


def test_payloads_may_be_bytearray_or_memoryview(hot: ModuleType) -> None:
    payload = b"some event"
    expected = hot.frame_event(payload)
    assert hot.frame_event(bytearray(payload)) == expected
    assert hot.frame_event(memoryview(payload)) == expected
    assert hot.frame_events([bytearray(payload), memoryview(payload)]) == expected * 2


def test_unframe_accepts_bytearray_and_memoryview(hot: ModuleType) -> None:
    buffer = hot.frame_events(PAYLOADS)
    expected = (PAYLOADS, len(buffer), hot.FRAMES_OK)
    assert hot.unframe(bytearray(buffer)) == expected
    assert hot.unframe(memoryview(buffer)) == expected
    # Offsets are relative to the view, not to the object underneath it.
    assert hot.unframe(memoryview(b"junk" + buffer)[4:]) == expected
    # A strided view is read element by element.
    interleaved = bytearray(b"?" * (2 * len(buffer)))
    interleaved[::2] = buffer
    assert hot.unframe(memoryview(interleaved)[::2]) == expected


def test_unframe_returns_bytes(hot: ModuleType) -> None:
    payloads, _, _ = hot.unframe(bytearray(hot.frame_events(PAYLOADS)))
    assert all(type(payload) is bytes for payload in payloads)


def test_torn_tail_at_every_cut(hot: ModuleType) -> None:
    buffer = hot.frame_events(PAYLOADS)
    ends = _frame_ends(hot, PAYLOADS)
    for cut in range(len(buffer) + 1):
        whole = max(i for i, end in enumerate(ends) if end <= cut)
        payloads, good_end, status = hot.unframe(buffer[:cut])
        assert payloads == PAYLOADS[:whole], cut
        assert good_end == ends[whole], cut
        assert status == (hot.FRAMES_OK if cut == ends[whole] else hot.FRAMES_TORN), cut


def test_every_single_byte_corruption_is_detected(hot: ModuleType) -> None:
    good = hot.frame_event(b"kept")
    bad = b"abc"
    buffer = good + hot.frame_event(bad)
    for position in range(len(good), len(buffer)):
        for flip in range(1, 256):
            damaged = bytearray(buffer)
            damaged[position] ^= flip
            payloads, good_end, status = hot.unframe(bytes(damaged))
            assert status == hot.FRAMES_CORRUPT, (position, flip)
            assert payloads == [b"kept"], (position, flip)
            assert good_end == len(good), (position, flip)


batches = st.lists(st.binary(max_size=300), max_size=8)


@settings(max_examples=200)
@given(batches, st.data())
def test_any_batch_round_trips_and_any_cut_keeps_the_whole_frames(
    hot: ModuleType, batch: list[bytes], data: st.DataObject
) -> None:
    buffer = hot.frame_events(batch)
    assert hot.unframe(buffer) == (batch, len(buffer), hot.FRAMES_OK)
    ends = _frame_ends(hot, batch)
    cut = data.draw(st.integers(min_value=0, max_value=len(buffer)), label="cut")
    whole = max(i for i, end in enumerate(ends) if end <= cut)
    status = hot.FRAMES_OK if cut == ends[whole] else hot.FRAMES_TORN
    assert hot.unframe(buffer[:cut]) == (batch[:whole], ends[whole], status)


@settings(max_examples=300)
@given(batches.filter(bool), st.data())
def test_any_single_byte_corruption_of_any_frame_is_detected(
    hot: ModuleType, batch: list[bytes], data: st.DataObject
) -> None:
    ends = _frame_ends(hot, batch)
    index = data.draw(st.integers(min_value=0, max_value=len(batch) - 1), label="frame")
    position = data.draw(st.integers(min_value=ends[index], max_value=ends[index + 1] - 1))
    flip = data.draw(st.integers(min_value=1, max_value=255), label="flip")
    damaged = bytearray(hot.frame_events(batch))
    damaged[position] ^= flip
    payloads, good_end, status = hot.unframe(bytes(damaged))
    # Corrupt, not torn: the header's own check guards the length, so a damaged length
    # is never mistaken for a cut-short write. The frames before the damaged one are
    # kept; nothing from it on is trusted.
    assert status == hot.FRAMES_CORRUPT
    assert payloads == batch[:index]
    assert good_end == ends[index]


def test_nothing_after_a_corrupt_frame_is_trusted(hot: ModuleType) -> None:
    frames = [hot.frame_event(payload) for payload in (b"one", b"two", b"three")]
    damaged = bytearray(b"".join(frames))
    damaged[len(frames[0]) + hot.HEADER_SIZE] ^= 0x01
    assert hot.unframe(bytes(damaged)) == ([b"one"], len(frames[0]), hot.FRAMES_CORRUPT)


def test_unframe_of_garbage(hot: ModuleType) -> None:
    assert hot.unframe(b"\x00" * 4) == ([], 0, hot.FRAMES_TORN)
    assert hot.unframe(b"\x00" * 12) == ([], 0, hot.FRAMES_CORRUPT)
    # A valid header that promises more bytes than there are is a torn tail.
    assert hot.unframe(hot.frame_event(b"abcdef")[:-1]) == ([], 0, hot.FRAMES_TORN)


def test_frame_event_of_a_str(hot: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"^a bytes-like object is required, not 'str'$"):
        hot.frame_event("text")
    with pytest.raises(TypeError, match=r"^a bytes-like object is required, not 'str'$"):
        hot.frame_events([b"ok", "text"])


def test_unframe_of_a_str(hot: ModuleType) -> None:
    with pytest.raises(
        TypeError, match=r"^memoryview: a bytes-like object is required, not 'str'$"
    ):
        hot.unframe("text")
