"""Failure compaction and the FNV-1a hashes behind signatures and the repeat breaker."""

from __future__ import annotations

from types import ModuleType

import pytest

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


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", 0xCBF29CE484222325),
        (b"a", 0xAF63DC4C8601EC8C),
        (b"foobar", 0x85944171F73967E8),
    ],
)
def test_fnv1a64_vectors(hot: ModuleType, data: bytes, expected: int) -> None:
    assert hot.fnv1a64(data) == expected
    assert hot.fnv1a64(bytearray(data)) == expected
    assert hot.fnv1a64(memoryview(data)) == expected


def test_fnv1a64_chains_through_the_seed(hot: ModuleType) -> None:
    assert hot.fnv1a64(b"bar", hot.fnv1a64(b"foo")) == hot.fnv1a64(b"foobar")


def test_fnv1a64_seed_is_reduced_to_64_bits(hot: ModuleType) -> None:
    assert hot.fnv1a64(b"x", 2**64 + 5) == hot.fnv1a64(b"x", 5)
    assert hot.fnv1a64(b"x", -1) == hot.fnv1a64(b"x", TOP)
    assert hot.fnv1a64(b"", -1) == TOP


def test_fnv1a64_of_a_str(hot: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"^unsupported operand type\(s\) for \^: 'int' and 'str'$"):
        hot.fnv1a64("text")


def test_proposal_hash_is_fnv1a64_of_tool_nul_args(hot: ModuleType) -> None:
    tool, args = b"refund", b'{"amount":150,"order":"A-17"}'
    assert hot.proposal_hash(tool, args) == hot.fnv1a64(tool + b"\x00" + args)
    assert hot.proposal_hash(b"", b"") == hot.fnv1a64(b"\x00")


def test_proposal_hash_properties(hot: ModuleType) -> None:
    args = b'{"amount":150}'
    value = hot.proposal_hash(b"refund", args)
    assert 0 <= value < 2**64
    assert hot.proposal_hash(b"refund", args) == value
    assert hot.proposal_hash(bytearray(b"refund"), memoryview(args)) == value
    assert hot.proposal_hash(b"refund", b'{"amount":151}') != value
    assert hot.proposal_hash(b"refunds", args) != value
    # The NUL keeps the tool and its arguments apart.
    assert hot.proposal_hash(b"ab", b"c") != hot.proposal_hash(b"a", b"bc")
