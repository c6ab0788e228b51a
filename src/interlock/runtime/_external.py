"""The port through which an outside driver reaches a supervisor's run table.

An external run has no actor: its caller owns the model and the tools, and drives it
request by request through the same gate, journal, breakers, budgets and in-doubt rules
as a run the runtime drives. The gateway is such a driver today (HTTP and the channel);
an MCP proxy and an OpenAI-compatible proxy are the next. Each reaches the runtime only
through :attr:`Supervisor.external <interlock.runtime.Supervisor.external>`, an
:class:`ExternalRuns`, and the supervisor's other public names; nothing of the
supervisor's own state.

The contract, for every driver:

- **start** a run with :meth:`ExternalRuns.start` (durable when it returns);
- drive it with :meth:`ExternalRuns.submit` (one request, answered once durable), or
  decide many at once with :meth:`ExternalRuns.decide_many` and wait for them with
  :meth:`ExternalRuns.sync` (a gateway batch);
- once a request decided by :meth:`~ExternalRuns.decide_many` is durable,
  :meth:`ExternalRuns.settle` its run: a run that ended leaves the table, and its
  handle's ``wait`` returns (:meth:`~ExternalRuns.submit` settles by itself);
- on a store that other processes write too, :meth:`ExternalRuns.hold` a run folded from
  the journal to decide requests on it here, and :meth:`ExternalRuns.forget` a copy that
  another process advanced (the next request folds it again);
- look a run up with :meth:`ExternalRuns.get` (or ``in``), and list the live runs with
  ``iter``/``len``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core._messages import Escalate, Propose, Reconciliation, Report, Sync, Verdict

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from ..core._events import Event
    from ..core._view import RunState
    from ._handle import RunHandle
    from ._supervisor import Supervisor

__all__ = ["ExternalRuns"]


class ExternalRuns:
    """A supervisor's run table as its outside drivers see it (see the module).

    Every live run of the supervisor is in the table: the external runs its drivers
    drive, and the hosted runs its actors drive, which a driver may look up (to answer
    about them) but never drives. The table is the supervisor's own: what a driver reads
    here is the live state, and changes only through the requests it decides.
    """

    __slots__ = ("_runs", "_supervisor", "get")

    def __init__(self, supervisor: Supervisor, runs: dict[str, RunState]) -> None:
        self._supervisor = supervisor
        self._runs = runs
        self.get: Callable[[str], RunState | None] = runs.get
        """The live run ``run_id`` (external or hosted), or None if it is not live here.

        The table's own lookup (no Python frame of its own): a batch looks up every item
        with it."""

    # -- looking runs up ----------------------------------------------------------

    def __contains__(self, run_id: object) -> bool:
        """Whether the run ``run_id`` is live here."""
        return run_id in self._runs

    def __iter__(self) -> Iterator[str]:
        """The ids of the live runs (a snapshot: the table may change meanwhile)."""
        return iter(list(self._runs))

    def __len__(self) -> int:
        """How many runs are live here."""
        return len(self._runs)

    # -- driving runs -------------------------------------------------------------

    async def start(
        self,
        machine: str,
        inputs: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        trace: str | None = None,
    ) -> RunHandle:
        """Start an external run of ``machine`` and return its handle once its
        ``run_started`` event is durable; its caller drives it from its first state.
        ``trace``: the ``traceparent`` of the request that starts it (tracing on: the run's
        spans continue it).

        Raises:
          UnknownMachine, InvalidInputs, ProtocolError (``run_id`` in use),
          trio.ClosedResourceError: as :meth:`Supervisor.start_run` raises them.
        """
        return await self._supervisor.start_run(
            machine, inputs, run_id=run_id, external=True, trace=trace
        )

    async def submit(self, msg: Propose | Report | Reconciliation | Escalate) -> Verdict:
        """Drive an external run one request further (a proposal, a tool call's outcome, a
        reconciliation, or an :class:`~interlock.messages.Escalate` for what the machine
        cannot see) and return the verdict once its events are durable; a run that
        ended is settled. See :meth:`Supervisor.submit`.

        Raises:
          ProtocolError, RunNotFound, StoreError: as :meth:`Supervisor.submit` raises them.
        """
        return await self._supervisor.submit(msg)

    def decide_many(self, msgs: Sequence[Propose]) -> list[Verdict | Exception]:
        """Decide ``msgs`` now, in order, in the caller's task: for each its verdict, or
        the error it was refused with. Never raises for one request: a bug met deciding
        one ends that run only (its entry is the :class:`InternalError`), and a failure of
        the whole call (the supervisor closing: ``trio.ClosedResourceError``; a batch that
        could not be written: ``StoreError``) is every entry's. Nothing is durable yet:
        :meth:`sync` waits until it is, then :meth:`settle` each run."""
        try:
            return self._supervisor.submit_many_nowait(msgs)
        except Exception as exc:
            return [exc] * len(msgs)

    async def sync(self, run_id: str) -> None:
        """Wait until every request decided so far is durable (one write holds them).

        Raises:
          StoreError: the write failed (the requests decided in it were not written).
          trio.ClosedResourceError: the supervisor is shutting down.
          InterlockError: ``run_id`` takes no request (it is not live here), raised only
            after that write.
        """
        await self._supervisor.request(Sync(run_id=run_id))

    def settle(self, run_id: str) -> None:
        """If the external run ``run_id`` has ended and its last events are durable, let it
        leave the table: its handle's ``wait`` returns. Call it after :meth:`sync` for each
        run of a :meth:`decide_many`."""
        self._supervisor.settle_external(run_id)

    # -- copies of runs other processes write too (a shared store) ------------------

    def hold(self, run: RunState, journal: Sequence[Event] = ()) -> RunState:
        """Hold ``run`` (an external run folded from the journal) live here, to decide its
        requests on; if a copy is held already (loaded meanwhile), that copy, unchanged.
        ``journal``: the events it was folded from; with tracing on, the run's spans here
        join the trace its ``run_started`` names.

        Raises:
          ValueError: ``run`` is not an external run.
        """
        if not run.external:
            raise ValueError(
                f"run {run.run_id!r} is hosted: its actor drives it, and only external runs "
                "are held by a driver; fold and hold runs started with external=True"
            )
        held = self._runs.setdefault(run.run_id, run)
        tracing = self._supervisor.tracing
        if held is run and tracing is not None:
            first = journal[0] if journal else None
            trace = getattr(first, "trace", "")
            tracing.resumed(run.run_id, run.machine.name, trace if isinstance(trace, str) else "")
        return held

    def forget(self, run_id: str, run: RunState | None = None) -> bool:
        """Drop this process's copy of the external run ``run_id`` (only if it is ``run``,
        when given) and its handle: another process advanced it, or it idled; the next
        request folds it afresh from the journal. A hosted run is never dropped. Whether
        a copy was dropped."""
        held = self._runs.get(run_id)
        if held is None or not held.external or (run is not None and held is not run):
            return False
        del self._runs[run_id]
        self._supervisor.handles.pop(run_id, None)
        return True
