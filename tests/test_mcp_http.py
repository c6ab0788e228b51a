"""``interlock mcp --http`` against real parts: the proxy started as a process
(``interlock mcp --http 0 ... -- python -m mcp_server_time``), the official ``mcp`` SDK's
clients over Streamable HTTP as the agents (``ClientSession`` over
``streamable_http_client``, which speaks 2025-11-25 with a session, and ``mcp.Client``,
which speaks 2026-07-28, stateless), and junk from httpx.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

mcp = pytest.importorskip("mcp", reason="the [mcp] extra (the official MCP SDK) is missing")
pytest.importorskip("hypercorn", reason="the [gateway] extra (hypercorn) is missing")

import httpx  # noqa: E402
import httpx2  # noqa: E402
from mcp import Client, ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from interlock.events import IntentRecorded, ToolCommitted  # noqa: E402
from interlock.stores import open_sqlite_store  # noqa: E402
from tests.test_mcp_proxy import CLOCK_MACHINE, TIME_APP, _time_server  # noqa: E402

# NOTE: the SDK's HTTP client leaves httpx2's body iterators (PoolByteStream.__aiter__,
# Response.aiter_bytes) of a 2025-11-25 session's GET stream to the garbage collector when
# the session closes: trio warns, in this process (the clients), not in the proxy under
# test, which is a process of its own.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object :pytest.PytestUnraisableExceptionWarning"
)

KEY_META = "dev.interlock/idempotency-key"
RUN_META = "dev.interlock/run"
MINTED = re.compile(r"mcp-[0-9a-f]{32}-1")


class Proxy:
    def __init__(self, process: subprocess.Popen[bytes], url: str, db: Path, log: Path) -> None:
        self.process = process
        self.url = url
        self.db = db
        self.log = log


def _start(tmp_path: Path, log: Path, *machine: str, env: dict[str, str] | None = None) -> Proxy:
    """``interlock mcp --http 0`` in front of mcp-server-time; its URL from its stderr."""
    (tmp_path / "clock.py").write_text(TIME_APP)
    db = tmp_path / "mcp.db"
    machine = machine or ("--app", "clock.py:app")
    argv = [sys.executable, "-m", "interlock", "mcp", "--http", "0", *machine]
    with log.open("wb") as err:
        process = subprocess.Popen(
            [*argv, "--db", str(db), "--", *_time_server()],
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **(env or {})},
        )
    try:
        return Proxy(process, _wait_for_url(process, log), db, log)
    except BaseException:
        process.kill()
        process.wait()
        raise


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Proxy]:
    """The proxy, stopped by SIGTERM at the end, which it must survive cleanly (exit 0)."""
    started = _start(tmp_path, tmp_path / "proxy.log")
    try:
        yield started
        if started.process.poll() is None:  # (not killed by the test)
            started.process.send_signal(signal.SIGTERM)
            assert started.process.wait(timeout=30) == 0, started.log.read_text()
        assert "Traceback" not in started.log.read_text(), started.log.read_text()
    finally:
        if started.process.poll() is None:
            started.process.kill()
            started.process.wait()


def _wait_for_url(process: subprocess.Popen[bytes], log: Path) -> str:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"serving (http://\S+/mcp)", log.read_text())
        if found:
            return found[1]
        if process.poll() is not None:
            pytest.fail(f"the proxy exited {process.returncode}: {log.read_text()}")
        time.sleep(0.05)
    pytest.fail(f"the proxy printed no URL: {log.read_text()}")


async def _events(db: Path, run_id: str) -> list[Any]:
    store = await open_sqlite_store(str(db), readonly=True)
    try:
        return await store.load(run_id)
    finally:
        await store.aclose()


async def test_a_2025_11_25_session_is_one_run_gated_and_keyed(proxy: Proxy) -> None:
    async with (
        streamable_http_client(proxy.url) as (read, write, *_),
        ClientSession(read, write) as client,
    ):
        init = await client.initialize()
        assert init.protocol_version == "2025-11-25"
        listed = await client.list_tools()
        # the upstream has convert_time too; the state allows only get_current_time
        assert [t.name for t in listed.tools] == ["get_current_time"]
        assert listed.tools[0].input_schema["required"] == ["timezone"]

        rejected = await client.call_tool("get_current_time", {"timezone": "Europe/Paris"})
        assert rejected.is_error
        assert (
            rejected.content[0].text
            == "args.timezone: 'Europe/Paris' is not UTC; ask for timezone UTC"
        )
        assert rejected.structured_content["violations"][0]["code"] == "guard"
        run_id = rejected.meta[RUN_META]
        assert MINTED.fullmatch(run_id), run_id

        not_here = await client.call_tool("convert_time", {})
        assert not_here.is_error
        assert not_here.structured_content["violations"][0]["code"] == "tool_not_allowed"

        ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not ok.is_error, ok
        assert '"timezone": "UTC"' in ok.content[0].text
        # the session id maps to its run: no handle was sent back, the same run answered
        assert ok.meta[RUN_META] == run_id
        key = ok.meta[KEY_META]
        assert key.startswith(run_id + ":")
        assert (await client.list_tools()).meta[RUN_META] == run_id

    events = await _events(proxy.db, run_id)
    intents = [e for e in events if isinstance(e, IntentRecorded)]
    commits = [e for e in events if isinstance(e, ToolCommitted)]
    assert [(i.tool, i.key) for i in intents] == [("get_current_time", key)]
    assert [c.key for c in commits] == [key]
    assert commits[0].seq > intents[0].seq  # the intent was durable before the call went out


async def test_a_2026_07_28_client_gets_a_handle_and_addresses_its_run_with_it(
    proxy: Proxy,
) -> None:
    async with Client(proxy.url) as client:
        assert client.protocol_version == "2026-07-28"
        # no run yet: the listing is what a new run allows, and names no run
        listed = await client.list_tools()
        assert [t.name for t in listed.tools] == ["get_current_time"]
        assert RUN_META not in (listed.meta or {})

        rejected = await client.call_tool("get_current_time", {"timezone": "Asia/Tokyo"})
        assert rejected.is_error
        assert rejected.structured_content["violations"][0]["code"] == "guard"
        run_id = rejected.meta[RUN_META]  # minted on the first call
        assert MINTED.fullmatch(run_id), run_id

        # sent back in _meta: the same run
        ok = await client.call_tool(
            "get_current_time", {"timezone": "UTC"}, meta={RUN_META: run_id}
        )
        assert not ok.is_error, ok
        assert ok.meta[RUN_META] == run_id
        first_key = ok.meta[KEY_META]
        assert first_key.startswith(run_id + ":")
        assert (await client.list_tools(meta={RUN_META: run_id})).meta[RUN_META] == run_id

        # not sent back: a stateless request is a new run
        other = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not other.is_error, other
        assert MINTED.fullmatch(other.meta[RUN_META])
        assert other.meta[RUN_META] != run_id

        # a session id is the handshake era's: on a 2026-07-28 request it names nothing
        async with (
            httpx2.AsyncClient(headers={"Mcp-Session-Id": "x" * 32}) as http,
            Client(streamable_http_client(proxy.url, http_client=http)) as forged,
        ):
            ours = await forged.call_tool("get_current_time", {"timezone": "UTC"})
            theirs = await forged.call_tool("get_current_time", {"timezone": "UTC"})
            assert ours.meta[RUN_META] != theirs.meta[RUN_META]

        # a run id nobody minted is refused, not started
        with pytest.raises(mcp.shared.exceptions.MCPError, match="no run 'mcp-nope-1'"):
            await client.call_tool(
                "get_current_time", {"timezone": "UTC"}, meta={RUN_META: "mcp-nope-1"}
            )

    # the Interlock-Run header addresses the run as the _meta key does
    async with (
        httpx2.AsyncClient(headers={"Interlock-Run": run_id}) as http,
        Client(streamable_http_client(proxy.url, http_client=http)) as client,
    ):
        assert client.protocol_version == "2026-07-28"
        again = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not again.is_error, again
        assert again.meta[RUN_META] == run_id
        second_key = again.meta[KEY_META]
        assert second_key != first_key

    events = await _events(proxy.db, run_id)
    commits = [e.key for e in events if isinstance(e, ToolCommitted)]
    assert commits == [first_key, second_key]


async def test_two_clients_get_two_runs(proxy: Proxy) -> None:
    runs: dict[str, str] = {}

    async def legacy(name: str) -> None:
        async with (
            streamable_http_client(proxy.url) as (read, write, *_),
            ClientSession(read, write) as client,
        ):
            await client.initialize()
            results: list[Any] = []

            async def call() -> None:
                results.append(await client.call_tool("get_current_time", {"timezone": "UTC"}))

            async with trio.open_nursery() as calls:  # the session's first calls at once
                calls.start_soon(call)
                calls.start_soon(call)
            assert not any(r.is_error for r in results), results
            assert results[0].meta[RUN_META] == results[1].meta[RUN_META]
            runs[name] = results[0].meta[RUN_META]

    async def modern(name: str) -> None:
        async with Client(proxy.url) as client:
            result = await client.call_tool("get_current_time", {"timezone": "UTC"})
            assert not result.is_error
            runs[name] = result.meta[RUN_META]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(legacy, "a")
        nursery.start_soon(legacy, "b")
        nursery.start_soon(modern, "c")
        nursery.start_soon(modern, "d")
    assert len(set(runs.values())) == 4, runs
    assert all(MINTED.fullmatch(r) for r in runs.values()), runs

    # Ctrl-C stops it as SIGTERM does: the requests in flight finish, then it exits 0
    proxy.process.send_signal(signal.SIGINT)
    assert await trio.to_thread.run_sync(lambda: proxy.process.wait(timeout=30)) == 0
    assert proxy.log.read_text().endswith("interlock mcp: stopped\n"), proxy.log.read_text()


async def test_a_run_named_after_the_proxy_restarted_goes_on_from_its_journal(
    proxy: Proxy, tmp_path: Path
) -> None:
    async with Client(proxy.url) as client:
        first = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not first.is_error, first
    run_id = first.meta[RUN_META]
    # a read-only call is answered before its commit is written (a crash may lose it: the
    # call is made again); what is asserted here is that the journal carries on, so the
    # kill waits for the first commit to be on disk
    with trio.fail_after(30):
        while not any(isinstance(e, ToolCommitted) for e in await _events(proxy.db, run_id)):  # noqa: ASYNC110
            await trio.sleep(0.05)
    proxy.process.kill()  # SIGKILL: no goodbye
    proxy.process.wait()
    again = _start(tmp_path, tmp_path / "proxy2.log")
    try:
        async with Client(again.url) as client:
            second = await client.call_tool(
                "get_current_time", {"timezone": "UTC"}, meta={RUN_META: run_id}
            )
            assert not second.is_error, second
            assert second.meta[RUN_META] == run_id
            rejected = await client.call_tool(
                "get_current_time", {"timezone": "Asia/Tokyo"}, meta={RUN_META: run_id}
            )
            assert rejected.meta[RUN_META] == run_id
    finally:
        again.process.send_signal(signal.SIGTERM)
        assert again.process.wait(timeout=30) == 0, again.log.read_text()
    assert "Traceback" not in again.log.read_text(), again.log.read_text()
    events = await _events(proxy.db, run_id)
    commits = [e.key for e in events if isinstance(e, ToolCommitted)]
    assert commits == [first.meta[KEY_META], second.meta[KEY_META]]


async def test_the_runs_held_at_once_are_bounded(tmp_path: Path) -> None:
    """In process: serve_http's own API, and a client that never sends its run back
    cannot make the proxy hold runs without end."""
    from interlock.mcp import Upstream, serve_http
    from interlock.stores import open_store

    app: dict[str, Any] = {}
    exec(TIME_APP, app)
    store = await open_store(str(tmp_path / "cap.db"))
    try:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(
                    serve_http,
                    app["machine"],
                    Upstream(_time_server()),
                    store,
                    max_runs=2,
                )
            )
            assert server.url.startswith("http://127.0.0.1:")
            async with Client(server.url) as client:
                runs = set()
                for _ in range(2):
                    result = await client.call_tool("get_current_time", {"timezone": "UTC"})
                    runs.add(result.meta[RUN_META])
                assert len(runs) == 2
                with pytest.raises(mcp.shared.exceptions.MCPError, match="holds 2 runs"):
                    await client.call_tool("get_current_time", {"timezone": "UTC"})
                # the runs held go on
                for run_id in runs:
                    result = await client.call_tool(
                        "get_current_time", {"timezone": "UTC"}, meta={RUN_META: run_id}
                    )
                    assert not result.is_error, result
            server.stop()
    finally:
        await store.aclose()


MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {},
}


def _rpc(method: str, params: Any = None, **extra: Any) -> bytes:
    return json.dumps(
        {"jsonrpc": "2.0", "id": 1, "method": method, "params": params, **extra}
    ).encode()


def _junk() -> list[tuple[str, str, dict[str, str], bytes | str]]:
    json_ct = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    modern = {**json_ct, "MCP-Protocol-Version": "2026-07-28"}
    call = {"name": "get_current_time", "arguments": {"timezone": "UTC"}}
    big = b"[" + b" " * (10 * 1024 * 1024) + b"]"
    return [
        ("not JSON", "POST", json_ct, b"{nope"),
        ("not JSON, 2026", "POST", modern, b"{nope"),
        ("bytes", "POST", json_ct, bytes(range(256)) * 16),
        ("JSON, not JSON-RPC", "POST", json_ct, b'{"hello": 1}'),
        ("JSON, not JSON-RPC, 2026", "POST", modern, b"[1, 2, 3]"),
        ("deep nesting, 2026", "POST", modern, b"[" * 100_000 + b"]" * 100_000),
        ("a call before initialize", "POST", json_ct, _rpc("tools/call", call)),
        ("no such method", "POST", json_ct, _rpc("nope/nope", {})),
        (
            "no such method, 2026",
            "POST",
            {**modern, "Mcp-Method": "nope/nope"},
            _rpc("nope/nope", {"_meta": MODERN_META}),
        ),
        (
            "mismatched Mcp-Method, 2026",
            "POST",
            {**modern, "Mcp-Method": "tools/list"},
            _rpc("tools/call", {**call, "_meta": MODERN_META}),
        ),
        (
            "params not an object, 2026",
            "POST",
            {**modern, "Mcp-Method": "tools/call"},
            _rpc("tools/call", [1]),
        ),
        (
            "unknown tool, 2026",
            "POST",
            {**modern, "Mcp-Method": "tools/call", "Mcp-Name": "zzz"},
            _rpc("tools/call", {"name": "zzz", "_meta": MODERN_META}),
        ),
        (
            "a run id that is not a string, 2026",
            "POST",
            {**modern, "Mcp-Method": "tools/call", "Mcp-Name": "get_current_time"},
            _rpc("tools/call", {**call, "_meta": {**MODERN_META, RUN_META: {"x": 1}}}),
        ),
        (
            "an unknown run in the header, 2026",
            "POST",
            {
                **modern,
                "Mcp-Method": "tools/call",
                "Mcp-Name": "get_current_time",
                "Interlock-Run": "mcp-" + "0" * 32 + "-1",
            },
            _rpc("tools/call", {**call, "_meta": MODERN_META}),
        ),
        (
            "a huge run id, 2026",
            "POST",
            {**modern, "Mcp-Method": "tools/list"},
            _rpc("tools/list", {"_meta": {**MODERN_META, RUN_META: "x" * 100_000}}),
        ),
        (
            "an unknown protocol version",
            "POST",
            {**json_ct, "MCP-Protocol-Version": "1999-01-01"},
            _rpc("ping"),
        ),
        ("a 10 MB body", "POST", json_ct, big),
        ("a 10 MB body, 2026", "POST", modern, big),
        ("text/plain", "POST", {**json_ct, "Content-Type": "text/plain"}, _rpc("ping")),
        ("text/plain, 2026", "POST", {**modern, "Content-Type": "text/plain"}, _rpc("ping")),
        ("no Accept", "POST", {"Content-Type": "application/json"}, _rpc("ping")),
        ("an unknown session", "POST", {**json_ct, "Mcp-Session-Id": "nope"}, _rpc("ping")),
        ("another host (DNS rebinding)", "POST", {**json_ct, "Host": "evil.example"}, _rpc("ping")),
        ("PUT", "PUT", json_ct, b"{}"),
        ("GET without a session", "GET", {"Accept": "text/event-stream"}, b""),
        ("DELETE without a session", "DELETE", {}, b""),
    ]


async def test_junk_gets_4xx_and_the_proxy_answers_a_real_client_after(proxy: Proxy) -> None:
    answers = []

    def post_all() -> None:
        with httpx.Client(timeout=60) as http:
            for name, method, headers, body in _junk():
                try:
                    response = http.request(method, proxy.url, headers=headers, content=body)
                except httpx.RemoteProtocolError as exc:
                    raise AssertionError(f"{name}: {exc}") from exc
                answers.append((name, response.status_code, response.text[:300]))
            response = http.post(proxy.url.replace("/mcp", "/other"), content=b"{}")
            answers.append(("another path", response.status_code, response.text[:300]))

    await trio.to_thread.run_sync(post_all)
    for name, status, text in answers:
        assert 400 <= status < 500, (name, status, text)
    statuses = {name: status for name, status, _ in answers}
    assert statuses["a 10 MB body"] == statuses["a 10 MB body, 2026"] == 413
    assert statuses["another host (DNS rebinding)"] == 421
    texts = {name: text for name, _, text in answers}
    assert '"code":-32700' in texts["not JSON"]  # the spec's parse error
    assert '"code":-32601' in texts["no such method, 2026"]
    assert "unknown tool 'zzz'" in texts["unknown tool, 2026"]
    assert "no run 'mcp-0000" in texts["an unknown run in the header, 2026"]

    async with Client(proxy.url) as client:
        ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not ok.is_error, ok
    async with (
        streamable_http_client(proxy.url) as (read, write, *_),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not ok.is_error, ok


def test_a_bad_http_address_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "clock.py").write_text(TIME_APP)
    cases = [
        (["--http", "nope"], "--http takes [HOST:]PORT"),
        (["--http", "0", "--session", "s"], "--session names the one session"),
    ]
    for extra, expected in cases:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "interlock",
                "mcp",
                "--app",
                "clock.py:app",
                *extra,
                "--",
                "true",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ),
        )
        assert done.returncode == 2, (extra, done.stderr)
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("interlock: error: "), (extra, done.stderr)
        assert expected in last, (extra, done.stderr)


STAGES = """
from interlock import Machine, Tool, Worker

async def never(args, ctx):
    raise AssertionError("the proxy's upstream executes the tools")

machine = Machine(
    "stages", "ASK",
    {"ASK": Worker(next=["CONVERT"], tools=["get_current_time"]),
     "CONVERT": Worker(next=["COMPLETED"], tools=["convert_time"])},
    tools=[Tool("get_current_time", never, {"type": "object"}, read_only=True),
           Tool("convert_time", never, {"type": "object"}, read_only=True)],
)
"""


async def test_a_session_hears_its_run_move_and_a_stateless_client_lists_it_by_handle(
    tmp_path: Path,
) -> None:
    """A machine with a transition tool (as a machine file gives), served in process:
    a 2025-11-25 session gets tools/list_changed when its run moves; a 2026-07-28 client
    lists the run it names, and hears it move on a subscriptions/listen stream."""
    import mcp.types as types

    from interlock.mcp import Upstream, serve_http
    from interlock.mcp._proxy import NoRules
    from interlock.stores import open_store

    app: dict[str, Any] = {}
    exec(STAGES, app)

    class Rules(NoRules):
        transition_tool = "move"

    def build(tools: list[Any]) -> tuple[Any, Any]:
        return app["machine"], Rules()

    heard: list[Any] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            heard.append(message)

    store = await open_store(str(tmp_path / "stages.db"))
    try:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_http, build, Upstream(_time_server()), store)
            )
            async with (
                streamable_http_client(server.url) as (read, write, *_),
                ClientSession(read, write, message_handler=on_message) as client,
            ):
                await client.initialize()
                listed = await client.list_tools()
                assert [t.name for t in listed.tools] == ["get_current_time", "move"]
                moved = await client.call_tool("move", {"to": "CONVERT"})
                assert not moved.is_error, moved
                with trio.fail_after(10):
                    while not heard:  # noqa: ASYNC110 - the notification comes on the GET stream
                        await trio.sleep(0.02)
                listed = await client.list_tools()
                assert [t.name for t in listed.tools] == ["convert_time", "move"]
                assert listed.meta[RUN_META] == moved.meta[RUN_META]
                assert len(heard) == 1  # once per move, not once per request made

            async with Client(server.url) as client:
                moved = await client.call_tool("move", {"to": "CONVERT"})
                assert not moved.is_error, moved
                run_id = moved.meta[RUN_META]
                listed = await client.list_tools(meta={RUN_META: run_id})
                assert [t.name for t in listed.tools] == ["convert_time", "move"]
                fresh = await client.list_tools()
                assert [t.name for t in fresh.tools] == ["get_current_time", "move"]

            # a 2026-07-28 client hears its run move on a subscriptions/listen stream, the
            # run named by the Interlock-Run header (the SDK's listen sends no _meta)
            from mcp.server.subscriptions import ToolsListChanged

            async with Client(server.url) as client:
                first = await client.call_tool("move", {"to": "CONVERT"})
                run_id = first.meta[RUN_META]
            async with (
                httpx2.AsyncClient(headers={"interlock-run": run_id}) as http,
                Client(streamable_http_client(server.url, http_client=http)) as client,
            ):
                async with client.listen(tools_list_changed=True) as changes:
                    done = await client.call_tool("move", {"to": "COMPLETED"})
                    assert not done.is_error, done
                    with trio.fail_after(10):
                        event = await changes.__anext__()
                    assert isinstance(event, ToolsListChanged)
                listed = await client.list_tools()
                assert listed.tools == []  # the run completed: nothing more to call
            server.stop()
    finally:
        await store.aclose()


@pytest.mark.parametrize("era", ["2025-11-25", "2026-07-28"])
async def test_approval_over_http_asks_the_user_and_starts_no_run_until_approved(
    tmp_path: Path, era: str
) -> None:
    """A machine file's ``approval = true`` over HTTP: mid-call elicitation on a
    2025-11-25 session, input-required rounds for 2026-07-28; a call that names no run
    starts one only once approved."""
    from mcp.types import ElicitResult

    (tmp_path / "clock.toml").write_text(CLOCK_MACHINE)
    proxy = _start(tmp_path, tmp_path / "proxy.log", "--machine", "clock.toml")
    asked: list[str] = []
    answers = iter([True, False])

    async def on_elicit(ctx: Any, request: Any) -> Any:
        asked.append(request.message)
        return ElicitResult(action="accept", content={"approve": next(answers)})

    try:
        if era == "2025-11-25":
            async with (
                streamable_http_client(proxy.url) as (read, write, *_),
                ClientSession(read, write, elicitation_callback=on_elicit) as client,
            ):
                assert (await client.initialize()).protocol_version == era
                approved = await client.call_tool("get_current_time", {"timezone": "UTC"})
                refused = await client.call_tool("get_current_time", {"timezone": "UTC"})
        else:
            async with Client(proxy.url, elicitation_callback=on_elicit) as client:
                assert client.protocol_version == era
                approved = await client.call_tool("get_current_time", {"timezone": "UTC"})
                run_id = approved.meta[RUN_META]
                refused = await client.call_tool(
                    "get_current_time", {"timezone": "UTC"}, meta={RUN_META: run_id}
                )
        assert not approved.is_error, approved
        assert refused.is_error
        assert refused.structured_content == {
            "approved": False,
            "reason": "the user did not approve it (accept)",
        }
        assert len(asked) == 2
        assert asked[0].endswith('{"timezone": "UTC"}')
    finally:
        proxy.process.send_signal(signal.SIGTERM)
        assert proxy.process.wait(timeout=30) == 0, proxy.log.read_text()
    store = await open_sqlite_store(str(proxy.db), readonly=True)
    try:
        runs = await store.list_runs()
        assert [r.run_id for r in runs] == [approved.meta[RUN_META]]  # no run per round
        events = await store.load(runs[0].run_id)
    finally:
        await store.aclose()
    assert len([e for e in events if isinstance(e, ToolCommitted)]) == 1


_METHODS = [
    "initialize",
    "notifications/initialized",
    "tools/list",
    "tools/call",
    "ping",
    "server/discover",
    "subscriptions/listen",
    "resources/list",
    "prompts/get",
    "completion/complete",
    "logging/setLevel",
    "notifications/cancelled",
]
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
_params = st.one_of(
    _json,
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["get_current_time", "convert_time", "zzz", ""])
            | st.text(max_size=8)
        },
        optional={
            "arguments": _json,
            "_meta": st.dictionaries(
                st.sampled_from(
                    ["dev.interlock/run", "io.modelcontextprotocol/protocolVersion", "x"]
                ),
                _json,
                max_size=2,
            ),
        },
    ),
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "jsonrpc": st.sampled_from(["2.0", "1.0", ""]) | _json,
        "id": st.integers() | st.text(max_size=8) | st.none() | _json,
        "method": st.sampled_from(_METHODS) | st.text(max_size=12),
        "params": _params,
    },
)
_headers = st.fixed_dictionaries(
    {
        "Content-Type": st.sampled_from(
            ["application/json", "text/plain", "application/json; charset=latin-1"]
        )
    },
    optional={
        "Accept": st.sampled_from(["application/json, text/event-stream", "text/html", "*/*"]),
        "MCP-Protocol-Version": st.sampled_from(["2026-07-28", "2025-11-25", "1999-01-01", "x"]),
        "Interlock-Run": st.sampled_from(["mcp-" + "0" * 32 + "-1", "", "../../etc"])
        | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
        "Mcp-Session-Id": st.text(alphabet="abcdef0123456789", max_size=32),
    },
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    messages=st.lists(
        st.one_of(_message, st.lists(_message, min_size=1, max_size=3)), min_size=1, max_size=3
    ),
    headers=_headers,
)
def test_no_client_mistake_makes_the_http_proxy_answer_5xx(
    proxy: Proxy, messages: list[Any], headers: dict[str, str]
) -> None:
    """A fuzzing pass over the HTTP transport: JSON-RPC messages and batches with any
    method, id, params and _meta, under any of the headers a client sends; the proxy
    answers each below 500 (the fixture checks its log has no traceback at the end)."""
    with httpx.Client(timeout=60) as http:
        for message in messages:
            response = http.post(proxy.url, headers=headers, content=json.dumps(message).encode())
            assert response.status_code < 500, (
                message,
                headers,
                response.status_code,
                response.text[:500],
            )
    assert proxy.process.poll() is None


async def test_a_call_that_names_a_key_twice_is_refused_by_the_gate_and_journaled(
    proxy: Proxy,
) -> None:
    """Over HTTP, as over stdio, the body is read exactly before the SDK's reader (which
    would keep the last value): the gate refuses the call as written, and the journal
    holds the refusal; a key named twice elsewhere than the arguments is refused too."""
    envelope = json.dumps(MODERN_META).encode()
    twice = (
        b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": '
        b'"get_current_time", "arguments": {"timezone": "Asia/Tokyo", "timezone": "UTC"}, '
        b'"_meta": ' + envelope + b"}}"
    )
    elsewhere = (
        b'{"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"name": '
        b'"convert_time", "name": "get_current_time", "arguments": {"timezone": "UTC"}, '
        b'"_meta": ' + envelope + b"}}"
    )
    headers = {
        "content-type": "application/json",
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": "2026-07-28",
        "mcp-method": "tools/call",
        "mcp-name": "get_current_time",
    }

    def post() -> list[Any]:
        with httpx.Client(timeout=60) as http:
            return [http.post(proxy.url, headers=headers, content=b) for b in (twice, elsewhere)]

    first, second = await trio.to_thread.run_sync(post)
    assert first.status_code == 200, first.text
    result = first.json()["result"]
    assert result["isError"] is True
    (violation,) = result["structuredContent"]["violations"]
    assert (violation["code"], violation["path"]) == ("malformed", "args.timezone")
    run_id = result["_meta"][RUN_META]
    rejected = [
        e for e in await _events(proxy.db, run_id) if type(e).__name__ == "ProposalRejected"
    ]
    assert [v.code for e in rejected for v in e.violations] == ["malformed"]
    assert second.status_code == 200, second.text
    refused = second.json()["result"]
    assert refused["isError"] is True
    assert refused["structuredContent"]["violations"][0]["path"] == "name"
    assert not [e for e in await _events(proxy.db, run_id) if isinstance(e, IntentRecorded)]


async def test_with_a_token_a_request_without_it_is_answered_401(tmp_path: Path) -> None:
    """INTERLOCK_MCP_TOKEN set: only requests with 'Authorization: Bearer TOKEN' reach
    the proxy; a real client configured with the header is served."""
    token = "s3cret-token"
    started = _start(tmp_path, tmp_path / "proxy.log", env={"INTERLOCK_MCP_TOKEN": token})
    try:

        def post(headers: dict[str, str]) -> httpx.Response:
            with httpx.Client(timeout=60) as http:
                return http.post(
                    started.url,
                    headers={"content-type": "application/json", **headers},
                    content=_rpc("tools/list"),
                )

        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": token}):
            denied = await trio.to_thread.run_sync(post, headers)
            assert denied.status_code == 401, (headers, denied.text)
            assert "Authorization: Bearer TOKEN" in denied.json()["error"]["message"]
            assert denied.headers["www-authenticate"].startswith("Bearer")
        async with (
            httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}) as http,
            Client(streamable_http_client(started.url, http_client=http)) as client,
        ):
            ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
            assert not ok.is_error, ok
    finally:
        started.process.send_signal(signal.SIGTERM)
        assert started.process.wait(timeout=30) == 0
    assert "Traceback" not in started.log.read_text()


SLOW_SERVER = """
import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("slow")

@server.tool()
async def wait(seconds: float) -> str:
    await anyio.sleep(seconds)
    return f"waited {seconds}"

@server.tool()
async def fail() -> str:
    raise RuntimeError("the tool broke")

@server.tool()
async def ping() -> str:
    return "pong"

server.run("stdio")
"""

SLOW_APP = """
from interlock import App, BreakerPolicy, Machine, Tool, Worker

async def never(args, ctx):
    raise AssertionError("the proxy's upstream executes the tools")

machine = Machine(
    "slow", "GO", {"GO": Worker(next=["COMPLETED"], tools=["wait", "fail", "ping"])},
    tools=[Tool("wait", never, {"type": "object"}, read_only=True, timeout=2.0),
           Tool("fail", never, {"type": "object"}),
           Tool("ping", never, {"type": "object"}, read_only=True)],
    breakers=BreakerPolicy(consecutive_failures=2, repeats=100),
)
"""


async def test_a_fault_in_one_run_leaves_the_others_alone(tmp_path: Path) -> None:
    """One upstream connection serves every run over HTTP: a run whose call hangs past its
    timeout, and a run whose tool keeps failing until its breaker escalates it, neither
    holds up nor changes another run, which calls on meanwhile and completes."""
    from interlock.mcp import Upstream, serve_http
    from interlock.stores import open_store

    (tmp_path / "slow_server.py").write_text(SLOW_SERVER)
    app: dict[str, Any] = {}
    exec(SLOW_APP, app)
    store = await open_store(str(tmp_path / "slow.db"))
    upstream = Upstream([sys.executable, str(tmp_path / "slow_server.py")])
    outcomes: dict[str, Any] = {}
    try:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(serve_http, app["machine"], upstream, store))

            async def hanging(started: trio.Event) -> None:
                async with Client(server.url) as client:
                    started.set()
                    outcomes["hung"] = await client.call_tool("wait", {"seconds": 30})

            async def failing() -> None:
                async with Client(server.url) as client:
                    first = await client.call_tool("fail", {})
                    meta = {RUN_META: first.meta[RUN_META]}
                    second = await client.call_tool("fail", {}, meta=meta)
                    third = await client.call_tool("ping", {}, meta=meta)
                    outcomes["failing"] = (first, second, third)

            started = trio.Event()
            nursery.start_soon(hanging, started)
            await started.wait()
            nursery.start_soon(failing)
            async with Client(server.url) as client:
                pings = []
                for _ in range(5):
                    meta = {RUN_META: pings[-1].meta[RUN_META]} if pings else None
                    pings.append(await client.call_tool("ping", {}, meta=meta))
                assert "hung" not in outcomes  # the other run's call is still in flight
            with trio.fail_after(60):
                while len(outcomes) < 2:  # noqa: ASYNC110 - both finish on their own
                    await trio.sleep(0.05)
            server.stop()
    finally:
        await store.aclose()
    assert all(not p.is_error and "pong" in p.content[0].text for p in pings), pings
    assert len({p.meta[RUN_META] for p in pings}) == 1
    hung = outcomes["hung"]
    assert hung.is_error  # timed out after 2 s: a read-only call, handed back
    assert "did not answer within 2 s" in hung.content[0].text, hung
    first, second, third = outcomes["failing"]
    assert first.is_error
    assert second.is_error
    assert third.structured_content["outcome"] == "escalated", third  # its breaker, its run
    reader = await open_store(str(tmp_path / "slow.db"), readonly=True)
    try:
        records = {r.run_id: r for r in await reader.list_runs()}
    finally:
        await reader.aclose()
    assert records[pings[0].meta[RUN_META]].outcome == "running"
    assert records[first.meta[RUN_META]].outcome == "escalated"
    assert records[hung.meta[RUN_META]].outcome == "running"
