"""The decider: given a run's state, a request, the time and the circuits, the events the
request makes and its verdict.

Pure: no trio, no I/O, no counters, no clock of its own. The supervisor calls it for
every request of a live run, replay calls it with recorded inputs, and the operator API
calls it on a copy of a run to try a payload before journaling anything. Each event is
folded into the run (``RunState.apply``) as it is made, so the run is the state the
journal will hold once the events are written; the caller writes them, and counts them
(``RuntimeStats.count``).
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from . import _breakers, _gate, _view
from ._breakers import Trip, check_budgets
from ._escalation import resume_targets
from ._events import (
    IN_DOUBT_AFTER_CRASH,
    BreakerTripped,
    Completed,
    Escalated,
    Event,
    Failed,
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
    Violation,
    describe_exception,
    hash_prompt_after,
    legacy_in_doubt_text,
    oversized_answer,
)
from ._exceptions import (
    IllegalResumeTarget,
    MalformedMessage,
    NotEscalated,
    OutOfTurn,
    RunEnded,
    RunExists,
    StaleSeq,
    UnknownState,
)
from ._gate import verify
from ._hotpath import common_affixes
from ._machine import ESCALATE, FAILED, Machine, Step, encode_action
from ._messages import (
    Abort,
    Cancel,
    Escalate,
    Propose,
    Reconciliation,
    Recover,
    Report,
    Request,
    Resume,
    Start,
    Sync,
    ToolCall,
    Verdict,
)
from ._view import DECIDE_IMPLEMENTATION, RunState, RunView, proposal_data

if TYPE_CHECKING:
    from ._machine import BreakerPolicy
    from ._tools import Tool

#: A model call journals its prompt as a delta against the run's previous one when the two
#: share at least this many characters; otherwise whole (a delta would save next to nothing).
_MIN_SHARED_PROMPT = 64

#: A transition whose data is at least this many bytes of proposal refers to the
#: proposal instead of holding a second copy (``Transitioned.delta_in_proposal``).
_DELTA_BY_REFERENCE = 1024

_SURROGATE = re.compile("[\ud800-\udfff]")


class Circuits(Protocol):
    """The per-tool circuits a decision reads and updates (``CircuitBoard`` live; replay
    hands in the recording's refusals)."""

    def check(self, tool: str, now: float, policy: BreakerPolicy) -> tuple[Violation, Trip] | None:
        """The refusal of a call of ``tool`` now, if its circuit is open."""
        ...

    def record(
        self, tool: str, ok: bool, now: float, policy: BreakerPolicy, error: str = ""
    ) -> None:
        """Count a call's outcome."""
        ...


def readable_text(text: str, what: str) -> tuple[str, str]:
    """``text`` as the journal can hold it, and the defect that made it unreadable ('' if none).

    A lone surrogate (``json.loads`` of an HTTP body can produce one, and so does text
    decoded with ``surrogateescape`` from invalid UTF-8) cannot be encoded as UTF-8: such
    text is kept with each bad code point escaped (``\\udcff``), and the defect names the
    first one and where it is.
    """
    if text.isascii():  # O(1) for a str: CPython knows its widest character
        return text, ""
    bad = _SURROGATE.search(text)
    if bad is None:
        return text, ""
    at = bad.start()
    offset = len(text[:at].encode("utf-8", "surrogatepass"))
    code = ord(bad.group())
    kind = (
        f"the invalid UTF-8 byte 0x{code - 0xDC00:02X}, decoded with surrogateescape"
        if 0xDC80 <= code <= 0xDCFF
        else "a lone surrogate"
    )
    defect = (
        f"{what} holds U+{code:04X} at character {at} (byte offset {offset}): {kind}, "
        "which UTF-8 cannot encode"
    )
    return text.encode("utf-8", "backslashreplace").decode("utf-8"), defect


def _text(text: str) -> str:
    return text if text.isascii() else readable_text(text, "")[0]


def _shown(raw: str) -> str:
    """What the journal keeps of a proposal over the cap: a proposal of the same call
    whose arguments are their bounded excerpt, the one the model is sent back (so the
    conversation rebuilt from the journal is the one the model saw), or the excerpt of
    the whole text when it is no call."""
    # The providers' wire format (the excerpt the model sees), imported only here: a
    # proposal over the cap is rare, and the decide path imports nothing of providers.
    from ._wire import TRANSITION, excerpt, parse_raw, to_raw

    call = parse_raw(raw, 0)
    if call is None or call[1] == TRANSITION:
        return excerpt(raw)
    return to_raw(call[1], excerpt(call[2]))[0]


def step_proposal(run_id: str, seq: int, state: str, step: Step, view: RunView) -> Propose:
    """What a step state proposes: its function's action, or the error it raised.

    The one place a step runs: the actor calls it live and replay calls it again, so a
    step that changed shows where its decisions differ.
    """
    try:
        raw = encode_action(step.fn(view)).decode()
    except _gate.INTERRUPTS:
        raise
    except BaseException as exc:  # the step's failure (see _gate.INTERRUPTS)
        error = f"step {state!r} raised {describe_exception(exc)}"
        return Propose(run_id=run_id, seq=seq, raw="", source="step", error=error)
    return Propose(run_id=run_id, seq=seq, raw=raw, source="step")


# -- entry points -----------------------------------------------------------------------


def start(
    machine: Machine, msg: Start, now: float, events: list[Event]
) -> tuple[RunState, Verdict]:
    """A new run of ``machine``: its ``run_started`` event and the run it folds into."""
    run = RunState(msg.run_id, machine)
    _emit(
        run,
        events,
        RunStarted,
        now,
        machine=machine.name,
        state=machine.initial,
        inputs=msg.inputs,
        external=True if msg.external else msgspec.UNSET,
        trace=msg.trace or msgspec.UNSET,
    )
    return run, _verdict(run, True)


def decide(
    run: RunState, msg: Request, now: float, circuits: Circuits, events: list[Event]
) -> Verdict:
    """Decide ``msg`` for ``run`` at time ``now``: append its events to ``events`` (each
    already folded into ``run``) and return the verdict.

    Raises:
      StaleSeq, RunEnded, OutOfTurn, RunExists (each a ProtocolError): the request is
        stale, for a run that has ended, not what the run waits for, or a second start.
      NotEscalated, IllegalResumeTarget: an operator request the run cannot take.
    """
    kind = type(msg)  # the two requests of nearly every step first, by identity
    if kind is Report:
        return _report(run, msg, now, circuits, events)  # type: ignore[arg-type]
    if kind is Propose:
        return _propose(run, msg, now, circuits, events)  # type: ignore[arg-type]
    match msg:
        case Propose():
            return _propose(run, msg, now, circuits, events)
        case Report():
            return _report(run, msg, now, circuits, events)
        case Reconciliation():
            return _on_reconciliation(run, msg, now, events)
        case Recover():
            return _on_recover(run, now, events)
        case Sync():
            return _verdict(run, True)
        case Resume():
            return _on_resume(run, msg, now, circuits, events)
        case Abort():
            return _on_abort(run, msg, now, events)
        case Cancel():
            return _on_cancel(run, msg, now, events)
        case Escalate():
            return _on_escalate(run, msg, now, events)
        case Start():
            raise RunExists(f"run {msg.run_id!r} already exists; run ids must be unique")
        case _:
            raise MalformedMessage(f"unexpected message {type(msg).__name__}")


def escalated(run: RunState) -> RunState:
    """``run``, if it waits in the escalation queue.

    Raises:
      NotEscalated: it does not.
    """
    if run.state != ESCALATE or run.escalation is None:
        raise NotEscalated(run.run_id, run.machine.outcome(run.state), run.state)
    return run


def resume_target(run: RunState, to: str) -> str:
    """The state an escalated run resumes in; ``to`` must be one of its
    :func:`~interlock.core._escalation.resume_targets`.

    Raises:
      IllegalResumeTarget: ``to`` is not a legal target (the message lists the legal ones).
    """
    assert run.escalation is not None
    origin = run.escalation.state
    machine = run.machine
    if to and to not in machine.states and not machine.is_terminal(to):
        raise UnknownState(run.run_id, to, machine.name, list(machine.states), "cannot resume in")
    if not to or to == origin:
        if origin not in machine.states:
            raise UnknownState(
                run.run_id, origin, machine.name, list(machine.states), "escalated from"
            )
        return origin
    legal = resume_targets(machine, origin)
    if to not in legal:
        raise IllegalResumeTarget(run.run_id, to, origin, legal)
    return to


# -- building blocks ----------------------------------------------------------------------


def _emit(run: RunState, events: list[Event], cls: type[Event], now: float, **fields: Any) -> Event:
    event = cls(run_id=run.run_id, seq=run.seq + 1, ts=now, **fields)
    run.apply(event)
    events.append(event)
    return event


def _verdict(run: RunState, accepted: bool, **fields: Any) -> Verdict:
    return Verdict(
        run_id=run.run_id,
        seq=run.seq,
        accepted=accepted,
        state=run.state,
        outcome=run.machine.outcome(run.state),
        **fields,
    )


def _check_seq(run: RunState, msg: Propose | Report | Reconciliation | Escalate) -> None:
    if msg.seq and msg.seq != run.seq:
        raise StaleSeq(
            f"run {run.run_id!r} is at seq {run.seq}, the request was made at seq {msg.seq}; "
            "re-read the run and propose again"
        )
    if run.terminal:
        raise RunEnded(
            f"run {run.run_id!r} is {run.machine.outcome(run.state)} in state "
            f"{run.state!r}; it takes no more proposals"
        )


def _is_fallback(machine: Machine, state: str) -> bool:
    return machine.on_breaker == state and isinstance(machine.states.get(state), Step)


# -- proposals ----------------------------------------------------------------------------


def _on_propose(
    run: RunState, msg: Propose, now: float, circuits: Circuits, events: list[Event]
) -> Verdict:
    _check_seq(run, msg)
    if run.pending is not None:
        raise OutOfTurn(
            f"run {run.run_id!r} is waiting for the outcome of {run.pending.key!r}; report it first"
        )
    machine = run.machine
    state = run.state
    if msg.source == "model" and msg.error and not msg.legacy:
        return _on_provider_failure(run, msg, now, events)
    # Text the journal cannot hold (UTF-8 cannot encode a lone surrogate) is kept
    # escaped, and the proposal is rejected naming where the bad code point was.
    raw, defect = msg.raw, msg.defect
    if not raw.isascii():  # isascii is O(1); only other text can hold a surrogate
        raw, bad = readable_text(raw, "the proposal")
        defect = defect or bad
    oversized = msg.oversized
    response = None if msg.response is None else _text(msg.response)
    if msg.source == "model" and oversized is None and not msg.error:
        size = len(raw) if raw.isascii() else len(raw.encode())
        if size > _gate.proposal_cap(machine, state):
            # NOTE: refused unread, so journaled once and bounded: an excerpt (what goes
            # back to the model), the size and the hash; never the answer again and
            # again (the proposal, the response body that holds it, ...).
            shown = _shown(raw)
            response, oversized = oversized_answer(raw, shown, response)
            raw = shown
    if msg.source == "model":
        prompt, model = msg.prompt, msg.model
        if not prompt.isascii():
            prompt = readable_text(prompt, "the prompt")[0]
        if not model.isascii():
            model = readable_text(model, "the model name")[0]
        base = prefix = suffix = 0
        text = prompt
        shared, tail = 0, len(prompt)
        if run.prompt_seq:
            prefix, suffix = common_affixes(run.prompt, prompt)
            shared, tail = prefix, len(prompt) - suffix
            if prefix + suffix >= _MIN_SHARED_PROMPT:
                base = run.prompt_seq
                text = prompt[prefix : len(prompt) - suffix]
            else:
                prefix = suffix = 0
        prompt_hash, hash_state = hash_prompt_after(
            run._hash_state, run.prompt, prompt, shared, tail
        )
        called = ModelCalled(
            run_id=run.run_id,
            seq=run.seq + 1,
            ts=now,
            state=state,
            model=model,
            prompt_hash=prompt_hash,
            prompt=text,
            raw=raw,
            usage=msg.usage,
            latency=msg.latency,
            error=msg.error if msg.error.isascii() else readable_text(msg.error, "")[0],
            defect=defect or msgspec.UNSET,
            prompt_base=base,
            prompt_prefix=prefix,
            prompt_suffix=suffix,
            response=msgspec.UNSET if response is None else response,
            envelope=msgspec.UNSET if msg.envelope is None else msg.envelope,
            extra_calls=tuple(msg.extra_calls) if msg.extra_calls else msgspec.UNSET,
            oversized=msgspec.UNSET if oversized is None else oversized,
        )
        # The provider's string, not a rebuilt copy of it: nothing to splice, one copy kept.
        run.apply(called, 0, prompt)
        events.append(called)
        run._hash_state = hash_state  # the state of run.prompt, which is now this prompt
    else:
        _emit(
            run,
            events,
            StepProposed,
            now,
            state=state,
            raw=raw,
            source=msg.source,
            error=readable_text(msg.error, "the error")[0],
        )
    if msg.error:  # a step that raised (or a legacy model call that failed)
        budget = check_budgets(run, machine.budgets, now)
        if budget is not None:
            return _reject(run, events, now, (budget[0],), budget[1])
        violation = Violation(
            "malformed",
            "$",
            f"no proposal: {msg.error}",
            "the proposer failed; it will be asked again",
        )
        return _reject(run, events, now, (violation,), None)
    if defect:
        violation = Violation(
            "malformed",
            "$",
            f"proposal cannot be read: {defect}",
            "send the proposal as UTF-8 JSON text with no lone surrogates or invalid bytes",
        )
        return _reject(run, events, now, (violation,), None)
    if msg.envelope is not None:  # the provider found no proposal in the response
        return _reject(run, events, now, (msg.envelope,), None)
    if oversized is not None:  # the answer is journaled as an excerpt: not read
        decision = _gate.verify_unread(machine, run, oversized.raw_bytes, now)
    else:
        decision = verify(machine, run, raw.encode(), now, circuits)  # type: ignore[arg-type]
    if not decision.accepted:
        return _reject(run, events, now, decision.violations, decision.trip)
    if decision.tool is not None:
        key = f"{run.run_id}:{state}:{run.seq + 1}"
        intent = IntentRecorded(
            run_id=run.run_id,
            seq=run.seq + 1,
            ts=now,
            state=state,
            tool=decision.tool.name,
            args=decision.args,
            key=key,
            # A call that moves on when it succeeds (call_and_move): the verified move.
            next=decision.target or msgspec.UNSET,
            data=decision.data if decision.target and decision.data else msgspec.UNSET,
        )
        # The gate's hash, and the args as the guards saw them: the tool runs on those.
        run.apply(intent, decision.call_hash, validated=decision.value)
        events.append(intent)
        return _verdict(run, True, execute=ToolCall(decision.tool.name, decision.args, key))
    reason = (
        "fallback"
        if _is_fallback(machine, state)
        else ("step" if msg.source == "step" else "proposal")
    )
    if msg.source == "operator":
        reason = "operator"
    # NOTE: a large data object is journaled once, in the proposal: the transition
    # refers to it when it is exactly the proposal's data (a schema may add defaults).
    by_reference = (
        len(raw) >= _DELTA_BY_REFERENCE
        and bool(decision.data)
        and proposal_data(run.run_id, run.seq + 1, raw) == decision.data
    )
    _transition(run, events, now, decision.target, decision.data, reason, by_reference=by_reference)
    return _verdict(run, True)


def _on_provider_failure(run: RunState, msg: Propose, now: float, events: list[Event]) -> Verdict:
    """A model call that got no answer: journal it, then ask again later or give up.

    Never a rejection: the model made no mistake. The wait follows the machine's
    provider policy, with jitter drawn from the run id and seq, so replay decides it
    again exactly.
    """
    machine = run.machine
    policy = machine.provider_policy
    attempt = run.provider_failures + 1
    elapsed = now - run.provider_failures_since if run.provider_failures else 0.0
    model = readable_text(msg.model, "the model name")[0]
    error = readable_text(msg.error, "the error")[0]
    budget = check_budgets(run, machine.budgets, now)
    retry_in: float | None = None
    refused = msg.refused
    if budget is None and msg.retryable and not refused and attempt < policy.attempts:
        wait = policy.delay(attempt, msg.retry_after, random.Random(f"{run.run_id}:{run.seq + 1}"))
        if elapsed + wait <= policy.max_elapsed:
            retry_in = round(wait, 6)
    _emit(
        run,
        events,
        ProviderFailed,
        now,
        state=run.state,
        model=model,
        error=error,
        attempt=attempt,
        retryable=msg.retryable,
        retry_after=msg.retry_after,
        retry_in=retry_in,
        latency=msg.latency,
        # NOTE: unset unless refused, so every other provider_failed encodes as before
        **({"refused": True} if refused else {}),
    )
    if budget is not None:
        _trip(run, events, now, budget[1])
        return _verdict(run, False, violations=(budget[0],))
    if retry_in is not None:
        return _verdict(run, False, retry_in=retry_in)
    if refused:
        # The same request would be refused again: the fix is the request's shape (a
        # profile flag), not the server's health. Say so, not provider_unavailable.
        detail = (
            f"the server refused the request for model {model!r} in state {run.state!r}, "
            f"which retrying cannot fix: {error}. Fix the provider's request shape (its "
            "profile), then resume the run"
        )
        _transition(
            run, events, now, ESCALATE, {}, "provider", escalation=("request_refused", detail)
        )
        return _verdict(run, False)
    if not msg.retryable:
        why = "the provider says retrying cannot help"
    elif attempt >= policy.attempts:
        why = f"{attempt} calls in a row failed (provider_policy.attempts={policy.attempts})"
    else:
        why = (
            f"retrying would go past {policy.max_elapsed:g} s since the first failure "
            "(provider_policy.max_elapsed)"
        )
    detail = (
        f"model {model!r} did not answer in state {run.state!r}: {why}; last error: {error}. "
        "Check the provider, then resume the run"
    )
    _transition(
        run, events, now, ESCALATE, {}, "provider", escalation=("provider_unavailable", detail)
    )
    return _verdict(run, False)


def _reject(
    run: RunState,
    events: list[Event],
    now: float,
    violations: tuple[Violation, ...],
    trip: Trip | None,
) -> Verdict:
    _emit(run, events, ProposalRejected, now, state=run.state, violations=violations)
    if trip is None and run.consecutive_failures >= run.machine.breakers.consecutive_failures:
        trip = _consecutive_trip(run)
    if trip is not None:
        _trip(run, events, now, trip)
    return _verdict(run, False, violations=violations)


def _consecutive_trip(run: RunState) -> Trip:
    limit = run.machine.breakers.consecutive_failures
    last = run.history[-1].text if run.history else ""
    return Trip(
        _breakers.CONSECUTIVE_FAILURES,
        run.consecutive_failures,
        limit,
        f"{run.consecutive_failures} consecutive failures in state {run.state!r} "
        f"(limit {limit}); last: {last}",
    )


def _trip(run: RunState, events: list[Event], now: float, trip: Trip) -> None:
    machine = run.machine
    _emit(
        run,
        events,
        BreakerTripped,
        now,
        breaker=trip.breaker,
        state=run.state,
        value=float(trip.value),
        limit=float(trip.limit),
        detail=trip.detail,
        tool=trip.tool,
    )
    if machine.on_breaker == ESCALATE or run.state == machine.on_breaker:
        _transition(
            run, events, now, ESCALATE, {}, "breaker", escalation=(trip.breaker, trip.detail)
        )
    else:
        _transition(run, events, now, machine.on_breaker, {"breaker": trip.breaker}, "breaker")


def _transition(
    run: RunState,
    events: list[Event],
    now: float,
    dst: str,
    data: dict[str, Any],
    reason: str,
    escalation: tuple[str, str] | None = None,
    *,
    by_reference: bool = False,
) -> None:
    src = run.state
    if by_reference:
        _emit(
            run,
            events,
            Transitioned,
            now,
            src=src,
            dst=dst,
            reason=reason,
            delta_in_proposal=True,
        )
    else:
        _emit(run, events, Transitioned, now, src=src, dst=dst, delta=data, reason=reason)
    if run.terminal:
        _close(run, events, now, reason, src, data, escalation, by_reference)


def _close(
    run: RunState,
    events: list[Event],
    now: float,
    reason: str,
    src: str = "",
    data: dict[str, Any] | None = None,
    escalation: tuple[str, str] | None = None,
    by_reference: bool = False,
) -> None:
    """Journal the terminal event of a run that has just entered a terminal state.

    ``by_reference``: ``data`` is the delta of the transition just journaled, which
    holds it by reference to its proposal; the output then refers to that delta.
    """
    dst = run.state
    data = data if data is not None else dict(run.data)
    if dst in run.machine.success_states:
        if by_reference:
            _emit(run, events, Completed, now, state=dst, output_in_delta=True)
        else:
            _emit(run, events, Completed, now, state=dst, output=data or None)
    elif dst == ESCALATE:
        why, detail = escalation or (
            f"{reason}_escalated",
            f"{reason} moved the run from {src} to ESCALATE",
        )
        _emit(run, events, Escalated, now, state=src or run.previous, reason=why, detail=detail)
    else:
        _emit(
            run,
            events,
            Failed,
            now,
            state=dst,
            reason=str(data.get("reason", f"{reason} moved the run to FAILED")),
        )


# -- tool calls -------------------------------------------------------------------------


def _on_report(
    run: RunState, msg: Report, now: float, circuits: Circuits, events: list[Event]
) -> Verdict:
    pending = run.pending
    if pending is None or pending.key != msg.key:
        # Not the call the run waits for: a duplicate report (a retried request) of a
        # committed call gets the recorded result; anything else is refused below.
        for done in reversed(run.results):
            if done.key == msg.key:
                return _verdict(run, True, result=done.result)
    _check_seq(run, msg)
    if pending is None or pending.key != msg.key:
        expected = pending.key if pending is not None else "no call"
        raise OutOfTurn(
            f"run {run.run_id!r} reported key {msg.key!r} but is waiting for {expected!r}"
        )
    machine = run.machine
    tool = machine.tool_by_name[pending.tool]
    circuits.record(tool.name, msg.ok, now, machine.breakers, msg.error)
    if msg.ok:
        return _commit(
            run,
            events,
            now,
            tool,
            msg.key,
            msg.result,
            attempts=msg.attempts,
            latency=msg.latency,
        )
    error = readable_text(msg.error, "the error")[0]
    if msg.applied is not False and not tool.safe_to_repeat:
        # An attempt may have reached the downstream: never run it again blindly.
        return _in_doubt(run, tool, events, now, error, msg.attempts, msg.latency)
    _emit(
        run,
        events,
        ToolFailed,
        now,
        tool=tool.name,
        key=msg.key,
        error=error,
        retryable=msg.retryable,
        attempts=msg.attempts,
        latency=msg.latency,
        # NOTE: not in doubt; said so only where the text alone would read as in doubt
        # (a journal from before the field marked it in the text: see ToolFailed).
        in_doubt=False if legacy_in_doubt_text(error) else msgspec.UNSET,
    )
    if run.consecutive_failures >= machine.breakers.consecutive_failures:
        _trip(run, events, now, _consecutive_trip(run))
    return _verdict(run, False)


def _commit(
    run: RunState,
    events: list[Event],
    now: float,
    tool: Tool,
    key: str,
    result: Any,
    **fields: Any,
) -> Verdict:
    """Journal the pending call's result (executed, or reported applied by reconcile), and
    the move its intent named, if any (call_and_move): in the same write, so the two are
    durable together and no model call comes between them."""
    intent = run.pending
    _emit(run, events, ToolCommitted, now, tool=tool.name, key=key, result=result, **fields)
    if intent is not None and intent.next is not msgspec.UNSET:
        data = intent.data if intent.data is not msgspec.UNSET else {}
        _transition(run, events, now, intent.next, data, "call")
    return _verdict(run, True)


def _in_doubt(
    run: RunState,
    tool: Tool,
    events: list[Event],
    now: float,
    error: str,
    attempts: int = 0,
    latency: float = 0.0,
    after_crash: bool = False,
) -> Verdict:
    """The pending call of ``tool`` (not safe to repeat) may or may not have been applied.

    A tool that can reconcile is asked (the verdict says so), up to its retry
    policy's attempts for one call; any other is escalated as in doubt.
    """
    pending = run.pending
    assert pending is not None
    if tool.reconcile is None or run.doubts >= tool.retry.attempts:
        if tool.reconcile is None:
            why = (
                "it is not idempotent and cannot reconcile (give the Tool reconcile= to "
                "ask its downstream whether the key was applied)"
            )
        else:
            why = f"it was still in doubt after {run.doubts} reconciliations"
        return _escalate_in_doubt(run, tool.name, events, now, error, why, "in_doubt")
    _emit(
        run,
        events,
        ToolInDoubt,
        now,
        tool=tool.name,
        key=pending.key,
        error=error,
        attempts=attempts,
        latency=latency,
        after_crash=after_crash,
    )
    return _verdict(run, False, reconcile=ToolCall(pending.tool, pending.args, pending.key))


def _escalate_in_doubt(
    run: RunState,
    tool: str,
    events: list[Event],
    now: float,
    error: str,
    why: str,
    reason: str,
) -> Verdict:
    pending = run.pending
    assert pending is not None
    detail = (
        f"tool {tool!r} with key {pending.key!r} may or may not have been applied "
        f"({error}), and {why}; check the downstream system, then resume or abort"
    )
    _emit(run, events, ToolFailed, now, tool=tool, key=pending.key, error=error, in_doubt=True)
    _transition(run, events, now, ESCALATE, {}, reason, escalation=("in_doubt_side_effect", detail))
    return _verdict(run, False)


def _on_reconciliation(
    run: RunState, msg: Reconciliation, now: float, events: list[Event]
) -> Verdict:
    _check_seq(run, msg)
    pending = run.pending
    if pending is None or pending.key != msg.key:
        expected = pending.key if pending is not None else "no call"
        raise OutOfTurn(
            f"run {run.run_id!r} reconciled key {msg.key!r} but is waiting for {expected!r}"
        )
    tool = run.machine.tool_by_name[pending.tool]
    error = readable_text(msg.error, "the error")[0]
    applied = msg.applied
    _emit(
        run,
        events,
        Reconciled,
        now,
        tool=tool.name,
        key=msg.key,
        applied=applied,
        error=error,
        latency=msg.latency,
    )
    if applied:
        return _commit(run, events, now, tool, msg.key, msg.result, attempts=0, reconciled=True)
    if applied is False:  # never applied: execute it once, with the same key
        return _verdict(run, True, execute=ToolCall(pending.tool, pending.args, pending.key))
    return _escalate_in_doubt(
        run, tool.name, events, now, "in doubt", f"its reconcile failed: {error}", "in_doubt"
    )


def _on_recover(run: RunState, now: float, events: list[Event]) -> Verdict:
    pending = run.pending
    if run.terminal and not run.closed:
        _close(run, events, now, "recovery")
        return _verdict(run, True)
    if pending is None or run.terminal:
        return _verdict(run, True)
    tool = run.machine.tool_by_name.get(pending.tool)
    if tool is not None and tool.safe_to_repeat:
        return _verdict(run, True, execute=ToolCall(pending.tool, pending.args, pending.key))
    if tool is not None and tool.reconcile is not None:
        return _in_doubt(run, tool, events, now, IN_DOUBT_AFTER_CRASH, after_crash=True)
    detail = (
        f"tool {pending.tool!r} with key {pending.key!r} may or may not have run before the "
        "crash, and it is not idempotent; check the downstream system, then resume or abort"
    )
    _emit(
        run,
        events,
        ToolFailed,
        now,
        tool=pending.tool,
        key=pending.key,
        error=IN_DOUBT_AFTER_CRASH,
        in_doubt=True,
    )
    _transition(
        run, events, now, ESCALATE, {}, "recovery", escalation=("in_doubt_side_effect", detail)
    )
    return _verdict(run, False)


# -- operators ----------------------------------------------------------------------------


def _on_cancel(run: RunState, msg: Cancel, now: float, events: list[Event]) -> Verdict:
    if not run.terminal:
        src = run.state
        _emit(run, events, Transitioned, now, src=src, dst=FAILED, reason="operator")
        _emit(run, events, Failed, now, state=FAILED, reason=msg.reason)
    return _verdict(run, True)


def _on_escalate(run: RunState, msg: Escalate, now: float, events: list[Event]) -> Verdict:
    if run.state == ESCALATE:  # escalated already (a repeat, or a breaker was first)
        return _verdict(run, False)
    _check_seq(run, msg)
    if run.pending is not None:
        raise OutOfTurn(
            f"run {run.run_id!r} has a call of {run.pending.tool!r} in flight (key "
            f"{run.pending.key!r}); report its outcome before escalating the run"
        )
    reason = readable_text(msg.reason, "the reason")[0] or "driver"
    detail = (
        readable_text(msg.detail, "the detail")[0] or f"the run's driver escalated it: {reason}"
    )
    _transition(run, events, now, ESCALATE, {}, "driver", escalation=(reason, detail))
    return _verdict(run, False)


def _on_resume(
    run: RunState, msg: Resume, now: float, circuits: Circuits, events: list[Event]
) -> Verdict:
    escalated(run)
    target = resume_target(run, msg.to)
    _emit(run, events, Resumed, now, by=msg.by, note=msg.note, to=target, payload=msg.payload)
    _emit(run, events, Transitioned, now, src=ESCALATE, dst=target, reason="operator")
    if not msg.payload:
        return _verdict(run, True)
    # One request, one clock reading: the payload is decided at the resume's time.
    return _on_propose(
        run,
        Propose(run_id=run.run_id, seq=run.seq, raw=msg.payload, source="operator"),
        now,
        circuits,
        events,
    )


def _on_abort(run: RunState, msg: Abort, now: float, events: list[Event]) -> Verdict:
    escalated(run)
    reason = f"aborted by {msg.by}" + (f": {msg.note}" if msg.note else "")
    _emit(run, events, Resumed, now, by=msg.by, note=msg.note, to=FAILED)
    _emit(
        run,
        events,
        Transitioned,
        now,
        src=ESCALATE,
        dst=FAILED,
        delta={"reason": reason},
        reason="operator",
    )
    _emit(run, events, Failed, now, state=FAILED, reason=reason)
    return _verdict(run, True)


# -- the implementation -------------------------------------------------------------------

# The decide path of a step: compiled (interlock.core._decide) where the run state is, else
# this module's own. The compiled path decides the ordinary proposal and success itself
# and hands everything else to _on_propose and _on_report, its pure-Python twins.
_propose = _on_propose
_report = _on_report
if DECIDE_IMPLEMENTATION == "compiled":
    from . import _decide

    # Everything the compiled path calls of the pure modules, named here once (see
    # ``_decide.Collaborators``): they import it, so it cannot import them.
    _decide.install(
        _decide.Collaborators(
            frame=_view.Frame,
            in_frame=_view.ToolResult._in_frame,
            violation_signature=_view.violation_signature,
            proposal_data=_view.proposal_data,
            call_hash=_view._call_hash,
            no_data=_view._NO_DATA,
            no_turns=_view._NO_TURNS,
            run_view=_view.RunView,
            canonical_encode=_view.canonical_encoder.encode,
            short_json=_view._SHORT,
            on_propose=_on_propose,
            on_report=_on_report,
            reject=_reject,
            transition=_transition,
            is_fallback=_is_fallback,
            close=_close,
            delta_by_reference=_DELTA_BY_REFERENCE,
            verify=_gate.verify,
            checked_call=_gate._checked_call,
            plan=_gate._plan,
            decision=_gate.Decision,
            envelope_decode=_gate._envelope_decoder.decode,
            envelope=_gate._Envelope,
            move_data=_gate._move_data,
            dict_decode=_gate._dict_decoder.decode,
            circuit_board=_breakers.CircuitBoard,
            ok=_gate.OK,
        )
    )
    _propose = _decide.on_propose
    _report = _decide.on_report

#: :func:`decide` for a proposal, the request of nearly every step: ``propose(run, msg,
#: now, circuits, events) -> Verdict``, the compiled path where it is built.
propose = _propose


__all__ = [
    "Circuits",
    "decide",
    "escalated",
    "propose",
    "readable_text",
    "resume_target",
    "start",
    "step_proposal",
]
