"""The supervisor: journals, compaction, cancellation, protocol errors, many runs, statistics."""

from __future__ import annotations

import functools
import re
from typing import Any

import msgspec
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import wait_all_tasks_blocked

from interlock import (
    BreakerPolicy,
    InterlockError,
    Machine,
    ProtocolError,
    Reject,
    RetryPolicy,
    RunNotFound,
    RunResult,
    RunView,
    StoreError,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
)
from interlock.core._events import (
    ModelCalled,
    ProposalRejected,
    hash_prompt,
    hash_prompt_after,
    whole_prompts,
)
from interlock.core._hotpath import common_affixes
from interlock.core._view import fold
from interlock.events import TokenUsage, Violation
from interlock.messages import Propose, Report, Start, Verdict
from interlock.providers import Frame, Proposal, ScriptedProvider, render_prompt
from interlock.stores import MemoryStore


class LookupArgs(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


class RefundArgs(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    amount: float


async def lookup_order(args: LookupArgs, ctx: ToolContext) -> dict[str, Any]:
    return {"order_id": args.order_id, "total": 100.0}


REFUNDS: list[tuple[str, int]] = []


async def refund(args: RefundArgs, ctx: ToolContext) -> dict[str, float]:
    REFUNDS.append((ctx.key, ctx.attempt))
    return {"refunded": args.amount}


def within_order_total(args: RefundArgs, view: RunView) -> Reject | None:
    order = view.last_result("lookup_order")
    if order is None:
        return Reject("args.order_id: the order was not looked up", "call lookup_order first")
    if args.amount > order["total"]:
        return Reject(
            f"args.amount: {args.amount} exceeds the order total {order['total']}",
            f"propose amount <= {order['total']}",
            "args.amount",
        )
    return None


def refund_machine(**kwargs: Any) -> Machine:
    return Machine(
        "refund",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order", "refund"])},
        tools=[
            Tool("lookup_order", lookup_order, LookupArgs, read_only=True),
            Tool("refund", refund, RefundArgs, guards=[within_order_total], idempotent=True),
        ],
        **kwargs,
    )


LOOKUP = '{"tool": "lookup_order", "args": {"order_id": "o1"}}'
REFUND_150 = '{"tool": "refund", "args": {"order_id": "o1", "amount": 150}}'
REFUND_100 = '{"tool": "refund", "args": {"order_id": "o1", "amount": 100}}'
DONE = '{"next": "COMPLETED", "data": {"answer": "refunded 100.0"}}'
GUARD_VIOLATION = Violation(
    "guard",
    "args.amount",
    "args.amount: 150.0 exceeds the order total 100.0",
    "propose amount <= 100.0",
)


class Blocked:
    """A provider that never answers until ``release`` is set, then answers ``raw``."""

    model = "blocked"

    def __init__(self, raw: str = DONE) -> None:
        self.raw = raw
        self.release = trio.Event()
        self.waiting = 0

    async def propose(self, view: RunView) -> Proposal:
        self.waiting += 1
        await self.release.wait()
        return Proposal(self.raw, TokenUsage(1, 1), self.model)


def kinds(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [kind for kind, _ in events]


# -- journals -------------------------------------------------------------------------------


async def test_happy_path_journal(memory_store: MemoryStore, events_of: Any) -> None:
    REFUNDS.clear()
    provider = ScriptedProvider([LOOKUP, REFUND_150, REFUND_100, DONE])
    async with open_supervisor(
        [refund_machine()], memory_store, provider=provider, clock=trio.current_time
    ) as sup:
        handle = await sup.start_run("refund", {"order": "o1"}, run_id="r-1")
        result = await handle.wait()
    answer = {"answer": "refunded 100.0"}
    assert result == RunResult("r-1", "refund", "COMPLETED", "completed", answer, "", seq=12)
    assert handle.done
    assert REFUNDS == [("r-1:WORK:8", 1)]

    def model_called(raw: str) -> tuple[str, dict[str, Any]]:
        return ("ModelCalled", {"state": "WORK", "model": "scripted", "raw": raw, "error": ""})

    assert await events_of(memory_store, "r-1") == [
        ("RunStarted", {"machine": "refund", "state": "WORK", "inputs": {"order": "o1"}}),
        model_called(LOOKUP),
        (
            "IntentRecorded",
            {
                "state": "WORK",
                "tool": "lookup_order",
                "args": {"order_id": "o1"},
                "key": "r-1:WORK:3",
            },
        ),
        (
            "ToolCommitted",
            {
                "tool": "lookup_order",
                "key": "r-1:WORK:3",
                "result": {"order_id": "o1", "total": 100.0},
                "attempts": 1,
                "reused": False,
            },
        ),
        model_called(REFUND_150),
        ("ProposalRejected", {"state": "WORK", "violations": (GUARD_VIOLATION,)}),
        model_called(REFUND_100),
        (
            "IntentRecorded",
            {
                "state": "WORK",
                "tool": "refund",
                "args": {"order_id": "o1", "amount": 100.0},
                "key": "r-1:WORK:8",
            },
        ),
        (
            "ToolCommitted",
            {
                "tool": "refund",
                "key": "r-1:WORK:8",
                "result": {"refunded": 100.0},
                "attempts": 1,
                "reused": False,
            },
        ),
        model_called(DONE),
        (
            "Transitioned",
            {"src": "WORK", "dst": "COMPLETED", "delta": answer, "reason": "proposal"},
        ),
        ("Completed", {"state": "COMPLETED", "output": answer}),
    ]
    record = await memory_store.get_run("r-1")
    assert (record.state, record.outcome, record.seq) == ("COMPLETED", "completed", 12)


async def test_event_timestamps_come_from_the_clock(
    memory_store: MemoryStore, autojump_clock: Any
) -> None:
    provider = ScriptedProvider([LOOKUP, DONE], latency=5.0)
    async with open_supervisor(
        [refund_machine()], memory_store, provider=provider, clock=trio.current_time
    ) as sup:
        start = trio.current_time()
        await (await sup.start_run("refund", run_id="r-1")).wait()
    stamps = [e.ts - start for e in await memory_store.load("r-1")]
    assert stamps == [0.0, 5.0, 5.0, 5.0, 10.0, 10.0, 10.0]


async def test_failures_are_compacted_in_the_view_but_not_in_the_journal(
    memory_store: MemoryStore,
) -> None:
    histories: list[tuple[Frame, ...]] = []
    script = iter([LOOKUP, REFUND_150, REFUND_150, REFUND_150, REFUND_100, DONE])

    def oracle(view: RunView) -> str:
        histories.append(view.history)
        return next(script)

    spec = refund_machine(breakers=BreakerPolicy(consecutive_failures=5))
    async with open_supervisor([spec], memory_store, provider=ScriptedProvider(oracle)) as sup:
        result = await (await sup.start_run("refund", run_id="r-1")).wait()
    assert result.outcome == "completed"

    looked_up = Frame(
        "tool_result",
        4,
        'lookup_order({"order_id":"o1"}) -> {"order_id":"o1","total":100.0}',
        first_seq=4,
    )
    rejected = GUARD_VIOLATION.message
    assert histories[:5] == [
        (),
        (looked_up,),
        (looked_up, Frame("rejected", 6, rejected, first_seq=6, violations=(GUARD_VIOLATION,))),
        (
            looked_up,
            Frame(
                "rejected",
                8,
                f"2 attempts rejected: {rejected}",
                count=2,
                first_seq=6,
                violations=(GUARD_VIOLATION,),
            ),
        ),
        (
            looked_up,
            Frame(
                "rejected",
                10,
                f"3 attempts rejected: {rejected}",
                count=3,
                first_seq=6,
                violations=(GUARD_VIOLATION,),
            ),
        ),
    ]
    assert histories[4][1].compacted

    events = await memory_store.load("r-1")
    assert [e.seq for e in events if type(e).__name__ == "ProposalRejected"] == [6, 8, 10]
    # the prompt of the fifth model call carries the three rejections as one line and one fix
    prompt = [whole for _, whole in whole_prompts(events)][4]
    assert prompt.count("] rejected: ") == 1
    assert f"  [10] rejected: 3 attempts rejected: {rejected}\n" in prompt
    assert prompt.count("fix: propose amount <= 100.0") == 1


class Recording:
    """Answers from a script and keeps every prompt it was given (the rendered one, or its own)."""

    model = "recording"

    def __init__(self, script: list[str], prompts: list[str] | None = None) -> None:
        self.script = iter(script)
        self.own = iter(prompts) if prompts is not None else None
        self.given: list[str] = []

    async def propose(self, view: RunView) -> Proposal:
        prompt = next(self.own) if self.own is not None else render_prompt(view)
        self.given.append(prompt)
        return Proposal(next(self.script), TokenUsage(len(prompt) // 4, 5), self.model, prompt)


async def test_prompts_are_journaled_as_deltas_and_rebuilt_exactly(
    memory_store: MemoryStore,
) -> None:
    provider = Recording([LOOKUP, REFUND_150, REFUND_150, REFUND_100, DONE])
    spec = refund_machine(breakers=BreakerPolicy(consecutive_failures=5))
    async with open_supervisor([spec], memory_store, provider=provider) as sup:
        result = await (await sup.start_run("refund", run_id="r-1")).wait()
    assert result.outcome == "completed"
    events = await memory_store.load("r-1")
    calls = [e for e in events if isinstance(e, ModelCalled)]
    assert len(calls) == len(provider.given) == 5
    # the first prompt is whole; each later one is written against the one before it
    assert calls[0].prompt == provider.given[0]
    assert calls[0].prompt_base == 0
    assert [c.prompt_base for c in calls[1:]] == [c.seq for c in calls[:-1]]
    journaled = sum(len(c.prompt) for c in calls)
    whole = sum(len(p) for p in provider.given)
    assert journaled < whole / 2, (journaled, whole)
    # every prompt comes back exactly, and matches its hash
    assert [p for _, p in whole_prompts(events)] == provider.given
    assert [c.prompt_hash for c in calls] == [hash_prompt(p) for p in provider.given]
    # folding the journal (recovery) rebuilds the last prompt, the base of the next delta
    folded = fold(spec, events)
    assert (folded.prompt, folded.prompt_seq) == (provider.given[-1], calls[-1].seq)


async def test_unrelated_prompts_are_journaled_whole(memory_store: MemoryStore) -> None:
    prompts = ["short one", "x" * 200, "y" * 200]
    provider = Recording([LOOKUP, REFUND_100, DONE], prompts)
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        await (await sup.start_run("refund", run_id="r-1")).wait()
    calls = [e for e in await memory_store.load("r-1") if isinstance(e, ModelCalled)]
    assert [(c.prompt, c.prompt_base) for c in calls] == [(p, 0) for p in prompts]


async def test_a_prompt_delta_against_a_missing_call_is_refused(memory_store: MemoryStore) -> None:
    provider = Recording([LOOKUP, REFUND_100, DONE])
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        await (await sup.start_run("refund", run_id="r-1")).wait()
    events = await memory_store.load("r-1")
    second = [i for i, e in enumerate(events) if isinstance(e, ModelCalled)][1]
    damaged = list(events)
    damaged[second] = msgspec.structs.replace(events[second], prompt_base=1)
    with pytest.raises(
        ProtocolError, match=r"written against the prompt at seq 1, but the previous "
    ):
        fold(refund_machine(), damaged)
    with pytest.raises(ValueError, match=r"written against the prompt at seq 1, but the previous "):
        list(whole_prompts(damaged))
    too_long = msgspec.structs.replace(events[second], prompt_prefix=10**6)
    damaged[second] = too_long
    with pytest.raises(ProtocolError, match=r"keeps 1000000\+\d+ characters of the prompt at seq"):
        fold(refund_machine(), damaged)
    damaged[second] = msgspec.structs.replace(events[second], prompt="tampered")
    with pytest.raises(ValueError, match="does not match its recorded hash"):
        list(whole_prompts(damaged))


async def test_live_repeat_counts_equal_the_ones_folded_from_the_journal(
    memory_store: MemoryStore,
) -> None:
    # The supervisor reuses the gate's call hash; recovery recomputes it from the journaled
    # args. Both must count the same calls under the same keys.
    script = [LOOKUP, REFUND_100, '{"tool": "refund", "args": {"amount": 100, "order_id": "o1"}}']
    release = trio.Event()

    class ThenBlock:
        model = "then-block"

        async def propose(self, view: RunView) -> Proposal:
            if view.steps < len(script):
                return Proposal(script[view.steps], TokenUsage(1, 1), self.model)
            await release.wait()
            return Proposal(DONE, TokenUsage(1, 1), self.model)

    spec = refund_machine(breakers=BreakerPolicy(repeats=5))
    async with open_supervisor([spec], memory_store, provider=ThenBlock()) as sup:
        handle = await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        run = sup._runs["r-1"]
        live = dict(run.repeat_counts)
        live_committed, live_seq = list(run._committed_calls), run.seq
        last = run.history[-1]
        folded = fold(spec, await memory_store.load("r-1")).repeat_counts
        release.set()
        await handle.wait()
    # The refund, proposed again with its keys reordered, is found committed (issue 32):
    # refused, so intended once.
    assert [v.code for v in last.violations] == ["already_committed"]
    assert sorted(live.values()) == [1, 1]
    assert live == folded
    # (the journal's tail may be written with the run's next request: fold it afterwards)
    folded_run = fold(spec, (await memory_store.load("r-1"))[:live_seq])
    assert live_committed == list(folded_run._committed_calls)
    assert sorted(live_committed) == sorted(live)


# -- cancellation ----------------------------------------------------------------------------


async def test_cancel_run_fails_it(memory_store: MemoryStore, events_of: Any) -> None:
    provider = Blocked()
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        verdict = await sup.cancel_run("r-1", "the customer withdrew the request")
        assert verdict == Verdict(
            run_id="r-1", seq=3, accepted=True, state="FAILED", outcome="failed"
        )
        provider.release.set()
    assert await events_of(memory_store, "r-1") == [
        ("RunStarted", {"machine": "refund", "state": "WORK", "inputs": {}}),
        ("Transitioned", {"src": "WORK", "dst": "FAILED", "delta": {}, "reason": "operator"}),
        ("Failed", {"state": "FAILED", "reason": "the customer withdrew the request"}),
    ]
    record = await memory_store.get_run("r-1")
    assert (record.outcome, record.reason) == ("failed", "the customer withdrew the request")


async def test_cancel_run_ends_the_handle_with_the_failed_result(memory_store: MemoryStore) -> None:
    provider = Blocked()
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        handle = await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        await sup.cancel_run("r-1", "withdrawn")
        provider.release.set()
        result = await handle.wait()
        assert sup.statistics().runs_in_flight == 0
    assert result == RunResult(
        "r-1", "refund", "FAILED", "failed", {"reason": "withdrawn"}, "withdrawn", seq=3
    )


async def test_cancel_run_of_a_finished_run_changes_nothing(memory_store: MemoryStore) -> None:
    provider = Blocked()
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        await sup.cancel_run("r-1", "first")
        verdict = await sup.cancel_run("r-1", "second")
        assert (verdict.seq, verdict.outcome) == (3, "failed")
        provider.release.set()
    assert len(await memory_store.load("r-1")) == 3


async def test_cancelling_the_supervisor_leaves_consistent_journals(
    memory_store: MemoryStore,
) -> None:
    never = trio.Event()

    async def hang(args: Any, ctx: ToolContext) -> None:
        await never.wait()

    spec = Machine(
        "hang",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["hang"])},
        tools=[Tool("hang", hang, timeout=3600.0)],
    )
    in_provider = Blocked()
    in_tool = ScriptedProvider(['{"tool": "hang", "args": {}}'])
    handles = []
    with trio.CancelScope() as scope:
        async with open_supervisor([spec], memory_store, provider=in_provider) as sup:
            for i in range(10):
                provider = in_provider if i % 2 else in_tool
                handles.append(await sup.start_run("hang", run_id=f"c-{i}", provider=provider))
            await wait_all_tasks_blocked()
            assert in_provider.waiting == 5
            assert sup.statistics().runs_in_flight == 10
            scope.cancel()
    assert scope.cancelled_caught
    for i, handle in enumerate(handles):
        with pytest.raises(
            InterlockError, match=rf"^run 'c-{i}' was cancelled before it finished$"
        ):
            await handle.wait()
        events = await memory_store.load(f"c-{i}")
        run = fold(spec, events)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert run.state == "WORK"
        assert (run.pending is not None) == (i % 2 == 0)
        assert (await memory_store.get_run(f"c-{i}")).seq == len(events)


async def test_cancelling_the_supervisor_mid_batch_leaves_consistent_journals(
    memory_store: MemoryStore,
) -> None:
    proposals = 0

    def busy(view: RunView) -> str:
        nonlocal proposals
        proposals += 1
        if proposals == 150:
            scope.cancel()
        return f'{{"tool": "lookup_order", "args": {{"order_id": "o{view.seq}"}}}}'

    spec = refund_machine()
    with trio.CancelScope() as scope:
        async with (
            open_supervisor([spec], memory_store, provider=ScriptedProvider(busy)) as sup,
            trio.open_nursery() as nursery,
        ):
            for i in range(40):
                nursery.start_soon(functools.partial(sup.start_run, "refund", run_id=f"b-{i}"))
    records = await memory_store.list_runs()
    assert len(records) == 40
    for record in records:
        events = await memory_store.load(record.run_id)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert fold(spec, events).seq == record.seq == len(events)
        assert record.outcome == "running"


# -- protocol errors ----------------------------------------------------------------------------


async def test_protocol_errors(memory_store: MemoryStore) -> None:
    provider = Blocked()
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        handle = await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        with pytest.raises(
            ProtocolError,
            match=r"^run 'r-1' is at seq 1, the request was made at seq 7; "
            r"re-read the run and propose again$",
        ):
            await sup.request(Propose(run_id="r-1", seq=7, raw=DONE))
        with pytest.raises(RunNotFound, match=r"^run 'r-9' not found$"):
            await sup.request(Propose(run_id="r-9", seq=1, raw=DONE))
        with pytest.raises(
            ProtocolError,
            match=r"^run 'r-1' reported key 'r-1:WORK:2' but is waiting for 'no call'$",
        ):
            await sup.request(Report(run_id="r-1", seq=1, key="r-1:WORK:2", ok=True))
        with pytest.raises(
            ProtocolError, match=r"^run 'r-1' already exists; run ids must be unique$"
        ):
            await sup.request(Start(run_id="r-1", machine="refund"))
        with pytest.raises(
            ProtocolError, match=r"^run 'r-1' already exists; run ids must be unique$"
        ):
            await sup.start_run("refund", run_id="r-1")
        with pytest.raises(RunNotFound, match=r"^run 'r-9' not found$"):
            sup.view("r-9")
        # none of that touched the run
        assert sup.view("r-1").seq == 1
        provider.release.set()
        assert (await handle.wait()).outcome == "completed"
    assert len(await memory_store.load("r-1")) == 4


async def test_a_duplicate_report_gets_the_recorded_result(memory_store: MemoryStore) -> None:
    # A retried Report of a call that is already committed: the recorded result stands,
    # nothing is journaled again, whatever the run is doing now.
    release = trio.Event()

    class LookupThenWait:
        model = "lookup-then-wait"

        async def propose(self, view: RunView) -> Proposal:
            if view.steps == 0:
                return Proposal(LOOKUP, TokenUsage(1, 1), self.model)
            await release.wait()
            return Proposal(DONE, TokenUsage(1, 1), self.model)

    async with open_supervisor([refund_machine()], memory_store, provider=LookupThenWait()) as sup:
        handle = await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        [done] = sup.view("r-1").results
        seq = sup.view("r-1").seq
        again = Report(run_id="r-1", seq=2, key=done.key, ok=True, result={"total": -1.0})
        verdict = await sup.request(again)
        assert verdict.accepted
        assert verdict.result == {"order_id": "o1", "total": 100.0}
        assert sup.view("r-1").seq == seq
        with pytest.raises(
            ProtocolError,
            match=r"^run 'r-1' reported key 'r-1:WORK:9' but is waiting for 'no call'$",
        ):
            await sup.request(Report(run_id="r-1", seq=seq, key="r-1:WORK:9", ok=True))
        release.set()
        assert (await handle.wait()).outcome == "completed"
    events = await memory_store.load("r-1")
    assert [type(e).__name__ for e in events].count("ToolCommitted") == 1
    assert fold(refund_machine(), events).committed == {
        done.key: {"order_id": "o1", "total": 100.0}
    }


async def test_proposal_for_a_finished_run_is_refused(memory_store: MemoryStore) -> None:
    provider = Blocked()
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        await sup.cancel_run("r-1")
        with pytest.raises(
            ProtocolError,
            match=r"^run 'r-1' is failed in state 'FAILED'; it takes no more proposals$",
        ):
            await sup.request(Propose(run_id="r-1", seq=3, raw=DONE))
        provider.release.set()


async def test_start_run_errors(memory_store: MemoryStore) -> None:
    spec = refund_machine(
        inputs={
            "type": "object",
            "properties": {"order": {"type": "string"}},
            "required": ["order"],
        }
    )
    async with open_supervisor([spec], memory_store) as sup:
        with pytest.raises(
            InterlockError, match=r"^machine 'nope' is not registered; registered: refund$"
        ):
            await sup.start_run("nope")
        with pytest.raises(
            InterlockError,
            match=r"^inputs of machine 'refund' are invalid: inputs\.order: expected `str`, got `int`$",
        ):
            await sup.start_run("refund", {"order": 1}, provider=Blocked())
        with pytest.raises(
            InterlockError,
            match=r"^machine 'refund' has worker states but no provider; pass provider= to "
            r"open_supervisor\(\) or start_run\(\)$",
        ):
            await sup.start_run("refund", {"order": "o1"})
    with pytest.raises(trio.ClosedResourceError, match=r"^supervisor is not running$"):
        await sup.start_run("refund", {"order": "o1"}, provider=Blocked())
    with pytest.raises(trio.ClosedResourceError, match=r"^supervisor is closed$"):
        await sup.request(Start(run_id="late", machine="refund"))
    assert await memory_store.list_runs() == []


class GatedStore(MemoryStore):
    """A memory store whose appends wait for ``gate`` (when set) and can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: trio.Event | None = None
        self.error: Exception | None = None

    async def append(self, events: Any) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        await super().append(events)


async def test_replies_wait_for_the_flush() -> None:
    store = GatedStore()
    store.gate = trio.Event()
    started: list[Any] = []

    async def start(sup: Any) -> None:
        started.append(await sup.start_run("refund", run_id="r-1"))

    provider = Blocked()
    async with open_supervisor([refund_machine()], store, provider=provider) as sup:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(start, sup)
            await wait_all_tasks_blocked()
            assert started == []
            assert await store.list_runs() == []
            store.gate.set()
        assert [h.run_id for h in started] == ["r-1"]
        assert (await store.get_run("r-1")).seq == 1
        provider.release.set()


@pytest.mark.parametrize(
    ("error", "message"),
    [
        pytest.param(StoreError("disk full"), "disk full", id="store-error"),
        pytest.param(
            OSError(28, "No space left on device"),
            "journal write failed: [Errno 28] No space left on device",
            id="os-error",
        ),
    ],
)
async def test_failed_flush_fails_the_runs_in_the_batch(error: Exception, message: str) -> None:
    store = GatedStore()
    provider = Blocked()
    async with open_supervisor([refund_machine()], store, provider=provider) as sup:
        handle = await sup.start_run("refund", run_id="r-1")
        await wait_all_tasks_blocked()
        store.error = error
        provider.release.set()
        with pytest.raises(StoreError, match=f"^{re.escape(message)}$"):
            await handle.wait()
        with pytest.raises(RunNotFound, match=r"^run 'r-1' not found$"):
            sup.view("r-1")
    assert len(await store.load("r-1")) == 1


async def test_two_machines_with_one_name_are_refused(memory_store: MemoryStore) -> None:
    with pytest.raises(
        InterlockError, match=r"^two machines are named 'refund'; names must be unique$"
    ):
        async with open_supervisor([refund_machine(), refund_machine()], memory_store):
            pass  # pragma: no cover


# -- many runs ----------------------------------------------------------------------------------


async def test_a_thousand_concurrent_runs(memory_store: MemoryStore) -> None:
    def oracle(view: RunView) -> str:
        if not view.results:
            return f'{{"tool": "lookup_order", "args": {{"order_id": "{view.run_id}"}}}}'
        total = view.results[0].result["total"]
        return msgspec.json.encode({"next": "COMPLETED", "data": {"total": total}}).decode()

    spec = refund_machine()
    run_ids = [f"run-{i:04d}" for i in range(1000)]
    async with open_supervisor([spec], memory_store, provider=ScriptedProvider(oracle)) as sup:
        async with trio.open_nursery() as nursery:
            for run_id in run_ids:
                nursery.start_soon(functools.partial(sup.start_run, "refund", run_id=run_id))
        stats = sup.statistics()
    assert stats.runs_started == 1000
    total = 0
    expected = [
        "RunStarted",
        "ModelCalled",
        "IntentRecorded",
        "ToolCommitted",
        "ModelCalled",
        "Transitioned",
        "Completed",
    ]
    for run_id in run_ids:
        events = await memory_store.load(run_id)
        assert [type(e).__name__ for e in events] == expected
        assert [e.seq for e in events] == list(range(1, 8))
        assert {e.run_id for e in events} == {run_id}
        assert events[2].args == {"order_id": run_id}  # type: ignore[attr-defined]
        assert fold(spec, events).output == {"total": 100.0}
        total += len(events)
    stats = sup.statistics()
    assert stats.runs_started == 1000
    assert stats.runs_finished == {"completed": 1000}
    assert stats.runs_in_flight == 0
    assert stats.verifications == 2000
    assert stats.rejections == {}
    assert stats.breaker_trips == {}
    assert (stats.tool_calls, stats.tool_errors, stats.side_effects) == (1000, 0, 0)
    assert stats.events == total == 7000
    assert 1 <= stats.flushes < 7000  # group commit: many events per flush
    assert len(await memory_store.list_runs(outcome="completed")) == 1000


# -- statistics ---------------------------------------------------------------------------------


class FixedUsage:
    model = "fixed"

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = {run_id: iter(raws) for run_id, raws in script.items()}

    async def propose(self, view: RunView) -> Proposal:
        await trio.lowlevel.checkpoint()
        return Proposal(next(self.script[view.run_id]), TokenUsage(30, 10), self.model)


async def test_statistics(memory_store: MemoryStore) -> None:
    async def ship(args: Any, ctx: ToolContext) -> None:
        raise RuntimeError("no courier available")

    spec = Machine(
        "shop",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order", "refund", "ship"])},
        tools=[
            Tool("lookup_order", lookup_order, LookupArgs, read_only=True),
            Tool("refund", refund, RefundArgs),
            Tool("ship", ship, retry=RetryPolicy(attempts=1), not_applied=(RuntimeError,)),
        ],
    )
    bad = '{"next": "NOWHERE"}'
    provider = FixedUsage(
        {
            "s-1": [bad, LOOKUP, REFUND_100, '{"tool": "ship", "args": {}}', DONE],
            "s-2": [bad, bad, bad],
        }
    )
    async with open_supervisor([spec], memory_store, provider=provider) as sup:
        empty = sup.statistics()
        assert (empty.runs_started, empty.verifications, empty.verify_p50, empty.flushes) == (
            0,
            0,
            0.0,
            0,
        )
        first = await sup.start_run("shop", run_id="s-1")
        second = await sup.start_run("shop", run_id="s-2")
        assert sup.statistics().runs_in_flight == 2
        assert (await first.wait()).outcome == "completed"
        assert (await second.wait()).outcome == "escalated"
        stats = sup.statistics()
    events = len(await memory_store.load("s-1")) + len(await memory_store.load("s-2"))
    assert stats.runs_started == 2
    assert stats.runs_finished == {"completed": 1, "escalated": 1}
    assert stats.runs_in_flight == 0
    assert stats.verifications == 8
    assert stats.rejections == {"illegal_transition": 4}
    assert stats.breaker_trips == {"consecutive_failures": 1}
    assert stats.tokens == 8 * 40
    assert (stats.tool_calls, stats.tool_errors, stats.side_effects) == (3, 1, 1)
    assert stats.events == events
    assert 1 <= stats.flushes <= events
    assert 0 < stats.verify_p50 <= stats.verify_p99


# -- the prompt --------------------------------------------------------------------------------


def test_render_prompt_text() -> None:
    from interlock.events import RunStarted

    started = RunStarted(
        run_id="r-1", seq=1, ts=0.0, machine="refund", state="WORK", inputs={"order": "o1"}
    )
    text = render_prompt(RunView(fold(refund_machine(), [started])))
    lines = text.split("\n")
    assert lines[:3] == ["machine: refund", "state: WORK", "tools allowed here:"]
    assert lines[3] == (
        '  - lookup_order:  args schema: {"title":"LookupArgs","type":"object","properties":'
        '{"order_id":{"type":"string"}},"required":["order_id"],"additionalProperties":false}'
    )
    assert lines[4].startswith("  - refund:  args schema: ")
    assert lines[5:] == [
        "legal next states: COMPLETED",
        'inputs: {"order":"o1"}',
        'answer with one JSON object: {"tool": NAME, "args": {...}} or {"next": STATE, "data": {...}}',
    ]


def test_render_prompt_tells_machines_with_one_name_apart() -> None:
    # The machine/state part of the prompt is rendered once per Machine object; a second
    # machine with the same name but other tools must not reuse the first one's text.
    from interlock.events import RunStarted

    started = RunStarted(run_id="r-1", seq=1, ts=0.0, machine="refund", state="WORK")
    first = render_prompt(RunView(fold(refund_machine(), [started])))
    other = Machine(
        "refund",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order"])},
        tools=[Tool("lookup_order", lookup_order, LookupArgs, read_only=True)],
    )
    second = render_prompt(RunView(fold(other, [started])))
    assert "  - refund: " in first
    assert "  - refund: " not in second
    assert render_prompt(RunView(fold(refund_machine(), [started]))) == first


_EDITS = st.lists(
    st.tuples(
        st.sampled_from(["append", "insert", "cut", "replace", "fresh"]),
        st.text(alphabet="ab\u00e9\u4e2d\U0001f600\n", max_size=12),
        st.integers(min_value=0, max_value=10_000),
    ),
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(first=st.text(max_size=40), edits=_EDITS)
def test_prompt_hash_resumed_from_the_previous_prompt_equals_a_whole_hash(
    first: str, edits: list[tuple[str, str, int]]
) -> None:
    # The supervisor hashes each prompt from where the previous one's new text ended;
    # whatever the edit between two prompts (growth at the end, a change in the middle, a
    # shorter or an unrelated prompt, non-ASCII text), the hash is the whole prompt's.
    state = None
    base = ""
    prompts = [first]
    for kind, text, at in edits:
        old = prompts[-1]
        at = at % (len(old) + 1)
        prompts.append(
            {
                "append": old[: len(old) - 3] + text + old[len(old) - 3 :],
                "insert": old[:at] + text + old[at:],
                "cut": old[:at] + old[at + len(text) :],
                "replace": old[:at] + text + old[at + len(text) :],
                "fresh": text,
            }[kind]
        )
    for i, prompt in enumerate(prompts):
        shared, tail = (0, len(prompt)) if i == 0 else common_affixes(base, prompt)
        if i:
            tail = len(prompt) - tail
        got, state = hash_prompt_after(state, base, prompt, shared, tail)
        assert got == hash_prompt(prompt)
        base = prompt
    # A state that is not the base's own is not used, even where its offset would fit.
    if state is not None and state[1] > 0:
        stranger = "Q" * len(base)
        other = stranger + "x"
        got, _ = hash_prompt_after(state, stranger, other, len(stranger), len(other))
        assert got == hash_prompt(other)


_HISTORY_STEPS = st.lists(
    st.sampled_from(
        ["reject_a", "reject_b", "commit", "fail", "trip", "move", "move_plain", "stay"]
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(steps=_HISTORY_STEPS)
def test_incremental_history_and_prompt_equal_a_fresh_fold(steps: list[str]) -> None:
    # render_prompt keeps the text of the frames that cannot change any more; after any
    # sequence of events (repeated rejections compact the last frame) the prompt must be
    # the one a run folded afresh (nothing cached) renders.
    from interlock.events import (
        BreakerTripped,
        IntentRecorded,
        RunStarted,
        ToolCommitted,
        ToolFailed,
        Transitioned,
    )

    # Two worker states to move between, with and without data: the head of the prompt
    # (state, data) is kept too while neither changes.
    machine = Machine(
        "refund",
        initial="WORK",
        states={
            "WORK": Worker(next=["WORK", "CHECK", "COMPLETED"], tools=["lookup_order", "refund"]),
            "CHECK": Worker(next=["WORK"], tools=["lookup_order"]),
        },
        tools=refund_machine().tools,
    )
    events: list[Any] = [
        RunStarted(run_id="r-1", seq=1, ts=0.0, machine="refund", state="WORK", inputs={"o": 1})
    ]
    live = fold(machine, events)
    view = RunView(live)  # one view for the run's life, as the actor keeps it: its memos
    other = Violation("schema", "args.order_id", "args.order_id: expected str", "send a str")
    for i, step in enumerate(steps):
        seq = len(events) + 1
        if step in ("reject_a", "reject_b"):
            why = GUARD_VIOLATION if step == "reject_a" else other
            new: list[Any] = [
                ProposalRejected(run_id="r-1", seq=seq, ts=1.0, state="WORK", violations=(why,))
            ]
        elif step in ("move", "move_plain", "stay"):
            src = live.state
            dst = src if step == "stay" else ("CHECK" if src == "WORK" else "WORK")
            new = [
                Transitioned(
                    run_id="r-1", seq=seq, ts=1.0, src=src, dst=dst,
                    delta={"moves": i} if step != "move_plain" else {}, reason="proposal",
                )
            ]  # fmt: skip
        elif step == "trip":
            new = [
                BreakerTripped(
                    run_id="r-1", seq=seq, ts=1.0, breaker="repeat", state="WORK",
                    value=4.0, limit=3.0, detail=f"trip {i}",
                )
            ]  # fmt: skip
        else:
            key = f"r-1:WORK:{seq}"
            intent = IntentRecorded(
                run_id="r-1", seq=seq, ts=1.0, state="WORK", tool="lookup_order",
                args={"order_id": f"o{i}"}, key=key,
            )  # fmt: skip
            done: Any = (
                ToolCommitted(
                    run_id="r-1", seq=seq + 1, ts=1.0, tool="lookup_order", key=key,
                    result={"i": i},
                )
                if step == "commit"
                else ToolFailed(
                    run_id="r-1", seq=seq + 1, ts=1.0, tool="lookup_order", key=key,
                    error=f"boom {i}",
                )
            )  # fmt: skip
            new = [intent, done]
        for event in new:
            live.apply(event)
            events.append(event)
        fresh = fold(machine, events)
        # The compacted history is kept incrementally too (only its last group can change).
        assert view.history == RunView(fresh).history
        assert render_prompt(view) == render_prompt(RunView(fresh))


# -- values the journal cannot hold -------------------------------------------------------------


HUGE = 123456789012345678901234567890


async def test_a_proposal_the_journal_cannot_hold_is_rejected_not_fatal(
    memory_store: MemoryStore,
) -> None:
    # JSON decodes integers of any size; msgpack (the journal) holds 64 bits. Accepting
    # such a proposal used to fail the whole batch when the store encoded it.
    script = iter([LOOKUP, f'{{"next": "COMPLETED", "data": {{"answer": {HUGE}}}}}', DONE])
    provider = ScriptedProvider(lambda view: next(script))
    async with open_supervisor([refund_machine()], memory_store, provider=provider) as sup:
        bystander = await sup.start_run(
            "refund", run_id="r-0", provider=ScriptedProvider(lambda v: DONE)
        )
        result = await (await sup.start_run("refund", run_id="r-1")).wait()
        assert (await bystander.wait()).outcome == "completed"
    assert result.outcome == "completed"
    events = await memory_store.load("r-1")
    rejected = [e for e in events if isinstance(e, ProposalRejected)]
    assert [v.code for e in rejected for v in e.violations] == ["schema"]
    [violation] = rejected[0].violations
    assert violation.path == "data"
    assert violation.message == (
        "data: the int at data.answer: can't serialize ints < -2**63 or > 2**64 - 1; "
        "the journal cannot hold this value"
    )
    assert violation.hint == (
        "send plain JSON values; keep integers within 64 bits (-2**63 .. 2**64-1)"
    )


class CountArgs(msgspec.Struct, forbid_unknown_fields=True):
    n: int


async def test_a_call_whose_args_the_journal_cannot_hold_is_rejected_by_the_gate(
    memory_store: MemoryStore,
) -> None:
    # The gate's repeat hash encodes the args as the journal does, so it is the gate that
    # refuses them: verify() answers, it does not raise, and the run goes on.
    calls: list[int] = []

    async def count(args: CountArgs, ctx: ToolContext) -> Any:
        calls.append(args.n)
        return {"n": args.n}

    machine = Machine(
        "counter",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["count"])},
        tools=[Tool("count", count, CountArgs)],
    )
    huge = f'{{"tool": "count", "args": {{"n": {HUGE}}}}}'
    fine = '{"tool": "count", "args": {"n": 2}}'
    script = iter([huge, fine, DONE])
    provider = ScriptedProvider(lambda view: next(script))
    async with open_supervisor([machine], memory_store, provider=provider) as sup:
        result = await (await sup.start_run("counter", run_id="r-1")).wait()
    assert result.outcome == "completed"
    assert calls == [2]
    events = await memory_store.load("r-1")
    [rejected] = [e for e in events if isinstance(e, ProposalRejected)]
    assert rejected.violations == (
        Violation(
            "schema",
            "args",
            "args: can't serialize ints < -2**63 or > 2**64 - 1; the journal cannot hold this value",
            "send plain JSON values; keep integers within 64 bits (-2**63 .. 2**64-1)",
        ),
    )


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        ({"total": HUGE}, "the int at result.total: can't serialize ints < -2**63 or > 2**64 - 1"),
        ("cycle", "the dict at result.self is the one at result again: a cycle cannot be encoded"),
        (object(), "the object at result: Encoding objects of type object is unsupported"),
    ],
    ids=["huge-int", "cycle", "foreign-object"],
)
async def test_a_tool_result_the_journal_cannot_hold_fails_the_call_not_the_batch(
    memory_store: MemoryStore, returned: Any, problem: str
) -> None:
    if returned == "cycle":
        returned = {}
        returned["self"] = returned

    async def lookup(args: LookupArgs, ctx: ToolContext) -> Any:
        return returned

    machine = Machine(
        "refund",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup_order"])},
        tools=[Tool("lookup_order", lookup, LookupArgs, read_only=True)],
    )
    script = iter([LOOKUP, DONE])
    provider = ScriptedProvider(lambda view: next(script))
    async with open_supervisor([machine], memory_store, provider=provider) as sup:
        result = await (await sup.start_run("refund", run_id="r-1")).wait()
    assert result.outcome == "completed"
    [failed] = [e for e in await memory_store.load("r-1") if type(e).__name__ == "ToolFailed"]
    assert failed.error == (  # type: ignore[attr-defined]
        f"tool 'lookup_order' returned a result that cannot be journaled: {problem}"
    )
    assert failed.retryable is False  # type: ignore[attr-defined]


async def test_start_run_refuses_inputs_the_journal_cannot_hold(memory_store: MemoryStore) -> None:
    async with open_supervisor([refund_machine()], memory_store, provider=Blocked()) as sup:
        with pytest.raises(
            InterlockError,
            match=r"^inputs of machine 'refund' cannot be journaled: the int at inputs\.order: "
            r"can't serialize ints < -2\*\*63 or > 2\*\*64 - 1; pass JSON-like values",
        ):
            await sup.start_run("refund", {"order": HUGE}, run_id="r-1")
        assert sup._runs == {}


async def test_an_error_in_the_block_reaches_the_caller_unwrapped() -> None:
    """It used to arrive in two nested ExceptionGroups, so ``except InterlockError`` never
    caught the clear "no provider" message (#15)."""
    from interlock import InterlockError

    with pytest.raises(
        InterlockError, match=r"^machine 'refund' has worker states but no provider"
    ):
        async with open_supervisor([refund_machine()]) as sup:
            await sup.start_run("refund", {"order_id": "o1"})


async def test_two_errors_at_once_stay_a_group() -> None:
    async def fail_later() -> None:
        raise KeyError("second")  # before any checkpoint: it is not cancelled first

    with pytest.RaisesGroup(ValueError, KeyError, flatten_subgroups=True):
        async with open_supervisor([refund_machine()]) as sup:
            assert sup._actors is not None
            sup._actors.start_soon(fail_later)
            raise ValueError("first")


async def test_nested_and_interleaved_supervisors_restore_the_collector() -> None:
    """The first supervisor to open saves the thresholds, the last to close restores them;
    one closing early used to restore them under the other, or leave them changed (#15)."""
    import gc

    from interlock.runtime._runtime import GC_THRESHOLD

    before = gc.get_threshold()
    opened: list[trio.Event] = [trio.Event(), trio.Event()]
    close_first = trio.Event()

    async def first() -> None:
        async with open_supervisor([refund_machine()]):
            opened[0].set()
            await close_first.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await opened[0].wait()
        assert gc.get_threshold() == GC_THRESHOLD
        async with open_supervisor([refund_machine()]):
            close_first.set()
            await trio.sleep(0.01)  # the first one has closed: the second still tunes
            assert gc.get_threshold() == GC_THRESHOLD
    assert gc.get_threshold() == before


async def test_finished_runs_are_released_and_only_the_latest_results_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long-lived supervisor kept every finished run's handle forever (#15)."""
    from interlock.runtime import _supervisor

    monkeypatch.setattr(_supervisor, "ENDED_KEPT", 5)
    spec = Machine("m", "W", {"W": Worker(next=["COMPLETED"])})
    provider = ScriptedProvider(['{"next": "COMPLETED"}'])
    async with open_supervisor([spec], provider=provider) as sup:
        # one after another, so they end in this order (runs in flight together end in
        # whatever order the scheduler runs them)
        results = [await (await sup.start_run("m", run_id=f"r-{i}")).wait() for i in range(12)]
        await trio.testing.wait_all_tasks_blocked()
        assert [r.outcome for r in results] == ["completed"] * 12  # the caller keeps its own
        assert sup.handles == {}
        assert sup._runs == {}
        assert list(sup._ended) == [f"r-{i}" for i in range(7, 12)]
        # a late request about a recent run gets the clear answer ...
        assert (await sup.cancel_run("r-11")).outcome == "completed"
        with pytest.raises(ProtocolError, match=r"^run 'r-10' is completed in state 'COMPLETED'"):
            await sup.request(Propose(run_id="r-10", raw="{}"))
        # ... and about a forgotten one, that it is not here
        with pytest.raises(RunNotFound):
            await sup.request(Propose(run_id="r-0", raw="{}"))
