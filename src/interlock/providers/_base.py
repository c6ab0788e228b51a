"""The provider interface: ``propose(view) -> Proposal``, and the prompt every provider renders."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from .._events import TokenUsage

if TYPE_CHECKING:
    from .._machine import Machine
    from .._view import Frame, RunState, RunView


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
    run = view._run
    lines = [_header(view)]
    lines.append(f"inputs: {msgspec.json.encode(run.inputs).decode()}")
    if run.data:
        lines.append(f"data: {msgspec.json.encode(run.data).decode()}")
    frames = view.history
    if frames:
        lines.append("history:")
        lines.append(_render_history(run, frames))
    lines.append(_ANSWER)
    return "\n".join(lines)


_ANSWER = (
    'answer with one JSON object: {"tool": NAME, "args": {...}} or {"next": STATE, "data": {...}}'
)


def _render_history(run: RunState, frames: tuple[Frame, ...]) -> str:
    # The history only grows, and compaction can change only its last frame (a repeated
    # rejection joins it): the text of every frame before the last one rendered stays.
    # Rendering from there on keeps a step's prompt O(new frames), not O(history).
    rendered, stable_text, _last = run._rendered
    if rendered > len(frames):  # not this history's cache (it never shrinks): start over
        rendered, stable_text = 0, ""
    stable = max(rendered - 1, 0)
    parts = [stable_text] if stable_text else []
    parts.extend(_render_frame(frame) for frame in frames[stable:-1])
    stable_text = "\n".join(parts)
    last = _render_frame(frames[-1])
    run._rendered = (len(frames), stable_text, last)
    return f"{stable_text}\n{last}" if stable_text else last


def _render_frame(frame: Frame) -> str:
    text = f"  [{frame.seq}] {frame.kind}: {frame.text}"
    for violation in frame.violations:
        text += f"\n      fix: {violation.hint}"
    return text


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
