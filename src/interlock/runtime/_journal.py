"""The journal writer: requests decided in batches, each batch's events written with one
append (group commit). A verdict is sent once the batch holding it is durable, or, for a
verdict whose action is harmless to repeat (see :attr:`GroupCommit.early`), as soon as
its events are in the batch: batches are written one after another, in order, so every
verdict follows all earlier events of its run into the journal."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import outcome
import trio

from ..core._exceptions import InterlockError, InternalError, StoreError
from ..core._gate import INTERRUPTS

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from ..core._events import Event
    from ..core._messages import Propose, Request, Verdict
    from ..core._stats import RuntimeStats
    from ..stores import Store


#: How a decided request's verdict goes out (see GroupCommit.early): once its events are
#: durable; at once, its events written now (the writer is woken); or at once, its events
#: written with the run's next request that wakes the writer (they may lag one step).
DURABLE, WRITE, LAG = 0, 1, 2


class _Pending:
    """A request waiting for its verdict; also the wait's abort function (see request),
    and, once decided, its reply (``verdict`` or ``error``): no tuple and no outcome
    object per waiting run until the reply is sent."""

    __slots__ = ("cancelled", "error", "msg", "task", "verdict")

    def __init__(self, msg: Request, task: trio.lowlevel.Task) -> None:
        self.msg = msg
        self.task = task
        self.cancelled = False
        self.verdict: Verdict | None = None
        self.error: BaseException | None = None

    def reply(self) -> outcome.Outcome[Verdict]:
        error = self.error
        if error is not None:
            return outcome.Error(error)
        assert self.verdict is not None
        return outcome.Value(self.verdict)

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

    A supervisor also sets :attr:`early`, which says of a decided request how its verdict
    goes out: :data:`DURABLE` (a run actor's proposal, see :meth:`propose`, answered
    once its events are durable), :data:`WRITE` (answered at once, the writer woken) or
    :data:`LAG` (answered at once; its events wait for the next request that wakes the
    writer, so they share its flush). A verdict answered before its events are durable
    is one a crash that loses them cannot make harmful: the run refolds to before it.
    Should their batch then fail to be written, the run is forgotten like the batch's
    others, whatever its actor decided meanwhile is dropped unwritten, and its next
    request gets the error.
    """

    __slots__ = (
        "_append_now",
        "_contain",
        "_decide",
        "_forget",
        "_idle",
        "_inline",
        "_queue",
        "_turned",
        "_waiting",
        "_writing",
        "closed",
        "decide_many",
        "early",
        "failed",
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
        contain: Callable[[Request, BaseException], InternalError],
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
        self._inline: list[Event] = []  # decided by submit_nowait or propose, not yet written
        self._waiting: list[_Pending] = []
        """Proposals decided by propose whose events are in _inline, waiting for them."""
        self._idle: trio.lowlevel.Task | None = None
        self.fenced: Callable[[list[Event]], Awaitable[frozenset[str]]] | None = None
        self.refusal: Callable[[str], Exception] | None = None
        self.early: Callable[[Request, Verdict], int] | None = None
        """When a verdict may be sent, and its events written: DURABLE, WRITE or LAG."""
        self.decide_many: (
            Callable[[Sequence[Request], list[Event]], tuple[list[Verdict | Exception], bool]]
            | None
        ) = None
        """The loop of :meth:`submit_many_nowait` over ``decide`` and ``early`` in one call
        (the supervisor's compiled one), or None for the loop below."""
        self.on_written: list[Callable[[Sequence[Event]], object]] = []
        """Called after each batch is durable, with the events written."""
        self.failed: StoreError | None = None
        """The error of the last write, if it failed and no write succeeded since (the
        journal cannot be written: a full disk, the database gone)."""
        self._turned: trio.Event | None = None  # set by serve after each batch (see close)
        self._writing = False
        immediate = getattr(store, "immediate_append", None)
        self._append_now: Callable[[Sequence[Event]], None] | None = (
            immediate() if immediate is not None else None
        )
        """A store with nothing to wait for (``MemoryStore.append_now``): where the writer
        would be woken and no batch is being written, the caller's task writes at once."""

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

    def _failed(
        self, msg: Request, exc: BaseException, events: list[Event], mark: int
    ) -> Exception:
        """The error ``msg`` gets when deciding it raised ``exc``, its events appended to
        ``events`` from ``mark`` on. The one rule for a decision that failed, whoever
        asked (the writer's batch, a run actor, a driver's batch): a refusal (an
        InterlockError) is that request's alone; a bug ends its run only (see contain),
        the events it appended dropped, never the batch's other requests or the
        supervisor; a KeyboardInterrupt or SystemExit passes through.

        NOTE: called from the callers' ``except`` only: the decision itself stays in their
        frame, with nothing on its path that succeeds (the hot path of every step)."""
        if isinstance(exc, InterlockError):
            return exc
        if isinstance(exc, INTERRUPTS):
            raise exc
        del events[mark:]
        return self._contain(msg, exc)

    def _decide_now(self, msg: Request) -> Verdict:
        """Decide ``msg`` in the caller's task, its events added to those not yet written;
        raise the error it was refused with (see _failed)."""
        if self.closed:
            raise trio.ClosedResourceError("supervisor is closed")
        inline = self._inline
        mark = len(inline)
        try:
            return self._decide(msg, inline)
        except BaseException as exc:
            error = self._failed(msg, exc, inline, mark)
            if error is exc:
                raise
            raise error from exc

    def submit_nowait(self, msg: Request) -> Verdict:
        """See :meth:`Supervisor.submit_nowait`."""
        verdict = self._decide_now(msg)
        if self._inline:
            early = self.early
            if early is None or early(msg, verdict) != LAG:
                if self._may_write_now():
                    error = self._write_now()
                    if error is not None:
                        raise error
                    return verdict
                idle = self._idle
                if idle is not None:
                    self._idle = None
                    trio.lowlevel.reschedule(idle)
        return verdict

    def submit_many_nowait(self, msgs: Sequence[Request]) -> list[Verdict | Exception]:
        """See :meth:`Supervisor.submit_many_nowait`."""
        if self.closed:
            raise trio.ClosedResourceError("supervisor is closed")
        inline = self._inline
        results: list[Verdict | Exception]
        if self.decide_many is not None:
            results, wake = self.decide_many(msgs, inline)
        else:
            results, wake = self._decide_each(msgs, inline)
        if wake and self._inline:
            if self._may_write_now():
                error = self._write_now()
                if error is not None:  # none of the verdicts decided here was written
                    return [r if isinstance(r, Exception) else error for r in results]
            else:
                idle = self._idle
                if idle is not None:
                    self._idle = None
                    trio.lowlevel.reschedule(idle)
        return results

    def _decide_each(
        self, msgs: Sequence[Request], inline: list[Event]
    ) -> tuple[list[Verdict | Exception], bool]:
        """Decide ``msgs`` in order, their events appended to ``inline``: each one's verdict
        or the error it was refused with, and whether the writer must be woken."""
        decide = self._decide
        early = self.early
        results: list[Verdict | Exception] = []
        wake = False
        for msg in msgs:
            mark = len(inline)
            try:
                verdict = decide(msg, inline)
            except BaseException as exc:
                results.append(self._failed(msg, exc, inline, mark))
                continue
            results.append(verdict)
            if not wake and (early is None or early(msg, verdict) != LAG):
                wake = True
        return results, wake

    async def propose(self, msg: Propose, *, lagging: bool = False) -> Verdict:
        """Decide a run actor's proposal now, in its task, and return the verdict: at once
        where :attr:`early` allows (its events are written before any later verdict of
        the run is sent), else once the batch holding them is durable.

        Args:
          msg: the proposal.
          lagging: the run's previous verdict was sent with its events left for a later
            write (:data:`LAG`): this one's are written now, so a run's journal lags it
            by one step at most.

        Raises:
          InterlockError: the proposal was refused (as by :meth:`request`), or the batch
            holding its events could not be written.
        """
        verdict = self._decide_now(msg)
        mode = DURABLE if self.early is None else self.early(msg, verdict)
        if (mode != LAG or lagging) and self._may_write_now():
            # Durable now, in this task: the write has nothing to wait for.
            error = self._write_now()
            if error is not None:
                raise error
            await trio.lowlevel.checkpoint()
            return verdict
        if mode == DURABLE:
            pending = _Pending(msg, trio.lowlevel.current_task())
            pending.verdict = verdict
            self._waiting.append(pending)
        idle = self._idle
        if idle is not None and (mode != LAG or lagging):
            self._idle = None
            trio.lowlevel.reschedule(idle)
        if mode == DURABLE:
            result: Verdict = await trio.lowlevel.wait_task_rescheduled(pending)
            return result
        # NOTE: a checkpoint, so a run whose every step is answered at once still lets
        # the writer (and every other task) run between its steps.
        await trio.lowlevel.checkpoint()
        return verdict

    async def _wait_for_work(self) -> None:
        if self._queue or self._inline or self._waiting:
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
            # Proposals decided in their actors' tasks (see propose), their events in
            # self._inline: answered after this write, with the requests decided below.
            replies: list[_Pending] = self._waiting
            self._waiting = []
            for pending in batch:
                mark = len(events)
                try:
                    pending.verdict = decide(pending.msg, events)
                except BaseException as exc:
                    pending.error = self._failed(pending.msg, exc, events, mark)
                replies.append(pending)
            if events:
                self._writing = True
                try:
                    error, refused = await self._write(events)
                finally:
                    self._writing = False
                    turned = self._turned
                    if turned is not None:
                        self._turned = None
                        turned.set()
                if error is not None:
                    for pending in replies:
                        pending.error = error
                elif refused:
                    self._refuse(replies, refused)
            for pending in replies:
                if not pending.cancelled:
                    trio.lowlevel.reschedule(pending.task, pending.reply())

    async def close(self) -> None:
        """Refuse new requests, and write what was decided and not yet written: the
        events of verdicts sent before their flush (a move, a rejection), so leaving the
        supervisor (cancelled too, as by Ctrl-C) leaves nothing for a resume to redo.

        Runs once the actors are done; the writer task may be gone (cancelled), so this
        writes itself, after the batch the writer may be writing.
        """
        self.closed = True
        while self._writing:
            turned = self._turned = self._turned or trio.Event()
            await turned.wait()
        events, self._inline = self._inline, []
        self._waiting = []  # their actors are gone
        if events:
            await self._write(events)

    def _refuse(self, replies: list[_Pending], refused: frozenset[str]) -> None:
        """The replies of a batch some runs of which the fence refused: theirs are errors."""
        refusal = self.refusal
        assert refusal is not None
        for pending in replies:
            if pending.msg.run_id in refused:
                pending.error = refusal(pending.msg.run_id)

    def _drop_inline(
        self, run_ids: set[str] | frozenset[str], error: Callable[[str], Exception]
    ) -> None:
        """Drop the events decided, while a batch was being written, for runs that batch
        lost: a verdict sent early let their actors go on, and what those decided
        meanwhile must never reach the journal without what came before it. The
        proposals among them that wait for the next write get ``error(run_id)``."""
        inline = self._inline
        if inline:
            self._inline = [event for event in inline if event.run_id not in run_ids]
        for pending in self._waiting:
            if pending.msg.run_id in run_ids:
                pending.error = error(pending.msg.run_id)

    def _may_write_now(self) -> bool:
        """Whether the caller's task may write what was decided now (see _append_now):
        the store appends with nothing to wait for, nothing is fenced, and no batch is
        being written or waits to be (so the journal's order is the decisions' order)."""
        return (
            self._append_now is not None
            and self.fenced is None
            and not self._writing
            and not self._queue
            and not self._waiting
            and not self.closed
        )

    def _write_now(self) -> StoreError | None:
        """Write the events decided so far in the caller's task (see _may_write_now); on
        failure, forget their runs (as :meth:`_write` does) and return the error."""
        events, self._inline = self._inline, []
        if not events:
            return None
        started = time.perf_counter()
        assert self._append_now is not None
        try:
            self._append_now(events)
        except (StoreError, OSError) as exc:
            return self._lost(events, exc)
        self._written(events, started)
        return None

    def _lost(self, events: list[Event], exc: StoreError | OSError) -> StoreError:
        """A batch that could not be written: its runs are forgotten; the error."""
        error = exc if isinstance(exc, StoreError) else StoreError(f"journal write failed: {exc}")
        self.failed = error
        lost = {e.run_id for e in events}
        self._forget(lost, error)
        self._drop_inline(lost, lambda _: error)
        return error

    def _written(self, events: list[Event], started: float) -> None:
        """A batch is durable: tell the listeners, count it."""
        self.failed = None
        for listener in self.on_written:
            listener(events)
        stats = self.stats
        stats.flush_latency.record(time.perf_counter() - started)
        stats.flush_events["batches"] += 1
        stats.flush_events["events"] += len(events)
        stats.batch_sizes.record(len(events) * 1e-6)

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
            return self._lost(events, exc), refused
        if refused:
            events = [event for event in events if event.run_id not in refused]
            assert self.refusal is not None
            self._drop_inline(refused, self.refusal)
        self._written(events, started)
        return None, refused
