"""Small trio helpers shared by the runtime, the gateway and the clients (never the core)."""

from __future__ import annotations

import trio


def single_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
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


class Wakeup:
    """One parked task and its wake-up: what a ParkingLot does, for one waiter, cheaper."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None

    async def wait(self) -> None:
        self.task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def wake(self) -> None:
        task = self.task
        if task is not None:
            self.task = None
            trio.lowlevel.reschedule(task)
