"""The MCP proxy's added latency per ``tools/call`` (issue 36).

``python -m benchmarks.mcp_proxy [--calls N] [--rounds R] [--write]``

The official SDK's client calls a real upstream server directly, and the same client calls
the same server through ``interlock mcp`` (stdio on both hops), in turns (the order flipped
every round, so drift on a shared host hits both alike). Two calls:

- **read-only**: ``mcp-server-time``'s ``get_current_time`` (PyPI), a read-only tool: the
  gate, then the call, then the commit; the answer waits for no journal write (a crash
  that loses them loses nothing: the call is asked again);
- **side-effecting**: the npm filesystem server's ``write_file`` (each call new content), a
  tool that is neither read-only nor idempotent: the intent is durable (an fsync) before
  the call is forwarded; the commit is written after the answer (a crash before it leaves
  the call in doubt, settled as such).

A second table isolates the proxy's own work from the SDK's stdio hops: in one process,
:meth:`McpRun.call_tool <interlock.mcp._proxy.McpRun.call_tool>` (the gate, the journal
on SQLite FULL, the run's bookkeeping) against an upstream that answers at once, minus
calling that upstream directly.

The proxy's journal is SQLite with ``synchronous=FULL`` (every batch fsynced). Per call:
the client's wall time from request to answer; per figure the median over rounds of each
round's percentile. *Added* is proxied minus direct at the same percentile. An fsync of
this disk (a 4 KiB write and ``os.fsync`` in the journal's directory, the median of 200)
is measured in the same run, for the goal "at most one fsync plus 100 µs".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## MCP proxy: added latency per tools/call (issue 36)"
SIDES = ("direct", "relay", "proxy")
NPM = Path(os.environ.get("INTERLOCK_CI_NPM", Path.home() / ".cache/interlock-ci/npm"))


def _child(db: str, app: str, upstream: list[str]) -> None:
    """The proxy: ``interlock mcp`` on a FULL-synchronous SQLite journal."""
    import trio

    from interlock.mcp import Upstream, serve_stdio
    from interlock.stores import open_sqlite_store

    sys.path.insert(0, str(ROOT))
    from benchmarks import _mcp_apps

    machine = next(iter(getattr(_mcp_apps, app).machines.values()))

    async def main() -> None:
        store = await open_sqlite_store(db, synchronous="FULL")
        try:
            await serve_stdio(machine, Upstream(upstream), store, session="bench")
        finally:
            await store.aclose()

    trio.run(main)


def _relay(upstream: list[str]) -> None:
    """The floor: a pass-through proxy on the same SDK (its low-level Server in front of a
    ClientSession), with no gate and no journal: what a second stdio hop costs by itself."""
    import trio
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    from interlock.mcp import Upstream, connect_upstream

    async def main() -> None:
        async with connect_upstream(Upstream(upstream)) as up:

            async def list_tools(ctx: Any, params: Any) -> Any:
                return await up.list_tools()

            async def call_tool(ctx: Any, params: Any) -> Any:
                return await up.call_tool(params.name, params.arguments)

            server = Server("relay", on_list_tools=list_tools, on_call_tool=call_tool)
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

    trio.run(main)


def _upstreams(scratch: Path) -> dict[str, tuple[list[str], str, Any]]:
    server = (
        NPM / "node_modules" / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"
    )
    if not server.exists():
        raise SystemExit(f"{server} is missing: .ci/run installs the npm servers there")
    files = scratch / "files"
    files.mkdir(exist_ok=True)
    return {
        "read-only": (
            [sys.executable, "-m", "mcp_server_time", "--local-timezone=UTC"],
            "clock",
            lambda i: ("get_current_time", {"timezone": "UTC"}),
        ),
        "side-effecting": (
            ["node", str(server), str(files)],
            "files",
            lambda i: ("write_file", {"path": str(files / "out.txt"), "content": f"call {i}"}),
        ),
    }


async def _measure(params: Any, calls: int, make: Any) -> list[float]:
    from mcp import ClientSession, stdio_client

    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        for i in range(20):  # warm: imports, plans, the first tools/list the SDK sends
            name, args = make(10**6 + i)
            await client.call_tool(name, args)
        took = []
        for i in range(calls):
            name, args = make(i)
            started = time.perf_counter()
            result = await client.call_tool(name, args)
            took.append(time.perf_counter() - started)
            if result.is_error:
                raise RuntimeError(f"{name} failed: {result.content}")
        return took


def _in_process(app: str, calls: int, scratch: Path) -> tuple[list[float], list[float]]:
    """Per-call wall times of ``McpRun.call_tool`` in this process against an upstream that
    answers at once (journal: SQLite FULL), and of calling that upstream directly."""
    import mcp.types as types
    import trio

    from benchmarks import _mcp_apps
    from interlock import open_supervisor
    from interlock.mcp._proxy import McpRun
    from interlock.stores import open_sqlite_store

    machine = next(iter(getattr(_mcp_apps, app).machines.values()))
    tool = next(iter(machine.tool_by_name))

    async def upstream(name: str, args: Any, meta: Any) -> types.CallToolResult:
        await trio.lowlevel.checkpoint()
        return types.CallToolResult(content=[types.TextContent(type="text", text='{"ok": 1}')])

    def make(i: int) -> dict[str, Any]:
        if app == "clock":
            return {"timezone": "UTC"}
        return {"path": "/tmp/out.txt", "content": f"call {i}"}

    async def main() -> tuple[list[float], list[float]]:
        store = await open_sqlite_store(str(scratch / f"in-process-{app}.db"), synchronous="FULL")
        tools = [types.Tool(name=tool, input_schema={"type": "object"})]
        direct: list[float] = []
        proxied: list[float] = []
        try:
            async with open_supervisor([machine], store) as supervisor:
                run = await McpRun.open(supervisor, machine, "bench", upstream, tools)
                for i in range(calls + 50):
                    args = make(i)
                    started = time.perf_counter()
                    await upstream(tool, args, {})
                    middle = time.perf_counter()
                    result = await run.call_tool(tool, args)
                    ended = time.perf_counter()
                    if result.is_error:
                        raise RuntimeError(f"{tool} failed: {result.content}")
                    if i >= 50:  # the first ones warm the caches
                        direct.append(middle - started)
                        proxied.append(ended - middle)
        finally:
            await store.aclose()
        return direct, proxied

    return trio.run(main)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _fsync_us(directory: Path) -> float:
    path = directory / "fsync-probe"
    times = []
    with open(path, "wb") as f:
        for _ in range(200):
            f.write(b"x" * 4096)
            f.flush()
            started = time.perf_counter()
            os.fsync(f.fileno())
            times.append(time.perf_counter() - started)
    path.unlink()
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # the proxy's process: --child DB APP COMMAND...
        _child(argv[1], argv[2], argv[3:])
        return 0
    if argv[:1] == ["--relay"]:  # the bare relay's process: --relay COMMAND...
        _relay(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mcp_proxy", description=__doc__)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per run (300)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of direct/proxied (3)")
    parser.add_argument("--write", action="store_true", help=f"write the table into {RESULTS}")
    args = parser.parse_args(argv)

    import trio
    from mcp import StdioServerParameters

    started = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="interlock-mcp-bench-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    figures: dict[str, dict[str, list[float]]] = {}
    for kind, (command, app, make) in _upstreams(scratch).items():
        per = figures.setdefault(kind, {f"{side}{q}": [] for side in SIDES for q in (50, 99)})
        for round_ in range(args.rounds):
            order = list(SIDES) if round_ % 2 == 0 else list(reversed(SIDES))
            for side in order:
                if side == "direct":
                    params = StdioServerParameters(command=command[0], args=command[1:], env=env)
                elif side == "relay":
                    params = StdioServerParameters(
                        command=sys.executable,
                        args=["-m", "benchmarks.mcp_proxy", "--relay", *command],
                        env=env,
                        cwd=str(ROOT),
                    )
                else:
                    db = str(scratch / f"{kind}-{round_}.db")
                    params = StdioServerParameters(
                        command=sys.executable,
                        args=["-m", "benchmarks.mcp_proxy", "--child", db, app, *command],
                        env=env,
                        cwd=str(ROOT),
                    )
                took = trio.run(_measure, params, args.calls, make)
                per[f"{side}50"].append(_pct(took, 0.50) * 1e6)
                per[f"{side}99"].append(_pct(took, 0.99) * 1e6)
                print(
                    f"[{time.strftime('%H:%M:%S')}] {kind} round {round_ + 1} {side}: "
                    f"p50 {per[f'{side}50'][-1]:.0f} µs, p99 {per[f'{side}99'][-1]:.0f} µs",
                    file=sys.stderr,
                    flush=True,
                )
    inside: dict[str, dict[str, float]] = {}
    for kind, (_, app, _) in _upstreams(scratch).items():
        direct, proxied = _in_process(app, args.calls * args.rounds, scratch)
        inside[kind] = {
            "direct50": _pct(direct, 0.5) * 1e6,
            "proxy50": _pct(proxied, 0.5) * 1e6,
            "proxy99": _pct(proxied, 0.99) * 1e6,
        }
    fsync = _fsync_us(scratch)
    table = _render(figures, fsync, args, time.time() - started, inside)
    print(table)
    if args.write:
        from benchmarks._results import write_section

        write_section(table, RESULTS)
    return 0


def _render(
    figures: dict[str, dict[str, list[float]]],
    fsync: float,
    args: Any,
    seconds: float,
    inside: dict[str, dict[str, float]],
) -> str:
    lines = [
        SECTION,
        "",
        f"`python -m benchmarks.mcp_proxy --calls {args.calls} --rounds {args.rounds}` "
        f"({seconds:.0f} s, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, shared host). "
        "The official `mcp` SDK client calls the upstream directly and through `interlock mcp` "
        "(stdio both hops), in turns; journal SQLite `synchronous=FULL`. Each figure: the "
        "median over rounds of that round's percentile of per-call wall time. "
        f"An fsync on this disk (4 KiB, median of 200): {fsync:.0f} µs.",
        "",
        "*relay* is the floor: a pass-through proxy on the same SDK with no gate and no "
        "journal. *interlock's own* is proxied minus relay: the gate, the journal (a "
        "read-only call waits for no write; a side-effecting one for its intent's, one "
        "fsync) and the run's bookkeeping, on a host whose 2 cores also run the client, the "
        "upstream and the journal's writer thread.",
        "",
        "| call | direct p50 | relay p50 | proxied p50 | added p50 | interlock's own p50 | "
        "direct p99 | proxied p99 | added p99 | goal (added p50) |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    for kind, per in figures.items():
        m = {k: statistics.median(v) for k, v in per.items()}
        added = m["proxy50"] - m["direct50"]
        limit = 100.0 if kind == "read-only" else fsync + 100.0
        goal = f"≤ {limit:.0f} µs: " + ("met" if added <= limit else "not met")
        lines.append(
            f"| {kind} | {m['direct50']:,.0f} µs | {m['relay50']:,.0f} µs | {m['proxy50']:,.0f} µs "
            f"| {added:,.0f} µs | {m['proxy50'] - m['relay50']:,.0f} µs | {m['direct99']:,.0f} µs "
            f"| {m['proxy99']:,.0f} µs | {m['proxy99'] - m['direct99']:,.0f} µs | {goal} |"
        )
    lines += [
        "",
        "In one process, without the SDK's hops (`McpRun.call_tool` against an upstream "
        f"that answers at once, {args.calls * args.rounds} calls, SQLite FULL): the "
        "proxy's own work per call, against the same goal.",
        "",
        "| call | upstream alone p50 | through the proxy p50 | added p50 | added p99 | goal |",
        "| :--- | ---: | ---: | ---: | ---: | :--- |",
    ]
    for kind, m in inside.items():
        added = m["proxy50"]
        limit = 100.0 if kind == "read-only" else fsync + 100.0
        goal = f"≤ {limit:.0f} µs: " + ("met" if added <= limit else "not met")
        lines.append(
            f"| {kind} | {m['direct50']:,.0f} µs | {m['direct50'] + added:,.0f} µs "
            f"| {added:,.0f} µs | {m['proxy99']:,.0f} µs | {goal} |"
        )
    lines += [
        "",
        "What the figures say. The SDK's second stdio hop (relay minus direct) is the floor "
        "of any proxy built on the official SDK, and by itself ten times the read-only "
        "goal: the goal cannot be met end to end with the SDK on this host. In process the "
        "proxy's own work on a read-only call (two decisions of the gate, the result's copy "
        "and dump, a cancel scope for the tool's timeout) is the second table's figure, and "
        "no answer waits for the journal. Over stdio the proxy adds more than that over the "
        "relay: the journal's writer (its thread and the fsync) competes for the host's 2 "
        "cores with the client, the server and the proxy even though no answer waits for it "
        "(measured by hand on 2026-12-04 with the in-memory store in its place: about 0.25 "
        "ms over the relay instead of about 1.5). A side-effecting call waits for one fsync, "
        "its intent's; back to back, with no pause between calls, the previous call's "
        "commit is still being written when the next intent must be, hence about two in "
        "the in-process figure.",
        "",
        "Raw per-round figures (µs): `" + json.dumps(figures) + "`",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
