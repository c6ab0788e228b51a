"""Calls cut as stalled with no stall (issue 33): three workers under load, no fault injected.

The scenario of ``tests/test_scaleout_chaos.py::test_no_call_is_cut_as_stalled_under_load_with_no_fault``
(its app, ``tests/scaleout_app.py``, whose ``charge`` is not idempotent and cannot reconcile,
so a call cut in flight escalates), measured before and after the fix: 9,000 runs enqueued,
three ``interlock worker`` processes (``--max-runs 3000 --claim-batch 500``; ``--runs N``: N
runs, a third of them per worker) at a lease ttl,
nothing killed, stopped or cut off. Per round: the runs escalated because a call was cut
as if its worker had stalled past its lease, every journaled failure of such a cut (a
``notify`` cut is reconciled instead), the leases lost (another worker took them), and the
audit's violations (none expected: a cut call was never applied twice).

*Before* runs the workers on the source tree of ``--before`` (``git archive`` of its
``src/``, with this checkout's compiled modules copied in: ``ext/`` is the same), *after*
on this checkout's ``src/``. The two take turns round by round, so the host's load (shared
with other users) hits both alike.

Run it: ``python -m benchmarks.lease_stalls --before REV [--ttl 2 3] [--rounds 2]``
(``INTERLOCK_PG_DSN``); it prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUNS = 9000
CLAIM_BATCH = "500"


def export_src(rev: str, into: Path) -> Path:
    """``src/`` of ``rev``, with this checkout's compiled modules beside its sources."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for built in (ROOT / "src").rglob("*.so"):
        target = into / built.relative_to(ROOT)
        if target.parent.is_dir():
            shutil.copy2(built, target)
    return into / "src"


def one_round(dsn: str, src: Path, ttl: float, logs: Path, runs: int = RUNS) -> dict[str, Any]:
    from tests import _scaleout as so

    schema = so.new_schema("bench_stall")
    url = so.journal_url(dsn, schema)
    try:
        so.enqueue_many(url, range(runs))
        load = ("--max-runs", str(runs // 3), "--claim-batch", CLAIM_BATCH)
        started = time.monotonic()
        env = {"PYTHONPATH": str(src)}
        with so.processes() as procs:
            procs.extend(
                so.worker(url, logs, f"{schema}-w{i}", *load, ttl=ttl, env=env) for i in range(3)
            )
            so.wait_until(
                f"all {runs} runs terminal",
                lambda: so.progress(url)[0] == runs,
                timeout=900,
                procs=procs,
            )
            for proc in procs:
                proc.send(signal.SIGTERM)
            for proc in procs:
                proc.exit_ok(60)
        wall = time.monotonic() - started
        summaries = [proc.summary() for proc in procs]
        escalated, cuts = so.stall_cuts(url)
        problems = so.audit(url, runs=runs)
        return {
            "ttl": ttl,
            "runs": runs,
            "stall_escalations": escalated,
            "stall_cuts": cuts,
            "lost": sum(s["lost"] for s in summaries),
            "violations": len(problems),
            "wall_s": wall,
            "load": os.getloadavg()[0],
        }
    finally:
        so.drop_schemas(dsn, schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision to compare against")
    parser.add_argument("--ttl", type=float, nargs="+", default=[2.0, 3.0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=RUNS, help="runs enqueued (a third per worker)")
    args = parser.parse_args()
    dsn = os.environ["INTERLOCK_PG_DSN"]
    sys.path.insert(0, str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-stalls-") as tmp:
        before = export_src(args.before, Path(tmp))
        sides = {f"before ({args.before})": before, "after": ROOT / "src"}
        for ttl in args.ttl:
            for index in range(args.rounds):
                order = list(sides.items())
                for name, src in order if index % 2 == 0 else reversed(order):
                    row = one_round(dsn, src, ttl, Path(tmp), args.runs)
                    row.update(side=name, round=index + 1)
                    print(row, file=sys.stderr, flush=True)
                    rows.append(row)
    print(
        "| code | lease ttl s | round | runs | stall escalations | % of runs | calls cut as "
        "stalled | leases lost | audit violations | wall s | load (1 min) |\n"
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for r in rows:
        print(
            f"| {r['side']} | {r['ttl']:g} | {r['round']} | {r['runs']:,} | {r['stall_escalations']} "
            f"| {100 * r['stall_escalations'] / r['runs']:.1f}% | {r['stall_cuts']} | {r['lost']} "
            f"| {r['violations']} | {r['wall_s']:.0f} | {r['load']:.1f} |"
        )


if __name__ == "__main__":
    main()
