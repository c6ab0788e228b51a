"""Providers: where proposals come from (scripted, chaos-wrapped, replayed, real models)."""

from ._base import (
    Proposal as Proposal,
)
from ._base import (
    Provider as Provider,
)
from ._base import (
    estimate_tokens as estimate_tokens,
)
from ._base import (
    render_prompt as render_prompt,
)
from ._chaos import CHAOS_KINDS as CHAOS_KINDS
from ._chaos import ChaosProvider as ChaosProvider
from ._chaos import corrupt as corrupt
from ._scripted import ScriptedProvider as ScriptedProvider
from ._scripted import ScriptExhausted as ScriptExhausted

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
