"""Opening a supervisor: its tasks (the journal writer, the watchdog, the runs' actors)
in nurseries, for the length of an ``async with`` block."""

from __future__ import annotations

import gc
import time
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any

import trio

from .._aio import single_leaf
from ..core._exceptions import InterlockError
from ._leasing import DEFAULT_TTL
from ._supervisor import Clock, Supervisor

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sequence

    from ..core._machine import Machine
    from ..core._stats import RuntimeStats
    from ..providers import Provider
    from ..stores import Store
    from ._tracing import Tracing

#: Garbage-collector thresholds while a supervisor runs (see :func:`open_supervisor`).
#: A young-generation pass walks every live run task, and the loop allocates steadily:
#: fewer, larger passes (benchmarks/bench_concurrency.py measures the difference).
GC_THRESHOLD = (200_000, 20, 100)


async def _release_all(supervisor: Supervisor) -> None:
    """Release the leases of the runs left unfinished (and of those that ended escalated
    here), so another process may claim them at once instead of after their expiry; best
    effort (the store may be gone)."""
    assert supervisor.leases is not None
    with trio.CancelScope(shield=True), trio.move_on_after(5), suppress(InterlockError):
        await supervisor.leases.release(supervisor.leases.releasable())  # else they expire


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
    owner: str | None = None,
    lease_ttl: float = DEFAULT_TTL,
    tracing: Tracing | None = None,
) -> AsyncIterator[Supervisor]:
    """Run a supervisor for the duration of an ``async with`` block.

    Leaving the block waits for every run to end (complete, fail or escalate);
    cancelling it cancels every run. Either way each journal batch is written whole
    or not at all, so the store stays consistent. An error that ends the block (one of
    the caller's, a store error, KeyboardInterrupt) reaches the caller as it was raised,
    not wrapped in the nurseries' exception groups; several at once stay a group.

    Whatever a run's own code raises (a tool, a provider, a guard, a step: any
    exception, GeneratorExit, a BaseException of its own, a ``trio.Cancelled`` raised
    while nothing is cancelled) fails that run alone, journaled. Only the interpreter's
    KeyboardInterrupt and SystemExit raised by such code end the block, every run in it
    with them (unfinished, resumable from the journal), and the process unless the
    caller catches them.

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
      owner: on a store with leases (PostgreSQL), this process's name in the leases
        table; ``host:pid:random`` if omitted.
      lease_ttl: on a store with leases, seconds each lease lasts; a heartbeat renews
        them every third of that. Every run the supervisor starts, claims or resumes is
        leased to it, and each batch is appended fenced: a run whose lease another
        process took is dropped with :class:`LeaseLost`, the rest of the batch commits.
        Leaving the block releases the leases of the runs left unfinished.
      tracing: trace the runs in OpenTelemetry (``interlock[otel]``): a
        :class:`~interlock.runtime._tracing.Tracing`, e.g. from ``tracing_from_env()``;
        None (the default) traces nothing and costs nothing.
    """
    if gc_threshold is not None:
        _tune_gc(gc_threshold)
    if store is None:
        from ..stores import MemoryStore

        store = MemoryStore()
    supervisor = Supervisor(
        machines,
        store,
        provider=provider,
        clock=clock,
        stats=stats,
        max_batch=max_batch,
        owner=owner,
        lease_ttl=lease_ttl,
    )
    if tracing is not None:
        tracing.attach(supervisor)
    try:
        async with trio.open_nursery() as outer:
            await outer.start(supervisor._journal.serve)
            await outer.start(supervisor._watchdog.serve)
            if supervisor.leases is not None:
                await outer.start(supervisor.leases.heartbeat, supervisor._holds)
            else:
                await outer.start(supervisor._readopt_loop)
            try:
                async with trio.open_nursery() as actors:
                    supervisor._actors = actors
                    # The gauge is store-wide: count the runs already parked before this one.
                    # (counted by the database: listing them read every row of a big
                    # journal at each start, 0.37 s and 95 MiB at 100,000 runs)
                    supervisor.stats.escalations_pending = await store.count_runs(
                        outcome="escalated"
                    )
                    if resume:
                        await supervisor.resume_unfinished()
                    yield supervisor
            finally:
                supervisor._actors = None
                # What was answered before its flush (a move, a rejection) is written
                # now, so a clean exit (or a Ctrl-C) leaves nothing for a resume to redo.
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    await supervisor._journal.close()
                supervisor._journal.closed = True
                if supervisor.leases is not None:
                    await _release_all(supervisor)
                if tracing is not None:
                    tracing.close()
                outer.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The two nurseries wrap whatever ended the block (the caller's own error, a
        # store error, Ctrl-C) in two groups; one error alone reaches the caller as it
        # was raised, so ``except InterlockError`` catches it. Several stay a group.
        leaf = single_leaf(group)
        if leaf is None:
            raise
        raise leaf from None
    finally:
        if gc_threshold is not None:
            _untune_gc()
