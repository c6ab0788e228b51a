"""Anthropic's Messages API: ``tool_use`` blocks answered with ``tool_result`` blocks.

The state's tools and ``transition`` are offered as tools with ``tool_choice`` ``any``
and parallel tool use disabled. A ``tool_use`` block's ``input`` is taken from the
response body as its raw JSON text, never re-serialised from a parsed object, so the gate
sees exactly what the model sent. Every ``tool_use`` of the conversation is followed by
its ``tool_result`` (the API answers 400 otherwise), a rejection marked ``is_error``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ..core._events import TokenUsage, Violation
from ..core._exceptions import ProviderError
from ..core._wire import (
    ONE_CALL,
    ONE_TOOL_HINT,
    Exchange,
    cached_closing,
    clip,
    encoded_tools,
    envelope,
    framing,
    judge_calls,
    memo,
    parts,
    system_text,
)
from ._openai import HttpProvider

if TYPE_CHECKING:
    from ..core._view import RunView
    from ..core._wire import ToolSpec

_encode = msgspec.json.encode

#: The API version the requests are written for.
ANTHROPIC_VERSION = "2023-06-01"


class _Block(msgspec.Struct):
    type: str = ""
    text: str | None = None
    name: str = ""
    id: str = ""
    input: msgspec.Raw = msgspec.Raw(b"{}")


class _Usage(msgspec.Struct):
    input_tokens: int | None = 0
    output_tokens: int | None = 0
    cache_read_input_tokens: int | None = 0
    cache_creation_input_tokens: int | None = 0


class _Message(msgspec.Struct):
    content: list[_Block]
    stop_reason: str | None = None
    usage: _Usage | None = None


_read_message = msgspec.json.Decoder(_Message).decode


def _usage(usage: _Usage | None) -> TokenUsage:
    if usage is None:
        return TokenUsage()
    cached = max(usage.cache_read_input_tokens or 0, 0)
    prompt = (
        max(usage.input_tokens or 0, 0) + cached + max(usage.cache_creation_input_tokens or 0, 0)
    )
    return TokenUsage(prompt, max(usage.output_tokens or 0, 0), cached, 0)


class AnthropicMessages(HttpProvider):
    """Anthropic Messages (``POST {base_url}/v1/messages``), with native tools.

    The options not listed here are :class:`OpenAIChat`'s (timeout, max_in_flight,
    tokens_per_minute, temperature, transition_tool, stream).

    Args:
      model: the model name (also the name prices and metrics use).
      base_url: ``https://api.anthropic.com`` by default.
      api_key: defaults to ``$ANTHROPIC_API_KEY``; never journaled, logged or shown.
      max_tokens: the output limit (the API requires one; 1024 by default).
    """

    api = "messages"
    path = "/v1/messages"
    key_variable = "ANTHROPIC_API_KEY"
    gen_ai_provider = "anthropic"
    default_base_url = "https://api.anthropic.com"

    def auth_headers(self) -> dict[str, str]:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if self._key:
            headers["x-api-key"] = self._key
        return headers

    def _opening(self, view: RunView) -> bytes:
        """The body's start up to the first user turn, kept on the view while the
        system text, the model and the output limit stay."""
        text = system_text(view)
        cache = memo(view)
        found = cache.get("messages_head")
        limit = self.max_tokens or 1024
        if found is None or found[0] is not text or found[1] != (self.model, limit):
            head = {"model": self.model, "max_tokens": limit, "system": text}
            opening = framing(head, "messages", {})[0] + _BEGIN
            found = cache["messages_head"] = (text, (self.model, limit), opening)
        return found[2]  # type: ignore[no-any-return]

    @staticmethod
    def _tool(spec: ToolSpec) -> dict[str, Any]:
        return {"name": spec.name, "description": spec.description, "input_schema": spec.parameters}

    def request_body(self, view: RunView, specs: tuple[ToolSpec, ...]) -> bytes:
        """The exact body: ``{"model":...,"max_tokens":...,"system":...,"messages":[begin,
        turns..., next],...rest}``, joined once from the parts kept on the view and on the
        provider."""
        options = (self.model, self.temperature, self.stream)
        closing = cached_closing(
            self._closings,
            specs,
            options,
            lambda: b"," + _NEXT + framing({"model": self.model}, "messages", self._rest(specs))[1],
        )
        return b"".join([self._opening(view), *parts(view, "messages", _messages_step), closing])

    def _rest(self, specs: tuple[ToolSpec, ...]) -> dict[str, Any]:
        """The body's fields after the messages."""
        body: dict[str, Any] = {
            "tools": msgspec.Raw(encoded_tools(self._tools, specs, self._tool)),
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.stream:
            body["stream"] = True
        return body

    def read(
        self, body: bytes, mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        message = self._decoded(_read_message, body)
        return self._judge(message)

    def _judge(
        self, message: _Message
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        usage = _usage(message.usage)
        calls: list[tuple[str, str]] = []
        texts: list[str] = []
        for block in message.content:
            if block.type == "tool_use":
                calls.append((block.name, bytes(block.input).decode("utf-8", "replace")))
            elif block.type == "text" and block.text:
                texts.append(block.text)
        stop = message.stop_reason
        text = "".join(texts)
        if stop == "refusal":
            return (
                "",
                usage,
                envelope(
                    f"the model refused (stop_reason 'refusal'){': ' + clip(text) if text else ''}",
                    ONE_TOOL_HINT,
                ),
                (),
            )
        if stop == "max_tokens":
            return (
                "",
                usage,
                envelope(
                    "the reply was cut at the output limit (stop_reason 'max_tokens') before it was whole",
                    "make the call shorter, or raise max_tokens",
                ),
                (),
            )
        announced = (
            "stop_reason is 'tool_use' but the reply holds no tool_use block"
            if stop == "tool_use"
            else None
        )
        mismatch = None
        if stop not in ("tool_use", None):
            mismatch = (
                f"the reply holds a tool_use block but stop_reason is {stop!r}, not 'tool_use'",
                ONE_TOOL_HINT,
            )
        return judge_calls(
            calls, text, usage, self.transition, announced=announced, mismatch=mismatch
        )

    def read_stream(
        self, data: list[str], mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        blocks: dict[int, dict[str, Any]] = {}
        stop: str | None = None
        usage: dict[str, int] = {}
        done = False
        for item in data:
            _event, _, payload = item.partition("\n") if "\n" in item else ("", "", item)
            event = self._decoded(msgspec.json.decode, payload)
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "message_start":
                usage.update(_ints((event.get("message") or {}).get("usage")))
            elif kind == "content_block_start":
                block = event.get("content_block") or {}
                blocks[event.get("index", 0)] = {
                    "type": block.get("type", ""),
                    "name": block.get("name", ""),
                    "text": block.get("text") or "",
                    "json": "",
                }
            elif kind == "content_block_delta":
                delta = event.get("delta") or {}
                block = blocks.setdefault(
                    event.get("index", 0), {"type": "", "name": "", "text": "", "json": ""}
                )
                if delta.get("type") == "input_json_delta":
                    block["json"] += delta.get("partial_json") or ""
                elif delta.get("type") == "text_delta":
                    block["text"] += delta.get("text") or ""
            elif kind == "message_delta":
                stop = (event.get("delta") or {}).get("stop_reason") or stop
                usage.update(_ints(event.get("usage")))
            elif kind == "message_stop":
                done = True
            elif kind == "error":
                error = event.get("error") or {}
                raise ProviderError(
                    f"{self.api} at {self.base_url}: the stream reported "
                    f"{error.get('type', 'an error')}: {clip(str(error.get('message', '')))}",
                    retryable=error.get("type")
                    in ("overloaded_error", "api_error", "rate_limit_error"),
                )
        if not done:
            raise ProviderError(
                f"{self.api} at {self.base_url}: the stream ended before message_stop",
                retryable=True,
            )
        content = [
            _Block(
                type=b["type"],
                text=b["text"] or None,
                name=b["name"],
                input=msgspec.Raw((b["json"] or "{}").encode()),
            )
            for _, b in sorted(blocks.items())
        ]
        return self._judge(_Message(content, stop, msgspec.convert(usage, _Usage)))


_BEGIN = _encode({"role": "user", "content": [{"type": "text", "text": "Begin the run."}]})
_NEXT = _encode({"role": "user", "content": [{"type": "text", "text": "Make the next call."}]})


def _messages_step(step: Exchange) -> bytes:
    """One step of the conversation as Messages turns (joined, no brackets)."""
    if step.call is None:
        return _encode({"role": "user", "content": [{"type": "text", "text": step.reply}]})
    calls = [step.call, *step.extra]
    results: list[dict[str, Any]] = [
        {
            "type": "tool_result",
            "tool_use_id": step.call[0],
            "content": step.reply,
            **({"is_error": True} if step.error else {}),
        }
    ]
    results.extend(
        {"type": "tool_result", "tool_use_id": cid, "content": ONE_CALL, "is_error": True}
        for cid, _name, _args in step.extra
    )
    turns = [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": cid, "name": name, "input": _input(args)}
                for cid, name, args in calls
            ],
        },
        {"role": "user", "content": results},
    ]
    return _encode(turns)[1:-1]


def _ints(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}


def _input(arguments: str) -> Any:
    """A call's arguments as the object a ``tool_use`` block's ``input`` must be."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {"unparsed_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}
