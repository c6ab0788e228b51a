"""Failure compaction and the XXH64 hashes behind signatures and the repeat breaker."""

from __future__ import annotations

from array import array
from types import ModuleType

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

TOP = 2**64 - 1


@pytest.mark.parametrize(
    ("signatures", "groups"),
    [
        ([], []),
        ([0], [(0, 0, 1)]),
        ([7], [(0, 0, 1)]),
        ([0, 0, 0], [(0, 0, 1), (1, 1, 1), (2, 2, 1)]),
        ([5, 5, 5], [(0, 2, 3)]),
        ([5, 5, 6, 6, 5], [(0, 1, 2), (2, 3, 2), (4, 4, 1)]),
        ([0, 9, 9, 0, 9], [(0, 0, 1), (1, 2, 2), (3, 3, 1), (4, 4, 1)]),
        ([TOP, TOP, -1, -1, 2**63, 2**63], [(0, 1, 2), (2, 3, 2), (4, 5, 2)]),
        ([2**70, 2**70, 0], [(0, 1, 2), (2, 2, 1)]),
    ],
)
def test_groups(hot: ModuleType, signatures: list[int], groups: list[tuple[int, int, int]]) -> None:
    assert hot.compact_failures(signatures) == groups
    assert hot.compact_failures(tuple(signatures)) == groups


def test_groups_cover_every_item_in_order(hot: ModuleType) -> None:
    signatures = [0, 3, 3, 3, 0, 0, 4, 3, 3, 0, 1]
    groups = hot.compact_failures(signatures)
    assert [index for first, last, _ in groups for index in range(first, last + 1)] == list(
        range(len(signatures))
    )
    assert all(count == last - first + 1 for first, last, count in groups)
    assert sum(count for _, _, count in groups) == len(signatures)


def test_equal_numbers_of_other_types_group_together(hot: ModuleType) -> None:
    assert hot.compact_failures([1, True, 1.0, 2]) == [(0, 2, 3), (3, 3, 1)]
    assert hot.compact_failures([False, 0.0]) == [(0, 0, 1), (1, 1, 1)]


def test_other_sequences(hot: ModuleType) -> None:
    assert hot.compact_failures(range(3)) == [(0, 0, 1), (1, 1, 1), (2, 2, 1)]


# From the reference implementation (the xxhash package wraps xxHash's C code). The
# lengths cover each part of the algorithm: the 32-byte stripes of four lanes, then the
# tail's 8-byte words, its 4-byte word and its last bytes.
@pytest.mark.parametrize(
    ("data", "seed", "expected"),
    [
        (b"", 0, 0xEF46DB3751D8E999),
        (b"a", 0, 0xD24EC4F1A98C6E5B),
        (b"abc", 0, 0x44BC2CF5AD770999),
        (b"foobar", 0, 0xA2AA05ED9085AAF9),
        (bytes(range(15)), 0, 0xA948F5F0F6ABAC2D),  # an 8-byte word, a 4-byte one, 3 bytes
        (bytes(range(32)), 0, 0xCBF59C5116FF32B4),
        (bytes(range(47)), 3, 0x104A5DBFA27C69EF),  # a stripe, then all three tails
        (bytes(range(100)), 7, 0x80653E7E9B887CDD),
        (b"x", TOP, 0x464C3A4DBE662870),
    ],
)
def test_hash64_vectors(hot: ModuleType, data: bytes, seed: int, expected: int) -> None:
    assert hot.hash64(data, seed) == expected
    assert hot.hash64(bytearray(data), seed) == expected
    assert hot.hash64(memoryview(data), seed) == expected


@settings(max_examples=300)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=TOP))
def test_hash64_is_xxh64(hot: ModuleType, data: bytes, seed: int) -> None:
    assert hot.hash64(data, seed) == xxhash.xxh64_intdigest(data, seed)


def test_hash64_seed_is_reduced_to_64_bits(hot: ModuleType) -> None:
    assert hot.hash64(b"x", 2**64 + 5) == hot.hash64(b"x", 5)
    assert hot.hash64(b"x", -1) == hot.hash64(b"x", TOP)
    assert hot.hash64(b"x", True) == hot.hash64(b"x", 1)


def test_hash64_hashes_the_bytes_of_any_contiguous_buffer(hot: ModuleType) -> None:
    numbers = array("i", [1, -2, 3])
    assert hot.hash64(numbers) == hot.hash64(numbers.tobytes())


@pytest.mark.parametrize(
    ("data", "seed", "message"),
    [
        ("text", 0, r"^hash64\(\) needs a bytes-like object, not 'str'$"),
        ([1, 2], 0, r"^hash64\(\) needs a bytes-like object, not 'list'$"),
        (
            memoryview(b"abcd")[::2],
            0,
            r"^hash64\(\) needs a contiguous buffer; copy it with bytes\(\) first$",
        ),
        (b"x", 1.5, r"^hash64\(\) seed must be an int, not 'float'$"),
    ],
)
def test_hash64_misuse_says_what_to_pass(
    hot: ModuleType, data: object, seed: object, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        hot.hash64(data, seed)


def test_proposal_hash_is_the_args_hash_seeded_with_the_tools(hot: ModuleType) -> None:
    tool, args = b"refund", b'{"amount":150,"order":"A-17"}'
    assert hot.proposal_hash(tool, args) == hot.hash64(args, hot.hash64(tool))
    assert hot.proposal_hash(b"", b"") == hot.hash64(b"", hot.hash64(b""))


def test_proposal_hash_properties(hot: ModuleType) -> None:
    args = b'{"amount":150}'
    value = hot.proposal_hash(b"refund", args)
    assert 0 <= value < 2**64
    assert hot.proposal_hash(b"refund", args) == value
    assert hot.proposal_hash(bytearray(b"refund"), memoryview(args)) == value
    assert hot.proposal_hash(b"refund", b'{"amount":151}') != value
    assert hot.proposal_hash(b"refunds", args) != value
    # The tool's hash seeds the args': moving a byte from one to the other changes it.
    assert hot.proposal_hash(b"ab", b"c") != hot.proposal_hash(b"a", b"bc")
