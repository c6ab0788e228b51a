"""The one place waits come from: backoff, Retry-After, the token bucket (``core._pacing``)."""

from __future__ import annotations

import email.utils
import random

import httpx
import pytest

from interlock.core._pacing import TokenBucket, backoff_delay, parse_retry_after

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, None),
        ({}, None),
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": " 2.5 "}, 2.5),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),  # the finer one wins
        ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),  # unreadable: the other
        ({"retry-after-ms": "-5"}, None),
        ({"retry-after": "-3"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "tomorrow"}, None),
        ({"retry-after": email.utils.formatdate(NOW + 120, usegmt=True)}, 120.0),
        ({"retry-after": email.utils.formatdate(NOW - 120, usegmt=True)}, 0.0),  # past: now
        ({"retry-after": "Sun, 06 Nov 1994 08:49:37"}, None),  # no zone: not an HTTP date
    ],
)
def test_retry_after_reads_seconds_milliseconds_and_dates(
    headers: dict[str, str] | None, expected: float | None
) -> None:
    assert parse_retry_after(headers, NOW) == expected


def test_retry_after_reads_case_insensitive_headers() -> None:
    assert parse_retry_after(httpx.Headers({"Retry-After": "7"}), NOW) == 7.0
    assert parse_retry_after(httpx.Headers({"Retry-After-Ms": "1500"}), NOW) == 1.5


def test_backoff_doubles_up_to_the_cap_and_retry_after_wins() -> None:
    rng = random.Random(0)
    waits = [backoff_delay(n, None, rng, base=1.0, cap=5.0, jitter=False) for n in range(1, 6)]
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff_delay(1, 30.0, rng, base=1.0, cap=5.0, jitter=False) == 5.0
    assert backoff_delay(3, 0.5, rng, base=1.0, cap=5.0, jitter=True) == 0.5
    jittered = [backoff_delay(3, None, rng, base=1.0, cap=5.0, jitter=True) for _ in range(200)]
    assert all(2.0 <= wait <= 4.0 for wait in jittered)
    assert len(set(jittered)) > 1


def test_a_bucket_takes_many_tokens_at_once_or_none() -> None:
    # A provider's tokens per minute: 600 a minute is 10 a second, a bucket of 600.
    bucket = TokenBucket(rate=10.0, burst=600, now=0.0)
    assert bucket.take(0.0, 500) == 0.0
    assert bucket.take(0.0, 200) == pytest.approx(10.0)  # 100 left: 100 more take 10 s
    assert bucket.take(5.0, 200) == pytest.approx(5.0)  # the refusal took nothing
    assert bucket.take(10.0, 200) == 0.0
    assert bucket.take(10.0, 1) == pytest.approx(0.1)


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1.0, 5), (1.0, 0), (1.0, 0.5)])
def test_a_bucket_refuses_a_rate_or_size_it_cannot_keep(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match=r"^a token bucket needs rate > 0 and burst >= 1"):
        TokenBucket(rate, burst, 0.0)
