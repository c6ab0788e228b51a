"""What one live run costs in memory: the concurrency benchmark's workload (10 steps, each a
model call of 5-20 ms through ScriptedProvider, the no-op idempotent tool, a SQLite journal,
the tuned collector), measured two ways, each in its own subprocess:

- ``profile``: ``runs`` runs under tracemalloc, snapshot once half of the run's events are
  journaled (every run live, waiting for the model): traced bytes per run by allocation
  site, and live objects per run by type (``gc.get_objects`` plus untracked slot objects
  reached from the supervisor's tables, sized with ``sys.getsizeof``);
- ``rss``: ``runs`` runs without tracing: peak RSS (``VmHWM``), wall and CPU, against bare
  trio doing only the sleeps (``--bare``).

Usage::

    python -m benchmarks.run_memory profile 10000
    python -m benchmarks.run_memory rss 100000 [--bare]
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from collections import Counter
from typing import Any

from benchmarks import bench_concurrency as bc
from benchmarks._harness import peak_rss_kib, rss_kib, run_child, short_path

STEPS = bc.STEPS


def _types_per_run(runs: int) -> list[tuple[str, float, float]]:
    """Live objects by type: (type, objects per run, bytes per run), gc-tracked ones
    (strings, bytes, ints and slot-less structs without references are not listed)."""
    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        count[name] += 1
        size[name] += sys.getsizeof(obj)
    rows = [(name, count[name] / runs, size[name] / runs) for name in size]
    rows.sort(key=lambda r: -r[2])
    return rows[:30]


def _profile(runs: int) -> dict[str, Any]:
    import tracemalloc

    import trio

    gc.set_threshold(*bc.TUNED_THRESHOLD)
    tracemalloc.start(1)
    holder: dict[str, Any] = {}
    original = bc._snapshot_when

    async def snapshot_when(supervisor: Any, events: float) -> Any:
        while supervisor.statistics().events < events:  # noqa: ASYNC110
            await trio.sleep(0.005)
        gc.unfreeze()  # the objects frozen at start-up are live too: count them
        holder["types"] = _types_per_run(runs)
        gc.freeze()
        return tracemalloc.take_snapshot()

    bc._snapshot_when = snapshot_when
    try:
        extra = bc._run_interlock(
            runs, STEPS, True, snapshot_at=float(__import__("os").environ.get("SNAP_AT", "0.5"))
        )
    finally:
        bc._snapshot_when = original
    tracemalloc.stop()
    snapshot = extra["snapshot"].filter_traces(
        [tracemalloc.Filter(False, "<frozen *>"), tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    stats = snapshot.statistics("lineno")
    total = sum(stat.size for stat in stats)
    sites = [
        (
            f"{short_path(s.traceback[0].filename)}:{s.traceback[0].lineno}",
            s.size / runs,
            s.count / runs,
        )
        for s in stats[:25]
    ]
    return {"runs": runs, "traced_per_run": total / runs, "sites": sites, "types": holder["types"]}


def _rss(runs: int, bare: bool) -> dict[str, Any]:
    gc.set_threshold(*bc.TUNED_THRESHOLD)
    import trio  # noqa: F401

    import interlock.providers
    import interlock.stores  # noqa: F401

    gc.collect()
    baseline = rss_kib()
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:  # RSS over the run, to see when the peak comes
        while not stop.wait(1.0):
            samples.append((round(time.perf_counter() - wall, 1), round(rss_kib() / 1024)))

    cpu, wall = time.process_time(), time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if bare:
        bc._run_trio(runs, STEPS, True)
    else:
        bc._run_interlock(runs, STEPS, True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stop.set()
    peak = peak_rss_kib()
    return {
        "runs": runs,
        "bare": bare,
        "wall_s": wall,
        "cpu_s": cpu,
        "baseline_mib": baseline / 1024,
        "peak_mib": peak / 1024,
        "per_run_kib": (peak - baseline) / runs,
        "rss_mib_over_time": samples[:: max(1, len(samples) // 12)],
    }


def _child(config: dict[str, Any]) -> dict[str, Any]:
    if config["mode"] == "profile":
        return _profile(config["runs"])
    return _rss(config["runs"], config.get("bare", False))


def _loop(runs: int, before: str, rounds: int = 5) -> None:
    """The loop benchmark's µs per step, this checkout against the tree ``before`` (a
    ``src`` directory), interleaved in fresh processes; the median of each, and their ratio."""
    import statistics

    configs = {
        "sequential": {"runs": runs, "concurrent": False, "provider": "scripted", "tuned": False},
        "concurrent": {
            "runs": 5 * runs,
            "concurrent": True,
            "provider": "scripted",
            "tuned": False,
        },
    }
    for label, config in configs.items():
        samples: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(rounds):
            for which in ("before", "after"):
                env = {"PYTHONPATH": before} if which == "before" else None
                row = run_child("benchmarks.bench_loop", config, env=env)
                samples[which].append(row["cpu_us_per_step"])
        b, a = (statistics.median(samples[k]) for k in ("before", "after"))
        print(
            f"{label}: CPU µs/step before {b:.1f} (runs {sorted(round(x) for x in samples['before'])}), "
            f"after {a:.1f} (runs {sorted(round(x) for x in samples['after'])}), after/before {a / b:.3f}"
        )


def _wall(runs: int, before: str, rounds: int = 3) -> None:
    """Wall time and peak RSS of ``runs`` runs: bare trio, interlock at ``before`` and
    this checkout, interlock's both as ratios to bare trio of the same round."""
    import statistics

    rows: dict[str, list[dict[str, Any]]] = {"bare trio": [], "before": [], "after": []}
    for _ in range(rounds):
        for label in rows:
            config = {"mode": "rss", "runs": runs, "bare": label == "bare trio"}
            env = {"PYTHONPATH": before} if label == "before" else None
            rows[label].append(run_child("benchmarks.run_memory", config, env=env, timeout=3600))
    for label, results in rows.items():
        ratios = [
            r["wall_s"] / b["wall_s"] for r, b in zip(results, rows["bare trio"], strict=True)
        ]
        print(
            f"{label}: wall s {statistics.median(r['wall_s'] for r in results):.2f}, "
            f"x bare trio {statistics.median(ratios):.2f} (rounds {[round(x, 2) for x in ratios]}), "
            f"peak RSS MiB {statistics.median(r['peak_mib'] for r in results):.0f}"
        )


def main(argv: list[str]) -> None:
    mode, runs = argv[1], int(argv[2])
    if mode == "wall":
        _wall(runs, argv[argv.index("--src") + 1])
        return
    if mode == "loop":
        _loop(runs, argv[argv.index("--src") + 1])
        return
    env = {"PYTHONPATH": argv[argv.index("--src") + 1]} if "--src" in argv else None
    result = run_child(
        "benchmarks.run_memory",
        {"mode": mode, "runs": runs, "bare": "--bare" in argv},
        env=env,
        timeout=3600,
    )
    if mode == "profile":
        print(f"{runs:,} runs, {result['traced_per_run']:,.0f} B traced per run")
        print("\nallocation site | B/run | objects/run")
        for site, size, count in result["sites"]:
            print(f"{site} | {size:,.0f} | {count:.1f}")
        print("\ntype (gc-tracked) | objects/run | B/run (getsizeof)")
        for name, count, size in result["types"]:
            print(f"{name} | {count:.2f} | {size:,.0f}")
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        from benchmarks._harness import child_main

        child_main(_child)
    else:
        main(sys.argv)
