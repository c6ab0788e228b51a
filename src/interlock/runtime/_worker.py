"""A worker: a long-running process that claims runs from a PostgreSQL journal and drives
them, beside any number of others on any number of hosts (``interlock worker``).

Each claimed run is leased to the worker (see :mod:`interlock.runtime._leasing`): heartbeats
renew the leases, every batch is appended fenced, and a run whose lease another worker
took is dropped here with :class:`~interlock.LeaseLost` while the rest go on. A drain
(SIGTERM, or :meth:`WorkerControl.drain`) stops claiming, lets every run finish the step in
flight, releases the leases of the runs left unfinished, and returns.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._events import Completed, Escalated, Failed
from ..core._exceptions import ConfigurationError, StoreError
from ..stores import open_store
from ._leasing import DEFAULT_TTL, is_leasing
from ._runtime import open_supervisor

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..core._events import Event
    from ..core._stats import RuntimeStats
    from ._app import App
    from ._supervisor import Supervisor
    from ._tracing import Tracing

__all__ = ["WorkerControl", "WorkerSummary", "run_worker"]

log = logging.getLogger("interlock.worker")

#: The longest a worker waits before claiming again after the store failed.
_MAX_BACKOFF = 5.0


class WorkerSummary(msgspec.Struct, kw_only=True):
    """What one worker did, from its start to its exit."""

    owner: str
    """The worker's name in the leases table."""
    claimed: int = 0
    """Runs claimed (a run claimed twice, after a lost lease, counts twice)."""
    finished: int = 0
    """Runs this worker drove to an end: completed, failed or escalated."""
    completed: int = 0
    failed: int = 0
    escalated: int = 0
    lost: int = 0
    """Runs dropped because another worker took their leases."""
    released: int = 0
    """Unfinished runs whose leases the worker released at its exit (a drain)."""
    drained: bool = False
    """The worker stopped on a drain (SIGTERM), not because it ran out of work."""
    waited_for: int = 0
    """With ``until_idle``: runs other processes still leased when the worker gave up
    waiting for them (their leases had not expired)."""
    wall_seconds: float = 0.0


class WorkerControl:
    """A running worker; :func:`run_worker` makes one. Call :meth:`drain` to stop it."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._drain = trio.Event()
        self._wake = trio.Event()

    @property
    def owner(self) -> str:
        assert self.supervisor.leases is not None
        return self.supervisor.leases.owner

    def drain(self) -> None:
        """Stop claiming; let every run finish its step in flight; release the rest."""
        self._drain.set()
        self._wake.set()

    @property
    def draining(self) -> bool:
        return self._drain.is_set()

    async def _nap(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            await self._wake.wait()
        if self._wake.is_set() and not self.draining:
            self._wake = trio.Event()


async def run_worker(
    app: App,
    db: str,
    *,
    owner: str | None = None,
    lease_ttl: float = DEFAULT_TTL,
    max_runs: int = 1000,
    claim_batch: int = 100,
    poll: float = 0.5,
    until_idle: bool = False,
    idle_wait: float | None = None,
    drain_timeout: float = 30.0,
    stats: RuntimeStats | None = None,
    on_start: Callable[[WorkerControl], None] | None = None,
    named: str = "",
    tracing: Tracing | None = None,
) -> WorkerSummary:
    """Claim runs of ``app``'s machines from the PostgreSQL journal ``db`` and drive them,
    until drained (:meth:`WorkerControl.drain`, given to ``on_start``) or cancelled, or, with
    ``until_idle``, until nothing is left to claim.

    Args:
      app: the machines, provider(s) and lifespan (what the tools need, opened once).
      db: a ``postgresql://`` URL (``?schema=NAME`` picks the schema).
      owner: the worker's name in the leases table; ``host:pid:random`` if omitted.
      lease_ttl: seconds a lease lasts; heartbeats renew every third of it. A worker
        that stops for longer (a pause, a partition) loses its runs to the others.
      max_runs: the most runs driven at once.
      claim_batch: the most runs per claim.
      poll: seconds between claims when nothing was claimable.
      until_idle: return once nothing is claimable and no run is driven here, after
        waiting up to ``idle_wait`` seconds (default: ``lease_ttl`` + 2) for the runs
        other processes lease (a crashed process's become claimable when they expire).
      drain_timeout: on a drain, seconds the steps in flight get to finish; then the
        runs still driven are cut (a call in flight stays in doubt, for the next owner
        to reconcile) and their leases released.
      stats: counters to update (serve them as metrics).
      on_start: called with the :class:`WorkerControl` once it runs (to drain it).
      named: what names the app in an error of its lifespan.
      tracing: trace the runs it drives in OpenTelemetry (``interlock[otel]``): each run
        it claims joins the trace its ``run_started`` names; None: off.

    Raises:
      ConfigurationError: ``db`` is not a PostgreSQL journal with leases, or an argument is
        unusable.
      StoreError: the journal cannot be opened.
    """
    for name, value in (("max_runs", max_runs), ("claim_batch", claim_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be an integer of at least 1, not {value!r}")
    for name, seconds in (("poll", poll), ("drain_timeout", drain_timeout)):
        if not isinstance(seconds, int | float) or not seconds > 0:
            raise ConfigurationError(f"{name} must be a number of seconds above 0, not {seconds!r}")
    wait = lease_ttl + 2.0 if idle_wait is None else idle_wait
    started = time.perf_counter()
    store = await open_store(db)
    try:
        if not is_leasing(store):
            raise ConfigurationError(
                f"a worker needs a PostgreSQL journal (postgresql://...), which leases runs to "
                f"workers; {db!r} is a {store.kind} journal, which one process drives: use "
                "`interlock resume` there"
            )
        async with (
            app.open(db, named),
            open_supervisor(
                list(app.machines.values()),
                store,
                provider=app.provider,
                stats=stats,
                owner=owner,
                lease_ttl=lease_ttl,
                tracing=tracing,
            ) as supervisor,
        ):
            worker = WorkerControl(supervisor)
            supervisor.readopting = True
            summary = WorkerSummary(owner=worker.owner)
            supervisor.on_written.append(partial(_count_ends, summary))
            if on_start is not None:
                on_start(worker)
            await _serve(worker, summary, max_runs, claim_batch, poll, until_idle, wait)
            if worker.draining:
                summary.drained = True
                summary.released = await _drain(supervisor, drain_timeout)
            summary.lost = supervisor.leases.lost if supervisor.leases is not None else 0
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
    summary.wall_seconds = round(time.perf_counter() - started, 3)
    return summary


async def _serve(
    worker: WorkerControl,
    summary: WorkerSummary,
    max_runs: int,
    claim_batch: int,
    poll: float,
    until_idle: bool,
    wait: float,
) -> None:
    """Claim and drive runs until drained, or (``until_idle``) until none is left."""
    supervisor = worker.supervisor
    leases = supervisor.leases
    assert leases is not None
    backoff = 0.1
    idle_since: float | None = None
    while not worker.draining:
        try:
            if supervisor._unwritten:
                await supervisor.readopt()
            free = max_runs - supervisor.driving
            claimed = 0
            if free > 0:
                before = supervisor.stats.leases_claimed
                await supervisor.claim_runs(min(free, claim_batch))
                claimed = supervisor.stats.leases_claimed - before
                summary.claimed += claimed
            backoff = 0.1
        except StoreError as exc:
            log.warning("claim failed: %s; retrying in %.1f s", exc, backoff)
            await worker._nap(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)
            continue
        summary.lost = leases.lost
        if claimed == claim_batch and supervisor.driving < max_runs:
            await trio.lowlevel.checkpoint()
            continue  # there may be more: claim again at once
        if until_idle and not claimed and not supervisor.driving and not supervisor._unwritten:
            others = await _held_elsewhere(supervisor)
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            if not others or now - idle_since >= wait:
                summary.waited_for = others
                return
        elif claimed or supervisor.driving:
            idle_since = None
        await worker._nap(poll)


async def _held_elsewhere(supervisor: Supervisor) -> int:
    assert supervisor.leases is not None
    store: Any = supervisor.store
    try:
        return len(await store.held_elsewhere(supervisor.leases.owner))
    except StoreError:
        return 1  # unknown: keep waiting (bounded by the idle wait)


async def _drain(supervisor: Supervisor, seconds: float) -> int:
    """Let the steps in flight finish, cut what outlasts ``seconds``, release the rest."""
    assert supervisor.leases is not None
    supervisor.drain()
    with trio.move_on_after(seconds):
        await supervisor.wait_undriven()
    if supervisor.driving:
        log.warning(
            "%d runs did not reach a step boundary within the drain timeout of %g s; cut",
            supervisor.driving,
            seconds,
        )
        for driver in list(supervisor._drivers.values()):
            driver.cancel()
        await supervisor.wait_undriven()
    held = supervisor.leases.releasable()
    with trio.move_on_after(max(5.0, supervisor.leases.ttl)):
        try:
            await supervisor.leases.release(held)
        except StoreError as exc:
            log.warning("could not release %d leases: %s; they expire instead", len(held), exc)
            return 0
    return len(held)


def _count_ends(summary: WorkerSummary, events: Sequence[Event]) -> None:
    """Count the runs whose end this worker wrote (durable: a batch that failed, or a
    run refused by the fence, is not counted)."""
    for event in events:
        kind = type(event)
        if kind is Completed:
            summary.completed += 1
        elif kind is Failed:
            summary.failed += 1
        elif kind is Escalated:
            summary.escalated += 1
        else:
            continue
        summary.finished += 1
