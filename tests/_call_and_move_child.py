"""The process a call-and-move crash test kills (tests/test_call_and_move_crash.py).

``python tests/_call_and_move_child.py JOURNAL LEDGER KIND PHASE``: phase ``first`` starts
one run whose single model call charges and names COMPLETED as its move; the charge is
applied downstream (the LEDGER file) and the process SIGKILLs itself before it reports.
Phase ``second`` opens the same journal, resumes the unfinished run and prints its result
as JSON. The provider has one answer: a second model call would exhaust it and escalate.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from typing import Any

import msgspec
import trio

from interlock import Applied, Machine, NotApplied, Tool, ToolContext, Worker, open_supervisor
from interlock.providers import ScriptedProvider
from interlock.stores import open_sqlite_store
from interlock.stores._open import open_store


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


class Note(msgspec.Struct, forbid_unknown_fields=True):
    charged: str


PROPOSAL = (
    '{"tool": "charge", "args": {"order_id": "o1"}, "next": "COMPLETED", "data": {"charged": "o1"}}'
)


def main(journal: str, ledger: str, kind: str, phase: str) -> None:
    db = sqlite3.connect(ledger, isolation_level=None)
    db.execute("CREATE TABLE IF NOT EXISTS applied (key TEXT PRIMARY KEY)")
    db.execute("CREATE TABLE IF NOT EXISTS attempts (key TEXT, phase TEXT)")

    async def charge(args: Charge, ctx: ToolContext) -> dict[str, Any]:
        db.execute("INSERT INTO attempts VALUES (?, ?)", (ctx.key, phase))
        db.execute("INSERT OR IGNORE INTO applied VALUES (?)", (ctx.key,))
        if phase == "first":
            os.kill(os.getpid(), signal.SIGKILL)  # applied downstream, not reported
        return {"charged": args.order_id}

    async def was_charged(key: str, args: Charge, ctx: ToolContext) -> Any:
        found = db.execute("SELECT 1 FROM applied WHERE key = ?", (key,)).fetchone()
        return Applied({"charged": args.order_id}) if found else NotApplied

    tool = (
        Tool("charge", charge, Charge, idempotent=True)
        if kind == "idempotent"
        else Tool("charge", charge, Charge, reconcile=was_charged)
    )
    machine = Machine(
        "pay",
        initial="WORK",
        states={
            "WORK": Worker(next=["COMPLETED"], tools=["charge"], data=Note, call_and_move=True)
        },
        tools=[tool],
    )

    async def run() -> None:
        postgres = journal.startswith("postgresql://")
        store = (
            await open_store(journal)
            if postgres
            else await open_sqlite_store(journal, synchronous="FULL")
        )
        provider = ScriptedProvider([PROPOSAL])
        options: dict[str, Any] = {"lease_ttl": 1.0} if postgres else {}
        try:
            if phase == "first":
                async with open_supervisor([machine], store, provider=provider, **options) as sup:
                    handle = await sup.start_run("pay", {}, run_id="r-1")
                    await handle.wait()
                return
            async with open_supervisor([machine], store, provider=provider, **options) as sup:
                handles = await sup.resume_unfinished()
                with trio.fail_after(30):  # a hang guard: the dead process's lease expires
                    while not handles:
                        await trio.sleep(0.2)
                        handles = await sup.resume_unfinished()
                result = await handles[0].wait()
                print(json.dumps({"outcome": result.outcome, "output": result.output}))
        finally:
            await store.aclose()

    trio.run(run)


if __name__ == "__main__":
    main(*sys.argv[1:5])
