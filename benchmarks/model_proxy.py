"""The model proxy's added latency per request (issue 37).

``python -m benchmarks.model_proxy [--requests N] [--rounds R] [--write]``

A client (httpx, HTTP/1.1 keep-alive) posts one chat completion request after another to
interlock's fake model server directly, and the same requests through ``interlock
proxy`` in the same process, whole answers and streamed ones (``stream: true``, the
stream read to its end). The fake answers
at once with a tool call, so what is measured is the proxy: the request read, the run's
step (the previous call's result journaled as its commit, the new call verified by the
gate, its intent journaled), the upstream hop and the answer rewritten with the call's
key. The journal is SQLite; ``--synchronous`` picks NORMAL (default) or FULL. Each
figure: the median over rounds of that round's percentile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## Model proxy: added latency per request (issue 37)"
TOOLS = [{"type": "function", "function": {"name": "charge", "parameters": {"type": "object"}}}]


def _machine() -> Any:
    from interlock import BreakerPolicy, Budgets, Machine, Tool, Worker

    async def never(args: Any, ctx: Any) -> Any:
        raise AssertionError("the application executes the tools")

    return Machine(
        "bench",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", never, {"type": "object"}, repeatable=True)],
        budgets=Budgets(tokens=10**12, steps=10**9, deadline=10.0**9),
        breakers=BreakerPolicy(repeats=10**9),
    )


def _call_of(answer: Any, stream: bool) -> dict[str, Any]:
    """The assistant message of a whole answer, or assembled from a stream's chunks."""
    if not stream:
        return answer.json()["choices"][0]["message"]  # type: ignore[no-any-return]
    call: dict[str, Any] = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
    for line in answer.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for delta in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or ():
            call["id"] += delta.get("id") or ""
            call["function"]["name"] += delta["function"].get("name") or ""
            call["function"]["arguments"] += delta["function"].get("arguments") or ""
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _relay_app(transport: Any) -> Any:
    """The floor: hypercorn serving an ASGI app that only relays the body to the upstream
    with interlock's transport and its answer back (no gate, no journal, no rewriting)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        answer = await transport.post("/chat/completions", body)
        kind = b"text/event-stream" if b'"stream":true' in body else b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [
                    (b"content-type", kind),
                    (b"content-length", str(len(answer.body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer.body})

    return app


async def _serve_relay(upstream: str, task_status: Any) -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from interlock.providers._http import Transport

    async with Transport(upstream, timeout=60) as transport:
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        stop = trio.Event()

        class _Status:
            def started(self, binds: Any) -> None:
                task_status.started((binds[0] + "/v1", stop))

        await serve(
            _relay_app(transport), config, shutdown_trigger=stop.wait, task_status=_Status()
        )


async def _serve_raw_relay(upstream: str, task_status: Any) -> None:
    """The floor without a server framework: the same relay on trio's sockets and h11
    (hypercorn's own HTTP/1.1 parser), one connection a task, keep-alive."""
    import h11
    import trio

    from interlock.providers._http import Transport

    async with Transport(upstream, timeout=60) as transport:

        async def connection(stream: Any) -> None:
            conn = h11.Connection(h11.SERVER)
            while True:
                body = b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        conn.receive_data(data)
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        return
                answer = await transport.post("/chat/completions", body)
                kind = "text/event-stream" if b'"stream":true' in body else "application/json"
                head = [("content-type", kind), ("content-length", str(len(answer.body)))]
                out = conn.send(h11.Response(status_code=answer.status, headers=head))
                out = (out or b"") + (conn.send(h11.Data(data=answer.body)) or b"")
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                conn.start_next_cycle()

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        task_status.started(f"http://127.0.0.1:{port}/v1")
        await trio.serve_listeners(connection, listeners)


async def _measure(
    requests: int, synchronous: str, scratch: Path, stream: bool
) -> dict[str, list[float]]:
    import httpx
    import trio

    from interlock.modelproxy import RUN_HEADER, serve_model_proxy
    from interlock.stores import open_sqlite_store
    from interlock.testing import Reply, open_fake_llm

    counter = iter(range(10**9))

    def brain(api: str, body: Any, headers: Any) -> Reply:
        return Reply(calls=[("charge", json.dumps({"cents": next(counter)}))])

    store = await open_sqlite_store(
        str(scratch / f"p-{time.time_ns()}.db"), synchronous=synchronous
    )
    took: dict[str, list[float]] = {"direct": [], "relay": [], "raw": [], "proxy": []}
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, _machine(), fake.openai_base_url, store)
            )
            relay, stop_relay = await nursery.start(_serve_relay, fake.openai_base_url)
            raw = await nursery.start(_serve_raw_relay, fake.openai_base_url)
            async with httpx.AsyncClient(timeout=60) as http:
                sides = (
                    ("direct", fake.openai_base_url),
                    ("relay", relay),
                    ("raw", raw),
                    ("proxy", server.url),
                )
                for side, base in sides:
                    headers: dict[str, str] = {}
                    messages: list[Any] = [{"role": "user", "content": "pay"}]
                    for i in range(requests + 20):
                        body = {"model": "m", "messages": messages, "tools": TOOLS}
                        if stream:
                            body["stream"] = True
                        started = time.perf_counter()
                        answer = await http.post(
                            f"{base}/chat/completions", json=body, headers=headers
                        )
                        elapsed = time.perf_counter() - started
                        if answer.status_code != 200:
                            raise RuntimeError(f"{side}: {answer.status_code} {answer.text}")
                        if i >= 20:  # warm: connections, caches
                            took[side].append(elapsed)
                        if side == "proxy":
                            headers = {RUN_HEADER: answer.headers[RUN_HEADER]}
                        message = _call_of(answer, stream)
                        call = message["tool_calls"][0]
                        messages = [
                            {"role": "user", "content": "pay"},
                            message,
                            {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
                        ]
            server.stop()
            stop_relay.set()
            nursery.cancel_scope.cancel()  # the raw relay
    finally:
        await store.aclose()
    return took


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_proxy", description=__doc__)
    parser.add_argument("--requests", type=int, default=500, help="timed requests a side (500)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    parser.add_argument("--synchronous", default="NORMAL", choices=("NORMAL", "FULL"))
    parser.add_argument("--write", action="store_true", help=f"write the table into {RESULTS}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    import trio

    started = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="interlock-proxy-bench-"))
    kinds = ("direct50", "direct99", "relay50", "relay99", "raw50", "raw99", "proxy50", "proxy99")
    rounds: dict[str, dict[str, list[float]]] = {
        mode: {k: [] for k in kinds} for mode in ("whole", "stream")
    }
    for round_ in range(args.rounds):
        for mode in ("whole", "stream") if round_ % 2 == 0 else ("stream", "whole"):
            took = trio.run(_measure, args.requests, args.synchronous, scratch, mode == "stream")
            for side in ("direct", "relay", "raw", "proxy"):
                rounds[mode][f"{side}50"].append(_pct(took[side], 0.5) * 1e6)
                rounds[mode][f"{side}99"].append(_pct(took[side], 0.99) * 1e6)
            print(
                f"round {round_ + 1} {mode}: direct p50 {rounds[mode]['direct50'][-1]:.0f} µs, "
                f"bare relay p50 {rounds[mode]['relay50'][-1]:.0f} µs, "
                f"raw relay p50 {rounds[mode]['raw50'][-1]:.0f} µs, "
                f"proxied p50 {rounds[mode]['proxy50'][-1]:.0f} µs",
                file=sys.stderr,
            )
    rows = []
    for mode in ("whole", "stream"):
        m = {k: statistics.median(v) for k, v in rounds[mode].items()}
        added = m["proxy50"] - m["direct50"]
        rows.append(
            f"| {mode} | {m['direct50']:,.0f} µs | {m['relay50']:,.0f} µs "
            f"| {m['raw50']:,.0f} µs | {m['raw50'] - m['direct50']:,.0f} µs "
            f"| {m['proxy50']:,.0f} µs | {added:,.0f} µs "
            f"| {m['proxy50'] - m['relay50']:,.0f} µs "
            f"| {m['direct99']:,.0f} µs | {m['proxy99']:,.0f} µs "
            f"| {m['proxy99'] - m['direct99']:,.0f} µs "
            f"| ≤ 200 µs added p50: {'met' if added <= 200 else 'not met'} |"
        )
    table = "\n".join(
        [
            SECTION,
            "",
            f"`python -m benchmarks.model_proxy --requests {args.requests} --rounds "
            f"{args.rounds} --synchronous {args.synchronous}` ({time.time() - started:.0f} s, "
            f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, shared host). A client posts "
            "chat completion requests to interlock's fake model server (a tool call, at once), "
            "directly and through the proxy in the same process; journal SQLite "
            f"`synchronous={args.synchronous}`. Each figure: the median over rounds of that "
            "round's percentile.",
            "",
            "| answer | direct p50 | bare relay p50 | raw relay p50 | raw relay added p50 "
            "| proxied p50 | added p50 | over the relay "
            "| direct p99 | proxied p99 | added p99 | goal |",
            "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
            *rows,
            "",
            "Each proxied request is a step: the previous call's result journaled as its "
            "commit, the upstream asked (never as a stream: a stream is held until the gate "
            "has decided, then sent whole as the API's events), the new call verified and "
            "its intent durable before the application hears of it (the application may "
            "execute it at once), the answer rewritten with the call's key. The bare relay "
            "is hypercorn serving an app that only passes the body to the upstream and back "
            "with interlock's transport: the floor of any proxy on this stack. The raw relay "
            "is the same relay with no server framework, on trio's sockets and h11 "
            "(hypercorn's own HTTP/1.1 parser), one task a connection: what a server written "
            "for the proxy alone could not go below. Raw per-round "
            f"figures (µs): `{json.dumps(rounds)}`",
            "",
            "What the figure says: the goal of 200 µs added cannot be met on this stack on "
            "this host: the bare relay alone adds about 600 µs (hypercorn serving the "
            "request on trio, and the second HTTP hop). With no framework (the raw relay) "
            "the hop alone adds about 200 µs, the whole budget, before the proxy's step. "
            "Over the relay, the proxy adds about "
            "750-1,000 µs, most of it the wait for the call's intent to be durable (one "
            "SQLite write through a worker thread, 500-700 µs here); a read-only tool's call "
            "does not wait (its intent is written with its commit), which saves 150-250 µs. "
            "A stream costs what a whole answer does: the proxy asks the upstream for the "
            "whole answer in both cases.",
        ]
    )
    print(table)
    if args.write:
        from benchmarks._results import write_section

        write_section(table, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
