"""The journal writer: requests decided in batches, each batch's events written with one
append (group commit), and every verdict sent only after the batch holding it is durable."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import outcome
import trio

from ._exceptions import InterlockError, InternalError, StoreError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ._events import Event
    from ._messages import Request, Verdict
    from ._stats import RuntimeStats
    from .stores import Store


class _Pending:
    """A request waiting for its verdict; also the wait's abort function (see request)."""

    __slots__ = ("cancelled", "msg", "task")

    def __init__(self, msg: Request, task: trio.lowlevel.Task) -> None:
        self.msg = msg
        self.task = task
        self.cancelled = False

    def __call__(self, _raise_cancel: Any) -> trio.lowlevel.Abort:
        self.cancelled = True
        return trio.lowlevel.Abort.SUCCEEDED


class GroupCommit:
    """Queues requests; :meth:`serve` decides all that arrived since its last turn as one
    batch, appends the batch's events to the store in one write, and only then wakes the
    senders.

    Args:
      store: the journal.
      stats: the counters of flush latency and batch size.
      decide: decides one request, appending its events; raises InterlockError for a
        request it refuses.
      contain: turns a bug met while deciding a request into the error that ends its run.
      forget: called with the run ids of a batch that could not be written, and the error.
      max_batch: the most requests decided per write.

    A supervisor on a store with leases sets :attr:`fenced` (the fenced append, which
    returns the runs it refused) and :attr:`refusal` (the error of a refused run's
    requests); the other runs of a batch commit.
    """

    __slots__ = (
        "_contain",
        "_decide",
        "_forget",
        "_idle",
        "_inline",
        "_queue",
        "closed",
        "fenced",
        "max_batch",
        "on_written",
        "refusal",
        "stats",
        "store",
    )

    def __init__(
        self,
        store: Store,
        stats: RuntimeStats,
        decide: Callable[[Request, list[Event]], Verdict],
        contain: Callable[[Request, Exception], InternalError],
        forget: Callable[[set[str], StoreError], None],
        max_batch: int,
    ) -> None:
        self.store = store
        self.stats = stats
        self.max_batch = max_batch
        self.closed = False
        self._decide = decide
        self._contain = contain
        self._forget = forget
        self._queue: deque[_Pending] = deque()
        self._inline: list[Event] = []  # decided by submit_nowait, not yet written
        self._idle: trio.lowlevel.Task | None = None
        self.fenced: Callable[[list[Event]], Awaitable[frozenset[str]]] | None = None
        self.refusal: Callable[[str], Exception] | None = None
        self.on_written: list[Callable[[Sequence[Event]], object]] = []
        """Called after each batch is durable, with the events written."""

    async def request(self, msg: Request) -> Verdict:
        """See :meth:`Supervisor.request`."""
        if self.closed:
            raise trio.ClosedResourceError("supervisor is closed")
        pending = _Pending(msg, trio.lowlevel.current_task())
        self._queue.append(pending)
        idle = self._idle
        if idle is not None:
            self._idle = None
            trio.lowlevel.reschedule(idle)
        # The pending request is its own abort function: a closure would be two more
        # objects per request for the garbage collector to walk while the run waits.
        result: Verdict = await trio.lowlevel.wait_task_rescheduled(pending)
        return result

    def submit_nowait(self, msg: Request) -> Verdict:
        """See :meth:`Supervisor.submit_nowait`."""
        if self.closed:
            raise trio.ClosedResourceError("supervisor is closed")
        inline = self._inline
        mark = len(inline)
        try:
            verdict = self._decide(msg, inline)
        except InterlockError:
            raise
        except Exception as exc:
            del inline[mark:]
            raise self._contain(msg, exc) from exc
        idle = self._idle
        if idle is not None and inline:
            self._idle = None
            trio.lowlevel.reschedule(idle)
        return verdict

    async def _wait_for_work(self) -> None:
        if self._queue or self._inline:
            await trio.lowlevel.checkpoint()
            return
        self._idle = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self._idle = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Decide and journal requests until cancelled."""
        task_status.started()
        queue = self._queue
        decide = self._decide
        while True:
            await self._wait_for_work()
            batch: list[_Pending] = []
            while queue and len(batch) < self.max_batch:
                batch.append(queue.popleft())
            # Events decided inline came first; they are written first.
            events: list[Event] = self._inline
            self._inline = []
            replies: list[tuple[_Pending, outcome.Outcome[Verdict]]] = []
            for pending in batch:
                mark = len(events)
                try:
                    replies.append((pending, outcome.Value(decide(pending.msg, events))))
                except InterlockError as exc:
                    replies.append((pending, outcome.Error(exc)))
                except Exception as exc:  # a bug: it ends that run only (see contain)
                    replies.append((pending, outcome.Error(self._contain(pending.msg, exc))))
                    del events[mark:]
            if events:
                error, refused = await self._write(events)
                if error is not None:
                    replies = [(p, outcome.Error(error)) for p, _ in replies]
                elif refused:
                    replies = self._refuse(replies, refused)
            for pending, reply in replies:
                if not pending.cancelled:
                    trio.lowlevel.reschedule(pending.task, reply)

    def _refuse(
        self, replies: list[tuple[_Pending, outcome.Outcome[Verdict]]], refused: frozenset[str]
    ) -> list[tuple[_Pending, outcome.Outcome[Verdict]]]:
        """The replies of a batch some runs of which the fence refused: theirs are errors."""
        refusal = self.refusal
        assert refusal is not None
        return [
            (p, outcome.Error(refusal(p.msg.run_id)) if p.msg.run_id in refused else reply)
            for p, reply in replies
        ]

    async def _write(self, events: list[Event]) -> tuple[StoreError | None, frozenset[str]]:
        """Append one batch; on failure, forget its runs and return the error. Also
        returns the runs a fenced append refused (none of their events were written)."""
        started = time.perf_counter()
        refused: frozenset[str] = frozenset()
        try:
            if self.fenced is None:
                await self.store.append(events)
            else:
                refused = await self.fenced(events)
        except (StoreError, OSError) as exc:
            error = (
                exc if isinstance(exc, StoreError) else StoreError(f"journal write failed: {exc}")
            )
            self._forget({e.run_id for e in events}, error)
            return error, refused
        if refused:
            events = [event for event in events if event.run_id not in refused]
        for listener in self.on_written:
            listener(events)
        stats = self.stats
        stats.flush_latency.record(time.perf_counter() - started)
        stats.flush_events["batches"] += 1
        stats.flush_events["events"] += len(events)
        stats.batch_sizes.record(len(events) * 1e-6)
        return None, refused
