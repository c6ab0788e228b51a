"""``interlock mcp``: the proxy between an MCP client and an upstream MCP server.

The client talks to the proxy over stdio (its configuration launches ``interlock mcp ...``
in place of the server); the proxy reaches the upstream over stdio (a command line) or
Streamable HTTP (a URL), with the official ``mcp`` SDK on trio. Each connection is one
run of the machine, journaled in the store (SQLite by default) like any other run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import mcp.types as types
import trio
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.stdio import stdio_server
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from .._version import __version__
from ..core._exceptions import ConfigurationError
from ..runtime._runtime import open_supervisor
from ._proxy import McpRun

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

    from ..core._machine import Machine
    from ..stores import Store

__all__ = ["Upstream", "connect_upstream", "list_all_tools", "proxy_server", "serve_stdio"]


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

    def describe(self) -> str:
        return self.url or " ".join(self.command)


@contextlib.asynccontextmanager
async def connect_upstream(
    upstream: Upstream, on_message: Callable[[Any], Awaitable[None]] | None = None
) -> AsyncIterator[ClientSession]:
    """An initialized client session with the upstream server; ``on_message`` hears its
    notifications (``tools/list_changed``)."""
    if upstream.url is not None:
        from mcp.client.streamable_http import streamable_http_client

        async with streamable_http_client(upstream.url) as streams:
            read, write = streams[0], streams[1]
            async with ClientSession(read, write, message_handler=on_message) as session:
                await session.initialize()
                yield session
        return
    # stdio_client hands the child only a few variables (HOME, PATH, ...): pass ours on, so
    # an upstream configured by its environment (MEMORY_FILE_PATH, tokens) finds it.
    env = upstream.env if upstream.env is not None else dict(os.environ)
    params = StdioServerParameters(command=upstream.command[0], args=upstream.command[1:], env=env)
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, message_handler=on_message) as session,
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


def proxy_server(run: McpRun, transition_tool: str | None = None) -> Server[Any]:
    """The MCP server the client sees: ``tools/list`` and ``tools/call`` of ``run``."""

    sessions: list[Any] = []

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        if ctx.session not in sessions:
            sessions.append(ctx.session)
        listed = run.list_tools()
        if transition_tool is not None and run.allowed() is not None:
            legal = _legal_next(run)
            if legal:
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

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if ctx.session not in sessions:
            sessions.append(ctx.session)
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
                )
            return await run.transition(target)
        if run.rules.approval(params.name) and params.name in run.allowed():
            declined = await _approve(ctx, params)
            if declined is not None:
                return declined
        return await run.call_tool(params.name, params.arguments)

    async def changed() -> None:
        for session in list(sessions):
            with contextlib.suppress(Exception):
                await session.send_tool_list_changed()

    run.on_state_change = changed
    return Server(
        "interlock-mcp",
        version=__version__,
        instructions=f"interlock holds this session to the machine {run.machine.name!r} (run {run.run_id})",
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
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
    runs: list[McpRun] = []

    async def heard(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            for run in runs:  # read the list again before the next call, and compare
                run.stale = True

    async with connect_upstream(upstream, heard) as up:
        tools = await list_all_tools(up)
        machine, rules = _build(machine_source, tools)

        async def forward(
            name: str, args: dict[str, Any], meta: dict[str, Any]
        ) -> types.CallToolResult:
            return await up.call_tool(name, args, meta=_strip(meta) or None)

        async with open_supervisor([machine], store, stats=stats) as supervisor:
            if on_supervisor is not None:  # e.g. the CLI's metrics, which read its runs
                on_supervisor(supervisor)
            run = await McpRun.open(
                supervisor, machine, session, forward, tools, rules, inputs=inputs
            )
            run.refresh = partial(list_all_tools, up)
            runs.append(run)
            server = proxy_server(run, getattr(rules, "transition_tool", None))
            print(
                f"interlock mcp: run {run.run_id} of {machine.name!r} in state {run.state}, "
                f"upstream {upstream.describe()}",
                file=sys.stderr,
                flush=True,
            )
            async with stdio_server() as (read, write):
                await server.run(
                    read,
                    write,
                    server.create_initialization_options(NotificationOptions(tools_changed=True)),
                )


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
    return machine_source(tools)


def run_sync(coro_fn: Any, *args: Any) -> None:  # pragma: no cover - the CLI's entry
    trio.run(coro_fn, *args)
