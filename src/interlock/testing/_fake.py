"""A local fake LLM server: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages.

It serves real HTTP/1.1 on a loopback socket (trio, keep-alive, many connections at once)
and answers each request with what a *brain* says: a :class:`Reply` (rendered in the exact wire
format of the API that was called, streamed as Server-Sent Events when the request
says ``"stream": true``), a :class:`Fault` (an HTTP error in the API's error format, a hang, a
dropped connection, a truncated body or stream) or a :class:`Raw` body sent verbatim.

Ids and timestamps are deterministic: every answered request takes the next number of a
counter and every id in its answer derives from that number (``chatcmpl-1``, ``call_1_0``,
``resp_1``, ``fc_1_0``, ``msg_1``, ``toolu_1_0``), so tests can compare whole bodies.

Example::

    async with open_fake_llm(scripted_brain([Reply(calls=[("lookup", '{"id": 7}')])])) as fake:
        client = openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="sk-test")
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, TypeAlias

import msgspec
import trio

from ..providers._http import ChunkedDecoder, head_lines, header_fields

__all__ = [
    "API_PATHS",
    "Brain",
    "FakeLLM",
    "Fault",
    "Raw",
    "RecordedRequest",
    "Reply",
    "ScriptedBrain",
    "open_fake_llm",
    "render_body",
    "scripted_brain",
    "serve_fake_llm",
    "tool_results_of",
    "tools_of",
]

#: The request path of each API the fake serves.
API_PATHS: Mapping[str, str] = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}

#: The fixed ``created`` timestamp of every answer (2026-01-01T00:00:00Z): bodies compare equal.
CREATED = 1767225600

_REDACTED_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "proxy-authorization"})

Arguments: TypeAlias = "str | Mapping[str, Any]"


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """What the model says, rendered in the wire format of the API that was called.

    Attributes:
      calls: the tool calls, each ``(name, arguments)``. ``arguments`` is the exact JSON text
        to send (sent byte for byte: in Chat and Responses as the ``arguments`` string, in
        Messages spliced raw as the ``input`` object); a mapping is encoded to JSON first.
      text: the assistant's text (Chat ``content``, a Responses ``output_text``, a Messages
        ``text`` block).
      finish: ``None`` for the natural reason (``tool_calls`` / ``stop``; ``tool_use`` /
        ``end_turn`` / ``refusal``; Responses status ``completed``); anything else is sent
        verbatim as ``finish_reason`` / ``stop_reason`` / the Responses ``status``, except
        that Responses maps ``length``, ``max_tokens`` and ``incomplete`` to status
        ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``, and
        ``content_filter`` to ``incomplete`` with reason ``content_filter``.
      usage: ``(prompt, completion, cached, reasoning)`` tokens. ``prompt`` is the whole
        input, cached tokens included (Messages sends ``input_tokens = prompt - cached -
        cache_creation``). ``None``: derived from the sizes of the request and the reply.
      cache_creation: Messages' ``cache_creation_input_tokens``.
      refusal: a refusal (Chat ``message.refusal``, a Responses ``refusal`` content part,
        Messages ``stop_reason: "refusal"`` with ``stop_details.explanation``).
      arguments_as_object: quirk of OpenAI-compatible servers (Ollama, vLLM): ``arguments``
        sent as a JSON object, not a string (the text of a str is spliced in raw).
      shared_index: quirk: in a Chat stream every parallel call's deltas carry ``index: 0``.
      tool_calls_empty: quirk: ``finish_reason: "tool_calls"`` (Messages: ``stop_reason:
        "tool_use"``) with ``tool_calls: []``; the calls are not sent.
      tool_calls_missing: the same with no ``tool_calls`` key at all.
      markup_in_content: quirk: each call written as text, ``<tool_call>{"name": ...,
        "arguments": {...}}</tool_call>``, after ``text`` in the content instead of as a call.
      delay: seconds to wait before answering (simulated model latency).
      pace: in a stream, ``None`` writes every event in one write; a number writes each
        event on its own, sleeping that many seconds in between (``0``: separate writes).
    """

    calls: Sequence[tuple[str, Arguments]] = ()
    text: str = ""
    finish: str | None = None
    usage: tuple[int, int, int, int] | None = None
    cache_creation: int = 0
    refusal: str | None = None
    arguments_as_object: bool = False
    shared_index: bool = False
    tool_calls_empty: bool = False
    tool_calls_missing: bool = False
    markup_in_content: bool = False
    delay: float = 0.0
    pace: float | None = None

    def __post_init__(self) -> None:
        for call in self.calls:
            if (
                not isinstance(call, tuple | list)
                or len(call) != 2
                or not isinstance(call[0], str)
                or not isinstance(call[1], str | Mapping)
            ):
                raise TypeError(
                    f"Reply.calls holds (name, arguments) pairs, arguments a JSON string or a "
                    f"mapping; got {call!r}"
                )
        if self.usage is not None and (
            len(self.usage) != 4 or not all(isinstance(n, int) and n >= 0 for n in self.usage)
        ):
            raise ValueError(
                f"Reply.usage is (prompt, completion, cached, reasoning), four counts >= 0; "
                f"got {self.usage!r}"
            )
        if self.tool_calls_empty and self.tool_calls_missing:
            raise ValueError("Reply: choose tool_calls_empty or tool_calls_missing, not both")


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """A failure of the server or the network.

    Attributes:
      status: the HTTP status of an error answer (429, 500, 529, 400, 401...), its body in the
        API's error format: OpenAI ``{"error": {"message", "type", "param", "code"}}``,
        Anthropic ``{"type": "error", "error": {"type", "message"}, "request_id"}``.
      message: the error message (default: one per status).
      error_type: the error's ``type`` (default: the API's type for the status).
      code: OpenAI's error ``code`` (default: one per status, e.g. ``rate_limit_exceeded``).
      retry_after: seconds, sent as the ``Retry-After`` header.
      retry_after_ms: milliseconds, sent as the ``retry-after-ms`` header.
      should_retry: sent as the ``x-should-retry`` header (the official SDKs obey it).
      hang: never answer; the client's timeout must cut the call.
      drop: send the headers and half the body of ``reply``, then close the connection.
      truncate: a well-framed answer that ends early: a stream that stops before its end
        (no ``[DONE]``, no ``message_stop``, no ``response.completed``), or a JSON body cut in
        half (with a matching ``Content-Length``).
      in_stream: to a streaming request, a 200 stream that carries the error after its
        first events, as the APIs do when a failure comes mid-answer (Chat ``data: {"error":
        {...}}``, Responses ``event: error``, Messages ``event: error`` with the error body);
        to any other request, the plain error answer.
      reset: close the connection at once, not a byte sent (what a client sees when a
        server drops a keep-alive connection just as a request goes out).
      reply: the answer that ``drop``, ``truncate`` and ``in_stream`` cut (default: one text
        reply).
    """

    status: int = 500
    message: str | None = None
    error_type: str | None = None
    code: str | None = None
    retry_after: float | None = None
    retry_after_ms: int | None = None
    should_retry: bool | None = None
    hang: bool = False
    drop: bool = False
    truncate: bool = False
    in_stream: bool = False
    reset: bool = False
    reply: Reply | None = None

    def __post_init__(self) -> None:
        if self.hang + self.drop + self.truncate + self.in_stream + self.reset > 1:
            raise ValueError(
                "Fault: choose at most one of hang, drop, truncate, in_stream and reset"
            )
        if (
            not (self.hang or self.drop or self.truncate or self.reset)
            and not 400 <= self.status <= 599
        ):
            raise ValueError(
                f"Fault.status must be an HTTP error status (400-599); got {self.status}"
            )


class Raw(msgspec.Struct, frozen=True, kw_only=True):
    """An answer sent exactly as given: any status, any bytes (e.g. a malformed body).

    Attributes:
      body: the body, byte for byte (for ``text/event-stream``, the whole stream).
      status: the HTTP status.
      content_type: the ``Content-Type`` header.
      headers: more headers, ``(name, value)`` pairs.
    """

    body: bytes
    status: int = 200
    content_type: str = "application/json"
    headers: Sequence[tuple[str, str]] = ()


class RecordedRequest(msgspec.Struct, frozen=True):
    """One request as the fake received it.

    Attributes:
      api: ``"chat"``, ``"responses"``, ``"messages"`` (or ``"other"`` for an unknown path).
      path: the request target, query string included.
      headers: lower-case names; ``authorization``, ``x-api-key`` and ``api-key`` values are
        ``"REDACTED"``.
      body: the parsed JSON body (``None`` if it was not JSON).
    """

    api: str
    path: str
    headers: dict[str, str]
    body: Any


#: ``brain(api, body, headers) -> Reply | Fault | Raw``: what to answer. ``api`` is
#: ``"chat"``, ``"responses"`` or ``"messages"``; ``headers`` have lower-case names. It may
#: also be an ``async`` function.
Brain: TypeAlias = Callable[[str, dict[str, Any], Mapping[str, str]], Any]


class ScriptedBrain:
    """A brain that answers with ``replies`` in order, whatever the request.

    When they run out, it answers 500 with ``scripted brain: no reply left after N``.
    ``served`` counts the replies given.
    """

    def __init__(self, replies: Sequence[Reply | Fault | Raw]) -> None:
        for reply in replies:
            if not isinstance(reply, Reply | Fault | Raw):
                raise TypeError(f"scripted_brain takes Reply, Fault or Raw items; got {reply!r}")
        self._replies = list(replies)
        self.served = 0

    def __call__(
        self, api: str, body: dict[str, Any], headers: Mapping[str, str]
    ) -> Reply | Fault | Raw:
        if self.served >= len(self._replies):
            return Fault(
                status=500, message=f"scripted brain: no reply left after {len(self._replies)}"
            )
        reply = self._replies[self.served]
        self.served += 1
        return reply


def scripted_brain(replies: Sequence[Reply | Fault | Raw]) -> ScriptedBrain:
    """A brain answering ``replies`` in order (see :class:`ScriptedBrain`)."""
    return ScriptedBrain(replies)


def tools_of(api: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The tools a request offers, ``name -> JSON Schema of its arguments``, for any API.

    For brains that answer from the request (e.g. pick one of a ``transition`` tool's
    ``next`` values).
    """
    out: dict[str, Any] = {}
    for tool in body.get("tools") or ():
        if not isinstance(tool, Mapping):
            continue
        if api == "chat":
            function = tool.get("function") or {}
            out[function.get("name")] = function.get("parameters", {})
        elif api == "responses":
            out[tool.get("name")] = tool.get("parameters", {})
        else:
            out[tool.get("name")] = tool.get("input_schema", {})
    return out


def tool_results_of(api: str, body: Mapping[str, Any]) -> list[tuple[str, Any, bool | None]]:
    """The tool results in a request's conversation, in order: ``(call id, content,
    is_error)``; ``is_error`` is ``None`` where the API has no such field (OpenAI)."""
    out: list[tuple[str, Any, bool | None]] = []
    if api == "chat":
        for m in body.get("messages") or ():
            if isinstance(m, Mapping) and m.get("role") == "tool":
                out.append((m.get("tool_call_id"), m.get("content"), None))
    elif api == "responses":
        items = body.get("input")
        for item in items if isinstance(items, list) else ():
            if isinstance(item, Mapping) and item.get("type") == "function_call_output":
                out.append((item.get("call_id"), item.get("output"), None))
    else:
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, Mapping) else None
            for block in content if isinstance(content, list) else ():
                if isinstance(block, Mapping) and block.get("type") == "tool_result":
                    out.append(
                        (
                            block.get("tool_use_id"),
                            block.get("content"),
                            bool(block.get("is_error")),
                        )
                    )
    return out


def render_body(
    api: str,
    reply: Reply,
    *,
    body: Mapping[str, Any] | None = None,
    n: int = 1,
    stream: bool = False,
) -> bytes:
    """The exact bytes the server would send for ``reply`` to request number ``n``: the JSON
    body, or with ``stream=True`` the whole SSE stream (no HTTP framing). For benchmarks that
    decode a body with no network, and fixtures.

    Args:
      api: ``"chat"``, ``"responses"`` or ``"messages"``.
      body: the request (its ``model``, ``tools``, ``stream_options``...); default ``{}``.
        A reply with ``usage=None`` derives its usage from the size of ``body`` as msgspec
        encodes it, which can differ from the bytes a client sent.
    """
    if api not in API_PATHS:
        raise ValueError(f"unknown api {api!r}; use one of {', '.join(API_PATHS)}")
    request = dict(body or {})
    size = len(_encode(request))
    if stream:
        return b"".join(_STREAMERS[api](reply, request, n, size))
    return _encode(_RENDERERS[api](reply, request, n, size))


class FakeLLM:
    """A running fake server (what :func:`serve_fake_llm` starts).

    Attributes:
      url: ``http://HOST:PORT``.
      openai_base_url: ``url + "/v1"``, the ``base_url`` of an OpenAI client.
      anthropic_base_url: ``url``, the ``base_url`` of an Anthropic client.
      requests: every request received, in order, as :class:`RecordedRequest` (empty when
        started with ``record=False``).
      count: the number of requests received.
      errors: exceptions the brain raised (each was answered with a 500).
    """

    def __init__(self, host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        self.host = host
        self.port = port
        self.url = f"http://{shown}:{port}"
        self.openai_base_url = self.url + "/v1"
        self.anthropic_base_url = self.url
        self.requests: list[RecordedRequest] = []
        self.count = 0
        self.errors: list[BaseException] = []

    def __repr__(self) -> str:
        return f"<FakeLLM {self.url} requests={self.count}>"


async def serve_fake_llm(
    brain: Brain,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    record: bool = True,
    validate: bool = True,
    task_status: trio.TaskStatus[FakeLLM] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the fake LLM APIs until cancelled.

    Use with ``fake = await nursery.start(serve_fake_llm, brain)``.

    Args:
      brain: ``brain(api, body, headers) -> Reply | Fault | Raw`` (see :data:`Brain`).
      host: the address to listen on.
      port: the port; ``0`` picks a free one (read it from ``FakeLLM.url``).
      record: keep every request in ``FakeLLM.requests`` (turn off for long benchmarks).
      validate: answer 400, as the real APIs do, to requests missing ``model``, ``messages``,
        ``input`` or ``max_tokens``, and to conversations whose tool calls and tool results
        do not pair up (the brain is not asked).
      task_status: receives the :class:`FakeLLM`.
    """
    if not callable(brain):
        raise TypeError(
            f"serve_fake_llm needs a brain function (api, body, headers); got {brain!r}"
        )
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0:
        listeners = listeners[:1]  # a name with several addresses would get several ports
    bound_port = listeners[0].socket.getsockname()[1]
    fake = FakeLLM(host, bound_port)
    server = _Server(brain, fake, record=record, validate=validate)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, server.handle, listeners)
        task_status.started(fake)


@asynccontextmanager
async def open_fake_llm(
    brain: Brain,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    record: bool = True,
    validate: bool = True,
) -> AsyncIterator[FakeLLM]:
    """Run the fake server for the duration of an ``async with`` block."""
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        fake = await nursery.start(
            _serve_kw, brain, {"host": host, "port": port, "record": record, "validate": validate}
        )
        try:
            yield fake
        except BaseException as exc:  # raised by the body: re-raised as is, not in a group
            error = exc
        finally:
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error


async def _serve_kw(
    brain: Brain, kwargs: dict[str, Any], task_status: trio.TaskStatus[FakeLLM]
) -> None:
    await serve_fake_llm(brain, task_status=task_status, **kwargs)


# --- the HTTP side --------------------------------------------------------------------------
#
# A lean HTTP/1.1 server of its own, not hypercorn (which serves the gateway), for two reasons:
# - Fault(reset=True) closes the connection before a byte of an answer, with a pipelined
#   request unread: raw control of the socket, which an ASGI app never has (an app that
#   raises before it starts its answer gets a 500 from the server, not a reset); and
#   Fault(drop=True) ends a response mid-body on purpose, which an ASGI server reports as
#   the app's crash.
# - Cost: the fake is the server of the provider benchmarks (bench_providers, in a process
#   beside the runtime on the same cores), so its CPU is the benchmark's noise floor. Driven
#   by the providers' Transport at 200 concurrent requests, client and server in one
#   process, this server and the client cost 131-145 µs of CPU per request together; the
#   same JSON answer from a bare ASGI app on hypercorn (trio) 719-833 µs, 5-6x
#   (``python -m benchmarks.fake_server``; benchmarks/RESULTS.md, "HTTP/1.1 clients").
# It handles what HTTP clients send: keep-alive (HTTP/1.1 by default, HTTP/1.0 on request),
# Content-Length and chunked request bodies, ``Expect: 100-continue``, pipelining; anything
# malformed is a 400 and a closed connection. The header fields and the chunked coding are
# parsed by the providers' HTTP/1.1 code (``interlock.providers._http``): one parser for
# both sides.

_ROUTES = {path: api for api, path in API_PATHS.items()}
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus} | {529: b"Overloaded"}


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "target", "version")

    def __init__(
        self, method: str, target: str, version: str, headers: dict[str, str], body: bytes
    ) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.body = body
        connection = headers.get("connection", "").lower()
        if version == "HTTP/1.1":
            self.keep_alive = "close" not in connection
        else:
            self.keep_alive = "keep-alive" in connection


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    try:
        request_line, *_ = lines = head_lines(head)
        method, target, version = request_line.split(" ")
    except ValueError:
        raise _BadRequest(400, "malformed request line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0") or not method.isalpha() or not target:
        raise _BadRequest(400, f"unsupported request line {request_line[:80]!r}")
    try:
        return method, target, version, header_fields(lines)
    except ValueError as exc:
        raise _BadRequest(400, str(exc)) from None


class _Connection:
    """One client connection: reads requests, writes answers."""

    __slots__ = ("buf", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError
        self.buf += data

    async def read_request(self) -> _Request:
        buf = self.buf
        while True:
            while buf[:2] == b"\r\n":
                del buf[:2]  # blank lines before a request are ignored (RFC 9112 2.2)
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > _MAX_HEAD:
                raise _BadRequest(431, "request headers too large")
            await self.fill()
        method, target, version, headers = _parse_head(bytes(buf[:end]))
        del buf[: end + 4]
        if headers.get("expect", "").lower() == "100-continue":
            await self.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "transfer-encoding" in headers:
            if headers["transfer-encoding"].lower() != "chunked" or "content-length" in headers:
                raise _BadRequest(400, "unsupported transfer-encoding")
            body = await self.read_chunked()
        else:
            length_text = headers.get("content-length", "0")
            if not length_text.isdigit():
                raise _BadRequest(400, f"bad content-length {length_text[:40]!r}")
            length = int(length_text)
            if length > _MAX_BODY:
                raise _BadRequest(413, "request body too large")
            while len(buf) < length:
                await self.fill()
            body = bytes(buf[:length])
            del buf[:length]
        return _Request(method, target, version, headers, body)

    async def read_chunked(self) -> bytes:
        decoder = ChunkedDecoder()
        parts: list[bytes] = []
        total = 0
        while True:
            try:
                pieces, done = decoder.take(self.buf)
            except ValueError as exc:
                raise _BadRequest(400, f"bad chunked body: {exc}") from None
            parts += pieces
            total += sum(map(len, pieces))
            if total > _MAX_BODY:
                raise _BadRequest(413, "request body too large")
            if done:
                return b"".join(parts)
            await self.fill()


def _head(
    status: int,
    content_type: bytes,
    length: int | None,
    extra: Sequence[tuple[bytes, bytes]],
    keep_alive: bool,
) -> bytes:
    lines = [
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n"
        % (status, _REASONS.get(status, b""), content_type)
    ]
    if length is None:
        lines.append(b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n")
    else:
        lines.append(b"content-length: %d\r\n" % length)
    for name, value in extra:
        lines.append(name + b": " + value + b"\r\n")
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Server:
    def __init__(self, brain: Brain, fake: FakeLLM, *, record: bool, validate: bool) -> None:
        self.brain = brain
        self.fake = fake
        self.record = record
        self.validate = validate
        self.seq = itertools.count(1)

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = _Connection(stream)
        try:
            while True:
                request = await conn.read_request()
                if not await self.answer(stream, request) or not request.keep_alive:
                    return
        except _BadRequest as exc:
            error = {
                "error": {
                    "message": f"bad request: {exc}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
            body = _encode(error)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(_head(exc.status, _JSON, len(body), (), False) + body)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def answer(self, stream: trio.SocketStream, request: _Request) -> bool:
        """Answer one request; False if the connection must close afterwards."""
        target = request.target
        path = target.split("?", 1)[0]
        api = _ROUTES.get(path)
        headers = request.headers
        raw = request.body
        keep = request.keep_alive
        fake = self.fake
        fake.count += 1
        try:
            body = _decode(raw) if raw else None
        except msgspec.DecodeError:
            body = None
            bad_json = True
        else:
            bad_json = False
        if self.record:
            logged = {k: ("REDACTED" if k in _REDACTED_HEADERS else v) for k, v in headers.items()}
            fake.requests.append(RecordedRequest(api or "other", target, logged, body))
        n = next(self.seq)
        if api is None:
            if request.method == "GET" and path == "/v1/models":
                listing = {
                    "object": "list",
                    "data": [
                        {
                            "id": "fake-model",
                            "object": "model",
                            "created": CREATED,
                            "owned_by": "interlock",
                        }
                    ],
                }
                payload = _encode(listing)
                await stream.send_all(_head(200, _JSON, len(payload), (), keep) + payload)
                return True
            flavour = "messages" if "anthropic-version" in headers else "chat"
            fault = Fault(status=404, message=f"Invalid URL ({request.method} {path})")
            await self.send_error(stream, flavour, n, fault, keep)
            return True
        if request.method != "POST":
            fault = Fault(status=405, message=f"Invalid method for URL ({request.method} {path})")
            await self.send_error(stream, api, n, fault, keep)
            return True
        if bad_json or not isinstance(body, dict):
            message = (
                "We could not parse the JSON body of your request. (HINT: This likely means "
                "you aren't using your HTTP library correctly. The OpenAI API expects a JSON "
                "payload, but what was sent was not valid JSON.)"
                if api != "messages"
                else "There was an issue with your request body: the body is not a JSON object"
            )
            await self.send_error(stream, api, n, Fault(status=400, message=message), keep)
            return True
        if self.validate:
            problem = _VALIDATORS[api](body)
            if problem is not None:
                await self.send_error(stream, api, n, Fault(status=400, message=problem), keep)
                return True
        try:
            answer = self.brain(api, body, headers)
            if inspect.isawaitable(answer):
                answer = await answer
        except Exception as exc:
            fake.errors.append(exc)
            fault = Fault(status=500, message=f"fake llm brain raised {type(exc).__name__}: {exc}")
            await self.send_error(stream, api, n, fault, keep)
            return True
        stream_mode = body.get("stream") is True
        if isinstance(answer, Reply):
            if answer.delay > 0:
                await trio.sleep(answer.delay)
            if stream_mode:
                events = _STREAMERS[api](answer, body, n, len(raw))
                await _send_stream(stream, api, n, events, answer.pace, keep)
            else:
                payload = _encode(_RENDERERS[api](answer, body, n, len(raw)))
                await stream.send_all(
                    _head(200, _JSON, len(payload), _id_header(api, n), keep) + payload
                )
            return True
        if isinstance(answer, Fault):
            return await self.send_fault(stream, api, n, body, len(raw), answer, stream_mode, keep)
        if isinstance(answer, Raw):
            extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
            content_type = answer.content_type.encode("latin-1")
            await stream.send_all(
                _head(answer.status, content_type, len(answer.body), extra, keep) + answer.body
            )
            return True
        message = f"fake llm brain must return Reply, Fault or Raw; got {answer!r}"
        fake.errors.append(TypeError(message))
        await self.send_error(stream, api, n, Fault(status=500, message=message), keep)
        return True

    async def send_error(
        self, stream: trio.SocketStream, api: str, n: int, fault: Fault, keep: bool
    ) -> None:
        headers = list(_id_header(api, n))
        if fault.retry_after is not None:
            value = float(fault.retry_after)
            headers.append(
                (b"retry-after", (str(int(value)) if value.is_integer() else repr(value)).encode())
            )
        if fault.retry_after_ms is not None:
            headers.append((b"retry-after-ms", b"%d" % fault.retry_after_ms))
        if fault.should_retry is not None:
            headers.append((b"x-should-retry", b"true" if fault.should_retry else b"false"))
        payload = _error_body(api, n, fault)
        await stream.send_all(_head(fault.status, _JSON, len(payload), headers, keep) + payload)

    async def send_fault(
        self,
        stream: trio.SocketStream,
        api: str,
        n: int,
        body: dict[str, Any],
        size: int,
        fault: Fault,
        stream_mode: bool,
        keep: bool,
    ) -> bool:
        if fault.hang:
            await _wait_for_close(stream)
            return False
        if fault.reset:
            return False
        if not (fault.drop or fault.truncate or (fault.in_stream and stream_mode)):
            await self.send_error(stream, api, n, fault, keep)
            return True
        reply = fault.reply or Reply(text="This answer is cut short by a fault.")
        if stream_mode:
            if fault.in_stream:
                events = _STREAMERS[api](reply, body, n, size)
                kept = events[: max(1, len(events) // 2)]
                await _send_stream(
                    stream, api, n, [*kept, _stream_error(api, n, fault, len(kept))], None, keep
                )
                return True
            events = _STREAMERS[api](reply, body, n, size)
            if fault.truncate:
                cut = max(1, min(len(events) - 2, len(events) * 2 // 3))
                await _send_stream(stream, api, n, events[:cut], None, keep)
                return True
            # drop: half the events, then the connection closes with no last chunk
            half = events[: max(1, len(events) // 2)]
            head = _head(200, _SSE, None, _id_header(api, n), True)
            await stream.send_all(head + b"".join(_chunk(e) for e in half))
            return False
        whole = _encode(_RENDERERS[api](reply, body, n, size))
        half = whole[: len(whole) // 2]
        if fault.truncate:
            await stream.send_all(_head(200, _JSON, len(half), _id_header(api, n), keep) + half)
            return True
        await stream.send_all(_head(200, _JSON, len(whole), _id_header(api, n), True) + half)
        return False


async def _wait_for_close(stream: trio.SocketStream) -> None:
    while await stream.receive_some(65536):
        pass


def _id_header(api: str, n: int) -> tuple[tuple[bytes, bytes], ...]:
    name = b"request-id" if api == "messages" else b"x-request-id"
    return ((name, b"req_%d" % n),)


async def _send_stream(
    stream: trio.SocketStream,
    api: str,
    n: int,
    events: list[bytes],
    pace: float | None,
    keep: bool,
) -> None:
    head = _head(200, _SSE, None, _id_header(api, n), keep)
    if pace is None:
        await stream.send_all(head + b"".join([_chunk(e) for e in events]) + b"0\r\n\r\n")
        return
    await stream.send_all(head)
    for e in events:
        await stream.send_all(_chunk(e))
        if pace > 0:
            await trio.sleep(pace)
    await stream.send_all(b"0\r\n\r\n")


# --- errors ---------------------------------------------------------------------------------

_OPENAI_ERRORS = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("invalid_request_error", "unsupported_country_region_territory", "Forbidden."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    405: ("invalid_request_error", None, "Method not allowed."),
    409: ("invalid_request_error", None, "Conflict."),
    413: ("invalid_request_error", None, "Request too large."),
    422: ("invalid_request_error", None, "Unprocessable entity."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests."),
    500: ("server_error", None, "The server had an error while processing your request."),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
    504: ("server_error", None, "Gateway timeout."),
}
_ANTHROPIC_ERRORS = {
    400: ("invalid_request_error", "Invalid request."),
    401: ("authentication_error", "invalid x-api-key"),
    403: ("permission_error", "Your API key does not have permission to use this resource."),
    404: ("not_found_error", "Not found."),
    405: ("invalid_request_error", "Method not allowed."),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: ("rate_limit_error", "Number of requests has exceeded your rate limit."),
    500: ("api_error", "Internal server error"),
    504: ("timeout_error", "Request timed out."),
    529: ("overloaded_error", "Overloaded"),
}


def _error_body(api: str, n: int, fault: Fault) -> bytes:
    status = fault.status
    if api == "messages":
        etype, default = _ANTHROPIC_ERRORS.get(status, ("api_error", f"HTTP {status}"))
        return _encode(
            {
                "type": "error",
                "error": {"type": fault.error_type or etype, "message": fault.message or default},
                "request_id": f"req_{n}",
            }
        )
    etype2, code, default2 = _OPENAI_ERRORS.get(status, ("server_error", None, f"HTTP {status}"))
    return _encode(
        {
            "error": {
                "message": fault.message or default2,
                "type": fault.error_type or etype2,
                "param": None,
                "code": fault.code if fault.code is not None else code,
            }
        }
    )


def _stream_error(api: str, n: int, fault: Fault, seq: int) -> bytes:
    """The error event of a stream that fails mid-answer, in the API's format."""
    error = msgspec.json.decode(_error_body(api, n, fault))
    if api == "chat":
        return b"data: " + _encode(error) + b"\n\n"
    if api == "responses":
        inner = error["error"]
        data = {
            "type": "error",
            "code": inner["code"] or inner["type"],
            "message": inner["message"],
            "param": None,
            "sequence_number": seq,
        }
        return b"event: error\ndata: " + _encode(data) + b"\n\n"
    return b"event: error\ndata: " + _encode(error) + b"\n\n"


# --- request validation (what the real APIs refuse with 400) ---------------------------------


def _check_chat(body: dict[str, Any]) -> str | None:
    if not isinstance(body.get("model"), str):
        return "you must provide a model parameter"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "Missing required parameter: 'messages'."
    pending: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            return f"Invalid type for 'messages[{i}]': expected an object with a 'role'."
        role = m["role"]
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid not in pending:
                return (
                    f"Invalid parameter: messages with role 'tool' must be a response to a "
                    f"preceeding message with 'tool_calls'. (messages[{i}], tool_call_id {tid!r})"
                )
            pending.remove(tid)
            continue
        if pending:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(pending)}"
            )
        if role == "assistant":
            for call in m.get("tool_calls") or ():
                if isinstance(call, dict):
                    pending.append(call.get("id"))
    if pending:
        return (
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            f"response messages: {', '.join(map(str, pending))}"
        )
    return None


def _check_responses(body: dict[str, Any]) -> str | None:
    if not isinstance(body.get("model"), str):
        return "Missing required parameter: 'model'."
    items = body.get("input")
    if isinstance(items, str):
        return None
    if not isinstance(items, list):
        return "Missing required parameter: 'input'."
    if body.get("previous_response_id") is not None:
        return None  # the calls answered may live in the previous response, server-side
    calls: set[Any] = set()
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "function_call":
            calls.add(item.get("call_id"))
        elif kind == "function_call_output" and item.get("call_id") not in calls:
            return (
                f"No tool call found for function call output with call_id {item.get('call_id')}."
            )
    return None


def _check_messages(body: dict[str, Any]) -> str | None:
    if not isinstance(body.get("model"), str):
        return "model: Field required"
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return "max_tokens: Field required (an integer >= 1)"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "messages: Field required"
    uses: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        content = m.get("content")
        blocks = content if isinstance(content, list) else ()
        if m["role"] == "user":
            results = [
                b.get("tool_use_id")
                for b in blocks
                if isinstance(b, dict) and b.get("type") == "tool_result"
            ]
            for j, rid in enumerate(results):
                if rid not in uses:
                    return (
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {rid}. Each `tool_result` block must have a "
                        f"corresponding `tool_use` block in the previous message."
                    )
            missing = [u for u in uses if u not in results]
            if missing:
                return (
                    f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                    f"corresponding `tool_result` block in the next message."
                )
            uses = []
        else:
            if uses:
                return (
                    f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(uses)}. Each `tool_use` block must have a "
                    f"corresponding `tool_result` block in the next message."
                )
            uses = [
                b.get("id") for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"
            ]
    if uses:
        # the last message is an assistant turn with tool_use: a prefill, which the API allows
        pass
    return None


_VALIDATORS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "chat": _check_chat,
    "responses": _check_responses,
    "messages": _check_messages,
}


# --- rendering: shared pieces ----------------------------------------------------------------


def _args_text(arguments: Arguments) -> str:
    if isinstance(arguments, str):
        return arguments
    return _encode(dict(arguments)).decode()


def _args_object(arguments: Arguments) -> Any:
    """``arguments`` as a JSON object in the body: a str is spliced in raw."""
    if isinstance(arguments, str):
        return msgspec.Raw(arguments.encode())
    return dict(arguments)


def _markup(reply: Reply) -> str:
    parts = [reply.text]
    for name, arguments in reply.calls:
        parts.append(
            '<tool_call>{"name": '
            + _encode(name).decode()
            + ', "arguments": '
            + _args_text(arguments)
            + "}</tool_call>"
        )
    return "".join(parts)


def _usage(reply: Reply, size: int) -> tuple[int, int, int, int]:
    if reply.usage is not None:
        return reply.usage
    out = len(reply.text) + sum(len(_args_text(a)) for _, a in reply.calls)
    out += len(reply.refusal or "")
    return (size // 4 + 1, out // 4 + 1, 0, 0)


def _split(text: str, parts: int = 3) -> list[str]:
    """``text`` in up to ``parts`` pieces (a stream sends arguments over several chunks)."""
    if len(text) <= 1:
        return [text]
    step = math.ceil(len(text) / min(parts, len(text)))
    return [text[i : i + step] for i in range(0, len(text), step)]


def _content_text(reply: Reply) -> str:
    return _markup(reply) if reply.markup_in_content else reply.text


def _sent_calls(reply: Reply) -> Sequence[tuple[str, Arguments]]:
    if reply.markup_in_content or reply.tool_calls_empty or reply.tool_calls_missing:
        return ()
    return reply.calls


# --- Chat Completions ------------------------------------------------------------------------


def _chat_finish(reply: Reply) -> str:
    if reply.finish is not None:
        return reply.finish
    if reply.tool_calls_empty or reply.tool_calls_missing or _sent_calls(reply):
        return "tool_calls"
    return "stop"


def _chat_usage(reply: Reply, size: int) -> dict[str, Any]:
    prompt, completion, cached, reasoning = _usage(reply, size)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _chat_function(reply: Reply, arguments: Arguments) -> Any:
    return _args_object(arguments) if reply.arguments_as_object else _args_text(arguments)


def _render_chat(reply: Reply, body: dict[str, Any], n: int, size: int) -> dict[str, Any]:
    text = _content_text(reply)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if text or (reply.refusal is None and not _sent_calls(reply)) else None,
        "refusal": reply.refusal,
        "annotations": [],
    }
    calls = _sent_calls(reply)
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{n}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": _chat_function(reply, arguments)},
            }
            for i, (name, arguments) in enumerate(calls)
        ]
    elif reply.tool_calls_empty:
        message["tool_calls"] = []
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": CREATED,
        "model": body.get("model", "fake-model"),
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": _chat_finish(reply)}
        ],
        "usage": _chat_usage(reply, size),
        "service_tier": "default",
        "system_fingerprint": "fp_fake",
    }


def _stream_chat(reply: Reply, body: dict[str, Any], n: int, size: int) -> list[bytes]:
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    base: dict[str, Any] = {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": body.get("model", "fake-model"),
        "service_tier": "default",
        "system_fingerprint": "fp_fake",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = dict(
            base, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        )
        if include_usage:
            data["usage"] = None
        return b"data: " + _encode(data) + b"\n\n"

    text = _content_text(reply)
    events = [chunk({"role": "assistant", "content": "" if text else None, "refusal": None})]
    for piece in _split(text) if text else ():
        events.append(chunk({"content": piece}))
    for piece in _split(reply.refusal) if reply.refusal else ():
        events.append(chunk({"refusal": piece}))
    for i, (name, arguments) in enumerate(_sent_calls(reply)):
        index = 0 if reply.shared_index else i
        head = {"index": index, "id": f"call_{n}_{i}", "type": "function"}
        if reply.arguments_as_object:
            head["function"] = {"name": name, "arguments": _args_object(arguments)}
            events.append(chunk({"tool_calls": [head]}))
            continue
        head["function"] = {"name": name, "arguments": ""}
        events.append(chunk({"tool_calls": [head]}))
        for piece in _split(_args_text(arguments)):
            events.append(
                chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            )
    if reply.tool_calls_empty:
        events.append(chunk({"tool_calls": []}))
    events.append(chunk({}, _chat_finish(reply)))
    if include_usage:
        events.append(
            b"data: " + _encode(dict(base, choices=[], usage=_chat_usage(reply, size))) + b"\n\n"
        )
    events.append(b"data: [DONE]\n\n")
    return events


# --- Responses -------------------------------------------------------------------------------


def _responses_status(reply: Reply) -> tuple[str, dict[str, str] | None]:
    finish = reply.finish
    if finish is None:
        return "completed", None
    if finish in ("length", "max_tokens", "incomplete", "max_output_tokens"):
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return finish, None


def _responses_usage(reply: Reply, size: int) -> dict[str, Any]:
    prompt, completion, cached, reasoning = _usage(reply, size)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _responses_items(reply: Reply, n: int, status: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    text = _content_text(reply)
    item_status = "completed" if status == "completed" else "incomplete"
    if text or reply.refusal is not None:
        content: list[dict[str, Any]] = []
        if text:
            content.append({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
        if reply.refusal is not None:
            content.append({"type": "refusal", "refusal": reply.refusal})
        items.append(
            {
                "id": f"msg_{n}",
                "type": "message",
                "status": item_status,
                "role": "assistant",
                "content": content,
            }
        )
    for i, (name, arguments) in enumerate(_sent_calls(reply)):
        items.append(
            {
                "id": f"fc_{n}_{i}",
                "type": "function_call",
                "status": "completed",
                "call_id": f"call_{n}_{i}",
                "name": name,
                "arguments": _chat_function(reply, arguments),
            }
        )
    return items


def _response_object(
    body: dict[str, Any], n: int, status: str, incomplete: Any, output: list[Any], usage: Any
) -> dict[str, Any]:
    return {
        "id": f"resp_{n}",
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model", "fake-model"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text", {"format": {"type": "text"}}),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": body.get("metadata", {}),
    }


def _render_responses(reply: Reply, body: dict[str, Any], n: int, size: int) -> dict[str, Any]:
    status, incomplete = _responses_status(reply)
    return _response_object(
        body,
        n,
        status,
        incomplete,
        _responses_items(reply, n, status),
        _responses_usage(reply, size),
    )


def _stream_responses(reply: Reply, body: dict[str, Any], n: int, size: int) -> list[bytes]:
    events: list[bytes] = []

    def event(kind: str, **data: Any) -> None:
        data = {"type": kind, "sequence_number": len(events), **data}
        events.append(b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n")

    status, incomplete = _responses_status(reply)
    items = _responses_items(reply, n, status)
    start = _response_object(body, n, "in_progress", None, [], None)
    event("response.created", response=start)
    event("response.in_progress", response=start)
    for index, item in enumerate(items):
        item_id = item["id"]
        if item["type"] == "message":
            event(
                "response.output_item.added",
                output_index=index,
                item=dict(item, status="in_progress", content=[]),
            )
            for c, part in enumerate(item["content"]):
                if part["type"] == "output_text":
                    empty = dict(part, text="")
                    event(
                        "response.content_part.added",
                        item_id=item_id,
                        output_index=index,
                        content_index=c,
                        part=empty,
                    )
                    for piece in _split(part["text"]):
                        event(
                            "response.output_text.delta",
                            item_id=item_id,
                            output_index=index,
                            content_index=c,
                            delta=piece,
                            logprobs=[],
                        )
                    event(
                        "response.output_text.done",
                        item_id=item_id,
                        output_index=index,
                        content_index=c,
                        text=part["text"],
                        logprobs=[],
                    )
                else:
                    empty = dict(part, refusal="")
                    event(
                        "response.content_part.added",
                        item_id=item_id,
                        output_index=index,
                        content_index=c,
                        part=empty,
                    )
                    for piece in _split(part["refusal"]):
                        event(
                            "response.refusal.delta",
                            item_id=item_id,
                            output_index=index,
                            content_index=c,
                            delta=piece,
                        )
                    event(
                        "response.refusal.done",
                        item_id=item_id,
                        output_index=index,
                        content_index=c,
                        refusal=part["refusal"],
                    )
                event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=c,
                    part=part,
                )
        else:
            arguments = item["arguments"]
            if isinstance(arguments, str):
                event(
                    "response.output_item.added",
                    output_index=index,
                    item=dict(item, status="in_progress", arguments=""),
                )
                for piece in _split(arguments):
                    event(
                        "response.function_call_arguments.delta",
                        item_id=item_id,
                        output_index=index,
                        delta=piece,
                    )
                event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    name=item["name"],
                    arguments=arguments,
                )
            else:  # the arguments-as-object quirk: no deltas, the object in the items
                event(
                    "response.output_item.added",
                    output_index=index,
                    item=dict(item, status="in_progress"),
                )
        event("response.output_item.done", output_index=index, item=item)
    final = _response_object(body, n, status, incomplete, items, _responses_usage(reply, size))
    event("response.incomplete" if status == "incomplete" else "response.completed", response=final)
    return events


# --- Anthropic Messages ----------------------------------------------------------------------


def _messages_stop(reply: Reply) -> str:
    if reply.finish is not None:
        return reply.finish
    if reply.refusal is not None:
        return "refusal"
    if reply.tool_calls_empty or reply.tool_calls_missing or _sent_calls(reply):
        return "tool_use"
    return "end_turn"


def _messages_usage(reply: Reply, size: int) -> dict[str, Any]:
    prompt, completion, cached, _reasoning = _usage(reply, size)
    return {
        "input_tokens": max(0, prompt - cached - reply.cache_creation),
        "cache_creation_input_tokens": reply.cache_creation,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
        "service_tier": "standard",
    }


def _messages_blocks(reply: Reply, n: int) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    text = _content_text(reply)
    if text:
        blocks.append({"type": "text", "text": text})
    for i, (name, arguments) in enumerate(_sent_calls(reply)):
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_{n}_{i}",
                "name": name,
                "input": _args_object(arguments),
            }
        )
    return blocks


def _message_object(
    reply: Reply, body: dict[str, Any], n: int, content: list[Any], stop: str | None, usage: Any
) -> dict[str, Any]:
    message = {
        "id": f"msg_{n}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "fake-model"),
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }
    if stop == "refusal" and reply.refusal is not None:
        message["stop_details"] = {
            "type": "refusal",
            "category": None,
            "explanation": reply.refusal,
        }
    return message


def _render_messages(reply: Reply, body: dict[str, Any], n: int, size: int) -> dict[str, Any]:
    return _message_object(
        reply,
        body,
        n,
        _messages_blocks(reply, n),
        _messages_stop(reply),
        _messages_usage(reply, size),
    )


def _stream_messages(reply: Reply, body: dict[str, Any], n: int, size: int) -> list[bytes]:
    events: list[bytes] = []

    def event(kind: str, **data: Any) -> None:
        events.append(
            b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **data}) + b"\n\n"
        )

    usage = _messages_usage(reply, size)
    start_usage = dict(usage, output_tokens=1)
    event("message_start", message=_message_object(Reply(), body, n, [], None, start_usage))
    event("ping")
    texts = iter([_args_text(arguments) for _, arguments in _sent_calls(reply)])
    for index, block in enumerate(_messages_blocks(reply, n)):
        if block["type"] == "text":
            event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            for piece in _split(block["text"]):
                event(
                    "content_block_delta", index=index, delta={"type": "text_delta", "text": piece}
                )
        else:
            event("content_block_start", index=index, content_block=dict(block, input={}))
            for piece in _split(next(texts)):
                event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "input_json_delta", "partial_json": piece},
                )
        event("content_block_stop", index=index)
    stop = _messages_stop(reply)
    delta: dict[str, Any] = {"stop_reason": stop, "stop_sequence": None}
    if stop == "refusal" and reply.refusal is not None:
        delta["stop_details"] = {"type": "refusal", "category": None, "explanation": reply.refusal}
    del usage["service_tier"]
    event("message_delta", delta=delta, usage=usage)
    event("message_stop")
    return events


_RENDERERS: dict[str, Callable[[Reply, dict[str, Any], int, int], dict[str, Any]]] = {
    "chat": _render_chat,
    "responses": _render_responses,
    "messages": _render_messages,
}
_STREAMERS: dict[str, Callable[[Reply, dict[str, Any], int, int], list[bytes]]] = {
    "chat": _stream_chat,
    "responses": _stream_responses,
    "messages": _stream_messages,
}


# --- a separate process: ``python -m interlock.testing._fake`` ----------------------------


def _load_brain(ref: str) -> Brain:
    import importlib

    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"--brain takes module:function (e.g. mypkg.brains:oracle); got {ref!r}")
    try:
        brain = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--brain {ref}: cannot load it ({exc})") from None
    if not callable(brain):
        raise SystemExit(f"--brain {ref} is not a function (api, body, headers) -> Reply")
    return brain  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the fake in its own process (so a benchmark's client owns its CPU).

    Prints ``url`` on the first line of stdout once listening; stops on Ctrl-C or SIGTERM.
    """
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m interlock.testing._fake")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--brain", help="module:function answering (api, body, headers); default: text 'ok'"
    )
    parser.add_argument("--no-validate", action="store_true", help="do not refuse bad requests")
    args = parser.parse_args(argv)
    brain: Brain = _load_brain(args.brain) if args.brain else (lambda a, b, h: Reply(text="ok"))

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(
                _serve_kw,
                brain,
                {
                    "host": args.host,
                    "port": args.port,
                    "record": False,
                    "validate": not args.no_validate,
                },
            )
            print(fake.url, flush=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

    trio.run(run)


if __name__ == "__main__":
    # Run as the package's module, not as __main__: a brain builds its replies from
    # interlock.testing (interlock.testing._fake), and a Reply of __main__'s own copy of
    # this file would be another class.
    from interlock.testing import _fake

    _fake.main()
