"""The Store contract: every backend (memory, SQLite, PostgreSQL) behaves the same."""

from __future__ import annotations

import itertools
import os
import typing

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interlock.core._events import (
    EVENT_TYPES,
    BreakerTripped,
    Completed,
    Escalated,
    Event,
    Failed,
    IntentRecorded,
    JournalEvent,
    ModelCalled,
    ProposalRejected,
    Resumed,
    RunStarted,
    StepProposed,
    TokenUsage,
    ToolCommitted,
    ToolFailed,
    Transitioned,
    Violation,
)
from interlock.core._exceptions import JournalCorrupt, RunNotFound, StoreError
from interlock.core._hotpath import frame_event
from interlock.events import ProviderFailed, Reconciled, ToolInDoubt
from interlock.stores import (
    CheckProblem,
    CheckReport,
    IndexDamaged,
    PostgresStore,
    RunRecord,
    SQLiteStore,
    Store,
)
from interlock.stores._base import COMPLETED, ESCALATED, FAILED, RUNNING, record_checksum

from .conftest import (
    STORE_PARAMS,
    delete_event,
    fresh_store,
    index_row,
    index_sql,
    open_twice,
    rewrite_event,
    set_index_column,
)


def every_kind(run_id: str, *, ts: float = 1000.0) -> list[JournalEvent]:
    """One event of every kind, as one well-formed run (seq 1 upwards)."""
    key = f"{run_id}:PAY:6"
    events: list[JournalEvent] = [
        RunStarted(
            run_id=run_id,
            seq=1,
            ts=ts,
            machine="refund",
            state="TRIAGE",
            inputs={"order": "o-1", "total": 100.0, "items": [1, 2, {"sku": "é✓"}]},
        ),
        ModelCalled(
            run_id=run_id,
            seq=2,
            ts=ts + 1,
            state="TRIAGE",
            model="gpt-test",
            prompt_hash="ab" * 32,
            prompt="refund the order\n",
            raw='{"tool": "refund", "args": {"amount": 150}}',
            usage=TokenUsage(prompt=120, completion=30),
            latency=0.25,
        ),
        ProposalRejected(
            run_id=run_id,
            seq=3,
            ts=ts + 2,
            state="TRIAGE",
            violations=(
                Violation(
                    code="guard",
                    path="args.amount",
                    message="amount: 150.0 exceeds the order total 100.0",
                    hint="propose amount <= 100.0",
                ),
            ),
        ),
        StepProposed(run_id=run_id, seq=4, ts=ts + 3, state="TRIAGE", raw='{"to": "PAY"}'),
        Transitioned(
            run_id=run_id,
            seq=5,
            ts=ts + 4,
            src="TRIAGE",
            dst="PAY",
            delta={"amount": 100.0},
            reason="step",
        ),
        IntentRecorded(
            run_id=run_id,
            seq=6,
            ts=ts + 5,
            state="PAY",
            tool="refund",
            args={"amount": 100.0},
            key=key,
        ),
        ToolFailed(
            run_id=run_id,
            seq=7,
            ts=ts + 6,
            tool="refund",
            key=key,
            error="503 service unavailable",
            retryable=True,
            attempts=3,
            latency=1.5,
        ),
        ToolCommitted(
            run_id=run_id,
            seq=8,
            ts=ts + 7,
            tool="refund",
            key=key,
            result={"id": "rf-1", "ok": True, "amounts": [100.0]},
            attempts=2,
            latency=0.125,
        ),
        BreakerTripped(
            run_id=run_id,
            seq=9,
            ts=ts + 8,
            breaker="consecutive_failures",
            state="PAY",
            value=3.0,
            limit=3.0,
            detail="3 proposals rejected in a row",
            tool="refund",
        ),
        Escalated(
            run_id=run_id,
            seq=10,
            ts=ts + 9,
            state="ESCALATE",
            reason="consecutive_failures",
            detail="3 proposals rejected in a row",
        ),
        Resumed(run_id=run_id, seq=11, ts=ts + 10, by="ops@example.com", note="ok", to="PAY"),
        Completed(run_id=run_id, seq=12, ts=ts + 11, state="DONE", output={"refunded": 100.0}),
        Failed(run_id=run_id, seq=13, ts=ts + 12, state="FAILED", reason="operator abort"),
    ]
    return events


def started(run_id: str, *, ts: float, machine: str = "refund", seq: int = 1) -> RunStarted:
    return RunStarted(run_id=run_id, seq=seq, ts=ts, machine=machine, state="TRIAGE")


def moved(run_id: str, seq: int, src: str, dst: str, *, ts: float) -> Transitioned:
    return Transitioned(run_id=run_id, seq=seq, ts=ts, src=src, dst=dst)


def intent(run_id: str, seq: int, key: str, *, ts: float = 5.0) -> IntentRecorded:
    return IntentRecorded(
        run_id=run_id, seq=seq, ts=ts, state="PAY", tool="refund", args={"amount": 1}, key=key
    )


async def snapshot(store: Store, run_ids: list[str]) -> tuple[object, ...]:
    """Everything a caller can observe about ``run_ids`` and the runs index."""
    journals: dict[str, object] = {}
    records: dict[str, object] = {}
    for run_id in run_ids:
        try:
            journals[run_id] = await store.load(run_id)
        except RunNotFound:
            journals[run_id] = None
        try:
            records[run_id] = await store.get_run(run_id)
        except RunNotFound:
            records[run_id] = None
    return (await store.list_runs(), journals, records)


def later_kinds(run_id: str, *, ts: float = 2000.0) -> list[JournalEvent]:
    """One event of each kind added after ``every_kind`` was written (#14), as one run."""
    key = f"{run_id}:PAY:3"
    return [
        started(run_id, ts=ts),
        ProviderFailed(
            run_id=run_id,
            seq=2,
            ts=ts + 1,
            state="TRIAGE",
            model="gpt-test",
            error="provider raised ProviderError: 429",
            retry_after=2.0,
            retry_in=2.0,
        ),
        intent(run_id, 3, key, ts=ts + 2),
        ToolInDoubt(run_id=run_id, seq=4, ts=ts + 3, tool="refund", key=key, error="reset"),
        Reconciled(run_id=run_id, seq=5, ts=ts + 4, tool="refund", key=key, applied=True),
        ToolCommitted(
            run_id=run_id,
            seq=6,
            ts=ts + 4,
            tool="refund",
            key=key,
            result={"ok": True},
            attempts=0,
            reconciled=True,
        ),
    ]


def test_samples_cover_every_event_type() -> None:
    kinds = {type(event) for event in every_kind("r") + later_kinds("r")}
    assert kinds == set(EVENT_TYPES) == set(typing.get_args(JournalEvent))


async def test_later_event_kinds_round_trip(store: Store) -> None:
    events = later_kinds("r-9")
    await store.append(events)
    assert await store.load("r-9") == events


async def test_every_event_kind_round_trips(store: Store) -> None:
    events = every_kind("r-1")
    await store.append(events)
    assert await store.load("r-1") == events
    record = await store.get_run("r-1")
    assert record == RunRecord(
        run_id="r-1",
        machine="refund",
        state="PAY",
        outcome=FAILED,
        seq=13,
        started=1000.0,
        updated=1012.0,
        reason="operator abort",
    )


async def test_each_event_appended_alone_round_trips(store: Store) -> None:
    events = every_kind("r-1", ts=1.5)
    for event in events:
        await store.append([event])
    assert await store.load("r-1") == events


async def test_empty_batch_is_a_no_op(store: Store) -> None:
    await store.append([])
    assert await store.list_runs() == []


async def test_a_write_probe_leaves_nothing_behind(store: Store) -> None:
    """#33: the gateway's readiness probes a journal whose last write failed with a write
    of its own; it must leave the journal as it was."""
    events: list[Event] = [started("r-1", ts=1.0), moved("r-1", 2, "A", "B", ts=1.5)]
    await store.append(events)
    await store.probe_write()
    await store.probe_write()
    assert await store.load("r-1") == events
    assert [r.run_id for r in await store.list_runs()] == ["r-1"]
    assert (await store.check()).ok
    await store.append([moved("r-1", 3, "B", "C", ts=2.0)])  # the journal takes writes
    assert (await store.load("r-1"))[-1].seq == 3


async def test_batches_over_many_runs(store: Store) -> None:
    run_ids = [f"run-{i:03d}" for i in range(60)]
    journals: dict[str, list[Event]] = {run_id: [] for run_id in run_ids}
    for step in range(1, 6):
        batch: list[Event] = []
        for i, run_id in enumerate(run_ids):
            if step == 1:
                event: Event = started(run_id, ts=float(i))
            else:
                event = moved(run_id, step, f"S{step - 1}", f"S{step}", ts=float(i + step))
            batch.append(event)
            journals[run_id].append(event)
        # Two batches per step, so runs of one batch continue in the next.
        await store.append(batch[:25])
        await store.append(batch[25:])
    for run_id in run_ids:
        assert await store.load(run_id) == journals[run_id]
        record = await store.get_run(run_id)
        assert (record.state, record.seq, record.outcome) == ("S5", 5, RUNNING)
    assert [r.run_id for r in await store.list_runs()] == run_ids


async def test_runs_index_follows_a_run_through_escalation(store: Store) -> None:
    await store.append([started("r-1", ts=10.0)])
    assert await store.get_run("r-1") == RunRecord(
        run_id="r-1",
        machine="refund",
        state="TRIAGE",
        outcome=RUNNING,
        seq=1,
        started=10.0,
        updated=10.0,
    )

    await store.append([moved("r-1", 2, "TRIAGE", "PAY", ts=11.0)])
    record = await store.get_run("r-1")
    assert (record.state, record.outcome, record.seq, record.updated) == ("PAY", RUNNING, 2, 11.0)

    await store.append(
        [
            moved("r-1", 3, "PAY", "ESCALATE", ts=12.0),
            Escalated(
                run_id="r-1",
                seq=4,
                ts=12.5,
                state="ESCALATE",
                reason="repeat",
                detail="refund(amount=150) proposed twice",
            ),
        ]
    )
    record = await store.get_run("r-1")
    assert record == RunRecord(
        run_id="r-1",
        machine="refund",
        state="ESCALATE",
        outcome=ESCALATED,
        seq=4,
        started=10.0,
        updated=12.5,
        reason="repeat",
        detail="refund(amount=150) proposed twice",
    )
    assert await store.escalations() == [record]
    assert await store.unfinished() == []

    await store.append(
        [
            Resumed(run_id="r-1", seq=5, ts=13.0, by="ops", to="PAY"),
            moved("r-1", 6, "ESCALATE", "PAY", ts=13.5),
        ]
    )
    record = await store.get_run("r-1")
    assert (record.outcome, record.state, record.reason, record.detail) == (RUNNING, "PAY", "", "")
    assert await store.escalations() == []
    assert await store.unfinished() == [record]

    await store.append(
        [
            moved("r-1", 7, "PAY", "DONE", ts=14.0),
            Completed(run_id="r-1", seq=8, ts=14.5, state="DONE", output={"ok": True}),
        ]
    )
    assert await store.get_run("r-1") == RunRecord(
        run_id="r-1",
        machine="refund",
        state="DONE",
        outcome=COMPLETED,
        seq=8,
        started=10.0,
        updated=14.5,
    )
    assert await store.unfinished() == []


async def test_runs_index_records_failure(store: Store) -> None:
    await store.append(
        [
            started("r-2", ts=1.0),
            moved("r-2", 2, "TRIAGE", "FAILED", ts=2.0),
            Failed(run_id="r-2", seq=3, ts=3.0, state="FAILED", reason="tool refund is unusable"),
        ]
    )
    record = await store.get_run("r-2")
    assert (record.outcome, record.state, record.reason, record.seq) == (
        FAILED,
        "FAILED",
        "tool refund is unusable",
        3,
    )
    assert await store.list_runs(outcome=FAILED) == [record]


async def test_list_runs_filters_and_order(store: Store) -> None:
    # Started out of order, with a tie on ``started`` broken by run id.
    await store.append(
        [
            started("c", ts=3.0, machine="refund"),
            started("a", ts=1.0, machine="support"),
            started("b2", ts=2.0, machine="refund"),
            started("b1", ts=2.0, machine="support"),
            started("d", ts=4.0, machine="refund"),
        ]
    )
    await store.append(
        [
            moved("c", 2, "TRIAGE", "PAY", ts=5.0),
            moved("d", 2, "TRIAGE", "DONE", ts=5.0),
            Completed(run_id="d", seq=3, ts=5.5, state="DONE"),
            Escalated(run_id="a", seq=2, ts=6.0, state="TRIAGE", reason="budget", detail="x"),
        ]
    )

    def ids(records: list[RunRecord]) -> list[str]:
        return [r.run_id for r in records]

    assert ids(await store.list_runs()) == ["a", "b1", "b2", "c", "d"]
    assert ids(await store.list_runs(machine="refund")) == ["b2", "c", "d"]
    assert ids(await store.list_runs(machine="support")) == ["a", "b1"]
    assert ids(await store.list_runs(state="TRIAGE")) == ["a", "b1", "b2"]
    assert ids(await store.list_runs(outcome=RUNNING)) == ["b1", "b2", "c"]
    assert ids(await store.list_runs(outcome=COMPLETED)) == ["d"]
    assert ids(await store.list_runs(machine="refund", state="TRIAGE")) == ["b2"]
    assert ids(await store.list_runs(machine="refund", outcome=RUNNING, state="PAY")) == ["c"]
    assert ids(await store.list_runs(limit=2)) == ["a", "b1"]
    assert ids(await store.list_runs(machine="refund", limit=1)) == ["b2"]
    assert await store.list_runs(limit=0) == []
    assert await store.list_runs(machine="nope") == []
    assert ids(await store.escalations()) == ["a"]
    assert ids(await store.unfinished()) == ["b1", "b2", "c"]
    # the count a gauge reads agrees with the listing, whatever the backend counts with
    for outcome in (RUNNING, COMPLETED, "escalated", "failed", "nope"):
        assert await store.count_runs(outcome=outcome) == len(
            await store.list_runs(outcome=outcome)
        ), outcome
    # a run resumed from the queue leaves the count at once (SQLite: its row moves now)
    await store.append([Resumed(run_id="a", seq=3, ts=7.0, to="TRIAGE", by="ops")])
    assert await store.count_runs(outcome="escalated") == 0
    assert await store.count_runs(outcome=RUNNING) == 4


async def test_unknown_run_is_not_found(store: Store) -> None:
    await store.append([started("r-1", ts=1.0)])
    with pytest.raises(RunNotFound, match=r"^run 'nope' not found$"):
        await store.load("nope")
    with pytest.raises(RunNotFound, match=r"^run 'nope' not found$"):
        await store.get_run("nope")


async def test_duplicate_idempotency_key_rejects_the_whole_batch(store: Store) -> None:
    await store.append([started("r-1", ts=1.0), intent("r-1", 2, "k-1")])
    before = await snapshot(store, ["r-1", "r-2"])
    with pytest.raises(
        StoreError, match=r"^idempotency key 'k-1' was already recorded; nothing was written$"
    ):
        await store.append(
            [
                started("r-2", ts=2.0),
                moved("r-1", 3, "PAY", "DONE", ts=3.0),
                intent("r-2", 2, "k-1"),
                moved("r-2", 3, "PAY", "DONE", ts=4.0),
            ]
        )
    assert await snapshot(store, ["r-1", "r-2"]) == before
    # The store is still usable, and the rejected run can be written afresh.
    await store.append([started("r-2", ts=2.0), intent("r-2", 2, "k-2")])
    assert [e.seq for e in await store.load("r-2")] == [1, 2]


async def test_duplicate_idempotency_key_within_one_batch_is_rejected(store: Store) -> None:
    with pytest.raises(
        StoreError, match=r"^idempotency key 'k-1' was already recorded; nothing was written$"
    ):
        await store.append(
            [started("r-1", ts=1.0), intent("r-1", 2, "k-1"), intent("r-1", 3, "k-1")]
        )
    assert await snapshot(store, ["r-1"]) == ([], {"r-1": None}, {"r-1": None})


async def test_commits_and_failures_may_share_an_intent_key(store: Store) -> None:
    events = [
        started("r-1", ts=1.0),
        intent("r-1", 2, "k-1"),
        ToolFailed(run_id="r-1", seq=3, ts=3.0, tool="refund", key="k-1", error="timeout"),
        ToolCommitted(run_id="r-1", seq=4, ts=4.0, tool="refund", key="k-1", result=1),
        ToolCommitted(run_id="r-1", seq=5, ts=5.0, tool="refund", key="k-1", result=1, reused=True),
    ]
    await store.append(events)
    assert await store.load("r-1") == events


ANOTHER_WRITER = (
    "another process advanced the run; keep one writer per SQLite journal, and on "
    "PostgreSQL drive runs through leases (a supervisor, `interlock worker` or "
    "`interlock resume` takes them); nothing was written"
)


async def test_duplicate_seq_rejects_the_whole_batch(store: Store) -> None:
    await store.append([started("r-1", ts=1.0), moved("r-1", 2, "TRIAGE", "PAY", ts=2.0)])
    before = await snapshot(store, ["r-1", "r-2"])
    with pytest.raises(StoreError) as info:
        await store.append(
            [
                started("r-2", ts=3.0),
                moved("r-2", 2, "TRIAGE", "PAY", ts=4.0),
                moved("r-1", 2, "TRIAGE", "DONE", ts=5.0),
            ]
        )
    assert str(info.value) == (
        f"run 'r-1' is already at seq 2 in the store, so this batch cannot append seq 2: "
        f"{ANOTHER_WRITER}"
    )
    assert await snapshot(store, ["r-1", "r-2"]) == before


async def test_a_gap_after_the_stored_seq_rejects_the_whole_batch(store: Store) -> None:
    """Regression (#14): the memory and PostgreSQL stores accepted a gap SQLite refuses."""
    await store.append([started("r-1", ts=1.0), moved("r-1", 2, "TRIAGE", "PAY", ts=2.0)])
    before = await snapshot(store, ["r-1", "r-2"])
    with pytest.raises(
        StoreError,
        match=r"^run 'r-1' is at seq 2; cannot append seq 4 \(seqs must follow one another "
        r"without gaps\)$",
    ):
        await store.append([started("r-2", ts=3.0), moved("r-1", 4, "PAY", "DONE", ts=4.0)])
    assert await snapshot(store, ["r-1", "r-2"]) == before
    await store.append([moved("r-1", 3, "PAY", "DONE", ts=4.0)])
    assert [e.seq for e in await store.load("r-1")] == [1, 2, 3]


async def test_another_writer_advancing_a_run_is_named(
    store_kind: str, tmp_path: os.PathLike[str]
) -> None:
    """Regression (#14): a second store object on the same journal stands for another process."""
    async with open_twice(store_kind, tmp_path) as (first, second):
        await first.append([started("r-1", ts=1.0)])
        await second.append([moved("r-1", 2, "TRIAGE", "PAY", ts=2.0)])
        with pytest.raises(StoreError) as info:
            await first.append([moved("r-1", 2, "TRIAGE", "DONE", ts=3.0)])
        assert str(info.value) == (
            "run 'r-1' is already at seq 2 in the store, so this batch cannot append seq 2: "
            f"{ANOTHER_WRITER}"
        )
        assert [e.seq for e in await first.load("r-1")] == [1, 2]


async def test_an_event_msgpack_cannot_encode_rejects_the_whole_batch(store: Store) -> None:
    # The supervisor refuses such values where they enter; this is the store's own guard.
    await store.append([started("r-1", ts=1.0)])
    before = await snapshot(store, ["r-1", "r-2"])
    with pytest.raises(
        StoreError,
        match=r"^transitioned seq 2 of run 'r-1' cannot be encoded \(can't serialize ints "
        r"< -2\*\*63 or > 2\*\*64 - 1\); nothing was written$",
    ):
        await store.append(
            [
                started("r-2", ts=3.0),
                Transitioned(
                    run_id="r-1", seq=2, ts=4.0, src="TRIAGE", dst="PAY", delta={"n": 2**70}
                ),
            ]
        )
    assert await snapshot(store, ["r-1", "r-2"]) == before


async def test_restarting_a_stored_run_is_rejected(store: Store) -> None:
    await store.append([started("r-1", ts=1.0), moved("r-1", 2, "TRIAGE", "PAY", ts=2.0)])
    before = await snapshot(store, ["r-1"])
    with pytest.raises(
        StoreError,
        match=r"^run 'r-1' already exists \(at seq 2\); run ids name one run each: start it "
        r"under another id; nothing was written$",
    ):
        await store.append([started("r-1", ts=9.0)])
    assert await snapshot(store, ["r-1"]) == before


@pytest.mark.parametrize(
    ("seqs", "message"),
    [
        ((1, 2, 2), r"^run 'r-1' already has seq 2; cannot append seq 2$"),
        ((1, 3, 2), r"^run 'r-1' is at seq 1; cannot append seq 3 \(seqs must follow one "),
        ((1, 2, 1), r"^run 'r-1' already exists \(at seq 2\); run ids name one run each"),
    ],
    ids=["repeat", "gap", "second start"],
)
async def test_seqs_out_of_order_within_a_batch_are_rejected(
    store: Store, seqs: tuple[int, ...], message: str
) -> None:
    events = [
        started("r-1", ts=1.0) if seq == 1 else moved("r-1", seq, "A", "B", ts=2.0) for seq in seqs
    ]
    with pytest.raises(StoreError, match=message):
        await store.append(events)
    assert await snapshot(store, ["r-1"]) == ([], {"r-1": None}, {"r-1": None})


@pytest.mark.parametrize(
    "first",
    [moved("r-2", 2, "A", "B", ts=2), moved("r-2", 1, "A", "B", ts=2), started("r-2", ts=2, seq=2)],
    ids=["transitioned seq 2", "transitioned seq 1", "run_started seq 2"],
)
async def test_a_run_starts_with_run_started_at_seq_1(store: Store, first: Event) -> None:
    await store.append([started("r-1", ts=1.0)])
    before = await snapshot(store, ["r-1", "r-2"])
    with pytest.raises(StoreError) as info:
        await store.append([moved("r-1", 2, "TRIAGE", "PAY", ts=2.0), first])
    kind = "run_started" if isinstance(first, RunStarted) else "transitioned"
    assert str(info.value) == (
        "run 'r-2' is not stored yet, so its first event must be run_started seq 1, not "
        f"{kind} seq {first.seq}; nothing was written"
    )
    assert await snapshot(store, ["r-1", "r-2"]) == before


async def test_append_after_close_is_refused(store: Store) -> None:
    await store.aclose()
    await store.aclose()
    with pytest.raises(StoreError, match=r"^store is closed$"):
        await store.append([started("r-1", ts=1.0)])


# --- integrity: damage behind the store's back is reported, never returned ------------------

RESTORE = (
    "the store was written outside interlock or a write was cut short; restore it from a backup"
)


def flip_last_byte(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 0x01])


async def two_runs(store: Store, *, one_per_batch: bool = False) -> list[JournalEvent]:
    """Store r-1 (every kind of event) and r-2 (two events); return r-1's events."""
    events = every_kind("r-1")
    other = [started("r-2", ts=5.0), moved("r-2", 2, "TRIAGE", "PAY", ts=6.0)]
    if one_per_batch:
        for event in events + other:
            await store.append([event])
    else:
        await store.append(events[:4])
        await store.append(events[4:])  # a chunk of seqs 5 to 13 in SQLite
        await store.append(other)
    return events


async def test_an_intact_store_checks_ok(store: Store) -> None:
    await two_runs(store)
    assert await store.check() == CheckReport(runs=2, events=15, problems=())
    assert (await store.check()).ok


@pytest.mark.parametrize(
    ("seq", "change", "what"),
    [
        (7, flip_last_byte, "corrupt (checksum mismatch)"),
        (7, lambda frame: bytes([frame[0] ^ 0x10]) + frame[1:], "corrupt (checksum mismatch)"),
        # The last event of its batch (in SQLite, cut short inside a chunk reads as corrupt).
        (13, lambda frame: frame[:-3], "torn (cut short)"),
    ],
    ids=["payload", "length", "cut short"],
)
async def test_a_damaged_event_is_refused_with_its_run_and_seq(
    store: Store, seq: int, change: typing.Callable[[bytes], bytes], what: str
) -> None:
    """Regression (#14): no test corrupted a PostgreSQL or memory row, so their CRC check
    could be turned off unnoticed."""
    events = await two_runs(store)
    rewrite_event(store, "r-1", seq, change)
    message = f"journal of run 'r-1' is {what} at seq {seq}; {RESTORE}"
    with pytest.raises(JournalCorrupt) as info:
        await store.load("r-1")
    assert str(info.value) == message
    # The other run is untouched, and so is the index.
    assert [e.seq for e in await store.load("r-2")] == [1, 2]
    assert (await store.get_run("r-1")).seq == len(events)
    assert await store.check() == CheckReport(
        runs=2, events=15, problems=(CheckProblem(run_id="r-1", seq=seq, message=message),)
    )


async def test_another_runs_event_in_place_is_refused(store: Store) -> None:
    await two_runs(store)
    rewrite_event(store, "r-1", 2, lambda _frame: frame_of(store, "r-2", 2))
    with pytest.raises(
        JournalCorrupt,
        match=r"^journal of run 'r-1' holds an event of run 'r-2' seq 2 where seq 2 belongs$",
    ):
        await store.load("r-1")


async def test_a_journal_that_does_not_start_with_run_started_is_reported(store: Store) -> None:
    await two_runs(store)
    other = msgspec.msgpack.encode(moved("r-2", 1, "A", "B", ts=5.0))
    rewrite_event(store, "r-2", 1, lambda _frame: frame_event(other))
    assert (await store.check()).problems == (
        CheckProblem(
            run_id="r-2",
            seq=1,
            message="event Transitioned seq 1 of run 'r-2' arrived before the run's "
            "run_started event",
        ),
    )


def frame_of(store: Store, run_id: str, seq: int) -> bytes:
    """A stored frame, read by rewriting it unchanged."""
    found: list[bytes] = []
    rewrite_event(store, run_id, seq, lambda frame: found.append(frame) or frame)  # type: ignore[func-returns-value]
    return found[0]


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (1, "journal of run 'r-1' starts at seq 2, not seq 1; restore it from a backup"),
        (
            7,
            "journal of run 'r-1' is missing or repeating events: seq 8 follows seq 6; "
            "restore it from a backup",
        ),
        (
            13,
            "journal of run 'r-1' ends at seq 12, but the runs index says the run reached "
            "seq 13: events are missing; restore it from a backup",
        ),
    ],
    ids=["first", "middle", "last"],
)
async def test_a_missing_event_is_reported(store: Store, seq: int, message: str) -> None:
    """Regression (#14): the memory and PostgreSQL stores returned a journal with a hole."""
    await two_runs(store, one_per_batch=True)
    delete_event(store, "r-1", seq)
    with pytest.raises(JournalCorrupt) as info:
        await store.load("r-1")
    assert str(info.value) == message
    assert await store.check() == CheckReport(
        runs=2, events=14, problems=(CheckProblem(run_id="r-1", seq=seq, message=message),)
    )


async def test_a_journal_without_its_index_row_and_the_reverse_are_reported(
    store: Store,
) -> None:
    await two_runs(store, one_per_batch=True)
    for seq in (1, 2):
        delete_event(store, "r-2", seq)
    message = (
        "journal of run 'r-2' is missing, but the runs index says the run reached seq 2; "
        "restore it from a backup"
    )
    with pytest.raises(JournalCorrupt) as info:
        await store.load("r-2")
    assert str(info.value) == message
    assert (await store.check()).problems == (
        CheckProblem(run_id="r-2", seq=None, message=message),
    )


DAMAGED_ROW = (
    "runs index row of run 'r-1' is damaged (checksum mismatch); the store was written "
    "outside interlock or its file is damaged; restore it from a backup"
)
durable = pytest.mark.parametrize(
    "store_kind", [p for p in STORE_PARAMS if p.values != ("memory",)]
)


@durable
@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("outcome", "completed"),
        ("state", "DONE"),
        ("seq", 14),
        ("machine", "refunds"),
        ("started", 1000.5),
        ("detail", "x"),
    ],
)
async def test_a_damaged_index_row_is_reported_by_every_read(
    store: Store, column: str, value: object
) -> None:
    """Regression (#14): a changed index row made listing skip a run (its outcome no longer
    matched the filter) or show a garbled one, with no error."""
    await two_runs(store)
    set_index_column(store, "r-1", column, value)
    if isinstance(store, (SQLiteStore, PostgresStore)):
        # SQLite and PostgreSQL read the unfinished runs through their own index (#18), and
        # r-1 failed: what resume reads is the one unfinished run, checked, and nothing else.
        assert [r.run_id for r in await store.unfinished()] == ["r-2"]
    for read in (
        lambda: store.list_runs(),
        lambda: store.list_runs(outcome=FAILED),
        lambda: store.list_runs(outcome=RUNNING),
        *(() if isinstance(store, (SQLiteStore, PostgresStore)) else (store.unfinished,)),
        store.escalations,
        lambda: store.list_runs(machine="refund", limit=1),
        lambda: store.get_run("r-1"),
        lambda: store.load("r-1"),
    ):
        with pytest.raises(IndexDamaged) as info:
            await read()
        assert str(info.value) == DAMAGED_ROW
        assert info.value.run_id == "r-1"
    # The journal is sound and so is the other run.
    assert [e.seq for e in await store.load("r-2")] == [1, 2]
    assert await store.get_run("r-2") == index_row(await store.load("r-2"))
    report = await store.check()
    assert report.problems == (CheckProblem(run_id="r-1", seq=None, message=DAMAGED_ROW),)
    # A batch continuing the run is refused, and nothing of it is written.
    with pytest.raises(IndexDamaged, match=r"^runs index row of run 'r-1' is damaged "):
        await store.append(
            [started("r-3", ts=9.0), Failed(run_id="r-1", seq=14, ts=9.0, state="X", reason="r")]
        )
    with pytest.raises(RunNotFound):
        await store.get_run("r-3")


@durable
async def test_an_index_row_that_agrees_with_its_checksum_but_not_its_journal_is_reported(
    store: Store,
) -> None:
    """What another program could write: a consistent row that the journal contradicts."""
    await store.append([started("r-1", ts=1.0), moved("r-1", 2, "TRIAGE", "PAY", ts=2.0)])
    record = await store.get_run("r-1")
    damaged = msgspec.structs.replace(record, state="DONE", outcome=COMPLETED)
    set_index_column(store, "r-1", "state", "DONE")
    set_index_column(store, "r-1", "outcome", COMPLETED)
    set_index_column(store, "r-1", "crc", record_checksum(damaged))
    assert await store.get_run("r-1") == damaged
    [problem] = (await store.check()).problems
    assert problem == CheckProblem(
        run_id="r-1",
        seq=None,
        message="runs index row of run 'r-1' is damaged (state 'DONE' where the journal says "
        "'PAY', outcome 'completed' where the journal says 'running'); the store was written "
        "outside interlock or its file is damaged; restore it from a backup",
    )


@durable
async def test_an_index_row_missing_beside_its_journal_is_reported(store: Store) -> None:
    await two_runs(store)
    index_sql(store, "DELETE FROM runs WHERE run_id = ?", ("r-2",))
    message = (
        "runs index row of run 'r-2' is damaged (the row is missing, but the run's journal "
        "holds events); the store was written outside interlock or its file is damaged; "
        "restore it from a backup"
    )
    for read in (store.get_run, store.load):
        with pytest.raises(IndexDamaged) as info:
            await read("r-2")
        assert str(info.value) == message
    problems = (await store.check()).problems
    assert problems[-1] == CheckProblem(run_id="r-2", seq=None, message=message)
    if isinstance(store, SQLiteStore):
        # SQLite counts the runs started, since one flipped byte can hide a row (see
        # test_sqlite); PostgreSQL does not (one counter row would serialize its writers).
        count = (
            "runs index is damaged (row count 1, but 2 runs were started); the store was "
            "written outside interlock or its file is damaged; restore it from a backup"
        )
        assert problems[:-1] == (CheckProblem(run_id=None, seq=None, message=count),)
        with pytest.raises(IndexDamaged) as info:
            await store.list_runs()
        assert str(info.value) == count
        assert info.value.run_id is None
    else:
        assert problems[:-1] == ()


# --- property: random well-formed journals come back unchanged ---------------------------

_names = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=8)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
_json_dict = st.dictionaries(st.text(max_size=5), _json, max_size=3)


@st.composite
def _journal(draw: st.DrawFn, run_id: str) -> list[Event]:
    """A well-formed run: RunStarted, then any mix of follow-up events."""
    ts = draw(st.floats(min_value=0, max_value=2e9, allow_nan=False))
    state = draw(_names)
    events: list[Event] = [
        RunStarted(
            run_id=run_id,
            seq=1,
            ts=ts,
            machine=draw(st.sampled_from(["refund", "support", "extract"])),
            state=state,
            inputs=draw(_json_dict),
        )
    ]
    for seq in range(2, draw(st.integers(min_value=1, max_value=8)) + 1):
        ts += draw(st.floats(min_value=0, max_value=10, allow_nan=False))
        kind = draw(st.sampled_from(["move", "model", "intent", "commit", "escalate", "end"]))
        common = {"run_id": run_id, "seq": seq, "ts": ts}
        if kind == "move":
            dst = draw(_names)
            event: Event = Transitioned(**common, src=state, dst=dst, delta=draw(_json_dict))
            state = dst
        elif kind == "model":
            event = ModelCalled(
                **common,
                state=state,
                model="m",
                prompt_hash="0" * 16,
                prompt=draw(st.text(max_size=20)),
                raw=draw(st.text(max_size=20)),
                usage=TokenUsage(prompt=draw(st.integers(0, 10**6)), completion=3),
            )
        elif kind == "intent":
            key = f"{run_id}:{state}:{seq}"
            event = IntentRecorded(**common, state=state, tool="t", args=draw(_json_dict), key=key)
        elif kind == "commit":
            event = ToolCommitted(**common, tool="t", key=f"{run_id}:x", result=draw(_json))
        elif kind == "escalate":
            event = draw(
                st.sampled_from(
                    [
                        Escalated(**common, state=state, reason="repeat", detail="d"),
                        Resumed(**common, by="ops"),
                    ]
                )
            )
        else:
            event = draw(
                st.sampled_from(
                    [
                        Completed(**common, state=state, output=None),
                        Failed(**common, state=state, reason="gave up"),
                    ]
                )
            )
        events.append(event)
    return events


@st.composite
def _batches(draw: st.DrawFn) -> tuple[dict[str, list[Event]], list[list[Event]]]:
    """Several runs' journals, interleaved (each run in order) and cut into batches."""
    count = draw(st.integers(min_value=1, max_value=6))
    journals = {f"run-{i}": draw(_journal(f"run-{i}")) for i in range(count)}
    pending = {run_id: list(events) for run_id, events in journals.items()}
    order: list[Event] = []
    while pending:
        run_id = draw(st.sampled_from(sorted(pending)))
        order.append(pending[run_id].pop(0))
        if not pending[run_id]:
            del pending[run_id]
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=len(order)), max_size=4)))
    bounds = [0, *cuts, len(order)]
    batches = [order[a:b] for a, b in itertools.pairwise(bounds) if a < b]
    return journals, batches


# NOTE: the test opens its own store per example, because a function-scoped fixture
# is set up once for all of hypothesis's examples.
@pytest.mark.parametrize("store_kind", STORE_PARAMS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_batches())
async def test_random_batches_round_trip(
    store_kind: str,
    tmp_path_factory: pytest.TempPathFactory,
    data: tuple[dict[str, list[Event]], list[list[Event]]],
) -> None:
    journals, batches = data
    async with fresh_store(store_kind, tmp_path_factory.mktemp("prop")) as store:
        for batch in batches:
            await store.append(batch)
        expected_index = {run_id: index_row(events) for run_id, events in journals.items()}
        for run_id, events in journals.items():
            assert await store.load(run_id) == events
            assert await store.get_run(run_id) == expected_index[run_id]
            # A follower's tail read, from every seq (batches split a run's journal into
            # chunks on SQLite: a tail may start inside one).
            for after in range(len(events) + 1):
                assert await store.load_after(run_id, after) == events[after:], after
        expected_order = sorted(expected_index.values(), key=lambda r: (r.started, r.run_id))
        assert await store.list_runs() == expected_order


async def test_a_tail_read_of_a_missing_run_or_a_damaged_tail_is_named(store: Store) -> None:
    with pytest.raises(RunNotFound):
        await store.load_after("nope", 0)
    with pytest.raises(RunNotFound):
        await store.load_after("nope", 3)
    events = [
        started("r-1", ts=1.0),
        *(moved("r-1", seq, f"S{seq}", f"S{seq + 1}", ts=float(seq)) for seq in range(2, 6)),
    ]
    await store.append(events[:2])
    for event in events[2:]:
        await store.append([event])  # one batch each: the damage below removes one
    assert await store.load_after("r-1", 5) == []
    assert await store.load_after("r-1", 9) == []
    delete_event(store, "r-1", 4)
    with pytest.raises(JournalCorrupt, match="'r-1'"):
        await store.load_after("r-1", 2)
