"""One route table (``gateway/_routes.py``) is what the app serves, the guard guards and the
OpenAPI document lists: a route cannot be in one and missing from another, and a path in
none of them is a 404 problem."""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from interlock import Machine, Tool, Worker
from interlock.gateway import GatewayServer, openapi_document, serve_gateway
from interlock.gateway._app import _ROUTES as SERVED
from interlock.gateway._app import _compile
from interlock.gateway._guard import _UNKNOWN, _Router, guarded
from interlock.gateway._keys import KeyRing, Principal
from interlock.gateway._routes import ROUTES, WEBSOCKET, Route

HTTP = [r for r in ROUTES if r.method != WEBSOCKET]
KEY = "route-table-key-5c1e9a3f7b2d4e6a8c0f"


def _concrete(pattern: str) -> str:
    return pattern.replace("{id}", "r-1")


def _ref(kind: type) -> str:
    return f"#/components/schemas/{kind.__name__}"


@pytest.mark.parametrize("route", HTTP, ids=lambda r: f"{r.method} {r.path}")
def test_every_route_is_documented_with_the_structs_of_the_table(route: Route) -> None:
    document = openapi_document()
    operation = document["paths"].get(route.path, {}).get(route.method.lower())
    assert operation is not None, f"{route.method} {route.path} is not in the OpenAPI document"
    assert operation["summary"] == route.summary
    answer = operation["responses"][str(route.status)]["content"]
    if route.out is not None:
        assert answer["application/json"]["schema"] == {"$ref": _ref(route.out)}
        assert route.out.__name__ in document["components"]["schemas"]
    else:
        assert list(answer) == [route.produces]
    if route.body is not None:
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": _ref(route.body)}
    else:
        assert "requestBody" not in operation
    documented = {p["name"] for p in operation.get("parameters", ()) if p["in"] == "query"}
    assert documented == {q.name for q in route.query}


def test_the_document_lists_nothing_the_table_lacks() -> None:
    documented = {
        (method.upper(), path)
        for path, operations in openapi_document()["paths"].items()
        for method in operations
    }
    assert documented == {(r.method, r.path) for r in HTTP}


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method} {r.path}")
def test_every_route_is_guarded_with_its_role_and_served(route: Route) -> None:
    rule = _Router(ROUTES).match(route.method, _concrete(route.path))
    assert rule is not _UNKNOWN, f"the guard does not know {route.method} {route.path}"
    assert (rule.role, rule.public, rule.streaming) == (route.role, route.public, route.streaming)
    if route.method != WEBSOCKET:
        assert route.method in SERVED[route.path].handlers, f"no handler for {route.path}"


def test_the_app_refuses_a_table_that_does_not_match_its_handlers() -> None:
    lacking = (*ROUTES, Route("GET", "/v1/nothing", "reader", "x", "nothing"))
    with pytest.raises(RuntimeError, match=r"names the handler 'nothing', which the gateway"):
        _compile(lacking)
    without_openapi = tuple(r for r in ROUTES if r.path != "/openapi.json")
    with pytest.raises(RuntimeError, match=r"the handlers \['openapi'\] serve no route"):
        _compile(without_openapi)
    twice = (*ROUTES, Route("GET", "/healthz", None, "again", "healthz"))
    with pytest.raises(RuntimeError, match=r"route GET /healthz is in ROUTES twice"):
        _compile(twice)


class _Reached:
    """An ASGI app that records that the guard let a request through, and answers 204."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.reached.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def _ask(app: Any, method: str, path: str, key: str | None) -> int:
    headers = [(b"host", b"127.0.0.1")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if method == "POST":
        headers.append((b"content-type", b"application/json"))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": headers,
        "query_string": b"",
        "http_version": "1.1",
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return int(sent[0]["status"])


@pytest.mark.parametrize("route", HTTP, ids=lambda r: f"{r.method} {r.path}")
async def test_the_guard_asks_each_route_for_the_key_its_table_entry_says(route: Route) -> None:
    """Without a key, a route with a role is refused (401) before the app sees it; a public
    one reaches the app; with a key that has every role, each reaches the app."""
    ring = KeyRing(
        [
            (
                hashlib.sha256(KEY.encode()).digest(),
                Principal("all", frozenset({"agent", "operator", "reader"})),
            )
        ]
    )
    app = _Reached()
    guard = guarded(app, ring)
    path = _concrete(route.path)
    status = await _ask(guard, route.method, path, None)
    if route.public:
        assert (status, app.reached) == (204, [(route.method, path)])
    else:
        assert (status, app.reached) == (401, [])
    app.reached.clear()
    assert await _ask(guard, route.method, path, KEY) == 204
    assert app.reached == [(route.method, path)]


class _Nothing(msgspec.Struct, forbid_unknown_fields=True):
    pass


async def _never(args: Any, ctx: Any) -> Any:
    raise AssertionError("an external run's tool is executed by its caller")


@pytest.mark.slow
async def test_a_path_in_no_route_is_a_404_problem_not_a_500(tmp_path: Path) -> None:
    machine = Machine(
        "m",
        "S",
        {"S": Worker(next=["COMPLETED"], tools=["t"])},
        tools=[Tool("t", _never, _Nothing)],
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server: GatewayServer = await nursery.start(
                partial(
                    serve_gateway, machine, db=str(tmp_path / "j.db"), port=0, keyring=KeyRing()
                )
            )
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                for method, path in [
                    ("GET", "/nope"),
                    ("GET", "/v1"),
                    ("GET", "/v1/runs/r-1/nope"),
                    ("GET", "/v1/runs//events"),
                    ("POST", "/v1/runs/r-1/proposals/x"),
                    ("GET", "/openapi.json/x"),
                ]:
                    body = {"json": {}} if method == "POST" else {}
                    response = await client.request(method, path, **body)
                    assert response.status_code == 404, (method, path, response.text)
                    assert response.headers["content-type"] == "application/problem+json"
                    problem = response.json()
                    assert problem["status"] == 404
                    assert "no route" in problem["detail"], problem
                    assert "openapi.json" in problem["detail"]
            server.stop()
