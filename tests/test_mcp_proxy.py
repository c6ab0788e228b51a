"""``interlock mcp`` against real parts: the official ``mcp`` SDK's client as the agent,
over stdio, and real upstream servers from the registries (``mcp-server-time`` from PyPI,
``@modelcontextprotocol/server-filesystem`` and ``server-memory`` from npm, which
``.ci/run`` installs into its cache). Processes are real and killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

mcp = pytest.importorskip("mcp", reason="the [mcp] extra (the official MCP SDK) is missing")

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

from interlock import replay  # noqa: E402
from interlock.events import IntentRecorded, ToolCommitted  # noqa: E402
from interlock.stores import open_sqlite_store  # noqa: E402

NPM = Path(os.environ.get("INTERLOCK_CI_NPM", Path.home() / ".cache/interlock-ci/npm"))
KEY_META = "dev.interlock/idempotency-key"


def _npm_server(name: str) -> Path:
    entry = NPM / "node_modules" / "@modelcontextprotocol" / name / "dist" / "index.js"
    if not entry.exists() or shutil.which("node") is None:
        what = f"@modelcontextprotocol/{name} (npm) under {NPM}"
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing in CI; .ci/run installs it")
        pytest.skip(f"{what} is not installed (.ci/run installs it); CI runs this test")
    return entry


def _proxy(
    tmp: Path,
    app: str,
    *upstream: str,
    session: str = "s",
    options: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> StdioServerParameters:
    """``interlock mcp --app APP`` (and ``options``) in ``tmp``, journaling into
    ``tmp/mcp.db``, in this environment or ``env``."""
    return StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "interlock",
            "mcp",
            "--app",
            app,
            "--db",
            str(tmp / "mcp.db"),
            "--session",
            session,
            *options,
            "--",
            *upstream,
        ],
        env=dict(os.environ) if env is None else env,
        cwd=str(tmp),
    )


def _file_proxy(
    tmp: Path, machine: str, db: str, *upstream: str, **env: str
) -> StdioServerParameters:
    """``interlock mcp --machine FILE.toml`` in ``tmp``, journaling into ``tmp/db``."""
    return StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "interlock",
            "mcp",
            "--machine",
            machine,
            "--db",
            str(tmp / db),
            "--",
            *upstream,
        ],
        env=dict(os.environ, **env),
        cwd=str(tmp),
    )


TIME_APP = """
from interlock import App, BreakerPolicy, Machine, Reject, Tool, Worker

async def never(args, ctx):
    raise AssertionError("the proxy's upstream executes the tools")

def utc_only(args, view):
    if args.get("timezone") != "UTC":
        return Reject(f"args.timezone: {args.get('timezone')!r} is not UTC",
                      "ask for timezone UTC", "args.timezone")
    return None

SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string"}},
          "required": ["timezone"], "additionalProperties": False}
machine = Machine(
    "clock", "ASK", {"ASK": Worker(next=["COMPLETED"], tools=["get_current_time"])},
    tools=[Tool("get_current_time", never, SCHEMA, guards=[utc_only], read_only=True),
           Tool("convert_time", never, {"type": "object"}, read_only=True)],
    breakers=BreakerPolicy(consecutive_failures=4),
)
app = App([machine])
"""


def _time_server() -> tuple[str, ...]:
    pytest.importorskip("mcp_server_time", reason="mcp-server-time (PyPI) is in the [test] extra")
    return (sys.executable, "-m", "mcp_server_time", "--local-timezone=UTC")


async def test_a_real_client_sees_only_what_the_state_allows_and_every_call_is_gated(
    tmp_path: Path,
) -> None:
    (tmp_path / "clock.py").write_text(TIME_APP)
    params = _proxy(tmp_path, "clock.py:app", *_time_server())
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
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

        bad_args = await client.call_tool("get_current_time", {"timezone": "UTC", "x": 1})
        assert bad_args.is_error
        assert "x" in bad_args.content[0].text
        assert bad_args.structured_content["violations"][0]["code"] == "schema"

        not_here = await client.call_tool("convert_time", {})
        assert not_here.is_error
        assert not_here.structured_content["violations"][0]["code"] == "tool_not_allowed"

        with pytest.raises(MCPError, match="unknown tool 'no_such_tool'"):
            await client.call_tool("no_such_tool", {})

        ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not ok.is_error, ok
        assert '"timezone": "UTC"' in ok.content[0].text
        key = ok.meta[KEY_META]
        assert ok.meta["dev.interlock/run"] == "mcp-s-1"

        # four rejections in a row trip the breaker: the run parks in ESCALATE, and every
        # later call answers in one line how an operator resumes it
        for _ in range(4):
            last = await client.call_tool("get_current_time", {"timezone": "Asia/Tokyo"})
        assert last.structured_content["outcome"] == "escalated"
        parked = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert parked.is_error
        assert parked.structured_content["outcome"] == "escalated"
        assert "interlock escalations resume mcp-s-1" in parked.content[0].text

    # an operator resumes the escalated run from the CLI; the agent's next session goes on
    resumed = await trio.run_process(
        [
            sys.executable,
            "-m",
            "interlock",
            "escalations",
            "resume",
            "mcp-s-1",
            "--to",
            "ASK",
            "--app",
            "clock.py:app",
            "--db",
            str(tmp_path / "mcp.db"),
            "--by",
            "ana",
        ],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert resumed.returncode == 0, resumed.stderr
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        assert [t.name for t in (await client.list_tools()).tools] == ["get_current_time"]
        after = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not after.is_error, after
        assert after.meta["dev.interlock/run"] == "mcp-s-1"

    store = await open_sqlite_store(str(tmp_path / "mcp.db"), readonly=True)
    try:
        events = await store.load("mcp-s-1")
    finally:
        await store.aclose()
    intents = [e for e in events if isinstance(e, IntentRecorded)][:1]
    commits = [e for e in events if isinstance(e, ToolCommitted)]
    assert [(i.tool, i.key) for i in intents] == [("get_current_time", key)]
    assert commits[0].key == key
    assert commits[0].seq > intents[0].seq  # the intent was durable before the call went out
    # the journal replays offline, with no upstream
    sys.path.insert(0, str(tmp_path))
    try:
        import clock  # type: ignore[import-not-found]

        assert replay(events, clock.machine).diverged == ()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("clock", None)


EDIT_APP = """
from interlock import App, Machine, Tool, Worker

async def never(args, ctx):
    raise AssertionError("the proxy's upstream executes the tools")

EDIT = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "edits": {"type": "array", "items": {
            "type": "object",
            "properties": {"oldText": {"type": "string"}, "newText": {"type": "string"}},
            "required": ["oldText", "newText"], "additionalProperties": False}},
    },
    "required": ["path", "edits"],
    "additionalProperties": False,
}
READ = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
        "additionalProperties": False}
machine = Machine(
    "ledger", "EDIT", {"EDIT": Worker(next=["COMPLETED"], tools=["edit_file", "read_text_file"])},
    tools=[Tool("edit_file", never, EDIT, repeatable=True),   # neither read-only nor idempotent
           Tool("read_text_file", never, READ, read_only=True)],
)
app = App([machine])
"""


def _tally(path: Path) -> int:
    """How many times the upstream applied the edit, from the file the upstream wrote."""
    return path.read_text().count("+")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _proxy_pid(session: str) -> int:
    out = subprocess.run(
        ["pgrep", "-f", f"interlock mcp .*--session {session} "], capture_output=True, text=True
    ).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


async def _wait_for_intent(db: Path, run_id: str) -> str:
    with trio.fail_after(30):
        while True:
            try:
                store = await open_sqlite_store(str(db), readonly=True)
                try:
                    events = await store.load(run_id)
                finally:
                    await store.aclose()
            except Exception:
                events = []
            intents = [e for e in events if isinstance(e, IntentRecorded)]
            if intents:
                return intents[-1].key
            await trio.sleep(0.05)


@pytest.mark.parametrize("killed", ["proxy", "upstream"])
async def test_a_call_in_flight_when_a_process_dies_is_applied_at_most_once(
    tmp_path: Path, killed: str
) -> None:
    """SIGKILL of the proxy (or of the upstream) while a side-effecting call is in flight
    upstream; then the client re-issues the call: the upstream applies it at most once
    (counted from the file it edits), and the run escalates instead of guessing."""
    server = _npm_server("server-filesystem")
    ledger = tmp_path / "files" / "ledger.txt"
    ledger.parent.mkdir()
    ledger.write_text("tally:\n")
    (tmp_path / "ledger_app.py").write_text(EDIT_APP)
    session = f"kill-{killed}-{os.getpid()}"
    params = _proxy(
        tmp_path, "ledger_app.py:app", "node", str(server), str(ledger.parent), session=session
    )
    call = {"path": str(ledger), "edits": [{"oldText": "tally:", "newText": "tally:+"}]}
    run_id = f"mcp-{session}-1"

    outcome: dict[str, Any] = {}
    answered = trio.Event()

    async def first_client(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
                await client.initialize()
                task_status.started()
                outcome["result"] = await client.call_tool("edit_file", call)
        except Exception as exc:  # the proxy died under it: the call's outcome is lost
            outcome["error"] = exc
        finally:
            answered.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(first_client)
        proxy = _proxy_pid(session)
        (upstream,) = _children(proxy)
        os.kill(upstream, signal.SIGSTOP)  # the call will hang upstream: slow, in flight
        await _wait_for_intent(tmp_path / "mcp.db", run_id)
        await trio.sleep(0.5)  # the proxy writes the request to the upstream's stdin
        if killed == "proxy":
            # the upstream applies the call while the proxy cannot hear the answer, then
            # the proxy dies: applied upstream, not committed in the journal
            os.kill(proxy, signal.SIGSTOP)
            os.kill(upstream, signal.SIGCONT)
            with trio.fail_after(30):
                while _tally(ledger) == 0:  # noqa: ASYNC110 - polls a file another process writes
                    await trio.sleep(0.02)
            os.kill(proxy, signal.SIGKILL)
        else:
            os.kill(upstream, signal.SIGKILL)
        with trio.fail_after(60):
            await answered.wait()
        nursery.cancel_scope.cancel()

    applied_before = _tally(ledger)
    assert applied_before == (1 if killed == "proxy" else 0)
    if killed == "upstream":
        # the proxy lived: it told the client that the run waits for an operator
        result = outcome["result"]
        assert result.is_error, result
        assert "escalated" in result.content[0].text, result

    # the client (or its restart) re-issues the same call under a new request id
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        again = await client.call_tool("edit_file", call)
        assert again.is_error
        assert "escalated" in again.content[0].text
        assert "interlock escalations resume" in again.content[0].text
        assert again.structured_content["outcome"] == "escalated"
        assert (await client.list_tools()).tools == []  # an escalated run allows nothing
    assert _tally(ledger) == applied_before  # never forwarded blind a second time

    store = await open_sqlite_store(str(tmp_path / "mcp.db"), readonly=True)
    try:
        record = await store.get_run(run_id)
    finally:
        await store.aclose()
    assert (record.outcome, record.reason) == ("escalated", "in_doubt_side_effect")


def test_a_bad_command_line_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "clock.py").write_text(TIME_APP)
    cases = [
        (["mcp", "--app", "clock.py:app"], "either as a command after `--`"),
        (["mcp", "--", "true"], "--machine FILE.toml"),
        (["mcp", "--app", "clock.py:nope", "--", "true"], "has no attribute 'nope'"),
        (
            ["mcp", "--app", "clock.py:app", "--", "no-such-server-here"],
            "the upstream command 'no-such-server-here' is not found",
        ),
    ]
    for argv, expected in cases:
        done = subprocess.run(
            [sys.executable, "-m", "interlock", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode in (1, 2), (argv, done.stderr)  # usage 2, configuration 1
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("interlock: error: "), (argv, done.stderr)
        assert expected in last, (argv, done.stderr)


def test_the_memory_server_tools_are_listed_through_the_proxy(tmp_path: Path) -> None:
    server = _npm_server("server-memory")
    (tmp_path / "graph.py").write_text(
        textwrap.dedent("""
        from interlock import App, Machine, Tool, Worker
        async def never(args, ctx):
            raise AssertionError
        machine = Machine("graph", "READ", {"READ": Worker(next=["COMPLETED"], tools=["read_graph"])},
                          tools=[Tool("read_graph", never, {"type": "object"}, read_only=True)])
        app = App([machine])
    """)
    )
    env = dict(os.environ, MEMORY_FILE_PATH=str(tmp_path / "memory.jsonl"))
    params = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "interlock",
            "mcp",
            "--app",
            "graph.py:app",
            "--db",
            str(tmp_path / "m.db"),
            "--",
            "node",
            str(server),
        ],
        env=env,
        cwd=str(tmp_path),
    )

    async def main() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            assert [t.name for t in (await client.list_tools()).tools] == ["read_graph"]
            graph = await client.call_tool("read_graph", {})
            assert not graph.is_error, graph

    trio.run(main)


MEMORY_MACHINE = """
[machine]
name = "people"
initial = "PLAN"

[states.PLAN]
tools = ["read_graph", "create_entities"]
next = ["RELATE"]

[states.RELATE]
tools = ["read_graph", "create_relations"]
next = ["CLEANUP"]

[states.CLEANUP]
tools = ["read_graph", "delete_entities"]
next = ["COMPLETED"]

[tools.read_graph]
kind = "read-only"

[tools.create_entities]
moves_to = "RELATE"

[[tools.create_entities.guards]]
when = "size(args.entities) <= 2"
message = "at most 2 entities a call"
hint = "split the entities into calls of 2 or fewer"

[tools.create_relations]
moves_to = "CLEANUP"
guards = [
  "args.relations.all(r, history.exists(h, h.tool == 'create_entities' && h.args.entities.exists(e, e.name == r.from)))",
]

[tools.delete_entities]
moves_to = "COMPLETED"

[tools.delete_entities.reconcile]
tool = "read_graph"
applied = "!result.entities.exists(e, e.name in args.entityNames)"

[breakers]
consecutive_failures = 5
"""


def _entities(memory: Path) -> list[str]:
    """The entities the memory server holds, read from its own file."""
    if not memory.exists():
        return []
    import json

    rows = [json.loads(line) for line in memory.read_text().splitlines() if line.strip()]
    return [r["name"] for r in rows if r.get("type") == "entity"]


def _memory_proxy(tmp: Path, session: str) -> StdioServerParameters:
    server = _npm_server("server-memory")
    (tmp / "people.toml").write_text(MEMORY_MACHINE)
    return StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "interlock",
            "mcp",
            "--machine",
            "people.toml",
            "--db",
            str(tmp / "m.db"),
            "--session",
            session,
            "--",
            "node",
            str(server),
        ],
        env=dict(os.environ, MEMORY_FILE_PATH=str(tmp / "memory.jsonl")),
        cwd=str(tmp),
    )


ADA = {"name": "ada", "entityType": "person", "observations": ["wrote the first program"]}
BOB = {"name": "bob", "entityType": "person", "observations": []}
EVE = {"name": "eve", "entityType": "person", "observations": []}


async def test_a_machine_file_holds_a_real_server_to_its_states_guards_and_moves(
    tmp_path: Path,
) -> None:
    changed: list[str] = []

    async def on_message(message: Any) -> None:
        if type(message).__name__ == "ToolListChangedNotification":
            changed.append("tools")

    params = _memory_proxy(tmp_path, "people")
    async with (
        stdio_client(params) as (read, write),
        ClientSession(read, write, message_handler=on_message) as client,
    ):
        await client.initialize()
        assert {t.name for t in (await client.list_tools()).tools} == {
            "read_graph",
            "create_entities",
        }

        too_many = await client.call_tool("create_entities", {"entities": [ADA, BOB, EVE]})
        assert too_many.is_error
        assert too_many.content[0].text == (
            "create_entities: at most 2 entities a call; split the entities into calls of 2 or fewer"
        )
        assert _entities(tmp_path / "memory.jsonl") == []  # never reached the server

        early = await client.call_tool("delete_entities", {"entityNames": ["ada"]})
        # refused for that alone: not also for the move its moves_to would have made
        codes = [v["code"] for v in early.structured_content["violations"]]
        assert codes == ["tool_not_allowed"], early.structured_content

        made = await client.call_tool("create_entities", {"entities": [ADA, BOB]})
        assert not made.is_error, made
        assert _entities(tmp_path / "memory.jsonl") == ["ada", "bob"]
        # the committed call moved the run: RELATE's tools now, and the client was told
        assert {t.name for t in (await client.list_tools()).tools} == {
            "read_graph",
            "create_relations",
        }
        assert changed

        stranger = await client.call_tool(
            "create_relations",
            {"relations": [{"from": "zed", "to": "ada", "relationType": "knows"}]},
        )
        assert stranger.structured_content["violations"][0]["code"] == "guard"
        related = await client.call_tool(
            "create_relations",
            {"relations": [{"from": "ada", "to": "bob", "relationType": "knows"}]},
        )
        assert not related.is_error, related

        graph = await client.call_tool("read_graph", {})
        assert not graph.is_error

        gone = await client.call_tool("delete_entities", {"entityNames": ["bob"]})
        assert not gone.is_error, gone
        assert _entities(tmp_path / "memory.jsonl") == ["ada"]
        done = await client.call_tool("read_graph", {})
        assert done.structured_content["outcome"] == "completed"

    store = await open_sqlite_store(str(tmp_path / "m.db"), readonly=True)
    try:
        record = await store.get_run("mcp-people-1")
    finally:
        await store.aclose()
    assert (record.outcome, record.state) == ("completed", "COMPLETED")


async def test_a_call_in_doubt_is_reconciled_from_the_server_not_sent_again(tmp_path: Path) -> None:
    """The proxy is SIGKILLed after the server applied a delete but before the commit; the
    client re-issues the delete: the proxy asks read_graph (the machine's reconcile), finds
    it applied, commits the call without sending it again, and the run moves on."""
    params = _memory_proxy(tmp_path, "doubt")
    memory = tmp_path / "memory.jsonl"
    delete = {"entityNames": ["bob"]}
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        assert not (await client.call_tool("create_entities", {"entities": [ADA, BOB]})).is_error
        assert not (
            await client.call_tool(
                "create_relations",
                {"relations": [{"from": "ada", "to": "bob", "relationType": "knows"}]},
            )
        ).is_error

    # a second connection (the proxy restarted) picks the run up in CLEANUP
    answered = trio.Event()
    async with trio.open_nursery() as nursery:

        async def doomed(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                async with stdio_client(params) as (read, write), ClientSession(read, write) as c:
                    await c.initialize()
                    task_status.started()
                    await c.call_tool("delete_entities", delete)
            except Exception:
                pass
            finally:
                answered.set()

        await nursery.start(doomed)
        proxy = _proxy_pid("doubt")
        (upstream,) = _children(proxy)
        os.kill(upstream, signal.SIGSTOP)
        await _wait_for_intent_of(tmp_path / "m.db", "mcp-doubt-1", "delete_entities")
        await trio.sleep(0.5)
        os.kill(proxy, signal.SIGSTOP)
        os.kill(upstream, signal.SIGCONT)
        with trio.fail_after(30):
            while "bob" in _entities(memory):  # noqa: ASYNC110 - polls the server's file
                await trio.sleep(0.02)
        os.kill(proxy, signal.SIGKILL)
        with trio.fail_after(30):
            await answered.wait()

    assert _entities(memory) == ["ada"]
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        again = await client.call_tool("delete_entities", delete)
        assert again.meta["dev.interlock/verdict"] == "reconciled: applied before"
        # delete_entities declares an outputSchema, which its lost answer cannot fill:
        # the agent is told, as an error result, that the call was applied and committed
        assert again.is_error, again
        assert "delete_entities was applied" in again.content[0].text, again
        assert "do not call it again" in again.content[0].text, again
    store = await open_sqlite_store(str(tmp_path / "m.db"), readonly=True)
    try:
        record = await store.get_run("mcp-doubt-1")
        events = await store.load("mcp-doubt-1")
    finally:
        await store.aclose()
    assert (record.outcome, record.state) == ("completed", "COMPLETED")
    # committed once, by the reconcile: one intent for the delete, its result the server's
    deletes = [e for e in events if isinstance(e, IntentRecorded) and e.tool == "delete_entities"]
    assert len(deletes) == 1
    committed = [e for e in events if isinstance(e, ToolCommitted) and e.key == deletes[0].key]
    assert len(committed) == 1


async def _wait_for_intent_of(db: Path, run_id: str, tool: str) -> None:
    with trio.fail_after(30):
        while True:
            try:
                store = await open_sqlite_store(str(db), readonly=True)
                try:
                    events = await store.load(run_id)
                finally:
                    await store.aclose()
            except Exception:
                events = []
            if any(isinstance(e, IntentRecorded) and e.tool == tool for e in events):
                return
            await trio.sleep(0.05)


CLOCK_MACHINE = """
[machine]
name = "clock"
initial = "ASK"

[states.ASK]
tools = ["get_current_time"]
next = ["COMPLETED"]

[tools.get_current_time]
kind = "read-only"
approval = true

[breakers]
repeats = 10
"""


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_tool_marked_for_approval_asks_the_user_with_the_exact_arguments(
    tmp_path: Path, mode: str
) -> None:
    from mcp import Client
    from mcp.types import ElicitResult

    (tmp_path / "clock.toml").write_text(CLOCK_MACHINE)
    params = _file_proxy(tmp_path, "clock.toml", "c.db", *_time_server())
    asked: list[str] = []
    answers = iter([True, False])

    async def on_elicit(ctx: Any, request: Any) -> Any:
        asked.append(request.message)
        return ElicitResult(action="accept", content={"approve": next(answers)})

    async with Client(params, elicitation_callback=on_elicit, mode=mode) as client:
        expected = "2026-07-28" if mode == "auto" else "2025-11-25"
        assert client.protocol_version == expected
        approved = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not approved.is_error, approved
        refused = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert refused.is_error
        assert refused.structured_content == {
            "approved": False,
            "reason": "the user did not approve it (accept)",
        }
    assert len(asked) == 2
    assert asked[0].endswith('{"timezone": "UTC"}')
    assert "get_current_time" in asked[0]
    store = await open_sqlite_store(str(tmp_path / "c.db"), readonly=True)
    try:
        events = await store.load("mcp-default-1")
    finally:
        await store.aclose()
    # only the approved call was proposed and committed
    assert len([e for e in events if isinstance(e, ToolCommitted)]) == 1


async def test_a_tool_whose_definition_changed_under_a_running_session_escalates_the_run(
    tmp_path: Path,
) -> None:
    """The run pins its tools' definitions when it starts; a server that comes back with
    another definition of a tool (here mcp-server-time started with another local time
    zone, which its schema's text names) gets no call of it: the run is escalated, once,
    and after an operator resumes it the changed tool stays refused, without escalating
    again."""
    (tmp_path / "clock.py").write_text(TIME_APP)
    server = _time_server()[:-1]
    first = _proxy(tmp_path, "clock.py:app", *server, "--local-timezone=UTC", session="pin")
    async with stdio_client(first) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        assert not (await client.call_tool("get_current_time", {"timezone": "UTC"})).is_error
    second = _proxy(
        tmp_path, "clock.py:app", *server, "--local-timezone=Europe/Paris", session="pin"
    )
    async with stdio_client(second) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        refused = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert refused.is_error
        text = refused.content[0].text
        assert "changed its definition since run mcp-pin-1 started" in text, text
        assert "interlock escalations resume mcp-pin-1" in text, text
        assert refused.meta["dev.interlock/verdict"] == "escalated"
        assert refused.structured_content["tool"] == "get_current_time"
        again = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert again.structured_content["outcome"] == "escalated"
    store = await open_sqlite_store(str(tmp_path / "mcp.db"), readonly=True)
    try:
        record = await store.get_run("mcp-pin-1")
    finally:
        await store.aclose()
    assert (record.outcome, record.reason) == ("escalated", "definition_changed")
    assert "Abort the run if the server should not have changed" in record.detail

    queue = _interlock(tmp_path, "escalations", "--db", "mcp.db")
    assert "mcp-pin-1" in queue.stdout, queue.stdout
    assert "definition_changed" in queue.stdout, queue.stdout
    resumed = _interlock(
        tmp_path, "escalations", "resume", "mcp-pin-1", "--app", "clock.py:app", "--db", "mcp.db"
    )
    assert resumed.returncode == 0, resumed.stderr

    async with stdio_client(second) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        refused = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert refused.is_error
        assert refused.meta["dev.interlock/verdict"] == "definition-changed"
        assert "start a new session" in refused.content[0].text
        assert [t.name for t in (await client.list_tools()).tools] == ["get_current_time"]
    store = await open_sqlite_store(str(tmp_path / "mcp.db"), readonly=True)
    try:
        events = await store.load("mcp-pin-1")
        record = await store.get_run("mcp-pin-1")
    finally:
        await store.aclose()
    assert record.outcome == "running"  # resumed, and not escalated a second time
    assert len([e for e in events if isinstance(e, IntentRecorded)]) == 1  # only the first
    assert "UTC" in str(events[0].inputs["mcp_tools"]["get_current_time"])


async def _interlock_async(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[bytes]:
    """``interlock ARGV...`` in ``tmp_path``, without blocking the test's other tasks."""
    return await trio.run_process(
        [sys.executable, "-m", "interlock", *argv],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def _interlock(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlock", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


async def test_junk_on_the_wire_gets_errors_and_the_proxy_goes_on(tmp_path: Path) -> None:
    """Malformed JSON-RPC, a wrong method and an oversized line over stdio: the proxy
    answers the spec's errors where an id is readable, never crashes, and answers a valid
    request afterwards."""
    import json

    (tmp_path / "clock.py").write_text(TIME_APP)
    params = _proxy(tmp_path, "clock.py:app", *_time_server())
    proc = await trio.lowlevel.open_process(
        [params.command, *params.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=params.cwd,
        env=params.env,
    )
    buffer = b""

    async def send(line: bytes) -> None:
        await proc.stdin.send_all(line + b"\n")

    async def answer(request_id: int) -> dict[str, Any]:
        nonlocal buffer
        with trio.fail_after(30):
            while True:
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if message.get("id") == request_id:
                        return message
                chunk = await proc.stdout.receive_some(65536)
                assert chunk, "the proxy closed its output"
                buffer += chunk

    try:
        init = {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "junk", "version": "0"},
        }
        await send(
            json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init}).encode()
        )
        assert "result" in await answer(1)
        await send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')
        await send(b"this is not json")
        await send(b'{"jsonrpc": "2.0", "id": 2}')  # no method
        await send(b'{"jsonrpc": "2.0", "id": 3, "method": "tools/destroy", "params": {}}')
        wrong = await answer(3)
        assert wrong["error"]["code"] == -32601  # method not found
        await send(b'{"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": 5}}')
        assert "error" in await answer(4)
        big = {"name": "get_current_time", "arguments": {"timezone": "x" * 3_000_000}}
        await send(
            json.dumps({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": big}).encode()
        )
        oversized = await answer(5)
        assert oversized["result"]["isError"] is True  # refused by the gate's size cap
        (violation,) = oversized["result"]["structuredContent"]["violations"]
        assert "bytes" in violation["message"], violation
        twice = (
            b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": '
            b'"get_current_time", "arguments": {"timezone": "Asia/Tokyo", "timezone": "UTC"}}}'
        )
        await send(twice)  # the SDK alone would read "UTC", and the guard would pass it
        named_twice = await answer(7)
        assert named_twice["result"]["isError"] is True
        (violation,) = named_twice["result"]["structuredContent"]["violations"]
        assert (violation["code"], violation["path"]) == ("malformed", "args.timezone")
        assert "duplicate key" in violation["message"], violation
        await send(b'{"jsonrpc": "2.0", "id": 6, "method": "tools/list"}')
        listed = await answer(6)
        assert [t["name"] for t in listed["result"]["tools"]] == ["get_current_time"]
        assert proc.poll() is None
        # the client leaves: the proxy writes what it decided and exits (a rejection is
        # answered before it is durable, so a SIGKILL here could lose it, harmlessly)
        await proc.stdin.aclose()
        with trio.fail_after(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    store = await open_sqlite_store(str(tmp_path / "mcp.db"), readonly=True)
    try:
        events = await store.load("mcp-s-1")
    finally:
        await store.aclose()
    # the call named twice is journaled as the gate refused it, as the client wrote it
    rejected = [e for e in events if type(e).__name__ == "ProposalRejected"]
    assert any(
        v.code == "malformed" and v.path == "args.timezone" for e in rejected for v in e.violations
    ), rejected


async def test_a_result_that_fails_a_check_does_not_reach_the_agent_as_an_answer(
    tmp_path: Path,
) -> None:
    (tmp_path / "checked.toml").write_text(
        """
[machine]
name = "checked"
initial = "ASK"

[states.ASK]
tools = ["get_current_time"]
next = ["COMPLETED"]

[tools.get_current_time]
kind = "read-only"

[[tools.get_current_time.result_guards]]
when = "result.timezone == args.timezone && result.is_dst"
message = "the server answered outside daylight saving time"
"""
    )
    params = _file_proxy(tmp_path, "checked.toml", "k.db", *_time_server())
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        checked = await client.call_tool("get_current_time", {"timezone": "UTC"})  # UTC: no DST
        assert checked.is_error
        assert checked.content[0].text == (
            "get_current_time: the server answered outside daylight saving time"
        )
    store = await open_sqlite_store(str(tmp_path / "k.db"), readonly=True)
    try:
        events = await store.load("mcp-default-1")
    finally:
        await store.aclose()
    assert not [e for e in events if isinstance(e, ToolCommitted)]  # a failure, not a commit


async def test_the_proxy_serves_the_runtime_metrics(tmp_path: Path) -> None:
    import httpx

    (tmp_path / "clock.py").write_text(TIME_APP)
    params = _proxy(tmp_path, "clock.py:app", *_time_server())
    params.args[params.args.index("--") : params.args.index("--")] = ["--metrics-port", "0"]
    log = tmp_path / "proxy.log"
    with log.open("w") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as client,
        ):
            await client.initialize()
            await client.call_tool("get_current_time", {"timezone": "Asia/Tokyo"})  # rejected
            assert not (await client.call_tool("get_current_time", {"timezone": "UTC"})).is_error
            url = next(
                line.rsplit(" ", 1)[1]
                for line in log.read_text().splitlines()
                if "serving metrics at" in line
            )
            async with httpx.AsyncClient() as http:
                text = (await http.get(url)).text
    assert 'interlock_runs_started_total{machine="clock"} 1.0' in text
    assert (
        'interlock_verifications_total{code="guard",machine="clock",outcome="rejected"} 1.0' in text
    )
    assert 'interlock_verifications_total{code="",machine="clock",outcome="accepted"} 1.0' in text
    assert 'interlock_tool_calls_total{tool="get_current_time"} 1.0' in text


async def test_an_escalated_run_of_a_machine_file_is_resumed_from_the_cli(tmp_path: Path) -> None:
    (tmp_path / "utc.toml").write_text(
        """
[machine]
name = "utc"
initial = "ASK"

[states.ASK]
tools = ["get_current_time"]
next = ["COMPLETED"]

[tools.get_current_time]
kind = "read-only"
guards = ["args.timezone == 'UTC'"]

[breakers]
consecutive_failures = 2
"""
    )
    params = _file_proxy(tmp_path, "utc.toml", "u.db", *_time_server())
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        for _ in range(2):
            last = await client.call_tool("get_current_time", {"timezone": "Asia/Tokyo"})
        assert last.structured_content["outcome"] == "escalated"
    listed = await trio.run_process(
        [sys.executable, "-m", "interlock", "escalations", "--db", str(tmp_path / "u.db")],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert b"mcp-default-1" in listed.stdout, listed.stderr
    resumed = await trio.run_process(
        [
            sys.executable,
            "-m",
            "interlock",
            "escalations",
            "resume",
            "mcp-default-1",
            "--app",
            "utc.toml",
            "--db",
            str(tmp_path / "u.db"),
            "--by",
            "ana",
        ],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
        assert not ok.is_error, ok
        assert ok.meta["dev.interlock/run"] == "mcp-default-1"


class _GatedStore:
    """A SQLite journal whose writes wait for ``gate`` while it is closed: what the proxy
    answers before its events are durable shows."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = trio.Event()
        self.gate.set()
        self.written = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def append(self, events: Any) -> None:
        await self.gate.wait()
        await self.inner.append(events)
        self.written += 1


@pytest.mark.parametrize("kind", ["read-only", "side-effecting"])
async def test_only_a_call_that_may_change_something_waits_for_its_intent_to_be_durable(
    tmp_path: Path, kind: str
) -> None:
    """A read-only call is forwarded and answered while the journal's write of its intent
    and result is still held (a crash loses nothing that matters: the call is asked
    again); any other call reaches the upstream only once its intent and key are durable.
    Both end up journaled, intent then commit."""
    import mcp.types as types

    from interlock import Machine, Tool, Worker, open_supervisor
    from interlock.mcp._proxy import McpRun

    async def never(args: Any, ctx: Any) -> Any:
        raise AssertionError("the upstream executes the tools")

    machine = Machine(
        "m",
        "GO",
        {"GO": Worker(next=["COMPLETED"], tools=["look", "write"])},
        tools=[
            Tool("look", never, {"type": "object"}, read_only=True),
            Tool("write", never, {"type": "object"}),
        ],
    )
    forwarded: list[tuple[str, int]] = []
    inner = await open_sqlite_store(str(tmp_path / "j.db"), synchronous="FULL")
    store = _GatedStore(inner)

    async def upstream(name: str, args: Any, meta: Any) -> types.CallToolResult:
        forwarded.append((name, store.written))
        return types.CallToolResult(content=[types.TextContent(type="text", text="{}")])

    tools = [types.Tool(name=n, input_schema={"type": "object"}) for n in ("look", "write")]
    name = "look" if kind == "read-only" else "write"
    async with open_supervisor([machine], store) as sup:  # type: ignore[arg-type]
        run = await McpRun.open(sup, machine, "g", upstream, tools)
        store.gate = trio.Event()  # hold every write from here on
        before = store.written
        answered = trio.Event()

        async def call() -> None:
            result = await run.call_tool(name, {"n": 1})
            assert not result.is_error, result
            answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            with trio.move_on_after(2):
                await answered.wait()
            if kind == "read-only":
                assert answered.is_set()  # answered with its writes still held
                assert forwarded == [("look", before)]
            else:
                assert not answered.is_set()  # the intent is not durable: not forwarded
                assert forwarded == []
            store.gate.set()
        if kind != "read-only":
            assert forwarded == [("write", before + 1)]  # once the intent was written
        await sup.external.sync(run.run_id)
        assert store.written > before
    events = await inner.load(run.run_id)
    await inner.aclose()
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("IntentRecorded") < kinds.index("ToolCommitted"), kinds


@pytest.mark.parametrize(
    ("action", "mode"), [("resume", "legacy"), ("resume", "auto"), ("abort", "legacy")]
)
async def test_an_operator_resumes_or_aborts_a_run_while_the_proxy_holds_its_journal(
    tmp_path: Path, action: str, mode: str
) -> None:
    """On SQLite the proxy holds the journal (one writer), so `interlock escalations
    resume|abort` hands its request to the proxy through the journal's inbox: the
    proxy decides it, the agent hears its tool list changed, and its next call is
    answered from where the operator put the run, all without a restart."""
    from mcp import Client

    (tmp_path / "clock.py").write_text(TIME_APP)
    params = _proxy(tmp_path, "clock.py:app", *_time_server(), session="live")
    changed = trio.Event()

    async def on_message(message: Any) -> None:
        if type(message).__name__ == "ToolListChangedNotification":
            changed.set()

    async with (
        Client(params, message_handler=on_message, mode=mode) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        for _ in range(4):  # four rejections in a row trip the breaker
            last = await client.call_tool("get_current_time", {"timezone": "Asia/Tokyo"})
        assert last.structured_content["outcome"] == "escalated"
        changed = trio.Event()
        if mode == "auto":  # 2026-07-28: the change comes on a subscriptions/listen stream
            assert client.protocol_version == "2026-07-28"
            changes = await stack.enter_async_context(client.listen(tools_list_changed=True))

            async def heard() -> None:
                await changes.__anext__()
                changed.set()

            nursery = await stack.enter_async_context(trio.open_nursery())
            nursery.start_soon(heard)
        listed = await _interlock_async(tmp_path, "escalations", "--db", "mcp.db")
        assert b"mcp-live-1" in listed.stdout
        if action == "resume":  # a refusal only the holder can decide comes back, one line
            bad = await _interlock_async(
                tmp_path,
                *("escalations", "resume", "mcp-live-1", "--app", "clock.py:app"),
                *("--db", "mcp.db", "--payload", '{"tool": "get_current_time", "args": {}}'),
            )
            assert bad.returncode == 1, bad.stderr.decode()
            last = bad.stderr.decode().strip().splitlines()[-1]
            assert "rejected" in last, last
            assert "timezone" in last, last
        operated = await _interlock_async(
            tmp_path,
            *("escalations", action, "mcp-live-1", "--app", "clock.py:app", "--db", "mcp.db"),
            *("--by", "oncall", "--note", "ok"),
        )
        assert operated.returncode == 0, operated.stderr.decode()
        if action == "resume":
            assert operated.stdout.decode().startswith("run mcp-live-1: running in ASK")
            with trio.fail_after(10):
                await changed.wait()  # told at once, before its next call
            listed_tools = await client.list_tools()
            assert [t.name for t in listed_tools.tools] == ["get_current_time"]
            ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
            assert not ok.is_error, ok
            assert ok.meta["dev.interlock/run"] == "mcp-live-1"
        else:
            assert operated.stdout.decode().startswith("run mcp-live-1: failed in FAILED")
            ended = await client.call_tool("get_current_time", {"timezone": "UTC"})
            assert ended.is_error
            assert ended.structured_content["outcome"] == "failed"
        # a second time: the proxy answers what the operator did, changing nothing
        again = await _interlock_async(
            tmp_path,
            *("escalations", action, "mcp-live-1", "--app", "clock.py:app", "--db", "mcp.db"),
        )
        assert again.returncode == 0, again.stderr.decode()
    store = await open_sqlite_store(str(tmp_path / "mcp.db"), readonly=True)
    try:
        events = await store.load("mcp-live-1")
    finally:
        await store.aclose()
    resumed = [e for e in events if type(e).__name__ == "Resumed"]
    assert [(e.by, e.note) for e in resumed] == [("oncall", "ok")]
    assert list((tmp_path / "mcp.db.operators").iterdir()) == []  # nothing left behind


async def test_a_holder_that_takes_no_operator_requests_gets_none_left_behind(
    tmp_path: Path,
) -> None:
    """A process that holds the journal but serves no inbox (here a bare writer): the
    request is withdrawn after --wait, and the operator is told in one line to stop
    that process first (exit 2); the inbox is left empty."""
    (tmp_path / "clock.py").write_text(TIME_APP)
    params = _proxy(tmp_path, "clock.py:app", *_time_server(), session="q")
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        for _ in range(4):
            await client.call_tool("get_current_time", {"timezone": "Asia/Tokyo"})
    holder = subprocess.Popen(  # noqa: ASYNC220 - a holder for the test's whole length
        [
            sys.executable,
            "-c",
            "import sys, trio\n"
            "from interlock.stores import open_sqlite_store\n"
            "async def main():\n"
            "    store = await open_sqlite_store('mcp.db')\n"
            "    print('held', flush=True)\n"
            "    await trio.sleep(60)\n"
            "trio.run(main)\n",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        refused = _interlock(
            tmp_path,
            *("escalations", "resume", "mcp-q-1", "--app", "clock.py:app", "--db", "mcp.db"),
            *("--wait", "0.5"),
        )
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert refused.returncode == 2, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert "took no operator request within 0.5 s" in last, last
    assert "stop it, then run this again" in last, last
    assert list((tmp_path / "mcp.db.operators").iterdir()) == []


async def test_stray_output_on_stdout_never_reaches_the_wire(tmp_path: Path) -> None:
    """A guard (or a library) that prints to stdout would corrupt a stdio proxy's wire;
    while it serves, fd 1 writes to stderr, as the SDK's own stdio server arranges."""
    (tmp_path / "loud.py").write_text(
        TIME_APP.replace(
            "def utc_only(args, view):\n",
            "def utc_only(args, view):\n    print('stray output from a guard')\n"
            "    import os; os.write(1, b'stray bytes on fd 1\\n')\n",
        )
    )
    params = _proxy(tmp_path, "loud.py:app", *_time_server(), session="loud")
    with open(tmp_path / "stderr.log", "w") as errlog:  # noqa: ASYNC230 - the child writes it
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as client,
        ):
            await client.initialize()
            for _ in range(3):
                ok = await client.call_tool("get_current_time", {"timezone": "UTC"})
                assert not ok.is_error, ok
    logged = (tmp_path / "stderr.log").read_text()
    assert "stray output from a guard" in logged, logged
    assert "stray bytes on fd 1" in logged, logged


LEDGER_SERVER = """
import json, sys
import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("ledger")
LEDGER = sys.argv[1]

def entries():
    try:
        with open(LEDGER) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []

DROPPED = set()

@server.tool()
async def pay(payee: str, cents: int, slow: float = 0.0, drop_first: bool = False) -> str:
    if drop_first and payee not in DROPPED:  # the first such call is never applied
        DROPPED.add(payee)
        await anyio.sleep(5)
        return "dropped"
    with open(LEDGER, "a") as f:
        f.write(json.dumps({"payee": payee, "cents": cents}) + "\\n")
    await anyio.sleep(slow)  # applied, but the answer comes late
    return "paid"

@server.tool()
async def payments() -> dict:
    return {"entries": entries()}

server.run("stdio")
"""

LEDGER_MACHINE = """
[machine]
name = "ledger"
initial = "PAY"

[states.PAY]
tools = ["pay", "payments"]
next = ["COMPLETED"]

[tools.payments]
kind = "read-only"

[tools.pay]
timeout = 1.0

[tools.pay.reconcile]
tool = "payments"
applied = "result.entries.exists(e, e.payee == args.payee && e.cents == args.cents)"

[breakers]
repeats = 10
"""


@pytest.mark.parametrize("applied", [True, False])
async def test_a_call_that_times_out_is_reconciled_while_the_proxy_lives(
    tmp_path: Path, applied: bool
) -> None:
    """A side-effecting call whose answer does not come within its timeout is in doubt
    with the proxy alive: the machine's reconcile asks the server's read-only tool, and
    the call is committed from what the server says (applied), or run once more under
    its key (not applied), never sent blind."""
    (tmp_path / "ledger_server.py").write_text(LEDGER_SERVER)
    (tmp_path / "ledger.toml").write_text(LEDGER_MACHINE)
    ledger = tmp_path / "ledger.jsonl"
    params = _file_proxy(
        tmp_path,
        "ledger.toml",
        "l.db",
        sys.executable,
        str(tmp_path / "ledger_server.py"),
        str(ledger),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        if applied:  # the server applies it, then answers after the timeout
            answer = await client.call_tool("pay", {"payee": "ann", "cents": 5, "slow": 3.0})
            # pay declares an outputSchema its lost answer cannot fill: an error result
            # that says it was applied and committed
            assert answer.is_error, answer
            assert "pay was applied" in answer.content[0].text, answer
            assert "do not call it again" in answer.content[0].text, answer
            assert answer.meta["dev.interlock/verdict"] == "reconciled: applied"
            again = await client.call_tool("pay", {"payee": "ann", "cents": 5, "slow": 3.0})
            assert again.is_error
            assert again.structured_content["violations"][0]["code"] == "already_committed"
        else:  # the first attempt is never applied: the reconcile says so, and the call
            # runs once more under its key
            answer = await client.call_tool("pay", {"payee": "bob", "cents": 7, "drop_first": True})
            assert not answer.is_error, answer
            assert answer.structured_content == {"result": "paid"}
    rows = [line for line in ledger.read_text().splitlines() if line.strip()]
    assert len(rows) == 1, rows
    store = await open_sqlite_store(str(tmp_path / "l.db"), readonly=True)
    try:
        [record] = await store.list_runs()
        events = await store.load(record.run_id)
    finally:
        await store.aclose()
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("Reconciled") == 1, kinds
    assert kinds.count("ToolCommitted") == 1, kinds
    assert kinds.count("IntentRecorded") == 1, kinds  # one intent, one key, both attempts
