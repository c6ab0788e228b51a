"""Exactly-once under retries: a call that may have reached the downstream is reconciled or
escalated, never executed again; provider failures retried, never counted as mistakes (#14)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
import pytest
import trio

from interlock import (
    Applied,
    Machine,
    NotApplied,
    ProviderError,
    ProviderPolicy,
    RetryableToolError,
    RetryPolicy,
    RunView,
    Tool,
    ToolContext,
    ToolError,
    Worker,
    open_supervisor,
    replay,
)
from interlock.core._view import fold
from interlock.events import IntentRecorded, ModelCalled, RunStarted, TokenUsage, hash_prompt
from interlock.providers import Proposal, ScriptedProvider
from interlock.stores import MemoryStore

CALL = '{"tool": "send", "args": {}}'
DONE = '{"next": "COMPLETED"}'


class Downstream:
    """A non-idempotent downstream (an email service) keyed by idempotency key."""

    def __init__(self, failures: list[BaseException | None], *, hang: bool = False) -> None:
        self.failures = failures
        self.hang = hang
        self.executed: list[str] = []
        self.applied: dict[str, dict[str, Any]] = {}
        self.reconciled: list[str] = []

    async def execute(self, args: Any, ctx: ToolContext) -> Any:
        self.executed.append(ctx.key)
        failure = self.failures.pop(0) if self.failures else None
        if self.hang and len(self.executed) == 1:
            self.applied[ctx.key] = {"sent": 1}
            await trio.sleep_forever()
        if failure is not None:
            if getattr(failure, "applied", None) is not False and not isinstance(
                failure, ConnectionRefusedError
            ):
                self.applied[ctx.key] = {"sent": len(self.executed)}  # it went out, then failed
            raise failure
        self.applied[ctx.key] = {"sent": len(self.executed)}
        return self.applied[ctx.key]

    async def reconcile(self, key: str, args: Any, ctx: ToolContext) -> Any:
        self.reconciled.append(key)
        found = self.applied.get(key)
        return NotApplied if found is None else Applied(found)


def machine(downstream: Downstream, **tool: Any) -> Machine:
    tool.setdefault("retry", RetryPolicy(attempts=3, base=1.0))
    return Machine(
        "mail",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["send"])},
        tools=[Tool("send", downstream.execute, **tool)],
    )


async def run(spec: Machine, store: MemoryStore, script: list[str] | None = None) -> Any:
    provider = ScriptedProvider(script or [CALL, DONE])
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        return await (await sup.start_run("mail", run_id="r-1")).wait()


def kinds(events: list[Any]) -> list[str]:
    return [type(e).__name__ for e in events]


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(ConnectionResetError("connection reset by peer"), id="connection-reset"),
        pytest.param(TimeoutError("read timed out"), id="timeout-error"),
        pytest.param(RetryableToolError("503 after the send"), id="retryable-unknown"),
        pytest.param(ValueError("bad response body"), id="any-exception"),
    ],
)
async def test_a_non_idempotent_tool_is_never_executed_twice_after_a_failed_attempt(
    failure: Exception, autojump_clock: Any
) -> None:
    downstream = Downstream([failure])
    store = MemoryStore()
    result = await run(machine(downstream), store)
    assert downstream.executed == ["r-1:WORK:3"]  # once, though the policy allows 3
    assert (result.outcome, result.reason) == ("escalated", "in_doubt_side_effect")
    events = await store.load("r-1")
    escalated = events[-1]
    assert escalated.detail == (
        f"tool 'send' with key 'r-1:WORK:3' may or may not have been applied "
        f"({type(failure).__name__}: {failure}), and it is not idempotent and cannot "
        "reconcile (give the Tool reconcile= to ask its downstream whether the key was "
        "applied); check the downstream system, then resume or abort"
    )
    assert replay(events, machine(Downstream([]))).ok


async def test_a_timed_out_attempt_is_in_doubt_not_retried(autojump_clock: Any) -> None:
    downstream = Downstream([], hang=True)
    store = MemoryStore()
    result = await run(machine(downstream, timeout=5.0), store)
    assert downstream.executed == ["r-1:WORK:3"]
    assert result.reason == "in_doubt_side_effect"
    assert "(timed out after 5 s)" in (await store.load("r-1"))[-1].detail


@pytest.mark.parametrize(
    ("failure", "declared"),
    [
        pytest.param(
            RetryableToolError("429", retry_after=2.0, applied=False), (), id="applied-false"
        ),
        pytest.param(
            ConnectionRefusedError("refused"), (ConnectionRefusedError,), id="not-applied-type"
        ),
    ],
)
async def test_a_failure_that_says_not_applied_permits_a_retry(
    failure: Exception, declared: tuple[type[BaseException], ...], autojump_clock: Any
) -> None:
    downstream = Downstream([failure])
    store = MemoryStore()
    result = await run(machine(downstream, not_applied=declared), store)
    assert result.outcome == "completed"
    assert downstream.executed == ["r-1:WORK:3", "r-1:WORK:3"]  # the same key
    assert len(downstream.applied) == 1
    committed = [e for e in await store.load("r-1") if type(e).__name__ == "ToolCommitted"]
    assert [(c.attempts, c.result) for c in committed] == [(2, {"sent": 2})]


async def test_a_definite_failure_goes_back_to_the_model(autojump_clock: Any) -> None:
    downstream = Downstream([ToolError("recipient unknown", applied=False)])
    store = MemoryStore()
    result = await run(machine(downstream), store)
    assert result.outcome == "completed"
    events = await store.load("r-1")
    assert kinds(events)[2:5] == ["IntentRecorded", "ToolFailed", "ModelCalled"]
    assert downstream.executed == ["r-1:WORK:3"]


async def test_idempotent_tools_still_retry_with_the_same_key(autojump_clock: Any) -> None:
    downstream = Downstream([ConnectionResetError("reset"), TimeoutError("slow")])
    store = MemoryStore()
    result = await run(machine(downstream, idempotent=True), store)
    assert result.outcome == "completed"
    assert downstream.executed == ["r-1:WORK:3"] * 3


async def test_in_doubt_and_applied_commits_the_reconciled_result_without_executing(
    autojump_clock: Any,
) -> None:
    downstream = Downstream([ConnectionResetError("reset after send")])
    store = MemoryStore()
    spec = machine(downstream, reconcile=downstream.reconcile)
    result = await run(spec, store)
    assert result.outcome == "completed"
    assert downstream.executed == ["r-1:WORK:3"]
    assert downstream.reconciled == ["r-1:WORK:3"]
    events = await store.load("r-1")
    assert kinds(events)[2:6] == ["IntentRecorded", "ToolInDoubt", "Reconciled", "ToolCommitted"]
    assert events[4].applied is True
    assert (events[5].result, events[5].reconciled, events[5].attempts) == ({"sent": 1}, True, 0)
    assert replay(events, machine(Downstream([]), reconcile=downstream.reconcile)).ok


async def test_in_doubt_and_not_applied_executes_once_more(autojump_clock: Any) -> None:
    downstream = Downstream([ConnectionRefusedError("never left")])  # not recorded as applied
    store = MemoryStore()
    result = await run(machine(downstream, reconcile=downstream.reconcile), store)
    assert result.outcome == "completed"
    assert downstream.executed == ["r-1:WORK:3", "r-1:WORK:3"]
    events = await store.load("r-1")
    assert kinds(events)[2:6] == ["IntentRecorded", "ToolInDoubt", "Reconciled", "ToolCommitted"]
    assert events[4].applied is False
    assert replay(events, machine(Downstream([]), reconcile=downstream.reconcile)).ok


@pytest.mark.parametrize("bound", [1, 2, 3])
async def test_a_call_reconciled_as_never_applied_stops_at_its_policys_bound(
    bound: int, autojump_clock: Any
) -> None:
    """(issue 33) Every execution of a tool that is not safe to repeat fails after it was
    dispatched, and its reconcile keeps answering "not applied". The call is reconciled
    at most ``RetryPolicy.attempts`` times, each "not applied" executing it once more with
    its key: the first execution and one per reconciliation, then it escalates in doubt."""
    executed: list[str] = []
    reconciled: list[str] = []

    async def execute(args: Any, ctx: ToolContext) -> Any:
        executed.append(ctx.key)
        raise ConnectionResetError("reset after the send")

    async def reconcile(key: str, args: Any, ctx: ToolContext) -> Any:
        reconciled.append(key)
        return NotApplied

    spec = Machine(
        "mail",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["send"])},
        tools=[
            Tool("send", execute, retry=RetryPolicy(attempts=bound, base=1.0), reconcile=reconcile)
        ],
    )
    store = MemoryStore()
    result = await run(spec, store)
    assert (result.outcome, result.reason) == ("escalated", "in_doubt_side_effect")
    assert len(executed) == bound + 1  # the tool's real executions, all with one key
    assert set(executed) == {"r-1:WORK:3"}
    assert reconciled == ["r-1:WORK:3"] * bound
    events = await store.load("r-1")
    assert kinds(events).count("ToolInDoubt") == bound
    assert f"still in doubt after {bound} reconciliations" in events[-1].detail
    assert replay(events, spec).ok


@pytest.mark.parametrize(
    "how", ["raises", "hangs", "returns-garbage", "generator-exit", "stray-cancelled"]
)
async def test_a_reconcile_that_fails_escalates_as_in_doubt(how: str, autojump_clock: Any) -> None:
    """(#33: GeneratorExit, and a trio.Cancelled raised while nothing is cancelled, used
    to end the supervisor.)"""
    with trio.CancelScope() as scope:  # a Cancelled of a cancellation that is over
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            stray = exc

    async def reconcile(key: str, args: Any, ctx: ToolContext) -> Any:
        if how == "raises":
            raise ConnectionError("mail API down")
        if how == "generator-exit":
            raise GeneratorExit("closed")
        if how == "stray-cancelled":
            raise stray
        if how == "hangs":
            await trio.sleep_forever()
        return {"sent": True}

    downstream = Downstream([ConnectionResetError("reset")])
    store = MemoryStore()
    result = await run(machine(downstream, reconcile=reconcile, timeout=5.0), store)
    assert (result.outcome, result.reason) == ("escalated", "in_doubt_side_effect")
    assert downstream.executed == ["r-1:WORK:3"]
    events = await store.load("r-1")
    (reconciled,) = [e for e in events if type(e).__name__ == "Reconciled"]
    assert reconciled.applied is None
    assert (
        reconciled.error
        == {
            "raises": "reconcile raised ConnectionError: mail API down",
            "hangs": "reconcile timed out after 5 s",
            "returns-garbage": "reconcile returned dict, not Applied(result) or NotApplied",
            "generator-exit": "reconcile raised GeneratorExit: closed",
            "stray-cancelled": "reconcile raised Cancelled (raised by the tool while nothing "
            "was cancelled)",
        }[how]
    )
    assert f"its reconcile failed: {reconciled.error}" in events[-1].detail


async def crashed_journal(store: MemoryStore) -> None:
    """A run whose intent is durable but whose outcome is not: a crash in between."""
    now = time.time()
    await store.append(
        [
            RunStarted(run_id="r-1", seq=1, ts=now, machine="mail", state="WORK"),
            ModelCalled(
                run_id="r-1",
                seq=2,
                ts=now,
                state="WORK",
                model="scripted",
                prompt_hash=hash_prompt(""),
                prompt="",
                raw=CALL,
                usage=TokenUsage(),
            ),
            IntentRecorded(
                run_id="r-1", seq=3, ts=now, state="WORK", tool="send", args={}, key="r-1:WORK:3"
            ),
        ]
    )


@pytest.mark.parametrize("applied", [True, False])
async def test_recovery_reconciles_a_call_in_doubt(applied: bool) -> None:
    store = MemoryStore()
    await crashed_journal(store)
    downstream = Downstream([])
    if applied:
        downstream.applied["r-1:WORK:3"] = {"sent": "before the crash"}
    spec = machine(downstream, reconcile=downstream.reconcile)
    async with open_supervisor([spec], store, provider=ScriptedProvider([DONE])) as sup:
        (handle,) = await sup.resume_unfinished()
        assert (await handle.wait()).outcome == "completed"
    assert downstream.reconciled == ["r-1:WORK:3"]
    assert downstream.executed == ([] if applied else ["r-1:WORK:3"])
    events = await store.load("r-1")
    assert kinds(events)[3:6] == ["ToolInDoubt", "Reconciled", "ToolCommitted"]
    assert events[3].after_crash
    assert replay(events, spec).ok


class Unavailable:
    """Fails with ``errors`` in turn, then answers DONE."""

    model = "remote"

    def __init__(self, *errors: BaseException, hang: bool = False) -> None:
        self.errors = list(errors)
        self.hang = hang
        self.calls: list[float] = []

    async def propose(self, view: RunView) -> Proposal:
        self.calls.append(trio.current_time())
        if self.hang and len(self.calls) == 1:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        if self.errors:
            raise self.errors.pop(0)
        return Proposal(DONE, TokenUsage(1, 1), self.model)


def plain(policy: ProviderPolicy) -> Machine:
    return Machine(
        "mail", initial="WORK", states={"WORK": Worker(next=["COMPLETED"])}, provider_policy=policy
    )


async def test_provider_retry_after_is_honoured_and_never_counts_as_a_rejection(
    autojump_clock: Any,
) -> None:
    errors = [ProviderError("429 too many requests", retry_after=7.0, status=429)] * 4
    provider = Unavailable(*errors)
    store = MemoryStore()
    spec = plain(ProviderPolicy(attempts=5, base=0.5, cap=10.0))
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        result = await (await sup.start_run("mail", run_id="r-1")).wait()
    # four 429s in a row would have tripped consecutive_failures (3) as model mistakes
    assert result.outcome == "completed"
    assert [round(b - a, 6) for a, b in itertools.pairwise(provider.calls)] == [7.0] * 4
    events = await store.load("r-1")
    assert [e.retry_in for e in events if type(e).__name__ == "ProviderFailed"] == [7.0] * 4
    assert replay(events, spec).ok


async def test_a_model_call_past_its_timeout_is_a_provider_failure(autojump_clock: Any) -> None:
    provider = Unavailable(hang=True)
    store = MemoryStore()
    spec = plain(ProviderPolicy(timeout=20.0, base=1.0, jitter=False))
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        result = await (await sup.start_run("mail", run_id="r-1")).wait()
    assert result.outcome == "completed"
    (failed,) = [e for e in await store.load("r-1") if type(e).__name__ == "ProviderFailed"]
    assert (failed.error, failed.retry_in) == ("the model call timed out after 20 s", 1.0)
    assert provider.calls == [0.0, 21.0]


async def test_provider_retries_stop_at_the_elapsed_cap(autojump_clock: Any) -> None:
    provider = Unavailable(*[ProviderError("503", status=503)] * 10)
    store = MemoryStore()
    spec = plain(ProviderPolicy(attempts=10, base=10.0, cap=10.0, max_elapsed=25.0, jitter=False))
    async with open_supervisor([spec], store, provider=provider, clock=trio.current_time) as sup:
        result = await (await sup.start_run("mail", run_id="r-1")).wait()
    assert (result.outcome, result.reason) == ("escalated", "provider_unavailable")
    failed = [e for e in await store.load("r-1") if type(e).__name__ == "ProviderFailed"]
    assert [f.retry_in for f in failed] == [10.0, 10.0, None]
    assert (
        "retrying would go past 25 s since the first failure"
        in (await store.load("r-1"))[-1].detail
    )


async def test_large_data_is_journaled_once() -> None:
    """A 200 KB answer used to be stored three times: the raw, the delta, the output."""
    answer = "x" * 200_000
    raw = msgspec.json.encode({"next": "COMPLETED", "data": {"answer": answer}}).decode()
    store = MemoryStore()
    spec = plain(ProviderPolicy())
    async with open_supervisor([spec], store, provider=ScriptedProvider([raw])) as sup:
        result = await (await sup.start_run("mail", run_id="r-1")).wait()
    assert result.output == {"answer": answer}
    events = await store.load("r-1")
    size = sum(len(msgspec.msgpack.encode(e)) for e in events)
    assert len(raw) < size < len(raw) + 2_000
    transitioned, completed = events[-2:]
    assert (transitioned.delta, transitioned.delta_in_proposal) == ({}, True)
    assert (completed.output, completed.output_in_delta) == (None, True)
    assert replay(events, spec).ok
    assert fold(spec, events).output == {"answer": answer}


def test_a_journal_from_before_provider_failed_still_replays() -> None:
    """Journals written before #14 record a failed model call as ``model_called`` with
    ``error``, then a ``malformed`` rejection: replay decides them as they were then."""
    from interlock.events import Completed, ProposalRejected, Transitioned, Violation

    error = "provider raised RuntimeError: model overloaded"

    def called(seq: int, raw: str, failed: str = "") -> ModelCalled:
        return ModelCalled(
            run_id="r-1",
            seq=seq,
            ts=10.0,
            state="WORK",
            model="flaky",
            prompt_hash=hash_prompt(""),
            prompt="",
            raw=raw,
            usage=TokenUsage(),
            error=failed,
        )

    events = [
        RunStarted(run_id="r-1", seq=1, ts=10.0, machine="mail", state="WORK"),
        called(2, "", error),
        ProposalRejected(
            run_id="r-1",
            seq=3,
            ts=10.0,
            state="WORK",
            violations=(
                Violation(
                    "malformed",
                    "$",
                    f"no proposal: {error}",
                    "the proposer failed; it will be asked again",
                ),
            ),
        ),
        called(4, DONE),
        Transitioned(run_id="r-1", seq=5, ts=10.0, src="WORK", dst="COMPLETED"),
        Completed(run_id="r-1", seq=6, ts=10.0, state="COMPLETED"),
    ]
    report = replay(events, plain(ProviderPolicy()))
    assert report.diverged == ()


async def test_a_thread_abandoned_at_its_timeout_is_in_doubt_and_its_late_result_ignored() -> None:
    """Timeouts are cooperative: a tool doing blocking work in a thread is cut only if the
    thread is abandoned on cancel; its outcome is then in doubt, and whatever the thread
    returns later is never committed."""
    import threading

    release = threading.Event()
    finished = threading.Event()

    def blocking_send() -> dict[str, Any]:
        release.wait(10)
        finished.set()
        return {"sent": "late"}

    async def send(args: Any, ctx: ToolContext) -> Any:
        return await trio.to_thread.run_sync(blocking_send, abandon_on_cancel=True)

    spec = Machine(
        "mail",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["send"])},
        tools=[Tool("send", send, timeout=0.2)],
    )
    store = MemoryStore()
    async with open_supervisor([spec], store, provider=ScriptedProvider([CALL, DONE])) as sup:
        result = await (await sup.start_run("mail", run_id="r-1")).wait()
    release.set()
    finished.wait(10)
    assert (result.outcome, result.reason) == ("escalated", "in_doubt_side_effect")
    events = await store.load("r-1")
    assert not [e for e in events if type(e).__name__ == "ToolCommitted"]
    assert "(timed out after 0.2 s)" in events[-1].detail


async def test_a_damaged_journal_stops_a_resume_before_any_run_starts(tmp_path: Any) -> None:
    """Two unfinished runs, the second one's journal damaged: the resume refuses before it
    has started the first (it used to start runs one by one, then stop part-way)."""
    import sqlite3

    from interlock.errors import JournalCorrupt
    from interlock.stores import open_sqlite_store

    path = str(tmp_path / "j.db")
    store = await open_sqlite_store(path)
    await crashed_journal(store)
    await store.append(
        [
            RunStarted(run_id="r-2", seq=1, ts=time.time(), machine="mail", state="WORK"),
            IntentRecorded(
                run_id="r-2", seq=2, ts=time.time(), state="WORK", tool="send", args={},
                key="r-2:WORK:2",
            ),
        ]
    )  # fmt: skip
    await store.aclose()
    with sqlite3.connect(path) as conn:  # flip one byte inside r-2's frames
        (body,) = conn.execute("SELECT body FROM chunks WHERE run_id = 'r-2'").fetchone()
        damaged = body[:-3] + bytes([body[-3] ^ 0x20]) + body[-2:]
        conn.execute("UPDATE chunks SET body = ? WHERE run_id = 'r-2'", (damaged,))
    downstream = Downstream([])
    store = await open_sqlite_store(path)
    try:
        spec = machine(downstream, reconcile=downstream.reconcile)
        async with open_supervisor([spec], store, provider=ScriptedProvider([DONE])) as sup:
            with pytest.raises(JournalCorrupt):
                await sup.resume_unfinished()
            assert sup.handles == {}
        assert downstream.reconciled == []
        assert [type(e).__name__ for e in await store.load("r-1")][-1] == "IntentRecorded"
    finally:
        await store.aclose()


# -- the same call proposed twice in one run (issue 32) ------------------------------------


class Shop:
    """A refund service, an order lookup and a reminder, counting what they executed."""

    def __init__(self) -> None:
        self.executed: list[tuple[str, str]] = []

    def tool(self, name: str) -> Any:
        async def execute(args: Any, ctx: ToolContext) -> Any:
            self.executed.append((name, ctx.key))
            return {"tool": name, "key": ctx.key}

        return execute


class Order(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    amount: float = 0.0


def shop(service: Shop, *, refund_repeatable: bool = False) -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup", "refund", "remind"])},
        tools=[
            Tool("lookup", service.tool("lookup"), Order, read_only=True),
            Tool(
                "refund",
                service.tool("refund"),
                Order,
                idempotent=True,
                repeatable=refund_repeatable,
            ),
            Tool("remind", service.tool("remind"), Order, repeatable=True),
        ],
    )


SHOP_SCRIPT = [
    '{"tool": "lookup", "args": {"order_id": "o1"}}',
    '{"tool": "refund", "args": {"order_id": "o1", "amount": 25}}',
    '{"tool": "lookup", "args": {"order_id": "o1"}}',
    # the same refund again, its args in another order and 25 written as a float
    '{"tool": "refund", "args": {"amount": 25.0, "order_id": "o1"}}',
    '{"tool": "remind", "args": {"order_id": "o1"}}',
    '{"tool": "remind", "args": {"order_id": "o1"}}',
    DONE,
]


async def test_the_same_side_effecting_call_proposed_twice_runs_once() -> None:
    """Issue 32: in a 60-run demo, two customers got a double refund and a double email,
    each call committed under its own key. The second identical refund is refused, quoting
    the first one's result; a read-only call and a repeatable one run again."""
    service, store = Shop(), MemoryStore()
    async with open_supervisor(
        [shop(service)], store, provider=ScriptedProvider(SHOP_SCRIPT)
    ) as sup:
        result = await (await sup.start_run("shop", run_id="r-1")).wait()
    assert result.outcome == "completed"
    assert [name for name, _key in service.executed] == [
        "lookup",
        "refund",
        "lookup",
        "remind",
        "remind",
    ]
    events = await store.load("r-1")
    refund_key = next(key for name, key in service.executed if name == "refund")
    committed = next(
        e for e in events if type(e).__name__ == "ToolCommitted" and e.key == refund_key
    )
    (rejection,) = [e for e in events if type(e).__name__ == "ProposalRejected"]
    (violation,) = rejection.violations
    assert violation.code == "already_committed"
    assert violation.message == (
        f"refund was already called with these args in this run: committed at seq "
        f"{committed.seq} (key {refund_key!r}) with result "
        f'{{"tool":"refund","key":"{refund_key}"}}; calling it again would apply it twice'
    )
    assert violation.hint == (
        f"use the result of seq {committed.seq} instead of calling refund again, or move on"
    )
    # The decision is the journal's: replay reproduces it, and a machine that declares the
    # refund repeatable decides that proposal differently, at its seq.
    assert replay(events, shop(Shop())).ok
    changed = replay(events, shop(Shop(), refund_repeatable=True))
    (diverged,) = changed.diverged
    assert diverged.divergence is not None
    assert diverged.divergence.seq == rejection.seq


async def test_a_repeatable_side_effecting_tool_runs_each_time() -> None:
    service, store = Shop(), MemoryStore()
    async with open_supervisor(
        [shop(service, refund_repeatable=True)], store, provider=ScriptedProvider(SHOP_SCRIPT)
    ) as sup:
        result = await (await sup.start_run("shop", run_id="r-1")).wait()
    assert result.outcome == "completed"
    assert [name for name, _key in service.executed].count("refund") == 2
    refunds = [key for name, key in service.executed if name == "refund"]
    assert len(set(refunds)) == 2  # each call under its own key
    assert replay(await store.load("r-1"), shop(Shop(), refund_repeatable=True)).ok
