"""``interlock mcp``: the proxy between an MCP client and an upstream MCP server.

The client talks to the proxy over stdio (its configuration launches ``interlock mcp ...``
in place of the server); the proxy reaches the upstream over stdio (a command line) or
Streamable HTTP (a URL), with the official ``mcp`` SDK on trio. Each connection is one
run of the machine, journaled in the store (SQLite by default) like any other run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import mcp.types as types
import msgspec
import trio
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.stdio import stdio_server
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from .._version import __version__
from ..core._exceptions import ConfigurationError
from ..runtime._operators import serve_operator_requests
from ..runtime._runtime import open_supervisor
from ..stores import SQLiteStore
from ._proxy import RUN_META, McpRun, NoRules, listed_tools

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

    from ..core._machine import Machine
    from ..runtime._supervisor import Supervisor
    from ..stores import Store

__all__ = [
    "Runs",
    "Upstream",
    "connect_upstream",
    "list_all_tools",
    "proxy_server",
    "serve_stdio",
]


class Upstream:
    """Where the upstream server is: a command line (stdio) or a URL (Streamable HTTP)."""

    def __init__(
        self,
        command: Sequence[str] = (),
        url: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if bool(command) == bool(url):
            raise ConfigurationError(
                "give the upstream MCP server either as a command after `--` (stdio) or as "
                "--upstream-url URL (Streamable HTTP), not both or neither"
            )
        self.command = list(command)
        self.url = url
        self.env = dict(env) if env is not None else None
        if self.command:
            import shutil

            path = (self.env or os.environ).get("PATH")
            if shutil.which(self.command[0], path=path) is None:
                raise ConfigurationError(
                    f"the upstream command {self.command[0]!r} is not found (not on PATH, "
                    "nor an executable file): give the MCP server's command line after `--`, "
                    "e.g. `-- npx -y @modelcontextprotocol/server-memory`"
                )

    def describe(self) -> str:
        return self.url or " ".join(self.command)


@contextlib.asynccontextmanager
async def connect_upstream(
    upstream: Upstream, on_message: Callable[[Any], Awaitable[None]] | None = None
) -> AsyncIterator[ClientSession]:
    """An initialized client session with the upstream server; ``on_message`` hears its
    notifications (``tools/list_changed``)."""
    handler: Any = on_message  # the SDK types it as taking its message union
    if upstream.url is not None:
        from mcp.client.streamable_http import streamable_http_client

        async with streamable_http_client(upstream.url) as streams:
            read, write = streams[0], streams[1]
            async with ClientSession(read, write, message_handler=handler) as session:
                await session.initialize()
                yield session
        return
    # stdio_client hands the child only a few variables (HOME, PATH, ...): pass ours on, so
    # an upstream configured by its environment (MEMORY_FILE_PATH, tokens) finds it.
    env = upstream.env if upstream.env is not None else dict(os.environ)
    params = StdioServerParameters(command=upstream.command[0], args=upstream.command[1:], env=env)
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, message_handler=handler) as session,
    ):
        await session.initialize()
        yield session


async def list_all_tools(session: ClientSession) -> list[types.Tool]:
    """Every tool of the upstream, all pages."""
    tools: list[types.Tool] = []
    cursor = None
    while True:
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _strip(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``_meta`` to forward: the spec's per-connection keys stay on this hop."""
    return {k: v for k, v in (meta or {}).items() if not k.startswith("io.modelcontextprotocol/")}


class Runs:
    """Which run a request belongs to: the one run of a stdio connection, or, over HTTP,
    the run a request names (or its session maps to, or a new one).

    ``resolve(ctx, mint=...)`` answers for the request whose context is ``ctx``; with
    ``mint=False`` (``tools/list``) it may answer None, and the client sees what a new
    run would allow.
    """

    def __init__(
        self,
        machine: Machine,
        tools: Sequence[types.Tool],
        transition_tool: str | None,
        rules: Any = None,
    ) -> None:
        self.machine = machine
        self.tools = {t.name: t for t in tools}
        self.transition_tool = transition_tool
        self.rules = rules if rules is not None else NoRules()

        # run id -> its listen streams' bus and handler (2026-07-28 clients hear their
        # run's tools/list_changed on a subscriptions/listen stream, not the session)
        self._listening: dict[str | None, tuple[Any, Any]] = {}

    async def resolve(self, ctx: Any, *, mint: bool) -> McpRun | None:
        raise NotImplementedError

    def instructions(self) -> str:
        return f"interlock holds this session to the machine {self.machine.name!r}"

    def listen_handler(self, run_id: str | None) -> Any:
        """The ``subscriptions/listen`` handler of ``run_id``'s streams (None: a client
        that names no run yet, whose streams hear nothing until it names one)."""
        found = self._listening.get(run_id)
        if found is None:
            from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler

            bus = InMemorySubscriptionBus()
            found = self._listening[run_id] = (bus, ListenHandler(bus, max_subscriptions=64))
        return found[1]

    async def publish_changed(self, run_id: str) -> None:
        """Tell ``run_id``'s listen streams its tool list changed."""
        found = self._listening.get(run_id)
        if found is not None:
            from mcp.server.subscriptions import ToolsListChanged

            await found[0].publish(ToolsListChanged())

    def forget_listeners(self, run_id: str) -> None:
        found = self._listening.pop(run_id, None)
        if found is not None:
            found[1].close()


class _OneRun(Runs):
    """A stdio connection: one run, and tools/list_changed on the connection when it moves."""

    def __init__(self, run: McpRun, transition_tool: str | None) -> None:
        super().__init__(run.machine, list(run.tools.values()), transition_tool, run.rules)
        self.run = run
        # NOTE: the SDK builds a ServerSession per request, all over the one connection:
        # keep the last one, or a state change would notify once per request ever made.
        self.session: Any = None
        run.on_state_change = self.changed

    async def resolve(self, ctx: Any, *, mint: bool) -> McpRun:
        self.session = ctx.session
        return self.run

    async def changed(self) -> None:
        if self.session is not None:  # a 2025-11-25 client hears it on the session
            with contextlib.suppress(Exception):
                await self.session.send_tool_list_changed()
        await self.publish_changed(self.run.run_id)  # a 2026-07-28 one on its listen stream

    def instructions(self) -> str:
        return f"{super().instructions()} (run {self.run.run_id})"


def proxy_server(runs: McpRun | Runs, transition_tool: str | None = None) -> Server[Any]:
    """The MCP server the client sees: ``tools/list`` and ``tools/call`` of the run each
    request belongs to (``runs``; a :class:`McpRun` is the one run of every request)."""
    if isinstance(runs, McpRun):
        runs = _OneRun(runs, transition_tool)
    source = runs
    transition_tool = source.transition_tool
    machine = source.machine

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        run = await source.resolve(ctx, mint=False)
        if run is None:  # no run yet: what a new run allows
            tables = machine.tables
            initial = tables.state_id(machine.initial)
            listed = listed_tools(machine, source.tools, tables.allowed_tools(initial))
            legal = list(tables.legal_next(initial))
        else:
            listed = run.list_tools()
            legal = _legal_next(run)
            listed.meta = {RUN_META: run.run_id}
        if transition_tool is not None and legal:
            listed.tools.append(
                types.Tool(
                    name=transition_tool,
                    description=("Move the run to its next state: " + ", ".join(legal)),
                    input_schema={
                        "type": "object",
                        "properties": {"to": {"enum": legal}},
                        "required": ["to"],
                        "additionalProperties": False,
                    },
                )
            )
        return listed

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> Any:
        twice = _meta_value(params.meta, DUPLICATE_META)
        if twice:  # read exactly, the call names a key twice: which value would be meant?
            written = _meta_value(params.meta, DUPLICATE_ARGS_META)
            if not isinstance(written, str) or params.name == transition_tool:
                return _named_twice(params.name, str(twice))
            # in the arguments: the gate refuses them as they were written, journaled
            run = await source.resolve(ctx, mint=True)
            assert run is not None
            _traced(run, ctx)
            return await run.call_tool(params.name, None, written=written)
        run = await source.resolve(ctx, mint=False)
        approved = False
        if run is None:
            # NOTE: a call that waits for approval starts no run until approved: a
            # 2026-07-28 client that names no run would start one per round otherwise
            tables = machine.tables
            initial = tables.allowed_tools(tables.state_id(machine.initial))
            if source.rules.approval(params.name) and params.name in initial:
                declined = await _approve(ctx, params)
                if declined is not None:
                    return declined
                approved = True
            run = await source.resolve(ctx, mint=True)
            assert run is not None
        if transition_tool is not None and params.name == transition_tool:
            target = (params.arguments or {}).get("to")
            if not isinstance(target, str):
                return types.CallToolResult(
                    content=[
                        types.TextContent(
                            type="text",
                            text=(
                                f'{transition_tool} takes {{"to": STATE}}; the next states are: '
                                + ", ".join(_legal_next(run))
                            ),
                        )
                    ],
                    is_error=True,
                    _meta={RUN_META: run.run_id},
                )
            _traced(run, ctx)
            return await run.transition(target)
        if not approved and run.rules.approval(params.name) and params.name in run.allowed():
            declined = await _approve(ctx, params)
            if declined is not None:
                return declined
        _traced(run, ctx)
        return await run.call_tool(params.name, params.arguments)

    async def on_listen(ctx: Any, params: Any) -> Any:
        run = await source.resolve(ctx, mint=False)
        handler = source.listen_handler(run.run_id if run is not None else None)
        return await handler(ctx, params)

    def input_schema(name: str) -> Mapping[str, Any] | None:
        # NOTE: without it, the SDK checks a 2026-07-28 tools/call's Mcp-Param headers
        # against a tools/list it makes first, in the call's name: a second resolve.
        tool = machine.tool_by_name.get(name)
        upstream = source.tools.get(name)
        if tool is None or upstream is None:
            return None
        return tool.validator.json_schema() or upstream.input_schema

    return Server(
        "interlock-mcp",
        version=__version__,
        instructions=source.instructions(),
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
        on_subscriptions_listen=on_listen,
        get_tool_input_schema=input_schema,
    )


_APPROVE_SCHEMA = {
    "type": "object",
    "properties": {"approve": {"type": "boolean", "description": "run this call"}},
    "required": ["approve"],
}


async def _approve(ctx: Any, params: types.CallToolRequestParams) -> Any:
    """Ask the end user to approve ``params`` (the exact arguments) before the call is
    proposed: None if approved, else the answer to give (a declined call, or the
    input-required result a 2026-07-28 client answers by calling again)."""
    import hashlib

    args = params.arguments or {}
    shown = json.dumps(args, sort_keys=True, ensure_ascii=False)
    message = f"Allow the agent to call {params.name} with these arguments?\n{shown}"
    # the answer is bound to these exact arguments: a retry with others is asked anew
    state = "approve:" + hashlib.sha256(f"{params.name}\0{shown}".encode()).hexdigest()
    if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
        responses = getattr(params, "input_responses", None) or {}
        answer = (
            responses.get("approve") if getattr(params, "request_state", None) == state else None
        )
        if answer is None:
            return types.InputRequiredResult(
                input_requests={
                    "approve": types.ElicitRequest(
                        params=types.ElicitRequestFormParams(
                            message=message, requested_schema=_APPROVE_SCHEMA
                        )
                    )
                },
                request_state=state,
            )
    else:
        try:
            answer = await ctx.session.elicit_form(
                message, _APPROVE_SCHEMA, related_request_id=ctx.request_id
            )
        except Exception as exc:  # the client cannot be asked (no elicitation, no channel)
            return _declined(params.name, f"the client could not ask the user ({exc})")
    action = getattr(answer, "action", None)
    content = getattr(answer, "content", None) or {}
    if action == "accept" and content.get("approve") is True:
        return None
    return _declined(params.name, f"the user did not approve it ({action or 'no answer'})")


def _declined(tool: str, why: str) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"{tool} was not called: {why}")],
        is_error=True,
        structured_content={"approved": False, "reason": why},
    )


def _legal_next(run: McpRun) -> list[str]:
    if run.allowed() == () and run.supervisor.external.get(run.run_id) is None:
        return []
    try:
        return list(run.supervisor.view(run.run_id).legal_next)
    except Exception:
        return []


async def serve_stdio(
    machine_source: Any,
    upstream: Upstream,
    store: Store,
    *,
    session: str = "default",
    inputs: Mapping[str, Any] | None = None,
    stats: Any = None,
    on_supervisor: Callable[[Any], None] | None = None,
) -> None:
    """Serve one MCP client on this process's stdin/stdout until it disconnects.

    ``machine_source``: a :class:`~interlock.Machine` (rules: none), or a callable
    ``(upstream_tools) -> (machine, rules)`` that builds it from the upstream's tools (a
    machine file).
    """
    async with proxied(
        machine_source, upstream, store, stats=stats, on_supervisor=on_supervisor
    ) as guarded:
        run = await McpRun.open(
            guarded.supervisor,
            guarded.machine,
            session,
            guarded.forward,
            guarded.tools,
            guarded.rules,
            inputs=inputs,
            # NOTE: a stdio server is a process its client starts, before any request:
            # a new run continues the trace of the client's TRACEPARENT, OpenTelemetry's
            # carrier of a trace into a process it starts (each request's own _meta
            # traceparent then parents the verdict on it; see _traced).
            trace=os.environ.get("TRACEPARENT") or None,
        )
        guarded.track(run)
        server = proxy_server(run, guarded.transition_tool)
        print(
            f"interlock mcp: run {run.run_id} of {guarded.machine.name!r} in state {run.state}, "
            f"upstream {upstream.describe()}",
            file=sys.stderr,
            flush=True,
        )
        async with _exact_stdio() as (read, write):
            await server.run(
                read,
                write,
                server.create_initialization_options(NotificationOptions(tools_changed=True)),
            )


#: The ``_meta`` key under which the proxy's own reader marks a ``tools/call`` that names
#: a key twice (the SDK's JSON reader keeps the last value, silently).
DUPLICATE_META = "dev.interlock/duplicate-key"
#: The ``_meta`` key under which it puts the call's arguments as their writer wrote them.
DUPLICATE_ARGS_META = "dev.interlock/duplicate-key-arguments"


def request_header(ctx: Any, name: str) -> str | None:
    """The HTTP header ``name`` of a request (Streamable HTTP), None if absent or empty
    (or on stdio, which has none)."""
    request = getattr(ctx, "request", None)
    headers = getattr(request, "headers", None)
    if headers is None:
        return None
    value = headers.get(name)
    return value or None


def request_traceparent(ctx: Any) -> str | None:
    """The W3C trace context of a request: its ``_meta`` (as the MCP SDK carries it),
    else its HTTP header (Streamable HTTP); None if it has neither."""
    found = _meta_value(getattr(ctx, "meta", None), "traceparent")
    if isinstance(found, str) and found:
        return found
    return request_header(ctx, "traceparent")


def _traced(run: McpRun, ctx: Any) -> None:
    """Trace the verdict on this request's call under the request's own span (each
    request's ``_meta.traceparent``, not only the one that started the run)."""
    tracing = run.supervisor.tracing
    if tracing is not None:
        tracing.request(run.run_id, request_traceparent(ctx))


def _meta_value(meta: Any, key: str) -> Any:
    """``meta[key]``, whichever shape the SDK gives a request's ``_meta`` in."""
    if meta is None:
        return None
    if isinstance(meta, dict):
        return meta.get(key)
    return (getattr(meta, "model_extra", None) or {}).get(key)


def _named_twice(tool: str, path: str) -> types.CallToolResult:
    message = (
        f"the call of {tool} names the key {path} twice (a reader keeps one value, and "
        "which one differs); name each key once"
    )
    violation = {
        "code": "malformed",
        "path": path,
        "message": message,
        "hint": "send the call again with each key once",
    }
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)],
        is_error=True,
        structured_content={"violations": [violation]},
    )


def mark_duplicates(raw: bytes) -> bytes | None:
    """``raw`` (one JSON-RPC message) with a ``tools/call`` that names a key twice marked
    in its ``_meta``, for the handler to refuse: the path of the first such key (from the
    params down) and, when it is in the arguments, the arguments as their writer wrote
    them (for the gate, which journals them as a malformed proposal). None if there is
    nothing to mark."""
    from ..core._hotpath import JSON_DUPLICATE_KEY, scan_json

    found = scan_json(raw)
    if found is None or found[0] != JSON_DUPLICATE_KEY:
        return None
    try:
        message = json.loads(raw)
        exact = msgspec.json.decode(raw, type=_RawCall)
    except (ValueError, msgspec.DecodeError):
        return None
    params = message.get("params") if isinstance(message, dict) else None
    if not isinstance(params, dict) or message.get("method") != "tools/call":
        return None  # elsewhere the SDK's reading is the answer
    path = ".".join(str(p) for p in found[2][1:])
    meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
    marks: dict[str, Any] = {DUPLICATE_META: path}
    if path.startswith("arguments.") and exact.params.arguments:
        marks[DUPLICATE_ARGS_META] = bytes(exact.params.arguments).decode("utf-8", "replace")
    params["_meta"] = {**meta, **marks}
    return json.dumps(message).encode()


class _RawParams(msgspec.Struct):
    arguments: msgspec.Raw = msgspec.Raw(b"")


class _RawCall(msgspec.Struct):
    params: _RawParams


def _mark_duplicates(line: str) -> str:
    marked = mark_duplicates(line.encode("utf-8", "replace"))
    return line if marked is None else marked.decode() + "\n"


class _ExactLines:
    """The client's lines as the SDK's stdio server reads them, each checked first."""

    def __init__(self, lines: Any) -> None:
        self._lines = lines

    def __aiter__(self) -> Any:
        return self._checked()

    async def _checked(self) -> Any:
        async for line in self._lines:
            yield _mark_duplicates(line)


@contextlib.asynccontextmanager
async def _exact_stdio() -> AsyncIterator[Any]:
    """The SDK's stdio server on this process's stdin and stdout, its input read exactly
    (a key named twice is refused, not resolved by the SDK's reader keeping the last).

    As the SDK's own stdio server does, the wire moves to private descriptors while it
    serves: fd 0 reads the null device and fd 1 writes to stderr, so a stray ``print``
    (a guard's, a library's) or a child's output never lands on the wire; both are
    restored on exit."""
    import io

    import anyio

    sys.stdout.flush()
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    # NOTE: never closed: a worker thread may still block reading the wire after the
    # transport exits, and a closed descriptor could be recycled under it
    reading = io.TextIOWrapper(
        os.fdopen(wire_in, "rb", closefd=False), encoding="utf-8", errors="replace"
    )
    writing = io.TextIOWrapper(os.fdopen(wire_out, "wb", closefd=False), encoding="utf-8")
    try:
        stdin = anyio.wrap_file(reading)
        stdout = anyio.wrap_file(writing)
        async with stdio_server(_ExactLines(stdin), stdout) as streams:  # type: ignore[arg-type]
            yield streams
    finally:
        with contextlib.suppress(OSError):
            os.dup2(wire_in, 0)
            os.dup2(wire_out, 1)


class Proxied:
    """What both transports serve: the upstream's tools, the machine (and its file's
    rules) that guards them, the supervisor, and ``forward``, the upstream call."""

    def __init__(
        self,
        supervisor: Supervisor,
        machine: Machine,
        rules: Any,
        tools: list[types.Tool],
        forward: Any,
    ) -> None:
        self.supervisor = supervisor
        self.machine = machine
        self.rules = rules
        self.tools = tools
        self.forward = forward
        self.transition_tool: str | None = getattr(rules, "transition_tool", None)
        self.refresh: Callable[[], Awaitable[Sequence[types.Tool]]] | None = None
        self._runs: dict[str, McpRun] = {}

    def track(self, run: McpRun) -> None:
        """Have ``run`` read the upstream's tools again when the upstream says they changed."""
        run.refresh = self.refresh
        self._runs[run.run_id] = run

    def untrack(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    async def resolved(self, run_id: str) -> None:
        """An operator resumed or aborted ``run_id``: its session hears it now (the
        tools it may call changed)."""
        run = self._runs.get(run_id)
        if run is not None and await run.refresh_ended() and run.on_state_change is not None:
            await run.on_state_change()

    def stale(self) -> None:
        for run in self._runs.values():  # read the list again before the next call, and compare
            run.stale = True


@contextlib.asynccontextmanager
async def proxied(
    machine_source: Any,
    upstream: Upstream,
    store: Store,
    *,
    stats: Any = None,
    on_supervisor: Callable[[Any], None] | None = None,
) -> AsyncIterator[Proxied]:
    """Connect to the upstream, build the machine from its tools, start a supervisor
    (counting into ``stats``, handed to ``on_supervisor``: the CLI's metrics)."""
    guarded: Proxied | None = None

    async def heard(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification) and guarded is not None:
            guarded.stale()

    async with connect_upstream(upstream, heard) as up:
        tools = await list_all_tools(up)
        machine, rules = _build(machine_source, tools)

        async def forward(
            name: str, args: dict[str, Any], meta: dict[str, Any]
        ) -> types.CallToolResult:
            forwarded: Any = _strip(meta) or None
            return await up.call_tool(name, args, meta=forwarded)

        async with (
            open_supervisor([machine], store, stats=stats) as supervisor,
            trio.open_nursery() as nursery,
        ):
            if on_supervisor is not None:
                on_supervisor(supervisor)
            guarded = Proxied(supervisor, machine, rules, tools, forward)
            guarded.refresh = partial(list_all_tools, up)
            if isinstance(store, SQLiteStore):
                # this process holds the journal: an operator's resume or abort of one of
                # its runs comes through the journal's inbox, and the agent hears of it
                nursery.start_soon(
                    partial(
                        serve_operator_requests, supervisor, store.path, on_done=guarded.resolved
                    )
                )
            yield guarded
            nursery.cancel_scope.cancel()


def _build(machine_source: Any, tools: list[types.Tool]) -> tuple[Machine, Any]:
    from ..core._machine import Machine

    if isinstance(machine_source, Machine):
        missing = sorted(set(machine_source.tool_by_name) - {t.name for t in tools})
        if missing:
            raise ConfigurationError(
                f"machine {machine_source.name!r} names tools the upstream does not have: "
                f"{', '.join(missing)}; the upstream's tools: {', '.join(t.name for t in tools)}"
            )
        return machine_source, None
    built: tuple[Machine, Any] = machine_source(tools)
    return built


def run_sync(coro_fn: Any, *args: Any) -> None:  # pragma: no cover - the CLI's entry
    trio.run(coro_fn, *args)
