"""The supervisor: the registry of machines, the lifecycle of runs and the operator API.

Its parts live beside it: the decider (``_decider``) decides each request, the journal
writer (``_journal``) group-commits the events and answers after durability, the
watchdog (``_watchdog``) keeps the deadlines and timeouts, and each run's actor
(``_actor``) drives its run through the narrow port the supervisor offers it.
"""

from __future__ import annotations

import logging
import operator
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import trio

from ..core import _decider
from ..core._breakers import CircuitBoard
from ..core._escalation import Action, answer_again
from ..core._events import Event, describe_exception
from ..core._exceptions import (
    ConfigurationError,
    InterlockError,
    InternalError,
    LeaseLost,
    NoProvider,
    NotExternal,
    PayloadRejected,
    RunEnded,
    RunExists,
    RunLeased,
    RunNotFound,
    StoreError,
    UnknownMachine,
    UnknownState,
)
from ..core._machine import ESCALATE, Machine
from ..core._messages import (
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
from ..core._stats import RuntimeStats, SupervisorStatistics
from ..core._view import DECIDE_IMPLEMENTATION, RunState, RunView, fold
from ._external import ExternalRuns
from ._handle import RunHandle, RunResult, run_result
from ._journal import DURABLE, LAG, WRITE, GroupCommit
from ._leasing import DEFAULT_TTL, Leases, default_owner, is_leasing
from ._watchdog import Watchdog

_compiled_batch: Callable[..., tuple[list[Verdict | Exception], bool]] | None = None
if DECIDE_IMPLEMENTATION == "compiled":
    from ..core._decide import decide_many as _compiled_batch

if TYPE_CHECKING:
    from ..providers import Provider
    from ..stores import Store
    from ._actor import Driver
    from ._tracing import Tracing

Clock = Callable[[], float]

_log = logging.getLogger("interlock.supervisor")

_MACHINE_AND_STATE = operator.attrgetter("machine.name", "state")

#: How many released runs' results a supervisor keeps to answer late requests clearly.
ENDED_KEPT = 10_000
#: Seconds between two tries to drive again the runs dropped because the journal could
#: not be written (see Supervisor.readopting), doubled up to READOPT_MAX while it cannot.
READOPT_MIN = 0.05
READOPT_MAX = 2.0


class Supervisor:
    """The machines, the live runs and the operator API. Make one with :func:`open_supervisor`.

    Requests from run actors (or from callers driving external runs) queue up; the
    journal writer takes all that arrived since its last turn as one batch, has each
    decided (:mod:`interlock.core._decider`), appends the batch's events to the store in one
    write, and only then wakes the senders.
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
        owner: str | None = None,
        lease_ttl: float = DEFAULT_TTL,
    ) -> None:
        self.machines: dict[str, Machine] = {}
        for machine in machines:
            if machine.name in self.machines:
                raise ConfigurationError(
                    f"two machines are named {machine.name!r}; names must be unique"
                )
            self.machines[machine.name] = machine
        for machine in self.machines.values():
            chosen = provider.get(machine.name) if isinstance(provider, Mapping) else provider
            check = getattr(chosen, "check", None)
            if callable(check):  # a provider that offers machines as tools checks them now
                check(machine)
        self.store = store
        self.clock = clock
        self.stats = stats if stats is not None else RuntimeStats()
        self._circuits = CircuitBoard()
        self._runs: dict[str, RunState] = {}
        self.external = ExternalRuns(self, self._runs)
        """The port through which outside drivers (the gateway, a proxy) start, drive,
        settle and look up external runs: their only way to the run table."""
        self.handles: dict[str, RunHandle] = {}
        self._drivers: dict[str, Driver] = {}
        self._journal = GroupCommit(
            store, self.stats, self._decide, self._contain, self._forget, max_batch
        )
        self._journal.early = self._early
        if _compiled_batch is not None:
            # NOTE: a batch of proposals (the gateway's) decided with no Python frame per
            # proposal: the same loop, compiled (ext/_decide.pyx, decide_many)
            self._journal.decide_many = self._decide_many
        self._reported = ""  # the tool of the latest Report decided (see _early)
        self._actors: trio.Nursery | None = None
        self._provider = provider
        self._next_id = 0
        self._watchdog = Watchdog(self._drivers, lambda: len(self._runs))
        # Runs whose in-memory state was dropped because a batch holding their events
        # could not be written (see _forget): their later requests get that error.
        self._lost: dict[str, Exception] = {}
        # Runs this process drives (leased ones, on a store with leases) dropped because
        # a batch could not be written: adopted again once the store is back (readopting),
        # instead of being left unfinished (or their leases left to expire).
        self._unwritten: set[str] = set()
        self._unwritten_added: trio.Event | None = None  # set when one is (see _readopt_loop)
        self._adopting: set[str] = set()  # claimed, their journals being folded
        self.readopting = False
        """Drive again the runs dropped because the journal could not be written (a full
        disk, the database gone), folded afresh from the journal once it can be: a worker
        does (its claim loop readopts), and so does the gateway on a store with one writer
        (the supervisor's own loop). Off, such a run's handle has the StoreError, and the
        run stays unfinished in the journal for a resume."""
        # How the latest released runs ended, so a late request gets a clear answer; the
        # oldest are forgotten, so a process that runs millions of runs stays flat.
        self._ended: dict[str, RunResult] = {}
        self.leases: Leases | None = None
        """This supervisor's leases, on a store that has them (PostgreSQL); else None."""
        self.tracing: Tracing | None = None
        """The OpenTelemetry tracing of its runs (``Tracing.attach``); None: off."""
        self._draining = False
        self._no_drivers: trio.Event | None = None
        if is_leasing(store):
            self.leases = Leases(
                store,  # type: ignore[arg-type]
                owner if owner is not None else default_owner(),
                lease_ttl,
                is_external=self._is_external,
                lose=self._lose,
            )
            self._journal.fenced = self.leases.append
            self._journal.refusal = self._refusal

    def _fold(self, machine: Machine, events: Sequence[Event]) -> RunState:
        """Fold a run read back from its journal; with tracing on, the run's spans in
        this process join its trace (``run_started.trace``)."""
        run = fold(machine, events)
        if self.tracing is not None and events:
            first = events[0]
            trace = getattr(first, "trace", "")
            self.tracing.resumed(run.run_id, machine.name, trace if isinstance(trace, str) else "")
        return run

    @property
    def on_written(self) -> list[Callable[[Sequence[Event]], object]]:
        """Callbacks called after each journal batch is durable, with the events written
        (a fenced batch's refused runs excluded)."""
        return self._journal.on_written

    def _holds(self, run_id: str) -> bool:
        """Whether this supervisor still wants ``run_id``'s lease (the heartbeat asks)."""
        return run_id in self._runs or run_id in self._unwritten or run_id in self._adopting

    def _is_external(self, run_id: str) -> bool:
        run = self._runs.get(run_id)
        return run is not None and run.external

    def _refusal(self, run_id: str) -> Exception:
        return self._lost.get(run_id) or StoreError(f"run {run_id!r} was refused by the store")

    def _lose(self, errors: Mapping[str, Exception]) -> None:
        """Drop runs the store refused (another process took their leases, or advanced an
        external run): their requests get ``errors``, and their actors stop (a call in
        flight is cut; its outcome is the new owner's to reconcile)."""
        for run_id, error in errors.items():
            self._runs.pop(run_id, None)
            self._lost[run_id] = error
            if len(self._lost) > ENDED_KEPT:
                del self._lost[next(iter(self._lost))]
            driver = self._drivers.get(run_id)
            if driver is not None:
                driver.cancel()
            if isinstance(error, LeaseLost):
                self.stats.leases_lost += 1

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
            return RunView(self._runs[run_id])
        except KeyError:
            raise RunNotFound(run_id) from None

    def live_states(self) -> Counter[tuple[str, str]]:
        """How many live runs are in each state, by ``(machine, state)``."""
        # NOTE: one pass in C: a metrics scrape calls this and must stay short at 100k runs.
        return Counter(map(_MACHINE_AND_STATE, list(self._runs.values())))

    def __len__(self) -> int:
        """How many runs are live (in memory) in this supervisor."""
        return len(self._runs)

    def circuit_state(self, tool: str) -> str:
        """The state of ``tool``'s circuit: ``closed``, ``open`` or ``half_open``."""
        return self._circuits.state(tool)

    def circuit_states(self) -> dict[str, str]:
        """The state of every circuit that has seen a call, by tool."""
        return self._circuits.states()

    def statistics(self) -> SupervisorStatistics:
        """A snapshot of the supervisor's counters."""
        return self.stats.snapshot(len(self._runs))

    # -- requests ---------------------------------------------------------------

    # NOTE: request and propose hand back the writer's coroutine rather than await it in
    # one of their own: a frame less per run waiting for a flush, which at 100,000 runs
    # is most of them.
    def request(self, msg: Request) -> Coroutine[Any, Any, Verdict]:
        """Submit one request and wait for its verdict (sent after the journal flush).

        Raises:
          ProtocolError: the request is stale or out of order (a leaf says which).
          RunNotFound: it names no live run.
          StoreError: the batch holding the request's events could not be written.
          trio.ClosedResourceError: the supervisor is shutting down.
        """
        return self._journal.request(msg)

    def submit_nowait(self, msg: Request) -> Verdict:
        """Decide a request now, in the caller's task, without waiting for the journal.

        Its events are written with the next group commit, before any later verdict is
        sent; nothing is acknowledged as durable. The run actor uses this to report a
        tool's outcome and go on at once. Await :meth:`request` with a :class:`Sync` to
        wait until it is durable.

        Raises:
          ProtocolError: the request is stale or out of order (a leaf says which).
          RunNotFound: it names no live run.
          trio.ClosedResourceError: the supervisor is shutting down.
        """
        return self._journal.submit_nowait(msg)

    def submit_many_nowait(self, msgs: Sequence[Request]) -> list[Verdict | Exception]:
        """:meth:`submit_nowait` for many requests, decided in order in the caller's task
        with the writer woken once, after the last: for each request its verdict, or the
        error it was refused with (what :meth:`submit_nowait` would raise: a
        :class:`ProtocolError` for a stale or out-of-order request, the
        :class:`InternalError` that ends the run whose request met a bug, the
        :class:`StoreError` of a write done in this call that failed). The gateway's
        batches decide their proposals with it.

        Raises:
          trio.ClosedResourceError: the supervisor is shutting down (nothing was decided).
        """
        return self._journal.submit_many_nowait(msgs)

    def propose(self, msg: Propose, *, lagging: bool = False) -> Coroutine[Any, Any, Verdict]:
        """Decide a run actor's proposal in its task; the verdict comes at once where
        acting on it before its events are durable is harmless (see :meth:`_early`),
        else after the journal flush, as from :meth:`request`.

        Raises:
          ProtocolError: the proposal is stale or out of order (a leaf says which).
          RunNotFound: it names no live run.
          StoreError: the batch holding the proposal's events could not be written.
          trio.ClosedResourceError: the supervisor is shutting down.
        """
        return self._journal.propose(msg, lagging=lagging)

    @property
    def max_batch(self) -> int:
        """The most requests decided per journal write."""
        return self._journal.max_batch

    # -- the actor's port (see _actor.ActorPort) ----------------------------------

    def traceparent(self, run_id: str) -> str:
        """:meth:`ActorPort.traceparent`."""
        return self.tracing.traceparent(run_id) if self.tracing is not None else ""

    def arm_deadline(self, driver: Driver) -> None:
        """Have the watchdog tell ``driver`` when its run's deadline passes.

        One heap entry per run instead of a cancel scope per model call: the actor cuts
        only its wait for the model (see run_actor).
        """
        run = self._runs[driver.run_id]
        # The clock may be any clock; the watchdog sleeps on trio's. 1 ms of margin, so
        # the decider's own check (on self.clock) agrees that it passed.
        remaining = run.started_ts + run.machine.budgets.deadline - self.clock()
        self._watchdog.arm_deadline(driver, remaining + 1e-3)

    def arm_timeout(self, driver: Driver, seconds: float) -> int:
        """Have the watchdog cut ``driver``'s call in flight after ``seconds``; see
        :meth:`Watchdog.arm_timeout`."""
        return self._watchdog.arm_timeout(driver, seconds)

    def lease_guard(self, run_id: str) -> Leases | None:
        """The guard of ``run_id``'s lease, if this supervisor leases it; see
        :meth:`ActorPort.lease_guard`."""
        return self.leases.guard(run_id) if self.leases is not None else None

    def call_args(self, run_id: str, call: ToolCall) -> Any:
        """The args to run ``call`` with: those the guards saw, if the call was decided in
        this process, else validated again from the journal's (recovery)."""
        run = self._run(run_id)
        pending = run.pending
        if pending is not None and pending.key == call.key and run.validated is not None:
            return run.validated
        return run.machine.tool_by_name[call.tool].validator.from_builtins(call.args)

    # -- deciding -----------------------------------------------------------------

    def _decide(self, msg: Request, events: list[Event]) -> Verdict:
        """Decide one request of the batch: the decider's verdict, its events counted."""
        mark = len(events)
        now = self.clock()
        if type(msg) is Start:
            run, verdict = self._start(msg, now, events)
        elif type(msg) is Propose:
            # NOTE: the request of nearly every step: the run, the decide path in use and
            # the machine's latency histogram looked up here, a Python frame each fewer
            run = self._runs.get(msg.run_id)
            if run is None:
                run = self._run(msg.run_id)  # raises what is wrong
            started = time.perf_counter()
            verdict = _decider.propose(run, msg, now, self._circuits, events)
            seconds = time.perf_counter() - started
            latency = self.stats.verify_latency.get(run.machine.name)
            if latency is None:
                latency = self.stats.histogram(self.stats.verify_latency, run.machine.name)
            latency.record(seconds)
        else:
            if type(msg) is Cancel and msg.run_id not in self._runs:
                ended = self._ended.get(msg.run_id)
                if ended is not None:  # already finished and released: nothing to cancel
                    return Verdict(
                        run_id=ended.run_id,
                        seq=ended.seq,
                        accepted=True,
                        state=ended.state,
                        outcome=ended.outcome,
                    )
            run = self._run(msg.run_id)
            if type(msg) is Report:  # the tool reported on, for _early (called next)
                pending = run.pending
                self._reported = pending.tool if pending is not None else ""
            verdict = _decider.decide(run, msg, now, self._circuits, events)
        if len(events) > mark:
            self.stats.count(run.machine, msg, events, mark)
        return verdict

    def _decide_many(
        self, msgs: list[Request], events: list[Event]
    ) -> tuple[list[Verdict | Exception], bool]:
        """A batch decided by the compiled loop (``_decide.decide_many``): what it needs of
        this supervisor given to it explicitly, the decide path of a proposal read per
        batch (``_decider.propose``, replaceable)."""
        assert _compiled_batch is not None
        return _compiled_batch(
            msgs,
            events,
            self._runs,
            self._circuits,
            self.clock,
            self.stats,
            _decider.propose,
            self._decide,
            self._early,
            self._contain,
            self._run,
        )

    def _early(self, msg: Request, verdict: Verdict) -> int:
        """How ``verdict`` goes out (see :attr:`GroupCommit.early`): :data:`DURABLE`
        (sent once its events are durable), :data:`WRITE` (sent at once, written now) or
        :data:`LAG` (sent at once, written with the run's next flush).

        Only a run this process drives gets a verdict before its events are durable (its
        actor acts on it and journals what follows here; an external run's caller is
        answered once durable), and only where a crash that loses them is harmless: the
        run refolds to before the proposal and asks the model again. So a proposal that
        moves the run on, is rejected, or waits out a provider failure (the next model
        call is its only effect: LAG, its record shares the next call's flush), or calls
        a read-only tool (no effect anywhere: WRITE). Not a call of any other tool: an
        idempotent tool is safe to repeat with the same key and args, but the model asked
        again after a crash may propose another call, under another key once a rejection
        or a provider failure moved the seq on; so its intent is durable before it runs,
        as one that is not idempotent. Nor a run end or an escalation, which the caller
        and the operators see. An external run's driver is answered once durable unless
        it decides without waiting (:meth:`ExternalRuns.decide_many`), and then it waits
        (:meth:`ExternalRuns.sync`) where it must: a read-only call's intent is LAG.

        The commit of a call that is safe to repeat or can reconcile is LAG too: a crash
        that loses it re-runs the call with its key, or reconciles it. That of a call that
        is neither is written at once, so the window in which a crash leaves it in doubt
        (escalated to a human) stays one flush.
        """
        kind = type(msg)
        if kind is Propose:
            if verdict.outcome != "running":
                return DURABLE
            run = self._runs.get(msg.run_id)
            if run is None:
                return DURABLE
            call = verdict.execute
            if run.external:
                # A driver deciding without waiting (decide_many) syncs where it must; a
                # read-only call's intent needs no write of its own before the call is
                # made: it goes with the run's next flush (its commit's, usually).
                read_only = call is not None and run.machine.tool_by_name[call.tool].read_only
                return LAG if read_only else DURABLE
            if call is None:
                return LAG
            return WRITE if run.machine.tool_by_name[call.tool].read_only else DURABLE
        if kind is Report and verdict.outcome == "running":
            run = self._runs.get(msg.run_id)
            if run is not None and not run.external:
                tool = run.machine.tool_by_name.get(self._reported)
                if tool is not None and (tool.safe_to_repeat or tool.reconcile is not None):
                    return LAG
        return WRITE

    def _start(self, msg: Start, now: float, events: list[Event]) -> tuple[RunState, Verdict]:
        machine = self.machine(msg.machine)
        if msg.run_id in self._runs:
            raise RunExists(f"run {msg.run_id!r} already exists; run ids must be unique")
        run, verdict = _decider.start(machine, msg, now, events)
        self._runs[msg.run_id] = run
        return run, verdict

    def _run(self, run_id: str) -> RunState:
        run = self._runs.get(run_id)
        if run is None:
            lost = self._lost.get(run_id)
            if lost is not None:
                raise lost
            ended = self._ended.get(run_id)
            if ended is not None:
                raise RunEnded(
                    f"run {run_id!r} is {ended.outcome} in state {ended.state!r}; "
                    "it takes no more proposals"
                )
            raise RunNotFound(run_id)
        return run

    def _forget(self, run_ids: set[str], error: StoreError) -> None:
        # NOTE: the in-memory state ran ahead of a batch that was never written; drop
        # it so nothing acts on decisions the journal does not hold. Recovery refolds:
        # an external run on its next request (see unwritten), a run driven here by
        # readopt (readopting).
        for run_id in run_ids:
            run = self._runs.pop(run_id, None)
            self._lost[run_id] = error
            if len(self._lost) > ENDED_KEPT:
                del self._lost[next(iter(self._lost))]
            if self.leases is not None and run_id in self.leases:
                if self.readopting:
                    self._unwritten.add(run_id)
                else:
                    self.leases.forget(run_id)
            elif self.leases is None and self.readopting and run is not None and not run.external:
                self._readopt_later(run_id)

    def _readopt_later(self, run_id: str) -> None:
        """Have :meth:`readopt` drive ``run_id`` again (see :attr:`readopting`)."""
        self._unwritten.add(run_id)
        if self._unwritten_added is not None:
            self._unwritten_added.set()

    def unwritten(self, run_id: str) -> bool:
        """Whether ``run_id`` is not live here because a batch holding its events could not
        be written (on a store without leases): the journal holds the run as it was before
        that batch, and its next request folds it from there (:meth:`submit`)."""
        return (
            self.leases is None
            and run_id not in self._runs
            and isinstance(self._lost.get(run_id), StoreError)
        )

    async def load_unwritten(self, run_id: str) -> RunState | None:
        """Fold again from the journal, and hold live, the external run ``run_id`` if it
        was dropped because a batch could not be written (:meth:`unwritten`); return it
        (None if it is not such a run, or the journal holds no unfinished external run).

        Raises:
          StoreError: the journal could not be read.
        """
        run = self._runs.get(run_id)
        if run is not None or not self.unwritten(run_id):
            return run
        return await self._load_external(run_id)

    async def journal_writable(self) -> StoreError | None:
        """None if the journal can be written: its last write succeeded or, if it failed
        (a full disk), a probe write (:meth:`Store.probe_write`) now succeeds; else the
        error that says why it cannot."""
        failed = self._journal.failed
        if failed is None:
            return None
        try:
            await self.store.probe_write()
        except StoreError as exc:
            return exc
        except OSError as exc:
            return StoreError(f"journal write probe failed: {exc}")
        if self._journal.failed is failed:  # no write failed meanwhile
            self._journal.failed = None
        return None

    def _contain(self, msg: Request, exc: BaseException) -> InternalError:
        """A bug met while deciding ``msg``: it ends that run only, never the supervisor.

        The events decided for the request are dropped (the caller truncates the batch),
        and so is the run's in-memory state, which may hold half of them; the journal
        holds only what came before, and a resume refolds from there.
        """
        error = InternalError(
            f"run {msg.run_id!r} was stopped by a bug in interlock while deciding a "
            f"{type(msg).__name__} request: {describe_exception(exc)}; its journal is "
            "intact up to the previous batch, and `interlock resume` continues it"
        )
        error.__cause__ = exc
        self._runs.pop(msg.run_id, None)
        self._lost[msg.run_id] = error
        return error

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
        trace: str | None = None,
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
          trace: the W3C ``traceparent`` of the request that starts the run: with tracing
            on, the run's spans continue that trace.

        Raises:
          UnknownMachine: ``machine`` names no registered machine.
          InvalidInputs: the inputs break the machine's ``inputs`` schema, or cannot be
            journaled.
          NoProvider: the machine has worker states and no provider was given.
          RunExists: ``run_id`` is already in use.
          trio.ClosedResourceError: the supervisor is shutting down.
        """
        spec = self.machine(machine)
        payload = spec.check_inputs(inputs)
        chosen = provider or self.provider_for(machine)
        if not external and chosen is None and spec.needs_provider:
            raise NoProvider(
                f"machine {machine!r} has worker states but no provider; pass provider= to "
                "open_supervisor() or start_run()"
            )
        if self._actors is None:
            raise trio.ClosedResourceError("supervisor is not running")
        run_id = run_id or self._new_run_id()
        if run_id in self._runs:
            raise RunExists(f"run {run_id!r} already exists; run ids must be unique")
        first = ""
        if self.tracing is not None:
            first = self.tracing.begin(run_id, machine, trace)
        verdict = await self.request(
            Start(run_id=run_id, machine=machine, inputs=payload, external=external, trace=first)
        )
        handle = RunHandle(run_id, machine, external=external)
        self.handles[run_id] = handle
        if not external:
            self._spawn(handle, verdict, chosen)
        return handle

    async def submit(self, msg: Propose | Report | Reconciliation | Escalate) -> Verdict:
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
          NotExternal: the run is driven by its actor.
          StaleSeq: the request's ``seq`` is not the run's; re-read it and send again.
          OutOfTurn: the run waits for another request (the pending call's outcome).
          RunEnded: the run has ended.
          RunLeased: another process holds the run's lease.
          RunNotFound: no such run is live here.
          StoreError: the batch holding the request's events could not be written.
        """
        run = self._runs.get(msg.run_id)
        if run is None and self.leases is not None and msg.run_id not in self._ended:
            # Several processes may serve one journal's external runs (gateways in front
            # of one PostgreSQL): load it from the journal; the seq check orders writers.
            run = await self._load_external(msg.run_id)
        elif run is None and self.unwritten(msg.run_id):
            # Dropped when a batch holding its events could not be written: the journal
            # holds it as it was before, where its caller's retry takes it on.
            run = await self._load_external(msg.run_id)
        if run is not None and not run.external:
            raise NotExternal(
                f"run {msg.run_id!r} is driven by its actor; submit is for runs started with "
                "start_run(..., external=True)"
            )
        verdict = await self.request(msg)
        self.settle_external(msg.run_id)
        return verdict

    def settle_external(self, run_id: str) -> None:
        """If the external run ``run_id`` has ended (its last events durable), settle it:
        its handle's :meth:`RunHandle.wait` returns, and it leaves the registry.

        :meth:`submit` does this itself; a caller that decides requests with
        :meth:`submit_nowait` (the gateway's batches) calls it once their batch is durable.
        """
        run = self._runs.get(run_id)
        if run is not None and run.terminal and run.closed:
            handle = self.handles.get(run_id)
            if handle is not None and not handle.done:
                handle._finish(self.result_of(run_id))
            self.release(run_id)

    def _spawn(self, handle: RunHandle, verdict: Verdict, provider: Provider | None) -> None:
        from ._actor import Driver

        assert self._actors is not None
        driver = self._drivers[handle.run_id] = Driver(handle.run_id)
        driver.draining = self._draining
        self._actors.start_soon(
            self._drive, handle, driver, verdict, provider, name=f"run:{handle.run_id}"
        )

    async def _drive(
        self, handle: RunHandle, driver: Driver, verdict: Verdict, provider: Provider | None
    ) -> None:
        """Run the actor of ``handle``'s run, then settle the handle however it stopped.

        A bug in interlock met by the actor ends this run with an InternalError, never
        its neighbours.
        """
        from ._actor import _passes_through, run_actor

        run_id = handle.run_id
        error: Exception | None = None
        actor = run_actor(self, driver, verdict, provider)
        del verdict, provider  # the actor's now: not held by this frame for the run's life
        try:
            await actor
        except InterlockError as exc:
            error = exc
            if (
                isinstance(exc, StoreError)
                and not isinstance(exc, LeaseLost)
                and self.readopting
                and (self.leases is None or run_id in self.leases)
                and self._runs.pop(run_id, None) is not None
            ):
                self._readopt_later(run_id)  # the store failed under it: adopted again later
        except BaseException as exc:
            if _passes_through(exc):
                raise  # a cancellation, Ctrl-C or exit: the supervisor's own end
            error = InternalError(
                f"run {run_id!r} was stopped by a bug in interlock: {describe_exception(exc)}; "
                "its journal is intact, and `interlock resume` continues it"
            )
            error.__cause__ = exc
            self._runs.pop(run_id, None)
        finally:
            driver.done = True
            if self._drivers.get(run_id) is driver:
                del self._drivers[run_id]
            if not self._drivers and self._no_drivers is not None:
                self._no_drivers.set()
            self._settle(handle, error)

    def _settle(self, handle: RunHandle, error: Exception | None) -> None:
        # NOTE: an operator may end the run (cancel_run) while its actor waits; then the
        # actor's own request is refused, but the run did end, with a journaled result.
        run = self._runs.get(handle.run_id)
        if run is not None and run.terminal and run.closed:
            handle._finish(self.result_of(handle.run_id))
            self.release(handle.run_id)
        elif error is not None:
            handle._finish(None, error)
        elif handle.run_id in self._lost and not handle.done:
            handle._finish(None, self._lost[handle.run_id])
        elif self._draining and run is not None and not handle.done:
            handle._finish(
                None,
                InterlockError(
                    f"run {handle.run_id!r} was left unfinished in state {run.state!r} by a "
                    "drain, at a step boundary; whoever claims or resumes it next continues it"
                ),
            )
        elif not handle.done:
            handle._finish(
                None, InterlockError(f"run {handle.run_id!r} was cancelled before it finished")
            )

    def result_of(self, run_id: str) -> RunResult:
        return run_result(self._run(run_id))

    def release(self, run_id: str) -> None:
        """Drop a finished run's in-memory state and its handle (its journal stays in the
        store; whoever holds the handle keeps its result). How it ended is kept for the
        latest :data:`ENDED_KEPT` runs, so a late request gets a clear answer."""
        run = self._runs.pop(run_id, None)
        if self.leases is not None:
            if run is not None and run.state == ESCALATE and run.escalation is not None:
                self.leases.end(run_id)  # released if this process exits before it expires
            else:
                self.leases.forget(run_id)
        driver = self._drivers.pop(run_id, None)
        if driver is not None:
            driver.done = True
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

        On a store with leases (PostgreSQL), only the runs nobody holds are resumed: each
        is claimed first (see :meth:`claim_runs`), so two processes resuming one journal
        split its runs; the runs another live process leases are its own, and a dead
        process's become claimable when its leases expire. External runs are then not
        loaded here: :meth:`submit` loads one on its first request.

        Raises:
          JournalCorrupt, IndexDamaged: a journal or the runs index is damaged; no run
            was resumed (``interlock check`` lists the damage).
          NoProvider: a run to resume needs a model and there is no provider for its
            machine; no run was resumed.
        """
        if self.leases is not None:
            # Several processes share this journal: take only the runs nobody holds (a
            # dead process's, once its leases expire), in claims of a thousand.
            handles: list[RunHandle] = []
            while True:
                claimed = await self.leases.claim(1000)
                if not claimed:
                    return handles
                self.stats.leases_claimed += len(claimed)
                handles += await self._adopt([lease.run_id for lease in claimed], provider)
        # Fold every journal before resuming any run: a damaged one (JournalCorrupt,
        # IndexDamaged) then stops the resume before it has started anything.
        folded = []
        for record in await self.store.unfinished():
            if record.run_id in self._runs:
                continue
            machine = self.machines.get(record.machine)
            if machine is None:
                continue
            folded.append(self._fold(machine, await self.store.load(record.run_id)))
        for run in folded:
            name = run.machine.name
            if not run.terminal and run.state not in run.machine.states:
                raise UnknownState(run.run_id, run.state, name, list(run.machine.states), "is in")
            if (
                not run.external
                and (provider or self.provider_for(name)) is None
                and run.machine.needs_provider
            ):
                raise NoProvider(
                    f"machine {name!r} has worker states but no provider, so run "
                    f"{run.run_id!r} cannot be resumed; pass provider= to open_supervisor() "
                    "or resume_unfinished()"
                )
        return await self._recover(folded, provider)

    async def _recover(self, folded: list[RunState], provider: Provider | None) -> list[RunHandle]:
        """Register folded runs, decide each one's recovery, make them durable with one
        flush, and start their actors."""
        if not folded:
            return []
        # Decide every recovery now and make them durable with one flush, not one each.
        verdicts: list[Verdict | None] = []
        for run in folded:
            self._runs[run.run_id] = run
            if run.external and run.pending is not None:
                # Its caller ran the call and knows how it went: it reports, with the key.
                verdicts.append(None)
                continue
            verdicts.append(self.submit_nowait(Recover(run_id=run.run_id)))
        with suppress(LeaseLost):  # that run alone was refused (another process took it)
            await self.request(Sync(run_id=folded[-1].run_id))
        handles = []
        for run, verdict in zip(folded, verdicts, strict=True):
            if run.run_id not in self._runs:
                continue  # its lease was lost before the recovery was written
            handle = RunHandle(run.run_id, run.machine.name, external=run.external)
            self.handles[run.run_id] = handle
            if verdict is not None and not run.external:  # an external run waits for its caller
                self._spawn(handle, verdict, provider or self.provider_for(run.machine.name))
            handles.append(handle)
        return handles

    # -- leases (a store that has them: PostgreSQL) --------------------------------

    def _require_leases(self, what: str) -> Leases:
        if self.leases is None:
            raise ConfigurationError(
                f"{what} needs a store with leases (PostgreSQL, schema 3, opened for writing); "
                f"this supervisor's store is {self.store!r}"
            )
        return self.leases

    async def claim_runs(self, limit: int, *, provider: Provider | None = None) -> list[RunHandle]:
        """Claim up to ``limit`` claimable runs from the store and drive them (a worker's
        claim): each is folded from its journal and recovered as :meth:`resume_unfinished`
        recovers a run (a call in doubt is re-executed, reconciled or escalated).

        A claimed run this supervisor cannot drive (its machine is not registered here,
        its state is unknown, it has no provider, its journal is damaged) is logged and
        left: its lease expires and another process may claim it.

        Raises:
          InterlockError: the store has no leases.
          StoreError: the store failed.
        """
        leases = self._require_leases("claim_runs")
        claimed = await leases.claim(limit)
        self.stats.leases_claimed += len(claimed)
        return await self._adopt([lease.run_id for lease in claimed], provider)

    async def readopt(self, *, provider: Provider | None = None) -> list[RunHandle]:
        """Drive again the runs (whose leases this supervisor still holds, on a store with
        leases) whose in-memory state was dropped because a batch could not be written
        (the database went away, the disk was full): folded afresh from the journal, which
        holds what was durable, and recovered as after a crash. A run whose actor has not
        stopped yet (it learns of the failure at its next request) waits for the next call."""
        leases = self.leases
        ids = []
        waiting = set()
        for run_id in self._unwritten:
            if run_id in self._drivers:
                waiting.add(run_id)  # never a second actor beside the one still running
            elif leases is None or run_id in leases:
                ids.append(run_id)
        self._unwritten = waiting
        return await self._adopt(ids, provider)

    async def _readopt_loop(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """On a store without leases (one writer: SQLite), :meth:`readopt` the runs dropped
        unwritten (readopting), once the journal can be written again, retrying with
        backoff meanwhile. (A worker's claim loop readopts on a store with leases.)"""
        task_status.started()
        delay = READOPT_MIN
        while True:
            if not self._unwritten:
                delay = READOPT_MIN
                self._unwritten_added = trio.Event()
                await self._unwritten_added.wait()
            await trio.sleep(delay)
            delay = min(delay * 2, READOPT_MAX)
            if self._actors is None or self._journal.closed:
                return  # closing: the runs stay unfinished in the journal, for a resume
            if await self.journal_writable() is not None:
                continue
            try:
                await self.readopt()
            except InterlockError as exc:  # the runs not adopted stay, for the next try
                _log.warning("runs dropped unwritten not driven again yet: %s", exc)
            except trio.ClosedResourceError:
                return

    async def _adopt(self, run_ids: Sequence[str], provider: Provider | None) -> list[RunHandle]:
        self._adopting.update(run_ids)
        try:
            return await self._adopt_held(run_ids, provider)
        except StoreError:
            # The store failed mid-way (the database went away): the runs not adopted
            # yet stay held, for the next readopt, or are let go to expire.
            leases = self.leases
            for run_id in run_ids:
                if run_id in self._runs or (leases is not None and run_id not in leases):
                    continue
                if self.readopting:
                    self._unwritten.add(run_id)
                elif leases is not None:
                    leases.forget(run_id)
            raise
        finally:
            self._adopting.difference_update(run_ids)

    async def _adopt_held(
        self, run_ids: Sequence[str], provider: Provider | None
    ) -> list[RunHandle]:
        folded = []
        for run_id in run_ids:
            try:
                events = await self.store.load(run_id)
                name = getattr(events[0], "machine", "") if events else ""
                machine = self.machines.get(name)
                if machine is None:
                    raise UnknownMachine(name, list(self.machines))
                run = self._fold(machine, events)
                if not run.terminal and run.state not in machine.states:
                    raise UnknownState(run_id, run.state, name, list(machine.states), "is in")
                if (provider or self.provider_for(name)) is None and machine.needs_provider:
                    raise NoProvider(f"machine {name!r} has worker states but no provider here")
            except StoreError:
                raise
            except InterlockError as exc:
                self._cannot_drive(run_id, exc)
                continue
            self._lost.pop(run_id, None)
            folded.append(run)
        # (never a run held again meanwhile: an operator's resume loaded it, say)
        return await self._recover([r for r in folded if r.run_id not in self._runs], provider)

    def _cannot_drive(self, run_id: str, exc: Exception) -> None:
        if self.leases is None:  # readopted here after a failed write: left unfinished
            _log.warning(
                "run %r cannot be driven again after its journal write failed: %s; it is "
                "left unfinished (`interlock resume` continues it)",
                run_id,
                exc,
            )
            return
        self.leases.forget(run_id)  # not renewed: it expires, and another process may claim it
        _log.warning(
            "run %r was claimed by %s, which cannot drive it: %s; it is left to expire for "
            "another process",
            run_id,
            self.leases.owner,
            exc,
        )

    def drain(self) -> None:
        """Stop every run at its next step boundary: the step in flight (a model call, a
        tool call) finishes and is journaled, the next one is not started. Runs started
        later stop likewise. The runs stay unfinished; release their leases (a worker) or
        resume them later."""
        self._draining = True
        for driver in self._drivers.values():
            driver.draining = True

    def cancel_actors(self) -> None:
        """Cancel every run actor now, without waiting for it to end (a server that
        stops once its requests are answered, rather than wait for its hosted runs): a
        call in flight is cut, its intent stays in the journal, and the run stays
        unfinished, for a resume or another process to continue."""
        actors = self._actors
        if actors is not None:
            actors.cancel_scope.cancel()

    async def wait_undriven(self) -> None:
        """Return once no run has an actor running here (after a :meth:`drain`)."""
        while self._drivers:
            self._no_drivers = trio.Event()
            await self._no_drivers.wait()

    @property
    def driving(self) -> int:
        """How many runs have an actor running here now."""
        return len(self._drivers)

    async def _load(self, run_id: str) -> RunState:
        run = self._runs.get(run_id)
        if run is not None:
            return run
        record = await self.store.get_run(run_id)
        machine = self.machine(record.machine)
        run = self._fold(machine, await self.store.load(run_id))
        if self.leases is not None and not run.external and run_id not in self.leases:
            # Another process may drive it: take its lease first, or leave it alone.
            if not await self.leases.take([run_id]):
                raise RunLeased(
                    f"run {run_id!r} is leased by another process, which drives it; wait for "
                    "it to finish or release the run (its lease expires if that process is "
                    "gone), then retry"
                )
            run = self._fold(machine, await self.store.load(run_id))  # as of the lease, not before
        self._runs[run_id] = run
        self._lost.pop(run_id, None)
        self._unwritten.discard(run_id)  # held again here: not to be adopted a second time
        return run

    async def _load_external(self, run_id: str) -> RunState | None:
        """Fold an unfinished external run from the journal and register it; None if the
        journal has no such run or it is not an unfinished external run."""
        try:
            record = await self.store.get_run(run_id)
        except RunNotFound:
            return None
        machine = self.machines.get(record.machine)
        if machine is None or record.outcome != "running":
            return None
        run = self._runs.get(run_id)
        if run is not None:
            return run
        events = await self.store.load(run_id)
        run = self._runs.get(run_id)
        if run is not None:  # loaded meanwhile by another request: never two copies
            return run
        run = self._fold(machine, events)
        if not run.external:
            return None
        self._runs[run_id] = run
        self._lost.pop(run_id, None)
        if run_id not in self.handles:
            self.handles[run_id] = RunHandle(run_id, machine.name, external=True)
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
        send it) is verified first, and if it is rejected nothing is journaled. A run
        started with ``external=True`` stays external: it gets no actor, and its caller
        drives it on with :meth:`submit`.

        Args:
          run_id: an escalated run in the store.
          by: who resumes it (journaled).
          note: why (journaled).
          to: the state to resume in: where it escalated from (default) or a legal next state.
          payload: a corrected proposal to verify and apply on resuming.
          provider: the provider for the rest of the run; defaults to the supervisor's.

        A repeat, once an operator resumed it in the same state with the same payload
        (whoever sends it), journals nothing and returns the run's handle: the live one if
        this supervisor drives it, else one finished with where the run is now
        (:func:`interlock.core._escalation.answer_again`).

        Raises:
          RunNotFound: no such run.
          NotEscalated: the run is not in the escalation queue, and no operator took it out.
          EscalationResolved: an operator aborted it, or resumed it in another state or
            with another payload (the message says who and when).
          IllegalResumeTarget: ``to`` is not a legal target.
          PayloadRejected: the gate rejected the payload (``.violations``); nothing was
            journaled.
        """
        again = await self._resolved(run_id, "resume", to, payload)
        if again is not None:
            handle = self.handles.get(run_id)
            if handle is None:
                handle = RunHandle(run_id, again.machine.name, external=again.external)
                handle._finish(run_result(again))
            return handle
        run = _decider.escalated(await self._load(run_id))
        target = _decider.resume_target(run, to or "")
        if payload:
            # Decide the resume for real, but on a copy of the run with circuits of its
            # own: a rejected payload must leave the journal and this supervisor untouched.
            trial = fold(run.machine, await self.store.load(run_id))
            request = Resume(run_id=run_id, by=by, note=note, to=target, payload=payload)
            attempt = _decider.decide(trial, request, self.clock(), CircuitBoard(), [])
            if attempt.violations:
                raise PayloadRejected(run_id, attempt.violations)
        verdict = await self.request(
            Resume(run_id=run_id, seq=run.seq, by=by, note=note, to=target, payload=payload or "")
        )
        handle = RunHandle(run_id, run.machine.name, external=run.external)
        self.handles[run_id] = handle
        if verdict.outcome == "running":
            if not run.external:  # an external run's caller drives it on: no actor
                self._spawn(handle, verdict, provider or self.provider_for(run.machine.name))
        else:
            handle._finish(self.result_of(run_id))
            self.release(run_id)
        return handle

    async def abort_escalated(self, run_id: str, *, by: str, note: str = "") -> RunResult:
        """End an escalated run: it moves to FAILED with ``aborted by {by}: {note}``.

        A repeat, once an operator aborted it, returns the failed run and journals
        nothing (:func:`interlock.core._escalation.answer_again`).

        Raises:
          RunNotFound: no such run.
          NotEscalated: the run is not in the escalation queue, and no operator took it out.
          EscalationResolved: an operator resumed it (the message says who and when).
        """
        again = await self._resolved(run_id, "abort")
        if again is not None:
            return run_result(again)
        await self._load(run_id)
        await self.request(Abort(run_id=run_id, by=by, note=note))
        result = self.result_of(run_id)
        self.release(run_id)
        return result

    async def _resolved(
        self, run_id: str, action: Action, to: str | None = None, payload: str | None = None
    ) -> RunState | None:
        """None if the run waits in the escalation queue (``action`` applies to it); else
        the run as its journal holds it, if ``action`` repeats what an operator did.

        Raises:
          RunNotFound, NotEscalated, EscalationResolved: as :func:`answer_again` decides.
        """
        run = self._runs.get(run_id)
        record = await self.store.get_run(run_id) if run is None else None
        if run is not None and run.state == ESCALATE and run.escalation is not None:
            return None
        if record is not None and record.outcome == "escalated":
            return None
        name = run.machine.name if run is not None else record.machine if record else ""
        events = await self.store.load(run_id)
        folded = fold(self.machine(name), events)
        outcome = folded.machine.outcome(folded.state)
        answer_again(run_id, outcome, folded.state, events, action, to=to, payload=payload)
        return folded

    async def cancel_run(self, run_id: str, reason: str = "cancelled") -> Verdict:
        """Fail a live run with ``reason`` (journaled as a transition to FAILED) and stop its actor.

        A tool call in flight is cancelled; its intent stays in the journal without a commit.
        """
        verdict = await self.request(Cancel(run_id=run_id, reason=reason))
        driver = self._drivers.get(run_id)
        if driver is not None:
            driver.cancel()
        return verdict
