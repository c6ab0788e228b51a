"""The cost of OpenTelemetry tracing, on and off (issue 39).

``python -m benchmarks.tracing [--runs N] [--runs-per-batch K] [--batches M] [--rounds R]
[--db sqlite|memory] [--max-queue-size Q] [--profile] [--write]``

Two workloads, each in three modes, measured in this one process:

- **off**: ``tracing=None``, today's code path and the baseline (when off, the supervisor's
  only change is one ``if self.tracing is not None`` per run start and per fold);
- **on, spans dropped**: ``Tracing(TracerProvider())`` with a ``BatchSpanProcessor``
  (the SDK's defaults: a queue of 2,048 spans, batches of 512) over an exporter whose
  ``export`` returns ``SUCCESS`` and keeps nothing: span creation and processing, no
  network;
- **on, OTLP/HTTP**: the same processor over the real
  ``opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter``, posting to
  a tiny receiver in a thread of this process (``http.server``, HTTP/1.1 keep-alive,
  answering 200 to ``POST /v1/traces`` and keeping the bodies): the export included (the
  protobuf encoding and the HTTP post, on the processor's thread; the receiver's own CPU,
  reported, is in the process's CPU time too).

The hosted runs make spans faster than the processor's thread gets to export them, so its
queue of 2,048 fills and drops spans; that workload is also measured in the two on modes
with a queue as large as the spans it makes (the rows (b') and (c')): the cost of keeping
every span.

The workloads:

1. **A hosted step**: ``open_supervisor([machine], provider=ScriptedProvider(...),
   tracing=...)`` on the in-memory store; the machine has one worker state and one
   idempotent tool, and the scripted model calls the tool and then moves to COMPLETED
   (``tests/test_tracing.py``'s machine). ``--runs`` runs (2,000) are started at once and
   the time taken from the first start to the last completion: wall µs and CPU µs
   (``time.process_time``: every thread of the process, the span processor's included)
   per step, a step being one model call (counted in the journal afterwards: 2 a run).
   Spans: 4 a run (``invoke_agent``, two ``chat``, one ``execute_tool``).
2. **The gateway's verify batch**: ``serve_gateway(app, db=..., port=0, keyring=KeyRing(),
   tracing=...)`` in process under trio (no rate limit, no request timeout), its journal a
   SQLite file in a temporary directory (``--db memory``: in memory); K external runs
   (``--runs-per-batch``, 1,000) of a machine with two worker states that hand over to each
   other are created (``POST /v1/runs``, untimed), then M batches (``--batches``, 50) of
   ``POST /v1/verify`` are timed, each carrying one proposal per run: the legal transition
   to the other state with distinct data, the ``model`` and ``usage`` of the call given, at
   the run's ``expected_seq``. So every item is verified, journaled and answered
   (accepted; the benchmark checks every verdict), and each is a ``model_called`` event (a
   ``chat`` span) and a verdict (an event on the run's span). The client is httpx's
   ``AsyncClient`` in the same process: the figure is the whole request, both sides. Wall
   µs and CPU µs per verified proposal. Spans: one ``chat`` an item, and one
   ``invoke_agent`` a run, ended when the gateway stops.

Rounds: each round measures every workload in every mode, each measurement in its own
``trio.run`` after a ``gc.collect()``, the modes' order rotated every round (off, dropped,
OTLP; then dropped, OTLP, off; ...) to spread the host's noise; one small untimed pass of
each first (imports, caches). After each measurement ``provider.shutdown()`` (outside the
timed region; its time, the export left over, is reported) and the spans counted: those
the exporter got (for OTLP, decoded from the bodies the receiver kept) against those made
(4 a hosted run; a proposal's and a run's in the gateway; checked in the warm-up pass, too
small to fill the queue): the difference the processor dropped, its queue full
(``--max-queue-size``, default the SDK's). Each figure is the median over rounds; each
ratio the median over rounds of that round's on/off ratio. The noise floor is the spread
(max/min) of the off rounds. When a ratio exceeds 2, one more untimed measurement of that
workload with spans dropped (mode b) has its timed region run under cProfile (the main
thread) and its top functions are reported (``--profile``: always).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import gzip
import http.server
import importlib.metadata
import io
import itertools
import json
import logging
import os
import platform
import pstats
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## Tracing: the cost of OpenTelemetry spans, on and off (issue 39)"
MODE_LABELS = {
    "off": "(a) off (`tracing=None`, today's path)",
    "drop": "(b) on, spans dropped by the exporter",
    "otlp": "(c) on, OTLP/HTTP to a local receiver",
    "drop_all": "(b') as (b), the queue holding every span",
    "otlp_all": "(c') as (c), the queue holding every span",
}
WORKLOADS = ("hosted", "gateway")
#: The modes of each workload: the hosted runs make spans faster than the processor's
#: thread gets to export them, so they are measured with a queue as large as what they
#: make, too (the gateway drops none).
MODES = {
    "hosted": ("off", "drop", "otlp", "drop_all", "otlp_all"),
    "gateway": ("off", "drop", "otlp"),
}
WORKLOAD_LABELS = {"hosted": "hosted step", "gateway": "gateway `POST /v1/verify`"}
REFUND = '{"tool": "refund", "args": {"order_id": "o-1", "cents": 250}}'
DONE = '{"next": "COMPLETED", "data": {"said": "refunded"}}'
#: Spans a run of the hosted workload makes: invoke_agent, two chat, one execute_tool.
HOSTED_SPANS_PER_RUN = 4


# -- the machines -----------------------------------------------------------------------


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    cents: int


async def _refunded(args: Refund, ctx: Any) -> Any:
    return {"refunded": args.cents, "key": ctx.key}


def _refund_machine() -> Any:
    """tests/test_tracing.py's ``machine(refunded)``: one worker state, one idempotent tool."""
    from interlock import Machine, Tool, Worker

    return Machine(
        "refund",
        "WORK",
        {"WORK": Worker(next=["COMPLETED"], tools=["refund"])},
        tools=[Tool("refund", _refunded, Refund, idempotent=True)],
    )


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def _not_here(args: Lookup, ctx: Any) -> Any:  # external runs: the caller executes
    raise AssertionError("the benchmark's client executes its tools")


def _cycle_app() -> Any:
    """Two worker states that hand over to each other (benchmarks/bench_gateway.py's)."""
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


def _transition(state: str, n: int) -> str:
    return f'{{"next":"{"B" if state == "A" else "A"}","data":{{"n":{n}}}}}'


# -- the tracing of each mode ---------------------------------------------------------------


class _Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP endpoint that answers 200 to ``POST /v1/traces`` and keeps the bodies."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.lock = threading.Lock()
        self.bodies: list[bytes] = []
        self.received = 0  # bytes of the bodies, as sent
        self.cpu = 0.0  # CPU seconds of the handler threads

    def take(self) -> tuple[list[bytes], int, float]:
        with self.lock:
            taken = self.bodies, self.received, self.cpu
            self.bodies, self.received, self.cpu = [], 0, 0.0
        return taken


class _ReceiverHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Receiver

    def handle_one_request(self) -> None:
        started = time.thread_time()
        try:
            super().handle_one_request()
        finally:
            with self.server.lock:
                self.server.cpu += time.thread_time() - started

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        ok = self.path == "/v1/traces"
        if ok:
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            with self.server.lock:
                self.server.bodies.append(body)
                self.server.received += int(self.headers.get("content-length") or 0)
        self.send_response(200 if ok else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _spans_in(bodies: list[bytes]) -> int:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    count = 0
    for body in bodies:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                count += len(scope.spans)
    return count


def _make_tracing(
    mode: str, receiver: _Receiver, max_queue_size: int | None
) -> tuple[Any, Any, Any]:
    """(the Tracing, its TracerProvider, the exporter) of ``mode``; all None when off."""
    if mode == "off":
        return None, None, None
    import requests
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from interlock.runtime._tracing import Tracing

    class DropExporter(SpanExporter):
        """Drops every span; counts them."""

        def __init__(self) -> None:
            self.spans = 0
            self.at: list[float] = []  # when each export came

        def export(self, spans: Any) -> SpanExportResult:
            self.spans += len(spans)
            self.at.append(time.perf_counter())
            return SpanExportResult.SUCCESS

    exporter: Any
    if mode == "drop":
        exporter = DropExporter()
    else:
        session = requests.Session()
        session.trust_env = False  # no proxy from the environment: the receiver is local
        exporter = OTLPSpanExporter(
            endpoint=f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces",
            session=session,
        )
    provider = TracerProvider()
    queue = {} if max_queue_size is None else {"max_queue_size": max_queue_size}
    provider.add_span_processor(BatchSpanProcessor(exporter, **queue))
    return Tracing(provider), provider, exporter


# -- the workloads --------------------------------------------------------------------------


async def _hosted(runs: int, tracing: Any, profiler: Any = None) -> dict[str, Any]:
    from interlock import open_supervisor
    from interlock.core._events import ModelCalled
    from interlock.providers import ScriptedProvider

    provider = ScriptedProvider([REFUND, DONE])
    async with open_supervisor([_refund_machine()], provider=provider, tracing=tracing) as sup:
        if profiler is not None:
            profiler.enable()
        t0 = wall = time.perf_counter()
        cpu = time.process_time()
        handles = [await sup.start_run("refund", run_id=f"r-{i}") for i in range(runs)]
        outcomes = [(await handle.wait()).outcome for handle in handles]
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if profiler is not None:
            profiler.disable()
        steps = 0
        for i in range(runs):
            steps += sum(isinstance(e, ModelCalled) for e in await sup.store.load(f"r-{i}"))
    completed = outcomes.count("completed")
    if completed != runs:
        raise RuntimeError(f"{runs - completed} of {runs} runs did not complete: {outcomes[:5]}")
    return {
        "wall": wall,
        "cpu": cpu,
        "t0": t0,
        "units": steps,
        "expected_spans": HOSTED_SPANS_PER_RUN * runs,
    }


async def _gateway(
    runs: int, batches: int, db: str | None, tracing: Any, profiler: Any = None
) -> dict[str, Any]:
    import httpx
    import trio

    from interlock.gateway import serve_gateway
    from interlock.gateway._guard import Limits
    from interlock.gateway._keys import KeyRing

    limits = Limits(rate=None, request_timeout=None)  # the server measured, not its throttle
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            partial(
                serve_gateway,
                _cycle_app(),
                db=db,
                port=0,
                keyring=KeyRing(),
                limits=limits,
                tracing=tracing,
            )
        )
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            table: list[list[Any]] = []
            for i in range(runs):
                answer = await client.post(
                    "/v1/runs", json={"machine": "cycle", "run_id": f"g-{i}", "mode": "external"}
                )
                if answer.status_code != 201:
                    raise RuntimeError(f"POST /v1/runs: {answer.status_code} {answer.text}")
                run = answer.json()
                table.append([run["id"], run["state"], run["seq"]])
            usage = {"prompt": 1200, "completion": 40}
            accepted = 0
            if profiler is not None:
                profiler.enable()
            t0 = wall = time.perf_counter()
            cpu = time.process_time()
            for n in range(batches):
                items = [
                    {
                        "run_id": run_id,
                        "proposal": _transition(state, n),
                        "expected_seq": seq,
                        "model": "bench-model",
                        "usage": usage,
                    }
                    for run_id, state, seq in table
                ]
                answer = await client.post("/v1/verify", json={"items": items})
                if answer.status_code != 200:
                    raise RuntimeError(f"POST /v1/verify: {answer.status_code} {answer.text}")
                verdicts = answer.json()["verdicts"]
                for entry, verdict in zip(table, verdicts, strict=True):
                    if not verdict.get("accepted") or verdict.get("problem"):
                        raise RuntimeError(f"an item was not accepted: {verdict}")
                    entry[1], entry[2] = verdict["state"], verdict["seq"]
                accepted += len(verdicts)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if profiler is not None:
                profiler.disable()
        server.stop()
    return {
        "wall": wall,
        "cpu": cpu,
        "t0": t0,
        "units": accepted,
        "expected_spans": accepted + runs,
    }


def _measure(
    workload: str,
    mode: str,
    args: argparse.Namespace,
    scratch: Path,
    receiver: _Receiver,
    profiler: cProfile.Profile | None = None,
) -> dict[str, Any]:
    """One measurement in its own ``trio.run`` (with ``profiler`` on over its timed
    region); the provider shut down after it."""
    import trio

    queue = args.max_queue_size
    if mode.endswith("_all"):  # a queue as large as the spans the hosted runs make
        queue = max(queue or 0, HOSTED_SPANS_PER_RUN * args.runs)
    kind = mode.removesuffix("_all")
    tracing, provider, exporter = _make_tracing(kind, receiver, queue)
    receiver.take()
    gc.collect()
    if workload == "hosted":
        got = trio.run(_hosted, args.runs, tracing, profiler)
    else:
        db = None
        if args.db == "sqlite":
            db = str(scratch / f"gateway-{time.time_ns()}.db")
        got = trio.run(_gateway, args.runs_per_batch, args.batches, db, tracing, profiler)
    got["exported"] = got["dropped"] = 0
    got["shutdown_s"] = got["receiver_cpu_s"] = 0.0
    got["received_bytes"] = 0
    if provider is not None:
        started = time.perf_counter()
        provider.shutdown()
        got["shutdown_s"] = time.perf_counter() - started
        if kind == "drop":
            got["exported"] = exporter.spans
            # the longest stretch of the timed region in which the processor's thread
            # exported nothing
            t0, t1 = got["t0"], got["t0"] + got["wall"]
            times = [t0, *(t for t in exporter.at if t0 < t < t1), t1]
            got["longest_gap_s"] = max(b - a for a, b in itertools.pairwise(times))
        else:
            bodies, got["received_bytes"], got["receiver_cpu_s"] = receiver.take()
            got["exported"] = _spans_in(bodies)
            got["posts"] = len(bodies)
        # the processor's warning of a full queue is logged once in 20 s: count by difference
        got["dropped"] = got["expected_spans"] - got["exported"]
    return got


def _profile(
    workload: str,
    args: argparse.Namespace,
    scratch: Path,
    receiver: _Receiver,
) -> dict[str, Any]:
    """One more measurement of ``workload`` with spans dropped, its timed region under
    cProfile: the top functions by own time, and own time by package."""
    profiler = cProfile.Profile()
    got = _measure(workload, "drop", args, scratch, receiver, profiler)
    stats = pstats.Stats(profiler, stream=io.StringIO())
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in entries.values()) or 1.0
    by_package: dict[str, float] = {}
    rows = []
    written = 0.0
    for (path, line, name), (_, calls, own, cum, _) in entries.items():
        package = _package(path)
        by_package[package] = by_package.get(package, 0.0) + own
        where = f"{_short(path)}:{line}({name})"
        rows.append((own, cum, calls, where))
        if path.endswith("runtime/_tracing.py") and name in ("written", "begin"):
            written += cum
    rows.sort(reverse=True)
    traced = [r for r in rows if r[3].startswith(("opentelemetry/", "interlock/runtime/_tracing"))]
    return {
        "units": got["units"],
        "total_s": total,
        "tracing_written_cum_s": written,
        "by_package": {k: v / total for k, v in sorted(by_package.items(), key=lambda x: -x[1])},
        "top": [
            {"own_s": own, "cum_s": cum, "calls": calls, "function": where}
            for own, cum, calls, where in rows[:15]
        ],
        "top_tracing": [
            {"own_s": own, "cum_s": cum, "calls": calls, "function": where}
            for own, cum, calls, where in traced[:8]
        ],
    }


def _package(path: str) -> str:
    for name in ("opentelemetry", "interlock", "trio", "hypercorn", "h11", "httpx", "httpcore"):
        if f"/{name}/" in path:
            return name
    return "other"


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path if path.startswith("~") or "/" not in path else path.rsplit("/", 1)[1]


# -- the report -----------------------------------------------------------------------------


def _table(
    medians: dict[str, dict[str, dict[str, float]]],
    ratios: dict[str, dict[str, dict[str, float]]],
    spans: dict[str, dict[str, str]],
) -> list[str]:
    lines = [
        "| workload | mode | wall µs / unit | CPU µs / unit | wall ratio to (a) "
        "| CPU ratio to (a) | spans exported (dropped) / made |",
        "| :--- | :--- | ---: | ---: | ---: | ---: | :--- |",
    ]
    for workload in WORKLOADS:
        unit = "step" if workload == "hosted" else "proposal"
        for mode in MODES[workload]:
            m = medians[workload][mode]
            r = ratios[workload][mode]
            lines.append(
                f"| {WORKLOAD_LABELS[workload]} (µs per {unit}) | {MODE_LABELS[mode]} "
                f"| {m['wall_us']:,.1f} | {m['cpu_us']:,.1f} | {r['wall']:.2f} "
                f"| {r['cpu']:.2f} | {spans[workload][mode]} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tracing", description=__doc__)
    parser.add_argument("--runs", type=int, default=2000, help="hosted runs at once (2,000)")
    parser.add_argument(
        "--runs-per-batch", type=int, default=1000, help="gateway runs, one item each (1,000)"
    )
    parser.add_argument("--batches", type=int, default=50, help="timed verify batches (50)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (3)")
    parser.add_argument(
        "--db", choices=("sqlite", "memory"), default="sqlite", help="the gateway's journal"
    )
    parser.add_argument(
        "--max-queue-size",
        type=int,
        default=None,
        help="the BatchSpanProcessor's queue (default: the SDK's, 2,048 or OTEL_BSP_MAX_QUEUE_SIZE)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile the dropped mode even under 2x"
    )
    parser.add_argument("--write", action="store_true", help=f"write the table into {RESULTS}")
    raw_argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw_argv)
    if min(args.runs, args.runs_per_batch, args.batches, args.rounds) < 1:
        parser.error("every count must be at least 1")

    started = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="interlock-tracing-bench-"))
    # "Queue full, dropping Span.": counted by difference, not printed
    logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)
    logging.getLogger("interlock.gateway").setLevel(logging.ERROR)
    receiver = _Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    measured: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {m: [] for m in MODES[w]} for w in WORKLOADS
    }
    profiles: dict[str, Any] = {}
    problems = []
    try:
        warm = argparse.Namespace(
            **{**vars(args), "runs": 200, "runs_per_batch": 100, "batches": 3}
        )
        for workload in WORKLOADS:
            for mode in MODES[workload]:
                got = _measure(workload, mode, warm, scratch, receiver)
                if mode != "off" and got["exported"] != got["expected_spans"]:
                    # too few spans to fill the queue: every span made must be exported
                    problems.append(
                        f"{workload} {mode}, warm-up: {got['exported']} spans exported, "
                        f"{got['expected_spans']} expected"
                    )
        for round_ in range(args.rounds):
            for workload in WORKLOADS:
                modes = MODES[workload]
                turn = round_ % len(modes)
                for mode in modes[turn:] + modes[:turn]:
                    got = _measure(workload, mode, args, scratch, receiver)
                    measured[workload][mode].append(got)
                    print(
                        f"round {round_ + 1} {workload} {mode}: "
                        f"{got['wall'] / got['units'] * 1e6:,.1f} µs wall, "
                        f"{got['cpu'] / got['units'] * 1e6:,.1f} µs CPU a unit; "
                        f"spans exported {got['exported']:,}, dropped {got['dropped']:,}",
                        file=sys.stderr,
                    )
        per_unit = {
            w: {
                m: {
                    "wall_us": [g["wall"] / g["units"] * 1e6 for g in measured[w][m]],
                    "cpu_us": [g["cpu"] / g["units"] * 1e6 for g in measured[w][m]],
                }
                for m in MODES[w]
            }
            for w in WORKLOADS
        }
        ratios = {
            w: {
                m: {
                    kind: statistics.median(
                        on / off
                        for on, off in zip(
                            per_unit[w][m][f"{kind}_us"],
                            per_unit[w]["off"][f"{kind}_us"],
                            strict=True,
                        )
                    )
                    for kind in ("wall", "cpu")
                }
                for m in MODES[w]
            }
            for w in WORKLOADS
        }
        for workload in WORKLOADS:
            worst = max(ratios[workload][m][k] for m in ("drop", "otlp") for k in ("wall", "cpu"))
            if args.profile or worst > 2:
                print(f"profiling {workload}, spans dropped", file=sys.stderr)
                profiles[workload] = _profile(workload, args, scratch, receiver)
                for entry in profiles[workload]["top"]:
                    print(
                        f"  {entry['own_s'] * 1e3:8.1f} ms own {entry['cum_s'] * 1e3:8.1f} ms "
                        f"cum {entry['calls']:8,} calls  {entry['function']}",
                        file=sys.stderr,
                    )
    finally:
        receiver.shutdown()
        receiver.server_close()
        shutil.rmtree(scratch, ignore_errors=True)

    medians = {
        w: {m: {k: statistics.median(v) for k, v in per_unit[w][m].items()} for m in MODES[w]}
        for w in WORKLOADS
    }
    spans: dict[str, dict[str, str]] = {w: {} for w in WORKLOADS}
    for workload in WORKLOADS:
        for mode in MODES[workload]:
            rounds = measured[workload][mode]
            if mode == "off":
                spans[workload][mode] = "none"
                continue
            spans[workload][mode] = " · ".join(
                f"{g['exported']:,} ({g['dropped']:,}) / {g['expected_spans']:,}" for g in rounds
            )
            if mode.startswith("otlp") and min(g["exported"] for g in rounds) == 0:
                problems.append(f"{workload} {mode}: no span reached the OTLP receiver")
    noise = {
        w: {
            k: max(per_unit[w]["off"][k]) / min(per_unit[w]["off"][k])
            for k in ("wall_us", "cpu_us")
        }
        for w in WORKLOADS
    }
    verdicts = []
    for workload in WORKLOADS:
        added = medians[workload]["drop"]["wall_us"] - medians[workload]["off"]["wall_us"]
        beyond = ratios[workload]["drop"]["wall"] > noise[workload]["wall_us"]
        unit = "step" if workload == "hosted" else "proposal"
        if "drop_all" in MODES[workload]:
            kept = ratios[workload]["drop_all"]["wall"]
            added_all = (
                medians[workload]["drop_all"]["wall_us"] - medians[workload]["off"]["wall_us"]
            )
            also = (
                f" (with every span kept, (b') - (a) is {added_all:+,.1f} µs, a ratio of "
                f"{kept:.2f}: {'beyond' if kept > noise[workload]['wall_us'] else 'within'} it)"
            )
        else:
            also = ""
        verdicts.append(
            f"{WORKLOAD_LABELS[workload]}: the off rounds spread {noise[workload]['wall_us']:.3f}"
            f" (max/min, wall; CPU {noise[workload]['cpu_us']:.3f}); (b) - (a) is "
            f"{added:+,.1f} µs a {unit}, a ratio of {ratios[workload]['drop']['wall']:.2f}: "
            f"{'beyond' if beyond else 'within'} the noise floor{also}"
        )
    raw = {
        w: {
            m: [
                {
                    "wall_us": round(g["wall"] / g["units"] * 1e6, 2),
                    "cpu_us": round(g["cpu"] / g["units"] * 1e6, 2),
                    "units": g["units"],
                    "wall_s": round(g["wall"], 4),
                    "exported": g["exported"],
                    "dropped": g["dropped"],
                    "shutdown_s": round(g["shutdown_s"], 4),
                    **(
                        {"longest_gap_s": round(g["longest_gap_s"], 3)}
                        if "longest_gap_s" in g
                        else {}
                    ),
                    **(
                        {
                            "posts": g.get("posts", 0),
                            "received_bytes": g["received_bytes"],
                            "receiver_cpu_s": round(g["receiver_cpu_s"], 4),
                        }
                        if m.startswith("otlp")
                        else {}
                    ),
                }
                for g in measured[w][m]
            ]
            for m in MODES[w]
        }
        for w in WORKLOADS
    }
    command = " ".join(["python -m benchmarks.tracing", *map(shlex.quote, raw_argv)])
    sdk = importlib.metadata.version("opentelemetry-sdk")
    otlp = importlib.metadata.version("opentelemetry-exporter-otlp-proto-http")
    lines = [
        SECTION,
        "",
        f"`{command}` ({time.time() - started:.0f} s, {time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} cores, shared host; Python {platform.python_version()}, "
        f"opentelemetry-sdk {sdk}, opentelemetry-exporter-otlp-proto-http {otlp}). "
        f"{args.rounds} rounds, the modes interleaved (the order rotated each round); each "
        "figure the median over rounds, each ratio the median of the rounds' on/off ratios "
        "(the off figure of the same round). Hosted step: "
        f"{args.runs:,} runs started at once on the in-memory store, each a tool call then "
        "COMPLETED (2 model calls, 4 spans), timed from the first start to the last "
        "completion; the unit is a step (one model call). Gateway: "
        f"{args.batches} batches of `POST /v1/verify`, each one proposal for each of "
        f"{args.runs_per_batch:,} external runs (the legal transition to the other worker "
        "state with `model` and `usage`: every item accepted and journaled, a `chat` span "
        f"each), journal {'SQLite in a temporary directory' if args.db == 'sqlite' else 'in memory'}"
        ", httpx in the same process; the unit is a verified proposal. CPU is "
        "`time.process_time()`, every thread (the span processor's, and in (c) the "
        "receiver's). (b) and (c) use the SDK's `BatchSpanProcessor` with "
        + (
            "its defaults (queue 2,048, batches of 512, 5 s delay)"
            if args.max_queue_size is None
            else f"a queue of {args.max_queue_size:,} (batches of 512, 5 s delay)"
        )
        + "; (b') and (c'), hosted only, the same with a queue as large as the spans the "
        f"runs make ({max(args.max_queue_size or 0, HOSTED_SPANS_PER_RUN * args.runs):,}).",
        "",
        *_table(medians, ratios, spans),
        "",
        "Spans column: per round, exported (dropped by the processor's full queue) / made. "
        "The export left over when each round ends, `provider.shutdown()` (untimed), took "
        + "; ".join(
            f"{WORKLOAD_LABELS[w]} {MODE_LABELS[m].split()[0]}: "
            f"{statistics.median(g['shutdown_s'] for g in measured[w][m]) * 1e3:,.0f} ms"
            for w in WORKLOADS
            for m in MODES[w]
            if m != "off"
        )
        + " (the median); the OTLP receiver's own CPU, in the CPU figures of (c): "
        + "; ".join(
            f"{WORKLOAD_LABELS[w]} "
            f"{statistics.median(g['receiver_cpu_s'] / g['units'] for g in measured[w]['otlp']) * 1e6:,.2f}"
            " µs a unit"
            for w in WORKLOADS
        )
        + ".",
        "",
        "**Off is today's path.** The off figure is not a separate build: with "
        "`tracing=None` the supervisor runs today's code, plus one "
        "`if self.tracing is not None` per run start and per fold. So 'off must be within "
        "noise of today' holds by construction here, and the figure that says what noise "
        "is, is the off rounds' own spread (max/min over rounds): the noise floor. For the "
        + "; for the ".join(verdicts)
        + ".",
    ]
    for workload in WORKLOADS:
        lost = [g["dropped"] for m in ("drop", "otlp") for g in measured[workload][m]]
        if not any(lost):
            continue
        gaps = [g["longest_gap_s"] * 1e3 for g in measured[workload]["drop"]]
        made = measured[workload]["drop"][0]["expected_spans"]
        lines += [
            "",
            f"**Spans lost ({WORKLOAD_LABELS[workload]}).** The processor dropped "
            f"{', '.join(f'{x:,}' for x in lost)} of {made:,} spans in the rounds of (b) "
            "and (c) (in that order): its queue "
            f"({'the default, 2,048' if args.max_queue_size is None else f'{args.max_queue_size:,}'}"
            ") was full. Its thread exports a batch as soon as 512 spans wait, but it did not "
            "get to run: in (b) the longest stretch of the timed region with no export was "
            f"{', '.join(f'{x:,.0f}' for x in gaps)} ms by round, while the runs made spans "
            "from a busy trio loop. A dropped span costs its creation but not its "
            "processing or export, so (b) and (c) understate keeping every span at this "
            "rate; a queue large enough keeps them (`--max-queue-size`, "
            "`OTEL_BSP_MAX_QUEUE_SIZE` in a deployment)"
            + (": (b') and (c') are that cost." if "drop_all" in MODES[workload] else "."),
        ]
    for workload, profile in profiles.items():
        per = profile["total_s"] / profile["units"] * 1e6
        shares = ", ".join(f"{k} {v:.0%}" for k, v in profile["by_package"].items() if v >= 0.01)
        top = "; ".join(
            f"`{t['function']}` {t['own_s'] * 1e3:,.0f} ms own ({t['calls']:,} calls)"
            for t in profile["top"][:8]
        )
        traced = "; ".join(
            f"`{t['function']}` {t['own_s'] * 1e3:,.0f} ms own, {t['cum_s'] * 1e3:,.0f} ms "
            f"with callees ({t['calls']:,} calls)"
            for t in profile["top_tracing"][:6]
        )
        lines += [
            "",
            f"**Profile, {WORKLOAD_LABELS[workload]}, spans dropped** (one more round under "
            f"cProfile, main thread only; {per:,.1f} µs of profiled time a unit, inflated by "
            f"the profiler): own time by package {shares}; `Tracing.written` and "
            "`Tracing.begin` (what the supervisor calls) with all they call "
            f"{profile['tracing_written_cum_s'] / profile['total_s']:.0%} of the total. Top "
            f"functions by own time: {top}. Of the tracing path alone (OpenTelemetry and "
            f"`runtime/_tracing.py`): {traced}.",
        ]
    if problems:
        lines += ["", "**Problems**: " + "; ".join(problems) + "."]
    lines += [
        "",
        f"Raw per-round figures: `{json.dumps(raw)}`",
    ]
    table = "\n".join(lines)
    print(table)
    if args.write:
        from benchmarks._results import write_section

        write_section(table, RESULTS)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
