"""A run as its starter holds it: the handle to wait on, and how the run ended."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._machine import FAILED

if TYPE_CHECKING:
    from ..core._view import RunState


class RunResult(msgspec.Struct, frozen=True, gc=False):
    """How a run ended (or where it stopped, for an escalated run)."""

    run_id: str
    machine: str
    state: str
    outcome: str
    """completed, escalated or failed."""
    output: Any = None
    reason: str = ""
    seq: int = 0
    """The seq of the run's last journal event."""


class RunHandle:
    """A started run. ``await handle.wait()`` returns its :class:`RunResult`."""

    __slots__ = ("_done", "_error", "_finished", "_result", "external", "machine", "run_id")

    def __init__(self, run_id: str, machine: str, *, external: bool = False) -> None:
        self.run_id = run_id
        self.machine = machine
        self.external = external
        """The run is driven by its caller (``start_run(external=True)``), not an actor:
        it finishes only as the caller's requests finish it."""
        # NOTE: made by the first wait() only: a trio.Event holds a set, the largest
        # part of a handle, and most handles of a busy process are never awaited.
        self._done: trio.Event | None = None
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._finished = False

    @property
    def done(self) -> bool:
        return self._finished

    async def wait(self) -> RunResult:
        """Wait until the run is terminal or escalated, and return how it ended.

        Raises:
          StoreError: the run's journal could not be written; its state is unknown.
          InternalError: a bug in interlock stopped the run; its journal is intact.
        """
        if not self._finished:
            if self._done is None:
                self._done = trio.Event()
            await self._done.wait()
        else:
            await trio.lowlevel.checkpoint()  # as Event.wait does when it is set
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self, result: RunResult | None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error
        self._finished = True
        if self._done is not None:
            self._done.set()


def run_result(run: RunState) -> RunResult:
    """Where ``run`` is: how it ended, or where it stopped."""
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
