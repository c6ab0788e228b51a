"""Call and move in one proposal: model calls per run and µs per step, one run at a time.

Standalone (not part of ``python -m benchmarks``)::

    python -m benchmarks.call_and_move [--runs 200] [--repeats 5] [--json out.json]

Two workloads, each with and without ``Worker(call_and_move=True)``, through the real
supervisor with an instant ``ScriptedProvider`` and a ``MemoryStore``, one run after another:

- *the 20-step no-op script* (``bench_loop`` / ``bench_peers``): one worker state; without,
  19 calls of the five-field no-op tool then a move to DONE (20 model calls); with, 20 calls,
  the last one naming DONE (20 model calls, no separate move). µs/step = wall ÷ (runs × 20).
- *a 20-state pipeline*, "call the tool, then move on" in each state: without, a call and
  then a move per state (40 model calls a run); with, one call that names the next state
  (20). µs/stage = wall ÷ (runs × 20): what one state's work costs the runtime.

Each configuration runs ``repeats`` times, interleaved, in this process; the median is kept.
No model latency is simulated: the figures are the runtime's own cost. A real model call
costs tokens and 0.3-3 s, which is what the saved calls save.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import Any

import msgspec
import trio

from benchmarks._workload import TOTAL, WORK, build_tool, call_args, call_raw, step_script
from interlock import Budgets, Machine, Worker, open_supervisor
from interlock.core._events import ModelCalled
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore

STEPS = 20
_BUDGETS = Budgets(tokens=10**12, steps=10**6, deadline=10.0**9)


def script_machine(moves: bool) -> Machine:
    return Machine(
        name="script",
        initial=WORK,
        states={
            WORK: Worker(
                next=["DONE"],
                tools=[build_tool().name],
                instructions="refund the order, then finish",
                call_and_move=moves,
            )
        },
        tools=[build_tool()],
        budgets=_BUDGETS,
    )


def script_outputs(moves: bool) -> list[str]:
    if not moves:
        return step_script(STEPS)
    rng = random.Random(7)
    outputs = [call_raw(call_args(rng, i)).decode() for i in range(STEPS)]
    outputs[-1] = msgspec.json.encode({**msgspec.json.decode(outputs[-1]), "next": "DONE"}).decode()
    return outputs


def pipeline_machine(moves: bool) -> Machine:
    names = [f"S{i}" for i in range(STEPS)]
    tool = build_tool()
    states = {
        name: Worker(
            next=[names[i + 1] if i + 1 < STEPS else "DONE"],
            tools=[tool.name],
            instructions="refund the order, then move on",
            call_and_move=moves,
        )
        for i, name in enumerate(names)
    }
    return Machine(name="pipeline", initial="S0", states=states, tools=[tool], budgets=_BUDGETS)


def pipeline_outputs(moves: bool) -> list[str]:
    """What the model answers, in order: per state a call (naming its move, with) and
    then (without) the move."""
    rng = random.Random(7)
    outputs = []
    for i in range(STEPS):
        target = f"S{i + 1}" if i + 1 < STEPS else "DONE"
        call = msgspec.json.decode(call_raw(call_args(rng, i)))
        if moves:
            outputs.append(msgspec.json.encode({**call, "next": target}).decode())
        else:
            outputs.append(msgspec.json.encode(call).decode())
            outputs.append(msgspec.json.encode({"next": target}).decode())
    return outputs


WORKLOADS = {
    "script": (script_machine, script_outputs),
    "pipeline": (pipeline_machine, pipeline_outputs),
}


def measure(workload: str, moves: bool, runs: int) -> dict[str, Any]:
    build, outputs_of = WORKLOADS[workload]
    machine = build(moves)
    outputs = outputs_of(moves)
    # the oracle answers by the run's model-call count: the same script for every run
    provider = ScriptedProvider(lambda view: outputs[view.steps])
    store = MemoryStore()
    out: dict[str, Any] = {}

    async def main() -> None:
        async with open_supervisor([machine], store, provider=provider) as supervisor:
            gc.collect()
            started = time.perf_counter()
            cpu = time.process_time()
            for i in range(runs):
                handle = await supervisor.start_run(machine.name, {"total": TOTAL}, run_id=f"r{i}")
                result = await handle.wait()
                if result.outcome != "completed":
                    raise RuntimeError(f"{workload} moves={moves}: run {i} ended {result}")
            out["wall_s"] = time.perf_counter() - started
            out["cpu_s"] = time.process_time() - cpu
        events = await store.load("r0")
        out["model_calls_per_run"] = sum(isinstance(e, ModelCalled) for e in events)
        out["events_per_run"] = len(events)

    trio.run(main)
    out["us_per_step"] = out["wall_s"] / (runs * STEPS) * 1e6
    out["cpu_us_per_step"] = out["cpu_s"] / (runs * STEPS) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    options = parser.parse_args()
    configs = [(w, m) for w in WORKLOADS for m in (False, True)]
    samples: dict[tuple[str, bool], list[dict[str, Any]]] = {c: [] for c in configs}
    measure("script", True, 5)  # warm up imports and caches
    for _ in range(options.repeats):
        for config in configs:
            samples[config].append(measure(*config, options.runs))
    rows = []
    for (workload, moves), got in samples.items():
        rows.append(
            {
                "workload": workload,
                "call_and_move": moves,
                "model_calls_per_run": got[0]["model_calls_per_run"],
                "events_per_run": got[0]["events_per_run"],
                "us_per_step": statistics.median(s["us_per_step"] for s in got),
                "us_per_step_range": [
                    min(s["us_per_step"] for s in got),
                    max(s["us_per_step"] for s in got),
                ],
                "cpu_us_per_step": statistics.median(s["cpu_us_per_step"] for s in got),
            }
        )
    print(f"{options.runs} runs one at a time, {options.repeats} repeats interleaved, median")
    print(
        f"{'workload':<10} {'call_and_move':<14} {'model calls/run':>15} {'events/run':>10} "
        f"{'µs/step':>9} {'range':>15} {'CPU µs/step':>12}"
    )
    for row in rows:
        lo, hi = row["us_per_step_range"]
        print(
            f"{row['workload']:<10} {('on' if row['call_and_move'] else 'off'):<14} "
            f"{row['model_calls_per_run']:>15} {row['events_per_run']:>10} "
            f"{row['us_per_step']:>9.1f} {f'{lo:.1f}-{hi:.1f}':>15} {row['cpu_us_per_step']:>12.1f}"
        )
    if options.json:
        with open(options.json, "w") as fh:
            json.dump(
                {"runs": options.runs, "repeats": options.repeats, "rows": rows}, fh, indent=1
            )


if __name__ == "__main__":
    main()
