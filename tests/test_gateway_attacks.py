"""Attacks on the gateway (#33), each over real loopback HTTP against ``serve_gateway``:
a web page driving a gateway that has no key, descriptors pinned by bare connections, and
every route's role asserted from the route table."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing

pytest.importorskip("hypercorn")

from interlock import Machine, Tool, Worker
from interlock.gateway import GatewayServer, serve_gateway
from interlock.gateway._guard import Limits
from interlock.gateway._keys import KeyRing

pytestmark = pytest.mark.slow


class Withdraw(msgspec.Struct, forbid_unknown_fields=True):
    cents: int


async def never(args: Any, ctx: Any) -> Any:  # an external run's caller executes its tools
    raise AssertionError("an external run's tool is executed by its caller")


def bank() -> Machine:
    return Machine(
        "bank",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["withdraw"], instructions="withdraw")},
        tools=[Tool("withdraw", never, Withdraw)],
    )


@asynccontextmanager
async def gateway(
    db: Path, **options: Any
) -> AsyncIterator[tuple[GatewayServer, httpx.AsyncClient]]:
    options.setdefault("keyring", KeyRing())
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            server: GatewayServer = await nursery.start(
                partial(serve_gateway, bank(), db=str(db), port=0, **options)
            )
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                yield server, client
            server.stop()


def assert_problem(response: httpx.Response, status: int, slug: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["type"] == f"https://interlock.dev/problems/{slug}", body
    assert body["status"] == status
    detail: str = body["detail"]
    assert not detail.endswith(".")
    return detail


RUN = b'{"machine": "bank", "run_id": "csrf-1", "mode": "external"}'
EVIL = "https://evil.example"


# -- 1. a web page drives a gateway that has no key ----------------------------------------


async def test_a_web_page_cannot_start_a_run_on_a_keyless_gateway(tmp_path: Path) -> None:
    """What a page of another site can send without a CORS preflight: a POST with no
    Content-Type (a Blob body) or a form's type; a browser adds Origin and Sec-Fetch-Site.
    None of it may start a run."""
    async with gateway(tmp_path / "j.db") as (_, client):
        # The attack as a browser sends it: refused for its origin, whatever it carries.
        for headers in (
            {"origin": EVIL, "sec-fetch-site": "cross-site"},
            {"origin": EVIL, "sec-fetch-site": "cross-site", "content-type": "text/plain"},
            {"origin": EVIL, "content-type": "application/json"},
            {"origin": "null", "content-type": "application/json"},  # a sandboxed frame
        ):
            refused = await client.post("/v1/runs", content=RUN, headers=headers)
            detail = assert_problem(refused, 403, "cross-origin")
            assert "--allow-origin" in detail
            assert "access-control-allow-origin" not in refused.headers
        # A WebSocket: browsers apply no CORS to it, so the Origin check is all there is.
        socket = await handshake(str(client.base_url).rstrip("/"), "/v1/channel", {"origin": EVIL})
        assert socket == (403, "https://interlock.dev/problems/cross-origin")
        # A browser that sends Sec-Fetch-Site but no Origin (a GET of an <img>, say).
        peek = await client.get("/v1/runs/csrf-1/events", headers={"sec-fetch-site": "cross-site"})
        assert_problem(peek, 403, "cross-origin")
        # DNS rebinding: evil.example now resolves to 127.0.0.1, so the page is same-origin
        # with itself; its Host header still names it.
        rebound = await client.post(
            "/v1/runs",
            content=RUN,
            headers={"host": "evil.example:8080", "content-type": "application/json"},
        )
        assert "loopback host" in assert_problem(rebound, 403, "bad-host")
        # Without the browser's headers (an older browser, or a proxy that drops them): the
        # body's type is what a page could not have sent without a preflight.
        for headers in (
            {},
            {"content-type": "text/plain"},
            {"content-type": "multipart/form-data"},
        ):
            refused = await client.post("/v1/runs", content=RUN, headers=headers)
            detail = assert_problem(refused, 415, "unsupported-media-type")
            assert "'Content-Type: application/json'" in detail
        runs = (await client.get("/v1/runs")).json()
        assert runs["runs"] == []
        # The same request sent as a program sends it is served.
        created = await client.post(
            "/v1/runs", content=RUN, headers={"content-type": "application/json"}
        )
        assert created.status_code == 201, created.text
        # A page the gateway served itself (same origin) and a non-browser are let in.
        same = await client.get(
            "/v1/runs/csrf-1",
            headers={"origin": str(client.base_url).rstrip("/"), "sec-fetch-site": "same-origin"},
        )
        assert same.status_code == 200
        assert "access-control-allow-origin" not in same.headers


async def test_an_allowed_origin_gets_cors_and_the_others_do_not(tmp_path: Path) -> None:
    console = "https://console.example"
    limits = Limits(allow_origins=("HTTPS://Console.Example:443/",))
    assert limits.allow_origins == (console,)
    async with gateway(tmp_path / "j.db", limits=limits) as (_, client):
        preflight = await client.options(
            "/v1/runs",
            headers={
                "origin": console,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type, authorization",
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == console
        assert "content-type" in preflight.headers["access-control-allow-headers"]
        assert "POST" in preflight.headers["access-control-allow-methods"]
        created = await client.post(
            "/v1/runs",
            content=RUN,
            headers={
                "origin": console,
                "sec-fetch-site": "cross-site",
                "content-type": "application/json",
            },
        )
        assert created.status_code == 201, created.text
        assert created.headers["access-control-allow-origin"] == console
        assert created.headers["vary"] == "Origin"
        # A refusal reaches the allowed page too, so it can show why.
        untyped = await client.post("/v1/runs", content=RUN, headers={"origin": console})
        assert_problem(untyped, 415, "unsupported-media-type")
        assert untyped.headers["access-control-allow-origin"] == console

        other = await client.options(
            "/v1/runs", headers={"origin": EVIL, "access-control-request-method": "POST"}
        )
        assert "allowed: https://console.example" in assert_problem(other, 403, "cross-origin")


def test_allowed_origins_are_checked_and_read_from_the_environment() -> None:
    from interlock.gateway._guard import normalize_origin

    assert normalize_origin("http://localhost:3000") == "http://localhost:3000"
    assert normalize_origin("http://LOCALHOST:80") == "http://localhost"
    for bad in ("localhost:3000", "https://a.example/path", "ftp://a.example", "*", "null"):
        with pytest.raises(ValueError, match=r"is not a web origin; give scheme, host and port"):
            normalize_origin(bad)
    env = {"INTERLOCK_GATEWAY_ALLOW_ORIGINS": "https://a.example, http://localhost:3000"}
    assert Limits.from_env(env).allow_origins == ("https://a.example", "http://localhost:3000")
    with pytest.raises(ValueError, match=r"must be a tuple of origins"):
        Limits(allow_origins="https://a.example")  # type: ignore[arg-type]


def test_interlock_serve_refuses_a_bad_allowed_origin_in_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLOCK_")}
    done = subprocess.run(
        # a named journal: no 'journal:' line before the refusal
        [
            sys.executable,
            "-m",
            "interlock",
            "serve",
            "--port",
            "0",
            "--allow-origin",
            "*",
            "--db",
            str(tmp_path / "j.db"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert done.stderr == (
        "interlock: error: '*' is not a web origin; give scheme, host and port only, e.g. "
        "https://console.example.com or http://localhost:3000\n"
    )


# -- 3. every route's role, from the route table -------------------------------------------

KEYS = {
    "agent": "agent-key-3f9a1c7e5b2d4f6a8c0e",
    "operator": "operator-key-7d1e3a5c9b2f4e6a8c0d",
    "reader": "reader-key-2c4e6a8b0d1f3a5c7e9b",
}


def role_keyring() -> KeyRing:
    import hashlib

    from interlock.gateway._keys import Principal

    return KeyRing(
        (hashlib.sha256(key.encode()).digest(), Principal(f"only-{role}", frozenset({role})))
        for role, key in KEYS.items()
    )


async def ask(url: str, method: str, path: str, key: str | None) -> tuple[int, str]:
    """The status and problem type (or '') of one request, sent as a client would."""
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    if method == "WEBSOCKET":
        return await handshake(url, path, headers)
    content = None
    if method in ("POST", "PUT", "PATCH", "DELETE"):
        content, headers = b"{}", {**headers, "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        request = client.build_request(method, path, content=content, headers=headers)
        response = await client.send(request, stream=True)  # the stream route answers forever
        try:
            kind = ""
            if response.headers.get("content-type") == "application/problem+json":
                kind = msgspec.json.decode(await response.aread())["type"]
            return response.status_code, kind
        finally:
            await response.aclose()


async def handshake(url: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    lines = [
        f"GET {path} HTTP/1.1",
        f"host: {host}:{port}",
        "upgrade: websocket",
        "connection: Upgrade",
        "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==",
        "sec-websocket-version: 13",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some()
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        kind = ""
        if b"application/problem+json" in head.lower():
            while True:
                try:
                    return status, msgspec.json.decode(body)["type"]
                except msgspec.DecodeError:
                    chunk = await stream.receive_some()
                    if not chunk:
                        break
                    body += chunk
        return status, kind


def test_the_route_table_names_every_route_the_api_serves() -> None:
    from interlock.gateway._app import _ROUTES
    from interlock.gateway._routes import ROUTES, WEBSOCKET

    served = {(method, name) for name, route in _ROUTES.items() for method in route.handlers}
    table = {(r.method, r.path) for r in ROUTES if r.method != WEBSOCKET}
    assert served == table  # a route the table lacks would let any valid key in
    assert len(ROUTES) == 17


#: The role each route needs, as the README's table of roles says: kept here, apart from the
#: guard's table, so that dropping or lowering a route's role there fails this test.
ROLE_OF = {
    ("POST", "/v1/runs"): "agent",
    ("GET", "/v1/runs"): "reader",
    ("GET", "/v1/runs/{id}"): "reader",
    ("GET", "/v1/runs/{id}/events"): "reader",
    ("GET", "/v1/runs/{id}/stream"): "reader",
    ("POST", "/v1/runs/{id}/proposals"): "agent",
    ("POST", "/v1/runs/{id}/results"): "agent",
    ("POST", "/v1/verify"): "agent",
    ("GET", "/v1/escalations"): "operator",
    ("GET", "/v1/escalations/{id}"): "operator",
    ("POST", "/v1/escalations/{id}/resume"): "operator",
    ("POST", "/v1/escalations/{id}/abort"): "operator",
    ("GET", "/metrics"): "reader",
    ("GET", "/healthz"): None,
    ("GET", "/readyz"): None,
    ("GET", "/openapi.json"): None,
    ("WEBSOCKET", "/v1/channel"): "agent",
}


def test_the_guard_table_gives_every_route_its_role() -> None:
    from interlock.gateway._routes import ROUTES

    roles = {(r.method, r.path): r.role for r in ROUTES}
    missing = sorted(set(roles) - set(ROLE_OF))
    assert not missing, f"routes {missing} have no role in ROLE_OF: add the role each needs"
    assert roles == ROLE_OF


def _routes() -> list[tuple[str, str, str | None]]:
    from interlock.gateway._routes import ROUTES

    # every route of the guard's table, with the role it must need
    return [(r.method, r.path, ROLE_OF.get((r.method, r.path), "?")) for r in ROUTES]


GUARD_REFUSALS = {
    401: "https://interlock.dev/problems/unauthorized",
    403: "https://interlock.dev/problems/forbidden",
}


@pytest.mark.parametrize(("method", "pattern", "role"), _routes(), ids=lambda v: str(v))
async def test_every_route_needs_its_role(
    tmp_path: Path, method: str, pattern: str, role: str | None
) -> None:
    """No key: 401; a key without the route's role: 403; a key with it: past the guard
    (whatever the API then says: 404 for the run r-1, 422 for an empty body, ...)."""
    from interlock.gateway._keys import Principal

    path = pattern.replace("{id}", "r-1")
    async with gateway(tmp_path / "j.db", keyring=role_keyring()) as (server, _):
        status, kind = await ask(server.url, method, path, None)
        if role is None:
            assert GUARD_REFUSALS.get(status) != kind, (method, pattern, status)
        else:
            assert (status, kind) == (401, GUARD_REFUSALS[401]), (method, pattern, status)
        for held, key in KEYS.items():
            status, kind = await ask(server.url, method, path, key)
            if role is None or Principal("k", frozenset({held})).allows(role):
                assert GUARD_REFUSALS.get(status) != kind, (method, pattern, held, status, kind)
            else:
                assert (status, kind) == (403, GUARD_REFUSALS[403]), (method, pattern, held)


# -- 2. bare connections must not pin the server's descriptors -----------------------------


def open_descriptors() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
async def test_bare_connections_that_close_free_their_descriptors_at_once(tmp_path: Path) -> None:
    """Connect, then close without a request: the server must let go of its end then, not
    when its idle timer ends (hypercorn's trio worker waited out keep_alive_timeout)."""
    limits = Limits(idle_timeout=600.0)  # far longer than this test may wait
    async with gateway(tmp_path / "j.db", limits=limits, channel_port=0) as (server, client):
        assert (await client.get("/healthz")).status_code == 200
        channel_port = server.channel.rsplit(":", 1)[1]
        before = open_descriptors()
        for _ in range(40):
            for port in (server.port, int(channel_port)):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.aclose()
        # Each server end is closed once the server reads the end of its connection; poll
        # for it (the bound is generous: what matters is that it happens at all).
        for _ in range(1200):  # 60 s
            if open_descriptors() <= before + 4:
                break
            await trio.sleep(0.05)
        assert open_descriptors() <= before + 4, open_descriptors() - before
        assert (await client.get("/healthz")).status_code == 200


SERVE_WITH_FEW_DESCRIPTORS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from interlock.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs resource.setrlimit")
def test_many_bare_connections_do_not_take_a_server_with_few_descriptors_offline(
    tmp_path: Path,
) -> None:
    """A server allowed 256 descriptors gets 300 bare connections on each port, which stay
    silent: it must still answer a real request on each, the idle connections giving way."""
    import os
    import signal
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLOCK_")}
    command = [sys.executable, "-c", SERVE_WITH_FEW_DESCRIPTORS, "serve", "--port", "0"]
    command += ["--channel-port", "0", "--db", str(tmp_path / "j.db")]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith("interlock serve: http://127.0.0.1:"), line
            url = line.split()[2].rstrip(",")
            channel = line.split()[4]
            assert channel.startswith("tcp://127.0.0.1:"), line
            trio.run(_flood_then_ask, url, channel)
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, err


async def _flood_then_ask(url: str, channel: str) -> None:
    from interlock.client._channel import open_channel

    http_port = int(url.rsplit(":", 1)[1])
    channel_port = int(channel.rsplit(":", 1)[1])
    streams: list[trio.SocketStream] = []

    async def connect(port: int) -> None:
        with trio.move_on_after(10):  # a connect the server's backlog cannot take waits
            streams.append(await trio.open_tcp_stream("127.0.0.1", port))

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(300):
                nursery.start_soon(connect, http_port)
                nursery.start_soon(connect, channel_port)
        assert len(streams) > 256  # more than the server could hold at once
        with trio.fail_after(60):  # generous: the server must answer at all, not fast
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                created = await client.post(
                    "/v1/runs", json={"machine": "refund", "mode": "external", "run_id": "r-1"}
                )
                assert created.status_code == 201, created.text
                assert (await client.get("/healthz")).status_code == 200
            async with open_channel(channel, connect_timeout=60) as client:
                assert (await client.get_run("r-1")).id == "r-1"
    finally:
        for stream in streams:
            await stream.aclose()


async def test_silent_connections_are_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    limits = Limits(idle_timeout=0.5)
    async with gateway(tmp_path / "j.db", limits=limits, channel_port=0) as (server, client):
        channel_port = int(server.channel.rsplit(":", 1)[1])
        for port in (server.port, channel_port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                with trio.fail_after(60):  # generous: it must close at all
                    assert await stream.receive_some() == b""
        # a channel frame begun and never finished holds the connection no longer either
        async with await trio.open_tcp_stream("127.0.0.1", channel_port) as stream:
            await stream.send_all(b"\x00\x00\x01")  # 3 of a frame length's 4 bytes
            said = b""
            with trio.fail_after(60):
                while chunk := await stream.receive_some():
                    said += chunk
            assert b"was begun and not finished within 0.5 s" in said  # a problem frame
        # a client between requests is closed too, and the next request reconnects
        assert (await client.get("/healthz")).status_code == 200
        await trio.sleep(1)
        assert (await client.get("/healthz")).status_code == 200
        assert server.connections is not None
        assert server.connections.limit == 1000


async def test_the_connection_budget_closes_the_longest_idle_to_make_room() -> None:
    from interlock.gateway._connections import ConnectionBudget

    budget = ConnectionBudget(2)
    closed: list[str] = []
    await budget.acquire()
    await budget.acquire()
    budget.idle("a", lambda: closed.append("a"))
    budget.idle("b", lambda: closed.append("b"))
    budget.busy("b")  # a request came on b
    async with trio.open_nursery() as nursery:
        nursery.start_soon(budget.acquire)
        await trio.testing.wait_all_tasks_blocked()
        assert closed == ["a"]  # a closes; its place is free once it is closed
        assert budget.open == 2
        budget.release("a")
    assert (budget.open, budget.reaped) == (2, 1)
    with pytest.raises(ValueError, match=r"^a connection budget needs a limit of at least 1"):
        ConnectionBudget(0)


def test_the_connection_budget_fits_the_descriptor_limit() -> None:
    import resource

    from interlock.gateway._connections import DESCRIPTOR_RESERVE, ConnectionBudget

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    budget = ConnectionBudget.within_descriptors(10**9)
    assert budget.limit == soft - DESCRIPTOR_RESERVE
    assert ConnectionBudget.within_descriptors(5).limit == 5
    env = {"INTERLOCK_GATEWAY_MAX_CONNECTIONS": "20", "INTERLOCK_GATEWAY_IDLE_TIMEOUT": "2.5"}
    assert (Limits.from_env(env).max_connections, Limits.from_env(env).idle_timeout) == (20, 2.5)
    with pytest.raises(ValueError, match=r"^Limits.idle_timeout must be a positive"):
        Limits(idle_timeout=0)
