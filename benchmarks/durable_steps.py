"""Durable steps one run at a time (#19): steps/s, flushes and fsyncs per step, per kind of tool.

One run at a time of 20 steps with a no-op tool that is read-only, idempotent, not
idempotent, or not idempotent with ``reconcile``, journaled in SQLite with
``synchronous=FULL`` (an fsync of the WAL per batch), in three shapes:

- ``calls``: 19 calls, then the run ends (a step is one model call);
- ``call, move``: each step calls the tool, then moves to the other state (two model
  calls a step, as a framework that runs a tool and then goes on), 20 steps, then the end;
- ``call+move``: each step calls the tool and names the state to move to in one proposal
  (``Worker(call_and_move=True)``; skipped where this interlock has no such state).

A step's flushes are the store's appends (counted by wrapping ``append``); its fsyncs are
the process's ``fsync``/``fdatasync`` calls counted by ``strace -f -c`` in a child that runs
the same configuration (``--no-strace`` to skip). Run it against any checkout to compare::

    python benchmarks/durable_steps.py --runs 20            # this checkout
    PYTHONPATH=/path/to/other/src python benchmarks/durable_steps.py --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

import interlock
from interlock import Machine, NotApplied, Tool, ToolContext, Worker, open_supervisor
from interlock.providers import ScriptedProvider
from interlock.stores import open_sqlite_store

STEPS = 20
KINDS = ("read_only", "idempotent", "not_idempotent", "reconcile")
SHAPES = ("calls", "call, move", "call+move")


class Args(msgspec.Struct):
    n: int


async def noop(args: Args, ctx: ToolContext) -> dict[str, bool]:
    return {"ok": True}


async def reconcile(key: str, args: Args, ctx: ToolContext) -> Any:
    return NotApplied


def machine(kind: str, shape: str) -> Machine:
    options: dict[str, Any] = {
        "read_only": {"read_only": True},
        "idempotent": {"idempotent": True},
        "not_idempotent": {},
        "reconcile": {"reconcile": reconcile},
    }[kind]
    tool = Tool("noop", noop, args=Args, **options)
    if shape == "calls":
        states = {"WORK": Worker(next=["COMPLETED"], tools=["noop"])}
        return Machine("durable", initial="WORK", states=states, tools=[tool])
    extra = {"call_and_move": True} if shape == "call+move" else {}
    states = {
        "A": Worker(next=["B", "COMPLETED"], tools=["noop"], **extra),
        "B": Worker(next=["A", "COMPLETED"], tools=["noop"], **extra),
    }
    return Machine("durable", initial="A", states=states, tools=[tool])


def script(shape: str) -> list[str]:
    def call(n: int, then: str = "") -> str:
        move = f', "next": "{then}"' if then else ""
        return f'{{"tool": "noop", "args": {{"n": {n}}}{move}}}'

    if shape == "calls":
        return [*(call(n) for n in range(STEPS - 1)), '{"next": "COMPLETED"}']
    raws: list[str] = []
    for n in range(STEPS):
        target = "B" if n % 2 == 0 else "A"
        if shape == "call+move":
            raws.append(call(n, target))
        else:
            raws += [call(n), f'{{"next": "{target}"}}']
    return [*raws, '{"next": "COMPLETED"}']


async def measure(kind: str, shape: str, runs: int, path: str) -> dict[str, Any]:
    spec = machine(kind, shape)
    store = await open_sqlite_store(path, synchronous="FULL")
    appends = 0
    append = store.append

    async def counted(events: Any) -> None:
        nonlocal appends
        appends += 1
        await append(events)

    store.append = counted  # type: ignore[method-assign]
    elapsed = 0.0
    try:
        async with open_supervisor([spec], store, provider=ScriptedProvider(script(shape))) as sup:
            for index in range(runs + 1):  # the first run warms up and is not counted
                if index == 1:
                    appends = 0
                started = time.perf_counter()
                handle = await sup.start_run("durable", run_id=f"r-{index}")
                result = await handle.wait()
                if index:
                    elapsed += time.perf_counter() - started
                assert result.outcome == "completed", (kind, shape, result)
    finally:
        await store.aclose()
    steps = max(runs * STEPS, 1)
    elapsed = max(elapsed, 1e-9)
    return {
        "kind": kind,
        "shape": shape,
        "runs": runs,
        "steps_per_s": steps / elapsed,
        "us_per_step": elapsed / steps * 1e6,
        "flushes_per_step": appends / steps,
    }


def has_call_and_move() -> bool:
    return "call_and_move" in getattr(Worker, "__dataclass_fields__", {}) or hasattr(
        Worker, "call_and_move"
    )


def child(kind: str, shape: str, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("DURABLE_STEPS_DIR")) as tmp:
        return trio.run(measure, kind, shape, runs, os.path.join(tmp, "journal.db"))


def fsyncs(kind: str, shape: str, runs: int) -> float | None:
    """fsync + fdatasync calls per step of the same configuration, in a child under strace
    (the warm-up run and the process's start and close are subtracted with a 0-run child)."""

    def count(n: int) -> int | None:
        with tempfile.NamedTemporaryFile(suffix=".strace") as out:
            cmd = [
                *("strace", "-f", "-qq", "-c", "-e", "trace=fsync,fdatasync", "-o", out.name),
                *(sys.executable, __file__, "--child", kind, shape, str(n)),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return None
            total = 0
            for line in Path(out.name).read_text().splitlines():
                fields = line.split()
                if fields and fields[-1] in ("fsync", "fdatasync"):
                    total += int(fields[3])  # % time, seconds, usecs/call, calls
            return total

    with_runs, without = count(runs), count(0)
    if with_runs is None or without is None:
        return None
    return (with_runs - without) / (runs * STEPS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="measured runs per configuration")
    parser.add_argument("--no-strace", action="store_true", help="do not count fsyncs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, shape, runs = args.child
        print(json.dumps(child(kind, shape, int(runs))))
        return
    rows = []
    for shape in SHAPES:
        if shape == "call+move" and not has_call_and_move():
            continue
        for kind in KINDS:
            row = child(kind, shape, args.runs)
            row["fsyncs_per_step"] = None if args.no_strace else fsyncs(kind, shape, args.runs)
            rows.append(row)
    if args.json:
        print(json.dumps({"interlock": interlock.__file__, "rows": rows}, indent=1))
        return
    print(
        f"interlock from {os.path.dirname(interlock.__file__)}; {args.runs} runs of {STEPS} steps"
    )
    print("| shape | tool | steps/s | µs/step | flushes/step | fsyncs/step |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        fs = "–" if r["fsyncs_per_step"] is None else f"{r['fsyncs_per_step']:.2f}"
        print(
            f"| {r['shape']} | {r['kind']} | {r['steps_per_s']:,.0f} | {r['us_per_step']:,.0f} "
            f"| {r['flushes_per_step']:.2f} | {fs} |"
        )


if __name__ == "__main__":
    main()
