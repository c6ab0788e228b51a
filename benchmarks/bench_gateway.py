"""The gateway over loopback: single HTTP proposals against hypercorn's own ceiling, batches,
the streaming channel, and one external step against the same step in process.

Every server runs in its own process and every load generator in another (``run_child``),
on loopback; ratios are taken within one run:

- *ceiling*: hypercorn's trio worker (``hypercorn.trio.serve``, the server the gateway runs
  on) serving a bare ASGI endpoint that reads a tiny JSON POST and answers ``{"ok":true}``
  with ``content-length``. Nothing in it is interlock's.
- *single proposals*: the gateway (``interlock.gateway.serve_gateway``, no per-key rate
  limit, on a SQLite journal in a temporary directory) with ``connections`` keep-alive
  connections, each driving its own external run of the benchmark's machine with one
  ``POST /v1/runs/{id}/proposals`` at a time: each proposal is a legal transition with
  distinct data (A -> B -> A ...), so every request is verified, journaled and acknowledged
  after its batch is durable. The ceiling and this load are measured in turns over
  ``ROUNDS`` rounds (a noisy neighbour lands on both); the ratio per round is taken per
  second of the server process's CPU (``/proc``: the per-core goal, 0.7 or more) and in
  requests/s, and the median round is reported.
- *batches*: ``POST /v1/verify`` with 100 and 1,000 items (each item one run's next
  transition; a batch touches each run once) from a few connections at a time. Each of
  these rows and the channel's is the median of ``THROUGHPUT_ROUNDS`` rounds (full run),
  each on a fresh server and journal, the loads taken in turns; every round's figure is
  kept in the row (``rounds_per_server_cpu_s``).
- *in process*: the same transitions of as many runs through ``Supervisor.submit`` in one
  process, no HTTP: the floor that the batch and channel paths are compared with.
- *channel*: the streaming channel (``serve_gateway(channel_port=0)``, as ``interlock serve
  --channel-port``, and ``open_channel``'s client), 1,000 runs multiplexed on each of 1 and 4 connections, each run
  a task proposing as soon as it has its last verdict.
- *profile* (full run): the gateway process's main thread under cProfile (CPU time) over
  the window of a batch-of-1,000 load, toggled by SIGUSR1/SIGUSR2 from the load generator.
- *external step*: one external step (propose a ``lookup`` call, get the verdict and the key,
  report its result) over HTTP on one connection, one at a time, against the same step
  through ``Supervisor.submit`` in process on a SQLite journal: µs per step and the ratio.

Figures per row: requests/s and proposals/s (wall), proposals per second of the server's
CPU, p50/p99 of a request (of a batch, for the batches), and the CPU share of a core used by
the server and by the load generator over the window.

The load generator is a lean client (trio sockets, requests written as prepared bytes, the
response parsed by hand: status line, ``content-length`` or chunked, ``connection: close``
honoured): it costs a few µs per request, so it is not the bottleneck; its own CPU share of
a core is reported beside each row to show it.

Run it alone: ``python -m benchmarks.bench_gateway [--quick]`` prints the tables.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import importlib.util
import io
import itertools
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from benchmarks._harness import (
    ROOT,
    Progress,
    area_of,
    child_env,
    child_main,
    no_progress,
    quantile,
    run_alone,
    run_child,
    short_path,
)

NAME = "gateway"
TITLE = "Gateway: HTTP proposals against the server's ceiling, batches, the channel, one step"

#: Keep-alive connections of the load (quick, full).
CONNECTIONS = (8, 50)
#: Seconds each load is measured, after a warm-up of a fifth of it (quick, full).
SECONDS = (0.3, 5.0)
BATCHES = ((100,), (100, 1000))
#: External steps timed one at a time (quick, full).
STEPS = (100, 1000)
#: Rounds of (ceiling, single proposals), taken in turns (quick, full).
ROUNDS = (1, 3)
#: The channel's loads: (connections, runs per connection) (quick, full).
CHANNEL = (((1, 200),), ((1, 1000), (4, 1000)))
#: Connections sending batches at once (quick, full).
BATCH_CONNECTIONS = (2, 4)
#: Rounds of the batches' and the channel's loads, each on a fresh server (quick, full).
THROUGHPUT_ROUNDS = (1, 3)
CEILING_GOAL = 0.7
THROUGHPUT_GOAL = 50_000.0

_encode = msgspec.json.encode
_decode = msgspec.json.decode


# -- the application the gateway serves -----------------------------------------------------


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def _not_here(args: Lookup, ctx: Any) -> Any:  # external runs: the caller executes
    raise AssertionError("the benchmark's client executes its tools")


def build_machine() -> Any:
    """Two worker states that hand over to each other, and a read-only ``lookup`` tool."""
    from interlock import Budgets, Machine, Tool, Worker

    return Machine(
        "cycle",
        "A",
        {
            "A": Worker(next=["B", "DONE"], tools=["lookup"]),
            "B": Worker(next=["A", "DONE"], tools=["lookup"]),
        },
        tools=[Tool("lookup", _not_here, Lookup, read_only=True, description="Find an order")],
        budgets=Budgets(tokens=10**12, steps=10**9, deadline=10.0**9),
    )


def build_app() -> Any:
    """``--app benchmarks.bench_gateway:build_app()``'s object: the machine, no provider."""
    from interlock import App

    return App([build_machine()])


def transition(state: str, n: int) -> str:
    """The proposal that moves a run out of ``state`` (A or B), with distinct data ``n``."""
    return f'{{"next":"{"B" if state == "A" else "A"}","data":{{"n":{n}}}}}'


def call(n: int) -> str:
    return f'{{"tool":"lookup","args":{{"order_id":"ORD-{n:07d}"}}}}'


# -- servers, each in its own process -------------------------------------------------------


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The ceiling: read the request body, answer a tiny JSON body. Nothing else."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"11")],
        }
    )
    await send({"type": "http.response.body", "body": b'{"ok":true}'})


def _hypercorn_config() -> Any:
    from hypercorn.config import Config

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 600
    return config


def serve(kind: str, db: str, profile_to: str = "") -> None:
    """A server's process: print ``PORT n`` once it listens, then serve until SIGTERM.

    With ``profile_to``, the process's main thread runs under cProfile (its CPU time)
    between SIGUSR1 and SIGUSR2, and the stats are written there when it stops.
    """
    import trio

    async def bare() -> None:
        from hypercorn.trio import serve as hypercorn_serve

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                functools.partial(hypercorn_serve, bare_app, _hypercorn_config(), mode="asgi")
            )
            _say_port(int(binds[0].rsplit(":", 1)[1]))

    async def gateway() -> None:
        from interlock.gateway import serve_gateway
        from interlock.gateway._guard import Limits

        # no per-key rate limit: the benchmark measures the server, not its throttle
        limits = Limits(rate=None, request_timeout=None)
        # the streaming channel beside the HTTP API, over the same service and journal
        channel = {"channel_port": 0} if has_channel() else {}
        async with trio.open_nursery() as nursery:
            started = await nursery.start(
                functools.partial(
                    serve_gateway,
                    build_app(),
                    db=db,
                    host="127.0.0.1",
                    port=0,
                    limits=limits,
                    **channel,
                )
            )
            _say_port(started.port, started.channel)
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    started.stop()  # drain, then return
                    nursery.cancel_scope.cancel()
                    break

    if kind == "gateway-timed":
        _time_decide(profile_to)
        trio.run(gateway)
        return
    if not profile_to:
        trio.run(bare if kind == "bare" else gateway)
        return
    # CPU time of the main thread (the time the event loop waits in epoll is not work),
    # from SIGUSR1 to SIGUSR2: the load generator sends them around its measured window
    profiler = cProfile.Profile(time.thread_time)
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, lambda *_: profiler.disable())
    try:
        trio.run(gateway)
    finally:
        profiler.disable()
        profiler.dump_stats(profile_to)


def _time_decide(path: str) -> None:
    """Time the decide path in this server process, between SIGUSR1 and SIGUSR2, and write
    ``{"seconds", "calls"}`` to ``path`` at SIGUSR2.

    Every proposal of a batch or of the channel is decided by ``Supervisor.submit_nowait``
    in the gateway's task (the decider, the gate, the view's fold, the stats counters,
    the events added to the next group commit); each call is timed in the main thread's
    CPU time (``time.thread_time``, so the store's thread holding the GIL is not counted),
    less the timer's own cost measured here first.
    """
    from interlock.runtime._supervisor import Supervisor

    clock = time.thread_time
    samples = [clock() for _ in range(10_001)]
    overhead = min(
        (samples[-1] - samples[0]) / 10_000,
        sorted(b - a for a, b in itertools.pairwise(samples))[5_000],
    )
    original = Supervisor.submit_nowait
    on = False
    seconds = 0.0
    calls = 0

    def submit_nowait(self: Any, msg: Any) -> Any:
        nonlocal seconds, calls
        if not on:
            return original(self, msg)
        started = clock()
        try:
            return original(self, msg)
        finally:
            seconds += clock() - started - overhead
            calls += 1

    def start(*_: Any) -> None:
        nonlocal on, seconds, calls
        on, seconds, calls = True, 0.0, 0

    def stop(*_: Any) -> None:
        nonlocal on
        on = False
        Path(path).write_text(json.dumps({"seconds": seconds, "calls": calls}))

    Supervisor.submit_nowait = submit_nowait  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def profile_rows(path: str, top: int = 14) -> dict[str, Any]:
    """The heaviest functions of a cProfile stats file (own time) and own time by area."""
    stats = pstats.Stats(path, stream=io.StringIO())
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in raw.values()) or 1.0
    areas: dict[str, float] = {}
    for (filename, _line, name), entry in raw.items():
        area = area_of(filename, name)
        areas[area] = areas.get(area, 0.0) + entry[2] / total
    ranked = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {
        "profile": [
            {
                "function": f"{short_path(filename)}:{line}({name})",
                "calls": calls,
                "own_s": own,
                "cum_s": cumulative,
                "own_share": own / total,
            }
            for (filename, line, name), (_cc, calls, own, cumulative, _callers) in ranked
        ],
        "profile_areas": dict(sorted(areas.items(), key=lambda kv: kv[1], reverse=True)),
    }


def _say_port(port: int, channel: str = "") -> None:
    sys.stdout.write(f"PORT {port} {channel}\n")
    sys.stdout.flush()


class Server:
    """A server in its own process: started, its CPU read from /proc, stopped."""

    def __init__(self, kind: str, db: str = "", profile_to: str = "") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_gateway", "--serve", kind, db, profile_to],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            _, err = self.proc.communicate()
            raise RuntimeError(f"the {kind} server did not start: {line!r}\n{err[-3000:]}")
        self.port = int(line.split()[1])
        self.channel = line.split()[2] if len(line.split()) > 2 else ""
        """The streaming channel's address (``tcp://HOST:PORT``), if it is served."""

    def stop(self) -> None:
        """SIGTERM (the gateway drains), then SIGKILL if it is not gone in a minute."""
        self.killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.killed = True
        _, self.stderr = self.proc.communicate()


@contextlib.contextmanager
def running(kind: str, db: str = "", profile_to: str = "") -> Any:
    server = Server(kind, db, profile_to)
    try:
        yield server
    finally:
        server.stop()


# -- the lean load generator ----------------------------------------------------------------


class HttpError(Exception):
    """The server answered a status the load did not expect."""


class Connection:
    """One keep-alive HTTP/1.1 connection: a request is prepared bytes, a response parsed
    by hand (status, ``content-length`` or chunked). A few µs per request."""

    def __init__(self, stream: Any, port: int) -> None:
        self.stream = stream
        self.port = port
        self.buffer = bytearray()
        self.closing = False
        """The server said ``connection: close`` (hypercorn does on a connection's
        1,000th response): the next request goes on a new connection."""
        self.reconnects = 0

    @classmethod
    async def open(cls, port: int) -> Connection:
        import trio

        return cls(await trio.open_tcp_stream("127.0.0.1", port), port)

    def prepare(self, method: str, path: str, body: bytes = b"", content_type: str = "") -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        if body or method == "POST":
            head += f"content-type: {content_type or 'application/json'}\r\n"
            head += f"content-length: {len(body)}\r\n"
        return head.encode() + b"\r\n" + body

    async def request(self, data: bytes) -> tuple[int, bytes]:
        if self.closing:
            import trio

            await self.stream.aclose()
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            self.buffer.clear()
            self.closing = False
            self.reconnects += 1
        await self.stream.send_all(data)
        return await self._response()

    async def _fill(self) -> None:
        chunk = await self.stream.receive_some(262144)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buffer += chunk

    async def _response(self) -> tuple[int, bytes]:
        buffer = self.buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            await self._fill()
        head = bytes(buffer[:end]).lower()
        del buffer[: end + 4]
        status = int(head[9:12])
        if b"\r\nconnection: close" in head:
            self.closing = True
        at = head.find(b"\r\ncontent-length:")
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17 : stop if stop >= 0 else len(head)])
            while len(buffer) < length:
                await self._fill()
            body = bytes(buffer[:length])
            del buffer[:length]
            return status, body
        if b"transfer-encoding: chunked" in head:
            parts = []
            while True:
                while (line := buffer.find(b"\r\n")) < 0:
                    await self._fill()
                size = int(bytes(buffer[:line]).split(b";")[0], 16)
                while len(buffer) < line + 2 + size + 2:
                    await self._fill()
                parts.append(bytes(buffer[line + 2 : line + 2 + size]))
                del buffer[: line + 2 + size + 2]
                if size == 0:
                    return status, b"".join(parts)
        return status, b""

    async def aclose(self) -> None:
        await self.stream.aclose()


Worker = Callable[[Connection, Any], Awaitable[None]]
"""``worker(conn, load)``: sets up (runs to drive), calls ``await load.ready()``, then
makes requests until cancelled, passing each one's latency and item count to
``load.record``."""


class Load:
    """What the workers of one load share: the start line and the measured window."""

    def __init__(self, workers: int) -> None:
        import trio

        self.waiting = workers
        self.all_ready = trio.Event()
        self.on = False
        self.over = False
        self.latencies: list[float] = []
        self.items = 0

    async def ready(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.all_ready.set()
        await self.all_ready.wait()

    def record(self, latency: float, items: int = 1) -> None:
        if self.on and not self.over:
            self.latencies.append(latency)
            self.items += items


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds process ``pid``'s main thread and its other threads (the SQLite store's
    writer and checkpointer) have used so far, from ``/proc``."""
    main = others = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        if tid == str(pid):
            main = cpu
        else:
            others += cpu
    return main, others


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, from ``/proc``."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(
    port: int,
    connections: int,
    seconds: float,
    worker: Worker,
    server_pid: int,
    profile: bool = False,
) -> dict[str, Any]:
    """Run ``connections`` workers: set up, a warm-up, then ``seconds`` measured."""
    import trio

    load = Load(connections)
    conns = [await Connection.open(port) for _ in range(connections)]
    try:
        async with trio.open_nursery() as nursery:
            for conn in conns:
                nursery.start_soon(worker, conn, load)
            figures = await _window(load, seconds, server_pid, profile)
            nursery.cancel_scope.cancel()
    finally:
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.aclose()
    return figures


async def _window(
    load: Load, seconds: float, server_pid: int, profile: bool = False
) -> dict[str, Any]:
    """Wait for every worker to be ready, warm up, then measure ``seconds`` (and have the
    server profile itself over them, with ``profile``)."""
    import trio

    with trio.fail_after(600):
        await load.all_ready.wait()
    await trio.sleep(max(0.2, seconds / 5))
    if profile:
        os.kill(server_pid, signal.SIGUSR1)
    load.on = True
    server_cpu = process_cpu(server_pid)
    main_cpu, threads_cpu = thread_cpu(server_pid)
    cpu, started = time.process_time(), time.perf_counter()
    await trio.sleep(seconds)
    load.over = True
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - cpu
    server_cpu = process_cpu(server_pid) - server_cpu
    main_after, threads_after = thread_cpu(server_pid)
    if profile:
        os.kill(server_pid, signal.SIGUSR2)
    return {
        "server_main_cpu_s": main_after - main_cpu,
        "server_threads_cpu_s": max(0.0, threads_after - threads_cpu),
        "requests": len(load.latencies),
        "items": load.items,
        "seconds": elapsed,
        "per_s": len(load.latencies) / elapsed,
        "items_per_s": load.items / elapsed,
        "p50_ms": quantile(load.latencies, 0.5) * 1e3,
        "p99_ms": quantile(load.latencies, 0.99) * 1e3,
        "client_cpu_share": client_cpu / elapsed,
        "server_cpu_share": server_cpu / elapsed,
        "items_per_server_cpu_s": load.items / server_cpu if server_cpu else None,
    }


def _checked(status: int, body: bytes, expected: int = 200) -> bytes:
    if status != expected:
        raise HttpError(f"HTTP {status}: {body[:300]!r}")
    return body


async def _bare_worker(conn: Connection, load: Load) -> None:
    request = conn.prepare("POST", "/echo", b'{"run_id":"r-1","proposal":"{}"}')
    timer = time.perf_counter
    await load.ready()
    while True:
        started = timer()
        status, body = await conn.request(request)
        _checked(status, body)
        load.record(timer() - started)


def _load_child(config: dict[str, Any]) -> dict[str, Any]:
    """A load generator's process: one load against the server on ``config['port']``."""
    import trio

    kind = config["kind"]
    if kind == "steps":
        return trio.run(external_steps, config["port"], config["steps"])
    if kind == "inprocess":
        return trio.run(inprocess_steps, config["db"], config["steps"])
    if kind == "inprocess_load":
        return trio.run(inprocess_load, config["db"], config["runs"], config["seconds"])
    if kind == "channel":
        return trio.run(
            channel_load,
            config["channel"],
            config["connections"],
            config["runs"],
            config["seconds"],
            config["server_pid"],
            config.get("profile", False),
        )
    worker: Worker
    if kind == "bare":
        worker = _bare_worker
    elif kind == "proposals":
        worker = _proposal_worker
    elif kind == "verify":
        worker = functools.partial(_verify_worker, batch=config["batch"])
    else:
        raise ValueError(f"unknown load {kind!r}")
    return trio.run(
        drive,
        config["port"],
        config["connections"],
        config["seconds"],
        worker,
        config["server_pid"],
        config.get("profile", False),
    )


# -- the gateway's loads (the routes of issue 17) -------------------------------------------


def _run_id(prefix: str) -> str:
    import uuid

    return f"{prefix}-{uuid.uuid4().hex[:16]}"


async def create_run(conn: Connection, run_id: str) -> dict[str, Any]:
    body = _encode({"machine": "cycle", "inputs": {}, "run_id": run_id, "mode": "external"})
    status, answer = await conn.request(conn.prepare("POST", "/v1/runs", body))
    run: dict[str, Any] = _decode(_checked(status, answer, 201))
    return run


def _accepted(verdict: dict[str, Any]) -> dict[str, Any]:
    if not verdict.get("accepted"):
        raise HttpError(f"a legal proposal was not accepted: {verdict}")
    return verdict


async def _proposal_worker(conn: Connection, load: Load) -> None:
    run_id = _run_id("p")
    run = await create_run(conn, run_id)
    state, seq = run["state"], run["seq"]
    path = f"/v1/runs/{run_id}/proposals"
    timer = time.perf_counter
    await load.ready()
    n = 0
    while True:
        request = conn.prepare(
            "POST", path, _encode({"proposal": transition(state, n), "expected_seq": seq})
        )
        started = timer()
        status, answer = await conn.request(request)
        verdict = _accepted(_decode(_checked(status, answer)))
        load.record(timer() - started)
        state, seq = verdict["state"], verdict["seq"]
        n += 1


async def _verify_worker(conn: Connection, load: Load, *, batch: int) -> None:
    runs = []
    for _ in range(batch):
        run_id = _run_id("v")
        run = await create_run(conn, run_id)
        runs.append([run_id, run["state"], run["seq"]])
    timer = time.perf_counter
    await load.ready()
    n = 0
    while True:
        items = [
            {"run_id": run_id, "proposal": transition(state, n), "expected_seq": seq}
            for run_id, state, seq in runs
        ]
        request = conn.prepare("POST", "/v1/verify", _encode({"items": items}))
        started = timer()
        status, answer = await conn.request(request)
        verdicts = _decode(_checked(status, answer))["verdicts"]
        load.record(timer() - started, len(verdicts))
        for entry, verdict in zip(runs, verdicts, strict=True):
            _accepted(verdict)
            entry[1], entry[2] = verdict["state"], verdict["seq"]
        n += 1


async def channel_load(
    url: str, connections: int, runs: int, seconds: float, server_pid: int, profile: bool = False
) -> dict[str, Any]:
    """``runs`` external runs on each of ``connections`` channel connections, each run a
    task proposing its next transition as soon as it has the last verdict: many runs
    multiplexed and pipelined on one connection."""
    import trio

    from interlock.client._channel import open_channel

    load = Load(connections * runs)
    timer = time.perf_counter

    async def one_run(channel: Any) -> None:
        run = await channel.create_run("cycle", run_id=_run_id("c"), mode="external")
        run_id, state, seq = run.id, run.state, run.seq
        await load.ready()
        n = 0
        while True:
            started = timer()
            verdict = await channel.propose(run_id, transition(state, n), expected_seq=seq)
            load.record(timer() - started)
            if not verdict.accepted:
                raise HttpError(f"a legal transition was not accepted: {verdict}")
            state, seq = verdict.state, verdict.seq
            n += 1

    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(open_channel(url)) for _ in range(connections)]
        async with trio.open_nursery() as nursery:
            for channel in channels:
                for _ in range(runs):
                    nursery.start_soon(one_run, channel)
            figures = await _window(load, seconds, server_pid, profile)
            nursery.cancel_scope.cancel()
    return figures


async def external_steps(port: int, steps: int) -> dict[str, Any]:
    """``steps`` external steps over HTTP, one at a time: propose a call, report it."""
    conn = await Connection.open(port)
    try:
        run_id = _run_id("s")
        run = await create_run(conn, run_id)
        seq = run["seq"]
        propose, report = f"/v1/runs/{run_id}/proposals", f"/v1/runs/{run_id}/results"
        latencies = []
        timer = time.perf_counter
        for n in range(-steps // 10, steps):  # a tenth more as a warm-up
            started = timer()
            status, answer = await conn.request(
                conn.prepare(
                    "POST", propose, _encode({"proposal": call(n + steps), "expected_seq": seq})
                )
            )
            verdict = _accepted(_decode(_checked(status, answer)))
            result = {"key": verdict["key"], "result": {"status": "shipped", "n": n}}
            status, answer = await conn.request(conn.prepare("POST", report, _encode(result)))
            seq = _accepted(_decode(_checked(status, answer)))["seq"]
            if n >= 0:
                latencies.append(timer() - started)
    finally:
        await conn.aclose()
    return _step_figures(latencies)


async def inprocess_steps(db: str, steps: int) -> dict[str, Any]:
    """The same steps through ``Supervisor.submit`` in this process, on a SQLite journal."""
    from interlock import open_supervisor
    from interlock.messages import Propose, Report
    from interlock.stores import open_sqlite_store

    store = await open_sqlite_store(db)
    try:
        async with open_supervisor([build_machine()], store) as sup:
            run_id = _run_id("i")
            await sup.start_run("cycle", run_id=run_id, external=True)
            seq = sup.view(run_id).seq
            latencies = []
            timer = time.perf_counter
            for n in range(-steps // 10, steps):
                started = timer()
                verdict = await sup.submit(Propose(run_id=run_id, seq=seq, raw=call(n + steps)))
                if not verdict.accepted or verdict.execute is None:
                    raise RuntimeError(f"a legal call was not accepted: {verdict}")
                done = await sup.submit(
                    Report(
                        run_id=run_id,
                        seq=verdict.seq,
                        key=verdict.execute.key,
                        ok=True,
                        result={"status": "shipped", "n": n},
                    )
                )
                if not done.accepted:
                    raise RuntimeError(f"a report was not accepted: {done}")
                seq = done.seq
                if n >= 0:
                    latencies.append(timer() - started)
    finally:
        await store.aclose()
    return _step_figures(latencies)


async def inprocess_load(db: str, runs: int, seconds: float) -> dict[str, Any]:
    """The floor of the batch rows: ``runs`` external runs driven concurrently through
    ``Supervisor.submit`` in this process (one task each, the next transition as soon as
    the last verdict came), on a SQLite journal; no HTTP, no gateway."""
    import trio

    from interlock import open_supervisor
    from interlock.messages import Propose
    from interlock.stores import open_sqlite_store

    load = Load(runs)
    pid = os.getpid()
    store = await open_sqlite_store(db)
    try:
        async with open_supervisor([build_machine()], store) as sup:

            async def one_run() -> None:
                run_id = _run_id("f")
                await sup.start_run("cycle", run_id=run_id, external=True)
                view = sup.view(run_id)
                state, seq = view.state, view.seq
                await load.ready()
                timer = time.perf_counter
                n = 0
                while True:
                    started = timer()
                    verdict = await sup.submit(
                        Propose(run_id=run_id, seq=seq, raw=transition(state, n))
                    )
                    load.record(timer() - started)
                    if not verdict.accepted:
                        raise RuntimeError(f"a legal transition was not accepted: {verdict}")
                    state, seq = verdict.state, verdict.seq
                    n += 1

            async with trio.open_nursery() as nursery:
                for _ in range(runs):
                    nursery.start_soon(one_run)
                # the server is this process: its CPU is the whole process's
                figures = await _window(load, seconds, pid)
                nursery.cancel_scope.cancel()
    finally:
        await store.aclose()
    return figures


def _step_figures(latencies: list[float]) -> dict[str, Any]:
    return {
        "steps": len(latencies),
        "mean_us": sum(latencies) / len(latencies) * 1e6,
        "p50_us": quantile(latencies, 0.5) * 1e6,
        "p99_us": quantile(latencies, 0.99) * 1e6,
    }


# -- the section ----------------------------------------------------------------------------


def _load(server: Server, kind: str, **config: Any) -> dict[str, Any]:
    row = run_child(
        "benchmarks.bench_gateway",
        {"kind": kind, "port": server.port, "server_pid": server.proc.pid, **config},
    )
    row["kind"] = kind
    return row


def _channel_load(
    server: Server, connections: int, runs: int, seconds: float, **config: Any
) -> dict[str, Any]:
    """The channel's load on ``server``: ``runs`` runs on each of ``connections``."""
    return _load(
        server,
        "channel",
        channel=server.channel,
        connections=connections,
        runs=runs,
        seconds=seconds,
        **config,
    )


def has_gateway() -> bool:
    return importlib.util.find_spec("interlock.gateway._serve") is not None


def has_channel() -> bool:
    return importlib.util.find_spec("interlock.client._channel") is not None


def _median_throughput(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose proposals per server CPU second are the median, with every round's
    figure (``rounds_per_server_cpu_s``, in the order taken)."""
    median = sorted(rounds, key=lambda r: r["items_per_server_cpu_s"])[len(rounds) // 2]
    return {
        **median,
        "rounds_per_server_cpu_s": [r["items_per_server_cpu_s"] for r in rounds],
    }


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose rate is the median."""
    return dict(sorted(rounds, key=lambda r: r["items_per_s"])[len(rounds) // 2])


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    level = 0 if quick else 1
    connections, seconds, rounds = CONNECTIONS[level], SECONDS[level], ROUNDS[level]
    results: dict[str, Any] = {
        "connections": connections,
        "batch_connections": BATCH_CONNECTIONS[level],
        "window_s": seconds,
        "rounds": rounds,
        "rows": [],
    }
    rows = results["rows"]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gateway-")))
        bare = stack.enter_context(running("bare"))
        gateway = (
            stack.enter_context(running("gateway", str(tmp / "single.db")))
            if has_gateway()
            else None
        )
        # the ceiling and the gateway in turns, each server idle while the other is loaded,
        # so that a noisy neighbour lands on both: the ratio is taken per round
        ceiling, single, ratios = [], [], []
        for index in range(rounds):
            progress(f"ceiling and single proposals, round {index + 1}", 0.4 * index / rounds)
            ceiling.append(_load(bare, "bare", connections=connections, seconds=seconds))
            if gateway is not None:
                single.append(_load(gateway, "proposals", connections=connections, seconds=seconds))
                ratios.append(
                    {
                        "wall": single[-1]["per_s"] / ceiling[-1]["per_s"],
                        "cpu": single[-1]["items_per_server_cpu_s"]
                        / ceiling[-1]["items_per_server_cpu_s"],
                    }
                )
        if gateway is None:
            rows.append({"label": CEILING, **_median_round(ceiling)})
            results["missing"] = "interlock.gateway has no server (_serve) in this checkout"
            return results
        # both rows from the round whose ratio (per server CPU second) is the median
        median = sorted(range(rounds), key=lambda i: ratios[i]["cpu"])[rounds // 2]
        rows.append({"label": CEILING, **ceiling[median], "round": median + 1})
        rows.append({"label": SINGLE, **single[median], "round": median + 1})
        results["ratios"] = ratios
        results["share_of_ceiling"] = quantile([r["wall"] for r in ratios], 0.5)
        results["share_of_ceiling_cpu"] = quantile([r["cpu"] for r in ratios], 0.5)
        # NOTE: the goal's rows (batches, the channel) are the median of THROUGHPUT_ROUNDS
        # rounds, each on a fresh server and journal, the loads taken in turns: on a shared
        # host one window of the same build swings by a quarter
        throughput_rounds = THROUGHPUT_ROUNDS[level]
        batch_rounds: dict[int, list[dict[str, Any]]] = {b: [] for b in BATCHES[level]}
        channel_rounds: dict[tuple[int, int], list[dict[str, Any]]] = {
            c: [] for c in CHANNEL[level]
        }
        for round_index in range(throughput_rounds):
            for index, batch in enumerate(BATCHES[level]):
                progress(
                    f"POST /v1/verify, batches of {batch}, round {round_index + 1}",
                    0.45 + 0.15 * (round_index + index / len(BATCHES[level])) / throughput_rounds,
                )
                with running("gateway", str(tmp / f"verify-{batch}-{round_index}.db")) as server:
                    batch_rounds[batch].append(
                        _load(
                            server,
                            "verify",
                            connections=BATCH_CONNECTIONS[level],
                            seconds=seconds,
                            batch=batch,
                        )
                    )
            if has_channel():
                for index, (conns, runs) in enumerate(CHANNEL[level]):
                    progress(
                        f"the channel: {conns} connection(s) x {runs} runs, round {round_index + 1}",
                        0.6 + 0.1 * (round_index + index / len(CHANNEL[level])) / throughput_rounds,
                    )
                    with running(
                        "gateway", str(tmp / f"channel-{conns}-{round_index}.db")
                    ) as server:
                        channel_rounds[(conns, runs)].append(
                            _channel_load(server, conns, runs, seconds)
                        )
        for batch, taken in batch_rounds.items():
            rows.append(
                {
                    "label": f"POST /v1/verify, batches of {batch:,}",
                    "batch": batch,
                    **_median_throughput(taken),
                }
            )
        progress("in process: Supervisor.submit, the same proposals", 0.6)
        floor_runs = CHANNEL[level][0][1]
        rows.append(
            {
                "label": f"in process: `Supervisor.submit`, {floor_runs:,} runs at once (no HTTP)",
                "floor": True,
                **run_child(
                    "benchmarks.bench_gateway",
                    {
                        "kind": "inprocess_load",
                        "db": str(tmp / "floor.db"),
                        "runs": floor_runs,
                        "seconds": seconds,
                    },
                ),
            }
        )
        if has_channel():
            for (conns, runs), taken in channel_rounds.items():
                rows.append(
                    {
                        "label": f"channel: {conns} connection(s), {runs:,} runs each",
                        "channel": True,
                        **_median_throughput(taken),
                    }
                )
            # where the server's CPU per proposal goes: the decide path timed in a server of
            # its own, and the same load on a memory store (the journal's part is the rest)
            progress("the split of the server's CPU per proposal", 0.72)
            conns, runs = CHANNEL[level][-1]
            timings = tmp / "decide.json"
            with running("gateway-timed", str(tmp / "timed.db"), str(timings)) as server:
                timed = _channel_load(server, conns, runs, seconds, profile=True)
            with running("gateway", ":memory:") as server:
                memory = _channel_load(server, conns, runs, seconds)
            memory["kind"] = "channel_memory"  # not journaled: never counted for the goal
            rows.append(
                {
                    "label": f"channel: {conns} connection(s), {runs:,} runs each, on a memory "
                    "store (not journaled: the split below)",
                    "memory": True,
                    **memory,
                }
            )
            decide = json.loads(timings.read_text()) if timings.exists() else None
            results["split"] = split(timed, memory, decide)
            results["split_label"] = f"the channel, {conns} connection(s) × {runs:,} runs"
            results["split_note"] = split_text(results)
        else:
            results["missing_channel"] = "interlock.gateway has no streaming channel here"
        if not quick:
            progress("a profile of the gateway under batches of 1,000", 0.75)
            stats = str(tmp / "gateway.prof")
            with running("gateway", str(tmp / "profiled.db"), stats) as server:
                _load(
                    server,
                    "verify",
                    connections=BATCH_CONNECTIONS[level],
                    seconds=seconds,
                    batch=1000,
                    profile=True,
                )
            if Path(stats).exists() and Path(stats).stat().st_size > 100:
                results.update(profile_rows(stats))
                results["profile_label"] = "the gateway process under batches of 1,000, cProfile"
            else:
                size = Path(stats).stat().st_size if Path(stats).exists() else None
                results["profile_missing"] = (
                    f"the profiled server wrote no stats ({size} bytes; killed: "
                    f"{server.killed}): {server.stderr[-500:]}"
                )
        progress("one external step, over HTTP and in process", 0.8)
        steps = STEPS[level]
        results["step_http"] = _load(gateway, "steps", steps=steps)
        results["step_inprocess"] = run_child(
            "benchmarks.bench_gateway",
            {"kind": "inprocess", "db": str(tmp / "inprocess.db"), "steps": steps},
        )
    ceiling_row = rows[0]
    for row in rows[:2]:  # requests against requests: the batches carry many proposals each
        row["share_of_ceiling"] = row["per_s"] / ceiling_row["per_s"]
        if row.get("items_per_server_cpu_s") and ceiling_row.get("items_per_server_cpu_s"):
            row["share_of_ceiling_cpu"] = (
                row["items_per_server_cpu_s"] / ceiling_row["items_per_server_cpu_s"]
            )
    return results


def split(
    timed: dict[str, Any], memory: dict[str, Any], decide: dict[str, Any] | None
) -> dict[str, Any]:
    """The server's CPU per proposal (µs) by part, from the timed load on SQLite, the same
    load on a memory store and the decide path's own time (see ``_time_decide``).

    - ``journal_us``: what the SQLite journal costs, the CPU per proposal above the memory
      store's (its writer and checkpoint threads, ``threads_us``, and on the main thread
      the encoding and framing of each batch's events);
    - ``decide_us``: ``Supervisor.submit_nowait`` per proposal;
    - ``rest_us``: the rest of the memory store's CPU per proposal: the gateway's own code
      (frames read and decoded, the service's dispatch, settling a batch, the verdicts
      encoded and written), trio's scheduling and the sockets, the group commit's loop.
    """
    items = timed.get("items") or 0
    if not items or not timed.get("items_per_server_cpu_s") or not memory.get("items"):
        return {}
    total = 1e6 / timed["items_per_server_cpu_s"]
    in_memory = 1e6 / memory["items_per_server_cpu_s"]
    out: dict[str, Any] = {
        "total_us": total,
        "main_us": timed["server_main_cpu_s"] / items * 1e6,
        "threads_us": timed["server_threads_cpu_s"] / items * 1e6,
        "memory_total_us": in_memory,
        "journal_us": total - in_memory,
        "memory_per_cpu_s": memory["items_per_server_cpu_s"],
    }
    if decide and decide.get("calls"):
        out["decide_us"] = decide["seconds"] / decide["calls"] * 1e6
        out["rest_us"] = in_memory - out["decide_us"]
    return out


def split_text(results: dict[str, Any]) -> str:
    """The split in one paragraph (also a note of the goal), or "" if not measured."""
    parts = results.get("split") or {}
    if not parts:
        return ""
    total = parts["total_us"]

    def part(key: str) -> str:
        return f"{parts[key]:.1f} µs ({parts[key] / total:.0%})"

    text = (
        f"Where the server's CPU per proposal goes ({results.get('split_label', 'the channel')}, "
        f"SQLite): {total:.1f} µs in all. The SQLite journal {part('journal_us')}: the same load "
        f"on a memory store costs {parts['memory_total_us']:.1f} µs "
        f"({parts['memory_per_cpu_s']:,.0f} per CPU second); the store's writer and "
        f"checkpoint threads alone use {parts['threads_us']:.1f} µs per proposal, the rest "
        "of its cost is each batch's encoding and framing on the main thread."
    )
    if "decide_us" in parts:
        text += (
            f" The decide path (`Supervisor.submit_nowait`: decider, gate, fold, counters, "
            f"timed in the server) {part('decide_us')}. Everything else {part('rest_us')}: "
            "the gateway's own code (frames read and decoded, the service's dispatch, a "
            "batch settled, verdicts encoded and written) with trio's scheduling, the "
            "sockets, the group commit's loop and the memory store's append."
        )
    return text


CEILING = "hypercorn trio worker, bare ASGI endpoint (the ceiling)"
SINGLE = "gateway: one proposal per request"


def find(results: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((row for row in results.get("rows", []) if row["label"] == label), None)


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, table

    def share(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.2f}" if row.get(key) is not None else "–"

    rows = [
        (
            row["label"],
            f"{row['per_s']:,.0f}",
            f"{row['items_per_s']:,.0f}",
            f"{row['items_per_server_cpu_s']:,.0f}" if row.get("items_per_server_cpu_s") else "–",
            num(row["p50_ms"], 2),
            num(row["p99_ms"], 2),
            share(row, "share_of_ceiling"),
            share(row, "share_of_ceiling_cpu"),
            f"{row['server_cpu_share']:.0%}",
            "(same process)" if row.get("floor") else f"{row['client_cpu_share']:.0%}",
        )
        for row in results["rows"]
    ]
    parts = [
        table(
            [
                "load",
                "requests/s",
                "proposals/s",
                "proposals per server CPU s",
                "p50 ms",
                "p99 ms",
                "requests/s of the ceiling",
                "per CPU s of the ceiling",
                "server CPU",
                "client CPU",
            ],
            rows,
        ),
        "",
        f"{results['connections']} keep-alive connections ({results['batch_connections']} for "
        f"the batches), {results['window_s']:.0f} s measured per row after a warm-up; each "
        "server and each load generator in its own process, on loopback. *proposals*: "
        "verified and journaled (SQLite, acknowledged after the batch is durable); a request "
        "of the ceiling counts as one. *per server CPU s*: the rate per second of the server "
        "process's own CPU over the window (`/proc`), i.e. per core. *server CPU*, *client "
        "CPU*: each process's CPU over the window as a share of one core (the client's well "
        "under one: the load generator is not the bottleneck).",
    ]
    if results.get("ratios"):
        rounds = ", ".join(f"{r['wall']:.2f} ({r['cpu']:.2f} per CPU s)" for r in results["ratios"])
        met = "met" if results["share_of_ceiling_cpu"] >= CEILING_GOAL else "missed"
        parts += [
            "",
            f"**Single proposals against the ceiling** (goal: {CEILING_GOAL} or more of it per "
            f"core): {results['share_of_ceiling_cpu']:.2f} per server CPU second, "
            f"{results['share_of_ceiling']:.2f} in requests/s (medians of {results['rounds']} "
            f"rounds taken in turns: {rounds}; the table shows the median round); {met}.",
        ]
    batches = [row for row in results["rows"] if "batch" in row or "channel" in row]
    floor = next((row for row in results["rows"] if row.get("floor")), None)
    if batches:
        best = max(batches, key=lambda row: row.get("items_per_server_cpu_s") or 0)
        per_core = best.get("items_per_server_cpu_s") or 0
        against = ""
        if floor and floor.get("items_per_server_cpu_s"):
            against = (
                f" The same proposals through `Supervisor.submit` in process, with no HTTP "
                f"(one task per run), make {floor['items_per_server_cpu_s']:,.0f} per CPU "
                f"second: the best gateway path makes "
                f"{per_core / floor['items_per_server_cpu_s']:.2f}× that."
            )
        taken = best.get("rounds_per_server_cpu_s") or []
        of_rounds = (
            f", the median of {len(taken)} rounds each on a fresh server "
            f"({', '.join(f'{r:,.0f}' for r in taken)})"
            if len(taken) > 1
            else ""
        )
        parts += [
            "",
            f"**Batches and the channel** (goal: {THROUGHPUT_GOAL:,.0f} verified, journaled "
            f"proposals/s or more on one core): {per_core:,.0f} per server CPU second at best "
            f"({best['label']}{of_rounds}), {best['items_per_s']:,.0f}/s in wall time; "
            f"{'met' if per_core >= THROUGHPUT_GOAL else 'missed'}.{against}",
        ]
    if split_text(results):
        parts += ["", split_text(results)]
    if results.get("profile_missing"):
        parts += ["", f"*No profile: {results['profile_missing']}*"]
    if results.get("profile_areas"):
        from benchmarks._harness import top_areas

        parts += [
            "",
            f"Own time by area ({results['profile_label']}): "
            f"{top_areas(results['profile_areas'], 8)}.",
        ]
    http, local = results.get("step_http"), results.get("step_inprocess")
    if http and local:
        parts += [
            "",
            table(
                [
                    "one external step (propose a call, verdict, report)",
                    "mean µs",
                    "p50 µs",
                    "p99 µs",
                ],
                [
                    (label, num(r["mean_us"], 0), num(r["p50_us"], 0), num(r["p99_us"], 0))
                    for label, r in (
                        ("over HTTP (gateway, one connection)", http),
                        ("in process (`Supervisor.submit`)", local),
                    )
                ],
            ),
            "",
            f"{http['steps']:,} steps one at a time, each on a SQLite journal: the gateway "
            f"adds {http['mean_us'] - local['mean_us']:,.0f} µs per step "
            f"({http['mean_us'] / local['mean_us']:.1f}× the in-process step).",
        ]
    if results.get("missing"):
        parts += ["", f"*Gateway rows not measured: {results['missing']}.*"]
    return "\n".join(parts)


def _child(config: dict[str, Any]) -> dict[str, Any]:
    return _load_child(config)


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--child"]:
        child_main(_child)
    elif argv[1:2] == ["--serve"]:
        serve(argv[2], argv[3] if len(argv) > 3 else "", argv[4] if len(argv) > 4 else "")
    else:
        results = run_alone("bench_gateway", run, render, argv)
        json.dump(results, sys.stderr, default=str)


if __name__ == "__main__":
    main(sys.argv)
