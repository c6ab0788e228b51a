"""The providers' HTTP transport against a real loopback server (trio + h11, real sockets)."""

from __future__ import annotations

import email.utils
import re
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import pytest
import trio

from interlock import ProviderError
from interlock.core._sse import SseEvent, SseParser
from interlock.errors import RequestRefused
from interlock.providers._http import Transport

KEY = "sk-test-SECRET-0123456789abcdef"

Handler = Callable[["Request", "Responder"], Awaitable[None]]


class Request:
    def __init__(self, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body


class Responder:
    """What a handler uses to answer: whole replies, raw bytes, chunks, a drop."""

    def __init__(self, stream: Any, conn: h11.Connection) -> None:
        self.stream = stream
        self.conn = conn

    async def reply(
        self, status: int, body: bytes = b"{}", headers: list[tuple[str, str]] | None = None
    ) -> None:
        fields = [("content-length", str(len(body))), *(headers or [])]
        data = self.conn.send(h11.Response(status_code=status, headers=fields))
        data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    async def start_chunked(self, status: int = 200) -> None:
        fields = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]
        await self.stream.send_all(self.conn.send(h11.Response(status_code=status, headers=fields)))

    async def chunk(self, data: bytes) -> None:
        await self.stream.send_all(self.conn.send(h11.Data(data=data)))

    async def end(self) -> None:
        await self.stream.send_all(self.conn.send(h11.EndOfMessage()))

    async def raw(self, data: bytes) -> None:
        await self.stream.send_all(data)


class Server:
    """A loopback HTTP/1.1 server that hands each request to ``handler``; counts what it saw."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.requests: list[Request] = []
        self.connections = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.arrivals: list[float] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        tcp = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = tcp[0].socket.getsockname()[1]
        listeners: list[Any] = tcp
        if self.tls is not None:
            listeners = [trio.SSLListener(t, self.tls, https_compatible=True) for t in tcp]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started()

    async def _handle(self, stream: Any) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await self._read(stream, conn)
                if request is None:
                    return
                self.requests.append(request)
                self.arrivals.append(trio.current_time())
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                try:
                    await self.handler(request, Responder(stream, conn))
                finally:
                    self.in_flight -= 1
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            await stream.aclose()

    async def _read(self, stream: Any, conn: h11.Connection) -> Request | None:
        head = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                headers = {k.decode(): v.decode() for k, v in head.headers}
                return Request(head.method.decode(), head.target.decode(), headers, body)
            elif isinstance(event, h11.ConnectionClosed):
                return None


async def start(nursery: trio.Nursery, handler: Handler) -> Server:
    server = Server(handler)
    await nursery.start(server.serve)
    return server


async def ok(request: Request, respond: Responder) -> None:
    await respond.reply(200, b'{"echo": %d}' % len(request.body))


def message_of(excinfo: pytest.ExceptionInfo[ProviderError]) -> str:
    return str(excinfo.value)


# -- success -------------------------------------------------------------------------------


async def test_post_returns_the_response_and_sends_the_headers(nursery: trio.Nursery) -> None:
    server = await start(nursery, ok)
    async with Transport(server.url, headers={"Authorization": f"Bearer {KEY}"}) as transport:
        response = await transport.post("/chat/completions", b'{"a": 1}')
        again = await transport.post("/chat/completions", b'{"b": 22}', headers={"X-Extra": "yes"})
    assert (response.status, response.body) == (200, b'{"echo": 8}')
    assert response.headers["content-length"] == "11"
    assert again.body == b'{"echo": 9}'
    first, second = server.requests
    assert (first.method, first.target, first.body) == ("POST", "/v1/chat/completions", b'{"a": 1}')
    assert first.headers["authorization"] == f"Bearer {KEY}"
    assert first.headers["content-type"] == "application/json"
    assert first.headers["host"] == f"127.0.0.1:{server.port}"
    assert "x-extra" not in first.headers
    assert second.headers["x-extra"] == "yes"
    assert server.connections == 1  # kept alive and reused


async def test_a_connection_the_server_closed_while_idle_is_not_reused(
    nursery: trio.Nursery,
) -> None:
    async def once(request: Request, respond: Responder) -> None:
        await respond.reply(200, b"{}")
        await respond.stream.aclose()  # no ``connection: close``: the pool finds out later

    server = await start(nursery, once)
    async with Transport(server.url) as transport:
        first = await transport.post("/x", b"{}")
        await trio.sleep(0.05)
        second = await transport.post("/x", b"{}")
    assert (first.status, second.status) == (200, 200)
    assert server.connections == 2


async def test_a_reused_connection_closed_before_any_reply_is_tried_once_more(
    nursery: trio.Nursery,
) -> None:
    seen: dict[int, int] = {}

    async def second_dies(request: Request, respond: Responder) -> None:
        count = seen[id(respond.stream)] = seen.get(id(respond.stream), 0) + 1
        if count == 2:  # the keep-alive race: the server gives up on the connection
            await respond.stream.aclose()
            return
        await respond.reply(200)

    server = await start(nursery, second_dies)
    async with Transport(server.url) as transport:
        first = await transport.post("/x", b"{}")
        second = await transport.post("/x", b"{}")
    assert (first.status, second.status) == (200, 200)
    assert (server.connections, len(server.requests)) == (2, 3)


async def test_a_new_connection_closed_before_any_reply_is_retryable(
    nursery: trio.Nursery,
) -> None:
    async def hang_up(request: Request, respond: Responder) -> None:
        await respond.stream.aclose()

    server = await start(nursery, hang_up)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    assert message_of(excinfo) == (
        f"POST /v1/x to 127.0.0.1:{server.port}: closed the connection without answering"
    )
    assert excinfo.value.retryable
    assert len(server.requests) == 1  # a fresh connection is never tried twice


# -- status errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "retryable", "refused"),
    [
        (400, False, True),
        (401, False, False),
        (403, False, False),
        (404, False, False),
        (408, True, False),
        (409, True, False),
        (413, False, True),
        (422, False, True),
        (425, True, False),
        (429, True, False),
        (500, True, False),
        (502, True, False),
        (503, True, False),
        (529, True, False),
    ],
)
async def test_each_status_maps_to_a_provider_error(
    nursery: trio.Nursery, status: int, retryable: bool, refused: bool
) -> None:
    async def answer(request: Request, respond: Responder) -> None:
        await respond.reply(status, b'{"error": {"message": "it went wrong"}}')

    server = await start(nursery, answer)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/chat/completions", b"{}")
    assert message_of(excinfo) == f"POST /v1/chat/completions answered HTTP {status}: it went wrong"
    assert excinfo.value.status == status
    assert excinfo.value.retryable is retryable
    assert excinfo.value.retry_after is None
    # a refusal of the request's shape, never one of the credentials or the address
    assert isinstance(excinfo.value, RequestRefused) is refused


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (
            b'{"error": {"message": "Rate limit reached for gpt-x", "type": "requests"}}',
            "requests: Rate limit reached for gpt-x",
        ),
        (
            b'{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}',
            "overloaded_error: Overloaded",
        ),
        (b'{"error": "model not loaded"}', "model not loaded"),
        (b"<html>" + b"x" * 400 + b"</html>", repr("<html>" + "x" * 294)),
        (b"", "(empty body)"),
    ],
    ids=["openai", "anthropic", "error-string", "html", "empty"],
)
async def test_the_message_holds_the_servers_own_words(
    nursery: trio.Nursery, body: bytes, text: str
) -> None:
    async def answer(request: Request, respond: Responder) -> None:
        await respond.reply(529, body)

    server = await start(nursery, answer)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/messages", b"{}")
    assert message_of(excinfo) == f"POST /v1/messages answered HTTP 529: {text}"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([("retry-after", "7")], 7.0),
        ([("retry-after", "1.5")], 1.5),
        ([("retry-after-ms", "250")], 0.25),
        ([("retry-after-ms", "250"), ("retry-after", "9")], 0.25),
        ([("retry-after-ms", "soon"), ("retry-after", "9")], 9.0),
        ([("retry-after", "-3")], None),
        ([("retry-after", "tomorrow")], None),
    ],
)
async def test_retry_after_is_read_from_the_response(
    nursery: trio.Nursery, headers: list[tuple[str, str]], expected: float | None
) -> None:
    async def answer(request: Request, respond: Responder) -> None:
        await respond.reply(429, b'{"error": {"message": "slow down"}}', headers)

    server = await start(nursery, answer)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    assert excinfo.value.retry_after == expected
    assert excinfo.value.retryable


async def test_retry_after_as_an_http_date(nursery: trio.Nursery) -> None:
    when = email.utils.formatdate(time.time() + 120, usegmt=True)

    async def answer(request: Request, respond: Responder) -> None:
        await respond.reply(503, b"{}", [("retry-after", when)])

    server = await start(nursery, answer)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    # The date has a resolution of one second and the clock moves on while the test runs.
    assert excinfo.value.retry_after is not None
    assert 100 < excinfo.value.retry_after <= 120


async def test_the_key_never_reaches_an_error_message(nursery: trio.Nursery) -> None:
    async def echo(request: Request, respond: Responder) -> None:
        text = f"Incorrect API key provided: {request.headers['authorization']}"
        extra = request.headers.get("x-api-key", "")
        body = b'{"error": {"message": "%s; also %s; %s"}}' % (
            text.encode(),
            extra.encode(),
            KEY[3:].encode(),
        )
        await respond.reply(401, body)

    server = await start(nursery, echo)
    transport = Transport(server.url, headers={"authorization": f"Bearer {KEY}"})
    async with transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}", headers={"x-api-key": "per-call-SECRET-987654"})
    text = message_of(excinfo)
    assert text == (
        "POST /v1/x answered HTTP 401: Incorrect API key provided: [redacted]; "
        "also [redacted]; [redacted]"
    )
    assert KEY not in text
    assert "per-call-SECRET-987654" not in text
    assert "SECRET" not in text
    assert KEY not in repr(transport)


def test_a_header_value_with_a_newline_is_refused_without_showing_it() -> None:
    with pytest.raises(ValueError, match=r"^header 'x-api-key' has a line break") as excinfo:
        Transport("https://api.example.com", headers={"x-api-key": KEY + "\n"})
    assert str(excinfo.value) == (
        "header 'x-api-key' has a line break, NUL or non-ASCII character in its value; "
        "strip the value (a key read from a file often ends with a newline)"
    )


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        (
            {"x-api-key": f" {KEY}"},
            "header 'x-api-key' has spaces or tabs around its value; strip the value",
        ),
        (
            {"x api key": KEY},
            "header name 'x api key' is not a valid HTTP header name "
            "(letters, digits and !#$%&'*+-.^_`|~ only)",
        ),
    ],
)
async def test_a_bad_header_is_refused_without_showing_its_value(
    headers: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Transport("https://api.example.com", headers=headers)
    transport = Transport("http://127.0.0.1:9")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        await transport.post("/x", b"{}", headers=headers)


async def test_a_path_that_cannot_go_on_the_request_line_is_a_value_error() -> None:
    transport = Transport("http://127.0.0.1:9")
    with pytest.raises(
        ValueError, match=r"^path 'x' must start with '/', like '/chat/completions'$"
    ):
        await transport.post("x", b"{}")
    for path in ("/x y", "/x\r\nhost: evil", "/caf\u00e9"):
        message = (
            f"POST {path!r}: the path has a space, a control or a non-ASCII character; "
            "percent-encode it"
        )
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            await transport.post(path, b"{}")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"base_url": "api.openai.com/v1"},
            "base_url 'api.openai.com/v1' is not an http:// or https:// URL; "
            "pass one like 'https://api.openai.com/v1'",
        ),
        (
            {"base_url": "https://user:pw@api.example.com/v1"},
            "base_url https://api.example.com/v1 must have no user, password, query or "
            "fragment; pass credentials in headers",
        ),
        ({"max_in_flight": 0}, "max_in_flight must be an int >= 1, not 0"),
        ({"tokens_per_minute": 0}, "tokens_per_minute must be None or an int >= 1, not 0"),
        ({"timeout": 0}, "timeout must be a positive number of seconds, not 0"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs: dict[str, Any], message: str) -> None:
    base_url = kwargs.pop("base_url", "https://api.example.com")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Transport(base_url, **kwargs)


# -- connection failures and timeouts ------------------------------------------------------


async def test_a_timeout_is_a_retryable_error(nursery: trio.Nursery, autojump_clock: Any) -> None:
    async def never(request: Request, respond: Responder) -> None:
        await trio.sleep_forever()

    server = await start(nursery, never)
    started = trio.current_time()
    async with Transport(server.url, timeout=30) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    assert message_of(excinfo) == (
        f"POST /v1/x to 127.0.0.1:{server.port}: no complete response within 30 seconds "
        "(the transport's timeout)"
    )
    assert excinfo.value.retryable
    assert excinfo.value.status is None
    assert trio.current_time() - started >= 30


async def test_a_finished_requests_deadline_never_cuts_the_next_on_its_connection(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """The timeout is a heap of deadlines that closes an overdue request's connection; the
    entry of a request that finished must not close the connection under a later one."""

    async def answer(request: Request, respond: Responder) -> None:
        if request.target == "/v1/hang":
            await trio.sleep_forever()
        if request.target == "/v1/slow":
            await trio.sleep(6)
        await respond.reply(200, request.body)

    server = await start(nursery, answer)
    async with Transport(server.url, timeout=10, max_in_flight=1) as transport:
        assert (await transport.post("/fast", b"1")).body == b"1"  # its deadline: t=10
        await trio.sleep(8)
        assert (await transport.post("/slow", b"2")).body == b"2"  # from t=8 to t=14
        for _ in range(12):  # past the heap's compaction (4 x max_in_flight entries)
            assert (await transport.post("/fast", b"3")).body == b"3"
        started = trio.current_time()
        with pytest.raises(ProviderError, match="no complete response within 10 seconds"):
            await transport.post("/hang", b"4")
        assert trio.current_time() - started == pytest.approx(10, abs=0.5)
        assert (await transport.post("/fast", b"5")).body == b"5"  # on a new connection
    assert server.connections == 2


async def test_a_request_after_every_deadline_passed_still_times_out(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """Once the heap of deadlines is empty the watcher sleeps with no deadline; the next
    request's deadline must wake it."""

    async def answer(request: Request, respond: Responder) -> None:
        if request.target == "/v1/hang":
            await trio.sleep_forever()
        await respond.reply(200, request.body)

    server = await start(nursery, answer)
    async with Transport(server.url, timeout=5) as transport:
        assert (await transport.post("/fast", b"1")).body == b"1"
        await trio.sleep(60)  # past its deadline: the heap is empty again
        started = trio.current_time()
        with pytest.raises(ProviderError, match="no complete response within 5 seconds"):
            await transport.post("/hang", b"2")
        assert trio.current_time() - started == pytest.approx(5, abs=0.5)


async def test_a_body_larger_than_the_socket_takes_at_once_arrives_whole(
    nursery: trio.Nursery,
) -> None:
    body = bytes(range(256)) * 16384  # 4 MiB: more than one send() hands the kernel

    async def echo(request: Request, respond: Responder) -> None:
        await respond.reply(200, request.body)

    server = await start(nursery, echo)
    async with Transport(server.url) as transport:
        response = await transport.post("/x", body)
    assert server.requests[0].body == body
    assert response.body == body


async def test_the_idle_check_without_poll_finds_a_closed_connection(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where select.poll is missing (Windows), the idle check falls back to select."""
    from interlock.providers import _http

    monkeypatch.setattr(_http, "_HAS_POLL", False)

    async def once(request: Request, respond: Responder) -> None:
        await respond.reply(200, b"{}")
        await respond.stream.aclose()

    server = await start(nursery, once)
    async with Transport(server.url) as transport:
        await transport.post("/x", b"{}")
        await trio.sleep(0.05)
        await transport.post("/x", b"{}")
    assert server.connections == 2


async def test_an_idle_connection_is_checked_with_one_poll_object(nursery: trio.Nursery) -> None:
    server = await start(nursery, ok)
    async with Transport(server.url) as transport:
        for _ in range(3):
            await transport.post("/x", b"{}")
        pool = transport._pool
        assert pool is not None
        (connection,) = pool.idle
        poller = connection.poller
        assert poller is not None
        await transport.post("/x", b"{}")
        assert connection.poller is poller  # made once, on the first reuse
    assert server.connections == 1


async def test_a_connection_dropped_mid_body_is_retryable(nursery: trio.Nursery) -> None:
    async def drop(request: Request, respond: Responder) -> None:
        await respond.raw(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b'{"partial": ')
        await respond.stream.aclose()

    server = await start(nursery, drop)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    assert message_of(excinfo).startswith(
        f"POST /v1/x to 127.0.0.1:{server.port}: closed the connection before the response "
        "was complete (12 of 1000 body bytes received)"
    )
    assert excinfo.value.retryable


async def test_a_reply_that_is_not_http_is_retryable(nursery: trio.Nursery) -> None:
    async def garbage(request: Request, respond: Responder) -> None:
        await respond.raw(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await trio.sleep_forever()

    server = await start(nursery, garbage)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    assert message_of(excinfo).startswith(
        f"POST /v1/x to 127.0.0.1:{server.port}: sent a response that is not valid HTTP/1.1 ("
    )
    assert excinfo.value.retryable


async def test_a_refused_connection_is_retryable() -> None:
    with trio.socket.socket() as sock:  # a port nothing listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with Transport(f"http://127.0.0.1:{port}") as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    assert message_of(excinfo).startswith(f"POST /x to 127.0.0.1:{port}: could not connect (")
    assert excinfo.value.retryable


# -- limits --------------------------------------------------------------------------------


async def test_at_most_max_in_flight_requests_reach_the_server(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    async def slow(request: Request, respond: Responder) -> None:
        await trio.sleep(1)
        await respond.reply(200)

    server = await start(nursery, slow)
    statuses: list[int] = []
    async with Transport(server.url, max_in_flight=3) as transport:

        async def call() -> None:
            statuses.append((await transport.post("/x", b"{}")).status)

        async with trio.open_nursery() as calls:
            for _ in range(20):
                calls.start_soon(call)
    assert statuses == [200] * 20
    assert server.most_in_flight == 3
    assert server.connections == 3


async def test_a_request_cancelled_while_waiting_for_a_slot_takes_none(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    async def slow(request: Request, respond: Responder) -> None:
        await trio.sleep(10)
        await respond.reply(200, request.body)

    server = await start(nursery, slow)
    bodies: list[bytes] = []
    async with Transport(server.url, max_in_flight=1) as transport:

        async def call(body: bytes, patience: float) -> None:
            with trio.move_on_after(patience):
                bodies.append((await transport.post("/x", body)).body)

        async with trio.open_nursery() as calls:
            calls.start_soon(call, b"1", 100)
            await trio.sleep(1)
            calls.start_soon(call, b"2", 2)  # gives up while the first holds the slot
            await trio.sleep(1)
            calls.start_soon(call, b"3", 100)
            await trio.sleep(1)
            calls.start_soon(call, b"4", 100)
    assert bodies == [b"1", b"3", b"4"]  # in the order they asked
    assert [r.body for r in server.requests] == [b"1", b"3", b"4"]
    assert server.most_in_flight == 1


async def test_tokens_per_minute_makes_requests_wait(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    server = await start(nursery, ok)
    started = trio.current_time()
    async with Transport(server.url, tokens_per_minute=600) as transport:
        for _ in range(4):
            await transport.post("/x", b"{}", tokens=300)
        await transport.post("/x", b"{}")  # no estimate: never waits
    waits = [round(t - started, 6) for t in server.arrivals]
    # A full bucket of 600 serves two at once; then 300 tokens refill in 30 seconds.
    assert waits == [0, 0, 30, 60, 60]


async def test_a_request_larger_than_a_minute_waits_for_a_full_bucket(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    server = await start(nursery, ok)
    started = trio.current_time()
    async with Transport(server.url, tokens_per_minute=100) as transport:
        await transport.post("/x", b"{}", tokens=50)
        await transport.post("/x", b"{}", tokens=10_000)
    assert [round(t - started, 6) for t in server.arrivals] == [0, 30]


# -- streams -------------------------------------------------------------------------------

SSE_PIECES = [
    b"\xef\xbb\xbf: a comment, then a BOM-less field\n",
    b"data: one\n\n",
    b"event: delta\r\ndata: two\r\ndata:  three (one space kept)\r\n\r",
    b"\n: CRLF split across chunks above\r",
    b"data\rdata:tight\r\r",
    b"id: 7\nretry: 100\ndata: caf\xc3",
    b"\xa9\n\n",
    b"event: ignored, no data\n\n",
    b"data: never dispatched, no blank line",
]
SSE_EVENTS = [
    SseEvent("", "one"),
    SseEvent("delta", "two\n three (one space kept)"),
    SseEvent("", "\ntight"),
    SseEvent("", "café", "7"),  # the last event id the stream set
]


def test_sse_parsing_follows_the_spec_at_every_split() -> None:
    whole = b"".join(SSE_PIECES)
    assert _parse([whole]) == SSE_EVENTS
    for cut in range(len(whole) + 1):
        assert _parse([whole[:cut], whole[cut:]]) == SSE_EVENTS, cut
    assert _parse([bytes([b]) for b in whole]) == SSE_EVENTS


def _parse(chunks: list[bytes]) -> list[SseEvent]:
    parser = SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


async def test_stream_yields_events_and_reuses_the_connection(nursery: trio.Nursery) -> None:
    async def sse(request: Request, respond: Responder) -> None:
        await respond.start_chunked()
        for piece in SSE_PIECES:
            await respond.chunk(piece)
            await trio.lowlevel.checkpoint()
        await respond.end()

    server = await start(nursery, sse)
    async with Transport(server.url, headers={"authorization": f"Bearer {KEY}"}) as transport:
        for _ in range(2):
            async with transport.stream("/chat/completions", b"{}") as events:
                got = [event async for event in events]
            assert got == SSE_EVENTS
    assert server.requests[0].headers["accept"] == "text/event-stream"
    assert server.connections == 1


async def test_leaving_a_stream_early_closes_its_connection(nursery: trio.Nursery) -> None:
    async def sse(request: Request, respond: Responder) -> None:
        await respond.start_chunked()
        await respond.chunk(b"data: a\n\ndata: b\n\n")
        await trio.sleep(0.2)
        await respond.chunk(b"data: c\n\n")
        await respond.end()

    server = await start(nursery, sse)
    async with Transport(server.url) as transport:
        async with transport.stream("/x", b"{}") as events:
            async for event in events:
                assert event.data == "a"
                break
        async with transport.stream("/x", b"{}") as events:
            assert [event.data async for event in events] == ["a", "b", "c"]
    assert server.connections == 2


async def test_a_stream_error_status_raises_before_any_event(nursery: trio.Nursery) -> None:
    async def busy(request: Request, respond: Responder) -> None:
        await respond.reply(429, b'{"error": {"message": "busy"}}', [("retry-after", "3")])

    server = await start(nursery, busy)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            async with transport.stream("/x", b"{}"):
                raise AssertionError("no events for an error status")
    assert message_of(excinfo) == "POST /v1/x answered HTTP 429: busy"
    assert (excinfo.value.retry_after, excinfo.value.retryable) == (3.0, True)


async def test_a_connection_dropped_mid_stream_is_retryable(nursery: trio.Nursery) -> None:
    async def drop(request: Request, respond: Responder) -> None:
        await respond.start_chunked()
        await respond.chunk(b"data: first\n\n")
        await respond.stream.aclose()  # no terminating chunk

    server = await start(nursery, drop)
    got: list[str] = []
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await _collect(transport, got)
    assert got == ["first"]
    assert message_of(excinfo).startswith(
        f"POST /v1/x to 127.0.0.1:{server.port}: dropped the connection mid-stream ("
    )
    assert excinfo.value.retryable


async def _collect(transport: Transport, got: list[str]) -> None:
    async with transport.stream("/x", b"{}") as events:
        async for event in events:
            got.append(event.data)


async def test_a_stream_that_ends_early_just_ends(nursery: trio.Nursery) -> None:
    async def short(request: Request, respond: Responder) -> None:
        await respond.start_chunked()
        await respond.chunk(b"data: first\n\n")
        await respond.end()  # a clean end, before any [DONE]: the caller judges

    server = await start(nursery, short)
    async with Transport(server.url) as transport, transport.stream("/x", b"{}") as events:
        assert [event.data async for event in events] == ["first"]


async def test_a_stream_times_out_as_a_whole(nursery: trio.Nursery, autojump_clock: Any) -> None:
    async def stall(request: Request, respond: Responder) -> None:
        await respond.start_chunked()
        await respond.chunk(b"data: first\n\n")
        await trio.sleep_forever()

    server = await start(nursery, stall)
    got: list[str] = []
    async with Transport(server.url, timeout=10) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await _collect(transport, got)
    assert got == ["first"]
    assert "no complete response within 10 seconds" in message_of(excinfo)


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 made by the openssl command: (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def _server_context(certificate: tuple[str, str]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    return context


async def test_https_with_the_servers_ca(
    nursery: trio.Nursery, certificate: tuple[str, str]
) -> None:
    server = Server(ok, tls=_server_context(certificate))
    await nursery.start(server.serve)
    trusted = ssl.create_default_context(cafile=certificate[0])
    async with Transport(server.url, ssl_context=trusted) as transport:
        first = await transport.post("/x", b"{}")
        second = await transport.post("/x", b"[1]")
    assert (first.body, second.body) == (b'{"echo": 2}', b'{"echo": 3}')
    assert server.connections == 1


async def test_an_untrusted_certificate_is_not_retryable(
    nursery: trio.Nursery, certificate: tuple[str, str]
) -> None:
    server = Server(ok, tls=_server_context(certificate))
    await nursery.start(server.serve)
    async with Transport(server.url) as transport:
        with pytest.raises(ProviderError) as excinfo:
            await transport.post("/x", b"{}")
    assert message_of(excinfo).startswith(
        f"POST /v1/x: TLS handshake with 127.0.0.1:{server.port} failed "
        "(SSLCertVerificationError: [SSL: CERTIFICATE_VERIFY_FAILED]"
    )
    assert excinfo.value.retryable is False


# -- lifetime ------------------------------------------------------------------------------


def test_a_transport_made_outside_trio_works_across_two_runs() -> None:
    token: list[trio.lowlevel.TrioToken] = []
    ready = threading.Event()
    scope: list[trio.CancelScope] = []
    server = Server(ok)

    async def serve() -> None:
        token.append(trio.lowlevel.current_trio_token())
        with trio.CancelScope() as cancel:
            scope.append(cancel)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve)
                ready.set()
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(serve,))
    thread.start()
    try:
        assert ready.wait(10)
        transport = Transport(server.url)  # no trio run here

        async def call() -> int:
            return (await transport.post("/x", b"{}")).status

        assert trio.run(call) == 200
        assert trio.run(call) == 200
        trio.run(transport.aclose)
    finally:
        trio.from_thread.run_sync(scope[0].cancel, trio_token=token[0])
        thread.join(10)
    assert server.connections == 2  # the second run could not use the first run's socket
