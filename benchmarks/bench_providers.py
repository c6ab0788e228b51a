"""The real providers' own cost: per call against msgspec, per step against the simulated one.

Two measurements, as ratios of one run:

- *per call*, in process, no network: for each of ``OpenAIChat``, ``OpenAIResponses`` and
  ``AnthropicMessages``, a run of the benchmark's machine (a ``lookup`` tool, then a move)
  is driven through the real supervisor with the provider's transport replaced by one that
  hands back the fake server's exact response bodies, rendered once. When the run is
  ``depth`` steps into its history (1, 10, 25, 50), the provider's own work is timed right
  there on the live view, in CPU time: building the request body (``tool_specs`` +
  ``request_body(view, specs)``) as the call makes it (the first build at that depth,
  which renders the step just added; median over runs), again with nothing new (warm),
  and on a fresh view of the same run (cold: every step rendered again, the cost of a
  provider that rebuilds the conversation each call); and reading the response
  (``read(body)``); against ``msgspec.json.decode`` of the same response body alone (the
  floor) and ``msgspec.json.encode`` of the same request, already built (the encoding
  floor). Loops are the median of 7 rounds, the collector paused. With valgrind on the
  PATH, the full run also counts the instructions of a warm build + read at depth 10
  against the decode floor, in child processes at two sizes, differenced
  (as ``bench_instructions``).
- *per step*, 10,000 concurrent runs of 6 steps (5 lookups with distinct order ids, then
  ``transition`` to DONE; a MemoryStore journal), each configuration in a fresh child
  process: ``ScriptedProvider`` answering the same proposals (the simulated provider);
  each HTTP provider against the fake server (``interlock.testing._fake``, in its own
  process, started by ``python -m benchmarks.bench_providers --serve``; it reads the step
  from the conversation it is sent) over loopback HTTP with ``max_in_flight`` 256; and
  ``OpenAIChat`` with the in-process transport of the per-call part (the provider's code
  and the journaling of the exact bodies, no HTTP), and the same with the bodies dropped
  from its proposals (the provider's code alone). Reported: runs/s, step latency p50/p99
  (from one call of the model to the run's next, or to its end), CPU µs per step of the
  runtime process (``process_time`` over its ``trio.run``), the fake server's CPU beside
  it, and the CPU the provider layer adds per step over the simulated provider. A smaller
  run of ``OpenAIChat`` over HTTP is profiled (cProfile, own time by area) to show where
  the added CPU goes.

Run it alone: ``python -m benchmarks.bench_providers [--quick]`` prints the tables.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import gc
import io
import itertools
import math
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import msgspec

from benchmarks._harness import (
    ROOT,
    Progress,
    area_of,
    child_env,
    child_instructions,
    child_main,
    no_progress,
    quantile,
    run_alone,
    run_child,
    short_path,
)

NAME = "providers"
TITLE = "Providers: a model call's own cost, and the HTTP path at 10,000 runs"

PROVIDERS = ("OpenAIChat", "OpenAIResponses", "AnthropicMessages")
API = {"OpenAIChat": "chat", "OpenAIResponses": "responses", "AnthropicMessages": "messages"}
SIMULATED = "simulated (ScriptedProvider)"
LOCAL = "OpenAIChat, in-process transport"
UNJOURNALED = "OpenAIChat, in-process transport, bodies not journaled"
BARE = "floor: simulated + a bare loopback exchange"
HTTP_CHAT = "OpenAIChat, HTTP"
MAX_IN_FLIGHT = 256
LOOKUPS = 5
"""Lookups per run in the concurrent part: 6 steps with the move."""
DEPTHS = ((1, 10), (1, 10, 25, 50))
"""History depths (steps) at which the per-call part times a provider (quick, full)."""
RUN_HEADER = "x-bench-run"

_encode = msgspec.json.encode
_decode = msgspec.json.decode


# -- the workload: a lookup tool and a move -------------------------------------------------


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def lookup(args: Lookup, ctx: Any) -> dict[str, Any]:
    return {"order_id": args.order_id, "status": "shipped", "total": 40, "items": 2}


def build_machine() -> Any:
    from interlock import Budgets, Machine, ProviderPolicy, Tool, Worker

    return Machine(
        "orders",
        initial="WORK",
        states={
            "WORK": Worker(
                next=["DONE"],
                tools=["lookup"],
                instructions="Look up each order the customer named, then finish.",
            )
        },
        tools=[
            Tool("lookup", lookup, Lookup, read_only=True, description="Find an order by its id")
        ],
        budgets=Budgets(tokens=10**12, steps=10**6, deadline=10.0**9),
        provider_policy=ProviderPolicy(timeout=600.0, attempts=3, base=0.05, cap=0.5),
    )


def arguments(step: int, lookups: int) -> tuple[str, str]:
    """The call the model makes at ``step``: ``(tool, arguments)``, compact JSON."""
    if step < lookups:
        return "lookup", f'{{"order_id":"ORD-{step:06d}"}}'
    return "transition", f'{{"next":"DONE","data":{{"checked":{lookups}}}}}'


def raw_proposal(step: int, lookups: int) -> str:
    """The proposal that call makes (what ``_wire.to_raw`` splices), for the simulated run."""
    name, args = arguments(step, lookups)
    return args if name == "transition" else f'{{"tool":"{name}","args":{args}}}'


def reply(step: int, lookups: int) -> Any:
    from interlock.testing._fake import Reply

    return Reply(calls=[arguments(step, lookups)], usage=(600 + 80 * step, 24, 512, 0))


def response_body(api: str, step: int, lookups: int) -> bytes:
    """The fake server's exact response body for ``step``, rendered in process."""
    from interlock.testing import _fake

    payload = _fake._RENDERERS[api](reply(step, lookups), {"model": "bench-model"}, step + 1, 2000)
    return _fake._encode(payload)


def steps_answered(api: str, body: dict[str, Any]) -> int:
    """How many calls the conversation in a request body already answers."""
    if api == "chat":
        return sum(1 for m in body.get("messages", ()) if m.get("role") == "tool")
    if api == "responses":
        return sum(1 for i in body.get("input", ()) if i.get("type") == "function_call_output")
    return sum(
        1
        for m in body.get("messages", ())
        if m.get("role") == "user"
        for block in m.get("content", ())
        if isinstance(block, dict) and block.get("type") == "tool_result"
    )


def make_provider(name: str, base_url: str, **options: Any) -> Any:
    from interlock import providers

    cls = getattr(providers, name)
    url = base_url + ("/v1" if API[name] != "messages" else "")
    return cls(
        "bench-model", base_url=url, api_key="sk-bench", max_in_flight=MAX_IN_FLIGHT, **options
    )


class LocalTransport:
    """A transport with no network: each run's next response body, rendered once.

    The run is told by the ``RUN_HEADER`` the provider sends; its step by a count.
    """

    def __init__(self, api: str, lookups: int, steps: int) -> None:
        from interlock.providers._http import HttpResponse

        self.responses = [
            HttpResponse(200, {}, response_body(api, step, lookups)) for step in range(steps)
        ]
        self.position: defaultdict[str, int] = defaultdict(int)

    async def post(self, path: str, body: bytes, *, headers: Any = None, tokens: int = 0) -> Any:
        import trio

        await trio.lowlevel.checkpoint()
        run = headers[RUN_HEADER]
        step = self.position[run]
        self.position[run] = step + 1
        return self.responses[step]

    async def aclose(self) -> None:
        pass


def local_provider(name: str, lookups: int, steps: int) -> Any:
    return make_provider(
        name,
        "http://127.0.0.1:9",
        run_header=RUN_HEADER,
        transport=LocalTransport(API[name], lookups, steps),
    )


class Unjournaled:
    """Wraps a provider: its proposals with the request and response bodies dropped, so the
    journal records no prompt (the in-process row minus this one: what journaling the exact
    bodies costs; this one minus the simulated row: the provider's own code)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.model = inner.model
        self.check = inner.check

    async def propose(self, view: Any) -> Any:
        proposal = await self.inner.propose(view)
        return msgspec.structs.replace(proposal, prompt="", response=None)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Recording(LocalTransport):
    """The in-process transport, keeping every request body it is sent."""

    def __init__(self, api: str, lookups: int, steps: int) -> None:
        super().__init__(api, lookups, steps)
        self.bodies: list[bytes] = []

    async def post(self, path: str, body: bytes, *, headers: Any = None, tokens: int = 0) -> Any:
        self.bodies.append(body)
        return await super().post(path, body, headers=headers, tokens=tokens)


def recorded_bodies(name: str, lookups: int, steps: int) -> list[bytes]:
    """The exact request bodies ``name`` sends at each step of one run (in process)."""
    import trio

    from interlock import open_supervisor
    from interlock.stores import MemoryStore

    recording = Recording(API[name], lookups, steps)
    provider = make_provider(name, "http://127.0.0.1:9", run_header=RUN_HEADER, transport=recording)

    async def main() -> None:
        async with open_supervisor([build_machine()], MemoryStore(), provider=provider) as sup:
            handle = await sup.start_run("orders", {"customer": "c-0"}, run_id="r0")
            await handle.wait()

    trio.run(main)
    return recording.bodies


class BareExchange:
    """The floor under any HTTP provider: the simulated provider's proposals, each after one
    exchange with the fake server of the very bytes OpenAIChat sends at that step, over a
    plain keep-alive socket with no HTTP library (the request pre-encoded, the response
    read up to its content-length), at the same limit in flight. What it costs over the
    simulated row is what loopback HTTP costs under trio at the least."""

    def __init__(self, url: str, bodies: list[bytes], inner: Any) -> None:
        from urllib.parse import urlsplit

        from interlock.providers._http import _Slots

        parts = urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.requests = [
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: %b:%d\r\n"
            b"content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
            b"content-length: %d\r\n\r\n%b"
            % (str(parts.hostname).encode(), parts.port or 80, len(body), body)
            for body in bodies
        ]
        self.inner = inner
        self.model = inner.model
        self.idle: list[Any] = []
        self.slots = _Slots(MAX_IN_FLIGHT)

    async def propose(self, view: Any) -> Any:
        import socket

        import trio

        await self.slots.acquire()
        try:
            if self.idle:
                sock = self.idle.pop()
            else:
                stream = await trio.open_tcp_stream(*self.address)
                raw = stream.socket
                sock = socket.socket(raw.family, raw.type, raw.proto, fileno=raw.detach())
                sock.setblocking(False)
            view_ = memoryview(self.requests[view.steps])
            while view_:
                try:
                    view_ = view_[sock.send(view_) :]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sock)
            data = b""
            while True:
                try:
                    chunk = sock.recv(65536)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock)
                    continue
                if not chunk:
                    raise RuntimeError("the fake server closed the connection")
                data += chunk
                end = data.find(b"\r\n\r\n")
                if end >= 0:
                    at = data.find(b"content-length: ", 0, end) + 16
                    length = int(data[at : data.index(b"\r\n", at)])
                    if len(data) >= end + 4 + length:
                        break
            self.idle.append(sock)
        finally:
            self.slots.release()
        return await self.inner.propose(view)


# -- per call: the provider's own work on a live view ---------------------------------------


def _time_loop(fn: Any, rounds: int = 7, target_s: float = 0.02) -> float:
    """Median µs per call of ``fn()`` over ``rounds`` loops of ~``target_s`` each, in CPU
    time (``process_time``: a shared host's preemption is not counted)."""
    clock = time.process_time_ns
    started = clock()
    fn()
    once = max((clock() - started) / 1e9, 1e-7)
    loops = max(5, int(target_s / once))
    samples = []
    enabled = gc.isenabled()
    try:
        for _ in range(rounds):
            gc.collect()
            gc.disable()
            started = clock()
            for _ in range(loops):
                fn()
            samples.append((clock() - started) / loops / 1000)
            if enabled:
                gc.enable()
    finally:
        if enabled:
            gc.enable()
    return statistics.median(samples)


class Probe:
    """Wraps a provider; at each depth in ``depths``, times its work on the live view."""

    def __init__(
        self, inner: Any, api: str, lookups: int, depths: tuple[int, ...], act: Any
    ) -> None:
        self.inner = inner
        self.model = inner.model
        self.api = api
        self.lookups = lookups
        self.depths = depths
        self.act = act
        self.rows: list[dict[str, Any]] = []

    def check(self, machine: Any) -> None:
        self.inner.check(machine)

    async def propose(self, view: Any) -> Any:
        if view.steps in self.depths:
            self.rows.append(self.act(self.inner, view, self.api, self.lookups))
        return await self.inner.propose(view)


def time_calls(provider: Any, view: Any, api: str, lookups: int) -> dict[str, Any]:
    """Timed loops on the live view: the body built warm (what the view keeps is reused)
    and cold (a fresh view of the same run: every step rendered again), the read, the
    floors."""
    from interlock.core._view import RunView
    from interlock.core._wire import tool_specs

    transition, strict = provider.transition, provider.strict
    body = provider.request_body(view, tool_specs(view, transition, strict))
    built = _decode(body)
    response = response_body(api, view.steps, lookups)
    parsed = provider.read(response)
    assert parsed[0] == raw_proposal(view.steps, lookups), parsed  # read exactly
    run = view._run

    def warm() -> None:
        provider.request_body(view, tool_specs(view, transition, strict))

    def cold() -> None:
        fresh = RunView(run)
        provider.request_body(fresh, tool_specs(fresh, transition, strict))

    return {
        "depth": view.steps,
        "request_bytes": len(body),
        "response_bytes": len(response),
        "warm_us": _time_loop(warm),
        "cold_us": _time_loop(cold),
        "encode_floor_us": _time_loop(lambda: _encode(built)),
        "read_us": _time_loop(lambda: provider.read(response)),
        "decode_floor_us": _time_loop(lambda: _decode(response)),
    }


def time_first(provider: Any, view: Any, api: str, lookups: int) -> dict[str, Any]:
    """One sample: the call's own build, the first at this depth (it renders the new step)."""
    from interlock.core._wire import tool_specs

    clock = time.process_time_ns
    started = clock()
    provider.request_body(view, tool_specs(view, provider.transition, provider.strict))
    return {"depth": view.steps, "first_us": (clock() - started) / 1000}


def _loop_calls(size: int) -> Any:
    """An ``act`` for the instruction count: ``size`` builds and reads, nothing timed."""

    def act(provider: Any, view: Any, api: str, lookups: int) -> dict[str, Any]:
        from interlock.core._wire import tool_specs

        response = response_body(api, view.steps, lookups)
        with _collector_paused():
            for _ in range(size):
                provider.request_body(view, tool_specs(view, provider.transition, provider.strict))
                provider.read(response)
        return {}

    return act


def _loop_floor(size: int) -> Any:
    def act(provider: Any, view: Any, api: str, lookups: int) -> dict[str, Any]:
        response = response_body(api, view.steps, lookups)
        with _collector_paused():
            for _ in range(size):
                _decode(response)
        return {}

    return act


@contextlib.contextmanager
def _collector_paused() -> Any:
    """The cyclic collector off for a counted loop: a full collection that falls inside
    the larger size's loop but not the smaller's would add its millions of instructions to
    the difference (seen: one build + read counted at 3x its instructions)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def drive_probe(
    name: str, depths: tuple[int, ...], act: Any, runs: int = 1
) -> list[dict[str, Any]]:
    """``runs`` runs one after the other, ``max(depths) + 1`` steps each, probed at each depth."""
    import trio

    from interlock import open_supervisor
    from interlock.stores import MemoryStore

    lookups = max(depths)
    probe = Probe(local_provider(name, lookups, lookups + 1), API[name], lookups, depths, act)

    async def main() -> None:
        async with open_supervisor([build_machine()], MemoryStore(), provider=probe) as sup:
            for index in range(runs):
                handle = await sup.start_run("orders", {"customer": "c-1"}, run_id=f"p{index}")
                result = await handle.wait()
                if result.outcome != "completed":
                    raise RuntimeError(f"the probed run of {name} ended {result}")

    trio.run(main)
    return probe.rows


def per_call(quick: bool) -> list[dict[str, Any]]:
    depths = DEPTHS[0] if quick else DEPTHS[1]
    rows = []
    for name in PROVIDERS:
        firsts: defaultdict[int, list[float]] = defaultdict(list)
        for sample in drive_probe(name, depths, time_first, runs=5 if quick else 41):
            firsts[sample["depth"]].append(sample["first_us"])
        for row in drive_probe(name, depths, time_calls):
            row["first_us"] = statistics.median(firsts[row["depth"]])
            rows.append({"provider": name, **row})
    return rows


# -- instructions (cachegrind), optional ----------------------------------------------------

_COUNT_SIZES = (100, 600)


def count_instructions(valgrind: str, kind: str, name: str, size: int) -> int:
    return child_instructions(
        valgrind,
        "benchmarks.bench_providers",
        {"count": kind, "provider": name, "size": size},
        f"{kind} {name} (size {size})",
    )


def instructions(progress: Progress) -> dict[str, Any]:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return {"skipped": "valgrind is not installed (`apt-get install -y valgrind`)"}
    small, large = _COUNT_SIZES
    rows = []
    for index, name in enumerate(PROVIDERS):
        progress(f"cachegrind: {name}", index / len(PROVIDERS))
        counts = {}
        for kind in ("calls", "floor"):
            low = count_instructions(valgrind, kind, name, small)
            high = count_instructions(valgrind, kind, name, large)
            counts[kind] = (high - low) / (large - small)
        rows.append(
            {
                "provider": name,
                "call_instructions": counts["calls"],
                "floor_instructions": counts["floor"],
                "ratio": counts["calls"] / counts["floor"],
            }
        )
    return {"sizes": list(_COUNT_SIZES), "depth": 10, "rows": rows}


# -- per step: 10,000 concurrent runs -------------------------------------------------------


def serve(lookups: int) -> None:
    """The fake server's process: print ``PORT n``, then serve until killed."""
    import trio

    from interlock.testing._fake import serve_fake_llm

    def brain(api: str, body: dict[str, Any], headers: Any) -> Any:
        return reply(steps_answered(api, body), lookups)

    async def root() -> None:
        async with trio.open_nursery() as nursery:
            fake = await nursery.start(functools.partial(serve_fake_llm, brain, record=False))
            sys.stdout.write(f"PORT {fake.port}\n")
            sys.stdout.flush()

    trio.run(root)


class FakeServer:
    """The fake server in its own process: started, its CPU read from /proc, stopped."""

    def __init__(self, lookups: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_providers", "--serve", str(lookups)],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the fake server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Timed:
    """Wraps a provider: when each run calls the model, for the step latencies."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.model = inner.model
        self.calls: defaultdict[str, list[float]] = defaultdict(list)
        self.check = getattr(inner, "check", None) or (lambda machine: None)

    async def propose(self, view: Any) -> Any:
        self.calls[view.run_id].append(time.perf_counter())
        return await self.inner.propose(view)


def measure_runs(config: dict[str, Any]) -> dict[str, Any]:
    """Run ``config["runs"]`` concurrent runs with one provider configuration."""
    import trio

    from interlock import open_supervisor
    from interlock.providers import ScriptedProvider
    from interlock.stores import MemoryStore

    kind, runs, lookups = config["kind"], config["runs"], config["lookups"]
    steps = lookups + 1
    if kind in ("simulated", "bare"):
        script = [raw_proposal(step, lookups) for step in range(steps)]
        inner: Any = ScriptedProvider(lambda view: script[view.steps], model="bench-model")
        if kind == "bare":
            bodies = recorded_bodies(config["provider"], lookups, steps)
            inner = BareExchange(config["url"], bodies, inner)
    elif kind == "local":
        inner = local_provider(config["provider"], lookups, steps)
        if not config.get("bodies", True):
            inner = Unjournaled(inner)
    else:
        inner = make_provider(config["provider"], config["url"])
    provider = Timed(inner)
    ended: dict[str, float] = {}
    outcomes: defaultdict[str, int] = defaultdict(int)

    async def one(sup: Any, index: int) -> None:
        handle = await sup.start_run("orders", {"customer": f"c-{index}"}, run_id=f"r{index}")
        result = await handle.wait()
        ended[handle.run_id] = time.perf_counter()
        outcomes[result.outcome] += 1

    async def main() -> None:
        async with (
            open_supervisor([build_machine()], MemoryStore(), provider=provider) as sup,
            trio.open_nursery() as nursery,
        ):
            for index in range(runs):
                nursery.start_soon(one, sup, index)
        if hasattr(inner, "aclose"):
            await inner.aclose()

    result: dict[str, Any] = {}
    times = os.times()
    cpu = time.process_time()
    wall = time.perf_counter()
    if config.get("profile"):
        result.update(_profiled(lambda: trio.run(main)))
    else:
        trio.run(main)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    system = os.times().system - times.system
    latencies = []
    calls = 0
    for run_id, stamps in provider.calls.items():
        calls += len(stamps)
        marks = [*stamps, ended.get(run_id, stamps[-1])]
        latencies += [b - a for a, b in itertools.pairwise(marks)]
    return {
        **result,
        "runs": runs,
        "steps_per_run": steps,
        "model_calls": calls,
        "completed": outcomes.get("completed", 0),
        "outcomes": dict(outcomes),
        "wall_s": wall,
        "cpu_s": cpu,
        "runs_per_s": runs / wall,
        "cpu_us_per_step": cpu / max(1, calls) * 1e6,
        "system_us_per_step": system / max(1, calls) * 1e6,
        "step_p50_ms": quantile(latencies, 0.5) * 1e3,
        "step_p99_ms": quantile(latencies, 0.99) * 1e3,
    }


def _profiled(fn: Any, top: int = int(os.environ.get("BENCH_PROFILE_TOP", "14"))) -> dict[str, Any]:
    """cProfile of ``fn``: the top functions by own time and own time by area (h11 apart)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    raw: dict[Any, Any] = pstats.Stats(profiler, stream=io.StringIO()).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in raw.values()) or 1.0
    areas: defaultdict[str, float] = defaultdict(float)
    for (filename, _line, name), entry in raw.items():
        area = "h11" if "/h11/" in filename else area_of(filename, name)
        areas[area] += entry[2] / total
    ranked = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    rows = [
        {
            "function": f"{short_path(filename)}:{line}({name})",
            "calls": calls,
            "own_s": own,
            "cum_s": cumulative,
            "own_share": own / total,
        }
        for (filename, line, name), (_cc, calls, own, cumulative, _callers) in ranked
    ]
    inclusive: defaultdict[str, float] = defaultdict(float)
    for (filename, _line, name), entry in raw.items():
        for label, (tail, function) in INCLUSIVE.items():
            if filename.endswith(tail) and name == function:
                inclusive[label] += entry[3] / total
    return {
        "profile": rows,
        "profile_areas": dict(sorted(areas.items(), key=lambda kv: kv[1], reverse=True)),
        "profile_inclusive": dict(inclusive),
    }


#: Functions whose inclusive time (cProfile's cumulative: while running, callees included)
#: the profile reports as a share of all own time.
INCLUSIVE = {
    "HttpProvider.propose (the whole provider call)": ("providers/_openai.py", "propose"),
    "Transport.post (the HTTP exchange)": ("providers/_http.py", "post"),
    "request_body": ("providers/_openai.py", "request_body"),
    "read": ("providers/_openai.py", "read"),
}


def configurations(quick: bool, url: str) -> list[dict[str, Any]]:
    runs = 200 if quick else 10_000
    base = {"runs": runs, "lookups": LOOKUPS, "url": url}
    configs = [{**base, "kind": "simulated", "label": SIMULATED}]
    configs.append({**base, "kind": "bare", "provider": "OpenAIChat", "label": BARE})
    for name in PROVIDERS if not quick else PROVIDERS[:1]:
        configs.append({**base, "kind": "http", "provider": name, "label": f"{name}, HTTP"})
    configs.append({**base, "kind": "local", "provider": "OpenAIChat", "label": LOCAL})
    configs.append(
        {**base, "kind": "local", "provider": "OpenAIChat", "bodies": False, "label": UNJOURNALED}
    )
    return configs


ROUNDS = (1, 3)
"""Rounds of every row (quick, full), interleaved: the differences between rows are small
beside a shared host's noise, so each row is the median of these."""


def concurrent(quick: bool, progress: Progress) -> dict[str, Any]:
    server = FakeServer(LOOKUPS)
    samples: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
    try:
        configs = configurations(quick, server.url)
        plan = [config for _round in range(ROUNDS[0 if quick else 1]) for config in configs]
        for index, config in enumerate(plan):
            progress(f"{config['label']}: {config['runs']:,} runs", 0.3 + 0.6 * index / len(plan))
            before = server.cpu_seconds()
            row = run_child("benchmarks.bench_providers", config, timeout=1800)
            row["server_cpu_us_per_step"] = (
                (server.cpu_seconds() - before) / max(1, row["model_calls"]) * 1e6
            )
            samples[config["label"]].append({**config, **row})
        rows = []
        for config in configs:
            taken = sorted(samples[config["label"]], key=lambda r: r["cpu_us_per_step"])
            row = taken[len(taken) // 2]
            row["cpu_us_per_step_samples"] = [r["cpu_us_per_step"] for r in taken]
            rows.append(row)
        progress("profiling OpenAIChat over HTTP", 0.9)
        profiled = run_child(
            "benchmarks.bench_providers",
            {
                **next(c for c in configs if c["label"] == HTTP_CHAT),
                "runs": 200 if quick else 2_000,
                "profile": True,
            },
            timeout=1800,
        )
    finally:
        server.stop()
    simulated = rows[0]
    for row in rows:
        added = row["cpu_us_per_step"] - simulated["cpu_us_per_step"]
        row["added_us_per_step"] = added
        row["added_share"] = added / simulated["cpu_us_per_step"]
    return {
        "rows": rows,
        "max_in_flight": MAX_IN_FLIGHT,
        "profile": profiled["profile"],
        "profile_areas": profiled["profile_areas"],
        "profile_inclusive": profiled["profile_inclusive"],
        "profile_runs": profiled["runs"],
    }


# -- the section ----------------------------------------------------------------------------


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    progress("per call, in process", 0.0)
    results: dict[str, Any] = {"per_call": per_call(quick)}
    if not quick:
        results["instructions"] = instructions(lambda d, f: progress(d, 0.1 + 0.2 * f))
    results.update(concurrent(quick, progress))
    return results


def find(results: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((row for row in results.get("rows", []) if row["label"] == label), None)


def render(results: dict[str, Any]) -> str:
    from benchmarks._harness import top_areas
    from benchmarks._report import num, ratio, table

    calls = table(
        [
            "provider",
            "depth (steps)",
            "request B",
            "build µs",
            "warm µs",
            "cold µs",
            "encode floor µs",
            "response B",
            "read µs",
            "decode floor µs",
            "read × floor",
            "build + read × floor",
        ],
        [
            (
                r["provider"],
                r["depth"],
                f"{r['request_bytes']:,}",
                num(r["first_us"], 2),
                num(r["warm_us"], 2),
                num(r["cold_us"], 2),
                num(r["encode_floor_us"], 2),
                f"{r['response_bytes']:,}",
                num(r["read_us"], 2),
                num(r["decode_floor_us"], 2),
                ratio(r["read_us"] / r["decode_floor_us"]),
                ratio((r["first_us"] + r["read_us"]) / r["decode_floor_us"]),
            )
            for r in results["per_call"]
        ],
    )
    parts = [
        "**Per call**, in process, CPU time on the live view of a run *depth* steps into its "
        "history. *Build*: `request_body(view, tool_specs(...))` as the call makes it, the "
        "first at its depth (it renders the new step; median over runs); *warm*: the same "
        "again (nothing new to render); *cold*: on a fresh view of the run (every step "
        "rendered again); *encode floor*: `msgspec.json.encode` of the same request, already "
        "built; *read*: `read(body)` of the fake server's response; *floor*: "
        "`msgspec.json.decode` of that body alone. Loops: median of 7.",
        "",
        calls,
    ]
    counted = results.get("instructions") or {}
    if counted.get("rows"):
        parts += [
            "",
            f"Instructions (cachegrind, children at {counted['sizes'][0]:,} and "
            f"{counted['sizes'][1]:,} calls, differenced) of one build + read at depth "
            f"{counted['depth']}, against `msgspec.json.decode` of the response alone:",
            "",
            table(
                ["provider", "build + read, instructions", "decode floor", "× floor"],
                [
                    (
                        r["provider"],
                        f"{r['call_instructions']:,.0f}",
                        f"{r['floor_instructions']:,.0f}",
                        ratio(r["ratio"]),
                    )
                    for r in counted["rows"]
                ],
            ),
        ]
    elif counted.get("skipped"):
        parts += ["", f"*Instructions not counted: {counted['skipped']}.*"]
    body = [
        (
            r["label"],
            f"{r['completed']:,}/{r['runs']:,}",
            f"{r['model_calls']:,}",
            num(r["runs_per_s"]),
            num(r["step_p50_ms"], 2),
            num(r["step_p99_ms"], 2),
            num(r["cpu_us_per_step"])
            + (
                f" ({'–'.join(num(v, 0) for v in (r['cpu_us_per_step_samples'][0], r['cpu_us_per_step_samples'][-1]))})"
                if len(r.get("cpu_us_per_step_samples", ())) > 1
                else ""
            ),
            num(r.get("system_us_per_step")),
            num(r["added_us_per_step"]) if r["kind"] != "simulated" else "–",
            f"{r['added_share']:+.0%}" if r["kind"] != "simulated" else "–",
            num(r["server_cpu_us_per_step"]) if r["kind"] in ("http", "bare") else "–",
        )
        for r in results["rows"]
    ]
    first = results["rows"][0]
    parts += [
        "",
        f"**Per step**, {first['runs']:,} concurrent runs of {first['steps_per_run']} steps "
        f"(a MemoryStore journal), each row a fresh process; HTTP rows against the fake "
        f"server in its own process over loopback, `max_in_flight={results['max_in_flight']}`. "
        "*Step latency*: from one model call of a run to its next (or to the run's end). "
        "*CPU*: user + system time of the runtime's process (the median of each row's rounds, "
        "with the range); *kernel*: the system part (loopback TCP "
        "is processed in the sender's system calls). *Added*: CPU per step over the "
        "simulated provider's.",
        "",
        table(
            [
                "provider",
                "completed",
                "model calls",
                "runs/s",
                "step p50 ms",
                "step p99 ms",
                "CPU µs/step",
                "of it in the kernel",
                "added µs/step",
                "added",
                "fake server CPU µs/step",
            ],
            body,
        ),
    ]
    parts += _split_paragraphs(results)
    if results.get("profile_areas"):
        inclusive = results.get("profile_inclusive") or {}
        parts += [
            "",
            f"Own time by area, OpenAIChat over HTTP ({results['profile_runs']:,} runs under "
            f"cProfile): {top_areas(results['profile_areas'], 8)}."
            + (
                " Inclusive: "
                + "; ".join(f"{label} {share:.0%}" for label, share in inclusive.items())
                + "."
                if inclusive
                else ""
            ),
        ]
    return "\n".join(parts)


def split(results: dict[str, Any]) -> dict[str, float] | None:
    """Where OpenAIChat's CPU per step over the simulated provider goes, in µs per step:
    ``floor`` (the bare exchange of the same bytes), ``transport`` (the HTTP exchange over
    the floor: HTTP minus in-process minus the floor), ``code`` (the provider's own code:
    in-process with the bodies not journaled minus simulated; without that row, it holds
    the journaling too) and ``bodies`` (journaling the exact bodies: in-process minus that
    row), with ``added`` their sum and ``simulated`` the base."""
    simulated, http, local, bare = (
        find(results, SIMULATED),
        find(results, HTTP_CHAT),
        find(results, LOCAL),
        find(results, BARE),
    )
    if not (simulated and http and local and bare):
        return None
    base = simulated["cpu_us_per_step"]
    floor = bare["cpu_us_per_step"] - base
    unjournaled = find(results, UNJOURNALED)
    local_us = local["cpu_us_per_step"]
    code = (unjournaled["cpu_us_per_step"] if unjournaled else local_us) - base
    return {
        "simulated": base,
        "added": http["cpu_us_per_step"] - base,
        "floor": floor,
        "transport": http["cpu_us_per_step"] - local_us - floor,
        "code": code,
        "bodies": local_us - base - code if unjournaled else math.nan,
    }


def _split_paragraphs(results: dict[str, Any]) -> list[str]:
    from benchmarks._report import num

    parts = split(results)
    if parts is None:
        return []
    base = parts["simulated"]

    def share(value: float) -> str:
        return f"{num(value)} µs ({value / base:+.0%})"

    bodies = (
        f"; journaling the exact request and response bodies (hashing, the delta against the "
        f"previous request, encoding: the journal's work) {share(parts['bodies'])} (in-process "
        "minus in-process with the bodies not journaled)"
        if not math.isnan(parts["bodies"])
        else " (with the journaling of the exact bodies)"
    )
    return [
        "",
        f"Where OpenAIChat over HTTP adds {share(parts['added'])} a step over the simulated "
        f"provider's {num(base)} µs: the floor {share(parts['floor'])}, the same bytes "
        "exchanged over a bare keep-alive socket with no HTTP library (trio's wait for the "
        "socket: a park, an epoll registration and a wake per exchange; the kernel's "
        "loopback; the queue for the in-flight limit), which any HTTP provider pays here; the "
        f"transport over that floor {share(parts['transport'])} (HTTP minus in-process minus "
        "the floor: the request head, the response head's parse, the deadline, the "
        "connection's idle check, the exchange's frames); the provider's own code "
        f"{share(parts['code'])} (in-process with the bodies not journaled minus simulated: "
        f"the request body joined from the parts kept on the view, the exact read){bodies}. "
        "The in-process rows include a scheduler checkpoint standing in for the wait on the "
        "server, so the transport's share is, if anything, understated by one.",
    ]


def _child(config: dict[str, Any]) -> dict[str, Any]:
    if "count" in config:
        size = config["size"]
        act = _loop_calls(size) if config["count"] == "calls" else _loop_floor(size)
        drive_probe(config["provider"], (10,), act)
        return {}
    return measure_runs(config)


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--child"]:
        child_main(_child)
    elif argv[1:2] == ["--serve"]:
        serve(int(argv[2]))
    else:
        run_alone("bench_providers", run, render, argv)


if __name__ == "__main__":
    main(sys.argv)
