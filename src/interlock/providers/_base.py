"""The provider interface: ``propose(view) -> Proposal``, and the prompt every provider renders."""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from ..core._events import TokenUsage, Violation

if TYPE_CHECKING:
    from ..core._machine import Machine
    from ..core._view import Frame, RunView


#: The W3C ``traceparent`` of the run whose model call is being made, set by the run's actor
#: when tracing is on ('' otherwise): an HTTP provider sends it, so the model server's own
#: spans join the run's trace.
TRACEPARENT: ContextVar[str] = ContextVar("interlock_traceparent", default="")


class Proposal(msgspec.Struct, frozen=True, gc=False):
    """What a provider returned: the raw text (untrusted), the prompt it was given, the usage.

    An HTTP provider also hands over the exact bodies: ``prompt`` is the request body and
    ``response`` the response body, both journaled (the request as a delta against the
    previous one), so replay needs no network. When the response's envelope already rules
    out a proposal, ``envelope`` says why (``raw`` is then ignored); the calls after the
    first are ``extra_calls``.
    """

    raw: str
    usage: TokenUsage = TokenUsage()
    model: str = ""
    prompt: str = ""
    response: str | None = None
    envelope: Violation | None = None
    extra_calls: tuple[tuple[str, str], ...] = ()


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
    frames = view.history
    if not frames:
        return "\n".join([_head_lines(view), _ANSWER])
    # The history only grows, and compaction can change only its last frame (a repeated
    # rejection joins it): the text of every frame before the last one rendered stays,
    # and so does the head while the state and the data do. Rendering from there on
    # keeps a step's prompt O(new frames), not O(history).
    rendered, previous, stable_end, state, version = view._rendered
    if 0 < rendered <= len(frames) and state == run.state and version == run._data_version:
        stable = rendered - 1
        base = previous[:stable_end]  # the head and the text of frames[:stable]
    else:
        stable = 0
        base = f"{_head_lines(view)}\nhistory:\n"
    texts = [_render_frame(frame) for frame in frames[stable:]]
    if len(texts) > 1:
        middle = "\n".join(texts[:-1])
        base = f"{base}\n{middle}" if stable else f"{base}{middle}"
    last = f"\n{texts[-1]}" if len(frames) > 1 else texts[-1]
    prompt = f"{base}{last}\n{_ANSWER}"
    # Where the stable frames' text ends in this prompt, for the next render. The prompt
    # is the string the run keeps as its latest (run.prompt), so this costs no copy.
    view._rendered = (len(frames), prompt, len(base), run.state, run._data_version)
    return prompt


def _head_lines(view: RunView) -> str:
    run = view._run
    lines = [_header(view), f"inputs: {msgspec.json.encode(run.inputs).decode()}"]
    if run.data:
        lines.append(f"data: {msgspec.json.encode(run.data).decode()}")
    return "\n".join(lines)


_ANSWER = (
    'answer with one JSON object: {"tool": NAME, "args": {...}} or {"next": STATE, "data": {...}}'
)


_CALL_AND_MOVE = (
    "call and move: a call may also name the state to move to once it succeeds, "
    '{"tool": NAME, "args": {...}, "next": STATE, "data": {...}}; if the call fails, '
    "the run stays here"
)


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
        data_schema = view.data_schema
        if data_schema is not None and view.legal_next:
            schema = msgspec.json.encode(data_schema).decode()
            lines.append(f"data of a move from here: must match the JSON Schema {schema}")
        if getattr(machine.states.get(view.state), "call_and_move", False):
            lines.append(_CALL_AND_MOVE)
        header = headers[view.state] = "\n".join(lines)
    return header


def estimate_tokens(text: str) -> int:
    """A rough token count (4 characters a token), for simulated providers."""
    return len(text) // 4 + 1
