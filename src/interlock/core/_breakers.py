"""Breakers: repeat and budget checks on one run, and the per-tool circuit shared by all runs."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ._events import Violation

if TYPE_CHECKING:
    from ._machine import BreakerPolicy, Budgets
    from ._view import RunState

#: Breaker names, as journal events and metrics carry them.
CONSECUTIVE_FAILURES = "consecutive_failures"
REPEAT = "repeat"
TOKEN_BUDGET = "token_budget"
STEP_BUDGET = "step_budget"
DEADLINE = "deadline"
CIRCUIT = "circuit"
BREAKERS = (CONSECUTIVE_FAILURES, REPEAT, TOKEN_BUDGET, STEP_BUDGET, DEADLINE, CIRCUIT)


#: How the error of an attempt the runtime itself cut begins (this process stalled past
#: its lease): not the downstream's failure, so no circuit counts it.
LEASE_CUT = "cut: this process could not renew the run's lease in time"


@dataclass(frozen=True, slots=True)
class Trip:
    """A breaker decision: ``value`` reached ``limit``."""

    breaker: str
    value: float
    limit: float
    detail: str
    tool: str = ""


def check_budgets(run: RunState, budgets: Budgets, now: float) -> tuple[Violation, Trip] | None:
    """Return the first exhausted budget of ``run`` as a violation and a trip, or None.

    The one budget predicate: the gate asks it before reading any proposal, a call or
    a move alike, and the supervisor for a proposal that never came. A budget is
    exhausted once the run has gone past it; at the limit, proposals still pass.
    """
    if run.tokens > budgets.tokens:
        detail = f"run used {run.tokens} tokens; the budget is {budgets.tokens}"
        return (
            Violation(
                "budget",
                "$",
                f"token budget exhausted: {detail}",
                "no further proposals are accepted",
            ),
            Trip(TOKEN_BUDGET, run.tokens, budgets.tokens, detail),
        )
    if run.steps > budgets.steps:
        detail = f"run made {run.steps} proposals; the budget is {budgets.steps}"
        return (
            Violation(
                "budget",
                "$",
                f"step budget exhausted: {detail}",
                "no further proposals are accepted",
            ),
            Trip(STEP_BUDGET, run.steps, budgets.steps, detail),
        )
    elapsed = now - run.started_ts
    if elapsed > budgets.deadline:
        detail = f"run has been going for {elapsed:.3f} s; the deadline is {budgets.deadline:g} s"
        return (
            Violation(
                "budget", "$", f"deadline passed: {detail}", "no further proposals are accepted"
            ),
            Trip(DEADLINE, round(elapsed, 6), budgets.deadline, detail),
        )
    return None


def check_repeat(
    run: RunState, tool: str, call_hash: int, policy: BreakerPolicy, args_text: str
) -> tuple[Violation, Trip] | None:
    """Trip when this exact call (tool + canonical args) was already made ``policy.repeats`` times."""
    made = run.repeats_of(call_hash)
    if made >= policy.repeats:
        detail = f"{tool}({args_text}) proposed {made + 1} times in this run; the limit is {policy.repeats}"
        return (
            Violation(
                "repeat",
                "args",
                f"repeated call: {detail}",
                f"do not call {tool} with the same args again; use the recorded result or move on",
            ),
            Trip(REPEAT, made + 1, policy.repeats, detail, tool),
        )
    return None


CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
#: Circuit states as numbers, for the metrics gauge.
CIRCUIT_STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class _Circuit:
    __slots__ = ("failures", "last_error", "opened_at", "state", "trial")

    def __init__(self) -> None:
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.trial = False
        self.last_error = ""


class CircuitBoard:
    """One circuit per tool, shared by every run of a supervisor.

    Closed: calls pass; ``threshold`` consecutive failures open it. Open: calls are
    refused until ``cooldown`` seconds have passed, then one trial call is let
    through (half-open); its success closes the circuit, its failure opens it again.
    """

    def __init__(self) -> None:
        self._circuits: dict[str, _Circuit] = {}
        self.trips = 0

    def state(self, tool: str) -> str:
        circuit = self._circuits.get(tool)
        return CLOSED if circuit is None else circuit.state

    def states(self) -> dict[str, str]:
        return {tool: circuit.state for tool, circuit in self._circuits.items()}

    def check(self, tool: str, now: float, policy: BreakerPolicy) -> tuple[Violation, Trip] | None:
        """Return a circuit_open violation and trip if ``tool`` may not be called now."""
        circuit = self._circuits.get(tool)
        if circuit is None or circuit.state == CLOSED:
            return None
        reopen = circuit.opened_at + policy.circuit_cooldown
        if circuit.state == OPEN and now >= reopen:
            circuit.state = HALF_OPEN
            circuit.trial = False
        if circuit.state == HALF_OPEN and not circuit.trial:
            circuit.trial = True
            return None
        when = datetime.fromtimestamp(reopen, UTC).isoformat(timespec="seconds")
        wait = max(0.0, reopen - now)
        detail = (
            f"circuit of tool {tool!r} is {circuit.state} after {circuit.failures} consecutive "
            f"failures (last: {circuit.last_error}); it lets a trial call through at {when} "
            f"(in {wait:.1f} s)"
        )
        return (
            Violation(
                "circuit_open",
                "tool",
                detail,
                f"do not call {tool} until {when}; choose another action or wait",
            ),
            Trip(CIRCUIT, circuit.failures, policy.circuit_failures, detail, tool),
        )

    def record(
        self, tool: str, ok: bool, now: float, policy: BreakerPolicy, error: str = ""
    ) -> None:
        """Count the outcome of one call of ``tool`` (a failure the runtime caused, see
        :data:`LEASE_CUT`, is not the tool's and is not counted)."""
        if not ok and error.startswith(LEASE_CUT):
            return
        circuit = self._circuits.get(tool)
        if circuit is None:
            if ok:
                return
            circuit = self._circuits[tool] = _Circuit()
        if ok:
            circuit.state = CLOSED
            circuit.failures = 0
            circuit.trial = False
            return
        circuit.failures += 1
        circuit.last_error = error[:200]
        if circuit.state == HALF_OPEN or (
            circuit.state == CLOSED and circuit.failures >= policy.circuit_failures
        ):
            circuit.state = OPEN
            circuit.opened_at = now
            circuit.trial = False
            self.trips += 1
