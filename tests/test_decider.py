"""The decider on its own: plain functions of a run's state, a request, the time and the
circuits. No trio here, no store, no supervisor: every test is a plain ``def``."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import (
    BreakerPolicy,
    Go,
    Machine,
    NotEscalated,
    ProtocolError,
    Step,
    Tool,
    ToolContext,
    Worker,
)
from interlock.core import _decider
from interlock.core._breakers import CircuitBoard
from interlock.core._events import Event
from interlock.core._stats import RuntimeStats
from interlock.core._view import RunState, RunView, fold
from interlock.messages import Propose, Reconciliation, Recover, Report, Resume, Start

SRC = pathlib.Path(_decider.__file__).parent


class Args(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def lookup(args: Args, ctx: ToolContext) -> dict[str, Any]:
    return {"total": 100}


async def charge(args: Args, ctx: ToolContext) -> dict[str, Any]:
    return {"charged": args.order_id}


async def was_charged(key: str, args: Args, ctx: ToolContext) -> Any:
    return None


def machine(*, reconcile: bool = False, failures: int = 3) -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={
            "WORK": Worker(next=["CHECK", "COMPLETED"], tools=["lookup", "charge"]),
            "CHECK": Step(lambda view: Go("COMPLETED", {"checked": True}), next=["COMPLETED"]),
        },
        tools=[
            Tool("lookup", lookup, Args, read_only=True),
            Tool("charge", charge, Args, reconcile=was_charged if reconcile else None),
        ],
        breakers=BreakerPolicy(consecutive_failures=failures),
    )


LOOKUP = '{"tool": "lookup", "args": {"order_id": "o1"}}'
CHARGE = '{"tool": "charge", "args": {"order_id": "o1"}}'
CHECK = '{"next": "CHECK", "data": {"n": 1}}'
DONE = '{"next": "COMPLETED", "data": {"answer": 42}}'


class Run:
    """A run decided by hand: each request at the next tick of a fake clock."""

    def __init__(self, spec: Machine, run_id: str = "r-1") -> None:
        self.circuits = CircuitBoard()
        self.events: list[Event] = []
        self.now = 1000.0
        start = Start(run_id=run_id, machine=spec.name, inputs={"order": "o1"})
        self.state, verdict = _decider.start(spec, start, self.now, self.events)
        assert verdict.accepted
        assert verdict.seq == 1

    def __call__(self, msg: Any) -> Any:
        self.now += 1.0
        return _decider.decide(self.state, msg, self.now, self.circuits, self.events)

    def propose(self, raw: str) -> Any:
        return self(
            Propose(run_id=self.state.run_id, seq=self.state.seq, raw=raw, model="m", prompt="p")
        )

    def report(self, key: str, **fields: Any) -> Any:
        return self(Report(run_id=self.state.run_id, seq=self.state.seq, key=key, **fields))

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


def same_state(a: RunState, b: RunState) -> None:
    fields = ("state", "seq", "data", "output", "tokens", "steps", "consecutive_failures")
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    assert [r.key for r in a.results] == [r.key for r in b.results]
    assert (a.pending.key if a.pending else None) == (b.pending.key if b.pending else None)


# -- purity -----------------------------------------------------------------------------------


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: a module of interlock
                base = node.module or ""
                names.update(f".{base}" if base else f".{alias.name}" for alias in node.names)
            elif node.module:
                names.add(node.module)
    return names


def test_the_decider_and_everything_it_imports_use_no_trio_and_no_store() -> None:
    seen: set[str] = set()
    todo = ["_decider"]
    outside: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = SRC / f"{name}.py"
        if not path.exists():
            path = SRC / name / "__init__.py"
        for imported in _imports(path):
            if imported.startswith("."):
                module = imported[1:].split(".")[0]
                if (SRC / f"{module}.py").exists():
                    todo.append(module)
            else:
                outside.add(imported.split(".")[0])
    assert "_decider" in seen
    assert "_gate" in seen
    assert "_view" in seen
    assert not {"_supervisor", "_journal", "_actor", "_watchdog", "stores"} & seen
    assert "trio" not in outside, sorted(outside)
    assert not {"sqlite3", "psycopg", "httpx", "outcome"} & outside


# -- whole runs -------------------------------------------------------------------------------


def test_a_run_decided_by_hand_folds_back_to_the_same_state() -> None:
    run = Run(machine())
    verdict = run.propose(LOOKUP)
    assert verdict.accepted
    assert verdict.execute is not None
    assert verdict.execute.key == "r-1:WORK:3"
    assert run.state.validated == Args("o1")  # the args the guards saw, for the tool
    verdict = run.report(verdict.execute.key, ok=True, result={"total": 100})
    assert verdict.accepted
    assert verdict.outcome == "running"
    assert run.state.validated is None
    verdict = run.propose(CHECK)
    assert (verdict.accepted, verdict.state) == (True, "CHECK")
    # the step state runs through the same function live and in replay
    spec = run.state.machine.states["CHECK"]
    assert isinstance(spec, Step)
    step = _decider.step_proposal("r-1", run.state.seq, "CHECK", spec, RunView(run.state))
    verdict = run(step)
    assert (verdict.outcome, verdict.state) == ("completed", "COMPLETED")
    assert run.kinds() == [
        "RunStarted", "ModelCalled", "IntentRecorded", "ToolCommitted", "ModelCalled",
        "Transitioned", "StepProposed", "Transitioned", "Completed",
    ]  # fmt: skip
    assert [e.seq for e in run.events] == list(range(1, 10))
    assert [e.ts for e in run.events[1:4]] == [1001.0, 1001.0, 1002.0]  # one reading a request
    same_state(fold(run.state.machine, run.events), run.state)
    assert run.state.output == {"checked": True}  # the final move's data
    assert run.state.data == {"n": 1, "checked": True}


def test_a_step_that_raises_is_a_proposal_with_its_error() -> None:
    def broken(view: RunView) -> Any:
        raise KeyError("missing")

    msg = _decider.step_proposal(
        "r-1", 4, "CHECK", Step(broken, next=["COMPLETED"]), RunView(Run(machine()).state)
    )
    assert (msg.raw, msg.source, msg.seq) == ("", "step", 4)
    assert msg.error == "step 'CHECK' raised KeyError: 'missing'"


def test_rejections_count_up_to_the_breaker_which_escalates() -> None:
    run = Run(machine(failures=2))
    first = run.propose('{"tool": "lookup"')
    assert not first.accepted
    assert [v.code for v in first.violations] == ["malformed"]
    assert run.state.consecutive_failures == 1
    second = run.propose('{"tool": "refund", "args": {}}')
    assert second.outcome == "escalated"
    assert run.kinds()[-4:] == ["ProposalRejected", "BreakerTripped", "Transitioned", "Escalated"]
    assert run.state.escalation is not None
    assert run.state.escalation.reason == "consecutive_failures"


def test_a_refused_request_appends_nothing_and_leaves_the_run_as_it_was() -> None:
    run = Run(machine())
    call = run.propose(CHARGE).execute
    before = (run.state.seq, len(run.events))
    with pytest.raises(ProtocolError, match="reported key 'other' but is waiting for 'r-1:WORK:3'"):
        run.report("other", ok=True)
    with pytest.raises(ProtocolError, match="is at seq 3, the request was made at seq 2"):
        run(Report(run_id="r-1", seq=2, key=call.key, ok=True))
    with pytest.raises(ProtocolError, match="waiting for the outcome of 'r-1:WORK:3'"):
        run.propose(DONE)
    with pytest.raises(NotEscalated):
        run(Resume(run_id="r-1", by="op"))
    assert (run.state.seq, len(run.events)) == before


def test_a_duplicate_report_of_a_committed_call_gets_the_recorded_result() -> None:
    run = Run(machine())
    key = run.propose(LOOKUP).execute.key
    run.report(key, ok=True, result={"total": 100})
    seq = run.state.seq
    again = run(Report(run_id="r-1", seq=seq - 1, key=key, ok=True, result={"total": 1}))
    assert (again.accepted, again.result, run.state.seq) == (True, {"total": 100}, seq)


def test_a_failure_of_a_tool_that_is_not_idempotent_is_in_doubt() -> None:
    run = Run(machine())
    key = run.propose(CHARGE).execute.key
    verdict = run.report(key, ok=False, error="connection reset", retryable=True)
    assert verdict.outcome == "escalated"
    assert run.state.escalation.reason == "in_doubt_side_effect"
    # one that says it was not applied is an ordinary failure, back to the model
    run = Run(machine())
    key = run.propose(CHARGE).execute.key
    verdict = run.report(key, ok=False, error="refused", applied=False)
    assert (verdict.accepted, verdict.outcome) == (False, "running")
    assert run.kinds()[-1] == "ToolFailed"


def test_a_tool_that_reconciles_is_asked_then_executed_once_when_not_applied() -> None:
    run = Run(machine(reconcile=True))
    key = run.propose(CHARGE).execute.key
    verdict = run.report(key, ok=False, error="timed out after 5 s")
    assert verdict.reconcile is not None
    assert verdict.reconcile.key == key
    verdict = run(Reconciliation(run_id="r-1", seq=run.state.seq, key=key, applied=False))
    assert verdict.accepted
    assert verdict.execute is not None
    assert verdict.execute.key == key
    verdict = run.report(key, ok=True, result={"charged": "o1"})
    assert verdict.accepted
    assert run.state.pending is None
    assert run.kinds()[-3:] == ["ToolInDoubt", "Reconciled", "ToolCommitted"]


def test_recovery_reexecutes_a_safe_call_and_escalates_an_unsafe_one() -> None:
    safe = Run(machine())
    key = safe.propose(LOOKUP).execute.key
    folded = fold(safe.state.machine, safe.events)  # after a crash: the intent, no outcome
    assert folded.validated is None
    verdict = _decider.decide(folded, Recover(run_id="r-1"), 2000.0, CircuitBoard(), [])
    assert verdict.execute is not None
    assert verdict.execute.key == key
    unsafe = Run(machine())
    unsafe.propose(CHARGE)
    folded = fold(unsafe.state.machine, unsafe.events)
    events: list[Event] = []
    verdict = _decider.decide(folded, Recover(run_id="r-1"), 2000.0, CircuitBoard(), events)
    assert verdict.outcome == "escalated"
    assert [type(e).__name__ for e in events] == ["ToolFailed", "Transitioned", "Escalated"]


def test_a_provider_failure_is_journaled_and_retried_after_the_same_wait_every_time() -> None:
    waits = []
    for _ in range(2):
        run = Run(machine())
        verdict = run(
            Propose(run_id="r-1", seq=run.state.seq, raw="", model="m", error="503", retryable=True)
        )
        waits.append(verdict.retry_in)
        assert not verdict.accepted
        assert not verdict.violations
        assert run.kinds()[-1] == "ProviderFailed"
        assert run.state.consecutive_failures == 0  # not the model's mistake
    assert waits[0] == waits[1] > 0


def test_the_counts_follow_from_the_events() -> None:
    run = Run(machine())
    stats = RuntimeStats()
    spec = run.state.machine
    stats.count(spec, Start(run_id="r-1", machine="shop"), run.events, 0)
    for raw in ('{"tool": "lookup"', LOOKUP):
        mark = len(run.events)
        msg = Propose(run_id="r-1", seq=run.state.seq, raw=raw, model="m", prompt="p")
        verdict = run(msg)
        stats.count(spec, msg, run.events, mark)
    mark = len(run.events)
    report = Report(run_id="r-1", seq=run.state.seq, key=verdict.execute.key, ok=True, latency=0.5)
    run(report)
    stats.count(spec, report, run.events, mark)
    assert stats.runs_started == {"shop": 1}
    assert stats.verdicts == {("shop", "rejected", "malformed"): 1, ("shop", "accepted", ""): 1}
    assert stats.model_calls == {("shop", "m"): 2}
    assert (stats.tool_calls, stats.side_effects) == ({"lookup": 1}, {})  # read-only
    assert stats.tool_latency["lookup"].total == 1


# -- determinism ------------------------------------------------------------------------------

ANSWERS = st.sampled_from(
    [LOOKUP, CHARGE, CHECK, DONE, "", "{", '{"next": "NOWHERE"}', '{"tool": "lookup", "args": {}}']
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(ANSWERS, st.booleans()), max_size=12))
def test_the_same_requests_decide_the_same_events_and_fold_back(
    script: list[tuple[str, bool]],
) -> None:
    """Two runs given the same requests at the same times make the same events, and
    folding those events from the journal gives the state the live run reached."""
    runs = [Run(machine(failures=4)), Run(machine(failures=4))]
    for run in runs:
        for raw, ok in script:
            state = run.state
            if state.terminal:
                break
            if state.pending is not None:
                run.report(state.pending.key, ok=ok, error="" if ok else "boom", applied=False)
            elif isinstance(state.machine.states[state.state], Step):
                spec = state.machine.states[state.state]
                assert isinstance(spec, Step)
                run(_decider.step_proposal("r-1", state.seq, state.state, spec, RunView(state)))
            else:
                run.propose(raw)
    first, second = runs
    assert [msgspec.to_builtins(e) for e in first.events] == [
        msgspec.to_builtins(e) for e in second.events
    ]
    same_state(fold(first.state.machine, first.events), first.state)
