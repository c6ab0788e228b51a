"""Fewer flushes, same guarantees (#19): a verdict whose action is harmless to repeat is sent
before its batch is durable; the intent of any other call is durable before it runs.

A store whose every append takes one second of trio's (autojumped) clock counts the
appends, the flushes, and what the run does while one is in flight: the seconds a run
takes are the flushes it waited for, one after another. One run at a time, 20 steps, a
no-op tool of each kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import trio

from interlock import Machine, NotApplied, Tool, ToolContext, Worker, open_supervisor, replay
from interlock.core._exceptions import StoreError
from interlock.events import Event, IntentRecorded, ToolCommitted
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore

STEPS = 20
FINISH = '{"next": "COMPLETED"}'


class SlowStore(MemoryStore):
    """A memory journal whose every append takes a second (a flush); MemoryStore counts
    them (``appends``, the batches written)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = False
        self.written: list[Event] = []
        self.batches: list[list[str]] = []

    async def append(self, events: Sequence[Event]) -> None:
        await trio.sleep(1)
        if self.fail_next:
            self.fail_next = False
            raise StoreError("journal write failed: disk full")
        await super().append(events)
        self.written += events
        self.batches.append([type(e).__name__ for e in events])


class Args(msgspec.Struct):
    n: int  # distinct per call, so the repeat breaker never trips


def call(n: int) -> str:
    return f'{{"tool": "noop", "args": {{"n": {n}}}}}'


KINDS: dict[str, dict[str, Any]] = {
    "read_only": {"read_only": True},
    "idempotent": {"idempotent": True},
    "not_idempotent": {},
    "reconcile": {},
}


class Noop:
    """The no-op tool; records, for each call, whether its intent was durable as it ran."""

    def __init__(self, store: SlowStore) -> None:
        self.store = store
        self.durable: list[bool] = []
        self.ran = trio.Event()

    async def execute(self, args: Any, ctx: ToolContext) -> dict[str, bool]:
        self.durable.append(
            any(type(e) is IntentRecorded and e.key == ctx.key for e in self.store.written)
        )
        self.ran.set()
        return {"ok": True}

    async def reconcile(self, key: str, args: Any, ctx: ToolContext) -> Any:
        return NotApplied


def build(kind: str, noop: Noop, *, moves: bool) -> Machine:
    options = dict(KINDS[kind])
    if kind == "reconcile":
        options["reconcile"] = noop.reconcile
    tool = Tool("noop", noop.execute, args=Args, **options)
    if moves:  # each step calls the tool, then moves on to the other state
        states = {
            "A": Worker(next=["B", "COMPLETED"], tools=["noop"]),
            "B": Worker(next=["A", "COMPLETED"], tools=["noop"]),
        }
        return Machine("steps", initial="A", states=states, tools=[tool])
    states = {"WORK": Worker(next=["COMPLETED"], tools=["noop"])}
    return Machine("steps", initial="WORK", states=states, tools=[tool])


def script(moves: bool) -> list[str]:
    if not moves:  # 19 calls, then the run ends: 20 model calls
        return [*map(call, range(STEPS - 1)), FINISH]
    raws = []
    for step in range(STEPS):  # a call, then a move: 40 model calls, then the end
        target = "B" if step % 2 == 0 else "A"
        raws += [call(step), f'{{"next": "{target}"}}']
    return [*raws, FINISH]


async def one_run(kind: str, *, moves: bool) -> tuple[SlowStore, Noop, float, Any]:
    store = SlowStore()
    noop = Noop(store)
    spec = build(kind, noop, moves=moves)
    provider = ScriptedProvider(script(moves))
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        handle = await sup.start_run("steps", run_id="r-1")
        started = trio.current_time()
        result = await handle.wait()
        waited = trio.current_time() - started
    assert result.outcome == "completed"
    events = await store.load("r-1")
    assert replay(events, build(kind, Noop(store), moves=moves)).ok
    assert sum(type(e) is ToolCommitted for e in events) == STEPS - (0 if moves else 1)
    return store, noop, waited, events


# The flushes a run waits for after its start, per kind of tool. Before #19 a call of any
# kind waited for its intent and a move for its own flush, and the commit got one of its
# own: about 1.5 flushes per step of calls, 2.6 per step of a call and a move.
@pytest.mark.parametrize("kind", ["idempotent", "reconcile"])
async def test_a_step_of_a_call_that_is_safe_to_repeat_or_reconciles_is_one_flush(
    kind: str, autojump_clock: Any
) -> None:
    store, noop, waited, _ = await one_run(kind, moves=False)
    # Each call waits for its intent, written with the commit before it and its model call;
    # the run's end is the 20th.
    assert waited == STEPS
    assert store.appends == STEPS + 1  # the run's start, too
    assert noop.durable == [True] * (STEPS - 1)  # every intent was durable as its call ran

    store, noop, waited, _ = await one_run(kind, moves=True)
    assert waited == STEPS + 1
    assert noop.durable == [True] * STEPS
    # The commit, the move and the next call's model call and intent: one flush.
    step = ["ToolCommitted", "ModelCalled", "Transitioned", "ModelCalled", "IntentRecorded"]
    assert store.batches[2:-1] == [step] * (STEPS - 1)


async def test_a_read_only_run_waits_only_for_its_end(autojump_clock: Any) -> None:
    for moves in (False, True):
        store, noop, waited, events = await one_run("read_only", moves=moves)
        # Its steps are written behind it, in a few batches, one after another; it waits
        # for the one in flight as it ends, and for its end.
        assert waited <= 2
        assert store.appends <= 4
        assert noop.durable == [False] * (STEPS - (0 if moves else 1))
        assert [e.seq for e in events] == list(range(1, len(events) + 1))


async def test_a_call_that_is_not_idempotent_has_its_intent_and_its_commit_flushed_at_once(
    autojump_clock: Any,
) -> None:
    store, noop, waited, _ = await one_run("not_idempotent", moves=False)
    assert noop.durable == [True] * (STEPS - 1)
    # Its commit is written at once, not with the next call (a crash in between would leave
    # the call in doubt, escalated): a step is one flush, or two when the next proposal
    # comes while the commit's is in flight.
    assert STEPS < waited <= 2 * STEPS

    store, noop, waited, _ = await one_run("not_idempotent", moves=True)
    assert noop.durable == [True] * STEPS
    assert waited <= 2 * STEPS + 1  # the move shares the next intent's flush
    assert all(
        batch[0] != "ToolCommitted" or "IntentRecorded" not in batch for batch in store.batches
    )


async def test_a_failed_write_stops_a_run_that_ran_ahead_and_writes_nothing_after_it(
    autojump_clock: Any,
) -> None:
    """A read-only call was answered before its batch was written, and that write fails:
    the run is dropped, what its actor decided meanwhile is never written, and a resume
    refolds it from what is durable and finishes it."""
    store = SlowStore()
    noop = Noop(store)
    spec = build("read_only", noop, moves=False)
    async with open_supervisor(
        [spec], store, provider=ScriptedProvider(script(False)), clock=trio.current_time
    ) as sup:
        handle = await sup.start_run("steps", run_id="r-1")
        await noop.ran.wait()  # the first call ran, ahead of its intent
        store.fail_next = True
        with pytest.raises(StoreError, match="disk full"):
            await handle.wait()
    events = await store.load("r-1")
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert not any(type(e) is IntentRecorded for e in events)  # the lost batch held it

    async with open_supervisor(
        [spec], store, provider=ScriptedProvider(script(False)), clock=trio.current_time
    ) as sup:
        (handle,) = await sup.resume_unfinished()
        assert (await handle.wait()).outcome == "completed"
    events = await store.load("r-1")
    assert replay(events, build("read_only", Noop(store), moves=False)).ok


@pytest.mark.parametrize("kind", ["idempotent", "reconcile"])
async def test_a_call_that_names_its_next_state_is_one_flush_a_step(
    kind: str, autojump_clock: Any
) -> None:
    """A call-and-move step: its commit and its move share the next call's flush."""
    store = SlowStore()
    noop = Noop(store)
    options = dict(KINDS[kind])
    if kind == "reconcile":
        options["reconcile"] = noop.reconcile
    spec = Machine(
        "steps",
        initial="A",
        states={
            "A": Worker(next=["B", "COMPLETED"], tools=["noop"], call_and_move=True),
            "B": Worker(next=["A", "COMPLETED"], tools=["noop"], call_and_move=True),
        },
        tools=[Tool("noop", noop.execute, args=Args, **options)],
    )
    raws = [
        f'{{"tool": "noop", "args": {{"n": {n}}}, "next": "{"B" if n % 2 == 0 else "A"}"}}'
        for n in range(STEPS)
    ]
    provider = ScriptedProvider([*raws, FINISH])
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        handle = await sup.start_run("steps", run_id="r-1")
        started = trio.current_time()
        assert (await handle.wait()).outcome == "completed"
        waited = trio.current_time() - started
    assert waited == STEPS + 1
    assert noop.durable == [True] * STEPS
    step = ["ToolCommitted", "Transitioned", "ModelCalled", "IntentRecorded"]
    assert store.batches[2:-1] == [step] * (STEPS - 1)
    assert replay(await store.load("r-1"), spec).ok


async def test_leaving_the_supervisor_writes_what_was_answered_before_its_flush(
    autojump_clock: Any,
) -> None:
    """A move is answered before its flush and written with the next one. When the block
    is left (cancelled, as by Ctrl-C) while the run waits for its next model call, the
    move is written on the way out, not lost for a resume to redo."""
    store = SlowStore()
    noop = Noop(store)
    spec = build("read_only", noop, moves=True)

    class MoveThenHang:
        model = "m"
        calls = 0

        async def propose(self, view: Any) -> Any:
            from interlock.events import TokenUsage
            from interlock.providers import Proposal

            self.calls += 1
            if self.calls == 2:
                self.asked_again.set()
            if self.calls == 1:
                return Proposal('{"next": "B"}', TokenUsage(1, 1), "m")
            await trio.sleep_forever()

    provider = MoveThenHang()
    provider.asked_again = trio.Event()  # type: ignore[attr-defined]
    with trio.CancelScope() as scope:
        async with open_supervisor(
            [spec], store, provider=provider, clock=trio.current_time
        ) as sup:
            await sup.start_run("steps", run_id="r-1")
            await provider.asked_again.wait()  # type: ignore[attr-defined]
            assert "Transitioned" not in [type(e).__name__ for e in store.written]
            scope.cancel()
            await trio.sleep(1)
    assert scope.cancelled_caught
    assert [type(e).__name__ for e in await store.load("r-1")][-1] == "Transitioned"
