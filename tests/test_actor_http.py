"""Tool retries against a real HTTP server on loopback, called with httpx (#14).

The downstream is a tiny HTTP/1.1 server on a trio socket that answers each request
with the next scripted reply and records what it saw; the tool is what a user writes:
an ``httpx.AsyncClient`` call with the idempotency key as a header, then
``raise_for_status()``. So the errors the runtime classifies are httpx's own.
"""

from __future__ import annotations

import http
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing

from interlock import Machine, RetryPolicy, RunResult, Tool, ToolContext, Worker, open_supervisor
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore

CALL = '{"tool": "charge", "args": {"amount": 12.5}}'
DONE = '{"next": "COMPLETED"}'
KEY = "r-1:WORK:3"
#: A reply that closes the connection without an answer (a dropped connection).
DROP = None


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """A mock clock that jumps to the next deadline once every task has waited 0.1 s of real
    time: loopback I/O gets that long to arrive before virtual time moves on."""
    return trio.testing.MockClock(autojump_threshold=0.1)


@dataclass(frozen=True)
class Seen:
    """One request as the server received it."""

    at: float
    method: str
    path: str
    key: str
    body: Any


class Downstream:
    """An HTTP/1.1 server on 127.0.0.1: each request gets the next of ``replies``.

    A reply is ``(status, headers, body)``, or :data:`DROP`.
    """

    def __init__(self, replies: list[tuple[int, dict[str, str], Any] | None]) -> None:
        self.replies = list(replies)
        self.seen: list[Seen] = []
        self.url = ""

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        await trio.serve_listeners(self.handle, listeners, task_status=task_status)

    async def handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some()
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            request, *lines = head.decode("latin-1").split("\r\n")
            headers = {
                name.strip().lower(): value.strip()
                for name, value in (line.split(":", 1) for line in lines)
            }
            while len(body) < int(headers.get("content-length", "0")):
                body += await stream.receive_some()
            method, path, _version = request.split(" ")
            self.seen.append(
                Seen(
                    trio.current_time(),
                    method,
                    path,
                    headers.get("idempotency-key", ""),
                    msgspec.json.decode(body) if body else None,
                )
            )
            reply = self.replies.pop(0)
            if reply is DROP:
                return
            status, extra, document = reply
            payload = msgspec.json.encode(document)
            lines = [
                f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
                "content-type: application/json",
                f"content-length: {len(payload)}",
                "connection: close",
                *(f"{name}: {value}" for name, value in extra.items()),
            ]
            await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    amount: float


class Charger:
    """The tool: POST the charge with the call's key; an error status raises."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.errors: list[Exception] = []

    async def __call__(self, args: Charge, ctx: ToolContext) -> Any:
        try:
            response = await self.client.post(
                "/charges", json={"amount": args.amount}, headers={"Idempotency-Key": ctx.key}
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self.errors.append(exc)
            raise
        return response.json()


def charge_machine(charger: Charger, retry: RetryPolicy) -> Machine:
    return Machine(
        "billing",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", charger, Charge, idempotent=True, retry=retry)],
    )


async def charge_once(
    replies: list[tuple[int, dict[str, str], Any] | None], retry: RetryPolicy, store: MemoryStore
) -> tuple[RunResult, Downstream, Charger]:
    """Serve ``replies``, run one billing run against them, and return what each side saw."""
    downstream = Downstream(replies)
    async with trio.open_nursery() as nursery:
        await nursery.start(downstream.serve)
        async with httpx.AsyncClient(base_url=downstream.url) as client:
            charger = Charger(client)
            spec = charge_machine(charger, retry)
            provider = ScriptedProvider([CALL, DONE])
            async with open_supervisor(
                [spec], store, provider=provider, clock=trio.current_time
            ) as sup:
                result = await (await sup.start_run("billing", run_id="r-1")).wait()
        nursery.cancel_scope.cancel()
    return result, downstream, charger


def closing(events: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """The event that closed the run's only tool call."""
    (event,) = [e for e in events if e[0] in ("ToolCommitted", "ToolFailed")]
    return event


async def test_429_and_503_are_retried_with_the_same_key_honouring_retry_after(
    memory_store: MemoryStore, events_of: Any, idle_clock: trio.testing.MockClock
) -> None:
    replies = [
        (429, {"retry-after": "4"}, {"error": "slow down"}),
        (503, {}, {"error": "unavailable"}),
        (201, {}, {"charge": "ch-1", "amount": 12.5}),
    ]
    retry = RetryPolicy(attempts=3, base=1.0, jitter=False)
    result, downstream, charger = await charge_once(replies, retry, memory_store)
    assert result.outcome == "completed"
    assert [(s.method, s.path, s.key, s.body) for s in downstream.seen] == [
        ("POST", "/charges", KEY, {"amount": 12.5})
    ] * 3
    # Retry-After: 4 wins over the backoff; the 503 said nothing, so the second backoff step.
    first, second, third = (s.at for s in downstream.seen)
    assert (second - first, third - second) == (4.0, 2.0)
    assert [e.response.status_code for e in charger.errors] == [429, 503]
    kind, fields = closing(await events_of(memory_store, "r-1"))
    assert (kind, fields["key"], fields["result"], fields["attempts"]) == (
        "ToolCommitted",
        KEY,
        {"charge": "ch-1", "amount": 12.5},
        3,
    )


async def test_retry_after_from_the_server_is_capped(
    memory_store: MemoryStore, idle_clock: trio.testing.MockClock
) -> None:
    replies = [(503, {"retry-after": "600"}, {}), (200, {}, {"charge": "ch-1"})]
    retry = RetryPolicy(attempts=2, cap=10.0)
    result, downstream, _charger = await charge_once(replies, retry, memory_store)
    assert result.outcome == "completed"
    first, second = (s.at for s in downstream.seen)
    assert second - first == 10.0


async def test_a_client_error_status_is_not_retried(
    memory_store: MemoryStore, events_of: Any, idle_clock: trio.testing.MockClock
) -> None:
    replies = [(503, {"retry-after": "1"}, {}), (404, {}, {"error": "no such account"})]
    retry = RetryPolicy(attempts=5)
    result, downstream, charger = await charge_once(replies, retry, memory_store)
    assert result.outcome == "completed"  # the model moved on after the failed call
    assert [s.key for s in downstream.seen] == [KEY, KEY]
    last = charger.errors[-1]
    assert isinstance(last, httpx.HTTPStatusError)
    kind, fields = closing(await events_of(memory_store, "r-1"))
    assert (kind, fields["key"], fields["error"], fields["retryable"], fields["attempts"]) == (
        "ToolFailed",
        KEY,
        f"HTTPStatusError: {last}",
        False,
        2,
    )


async def test_a_dropped_connection_is_retried_with_the_same_key(
    memory_store: MemoryStore, events_of: Any, idle_clock: trio.testing.MockClock
) -> None:
    replies = [DROP, (200, {}, {"charge": "ch-1"})]
    retry = RetryPolicy(attempts=2, base=1.0, jitter=False)
    result, downstream, charger = await charge_once(replies, retry, memory_store)
    assert isinstance(charger.errors[0], httpx.RemoteProtocolError)
    assert [s.key for s in downstream.seen] == [KEY, KEY]
    assert result.outcome == "completed"
    assert closing(await events_of(memory_store, "r-1"))[1]["attempts"] == 2
