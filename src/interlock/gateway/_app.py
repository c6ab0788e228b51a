"""The gateway's HTTP API: a plain ASGI app over a :class:`GatewayService`.

No web framework: a small router, content negotiation (JSON by default, msgpack when the
request's ``Content-Type`` or ``Accept`` says ``application/msgpack``), problem+json
errors, SSE for the event stream. All the semantics live in the service; this module only
routes, decodes, encodes and counts.

Bad input never gets a 500: an undecodable body, a wrong field, an unknown path or method,
a bad query parameter or an unknown run is a 4xx problem whose detail says what to fix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..core._exceptions import StoreDamaged
from ..protocol import (
    AbortIn,
    EventOut,
    HealthOut,
    ProposalIn,
    ResultIn,
    ResumeIn,
    RunCreate,
    VerifyIn,
)
from ..runtime._metrics import RuntimeCollector
from ._guard import retry_after
from ._routes import (
    JSON,
    MSGPACK,
    PAGES,
    PROBLEM_JSON,
    ROUTES,
    WEBSOCKET,
    Route,
    openapi_document,
)
from ._service import GatewayError, GatewayService, damaged

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["GatewayApp"]

log = logging.getLogger("interlock.gateway")

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]
T = TypeVar("T")

_MSGPACK_TYPES = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: The largest request body the app reads, in bytes, when no guard limits it first.
DEFAULT_MAX_BODY = 8 << 20

_json_encode = msgspec.json.Encoder().encode
_msgpack_encode = msgspec.msgpack.Encoder().encode


class _Request:
    __slots__ = (
        "_query",
        "method",
        "params",
        "path",
        "principal",
        "receive",
        "scope",
        "send",
    )

    def __init__(self, scope: Scope, receive: Receive, send: Send, params: dict[str, str]) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.params = params
        self.principal = scope.get("interlock.principal")
        self._query: dict[str, list[str]] | None = None

    def header(self, name: bytes) -> str:
        """The value of header ``name`` (lower case), '' if absent."""
        for key, value in self.scope["headers"]:
            if key.lower() == name:
                return str(value.decode("latin-1"))
        return ""

    @property
    def query(self) -> dict[str, list[str]]:
        if self._query is None:
            self._query = _parse_query(self.scope.get("query_string", b""))
        return self._query

    @property
    def msgpack_in(self) -> bool:
        kind = self.header(b"content-type").split(";", 1)[0].strip().lower()
        return kind in _MSGPACK_TYPES

    @property
    def msgpack_out(self) -> bool:
        accept = self.header(b"accept")
        if not accept:
            return self.msgpack_in
        return any(
            part.split(";", 1)[0].strip().lower() in _MSGPACK_TYPES for part in accept.split(",")
        )

    def text(self, name: str) -> str | None:
        values = self.query.get(name)
        if not values:
            return None
        if len(values) > 1:
            raise _bad(f"query parameter {name!r} is given {len(values)} times; give it once")
        return values[0]

    def integer(self, name: str, default: int) -> int:
        value = self.text(name)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise _bad(f"query parameter {name!r} must be an integer, got {value!r}") from None


def _parse_query(raw: bytes) -> dict[str, list[str]]:
    try:
        return urllib.parse.parse_qs(raw.decode("latin-1"), keep_blank_values=True)
    except ValueError as exc:
        raise _bad(f"the query string cannot be read: {exc}") from None


def _bad(detail: str) -> GatewayError:
    return GatewayError(400, "Bad Request", detail)


class _Response:
    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.body = body
        self.headers = headers


Handler: TypeAlias = Callable[["GatewayApp", _Request], Awaitable[_Response | None]]


class _Route:
    """The routes of one path pattern: its regex and the handler of each method."""

    __slots__ = ("handlers", "name", "pattern")

    def __init__(self, name: str) -> None:
        self.name = name
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", name)
        self.pattern = re.compile(f"^{regex}$")
        self.handlers: dict[str, Handler] = {}


#: The handlers, by the name a :class:`Route` gives (the function's, without its ``_``).
_HANDLERS: dict[str, Handler] = {}


def _handles(handler: Handler) -> Handler:
    _HANDLERS[handler.__name__.removeprefix("_")] = handler
    return handler


def _compile(routes: tuple[Route, ...]) -> dict[str, _Route]:
    """The HTTP routes of the table by path pattern, each method bound to its handler.

    Raises:
      RuntimeError: if a route names a handler this module lacks, or a handler serves no
        route (a route added to one place and not the other).
    """
    compiled: dict[str, _Route] = {}
    for route in routes:
        if route.method == WEBSOCKET:
            continue
        handler = _HANDLERS.get(route.handler)
        if handler is None:
            raise RuntimeError(
                f"route {route.method} {route.path} names the handler {route.handler!r}, "
                f"which the gateway app lacks; define async def _{route.handler}(app, request) "
                "decorated with @_handles"
            )
        handlers = compiled.setdefault(route.path, _Route(route.path)).handlers
        if route.method in handlers:
            raise RuntimeError(f"route {route.method} {route.path} is in ROUTES twice; keep one")
        handlers[route.method] = handler
    unused = set(_HANDLERS) - {r.handler for r in routes}
    if unused:
        raise RuntimeError(
            f"the handlers {sorted(unused)} serve no route; add their Route to ROUTES "
            "(gateway/_routes.py)"
        )
    return compiled


class GatewayApp:
    """The gateway's ASGI app. Make one with :func:`interlock.gateway.create_app`.

    Args:
      service: the operations it serves.
      prices: USD per million tokens by model, for the cost metric.
      max_body: the largest request body read, in bytes (413 past it).
      websocket: an ASGI app for WebSocket connections, or None to refuse them (the
        streaming channel is served on its own socket: see ``serve_gateway``).
      console: the operator console's app (``gateway._console.ConsoleApp``), served
        under ``/console``; None: not served.
    """

    def __init__(
        self,
        service: GatewayService,
        *,
        prices: Mapping[str, tuple[float, float]] | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        websocket: ASGIApp | None = None,
        console: ASGIApp | None = None,
    ) -> None:
        self.service = service
        self.console = console
        """The operator console's app, served under ``/console`` (None: not served)."""
        self.max_body = max_body
        self.websocket = websocket
        self.registry = CollectorRegistry()
        supervisor = service.supervisor
        self.registry.register(
            RuntimeCollector(supervisor.stats, supervisor=lambda: supervisor, prices=prices)
        )
        self.requests = Counter(
            "interlock_gateway_requests",
            "HTTP requests the gateway answered, by route, method and status",
            ("route", "method", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "interlock_gateway_request_seconds",
            "Seconds the gateway took to answer an HTTP request, by route",
            ("route",),
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=self.registry,
        )
        # The labelled children, by label values: labels() costs a lock and a dict each.
        self._counted: dict[tuple[str, str, int], Any] = {}
        self._timed: dict[str, Any] = {}
        self._streams: set[trio.CancelScope] = set()
        self._openapi: bytes | None = None
        self.heartbeat = 15.0
        """Seconds an event stream may stay silent before a keep-alive comment is sent."""
        self.asgi: ASGIApp = self
        """What to serve: this app, or (from create_app) the guard around it."""

    def drain(self) -> None:
        """Stop taking work: mutating requests get a 503 and every event stream ends."""
        self.service.draining = True
        for scope in list(self._streams):
            scope.cancel()
        for scope in list(getattr(self.console, "streams", ())):
            scope.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            if self.console is not None and _CONSOLE.holds(path):
                await self.console(scope, receive, send)
                return
            await self._http(scope, receive, send)
        elif kind == "websocket":
            if self.websocket is not None:
                await self.websocket(scope, receive, send)
            else:
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008})
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.drain()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        method: str = scope["method"]
        name = "unmatched"
        response: _Response | None
        try:
            route, params = self._match(scope["path"])
            name = route.name
            handler = route.handlers.get("GET" if method == "HEAD" else method)
            if handler is None:
                allowed = ", ".join(sorted(route.handlers))
                raise GatewayError(
                    405,
                    "Method Not Allowed",
                    f"{method} is not allowed on {route.name}; use {allowed}",
                )
            request = _Request(scope, receive, send, params)
            response = await handler(self, request)
        except GatewayError as exc:
            response = _problem(exc)
        except StoreDamaged as exc:  # met outside the service's answers: not a bug either
            response = _problem(damaged(exc))
        except Exception as exc:
            log.exception("the gateway failed answering %s %s", method, scope.get("path"))
            response = _problem(
                GatewayError(
                    500,
                    "Internal Server Error",
                    f"a bug in interlock's gateway: {type(exc).__name__}: {exc}; the journal "
                    "is intact; report it",
                )
            )
        if response is not None:  # None: the handler streamed its own answer
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": response.headers,
                }
            )
            body = b"" if method == "HEAD" else response.body
            await send({"type": "http.response.body", "body": body})
            status = response.status
        else:
            status = 200
        label = method if method in _METHODS else "other"  # bounded label values
        counter = self._counted.get((name, label, status))
        if counter is None:
            counter = self._counted[(name, label, status)] = self.requests.labels(
                name, label, str(status)
            )
        counter.inc()
        timer = self._timed.get(name)
        if timer is None:
            timer = self._timed[name] = self.latency.labels(name)
        timer.observe(time.perf_counter() - started)

    @staticmethod
    def _match(path: str) -> tuple[_Route, dict[str, str]]:
        route = _ROUTES.get(path)
        if route is not None and "{" not in path:  # a fixed path: no pattern to match
            return route, {}
        for route in _ROUTES.values():
            found = route.pattern.match(path)
            if found is not None:
                params = {k: urllib.parse.unquote(v) for k, v in found.groupdict().items()}
                return route, params
        raise GatewayError(
            404,
            "Not Found",
            f"no route {path!r}; the API is under /v1 (GET /openapi.json lists every route)",
        )

    # -- bodies -------------------------------------------------------------------

    async def _body(self, request: _Request, kind: type[T]) -> T:
        content_type = request.header(b"content-type")
        media = content_type.split(";", 1)[0].strip().lower()
        if media != JSON and not media.endswith("+json") and not request.msgpack_in:
            # NOTE: no Content-Type at all is refused too: a web page can send a body without
            # one (or with a form's type) to any address, without a CORS preflight.
            sent = repr(content_type) if content_type else "missing"
            raise GatewayError(
                415,
                "Unsupported Media Type",
                f"the body's Content-Type is {sent}; send {JSON} or {MSGPACK} (curl "
                f"-d sends a form's type unless given -H 'Content-Type: {JSON}')",
            )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise _bad("the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise GatewayError(
                    413,
                    "Content Too Large",
                    f"the body is larger than {self.max_body} bytes; send less (split a batch)",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        data = b"".join(chunks)
        if not data:
            raise _bad(
                f"the request needs a body: a {kind.__name__} as {JSON} (GET /openapi.json "
                "shows its fields)"
            )
        decoder = _decoders(kind, request.msgpack_in)
        try:
            return decoder.decode(data)  # type: ignore[no-any-return]
        except msgspec.ValidationError as exc:
            raise GatewayError(
                422, "Unprocessable Content", f"the {kind.__name__} body is not valid: {exc}"
            ) from None
        except msgspec.DecodeError as exc:
            what = "msgpack" if request.msgpack_in else "JSON"
            raise _bad(f"the body is not valid {what}: {exc}") from None

    def _reply(
        self,
        request: _Request,
        body: msgspec.Struct,
        status: int = 200,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> _Response:
        if request.msgpack_out:
            data, kind = _msgpack_encode(body), MSGPACK
        else:
            data, kind = _json_encode(body), JSON
        extra = headers or []
        return _Response(
            status,
            data,
            [
                (b"content-type", kind.encode()),
                (b"content-length", str(len(data)).encode()),
                *extra,
            ],
        )


_DECODERS: dict[tuple[type, bool], msgspec.json.Decoder[Any] | msgspec.msgpack.Decoder[Any]] = {}


def _decoders(
    kind: type[T], msgpack: bool
) -> msgspec.json.Decoder[Any] | msgspec.msgpack.Decoder[Any]:
    decoder = _DECODERS.get((kind, msgpack))
    if decoder is None:
        decoder = _DECODERS[(kind, msgpack)] = (
            msgspec.msgpack.Decoder(kind) if msgpack else msgspec.json.Decoder(kind)
        )
    return decoder


def _problem(exc: GatewayError) -> _Response:
    data = _json_encode(exc.problem())
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(data)).encode()),
    ]
    if exc.retry_after is not None:
        headers.append((b"retry-after", b"%d" % retry_after(exc.retry_after)))
    if exc.status == 405:
        allowed = exc.detail.rpartition("; use ")[2]
        headers.append((b"allow", allowed.encode()))
    return _Response(exc.status, data, headers)


# -- routes -------------------------------------------------------------------------------


@_handles
async def _healthz(app: GatewayApp, request: _Request) -> _Response:
    return app._reply(request, HealthOut())


@_handles
async def _readyz(app: GatewayApp, request: _Request) -> _Response:
    ready = await app.service.ready()
    headers = [] if ready.ready else [(b"retry-after", b"1")]
    return app._reply(request, ready, 200 if ready.ready else 503, headers)


@_handles
async def _metrics(app: GatewayApp, request: _Request) -> _Response:
    data = generate_latest(app.registry)
    return _Response(
        200,
        data,
        [
            (b"content-type", CONTENT_TYPE_LATEST.encode()),
            (b"content-length", str(len(data)).encode()),
        ],
    )


@_handles
async def _openapi(app: GatewayApp, request: _Request) -> _Response:
    if app._openapi is None:
        app._openapi = json.dumps(openapi_document()).encode()
    return _Response(
        200,
        app._openapi,
        [(b"content-type", JSON.encode()), (b"content-length", str(len(app._openapi)).encode())],
    )


@_handles
async def _create_run(app: GatewayApp, request: _Request) -> _Response:
    body = await app._body(request, RunCreate)
    trace = request.header(b"traceparent") or None
    run, created = await app.service.create_run(body, request.principal, trace)
    location = f"/v1/runs/{urllib.parse.quote(run.id, safe='')}".encode()
    return app._reply(request, run, 201 if created else 200, [(b"location", location)])


@_handles
async def _list_runs(app: GatewayApp, request: _Request) -> _Response:
    page = await app.service.list_runs(
        state=request.text("state") or None,
        machine=request.text("machine") or None,
        outcome=request.text("outcome") or None,
        limit=request.integer("limit", 100),
        cursor=request.text("cursor") or None,
        principal=request.principal,
    )
    return app._reply(request, page)


@_handles
async def _get_run(app: GatewayApp, request: _Request) -> _Response:
    return app._reply(request, await app.service.get_run(request.params["id"], request.principal))


@_handles
async def _events(app: GatewayApp, request: _Request) -> _Response:
    page = await app.service.events(
        request.params["id"],
        after=request.integer("after", 0),
        limit=request.integer("limit", 1000),
        principal=request.principal,
    )
    return app._reply(request, page)


@_handles
async def _stream(app: GatewayApp, request: _Request) -> None:
    after = request.integer("after", 0)
    last = request.header(b"last-event-id").strip()
    if last:
        try:
            after = int(last)
        except ValueError:
            raise _bad(
                f"Last-Event-ID must be the seq of an event (an integer), got {last!r}"
            ) from None
    events = await app.service.follow(
        request.params["id"], after, request.principal, heartbeat=app.heartbeat
    )
    send = request.send
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ],
        }
    )
    with trio.CancelScope() as scope:
        app._streams.add(scope)
        try:
            async with trio.open_nursery() as nursery:

                async def disconnect() -> None:
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(disconnect)
                await send(
                    {"type": "http.response.body", "body": b": stream\n\n", "more_body": True}
                )
                try:
                    async with contextlib.aclosing(events) as stream:
                        async for event in stream:
                            await send(
                                {
                                    "type": "http.response.body",
                                    "body": b": keep-alive\n\n" if event is None else sse(event),
                                    "more_body": True,
                                }
                            )
                except Exception as exc:  # e.g. the store stopped answering: end the stream
                    if isinstance(exc, StoreDamaged):  # a reconnect would meet it again
                        exc = damaged(exc)
                    elif not isinstance(exc, GatewayError):
                        log.exception("the event stream of %r failed", request.params["id"])
                        exc = GatewayError(
                            500,
                            "Internal Server Error",
                            f"the stream failed: {type(exc).__name__}: {exc}; reconnect with "
                            "Last-Event-ID to go on",
                        )
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"event: problem\ndata: %s\n\n" % _json_encode(exc.problem()),
                            "more_body": True,
                        }
                    )
                nursery.cancel_scope.cancel()
        finally:
            app._streams.discard(scope)
    # the client may be gone: then there is nothing to finish
    with trio.CancelScope(shield=True), trio.move_on_after(5), contextlib.suppress(Exception):
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return None


def sse(event: EventOut) -> bytes:
    """One journal event as a Server-Sent Event: ``id:`` is its seq, ``event:`` its kind."""
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (
        event.seq,
        event.kind.encode(),
        _json_encode(event),
    )


@_handles
async def _propose(app: GatewayApp, request: _Request) -> _Response:
    body = await app._body(request, ProposalIn)
    trace = request.header(b"traceparent") or None
    verdict = await app.service.propose(request.params["id"], body, request.principal, trace)
    return app._reply(request, verdict)


@_handles
async def _report(app: GatewayApp, request: _Request) -> _Response:
    body = await app._body(request, ResultIn)
    verdict = await app.service.report(request.params["id"], body, request.principal)
    return app._reply(request, verdict)


@_handles
async def _verify(app: GatewayApp, request: _Request) -> _Response:
    body = await app._body(request, VerifyIn)
    trace = request.header(b"traceparent") or None
    return app._reply(request, await app.service.verify_batch(body, request.principal, trace))


@_handles
async def _escalations(app: GatewayApp, request: _Request) -> _Response:
    return app._reply(request, await app.service.escalations(request.principal))


@_handles
async def _escalation(app: GatewayApp, request: _Request) -> _Response:
    found = await app.service.escalation(request.params["id"], request.principal)
    return app._reply(request, found)


@_handles
async def _resume(app: GatewayApp, request: _Request) -> _Response:
    body = await app._body(request, ResumeIn)
    run = await app.service.resume(request.params["id"], body, request.principal)
    return app._reply(request, run)


@_handles
async def _abort(app: GatewayApp, request: _Request) -> _Response:
    body = await app._body(request, AbortIn)
    run = await app.service.abort(request.params["id"], body, request.principal)
    return app._reply(request, run)


_ROUTES: dict[str, _Route] = _compile(ROUTES)
#: The console's page tree: the guard and this app read the same entry of PAGES.
(_CONSOLE,) = (pages for pages in PAGES if pages.prefix == "/console")
