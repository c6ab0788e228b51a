"""The report: the machine and versions, Markdown tables, and the PNG charts."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import ROOT

PACKAGES = (
    "interlock",
    "trio",
    "msgspec",
    "pydantic",
    "pydantic-core",
    "Cython",
    "matplotlib",
    "rich",
)


def environment() -> dict[str, Any]:
    """The machine, the interpreter, the package versions and the hot path in use."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": _ram_gib(),
        "load_average": _load_average(),
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "versions": {name: _version(name) for name in PACKAGES},
        "hot_path": hot_path(),
        "git": _git(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def hot_path() -> dict[str, Any]:
    """Which hot path the selector picked, and whether the compiled module is up to date."""
    selector = importlib.import_module("interlock.core._hotpath")
    info: dict[str, Any] = {
        "selected": selector.IMPLEMENTATION,
        "no_extensions_env": bool(os.environ.get("INTERLOCK_NO_EXTENSIONS")),
    }
    try:
        compiled = importlib.import_module("interlock.core._hot")
    except ImportError as exc:
        info["compiled_module"] = f"not importable: {exc}"
        return info
    so = Path(compiled.__file__ or "")
    info["compiled_module"] = so.name
    pyx = ROOT / "ext" / "_hot.pyx"
    if so.exists() and pyx.exists():
        info["compiled_newer_than_pyx"] = so.stat().st_mtime >= pyx.stat().st_mtime
    # The decide path (ext/_decide.pyx): the run state and a step's accepted path.
    info["decide"] = importlib.import_module("interlock.core._view").DECIDE_IMPLEMENTATION
    decide_pyx = ROOT / "ext" / "_decide.pyx"
    if info["decide"] == "compiled" and decide_pyx.exists():
        decide_so = Path(importlib.import_module("interlock.core._decide").__file__ or "")
        info["decide_newer_than_pyx"] = decide_so.stat().st_mtime >= decide_pyx.stat().st_mtime
    return info


def _git() -> dict[str, Any]:
    def read(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except OSError:
            return ""

    # The suite's own outputs (RESULTS.md, results.json, the charts) do not count as
    # changes to the code measured: a previous run leaves them modified.
    outputs = (
        ":(exclude)benchmarks/RESULTS.md",
        ":(exclude)benchmarks/results.json",
        ":(exclude)benchmarks/*.png",
    )
    return {
        "commit": read("rev-parse", "--short", "HEAD"),
        "dirty": bool(read("status", "--porcelain", "--", ".", *outputs)),
    }


# -- Markdown ---------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table; ``align`` holds one of ``l``/``r`` per column (default: first left)."""
    align = align or "l" + "r" * (len(headers) - 1)
    marks = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(marks) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def num(value: float | None, digits: int = 1) -> str:
    """A number with thousands separators, or a dash."""
    if value is None or value != value:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def ratio(value: float | None) -> str:
    if value is None or value != value:
        return "–"
    return f"{value:.2f}×"


def environment_markdown(env: dict[str, Any], command: str, started: str, seconds: float) -> str:
    hot = env["hot_path"]
    fresh = hot.get("compiled_newer_than_pyx")
    freshness = (
        ""
        if fresh is None
        else (", built after ext/_hot.pyx" if fresh else ", OLDER than ext/_hot.pyx (stale build)")
    )
    lines = [
        f"- **Command:** `{command}`",
        f"- **Date:** {started} (the suite took {seconds:,.0f} s)",
        f"- **Machine:** {env['cpu']}, {env['cores']} cores, {env['ram_gib']:.1f} GiB RAM; "
        f"load average at start {', '.join(map(str, env['load_average']))}"
        + (
            f", at end {', '.join(map(str, env['load_average_end']))}"
            if env.get("load_average_end")
            else ""
        ),
        f"- **OS / Python:** {env['os']} / {env['python']}",
        "- **Versions:** " + ", ".join(f"{name} {v}" for name, v in env["versions"].items()),
        f"- **Hot path:** `interlock.core._hotpath` selected **{hot['selected']}**"
        f" (`{hot.get('compiled_module', '?')}`{freshness})"
        + (
            f"; the decide path (ext/_decide.pyx): **{hot['decide']}**"
            + ("" if hot.get("decide_newer_than_pyx", True) else " (OLDER than its .pyx: stale)")
            if "decide" in hot
            else ""
        ),
        f"- **Checkout:** {env['git'].get('commit') or 'unknown'}"
        + (" with uncommitted changes" if env["git"].get("dirty") else ""),
    ]
    return "\n".join(lines)


# -- charts -------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart_verify(results: dict[str, Any], path: Path) -> None:
    """Bars of µs per proposal (p50 of batches, whisker to p99) and per-call CDFs."""
    plt = _pyplot()
    rows = {k: v for k, v in results["rows"].items() if "child" not in k}
    labels = list(rows)
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    p50 = [rows[k]["batch"]["p50"] for k in labels]
    p99 = [rows[k]["batch"]["p99"] for k in labels]
    colors = ["#1f77b4", "#aec7e8", "#ff7f0e", "#2ca02c", "#9467bd"]
    bars.barh(
        labels,
        p50,
        xerr=[[0] * len(p50), [b - a for a, b in zip(p50, p99, strict=True)]],
        color=colors[: len(labels)],
        capsize=4,
    )
    bars.invert_yaxis()
    bars.set_xlabel("µs per proposal (batch mean: bar p50, whisker p99)")
    bars.set_title("Verification latency by implementation")
    for y, (value, high) in enumerate(zip(p50, p99, strict=True)):
        bars.text(high, y, f"  {value:.2f} µs", va="center")
    bars.set_xlim(0, max(p99) * 1.25)
    for label, color in zip(labels, colors, strict=False):
        sample = rows[label].get("calls_sample") or []
        if sample:
            ys = [(i + 1) / len(sample) for i in range(len(sample))]
            cdf.plot(sample, ys, label=label, color=color)
    cdf.set_xscale("log")
    cdf.set_xlabel("µs per call (one call at a time)")
    cdf.set_ylabel("share of calls")
    cdf.set_title("Per-call latency (CDF, 5% malformed)")
    cdf.legend(fontsize=8)
    cdf.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_concurrency(results: dict[str, Any], path: Path) -> None:
    """Wall time, CPU seconds and peak RSS against the number of concurrent runs."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = list(dict.fromkeys(row["label"] for row in results["rows"]))
    for label in labels:
        rows = sorted((r for r in results["rows"] if r["label"] == label), key=lambda r: r["runs"])
        xs = [r["runs"] for r in rows]
        for axis, key in zip(axes, ("wall_s", "cpu_s", "peak_rss_mib"), strict=True):
            axis.plot(xs, [r[key] for r in rows], marker="o", label=label)
    titles = ("Wall time (s)", "CPU time (s)", "Peak RSS (MiB)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("concurrent runs (10 steps, 5-20 ms model latency each)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    axes[2].axhline(2048, color="red", linestyle="--", linewidth=1, label="goal: 2 GiB")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_journal(results: dict[str, Any], path: Path) -> None:
    """Events per second against batch size, by store and durability."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(8, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in results["rows"]:
        if row.get("mix", "real") != "real" or row["store"].startswith("SQLite, one insert"):
            continue
        series.setdefault(f"{row['store']} ({row['sync']})", []).append(
            (row["batch"], row["events_per_s"])
        )
    for label, points in series.items():
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    for row in results["rows"]:
        if row["store"].startswith("SQLite, one insert"):
            axis.scatter(
                [1],
                [row["events_per_s"]],
                marker="x",
                s=60,
                label=f"one insert per commit ({row['sync']})",
            )
    axis.axhline(200_000, color="red", linestyle="--", linewidth=1, label="goal NORMAL: 200k/s")
    axis.axhline(100_000, color="orange", linestyle="--", linewidth=1, label="goal FULL: 100k/s")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("events per append (batch size)")
    axis.set_ylabel("events per second")
    axis.set_title("Journal append + flush throughput")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line() -> str:
    """The command as typed: ``python -m benchmarks`` and its arguments."""
    return " ".join(["python -m benchmarks", *sys.argv[1:]])
