"""Breakers, end to end through a supervisor: each trips at its threshold and not one before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import trio
from trio.testing import wait_all_tasks_blocked

from interlock import (
    BreakerPolicy,
    Budgets,
    Go,
    Machine,
    RetryPolicy,
    RunResult,
    RunView,
    Step,
    Tool,
    Worker,
    open_supervisor,
)
from interlock.events import TokenUsage, Violation
from interlock.providers import Proposal, ScriptedProvider
from interlock.stores import MemoryStore


class LookupArgs(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def lookup(args: LookupArgs, ctx: Any) -> dict[str, Any]:
    return {"order_id": args.order_id, "total": 100.0}


class Downstream:
    """A tool whose next calls fail while ``failing`` is set."""

    def __init__(self) -> None:
        self.failing = False
        self.calls = 0
        self.gate: trio.Event | None = None

    async def __call__(self, args: Any, ctx: Any) -> dict[str, bool]:
        if self.gate is not None:
            await self.gate.wait()
        self.calls += 1
        if self.failing:
            raise ConnectionRefusedError("payment gateway refused the connection")
        return {"charged": True}


USAGE = TokenUsage(30, 10)


class FixedProvider:
    """Answers ``answer(view)`` after ``latency`` seconds, always with the same token usage."""

    model = "fixed"

    def __init__(
        self,
        answer: Callable[[RunView], str],
        *,
        usage: TokenUsage = USAGE,
        latency: float = 0.0,
    ) -> None:
        self.answer = answer
        self.usage = usage
        self.latency = latency

    async def propose(self, view: RunView) -> Proposal:
        await trio.sleep(self.latency)
        return Proposal(self.answer(view), self.usage, self.model, "prompt")


def machine(
    *,
    budgets: Budgets | None = None,
    breakers: BreakerPolicy | None = None,
    charge: Downstream | None = None,
    on_breaker: str = "ESCALATE",
    fallback: Callable[[RunView], Any] | None = None,
) -> Machine:
    states: dict[str, Worker | Step] = {
        "WORK": Worker(next=["COMPLETED"], tools=["lookup_order", "charge"])
    }
    if fallback is not None:
        states["FALLBACK"] = Step(fallback, next=["DONE"])
    return Machine(
        "shop",
        initial="WORK",
        states=states,
        tools=[
            Tool("lookup_order", lookup, LookupArgs, read_only=True),
            # idempotent: these tests count failures; a failed call of a tool that is not
            # safe to repeat is in doubt instead (see test_exactly_once.py)
            Tool("charge", charge or Downstream(), retry=RetryPolicy(attempts=1), idempotent=True),
        ],
        on_breaker=on_breaker,
        budgets=budgets or Budgets(),
        breakers=breakers or BreakerPolicy(),
    )


BAD = '{"next": "NOWHERE"}'
BAD_TEXT = "state 'NOWHERE' does not exist; legal next states from 'WORK': COMPLETED"
LOOKUP = '{"tool": "lookup_order", "args": {"order_id": "o1"}}'
CHARGE = '{"tool": "charge", "args": {}}'
DONE = '{"next": "COMPLETED"}'


def lookup_of(view: RunView) -> str:
    """A lookup whose args differ at every step, so the repeat breaker stays out of the way."""
    return f'{{"tool": "lookup_order", "args": {{"order_id": "o{view.seq}"}}}}'


async def run_one(
    spec: Machine, provider: Any, store: MemoryStore, run_id: str = "r-1"
) -> RunResult:
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        handle = await sup.start_run(spec.name, run_id=run_id)
        return await handle.wait()


def kinds(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [kind for kind, _ in events]


def escalation(breaker: str, value: float, limit: float, detail: str, tool: str = "") -> list[Any]:
    return [
        (
            "BreakerTripped",
            {
                "breaker": breaker,
                "state": "WORK",
                "value": value,
                "limit": limit,
                "detail": detail,
                "tool": tool,
            },
        ),
        (
            "Transitioned",
            {"src": "WORK", "dst": "ESCALATE", "delta": {}, "reason": "breaker"},
        ),
        ("Escalated", {"state": "WORK", "reason": breaker, "detail": detail}),
    ]


# -- consecutive failures ----------------------------------------------------------------


async def test_consecutive_failures_trip_at_three(
    memory_store: MemoryStore, events_of: Any
) -> None:
    result = await run_one(machine(), ScriptedProvider([BAD, BAD, BAD]), memory_store)
    assert result == RunResult(
        "r-1", "shop", "ESCALATE", "escalated", None, "consecutive_failures", seq=10
    )
    events = await events_of(memory_store, "r-1")
    detail = f"3 consecutive failures in state 'WORK' (limit 3); last: {BAD_TEXT}"
    assert kinds(events[:7]) == ["RunStarted", *["ModelCalled", "ProposalRejected"] * 3]
    assert events[7:] == escalation("consecutive_failures", 3.0, 3.0, detail)


async def test_consecutive_failures_do_not_trip_at_two(
    memory_store: MemoryStore, events_of: Any
) -> None:
    script = [BAD, BAD, LOOKUP, BAD, BAD, DONE]
    result = await run_one(machine(), ScriptedProvider(script), memory_store)
    assert result.outcome == "completed"
    events = await events_of(memory_store, "r-1")
    assert "BreakerTripped" not in kinds(events)
    assert kinds(events).count("ProposalRejected") == 4


async def test_tool_failures_count_as_consecutive_failures(
    memory_store: MemoryStore, events_of: Any
) -> None:
    charge = Downstream()
    charge.failing = True
    result = await run_one(
        machine(charge=charge), ScriptedProvider([BAD, BAD, CHARGE]), memory_store
    )
    assert result.reason == "consecutive_failures"
    events = await events_of(memory_store, "r-1")
    detail = (
        "3 consecutive failures in state 'WORK' (limit 3); last: charge failed: "
        "ConnectionRefusedError: payment gateway refused the connection"
    )
    assert kinds(events[-5:-3]) == ["IntentRecorded", "ToolFailed"]
    assert events[-3:] == escalation("consecutive_failures", 3.0, 3.0, detail)


async def test_consecutive_failures_threshold_is_configurable(
    memory_store: MemoryStore, events_of: Any
) -> None:
    spec = machine(breakers=BreakerPolicy(consecutive_failures=5))
    result = await run_one(spec, ScriptedProvider([BAD] * 5), memory_store)
    assert result.reason == "consecutive_failures"
    events = await events_of(memory_store, "r-1")
    assert kinds(events).count("ProposalRejected") == 5
    assert events[-3][1]["value"] == 5.0
    assert events[-3][1]["limit"] == 5.0


# -- repeat --------------------------------------------------------------------------------


async def test_repeat_trips_and_escalates(memory_store: MemoryStore, events_of: Any) -> None:
    result = await run_one(machine(), ScriptedProvider(lambda view: LOOKUP), memory_store)
    assert result.reason == "repeat"
    events = await events_of(memory_store, "r-1")
    proposals = kinds(events).count("ModelCalled")
    assert kinds(events).count("IntentRecorded") == proposals - 1
    detail = (
        f'lookup_order({{"order_id":"o1"}}) proposed {proposals} times in this run; the limit is 3'
    )
    assert events[-4] == (
        "ProposalRejected",
        {
            "state": "WORK",
            "violations": (
                Violation(
                    "repeat",
                    "args",
                    f"repeated call: {detail}",
                    "do not call lookup_order with the same args again; use the recorded "
                    "result or move on",
                ),
            ),
        },
    )
    assert events[-3:] == escalation("repeat", float(proposals), 3.0, detail, "lookup_order")


async def test_repeat_allows_exactly_the_limit(memory_store: MemoryStore, events_of: Any) -> None:
    result = await run_one(machine(), ScriptedProvider(lambda view: LOOKUP), memory_store)
    assert result.reason == "repeat"
    events = await events_of(memory_store, "r-1")
    assert kinds(events).count("ToolCommitted") == 3
    detail = 'lookup_order({"order_id":"o1"}) proposed 4 times in this run; the limit is 3'
    assert events[-3:] == escalation("repeat", 4.0, 3.0, detail, "lookup_order")


# -- budgets ----------------------------------------------------------------------------------


async def test_token_budget_trips_past_the_limit(memory_store: MemoryStore, events_of: Any) -> None:
    # 40 tokens a call: the third call reaches exactly 120 and is still accepted
    spec = machine(budgets=Budgets(tokens=120))
    result = await run_one(spec, FixedProvider(lookup_of), memory_store)
    assert result.reason == "token_budget"
    events = await events_of(memory_store, "r-1")
    assert kinds(events).count("ToolCommitted") == 3
    detail = "run used 160 tokens; the budget is 120"
    assert events[-4] == (
        "ProposalRejected",
        {
            "state": "WORK",
            "violations": (
                Violation(
                    "budget",
                    "$",
                    f"token budget exhausted: {detail}",
                    "no further proposals are accepted",
                ),
            ),
        },
    )
    assert events[-3:] == escalation("token_budget", 160.0, 120.0, detail)


async def test_step_budget_trips_past_the_limit(memory_store: MemoryStore, events_of: Any) -> None:
    spec = machine(budgets=Budgets(steps=3))
    result = await run_one(spec, FixedProvider(lookup_of), memory_store)
    assert result.reason == "step_budget"
    events = await events_of(memory_store, "r-1")
    assert kinds(events).count("ToolCommitted") == 3
    detail = "run made 4 proposals; the budget is 3"
    assert events[-3:] == escalation("step_budget", 4.0, 3.0, detail)


async def test_deadline_trips_past_the_limit(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    # one proposal every 10 s: the one at exactly 30 s is still accepted; the wait for the
    # next is cut at the deadline (plus the actor's 1 ms margin), not when the model answers
    spec = machine(budgets=Budgets(deadline=30.0))
    result = await run_one(spec, FixedProvider(lookup_of, latency=10.0), memory_store)
    assert result.reason == "deadline"
    events = await events_of(memory_store, "r-1")
    assert kinds(events).count("ToolCommitted") == 3
    detail = "run has been going for 30.001 s; the deadline is 30 s"
    assert events[-3:] == escalation("deadline", 30.001, 30.0, detail)


async def test_deadline_stops_a_run_whose_provider_hangs(
    memory_store: MemoryStore, autojump_clock: Any
) -> None:
    spec = machine(budgets=Budgets(deadline=30.0))
    with trio.fail_after(3600):
        result = await run_one(spec, FixedProvider(lookup_of, latency=float("inf")), memory_store)
    assert result.reason == "deadline"


class SlowCharge:
    """A side-effecting tool that takes ``seconds`` (cancellation shows as ``cut``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.done = 0
        self.cut = 0

    async def __call__(self, args: Any, ctx: Any) -> dict[str, bool]:
        try:
            await trio.sleep(self.seconds)
        except trio.Cancelled:
            self.cut += 1
            raise
        self.done += 1
        return {"charged": True}


def slow_machine(charge: SlowCharge, deadline: float = 30.0) -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[
            Tool("charge", charge, timeout=100.0, retry=RetryPolicy(attempts=1), idempotent=True)
        ],
        budgets=Budgets(deadline=deadline),
    )


async def test_deadline_does_not_cut_a_tool_call_in_flight(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    # The deadline (30 s) passes while the charge (40 s) runs: the charge finishes and is
    # committed; the model is not asked again (the wait would be cut at once), and the
    # run escalates on its deadline.
    charge = SlowCharge(40.0)
    asked: list[float] = []

    def answer(view: RunView) -> str:
        asked.append(trio.current_time())
        return CHARGE if not view.history else DONE

    result = await run_one(slow_machine(charge), FixedProvider(answer), memory_store)
    assert (charge.done, charge.cut) == (1, 0)
    assert asked == [0.0]
    assert result.reason == "deadline"
    events = await events_of(memory_store, "r-1")
    assert kinds(events)[:5] == [
        "RunStarted", "ModelCalled", "IntentRecorded", "ToolCommitted", "ProviderFailed",
    ]  # fmt: skip
    assert events[4][1]["error"] == "no answer before the run's deadline of 30 s"
    assert events[4][1]["retry_in"] is None
    detail = "run has been going for 40.000 s; the deadline is 30 s"
    assert events[-3:] == escalation("deadline", 40.0, 30.0, detail)


async def test_cancel_run_cancels_a_tool_call_in_flight(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    charge = SlowCharge(40.0)
    provider = FixedProvider(lambda view: CHARGE)
    async with open_supervisor(
        [slow_machine(charge)], memory_store, provider=provider, clock=trio.current_time
    ) as sup:
        handle = await sup.start_run("shop", run_id="r-1")
        await trio.sleep(10.0)
        await sup.cancel_run("r-1", "withdrawn")
        result = await handle.wait()
    assert (charge.done, charge.cut) == (0, 1)
    assert (result.outcome, result.reason) == ("failed", "withdrawn")
    # the intent stays without a commit: recovery will find the call in doubt
    assert kinds(await events_of(memory_store, "r-1")) == [
        "RunStarted", "ModelCalled", "IntentRecorded", "Transitioned", "Failed",
    ]  # fmt: skip


class AnswersAsCut:
    """Answers at once, but as it answers the run's deadline passes (the watchdog fires
    between the answer and the actor's resumption): the answer must still be journaled."""

    model = "late"

    def __init__(self) -> None:
        self.sup: Any = None
        self.calls = 0

    async def propose(self, view: RunView) -> Proposal:
        await trio.lowlevel.checkpoint()
        self.calls += 1
        if self.calls == 1:
            driver = self.sup._drivers[view.run_id]
            driver.fire(driver.deadline_token)  # what the watchdog does
            return Proposal(CHARGE, USAGE, self.model, "prompt")
        raise AssertionError("past the deadline the model must not be asked again")


async def test_an_answer_that_arrives_as_the_deadline_cuts_is_kept(
    memory_store: MemoryStore, events_of: Any
) -> None:
    provider = AnswersAsCut()
    charge = SlowCharge(0.0)
    async with open_supervisor([slow_machine(charge)], memory_store, provider=provider) as sup:
        provider.sup = sup
        result = await (await sup.start_run("shop", run_id="r-1")).wait()
    # The charge ran (in a fresh scope: it was not cancelled); then the next model call is
    # not made (the run's deadline has passed for its handle), and that is final: the
    # supervisor's clock has not reached the deadline here, so the run escalates as
    # unable to get an answer rather than on the deadline breaker.
    assert (charge.done, charge.cut, provider.calls) == (1, 0, 1)
    assert result.reason == "provider_unavailable"
    events = await events_of(memory_store, "r-1")
    assert kinds(events)[:5] == [
        "RunStarted", "ModelCalled", "IntentRecorded", "ToolCommitted", "ProviderFailed",
    ]  # fmt: skip
    assert [fields["error"] for kind, fields in events if kind == "ProviderFailed"] == [
        "no answer before the run's deadline of 30 s"
    ]


async def test_deadline_heap_keeps_only_live_runs(memory_store: MemoryStore) -> None:
    # Each run arms its deadline, a timeout per model call (two here) and one tool timeout;
    # entries of ended runs and of finished calls are dropped as new ones come, so 300 runs
    # never pile up 1,200 entries.
    provider = ScriptedProvider([LOOKUP, DONE])
    async with open_supervisor([machine()], memory_store, provider=provider) as sup:
        sizes = []
        for i in range(300):
            await (await sup.start_run("shop", run_id=f"r-{i}")).wait()
            sizes.append(len(sup._watchdog))
    # one run live at a time: a push prunes the heap once it holds more than 3 * 1 + 64
    assert sizes[:17] == list(range(4, 72, 4))
    assert max(sizes) == 68
    assert min(sizes[17:]) <= 4


async def test_a_watchdog_entry_acts_only_on_the_driver_that_armed_it() -> None:
    # Entries name the run, not the actor's driver; a resumed run gets a new driver under
    # the same id, and an entry its old driver armed must not cut the new one's wait.
    from interlock.runtime._actor import Driver
    from interlock.runtime._watchdog import armed_for as _armed_for

    old, new = Driver("r-1"), Driver("r-1")
    old.deadline_token, new.deadline_token = -1, -7
    new.tool_token = 8
    new.in_provider = True
    new.fire(-1)  # the old driver's deadline fires
    new.fire(3)  # an attempt that already finished
    assert (new.deadline_passed, new.tool_cut, new.scope.cancel_called) == (False, 0, False)
    assert [_armed_for(new, token) for token in (-1, -7, 3, 8)] == [False, True, False, True]
    assert not _armed_for(None, -7)
    new.fire(-7)
    assert new.deadline_passed
    assert new.scope.cancel_called
    new.done = True  # the actor stopped: nothing it armed acts any more
    assert not _armed_for(new, 8)


# -- per-tool circuit ----------------------------------------------------------------------


def charge_once(view: RunView) -> str:
    return CHARGE if not view.history else DONE


async def test_circuit_opens_after_failures_across_runs_and_recovers(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    charge = Downstream()
    spec = machine(charge=charge, breakers=BreakerPolicy(circuit_failures=2, circuit_cooldown=30.0))
    provider = ScriptedProvider(charge_once)
    async with open_supervisor(
        [spec], memory_store, provider=provider, clock=trio.current_time
    ) as sup:

        async def run(run_id: str) -> RunResult:
            return await (await sup.start_run("shop", run_id=run_id)).wait()

        charge.failing = True
        assert (await run("a-1")).outcome == "completed"
        assert sup.circuit_state("charge") == "closed"
        assert (await run("a-2")).outcome == "completed"
        assert sup.circuit_state("charge") == "open"

        refused = await run("a-3")
        assert (refused.outcome, refused.reason) == ("escalated", "circuit")
        assert charge.calls == 2

        await trio.sleep(29.0)
        assert (await run("a-4")).reason == "circuit"
        await trio.sleep(1.0)
        charge.failing = False
        assert (await run("a-5")).outcome == "completed"
        assert sup.circuit_state("charge") == "closed"
        assert charge.calls == 3
        assert sup.statistics().breaker_trips == {"circuit": 2}

    events = await events_of(memory_store, "a-3")
    detail = (
        "circuit of tool 'charge' is open after 2 consecutive failures (last: "
        "ConnectionRefusedError: payment gateway refused the connection); it lets a trial call "
        "through at 1970-01-01T00:00:30+00:00 (in 30.0 s)"
    )
    assert events[2] == (
        "ProposalRejected",
        {
            "state": "WORK",
            "violations": (
                Violation(
                    "circuit_open",
                    "tool",
                    detail,
                    "do not call charge until 1970-01-01T00:00:30+00:00; choose another action or wait",
                ),
            ),
        },
    )
    assert events[3:] == escalation("circuit", 2.0, 2.0, detail, "charge")


async def test_circuit_opens_again_when_the_trial_call_fails(
    memory_store: MemoryStore, autojump_clock: Any
) -> None:
    charge = Downstream()
    charge.failing = True
    spec = machine(charge=charge, breakers=BreakerPolicy(circuit_failures=2, circuit_cooldown=30.0))
    provider = ScriptedProvider(charge_once)
    async with open_supervisor(
        [spec], memory_store, provider=provider, clock=trio.current_time
    ) as sup:

        async def run(run_id: str) -> RunResult:
            return await (await sup.start_run("shop", run_id=run_id)).wait()

        await run("b-1")
        await run("b-2")
        assert sup.circuit_state("charge") == "open"
        await trio.sleep(30.0)
        assert (await run("b-3")).outcome == "completed"  # the trial call ran, and failed
        assert charge.calls == 3
        assert sup.circuit_state("charge") == "open"
        assert (await run("b-4")).reason == "circuit"
        assert charge.calls == 3


async def test_circuit_lets_one_trial_call_through_while_half_open(
    memory_store: MemoryStore, autojump_clock: Any
) -> None:
    charge = Downstream()
    charge.failing = True
    spec = machine(charge=charge, breakers=BreakerPolicy(circuit_failures=1, circuit_cooldown=30.0))
    provider = ScriptedProvider(charge_once)
    async with open_supervisor(
        [spec], memory_store, provider=provider, clock=trio.current_time
    ) as sup:
        await (await sup.start_run("shop", run_id="c-1")).wait()
        assert sup.circuit_state("charge") == "open"
        await trio.sleep(30.0)
        charge.failing = False
        charge.gate = trio.Event()
        trial = await sup.start_run("shop", run_id="c-2")
        await wait_all_tasks_blocked()
        assert sup.circuit_state("charge") == "half_open"
        assert (await (await sup.start_run("shop", run_id="c-3")).wait()).reason == "circuit"
        charge.gate.set()
        assert (await trial.wait()).outcome == "completed"
        assert sup.circuit_state("charge") == "closed"


# -- fallback ------------------------------------------------------------------------------


def apologise(view: RunView) -> Go:
    return Go("DONE", {"answer": f"a human will call you back ({view.data['breaker']})"})


async def test_breaker_sends_the_run_to_its_fallback_step(
    memory_store: MemoryStore, events_of: Any
) -> None:
    spec = machine(on_breaker="FALLBACK", fallback=apologise)
    result = await run_one(spec, ScriptedProvider([BAD, BAD, BAD]), memory_store)
    answer = {"answer": "a human will call you back (consecutive_failures)"}
    assert result == RunResult("r-1", "shop", "DONE", "completed", answer, "", seq=12)
    events = await events_of(memory_store, "r-1")
    detail = f"3 consecutive failures in state 'WORK' (limit 3); last: {BAD_TEXT}"
    assert events[7:] == [
        (
            "BreakerTripped",
            {
                "breaker": "consecutive_failures",
                "state": "WORK",
                "value": 3.0,
                "limit": 3.0,
                "detail": detail,
                "tool": "",
            },
        ),
        (
            "Transitioned",
            {
                "src": "WORK",
                "dst": "FALLBACK",
                "delta": {"breaker": "consecutive_failures"},
                "reason": "breaker",
            },
        ),
        (
            "StepProposed",
            {
                "state": "FALLBACK",
                "raw": msgspec.json.encode({"next": "DONE", "data": answer}).decode(),
                "source": "step",
                "error": "",
            },
        ),
        ("Transitioned", {"src": "FALLBACK", "dst": "DONE", "delta": answer, "reason": "fallback"}),
        ("Completed", {"state": "DONE", "output": answer}),
    ]


async def test_breaker_in_the_fallback_escalates(memory_store: MemoryStore, events_of: Any) -> None:
    def broken(view: RunView) -> Go:
        raise LookupError("no template for this apology")

    spec = machine(on_breaker="FALLBACK", fallback=broken)
    result = await run_one(spec, ScriptedProvider([BAD, BAD, BAD]), memory_store)
    assert (result.state, result.reason) == ("ESCALATE", "consecutive_failures")
    events = await events_of(memory_store, "r-1")
    assert kinds(events[8:]) == [
        "Transitioned",
        *["StepProposed", "ProposalRejected"] * 3,
        "BreakerTripped",
        "Transitioned",
        "Escalated",
    ]
    assert events[-2] == (
        "Transitioned",
        {"src": "FALLBACK", "dst": "ESCALATE", "delta": {}, "reason": "breaker"},
    )
    assert events[-1][1]["state"] == "FALLBACK"
