"""The escalation queue's rules, in one place: where an escalated run may resume, and what
a repeated or conflicting resume or abort gets.

Pure: no trio, no I/O. The decider checks a resume's target with :func:`resume_targets`;
the supervisor, the gateway and the command line answer an operator's request of a run
that is no longer escalated with :func:`answer_again`, so all three decide it alike.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

import msgspec

from ._events import Escalated, Resumed
from ._exceptions import EscalationResolved, NotEscalated
from ._machine import FAILED

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from ._machine import Machine

Action = Literal["resume", "abort"]


class Resolution(msgspec.Struct, frozen=True, kw_only=True):
    """How an operator resolved a run's last escalation: its ``resumed`` event."""

    action: Action
    by: str
    note: str = ""
    to: str = ""
    """The state it resumed in (``FAILED`` for an abort)."""
    payload: str = ""
    escalated_from: str = ""
    seq: int = 0
    ts: float = 0.0

    def describe(self) -> str:
        """What was done, by whom, when: ``resumed by ops at 2026-12-03 21:40:52 UTC in
        state 'PAY' (seq 11)``."""
        when = datetime.fromtimestamp(self.ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        if self.action == "abort":
            what = f"aborted by {self.by} at {when}"
            if self.note:
                what += f" with the note {self.note!r}"
        else:
            what = f"resumed by {self.by} at {when} in state {self.to!r}"
            if self.payload:
                what += f" with the payload {_short(self.payload)}"
        return f"{what} (seq {self.seq})"


def resume_targets(machine: Machine, origin: str) -> list[str]:
    """The states a run that escalated from ``origin`` may resume in: there, then each
    legal next state of it that is not terminal (a run ends through the gate, with a
    payload, never by an operator's move). If the machine has no ``origin`` any more (it
    changed since), any of its states.
    """
    if origin not in machine.states:
        return list(machine.states)
    tables = machine.tables
    return [
        origin,
        *(
            s
            for s in tables.legal_next(tables.state_id(origin))
            if s in machine.states and s != origin
        ),
    ]


def resolution(events: Iterable[Escalated | Resumed | object]) -> Resolution | None:
    """How the run's last escalation was resolved, from its journal (in seq order); None if
    it never escalated or waits in the queue still."""
    answer: Resumed | None = None
    for event in reversed(list(events)):
        if isinstance(event, Resumed):
            answer = event
        elif isinstance(event, Escalated):
            if answer is None:
                return None
            return Resolution(
                action="abort" if answer.to == FAILED else "resume",
                by=answer.by,
                note=answer.note,
                to=answer.to,
                payload=answer.payload,
                escalated_from=event.state,
                seq=answer.seq,
                ts=answer.ts,
            )
    return None


def escalated_from(events: Iterable[object]) -> str:
    """The state the run's last escalation left (its ``escalated`` event's), from its
    journal; empty if it never escalated."""
    for event in reversed(list(events)):
        if isinstance(event, Escalated):
            return event.state
    return ""


def answer_again(
    run_id: str,
    outcome: str,
    state: str,
    events: Sequence[object],
    action: Action,
    *,
    to: str | None = None,
    payload: str | None = None,
) -> tuple[Resolution, str]:
    """Answer an operator's ``action`` on a run that is not in the escalation queue (it
    is ``outcome`` in ``state``; ``events`` is its journal).

    A repeat of what was done (an abort after the abort; a resume in the same state with
    the same payload after the resume, whoever sends it) is idempotent: it gets what was
    done and the message that says so. Anything else is refused.

    Returns:
      what was done, and the message for the operator.

    Raises:
      NotEscalated: the run never escalated, or no operator resolved its escalation.
      EscalationResolved: an operator resolved it otherwise (the message names what was
        done, by whom and when).
    """
    done = resolution(events)
    if done is None:
        raise NotEscalated(run_id, outcome, state)
    now = f"{outcome} in state {state!r} now"
    if action == "abort":
        if done.action == "abort":
            return done, f"run {run_id!r} was already {done.describe()}; it is {now}"
        raise EscalationResolved(
            f"cannot abort run {run_id!r}: it was {done.describe()} and is {now}; only a run "
            "in the escalation queue can be aborted",
            run_id,
            state,
            done,
        )
    if done.action == "abort":
        raise EscalationResolved(
            f"cannot resume run {run_id!r}: it was {done.describe()} and is {now}; an aborted "
            "run stays ended: start a new run",
            run_id,
            state,
            done,
        )
    target = to or done.escalated_from
    if target == done.to and (payload or "") == done.payload:
        return done, f"run {run_id!r} was already {done.describe()}; it is {now}"
    asked = f"in state {target!r}" if target != done.to else "with another payload"
    if target == done.to and not payload:
        asked = "without a payload"
    raise EscalationResolved(
        f"cannot resume run {run_id!r} {asked}: it was already {done.describe()} and is {now}; "
        "only a run in the escalation queue can be resumed",
        run_id,
        state,
        done,
    )


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
