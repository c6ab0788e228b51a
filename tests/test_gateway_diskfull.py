"""The gateway through a full disk (#33): runs in flight when the journal's writes start
failing go on once there is room again, and ``/readyz`` says whether the journal can be
written. A real SQLITE_FULL: the journal may not grow past its pages (``max_page_count``,
which SQLite reports exactly as a full disk), its free pages taken by a filler table."""

from __future__ import annotations

import inspect
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from interlock import App, Machine, Tool, Worker, replay
from interlock.gateway import GatewayServer, serve_gateway
from interlock.gateway._keys import KeyRing
from interlock.providers import ScriptedProvider
from interlock.stores import SQLiteStore, open_sqlite_store

pytestmark = pytest.mark.slow

#: More than a page of the journal (8 KiB): every batch written while the disk is full
#: holds a row that needs a page of its own (an overflow page), which it cannot get.
BIG = "x" * 9000


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    cents: int
    memo: str


class Receipt(msgspec.Struct, forbid_unknown_fields=True):
    receipt: str


async def never(args: Any, ctx: Any) -> Any:  # an external run's caller executes its tools
    raise AssertionError("an external run's tool is executed by its caller")


def shop() -> Machine:
    """An external run: charge, then finish with a receipt."""
    return Machine(
        "shop",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"], data=Receipt)},
        tools=[Tool("charge", never, Charge)],
    )


class Downstream:
    """An idempotent downstream: a key applied once, its result returned to every repeat.
    Its calls wait for ``open`` (so they are in flight when the disk fills up)."""

    def __init__(self) -> None:
        self.applied: dict[str, Any] = {}
        self.calls: Counter[str] = Counter()
        self.open = trio.Event()
        self.waiting = 0

    async def fetch(self, args: Charge, ctx: Any) -> Any:
        self.calls[ctx.key] += 1
        self.waiting += 1
        try:
            await self.open.wait()
        finally:
            self.waiting -= 1
        if ctx.key not in self.applied:
            self.applied[ctx.key] = {"charged": args.cents, "blob": BIG}
        return self.applied[ctx.key]


def hosted(downstream: Downstream) -> Machine:
    """A hosted run: the model charges (an idempotent tool), then finishes."""
    return Machine(
        "hosted",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"], data=Receipt)},
        tools=[Tool("charge", downstream.fetch, Charge, idempotent=True)],
    )


def model(view: Any) -> str:
    if not view.results_of("charge"):
        return msgspec.json.encode({"tool": "charge", "args": {"cents": 7, "memo": BIG}}).decode()
    return msgspec.json.encode({"next": "COMPLETED", "data": {"receipt": BIG}}).decode()


@asynccontextmanager
async def gateway(app: App, db: Path) -> AsyncIterator[tuple[GatewayServer, httpx.AsyncClient]]:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            server: GatewayServer = await nursery.start(
                partial(serve_gateway, app, db=str(db), port=0, keyring=KeyRing())
            )
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                yield server, client
            server.stop()


async def until(
    holds: Callable[[], bool | Awaitable[bool]], *, bound: float = 30.0, fail: bool = True
) -> bool:
    """Wait until ``holds()``, for ``bound`` seconds at most (generous, not a figure):
    whether it held (``fail``: else raise TooSlowError)."""
    with trio.move_on_after(bound):
        while True:
            value = holds()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return True
            await trio.sleep(0.02)
    if fail:
        raise trio.TooSlowError(f"{holds} did not hold within {bound} s")
    return False


async def fill_up(store: SQLiteStore) -> None:
    """The journal may not grow, and its free pages are taken: the disk is full."""

    def fill(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS filler (b BLOB)")
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()
        for size in (4000, 100):
            while True:
                try:
                    conn.execute("INSERT INTO filler VALUES (randomblob(?))", (size,))
                except sqlite3.OperationalError as exc:
                    if exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
                        raise
                    break

    await store._call("fill", fill)


async def make_room(store: SQLiteStore) -> None:
    def free(conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA max_page_count = 1073741823").fetchone()
        conn.execute("DROP TABLE filler")

    await store._call("free", free)


class Problem(Exception):
    """A request answered with a problem its client cannot retry."""


class Client:
    """A caller that retries a 503 after its Retry-After, as the docs tell it to, and
    counts what it was answered."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.statuses: Counter[int] = Counter()
        self.problems: list[str] = []
        self.full = trio.Event()  # set at its first 503 of the full disk
        self.room = trio.Event()  # set once there is room again
        self.after_room: Counter[int] = Counter()  # the answers since

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        while True:
            response = await self.http.post(path, json=body)
            self.statuses[response.status_code] += 1
            if self.room.is_set():
                self.after_room[response.status_code] += 1
            if response.status_code != 503:
                break
            if "disk is full" in response.json()["detail"]:
                self.full.set()
            if self.after_room[503] > 10:  # a stale 503: the disk has room again
                self.problems.append(f"{path}: still 503 with room: {response.json()['detail']}")
                raise Problem(self.problems[-1])
            await trio.sleep(float(response.headers["retry-after"]))
        if response.status_code >= 400:
            self.problems.append(f"{path}: {response.status_code} {response.json()['detail']}")
            raise Problem(self.problems[-1])
        return response.json()


async def charge(client: Client, run: dict[str, Any]) -> dict[str, Any]:
    """Propose the call; the verdict holds its idempotency key."""
    call = await client.post(
        f"/v1/runs/{run['id']}/proposals",
        {
            "proposal": msgspec.json.encode(
                {"tool": "charge", "args": {"cents": 5, "memo": BIG}}
            ).decode(),
            "expected_seq": run["seq"],
        },
    )
    assert call["accepted"], call
    return call


async def report(client: Client, call: dict[str, Any]) -> dict[str, Any]:
    """Report the call's result (the client executed it, once for its key)."""
    return await client.post(
        f"/v1/runs/{call['run_id']}/results",
        {"key": call["key"], "result": {"charged": 5, "blob": BIG}},
    )


async def drive_report(client: Client, call: dict[str, Any], done: list[str]) -> None:
    """Report a call's result while the disk is full, then finish."""
    try:
        reported = await report(client, call)
    except Problem:
        return  # counted in client.problems
    await drive_finish(client, reported, done)


async def drive_finish(client: Client, run: dict[str, Any], done: list[str]) -> None:
    """Finish a run that has charged already (``run`` is its last verdict)."""
    try:
        end = await client.post(
            f"/v1/runs/{run['run_id']}/proposals",
            {
                "proposal": msgspec.json.encode(
                    {"next": "COMPLETED", "data": {"receipt": BIG}}
                ).decode(),
                "expected_seq": run["seq"],
            },
        )
    except Problem:
        return  # counted in client.problems
    assert end["outcome"] == "completed", end
    done.append(run["run_id"])


async def outcome_of(http: httpx.AsyncClient, run_id: str) -> str:
    response = await http.get(f"/v1/runs/{run_id}")
    assert response.status_code == 200, response.text
    return str(response.json()["outcome"])


async def test_runs_in_flight_through_a_full_disk_finish_once_there_is_room(
    tmp_path: Path,
) -> None:
    """Regression (#33): after a disk-full the gateway wedged the runs in flight until
    restarted (a stale 'disk is full' 503, or a 409 for a request never written), while
    /readyz answered ready."""
    db = tmp_path / "j.db"
    downstream = Downstream()
    app = App([shop(), hosted(downstream)], provider={"hosted": ScriptedProvider(model)})
    async with gateway(app, db) as (server, http):
        store = server.supervisor.store
        assert isinstance(store, SQLiteStore)
        client = Client(http)
        # Hosted runs, each waiting in its call; external runs, each with a call in flight
        # (its result not reported yet) or a finish to propose.
        hosted_ids = [f"h-{i}" for i in range(4)]
        for run_id in hosted_ids:
            await client.post("/v1/runs", {"machine": "hosted", "run_id": run_id, "inputs": {}})
        calling = []  # runs whose call is in flight
        finishing = []  # runs that charged, to finish
        for i in range(4):
            run = await client.post(
                "/v1/runs", {"machine": "shop", "run_id": f"c-{i}", "mode": "external"}
            )
            calling.append(await charge(client, run))
            run = await client.post(
                "/v1/runs", {"machine": "shop", "run_id": f"f-{i}", "mode": "external"}
            )
            finishing.append(await report(client, await charge(client, run)))
        await until(lambda: downstream.waiting == len(hosted_ids))
        before = {r.run_id: await store.load(r.run_id) for r in await store.list_runs()}
        done: list[str] = []
        await fill_up(store)
        async with trio.open_nursery() as nursery:
            downstream.open.set()  # the hosted runs' commits now fail
            for call in calling:
                nursery.start_soon(drive_report, client, call, done)
            for verdict in finishing:
                nursery.start_soon(drive_finish, client, verdict, done)
            with trio.fail_after(30):
                await client.full.wait()
            await until(lambda: not server.supervisor.driving)  # the hosted actors stopped
            full_ready = await http.get("/readyz")
            await make_room(store)
            client.room.set()

        async def hosted_ended() -> bool:
            return all([await outcome_of(http, run_id) != "running" for run_id in hosted_ids])

        await until(hosted_ended, fail=False)
        outcomes = {run_id: await outcome_of(http, run_id) for run_id in hosted_ids}
        ready_after = await http.get("/readyz")
    # What the callers saw (a 409, a stale 503), hosted runs left running, readiness.
    assert client.problems == []
    assert 409 not in client.statuses
    assert outcomes == dict.fromkeys(hosted_ids, "completed")
    assert full_ready.status_code == 503
    assert full_ready.json()["ready"] is False
    assert "the journal cannot be written" in full_ready.json()["detail"]
    assert "disk is full" in full_ready.json()["detail"]
    assert ready_after.status_code == 200, ready_after.text
    assert sorted(done) == sorted(v["run_id"] for v in calling + finishing)
    assert client.after_room[503] == 0  # nothing stale once there was room
    # Nothing committed before the fault is lost, nothing is applied twice.
    store = await open_sqlite_store(str(db), readonly=True)
    try:
        assert (await store.check()).ok
        for run_id, events in before.items():
            now = await store.load(run_id)
            assert now[: len(events)] == events
            kinds = [type(e).__struct_config__.tag for e in now]
            assert kinds[-1] == "completed"
            assert kinds.count("tool_committed") == 1
            assert kinds.count("intent_recorded") == 1
            machine = shop() if run_id[0] in "cf" else hosted(downstream)
            assert replay(now, machine).diverged == ()
    finally:
        await store.aclose()
    # Each hosted call ran again with its key once driven again (its commit was lost),
    # and was applied once.
    assert len(downstream.applied) == len(hosted_ids)
    assert set(downstream.calls.values()) == {2}


async def test_a_batch_retried_after_a_full_disk_is_decided_afresh(tmp_path: Path) -> None:
    """Regression (#33): the retry of a batch (POST /v1/verify) whose write failed on a
    full disk got a 409 per item (the runs taken for advanced by another request), and
    /readyz stayed ready; it turns ready again once there is room, with no request."""
    db = tmp_path / "j.db"
    async with gateway(App([shop()]), db) as (server, http):
        store = server.supervisor.store
        assert isinstance(store, SQLiteStore)
        client = Client(http)
        verdicts = []
        for i in range(3):
            run = await client.post(
                "/v1/runs", {"machine": "shop", "run_id": f"b-{i}", "mode": "external"}
            )
            verdicts.append(await report(client, await charge(client, run)))
        finish = msgspec.json.encode({"next": "COMPLETED", "data": {"receipt": BIG}}).decode()
        batch = {
            "items": [
                {"run_id": v["run_id"], "proposal": finish, "expected_seq": v["seq"]}
                for v in verdicts
            ]
        }
        await fill_up(store)
        failed = (await http.post("/v1/verify", json=batch)).json()["verdicts"]
        full = await http.get("/readyz")
        await make_room(store)
        ready = await http.get("/readyz")  # no request wrote anything since
        again = (await http.post("/v1/verify", json=batch)).json()["verdicts"]
    assert [v["problem"]["status"] for v in failed] == [503] * 3
    assert "disk is full" in failed[0]["problem"]["detail"]
    assert full.status_code == 503
    assert full.json()["detail"].startswith("the journal cannot be written: ")
    assert ready.status_code == 200, ready.text
    assert [v.get("problem") for v in again] == [None] * 3, again
    assert [(v["accepted"], v["outcome"]) for v in again] == [(True, "completed")] * 3
    store = await open_sqlite_store(str(db), readonly=True)
    try:
        assert (await store.check()).ok
        for v in verdicts:
            kinds = [type(e).__struct_config__.tag for e in await store.load(v["run_id"])]
            assert kinds.count("model_called") == 2  # the charge and the one finish
            assert kinds[-1] == "completed"
    finally:
        await store.aclose()
