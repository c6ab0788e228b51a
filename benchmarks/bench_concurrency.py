"""Concurrency: 1,000, 10,000 and 100,000 concurrent runs of 10 steps, each step a model call
with 5-20 ms of simulated latency, through the full loop (propose -> verify -> journal ->
execute the no-op tool -> report -> commit).

The journal is the embedded default, a SQLite file (``open_sqlite_store``, synchronous
NORMAL, in a temporary directory): what a user runs, with the journal on disk rather than
in the process. One configuration at 10,000 runs uses a ``MemoryStore`` instead, so the
cost of the disk writes (a worker thread per flush) can be told apart, and so the journal's
resident size shows.

Measured per configuration, each in its own subprocess so that the peak RSS belongs to
that configuration alone: wall time, CPU seconds (user + system), the collector's own CPU
seconds and passes (``gc.callbacks``), peak RSS and RSS per run above the process's RSS
before the runs started. Peak RSS is the kernel's high-water mark of the child
(``VmHWM``); ``resource.getrusage().ru_maxrss`` is recorded too, but on Linux it carries
over across ``exec`` and so reports at least the parent's RSS at fork time.

Baselines, with the same per-run, per-step latencies (``_workload.latency_ms``):

- *bare trio*: one task per run doing only the 10 sleeps, trio's default settings;
- *bare asyncio*: the same sleeps as asyncio tasks.

interlock runs twice: with the interpreter's default collector settings, and *tuned*
from the benchmark side: ``gc.set_threshold(*TUNED_THRESHOLD)`` at process start and
``gc.freeze()`` once every run has started (so the long-lived task frames, run states
and supervisor tables move to the permanent generation and are never walked again).

Wall time on this shared 2-core host is sensitive to other processes; CPU seconds are
the steadier figure, so both are reported and compared.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import resource
import time
from typing import Any

from benchmarks._harness import (
    GCTimer,
    Progress,
    child_main,
    no_progress,
    peak_rss_kib,
    profile,
    rss_kib,
    run_child,
    short_path,
)
from interlock.runtime._runtime import GC_THRESHOLD

NAME = "concurrency"
TITLE = "Concurrent runs: wall time, CPU and memory against bare trio and asyncio sleeps"

STEPS = 10
#: Generation thresholds of the tuned variant: the ones open_supervisor sets.
TUNED_THRESHOLD = GC_THRESHOLD
FULL_SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (100, 400)

#: (label, runtime, gc mode). ``sizes`` limits a configuration to some sizes (None: all).
CONFIGS: tuple[tuple[str, str, str, tuple[int, ...] | None], ...] = (
    ("bare asyncio", "asyncio", "default", None),
    ("bare trio", "trio", "default", None),
    ("bare trio, tuned gc", "trio", "tuned", (10_000,)),
    ("interlock", "interlock", "default", (1_000, 10_000, 100, 400)),
    ("interlock, tuned gc", "interlock", "tuned", None),
    ("interlock, MemoryStore, tuned gc", "interlock-memory", "tuned", (10_000, 400)),
)


# -- children -------------------------------------------------------------------------


def _latency(run_index: int, step: int) -> float:
    from benchmarks._workload import latency_ms

    return latency_ms(run_index, step) / 1000.0


def _run_asyncio(runs: int, steps: int, tuned: bool) -> dict[str, Any]:
    from benchmarks._workload import latency_ms

    async def task(index: int) -> None:
        for step in range(steps):
            await asyncio.sleep(latency_ms(index, step) / 1000.0)

    async def main() -> float:
        started = time.perf_counter()
        tasks = [asyncio.ensure_future(task(i)) for i in range(runs)]
        if tuned:
            gc.freeze()
        await asyncio.gather(*tasks)
        return time.perf_counter() - started

    asyncio.run(main())
    return {}


def _run_trio(runs: int, steps: int, tuned: bool) -> dict[str, Any]:
    import trio

    from benchmarks._workload import latency_ms

    async def task(index: int) -> None:
        for step in range(steps):
            await trio.sleep(latency_ms(index, step) / 1000.0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(runs):
                nursery.start_soon(task, i)
            if tuned:
                gc.freeze()

    trio.run(main)
    return {}


def _run_interlock(
    runs: int, steps: int, tuned: bool, snapshot_at: float = 0.0, store_kind: str = "sqlite"
) -> dict[str, Any]:
    import tempfile

    import trio

    from benchmarks._workload import build_machine, latency_ms, step_script
    from interlock import RunView, open_supervisor
    from interlock.providers import ScriptedProvider
    from interlock.stores import MemoryStore, Store, open_sqlite_store

    script = step_script(steps)

    def oracle(view: RunView) -> str:
        return script[view.steps]

    def latency(view: RunView) -> float:
        return latency_ms(int(view.run_id[1:]), view.steps) / 1000.0

    machine = build_machine()
    provider = ScriptedProvider(oracle, latency=latency)
    memory = MemoryStore()
    directory = tempfile.TemporaryDirectory(prefix="interlock-bench-")
    extra: dict[str, Any] = {}

    async def main() -> None:
        store: Store = memory
        if store_kind == "sqlite":
            store = await open_sqlite_store(f"{directory.name}/journal.db")
        started = time.perf_counter()
        async with open_supervisor([machine], store, provider=provider) as supervisor:

            async def start(index: int) -> None:
                await supervisor.start_run(machine.name, {"total": 100.0}, run_id=f"r{index}")

            async with trio.open_nursery() as starters:
                for i in range(runs):
                    starters.start_soon(start, i)
            extra["startup_s"] = time.perf_counter() - started
            if tuned:
                gc.freeze()
            if snapshot_at:
                extra["snapshot"] = await _snapshot_when(supervisor, runs * 31 * snapshot_at)
        stats = supervisor.statistics()
        extra.update(
            completed=stats.runs_finished.get("completed", 0),
            events=stats.events,
            flushes=stats.flushes,
            events_per_flush=stats.events / max(1, stats.flushes),
        )

        if store is not memory:
            extra["journal_mib"] = store.bytes_written / 2**20
            await store.aclose()

    trio.run(main)
    if store_kind == "memory":
        journal = memory._journal
        extra["journal_mib"] = sum(len(b) for rows in journal.values() for _, b in rows) / 2**20
    directory.cleanup()
    extra["store"] = store_kind
    return extra


async def _snapshot_when(supervisor: Any, events: float) -> Any:
    """Wait until the journal holds ``events`` events, then take a tracemalloc snapshot."""
    import tracemalloc

    import trio

    # Polling: the supervisor has no hook to wait on, and a 5 ms tick is far below a step.
    while supervisor.statistics().events < events:  # noqa: ASYNC110
        await trio.sleep(0.005)
    return tracemalloc.take_snapshot()


def _memory_profile(runs: int, steps: int, top: int) -> dict[str, Any]:
    """Where the live memory of ``runs`` runs is, half-way through: top allocation sites."""
    import tracemalloc

    tracemalloc.start(1)
    extra = _run_interlock(runs, steps, True, snapshot_at=0.5)
    tracemalloc.stop()
    snapshot = extra["snapshot"].filter_traces(
        [tracemalloc.Filter(False, "<frozen *>"), tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    stats = snapshot.statistics("lineno")
    total = sum(stat.size for stat in stats)
    rows = []
    for stat in stats[:top]:
        frame = stat.traceback[0]
        rows.append(
            {
                "site": f"{short_path(frame.filename)}:{frame.lineno}",
                "kib_per_run": stat.size / runs / 1024,
                "objects_per_run": stat.count / runs,
                "share": stat.size / total,
            }
        )
    return {"runs": runs, "traced_kib_per_run": total / runs / 1024, "sites": rows}


_RUNNERS = {
    "asyncio": _run_asyncio,
    "trio": _run_trio,
    "interlock": _run_interlock,
    "interlock-memory": functools.partial(_run_interlock, store_kind="memory"),
}


def _child(config: dict[str, Any]) -> dict[str, Any]:
    runtime, runs, steps, mode = config["runtime"], config["runs"], config["steps"], config["gc"]
    runner = _RUNNERS[runtime]
    # "tuned" does both; "freeze" and "threshold" (one-off experiments) do one each.
    tuned = mode in ("tuned", "freeze")
    if mode in ("tuned", "threshold"):
        gc.set_threshold(*TUNED_THRESHOLD)
    # Imported before the RSS baseline (and before tracemalloc starts), for every runtime.
    import trio  # noqa: F401

    import interlock.providers
    import interlock.stores  # noqa: F401

    gc.collect()
    baseline = rss_kib()
    if config.get("profile"):
        prof = profile(lambda: runner(runs, steps, tuned), top=config["profile"])
        return {"profile": prof.rows, "profile_areas": prof.areas}
    if config.get("memory_profile"):
        return _memory_profile(runs, steps, config["memory_profile"])
    with GCTimer() as gc_timer:
        cpu = time.process_time()
        wall = time.perf_counter()
        extra = runner(runs, steps, tuned)
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
    peak = peak_rss_kib()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "runtime": runtime,
        "gc": mode,
        "runs": runs,
        "steps": steps,
        "wall_s": wall,
        "cpu_s": cpu,
        "gc_s": gc_timer.seconds,
        "gc_collections": gc_timer.collections,
        "baseline_rss_mib": baseline / 1024,
        "peak_rss_mib": peak / 1024,
        "ru_maxrss_mib": maxrss / 1024,
        "rss_per_run_kib": (peak - baseline) / runs,
        "sleep_floor_s": max(
            sum(_latency(i, s) for s in range(steps)) for i in range(min(runs, 5000))
        ),
        **extra,
    }


# -- the benchmark ----------------------------------------------------------------------


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    sizes = QUICK_SIZES if quick else FULL_SIZES
    plan = [
        (label, runtime, mode, size)
        for size in sizes
        for label, runtime, mode, only in CONFIGS
        if only is None or size in only
    ]
    rows = []
    for done, (label, runtime, mode, size) in enumerate(plan):
        progress(f"{label}: {size:,} runs", done / len(plan))
        result = run_child(
            "benchmarks.bench_concurrency",
            {"runtime": runtime, "runs": size, "steps": STEPS, "gc": mode},
            timeout=1800,
        )
        result["label"] = label
        rows.append(result)
    progress("profiling interlock (CPU)", 1.0)
    prof = run_child(
        "benchmarks.bench_concurrency",
        {"runtime": "interlock", "runs": sizes[0], "steps": STEPS, "gc": "tuned", "profile": 14},
    )
    progress("profiling interlock (memory)", 1.0)
    memory = run_child(
        "benchmarks.bench_concurrency",
        {
            "runtime": "interlock",
            "runs": 300 if quick else 3_000,
            "steps": STEPS,
            "gc": "tuned",
            "memory_profile": 12,
        },
    )
    return {
        "sizes": list(sizes),
        "steps": STEPS,
        "tuned_threshold": list(TUNED_THRESHOLD),
        "rows": rows,
        "profile": prof["profile"],
        "profile_areas": prof["profile_areas"],
        "profile_runs": sizes[0],
        "memory_profile": memory,
    }


def find(results: dict[str, Any], label: str, runs: int) -> dict[str, Any] | None:
    """The row of configuration ``label`` at ``runs`` runs, if it was measured."""
    for row in results["rows"]:
        if row["label"] == label and row["runs"] == runs:
            return row
    return None


if __name__ == "__main__":
    child_main(_child)


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    body = []
    for size in results["sizes"]:
        trio_row = find(results, "bare trio", size)
        asyncio_row = find(results, "bare asyncio", size)
        for row in (r for r in results["rows"] if r["runs"] == size):
            body.append(
                (
                    f"{size:,}",
                    row["label"],
                    num(row["wall_s"], 2),
                    ratio(row["wall_s"] / trio_row["wall_s"]) if trio_row else "–",
                    ratio(row["wall_s"] / asyncio_row["wall_s"]) if asyncio_row else "–",
                    num(row["cpu_s"], 2),
                    ratio(row["cpu_s"] / trio_row["cpu_s"]) if trio_row else "–",
                    num(row["gc_s"], 2),
                    "/".join(str(c) for c in row["gc_collections"]),
                    num(row["peak_rss_mib"], 0),
                    num(row["rss_per_run_kib"], 1),
                    num(row.get("journal_mib"), 0),
                )
            )
    skipped = [
        f"{label} at {size:,}"
        for size in results["sizes"]
        for label, _runtime, _mode, only in CONFIGS
        if only is not None and size not in only
    ]
    note = (
        f" Not run at these sizes, to keep the suite's time down: {', '.join(skipped)}."
        if skipped
        else ""
    )
    memory = results.get("memory_profile")
    memory_lines = []
    if memory:
        memory_lines = [
            "",
            f"Where live memory is, half-way through {memory['runs']:,} runs (tracemalloc, "
            f"{memory['traced_kib_per_run']:.1f} KiB traced per run; RSS adds allocator overhead):",
            "",
            table(
                ["allocation site", "KiB per run", "objects per run", "share"],
                [
                    (
                        f"`{r['site']}`",
                        f"{r['kib_per_run']:.2f}",
                        f"{r['objects_per_run']:.1f}",
                        f"{r['share']:.0%}",
                    )
                    for r in memory["sites"]
                ],
            ),
        ]
    return "\n".join(
        [
            f"Each run makes {results['steps']} model calls with 5-20 ms simulated latency (9 verified "
            "tool calls + a move to DONE); each configuration runs in its own subprocess. *tuned gc*: "
            f"`gc.set_threshold{tuple(results['tuned_threshold'])}` at start and `gc.freeze()` once "
            "every run has started, applied from the benchmark. GC columns: CPU seconds inside the "
            "collector and passes per generation (0/1/2). RSS per run = (peak RSS − RSS before the "
            "runs) ÷ runs; *journal* is the framed bytes written (held in the process only by the MemoryStore)."
            + note,
            "",
            table(
                [
                    "runs",
                    "configuration",
                    "wall s",
                    "× bare trio",
                    "× bare asyncio",
                    "CPU s",
                    "CPU × bare trio",
                    "GC CPU s",
                    "GC passes",
                    "peak RSS MiB",
                    "RSS/run KiB",
                    "journal MiB",
                ],
                body,
            ),
            *memory_lines,
        ]
    )
