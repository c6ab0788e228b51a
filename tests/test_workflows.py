"""The three seed workflows, end to end: happy paths, failure paths, side effects counted."""

from __future__ import annotations

import msgspec
import pytest
import trio

from interlock import open_supervisor
from interlock.demo.workflows import WORKFLOWS, Backend, extraction, order_total, refund
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore

ORDER_100 = "ord-100044"


@pytest.fixture
def backend():
    backend = Backend(":memory:")
    yield backend
    backend.close()


async def run_one(backend, workflow, inputs, script, run_id="r-1"):
    store = MemoryStore()
    provider = ScriptedProvider(script, model="test")
    async with open_supervisor(
        [WORKFLOWS[workflow].build(backend)], store, provider=provider
    ) as sup:
        handle = await sup.start_run(workflow, inputs, run_id=run_id)
    return await handle.wait(), await store.load(run_id)


def kinds(events):
    return [type(e).__struct_config__.tag for e in events]


def call(tool, **args):
    return msgspec.json.encode({"tool": tool, "args": args}).decode()


def test_order_fixture_total_is_100():
    assert order_total(ORDER_100) == 100.0


async def test_refund_over_total_is_rejected_then_corrected_commits_once(backend):
    script = [
        call("lookup_order", order_id=ORDER_100),
        call("refund", order_id=ORDER_100, amount=150, currency="USD", reason="broken"),
        call("refund", order_id=ORDER_100, amount=100, currency="USD", reason="broken"),
        call("send_email", to="a@example.com", subject="Refund", lines=["done"]),
        '{"next": "COMPLETED", "data": {"answer": "refunded 100"}}',
    ]
    result, events = await run_one(
        backend,
        "refund",
        {"order_id": ORDER_100, "customer": "a@example.com", "requested": 150.0},
        script,
    )
    assert result.outcome == "completed"
    assert result.output == {"answer": "refunded 100"}
    rejected = [e for e in events if type(e).__name__ == "ProposalRejected"]
    assert len(rejected) == 1
    (violation,) = rejected[0].violations
    assert (violation.code, violation.path, violation.message, violation.hint) == (
        "guard",
        "args.amount",
        "args.amount: 150.0 exceeds the order total 100.0",
        "propose amount <= 100.0",
    )
    assert kinds(events) == [
        "run_started",
        "model_called", "intent_recorded", "tool_committed",
        "model_called", "proposal_rejected",
        "model_called", "intent_recorded", "tool_committed",
        "model_called", "intent_recorded", "tool_committed",
        "model_called", "transitioned", "completed",
    ]  # fmt: skip
    counts = backend.counts()
    assert counts["refund"] == {"executions": 1, "keys": 1, "applied": 1, "duplicates": 0}
    assert counts["send_email"]["applied"] == 1


async def test_refund_guard_counts_what_was_already_refunded(backend):
    script = [
        call("lookup_order", order_id=ORDER_100),
        call("refund", order_id=ORDER_100, amount=60, currency="USD", reason="part one"),
        call("refund", order_id=ORDER_100, amount=60, currency="USD", reason="part two"),
        '{"next": "ESCALATE"}',
    ]
    result, events = await run_one(
        backend,
        "refund",
        {"order_id": ORDER_100, "customer": "a@example.com", "requested": 120.0},
        script,
    )
    rejected = [e for e in events if type(e).__name__ == "ProposalRejected"]
    assert rejected[0].violations[0].message == (
        "args.amount: 60.0 exceeds the order total 100.0 minus 60.0 already refunded"
    )
    assert rejected[0].violations[0].hint == "propose amount <= 40.0"
    assert result.outcome == "escalated"
    assert result.reason == "proposal_escalated"


async def test_refund_schema_refuses_string_amount_and_bad_currency(backend):
    script = [
        call("lookup_order", order_id=ORDER_100),
        call("refund", order_id=ORDER_100, amount="100", currency="USD", reason="broken"),
        call("refund", order_id=ORDER_100, amount=10, currency="usd", reason="broken"),
        call("refund", order_id="100", amount=10, currency="USD", reason="broken"),
    ]
    result, events = await run_one(
        backend,
        "refund",
        {"order_id": ORDER_100, "customer": "a@example.com", "requested": 1.0},
        script,
    )
    violations = [e.violations[0] for e in events if type(e).__name__ == "ProposalRejected"]
    assert [(v.code, v.path) for v in violations] == [
        ("schema", "args.amount"),
        ("schema", "args.currency"),
        ("schema", "args.order_id"),
    ]
    assert violations[0].message == "args.amount: expected `float`, got `str`"
    assert violations[1].message == "args.currency: invalid enum value 'usd'"
    assert violations[1].hint == "use one of: EUR, USD"
    assert (
        violations[2].message == "args.order_id: expected `str` matching regex '^ord-[0-9]{3,10}$'"
    )
    assert result.outcome == "escalated"
    assert result.reason == "consecutive_failures"
    assert backend.counts()["refund"]["executions"] == 0


async def test_refund_oracle_completes_after_guard_correction(backend):
    inputs = {"order_id": ORDER_100, "customer": "a@example.com", "requested": 300.0}
    result, events = await run_one(backend, "refund", inputs, refund.oracle)
    assert result.outcome == "completed"
    committed = [e for e in events if type(e).__name__ == "IntentRecorded" and e.tool == "refund"]
    assert [e.args["amount"] for e in committed] == [100.0]


async def test_extraction_repairs_then_commits(backend):
    inputs = {"document": "Report mentioning a, b.", "terms": ["a", "b"], "sloppy": True}
    result, events = await run_one(backend, "extraction", inputs, extraction.oracle)
    assert result.outcome == "completed"
    assert result.output == {"written": 2}
    path = [(e.src, e.dst) for e in events if type(e).__name__ == "Transitioned"]
    assert path == [
        ("IDLE", "EXTRACTING"),
        ("EXTRACTING", "VALIDATING"),
        ("VALIDATING", "REPAIRING"),
        ("REPAIRING", "VALIDATING"),
        ("VALIDATING", "COMMITTING"),
        ("COMMITTING", "COMPLETED"),
    ]
    repair = next(e for e in events if type(e).__name__ == "Transitioned" and e.dst == "REPAIRING")
    assert repair.delta["errors"] == [
        {
            "path": "entities[0].confidence",
            "message": "confidence 0.5 is below 0.7",
            "hint": "re-check the entity and report confidence >= 0.7, or drop it",
        }
    ]
    rows = backend._db.execute("SELECT entity_id, category FROM entities ORDER BY idx").fetchall()
    assert [r[0] for r in rows] == ["e0", "e1"]


async def test_extraction_rejects_empty_document(backend):
    result, events = await run_one(backend, "extraction", {"document": "  "}, extraction.oracle)
    assert result.outcome == "failed"
    assert result.reason == "document is empty; start the run with a non-empty 'document' input"
    assert kinds(events) == ["run_started", "step_proposed", "transitioned", "failed"]


async def test_extraction_escalates_after_repair_budget(backend):
    bad = '{"next": "VALIDATING", "data": {"entities": [{"id": "", "category": "alien", "confidence": 0.1}]}}'
    result, events = await run_one(
        backend, "extraction", {"document": "x", "terms": ["x"]}, [bad, bad, bad]
    )
    assert result.outcome == "escalated"
    assert result.state == "ESCALATE"
    last = [e for e in events if type(e).__name__ == "Transitioned"][-1]
    assert (last.src, last.dst, last.reason) == ("VALIDATING", "ESCALATE", "step")
    assert last.delta["reason"] == "still invalid after 2 repairs"
    assert [err["path"] for err in last.delta["errors"]] == [
        "entities[0].id",
        "entities[0].category",
        "entities[0].confidence",
    ]
    assert backend.counts()["write_entities"]["executions"] == 0


async def test_extraction_commit_is_idempotent_on_key(backend):
    entities = [{"id": "e0", "category": "person", "confidence": 0.9}]
    first = await backend.write_entities("k-1", "r-1", entities)
    again = await backend.write_entities("k-1", "r-1", entities)
    assert first == {"written": 1, "entities": 1}
    assert again == {"written": 0, "entities": 1}
    assert backend.counts()["write_entities"] == {
        "executions": 2,
        "keys": 1,
        "applied": 1,
        "duplicates": 0,
    }


async def test_router_rejects_illegal_pick_then_routes(backend):
    script = [
        '{"next": "FORMAT_RESPONSE"}',
        '{"next": "QUERY_DB", "data": {"category": "billing", "summary": "charged twice"}}',
        '{"next": "DONE", "data": {"response": "ticket opened"}}',
    ]
    result, events = await run_one(
        backend, "router", {"ticket": "charged twice", "category": "billing"}, script
    )
    assert result.outcome == "completed"
    assert result.state == "DONE"
    rejection = next(e for e in events if type(e).__name__ == "ProposalRejected")
    assert rejection.violations[0].message == (
        "transition INIT -> FORMAT_RESPONSE is not allowed; legal next states from 'INIT': QUERY_DB, ESCALATE"
    )
    assert rejection.violations[0].hint == "propose next: one of QUERY_DB, ESCALATE"
    rows = backend._db.execute("SELECT db_key FROM tickets").fetchall()
    assert rows == [("r-1:QUERY_DB",)]


async def test_router_retried_commit_does_not_write_twice(backend):
    first = await backend.record_ticket("r-1:QUERY_DB", "r-1:QUERY_DB:7", "r-1", "billing", "x")
    retry = await backend.record_ticket("r-1:QUERY_DB", "r-1:QUERY_DB:9", "r-1", "billing", "x")
    assert first["new"] is True
    assert retry["new"] is False
    assert first["ticket"] == retry["ticket"]
    assert backend.counts()["record_ticket"] == {
        "executions": 2,
        "keys": 2,
        "applied": 1,
        "duplicates": 0,
    }


async def test_router_rejects_wrong_category_enum(backend):
    script = [
        '{"next": "QUERY_DB", "data": {"category": "Billing"}}',
        '{"next": "QUERY_DB", "data": {"category": "billing"}}',
        '{"next": "DONE", "data": {"response": "ok"}}',
    ]
    result, events = await run_one(
        backend, "router", {"ticket": "t", "category": "billing"}, script
    )
    rejection = next(e for e in events if type(e).__name__ == "ProposalRejected")
    assert (rejection.violations[0].code, rejection.violations[0].path) == (
        "schema",
        "data.category",
    )
    assert rejection.violations[0].hint == "use one of: account, billing, technical"
    assert result.outcome == "completed"


@pytest.mark.parametrize("workflow", sorted(WORKFLOWS))
async def test_workflow_oracles_complete_many_runs(backend, workflow):
    import random

    rng = random.Random(7)
    module = WORKFLOWS[workflow]
    store = MemoryStore()
    provider = ScriptedProvider(module.oracle)
    async with open_supervisor([module.build(backend)], store, provider=provider) as sup:
        handles = []
        async with trio.open_nursery() as nursery:

            async def start(i):
                handles.append(
                    await sup.start_run(
                        workflow, module.make_inputs(i, rng), run_id=f"{workflow}-{i}"
                    )
                )

            for i in range(60):
                nursery.start_soon(start, i)
    results = [await h.wait() for h in handles]
    outcomes = {r.outcome for r in results}
    if workflow == "extraction":
        assert outcomes == {"completed", "failed"}  # every tenth document is empty
        assert sum(r.outcome == "failed" for r in results) == 6
    else:
        assert outcomes == {"completed"}


async def test_duplicates_count_the_same_effect_applied_twice_in_one_run(backend):
    """Issue 32: a call repeated under a second key is no duplicate per key, but the
    customer got two refunds and two emails all the same."""
    await backend.refund("r-1:WORK:3", "r-1", ORDER_100, 50.0)
    await backend.refund("r-1:WORK:9", "r-1", ORDER_100, 50.0)  # the same refund again
    await backend.refund("r-1:WORK:11", "r-1", ORDER_100, 25.0)  # another amount: another call
    await backend.refund("r-2:WORK:3", "r-2", ORDER_100, 50.0)  # another run
    for key in ("r-1:WORK:5", "r-1:WORK:7", "r-1:WORK:7"):  # twice under one key, too
        await backend.send_email(key, "r-1", "a@example.com", "Your refund")
    entities = [{"id": "e0", "category": "person", "confidence": 0.9}]
    for key in ("r-3:COMMIT:4", "r-3:COMMIT:6"):
        await backend.write_entities(key, "r-3", entities)
    await backend.write_entities("r-4:COMMIT:4", "r-4", entities)
    counts = backend.counts()
    assert counts["refund"] == {"executions": 4, "keys": 4, "applied": 4, "duplicates": 1}
    assert counts["send_email"] == {"executions": 3, "keys": 2, "applied": 3, "duplicates": 2}
    assert counts["write_entities"] == {"executions": 3, "keys": 3, "applied": 3, "duplicates": 1}
    assert counts["record_ticket"]["duplicates"] == 0


async def test_the_demo_applies_no_effect_twice_and_counts_the_refused_repeats():
    """Issue 32: under chaos (a model repeating its last call), the demo said "duplicates 0"
    while customers got a second refund and a second email. Every repeat is now refused and
    counted as such; no effect is applied twice."""
    from interlock.demo._run import DemoConfig, run_demo

    config = DemoConfig(
        runs=60,
        workflows=("refund",),
        chaos_rate=0.1,
        seed=10,
        db=":memory:",
        latency=(0.0, 0.0),
        run_prefix="t",
    )
    row = (await run_demo(config))["workflows"]["refund"]
    assert {tool: c["duplicates"] for tool, c in row["side_effects"].items()} == {
        "refund": 0,
        "send_email": 0,
    }
    assert row["repeats_refused"] == row["rejections"]["already_committed"] > 0
