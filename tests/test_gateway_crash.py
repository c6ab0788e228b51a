"""The gateway SIGKILLed under a load of external runs, then started again on the same file.

``interlock serve`` runs as a real process on a SQLite journal; concurrent clients in this
test drive external runs through it (create, propose a charge, execute it, report it, move
on, propose a shipment, execute, report, complete), retrying every request that got no
answer with the same idempotency (the same ``run_id``, the same ``expected_seq``, the same
result key) until the server answers. The server is killed with SIGKILL while the load
runs, twice, and started again each time on the same file and port.

Asserts: every run ends as the same requests end it in process; every verdict that was
acknowledged is in the journal (its seq, its key's intent); no intent is journaled twice
(one ``intent_recorded`` per key, one key per run and tool), and the client executed each
key once; every acknowledged request sent again gets its recorded answer; a call whose
outcome the client cannot tell escalates as in doubt (``in_doubt_side_effect``), as in
process; and ``interlock replay --all`` and ``interlock check`` exit 0 afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("hypercorn")
pytest.importorskip("interlock.gateway._serve", reason="the gateway's server is not built yet")

from interlock import open_supervisor
from interlock.events import IntentRecorded, ToolCommitted
from interlock.messages import Propose, Report
from interlock.stores import MemoryStore
from interlock.stores._open import open_store

pytestmark = pytest.mark.slow

RUNS = int(os.environ.get("INTERLOCK_GATEWAY_CRASH_RUNS", "120"))
CLIENTS = 16
KILLS = 2
#: Every ``LOSE``-th run's client drops the answer to its charge unread (see drive()).
LOSE = 7
#: Every ``IN_DOUBT``-th run's client reports its charge as failed without knowing whether
#: the charge was applied: the call is in doubt.
IN_DOUBT = 10

APP = textwrap.dedent(
    """
    import msgspec
    from interlock import App, Budgets, Machine, Tool, Worker

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
    app = App([shop])
    """
)


def charge(index: int) -> str:
    return f'{{"tool": "charge", "args": {{"order": "o-{index}", "cents": {100 + index}}}}}'


def ship(index: int) -> str:
    return f'{{"tool": "ship", "args": {{"order": "o-{index}"}}}}'


def move(to: str, index: int) -> str:
    return f'{{"next": "{to}", "data": {{"order": "o-{index}"}}}}'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Down(Exception):
    """The server is not there, or went away before it answered."""


async def http(
    port: int, method: str, path: str, body: Any = None
) -> tuple[int, dict[str, str], Any]:
    """One request on its own connection: ``(status, headers, decoded JSON body)``.

    Raises:
      Down: the connection failed or closed before the whole answer came.
    """
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
    if body is not None:
        head += f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError as exc:
        raise Down(str(exc)) from None
    raw = bytearray()
    try:
        async with stream:
            await stream.send_all(head.encode() + b"\r\n" + data)
            while chunk := await stream.receive_some(65536):
                raw += chunk
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise Down(str(exc)) from None
    header, _, content = bytes(raw).partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1.1 "):
        raise Down(f"no answer: {bytes(raw[:100])!r}")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    headers = {name.lower(): value for name, value in headers.items()}
    length = int(headers.get("content-length", len(content)))
    if len(content) < length:
        raise Down(f"the answer was cut after {len(content)} of {length} bytes")
    return int(lines[0][9:12]), headers, json.loads(content) if content else None


class Gateway:
    """``interlock serve`` on a SQLite file, as a process that can be killed and restarted."""

    def __init__(self, tmp_path: Path) -> None:
        (tmp_path / "shop_app.py").write_text(APP, encoding="utf-8")
        self.ref = f"{tmp_path / 'shop_app.py'}:app"
        self.db = str(tmp_path / "journal.db")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "interlock", *args, "--app", self.ref, "--db", self.db]

    def spawn(self) -> None:
        self.starts += 1
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.command("serve"), "--port", str(self.port)], stdout=log, stderr=log
            )

    async def start(self) -> None:
        """Start the server and wait until it says it is ready."""
        self.spawn()
        assert self.proc is not None
        with trio.fail_after(60):
            while True:
                assert self.proc.poll() is None, self.output()
                try:
                    if (await http(self.port, "GET", "/readyz"))[0] == 200:
                        return
                except Down:
                    pass
                await trio.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        assert self.proc.poll() is None, f"the server exited by itself:\n{self.output()}"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-4000:]


class Load:
    """The clients' shared record: acknowledged answers, executed keys, progress."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.acknowledged: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []
        """(run id, path, request body, the answer) for every request that got one."""
        self.executed: Counter[str] = Counter()
        """How many times the client executed each idempotency key (its downstream)."""
        self.retries = 0
        self.resent: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        """(path, body, answer) of each request answered only after it was sent again."""
        self.lost: dict[str, tuple[dict[str, Any], trio.Event]] = {}
        """Run id -> the answer to its charge proposal that its client dropped unread, and
        the event its client waits for before it sends the proposal again."""
        self.recovered: dict[str, dict[str, Any]] = {}
        """Run id -> the answer to the same proposal sent again after the kill."""
        self.kills_left = KILLS
        self.waiting: set[str] = set()
        """The runs whose clients wait for the server to come back from a kill."""
        self.restarted = trio.Event()
        """Set when the server is back after a kill (then replaced by a fresh one)."""
        self.progress = trio.Condition()


async def send(load: Load, run_id: str, path: str, body: dict[str, Any]) -> Any:
    """POST ``body`` until the server answers it; retried as is (same idempotency)."""
    attempts = 0
    while True:
        attempts += 1
        try:
            status, headers, answer = await http(load.port, "POST", path, body)
        except Down:  # killed mid-request, or not back yet
            load.retries += 1
            await trio.sleep(0.05)
            continue
        if status in (429, 503):  # back-pressure, or starting up
            load.retries += 1
            await trio.sleep(float(headers.get("retry-after", "0.05")))
            continue
        assert status in (200, 201), (path, body, status, answer)
        load.acknowledged.append((run_id, path, body, answer))
        if attempts > 1:
            load.resent.append((path, body, answer))
        async with load.progress:
            load.progress.notify_all()
        return answer


async def drive(load: Load, index: int) -> None:
    """One external run to its end, as an agent that owns the model and the tools.

    Every ``LOSE``-th run's client, while a kill is still to come, drops the answer to its
    charge proposal unread (as if the connection had failed under it) and sends the same
    proposal again only once the server is back from the next kill: the call it asked for
    is in the journal, pending, across the crash.
    """
    run_id = f"shop-{index}"
    run = await send(
        load, run_id, "/v1/runs", {"machine": "shop", "run_id": run_id, "mode": "external"}
    )
    seq = run["seq"]
    proposals, results = f"/v1/runs/{run_id}/proposals", f"/v1/runs/{run_id}/results"
    for proposal, tool in ((charge(index), "charge"), (ship(index), "ship")):
        body = {"proposal": proposal, "expected_seq": seq}
        lose = tool == "charge" and index % LOSE == LOSE - 1
        if lose and load.kills_left and len(load.waiting) < CLIENTS // 2:  # others go on
            load.waiting.add(run_id)
            answer = await send(load, run_id, proposals, body)
            restarted = load.restarted
            load.lost[run_id] = (answer, restarted)
            await restarted.wait()
            load.waiting.discard(run_id)
        verdict = await send(load, run_id, proposals, body)
        if tool == "charge" and run_id in load.lost:
            load.recovered[run_id] = verdict
        assert verdict["accepted"], verdict
        assert verdict["tool"] == tool, verdict
        key = verdict["key"]
        if tool == "charge" and index % IN_DOUBT == 0:
            report = {"key": key, "error": "connection reset after sending"}  # applied unknown
        else:
            load.executed[key] += 1  # the downstream applies it, then the client reports
            report = {"key": key, "result": {"done": tool, "order": f"o-{index}"}}
        reported = await send(load, run_id, results, report)
        if reported["outcome"] != "running":
            return
        seq = reported["seq"]
        to = "SHIP" if tool == "charge" else "COMPLETED"
        moved = await send(
            load, run_id, proposals, {"proposal": move(to, index), "expected_seq": seq}
        )
        assert moved["accepted"], moved
        seq = moved["seq"]


async def one_client(load: Load, pending: Any) -> None:
    """A client: drives the next run nobody has taken until there is none."""
    for index in pending:
        await drive(load, index)


async def expected_outcomes() -> dict[str, tuple[str, str]]:
    """The same requests in process (``Supervisor.submit``): each run's outcome and reason."""
    namespace: dict[str, Any] = {}
    exec(compile(APP, "shop_app.py", "exec"), namespace)
    outcomes = {}
    async with open_supervisor([namespace["shop"]], MemoryStore()) as sup:
        for index in range(RUNS):
            run_id = f"shop-{index}"
            handle = await sup.start_run("shop", run_id=run_id, external=True)
            seq = sup.view(run_id).seq
            for proposal, tool in ((charge(index), "charge"), (ship(index), "ship")):
                verdict = await sup.submit(Propose(run_id=run_id, seq=seq, raw=proposal))
                assert verdict.execute is not None
                if tool == "charge" and index % IN_DOUBT == 0:
                    report = Report(run_id=run_id, key=verdict.execute.key, ok=False, error="reset")
                else:
                    report = Report(run_id=run_id, key=verdict.execute.key, ok=True, result={})
                reported = await sup.submit(report)
                if reported.outcome != "running":
                    break
                to = "SHIP" if tool == "charge" else "COMPLETED"
                moved = await sup.submit(
                    Propose(run_id=run_id, seq=reported.seq, raw=move(to, index))
                )
                seq = moved.seq
            result = await handle.wait()
            outcomes[run_id] = (result.outcome, result.reason)
    return outcomes


async def test_sigkill_under_load_loses_no_verdict_and_repeats_no_intent(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path)
    load = Load(gateway.port)
    # Each run makes 7 requests (5 when its charge is in doubt, 1 more when its client
    # loses an answer): kill after these many answers.
    total = RUNS * 6
    kills_at = [total * (k + 1) // (KILLS + 2) for k in range(KILLS)]
    pending_at_restart: dict[str, Any] = {}
    await gateway.start()
    try:
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                pending = iter(range(RUNS))
                for _ in range(CLIENTS):
                    nursery.start_soon(one_client, load, pending)
                for at in kills_at:
                    async with load.progress:
                        while len(load.acknowledged) < at:
                            await load.progress.wait()
                    load.kills_left -= 1
                    gateway.kill()  # mid-load: requests in flight
                    await gateway.start()
                    # the runs whose clients lost an answer and wait for this restart
                    restarted, load.restarted = load.restarted, trio.Event()
                    lost = {r: a for r, (a, event) in load.lost.items() if event is restarted}
                    for run_id, answer in lost.items():
                        _, _, run = await http(gateway.port, "GET", f"/v1/runs/{run_id}")
                        pending_at_restart[run_id] = (answer, run)
                    restarted.set()
                load.restarted.set()  # a client that lost an answer after the last kill
            # every request sent again gets the answer it got the first time
            for _run_id, path, body, answer in load.acknowledged:
                status, _, again = await http(gateway.port, "POST", path, body)
                assert status in (200, 201), (path, body, status, again)
                assert same_answer(path, body, again, answer), (path, body, again, answer)
            runs = {}
            for index in range(RUNS):
                status, _, runs[f"shop-{index}"] = await http(
                    gateway.port, "GET", f"/v1/runs/shop-{index}"
                )
                assert status == 200, runs[f"shop-{index}"]
        assert gateway.terminate() == 0, gateway.output()  # SIGTERM drains and exits 0
    finally:
        if gateway.proc is not None and gateway.proc.poll() is None:
            gateway.proc.kill()
            gateway.proc.wait()
    assert gateway.starts == KILLS + 1
    print(
        f"{len(load.acknowledged)} answers, {load.retries} retries, {len(load.resent)} "
        f"requests answered only after a resend, {len(pending_at_restart)} calls pending "
        "across a kill"
    )
    assert load.retries > 0, "no request was in flight at a kill"

    # a call whose answer was lost before a kill is pending after it, with the same key,
    # and the same proposal sent again gets that recorded verdict
    assert len(pending_at_restart) >= KILLS, "no answer was lost before a kill"
    for run_id, (lost, run) in pending_at_restart.items():
        assert lost["accepted"], lost
        assert run["pending"] is not None, (run_id, run)
        assert run["pending"]["key"] == lost["key"], (run_id, run, lost)
        again = load.recovered[run_id]
        assert again["replayed"], again
        assert same_answer(f"/v1/runs/{run_id}/proposals", {}, again, lost), (again, lost)

    expected = await expected_outcomes()
    assert {run_id: (run["outcome"], run["reason"]) for run_id, run in runs.items()} == expected
    assert Counter(outcome for outcome, _ in expected.values()) == {
        "completed": RUNS - len(range(0, RUNS, IN_DOUBT)),
        "escalated": len(range(0, RUNS, IN_DOUBT)),
    }
    assert {reason for outcome, reason in expected.values() if outcome == "escalated"} == {
        "in_doubt_side_effect"
    }

    store = await open_store(gateway.db, readonly=True)
    try:
        journals = {f"shop-{i}": await store.load(f"shop-{i}") for i in range(RUNS)}
    finally:
        await store.aclose()
    intents: Counter[str] = Counter()
    committed: Counter[str] = Counter()
    for run_id, events in journals.items():
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), run_id
        tools = Counter()
        for event in events:
            if isinstance(event, IntentRecorded):
                intents[event.key] += 1
                tools[event.tool] += 1
            elif isinstance(event, ToolCommitted):
                committed[event.key] += 1
        assert all(count == 1 for count in tools.values()), (run_id, tools)
    assert set(intents.values()) == {1}, "an intent was journaled twice"
    assert set(committed.values()) == {1}, "a call was committed twice"
    assert set(load.executed.values()) == {1}, "the client executed a key twice"
    assert set(load.executed) == set(committed), "executed and committed keys differ"

    for run_id, path, body, answer in load.acknowledged:
        events = journals[run_id]
        assert answer["seq"] <= len(events), (path, body, answer)
        if path.endswith("/proposals") and answer.get("key"):
            assert answer["key"] in intents, (path, body, answer)
        if path.endswith("/results") and "result" in body:
            assert body["key"] in committed, (path, body, answer)

    check = [sys.executable, "-m", "interlock", "check", "--db", gateway.db]
    for command in (gateway.command("replay", "--all"), check):
        with trio.fail_after(120):
            done = await trio.run_process(
                command, capture_stdout=True, capture_stderr=True, check=False
            )
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])


def same_answer(
    path: str, body: dict[str, Any], again: dict[str, Any], first: dict[str, Any]
) -> bool:
    """Whether ``again`` is the recorded answer ``first`` to the request ``body`` to ``path``.

    A run created again is the same run (it may have moved on since); a proposal at the
    same ``expected_seq`` gets the same verdict, field for field; a result reported again
    is accepted with the result recorded for its key (a failure: the same outcome).
    """
    if path == "/v1/runs":
        fields: tuple[str, ...] = ("id", "machine", "mode")
    elif path.endswith("/proposals"):
        fields = ("run_id", "accepted", "state", "seq", "key", "tool", "args", "violations")
    else:
        if "result" in body and again.get("result") != body["result"]:
            return False
        fields = ("run_id", "accepted")
    return {f: again.get(f) for f in fields} == {f: first.get(f) for f in fields}
