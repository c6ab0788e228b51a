"""The three APIs the model proxy serves, each in its own words: where a request names its
tools and reports a call's result, where an answer holds its calls, how a verified call is
keyed, how a refusal and an error are said, and how a whole answer is streamed.

One :class:`Api` per wire format; the proxy's steps (:mod:`._proxy`) are the same for all.
The readers that judge an answer are the providers' own (byte-exact arguments, envelope
checks): the proxy reads a model's answer exactly as a run on the hosted runtime does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from ..providers import AnthropicMessages, OpenAIChat, OpenAIResponses

if TYPE_CHECKING:
    from ..providers._openai import HttpProvider

__all__ = ["API_PATHS", "Api", "ChatApi", "MessagesApi", "ResponsesApi"]

_encode = msgspec.json.encode


def _text(content: Any) -> str:
    return content if isinstance(content, str) else _encode(content).decode()


class Api:
    """What the proxy needs to know of one API (a request and its answer, both as decoded
    JSON objects)."""

    name: ClassVar[str]
    #: the path the proxy serves, and the upstream's path under its base URL
    path: ClassVar[str]
    upstream_path: ClassVar[str]
    #: the headers of the application's request that go upstream with it
    forwarded: ClassVar[tuple[str, ...]]

    reader: HttpProvider

    def check(self, request: Any) -> str | None:
        """Why ``request`` is not a request of this API, or None."""
        raise NotImplementedError

    def tool_name(self, tool: Any) -> str | None:
        raise NotImplementedError

    def result(self, request: dict[str, Any], key: str) -> tuple[bool, Any, bool]:
        """(found, content, is_error) of the result reported for the call ``key``."""
        raise NotImplementedError

    def how_to_report(self, key: str) -> str:
        """How a request reports the result of the call ``key``."""
        raise NotImplementedError

    def calls(self, answer: dict[str, Any]) -> list[dict[str, Any]]:
        """The calls in ``answer`` (the API's own objects); raises on a shape it is not."""
        raise NotImplementedError

    def for_gate(self, answer: dict[str, Any]) -> bytes:
        """``answer`` as the reader judges it: without the text beside its calls (an
        application's model is not told to answer with a call alone, as a run's is)."""
        raise NotImplementedError

    def keyed(self, answer: dict[str, Any], key: str) -> dict[str, Any]:
        """``answer`` holding its first call only, whose id is the idempotency ``key``."""
        raise NotImplementedError

    def refused(self, answer: dict[str, Any], text: str) -> dict[str, Any]:
        """``answer`` turned into a text answer saying ``text`` (no call)."""
        raise NotImplementedError

    def reask(self, request: dict[str, Any], answer: dict[str, Any], why: str) -> dict[str, Any]:
        """``request`` once more, with the answer's first call and ``why`` as its result."""
        raise NotImplementedError

    def narrowed(self, request: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
        """``request`` offering only the tools in ``allowed``."""
        tools = [t for t in request.get("tools") or () if self.tool_name(t) in allowed]
        body = dict(request)
        body.pop("stream", None)
        body.pop("stream_options", None)
        if tools:
            body["tools"] = tools
            if self._chosen(body.get("tool_choice")) not in (None, *allowed):
                # a tool_choice naming a tool this state does not allow would make the
                # upstream refuse the request; the model is offered the allowed ones
                body.pop("tool_choice")
        else:
            body.pop("tools", None)
            body.pop("tool_choice", None)
        return body

    @staticmethod
    def _chosen(choice: Any) -> str | None:
        """The tool a ``tool_choice`` names (Chat nests it under ``function``), or None."""
        if not isinstance(choice, dict):
            return None
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        return name if isinstance(name, str) else None

    def shaped(self, request: dict[str, Any]) -> dict[str, Any]:
        """``request`` as the upstream's profile takes it."""
        return request

    def upstream_ids(self, request: dict[str, Any], ids: dict[str, str]) -> dict[str, Any]:
        """``request`` with the keys the application knows mapped back to the upstream's own
        call ids, where the upstream keeps the conversation (only Responses can)."""
        return request

    def error(self, status: int, message: str, kind: str) -> bytes:
        return _encode({"error": {"message": message, "type": kind, "code": kind}})

    def stream(self, answer: dict[str, Any], request: dict[str, Any]) -> list[bytes]:
        """The whole ``answer`` as the API's server-sent events."""
        raise NotImplementedError


# --- OpenAI Chat Completions -----------------------------------------------------------------


class ChatApi(Api):
    name = "chat"
    path = "/v1/chat/completions"
    upstream_path = "/chat/completions"
    forwarded = ("authorization", "openai-organization", "openai-project")

    def __init__(self, base_url: str, profile: str | None) -> None:
        self.reader = OpenAIChat("proxy", base_url=base_url, profile=profile)

    def check(self, request: Any) -> str | None:
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            return "the body must be a chat completion request with messages"
        return None

    def tool_name(self, tool: Any) -> str | None:
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            name = tool["function"].get("name")
            return name if isinstance(name, str) else None
        return None

    def result(self, request: dict[str, Any], key: str) -> tuple[bool, Any, bool]:
        for message in reversed(request["messages"]):
            if (
                isinstance(message, dict)
                and message.get("role") == "tool"
                and message.get("tool_call_id") == key
            ):
                return True, message.get("content"), False
        return False, None, False

    def how_to_report(self, key: str) -> str:
        return f"a tool message with tool_call_id {key!r}"

    def calls(self, answer: dict[str, Any]) -> list[dict[str, Any]]:
        message = answer["choices"][0]["message"]
        return list(message.get("tool_calls") or ())

    def for_gate(self, answer: dict[str, Any]) -> bytes:
        choice = answer["choices"][0]
        message = {**choice["message"], "content": None}
        return _encode({**answer, "choices": [{**choice, "message": message}]})

    def keyed(self, answer: dict[str, Any], key: str) -> dict[str, Any]:
        choice = answer["choices"][0]
        message = choice["message"]
        call = {**message["tool_calls"][0], "id": key}
        return {**answer, "choices": [{**choice, "message": {**message, "tool_calls": [call]}}]}

    def refused(self, answer: dict[str, Any], text: str) -> dict[str, Any]:
        choice = {
            **answer["choices"][0],
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        return {**answer, "choices": [choice]}

    def reask(self, request: dict[str, Any], answer: dict[str, Any], why: str) -> dict[str, Any]:
        call = self.calls(answer)[0]
        turns = [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call.get("id") or "call", "content": why},
        ]
        return {**request, "messages": [*request["messages"], *turns]}

    def shaped(self, request: dict[str, Any]) -> dict[str, Any]:
        """The conversation as the upstream's profile takes it: an assistant turn's empty
        content beside its tool calls as ``""`` where the server refuses null, and tool
        results as user messages where its template drops ``tool`` messages."""
        profile = self.reader.profile
        if profile.null_content and not profile.tool_results_as_user:
            return request
        shaped = []
        for message in request["messages"]:
            if not isinstance(message, dict):
                shaped.append(message)
                continue
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls") and not profile.null_content:
                if message.get("content") is None:
                    message = {**message, "content": ""}
            elif role == "tool" and profile.tool_results_as_user:
                message = {
                    "role": "user",
                    "content": f"The result of call {message.get('tool_call_id')}: "
                    f"{_text(message.get('content'))}",
                }
            shaped.append(message)
        return {**request, "messages": shaped}

    def stream(self, answer: dict[str, Any], request: dict[str, Any]) -> list[bytes]:
        options = request.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        base = {
            k: answer[k]
            for k in ("id", "created", "model", "system_fingerprint", "service_tier")
            if k in answer
        }
        base["object"] = "chat.completion.chunk"
        choice = answer["choices"][0]
        message = choice.get("message") or {}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data = dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": finish}])
            if include_usage:
                data["usage"] = None
            return b"data: " + _encode(data) + b"\n\n"

        content = message.get("content")
        events = [chunk({"role": "assistant", "content": "" if content else None})]
        if content:
            events.append(chunk({"content": content}))
        for index, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") or {}
            events.append(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call.get("id"),
                                "type": "function",
                                "function": {"name": function.get("name"), "arguments": ""},
                            }
                        ]
                    }
                )
            )
            events.append(
                chunk(
                    {
                        "tool_calls": [
                            {"index": index, "function": {"arguments": function.get("arguments")}}
                        ]
                    }
                )
            )
        events.append(chunk({}, choice.get("finish_reason") or "stop"))
        if include_usage:
            usage = dict(base, choices=[], usage=answer.get("usage"))
            events.append(b"data: " + _encode(usage) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events


# --- OpenAI Responses ------------------------------------------------------------------------


class ResponsesApi(Api):
    name = "responses"
    path = "/v1/responses"
    upstream_path = "/responses"
    forwarded = ChatApi.forwarded

    def __init__(self, base_url: str, profile: str | None) -> None:
        self.reader = OpenAIResponses("proxy", base_url=base_url)

    def check(self, request: Any) -> str | None:
        if not isinstance(request, dict) or not isinstance(request.get("input"), (str, list)):
            return "the body must be a Responses request with input (a string or a list of items)"
        return None

    def tool_name(self, tool: Any) -> str | None:
        if isinstance(tool, dict) and tool.get("type") == "function":
            name = tool.get("name")
            return name if isinstance(name, str) else None
        return None

    def result(self, request: dict[str, Any], key: str) -> tuple[bool, Any, bool]:
        items = request["input"]
        for item in reversed(items) if isinstance(items, list) else ():
            if (
                isinstance(item, dict)
                and item.get("type") == "function_call_output"
                and item.get("call_id") == key
            ):
                return True, item.get("output"), False
        return False, None, False

    def how_to_report(self, key: str) -> str:
        return f"a function_call_output input item with call_id {key!r}"

    def calls(self, answer: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            item
            for item in answer["output"]
            if isinstance(item, dict) and item.get("type") == "function_call"
        ]

    def for_gate(self, answer: dict[str, Any]) -> bytes:
        output = [
            i for i in answer["output"] if not (isinstance(i, dict) and i.get("type") == "message")
        ]
        return _encode({**answer, "output": output})

    def keyed(self, answer: dict[str, Any], key: str) -> dict[str, Any]:
        output: list[Any] = []
        seen = False
        for item in answer["output"]:
            if isinstance(item, dict) and item.get("type") == "function_call":
                if seen:
                    continue  # one call a step: the extra ones are journaled, not handed on
                seen = True
                item = {**item, "call_id": key}
            output.append(item)
        return {**answer, "output": output}

    def refused(self, answer: dict[str, Any], text: str) -> dict[str, Any]:
        item = {
            "type": "message",
            "id": f"msg_{answer.get('id', 'interlock')}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        return {**answer, "status": "completed", "output": [item]}

    def reask(self, request: dict[str, Any], answer: dict[str, Any], why: str) -> dict[str, Any]:
        call = self.calls(answer)[0]
        result = {"type": "function_call_output", "call_id": call.get("call_id"), "output": why}
        # the call and its result follow the request's own input (after the answer it
        # continues, where it names a previous_response_id): no state kept upstream is needed
        items = request["input"]
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        return {**request, "input": [*items, call, result]}

    def upstream_ids(self, request: dict[str, Any], ids: dict[str, str]) -> dict[str, Any]:
        items = request["input"]
        if not ids or not isinstance(items, list):
            return request
        mapped = []
        for item in items:
            if isinstance(item, dict) and item.get("call_id") in ids:
                item = {**item, "call_id": ids[item["call_id"]]}
            mapped.append(item)
        return {**request, "input": mapped}

    def stream(self, answer: dict[str, Any], request: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []

        def event(kind: str, **data: Any) -> None:
            data = {"type": kind, "sequence_number": len(events), **data}
            events.append(b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n")

        start = {**answer, "status": "in_progress", "output": [], "usage": None}
        event("response.created", response=start)
        event("response.in_progress", response=start)
        for index, item in enumerate(answer.get("output") or ()):
            item_id = item.get("id")
            if item.get("type") == "message":
                event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "content": []},
                )
                for c, part in enumerate(item.get("content") or ()):
                    where = {"item_id": item_id, "output_index": index, "content_index": c}
                    if part.get("type") == "output_text":
                        event("response.content_part.added", **where, part={**part, "text": ""})
                        event(
                            "response.output_text.delta", **where, delta=part["text"], logprobs=[]
                        )
                        event("response.output_text.done", **where, text=part["text"], logprobs=[])
                    elif part.get("type") == "refusal":
                        event("response.content_part.added", **where, part={**part, "refusal": ""})
                        event("response.refusal.delta", **where, delta=part["refusal"])
                        event("response.refusal.done", **where, refusal=part["refusal"])
                    else:
                        event("response.content_part.added", **where, part=part)
                    event("response.content_part.done", **where, part=part)
            elif item.get("type") == "function_call":
                arguments = item.get("arguments", "")
                event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
                where = {"item_id": item_id, "output_index": index}
                event("response.function_call_arguments.delta", **where, delta=arguments)
                event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.get("name"),
                    arguments=arguments,
                )
            else:
                event("response.output_item.added", output_index=index, item=item)
            event("response.output_item.done", output_index=index, item=item)
        done = (
            "response.incomplete" if answer.get("status") == "incomplete" else "response.completed"
        )
        event(done, response=answer)
        return events


# --- Anthropic Messages ----------------------------------------------------------------------


class MessagesApi(Api):
    name = "messages"
    path = "/v1/messages"
    upstream_path = "/v1/messages"
    forwarded = ("x-api-key", "authorization", "anthropic-version", "anthropic-beta")

    def __init__(self, base_url: str, profile: str | None) -> None:
        self.reader = AnthropicMessages("proxy", base_url=base_url)

    def check(self, request: Any) -> str | None:
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            return "the body must be a Messages request with messages"
        if not isinstance(request.get("max_tokens"), int):
            return "the body must give max_tokens, a whole number (the Messages API needs it)"
        return None

    def tool_name(self, tool: Any) -> str | None:
        if isinstance(tool, dict) and "input_schema" in tool:
            name = tool.get("name")
            return name if isinstance(name, str) else None
        return None

    def result(self, request: dict[str, Any], key: str) -> tuple[bool, Any, bool]:
        for message in reversed(request["messages"]):
            if not (isinstance(message, dict) and message.get("role") == "user"):
                continue
            content = message.get("content")
            for block in content if isinstance(content, list) else ():
                if (
                    isinstance(block, dict)
                    and block.get("type") == "tool_result"
                    and block.get("tool_use_id") == key
                ):
                    return True, block.get("content"), block.get("is_error") is True
        return False, None, False

    def how_to_report(self, key: str) -> str:
        return f"a tool_result block with tool_use_id {key!r} in a user message"

    def calls(self, answer: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            block
            for block in answer["content"]
            if isinstance(block, dict) and block.get("type") == "tool_use"
        ]

    def for_gate(self, answer: dict[str, Any]) -> bytes:
        content = [
            b for b in answer["content"] if not (isinstance(b, dict) and b.get("type") == "text")
        ]
        return _encode({**answer, "content": content})

    def keyed(self, answer: dict[str, Any], key: str) -> dict[str, Any]:
        content: list[Any] = []
        seen = False
        for block in answer["content"]:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                if seen:
                    continue
                seen = True
                block = {**block, "id": key}
            content.append(block)
        return {**answer, "content": content}

    def refused(self, answer: dict[str, Any], text: str) -> dict[str, Any]:
        return {
            **answer,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
        }

    def reask(self, request: dict[str, Any], answer: dict[str, Any], why: str) -> dict[str, Any]:
        call = self.calls(answer)[0]
        turns = [
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.get("id") or "call",
                        "content": why,
                        "is_error": True,
                    }
                ],
            },
        ]
        return {**request, "messages": [*request["messages"], *turns]}

    def error(self, status: int, message: str, kind: str) -> bytes:
        return _encode({"type": "error", "error": {"type": kind, "message": message}})

    def stream(self, answer: dict[str, Any], request: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []

        def event(kind: str, **data: Any) -> None:
            events.append(
                b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **data}) + b"\n\n"
            )

        usage = dict(answer.get("usage") or {})
        start = {
            **answer,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 0},
        }
        event("message_start", message=start)
        for index, block in enumerate(answer.get("content") or ()):
            if block.get("type") == "text":
                event(
                    "content_block_start", index=index, content_block={"type": "text", "text": ""}
                )
                delta = {"type": "text_delta", "text": block.get("text", "")}
                event("content_block_delta", index=index, delta=delta)
            elif block.get("type") == "tool_use":
                event("content_block_start", index=index, content_block={**block, "input": {}})
                partial = _encode(block.get("input", {})).decode()
                delta = {"type": "input_json_delta", "partial_json": partial}
                event("content_block_delta", index=index, delta=delta)
            else:
                event("content_block_start", index=index, content_block=block)
            event("content_block_stop", index=index)
        delta = {
            "stop_reason": answer.get("stop_reason"),
            "stop_sequence": answer.get("stop_sequence"),
        }
        event("message_delta", delta=delta, usage={"output_tokens": usage.get("output_tokens", 0)})
        event("message_stop")
        return events


#: the path each API is served at, and its class
API_PATHS: dict[str, type[Api]] = {
    ChatApi.path: ChatApi,
    ResponsesApi.path: ResponsesApi,
    MessagesApi.path: MessagesApi,
}
