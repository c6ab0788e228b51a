"""Fewer flushes (#19) on PostgreSQL, where runs are leased and every append is fenced: a
worker whose lease another process took never starts a call that is not read-only (its
intent is fenced and durable first); a read-only call may start (harmless: it changes
nothing), and what the run decided is refused by the fence, none of it written. Real
PostgreSQL; skipped without INTERLOCK_PG_DSN."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import psycopg
import pytest
import trio

from interlock import (
    LeaseLost,
    Machine,
    NotApplied,
    RunView,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
)
from interlock.events import TokenUsage
from interlock.providers import Proposal
from interlock.stores import PostgresStore, open_postgres_store

pytestmark = pytest.mark.postgres

DSN = os.environ.get("INTERLOCK_PG_DSN", "")
if not DSN:
    pytest.skip(
        "INTERLOCK_PG_DSN is not set; set it to a PostgreSQL DSN to run the leased "
        "durable-steps tests",
        allow_module_level=True,
    )


class Args(msgspec.Struct):
    n: int


class Held:
    """Answers a call, then a move, then a call ... ; the first answer waits for ``go``."""

    model = "held"

    def __init__(self) -> None:
        self.go = trio.Event()
        self.waiting = trio.Event()
        self.asked = 0

    async def propose(self, view: RunView) -> Proposal:
        self.asked += 1
        if self.asked == 1:
            self.waiting.set()
            await self.go.wait()
        target = "B" if view.state == "A" else "A"
        raw = (
            f'{{"tool": "t", "args": {{"n": {self.asked}}}}}'
            if self.asked % 2
            else f'{{"next": "{target}"}}'
        )
        return Proposal(raw, TokenUsage(1, 1), self.model)


KINDS: dict[str, dict[str, Any]] = {
    "read_only": {"read_only": True},
    "idempotent": {"idempotent": True},
    "not_idempotent": {},
    "reconcile": {},
}


@pytest.fixture
async def store() -> AsyncIterator[PostgresStore]:
    schema = f"durable_{uuid.uuid4().hex[:10]}"
    opened = await open_postgres_store(DSN, schema=schema)
    try:
        yield opened
    finally:
        await opened.aclose()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_worker_that_lost_the_lease_starts_only_a_read_only_call(
    kind: str, store: PostgresStore
) -> None:
    ran: list[str] = []

    async def execute(args: Args, ctx: ToolContext) -> dict[str, int]:
        ran.append(ctx.key)
        return {"n": args.n}

    async def reconcile(key: str, args: Args, ctx: ToolContext) -> Any:
        return NotApplied

    options = dict(KINDS[kind])
    if kind == "reconcile":
        options["reconcile"] = reconcile
    spec = Machine(
        "leased",
        initial="A",
        states={
            "A": Worker(next=["B", "COMPLETED"], tools=["t"]),
            "B": Worker(next=["A", "COMPLETED"], tools=["t"]),
        },
        tools=[Tool("t", execute, args=Args, **options)],
    )
    provider = Held()
    other = await open_postgres_store(DSN, schema=store.schema)
    try:
        async with open_supervisor(
            [spec], store, provider=provider, owner="victim", lease_ttl=30
        ) as sup:
            handle = await sup.start_run("leased", run_id="r-1")
            await provider.waiting.wait()
            before = [type(e).__name__ for e in await store.load("r-1")]
            with psycopg.connect(DSN, autocommit=True) as conn:
                conn.execute(f'SET search_path TO "{store.schema}"')
                conn.execute("UPDATE leases SET expires = now() - interval '1 second'")
            assert [lease.run_id for lease in await other.claim("thief")] == ["r-1"]
            provider.go.set()  # the victim does not know yet: its model answers a call
            with pytest.raises(LeaseLost, match="worker 'victim' no longer holds"):
                await handle.wait()
    finally:
        await other.aclose()
    # Nothing the victim decided after the thief took the run was written.
    assert [type(e).__name__ for e in await store.load("r-1")] == before == ["RunStarted"]
    if kind == "read_only":
        assert ran  # it ran ahead of its intent: harmless, it changes nothing
    else:
        assert ran == []  # the fence refused its intent before the call could start
