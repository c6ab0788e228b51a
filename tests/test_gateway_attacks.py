"""Attacks on the gateway (#33), each over real loopback HTTP against ``serve_gateway``:
a web page driving a gateway that has no key, descriptors pinned by bare connections, and
every route's role asserted from the route table."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

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
        [sys.executable, "-m", "interlock", "serve", "--port", "0", "--allow-origin", "*"],
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
