"""Instructions per proposal of the gateway's batch path, counted by valgrind (cachegrind).

On a shared host the gateway's proposals per CPU second swing by a quarter between two
runs of the same build; a count of executed instructions barely moves, so a change to
the path is measured here before and after, in one run. The workload is what a
``POST /v1/verify`` batch (or a busy streaming channel) hands the service, without the
HTTP around it: ``runs`` external runs of the gateway benchmark's machine on a SQLite
journal (synchronous=FULL, the store's default), every round one proposal per run (its
next transition) through ``GatewayService.verify_many``, answered once the batch is
durable. Each count is of a child process at two numbers of rounds (30 apart, so that the
SQLite store applies its pending index moves once between them, see LAG_BATCHES),
differenced, so the start-up, the imports and the runs' creation cancel out; every thread
of the process is counted (the store's writer and checkpointer too).

    python -m benchmarks.gateway_instructions [--against REV] [--rounds 2,32] [--runs 1000]

``--against REV`` counts that commit too, from a worktree of it with its own compiled
extensions built there (``git worktree``; removed afterwards). An instruction is not a
nanosecond (a cache miss costs more than an add), so the counts complement the timed
gateway section of RESULTS.md rather than replace it. Needs ``valgrind`` on the PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._harness import ROOT, child_env, child_instructions, child_main

RUNS = 1000


#: Batches between two applications of the SQLite store's pending index moves (schema
#: version 6): under valgrind a batch takes about a second, so the store's time-based lag
#: (``INDEX_LAG_SECONDS``) would apply them after nearly every batch, which no real load
#: does. At the gateway's rate (a few dozen batches of 1,000 a second) the lag applies
#: them every hundred batches or more; once in 30 overcounts that share a little.
LAG_BATCHES = 30


def workload(runs: int, rounds: int) -> None:
    """``runs`` external runs, then ``rounds`` batches of one transition per run."""
    import trio

    from interlock.stores import _sqlite

    # (set on a revision from before version 6 too: there nothing reads them)
    _sqlite.INDEX_LAG_SECONDS = float("inf")  # type: ignore[attr-defined]
    _sqlite.INDEX_LAG_BATCHES = LAG_BATCHES  # type: ignore[attr-defined]

    from benchmarks.bench_gateway import build_machine, transition
    from interlock import open_supervisor
    from interlock.gateway._service import GatewayService
    from interlock.protocol import ProposalIn
    from interlock.stores import open_sqlite_store

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            store = await open_sqlite_store(os.path.join(tmp, "j.db"))
            try:
                async with open_supervisor([build_machine()], store) as sup:
                    service = GatewayService(sup)
                    ids = [f"g-{uuid.UUID(int=i).hex[-16:]}" for i in range(runs)]
                    async with trio.open_nursery() as nursery:
                        for run_id in ids:
                            nursery.start_soon(
                                lambda r: sup.start_run("cycle", run_id=r, external=True), run_id
                            )
                    where = {r: (sup.view(r).state, sup.view(r).seq) for r in ids}
                    for n in range(rounds):
                        bodies = [
                            ProposalIn(
                                proposal=transition(where[r][0], n), expected_seq=where[r][1]
                            )
                            for r in ids
                        ]
                        verdicts = await service.verify_many(ids, bodies)
                        for run_id, verdict in zip(ids, verdicts, strict=True):
                            if not verdict.accepted:
                                raise AssertionError(f"a legal transition was refused: {verdict}")
                            where[run_id] = (verdict.state, verdict.seq)
            finally:
                await store.aclose()

    trio.run(main)


def _child(config: dict[str, Any]) -> dict[str, Any]:
    workload(config["runs"], config["rounds"])
    return {}


def count(valgrind: str, tree: Path, runs: int, rounds: int) -> int:
    """Instructions of a child process (the checkout at ``tree``) running the workload."""
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join((str(tree / "src"), str(tree), str(ROOT)))
    return child_instructions(
        valgrind,
        "benchmarks.gateway_instructions",
        {"runs": runs, "rounds": rounds},
        f"{tree} ({rounds} rounds)",
        cwd=tree,
        env=env,
        timeout=3600,
    )


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """A checkout of ``revision`` with its compiled extensions built, removed on exit."""
    path = Path(tempfile.mkdtemp(prefix="interlock-at-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), revision],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    try:
        # its workload module is this checkout's (the child runs it from ROOT's copy)
        shutil.copy(ROOT / "benchmarks" / "gateway_instructions.py", path / "benchmarks")
        subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=path,
            check=True,
            capture_output=True,
            env={**os.environ, "CFLAGS": "-g0"},
        )
        yield path
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(path)],
            cwd=ROOT,
            check=False,
            capture_output=True,
        )


def per_proposal(valgrind: str, tree: Path, runs: int, rounds: tuple[int, int]) -> float:
    low, high = (count(valgrind, tree, runs, n) for n in rounds)
    return (high - low) / ((rounds[1] - rounds[0]) * runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", default="")
    parser.add_argument("--rounds", default="2,32")
    parser.add_argument("--runs", type=int, default=RUNS)
    args = parser.parse_args()
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("valgrind is not installed; `apt-get install -y valgrind` and run again")
    low, high = (int(n) for n in args.rounds.split(","))
    now = per_proposal(valgrind, ROOT, args.runs, (low, high))
    print(f"this checkout: {now:,.0f} instructions per proposal")
    if args.against:
        with worktree(args.against) as tree:
            then = per_proposal(valgrind, tree, args.runs, (low, high))
        print(f"{args.against}: {then:,.0f} instructions per proposal")
        print(f"this checkout / {args.against}: {now / then:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(_child)
    else:
        main()
