"""Which transport carries the gateway's streaming channel: measured, not guessed.

A client process sends small proposal-like msgpack Structs to a server process, which
decodes each one and answers with a verdict-like Struct; both run under trio, on loopback.
The client keeps a window of messages in flight on each connection (pipelined), on 1 and
on 8 connections, for a few seconds, and the script reports round trips per second and the
CPU time per message of the server process and of the client process (read from
``/proc/PID/stat``, so each side is charged only its own work).

Transports:

- ``ws``: a WebSocket on hypercorn's trio worker (hypercorn speaks it through wsproto), one
  proposal per WebSocket message; the client is the ``wsproto`` library over a trio TCP
  stream.
- ``ws-packed``: the same WebSocket, but each message carries every frame the client had
  ready (length-prefixed frames inside one WebSocket message), answered the same way.
- ``tcp``: length-prefixed frames (4-byte big-endian length + msgpack) on a trio TCP socket.
- ``unix``: the same frames on a trio Unix socket.

Server variants: ``plain`` (decode -> encode, nothing else) and ``checkpoint`` (the server
awaits a trio checkpoint once per batch of frames it read together, as a journal hand-off
would).

Run: ``python -m benchmarks.gateway_channel [--seconds 3] [--window 1000]``; it prints a
Markdown table (paste it into benchmarks/gateway_channel.md).

``--e2e RUNS`` measures the channel the gateway serves instead (``serve_channel``): a server
process with a real Supervisor journaling to SQLite (a temporary file) through
GatewayService, and a client process (``open_channel``) that drives RUNS external runs at
once, each one step: propose a tool call (verified; its intent journaled before the verdict),
report its result, propose the final move. It reports verified, journaled proposals/s and
the server's CPU per request.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import trio

HEADER = struct.Struct(">I")
TICKS = os.sysconf("SC_CLK_TCK")


class Proposal(msgspec.Struct, kw_only=True):
    """A proposal-like request frame: what an external agent sends per step."""

    id: int
    op: str
    run_id: str
    proposal: str
    expected_seq: int | None = None


class Violation(msgspec.Struct, kw_only=True):
    code: str
    path: str
    message: str
    hint: str


class Verdict(msgspec.Struct, kw_only=True):
    """A verdict-like response frame."""

    id: int
    run_id: str
    accepted: bool
    state: str
    seq: int
    key: str | None = None
    violations: list[Violation] = []


RAW = '{"tool": "refund", "args": {"order_id": "o-1042", "amount": 42.5, "reason": "damaged"}}'
ENCODER = msgspec.msgpack.Encoder()
DECODE_PROPOSAL = msgspec.msgpack.Decoder(Proposal).decode
DECODE_VERDICT = msgspec.msgpack.Decoder(Verdict).decode


def answer(data: bytes | memoryview) -> Verdict:
    """The server's work per message: decode the proposal, build its verdict."""
    p = DECODE_PROPOSAL(data)
    return Verdict(
        id=p.id, run_id=p.run_id, accepted=True, state="REFUND", seq=p.id + 1, key=f"{p.run_id}:R:1"
    )


def proposal_bytes(i: int, conn: int) -> bytes:
    return ENCODER.encode(Proposal(id=i, op="propose", run_id=f"run-{conn}-{i % 64}", proposal=RAW))


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def split_frames(buffer: bytearray) -> list[bytes]:
    """Remove every complete length-prefixed frame from ``buffer``."""
    out = []
    pos = 0
    n = len(buffer)
    while n - pos >= 4:
        (size,) = HEADER.unpack_from(buffer, pos)
        if n - pos - 4 < size:
            break
        out.append(bytes(buffer[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    del buffer[:pos]
    return out


# -- servers -------------------------------------------------------------------


async def handle_stream(stream: trio.abc.Stream, checkpoint: bool) -> None:
    buffer = bytearray()
    encode = ENCODER.encode
    try:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            buffer += data
            frames = split_frames(buffer)
            if not frames:
                continue
            if checkpoint:
                await trio.lowlevel.checkpoint()
            out = bytearray()
            for f in frames:
                body = encode(answer(f))
                out += HEADER.pack(len(body))
                out += body
            await stream.send_all(out)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return


async def ws_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "websocket":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    checkpoint = scope["path"].endswith("/checkpoint")
    packed = "/packed" in scope["path"]
    await receive()
    await send({"type": "websocket.accept"})
    encode = ENCODER.encode
    while True:
        message = await receive()
        if message["type"] != "websocket.receive":
            return
        data = message.get("bytes") or b""
        if checkpoint:
            await trio.lowlevel.checkpoint()
        if packed:
            out = bytearray()
            for f in split_frames(bytearray(data)):
                body = encode(answer(f))
                out += HEADER.pack(len(body))
                out += body
            await send({"type": "websocket.send", "bytes": bytes(out)})
        else:
            await send({"type": "websocket.send", "bytes": encode(answer(data))})


async def serve(kind: str, variant: str, where: str) -> None:
    checkpoint = variant == "checkpoint"
    if kind == "ws":
        from hypercorn.config import Config
        from hypercorn.trio import serve as hypercorn_serve

        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.errorlog = None
        config.max_app_queue_size = int(os.environ.get("H3_QUEUE", "10"))
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(hypercorn_serve, ws_app, config)
            port = binds[0].rsplit(":", 1)[1]
            print(f"READY {port}", flush=True)
        return
    listeners: list[trio.SocketListener]
    if kind == "tcp":
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        address = str(listeners[0].socket.getsockname()[1])
    else:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(where)
        sock.listen(128)
        listeners = [trio.SocketListener(sock)]
        address = where
    print(f"READY {address}", flush=True)
    await trio.serve_listeners(lambda s: handle_stream(s, checkpoint), listeners)


# -- clients -------------------------------------------------------------------


async def open_connection(kind: str, address: str) -> trio.abc.Stream:
    if kind == "unix":
        return await trio.open_unix_socket(address)
    return await trio.open_tcp_stream("127.0.0.1", int(address))


class Credits:
    """Answers received and not yet refilled: the sender waits on it, the receiver adds."""

    def __init__(self) -> None:
        self.count = 0
        self.lot = trio.lowlevel.ParkingLot()

    def give(self, n: int) -> None:
        self.count += n
        self.lot.unpark_all()

    async def take(self) -> int:
        while self.count == 0:
            await self.lot.park()
        n, self.count = self.count, 0
        return n


async def pipeline(send: Any, receive: Any, window: int, deadline: float) -> int:
    """Keep ``window`` messages in flight until ``deadline``, then drain; return the count.

    Sending and receiving are separate tasks: a client that only reads between its writes
    deadlocks against a server that stops reading while its answers are not read.
    """
    credits = Credits()
    state = {"sent": 0, "done": 0, "stopped": False}

    async def sender(cancel: trio.CancelScope) -> None:
        await send(0, window)
        state["sent"] = window
        while True:
            n = await credits.take()
            if time.monotonic() >= deadline:
                break
            await send(state["sent"], n)
            state["sent"] += n
        state["stopped"] = True
        if state["done"] >= state["sent"]:
            cancel.cancel()

    async def receiver(cancel: trio.CancelScope) -> None:
        while True:
            got = await receive()
            state["done"] += got
            if state["stopped"] and state["done"] >= state["sent"]:
                cancel.cancel()
                return
            credits.give(got)

    with trio.move_on_after(
        max(deadline - time.monotonic(), 0) + float(os.environ.get("H3_LIMIT", "60"))
    ) as limit:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender, nursery.cancel_scope)
            nursery.start_soon(receiver, nursery.cancel_scope)
    if limit.cancelled_caught:
        raise RuntimeError(f"answers stopped coming: {state}")
    return state["done"]


async def stream_client(
    stream: trio.abc.Stream, conn: int, window: int, deadline: float, counts: list[int]
) -> None:
    buffer = bytearray()

    async def send(first: int, count: int) -> None:
        await stream.send_all(
            b"".join(frame(proposal_bytes(first + i, conn)) for i in range(count))
        )

    async def receive() -> int:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                raise RuntimeError("server closed the connection")
            buffer.extend(data)
            frames = split_frames(buffer)
            if frames:
                for f in frames:
                    DECODE_VERDICT(f)
                return len(frames)

    counts[conn] = await pipeline(send, receive, window, deadline)


async def ws_client(
    address: str, path: str, conn: int, window: int, deadline: float, counts: list[int]
) -> None:
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, BytesMessage, Request

    packed = "/packed" in path
    stream = await trio.open_tcp_stream("127.0.0.1", int(address))
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host="127.0.0.1", target=path)))
    accepted = False
    while not accepted:
        ws.receive_data(await stream.receive_some(65536))
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                accepted = True

    async def send(first: int, count: int) -> None:
        if packed:
            # at most 100 frames a message, so the first window is not one giant message
            data = b"".join(
                ws.send(
                    BytesMessage(
                        data=b"".join(
                            frame(proposal_bytes(first + i, conn))
                            for i in range(start, min(count, start + 100))
                        )
                    )
                )
                for start in range(0, count, 100)
            )
        else:
            data = b"".join(
                ws.send(BytesMessage(data=proposal_bytes(first + i, conn))) for i in range(count)
            )
        await stream.send_all(data)

    partial = bytearray()

    async def receive() -> int:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                raise RuntimeError("server closed the connection")
            ws.receive_data(data)
            got = 0
            for event in ws.events():
                if isinstance(event, BytesMessage):
                    # NOTE: wsproto hands a large message over in parts
                    partial.extend(event.data)
                    if not event.message_finished:
                        continue
                    if packed:
                        frames = split_frames(partial)
                        for f in frames:
                            DECODE_VERDICT(f)
                        got += len(frames)
                    else:
                        DECODE_VERDICT(partial)
                        del partial[:]
                        got += 1
            if got:
                return got

    counts[conn] = await pipeline(send, receive, window, deadline)


async def client(
    kind: str, address: str, path: str, conns: int, window: int, seconds: float
) -> None:
    counts = [0] * conns
    started = time.monotonic()
    deadline = started + seconds
    cpu0 = time.process_time()
    async with trio.open_nursery() as nursery:
        for c in range(conns):
            if kind.startswith("ws"):
                nursery.start_soon(ws_client, address, path, c, window, deadline, counts)
            else:
                stream = await open_connection(kind, address)
                nursery.start_soon(stream_client, stream, c, window, deadline, counts)
    wall = time.monotonic() - started
    print(json.dumps({"messages": sum(counts), "wall": wall, "cpu": time.process_time() - cpu0}))


# -- the driver ------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def run_client(
    kind: str, address: str, path: str, conns: int, window: int, seconds: float
) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "benchmarks.gateway_channel",
        "--client",
        kind,
        "--address",
        address,
    ]
    command += [
        "--path",
        path,
        "--conns",
        str(conns),
        "--window",
        str(window),
        "--seconds",
        str(seconds),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(
    kind: str, variant: str, conns_list: list[int], window: int, seconds: float
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "channel.sock")
        server_kind = "ws" if kind.startswith("ws") else kind
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.gateway_channel",
                "--serve",
                server_kind,
                "--variant",
                variant,
                "--where",
                where,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline().split()
            if not line or line[0] != "READY":
                raise RuntimeError(f"server did not start: {line}")
            address = line[1]
            path = "/v1/channel"
            if kind == "ws-packed":
                path += "/packed"
            if variant == "checkpoint":
                path += "/checkpoint"
            run_client(kind, address, path, 1, min(window, 100), 0.3)  # warm-up
            rows = []
            for conns in conns_list:
                before = cpu_seconds(server.pid)
                result = run_client(kind, address, path, conns, window, seconds)
                server_cpu = cpu_seconds(server.pid) - before
                n = result["messages"]
                rows.append(
                    {
                        "transport": kind,
                        "variant": variant,
                        "conns": conns,
                        "window": window,
                        "messages": n,
                        "per_s": n / result["wall"],
                        "server_us": server_cpu / n * 1e6,
                        "client_us": result["cpu"] / n * 1e6,
                    }
                )
                print(
                    f"  {kind:9} {variant:10} conns={conns} {rows[-1]['per_s']:9,.0f}/s  "
                    f"server {rows[-1]['server_us']:5.1f} us/msg  client {rows[-1]['client_us']:5.1f} us/msg",
                    file=sys.stderr,
                    flush=True,
                )
            return rows
        finally:
            server.terminate()
            server.wait(timeout=30)


# -- end to end: the gateway's channel over a real supervisor ----------------------------

CHARGE = '{"tool": "charge", "args": {"cents": 500}}'
DONE = '{"next": "COMPLETED", "data": {"receipt": "r-9"}}'


def shop() -> Any:
    from interlock import Machine, Tool, Worker

    class Charge(msgspec.Struct, forbid_unknown_fields=True):
        cents: int

    async def never(args: Any, ctx: Any) -> Any:
        raise AssertionError("an external run's tool is executed by its caller")

    return Machine(
        "shop",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", never, Charge)],
    )


class TrivialService:
    """Answers like GatewayService after one checkpoint (per call, or per batch), deciding
    nothing: the channel's own cost is what is left."""

    async def create_run(self, body: Any, principal: Any = None) -> tuple[Any, bool]:
        from interlock.protocol import RunOut

        await trio.lowlevel.checkpoint()
        run = RunOut(
            id=body.run_id, machine="shop", mode="external", state="PAY", seq=1, outcome="running"
        )
        return run, True

    async def verify_batch(self, body: Any, principal: Any = None) -> Any:
        from interlock.protocol import VerifyOut

        await trio.lowlevel.checkpoint()
        return VerifyOut(verdicts=[self._verdict(i.run_id, i.proposal) for i in body.items])

    async def propose(self, run_id: str, body: Any, principal: Any = None) -> Any:
        await trio.lowlevel.checkpoint()
        return self._verdict(run_id, body.proposal)

    @staticmethod
    def _verdict(run_id: str, proposal: str) -> Any:
        from interlock.protocol import VerdictOut

        if "COMPLETED" in proposal:
            return VerdictOut(
                run_id=run_id, accepted=True, outcome="completed", state="COMPLETED", seq=6
            )
        return VerdictOut(
            run_id=run_id, accepted=True, outcome="running", state="PAY", seq=3,
            key=f"{run_id}:PAY:2", tool="charge", args={"cents": 500},
        )  # fmt: skip

    async def report(self, run_id: str, body: Any, principal: Any = None) -> Any:
        from interlock.protocol import VerdictOut

        await trio.lowlevel.checkpoint()
        return VerdictOut(run_id=run_id, accepted=True, outcome="running", state="PAY", seq=5)


async def serve_gateway_channel(db: str) -> None:
    from interlock import open_supervisor
    from interlock.gateway import GatewayService
    from interlock.gateway._channel import serve_channel
    from interlock.gateway._keys import KeyRing
    from interlock.stores import open_sqlite_store

    if db == "trivial":
        async with trio.open_nursery() as nursery:
            url = await nursery.start(
                lambda task_status: serve_channel(
                    TrivialService(),  # type: ignore[arg-type]
                    keyring=KeyRing(),
                    task_status=task_status,
                )
            )
            print(f"READY {url}", flush=True)
            await trio.sleep_forever()
    store = await open_sqlite_store(db)
    try:
        async with open_supervisor([shop()], store) as sup, trio.open_nursery() as nursery:
            service = GatewayService(sup, max_waiting=1_000_000)
            url = await nursery.start(
                lambda task_status: serve_channel(
                    service, keyring=KeyRing(), task_status=task_status
                )
            )
            print(f"READY {url}", flush=True)
            await trio.sleep_forever()
    finally:
        await store.aclose()


async def drive_runs(url: str, runs: int, server_pid: int, only_propose: bool = False) -> None:
    from interlock.client._channel import open_channel

    async with open_channel(url) as channel:
        async with trio.open_nursery() as nursery:
            for i in range(runs):
                nursery.start_soon(partial_create, channel, i)
        cpu0, server0, started = time.process_time(), cpu_seconds(server_pid), time.monotonic()
        async with trio.open_nursery() as nursery:
            for i in range(runs):
                nursery.start_soon(propose_once if only_propose else one_step, channel, i)
        wall = time.monotonic() - started
        server = cpu_seconds(server_pid) - server0
        client = time.process_time() - cpu0
    proposals = runs if only_propose else 2 * runs
    requests = runs if only_propose else 3 * runs
    print(
        json.dumps(
            {
                "runs": runs,
                "wall": wall,
                "proposals_per_s": proposals / wall,
                "requests_per_s": requests / wall,
                "server_us_per_request": server / requests * 1e6,
                "server_proposals_per_cpu_s": proposals / server,
                "client_us_per_request": client / requests * 1e6,
            }
        )
    )


async def partial_create(channel: Any, i: int) -> None:
    await channel.create_run("shop", run_id=f"e-{i}")


async def propose_once(channel: Any, i: int) -> None:
    call = await channel.propose(f"e-{i}", CHARGE, expected_seq=1)
    assert call.accepted, call


async def one_step(channel: Any, i: int) -> None:
    run_id = f"e-{i}"
    call = await channel.propose(run_id, CHARGE, expected_seq=1)
    assert call.accepted, call
    assert call.key, call
    done = await channel.report(run_id, call.key, {"charged": 500})
    end = await channel.propose(run_id, DONE, expected_seq=done.seq)
    assert end.outcome == "completed", end


async def batched(sup: Any, runs: int) -> None:
    """Each request decided in one task with submit_nowait, one Sync per batch: what a batch
    path through the service could do."""
    from interlock.core._messages import Sync
    from interlock.messages import Propose, Report

    ids = [f"e-{i}" for i in range(runs)]
    calls = [sup.submit_nowait(Propose(run_id=r, seq=1, raw=CHARGE)) for r in ids]
    await sup.request(Sync(run_id=ids[0]))
    done = [
        sup.submit_nowait(Report(run_id=r, key=c.execute.key, ok=True, result={"charged": 500}))
        for r, c in zip(ids, calls, strict=True)
    ]
    await sup.request(Sync(run_id=ids[0]))
    ends = [
        sup.submit_nowait(Propose(run_id=r, seq=d.seq, raw=DONE))
        for r, d in zip(ids, done, strict=True)
    ]
    await sup.request(Sync(run_id=ids[1]))
    assert all(e.outcome == "completed" for e in ends)
    for r in ids:
        if r in sup._runs:
            sup.release(r)


async def in_process(runs: int, through: str) -> dict[str, float]:
    """The same steps without the channel: Supervisor.submit, or GatewayService's methods."""
    import resource

    from interlock import open_supervisor
    from interlock.gateway import GatewayService
    from interlock.messages import Propose, Report
    from interlock.protocol import ProposalIn, ResultIn
    from interlock.stores import open_sqlite_store

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    with tempfile.TemporaryDirectory() as tmp:
        store = await open_sqlite_store(os.path.join(tmp, "j.db"))
        try:
            async with open_supervisor([shop()], store) as sup:
                service = GatewayService(sup, max_waiting=1_000_000)

                async def start(i: int) -> None:
                    await sup.start_run("shop", run_id=f"e-{i}", external=True)

                async def by_supervisor(i: int) -> None:
                    run_id = f"e-{i}"
                    call = await sup.submit(Propose(run_id=run_id, seq=1, raw=CHARGE))
                    assert call.execute is not None
                    done = await sup.submit(
                        Report(
                            run_id=run_id, key=call.execute.key, ok=True, result={"charged": 500}
                        )
                    )
                    end = await sup.submit(Propose(run_id=run_id, seq=done.seq, raw=DONE))
                    assert end.outcome == "completed", end

                async def by_service(i: int) -> None:
                    run_id = f"e-{i}"
                    call = await service.propose(
                        run_id, ProposalIn(proposal=CHARGE, expected_seq=1)
                    )
                    assert call.key is not None
                    done = await service.report(
                        run_id, ResultIn(key=call.key, result={"charged": 500})
                    )
                    end = await service.propose(
                        run_id, ProposalIn(proposal=DONE, expected_seq=done.seq)
                    )
                    assert end.outcome == "completed", end

                async with trio.open_nursery() as nursery:
                    for i in range(runs):
                        nursery.start_soon(start, i)
                step = by_supervisor if through == "supervisor" else by_service
                cpu0, started = cpu(), time.monotonic()
                if through == "batch":
                    await batched(sup, runs)
                else:
                    async with trio.open_nursery() as nursery:
                        for i in range(runs):
                            nursery.start_soon(step, i)
                wall, used = time.monotonic() - started, cpu() - cpu0
        finally:
            await store.aclose()
    return {
        "proposals_per_s": 2 * runs / wall,
        "requests_per_s": 3 * runs / wall,
        "cpu_us_per_request": used / (3 * runs) * 1e6,
    }


def over_channel(runs: int, db: str, only_propose: bool = False) -> dict[str, float]:
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gateway_channel", "--serve-e2e", db],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline().split()
        if not line or line[0] != "READY":
            raise RuntimeError(f"server did not start: {line}")
        command = [sys.executable, "-m", "benchmarks.gateway_channel", "--drive", line[1]]
        command += ["--runs", str(runs), "--server-pid", str(server.pid)]
        command += ["--only-propose"] if only_propose else []
        out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
        result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
        return result
    finally:
        server.terminate()
        server.wait(timeout=30)


def end_to_end(runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = over_channel(runs, os.path.join(tmp, "j.db"))
    with tempfile.TemporaryDirectory() as tmp:
        proposals = over_channel(runs, os.path.join(tmp, "j.db"), only_propose=True)
    trivial = over_channel(runs, "trivial")
    inside = {
        through: trio.run(in_process, runs, through)
        for through in ("supervisor", "service", "batch")
    }
    print(f"command: `python -m benchmarks.gateway_channel --e2e {runs}`\n")
    print(
        "| path | runs at once | verified proposals/s | requests/s | server CPU µs/request "
        "| client CPU µs/request |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| channel (2 processes) | {runs:,} | {result['proposals_per_s']:,.0f} | "
        f"{result['requests_per_s']:,.0f} | {result['server_us_per_request']:.1f} | "
        f"{result['client_us_per_request']:.1f} |"
    )
    print(
        f"| channel, one accepted proposal a run | {runs:,} | "
        f"{proposals['proposals_per_s']:,.0f} | {proposals['requests_per_s']:,.0f} | "
        f"{proposals['server_us_per_request']:.1f} | {proposals['client_us_per_request']:.1f} |"
    )
    print(
        f"| channel over a trivial service (its own cost) | {runs:,} | "
        f"{trivial['proposals_per_s']:,.0f} | {trivial['requests_per_s']:,.0f} | "
        f"{trivial['server_us_per_request']:.1f} | {trivial['client_us_per_request']:.1f} |"
    )
    for through, row in inside.items():
        name = {
            "supervisor": "Supervisor.submit",
            "service": "GatewayService",
            "batch": "submit_nowait + one Sync a batch",
        }[through]
        print(
            f"| {name} in process | {runs:,} | {row['proposals_per_s']:,.0f} | "
            f"{row['requests_per_s']:,.0f} | {row['cpu_us_per_request']:.1f} (with the callers) | - |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--serve", choices=["ws", "tcp", "unix"])
    parser.add_argument("--client", choices=["ws", "ws-packed", "tcp", "unix"])
    parser.add_argument("--variant", default="plain", choices=["plain", "checkpoint"])
    parser.add_argument("--where", default="")
    parser.add_argument("--address", default="")
    parser.add_argument("--path", default="/v1/channel")
    parser.add_argument("--conns", type=int, default=1)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--transports", default="tcp,unix,ws-packed,ws")
    parser.add_argument("--e2e", type=int, default=0, metavar="RUNS")
    parser.add_argument("--serve-e2e", default="")
    parser.add_argument("--drive", default="")
    parser.add_argument("--only-propose", action="store_true")
    parser.add_argument("--runs", type=int, default=0)
    parser.add_argument("--server-pid", type=int, default=0)
    args = parser.parse_args()
    if args.serve_e2e:
        trio.run(serve_gateway_channel, args.serve_e2e)
        return
    if args.drive:
        trio.run(drive_runs, args.drive, args.runs, args.server_pid, args.only_propose)
        return
    if args.e2e:
        end_to_end(args.e2e)
        return
    if args.serve:
        trio.run(serve, args.serve, args.variant, args.where)
        return
    if args.client:
        trio.run(
            client, args.client, args.address, args.path, args.conns, args.window, args.seconds
        )
        return
    rows: list[dict[str, Any]] = []
    for kind in args.transports.split(","):
        for variant in ("plain", "checkpoint"):
            rows += measure(kind, variant, [1, 8], args.window, args.seconds)
    print(
        f"command: `python -m benchmarks.gateway_channel --seconds {args.seconds} --window {args.window}`\n"
    )
    print(
        "| transport | server | connections | window each | round trips/s | server CPU µs/msg | client CPU µs/msg |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['transport']} | {r['variant']} | {r['conns']} | {r['window']} | {r['per_s']:,.0f} | "
            f"{r['server_us']:.1f} | {r['client_us']:.1f} |"
        )


if __name__ == "__main__":
    main()
