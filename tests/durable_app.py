"""The durable-steps crash test's application (#19): runs that call a tool of each kind in
turn, against a downstream that records every execution in a SQLite file of its own
(committed before the tool returns), so the test can SIGKILL the process anywhere:

    python tests/durable_app.py run|resume JOURNAL EFFECTS RUNS [KILL]

With KILL (a probability), each execution SIGKILLs the process just after the downstream
recorded it, at that probability: a read-only call then ran before its intent was
durable, an idempotent one is re-run with its key, and the others are left in doubt.
``interlock replay --app tests/durable_app.py:machines`` replays its journals.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import sys
from typing import Any

import msgspec
import trio

from interlock import (
    Applied,
    Machine,
    NotApplied,
    RetryPolicy,
    RunView,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
)
from interlock.providers import ScriptedProvider
from interlock.stores import open_sqlite_store

#: Calls per run: a read-only, an idempotent, a not idempotent and a reconciling tool in turn.
CALLS = 40
TOOLS = ("look", "put", "send", "charge")
#: Seconds a side-effecting call holds its answer back once applied: a kill then leaves it
#: applied and not committed (in doubt).
PAUSE = 0.01
KILL = float(os.environ.get("INTERLOCK_DURABLE_KILL", "0"))


class Args(msgspec.Struct):
    n: int


class Downstream:
    """Every execution, as ``(tool, key, args)`` rows, durable before the tool returns."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, timeout=30)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS executions (tool TEXT, key TEXT, args TEXT, attempt INT)"
        )

    def record(self, tool: str, args: Any, ctx: ToolContext) -> None:
        self.db.execute(
            "INSERT INTO executions VALUES (?, ?, ?, ?)",
            (tool, ctx.key, json.dumps(msgspec.to_builtins(args)), ctx.attempt),
        )

    def applied(self, tool: str, key: str) -> bool:
        row = self.db.execute(
            "SELECT 1 FROM executions WHERE tool = ? AND key = ?", (tool, key)
        ).fetchone()
        return row is not None


_downstream: Downstream | None = None


def downstream() -> Downstream:
    global _downstream
    if _downstream is None:
        _downstream = Downstream(os.environ["INTERLOCK_DURABLE_EFFECTS"])
    return _downstream


def tool(name: str, **options: Any) -> Tool:
    async def execute(args: Args, ctx: ToolContext) -> dict[str, int]:
        downstream().record(name, args, ctx)
        if KILL and random.random() < KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if name != "look":
            await trio.sleep(PAUSE)
        return {"n": args.n}

    return Tool(name, execute, args=Args, retry=RetryPolicy(attempts=1), **options)


async def reconcile(key: str, args: Args, ctx: ToolContext) -> Any:
    return Applied({"n": args.n}) if downstream().applied("charge", key) else NotApplied


machines = [
    Machine(
        "durable",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=list(TOOLS))},
        tools=[
            tool("look", read_only=True),
            tool("put", idempotent=True),
            tool("send"),
            tool("charge", reconcile=reconcile),
        ],
    )
]


def oracle(view: RunView) -> str:
    """The next call from what the run has done: the same answer when asked again."""
    done = len(view.results)
    if done >= CALLS:
        return '{"next": "COMPLETED"}'
    return json.dumps({"tool": TOOLS[done % len(TOOLS)], "args": {"n": done}})


async def main(mode: str, journal: str, runs: int) -> None:
    store = await open_sqlite_store(journal, synchronous="FULL")
    try:
        started = {record.run_id for record in await store.list_runs()}
        async with open_supervisor(
            machines, store, provider=ScriptedProvider(oracle), resume=mode == "resume"
        ) as sup:
            for index in range(runs):
                run_id = f"d-{index:03d}"
                if run_id not in started:
                    await sup.start_run("durable", run_id=run_id)
    finally:
        await store.aclose()


if __name__ == "__main__":
    mode, journal, effects, runs = sys.argv[1:5]
    os.environ["INTERLOCK_DURABLE_EFFECTS"] = effects
    KILL = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    trio.run(main, mode, journal, int(runs))
