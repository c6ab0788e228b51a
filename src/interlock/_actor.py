"""The per-run loop: observe -> propose -> await the verdict -> execute -> report -> repeat."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import msgspec
import trio

from ._events import unjournalable
from ._exceptions import InterlockError
from ._machine import Step, encode_action
from ._messages import Propose, Report, Sync, ToolCall, Verdict
from ._tools import RetryableToolError, ToolContext
from ._view import RunView

if TYPE_CHECKING:
    from ._supervisor import RunHandle, Supervisor
    from ._tools import Tool
    from .providers import Provider

_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class _Attempts:
    """A verified call's attempts so far. It outlives a cut (see execute_call)."""

    __slots__ = (
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
        self.rng: random.Random | None = None


#: What a cut carries out of the run's cancelled scope: the model's answer, a call's
#: attempts so far (its latest one timed out), or a call's finished report.
_Carried = Propose | _Attempts | Report


class _Cut(Exception):  # a signal inside the actor, never raised out of it
    """The watchdog cut the run's scope; go on with ``carried`` in a fresh scope."""

    def __init__(self, carried: _Carried) -> None:
        self.carried = carried


async def run_actor(
    supervisor: Supervisor, handle: RunHandle, verdict: Verdict, provider: Provider | None
) -> None:
    """Drive one run until it is terminal or escalated. Never raises for a tool's failure.

    The run lives in one cancel scope, ``handle._scope``, not one per model call and
    one per tool attempt: entering a trio scope costs as much as the rest of a step's
    bookkeeping. Timeouts are kept by the supervisor's watchdog (one heap entry each),
    which cancels the run's scope only while the actor waits for what timed out: the
    model, past the run's deadline, or a tool attempt, past the tool's timeout. The
    actor then carries what it was doing out of the cancelled scope and goes on in a
    fresh one. So a tool call is never cut by the run's deadline, only by its own
    timeout or by cancel_run.
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
    report = carried if isinstance(carried, Report) else None
    attempts = carried if isinstance(carried, _Attempts) else None
    while proposal is not None or report is not None or verdict.outcome == "running":
        if proposal is None:
            if report is None and attempts is None and verdict.execute is not None:
                attempts = _Attempts(verdict.state, verdict.seq, verdict.execute)
            if attempts is not None:
                report = await execute_call(supervisor, handle, attempts)
                attempts = None
            if report is not None:
                # NOTE: the commit need not be durable before the next model call:
                # the next verdict is sent only after a flush that holds it, and a
                # crash before then leaves the call in doubt, which recovery handles.
                verdict = supervisor.submit_nowait(report)
                report = None
                durable = False
                continue
            proposal = await _next_proposal(supervisor, handle, provider)
        verdict = await supervisor.request(proposal)
        proposal = None
        durable = True
    if not durable:
        await supervisor.request(Sync(run_id=run_id))


def _finish(supervisor: Supervisor, handle: RunHandle, error: InterlockError | None) -> None:
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
        latency=time.perf_counter() - handle._asked,
    )


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
            error = f"step {run.state!r} raised {type(exc).__name__}: {exc}"
            return Propose(run_id=run_id, seq=run.seq, raw="", source="step", error=error)
        return Propose(run_id=run_id, seq=run.seq, raw=raw, source="step")
    assert provider is not None
    seq = run.seq  # the state this proposal answers; a stale one is refused
    model = getattr(provider, "model", "")
    started = time.perf_counter()
    handle._model, handle._asked = model, started
    if handle._deadline_passed:
        # Past the deadline the wait would be cut at once: do not start the call.
        return _deadline_cut(supervisor, handle)
    handle._in_provider = True
    try:
        proposal = await provider.propose(view)
    except Exception as exc:
        return Propose(
            run_id=run_id,
            seq=seq,
            raw="",
            model=model,
            error=f"provider raised {type(exc).__name__}: {exc}",
            latency=time.perf_counter() - started,
        )
    finally:
        handle._in_provider = False
    answer = Propose(
        run_id=run_id,
        seq=seq,
        raw=proposal.raw,
        model=proposal.model,
        prompt=proposal.prompt,
        usage=proposal.usage,
        latency=time.perf_counter() - started,
    )
    if handle._scope.cancel_called:
        # The answer came as the scope was cancelled: the next checkpoint would raise.
        raise _Cut(answer)
    return answer


def _retry_after(exc: BaseException) -> tuple[bool, float | None]:
    """Return whether ``exc`` is worth retrying, and the Retry-After it carries."""
    if isinstance(exc, RetryableToolError):
        return True, exc.retry_after
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        header = None
        headers = getattr(response, "headers", None)
        if headers is not None:
            header = headers.get("retry-after")
        try:
            after = float(header) if header is not None else None
        except ValueError:
            after = None
        return status in _RETRYABLE_STATUS, after
    return isinstance(exc, ConnectionError | TimeoutError), None


async def execute_call(supervisor: Supervisor, handle: RunHandle, attempts: _Attempts) -> Report:
    """Run a verified call with its timeout and retry policy; return the report to journal.

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
            if not attempts.retryable or attempts.attempt >= policy.attempts:
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
        except (trio.Cancelled, BaseExceptionGroup):
            if handle._tool_cut == token:  # its timeout, not cancel_run or a shutdown
                attempts.error = f"timed out after {tool.timeout:g} s"
                attempts.retryable = True
                raise _Cut(attempts) from None
            raise
        except Exception as exc:
            attempts.retryable, attempts.retry_after = _retry_after(exc)
            attempts.error = f"{type(exc).__name__}: {exc}"
            if handle._tool_cut == token:  # the tool turned the cut into an error
                raise _Cut(attempts) from None
            continue
        finally:
            handle._tool_token = 0
        try:
            payload = msgspec.to_builtins(result)
        except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:
            problem: str | None = str(exc) or type(exc).__name__
        else:
            # What the store will do with it: a result it cannot encode must fail
            # this call, not the batch (and every run in it).
            problem = unjournalable(payload)
        if problem is not None:
            attempts.error = (
                f"tool {call.tool!r} returned a result that cannot be journaled: {problem}"
            )
            attempts.retryable = False
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


def _failure(run_id: str, attempts: _Attempts) -> Report:
    return Report(
        run_id=run_id,
        seq=attempts.seq,
        key=attempts.call.key,
        ok=False,
        error=attempts.error,
        retryable=attempts.retryable,
        attempts=attempts.attempt,
        latency=time.perf_counter() - attempts.started,
    )
