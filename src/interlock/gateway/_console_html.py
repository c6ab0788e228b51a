"""The operator console's HTML: pages rendered on the server from the journal, escaped.

Every value that came from outside (a model's answer, a tool's result, a run id, a
violation's message, an operator's note) goes through :func:`h` (HTML-escaped, quotes too)
before it is written into a page, and the pages are served with a Content-Security-Policy
that runs only the console's own script file: a hostile string is shown as text, and even
markup that slipped through could run nothing.
"""

from __future__ import annotations

import html
import json
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from ..core._events import (
    BreakerTripped,
    Completed,
    Escalated,
    Event,
    Failed,
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
)
from ..core._machine import ESCALATE, FAILED, SUCCESS_STATES

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from ..core._conversation import Turn

_CURRENT_PAGE = ' aria-current="page"'

__all__ = [
    "REASONS",
    "Step",
    "diagram",
    "group_steps",
    "h",
    "page",
    "why",
]


def h(value: object) -> str:
    """``value`` as text safe anywhere in HTML: in an element and in a quoted attribute."""
    return html.escape(value if isinstance(value, str) else str(value), quote=True)


def q(**params: object) -> str:
    """A query string of the non-empty ``params``, escaped for an attribute."""
    pairs = [(k, str(v)) for k, v in params.items() if v not in (None, "")]
    return h("?" + urllib.parse.urlencode(pairs)) if pairs else ""


def when(ts: float) -> str:
    """A journal timestamp as UTC, to the second."""
    if not ts:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def pretty(value: Any) -> str:
    """A JSON value (or a string holding JSON) indented, for a ``<pre>``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


def pre(value: Any, label: str = "") -> str:
    aria = f' aria-label="{h(label)}"' if label else ""
    return f"<pre{aria}>{h(pretty(value))}</pre>"


def badge(outcome: str) -> str:
    return f'<span class="badge o-{h(outcome)}">{h(outcome)}</span>'


def run_link(run_id: str) -> str:
    return f'<a href="/console/runs/{h(urllib.parse.quote(run_id, safe=""))}">{h(run_id)}</a>'


#: What each reason a run escalates for means, in words, for the queue.
REASONS: Mapping[str, str] = {
    "consecutive_failures": "The model's proposals failed the gate too many times in a row.",
    "repeat": "The model kept proposing the same call: a loop the repeat breaker stopped.",
    "token_budget": "The run used up its token budget.",
    "step_budget": "The run took as many steps as its budget allows.",
    "deadline": "The run passed its deadline.",
    "circuit": "A tool's circuit breaker is open: the tool kept failing across runs.",
    "in_doubt_side_effect": (
        "A tool call may or may not have taken effect (it broke mid-call, or the process "
        "died during it), and the tool can neither be run again safely nor asked: check "
        "the side effect downstream before resuming."
    ),
    "provider_unavailable": "The model's server kept failing; retrying could not help.",
    "request_refused": "The model's server refuses requests of this shape; retrying cannot help.",
}


def why(reason: str, detail: str) -> str:
    """Why a run stopped, in words (the page shows the journal's ``detail`` beside it)."""
    base = reason.split(":", 1)[0].strip()
    said = REASONS.get(base)
    if said is None:
        said = f"It escalated for {reason!r}." if reason else "It escalated."
    return said


# -- the timeline -------------------------------------------------------------------------


@dataclass
class Step:
    """A step of a run's timeline: the events from one model call (or operator action) to
    the next."""

    title: str
    events: list[Event] = field(default_factory=list)


def _tag(event: Event) -> str:
    tag = type(event).__struct_config__.tag
    return tag if isinstance(tag, str) else type(event).__name__


def group_steps(events: Sequence[Event]) -> list[Step]:
    """The run's events grouped into steps: the start; each model call (or proposal made
    without one) with what the gate and the tools made of it; each escalation, resume and
    the end on their own."""
    steps: list[Step] = []
    current: Step | None = None
    number = 0
    for event in events:
        opens: str | None = None
        if isinstance(event, RunStarted):
            opens = "Run started"
        elif isinstance(event, ModelCalled):
            number += 1
            opens = f"Step {number}: model call in {event.state}"
        elif isinstance(event, StepProposed) and (
            current is None
            or not any(isinstance(e, ModelCalled) for e in current.events)
            or any(isinstance(e, StepProposed) for e in current.events)
        ):
            number += 1
            opens = f"Step {number}: proposal in {event.state}"
        elif isinstance(event, Escalated):
            opens = "Escalated"
        elif isinstance(event, Resumed):
            opens = "Resumed by an operator"
        elif isinstance(event, Completed | Failed):
            opens = "Ended"
        if opens is not None or current is None:
            current = Step(opens or "Events")
            steps.append(current)
        current.events.append(event)
    return steps


def _violations(items: Iterable[Any]) -> str:
    rows = "".join(
        f"<tr><td><code>{h(v.code)}</code></td><td><code>{h(v.path)}</code></td>"
        f"<td>{h(v.message)}</td><td>{h(v.hint)}</td></tr>"
        for v in items
    )
    return (
        '<div class="scroll"><table class="viol"><thead><tr><th scope="col">code</th>'
        '<th scope="col">path</th><th scope="col">message</th><th scope="col">hint</th>'
        f"</tr></thead><tbody>{rows}</tbody></table></div>"
    )


def _cost(model: str, usage: Any, prices: Mapping[str, tuple[float, float]]) -> str:
    price = prices.get(model)
    if price is None:
        return ""
    dollars = (usage.prompt * price[0] + usage.completion * price[1]) / 1e6
    return f", ${dollars:.6f}"


def describe(
    event: Event,
    prices: Mapping[str, tuple[float, float]],
    prompts: Mapping[int, str] | None = None,
) -> tuple[str, str, str]:
    """One event as (css class, heading, body HTML); ``prompts``: each model call's whole
    prompt, by seq (a journal compacts a prompt into its difference from the last)."""
    if isinstance(event, RunStarted):
        body = f"machine <code>{h(event.machine)}</code>, in <code>{h(event.state)}</code>"
        if event.inputs:
            body += pre(event.inputs, "inputs")
        return "started", "run started", body
    if isinstance(event, ModelCalled):
        u = event.usage
        tokens = f"{u.prompt} prompt + {u.completion} completion tokens"
        body = (
            f"model <code>{h(event.model)}</code> in <code>{h(event.state)}</code>: {tokens}"
            f"{h(_cost(event.model, u, prices))}, {event.latency * 1000:.0f} ms"
        )
        if event.error:
            body += f'<div class="notice error">{h(event.error)}</div>'
        prompt = (prompts or {}).get(event.seq, "")
        if prompt.strip():
            body += f"<details><summary>Prompt</summary>{pre(prompt, 'prompt')}</details>"
        response = event.response if isinstance(event.response, str) else event.raw
        body += f"<details><summary>Response</summary>{pre(response, 'response')}</details>"
        if event.envelope:
            body += (
                f'<div class="notice error">Refused before the gate: '
                f"{h(event.envelope.message)}</div>"
            )
        return "model", "model call", body
    if isinstance(event, StepProposed):
        body = f"in <code>{h(event.state)}</code> ({h(event.source)}){pre(event.raw, 'proposal')}"
        if event.error:
            body += f'<div class="notice error">{h(event.error)}</div>'
        return "proposed", "proposal", body
    if isinstance(event, ProposalRejected):
        return "rejected", "rejected by the gate", _violations(event.violations)
    if isinstance(event, Transitioned):
        body = f"<code>{h(event.src)}</code> → <code>{h(event.dst)}</code> ({h(event.reason)})"
        if event.delta:
            body += pre(event.delta, "data changed")
        return "moved", "transition", body
    if isinstance(event, IntentRecorded):
        body = (
            f"tool <code>{h(event.tool)}</code>, idempotency key <code>{h(event.key)}</code>"
            f"{pre(event.args, 'arguments')}"
        )
        return "intent", "intent recorded", body
    if isinstance(event, ToolCommitted):
        notes = []
        if event.attempts != 1:
            notes.append(f"{event.attempts} attempts")
        if event.reused:
            notes.append("reused an earlier commit")
        if event.reconciled is True:
            notes.append("reconciled: the call had taken effect")
        extra = f" ({h(', '.join(notes))})" if notes else ""
        body = (
            f"tool <code>{h(event.tool)}</code>, key <code>{h(event.key)}</code>{extra}"
            f"{pre(event.result, 'result')}"
        )
        return "committed", "committed", body
    if isinstance(event, ToolInDoubt):
        body = (
            f"tool <code>{h(event.tool)}</code>, key <code>{h(event.key)}</code>: "
            f"{h(event.error)}{' (after a crash)' if event.after_crash else ''}"
        )
        return "doubt", "in doubt", body
    if isinstance(event, Reconciled):
        applied = {True: "it had taken effect", False: "it had not", None: "unknown"}[event.applied]
        body = f"tool <code>{h(event.tool)}</code>, key <code>{h(event.key)}</code>: {applied}"
        if event.error:
            body += f" ({h(event.error)})"
        return "reconciled", "reconciled", body
    if isinstance(event, ProviderFailed):
        body = f"model <code>{h(event.model)}</code>, attempt {event.attempt}: {h(event.error)}"
        return "failed", "model call failed", body
    if isinstance(event, ToolFailed):
        body = (
            f"tool <code>{h(event.tool)}</code>, key <code>{h(event.key)}</code>: {h(event.error)}"
        )
        return "failed", "tool failed", body
    if isinstance(event, BreakerTripped):
        body = (
            f"breaker <code>{h(event.breaker)}</code> in <code>{h(event.state)}</code>: "
            f"{event.value:g} of limit {event.limit:g}; {h(event.detail)}"
        )
        return "tripped", "breaker tripped", body
    if isinstance(event, Escalated):
        body = f"from <code>{h(event.state)}</code>: {h(why(event.reason, event.detail))}"
        body += f"<br><code>{h(event.reason)}</code>: {h(event.detail)}"
        return "escalated", "escalated", body
    if isinstance(event, Resumed):
        body = f"by <strong>{h(event.by)}</strong>"
        if event.to:
            body += f", in <code>{h(event.to)}</code>"
        if event.note:
            body += f": {h(event.note)}"
        if event.payload:
            body += pre(event.payload, "payload")
        return "resumed", "resumed", body
    if isinstance(event, Completed):
        return "completed", "completed", f"in <code>{h(event.state)}</code>{pre(event.output)}"
    if isinstance(event, Failed):
        return "failed", "failed", f"in <code>{h(event.state)}</code>: {h(event.reason)}"
    data = msgspec.to_builtins(event)
    for name in ("kind", "run_id", "seq", "ts"):
        data.pop(name, None)
    return "other", _tag(event).replace("_", " "), pre(data)


def timeline(
    events: Sequence[Event],
    prices: Mapping[str, tuple[float, float]],
    prompts: Mapping[int, str] | None = None,
) -> str:
    parts = ['<ol class="steps">']
    for step in group_steps(events):
        parts.append(f'<li class="step"><h3>{h(step.title)}</h3>')
        for event in step.events:
            css, heading, body = describe(event, prices, prompts)
            parts.append(
                f'<div class="ev {css}" id="seq-{event.seq}"><span class="kind">{h(heading)}'
                f'</span> <span class="seq">#{event.seq}, {h(when(event.ts))}</span>'
                f"<div>{body}</div></div>"
            )
        parts.append("</li>")
    parts.append("</ol>")
    return "".join(parts)


# -- the conversation ---------------------------------------------------------------------


def render_conversation(turns: Sequence[Turn], tools: Sequence[str]) -> str:
    parts = []
    for turn in turns:
        css = (
            "assistant"
            if turn.role == "assistant"
            else "system"
            if turn.role == "system"
            else "tool"
            if turn.role.startswith("result") or turn.role == "tool"
            else "user"
        )
        parts.append(f'<div class="turn {css}"><strong>{h(turn.role)}</strong>')
        if turn.text:
            parts.append(f"<pre>{h(turn.text)}</pre>")
        if turn.calls:
            count = len(turn.calls)
            label = f"{count} calls in one turn, side by side" if count > 1 else "a call"
            parts.append(f'<div class="calls" role="list" aria-label="{h(label)}">')
            for number, call in enumerate(turn.calls, 1):
                mark = "ran" if call.ran else "not run (one call per turn)"
                parts.append(
                    f'<div class="call{"" if call.ran else " notrun"}" role="listitem">'
                    f"<div>call {number} of {count}: <code>{h(call.name)}</code> "
                    f'<span class="seq">{h(mark)}, id {h(call.id)}</span></div>'
                    f"{pre(call.arguments, 'arguments')}"
                )
                if call.result is not None:
                    parts.append(f"<div>result</div>{pre(call.result, 'result')}")
                parts.append("</div>")
            parts.append("</div>")
        parts.append("</div>")
    if tools:
        parts.append(f'<p class="seq">tools offered: {h(", ".join(tools))}</p>')
    return "".join(parts)


# -- the machine as a diagram --------------------------------------------------------------


def diagram(
    name: str,
    initial: str,
    edges: Mapping[str, Sequence[str]],
    current: str,
    taken: Iterable[tuple[str, str]],
) -> str:
    """The machine as an SVG: its states in columns by distance from the initial state,
    its legal edges, the edges the run took drawn bold, the state it is in filled."""
    taken_set = set(taken)
    visited = {s for pair in taken_set for s in pair} | {initial}
    nodes: list[str] = []
    depth: dict[str, int] = {initial: 0}
    frontier = [initial]
    while frontier:
        following = []
        for state in frontier:
            for dst in edges.get(state, ()):
                if dst not in depth:
                    depth[dst] = depth[state] + 1
                    following.append(dst)
        frontier = following
    for state in [*edges, *(d for ds in edges.values() for d in ds), *visited, current]:
        if state and state not in depth:
            depth[state] = max(depth.values(), default=0) + 1
    nodes = sorted(depth, key=lambda s: (depth[s], s not in edges, s))
    columns: dict[int, list[str]] = {}
    for state in nodes:
        columns.setdefault(depth[state], []).append(state)
    box_w = max(90, *(len(s) * 8 + 24 for s in nodes))
    box_h, gap_x, gap_y, pad = 34, 70, 26, 14
    where: dict[str, tuple[float, float]] = {}
    for col, states in columns.items():
        for row, state in enumerate(states):
            where[state] = (pad + col * (box_w + gap_x), pad + row * (box_h + gap_y))
    width = pad * 2 + (max(columns) + 1) * (box_w + gap_x) - gap_x
    height = pad * 2 + max(len(v) for v in columns.values()) * (box_h + gap_y) - gap_y + 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'width="{width:.0f}" height="{height:.0f}" role="img" aria-labelledby="dg-t dg-d">'
        f'<title id="dg-t">Machine {h(name)}</title>'
        f'<desc id="dg-d">The run is in {h(current)}; bold arrows are the moves it made.</desc>'
        '<defs><marker id="arr" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="#555"/>'
        '</marker><marker id="arr2" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" '
        'fill="#0b57d0"/></marker></defs>'
    ]
    for src, dsts in edges.items():
        for dst in dsts:
            if src not in where or dst not in where:
                continue
            out.append(_edge(where[src], where[dst], box_w, box_h, (src, dst) in taken_set))
    for src, dst in taken_set:  # moves off the machine's edges (an operator's, a breaker's)
        if dst not in edges.get(src, ()) and src in where and dst in where:
            out.append(_edge(where[src], where[dst], box_w, box_h, True, dashed=True))
    for state, (x, y) in where.items():
        fill = "#0b57d0" if state == current else "#e8f0fe" if state in visited else "#fff"
        ink = "#fff" if state == current else "#1a1a1a"
        stroke = (
            "#b3261e"
            if state in (FAILED, ESCALATE)
            else ("#146c2e" if state in SUCCESS_STATES else "#555")
        )
        out.append(
            f'<g><rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" rx="6" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{2 if state in visited else 1}"/>'
            f'<text x="{x + box_w / 2:.0f}" y="{y + box_h / 2 + 5:.0f}" text-anchor="middle" '
            f'font-family="ui-monospace, monospace" font-size="13" fill="{ink}">{h(state)}</text>'
            "</g>"
        )
    out.append("</svg>")
    return "".join(out)


def _edge(
    a: tuple[float, float],
    b: tuple[float, float],
    w: int,
    hgt: int,
    bold: bool,
    dashed: bool = False,
) -> str:
    (x1, y1), (x2, y2) = a, b
    colour = "#0b57d0" if bold else "#777"
    marker = "arr2" if bold else "arr"
    style = f'stroke="{colour}" stroke-width="{3 if bold else 1.2}" fill="none"'
    if dashed:
        style += ' stroke-dasharray="5 4"'
    if x2 > x1:
        sx, sy, ex, ey = x1 + w, y1 + hgt / 2, x2, y2 + hgt / 2
        mid = (sx + ex) / 2
        path = f"M{sx:.0f},{sy:.0f} C{mid:.0f},{sy:.0f} {mid:.0f},{ey:.0f} {ex:.0f},{ey:.0f}"
    elif a == b:  # a self loop, above the box
        sx, sy = x1 + w * 0.35, y1
        ex = x1 + w * 0.65
        path = (
            f"M{sx:.0f},{sy:.0f} C{sx:.0f},{sy - 22:.0f} {ex:.0f},{sy - 22:.0f} {ex:.0f},{sy:.0f}"
        )
    else:  # back or sideways: around below
        sx, sy = x1 + w / 2, y1 + hgt
        ex, ey = x2 + w / 2, y2 + hgt
        low = max(sy, ey) + 18
        path = f"M{sx:.0f},{sy:.0f} C{sx:.0f},{low:.0f} {ex:.0f},{low:.0f} {ex:.0f},{ey:.0f}"
    return f'<path d="{path}" {style} marker-end="url(#{marker})"/>'


# -- the frame ---------------------------------------------------------------------------


def page(
    title: str,
    body: str,
    *,
    nav: str = "",
    who: str = "",
    csrf: str = "",
    live: str = "",
) -> str:
    """A whole page: the bar (the sections, who is signed in), then ``body`` in ``main``;
    ``live``: the event stream whose events refresh the page's live part."""
    links = "".join(
        f'<a href="{href}"{_CURRENT_PAGE if key == nav else ""}>{label}</a>'
        for key, href, label in (
            ("runs", "/console/runs", "Runs"),
            ("escalations", "/console/escalations", "Escalation queue"),
        )
    )
    signed = ""
    if who:
        signed = (
            f'<span class="who">{h(who)}'
            + (
                ' <form method="post" action="/console/logout">'
                f'<input type="hidden" name="csrf" value="{h(csrf)}">'
                '<button type="submit">Sign out</button></form>'
                if csrf
                else ""
            )
            + "</span>"
        )
    note = (
        '<div id="live-note" class="notice info" role="status" hidden>The journal changed '
        'while you were editing. <button type="button" class="plain">Refresh</button></div>'
        '<p class="seq" id="live-status" aria-live="polite"></p>'
        if live
        else ""
    )
    attr = f' data-live="{h(live)}"' if live else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{h(title)} · interlock console</title>"
        '<link rel="icon" href="data:,">'
        '<link rel="stylesheet" href="/console/static/console.css"></head><body>'
        '<a class="skip" href="#main">Skip to content</a>'
        f'<header class="bar"><a href="/console/runs">interlock</a>{links}{signed}</header>'
        f'<main id="main">{note}<div{attr}>{body}</div></main>'
        '<script src="/console/static/console.js" defer></script></body></html>'
    )
