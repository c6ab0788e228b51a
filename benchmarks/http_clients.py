"""HTTP clients under trio at fan-out: httpx 0.28 against httpx2 2.16, one shared pool each.

What a provider does per model call: POST a ~2 KB JSON body and read a ~1 KB JSON reply,
through ONE ``AsyncClient`` (one connection pool) shared by every run. Measured:

- a loopback server written here (trio + h11, keep-alive, a fixed reply), run in its own
  process so that the client's CPU is measured alone (its CPU is reported beside it, to
  show it is not the bottleneck);
- each configuration in a fresh client process: ``concurrency`` trio tasks each making
  ``per_task`` requests, connections capped by the pool's ``Limits(max_connections=pool)``
  and, as a provider does, by a ``trio.CapacityLimiter(pool)`` in front of the client (so
  that requests wait in trio, not in the pool's own queue); one configuration per client
  also leaves the queueing to the pool alone (no limiter), to show what that costs;
- requests/s (wall), the latency a caller sees (limiter wait included) and the latency of
  the request itself (inside the limiter), p50/p99, client CPU µs per request
  (``process_time`` of the client process over the whole trio.run), errors.

Run it alone: ``python -m benchmarks.http_clients [--quick]`` prints the table.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks._harness import (
    ROOT,
    Progress,
    child_env,
    child_main,
    no_progress,
    quantile,
    run_alone,
    run_child,
)

NAME = "http"
TITLE = "HTTP clients under trio: httpx against httpx2, one shared pool"

CLIENTS = ("httpx", "httpx2", "h11", "interlock")
"""``h11`` is the floor: a bare keep-alive pool of trio streams speaking h11, written below;
``interlock`` is the providers' own ``Transport`` (on h11, its in-flight limit as the limiter)."""
REQUEST_BODY = json.dumps(
    {
        "model": "bench",
        "messages": [{"role": "user", "content": "x" * 160} for _ in range(10)],
        "tools": [],
    }
).encode()
REPLY_BODY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * 800}}],
        "usage": {"prompt_tokens": 500, "completion_tokens": 200, "total_tokens": 700},
    }
).encode()


# -- the server (its own process) ----------------------------------------------------------


def serve() -> None:
    """Serve the fixed reply on a loopback port; print ``PORT n`` once listening."""
    import h11
    import trio

    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(REPLY_BODY))),
    ]

    async def handle(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.EndOfMessage):
                    out = conn.send(h11.Response(status_code=200, headers=headers))
                    out += conn.send(h11.Data(data=REPLY_BODY))
                    out += conn.send(h11.EndOfMessage())
                    await stream.send_all(out)
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        except (trio.BrokenResourceError, h11.RemoteProtocolError):
            return

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
        port = listeners[0].socket.getsockname()[1]
        sys.stdout.write(f"PORT {port}\n")
        sys.stdout.flush()
        await trio.serve_listeners(handle, listeners)

    trio.run(main)


class Server:
    """The server process: started, its CPU read from /proc, stopped."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.http_clients", "--server"],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"the benchmark server did not start: {line!r}")
        self.port = int(line.split()[1])

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


# -- the client (one process per configuration) --------------------------------------------


class _H11Response:
    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content


class BareH11Client:
    """The floor: idle connections in a list, one ``send_all`` per request, h11 parsing.

    No TLS, proxies, redirects or cookies; it relies on the caller's limiter for its
    connection cap (a request with no idle connection opens one).
    """

    def __init__(self, limits: Any = None, timeout: float = 60.0) -> None:
        self._idle: list[tuple[Any, Any]] = []

    async def __aenter__(self) -> BareH11Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for stream, _conn in self._idle:
            await stream.aclose()

    async def post(
        self, url: str, content: bytes = b"", headers: dict[str, str] | None = None
    ) -> _H11Response:
        import h11
        import trio

        if self._idle:
            stream, conn = self._idle.pop()
        else:
            host, port = url.split("/")[2].split(":")
            stream = await trio.open_tcp_stream(host, int(port))
            conn = h11.Connection(h11.CLIENT)
        fields = [("host", "127.0.0.1"), ("content-length", str(len(content)))]
        fields += list((headers or {}).items())
        target = "/" + url.split("/", 3)[3]
        out = conn.send(h11.Request(method="POST", target=target, headers=fields))
        out += conn.send(h11.Data(data=content)) + conn.send(h11.EndOfMessage())
        await stream.send_all(out)
        status = 0
        chunks = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
        conn.start_next_cycle()
        self._idle.append((stream, conn))
        return _H11Response(status, b"".join(chunks))


class TransportClient:
    """interlock's ``Transport`` behind the same ``post(url, content, headers)`` call."""

    def __init__(self, url: str, max_in_flight: int, timeout: float) -> None:
        from interlock.providers._http import Transport

        self._base = url.rsplit("/", 2)[0]
        self._transport = Transport(self._base, max_in_flight=max_in_flight, timeout=timeout)

    async def __aenter__(self) -> TransportClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._transport.aclose()

    async def post(
        self, url: str, content: bytes = b"", headers: dict[str, str] | None = None
    ) -> _H11Response:
        response = await self._transport.post(url[len(self._base) :], content, headers=headers)
        return _H11Response(response.status, response.body)


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration against the server on ``config["port"]``."""
    import trio

    name = config["client"]
    lib: Any = None if name in ("h11", "interlock") else importlib.import_module(name)
    concurrency: int = config["concurrency"]
    per_task: int = config["per_task"]
    pool: int = config["pool"]
    url = f"http://127.0.0.1:{config['port']}/v1/chat/completions"
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
    waited: list[float] = []
    served: list[float] = []
    errors: dict[str, int] = {}

    async def one(client: Any, limiter: trio.CapacityLimiter | None) -> None:
        for _ in range(per_task):
            started = time.perf_counter()
            try:
                if limiter is None:
                    entered = started
                    response = await client.post(url, content=REQUEST_BODY, headers=headers)
                else:
                    async with limiter:
                        entered = time.perf_counter()
                        response = await client.post(url, content=REQUEST_BODY, headers=headers)
                if response.status_code != 200 or len(response.content) != len(REPLY_BODY):
                    errors[f"status {response.status_code}"] = (
                        errors.get(f"status {response.status_code}", 0) + 1
                    )
                    continue
            except Exception as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            done = time.perf_counter()
            waited.append(done - started)
            served.append(done - entered)

    async def main() -> None:
        if name == "interlock":
            client_cm: Any = TransportClient(url, pool, config["timeout"])
        elif lib is None:
            client_cm = BareH11Client()
        else:
            limits = lib.Limits(max_connections=pool, max_keepalive_connections=pool)
            client_cm = lib.AsyncClient(limits=limits, timeout=config["timeout"])
        async with client_cm as client:
            # Warm the pool, so connecting is not measured (a provider's pool stays open).
            async with trio.open_nursery() as nursery:
                for _ in range(min(pool, concurrency)):
                    nursery.start_soon(client.post, url)
            # interlock's Transport has its limiter inside (max_in_flight=pool).
            own = config["limiter"] and name != "interlock"
            limiter = trio.CapacityLimiter(pool) if own else None
            with trio.move_on_after(config["budget"]) as scope:
                async with trio.open_nursery() as nursery:
                    for _ in range(concurrency):
                        nursery.start_soon(one, client, limiter)
            result["cut_off"] = scope.cancelled_caught

    result: dict[str, Any] = {}
    cpu = time.process_time()
    wall = time.perf_counter()
    trio.run(main)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    requests = len(served)
    total = concurrency * per_task
    if result["cut_off"]:
        errors["not finished in budget"] = total - requests - sum(errors.values())
    return {
        **result,
        "requests": requests,
        "asked": total,
        "wall_s": wall,
        "rps": requests / wall if wall else 0.0,
        "cpu_us_per_request": cpu / max(1, requests) * 1e6,
        "cpu_share": cpu / wall if wall else 0.0,
        "p50_ms": quantile(waited, 0.5) * 1e3,
        "p99_ms": quantile(waited, 0.99) * 1e3,
        "served_p50_ms": quantile(served, 0.5) * 1e3,
        "served_p99_ms": quantile(served, 0.99) * 1e3,
        "errors": errors,
    }


def configurations(quick: bool) -> list[dict[str, Any]]:
    """(concurrency, per_task, pool, limiter) to run for each client."""
    scale = 0.2 if quick else 1.0

    def n(value: int) -> int:
        return max(1, int(value * scale))

    shapes = [
        (1, n(1000), 64, True),
        (50, n(40), 64, True),
        (1_000, n(3), 64, True),
        (1_000, n(3), 256, True),
        (10_000, 1, 64, True),
        (10_000, 1, 256, True),
        (1_000, n(3), 64, False),
    ]
    # NOTE: not 10,000 with the pool alone: httpx's pool rescans its queue of waiters on
    # every release and cancel, so it runs past any budget (over 10 minutes here).
    return [
        {"concurrency": c, "per_task": p, "pool": pool, "limiter": lim}
        for c, p, pool, lim in shapes
    ]


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    server = Server()
    rows: list[dict[str, Any]] = []
    try:
        shapes = configurations(quick)
        total = len(shapes) * len(CLIENTS)
        done = 0
        for shape in shapes:
            # Clients interleaved per shape, so a change of load on the host hits both.
            for client in CLIENTS:
                if client in ("h11", "interlock") and not shape["limiter"]:
                    continue  # the floor has no queue of its own
                progress(f"{client} {shape}", done / total)
                config = {
                    **shape,
                    "client": client,
                    "port": server.port,
                    "timeout": 120.0,
                    "budget": 30.0 if quick else 90.0,
                }
                before = server.cpu_seconds()
                try:
                    row = run_child("benchmarks.http_clients", config, timeout=600)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    row = _failed(config, exc)
                row["server_cpu_us_per_request"] = (
                    (server.cpu_seconds() - before) / max(1, row["requests"]) * 1e6
                )
                rows.append({**config, **row})
                done += 1
    finally:
        server.stop()
    return {
        "request_bytes": len(REQUEST_BODY),
        "reply_bytes": len(REPLY_BODY),
        "versions": {
            name: importlib.import_module("h11" if name == "interlock" else name).__version__
            for name in CLIENTS
        },
        "rows": rows,
    }


def _failed(config: dict[str, Any], exc: Exception) -> dict[str, Any]:
    """A row for a configuration whose client process failed or ran out of time."""
    nan = float("nan")
    reason = "timed out" if isinstance(exc, subprocess.TimeoutExpired) else "failed"
    return {
        "requests": 0,
        "asked": config["concurrency"] * config["per_task"],
        "rps": nan,
        "cpu_us_per_request": nan,
        "cpu_share": nan,
        **dict.fromkeys(("p50_ms", "p99_ms", "served_p50_ms", "served_p99_ms"), nan),
        "errors": {f"client process {reason}": 1},
    }


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, table

    body = []
    for row in results["rows"]:
        errors = ", ".join(f"{k} {v:,}" for k, v in row["errors"].items()) or "0"
        body.append(
            (
                _label(row["client"], results["versions"][row["client"]]),
                f"{row['concurrency']:,}",
                f"{row['requests']:,}/{row['asked']:,}",
                row["pool"],
                "limiter + pool" if row["limiter"] else "pool only",
                num(row["rps"]),
                num(row["p50_ms"]),
                num(row["p99_ms"]),
                # the Transport's limiter is inside it: no separate request latency
                num(None if row["client"] == "interlock" else row["served_p50_ms"]),
                num(None if row["client"] == "interlock" else row["served_p99_ms"]),
                num(row["cpu_us_per_request"]),
                "–" if row["cpu_share"] != row["cpu_share"] else f"{row['cpu_share']:.0%}",
                num(row["server_cpu_us_per_request"]),
                errors,
            )
        )
    return "\n".join(
        [
            f"POST {results['request_bytes']:,} B JSON, reply {results['reply_bytes']:,} B JSON, "
            "loopback, keep-alive; server (trio + h11) in its own process; each row a fresh "
            "client process with one shared AsyncClient. *Caller* latency includes the wait "
            "for the limiter (or the pool's queue); *request* latency is inside it.",
            "",
            table(
                [
                    "client",
                    "concurrent",
                    "done",
                    "pool",
                    "queueing",
                    "requests/s",
                    "caller p50 ms",
                    "caller p99 ms",
                    "request p50 ms",
                    "request p99 ms",
                    "client CPU µs/req",
                    "client CPU share",
                    "server CPU µs/req",
                    "errors",
                ],
                body,
            ),
        ]
    )


def _label(client: str, version: str) -> str:
    if client == "h11":
        return f"bare h11 {version} (floor)"
    if client == "interlock":
        return f"interlock Transport (h11 {version})"
    return f"{client} {version}"


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--child"]:
        child_main(measure)
    elif argv[1:2] == ["--server"]:
        serve()
    else:
        run_alone("http_clients", run, render, argv)


if __name__ == "__main__":
    main(sys.argv)
