"""The supervisor: owns the machines' tables and every run's state, verifies proposals,
group-commits the journal and replies only after the batch is durable."""

from __future__ import annotations

import gc
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from . import _breakers
from ._breakers import CircuitBoard, Trip, check_budgets
from ._events import (
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
    hash_prompt_after,
    unjournalable,
)
from ._exceptions import (
    IllegalResumeTarget,
    InterlockError,
    InternalError,
    InvalidInputs,
    NoProvider,
    NotEscalated,
    PayloadRejected,
    ProtocolError,
    RunNotFound,
    StoreError,
    UnknownMachine,
)
from ._gate import verify
from ._handle import RunHandle, RunResult
from ._hotpath import common_affixes
from ._journal import GroupCommit
from ._machine import ESCALATE, FAILED, Machine, Step, Worker
from ._messages import (
    Abort,
    Cancel,
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
from ._stats import RuntimeStats, SupervisorStatistics
from ._view import RunState, RunView, fold, proposal_data
from ._watchdog import Watchdog

if TYPE_CHECKING:
    from ._tools import Tool
    from .providers import Provider
    from .stores import Store

Clock = Callable[[], float]

#: Garbage-collector thresholds while a supervisor runs (see :func:`open_supervisor`).
#: A young-generation pass walks every live run task, and the loop allocates steadily:
#: fewer, larger passes (benchmarks/bench_concurrency.py measures the difference).
GC_THRESHOLD = (200_000, 20, 100)

#: A model call journals its prompt as a delta against the run's previous one when the two
#: share at least this many characters; otherwise whole (a delta would save next to nothing).
_MIN_SHARED_PROMPT = 64

#: How many released runs' results a supervisor keeps to answer late requests clearly.
ENDED_KEPT = 10_000

#: A transition whose data is at least this many bytes of proposal refers to the
#: proposal instead of holding a second copy (``Transitioned.delta_in_proposal``).
_DELTA_BY_REFERENCE = 1024

_SURROGATE = re.compile("[\ud800-\udfff]")


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


class Supervisor:
    """Owns every run's state and the journal writer. Make one with :func:`open_supervisor`.

    Requests from run actors (or the gateway) queue up; the supervisor takes all that
    arrived since its last turn as one batch, decides each, appends the batch's events
    to the store in one write, and only then wakes the senders.
    """

    def __init__(
        self,
        machines: Iterable[Machine],
        store: Store,
        *,
        provider: Provider | Mapping[str, Provider] | None = None,
        clock: Clock = time.time,
        max_batch: int = 8192,
        stats: RuntimeStats | None = None,
    ) -> None:
        self.machines: dict[str, Machine] = {}
        for machine in machines:
            if machine.name in self.machines:
                raise InterlockError(
                    f"two machines are named {machine.name!r}; names must be unique"
                )
            self.machines[machine.name] = machine
        self.store = store
        self.clock = clock
        self.stats = stats if stats is not None else RuntimeStats()
        self.circuits = CircuitBoard()
        self.runs: dict[str, RunState] = {}
        self.handles: dict[str, RunHandle] = {}
        self._journal = GroupCommit(
            store, self.stats, self._decide, self._contain, self._forget, max_batch
        )
        self._actors: trio.Nursery | None = None
        self._provider = provider
        self._next_id = 0
        self._watchdog = Watchdog(self.handles, lambda: len(self.runs))
        # Runs whose in-memory state was dropped because a batch holding their events
        # could not be written (see _forget): their later requests get that error.
        self._lost: dict[str, Exception] = {}
        # How the latest released runs ended, so a late request gets a clear answer; the
        # oldest are forgotten, so a process that runs millions of runs stays flat.
        self._ended: dict[str, RunResult] = {}

    def provider_for(self, machine: str) -> Provider | None:
        if isinstance(self._provider, Mapping):
            return self._provider.get(machine)
        return self._provider

    def machine(self, name: str) -> Machine:
        try:
            return self.machines[name]
        except KeyError:
            raise UnknownMachine(name, list(self.machines)) from None

    def view(self, run_id: str) -> RunView:
        """A read-only view of a live run.

        Raises:
          RunNotFound: the run is not live in this supervisor.
        """
        try:
            return RunView(self.runs[run_id])
        except KeyError:
            raise RunNotFound(run_id) from None

    def statistics(self) -> SupervisorStatistics:
        """A snapshot of the supervisor's counters."""
        return self.stats.snapshot(len(self.runs))

    # -- requests ---------------------------------------------------------------

    async def request(self, msg: Request) -> Verdict:
        """Submit one request and wait for its verdict (sent after the journal flush).

        Raises:
          ProtocolError: the request is out of order or names no live run.
          StoreError: the batch holding the request's events could not be written.
          trio.ClosedResourceError: the supervisor is shutting down.
        """
        return await self._journal.request(msg)

    def submit_nowait(self, msg: Request) -> Verdict:
        """Decide a request now, in the caller's task, without waiting for the journal.

        Its events are written with the next group commit, before any later verdict is
        sent; nothing is acknowledged as durable. The run actor uses this to report a
        tool's outcome and go on at once. Await :meth:`request` with a :class:`Sync` to
        wait until it is durable.

        Raises:
          ProtocolError: the request is out of order or names no live run.
          trio.ClosedResourceError: the supervisor is shutting down.
        """
        return self._journal.submit_nowait(msg)

    @property
    def max_batch(self) -> int:
        """The most requests decided per journal write."""
        return self._journal.max_batch

    # -- deadlines ----------------------------------------------------------------

    def arm_deadline(self, handle: RunHandle) -> None:
        """Have the watchdog tell ``handle`` when its run's deadline passes.

        One heap entry per run instead of a cancel scope per model call: the actor cuts
        only its wait for the model (see run_actor).
        """
        run = self.runs[handle.run_id]
        # The clock may be any clock; the watchdog sleeps on trio's. 1 ms of margin, so
        # the supervisor's own check (on self.clock) agrees that it passed.
        remaining = run.started_ts + run.machine.budgets.deadline - self.clock()
        self._watchdog.arm_deadline(handle, remaining + 1e-3)

    def arm_timeout(self, handle: RunHandle, seconds: float) -> int:
        """Have the watchdog cut ``handle``'s call in flight after ``seconds``; see
        :meth:`Watchdog.arm_timeout`."""
        return self._watchdog.arm_timeout(handle, seconds)

    def _forget(self, run_ids: set[str], error: StoreError) -> None:
        # NOTE: the in-memory state ran ahead of a batch that was never written; drop
        # it so nothing acts on decisions the journal does not hold. Recovery refolds.
        for run_id in run_ids:
            self.runs.pop(run_id, None)
            self._lost[run_id] = error
            if len(self._lost) > ENDED_KEPT:
                del self._lost[next(iter(self._lost))]

    def _contain(self, msg: Request, exc: Exception) -> InternalError:
        """A bug met while deciding ``msg``: it ends that run only, never the supervisor.

        The events decided for the request are dropped (the caller truncates the batch),
        and so is the run's in-memory state, which may hold half of them; the journal
        holds only what came before, and a resume refolds from there.
        """
        error = InternalError(
            f"run {msg.run_id!r} was stopped by a bug in interlock while deciding a "
            f"{type(msg).__name__} request: {type(exc).__name__}: {exc}; its journal is "
            "intact up to the previous batch, and `interlock resume` continues it"
        )
        error.__cause__ = exc
        self.runs.pop(msg.run_id, None)
        self._lost[msg.run_id] = error
        return error

    # -- deciding -----------------------------------------------------------------

    def _decide(self, msg: Request, events: list[Event]) -> Verdict:
        match msg:
            case Propose():
                return self._on_propose(msg, events)
            case Report():
                return self._on_report(msg, events)
            case Reconciliation():
                return self._on_reconciliation(msg, events)
            case Start():
                return self._on_start(msg, events)
            case Recover():
                return self._on_recover(msg, events)
            case Sync():
                return self._verdict(self._run(msg.run_id), True)
            case Resume():
                return self._on_resume(msg, events)
            case Abort():
                return self._on_abort(msg, events)
            case Cancel():
                return self._on_cancel(msg, events)
            case _:
                raise ProtocolError(f"unexpected message {type(msg).__name__}")

    def _run(self, run_id: str) -> RunState:
        run = self.runs.get(run_id)
        if run is None:
            lost = self._lost.get(run_id)
            if lost is not None:
                raise lost
            ended = self._ended.get(run_id)
            if ended is not None:
                raise ProtocolError(
                    f"run {run_id!r} is {ended.outcome} in state {ended.state!r}; "
                    "it takes no more proposals"
                )
            raise RunNotFound(run_id)
        return run

    def _emit(
        self, run: RunState, events: list[Event], cls: type[Event], now: float, **fields: Any
    ) -> Event:
        event = cls(run_id=run.run_id, seq=run.seq + 1, ts=now, **fields)
        run.apply(event)
        events.append(event)
        return event

    @staticmethod
    def _record(
        run: RunState,
        events: list[Event],
        event: Event,
        call_hash: int = 0,
        prompt: str | None = None,
    ) -> None:
        """Fold and queue ``event``, passing on what the caller already derived (see apply)."""
        run.apply(event, call_hash, prompt)
        events.append(event)

    def _verdict(self, run: RunState, accepted: bool, **fields: Any) -> Verdict:
        return Verdict(
            run_id=run.run_id,
            seq=run.seq,
            accepted=accepted,
            state=run.state,
            outcome=run.machine.outcome(run.state),
            **fields,
        )

    def _on_start(self, msg: Start, events: list[Event]) -> Verdict:
        machine = self.machine(msg.machine)
        if msg.run_id in self.runs:
            raise ProtocolError(f"run {msg.run_id!r} already exists; run ids must be unique")
        run = RunState(msg.run_id, machine)
        self.runs[msg.run_id] = run
        now = self.clock()
        self._emit(
            run,
            events,
            RunStarted,
            now,
            machine=machine.name,
            state=machine.initial,
            inputs=msg.inputs,
            external=True if msg.external else msgspec.UNSET,
        )
        self.stats.runs_started[machine.name] += 1
        return self._verdict(run, True)

    def _on_cancel(self, msg: Cancel, events: list[Event]) -> Verdict:
        ended = self._ended.get(msg.run_id)
        if msg.run_id not in self.runs and ended is not None:
            # already finished and released: nothing to cancel
            return Verdict(
                run_id=ended.run_id,
                seq=ended.seq,
                accepted=True,
                state=ended.state,
                outcome=ended.outcome,
            )
        run = self._run(msg.run_id)
        if not run.terminal:
            now = self.clock()
            src = run.state
            self._emit(run, events, Transitioned, now, src=src, dst=FAILED, reason="operator")
            self._emit(run, events, Failed, now, state=FAILED, reason=msg.reason)
            self._finished(run)
        return self._verdict(run, True)

    def _check_seq(self, run: RunState, msg: Propose | Report | Reconciliation) -> None:
        if msg.seq and msg.seq != run.seq:
            raise ProtocolError(
                f"run {run.run_id!r} is at seq {run.seq}, the request was made at seq {msg.seq}; "
                "re-read the run and propose again"
            )
        if run.terminal:
            raise ProtocolError(
                f"run {run.run_id!r} is {run.machine.outcome(run.state)} in state "
                f"{run.state!r}; it takes no more proposals"
            )

    def _on_propose(self, msg: Propose, events: list[Event], now: float | None = None) -> Verdict:
        """Decide a proposal. ``now``: the clock reading of the request it is part of (a
        resume with a payload): one request, one reading, so replay reproduces it."""
        run = self._run(msg.run_id)
        self._check_seq(run, msg)
        if run.pending is not None:
            raise ProtocolError(
                f"run {run.run_id!r} is waiting for the outcome of {run.pending.key!r}; report it first"
            )
        machine = run.machine
        now = self.clock() if now is None else now
        state = run.state
        if msg.source == "model" and msg.error and not msg.legacy:
            return self._on_provider_failure(run, msg, events, now)
        # Text the journal cannot hold (UTF-8 cannot encode a lone surrogate) is kept
        # escaped, and the proposal is rejected naming where the bad code point was.
        raw, defect = msg.raw, msg.defect
        if not raw.isascii():  # isascii is O(1); only other text can hold a surrogate
            raw, bad = readable_text(raw, "the proposal")
            defect = defect or bad
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
            )
            # The provider's string, not a rebuilt copy of it: nothing to splice, one copy kept.
            self._record(run, events, called, prompt=prompt)
            run._hash_state = hash_state  # the state of run.prompt, which is now this prompt
            tokens = self.stats.tokens
            tokens[(machine.name, state, model, "prompt")] += msg.usage.prompt
            tokens[(machine.name, state, model, "completion")] += msg.usage.completion
            self.stats.model_calls[(machine.name, model)] += 1
            self.stats.histogram(self.stats.model_latency, model).record(msg.latency)
        else:
            self._emit(
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
                return self._reject(run, events, now, (budget[0],), budget[1])
            violation = Violation(
                "malformed",
                "$",
                f"no proposal: {msg.error}",
                "the proposer failed; it will be asked again",
            )
            return self._reject(run, events, now, (violation,), None)
        if defect:
            violation = Violation(
                "malformed",
                "$",
                f"proposal cannot be read: {defect}",
                "send the proposal as UTF-8 JSON text with no lone surrogates or invalid bytes",
            )
            return self._reject(run, events, now, (violation,), None)
        started = time.perf_counter()
        decision = verify(machine, run, raw.encode(), now, self.circuits)
        self.stats.histogram(self.stats.verify_latency, machine.name).record(
            time.perf_counter() - started
        )
        if not decision.accepted:
            return self._reject(run, events, now, decision.violations, decision.trip)
        self.stats.verdicts[(machine.name, "accepted", "")] += 1
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
            )
            self._record(run, events, intent, call_hash=decision.call_hash)  # the gate's hash
            handle = self.handles.get(run.run_id)
            if handle is not None:  # the actor runs the tool on what the guards saw
                handle._validated = (key, decision.value)
            return self._verdict(
                run, True, execute=ToolCall(decision.tool.name, decision.args, key)
            )
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
        self._transition(
            run, events, now, decision.target, decision.data, reason, by_reference=by_reference
        )
        return self._verdict(run, True)

    def _on_provider_failure(
        self, run: RunState, msg: Propose, events: list[Event], now: float
    ) -> Verdict:
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
        if budget is None and msg.retryable and attempt < policy.attempts:
            wait = policy.delay(
                attempt, msg.retry_after, random.Random(f"{run.run_id}:{run.seq + 1}")
            )
            if elapsed + wait <= policy.max_elapsed:
                retry_in = round(wait, 6)
        self._emit(
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
        )
        self.stats.provider_failures[(machine.name, model)] += 1
        if budget is not None:
            self._trip(run, events, now, budget[1])
            return self._verdict(run, False, violations=(budget[0],))
        if retry_in is not None:
            return self._verdict(run, False, retry_in=retry_in)
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
        self._transition(
            run,
            events,
            now,
            ESCALATE,
            {},
            "provider",
            escalation=("provider_unavailable", detail),
        )
        return self._verdict(run, False)

    def _reject(
        self,
        run: RunState,
        events: list[Event],
        now: float,
        violations: tuple[Violation, ...],
        trip: Trip | None,
    ) -> Verdict:
        verdicts = self.stats.verdicts
        name = run.machine.name
        for violation in violations:
            verdicts[(name, "rejected", violation.code)] += 1
        self._emit(run, events, ProposalRejected, now, state=run.state, violations=violations)
        if trip is None and run.consecutive_failures >= run.machine.breakers.consecutive_failures:
            trip = self._consecutive_trip(run)
        if trip is not None:
            self._trip(run, events, now, trip)
        return self._verdict(run, False, violations=violations)

    def _consecutive_trip(self, run: RunState) -> Trip:
        limit = run.machine.breakers.consecutive_failures
        last = run.history[-1].text if run.history else ""
        return Trip(
            _breakers.CONSECUTIVE_FAILURES,
            run.consecutive_failures,
            limit,
            f"{run.consecutive_failures} consecutive failures in state {run.state!r} (limit {limit}); last: {last}",
        )

    def _trip(self, run: RunState, events: list[Event], now: float, trip: Trip) -> None:
        machine = run.machine
        self.stats.breaker_trips[(machine.name, trip.breaker, trip.tool)] += 1
        self._emit(
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
            self._transition(
                run, events, now, ESCALATE, {}, "breaker", escalation=(trip.breaker, trip.detail)
            )
        else:
            self._transition(
                run, events, now, machine.on_breaker, {"breaker": trip.breaker}, "breaker"
            )

    def _transition(
        self,
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
            self._emit(
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
            self._emit(run, events, Transitioned, now, src=src, dst=dst, delta=data, reason=reason)
        self.stats.transitions[(run.machine.name, src, dst)] += 1
        if run.terminal:
            self._close(run, events, now, reason, src, data, escalation, by_reference)

    def _close(
        self,
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
                self._emit(run, events, Completed, now, state=dst, output_in_delta=True)
            else:
                self._emit(run, events, Completed, now, state=dst, output=data or None)
        elif dst == ESCALATE:
            why, detail = escalation or (
                f"{reason}_escalated",
                f"{reason} moved the run from {src} to ESCALATE",
            )
            self._emit(
                run, events, Escalated, now, state=src or run.previous, reason=why, detail=detail
            )
            self.stats.escalations_pending += 1
            self.stats.escalation_reasons[(run.machine.name, why)] += 1
        else:
            self._emit(
                run,
                events,
                Failed,
                now,
                state=dst,
                reason=str(data.get("reason", f"{reason} moved the run to FAILED")),
            )
        self._finished(run)

    def _finished(self, run: RunState) -> None:
        self.stats.runs_finished[(run.machine.name, run.machine.outcome(run.state))] += 1

    def _on_report(self, msg: Report, events: list[Event]) -> Verdict:
        run = self._run(msg.run_id)
        pending = run.pending
        if pending is None or pending.key != msg.key:
            # Not the call the run waits for: a duplicate report (a retried request) of a
            # committed call gets the recorded result; anything else is refused below.
            for done in reversed(run.results):
                if done.key == msg.key:
                    return self._verdict(run, True, result=done.result)
        self._check_seq(run, msg)
        if pending is None or pending.key != msg.key:
            expected = pending.key if pending is not None else "no call"
            raise ProtocolError(
                f"run {run.run_id!r} reported key {msg.key!r} but is waiting for {expected!r}"
            )
        machine = run.machine
        tool = machine.tool_by_name[pending.tool]
        now = self.clock()
        self.stats.tool_calls[tool.name] += 1
        self.stats.histogram(self.stats.tool_latency, tool.name).record(msg.latency)
        self.circuits.record(tool.name, msg.ok, now, machine.breakers, msg.error)
        if msg.ok:
            return self._commit(
                run,
                events,
                now,
                tool,
                msg.key,
                msg.result,
                attempts=msg.attempts,
                latency=msg.latency,
            )
        self.stats.tool_errors[tool.name] += 1
        error = readable_text(msg.error, "the error")[0]
        if msg.applied is not False and not tool.safe_to_repeat:
            # An attempt may have reached the downstream: never run it again blindly.
            return self._in_doubt(run, tool, events, now, error, msg.attempts, msg.latency)
        self._emit(
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
        )
        if run.consecutive_failures >= machine.breakers.consecutive_failures:
            self._trip(run, events, now, self._consecutive_trip(run))
        return self._verdict(run, False)

    def _commit(
        self,
        run: RunState,
        events: list[Event],
        now: float,
        tool: Tool,
        key: str,
        result: Any,
        **fields: Any,
    ) -> Verdict:
        """Journal the pending call's result (executed, or reported applied by reconcile)."""
        self._emit(
            run, events, ToolCommitted, now, tool=tool.name, key=key, result=result, **fields
        )
        if not tool.read_only:
            self.stats.side_effects[tool.name] += 1
        return self._verdict(run, True)

    def _in_doubt(
        self,
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
        self.stats.in_doubt[tool.name] += 1
        if tool.reconcile is None or run.doubts >= tool.retry.attempts:
            if tool.reconcile is None:
                why = (
                    "it is not idempotent and cannot reconcile (give the Tool reconcile= to "
                    "ask its downstream whether the key was applied)"
                )
            else:
                why = f"it was still in doubt after {run.doubts} reconciliations"
            return self._escalate_in_doubt(run, tool, events, now, error, why, "in_doubt")
        self._emit(
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
        return self._verdict(
            run, False, reconcile=ToolCall(pending.tool, pending.args, pending.key)
        )

    def _escalate_in_doubt(
        self,
        run: RunState,
        tool: Tool,
        events: list[Event],
        now: float,
        error: str,
        why: str,
        reason: str,
    ) -> Verdict:
        pending = run.pending
        assert pending is not None
        detail = (
            f"tool {tool.name!r} with key {pending.key!r} may or may not have been applied "
            f"({error}), and {why}; check the downstream system, then resume or abort"
        )
        self._emit(
            run,
            events,
            ToolFailed,
            now,
            tool=tool.name,
            key=pending.key,
            error=f"in doubt: {error}",
        )
        self._transition(
            run, events, now, ESCALATE, {}, reason, escalation=("in_doubt_side_effect", detail)
        )
        return self._verdict(run, False)

    def _on_reconciliation(self, msg: Reconciliation, events: list[Event]) -> Verdict:
        run = self._run(msg.run_id)
        self._check_seq(run, msg)
        pending = run.pending
        if pending is None or pending.key != msg.key:
            expected = pending.key if pending is not None else "no call"
            raise ProtocolError(
                f"run {run.run_id!r} reconciled key {msg.key!r} but is waiting for {expected!r}"
            )
        tool = run.machine.tool_by_name[pending.tool]
        now = self.clock()
        error = readable_text(msg.error, "the error")[0]
        applied = msg.applied
        self._emit(
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
        outcome = "applied" if applied else ("not_applied" if applied is False else "failed")
        self.stats.reconciliations[(tool.name, outcome)] += 1
        if applied:
            return self._commit(
                run, events, now, tool, msg.key, msg.result, attempts=0, reconciled=True
            )
        if applied is False:  # never applied: execute it once, with the same key
            return self._verdict(
                run, True, execute=ToolCall(pending.tool, pending.args, pending.key)
            )
        return self._escalate_in_doubt(
            run, tool, events, now, "in doubt", f"its reconcile failed: {error}", "in_doubt"
        )

    def _escalated(self, run_id: str) -> RunState:
        run = self._run(run_id)
        if run.state != ESCALATE or run.escalation is None:
            raise NotEscalated(run_id, run.machine.outcome(run.state), run.state)
        return run

    def resume_target(self, run: RunState, to: str) -> str:
        """The state an escalated run resumes in; ``to`` must be where it escalated from or a
        legal next state of it.

        Raises:
          IllegalResumeTarget: ``to`` is not a legal target (the message lists the legal ones).
        """
        assert run.escalation is not None
        origin = run.escalation.state
        if not to or to == origin:
            return origin
        machine = run.machine
        tables = machine.tables
        legal = [
            origin,
            *(s for s in tables.legal_next(tables.state_id(origin)) if s in machine.states),
        ]
        if to not in legal:
            raise IllegalResumeTarget(run.run_id, to, origin, legal)
        return to

    def _on_resume(self, msg: Resume, events: list[Event]) -> Verdict:
        run = self._escalated(msg.run_id)
        target = self.resume_target(run, msg.to)
        now = self.clock()
        self._emit(
            run, events, Resumed, now, by=msg.by, note=msg.note, to=target, payload=msg.payload
        )
        self._emit(run, events, Transitioned, now, src=ESCALATE, dst=target, reason="operator")
        self.stats.escalations_pending -= 1
        if not msg.payload:
            return self._verdict(run, True)
        return self._on_propose(
            Propose(run_id=run.run_id, seq=run.seq, raw=msg.payload, source="operator"),
            events,
            now,
        )

    def _on_abort(self, msg: Abort, events: list[Event]) -> Verdict:
        run = self._escalated(msg.run_id)
        now = self.clock()
        reason = f"aborted by {msg.by}" + (f": {msg.note}" if msg.note else "")
        self._emit(run, events, Resumed, now, by=msg.by, note=msg.note, to=FAILED)
        self._emit(
            run,
            events,
            Transitioned,
            now,
            src=ESCALATE,
            dst=FAILED,
            delta={"reason": reason},
            reason="operator",
        )
        self._emit(run, events, Failed, now, state=FAILED, reason=reason)
        self.stats.escalations_pending -= 1
        self._finished(run)
        return self._verdict(run, True)

    def _on_recover(self, msg: Recover, events: list[Event]) -> Verdict:
        run = self._run(msg.run_id)
        pending = run.pending
        if run.terminal and not run.closed:
            self._close(run, events, self.clock(), "recovery")
            return self._verdict(run, True)
        if pending is None or run.terminal:
            return self._verdict(run, True)
        tool = run.machine.tool_by_name.get(pending.tool)
        if tool is not None and tool.safe_to_repeat:
            return self._verdict(
                run, True, execute=ToolCall(pending.tool, pending.args, pending.key)
            )
        now = self.clock()
        if tool is not None and tool.reconcile is not None:
            return self._in_doubt(
                run, tool, events, now, "in doubt after a crash", after_crash=True
            )
        detail = (
            f"tool {pending.tool!r} with key {pending.key!r} may or may not have run before the "
            "crash, and it is not idempotent; check the downstream system, then resume or abort"
        )
        self._emit(
            run,
            events,
            ToolFailed,
            now,
            tool=pending.tool,
            key=pending.key,
            error="in doubt after a crash",
        )
        self._transition(
            run, events, now, ESCALATE, {}, "recovery", escalation=("in_doubt_side_effect", detail)
        )
        return self._verdict(run, False)

    # -- runs -----------------------------------------------------------------------

    def _new_run_id(self) -> str:
        self._next_id += 1
        return f"run-{int(self.clock() * 1000):x}-{self._next_id}"

    async def start_run(
        self,
        machine: str,
        inputs: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        provider: Provider | None = None,
        external: bool = False,
    ) -> RunHandle:
        """Start a run and return once its ``run_started`` event is durable.

        The run's actor lives in the supervisor's nursery; cancelling the supervisor
        cancels every run. An ``external`` run has no actor: its caller owns the model and
        the tools, and drives it with :meth:`submit` (the gateway's external runs).

        Args:
          machine: the name of a registered machine.
          inputs: the run's inputs (checked against the machine's ``inputs`` schema).
          run_id: the run's id; generated if omitted. Must be unique in the store.
          provider: the provider for this run; defaults to the supervisor's.
          external: the caller drives the run (no provider needed).

        Raises:
          UnknownMachine: ``machine`` names no registered machine.
          InvalidInputs: the inputs break the machine's ``inputs`` schema, or cannot be
            journaled.
          NoProvider: the machine has worker states and no provider was given.
          ProtocolError: ``run_id`` is already in use.
          trio.ClosedResourceError: the supervisor is shutting down.
        """
        spec = self.machine(machine)
        payload = dict(inputs or {})
        problem = unjournalable(payload)
        if problem is not None:
            raise InvalidInputs(
                f"inputs of machine {machine!r} cannot be journaled: {problem}; pass JSON-like "
                "values (str, int within 64 bits, float, bool, None, lists and dicts of them)"
            )
        if spec.input_validator is not None:
            _, violations = spec.input_validator.validate_json(msgspec.json.encode(payload))
            if violations:
                text = "; ".join(v.message.replace("args", "inputs", 1) for v in violations)
                raise InvalidInputs(f"inputs of machine {machine!r} are invalid: {text}")
        chosen = provider or self.provider_for(machine)
        if (
            not external
            and chosen is None
            and any(isinstance(s, Worker) for s in spec.states.values())
        ):
            raise NoProvider(
                f"machine {machine!r} has worker states but no provider; pass provider= to "
                "open_supervisor() or start_run()"
            )
        if self._actors is None:
            raise trio.ClosedResourceError("supervisor is not running")
        run_id = run_id or self._new_run_id()
        if run_id in self.runs:
            raise ProtocolError(f"run {run_id!r} already exists; run ids must be unique")
        verdict = await self.request(
            Start(run_id=run_id, machine=machine, inputs=payload, external=external)
        )
        handle = RunHandle(run_id, machine)
        self.handles[run_id] = handle
        if not external:
            self._spawn(handle, verdict, chosen)
        return handle

    async def submit(self, msg: Propose | Report | Reconciliation) -> Verdict:
        """Drive an external run one request further: a proposal (the model's raw text, as
        the caller's model produced it), a tool call's outcome, or a reconciliation.

        The same gate, journal, breakers, budgets and in-doubt rules as for a run the
        runtime drives; the verdict is sent once its events are durable. For an accepted
        call, ``verdict.execute`` holds the idempotency key to pass downstream; report the
        outcome with that key (``Report(ok=False, applied=False)`` for a failure that
        certainly was not applied; any other failure of a tool that is not idempotent is
        in doubt, and a tool that can reconcile is asked through ``verdict.reconcile``).
        Once the run ends, its handle's :meth:`RunHandle.wait` returns.

        Raises:
          ProtocolError: the run is driven by its actor, the request is stale (its ``seq``
            is not the run's) or out of order, or the run has ended.
          RunNotFound: no such run is live here.
          StoreError: the batch holding the request's events could not be written.
        """
        run = self.runs.get(msg.run_id)
        if run is not None and not run.external:
            raise ProtocolError(
                f"run {msg.run_id!r} is driven by its actor; submit is for runs started with "
                "start_run(..., external=True)"
            )
        verdict = await self.request(msg)
        run = self.runs.get(msg.run_id)
        if run is not None and run.terminal and run.closed:
            handle = self.handles.get(msg.run_id)
            if handle is not None and not handle.done:
                handle._finish(self.result_of(msg.run_id))
            self.release(msg.run_id)
        return verdict

    def _spawn(self, handle: RunHandle, verdict: Verdict, provider: Provider | None) -> None:
        from ._actor import run_actor

        assert self._actors is not None
        self._actors.start_soon(
            run_actor, self, handle, verdict, provider, name=f"run:{handle.run_id}"
        )

    def result_of(self, run_id: str) -> RunResult:
        run = self._run(run_id)
        reason = ""
        if run.escalation is not None:
            reason = run.escalation.reason
        elif run.state == FAILED and isinstance(run.output, dict):
            reason = str(run.output.get("reason", ""))
        return RunResult(
            run.run_id,
            run.machine.name,
            run.state,
            run.machine.outcome(run.state),
            run.output,
            reason,
            run.seq,
        )

    def release(self, run_id: str) -> None:
        """Drop a finished run's in-memory state and its handle (its journal stays in the
        store; whoever holds the handle keeps its result). How it ended is kept for the
        latest :data:`ENDED_KEPT` runs, so a late request gets a clear answer."""
        self.runs.pop(run_id, None)
        handle = self.handles.pop(run_id, None)
        if handle is not None and handle._result is not None:
            ended = self._ended
            ended[run_id] = handle._result
            if len(ended) > ENDED_KEPT:
                del ended[next(iter(ended))]  # dicts keep insertion order: the oldest

    async def resume_unfinished(self, *, provider: Provider | None = None) -> list[RunHandle]:
        """Rebuild every unfinished run in the store by folding its journal, and resume it.

        A call whose intent is durable but whose outcome is not (in doubt) is re-executed
        with the same key if its tool is idempotent or read-only, reconciled if its tool
        can reconcile, and otherwise escalated with reason ``in_doubt_side_effect``.

        Raises:
          JournalCorrupt, IndexDamaged: a journal or the runs index is damaged; no run
            was resumed (``interlock check`` lists the damage).
          NoProvider: a run to resume needs a model and there is no provider for its
            machine; no run was resumed.
        """
        # Fold every journal before resuming any run: a damaged one (JournalCorrupt,
        # IndexDamaged) then stops the resume before it has started anything.
        folded = []
        for record in await self.store.unfinished():
            if record.run_id in self.runs:
                continue
            machine = self.machines.get(record.machine)
            if machine is None:
                continue
            folded.append(fold(machine, await self.store.load(record.run_id)))
        for run in folded:
            name = run.machine.name
            if (
                not run.external
                and (provider or self.provider_for(name)) is None
                and any(isinstance(spec, Worker) for spec in run.machine.states.values())
            ):
                raise NoProvider(
                    f"machine {name!r} has worker states but no provider, so run "
                    f"{run.run_id!r} cannot be resumed; pass provider= to open_supervisor() "
                    "or resume_unfinished()"
                )
        if not folded:
            return []
        # Decide every recovery now and make them durable with one flush, not one each.
        verdicts: list[Verdict | None] = []
        for run in folded:
            self.runs[run.run_id] = run
            if run.external and run.pending is not None:
                # Its caller ran the call and knows how it went: it reports, with the key.
                verdicts.append(None)
                continue
            verdicts.append(self.submit_nowait(Recover(run_id=run.run_id)))
        await self.request(Sync(run_id=folded[-1].run_id))
        handles = []
        for run, verdict in zip(folded, verdicts, strict=True):
            handle = RunHandle(run.run_id, run.machine.name)
            self.handles[run.run_id] = handle
            if verdict is not None and not run.external:  # an external run waits for its caller
                self._spawn(handle, verdict, provider or self.provider_for(run.machine.name))
            handles.append(handle)
        return handles

    async def _load(self, run_id: str) -> RunState:
        run = self.runs.get(run_id)
        if run is not None:
            return run
        record = await self.store.get_run(run_id)
        machine = self.machine(record.machine)
        run = fold(machine, await self.store.load(run_id))
        self.runs[run_id] = run
        return run

    async def resume_escalated(
        self,
        run_id: str,
        *,
        by: str,
        note: str = "",
        to: str | None = None,
        payload: str | None = None,
        provider: Provider | None = None,
    ) -> RunHandle:
        """Resume an escalated run, as operator ``by``, and return its new handle.

        The run re-enters through the gate: a ``payload`` (a proposal, as the model would
        send it) is verified first, and if it is rejected nothing is journaled.

        Args:
          run_id: an escalated run in the store.
          by: who resumes it (journaled).
          note: why (journaled).
          to: the state to resume in: where it escalated from (default) or a legal next state.
          payload: a corrected proposal to verify and apply on resuming.
          provider: the provider for the rest of the run; defaults to the supervisor's.

        Raises:
          RunNotFound: no such run.
          NotEscalated: the run is not in the escalation queue.
          IllegalResumeTarget: ``to`` is not a legal target.
          PayloadRejected: the gate rejected the payload (``.violations``); nothing was
            journaled.
        """
        run = await self._load(run_id)
        self._escalated(run_id)
        target = self.resume_target(run, to or "")
        if payload:
            # Decide the resume for real, but on a copy of the run in a throwaway supervisor:
            # a rejected payload must leave the journal and this supervisor untouched.
            trial = Supervisor([run.machine], self.store, clock=self.clock)
            trial.runs[run_id] = fold(run.machine, await self.store.load(run_id))
            request = Resume(run_id=run_id, by=by, note=note, to=target, payload=payload)
            attempt = trial._decide(request, [])
            if attempt.violations:
                raise PayloadRejected(run_id, attempt.violations)
        verdict = await self.request(
            Resume(run_id=run_id, seq=run.seq, by=by, note=note, to=target, payload=payload or "")
        )
        handle = RunHandle(run_id, run.machine.name)
        self.handles[run_id] = handle
        if verdict.outcome == "running":
            self._spawn(handle, verdict, provider or self.provider_for(run.machine.name))
        else:
            handle._finish(self.result_of(run_id))
            self.release(run_id)
        return handle

    async def abort_escalated(self, run_id: str, *, by: str, note: str = "") -> RunResult:
        """End an escalated run: it moves to FAILED with ``aborted by {by}: {note}``.

        Raises:
          RunNotFound: no such run.
          NotEscalated: the run is not in the escalation queue.
        """
        await self._load(run_id)
        await self.request(Abort(run_id=run_id, by=by, note=note))
        result = self.result_of(run_id)
        self.release(run_id)
        return result

    async def cancel_run(self, run_id: str, reason: str = "cancelled") -> Verdict:
        """Fail a live run with ``reason`` (journaled as a transition to FAILED) and stop its actor.

        A tool call in flight is cancelled; its intent stays in the journal without a commit.
        """
        verdict = await self.request(Cancel(run_id=run_id, reason=reason))
        handle = self.handles.get(run_id)
        if handle is not None:
            handle._cancelled = True
            handle._scope.cancel()
        return verdict


def _is_fallback(machine: Machine, state: str) -> bool:
    return machine.on_breaker == state and isinstance(machine.states.get(state), Step)


def _single_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception inside ``group`` (however deeply nested), or None if several."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else None


#: How many supervisors hold the collector tuned, and the thresholds from before the first.
_gc_tuning: list[Any] = [0, None]


def _tune_gc(threshold: tuple[int, int, int]) -> None:
    # Supervisors nest and interleave: the first to open saves the thresholds and sets
    # its own, the last to close restores what the first saved.
    if _gc_tuning[0] == 0:
        _gc_tuning[1] = gc.get_threshold()
        gc.set_threshold(*threshold)
    _gc_tuning[0] += 1


def _untune_gc() -> None:
    _gc_tuning[0] -= 1
    if _gc_tuning[0] == 0:
        gc.set_threshold(*_gc_tuning[1])


@asynccontextmanager
async def open_supervisor(
    machines: Sequence[Machine],
    store: Store | None = None,
    *,
    provider: Provider | Mapping[str, Provider] | None = None,
    clock: Clock = time.time,
    resume: bool = False,
    stats: RuntimeStats | None = None,
    max_batch: int = 8192,
    gc_threshold: tuple[int, int, int] | None = GC_THRESHOLD,
) -> AsyncIterator[Supervisor]:
    """Run a supervisor for the duration of an ``async with`` block.

    Leaving the block waits for every run to end (complete, fail or escalate);
    cancelling it cancels every run. Either way each journal batch is written whole
    or not at all, so the store stays consistent. An error that ends the block (one of
    the caller's, a store error, KeyboardInterrupt) reaches the caller as it was raised,
    not wrapped in the nurseries' exception groups; several at once stay a group.

    Args:
      machines: the machines runs may use.
      store: the journal; an in-memory store if omitted.
      provider: the default provider, or one per machine name.
      clock: returns the current time in seconds; recorded into every event.
      resume: resume every unfinished run in the store on entry.
      stats: counters to update (the metrics collector reads them).
      max_batch: the most requests decided per journal write.
      gc_threshold: the cyclic garbage collector's thresholds while the supervisor runs,
        or None to leave them alone. Restored when the last supervisor that set them
        closes (they nest and interleave; the first one's thresholds hold meanwhile).
        Thousands of long-lived run tasks make the default thresholds spend up to half
        the CPU walking them; see
        benchmarks/RESULTS.md. After a burst of start_run calls, ``gc.freeze()`` halves
        the remaining collection work (frozen garbage is never collected, so freeze
        only once the start-up garbage is gone).
    """
    if gc_threshold is not None:
        _tune_gc(gc_threshold)
    if store is None:
        from .stores import MemoryStore

        store = MemoryStore()
    supervisor = Supervisor(
        machines, store, provider=provider, clock=clock, stats=stats, max_batch=max_batch
    )
    try:
        async with trio.open_nursery() as outer:
            await outer.start(supervisor._journal.serve)
            await outer.start(supervisor._watchdog.serve)
            try:
                async with trio.open_nursery() as actors:
                    supervisor._actors = actors
                    # The gauge is store-wide: count the runs already parked before this one.
                    supervisor.stats.escalations_pending = len(await store.escalations())
                    if resume:
                        await supervisor.resume_unfinished()
                    yield supervisor
            finally:
                supervisor._actors = None
                supervisor._journal.closed = True
                outer.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The two nurseries wrap whatever ended the block (the caller's own error, a
        # store error, Ctrl-C) in two groups; one error alone reaches the caller as it
        # was raised, so ``except InterlockError`` catches it. Several stay a group.
        leaf = _single_leaf(group)
        if leaf is None:
            raise
        raise leaf from None
    finally:
        if gc_threshold is not None:
            _untune_gc()
