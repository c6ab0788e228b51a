"""HTTP/1.1 clients under trio at fan-out: the providers' own ``Transport`` against httpcore.

Decides whether the providers keep their own HTTP/1.1 client (``interlock.providers._http``)
or use httpcore (httpx's engine, already installed with it). The rule: keep our own only
where it still wins by 2x or more.

What a provider does per model call: POST a ~2 KB JSON body and read a ~1 KB JSON reply
through ONE pool shared by every run, at most ``pool`` requests in flight (the rest queue in
trio). Measured, for each shape (``concurrency`` tasks each making ``per_task`` requests,
over plain HTTP and over TLS on loopback with a self-signed certificate made by
``openssl``):

- the server: trio + h11, keep-alive, a fixed reply, in its own process (so the client's CPU
  is measured alone);
- each client in a fresh process, its pool warmed first (connecting is not measured), the
  clients of one shape run back to back and interleaved over ``rounds`` rounds, so a change
  of load on this shared host hits them alike;
- requests/s (wall) and client CPU µs per request (``process_time`` of the client process),
  each also as a ratio to httpcore's in the same round (the baseline): the figure to judge,
  since absolute rates on a shared 2-core host swing by 2x from run to run.

Clients: ``httpcore`` (the baseline; ``AsyncConnectionPool`` on anyio's trio backend),
``interlock`` (``interlock.providers._http.Transport``), ``httpx`` (``AsyncClient``) and
``httpx2`` (its successor, when installed); all but ``interlock`` with a
``trio.CapacityLimiter(pool)`` in front, as a provider holds (so requests queue in trio, not
in the pool's own queue of waiters).

Run it: ``python -m benchmarks.http_clients [--quick]`` prints the tables.
"""

from __future__ import annotations

import importlib
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
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
TITLE = "HTTP/1.1 clients under trio at fan-out: interlock's Transport against httpcore"

BASELINE = "httpcore"
CLIENTS = ("httpcore", "interlock", "httpx", "httpx2")
POOL = 64
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


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (an EC key, as most servers now use)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def serve(cert: str | None, key: str | None) -> None:
    """Serve the fixed reply on a loopback port (TLS when given a certificate); print
    ``PORT n`` once listening."""
    import h11
    import trio

    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(REPLY_BODY))),
    ]
    context = None
    if cert is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)

    async def handle(stream: Any) -> None:
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
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return

    async def main() -> None:
        listeners: list[Any] = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
        port = listeners[0].socket.getsockname()[1]
        if context is not None:
            listeners = [trio.SSLListener(one, context) for one in listeners]
        sys.stdout.write(f"PORT {port}\n")
        sys.stdout.flush()
        await trio.serve_listeners(handle, listeners)

    trio.run(main)


class Server:
    """The server process: started, its CPU read from /proc, stopped."""

    def __init__(self, cert: Path | None, key: Path | None) -> None:
        args = [] if cert is None else [str(cert), str(key)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.http_clients", "--server", *args],
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


# -- the clients (one process per measurement) ---------------------------------------------


class Answer:
    def __init__(self, status: int, content: bytes) -> None:
        self.status = status
        self.content = content


class TransportClient:
    """interlock's ``Transport``: its in-flight limit is the pool's cap and its queue."""

    def __init__(self, base: str, context: ssl.SSLContext | None) -> None:
        from interlock.providers._http import Transport

        self._transport = Transport(base, max_in_flight=POOL, timeout=120.0, ssl_context=context)
        self.limited = True

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def post(self, path: str, headers: dict[str, str]) -> Answer:
        response = await self._transport.post(path, REQUEST_BODY, headers=headers)
        return Answer(response.status, response.body)


class HttpcoreClient:
    """httpcore's ``AsyncConnectionPool`` (on anyio's trio backend), a limiter in front."""

    def __init__(self, base: str, context: ssl.SSLContext | None) -> None:
        import httpcore

        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context, max_connections=POOL, max_keepalive_connections=POOL
        )
        self._base = base
        self.limited = False

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def post(self, path: str, headers: dict[str, str]) -> Answer:
        fields = [(k.encode(), v.encode()) for k, v in headers.items()]
        response = await self._pool.request(
            "POST", self._base + path, headers=fields, content=REQUEST_BODY
        )
        return Answer(response.status, response.content)


class HttpxClient:
    """httpx's (or httpx2's) ``AsyncClient``, a limiter in front as a provider holds."""

    def __init__(self, lib: Any, base: str, context: ssl.SSLContext | None) -> None:
        limits = lib.Limits(max_connections=POOL, max_keepalive_connections=POOL)
        self._client = lib.AsyncClient(limits=limits, timeout=120.0, verify=context or True)
        self._base = base
        self.limited = False

    async def aclose(self) -> None:
        await self._client.aclose()

    async def post(self, path: str, headers: dict[str, str]) -> Answer:
        response = await self._client.post(self._base + path, content=REQUEST_BODY, headers=headers)
        return Answer(response.status_code, response.content)


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Run one client and shape against the server on ``config["port"]``."""
    import trio

    name = config["client"]
    scheme = "https" if config["cert"] else "http"
    base = f"{scheme}://127.0.0.1:{config['port']}/v1"
    context = ssl.create_default_context(cafile=config["cert"]) if config["cert"] else None
    headers = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def one(client: Any, limiter: trio.CapacityLimiter | None) -> None:
        for _ in range(config["per_task"]):
            started = time.perf_counter()
            try:
                if limiter is None:
                    answer = await client.post("/chat/completions", headers)
                else:
                    async with limiter:
                        answer = await client.post("/chat/completions", headers)
                if answer.status != 200 or answer.content != REPLY_BODY:
                    raise RuntimeError(f"status {answer.status}")
            except Exception as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            latencies.append(time.perf_counter() - started)

    def make() -> Any:
        if name == "interlock":
            return TransportClient(base, context)
        if name == "httpcore":
            return HttpcoreClient(base, context)
        return HttpxClient(importlib.import_module(name), base, context)

    async def main() -> None:
        client = make()
        try:
            async with trio.open_nursery() as nursery:  # warm the pool: POOL connections
                for _ in range(POOL):
                    nursery.start_soon(client.post, "/chat/completions", headers)
            latencies.clear()
            limiter = None if client.limited else trio.CapacityLimiter(POOL)
            result["cpu"] = time.process_time()
            result["wall"] = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(config["concurrency"]):
                    nursery.start_soon(one, client, limiter)
            result["wall"] = time.perf_counter() - result["wall"]
            result["cpu"] = time.process_time() - result["cpu"]
        finally:
            await client.aclose()

    result: dict[str, Any] = {}
    trio.run(main)
    requests = len(latencies)
    return {
        "requests": requests,
        "asked": config["concurrency"] * config["per_task"],
        "rps": requests / result["wall"],
        "cpu_us": result["cpu"] / max(1, requests) * 1e6,
        "p50_ms": quantile(latencies, 0.5) * 1e3,
        "p99_ms": quantile(latencies, 0.99) * 1e3,
        "errors": errors,
    }


def installed(name: str) -> str | None:
    """The version of ``name``, or None when it is not installed."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return str(getattr(module, "__version__", "?"))


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    versions = {name: installed(name if name != "interlock" else "h11") for name in CLIENTS}
    clients = [name for name in CLIENTS if versions[name] is not None]
    rounds = 1 if quick else 3
    shapes = [(200, 2 if quick else 5), (1000, 1 if quick else 2)]
    rows: list[dict[str, Any]] = []
    total = 2 * len(shapes) * rounds * len(clients)
    done = 0
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = make_certificate(Path(tmp))
        for tls in (False, True):
            server = Server(cert if tls else None, key if tls else None)
            try:
                for concurrency, per_task in shapes:
                    for round_ in range(rounds):
                        for client in clients:
                            progress(f"{client} {concurrency} tls={tls}", done / total)
                            config = {
                                "client": client,
                                "concurrency": concurrency,
                                "per_task": per_task,
                                "port": server.port,
                                "cert": str(cert) if tls else None,
                            }
                            before = server.cpu_seconds()
                            try:
                                row = run_child("benchmarks.http_clients", config, timeout=600)
                            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                                row = {"requests": 0, "errors": {type(exc).__name__: 1}}
                            row["server_cpu_us"] = (
                                (server.cpu_seconds() - before) / max(1, row["requests"]) * 1e6
                            )
                            rows.append({**config, **row, "tls": tls, "round": round_})
                            done += 1
            finally:
                server.stop()
    return {"versions": versions, "rows": rows, "rounds": rounds}


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (tls, concurrency, client): median requests/s and CPU, and the median over
    rounds of each round's ratio to the baseline's figure in that round."""
    rows = results["rows"]
    keys: list[tuple[bool, int, str]] = []
    for row in rows:
        key = (row["tls"], row["concurrency"], row["client"])
        if key not in keys:
            keys.append(key)
    out = []
    for tls, concurrency, client in keys:
        mine = [
            r
            for r in rows
            if (r["tls"], r["concurrency"], r["client"]) == (tls, concurrency, client)
        ]
        speed, cpu = [], []
        for row in mine:
            base = next(
                r
                for r in rows
                if (r["tls"], r["concurrency"], r["round"], r["client"])
                == (tls, concurrency, row["round"], BASELINE)
            )
            if row["requests"] and base["requests"]:
                speed.append(row["rps"] / base["rps"])
                cpu.append(base["cpu_us"] / row["cpu_us"])
        ok = [r for r in mine if r["requests"]]
        out.append(
            {
                "tls": tls,
                "concurrency": concurrency,
                "client": client,
                "done": f"{sum(r['requests'] for r in mine):,}/{sum(r.get('asked', 0) for r in mine):,}",
                "rps": statistics.median(r["rps"] for r in ok) if ok else float("nan"),
                "cpu_us": statistics.median(r["cpu_us"] for r in ok) if ok else float("nan"),
                "p99_ms": statistics.median(r["p99_ms"] for r in ok) if ok else float("nan"),
                "speed": statistics.median(speed) if speed else float("nan"),
                "cpu_ratio": statistics.median(cpu) if cpu else float("nan"),
                "errors": sum(sum(r["errors"].values()) for r in mine),
            }
        )
    return out


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, table

    versions = results["versions"]
    body = []
    for row in summary(results):
        version = versions[row["client"]]
        label = (
            "interlock Transport" if row["client"] == "interlock" else f"{row['client']} {version}"
        )
        body.append(
            (
                "TLS" if row["tls"] else "plain",
                f"{row['concurrency']:,}",
                label,
                row["done"],
                num(row["rps"]),
                f"{row['speed']:.2f}x",
                num(row["cpu_us"]),
                f"{row['cpu_ratio']:.2f}x",
                num(row["p99_ms"]),
                row["errors"],
            )
        )
    missing = [name for name, version in versions.items() if version is None]
    return "\n".join(
        [
            f"POST {len(REQUEST_BODY):,} B JSON, reply {len(REPLY_BODY):,} B JSON, loopback, "
            f"keep-alive, at most {POOL} connections; server trio + h11 in its own process; "
            f"each figure the median of {results['rounds']} rounds, each row a fresh client "
            f"process. *vs {BASELINE}*: the median of each round's ratio to {BASELINE}'s figure "
            "in the same round (throughput: higher is faster; CPU: baseline's µs over this "
            "client's, higher is cheaper).",
            *([f"Not installed, skipped: {', '.join(missing)}."] if missing else []),
            "",
            table(
                [
                    "transport",
                    "concurrent",
                    "client",
                    "done",
                    "requests/s",
                    f"vs {BASELINE}",
                    "client CPU µs/req",
                    f"CPU vs {BASELINE}",
                    "p99 ms",
                    "errors",
                ],
                body,
            ),
        ]
    )


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--child"]:
        child_main(measure)
    elif argv[1:2] == ["--server"]:
        serve(*(argv[2:4] or (None, None)))
    else:
        run_alone("http_clients", run, render, argv)


if __name__ == "__main__":
    main(sys.argv)
