"""The model proxy's three doors, each met by its official SDK as an unchanged application
would: OpenAI Chat Completions and Responses (``openai``), Anthropic Messages
(``anthropic``), whole answers and streams. The SDKs' own stream accumulators read the
proxy's events, so an event the SDK would not take fails here."""

from __future__ import annotations

import inspect
import json
from functools import partial
from typing import Any

import pytest
import trio

openai = pytest.importorskip("openai", reason="the openai SDK is in the [test] extra")
anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is in the [test] extra")
pytest.importorskip("hypercorn", reason="the [gateway] extra (hypercorn) is missing")

from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

from interlock.modelproxy import KEY_HEADER, RUN_HEADER, serve_model_proxy  # noqa: E402
from interlock.stores import open_sqlite_store  # noqa: E402
from interlock.testing import Reply, open_fake_llm, scripted_brain, tool_results_of  # noqa: E402
from tests.test_model_proxy import MACHINE  # noqa: E402

# The openai SDK breaks out of its SSE loop at ``data: [DONE]`` and leaves its inner async
# generators suspended; trio warns when they are collected. Every server's stream ends that
# way (the fake LLM's tests say the same): the SDK's behaviour under trio, not the proxy's.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|anthropic|httpx2|httpcore2)\.:ResourceWarning"
)

SCHEMA = {"type": "object", "properties": {"cents": {"type": "integer"}}}


class Seen:
    """What the application got from one request: the run, the call (id, name, arguments
    as text), its text, and the raw answer to put back in the conversation."""

    def __init__(self, headers: Any, call: tuple[str, str, str] | None, text: str, turn: Any):
        self.run_id = headers[RUN_HEADER]
        self.key = headers.get(KEY_HEADER)
        self.call = call
        self.text = text
        self.turn = turn


async def _chat(client: Any, state: list[Any], stream: bool, run_id: str | None) -> Seen:
    tools = [{"type": "function", "function": {"name": "charge", "parameters": SCHEMA}}]
    extra = {RUN_HEADER: run_id} if run_id else {}
    if stream:
        accumulated = ChatCompletionStreamState()
        events = await client.chat.completions.create(
            model="m",
            messages=state,
            tools=tools,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=extra,
        )
        headers = events.response.headers
        async for chunk in events:
            accumulated.handle_chunk(chunk)
        completion = accumulated.get_final_completion()
        assert completion.usage is not None  # include_usage: the last chunk carries it
    else:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=state, tools=tools, extra_headers=extra
        )
        headers, completion = raw.headers, raw.parse()
    message = completion.choices[0].message
    call = None
    if message.tool_calls:
        (c,) = message.tool_calls
        call = (c.id, c.function.name, c.function.arguments)
    turn = message.model_dump(exclude_none=True, exclude={"parsed"})
    for c in turn.get("tool_calls") or ():
        c.get("function", {}).pop("parsed_arguments", None)
    return Seen(headers, call, message.content or "", turn)


def _chat_report(state: list[Any], seen: Seen, result: str) -> None:
    assert seen.call is not None
    state += [seen.turn, {"role": "tool", "tool_call_id": seen.call[0], "content": result}]


async def _responses(client: Any, state: list[Any], stream: bool, run_id: str | None) -> Seen:
    tools = [{"type": "function", "name": "charge", "parameters": SCHEMA, "strict": False}]
    extra = {RUN_HEADER: run_id} if run_id else {}
    if stream:
        from openai.lib.streaming.responses import ResponseStreamState

        accumulated = ResponseStreamState(input_tools=tools, text_format=openai.omit)
        response = None
        events = await client.responses.create(
            model="m", input=state, tools=tools, stream=True, extra_headers=extra
        )
        headers = events.response.headers
        async for event in events:
            accumulated.handle_event(event)
            if event.type == "response.completed":
                response = event.response
        assert response is not None
    else:
        raw = await client.responses.with_raw_response.create(
            model="m", input=state, tools=tools, extra_headers=extra
        )
        headers, response = raw.headers, raw.parse()
    calls = [i for i in response.output if i.type == "function_call"]
    call = None
    if calls:
        (c,) = calls
        call = (c.call_id, c.name, c.arguments)
    turn = [i.model_dump(exclude_none=True) for i in response.output]
    return Seen(headers, call, response.output_text, turn)


def _responses_report(state: list[Any], seen: Seen, result: str) -> None:
    assert seen.call is not None
    state += [
        *seen.turn,
        {"type": "function_call_output", "call_id": seen.call[0], "output": result},
    ]


async def _messages(client: Any, state: list[Any], stream: bool, run_id: str | None) -> Seen:
    tools = [{"name": "charge", "input_schema": SCHEMA}]
    extra = {RUN_HEADER: run_id} if run_id else {}
    if stream:
        message = None
        bufs: dict[int, bytes] = {}
        events = await client.messages.create(
            model="m", max_tokens=256, messages=state, tools=tools, stream=True, extra_headers=extra
        )
        headers = events.response.headers
        async for event in events:
            message = accumulate_event(event=event, current_snapshot=message, json_bufs=bufs)
        assert message is not None
    else:
        raw = await client.messages.with_raw_response.create(
            model="m", max_tokens=256, messages=state, tools=tools, extra_headers=extra
        )
        headers, message = raw.headers, raw.parse()
        if inspect.isawaitable(message):  # anthropic's raw response parses asynchronously
            message = await message
    uses = [b for b in message.content if b.type == "tool_use"]
    call = None
    if uses:
        (c,) = uses
        call = (c.id, c.name, json.dumps(c.input))
    text = "".join(b.text for b in message.content if b.type == "text")
    turn = {
        "role": "assistant",
        "content": [b.model_dump(exclude_none=True) for b in message.content],
    }
    return Seen(headers, call, text, turn)


def _messages_report(state: list[Any], seen: Seen, result: str) -> None:
    assert seen.call is not None
    block = {"type": "tool_result", "tool_use_id": seen.call[0], "content": result}
    state += [seen.turn, {"role": "user", "content": [block]}]


DOORS = {
    "chat": (_chat, _chat_report),
    "responses": (_responses, _responses_report),
    "messages": (_messages, _messages_report),
}


def _client(api: str, url: str) -> Any:
    if api == "messages":
        return anthropic.AsyncAnthropic(
            base_url=url.removesuffix("/v1"), api_key="k", max_retries=0
        )
    return openai.AsyncOpenAI(base_url=url, api_key="sk-test", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", list(DOORS))
async def test_each_sdk_gets_only_verified_calls_keyed_and_its_results_are_journaled(
    api: str, stream: bool, tmp_path: Any
) -> None:
    """The model first proposes a charge the guard refuses; the proxy asks again with the
    refusal as that call's result; the application gets only the good call, its id the
    idempotency key, as a whole answer or as the API's stream; it reports the result the
    usual way and the proxy journals it as the commit."""
    ask, report = DOORS[api]
    brain = scripted_brain(
        [
            Reply(calls=[("charge", '{"cents": 5000}')]),
            # text beside a call, as Claude and GPT write it: passed on with the call
            Reply(text="Charging now.", calls=[("charge", '{"cents": 500}')]),
            Reply(text="charged 5 dollars"),
        ]
    )
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            client = _client(api, server.url)
            state: list[Any] = [{"role": "user", "content": "charge me 5 dollars"}]
            first = await ask(client, state, stream, None)
            assert first.call is not None, first.text
            key, name, arguments = first.call
            assert (name, json.loads(arguments)) == ("charge", {"cents": 500})
            assert key == first.key
            assert key.startswith(first.run_id)
            assert first.text == "Charging now."
            report(state, first, '{"charged": 500}')
            final = await ask(client, state, stream, first.run_id)
            assert final.call is None
            assert final.text == "charged 5 dollars"
            await client.close()
            server.stop()
            requests = fake.requests
    finally:
        await store.aclose()
    assert [r.path.rsplit("/", 1)[-1] for r in requests] == [
        {"chat": "completions", "responses": "responses", "messages": "messages"}[api]
    ] * 3
    assert not any(r.body.get("stream") for r in requests)  # held until decided
    refusal = tool_results_of(api, requests[1].body)[-1]
    assert "is over 1000" in str(refusal[1]), refusal
    results = tool_results_of(api, requests[2].body)
    # the upstream hears of its call under its own id (a Responses upstream may keep the
    # conversation and know it by no other); Chat and Messages pass the conversation as is
    assert results[-1][1] == '{"charged": 500}'
    assert (results[-1][0] == key) == (api != "responses"), results
    reader = await open_sqlite_store(str(tmp_path / "p.db"), readonly=True)
    try:
        events = await reader.load(first.run_id)
    finally:
        await reader.aclose()
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("ProposalRejected") == 1, kinds
    committed = [e for e in events if type(e).__name__ == "ToolCommitted"]
    assert [(e.key, e.result) for e in committed] == [(key, '{"charged": 500}')]


@pytest.mark.parametrize("api", list(DOORS))
async def test_past_its_reasks_a_refusal_is_the_apis_own_text_answer_and_a_breaker_parks(
    api: str, tmp_path: Any
) -> None:
    """reasks=0: the first refusal is answered at once, as the assistant's text in the API's
    shape; the model keeps proposing the bad call and the breaker escalates the run, which
    each SDK raises as a 409 naming how to resume it."""
    ask, _report = DOORS[api]
    brain = scripted_brain([Reply(calls=[("charge", '{"cents": 5000}')])] * 4)
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store, reasks=0)
            )
            client = _client(api, server.url)
            state: list[Any] = [{"role": "user", "content": "charge me 50 dollars"}]
            first = await ask(client, state, False, None)
            assert first.call is None
            assert first.text.startswith("interlock refused the model's call: ")
            assert "is over 1000" in first.text
            conflict = openai.ConflictError if api != "messages" else anthropic.ConflictError
            answers = []
            with pytest.raises(conflict) as parked:  # noqa: PT012 - the breaker trips on one
                for _ in range(3):
                    answers.append(await ask(client, state, False, first.run_id))
            assert all(a.call is None for a in answers)  # none let the bad call through
            assert "interlock escalations resume" in str(parked.value)
            await client.close()
            server.stop()
    finally:
        await store.aclose()


async def test_a_responses_conversation_kept_upstream_gets_the_upstreams_own_call_ids(
    tmp_path: Any,
) -> None:
    """An application on previous_response_id sends only the call's output, under the key it
    was given; the upstream that keeps the conversation knows the call by its own id, and
    the proxy maps the key back."""
    brain = scripted_brain([Reply(calls=[("charge", '{"cents": 5}')]), Reply(text="done")])
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            async with openai.AsyncOpenAI(base_url=server.url, api_key="k", max_retries=0) as c:
                tools = [{"type": "function", "name": "charge", "parameters": SCHEMA}]
                raw = await c.responses.with_raw_response.create(
                    model="m", input="pay", tools=tools
                )
                first = raw.parse()
                (call,) = [i for i in first.output if i.type == "function_call"]
                assert call.call_id == raw.headers[KEY_HEADER]
                final = await c.responses.create(
                    model="m",
                    previous_response_id=first.id,
                    input=[
                        {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}
                    ],
                    tools=tools,
                    extra_headers={RUN_HEADER: raw.headers[RUN_HEADER]},
                )
                assert final.output_text == "done"
            server.stop()
            requests = fake.requests
    finally:
        await store.aclose()
    (sent,) = tool_results_of("responses", requests[1].body)
    assert sent[0] != call.call_id, sent
    assert sent[0].startswith("call_"), sent  # the upstream's own id
    assert requests[1].body["previous_response_id"] == first.id


async def test_an_application_that_names_its_own_run_keeps_it_across_requests(
    tmp_path: Any,
) -> None:
    """A framework that never reads a response header sets the run once, as the client's
    default header: the first request starts the run under that name, the next continue it
    (the machine's state and breakers hold across the conversation)."""
    brain = scripted_brain([Reply(calls=[("charge", '{"cents": 5}')]), Reply(text="done")])
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            async with openai.AsyncOpenAI(
                base_url=server.url,
                api_key="k",
                max_retries=0,
                default_headers={RUN_HEADER: "order-7"},
            ) as client:
                tools = [{"type": "function", "function": {"name": "charge", "parameters": SCHEMA}}]
                messages: list[Any] = [{"role": "user", "content": "pay"}]
                first = await client.chat.completions.create(
                    model="m", messages=messages, tools=tools
                )
                (call,) = first.choices[0].message.tool_calls
                assert call.id.startswith("order-7:")
                messages += [
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "ok"},
                ]
                final = await client.chat.completions.create(
                    model="m", messages=messages, tools=tools
                )
                assert final.choices[0].message.content == "done"
            server.stop()
    finally:
        await store.aclose()
    reader = await open_sqlite_store(str(tmp_path / "p.db"), readonly=True)
    try:
        kinds = [type(e).__name__ for e in await reader.load("order-7")]
    finally:
        await reader.aclose()
    assert kinds.count("ToolCommitted") == 1, kinds


MACHINE_FILE = """
[machine]
name = "shop"
initial = "PAY"
reasks = 0

[states.PAY]
tools = ["charge"]
next = ["COMPLETED"]

[tools.charge]
schema = { type = "object", properties = { cents = { type = "integer" } }, required = ["cents"], additionalProperties = false }
guards = [{ when = "args.cents <= 1000", message = "a charge is at most 1000 cents", hint = "charge 1000 or less" }]
"""


def test_the_command_takes_a_toml_machine_file_and_its_reasks(tmp_path: Any) -> None:
    """`interlock proxy --machine shop.toml`: the file's schema and CEL guard hold, its
    `reasks = 0` answers the refusal at once, and `interlock replay` rebuilds the run from
    the same file with no upstream."""
    import subprocess
    import sys

    from tests.test_model_proxy import proxy_command

    (tmp_path / "shop.toml").write_text(MACHINE_FILE)
    brain = scripted_brain([Reply(calls=[("charge", '{"cents": 5000}')])])
    with proxy_command(tmp_path, brain, "--machine", "shop.toml", "--db", "shop.db") as proxy:
        client = openai.OpenAI(base_url=proxy.url, api_key="k", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": "pay"}],
            tools=[{"type": "function", "function": {"name": "charge", "parameters": SCHEMA}}],
        )
        message = raw.parse().choices[0].message
        run_id = raw.headers[RUN_HEADER]
    assert proxy.code == 0, proxy.log
    assert message.tool_calls is None
    assert message.content == (
        "interlock refused the model's call: charge: a charge is at most 1000 cents; charge 1000 or less"
    )
    replayed = subprocess.run(
        [
            sys.executable,
            "-m",
            "interlock",
            "replay",
            run_id,
            "--machine",
            "shop.toml",
            "--db",
            "shop.db",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


@pytest.mark.parametrize("kind", ["read-only", "may change something"])
async def test_a_call_that_may_change_something_reaches_the_application_only_once_its_intent_is_durable(
    tmp_path: Any, kind: str
) -> None:
    """The application may execute a call the moment it hears of it: a call of a tool that
    may change something is answered only after its intent and key are written; a
    read-only one is answered while the write is still held (a crash loses nothing that
    matters: the call is made again). Both are journaled, intent then commit."""
    from interlock import open_supervisor
    from interlock.modelproxy import ModelProxy
    from interlock.providers._http import Transport
    from tests.test_mcp_proxy import _GatedStore

    name = "lookup" if kind == "read-only" else "charge"
    brain = scripted_brain([Reply(calls=[(name, '{"cents": 5}')]), Reply(text="done")])
    inner = await open_sqlite_store(str(tmp_path / "j.db"), synchronous="FULL")
    store = _GatedStore(inner)
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("charge", "lookup")
    ]
    request = {"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": tools}
    async with (
        open_fake_llm(brain) as fake,
        Transport(fake.openai_base_url) as transport,
        open_supervisor([MACHINE], store) as sup,  # type: ignore[arg-type]
    ):
        proxy = ModelProxy(sup, MACHINE, transport)
        await sup.external.start(MACHINE.name, {}, run_id="r-1")  # its start is written
        store.gate = trio.Event()  # hold every write from here on
        before = store.written
        answers: list[Any] = []
        answered = trio.Event()

        async def ask() -> None:
            body = json.dumps(request).encode()
            answers.append(await proxy.handle("/v1/chat/completions", body, {RUN_HEADER: "r-1"}))
            answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            with trio.move_on_after(2):
                await answered.wait()
            if kind == "read-only":
                assert answers  # answered with its writes still held
                assert store.written == before
            else:
                assert not answers  # its intent is not durable: the application waits
            store.gate.set()
        (answer,) = answers
        assert answer.status == 200, answer.body
        if kind != "read-only":
            assert store.written > before  # answered once the intent was written
        run_id = dict(answer.headers)[RUN_HEADER]
        key = dict(answer.headers)[KEY_HEADER]
        follow = {
            **request,
            "messages": [
                *request["messages"],
                json.loads(answer.body)["choices"][0]["message"],
                {"role": "tool", "tool_call_id": key, "content": "ok"},
            ],
        }
        final = await proxy.handle(
            "/v1/chat/completions", json.dumps(follow).encode(), {RUN_HEADER: run_id}
        )
        assert final.status == 200, final.body
        await sup.external.sync(run_id)
    events = await inner.load(run_id)
    await inner.aclose()
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("IntentRecorded") < kinds.index("ToolCommitted"), kinds


async def test_what_the_real_model_cannot_show_parallel_calls_a_cut_off_answer_and_a_429(
    tmp_path: Any,
) -> None:
    """With the fake upstream: a parallel answer hands on its first call only (the others
    are journaled with the proposal, never reach the application); an answer cut off at the
    output limit is not a call, and the model is asked again, told why; a 429 reaches the
    application as a 429 with the upstream's Retry-After, which the SDK obeys and retries."""
    from interlock.testing import Fault

    brain = scripted_brain(
        [
            Reply(calls=[("charge", '{"cents": 1}'), ("charge", '{"cents": 2}')]),
            Reply(calls=[("charge", '{"cents": 3')], finish="length"),
            Reply(calls=[("charge", '{"cents": 3}')]),
            Fault(status=429, retry_after=0.2),
            Reply(text="all done"),
        ]
    )
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            async with openai.AsyncOpenAI(base_url=server.url, api_key="k", max_retries=0) as c:
                state: list[Any] = [{"role": "user", "content": "pay twice"}]
                first = await _chat(c, state, False, None)
                assert first.call is not None
                assert json.loads(first.call[2]) == {"cents": 1}  # the first call only
                assert len(first.turn["tool_calls"]) == 1
                _chat_report(state, first, "ok")
                second = await _chat(c, state, False, first.run_id)
                assert second.call is not None
                assert json.loads(second.call[2]) == {"cents": 3}  # the whole one
                _chat_report(state, second, "ok")
                with pytest.raises(openai.RateLimitError) as limited:
                    await _chat(c, state, False, first.run_id)
                assert limited.value.response.headers["retry-after"] == "1"
            async with openai.AsyncOpenAI(base_url=server.url, api_key="k", max_retries=1) as c:
                final = await _chat(c, state, False, first.run_id)  # the SDK's retry
                assert final.text == "all done"
            server.stop()
            requests = fake.requests
    finally:
        await store.aclose()
    cut = tool_results_of("chat", requests[2].body)[-1]
    assert "output limit" in str(cut[1]) or "finish_reason" in str(cut[1]), cut
    reader = await open_sqlite_store(str(tmp_path / "p.db"), readonly=True)
    try:
        events = await reader.load(first.run_id)
    finally:
        await reader.aclose()
    extra = [e.extra_calls for e in events if type(e).__name__ == "ModelCalled"]
    assert (("charge", '{"cents": 2}'),) in extra, extra  # journaled, never handed on
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("ToolCommitted") == 2, kinds
    assert kinds.count("ProposalRejected") == 1, kinds


async def test_a_run_left_idle_leaves_memory_and_its_next_request_reads_it_again(
    tmp_path: Any,
) -> None:
    """An application never says a conversation is over: a run no request used for the
    idle time is dropped from the proxy's memory once durable, and its next request folds
    it again from the journal and goes on (the pending call's result journaled)."""
    from interlock import open_supervisor
    from interlock.modelproxy import ModelProxy
    from interlock.providers._http import Transport

    brain = scripted_brain([Reply(calls=[("charge", '{"cents": 5}')]), Reply(text="done")])
    store = await open_sqlite_store(str(tmp_path / "j.db"))
    tools = [{"type": "function", "function": {"name": "charge", "parameters": SCHEMA}}]
    request = {"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": tools}
    async with (
        open_fake_llm(brain) as fake,
        Transport(fake.openai_base_url) as transport,
        open_supervisor([MACHINE], store) as sup,
        trio.open_nursery() as nursery,
    ):
        proxy = ModelProxy(sup, MACHINE, transport)
        nursery.start_soon(proxy.forget_idle, 0.2)
        first = await proxy.handle("/v1/chat/completions", json.dumps(request).encode(), {})
        run_id = dict(first.headers)[RUN_HEADER]
        key = dict(first.headers)[KEY_HEADER]
        assert sup.external.get(run_id) is not None
        with trio.fail_after(10):
            while sup.external.get(run_id) is not None:  # noqa: ASYNC110 - no event to await
                await trio.sleep(0.05)
        follow = {
            **request,
            "messages": [
                *request["messages"],
                json.loads(first.body)["choices"][0]["message"],
                {"role": "tool", "tool_call_id": key, "content": "ok"},
            ],
        }
        final = await proxy.handle(
            "/v1/chat/completions", json.dumps(follow).encode(), {RUN_HEADER: run_id}
        )
        assert final.status == 200, final.body
        assert json.loads(final.body)["choices"][0]["message"]["content"] == "done"
        await sup.external.sync(run_id)
        nursery.cancel_scope.cancel()
    events = await store.load(run_id)
    await store.aclose()
    committed = [e for e in events if type(e).__name__ == "ToolCommitted"]
    assert [(e.key, e.result) for e in committed] == [(key, "ok")]


async def test_the_guardrail_endpoint_names_bad_input_and_keeps_no_anonymous_run(
    tmp_path: Any,
) -> None:
    """LiteLLM's guardrail requests, posted as LiteLLM posts them: a body that is not one
    is a 400 naming what it must be; a run header LiteLLM was not told to pass on (it shows
    ``[present]``) is a 400 naming the config key; a request with no run is checked as a
    run of one call, blocked when the gate refuses it, and not kept in memory after."""
    import httpx

    from interlock.modelproxy import GUARDRAIL_PATH

    store = await open_sqlite_store(str(tmp_path / "g.db"))
    try:
        async with open_fake_llm(scripted_brain([])) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            url = server.anthropic_url + GUARDRAIL_PATH

            def call(cents: int) -> dict[str, Any]:
                arguments = json.dumps({"cents": cents})
                return {"id": "c1", "type": "function",
                        "function": {"name": "charge", "arguments": arguments}}  # fmt: skip

            async with httpx.AsyncClient(timeout=30) as http:
                junk = await http.post(url, content=b"{nope")
                shape = await http.post(url, json={"texts": ["hi"]})
                hidden = await http.post(
                    url,
                    json={"input_type": "request", "request_data": {},
                          "request_headers": {RUN_HEADER: "[present]"}},
                )  # fmt: skip
                before = await http.post(
                    url, json={"input_type": "request", "request_data": {}, "litellm_call_id": "x1"}
                )
                misnamed = await http.post(
                    url,
                    json={"input_type": "request", "request_data": {},
                          "request_headers": {RUN_HEADER: "no spaces/slashes"}},
                )  # fmt: skip
                bad = await http.post(
                    url,
                    json={"input_type": "response", "request_data": {}, "litellm_call_id": "x1",
                          "tool_calls": [call(5000)]},
                )  # fmt: skip
                good = await http.post(
                    url,
                    json={"input_type": "response", "request_data": {}, "litellm_call_id": "x2",
                          "tool_calls": [call(50)]},
                )  # fmt: skip
            held = [
                r for r in ("litellm-x1", "litellm-x2") if server.proxy.supervisor.external.get(r)
            ]
            assert held == []  # runs of one call: not kept in memory
            server.stop()
    finally:
        await store.aclose()
    assert (junk.status_code, shape.status_code, hidden.status_code) == (400, 400, 400)
    assert "not JSON" in junk.json()["error"]["message"]
    assert "input_type" in shape.json()["error"]["message"]
    assert "extra_headers" in hidden.json()["error"]["message"]
    assert before.json() == {"action": "NONE"}
    assert misnamed.json()["action"] == "BLOCKED"  # the run's name is named, with the fix
    assert "is not a run name" in misnamed.json()["blocked_reason"], misnamed.json()
    assert bad.json()["action"] == "BLOCKED"
    assert "cents" in bad.json()["blocked_reason"], bad.json()
    assert good.json() == {"action": "NONE"}
    reader = await open_sqlite_store(str(tmp_path / "g.db"), readonly=True)
    try:
        runs = {r.run_id for r in await reader.list_runs()}
    finally:
        await reader.aclose()
    assert runs == {"litellm-x1", "litellm-x2"}  # journaled, each its own run


async def test_an_upstream_base_url_without_its_v1_is_named_with_the_fix(tmp_path: Any) -> None:
    """`--upstream http://host:port` for an OpenAI-style server (no /v1): the upstream's 404
    reaches the application naming the URL asked and what --upstream should be."""
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(scripted_brain([])) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.anthropic_base_url, store)
            )
            async with openai.AsyncOpenAI(base_url=server.url, api_key="k", max_retries=0) as c:
                with pytest.raises(openai.NotFoundError) as missing:
                    await c.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}]
                    )
            server.stop()
    finally:
        await store.aclose()
    assert f"no {fake.anthropic_base_url}/chat/completions" in str(missing.value)
    assert "ends in /v1" in str(missing.value)


@pytest.mark.parametrize("api", list(DOORS))
async def test_a_tool_choice_naming_a_tool_the_state_does_not_allow_is_not_sent_upstream(
    api: str, tmp_path: Any
) -> None:
    """The application forces a tool the run's state does not allow (``refund``): the
    upstream is offered only the allowed tools, without the tool_choice that names one it
    no longer has (which the real APIs refuse); one that names an allowed tool stays."""
    brain = scripted_brain([Reply(text="no")] * 2)
    names = {"chat": ("function", "function"), "responses": ("function", None),
             "messages": ("tool", None)}  # fmt: skip
    kind, nested = names[api]

    def choice(tool: str) -> dict[str, Any]:
        return {"type": kind, nested: {"name": tool}} if nested else {"type": kind, "name": tool}

    def tools(*wanted: str) -> list[dict[str, Any]]:
        if api == "chat":
            return [
                {"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in wanted
            ]
        if api == "responses":
            return [{"type": "function", "name": n, "parameters": SCHEMA} for n in wanted]
        return [{"name": n, "input_schema": SCHEMA} for n in wanted]

    body: dict[str, Any] = {"model": "m", "tools": tools("charge", "refund")}
    if api == "responses":
        body["input"] = "go"
    else:
        body["messages"] = [{"role": "user", "content": "go"}]
    if api == "messages":
        body["max_tokens"] = 64
    store = await open_sqlite_store(str(tmp_path / "p.db"))
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            import httpx

            path = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}
            async with httpx.AsyncClient(timeout=30) as http:
                for tool in ("refund", "charge"):
                    sent = await http.post(
                        server.url + path[api], json={**body, "tool_choice": choice(tool)}
                    )
                    assert sent.status_code == 200, sent.text
            server.stop()
            requests = fake.requests
    finally:
        await store.aclose()
    forced, allowed = (r.body for r in requests)
    assert "tool_choice" not in forced
    assert allowed["tool_choice"] == choice("charge")
    assert [t for t in forced["tools"]] == tools("charge")
