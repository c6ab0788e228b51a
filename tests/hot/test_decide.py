"""The compiled decide path (``interlock.core._decide``, from ext/_decide.pyx) and its pure-Python
twin (``interlock.core._view.PyRunState`` and ``interlock.core._decider``'s own paths) agree.

Each test drives the same requests through both, one run state of each kind, and asserts
the same verdicts (or the same error), the same events, and the same folded state after
every request; hypothesis writes the requests: calls that pass, fail a guard, repeat, name
a tool not allowed or a state not legal, break the schema or the JSON, move on, fail at the
provider, carry text UTF-8 cannot hold, come at a stale seq; reports that succeed, fail,
or name another key.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import (
    BreakerPolicy,
    Budgets,
    Go,
    Machine,
    Reject,
    RunView,
    Step,
    Tool,
    ToolContext,
    Worker,
)
from interlock.core import _decider, _view
from interlock.core._breakers import CircuitBoard
from interlock.core._events import Event, TokenUsage
from interlock.core._messages import Propose, Report, Start

if os.environ.get("INTERLOCK_NO_EXTENSIONS"):
    pytest.skip(
        "INTERLOCK_NO_EXTENSIONS is set: there is no compiled decide path to compare",
        allow_module_level=True,
    )
try:
    compiled: ModuleType = importlib.import_module("interlock.core._decide")
except ImportError as exc:
    pytest.skip(
        f"interlock.core._decide cannot be imported ({exc}); "
        "build it with `python setup.py build_ext --inplace`",
        allow_module_level=True,
    )

pytestmark = pytest.mark.c_extension


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    amount: float


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


def within_total(args: Refund, view: RunView) -> Reject | None:
    if args.amount > view.inputs["total"]:
        return Reject(f"args.amount: {args.amount} is over the total", "refund less", "args.amount")
    return None


def odd_guard(args: Refund, view: RunView) -> Any:
    if args.amount == 13:
        raise RuntimeError("thirteen")
    if args.amount == 14:
        return "not a Reject"
    return None


async def noop(args: Any, ctx: ToolContext) -> dict[str, Any]:
    return {"ok": True}


def shop() -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={
            "WORK": Worker(next=["MOVE", "CHECK", "DONE"], tools=["refund", "lookup", "charge"]),
            "MOVE": Worker(next=["DONE", "WORK"], tools=["refund"], call_and_move=True),
            "CHECK": Step(lambda view: Go("DONE", {"checked": True}), next=["DONE"]),
        },
        tools=[
            Tool("refund", noop, Refund, guards=(within_total, odd_guard), idempotent=True),
            Tool("lookup", noop, Lookup, read_only=True),
            Tool("charge", noop, Lookup),
        ],
        breakers=BreakerPolicy(consecutive_failures=4, repeats=2, circuit_failures=2),
        budgets=Budgets(steps=14, tokens=10**6, deadline=10**6),
    )


MACHINE = shop()

RAWS = (
    '{"tool": "refund", "args": {"order_id": "o1", "amount": 5}}',
    '{"tool": "refund", "args": {"order_id": "o2", "amount": 7.5}}',
    '{"tool": "refund", "args": {"order_id": "o1", "amount": 500}}',
    '{"tool": "refund", "args": {"order_id": "o1", "amount": 13}}',
    '{"tool": "refund", "args": {"order_id": "o1", "amount": 14}}',
    '{"tool": "refund", "args": {"order_id": "o1"}}',
    '{"tool": "refund", "args": {"order_id": "o1", "amount": 5, "x": 1}}',
    '{"tool": "refund", "args": {"order_id": "o1", "order_id": "o2", "amount": 5}}',
    '{"tool": "refund", "args": {"order_id": "o3", "amount": 1}, "next": "DONE"}',
    '{"tool": "refund", "args": {"order_id": "o3", "amount": 1}, "next": "WORK", "data": {"k": 1}}',
    '{"tool": "lookup", "args": {"order_id": "o1"}}',
    '{"tool": "charge", "args": {"order_id": "o9"}}',
    '{"tool": "nope", "args": {}}',
    '{"next": "MOVE", "data": {"n": 1}}',
    '{"next": "CHECK"}',
    '{"next": "DONE", "data": {"answer": 42}}',
    '{"next": "NOWHERE"}',
    '{"tool": "refund", "args": {"order_id": "é", "amount": 2}}',
    "not json",
    "",
    '{"tool": "refund", "args": {"order_id": "\\ud800", "amount": 2}}',
)

PROMPTS = (
    "",
    "p",
    "system: refund the order\n" * 4,
    "system: refund the order\n" * 4 + "history: one more line\n",
    "system: refund the order\n" * 4 + "history: one more line\nand another\n",
    "système: rembourser\n" * 4,
    "a lone \udc80 surrogate",
)

proposals = st.builds(
    lambda raw, prompt, model, error, usage, stale, response, extra: (
        "propose",
        dict(
            raw=raw,
            prompt=prompt,
            model=model,
            error=error,
            usage=TokenUsage(prompt=usage, completion=usage // 2),
            response=response,
            extra_calls=extra,
        ),
        stale,
    ),
    # Mostly what passes (so runs go on long enough to call, commit and move), and
    # everything else often enough.
    st.one_of(st.sampled_from(RAWS[:2] + RAWS[8:11] + RAWS[13:15]), st.sampled_from(RAWS)),
    st.one_of(st.sampled_from(PROMPTS[2:5]), st.sampled_from(PROMPTS)),
    st.sampled_from(("m", "m", "m", "modèle")),
    st.sampled_from(("",) * 7 + ("timeout",)),
    st.integers(min_value=0, max_value=3000),
    st.sampled_from((False,) * 7 + (True,)),
    st.sampled_from((None, None, '{"id": 1}', "réponse")),
    st.sampled_from(((), (), (("refund", "{}"),))),
)
reports = st.builds(
    lambda ok, wrong_key, applied, result: ("report", ok, wrong_key, applied, result),
    st.sampled_from((True, True, True, False)),
    st.sampled_from((False,) * 7 + (True,)),
    st.sampled_from((None, False, True)),
    st.sampled_from(({"ok": True}, [1, 2], "done", None, {"big": "x" * 300})),
)
# Mostly a proposal and the report of its call, as a run goes; and either one alone.
requests = st.lists(
    st.one_of(st.tuples(proposals, reports), st.tuples(proposals), st.tuples(reports)),
    min_size=1,
    max_size=20,
).map(lambda groups: [request for group in groups for request in group])


class Side:
    """One implementation's run: its state, circuits, events and clock."""

    def __init__(self, compiled_path: bool) -> None:
        self.compiled = compiled_path
        self.propose = compiled.on_propose if compiled_path else _decider._on_propose
        self.report = compiled.on_report if compiled_path else _decider._on_report
        cls = compiled.RunState if compiled_path else _view.PyRunState
        self.circuits = CircuitBoard()
        self.events: list[Event] = []
        start = Start(run_id="r-1", machine="shop", inputs={"total": 100.0})
        real = _decider.RunState
        _decider.RunState = cls  # type: ignore[misc]
        try:
            self.run, _ = _decider.start(MACHINE, start, 1000.0, self.events)
        finally:
            _decider.RunState = real  # type: ignore[misc]
        assert type(self.run) is cls

    def __call__(self, request: tuple[Any, ...], now: float) -> tuple[Any, ...]:
        run = self.run
        if request[0] == "propose":
            fields, stale = request[1], request[2]
            msg: Any = Propose(run_id="r-1", seq=run.seq - 1 if stale else run.seq, **fields)
            decide = self.propose
        else:
            _, ok, wrong_key, applied, result = request
            key = run.pending.key if run.pending is not None and not wrong_key else "r-1:X:1"
            msg = Report(
                run_id="r-1",
                seq=run.seq,
                key=key,
                ok=ok,
                result=result if ok else None,
                error="" if ok else "it broke",
                applied=applied,
            )
            decide = self.report
        mark = len(self.events)
        try:
            verdict = decide(run, msg, now, self.circuits, self.events)
        except Exception as exc:
            return ("raised", type(exc), str(exc), self.events[mark:])
        return ("returned", verdict, self.events[mark:])


def state_of(run: Any) -> dict[str, Any]:
    """Every attribute of a run state, the prompt hash's progress as what it hashed."""
    names = [name for name in _view.PyRunState.__slots__ if name != "machine"]
    out = {name: getattr(run, name) for name in names if name != "_hash_state"}
    hashed = run._hash_state
    out["_hash_state"] = (
        None if hashed is None else (hashed[0], hashed[1], hashed[2].copy().hexdigest())
    )
    out["results"] = [(r.tool, r.args, r.result, r.key, r.seq) for r in run.results]
    out["terminal"] = run.terminal
    out["committed"] = run.committed
    return out


def drive(requests_: list[tuple[Any, ...]]) -> tuple[Side, Side]:
    fast, twin = Side(True), Side(False)
    now = 1000.0
    for request in requests_:
        now += 0.5
        got, want = fast(request, now), twin(request, now)
        assert got == want
        assert state_of(fast.run) == state_of(twin.run)
    assert fast.events == twin.events
    return fast, twin


@settings(max_examples=300, deadline=None)
@given(requests)
def test_the_compiled_path_decides_every_request_as_its_twin_does(
    requests_: list[tuple[Any, ...]],
) -> None:
    drive(requests_)


@settings(max_examples=100, deadline=None)
@given(requests)
def test_a_compiled_fold_of_the_journal_is_the_twins_fold(requests_: list[tuple[Any, ...]]) -> None:
    fast, _ = drive(requests_)
    events = list(fast.events)
    real = _view.RunState
    try:
        folded_fast = _view.fold(MACHINE, events)
        _view.RunState = _view.PyRunState  # type: ignore[misc]
        folded_twin = _view.fold(MACHINE, events)
    finally:
        _view.RunState = real  # type: ignore[misc]
    assert type(folded_fast) is compiled.RunState
    assert type(folded_twin) is _view.PyRunState
    folded = state_of(folded_fast)
    assert folded == state_of(folded_twin)
    # Folded from the journal is the state the decisions left (the caches start empty,
    # and the args the guards saw are not journaled).
    live = state_of(fast.run)
    for cache in ("_hash_state", "validated"):
        folded.pop(cache)
        live.pop(cache)
    assert folded == live


#: The collaborators ``_decider`` gave the compiled path at its import.
INSTALLED = compiled.installed()
#: Each part of a ``Collaborators`` (all required, keyword-only), as it reads them back.
PARTS = (
    "frame", "in_frame", "violation_signature", "proposal_data", "call_hash", "no_data",
    "no_turns", "run_view", "canonical_encode", "on_propose", "on_report", "reject",
    "transition", "is_fallback", "close", "delta_by_reference", "verify", "checked_call",
    "plan", "decision", "envelope_decode", "envelope", "move_data", "dict_decode",
    "circuit_board", "ok",
)  # fmt: skip


def collaborators_with(**changes: Any) -> Any:
    """The installed collaborators with ``changes`` made."""
    parts = {name: getattr(INSTALLED, name) for name in PARTS} | {"short_json": _view._SHORT}
    return compiled.Collaborators(**(parts | changes))


def test_the_compiled_path_is_given_the_twins_own_parts() -> None:
    """What ``_decider`` installs is its own paths, the view's and the gate's: the
    compiled path hands a step to the very functions the twin runs."""
    from interlock.core import _breakers, _gate

    assert INSTALLED is not None
    assert INSTALLED.on_propose is _decider._on_propose
    assert INSTALLED.on_report is _decider._on_report
    assert INSTALLED.verify is _gate.verify
    assert INSTALLED.envelope is _gate._Envelope
    assert INSTALLED.circuit_board is _breakers.CircuitBoard
    assert INSTALLED.no_data is _view._NO_DATA
    assert INSTALLED.run_view is _view.RunView
    assert INSTALLED.delta_by_reference == _decider._DELTA_BY_REFERENCE
    # the envelope's fields are read from their slots, not by name
    assert min(INSTALLED.env_next, INSTALLED.env_tool, INSTALLED.env_data) >= 0


def test_collaborators_are_all_named_and_checked() -> None:
    parts = {name: getattr(INSTALLED, name) for name in PARTS if name != "verify"}
    with pytest.raises(TypeError, match="verify"):
        compiled.Collaborators(**parts, short_json=_view._SHORT)
    with pytest.raises(ImportError, match=r"out of date; rebuild it"):
        collaborators_with(short_json=_view._SHORT + 1)
    with pytest.raises(TypeError, match=r"envelope and circuit_board must be classes"):
        collaborators_with(envelope=None)
    with pytest.raises(TypeError):
        compiled.install(None)


def test_a_step_of_calls_takes_the_compiled_path_from_end_to_end() -> None:
    """The ordinary call and its success are decided by the compiled module itself: the
    twin's paths are never entered for them (their counters stay at zero)."""
    calls = {"propose": 0, "report": 0, "transition": 0}
    real_propose, real_report = _decider._on_propose, _decider._on_report

    def counted(name: str, function: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            calls[name] += 1
            return function(*args)

        return wrapper

    compiled.install(
        collaborators_with(
            on_propose=counted("propose", real_propose),
            on_report=counted("report", real_report),
            transition=counted("transition", _decider._transition),
        )
    )
    try:
        side = Side(True)
        for i in range(5):
            raw = f'{{"tool": "refund", "args": {{"order_id": "o{i}", "amount": 5}}}}'
            kind, verdict, events = side(
                ("propose", dict(raw=raw, prompt="p" * (80 + i)), False), 1.0 + i
            )
            assert kind == "returned"
            assert verdict.execute is not None
            assert [type(e).__name__ for e in events] == ["ModelCalled", "IntentRecorded"]
            kind, verdict, events = side(("report", True, False, None, {"ok": True}), 1.5 + i)
            assert kind == "returned"
            assert verdict.accepted
            assert [type(e).__name__ for e in events] == ["ToolCommitted"]
        assert calls == {"propose": 0, "report": 0, "transition": 0}
        # So is a move, and one that ends the run's state machine in a success.
        move = '{"next": "MOVE", "data": {"n": 1}}'
        kind, verdict, events = side(("propose", dict(raw=move, prompt="p" * 90), False), 7.0)
        assert kind == "returned"
        assert verdict.state == "MOVE"
        assert [type(e).__name__ for e in events] == ["ModelCalled", "Transitioned"]
        done = '{"next": "DONE", "data": {"answer": 42}}'
        kind, verdict, events = side(("propose", dict(raw=done, prompt="p" * 91), False), 8.0)
        assert verdict.outcome == "completed"
        assert [type(e).__name__ for e in events] == ["ModelCalled", "Transitioned", "Completed"]
        assert calls == {"propose": 0, "report": 0, "transition": 0}
        side = Side(True)
        # A rejection is the twin's to decide.
        side(("propose", dict(raw="not json", prompt="p"), False), 9.0)
        assert calls["propose"] == 0  # handed its helpers, not its path
        side(("propose", dict(raw=RAWS[0], prompt="p", error="boom"), False), 10.0)
        assert calls["propose"] == 1
    finally:
        compiled.install(INSTALLED)


# -- a batch of requests: the supervisor's compiled loop and the journal's own ------------

#: One request of a batch: (what, run index, raw) — a proposal at the run's seq, at a stale
#: seq or at seq 0 (unchecked), a report of the run's pending call (or of a key it never
#: had), a Sync, or a proposal for a run that does not exist.
batch_requests = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from(
                ("propose",) * 6 + ("stale", "unseq", "report", "failed", "sync", "unknown")
            ),
            st.integers(0, 2),
            st.one_of(st.sampled_from(RAWS[:2] + RAWS[8:11] + RAWS[13:16]), st.sampled_from(RAWS)),
        ),
        min_size=1,
        max_size=8,
    ),
    min_size=1,
    max_size=8,
)


def _batch_side(lane: str, batches: list[list[tuple[str, int, str]]]) -> dict[str, Any]:
    """Decide ``batches`` with one supervisor (``lane``: its compiled loop, or the
    journal's), on a memory store and a clock that ticks per reading."""
    import trio

    from interlock import open_supervisor
    from interlock.core._messages import Sync
    from interlock.stores import MemoryStore

    ticks = iter(range(10**6))
    store = MemoryStore()
    out: list[Any] = []

    async def main() -> None:
        async with open_supervisor(
            [shop()], store, clock=lambda: 1000.0 + next(ticks) * 0.25
        ) as sup:
            journal = sup._journal
            if lane == "loop":
                inner = journal._decide_each
            else:
                assert journal.decide_many is not None
                inner = journal.decide_many
            wakes: list[bool] = []

            def recording(msgs: Any, events: list[Any]) -> Any:
                results, wake = inner(msgs, events)
                wakes.append(wake)
                return results, wake

            journal.decide_many = recording
            runs = [f"r-{n}" for n in range(3)]
            for run_id in runs:
                await sup.start_run("shop", {"total": 100.0}, run_id=run_id, external=True)
            # one run as if driven here (when its verdicts may go out before the write
            # differs), though no actor drives it
            sup._runs["r-2"].external = False
            for batch in batches:
                msgs: list[Any] = []
                for what, index, raw in batch:
                    run_id = runs[index]
                    run = sup._runs.get(run_id)
                    seq = run.seq if run is not None else 1
                    if what == "unknown":
                        msgs.append(Propose(run_id="nobody", seq=1, raw=raw))
                    elif what == "sync":
                        msgs.append(Sync(run_id=run_id))
                    elif what in ("report", "failed"):
                        pending = run.pending if run is not None else None
                        key = pending.key if pending is not None else f"{run_id}:WORK:99"
                        ok = what == "report"
                        msgs.append(
                            Report(
                                run_id=run_id,
                                seq=seq,
                                key=key,
                                ok=ok,
                                result={"ok": True} if ok else None,
                                error="" if ok else "it broke",
                                latency=0.125,
                            )
                        )
                    else:
                        at = {"propose": seq, "stale": seq - 1, "unseq": 0}[what]
                        usage = TokenUsage(prompt=len(raw), completion=index)
                        msgs.append(
                            Propose(run_id=run_id, seq=at, raw=raw, usage=usage, latency=0.01)
                        )
                results = sup.submit_many_nowait(msgs)
                out.append(
                    [
                        ("error", type(r).__name__, str(r))
                        if isinstance(r, Exception)
                        else ("verdict", r)
                        for r in results
                    ]
                )
                await sup.request(Sync(run_id=runs[0]))
            stats = sup.stats
            out.append(
                {
                    name: dict(getattr(stats, name))
                    for name in (
                        "tokens",
                        "model_calls",
                        "verdicts",
                        "transitions",
                        "runs_started",
                        "runs_finished",
                        "tool_calls",
                        "tool_errors",
                        "side_effects",
                        "breaker_trips",
                        "escalation_reasons",
                    )
                }
            )
            out.append(
                {
                    model: (h.counts, h.sum, h.total)
                    for model, h in sorted(stats.model_latency.items())
                }
            )
            # timed: the buckets differ from run to run, the number of samples does not
            out.append({name: h.total for name, h in stats.verify_latency.items()})
            out.append(wakes)

    trio.run(main)
    journals = {run_id: store._journal.get(run_id) for run_id in ("r-0", "r-1", "r-2")}
    return {"answers": out, "journals": journals}


@settings(max_examples=60, deadline=None)
@given(batch_requests)
def test_the_compiled_batch_loop_decides_as_the_journals_loop(
    batches: list[list[tuple[str, int, str]]],
) -> None:
    """``Supervisor.submit_many_nowait`` decides a batch (the gateway's) with the compiled
    loop (``_decide.decide_many``) exactly as with the journal's own loop over
    ``Supervisor._decide``: the same verdicts and refusals in the same places, the same
    journals, the same counters."""
    assert _batch_side("decide_many", batches) == _batch_side("loop", batches)


def test_every_hot_field_is_read_from_its_slot() -> None:
    """The compiled path reads the fields of the Structs a proposal passes through from
    their slots (about five instructions, against some 160 by name); a field msgspec came
    to hold otherwise would be read by name, correct but slower, so its offset is -1."""
    offsets = compiled.slot_offsets()
    assert len(offsets) > 40
    assert "_Envelope.next" in offsets  # the gate's, bound once it is imported
    assert all(offset > 0 for offset in offsets.values()), {
        name: offset for name, offset in offsets.items() if offset <= 0
    }


def test_a_proposal_of_a_subclass_of_propose_is_decided_as_the_twin_decides_it() -> None:
    """Fields are read from their slots only on the exact class; a subclass's proposal
    goes the twin's way (the same verdict, events and state)."""

    class Tagged(Propose, frozen=True, tag="tagged_propose"):
        note: str = ""

    fast, twin = Side(True), Side(False)
    results = []
    for side in (fast, twin):
        msg = Tagged(run_id="r-1", seq=side.run.seq, raw='{"next": "MOVE", "data": {"n": 1}}')
        results.append(side.propose(side.run, msg, 1001.0, side.circuits, side.events))
    assert results[0] == results[1]
    assert results[0].accepted
    assert fast.events == twin.events
    assert state_of(fast.run) == state_of(twin.run)
