"""Recovery after a crash, deterministically: journals cut at chosen points, then resumed."""

from __future__ import annotations

import msgspec
import pytest

from interlock import (
    Go,
    InterlockError,
    Machine,
    Reject,
    RunNotFound,
    Step,
    Tool,
    Worker,
    open_supervisor,
)
from interlock.errors import EscalationResolved
from interlock.events import Escalated, IntentRecorded, ToolCommitted, ToolFailed
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore, open_sqlite_store


class Pay(msgspec.Struct, forbid_unknown_fields=True):
    amount: float


class Calls:
    def __init__(self):
        self.keys = []

    async def __call__(self, args, ctx):
        self.keys.append(ctx.key)
        return {"paid": args.amount, "key": ctx.key}


def limit_100(args, view):
    if args.amount > 100:
        return Reject(
            f"args.amount: {args.amount} exceeds 100", "propose amount <= 100", "args.amount"
        )
    return None


def machine(pay, notify, quote=None, repeatable=False):
    return Machine(
        "pay",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED", "ESCALATE"], tools=["pay", "notify", "quote"])},
        tools=[
            Tool("pay", pay, Pay, guards=[limit_100], idempotent=True, repeatable=repeatable),
            Tool("notify", notify, Pay),  # not idempotent
            Tool("quote", quote or Calls(), Pay, read_only=True),  # not idempotent either
        ],
    )


SCRIPT = [
    '{"tool": "pay", "args": {"amount": 5}}',
    '{"tool": "notify", "args": {"amount": 5}}',
    '{"next": "COMPLETED"}',
]


async def crash_after(store, events_kept, script=SCRIPT, run_id="r-1"):
    """Record a full run, then rebuild a store holding only its first ``events_kept`` events."""
    pay, notify = Calls(), Calls()
    full = MemoryStore()
    async with open_supervisor(
        [machine(pay, notify)], full, provider=ScriptedProvider(script)
    ) as sup:
        await sup.start_run("pay", run_id=run_id)
    events = await full.load(run_id)
    await store.append(events[:events_kept])
    return events


def position(events, predicate):
    return next(i for i, e in enumerate(events) if predicate(e)) + 1


async def test_in_doubt_idempotent_call_is_reexecuted_with_the_same_key():
    store = MemoryStore()
    recorded = await crash_after(MemoryStore(), 0)
    cut = position(recorded, lambda e: isinstance(e, IntentRecorded) and e.tool == "pay")
    await crash_after(store, cut)
    pay, notify = Calls(), Calls()
    async with open_supervisor(
        [machine(pay, notify)], store, provider=ScriptedProvider(SCRIPT[1:]), resume=True
    ):
        pass
    key = recorded[cut - 1].key
    assert pay.keys == [key]
    events = await store.load("r-1")
    commits = [e for e in events if isinstance(e, ToolCommitted) and e.key == key]
    assert len(commits) == 1
    assert type(events[-1]).__name__ == "Completed"
    assert (await store.get_run("r-1")).outcome == "completed"


async def test_in_doubt_non_idempotent_call_is_escalated_not_rerun():
    store = MemoryStore()
    recorded = await crash_after(MemoryStore(), 0)
    cut = position(recorded, lambda e: isinstance(e, IntentRecorded) and e.tool == "notify")
    await crash_after(store, cut)
    pay, notify = Calls(), Calls()
    async with open_supervisor(
        [machine(pay, notify)], store, provider=ScriptedProvider([]), resume=True
    ):
        pass
    assert notify.keys == []
    assert pay.keys == []
    events = await store.load("r-1")
    key = recorded[cut - 1].key
    failed, _moved, escalated = events[-3:]
    assert isinstance(failed, ToolFailed)
    assert (failed.key, failed.error) == (key, "in doubt after a crash")
    assert isinstance(escalated, Escalated)
    assert escalated.reason == "in_doubt_side_effect"
    assert escalated.detail == (
        f"tool 'notify' with key '{key}' may or may not have run before the crash, and it is "
        "not idempotent; check the downstream system, then resume or abort"
    )
    record = await store.get_run("r-1")
    assert (record.outcome, record.reason) == ("escalated", "in_doubt_side_effect")


async def test_in_doubt_read_only_call_is_reexecuted_with_the_same_key():
    """A read-only tool is safe to repeat though it is not idempotent: recovery re-runs it (#14)."""
    script = ['{"tool": "quote", "args": {"amount": 5}}', '{"next": "COMPLETED"}']
    store = MemoryStore()
    recorded = await crash_after(MemoryStore(), 0, script)
    cut = position(recorded, lambda e: isinstance(e, IntentRecorded) and e.tool == "quote")
    await crash_after(store, cut, script)
    pay, notify, quote = Calls(), Calls(), Calls()
    async with open_supervisor(
        [machine(pay, notify, quote)], store, provider=ScriptedProvider(script[1:]), resume=True
    ):
        pass
    key = recorded[cut - 1].key
    assert quote.keys == [key]
    events = await store.load("r-1")
    assert [type(e).__name__ for e in events[cut:]] == [
        "ToolCommitted",
        "ModelCalled",
        "Transitioned",
        "Completed",
    ]
    assert (events[cut].key, events[cut].result) == (key, {"paid": 5.0, "key": key})
    assert (await store.get_run("r-1")).outcome == "completed"


async def test_committed_call_is_never_executed_again():
    store = MemoryStore()
    recorded = await crash_after(MemoryStore(), 0)
    cut = position(recorded, lambda e: isinstance(e, ToolCommitted) and e.tool == "pay")
    await crash_after(store, cut)
    pay, notify = Calls(), Calls()
    async with open_supervisor(
        [machine(pay, notify)], store, provider=ScriptedProvider(SCRIPT[1:]), resume=True
    ):
        pass
    assert pay.keys == []
    assert len(notify.keys) == 1
    assert (await store.get_run("r-1")).outcome == "completed"


#: How many events the recorded run of SCRIPT has: every cut point is 1..RUN_EVENTS.
RUN_EVENTS = 10


async def test_cut_points_cover_the_whole_run():
    # If the run's shape changes, the cut points below must change with it.
    assert len(await crash_after(MemoryStore(), 0)) == RUN_EVENTS
    assert {cut for cut, _late in CUTS} == set(range(1, RUN_EVENTS + 1))


class Crash(SystemExit):
    """The process dies: nothing of it runs on (the runtime lets SystemExit through, and
    pytest reports one that escapes as a failure, not the end of the session)."""


class CrashingStore(MemoryStore):
    """A journal whose process dies once ``keep`` events of its one run are durable.

    The append that would take the journal past ``keep`` writes what fits and dies. An
    append that ends exactly at ``keep`` is written whole; then the process dies at once,
    or, if ``late``, with its next write (what it did meanwhile, a tool call say, did
    happen). Once dead it writes nothing more; ``revive()`` is the restart."""

    def __init__(self, keep: int, *, late: bool) -> None:
        super().__init__()
        self.keep = keep
        self.late = late
        self.armed = True
        self.dead = False

    def revive(self) -> None:
        self.armed = self.dead = False

    async def append(self, events):
        if self.dead:
            raise Crash
        room = self.keep - sum(len(journal) for journal in self._journal.values())
        if self.armed and (len(events) > room or (len(events) == room and not self.late)):
            if room > 0:
                await super().append(events[:room])
            self.dead = True
            raise Crash
        await super().append(events)


class Downstream:
    """The systems the tools call, outside the process and its journal: they see every
    execution, before the crash and after it. The bank dedupes payments by idempotency
    key (``pay`` is idempotent); the notifier sends every message it is given."""

    def __init__(self) -> None:
        self.executed: list[tuple[str, str]] = []  # (tool, key), each call that reached it
        self.payments: dict[str, dict] = {}  # key -> the payment, applied once per key
        self.messages: list[str] = []  # one per message sent

    async def pay(self, args, ctx):
        self.executed.append(("pay", ctx.key))
        return self.payments.setdefault(ctx.key, {"paid": args.amount, "key": ctx.key})

    async def notify(self, args, ctx):
        self.executed.append(("notify", ctx.key))
        self.messages.append(ctx.key)
        return {"paid": args.amount, "key": ctx.key}


PAY, NOTIFY = ("pay", "r-1:WORK:3"), ("notify", "r-1:WORK:6")
#: The recorded run is RunStarted 1, ModelCalled 2, IntentRecorded(pay) 3,
#: ToolCommitted(pay) 4, ModelCalled 5, IntentRecorded(notify) 6, ToolCommitted(notify) 7,
#: ModelCalled 8, Transitioned 9, Completed 10; the process dies with the first ``cut``
#: of them durable. What must follow, from the rules of recovery alone:
#: ``(cut, late): (calls before the crash, calls after the restart, outcome)``.
#: ``late``: the cut is an intent, and the call ran before the process died (with its
#: next write); otherwise the process died as the intent became durable, before the call.
CUTS = {
    # Nothing was called; the run starts over: each call once.
    (1, False): ([], [PAY, NOTIFY], "completed"),
    # The model's answer is durable, its intent is not: the model is asked again (its
    # answer at seq 3), so the calls' intents, and keys, are one seq later.
    (2, False): ([], [("pay", "r-1:WORK:4"), ("notify", "r-1:WORK:7")], "completed"),
    # pay in doubt, idempotent: sent again with its key (the bank applies it once).
    (3, False): ([], [PAY, NOTIFY], "completed"),
    (3, True): ([PAY], [PAY, NOTIFY], "completed"),
    # pay committed: never sent again.
    (4, False): ([PAY], [NOTIFY], "completed"),
    (5, False): ([PAY], [("notify", "r-1:WORK:7")], "completed"),
    # notify in doubt, not idempotent: escalated for a human, never sent again.
    (6, False): ([PAY], [], "escalated"),
    (6, True): ([PAY, NOTIFY], [], "escalated"),
    # Both committed: only the run's end is left to write.
    (7, False): ([PAY, NOTIFY], [], "completed"),
    (8, False): ([PAY, NOTIFY], [], "completed"),
    (9, False): ([PAY, NOTIFY], [], "completed"),
    (10, False): ([PAY, NOTIFY], [], "completed"),
}


@pytest.mark.parametrize(
    ("cut", "late"), list(CUTS), ids=[f"{c}-late" if late else str(c) for c, late in CUTS]
)
async def test_resume_from_every_cut_point_does_what_the_cut_calls_for(cut, late):
    """A process dies at every point of a run; a new one resumes it. Each call reaches
    its downstream exactly as recovery's rules say: a committed call never again, an
    in-doubt idempotent one once more with its key, an in-doubt one that is not
    idempotent never (escalated); so each payment is applied exactly once, and the
    message is sent exactly once, or at most once where a human must look."""
    before, after, outcome = CUTS[cut, late]
    downstream = Downstream()
    store = CrashingStore(cut, late=late)
    spec = machine(downstream.pay, downstream.notify)
    try:
        async with open_supervisor([spec], store, provider=ScriptedProvider(SCRIPT)) as sup:
            await (await sup.start_run("pay", run_id="r-1")).wait()
    except* Crash:
        pass
    assert store.dead
    assert downstream.executed == before
    durable = await store.load("r-1")
    assert len(durable) == cut

    store.revive()
    async with open_supervisor([spec], store, provider=ScriptedProvider(oracle), resume=True):
        pass
    assert downstream.executed[len(before) :] == after
    record = await store.get_run("r-1")
    events = await store.load("r-1")
    assert events[:cut] == durable  # the journal is only ever appended to
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    # Applied: each payment once, whatever reached the bank; the message once, or (in
    # doubt, escalated) once if it went out before the crash and never after.
    assert len(downstream.payments) == 1
    if outcome == "completed":
        assert (record.outcome, record.reason) == ("completed", "")
        assert len(downstream.messages) == 1
    else:
        assert (record.outcome, record.reason) == ("escalated", "in_doubt_side_effect")
        assert downstream.messages == ([NOTIFY[1]] if late else [])
        assert [type(e).__name__ for e in events[cut:]] == [
            "ToolFailed",
            "Transitioned",
            "Escalated",
        ]
    # Each call's result is committed once, under its key, as the downstream answered it.
    commits = [(e.tool, e.key) for e in events if isinstance(e, ToolCommitted)]
    assert len(commits) == len(set(commits))
    reached = set(downstream.executed)
    if outcome == "escalated":
        reached.discard(NOTIFY)  # in doubt: no result to commit
    assert sorted(reached) == sorted(commits)
    for e in events:
        if isinstance(e, ToolCommitted) and e.tool == "pay":
            assert e.result == downstream.payments[e.key]


async def test_resume_escalated_with_corrected_payload_goes_through_the_gate():
    store = MemoryStore()
    pay, notify = Calls(), Calls()
    script = ['{"tool": "pay", "args": {"amount": 500}}'] * 3
    async with open_supervisor(
        [machine(pay, notify)], store, provider=ScriptedProvider(script)
    ) as sup:
        handle = await sup.start_run("pay", run_id="r-1")
    assert (await handle.wait()).reason == "consecutive_failures"
    before = await store.load("r-1")
    provider = ScriptedProvider(['{"next": "COMPLETED"}'])
    async with open_supervisor([machine(pay, notify)], store, provider=provider) as sup:
        with pytest.raises(InterlockError) as bad:
            await sup.resume_escalated(
                "r-1", by="ada", payload='{"tool": "pay", "args": {"amount": 500}}'
            )
        assert str(bad.value) == (
            "payload for run 'r-1' was rejected: [guard] args.amount: 500.0 exceeds 100 (propose amount <= 100)"
        )
        assert await store.load("r-1") == before  # a rejected payload journals nothing
        with pytest.raises(
            InterlockError,
            match=r"^cannot resume run 'r-1' in state 'DONE'; it escalated from 'WORK' and may resume in: WORK$",
        ):
            await sup.resume_escalated("r-1", by="ada", to="DONE")
        handle = await sup.resume_escalated(
            "r-1",
            by="ada",
            note="verified with the bank",
            payload='{"tool": "pay", "args": {"amount": 50}}',
        )
    result = await handle.wait()
    assert result.outcome == "completed"
    assert pay.keys == [f"r-1:WORK:{len(before) + 4}"]
    events = await store.load("r-1")
    resumed = events[len(before)]
    assert (type(resumed).__name__, resumed.by, resumed.note, resumed.to) == (
        "Resumed",
        "ada",
        "verified with the bank",
        "WORK",
    )
    kinds = [type(e).__name__ for e in events[len(before) :]]
    assert kinds[:5] == [
        "Resumed",
        "Transitioned",
        "StepProposed",
        "IntentRecorded",
        "ToolCommitted",
    ]


async def test_abort_escalated_and_errors():
    store = MemoryStore()
    pay, notify = Calls(), Calls()
    async with open_supervisor(
        [machine(pay, notify)], store, provider=ScriptedProvider(['{"next": "ESCALATE"}'])
    ) as sup:
        await sup.start_run("pay", run_id="r-1")
    async with open_supervisor([machine(pay, notify)], store) as sup:
        result = await sup.abort_escalated("r-1", by="ada", note="duplicate ticket")
        assert (result.outcome, result.reason) == ("failed", "aborted by ada: duplicate ticket")
        # a repeat is answered with what was done; the other action is refused (#32)
        assert await sup.abort_escalated("r-1", by="bob") == result
        with pytest.raises(
            EscalationResolved,
            match=r"^cannot resume run 'r-1': it was aborted by ada at \S+ \S+ UTC with the "
            r"note 'duplicate ticket' \(seq \d+\) and is failed in state 'FAILED' now; an "
            r"aborted run stays ended: start a new run$",
        ):
            await sup.resume_escalated("r-1", by="ada")
        with pytest.raises(RunNotFound, match=r"^run 'nope' not found$"):
            await sup.resume_escalated("nope", by="ada")
    assert (await store.get_run("r-1")).outcome == "failed"


async def test_corrupt_tail_is_reported_on_resume(tmp_path):
    path = tmp_path / "j.db"
    store = await open_sqlite_store(path)
    await crash_after(store, 4)
    await store.aclose()
    import sqlite3

    db = sqlite3.connect(path)
    # Seq 4 is the last frame of its chunk (one row per run per batch): cut the chunk short.
    first, body = db.execute(
        "SELECT first_seq, body FROM chunks WHERE run_id = 'r-1' AND last_seq = 4"
    ).fetchone()
    db.execute(
        "UPDATE chunks SET body = ? WHERE run_id = 'r-1' AND first_seq = ?", (body[:-3], first)
    )
    db.commit()
    db.close()
    snapshot = path.read_bytes()
    store = await open_sqlite_store(path)
    pay, notify = Calls(), Calls()
    from interlock.errors import JournalCorrupt

    # the error itself, not wrapped in the supervisor's nurseries' groups (#15)
    with pytest.raises(
        JournalCorrupt, match=r"^journal of run 'r-1' is torn \(cut short\) at seq 4"
    ):
        async with open_supervisor(
            [machine(pay, notify)], store, provider=ScriptedProvider([]), resume=True
        ):
            pass
    await store.aclose()
    assert pay.keys == notify.keys == []
    assert path.read_bytes()[:100] == snapshot[:100]


PAY_5 = '{"tool": "pay", "args": {"amount": 5}}'


async def test_resume_resets_the_repeat_counts():
    """A run escalated for repeating a call may be resumed with that call once more (#14).

    Its tool is declared repeatable (repeats are meant), or the second call would be
    refused as already committed (issue 32)."""
    store = MemoryStore()
    pay, notify = Calls(), Calls()
    async with open_supervisor(
        [machine(pay, notify, repeatable=True)], store, provider=ScriptedProvider([PAY_5] * 4)
    ) as sup:
        handle = await sup.start_run("pay", run_id="r-1")
    result = await handle.wait()
    assert (result.outcome, result.reason) == ("escalated", "repeat")
    assert len(pay.keys) == 3
    escalated_at = result.seq
    provider = ScriptedProvider(['{"next": "COMPLETED"}'])
    async with open_supervisor(
        [machine(pay, notify, repeatable=True)], store, provider=provider
    ) as sup:
        handle = await sup.resume_escalated("r-1", by="ada", note="once more", payload=PAY_5)
    assert (await handle.wait()).outcome == "completed"
    assert pay.keys[3:] == [f"r-1:WORK:{escalated_at + 4}"]
    events = await store.load("r-1")
    assert [type(e).__name__ for e in events[escalated_at:]] == [
        "Resumed",
        "Transitioned",
        "StepProposed",
        "IntentRecorded",
        "ToolCommitted",
        "ModelCalled",
        "Transitioned",
        "Completed",
    ]


async def test_resume_and_abort_each_take_one_escalation_off_the_pending_count():
    """``escalations_pending`` and its gauge go down by one on resume and on abort (#14)."""
    from prometheus_client import CollectorRegistry

    from interlock.metrics import RuntimeCollector, RuntimeStats

    store = MemoryStore()
    stats = RuntimeStats()
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(stats))

    def pending():
        gauge = registry.get_sample_value("interlock_escalations_pending")
        assert gauge == stats.escalations_pending
        return gauge

    pay, notify = Calls(), Calls()
    script = {
        "r-1": ['{"next": "ESCALATE"}', '{"next": "COMPLETED"}'],
        "r-2": ['{"next": "ESCALATE"}'],
    }
    async with open_supervisor(
        [machine(pay, notify)], store, provider=ScriptedProvider(script), stats=stats
    ) as sup:
        assert pending() == 0
        for run_id in script:
            assert (await (await sup.start_run("pay", run_id=run_id)).wait()).outcome == (
                "escalated"
            )
        assert pending() == 2
        resumed = await sup.resume_escalated("r-1", by="ada")
        assert pending() == 1
        assert (await resumed.wait()).outcome == "completed"
        assert pending() == 1
        assert (await sup.abort_escalated("r-2", by="ada")).outcome == "failed"
        assert pending() == 0


async def test_a_new_supervisor_counts_the_stores_pending_escalations():
    """The pending count is store-wide: a supervisor opened later starts from the queue (#14)."""
    from interlock.metrics import RuntimeStats

    store = MemoryStore()
    pay, notify = Calls(), Calls()
    provider = ScriptedProvider(['{"next": "ESCALATE"}'])
    async with open_supervisor([machine(pay, notify)], store, provider=provider) as sup:
        for run_id in ("r-1", "r-2"):
            await sup.start_run("pay", run_id=run_id)
    stats = RuntimeStats()
    async with open_supervisor([machine(pay, notify)], store, stats=stats) as sup:
        assert stats.escalations_pending == 2
        await sup.abort_escalated("r-1", by="ada")
        assert stats.escalations_pending == 1


class Review:
    """A step that completes the run with the result of the last payment."""

    def __init__(self):
        self.seen = []

    def __call__(self, view):
        self.seen.append(view.state)
        return Go("COMPLETED", {"paid": view.last_result("pay")})


def review_machine(pay, review):
    return Machine(
        "review",
        initial="WORK",
        states={
            "WORK": Worker(next=["REVIEW", "ESCALATE"], tools=["pay"]),
            "REVIEW": Step(review, next=["COMPLETED"]),
        },
        tools=[Tool("pay", pay, Pay, idempotent=True)],
    )


async def test_resume_escalated_to_a_legal_next_state_runs_from_there():
    """``resume_escalated(to=...)`` moves the run to that state and drives it to its end (#14)."""
    store = MemoryStore()
    pay, review = Calls(), Review()
    script = [PAY_5, '{"next": "ESCALATE"}']
    async with open_supervisor(
        [review_machine(pay, review)], store, provider=ScriptedProvider(script)
    ) as sup:
        first = await (await sup.start_run("review", run_id="r-1")).wait()
    assert (first.outcome, first.state) == ("escalated", "ESCALATE")
    async with open_supervisor([review_machine(pay, review)], store) as sup:
        handle = await sup.resume_escalated("r-1", by="ada", note="paid; review it", to="REVIEW")
    result = await handle.wait()
    paid = {"paid": 5.0, "key": "r-1:WORK:3"}
    assert (result.outcome, result.state, result.output) == (
        "completed",
        "COMPLETED",
        {"paid": paid},
    )
    assert review.seen == ["REVIEW"]
    assert pay.keys == ["r-1:WORK:3"]
    events = (await store.load("r-1"))[first.seq :]
    assert [type(e).__name__ for e in events] == [
        "Resumed",
        "Transitioned",
        "StepProposed",
        "Transitioned",
        "Completed",
    ]
    resumed, moved, proposed, done, completed = events
    assert (resumed.by, resumed.note, resumed.to) == ("ada", "paid; review it", "REVIEW")
    assert (moved.src, moved.dst, moved.reason) == ("ESCALATE", "REVIEW", "operator")
    assert (proposed.state, proposed.source, proposed.error) == ("REVIEW", "step", "")
    assert (done.src, done.dst, done.reason) == ("REVIEW", "COMPLETED", "step")
    assert completed.output == {"paid": paid}
    assert (await store.get_run("r-1")).outcome == "completed"


def oracle(view):
    """What a good model proposes next: pay, then notify, then complete."""
    done = {r.tool for r in view.results}
    for raw in SCRIPT:
        tool = msgspec.json.decode(raw).get("tool")
        if tool is None or tool not in done:
            return raw
    return SCRIPT[-1]


@pytest.mark.parametrize("how", ["resume_unfinished", "open_supervisor"])
async def test_resume_unfinished_drives_every_unfinished_run_to_its_end(how):
    """Each unfinished run of a store is rebuilt and run to its end; finished ones are left (#14)."""
    store = MemoryStore()
    recorded = await crash_after(MemoryStore(), 0)
    cuts = {
        "r-started": 1,
        "r-pay": position(recorded, lambda e: isinstance(e, IntentRecorded) and e.tool == "pay"),
        "r-notify": position(
            recorded, lambda e: isinstance(e, IntentRecorded) and e.tool == "notify"
        ),
        "r-done": len(recorded),
    }
    for run_id, cut in cuts.items():
        await crash_after(store, cut, run_id=run_id)
    finished = await store.load("r-done")
    pay, notify = Calls(), Calls()
    async with open_supervisor(
        [machine(pay, notify)],
        store,
        provider=ScriptedProvider(oracle),
        resume=how == "open_supervisor",
    ) as sup:
        if how == "resume_unfinished":
            handles = await sup.resume_unfinished()
            assert sorted(h.run_id for h in handles) == ["r-notify", "r-pay", "r-started"]
            results = {h.run_id: await h.wait() for h in handles}
            assert {run_id: r.outcome for run_id, r in results.items()} == {
                "r-started": "completed",
                "r-pay": "completed",
                "r-notify": "escalated",
            }
            assert await sup.resume_unfinished() == []
    outcomes = {r.run_id: (r.outcome, r.reason) for r in await store.list_runs()}
    assert outcomes == {
        "r-started": ("completed", ""),
        "r-pay": ("completed", ""),
        "r-notify": ("escalated", "in_doubt_side_effect"),
        "r-done": ("completed", ""),
    }
    assert sorted(pay.keys) == ["r-pay:WORK:3", "r-started:WORK:3"]
    assert sorted(notify.keys) == ["r-pay:WORK:6", "r-started:WORK:6"]
    assert await store.load("r-done") == finished


async def test_a_run_resumed_with_a_payload_replays() -> None:
    """Resuming with a payload read the clock twice in one request (the resume, then the
    proposal), so replay, which gives one request one reading, diverged at the payload's
    step_proposed with the same text on both sides: its timestamp differed (#15)."""
    from interlock import Machine, Tool, Worker, replay

    async def work(args: object, ctx: object) -> dict[str, int]:
        return {"ok": 1}

    spec = Machine(
        "m",
        "W",
        {"W": Worker(next=["COMPLETED"], tools=["work"])},
        tools=[Tool("work", work, idempotent=True)],
    )
    ticks = iter(range(1_000_000_000, 1_000_001_000))  # every reading a new second

    def clock() -> float:
        return float(next(ticks))

    store = MemoryStore()
    script = ['{"next": "X"}'] * 3 + ['{"next": "COMPLETED"}']
    async with open_supervisor(
        [spec], store, provider=ScriptedProvider(script), clock=clock
    ) as sup:
        assert (await (await sup.start_run("m", run_id="r-1")).wait()).outcome == "escalated"
        handle = await sup.resume_escalated("r-1", by="ada", payload='{"tool": "work", "args": {}}')
        assert (await handle.wait()).outcome == "completed"
    assert replay(await store.load("r-1"), spec).diverged == ()


async def test_expected_refusals_are_typed_errors_users_can_catch() -> None:
    """Each expected refusal is its own InterlockError subclass, with the fields a caller
    needs, instead of a bare InterlockError (#15)."""
    from interlock import (
        InterlockError,
        InvalidInputs,
        Machine,
        NotEscalated,
        StoreDamaged,
        UnknownMachine,
        Worker,
    )
    from interlock.errors import (
        IllegalResumeTarget,
        IndexDamaged,
        JournalCorrupt,
        NoProvider,
        PayloadRejected,
    )

    assert issubclass(JournalCorrupt, StoreDamaged)
    assert issubclass(IndexDamaged, StoreDamaged)
    spec = Machine(
        "m",
        "W",
        {"W": Worker(next=["REVIEW"]), "REVIEW": Worker(next=["COMPLETED"])},
        inputs={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    )
    store = MemoryStore()
    async with open_supervisor(
        [spec], store, provider=ScriptedProvider(['{"next": "X"}'] * 3)
    ) as sup:
        with pytest.raises(UnknownMachine, match=r"^machine 'nope' is not registered") as unknown:
            await sup.start_run("nope")
        assert isinstance(unknown.value, LookupError)
        assert unknown.value.machine == "nope"
        with pytest.raises(InvalidInputs, match=r"^inputs of machine 'm' are invalid"):
            await sup.start_run("m", {"n": "one"})
        assert (await (await sup.start_run("m", {"n": 1}, run_id="r-1")).wait()).reason == (
            "consecutive_failures"
        )
        with pytest.raises(IllegalResumeTarget) as illegal:
            await sup.resume_escalated("r-1", by="ada", to="COMPLETED")
        assert (illegal.value.target, illegal.value.legal) == ("COMPLETED", ("W", "REVIEW"))
        with pytest.raises(PayloadRejected) as rejected:
            await sup.resume_escalated("r-1", by="ada", payload='{"next": "NOWHERE"}')
        assert [v.code for v in rejected.value.violations] == ["illegal_transition"]
        await sup.abort_escalated("r-1", by="ada")
        with pytest.raises(NotEscalated, match=r"^cannot resume run 'r-1': it was aborted") as n:
            await sup.resume_escalated("r-1", by="ada")
        assert n.value.state == "FAILED"
        assert isinstance(n.value, EscalationResolved)
        assert (n.value.done.action, n.value.done.by) == ("abort", "ada")
    async with open_supervisor([spec], store) as sup:
        with pytest.raises(NoProvider, match=r"^machine 'm' has worker states but no provider"):
            await sup.start_run("m", {"n": 1})
    for error in (UnknownMachine, InvalidInputs, NoProvider, NotEscalated, IllegalResumeTarget):
        assert issubclass(error, InterlockError)


async def test_resume_refuses_a_run_that_needs_a_model_it_has_not_got() -> None:
    """resume_unfinished started the actor of a worker-state run with no provider, which
    then died of an internal error; it now refuses before resuming any run (#15)."""
    import time

    from interlock import Machine, Worker
    from interlock.errors import NoProvider
    from interlock.events import RunStarted

    store = MemoryStore()
    await store.append([RunStarted(run_id="r-1", seq=1, ts=time.time(), machine="m", state="W")])
    spec = Machine("m", "W", {"W": Worker(next=["COMPLETED"])})
    async with open_supervisor([spec], store) as sup:
        with pytest.raises(NoProvider, match=r"^machine 'm' has worker states but no provider"):
            await sup.resume_unfinished()
        assert sup.handles == {}
