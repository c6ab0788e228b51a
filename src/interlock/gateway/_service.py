"""The gateway's semantics, free of any transport: one async method per API operation.

The HTTP app (``_app``) and the streaming channel (``_channel``) both call a
:class:`GatewayService`; it takes and returns the Structs of :mod:`._api` and raises
:class:`GatewayError` for every problem, so both transports answer alike.

Retries are safe. A proposal sent with ``expected_seq`` is answered once: the same
proposal at the same ``expected_seq`` gets the recorded verdict (from memory while the
process lives, else read back from the run's journal), never a second decision. A result
is keyed by its idempotency key: a repeated report gets the key's recorded outcome.

On a store that other processes write too (PostgreSQL: several gateway instances and
workers in front of one database), an instance holds nothing another one needs. A hosted
run it is asked to start is enqueued for a worker (``interlock worker``) to claim; reads
come from the store; an external run it does not hold is folded from the store on its
first request, and a copy another instance has advanced is dropped and folded again. Two
instances deciding the same run at once conflict on the seq in the store: the loser
answers 409 and drops its copy, so the next request reads the run afresh.
"""

from __future__ import annotations

import base64
import logging
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from ..core import _decider
from ..core._breakers import CircuitBoard
from ..core._escalation import Action, answer_again, escalated_from, resume_targets
from ..core._events import (
    Completed,
    Escalated,
    Failed,
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    TokenUsage,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    same_answer,
)
from ..core._exceptions import (
    IllegalResumeTarget,
    InterlockError,
    InternalError,
    InvalidInputs,
    InvalidRunId,
    MalformedMessage,
    NoProvider,
    NotEscalated,
    PayloadRejected,
    ProtocolError,
    RunNotFound,
    StoreDamaged,
    StoreError,
    UnknownMachine,
    UnknownState,
)
from ..core._machine import ESCALATE, Machine, Step
from ..core._messages import (
    Abort,
    Propose,
    Reconciliation,
    Recover,
    Report,
    Resume,
    Verdict,
)
from ..core._view import RunState, RunView, fold
from ..protocol import (
    AbortIn,
    CallOut,
    EscalationOut,
    EscalationPage,
    EventOut,
    EventPage,
    Problem,
    ProposalIn,
    ReadyOut,
    ResultIn,
    ResumeIn,
    RunCreate,
    RunOut,
    RunPage,
    RunSummary,
    ToolSpec,
    Usage,
    VerdictOut,
    VerifyIn,
    VerifyItem,
    VerifyOut,
    ViolationOut,
    problem_slug,
)
from ..providers._base import render_prompt
from ..runtime._enqueue import enqueue_run
from ..runtime._tracing import parse_traceparent
from ..stores import LeasingStore

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable, Sequence

    from ..core._events import Event, JournalEvent, Violation
    from ..runtime._supervisor import Supervisor

__all__ = ["GatewayError", "GatewayService", "PrincipalLike"]

PROBLEMS = "https://interlock.dev/problems/"
#: How many runs' last proposal answers are kept in memory (the journal holds the rest).
ANSWERS_KEPT = 100_000
#: The most step states run in a row for one request of an external run.
MAX_STEPS = 1000
#: Events per page of GET /v1/runs/{id}/events, at most.
MAX_EVENTS_PAGE = 10_000
#: Seconds an event stream waits between two looks at the store for events another
#: process wrote (a shared store), doubled up to POLL_MAX while nothing comes.
POLL_MIN = 0.1
POLL_MAX = 1.0
#: Seconds an external run's copy, on a shared store, stays in memory after its last
#: request; then it is dropped (the run may go on through another instance), and the next
#: request here folds it again.
HELD_IDLE = 300.0
_TERMINAL_KINDS = frozenset({"completed", "failed"})
_ENDINGS = frozenset({Completed, Failed, Escalated})  # (by type: none is subclassed)
# The events that begin the decision of a new request: a decision's events run from its
# first event up to (not including) the next of these. A step_proposed is not one: in an
# external run the gateway runs the steps the answer reached before answering.
_REQUEST_KINDS = frozenset(
    {
        "model_called",
        "provider_failed",
        "tool_committed",
        "tool_failed",
        "tool_in_doubt",
        "reconciled",
        "resumed",
    }
)


class PrincipalLike(Protocol):
    """Who makes a request (``gateway._keys.Principal``)."""

    name: str

    def allows(self, role: str, machine: str | None = None) -> bool: ...


class QuotaLike(Protocol):
    """How many runs each key may have in flight (``gateway._guard.RunQuota``)."""

    limit: int

    def acquire(self, name: str) -> bool: ...

    def release(self, name: str) -> None: ...


class GatewayError(Exception):
    """A problem answer: an HTTP status, a title and a detail that says what to fix.

    Args:
      status: the HTTP status (4xx for the caller's mistakes, 503 when it should retry).
      title: a short, fixed summary of the kind of problem.
      detail: what exactly was wrong, and how to fix it.
      violations: the gate's violations, for a rejected payload.
      retry_after: seconds to wait before retrying (sent as ``Retry-After``).
      slug: the problem type's slug, where it is more specific than the title's (one of
        :data:`~interlock.protocol.PROBLEM_ERRORS` names an exception the client raises).
    """

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        violations: Sequence[ViolationOut] = (),
        retry_after: float | None = None,
        slug: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.violations = list(violations)
        self.retry_after = retry_after
        self._slug = slug

    @property
    def slug(self) -> str:
        return self._slug or self.title.lower().replace(" ", "-")

    def problem(self) -> Problem:
        """This error as a problem+json body."""
        return Problem(
            type=PROBLEMS + self.slug,
            title=self.title,
            status=self.status,
            detail=self.detail,
            violations=self.violations,
        )


def not_found(detail: str, slug: str | None = None) -> GatewayError:
    return GatewayError(404, "Not Found", detail, slug=slug)


def conflict(detail: str, slug: str | None = None) -> GatewayError:
    return GatewayError(409, "Conflict", detail, slug=slug)


def invalid(
    detail: str, violations: Sequence[ViolationOut] = (), slug: str | None = None
) -> GatewayError:
    return GatewayError(422, "Unprocessable Content", detail, violations, slug=slug)


def damaged(exc: StoreDamaged) -> GatewayError:
    """The answer to damage in the store: a 500 without ``Retry-After`` (damage does not
    heal, so a retry gets the same answer) that names ``interlock check``."""
    return GatewayError(
        500,
        "Store Damaged",
        f"{exc}; retrying cannot help: run 'interlock check --db JOURNAL' on this gateway's "
        "journal to list all the damage, then restore it from a backup",
        slug="store-damaged",
    )


def unavailable(detail: str, retry_after: float = 1.0) -> GatewayError:
    return GatewayError(503, "Service Unavailable", detail, retry_after=retry_after)


def _violations(items: Sequence[Violation]) -> list[ViolationOut]:
    return [ViolationOut(code=v.code, path=v.path, message=v.message, hint=v.hint) for v in items]


def _translate(exc: Exception) -> GatewayError:
    """The problem answer for an error the runtime raised."""
    match exc:
        case GatewayError():
            return exc
        case RunNotFound():
            return not_found(f"{exc}; list the runs with GET /v1/runs", "run-not-found")
        case UnknownMachine():
            return invalid(str(exc))
        case InvalidInputs() | IllegalResumeTarget() | UnknownState():
            return invalid(str(exc))
        case NoProvider():
            return invalid(f"{exc}; or start the run with mode 'external'")
        case PayloadRejected():
            return invalid(
                f"the payload was rejected by the gate; nothing was journaled: {exc}",
                _violations(exc.violations),
            )
        case NotEscalated():
            return conflict(str(exc))
        case StoreDamaged():  # before ProtocolError: a JournalInconsistent is both
            return damaged(exc)
        case InvalidRunId() | MalformedMessage():  # can never be valid: not a conflict
            return invalid(str(exc), slug=problem_slug(exc, "unprocessable-content"))
        case ProtocolError():  # StaleSeq, RunEnded, RunExists, OutOfTurn, NotExternal, ...
            return conflict(str(exc), problem_slug(exc, "conflict"))
        case StoreError():
            return unavailable(f"the journal cannot be written now: {exc}; retry")
        case trio.ClosedResourceError():
            return unavailable("the gateway is shutting down; retry against another instance")
        case InternalError():
            # A bug met deciding one run's request: that run was stopped (the supervisor
            # contained it); in a batch, the others are answered as they were decided.
            log.error("%s", exc, exc_info=exc.__cause__ or exc)
            return GatewayError(500, "Internal Server Error", f"{exc}; report it")
    raise exc


log = logging.getLogger("interlock.gateway")

_NO_USAGE = TokenUsage()  # frozen: one for every proposal that reports none


def _usage(usage: Usage | None) -> TokenUsage:
    if usage is None:
        return _NO_USAGE
    return TokenUsage(usage.prompt, usage.completion, usage.cached, usage.reasoning)


def verdict_out(verdict: Verdict, *, replayed: bool = False) -> VerdictOut:
    """A runtime verdict as the API's VerdictOut."""
    call = verdict.execute
    reconcile = verdict.reconcile
    if (
        call is None
        and reconcile is None
        and not verdict.violations
        and verdict.result is None
        and not verdict.retry_in
        and not replayed
    ):
        # NOTE: a move, the answer of most proposals: only the fields that differ from
        # their defaults (a keyword a Struct must match costs more than a default)
        return VerdictOut(
            run_id=verdict.run_id,
            accepted=verdict.accepted,
            outcome=verdict.outcome,
            state=verdict.state,
            seq=verdict.seq,
        )
    return VerdictOut(
        run_id=verdict.run_id,
        accepted=verdict.accepted,
        outcome=verdict.outcome,
        state=verdict.state,
        seq=verdict.seq,
        violations=_violations(verdict.violations) if verdict.violations else [],
        key=call.key if call is not None else None,
        tool=call.tool if call is not None else None,
        args=call.args if call is not None else None,
        reconcile=(
            CallOut(key=reconcile.key, tool=reconcile.tool, args=reconcile.args)
            if reconcile is not None
            else None
        ),
        result=verdict.result,
        retry_in=verdict.retry_in,
        replayed=replayed,
    )


def event_out(event: JournalEvent | Event) -> EventOut:
    """A journal event as the API's EventOut."""
    data = msgspec.to_builtins(event)
    kind = data.pop("kind")
    for name in ("run_id", "seq", "ts"):
        data.pop(name, None)
    return EventOut(run_id=event.run_id, seq=event.seq, ts=event.ts, kind=kind, data=data)


class _Answer(msgspec.Struct):
    """The answer to one proposal at one seq: in flight until :meth:`settle`.

    NOTE: the event a retry waits on is made only when one does (a batch makes an
    answer per proposal, and almost none is ever waited on); a Struct, made without a
    Python frame (an ``__init__`` was a tenth of a batch's intake).
    """

    seq: int
    proposal: str
    settled: bool = False
    event: Any = None  # the trio.Event a retry waits on, made when one does
    verdict: Any = None  # VerdictOut, once settled
    error: Any = None  # GatewayError, once failed

    def settle(self) -> None:
        """The verdict or the error is set: wake whoever waits for it."""
        self.settled = True
        event = self.event
        if event is not None:
            event.set()

    async def wait(self) -> None:
        """Wait until settled (a checkpoint if it is already)."""
        if self.settled:
            await trio.lowlevel.checkpoint()
            return
        if self.event is None:
            self.event = trio.Event()
        await self.event.wait()


class _Follower:
    """One event stream's inbox: the events of its run this process wrote since it looked."""

    __slots__ = ("events", "tick")

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.tick = trio.Event()

    def add(self, event: Event) -> None:
        self.events.append(event)
        self.tick.set()

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        self.tick = trio.Event()
        return events


class GatewayService:
    """The API's operations over a running :class:`~interlock.Supervisor`.

    Args:
      supervisor: a running supervisor (``async with open_supervisor(...)``).
      max_waiting: the most proposals and results waiting on the journal at once; past
        it a request gets a 503 with ``Retry-After`` (back-pressure, never an unbounded
        queue).
      retry_after: the seconds a 503 asks the caller to wait.
      quota: the most unfinished runs each key may have (``gateway._guard.RunQuota``);
        a key at its limit gets a 429 when it starts another run.

    On a store with leases (PostgreSQL), where workers and other gateway instances write
    the same journal, the service keeps no state another instance needs (see the module):
    :attr:`shared` is set, and :attr:`enqueues` when hosted runs go to workers.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        *,
        max_waiting: int = 20_000,
        retry_after: float = 1.0,
        quota: QuotaLike | None = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.supervisor = supervisor
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.waiting = 0
        """Requests waiting on the journal now."""
        self.draining = False
        """Set when the server stops: new mutating requests get a 503."""
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        self._step_states: dict[str, frozenset[str]] = {}  # by machine name, see _steps_of
        self._reconciling: set[tuple[str, str]] = set()
        self.quota = quota
        self._owners: dict[str, str] = {}  # run id -> the key that holds a quota slot for it
        store = supervisor.store
        self.shared = isinstance(store, LeasingStore)
        """Whether other processes write the journal too (PostgreSQL): reads then go to the
        store, and external runs are folded from it on demand."""
        self.enqueues = self.shared and getattr(store, "leasing", False) is True
        """Whether a hosted run is enqueued for a worker (``interlock worker``) to drive,
        instead of being driven in this process."""
        if not self.enqueues:
            # The hosted runs are driven here: one whose events could not be written (a
            # full disk) is driven again from its journal once the journal can be written,
            # as a worker does, not left unfinished until a restart resumes it.
            supervisor.readopting = True
        self.poll = (POLL_MIN, POLL_MAX)
        """The shortest and longest wait of an event stream between looks at a shared store."""
        self._loading: dict[str, trio.Lock] = {}
        self.held_idle = HELD_IDLE
        """Seconds an external run's copy stays in memory after its last request (shared store)."""
        self._used: OrderedDict[str, float] = OrderedDict()  # run id -> its last request
        self._followers: dict[str, list[_Follower]] = {}
        self._watch_store()

    # -- plumbing -----------------------------------------------------------------

    def _watch_store(self) -> None:
        # NOTE: told of every batch the journal writer made durable, the event streams
        # (follow) get this process's writes with no polling and no reload of the journal,
        # at no cost when nobody follows.
        owners = self._owners
        followers = self._followers

        def written(events: Sequence[Event]) -> None:
            if owners:
                endings = _ENDINGS
                for event in events:
                    if type(event) in endings and event.run_id in owners:
                        self._release(event.run_id)
            if followers:
                for event in events:
                    waiting = followers.get(event.run_id)
                    if waiting is not None:
                        for follower in waiting:
                            follower.add(event)

        self.supervisor.on_written.append(written)

    def _release(self, run_id: str) -> None:
        name = self._owners.pop(run_id, None)
        if name is not None and self.quota is not None:
            self.quota.release(name)

    def _take_slot(self, principal: PrincipalLike | None) -> str | None:
        if self.quota is None or principal is None:
            return None
        if not self.quota.acquire(principal.name):
            raise GatewayError(
                429,
                "Too Many Requests",
                f"key {principal.name!r} has {self.quota.limit} runs in flight, its limit; "
                "finish or abort one first",
                retry_after=self.retry_after,
            )
        return principal.name

    def _admit(self, count: int = 1) -> None:
        if self.draining:
            raise unavailable("the gateway is shutting down; retry", self.retry_after)
        if self.waiting and self.waiting + count > self.max_waiting:
            raise unavailable(
                f"the journal is behind: {self.waiting} requests are waiting for it "
                f"(at most {self.max_waiting}); retry after {self.retry_after:g} s",
                self.retry_after,
            )
        self.waiting += count

    @staticmethod
    def _allow(principal: PrincipalLike | None, roles: tuple[str, ...], machine: str) -> None:
        if principal is None:
            return
        if not any(principal.allows(role, machine) for role in roles):
            raise GatewayError(
                403,
                "Forbidden",
                f"key {principal.name!r} may not do this for machine {machine!r}: it needs "
                f"the role {' or '.join(map(repr, roles))} for that machine; use a key that has it",
            )

    async def _machine_of(self, run_id: str) -> str:
        run = self.supervisor.external.get(run_id)
        if run is not None:
            return run.machine.name
        try:
            return (await self.supervisor.store.get_run(run_id)).machine
        except Exception as exc:
            raise _translate(exc) from None

    async def _fold(self, run_id: str) -> RunState:
        """The run as its journal holds it (the live state, if it is live here and, on a
        shared store, no other process has written it since)."""
        run = self.supervisor.external.get(run_id)
        if run is not None and not self.shared:
            return run
        store = self.supervisor.store
        try:
            record = await store.get_run(run_id)
            if run is not None and run.seq >= record.seq:
                return run
            machine = self.supervisor.machine(record.machine)
            return fold(machine, await store.load(run_id))
        except UnknownMachine:
            raise conflict(
                f"run {run_id!r} is of machine {record.machine!r}, which this gateway's "
                f"application does not have (it has: {', '.join(self.supervisor.machines)})"
            ) from None
        except Exception as exc:
            raise _translate(exc) from None

    async def _held(
        self, run_id: str, *, behind: int | None = None, check: bool = False
    ) -> RunState | None:
        """This process's copy of the run, to decide a request on.

        On a shared store an external run this process does not hold is folded from the
        store (and held from then on), and a copy older than seq ``behind`` (or, with
        ``check``, than the store's) is dropped and folded again: another instance advanced
        the run. None when no copy can be held here: no such run is live (not shared), or
        the run is hosted (a worker drives it) or has ended.
        """
        sup = self.supervisor
        run = sup.external.get(run_id)
        if not self.shared:
            if run is None and sup.unwritten(run_id):
                # Dropped when a batch holding its events could not be written (a full
                # disk): the journal holds it as it was, where this request takes it on.
                try:
                    run = await sup.load_unwritten(run_id)
                except Exception as exc:
                    raise _translate(exc) from None
            return run
        if run is not None and not run.external:
            return run
        self._use(run_id)
        if run is not None and not check and (behind is None or run.seq >= behind):
            return run
        lock = self._loading.get(run_id)
        if lock is None:
            lock = self._loading[run_id] = trio.Lock()
        try:
            async with lock:
                return await self._load_held(run_id, behind, check)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._loading.pop(run_id, None)

    async def _load_held(self, run_id: str, behind: int | None, check: bool) -> RunState | None:
        sup = self.supervisor
        store = sup.store
        run = sup.external.get(run_id)
        try:
            record = await store.get_run(run_id)
        except Exception as exc:
            raise _translate(exc) from None
        if run is not None and run.seq >= max(record.seq, behind or 0):
            return run  # loaded meanwhile by another request, or not stale after all
        if run is not None:
            self._drop(run_id, run)
        if record.outcome != "running":
            return None
        try:
            machine = sup.machine(record.machine)
        except UnknownMachine:
            raise conflict(
                f"run {run_id!r} is of machine {record.machine!r}, which this gateway's "
                f"application does not have (it has: {', '.join(sup.machines)})"
            ) from None
        try:
            events = await store.load(run_id)
            run = fold(machine, events)
        except Exception as exc:
            raise _translate(exc) from None
        if not run.external:
            return None
        held = sup.external.hold(run, events)
        if held is not run:  # started or loaded by a request that did not wait here
            return held
        if run.terminal and not run.closed:  # its last write was cut short: close it
            try:
                await sup.request(Recover(run_id=run_id))
            except Exception as exc:
                raise _translate(exc) from None
            sup.external.settle(run_id)
            return None
        return run

    def _use(self, run_id: str) -> None:
        """Note a request of an external run; drop the copies idle for ``held_idle`` s."""
        used = self._used
        now = trio.current_time()
        used[run_id] = now
        used.move_to_end(run_id)
        horizon = now - self.held_idle
        while used:
            oldest, when = next(iter(used.items()))
            if when >= horizon:  # never the run of this request
                break
            del used[oldest]
            if oldest not in self._loading:
                self._drop(oldest)

    def _drop(self, run_id: str, run: RunState | None = None) -> None:
        """Forget this process's copy of an external run (``run``, if given and still
        the one held): the next request folds it from the store."""
        self.supervisor.external.forget(run_id, run)

    async def _write_failed(self, run_id: str, before: int, exc: Exception) -> GatewayError:
        """The answer to a request of an external run whose events could not be written:
        on a shared store, a 409 when another process wrote the run meanwhile (the seq
        conflict of two instances deciding it at once), else what ``exc`` means."""
        if not self.shared or not isinstance(exc, StoreError) or isinstance(exc, StoreDamaged):
            return _translate(exc)
        self._drop(run_id)
        try:
            record = await self.supervisor.store.get_run(run_id)
        except Exception:
            return _translate(exc)
        if record.seq <= before:
            return _translate(exc)
        return conflict(
            f"run {run_id!r} was advanced by another gateway instance (or process) at the "
            f"same time: the journal holds it at seq {record.seq}, this request was decided "
            f"at seq {before} and nothing of it was written; GET the run (or its last "
            "verdict) and send the request again at the run's seq",
            "stale-seq",
        )

    async def _submit(self, run: RunState, msg: Propose | Report | Reconciliation) -> Verdict:
        """``supervisor.external.submit(msg)``, a lost race answered as
        :meth:`_write_failed` says."""
        before = run.seq
        try:
            return await self.supervisor.external.submit(msg)
        except StoreError as exc:
            raise await self._write_failed(run.run_id, before, exc) from None

    def run_out(self, run: RunState) -> RunOut:
        """A run (live, or folded from its journal) as the API's RunOut."""
        view = RunView(run)
        machine = run.machine
        tools: list[ToolSpec] = []
        legal: list[str] = []
        data_schema = None
        context = ""
        outcome = machine.outcome(run.state)
        if not run.terminal and run.state in machine.states:
            legal = list(view.legal_next)
            data_schema = view.data_schema if legal else None
            tools = [
                ToolSpec(name=t, description=view.tool_description(t), schema=view.tool_schema(t))
                for t in view.allowed_tools
            ]
            if view.instructions or tools or legal:
                context = render_prompt(view)
        pending = run.pending
        reason = ""
        if run.escalation is not None and run.state == ESCALATE:
            reason = run.escalation.reason
        elif isinstance(run.output, dict) and outcome == "failed":
            reason = str(run.output.get("reason", ""))
        return RunOut(
            id=run.run_id,
            machine=machine.name,
            mode="external" if run.external else "hosted",
            state=run.state,
            seq=run.seq,
            outcome=outcome,
            tools=tools,
            next=legal,
            data_schema=data_schema,
            context=context,
            pending=(
                CallOut(key=pending.key, tool=pending.tool, args=pending.args)
                if pending is not None
                else None
            ),
            output=run.output if outcome == "completed" else None,
            reason=reason,
            driven_by="caller" if run.external else "worker" if self.enqueues else "gateway",
        )

    # -- runs ---------------------------------------------------------------------

    async def create_run(
        self, body: RunCreate, principal: PrincipalLike | None = None, trace: str | None = None
    ) -> tuple[RunOut, bool]:
        """Start a run; return it and whether this request created it.

        A retry with the same ``run_id``, machine, inputs and mode gets the existing run
        (created False); the same id with anything else is a 409. On a store with leases
        (:attr:`enqueues`) a hosted run is enqueued, not driven here: the answer is the run
        as the store holds it (its initial state, running) and a worker drives it.
        ``trace``: the request's ``traceparent``, which the run's spans continue (tracing on).
        """
        self._allow(principal, ("agent",), body.machine)
        sup = self.supervisor
        if body.machine not in sup.machines:
            raise invalid(
                f"no machine named {body.machine!r}; this gateway's machines: "
                f"{', '.join(sup.machines)}"
            )
        external = body.mode == "external"
        if body.run_id is not None:
            existing = await self._existing(body, external)
            if existing is not None:
                return existing, False
        self._admit()
        try:
            owner = await self._take_slot_swept(principal)
        except BaseException:
            self.waiting -= 1
            raise
        if self.enqueues and not external:
            return await self._enqueue(body, owner, trace)
        try:
            if external:
                handle = await sup.external.start(
                    body.machine, body.inputs, run_id=body.run_id, trace=trace
                )
                await self._steps(handle.run_id, None)
            else:
                handle = await sup.start_run(
                    body.machine, body.inputs, run_id=body.run_id, trace=trace
                )
        except Exception as exc:
            if owner is not None and self.quota is not None:
                self.quota.release(owner)
            if isinstance(exc, ProtocolError) or (self.shared and isinstance(exc, StoreError)):
                # Another request (or instance) created it meanwhile: answered as a retry.
                existing = await self._existing(body, external)
                if existing is not None:
                    return existing, False
            raise _translate(exc) from None
        except BaseException:  # cancelled: the slot goes with the run, if it was started
            if owner is not None and self.quota is not None:
                if body.run_id is not None and body.run_id in sup.external:
                    self._owners[body.run_id] = owner
                else:
                    self.quota.release(owner)
            raise
        finally:
            self.waiting -= 1
        run = sup.external.get(handle.run_id)
        if self.shared and external:
            self._use(handle.run_id)
        if owner is not None:
            if run is not None and not run.closed:
                self._owners[handle.run_id] = owner
            elif self.quota is not None:  # it ended already
                self.quota.release(owner)
        if run is None:  # a hosted run may have finished already
            run = await self._fold(handle.run_id)
        return self.run_out(run), True

    async def _enqueue(
        self, body: RunCreate, owner: str | None, trace: str | None = None
    ) -> tuple[RunOut, bool]:
        """Create the hosted run in the store for a worker to claim (see create_run)."""
        sup = self.supervisor
        try:
            try:
                run_id = await enqueue_run(
                    sup.store,
                    sup.machine(body.machine),
                    body.inputs,
                    run_id=body.run_id,
                    # the caller's trace, which the worker's spans continue (tracing on)
                    trace=trace if sup.tracing is not None and parse_traceparent(trace) else None,
                )
            finally:
                self.waiting -= 1
        except Exception as exc:
            if owner is not None and self.quota is not None:
                self.quota.release(owner)
            if body.run_id is not None and isinstance(exc, ProtocolError | StoreError):
                # Created meanwhile, by another request here or another instance.
                existing = await self._existing(body, False)
                if existing is not None:
                    return existing, False
            raise _translate(exc) from None
        except BaseException:
            if owner is not None and self.quota is not None:
                self.quota.release(owner)
            raise
        if owner is not None:
            # NOTE: a worker writes its end, so this process never sees it: the slot is
            # given back when the key is at its limit and the store says the run ended.
            self._owners[run_id] = owner
        return self.run_out(await self._fold(run_id)), True

    async def _take_slot_swept(self, principal: PrincipalLike | None) -> str | None:
        """:meth:`_take_slot`; on a shared store, a key at its limit first gets back the
        slots of its runs that other processes ended."""
        if not self.shared or self.quota is None or principal is None:
            return self._take_slot(principal)
        try:
            return self._take_slot(principal)
        except GatewayError:
            pass
        name = principal.name
        store = self.supervisor.store
        # NOTE: a run held here may have been ended by another instance too: the store
        # decides for every run, one index row each, only when the key is at its limit.
        for run_id in [r for r, owner in self._owners.items() if owner == name]:
            try:
                record = await store.get_run(run_id)
            except RunNotFound:
                self._release(run_id)
                continue
            except Exception as exc:
                raise _translate(exc) from None
            if record.outcome != "running":
                self._release(run_id)
                self._drop(run_id)
        return self._take_slot(principal)

    async def _existing(self, body: RunCreate, external: bool) -> RunOut | None:
        assert body.run_id is not None
        try:
            events = await self.supervisor.store.load(body.run_id)
        except RunNotFound:
            return None
        except Exception as exc:
            raise _translate(exc) from None
        started = events[0]
        same = (
            getattr(started, "machine", None) == body.machine
            and getattr(started, "inputs", None) == body.inputs
            and (getattr(started, "external", False) is True) == external
        )
        if not same:
            raise conflict(
                f"run {body.run_id!r} already exists with another machine, inputs or mode; "
                "choose another run_id (or omit it to have one generated)",
                "run-exists",
            )
        return self.run_out(await self._fold(body.run_id))

    async def get_run(self, run_id: str, principal: PrincipalLike | None = None) -> RunOut:
        """The run ``run_id``, live or from its journal."""
        run = await self._fold(run_id)
        self._allow(principal, ("reader", "agent"), run.machine.name)
        return self.run_out(run)

    async def list_runs(
        self,
        *,
        state: str | None = None,
        machine: str | None = None,
        outcome: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        principal: PrincipalLike | None = None,
    ) -> RunPage:
        """A page of the runs index, oldest first, filtered by every filter given."""
        if not 1 <= limit <= 1000:
            raise GatewayError(400, "Bad Request", f"limit must be between 1 and 1000, got {limit}")
        start = _decode_cursor(cursor)
        try:
            records = await self.supervisor.store.list_runs(
                machine=machine, state=state, outcome=outcome
            )
        except Exception as exc:
            raise _translate(exc) from None
        if principal is not None:
            records = [
                r
                for r in records
                if principal.allows("reader", r.machine) or principal.allows("agent", r.machine)
            ]
        page = records[start : start + limit]
        following = start + limit if start + limit < len(records) else None
        return RunPage(
            runs=[
                RunSummary(
                    id=r.run_id,
                    machine=r.machine,
                    state=r.state,
                    outcome=r.outcome,
                    seq=r.seq,
                    started=r.started,
                    updated=r.updated,
                    reason=r.reason,
                )
                for r in page
            ],
            cursor=_encode_cursor(following) if following is not None else None,
        )

    async def events(
        self,
        run_id: str,
        after: int = 0,
        limit: int = MAX_EVENTS_PAGE,
        principal: PrincipalLike | None = None,
    ) -> EventPage:
        """The run's journal events after seq ``after``, at most ``limit``."""
        if after < 0:
            raise GatewayError(400, "Bad Request", f"after must be a seq >= 0, got {after}")
        if not 1 <= limit <= MAX_EVENTS_PAGE:
            raise GatewayError(
                400, "Bad Request", f"limit must be between 1 and {MAX_EVENTS_PAGE}, got {limit}"
            )
        self._allow(principal, ("reader", "agent"), await self._machine_of(run_id))
        events = await self._load(run_id)
        chosen = events[after : after + limit]  # seqs run from 1 without gaps
        return EventPage(
            run_id=run_id,
            events=[event_out(e) for e in chosen],
            last_seq=chosen[-1].seq if chosen else after,
            more=after + limit < len(events),
        )

    async def _load(self, run_id: str) -> list[JournalEvent]:
        try:
            return await self.supervisor.store.load(run_id)
        except Exception as exc:
            raise _translate(exc) from None

    async def follow(
        self,
        run_id: str,
        after: int = 0,
        principal: PrincipalLike | None = None,
        *,
        heartbeat: float | None = None,
    ) -> AsyncGenerator[EventOut | None, None]:
        """Every journal event of the run after seq ``after``, as it becomes durable, until
        the run completes or fails (an escalated run is followed on: it may be resumed).

        With ``heartbeat``, None is yielded after that many seconds without an event (an
        SSE comment keeps proxies from closing an idle stream).
        """
        if after < 0:
            raise GatewayError(400, "Bad Request", f"after must be a seq >= 0, got {after}")
        self._allow(principal, ("reader", "agent"), await self._machine_of(run_id))
        return self._follow(run_id, after, heartbeat)

    async def _follow(
        self, run_id: str, after: int, heartbeat: float | None
    ) -> AsyncGenerator[EventOut | None, None]:
        # NOTE: the journal is read once; then this process's writes of the run come from
        # the journal writer (see _watch_store) and, on a shared store, other processes'
        # writes from polling the run's index row: the journal is read again only when
        # that row says the run grew, and only from the first event not yet sent.
        follower = _Follower()
        self._followers.setdefault(run_id, []).append(follower)
        try:
            seq = after
            events: Sequence[JournalEvent | Event] = await self._load_after(run_id, seq)
            if not events:
                try:
                    record = await self.supervisor.store.get_run(run_id)
                except Exception as exc:
                    raise _translate(exc) from None
                if record.outcome in _TERMINAL_KINDS and record.seq <= seq:
                    return  # it ended at or before ``after``
            poll, poll_max = self.poll
            quiet = 0.0  # seconds since the last event or keep-alive
            while True:
                for event in events:
                    if event.seq <= seq:
                        continue
                    if event.seq > seq + 1:  # a gap (another process's writes): read them
                        break
                    seq = event.seq
                    quiet, poll = 0.0, self.poll[0]
                    yield event_out(event)
                    if type(event).__struct_config__.tag in _TERMINAL_KINDS:
                        return
                else:
                    events = ()
                if events:  # stopped at a gap
                    events = await self._load_after(run_id, seq)
                    continue
                wait = heartbeat if heartbeat is not None else math.inf
                if self.shared:
                    wait = min(wait - quiet, poll) if heartbeat is not None else poll
                with trio.move_on_after(max(wait, 0.0)):
                    await follower.tick.wait()
                if follower.tick.is_set():
                    events = follower.take()
                    continue
                quiet += max(wait, 0.0)
                if self.shared:
                    grown = await self._grown(run_id, seq)
                    if grown:
                        events = await self._load_after(run_id, seq)
                        continue
                    poll = min(poll * 2, poll_max)
                if heartbeat is not None and quiet >= heartbeat:
                    quiet = 0.0
                    yield None
        finally:
            waiting = self._followers.get(run_id)
            if waiting is not None:
                waiting.remove(follower)
                if not waiting:
                    del self._followers[run_id]

    async def _grown(self, run_id: str, seq: int) -> bool:
        """Whether the store holds events of the run after ``seq``."""
        try:
            return (await self.supervisor.store.get_run(run_id)).seq > seq
        except Exception as exc:
            raise _translate(exc) from None

    async def _load_after(self, run_id: str, seq: int) -> list[JournalEvent]:
        """The run's journal events after ``seq``."""
        try:
            return await self._read_after(run_id, seq)
        except Exception as exc:
            raise _translate(exc) from None

    async def _read_after(self, run_id: str, seq: int) -> list[JournalEvent]:
        """:meth:`_load_after`, with the store's errors as it raised them."""
        store = self.supervisor.store
        load_after = getattr(store, "load_after", None)
        if load_after is not None:
            return list(await load_after(run_id, seq))
        return (await store.load(run_id))[seq:]  # seqs run from 1 without gaps

    # -- proposals ----------------------------------------------------------------

    async def propose(
        self,
        run_id: str,
        body: ProposalIn,
        principal: PrincipalLike | None = None,
        trace: str | None = None,
    ) -> VerdictOut:
        """Verify the model's raw proposal for the external run ``run_id`` (``trace``: the
        request's ``traceparent``, under which the verdict is traced, tracing on).

        Raises:
          GatewayError: 404 no such run; 409 a stale ``expected_seq``, a hosted run, a
            call awaiting its result, or a run that has ended; 503 back-pressure.
        """
        self._allow(principal, ("agent",), await self._machine_of(run_id))
        self._admit()
        try:
            return await self._propose(
                run_id, body.proposal, body.expected_seq, body.usage, body.model, trace
            )
        finally:
            self.waiting -= 1

    async def _propose(
        self,
        run_id: str,
        proposal: str,
        expected: int | None,
        usage: Usage | None,
        model: str,
        trace: str | None = None,
        *,
        told: bool = False,
    ) -> VerdictOut:
        """One proposal (``told``: its batch has told the tracing of it already)."""
        answer: _Answer | None = None
        # A copy behind the seq the caller saw is one another instance advanced: reload it.
        run = await self._held(run_id, behind=expected)
        if expected is not None:
            known = self._answers.get(run_id)
            if known is not None and known.seq == expected and known.proposal == proposal:
                return await self._recorded_answer(known)
            if run is None or run.seq != expected:
                return await self._replay_proposal(run_id, proposal, expected)
            answer = _Answer(expected, proposal)
            self._remember(run_id, answer)
        if run is None:
            raise await self._not_live(run_id)
        if not run.external:
            raise _hosted(run_id)
        tracing = self.supervisor.tracing
        if tracing is not None and not told:
            tracing.request(run_id, trace)
        try:
            verdict = await self._submit(
                run,
                Propose(
                    run_id=run_id,
                    seq=expected or 0,
                    raw=proposal,
                    usage=_usage(usage),
                    model=model,
                ),
            )
            verdict = await self._advance(run_id, verdict)
        except Exception as exc:
            error = _translate(exc)
            self._fail(run_id, answer, error)
            raise error from None
        except BaseException:  # cancelled (a timeout, a client gone): never leave it pending
            self._fail(run_id, answer, _interrupted())
            raise
        out = verdict_out(verdict)
        self._note_reconcile(out)
        if answer is not None:
            answer.verdict = out
            answer.settle()
        return out

    def _steps_of(self, machine: Machine) -> frozenset[str]:
        """The names of ``machine``'s step states (remembered per machine)."""
        names = frozenset(n for n, spec in machine.states.items() if isinstance(spec, Step))
        self._step_states[machine.name] = names  # one machine per name (the supervisor's rule)
        return names

    def _remember(self, run_id: str, answer: _Answer) -> None:
        self._answers[run_id] = answer
        self._answers.move_to_end(run_id)
        if len(self._answers) > ANSWERS_KEPT:
            self._answers.popitem(last=False)

    def _fail(self, run_id: str, answer: _Answer | None, error: GatewayError) -> None:
        """Requests waiting on ``answer`` get ``error``; a later retry is decided afresh
        (the error may have been passing: a 503, a store hiccup)."""
        if answer is None:
            return
        answer.error = error
        answer.settle()
        if self._answers.get(run_id) is answer:
            del self._answers[run_id]

    async def _advance(self, run_id: str, verdict: Verdict) -> Verdict:
        """``verdict``, or the verdict of the last step state it led to (see _steps)."""
        return await self._steps(run_id, verdict) or verdict

    async def _steps(self, run_id: str, verdict: Verdict | None) -> Verdict | None:
        """Run the step states an external run has reached, and return the last verdict.

        A step is plain code of the machine (no model, no I/O), so the gateway runs it, as
        an actor would: its caller owns only the model and the tools. It stops at a worker
        state, a call to execute (a step may propose one), the end of the run, or after
        :data:`MAX_STEPS` (a step that keeps failing trips the breakers long before).
        """
        get = self.supervisor.external.get
        for _ in range(MAX_STEPS):
            if verdict is not None and (verdict.execute is not None or verdict.reconcile):
                return verdict
            run = get(run_id)
            if run is None or not run.external or run.closed or run.pending is not None:
                return verdict
            spec = run.machine.states.get(run.state)
            if not isinstance(spec, Step):
                return verdict
            proposal = _decider.step_proposal(run_id, run.seq, run.state, spec, RunView(run))
            verdict = await self._submit(run, proposal)
        return verdict

    async def _not_live(self, run_id: str) -> GatewayError:
        """The problem for a request to a run that is not live here."""
        try:
            record = await self.supervisor.store.get_run(run_id)
        except Exception as exc:
            return _translate(exc)
        if record.outcome != "running":
            return conflict(
                f"run {run_id!r} is {record.outcome} in state {record.state!r}; it takes no "
                "more proposals or results"
                + ("; an operator resumes it" if record.outcome == "escalated" else ""),
                "run-ended",
            )
        if self.shared:
            return conflict(
                f"run {run_id!r} is hosted: a worker drives it (interlock worker); "
                "proposals and results are for runs created with mode 'external'",
                "not-external",
            )
        return conflict(
            f"run {run_id!r} is running but not in this gateway (another process drives it); "
            "send its requests there",
            "run-leased",
        )

    async def _recorded_answer(self, answer: _Answer) -> VerdictOut:
        await answer.wait()
        if answer.verdict is None:
            assert answer.error is not None
            raise answer.error
        return msgspec.structs.replace(answer.verdict, replayed=True)

    async def _replay_proposal(self, run_id: str, proposal: str, expected: int) -> VerdictOut:
        """The recorded verdict of ``proposal`` made at seq ``expected``, read from the
        journal; a 409 if the run moved on by another request."""
        events = await self._load(run_id)
        _external(run_id, events, "proposals")
        current = events[-1].seq
        if expected > current:
            raise conflict(
                f"run {run_id!r} is at seq {current}, the request was made at seq {expected}, "
                "which the run has not reached; send the seq of RunOut or of the last verdict",
                "stale-seq",
            )
        first = events[expected] if expected < len(events) else None
        if isinstance(first, ModelCalled) and same_answer(first, proposal):
            return self._recorded(events, expected)
        raise conflict(
            f"run {run_id!r} is at seq {current}, the request was made at seq {expected}: "
            "another request advanced the run; GET the run and propose again at its seq",
            "stale-seq",
        )

    def _recorded(self, events: Sequence[JournalEvent], start: int) -> VerdictOut:
        """The verdict of the decision whose first event is ``events[start]``."""
        end = start + 1
        while end < len(events) and type(events[end]).__struct_config__.tag not in _REQUEST_KINDS:
            end += 1
        decided = events[start:end]
        machine = self.supervisor.machine(self._machine_name(events))
        run = fold(machine, list(events[:end]))
        key = tool = None
        args: dict[str, Any] | None = None
        violations: list[ViolationOut] = []
        accepted = True
        result: Any = None
        for event in decided:
            if isinstance(event, IntentRecorded):
                key, tool, args = event.key, event.tool, event.args
            elif isinstance(event, ProposalRejected):
                accepted = False
                violations = _violations(event.violations)
            elif isinstance(event, ToolCommitted):
                result = event.result
            elif isinstance(event, ToolFailed | ToolInDoubt):
                accepted = False
        return VerdictOut(
            run_id=run.run_id,
            accepted=accepted,
            outcome=machine.outcome(run.state),
            state=run.state,
            seq=run.seq,
            violations=violations,
            key=key,
            tool=tool,
            args=args,
            result=result,
            replayed=True,
        )

    @staticmethod
    def _machine_name(events: Sequence[JournalEvent]) -> str:
        return str(events[0].machine)  # type: ignore[union-attr]

    def _note_reconcile(self, out: VerdictOut) -> None:
        if out.reconcile is not None:
            self._reconciling.add((out.run_id, out.reconcile.key))

    async def verify_batch(
        self, body: VerifyIn, principal: PrincipalLike | None = None, trace: str | None = None
    ) -> VerifyOut:
        """Verify many proposals at once, journaled in one group commit (see
        :meth:`verify_many`)."""
        items = body.items
        return VerifyOut(
            verdicts=await self.verify_many(
                [item.run_id for item in items], items, principal, trace
            )
        )

    async def verify_many(
        self,
        run_ids: Sequence[str],
        bodies: Sequence[ProposalIn | VerifyItem],
        principal: PrincipalLike | None = None,
        trace: str | None = None,
    ) -> list[VerdictOut]:
        """Verify the proposal ``bodies[i]`` for the run ``run_ids[i]``, for every i, in
        one group commit; one verdict each, in order (an item that got none has
        ``problem`` set).

        Each proposal of a live external run is decided at once in this task
        (``supervisor.external.decide_many``: no task and no wake-up per item), then one
        ``sync`` waits until the write that holds all their events is durable; only then
        is any verdict answered. The rest (a recorded answer to repeat, a stale seq to
        check against the journal, a run not live here) goes the way of a single proposal,
        concurrently, in the same commit where it can.
        """
        count = len(bodies)
        self._admit(count)
        try:
            verdicts: list[VerdictOut | None] = [None] * count

            async def one(index: int) -> None:
                run_id, item = run_ids[index], bodies[index]
                try:
                    self._allow(principal, ("agent",), await self._machine_of(run_id))
                    verdicts[index] = await self._propose(
                        run_id,
                        item.proposal,
                        item.expected_seq,
                        item.usage,
                        item.model,
                        trace,
                        told=True,
                    )
                except GatewayError as exc:
                    verdicts[index] = _item_problem(run_id, exc)

            # NOTE: one loop, no call of the service's own per item: per proposal this is
            # most of what the gateway itself costs a batch (see _take_proposals).
            answers = self._answers
            decided: list[tuple[int, Verdict, _Answer | None, int]] = []
            later: list[int] = []
            tracing = self.supervisor.tracing
            if tracing is not None:  # each verdict under the request's span (see request)
                for run_id in run_ids:
                    tracing.request(run_id, trace)
            try:
                _take_proposals(
                    self.supervisor.external.get,
                    answers,
                    run_ids if type(run_ids) is list else list(run_ids),
                    bodies if type(bodies) is list else list(bodies),
                    principal,
                    self.supervisor.external.decide_many,
                    self._refused,
                    verdicts,
                    later,
                    decided,
                )
            except BaseException:  # the batch fails whole: no answer is left pending
                self._fail_pending(decided, run_ids)
                raise
            while len(answers) > ANSWERS_KEPT:
                answers.popitem(last=False)
            if later:
                async with trio.open_nursery() as nursery:
                    for index in later:
                        nursery.start_soon(one, index)
                    if decided:
                        await self._answer_decided(decided, run_ids, verdicts)
            elif decided:
                await self._answer_decided(decided, run_ids, verdicts)
        finally:
            self.waiting -= count
        return [v for v in verdicts if v is not None]

    def _refused(
        self,
        taken: list[tuple[int, str, _Answer | None, int]],
        at: int,
        error: Exception,
        verdicts: list[VerdictOut | None],
    ) -> None:
        """``taken[at]`` (its index, run, answer and seq before) was refused with ``error``:
        its problem goes to ``verdicts``, its answer fails."""
        index, run_id, answer, _ = taken[at]
        try:
            problem = _translate(error)
        except BaseException:  # an error no problem says: no answer is left pending
            for _, other, pending, _ in taken:
                if pending is not None and not pending.settled:
                    self._fail(other, pending, _interrupted())
            raise
        self._fail(run_id, answer, problem)
        verdicts[index] = _item_problem(run_id, problem)

    async def _answer_decided(
        self,
        decided: list[tuple[int, Verdict, _Answer | None, int]],
        run_ids: Sequence[str],
        verdicts: list[VerdictOut | None],
    ) -> None:
        """Wait until the decided items are durable, then settle and answer each."""
        try:
            await self._settle_decided(decided, run_ids, verdicts)
        except BaseException:  # cancelled: the answers not given are never left pending
            self._fail_pending(decided, run_ids)
            raise

    def _fail_pending(
        self, decided: list[tuple[int, Verdict, _Answer | None, int]], run_ids: Sequence[str]
    ) -> None:
        """The answers of ``decided`` not given yet fail (a retry is decided afresh)."""
        for index, _, answer, _ in decided:
            if answer is not None and not answer.settled:
                self._fail(run_ids[index], answer, _interrupted())

    async def _settle_decided(
        self,
        decided: list[tuple[int, Verdict, _Answer | None, int]],
        run_ids: Sequence[str],
        verdicts: list[VerdictOut | None],
    ) -> None:
        external = self.supervisor.external
        try:
            # Answered after the write that holds every event decided before it; refused
            # (an InterlockError) only after that write, if its run cannot take a Sync.
            await external.sync(decided[0][1].run_id)
        except (StoreError, trio.ClosedResourceError) as exc:
            for index, verdict, answer, before in decided:
                error = await self._write_failed(verdict.run_id, before, exc)
                self._fail(run_ids[index], answer, error)
                verdicts[index] = _item_problem(run_ids[index], error)
            return
        except InterlockError:
            pass
        get = external.get
        settle = external.settle
        count = len(decided)
        at = 0
        while True:
            # NOTE: one pass (see _settle_from); it stops at a verdict that leads into a
            # step state (rare), whose steps run here
            at = _settle_from(
                decided,
                at,
                verdicts,
                get,
                settle,
                self._step_states,
                self._steps_of,
                self._reconciling,
            )
            if at >= count:
                return
            index, verdict, answer, _ = decided[at]
            run_id = verdict.run_id
            try:
                verdict = await self._advance(run_id, verdict)
            except Exception as exc:
                error = _translate(exc)
                self._fail(run_id, answer, error)
                verdicts[index] = _item_problem(run_ids[index], error)
            else:
                _answered(index, verdict, answer, verdicts, self._reconciling)
            at += 1

    # -- results ------------------------------------------------------------------

    async def report(
        self, run_id: str, body: ResultIn, principal: PrincipalLike | None = None
    ) -> VerdictOut:
        """Journal how the accepted call with ``body.key`` went (or what its reconciliation
        found). A repeated report of a key gets the key's recorded outcome."""
        if body.error is not None and body.result is not None:
            raise invalid(
                "a result has either result (it succeeded) or error (it failed), not both; "
                "send {key, result} or {key, error, retryable?, applied?}"
            )
        self._allow(principal, ("agent",), await self._machine_of(run_id))
        sup = self.supervisor
        run = sup.external.get(run_id)
        if self.shared and (run is None or run.pending is None or run.pending.key != body.key):
            # Not held, or not awaiting this key: another instance may have advanced it.
            run = await self._held(run_id, check=True)
        if run is not None and not run.external:
            raise conflict(
                f"run {run_id!r} is hosted: the runtime executes its tools; results are for "
                "runs created with mode 'external'",
                "not-external",
            )
        if run is None or run.pending is None or run.pending.key != body.key:
            recorded = await self._replay_result(run_id, body.key, live=run is not None)
            if recorded is not None:
                return recorded
        self._admit()
        try:
            if (run_id, body.key) in self._reconciling:
                msg: Report | Reconciliation = Reconciliation(
                    run_id=run_id,
                    key=body.key,
                    applied=body.applied,
                    result=body.result,
                    error=body.error or "",
                    latency=body.latency,
                )
            else:
                msg = Report(
                    run_id=run_id,
                    key=body.key,
                    ok=body.error is None,
                    result=body.result,
                    error=body.error or "",
                    retryable=body.retryable,
                    attempts=body.attempts,
                    latency=body.latency,
                    applied=body.applied,
                )
            if run is None:
                verdict = await sup.external.submit(msg)  # refused: no such run is live here
            else:
                verdict = await self._submit(run, msg)
            verdict = await self._advance(run_id, verdict)
        except Exception as exc:
            raise _translate(exc) from None
        finally:
            self.waiting -= 1
        self._reconciling.discard((run_id, body.key))
        out = verdict_out(verdict)
        self._note_reconcile(out)
        return out

    async def _replay_result(self, run_id: str, key: str, *, live: bool) -> VerdictOut | None:
        """The recorded answer to the first report of ``key``, from the journal; None
        when the journal holds no outcome of it (yet)."""
        events = await self._load(run_id)
        _external(run_id, events, "results")
        for index, event in enumerate(events):
            if (
                isinstance(event, ToolCommitted | ToolFailed | ToolInDoubt)
                and event.key == key
                and not (isinstance(event, ToolCommitted) and event.reused)
            ):
                return self._recorded(events, index)
        if live:
            return None  # in flight, or not a key of this run: the decider answers
        if any(isinstance(e, IntentRecorded) and e.key == key for e in events):
            return None
        raise conflict(
            f"run {run_id!r} has no call with key {key!r}; report the key a verdict gave",
            "out-of-turn",
        )

    # -- escalations --------------------------------------------------------------

    async def escalations(self, principal: PrincipalLike | None = None) -> EscalationPage:
        """The escalation queue, oldest first."""
        try:
            records = await self.supervisor.store.escalations()
        except Exception as exc:
            raise _translate(exc) from None
        out: list[EscalationOut] = []
        for r in records:
            if principal is not None and not principal.allows("operator", r.machine):
                continue
            origin = await self._escalated_from(r.run_id, r.seq)
            machine = self.supervisor.machines.get(r.machine)
            out.append(
                EscalationOut(
                    id=r.run_id,
                    machine=r.machine,
                    reason=r.reason,
                    detail=r.detail,
                    seq=r.seq,
                    since=r.updated,
                    from_state=origin,
                    targets=resume_targets(machine, origin) if machine and origin else [],
                )
            )
        return EscalationPage(escalations=out)

    async def _escalated_from(self, run_id: str, seq: int) -> str:
        """The state the escalated run ``run_id`` (at ``seq``) escalated from: its journal's
        last escalated event, read from the tail (the run has not moved since). Empty if
        its journal is damaged: the queue is still listed, and ``GET /v1/escalations/{id}``
        reports the damage."""
        try:
            return escalated_from(
                await self._read_after(run_id, max(0, seq - 8))
            ) or escalated_from(await self.supervisor.store.load(run_id))
        except StoreDamaged:
            return ""
        except Exception as exc:
            raise _translate(exc) from None

    async def escalation(
        self, run_id: str, principal: PrincipalLike | None = None
    ) -> EscalationOut:
        """One escalated run, with where it may be resumed."""
        run = await self._fold(run_id)
        self._allow(principal, ("operator",), run.machine.name)
        try:
            _decider.escalated(run)
        except NotEscalated as exc:
            raise not_found(f"{exc}; GET /v1/escalations lists the queue") from None
        assert run.escalation is not None
        origin = run.escalation.state
        machine = run.machine
        targets = resume_targets(machine, origin)
        return EscalationOut(
            id=run.run_id,
            machine=machine.name,
            reason=run.escalation.reason,
            detail=run.escalation.detail,
            seq=run.seq,
            since=run.escalation.ts,
            from_state=origin,
            targets=targets,
        )

    async def resume(
        self, run_id: str, body: ResumeIn, principal: PrincipalLike | None = None
    ) -> RunOut:
        """Resume an escalated run; a repeat of the resume done gets the run as it is, and
        a resume after an abort, or elsewhere, a 409 (:func:`answer_again`)."""
        if body.payload is not None and body.to is not None:
            raise invalid("resume takes a payload (a corrected proposal) or to (a state), not both")
        self._allow(principal, ("operator",), await self._machine_of(run_id))
        run = await self._fold(run_id)
        before = run.seq
        if run.state != ESCALATE:
            await self._answer_again(run, "resume", body.to, body.payload)
            return self.run_out(run)
        sup = self.supervisor
        self._admit()
        try:
            if self.enqueues and not run.external:
                await self._write_operator(
                    run,
                    Resume(
                        run_id=run_id,
                        seq=run.seq,
                        by=body.by,
                        note=body.note,
                        to=body.to or "",
                        payload=body.payload or "",
                    ),
                )
            else:
                self._drop_stale(run_id, run)
                await sup.resume_escalated(
                    run_id, by=body.by, note=body.note, to=body.to, payload=body.payload
                )
                if run.external:  # the step states it resumed into, as for any request
                    await self._steps(run_id, None)
        except Exception as exc:
            raise await self._write_failed(run_id, before, exc) from None
        finally:
            self.waiting -= 1
        return self.run_out(await self._fold(run_id))

    def _drop_stale(self, run_id: str, current: RunState) -> None:
        """Drop this process's copy of the run if it is older than ``current`` (the run as
        the store holds it): the supervisor then folds it afresh."""
        held = self.supervisor.external.get(run_id)
        if held is not None and held is not current and held.seq < current.seq:
            self._drop(run_id, held)

    async def _write_operator(self, run: RunState, msg: Resume | Abort) -> None:
        """Decide an operator's request of a hosted run that no process here holds (a
        worker drives it), and write its events; a worker claims the resumed run.

        Raises:
          NotEscalated, IllegalResumeTarget, UnknownState: as the supervisor raises them.
          PayloadRejected: the gate rejected a resume's payload; nothing was written.
          StoreError: the events could not be written (another process wrote the run).
        """
        _decider.escalated(run)
        if isinstance(msg, Resume):
            msg = msgspec.structs.replace(msg, to=_decider.resume_target(run, msg.to))
        events: list[Event] = []
        verdict = _decider.decide(run, msg, self.supervisor.clock(), CircuitBoard(), events)
        if isinstance(msg, Resume) and msg.payload and verdict.violations:
            raise PayloadRejected(run.run_id, verdict.violations)
        await self.supervisor.store.append(events)

    async def _answer_again(
        self, run: RunState, action: Action, to: str | None = None, payload: str | None = None
    ) -> None:
        """Return if ``action`` on ``run``, out of the escalation queue, repeats what an
        operator did (a retry: answered with the run as it is); else raise the 409 that
        says what was done, by whom and when (:func:`answer_again`, as the supervisor and
        the command line decide it)."""
        outcome = run.machine.outcome(run.state)
        events = await self._load(run.run_id)
        try:
            answer_again(run.run_id, outcome, run.state, events, action, to=to, payload=payload)
        except NotEscalated as exc:
            raise _translate(exc) from None

    async def abort(
        self, run_id: str, body: AbortIn, principal: PrincipalLike | None = None
    ) -> RunOut:
        """End an escalated run in FAILED; a repeat gets the failed run, and an abort after
        a resume a 409 (:func:`answer_again`)."""
        self._allow(principal, ("operator",), await self._machine_of(run_id))
        run = await self._fold(run_id)
        before = run.seq
        if run.state != ESCALATE:
            await self._answer_again(run, "abort")
            return self.run_out(run)
        self._admit()
        try:
            if self.enqueues and not run.external:
                await self._write_operator(run, Abort(run_id=run_id, by=body.by, note=body.note))
            else:
                self._drop_stale(run_id, run)
                await self.supervisor.abort_escalated(run_id, by=body.by, note=body.note)
        except Exception as exc:
            raise await self._write_failed(run_id, before, exc) from None
        finally:
            self.waiting -= 1
        return self.run_out(await self._fold(run_id))

    # -- health -------------------------------------------------------------------

    async def ready(self) -> ReadyOut:
        """Whether the store answers, the journal can be written and keeps up.

        After a write of the journal failed (a full disk), and until one succeeds, each
        call probes it with a write (:meth:`Supervisor.journal_writable`): not ready while
        that fails, ready again once there is room."""
        store = self.supervisor.store
        detail = ""
        ok = True
        try:
            await store.get_run("interlock:readyz")
        except RunNotFound:
            pass
        except Exception as exc:
            ok, detail = False, f"the store does not answer: {type(exc).__name__}: {exc}"
        if ok and self.draining:
            ok, detail = False, "shutting down"
        if ok:
            failure = await self.supervisor.journal_writable()
            if failure is not None:
                ok, detail = False, f"the journal cannot be written: {failure}"
        if ok and self.waiting >= self.max_waiting:
            ok, detail = False, f"the journal is behind: {self.waiting} requests waiting"
        return ReadyOut(ready=ok, store=store.kind, waiting=self.waiting, detail=detail)


def _interrupted() -> GatewayError:
    """What a request waiting on another, identical one gets when that one was cancelled."""
    return unavailable(
        "the identical request this one waited for was interrupted before its answer; retry "
        "it (the journal holds whatever was decided)"
    )


def _external(run_id: str, events: Sequence[JournalEvent], what: str) -> None:
    if getattr(events[0], "external", False) is not True:
        raise conflict(
            f"run {run_id!r} is hosted: the runtime drives it; {what} are for runs created "
            "with mode 'external'",
            "not-external",
        )


def _item_problem(run_id: str, error: GatewayError) -> VerdictOut:
    """The entry of a batch item that got no verdict."""
    return VerdictOut(
        run_id=run_id, accepted=False, outcome="", state="", seq=-1, problem=error.problem()
    )


def _hosted(run_id: str) -> GatewayError:
    return conflict(
        f"run {run_id!r} is hosted: the runtime proposes for it; proposals are for "
        "runs created with mode 'external'",
        "not-external",
    )


def _encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"o:{offset}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> int:
    if not cursor:
        return 0
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, _, offset = text.partition(":")
        if kind != "o" or not offset.isdigit():
            raise ValueError(text)
        return int(offset)
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(
            400,
            "Bad Request",
            f"cursor {cursor!r} is not one this gateway gave; pass the cursor of the "
            "previous page unchanged, or none for the first page",
        ) from None


# -- a batch's intake and settling ----------------------------------------------------------


def _take_proposals(
    get: Callable[[str], RunState | None],
    answers: OrderedDict[str, _Answer],
    run_ids: list[str],
    bodies: list[ProposalIn] | list[VerifyItem],
    principal: PrincipalLike | None,
    submit: Callable[[list[Propose]], list[Verdict | Exception]],
    refused: Callable[..., None],
    verdicts: list[VerdictOut | None],
    later: list[int],
    decided: list[tuple[int, Verdict, _Answer | None, int]],
) -> None:
    """:meth:`GatewayService.verify_many`'s pass over a batch's items.

    Each proposal of a live external run (``get`` looks runs up: the supervisor's
    ``external.get``) at its seq is decided by ``submit`` (``external.decide_many``, which
    contains a failure to its request) together with the others (its verdict goes to
    ``decided``; a refusal to ``refused``, :meth:`GatewayService._refused`, which puts its
    problem in ``verdicts``), a run's second proposal of the batch only
    after its first (what it is checked against); its answer is remembered in
    ``answers`` first, for a retry to find. The index of every other item (a repeat of a
    recorded answer, a stale seq, a run not live here) goes to ``later``; an item the key
    may not propose for, or of a hosted run, gets its problem in ``verdicts``. The
    machines the key may propose for are checked once per machine, not once per item.
    """
    allowed: set[str] = set()
    msgs: list[Propose] = []
    taken: list[tuple[int, str, _Answer | None, int]] = []
    taking: set[str] = set()  # the runs of taken
    for index in range(len(bodies)):
        run_id = run_ids[index]
        item = bodies[index]
        run = get(run_id)
        if run is None:
            later.append(index)
            continue
        if run_id in taking:
            _decide_group(submit, refused, msgs, taken, decided, verdicts)
            msgs, taken = [], []
            taking.clear()
        answer: _Answer | None = None
        try:
            if principal is not None:
                machine = run.machine.name
                if machine not in allowed:
                    GatewayService._allow(principal, ("agent",), machine)
                    allowed.add(machine)
            if not run.external:
                raise _hosted(run_id)
        except GatewayError as exc:
            verdicts[index] = _item_problem(run_id, exc)
            continue
        expected = item.expected_seq
        if expected is not None:
            known = answers.get(run_id)
            if known is not None and known.seq == expected and known.proposal == item.proposal:
                later.append(index)  # a repeat: it gets the recorded answer
                continue
            if run.seq != expected:
                later.append(index)  # stale, or answered before: the journal says
                continue
            # _remember, inline; the caller drops the oldest answers
            answer = answers[run_id] = _Answer(expected, item.proposal)
            if known is not None:
                answers.move_to_end(run_id)
        usage = item.usage
        msgs.append(
            Propose(
                run_id=run_id,
                seq=expected or 0,
                raw=item.proposal,
                usage=_NO_USAGE if usage is None else _usage(usage),
                model=item.model,
            )
        )
        taken.append((index, run_id, answer, run.seq))
        taking.add(run_id)
    if msgs:
        _decide_group(submit, refused, msgs, taken, decided, verdicts)


def _decide_group(
    submit: Callable[[list[Propose]], list[Verdict | Exception]],
    refused: Callable[..., None],
    msgs: list[Propose],
    taken: list[tuple[int, str, _Answer | None, int]],
    decided: list[tuple[int, Verdict, _Answer | None, int]],
    verdicts: list[VerdictOut | None],
) -> None:
    results = submit(msgs)
    if len(results) != len(taken):  # pragma: no cover - a bug in the supervisor
        raise RuntimeError(f"{len(results)} verdicts for {len(taken)} proposals")
    for at, result in enumerate(results):
        if isinstance(result, Exception):
            refused(taken, at, result, verdicts)
        else:
            index, _, answer, before = taken[at]
            decided.append((index, result, answer, before))


def _settle_from(
    decided: list[tuple[int, Verdict, _Answer | None, int]],
    at: int,
    verdicts: list[VerdictOut | None],
    get: Callable[[str], RunState | None],
    settle: Callable[[str], None],
    steps: dict[str, frozenset[str]],
    steps_of: Callable[[Machine], frozenset[str]],
    reconciling: set[tuple[str, str]],
) -> int:
    """Answer the durable verdicts ``decided[at:]`` in order (see :func:`_answered`),
    settling each external run that ended; stop at the first that leads a run into a
    step state, whose steps the caller runs, and return its position (``len(decided)``
    once every one is answered).
    """
    last: Machine | None = None  # the machine whose step states are names
    names: frozenset[str] = frozenset()
    for position in range(at, len(decided)):
        index, verdict, answer, _ = decided[position]
        run_id = verdict.run_id
        run = get(run_id)
        if run is not None and run.closed and run.terminal:  # settle's first look
            settle(run_id)
            run = get(run_id)
        call = verdict.execute
        reconcile = verdict.reconcile
        # NOTE: _steps' first look, inlined: only a run that reached a step state (rare)
        # pays for the coroutine that runs its steps.
        if (
            run is not None
            and call is None
            and not reconcile
            and run.external
            and not run.closed
            and run.pending is None
        ):
            machine = run.machine
            if machine is not last:  # (a batch's runs are mostly of one machine)
                names = steps.get(machine.name)
                if names is None:
                    names = steps_of(machine)
                last = machine
            if run.state in names:
                return position
        # NOTE: _answered, inline, and verdict_out's answer to a move (most proposals'):
        # three Python frames a proposal fewer
        if (
            call is None
            and reconcile is None
            and not verdict.violations
            and verdict.result is None
            and not verdict.retry_in
        ):
            out = VerdictOut(
                run_id=run_id,
                accepted=verdict.accepted,
                outcome=verdict.outcome,
                state=verdict.state,
                seq=verdict.seq,
            )
            if answer is not None:
                answer.verdict = out
                # _Answer.settle, inline
                answer.settled = True
                event = answer.event
                if event is not None:
                    event.set()
            verdicts[index] = out
        else:
            _answered(index, verdict, answer, verdicts, reconciling)
    return len(decided)


def _answered(
    index: int,
    verdict: Verdict,
    answer: _Answer | None,
    verdicts: list[VerdictOut | None],
    reconciling: set[tuple[str, str]],
) -> None:
    """``verdict`` is durable: it is item ``index``'s answer, and ``answer``'s."""
    out = verdict_out(verdict)
    reconcile = out.reconcile
    if reconcile is not None:
        reconciling.add((verdict.run_id, reconcile.key))
    if answer is not None:
        answer.verdict = out
        answer.settle()
    verdicts[index] = out
