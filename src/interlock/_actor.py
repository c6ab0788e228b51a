"""The per-run loop: observe -> propose -> await the verdict -> execute -> report -> repeat."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

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


class _Answered(Exception):  # a signal inside the actor, never raised out of it
    """The model answered as the run's deadline passed: submit the answer in a fresh scope."""

    def __init__(self, proposal: Propose) -> None:
        self.proposal = proposal


async def run_actor(
    supervisor: Supervisor, handle: RunHandle, verdict: Verdict, provider: Provider | None
) -> None:
    """Drive one run until it is terminal or escalated. Never raises for a tool's failure.

    The run lives in one cancel scope, ``handle._scope``, not one per model call: entering
    a trio scope costs as much as the rest of a step's bookkeeping. The run's deadline is
    kept by the supervisor's watchdog, which cancels that scope only while the actor
    waits for the model; then the actor journals the cut call as a failed one and goes on
    in a fresh scope. A tool call is never cut by the run's deadline, only by its own
    timeout (or cancel_run).
    """
    run_id = handle.run_id
    try:
        supervisor.arm_deadline(handle)
        carried: Propose | None = None
        while True:
            scope = handle._scope
            try:
                with scope:
                    await _drive(supervisor, handle, verdict, provider, carried)
            except _Answered as answered:
                carried = answered.proposal
            else:
                if not scope.cancelled_caught:
                    break  # the run is terminal or escalated
                # The scope was cancelled: by cancel_run, or the watchdog cut a model call.
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
    proposal: Propose | None,
) -> None:
    """The loop proper: from ``verdict`` (or first ``proposal``) until the run stops running."""
    run_id = handle.run_id
    durable = True
    while proposal is not None or verdict.outcome == "running":
        if proposal is None:
            if verdict.execute is not None:
                report = await execute_call(
                    supervisor, run_id, verdict.state, verdict.seq, verdict.execute
                )
                # NOTE: the commit need not be durable before the next model call:
                # the next verdict is sent only after a flush that holds it, and a
                # crash before then leaves the call in doubt, which recovery handles.
                verdict = supervisor.submit_nowait(report)
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
    if handle._deadline_passed:
        # Past the deadline the wait would be cut at once: do not start the call.
        handle._model, handle._asked = model, started
        return _deadline_cut(supervisor, handle)
    handle._in_provider = True
    handle._model, handle._asked = model, started
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
        raise _Answered(answer)
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


async def execute_call(
    supervisor: Supervisor, run_id: str, state: str, seq: int, call: ToolCall
) -> Report:
    """Run a verified call with its timeout and retry policy; return the report to journal."""
    run = supervisor.runs[run_id]
    tool: Tool = run.machine.tool_by_name[call.tool]
    args: Any = tool.validator.from_builtins(call.args)
    policy = tool.retry
    rng: random.Random | None = None
    started = time.perf_counter()
    error = ""
    retryable = False
    attempt = 0
    while attempt < policy.attempts:
        attempt += 1
        ctx = ToolContext(run_id=run_id, state=state, key=call.key, attempt=attempt)
        retry_after: float | None = None
        try:
            # What trio.fail_after does, without its generator context manager per call.
            with trio.CancelScope(relative_deadline=tool.timeout) as timer:
                result = await tool.execute(args, ctx)
            if timer.cancelled_caught:
                raise trio.TooSlowError
            try:
                payload = msgspec.to_builtins(result)
            except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:
                problem: str | None = str(exc) or type(exc).__name__
            else:
                # What the store will do with it: a result it cannot encode must fail
                # this call, not the batch (and every run in it).
                problem = unjournalable(payload)
            if problem is not None:
                error = f"tool {call.tool!r} returned a result that cannot be journaled: {problem}"
                retryable = False
                break
            return Report(
                run_id=run_id,
                seq=seq,
                key=call.key,
                ok=True,
                result=payload,
                attempts=attempt,
                latency=time.perf_counter() - started,
            )
        except trio.TooSlowError:
            error = f"timed out after {tool.timeout:g} s"
            retryable = True
        except Exception as exc:
            retryable, retry_after = _retry_after(exc)
            error = f"{type(exc).__name__}: {exc}"
        if not retryable or attempt >= policy.attempts:
            break
        if rng is None:
            rng = random.Random(call.key)  # jitter that replays the same for the same key
        await trio.sleep(policy.delay(attempt, retry_after, rng))
    return Report(
        run_id=run_id,
        seq=seq,
        key=call.key,
        ok=False,
        error=error,
        retryable=retryable,
        attempts=attempt,
        latency=time.perf_counter() - started,
    )
