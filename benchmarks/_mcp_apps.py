"""The machines ``benchmarks.mcp_proxy`` puts in front of real MCP servers."""

from __future__ import annotations

from typing import Any

from interlock import App, BreakerPolicy, Budgets, Machine, Tool, Worker


async def _upstream(args: Any, ctx: Any) -> Any:  # the proxy's runs are external
    raise AssertionError("the upstream server executes the tools")


_TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
_WRITE = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"],
    "additionalProperties": False,
}
_BUDGETS = Budgets(tokens=10**12, steps=10**9, deadline=10.0**9)
#: A benchmark repeats one call on purpose: the repeat breaker would stop it.
_BREAKERS = BreakerPolicy(repeats=10**9)

#: A read-only call: mcp-server-time's get_current_time.
clock = App(
    [
        Machine(
            "clock",
            "ASK",
            {"ASK": Worker(next=["COMPLETED"], tools=["get_current_time"])},
            tools=[Tool("get_current_time", _upstream, _TIME, read_only=True)],
            budgets=_BUDGETS,
            breakers=_BREAKERS,
        )
    ]
)

#: A side-effecting call (neither read-only nor idempotent): the filesystem server's
#: write_file, each call with new content.
files = App(
    [
        Machine(
            "files",
            "WRITE",
            {"WRITE": Worker(next=["COMPLETED"], tools=["write_file"])},
            tools=[Tool("write_file", _upstream, _WRITE, repeatable=True)],
            budgets=_BUDGETS,
            breakers=_BREAKERS,
        )
    ]
)
