"""The provider interface: ``propose(view) -> Proposal``, and the prompt every provider renders."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from .._events import TokenUsage

if TYPE_CHECKING:
    from .._machine import Machine
    from .._view import RunView


class Proposal(msgspec.Struct, frozen=True, gc=False):
    """What a provider returned: the raw text (untrusted), the prompt it was given, the usage."""

    raw: str
    usage: TokenUsage = TokenUsage()
    model: str = ""
    prompt: str = ""


@runtime_checkable
class Provider(Protocol):
    """Anything that proposes the next action of a run in a worker state."""

    model: str

    async def propose(self, view: RunView) -> Proposal:
        """Return the next proposal for the run ``view`` shows. May raise; the run survives."""
        ...


def render_prompt(view: RunView) -> str:
    """The prompt for a run in a worker state: instructions, what is allowed, the history.

    Failed attempts arrive compacted (one frame per run of identical rejections), so
    retries do not flood the context window.
    """
    lines = [_header(view)]
    lines.append(f"inputs: {msgspec.json.encode(dict(view.inputs)).decode()}")
    if view.data:
        lines.append(f"data: {msgspec.json.encode(dict(view.data)).decode()}")
    if view.history:
        lines.append("history:")
        for frame in view.history:
            lines.append(f"  [{frame.seq}] {frame.kind}: {frame.text}")
            for violation in frame.violations:
                lines.append(f"      fix: {violation.hint}")
    lines.append(
        'answer with one JSON object: {"tool": NAME, "args": {...}} or {"next": STATE, "data": {...}}'
    )
    return "\n".join(lines)


#: The part of a prompt that depends only on the machine and the state, rendered once.
_HEADERS: weakref.WeakKeyDictionary[Machine, dict[str, str]] = weakref.WeakKeyDictionary()


def _header(view: RunView) -> str:
    machine = view._run.machine
    headers = _HEADERS.get(machine)
    if headers is None:
        headers = _HEADERS.setdefault(machine, {})
    header = headers.get(view.state)
    if header is None:
        lines = [f"machine: {view.machine}", f"state: {view.state}"]
        instructions = view.instructions
        if instructions:
            lines.append(f"instructions: {instructions}")
        tools = view.allowed_tools
        if tools:
            lines.append("tools allowed here:")
            for name in tools:
                schema = msgspec.json.encode(view.tool_schema(name)).decode()
                lines.append(f"  - {name}: {view.tool_description(name)} args schema: {schema}")
        lines.append(f"legal next states: {', '.join(view.legal_next) or 'none'}")
        header = headers[view.state] = "\n".join(lines)
    return header


def estimate_tokens(text: str) -> int:
    """A rough token count (4 characters a token), for simulated providers."""
    return len(text) // 4 + 1
