"""Runs driven from outside, with no actor: the caller owns the model and the tools and
drives the run with ``Supervisor.submit`` through the same messages (#15; the gateway's
external runs build on this)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from interlock import Machine, ProtocolError, Tool, Worker, open_supervisor, replay
from interlock.messages import Escalate, Propose, Report
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore, open_sqlite_store


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    cents: int


async def never(args: Any, ctx: Any) -> Any:  # the caller executes; the runtime never does
    raise AssertionError("an external run's tool is executed by its caller")


def shop() -> Machine:
    return Machine(
        "shop",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", never, Charge)],
    )


CHARGE = '{"tool": "charge", "args": {"cents": 500}}'
DONE = '{"next": "COMPLETED", "data": {"receipt": "r-9"}}'


async def test_an_external_run_is_proposed_reported_and_completed_by_its_caller() -> None:
    store = MemoryStore()
    async with open_supervisor([shop()], store) as sup:  # no provider: none is needed
        handle = await sup.start_run("shop", run_id="x-1", external=True)
        view = sup.view("x-1")
        assert (view.state, view.allowed_tools, view.legal_next) == (
            "PAY",
            ("charge",),
            ("COMPLETED",),
        )
        bad = await sup.submit(Propose(run_id="x-1", seq=view.seq, raw='{"tool": "refund"}'))
        assert (bad.accepted, bad.violations[0].code) == (False, "unknown_tool")
        verdict = await sup.submit(Propose(run_id="x-1", seq=bad.seq, raw=CHARGE))
        assert verdict.execute is not None
        key = verdict.execute.key
        assert (verdict.execute.tool, verdict.execute.args) == ("charge", {"cents": 500})
        done = await sup.submit(
            Report(run_id="x-1", seq=verdict.seq, key=key, ok=True, result={"charged": 500})
        )
        assert done.accepted
        # a retried report of the same key gets the recorded result, not a second commit
        again = await sup.submit(Report(run_id="x-1", key=key, ok=True, result={"charged": 1}))
        assert again.result == {"charged": 500}
        end = await sup.submit(Propose(run_id="x-1", seq=done.seq, raw=DONE))
        assert end.outcome == "completed"
        result = await handle.wait()
        assert (result.outcome, result.output) == ("completed", {"receipt": "r-9"})
    events = await store.load("x-1")
    assert events[0].external is True
    assert [type(e).__name__ for e in events].count("ToolCommitted") == 1
    assert replay(events, shop()).diverged == ()


async def test_a_stale_proposal_is_refused() -> None:
    async with open_supervisor([shop()]) as sup:
        await sup.start_run("shop", run_id="x-1", external=True)
        first = await sup.submit(Propose(run_id="x-1", seq=1, raw='{"next": "NOWHERE"}'))
        with pytest.raises(ProtocolError, match=r"^run 'x-1' is at seq 3, the request was made"):
            await sup.submit(Propose(run_id="x-1", seq=1, raw=DONE))
        assert first.seq == 3


async def test_a_failure_the_caller_cannot_rule_out_is_in_doubt() -> None:
    store = MemoryStore()
    async with open_supervisor([shop()], store) as sup:
        handle = await sup.start_run("shop", run_id="x-1", external=True)
        verdict = await sup.submit(Propose(run_id="x-1", seq=1, raw=CHARGE))
        assert verdict.execute is not None
        await sup.submit(
            Report(run_id="x-1", seq=verdict.seq, key=verdict.execute.key, ok=False, error="reset")
        )
        result = await handle.wait()
    assert (result.outcome, result.reason) == ("escalated", "in_doubt_side_effect")


async def test_submit_refuses_a_run_its_actor_drives() -> None:
    async with open_supervisor([shop()], provider=ScriptedProvider([DONE])) as sup:
        handle = await sup.start_run("shop", run_id="a-1")
        with pytest.raises(ProtocolError, match=r"^run 'a-1' is driven by its actor"):
            await sup.submit(Propose(run_id="a-1", raw=DONE))
        await handle.wait()


async def test_after_a_restart_an_external_run_waits_for_its_caller(tmp_path: Any) -> None:
    """Resuming does not drive an external run (no actor, no model call), and its call in
    flight stays pending until the caller reports it with its key."""
    path = str(tmp_path / "j.db")
    store = await open_sqlite_store(path)
    async with open_supervisor([shop()], store) as sup:
        await sup.start_run("shop", run_id="x-1", external=True)
        verdict = await sup.submit(Propose(run_id="x-1", seq=1, raw=CHARGE))
    await store.aclose()
    assert verdict.execute is not None
    store = await open_sqlite_store(path)
    try:
        async with open_supervisor([shop()], store, provider=ScriptedProvider([])) as sup:
            (handle,) = await sup.resume_unfinished()
            assert not handle.done
            done = await sup.submit(
                Report(run_id="x-1", key=verdict.execute.key, ok=True, result={"charged": 500})
            )
            await sup.submit(Propose(run_id="x-1", seq=done.seq, raw=DONE))
            assert (await handle.wait()).outcome == "completed"
        assert replay(await store.load("x-1"), shop()).diverged == ()
    finally:
        await store.aclose()


async def test_an_escalated_external_run_resumes_external_and_its_caller_drives_it_on() -> None:
    store = MemoryStore()
    async with open_supervisor([shop()], store) as sup:
        await sup.start_run("shop", run_id="x-4", external=True)
        verdict = await sup.submit(Propose(run_id="x-4", seq=1, raw=CHARGE))
        assert verdict.execute is not None
        doubt = await sup.submit(
            Report(run_id="x-4", seq=verdict.seq, key=verdict.execute.key, ok=False, error="reset")
        )
        assert doubt.outcome == "escalated"
        handle = await sup.resume_escalated("x-4", by="ana", note="not charged", to="PAY")
        assert handle.external  # no actor: submit would refuse a run an actor drives
        again = await sup.submit(Propose(run_id="x-4", seq=sup.view("x-4").seq, raw=CHARGE))
        assert again.execute is not None
        assert again.execute.key != verdict.execute.key


async def test_a_driver_escalates_its_run_for_what_the_machine_cannot_see(tmp_path: Any) -> None:
    """Escalate parks the run for an operator with the driver's reason and detail; it is
    refused while a call is in flight and once the run is parked or ended, and an operator resumes
    the run as after any escalation."""
    store = await open_sqlite_store(str(tmp_path / "j.db"))
    async with open_supervisor([shop()], store) as sup:
        await sup.start_run("shop", run_id="x-1", external=True)
        verdict = await sup.submit(Propose(run_id="x-1", raw=CHARGE))
        assert verdict.execute is not None
        with pytest.raises(ProtocolError, match=r"has a call of 'charge' in flight .* report"):
            await sup.external.submit(Escalate(run_id="x-1", reason="drift"))
        await sup.submit(Report(run_id="x-1", key=verdict.execute.key, ok=True, result={}))
        parked = await sup.external.submit(
            Escalate(run_id="x-1", reason="drift", detail="the server changed charge")
        )
        assert (parked.accepted, parked.state, parked.outcome) == (False, "ESCALATE", "escalated")
        with pytest.raises(ProtocolError, match="is escalated in state 'ESCALATE'"):
            await sup.external.submit(Escalate(run_id="x-1", reason="other"))
        record = await store.get_run("x-1")
        assert (record.outcome, record.reason, record.detail) == (
            "escalated",
            "drift",
            "the server changed charge",
        )
        await sup.resume_escalated("x-1", by="ops")
        end = await sup.submit(Propose(run_id="x-1", raw=DONE))
        assert end.outcome == "completed"
        with pytest.raises(ProtocolError, match="is completed"):
            await sup.external.submit(Escalate(run_id="x-1", reason="late"))
    events = await store.load("x-1")
    await store.aclose()
    assert [type(e).__name__ for e in events].count("Escalated") == 1
    assert replay(events, shop()).diverged == ()


async def test_a_read_only_calls_intent_waits_for_the_next_write_and_any_others_is_written_at_once(
    tmp_path: Any,
) -> None:
    """Decided without waiting (decide_many), a read-only call's intent starts no write of
    its own (nothing to protect: it is written with the run's next flush, its commit's);
    the intent of a call that may change something is written at once. Both modes."""
    import trio

    machine = Machine(
        "two",
        "GO",
        {"GO": Worker(next=["COMPLETED"], tools=["look", "charge"])},
        tools=[
            Tool("look", never, {"type": "object"}, read_only=True),
            Tool("charge", never, Charge),
        ],
    )
    batches: list[list[str]] = []
    wrote = trio.Event()

    def written(events: Any) -> None:
        batches.append([type(e).__name__ for e in events])
        wrote.set()

    store = await open_sqlite_store(str(tmp_path / "j.db"))
    async with open_supervisor([machine], store) as sup:
        sup.on_written.append(written)
        await sup.external.start("two", run_id="x-1")
        batches.clear()
        wrote = trio.Event()
        [looked] = sup.external.decide_many(
            [Propose(run_id="x-1", raw='{"tool": "look", "args": {}}')]
        )
        assert looked.execute is not None
        await trio.sleep(0.2)
        assert batches == []  # no write of its own
        [done] = sup.external.decide_many(
            [Report(run_id="x-1", key=looked.execute.key, ok=True, result={"seen": 1})]
        )
        assert done.accepted
        with trio.fail_after(10):
            await wrote.wait()
        assert len(batches) == 1
        assert {"IntentRecorded", "ToolCommitted"} <= set(batches[0]), batches
        wrote = trio.Event()
        [charged] = sup.external.decide_many(
            [Propose(run_id="x-1", raw=CHARGE.replace("500", "7"))]
        )
        assert charged.execute is not None
        with trio.fail_after(10):  # written without a sync or another request
            await wrote.wait()
        assert "IntentRecorded" in batches[1], batches
    await store.aclose()


async def test_many_proposals_are_decided_at_once_each_as_alone(tmp_path: Any) -> None:
    """Supervisor.submit_many_nowait (the gateway's batches): in order, each verdict the
    one submit_nowait would give, a refusal in its own place, one write for them all."""
    from interlock.messages import Sync

    async def decide(store: Any, many: bool) -> tuple[list[Any], list[list[Any]]]:
        async with open_supervisor([shop()], store) as sup:
            for n in range(4):
                await sup.start_run("shop", run_id=f"m-{n}", external=True)
            seqs = [sup.view(f"m-{n}").seq for n in range(4)]
            msgs = [
                Propose(run_id="m-0", seq=seqs[0], raw=CHARGE),
                Propose(run_id="m-1", seq=seqs[1] + 7, raw=CHARGE),  # out of order
                Propose(run_id="m-2", seq=seqs[2], raw='{"tool": "refund"}'),  # rejected
                Propose(run_id="m-3", seq=seqs[3], raw=DONE),
            ]
            if many:
                batches = sup.stats.flush_events["batches"]
                results: list[Any] = sup.submit_many_nowait(msgs)
                await sup.request(Sync(run_id="m-0"))
                assert sup.stats.flush_events["batches"] == batches + 1
            else:
                results = []
                for msg in msgs:
                    try:
                        results.append(sup.submit_nowait(msg))
                    except ProtocolError as exc:
                        results.append(exc)
                await sup.request(Sync(run_id="m-0"))
        journaled = [[type(e).__name__ for e in await store.load(f"m-{n}")] for n in range(4)]
        await store.aclose()
        return results, journaled

    many, journaled = await decide(await open_sqlite_store(tmp_path / "many.db"), True)
    alone, journaled_alone = await decide(MemoryStore(), False)
    assert journaled == journaled_alone
    assert [type(r) for r in many] == [type(r) for r in alone]
    assert isinstance(many[1], ProtocolError)
    assert str(many[1]) == str(alone[1])
    for got, want in zip(many, alone, strict=True):
        if not isinstance(got, Exception):
            assert (got.accepted, got.state, got.seq, got.outcome) == (
                want.accepted,
                want.state,
                want.seq,
                want.outcome,
            )
    assert (many[0].execute.key, many[2].accepted, many[3].outcome) == (
        alone[0].execute.key,
        False,
        "completed",
    )


@pytest.mark.parametrize("lane", ["decide_many", "loop"])
async def test_a_bug_deciding_one_proposal_of_many_ends_that_run_only(
    lane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug met deciding one proposal of a batch ends that run only, half of its decision
    dropped; the others are decided and written. Both ways of deciding a batch: the
    supervisor's compiled loop (where the decide path is compiled) and the journal's own."""
    from interlock.core import _decider
    from interlock.errors import InternalError
    from interlock.messages import Sync

    original = _decider.propose  # the decide path in use: compiled, or its twin

    def buggy(run: Any, msg: Any, now: float, circuits: Any, events: list[Any]) -> Any:
        if msg.run_id == "b-0":
            events.append(object())  # half of a decision, then the bug
            raise ZeroDivisionError("a bug")
        return original(run, msg, now, circuits, events)

    store = MemoryStore()
    async with open_supervisor([shop()], store) as sup:
        if lane == "loop":
            sup._journal.decide_many = None
        elif sup._journal.decide_many is None:
            pytest.skip("the decide path is not compiled: the journal's loop decides batches")
        for n in range(3):
            await sup.start_run("shop", run_id=f"b-{n}", external=True)
        seqs = [sup.view(f"b-{n}").seq for n in range(3)]
        monkeypatch.setattr(_decider, "propose", buggy)
        results = sup.submit_many_nowait(
            [Propose(run_id=f"b-{n}", seq=seqs[n], raw=CHARGE) for n in (1, 0, 2)]
        )
        monkeypatch.setattr(_decider, "propose", original)
        assert isinstance(results[1], InternalError)
        assert str(results[1]).startswith("run 'b-0' was stopped by a bug in interlock")
        assert isinstance(results[1].__cause__, ZeroDivisionError)
        assert results[0].execute is not None
        assert results[2].execute is not None
        await sup.request(Sync(run_id="b-1"))
    for run_id in ("b-1", "b-2"):
        assert "IntentRecorded" in [type(e).__name__ for e in await store.load(run_id)]
    assert [type(e).__name__ for e in await store.load("b-0")] == ["RunStarted"]


async def test_a_driver_reaches_the_run_table_through_its_port() -> None:
    """``Supervisor.external``, the port of every outside driver (the gateway, a proxy):
    it starts, drives, decides a batch and settles, looks runs up and lists them, holds a
    copy folded from the journal and forgets it; never a hosted run."""
    import trio

    from interlock.core._view import fold

    store = MemoryStore()
    hosted = Machine("hosted", "WORK", {"WORK": Worker(next=["COMPLETED"], tools=[])})
    script = ScriptedProvider(['{"next": "COMPLETED", "data": {}}'])
    async with open_supervisor([shop(), hosted], store, provider=script) as sup:
        runs = sup.external
        handle = await runs.start("shop", run_id="p-1")
        other = await runs.start("shop", run_id="p-2")
        assert handle.external
        assert "p-1" in runs
        assert runs.get("p-1") is not None
        assert runs.get("nope") is None
        assert {"p-1", "p-2"} <= set(runs)
        assert len(runs) >= 2
        call = await runs.submit(Propose(run_id="p-1", seq=runs.get("p-1").seq, raw=CHARGE))
        assert call.execute is not None
        # a batch: each request's verdict or its own error, none raised
        seq = runs.get("p-2").seq
        results = runs.decide_many(
            [Propose(run_id="p-2", seq=seq, raw=CHARGE), Propose(run_id="p-9", raw=CHARGE)]
        )
        assert results[0].execute is not None
        assert isinstance(results[1], Exception)
        assert "p-9" in str(results[1])
        await runs.sync("p-2")
        key = results[0].execute.key
        ended = runs.decide_many(
            [Report(run_id="p-2", seq=results[0].seq, key=key, ok=True, result={})]
        )
        assert ended[0].outcome == "running"  # the report moves it on; DONE ends it
        seq = runs.get("p-2").seq
        done = runs.decide_many([Propose(run_id="p-2", seq=seq, raw=DONE)])
        assert done[0].outcome == "completed"
        await runs.sync("p-2")
        runs.settle("p-2")
        assert "p-2" not in runs
        assert (await other.wait()).outcome == "completed"
        # a copy another process advanced is forgotten, and held again once folded afresh
        copy = runs.get("p-1")
        assert not runs.forget("p-1", object())  # type: ignore[arg-type]  (not the copy held)
        assert runs.forget("p-1", copy)
        assert "p-1" not in runs
        assert "p-1" not in sup.handles
        folded = fold(shop(), await store.load("p-1"))
        assert runs.hold(folded) is folded
        assert runs.hold(fold(shop(), await store.load("p-1"))) is folded  # one copy
        # a hosted run is looked up, never held or forgotten by a driver
        work = await sup.start_run("hosted", run_id="h-1")
        await work.wait()
        started = fold(hosted, [(await store.load("h-1"))[0]])
        with pytest.raises(ValueError, match="'h-1' is hosted"):
            runs.hold(started)
    # once the supervisor is closed, a batch's every entry gets that error
    results = runs.decide_many([Propose(run_id="p-1", raw=CHARGE)] * 2)
    assert [type(r) for r in results] == [trio.ClosedResourceError] * 2


@pytest.mark.parametrize("depth", [1_000, 100_000])
async def test_a_proposal_nested_too_deep_is_malformed_and_the_run_goes_on(depth: int) -> None:
    # The compiled decide path caught only msgspec.DecodeError around its decoders: a
    # proposal nested past the decoder's recursion limit raised RecursionError there and
    # ended the run as a bug in interlock, where the pure path answered "malformed".
    deep = '{"tool": "charge", "args": {"cents": ' + "[" * depth + "]" * depth + "}}"
    async with open_supervisor([shop()], MemoryStore()) as sup:
        handle = await sup.external.start("shop", run_id="deep-1")
        for raw in (deep, '{"next": "COMPLETED", "data": ' + "[" * depth + "]" * depth + "}"):
            verdict = await sup.external.submit(Propose(run_id="deep-1", raw=raw))
            assert not verdict.accepted
            assert [v.code for v in verdict.violations] == ["malformed"]
            assert "nested too deeply" in verdict.violations[0].message
        verdict = await sup.external.submit(Propose(run_id="deep-1", raw=CHARGE))
        assert verdict.execute is not None
        assert handle.run_id == "deep-1"
