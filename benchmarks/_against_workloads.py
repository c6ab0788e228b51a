"""The five workloads of ``benchmarks.against``, each written so that it runs unchanged on
the tree before the layers move (issue 34) and on the tree after it.

``python -m benchmarks._against_workloads NAME '{"size": ...}'`` runs one workload in this
process against whichever ``interlock`` is first on ``PYTHONPATH`` and prints one JSON line
(``RESULT_MARK`` + figures); ``against.py`` starts it once per tree and round. Every
figure is a cost (lower is better): µs per step, per proposal, or seconds.

Only names both trees export are used: ``interlock``'s ``Machine``, ``Tool``, ``Worker``,
``Budgets``, ``RunView``, ``ToolContext``, ``Reject``, ``App`` and ``open_supervisor``,
``interlock.providers.ScriptedProvider``, ``interlock.stores.MemoryStore`` and
``open_sqlite_store``, and ``interlock.gateway.serve_gateway`` and ``Limits``. The gateway
is spoken to over loopback as any client would: raw JSON over HTTP/1.1 (the request Structs
moved from ``interlock.gateway`` to ``interlock.protocol``), and the channel's frames (a
4-byte big-endian length + a msgpack map ``{id, op, run_id, body}``) written by hand
(``open_channel`` moved and has no public home in both trees).

One exception: the gate has no public entry point in either tree, so :func:`gate` finds
the same internal functions under their old (``interlock._gate``) or new
(``interlock.core._gate``) module name; nothing else differs between the two.

Workloads (``size`` is the quick or full size ``against.py`` passes):

- ``step``: the hosted step. ``size`` runs of 20 steps at once through ``open_supervisor``
  with an instant scripted provider, a no-op five-field tool with one guard and a
  MemoryStore: wall and CPU µs per step (bench_loop's concurrent case);
- ``gate``: the gate as a step runs it (the compiled accept path, the Python gate for what
  it rejects) on 1,000 proposals, 5% malformed, ``size`` passes: µs per proposal
  (bench_verify's goal row);
- ``verify_batch``: ``POST /v1/verify`` with ``size`` items (each one external run's next
  transition) from 2 connections, against ``serve_gateway`` on SQLite in another process:
  µs of the server's CPU per verified, journaled proposal, and wall µs per proposal;
- ``channel``: ``size`` external runs multiplexed on one channel connection, each proposing
  its next transition as soon as it has the last verdict: the same two figures;
- ``concurrency``: ``size`` concurrent runs of 10 steps, each model call 5-20 ms of
  simulated latency, journaled to a SQLite file: wall and CPU seconds (bench_concurrency's
  "interlock" row; 10,000 runs at full size).

``against.py`` also counts instructions (valgrind, the same load at two sizes,
differenced): of this process for ``step`` and ``gate``; of the server's, for the gateway
workloads, which then send a fixed number of ``batches`` (``{"valgrind": PATH}`` runs the
server under cachegrind and reports ``server_instructions``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
from typing import Annotated, Any, Literal

import msgspec

RESULT_MARK = "@@against "
STEPS = 20
CONCURRENCY_STEPS = 10
TOTAL = 100.0
REASONS = ("damaged", "late", "wrong_item", "not_received", "other")
HEADER = struct.Struct(">I")


# -- the machine of the step, the gate and the concurrency workloads -----------------------


class RefundArgs(msgspec.Struct, forbid_unknown_fields=True):
    """The five-field tool call of benchmarks/_workload.py (copied: that module reads
    names of the new layout)."""

    order_id: Annotated[str, msgspec.Meta(pattern=r"^ORD-[0-9]{6}$")]
    amount: Annotated[float, msgspec.Meta(gt=0)]
    reason: Literal["damaged", "late", "wrong_item", "not_received", "other"]
    note: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    tags: Annotated[list[str], msgspec.Meta(min_length=1, max_length=10)]


def within_total(args: RefundArgs, view: Any) -> Any:
    from interlock import Reject

    total = view.inputs.get("total", TOTAL)
    if args.amount > total:
        return Reject(
            f"args.amount: {args.amount} exceeds the order total {total}",
            f"propose amount <= {total}",
            "args.amount",
        )
    return None


async def noop(args: Any, ctx: Any) -> dict[str, bool]:
    return {"ok": True}


def refund_machine() -> Any:
    from interlock import Budgets, Machine, Tool, Worker

    return Machine(
        name="bench",
        initial="WORK",
        states={
            "WORK": Worker(next=["DONE"], tools=["refund"], instructions="refund, then finish")
        },
        tools=[Tool("refund", noop, args=RefundArgs, guards=(within_total,), idempotent=True)],
        budgets=Budgets(tokens=10**12, steps=10**6, deadline=10.0**9),
    )


def _call_args(rng: random.Random, step: int) -> dict[str, Any]:
    return {
        "order_id": f"ORD-{rng.randrange(10**6):06d}",
        "amount": round(rng.uniform(0.01, TOTAL), 2),
        "reason": REASONS[step % len(REASONS)],
        "note": f"step {step}: the parcel arrived {rng.choice(('crushed', 'wet', 'late'))}",
        "tags": [f"t{k}" for k in range(1 + step % 10)],
    }


def _call_raw(args: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"tool": "refund", "args": args})


def step_script(steps: int, seed: int = 7) -> list[str]:
    """One run's raw outputs: ``steps - 1`` distinct tool calls, then a move to DONE."""
    rng = random.Random(seed)
    outputs = [_call_raw(_call_args(rng, i)).decode() for i in range(steps - 1)]
    return [*outputs, '{"next": "DONE"}']


def proposals(count: int, malformed_share: float = 0.05, seed: int = 4) -> list[bytes]:
    """``count`` raw proposals, ``malformed_share`` of them broken the ways models do."""
    rng = random.Random(seed)
    items = [_call_raw(_call_args(rng, i)) for i in range(count)]
    for n, index in enumerate(rng.sample(range(count), round(count * malformed_share))):
        raw = items[index]
        items[index] = (
            raw[:-2] + b",}}",
            b"```json\n" + raw + b"\n```",
            raw[: len(raw) * 2 // 3],
            b"Sure! Here is the call: " + raw,
        )[n % 4]
    return items


def latency_ms(run_index: int, step: int) -> float:
    """The simulated model latency of one call, 5-20 ms (benchmarks/_workload.py's)."""
    mixed = (run_index * 2654435761 + step * 40503 + 12345) % 1000
    return 5.0 + 15.0 * mixed / 999


# -- step ------------------------------------------------------------------------------------


def step(size: int) -> dict[str, Any]:
    import trio

    from interlock import RunView, open_supervisor
    from interlock.providers import ScriptedProvider
    from interlock.stores import MemoryStore

    machine = refund_machine()
    script = step_script(STEPS)

    def oracle(view: RunView) -> str:
        return script[view.steps]

    provider = ScriptedProvider(oracle)

    async def main() -> None:
        async with open_supervisor([machine], MemoryStore(), provider=provider) as supervisor:

            async def one(index: int) -> None:
                handle = await supervisor.start_run(
                    machine.name, {"total": TOTAL}, run_id=f"r{index}"
                )
                result = await handle.wait()
                assert result.outcome == "completed", result

            async with trio.open_nursery() as nursery:
                for i in range(size):
                    nursery.start_soon(one, i)

    cpu, wall = time.process_time(), time.perf_counter()
    trio.run(main)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    steps = max(1, size * STEPS)
    return {"us_per_step": wall / steps * 1e6, "cpu_us_per_step": cpu / steps * 1e6}


# -- gate ------------------------------------------------------------------------------------


def _internal(module: str) -> Any:
    """``interlock.core.MODULE`` (after the move) or ``interlock.MODULE`` (before it)."""
    try:
        return importlib.import_module(f"interlock.core.{module}")
    except ModuleNotFoundError:
        return importlib.import_module(f"interlock.{module}")


def gate_function() -> Any:
    """The gate: ``_gate.verify``, the same function in both trees. (Before the move a
    compiled accept path, ``_decide.accept_call``, could be timed on its own; the move
    deleted that benchmark entry point, and the compiled path now runs only inside
    ``on_propose``, which the step workload times with the rest of a step.)"""
    import interlock

    view_module = _internal("_view")
    events = importlib.import_module("interlock.events") if _has("interlock.events") else None
    run_started = getattr(events, "RunStarted", None) or interlock.RunStarted  # type: ignore[attr-defined]
    verify = _internal("_gate").verify
    board = _internal("_breakers").CircuitBoard()
    machine = refund_machine()
    run = view_module.RunState("bench-run", machine)
    run.apply(
        run_started(
            run_id="bench-run",
            seq=1,
            ts=1.0,
            machine="bench",
            state="WORK",
            inputs={"total": TOTAL},
        )
    )
    now = run.started_ts + 1.0
    return lambda raw: verify(machine, run, raw, now, board)


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def gate(size: int) -> dict[str, Any]:
    import gc

    fn = gate_function()
    raws = proposals(1_000)
    for raw in raws:  # warm: the plan and the decoders are built on first use
        fn(raw)
    per_pass = []
    gc.collect()
    for _ in range(size):
        started = time.perf_counter_ns()
        for raw in raws:
            fn(raw)
        per_pass.append((time.perf_counter_ns() - started) / len(raws) / 1000)
    per_pass.sort()
    return {"us_per_proposal": per_pass[len(per_pass) // 2] if per_pass else 0.0}


# -- the gateway: a server process, and the load from this one -----------------------------


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def _not_here(args: Lookup, ctx: Any) -> Any:  # external runs: the caller executes
    raise AssertionError("the benchmark's client executes its tools")


def gateway_app() -> Any:
    """Two worker states that hand over to each other (bench_gateway's ``cycle``)."""
    from interlock import App, Budgets, Machine, Tool, Worker

    machine = Machine(
        "cycle",
        "A",
        {
            "A": Worker(next=["B", "DONE"], tools=["lookup"]),
            "B": Worker(next=["A", "DONE"], tools=["lookup"]),
        },
        tools=[Tool("lookup", _not_here, Lookup, read_only=True, description="Find an order")],
        budgets=Budgets(tokens=10**12, steps=10**9, deadline=10.0**9),
    )
    return App([machine])


def serve(db: str) -> None:
    """The server's process: ``serve_gateway`` with the channel beside it, no rate limit;
    prints ``PORT http channel`` once it listens, serves until SIGTERM."""
    from functools import partial

    import trio

    from interlock.gateway import Limits, serve_gateway

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            started = await nursery.start(
                partial(
                    serve_gateway,
                    gateway_app(),
                    db=db,
                    host="127.0.0.1",
                    port=0,
                    channel_port=0,
                    limits=Limits(rate=None, request_timeout=None),
                )
            )
            sys.stdout.write(f"PORT {started.port} {started.channel}\n")
            sys.stdout.flush()
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    started.stop()
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)


_IREFS = re.compile(r"I\s+refs:\s+([\d,]+)")


@contextlib.contextmanager
def gateway_server(valgrind: str | None = None, counted: dict[str, int] | None = None) -> Any:
    """A gateway in its own process on a fresh SQLite journal: ``(pid, port, channel)``.

    With ``valgrind``, the server runs under cachegrind and, once it has exited (SIGTERM,
    drained), ``counted["instructions"]`` holds what it executed (every thread).
    """
    wrap = (
        [valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
        if valgrind
        else []
    )
    with tempfile.TemporaryDirectory(prefix="interlock-against-") as directory:
        proc = subprocess.Popen(
            [
                *wrap,
                sys.executable,
                "-m",
                "benchmarks._against_workloads",
                "serve",
                f"{directory}/j.db",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            if not line or line[0] != "PORT":
                proc.kill()
                raise RuntimeError(f"the gateway did not start:\n{proc.communicate()[1][-3000:]}")
            yield proc.pid, int(line[1]), line[2]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=600 if valgrind else 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
        if counted is not None:
            match = _IREFS.search(err)
            if proc.returncode or match is None:
                raise RuntimeError(
                    f"the server under valgrind exited {proc.returncode}: {err[-800:]}"
                )
            counted["instructions"] = int(match.group(1).replace(",", ""))


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, from ``/proc``."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transition(state: str, n: int) -> str:
    """The proposal that moves a run out of ``state`` (A or B), with distinct data ``n``."""
    return f'{{"next":"{"B" if state == "A" else "A"}","data":{{"n":{n}}}}}'


class Http:
    """One keep-alive HTTP/1.1 connection; responses parsed by hand (content-length or
    chunked), a new connection when the server says ``connection: close``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: Any = None
        self.buffer = bytearray()
        self.closing = True

    async def post(self, path: str, body: dict[str, Any], expected: int = 200) -> Any:
        import trio

        if self.closing:
            if self.stream is not None:
                await self.stream.aclose()
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            self.buffer.clear()
            self.closing = False
        data = msgspec.json.encode(body)
        await self.stream.send_all(
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        status, answer = await self._response()
        if status != expected:
            raise RuntimeError(f"POST {path}: HTTP {status}: {answer[:300]!r}")
        return msgspec.json.decode(answer)

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
            return int(head[9:12]), body
        parts = []
        while b"transfer-encoding: chunked" in head:
            while (line := buffer.find(b"\r\n")) < 0:
                await self._fill()
            size = int(bytes(buffer[:line]).split(b";")[0], 16)
            while len(buffer) < line + 4 + size:
                await self._fill()
            parts.append(bytes(buffer[line + 2 : line + 2 + size]))
            del buffer[: line + 4 + size]
            if size == 0:
                break
        return int(head[9:12]), b"".join(parts)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


def _accepted(verdict: dict[str, Any]) -> dict[str, Any]:
    if not verdict.get("accepted"):
        raise RuntimeError(f"a legal transition was not accepted: {verdict}")
    return verdict


def _window_figures(load: dict[str, Any], pid: int, seconds: float) -> Any:
    """An async function that waits for the warm-up, measures ``seconds`` of ``load``
    (``items`` counted by the workers while ``on``) and returns the figures."""
    import trio

    async def window() -> dict[str, Any]:
        await load["ready"].wait()
        await trio.sleep(max(0.2, seconds / 5))  # warm-up
        cpu, items, wall = process_cpu(pid), load["items"], time.perf_counter()
        await trio.sleep(seconds)
        cpu, items = process_cpu(pid) - cpu, load["items"] - items
        wall = time.perf_counter() - wall
        if not items:
            raise RuntimeError("no proposal was answered in the measured window")
        return {
            "server_cpu_us_per_proposal": cpu / items * 1e6,
            "wall_us_per_proposal": wall / items * 1e6,
            "proposals": items,
        }

    return window


def verify_batch(
    size: int,
    seconds: float = 3.0,
    connections: int = 2,
    batches: int = 0,
    valgrind: str | None = None,
) -> dict[str, Any]:
    """Timed over ``seconds``; or, with ``batches``, each connection sends exactly that many
    (with ``valgrind``: the server's instructions, counted)."""
    import trio

    async def main(pid: int, port: int) -> dict[str, Any]:
        load: dict[str, Any] = {"items": 0, "ready": trio.Event(), "waiting": connections}

        async def worker(prefix: str) -> None:
            http = Http(port)
            runs = []
            for i in range(size):
                run_id = f"{prefix}-{i}"
                run = await http.post(
                    "/v1/runs",
                    {"machine": "cycle", "inputs": {}, "run_id": run_id, "mode": "external"},
                    201,
                )
                runs.append([run_id, run["state"], run["seq"]])
            load["waiting"] -= 1
            if not load["waiting"]:
                load["ready"].set()
            n = 0
            try:
                while not batches or n < batches:
                    items = [
                        {"run_id": r, "proposal": transition(state, n), "expected_seq": seq}
                        for r, state, seq in runs
                    ]
                    verdicts = (await http.post("/v1/verify", {"items": items}))["verdicts"]
                    load["items"] += len(verdicts)
                    for entry, verdict in zip(runs, verdicts, strict=True):
                        _accepted(verdict)
                        entry[1], entry[2] = verdict["state"], verdict["seq"]
                    n += 1
            finally:
                with trio.CancelScope(shield=True):
                    await http.aclose()

        figures: dict[str, Any] = {"proposals": connections * size * batches}
        window = _window_figures(load, pid, seconds)
        async with trio.open_nursery() as nursery:
            for c in range(connections):
                nursery.start_soon(worker, f"v{c}")
            if not batches:
                figures = await window()
                nursery.cancel_scope.cancel()
        return figures

    counted: dict[str, int] = {}
    with gateway_server(valgrind, counted if valgrind else None) as (pid, port, _channel):
        result: dict[str, Any] = trio.run(main, pid, port)
    return {**result, **({"server_instructions": counted["instructions"]} if valgrind else {})}


class Channel:
    """One channel connection: requests pipelined, answers matched by id by one reader."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.next_id = 0
        self.waiting: dict[int, Any] = {}
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder().decode
        self.outgoing = bytearray()
        self.wake: Any = None
        self.hold = False
        """While set, queued frames wait (a whole wave goes out in one write)."""

    async def write(self) -> None:
        """Send what the runs' tasks queued, many frames per write (one sender at a time)."""
        import trio

        while True:
            while self.hold or not self.outgoing:
                self.wake = trio.Event()
                await self.wake.wait()
            data, self.outgoing = bytes(self.outgoing), bytearray()
            await self.stream.send_all(data)

    async def request(self, op: str, run_id: str | None, body: dict[str, Any]) -> Any:
        import trio

        self.next_id += 1
        frame_id = self.next_id
        payload = self.encode({"id": frame_id, "op": op, "run_id": run_id, "body": body})
        slot: list[Any] = [trio.Event(), None]
        self.waiting[frame_id] = slot
        self.outgoing += HEADER.pack(len(payload))
        self.outgoing += payload
        if self.wake is not None and not self.hold:
            self.wake.set()
        await slot[0].wait()
        answer = slot[1]
        if answer.get("problem") is not None:
            raise RuntimeError(f"the channel refused {op}: {answer['problem']}")
        return answer["body"]

    async def read(self) -> None:
        buffer = bytearray()
        while True:
            chunk = await self.stream.receive_some(262144)
            if not chunk:
                raise ConnectionError("the server closed the channel")
            buffer += chunk
            at = 0
            while len(buffer) - at >= 4:
                (length,) = HEADER.unpack_from(buffer, at)
                if len(buffer) - at - 4 < length:
                    break
                answer = self.decode(bytes(buffer[at + 4 : at + 4 + length]))
                at += 4 + length
                slot = self.waiting.pop(answer.get("id"), None)
                if slot is None:
                    raise RuntimeError(f"an answer for no request: {answer}")
                slot[1] = answer
                slot[0].set()
            del buffer[:at]


def channel(
    size: int, seconds: float = 3.0, batches: int = 0, valgrind: str | None = None
) -> dict[str, Any]:
    """Timed over ``seconds``, each run pipelined on its own; or, with ``batches``, that
    many waves of one proposal per run (with ``valgrind``: the server's instructions)."""
    import trio
    import trio.testing

    async def main(pid: int, url: str) -> dict[str, Any]:
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        load: dict[str, Any] = {"items": 0, "ready": trio.Event(), "waiting": size}
        stream = await trio.open_tcp_stream(host, int(port))
        conn = Channel(stream)

        async def one_run(index: int) -> None:
            run_id = f"c-{index}"
            run = await conn.request(
                "create_run",
                None,
                {"machine": "cycle", "inputs": {}, "run_id": run_id, "mode": "external"},
            )
            state, seq = run["state"], run["seq"]
            load["waiting"] -= 1
            if not load["waiting"]:
                load["ready"].set()
            n = 0
            while not batches or n < batches:
                verdict = _accepted(
                    await conn.request(
                        "propose", run_id, {"proposal": transition(state, n), "expected_seq": seq}
                    )
                )
                load["items"] += 1
                state, seq = verdict["state"], verdict["seq"]
                n += 1

        async def waves() -> None:
            """Counted: every run's proposal sent in one write, all answered, then the next
            wave: how many frames the server reads together does not depend on timing."""
            created = []
            for i in range(size):
                run_id = f"c-{i}"
                run = await conn.request(
                    "create_run",
                    None,
                    {"machine": "cycle", "inputs": {}, "run_id": run_id, "mode": "external"},
                )
                created.append([run_id, run["state"], run["seq"]])
            for n in range(batches):
                verdicts: list[Any] = [None] * size

                async def one(into: list[Any], i: int, run_id: str, body: Any) -> None:
                    into[i] = _accepted(await conn.request("propose", run_id, body))

                async with trio.open_nursery() as wave:
                    conn.hold = True  # the writer sends the whole wave at once
                    for i, (run_id, state, seq) in enumerate(created):
                        body = {"proposal": transition(state, n), "expected_seq": seq}
                        wave.start_soon(one, verdicts, i, run_id, body)
                    await trio.testing.wait_all_tasks_blocked()
                    conn.hold = False
                    conn.wake.set()
                for entry, verdict in zip(created, verdicts, strict=True):
                    entry[1], entry[2] = verdict["state"], verdict["seq"]

        window = _window_figures(load, pid, seconds)
        figures: dict[str, Any] = {"proposals": size * batches}
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.read)
                nursery.start_soon(conn.write)
                if batches:
                    await waves()
                else:
                    for i in range(size):
                        nursery.start_soon(one_run, i)
                    figures = await window()
                nursery.cancel_scope.cancel()
        finally:
            await stream.aclose()
        return figures

    counted: dict[str, int] = {}
    with gateway_server(valgrind, counted if valgrind else None) as (pid, _port, url):
        if not url.startswith("tcp://"):
            raise RuntimeError(f"the gateway served no channel on TCP: {url!r}")
        result: dict[str, Any] = trio.run(main, pid, url)
    return {**result, **({"server_instructions": counted["instructions"]} if valgrind else {})}


# -- concurrency -----------------------------------------------------------------------------


def concurrency(size: int) -> dict[str, Any]:
    import trio

    from interlock import RunView, open_supervisor
    from interlock.providers import ScriptedProvider
    from interlock.stores import open_sqlite_store

    script = step_script(CONCURRENCY_STEPS)
    machine = refund_machine()

    def oracle(view: RunView) -> str:
        return script[view.steps]

    def latency(view: RunView) -> float:
        return latency_ms(int(view.run_id[1:]), view.steps) / 1000.0

    provider = ScriptedProvider(oracle, latency=latency)
    completed = 0

    async def main(path: str) -> None:
        nonlocal completed
        store = await open_sqlite_store(path)
        async with open_supervisor([machine], store, provider=provider) as supervisor:

            async def one(index: int) -> None:
                nonlocal completed
                handle = await supervisor.start_run(
                    machine.name, {"total": TOTAL}, run_id=f"r{index}"
                )
                result = await handle.wait()
                completed += result.outcome == "completed"

            async with trio.open_nursery() as nursery:
                for i in range(size):
                    nursery.start_soon(one, i)
        await store.aclose()

    with tempfile.TemporaryDirectory(prefix="interlock-against-") as directory:
        cpu, wall = time.process_time(), time.perf_counter()
        trio.run(main, f"{directory}/journal.db")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if completed != size:
        raise RuntimeError(f"{size - completed} of {size} runs did not complete")
    return {"wall_s": wall, "cpu_s": cpu}


WORKLOADS = {
    "step": step,
    "gate": gate,
    "verify_batch": verify_batch,
    "channel": channel,
    "concurrency": concurrency,
}


def tree() -> dict[str, Any]:
    """Which interlock this process imported, and which compiled modules it loaded."""
    import interlock

    compiled = sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("interlock") and str(getattr(module, "__file__", "")).endswith(".so")
    )
    return {"interlock": os.path.dirname(interlock.__file__ or ""), "compiled": compiled}


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "serve":
        serve(argv[1])
        return
    if len(argv) != 2 or argv[0] not in WORKLOADS:
        sys.exit(
            "usage: python -m benchmarks._against_workloads "
            f"{{{','.join(WORKLOADS)}}} '{{\"size\": N}}'  (or: serve DB)"
        )
    config = json.loads(argv[1])
    figures = WORKLOADS[argv[0]](**config)
    sys.stdout.write(RESULT_MARK + json.dumps({"figures": figures, "tree": tree()}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
