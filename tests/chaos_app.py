"""The chaos test's application: the seed workflows with a provider and tools that fail in
every way the runtime must contain (#14). Run as a process, so the test can SIGKILL it:

    python tests/chaos_app.py run|resume DB EFFECTS RUNS SEED
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any

import trio

from interlock import (
    Machine,
    ProviderError,
    ProviderPolicy,
    RetryPolicy,
    RunView,
    Tool,
    ToolContext,
    open_supervisor,
)
from interlock.demo.workflows import WORKFLOWS, Backend
from interlock.providers import ChaosProvider, Proposal, ScriptedProvider
from interlock.stores import open_sqlite_store

#: What the provider does instead of answering, each at this probability per call.
PROVIDER_FAULTS = (
    "returns_str",
    "returns_none",
    "returns_bytes",
    "raw_not_str",
    "lone_surrogate",
    "surrogateescape",
    "raises",
    "raises_group",
    "hangs",
    "rate_limited",
    "oversized",
    "duplicate_key",
)
PROVIDER_RATE = 0.02  # per fault: about a quarter of the calls fail in some way
TOOL_FAULTS = ("raises_group", "fails_after_applying", "hangs")
TOOL_RATE = 0.04


class FaultyProvider:
    """Wraps the demo's chaos provider; the dice depend only on (seed, run, seq, call)."""

    def __init__(self, inner: Any, seed: int) -> None:
        self.inner = inner
        self.model = inner.model
        self.seed = seed
        self.calls: dict[tuple[str, int], int] = {}

    async def propose(self, view: RunView) -> Any:
        at = (view.run_id, view.seq)
        self.calls[at] = self.calls.get(at, 0) + 1
        rng = random.Random(f"{self.seed}:{view.run_id}:{view.seq}:{self.calls[at]}")
        fault = next((f for f in PROVIDER_FAULTS if rng.random() < PROVIDER_RATE), None)
        if fault == "hangs":
            await trio.sleep_forever()
        if fault == "raises":
            raise RuntimeError("upstream 502")
        if fault == "raises_group":
            raise ExceptionGroup("fan-out failed", [OSError("reset"), ValueError("bad chunk")])
        if fault == "rate_limited":
            raise ProviderError("429 too many requests", retry_after=0.02, status=429)
        answer: Proposal = await self.inner.propose(view)
        raw = answer.raw
        match fault:
            case "returns_str":
                return raw
            case "returns_none":
                return None
            case "returns_bytes":
                return raw.encode()
            case "raw_not_str":
                return Proposal(raw=1)  # type: ignore[arg-type]
            case "lone_surrogate":
                return Proposal(raw=raw[:5] + "\ud800" + raw[5:], usage=answer.usage)
            case "surrogateescape":
                bad = (raw[:5].encode() + b"\xff" + raw[5:].encode()).decode(
                    "utf-8", "surrogateescape"
                )
                return Proposal(raw=bad, usage=answer.usage)
            case "oversized":
                return Proposal(raw=raw + " " * 300_000, usage=answer.usage)
            case "duplicate_key":
                return Proposal(raw=raw[:-1] + ', "tool": "wipe_everything"}', usage=answer.usage)
        return answer


def faulty_tool(tool: Tool, backend: Backend, seed: int) -> Tool:
    execute = tool.execute

    async def chaotic(args: Any, ctx: ToolContext) -> Any:
        rng = random.Random(f"{seed}:{ctx.key}:{ctx.attempt}")
        fault = next((f for f in TOOL_FAULTS if rng.random() < TOOL_RATE), None)
        if fault == "raises_group":

            async def fail() -> None:
                raise ConnectionRefusedError("shard refused")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail)
        if fault == "hangs":
            await trio.sleep_forever()
        result = await execute(args, ctx)
        if fault == "fails_after_applying":
            raise ConnectionResetError("connection reset after the write")
        return result

    return dataclasses.replace(tool, execute=chaotic, timeout=0.5, retry=RetryPolicy(base=0.01))


def machines(backend: Backend, seed: int) -> list[Machine]:
    built = []
    for name, workflow in WORKFLOWS.items():
        machine = workflow.build(backend)
        built.append(
            dataclasses.replace(
                machine,
                tools=[faulty_tool(t, backend, seed) for t in machine.tools],
                provider_policy=ProviderPolicy(timeout=0.5, attempts=4, base=0.01, cap=0.05),
            )
        )
        assert built[-1].name == name
    return built


def providers(seed: int) -> dict[str, Any]:
    return {
        name: FaultyProvider(
            ChaosProvider(
                ScriptedProvider(workflow.oracle, model="sim-1"),
                rate=0.1,
                seed=seed,
                latency=(0.005, 0.02),
            ),
            seed,
        )
        for name, workflow in WORKFLOWS.items()
    }


async def main(mode: str, db: str, effects: str, runs: int, seed: int) -> None:
    backend = Backend(effects)
    store = await open_sqlite_store(db)
    try:
        # Resume what a killed process left unfinished, then start the runs it never did.
        started = {record.run_id for record in await store.list_runs()}
        async with open_supervisor(
            machines(backend, seed), store, provider=providers(seed), resume=mode == "resume"
        ) as sup:
            rng = random.Random(seed)
            names = list(WORKFLOWS)
            for index in range(runs):
                name = names[index % len(names)]
                inputs = WORKFLOWS[name].make_inputs(index, rng)
                run_id = f"{name}-chaos-{index:05d}"
                if run_id not in started:
                    await sup.start_run(name, inputs, run_id=run_id)
    finally:
        await store.aclose()
        backend.close()


if __name__ == "__main__":
    mode, db, effects, runs, seed = sys.argv[1:6]
    trio.run(main, mode, db, effects, int(runs), int(seed))
