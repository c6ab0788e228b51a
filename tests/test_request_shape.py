"""A server that refuses the request's shape is told apart from one that is down (#32).

The bodies quoted here are what llama-cpp-python's server 0.3.36 (``python -m
llama_cpp.server --chat_format chatml-function-calling``, SmolLM2-135M-Instruct) answered
to curl: ``tool_choice: "required"`` fails an assertion in its function-calling handler
(HTTP 500, an empty message); an assistant turn with ``content: null`` beside its
``tool_calls`` fails its request validation (HTTP 500, pydantic's words); with the
content left out its template fails (HTTP 500). The same server runs for real in
tests/test_real_model.py; here a small loopback server answers as it did, so the
classification is covered without it.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import msgspec
import pytest
import trio

from interlock import (
    InterlockError,
    Machine,
    ProviderPolicy,
    Reject,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
    replay,
)
from interlock.core._decider import decide, start
from interlock.core._events import Escalated, ProviderFailed
from interlock.core._view import RunView
from interlock.core._wire import tool_specs
from interlock.messages import Start
from interlock.providers import AnthropicMessages, OpenAIChat, OpenAIResponses, Profile
from interlock.providers._http import refuses_the_request
from interlock.stores import MemoryStore

#: tool_choice "required": ``assert tool_choice == "auto"`` in chatml_function_calling.
REQUIRED_500 = b'{"error":{"message":"","type":"internal_server_error","param":null,"code":null}}'
#: content null beside tool_calls: the request model's validation error, as the server sent it.
NULL_CONTENT_500 = (
    b"{\"error\":{\"message\":\"7 validation errors:\\n  {'type': 'literal_error', 'loc': "
    b"('body', 'messages', 2, 'ChatCompletionRequestSystemMessage', 'role'), 'msg': \\\"Input "
    b"should be 'system'\\\", 'input': 'assistant', 'ctx': {'expected': \\\"'system'\\\"}}\\n  "
    b"{'type': 'literal_error', 'loc': ('body', 'messages', 2, "
    b"'ChatCompletionRequestUserMessage', 'role'), 'msg': \\\"Input should be 'user'\\\", "
    b"'input': 'assistant', 'ctx': {'expected': \\\"'user'\\\"}}\\n  {'type': 'string_type', "
    b"'loc': ('body', 'messages', 2, 'ChatCompletionRequestAssistantMessage', 'content'), "
    b"'msg': 'Input should be a valid string', 'input': None}\\n  {'type': 'literal_error', "
    b"'loc': ('body', 'messages', 2, 'ChatCompletionRequestToolMessage', 'role'), 'msg': "
    b"\\\"Input should be 'tool'\\\", 'input': 'assistant', 'ctx': {'expected': "
    b"\\\"'tool'\\\"}}\\n  {'type': 'missing', 'loc': ('body', 'messages', 2, "
    b"'ChatCompletionRequestToolMessage', 'tool_call_id'), 'msg': 'Field required', 'input': "
    b"{'role': 'assistant', 'tool_calls': [{'id': 'call_3', 'type': 'function', 'function': "
    b"{'name': 'refund', 'arguments': '{\\\"order_id\\\": \\\"o1\\\", \\\"amount\\\": 150}'}}], "
    b"'content': None}}\\n  {'type': 'literal_error', 'loc': ('body', 'messages', 2, "
    b"'ChatCompletionRequestFunctionMessage', 'role'), 'msg': \\\"Input should be "
    b"'function'\\\", 'input': 'assistant', 'ctx': {'expected': \\\"'function'\\\"}}\\n  "
    b"{'type': 'missing', 'loc': ('body', 'messages', 2, 'ChatCompletionRequestFunctionMessage',"
    b" 'name'), 'msg': 'Field required', 'input': {'role': 'assistant', 'tool_calls': [{'id': "
    b"'call_3', 'type': 'function', 'function': {'name': 'refund', 'arguments': "
    b'\'{\\"order_id\\": \\"o1\\", \\"amount\\": 150}\'}}], \'content\': None}}\\n\\n  File '
    b'\\"/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llama_cpp/server/app.py\\", '
    b'line 376, in create_chat_completion\\n    POST /v1/chat/completions",'
    b'"type":"internal_server_error","param":null,"code":null}}'
)
#: content left out beside tool_calls: its chat template (StrictUndefined) fails.
NO_CONTENT_500 = (
    b'{"error":{"message":"\'dict object\' has no attribute \'content\'",'
    b'"type":"internal_server_error","param":null,"code":null}}'
)


def completion(name: str, arguments: str) -> bytes:
    """A tool call as the server answers one (its own ids, the legacy ``function_call``
    beside ``tool_calls``, ``content: null``, ``finish_reason: "tool_calls"``)."""
    call = {"name": name, "arguments": arguments}
    return msgspec.json.encode(
        {
            "id": "chatcmpl-156add80-7c6d-4529-9f76-c2aab8093e3b",
            "object": "chat.completion",
            "created": 1796334176,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "content": None,
                        "tool_calls": [
                            {
                                "id": f"call__0_{name}_cmpl-1f202bfe",
                                "type": "function",
                                "function": call,
                            }
                        ],
                        "role": "assistant",
                        "function_call": {**call, "name": f"{name}:"},
                    },
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 292, "completion_tokens": 22, "total_tokens": 314},
        }
    )


class LlamaCppPythonLike:
    """An HTTP/1.1 server on loopback that refuses what llama-cpp-python's refuses, with
    its bodies, and otherwise answers the next of ``calls`` ((name, arguments) pairs).

    ``outage``: answer the first requests with this many 503s first (a server that is
    down for a moment, retried)."""

    def __init__(self, calls: list[tuple[str, str]], outage: int = 0) -> None:
        self.calls = list(calls)
        self.outage = outage
        self.bodies: list[dict[str, Any]] = []
        self.url = ""

    def answer(self, body: dict[str, Any]) -> tuple[int, bytes]:
        if self.outage:
            self.outage -= 1
            return 503, b'{"error":{"message":"Service Unavailable","type":"server_error"}}'
        if body.get("tool_choice") == "required":
            return 500, REQUIRED_500
        for message in body.get("messages", []):
            if message.get("role") == "assistant" and "tool_calls" in message:
                if "content" not in message:
                    return 500, NO_CONTENT_500
                if message["content"] is None:
                    return 500, NULL_CONTENT_500
        return 200, completion(*self.calls.pop(0))

    async def serve(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        length = int(found.group(1)) if found else 0
        while len(body) < length:
            body += await stream.receive_some(65536)
        request = msgspec.json.decode(body)
        self.bodies.append(request)
        status, answer = self.answer(request)
        await stream.send_all(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, len(answer), answer)
        )
        await stream.aclose()

    async def start(self, nursery: trio.Nursery) -> None:
        listeners = await nursery.start(partial(trio.serve_tcp, self.serve, 0, host="127.0.0.1"))
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1"


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    amount: float


async def refund(args: Refund, ctx: ToolContext) -> dict[str, Any]:
    return {"refunded": args.amount}


def at_most_the_total(args: Refund, view: RunView) -> Reject | None:
    total = view.inputs["total"]
    if args.amount > total:
        return Reject(
            f"amount: {args.amount} exceeds the order total {total}",
            f"propose amount <= {total}",
            "args.amount",
        )
    return None


def shop() -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["refund"], instructions="Refund o1.")},
        tools=[Tool("refund", refund, Refund, guards=[at_most_the_total], description="Refund")],
        provider_policy=ProviderPolicy(timeout=5.0, attempts=5, base=0.01, cap=0.02),
    )


OVER = ("refund", '{"order_id": "o1", "amount": 150}')
REFUND = ("refund", '{"order_id": "o1", "amount": 40}')
DONE = ("transition", '{"next": "COMPLETED", "data": {}}')


async def drive(
    server: LlamaCppPythonLike, profile: str | Profile | None
) -> tuple[Any, list[Any], Machine]:
    store = MemoryStore()
    machine = shop()
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        provider = OpenAIChat("m", base_url=server.url, profile=profile)
        async with provider, open_supervisor([machine], store, provider=provider) as sup:
            handle = await sup.start_run("shop", {"total": 100}, run_id="r-1")
            with trio.fail_after(20):
                result = await handle.wait()
        nursery.cancel_scope.cancel()
    return result, await store.load("r-1"), machine


async def test_tool_choice_required_refused_escalates_at_once_naming_the_flag() -> None:
    server = LlamaCppPythonLike([])
    result, events, machine = await drive(server, "generic")
    assert (result.outcome, result.reason) == ("escalated", "request_refused")
    assert len(server.bodies) == 1  # not retried as if the server were down
    (failed,) = [e for e in events if isinstance(e, ProviderFailed)]
    assert (failed.retryable, failed.refused, failed.retry_in) == (False, True, None)
    assert failed.error.startswith(
        'provider raised RequestRefused: tool_choice "required" refused by the server; use '
        "profile='llama-cpp-python' or a Profile(tool_choice=\"auto\") (it answered HTTP 500 "
        "with an empty message); POST /v1/chat/completions answered HTTP 500"
    )
    escalated = events[-1]
    assert isinstance(escalated, Escalated)
    assert escalated.reason == "request_refused"
    assert 'Profile(tool_choice="auto")' in escalated.detail
    assert replay(events, machine).ok


async def test_content_null_refused_escalates_at_once_naming_the_flag() -> None:
    # with tool_choice "auto" the first call goes through; the second sends the first
    # call back with content null
    server = LlamaCppPythonLike([OVER])
    result, events, machine = await drive(server, Profile("custom", tool_choice="auto"))
    assert (result.outcome, result.reason) == ("escalated", "request_refused")
    assert len(server.bodies) == 2
    (failed,) = [e for e in events if isinstance(e, ProviderFailed)]
    assert failed.refused is True
    assert failed.error.startswith(
        "provider raised RequestRefused: content null beside an assistant turn's tool_calls "
        "refused by the server; use profile='llama-cpp-python' or a "
        "Profile(null_content=False); POST /v1/chat/completions answered HTTP 500: "
        "internal_server_error: 7 validation errors:"
    )
    assert replay(events, machine).ok


async def test_the_llama_cpp_python_profile_runs_where_the_others_are_refused() -> None:
    server = LlamaCppPythonLike([OVER, REFUND, DONE])
    result, events, _ = await drive(server, "llama-cpp-python")
    assert result.outcome == "completed"
    assert not [e for e in events if isinstance(e, ProviderFailed)]
    first, second, third = server.bodies
    assert first["tool_choice"] == "auto"
    assert "parallel_tool_calls" not in first
    assert "max_tokens" in first
    assert "max_completion_tokens" not in first
    # the rejected call went back with content "" and its rejection as a user message
    # (the server's template drops tool messages): the message and the hint both
    assistant, answer = second["messages"][-3:-1]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == OVER[1]
    assert answer["role"] == "user"
    assert answer["content"].startswith("result of refund (call_")
    assert "150.0 exceeds the order total 100" in answer["content"]
    assert "propose amount <= 100" in answer["content"]
    assert all(message["role"] != "tool" for message in third["messages"])


async def test_a_server_down_for_a_moment_is_still_retried() -> None:
    server = LlamaCppPythonLike([REFUND, DONE], outage=2)
    result, events, _ = await drive(server, "llama-cpp-python")
    assert result.outcome == "completed"
    failed = [e for e in events if isinstance(e, ProviderFailed)]
    assert [(e.retryable, e.refused) for e in failed] == [(True, msgspec.UNSET)] * 2


@pytest.mark.parametrize(
    ("status", "text", "refused"),
    [
        (400, "invalid_request_error: 'tools' is too long", True),
        (422, "Unprocessable Entity", True),
        (401, "Incorrect API key provided", False),
        (404, "The model 'm' does not exist", False),
        (429, "Rate limit reached", False),
        (409, "conflict", False),
        (500, msgspec.json.decode(NULL_CONTENT_500)["error"]["message"], True),
        (500, "tool_choice 'required' is not supported", True),
        (500, "The server had an error while processing your request. Sorry about that!", False),
        (503, "Service Unavailable", False),
        (529, "overloaded_error: Overloaded", False),
        (500, "", False),
    ],
)
def test_a_refusal_of_the_requests_shape_is_told_from_an_outage(
    status: int, text: str, refused: bool
) -> None:
    assert refuses_the_request(status, text) is refused


@pytest.mark.parametrize(
    "make", [OpenAIChat, OpenAIResponses, AnthropicMessages], ids=lambda m: m.__name__
)
@pytest.mark.parametrize(
    ("url", "example"),
    [
        ("127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1"),
        ("localhost:8080/v1", "http://localhost:8080/v1"),
        ("ftp://127.0.0.1/v1", "https://host/v1"),
    ],
)
def test_a_base_url_without_http_is_refused_when_the_provider_is_made(
    make: Any, url: str, example: str
) -> None:
    """Issue 32: accepted before, every call of every run then failed and was retried."""
    with pytest.raises(InterlockError) as excinfo:
        make("m", base_url=url)
    assert str(excinfo.value) == (
        f"{make.__name__}: base_url {url!r} does not start with http:// or https://; "
        f"pass the whole URL, e.g. {example!r}"
    )


def test_a_profile_that_cannot_stream_calls_refuses_stream_true() -> None:
    with pytest.raises(
        InterlockError,
        match=r"^OpenAIChat: profile 'llama-cpp-python' cannot stream tool calls "
        r"\(stream_calls=False\); pass stream=False$",
    ):
        OpenAIChat("m", base_url="http://127.0.0.1:9/v1", profile="llama-cpp-python", stream=True)
    OpenAIChat(
        "m",
        base_url="http://127.0.0.1:9/v1",
        profile="llama-cpp-python",
        stream=True,
        output="json_schema",
    )


def test_the_default_profiles_still_send_tool_messages_and_null_content() -> None:
    machine = shop()
    events: list[Any] = []
    run, _ = start(machine, Start(run_id="r", machine="shop", inputs={"total": 100}), 0.0, events)
    from interlock.core._breakers import CircuitBoard
    from interlock.messages import Propose

    raw = '{"tool":"refund","args":{"order_id":"o1","amount":150}}'
    decide(
        run,
        Propose(run_id="r", seq=run.seq, raw=raw, model="m", prompt="p", response="{}"),
        1.0,
        CircuitBoard(),
        events,
    )
    view = RunView(run)
    bodies = {}
    for profile in ("openai", "generic", "llama-cpp-python"):
        provider = OpenAIChat("m", base_url="http://127.0.0.1:9/v1", profile=profile)
        bodies[profile] = msgspec.json.decode(provider.request_body(view, tool_specs(view)))
    for profile in ("openai", "generic"):
        assistant, result = bodies[profile]["messages"][1:3]
        assert assistant["content"] is None
        assert (result["role"], result["tool_call_id"]) == (
            "tool",
            assistant["tool_calls"][0]["id"],
        )
        assert result["content"].startswith("error: amount: 150.0 exceeds the order total 100")
    assistant, result = bodies["llama-cpp-python"]["messages"][1:3]
    assert assistant["content"] == ""
    assert result["role"] == "user"
    cid = assistant["tool_calls"][0]["id"]
    assert result["content"].startswith(f"result of refund ({cid}): error: amount: 150.0 exceeds")
    # and the view's kept conversation is not mixed up between profiles
    again = OpenAIChat("m", base_url="http://127.0.0.1:9/v1", profile="openai")
    assert msgspec.json.decode(again.request_body(view, tool_specs(view))) == bodies["openai"]
