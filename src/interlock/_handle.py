"""A run as its starter holds it: the handle to wait on, and how the run ended."""

from __future__ import annotations

from typing import Any

import msgspec
import trio


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

    __slots__ = ("_done", "_error", "_result", "external", "machine", "run_id")

    def __init__(self, run_id: str, machine: str, *, external: bool = False) -> None:
        self.run_id = run_id
        self.machine = machine
        self.external = external
        """The run is driven by its caller (``start_run(external=True)``), not an actor:
        it finishes only as the caller's requests finish it."""
        self._done = trio.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> RunResult:
        """Wait until the run is terminal or escalated, and return how it ended.

        Raises:
          StoreError: the run's journal could not be written; its state is unknown.
          InternalError: a bug in interlock stopped the run; its journal is intact.
        """
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self, result: RunResult | None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error
        self._done.set()
