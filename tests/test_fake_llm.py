"""The fake LLM server speaks the real wire formats: the official SDKs parse it over loopback.

Every test runs the server on a real socket. The ``openai`` and ``anthropic`` packages (the
test extra) prove the formats; raw ``httpx`` requests pin the exact bytes of each quirk and
fault.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
import trio

from interlock.testing._fake import (
    API_PATHS,
    Fault,
    Raw,
    Reply,
    open_fake_llm,
    render_body,
    scripted_brain,
    serve_fake_llm,
    tool_results_of,
    tools_of,
)

# The openai SDK breaks out of its SSE loop at ``data: [DONE]`` (and both SDKs at an error
# event) and leaves its inner async generators suspended; trio warns when they are collected.
# Every real stream ends that way: it is the SDKs' behaviour under trio, not the fake's.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|anthropic|httpx2|httpcore2)\.:ResourceWarning"
)

TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
        },
    }
]
USER = [{"role": "user", "content": "find order 7"}]
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "gpt-test", "messages": USER},
    "responses": {"model": "gpt-test", "input": "find order 7"},
    "messages": {"model": "claude-test", "max_tokens": 64, "messages": USER},
}


def openai_client(fake: Any, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fake.openai_base_url, api_key="sk-test", **kwargs)


def anthropic_client(fake: Any, **kwargs: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=fake.anthropic_base_url, api_key="test", **kwargs)


async def post(fake: Any, api: str, **extra: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(fake.url + API_PATHS[api], json={**BODIES[api], **extra})


async def read_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> bytes:
    """The whole body of a streamed answer, read chunk by chunk as it arrives."""
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_bytes()])


async def drain(stream: Any) -> None:
    async for _ in stream:
        pass


def sse_data(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded ("[DONE]" kept as a string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# --- the official OpenAI SDK: Chat Completions --------------------------------------------


async def test_openai_sdk_parses_a_chat_tool_call_text_and_usage() -> None:
    reply = Reply(calls=[("lookup", '{"id": 7}')], text="checking", usage=(120, 9, 100, 4))
    async with open_fake_llm(scripted_brain([reply])) as fake, openai_client(fake) as client:
        completion = await client.chat.completions.create(
            model="gpt-test", messages=USER, tools=TOOLS_CHAT
        )
    assert completion.id == "chatcmpl-1"
    assert completion.object == "chat.completion"
    assert completion.model == "gpt-test"
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "checking"
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_1_0", "function", "lookup")
    assert call.function.arguments == '{"id": 7}'
    assert completion.usage.prompt_tokens == 120
    assert completion.usage.completion_tokens == 9
    assert completion.usage.total_tokens == 129
    assert completion.usage.prompt_tokens_details.cached_tokens == 100
    assert completion.usage.completion_tokens_details.reasoning_tokens == 4
    assert fake.requests[0].body["tools"] == TOOLS_CHAT


async def test_openai_sdk_parses_chat_text_and_refusal() -> None:
    brain = scripted_brain([Reply(text="all done"), Reply(refusal="I can't help with that.")])
    async with open_fake_llm(brain) as fake, openai_client(fake) as client:
        text = await client.chat.completions.create(model="gpt-test", messages=USER)
        refused = await client.chat.completions.create(model="gpt-test", messages=USER)
    assert text.choices[0].message.content == "all done"
    assert text.choices[0].message.tool_calls is None
    assert text.choices[0].finish_reason == "stop"
    assert refused.choices[0].message.refusal == "I can't help with that."
    assert refused.choices[0].message.content is None


async def test_openai_sdk_assembles_a_streamed_chat_tool_call_from_its_deltas() -> None:
    arguments = '{"id": 7, "note": "rush"}'
    reply = Reply(calls=[("lookup", arguments), ("lookup", '{"id": 8}')], usage=(50, 20, 10, 0))
    async with open_fake_llm(scripted_brain([reply])) as fake, openai_client(fake) as client:
        stream = await client.chat.completions.create(
            model="gpt-test",
            messages=USER,
            tools=TOOLS_CHAT,
            stream=True,
            stream_options={"include_usage": True},
        )
        calls: dict[int, dict[str, str]] = {}
        pieces: dict[int, int] = {}
        finish, usage = None, None
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
                continue
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                pieces[delta.index] = pieces.get(delta.index, 0) + bool(delta.function.arguments)
    assert calls == {
        0: {"id": "call_1_0", "name": "lookup", "arguments": arguments},
        1: {"id": "call_1_1", "name": "lookup", "arguments": '{"id": 8}'},
    }
    assert pieces[0] > 1  # the arguments arrived over several chunks
    assert finish == "tool_calls"
    assert usage.prompt_tokens == 50
    assert usage.prompt_tokens_details.cached_tokens == 10


async def test_openai_sdk_stream_helper_accumulates_the_final_chat_completion() -> None:
    reply = Reply(text="on it", calls=[("lookup", '{"id": 7}')])
    async with (
        open_fake_llm(scripted_brain([reply])) as fake,
        openai_client(fake) as client,
        client.chat.completions.stream(model="gpt-test", messages=USER, tools=TOOLS_CHAT) as stream,
    ):
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "on it"
    assert message.tool_calls[0].function.arguments == '{"id": 7}'
    assert final.choices[0].finish_reason == "tool_calls"


# --- the official OpenAI SDK: Responses ---------------------------------------------------


async def test_openai_sdk_parses_a_responses_function_call_and_usage() -> None:
    reply = Reply(text="checking", calls=[("lookup", '{"id": 7}')], usage=(80, 6, 64, 3))
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    async with open_fake_llm(scripted_brain([reply])) as fake, openai_client(fake) as client:
        response = await client.responses.create(model="gpt-test", input="find", tools=tools)
    assert (response.id, response.object, response.status) == ("resp_1", "response", "completed")
    message, call = response.output
    assert message.type == "message"
    assert response.output_text == "checking"
    assert call.type == "function_call"
    assert (call.id, call.call_id, call.name) == ("fc_1_0", "call_1_0", "lookup")
    assert call.arguments == '{"id": 7}'
    assert response.usage.input_tokens == 80
    assert response.usage.output_tokens == 6
    assert response.usage.input_tokens_details.cached_tokens == 64
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    assert response.tools[0].name == "lookup"


async def test_openai_sdk_streams_responses_events_and_assembles_the_call() -> None:
    arguments = '{"id": 7, "note": "rush"}'
    reply = Reply(calls=[("lookup", arguments)], usage=(30, 8, 0, 0))
    async with open_fake_llm(scripted_brain([reply, reply])) as fake, openai_client(fake) as client:
        stream = await client.responses.create(model="gpt-test", input="find", stream=True)
        kinds, deltas, done, completed = [], [], None, None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
            elif event.type == "response.output_item.done":
                done = event.item
            elif event.type == "response.completed":
                completed = event.response
        async with client.responses.stream(model="gpt-test", input="find") as helper:
            final = await helper.get_final_response()
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert len(deltas) > 1
    assert "".join(deltas) == arguments
    assert (done.type, done.call_id, done.arguments) == ("function_call", "call_1_0", arguments)
    assert completed.usage.input_tokens == 30
    assert completed.usage.output_tokens == 8
    assert final.output[0].arguments == arguments
    assert final.output[0].call_id == "call_2_0"


# --- the official OpenAI SDK: errors -------------------------------------------------------


async def test_openai_sdk_raises_rate_limit_error_with_the_documented_body() -> None:
    fault = Fault(status=429, retry_after=7, message="Rate limit reached for requests")
    async with (
        open_fake_llm(scripted_brain([fault])) as fake,
        openai_client(fake, max_retries=0) as client,
    ):
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="gpt-test", messages=USER)
    error = caught.value
    assert error.status_code == 429
    assert error.code == "rate_limit_exceeded"
    assert error.type == "requests"
    assert error.response.headers["retry-after"] == "7"
    assert "Rate limit reached for requests" in str(error)


async def test_openai_sdk_retries_429_and_500_then_succeeds() -> None:
    brain = scripted_brain(
        [Fault(status=429, retry_after_ms=1), Fault(status=500, retry_after_ms=1), Reply(text="ok")]
    )
    async with open_fake_llm(brain) as fake, openai_client(fake, max_retries=2) as client:
        completion = await client.chat.completions.create(model="gpt-test", messages=USER)
    assert completion.choices[0].message.content == "ok"
    assert fake.count == 3


async def test_openai_sdk_surfaces_rate_limit_error_after_its_retries() -> None:
    brain = scripted_brain([Fault(status=429, retry_after_ms=1)] * 3)
    async with open_fake_llm(brain) as fake, openai_client(fake, max_retries=2) as client:
        with pytest.raises(openai.RateLimitError):
            await client.responses.create(model="gpt-test", input="find")
    assert fake.count == 3


async def test_openai_sdk_raises_bad_request_and_server_errors() -> None:
    brain = scripted_brain([Fault(status=400, message="bad tools"), Fault(status=500)])
    async with (
        open_fake_llm(brain) as fake,
        openai_client(fake, max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError, match="bad tools"):
            await client.chat.completions.create(model="gpt-test", messages=USER)
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="gpt-test", messages=USER)


# --- the official Anthropic SDK -----------------------------------------------------------


async def test_anthropic_sdk_parses_tool_use_stop_reason_and_cache_usage() -> None:
    reply = Reply(
        text="checking", calls=[("lookup", '{"id": 7}')], usage=(200, 12, 150, 0), cache_creation=30
    )
    async with open_fake_llm(scripted_brain([reply])) as fake, anthropic_client(fake) as client:
        message = await client.messages.create(model="claude-test", max_tokens=64, messages=USER)
    assert (message.id, message.type, message.role) == ("msg_1", "message", "assistant")
    text, tool_use = message.content
    assert (text.type, text.text) == ("text", "checking")
    assert (tool_use.type, tool_use.id, tool_use.name) == ("tool_use", "toolu_1_0", "lookup")
    assert tool_use.input == {"id": 7}
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 20  # 200 in all: 150 read from the cache, 30 written
    assert message.usage.cache_read_input_tokens == 150
    assert message.usage.cache_creation_input_tokens == 30
    assert message.usage.output_tokens == 12
    headers = fake.requests[0].headers
    assert "anthropic-version" in headers
    assert "test" not in (headers.get("x-api-key", ""), headers.get("authorization", ""))


async def test_anthropic_sdk_parses_end_turn_max_tokens_and_refusal() -> None:
    brain = scripted_brain(
        [
            Reply(text="done"),
            Reply(text="cut", finish="max_tokens"),
            Reply(refusal="This request is not something I can help with."),
        ]
    )
    async with open_fake_llm(brain) as fake, anthropic_client(fake) as client:
        done, cut, refused = [
            await client.messages.create(model="claude-test", max_tokens=64, messages=USER)
            for _ in range(3)
        ]
    assert done.stop_reason == "end_turn"
    assert cut.stop_reason == "max_tokens"
    assert refused.stop_reason == "refusal"
    assert refused.stop_details.explanation == "This request is not something I can help with."
    assert refused.content == []


async def test_anthropic_sdk_stream_assembles_tool_input_from_partial_json() -> None:
    arguments = '{"id": 7, "note": "rush"}'
    reply = Reply(text="checking", calls=[("lookup", arguments)], usage=(40, 15, 8, 0))
    async with (
        open_fake_llm(scripted_brain([reply])) as fake,
        anthropic_client(fake) as client,
        client.messages.stream(model="claude-test", max_tokens=64, messages=USER) as stream,
    ):
        kinds, partials, texts = [], [], []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "input_json":
                partials.append(event.partial_json)
            elif event.type == "text":
                texts.append(event.text)
        final = await stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "content_block_start" in kinds
    assert "content_block_stop" in kinds
    assert "message_delta" in kinds
    assert len(partials) > 1
    assert "".join(partials) == arguments
    assert "".join(texts) == "checking"
    assert final.content[1].input == {"id": 7, "note": "rush"}
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 15
    assert final.usage.cache_read_input_tokens == 8
    assert fake.requests[0].body["stream"] is True


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (429, anthropic.RateLimitError),
        (529, anthropic.OverloadedError),
        (500, anthropic.InternalServerError),
        (400, anthropic.BadRequestError),
        (401, anthropic.AuthenticationError),
    ],
)
async def test_anthropic_sdk_raises_its_error_for_each_status(
    status: int, error: type[Exception]
) -> None:
    brain = scripted_brain([Fault(status=status, message=f"failure {status}")])
    async with (
        open_fake_llm(brain) as fake,
        anthropic_client(fake, max_retries=0) as client,
    ):
        with pytest.raises(error, match=f"failure {status}") as caught:
            await client.messages.create(model="claude-test", max_tokens=64, messages=USER)
    assert caught.value.status_code == status
    assert caught.value.body["type"] == "error"


async def test_anthropic_sdk_retries_529_honouring_retry_after_ms() -> None:
    brain = scripted_brain([Fault(status=529, retry_after_ms=1), Reply(text="ok")])
    async with open_fake_llm(brain) as fake, anthropic_client(fake, max_retries=1) as client:
        message = await client.messages.create(model="claude-test", max_tokens=64, messages=USER)
    assert message.content[0].text == "ok"
    assert fake.count == 2


# --- raw bytes: each quirk ----------------------------------------------------------------


async def test_arguments_are_sent_byte_for_byte_with_duplicate_keys() -> None:
    arguments = '{"id": 7, "id": 8,  "x":"\\u00e9"}'
    reply = Reply(calls=[("lookup", arguments)])
    async with open_fake_llm(scripted_brain([reply] * 3)) as fake:
        chat = await post(fake, "chat")
        responses = await post(fake, "responses")
        messages = await post(fake, "messages")
    assert chat.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == (
        arguments
    )
    assert responses.json()["output"][0]["arguments"] == arguments
    # Messages splices the text in raw as the input object: duplicate keys reach the client
    assert b'"input":' + arguments.encode() + b"}" in messages.content


async def test_mapping_arguments_are_encoded_to_a_json_string() -> None:
    reply = Reply(calls=[("lookup", {"id": 7})])
    async with open_fake_llm(scripted_brain([reply])) as fake:
        chat = await post(fake, "chat")
    assert chat.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == (
        '{"id":7}'
    )


async def test_quirk_arguments_as_object() -> None:
    reply = Reply(calls=[("lookup", '{"id": 7}')], arguments_as_object=True)
    async with open_fake_llm(scripted_brain([reply] * 3)) as fake:
        chat = await post(fake, "chat")
        streamed = await post(fake, "chat", stream=True)
        responses = await post(fake, "responses")
    function = chat.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert function["arguments"] == {"id": 7}
    assert b'"arguments":{"id": 7}' in chat.content
    deltas = [
        d["choices"][0]["delta"]["tool_calls"]
        for d in sse_data(streamed.text)[:-1]
        if "tool_calls" in d["choices"][0]["delta"]
    ]
    assert deltas == [
        [{"index": 0, "id": "call_2_0", "type": "function",
          "function": {"name": "lookup", "arguments": {"id": 7}}}]
    ]  # fmt: skip
    assert responses.json()["output"][0]["arguments"] == {"id": 7}


async def test_quirk_shared_index_gives_every_streamed_call_index_zero() -> None:
    reply = Reply(calls=[("lookup", '{"id": 7}'), ("lookup", '{"id": 8}')], shared_index=True)
    plain = Reply(calls=[("lookup", '{"id": 7}'), ("lookup", '{"id": 8}')])
    async with open_fake_llm(scripted_brain([reply, plain])) as fake:
        shared = await post(fake, "chat", stream=True)
        normal = await post(fake, "chat", stream=True)

    def calls(text: str) -> list[dict[str, Any]]:
        return [
            call
            for d in sse_data(text)[:-1]
            for call in d["choices"][0]["delta"].get("tool_calls", ())
        ]

    assert {c["index"] for c in calls(shared.text)} == {0}
    assert [c["id"] for c in calls(shared.text) if "id" in c] == ["call_1_0", "call_1_1"]
    assert {c["index"] for c in calls(normal.text)} == {0, 1}


async def test_quirk_tool_calls_empty_and_missing() -> None:
    brain = scripted_brain(
        [
            Reply(calls=[("lookup", "{}")], tool_calls_empty=True),
            Reply(calls=[("lookup", "{}")], tool_calls_missing=True),
            Reply(tool_calls_empty=True),
            Reply(tool_calls_missing=True),
        ]
    )
    async with open_fake_llm(brain) as fake:
        empty = (await post(fake, "chat")).json()["choices"][0]
        missing = (await post(fake, "chat")).json()["choices"][0]
        stream_empty = sse_data((await post(fake, "chat", stream=True)).text)
        anthropic_missing = (await post(fake, "messages")).json()
    assert empty["finish_reason"] == "tool_calls"
    assert empty["message"]["tool_calls"] == []
    assert missing["finish_reason"] == "tool_calls"
    assert "tool_calls" not in missing["message"]
    assert stream_empty[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert {"tool_calls": []} in [d["choices"][0]["delta"] for d in stream_empty[:-1]]
    assert anthropic_missing["stop_reason"] == "tool_use"
    assert anthropic_missing["content"] == []


async def test_quirk_tool_calls_with_finish_reason_stop_and_other_verbatim_finishes() -> None:
    brain = scripted_brain(
        [
            Reply(calls=[("lookup", "{}")], finish="stop"),
            Reply(text="cut mid-sent", finish="length"),
            Reply(text="cut", finish="length"),
        ]
    )
    async with open_fake_llm(brain) as fake:
        stop = (await post(fake, "chat")).json()["choices"][0]
        length = (await post(fake, "chat")).json()["choices"][0]
        incomplete = (await post(fake, "responses")).json()
    assert stop["finish_reason"] == "stop"
    assert stop["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert length["finish_reason"] == "length"
    assert incomplete["status"] == "incomplete"
    assert incomplete["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_quirk_markup_in_content_writes_the_call_as_text() -> None:
    reply = Reply(text="Sure. ", calls=[("lookup", '{"id": 7}')], markup_in_content=True)
    async with open_fake_llm(scripted_brain([reply] * 3)) as fake:
        chat = (await post(fake, "chat")).json()["choices"][0]
        streamed = sse_data((await post(fake, "chat", stream=True)).text)
        messages = (await post(fake, "messages")).json()
    markup = 'Sure. <tool_call>{"name": "lookup", "arguments": {"id": 7}}</tool_call>'
    assert chat["message"]["content"] == markup
    assert "tool_calls" not in chat["message"]
    assert chat["finish_reason"] == "stop"
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in streamed[:-1]) == markup
    assert messages["content"] == [{"type": "text", "text": markup}]
    assert messages["stop_reason"] == "end_turn"


# --- raw bytes: each fault ----------------------------------------------------------------


async def test_fault_429_sends_retry_after_headers_and_each_apis_error_body() -> None:
    fault = Fault(status=429, retry_after=2, retry_after_ms=1500, should_retry=True)
    async with open_fake_llm(scripted_brain([fault, fault])) as fake:
        chat = await post(fake, "chat")
        messages = await post(fake, "messages")
    assert chat.status_code == 429
    assert chat.headers["retry-after"] == "2"
    assert chat.headers["retry-after-ms"] == "1500"
    assert chat.headers["x-should-retry"] == "true"
    assert chat.json() == {
        "error": {
            "message": "Rate limit reached for requests.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert messages.status_code == 429
    assert messages.headers["request-id"] == "req_2"
    assert messages.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "Number of requests has exceeded your rate limit."},
        "request_id": "req_2",
    }  # fmt: skip


async def test_fault_529_is_anthropics_overloaded_error_and_500_its_api_error() -> None:
    brain = scripted_brain([Fault(status=529), Fault(status=500, message="boom")])
    async with open_fake_llm(brain) as fake:
        overloaded = await post(fake, "messages")
        failed = await post(fake, "messages")
    assert overloaded.status_code == 529
    assert overloaded.json()["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert failed.json()["error"] == {"type": "api_error", "message": "boom"}


async def test_fault_hang_never_answers_until_the_client_times_out() -> None:
    brain = scripted_brain([Fault(hang=True), Reply(text="after")])
    async with open_fake_llm(brain) as fake, httpx.AsyncClient() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(fake.url + API_PATHS["chat"], json=BODIES["chat"], timeout=0.2)
        after = await client.post(fake.url + API_PATHS["chat"], json=BODIES["chat"])
    assert after.json()["choices"][0]["message"]["content"] == "after"


async def test_fault_hang_is_cut_by_the_openai_sdks_timeout() -> None:
    brain = scripted_brain([Fault(hang=True)])
    async with (
        open_fake_llm(brain) as fake,
        openai_client(fake, max_retries=0, timeout=0.2) as client,
    ):
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="gpt-test", messages=USER)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_fault_drop_closes_the_connection_mid_body(api: str) -> None:
    brain = scripted_brain([Fault(drop=True), Fault(drop=True)])
    async with open_fake_llm(brain) as fake, httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(fake.url + API_PATHS[api], json=BODIES[api])
        with pytest.raises(httpx.RemoteProtocolError):
            await read_stream(client, fake.url + API_PATHS[api], {**BODIES[api], "stream": True})


async def test_fault_reset_closes_the_connection_without_a_byte() -> None:
    payload = msgspec.json.encode(BODIES["chat"])
    request = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: %d\r\n\r\n%s" % (
        len(payload),
        payload,
    )
    async with open_fake_llm(scripted_brain([Fault(reset=True), Reply(text="x")])) as fake:
        received = await _exchange(fake.port, request + request)
        async with httpx.AsyncClient() as client:
            after = await client.post(fake.url + API_PATHS["chat"], json=BODIES["chat"])
    assert received == b""
    assert after.json()["choices"][0]["message"]["content"] == "x"
    assert fake.count == 2  # the pipelined second request died with the connection


async def test_fault_drop_surfaces_as_a_connection_error_in_the_sdks() -> None:
    brain = scripted_brain([Fault(drop=True)] * 2)
    async with (
        open_fake_llm(brain) as fake,
        openai_client(fake, max_retries=0) as oai,
        anthropic_client(fake, max_retries=0) as ant,
    ):
        with pytest.raises(openai.APIConnectionError):
            await oai.chat.completions.create(model="gpt-test", messages=USER)
        with pytest.raises(anthropic.APIConnectionError):
            await ant.messages.create(model="claude-test", max_tokens=64, messages=USER)


async def test_fault_truncate_ends_each_stream_before_its_end() -> None:
    reply = Reply(text="partial answer", calls=[("lookup", '{"id": 7, "more": true}')])
    brain = scripted_brain([Fault(truncate=True, reply=reply)] * 3 + [Fault(truncate=True)])
    async with open_fake_llm(brain) as fake:
        chat = await post(fake, "chat", stream=True)
        responses = await post(fake, "responses", stream=True)
        messages = await post(fake, "messages", stream=True)
        body = await post(fake, "chat")
    assert chat.status_code == 200
    chat_events = sse_data(chat.text)
    assert chat_events
    assert "[DONE]" not in chat_events
    assert all(d["choices"][0]["finish_reason"] is None for d in chat_events)
    assert "response.created" in responses.text
    assert "response.completed" not in responses.text
    assert "message_start" in messages.text
    assert "message_stop" not in messages.text
    assert body.status_code == 200
    assert int(body.headers["content-length"]) == len(body.content)
    with pytest.raises(json.JSONDecodeError):
        body.json()


async def test_truncated_stream_raises_in_the_anthropic_sdk_helper() -> None:
    brain = scripted_brain([Fault(truncate=True, reply=Reply(calls=[("lookup", '{"id": 7}')]))])
    async with (
        open_fake_llm(brain) as fake,
        anthropic_client(fake, max_retries=0) as client,
    ):
        async with client.messages.stream(
            model="claude-test", max_tokens=64, messages=USER
        ) as stream:
            kinds = [event.type async for event in stream]
        assert "message_stop" not in kinds
        assert kinds[0] == "message_start"


async def test_fault_in_stream_carries_each_apis_error_event_after_a_200() -> None:
    fault = Fault(status=529, message="Overloaded mid-answer", in_stream=True)
    async with open_fake_llm(scripted_brain([fault] * 4)) as fake:
        chat = await post(fake, "chat", stream=True)
        responses = await post(fake, "responses", stream=True)
        messages = await post(fake, "messages", stream=True)
        plain = await post(fake, "messages")
    assert (chat.status_code, responses.status_code, messages.status_code) == (200, 200, 200)
    chat_events = sse_data(chat.text)
    assert chat_events[-1]["error"]["message"] == "Overloaded mid-answer"
    assert "[DONE]" not in chat_events
    last = sse_data(responses.text)[-1]
    assert (last["type"], last["message"]) == ("error", "Overloaded mid-answer")
    assert "event: error\n" in messages.text
    assert sse_data(messages.text)[-1]["error"] == {
        "type": "overloaded_error",
        "message": "Overloaded mid-answer",
    }
    assert plain.status_code == 529  # a request that does not stream gets the plain error


async def test_fault_in_stream_raises_in_the_sdks() -> None:
    fault = Fault(status=529, message="Overloaded mid-answer", in_stream=True)
    async with (
        open_fake_llm(scripted_brain([fault] * 2)) as fake,
        openai_client(fake, max_retries=0) as oai,
        anthropic_client(fake, max_retries=0) as ant,
    ):
        stream = await oai.chat.completions.create(model="gpt-test", messages=USER, stream=True)
        with pytest.raises(openai.APIError, match="Overloaded mid-answer"):
            await drain(stream)
        with pytest.raises(anthropic.APIStatusError, match="Overloaded mid-answer"):
            async with ant.messages.stream(
                model="claude-test", max_tokens=64, messages=USER
            ) as events:
                await events.get_final_message()


async def test_paced_streams_arrive_in_separate_writes_and_assemble_the_same() -> None:
    arguments = '{"id": 7, "note": "rush"}'
    replies = [Reply(text="hi", calls=[("lookup", arguments)], pace=p) for p in (None, 0, 0.001)]
    async with open_fake_llm(scripted_brain(replies)) as fake, anthropic_client(fake) as client:
        finals = []
        for _ in replies:
            async with client.messages.stream(
                model="claude-test", max_tokens=64, messages=USER
            ) as stream:
                finals.append(await stream.get_final_message())
    assert [f.content[1].input for f in finals] == [{"id": 7, "note": "rush"}] * 3
    assert [f.content[0].text for f in finals] == ["hi"] * 3


async def test_openai_sdk_parses_a_responses_refusal_and_a_streamed_text() -> None:
    brain = scripted_brain([Reply(refusal="No."), Reply(text="streamed text")])
    async with open_fake_llm(brain) as fake, openai_client(fake) as client:
        refused = await client.responses.create(model="gpt-test", input="find")
        async with client.responses.stream(model="gpt-test", input="find") as stream:
            texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    assert refused.output[0].content[0].type == "refusal"
    assert refused.output[0].content[0].refusal == "No."
    assert "".join(texts) == "streamed text"
    assert final.output_text == "streamed text"


async def test_raw_answers_are_sent_verbatim() -> None:
    raw = Raw(body=b'{"choices": [', status=200, headers=[("x-fake", "1")])
    async with open_fake_llm(scripted_brain([raw])) as fake:
        response = await post(fake, "chat")
    assert response.content == b'{"choices": ['
    assert response.headers["x-fake"] == "1"


# --- the server itself --------------------------------------------------------------------


async def test_the_request_log_records_bodies_and_redacts_keys() -> None:
    brain = scripted_brain([Reply(text="a"), Reply(text="b"), Reply(text="c")])
    async with (
        open_fake_llm(brain) as fake,
        openai_client(fake) as oai,
        anthropic_client(fake) as ant,
    ):
        await oai.chat.completions.create(model="gpt-test", messages=USER)
        await oai.responses.create(model="gpt-test", input="find")
        await ant.messages.create(model="claude-test", max_tokens=64, messages=USER)
    chat, responses, messages = fake.requests
    assert (chat.api, chat.path) == ("chat", "/v1/chat/completions")
    assert (responses.api, responses.path) == ("responses", "/v1/responses")
    assert (messages.api, messages.path) == ("messages", "/v1/messages")
    assert chat.headers["authorization"] == "REDACTED"
    # anthropic 2.15 sends the key as a bearer token; older SDKs as x-api-key
    assert messages.headers.get("x-api-key", messages.headers.get("authorization")) == "REDACTED"
    assert chat.body == {"model": "gpt-test", "messages": USER}
    assert messages.body == {"model": "claude-test", "max_tokens": 64, "messages": USER}
    assert "sk-test" not in repr(fake.requests)
    assert fake.count == 3


async def test_the_request_log_redacts_every_key_header() -> None:
    keys = {"authorization": "Bearer sk-1", "x-api-key": "sk-2", "api-key": "sk-3"}
    async with (
        open_fake_llm(scripted_brain([Reply(text="a")])) as fake,
        httpx.AsyncClient(headers=keys) as client,
    ):
        await client.post(fake.url + API_PATHS["messages"], json=BODIES["messages"])
    headers = fake.requests[0].headers
    assert {k: headers[k] for k in keys} == dict.fromkeys(keys, "REDACTED")
    assert "sk-" not in repr(fake.requests)


async def test_the_brain_sees_the_api_the_body_and_the_real_headers() -> None:
    seen: list[tuple[str, Any, str]] = []

    def brain(api: str, body: dict[str, Any], headers: Any) -> Reply:
        seen.append((api, body["model"], headers.get("authorization") or headers["x-api-key"]))
        return Reply(text=api)

    async with (
        open_fake_llm(brain) as fake,
        openai_client(fake) as oai,
        anthropic_client(fake) as ant,
    ):
        await oai.chat.completions.create(model="gpt-test", messages=USER)
        await oai.responses.create(model="gpt-r", input="find")
        await ant.messages.create(model="claude-test", max_tokens=64, messages=USER)
    assert seen[:2] == [
        ("chat", "gpt-test", "Bearer sk-test"),
        ("responses", "gpt-r", "Bearer sk-test"),
    ]
    assert seen[2][:2] == ("messages", "claude-test")
    assert seen[2][2] in ("test", "Bearer test")


async def test_an_async_brain_with_a_delay_is_awaited() -> None:
    async def brain(api: str, body: dict[str, Any], headers: Any) -> Reply:
        await trio.lowlevel.checkpoint()
        return Reply(text="slow", delay=0.01)

    async with open_fake_llm(brain) as fake:
        response = await post(fake, "chat")
    assert response.json()["choices"][0]["message"]["content"] == "slow"


async def test_a_brain_that_raises_is_a_500_naming_the_error() -> None:
    def brain(api: str, body: dict[str, Any], headers: Any) -> Reply:
        raise KeyError("tools")

    async with open_fake_llm(brain) as fake:
        response = await post(fake, "messages")
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "fake llm brain raised KeyError: 'tools'"
    assert isinstance(fake.errors[0], KeyError)


async def test_a_scripted_brain_that_runs_out_answers_500() -> None:
    async with open_fake_llm(scripted_brain([Reply(text="only")])) as fake:
        await post(fake, "chat")
        response = await post(fake, "chat")
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "scripted brain: no reply left after 1"


async def test_bad_paths_methods_and_bodies_get_the_apis_errors() -> None:
    async with open_fake_llm(scripted_brain([])) as fake, httpx.AsyncClient() as client:
        unknown = await client.post(fake.url + "/v1/embeddings", json={})
        method = await client.get(fake.url + API_PATHS["chat"])
        not_json = await client.post(fake.url + API_PATHS["chat"], content=b"{nope")
        anthropic_not_json = await client.post(fake.url + API_PATHS["messages"], content=b"[]")
        models = await client.get(fake.url + "/v1/models")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"
    assert method.status_code == 405
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    assert anthropic_not_json.status_code == 400
    assert anthropic_not_json.json()["type"] == "error"
    assert models.json()["data"][0]["id"] == "fake-model"
    assert [r.api for r in fake.requests] == ["other", "chat", "chat", "messages", "other"]


async def test_validation_refuses_unpaired_tool_calls_like_the_real_apis() -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    tool_use = {"type": "tool_use", "id": "toolu_9", "name": "lookup", "input": {}}
    async with open_fake_llm(scripted_brain([Reply(text="ok")] * 3)) as fake:
        chat_unanswered = await post(
            fake, "chat", messages=[*USER, {"role": "assistant", "tool_calls": [call]}, *USER]
        )
        chat_answered = await post(
            fake,
            "chat",
            messages=[
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_9", "content": "found"},
            ],
        )
        anthropic_unanswered = await post(
            fake,
            "messages",
            messages=[*USER, {"role": "assistant", "content": [tool_use]}, *USER],
        )
        anthropic_answered = await post(
            fake,
            "messages",
            messages=[
                *USER,
                {"role": "assistant", "content": [tool_use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]},
            ],
        )  # fmt: skip
        responses_orphan = await post(
            fake,
            "responses",
            input=[{"type": "function_call_output", "call_id": "call_1", "output": "x"}],
        )
        no_max_tokens = await post(fake, "messages", max_tokens=None)
        chained = await post(
            fake,
            "responses",
            previous_response_id="resp_1",
            input=[{"type": "function_call_output", "call_id": "call_1", "output": "x"}],
        )
    assert chat_unanswered.status_code == 400
    assert "did not have response messages: call_9" in chat_unanswered.json()["error"]["message"]
    assert chat_answered.status_code == 200
    assert anthropic_unanswered.status_code == 400
    assert (
        "`tool_use` ids were found without `tool_result` blocks"
        in (anthropic_unanswered.json()["error"]["message"])
    )
    assert anthropic_answered.status_code == 200
    assert responses_orphan.status_code == 400
    assert no_max_tokens.json()["error"]["message"].startswith("max_tokens: Field required")
    assert chained.status_code == 200  # the call lives in the previous response


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a bare socket; everything the server sends until it closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        received = b""
        while chunk := await stream.receive_some(65536):
            received += chunk
    return received


async def test_http_chunked_bodies_expect_continue_and_connection_close() -> None:
    payload = msgspec.json.encode(BODIES["chat"])
    half = len(payload) // 2
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
        b"expect: 100-continue\r\nconnection: close\r\n\r\n"
        + b"%x\r\n%s\r\n" % (half, payload[:half])
        + b"%x;ext=1\r\n%s\r\n" % (len(payload) - half, payload[half:])
        + b"0\r\n\r\n"
    )
    async with open_fake_llm(scripted_brain([Reply(text="chunked")])) as fake:
        received = await _exchange(fake.port, chunked)
    assert received.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert b"\r\nconnection: close\r\n" in received
    assert b'"content":"chunked"' in received
    assert fake.requests[0].body == BODIES["chat"]


async def test_http_1_0_closes_after_one_answer() -> None:
    payload = msgspec.json.encode(BODIES["chat"])
    request = b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n%s" % (
        len(payload),
        payload,
    )
    async with open_fake_llm(scripted_brain([Reply(text="one")] * 2)) as fake:
        received = await _exchange(fake.port, request + request)
    assert received.count(b"HTTP/1.1 200 OK") == 1
    assert fake.count == 1


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NOT A REQUEST\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/2.0\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: x\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\nbad header\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 999999999\r\n\r\n", 413),
    ],
)
async def test_http_malformed_requests_get_an_error_and_a_closed_connection(
    request_bytes: bytes, status: int
) -> None:
    async with open_fake_llm(scripted_brain([])) as fake:
        received = await _exchange(fake.port, request_bytes)
    assert received.startswith(b"HTTP/1.1 %d " % status)
    assert b"\r\nconnection: close\r\n" in received
    assert b'"type":"invalid_request_error"' in received
    assert fake.count == 0


async def test_ids_and_bodies_are_deterministic_across_servers() -> None:
    replies = [Reply(calls=[("lookup", '{"id": 7}')], text="x"), Reply(text="y")]
    bodies = []
    for _ in range(2):
        async with open_fake_llm(scripted_brain(replies * 3)) as fake:
            bodies.append(
                [(await post(fake, api, stream=stream)).content for api in API_PATHS for stream in (False, True)]
            )  # fmt: skip
    assert bodies[0] == bodies[1]


async def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async with open_fake_llm(scripted_brain([Reply(text="k")] * 20)) as fake:
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(limits=limits) as client:
            for _ in range(10):
                response = await client.post(fake.url + API_PATHS["chat"], json=BODIES["chat"])
                assert response.status_code == 200
            streamed = await client.post(
                fake.url + API_PATHS["chat"], json={**BODIES["chat"], "stream": True}
            )
            assert sse_data(streamed.text)[-1] == "[DONE]"
        ports = {r.headers.get("host") for r in fake.requests}
    assert len(ports) == 1
    assert fake.count == 11


async def _raw_request(port: int, api: str, n: int) -> list[dict[str, Any]]:
    """Two requests on one keep-alive connection, with a bare socket; their parsed bodies."""
    payload = msgspec.json.encode({**BODIES[api], "n": n})
    request = (
        f"POST {API_PATHS[api]} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    bodies = []
    async with stream:
        await stream.send_all(request + request)
        buffer = b""
        while len(bodies) < 2:
            head, sep, rest = buffer.partition(b"\r\n\r\n")
            if sep:
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(rest) >= length:
                    bodies.append(msgspec.json.decode(rest[:length]))
                    buffer = rest[length:]
                    continue
            data = await stream.receive_some(65536)
            assert data, "the server closed the connection early"
            buffer += data
    return bodies


@pytest.mark.slow
async def test_a_thousand_concurrent_connections_all_get_answers() -> None:
    def brain(api: str, body: dict[str, Any], headers: Any) -> Reply:
        return Reply(text=f"answer {body['n']}")

    results: dict[int, list[dict[str, Any]]] = {}

    async def one(port: int, n: int) -> None:
        results[n] = await _raw_request(port, ("chat", "responses", "messages")[n % 3], n)

    async with open_fake_llm(brain, record=False) as fake, trio.open_nursery() as nursery:
        for n in range(1000):
            nursery.start_soon(one, fake.port, n)
    assert len(results) == 1000
    texts = {
        n: {
            b.get("choices", [{}])[0].get("message", {}).get("content")
            or (b.get("output") or [{}])[0].get("content", [{}])[0].get("text")
            or b["content"][0]["text"]
            for b in bodies
        }
        for n, bodies in results.items()
    }
    assert texts == {n: {f"answer {n}"} for n in range(1000)}
    assert fake.count == 2000
    assert fake.requests == []


@pytest.mark.slow
async def test_two_hundred_concurrent_sdk_requests_through_one_pool() -> None:
    async with (
        open_fake_llm(lambda api, body, headers: Reply(text="pooled"), record=False) as fake,
        openai_client(fake, max_retries=0) as client,
    ):
        answers: list[str] = []

        async def one() -> None:
            completion = await client.chat.completions.create(model="gpt-test", messages=USER)
            answers.append(completion.choices[0].message.content)

        async with trio.open_nursery() as nursery:
            for _ in range(200):
                nursery.start_soon(one)
    assert answers == ["pooled"] * 200
    assert fake.count == 200


async def test_serve_fake_llm_starts_in_a_nursery_and_stops_on_cancel() -> None:
    async with trio.open_nursery() as nursery:
        fake = await nursery.start(serve_fake_llm, scripted_brain([Reply(text="n")]))
        assert fake.openai_base_url == fake.url + "/v1"
        assert fake.anthropic_base_url == fake.url
        response = await post(fake, "chat")
        assert response.status_code == 200
        nursery.cancel_scope.cancel()
    with pytest.raises(httpx.ConnectError):
        await post(fake, "chat")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_render_body_is_what_the_server_sends(api: str, stream: bool) -> None:
    reply = Reply(text="x", calls=[("lookup", '{"id": 7}')], usage=(9, 3, 1, 0))
    async with open_fake_llm(scripted_brain([reply])) as fake:
        sent = await post(fake, api, stream=stream)
    body = {**BODIES[api], "stream": stream}
    assert sent.content == render_body(api, reply, body=body, stream=stream)


def test_render_body_refuses_an_unknown_api() -> None:
    with pytest.raises(ValueError, match="unknown api 'completions'; use one of chat, responses"):
        render_body("completions", Reply())


def test_tools_and_tool_results_of_each_api() -> None:
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}}
    chat = {
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": schema}}],
        "messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "found"}],
    }
    responses = {
        "tools": [{"type": "function", "name": "lookup", "parameters": schema}],
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "found"}],
    }
    messages = {
        "tools": [{"name": "lookup", "input_schema": schema}],
        "messages": [
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "bad", "is_error": True}
            ]}
        ],
    }  # fmt: skip
    assert tools_of("chat", chat) == tools_of("responses", responses) == {"lookup": schema}
    assert tools_of("messages", messages) == {"lookup": schema}
    assert tool_results_of("chat", chat) == [("call_1", "found", None)]
    assert tool_results_of("responses", responses) == [("call_1", "found", None)]
    assert tool_results_of("messages", messages) == [("toolu_1", "bad", True)]


def test_bad_replies_and_faults_are_refused_in_one_line() -> None:
    with pytest.raises(TypeError, match=r"Reply.calls holds \(name, arguments\) pairs"):
        Reply(calls=[("lookup", 7)])
    with pytest.raises(ValueError, match=r"Reply\.usage is"):
        Reply(usage=(1, 2, 3))
    with pytest.raises(ValueError, match="choose tool_calls_empty or tool_calls_missing"):
        Reply(tool_calls_empty=True, tool_calls_missing=True)
    with pytest.raises(ValueError, match=r"Fault.status must be an HTTP error status \(400-599\)"):
        Fault(status=200)
    with pytest.raises(
        ValueError, match="choose at most one of hang, drop, truncate, in_stream and reset"
    ):
        Fault(hang=True, drop=True)
    with pytest.raises(TypeError, match="scripted_brain takes Reply, Fault or Raw items"):
        scripted_brain(["text"])


async def test_an_error_in_the_block_leaves_open_fake_llm_as_itself_not_in_a_group() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with open_fake_llm(scripted_brain([])):
            raise KeyError("mine")


@pytest.mark.slow
async def test_the_fake_runs_in_its_own_process_until_sigterm() -> None:
    import signal
    import sys

    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "interlock.testing"], stdout=subprocess.PIPE
    )
    try:
        line = b""
        while not line.endswith(b"\n"):
            chunk = await process.stdout.receive_some(1)
            assert chunk, "the fake process exited before printing its url"
            line += chunk
        url = line.decode().strip()
        async with httpx.AsyncClient() as client:
            response = await client.post(url + API_PATHS["messages"], json=BODIES["messages"])
        assert response.json()["content"] == [{"type": "text", "text": "ok"}]
    finally:
        process.send_signal(signal.SIGTERM)
        code = await process.wait()
    assert code == 0


def test_the_fake_process_refuses_a_bad_brain_in_one_line() -> None:
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "interlock.testing", "--brain", "nowhere"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "--brain takes module:function (e.g. mypkg.brains:oracle); got 'nowhere'"
    )
