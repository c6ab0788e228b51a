"""Prompt deltas: the prefix and suffix two prompts share, so a model call journals only the change."""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

texts = st.text(alphabet=st.sampled_from("xy\n é😀"), max_size=30)


@given(texts, texts, texts, texts)
def test_affixes_rebuild_the_new_text(
    hot: ModuleType, head: str, old_middle: str, new_middle: str, tail: str
) -> None:
    old, new = head + old_middle + tail, head + new_middle + tail
    prefix, suffix = hot.common_affixes(old, new)
    assert prefix + suffix <= min(len(old), len(new))
    assert prefix >= len(head)
    assert prefix + suffix >= min(len(head) + len(tail), len(old), len(new))
    middle = new[prefix : len(new) - suffix]
    assert old[:prefix] + middle + old[len(old) - suffix :] == new
    # the prefix is the longest: one more character would differ (or run out)
    assert prefix == min(len(old), len(new)) or old[prefix] != new[prefix]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("", "", (0, 0)),
        ("history:\n  [1] a\nanswer", "history:\n  [1] a\n  [2] b\nanswer", (17, 6)),
        ("state: WORK\n", "state: DONE\n", (7, 1)),
        ("aaa", "aa", (2, 0)),
        ("é😀x", "é😀yx", (2, 1)),
        ("same", "same", (4, 0)),
    ],
)
def test_affixes_examples(hot: ModuleType, old: str, new: str, expected: tuple[int, int]) -> None:
    assert hot.common_affixes(old, new) == expected


def test_affixes_reject_non_text(hot: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"common_affixes\(\) takes two str, got bytes and str"):
        hot.common_affixes(b"a", "a")
