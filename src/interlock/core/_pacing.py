"""How long to wait, in one place: exponential backoff, a ``Retry-After`` header, a token
bucket.

Every retry in interlock (a tool's :class:`~interlock.RetryPolicy`, a run's
:class:`~interlock.ProviderPolicy`, the gateway client's resends) draws its wait from
:func:`backoff_delay`; every ``Retry-After`` read (the providers' transport, the gateway
client) goes through :func:`parse_retry_after`; every rate limit (the gateway guard's per
key, a provider's tokens per minute) is a :class:`TokenBucket`.

Pure: the time comes in as an argument (the core has no clock of its own), so each is
tested with any clock.
"""

from __future__ import annotations

import email.utils
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import random

__all__ = ["TokenBucket", "backoff_delay", "parse_retry_after"]


def backoff_delay(
    attempt: int,
    retry_after: float | None,
    rng: random.Random,
    *,
    base: float,
    cap: float,
    jitter: bool,
) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    Exponential (``base * 2**(attempt-1)``), capped at ``cap``; with ``jitter`` drawn
    uniformly from [wait/2, wait]. A Retry-After the other side sent wins, capped too.
    """
    if retry_after is not None and retry_after >= 0:
        return float(min(retry_after, cap))
    wait = float(min(cap, base * (2 ** (attempt - 1))))
    if jitter:
        wait = rng.uniform(wait / 2, wait)
    return wait


def parse_retry_after(headers: Any, now: float) -> float | None:
    """Seconds to wait from a response's ``retry-after-ms`` or ``Retry-After`` header
    (seconds, or an HTTP date read against ``now``, the wall clock's ``time.time()``), or
    None when neither says (or says something unreadable, negative or infinite).

    ``headers``: anything with a ``get(name)`` that finds ``retry-after`` (a dict with
    lower-case names, httpx's case-insensitive ``Headers``), or None.
    """
    if headers is None:
        return None
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            ms = float(value)
        except (TypeError, ValueError):
            ms = math.nan
        if math.isfinite(ms) and ms >= 0:
            return ms / 1000.0
    value = headers.get("retry-after")
    if not isinstance(value, str):
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - now)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class TokenBucket:
    """A token bucket: ``burst`` tokens, refilled at ``rate`` per second.

    Time comes in as an argument, so the bucket is pure and tests drive it with any clock:
    the gateway guard passes ``time.monotonic()`` and takes one token per request; a
    provider's transport passes trio's clock and takes a call's estimated tokens.
    """

    __slots__ = ("_stamp", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        """Args:
        rate: tokens added per second.
        burst: the bucket's size; it starts full.
        now: the current time, in seconds, on the clock later passed to :meth:`take`.
        """
        if not rate > 0 or not burst >= 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1; got {rate}, {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._stamp = now

    def take(self, now: float, tokens: float = 1.0) -> float:
        """Take ``tokens`` at time ``now``: ``0.0`` if there were that many, else the
        seconds until there will be (and nothing is taken).

        ``tokens`` more than ``burst`` would never fit: ask for at most ``burst``. A clock
        that steps back refills nothing.
        """
        elapsed = now - self._stamp
        have = self._tokens
        if elapsed > 0:
            have = min(self.burst, have + elapsed * self.rate)
            self._stamp = now
        if have >= tokens:
            self._tokens = have - tokens
            return 0.0
        self._tokens = have
        return (tokens - have) / self.rate
