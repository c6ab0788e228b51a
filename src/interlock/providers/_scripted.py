"""A provider that replays a script: for tests, demos and replay."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import trio

from ..core._events import TokenUsage
from ..core._exceptions import ProviderError
from ._base import Proposal, estimate_tokens, render_prompt

if TYPE_CHECKING:
    from ..core._view import RunView


def _abort(_: object) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.SUCCEEDED


class ScriptExhausted(ProviderError):
    """The script has no more outputs for this run. Retrying cannot help: the run
    escalates with ``provider_unavailable`` at once."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class ScriptedProvider:
    """Returns scripted raw outputs in order.

    Args:
      script: one list of raw outputs shared by every run, a mapping of run id to
        its own list, or a function ``view -> raw`` (an "oracle").
      model: the model name recorded for each call.
      latency: seconds to sleep before each answer, or a function ``view -> seconds``.
    """

    def __init__(
        self,
        script: Sequence[str] | Mapping[str, Sequence[str]] | Callable[[RunView], str],
        *,
        model: str = "scripted",
        latency: float | Callable[[RunView], float] = 0.0,
    ) -> None:
        self.model = model
        self._script = script
        self._latency = latency
        self._positions: dict[str, int] = {}

    def _next_raw(self, view: RunView) -> str:
        script = self._script
        if callable(script):
            return script(view)
        outputs = script.get(view.run_id, ()) if isinstance(script, Mapping) else script
        position = self._positions.get(view.run_id, 0)
        if position >= len(outputs):
            raise ScriptExhausted(
                f"script for run {view.run_id!r} has {len(outputs)} outputs; all were used"
            )
        self._positions[view.run_id] = position + 1
        return outputs[position]

    async def propose(self, view: RunView) -> Proposal:
        latency = self._latency(view) if callable(self._latency) else self._latency
        if latency > 0:
            # trio.sleep(latency), with the bodies of sleep_until and sleep_forever
            # inlined: the same cancel scope with a deadline, without their two frames
            # and the abort closure each sleep makes (per run waiting on the model).
            with trio.move_on_at(trio.current_time() + latency):
                await trio.lowlevel.wait_task_rescheduled(_abort)
                raise RuntimeError("the scripted provider's sleep was rescheduled")
        else:
            await trio.lowlevel.checkpoint()
        prompt = render_prompt(view)
        raw = self._next_raw(view)
        return Proposal(
            raw=raw,
            usage=TokenUsage(estimate_tokens(prompt), estimate_tokens(raw)),
            model=self.model,
            prompt=prompt,
        )
