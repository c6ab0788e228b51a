"""Metrics: what the Prometheus collector costs verification, as a ratio.

The supervisor always counts in plain integers (``RuntimeStats``); the
``RuntimeCollector`` turns them into samples only when scraped. Measured:

- *verification through the supervisor*: concurrent 20-step runs of the benchmark machine
  (every step a verified tool call, as in ``bench_loop``), microseconds per step, with the
  collector **not registered**, and **registered on a ``CollectorRegistry`` and scraped
  once per second** by a thread rendering the exposition text
  (``prometheus_client.generate_latest``), as Prometheus's scrape of ``serve_metrics``
  would; the two alternate, three times each, and the ratio of the medians is reported;
- *one scrape*: milliseconds to render every family with 1,000 and 10,000 runs in flight
  (the runs-in-flight family counts live runs by state at scrape time).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks._harness import Progress, no_progress, quantile
from benchmarks._workload import TOTAL, build_machine, step_script
from interlock import open_supervisor
from interlock.metrics import RuntimeCollector, RuntimeStats
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore

NAME = "metrics"
TITLE = "Metrics: verification with the collector scraped every second, and one scrape"

STEPS = 20
SCRAPE_INTERVAL = 1.0


class _Scraper(threading.Thread):
    """Renders the registry's exposition text every ``interval`` seconds until stopped."""

    def __init__(self, registry: CollectorRegistry, interval: float) -> None:
        super().__init__(daemon=True)
        self.registry = registry
        self.interval = interval
        self.durations: list[float] = []
        self.bytes = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            started = time.perf_counter()
            self.bytes = len(generate_latest(self.registry))
            self.durations.append(time.perf_counter() - started)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def verify_steps(runs: int, scraped: bool) -> dict[str, Any]:
    """Microseconds per step of ``runs`` concurrent runs, with or without the collector."""
    machine = build_machine()
    script = step_script(STEPS)
    provider = ScriptedProvider(lambda view: script[view.steps])
    stats = RuntimeStats()
    live: dict[str, Any] = {}
    scraper = None
    if scraped:
        registry = CollectorRegistry()
        registry.register(RuntimeCollector(stats, supervisor=lambda: live.get("supervisor")))
        scraper = _Scraper(registry, SCRAPE_INTERVAL)

    async def main() -> None:
        async with open_supervisor([machine], MemoryStore(), provider=provider, stats=stats) as sup:
            live["supervisor"] = sup
            for i in range(runs):
                await sup.start_run(machine.name, {"total": TOTAL}, run_id=f"r{i}")

    if scraper is not None:
        scraper.start()
    wall = time.perf_counter()
    cpu = time.process_time()
    try:
        trio.run(main)
    finally:
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
        if scraper is not None:
            scraper.stop()
    result: dict[str, Any] = {
        "us_per_step": wall / (runs * STEPS) * 1e6,
        "cpu_us_per_step": cpu / (runs * STEPS) * 1e6,
        "verifications": stats.snapshot(0).verifications,
    }
    if scraper is not None:
        result["scrapes"] = len(scraper.durations)
        result["scrape_ms_max"] = max(scraper.durations, default=0.0) * 1e3
        result["exposition_bytes"] = scraper.bytes
    return result


def scrape_cost(in_flight: int, scrapes: int) -> dict[str, Any]:
    """Milliseconds per scrape with ``in_flight`` runs parked in their worker state."""
    machine = build_machine()
    script = step_script(STEPS)
    provider = ScriptedProvider(lambda view: script[view.steps], latency=3600.0)
    stats = RuntimeStats()
    durations: list[float] = []
    size = 0

    async def main() -> None:
        nonlocal size
        # Cancelling the scope cancels the parked runs when the supervisor's block exits.
        with trio.CancelScope() as scope:
            async with open_supervisor(
                [machine], MemoryStore(), provider=provider, stats=stats
            ) as sup:
                registry = CollectorRegistry()
                registry.register(RuntimeCollector(stats, supervisor=lambda: sup))
                for i in range(in_flight):
                    await sup.start_run(machine.name, {"total": TOTAL}, run_id=f"r{i}")
                await trio.sleep(0.05)
                for _ in range(scrapes):
                    started = time.perf_counter()
                    size = len(generate_latest(registry))
                    durations.append(time.perf_counter() - started)
                scope.cancel()

    trio.run(main)
    return {
        "in_flight": in_flight,
        "ms_p50": quantile(durations, 0.5) * 1e3,
        "ms_max": max(durations) * 1e3,
        "exposition_bytes": size,
    }


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    runs = 100 if quick else 1_000
    repeats = 1 if quick else 3
    plain: list[dict[str, Any]] = []
    scraped: list[dict[str, Any]] = []
    total = 2 * repeats + 2
    for i in range(repeats):
        progress("verification, collector not registered", (2 * i) / total)
        plain.append(verify_steps(runs, scraped=False))
        progress("verification, collector scraped every second", (2 * i + 1) / total)
        scraped.append(verify_steps(runs, scraped=True))
    scrapes = []
    for done, in_flight in enumerate((100, 500) if quick else (1_000, 10_000)):
        progress(f"one scrape, {in_flight:,} runs in flight", (2 * repeats + done) / total)
        scrapes.append(scrape_cost(in_flight, 5 if quick else 20))
    plain_us = statistics.median(r["us_per_step"] for r in plain)
    scraped_us = statistics.median(r["us_per_step"] for r in scraped)
    return {
        "runs": runs,
        "steps": STEPS,
        "interval_s": SCRAPE_INTERVAL,
        "not_registered": plain,
        "scraped": scraped,
        "ratio": scraped_us / plain_us,
        "scrape_cost": scrapes,
    }


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    def median(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    scraped = results["scraped"]
    return "\n".join(
        [
            f"{results['runs']:,} concurrent runs of {results['steps']} verified steps, the collector "
            f"scraped every {results['interval_s']:g} s in a thread; medians of "
            f"{len(scraped)} alternating repetitions.",
            "",
            table(
                ["configuration", "µs/step (wall)", "CPU µs/step", "scrapes", "slowest scrape ms"],
                [
                    (
                        "collector not registered",
                        num(median(results["not_registered"], "us_per_step")),
                        num(median(results["not_registered"], "cpu_us_per_step")),
                        "–",
                        "–",
                    ),
                    (
                        "collector registered, scraped every second",
                        num(median(scraped, "us_per_step")),
                        num(median(scraped, "cpu_us_per_step")),
                        f"{sum(r['scrapes'] for r in scraped):,}",
                        num(max(r["scrape_ms_max"] for r in scraped), 2),
                    ),
                ],
            ),
            "",
            f"Scraped ÷ not registered: **{ratio(results['ratio'])}**.",
            "",
            table(
                ["runs in flight", "ms per scrape p50", "max", "exposition bytes"],
                [
                    (
                        f"{r['in_flight']:,}",
                        num(r["ms_p50"], 2),
                        num(r["ms_max"], 2),
                        f"{r['exposition_bytes']:,}",
                    )
                    for r in results["scrape_cost"]
                ],
            ),
        ]
    )
