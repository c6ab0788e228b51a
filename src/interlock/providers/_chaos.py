"""A provider that corrupts another provider's proposals the way production models do."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._events import TokenUsage
from ._base import Proposal, estimate_tokens

if TYPE_CHECKING:
    from ..core._view import RunView
    from ._base import Provider

#: The failure kinds the chaos provider injects.
CHAOS_KINDS = (
    "malformed_json",
    "trailing_comma",
    "markdown_fence",
    "array_as_string",
    "wrong_enum",
    "out_of_range",
    "illegal_transition",
    "unknown_tool",
    "repeat_call",
)


class ChaosProvider:
    """Wraps a provider; at ``rate`` replaces its answer with a typical production failure.

    Deterministic for a given seed: the dice for a run's step depend only on
    ``(seed, run_id, seq)``.

    Args:
      inner: the provider whose answers are corrupted (e.g. a scripted oracle).
      rate: the probability, 0..1, that an answer is corrupted.
      seed: the seed of every run's dice.
      latency: ``(low, high)`` seconds of simulated model latency, drawn per call.
      kinds: the failure kinds to draw from (default: all of :data:`CHAOS_KINDS`).
    """

    def __init__(
        self,
        inner: Provider,
        *,
        rate: float = 0.1,
        seed: int = 0,
        latency: tuple[float, float] = (0.0, 0.0),
        kinds: tuple[str, ...] = CHAOS_KINDS,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"chaos rate must be between 0 and 1; got {rate}")
        unknown = set(kinds) - set(CHAOS_KINDS)
        if unknown:
            raise ValueError(
                f"unknown chaos kinds {sorted(unknown)}; known: {', '.join(CHAOS_KINDS)}"
            )
        self.inner = inner
        self.model = f"chaos:{inner.model}"
        self.rate = rate
        self.seed = seed
        self.latency = latency
        self.kinds = kinds
        self.injected: dict[str, int] = dict.fromkeys(CHAOS_KINDS, 0)

    async def propose(self, view: RunView) -> Proposal:
        rng = random.Random(f"{self.seed}:{view.run_id}:{view.seq}")
        low, high = self.latency
        if high > 0:
            await trio.sleep(rng.uniform(low, high))
        proposal = await self.inner.propose(view)
        if rng.random() >= self.rate:
            return msgspec.structs.replace(proposal, model=self.model)
        kind = rng.choice(self.kinds)
        raw = corrupt(proposal.raw, kind, view, rng)
        self.injected[kind] += 1
        return Proposal(
            raw=raw,
            usage=TokenUsage(proposal.usage.prompt, estimate_tokens(raw)),
            model=self.model,
            prompt=proposal.prompt,
        )


def _first(args: dict[str, Any], predicate: Any) -> str | None:
    for name, value in args.items():
        if predicate(value):
            return name
    return None


def corrupt(raw: str, kind: str, view: RunView, rng: random.Random) -> str:
    """Return ``raw`` damaged in the way ``kind`` names (falls back to malformed JSON)."""
    try:
        proposal = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        proposal = None
    if not isinstance(proposal, dict):
        return raw[: max(1, len(raw) // 2)]
    args = proposal.get("args") if isinstance(proposal.get("args"), dict) else None
    if kind == "trailing_comma" and raw.rstrip().endswith("}"):
        return raw.rstrip()[:-1] + ",}"
    if kind == "markdown_fence":
        return f"```json\n{raw}\n```"
    if kind == "array_as_string" and args:
        name = _first(args, lambda v: isinstance(v, list) and v)
        if name is not None:
            args[name] = ", ".join(map(str, args[name]))
            return msgspec.json.encode(proposal).decode()
    if kind == "wrong_enum" and args and "tool" in proposal:
        try:
            props = view.tool_schema(proposal["tool"]).get("properties", {})
        except KeyError:
            props = {}
        name = next((n for n, p in props.items() if "enum" in p and n in args), None)
        if name is not None:
            args[name] = str(args[name]).upper() + "_X"
            return msgspec.json.encode(proposal).decode()
    if kind == "out_of_range" and args:
        name = _first(args, lambda v: isinstance(v, int | float) and not isinstance(v, bool))
        if name is not None:
            args[name] = -abs(args[name]) - 1 if rng.random() < 0.5 else abs(args[name]) * 1000 + 1
            return msgspec.json.encode(proposal).decode()
    if kind == "illegal_transition":
        legal = set(view.legal_next)
        illegal = [s for s in view.all_states if s not in legal and s != view.state]
        target = rng.choice(illegal) if illegal else "FINISHED"
        return msgspec.json.encode({"next": target}).decode()
    if kind == "unknown_tool":
        return msgspec.json.encode({"tool": "delete_all_records", "args": {}}).decode()
    if kind == "repeat_call" and view.results:
        last = view.results[-1]
        return msgspec.json.encode({"tool": last.tool, "args": last.args}).decode()
    cut = rng.randrange(1, max(2, len(raw) - 1))
    return raw[:cut]
