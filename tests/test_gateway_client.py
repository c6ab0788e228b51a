"""interlock.client against a real gateway on loopback, and the examples that use it (#17).

The gateway is ``serve_gateway`` (hypercorn on trio) in the test's own trio loop, or
``interlock serve`` as a process for the examples. Dropped connections and odd answers
come from a real TCP proxy between client and gateway (:class:`Proxy`), never a mock.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import interlock.client
from interlock import App
from interlock.client import (
    AsyncClient,
    Client,
    ClientRetryPolicy,
    GatewayProblem,
    GatewayUnavailable,
)
from interlock.core._sse import SseEvent, SseParser
from interlock.demo.workflows import Backend, order_total, refund
from interlock.events import Event
from interlock.gateway import serve_gateway
from interlock.gateway._keys import KeyRing
from interlock.providers import ScriptedProvider

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ORDER = "ord-100001"
TOTAL = order_total(ORDER)
INPUTS = {"order_id": ORDER, "customer": "ada@example.com", "requested": 150.0}
FAST = ClientRetryPolicy(retries=3, base=0.01, cap=2.0)


def lookup() -> str:
    return json.dumps({"tool": "lookup_order", "args": {"order_id": ORDER}})


def refund_of(amount: float) -> str:
    args = {"order_id": ORDER, "amount": amount, "currency": "USD", "reason": "damaged"}
    return json.dumps({"tool": "refund", "args": args})


EMAIL = json.dumps(
    {"tool": "send_email", "args": {"to": "ada@example.com", "subject": "Hi", "lines": ["ok"]}}
)
DONE = json.dumps({"next": "COMPLETED", "data": {"answer": "refunded"}})


@dataclass
class Gateway:
    url: str
    server: Any

    async def journal(self, run_id: str) -> list[Event]:
        return list(await self.server.supervisor.store.load(run_id))

    async def kinds(self, run_id: str) -> list[str]:
        return [type(e).__struct_config__.tag for e in await self.journal(run_id)]


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, keyring: KeyRing | None = None) -> AsyncIterator[Gateway]:
    """The refund workflow behind ``serve_gateway`` on a SQLite journal, on a free port.

    Hosted runs are driven by the workflow's oracle (a well-behaved simulated model).
    No API key is needed unless ``keyring`` holds some."""
    backend = Backend(":memory:")
    app = App([refund.build(backend)], provider=ScriptedProvider(refund.oracle, model="oracle"))
    try:
        # every test that uses a gateway ends within 90 s, whatever goes wrong
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                server = await nursery.start(
                    partial(
                        serve_gateway,
                        app,
                        db=str(tmp_path / "journal.db"),
                        port=0,
                        keyring=keyring if keyring is not None else KeyRing(),
                    )
                )
                try:
                    yield Gateway(server.url, server)
                finally:
                    server.stop()
    finally:
        backend.close()


@dataclass
class Proxy:
    """A TCP proxy on loopback that can drop an answer, cut connections or answer itself."""

    upstream: int
    port: int = 0
    drops: int = 0
    """Answers to swallow: the gateway did the work, the client sees the connection close."""
    canned: list[bytes] = field(default_factory=list)
    """Raw HTTP answers sent instead of forwarding the next requests."""
    connections: int = 0
    dropped: int = 0
    _scopes: set[trio.CancelScope] = field(default_factory=set)

    async def serve(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    def cut(self) -> None:
        """Close every connection now, mid-answer or not."""
        for scope in list(self._scopes):
            scope.cancel()

    async def _connection(self, client: trio.SocketStream) -> None:
        self.connections += 1
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream)
                async with client, upstream, trio.open_nursery() as nursery:
                    nursery.start_soon(self._up, client, upstream, nursery.cancel_scope)
                    nursery.start_soon(self._down, upstream, client, nursery.cancel_scope)
            finally:
                self._scopes.discard(scope)

    async def _up(self, client: Any, upstream: Any, done: trio.CancelScope) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await client.receive_some(65536):
                if self.canned:
                    await client.send_all(self.canned.pop(0))
                    break
                await upstream.send_all(data)
        done.cancel()

    async def _down(self, upstream: Any, client: Any, done: trio.CancelScope) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await upstream.receive_some(65536):
                if self.drops:
                    self.drops -= 1
                    self.dropped += 1
                    break
                await client.send_all(data)
        done.cancel()


@contextlib.asynccontextmanager
async def proxy_to(gw: Gateway) -> AsyncIterator[Proxy]:
    proxy = Proxy(upstream=gw.server.port)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        yield proxy
        nursery.cancel_scope.cancel()


def canned(status: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"content-length: {len(body)}", "connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# -- the async client ---------------------------------------------------------------------


async def test_an_external_run_from_start_to_completed(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, AsyncClient(gw.url, retry=FAST) as client:
        run = await client.start_external("refund", INPUTS, run_id="x-1")
        assert (run.id, run.state, run.outcome, run.seq) == ("x-1", "WORK", "running", 1)
        assert {t.name for t in run.run.tools} == {"lookup_order", "refund", "send_email"}
        assert "COMPLETED" in run.run.next

        verdict = await run.propose(lookup())
        assert (verdict.accepted, verdict.tool, verdict.args) == (
            True,
            "lookup_order",
            {"order_id": ORDER},
        )
        assert verdict.key is not None
        await run.report(verdict.key, {"order_id": ORDER, "total": TOTAL})

        rejected = await run.propose(refund_of(TOTAL + 50))
        assert not rejected.accepted
        (violation,) = rejected.violations
        assert (violation.code, violation.path, violation.hint) == (
            "guard",
            "args.amount",
            f"propose amount <= {TOTAL}",
        )
        assert run.seq == rejected.seq

        paid = await run.propose(refund_of(TOTAL))
        assert paid.accepted
        assert paid.tool == "refund"
        assert paid.key
        journal = await gw.journal("x-1")
        intents = [e for e in journal if type(e).__struct_config__.tag == "intent_recorded"]
        assert intents[-1].key == paid.key  # durable before the verdict came back
        await run.report(paid.key, {"refunded": TOTAL})
        email = await run.propose(EMAIL)
        assert email.key is not None
        await run.report(email.key, {"message_id": "m-1"})
        end = await run.propose(DONE)
        assert (end.accepted, end.outcome, end.state, run.outcome) == (
            True,
            "completed",
            "COMPLETED",
            "completed",
        )

        done = await client.get_run("x-1")
        assert (done.outcome, done.output) == ("completed", {"answer": "refunded"})
        events = await client.events("x-1")
        assert [e.seq for e in events] == list(range(1, done.seq + 1))
        assert [e.kind for e in events] == await gw.kinds("x-1")
        assert [e.kind for e in await client.events("x-1", after=done.seq - 1)] == ["completed"]
        assert (await client.wait("x-1")).outcome == "completed"
        assert [r.id async for r in client.list_runs(outcome="completed")] == ["x-1"]
        assert (await client.health()).status == "ok"
        assert (await client.ready()).ready


async def test_a_hosted_run_is_watched_with_stream_and_wait(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, AsyncClient(gw.url, retry=FAST) as client:
        run = await client.create_run("refund", INPUTS, run_id="h-1", mode="hosted")
        assert run.mode == "hosted"
        with trio.fail_after(60):
            seen = [event async for event in client.stream("h-1")]
            finished = await client.wait("h-1")
        assert [e.seq for e in seen] == list(range(1, finished.seq + 1))
        assert seen[-1].kind == "completed" == finished.outcome
        assert [e.kind for e in seen] == await gw.kinds("h-1")
        # from the middle: only what follows
        tail = [e.seq async for e in client.stream("h-1", last_event_id=finished.seq - 2)]
        assert tail == [finished.seq - 1, finished.seq]


async def test_runs_are_listed_page_by_page(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, AsyncClient(gw.url, retry=FAST) as client:
        for index in range(5):
            await client.create_run("refund", INPUTS, run_id=f"x-{index}")
        ids = [r.id async for r in client.list_runs(page_size=2)]
        assert ids == [f"x-{index}" for index in range(5)]
        assert [r.id async for r in client.list_runs(machine="nope")] == []


async def test_msgpack_bodies_both_ways(tmp_path: Path) -> None:
    types: list[str] = []

    async def note(response: httpx.Response) -> None:
        types.append(response.headers.get("content-type", ""))

    async with (
        gateway(tmp_path) as gw,
        httpx.AsyncClient(event_hooks={"response": [note]}) as http,
    ):
        client = AsyncClient(gw.url, format="msgpack", http=http, retry=FAST)
        run = await client.start_external("refund", INPUTS, run_id="m-1")
        verdict = await run.propose(lookup())
        assert verdict.key is not None
        await run.report(verdict.key, {"order_id": ORDER, "total": TOTAL})
        rejected = await run.propose(refund_of(TOTAL + 1))
        assert rejected.violations[0].hint == f"propose amount <= {TOTAL}"
        assert types
        assert all(t.startswith("application/msgpack") for t in types), types
        with pytest.raises(GatewayProblem) as caught:
            await client.get_run("nope")
        assert caught.value.status == 404


async def test_a_batch_is_verified_in_one_request(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, AsyncClient(gw.url, retry=FAST) as client:
        a = await client.create_run("refund", INPUTS, run_id="b-1")
        b = await client.create_run("refund", INPUTS, run_id="b-2")
        verdicts = await client.verify(
            [
                {"run_id": "b-1", "proposal": lookup(), "expected_seq": a.seq},
                {"run_id": "b-2", "proposal": '{"tool": "wipe"}', "expected_seq": b.seq},
            ]
        )
        assert [(v.run_id, v.accepted) for v in verdicts] == [("b-1", True), ("b-2", False)]
        assert verdicts[1].violations[0].code == "unknown_tool"
        with pytest.raises(ValueError, match=r"^verify\(\) needs at least one item$"):
            await client.verify([])


async def test_escalations_are_listed_resumed_and_aborted(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, AsyncClient(gw.url, retry=FAST) as client:
        for run_id in ("e-1", "e-2"):
            run = await client.start_external("refund", INPUTS, run_id=run_id)
            while run.outcome == "running":  # three rejections in a row trip the breaker
                await run.propose('{"tool": "wipe"}')
            assert (await client.wait(run_id)).outcome == "escalated"
        queued = await client.escalations()
        assert sorted(e.id for e in queued) == ["e-1", "e-2"]
        one = await client.escalation("e-1")
        assert (one.reason, one.from_state) == ("consecutive_failures", "WORK")

        with pytest.raises(GatewayProblem) as caught:  # a corrected payload is verified too
            await client.resume("e-1", by="ops", payload='{"tool": "refund", "args": {}}')
        assert caught.value.status == 422
        assert [(v.code, v.path) for v in caught.value.violations] == [("schema", "args")]
        assert "\n  schema at args: " in str(caught.value)

        resumed = await client.resume("e-1", by="ops", note="try again")
        assert (resumed.outcome, resumed.state) == ("running", "WORK")
        again = await client.resume("e-1", by="ops", note="try again")  # a retry: same answer
        assert (again.outcome, again.seq) == ("running", resumed.seq)
        assert (await gw.kinds("e-1")).count("resumed") == 1

        aborted = await client.abort("e-2", by="ops", note="give up")
        assert aborted.outcome == "failed"
        assert (await client.abort("e-2", by="ops", note="give up")).outcome == "failed"
        assert [e.id for e in await client.escalations()] == []

        with pytest.raises(GatewayProblem) as caught:
            await client.resume("e-2", by="ops")
        assert caught.value.status == 409


# -- problems -----------------------------------------------------------------------------


async def test_problems_carry_what_the_server_said(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, AsyncClient(gw.url, retry=FAST) as client:
        with pytest.raises(GatewayProblem) as caught:
            await client.get_run("nope")
        problem = caught.value
        assert (problem.status, problem.method, problem.path) == (404, "GET", "/v1/runs/nope")
        assert str(problem).startswith("GET /v1/runs/nope: 404 ")
        assert problem.detail
        assert problem.detail in str(problem)

        with pytest.raises(GatewayProblem) as caught:
            await client.create_run("nope", {})
        assert caught.value.status == 422
        assert "refund" in caught.value.detail  # it names the machines there are

        run = await client.start_external("refund", INPUTS, run_id="p-1")
        await run.propose(lookup())
        with pytest.raises(GatewayProblem) as caught:  # another client advanced the run
            await client.propose("p-1", DONE, expected_seq=1)
        assert caught.value.status == 409
        assert "advanced" in caught.value.detail or "seq" in caught.value.detail

        with pytest.raises(GatewayProblem) as caught:
            await client.report("p-1", "p-1:WORK:99", {"x": 1})
        assert 400 <= caught.value.status < 500


async def test_bad_arguments_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match=r"^base_url must start with http:// or https://"):
        AsyncClient("127.0.0.1:8080")
    with pytest.raises(ValueError, match=r"^format must be 'json' or 'msgpack', got 'xml'$"):
        Client("http://127.0.0.1:1", format="xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^timeout must be > 0 seconds, got 0$"):
        AsyncClient("http://127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match=r"^retries, base and cap must be >= 0"):
        ClientRetryPolicy(retries=-1)
    async with AsyncClient("http://127.0.0.1:1") as client:
        with pytest.raises(ValueError, match=r"^mode must be 'external' or 'hosted', got 'x'$"):
            await client.create_run("refund", mode="x")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^give payload or to, not both$"):
            await client.resume("r", by="me", payload="{}", to="WORK")
        with pytest.raises(TypeError, match=r"^proposal must be the model's raw text \(str\)"):
            await client.propose("r", {"tool": "x"})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^usage must be a Usage, a TokenUsage or a mapping"):
            await client.propose("r", "{}", usage={"prompt": -1})


def test_the_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTERLOCK_API_KEY", "k-123")
    client = Client("http://127.0.0.1:1")
    assert client._headers["Authorization"] == "Bearer k-123"
    with pytest.raises(ValueError, match=r"^api_key must be a non-empty token with no line"):
        Client("http://127.0.0.1:1", api_key="a\nb")


async def test_the_bearer_key_is_sent_with_every_request(tmp_path: Path) -> None:
    key = "k-7f3a9c1e5b2d4f6a8c0e"
    async with gateway(tmp_path, KeyRing.from_env({"INTERLOCK_API_KEY": key})) as gw:
        async with AsyncClient(gw.url, api_key=key, retry=FAST) as client:
            run = await client.start_external("refund", INPUTS, run_id="k-1")
            assert (await run.propose(lookup())).accepted
            async with contextlib.aclosing(client.stream("k-1")) as events:
                async for event in events:  # the stream sends the key too
                    if event.seq == run.seq:
                        break
        async with AsyncClient(gw.url, api_key="k-not-the-key", retry=FAST) as client:
            with pytest.raises(GatewayProblem) as caught:
                await client.get_run("k-1")
        assert caught.value.status == 401
        with pytest.MonkeyPatch.context() as env:
            env.setenv("INTERLOCK_API_KEY", key)
            with Client(gw.url, retry=FAST) as sync:  # the key from the environment
                seen = await trio.to_thread.run_sync(sync.get_run, "k-1")
        assert seen.seq == run.seq


# -- retries ------------------------------------------------------------------------------


async def test_a_dropped_answer_is_resent_and_gets_the_recorded_one(tmp_path: Path) -> None:
    """The gateway did the work; the answer was lost. The resend gets what was recorded,
    and the journal holds one of each: one run, one model call, one intent, one commit."""
    async with (
        gateway(tmp_path) as gw,
        proxy_to(gw) as proxy,
        AsyncClient(f"http://127.0.0.1:{proxy.port}", retry=FAST) as client,
    ):
        proxy.drops = 1
        run = await client.start_external("refund", INPUTS)  # the client made the id
        assert proxy.dropped == 1
        assert len([r async for r in client.list_runs()]) == 1

        proxy.drops = 1
        verdict = await run.propose(lookup())
        assert (proxy.dropped, verdict.accepted, verdict.replayed) == (2, True, True)
        assert verdict.key is not None

        proxy.drops = 1
        reported = await run.report(verdict.key, {"order_id": ORDER, "total": TOTAL})
        assert (proxy.dropped, reported.replayed) == (3, True)

        kinds = await gw.kinds(run.id)
        assert (kinds.count("run_started"), kinds.count("model_called")) == (1, 1)
        assert kinds.count("tool_committed") == 1
        assert run.seq == reported.seq == len(kinds)


async def _drive(client: AsyncClient, proxy: Proxy, run_id: str, drops: list[bool]) -> str:
    """The refund run, each request's answer dropped where ``drops`` says; its outcome."""
    plan = iter(drops)

    def arm() -> None:
        proxy.drops = 1 if next(plan, False) else 0

    arm()
    run = await client.start_external("refund", INPUTS, run_id=run_id)
    results = {"lookup_order": {"order_id": ORDER, "total": TOTAL}, "refund": {"ok": 1}}
    for text in (lookup(), refund_of(TOTAL + 1), refund_of(TOTAL), EMAIL, DONE):
        arm()
        verdict = await run.propose(text)
        if verdict.key and verdict.tool:
            arm()
            await run.report(verdict.key, results.get(verdict.tool, {"sent": True}))
    return run.outcome


@settings(max_examples=6, deadline=None)
@given(st.lists(st.booleans(), min_size=9, max_size=9))
async def test_dropped_answers_anywhere_leave_the_journal_as_if_none_were(
    drops: list[bool],
) -> None:
    """Whichever answers are lost, the resends end the run with the very journal of a run
    that lost none: no second run, model call, intent or commit."""
    with tempfile.TemporaryDirectory() as work:  # hypothesis runs it more than once
        async with (
            gateway(Path(work)) as gw,
            proxy_to(gw) as proxy,
            AsyncClient(f"http://127.0.0.1:{proxy.port}", retry=FAST) as client,
        ):
            assert await _drive(client, proxy, "clean", []) == "completed"
            assert await _drive(client, proxy, "lossy", drops) == "completed"
            assert proxy.dropped == sum(drops)
            assert await gw.kinds("lossy") == await gw.kinds("clean")


async def test_a_proposal_without_expected_seq_is_not_resent(tmp_path: Path) -> None:
    async with (
        gateway(tmp_path) as gw,
        proxy_to(gw) as proxy,
        AsyncClient(f"http://127.0.0.1:{proxy.port}", retry=FAST) as client,
    ):
        await client.create_run("refund", INPUTS, run_id="n-1")
        proxy.drops = 1
        with pytest.raises(GatewayUnavailable) as caught:
            await client.propose("n-1", lookup())
        assert caught.value.attempts == 1
        assert "not resent, since it may have reached the gateway" in str(caught.value)
        assert (await gw.kinds("n-1")).count("model_called") == 1  # it did reach it


async def test_no_answer_at_all_ends_after_the_retries() -> None:
    with trio.socket.socket() as probe:  # a port nobody listens on
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}", retry=FAST) as client:
        with pytest.raises(GatewayUnavailable) as caught:
            await client.get_run("x")
    assert caught.value.attempts == FAST.retries + 1
    assert str(caught.value).startswith("GET /v1/runs/x: no answer from the gateway after 4 ")
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


async def test_429_and_503_are_waited_out_then_raised(tmp_path: Path) -> None:
    busy = json.dumps(
        {
            "type": "about:blank",
            "title": "Service Unavailable",
            "status": 503,
            "detail": "the journal is behind",
        }
    ).encode()
    async with (
        gateway(tmp_path) as gw,
        proxy_to(gw) as proxy,
        AsyncClient(f"http://127.0.0.1:{proxy.port}", retry=FAST) as client,
    ):
        proxy.canned = [
            canned(
                "503 Service Unavailable",
                {"retry-after": "0", "content-type": "application/problem+json"},
                busy,
            ),
            canned("429 Too Many Requests", {"retry-after": "0"}, b""),
        ]
        run = await client.create_run("refund", INPUTS, run_id="r-1")
        assert run.id == "r-1"
        assert proxy.canned == []

        proxy.canned = [canned("429 Too Many Requests", {"retry-after": "60"}, b"slow down")]
        with pytest.raises(GatewayProblem) as caught:  # longer than the cap: raised
            await client.get_run("r-1")
        assert (caught.value.status, caught.value.retry_after) == (429, 60.0)
        assert caught.value.detail == "slow down"

        page = b"<html><body>502 Bad Gateway</body></html>"
        proxy.canned = [canned("502 Bad Gateway", {"content-type": "text/html"}, page)]
        with pytest.raises(GatewayProblem) as caught:  # not a problem document
            await client.get_run("r-1")
        assert (caught.value.status, caught.value.title) == (502, "Bad Gateway")
        assert caught.value.detail == page.decode()


async def test_a_stream_resumes_after_a_drop_with_no_event_lost_or_repeated(
    tmp_path: Path,
) -> None:
    async with gateway(tmp_path) as gw, proxy_to(gw) as proxy:
        watcher = AsyncClient(f"http://127.0.0.1:{proxy.port}", retry=FAST)
        driver = AsyncClient(gw.url, retry=FAST)
        async with watcher, driver:
            run = await driver.start_external("refund", INPUTS, run_id="s-1")
            seen: list[int] = []
            first = trio.Event()

            async def watch() -> None:
                async for event in watcher.stream("s-1"):
                    seen.append(event.seq)
                    first.set()

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    await first.wait()
                    proxy.cut()  # the watcher's connection drops mid-stream
                    verdict = await run.propose(lookup())
                    assert verdict.key is not None
                    await run.report(verdict.key, {"order_id": ORDER, "total": TOTAL})
                    proxy.cut()
                    await run.propose(DONE)
            assert seen == list(range(1, run.seq + 1))
            assert proxy.connections >= 2


# -- the sync client ----------------------------------------------------------------------


def drive_with_the_sync_client(url: str) -> dict[str, Any]:
    with Client(url, retry=FAST) as client:
        run = client.start_external("refund", INPUTS, run_id="y-1")
        verdict = run.propose(lookup())
        assert verdict.key is not None
        run.report(verdict.key, {"order_id": ORDER, "total": TOTAL})
        rejected = run.propose(refund_of(TOTAL + 5))
        paid = run.propose(refund_of(TOTAL))
        assert paid.key is not None
        failed = run.report_error(paid.key, "connection reset", retryable=True, applied=False)
        paid = run.propose(refund_of(TOTAL))
        assert paid.key is not None
        run.report(paid.key, {"refunded": TOTAL})
        run.propose(DONE)
        hosted = client.create_run("refund", INPUTS, run_id="y-2", mode="hosted")
        return {
            "rejected": rejected,
            "failed": failed,
            "done": client.wait("y-1"),
            "hosted": [e.kind for e in client.stream(hosted.id)],
            "waited": client.wait("y-2"),
            "runs": [r.id for r in client.list_runs(page_size=1)],
            "events": client.events("y-1"),
            "escalations": client.escalations(),
            "missing": _problem(lambda: client.get_run("nope")),
        }


def _problem(call: Any) -> GatewayProblem:
    with pytest.raises(GatewayProblem) as caught:
        call()
    return caught.value


async def test_the_sync_client_drives_and_watches_runs(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        with trio.fail_after(60):
            out = await trio.to_thread.run_sync(drive_with_the_sync_client, gw.url)
        assert out["rejected"].violations[0].code == "guard"
        assert out["failed"].outcome == "running"  # not applied: back to the model
        assert (out["done"].outcome, out["waited"].outcome) == ("completed", "completed")
        assert out["hosted"][0] == "run_started"
        assert out["hosted"][-1] == "completed"
        assert out["runs"] == ["y-1", "y-2"]
        assert [e.kind for e in out["events"]] == await gw.kinds("y-1")
        assert out["escalations"] == []
        assert out["missing"].status == 404


def test_the_two_clients_have_the_same_methods() -> None:
    def surface(cls: type) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(member).parameters)
            for name, member in vars(cls).items()
            if not name.startswith("_") and callable(member) and name not in ("close", "aclose")
        }

    assert surface(AsyncClient) == surface(Client)
    assert surface(interlock.client.AsyncExternalRun) == surface(interlock.client.ExternalRun)


def test_the_public_names_are_exported_and_documented() -> None:
    module = interlock.client
    public = {n for n in vars(module) if not n.startswith("_") and n not in ("Any", "annotations")}
    lazy = set(module._LAZY)  # the channel's client, imported on first use
    assert set(module.__all__) == public | lazy
    channel = importlib.util.find_spec("interlock.client._channel") is not None
    for name in module.__all__:
        if name in lazy and not channel:
            continue
        obj = getattr(module, name)
        assert obj.__module__.startswith("interlock"), name
        assert inspect.getdoc(obj), name


async def test_the_channel_client_is_reachable_from_interlock_client(tmp_path: Path) -> None:
    """The streaming channel beside the HTTP API, on the same service: the same run."""
    from interlock.gateway._channel import serve_channel

    async with gateway(tmp_path) as gw, trio.open_nursery() as nursery:
        address = await nursery.start(
            partial(serve_channel, gw.server.app.service, keyring=KeyRing())
        )
        async with interlock.client.open_channel(address) as channel:
            assert isinstance(channel, interlock.client.ChannelClient)
            run = await channel.create_run("refund", INPUTS, run_id="ch-1", mode="external")
            verdict = await channel.propose("ch-1", lookup(), expected_seq=run.seq)
            assert verdict.accepted
        async with AsyncClient(gw.url, retry=FAST) as client:
            assert (await client.get_run("ch-1")).seq == verdict.seq
        nursery.cancel_scope.cancel()


def test_the_client_needs_no_server_packages() -> None:
    code = (
        "import sys; sys.modules['hypercorn'] = None\n"
        "import interlock.client\n"
        "interlock.client.Client('http://127.0.0.1:1').close()\n"
        "assert 'hypercorn' not in sys.modules or sys.modules['hypercorn'] is None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


# -- the SSE reader -----------------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\0"))


@settings(deadline=None)  # a loaded host must not fail it
@given(
    st.lists(
        st.tuples(
            st.integers(0, 10**9),
            st.from_regex(r"\A[a-z_]{1,20}\Z"),
            st.lists(_text, min_size=1, max_size=3),
        ),
        max_size=8,
    ),
    st.booleans(),
)
def test_sse_frames_are_read_back_exactly(
    events: list[tuple[int, str, list[str]]], comments: bool
) -> None:
    lines: list[str] = []
    for seq, kind, data in events:
        if comments:
            lines.append(": keep-alive")
        lines += [f"id: {seq}", f"event: {kind}", *(f"data: {part}" for part in data), ""]
    parser = SseParser()
    read = [frame for line in lines if (frame := parser.feed_line(line)) is not None]
    assert read == [SseEvent(kind, "\n".join(data), str(seq)) for seq, kind, data in events]
    # The same stream as bytes, cut anywhere, reads back the same events.
    whole = "".join(f"{line}\r\n" for line in lines).encode()
    for cut in {0, len(whole) // 3, len(whole) // 2, len(whole)}:
        bytes_parser = SseParser()
        assert [*bytes_parser.feed(whole[:cut]), *bytes_parser.feed(whole[cut:])] == read


# -- the examples -------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["INTERLOCK"] = f"{sys.executable} -m interlock"
    env.pop("INTERLOCK_API_KEY", None)
    return env


needs_curl = pytest.mark.skipif(
    shutil.which("curl") is None, reason="curl is not installed: the curl example needs it"
)


@needs_curl
async def test_the_curl_example_completes_a_run_against_its_own_gateway() -> None:
    """Done line of #17: an external agent written with curl completes a run through
    ``interlock serve`` on the demo application."""
    env = _env()
    if shutil.which("jq", path=env["PATH"]) is None:
        env["INTERLOCK_NO_JQ"] = "1"
    with trio.fail_after(120):
        done = await trio.run_process(
            ["bash", str(ROOT / "examples/external_agent_curl.sh")],
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    assert "gateway: http://127.0.0.1:" in out
    assert "rejected: guard at args.amount: args.amount: 150.0 exceeds the order total 120.0" in out
    assert "hint: propose amount <= 120.0" in out
    assert "replayed=true" in out
    assert ": completed at seq" in out


@needs_curl
async def test_the_curl_example_parses_with_sed_when_there_is_no_jq(tmp_path: Path) -> None:
    """Against a gateway that needs a key: the script sends INTERLOCK_API_KEY."""
    key = "k-curl-2b8e61d04f9a7c35"
    async with gateway(tmp_path, KeyRing.from_env({"INTERLOCK_API_KEY": key})) as gw:
        env = {
            **_env(),
            "INTERLOCK_URL": gw.url,
            "INTERLOCK_API_KEY": key,
            "INTERLOCK_NO_JQ": "1",
            "RUN_ID": "c-1",
        }
        with trio.fail_after(120):
            done = await trio.run_process(
                ["bash", str(ROOT / "examples/external_agent_curl.sh")],
                env=env,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        out = done.stdout.decode()
        assert done.returncode == 0, out + done.stderr.decode()
        assert "(parsed with sed)" in out
        assert "hint: propose amount <= 120.0" in out
        kinds = await gw.kinds("c-1")
        assert kinds[-1] == "completed"
        assert kinds.count("tool_committed") == 3  # the retried result added nothing
        events = await gw.journal("c-1")
        committed = [e for e in events if type(e).__struct_config__.tag == "tool_committed"]
        assert msgspec.to_builtins(committed[1].result)["refunded"] == 120.0


async def test_the_python_example_runs_an_external_and_a_hosted_run(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        with trio.fail_after(120):
            done = await trio.run_process(
                [sys.executable, str(ROOT / "examples/external_agent.py"), gw.url],
                env=_env(),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        out = done.stdout.decode()
        assert done.returncode == 0, out + done.stderr.decode()
        assert f"hint: propose amount <= {120.0}" in out
        assert "retried the refund's result: replayed=True" in out
        assert "1 refund, 1 email" in out
        async with AsyncClient(gw.url) as client:
            finished = [r async for r in client.list_runs(outcome="completed")]
        assert len(finished) == 2


def test_the_python_example_starts_its_own_gateway() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples/external_agent.py")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gateway: http://127.0.0.1:" in done.stdout
    assert "completed" in done.stdout
