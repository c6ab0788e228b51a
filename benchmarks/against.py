"""Before and after: the same five workloads on an earlier commit and on this checkout.

``python -m benchmarks.against --against REV [--rounds N] [--quick] [--write]``

1. Builds REV into a throwaway directory (``git archive`` into it, ``pip wheel`` of that
   tree, the wheel's ``interlock/`` unzipped into ``DIR/site``; nothing is installed) and
   keeps it for the next call. "After" is this checkout's ``src/`` with its compiled
   extensions (refused if one is missing or older than its ``ext/*.pyx``).
2. Runs each workload of :mod:`benchmarks._against_workloads` (the hosted step, the gate,
   the gateway's verify batch and channel, concurrent runs) as a subprocess against each
   tree, before and after in turns (the order flipped every round), over ``--rounds``
   rounds, so drift on a shared host hits both alike. Per figure: the median of each tree,
   and after/before as the median of the rounds' paired ratios, with their range.
3. Counts instructions (valgrind cachegrind, the same load at two sizes, differenced) on
   both trees: the step's and the gate's process, and the gateway server's process under
   the verify batches and the channel (a smaller load than the timed one: valgrind is
   slow). The figure a busy host does not move. ``--no-instructions`` skips them; they are
   most of a full run's time (the server's start-up under valgrind, eight times).
4. Prints a Markdown table; ``--write`` puts it into ``benchmarks/RESULTS.md`` as the section
   "Before and after the layers move (issue 34)" (replacing an earlier one).

Every figure is a cost (lower is better). A figure within 5% of before either way, or
faster, passes; a slower one is marked with by how much.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._results import write_section

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## Before and after the layers move (issue 34)"
MARK = "@@against "
TOLERANCE = 0.05
BUILDS = Path(tempfile.gettempdir()) / "interlock-against"


@dataclass(frozen=True)
class Count:
    """An instruction count: the workload at two configurations, differenced."""

    small: dict[str, Any]
    large: dict[str, Any]
    units: int
    """Steps or proposals the large configuration does more than the small one."""
    server: bool = False
    """Count the gateway's server process (the workload runs it under valgrind), not the
    workload's own process."""
    note: str = ""
    """How the counted load differs from the timed one (smaller: valgrind is slow)."""


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    figures: tuple[tuple[str, str], ...]
    """(key in the child's JSON, how the table names it)."""
    config: tuple[dict[str, Any], dict[str, Any]]
    """The child's arguments (quick, full)."""
    count: tuple[Count, Count] | None = None
    """Its instruction count (quick, full), or None."""
    per: str = ""


WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "step",
        "hosted step (20-step runs at once, MemoryStore)",
        (("us_per_step", "µs per step, wall"), ("cpu_us_per_step", "µs per step, CPU")),
        ({"size": 50}, {"size": 500}),
        (Count({"size": 0}, {"size": 50}, 50 * 20), Count({"size": 0}, {"size": 100}, 100 * 20)),
        "step",
    ),
    Workload(
        "gate",
        "gate (1,000 proposals, 5% malformed)",
        (("us_per_proposal", "µs per proposal"),),
        ({"size": 5}, {"size": 20}),
        (Count({"size": 1}, {"size": 3}, 2_000), Count({"size": 1}, {"size": 4}, 3_000)),
        "proposal",
    ),
    Workload(
        "verify_batch",
        "gateway verify batch (HTTP, SQLite)",
        (
            ("server_cpu_us_per_proposal", "server CPU µs per proposal"),
            ("wall_us_per_proposal", "wall µs per proposal"),
        ),
        ({"size": 100, "seconds": 1.0}, {"size": 1000, "seconds": 2.0}),
        (
            Count(
                {"size": 100, "batches": 1},
                {"size": 100, "batches": 3},
                400,
                True,
                "batches of 100",
            ),
            Count(
                {"size": 200, "batches": 1},
                {"size": 200, "batches": 3},
                800,
                True,
                "batches of 200",
            ),
        ),
        "proposal, server",
    ),
    Workload(
        "channel",
        "gateway channel (frames, SQLite)",
        (
            ("server_cpu_us_per_proposal", "server CPU µs per proposal"),
            ("wall_us_per_proposal", "wall µs per proposal"),
        ),
        ({"size": 200, "seconds": 1.0}, {"size": 1000, "seconds": 2.0}),
        (
            Count({"size": 200, "batches": 1}, {"size": 200, "batches": 3}, 400, True, "200 runs"),
            Count({"size": 500, "batches": 1}, {"size": 500, "batches": 3}, 1000, True, "500 runs"),
        ),
        "proposal, server",
    ),
    Workload(
        "concurrency",
        "concurrent runs (10 steps, 5-20 ms model, SQLite)",
        (("wall_s", "wall s"), ("cpu_s", "CPU s")),
        ({"size": 1_000}, {"size": 10_000}),
    ),
)


# -- the two trees ---------------------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def resolve(rev: str) -> str:
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        sys.exit(f"--against {rev!r}: not a commit of this repository (try a hash from git log)")


def build(commit: str, say: Any) -> Path:
    """``commit``'s package, compiled, in ``BUILDS/commit/site`` (built once, then reused)."""
    home = BUILDS / commit
    site, stamp = home / "site", home / "site" / ".built"
    if stamp.exists():
        return site
    shutil.rmtree(home, ignore_errors=True)
    source = home / "tree"
    source.mkdir(parents=True)
    say(f"building {commit[:9]} in {home} (a minute or two)")
    archive = subprocess.run(
        ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    wheels = home / "whl"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
        env={**os.environ, "CFLAGS": "-g0"},
        capture_output=True,
        text=True,
        check=False,
    )
    found = sorted(wheels.glob("interlock-*.whl"))
    if proc.returncode or not found:
        sys.exit(
            f"building {commit[:9]} failed (pip wheel exited {proc.returncode}):\n{proc.stderr}"
        )
    with zipfile.ZipFile(found[0]) as wheel:
        wheel.extractall(site, [n for n in wheel.namelist() if n.startswith("interlock/")])
    stamp.write_text(commit + "\n")
    shutil.rmtree(source)
    return site


def current_tree() -> Path:
    """This checkout's ``src``, refused if a compiled extension is missing or stale."""
    src = ROOT / "src"
    for pyx in sorted((ROOT / "ext").glob("*.pyx")):
        built = list((src / "interlock").rglob(f"{pyx.stem}.*.so"))
        if not built:
            sys.exit(
                f"this checkout has no compiled {pyx.stem} (from ext/{pyx.name}): copy or build "
                "it into src/interlock/ (see CONTRIBUTING: pip wheel, then unzip the .so files)"
            )
        if built[0].stat().st_mtime < pyx.stat().st_mtime:
            sys.exit(f"{built[0]} is older than ext/{pyx.name}: rebuild it before comparing")
    return src


def child_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("INTERLOCK_NO_EXTENSIONS", None)
    env["PYTHONPATH"] = os.pathsep.join((str(tree), str(ROOT)))
    return env


# -- running the workloads -------------------------------------------------------------------


def run_once(workload: Workload, config: dict[str, Any], tree: Path) -> dict[str, Any]:
    """One run of ``workload`` against ``tree`` in a fresh process: its figures."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks._against_workloads", workload.name, json.dumps(config)],
        cwd=ROOT,
        env=child_env(tree),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK) :])
            imported = Path(result["tree"]["interlock"])
            if imported.parent != tree:
                raise RuntimeError(
                    f"{workload.name} imported {imported}, not the tree under {tree}"
                )
            if not result["tree"]["compiled"]:
                raise RuntimeError(f"{workload.name} ran on {tree} without compiled extensions")
            figures: dict[str, Any] = result["figures"]
            return figures
    raise RuntimeError(
        f"{workload.name} on {tree} exited {proc.returncode} without figures:\n{proc.stderr[-3000:]}"
    )


_IREFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def instructions(
    valgrind: str, workload: Workload, config: dict[str, Any], server: bool, tree: Path
) -> int:
    """Instructions ``workload`` at ``config`` executes against ``tree`` (every thread): its
    own process's, or with ``server`` its gateway server's."""
    if server:
        return int(
            run_once(workload, {**config, "valgrind": valgrind}, tree)["server_instructions"]
        )
    proc = subprocess.run(
        [
            valgrind,
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks._against_workloads",
            workload.name,
            json.dumps(config),
        ],
        cwd=ROOT,
        env=child_env(tree),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    match = _IREFS.search(proc.stderr)
    if proc.returncode or match is None:
        raise RuntimeError(
            f"valgrind on {workload.name} {config} exited {proc.returncode}: {proc.stderr[-800:]}"
        )
    return int(match.group(1).replace(",", ""))


@dataclass
class Row:
    """One figure of one workload: the rounds' values before and after."""

    workload: str
    figure: str
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    counted: bool = False
    """Instructions (one count each), not timings."""


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def ratios(row: Row) -> list[float]:
    """after/before of each round (paired: the two runs of a round ran back to back)."""
    return [a / b for a, b in zip(row.after, row.before, strict=True) if b]


def verdict(ratio: float) -> str:
    """Pass within ``TOLERANCE`` of before (or faster); else say by how much it is slower."""
    if ratio != ratio:
        return "–"
    if ratio > 1 + TOLERANCE:
        return f"❌ {ratio - 1:.0%} slower"
    if ratio < 1 - TOLERANCE:
        return f"✅ {1 - ratio:.0%} faster"
    return f"✅ within 5% ({ratio - 1:+.1%})"


def fmt(value: float) -> str:
    if value != value:
        return "–"
    if abs(value) >= 1e5:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:,.1f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| workload | figure | before (median) | after (median) | after ÷ before | rounds' range | verdict |",
        "| :--- | :--- | ---: | ---: | ---: | ---: | :--- |",
    ]
    for row in rows:
        paired = ratios(row)
        ratio = median(paired)
        spread = f"{min(paired):.3f}–{max(paired):.3f}" if len(paired) > 1 else "–"
        lines.append(
            f"| {row.workload} | {row.figure} | {fmt(median(row.before))} | "
            f"{fmt(median(row.after))} | {ratio:.3f} | {spread} | {verdict(ratio)} |"
        )
    return "\n".join(lines)


# -- the report ------------------------------------------------------------------------------


def describe(commit: str) -> str:
    return git("log", "-1", "--format=%h (%s)", commit)[:110]


def checkout() -> str:
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src", "ext")
    return head + (" with uncommitted changes to src/ or ext/" if dirty else "")


def report(
    rows: list[Row], args: argparse.Namespace, commit: str, started: str, seconds: float, load: str
) -> str:
    command = "python -m benchmarks.against " + " ".join(args.argv)
    mode = (
        "quick: small sizes, few rounds; checks the tool, not figures to quote"
        if args.quick
        else "full"
    )
    return "\n".join(
        [
            SECTION,
            "",
            f"- **Command:** `{command}` ({mode})",
            f"- **Date:** {started} ({seconds:,.0f} s)",
            f"- **Before:** {describe(commit)}, built from the commit (`pip wheel`) with its "
            "compiled extensions",
            f"- **After:** this checkout, {checkout()}, `src/` with its compiled extensions",
            f"- **Machine:** {os.cpu_count()} cores, shared with other jobs; load average "
            f"{load}. Each round ran every workload before and after back to back (the order "
            f"flipped each round), {args.rounds} round(s), each run in a fresh process",
            "",
            "Every figure is a cost: lower is better. *after ÷ before* is the median of the "
            "rounds' paired ratios; the range shows how far the rounds spread, which on a busy "
            "host is often wider than 5%: the instruction counts (valgrind cachegrind, two "
            "sizes differenced, one count each) are the figure load does not move. The "
            "workloads (`benchmarks/_against_workloads.py`) use only what both trees export: "
            "the gateway over loopback HTTP and the channel's frames, the gate (which neither "
            "tree exports) by its module in each layout.",
            "",
            table(rows),
        ]
    )


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.against",
        description="The hosted step, the gate, the gateway's verify batch and channel and "
        "concurrent runs, on an earlier commit and on this checkout, in turns.",
    )
    parser.add_argument("--against", required=True, metavar="REV", help="the commit before")
    parser.add_argument("--rounds", type=int, help="rounds of before/after (default 5; quick 2)")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the tool")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated workloads ({', '.join(w.name for w in WORKLOADS)})",
    )
    parser.add_argument("--no-instructions", action="store_true", help="skip the valgrind counts")
    parser.add_argument("--write", action="store_true", help=f"put the table into {RESULTS}")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    names = [w.name for w in WORKLOADS]
    wanted = [n.strip() for n in args.only.split(",") if n.strip()] or names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        parser.error(f"--only: unknown workload {unknown[0]!r}; choose from {', '.join(names)}")
    args.workloads = [w for w in WORKLOADS if w.name in wanted]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def say(message: str) -> None:
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
        sys.stderr.flush()

    commit = resolve(args.against)
    after = current_tree()
    before = build(commit, say)
    trees = {"before": before, "after": after}
    level = 0 if args.quick else 1
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_start = load_average()
    clock = time.perf_counter()
    rows: list[Row] = []
    by_key: dict[tuple[str, str], Row] = {}
    for workload in args.workloads:
        for key, label in workload.figures:
            by_key[workload.name, key] = Row(workload.label, label)
            rows.append(by_key[workload.name, key])
    for round_ in range(args.rounds):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        for workload in args.workloads:
            for side in order:
                say(f"round {round_ + 1}/{args.rounds}: {workload.name}, {side}")
                figures = run_once(workload, workload.config[level], trees[side])
                for key, _label in workload.figures:
                    getattr(by_key[workload.name, key], side).append(float(figures[key]))
    valgrind = shutil.which("valgrind")
    counted = [w for w in args.workloads if w.count is not None]
    if counted and not args.no_instructions:
        if valgrind is None:
            say("valgrind is not installed: no instruction counts (apt-get install valgrind)")
        else:
            jobs = [
                (w, which, side)
                for w in counted
                for which in ("small", "large")
                for side in ("before", "after")
            ]
            say(f"{len(jobs)} instruction counts under valgrind, two at a time")

            def one(job: tuple[Workload, str, str]) -> int:
                w, which, side = job
                plan = w.count[level]  # type: ignore[index]
                began = time.perf_counter()
                n = instructions(valgrind, w, getattr(plan, which), plan.server, trees[side])
                say(f"counted {w.name} ({which}, {side}) in {time.perf_counter() - began:.0f} s")
                return n

            with ThreadPoolExecutor(2) as pool:
                counts = list(pool.map(one, jobs))
            found = {
                (w.name, which, side): n for (w, which, side), n in zip(jobs, counts, strict=True)
            }
            for w in counted:
                plan = w.count[level]  # type: ignore[index]
                how = f"cachegrind; {plan.note}" if plan.note else "cachegrind"
                row = Row(w.label, f"instructions per {w.per} ({how})", counted=True)
                for side in ("before", "after"):
                    more = found[w.name, "large", side] - found[w.name, "small", side]
                    getattr(row, side).append(more / plan.units)
                last = max(i for i, r in enumerate(rows) if r.workload == w.label)
                rows.insert(last + 1, row)
    seconds = time.perf_counter() - clock
    text = report(
        rows, args, commit, started, seconds, f"{load_start} at start, {load_average()} at end"
    )
    print(text)
    if args.write:
        write_section(text)
        say(f"wrote the section into {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
