"""The scale-out benchmark's application: a machine whose steps cost the runtime and the
journal only, so that ``bench_scaleout`` measures the workers and PostgreSQL, nothing else.

    interlock worker --app benchmarks/scaleout_app.py:app --db 'postgresql://...?schema=S'

One machine, ``steps``, with one model state ``WORK`` and a no-op, read-only tool
``noop``: the scripted model (an oracle, no latency unless asked for) calls ``noop`` with
``i = 1, 2, ...`` and, once ``STEPS - 1`` calls have returned, moves to ``COMPLETED``: a
run is ``STEPS`` model calls and ``STEPS - 1`` tool calls.

The failover measurement wants runs that live long enough to be killed mid-way:
``BENCH_SCALEOUT_STEPS`` (default 5) and ``BENCH_SCALEOUT_LATENCY`` (seconds per model
call, default 0) set both, in every process that reads them (the benchmark sets them in the
workers' environment).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from interlock import App, Budgets, Machine, RunView, Tool, ToolContext, Worker
from interlock.providers import ScriptedProvider

#: Model calls per run (the last one completes it).
STEPS = int(os.environ.get("BENCH_SCALEOUT_STEPS", "5"))
#: Seconds each model call waits before it answers.
LATENCY = float(os.environ.get("BENCH_SCALEOUT_LATENCY", "0"))


class Noop(msgspec.Struct, forbid_unknown_fields=True):
    i: int


async def noop(args: Noop, ctx: ToolContext) -> dict[str, Any]:
    return {"i": args.i}


def oracle(view: RunView) -> str:
    """Call ``noop`` with the next ``i`` until ``STEPS - 1`` calls returned, then complete."""
    last = view.last_result("noop")
    done = 0 if last is None else int(last["i"])
    if done < STEPS - 1:
        return f'{{"tool":"noop","args":{{"i":{done + 1}}}}}'
    return '{"next":"COMPLETED"}'


steps = Machine(
    "steps",
    initial="WORK",
    states={"WORK": Worker(next=["COMPLETED"], tools=["noop"], instructions="Step, then finish.")},
    tools=[Tool("noop", noop, Noop, "Does nothing.", read_only=True)],
    budgets=Budgets(steps=10 * STEPS + 10, deadline=3600.0),
)

app = App([steps], provider=ScriptedProvider(oracle, latency=LATENCY))
