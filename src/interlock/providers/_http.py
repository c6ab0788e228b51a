"""The HTTP transport of the real providers: one keep-alive pool per provider, on trio.

Measured in ``benchmarks/http_clients.py`` (``benchmarks/RESULTS.md``, *HTTP/1.1
clients*): under trio at 200-1,000 concurrent requests through one pool, plain and TLS, this
client does 25-54x the requests/s of httpcore (httpx's engine, on anyio's trio backend) at
46-91x less client CPU per request, and 3.8-9.6x httpx2's. At the fan-out of 10,000 runs the
client's CPU is the limit, so the providers speak HTTP/1.1 themselves: each path's request
head encoded once, one ``send`` per request, the response head parsed with two regular
expressions, a content-length body read in place (chunked and close-delimited bodies too,
for the streams), the plain socket driven directly, and the connection cap and the queue in
trio (a FIFO of parked tasks), not in a pool that rescans its waiters on every release.
h11, which this replaced, cost about 144 µs of CPU per exchange here; the tests check
this parser against it on generated responses.

What it does not do: proxies, HTTP/2, redirects, cookies, compression (it asks for
``identity``). The model APIs need none of them.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import re
import select
import socket
import ssl
import time
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec
import trio

from .._version import __version__
from ..core._exceptions import ProviderError, RequestRefused
from ..core._pacing import TokenBucket, parse_retry_after
from ..core._sse import SseEvent, SseParser

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

__all__ = [
    "ChunkedDecoder",
    "HttpResponse",
    "SseEvent",
    "Transport",
    "head_lines",
    "header_fields",
]

RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
"""Statuses below 500 that retrying can fix (every 5xx, Anthropic's 529 too, is retryable,
unless its body names request validation: see :func:`refuses_the_request`)."""
NOT_THE_SHAPE = frozenset({401, 402, 403, 404, 407})
"""Statuses below 500 that retrying cannot fix but that say nothing of the request's
shape: who may ask (a key, a bill, a proxy) and where (the URL, the model's name)."""
_VALIDATION = re.compile(
    r"validation error|input should be|field required|extra inputs are not permitted"
    r"|not supported|unsupported|is not one of|invalid_request_error|unprocessable",
    re.I,
)
"""What a server's own request validation says (pydantic, FastAPI, OpenAI-style types),
in a 5xx body: a server that answers its validation errors as 500 (llama-cpp-python)."""

_READ_SIZE = 65536
_MAX_HEAD = 65536
_HEAD = -3
_UNTIL_CLOSE = -2
_CHUNKED = -1
"""Framings of a body, beside its content-length (0 or more)."""
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_STATUS_LINE = re.compile(r"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: [^\r\n]*)?")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n\0]*)?")
_TARGET = re.compile(r"[!-~]+")
_ERROR_TEXT_BYTES = 300
_BAD_HEADER = re.compile(r"[\r\n\0]")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HAS_POLL = hasattr(select, "poll")
_WORD = re.compile(r"[A-Za-z0-9_.+/=-]{8,}")
_error_decoder = msgspec.json.Decoder()


class HttpResponse:
    """A complete response: ``status``, ``headers`` (lower-case names) and ``body``."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        """The HTTP status code."""
        self.headers = headers
        """Header names in lower case; repeated headers joined with ``", "``."""
        self.body = body
        """The body as received (no decompression: the transport asks for ``identity``)."""

    def __repr__(self) -> str:
        return f"HttpResponse(status={self.status}, {len(self.body)} bytes)"


class _Connection:
    """One keep-alive connection: a plain socket driven directly, or a TLS stream."""

    __slots__ = ("armed", "buffer", "poller", "received", "socket", "stream", "timed_out")

    def __init__(self, sock: Any, stream: trio.SSLStream[Any] | None) -> None:
        self.socket = sock
        """The socket (plain: a non-blocking stdlib socket; TLS: trio's), None once closed."""
        self.stream = stream
        self.buffer = bytearray()
        """Bytes received and not yet consumed."""
        self.received = False
        """Whether any byte of the current response has arrived."""
        self.armed = 0
        """The token of the request's deadline in the pool's heap; 0 when none is armed."""
        self.timed_out = False
        """Whether the pool closed the connection at its request's deadline."""
        self.poller: Any = None
        """A ``select.poll`` of the plain socket, made on the first idle check."""

    async def send(self, data: bytes) -> None:
        if self.stream is not None:
            await self.stream.send_all(data)
            return
        sock = self.socket
        if sock is None:
            raise trio.BrokenResourceError("the connection is closed")
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            view = view[sent:]

    async def receive(self) -> bytes:
        if self.stream is not None:
            return await self.stream.receive_some(_READ_SIZE)
        sock = self.socket
        if sock is None:
            raise trio.BrokenResourceError("the connection is closed")
        while True:
            try:
                return sock.recv(_READ_SIZE)  # type: ignore[no-any-return]
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)

    def is_readable(self) -> bool:
        """Whether a byte (or the end) is waiting: on an idle connection, a sign that the
        server closed it."""
        sock = self.socket
        if sock is None:
            return True
        if self.stream is not None:
            return bool(sock.is_readable())
        try:
            if not _HAS_POLL:
                return bool(select.select([sock], [], [], 0)[0])
            # NOTE: one poll object per connection, registered once: a third of the cost
            # of select.select, which builds its fd sets on every call.
            poller = self.poller
            if poller is None:
                poller = self.poller = select.poll()
                poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


class _Slots:
    """A FIFO limit on requests in flight: a ``trio.CapacityLimiter`` without its
    scheduling round trip when a slot is free (12 µs against 0.7 µs per request here)."""

    __slots__ = ("free", "lot")

    def __init__(self, total: int) -> None:
        self.free = total
        self.lot = trio.lowlevel.ParkingLot()

    async def acquire(self) -> None:
        if self.free and not self.lot:
            self.free -= 1
            return
        # NOTE: no slot is taken here: release() hands its own slot to the task it wakes,
        # so a newcomer cannot overtake a waiter, and a waiter cancelled while parked
        # holds nothing.
        await self.lot.park()

    def release(self) -> None:
        if self.lot:
            self.lot.unpark()
        else:
            self.free += 1


class _Pool:
    """What one trio run holds: the slots, the idle connections, the token bucket."""

    def __init__(self, token: object, max_in_flight: int, tokens_per_minute: int | None) -> None:
        self.token = token
        self.slots = _Slots(max_in_flight)
        self.idle: list[_Connection] = []
        self.closed = False
        self.bucket = None if tokens_per_minute is None else _Tokens(tokens_per_minute)
        self.timers: list[tuple[float, int, _Connection]] = []
        """(deadline, token, connection) of the requests in flight, a heap; an entry whose
        token is no longer its connection's is stale (that request is over)."""
        self.tokens = 0
        self.keep = 4 * max_in_flight
        self.waiting: trio.CancelScope | None = None
        self.wake_at = math.inf
        """The deadline of ``waiting``: a new request's deadline is almost always later
        (the same timeout from a later now), which a float comparison tells."""
        self.watching = False

    def arm(self, connection: _Connection, deadline: float) -> None:
        """Close ``connection`` at ``deadline`` unless its request is over by then."""
        self.tokens += 1
        connection.armed = self.tokens
        timers = self.timers
        if len(timers) > self.keep:  # mostly stale entries: keep the live ones
            timers[:] = [entry for entry in timers if entry[2].armed == entry[1]]
            heapq.heapify(timers)
        heapq.heappush(timers, (deadline, self.tokens, connection))
        if not self.watching:
            self.watching = True
            trio.lowlevel.spawn_system_task(self._watch, name="interlock.providers timeouts")
        elif deadline < self.wake_at and self.waiting is not None:
            self.wake_at = self.waiting.deadline = deadline

    async def _watch(self) -> None:
        # A system task: it must never raise (that would crash the whole trio run).
        timers = self.timers
        while not self.closed:
            now = trio.current_time()
            while timers and timers[0][0] <= now:
                _deadline, token, connection = heapq.heappop(timers)
                if connection.armed == token:
                    connection.timed_out = True
                    with contextlib.suppress(Exception):  # a socket that will not close
                        _close_now(connection)
            self.wake_at = timers[0][0] if timers else math.inf
            with trio.CancelScope(deadline=self.wake_at) as waiting:
                self.waiting = waiting
                await trio.sleep_forever()
            self.waiting = None
            self.wake_at = math.inf
        self.watching = False

    def stop(self) -> None:
        self.closed = True
        if self.waiting is not None:
            self.waiting.cancel()

    def release(self, connection: _Connection) -> None:
        if self.closed:
            _close_now(connection)
        else:
            self.idle.append(connection)

    def take_idle(self) -> _Connection | None:
        while self.idle:
            connection = self.idle.pop()
            # NOTE: an idle keep-alive connection that is readable has been closed by the
            # server (or sent garbage): reusing it would fail the next request for nothing.
            if connection.is_readable():
                _close_now(connection)
                continue
            return connection
        return None


class _Tokens:
    """Tokens per minute: a :class:`TokenBucket` of one minute's tokens, and a FIFO wait."""

    def __init__(self, tokens_per_minute: int) -> None:
        self.capacity = float(tokens_per_minute)
        self.bucket = TokenBucket(tokens_per_minute / 60.0, tokens_per_minute, trio.current_time())
        self.lock = trio.Lock()  # FIFO: the first caller to wait is the first served

    async def take(self, tokens: int) -> None:
        # A request larger than a whole minute's budget waits for a full bucket, not forever.
        need = min(float(tokens), self.capacity)
        async with self.lock:
            wait = self.bucket.take(trio.current_time(), need)
            while wait:  # a second round only for the float rounding of the first wait
                await trio.sleep(wait)
                wait = self.bucket.take(trio.current_time(), need)


class Transport:
    """One provider's HTTP client: a keep-alive pool, a limit on requests in flight, an
    optional tokens-per-minute limit, and failures as :class:`~interlock.ProviderError`.

    The pool is created lazily inside trio on first use, so a Transport may be built at
    import time; used from a later ``trio.run``, it opens a fresh pool there. It never
    retries: the machine's ``ProviderPolicy`` does.

    Args:
      base_url: ``http://`` or ``https://`` URL that paths are appended to, e.g.
        ``https://api.openai.com/v1``.
      headers: sent with every request (the API key goes here; it never appears in an
        error message).
      timeout: seconds for a whole request, from connecting to the last byte (a stream:
        to its end). Waiting for a free slot or for tokens is not counted.
      max_in_flight: requests in flight at once; each holds one connection, so this is
        also the most connections the pool opens.
      tokens_per_minute: if set, a request waits until its ``tokens`` estimate fits in a
        bucket refilled at this rate.
      ssl_context: for ``https://``: the TLS settings, e.g. to trust a self-hosted server's
        own CA (``ssl.create_default_context(cafile=...)``); default: the system's CAs.

    Raises:
      ValueError: a bad ``base_url``, limit or header.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        max_in_flight: int = 64,
        tokens_per_minute: int | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"base_url {base_url!r} is not an http:// or https:// URL; "
                "pass one like 'https://api.openai.com/v1'"
            )
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError(
                f"base_url {parts.scheme}://{parts.hostname}{parts.path} must have no user, "
                "password, query or fragment; pass credentials in headers"
            )
        if not (isinstance(max_in_flight, int) and max_in_flight >= 1):
            raise ValueError(f"max_in_flight must be an int >= 1, not {max_in_flight!r}")
        if tokens_per_minute is not None and not (
            isinstance(tokens_per_minute, int) and tokens_per_minute >= 1
        ):
            raise ValueError(
                f"tokens_per_minute must be None or an int >= 1, not {tokens_per_minute!r}"
            )
        if not (isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.base_url = base_url
        self.timeout = float(timeout)
        self.max_in_flight = max_in_flight
        self.tokens_per_minute = tokens_per_minute
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        default_port = self._port == (443 if self._tls else 80)
        host = self._host if ":" not in self._host else f"[{self._host}]"
        self._headers: dict[str, str] = {
            "host": host if default_port else f"{host}:{self._port}",
            "user-agent": f"interlock/{__version__}",
            "accept": "application/json",
            "accept-encoding": "identity",
            "content-type": "application/json",
        }
        given = _checked_headers(headers)
        self._headers.update(given)
        self._secrets = _secrets(given.values())
        self._heads: dict[tuple[str, str | None], bytes] = {}
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise ValueError(f"ssl_context must be an ssl.SSLContext, not {ssl_context!r}")
        self._ssl = ssl_context
        self._pool: _Pool | None = None

    def __repr__(self) -> str:  # never a header: one of them is the key
        return f"Transport({self.base_url!r}, max_in_flight={self.max_in_flight})"

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the idle connections; one still in flight is closed when it finishes.
        The Transport stays usable: a later request opens a new pool."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            idle, pool.idle = pool.idle, []
            for connection in idle:
                _close_now(connection)
        await trio.lowlevel.checkpoint()

    async def post(
        self,
        path: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        tokens: int = 0,
    ) -> HttpResponse:
        """POST ``body`` to ``base_url + path`` and return the whole response.

        Args:
          path: appended to the base URL's path (``/chat/completions``).
          body: the request body, sent as is.
          headers: added to (and overriding) the Transport's headers for this call.
          tokens: the caller's estimate of the tokens this call uses, for the
            tokens-per-minute limit.

        Raises:
          ProviderError: a status of 400 or more (``retryable`` per the status,
            ``retry_after`` from the response), a connection that failed or dropped,
            or no complete response within ``timeout``.
        """
        pool = self._current_pool()
        head, secrets = self._request_head(path, headers)
        if pool.bucket is not None and tokens > 0:
            await pool.bucket.take(tokens)
        await pool.slots.acquire()
        try:
            status, response_headers, length, reuse, connection = await self._start(
                pool, path, head, body
            )
            try:
                buffer = connection.buffer
                if length >= 0:  # content-length: the common case, read in place
                    while len(buffer) < length:
                        await self._fill(connection, path, length)
                    if len(buffer) == length:
                        data = bytes(buffer)
                        buffer.clear()
                    else:
                        data = bytes(buffer[:length])
                        del buffer[:length]
                else:
                    data = b"".join([piece async for piece in self._body(connection, path, length)])
            except BaseException:
                _close_now(connection)
                raise
            finally:
                connection.armed = 0
            self._finish(pool, connection, reuse)
        except _TimedOut:
            raise self._timed_out(path) from None
        finally:
            pool.slots.release()
        response = HttpResponse(status, response_headers, data)
        if status >= 400:
            raise self._status_error(path, response, secrets)
        return response

    @asynccontextmanager
    async def stream(
        self,
        path: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        tokens: int = 0,
    ) -> AsyncIterator[AsyncIterator[SseEvent]]:
        """POST ``body`` and iterate the server-sent events of the response::

            async with transport.stream("/chat/completions", body) as events:
                async for event in events:
                    ...

        The events end where the response ends; a stream that ends before the API's own
        terminator (``[DONE]``, ``message_stop``) is the caller's to judge. Leaving the
        block early closes the connection.

        Raises:
          ProviderError: as :meth:`post` for the status and the connection; a
            connection dropped mid-stream is retryable; ``timeout`` covers the whole
            stream.
        """
        pool = self._current_pool()
        head, secrets = self._request_head(path, headers, accept="text/event-stream")
        if pool.bucket is not None and tokens > 0:
            await pool.bucket.take(tokens)
        await pool.slots.acquire()
        try:
            status, response_headers, length, reuse, connection = await self._start(
                pool, path, head, body
            )
            state = _StreamState()
            try:
                if status >= 400:
                    pieces = self._body(connection, path, length, state)
                    data = b"".join([piece async for piece in pieces])
                    raise self._status_error(
                        path, HttpResponse(status, response_headers, data), secrets
                    )
                events = self._events(connection, path, length, state)
                try:
                    yield events
                finally:
                    await events.aclose()  # type: ignore[attr-defined]
            finally:
                connection.armed = 0
                if state.done:
                    self._finish(pool, connection, reuse)
                else:
                    _close_now(connection)
        except _TimedOut:
            raise self._timed_out(path) from None
        finally:
            pool.slots.release()

    async def _events(
        self, connection: _Connection, path: str, length: int, state: _StreamState
    ) -> AsyncIterator[SseEvent]:
        parser = SseParser()
        async with aclosing(self._body(connection, path, length, state, streaming=True)) as body:
            async for piece in body:
                for sse in parser.feed(piece):
                    yield sse

    # -- the exchange --------------------------------------------------------------------

    def _current_pool(self) -> _Pool:
        token = trio.lowlevel.current_trio_token()
        pool = self._pool
        if pool is None or pool.token is not token:
            if pool is not None:  # left by an earlier trio.run: its sockets are dead to us
                for connection in pool.idle:
                    _close_now(connection)
            pool = self._pool = _Pool(token, self.max_in_flight, self.tokens_per_minute)
        return pool

    def _request_head(
        self, path: str, headers: Mapping[str, str] | None, accept: str | None = None
    ) -> tuple[bytes, set[str]]:
        """The request line and header fields, up to the content-length's value, encoded
        (the same for every call of a path, so kept); and the values an error must not show."""
        if not headers:
            head = self._heads.get((path, accept))
            if head is not None:
                return head, self._secrets
        if path[:1] != "/":
            raise ValueError(f"path {path!r} must start with '/', like '/chat/completions'")
        target = self._prefix + path
        if not _TARGET.fullmatch(target):
            raise ValueError(
                f"POST {target!r}: the path has a space, a control or a non-ASCII character; "
                "percent-encode it"
            )
        fields = dict(self._headers)
        secrets = self._secrets
        if accept is not None:
            fields["accept"] = accept
        if headers:
            extra = _checked_headers(headers)
            fields.update(extra)
            secrets = secrets | _secrets(extra.values())
        lines = [f"POST {target} HTTP/1.1", *(f"{name}: {value}" for name, value in fields.items())]
        head = ("\r\n".join(lines) + "\r\ncontent-length: ").encode("ascii")
        if not headers and len(self._heads) < 64:
            self._heads[(path, accept)] = head
        return head, secrets

    async def _start(
        self, pool: _Pool, path: str, head: bytes, body: bytes
    ) -> tuple[int, dict[str, str], int, bool, _Connection]:
        """Send the request; return the status, the headers, the body's framing (its
        length, or ``_CHUNKED`` or ``_UNTIL_CLOSE``), whether the connection may be kept,
        and the connection to read the body on.

        A reused keep-alive connection that the server closed before answering gets one
        more try on a fresh connection: most likely the server closed it while idle, as
        the request went out."""
        request = b"%b%d\r\n\r\n%b" % (head, len(body), body)
        # NOTE: the timeout is the pool's heap of deadlines, which closes an overdue
        # request's connection (waking it), not a cancel scope per request: entering and
        # leaving one with a deadline costs more than the rest of the exchange's bookkeeping.
        deadline = trio.current_time() + self.timeout
        reused = pool.take_idle()
        while True:
            if reused is not None:
                connection = reused
                pool.arm(connection, deadline)
            else:
                fresh: _Connection | None = None
                with trio.move_on_at(deadline):
                    fresh = await self._connect(path)
                if fresh is None:
                    raise _TimedOut
                connection = fresh
                pool.arm(connection, deadline)
            connection.received = False
            try:
                sock = connection.socket
                if connection.stream is None and sock is not None:
                    # connection.send() inline: a loopback or idle socket takes the whole
                    # request at once (one coroutine less per request)
                    try:
                        sent = sock.send(request)
                    except BlockingIOError:
                        sent = 0
                    if sent < len(request):
                        await connection.send(request[sent:])
                else:
                    await connection.send(request)
                status, headers, length, reuse = await self._response_head(
                    connection, path, fresh=reused is not None
                )
            except _Stale:
                _close_now(connection)
                reused = None
                continue
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                _close_now(connection)
                if connection.timed_out:
                    raise _TimedOut from None
                if reused is not None:
                    reused = None
                    continue
                raise self._connection_error(
                    path, "failed while sending the request", exc
                ) from None
            except BaseException:
                _close_now(connection)
                raise
            return status, headers, length, reuse, connection

    async def _connect(self, path: str) -> _Connection:
        try:
            tcp = await trio.open_tcp_stream(self._host, self._port)
        except OSError as exc:
            raise self._connection_error(path, "could not connect", exc) from None
        if not self._tls:
            # NOTE: the plain socket is driven directly (recv/send, then wait on trio when
            # it would block): trio's socket wrappers cost two scheduler round trips more
            # per request, the largest part of a loopback exchange's CPU.
            raw = tcp.socket
            sock = socket.socket(raw.family, raw.type, raw.proto, fileno=raw.detach())
            sock.setblocking(False)
            return _Connection(sock, None)
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        stream = trio.SSLStream(tcp, self._ssl, server_hostname=self._host, https_compatible=True)
        try:
            await stream.do_handshake()
        except BaseException as exc:
            if not isinstance(exc, trio.BrokenResourceError):
                tcp.socket.close()  # cancelled (the timeout) mid-handshake
                raise
            await trio.aclose_forcefully(tcp)
            cause = exc.__cause__
            verify = isinstance(cause, ssl.SSLCertVerificationError)
            raise ProviderError(
                f"POST {self._prefix}{path}: TLS handshake with {self._host}:{self._port} "
                f"failed ({_describe(cause or exc)})",
                retryable=not verify,
            ) from None
        return _Connection(tcp.socket, stream)

    async def _fill(
        self,
        connection: _Connection,
        path: str,
        length: int = _UNTIL_CLOSE,
        *,
        fresh: bool = False,
        streaming: bool = False,
    ) -> bool:
        """Receive more of the response into the connection's buffer; False at the end of
        a body that lasts until the server closes. A dropped connection is a retryable
        ProviderError (or ``_Stale``: a reused connection that got no byte of a response)."""
        try:
            if connection.stream is None and connection.socket is not None:
                # connection.receive() inline (one coroutine less per read)
                sock = connection.socket
                while True:
                    try:
                        data = sock.recv(_READ_SIZE)
                        break
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(sock)
            else:
                data = await connection.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if connection.timed_out:
                raise _TimedOut from None
            if fresh and not connection.received:
                raise _Stale from None
            what = "dropped the connection mid-stream" if streaming else "lost the connection"
            raise self._connection_error(path, what, exc) from None
        if data:
            connection.received = True
            connection.buffer += data
            return True
        if not connection.received:
            if fresh:
                raise _Stale
            raise self._connection_error(path, "closed the connection without answering", None)
        if length == _UNTIL_CLOSE:
            return False
        if streaming:
            what = "dropped the connection mid-stream"
        else:
            what = "closed the connection before the response was complete"
        if length >= 0:
            what += f" ({len(connection.buffer)} of {length} body bytes received)"
        elif length == _CHUNKED:
            what += " (before the chunked body's last chunk)"
        else:
            what += " (in the response's head)"
        raise self._connection_error(path, what, None)

    async def _response_head(
        self, connection: _Connection, path: str, *, fresh: bool
    ) -> tuple[int, dict[str, str], int, bool]:
        """Read the response's head: status, headers, framing, and keep-alive."""
        buffer = connection.buffer
        while True:
            at = buffer.find(b"\r\n\r\n")
            # NOTE: where every LF before it ends a CRLF, no earlier blank line (a bare LF
            # one) can end the head: the first CRLF CRLF does; else the regular expression.
            if at >= 0 and buffer.count(b"\n", 0, at) == buffer.count(b"\r\n", 0, at):
                start, stop = at, at + 4
            else:
                end = _HEAD_END.search(buffer)
                if end is None:
                    if len(buffer) > _MAX_HEAD:
                        raise self._not_http(path, f"a response head over {_MAX_HEAD} bytes")
                    await self._fill(connection, path, _HEAD, fresh=fresh)
                    continue
                start, stop = end.start(), end.end()
            head = buffer[:start]
            del buffer[:stop]
            try:
                status, headers, http11 = _parse_head(head)
                if 100 <= status < 200:
                    continue  # an interim response (100 Continue): the real one follows
                length = _framing(status, headers)
            except _BadHttp as exc:
                raise self._not_http(path, str(exc)) from None
            reuse = (
                http11
                and length != _UNTIL_CLOSE
                and "close" not in headers.get("connection", "").lower()
            )
            return status, headers, length, reuse

    async def _body(
        self,
        connection: _Connection,
        path: str,
        length: int,
        state: _StreamState | None = None,
        *,
        streaming: bool = False,
    ) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive, per its framing."""
        buffer = connection.buffer
        if length == _CHUNKED:
            chunks = ChunkedDecoder()
            while True:
                try:
                    pieces, done = chunks.take(buffer)
                except _BadHttp as exc:
                    raise self._not_http(path, str(exc)) from None
                for piece in pieces:
                    yield piece
                if done:
                    break
                await self._fill(connection, path, _CHUNKED, streaming=streaming)
        elif length == _UNTIL_CLOSE:
            while True:
                if buffer:
                    yield bytes(buffer)
                    buffer.clear()
                if not await self._fill(connection, path, _UNTIL_CLOSE, streaming=streaming):
                    break
        else:
            left = length
            while True:
                if buffer:
                    piece = bytes(buffer[:left])
                    del buffer[:left]
                    left -= len(piece)
                    yield piece
                if not left:
                    break
                await self._fill(connection, path, left, streaming=streaming)
        if state is not None:
            state.done = True

    def _finish(self, pool: _Pool, connection: _Connection, reuse: bool) -> None:
        # NOTE: bytes beyond the response are a server's mistake: never read them as the
        # next response's
        if reuse and not connection.buffer:
            pool.release(connection)
        else:
            _close_now(connection)

    # -- errors --------------------------------------------------------------------------

    def _timed_out(self, path: str) -> ProviderError:
        return ProviderError(
            f"POST {self._prefix}{path} to {self._host}:{self._port}: no complete response "
            f"within {self.timeout:g} seconds (the transport's timeout)",
            retryable=True,
        )

    def _connection_error(self, path: str, what: str, exc: BaseException | None) -> ProviderError:
        reason = f" ({self._redact(_describe(exc))})" if exc is not None else ""
        return ProviderError(
            f"POST {self._prefix}{path} to {self._host}:{self._port}: {what}{reason}",
            retryable=True,
        )

    def _status_error(self, path: str, response: HttpResponse, secrets: set[str]) -> ProviderError:
        status = response.status
        text = _redact(_error_text(response.body), secrets)
        said = _server_message(response.body)
        if said is not None:
            said = _redact(said, secrets)
        if refuses_the_request(status, text):
            return RequestRefused(
                f"POST {self._prefix}{path} answered HTTP {status}: {text}",
                status=status,
                server_message=said,
            )
        return ProviderError(
            f"POST {self._prefix}{path} answered HTTP {status}: {text}",
            retryable=status >= 500 or status in RETRYABLE_STATUSES,
            retry_after=parse_retry_after(response.headers, time.time()),
            status=status,
            server_message=said,
        )

    def _not_http(self, path: str, what: str) -> ProviderError:
        return self._connection_error(
            path, f"sent a response that is not valid HTTP/1.1 ({what})", None
        )

    def _redact(self, text: str) -> str:
        return _redact(text, self._secrets)


class _StreamState:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class _TimedOut(Exception):
    """The pool closed the request's connection at its deadline."""


class _Stale(Exception):
    """A reused keep-alive connection was closed by the server before it answered."""


class _BadHttp(ValueError):
    """The message is not HTTP/1.1 this module can read; the message says where."""


def _parse_head(head: bytes | bytearray) -> tuple[int, dict[str, str], bool]:
    """The status, the header fields (names in lower case, repeats joined with ``", "``)
    and whether the response is HTTP/1.1, from a response head without its blank line."""
    lines = head_lines(head)
    status = _STATUS_LINE.fullmatch(lines[0])
    if status is None:
        raise _BadHttp(f"a status line {lines[0][:60].encode('latin-1')!r} that is not HTTP/1.x")
    return int(status.group(2)), header_fields(lines), status.group(1) == "1"


def head_lines(head: bytes | bytearray) -> list[str]:
    """The lines of a message head (without its blank line), CRLF or bare-LF ended.

    Raises:
      ValueError: a NUL byte in the head.
    """
    text = head.decode("latin-1")
    if "\0" in text:
        raise _BadHttp("a NUL byte in the head")
    if text.count("\n") == text.count("\r\n"):
        return text.split("\r\n")
    return [line.removesuffix("\r") for line in text.split("\n")]  # RFC 9112 lets bare LF in


def header_fields(lines: list[str]) -> dict[str, str]:
    """The header fields of a head's ``lines`` (the first, the start line, skipped): names
    in lower case, repeated fields joined with ``", "``, obs-folded lines unfolded.

    The one header parser of interlock's HTTP/1.1: the providers' transport reads
    responses with it, the fake LLM server (``interlock.testing``) requests.

    Raises:
      ValueError: a line that is not ``name: value`` (the message says which).
    """
    headers: dict[str, str] = {}
    key = ""
    token = _TOKEN.fullmatch
    for index in range(1, len(lines)):
        line = lines[index]
        if line[:1] in (" ", "\t") and key:  # obs-fold: one more line of the last field
            more = line.strip(" \t")
            if "\r" in more:
                raise _BadHttp(f"a folded line of header {key!r} with a CR in it")
            headers[key] = f"{headers[key]} {more}"
            continue
        name, colon, value = line.partition(":")
        if not colon or token(name) is None or "\r" in value:
            raise _BadHttp(
                f"a header line {line[:60].encode('latin-1')!r} that is not 'name: value'"
            )
        key = name.lower()
        value = value.strip(" \t")
        if key in headers:
            headers[key] = f"{headers[key]}, {value}"
        else:
            headers[key] = value
    return headers


def _framing(status: int, headers: Mapping[str, str]) -> int:
    """How the body ends: its length, ``_CHUNKED`` or ``_UNTIL_CLOSE`` (RFC 9112, 6.3)."""
    if status in (204, 304):
        return 0
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.strip().lower() != "chunked":
            raise _BadHttp(
                f"transfer-encoding {coding!r}: only 'chunked' is understood "
                "(the transport asks for identity)"
            )
        return _CHUNKED
    length = headers.get("content-length")
    if length is None:
        return _UNTIL_CLOSE
    if length.isdigit() and length.isascii() and len(length) <= 15:  # the common case
        return int(length)
    values = {value.strip() for value in length.split(",")}
    value = values.pop()
    if values or not (value.isascii() and value.isdigit()) or len(value) > 15:
        raise _BadHttp(f"a content-length of {length!r}, not one number of bytes")
    return int(value)


class ChunkedDecoder:
    """The chunked transfer coding, decoded incrementally from a connection's buffer: the
    transport's for response bodies, the fake LLM server's for request bodies.

    :meth:`take` raises ValueError for a body that is not chunked as RFC 9112 says.
    """

    __slots__ = ("left", "phase")

    def __init__(self) -> None:
        self.phase = 0  # 0: a size line; 1: data; 2: the CRLF after data; 3: trailers
        self.left = 0

    def take(self, buffer: bytearray) -> tuple[list[bytes], bool]:
        """Consume what ``buffer`` holds: the data pieces, and whether the body ended."""
        pieces: list[bytes] = []
        while True:
            if self.phase == 1:
                if not buffer:
                    return pieces, False
                piece = bytes(buffer[: self.left])
                del buffer[: self.left]
                pieces.append(piece)
                self.left -= len(piece)
                if self.left:
                    return pieces, False
                self.phase = 2
            end = buffer.find(b"\n")
            if end < 0:
                if len(buffer) > 4096:
                    raise _BadHttp("a chunk-size or trailer line over 4096 bytes")
                return pieces, False
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if line.endswith(b"\r"):
                line = line[:-1]
            if self.phase == 2:
                if line:
                    raise _BadHttp("a chunk longer than its size says")
                self.phase = 0
            elif self.phase == 0:
                size = _CHUNK_SIZE.fullmatch(line)
                if size is None:
                    raise _BadHttp(f"a chunk-size line {line[:40]!r} that is not hexadecimal")
                self.left = int(size.group(1), 16)
                self.phase = 1 if self.left else 3
            elif not line:  # the blank line after the trailers: the end
                return pieces, True


def refuses_the_request(status: int, text: str) -> bool:
    """Whether an error answer refuses the request's shape (retrying the same request
    cannot help): a 4xx but for congestion (:data:`RETRYABLE_STATUSES`) and for who may
    ask or where (:data:`NOT_THE_SHAPE`), or a 5xx whose ``text`` names request
    validation (a server that answers its own validation errors as 500)."""
    if 400 <= status < 500:
        return status not in RETRYABLE_STATUSES and status not in NOT_THE_SHAPE
    return status >= 500 and _VALIDATION.search(text) is not None


def _error_text(body: bytes) -> str:
    """The server's own words: ``error.message`` (OpenAI, Anthropic) or the body's start."""
    try:
        decoded = _error_decoder.decode(body)
    except msgspec.DecodeError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            kind = error.get("type")
            message: str = error["message"]
            text = f"{kind}: {message}" if isinstance(kind, str) and kind else message
            return _one_line(text)[:1000]
        if isinstance(error, str):
            return _one_line(error)[:1000]
        if isinstance(decoded.get("message"), str):
            return _one_line(decoded["message"])[:1000]
    if not body:
        return "(empty body)"
    return repr(body[:_ERROR_TEXT_BYTES].decode("utf-8", "replace"))


def _server_message(body: bytes) -> str | None:
    """``error.message`` of an OpenAI or Anthropic error body, or None for another body."""
    try:
        decoded = _error_decoder.decode(body)
    except msgspec.DecodeError:
        return None
    error = decoded.get("error") if isinstance(decoded, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, trio.BrokenResourceError) and cause is not None:
        exc = cause
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _redact(text: str, secrets: set[str]) -> str:
    """``text`` with every header value, and every word that is a piece of one (a server
    echoing part of a key), replaced by ``[redacted]``."""
    if not secrets:
        return text
    # Longest first, so that a key inside a longer value (``Bearer KEY``) goes whole.
    for secret in sorted(secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, "[redacted]")

    def piece(match: re.Match[str]) -> str:
        word = match.group()
        return "[redacted]" if any(word in secret for secret in secrets) else word

    return _WORD.sub(piece, text)


def _checked_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ValueError(f"header {name!r} must be a str name with a str value")
        if not _TOKEN.fullmatch(name):
            raise ValueError(
                f"header name {name!r} is not a valid HTTP header name "
                "(letters, digits and !#$%&'*+-.^_`|~ only)"
            )
        if value != value.strip(" \t"):
            raise ValueError(
                f"header {name!r} has spaces or tabs around its value; strip the value"
            )
        if _BAD_HEADER.search(value) or not value.isascii():
            # NOTE: never the value itself: it is often the key (read from a file, with
            # its newline)
            raise ValueError(
                f"header {name!r} has a line break, NUL or non-ASCII character in its value; "
                "strip the value (a key read from a file often ends with a newline)"
            )
        out[name.lower()] = value
    return out


def _secrets(values: Any) -> set[str]:
    """Every header value and every word of one that could be a credential."""
    found: set[str] = set()
    for value in values:
        if len(value) >= 8:
            found.add(value)
        found.update(word for word in value.split() if len(word) >= 8)
    return found


def _close_now(connection: _Connection) -> None:
    sock = connection.socket
    if sock is not None:
        connection.socket = None
        if connection.stream is None:  # a stdlib socket: wake a task waiting on it first
            trio.lowlevel.notify_closing(sock)
        sock.close()
