"""The watchdog: every run's deadline and the timeout of each model call and tool attempt
in flight, in one heap, so that no step enters a trio cancel scope of its own."""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._actor import Driver


def armed_for(driver: Driver | None, token: int) -> bool:
    """Whether a watchdog entry with ``token`` is still live for ``driver``."""
    if driver is None or driver.done:
        return False
    return token == (driver.deadline_token if token < 0 else driver.tool_token)


class Watchdog:
    """Tells a run's actor (its :class:`~interlock.runtime._actor.Driver`) when what it waits
    for has overrun.

    An entry is (trio time, token, run id). A deadline's token is negative, a call's
    positive; each is unique, so ties never compare run ids. The run id, not the driver:
    a tuple of a float, an int and a str is untracked by the garbage collector after its
    first pass, and the heap holds one per live step. The driver is looked up when the
    entry fires, and its token says whether the entry is still its own (a resumed run has
    a new driver under the same id, a finished call a new token).

    Args:
      drivers: the live actors' drivers by run id (the supervisor's table, read only).
      live: how many runs are live (bounds the heap).
    """

    __slots__ = ("_armed", "_drivers", "_heap", "_live", "_waiting")

    def __init__(self, drivers: Mapping[str, Driver], live: Callable[[], int]) -> None:
        self._drivers = drivers
        self._live = live
        self._heap: list[tuple[float, int, str]] = []
        self._waiting: trio.CancelScope | None = None
        self._armed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def arm_deadline(self, driver: Driver, remaining: float) -> None:
        """Fire ``driver``'s deadline in ``remaining`` seconds (of trio's clock)."""
        if math.isfinite(remaining):
            self._armed += 1
            token = driver.deadline_token = -self._armed
            self._arm(trio.current_time() + max(remaining, 0.0), token, driver)

    def arm_timeout(self, driver: Driver, seconds: float) -> int:
        """Cut ``driver``'s call in flight (a model call or a tool attempt) after ``seconds``.

        Returns the call's token, which the actor holds in ``driver.tool_token`` while the
        call runs; the entry of a call that finished is ignored when it fires.
        """
        self._armed += 1
        token = driver.tool_token = self._armed
        self._arm(trio.current_time() + seconds, token, driver)
        return token

    def _arm(self, at: float, token: int, driver: Driver) -> None:
        heap = self._heap
        if len(heap) > 3 * self._live() + 64:
            # Each live run has at most two live entries (its deadline, its call in
            # flight): drop the rest, so the heap stays O(live runs) however many calls
            # finished. Pruning at 3x leaves room for at least one push per live run.
            drivers = self._drivers
            heap[:] = [entry for entry in heap if armed_for(drivers.get(entry[2]), entry[1])]
            heapq.heapify(heap)
        heapq.heappush(heap, (at, token, driver.run_id))
        waiting = self._waiting
        if waiting is not None and at < waiting.deadline:
            waiting.deadline = at

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fire entries as they come due, until cancelled."""
        task_status.started()
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _at, token, run_id = heapq.heappop(heap)
                driver = self._drivers.get(run_id)
                if driver is not None:
                    driver.fire(token)
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as waiting:
                self._waiting = waiting
                await trio.sleep_forever()
            self._waiting = None
