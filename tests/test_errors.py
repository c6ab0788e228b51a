"""The exception tree: one class per decision a caller makes (#34).

Each situation is raised through the public API (or the gateway over loopback HTTP) and
caught as its leaf; the gateway answers each with its status and problem type, and the
client raises the same leaf again.
"""

from __future__ import annotations

import ast
import contextlib
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

import interlock
import interlock.errors
from interlock import (
    App,
    ConfigurationError,
    InvalidRunId,
    JournalInconsistent,
    LifespanError,
    Machine,
    MalformedMessage,
    MissingExtra,
    NotExternal,
    OutOfTurn,
    ProtocolError,
    RunEnded,
    RunExists,
    RunNotFound,
    StaleSeq,
    StoreDamaged,
    Tool,
    Worker,
    enqueue_run,
    enqueue_runs,
    open_supervisor,
    replay,
    run_worker,
)
from interlock.messages import Propose, Report, decode_message
from interlock.protocol import PROBLEM_ERRORS
from interlock.providers import OpenAIChat, ScriptedProvider
from interlock.stores import MemoryStore

SRC = Path(__file__).resolve().parents[1] / "src"
PROBLEMS = "https://interlock.dev/problems/"

LEAVES = [
    StaleSeq,
    RunEnded,
    RunExists,
    OutOfTurn,
    NotExternal,
    interlock.RunLeased,
    InvalidRunId,
    MalformedMessage,
    JournalInconsistent,
]


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
BAD = '{"tool": "charge", "args": {"cents": "five"}}'


# -- the tree ------------------------------------------------------------------------------


def test_no_bare_interlock_error_is_raised_in_src() -> None:
    """Every refusal raises the class that names its decision, never the root."""
    bare = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Raise)
                and isinstance(node.exc, ast.Call)
                and isinstance(node.exc.func, ast.Name | ast.Attribute)
                and (getattr(node.exc.func, "id", None) or node.exc.func.attr) == "InterlockError"
            ):
                bare.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert bare == []


@pytest.mark.parametrize("cls", LEAVES, ids=lambda c: c.__name__)
def test_each_leaf_is_a_protocol_error_documented_and_exported(cls: type[Exception]) -> None:
    assert issubclass(cls, ProtocolError)
    assert cls.__doc__ is not None
    assert len(cls.__doc__.split()) > 15  # when it is raised, and what to do
    assert getattr(interlock, cls.__name__) is cls
    assert getattr(interlock.errors, cls.__name__) is cls


def test_damage_is_store_damage_whatever_found_it() -> None:
    assert issubclass(JournalInconsistent, StoreDamaged)
    assert issubclass(interlock.errors.JournalCorrupt, StoreDamaged)
    assert not issubclass(StoreDamaged, ProtocolError)


def test_requests_that_can_never_be_valid_are_value_errors() -> None:
    assert issubclass(InvalidRunId, ValueError)
    assert issubclass(MalformedMessage, ValueError)
    assert issubclass(ConfigurationError, ValueError)
    for cls in (StaleSeq, RunEnded, RunExists, OutOfTurn, NotExternal):
        assert not issubclass(cls, ValueError)


# -- in process ---------------------------------------------------------------------------


async def test_each_situation_of_an_external_run_raises_its_leaf() -> None:
    async with open_supervisor([shop()]) as sup:
        await sup.start_run("shop", run_id="x-1", external=True)
        with pytest.raises(RunExists, match=r"^run 'x-1' already exists; run ids must be unique$"):
            await sup.start_run("shop", run_id="x-1", external=True)
        call = await sup.submit(Propose(run_id="x-1", seq=1, raw=CHARGE))
        assert call.execute is not None
        with pytest.raises(StaleSeq, match=r"^run 'x-1' is at seq 3, the request was made at seq 1; re-read the run and propose again$"):  # fmt: skip
            await sup.submit(Propose(run_id="x-1", seq=1, raw=DONE))
        with pytest.raises(OutOfTurn, match=r"^run 'x-1' is waiting for the outcome of 'x-1:PAY:3'; report it first$"):  # fmt: skip
            await sup.submit(Propose(run_id="x-1", seq=call.seq, raw=DONE))
        with pytest.raises(OutOfTurn, match=r"^run 'x-1' reported key 'other' but is waiting for 'x-1:PAY:3'$"):  # fmt: skip
            await sup.submit(Report(run_id="x-1", seq=call.seq, key="other", ok=True))
        done = await sup.submit(
            Report(run_id="x-1", seq=call.seq, key=call.execute.key, ok=True, result=1)
        )
        end = await sup.submit(Propose(run_id="x-1", seq=done.seq, raw=DONE))
        assert end.outcome == "completed"
        with pytest.raises(RunEnded, match=r"^run 'x-1' is completed in state 'COMPLETED'; it takes no more proposals$"):  # fmt: skip
            await sup.submit(Propose(run_id="x-1", seq=end.seq, raw=DONE))


async def test_a_request_to_a_run_the_runtime_drives_is_not_external() -> None:
    async with open_supervisor([shop()], provider=ScriptedProvider([DONE])) as sup:
        handle = await sup.start_run("shop", run_id="a-1")
        with pytest.raises(NotExternal, match=r"^run 'a-1' is driven by its actor; submit is for runs started with start_run\(..., external=True\)$"):  # fmt: skip
            await sup.submit(Propose(run_id="a-1", raw=DONE))
        await handle.wait()


async def test_enqueued_run_ids_are_invalid_or_taken() -> None:
    store = MemoryStore()
    await enqueue_run(store, shop(), run_id="q-1")
    with pytest.raises(RunExists, match=r"^run 'q-1' already exists in this journal"):
        await enqueue_run(store, shop(), run_id="q-1")
    with pytest.raises(InvalidRunId, match=r"^run_id must be a non-empty string, not ''$"):
        await enqueue_run(store, shop(), run_id="")
    with pytest.raises(InvalidRunId, match=r"^run id 'q-2' is given twice; run ids must be unique$"):  # fmt: skip
        await enqueue_runs(store, shop(), [None, None], run_ids=["q-2", "q-2"])
    with pytest.raises(InvalidRunId, match=r"^run_ids holds 1 ids for 2 inputs; "):
        await enqueue_runs(store, shop(), [None, None], run_ids=["q-3"])
    with pytest.raises(RunExists, match=r"^run 'q-1' already exists in this journal; .* nothing was written$"):  # fmt: skip
        await enqueue_runs(store, shop(), [None, None], run_ids=["q-4", "q-1"])


def test_undecodable_bytes_are_a_malformed_message() -> None:
    with pytest.raises(MalformedMessage, match=r"^undecodable message: "):
        decode_message(b"\xc1 not msgpack")


async def test_a_journal_whose_events_do_not_fit_is_damaged() -> None:
    store = MemoryStore()
    async with open_supervisor([shop()], store) as sup:
        await sup.start_run("shop", run_id="x-1", external=True)
        await sup.submit(Propose(run_id="x-1", seq=1, raw=BAD))
    events = list(await store.load("x-1"))
    with pytest.raises(StoreDamaged, match=r"^a recorded run must start with its run_started event$") as info:  # fmt: skip
        replay(events[1:], shop())
    assert isinstance(info.value, JournalInconsistent)
    assert isinstance(info.value, ProtocolError)  # what it was before #34


def test_a_provider_with_a_bad_base_url_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"^OpenAIChat: base_url 'localhost:8000/v1' does not start with http:// or https://; pass the whole URL"):  # fmt: skip
        OpenAIChat("m", base_url="localhost:8000/v1", api_key="k")


def test_an_app_without_machines_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"^App needs at least one Machine; pass App\(\[machine, ...\]\)$"):  # fmt: skip
        App([])


async def test_bad_worker_arguments_are_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"^max_runs must be an integer of at least 1, not 0$"):  # fmt: skip
        await run_worker(App([shop()]), str(tmp_path / "j.db"), max_runs=0)


async def test_a_lifespan_that_raises_is_a_lifespan_error(tmp_path: Path) -> None:
    def lifespan(db: str) -> Any:
        raise KeyError("no backend")

    app = App([shop()], lifespan=lifespan)
    with pytest.raises(LifespanError, match=r"^the app demo: its lifespan raised ") as info:
        async with app.open(str(tmp_path / "j.db"), named="demo"):
            pass  # pragma: no cover - never entered
    assert isinstance(info.value.__cause__, KeyError)


async def test_a_gateway_without_hypercorn_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from interlock.gateway import serve_gateway

    monkeypatch.setitem(sys.modules, "hypercorn.config", None)
    with pytest.raises(MissingExtra, match=r"pip install 'interlock\[gateway\]'$") as info:
        await serve_gateway(shop(), db=str(tmp_path / "j.db"), port=0)
    assert isinstance(info.value, ImportError)


# -- over HTTP -----------------------------------------------------------------------------


@asynccontextmanager
async def gateway(db: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    from interlock.client import AsyncClient
    from interlock.gateway import serve_gateway
    from interlock.gateway._keys import KeyRing

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_gateway, shop(), db=str(db), port=0, keyring=KeyRing())
            )
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=30) as http,
                AsyncClient(server.url) as client,
            ):
                yield http, client
            server.stop()


def problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["type"] == PROBLEMS + slug, body
    return body


async def test_the_gateway_answers_each_situation_with_its_problem_type(tmp_path: Path) -> None:
    async with gateway(tmp_path / "j.db") as (http, client):
        run = await client.create_run("shop", run_id="x-1")
        body = problem(await http.get("/v1/runs/nope"), 404, "run-not-found")
        assert body["title"] == "Not Found"
        taken = await http.post("/v1/runs", json={"machine": "shop", "run_id": "x-1"})
        problem(taken, 409, "run-exists")
        call = await client.propose("x-1", CHARGE, expected_seq=run.seq)
        stale = await http.post(
            "/v1/runs/x-1/proposals", json={"proposal": DONE, "expected_seq": run.seq}
        )
        assert problem(stale, 409, "stale-seq")["title"] == "Conflict"
        waiting = await http.post(
            "/v1/runs/x-1/proposals", json={"proposal": DONE, "expected_seq": call.seq}
        )
        problem(waiting, 409, "out-of-turn")
        unknown = await http.post("/v1/runs/x-1/results", json={"key": "x-1:PAY:99"})
        problem(unknown, 409, "out-of-turn")
        assert call.key is not None
        done = await client.report("x-1", call.key, {"charged": 500})
        end = await client.propose("x-1", DONE, expected_seq=done.seq)
        assert end.outcome == "completed"
        late = await http.post("/v1/runs/x-1/proposals", json={"proposal": DONE})
        problem(late, 409, "run-ended")


async def test_the_client_raises_the_leaf_the_problem_names(tmp_path: Path) -> None:
    from interlock.client import GatewayProblem

    async with gateway(tmp_path / "j.db") as (_, client):
        with pytest.raises(RunNotFound) as missing:
            await client.get_run("nope")
        assert isinstance(missing.value, GatewayProblem)
        assert (missing.value.status, missing.value.run_id) == (404, "nope")
        run = await client.create_run("shop", run_id="x-1")
        with pytest.raises(RunExists) as taken:
            await client.create_run("shop", run_id="x-1", mode="hosted")
        assert taken.value.status == 409
        call = await client.propose("x-1", CHARGE, expected_seq=run.seq)
        with pytest.raises(StaleSeq, match=r"409 Conflict: run 'x-1' is at seq 3, the request was made at seq 1"):  # fmt: skip
            await client.propose("x-1", DONE, expected_seq=run.seq)
        with pytest.raises(OutOfTurn):
            await client.propose("x-1", DONE, expected_seq=call.seq)
        assert call.key is not None
        done = await client.report("x-1", call.key, {"charged": 500})
        await client.propose("x-1", DONE, expected_seq=done.seq)
        with pytest.raises(RunEnded) as ended:
            await client.propose("x-1", DONE)
        assert isinstance(ended.value, ProtocolError)
        assert ended.value.type == PROBLEMS + "run-ended"


def test_every_problem_type_names_a_public_exception() -> None:
    for slug, cls in PROBLEM_ERRORS.items():
        assert slug == slug.lower()
        assert getattr(interlock.errors, cls.__name__) is cls


def _flip_last_chunk(db: Path, run_id: str) -> None:
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        chunk, body = conn.execute(
            "SELECT id, body FROM chunks WHERE run_id = ? ORDER BY id DESC LIMIT 1", (run_id,)
        ).fetchone()
        damaged = bytearray(body)
        damaged[20] ^= 0xFF
        conn.execute("UPDATE chunks SET body = ? WHERE id = ?", (bytes(damaged), chunk))


async def test_store_damage_is_a_500_that_names_interlock_check_not_a_retry(
    tmp_path: Path,
) -> None:
    db = tmp_path / "j.db"
    async with gateway(db) as (_, client):
        seq = (await client.create_run("shop", run_id="x-1")).seq
        for _ in range(3):  # three rejections in a row escalate it: not resumed at start
            seq = (await client.propose("x-1", BAD, expected_seq=seq)).seq
    _flip_last_chunk(db, "x-1")
    async with gateway(db) as (http, client):
        answer = await http.get("/v1/runs/x-1")
        body = problem(answer, 500, "store-damaged")
        assert "retry-after" not in answer.headers
        assert body["title"] == "Store Damaged"
        assert "corrupt" in body["detail"]
        assert body["detail"].endswith(
            "; retrying cannot help: run 'interlock check --db JOURNAL' on this gateway's "
            "journal to list all the damage, then restore it from a backup"
        )
        with pytest.raises(StoreDamaged) as damaged:
            await client.get_run("x-1")
        assert damaged.value.status == 500
        for path in ("/v1/runs/x-1/events", "/v1/escalations/x-1"):
            problem(await http.get(path), 500, "store-damaged")
