"""Several gateway instances in front of one PostgreSQL database (#18: "gateway instances
are stateless in front of the same database").

Two ``interlock serve`` processes on one schema (each test its own): an external run is
driven to its end alternating requests between them, with the same outcome and journal as
through one instance; the same request sent to both at once gets one answer and one clean
409, and the run completes afterwards; a hosted run POSTed to one is enqueued, is seen
running through the other, and once ``interlock worker`` drives it the other's event stream
ends with its completion; an instance SIGKILLed mid-run leaves its runs to the other.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("hypercorn")
httpx = pytest.importorskip("httpx")
psycopg = pytest.importorskip("psycopg")

from interlock.stores import open_store  # noqa: E402

PG_DSN = os.environ.get("INTERLOCK_PG_DSN", "")

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.skipif(
        not PG_DSN,
        reason="INTERLOCK_PG_DSN is not set; set it to a PostgreSQL DSN to run the tests of "
        "several gateways on one database",
    ),
]

APP = textwrap.dedent(
    """
    import msgspec
    from interlock import App, Budgets, Go, Machine, Step, Tool, Worker

    class Charge(msgspec.Struct, forbid_unknown_fields=True):
        order: str
        cents: int

    class Ship(msgspec.Struct, forbid_unknown_fields=True):
        order: str

    async def executed_by_the_client(args, ctx):
        raise AssertionError("an external run's tools are executed by its client")

    shop = Machine(
        "shop",
        "PAY",
        {
            "PAY": Worker(next=["SHIP"], tools=["charge"]),
            "SHIP": Worker(next=["COMPLETED"], tools=["ship"]),
        },
        tools=[
            Tool("charge", executed_by_the_client, Charge),
            Tool("ship", executed_by_the_client, Ship, idempotent=True),
        ],
        budgets=Budgets(steps=100),
    )

    # A hosted machine of plain steps: a worker drives it with no model.
    tally = Machine(
        "tally",
        "ADD",
        {
            "ADD": Step(lambda view: Go("CHECK", {"total": 3}), next=["CHECK"]),
            "CHECK": Step(lambda view: Go("COMPLETED", {"checked": True}), next=["COMPLETED"]),
        },
    )
    # A hosted machine whose first step proposes an illegal move: it escalates every time.
    stuck = Machine(
        "stuck",
        "TRY",
        {
            "TRY": Step(lambda view: Go("COMPLETED"), next=["WAIT"]),
            "WAIT": Step(lambda view: Go("COMPLETED"), next=["COMPLETED"]),
        },
    )
    app = App([shop, tally, stuck])
    """
)

CHARGE = '{"tool": "charge", "args": {"order": "o-1", "cents": 150}}'
BAD_CHARGE = '{"tool": "charge", "args": {"order": "o-1", "cents": "150"}}'
SHIP = '{"tool": "ship", "args": {"order": "o-1"}}'


def move(to: str) -> str:
    return f'{{"next": "{to}", "data": {{"order": "o-1"}}}}'


class Instance:
    """One ``interlock serve`` process on the test's database."""

    def __init__(
        self, name: str, ref: str, db: str, logs: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.env = {**os.environ, **(env or {})}
        self.ref = ref
        self.db = db
        self.log = logs / f"serve-{name}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.client: httpx.AsyncClient | None = None

    def _spawn(self) -> subprocess.Popen[str]:
        with self.log.open("ab") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "interlock",
                    "serve",
                    "--app",
                    self.ref,
                    "--db",
                    self.db,
                    "--port",
                    "0",
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
            )

    async def start(self) -> None:
        """Start it on a free port (``--port 0``) and read the port from its ready line."""
        self.proc = self._spawn()
        assert self.proc.stdout is not None
        with trio.fail_after(60):  # a hang guard, not a timing assertion
            line = await trio.to_thread.run_sync(self.proc.stdout.readline, abandon_on_cancel=True)
        assert line.startswith("interlock serve: http://"), (
            f"instance {self.name} did not start: {line!r}\n{self.output()}"
        )
        self.url = line.split()[2]
        self.client = httpx.AsyncClient(base_url=self.url, timeout=60)

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert self.client is not None
        response = await self.client.request(method, path, json=body)
        return response.status_code, response.json()

    async def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = await self.request(method, path, body)
        assert status in (200, 201), (self.name, method, path, body, status, answer)
        return answer

    def kill(self) -> None:
        assert self.proc is not None
        assert self.proc.poll() is None, f"instance {self.name} exited by itself:\n{self.output()}"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-4000:]


class Cluster:
    """Two instances (``a``, ``b``) on one fresh schema, and the app file they serve."""

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None) -> None:
        (tmp_path / "pg_shop_app.py").write_text(APP, encoding="utf-8")
        self.ref = f"{tmp_path / 'pg_shop_app.py'}:app"
        self.schema = f"interlock_gw_{secrets.token_hex(5)}"
        separator = "&" if "?" in PG_DSN else "?"
        self.db = f"{PG_DSN}{separator}schema={self.schema}"
        self.tmp_path = tmp_path
        self.a = Instance("a", self.ref, self.db, tmp_path, env)
        self.b = Instance("b", self.ref, self.db, tmp_path, env)

    async def journal(self, run_id: str) -> list[dict[str, Any]]:
        """The run's journal, without what varies between two runs of the same requests
        (times, latencies, its id, here or inside its idempotency keys)."""
        store = await open_store(self.db)
        try:
            events = await store.load(run_id)
        finally:
            await store.aclose()
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        out = []
        for event in events:
            text = json.dumps(
                {
                    **{
                        k: v
                        for k, v in _builtins(event).items()
                        if k not in {"run_id", "ts", "latency", "usage", "prompt_hash"}
                    },
                },
                sort_keys=True,
            )
            out.append(json.loads(text.replace(run_id, "RUN")))
        return out

    def lease(self, run_id: str) -> tuple[str | None, int]:
        """The run's lease: its owner (None: nobody holds it) and epoch (how many times it
        was claimed). Whoever drives a hosted run, a worker or a gateway, claims it first,
        so the epoch counts its drivers."""
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            [(owner, epoch)] = conn.execute(
                psycopg.sql.SQL("SELECT owner, epoch FROM {}.leases WHERE run_id = %s").format(
                    psycopg.sql.Identifier(self.schema)
                ),
                (run_id,),
            ).fetchall()
        return owner, epoch

    def drop(self) -> None:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(
                psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    psycopg.sql.Identifier(self.schema)
                )
            )


def _builtins(event: Any) -> dict[str, Any]:
    import msgspec

    data: dict[str, Any] = msgspec.to_builtins(event)
    return data


@pytest.fixture
async def cluster(tmp_path: Path) -> Any:
    cluster = Cluster(tmp_path)
    try:
        await cluster.a.start()
        await cluster.b.start()
        yield cluster
    finally:
        with trio.CancelScope(shield=True):
            await cluster.a.aclose()
            await cluster.b.aclose()
            await trio.to_thread.run_sync(cluster.drop)


async def drive(run_id: str, pick: Any, created: Any = None) -> list[dict[str, Any]]:
    """Drive the shop run ``run_id`` to its end, the instance of each request chosen by
    ``pick(step)``; returns every answer. ``created()`` is called once the run exists."""
    answers: list[dict[str, Any]] = []
    path = f"/v1/runs/{run_id}"
    run = await pick(0).ok(
        "POST", "/v1/runs", {"machine": "shop", "run_id": run_id, "mode": "external"}
    )
    assert run["driven_by"] == "caller"
    answers.append(run)
    if created is not None:
        created()
    seq = run["seq"]
    step = 1

    async def propose(text: str) -> dict[str, Any]:
        nonlocal seq, step
        verdict = await pick(step).ok(
            "POST", f"{path}/proposals", {"proposal": text, "expected_seq": seq}
        )
        step += 1
        seq = verdict["seq"]
        answers.append(verdict)
        return verdict

    async def report(key: str, result: Any) -> dict[str, Any]:
        nonlocal seq, step
        verdict = await pick(step).ok("POST", f"{path}/results", {"key": key, "result": result})
        step += 1
        seq = verdict["seq"]
        answers.append(verdict)
        return verdict

    rejected = await propose(BAD_CHARGE)
    assert not rejected["accepted"], rejected
    charge = await propose(CHARGE)
    assert charge["accepted"], charge
    await report(charge["key"], {"charged": 150})
    await propose(move("SHIP"))
    ship = await propose(SHIP)
    await report(ship["key"], {"shipped": True})
    done = await propose(move("COMPLETED"))
    assert done["outcome"] == "completed", done
    return answers


def _comparable(answers: list[dict[str, Any]], run_id: str) -> list[Any]:
    return json.loads(json.dumps(answers).replace(run_id, "RUN"))


async def read_stream(instance: Instance, run_id: str, into: list[dict[str, Any]]) -> None:
    """Follow the run's event stream on ``instance`` until the server ends it."""
    assert instance.client is not None
    async with instance.client.stream("GET", f"/v1/runs/{run_id}/stream") as response:
        assert response.status_code == 200
        kind = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                into.append({"event": kind, **data})


async def test_an_external_run_driven_through_two_instances_in_turn(cluster: Cluster) -> None:
    single = await drive("shop-single", lambda step: cluster.a)
    streams: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    # A hang guard: the nursery waits for both streams, which must end by themselves with
    # the run. The last request goes through B: A's stream hears it only from the store.
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:

            def follow() -> None:  # on A and on B, while both drive it
                for instance in (cluster.a, cluster.b):
                    nursery.start_soon(read_stream, instance, "shop-both", streams[instance.name])

            both = await drive("shop-both", lambda step: (cluster.a, cluster.b)[step % 2], follow)
    assert _comparable(both, "shop-both") == _comparable(single, "shop-single")
    journal = await cluster.journal("shop-both")
    assert journal == await cluster.journal("shop-single")
    # Each stream heard every event, the other instance's writes too, in order, once each.
    assert len(both) % 2 == 0  # so the last request went through B
    for streamed in streams.values():
        assert [e["seq"] for e in streamed] == list(range(1, len(journal) + 1))
        assert streamed[-1]["event"] == "completed"
    for instance in (cluster.a, cluster.b):
        run = await instance.ok("GET", "/v1/runs/shop-both")
        assert (run["outcome"], run["state"], run["seq"]) == (
            "completed",
            "COMPLETED",
            len(journal),
        )


async def _race(cluster: Cluster, path: str, body: dict[str, Any]) -> list[tuple[str, int, Any]]:
    answers: list[tuple[str, int, Any]] = []

    async def one(instance: Instance) -> None:
        status, answer = await instance.request("POST", path, body)
        answers.append((instance.name, status, answer))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, cluster.a)
        nursery.start_soon(one, cluster.b)
    return sorted(answers, key=lambda item: item[1])


async def test_the_same_request_on_two_instances_at_once(cluster: Cluster) -> None:
    run_id = "shop-race"
    path = f"/v1/runs/{run_id}"
    run = await cluster.a.ok(
        "POST", "/v1/runs", {"machine": "shop", "run_id": run_id, "mode": "external"}
    )
    body = {"proposal": CHARGE, "expected_seq": run["seq"]}
    charge = await cluster.a.ok("POST", f"{path}/proposals", body)
    # The retry of an answered request on the other instance gets the recorded verdict,
    # and leaves both instances holding the run at the same seq.
    again = await cluster.b.ok("POST", f"{path}/proposals", body)
    assert again["replayed"] is True
    assert {k: v for k, v in again.items() if k != "replayed"} == {
        k: v for k, v in charge.items() if k != "replayed"
    }

    result = {"key": charge["key"], "result": {"charged": 150}}
    (winner, won, reported), (loser, lost, problem) = await _race(
        cluster, f"{path}/results", result
    )
    assert (won, lost) == (200, 409), (reported, problem)
    assert run_id in problem["detail"], problem
    assert "GET the run" in problem["detail"], problem
    # The loser dropped its copy: the same request sent to it again reads the journal.
    retried = await getattr(cluster, loser).ok("POST", f"{path}/results", result)
    assert retried["seq"] == reported["seq"]
    assert retried["replayed"] is True

    body = {"proposal": move("SHIP"), "expected_seq": reported["seq"]}
    (winner, won, moved), (loser, lost, problem) = await _race(cluster, f"{path}/proposals", body)
    assert (won, lost) == (200, 409), (moved, problem)
    assert run_id in problem["detail"], problem
    retried = await getattr(cluster, loser).ok("POST", f"{path}/proposals", body)
    assert retried["replayed"] is True
    assert retried["seq"] == moved["seq"]

    # The run goes on through either instance to its end.
    ship = await getattr(cluster, loser).ok(
        "POST", f"{path}/proposals", {"proposal": SHIP, "expected_seq": moved["seq"]}
    )
    shipped = await getattr(cluster, winner).ok(
        "POST", f"{path}/results", {"key": ship["key"], "result": {"shipped": True}}
    )
    done = await getattr(cluster, loser).ok(
        "POST", f"{path}/proposals", {"proposal": move("COMPLETED"), "expected_seq": shipped["seq"]}
    )
    assert done["outcome"] == "completed"
    journal = await cluster.journal(run_id)
    kinds = [e["kind"] for e in journal]
    assert kinds.count("tool_committed") == 2, kinds  # once per key, the race's included
    assert kinds.count("intent_recorded") == 2, kinds
    assert kinds[-1] == "completed"


async def test_an_instance_killed_mid_run_leaves_the_run_to_the_other(cluster: Cluster) -> None:
    single = await drive("shop-alone", lambda step: cluster.b)
    killed = False

    def pick(step: int) -> Instance:
        nonlocal killed
        if step < 3:
            return cluster.a
        if not killed:
            cluster.a.kill()  # after the charge's intent and its result went through A
            killed = True
        return cluster.b

    answers = await drive("shop-killed", pick)
    assert killed
    assert _comparable(answers, "shop-killed") == _comparable(single, "shop-alone")
    assert await cluster.journal("shop-killed") == await cluster.journal("shop-alone")


async def work(cluster: Cluster, *, ttl: float = 3, wait: float = 15) -> dict[str, Any]:
    """Run ``interlock worker --until-idle`` on the cluster's database; its summary.

    Its leases last ``ttl`` seconds: 3, not the default 10, so that a lease a worker left
    behind (a bug) costs a test seconds, not tens. (At 2 s a worker that stalled for 2 s
    on a loaded host lost its run mid-drive, once in a CI run.) It waits up to ``wait``
    seconds for leases held elsewhere, by default past any it should meet."""
    worker = await trio.run_process(
        [
            sys.executable,
            "-m",
            "interlock",
            "worker",
            "--app",
            cluster.ref,
            "--db",
            cluster.db,
            "--until-idle",
            "--lease-ttl",
            str(ttl),
            "--wait",
            str(wait),
            "--json",
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert worker.returncode == 0, worker.stderr.decode()
    summary: dict[str, Any] = json.loads(worker.stdout)
    return summary


async def _need_worker() -> None:
    why = await trio.to_thread.run_sync(_worker_available)
    if why:
        pytest.skip(why)


def _worker_available() -> str:
    """'' when ``interlock worker`` exists, else why not."""
    done = subprocess.run(
        [sys.executable, "-m", "interlock", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        return f"interlock worker is not there yet (exit {done.returncode}): {done.stderr[-300:]}"
    return ""


async def test_a_hosted_run_is_enqueued_and_a_worker_drives_it(cluster: Cluster) -> None:
    created = await cluster.a.ok("POST", "/v1/runs", {"machine": "tally", "run_id": "tally-1"})
    assert (created["mode"], created["state"], created["outcome"]) == ("hosted", "ADD", "running")
    assert created["driven_by"] == "worker"
    assert created["seq"] == 1  # run_started only: nothing drove it in the gateway
    seen = await cluster.b.ok("GET", "/v1/runs/tally-1")
    assert (seen["state"], seen["outcome"], seen["seq"]) == ("ADD", "running", 1)
    # Neither instance drives it: nobody ever claimed it, and it is where it was created.
    assert await trio.to_thread.run_sync(cluster.lease, "tally-1") == (None, 0)
    assert (await cluster.a.ok("GET", "/v1/runs/tally-1"))["seq"] == 1
    status, problem = await cluster.b.request(
        "POST", "/v1/runs/tally-1/proposals", {"proposal": move("CHECK")}
    )
    assert status == 409, problem
    assert "hosted" in problem["detail"], problem

    await _need_worker()
    streamed: list[dict[str, Any]] = []
    # A hang guard: the nursery waits for B's stream, which must end by itself with the run.
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, cluster.b, "tally-1", streamed)
            summary = await work(cluster)
            assert summary["completed"] == 1, summary
    assert streamed[-1]["event"] == "completed"
    assert [e["seq"] for e in streamed] == list(range(1, len(streamed) + 1))
    # One claim in the run's whole life, the worker's: no gateway drove any of it.
    assert (await trio.to_thread.run_sync(cluster.lease, "tally-1"))[1] == 1
    run = await cluster.a.ok("GET", "/v1/runs/tally-1")
    assert (run["outcome"], run["state"], run["output"]) == (
        "completed",
        "COMPLETED",
        {"checked": True},
    )


async def escalate(instance: Instance, run_id: str) -> dict[str, Any]:
    """Start the shop run ``run_id`` on ``instance`` and escalate it: three proposals in a
    row that the gate rejects trip the failure breaker."""
    path = f"/v1/runs/{run_id}"
    run = await instance.ok(
        "POST", "/v1/runs", {"machine": "shop", "run_id": run_id, "mode": "external"}
    )
    verdict: dict[str, Any] = {"seq": run["seq"]}
    for _ in range(3):
        verdict = await instance.ok(
            "POST", f"{path}/proposals", {"proposal": BAD_CHARGE, "expected_seq": verdict["seq"]}
        )
    assert verdict["outcome"] == "escalated", verdict
    return verdict


async def test_escalations_are_resumed_and_aborted_through_any_instance(cluster: Cluster) -> None:
    await escalate(cluster.a, "shop-resumed")
    await escalate(cluster.a, "shop-aborted")
    queue = await cluster.b.ok("GET", "/v1/escalations")
    assert {e["id"] for e in queue["escalations"]} == {"shop-resumed", "shop-aborted"}

    resumed = await cluster.b.ok(
        "POST", "/v1/escalations/shop-resumed/resume", {"by": "op", "note": "cents fixed"}
    )
    assert (resumed["outcome"], resumed["state"]) == ("running", "PAY")
    # A retry of the resume, on the other instance, gets the run as it is.
    again = await cluster.a.ok(
        "POST", "/v1/escalations/shop-resumed/resume", {"by": "op", "note": "cents fixed"}
    )
    assert again["seq"] == resumed["seq"]
    # ... and A, which escalated it, drives it on from what B wrote.
    path = "/v1/runs/shop-resumed"
    charge = await cluster.a.ok(
        "POST", f"{path}/proposals", {"proposal": CHARGE, "expected_seq": resumed["seq"]}
    )
    assert charge["accepted"], charge
    charged = await cluster.b.ok(
        "POST", f"{path}/results", {"key": charge["key"], "result": {"charged": 150}}
    )
    assert charged["state"] == "PAY"

    aborted = await cluster.a.ok(
        "POST", "/v1/escalations/shop-aborted/abort", {"by": "op", "note": "duplicate order"}
    )
    assert aborted["outcome"] == "failed"
    seen = await cluster.b.ok("GET", "/v1/runs/shop-aborted")
    assert (seen["outcome"], seen["seq"]) == ("failed", aborted["seq"])
    assert (await cluster.b.ok("GET", "/v1/escalations"))["escalations"] == []


async def test_a_batch_raced_on_two_instances(cluster: Cluster) -> None:
    run_id = "shop-batch"
    run = await cluster.a.ok(
        "POST", "/v1/runs", {"machine": "shop", "run_id": run_id, "mode": "external"}
    )
    first = {"run_id": run_id, "proposal": BAD_CHARGE, "expected_seq": run["seq"]}
    rejected = (await cluster.a.ok("POST", "/v1/verify", {"items": [first]}))["verdicts"][0]
    # The retry on B loads the run there: both instances now hold it at the same seq.
    replayed = (await cluster.b.ok("POST", "/v1/verify", {"items": [first]}))["verdicts"][0]
    assert replayed["replayed"] is True
    assert replayed["seq"] == rejected["seq"]

    item = {"run_id": run_id, "proposal": CHARGE, "expected_seq": rejected["seq"]}
    answers = await _race(cluster, "/v1/verify", {"items": [item]})
    verdicts = sorted(
        (answer["verdicts"][0] for _, status, answer in answers if status == 200),
        key=lambda verdict: verdict["problem"] is not None,
    )
    assert [status for _, status, _ in answers] == [200, 200]
    won, lost = verdicts
    assert won["accepted"] is True, won
    assert lost["problem"]["status"] == 409, lost
    assert run_id in lost["problem"]["detail"], lost
    journal = await cluster.journal(run_id)
    assert [e["kind"] for e in journal].count("intent_recorded") == 1
    assert journal[-1]["seq"] == won["seq"]


async def test_a_hosted_escalation_is_resumed_for_a_worker_and_aborted(cluster: Cluster) -> None:
    await _need_worker()
    await cluster.a.ok("POST", "/v1/runs", {"machine": "stuck", "run_id": "stuck-1"})
    summary = await work(cluster)
    assert summary["escalated"] == 1, summary
    queue = (await cluster.b.ok("GET", "/v1/escalations"))["escalations"]
    assert [e["id"] for e in queue] == ["stuck-1"]
    escalated_at = queue[0]["seq"]

    resumed = await cluster.b.ok("POST", "/v1/escalations/stuck-1/resume", {"by": "op"})
    assert (resumed["outcome"], resumed["state"]) == ("running", "TRY")
    assert resumed["seq"] == escalated_at + 2  # resumed, transitioned: written, not driven
    # Neither gateway drives it: it waits for a worker, unclaimed since the first one.
    assert await trio.to_thread.run_sync(cluster.lease, "stuck-1") == (None, 1)
    assert (await cluster.a.ok("GET", "/v1/runs/stuck-1"))["seq"] == resumed["seq"]
    summary = await work(cluster)
    assert summary["escalated"] == 1, summary  # claimed and driven by a worker again
    assert (await trio.to_thread.run_sync(cluster.lease, "stuck-1"))[1] == 2  # by it alone

    aborted = await cluster.a.ok(
        "POST", "/v1/escalations/stuck-1/abort", {"by": "op", "note": "gave up"}
    )
    assert aborted["outcome"] == "failed"
    assert aborted["reason"] == "aborted by op: gave up"
    journal = await cluster.journal("stuck-1")
    assert [e["kind"] for e in journal].count("resumed") == 2  # the resume and the abort
    assert journal[-1]["kind"] == "failed"


async def test_a_worker_that_escalated_a_run_releases_its_lease_when_it_exits(
    cluster: Cluster,
) -> None:
    # Leases of a minute, and a second worker that waits 3 s for leases held elsewhere: if
    # the first worker left the escalated run's lease behind, the second would give up on
    # the resumed run long before the lease expired.
    await _need_worker()
    await cluster.a.ok("POST", "/v1/runs", {"machine": "stuck", "run_id": "stuck-2"})
    first = await work(cluster, ttl=60, wait=3)
    assert first["escalated"] == 1, first
    await cluster.b.ok("POST", "/v1/escalations/stuck-2/resume", {"by": "op"})
    second = await work(cluster, ttl=60, wait=3)
    assert second["escalated"] == 1, second  # claimed at once, and driven to escalation again
    assert (await cluster.a.ok("GET", "/v1/runs/stuck-2"))["outcome"] == "escalated"


async def test_a_key_at_its_limit_gets_back_the_slots_of_runs_ended_elsewhere(
    tmp_path: Path,
) -> None:
    # One run in flight per key (the anonymous key: no API keys), counted per instance.
    cluster = Cluster(tmp_path, {"INTERLOCK_GATEWAY_RUNS_IN_FLIGHT": "1"})
    try:
        await cluster.a.start()
        await cluster.b.start()
        answers = await drive("shop-quota-1", lambda step: cluster.b if step else cluster.a)
        assert answers[-1]["outcome"] == "completed"  # started on A, ended through B
        second = {"machine": "shop", "run_id": "shop-quota-2", "mode": "external"}
        # A never wrote the first run's end, yet the key's slot is free again there.
        assert (await cluster.a.ok("POST", "/v1/runs", second))["outcome"] == "running"
        third = {"machine": "shop", "run_id": "shop-quota-3", "mode": "external"}
        status, problem = await cluster.a.request("POST", "/v1/runs", third)
        assert status == 429, problem  # the second run is still in flight
    finally:
        with trio.CancelScope(shield=True):
            await cluster.a.aclose()
            await cluster.b.aclose()
            await trio.to_thread.run_sync(cluster.drop)


async def test_an_idle_copy_is_dropped_and_folded_again(tmp_path: Path) -> None:
    """In process: the copies of external runs a service holds go once idle; the next
    request folds the run again, as another instance may have advanced it meanwhile."""
    from interlock import open_supervisor
    from interlock.gateway import GatewayService
    from interlock.protocol import ProposalIn, RunCreate
    from interlock.runtime._app import load_app

    cluster = Cluster(tmp_path)
    app = load_app(cluster.ref)
    store = await open_store(cluster.db)
    try:
        async with open_supervisor(list(app.machines.values()), store) as supervisor:
            service = GatewayService(supervisor)
            assert service.shared
            assert service.enqueues
            service.held_idle = 0.0
            first, _ = await service.create_run(
                RunCreate(machine="shop", run_id="idle-1", mode="external")
            )
            await service.create_run(RunCreate(machine="shop", run_id="idle-2", mode="external"))
            assert "idle-1" not in supervisor._runs  # dropped when idle-2 was used
            assert "idle-2" in supervisor._runs
            verdict = await service.propose(
                "idle-1", ProposalIn(proposal=CHARGE, expected_seq=first.seq)
            )
            assert verdict.accepted
            assert "idle-1" in supervisor._runs  # folded again for the request
            assert "idle-2" not in supervisor._runs
            hosted, _ = await service.create_run(RunCreate(machine="tally", run_id="idle-3"))
            assert (hosted.driven_by, hosted.seq) == ("worker", 1)
            assert "idle-3" not in supervisor._runs  # enqueued, not driven here
    finally:
        await store.aclose()
        await trio.to_thread.run_sync(cluster.drop)
