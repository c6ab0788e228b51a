"""Plain-integer counters the supervisor keeps; the metrics collector reads them at scrape time."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

# Latency histogram: log-spaced bucket bounds in seconds, 4 per octave, from 250 ns to ~17 s.
_BOUNDS: tuple[float, ...] = tuple(2.5e-7 * 2 ** (i / 4) for i in range(105))


class LatencyHistogram:
    """A fixed-bucket histogram of durations in seconds; ~19% resolution, cheap to record."""

    __slots__ = ("counts", "sum", "total")

    BOUNDS = _BOUNDS

    def __init__(self) -> None:
        self.counts = [0] * (len(_BOUNDS) + 1)
        self.sum = 0.0
        self.total = 0

    def record(self, seconds: float) -> None:
        # The first bucket whose bound is >= seconds; past the last bound, the overflow bucket.
        self.counts[bisect_left(_BOUNDS, seconds)] += 1
        self.sum += seconds
        self.total += 1

    @classmethod
    def merged(cls, histograms: Iterable[LatencyHistogram]) -> LatencyHistogram:
        """One histogram holding every sample of ``histograms``."""
        result = cls()
        for histogram in histograms:
            result.counts = [a + b for a, b in zip(result.counts, histogram.counts, strict=True)]
            result.sum += histogram.sum
            result.total += histogram.total
        return result

    def quantile(self, q: float) -> float:
        """Return the upper bound of the bucket holding the ``q`` quantile (0 with no samples)."""
        if not self.total:
            return 0.0
        rank = q * self.total
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank and count:
                return _BOUNDS[min(index, len(_BOUNDS) - 1)]
        return _BOUNDS[-1]

    def cumulative(self, bounds: tuple[float, ...]) -> list[tuple[float, int]]:
        """Return ``(le, count)`` pairs for the given bucket bounds (Prometheus style)."""
        pairs = []
        running = 0
        index = 0
        for bound in bounds:
            while index < len(_BOUNDS) and _BOUNDS[index] <= bound * (1 + 1e-9):
                running += self.counts[index]
                index += 1
            pairs.append((bound, running))
        return pairs


@dataclass(frozen=True)
class SupervisorStatistics:
    """A snapshot of a supervisor's counters (see :meth:`Supervisor.statistics`)."""

    runs_started: int
    runs_finished: dict[str, int]
    runs_in_flight: int
    verifications: int
    rejections: dict[str, int]
    breaker_trips: dict[str, int]
    tokens: int
    verify_p50: float
    verify_p99: float
    tool_calls: int
    tool_errors: int
    side_effects: int
    flushes: int
    events: int


class RuntimeStats:
    """Counters keyed by bounded label tuples. No locks: one trio thread updates them."""

    def __init__(self) -> None:
        self.tokens: Counter[tuple[str, str, str, str]] = Counter()  # machine, state, model, kind
        self.model_calls: Counter[tuple[str, str]] = Counter()  # machine, model
        self.model_latency: dict[str, LatencyHistogram] = {}  # by model
        self.verdicts: Counter[tuple[str, str, str]] = Counter()  # machine, outcome, code
        self.verify_latency: dict[str, LatencyHistogram] = {}  # by machine
        self.breaker_trips: Counter[tuple[str, str, str]] = Counter()  # machine, breaker, tool
        self.transitions: Counter[tuple[str, str, str]] = Counter()  # machine, src, dst
        self.runs_started: Counter[str] = Counter()  # machine
        self.runs_finished: Counter[tuple[str, str]] = Counter()  # machine, outcome
        self.tool_calls: Counter[str] = Counter()
        self.tool_errors: Counter[str] = Counter()
        self.tool_latency: dict[str, LatencyHistogram] = {}
        self.side_effects: Counter[str] = Counter()  # non-read-only tool commits, by tool
        self.provider_failures: Counter[tuple[str, str]] = Counter()  # machine, model
        self.in_doubt: Counter[str] = Counter()  # calls found in doubt, by tool
        self.reconciliations: Counter[tuple[str, str]] = Counter()  # tool, outcome
        self.escalation_reasons: Counter[tuple[str, str]] = Counter()  # machine, reason
        self.flush_latency = LatencyHistogram()
        self.flush_events: Counter[str] = Counter()  # "batches", "events", "bytes"
        self.batch_sizes = LatencyHistogram()  # reused as a size histogram (events, not seconds)
        self.escalations_pending = 0  # runs parked in ESCALATE, store-wide once counted at start

    def histogram(self, table: dict[str, LatencyHistogram], key: str) -> LatencyHistogram:
        """The histogram of ``key`` in ``table``, created on first use."""
        histogram = table.get(key)
        if histogram is None:
            histogram = table[key] = LatencyHistogram()
        return histogram

    def snapshot(self, in_flight: int) -> SupervisorStatistics:
        rejections: Counter[str] = Counter()
        verifications = 0
        for (_machine, outcome, code), count in self.verdicts.items():
            verifications += count
            if outcome == "rejected":
                rejections[code] += count
        trips: Counter[str] = Counter()
        for (_machine, breaker, _tool), count in self.breaker_trips.items():
            trips[breaker] += count
        latency = LatencyHistogram.merged(self.verify_latency.values())
        finished: Counter[str] = Counter()
        for (_machine, outcome), count in self.runs_finished.items():
            finished[outcome] += count
        return SupervisorStatistics(
            runs_started=sum(self.runs_started.values()),
            runs_finished=dict(finished),
            runs_in_flight=in_flight,
            verifications=verifications,
            rejections=dict(rejections),
            breaker_trips=dict(trips),
            tokens=sum(self.tokens.values()),
            verify_p50=latency.quantile(0.5),
            verify_p99=latency.quantile(0.99),
            tool_calls=sum(self.tool_calls.values()),
            tool_errors=sum(self.tool_errors.values()),
            side_effects=sum(self.side_effects.values()),
            flushes=self.flush_events["batches"],
            events=self.flush_events["events"],
        )
