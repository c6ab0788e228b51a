"""Call and move in one proposal (``Worker(call_and_move=True)``): verified together, the
move journaled with the commit, no move on a failure, and replay reproduces it all."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import (
    Machine,
    MachineDefinitionError,
    Reject,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
)
from interlock.core import _decider
from interlock.core._breakers import CircuitBoard
from interlock.core._events import (
    Event,
    IntentRecorded,
    ToolCommitted,
    Transitioned,
    decode_event,
    encode_event,
)
from interlock.core._gate import _verify, verify
from interlock.core._view import RunState, fold
from interlock.messages import Propose, Reconciliation, Recover, Report, Start
from interlock.providers import ScriptedProvider
from interlock.runtime._replay import replay, replay_run
from interlock.stores import MemoryStore


class Args(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


class Note(msgspec.Struct, forbid_unknown_fields=True):
    note: str


async def lookup(args: Args, ctx: ToolContext) -> dict[str, Any]:
    return {"total": 100}


async def charge(args: Args, ctx: ToolContext) -> dict[str, Any]:
    return {"charged": args.order_id}


async def was_charged(key: str, args: Args, ctx: ToolContext) -> Any:
    return None


def no_o9(args: Args, view: Any) -> Reject | None:
    if args.order_id == "o9":
        return Reject("order o9 is frozen", "use another order", "args.order_id")
    return None


def machine(*, moves: bool = True, reconcile: bool = False) -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={
            "WORK": Worker(
                next=["PAY", "COMPLETED"], tools=["lookup"], data=Note, call_and_move=moves
            ),
            "PAY": Worker(next=["COMPLETED"], tools=["charge"], call_and_move=moves),
        },
        tools=[
            Tool("lookup", lookup, Args, read_only=True, guards=[no_o9]),
            Tool("charge", charge, Args, reconcile=was_charged if reconcile else None),
        ],
    )


def raw(tool: str = "lookup", order: Any = "o1", next_: Any = "PAY", data: Any = None) -> str:
    proposal: dict[str, Any] = {"tool": tool, "args": {"order_id": order}}
    if next_ is not None:
        proposal["next"] = next_
    proposal["data"] = {"note": "n"} if data is None else data
    return msgspec.json.encode(proposal).decode()


class Run:
    """A run decided by hand, one request per tick of a fake clock."""

    def __init__(self, spec: Machine) -> None:
        self.events: list[Event] = []
        self.now = 1000.0
        self.circuits = CircuitBoard()
        start = Start(run_id="r-1", machine=spec.name, inputs={})
        self.state, _ = _decider.start(spec, start, self.now, self.events)

    def __call__(self, msg: Any) -> Any:
        self.now += 1.0
        return _decider.decide(self.state, msg, self.now, self.circuits, self.events)

    def propose(self, text: str) -> Any:
        return self(Propose(run_id="r-1", seq=self.state.seq, raw=text, model="m", prompt="p"))

    def report(self, key: str, **fields: Any) -> Any:
        return self(Report(run_id="r-1", seq=self.state.seq, key=key, **fields))

    def reconciled(self, key: str, applied: bool | None, result: Any = None) -> Any:
        return self(
            Reconciliation(
                run_id="r-1", seq=self.state.seq, key=key, applied=applied, result=result
            )
        )

    def kinds(self, since: int = 0) -> list[str]:
        return [type(e).__name__ for e in self.events[since:]]


def decide_gate(spec: Machine, text: str, fast: bool = True) -> Any:
    run = RunState("r-1", spec)
    run.apply(_start_event(spec))
    check = verify if fast else _verify
    return check(spec, run, text.encode(), 1000.0, None)


def _start_event(spec: Machine) -> Event:
    events: list[Event] = []
    _decider.start(spec, Start(run_id="r-1", machine=spec.name, inputs={}), 1000.0, events)
    return events[0]


def codes(decision: Any) -> list[tuple[str, str]]:
    return [(v.code, v.path) for v in decision.violations]


# -- the definition ---------------------------------------------------------------------------


def test_off_by_default_a_call_that_names_next_is_rejected_as_before() -> None:
    decision = decide_gate(machine(moves=False), raw())
    assert codes(decision) == [("malformed", "$")]
    assert 'both of "tool" and "next"' in decision.violations[0].message
    assert "or both" not in decision.violations[0].message


def test_call_and_move_needs_tools_and_a_bool() -> None:
    with pytest.raises(MachineDefinitionError, match="call_and_move but allows no tools"):
        Machine("m", "A", {"A": Worker(next=["DONE"], call_and_move=True)})
    with pytest.raises(MachineDefinitionError, match="call_and_move must be True or False"):
        Machine(
            "m",
            "A",
            {"A": Worker(next=["DONE"], tools=["t"], call_and_move="yes")},  # type: ignore[arg-type]
            tools=[Tool("t", lookup, Args)],
        )


# -- verification -------------------------------------------------------------------------


@pytest.mark.parametrize("fast", [True, False])
def test_an_accepted_call_and_move_carries_the_call_and_the_move(fast: bool) -> None:
    decision = decide_gate(machine(), raw(data={"note": "checked"}), fast)
    assert decision.accepted
    assert (decision.tool.name, decision.args) == ("lookup", {"order_id": "o1"})
    assert (decision.target, decision.data) == ("PAY", {"note": "checked"})


@pytest.mark.parametrize(
    ("proposal", "expected"),
    [
        # stage one: the tool allowed here and the transition legal, both reported
        (
            raw(tool="nope", next_="NOWHERE"),
            [("unknown_tool", "tool"), ("illegal_transition", "next")],
        ),
        (raw(tool="charge"), [("tool_not_allowed", "tool")]),
        (raw(next_="WORK"), [("illegal_transition", "next")]),
        # an illegal move wins over bad args: stage one comes before the schemas
        (raw(order=5, next_="NOWHERE"), [("illegal_transition", "next")]),
        # stage two: the args' schema and the data's schema, both reported
        (raw(order=5, data={"note": 1}), [("schema", "args.order_id"), ("schema", "data.note")]),
        (raw(data={"note": 1}), [("schema", "data.note")]),
        (raw(data={"other": "x"}), [("schema", "data")]),
        # stage three: the call's guards, only once the move's data is valid
        (raw(order="o9"), [("guard", "args.order_id")]),
        (raw(order="o9", data={"note": 1}), [("schema", "data.note")]),
    ],
)
def test_the_call_and_the_move_are_verified_stage_by_stage(
    proposal: str, expected: list[tuple[str, str]]
) -> None:
    for fast in (True, False):
        decision = decide_gate(machine(), proposal, fast)
        got = codes(decision)
        if expected == [("schema", "data")]:  # the path of an unknown field names it
            assert [(c, p.split(".")[0]) for c, p in got] == expected, proposal
        else:
            assert got == expected, (proposal, fast)
        assert decision.tool is None or not decision.accepted


@settings(max_examples=200, deadline=None)
@given(
    tool=st.sampled_from(["lookup", "charge", "nope"]),
    order=st.sampled_from(["o1", "o9", 5]),
    next_=st.sampled_from(["PAY", "COMPLETED", "WORK", "NOWHERE", None]),
    data=st.sampled_from([{"note": "n"}, {"note": 1}, {}, {"x": 1}]),
)
def test_the_single_decode_path_and_the_two_pass_path_agree(
    tool: str, order: Any, next_: Any, data: Any
) -> None:
    spec = machine()
    text = raw(tool, order, next_, data)
    fast, slow = decide_gate(spec, text, True), decide_gate(spec, text, False)
    assert codes(fast) == codes(slow)
    assert (fast.target, fast.data, fast.args) == (slow.target, slow.data, slow.args)
    if fast.accepted:
        # accepted only when every stage of the call and of the move passed
        assert (tool, order) == ("lookup", "o1")
        assert fast.target == (next_ or "")
        if next_ is not None:  # a plain call's data is not read, as before
            assert data == {"note": "n"}
            assert next_ in ("PAY", "COMPLETED")


# -- the journal of a step -----------------------------------------------------------------


def test_a_committed_call_moves_in_the_same_decision() -> None:
    run = Run(machine())
    verdict = run.propose(raw(data={"note": "looked up"}))
    assert verdict.execute is not None
    assert run.kinds(1) == ["ModelCalled", "IntentRecorded"]
    intent = run.events[-1]
    assert isinstance(intent, IntentRecorded)
    assert (intent.next, intent.data) == ("PAY", {"note": "looked up"})
    assert run.state.state == "WORK"  # nothing moves before the call succeeds
    before = len(run.events)
    verdict = run.report(verdict.execute.key, ok=True, result={"total": 100})
    assert run.kinds(before) == ["ToolCommitted", "Transitioned"]
    moved = run.events[-1]
    assert isinstance(moved, Transitioned)
    assert (moved.src, moved.dst, moved.delta, moved.reason) == (
        "WORK",
        "PAY",
        {"note": "looked up"},
        "call",
    )
    assert (verdict.accepted, verdict.state, verdict.seq) == (True, "PAY", run.state.seq)
    assert run.state.data == {"note": "looked up"}
    assert run.state.results[-1].result == {"total": 100}
    # into a success state: the run completes with the call's commit
    verdict = run.propose(raw("charge", next_="COMPLETED", data={}))
    before = len(run.events)
    verdict = run.report(verdict.execute.key, ok=True, result={"charged": "o1"})
    assert run.kinds(before) == ["ToolCommitted", "Transitioned", "Completed"]
    assert verdict.outcome == "completed"
    assert run.kinds().count("ModelCalled") == 2  # two steps, two model calls


def test_a_plain_call_or_move_in_such_a_state_is_as_before() -> None:
    run = Run(machine())
    verdict = run.propose('{"tool": "lookup", "args": {"order_id": "o1"}}')
    intent = run.events[-1]
    assert (intent.next, intent.data) == (msgspec.UNSET, msgspec.UNSET)
    assert b"next" not in encode_event(intent)  # the bytes of an intent as before
    before = len(run.events)
    run.report(verdict.execute.key, ok=True, result={})
    assert run.kinds(before) == ["ToolCommitted"]
    run.propose('{"next": "PAY", "data": {"note": "x"}}')
    assert run.state.state == "PAY"


def test_an_intent_written_before_the_field_existed_decodes_and_folds() -> None:
    old = {
        "kind": "intent_recorded",
        "run_id": "r-1",
        "seq": 2,
        "ts": 1.0,
        "state": "WORK",
        "tool": "lookup",
        "args": {"order_id": "o1"},
        "key": "r-1:WORK:2",
    }
    event = decode_event(msgspec.msgpack.encode(old))
    assert isinstance(event, IntentRecorded)
    assert event.next is msgspec.UNSET
    spec = machine()
    folded = fold(spec, [_start_event(spec), event])
    assert folded.pending is not None
    assert folded.pending.key == "r-1:WORK:2"


# -- failures --------------------------------------------------------------------------------


def test_a_failed_call_makes_no_move_and_goes_back_to_the_model() -> None:
    run = Run(machine())
    key = run.propose(raw()).execute.key
    before = len(run.events)
    verdict = run.report(key, ok=False, error="503 after 3 attempts", retryable=True, attempts=3)
    assert run.kinds(before) == ["ToolFailed"]
    assert (verdict.accepted, verdict.state, run.state.state) == (False, "WORK", "WORK")
    assert run.state.pending is None
    assert run.state.history[-1].kind == "tool_failed"  # what the next prompt shows
    assert run.state.data == {}


def test_a_call_in_doubt_without_reconcile_escalates_and_does_not_move() -> None:
    run = Run(machine())
    run.report(run.propose(raw()).execute.key, ok=True, result={})
    assert run.state.state == "PAY"
    key = run.propose(raw("charge", next_="COMPLETED", data={})).execute.key
    before = len(run.events)
    verdict = run.report(key, ok=False, error="timed out after 5 s")
    assert run.kinds(before) == ["ToolFailed", "Transitioned", "Escalated"]
    assert run.events[-2].dst == "ESCALATE"
    assert verdict.outcome == "escalated"
    assert run.state.escalation.state == "PAY"


def _in_doubt_in_pay(run: Run) -> str:
    key = run.propose(raw()).execute.key
    run.report(key, ok=True, result={})
    key = run.propose(raw("charge", next_="COMPLETED", data={})).execute.key
    verdict = run.report(key, ok=False, error="timed out after 5 s")
    assert verdict.reconcile is not None
    return key


def test_reconciled_as_applied_completes_the_move() -> None:
    run = Run(machine(reconcile=True))
    key = _in_doubt_in_pay(run)
    before = len(run.events)
    verdict = run.reconciled(key, True, {"charged": "o1"})
    assert run.kinds(before) == ["Reconciled", "ToolCommitted", "Transitioned", "Completed"]
    assert run.events[before + 1].reconciled is True
    assert verdict.outcome == "completed"


def test_reconciled_as_not_applied_executes_again_then_moves() -> None:
    run = Run(machine(reconcile=True))
    key = _in_doubt_in_pay(run)
    verdict = run.reconciled(key, False)
    assert verdict.execute is not None
    assert verdict.execute.key == key
    assert run.state.state == "PAY"  # no move yet
    before = len(run.events)
    verdict = run.report(key, ok=True, result={"charged": "o1"})
    assert run.kinds(before) == ["ToolCommitted", "Transitioned", "Completed"]
    assert verdict.outcome == "completed"


def test_reconcile_that_cannot_tell_escalates_and_does_not_move() -> None:
    run = Run(machine(reconcile=True))
    key = _in_doubt_in_pay(run)
    before = len(run.events)
    verdict = run.reconciled(key, None)
    assert run.kinds(before) == ["Reconciled", "ToolFailed", "Transitioned", "Escalated"]
    assert run.events[-2].dst == "ESCALATE"
    assert verdict.outcome == "escalated"


def test_after_a_crash_the_intent_still_names_the_move() -> None:
    # A safe call is executed again after the crash, and its commit moves the run.
    run = Run(machine())
    key = run.propose(raw(data={"note": "after crash"})).execute.key
    folded = fold(run.state.machine, run.events)  # the crash: the intent, no outcome
    assert folded.pending.next == "PAY"
    events: list[Event] = []
    verdict = _decider.decide(folded, Recover(run_id="r-1"), 2000.0, CircuitBoard(), events)
    assert verdict.execute.key == key
    report = Report(run_id="r-1", seq=folded.seq, key=key, ok=True, result={"total": 1})
    verdict = _decider.decide(folded, report, 2001.0, CircuitBoard(), events)
    assert [type(e).__name__ for e in events] == ["ToolCommitted", "Transitioned"]
    assert (folded.state, folded.data) == ("PAY", {"note": "after crash"})
    # An unsafe call that reconciles: in doubt after the crash, then applied moves.
    run = Run(machine(reconcile=True))
    run.report(run.propose(raw()).execute.key, ok=True, result={})
    key = run.propose(raw("charge", next_="COMPLETED", data={})).execute.key
    folded = fold(run.state.machine, run.events)
    events = []
    verdict = _decider.decide(folded, Recover(run_id="r-1"), 2000.0, CircuitBoard(), events)
    assert verdict.reconcile is not None
    applied = Reconciliation(run_id="r-1", seq=folded.seq, key=key, applied=True, result={})
    verdict = _decider.decide(folded, applied, 2001.0, CircuitBoard(), events)
    assert verdict.outcome == "completed"
    assert "Transitioned" in [type(e).__name__ for e in events]


# -- replay ------------------------------------------------------------------------------------

_OUTCOMES = st.sampled_from(["ok", "failed", "doubt_applied", "doubt_not_applied", "doubt_unknown"])


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["move", "plain", "bad_move", "go"]),
            _OUTCOMES,
            st.booleans(),  # crash after the intent (fold, then Recover)
        ),
        min_size=1,
        max_size=8,
    ),
    reconcile=st.booleans(),
)
def test_replay_of_any_recorded_call_and_move_run_reproduces_it(
    steps: list[tuple[str, str, bool]], reconcile: bool
) -> None:
    spec = machine(reconcile=reconcile)
    run = Run(spec)
    for kind, outcome, crash in steps:
        if run.state.terminal:
            break
        state = run.state.state
        tool = "lookup" if state == "WORK" else "charge"
        target = "PAY" if state == "WORK" else "COMPLETED"
        data = {"note": "n"} if state == "WORK" else {}
        if kind == "go":
            run.propose(msgspec.json.encode({"next": target, "data": data}).decode())
            continue
        text = (
            raw(tool, next_=target, data=data)
            if kind == "move"
            else raw(tool, next_="NOWHERE" if kind == "bad_move" else None, data=data)
        )
        verdict = run.propose(text)
        if verdict.execute is None:
            continue
        key = verdict.execute.key
        if crash:
            run.state = fold(spec, run.events)
            verdict = run(Recover(run_id="r-1"))
            if verdict.execute is None and verdict.reconcile is None:
                continue
        if verdict.reconcile is None:
            if outcome == "ok":
                verdict = run.report(key, ok=True, result={"n": len(run.events)})
            elif outcome == "failed":
                verdict = run.report(key, ok=False, error="refused", applied=False)
            else:
                verdict = run.report(key, ok=False, error="timed out")
        while verdict.reconcile is not None:
            applied = {"doubt_applied": True, "doubt_not_applied": False}.get(outcome)
            verdict = run.reconciled(key, applied, {"r": 1} if applied else None)
            if verdict.execute is not None:
                verdict = run.report(key, ok=True, result={"again": True})
    moves = [e for e in run.events if isinstance(e, Transitioned) and e.reason == "call"]
    for move in moves:  # a move named by a call follows that call's commit, nothing else
        before = run.events[move.seq - 2]
        assert isinstance(before, ToolCommitted)
    result = replay_run(spec, run.events)
    assert result.reproduced, result.divergence
    assert result.events == len(run.events)
    same = fold(spec, run.events)
    assert (same.state, same.data, same.seq) == (run.state.state, run.state.data, run.state.seq)


# -- end to end: the actor, the supervisor, the journal -----------------------------------------


async def _record(spec: Machine, script: list[str]) -> list[Event]:
    store = MemoryStore()
    async with open_supervisor([spec], store, provider=ScriptedProvider(script)) as sup:
        handle = await sup.start_run("shop", {}, run_id="e2e")
        result = await handle.wait()
        assert result.outcome == "completed", result
    return list(await store.load("e2e"))


def test_a_live_run_makes_one_model_call_per_call_and_move_step_and_replays() -> None:
    spec = machine()
    moving = [raw(data={"note": "a"}), raw("charge", next_="COMPLETED", data={})]
    events = trio.run(_record, spec, moving)
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("ModelCalled") == 2
    assert kinds.count("Transitioned") == 2
    assert replay(events, [spec]).ok
    # the same work as calls, then moves: four model calls
    plain = machine(moves=False)
    two_step = [
        '{"tool": "lookup", "args": {"order_id": "o1"}}',
        '{"next": "PAY", "data": {"note": "a"}}',
        '{"tool": "charge", "args": {"order_id": "o1"}}',
        '{"next": "COMPLETED"}',
    ]
    events = trio.run(_record, plain, two_step)
    assert [type(e).__name__ for e in events].count("ModelCalled") == 4


def test_show_prints_the_move_an_intent_makes_when_its_call_succeeds() -> None:
    from interlock.cli._show import _describe
    from interlock.core._events import IntentRecorded

    plain = IntentRecorded(
        run_id="r", seq=3, ts=1.0, state="WORK", tool="lookup", args={"id": 1}, key="r:WORK:3"
    )
    moving = IntentRecorded(
        run_id="r",
        seq=3,
        ts=1.0,
        state="WORK",
        tool="lookup",
        args={"id": 1},
        key="r:WORK:3",
        next="PAY",
        data={"note": "paid"},
    )
    assert _describe(plain) == 'intent lookup({"id":1}) key=r:WORK:3'
    assert (
        _describe(moving)
        == 'intent lookup({"id":1}) key=r:WORK:3, then -> PAY data {"note":"paid"}'
    )
    bare = msgspec.structs.replace(moving, data=msgspec.UNSET)
    assert _describe(bare) == 'intent lookup({"id":1}) key=r:WORK:3, then -> PAY'
