"""Instructions per step and per proposal, counted by valgrind (cachegrind): ratios without noise.

Wall and CPU time on a shared host swing between runs; a count of executed instructions
barely moves. Each figure
here is the instruction count of a child process running the workload at two sizes,
differenced, so the interpreter's start-up and imports cancel out:

- *loop*: ``bench_loop``'s concurrent case (runs of 20 steps through the real supervisor
  with an instant scripted provider, a no-op tool and a MemoryStore), per step; against
  the plain-Python msgspec loop of the same section, per step;
- *verify*: the gate on ``bench_verify``'s proposals (5% malformed), per proposal; against
  msgspec decoding the same bytes alone, the hand-written pydantic check, and the
  design's floor (decode + guard + repeat hash, nothing else; see ``bench_verify``).

An instruction is not a nanosecond (a cache miss costs more than an add), so these ratios
complement the timed sections rather than replace them. One skew is large: valgrind's
virtual CPU does not offer the SHA extensions, so OpenSSL hashes in software under it: the
SHA-256 of what each model call adds to its prompt (a few hundred bytes, the hash resuming
from the previous prompt's state) counts for several times its native share of the loop's
instructions per step. What the counts are for is comparing the same workload before and
after a change. Needs
``valgrind`` on the PATH (``apt-get install -y valgrind``); without it the section says so
and measures nothing.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks._goals import MINIMAL_ROW
from benchmarks._harness import Progress, child_instructions, child_main, no_progress

NAME = "instructions"
TITLE = "Instructions per step and per proposal (cachegrind), against the same baselines"


#: (label, workload, unit, sizes (quick, full), units per size step, baseline label)
PLAN: tuple[tuple[str, str, str, tuple[tuple[int, int], tuple[int, int]], int, str], ...] = (
    ("interlock loop, concurrent", "loop", "step", ((0, 0), (100, 300)), 20, "plain msgspec loop"),
    ("plain msgspec loop", "plain", "step", ((0, 0), (2_000, 6_000)), 20, "plain msgspec loop"),
    ("interlock gate (compiled)", "gate", "proposal", ((1, 2), (2, 12)), 1_000, "msgspec alone"),
    ("msgspec alone", "floor", "proposal", ((1, 2), (2, 12)), 1_000, "msgspec alone"),
    ("pydantic v2 by hand", "pydantic", "proposal", ((0, 0), (2, 12)), 1_000, "msgspec alone"),
    (MINIMAL_ROW, "minimal", "proposal", ((0, 0), (2, 12)), 1_000, "msgspec alone"),
)
"""Quick mode (which only checks that the section works) counts the gate and its floor,
the rows whose sizes are not (0, 0): each count is a process start under valgrind, and
quick mode starts them at once, one per core (a count does not depend on what else runs)."""


def _workload(kind: str, size: int) -> None:
    if kind == "loop":
        from benchmarks.bench_loop import measure_runtime

        measure_runtime(size, True, "scripted", False)
    elif kind == "plain":
        from benchmarks._workload import step_script
        from benchmarks.bench_loop import STEPS, plain_msgspec

        raws = [r.encode() for r in step_script(STEPS)]
        for _ in range(size):
            plain_msgspec(raws)
    else:
        from benchmarks._workload import proposals
        from benchmarks.bench_verify import _gate, _minimal, msgspec_floor, pydantic_check

        fn = {
            "gate": _gate,
            "floor": lambda: msgspec_floor,
            "pydantic": lambda: pydantic_check,
            "minimal": _minimal,
        }[kind]()
        raws = proposals(1_000, 0.05)
        for _ in range(size):
            for raw in raws:
                fn(raw)


def _child(config: dict[str, Any]) -> dict[str, Any]:
    _workload(config["kind"], config["size"])
    return {}


def count(valgrind: str, kind: str, size: int) -> int:
    """Instructions executed by a child process running ``kind`` at ``size``."""
    return child_instructions(
        valgrind,
        "benchmarks.bench_instructions",
        {"kind": kind, "size": size},
        f"{kind} (size {size})",
    )


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return {
            "skipped": "valgrind is not installed; `apt-get install -y valgrind` and run again",
            "rows": [],
        }
    rows = []
    plan = [entry for entry in PLAN if not quick or entry[3][0] != (0, 0)]
    counted: dict[tuple[str, int], int] = {}
    if quick:
        jobs = [(entry[1], size) for entry in plan for size in entry[3][0]]
        progress(f"{len(jobs)} counts under cachegrind, at once", 0.0)
        with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
            counted = dict(
                zip(jobs, pool.map(lambda job: count(valgrind, *job), jobs), strict=True)
            )
    for done, (label, kind, unit, sizes, per_size, baseline) in enumerate(plan):
        small, large = sizes[0] if quick else sizes[1]
        progress(f"{label} under cachegrind", done / len(plan))
        low = counted[kind, small] if quick else count(valgrind, kind, small)
        high = counted[kind, large] if quick else count(valgrind, kind, large)
        units = (large - small) * per_size
        rows.append(
            {
                "label": label,
                "unit": unit,
                "sizes": [small, large],
                "units": units,
                "instructions": (high - low) / units,
                "baseline": baseline,
            }
        )
    for row in rows:
        base = find({"rows": rows}, row["baseline"])
        row["ratio"] = row["instructions"] / base["instructions"] if base else None
    return {"rows": rows, "valgrind": valgrind}


def find(results: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((row for row in results.get("rows", []) if row["label"] == label), None)


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    if results.get("skipped"):
        return f"*Not measured: {results['skipped']}.*"
    body = [
        (
            row["label"],
            row["unit"],
            f"{row['units']:,}",
            num(row["instructions"] / 1000),
            f"{ratio(row['ratio'])} {row['baseline']}" if row["ratio"] is not None else "–",
        )
        for row in results["rows"]
    ]
    return "\n".join(
        [
            "Instructions executed (valgrind cachegrind, `I refs`) by a child process at two sizes, "
            "differenced, divided by the steps or proposals between them. The loop and the plain "
            "loop are bench_loop's concurrent case and msgspec loop; the proposals are "
            "bench_verify's (5% malformed). Valgrind hides the CPU's SHA extensions, so the "
            "SHA-256 of what each step adds to its prompt (a few hundred bytes; the hash resumes "
            "from the previous prompt's state) counts for several times its native share of "
            "the loop's instructions; the counts are for comparing one workload across changes.",
            "",
            table(
                ["workload", "per", "counted over", "thousand instructions", "× baseline"],
                body,
            ),
        ]
    )


if __name__ == "__main__":
    child_main(_child)
