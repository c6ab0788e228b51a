"""The MCP proxy's added latency per ``tools/call`` (issue 36).

``python -m benchmarks.mcp_proxy [--calls N] [--rounds R] [--write]``

The official SDK's client calls a real upstream server directly, and the same client calls
the same server through ``interlock mcp`` (stdio on both hops), in turns (the order flipped
every round, so drift on a shared host hits both alike). Two calls:

- **read-only**: ``mcp-server-time``'s ``get_current_time`` (PyPI), a read-only tool: the
  gate, then the call, then the commit (one journal batch after the call);
- **side-effecting**: the npm filesystem server's ``write_file`` (each call new content), a
  tool that is neither read-only nor idempotent: the intent is durable (an fsync) before
  the call is forwarded, the commit after.

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
    fsync = _fsync_us(scratch)
    table = _render(figures, fsync, args, time.time() - started)
    print(table)
    if args.write:
        _write(table)
    return 0


def _render(
    figures: dict[str, dict[str, list[float]]], fsync: float, args: Any, seconds: float
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
        "journal. *interlock's own* is proxied minus relay: the gate, the journal (one "
        "fsync'd batch for a read-only call, two for a side-effecting one) and the run's "
        "bookkeeping.",
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
    lines += ["", "Raw per-round figures (µs): `" + json.dumps(figures) + "`"]
    return "\n".join(lines)


def _write(table: str) -> None:
    text = RESULTS.read_text(encoding="utf-8")
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + table + "\n" + (text[end:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    RESULTS.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
