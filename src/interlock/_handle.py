"""A run as its starter holds it: the handle to wait on, and how the run ended."""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from ._watchdog import armed_for


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

    __slots__ = (
        "_asked",
        "_cancelled",
        "_deadline_passed",
        "_deadline_token",
        "_done",
        "_error",
        "_in_provider",
        "_model",
        "_result",
        "_scope",
        "_tool_cut",
        "_tool_token",
        "_validated",
        "machine",
        "run_id",
    )

    def __init__(self, run_id: str, machine: str) -> None:
        self.run_id = run_id
        self.machine = machine
        self._done = trio.Event()
        self._scope = trio.CancelScope()
        """The scope the run's actor runs in (see run_actor)."""
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        """cancel_run cancelled the scope (not the deadline)."""
        self._deadline_passed = False
        """The run's deadline has passed (set by the supervisor's watchdog)."""
        self._deadline_token = 0
        """The watchdog's token of the run's deadline (negative); 0 before it is armed."""
        self._in_provider = False
        """The actor is waiting for the model: the watchdog may cut the wait."""
        self._model = ""
        self._asked = 0.0
        """The model asked last, and when (perf_counter), for a call the deadline cuts."""
        self._tool_token = 0
        """The watchdog's token of the tool attempt in flight; 0 when none is."""
        self._tool_cut = 0
        """The token of the latest attempt the watchdog cut at its timeout."""
        self._validated: tuple[str, Any] = ("", None)
        """The key of the run's latest accepted call and its validated args."""

    def _fire(self, token: int) -> None:
        """The watchdog's entry ``token`` is due: act on it if it is still this handle's."""
        if not armed_for(self, token):
            return
        if token > 0:  # the tool attempt's timeout: cut the attempt
            self._tool_cut = token
            self._scope.cancel()
        else:  # the run's deadline: cut the wait for the model, if that is what runs
            self._deadline_passed = True
            if self._in_provider:
                self._scope.cancel()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> RunResult:
        """Wait until the run is terminal or escalated, and return how it ended.

        Raises:
          StoreError: the run's journal could not be written; its state is unknown.
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
