"""Offline replay: recorded runs reproduce exactly; a changed machine shows where it diverges."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interlock import Reject, ReplayDivergence, open_supervisor
from interlock.demo.workflows import WORKFLOWS, Backend
from interlock.events import ToolFailed, Transitioned, decode_event, encode_event
from interlock.providers import CHAOS_KINDS, ChaosProvider, ScriptedProvider
from interlock.runtime._replay import replay, split_runs
from interlock.stores import MemoryStore
from tests import in_doubt_app


async def record(workflows, runs, rate, seed, kinds=CHAOS_KINDS):
    backend = Backend(":memory:")
    store = MemoryStore()
    machines = [WORKFLOWS[w].build(backend) for w in workflows]
    providers = {
        w: ChaosProvider(ScriptedProvider(WORKFLOWS[w].oracle), rate=rate, seed=seed, kinds=kinds)
        for w in workflows
    }
    import random

    rng = random.Random(seed)
    async with open_supervisor(machines, store, provider=providers) as sup:
        for i in range(runs):
            w = workflows[i % len(workflows)]
            await sup.start_run(w, WORKFLOWS[w].make_inputs(i, rng), run_id=f"{w}-{i}")
    events = []
    for r in await store.list_runs():
        events.extend(await store.load(r.run_id))
    backend.close()
    return machines, events


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workflow=st.sampled_from(sorted(WORKFLOWS)),
    rate=st.floats(0, 1),
    seed=st.integers(0, 2**32),
    kinds=st.sets(st.sampled_from(CHAOS_KINDS), min_size=1).map(lambda s: tuple(sorted(s))),
)
def test_any_chaos_run_replays_without_divergence(workflow, rate, seed, kinds):
    machines, events = trio.run(record, [workflow], 6, rate, seed, kinds)
    report = replay(events, machines)
    assert len(report.runs) == 6
    assert report.ok, report.diverged[:1]
    assert report.reproduced == 6
    assert sum(r.events for r in report.runs) == len(events)


def test_large_demo_journal_replays_every_run():
    machines, events = trio.run(record, sorted(WORKFLOWS), 300, 0.3, 11)
    report = replay(events, machines)
    assert report.reproduced == 300
    assert report.ok
    report.raise_for_divergence()


def stricter_refund(machine, limit):
    def at_most(args, view):
        if args.amount > limit:
            return Reject(
                f"args.amount: {args.amount} exceeds the new limit {limit}",
                f"propose amount <= {limit}",
                "args.amount",
            )
        return None

    tools = [
        dataclasses.replace(t, guards=[*t.guards, at_most]) if t.name == "refund" else t
        for t in machine.tools
    ]
    return dataclasses.replace(machine, tools=tools)


def test_changed_guard_reports_first_differing_seq():
    machines, events = trio.run(record, ["refund"], 40, 0.0, 5)
    strict = stricter_refund(machines[0], 60)
    report = replay(events, strict)
    runs = split_runs(events)

    def first_big_refund(items):
        for event in items:
            if type(event).__name__ == "ModelCalled":
                proposal = json.loads(event.raw)
                if proposal.get("tool") == "refund" and proposal["args"]["amount"] > 60:
                    return event
        return None

    expected = {run_id: first_big_refund(items) for run_id, items in runs.items()}
    expected = {run_id: event for run_id, event in expected.items() if event is not None}
    assert expected, "the recording has no refund above 60; the test proves nothing"
    assert {r.run_id for r in report.diverged} == set(expected)
    for run in report.diverged:
        d = run.divergence
        # The model call itself is the recording's input; the decision right after it differs.
        assert d.seq == expected[run.run_id].seq + 1
        assert d.kind in ("intent_recorded", "proposal_rejected")
        assert d.got.startswith('proposal_rejected {"state":"WORK","violations":[')
        assert "exceeds the new limit 60" in d.got
    with pytest.raises(ReplayDivergence) as raised:
        report.raise_for_divergence()
    assert raised.value.seq == report.diverged[0].divergence.seq


def test_truncated_recording_and_wrong_machine_are_reported():
    machines, events = trio.run(record, ["router"], 1, 0.0, 1)
    report = replay(events[:-1], machines)
    (run,) = report.runs
    assert run.divergence.kind == "end"
    backend = Backend(":memory:")
    try:
        other = replay(events, WORKFLOWS["refund"].build(backend))
    finally:
        backend.close()
    assert other.runs[0].divergence.seq == 1


def test_cli_replay_all_and_what_if(tmp_path):
    db = tmp_path / "j.db"
    demo = subprocess.run(
        [sys.executable, "-m", "interlock", "demo", "--runs", "60", "--workflow", "refund", "--db", str(db), "--latency", "0,1", "--json"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    done = subprocess.run(
        [sys.executable, "-m", "interlock", "replay", "--all", "--db", str(db), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout
    assert json.loads(done.stdout)["reproduced"] == 60
    module = tmp_path / "strict_machine.py"
    module.write_text(
        "from interlock.demo.workflows import Backend, refund\n"
        "import dataclasses\n"
        "from interlock import Reject\n"
        "def cap(args, view):\n"
        "    return Reject('args.amount: over 30', 'propose amount <= 30', 'args.amount') if args.amount > 30 else None\n"
        "base = refund.build(Backend(':memory:'))\n"
        "machine = dataclasses.replace(base, tools=[dataclasses.replace(t, guards=[*t.guards, cap]) if t.name == 'refund' else t for t in base.tools])\n"
    )
    what_if = subprocess.run(
        [sys.executable, "-m", "interlock", "replay", "--all", "--db", str(db), "--machine", "strict_machine:machine", "--json"],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert what_if.returncode == 1
    document = json.loads(what_if.stdout)
    assert document["what_if"] == ["refund"]
    assert document["diverged"]
    assert {d["divergence"]["kind"] for d in document["diverged"]} <= {
        "intent_recorded",
        "proposal_rejected",
    }
    text = subprocess.run(
        [sys.executable, "-m", "interlock", "replay", "--all", "--db", str(db), "--machine", "strict_machine:machine"],
        capture_output=True, text=True, check=False, cwd=tmp_path, env={"COLUMNS": "200", "PATH": ""},
    )  # fmt: skip
    assert text.returncode == 1
    assert "diverged" in text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "interlock", "replay", "--all", "--db", str(db), "--machine", "nomodule:x"],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.startswith(
        "interlock: error: --machine 'nomodule:x': cannot import 'nomodule'"
    )


def _capped(cap):
    from interlock import Machine, Tool, Worker

    async def note(args, ctx):
        return {"ok": True}

    return Machine(
        "capped",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["note"])},
        tools=[Tool("note", note, read_only=True)],
        max_proposal_bytes=cap,
    )


@pytest.mark.parametrize(
    "answer",
    [
        '{"tool": "note", "args": {"text": "' + "x" * 50_000 + '"}}',
        '{"tool":"note","args":{"text":"' + "y" * 50_000 + '"}}',  # a native call's shape
        '{"next": "COMPLETED", "data": {"text": "' + "z" * 50_000 + '"}}',
        "w" * 50_000,
    ],
    ids=["spaced-call", "native-call", "move", "text"],
)
async def test_an_answer_over_the_cap_replays_as_the_same_refusal_from_its_excerpt(answer):
    """A refused answer over the cap is journaled as a bounded excerpt with its size and
    hash (#33); replay decides the same refusal from them, and a machine whose cap now
    reaches its size is told it cannot be read, at the refusal."""
    import hashlib

    from interlock.core._events import ModelCalled, ProposalRejected

    store = MemoryStore()
    provider = ScriptedProvider([answer, '{"next": "COMPLETED"}'])
    async with open_supervisor([_capped(10_000)], store, provider=provider) as sup:
        result = await (await sup.start_run("capped", run_id="r-1")).wait()
    assert result.outcome == "completed"
    events = await store.load("r-1")
    called, rejected = events[1], events[2]
    assert isinstance(called, ModelCalled)
    assert isinstance(rejected, ProposalRejected)
    assert len(called.raw) < 4096
    assert called.oversized.raw_bytes == len(answer)
    assert called.oversized.raw_sha256 == hashlib.sha256(answer.encode()).hexdigest()
    assert [v.message for v in rejected.violations] == [
        f"proposal is {len(answer):,} bytes, over the cap of 10,000 bytes in state 'WORK'; "
        "it was not read"
    ]
    assert replay(events, _capped(10_000)).ok
    [diverged] = replay(events, _capped(100_000)).diverged
    assert diverged.divergence.seq == 3
    assert "kept only as an excerpt" in diverged.divergence.got


def _mailer(schema):
    from interlock import Machine, Tool, Worker

    async def send(args, ctx):
        return {"sent": args.to}

    return Machine(
        "mailer",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["send"])},
        tools=[Tool("send", send, schema, idempotent=True)],
    )


async def test_a_tool_whose_args_changed_diverges_at_its_intent_naming_the_args():
    """(issue 33) The args a call is executed with are a decision of the machine's code (its
    schema validates and fills them): a recording replayed against a tool whose schema now
    gives other args (a new field with a default) diverges at the intent, naming the args
    recorded and the args now decided, though the model's answer is byte for byte the same."""
    import msgspec

    class Before(msgspec.Struct, forbid_unknown_fields=True):
        to: str

    class After(msgspec.Struct, forbid_unknown_fields=True):
        to: str
        cc: list[str] = []

    store = MemoryStore()
    provider = ScriptedProvider(
        ['{"tool": "send", "args": {"to": "a@b.c"}}', '{"next": "COMPLETED"}']
    )
    async with open_supervisor([_mailer(Before)], store, provider=provider) as sup:
        assert (await (await sup.start_run("mailer", run_id="r-1")).wait()).outcome == "completed"
    events = await store.load("r-1")
    assert replay(events, _mailer(Before)).ok
    report = replay(events, _mailer(After))
    assert report.reproduced == 0, f"a tool whose args changed replayed as reproduced: {report}"
    [run] = report.diverged
    intent = events[2]
    assert type(intent).__name__ == "IntentRecorded"
    d = run.divergence
    assert (d.seq, d.kind) == (intent.seq, "intent_recorded")
    assert '"args":{"to":"a@b.c"},' in d.expected
    assert '"args":{"to":"a@b.c","cc":[]},' in d.got
    with pytest.raises(ReplayDivergence) as raised:
        report.raise_for_divergence()
    assert raised.value.seq == intent.seq


# -- calls in doubt ---------------------------------------------------------------------------

IN_DOUBT_JOURNAL = Path(__file__).parent / "data" / "journal-in-doubt-0.3.msgpack"


def _escalated_in_doubt(events):
    """Each tool_failed that escalated its run as in doubt (a transitioned in_doubt follows)."""
    return [
        e
        for e, after in itertools.pairwise(events)
        if isinstance(e, ToolFailed)
        and isinstance(after, Transitioned)
        and after.reason == "in_doubt"
    ]


def test_a_journal_from_before_the_in_doubt_field_decodes_structured_and_replays():
    """Recorded by an interlock that marked an escalation in doubt only in the text
    (``error="in doubt: ..."``): it reads as the structured form, and replays exactly."""
    payloads = msgspec.msgpack.decode(IN_DOUBT_JOURNAL.read_bytes(), type=list[msgspec.Raw])
    raw = [msgspec.msgpack.decode(bytes(p)) for p in payloads]
    assert any(e.get("error", "").startswith("in doubt: ") for e in raw)  # the old form
    assert not any("in_doubt" in e for e in raw)
    events = [decode_event(bytes(p)) for p in payloads]
    doubted = _escalated_in_doubt(events)
    assert [(e.run_id, e.error, e.in_doubt) for e in doubted] == [
        ("mail-escalated", "ValueError: bad response body", True),
        ("post-unknown", "in doubt", True),
        ("post-garbage", "in doubt", True),
        (
            "mail-unjournalable",
            "tool 'mail' returned a result that cannot be journaled: the object at "
            "result.handle: Encoding objects of type object is unsupported",
            True,
        ),
    ]
    # every other failure stays a plain one
    plain = [e for e in events if isinstance(e, ToolFailed) and e not in doubted]
    assert [(e.run_id, e.in_doubt) for e in plain] == [("mail-plain-text", msgspec.UNSET)]
    report = replay(events, in_doubt_app.old_machine())
    assert report.ok, report.diverged[:1]
    assert report.reproduced == len(in_doubt_app.OLD_SCRIPTS)
    assert sum(r.events for r in report.runs) == len(events)


def test_the_old_journal_replays_against_a_changed_tool_up_to_the_change():
    """A call that was in doubt, replayed against a tool that now reconciles, diverges at
    the in-doubt failure (now a tool_in_doubt): the structured form is what is compared."""
    payloads = msgspec.msgpack.decode(IN_DOUBT_JOURNAL.read_bytes(), type=list[msgspec.Raw])
    events = [e for e in map(decode_event, map(bytes, payloads)) if e.run_id == "mail-escalated"]
    behaviour = in_doubt_app.Behaviour({}, {})
    changed = in_doubt_app.machine(behaviour)
    mail = next(t for t in changed.tools if t.name == "mail")
    changed = dataclasses.replace(
        changed,
        tools=[dataclasses.replace(mail, reconcile=behaviour.reconcile)]
        + [t for t in changed.tools if t.name != "mail"],
    )
    (run,) = replay(events, changed).runs
    assert run.divergence is not None
    assert run.divergence.kind == "tool_failed"
    assert run.divergence.got.startswith("tool_in_doubt ")


attempt_scripts = st.lists(st.sampled_from(in_doubt_app.ATTEMPTS), max_size=4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(
        st.tuples(
            st.lists(st.sampled_from(["mail", "post", "fetch"]), min_size=1, max_size=3),
            attempt_scripts,
            st.lists(st.sampled_from(in_doubt_app.RECONCILES), max_size=3),
        ),
        min_size=1,
        max_size=4,
    ),
    retries=st.integers(1, 3),
)
def test_any_run_with_calls_in_doubt_replays_without_divergence(runs, retries):
    """Tools that fail in every way (applied unknown, certainly not applied, a result the
    journal cannot hold), reconcile answers of every kind, escalations in doubt resumed
    by an operator: each recorded run reproduces, and an in-doubt failure is structured."""
    scripts = {
        f"r-{i}": [in_doubt_app.call(t) for t in tools] for i, (tools, _, _) in enumerate(runs)
    }
    attempts = {f"r-{i}": a for i, (_, a, _) in enumerate(runs)}
    reconciles = {f"r-{i}": r for i, (_, _, r) in enumerate(runs)}
    spec = in_doubt_app.machine(in_doubt_app.Behaviour(attempts, reconciles), retries)
    events = trio.run(in_doubt_app.record, spec, scripts)
    for event in _escalated_in_doubt(events):
        assert event.in_doubt is True
        assert not event.error.startswith("in doubt: ")
    # what goes to the journal reads back as it was written (no upgrade of a new event)
    assert [decode_event(encode_event(e)) for e in events] == events
    replayed = replay(events, in_doubt_app.machine(in_doubt_app.Behaviour({}, {}), retries))
    assert replayed.ok, replayed.diverged[:1]
    assert replayed.reproduced == len(runs)
    assert sum(r.events for r in replayed.runs) == len(events)
