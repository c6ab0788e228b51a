"""The verification gateway over real loopback HTTP: serve_gateway (hypercorn on trio), a
SQLite journal in tmp_path, httpx as the client (#17)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import App, Go, Machine, Step, Tool, Worker, open_supervisor, replay
from interlock.core._events import Violation
from interlock.core._messages import ToolCall, Verdict
from interlock.demo._run import DemoConfig, build_app
from interlock.gateway import GatewayServer, openapi_document, serve_gateway
from interlock.gateway._guard import Limits
from interlock.gateway._keys import KeyRing, Principal
from interlock.protocol import CallOut, RunOut, VerdictOut, VerifyOut, ViolationOut
from interlock.providers import ScriptedProvider
from interlock.stores import open_sqlite_store

pytestmark = pytest.mark.slow


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    cents: int


async def never(args: Any, ctx: Any) -> Any:  # an external run's caller executes its tools
    raise AssertionError("an external run's tool is executed by its caller")


def shop(name: str = "shop") -> Machine:
    return Machine(
        name,
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"], instructions="charge, then finish")},
        tools=[Tool("charge", never, Charge, description="Charge the customer.")],
    )


CHARGE = '{"tool": "charge", "args": {"cents": 500}}'
DONE = '{"next": "COMPLETED", "data": {"receipt": "r-9"}}'
BAD = '{"tool": "charge", "args": {"cents": "five"}}'


@asynccontextmanager
async def gateway(
    app: App | Machine, db: Path, **options: Any
) -> AsyncIterator[tuple[GatewayServer, httpx.AsyncClient]]:
    options.setdefault("keyring", KeyRing())
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server: GatewayServer = await nursery.start(
                partial(serve_gateway, app, db=str(db), port=0, **options)
            )
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                yield server, client
            server.stop()


def decode(response: httpx.Response, kind: type[Any]) -> Any:
    return msgspec.json.decode(response.content, type=kind)


async def start(client: httpx.AsyncClient, run_id: str, machine: str = "shop") -> RunOut:
    response = await client.post(
        "/v1/runs", json={"machine": machine, "run_id": run_id, "mode": "external"}
    )
    assert response.status_code == 201, response.text
    return decode(response, RunOut)


async def propose(
    client: httpx.AsyncClient, run_id: str, proposal: str, seq: int | None
) -> httpx.Response:
    body: dict[str, Any] = {"proposal": proposal}
    if seq is not None:
        body["expected_seq"] = seq
    return await client.post(f"/v1/runs/{run_id}/proposals", json=body)


async def journal(db: Path, run_id: str) -> list[Any]:
    store = await open_sqlite_store(str(db), readonly=True)
    try:
        return await store.load(run_id)
    finally:
        await store.aclose()


def kinds(events: list[Any]) -> list[str]:
    return [type(e).__struct_config__.tag for e in events]


# -- the two kinds of runs ------------------------------------------------------------------


async def test_a_hosted_run_of_the_demo_app_is_driven_and_watched_end_to_end(
    tmp_path: Path,
) -> None:
    app = build_app(DemoConfig(chaos_rate=0.0, latency=(0.0, 0.001)))
    async with gateway(app, tmp_path / "j.db") as (_, client):
        inputs = {"order_id": "ord-100001", "customer": "a@example.com", "requested": 25.0}
        created = await client.post(
            "/v1/runs", json={"machine": "refund", "inputs": inputs, "run_id": "h-1"}
        )
        assert created.status_code == 201, created.text
        assert created.headers["location"] == "/v1/runs/h-1"
        run = decode(created, RunOut)
        assert (run.mode, run.machine) == ("hosted", "refund")
        assert "lookup_order" in [t.name for t in run.tools]
        assert "state: WORK" in run.context  # the rendered context the model gets
        # Watch it: the stream ends once the run completes.
        seen = []
        async with client.stream("GET", "/v1/runs/h-1/stream") as stream:
            assert stream.headers["content-type"] == "text/event-stream"
            async for line in stream.aiter_lines():
                if line.startswith("event: "):
                    seen.append(line.removeprefix("event: "))
        assert seen[0] == "run_started"
        assert seen[-1] == "completed"
        done = decode(await client.get("/v1/runs/h-1"), RunOut)
        assert done.outcome == "completed"
        assert done.output == {"answer": "refunded 25.00 USD on ord-100001"}
        listed = (await client.get("/v1/runs", params={"machine": "refund"})).json()
        assert [r["id"] for r in listed["runs"]] == ["h-1"]
        # a hosted run takes no proposals or results from outside, live or ended
        refused = await propose(client, "h-1", DONE, None)
        assert refused.status_code == 409
        assert "is completed" in refused.json()["detail"]
        refused = await propose(client, "h-1", DONE, 1)
        assert refused.status_code == 409
        assert "is hosted" in refused.json()["detail"]
        key = next(
            e["data"]["key"]
            for e in (await client.get("/v1/runs/h-1/events")).json()["events"]
            if e["kind"] == "intent_recorded"
        )
        result = await client.post("/v1/runs/h-1/results", json={"key": key, "result": 1})
        assert result.status_code == 409
    assert kinds(await journal(tmp_path / "j.db", "h-1"))[-1] == "completed"


async def test_an_external_run_is_driven_step_by_step(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    async with gateway(shop(), db) as (_, client):
        run = await start(client, "x-1")
        assert (run.state, run.seq, run.next, run.pending) == ("PAY", 1, ["COMPLETED"], None)
        assert run.tools[0].name == "charge"
        assert run.tools[0].schema["properties"]["cents"]["type"] == "integer"
        bad = decode(await propose(client, "x-1", BAD, run.seq), VerdictOut)
        assert not bad.accepted
        assert bad.key is None
        assert (bad.violations[0].code, bad.violations[0].path) == ("schema", "args.cents")
        assert bad.violations[0].hint
        ok = decode(await propose(client, "x-1", CHARGE, bad.seq), VerdictOut)
        assert ok.accepted
        assert (ok.tool, ok.args, ok.key) == ("charge", {"cents": 500}, f"x-1:PAY:{ok.seq}")
        # the intent is durable before the answer
        assert kinds(await journal(db, "x-1"))[-1] == "intent_recorded"
        waiting = decode(await client.get("/v1/runs/x-1"), RunOut)
        assert waiting.pending is not None
        assert waiting.pending.key == ok.key
        reported = await client.post(
            "/v1/runs/x-1/results", json={"key": ok.key, "result": {"charged": 500}}
        )
        committed = decode(reported, VerdictOut)
        assert committed.accepted
        assert committed.seq == ok.seq + 1
        end = decode(await propose(client, "x-1", DONE, committed.seq), VerdictOut)
        assert (end.accepted, end.outcome, end.state) == (True, "completed", "COMPLETED")
        final = decode(await client.get("/v1/runs/x-1"), RunOut)
        assert (final.outcome, final.output) == ("completed", {"receipt": "r-9"})
        page = (await client.get("/v1/runs/x-1/events", params={"after": 2})).json()
        assert [e["seq"] for e in page["events"]] == list(range(3, final.seq + 1))
        assert page["last_seq"] == final.seq
    events = await journal(db, "x-1")
    assert events[0].external is True
    assert kinds(events).count("tool_committed") == 1
    assert replay(events, shop()).diverged == ()


class Receipt(msgspec.Struct, forbid_unknown_fields=True):
    receipt: str


def paying() -> Machine:
    """``shop``, whose moves out of PAY carry a receipt."""
    return Machine(
        "shop",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"], data=Receipt)},
        tools=[Tool("charge", never, Charge, description="Charge the customer.")],
    )


async def test_a_runs_description_gives_the_data_schema_of_its_moves(tmp_path: Path) -> None:
    """Issue 32: an external agent learned the data a move must carry only from rejections."""
    expected = {
        "title": "Receipt",
        "type": "object",
        "properties": {"receipt": {"type": "string"}},
        "required": ["receipt"],
        "additionalProperties": False,
    }
    async with gateway(paying(), tmp_path / "j.db") as (_, client):
        run = await start(client, "x-1")
        assert run.data_schema == expected
        described = (await client.get("/v1/runs/x-1")).json()
        assert described["data_schema"] == expected
        assert described["tools"][0]["schema"]["properties"]["cents"] == {"type": "integer"}
        schema = json.dumps(expected, separators=(",", ":"))
        assert (
            f"data of a move from here: must match the JSON Schema {schema}"
            in (described["context"])
        )
        done = decode(await propose(client, "x-1", DONE, run.seq), VerdictOut)
        assert done.outcome == "completed"
        assert decode(await client.get("/v1/runs/x-1"), RunOut).data_schema is None
    async with gateway(shop(), tmp_path / "k.db") as (_, client):
        assert (await start(client, "x-2")).data_schema is None  # any object will do


async def test_a_stale_expected_seq_is_a_409(tmp_path: Path) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (_, client):
        run = await start(client, "x-1")
        first = await propose(client, "x-1", BAD, run.seq)
        assert first.status_code == 200
        # another client advanced the run: this one's view (seq 1) is stale
        stale = await propose(client, "x-1", CHARGE, run.seq)
        assert stale.status_code == 409
        problem = stale.json()
        assert stale.headers["content-type"] == "application/problem+json"
        assert problem["status"] == 409
        assert "another request advanced the run" in problem["detail"]
        ahead = await propose(client, "x-1", CHARGE, 99)
        assert ahead.status_code == 409
        assert "has not reached" in ahead.json()["detail"]


async def test_a_retried_proposal_over_the_cap_gets_its_recorded_refusal(tmp_path: Path) -> None:
    """A proposal over the gate's cap is journaled as an excerpt with its size and hash
    (#33); a retry of it is still recognised from the journal, not a 409."""
    db = tmp_path / "j.db"
    oversized = '{"tool": "charge", "args": {"note": "' + "n" * 300_000 + '"}}'
    async with gateway(shop(), db) as (_, client):
        run = await start(client, "x-1")
        first = decode(await propose(client, "x-1", oversized, run.seq), VerdictOut)
        assert not first.accepted
    async with gateway(shop(), db) as (_, client):
        retried = decode(await propose(client, "x-1", oversized, run.seq), VerdictOut)
        assert (retried.seq, retried.replayed, retried.accepted) == (first.seq, True, False)
        other = await propose(client, "x-1", oversized.replace("n", "m"), run.seq)
        assert other.status_code == 409
    events = await journal(db, "x-1")
    assert kinds(events) == ["run_started", "model_called", "proposal_rejected"]
    assert events[1].oversized.raw_bytes == len(oversized)


async def test_retries_get_the_recorded_answer_and_journal_nothing_twice(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    async with gateway(shop(), db) as (_, client):
        run = await start(client, "x-1")
        # the same proposal twice at once, and once more after: one decision
        async with trio.open_nursery() as nursery:
            answers: list[httpx.Response] = []

            async def send() -> None:
                answers.append(await propose(client, "x-1", CHARGE, run.seq))

            nursery.start_soon(send)
            nursery.start_soon(send)
        again = await propose(client, "x-1", CHARGE, run.seq)
        verdicts = [decode(r, VerdictOut) for r in [*answers, again]]
        assert len({(v.key, v.seq) for v in verdicts}) == 1
        assert sorted(v.replayed for v in verdicts) == [False, True, True]
        key = verdicts[0].key
        assert key is not None
        first = decode(
            await client.post("/v1/runs/x-1/results", json={"key": key, "result": {"n": 1}}),
            VerdictOut,
        )
        repeat = decode(
            await client.post("/v1/runs/x-1/results", json={"key": key, "result": {"n": 2}}),
            VerdictOut,
        )
        assert repeat.result == {"n": 1}  # the recorded result, not the resent one
        assert repeat.seq == first.seq
        end = decode(await propose(client, "x-1", DONE, first.seq), VerdictOut)
        assert end.outcome == "completed"
        # after the run ended, both retries still get their recorded answers
        late = decode(
            await client.post("/v1/runs/x-1/results", json={"key": key, "result": None}),
            VerdictOut,
        )
        assert (late.result, late.replayed) == ({"n": 1}, True)
        assert decode(await propose(client, "x-1", DONE, first.seq), VerdictOut).replayed
    # ... and after a restart of the gateway, from the journal
    async with gateway(shop(), db) as (_, client):
        retried = decode(await propose(client, "x-1", CHARGE, run.seq), VerdictOut)
        assert (retried.key, retried.replayed, retried.accepted) == (key, True, True)
        recorded = decode(
            await client.post("/v1/runs/x-1/results", json={"key": key, "result": {"n": 3}}),
            VerdictOut,
        )
        assert recorded.result == {"n": 1}
        unknown = await client.post("/v1/runs/x-1/results", json={"key": "x-1:PAY:99"})
        assert unknown.status_code == 409
    events = await journal(db, "x-1")
    assert kinds(events).count("intent_recorded") == 1
    assert kinds(events).count("tool_committed") == 1
    assert kinds(events).count("model_called") == 2


async def test_creating_a_run_again_with_its_id_returns_it(tmp_path: Path) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (_, client):
        first = await start(client, "x-1")
        again = await client.post(
            "/v1/runs", json={"machine": "shop", "run_id": "x-1", "mode": "external"}
        )
        assert again.status_code == 200
        assert decode(again, RunOut) == first
        other = await client.post("/v1/runs", json={"machine": "shop", "run_id": "x-1"})
        assert other.status_code == 409
        assert "already exists" in other.json()["detail"]


async def test_msgpack_is_negotiated_both_ways(tmp_path: Path) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (_, client):
        pack = {"content-type": "application/msgpack", "accept": "application/msgpack"}
        body = msgspec.msgpack.encode({"machine": "shop", "run_id": "m-1", "mode": "external"})
        created = await client.post("/v1/runs", content=body, headers=pack)
        assert created.headers["content-type"] == "application/msgpack"
        run = msgspec.msgpack.decode(created.content, type=RunOut)
        proposal = msgspec.msgpack.encode({"proposal": CHARGE, "expected_seq": run.seq})
        answer = await client.post("/v1/runs/m-1/proposals", content=proposal, headers=pack)
        verdict = msgspec.msgpack.decode(answer.content, type=VerdictOut)
        assert verdict.accepted
        assert verdict.key
        # JSON in, msgpack out, by Accept alone
        got = await client.get("/v1/runs/m-1", headers={"accept": "application/msgpack"})
        assert msgspec.msgpack.decode(got.content, type=RunOut).pending is not None
        # a msgpack body that breaks the schema is a 422 problem (in JSON)
        wrong = msgspec.msgpack.encode({"proposal": 5})
        refused = await client.post("/v1/runs/m-1/proposals", content=wrong, headers=pack)
        assert refused.status_code == 422
        assert "Expected `str`, got `int`" in refused.json()["detail"]


# httpx leaves its inner async generators suspended when a reader stops before the stream
# ends (as every SSE reader that has seen enough does); trio warns when they are collected.
@pytest.mark.filterwarnings(r"ignore:Async generator '(httpx|httpcore)\.:ResourceWarning")
async def test_the_stream_resumes_after_last_event_id(tmp_path: Path) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (server, client):
        run = await start(client, "s-1")
        bad = decode(await propose(client, "s-1", BAD, run.seq), VerdictOut)

        async def read(headers: dict[str, str], count: int) -> list[tuple[int, str]]:
            got: list[tuple[int, str]] = []
            async with client.stream("GET", "/v1/runs/s-1/stream", headers=headers) as stream:
                seq = 0
                async for line in stream.aiter_lines():
                    if line.startswith("id: "):
                        seq = int(line.removeprefix("id: "))
                    elif line.startswith("data: "):
                        data = json.loads(line.removeprefix("data: "))
                        assert data["seq"] == seq
                        got.append((seq, data["kind"]))
                        if len(got) == count:
                            break
            return got

        first = await read({}, 2)
        assert first == [(1, "run_started"), (2, "model_called")]
        rest = await read({"last-event-id": "2"}, bad.seq - 2)
        assert [seq for seq, _ in rest] == list(range(3, bad.seq + 1))
        # a resumed stream also carries what is journaled after it connected
        async with trio.open_nursery() as nursery:
            later: list[list[tuple[int, str]]] = []

            async def follow() -> None:
                later.append(await read({"last-event-id": str(bad.seq)}, 2))

            nursery.start_soon(follow)
            await propose(client, "s-1", CHARGE, bad.seq)
        assert later == [[(bad.seq + 1, "model_called"), (bad.seq + 2, "intent_recorded")]]
        broken = await client.get("/v1/runs/s-1/stream", headers={"last-event-id": "x"})
        assert broken.status_code == 400
        # an idle stream gets keep-alive comments (proxies close silent connections)
        server.app.heartbeat = 0.01
        headers = {"last-event-id": str(bad.seq + 2)}
        async with client.stream("GET", "/v1/runs/s-1/stream", headers=headers) as stream:
            async for line in stream.aiter_lines():
                if line == ": keep-alive":
                    break


async def test_a_batch_is_verified_and_journaled_in_one_group_commit(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    async with gateway(shop(), db) as (server, client):
        runs = [await start(client, f"b-{i}") for i in range(20)]
        stats = server.supervisor.stats
        batches = stats.flush_events["batches"]
        items = [{"run_id": r.id, "proposal": CHARGE, "expected_seq": r.seq} for r in runs]
        items[3]["proposal"] = BAD
        items.append({"run_id": "nobody", "proposal": CHARGE})
        answer = await client.post("/v1/verify", json={"items": items})
        assert answer.status_code == 200, answer.text
        verdicts = decode(answer, VerifyOut).verdicts
        assert stats.flush_events["batches"] == batches + 1
        assert len(verdicts) == 21
        assert [v.run_id for v in verdicts] == [i["run_id"] for i in items]
        assert [v.accepted for v in verdicts[:20]] == [i != 3 for i in range(20)]
        assert verdicts[3].violations[0].code == "schema"
        assert verdicts[20].problem is not None
        assert verdicts[20].problem.status == 404
        assert all(v.key == f"b-{i}:PAY:{v.seq}" for i, v in enumerate(verdicts[:20]) if i != 3)
        # retrying the batch answers from the record
        again = decode(await client.post("/v1/verify", json={"items": items[:20]}), VerifyOut)
        assert [v.key for v in again.verdicts] == [v.key for v in verdicts[:20]]
        assert all(v.replayed for v in again.verdicts)
        empty = await client.post("/v1/verify", json={"items": []})
        assert empty.status_code == 422
    assert kinds(await journal(db, "b-0")).count("intent_recorded") == 1


async def test_a_batch_decides_a_runs_second_proposal_after_its_first(tmp_path: Path) -> None:
    """Two proposals of one run in a batch: the second is checked against the run as the
    first left it (its expected_seq is the first verdict's seq), as if sent after it."""
    async with gateway(shop(), tmp_path / "j.db") as (_, client):
        x = await start(client, "x")
        y = await start(client, "y")
        items = [
            {"run_id": "x", "proposal": BAD, "expected_seq": x.seq},  # rejected: seq + 2
            {"run_id": "y", "proposal": CHARGE, "expected_seq": y.seq},
            {"run_id": "x", "proposal": CHARGE, "expected_seq": x.seq + 2},
            {"run_id": "x", "proposal": CHARGE, "expected_seq": x.seq},  # stale by now
        ]
        answer = await client.post("/v1/verify", json={"items": items})
        assert answer.status_code == 200, answer.text
        bad, other, call, stale = decode(answer, VerifyOut).verdicts
        assert (bad.accepted, bad.seq) == (False, x.seq + 2)
        assert other.key is not None
        assert (call.accepted, call.key) == (True, f"x:PAY:{x.seq + 4}")
        # the first answer at that seq was the rejection, and a different proposal
        # retried at a seq already answered is refused, not decided again
        assert stale.problem is not None
        assert stale.problem.status == 409, stale


async def test_a_bug_deciding_one_proposal_of_a_batch_ends_that_run_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run whose request met a bug gets a 500 problem in its place, naming the bug;
    the batch's other proposals are decided, journaled and answered."""
    from interlock.core import _decider

    original = _decider.propose  # the decide path in use: compiled, or its twin

    def broken(run: Any, msg: Any, *rest: Any) -> Any:
        if msg.run_id == "bug":
            raise ZeroDivisionError("a bug in the decide path")
        return original(run, msg, *rest)

    db = tmp_path / "j.db"
    async with gateway(shop(), db) as (_, client):
        runs = [await start(client, run_id) for run_id in ("ok-1", "bug", "ok-2")]
        monkeypatch.setattr(_decider, "propose", broken)
        items = [{"run_id": r.id, "proposal": CHARGE, "expected_seq": r.seq} for r in runs]
        answer = await client.post("/v1/verify", json={"items": items})
        assert answer.status_code == 200, answer.text
        first, bug, last = decode(answer, VerifyOut).verdicts
        assert first.key is not None
        assert last.key is not None
        assert bug.problem is not None
        assert bug.problem.status == 500
        assert "ZeroDivisionError" in bug.problem.detail
        assert "interlock resume" in bug.problem.detail
    assert kinds(await journal(db, "ok-2")).count("intent_recorded") == 1
    assert kinds(await journal(db, "bug")).count("intent_recorded") == 0


async def test_a_batch_that_fails_whole_leaves_no_answer_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug that fails a whole batch (here the supervisor's, on its second group) leaves
    none of its answers pending, neither those decided before it nor its own group's: a
    retry of each proposal gets the journal's answer or is decided afresh, instead of
    waiting forever."""
    from interlock.core._messages import Sync
    from interlock.gateway import GatewayService
    from interlock.protocol import ProposalIn, RunCreate

    store = await open_sqlite_store(str(tmp_path / "j.db"))
    async with open_supervisor([shop()], store) as supervisor:
        service = GatewayService(supervisor)
        run, _ = await service.create_run(RunCreate(machine="shop", run_id="w-1", mode="external"))
        other, _ = await service.create_run(
            RunCreate(machine="shop", run_id="w-2", mode="external")
        )
        submit = supervisor.submit_many_nowait
        groups = []

        def failing(msgs: Any) -> Any:
            groups.append(len(msgs))
            if len(groups) == 2:
                raise ZeroDivisionError("a bug in the supervisor")
            return submit(msgs)

        monkeypatch.setattr(supervisor, "submit_many_nowait", failing)
        first = ProposalIn(proposal=BAD, expected_seq=run.seq)  # rejected: its seq goes on
        second = ProposalIn(proposal=CHARGE, expected_seq=run.seq + 2)  # the second group
        third = ProposalIn(proposal=CHARGE, expected_seq=other.seq)
        with pytest.raises(ZeroDivisionError):
            await service.verify_many(["w-1", "w-2", "w-1"], [first, third, second])
        assert groups == [2, 1]
        pending = [a for a in service._answers.values() if not a.settled]
        assert pending == []
        monkeypatch.setattr(supervisor, "submit_many_nowait", submit)
        await supervisor.request(Sync(run_id="w-2"))  # the first group's events are durable
        with trio.fail_after(30):  # the retries are not waiting on the failed batch
            again = await service.verify_many(["w-2", "w-1"], [third, second])
        assert [v.accepted for v in again] == [True, True], again
    await store.aclose()


async def test_a_batch_answers_repeats_steps_and_ends_of_runs(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    async with gateway([shop(), checkout()], db) as (server, client):
        a = await start(client, "a")
        c = await start(client, "c", "checkout")
        items = [
            {"run_id": "a", "proposal": DONE, "expected_seq": a.seq},
            {"run_id": "a", "proposal": DONE, "expected_seq": a.seq},  # a repeat, in the batch
            {"run_id": "c", "proposal": CHARGE, "expected_seq": c.seq},
        ]
        verdicts = decode(await client.post("/v1/verify", json={"items": items}), VerifyOut)
        first, repeat, call = verdicts.verdicts
        assert (first.outcome, first.replayed) == ("completed", False)
        assert (repeat.outcome, repeat.seq, repeat.replayed) == ("completed", first.seq, True)
        assert call.key is not None
        assert len(server.supervisor) == 1  # the completed run was released; c waits
        done = decode(
            await client.post(
                "/v1/runs/c/results", json={"key": call.key, "result": {"charged": 7}}
            ),
            VerdictOut,
        )
        items = [{"run_id": "c", "proposal": '{"next": "RECEIPT"}', "expected_seq": done.seq}]
        (end,) = decode(await client.post("/v1/verify", json={"items": items}), VerifyOut).verdicts
        assert (end.outcome, end.state) == ("completed", "COMPLETED")  # the step ran
    assert kinds(await journal(db, "a")).count("completed") == 1


async def test_a_damaged_journal_leaves_the_rest_of_the_escalation_queue_listed(
    tmp_path: Path,
) -> None:
    db = tmp_path / "j.db"
    async with gateway(shop(), db) as (_, client):
        for run_id in ("e-1", "e-2"):
            seq = (await start(client, run_id)).seq
            for _ in range(3):  # three rejections in a row trip the breaker
                seq = decode(await propose(client, run_id, BAD, seq), VerdictOut).seq
    # one byte of e-2's last chunk flipped: its frames no longer match their checksums
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        chunk, body = conn.execute(
            "SELECT id, body FROM chunks WHERE run_id = 'e-2' ORDER BY id DESC LIMIT 1"
        ).fetchone()
        damaged = bytearray(body)
        damaged[20] ^= 0xFF
        conn.execute("UPDATE chunks SET body = ? WHERE id = ?", (bytes(damaged), chunk))
    async with gateway(shop(), db) as (_, client):
        listed = await client.get("/v1/escalations")
        assert listed.status_code == 200, listed.text
        queue = {e["id"]: (e["from_state"], e["targets"]) for e in listed.json()["escalations"]}
        assert queue == {"e-1": ("PAY", ["PAY"]), "e-2": ("", [])}
        one = await client.get("/v1/escalations/e-2")  # the run's own answer names the damage
        assert one.status_code >= 400, one.text
        assert "corrupt" in one.json()["detail"], one.text


async def test_escalations_are_listed_resumed_and_aborted(tmp_path: Path) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (_, client):
        for run_id in ("e-1", "e-2"):
            seq = (await start(client, run_id)).seq
            for _ in range(3):  # three rejections in a row trip the breaker
                verdict = decode(await propose(client, run_id, BAD, seq), VerdictOut)
                seq = verdict.seq
            assert verdict.outcome == "escalated"
        queue = (await client.get("/v1/escalations")).json()["escalations"]
        assert [(e["id"], e["reason"]) for e in queue] == [
            ("e-1", "consecutive_failures"),
            ("e-2", "consecutive_failures"),
        ]
        one = (await client.get("/v1/escalations/e-1")).json()
        # COMPLETED is a legal next state, but a run ends through the gate (#32)
        assert (one["from_state"], one["targets"]) == ("PAY", ["PAY"])
        # the list says where each run may be resumed, as the run's own answer does
        assert [(e["from_state"], e["targets"]) for e in queue] == [("PAY", ["PAY"])] * 2
        assert queue[0] == one
        # a payload the gate rejects changes nothing
        rejected = await client.post(
            "/v1/escalations/e-1/resume", json={"by": "ops", "payload": BAD, "note": "try"}
        )
        assert rejected.status_code == 422
        assert rejected.json()["violations"][0]["code"] == "schema"
        both = await client.post(
            "/v1/escalations/e-1/resume", json={"by": "ops", "payload": CHARGE, "to": "PAY"}
        )
        assert both.status_code == 422
        resumed = await client.post(
            "/v1/escalations/e-1/resume", json={"by": "ops", "note": "fixed the schema"}
        )
        assert resumed.status_code == 200, resumed.text
        run = decode(resumed, RunOut)
        assert (run.state, run.outcome) == ("PAY", "running")
        retried = await client.post(
            "/v1/escalations/e-1/resume", json={"by": "ops", "note": "fixed the schema"}
        )
        assert decode(retried, RunOut) == run
        # the resumed external run goes on with its caller
        ok = decode(await propose(client, "e-1", CHARGE, run.seq), VerdictOut)
        assert ok.accepted
        assert ok.key
        aborted = await client.post("/v1/escalations/e-2/abort", json={"by": "ops", "note": "no"})
        assert decode(aborted, RunOut).outcome == "failed"
        assert decode(aborted, RunOut).reason == "aborted by ops: no"
        again = await client.post("/v1/escalations/e-2/abort", json={"by": "ops", "note": "no"})
        assert again.status_code == 200
        assert (await client.get("/v1/escalations")).json()["escalations"] == []
        gone = await client.get("/v1/escalations/e-2")
        assert gone.status_code == 404
        late = await client.post("/v1/escalations/e-2/resume", json={"by": "ops"})
        assert late.status_code == 409


# see test_the_stream_resumes_after_last_event_id
@pytest.mark.filterwarnings(r"ignore:Async generator '(httpx|httpcore)\.:ResourceWarning")
async def test_a_hosted_run_escalates_and_an_operator_resumes_it(tmp_path: Path) -> None:
    app = App(shop(), provider=ScriptedProvider([BAD, BAD, BAD, DONE]))
    db = tmp_path / "j.db"
    async with gateway(app, db) as (_, client):
        created = await client.post("/v1/runs", json={"machine": "shop", "run_id": "h-1"})
        assert created.status_code == 201
        async with client.stream("GET", "/v1/runs/h-1/stream") as stream:
            async for line in stream.aiter_lines():
                if line == "event: escalated":
                    break
        queue = (await client.get("/v1/escalations")).json()["escalations"]
        assert [e["id"] for e in queue] == ["h-1"]
        resumed = await client.post("/v1/escalations/h-1/resume", json={"by": "ops"})
        assert resumed.status_code == 200
        assert decode(resumed, RunOut).mode == "hosted"
        # the runtime drives it on: the scripted model now finishes it
        async with client.stream("GET", "/v1/runs/h-1/stream", params={"after": 1}) as stream:
            ends = [line async for line in stream.aiter_lines() if line.startswith("event: ")]
        assert ends[-1] == "event: completed"
        assert decode(await client.get("/v1/runs/h-1"), RunOut).output == {"receipt": "r-9"}
    assert kinds(await journal(db, "h-1")).count("resumed") == 1


async def test_a_key_scoped_to_other_machines_gets_a_403(tmp_path: Path) -> None:
    keys = KeyRing(
        [
            (hashlib.sha256(b"k-all").digest(), Principal("all", frozenset({"agent"}))),
            (
                hashlib.sha256(b"k-other").digest(),
                Principal("other", frozenset({"agent"}), frozenset({"other"})),
            ),
        ]
    )
    async with gateway([shop(), shop("other")], tmp_path / "j.db", keyring=keys) as (_, client):
        client.headers["authorization"] = "Bearer k-all"
        await start(client, "x-1")
        client.headers["authorization"] = "Bearer k-other"
        refused = await propose(client, "x-1", CHARGE, None)
        assert refused.status_code == 403
        assert "'other'" in refused.json()["detail"]
        assert "'shop'" in refused.json()["detail"]
        assert (await client.get("/v1/runs/x-1")).status_code == 403
        assert (await client.get("/v1/runs")).json()["runs"] == []
        assert (await start(client, "o-1", "other")).id == "o-1"
        del client.headers["authorization"]
        assert (await client.get("/v1/runs/x-1")).status_code == 401


def receipt(view: Any) -> Go:
    return Go("COMPLETED", {"receipt": f"r-{view.last_result('charge')['charged']}"})


def checkout() -> Machine:
    """A step state first (plain code), then the model's, then a step that finishes."""
    return Machine(
        "checkout",
        "START",
        {
            "START": Step(lambda view: Go("PAY"), next=["PAY"]),
            "PAY": Worker(next=["RECEIPT"], tools=["charge"]),
            "RECEIPT": Step(receipt, next=["COMPLETED"]),
        },
        tools=[Tool("charge", never, Charge)],
    )


async def test_the_gateway_runs_the_step_states_of_an_external_run(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    async with gateway(checkout(), db) as (_, client):
        run = await start(client, "c-1", "checkout")
        assert run.state == "PAY"  # START ran before the answer
        call = decode(await propose(client, "c-1", CHARGE, run.seq), VerdictOut)
        assert call.key is not None
        done = decode(
            await client.post(
                "/v1/runs/c-1/results", json={"key": call.key, "result": {"charged": 5}}
            ),
            VerdictOut,
        )
        end = decode(await propose(client, "c-1", '{"next": "RECEIPT"}', done.seq), VerdictOut)
        assert (end.outcome, end.state) == ("completed", "COMPLETED")
        assert decode(await client.get("/v1/runs/c-1"), RunOut).output == {"receipt": "r-5"}
    async with gateway(checkout(), db) as (_, client):
        again = decode(await propose(client, "c-1", '{"next": "RECEIPT"}', done.seq), VerdictOut)
        assert (again.replayed, again.state, again.seq) == (True, "COMPLETED", end.seq)
    events = await journal(db, "c-1")
    assert kinds(events).count("step_proposed") == 2
    assert replay(events, checkout()).diverged == ()


async def reconcile_never(key: str, args: Any, ctx: Any) -> Any:
    raise AssertionError("an external run's caller asks its downstream itself")


async def test_a_call_in_doubt_is_reconciled_by_its_caller(tmp_path: Path) -> None:
    machine = Machine(
        "pay",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", never, Charge, reconcile=reconcile_never)],
    )
    db = tmp_path / "j.db"
    async with gateway(machine, db) as (_, client):
        run = await start(client, "r-1", "pay")
        call = decode(await propose(client, "r-1", CHARGE, run.seq), VerdictOut)
        assert call.key is not None
        # the attempt failed in a way that may have reached the downstream
        doubt = decode(
            await client.post("/v1/runs/r-1/results", json={"key": call.key, "error": "reset"}),
            VerdictOut,
        )
        assert doubt.accepted is False
        assert doubt.reconcile is not None
        assert (doubt.reconcile.key, doubt.reconcile.args) == (call.key, {"cents": 500})
        # the caller asked its downstream: it was applied
        settled = decode(
            await client.post(
                "/v1/runs/r-1/results",
                json={"key": call.key, "applied": True, "result": {"charged": 500}},
            ),
            VerdictOut,
        )
        assert settled.accepted
        assert decode(await client.get("/v1/runs/r-1"), RunOut).pending is None
    events = await journal(db, "r-1")
    assert kinds(events)[-3:] == ["tool_in_doubt", "reconciled", "tool_committed"]
    assert events[-1].result == {"charged": 500}
    assert events[-1].reconciled is True


async def test_a_key_at_its_runs_in_flight_limit_gets_a_429(tmp_path: Path) -> None:
    limits = Limits(runs_in_flight=1)
    async with gateway(shop(), tmp_path / "j.db", limits=limits) as (_, client):
        run = await start(client, "q-1")
        refused = await client.post("/v1/runs", json={"machine": "shop", "mode": "external"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert "runs in flight" in refused.json()["detail"]
        verdict = decode(await propose(client, "q-1", DONE, run.seq), VerdictOut)
        assert verdict.outcome == "completed"  # its slot is free again
        assert (await start(client, "q-2")).id == "q-2"


async def test_the_streaming_channel_is_served_beside_http(tmp_path: Path) -> None:
    from interlock.client._channel import open_channel

    db = tmp_path / "j.db"
    async with gateway(shop(), db, channel_port=0) as (server, client):
        assert server.channel.startswith("tcp://127.0.0.1:")
        async with open_channel(server.channel) as channel:
            run = await channel.create_run("shop", run_id="c-1")
            verdict = await channel.propose("c-1", CHARGE, run.seq)
            assert verdict.key is not None
        # the same service: HTTP sees what the channel did, and answers its retry
        again = decode(await propose(client, "c-1", CHARGE, run.seq), VerdictOut)
        assert (again.key, again.replayed) == (verdict.key, True)
    assert kinds(await journal(db, "c-1")).count("intent_recorded") == 1


async def test_the_limits_come_from_the_environment_and_the_channel_has_no_request_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``interlock serve`` takes its limits from INTERLOCK_GATEWAY_*; the per-key request
    rate is HTTP's, and the channel (bounded by its requests in flight) is not held to it."""
    from interlock.client._channel import open_channel

    monkeypatch.setenv("INTERLOCK_GATEWAY_RATE", "1")
    monkeypatch.setenv("INTERLOCK_GATEWAY_BURST", "1")
    monkeypatch.setenv("INTERLOCK_GATEWAY_MAX_BODY", "4096")
    async with gateway(shop(), tmp_path / "j.db", channel_port=0) as (server, client):
        huge = await client.post(
            "/v1/verify",
            content=b"{" + b" " * 5000 + b"}",
            headers={"content-type": "application/json"},
        )
        assert huge.status_code == 413, huge.text
        statuses = [(await client.get("/v1/runs")).status_code for _ in range(3)]
        assert 429 in statuses, statuses
        async with open_channel(server.channel) as channel:
            for index in range(5):
                run = await channel.create_run("shop", run_id=f"r-{index}")
                verdict = await channel.propose(run.id, CHARGE, run.seq)
                assert verdict.key is not None


async def test_a_proposal_cancelled_while_it_waits_is_answered_to_its_retry(
    tmp_path: Path,
) -> None:
    """A request cut while it waits on the journal (a timeout, a client gone) leaves no
    answer pending: its retry gets the decision the journal holds."""
    from interlock.core._messages import Sync
    from interlock.gateway import GatewayService
    from interlock.protocol import ProposalIn, RunCreate

    store = await open_sqlite_store(str(tmp_path / "j.db"))
    async with open_supervisor([shop()], store) as supervisor:
        service = GatewayService(supervisor)
        run, _ = await service.create_run(RunCreate(machine="shop", run_id="k-1", mode="external"))
        append = store.append
        release, held = trio.Event(), trio.Event()

        async def slow_append(events: Any) -> None:
            held.set()
            await release.wait()
            await append(events)

        store.append = slow_append
        body = ProposalIn(proposal=CHARGE, expected_seq=run.seq)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.propose, "k-1", body)
            await held.wait()
            nursery.cancel_scope.cancel()  # the request is cut while its batch is written
        release.set()
        await supervisor.request(Sync(run_id="k-1"))
        with trio.fail_after(30):  # a retry never waits on the cut request forever
            retried = await service.propose("k-1", body)
        assert (retried.replayed, retried.accepted) == (True, True)
        assert retried.key == f"k-1:PAY:{retried.seq}"
    events = await store.load("k-1")
    await store.aclose()
    assert kinds(events).count("intent_recorded") == 1


async def test_stopping_finishes_the_requests_in_flight_first(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    async with gateway(shop(), db) as (server, client):
        run = await start(client, "d-1")
        store = server.supervisor.store
        append = store.append
        release = trio.Event()
        held = trio.Event()

        async def slow_append(events: Any) -> None:
            held.set()
            await release.wait()
            await append(events)

        store.append = slow_append
        async with trio.open_nursery() as nursery:
            answers: list[httpx.Response] = []

            async def send() -> None:
                answers.append(await propose(client, "d-1", CHARGE, run.seq))

            nursery.start_soon(send)
            await held.wait()
            server.stop()  # as SIGTERM does, with the proposal waiting on the journal
            release.set()
        assert [a.status_code for a in answers] == [200]
        key = decode(answers[0], VerdictOut).key
    assert kinds(await journal(db, "d-1"))[-1] == "intent_recorded"
    assert (await journal(db, "d-1"))[-1].key == key


async def test_back_pressure_answers_503_with_retry_after(tmp_path: Path) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (server, client):
        runs = [await start(client, f"p-{i}") for i in range(2)]
        service = server.app.service
        service.max_waiting = 1
        # Hold the journal's writes, as a slow disk would.
        store = server.supervisor.store
        append = store.append
        release = trio.Event()
        held = trio.Event()

        async def slow_append(events: Any) -> None:
            held.set()
            await release.wait()
            await append(events)

        store.append = slow_append
        async with trio.open_nursery() as nursery:
            answers: list[httpx.Response] = []

            async def send(run: RunOut) -> None:
                answers.append(await propose(client, run.id, CHARGE, run.seq))

            nursery.start_soon(send, runs[0])
            await held.wait()  # its batch is being written: it waits on the journal
            assert service.waiting == 1
            refused = await propose(client, runs[1].id, CHARGE, runs[1].seq)
            ready = await client.get("/readyz")
            release.set()
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "the journal is behind" in refused.json()["detail"]
        assert ready.status_code == 503
        assert ready.json()["ready"] is False
        assert [a.status_code for a in answers] == [200]
        assert (await propose(client, runs[1].id, CHARGE, runs[1].seq)).status_code == 200


# -- bad input ------------------------------------------------------------------------------


async def test_bad_input_of_each_kind_is_a_4xx_problem_that_says_what_to_fix(
    tmp_path: Path,
) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (_, client):
        await start(client, "x-1")
        cases: list[tuple[str, str, dict[str, Any], int, str]] = [
            ("GET", "/v2/nothing", {}, 404, "no route"),
            ("DELETE", "/v1/runs/x-1", {}, 405, "use GET"),
            ("GET", "/v1/runs/nobody", {}, 404, "nobody"),
            ("POST", "/v1/runs/nobody/proposals", {"json": {"proposal": DONE}}, 404, "nobody"),
            ("POST", "/v1/runs", {"content": b"{nope"}, 400, "not valid JSON"),
            ("POST", "/v1/runs", {"content": b""}, 400, "needs a body"),
            ("POST", "/v1/runs", {"json": {"machine": 7}}, 422, "Expected `str`"),
            ("POST", "/v1/runs", {"json": {"machine": "shop", "mood": 1}}, 422, "`mood`"),
            ("POST", "/v1/runs", {"json": {"machine": "nope"}}, 422, "no machine named"),
            (
                "POST",
                "/v1/runs",
                {"content": b'{"machine": "shop", "mode": "external", "inputs": {"n": 1e999}}'},
                422,
                "inputs",
            ),
            (
                "POST",
                "/v1/runs",
                {
                    "content": b'{"machine": "shop", "mode": "external", "inputs": {"n": %d}}'
                    % 2**70
                },
                422,
                "inputs",
            ),
            ("POST", "/v1/runs", {"json": {"machine": "shop", "mode": "x"}}, 422, "mode"),
            ("POST", "/v1/runs", {"json": {"machine": "shop", "run_id": "a b"}}, 422, "run_id"),
            (
                "POST",
                "/v1/runs",
                {"content": b"<x/>", "headers": {"content-type": "text/xml"}},
                415,
                "application/json",
            ),
            ("GET", "/v1/runs", {"params": {"limit": "0"}}, 400, "limit"),
            ("GET", "/v1/runs", {"params": {"limit": "x"}}, 400, "integer"),
            ("GET", "/v1/runs", {"params": {"cursor": "zz"}}, 400, "cursor"),
            ("GET", "/v1/runs/x-1/events", {"params": {"after": "-1"}}, 400, "after"),
            (
                "POST",
                "/v1/runs/x-1/proposals",
                {"json": {"proposal": DONE, "expected_seq": -1}},
                422,
                "expected_seq",
            ),
            (
                "POST",
                "/v1/runs/x-1/results",
                {"json": {"key": "k", "result": 1, "error": "e"}},
                422,
                "not both",
            ),
            ("POST", "/v1/runs/x-1/results", {"json": {"key": "x-1:PAY:9"}}, 409, "waiting"),
            ("POST", "/v1/escalations/x-1/abort", {"json": {"by": "ops"}}, 409, "escalat"),
            ("POST", "/v1/escalations/x-1/resume", {"json": {}}, 422, "`by`"),
            ("GET", "/v1/escalations/x-1", {}, 404, "escalat"),
            ("POST", "/v1/runs", {"content": b"{}", "headers": {}}, 415, "Content-Type"),
        ]
        for method, path, options, status, says in cases:
            if "content" in options:
                options = {"headers": {"content-type": "application/json"}, **options}
            response = await client.request(method, path, **options)
            assert response.status_code == status, (method, path, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            problem = response.json()
            assert problem["status"] == status
            assert problem["type"].startswith("https://interlock.dev/problems/")
            assert says in problem["detail"], (path, problem["detail"])
        metrics = (await client.get("/metrics")).text
        assert 'interlock_gateway_requests_total{method="GET",route="unmatched",status="404"}' in (
            metrics
        )
        assert "interlock_verdicts_total" in metrics or "interlock_verification" in metrics
        assert "x-1" not in metrics  # no run id in any label


ROUTES = [
    ("POST", "/v1/runs"),
    ("POST", "/v1/runs/{id}/proposals"),
    ("POST", "/v1/runs/{id}/results"),
    ("POST", "/v1/verify"),
    ("POST", "/v1/escalations/{id}/resume"),
    ("POST", "/v1/escalations/{id}/abort"),
    ("GET", "/v1/runs"),
    ("GET", "/v1/runs/{id}"),
    ("GET", "/v1/runs/{id}/events"),
    ("GET", "/v1/escalations/{id}"),
]


async def test_random_bodies_never_get_a_5xx(tmp_path: Path) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
        max_leaves=12,
    )
    fields = st.sampled_from(
        [
            "machine",
            "inputs",
            "run_id",
            "mode",
            "proposal",
            "expected_seq",
            "usage",
            "key",
            "result",
            "error",
            "retryable",
            "applied",
            "items",
            "by",
            "note",
            "payload",
            "to",
        ]
    )
    bodies = st.one_of(
        st.binary(max_size=200).map(lambda b: ("raw", b)),
        st.dictionaries(fields, json_values, max_size=6).map(lambda d: ("json", d)),
        st.dictionaries(fields, json_values, max_size=6).map(lambda d: ("msgpack", d)),
    )
    queries = st.dictionaries(
        st.sampled_from(["limit", "after", "cursor", "state", "machine"]),
        st.text(max_size=8),
        max_size=3,
    )

    async with gateway(shop(), tmp_path / "j.db") as (server, client):
        await start(client, "x-1")
        seen: set[int] = set()

        ids = st.sampled_from(["x-1"]) | st.text(min_size=1, max_size=30)

        @settings(
            max_examples=150,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(route=st.sampled_from(ROUTES), run_id=ids, body=bodies, query=queries)
        def check(
            route: tuple[str, str], run_id: str, body: tuple[str, Any], query: dict[str, str]
        ) -> None:
            method, template = route
            quoted = urllib.parse.quote(run_id.encode("utf-8", "surrogatepass"), safe="")
            path = template.replace("{id}", quoted)
            kind, value = body
            if kind == "raw":
                content, headers = value, {"content-type": "application/json"}
            elif kind == "json":
                content = json.dumps(value).encode()
                headers = {"content-type": "application/json"}
            else:
                content = msgspec.msgpack.encode(value)
                headers = {"content-type": "application/msgpack"}
            with httpx.Client(base_url=server.url, timeout=30) as sync:
                response = sync.request(
                    method,
                    path,
                    content=content if method == "POST" else None,
                    headers=headers,
                    params=query,
                )
            seen.add(response.status_code)
            assert response.status_code < 500, (route, run_id, body, response.text)

        await trio.to_thread.run_sync(check)
        assert any(400 <= s < 500 for s in seen)


# -- the OpenAPI document and the command ---------------------------------------------------


async def test_the_openapi_document_is_generated_from_the_structs(tmp_path: Path) -> None:
    async with gateway(shop(), tmp_path / "j.db") as (_, client):
        served = (await client.get("/openapi.json")).json()
    assert served == json.loads(json.dumps(openapi_document()))
    assert served["openapi"].startswith("3.1")
    post = served["paths"]["/v1/runs/{id}/proposals"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ProposalIn"
    }
    schemas = served["components"]["schemas"]
    assert set(schemas["ProposalIn"]["properties"]) == {
        "proposal",
        "usage",
        "expected_seq",
        "model",
    }
    assert schemas["ProposalIn"]["additionalProperties"] is False
    assert "data_schema" in schemas["RunOut"]["properties"]
    assert "/v1/runs/{id}/stream" in served["paths"]


def test_interlock_serve_drains_on_sigterm_and_exits_0(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    app_file = tmp_path / "shop_app.py"
    app_file.write_text(
        "import msgspec\n"
        "from interlock import Machine, Tool, Worker\n"
        "class Charge(msgspec.Struct):\n    cents: int\n"
        "async def never(args, ctx):\n    raise AssertionError\n"
        "machine = Machine('shop', 'PAY', {'PAY': Worker(next=['COMPLETED'], tools=['charge'])},"
        " tools=[Tool('charge', never, Charge)])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLOCK_")}
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "interlock",
            "serve",
            "--app",
            f"{app_file}:machine",
            "--db",
            str(db),
            "--port",
            "0",
            "--channel-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith("interlock serve: http://127.0.0.1:"), line
            assert "loopback only" in line
            url = line.split()[2].rstrip(",")
            assert ", channel tcp://127.0.0.1:" in line
            with httpx.Client(base_url=url, timeout=30) as client:
                created = client.post(
                    "/v1/runs", json={"machine": "shop", "run_id": "x-1", "mode": "external"}
                )
                assert created.status_code == 201
                verdict = client.post(
                    "/v1/runs/x-1/proposals", json={"proposal": CHARGE, "expected_seq": 1}
                ).json()
                assert verdict["accepted"]
                # a stream is open when SIGTERM comes: the drain ends it, it does not hang
                with client.stream("GET", "/v1/runs/x-1/stream") as stream:
                    lines = stream.iter_lines()
                    for line in lines:
                        if line == "event: intent_recorded":
                            break
                    process.send_signal(signal.SIGTERM)
                    rest = list(lines)  # ends: the drain closes the stream
                assert rest[0].startswith("data: ")
            out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, err
    assert "drained and stopped" in out
    events = trio.run(journal, db, "x-1")
    assert kinds(events) == ["run_started", "model_called", "intent_recorded"]


def test_interlock_serve_refuses_a_public_address_without_a_key(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLOCK_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "interlock",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--db",
            str(tmp_path / "j.db"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert "refusing to serve on '0.0.0.0' without an API key" in done.stderr


def test_interlock_serve_says_when_its_port_is_taken(tmp_path: Path) -> None:
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLOCK_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "interlock",
                "serve",
                "--port",
                str(port),
                "--db",
                str(tmp_path / "j.db"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=tmp_path,
        )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in done.stderr


@settings(max_examples=200, deadline=None)
@given(
    accepted=st.booleans(),
    violations=st.lists(
        st.builds(
            Violation,
            st.sampled_from(["schema", "guard"]),
            st.text(max_size=5),
            st.text(max_size=5),
            st.text(max_size=5),
        ),
        max_size=2,
    ),
    execute=st.none() | st.builds(ToolCall, st.just("charge"), st.just({"cents": 1}), st.just("k")),
    reconcile=st.none() | st.builds(ToolCall, st.just("charge"), st.just({}), st.just("k2")),
    result=st.none() | st.just({"charged": 7}),
    retry_in=st.sampled_from([0.0, 1.5]),
    replayed=st.booleans(),
)
def test_every_verdict_is_answered_with_all_its_fields(
    accepted: bool,
    violations: list[Any],
    execute: Any,
    reconcile: Any,
    result: Any,
    retry_in: float,
    replayed: bool,
) -> None:
    """verdict_out's short path (a plain move) answers what the whole mapping would."""
    from interlock.gateway._service import verdict_out

    verdict = Verdict(
        run_id="r",
        seq=4,
        accepted=accepted,
        state="PAY",
        outcome="running",
        violations=tuple(violations),
        execute=execute,
        reconcile=reconcile,
        result=result,
        retry_in=retry_in,
    )
    whole = VerdictOut(
        run_id="r",
        accepted=accepted,
        outcome="running",
        state="PAY",
        seq=4,
        violations=[
            ViolationOut(code=v.code, path=v.path, message=v.message, hint=v.hint)
            for v in violations
        ],
        key=execute.key if execute else None,
        tool=execute.tool if execute else None,
        args=execute.args if execute else None,
        reconcile=(
            CallOut(key=reconcile.key, tool=reconcile.tool, args=reconcile.args)
            if reconcile
            else None
        ),
        result=result,
        retry_in=retry_in,
        replayed=replayed,
    )
    assert verdict_out(verdict, replayed=replayed) == whole
