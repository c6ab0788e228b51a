"""A supervisor on PostgreSQL holds a lease on every run it drives and writes fenced: a run
whose lease another process takes is dropped there alone (LeaseLost), the heartbeat finds
such a loss without a write, a drain stops runs at a step boundary, and the runs other
processes hold are left to them. Real PostgreSQL; skipped without INTERLOCK_PG_DSN."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import psycopg
import pytest
import trio
import trio.lowlevel

from interlock import (
    InterlockError,
    LeaseLost,
    Machine,
    NotEscalated,
    RunLeased,
    RunView,
    Tool,
    ToolContext,
    Worker,
    enqueue_run,
    open_supervisor,
)
from interlock.events import TokenUsage
from interlock.providers import Proposal
from interlock.stores import PostgresStore, open_postgres_store

pytestmark = pytest.mark.postgres

DSN = os.environ.get("INTERLOCK_PG_DSN", "")
if not DSN:
    pytest.skip(
        "INTERLOCK_PG_DSN is not set; set it to a PostgreSQL DSN to run the leased supervisor "
        "tests",
        allow_module_level=True,
    )


class NoteArgs(msgspec.Struct, forbid_unknown_fields=True):
    text: str


CALLS: list[str] = []


class Gate:
    """A tool that waits for ``open`` before it returns (to hold a call in flight)."""

    def __init__(self) -> None:
        self.open = trio.Event()
        self.entered = trio.Event()

    async def __call__(self, args: NoteArgs, ctx: ToolContext) -> dict[str, str]:
        self.entered.set()
        await self.open.wait()
        CALLS.append(ctx.key)
        return {"noted": args.text}


NOTE = '{"tool": "note", "args": {"text": "hi"}}'
DONE = '{"next": "COMPLETED", "data": {}}'


def machine(tool: Any) -> Machine:
    return Machine(
        "notes",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["note"])},
        tools=[Tool("note", tool, NoteArgs, idempotent=True)],
    )


class Script:
    """Answers NOTE, then DONE, per run; each answer waits for ``go`` (set by default)."""

    model = "script"

    def __init__(self, *, held: bool = False) -> None:
        self.go = trio.Event()
        if not held:
            self.go.set()
        self.calls: dict[str, int] = {}
        self.waiting = 0
        self.asked = trio.Event()  # set (and replaced) whenever a call starts waiting

    async def until_waiting(self, count: int) -> None:
        while self.waiting < count:
            await self.asked.wait()

    async def propose(self, view: RunView) -> Proposal:
        n = self.calls[view.run_id] = self.calls.get(view.run_id, 0) + 1
        self.waiting += 1
        self.asked.set()
        self.asked = trio.Event()
        try:
            await self.go.wait()
        finally:
            self.waiting -= 1
        return Proposal(NOTE if n == 1 else DONE, TokenUsage(1, 1), self.model)


async def immediate(args: NoteArgs, ctx: ToolContext) -> dict[str, str]:
    CALLS.append(ctx.key)
    return {"noted": args.text}


@pytest.fixture
async def store() -> AsyncIterator[PostgresStore]:
    schema = f"leased_{uuid.uuid4().hex[:10]}"
    opened = await open_postgres_store(DSN, schema=schema)
    try:
        yield opened
    finally:
        await opened.aclose()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def sql(store: PostgresStore, statement: str, params: tuple[Any, ...] = ()) -> list[Any]:
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{store.schema}"')
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def expire(store: PostgresStore, run_id: str) -> None:
    sql(
        store,
        "UPDATE leases SET expires = now() - interval '1 second' WHERE run_id = %s",
        (run_id,),
    )


def wait_in_database(
    store: PostgresStore, condition: str, params: tuple[Any, ...], what: str, timeout: float = 60.0
) -> None:
    """Block (the caller's thread: a stalled event loop, or a worker thread) until the
    query ``condition`` answers true. Leases are granted by the database's clock and a
    real ttl must pass, so this polls; the timeout bounds a hang, it checks no speed."""
    give_up = time.monotonic() + timeout
    while not sql(store, condition, params)[0][0]:
        assert time.monotonic() < give_up, f"gave up waiting for {what}"
        time.sleep(0.01)


def wait_for_lapse(store: PostgresStore, run_id: str) -> None:
    """Block until ``run_id``'s lease has expired by the database's clock."""
    query = "SELECT expires < now() FROM leases WHERE run_id = %s"
    wait_in_database(store, query, (run_id,), f"the lease of {run_id!r} to lapse")


async def kinds(store: PostgresStore, run_id: str) -> list[str]:
    return [type(event).__name__ for event in await store.load(run_id)]


async def test_runs_started_are_leased_to_the_supervisor_and_released_when_it_ends(
    store: PostgresStore,
) -> None:
    async with open_supervisor([machine(immediate)], store, provider=Script(), owner="me") as sup:
        assert sup.leases is not None
        assert sup.leases.owner == "me"
        handle = await sup.start_run("notes", run_id="r-1")
        assert sql(store, "SELECT owner, epoch FROM leases WHERE run_id = 'r-1'") == [("me", 1)]
        result = await handle.wait()
    assert result.outcome == "completed"
    # The run ended: its lease row says it is not live, so no worker claims it.
    assert sql(store, "SELECT live FROM leases WHERE run_id = 'r-1'") == [(False,)]
    assert await store.claim("other") == []


async def test_a_run_whose_lease_was_taken_is_dropped_alone(store: PostgresStore) -> None:
    """Three runs wait for the model; one's lease expires and another process claims it.
    When the model answers, that run's events are refused (LeaseLost on its handle, none
    of its new events in the journal); the two others commit in the same batches."""
    script = Script(held=True)
    CALLS.clear()
    other = await open_postgres_store(DSN, schema=store.schema)
    try:
        async with open_supervisor(
            [machine(immediate)], store, provider=script, owner="victim", lease_ttl=30
        ) as sup:
            handles = [await sup.start_run("notes", run_id=f"r-{i}") for i in range(3)]
            await script.until_waiting(3)
            expire(store, "r-1")
            taken = await other.claim("thief")
            assert [(lease.run_id, lease.epoch) for lease in taken] == [("r-1", 2)]
            before = await kinds(store, "r-1")
            script.go.set()
            with pytest.raises(LeaseLost, match=r"run 'r-1': worker 'victim' no longer holds"):
                await handles[1].wait()
            assert (await handles[0].wait()).outcome == "completed"
            assert (await handles[2].wait()).outcome == "completed"
            assert sup.leases is not None
            assert "r-1" not in sup.leases
            assert sup.leases.lost == 1
    finally:
        await other.aclose()
    assert await kinds(store, "r-1") == before == ["RunStarted"]
    assert sorted(CALLS) == ["r-0:WORK:3", "r-2:WORK:3"]  # r-1's tool never ran
    assert sql(store, "SELECT owner, epoch FROM leases WHERE run_id = 'r-1'") == [("thief", 2)]


async def test_the_heartbeat_finds_a_lost_lease_with_no_write_and_stops_the_run(
    store: PostgresStore,
) -> None:
    """A run waits for a model that does not answer: no write will tell it. Its lease is
    taken over; the next heartbeat (ttl 0.6 s: every 0.2 s) drops it and cuts the wait."""
    script = Script(held=True)
    other = await open_postgres_store(DSN, schema=store.schema)
    try:
        async with open_supervisor(
            [machine(immediate)], store, provider=script, owner="victim", lease_ttl=0.6
        ) as sup:
            handle = await sup.start_run("notes", run_id="r-1")
            await script.until_waiting(1)
            expire(store, "r-1")
            assert [lease.epoch for lease in await other.claim("thief", ttl=60)] == [2]
            with trio.fail_after(30), pytest.raises(LeaseLost):
                await handle.wait()
            assert script.waiting == 0  # the wait for the model was cut
    finally:
        await other.aclose()


async def test_heartbeats_keep_a_slow_run_leased_past_its_ttl(store: PostgresStore) -> None:
    """A model call held until a whole ttl past the end of the run's first lease (by the
    database's clock): the heartbeat renews it, no other process can claim the run
    meanwhile, and the run completes."""
    script = Script(held=True)
    async with open_supervisor(
        [machine(immediate)], store, provider=script, owner="me", lease_ttl=0.5
    ) as sup:
        handle = await sup.start_run("notes", run_id="r-1")
        await script.until_waiting(1)
        # Wait, by the database's clock, until a whole ttl past the first lease's
        # expiry: only a lease renewed twice or more is still held then.
        [(first,)] = await trio.to_thread.run_sync(
            sql, store, "SELECT expires FROM leases WHERE run_id = 'r-1'"
        )
        past = "SELECT now() > %s + interval '0.5 seconds'"
        await trio.to_thread.run_sync(
            wait_in_database, store, past, (first,), "a ttl past the first expiry"
        )
        assert await store.claim("thief") == []
        script.go.set()
        assert (await handle.wait()).outcome == "completed"
        assert sup.leases is not None
        assert sup.leases.lost == 0


async def test_a_drain_finishes_the_call_in_flight_and_starts_no_model_call(
    store: PostgresStore,
) -> None:
    gate = Gate()
    script = Script()
    CALLS.clear()
    async with open_supervisor([machine(gate)], store, provider=script, owner="me") as sup:
        handle = await sup.start_run("notes", run_id="r-1")
        await gate.entered.wait()
        sup.drain()
        gate.open.set()
        with trio.fail_after(30):
            await sup.wait_undriven()
        with pytest.raises(InterlockError, match="left unfinished in state 'WORK' by a drain"):
            await handle.wait()
        assert script.calls == {"r-1": 1}  # the model was not asked again
        assert sup.leases is not None
        await sup.leases.release(["r-1"])
    # The call is committed, and the run is claimable at once, at the next epoch.
    assert (await kinds(store, "r-1"))[-2:] == ["IntentRecorded", "ToolCommitted"]
    assert CALLS == ["r-1:WORK:3"]
    assert [(lease.run_id, lease.epoch) for lease in await store.claim("next")] == [("r-1", 2)]


async def test_resume_takes_only_what_nobody_holds(store: PostgresStore) -> None:
    """Two runs enqueued, one of them claimed by a live worker: a resume drives the other
    one alone, and leaves the held one to its worker."""
    spec = machine(immediate)
    await enqueue_run(store, spec, run_id="free")
    await enqueue_run(store, spec, run_id="held")
    other = await open_postgres_store(DSN, schema=store.schema)
    try:
        held = await other.claim("worker-1", run_ids=["held"], ttl=60)
    finally:
        await other.aclose()
    assert [(lease.run_id, lease.epoch) for lease in held] == [("held", 1)]
    async with open_supervisor([spec], store, provider=Script(), owner="resume") as sup:
        handles = await sup.resume_unfinished()
        assert [handle.run_id for handle in handles] == ["free"]
        assert (await handles[0].wait()).outcome == "completed"
    assert (await store.get_run("held")).outcome == "running"
    assert await kinds(store, "held") == ["RunStarted"]
    assert [lease.run_id for lease in await store.held_elsewhere("resume")] == ["held"]


class Malformed:
    """Answers what no gate accepts, so the run escalates on consecutive failures."""

    model = "malformed"

    async def propose(self, view: RunView) -> Proposal:
        return Proposal("not json", TokenUsage(1, 1), self.model)


async def test_an_operator_cannot_take_a_run_another_process_drives(
    store: PostgresStore,
) -> None:
    """A run another process drives is left alone: one running there is not in the queue
    (the escalation rule names its state), and one the index shows escalated while another
    process still holds its lease is refused by the lease, not taken (issue 32)."""
    spec = machine(immediate)
    await enqueue_run(store, spec, run_id="r-1")
    sql(store, "UPDATE leases SET owner = 'w', epoch = 1, expires = now() + interval '1 hour'")
    async with open_supervisor([spec], store, provider=Script(), owner="op") as sup:
        with pytest.raises(
            NotEscalated, match=r"^run 'r-1' is not escalated; it is running in state 'WORK'"
        ):
            await sup.abort_escalated("r-1", by="ops")
    async with open_supervisor([spec], store, provider=Malformed(), owner="w") as sup:
        handle = await sup.start_run("notes", run_id="r-2")
        assert (await handle.wait()).outcome == "escalated"
    sql(
        store,
        "UPDATE leases SET owner = 'w', epoch = epoch + 1, live = true, "
        "expires = now() + interval '1 hour' "
        "WHERE run_id = 'r-2'",
    )
    before = await store.load("r-2")
    async with open_supervisor([spec], store, provider=Script(), owner="op") as sup:
        with pytest.raises(RunLeased, match="leased by another process, which drives it"):
            await sup.abort_escalated("r-2", by="ops")
    assert await store.load("r-2") == before
    assert (await store.get_run("r-2")).outcome == "escalated"


async def test_external_runs_are_not_leased_and_any_process_drives_them(
    store: PostgresStore,
) -> None:
    """An external run started by one supervisor is driven on by another (a second
    gateway): it is loaded on its first request; workers never claim it."""
    spec = machine(immediate)
    from interlock.messages import Propose

    async with open_supervisor([spec], store, owner="gateway-a") as first:
        await first.start_run("notes", run_id="x-1", external=True)
    assert await store.claim("worker") == []
    other = await open_postgres_store(DSN, schema=store.schema)
    try:
        async with open_supervisor([spec], other, owner="gateway-b") as second:
            verdict = await second.submit(Propose(run_id="x-1", seq=1, raw=DONE, model="m"))
            assert verdict.accepted
            assert verdict.outcome == "completed"
    finally:
        await other.aclose()
    assert (await store.get_run("x-1")).outcome == "completed"


async def test_a_worker_on_sqlite_is_refused(tmp_path: Any) -> None:
    from interlock import App, run_worker

    with pytest.raises(InterlockError, match="a worker needs a PostgreSQL journal"):
        await run_worker(App([machine(immediate)], provider=Script()), str(tmp_path / "j.db"))


async def test_circuits_are_per_process(store: PostgresStore) -> None:
    """Circuits are kept per process, not in the database: three failures open the
    circuit of the process that saw them, and another process on the same journal still
    sends its first call downstream. With W workers a dead downstream therefore sees up to
    W times the calls one process sends before its circuit opens (README: Scale-out)."""
    from interlock import BreakerPolicy, ToolError

    calls: list[str] = []

    async def down(args: NoteArgs, ctx: ToolContext) -> dict[str, str]:
        calls.append(ctx.key)
        raise ToolError("downstream is down", applied=False)

    spec = Machine(
        "notes",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["note"])},
        tools=[Tool("note", down, NoteArgs, idempotent=True)],
        breakers=BreakerPolicy(consecutive_failures=1, circuit_failures=3, circuit_cooldown=600),
    )
    other = await open_postgres_store(DSN, schema=store.schema)
    try:
        async with (
            open_supervisor([spec], store, provider=Script(), owner="a") as first,
            open_supervisor([spec], other, provider=Script(), owner="b") as second,
        ):
            for i in range(3):  # one at a time: each failure is counted before the next call
                await (await first.start_run("notes", run_id=f"a-{i}")).wait()
            assert first.circuit_state("note") == "open"
            assert second.circuit_state("note") == "closed"
            await (await second.start_run("notes", run_id="b-0")).wait()
            await (await first.start_run("notes", run_id="a-3")).wait()
    finally:
        await other.aclose()
    assert calls == ["a-0:WORK:3", "a-1:WORK:3", "a-2:WORK:3", "b-0:WORK:3"]
    assert (await store.get_run("a-3")).outcome == "escalated"  # refused by a's open circuit


async def test_a_stale_external_run_is_refused_alone_in_its_batch(store: PostgresStore) -> None:
    """Two processes drive external runs of one journal (two gateways). One advances x-1
    behind the other's back; the other's next batch holds x-1 (stale) and y-1: x-1 alone is
    refused, with an error that says to read the run again, and y-1 commits."""
    from interlock import StoreError
    from interlock.messages import Propose, Sync

    spec = machine(immediate)
    other = await open_postgres_store(DSN, schema=store.schema)
    try:
        async with (
            open_supervisor([spec], store, owner="a") as first,
            open_supervisor([spec], other, owner="b") as second,
        ):
            await first.start_run("notes", run_id="x-1", external=True)
            await first.start_run("notes", run_id="y-1", external=True)
            await second.submit(Propose(run_id="x-1", seq=1, raw=NOTE, model="m"))
            first.submit_nowait(Propose(run_id="x-1", seq=1, raw=DONE, model="m"))
            first.submit_nowait(Propose(run_id="y-1", seq=1, raw=DONE, model="m"))
            await first.request(Sync(run_id="y-1"))
            with pytest.raises(StoreError, match="'x-1' was advanced by another process"):
                await first.request(Sync(run_id="x-1"))
            assert first.statistics().runs_in_flight == 1  # y-1 is still registered
            assert first.leases is not None
            assert first.leases.lost == 0  # not a lost lease
    finally:
        await other.aclose()
    assert (await store.get_run("y-1")).outcome == "completed"
    assert await kinds(store, "x-1") == ["RunStarted", "ModelCalled", "IntentRecorded"]


class Stalling:
    """A tool whose first attempt stalls the whole process (a blocking call: as a SIGSTOP
    or a long GC pause would) until the run's lease has expired by the database's clock,
    then sends its side effect; ``during`` runs before the process wakes (another process
    taking the lease, say)."""

    def __init__(self, store: PostgresStore, during: Any = None) -> None:
        self.store = store
        self.during = during
        self.sent: list[tuple[str, int]] = []
        self.epochs: list[int] = []

    async def __call__(self, args: NoteArgs, ctx: ToolContext) -> dict[str, str]:
        self.epochs.append(ctx.epoch)
        if ctx.attempt == 1:
            # The point: the event loop stops, no heartbeat runs, past the lease's end.
            wait_for_lapse(self.store, "r-1")
            if self.during is not None:
                self.during()
        await trio.lowlevel.checkpoint()  # the request would leave here
        self.sent.append((ctx.key, ctx.attempt))
        return {"noted": args.text}


async def test_a_side_effect_is_not_sent_past_a_stall_that_lost_the_lease(
    store: PostgresStore,
) -> None:
    """The process stalls inside a tool call longer than the lease; meanwhile another
    process takes the run. When it wakes, the call is cut before it sends anything, and
    the run is dropped with LeaseLost: the new owner alone decides what happens to it."""

    def take_over() -> None:  # the lease has lapsed: another worker claims the run
        taken = sql(
            store,
            "UPDATE leases SET owner = 'thief', epoch = epoch + 1, "
            "expires = now() + interval '1 hour' WHERE run_id = 'r-1' AND expires < now() "
            "RETURNING epoch",
        )
        assert taken == [(2,)]

    tool = Stalling(store, take_over)
    async with open_supervisor(
        [machine(tool)], store, provider=Script(), owner="victim", lease_ttl=0.6
    ) as sup:
        handle = await sup.start_run("notes", run_id="r-1")
        with trio.fail_after(30), pytest.raises(LeaseLost):
            await handle.wait()
    assert tool.sent == []
    assert (await kinds(store, "r-1"))[-1] == "IntentRecorded"  # in doubt, for 'thief'


async def test_a_stall_that_kept_the_lease_cuts_the_attempt_and_retries_it(
    store: PostgresStore,
) -> None:
    """The same stall with nobody taking the run: the attempt in flight is cut when the
    lease is no longer surely held, the lease is confirmed, and the idempotent call is
    tried again with its key: one side effect, from the second attempt."""
    tool = Stalling(store)
    async with open_supervisor(
        [machine(tool)], store, provider=Script(), owner="me", lease_ttl=0.6
    ) as sup:
        handle = await sup.start_run("notes", run_id="r-1")
        with trio.fail_after(30):
            assert (await handle.wait()).outcome == "completed"
    assert tool.sent == [("r-1:WORK:3", 2)]
    assert tool.epochs == [1, 1]  # the downstream sees the lease epoch (still 1: kept)


async def test_an_attempt_cut_by_a_stall_is_in_doubt_and_not_the_tools_failure(
    store: PostgresStore,
) -> None:
    """A call of a tool that is not safe to repeat, cut because the process stalled past
    its lease (kept): it is in doubt (escalated, no reconcile), and the tool's circuit,
    which opens at one failure here, does not count it."""
    from interlock import BreakerPolicy

    tool = Stalling(store)
    spec = Machine(
        "notes",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["note"])},
        tools=[Tool("note", tool, NoteArgs)],
        breakers=BreakerPolicy(circuit_failures=1),
    )
    async with open_supervisor([spec], store, provider=Script(), owner="me", lease_ttl=0.6) as sup:
        result = await (await sup.start_run("notes", run_id="r-1")).wait()
        assert sup.circuit_state("note") == "closed"
    assert (result.outcome, result.reason) == ("escalated", "in_doubt_side_effect")
    assert tool.sent == []  # cut before it sent anything, and not tried again


async def test_an_operator_takes_a_run_the_moment_its_worker_escalated_it(
    store: PostgresStore,
) -> None:
    """A worker escalated a run (its lease row: still the worker's, unexpired, not live)
    and goes on with others; no one drives that run, so an operator takes it at once."""
    spec = machine(immediate)
    await enqueue_run(store, spec, run_id="e-1")
    sql(
        store,
        "UPDATE leases SET owner = 'worker', epoch = 1, live = false, "
        "expires = now() + interval '1 hour' WHERE run_id = 'e-1'",
    )
    async with open_supervisor([spec], store, provider=Script(), owner="ops") as ops:
        assert ops.leases is not None
        assert [lease.epoch for lease in await ops.leases.take(["e-1"])] == [2]


class ClockedLeases:
    """A leasing store whose leases expire on trio's clock, to check a process's sure
    time against the real expiry (issue 33). A claim or renewal waits ``queued`` seconds
    for a connection, is then sent (its lease says when), and takes ``trip`` seconds to
    reach the server, which grants the lease for ``ttl`` seconds from then: it really
    expires later than ``sent + ttl``, never earlier. ``taken``: runs another process
    has claimed (renewals of them come back empty)."""

    def __init__(self, *, queued: float, trip: float) -> None:
        self.queued = queued
        self.trip = trip
        self.expires: dict[str, float] = {}
        self.taken: set[str] = set()
        self.renewals = 0

    async def _grant(self, owner: str, run_ids: Any, ttl: float) -> list[Any]:
        from interlock.stores._leases import Lease

        await trio.sleep(self.queued)
        sent = trio.current_time()
        await trio.sleep(self.trip)
        granted = []
        for run_id in run_ids:
            if run_id in self.taken:
                continue
            self.expires[run_id] = trio.current_time() + ttl
            granted.append(Lease(run_id=run_id, owner=owner, epoch=1, expires=0.0, sent=sent))
        return granted

    async def claim(self, owner: str, *, ttl: float, run_ids: Any, **_: Any) -> list[Any]:
        return await self._grant(owner, run_ids, ttl)

    async def renew(self, owner: str, run_ids: Any, *, ttl: float) -> list[Any]:
        self.renewals += 1
        return await self._grant(owner, run_ids, ttl)


class Send:
    """A tool that is not safe to repeat: ``wait`` seconds after it starts, it sends."""

    def __init__(self, wait: float = 0.0) -> None:
        self.wait = wait
        self.sent: list[float] = []

    async def __call__(self, args: NoteArgs, ctx: ToolContext) -> dict[str, str]:
        await trio.sleep(self.wait)
        self.sent.append(trio.current_time())
        return {"noted": args.text}


async def leased_call(leases: Any, send: Send) -> tuple[Any, bool]:
    """One attempt of a call of ``send`` (not idempotent) under r-1's lease, as the actor
    makes it."""
    from interlock.runtime._actor import _under_lease

    tool = Tool("send", send, NoteArgs)
    assert not tool.safe_to_repeat
    ctx = ToolContext(run_id="r-1", state="WORK", key="r-1:WORK:3", attempt=1, epoch=1)
    return await _under_lease(leases, "r-1", tool, NoteArgs(text="hi"), ctx)


def clocked_leases(store: ClockedLeases, lost: dict[str, Any]) -> Any:
    from interlock.runtime._leasing import Leases

    return Leases(store, "me", 1.0, is_external=lambda run_id: False, lose=lost.update)


async def test_a_call_under_a_lease_is_cut_before_the_lease_really_expires(
    autojump_clock: Any,
) -> None:
    """(issue 33) A process takes its lease as surely held for part of the ttl, counted
    from when the claim or renewal was sent: never up to or past the real expiry. A
    side effect that would go out at the expiry is cut first, after the claim and after
    every renewal; and the sure time never lies past the expiry the store granted."""
    store = ClockedLeases(queued=0.3, trip=0.05)
    lost: dict[str, Any] = {}
    leases = clocked_leases(store, lost)
    await leases.take(["r-1"])
    send = Send(wait=store.expires["r-1"] - trio.current_time())  # out at the expiry
    assert await leased_call(leases, send) == (None, True)  # cut
    assert send.sent == []
    assert trio.current_time() < store.expires["r-1"]
    assert leases.until["r-1"] <= store.expires["r-1"]
    for _ in range(3):  # the heartbeat: each renewal counts from when it was sent
        await leases.renew(lambda run_id: True)
        send = Send(wait=store.expires["r-1"] - trio.current_time())
        assert await leased_call(leases, send) == (None, True)
        assert send.sent == []
        assert trio.current_time() < store.expires["r-1"]
        assert leases.until["r-1"] <= store.expires["r-1"]
    assert lost == {}


async def test_a_call_is_not_started_past_the_sure_time_without_confirming_the_lease(
    autojump_clock: Any,
) -> None:
    """(issue 33) The process stalled past its lease's expiry, and another took the run.
    A call of a tool not safe to repeat is not started on the old sure time: the lease
    is confirmed first, the store says it is gone, and nothing is sent (LeaseLost)."""
    store = ClockedLeases(queued=0.0, trip=0.05)
    lost: dict[str, Any] = {}
    leases = clocked_leases(store, lost)
    await leases.take(["r-1"])
    await trio.sleep_until(store.expires["r-1"])  # the stall: the lease really expired
    store.taken.add("r-1")  # and another process claimed the run
    renewals = store.renewals
    send = Send()
    with pytest.raises(LeaseLost):
        await leased_call(leases, send)
    assert send.sent == []
    assert store.renewals == renewals + 1  # it asked the store before starting
    assert set(lost) == {"r-1"}
    assert "r-1" not in leases
