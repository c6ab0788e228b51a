"""Runs whose tool calls end in doubt, for the replay tests: the machine, and a recorder.

``tests/data/journal-in-doubt-0.3.msgpack`` was recorded by this module with interlock as
it was before ``ToolFailed.in_doubt`` existed, when an escalation in doubt was journaled
only as ``error="in doubt: <the failure>"``; it pins that old form, so never regenerate it
with a newer interlock::

    PYTHONPATH=<an old src> python tests/in_doubt_app.py OUT.msgpack

Each run of ``Behaviour`` calls one tool of the machine once per model proposal, and each
attempt does what its script says.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from interlock import (
    Applied,
    Machine,
    NotApplied,
    RetryPolicy,
    Tool,
    ToolContext,
    ToolError,
    Worker,
    open_supervisor,
)
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore

DONE = '{"next": "COMPLETED"}'

#: What one attempt of a call does: return, raise (applied unknown, or certainly not),
#: fail with text that has the old in-doubt form, or return what the journal cannot hold.
ATTEMPTS = ("ok", "reset", "value", "not_applied", "in_doubt_text", "unjournalable")
#: What the tool's reconcile (if it has one) says of a call in doubt.
RECONCILES = ("applied", "not_applied", "raises", "garbage")


class Behaviour:
    """The downstream of every tool, scripted per run: ``attempts[run_id]`` in order
    (then "ok"), and ``reconciles[run_id]`` in order (then "not_applied")."""

    def __init__(
        self, attempts: dict[str, Sequence[str]], reconciles: dict[str, Sequence[str]]
    ) -> None:
        self.attempts = {k: list(v) for k, v in attempts.items()}
        self.reconciles = {k: list(v) for k, v in reconciles.items()}

    async def execute(self, args: Any, ctx: ToolContext) -> Any:
        await trio.lowlevel.checkpoint()
        script = self.attempts.get(ctx.run_id, [])
        what = script.pop(0) if script else "ok"
        if what == "reset":
            raise ConnectionResetError("connection reset by peer")
        if what == "value":
            raise ValueError("bad response body")
        if what == "not_applied":
            raise ToolError("the downstream refused it", applied=False)
        if what == "in_doubt_text":  # a plain failure whose text has the old in-doubt form
            raise ToolError("in doubt: the ledger said no", applied=False)
        if what == "unjournalable":
            return {"handle": object()}
        return {"sent": ctx.key}

    async def reconcile(self, key: str, args: Any, ctx: ToolContext) -> Any:
        await trio.lowlevel.checkpoint()
        script = self.reconciles.get(ctx.run_id, [])
        what = script.pop(0) if script else "not_applied"
        if what == "applied":
            return Applied({"sent": key})
        if what == "raises":
            raise RuntimeError("the ledger is down")
        if what == "garbage":
            return "yes"
        return NotApplied


def machine(behaviour: Behaviour, retries: int = 2) -> Machine:
    """``mail`` (not idempotent, no reconcile), ``post`` (not idempotent, reconciles) and
    ``fetch`` (read-only, retried)."""
    retry = RetryPolicy(attempts=retries, base=0.0, jitter=False)
    return Machine(
        "doubt",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["mail", "post", "fetch"])},
        tools=[
            Tool("mail", behaviour.execute, retry=retry),
            Tool("post", behaviour.execute, retry=retry, reconcile=behaviour.reconcile),
            Tool("fetch", behaviour.execute, retry=retry, read_only=True),
        ],
    )


def call(tool: str) -> str:
    return f'{{"tool": "{tool}", "args": {{}}}}'


async def record(spec: Machine, scripts: dict[str, list[str]], *, resume: bool = True) -> list[Any]:
    """Run each ``scripts`` run (its model's answers in order) to its end; an escalated
    run is resumed once by an operator with a move to COMPLETED. Return every event."""
    store = MemoryStore()
    provider = ScriptedProvider({run_id: [*answers, DONE] for run_id, answers in scripts.items()})
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        for run_id in scripts:
            result = await (await sup.start_run("doubt", run_id=run_id)).wait()
            if resume and result.outcome == "escalated":
                handle = await sup.resume_escalated(run_id, by="op", note="checked", payload=DONE)
                await handle.wait()
    events: list[Any] = []
    for run_id in scripts:
        events.extend(await store.load(run_id))
    return events


#: The runs of the pinned old journal, and what their downstream did.
OLD_SCRIPTS = {
    "mail-escalated": [call("mail")],
    "post-unknown": [call("post")],
    "post-garbage": [call("post")],
    "post-applied": [call("post")],
    "mail-plain-text": [call("mail")],
    "fetch-retried": [call("fetch")],
    "mail-unjournalable": [call("mail")],
}
OLD_ATTEMPTS = {
    "mail-escalated": ["value"],
    "post-unknown": ["reset"],
    "post-garbage": ["reset"],
    "post-applied": ["value"],
    "mail-plain-text": ["in_doubt_text"],
    "fetch-retried": ["reset", "ok"],
    "mail-unjournalable": ["unjournalable"],
}
OLD_RECONCILES = {
    "post-unknown": ["raises"],
    "post-garbage": ["garbage"],
    "post-applied": ["applied"],
}


def old_machine() -> Machine:
    return machine(Behaviour(OLD_ATTEMPTS, OLD_RECONCILES))


def _main(out: Path) -> None:
    from interlock.events import encode_event

    events = trio.run(record, old_machine(), OLD_SCRIPTS)
    out.write_bytes(msgspec.msgpack.encode([msgspec.Raw(encode_event(e)) for e in events]))


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
