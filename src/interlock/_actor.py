"""The per-run loop: observe -> propose -> await the verdict -> execute -> report -> repeat."""

from __future__ import annotations

import email.utils
import random
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ._events import TokenUsage, describe_exception, unjournalable
from ._exceptions import InterlockError, InternalError, ProviderError
from ._machine import Step, encode_action
from ._messages import Propose, Reconciliation, Report, Sync, ToolCall, Verdict
from ._tools import Applied, NotApplied, ToolContext, ToolError
from ._view import RunView
from .providers._base import Proposal

if TYPE_CHECKING:
    from ._handle import RunHandle
    from ._supervisor import Supervisor
    from ._tools import Tool
    from .providers import Provider

_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504, 529})

#: What a run never contains: these end the task (trio's cancellation, Ctrl-C, exit).
_PASS_THROUGH = (trio.Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)


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


class _Cut(Exception):  # a signal inside the actor, never raised out of it
    """The watchdog cut the run's scope; go on with ``carried`` in a fresh scope."""

    def __init__(self, carried: _Carried) -> None:
        self.carried = carried


def _passes_through(exc: BaseException) -> bool:
    """Whether ``exc`` (or a leaf of it, for a group) must leave the run's task as it is."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(_PASS_THROUGH) is not None
    return isinstance(exc, _PASS_THROUGH)


def _cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(trio.Cancelled) is not None
    return isinstance(exc, trio.Cancelled)


async def run_actor(
    supervisor: Supervisor, handle: RunHandle, verdict: Verdict, provider: Provider | None
) -> None:
    """Drive one run until it is terminal or escalated. Never raises for a run's fault.

    The run lives in one cancel scope, ``handle._scope``, not one per model call and
    one per tool attempt: entering a trio scope costs as much as the rest of a step's
    bookkeeping. Timeouts are kept by the supervisor's watchdog (one heap entry each),
    which cancels the run's scope only while the actor waits for what timed out: the
    model, past its call timeout or the run's deadline, or a tool attempt, past the
    tool's timeout. The actor then carries what it was doing out of the cancelled scope
    and goes on in a fresh one. So a tool call is never cut by the run's deadline, only
    by its own timeout or by cancel_run.

    Whatever a provider or a tool does (returns garbage, raises anything, opens a
    nursery that fails) ends up journaled for this run alone; only trio's cancellation,
    KeyboardInterrupt and SystemExit leave the task. A bug in interlock itself ends this
    run with an :class:`InternalError` on its handle, never its neighbours.
    """
    run_id = handle.run_id
    try:
        supervisor.arm_deadline(handle)
        carried: _Carried | None = None
        while True:
            scope = handle._scope
            try:
                with scope:
                    await _drive(supervisor, handle, verdict, provider, carried)
            except _Cut as cut:
                carried = cut.carried
            else:
                if not scope.cancelled_caught:
                    break  # the run is terminal or escalated
                # Cancelled, not cut: cancel_run, or the deadline cut the wait for the model.
                carried = None if handle._cancelled else _deadline_cut(supervisor, handle)
            if handle._cancelled or carried is None:
                break
            handle._scope = trio.CancelScope()
        _finish(supervisor, handle, None)
    except InterlockError as exc:
        _finish(supervisor, handle, exc)
    except Exception as exc:
        error = InternalError(
            f"run {run_id!r} was stopped by a bug in interlock: {describe_exception(exc)}; "
            "its journal is intact, and `interlock resume` continues it"
        )
        error.__cause__ = exc
        supervisor.runs.pop(run_id, None)
        _finish(supervisor, handle, error)
    finally:
        if not handle.done:
            handle._finish(None, InterlockError(f"run {run_id!r} was cancelled before it finished"))


async def _drive(
    supervisor: Supervisor,
    handle: RunHandle,
    verdict: Verdict,
    provider: Provider | None,
    carried: _Carried | None,
) -> None:
    """The loop proper: from ``verdict`` (or what a cut carried) until the run stops running."""
    run_id = handle.run_id
    durable = True
    proposal = carried if isinstance(carried, Propose) else None
    told = carried if isinstance(carried, Report | Reconciliation) else None
    attempts = carried if isinstance(carried, _Attempts) else None
    while proposal is not None or told is not None or verdict.outcome == "running":
        if proposal is None:
            if told is None and attempts is None:
                if verdict.execute is not None:
                    attempts = _Attempts(verdict.state, verdict.seq, verdict.execute)
                elif verdict.reconcile is not None:
                    told = await reconcile_call(supervisor, handle, verdict)
            if attempts is not None:
                told = await execute_call(supervisor, handle, attempts)
                attempts = None
            if told is not None:
                # NOTE: the commit need not be durable before the next model call:
                # the next verdict is sent only after a flush that holds it, and a
                # crash before then leaves the call in doubt, which recovery handles.
                verdict = supervisor.submit_nowait(told)
                told = None
                durable = False
                continue
            if verdict.retry_in > 0:
                await _backoff(handle, verdict.retry_in)
            proposal = await _next_proposal(supervisor, handle, provider)
        verdict = await supervisor.request(proposal)
        proposal = None
        durable = True
    if not durable:
        await supervisor.request(Sync(run_id=run_id))


async def _backoff(handle: RunHandle, seconds: float) -> None:
    """Wait before asking a provider that failed again; the run's deadline cuts the wait."""
    if handle._deadline_passed:
        return  # the next call is refused at once (see _next_proposal)
    handle._in_provider = True
    try:
        await trio.sleep(seconds)
    finally:
        handle._in_provider = False


def _finish(supervisor: Supervisor, handle: RunHandle, error: Exception | None) -> None:
    # NOTE: an operator may end the run (cancel_run) while its actor waits; then the
    # actor's own request is refused, but the run did end, with a journaled result.
    run = supervisor.runs.get(handle.run_id)
    if run is not None and run.terminal and run.closed:
        handle._finish(supervisor.result_of(handle.run_id))
        supervisor.release(handle.run_id)
    elif error is not None:
        handle._finish(None, error)


def _deadline_cut(supervisor: Supervisor, handle: RunHandle) -> Propose:
    """The failed model call to journal when the run's deadline cut the wait for it."""
    run = supervisor.runs[handle.run_id]
    return Propose(
        run_id=run.run_id,
        seq=run.seq,
        raw="",
        model=handle._model,
        error=f"no answer before the run's deadline of {run.machine.budgets.deadline:g} s",
        retryable=False,
        latency=time.perf_counter() - handle._asked,
    )


def _text(value: Any) -> str:
    return value if type(value) is str else ""


def _answer(run_id: str, seq: int, model: str, answer: Any, latency: float) -> Propose:
    """The proposal message for what a provider returned, whatever it returned.

    A provider may return anything; only a :class:`Proposal` whose fields have their
    types is a proposal. Anything else is journaled as a defect of that answer, and
    the gate rejects it as ``malformed`` naming the type; the run goes on.
    """
    if not isinstance(answer, Proposal):
        return Propose(
            run_id=run_id,
            seq=seq,
            raw="",
            model=model,
            latency=latency,
            defect=f"the provider returned {type(answer).__name__}, not a Proposal",
        )
    raw, usage = answer.raw, answer.usage
    defect = ""
    if type(raw) is not str:
        defect = f"the provider's Proposal.raw is {type(raw).__name__}, not str"
        raw = ""
    if not (
        type(usage) is TokenUsage
        and type(usage.prompt) is int
        and type(usage.completion) is int
        and usage.prompt >= 0
        and usage.completion >= 0
    ):
        # the type, or the values of a TokenUsage: a foreign object's repr may raise
        shown = repr(usage) if type(usage) is TokenUsage else type(usage).__name__
        defect = defect or (
            f"the provider's Proposal.usage is {shown}, not a TokenUsage of two non-negative ints"
        )
        usage = TokenUsage()
    name, prompt = answer.model, answer.prompt
    return Propose(
        run_id=run_id,
        seq=seq,
        raw=raw,
        model=name if type(name) is str and name else model,
        prompt=prompt if type(prompt) is str else "",
        usage=usage,
        latency=latency,
        defect=defect,
    )


def _retry_after_header(headers: Any) -> float | None:
    """Seconds from a ``retry-after-ms`` or ``Retry-After`` header (seconds or an HTTP date)."""
    if headers is None:
        return None
    try:
        millis = headers.get("retry-after-ms")
        if millis is not None:
            return max(0.0, float(millis) / 1000)
        header = headers.get("retry-after")
        if header is None:
            return None
        try:
            return max(0.0, float(header))
        except ValueError:
            when = email.utils.parsedate_to_datetime(header)
            return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def _provider_failure(exc: BaseException) -> tuple[bool, float | None]:
    """Whether retrying a provider that raised ``exc`` can help, and its Retry-After."""
    if isinstance(exc, ProviderError):
        return exc.retryable, exc.retry_after
    status, after = _http_status(exc)
    if status is not None:
        return status in _RETRYABLE_STATUS or status >= 500, after
    return True, None  # anything else a provider raises: a failure to answer, retried


async def _next_proposal(
    supervisor: Supervisor, handle: RunHandle, provider: Provider | None
) -> Propose:
    run_id = handle.run_id
    run = supervisor.runs[run_id]
    spec = run.machine.states[run.state]
    view = RunView(run)
    if isinstance(spec, Step):
        try:
            raw = encode_action(spec.fn(view)).decode()
        except Exception as exc:
            error = f"step {run.state!r} raised {describe_exception(exc)}"
            return Propose(run_id=run_id, seq=run.seq, raw="", source="step", error=error)
        return Propose(run_id=run_id, seq=run.seq, raw=raw, source="step")
    assert provider is not None
    seq = run.seq  # the state this proposal answers; a stale one is refused
    model = _text(getattr(provider, "model", ""))
    started = time.perf_counter()
    handle._model, handle._asked = model, started
    if handle._deadline_passed:
        # Past the deadline the wait would be cut at once: do not start the call.
        return _deadline_cut(supervisor, handle)
    timeout = run.machine.provider_policy.timeout
    handle._in_provider = True
    token = supervisor.arm_timeout(handle, timeout)
    try:
        answer = await provider.propose(view)
    except BaseException as exc:
        timed_out = handle._tool_cut == token
        if _passes_through(exc) and not (timed_out and _cancelled(exc)):
            raise
        if timed_out:  # its call timeout: leave the cancelled scope with the failure
            raise _Cut(
                Propose(
                    run_id=run_id,
                    seq=seq,
                    raw="",
                    model=model,
                    error=f"the model call timed out after {timeout:g} s",
                    latency=time.perf_counter() - started,
                )
            ) from None
        retryable, retry_after = _provider_failure(exc)
        return Propose(
            run_id=run_id,
            seq=seq,
            raw="",
            model=model,
            error=f"provider raised {describe_exception(exc)}",
            retryable=retryable,
            retry_after=retry_after,
            latency=time.perf_counter() - started,
        )
    finally:
        handle._in_provider = False
        handle._tool_token = 0
    message = _answer(run_id, seq, model, answer, time.perf_counter() - started)
    if handle._scope.cancel_called:
        # The answer came as the scope was cancelled: the next checkpoint would raise.
        raise _Cut(message)
    return message


def _tool_failure(exc: BaseException, tool: Tool) -> tuple[bool, float | None, bool | None]:
    """Whether a failed attempt is worth retrying, its Retry-After, and whether it was applied."""
    if isinstance(exc, ToolError):
        return exc.retryable, exc.retry_after, exc.applied
    applied: bool | None = False if isinstance(exc, tool.not_applied) else None
    status, after = _http_status(exc)
    if status is not None:
        return status in _RETRYABLE_STATUS, after, applied
    return _transport_error(exc), None, applied


def _transport_error(exc: BaseException) -> bool:
    """A dropped or refused connection, or a timeout: worth retrying for a safe tool."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    httpx = sys.modules.get("httpx")  # only if the tool uses it: never imported for this
    return httpx is not None and isinstance(exc, httpx.TransportError)


def _may_retry(tool: Tool, attempts: _Attempts) -> bool:
    """Whether the latest failed attempt may be tried again.

    NOTE: a tool that is not safe to repeat is retried only after a failure that says
    it was not applied: an attempt that may have reached the downstream is in doubt.
    """
    if not attempts.retryable or attempts.attempt >= tool.retry.attempts:
        return False
    return tool.safe_to_repeat or attempts.applied is False


async def execute_call(supervisor: Supervisor, handle: RunHandle, attempts: _Attempts) -> Report:
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
    run_id = handle.run_id
    run = supervisor.runs[run_id]
    call = attempts.call
    tool: Tool = run.machine.tool_by_name[call.tool]
    key, args = handle._validated
    handle._validated = ("", None)  # held only until the call runs: not for the run's life
    if key != call.key:  # not decided in this process (recovery): validate from the journal
        args = tool.validator.from_builtins(call.args)
    policy = tool.retry
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
            run_id=run_id, state=attempts.state, key=call.key, attempt=attempts.attempt
        )
        token = supervisor.arm_timeout(handle, tool.timeout)
        try:
            result = await tool.execute(args, ctx)
        except BaseException as exc:
            timed_out = handle._tool_cut == token  # its timeout, not cancel_run or a shutdown
            if _passes_through(exc) and not (timed_out and _cancelled(exc)):
                raise
            if timed_out:  # cut, or the tool turned the cut into an error of its own
                attempts.error = f"timed out after {tool.timeout:g} s"
                attempts.retryable = True
                attempts.applied = None
                raise _Cut(attempts) from None
            attempts.retryable, attempts.retry_after, attempts.applied = _tool_failure(exc, tool)
            attempts.error = describe_exception(exc)
            continue
        finally:
            handle._tool_token = 0
        payload, problem = _journalable(result)
        if problem is not None:
            attempts.error = (
                f"tool {call.tool!r} returned a result that cannot be journaled: {problem}"
            )
            attempts.retryable = False
            attempts.applied = True
            report = _failure(run_id, attempts)
        else:
            report = Report(
                run_id=run_id,
                seq=attempts.seq,
                key=call.key,
                ok=True,
                result=payload,
                attempts=attempts.attempt,
                latency=time.perf_counter() - attempts.started,
            )
        if handle._tool_cut == token:  # it finished as it was cut: leave the scope first
            raise _Cut(report)
        return report
    return _failure(run_id, attempts)


def _journalable(result: Any) -> tuple[Any, str | None]:
    """A tool's result as JSON builtins, or why the journal cannot hold it.

    NOTE: what the store will do with it: a result it cannot encode must fail this
    call, not the batch (and every run in it).
    """
    try:
        payload = msgspec.to_builtins(result)
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:
        return None, str(exc) or type(exc).__name__
    return payload, unjournalable(payload)


def _http_status(exc: BaseException) -> tuple[int | None, float | None]:
    """The HTTP status an exception carries (httpx's ``HTTPStatusError`` and the SDKs'
    errors hold a ``response``), and the Retry-After its headers give."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if not isinstance(status, int):
        return None, None
    return status, _retry_after_header(getattr(response, "headers", None))


def _failure(run_id: str, attempts: _Attempts) -> Report:
    return Report(
        run_id=run_id,
        seq=attempts.seq,
        key=attempts.call.key,
        ok=False,
        error=attempts.error,
        retryable=attempts.retryable,
        applied=attempts.applied,
        attempts=attempts.attempt,
        latency=time.perf_counter() - attempts.started,
    )


async def reconcile_call(
    supervisor: Supervisor, handle: RunHandle, verdict: Verdict
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
    run_id = handle.run_id
    tool: Tool = supervisor.runs[run_id].machine.tool_by_name[call.tool]
    assert tool.reconcile is not None
    started = time.perf_counter()

    def answer(applied: bool | None, result: Any = None, error: str = "") -> Reconciliation:
        return Reconciliation(
            run_id=run_id,
            seq=verdict.seq,
            key=call.key,
            applied=applied,
            result=result,
            error=error,
            latency=time.perf_counter() - started,
        )

    token = supervisor.arm_timeout(handle, tool.timeout)
    try:
        args = tool.validator.from_builtins(call.args)
        ctx = ToolContext(run_id=run_id, state=verdict.state, key=call.key, attempt=0)
        found = await tool.reconcile(call.key, args, ctx)
    except BaseException as exc:
        timed_out = handle._tool_cut == token
        if _passes_through(exc) and not (timed_out and _cancelled(exc)):
            raise
        if timed_out:
            raise _Cut(
                answer(None, error=f"reconcile timed out after {tool.timeout:g} s")
            ) from None
        return answer(None, error=f"reconcile raised {describe_exception(exc)}")
    finally:
        handle._tool_token = 0
    if found is NotApplied or isinstance(found, NotApplied):
        message = answer(False)
    elif isinstance(found, Applied):
        payload, problem = _journalable(found.result)
        if problem is None:
            message = answer(True, payload)
        else:
            message = answer(
                None, error=f"reconcile returned a result that cannot be journaled: {problem}"
            )
    else:
        message = answer(
            None,
            error=f"reconcile returned {type(found).__name__}, not Applied(result) or NotApplied",
        )
    if handle._tool_cut == token:  # it finished as it was cut: leave the scope first
        raise _Cut(message)
    return message
