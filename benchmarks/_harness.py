"""Timing, statistics, subprocess and profiling helpers shared by the benchmark modules."""

from __future__ import annotations

import cProfile
import gc
import io
import json
import os
import pstats
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The directory holding the ``benchmarks`` package: subprocesses run from here.
ROOT = Path(__file__).resolve().parent.parent
#: Marks the one line of a child process's stdout that carries its JSON result.
RESULT_MARK = "@@result "

Progress = Callable[[str, float], None]
"""``progress(description, fraction_done)``: how a benchmark reports where it is."""


def no_progress(description: str, fraction: float) -> None:
    """A progress callback that ignores everything."""


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank on the sorted values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50, p99, mean, min and max of ``values``."""
    return {
        "p50": quantile(values, 0.50),
        "p99": quantile(values, 0.99),
        "mean": sum(values) / len(values) if values else float("nan"),
        "min": min(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
    }


def time_batches(
    fn: Callable[[Sequence[Any]], object],
    items: Sequence[Any],
    batch: int,
    rounds: int,
) -> list[float]:
    """Time ``fn(chunk)`` over ``items`` in chunks of ``batch``; return ns per item per chunk.

    The collector is paused while timing (and run between rounds) so that a
    collection triggered by an earlier benchmark's garbage does not land in a batch.
    """
    chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
    per_item: list[float] = []
    enabled = gc.isenabled()
    try:
        for _ in range(rounds):
            gc.collect()
            gc.disable()
            for chunk in chunks:
                started = time.perf_counter_ns()
                fn(chunk)
                per_item.append((time.perf_counter_ns() - started) / len(chunk))
            if enabled:
                gc.enable()
    finally:
        if enabled:
            gc.enable()
    return per_item


def time_each(fn: Callable[[Any], object], items: Iterable[Any], rounds: int) -> list[float]:
    """Time ``fn(item)`` one call at a time; return ns per call (timer overhead subtracted)."""
    timer = time.perf_counter_ns
    overhead = _timer_overhead()
    samples: list[float] = []
    items = list(items)
    for _ in range(rounds):
        gc.collect()
        for item in items:
            started = timer()
            fn(item)
            samples.append(max(0.0, timer() - started - overhead))
    return samples


def _timer_overhead() -> float:
    timer = time.perf_counter_ns
    costs = []
    for _ in range(2000):
        started = timer()
        costs.append(timer() - started)
    return quantile(costs, 0.5)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark child: this checkout first on the path, the
    compiled hot path allowed (a child that wants the twin sets it in ``extra``)."""
    env = dict(os.environ)
    env.pop("INTERLOCK_NO_EXTENSIONS", None)
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_child(
    module: str, config: dict[str, Any], *, env: dict[str, str] | None = None, timeout: float = 900
) -> dict[str, Any]:
    """Run ``python -m module --child CONFIG`` and return the JSON it reports.

    Raises:
      RuntimeError: the child failed or reported nothing; the message holds its stderr.
    """
    proc = subprocess.run(
        [sys.executable, "-m", module, "--child", json.dumps(config)],
        cwd=ROOT,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            return result
    raise RuntimeError(
        f"{module} child {config} exited {proc.returncode} without a result:\n{proc.stderr[-4000:]}"
    )


_INSTRUCTIONS = re.compile(r"I\s+refs:\s+([\d,]+)")


def child_instructions(
    valgrind: str,
    module: str,
    config: dict[str, Any],
    what: str,
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    timeout: float = 1800,
) -> int:
    """Instructions executed by ``python -m module --child CONFIG`` under cachegrind (every
    thread of the process); ``what`` names the run in the error.

    Raises:
      RuntimeError: the child failed, or valgrind printed no count.
    """
    proc = subprocess.run(
        [
            valgrind,
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            sys.executable,
            "-m",
            module,
            "--child",
            json.dumps(config),
        ],
        cwd=cwd,
        env=child_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    match = _INSTRUCTIONS.search(proc.stderr)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(
            f"valgrind on {what} exited {proc.returncode}: {proc.stderr.strip()[-800:]}"
        )
    return int(match.group(1).replace(",", ""))


def child_main(handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The entry point of a module run as a child: ``--child CONFIG`` -> one result line."""
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit(f"usage: python -m {__package__}.<module> --child JSON")
    result = handler(json.loads(sys.argv[2]))
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_alone(
    module: str,
    run: Callable[[bool, Progress], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    argv: Sequence[str],
) -> dict[str, Any]:
    """``python -m benchmarks.MODULE [--quick]``: run one section outside the suite, print
    its tables and the command that produced them, and return its results."""
    quick = "--quick" in argv[1:]

    def show(description: str, fraction: float) -> None:
        sys.stderr.write(f"[{fraction:4.0%}] {description}\n")

    started = time.perf_counter()
    results = run(quick, show)
    print(render(results))
    print(
        f"\n`python -m benchmarks.{module}{' --quick' if quick else ''}` "
        f"({time.perf_counter() - started:.0f} s)"
    )
    return results


@dataclass
class Profile:
    """The heaviest functions of a cProfile run, as rows for RESULTS.md, and own time by area."""

    total_seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    areas: dict[str, float] = field(default_factory=dict)
    """Share of all own time by area (an interlock module, trio, msgspec, sqlite3, ...)."""
    calls: int = 0
    """Every call cProfile saw: Python functions and the C functions called from Python."""


def profile(fn: Callable[[], object], *, top: int = 12, sort: str = "tottime") -> Profile:
    """Run ``fn`` under cProfile; return its ``top`` functions by ``sort`` (own time)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in raw.values())
    ranked = sorted(raw.items(), key=lambda kv: kv[1][2 if sort == "tottime" else 3], reverse=True)
    areas: dict[str, float] = {}
    for (filename, _line, name), entry in raw.items():
        area = area_of(filename, name)
        areas[area] = areas.get(area, 0.0) + entry[2] / (total or 1.0)
    rows = []
    for (filename, line, name), (_cc, calls, own, cumulative, _callers) in ranked[:top]:
        rows.append(
            {
                "function": f"{short_path(filename)}:{line}({name})",
                "calls": calls,
                "own_s": own,
                "cum_s": cumulative,
                "own_share": own / total if total else 0.0,
            }
        )
    ordered = dict(sorted(areas.items(), key=lambda kv: kv[1], reverse=True))
    calls = sum(entry[1] for entry in raw.values())
    return Profile(total, rows, ordered, calls)


def area_of(filename: str, name: str) -> str:
    """Where a profiled function lives: ``interlock/core/_gate.py``, ``trio``, ``msgspec``, ..."""
    if "/interlock/" in filename:
        return "interlock/" + filename.split("/interlock/", 1)[1]
    if "/benchmarks/" in filename:
        return "benchmark code (guard, harness)"
    for package in ("trio", "outcome", "sniffio", "prometheus_client"):
        if f"/{package}/" in filename or f"<attrs generated methods {package}." in filename:
            return "trio" if package in ("trio", "outcome", "sniffio") else package
    if filename == "~":
        for package in ("msgspec", "sqlite3", "select", "_hashlib", "zlib", "gc"):
            if package in name:
                return {"select": "trio", "_hashlib": "hashlib"}.get(package, package)
        return "Python builtins"
    return "Python stdlib"


def top_areas(areas: dict[str, float], count: int = 6) -> str:
    """``area 31%, area 12%, ...`` for the ``count`` largest areas."""
    return ", ".join(f"{area} {share:.0%}" for area, share in list(areas.items())[:count])


def short_path(filename: str) -> str:
    for marker in ("/site-packages/", "/src/", "/lib/python3."):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker != "/lib/python3." else "stdlib/" + tail.split("/", 1)[-1]
    if filename.startswith("~"):
        return "builtin"
    return Path(filename).name


def profile_rows(prof: Profile) -> list[dict[str, Any]]:
    """A profile as JSON-ready rows."""
    return [dict(row) for row in prof.rows]


def peak_rss_kib() -> int:
    """The peak resident set size of this process (``VmHWM``), in KiB.

    NOTE: not ``ru_maxrss``: on Linux that survives ``exec``, so a child started by a
    big parent reports at least the parent's RSS at fork time.
    """
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def rss_kib() -> int:
    """The current resident set size of this process, in KiB."""
    with open("/proc/self/statm") as file:
        pages = int(file.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


class GCTimer:
    """Counts the collector's passes and the CPU seconds it spends, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.seconds += time.process_time() - self._started
            self.collections[info["generation"]] += 1

    def __enter__(self) -> GCTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)
