"""Plain-integer counters the supervisor keeps; the metrics collector reads them at scrape time."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._events import (
    BreakerTripped,
    Completed,
    Escalated,
    Failed,
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
)
from ._messages import Report

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._events import Event
    from ._machine import Machine
    from ._messages import Request

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


class _Keys:
    """The label tuples :meth:`RuntimeStats.count` adds to for one machine, each built once.

    Keyed by the machine's name, as the tables are: two machines of one name share them.
    """

    __slots__ = ("accepted", "calls", "moves", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.accepted = (name, "accepted", "")
        # state -> model -> (prompt, completion, cached, reasoning) token keys, call key
        self.calls: dict[str, dict[str, tuple[Any, ...]]] = {}
        self.moves: dict[str, dict[str, tuple[str, str, str]]] = {}  # src -> dst -> key

    def call(self, state: str, model: str) -> tuple[Any, ...]:
        name = self.name
        keys = (
            (name, state, model, "prompt"),
            (name, state, model, "completion"),
            (name, state, model, "cached"),
            (name, state, model, "reasoning"),
            (name, model),
        )
        self.calls.setdefault(state, {})[model] = keys
        return keys

    def move(self, src: str, dst: str) -> tuple[str, str, str]:
        key = (self.name, src, dst)
        self.moves.setdefault(src, {})[dst] = key
        return key


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
    """Counters keyed by bounded label tuples. No locks: one trio thread updates them.

    Each table is a ``defaultdict(int)``, not a Counter: ``+=`` on one costs half as
    much, and the runtime does it several times a step. Reading a missing key inserts
    a 0 there; use ``.get(key, 0)`` to look without inserting.
    """

    def __init__(self) -> None:
        self.tokens: defaultdict[tuple[str, str, str, str]] = defaultdict(
            int
        )  # machine, state, model, kind
        self.model_calls: defaultdict[tuple[str, str]] = defaultdict(int)  # machine, model
        self.model_latency: dict[str, LatencyHistogram] = {}  # by model
        self.verdicts: defaultdict[tuple[str, str, str]] = defaultdict(
            int
        )  # machine, outcome, code
        self.verify_latency: dict[str, LatencyHistogram] = {}  # by machine
        self.breaker_trips: defaultdict[tuple[str, str, str]] = defaultdict(
            int
        )  # machine, breaker, tool
        self.transitions: defaultdict[tuple[str, str, str]] = defaultdict(int)  # machine, src, dst
        self.runs_started: defaultdict[str] = defaultdict(int)  # machine
        self.runs_finished: defaultdict[tuple[str, str]] = defaultdict(int)  # machine, outcome
        self.tool_calls: defaultdict[str] = defaultdict(int)
        self.tool_errors: defaultdict[str] = defaultdict(int)
        self.tool_latency: dict[str, LatencyHistogram] = {}
        self.side_effects: defaultdict[str] = defaultdict(
            int
        )  # non-read-only tool commits, by tool
        self.provider_failures: defaultdict[tuple[str, str]] = defaultdict(int)  # machine, model
        self.in_doubt: defaultdict[str] = defaultdict(int)  # calls found in doubt, by tool
        self.reconciliations: defaultdict[tuple[str, str]] = defaultdict(int)  # tool, outcome
        self.escalation_reasons: defaultdict[tuple[str, str]] = defaultdict(int)  # machine, reason
        self.flush_latency = LatencyHistogram()
        self.flush_events: defaultdict[str] = defaultdict(int)  # "batches", "events", "bytes"
        self.batch_sizes = LatencyHistogram()  # reused as a size histogram (events, not seconds)
        self.escalations_pending = 0  # runs parked in ESCALATE, store-wide once counted at start
        self.leases_lost = 0  # runs dropped because another process took their leases
        self.leases_claimed = 0  # runs claimed (a worker, a resume on PostgreSQL)
        self._keys: dict[str, _Keys] = {}  # count's label tuples, by machine name

    def histogram(self, table: dict[str, LatencyHistogram], key: str) -> LatencyHistogram:
        """The histogram of ``key`` in ``table``, created on first use."""
        histogram = table.get(key)
        if histogram is None:
            histogram = table[key] = LatencyHistogram()
        return histogram

    def count(self, machine: Machine, msg: Request, events: list[Event], start: int) -> None:
        """Count what one request of a run of ``machine`` decided: ``events[start:]``.

        The decider keeps no counters; every figure here follows from the events a
        request made (and, for a tool call, the report that made them), so what the
        metrics say is what the journal holds.

        Runs once per decided request, so the label tuples of a model call and a
        transition come from :class:`_Keys`, built once per machine, state and model (or
        source and destination): two dict lookups instead of building and hashing a fresh
        tuple per table, and the tables then find their key by identity.
        """
        name = machine.name
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = _Keys(name)
        proposed = False  # a proposal was journaled and its verdict is still to come
        reconciled = False
        for index in range(start, len(events)):
            event: Any = events[index]
            kind = type(event)
            if kind is ModelCalled:
                model = event.model
                by_model = keys.calls.get(event.state)
                call = by_model.get(model) if by_model is not None else None
                if call is None:
                    call = keys.call(event.state, model)
                prompt_key, completion_key, cached_key, reasoning_key, calls_key = call
                usage = event.usage
                tokens = self.tokens
                # ``+= 0`` only makes the key there: a membership test does that for less
                prompt, completion = usage.prompt, usage.completion
                if prompt:
                    tokens[prompt_key] += prompt
                elif prompt_key not in tokens:
                    tokens[prompt_key] = 0
                if completion:
                    tokens[completion_key] += completion
                elif completion_key not in tokens:
                    tokens[completion_key] = 0
                if usage.cached:
                    tokens[cached_key] += usage.cached
                if usage.reasoning:
                    tokens[reasoning_key] += usage.reasoning
                self.model_calls[calls_key] += 1
                latency = self.model_latency.get(model)
                if latency is None:
                    latency = self.histogram(self.model_latency, model)
                seconds = event.latency  # LatencyHistogram.record, inlined
                latency.counts[bisect_left(_BOUNDS, seconds)] += 1
                latency.sum += seconds
                latency.total += 1
                proposed = True
            elif kind is Transitioned:
                if proposed:
                    self.verdicts[keys.accepted] += 1
                    proposed = False
                src = event.src
                by_dst = keys.moves.get(src)
                move = by_dst.get(event.dst) if by_dst is not None else None
                if move is None:
                    move = keys.move(src, event.dst)
                self.transitions[move] += 1
            elif kind is IntentRecorded:
                if proposed:
                    self.verdicts[keys.accepted] += 1
                    proposed = False
            elif kind is ToolCommitted:
                tool = machine.tool_by_name.get(event.tool)
                if tool is not None and not tool.read_only:
                    self.side_effects[event.tool] += 1
            elif kind is ProposalRejected:
                for violation in event.violations:
                    self.verdicts[(name, "rejected", violation.code)] += 1
                proposed = False
            elif kind is StepProposed:
                proposed = True
            elif kind is RunStarted:
                self.runs_started[name] += 1
            elif kind is Completed:
                self.runs_finished[(name, "completed")] += 1
            elif kind is Failed:
                self.runs_finished[(name, "failed")] += 1
            elif kind is Escalated:
                self.runs_finished[(name, "escalated")] += 1
                self.escalations_pending += 1
                self.escalation_reasons[(name, event.reason)] += 1
            elif kind is Resumed:
                self.escalations_pending -= 1
            elif kind is ProviderFailed:
                self.provider_failures[(name, event.model)] += 1
            elif kind is BreakerTripped:
                self.breaker_trips[(name, event.breaker, event.tool)] += 1
            elif kind is ToolInDoubt:
                self.in_doubt[event.tool] += 1
            elif kind is Reconciled:
                applied = event.applied
                outcome = (
                    "applied" if applied else ("not_applied" if applied is False else "failed")
                )
                self.reconciliations[(event.tool, outcome)] += 1
                reconciled = True
            elif kind is ToolFailed and not reconciled and event.in_doubt is True:
                self.in_doubt[event.tool] += 1  # escalated as in doubt, not reconciled
        if type(msg) is Report:
            first = events[start]
            tool_name: str = getattr(first, "tool", "")
            self.tool_calls[tool_name] += 1
            self.histogram(self.tool_latency, tool_name).record(msg.latency)
            if not msg.ok:
                self.tool_errors[tool_name] += 1

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
