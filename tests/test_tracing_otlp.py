"""Traces exported over OTLP to a real receiver on loopback, from real processes: the
gateway (``interlock serve --otel``) over OTLP/HTTP and over OTLP/gRPC, the MCP proxy
(``interlock mcp --http``) and the model proxy (``interlock proxy``). The receiver decodes
the protobuf with the official ``opentelemetry-proto`` package. Each run driven through a
door must arrive as one connected trace that continues the incoming request's trace
context, with its verdicts.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="opentelemetry-proto (the otel extra) is not installed",
)

from tests._console import APP, BAD, GOOD  # noqa: E402

# NOTE: the MCP SDK's and the openai SDK's HTTP clients leave body iterators to the
# garbage collector when a session closes (in this process, the clients', not in the
# interlock processes under test): trio warns; see tests/test_mcp_http.py.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <async_generator object "
        ":pytest.PytestUnraisableExceptionWarning"
    ),
    pytest.mark.filterwarnings(
        r"ignore:Async generator '(openai|anthropic|httpx2|httpcore2)\.:ResourceWarning"
    ),
]

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
# A later request of the same caller (another span of its trace), and one from another
# trace (a caller whose every step is a trace of its own).
STEP_SPAN = "1111111111111111"
STEP_TRACEPARENT = f"00-{CALLER_TRACE}-{STEP_SPAN}-01"
OTHER_TRACE = "0af7651916cd43dd8448eb211c80319c"
OTHER_SPAN = "b7ad6b7169203331"
OTHER_TRACEPARENT = f"00-{OTHER_TRACE}-{OTHER_SPAN}-01"


class Receiver:
    """The spans an OTLP receiver was sent, decoded: (name, trace id, span id, parent span
    id, attributes, events), with the resource's ``service.name``."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = trace_service.ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.lock:
            for resource in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.spans.append(
                            {
                                "name": span.name,
                                "trace": span.trace_id.hex(),
                                "span": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                                "events": [
                                    (e.name, {a.key: _value(a.value) for a in e.attributes})
                                    for e in span.events
                                ],
                                "links": [
                                    (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                                ],
                                "service": service,
                                "schema": scope.schema_url,
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                            }
                        )

    def wait_for(self, found: Callable[[list[dict[str, Any]]], bool], what: str) -> None:
        deadline = time.monotonic() + 30  # a hang guard: the exporter sends every 100 ms
        while time.monotonic() < deadline:
            with self.lock:
                if found(list(self.spans)):
                    return
            time.sleep(0.05)
        pytest.fail(f"the receiver never got {what}; it got {[s['name'] for s in self.spans]}")


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def http_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            assert self.path == "/v1/traces", self.path
            assert self.headers["content-type"] == "application/x-protobuf"
            receiver.take(body)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[Receiver, str]]:
    grpc = pytest.importorskip("grpc", reason="grpcio (the otel extra's gRPC exporter)")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    receiver = Receiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            receiver.take(request.SerializeToString())
            return trace_service.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)


def otel_env(endpoint: str, protocol: str = "http/protobuf") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INTERLOCK_API"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_EXPORTER_OTLP_INSECURE="true",
    )
    return env


def serve(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    with (tmp_path / "serve.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "interlock",
                "serve",
                "--app",
                APP,
                "--db",
                str(tmp_path / "journal.db"),
                "--port",
                "0",
                "--otel",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("interlock serve: http://"), (tmp_path / "serve.log").read_text()
    return proc, line.split()[2]


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def drive_refund(url: str, run_id: str) -> list[dict[str, Any]]:
    """An external refund run through the gateway: a rejected proposal, a refund (its
    result reported), two moves; the request that starts it carries TRACEPARENT, the
    rejected proposal STEP_TRACEPARENT (the same trace), the refund's OTHER_TRACEPARENT
    (another trace), the moves none."""
    with httpx.Client(base_url=url, timeout=60) as client:
        created = client.post(
            "/v1/runs",
            json={"machine": "refund", "run_id": run_id, "mode": "external"},
            headers={"traceparent": TRACEPARENT},
        )
        assert created.status_code == 201, created.text
        post = client.post
        refused = post(
            f"/v1/runs/{run_id}/proposals",
            json={"proposal": BAD},
            headers={"traceparent": STEP_TRACEPARENT},
        )
        assert not refused.json()["accepted"]
        verdict = post(
            f"/v1/runs/{run_id}/proposals",
            json={"proposal": GOOD},
            headers={"traceparent": OTHER_TRACEPARENT},
        ).json()
        assert verdict["accepted"], verdict
        reported = post(
            f"/v1/runs/{run_id}/results", json={"key": verdict["key"], "result": {"refunded": 250}}
        )
        assert reported.status_code == 200, reported.text
        post(f"/v1/runs/{run_id}/proposals", json={"proposal": '{"next": "NOTIFY"}'})
        done = post(f"/v1/runs/{run_id}/proposals", json={"proposal": '{"next": "COMPLETED"}'})
        assert done.json()["outcome"] == "completed", done.text
        return client.get(f"/v1/runs/{run_id}/events").json()["events"]


def check_refund_trace(receiver: Receiver, run_id: str, service: str) -> None:
    def ended(spans: list[dict[str, Any]]) -> bool:
        return any(
            s["name"] == "invoke_agent refund"
            and s["attributes"].get("gen_ai.conversation.id") == run_id
            and s["attributes"].get("interlock.outcome") == "completed"
            for s in spans
        )

    receiver.wait_for(ended, f"the span of run {run_id}")
    spans = [s for s in receiver.spans if s["trace"] == CALLER_TRACE]
    (run,) = [s for s in spans if s["name"] == "invoke_agent refund"]
    assert run["parent"] == CALLER_SPAN  # the incoming request's trace, continued
    assert run["service"] == service
    assert run["schema"].startswith("https://opentelemetry.io/schemas/")
    here = (CALLER_TRACE, run["span"])
    # Each proposal's own traceparent: its verdict is a span under the request's span,
    # linked to the run's; a request with none has none.
    checks = [s for s in receiver.spans if s["name"] == "verify refund"]
    assert sorted((s["trace"], s["parent"]) for s in checks) == sorted(
        [(CALLER_TRACE, STEP_SPAN), (OTHER_TRACE, OTHER_SPAN)]
    )
    (refused,) = [s for s in checks if s["parent"] == STEP_SPAN]
    assert refused["attributes"]["interlock.verdict"] == "rejected"
    assert refused["attributes"]["interlock.violation.codes"] == ["schema"]
    assert refused["attributes"]["gen_ai.conversation.id"] == run_id
    assert refused["links"] == [here]
    (accepted,) = [s for s in checks if s["parent"] == OTHER_SPAN]
    assert accepted["attributes"]["interlock.verdict"] == "accepted"
    assert accepted["links"] == [here]
    # The refund was proposed from another trace: it is traced there, linked to the run.
    (tool,) = [s for s in receiver.spans if s["name"] == "execute_tool refund"]
    assert (tool["trace"], tool["parent"]) == (OTHER_TRACE, OTHER_SPAN)
    assert tool["links"] == [here]
    assert tool["attributes"]["gen_ai.tool.name"] == "refund"
    verdicts = [e for name, e in run["events"] if name == "interlock.verdict"]
    assert [v["interlock.verdict"] for v in verdicts] == [
        "rejected",
        "accepted",
        "accepted",
        "accepted",
    ]
    assert verdicts[0]["interlock.violation.codes"] == ["schema"]


def test_a_gateway_run_arrives_over_otlp_http_as_one_trace(
    tmp_path: Path, http_receiver: tuple[Receiver, str]
) -> None:
    receiver, endpoint = http_receiver
    env = {**otel_env(endpoint), "INTERLOCK_TRACE_URL": "http://jaeger.test/trace/{trace_id}"}
    proc, url = serve(tmp_path, env)
    try:
        events = drive_refund(url, "otlp-http-1")
        page = httpx.get(f"{url}/console/runs/otlp-http-1", timeout=30).text
    finally:
        stop(proc)
    # the console links the run to its trace
    assert f'<a href="http://jaeger.test/trace/{CALLER_TRACE}"' in page
    check_refund_trace(receiver, "otlp-http-1", "interlock-gateway")
    started = events[0]
    assert started["kind"] == "run_started"
    assert started["data"]["trace"].split("-")[1] == CALLER_TRACE  # journaled


def test_a_gateway_run_arrives_over_otlp_grpc_as_one_trace(
    tmp_path: Path, grpc_receiver: tuple[Receiver, str]
) -> None:
    receiver, endpoint = grpc_receiver
    proc, url = serve(tmp_path, otel_env(endpoint, "grpc"))
    try:
        drive_refund(url, "otlp-grpc-1")
    finally:
        stop(proc)
    check_refund_trace(receiver, "otlp-grpc-1", "interlock-gateway")


async def test_an_mcp_proxy_run_arrives_as_one_trace_continuing_the_request(
    tmp_path: Path, http_receiver: tuple[Receiver, str]
) -> None:
    pytest.importorskip("mcp", reason="the [mcp] extra is missing")
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from tests.test_mcp_http import _start

    receiver, endpoint = http_receiver
    proxy = _start(
        tmp_path, tmp_path / "proxy.log", "--app", "clock.py:app", "--otel", env=otel_env(endpoint)
    )
    try:
        async with (
            streamable_http_client(proxy.url) as (read, write, *_),
            ClientSession(read, write) as client,
        ):
            await client.initialize()
            meta: Any = {"traceparent": TRACEPARENT}
            refused = await client.call_tool(
                "get_current_time", {"timezone": "Europe/Paris"}, meta=meta
            )
            assert refused.is_error
            step: Any = {"traceparent": STEP_TRACEPARENT}  # the caller's next span
            answered = await client.call_tool("get_current_time", {"timezone": "UTC"}, meta=step)
            assert not answered.is_error
    finally:
        proxy.process.terminate()
        proxy.process.wait(timeout=30)

    def arrived(spans: list[dict[str, Any]]) -> bool:
        return any(s["name"] == "execute_tool get_current_time" for s in spans) and any(
            s["name"] == "invoke_agent clock" for s in spans
        )

    receiver.wait_for(arrived, "the MCP run's spans")
    (run,) = [s for s in receiver.spans if s["name"] == "invoke_agent clock"]
    assert run["trace"] == CALLER_TRACE
    assert run["parent"] == CALLER_SPAN
    assert run["service"] == "interlock-mcp"
    (tool,) = [s for s in receiver.spans if s["name"] == "execute_tool get_current_time"]
    assert tool["trace"] == CALLER_TRACE
    assert tool["parent"] == run["span"]
    verdicts = [e for name, e in run["events"] if name == "interlock.verdict"]
    assert [v["interlock.verdict"] for v in verdicts][:2] == ["rejected", "accepted"]
    assert verdicts[0]["interlock.violation.codes"] == ["guard"]
    # each request's own _meta.traceparent parents the verdict on its call
    checks = sorted(
        (s["parent"], s["attributes"]["interlock.verdict"])
        for s in receiver.spans
        if s["name"] == "verify clock" and s["trace"] == CALLER_TRACE
    )
    assert checks == sorted([(CALLER_SPAN, "rejected"), (STEP_SPAN, "accepted")])


async def test_an_mcp_stdio_run_continues_its_client_s_traceparent_and_each_request_s(
    tmp_path: Path, http_receiver: tuple[Receiver, str]
) -> None:
    """A stdio proxy is a process its client starts, before any request: its run continues
    the client's TRACEPARENT (OpenTelemetry's carrier of a trace into a process it
    starts), and each request's _meta.traceparent parents the verdict on its call; a call
    from another trace is traced there, linked to the run."""
    pytest.importorskip("mcp", reason="the [mcp] extra is missing")
    from mcp import ClientSession, stdio_client

    from tests.test_mcp_http import TIME_APP, _time_server
    from tests.test_mcp_proxy import _proxy

    receiver, endpoint = http_receiver
    (tmp_path / "clock.py").write_text(TIME_APP)
    env = {**os.environ, **otel_env(endpoint), "TRACEPARENT": TRACEPARENT}
    # the console exporter too: its spans go to stderr, never into the protocol's stdout
    env["OTEL_TRACES_EXPORTER"] = "otlp,console"
    errors = (tmp_path / "stderr.log").open("w")
    params = _proxy(tmp_path, "clock.py:app", *_time_server(), options=("--otel",), env=env)
    async with (
        stdio_client(params, errlog=errors) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        step: Any = {"traceparent": STEP_TRACEPARENT}
        refused = await client.call_tool("get_current_time", {"timezone": "Asia/Tokyo"}, meta=step)
        assert refused.is_error
        other: Any = {"traceparent": OTHER_TRACEPARENT}
        answered = await client.call_tool("get_current_time", {"timezone": "UTC"}, meta=other)
        assert not answered.is_error

    def arrived(spans: list[dict[str, Any]]) -> bool:
        return any(s["name"] == "execute_tool get_current_time" for s in spans) and any(
            s["name"] == "invoke_agent clock" for s in spans
        )

    receiver.wait_for(arrived, "the stdio run's spans")
    errors.close()
    assert '"name": "invoke_agent clock"' in (tmp_path / "stderr.log").read_text()
    (run,) = [s for s in receiver.spans if s["name"] == "invoke_agent clock"]
    assert (run["trace"], run["parent"]) == (CALLER_TRACE, CALLER_SPAN)
    here = (CALLER_TRACE, run["span"])
    checks = {(s["trace"], s["parent"]): s for s in receiver.spans if s["name"] == "verify clock"}
    assert set(checks) == {(CALLER_TRACE, STEP_SPAN), (OTHER_TRACE, OTHER_SPAN)}
    assert checks[CALLER_TRACE, STEP_SPAN]["attributes"]["interlock.violation.codes"] == ["guard"]
    assert checks[OTHER_TRACE, OTHER_SPAN]["attributes"]["interlock.verdict"] == "accepted"
    assert all(s["links"] == [here] for s in checks.values())
    (tool,) = [s for s in receiver.spans if s["name"] == "execute_tool get_current_time"]
    assert (tool["trace"], tool["parent"], tool["links"]) == (OTHER_TRACE, OTHER_SPAN, [here])
    # the client's calls are an agent's, not model calls: no chat span
    assert not [s["name"] for s in receiver.spans if s["name"].startswith("chat ")]


MODEL_MACHINE = """
[machine]
name = "shop"
initial = "WORK"
reasks = 0

[states.WORK]
tools = ["refund"]
next = ["COMPLETED"]

[tools.refund]
kind = "neither"
schema = { type = "object", properties = { amount = { type = "number" } }, required = ["amount"] }
"""


async def test_a_model_proxy_run_arrives_as_one_trace_continuing_the_request(
    tmp_path: Path, http_receiver: tuple[Receiver, str]
) -> None:
    import trio

    openai = pytest.importorskip("openai")
    from interlock.testing import Reply, open_fake_llm, scripted_brain

    receiver, endpoint = http_receiver
    brain = scripted_brain(
        [
            Reply(calls=[("refund", '{"amount": "lots"}')]),
            Reply(calls=[("refund", '{"amount": 12}')]),
        ]
    )
    (tmp_path / "shop.toml").write_text(MODEL_MACHINE)
    log = tmp_path / "proxy.log"
    async with open_fake_llm(brain) as fake:
        with log.open("wb") as err:
            proxy = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                [
                    sys.executable,
                    "-m",
                    "interlock",
                    "proxy",
                    "--upstream",
                    fake.openai_base_url,
                    "--machine",
                    str(tmp_path / "shop.toml"),
                    "--reasks",
                    "1",
                    "--db",
                    str(tmp_path / "proxy.db"),
                    "--listen",
                    "127.0.0.1:0",
                    "--otel",
                ],
                stderr=err,
                env=otel_env(endpoint),
                cwd=tmp_path,
            )
        try:
            url = await _proxy_url(proxy, log, trio)
            async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0) as client:
                completion = await client.chat.completions.create(
                    model="fake",
                    messages=[{"role": "user", "content": "refund 12"}],
                    tools=[
                        {
                            "type": "function",
                            "function": {
                                "name": "refund",
                                "parameters": {
                                    "type": "object",
                                    "properties": {"amount": {"type": "number"}},
                                },
                            },
                        }
                    ],
                    extra_headers={"traceparent": TRACEPARENT},
                )
            (call,) = completion.choices[0].message.tool_calls or []
            assert call.function.name == "refund"
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
        upstream = [r.headers.get("traceparent", "") for r in fake.requests]

    def arrived(spans: list[dict[str, Any]]) -> bool:
        return any(s["name"] == "invoke_agent shop" for s in spans)

    receiver.wait_for(arrived, "the model proxy run's span")
    (run,) = [s for s in receiver.spans if s["name"] == "invoke_agent shop"]
    assert run["trace"] == CALLER_TRACE
    assert run["parent"] == CALLER_SPAN
    assert run["service"] == "interlock-proxy"
    verdicts = [e for name, e in run["events"] if name == "interlock.verdict"]
    assert [v["interlock.verdict"] for v in verdicts] == ["rejected", "accepted"]
    assert verdicts[0]["interlock.violation.codes"] == ["schema"]
    chats = [s for s in receiver.spans if s["name"].startswith("chat ")]
    assert len(chats) == 2  # the call asked again after the refusal, then the good one
    for chat in chats:
        assert chat["trace"] == CALLER_TRACE
        assert chat["parent"] == run["span"]
        assert chat["attributes"]["gen_ai.operation.name"] == "chat"
        assert "gen_ai.usage.input_tokens" in chat["attributes"]
        # what the proxy read of the upstream's answer, and how long the call took
        assert chat["attributes"]["gen_ai.provider.name"] == "openai"
        assert chat["attributes"]["gen_ai.response.finish_reasons"] == ["tool_calls"]
        assert chat["end"] > chat["start"]
    # the request's verdicts, under the request's span (asked again within it)
    checks = [s for s in receiver.spans if s["name"] == "verify shop"]
    assert sorted((s["parent"], s["attributes"]["interlock.verdict"]) for s in checks) == [
        (CALLER_SPAN, "accepted"),
        (CALLER_SPAN, "rejected"),
    ]
    # each request the proxy made upstream carried the run's trace
    assert len(upstream) == 2
    assert all(
        t.split("-")[1] == CALLER_TRACE and t.split("-")[2] == run["span"] for t in upstream
    ), upstream


async def _proxy_url(proc: subprocess.Popen[bytes], log: Path, trio: Any) -> str:
    import re

    with trio.fail_after(60):  # a hang guard
        while True:
            found = re.search(r"(http://127\.0\.0\.1:\d+/v1)", await trio.Path(log).read_text())
            if found:
                return found[1]
            if proc.poll() is not None:
                pytest.fail(f"interlock proxy exited: {await trio.Path(log).read_text()}")
            await trio.sleep(0.05)


def test_a_run_whose_gateway_was_killed_goes_on_in_the_same_trace(
    tmp_path: Path, http_receiver: tuple[Receiver, str]
) -> None:
    """SIGKILL the gateway mid-run (its run's first span is never exported), start it
    again on the same journal and finish the run: the new part is in the caller's trace,
    a child of the first span the journal names, and linked to it."""
    import signal

    receiver, endpoint = http_receiver
    env = otel_env(endpoint)
    proc, url = serve(tmp_path, env)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            created = client.post(
                "/v1/runs",
                json={"machine": "refund", "run_id": "killed-1", "mode": "external"},
                headers={"traceparent": TRACEPARENT},
            )
            assert created.status_code == 201, created.text
            client.post("/v1/runs/killed-1/proposals", json={"proposal": BAD})
            first = client.get("/v1/runs/killed-1/events").json()["events"][0]["data"]["trace"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    first_span = first.split("-")[2]
    proc, url = serve(tmp_path, env)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            post = client.post
            verdict = post("/v1/runs/killed-1/proposals", json={"proposal": GOOD}).json()
            assert verdict["accepted"], verdict
            post("/v1/runs/killed-1/results", json={"key": verdict["key"], "result": {"ok": 1}})
            post("/v1/runs/killed-1/proposals", json={"proposal": '{"next": "NOTIFY"}'})
            done = post("/v1/runs/killed-1/proposals", json={"proposal": '{"next": "COMPLETED"}'})
            assert done.json()["outcome"] == "completed", done.text
    finally:
        stop(proc)

    def ended(spans: list[dict[str, Any]]) -> bool:
        return any(
            s["attributes"].get("gen_ai.conversation.id") == "killed-1"
            and s["attributes"].get("interlock.outcome") == "completed"
            for s in spans
        )

    receiver.wait_for(ended, "the resumed part of the killed run")
    (part,) = [s for s in receiver.spans if s["name"] == "invoke_agent refund"]
    assert part["trace"] == CALLER_TRACE
    assert part["parent"] == first_span  # the first part's span, as the journal names it
    assert first_span != CALLER_SPAN


WORKER_APP = """
import msgspec
from interlock import App, Machine, Tool, Worker
from interlock.providers import ScriptedProvider


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    cents: int


async def refund(args, ctx):
    return {"refunded": args.cents}


def model(view):
    if view.last_result("refund") is None:
        return '{"tool": "refund", "args": {"order_id": "o-1", "cents": 250}}'
    return '{"next": "COMPLETED"}'


machine = Machine("payout", "WORK", {"WORK": Worker(next=["COMPLETED"], tools=["refund"])},
                  tools=[Tool("refund", refund, Refund, idempotent=True)])
app = App([machine], provider=ScriptedProvider(model, model="scripted"))
"""


def test_a_run_a_gateway_enqueues_and_a_worker_drives_continues_the_request_s_trace(
    tmp_path: Path, http_receiver: tuple[Receiver, str]
) -> None:
    """On PostgreSQL: the gateway enqueues the hosted run with the request's trace in its
    journal; a worker (another process) claims it and traces it in that trace."""
    import secrets

    dsn = os.environ.get("INTERLOCK_PG_DSN")
    if not dsn:
        pytest.skip("INTERLOCK_PG_DSN is not set: no PostgreSQL for workers")
    import psycopg

    receiver, endpoint = http_receiver
    env = otel_env(endpoint)
    (tmp_path / "payout.py").write_text(WORKER_APP)
    schema = f"interlock_trace_{secrets.token_hex(5)}"
    db = f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"
    app = str(tmp_path / "payout.py") + ":app"
    try:
        with (tmp_path / "serve.log").open("wb") as log:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "interlock", "serve", "--app", app, "--db", db, "--port",
                 "0", "--otel"], stdout=subprocess.PIPE, stderr=log, text=True, env=env,
            )  # fmt: skip
        try:
            assert gateway.stdout is not None
            line = gateway.stdout.readline()
            assert line.startswith("interlock serve: http://"), (tmp_path / "serve.log").read_text()
            created = httpx.post(
                line.split()[2] + "/v1/runs", json={"machine": "payout", "run_id": "paid-1"},
                headers={"traceparent": TRACEPARENT}, timeout=60,
            )  # fmt: skip
            assert created.status_code == 201, created.text
        finally:
            stop(gateway)
        worker = subprocess.run(
            [sys.executable, "-m", "interlock", "worker", "--app", app, "--db", db,
             "--until-idle", "--otel", "--json"],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert worker.returncode == 0, worker.stderr[-3000:]
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    def arrived(spans: list[dict[str, Any]]) -> bool:
        return any(s["name"] == "invoke_agent payout" for s in spans)

    receiver.wait_for(arrived, "the worker's span of the run")
    (run,) = [s for s in receiver.spans if s["name"] == "invoke_agent payout"]
    assert run["trace"] == CALLER_TRACE
    assert run["parent"] == CALLER_SPAN
    assert run["service"] == "interlock-worker"
    assert run["attributes"]["interlock.outcome"] == "completed"
    names = sorted(s["name"] for s in receiver.spans if s["trace"] == CALLER_TRACE)
    assert names == ["chat scripted", "chat scripted", "execute_tool refund",
                     "invoke_agent payout"]  # fmt: skip
