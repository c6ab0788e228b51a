"""The per-run loop: observe -> propose -> await the verdict -> execute -> report -> repeat."""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..core._breakers import LEASE_CUT
from ..core._decider import step_proposal
from ..core._events import describe_exception
from ..core._machine import Step
from ..core._messages import Propose, Reconciliation, Report, Sync, ToolCall, Verdict
from ..core._tools import ToolContext
from ..providers._base import TRACEPARENT
from ._requests import (
    answered,
    failed,
    provider_failure,
    reconcile_found,
    reconciled,
    returned,
    tool_failure,
    unanswered,
)
from ._watchdog import armed_for

if TYPE_CHECKING:
    from ..core._messages import Request
    from ..core._tools import Tool
    from ..core._view import RunView
    from ..providers import Provider

#: What a run never contains: the interpreter's own Ctrl-C and exit end the task, and the
#: process (see run_actor). trio's Cancelled ends it too, when it is a cancellation.
_INTERPRETER = (KeyboardInterrupt, SystemExit)


class _Attempts:
    """A verified call's attempts so far. It outlives a cut (see execute_call)."""

    __slots__ = (
        "applied",
        "attempt",
        "call",
        "error",
        "retry_after",
        "retryable",
        "rng",
        "seq",
        "started",
        "state",
    )

    def __init__(self, state: str, seq: int, call: ToolCall) -> None:
        self.state = state
        self.seq = seq
        self.call = call
        self.attempt = 0
        self.started = time.perf_counter()
        self.error = ""
        self.retryable = False
        self.retry_after: float | None = None
        self.applied: bool | None = None
        """Whether the latest failed attempt was applied downstream (None: unknown)."""
        self.rng: random.Random | None = None


#: What a cut carries out of the run's cancelled scope: the model's answer, a call's
#: attempts so far (its latest one timed out), or a finished report or reconciliation.
_Carried = Propose | _Attempts | Report | Reconciliation


#: What run_actor passes _drive after a cut in place of the verdict it started from:
#: only its outcome is read then (the run is running; what the cut carried goes on).
_RUNNING = Verdict(run_id="", seq=0, accepted=True, state="", outcome="running")


class _Cut(Exception):  # a signal inside the actor, never raised out of it
    """The watchdog cut the run's scope; go on with ``carried`` in a fresh scope."""

    def __init__(self, carried: _Carried) -> None:
        self.carried = carried


def _passes_through(exc: BaseException) -> bool:
    """Whether ``exc`` (or a leaf of it, for a group) must leave the run's task as it is:
    KeyboardInterrupt, SystemExit, or a trio.Cancelled while the task is cancelled.

    NOTE: a Cancelled raised where no scope around the task is cancelled (one kept from
    an earlier cancellation and raised again, say) is not a cancellation, and nothing
    would catch it: it would end the run's task, then the supervisor's nursery would take
    it for its own and return as if cancelled. It is the failure of the code that raised
    it, contained like any other.
    """
    if isinstance(exc, BaseExceptionGroup):
        if exc.subgroup(_INTERPRETER) is not None:
            return True
    elif isinstance(exc, _INTERPRETER):
        return True
    return _cancelled(exc) and trio.current_effective_deadline() == -math.inf


def _describe(exc: BaseException, who: str) -> str:
    """How a failure of ``who`` (the tool, the provider) is journaled."""
    text = describe_exception(exc)
    if _cancelled(exc):  # here never a cancellation (see _passes_through)
        text += f" (raised by the {who} while nothing was cancelled)"
    return text


def _cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(trio.Cancelled) is not None
    return isinstance(exc, trio.Cancelled)


class ActorPort(Protocol):
    """All an actor may ask of the runtime: the requests of its run, a read-only view of
    it, the watchdog's timers, and the args the gate validated. The supervisor is one;
    nothing else of it (its run table, a handle's internals) is the actor's to touch."""

    def traceparent(self, run_id: str) -> str:
        """The W3C ``traceparent`` of the run's span here, '' with tracing off: what the
        provider's requests for the run carry."""
        ...

    async def request(self, msg: Request) -> Verdict:
        """Decide ``msg`` and return its verdict once its events are durable."""
        ...

    async def propose(self, msg: Propose, *, lagging: bool = False) -> Verdict:
        """Decide the run's proposal and return its verdict: at once where acting on it
        before its events are durable is harmless (it moves the run on and the run stays
        running, it is rejected, or it calls a read-only tool), else once they are
        durable (a run end, an escalation, a call of any other tool: its intent is
        durable before it runs). The events are written before any later verdict of the
        run is sent. ``lagging``: the previous verdict was a move or a rejection, whose
        events may still wait for a flush; this proposal's are written now."""
        ...

    def submit_nowait(self, msg: Request) -> Verdict:
        """Decide ``msg`` now; its events are written before any later verdict is sent."""
        ...

    def view(self, run_id: str) -> RunView:
        """The read-only view of the live run ``run_id``."""
        ...

    def arm_deadline(self, driver: Driver) -> None:
        """Have the watchdog tell ``driver`` when its run's deadline passes."""
        ...

    def arm_timeout(self, driver: Driver, seconds: float) -> int:
        """Have the watchdog cut ``driver``'s call in flight after ``seconds``."""
        ...

    def call_args(self, run_id: str, call: ToolCall) -> Any:
        """The args to run ``call`` with: as the gate validated them, if it did."""
        ...

    def lease_guard(self, run_id: str) -> LeaseGuard | None:
        """The guard of the run's lease, if it is leased (PostgreSQL), else None."""
        ...


class LeaseGuard(Protocol):
    """What keeps a leased run's side effects under its lease (see _leasing.Leases)."""

    async def confirm(self, run_id: str, *, lapsed_only: bool = False) -> None:
        """Raise LeaseLost unless the lease is still held (renewing it)."""
        ...

    def open_scope(self, run_id: str) -> trio.CancelScope:
        """A scope cancelled when the lease is no longer surely held."""
        ...

    def close_scope(self, run_id: str, scope: trio.CancelScope) -> None: ...

    def epoch(self, run_id: str) -> int:
        """The run's lease epoch (0 once it is not held)."""
        ...


class Driver:
    """What the actor of one run does right now, as far as the watchdog needs to know:
    the cancel scope the run lives in, and what a timeout would cut.

    The watchdog fires its entries here (:meth:`fire`); ``cancel_run`` calls
    :meth:`cancel`. Owned by the run's actor, never by the run's handle.
    """

    __slots__ = (
        "asked",
        "cancelled",
        "deadline_passed",
        "deadline_token",
        "done",
        "draining",
        "in_provider",
        "model",
        "run_id",
        "scope",
        "tool_cut",
        "tool_token",
    )

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.scope = trio.CancelScope()
        """The scope the run's actor runs in (see run_actor)."""
        self.done = False
        """The actor has stopped: the watchdog's entries for it are void."""
        self.draining = False
        """Stop at the next step boundary, before asking the model again (a drain)."""
        self.cancelled = False
        """cancel_run cancelled the scope (not the deadline)."""
        self.deadline_passed = False
        """The run's deadline has passed (set by the watchdog)."""
        self.deadline_token = 0
        """The watchdog's token of the run's deadline (negative); 0 before it is armed."""
        self.in_provider = False
        """The actor is waiting for the model: the watchdog may cut the wait."""
        self.model = ""
        self.asked = 0.0
        """The model asked last, and when (perf_counter), for a call the deadline cuts."""
        self.tool_token = 0
        """The watchdog's token of the call in flight; 0 when none is."""
        self.tool_cut = 0
        """The token of the latest call the watchdog cut at its timeout."""

    def fire(self, token: int) -> None:
        """The watchdog's entry ``token`` is due: act on it if it is still this driver's."""
        if not armed_for(self, token):
            return
        if token > 0:  # the call's timeout: cut the call
            self.tool_cut = token
            self.scope.cancel()
        else:  # the run's deadline: cut the wait for the model, if that is what runs
            self.deadline_passed = True
            if self.in_provider:
                self.scope.cancel()

    def cancel(self) -> None:
        """Stop the actor (cancel_run): a call in flight is cancelled."""
        self.cancelled = True
        self.scope.cancel()


async def run_actor(
    port: ActorPort, driver: Driver, verdict: Verdict, provider: Provider | None
) -> None:
    """Drive one run from ``verdict`` until it is terminal or escalated, or cancelled.

    The run lives in one cancel scope, ``driver.scope``, not one per model call and
    one per tool attempt: entering a trio scope costs as much as the rest of a step's
    bookkeeping. Timeouts are kept by the watchdog (one heap entry each), which cancels
    the run's scope only while the actor waits for what timed out: the model, past its
    call timeout or the run's deadline, or a tool attempt, past the tool's timeout. The
    actor then carries what it was doing out of the cancelled scope and goes on in a
    fresh one. So a tool call is never cut by the run's deadline, only by its own
    timeout or by cancel_run.

    Whatever a provider or a tool does (returns garbage, raises anything, opens a
    nursery that fails, raises GeneratorExit, or a trio.Cancelled while nothing is
    cancelled) ends up journaled for this run alone. Only a cancellation (cancel_run, a
    timeout, the supervisor's scope), KeyboardInterrupt and SystemExit leave the task as
    they are: the last two end the supervisor, every run in it and, unless the caller
    of ``open_supervisor`` catches them, the process, as they would end any program.

    Raises:
      InterlockError: the runtime refused a request of the run (a store error, a run
        an operator ended meanwhile); whoever started the actor settles the run's handle.
      Exception: a bug in interlock; the supervisor ends this run with an InternalError.
    """
    view = port.view(driver.run_id)
    port.arm_deadline(driver)
    carried: _Carried | None = None
    while True:
        scope = driver.scope
        # NOTE: the verdict goes to _drive, not kept here for the run's life: a fresh
        # scope after a cut goes on from what the cut carried, as a running run.
        drive = _drive(port, driver, view, verdict, provider, carried)
        verdict = _RUNNING
        try:
            with scope:
                await drive
        except _Cut as cut:
            carried = cut.carried
        else:
            if not scope.cancelled_caught:
                break  # the run is terminal or escalated
            # Cancelled, not cut: cancel_run, or the deadline cut the wait for the model.
            carried = None if driver.cancelled else _deadline_cut(driver, view)
        if driver.cancelled or carried is None:
            break
        driver.scope = trio.CancelScope()


async def _drive(
    port: ActorPort,
    driver: Driver,
    view: RunView,
    verdict: Verdict,
    provider: Provider | None,
    carried: _Carried | None,
) -> None:
    """The loop proper: from ``verdict`` (or what a cut carried) until the run stops running."""
    parent = port.traceparent(driver.run_id)
    if parent:  # tracing on: the provider's requests join the run's trace (this task only)
        TRACEPARENT.set(parent)
    durable = True
    lagging = False  # the run's latest verdict may have left its events unwritten
    proposal = carried if isinstance(carried, Propose) else None
    told = carried if isinstance(carried, Report | Reconciliation) else None
    attempts = carried if isinstance(carried, _Attempts) else None
    while proposal is not None or told is not None or verdict.outcome == "running":
        if proposal is None:
            if told is None and attempts is None:
                if verdict.execute is not None:
                    attempts = _Attempts(verdict.state, verdict.seq, verdict.execute)
                elif verdict.reconcile is not None:
                    told = await reconcile_call(port, driver, view, verdict)
            if attempts is not None:
                told = await execute_call(port, driver, view, attempts)
                attempts = None
            if told is not None:
                # NOTE: the commit need not be durable before the next model call:
                # the next verdict is sent only after a flush that holds it, and a
                # crash before then leaves the call in doubt, which recovery handles.
                verdict = port.submit_nowait(told)
                told = None
                durable = False
                continue
            if driver.draining:
                break  # a drain: the step in flight is done; the next one is not started
            if verdict.retry_in > 0:
                await _backoff(driver, verdict.retry_in)
            proposal = _ask(port, driver, view, provider)
            if proposal is None:  # ask the model (see _ask)
                assert provider is not None
                seq, token = view.seq, driver.tool_token  # a stale answer is refused
                try:
                    answer = await provider.propose(view)
                except BaseException as exc:
                    proposal = _unanswered(driver, view, seq, token, exc)
                    if proposal is None:
                        raise
                else:
                    proposal = _answered(driver, seq, answer)
                finally:
                    driver.in_provider = False
                    driver.tool_token = 0
        verdict = await port.propose(proposal, lagging=lagging)
        proposal = None
        lagging = verdict.execute is None and verdict.outcome == "running"
        # A verdict that ends or escalates the run is durable; one that keeps it running
        # may have been sent before its events were (see ActorPort.propose).
        durable = verdict.outcome != "running"
    if not durable:
        await port.request(Sync(run_id=driver.run_id))


async def _backoff(driver: Driver, seconds: float) -> None:
    """Wait before asking a provider that failed again; the run's deadline cuts the wait."""
    if driver.deadline_passed:
        return  # the next call is refused at once (see _ask)
    driver.in_provider = True
    try:
        await trio.sleep(seconds)
    finally:
        driver.in_provider = False


def _deadline_cut(driver: Driver, view: RunView) -> Propose:
    """The failed model call to journal when the run's deadline cut the wait for it."""
    return unanswered(
        view.run_id,
        view.seq,
        driver.model,
        f"no answer before the run's deadline of {view.definition.budgets.deadline:g} s",
        time.perf_counter() - driver.asked,
        retryable=False,
    )


def _text(value: Any) -> str:
    return value if type(value) is str else ""


def _ask(
    port: ActorPort, driver: Driver, view: RunView, provider: Provider | None
) -> Propose | None:
    """The proposal to make without asking the model (a step state's, or the failed call
    once the run's deadline has passed), or None: the model is to be asked now, its call
    armed with the watchdog (``driver.tool_token``) and ``driver.in_provider`` set.

    The model is awaited in :func:`_drive`'s own frame, not in a coroutine of its own: a
    run waiting for its model (100,000 of them may wait at once) holds one frame fewer.
    """
    run_id = driver.run_id
    machine = view.definition
    spec = machine.states[view.state]
    if isinstance(spec, Step):
        return step_proposal(run_id, view.seq, view.state, spec, view)
    assert provider is not None
    driver.model = _text(getattr(provider, "model", ""))
    driver.asked = time.perf_counter()
    if driver.deadline_passed:
        # Past the deadline the wait would be cut at once: do not start the call.
        return _deadline_cut(driver, view)
    driver.in_provider = True
    port.arm_timeout(driver, machine.provider_policy.timeout)
    return None


def _unanswered(
    driver: Driver, view: RunView, seq: int, token: int, exc: BaseException
) -> Propose | None:
    """The proposal for a model call that raised ``exc`` (``seq``: the state it answers,
    ``token``: its watchdog entry), or None for an exception to pass through.

    Raises:
      _Cut: the call's own timeout cut it (the actor leaves the cancelled scope with the
        failure).
    """
    timed_out = driver.tool_cut == token
    if _passes_through(exc) and not (timed_out and _cancelled(exc)):
        return None
    latency = time.perf_counter() - driver.asked
    if timed_out:
        timeout = view.definition.provider_policy.timeout
        error = f"the model call timed out after {timeout:g} s"
        raise _Cut(unanswered(driver.run_id, seq, driver.model, error, latency)) from None
    retryable, retry_after, refused = provider_failure(exc)
    return unanswered(
        driver.run_id,
        seq,
        driver.model,
        f"provider raised {_describe(exc, 'provider')}",
        latency,
        retryable=retryable,
        retry_after=retry_after,
        refused=refused,
    )


def _answered(driver: Driver, seq: int, answer: Any) -> Propose:
    """The proposal for what the model answered to the call that asked in state ``seq``.

    Raises:
      _Cut: the answer came as the scope was cancelled (the next checkpoint would raise).
    """
    message = answered(driver.run_id, seq, driver.model, answer, time.perf_counter() - driver.asked)
    if driver.scope.cancel_called:
        raise _Cut(message)
    return message


def _may_retry(tool: Tool, attempts: _Attempts) -> bool:
    """Whether the latest failed attempt may be tried again.

    NOTE: a tool that is not safe to repeat is retried only after a failure that says
    it was not applied: an attempt that may have reached the downstream is in doubt.
    """
    if not attempts.retryable or attempts.attempt >= tool.retry.attempts:
        return False
    return tool.safe_to_repeat or attempts.applied is False


async def execute_call(
    port: ActorPort, driver: Driver, view: RunView, attempts: _Attempts
) -> Report:
    """Run a verified call with its timeout and retry policy; return the report to journal.

    A tool that is safe to repeat (idempotent or read-only) is retried with the same key
    after a retryable failure. One that is not is retried only after a failure that says
    it was not applied; after any other failure (a timeout included) the report leaves
    the call in doubt, and the supervisor reconciles or escalates it.

    Raises:
      _Cut: the watchdog cut an attempt at the tool's timeout (``attempts`` says how far
        the call got; the actor goes on from there in a fresh scope), or an attempt
        finished just as it was cut (the report is carried out).
    """
    run_id = driver.run_id
    call = attempts.call
    tool: Tool = view.definition.tool_by_name[call.tool]
    args = port.call_args(run_id, call)
    policy = tool.retry
    guard = port.lease_guard(run_id)
    while True:
        if attempts.attempt:  # the latest attempt failed: retry it, or report the failure
            if not _may_retry(tool, attempts):
                break
            if attempts.rng is None:  # jitter that replays the same for the same key
                attempts.rng = random.Random(call.key)
            await trio.sleep(policy.delay(attempts.attempt, attempts.retry_after, attempts.rng))
        attempts.attempt += 1
        attempts.retry_after = None
        ctx = ToolContext(
            run_id=run_id,
            state=attempts.state,
            key=call.key,
            attempt=attempts.attempt,
            epoch=0 if guard is None else guard.epoch(run_id),
        )
        token = port.arm_timeout(driver, tool.timeout)
        lapsed = False
        try:
            if guard is None:
                result = await tool.execute(args, ctx)
            else:
                result, lapsed = await _under_lease(guard, run_id, tool, args, ctx)
        except BaseException as exc:
            timed_out = driver.tool_cut == token  # its timeout, not cancel_run or a shutdown
            if _passes_through(exc) and not (timed_out and _cancelled(exc)):
                raise
            if timed_out:  # cut, or the tool turned the cut into an error of its own
                attempts.error = f"timed out after {tool.timeout:g} s"
                attempts.retryable = True
                attempts.applied = None
                raise _Cut(attempts) from None
            attempts.retryable, attempts.retry_after, attempts.applied = tool_failure(exc, tool)
            attempts.error = _describe(exc, "tool")
            continue
        finally:
            driver.tool_token = 0
        if lapsed:
            assert guard is not None
            await guard.confirm(run_id)  # LeaseLost: another process took the run
            attempts.error = f"{LEASE_CUT} (it stalled), so the attempt was stopped"
            attempts.retryable = True
            attempts.applied = None
            continue
        report = returned(
            run_id,
            attempts.seq,
            call.key,
            call.tool,
            result,
            attempts.attempt,
            time.perf_counter() - attempts.started,
        )
        if driver.tool_cut == token:  # it finished as it was cut: leave the scope first
            raise _Cut(report)
        return report
    return _failure(run_id, attempts)


async def _under_lease(
    guard: LeaseGuard, run_id: str, tool: Tool, args: Any, ctx: ToolContext
) -> tuple[Any, bool]:
    """One attempt of a leased run's call, only while its lease is surely held: a process
    that stalled past that (a pause, a partition) confirms the lease before it starts a
    side effect, and one in flight is cut when the lease lapses. Returns the result, and
    whether the attempt was cut so."""
    await guard.confirm(run_id, lapsed_only=True)
    scope = guard.open_scope(run_id)
    try:
        with scope:
            return await tool.execute(args, ctx), False
    finally:
        guard.close_scope(run_id, scope)
    return None, True  # the scope caught its own cancellation: the lease lapsed


def _failure(run_id: str, attempts: _Attempts) -> Report:
    return failed(
        run_id,
        attempts.seq,
        attempts.call.key,
        attempts.error,
        retryable=attempts.retryable,
        applied=attempts.applied,
        attempts=attempts.attempt,
        latency=time.perf_counter() - attempts.started,
    )


async def reconcile_call(
    port: ActorPort, driver: Driver, view: RunView, verdict: Verdict
) -> Reconciliation:
    """Ask the downstream of a call in doubt whether its key was applied.

    The tool's ``reconcile`` runs under the tool's timeout. Whatever it does, the answer
    is a :class:`Reconciliation`: applied (with the result it reported), not applied, or
    unknown (it raised, timed out, or returned something else), with the reason.

    Raises:
      _Cut: the watchdog cut reconcile at the tool's timeout, or it finished as it was cut.
    """
    call = verdict.reconcile
    assert call is not None
    run_id = driver.run_id
    tool: Tool = view.definition.tool_by_name[call.tool]
    assert tool.reconcile is not None
    started = time.perf_counter()

    def answer(applied: bool | None, result: Any = None, error: str = "") -> Reconciliation:
        latency = time.perf_counter() - started
        return reconciled(run_id, verdict.seq, call.key, applied, latency, result, error)

    token = port.arm_timeout(driver, tool.timeout)
    try:
        args = tool.validator.from_builtins(call.args)
        guard = port.lease_guard(run_id)
        ctx = ToolContext(
            run_id=run_id,
            state=verdict.state,
            key=call.key,
            attempt=0,
            epoch=0 if guard is None else guard.epoch(run_id),
        )
        found = await tool.reconcile(call.key, args, ctx)
    except BaseException as exc:
        timed_out = driver.tool_cut == token
        if _passes_through(exc) and not (timed_out and _cancelled(exc)):
            raise
        if timed_out:
            raise _Cut(
                answer(None, error=f"reconcile timed out after {tool.timeout:g} s")
            ) from None
        return answer(None, error=f"reconcile raised {_describe(exc, 'tool')}")
    finally:
        driver.tool_token = 0
    message = answer(*reconcile_found(found))
    if driver.tool_cut == token:  # it finished as it was cut: leave the scope first
        raise _Cut(message)
    return message
