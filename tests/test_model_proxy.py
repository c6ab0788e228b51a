"""``interlock proxy``: an application on the official OpenAI SDK, its ``base_url`` at the
proxy, its model's tool calls verified against a run's machine before it sees them."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import trio

openai = pytest.importorskip("openai", reason="the openai SDK is in the [test] extra")
pytest.importorskip("hypercorn", reason="the [gateway] extra (hypercorn) is missing")

from interlock import Machine, Reject, Tool, Worker  # noqa: E402
from interlock.modelproxy import RUN_HEADER, serve_model_proxy  # noqa: E402
from interlock.stores import open_sqlite_store  # noqa: E402
from interlock.testing import (  # noqa: E402
    Raw,
    Reply,
    open_fake_llm,
    scripted_brain,
    tool_results_of,
)
from tests.test_real_model import llama_server  # noqa: E402, F401 - the fixture


async def _never(args: Any, ctx: Any) -> Any:
    raise AssertionError("the application executes the tools")


def _small(args: Any, view: Any) -> Reject | None:
    if args.get("cents", 0) > 1000:
        return Reject(
            f"args.cents: {args['cents']} is over 1000", "charge 1000 or less", "args.cents"
        )
    return None


CHARGE = {
    "type": "object",
    "properties": {"cents": {"type": "integer"}},
    "required": ["cents"],
    "additionalProperties": False,
}
MACHINE = Machine(
    "shop",
    "PAY",
    {"PAY": Worker(next=["COMPLETED"], tools=["charge", "lookup"])},
    tools=[
        Tool("charge", _never, CHARGE, guards=[_small]),
        Tool("lookup", _never, {"type": "object"}, read_only=True),
        Tool("refund", _never, {"type": "object"}),
    ],
)
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("charge", "lookup", "refund")
]


async def test_a_rejected_call_is_asked_again_and_the_application_sees_only_a_verified_one(
    tmp_path: Any,
) -> None:
    brain = scripted_brain(
        [
            Reply(calls=[("charge", '{"cents": 5000}')]),  # breaks the guard
            Reply(calls=[("charge", '{"cents": 500}')]),
            Reply(text="charged 5 dollars"),
        ]
    )
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            async with openai.AsyncOpenAI(base_url=server.url, api_key="sk-test") as client:
                messages: list[Any] = [{"role": "user", "content": "charge me"}]
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=messages, tools=TOOLS
                )
                run_id = raw.headers[RUN_HEADER]
                completion = raw.parse()
                (call,) = completion.choices[0].message.tool_calls
                assert call.function.name == "charge"
                assert call.function.arguments == '{"cents": 500}'  # never the 5000 one
                assert call.id == raw.headers["interlock-key"]
                messages += [
                    completion.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"charged": 500}'},
                ]
                final = await client.chat.completions.create(
                    model="m",
                    messages=messages,
                    tools=TOOLS,
                    extra_headers={RUN_HEADER: run_id},
                )
                assert final.choices[0].message.content == "charged 5 dollars"
            server.stop()
            requests = fake.requests
    finally:
        await store.aclose()
    # the model heard why its first call was refused, as that call's result
    assert len(requests) == 3
    refusals = tool_results_of("chat", requests[1].body)
    assert "is over 1000" in str(refusals[-1][1]), refusals
    # the upstream was offered only the tools the state allows
    assert {t["function"]["name"] for t in requests[0].body["tools"]} == {"charge", "lookup"}
    reader = await open_sqlite_store(str(tmp_path / "p.db"), readonly=True)
    try:
        events = await reader.load(run_id)
    finally:
        await reader.aclose()
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("ProposalRejected") == 1, kinds
    assert kinds.count("ToolCommitted") == 1, kinds


REFUND = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 12},
        "amount": {"type": "number"},
    },
    "required": ["order_id", "amount"],
    "additionalProperties": False,
}
LIMIT = 100.0


def _within(args: Any, view: Any) -> Reject | None:
    amount = args.get("amount", 0)
    if not 0 < amount <= LIMIT:
        return Reject(
            f"amount: {amount} is not within (0, {LIMIT}]",
            f"propose 0 < amount <= {LIMIT}",
            "args.amount",
        )
    return None


#: The real-model tests' machine: refunds up to LIMIT, and the tool as the model is offered it.
REFUNDS = Machine(
    "refunds",
    "REFUND",
    {"REFUND": Worker(next=["COMPLETED"], tools=["refund"])},
    tools=[Tool("refund", _never, REFUND, guards=[_within])],
)
REFUND_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "refund",
            "description": "Refund an amount of an order",
            "parameters": REFUND,
        },
    }
]


@pytest.mark.slow
async def test_an_unchanged_openai_application_runs_a_guarded_machine_against_a_real_model(
    llama_server: str,  # noqa: F811 - the real model test's fixture
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real local model (SmolLM2 behind llama-cpp-python's server) proposes refunds
    through the proxy, asked for more than the guard allows. What the gate must guarantee
    is asserted, not what the model answers: no call the application receives breaks the
    guard, the upstream never refused a request the proxy made, every rejection the gate
    made reached the model as the refused call's result (or, past the re-asks, the
    application as the refusal), and no run ended by a provider failure."""
    from interlock.providers._http import Transport

    sent: list[bytes] = []  # what the proxy really sent the model server
    post = Transport.post

    async def recording(self: Any, path: str, body: bytes, **kw: Any) -> Any:
        sent.append(body)
        return await post(self, path, body, **kw)

    monkeypatch.setattr(Transport, "post", recording)
    machine, tools = REFUNDS, REFUND_TOOLS
    received: list[Any] = []
    statuses: list[int] = []
    refusals = 0
    store = await open_sqlite_store(str(tmp_path / "real.db"))
    try:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, machine, llama_server, store, profile="llama-cpp-python")
            )
            async with openai.AsyncOpenAI(
                base_url=server.url, api_key="none", max_retries=0, timeout=300
            ) as client:
                for amount in (150, 40):
                    messages: list[Any] = [
                        {
                            "role": "system",
                            "content": "You answer by calling a tool. The customer of order "
                            f"o1 asks for a refund of {amount}. Call refund with order_id o1 "
                            f"and amount {amount}.",
                        },
                        {"role": "user", "content": f"Please refund {amount} on order o1."},
                    ]
                    headers: dict[str, str] = {}
                    for _ in range(2):
                        try:
                            raw = await client.chat.completions.with_raw_response.create(
                                model="m",
                                messages=messages,
                                tools=tools,
                                # a named function: llama-cpp-python's handler takes it
                                tool_choice={"type": "function", "function": {"name": "refund"}},
                                max_tokens=96,
                                extra_headers=headers,
                            )
                        except openai.APIStatusError as exc:
                            statuses.append(exc.status_code)
                            break
                        statuses.append(raw.http_response.status_code)
                        headers = {RUN_HEADER: raw.headers[RUN_HEADER]}
                        message = raw.parse().choices[0].message
                        if not message.tool_calls:
                            refusals += (message.content or "").startswith(
                                "interlock refused the model's call"
                            )
                            break
                        received.extend(message.tool_calls)
                        call = message.tool_calls[0]
                        messages += [
                            message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'},
                        ]
            server.stop()
    finally:
        await store.aclose()
    import json

    for call in received:  # the guarantee: nothing past the gate breaks the guard
        args = json.loads(call.function.arguments)
        assert 0 < args["amount"] <= LIMIT, call
    assert all(s in (200, 409) for s in statuses), statuses  # never an upstream refusal
    reader = await open_sqlite_store(str(tmp_path / "real.db"), readonly=True)
    try:
        runs = await reader.list_runs()
        kinds = [type(e).__name__ for r in runs for e in await reader.load(r.run_id)]
        rejected = kinds.count("ProposalRejected")
    finally:
        await reader.aclose()
    assert len(runs) == 2
    assert {r.outcome for r in runs} <= {"running", "completed", "escalated"}, runs
    # each rejection was asked again with the violation as the call's result, but the last
    # of a request past its re-asks, which the application got as the refusal, and one
    # that tripped a breaker, which escalated the run (the application got a 409)
    escalated = sum(r.outcome == "escalated" for r in runs)
    reasked = [b for b in sent if b"refused: " in b]
    assert len(reasked) == rejected - refusals - escalated, (
        len(reasked),
        rejected,
        refusals,
        escalated,
    )
    assert received or rejected, "the model proposed no call: the gate had no work"
    print(
        f"calls received: {len(received)}, rejected by the gate: {rejected}, statuses: {statuses}"
    )


async def test_bad_requests_get_the_apis_errors_naming_what_to_fix(tmp_path: Any) -> None:
    import httpx

    brain = scripted_brain([Reply(calls=[("charge", '{"cents": 5}')])] * 3)
    store = await open_sqlite_store(str(tmp_path / "b.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            base = server.url
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
            async with httpx.AsyncClient(timeout=30) as http:
                answers = {
                    "not JSON": await http.post(f"{base}/chat/completions", content=b"{nope"),
                    "no messages": await http.post(f"{base}/chat/completions", json={"model": "m"}),
                    "another path": await http.post(f"{base}/embeddings", json=body),
                    "GET": await http.get(f"{base}/chat/completions"),
                    "a bad run name": await http.post(
                        f"{base}/chat/completions",
                        json=body,
                        headers={RUN_HEADER: "no spaces/slashes"},
                    ),
                }
                first = await http.post(f"{base}/chat/completions", json=body)
                run_id = first.headers[RUN_HEADER]
                unreported = await http.post(
                    f"{base}/chat/completions", json=body, headers={RUN_HEADER: run_id}
                )
            server.stop()
    finally:
        await store.aclose()
    statuses = {name: r.status_code for name, r in answers.items()}
    assert statuses == {
        "not JSON": 400,
        "no messages": 400,
        "another path": 404,
        "GET": 405,
        "a bad run name": 400,
    }
    for r in answers.values():  # the OpenAI SDK surfaces error.message
        assert r.json()["error"]["message"], r.text
    assert "is not a run name" in answers["a bad run name"].json()["error"]["message"]
    assert first.status_code == 200
    assert unreported.status_code == 409
    message = unreported.json()["error"]["message"]
    key = first.json()["choices"][0]["message"]["tool_calls"][0]["id"]
    assert f"tool_call_id {key!r}" in message, message


class ProxyCommand:
    """``interlock proxy`` run as a user runs it, in front of the fake server (in a thread
    of its own): ``url`` once it serves; ``code`` and ``log`` once it stopped."""

    url: str
    code: int | None = None
    log: str = ""


@contextlib.contextmanager
def proxy_command(tmp_path: Any, brain: Any, *args: str) -> Iterator[ProxyCommand]:
    """Start ``interlock proxy --upstream FAKE ARGS...`` in ``tmp_path``; SIGTERM it on
    the way out and keep its exit code and stderr."""
    import re
    import subprocess
    import sys
    import threading

    ready: dict[str, Any] = {}
    done = threading.Event()

    async def fake_llm() -> None:
        async with open_fake_llm(brain) as fake:
            ready["url"] = fake.openai_base_url
            await trio.to_thread.run_sync(done.wait)

    thread = threading.Thread(target=trio.run, args=(fake_llm,))
    thread.start()
    command = ProxyCommand()
    log = tmp_path / "proxy.log"
    try:
        while "url" not in ready:
            threading.Event().wait(0.02)
        with log.open("wb") as err:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "interlock", "proxy", "--upstream", ready["url"], *args],
                cwd=tmp_path,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            for _ in range(600):
                found = re.search(r"serving (http://\S+/v1)", log.read_text())
                if found:
                    command.url = found[1]
                    break
                assert proxy.poll() is None, log.read_text()
                threading.Event().wait(0.05)
            assert hasattr(command, "url"), log.read_text()
            yield command
        finally:
            proxy.terminate()
            command.code = proxy.wait(timeout=30)
            command.log = log.read_text()
    finally:
        done.set()
        thread.join()


def test_the_command_serves_an_unchanged_openai_application(tmp_path: Any) -> None:
    """`interlock proxy --upstream URL --app REF`, from the command line, in front of the
    fake server; the OpenAI SDK (sync) pointed at the URL it prints."""
    (tmp_path / "shop.py").write_text(
        "from interlock import App, Machine, Tool, Worker\n"
        "async def never(args, ctx):\n    raise AssertionError\n"
        "app = App([Machine('shop', 'PAY', {'PAY': Worker(next=['COMPLETED'], tools=['charge'])},\n"
        "    tools=[Tool('charge', never, {'type': 'object'})])])\n"
    )
    brain = scripted_brain([Reply(calls=[("charge", '{"cents": 5}')])])
    with proxy_command(tmp_path, brain, "--app", "shop.py:app", "--db", "shop.db") as proxy:
        client = openai.OpenAI(base_url=proxy.url, api_key="sk-test", max_retries=0)
        completion = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "pay"}], tools=TOOLS[:1]
        )
        (call,) = completion.choices[0].message.tool_calls
        assert call.function.name == "charge"
        assert call.id.startswith("proxy-")  # the idempotency key
    assert "Traceback" not in proxy.log, proxy.log
    assert proxy.code == 0, proxy.log  # SIGTERM: the requests in flight answered, then out
    assert "interlock proxy: stopped" in proxy.log


SHOP_APP = """
from interlock import App, Machine, Reject, Tool, Worker

async def never(args, ctx):
    raise AssertionError

def small(args, view):
    if args.get("cents", 0) > 1000:
        return Reject(f"args.cents: {args['cents']} is over 1000", "charge 1000 or less")
    return None

app = App([Machine("shop", "PAY", {"PAY": Worker(next=["COMPLETED"], tools=["charge", "lookup"])},
    tools=[Tool("charge", never, {"type": "object"}, guards=[small]),
           Tool("lookup", never, {"type": "object"}, read_only=True),
           Tool("refund", never, {"type": "object"})])])
"""


async def test_a_tripped_breaker_answers_409_until_an_operator_resumes_the_run(
    tmp_path: Any,
) -> None:
    """The model keeps proposing a call the guard refuses: the breaker parks the run, the
    SDK raises ConflictError naming how to resume it, and once an operator resumes it
    (through the journal's inbox: the proxy holds the SQLite journal) the same
    conversation goes on."""
    (tmp_path / "shop.py").write_text(SHOP_APP)
    brain = scripted_brain(
        [Reply(calls=[("charge", '{"cents": 5000}')])] * 3
        + [Reply(calls=[("charge", '{"cents": 50}')])]
    )
    store = await open_sqlite_store(str(tmp_path / "shop.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            async with openai.AsyncOpenAI(
                base_url=server.url, api_key="sk-test", max_retries=0
            ) as client:
                messages = [{"role": "user", "content": "charge"}]
                with pytest.raises(openai.ConflictError) as parked:
                    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
                assert "interlock escalations resume" in str(parked.value)
                run_id = parked.value.response.headers[RUN_HEADER]
                with pytest.raises(openai.ConflictError, match="escalated"):
                    await client.chat.completions.create(
                        model="m",
                        messages=messages,
                        tools=TOOLS,
                        extra_headers={RUN_HEADER: run_id},
                    )
                resumed = await trio.run_process(
                    [
                        *(sys.executable, "-m", "interlock", "escalations", "resume", run_id),
                        *("--app", "shop.py:app", "--db", "shop.db"),
                    ],
                    cwd=tmp_path,
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
                assert resumed.returncode == 0, resumed.stderr.decode()
                again = await client.chat.completions.create(
                    model="m", messages=messages, tools=TOOLS, extra_headers={RUN_HEADER: run_id}
                )
                assert again.choices[0].message.tool_calls[0].function.arguments == '{"cents": 50}'
            server.stop()
    finally:
        await store.aclose()


async def test_an_upstream_answer_that_is_not_a_completion_is_a_502_naming_it(
    tmp_path: Any,
) -> None:
    brain = scripted_brain([Raw(body=b"<html>gateway timeout</html>"), Raw(body=b'{"choices": 5}')])
    store = await open_sqlite_store(str(tmp_path / "j.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            async with openai.AsyncOpenAI(
                base_url=server.url, api_key="sk-test", max_retries=0
            ) as client:
                for _ in range(2):
                    with pytest.raises(openai.APIStatusError) as failed:
                        await client.chat.completions.create(
                            model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS
                        )
                    assert failed.value.status_code == 502
                    assert "not a chat completion" in str(failed.value)
            server.stop()
    finally:
        await store.aclose()


async def test_a_request_the_upstream_refuses_for_its_shape_is_named_with_the_fix(
    tmp_path: Any,
) -> None:
    """The application's conversation carries ``content: null`` beside a call, as the SDK
    sends it; a server that refuses that answers 400, and the proxy passes the refusal on
    with the profile flag that fixes it, not as a transient failure."""
    refusal = b'{"error": {"message": "messages.1.content: Input should be a valid string"}}'
    brain = scripted_brain(
        [Reply(calls=[("charge", '{"cents": 5}')]), Raw(body=refusal, status=400)]
    )
    store = await open_sqlite_store(str(tmp_path / "r.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            async with openai.AsyncOpenAI(
                base_url=server.url, api_key="sk-test", max_retries=0
            ) as client:
                messages: list[Any] = [{"role": "user", "content": "pay"}]
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=messages, tools=TOOLS
                )
                message = raw.parse().choices[0].message
                messages += [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [c.model_dump() for c in message.tool_calls],
                    },
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "ok"},
                ]
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="m",
                        messages=messages,
                        tools=TOOLS,
                        extra_headers={RUN_HEADER: raw.headers[RUN_HEADER]},
                    )
            server.stop()
    finally:
        await store.aclose()
    assert "profile='llama-cpp-python'" in str(refused.value), refused.value
