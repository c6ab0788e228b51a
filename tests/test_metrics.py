"""The metrics collector: samples agree with the journal, expositions parse, the dashboard's
names exist."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import (
    text_string_to_metric_families as text_string_to_prometheus_families,
)

from interlock import BreakerPolicy, __version__, serve_metrics
from interlock.core._breakers import CircuitBoard
from interlock.core._hotpath import IMPLEMENTATION
from interlock.demo._run import DemoConfig, run_demo
from interlock.events import (
    BreakerTripped,
    Completed,
    Escalated,
    Failed,
    ModelCalled,
    ProposalRejected,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    Transitioned,
)
from interlock.metrics import RuntimeCollector, RuntimeStats
from interlock.stores import MemoryStore

DASHBOARD = Path(__file__).parent.parent / "grafana/provisioning/dashboards/interlock/overview.json"
DATASOURCE = {"type": "prometheus", "uid": "interlock-prometheus"}
CONFIG = DemoConfig(runs=60, db=":memory:", latency=(0, 0.001), chaos_rate=0.3, seed=1)
PRICES = {"chaos:sim-1": (3.0, 15.0)}

FAMILIES = {
    "interlock_tokens": "counter",
    "interlock_cost_usd": "counter",
    "interlock_model_calls": "counter",
    "interlock_model_call_seconds": "histogram",
    "interlock_verifications": "counter",
    "interlock_verification_seconds": "histogram",
    "interlock_breaker_trips": "counter",
    "interlock_circuit_state": "gauge",
    "interlock_transitions": "counter",
    "interlock_runs_started": "counter",
    "interlock_runs_finished": "counter",
    "interlock_runs_in_flight": "gauge",
    "interlock_escalations_pending": "gauge",
    "interlock_leases_held": "gauge",
    "interlock_leases_claimed": "counter",
    "interlock_leases_lost": "counter",
    "interlock_tool_calls": "counter",
    "interlock_tool_errors": "counter",
    "interlock_provider_failures": "counter",
    "interlock_tool_in_doubt": "counter",
    "interlock_reconciliations": "counter",
    "interlock_escalations": "counter",
    "interlock_tool_call_seconds": "histogram",
    "interlock_side_effects": "counter",
    "interlock_journal_flush_seconds": "histogram",
    "interlock_journal_batch_events": "histogram",
    "interlock_journal_events": "counter",
    "interlock_journal_bytes": "counter",
    "interlock_build_info": "gauge",
}
HISTOGRAMS = [name for name, kind in FAMILIES.items() if kind == "histogram"]


@dataclass
class Demo:
    registry: CollectorRegistry
    stats: RuntimeStats
    supervisor: Any
    store: MemoryStore
    journals: dict[str, list[Any]]

    def events(self) -> list[tuple[str, Any]]:
        """Every journal event with the machine of its run."""
        out = []
        for events in self.journals.values():
            started = events[0]
            assert isinstance(started, RunStarted)
            out.extend((started.machine, event) for event in events)
        return out

    def samples(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The samples called ``name``, keyed by their sorted label pairs."""
        return {
            tuple(sorted(sample.labels.items())): sample.value
            for family in self.registry.collect()
            for sample in family.samples
            if sample.name == name
        }


def _key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _nonzero(samples: dict[Any, float]) -> dict[Any, float]:
    return {key: value for key, value in samples.items() if value}


@pytest.fixture(scope="module")
def demo() -> Demo:
    """A 60-run chaos demo on an in-memory journal, scraped through a fresh registry."""
    stats = RuntimeStats()
    store = MemoryStore()
    holder: dict[str, Any] = {}
    registry = CollectorRegistry()
    registry.register(
        RuntimeCollector(stats, supervisor=lambda: holder.get("supervisor"), prices=PRICES)
    )

    async def main() -> dict[str, list[Any]]:
        await run_demo(
            CONFIG, stats=stats, store=store, on_start=lambda s: holder.__setitem__("supervisor", s)
        )
        return {r.run_id: await store.load(r.run_id) for r in await store.list_runs()}

    journals = trio.run(main)
    assert len(journals) == CONFIG.runs
    return Demo(registry, stats, holder["supervisor"], store, journals)


def test_tokens_equal_the_recorded_usage(demo: Demo) -> None:
    expected: Counter[tuple[tuple[str, str], ...]] = Counter()
    for machine, event in demo.events():
        if isinstance(event, ModelCalled):
            labels = {"machine": machine, "state": event.state, "model": event.model}
            expected[_key(**labels, kind="prompt")] += event.usage.prompt
            expected[_key(**labels, kind="completion")] += event.usage.completion
    assert sum(expected.values()) > 0
    assert demo.samples("interlock_tokens_total") == dict(expected)


def test_cost_follows_the_price_table(demo: Demo) -> None:
    expected: Counter[tuple[tuple[str, str], ...]] = Counter()
    for key, tokens in demo.samples("interlock_tokens_total").items():
        labels = dict(key)
        prompt, completion = PRICES[labels["model"]]
        price = prompt if labels["kind"] == "prompt" else completion
        expected[_key(machine=labels["machine"], model=labels["model"])] += tokens * price / 1e6
    cost = demo.samples("interlock_cost_usd_total")
    assert cost.keys() == expected.keys()
    for key, value in expected.items():
        assert cost[key] == pytest.approx(value)
    assert sum(cost.values()) > 0


def test_a_model_missing_from_the_price_table_costs_nothing_but_counts_tokens() -> None:
    stats = RuntimeStats()
    stats.tokens[("refund", "WORK", "unpriced", "prompt")] += 1000
    stats.tokens[("refund", "WORK", "sim-1", "completion")] += 2_000_000
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(stats))
    value = registry.get_sample_value
    tokens = {"machine": "refund", "state": "WORK", "model": "unpriced", "kind": "prompt"}
    assert value("interlock_tokens_total", tokens) == 1000
    assert value("interlock_cost_usd_total", {"machine": "refund", "model": "unpriced"}) == 0
    # The documented default: sim-1 costs 15 USD per million completion tokens.
    assert value("interlock_cost_usd_total", {"machine": "refund", "model": "sim-1"}) == 30.0


def test_breaker_trips_equal_the_breaker_events(demo: Demo) -> None:
    expected: Counter[tuple[tuple[str, str], ...]] = Counter()
    by_breaker: Counter[str] = Counter()
    for machine, event in demo.events():
        if isinstance(event, BreakerTripped):
            expected[_key(machine=machine, breaker=event.breaker, tool=event.tool)] += 1
            by_breaker[event.breaker] += 1
    assert by_breaker  # chaos at 0.3 trips breakers; the test would prove nothing otherwise
    assert _nonzero(demo.samples("interlock_breaker_trips_total")) == dict(expected)
    for breaker, count in by_breaker.items():
        emitted = sum(
            value
            for key, value in demo.samples("interlock_breaker_trips_total").items()
            if dict(key)["breaker"] == breaker
        )
        assert emitted == count


def test_verifications_follow_the_journal(demo: Demo) -> None:
    """Each proposal is journaled as ModelCalled or StepProposed; a rejection adds one
    ProposalRejected with its violations (a provider error is rejected as ``malformed``
    without reaching the gate). So, per machine: accepted = proposals - rejections,
    rejected{code} = violations with that code, and the latency histogram counts
    proposals that were not provider errors."""
    proposals: Counter[str] = Counter()
    provider_errors: Counter[str] = Counter()
    rejections: Counter[str] = Counter()
    violations: Counter[tuple[str, str]] = Counter()
    for machine, event in demo.events():
        if isinstance(event, ModelCalled | StepProposed):
            proposals[machine] += 1
            provider_errors[machine] += bool(event.error)
        elif isinstance(event, ProposalRejected):
            rejections[machine] += 1
            violations.update((machine, v.code) for v in event.violations)
    value = demo.registry.get_sample_value
    for machine in demo.supervisor.machines:
        accepted = {"machine": machine, "outcome": "accepted", "code": ""}
        assert (
            value("interlock_verifications_total", accepted)
            == proposals[machine] - rejections[machine]
        )
        count = value("interlock_verification_seconds_count", {"machine": machine})
        assert count == proposals[machine] - provider_errors[machine]
    rejected = {
        key: count
        for key, count in demo.samples("interlock_verifications_total").items()
        if dict(key)["outcome"] == "rejected"
    }
    assert rejected == {
        _key(machine=machine, outcome="rejected", code=code): count
        for (machine, code), count in violations.items()
    }
    assert sum(violations.values()) > 0


def test_runs_follow_the_journal(demo: Demo) -> None:
    started: Counter[str] = Counter()
    finished: Counter[tuple[tuple[str, str], ...]] = Counter()
    transitions: Counter[tuple[tuple[str, str], ...]] = Counter()
    outcome_of = {Completed: "completed", Escalated: "escalated", Failed: "failed"}
    for machine, event in demo.events():
        if isinstance(event, RunStarted):
            started[machine] += 1
        elif isinstance(event, Completed | Escalated | Failed):
            finished[_key(machine=machine, outcome=outcome_of[type(event)])] += 1
        elif isinstance(event, Transitioned):
            transitions[_key(machine=machine, src=event.src, dst=event.dst)] += 1
    assert demo.samples("interlock_runs_started_total") == {
        _key(machine=m): float(n) for m, n in started.items()
    }
    assert sum(finished.values()) == CONFIG.runs
    assert _nonzero(demo.samples("interlock_runs_finished_total")) == dict(finished)
    assert demo.samples("interlock_transitions_total") == dict(transitions)
    escalated = sum(n for key, n in finished.items() if dict(key)["outcome"] == "escalated")
    assert demo.registry.get_sample_value("interlock_escalations_pending") == escalated
    # Every run is over: every non-terminal state of every machine reads 0.
    in_flight = demo.samples("interlock_runs_in_flight")
    assert in_flight == {
        _key(machine=name, state=state): 0.0
        for name, machine in demo.supervisor.machines.items()
        for state in machine.states
    }


def test_tools_and_journal_follow_the_journal(demo: Demo) -> None:
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    effects: Counter[str] = Counter()
    model_calls: Counter[tuple[tuple[str, str], ...]] = Counter()
    read_only = {
        tool.name: tool.read_only
        for machine in demo.supervisor.machines.values()
        for tool in machine.tools
    }
    events = demo.events()
    for machine, event in events:
        if isinstance(event, ToolCommitted):
            calls[event.tool] += 1
            effects[event.tool] += not read_only[event.tool]
        elif isinstance(event, ToolFailed):
            calls[event.tool] += 1
            errors[event.tool] += 1
        elif isinstance(event, ModelCalled):
            model_calls[_key(machine=machine, model=event.model)] += 1
    for name, expected in (
        ("interlock_tool_calls_total", calls),
        ("interlock_tool_errors_total", errors),
        ("interlock_side_effects_total", effects),
    ):
        assert _nonzero(demo.samples(name)) == {
            _key(tool=t): float(n) for t, n in expected.items() if n
        }, name
    assert demo.samples("interlock_model_calls_total") == dict(model_calls)
    for tool, count in calls.items():
        assert (
            demo.registry.get_sample_value("interlock_tool_call_seconds_count", {"tool": tool})
            == count
        )
    value = demo.registry.get_sample_value
    assert value("interlock_journal_events_total") == len(events)
    assert value("interlock_journal_batch_events_sum") == len(events)
    assert value("interlock_journal_batch_events_count") == demo.store.appends
    assert value("interlock_journal_flush_seconds_count") == demo.store.appends
    assert value("interlock_journal_bytes_total") == getattr(demo.store, "bytes_written", 0)


def test_batch_size_buckets_count_events_exactly() -> None:
    stats = RuntimeStats()
    sizes = [1, 1, 2, 3, 4, 5, 8, 9, 100, 8192, 9000]
    for size in sizes:
        stats.batch_sizes.record(size * 1e-6)  # how the supervisor records a batch
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(stats))
    for le in (1, 2, 4, 8, 16, 64, 128, 8192):
        got = registry.get_sample_value("interlock_journal_batch_events_bucket", {"le": f"{le}.0"})
        assert got == sum(size <= le for size in sizes), le
    assert registry.get_sample_value(
        "interlock_journal_batch_events_bucket", {"le": "+Inf"}
    ) == len(sizes)
    assert registry.get_sample_value("interlock_journal_batch_events_sum") == sum(sizes)


def test_latency_buckets_are_exact_cumulative_counts() -> None:
    stats = RuntimeStats()
    samples = [0.0, 3e-7, 1e-6, 1.0001e-6, 2.5e-6, 7.9e-6, 8e-6, 3e-5, 0.001, 0.05, 0.2, 30.0]
    histogram = stats.histogram(stats.verify_latency, "m")
    for seconds in samples:
        histogram.record(seconds)
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(stats))
    buckets = {
        sample.labels["le"]: sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "interlock_verification_seconds_bucket"
    }
    assert next(iter(buckets)) == "1e-06"
    assert list(buckets)[-2:] == ["0.131072", "+Inf"]
    for le, count in buckets.items():
        assert count == sum(s <= float(le) for s in samples), le


def test_histograms_are_well_formed(demo: Demo) -> None:
    for family in demo.registry.collect():
        if family.type != "histogram":
            continue
        series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        counts = {}
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            key = tuple(sorted(labels.items()))
            if sample.name.endswith("_bucket"):
                series.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                counts[key] = sample.value
        assert series, family.name
        for key, buckets in series.items():
            bounds = [le for le, _ in buckets]
            values = [value for _, value in buckets]
            assert bounds == sorted(bounds), family.name
            assert bounds[-1] == math.inf, family.name
            assert values == sorted(values), (family.name, key)
            assert values[-1] == counts[key], (family.name, key)


def test_build_info_names_the_version_and_hot_path(demo: Demo) -> None:
    assert IMPLEMENTATION in ("compiled", "python")
    labels = {"version": __version__, "hotpath": IMPLEMENTATION}
    assert demo.registry.get_sample_value("interlock_build_info", labels) == 1
    assert len(demo.samples("interlock_build_info")) == 1


def test_every_family_is_emitted_with_no_run_id_label(demo: Demo) -> None:
    families = {family.name: family for family in demo.registry.collect()}
    assert {name: family.type for name, family in families.items()} == FAMILIES
    machines = set(demo.supervisor.machines)
    tools = {t.name for m in demo.supervisor.machines.values() for t in m.tools}
    run_ids = set(demo.journals)
    for family in families.values():
        assert family.samples, family.name
        for sample in family.samples:
            assert "run_id" not in sample.labels, sample
            assert not run_ids & set(sample.labels.values()), sample
            assert sample.labels.get("machine", next(iter(machines))) in machines, sample
            assert sample.labels.get("tool", "") in tools | {""}, sample


def test_openmetrics_and_text_expositions_parse(demo: Demo) -> None:
    openmetrics = generate_openmetrics(demo.registry).decode()
    assert openmetrics.endswith("# EOF\n")
    parsed = {f.name: f for f in text_string_to_metric_families(openmetrics)}
    assert {name: f.type for name, f in parsed.items()} == FAMILIES
    tokens = [s for s in parsed["interlock_tokens"].samples if s.name == "interlock_tokens_total"]
    assert sum(s.value for s in tokens) == sum(demo.samples("interlock_tokens_total").values())
    text = {
        f.name: f
        for f in text_string_to_prometheus_families(generate_latest(demo.registry).decode())
    }
    assert set(text) == set(FAMILIES)


def test_a_collector_without_a_supervisor_still_exposes_every_family() -> None:
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(RuntimeStats()))
    parsed = {
        f.name for f in text_string_to_metric_families(generate_openmetrics(registry).decode())
    }
    assert parsed == set(FAMILIES)
    assert registry.get_sample_value("interlock_escalations_pending") == 0


def test_circuit_state_gauge_reads_closed_half_open_and_open() -> None:
    policy = BreakerPolicy(circuit_failures=2, circuit_cooldown=10.0)
    board = CircuitBoard()
    tool = SimpleNamespace(name="pay")
    machine = SimpleNamespace(tools=[tool, SimpleNamespace(name="lookup")], states={})
    supervisor = SimpleNamespace(
        machines={"m": machine}, live_states=Counter, circuit_states=board.states, store=None
    )
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(RuntimeStats(), supervisor=lambda: supervisor))

    def state(name: str) -> float | None:
        return registry.get_sample_value("interlock_circuit_state", {"tool": name})

    assert (state("pay"), state("lookup")) == (0, 0)
    board.record("pay", False, 100.0, policy, "boom")
    board.record("pay", False, 100.0, policy, "boom")
    assert (state("pay"), state("lookup")) == (2, 0)
    assert board.check("pay", 111.0, policy) is None  # the cooldown passed: one trial call
    assert state("pay") == 1


async def test_runs_in_flight_counts_live_runs_by_state() -> None:
    stats = RuntimeStats()
    holder: dict[str, Any] = {}
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(stats, supervisor=lambda: holder.get("supervisor")))
    config = DemoConfig(runs=30, db=":memory:", latency=(0.002, 0.004), chaos_rate=0.2, seed=2)
    seen = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: run_demo(
                config,
                stats=stats,
                store=MemoryStore(),
                on_start=lambda s: holder.__setitem__("supervisor", s),
            )
        )
        with trio.fail_after(30):
            while not seen:
                await trio.sleep(0.001)
                supervisor = holder.get("supervisor")
                if supervisor is None:
                    continue
                # No checkpoint between the two reads, so they see the same runs.
                live = Counter(
                    (run.machine.name, run.state)
                    for run in supervisor._runs.values()
                    if not run.terminal
                )
                gauge = {
                    key: value
                    for family in registry.collect()
                    for sample in family.samples
                    if sample.name == "interlock_runs_in_flight" and (value := sample.value)
                    for key in [(sample.labels["machine"], sample.labels["state"])]
                }
                assert gauge == {key: float(n) for key, n in live.items()}
                seen = sum(live.values())
    assert seen > 0


def test_serve_metrics_speaks_text_and_openmetrics(demo: Demo) -> None:
    server = serve_metrics(demo.registry, 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with httpx.Client(timeout=10) as client:
            text = client.get(url)
            openmetrics = client.get(
                url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
            )
    finally:
        server.shutdown()
        server.server_close()
    assert text.status_code == 200
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "interlock_tokens_total{" in text.text
    assert openmetrics.status_code == 200
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert {f.name for f in text_string_to_metric_families(openmetrics.text)} == set(FAMILIES)


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def test_dashboard_names_are_metrics_the_collector_emits(demo: Demo) -> None:
    text = DASHBOARD.read_text()
    names = set(re.findall(r"interlock_\w+", text))
    emitted = set(FAMILIES)
    for family in demo.registry.collect():
        emitted.update(sample.name for sample in family.samples)
    assert names - emitted == set()
    # ...and every family has a panel.
    assert {f for f in FAMILIES if not any(n.startswith(f) for n in names)} == set()


def test_dashboard_panels_use_the_provisioned_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "interlock-overview"
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert titles == {
        "Token burn", "Breakers", "Verification", "Runs", "Tools", "Journal", "Reliability",
    }  # fmt: skip
    for panel in _panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
    provisioning = DASHBOARD.parent.parent.parent
    assert "uid: interlock-prometheus" in (provisioning / "datasources/prometheus.yaml").read_text()
    assert "folder: Interlock" in (provisioning / "dashboards/interlock.yaml").read_text()
