"""``interlock mcp --http``: the proxy served over Streamable HTTP, many runs at once.

One upstream connection and one supervisor serve every client; each agent session is a
run of its own. Which run a request belongs to:

* a request that names its run, in its ``_meta`` (:data:`RUN_META`,
  ``"dev.interlock/run"``) or in the ``Interlock-Run`` header, belongs to that run (the
  run id that every result's ``_meta`` carries under the same key);
* else a stateful (2025-11-25) client's ``Mcp-Session-Id`` maps to the run its session
  started;
* else a ``tools/call`` starts a new run ``mcp-HANDLE-1`` (HANDLE a fresh random token),
  and its result's ``_meta`` names it: a stateless client (2026-07-28, which has no
  session) sends it back with its next requests to stay in that run. A ``tools/list``
  that names no run starts none: it lists what a new run allows.

A run id is a bearer handle: whoever sends it drives that run. A run whose process
stopped is picked up again from the journal when a request names it.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import signal
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from ..core._exceptions import RunNotFound
from ._proxy import INVALID_PARAMS, RUN_META, McpRun
from ._serve import (
    Proxied,
    Runs,
    mark_duplicates,
    proxied,
    proxy_server,
    request_header,
    request_traceparent,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..stores import Store
    from ._serve import Upstream

__all__ = ["RUN_HEADER", "HttpRuns", "McpHttpServer", "serve_http"]

log = logging.getLogger("interlock.mcp")

#: The HTTP header by which a request names its run (as ``_meta[RUN_META]`` does).
RUN_HEADER = "interlock-run"
#: The session header of the 2025-11-25 Streamable HTTP transport.
SESSION_HEADER = "mcp-session-id"
#: The largest request body served (a larger one is answered 413).
DEFAULT_MAX_BODY = 4 * 1024 * 1024
#: The most runs held at once (ended runs are let go of first).
DEFAULT_MAX_RUNS = 10_000
#: JSON-RPC's internal error.
INTERNAL_ERROR = -32603
#: JSON-RPC's invalid request.
INVALID_REQUEST = -32600
#: The environment variable holding the bearer token clients must send (if set).
TOKEN_ENV = "INTERLOCK_MCP_TOKEN"
#: The endpoint's path.
PATH = "/mcp"

#: The run ids this transport mints: ``mcp-`` + 32 hex digits + ``-N``. Only these are
#: picked up from the journal by name (not a stdio session's runs).
_MINTED = re.compile(r"mcp-([0-9a-f]{32})-([1-9][0-9]{0,8})")


class HttpRuns(Runs):
    """The runs of an HTTP proxy: by run id, and by the session that started each."""

    def __init__(
        self,
        guarded: Proxied,
        *,
        inputs: Mapping[str, Any] | None = None,
        max_runs: int = DEFAULT_MAX_RUNS,
    ) -> None:
        super().__init__(guarded.machine, guarded.tools, guarded.transition_tool, guarded.rules)
        self.guarded = guarded
        self.inputs = dict(inputs or {})
        self.max_runs = max_runs
        self.runs: dict[str, McpRun] = {}
        self.sessions: dict[str, McpRun] = {}  # Mcp-Session-Id -> its run
        # run id -> (Mcp-Session-Id -> that session's latest ServerSession): where a
        # handshake-era client hears tools/list_changed when its run moves
        self._listeners: dict[str, dict[str, Any]] = {}
        self._opening = trio.Lock()
        self._starting: dict[str, trio.Lock] = {}  # Mcp-Session-Id -> its run being started

    async def resolve(self, ctx: Any, *, mint: bool) -> McpRun | None:
        named = _named_run(ctx)
        # NOTE: only the handshake era has sessions, which the SDK checks (an unknown id
        # is a 404 before any handler); a 2026-07-28 request's Mcp-Session-Id is the
        # client's say-so, and does not count
        legacy = ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS
        session_id = request_header(ctx, SESSION_HEADER) if legacy else None
        if named is not None:
            run = await self._named(named)
        elif session_id is not None and session_id in self.sessions:
            run = self.sessions[session_id]
        elif not mint:
            return None
        elif session_id is None:
            run = await self._mint(request_traceparent(ctx))
        else:  # a session's first calls may come at once: one run for them all
            lock = self._starting.setdefault(session_id, trio.Lock())
            try:
                async with lock:
                    run = self.sessions.get(session_id) or await self._mint(
                        request_traceparent(ctx)
                    )
            finally:
                if not lock.locked() and not lock.statistics().tasks_waiting:
                    self._starting.pop(session_id, None)
        if session_id is not None:
            self.sessions.setdefault(session_id, run)
            self._listeners.setdefault(run.run_id, {})[session_id] = ctx.session
        return run

    async def _mint(self, trace: str | None = None) -> McpRun:
        g = self.guarded
        if len(self.runs) >= self.max_runs:
            self._forget_ended()
            if len(self.runs) >= self.max_runs:
                # NOTE: a client that never sends its run back starts a run per call:
                # bounded, so such a client cannot grow the proxy's memory without end
                raise MCPError(
                    INTERNAL_ERROR,
                    f"the proxy holds {self.max_runs} runs, the most it holds; send back "
                    f"the run id of a result's _meta ({RUN_META!r}) to go on in that run",
                )
        handle = secrets.token_hex(16)
        run = await McpRun.open(
            g.supervisor,
            g.machine,
            handle,
            g.forward,
            g.tools,
            g.rules,
            inputs=self.inputs,
            trace=trace,
        )
        self._keep(run)
        log.info("run %s started", run.run_id)
        return run

    async def _named(self, run_id: str) -> McpRun:
        run = self.runs.get(run_id)
        if run is not None:
            return run
        found = _MINTED.fullmatch(run_id)
        if found is None:
            raise _unknown(run_id)
        g = self.guarded
        async with self._opening:  # two requests naming it at once get the same McpRun
            run = self.runs.get(run_id)
            if run is not None:
                return run
            try:
                record = await g.supervisor.store.get_run(run_id)
            except RunNotFound:
                raise _unknown(run_id) from None
            if record.machine != g.machine.name:
                raise _unknown(run_id)
            if record.outcome not in ("running", "escalated"):
                raise MCPError(
                    INVALID_PARAMS,
                    f"run {run_id} has {record.outcome} in {record.state}; send no "
                    f"{RUN_META!r} (nor {RUN_HEADER} header) to start a new run",
                )
            run = await McpRun.open(g.supervisor, g.machine, found[1], g.forward, g.tools, g.rules)
            if run.run_id != run_id:  # a newer run of the same handle is the live one
                raise _unknown(run_id)
            self._keep(run)
            log.info("run %s picked up from the journal", run_id)
            return run

    def _forget_ended(self) -> None:
        """Let go of the runs that completed, failed or stopped (their journals stay; an
        escalated run waits for its operator and is kept)."""
        ended = {
            run_id
            for run_id, run in self.runs.items()
            if run.outcome not in ("running", "escalated")
        }
        for run_id in ended:
            del self.runs[run_id]
            self.guarded.untrack(run_id)
            self._listeners.pop(run_id, None)
            self.forget_listeners(run_id)
        for session_id, run in list(self.sessions.items()):
            if run.run_id in ended:
                del self.sessions[session_id]

    def _keep(self, run: McpRun) -> None:
        self.runs[run.run_id] = run
        self.guarded.track(run)

        async def changed() -> None:
            for session in list(self._listeners.get(run.run_id, {}).values()):
                try:
                    await session.send_tool_list_changed()
                except Exception:  # the session is gone; its client hears it no more
                    continue
            await self.publish_changed(run.run_id)  # 2026-07-28: its listen streams

        run.on_state_change = changed

    def instructions(self) -> str:
        return (
            f"{super().instructions()}. Each session is a run; every result's _meta names "
            f"it under {RUN_META!r}: send it back in a request's _meta (or the Interlock-Run "
            "header) to stay in that run."
        )


def _named_run(ctx: Any) -> str | None:
    """The run the request names: its ``_meta`` key, else its header."""
    meta = ctx.meta or {}
    named = meta.get(RUN_META) if isinstance(meta, Mapping) else None
    if named is None:
        named = request_header(ctx, RUN_HEADER)
    if named is None:
        return None
    if not isinstance(named, str) or not named:
        raise MCPError(INVALID_PARAMS, f"{RUN_META} names a run by its id, a string")
    return named


def _unknown(run_id: str) -> MCPError:
    shown = run_id if len(run_id) <= 80 else run_id[:77] + "..."
    return MCPError(
        INVALID_PARAMS,
        f"no run {shown!r} here; send no {RUN_META!r} (nor {RUN_HEADER} header) to start a new run",
    )


class _Guard:
    """The ASGI app in front of the SDK's: a request without the bearer token (when the
    proxy has one) is answered 401 before anything reads it; a POST body is read whole
    (up to ``max_body``) and a ``tools/call`` that names a key twice is marked for the
    handler (:func:`mark_duplicates`), as the stdio reader does: the SDK's JSON reader
    would keep the last value, silently."""

    def __init__(self, app: Any, token: str | None, max_body: int) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.max_body = max_body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.token is not None and not self._authorized(scope):
            await _unauthorized(send)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the SDK see it
                await self.app(scope, _replay(chunks, receive, more=False, last=message), send)
                return
            body = message.get("body", b"")
            chunks.append(body)
            size += len(body)
            more = bool(message.get("more_body"))
            if size > self.max_body:  # the SDK answers 413; nothing to mark
                if more:  # the client sends the rest first, then hears the 413
                    await _drain(receive)
                await self.app(scope, _replay(chunks, receive, more=False), send)
                return
        raw = b"".join(chunks)
        marked = mark_duplicates(raw) if b"tools/call" in raw else None
        if marked is not None:
            raw = marked
            scope = dict(scope)
            scope["headers"] = [
                (k, str(len(raw)).encode() if k == b"content-length" else v)
                for k, v in scope["headers"]
            ]
        await self.app(scope, _replay([raw], receive, more=False), send)

    def _authorized(self, scope: Any) -> bool:
        assert self.token is not None
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    given.strip(), self.token
                )
        return False


#: What is read and dropped of a body refused as too large, at most, before the answer.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 5.0


async def _drain(receive: Any) -> None:
    """Read and drop the rest of a body refused as too large (up to :data:`DRAIN_BYTES`,
    for :data:`DRAIN_SECONDS`) before it is answered: answered first, the connection was
    closed while the client still sent, and reset, and the client lost the 413 (seen: 1 run
    in 14 of a 10 MB body)."""
    drained = 0
    with trio.move_on_after(DRAIN_SECONDS):
        while drained < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body"):
                return


def _replay(chunks: list[bytes], receive: Any, *, more: bool, last: Any = None) -> Any:
    """A ``receive`` that gives ``chunks`` (one message) first, then ``last`` or the
    client's own messages."""
    pending: list[Any] = [{"type": "http.request", "body": b"".join(chunks), "more_body": more}]
    if last is not None:
        pending.append(last)

    async def replayed() -> Any:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


async def _unauthorized(send: Any) -> None:
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": None,
            "error": {
                "code": INVALID_REQUEST,
                "message": (
                    "this proxy takes requests with its token only: send the header "
                    "'Authorization: Bearer TOKEN' (the INTERLOCK_MCP_TOKEN it was started with)"
                ),
            },
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="interlock-mcp"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class McpHttpServer:
    """A proxy being served over HTTP (what :func:`serve_http` hands ``task_status``)."""

    def __init__(self, url: str, runs: HttpRuns, stop: trio.Event) -> None:
        self.url = url
        self.runs = runs
        self._stop = stop

    def stop(self) -> None:
        """Stop serving: finish the requests in flight, then return (as SIGTERM does)."""
        self._stop.set()


async def serve_http(
    machine_source: Any,
    upstream: Upstream,
    store: Store,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    inputs: Mapping[str, Any] | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    max_runs: int = DEFAULT_MAX_RUNS,
    token: str | None = None,
    graceful_timeout: float = 3.0,
    handle_signals: bool = False,
    stats: Any = None,
    on_supervisor: Callable[[Any], None] | None = None,
    task_status: trio.TaskStatus[McpHttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the proxy over Streamable HTTP at ``http://HOST:PORT/mcp`` until stopped.

    Clients of the 2026-07-28 protocol (stateless, one POST per request) and of
    2025-11-25 (a session opened by ``initialize``) are both served. ``port`` 0 picks a
    free port; the URL is printed on stderr once listening, and handed to
    ``task_status`` in a :class:`McpHttpServer`. A body over ``max_body`` bytes is
    answered 413; past ``max_runs`` runs held at once (ended ones let go of), a request
    that would start another is refused. With a ``token``, a request without the header
    ``Authorization: Bearer TOKEN`` is answered 401. :meth:`McpHttpServer.stop` (or SIGTERM or SIGINT,
    with ``handle_signals``) stops it: the requests in flight get ``graceful_timeout``
    seconds to finish.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    async with proxied(
        machine_source, upstream, store, stats=stats, on_supervisor=on_supervisor
    ) as guarded:
        runs = HttpRuns(guarded, inputs=inputs, max_runs=max_runs)
        server = proxy_server(runs)
        # NOTE: stateful: a handshake-era client gets a session (and so list_changed on
        # its GET stream, and a run without sending the handle back); 2026-07-28 requests
        # are single exchanges whatever this says. The SDK turns DNS-rebinding protection
        # on for a loopback host.
        app: Any = server.streamable_http_app(
            streamable_http_path=PATH,
            stateless_http=False,
            host=host,
            max_request_body_size=max_body,
        )
        app = _Guard(app, token, max_body)
        config = Config()
        config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        config.graceful_timeout = graceful_timeout
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.keep_alive_max_requests = 1_000_000
        stop = trio.Event()
        served = trio.Event()

        async def run_server(
            task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            try:
                await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
            finally:
                served.set()

        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_on_signals, stop)
            binds: list[str] = await nursery.start(run_server)
            url = binds[0] + PATH
            if host not in ("127.0.0.1", "localhost", "::1") and token is None:
                print(
                    f"interlock mcp: warning: listening on {host}, beyond this machine, with "
                    f"no token: set {TOKEN_ENV} to require 'Authorization: Bearer TOKEN' "
                    "(a run id is all it takes to drive a run)",
                    file=sys.stderr,
                    flush=True,
                )
            print(
                f"interlock mcp: serving {url} (machine {guarded.machine.name!r}, upstream "
                f"{upstream.describe()})",
                file=sys.stderr,
                flush=True,
            )
            task_status.started(McpHttpServer(url, runs, stop))
            # hypercorn returns once the requests in flight are answered (or their grace
            # is up) and the session manager has stopped
            await served.wait()
            nursery.cancel_scope.cancel()


async def _on_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: stopping", signal.Signals(signum).name)
            stop.set()
            return
