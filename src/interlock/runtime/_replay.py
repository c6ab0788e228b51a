"""Offline replay: re-run a recorded run against the current machine, with no model call
and no side effect, and report the first place it decides differently.

The recording supplies everything that came from outside the machine's code: the
model's raw outputs, tool results, clock readings, operator actions and the shared
circuit's refusals. The machine's code (tables, schemas, guards, steps, breakers)
runs for real. With the machine that recorded the run, replay reproduces it event
for event; with a changed machine (a stricter guard, say) it shows which recorded
runs would now be decided differently, and where.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ..core import _decider
from ..core._breakers import Trip
from ..core._events import (
    BreakerTripped,
    Escalated,
    Event,
    Failed,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
    Violation,
    expand_prompt,
)
from ..core._exceptions import InterlockError, JournalInconsistent, ReplayDivergence
from ..core._machine import ESCALATE, FAILED, Step
from ..core._messages import Abort, Cancel, Escalate, Propose, Recover, Resume, Start
from ..core._view import RunState, RunView
from ..providers._base import Proposal
from ._requests import answered, failed, reconciled, returned, unanswered

if TYPE_CHECKING:
    from ..core._machine import BreakerPolicy, Machine
    from ..core._messages import Request

#: Fields that never take part in the comparison (wall-clock measurements, not decisions).
_IGNORED = frozenset({"latency"})


class Divergence(msgspec.Struct, frozen=True):
    """Where a replay first differed from its recording."""

    seq: int
    kind: str
    """The recorded event's kind at ``seq`` (or ``end`` if the recording ran out)."""
    expected: str
    got: str


class RunReplay(msgspec.Struct, frozen=True):
    """The replay of one run."""

    run_id: str
    machine: str
    events: int
    """Recorded events compared."""
    divergence: Divergence | None = None

    @property
    def reproduced(self) -> bool:
        return self.divergence is None


class ReplayReport(msgspec.Struct, frozen=True):
    """The replay of many runs."""

    runs: tuple[RunReplay, ...]

    @property
    def reproduced(self) -> int:
        return sum(1 for r in self.runs if r.reproduced)

    @property
    def diverged(self) -> tuple[RunReplay, ...]:
        return tuple(r for r in self.runs if not r.reproduced)

    @property
    def ok(self) -> bool:
        return not self.diverged

    def raise_for_divergence(self) -> None:
        """Raise :class:`ReplayDivergence` for the first diverged run, if any."""
        for run in self.runs:
            if run.divergence is not None:
                d = run.divergence
                raise ReplayDivergence(run.run_id, d.seq, d.expected, d.got)


def _tag(event: Event) -> str:
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def _comparable(event: Event) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(event)
    for name in _IGNORED:
        data.pop(name, None)
    return data


def _describe(event: Event) -> str:
    data = _comparable(event)
    for name in (
        "run_id",
        "seq",
        "ts",
        "prompt",
        "prompt_hash",
        "prompt_base",
        "prompt_prefix",
        "prompt_suffix",
    ):
        data.pop(name, None)
    kind = data.pop("kind", _tag(event))
    text = msgspec.json.encode(data).decode()
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{kind} {text}"


class _Clock:
    """Returns the recorded timestamp of the event about to be produced."""

    def __init__(self, recorded: Sequence[Event]) -> None:
        self.recorded = recorded
        self.position = 0

    def __call__(self) -> float:
        if self.position < len(self.recorded):
            return self.recorded[self.position].ts
        return self.recorded[-1].ts if self.recorded else 0.0


class _RecordedCircuits:
    """Replays the shared circuit: refuses a call exactly where the recording shows a refusal."""

    def __init__(self, recorded: Sequence[Event], clock: _Clock) -> None:
        self.recorded = recorded
        self.clock = clock
        self.trips = 0

    def check(self, tool: str, now: float, policy: BreakerPolicy) -> tuple[Violation, Trip] | None:
        position = self.clock.position
        # The proposal's own event (model_called, step_proposed) is decided in the same
        # request, before the clock moves past it: the verdict is the event after it.
        while position < len(self.recorded) and isinstance(
            self.recorded[position], ModelCalled | StepProposed
        ):
            position += 1
        rejected = self.recorded[position] if position < len(self.recorded) else None
        if not isinstance(rejected, ProposalRejected):
            return None
        violation = next((v for v in rejected.violations if v.code == "circuit_open"), None)
        if violation is None:
            return None
        tripped = self.recorded[position + 1] if position + 1 < len(self.recorded) else None
        if isinstance(tripped, BreakerTripped) and tripped.breaker == "circuit":
            return violation, Trip(
                "circuit", tripped.value, tripped.limit, tripped.detail, tripped.tool
            )
        return violation, Trip("circuit", 0, policy.circuit_failures, violation.message, tool)

    def record(
        self, tool: str, ok: bool, now: float, policy: BreakerPolicy, error: str = ""
    ) -> None:
        pass


def _given(value: Any) -> Any:
    """A recorded optional field, None where the recording left it out."""
    return None if value is msgspec.UNSET else value


def _at(recorded: Sequence[Event], position: int) -> Event | None:
    return recorded[position] if position < len(recorded) else None


def _operator_request(run: RunState, recorded: Sequence[Event], position: int) -> Request | None:
    """The operator's request that produced the events at ``position``, if one did."""
    upcoming = recorded[position]
    if isinstance(upcoming, Resumed):
        if upcoming.to == FAILED:
            return Abort(run_id=run.run_id, seq=run.seq, by=upcoming.by, note=upcoming.note)
        return Resume(
            run_id=run.run_id,
            seq=run.seq,
            by=upcoming.by,
            note=upcoming.note,
            to=upcoming.to,
            payload=upcoming.payload,
        )
    if (
        isinstance(upcoming, Transitioned)
        and upcoming.reason == "operator"
        and upcoming.dst == FAILED
    ):
        failed = _at(recorded, position + 1)
        reason = failed.reason if isinstance(failed, Failed) else "cancelled"
        return Cancel(run_id=run.run_id, seq=run.seq, reason=reason)
    if (
        isinstance(upcoming, Transitioned)
        and upcoming.reason == "driver"
        and upcoming.dst == ESCALATE
    ):  # the run's driver escalated it (Escalate)
        parked = _at(recorded, position + 1)
        if isinstance(parked, Escalated):
            return Escalate(
                run_id=run.run_id, seq=run.seq, reason=parked.reason, detail=parked.detail
            )
    return None


def _call_request(run: RunState, recorded: Sequence[Event], position: int) -> Request | None:
    """The request that told the decider how the run's pending call went, rebuilt from
    the events it produced at ``position`` through the actor's own builders (_requests),
    or None: the recording stops while the call was in flight (a crash)."""
    pending = run.pending
    assert pending is not None
    run_id, seq, key = run.run_id, run.seq, pending.key
    upcoming = recorded[position]
    follows = _at(recorded, position + 1)
    if (isinstance(upcoming, ToolInDoubt) and upcoming.after_crash) or (
        isinstance(upcoming, ToolFailed)
        and isinstance(follows, Transitioned)
        and follows.reason == "recovery"
    ):
        return Recover(run_id=run_id, seq=seq)  # the run was recovered with the call in doubt
    if isinstance(upcoming, ToolInDoubt) or (
        isinstance(upcoming, ToolFailed) and upcoming.in_doubt is True
    ):
        # A failure that may have been applied (applied unknown): reconciled or escalated.
        return failed(
            run_id,
            seq,
            key,
            upcoming.error,
            retryable=False,
            applied=None,
            attempts=upcoming.attempts,
            latency=upcoming.latency,
        )
    if isinstance(upcoming, Reconciled):
        committed = follows if isinstance(follows, ToolCommitted) else None
        return reconciled(
            run_id,
            seq,
            key,
            upcoming.applied,
            upcoming.latency,
            committed.result if committed is not None else None,
            upcoming.error,
        )
    outcome = next(
        (
            e
            for e in recorded[position:]
            if isinstance(e, ToolCommitted | ToolFailed) and e.key == key
        ),
        None,
    )
    if isinstance(outcome, ToolCommitted):
        return returned(
            run_id, seq, key, outcome.tool, outcome.result, outcome.attempts, outcome.latency
        )
    if isinstance(outcome, ToolFailed):
        return failed(
            run_id,
            seq,
            key,
            outcome.error,
            retryable=outcome.retryable,
            applied=False,  # handed back to the model: an in-doubt one is marked so (above)
            attempts=outcome.attempts,
            latency=outcome.latency,
        )
    return None


def _proposal(machine: Machine, run: RunState, upcoming: Event) -> Propose | str:
    """The proposal that produced ``upcoming`` (a step's, the model's answer or failure,
    an operator's), or what replay expected instead (a divergence)."""
    run_id, seq = run.run_id, run.seq
    spec = machine.states.get(run.state)
    if isinstance(spec, Step):  # the step runs again, as the actor runs it
        return _decider.step_proposal(run_id, seq, run.state, spec, RunView(run))
    if isinstance(upcoming, ModelCalled):
        try:
            prompt = expand_prompt(run.prompt_seq, run.prompt, upcoming)
        except ValueError as exc:
            return f"a prompt delta that fits ({exc})"
        answer = Proposal(
            raw=upcoming.raw,
            usage=upcoming.usage,
            model=upcoming.model,
            prompt=prompt,
            response=_given(upcoming.response),
            envelope=_given(upcoming.envelope),
            extra_calls=_given(upcoming.extra_calls) or (),
        )
        msg = answered(run_id, seq, upcoming.model, answer, upcoming.latency)
        # What the journal keeps of an answer the actor read otherwise: a defect it found
        # (the provider returned no Proposal), an answer over the cap kept as an excerpt,
        # a failed call journaled before provider_failed existed.
        return msgspec.structs.replace(
            msg,
            defect=upcoming.defect or "",
            oversized=_given(upcoming.oversized),
            error=upcoming.error,
            legacy=bool(upcoming.error),
        )
    if isinstance(upcoming, ProviderFailed):
        return unanswered(
            run_id,
            seq,
            upcoming.model,
            upcoming.error,
            upcoming.latency,
            retryable=upcoming.retryable,
            retry_after=upcoming.retry_after,
            refused=upcoming.refused is True,
        )
    if isinstance(upcoming, StepProposed) and upcoming.source == "operator":
        return Propose(run_id=run_id, seq=seq, raw=upcoming.raw, source="operator")
    return f"a model call in state {run.state!r}"


def replay_run(machine: Machine, recorded: Sequence[Event]) -> RunReplay:
    """Replay one recorded run against ``machine``; see :func:`replay`."""
    if not recorded or not isinstance(recorded[0], RunStarted):
        raise JournalInconsistent("a recorded run must start with its run_started event")
    first = recorded[0]
    assert isinstance(first, RunStarted)
    run_id = first.run_id
    clock = _Clock(recorded)
    circuits = _RecordedCircuits(recorded, clock)
    produced: list[Event] = []
    live: list[RunState] = []  # the run, once its start is decided

    def divergence(position: int, got: str) -> RunReplay:
        if position < len(recorded):
            event = recorded[position]
            found = Divergence(event.seq, _tag(event), _describe(event), got)
        else:
            found = Divergence(position + 1, "end", "the recording ends here", got)
        return RunReplay(run_id, machine.name, position, found)

    def feed(msg: Request) -> RunReplay | None:
        # The decider the supervisor runs, with the recording's clock and circuits.
        events: list[Event] = []
        now = clock()
        try:
            if isinstance(msg, Start):
                live.append(_decider.start(machine, msg, now, events)[0])
            else:
                _decider.decide(live[0], msg, now, circuits, events)
        except InterlockError as exc:
            return divergence(len(produced), f"the request was refused: {exc}")
        for event in events:
            position = len(produced)
            if position >= len(recorded):
                return divergence(position, _describe(event))
            if _comparable(event) != _comparable(recorded[position]):
                return divergence(position, _describe(event))
            produced.append(event)
            clock.position = len(produced)
        return None

    if first.machine != machine.name:
        return divergence(0, f"run_started of machine {machine.name!r}")
    start = Start(
        run_id=run_id,
        machine=first.machine,
        inputs=dict(first.inputs),
        external=first.external is True,
        trace=first.trace if isinstance(first.trace, str) else "",
    )
    result = feed(start)
    while result is None and len(produced) < len(recorded):
        run, position = live[0], len(produced)
        msg: Request | str | None = _operator_request(run, recorded, position)
        if msg is None:
            if run.terminal:
                return divergence(position, f"the run ended in {run.state}")
            if run.pending is not None:
                msg = _call_request(run, recorded, position)
                if msg is None:
                    break  # the recording stops while a call was in flight: nothing to compare
            else:
                msg = _proposal(machine, run, recorded[position])
        if isinstance(msg, str):
            return divergence(position, msg)
        result = feed(msg)
    return result or RunReplay(run_id, machine.name, len(produced))


def split_runs(events: Iterable[Event]) -> dict[str, list[Event]]:
    """Group a journal's events by run, each run's in seq order."""
    runs: dict[str, list[Event]] = {}
    for event in events:
        runs.setdefault(event.run_id, []).append(event)
    for items in runs.values():
        items.sort(key=lambda e: e.seq)
    return runs


def replay(
    journal: Iterable[Event] | Mapping[str, Sequence[Event]],
    machine: Machine | Sequence[Machine],
) -> ReplayReport:
    """Replay recorded runs against ``machine`` (or the machine each run names).

    Args:
      journal: events of one or more runs (any order), or a mapping of run id to events.
      machine: the machine to replay against, or several (picked by each run's
        ``run_started.machine``). Pass a changed machine to see which runs it would
        decide differently.

    Returns:
      A :class:`ReplayReport`; ``report.ok`` when every run reproduced its recording.
      Nothing is executed: no model call, no tool, no side effect.
    """
    machines = [machine] if not isinstance(machine, Sequence) else list(machine)
    by_name = {m.name: m for m in machines}
    runs = journal if isinstance(journal, Mapping) else split_runs(journal)
    results = []
    for run_id, events in runs.items():
        first = events[0] if events else None
        name = first.machine if isinstance(first, RunStarted) else ""
        chosen = by_name.get(name) or (machines[0] if len(machines) == 1 else None)
        if chosen is None:
            results.append(
                RunReplay(
                    run_id,
                    name,
                    0,
                    Divergence(
                        1,
                        "run_started",
                        f"a run of machine {name!r}",
                        "no such machine to replay against",
                    ),
                )
            )
            continue
        results.append(replay_run(chosen, events))
    return ReplayReport(tuple(results))


__all__ = [
    "ESCALATE",
    "Divergence",
    "ReplayReport",
    "RunReplay",
    "replay",
    "replay_run",
    "split_runs",
]
