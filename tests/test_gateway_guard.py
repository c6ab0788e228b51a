"""The gateway's keys, roles and limits: KeyRing, check_bind, the token bucket, and the guard
middleware served for real by hypercorn on trio over loopback."""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import re
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("hypercorn")

from hypercorn.config import Config
from hypercorn.trio import serve

from interlock.core._pacing import TokenBucket
from interlock.gateway import _keys
from interlock.gateway._guard import (
    Limits,
    RateLimiter,
    RunQuota,
    _Router,
    guarded,
    retry_after,
)
from interlock.gateway._keys import (
    ANONYMOUS,
    ROLES,
    KeyRing,
    Principal,
    Unauthorized,
    check_bind,
    hash_key,
    is_loopback,
)
from interlock.gateway._routes import PAGES, ROUTES, Pages, Route

AGENT_KEY = "agent-key-9d2f0c4e1b7a4f0e8c3d"
READER_KEY = "reader-key-5b8e2a1c7d3f4e6a9b0c"
OPERATOR_KEY = "operator-key-1f3a5c7e9b2d4f6a8c0e"


def keys_file(tmp_path, text: str):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


@pytest.fixture
def keyring(tmp_path) -> KeyRing:
    """Three keys: an agent scoped to machine 'refund', a reader, an operator."""
    path = keys_file(
        tmp_path,
        f"""
[keys.billing]
sha256 = "{hash_key(AGENT_KEY)}"
roles = ["agent"]
machines = ["refund"]

[keys.dashboard]
sha256 = "{hash_key(READER_KEY).upper()}"
roles = ["reader"]

[keys.oncall]
sha256 = "{hash_key(OPERATOR_KEY)}"
roles = ["operator"]
""",
    )
    return KeyRing.from_file(path)


# ---- keys ------------------------------------------------------------------------------------


def test_keys_file_roles_and_machines(keyring):
    billing = keyring.authenticate(f"Bearer {AGENT_KEY}")
    assert billing == Principal("billing", frozenset({"agent"}), frozenset({"refund"}))
    assert billing.allows("agent", "refund")
    assert not billing.allows("agent", "support")
    assert billing.allows("reader", "refund")  # agent implies reader
    assert billing.allows("agent")  # no machine: the role only
    assert not billing.allows("operator")

    dashboard = keyring.authenticate(f"bearer   {READER_KEY}  ")  # scheme is case-insensitive
    assert dashboard.name == "dashboard"
    assert dashboard.machines is None
    assert dashboard.allows("reader", "anything")
    assert not dashboard.allows("agent")
    assert not dashboard.allows("operator")

    oncall = keyring.authenticate(f"Bearer {OPERATOR_KEY}")
    assert oncall.allows("operator", "refund")
    assert oncall.allows("reader")  # operator implies reader
    assert not oncall.allows("agent")
    assert not keyring.open
    assert sorted(keyring.principals) == ["billing", "dashboard", "oncall"]


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "this server needs an API key; send the header 'Authorization: Bearer <key>'"),
        (
            f"Basic {AGENT_KEY}",
            "the Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'",
        ),
        (
            "Bearer",
            "the Bearer credential is empty or not ASCII; send 'Authorization: Bearer <key>'",
        ),
        (
            "Bearer clé",
            "the Bearer credential is empty or not ASCII; send 'Authorization: Bearer <key>'",
        ),
        (
            f"Bearer {AGENT_KEY}x",
            "the API key is not one this server accepts; check INTERLOCK_API_KEY or the server's "
            "keys file",
        ),
    ],
)
def test_authenticate_refuses_without_echoing_the_key(keyring, header, message):
    with pytest.raises(Unauthorized) as caught:
        keyring.authenticate(header)
    assert str(caught.value) == message
    assert AGENT_KEY not in str(caught.value)


def test_keys_are_compared_in_constant_time(keyring, monkeypatch):
    source = inspect.getsource(KeyRing.authenticate)
    assert "hmac.compare_digest(" in source
    assert "==" not in source.split('"""')[-1]  # no plain comparison after the docstring
    calls = []
    real = _keys.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(_keys.hmac, "compare_digest", spy)
    keyring.authenticate(f"Bearer {AGENT_KEY}")
    digest = hashlib.sha256(AGENT_KEY.encode()).digest()
    assert calls == [(digest, digest)]  # digests only: the secret itself is never compared
    # A key ring that holds the plain key nowhere: only 32-byte digests.
    assert all(len(d) == 32 for d in keyring._by_digest)
    assert AGENT_KEY.encode() not in b"".join(keyring._by_digest)


def test_env_key_has_every_role_and_combines_with_a_file(keyring, tmp_path):
    ring = KeyRing.from_env({"INTERLOCK_API_KEY": "s3cret-token"})
    principal = ring.authenticate("Bearer s3cret-token")
    assert principal == Principal("default", ROLES)
    assert all(principal.allows(role, "any") for role in ROLES)
    assert KeyRing.from_env({}).open
    assert KeyRing.from_env({}).authenticate(None) is ANONYMOUS
    path = tmp_path / "keys.toml"
    both = KeyRing.from_env(
        {"INTERLOCK_API_KEY": "s3cret-token", "INTERLOCK_API_KEYS_FILE": str(path)}
    )
    assert sorted(both.principals) == ["billing", "dashboard", "default", "oncall"]
    assert both.authenticate(f"Bearer {READER_KEY}").name == "dashboard"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"INTERLOCK_API_KEY": ""},
            "INTERLOCK_API_KEY is set but empty; set it to a random key (python -c "
            '"import secrets; print(secrets.token_urlsafe(32))") or unset it to serve on '
            "loopback without keys",
        ),
        (
            {"INTERLOCK_API_KEY": "two words"},
            "INTERLOCK_API_KEY must be printable ASCII without spaces",
        ),
        (
            {"INTERLOCK_API_KEYS_FILE": ""},
            "INTERLOCK_API_KEYS_FILE is set but empty; set it to the path of a keys file or "
            "unset it",
        ),
        (
            {"INTERLOCK_API_KEYS_FILE": "/nonexistent/keys.toml"},
            "keys file /nonexistent/keys.toml: cannot be read",
        ),
    ],
)
def test_env_mistakes_are_clear(environ, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        KeyRing.from_env(environ)


GOOD = hash_key("k1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys = [", "is not valid TOML: "),
        ("", "defines no keys; add a table per key: [keys.NAME]"),
        (
            f'[key.a]\nsha256 = "{GOOD}"',
            "unknown top-level entries ['key']; put every key in a [keys.NAME] table",
        ),
        ('[keys]\na = "x"', "[keys.a]: must be a table ([keys.a]), not a plain value"),
        (
            '[keys.a]\nroles = ["agent"]',
            '[keys.a]: has no sha256; add sha256 = "<output of printf %s "$KEY" | sha256sum>"',
        ),
        (
            '[keys.a]\nsha256 = "k1"\nroles = ["agent"]',
            "[keys.a]: sha256 must be 64 hex characters, the digest of the key (store the hash, "
            'never the key): printf %s "$KEY" | sha256sum',
        ),
        (
            f'[keys.a]\nsha256 = "{GOOD}"\nrole = ["agent"]',
            "[keys.a]: unknown fields ['role']; a key has sha256, roles, machines",
        ),
        (
            f'[keys.a]\nsha256 = "{GOOD}"',
            "[keys.a]: roles must be a non-empty list of agent, operator, reader, e.g. "
            'roles = ["agent"]; got None',
        ),
        (
            f'[keys.a]\nsha256 = "{GOOD}"\nroles = ["admin"]',
            "[keys.a]: roles must be a non-empty list of agent, operator, reader",
        ),
        (
            f'[keys.a]\nsha256 = "{GOOD}"\nroles = ["agent"]\nmachines = []',
            "[keys.a]: machines must be a non-empty list of machine names, e.g. machines = "
            '["refund"]; omit it to allow every machine; got []',
        ),
        (
            f'[keys.a]\nsha256 = "{GOOD}"\nroles = ["agent"]\n[keys.b]\nsha256 = "{GOOD.upper()}"\nroles = ["reader"]',
            "[keys.b]: has the same sha256 as [keys.a]; give each its own random key",
        ),
        (
            f'[keys."bad name"]\nsha256 = "{GOOD}"\nroles = ["agent"]',
            "[keys.bad name]: a key's name must be 1-64 letters, digits, '_', '.' or '-'",
        ),
    ],
)
def test_bad_keys_files_say_where_and_how_to_fix(tmp_path, text, message):
    path = keys_file(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        KeyRing.from_file(path)
    text_of = str(caught.value)
    assert text_of.startswith(f"keys file {path}: ")
    assert message in text_of
    assert 'k1"' not in text_of  # a pasted plain key is never echoed


def test_principal_validates():
    with pytest.raises(ValueError, match=r"^principal 'x': roles must be a non-empty subset"):
        Principal("x", frozenset({"root"}))
    with pytest.raises(ValueError, match=r"^principal 'x': roles must be a non-empty subset"):
        Principal("x", frozenset())
    with pytest.raises(ValueError, match=r"^principal 'x': machines must be None"):
        Principal("x", frozenset({"agent"}), frozenset())
    with pytest.raises(
        ValueError,
        match=r"^principal 'x': roles must be a set of role names, e.g. frozenset\(\{'agent'\}\), not a string$",
    ):
        Principal("x", "agent")
    with pytest.raises(ValueError, match=r"^principal 'x': machines must be None"):
        Principal("x", frozenset({"agent"}), "refund")
    with pytest.raises(ValueError, match=r"^a principal needs a non-empty name"):
        Principal("", frozenset({"agent"}))


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LocalHost.", True),
        ("unix:/tmp/interlock.sock", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("::ffff:10.0.0.5", False),
        ("example.com", False),
        ("localhost.example.com", False),
    ],
)
def test_check_bind(host, loopback, caplog):
    assert is_loopback(host) is loopback
    keyed = KeyRing.from_env({"INTERLOCK_API_KEY": "k"})
    check_bind(host, keyed)  # with a key, anywhere
    if loopback:
        with caplog.at_level(logging.WARNING, logger="interlock.gateway"):
            check_bind(host, KeyRing())
        assert "no API key configured: serving on" in caplog.text
        assert "loopback only" in caplog.text
    else:
        with pytest.raises(ValueError, match=r"^refusing to serve on ") as caught:
            check_bind(host, KeyRing())
        assert str(caught.value) == (
            f"refusing to serve on {host!r} without an API key: anyone who reaches it could "
            "drive runs; set INTERLOCK_API_KEY (one key, every role) or INTERLOCK_API_KEYS_FILE "
            "(a keys file), or bind to 127.0.0.1"
        )
    with pytest.raises(ValueError, match=r"^the host to bind is empty"):
        check_bind(" ", keyed)


def test_serving_open_is_said_once_per_key_ring(caplog):
    """The gateway and its channel check their binds with one key ring: one warning."""
    ring = KeyRing()
    with caplog.at_level(logging.WARNING, logger="interlock.gateway"):
        check_bind("127.0.0.1", ring)
        check_bind("unix:/tmp/channel.sock", ring)
        check_bind("::1", KeyRing())
    assert caplog.text.count("no API key configured") == 2
    with pytest.raises(ValueError, match=r"^refusing to serve on "):
        check_bind("10.0.0.5", ring)  # warned or not, an open ring stays on loopback


# ---- limits, bucket, quota, routes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"max_body": 0},
            "Limits.max_body must be a positive integer (bytes, e.g. 1048576 for 1 MiB); got 0",
        ),
        ({"max_body": True}, "Limits.max_body must be a positive integer"),
        (
            {"rate": -1},
            "Limits.rate must be a positive finite number (requests per second per key, or None); got -1",
        ),
        ({"rate": math.inf}, "Limits.rate must be a positive finite number"),
        ({"burst": 0}, "Limits.burst must be a positive integer"),
        (
            {"rate": None, "burst": 5},
            "Limits.burst needs a rate; set rate too, or leave burst None",
        ),
        ({"runs_in_flight": 1.5}, "Limits.runs_in_flight must be a positive integer"),
        ({"request_timeout": 0}, "Limits.request_timeout must be a positive finite number"),
    ],
)
def test_limits_validate(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        Limits(**kwargs)


def test_limits_defaults():
    limits = Limits()
    assert (limits.max_body, limits.rate, limits.runs_in_flight, limits.request_timeout) == (
        1 << 20,
        1000.0,
        10_000,
        30.0,
    )
    assert limits.effective_burst == 1000
    assert Limits(rate=2.5).effective_burst == 3
    assert Limits(rate=0.1).effective_burst == 1
    assert Limits(rate=10, burst=50).effective_burst == 50


def test_limits_from_env():
    assert Limits.from_env({}) == Limits()
    limits = Limits.from_env(
        {
            "INTERLOCK_GATEWAY_MAX_BODY": "2048",
            "INTERLOCK_GATEWAY_RATE": "50.5",
            "INTERLOCK_GATEWAY_BURST": "7",
            "INTERLOCK_GATEWAY_RUNS_IN_FLIGHT": "3",
            "INTERLOCK_GATEWAY_REQUEST_TIMEOUT": "off",
        }
    )
    assert limits == Limits(
        max_body=2048, rate=50.5, burst=7, runs_in_flight=3, request_timeout=None
    )
    assert Limits.from_env({"INTERLOCK_GATEWAY_RATE": " OFF "}).rate is None
    with pytest.raises(
        ValueError, match=r"^INTERLOCK_GATEWAY_MAX_BODY must be a whole number; got '1MiB'$"
    ):
        Limits.from_env({"INTERLOCK_GATEWAY_MAX_BODY": "1MiB"})
    with pytest.raises(
        ValueError, match=r"^INTERLOCK_GATEWAY_REQUEST_TIMEOUT must be a number or off; got 'x'$"
    ):
        Limits.from_env({"INTERLOCK_GATEWAY_REQUEST_TIMEOUT": "x"})
    with pytest.raises(
        ValueError,
        match=r"^Limits.rate must be a positive finite number .* \(from the INTERLOCK_GATEWAY_\* variables\)$",
    ):
        Limits.from_env({"INTERLOCK_GATEWAY_RATE": "0"})


def test_token_bucket_with_a_fake_clock():
    bucket = TokenBucket(rate=2.0, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert bucket.take(100.0) == 0.5  # one token needs 1/rate seconds
    assert bucket.take(100.25) == 0.25  # a refusal takes nothing; half a token came back
    assert bucket.take(100.5) == 0.0
    assert bucket.take(100.5) == 0.5
    assert bucket.take(99.0) == 0.5  # a clock stepping back refills nothing
    assert [bucket.take(1000.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]  # capped at burst


@settings(max_examples=300, deadline=None)
@given(
    rate=st.sampled_from([0.5, 1.0, 3.0, 100.0]),
    burst=st.integers(1, 20),
    steps=st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=60),
)
def test_token_bucket_never_exceeds_rate_and_its_wait_is_enough(rate, burst, steps):
    start = 1000.0
    bucket = TokenBucket(rate, burst, start)
    now, accepted = start, 0
    for step in steps:
        now += step
        wait = bucket.take(now)
        if wait == 0.0:
            accepted += 1
        else:
            assert 0 < wait <= 1 / rate + 1e-9
            # Waiting what it said is enough (a fresh copy, so the probe does not disturb).
            probe = TokenBucket(rate, burst, start)
            probe._tokens, probe._stamp = bucket._tokens, bucket._stamp
            assert probe.take(now + wait + 1e-9) == 0.0
        assert accepted <= burst + (now - start) * rate + 1e-9


def test_retry_after_rounds_up_to_whole_seconds():
    assert [retry_after(w) for w in (1e-9, 0.5, 1.0, 1.000001, 2.5, 99.99)] == [1, 1, 1, 2, 3, 100]


def test_rate_limiter_is_per_key():
    now = [0.0]
    limiter = RateLimiter(rate=1.0, burst=2, clock=lambda: now[0])
    assert [limiter.check("a") for _ in range(3)] == [0.0, 0.0, 1.0]
    assert limiter.check("b") == 0.0  # another key has its own bucket
    now[0] = 1.0
    assert limiter.check("a") == 0.0


def test_run_quota():
    quota = RunQuota(2)
    assert quota.acquire("a")
    assert quota.acquire("a")
    assert not quota.acquire("a")
    assert quota.acquire("b")
    assert quota.in_flight("a") == 2
    quota.release("a")
    assert quota.acquire("a")
    for _ in range(2):
        quota.release("a")
    assert quota.in_flight("a") == 0
    with pytest.raises(ValueError, match=r"^key 'a' has no run in flight to release$"):
        quota.release("a")
    with pytest.raises(ValueError, match=r"^Limits.runs_in_flight must be a positive integer"):
        RunQuota(0)


def test_route_table():
    router = _Router(ROUTES)
    assert router.match("POST", "/v1/runs").role == "agent"
    assert router.match("GET", "/v1/runs").role == "reader"
    assert router.match("HEAD", "/v1/runs/r-1").role == "reader"
    assert router.match("POST", "/v1/runs/r-1/proposals").role == "agent"
    assert router.match("POST", "/v1/escalations/r-1/resume").role == "operator"
    assert router.match("GET", "/v1/runs/r-1/stream").streaming
    assert not router.match("GET", "/v1/runs/r-1/events").streaming
    assert router.match("GET", "/healthz").public
    unknown = router.match("GET", "/v1/runs//events")  # an empty id matches no pattern
    assert (unknown.public, unknown.role) == (False, None)
    assert router.match("DELETE", "/v1/runs").role is None
    assert not router.match("DELETE", "/v1/runs").public
    with pytest.raises(ValueError, match=r"^route POST /x: role 'admin' is not one of"):
        Route("POST", "/x", "admin", "x")
    with pytest.raises(ValueError, match=r"the method must be upper case"):
        Route("post", "/x", "agent", "x")
    with pytest.raises(ValueError, match=r"the path must start with '/'"):
        Route("GET", "x", "agent", "x")
    with pytest.raises(ValueError, match=r"limits must be 'request' or 'stream'"):
        Route("GET", "/x", "agent", "x", limits="forever")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^route GET /v1/runs/\{run\} is in the table twice"):
        _Router((*ROUTES, Route("GET", "/v1/runs/{run}", "agent", "x")))
    with pytest.raises(TypeError, match=r"must be Route objects"):
        _Router([("GET", "/x")])  # type: ignore[list-item]


def test_page_trees_are_entries_of_the_table():
    """The console is an entry of PAGES, which the guard reads like the routes: every path
    under its prefix is public and takes forms, its live streams are untimed; a path that
    only starts with the same letters, a WebSocket, or an API route is not a page. A tree
    of another prefix is guarded the same way, with no code of the guard's naming it."""
    assert [pages.prefix for pages in PAGES] == ["/console"]
    router = _Router(ROUTES, PAGES)
    for path in ("/console", "/console/", "/console/runs/r-1", "/console/runs/r-1/resume"):
        rule = router.match("POST", path)
        assert (rule.public, rule.forms, rule.streaming) == (True, True, False), path
    live = router.match("GET", "/console/runs/r-1/live")
    assert (live.public, live.streaming) == (True, True)
    for method, path in (("GET", "/consoles"), ("GET", "/v1/console"), ("WEBSOCKET", "/console")):
        rule = router.match(method, path)
        assert (rule.public, rule.forms) == (False, False), (method, path)
    assert not router.match("POST", "/v1/runs").forms
    other = _Router(ROUTES, (Pages("/ops", "another console", stream_suffix="/events"),))
    assert other.match("GET", "/ops/x").public
    assert other.match("GET", "/ops/x/events").streaming
    assert not other.match("GET", "/console").public  # not in this table
    with pytest.raises(ValueError, match=r"the prefix must start with '/' and not end with one"):
        Pages("/ops/", "x")


# ---- the middleware over real HTTP -----------------------------------------------------------


class EchoApp:
    """A tiny ASGI app: reads the whole body, answers who it was and how much it read."""

    def __init__(self, hold_stream: bool = False) -> None:
        self.hold_stream = hold_stream
        self.disconnects = 0
        self.stream_started = trio.Event()
        self.stream_release = trio.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/raises":  # a bug, before the body is read
            raise RuntimeError("a bug in the app")
        if scope["path"] == "/unfinished":  # begins an answer and leaves it
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"half", "more_body": True})
            return
        if scope["path"] == "/early-start":  # starts its answer, then reads the body
            await send({"type": "http.response.start", "status": 200, "headers": []})
        elif scope["path"] == "/refuse-unread":  # answers before reading the body, as a 415 does
            await send({"type": "http.response.start", "status": 415, "headers": []})
            await send({"type": "http.response.body", "body": b"no"})
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                raise RuntimeError("the client went away")  # the guard must swallow this
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if scope["path"] == "/slow":
            await trio.sleep_forever()
        if scope["path"] == "/v1/runs/r-1/stream" and self.hold_stream:
            self.stream_started.set()
            await self.stream_release.wait()
        principal = scope.get("interlock.principal")
        answer = msgspec.json.encode(
            {
                "principal": principal and principal.name,
                "read": len(body),
                "path": scope["path"],
            }
        )
        if scope["path"] != "/early-start":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
        await send({"type": "http.response.body", "body": answer})


class Watched:
    """Wraps an ASGI app: after each HTTP call, ``await next_call()`` gives its path and
    whatever exception escaped it (None), so a test knows the call is over, without sleeping."""

    def __init__(self, app) -> None:
        self.app = app
        self._send, self._receive = trio.open_memory_channel(float("inf"))

    async def __call__(self, scope, receive, send):
        escaped = None
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            escaped = exc
            raise
        finally:
            if scope["type"] == "http":
                self._send.send_nowait((scope["path"], escaped))

    async def next_call(self):
        return await self._receive.receive()


@asynccontextmanager
async def served(app) -> AsyncIterator[str]:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve(
                app, config, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        try:
            yield binds[0]
        finally:
            stop.set()


def auth(key: str) -> dict[str, str]:
    # every mutating route takes JSON or msgpack only (a web page can send neither unasked)
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def assert_problem(response: httpx.Response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert set(body) == {"type", "title", "status", "detail"}
    assert body["type"] == f"https://interlock.dev/problems/{slug}"
    assert body["status"] == status
    assert body["title"]
    assert body["detail"]
    return body


SLOW_ROUTES = (*ROUTES, Route("POST", "/slow", "agent", "an app that takes its time"))


async def test_keys_and_roles_over_http(keyring):
    app = EchoApp()
    with trio.fail_after(60):
        async with (
            served(guarded(app, keyring, Limits(), routes=SLOW_ROUTES)) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            for path in ("/healthz", "/readyz", "/openapi.json"):
                response = await client.get(path)
                assert response.status_code == 200
                assert response.json()["principal"] is None

            missing = await client.post("/v1/runs", json={})
            body = assert_problem(missing, 401, "unauthorized")
            # Refused with its body unread: the server closes, and says so.
            assert missing.headers["connection"] == "close"
            no_body = await client.get("/v1/runs")
            assert_problem(no_body, 401, "unauthorized")
            assert "connection" not in no_body.headers  # nothing unread: kept alive
            assert missing.headers["www-authenticate"] == 'Bearer realm="interlock"'
            assert "Authorization: Bearer <key>" in body["detail"]

            wrong = await client.post("/v1/runs", json={}, headers=auth("nope-" + AGENT_KEY))
            body = assert_problem(wrong, 401, "unauthorized")
            assert wrong.headers["www-authenticate"] == (
                'Bearer realm="interlock", error="invalid_token"'
            )
            assert AGENT_KEY not in wrong.text

            started = await client.post("/v1/runs", json={"x": 1}, headers=auth(AGENT_KEY))
            assert started.status_code == 200
            assert started.json() == {"principal": "billing", "read": 7, "path": "/v1/runs"}
            listed = await client.get("/v1/runs", headers=auth(AGENT_KEY))  # implied reader
            assert listed.json()["principal"] == "billing"

            refused = await client.post("/v1/runs", json={}, headers=auth(READER_KEY))
            body = assert_problem(refused, 403, "forbidden")
            assert body["detail"] == (
                "key 'dashboard' has the roles reader; POST /v1/runs needs the 'agent' role: "
                "use a key that has it"
            )
            assert 'error="insufficient_scope"' in refused.headers["www-authenticate"]
            assert_problem(
                await client.get("/v1/escalations", headers=auth(AGENT_KEY)), 403, "forbidden"
            )
            operator = await client.post(
                "/v1/escalations/r-1/resume", json={}, headers=auth(OPERATOR_KEY)
            )
            assert operator.json()["principal"] == "oncall"
            metrics = await client.get("/metrics", headers=auth(READER_KEY))
            assert metrics.json()["principal"] == "dashboard"

            # A route the table does not know needs a valid key, then the app answers it.
            assert (await client.get("/v2/else")).status_code == 401
            assert (await client.get("/v2/else", headers=auth(READER_KEY))).status_code == 200
            twice = await client.get(
                "/v1/runs",
                headers=[("Authorization", f"Bearer {READER_KEY}"), ("Authorization", "Bearer x")],
            )
            body = assert_problem(twice, 401, "unauthorized")
            assert body["detail"] == (
                "the request has more than one Authorization header; send exactly one: "
                "'Authorization: Bearer <key>'"
            )
            dotted = await client.get("/v1/runs/x/%2E%2E/y", headers=auth(READER_KEY))
            assert_problem(dotted, 400, "bad-path")
    assert app.disconnects == 0


async def test_open_keyring_lets_everyone_in_as_anonymous():
    with trio.fail_after(60):
        async with (
            served(guarded(EchoApp(), KeyRing())) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            response = await client.post(
                "/v1/escalations/r/abort", content=b"{}", headers={"content-type": "text/json"}
            )
            assert response.status_code == 415  # no web form's type, even without keys
            response = await client.post("/v1/escalations/r/abort", json={})
            assert response.json()["principal"] == "anonymous"


async def test_body_limit_announced_and_streamed(keyring):
    app = EchoApp()
    watched = Watched(guarded(app, keyring, Limits(max_body=1000)))
    with trio.fail_after(60):
        async with served(watched) as url, httpx.AsyncClient(base_url=url) as client:
            fits = await client.post("/v1/verify", content=b"x" * 1000, headers=auth(AGENT_KEY))
            assert fits.json()["read"] == 1000
            assert await watched.next_call() == ("/v1/verify", None)

            announced = await client.post(
                "/v1/verify", content=b"x" * 1001, headers=auth(AGENT_KEY)
            )
            body = assert_problem(announced, 413, "body-too-large")
            assert announced.headers["connection"] == "close"
            assert body["detail"] == (
                "the request body is larger than this server's limit of 1000 bytes; send a "
                "smaller body (split a batch into several requests)"
            )
            assert await watched.next_call() == ("/v1/verify", None)
            assert app.disconnects == 0  # refused before the app ran

            async def chunks():
                for _ in range(8):
                    yield b"y" * 300

            streamed = await client.post("/v1/verify", content=chunks(), headers=auth(AGENT_KEY))
            assert "content-length" not in streamed.request.headers
            assert_problem(streamed, 413, "body-too-large")
            assert streamed.headers["connection"] == "close"
            # The app saw a disconnect instead of the rest and raised; the guard kept it in.
            assert await watched.next_call() == ("/v1/verify", None)
            assert app.disconnects == 1
            assert (await client.get("/healthz")).status_code == 200


async def test_an_answer_before_the_body_is_read_says_connection_close(keyring):
    """The app refusing a body unread (a 415, say) leaves hypercorn to close the connection;
    the guard adds ``Connection: close`` so the client does not lose its next request."""
    routes = (*ROUTES, Route("POST", "/refuse-unread", "agent", "refuses the body unread"))
    with trio.fail_after(60):
        async with (
            served(guarded(EchoApp(), keyring, Limits(), routes=routes)) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            for _ in range(3):  # without the header, the next request is the one lost
                unread = await client.post(
                    "/refuse-unread", content=b"x" * 300_000, headers=auth(AGENT_KEY)
                )
                assert unread.status_code == 415
                assert unread.headers["connection"] == "close"
                assert (await client.get("/healthz")).status_code == 200
            read = await client.post("/v1/verify", content=b"x" * 10, headers=auth(AGENT_KEY))
            assert read.status_code == 200
            assert "connection" not in read.headers  # the body was read: kept alive


async def test_http2_refusals_before_the_body_do_not_crash_the_server(keyring):
    """hypercorn 0.18's HTTP/2 dies (a KeyError out of serve) on body data for a stream whose
    response ended (pgjones/hypercorn#329); the guard ends such a stream only after its body."""
    pytest.importorskip("h2")
    routes = (
        *ROUTES,
        *(
            Route("POST", path, "agent", "an echo app's misbehaviour")
            for path in ("/refuse-unread", "/early-start", "/raises", "/unfinished")
        ),
    )
    big = b"x" * 300_000

    async def chunks():
        for _ in range(100):
            yield b"y" * 3000

    with trio.fail_after(60):
        async with (
            served(guarded(EchoApp(), keyring, Limits(max_body=100_000), routes=routes)) as url,
            httpx.AsyncClient(base_url=url, http1=False, http2=True) as client,
        ):
            unauthenticated = await client.post("/v1/runs", content=big)
            assert unauthenticated.http_version == "HTTP/2"
            assert_problem(unauthenticated, 401, "unauthorized")
            assert "connection" not in unauthenticated.headers  # not allowed in HTTP/2
            announced = await client.post("/v1/verify", content=big, headers=auth(AGENT_KEY))
            assert_problem(announced, 413, "body-too-large")
            streamed = await client.post("/v1/verify", content=chunks(), headers=auth(AGENT_KEY))
            assert_problem(streamed, 413, "body-too-large")
            unread = await client.post(
                "/refuse-unread", content=big[:90_000], headers=auth(AGENT_KEY)
            )
            assert unread.status_code == 415
            # Too late for a 413: the answer began; it ends (empty) once the body has.
            early = await client.post("/early-start", content=chunks(), headers=auth(AGENT_KEY))
            assert (early.status_code, early.content) == (200, b"")
            # The app's own failings, before its body was read: still no crash.
            unfinished = await client.post(
                "/unfinished", content=big[:90_000], headers=auth(AGENT_KEY)
            )
            assert (unfinished.status_code, unfinished.content) == (200, b"half")
            raised = await client.post("/raises", content=big[:90_000], headers=auth(AGENT_KEY))
            assert raised.status_code == 500  # hypercorn's answer to an app that raised
            read = await client.post("/v1/verify", content=b"x" * 10, headers=auth(AGENT_KEY))
            assert read.json()["read"] == 10
            assert (await client.get("/healthz")).status_code == 200


async def test_rate_limit_per_key(keyring):
    limits = Limits(rate=0.01, burst=2)
    with trio.fail_after(60):
        async with (
            served(guarded(EchoApp(), keyring, limits)) as url,
            httpx.AsyncClient(base_url=url) as client,
        ):
            for _ in range(2):
                ok = await client.get("/v1/runs", headers=auth(READER_KEY))
                assert ok.status_code == 200
            limited = await client.get("/v1/runs", headers=auth(READER_KEY))
            body = assert_problem(limited, 429, "rate-limited")
            retry_after = limited.headers["retry-after"]
            assert retry_after.isdigit()
            assert 1 <= int(retry_after) <= 100  # 1/rate at most, in whole seconds
            assert body["detail"].startswith(
                "key 'dashboard' is over its rate of 0.01 requests per second; retry after "
                f"{retry_after} s (the Retry-After header)"
            )
            other = await client.get("/v1/runs", headers=auth(AGENT_KEY))
            assert other.status_code == 200  # another key has its own bucket
            assert (await client.get("/healthz")).status_code == 200  # public: no bucket


async def test_request_timeout_and_streaming_exemption(keyring):
    app = EchoApp(hold_stream=True)
    limits = Limits(request_timeout=0.5)
    with trio.fail_after(60):
        async with served(guarded(app, keyring, limits, routes=SLOW_ROUTES)) as url:
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as client,
                trio.open_nursery() as nursery,
            ):
                streamed: list[httpx.Response] = []

                async def stream():
                    streamed.append(
                        await client.get("/v1/runs/r-1/stream", headers=auth(READER_KEY))
                    )

                nursery.start_soon(stream)
                await app.stream_started.wait()
                # Started after the stream, so when it times out the stream has outlived the
                # timeout too.
                slow = await client.post("/slow", headers=auth(AGENT_KEY))
                body = assert_problem(slow, 504, "timeout")
                assert "connection" not in slow.headers  # the body was read: kept alive
                assert body["detail"].startswith(
                    "the request took longer than this server's limit of 0.5 s and was cancelled"
                )
                app.stream_release.set()
            assert streamed[0].status_code == 200


async def test_websocket_handshake_is_guarded(keyring):
    wsproto = pytest.importorskip("wsproto")
    from wsproto.events import (
        AcceptConnection,
        BytesMessage,
        CloseConnection,
        RejectConnection,
        RejectData,
        Request,
    )

    accepted: list[str | None] = []

    async def ws_app(scope, receive, send):
        if scope["type"] != "websocket":
            return await EchoApp()(scope, receive, send)  # the lifespan
        await receive()
        await send({"type": "websocket.accept"})
        accepted.append(scope["interlock.principal"].name)
        while (await receive())["type"] != "websocket.disconnect":
            pass

    async def handshake(url, headers, frame: bytes | None = None, target="/v1/channel"):
        host, port = url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        await stream.send_all(ws.send(Request(host=host, target=target, extra_headers=headers)))
        events, body = [], b""
        while True:
            data = await stream.receive_some()
            ws.receive_data(data or None)
            for event in ws.events():
                events.append(event)
                if isinstance(event, RejectData):
                    body += event.data
                    if event.body_finished:
                        await stream.aclose()
                        return events, body
                if isinstance(event, AcceptConnection) and frame is not None:
                    await stream.send_all(ws.send(BytesMessage(data=frame)))
                    frame = None
                if isinstance(event, CloseConnection):
                    await stream.aclose()
                    return events, body
            if not data:
                await stream.aclose()
                return events, body

    with trio.fail_after(60):
        async with served(guarded(ws_app, keyring, Limits(max_body=100))) as url:
            events, body = await handshake(url, [])
            assert isinstance(events[0], RejectConnection)
            assert events[0].status_code == 401
            assert (
                msgspec.json.decode(body)["type"] == "https://interlock.dev/problems/unauthorized"
            )
            events, body = await handshake(
                url, [(b"authorization", f"Bearer {READER_KEY}".encode())]
            )
            assert events[0].status_code == 403
            events, body = await handshake(
                url, [(b"authorization", f"Bearer {READER_KEY}".encode())], target="/elsewhere"
            )
            assert events[0].status_code == 404  # a path the table does not name: refused
            assert msgspec.json.decode(body)["detail"] == (
                "there is no WebSocket endpoint at '/elsewhere'; connect to /v1/channel"
            )
            events, _ = await handshake(
                url, [(b"authorization", f"Bearer {AGENT_KEY}".encode())], frame=b"z" * 101
            )
            assert isinstance(events[0], AcceptConnection)
            closes = [e for e in events if isinstance(e, CloseConnection)]
            assert closes
            assert closes[0].code == 1009
    assert accepted == ["billing"]


# ---- fuzzing: random headers and bodies never give a 5xx -----------------------------------


class Escapes:
    """Wraps an ASGI app and keeps every exception that escapes it."""

    def __init__(self, app) -> None:
        self.app = app
        self.errors: list[BaseException] = []

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            self.errors.append(exc)
            raise


@pytest.fixture(scope="module")
def threaded_server():
    """The guard over EchoApp, served by hypercorn on trio in a thread, for sync hypothesis tests."""
    ring = KeyRing.from_env({"INTERLOCK_API_KEY": AGENT_KEY})
    app = Escapes(guarded(EchoApp(), ring, Limits(max_body=4096, rate=None)))
    ready: list[str] = []
    started = threading.Event()
    token: list[trio.lowlevel.TrioToken] = []
    stop: list[trio.Event] = []

    async def main():
        stop.append(trio.Event())
        token.append(trio.lowlevel.current_trio_token())
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.errorlog = None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: serve(
                    app, config, shutdown_trigger=stop[0].wait, task_status=task_status
                )
            )
            ready.append(binds[0])
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(60), "the server did not start"
    with (
        httpx.Client(base_url=ready[0], timeout=30) as http1,
        httpx.Client(base_url=ready[0], timeout=30, http1=False, http2=True) as http2,
    ):
        yield {"HTTP/1.1": http1, "HTTP/2": http2}, app.errors
    trio.from_thread.run_sync(stop[0].set, trio_token=token[0])
    thread.join(60)


header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=80
)
paths = st.sampled_from(
    [r.path.replace("{id}", "r-1") for r in ROUTES if not r.path.startswith("/v1/channel")]
    + ["/", "/v1/runs/", "/nope"]
)
paths = paths | st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#%"), max_size=30
).map(lambda t: "/v1/runs/" + t)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]),
    path=paths,
    authorization=st.one_of(
        st.none(),
        header_text,
        header_text.map(lambda t: "Bearer " + t),
        st.just(f"Bearer {AGENT_KEY}"),
    ),
    body=st.binary(max_size=6000),
)
@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/2"])
def test_random_headers_and_bodies_never_give_a_5xx(
    threaded_server, version, method, path, authorization, body
):
    headers = {}
    if authorization is not None:  # h11 refuses to send a value with surrounding whitespace
        headers[b"authorization"] = authorization.strip(" \t").encode("latin-1")
    clients, escaped = threaded_server
    response = clients[version].request(method, path, headers=headers, content=body)
    assert response.http_version == version
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert response.headers["content-type"] == "application/problem+json"
        assert AGENT_KEY not in response.text
    assert escaped == []
