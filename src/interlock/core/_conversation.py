"""A model request body read as a conversation: one parser for the three APIs' bodies
(Chat Completions, Responses, Messages), shared by the console's run page and
``interlock show --conversation``, which each only format its turns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._wire import ONE_CALL

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Call", "Turn", "conversation", "offered_tools"]


@dataclass
class Call:
    """One call of the model's, with the result the conversation reported for it."""

    id: str
    name: str
    arguments: str
    result: str | None = None
    ran: bool = True
    """False for a call the runtime answered as not run (one call per turn)."""


@dataclass
class Turn:
    """One message: its role (``system``, ``user``, ``assistant``, ``result of ID``, ...),
    its text parts and the calls it made."""

    role: str
    parts: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.parts)


def conversation(body: Any, one_call: str = ONE_CALL) -> list[Turn]:
    """``body`` (a decoded request body of any of the three APIs) as turns, each turn's
    calls with their results; of several calls in one turn, a call the runtime answered
    as not run (its result holds ``one_call``) is marked so. A body that is not an
    object is one ``prompt`` turn."""
    if not isinstance(body, dict):
        return [Turn("prompt", [body if isinstance(body, str) else json.dumps(body)])]
    results = _results(body)
    turns: list[Turn] = []
    for key in ("system", "instructions"):
        if isinstance(body.get(key), str):
            turns.append(Turn("system", [body[key]]))
        elif isinstance(body.get(key), list):
            turns.append(Turn("system", [_text(body[key])]))
    pending: Turn | None = None  # the Responses API's calls: one item each
    for message in body.get("messages") or body.get("input") or ():
        if not isinstance(message, dict):
            continue
        if message.get("type") == "function_call":
            if pending is None:
                pending = Turn("assistant")
                turns.append(pending)
            pending.calls.append(
                Call(
                    str(message.get("call_id")),
                    str(message.get("name")),
                    str(message.get("arguments")),
                )
            )
            continue
        pending = None
        role = str(message.get("role") or message.get("type") or "?")
        content = message.get("content")
        turn = Turn(role)
        if isinstance(content, list):
            for block in content:
                if not isinstance(block, dict):
                    continue
                kind = block.get("type")
                if kind == "tool_use":
                    turn.calls.append(
                        Call(
                            str(block.get("id")),
                            str(block.get("name")),
                            json.dumps(block.get("input")),
                        )
                    )
                elif kind == "tool_result":
                    error = " (error)" if block.get("is_error") else ""
                    turn.parts.append(
                        f"result{error} of {block.get('tool_use_id')}: "
                        f"{_text(block.get('content'))}"
                    )
                elif block.get("text"):
                    turn.parts.append(str(block["text"]))
        elif content is not None:
            text = _text(content)
            if text:
                turn.parts.append(text)
        for call in message.get("tool_calls") or ():
            function = call.get("function", {}) if isinstance(call, dict) else {}
            turn.calls.append(
                Call(str(call.get("id")), str(function.get("name")), str(function.get("arguments")))
            )
        if message.get("type") == "function_call_output":
            turn.role = f"result of {message.get('call_id')}"
            turn.parts = [_text(message.get("output"))]
        elif role == "tool":
            turn.role = f"result of {message.get('tool_call_id')}"
        turns.append(turn)
    for turn in turns:
        for call in turn.calls:
            call.result = results.get(call.id)
            if len(turn.calls) > 1 and call.result is not None and one_call in call.result:
                call.ran = False
    return turns


def offered_tools(body: Any) -> list[str]:
    """The names of the tools a request body offers the model."""
    if not isinstance(body, dict):
        return []
    return [
        str(t.get("name") or t.get("function", {}).get("name"))
        for t in body.get("tools") or ()
        if isinstance(t, dict)
    ]


def _results(body: Mapping[str, Any]) -> dict[str, str]:
    """The text of each tool result in a request body, by the id of its call."""
    results: dict[str, str] = {}
    for message in body.get("messages") or body.get("input") or ():
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            results[str(message.get("tool_call_id"))] = _text(message.get("content"))
        elif message.get("type") == "function_call_output":
            results[str(message.get("call_id"))] = _text(message.get("output"))
        elif isinstance(message.get("content"), list):
            for block in message["content"]:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    results[str(block.get("tool_use_id"))] = _text(block.get("content"))
    return results


def _text(value: Any) -> str:
    """A message's content as text: a string as it is, a list of blocks their texts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(
            str(b.get("text", "")) if isinstance(b, dict) else str(b) for b in value
        ).strip()
    return "" if value is None else json.dumps(value, default=str)
