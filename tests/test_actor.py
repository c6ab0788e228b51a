"""Run actors: tool failures, timeouts, retries and backoff, providers and steps that raise."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from interlock import (
    Call,
    Go,
    Machine,
    ProviderPolicy,
    RetryableToolError,
    RetryPolicy,
    RunResult,
    RunView,
    Step,
    Tool,
    ToolContext,
    ToolError,
    Worker,
    open_supervisor,
)
from interlock.events import TokenUsage, Violation
from interlock.providers import Proposal, ScriptedProvider
from interlock.stores import MemoryStore

CALL = '{"tool": "work", "args": {}}'
DONE = '{"next": "COMPLETED"}'


class Recorder:
    """A tool that records each attempt (context and clock), then does what ``behaviour`` says."""

    def __init__(self, behaviour: Callable[[ToolContext], Any]) -> None:
        self.behaviour = behaviour
        self.attempts: list[tuple[ToolContext, float]] = []

    async def __call__(self, args: Any, ctx: ToolContext) -> Any:
        self.attempts.append((ctx, trio.current_time()))
        result = self.behaviour(ctx)
        if isinstance(result, BaseException):
            raise result
        if result is _HANG:
            await trio.sleep_forever()
        return result

    @property
    def gaps(self) -> list[float]:
        """Seconds between the starts of consecutive attempts."""
        times = [t for _, t in self.attempts]
        return [b - a for a, b in itertools.pairwise(times)]


_HANG = object()


def worker_machine(
    execute: Any,
    *,
    timeout: float = 30.0,
    retry: RetryPolicy | None = None,
    idempotent: bool = True,
) -> Machine:
    """A one-tool machine. The tool is idempotent unless said otherwise: these tests are
    about retries, which only a tool that is safe to repeat gets after any failure (see
    test_exactly_once.py for the others)."""
    return Machine(
        "job",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["work"])},
        tools=[
            Tool(
                "work",
                execute,
                timeout=timeout,
                retry=retry or RetryPolicy(),
                idempotent=idempotent,
            )
        ],
    )


async def run_one(
    spec: Machine, provider: Any, store: MemoryStore, run_id: str = "r-1"
) -> RunResult:
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        return await (await sup.start_run(spec.name, run_id=run_id)).wait()


def tool_outcome(events: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """The event that closed the run's only tool call."""
    (closing,) = [e for e in events if e[0] in ("ToolCommitted", "ToolFailed")]
    return closing


# -- tools that fail ----------------------------------------------------------------------------


async def test_tool_that_raises_is_journaled_and_the_run_continues(
    memory_store: MemoryStore, events_of: Any
) -> None:
    jammed = Recorder(lambda ctx: ToolError("label printer jammed", applied=False))
    fine = Recorder(lambda ctx: {"printed": True})
    spec = worker_machine(jammed, idempotent=False)
    other = Machine(
        "other",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["work"])},
        tools=[Tool("work", fine)],
    )
    provider = ScriptedProvider([CALL, DONE])
    async with open_supervisor([spec, other], memory_store, provider=provider) as sup:
        failing = await sup.start_run("job", run_id="r-1")
        healthy = await sup.start_run("other", run_id="r-2")
        assert (await failing.wait()).outcome == "completed"
        assert (await healthy.wait()).outcome == "completed"

    events = await events_of(memory_store, "r-1")
    assert events[2:5] == [
        ("IntentRecorded", {"state": "WORK", "tool": "work", "args": {}, "key": "r-1:WORK:3"}),
        (
            "ToolFailed",
            {
                "tool": "work",
                "key": "r-1:WORK:3",
                "error": "ToolError: label printer jammed",
                "retryable": False,
                "attempts": 1,
            },
        ),
        ("ModelCalled", {"state": "WORK", "model": "scripted", "raw": DONE, "error": ""}),
    ]
    assert [kind for kind, _ in events[-2:]] == ["Transitioned", "Completed"]
    assert [ctx.attempt for ctx, _ in jammed.attempts] == [1]
    assert tool_outcome(await events_of(memory_store, "r-2")) == (
        "ToolCommitted",
        {
            "tool": "work",
            "key": "r-2:WORK:3",
            "result": {"printed": True},
            "attempts": 1,
            "reused": False,
        },
    )


async def test_tool_gets_its_context(memory_store: MemoryStore) -> None:
    tool = Recorder(lambda ctx: None)
    await run_one(worker_machine(tool), ScriptedProvider([CALL, DONE]), memory_store, "ctx-1")
    assert [ctx for ctx, _ in tool.attempts] == [
        ToolContext(run_id="ctx-1", state="WORK", key="ctx-1:WORK:3", attempt=1)
    ]


async def test_hanging_tool_times_out_and_is_retried_with_backoff(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    tool = Recorder(lambda ctx: _HANG)
    spec = worker_machine(tool, timeout=2.0, retry=RetryPolicy(attempts=3, base=1.0))
    assert (
        await run_one(spec, ScriptedProvider([CALL, DONE]), memory_store)
    ).outcome == "completed"
    assert tool_outcome(await events_of(memory_store, "r-1")) == (
        "ToolFailed",
        {
            "tool": "work",
            "key": "r-1:WORK:3",
            "error": "timed out after 2 s",
            "retryable": True,
            "attempts": 3,
        },
    )
    assert [ctx.attempt for ctx, _ in tool.attempts] == [1, 2, 3]
    # each attempt times out after 2 s, then waits a jittered backoff: [0.5, 1] s, then [1, 2] s
    first, second = (gap - 2.0 for gap in tool.gaps)
    assert 0.5 <= first <= 1.0
    assert 1.0 <= second <= 2.0


async def test_tool_that_swallows_the_timeout_is_committed_and_the_run_goes_on(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    # A tool that catches the cut and returns anyway: its result is what happened, so it
    # is committed, and the run's next model call is not mistaken for a cut one.
    async def stubborn(args: Any, ctx: ToolContext) -> Any:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            return {"done": "anyway"}

    spec = worker_machine(stubborn, timeout=2.0)
    assert (await run_one(spec, ScriptedProvider([CALL, DONE]), memory_store)).outcome == (
        "completed"
    )
    events = await events_of(memory_store, "r-1")
    assert tool_outcome(events)[1]["result"] == {"done": "anyway"}
    assert [fields["error"] for kind, fields in events if kind == "ModelCalled"] == ["", ""]


async def test_tool_that_turns_the_timeout_into_an_error_is_retried(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    calls: list[int] = []

    async def converts(args: Any, ctx: ToolContext) -> Any:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                raise ConnectionError("aborted") from None
        return {"ok": True}

    spec = worker_machine(converts, timeout=2.0, retry=RetryPolicy(attempts=2, base=1.0))
    await run_one(spec, ScriptedProvider([CALL, DONE]), memory_store)
    assert calls == [1, 2]
    assert tool_outcome(await events_of(memory_store, "r-1"))[1]["attempts"] == 2


async def test_tool_with_its_own_nursery_times_out(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    # The cut reaches the tool's tasks and comes back out wrapped in an exception group.
    async def fan_out(args: Any, ctx: ToolContext) -> Any:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
        return {"never": True}

    spec = worker_machine(fan_out, timeout=2.0, retry=RetryPolicy(attempts=1))
    assert (await run_one(spec, ScriptedProvider([CALL, DONE]), memory_store)).outcome == (
        "completed"
    )
    outcome = tool_outcome(await events_of(memory_store, "r-1"))
    assert outcome[0] == "ToolFailed"
    assert (outcome[1]["error"], outcome[1]["attempts"]) == ("timed out after 2 s", 1)


class WorkArgs(msgspec.Struct, forbid_unknown_fields=True):
    n: int


async def test_tool_runs_on_the_args_its_guards_saw(memory_store: MemoryStore) -> None:
    # The gate's validated args go to the tool as they are: not rebuilt from the journal's
    # builtins (that costs a conversion per call, and only recovery needs it).
    seen: list[Any] = []

    def guard(args: WorkArgs, view: RunView) -> None:
        seen.append(args)

    async def work(args: WorkArgs, ctx: ToolContext) -> Any:
        seen.append(args)
        return {"n": args.n}

    spec = Machine(
        "job",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["work"])},
        tools=[Tool("work", work, WorkArgs, guards=[guard])],
    )
    call = '{"tool": "work", "args": {"n": 7}}'
    assert (await run_one(spec, ScriptedProvider([call, DONE]), memory_store)).outcome == (
        "completed"
    )
    assert len(seen) == 2
    assert seen[0] is seen[1]
    assert seen[1] == WorkArgs(7)


async def test_backoff_without_jitter_doubles_up_to_the_cap(
    memory_store: MemoryStore, autojump_clock: Any
) -> None:
    tool = Recorder(lambda ctx: ConnectionResetError("connection reset by peer"))
    retry = RetryPolicy(attempts=5, base=1.0, cap=3.0, jitter=False)
    await run_one(worker_machine(tool, retry=retry), ScriptedProvider([CALL, DONE]), memory_store)
    assert tool.gaps == [1.0, 2.0, 3.0, 3.0]


async def test_retry_after_is_honoured(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    def rate_limited(ctx: ToolContext) -> Any:
        if ctx.attempt < 3:
            return RetryableToolError("429 too many requests", retry_after=7.0)
        return {"sent": True}

    tool = Recorder(rate_limited)
    spec = worker_machine(tool, retry=RetryPolicy(attempts=3, base=0.1, cap=10.0))
    await run_one(spec, ScriptedProvider([CALL, DONE]), memory_store)
    assert tool.gaps == [7.0, 7.0]
    assert tool_outcome(await events_of(memory_store, "r-1")) == (
        "ToolCommitted",
        {
            "tool": "work",
            "key": "r-1:WORK:3",
            "result": {"sent": True},
            "attempts": 3,
            "reused": False,
        },
    )


async def test_retry_after_is_capped(memory_store: MemoryStore, autojump_clock: Any) -> None:
    tool = Recorder(lambda ctx: RetryableToolError("503 unavailable", retry_after=600.0))
    spec = worker_machine(tool, retry=RetryPolicy(attempts=2, cap=10.0))
    await run_one(spec, ScriptedProvider([CALL, DONE]), memory_store)
    assert tool.gaps == [10.0]


async def test_result_that_cannot_be_journaled_is_a_failure(
    memory_store: MemoryStore, events_of: Any
) -> None:
    tool = Recorder(lambda ctx: object())
    await run_one(worker_machine(tool), ScriptedProvider([CALL, DONE]), memory_store)
    _, failed = tool_outcome(await events_of(memory_store, "r-1"))
    assert (failed["error"], failed["retryable"], failed["attempts"]) == (
        "tool 'work' returned a result that cannot be journaled: "
        "the object at result: Encoding objects of type object is unsupported",
        False,
        1,
    )
    assert len(tool.attempts) == 1


# -- providers and steps that raise ---------------------------------------------------------------


class Flaky:
    """Raises for the first ``failures`` calls, then answers ``raw``."""

    model = "flaky"

    def __init__(self, failures: int, raw: str = DONE) -> None:
        self.failures = failures
        self.raw = raw

    async def propose(self, view: RunView) -> Proposal:
        await trio.lowlevel.checkpoint()
        if self.failures:
            self.failures -= 1
            raise RuntimeError("model overloaded")
        return Proposal(self.raw, TokenUsage(3, 1), self.model)


PROVIDER_ERROR = "provider raised RuntimeError: model overloaded"


async def test_provider_that_raises_is_retried_not_rejected(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    """A provider's failure is journaled as its own event and retried after a backoff; it is
    never a rejection of the model (#14)."""
    result = await run_one(worker_machine(Recorder(lambda ctx: None)), Flaky(2), memory_store)
    assert result.outcome == "completed"
    events = await events_of(memory_store, "r-1")
    assert [kind for kind, _ in events] == [
        "RunStarted",
        "ProviderFailed",
        "ProviderFailed",
        "ModelCalled",
        "Transitioned",
        "Completed",
    ]
    first, second = events[1][1], events[2][1]
    assert {k: v for k, v in first.items() if k != "retry_in"} == {
        "state": "WORK",
        "model": "flaky",
        "error": PROVIDER_ERROR,
        "attempt": 1,
        "retryable": True,
        "retry_after": None,
    }
    assert second["attempt"] == 2
    # the default policy: 1 s doubled, jittered into [wait/2, wait]
    assert 0.5 <= first["retry_in"] <= 1.0
    assert 1.0 <= second["retry_in"] <= 2.0


async def test_provider_that_keeps_raising_escalates_as_unavailable(
    memory_store: MemoryStore, events_of: Any, autojump_clock: Any
) -> None:
    spec = Machine(
        "job",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"])},
        provider_policy=ProviderPolicy(attempts=4, base=1.0, jitter=False),
    )
    result = await run_one(spec, Flaky(99), memory_store)
    assert (result.outcome, result.reason) == ("escalated", "provider_unavailable")
    events = await events_of(memory_store, "r-1")
    failed = [fields for kind, fields in events if kind == "ProviderFailed"]
    assert [(f["attempt"], f["retry_in"]) for f in failed] == [
        (1, 1.0),
        (2, 2.0),
        (3, 4.0),
        (4, None),
    ]
    assert not [kind for kind, _ in events if kind == "ProposalRejected"]
    assert events[-1] == (
        "Escalated",
        {
            "state": "WORK",
            "reason": "provider_unavailable",
            "detail": "model 'flaky' did not answer in state 'WORK': 4 calls in a row failed "
            f"(provider_policy.attempts=4); last error: {PROVIDER_ERROR}. Check the provider, "
            "then resume the run",
        },
    )


async def test_exhausted_script_escalates_at_once(
    memory_store: MemoryStore, events_of: Any
) -> None:
    await run_one(worker_machine(Recorder(lambda ctx: None)), ScriptedProvider(["{"]), memory_store)
    events = await events_of(memory_store, "r-1")
    assert events[3] == (
        "ProviderFailed",
        {
            "state": "WORK",
            "model": "scripted",
            "error": "provider raised ScriptExhausted: script for run 'r-1' has 1 outputs; "
            "all were used",
            "attempt": 1,
            "retryable": False,
            "retry_after": None,
            "retry_in": None,
        },
    )
    assert events[-1][1]["reason"] == "provider_unavailable"


class Order(msgspec.Struct):
    amount: float


def step_machine(check: Callable[[RunView], Any], execute: Any = None) -> Machine:
    return Machine(
        "pipeline",
        initial="CHECK",
        states={"CHECK": Step(check, next=["COMPLETED"], tools=["record"])},
        tools=[Tool("record", execute or Recorder(lambda ctx: {"recorded": True}), Order)],
    )


async def test_step_machine_runs_without_a_provider(
    memory_store: MemoryStore, events_of: Any
) -> None:
    def check(view: RunView) -> Call | Go:
        if not view.results:
            return Call("record", {"amount": view.inputs["amount"]})
        return Go("COMPLETED", {"recorded": view.last_result("record")["recorded"]})

    async with open_supervisor([step_machine(check)], memory_store) as sup:
        result = await (await sup.start_run("pipeline", {"amount": 12.5}, run_id="p-1")).wait()
    assert result.output == {"recorded": True}
    assert await events_of(memory_store, "p-1") == [
        ("RunStarted", {"machine": "pipeline", "state": "CHECK", "inputs": {"amount": 12.5}}),
        (
            "StepProposed",
            {
                "state": "CHECK",
                "raw": '{"tool":"record","args":{"amount":12.5}}',
                "source": "step",
                "error": "",
            },
        ),
        (
            "IntentRecorded",
            {"state": "CHECK", "tool": "record", "args": {"amount": 12.5}, "key": "p-1:CHECK:3"},
        ),
        (
            "ToolCommitted",
            {
                "tool": "record",
                "key": "p-1:CHECK:3",
                "result": {"recorded": True},
                "attempts": 1,
                "reused": False,
            },
        ),
        (
            "StepProposed",
            {
                "state": "CHECK",
                "raw": '{"next":"COMPLETED","data":{"recorded":true}}',
                "source": "step",
                "error": "",
            },
        ),
        (
            "Transitioned",
            {"src": "CHECK", "dst": "COMPLETED", "delta": {"recorded": True}, "reason": "step"},
        ),
        ("Completed", {"state": "COMPLETED", "output": {"recorded": True}}),
    ]


async def test_step_that_raises_is_rejected_then_escalated(
    memory_store: MemoryStore, events_of: Any
) -> None:
    def check(view: RunView) -> Go:
        raise ValueError("amount is missing from the inputs")

    async with open_supervisor([step_machine(check)], memory_store) as sup:
        result = await (await sup.start_run("pipeline", run_id="p-1")).wait()
    assert (result.state, result.reason) == ("ESCALATE", "consecutive_failures")
    error = "step 'CHECK' raised ValueError: amount is missing from the inputs"
    events = await events_of(memory_store, "p-1")
    assert events[1:3] == [
        ("StepProposed", {"state": "CHECK", "raw": "", "source": "step", "error": error}),
        (
            "ProposalRejected",
            {
                "state": "CHECK",
                "violations": (
                    Violation(
                        "malformed",
                        "$",
                        f"no proposal: {error}",
                        "the proposer failed; it will be asked again",
                    ),
                ),
            },
        ),
    ]
    assert [kind for kind, _ in events[3:]] == [
        "StepProposed",
        "ProposalRejected",
        "StepProposed",
        "ProposalRejected",
        "BreakerTripped",
        "Transitioned",
        "Escalated",
    ]


async def test_step_with_an_unserialisable_action_is_rejected(
    memory_store: MemoryStore, events_of: Any
) -> None:
    def check(view: RunView) -> Go:
        return Go("COMPLETED", {"when": object()})

    async with open_supervisor([step_machine(check)], memory_store) as sup:
        await (await sup.start_run("pipeline", run_id="p-1")).wait()
    events = await events_of(memory_store, "p-1")
    assert events[1] == (
        "StepProposed",
        {
            "state": "CHECK",
            "raw": "",
            "source": "step",
            "error": "step 'CHECK' raised TypeError: Encoding objects of type object is unsupported",
        },
    )
