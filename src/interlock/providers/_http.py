"""The HTTP transport of the real providers: one keep-alive pool per provider, on trio + h11.

Measured in ``benchmarks/http_clients.py``: under trio with one shared pool, httpx 0.28
falls to 75-280 requests/s once requests are concurrent and httpx2 2.16 holds 380-540/s
at 1.5-2 ms of client CPU per request, while a bare pool of trio streams speaking h11
does 1,100-1,800/s at 0.3-0.55 ms. At the fan-out of 10,000 runs the client's CPU is
the limit, so the providers speak HTTP/1.1 through h11 directly: one ``send_all`` per
request, no per-request objects beyond h11's own, the connection cap and the queue in
trio (a FIFO of parked tasks), not in a pool that rescans its waiters on every release.

What it does not do: proxies, HTTP/2, redirects, cookies, compression (it asks for
``identity``). The model APIs need none of them.
"""

from __future__ import annotations

import codecs
import email.utils
import math
import re
import ssl
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

import h11
import msgspec
import trio

from .._exceptions import ProviderError
from .._version import __version__

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

__all__ = ["HttpResponse", "SseEvent", "Transport"]

RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
"""Statuses below 500 that retrying can fix (every 5xx, Anthropic's 529 too, is retryable)."""

_READ_SIZE = 65536
_ERROR_TEXT_BYTES = 300
_LINE_END = re.compile(r"\r\n|\r|\n")
_BAD_HEADER = re.compile(r"[\r\n\0]")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
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


class SseEvent(NamedTuple):
    """One server-sent event, parsed per the HTML standard's event-stream rules."""

    event: str
    """The ``event:`` field; ``""`` when the event had none (the standard's ``message``)."""
    data: str
    """The ``data:`` lines joined with ``\\n``."""


class _Connection:
    __slots__ = ("conn", "received", "socket", "stream")

    def __init__(self, stream: trio.abc.Stream, socket: Any) -> None:
        self.stream = stream
        self.socket = socket
        self.conn = h11.Connection(h11.CLIENT)
        self.received = False
        """Whether any byte of the current response has arrived."""


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
        self.bucket = None if tokens_per_minute is None else _TokenBucket(tokens_per_minute)

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
            if connection.socket is not None and connection.socket.is_readable():
                _close_now(connection)
                continue
            return connection
        return None


class _TokenBucket:
    """Tokens per minute: a bucket of one minute's tokens, refilled continuously."""

    def __init__(self, tokens_per_minute: int) -> None:
        self.capacity = float(tokens_per_minute)
        self.rate = tokens_per_minute / 60.0
        self.level = self.capacity
        self.stamp = trio.current_time()
        self.lock = trio.Lock()  # FIFO: the first caller to wait is the first served

    async def take(self, tokens: int) -> None:
        # A request larger than a whole minute's budget waits for a full bucket, not forever.
        need = min(float(tokens), self.capacity)
        async with self.lock:
            self._refill()
            if self.level < need:
                await trio.sleep((need - self.level) / self.rate)
                self._refill()
            self.level -= need

    def _refill(self) -> None:
        now = trio.current_time()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now


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
        self._base_fields = list(self._headers.items())
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
            pool.closed = True
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
        fields, secrets = self._fields(headers)
        if pool.bucket is not None and tokens > 0:
            await pool.bucket.take(tokens)
        await pool.slots.acquire()
        try:
            with trio.move_on_after(self.timeout) as scope:
                status, response_headers, connection = await self._start(pool, path, body, fields)
                chunks = []
                try:
                    while True:
                        event = await self._next(connection, path)
                        if type(event) is h11.Data:
                            chunks.append(event.data)
                        elif type(event) is h11.EndOfMessage:
                            break
                except BaseException:
                    _close_now(connection)
                    raise
                self._finish(pool, connection)
        finally:
            pool.slots.release()
        if scope.cancelled_caught:
            raise self._timed_out(path)
        response = HttpResponse(status, response_headers, b"".join(chunks))
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
        fields, secrets = self._fields(headers, accept="text/event-stream")
        if pool.bucket is not None and tokens > 0:
            await pool.bucket.take(tokens)
        await pool.slots.acquire()
        try:
            with trio.move_on_after(self.timeout) as scope:
                status, response_headers, connection = await self._start(pool, path, body, fields)
                done = False
                try:
                    if status >= 400:
                        chunks = []
                        while True:
                            event = await self._next(connection, path)
                            if type(event) is h11.Data:
                                chunks.append(event.data)
                            elif type(event) is h11.EndOfMessage:
                                break
                        done = True
                        raise self._status_error(
                            path, HttpResponse(status, response_headers, b"".join(chunks)), secrets
                        )
                    state = _StreamState()
                    events = self._events(connection, path, state)
                    try:
                        yield events
                    finally:
                        await events.aclose()  # type: ignore[attr-defined]
                    done = state.done
                finally:
                    if done:
                        self._finish(pool, connection)
                    else:
                        _close_now(connection)
        finally:
            pool.slots.release()
        if scope.cancelled_caught:
            raise self._timed_out(path)

    async def _events(
        self, connection: _Connection, path: str, state: _StreamState
    ) -> AsyncIterator[SseEvent]:
        parser = SseParser()
        while True:
            event = await self._next(connection, path, streaming=True)
            if type(event) is h11.Data:
                for sse in parser.feed(event.data):
                    yield sse
            elif type(event) is h11.EndOfMessage:
                state.done = True
                return

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

    def _fields(
        self, headers: Mapping[str, str] | None, accept: str | None = None
    ) -> tuple[list[tuple[str, str]], set[str]]:
        """The request's header fields, and the values an error message must not show."""
        if not headers and accept is None:
            return self._base_fields, self._secrets
        merged = dict(self._headers)
        if accept is not None:
            merged["accept"] = accept
        extra = _checked_headers(headers)
        merged.update(extra)
        return list(merged.items()), self._secrets | _secrets(extra.values())

    async def _start(
        self, pool: _Pool, path: str, body: bytes, fields: list[tuple[str, str]]
    ) -> tuple[int, dict[str, str], _Connection]:
        """Send the request; return the status, headers and the connection to read on.

        A reused keep-alive connection that the server closed before answering gets one
        more try on a fresh connection: most likely the server closed it while idle, as
        the request went out."""
        if path[:1] != "/":
            raise ValueError(f"path {path!r} must start with '/', like '/chat/completions'")
        target = self._prefix + path
        request_fields = [*fields, ("content-length", str(len(body)))]
        try:
            request = h11.Request(method="POST", target=target, headers=request_fields)
        except h11.LocalProtocolError:
            # NOTE: never h11's text: it quotes the header value, maybe the key
            raise ValueError(
                f"POST {target}: h11 refused the request line or a header; check the "
                "path and the headers passed"
            ) from None
        reused = pool.take_idle()
        while True:
            connection = reused or await self._connect(path)
            connection.received = False
            conn = connection.conn
            try:
                data = conn.send(request)
                assert data is not None
                data += conn.send(h11.Data(data=body)) or b""
                data += conn.send(h11.EndOfMessage()) or b""
                await connection.stream.send_all(data)
                while True:
                    event = await self._next(connection, path, fresh=reused is not None)
                    if type(event) is h11.Response:
                        break
                    # an InformationalResponse (100 Continue): the real one follows
            except _Stale:
                _close_now(connection)
                reused = None
                continue
            except (trio.BrokenResourceError, OSError) as exc:
                _close_now(connection)
                if reused is not None:
                    reused = None
                    continue
                raise self._connection_error(
                    path, "failed while sending the request", exc
                ) from None
            except BaseException:
                _close_now(connection)
                raise
            headers: dict[str, str] = {}
            for name, value in event.headers:
                key = name.decode("latin-1")
                text = value.decode("latin-1")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
            return event.status_code, headers, connection

    async def _connect(self, path: str) -> _Connection:
        try:
            tcp = await trio.open_tcp_stream(self._host, self._port)
        except OSError as exc:
            raise self._connection_error(path, "could not connect", exc) from None
        if not self._tls:
            return _Connection(tcp, tcp.socket)
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
        return _Connection(stream, tcp.socket)

    async def _next(
        self, connection: _Connection, path: str, *, fresh: bool = False, streaming: bool = False
    ) -> Any:
        """The next h11 event; a dropped connection becomes a retryable ProviderError
        (or ``_Stale`` for a reused connection that got no byte of a response)."""
        conn = connection.conn
        closed = False
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if fresh and not connection.received:
                    raise _Stale from None
                if not closed:
                    what = "sent a response that is not valid HTTP/1.1"
                elif streaming:
                    what = "dropped the connection mid-stream"
                else:
                    what = "closed the connection before the response was complete"
                raise self._connection_error(path, what, exc) from None
            if event is h11.NEED_DATA:
                try:
                    data = await connection.stream.receive_some(_READ_SIZE)
                except (trio.BrokenResourceError, OSError) as exc:
                    if fresh and not connection.received:
                        raise _Stale from None
                    what = (
                        "dropped the connection mid-stream" if streaming else "lost the connection"
                    )
                    raise self._connection_error(path, what, exc) from None
                if data:
                    connection.received = True
                else:
                    closed = True
                if not data and not connection.received:
                    if fresh:
                        raise _Stale
                    raise self._connection_error(
                        path, "closed the connection without answering", None
                    )
                conn.receive_data(data)
                continue
            if type(event) is h11.ConnectionClosed:
                raise self._connection_error(path, "closed the connection", None)
            return event

    def _finish(self, pool: _Pool, connection: _Connection) -> None:
        conn = connection.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            pool.release(connection)
        else:  # ``connection: close`` from either side
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
        return ProviderError(
            f"POST {self._prefix}{path} answered HTTP {status}: {text}",
            retryable=status >= 500 or status in RETRYABLE_STATUSES,
            retry_after=retry_after(response.headers),
            status=status,
        )

    def _redact(self, text: str) -> str:
        return _redact(text, self._secrets)


class _StreamState:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class _Stale(Exception):
    """A reused keep-alive connection was closed by the server before it answered."""


class SseParser:
    """An incremental ``text/event-stream`` parser: feed bytes, get complete events.

    Lines end with CRLF, LF or CR; ``:`` starts a comment; a field's value loses one
    leading space; ``data`` lines accumulate; a blank line dispatches an event if it has
    data; an event left incomplete when the stream ends is dropped.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._buffer = ""
        self._skip_lf = False
        self._first = True
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        text = self._decoder.decode(chunk)
        if self._first and text:
            self._first = False
            text = text.removeprefix("\ufeff")
        if self._skip_lf and text:
            self._skip_lf = False
            text = text.removeprefix("\n")
        if not text:
            return []
        lines = _LINE_END.split(self._buffer + text)
        self._buffer = lines.pop()
        if self._buffer == "" and text.endswith("\r"):
            self._skip_lf = True  # the LF of a CRLF split across two chunks
        events: list[SseEvent] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(SseEvent(self._event, "\n".join(self._data)))
                self._event = ""
                self._data = []
                continue
            if line[0] == ":":
                continue
            name, colon, value = line.partition(":")
            if colon and value[:1] == " ":
                value = value[1:]
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value
            # ``id`` and ``retry`` steer a browser's reconnection; a model call never resumes
        return events


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP
    date), or None when neither says."""
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms >= 0:
            return ms / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - time.time())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


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
    socket = connection.socket
    if socket is not None:
        connection.socket = None
        socket.close()
