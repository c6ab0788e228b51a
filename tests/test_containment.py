"""One run's fault stays in that run: bad providers and tools beside 50 healthy runs (#14)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from interlock import (
    Machine,
    ProviderPolicy,
    RunView,
    Step,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
    replay,
)
from interlock.core._events import describe_exception
from interlock.events import TokenUsage
from interlock.providers import Proposal, ScriptedProvider
from interlock.stores import MemoryStore

CALL = '{"tool": "work", "args": {}}'
DONE = '{"next": "COMPLETED"}'
HEALTHY = 50


async def work(args: Any, ctx: ToolContext) -> Any:
    await trio.lowlevel.checkpoint()
    return {"ok": True}


def job(name: str, execute: Any = work, **tool: Any) -> Machine:
    return Machine(
        name,
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["work"])},
        tools=[Tool("work", execute, **tool)],
        provider_policy=ProviderPolicy(attempts=2, base=0.01, cap=0.01, jitter=False),
    )


class Answers:
    """A provider whose every answer is ``answer`` (or raises it, if it is an exception)."""

    model = "bad"

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    async def propose(self, view: RunView) -> Any:
        await trio.lowlevel.checkpoint()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class Custom(BaseException):
    """Not an Exception: a provider or tool may still raise it."""


def surrogate_escaped() -> str:
    return b'{"next": "COMPLETED", "data": {"name": "caf\xe9"}}'.decode("utf-8", "surrogateescape")


BAD_ANSWERS = [
    pytest.param("just text", "the provider returned str, not a Proposal", id="str"),
    pytest.param(None, "the provider returned NoneType, not a Proposal", id="none"),
    pytest.param(b"{}", "the provider returned bytes, not a Proposal", id="bytes"),
    pytest.param(Proposal(raw=123), "the provider's Proposal.raw is int, not str", id="raw-int"),  # type: ignore[arg-type]
    pytest.param(
        Proposal(raw=DONE, usage=None),  # type: ignore[arg-type]
        "the provider's Proposal.usage is NoneType, not a TokenUsage of two non-negative ints",
        id="usage-none",
    ),
    pytest.param(
        Proposal(raw='{"next": "\ud800"}'),
        "the proposal holds U+D800 at character 10 (byte offset 10): a lone surrogate, "
        "which UTF-8 cannot encode",
        id="lone-surrogate",
    ),
    pytest.param(
        Proposal(raw=surrogate_escaped()),
        "the proposal holds U+DCE9 at character 43 (byte offset 43): the invalid UTF-8 byte "
        "0xE9, decoded with surrogateescape, which UTF-8 cannot encode",
        id="surrogateescape",
    ),
]


async def with_healthy_runs(bad: Machine, provider: Any, store: MemoryStore) -> Any:
    """Run one run of ``bad`` with ``provider`` beside 50 healthy runs; return its result."""
    healthy = job("healthy")
    providers = {"healthy": ScriptedProvider([CALL, DONE]), bad.name: provider}
    async with open_supervisor([healthy, bad], store, provider=providers) as sup:
        runs = [await sup.start_run("healthy", run_id=f"h-{i}") for i in range(HEALTHY)]
        faulty = await sup.start_run(bad.name, run_id="bad-1")
        results = [await run.wait() for run in runs]
        result = await faulty.wait()
    assert [r.outcome for r in results] == ["completed"] * HEALTHY
    return result


@pytest.mark.parametrize(("answer", "defect"), BAD_ANSWERS)
async def test_a_provider_answer_that_is_not_a_proposal_is_rejected_for_its_run_only(
    answer: Any, defect: str
) -> None:
    store = MemoryStore()
    result = await with_healthy_runs(job("bad"), Answers(answer), store)
    assert (result.outcome, result.reason) == ("escalated", "consecutive_failures")
    events = await store.load("bad-1")
    rejected = [e for e in events if type(e).__name__ == "ProposalRejected"]
    assert len(rejected) == 3
    (violation,) = rejected[0].violations
    assert (violation.code, violation.message) == (
        "malformed",
        f"proposal cannot be read: {defect}",
    )
    called = [e for e in events if type(e).__name__ == "ModelCalled"]
    assert called[0].defect == defect
    if isinstance(answer, Proposal) and isinstance(answer.raw, str):  # kept, escaped
        assert called[0].raw == answer.raw.encode("utf-8", "backslashreplace").decode()
    assert replay(events, job("bad")).ok


@pytest.mark.parametrize(
    "raised",
    [
        pytest.param(RuntimeError("model overloaded"), id="exception"),
        pytest.param(
            ExceptionGroup("fan-out failed", [ValueError("a"), KeyError("b")]), id="group"
        ),
        pytest.param(Custom("not an Exception"), id="base-exception"),
        pytest.param(GeneratorExit("closed"), id="generator-exit"),
    ],
)
async def test_a_provider_that_raises_anything_fails_only_its_run(raised: BaseException) -> None:
    store = MemoryStore()
    result = await with_healthy_runs(job("bad"), Answers(raised), store)
    assert (result.outcome, result.reason) == ("escalated", "provider_unavailable")
    events = await store.load("bad-1")
    failed = [e for e in events if type(e).__name__ == "ProviderFailed"]
    assert [f.attempt for f in failed] == [1, 2]
    assert failed[0].error.startswith(f"provider raised {type(raised).__name__}")
    assert not [e for e in events if type(e).__name__ == "ProposalRejected"]
    assert replay(events, job("bad")).ok


async def test_a_tool_that_raises_an_exception_group_is_a_tool_failure_with_its_leaves() -> None:
    async def fan_out(args: Any, ctx: ToolContext) -> Any:
        async def fail(exc: Exception) -> None:
            raise exc  # before any checkpoint: both fail before either is cancelled

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail, ValueError("shard 1 refused"))
            nursery.start_soon(fail, KeyError("shard 2"))

    store = MemoryStore()
    bad = job("bad", fan_out, idempotent=True)
    result = await with_healthy_runs(bad, ScriptedProvider([CALL, DONE]), store)
    assert result.outcome == "completed"
    events = await store.load("bad-1")
    (failed,) = [e for e in events if type(e).__name__ == "ToolFailed"]
    assert failed.error.startswith("ExceptionGroup: ")
    assert "(2 leaves: " in failed.error
    assert "ValueError: shard 1 refused" in failed.error
    assert "KeyError: 'shard 2'" in failed.error
    assert replay(events, bad).ok


async def test_a_tool_that_raises_a_base_exception_is_a_tool_failure() -> None:
    async def odd(args: Any, ctx: ToolContext) -> Any:
        raise Custom("odd")

    store = MemoryStore()
    result = await with_healthy_runs(
        job("bad", odd, idempotent=True), ScriptedProvider([CALL, DONE]), store
    )
    assert result.outcome == "completed"
    (failed,) = [e for e in await store.load("bad-1") if type(e).__name__ == "ToolFailed"]
    assert failed.error == "Custom: odd"


async def stray_cancelled() -> trio.Cancelled:
    """A real ``trio.Cancelled``, caught in its own scope and kept: code that raises it
    later, where nothing is cancelled, has a bug; that is not a cancellation."""
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            return exc
    raise AssertionError("the scope was cancelled")


async def test_a_stray_cancelled_from_a_tool_is_a_tool_failure_of_its_run_only() -> None:
    """A tool that raises trio.Cancelled while nothing is cancelled used to end its run's
    task silently, and the supervisor with it: ``open_supervisor`` returned with the
    runs unfinished (#33)."""
    stray = await stray_cancelled()

    async def confused(args: Any, ctx: ToolContext) -> Any:
        raise stray

    store = MemoryStore()
    bad = job("bad", confused, idempotent=True)
    result = await with_healthy_runs(bad, ScriptedProvider([CALL, DONE]), store)
    assert result.outcome == "completed"
    events = await store.load("bad-1")
    (failed,) = [e for e in events if type(e).__name__ == "ToolFailed"]
    assert failed.error == "Cancelled (raised by the tool while nothing was cancelled)"
    assert replay(events, bad).ok


async def test_a_stray_cancelled_from_a_provider_is_a_provider_failure_of_its_run_only() -> None:
    """(#33) The provider's stray Cancelled is a failure to answer, retried, then escalated."""
    store = MemoryStore()
    result = await with_healthy_runs(job("bad"), Answers(await stray_cancelled()), store)
    assert (result.outcome, result.reason) == ("escalated", "provider_unavailable")
    events = await store.load("bad-1")
    failed = [e for e in events if type(e).__name__ == "ProviderFailed"]
    assert [f.error for f in failed] == [
        "provider raised Cancelled (raised by the provider while nothing was cancelled)"
    ] * 2
    assert replay(events, job("bad")).ok


async def test_generator_exit_from_a_tool_is_a_tool_failure_of_its_run_only() -> None:
    """(#33) GeneratorExit raised by a tool used to crash the supervisor."""

    async def closing(args: Any, ctx: ToolContext) -> Any:
        raise GeneratorExit("closed")

    store = MemoryStore()
    bad = job("bad", closing, idempotent=True)
    result = await with_healthy_runs(bad, ScriptedProvider([CALL, DONE]), store)
    assert result.outcome == "completed"
    (failed,) = [e for e in await store.load("bad-1") if type(e).__name__ == "ToolFailed"]
    assert failed.error == "GeneratorExit: closed"


async def test_a_real_cancellation_still_ends_the_runs_while_a_tool_runs(
    autojump_clock: Any,
) -> None:
    """A Cancelled that is a cancellation (the supervisor's scope was cancelled) is not
    taken for the tool's failure: it ends the run's task and the supervisor (#33)."""
    started = trio.Event()

    async def slow(args: Any, ctx: ToolContext) -> Any:
        started.set()
        await trio.sleep_forever()

    store = MemoryStore()
    bad = job("bad", slow, idempotent=True)
    with trio.move_on_after(60) as scope:
        async with open_supervisor([bad], store, provider=ScriptedProvider([CALL, DONE])) as sup:
            await sup.start_run("bad", run_id="bad-1")
            await started.wait()
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    kinds = [type(e).__name__ for e in await store.load("bad-1")]
    assert kinds == ["RunStarted", "ModelCalled", "IntentRecorded"]


@pytest.mark.parametrize("raised", ["own", "generator-exit", "stray-cancelled"])
async def test_a_guard_that_raises_a_base_exception_rejects_its_call_only(raised: str) -> None:
    """A guard raising a BaseException of its own (not an Exception) used to crash the
    supervisor; it is that guard's violation now, as any other guard failure (#33)."""
    stray = await stray_cancelled()
    error: BaseException = {
        "own": Custom("no verdict"),
        "generator-exit": GeneratorExit(),
        "stray-cancelled": stray,
    }[raised]

    def fussy(args: Any, view: RunView) -> None:
        raise error

    store = MemoryStore()
    bad = job("bad", guards=[fussy])
    result = await with_healthy_runs(bad, ScriptedProvider([CALL, DONE]), store)
    assert result.outcome == "completed"
    events = await store.load("bad-1")
    (rejected,) = [e for e in events if type(e).__name__ == "ProposalRejected"]
    (violation,) = rejected.violations
    assert violation.code == "guard"
    assert violation.message.startswith(
        f"guard 'fussy' of tool 'work' raised {type(error).__name__}"
    )
    assert replay(events, bad).ok


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        pytest.param(
            {"rows": [{"a": 1}, {(1, 2): "x"}]},
            "the key (1, 2) of type tuple at result.rows[1]: "
            "Only dicts with str-like or number-like keys are supported",
            id="tuple-key",
        ),
        pytest.param(
            {"owner": {None: "x"}},
            "the key None of type NoneType at result.owner: "
            "Only dicts with str-like or number-like keys are supported",
            id="none-key",
        ),
        pytest.param(
            {"a": {"b": [1, object()]}},
            "the object at result.a.b[1]: Encoding objects of type object is unsupported",
            id="foreign-object",
        ),
    ],
)
async def test_a_result_that_cannot_be_encoded_is_a_tool_error_naming_where(
    returned: Any, problem: str
) -> None:
    """A result with tuple dict keys passed the journal's check (msgpack takes them) and
    failed later, as JSON, while its run was decided: an InternalError, the run left
    running (#33). It is the call's failure now, naming the path and the type."""

    async def odd(args: Any, ctx: ToolContext) -> Any:
        return returned

    store = MemoryStore()
    bad = job("bad", odd, idempotent=True)
    result = await with_healthy_runs(bad, ScriptedProvider([CALL, DONE]), store)
    assert result.outcome == "completed"
    events = await store.load("bad-1")
    (failed,) = [e for e in events if type(e).__name__ == "ToolFailed"]
    assert failed.error == f"tool 'work' returned a result that cannot be journaled: {problem}"
    assert replay(events, bad).ok


def base_exception(raised: str, stray: trio.Cancelled) -> BaseException:
    return {"own": Custom("no"), "generator-exit": GeneratorExit(), "stray-cancelled": stray}[
        raised
    ]


@pytest.mark.parametrize("raised", ["own", "generator-exit", "stray-cancelled"])
async def test_a_step_that_raises_a_base_exception_fails_its_run_only(raised: str) -> None:
    """A step function raising a BaseException that is not an Exception used to crash the
    supervisor (or, a stray Cancelled, end it silently); it is the step's failure (#33)."""
    error = base_exception(raised, await stray_cancelled())

    def check(view: RunView) -> Any:
        raise error

    stepper = Machine(
        "bad", initial="CHECK", states={"CHECK": Step(check, next=["COMPLETED"])}, tools=[]
    )
    store = MemoryStore()
    result = await with_healthy_runs(stepper, None, store)
    assert (result.outcome, result.reason) == ("escalated", "consecutive_failures")
    events = await store.load("bad-1")
    proposed = [e for e in events if type(e).__name__ == "StepProposed"]
    assert proposed[0].error == f"step 'CHECK' raised {describe_exception(error)}"
    assert replay(events, stepper).ok


@pytest.mark.parametrize("raised", ["own", "generator-exit", "stray-cancelled"])
async def test_a_base_exception_while_deciding_ends_that_run_only(raised: str) -> None:
    """User code run while a request is decided (an args Struct's ``__post_init__``)
    raising a BaseException that is not an Exception used to crash the supervisor; it
    ends that run with an InternalError, as an Exception there does (#33)."""
    from interlock.errors import InternalError

    error = base_exception(raised, await stray_cancelled())

    class Args(msgspec.Struct):
        n: int = 0

        def __post_init__(self) -> None:
            raise error

    store = MemoryStore()
    bad = Machine(
        "bad",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["work"])},
        tools=[Tool("work", work, Args)],
    )
    providers = {"healthy": ScriptedProvider([CALL, DONE]), "bad": ScriptedProvider([CALL])}
    async with open_supervisor([job("healthy"), bad], store, provider=providers) as sup:
        runs = [await sup.start_run("healthy", run_id=f"h-{i}") for i in range(HEALTHY)]
        faulty = await sup.start_run("bad", run_id="bad-1")
        assert [(await r.wait()).outcome for r in runs] == ["completed"] * HEALTHY
        with pytest.raises(InternalError, match=r"^run 'bad-1' was stopped by a bug in interl"):
            await faulty.wait()


async def test_system_exit_from_a_tool_is_not_contained() -> None:
    async def interrupted(args: Any, ctx: ToolContext) -> Any:
        raise SystemExit(3)

    async def main() -> None:
        async with open_supervisor(
            [job("bad", interrupted, idempotent=True)], provider=ScriptedProvider([CALL, DONE])
        ) as sup:
            await sup.start_run("bad", run_id="bad-1")
            await trio.sleep_forever()  # SystemExit ends the supervisor, and this with it

    with pytest.raises(SystemExit):
        await main()


async def test_a_bug_while_deciding_one_request_ends_that_run_only(monkeypatch: Any) -> None:
    """A bug met while deciding one run's request (here, a provider's usage whose counts
    break the arithmetic) ends that run with an InternalError; the others go on."""
    from interlock.core import _decider
    from interlock.errors import InternalError

    original = _decider.propose  # the decide path in use: compiled, or its twin

    def broken(run: Any, msg: Any, *rest: Any) -> Any:
        if msg.run_id == "bad-1":
            raise ZeroDivisionError("a bug")
        return original(run, msg, *rest)

    monkeypatch.setattr(_decider, "propose", broken)
    store = MemoryStore()
    healthy = job("healthy")
    async with open_supervisor([healthy], store, provider=ScriptedProvider([CALL, DONE])) as sup:
        runs = [await sup.start_run("healthy", run_id=f"h-{i}") for i in range(HEALTHY)]
        bad = await sup.start_run("healthy", run_id="bad-1")
        assert [(await r.wait()).outcome for r in runs] == ["completed"] * HEALTHY
        with pytest.raises(InternalError, match=r"^run 'bad-1' was stopped by a bug in interlock"):
            await bad.wait()
    # its journal holds what was durable before the bug, nothing of the failed decision
    assert [type(e).__name__ for e in await store.load("bad-1")] == ["RunStarted"]


async def test_a_usage_whose_repr_raises_is_still_a_rejection_of_its_run() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    store = MemoryStore()
    result = await with_healthy_runs(job("bad"), Answers(Proposal(raw=DONE, usage=Broken())), store)  # type: ignore[arg-type]
    assert result.reason == "consecutive_failures"
    (called, *_) = [e for e in await store.load("bad-1") if type(e).__name__ == "ModelCalled"]
    assert called.defect == (
        "the provider's Proposal.usage is Broken, not a TokenUsage of two non-negative ints"
    )


async def test_usage_is_counted_from_valid_proposals_only() -> None:
    store = MemoryStore()
    provider = Answers(Proposal(raw=DONE, usage=TokenUsage(-5, 2)))
    result = await with_healthy_runs(job("bad"), provider, store)
    assert result.reason == "consecutive_failures"
    assert all(
        e.usage == TokenUsage()
        for e in await store.load("bad-1")
        if type(e).__name__ == "ModelCalled"
    )


async def test_a_batch_the_store_cannot_write_fails_its_runs_with_the_store_error() -> None:
    """After a failed write (a full disk, say) the runs of that batch are told why, on every
    later request too: never 'run ... not found' (#14)."""
    from interlock import StoreError

    class FullDisk(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.appends = 0

        async def append(self, events: Any) -> None:
            self.appends += 1
            if self.appends > 1:
                raise StoreError("journal /data/j.db: disk is full, so append wrote nothing")
            await super().append(events)

    store = FullDisk()
    async with open_supervisor(
        [job("healthy")], store, provider=ScriptedProvider([CALL, DONE])
    ) as sup:
        handle = await sup.start_run("healthy", run_id="r-1")
        with pytest.raises(StoreError, match=r"^journal /data/j\.db: disk is full"):
            await handle.wait()
        with pytest.raises(StoreError, match=r"^journal /data/j\.db: disk is full"):
            await sup.cancel_run("r-1")
    assert [type(e).__name__ for e in await store.load("r-1")] == ["RunStarted"]
