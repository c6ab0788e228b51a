"""Bad input never gets a 5xx, and never brings the gateway down.

``interlock serve`` runs as a real process on loopback (schemathesis's in-process ASGI
mode runs the app on asyncio and fails on trio), on a SQLite journal, with an application
of one external machine. Against it:

- schemathesis's CLI over the server's own ``/openapi.json`` (every operation: examples,
  coverage and fuzzing phases, a bounded number of cases each, seeded) with the
  ``not_a_server_error`` check;
- hypothesis-generated bodies to every mutating route: random JSON and msgpack values,
  the right fields with wrong types, huge and non-finite numbers, unicode (lone
  surrogates, NUL, RTL marks), deep nesting, bytes that are no encoding at all, wrong and
  missing content types, over-long ids; and random proposals (the model's raw text) to a
  live external run. Every refusal must be a 4xx ``application/problem+json`` whose
  ``status`` is the response's;
- random byte streams to the streaming channel (``--channel-port``, beside the HTTP API
  over the same service): frames of random msgpack, request maps with wrong types,
  bytes with no framing, lengths past the limit or torn. Every answer is a whole frame,
  a refusal a 4xx problem, and the connection ends cleanly.

After each, the server still answers ``/healthz`` and a well-formed external run still
completes through it (over HTTP, or over the channel).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")
pytest.importorskip("hypercorn")
pytest.importorskip("interlock.gateway._serve", reason="the gateway's server is not built yet")

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("INTERLOCK_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

APP = textwrap.dedent(
    """
    import msgspec
    from interlock import App, Budgets, Machine, Tool, Worker

    class Charge(msgspec.Struct, forbid_unknown_fields=True):
        order: str
        cents: int

    async def executed_by_the_client(args, ctx):
        raise AssertionError("an external run's tools are executed by its client")

    shop = Machine(
        "shop",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", executed_by_the_client, Charge)],
        budgets=Budgets(steps=50),
    )
    app = App([shop])
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Served:
    """The gateway process and a client to it."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.client = httpx.Client(base_url=url, timeout=30)
        self.channel_port: int | None = None
        """The streaming channel's port, when it is served."""

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-4000:]

    def assert_alive(self) -> None:
        """The process runs, answers /healthz, and an external run completes through it."""
        assert self.proc.poll() is None, f"the gateway exited:\n{self.output()}"
        health = self.client.get("/healthz")
        assert health.status_code == 200, health.text
        run_id = f"alive-{uuid.uuid4().hex[:8]}"
        run = self.client.post(
            "/v1/runs", json={"machine": "shop", "run_id": run_id, "mode": "external"}
        )
        assert run.status_code == 201, run.text
        path = f"/v1/runs/{run_id}"
        call = '{"tool": "charge", "args": {"order": "o-1", "cents": 5}}'
        verdict = self.client.post(f"{path}/proposals", json={"proposal": call}).json()
        assert verdict["accepted"], verdict
        done = self.client.post(f"{path}/results", json={"key": verdict["key"], "result": {}})
        assert done.status_code == 200, done.text
        end = self.client.post(
            f"{path}/proposals", json={"proposal": '{"next": "COMPLETED", "data": {}}'}
        )
        assert end.json()["outcome"] == "completed", end.text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("gateway-fuzz")
    (tmp / "shop_app.py").write_text(APP, encoding="utf-8")
    port = free_port()
    channel_port = free_port() if importlib.util.find_spec("interlock.gateway._channel") else None
    channel = ["--channel-port", str(channel_port)] if channel_port is not None else []
    log = tmp / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "interlock",
                "serve",
                "--app",
                f"{tmp / 'shop_app.py'}:app",
                "--db",
                str(tmp / "journal.db"),
                "--port",
                str(port),
                *channel,
            ],
            stdout=out,
            stderr=out,
        )
    server = Served(proc, f"http://127.0.0.1:{port}", log)
    server.channel_port = channel_port
    try:
        give_up = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the gateway did not start:\n{server.output()}"
            try:
                if server.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < give_up, f"the gateway never answered:\n{server.output()}"
            time.sleep(0.05)
        yield server
    finally:
        server.client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def assert_refused_well(response: Any, what: object) -> None:
    """Not a 5xx; a refusal is a problem+json naming its own status."""
    assert response.status_code < 500, (what, response.status_code, response.text[:2000])
    if response.status_code >= 400:
        kind = response.headers.get("content-type", "")
        assert kind.startswith("application/problem+json"), (what, kind, response.text[:500])
        problem = response.json()
        assert problem["status"] == response.status_code, (what, problem)
        assert problem["detail"], (what, problem)


# -- schemathesis over the OpenAPI document -------------------------------------------------


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis is not installed")
def test_schemathesis_finds_no_server_error(served: Served, tmp_path: Path) -> None:
    report = tmp_path / "report"
    proc = subprocess.run(
        [
            "schemathesis",
            "run",
            f"{served.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--phases",
            "examples,fuzzing",  # coverage: schemathesis 4.32 errors inside itself here
            "--max-examples",
            "25",
            "--seed",
            "17",
            "--workers",
            "2",
            "--request-timeout",
            "30",
            "--no-shrink",
            "--report",
            "ndjson",
            "--report-dir",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,  # its .schemathesis/ cache stays out of the checkout
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-6000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", said)
    assert cases is not None, said[-3000:]
    assert int(cases[1]) == int(cases[2]) >= 200, cases[0]
    print(f"schemathesis: {cases[0]} (not_a_server_error)")
    operations = json.loads(served.client.get("/openapi.json").text)["paths"]
    assert len(operations) >= 10, sorted(operations)
    served.assert_alive()


# -- hypothesis: bodies to every mutating route ---------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats()
    | st.text()
    | st.sampled_from(["", "\x00", "\u202e", "\U0001f600", "PAY", "COMPLETED", "external"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
FIELDS = (
    "machine",
    "inputs",
    "run_id",
    "mode",
    "proposal",
    "usage",
    "expected_seq",
    "model",
    "key",
    "result",
    "error",
    "retryable",
    "applied",
    "attempts",
    "latency",
    "items",
    "by",
    "note",
    "payload",
    "to",
)
#: Objects with the routes' own field names, each holding any value (wrong types mostly).
shaped = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
bodies = values | shaped | st.builds(lambda item: {"items": [item]}, shaped)

ROUTES = (
    "/v1/runs",
    "/v1/runs/{id}/proposals",
    "/v1/runs/{id}/results",
    "/v1/verify",
    "/v1/escalations/{id}/resume",
    "/v1/escalations/{id}/abort",
)
ids = st.sampled_from(["live", "shop-none"]) | st.text(min_size=1, max_size=300)


def encoded(body: Any, encoding: str) -> tuple[bytes, str]:
    """``body`` as JSON (Python's encoder: big ints, lone surrogates escaped) or msgpack."""
    if encoding == "msgpack":
        try:
            return msgspec.msgpack.encode(body), "application/msgpack"
        except (OverflowError, TypeError, UnicodeEncodeError):
            return json.dumps(body).encode(), "application/json"
    return json.dumps(body).encode(), "application/json"


@pytest.fixture(scope="module")
def live_run(served: Served) -> str:
    run_id = f"live-{uuid.uuid4().hex[:8]}"
    created = served.client.post(
        "/v1/runs", json={"machine": "shop", "run_id": run_id, "mode": "external"}
    )
    assert created.status_code == 201, created.text
    return run_id


@FUZZ
@given(
    route=st.sampled_from(ROUTES),
    run_id=ids,
    body=bodies,
    encoding=st.sampled_from(["json", "msgpack"]),
)
def test_any_body_to_any_mutating_route_is_refused_as_a_problem(
    served: Served, live_run: str, route: str, run_id: str, body: Any, encoding: str
) -> None:
    path = route.replace("{id}", quote(live_run if run_id == "live" else run_id, safe=""))
    data, kind = encoded(body, encoding)
    response = served.client.post(path, content=data, headers={"content-type": kind})
    assert_refused_well(response, (path, body, encoding))


#: Bodies no encoder would write: each a way a client gets the bytes wrong.
RAW = (
    b"",
    b"{",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"machine": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"machine": "shop", "mode": "external", "inputs": {"n": 1' + b"0" * 20_000 + b"}}",
    b'{"machine": "shop", "inputs": {"x": 1e999999}}',
    b'{"proposal": "\\ud800", "expected_seq": 1}',
    b'{"proposal": "ok", "expected_seq": 18446744073709551616}',
    b'{"proposal": "ok", "expected_seq": -1}',
    b'{"key": "\xff\xfe", "result": 1}',
    b"\xc1\xc1\xc1",  # msgpack's never-used byte
    b"\x92\x01",  # a msgpack array cut short
    b'{"items": []}',
    b'{"items": ['
    + b'{"run_id": "x", "proposal": "{}"},' * 10_001
    + b'{"run_id": "x", "proposal": "{}"}]}',
    b'{"machine": "shop", "machine": "other"}',
    b"null",
    '{"by": "\u202e\u0000"}'.encode(),
)
KINDS = (
    "application/json",
    "application/msgpack",
    "text/plain",
    "",
    "application/json; charset=latin-1",
)


@pytest.mark.parametrize("data", RAW, ids=lambda d: repr(d[:24]))
def test_bytes_no_encoder_would_write_are_refused(
    served: Served, live_run: str, data: bytes
) -> None:
    for kind in KINDS:
        for route in ROUTES:
            path = route.replace("{id}", live_run)
            # a connection each: a refusal before the body is read may close the connection
            # (test_a_refusal_before_the_body_is_read_says_connection_close); not this test's
            # point
            headers = {"connection": "close", **({"content-type": kind} if kind else {})}
            response = served.client.post(path, content=data, headers=headers)
            assert_refused_well(response, (path, data[:80], kind))
    served.assert_alive()


def test_an_oversized_body_is_413(served: Served, live_run: str) -> None:
    huge = json.dumps({"proposal": "x" * (8 * 2**20)}).encode()
    response = served.client.post(
        f"/v1/runs/{live_run}/proposals",
        content=huge,
        headers={"content-type": "application/json", "connection": "close"},
    )
    assert response.status_code == 413, response.text[:500]
    assert_refused_well(response, "8 MiB")
    served.assert_alive()


def test_a_refusal_before_the_body_is_read_says_connection_close(
    served: Served, live_run: str
) -> None:
    """A refusal sent while the body is still arriving must say ``connection: close``, or
    leave the connection usable for the next request (drain the body)."""
    port = int(served.url.rsplit(":", 1)[1])
    body = b"x" * 300_000
    head = (
        f"POST /v1/runs/{live_run}/proposals HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: text/plain\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body[:1000])  # the rest is still on its way
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection without an answer"
            answer += chunk
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 415"), status_line
        headers = rest.split(b"\r\n\r\n", 1)[0].lower()
        if b"connection: close" in headers:
            return  # the client knows not to reuse it
        try:
            sock.sendall(body[1000:] + b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            following = b""
            while following.count(b"HTTP/1.1 ") < 1 or b"HTTP/1.1 200" not in following:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                following += chunk
        except OSError as exc:
            following = repr(exc).encode()
        assert b"HTTP/1.1 200" in following, (
            "after a 415 with no 'connection: close', the server dropped the keep-alive "
            f"connection under the next request: {following[-300:]!r}"
        )


proposal_text = (
    st.text()
    | values.map(json.dumps)
    | st.builds(
        lambda tool, args: json.dumps({"tool": tool, "args": args}),
        st.sampled_from(["charge", "refund", "", "transition"]) | st.text(max_size=10),
        values,
    )
    | st.builds(
        lambda to, data: json.dumps({"next": to, "data": data}),
        st.sampled_from(["COMPLETED", "PAY", "ESCALATE", "FAILED", ""]) | st.text(max_size=10),
        values,
    )
)


@FUZZ
@given(proposals=st.lists(proposal_text, min_size=1, max_size=4))
@example(proposals=['{"tool": "charge", "args": {"order": "o", "cents": 1e999}}'])
@example(proposals=['{"tool": "charge", "args": {"order": "o", "cents": 1, "order": "p"}}'])
@example(proposals=["[" * 100_000])
def test_any_proposal_to_a_live_run_gets_a_verdict_or_a_problem(
    served: Served, proposals: list[str]
) -> None:
    run_id = f"p-{uuid.uuid4().hex[:12]}"
    created = served.client.post(
        "/v1/runs", json={"machine": "shop", "run_id": run_id, "mode": "external"}
    )
    assert created.status_code == 201, created.text
    seq = created.json()["seq"]
    for proposal in proposals:
        response = served.client.post(
            f"/v1/runs/{run_id}/proposals", json={"proposal": proposal, "expected_seq": seq}
        )
        assert_refused_well(response, proposal)
        if response.status_code != 200:
            continue
        verdict = response.json()
        assert verdict["accepted"] == (not verdict["violations"]), verdict
        if verdict["outcome"] != "running":
            break
        seq = verdict["seq"]
        if verdict.get("key"):
            reported = served.client.post(
                f"/v1/runs/{run_id}/results", json={"key": verdict["key"], "result": proposal}
            )
            assert_refused_well(reported, verdict)
            seq = reported.json()["seq"]


def test_after_the_fuzzing_the_gateway_still_serves(served: Served) -> None:
    served.assert_alive()
    metrics = served.client.get("/metrics")
    assert metrics.status_code == 200
    assert "interlock_" in metrics.text


# -- random frames to the streaming channel -------------------------------------------------


class Channel:
    """The streaming channel of the served gateway (``interlock serve --channel-port``)."""

    def __init__(self, served: Served, port: int) -> None:
        self.served = served
        self.address = ("127.0.0.1", port)

    def exchange(self, data: bytes) -> list[Any]:
        """Send ``data``, close the sending side, and read every answer until the server
        closes the connection; each answer decoded."""
        answers = []
        with socket.create_connection(self.address, timeout=30) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        while received:
            assert len(received) >= 4, f"a torn frame header: {received!r}"
            size = int.from_bytes(received[:4], "big")
            assert len(received) >= 4 + size, f"a torn frame: {size} bytes announced"
            answers.append(msgspec.msgpack.decode(received[4 : 4 + size]))
            received = received[4 + size :]
        return answers


@pytest.fixture(scope="module")
def channel(served: Served) -> Channel:
    if served.channel_port is None:
        pytest.skip("interlock serve has no --channel-port here")
    return Channel(served, served.channel_port)


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def packed(value: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, TypeError, UnicodeEncodeError):
        return msgspec.msgpack.encode(repr(value))


OPS = ("hello", "create_run", "get_run", "propose", "report", "verify", "nope", "")
requests = st.fixed_dictionaries(
    {
        "id": st.integers(min_value=0, max_value=2**63 - 1) | values,
        "op": st.sampled_from(OPS) | values,
    },
    optional={"run_id": ids | values, "body": values | shaped},
)
frames = (
    requests.map(lambda r: frame(packed(r)))
    | values.map(lambda v: frame(packed(v)))
    | st.binary(min_size=1, max_size=64).map(frame)
    | st.binary(max_size=64)  # no framing at all
    | st.integers(min_value=0, max_value=2**32 - 1).map(lambda n: n.to_bytes(4, "big"))
)


@FUZZ
@given(stream=st.lists(frames, min_size=1, max_size=6))
@example(stream=[b"\xff\xff\xff\xff"])
@example(stream=[frame(b"\x80")])
@example(stream=[frame(packed({"id": 1, "op": "propose", "run_id": "x", "body": [1] * 3}))])
@example(stream=[frame(packed({"id": 2**64 - 1, "op": "get_run", "run_id": "x"}))])
def test_any_frames_get_answers_or_a_clean_close(channel: Channel, stream: list[bytes]) -> None:
    answers = channel.exchange(b"".join(stream))
    for answer in answers:
        assert isinstance(answer, dict), answer
        assert set(answer) <= {"id", "body", "problem"}, answer
        problem = answer.get("problem")
        if problem is not None:
            assert 400 <= problem["status"] < 500, answer
            assert problem["detail"], answer
    assert channel.served.proc.poll() is None, f"the gateway exited:\n{channel.served.output()}"


def test_after_random_frames_the_channel_still_completes_a_run(channel: Channel) -> None:
    channel.served.assert_alive()
    run_id = f"c-{uuid.uuid4().hex[:8]}"
    call = '{"tool": "charge", "args": {"order": "o-1", "cents": 5}}'
    requests = [
        {
            "id": 1,
            "op": "create_run",
            "body": {"machine": "shop", "run_id": run_id, "mode": "external"},
        },
        {"id": 2, "op": "propose", "run_id": run_id, "body": {"proposal": call}},
    ]
    created, verdict = channel.exchange(b"".join(frame(packed(r)) for r in requests))
    assert created["body"]["id"] == run_id, created
    assert verdict["body"]["accepted"], verdict
    key = verdict["body"]["key"]
    more = [
        {"id": 3, "op": "report", "run_id": run_id, "body": {"key": key, "result": {}}},
        {
            "id": 4,
            "op": "propose",
            "run_id": run_id,
            "body": {"proposal": '{"next": "COMPLETED", "data": {}}'},
        },
    ]
    reported, done = channel.exchange(b"".join(frame(packed(r)) for r in more))
    assert reported["body"]["accepted"], reported
    assert done["body"]["outcome"] == "completed", done
