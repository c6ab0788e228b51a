"""RuntimeCollector: turns the supervisor's plain-integer counters into Prometheus samples."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .._version import __version__
from ..core._breakers import BREAKERS, CIRCUIT, CIRCUIT_STATE_VALUES, CLOSED, REPEAT
from ..core._hotpath import IMPLEMENTATION
from ..core._stats import LatencyHistogram

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.registry import CollectorRegistry

    from ..core._stats import RuntimeStats
    from ._supervisor import Supervisor

#: USD per million tokens, ``(prompt, completion)``, by model name. ``sim-1`` is the
#: demo's simulated model (``chaos:sim-1`` once the chaos provider wraps it), priced
#: like a mid-size hosted model. A model missing from the table costs 0, but its
#: tokens are still counted.
DEFAULT_PRICES: Mapping[str, tuple[float, float]] = {
    "sim-1": (3.0, 15.0),
    "chaos:sim-1": (3.0, 15.0),
}

#: The port ``interlock demo --metrics-port`` is documented with (OpenTelemetry's
#: Prometheus exporter default); any free port works.
DEFAULT_METRICS_PORT = 9464


#: Breakers whose trips name a tool; the others trip with ``tool=""``.
_TOOL_BREAKERS = (REPEAT, CIRCUIT)
#: Terminal outcomes, as ``Machine.outcome`` names them.
_OUTCOMES = ("completed", "escalated", "failed")


def _octaves(first: int, last: int) -> tuple[float, ...]:
    # NOTE: bucket bounds are taken from LatencyHistogram's own grid (one per octave),
    # so each cumulative count is exact; a bound between grid points could only be
    # approximated from the recorded buckets.
    return LatencyHistogram.BOUNDS[first : last + 1 : 4]


#: Verification: 1 µs .. 131 ms (a proposal takes microseconds; a slow guard, milliseconds).
VERIFY_BOUNDS = _octaves(8, 76)
#: Model and tool calls: 64 µs .. 16.8 s.
CALL_BOUNDS = _octaves(32, 104)
#: Journal flushes: 4 µs .. 4.2 s.
FLUSH_BOUNDS = _octaves(16, 96)
#: Batch sizes are recorded as ``events * 1e-6`` "seconds": 1, 2, 4 .. 8192 events.
BATCH_BOUNDS = _octaves(8, 60)


@functools.cache
def _labels(bounds: tuple[float, ...], scale: float) -> tuple[str, ...]:
    # Round away the float noise of the grid (3.2000000000000005e-05) for the label only.
    return tuple(repr(float(f"{bound * scale:.12g}")) for bound in bounds)


def _buckets(
    histogram: LatencyHistogram, bounds: tuple[float, ...], scale: float = 1.0
) -> tuple[list[tuple[str, float]], float]:
    # Copy first: the trio thread may record while a scrape runs in the server thread.
    # The count is taken from the copied buckets so +Inf always equals _count.
    counts = list(histogram.counts)
    snapshot = LatencyHistogram()
    snapshot.counts = counts
    pairs: list[tuple[str, float]] = [
        (le, float(count))
        for le, (_bound, count) in zip(
            _labels(bounds, scale), snapshot.cumulative(bounds), strict=True
        )
    ]
    pairs.append(("+Inf", float(sum(counts))))
    return pairs, histogram.sum * scale


def _copy(table: Mapping[Any, Any]) -> dict[Any, Any]:
    # NOTE: dict.copy runs in C without releasing the GIL, so this is a consistent
    # snapshot even while the supervisor inserts new keys from the trio thread.
    return dict.copy(table)  # type: ignore[arg-type]


class RuntimeCollector(Collector):
    """A Prometheus collector that reads a :class:`RuntimeStats` at scrape time.

    Recording stays plain integer arithmetic on the supervisor's thread; this
    collector builds every sample only when scraped, so there is no lock and no
    ``Counter`` object on the hot path. No family has a run id label: every label
    value comes from a machine, state, model, tool, breaker or violation code.

    Register it on a registry of your own (never the global one)::

        registry = CollectorRegistry()
        registry.register(RuntimeCollector(stats, supervisor=lambda: supervisor))
        server = serve_metrics(registry, 9464)

    Args:
      stats: the counters the supervisor updates (pass the same object as
        ``open_supervisor(stats=...)``).
      supervisor: returns the live supervisor, or None before it starts; used for
        runs in flight by state, circuit states and journal bytes, and to start the
        series of every machine, state, tool, breaker and outcome at 0 (so ``rate()``
        sees the first increment). Without it, those families hold only what
        ``stats`` has counted.
      prices: USD per million tokens, ``(prompt, completion)``, by model name;
        defaults to :data:`DEFAULT_PRICES`. A model missing from the table costs 0.
    """

    def __init__(
        self,
        stats: RuntimeStats,
        *,
        supervisor: Callable[[], Supervisor | None] | None = None,
        prices: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        self.stats = stats
        self.supervisor = supervisor
        self.prices = dict(DEFAULT_PRICES if prices is None else prices)

    def collect(self) -> Iterator[Metric]:
        """Yield every ``interlock_*`` family, built from the counters as they are now."""
        stats = self.stats
        supervisor = self.supervisor() if self.supervisor is not None else None
        yield from self._tokens(stats)
        yield from self._verification(stats, supervisor)
        yield from self._breakers(stats, supervisor)
        yield from self._runs(stats, supervisor)
        yield from self._tools(stats, supervisor)
        yield from self._journal(stats, supervisor)
        build = GaugeMetricFamily(
            "interlock_build_info",
            "interlock's version and hot path (compiled or python); always 1",
            labels=("version", "hotpath"),
        )
        build.add_metric((__version__, IMPLEMENTATION), 1.0)
        yield build

    def _tokens(self, stats: RuntimeStats) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "interlock_tokens",
            "Tokens the model calls used, by machine, state, model and kind: prompt, completion, "
            "and of those cached (prompt tokens read from the provider's cache) and reasoning "
            "(completion tokens of hidden reasoning)",
            labels=("machine", "state", "model", "kind"),
        )
        cost: dict[tuple[str, str], float] = {}
        for (machine, state, model, kind), count in sorted(_copy(stats.tokens).items()):
            tokens.add_metric((machine, state, model, kind), float(count))
            if kind not in ("prompt", "completion"):
                continue  # cached and reasoning tokens are counted in these already
            prompt, completion = self.prices.get(model, (0.0, 0.0))
            price = prompt if kind == "prompt" else completion
            cost[(machine, model)] = cost.get((machine, model), 0.0) + count * price / 1e6
        yield tokens
        usd = CounterMetricFamily(
            "interlock_cost_usd",
            "Estimated model cost in US dollars from the price table, by machine and model",
            labels=("machine", "model"),
        )
        for key, value in sorted(cost.items()):
            usd.add_metric(key, value)
        yield usd
        calls = CounterMetricFamily(
            "interlock_model_calls",
            "Model calls, by machine and model",
            labels=("machine", "model"),
        )
        for key, count in sorted(_copy(stats.model_calls).items()):
            calls.add_metric(key, float(count))
        yield calls
        latency = HistogramMetricFamily(
            "interlock_model_call_seconds",
            "Model call latency in seconds, by model",
            labels=("model",),
        )
        for model, histogram in sorted(_copy(stats.model_latency).items()):
            latency.add_metric((model,), *_buckets(histogram, CALL_BOUNDS))
        yield latency
        failures = CounterMetricFamily(
            "interlock_provider_failures",
            "Model calls the provider failed to answer (raised, timed out, 429/5xx), by "
            "machine and model; never counted as the model's mistakes",
            labels=("machine", "model"),
        )
        # Every machine and model that was called starts at 0, so a rate has a series.
        zeros = dict.fromkeys(_copy(stats.model_calls), 0)
        for key, count in sorted({**zeros, **_copy(stats.provider_failures)}.items()):
            failures.add_metric(key, float(count))
        yield failures

    def _verification(self, stats: RuntimeStats, supervisor: Supervisor | None) -> Iterator[Metric]:
        verdicts = CounterMetricFamily(
            "interlock_verifications",
            "Verification verdicts by machine, outcome (accepted or rejected) and violation code; "
            'a rejection counts once per violation, an accepted verdict has code=""',
            labels=("machine", "outcome", "code"),
        )
        zeros = {(name, "accepted", ""): 0 for name in _machines_of(supervisor)}
        for key, count in sorted({**zeros, **_copy(stats.verdicts)}.items()):
            verdicts.add_metric(key, float(count))
        yield verdicts
        latency = HistogramMetricFamily(
            "interlock_verification_seconds",
            "Time the gate took to verify one proposal, in seconds, by machine",
            labels=("machine",),
        )
        for machine, histogram in sorted(_copy(stats.verify_latency).items()):
            latency.add_metric((machine,), *_buckets(histogram, VERIFY_BOUNDS))
        yield latency

    def _breakers(self, stats: RuntimeStats, supervisor: Supervisor | None) -> Iterator[Metric]:
        trips = CounterMetricFamily(
            "interlock_breaker_trips",
            "Breaker trips by machine, breaker (consecutive_failures, repeat, token_budget, "
            "step_budget, deadline, circuit) and tool (empty when no tool is involved)",
            labels=("machine", "breaker", "tool"),
        )
        zeros: dict[tuple[str, str, str], int] = {}
        if supervisor is not None:
            for name, machine in supervisor.machines.items():
                for breaker in BREAKERS:
                    if breaker in _TOOL_BREAKERS:
                        zeros.update(((name, breaker, tool.name), 0) for tool in machine.tools)
                    else:
                        zeros[(name, breaker, "")] = 0
        for key, count in sorted({**zeros, **_copy(stats.breaker_trips)}.items()):
            trips.add_metric(key, float(count))
        yield trips
        circuits = GaugeMetricFamily(
            "interlock_circuit_state",
            "State of each tool's circuit: 0 closed, 1 half-open, 2 open",
            labels=("tool",),
        )
        if supervisor is not None:
            states = {tool: CLOSED for tool in _tools_of(supervisor)}
            states.update(_circuit_states(supervisor))
            for tool, state in sorted(states.items()):
                circuits.add_metric((tool,), float(CIRCUIT_STATE_VALUES[state]))
        yield circuits

    def _runs(self, stats: RuntimeStats, supervisor: Supervisor | None) -> Iterator[Metric]:
        transitions = CounterMetricFamily(
            "interlock_transitions",
            "State transitions by machine, source and destination state",
            labels=("machine", "src", "dst"),
        )
        for key, count in sorted(_copy(stats.transitions).items()):
            transitions.add_metric(key, float(count))
        yield transitions
        started = CounterMetricFamily(
            "interlock_runs_started", "Runs started, by machine", labels=("machine",)
        )
        machines = _machines_of(supervisor)
        for machine, count in sorted(
            {**dict.fromkeys(machines, 0), **_copy(stats.runs_started)}.items()
        ):
            started.add_metric((machine,), float(count))
        yield started
        finished = CounterMetricFamily(
            "interlock_runs_finished",
            "Runs that reached a terminal state, by machine and outcome (completed, escalated, failed)",
            labels=("machine", "outcome"),
        )
        zeros = {(machine, outcome): 0 for machine in machines for outcome in _OUTCOMES}
        for key, count in sorted({**zeros, **_copy(stats.runs_finished)}.items()):
            finished.add_metric(key, float(count))
        yield finished
        in_flight = GaugeMetricFamily(
            "interlock_runs_in_flight",
            "Live runs not yet terminal, by machine and current state",
            labels=("machine", "state"),
        )
        if supervisor is not None:
            # Every non-terminal state of every machine, so each series exists at 0.
            counts = {
                (name, state): 0
                for name, machine in supervisor.machines.items()
                for state in machine.states
            }
            # A state outside ``machine.states`` is terminal and is not counted.
            live = supervisor.live_states()
            for key, count in live.items():
                if key in counts:
                    counts[key] = count
            for key, count in sorted(counts.items()):
                in_flight.add_metric(key, float(count))
        yield in_flight
        yield GaugeMetricFamily(
            "interlock_escalations_pending",
            "Runs parked in ESCALATE waiting for an operator",
            value=float(stats.escalations_pending),
        )
        leases = supervisor.leases if supervisor is not None else None
        yield GaugeMetricFamily(
            "interlock_leases_held",
            "Runs this process holds leases of (PostgreSQL: a worker, a resume, a gateway)",
            value=float(len(leases)) if leases is not None else 0.0,
        )
        yield CounterMetricFamily(
            "interlock_leases_claimed",
            "Runs claimed from the journal (PostgreSQL)",
            value=float(stats.leases_claimed),
        )
        yield CounterMetricFamily(
            "interlock_leases_lost",
            "Runs dropped because another process took their leases (PostgreSQL)",
            value=float(stats.leases_lost),
        )
        reasons = CounterMetricFamily(
            "interlock_escalations",
            "Runs escalated, by machine and reason (a breaker, in_doubt_side_effect, "
            "provider_unavailable, ...)",
            labels=("machine", "reason"),
        )
        for key, count in sorted(_copy(stats.escalation_reasons).items()):
            reasons.add_metric(key, float(count))
        yield reasons

    def _tools(self, stats: RuntimeStats, supervisor: Supervisor | None) -> Iterator[Metric]:
        # Every tool the machines declare starts at 0, so rates and ratios have a series.
        known = dict.fromkeys(_tools_of(supervisor) if supervisor is not None else (), 0)
        for name, counter, help_text in (
            ("interlock_tool_calls", stats.tool_calls, "Tool calls reported back, by tool"),
            ("interlock_tool_errors", stats.tool_errors, "Tool calls that failed, by tool"),
            (
                "interlock_side_effects",
                stats.side_effects,
                "Committed calls of tools that are not read-only, by tool",
            ),
        ):
            family = CounterMetricFamily(name, help_text, labels=("tool",))
            for tool, count in sorted({**known, **_copy(counter)}.items()):
                family.add_metric((tool,), float(count))
            yield family
        in_doubt = CounterMetricFamily(
            "interlock_tool_in_doubt",
            "Calls of tools that are not safe to repeat whose outcome was in doubt (an attempt "
            "that failed after dispatch, or a crash), by tool",
            labels=("tool",),
        )
        for tool, count in sorted({**known, **_copy(stats.in_doubt)}.items()):
            in_doubt.add_metric((tool,), float(count))
        yield in_doubt
        reconciled = CounterMetricFamily(
            "interlock_reconciliations",
            "Calls in doubt reconciled with their downstream, by tool and outcome "
            "(applied, not_applied, failed)",
            labels=("tool", "outcome"),
        )
        reconciling = {
            (tool.name, outcome): 0
            for machine in (supervisor.machines.values() if supervisor is not None else ())
            for tool in machine.tools
            if tool.reconcile is not None
            for outcome in ("applied", "not_applied", "failed")
        }
        for key, count in sorted({**reconciling, **_copy(stats.reconciliations)}.items()):
            reconciled.add_metric(key, float(count))
        yield reconciled
        latency = HistogramMetricFamily(
            "interlock_tool_call_seconds",
            "Tool call latency in seconds (all attempts), by tool",
            labels=("tool",),
        )
        for tool, histogram in sorted(_copy(stats.tool_latency).items()):
            latency.add_metric((tool,), *_buckets(histogram, CALL_BOUNDS))
        yield latency

    def _journal(self, stats: RuntimeStats, supervisor: Supervisor | None) -> Iterator[Metric]:
        flush = HistogramMetricFamily(
            "interlock_journal_flush_seconds",
            "Time one group-commit write of the journal took, in seconds",
        )
        flush.add_metric((), *_buckets(stats.flush_latency, FLUSH_BOUNDS))
        yield flush
        batch = HistogramMetricFamily(
            "interlock_journal_batch_events", "Events written per journal flush"
        )
        buckets, total = _buckets(stats.batch_sizes, BATCH_BOUNDS, scale=1e6)
        batch.add_metric((), buckets, float(round(total)))
        yield batch
        flush_events = _copy(stats.flush_events)
        yield CounterMetricFamily(
            "interlock_journal_events",
            "Events appended to the journal",
            value=float(flush_events.get("events", 0)),
        )
        written = flush_events.get("bytes", 0)
        if supervisor is not None:
            written = max(written, getattr(supervisor.store, "bytes_written", 0))
        yield CounterMetricFamily(
            "interlock_journal_bytes",
            "Bytes of framed events written to the journal (0 if the store does not count them)",
            value=float(written),
        )


def _machines_of(supervisor: Supervisor | None) -> list[str]:
    return [] if supervisor is None else list(supervisor.machines)


def _tools_of(supervisor: Supervisor) -> list[str]:
    return sorted({tool.name for machine in supervisor.machines.values() for tool in machine.tools})


def _circuit_states(supervisor: Supervisor) -> dict[str, str]:
    # states() iterates a dict the trio thread may grow; retry on the rare collision.
    for _ in range(3):
        try:
            return supervisor.circuit_states()
        except RuntimeError:
            continue
    return {}


def serve_metrics(
    registry: CollectorRegistry, port: int = DEFAULT_METRICS_PORT, host: str = "127.0.0.1"
) -> WSGIServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    The Prometheus text format is the default; a scraper that sends
    ``Accept: application/openmetrics-text`` gets OpenMetrics. Port 0 picks a free
    port (read it back from ``server.server_port``).

    Args:
      registry: the registry to expose (make one per process or test).
      port: the TCP port; 9464 by default.
      host: the address to bind; loopback by default.

    Returns:
      The running server; ``server.shutdown()`` then ``server.server_close()`` stop it.

    Raises:
      OSError: the address cannot be bound (for example, the port is in use).
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
