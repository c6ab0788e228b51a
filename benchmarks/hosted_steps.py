"""Hosted steps, as a user's process runs them: ``python benchmarks/hosted_steps.py [N]``.

N runs (default 2,000) started at once on the in-memory store, each a tool call then
COMPLETED (two model calls: two steps), tracing off; prints µs of wall time and of CPU
per step. Run it with two interpreters (two checkouts) to compare code paths, rounds
interleaved: benchmarks/RESULTS.md, "Tracing", compares tracing off against the code
before tracing existed.
"""

import sys
import time

import msgspec
import trio

from interlock import Machine, Tool, Worker, open_supervisor
from interlock.providers import ScriptedProvider

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
REFUND = '{"tool": "refund", "args": {"order_id": "o-1", "cents": 250}}'
DONE = '{"next": "COMPLETED"}'


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    cents: int


async def refunded(args, ctx):
    return {"refunded": args.cents}


machine = Machine(
    "refund",
    "WORK",
    {"WORK": Worker(next=["COMPLETED"], tools=["refund"])},
    tools=[Tool("refund", refunded, Refund, idempotent=True)],
)


def oracle(view):
    return DONE if view.last_result("refund") is not None else REFUND


async def main():
    async with open_supervisor([machine], provider=ScriptedProvider(oracle)) as sup:
        t0, c0 = time.perf_counter(), time.process_time()
        handles = [await sup.start_run("refund", run_id=f"r-{i}") for i in range(N)]
        for h in handles:
            await h.wait()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{wall / (2 * N) * 1e6:.2f} {cpu / (2 * N) * 1e6:.2f}")


trio.run(main)
