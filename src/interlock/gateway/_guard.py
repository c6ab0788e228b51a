"""The gateway's guard: an ASGI middleware for keys, roles, body size, rate and time limits.

:func:`guarded` wraps the gateway's ASGI app. Per HTTP request, in this order, it

1. refuses a request from a web page of another origin (403): an ``Origin`` header that is
   neither the server's own origin nor in :attr:`Limits.allow_origins`, or
   ``Sec-Fetch-Site: cross-site`` / ``same-site``; answers the CORS preflight of an allowed
   origin. Without keys it also refuses a ``Host`` that is not loopback (DNS rebinding);
2. finds the route's role in the gateway's route table (``_routes.ROUTES``; ``None``: public);
3. authenticates the bearer key (401 with ``WWW-Authenticate: Bearer``), unless public;
4. takes a token from the key's bucket (429 with ``Retry-After`` in whole seconds);
5. checks the role (403);
6. refuses an announced ``Content-Length`` over :attr:`Limits.max_body` (413), and counts the
   body as the app reads it through ``receive``: 413 the moment it passes the limit;
7. refuses a mutating request (POST, PUT, PATCH, DELETE) of a route in the table whose
   ``Content-Type`` is not JSON or msgpack (415): a web page can send a form's types or
   none without a CORS preflight, but not these;
8. runs the app with ``scope["interlock.principal"]`` set, under :attr:`Limits.request_timeout`
   (504 if nothing was answered in time; streaming routes are exempt).

The page trees of the table's ``PAGES`` (the operator console: every path under
``/console``) pass steps 2-7 unchecked: the console signs its users in itself (a key in a
cookie or the bearer header, a token in each form) and takes HTML forms; step 1 applies to
them as to any request, and step 8 with its live streams (``.../live``) exempt.

Every refusal is ``application/problem+json`` with a ``detail`` that says what to fix. A
WebSocket handshake gets the same checks (refused with an HTTP problem where the server
supports it, else closed with code 1008), and a frame over ``max_body`` closes it with 1009.
Lifespan and other scope types pass straight through.

The guard knows roles, not machines: a route's machine is known only to the app (from the run
or the body), so the app calls ``principal.allows(role, machine)`` itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import msgspec
import trio

from ..core._pacing import TokenBucket
from ._keys import KeyRing, Principal, Unauthorized, is_loopback
from ._routes import PAGES, ROUTES, WEBSOCKET, Pages, Route

__all__ = [
    "Limits",
    "RateLimiter",
    "RunQuota",
    "guarded",
    "normalize_origin",
    "retry_after",
]

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]

_PROBLEM = "https://interlock.dev/problems/"
_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    """The gateway's limits, per key where it says so.

    Attributes:
      max_body: the largest request body (or WebSocket frame) accepted, in bytes; a larger
        one gets 413.
      rate: requests per second each key may make on average (a token bucket); ``None`` for no
        limit. Over it: 429 with ``Retry-After``.
      burst: how many requests a key may make at once above the average rate; ``None`` for one
        second's worth (``ceil(rate)``).
      runs_in_flight: how many unfinished runs each key may have; enforced by the service
        through :class:`RunQuota`.
      request_timeout: seconds a request may take before it gets 504; ``None`` for no limit.
        Streaming routes (SSE, the channel) are exempt.
      max_connections: the most connections (HTTP and the channel together) held open at
        once; lowered to fit the process's open-file limit (``ulimit -n``) less a reserve.
        When it is reached the connection idle for longest is closed; when none is idle, new
        connections wait in the listen backlog.
      idle_timeout: seconds a connection may stay open with nothing in flight: a new one
        before its first request (or channel frame), an HTTP one between requests.
      allow_origins: the web origins (``https://console.example.com``, scheme, host and port)
        whose pages may call the gateway (CORS). A request with any other ``Origin`` (bar
        the server's own) or with ``Sec-Fetch-Site: cross-site`` gets 403. Empty: none.
    """

    max_body: int = _MIB
    rate: float | None = 1000.0
    burst: int | None = None
    runs_in_flight: int = 10_000
    request_timeout: float | None = 30.0
    max_connections: int = 1000
    idle_timeout: float = 15.0
    allow_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.allow_origins, str) or not all(
            isinstance(o, str) for o in self.allow_origins
        ):
            raise ValueError(
                "Limits.allow_origins must be a tuple of origins such as "
                f"('https://console.example.com',); got {self.allow_origins!r}"
            )
        object.__setattr__(
            self, "allow_origins", tuple(normalize_origin(o) for o in self.allow_origins)
        )
        _positive_int("max_body", self.max_body, "bytes, e.g. 1048576 for 1 MiB")
        _positive_int("runs_in_flight", self.runs_in_flight, "runs per key, e.g. 10000")
        _positive_int("max_connections", self.max_connections, "connections, e.g. 1000")
        _positive_number("idle_timeout", self.idle_timeout, "seconds, e.g. 15")
        if self.rate is not None:
            _positive_number("rate", self.rate, "requests per second per key, or None")
        if self.burst is not None:
            _positive_int("burst", self.burst, "requests, or None for one second's worth")
            if self.rate is None:
                raise ValueError("Limits.burst needs a rate; set rate too, or leave burst None")
        if self.request_timeout is not None:
            _positive_number("request_timeout", self.request_timeout, "seconds, or None")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        """The limits set by ``INTERLOCK_GATEWAY_*`` variables, the defaults for the rest.

        ``INTERLOCK_GATEWAY_MAX_BODY`` (bytes), ``INTERLOCK_GATEWAY_RATE`` (requests/s per
        key, or ``off``), ``INTERLOCK_GATEWAY_BURST``, ``INTERLOCK_GATEWAY_RUNS_IN_FLIGHT``,
        ``INTERLOCK_GATEWAY_REQUEST_TIMEOUT`` (seconds, or ``off``),
        ``INTERLOCK_GATEWAY_MAX_CONNECTIONS``, ``INTERLOCK_GATEWAY_IDLE_TIMEOUT`` (seconds),
        ``INTERLOCK_GATEWAY_ALLOW_ORIGINS`` (origins separated by commas).

        Args:
          environ: the environment to read; ``os.environ`` by default.

        Raises:
          ValueError: a variable that is not a number of the right kind, naming it.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        origins = env.get("INTERLOCK_GATEWAY_ALLOW_ORIGINS")
        if origins is not None:
            values["allow_origins"] = tuple(o for o in origins.replace(" ", ",").split(",") if o)
        for name, kind, can_be_off in _ENV_LIMITS:
            text = env.get(f"INTERLOCK_GATEWAY_{name.upper()}")
            if text is None:
                continue
            variable = f"INTERLOCK_GATEWAY_{name.upper()}"
            text = text.strip()
            if can_be_off and text.lower() == "off":
                values[name] = None
                continue
            try:
                values[name] = kind(text)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                hint = " or off" if can_be_off else ""
                raise ValueError(f"{variable} must be {what}{hint}; got {text!r}") from None
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{exc} (from the INTERLOCK_GATEWAY_* variables)") from None

    @property
    def effective_burst(self) -> int:
        """The bucket's size: :attr:`burst`, or ``ceil(rate)`` when it is ``None``."""
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.rate)) if self.rate is not None else 1


_ENV_LIMITS: Final = (
    ("max_body", int, False),
    ("rate", float, True),
    ("burst", int, False),
    ("runs_in_flight", int, False),
    ("request_timeout", float, True),
    ("max_connections", int, False),
    ("idle_timeout", float, False),
)


_ORIGIN = re.compile(r"(https?)://([^/?#@\s]+?)(?::([0-9]{1,5}))?/?")
_DEFAULT_PORTS: Final = {"http": "80", "https": "443"}


def normalize_origin(origin: str) -> str:
    """``origin`` as a browser sends it in ``Origin``: lower case, no default port, no slash.

    Raises:
      ValueError: if it is not ``http(s)://host[:port]`` (no path, query or user).
    """
    found = _ORIGIN.fullmatch(origin.strip().lower())
    if found is None or found.group(2).endswith("."):
        raise ValueError(
            f"{origin!r} is not a web origin; give scheme, host and port only, e.g. "
            f"https://console.example.com or http://localhost:3000"
        )
    scheme, host, port = found.groups()
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def _positive_int(name: str, value: object, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Limits.{name} must be a positive integer ({unit}); got {value!r}")


def _positive_number(name: str, value: object, unit: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"Limits.{name} must be a positive finite number ({unit}); got {value!r}")


class RateLimiter:
    """One :class:`TokenBucket` per key name, made on the key's first request.

    The names are the key ring's principals, so the number of buckets is bounded by the
    number of configured keys.
    """

    __slots__ = ("_buckets", "_clock", "burst", "rate")

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, name: str) -> float:
        """Count one request of key ``name``: ``0.0`` if allowed, else the seconds to wait."""
        now = self._clock()
        bucket = self._buckets.get(name)
        if bucket is None:
            bucket = self._buckets[name] = TokenBucket(self.rate, self.burst, now)
        return bucket.take(now)


class RunQuota:
    """How many unfinished runs each key has, against a limit per key.

    The service calls :meth:`acquire` before it starts a run and :meth:`release` when the run
    ends (or when starting it failed).
    """

    __slots__ = ("_counts", "limit")

    def __init__(self, limit: int) -> None:
        """Args:
        limit: the most runs in flight per key (:attr:`Limits.runs_in_flight`).
        """
        _positive_int("runs_in_flight", limit, "runs per key")
        self.limit = limit
        self._counts: dict[str, int] = {}

    def acquire(self, name: str) -> bool:
        """Take a slot for key ``name``: False (and nothing taken) when it is at its limit."""
        count = self._counts.get(name, 0)
        if count >= self.limit:
            return False
        self._counts[name] = count + 1
        return True

    def release(self, name: str) -> None:
        """Give back a slot of key ``name``.

        Raises:
          ValueError: if ``name`` holds no slot (a release without its acquire).
        """
        count = self._counts.get(name, 0)
        if count <= 0:
            raise ValueError(f"key {name!r} has no run in flight to release")
        if count == 1:
            del self._counts[name]
        else:
            self._counts[name] = count - 1

    def in_flight(self, name: str) -> int:
        """How many runs key ``name`` has in flight."""
        return self._counts.get(name, 0)


def retry_after(wait: float) -> int:
    """The ``Retry-After`` value for a wait of ``wait`` seconds: whole seconds, rounded up, >= 1."""
    return max(1, math.ceil(wait))


_problem_encoder = msgspec.json.Encoder()


def _problem(status: int, slug: str, title: str, detail: str) -> bytes:
    return _problem_encoder.encode(
        {"type": _PROBLEM + slug, "title": title, "status": status, "detail": detail}
    )


@dataclass(frozen=True, slots=True)
class _Rule:
    role: str | None
    public: bool
    streaming: bool
    forms: bool = False
    """Any body type is taken (pages that check their forms' tokens themselves)."""


#: A route the table does not know: any valid key may reach the app, which answers 404/405.
_UNKNOWN = _Rule(None, False, False)
#: A page of a tree in the table's PAGES (the operator console): it signs its users in
#: itself and checks each form's token, so the guard lets it through unauthenticated,
#: takes its forms and times its requests; its live streams stay open.
_PAGE = _Rule(None, True, False, forms=True)
_PAGE_STREAM = _Rule(None, True, True, forms=True)


class _Router:
    """The route table compiled: an exact dict for fixed paths, per-length patterns for the rest."""

    __slots__ = ("_exact", "_pages", "_patterns", "_routes")

    def __init__(self, routes: Iterable[Route], pages: Iterable[Pages] = ()) -> None:
        routes = tuple(routes)
        self._pages = tuple(pages)
        self._routes: list[tuple[str, str]] = []
        self._exact: dict[tuple[str, str], _Rule] = {}
        self._patterns: dict[tuple[str, int], list[tuple[tuple[str | None, ...], _Rule]]] = {}
        seen: set[tuple[str, tuple[str | None, ...]]] = set()
        for route in routes:
            if not isinstance(route, Route):
                raise TypeError(
                    f"the guard's routes must be Route objects (interlock.gateway._routes), "
                    f"got {route!r}"
                )
            shape = _shape(route.path)
            if (route.method, shape) in seen:
                raise ValueError(
                    f"route {route.method} {route.path} is in the table twice; keep one"
                )
            seen.add((route.method, shape))
            self._routes.append((route.method, route.path))
            rule = _Rule(route.role, route.public, route.streaming)
            if None not in shape:
                self._exact[route.method, route.path] = rule
            else:
                self._patterns.setdefault((route.method, len(shape)), []).append((shape, rule))

    def paths(self, method: str) -> list[str]:
        """The patterns the table has for ``method``."""
        return sorted(p for m, p in self._routes if m == method)

    def match(self, method: str, path: str) -> _Rule:
        if method == "HEAD":
            method = "GET"
        if method != WEBSOCKET:
            for pages in self._pages:
                if pages.holds(path):
                    return _PAGE_STREAM if path.endswith(pages.stream_suffix) else _PAGE
        rule = self._exact.get((method, path))
        if rule is not None:
            return rule
        candidates = self._patterns.get((method, path.count("/") + 1))
        if candidates:
            segments = path.split("/")
            for shape, rule in candidates:
                for want, got in zip(shape, segments, strict=True):
                    if want is None:
                        if not got:
                            break
                    elif want != got:
                        break
                else:
                    return rule
        return _UNKNOWN


def _shape(pattern: str) -> tuple[str | None, ...]:
    """A path pattern's segments, None for each variable one."""
    return tuple(None if s.startswith("{") and s.endswith("}") else s for s in pattern.split("/"))


class _Refusal(Exception):
    def __init__(
        self, status: int, slug: str, title: str, detail: str, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.status = status
        self.body = _problem(status, slug, title, detail)
        self.headers = headers


_CLOSE = (b"connection", b"close")
_MULTIPLEXED = frozenset({"2", "3"})
_CHALLENGE = (b"www-authenticate", b'Bearer realm="interlock"')
_CHALLENGE_INVALID = (b"www-authenticate", b'Bearer realm="interlock", error="invalid_token"')
_CHALLENGE_SCOPE = (b"www-authenticate", b'Bearer realm="interlock", error="insufficient_scope"')


class _Exchange:
    """One HTTP request's passage: counts the body on the way in, watches the response go out."""

    __slots__ = (
        "_receive",
        "_send",
        "complete",
        "finished",
        "limit",
        "multiplexed",
        "received",
        "refused",
        "started",
    )

    def __init__(
        self, receive: Receive, send: Send, limit: int, has_body: bool, multiplexed: bool
    ) -> None:
        self._receive = receive
        self._send = send
        self.limit = limit
        self.received = 0
        self.started = False
        self.finished = False  # the answer's last body message went out
        self.refused = False
        self.multiplexed = multiplexed  # HTTP/2: a body needs no header to be there
        self.complete = not has_body and not multiplexed  # the whole body has arrived

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                # NOTE: answer now, while the app waits for the body it will never get; the app
                # sees a disconnect, and whatever it sends afterwards goes nowhere.
                if not self.started:
                    await self.refuse(_too_large(self.limit))
                elif self.multiplexed:
                    # too late for a 413: end the stream the app began, after the body (_drain)
                    await _drain(self._receive)
                    await self._send({"type": "http.response.body", "body": b""})
                self.refused = True
                return {"type": "http.disconnect"}
            if not message.get("more_body", False):
                self.complete = True
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            if not self.complete and not self.multiplexed:
                # NOTE: an answer that starts before the body has all arrived (the app refusing
                # it unread, say) leaves the server to close the connection: say so (see
                # _send_problem).
                message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
        elif (
            kind == "http.response.body"
            and self.multiplexed
            and not self.complete
            and not message.get("more_body", False)
        ):
            # NOTE: see _drain: the stream must not end before the request body has.
            await self._send({**message, "more_body": True})
            await _drain(self._receive)
            self.complete = True
            message = {"type": "http.response.body", "body": b""}
        if kind == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def refuse(self, refusal: _Refusal) -> None:
        self.refused = True
        self.started = True
        await _send_problem(
            self._send,
            refusal,
            close=not self.complete and not self.multiplexed,
            drain=self._receive if self.multiplexed and not self.complete else None,
        )


def _too_large(limit: int) -> _Refusal:
    return _Refusal(
        413,
        "body-too-large",
        "Request body too large",
        f"the request body is larger than this server's limit of {limit} bytes; send a smaller "
        f"body (split a batch into several requests)",
        [],
    )


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a request body, until it ends or the client goes away.

    hypercorn 0.18's HTTP/2 crashes its whole trio server (a KeyError escapes serve) when
    body data arrives for a stream whose response has ended (pgjones/hypercorn#329, open PRs
    #312, #334). So over HTTP/2 an answer is sent at once, but its stream ends only after the
    request's body has; the client can stop sending by resetting the stream.
    """
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if (name == b"content-length" and value.strip(b" \t0")) or name == b"transfer-encoding":
            return True
    return False


async def _send_problem(
    send: Send,
    refusal: _Refusal,
    kind: str = "http",
    *,
    close: bool = False,
    drain: Receive | None = None,
) -> None:
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(refusal.body)).encode()),
        *refusal.headers,
    ]
    if close:
        # NOTE: a refusal sent before the body has arrived leaves it unread, and the server
        # then closes the connection; saying so stops the client reusing it for its next
        # request and losing that request in the race.
        headers.append(_CLOSE)
    await send({"type": f"{kind}.response.start", "status": refusal.status, "headers": headers})
    if drain is None:
        await send({"type": f"{kind}.response.body", "body": refusal.body})
        return
    await send({"type": f"{kind}.response.body", "body": refusal.body, "more_body": True})
    await _drain(drain)
    await send({"type": f"{kind}.response.body", "body": b""})


_MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_BODY_TYPES = frozenset(
    {
        b"application/json",
        b"application/msgpack",
        b"application/x-msgpack",
        b"application/vnd.msgpack",
    }
)
#: What a page of an allowed origin may send and read (the CORS preflight's answer).
_CORS_ALLOW = [
    (b"access-control-allow-methods", b"GET, HEAD, POST"),
    (b"access-control-allow-headers", b"authorization, content-type, accept, last-event-id"),
    (b"access-control-max-age", b"600"),
]
_CORS_EXPOSE = (b"access-control-expose-headers", b"location, retry-after, www-authenticate")


def _body_type_ok(value: bytes) -> bool:
    media = value.split(b";", 1)[0].strip().lower()
    return media in _BODY_TYPES or (media.endswith(b"+json") and media.startswith(b"application/"))


def _host_name(host: str) -> str:
    """The name or address in a ``Host`` header, without its port."""
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class _Guard:
    __slots__ = ("_allowed", "_app", "_keyring", "_limiter", "_limits", "_router")

    def __init__(
        self,
        app: ASGIApp,
        keyring: KeyRing,
        limits: Limits,
        router: _Router,
        limiter: RateLimiter | None,
    ) -> None:
        self._app = app
        self._keyring = keyring
        self._limits = limits
        self._router = router
        self._limiter = limiter
        self._allowed = frozenset(limits.allow_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await self._app(scope, receive, send)

    def _cross_origin(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """Refuse a request a web page of another origin made; the CORS headers to answer
        an allowed origin with (none for a request that is not cross-origin)."""
        origin: bytes | None = None
        site: bytes | None = None
        host: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = value
            elif name == b"sec-fetch-site":
                site = value
            elif name == b"host":
                host = value
        host_text = "" if host is None else host.decode("latin-1").strip()
        if self._keyring.open and host_text and not is_loopback(_host_name(host_text)):
            # NOTE: DNS rebinding: a page of evil.example whose name now points at 127.0.0.1
            # is same-origin with itself, so browsers send no Origin on its GETs; its Host
            # header still says evil.example.
            raise _Refusal(
                403,
                "bad-host",
                "Host not allowed",
                f"this gateway has no API key, so it answers only requests addressed to a "
                f"loopback host (127.0.0.1, localhost, [::1]); the Host header was "
                f"{host_text[:200]!r}: connect to 127.0.0.1, or configure API keys "
                f"(INTERLOCK_API_KEY or INTERLOCK_API_KEYS_FILE)",
                [],
            )
        if origin is None:
            if site is not None and site.strip().lower() in (b"cross-site", b"same-site"):
                raise _Refusal(
                    403,
                    "cross-origin",
                    "Cross-origin request refused",
                    f"this request came from a web page of another site (Sec-Fetch-Site: "
                    f"{site.decode('latin-1')[:40]}) and carries no Origin this gateway allows; "
                    f"call it from a server or a script, or allow the page's origin "
                    f"(interlock serve --allow-origin https://console.example.com)",
                    [],
                )
            return []
        text = origin.decode("latin-1").strip()
        try:
            normal = normalize_origin(text)
        except ValueError:
            normal = None
        if normal is not None and host_text:
            with contextlib.suppress(ValueError):
                if normal == normalize_origin(f"{scope.get('scheme', 'http')}://{host_text}"):
                    return []  # same origin: a page the gateway served itself
        if normal is None or normal not in self._allowed:
            allowed = ", ".join(sorted(self._allowed)) or "none"
            raise _Refusal(
                403,
                "cross-origin",
                "Cross-origin request refused",
                f"requests from web pages of origin {text[:200]!r} are not allowed (allowed: "
                f"{allowed}); allow it with interlock serve --allow-origin {text[:200]} (or "
                f"INTERLOCK_GATEWAY_ALLOW_ORIGINS), or call the gateway from a server",
                [],
            )
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin"), _CORS_EXPOSE]

    def _admit(self, method: str, scope: Scope) -> tuple[_Rule, Principal | None, int | None, bool]:
        """The route's rule, the principal, the announced body length and whether a body
        comes, or a _Refusal."""
        path: str = scope["path"]
        if "/." in path and any(s in (".", "..") for s in path.split("/")):
            raise _Refusal(
                400,
                "bad-path",
                "Bad path",
                f"the path {path[:200]!r} has a '.' or '..' segment; send the resolved path",
                [],
            )
        rule = self._router.match(method, path)
        if rule is _UNKNOWN and method == WEBSOCKET:
            # NOTE: the app may hand every WebSocket to one handler, whatever its path, so a
            # path the table does not name must not get through with just any key.
            known = self._router.paths(WEBSOCKET)
            raise _Refusal(
                404,
                "not-found",
                "Not found",
                f"there is no WebSocket endpoint at {path[:200]!r}; connect to "
                f"{' or '.join(known) or 'none (this server has none)'}",
                [],
            )
        authorization: str | None = None
        length: bytes | None = None
        content_type: bytes | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                if authorization is not None:
                    raise _Refusal(
                        401,
                        "unauthorized",
                        "Unauthorized",
                        "the request has more than one Authorization header; send exactly one: "
                        "'Authorization: Bearer <key>'",
                        [_CHALLENGE_INVALID],
                    )
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"content-type":
                content_type = value
        principal: Principal | None = None
        if not rule.public:
            try:
                principal = self._keyring.authenticate(authorization)
            except Unauthorized as exc:
                challenge = _CHALLENGE if authorization is None else _CHALLENGE_INVALID
                raise _Refusal(401, "unauthorized", "Unauthorized", str(exc), [challenge]) from None
            limiter = self._limiter
            if limiter is not None:
                wait = limiter.check(principal.name)
                if wait:
                    seconds = retry_after(wait)
                    raise _Refusal(
                        429,
                        "rate-limited",
                        "Too many requests",
                        f"key {principal.name!r} is over its rate of {limiter.rate:g} requests "
                        f"per second; retry after {seconds} s (the Retry-After header), or "
                        f"batch proposals with POST /v1/verify",
                        [(b"retry-after", str(seconds).encode())],
                    )
            if rule.role is not None and not principal.allows(rule.role):
                raise _Refusal(
                    403,
                    "forbidden",
                    "Forbidden",
                    f"key {principal.name!r} has the roles {', '.join(sorted(principal.roles))}; "
                    f"{method} {path[:200]} needs the {rule.role!r} role: use a key that has it",
                    [_CHALLENGE_SCOPE],
                )
        announced: int | None = None
        if length is not None:
            if not length.isdigit():
                raise _Refusal(
                    400,
                    "bad-content-length",
                    "Bad Content-Length",
                    "the Content-Length header is not a whole number of bytes; send the body's "
                    "length in bytes or leave the header out",
                    [],
                )
            announced = int(length)
        if (
            method in _MUTATING
            and rule is not _UNKNOWN
            and not rule.forms
            and not _body_type_ok(content_type or b"")
        ):
            # NOTE: a web page may POST a form's types (text/plain, ...) or none at all to any
            # address without a CORS preflight; JSON and msgpack need one, which fails.
            sent = "none" if content_type is None else repr(content_type.decode("latin-1")[:100])
            raise _Refusal(
                415,
                "unsupported-media-type",
                "Unsupported Media Type",
                f"{method} {path[:200]} takes a body of Content-Type application/json (or "
                f"application/msgpack); the request's Content-Type was {sent}: send the header "
                f"'Content-Type: application/json'",
                [],
            )
        return rule, principal, announced, chunked or bool(announced)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self._limits
        cors: list[tuple[bytes, bytes]] = []
        try:
            cors = self._cross_origin(scope)
            method = scope["method"]
            if cors and method == "OPTIONS":  # a CORS preflight of an allowed origin
                await send(
                    {
                        "type": "http.response.start",
                        "status": 204,
                        "headers": [*cors, *_CORS_ALLOW],
                    }
                )
                await send({"type": "http.response.body", "body": b""})
                return
            rule, principal, announced, has_body = self._admit(method, scope)
            if announced is not None and announced > limits.max_body:
                raise _too_large(limits.max_body)
        except _Refusal as refusal:
            refusal.headers = [*refusal.headers, *cors]
            if scope.get("http_version", "1.1") in _MULTIPLEXED:
                await _send_problem(send, refusal, drain=receive)
            else:
                await _send_problem(send, refusal, close=_has_body(scope))
            return
        if principal is not None:
            scope = {**scope, "interlock.principal": principal}
        if cors:
            send = _with_headers(send, cors)
        exchange = _Exchange(
            receive,
            send,
            limits.max_body,
            has_body,
            scope.get("http_version", "1.1") in _MULTIPLEXED,
        )
        timeout = None if rule.streaming else limits.request_timeout
        timed_out = False
        try:
            if timeout is None:
                await self._app(scope, exchange.receive, exchange.send)
            else:
                with trio.move_on_after(timeout) as cancel_scope:
                    await self._app(scope, exchange.receive, exchange.send)
                timed_out = cancel_scope.cancelled_caught
        except Exception:
            if exchange.refused:
                return  # the app tripped over the disconnect the body limit gave it
            if exchange.multiplexed and not exchange.complete:
                await _drain(receive)  # before the server's 500 ends the stream (see _drain)
            raise
        if exchange.multiplexed and not exchange.refused:
            if exchange.started and not exchange.finished:
                # the app left its answer unfinished (timed out, or a bug): end it after the body
                await exchange.send({"type": "http.response.body", "body": b""})
                return
            if not exchange.started and not timed_out and not exchange.complete:
                await _drain(receive)  # the server answers an app that answered nothing
        if timed_out and not exchange.started:
            await exchange.refuse(
                _Refusal(
                    504,
                    "timeout",
                    "Request timed out",
                    f"the request took longer than this server's limit of {timeout:g} s and was "
                    f"cancelled; retry it (a retry with the same expected_seq or result key gets "
                    f"the recorded answer), or send smaller batches",
                    [],
                )
            )

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # NOTE: browsers apply no CORS to WebSockets: the Origin check is all there is.
            self._cross_origin(scope)
            principal = self._admit(WEBSOCKET, scope)[1]
        except _Refusal as refusal:
            message = await receive()
            if message["type"] != "websocket.connect":
                return
            if "websocket.http.response" in scope.get("extensions", {}):
                await _send_problem(send, refusal, "websocket.http")
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        if principal is not None:
            scope = {**scope, "interlock.principal": principal}
        limit = self._limits.max_body
        closed = False

        async def receive_frame() -> Message:
            nonlocal closed
            if closed:
                return {"type": "websocket.disconnect", "code": 1009}
            message = await receive()
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                if data is None:
                    text = message.get("text") or ""
                    size = len(text) if len(text) * 4 <= limit else len(text.encode())
                else:
                    size = len(data)
                if size > limit:
                    closed = True
                    await send(
                        {
                            "type": "websocket.close",
                            "code": 1009,
                            "reason": f"frame larger than {limit} bytes",
                        }
                    )
                    return {"type": "websocket.disconnect", "code": 1009}
            return message

        async def send_frame(message: Message) -> None:
            if not closed:
                await send(message)

        await self._app(scope, receive_frame, send_frame)


def _with_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending


def guarded(
    app: ASGIApp,
    keyring: KeyRing,
    limits: Limits | None = None,
    *,
    routes: Iterable[Route] = ROUTES,
    pages: Iterable[Pages] = PAGES,
    clock: Callable[[], float] = time.monotonic,
) -> ASGIApp:
    """Wrap an ASGI app in the gateway's keys, roles and limits.

    Args:
      app: the ASGI app to guard; it reads ``scope["interlock.principal"]`` (a
        :class:`~interlock.gateway._keys.Principal`, set on every authenticated request) to
        check machines.
      keyring: the accepted keys; an open key ring lets every request in as the anonymous
        principal (keep such a server on loopback: :func:`check_bind`).
      limits: the limits; :class:`Limits` defaults when ``None``.
      routes: the route table (:data:`~interlock.gateway._routes.ROUTES`, the one the app
        serves and the OpenAPI document lists): each route's role (``None``: public) and
        limits class (``"stream"``: no request timeout). ``HEAD`` uses the ``GET`` route. A
        path not in the table needs a valid key and no role (the app answers it, e.g. 404).
      pages: the page trees (:data:`~interlock.gateway._routes.PAGES`): every path under
        one passes unauthenticated, any body type, its streams untimed (see :class:`Pages`).
      clock: the rate limiter's clock (seconds, monotonic).

    Raises:
      ValueError: if the route table names a route twice.
    """
    limits = Limits() if limits is None else limits
    router = _Router(routes, pages)
    limiter = (
        RateLimiter(limits.rate, limits.effective_burst, clock) if limits.rate is not None else None
    )
    return _Guard(app, keyring, limits, router, limiter)
