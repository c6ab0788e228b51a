"""Run the benchmark suite and write RESULTS.md, results.json and the charts.

Usage: ``python -m benchmarks [--quick] [--only NAME,...] [--merge] [--out DIR]``; a quick run
writes to :data:`QUICK_OUT` unless ``--out`` says otherwise, so it never overwrites the committed
figures. ``--merge`` runs the named sections and puts their figures into the existing
``results.json`` beside the others', each merged section marked with its own run's command,
date, load and checkout in RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from benchmarks import HERE, available, load, run_section
from benchmarks._goals import evaluate
from benchmarks._report import (
    chart_concurrency,
    chart_journal,
    chart_verify,
    command_line,
    environment,
    environment_markdown,
    table,
)

CHARTS = {
    "verify": ("verify_latency.png", "Verification latency by implementation", chart_verify),
    "concurrency": (
        "concurrency.png",
        "Wall time, CPU and peak RSS against concurrent runs",
        chart_concurrency,
    ),
    "journal": ("journal.png", "Journal throughput against batch size", chart_journal),
}

#: Where ``--quick`` writes without ``--out``: smoke-run figures must not replace RESULTS.md.
QUICK_OUT = Path(tempfile.gettempdir()) / "interlock-benchmarks-quick"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run interlock's benchmarks; write RESULTS.md, results.json and PNG charts.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small N, seconds: checks the runner works"
    )
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: replace those sections in OUT/results.json (the rest stay as they "
        "were run) and rewrite RESULTS.md; each merged section says when and how it ran",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="run nothing: re-evaluate the goals and rewrite RESULTS.md from OUT/results.json",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"output directory (default: benchmarks/; for --quick, {QUICK_OUT})",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = QUICK_OUT if args.quick and not args.render else HERE
    names = available()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown == ["scaleout"]:
            parser.error("the scaleout benchmark needs PostgreSQL: set INTERLOCK_PG_DSN")
        if unknown:
            parser.error(f"unknown benchmark {unknown[0]!r}; choose from: {', '.join(names)}")
        names = [n for n in names if n in wanted]
    args.names = names
    if args.merge and (not args.only or args.quick or args.render):
        parser.error("--merge needs --only NAME,... and a full run (no --quick, no --render)")
    return args


#: Sections by how long their quick runs take (longest first), for the parallel quick run.
_QUICK_ORDER = ("instructions", "scaleout", "gateway", "concurrency", "peers", "providers")


def run_quick(names: list[str], console: Console) -> dict[str, Any]:
    """A quick run: the sections two at a time, each in a process of its own.

    A quick run only checks that every section works (its figures are never read), so
    nothing is lost by sharing the cores; the test suite runs it, and this halves its wait.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ordered = sorted(names, key=lambda n: _QUICK_ORDER.index(n) if n in _QUICK_ORDER else 99)
    results: dict[str, Any] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        futures = {name: pool.submit(run_section, name, True) for name in ordered}
        for name in ordered:
            results[name] = futures[name].result()
            if "error" in results[name]:
                console.print(f"[red]{name} failed:[/red] {results[name]['error']}")
            else:
                console.print(f"{name:<12} done in {results[name]['seconds']:.0f} s")
    return {name: results[name] for name in names}


def run_all(names: list[str], quick: bool, console: Console) -> dict[str, Any]:
    if quick and len(names) > 1:
        return run_quick(names, console)
    results: dict[str, Any] = {}
    columns = (
        TextColumn("[bold]{task.fields[bench]:<12}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("", total=len(names), bench="suite")
        for name in names:
            task = progress.add_task("starting", total=1.0, bench=name)

            def report(description: str, fraction: float, task: Any = task) -> None:
                progress.update(task, description=description, completed=min(1.0, fraction))

            started = time.perf_counter()
            try:
                results[name] = load(name).run(quick, report)
            except Exception as exc:
                results[name] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
                console.print(f"[red]{name} failed:[/red] {exc}")
            results[name]["seconds"] = time.perf_counter() - started
            progress.update(
                task, completed=1.0, description=f"done in {results[name]['seconds']:.0f} s"
            )
            progress.advance(overall)
    return results


def write_charts(results: dict[str, Any], out: Path) -> dict[str, str]:
    """Draw the charts of the benchmarks that ran; none without matplotlib (the bench extra)."""
    written: dict[str, str] = {}
    if importlib.util.find_spec("matplotlib") is None:
        return written
    for name, (filename, _title, draw) in CHARTS.items():
        if name in results and "error" not in results[name]:
            draw(results[name], out / filename)
            written[name] = filename
    return written


def _status(met: bool | None) -> str:
    return {True: "✅ met", False: "❌ missed", None: "– not measured"}[met]


def goals_markdown(goals: list[dict[str, Any]]) -> str:
    lines = [
        table(
            ["goal", "measured", "status", "missed by"],
            [(g["goal"], g["measured"], _status(g["met"]), g["margin"] or "") for g in goals],
            align="llll",
        )
    ]
    seen: dict[str, str] = {}
    for goal in goals:
        if goal["met"] is not False and not goal["notes"]:
            continue
        lines += ["", f"**{goal['goal']}** — {_status(goal['met'])}"]
        if goal.get("how"):
            lines.append(f"- Measured: {goal['how']}.")
        lines += [f"- {note}" for note in goal["notes"]]
        closing = goal.get("closing")
        if closing in seen:
            lines.append(f"- Profile and what would close it: as for *{seen[closing]}* above.")
            continue
        if closing:
            seen[closing] = goal["goal"]
        if goal.get("profile"):
            top = goal["profile"][:8]
            lines.append(
                f"- Profile ({goal.get('profile_label', 'cProfile')}): "
                + "; ".join(f"`{row['function']}` {row['own_share']:.0%}" for row in top)
                + "."
            )
        if goal.get("closing"):
            lines.append(f"- What would close it: {goal['closing']}")
    return "\n".join(lines)


def profile_markdown(rows: list[dict[str, Any]]) -> str:
    return table(
        ["function", "calls", "own s", "cumulative s", "own share"],
        [
            (
                f"`{r['function']}`",
                f"{r['calls']:,}",
                f"{r['own_s']:.3f}",
                f"{r['cum_s']:.3f}",
                f"{r['own_share']:.1%}",
            )
            for r in rows
        ],
    )


def write_markdown(
    results: dict[str, Any],
    goals: list[dict[str, Any]],
    charts: dict[str, str],
    meta: dict[str, Any],
    out: Path,
    no_charts: str = "matplotlib is not installed (`pip install -e '.[bench]'`)",
) -> None:
    """Write RESULTS.md; ``no_charts`` says why, if no chart is linked."""
    mode = "quick (small N: checks the runner, not figures to quote)" if meta["quick"] else "full"
    parts = [
        "# interlock benchmarks",
        "",
        f"Written by `python -m benchmarks` ({mode}). Figures are from one run on a shared host; "
        "compare the ratios within this file, not with other machines. Each section's module "
        "docstring (`benchmarks/bench_<name>.py`) says exactly what is measured.",
        "",
        environment_markdown(meta["environment"], meta["command"], meta["date"], meta["seconds"]),
        "",
        "## Goals",
        "",
        goals_markdown(goals) if goals else "No goal's benchmark ran.",
    ]
    if not charts and any(name in CHARTS for name in meta["benchmarks"]):
        parts += [
            "",
            f"*Charts skipped: {no_charts}.*",
        ]
    for name in meta["benchmarks"]:
        module = load(name)
        result = results[name]
        parts += ["", f"## {module.TITLE}", ""]
        if "error" in result:
            parts += [
                f"**Failed:** `{result['error']}`",
                "",
                "```",
                result["traceback"].rstrip(),
                "```",
            ]
            continue
        merged = result.get("merged")
        if merged:
            env = merged["environment"]
            parts += [
                f"*This section was run on its own, after the rest: `{merged['command']}` on "
                f"{merged['date']} ({merged['seconds']:,.0f} s), checkout "
                f"{env['git'].get('commit') or 'unknown'}"
                + (" with uncommitted changes" if env["git"].get("dirty") else "")
                + f", on {env['cpu']} ({env['cores']} cores), load average at start "
                f"{', '.join(map(str, env['load_average']))}: compare its ratios within it.*",
                "",
            ]
        parts.append(module.render(result))
        if name in charts:
            parts += ["", f"![{CHARTS[name][1]}]({charts[name]})"]
        for key, label in (
            ("profile", "Profile"),
            ("profile_pure", "Profile of the pure-Python gate"),
        ):
            if result.get(key):
                parts += [
                    "",
                    "<details><summary>"
                    + label
                    + " (cProfile, top functions by own time)</summary>",
                    "",
                    profile_markdown(result[key]),
                    "",
                    "</details>",
                ]
        parts += ["", f"*{result['seconds']:.0f} s.*"]
    (out / "RESULTS.md").write_text("\n".join(parts) + "\n", encoding="utf-8")


def render_again(out: Path, console: Console) -> int:
    """Rewrite RESULTS.md (and the goals in results.json) from the figures already recorded."""
    path = out / "results.json"
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
        meta, results = recorded["meta"], recorded["benchmarks"]
    except (OSError, ValueError, KeyError) as exc:
        console.print(f"[red]cannot render: {path}: {exc}[/red] (run the benchmarks first)")
        return 2
    goals = evaluate(results)
    charts = {name: entry[0] for name, entry in CHARTS.items() if (out / entry[0]).exists()}
    recorded["goals"] = goals
    path.write_text(json.dumps(recorded, indent=1, default=str) + "\n", encoding="utf-8")
    write_markdown(
        results,
        goals,
        charts,
        meta,
        out,
        no_charts=f"none of the charts is in {out}; a run of the benchmarks draws them",
    )
    console.print(f"rewrote {out / 'RESULTS.md'} from {path} (figures of {meta['date']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    if args.render:
        return render_again(out, console)
    meta: dict[str, Any] = {
        "command": command_line(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": args.quick,
        "benchmarks": args.names,
        "environment": environment(),
    }
    recorded = None
    if args.merge:  # read before running: a merge with nothing to merge into runs nothing
        path = out / "results.json"
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(recorded["meta"]["benchmarks"], list) or not recorded["benchmarks"]:
                raise ValueError("it holds no recorded sections")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            console.print(f"[red]cannot merge into {path}: {exc}[/red] (run the whole suite first)")
            return 2
    console.print(
        f"[bold]interlock benchmarks[/bold] ({'quick' if args.quick else 'full'}): {', '.join(args.names)}"
    )
    if out == QUICK_OUT:
        console.print(f"quick run: writing to {out}, not benchmarks/ (--out DIR to choose)")
    started = time.perf_counter()
    results = run_all(args.names, args.quick, console)
    seconds = meta["seconds"] = time.perf_counter() - started
    meta["environment"]["load_average_end"] = environment()["load_average"]
    if recorded is not None:
        for name in args.names:
            section = results[name]
            carry = getattr(load(name), "carry", None)
            previous = recorded["benchmarks"].get(name)
            if carry is not None and "error" not in section:  # it keeps its earlier runs
                section = carry(previous if previous and "error" not in previous else {}, section)
            recorded["benchmarks"][name] = {**section, "merged": meta}
            if name not in recorded["meta"]["benchmarks"]:
                recorded["meta"]["benchmarks"].append(name)
        meta, results = recorded["meta"], recorded["benchmarks"]
    goals = evaluate(results)
    charts = write_charts(results, out)
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "goals": goals, "benchmarks": results}, indent=1, default=str)
        + "\n",
        encoding="utf-8",
    )
    write_markdown(results, goals, charts, meta, out)
    failed = [name for name in args.names if "error" in results[name]]
    console.print(
        # NOTE: this run's time; a merge's meta is the recorded whole run's (its seconds too)
        f"wrote {out / 'RESULTS.md'}, {out / 'results.json'} and {len(charts)} chart(s) in {seconds:.0f} s"
    )
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}[/red]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
