"""Providers: where proposals come from (scripted, chaos-wrapped, replayed, real models)."""

from ._base import (
    Proposal as Proposal,
    Provider as Provider,
    estimate_tokens as estimate_tokens,
    render_prompt as render_prompt,
)
from ._chaos import CHAOS_KINDS as CHAOS_KINDS, ChaosProvider as ChaosProvider, corrupt as corrupt
from ._scripted import ScriptedProvider as ScriptedProvider, ScriptExhausted as ScriptExhausted

__all__ = [
    "CHAOS_KINDS",
    "ChaosProvider",
    "Proposal",
    "Provider",
    "ScriptExhausted",
    "ScriptedProvider",
    "corrupt",
    "estimate_tokens",
    "render_prompt",
]
