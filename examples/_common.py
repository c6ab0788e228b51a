"""Shared by the example scripts: run one workflow once and print its journal."""

from __future__ import annotations

from typing import Any

import trio

from interlock import open_supervisor
from interlock.demo.workflows import WORKFLOWS, Backend
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore


async def run_once(workflow: str, inputs: dict[str, Any], script: list[str] | None = None) -> None:
    """Run ``workflow`` once with the oracle model (or ``script``) and print every event."""
    backend = Backend(":memory:")
    store = MemoryStore()
    module = WORKFLOWS[workflow]
    provider = ScriptedProvider(script if script is not None else module.oracle, model="oracle")
    async with open_supervisor([module.build(backend)], store, provider=provider) as supervisor:
        handle = await supervisor.start_run(workflow, inputs, run_id=f"{workflow}-example")
    result = await handle.wait()
    for event in await store.load(handle.run_id):
        print(f"{event.seq:>3} {type(event).__struct_config__.tag:<18} {_brief(event)}")
    print(f"\n{workflow}: {result.outcome} in {result.state} {result.output or ''}")
    print(f"side effects: {backend.counts()}")
    backend.close()


def _brief(event: Any) -> str:
    import msgspec

    data = msgspec.to_builtins(event)
    for noise in ("run_id", "seq", "ts", "kind", "latency", "prompt", "prompt_hash"):
        data.pop(noise, None)
    for noise in ("prompt_base", "prompt_prefix", "prompt_suffix"):
        data.pop(noise, None)
    text = msgspec.json.encode(data).decode()
    return text if len(text) < 150 else text[:147] + "..."


def main(workflow: str, inputs: dict[str, Any], script: list[str] | None = None) -> None:
    trio.run(run_once, workflow, inputs, script)
