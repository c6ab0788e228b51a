"""Providers: where proposals come from (scripted, chaos-wrapped, and real models over HTTP)."""

from ..core._sse import SseEvent as SseEvent
from ..core._view import Frame as Frame
from ._anthropic import AnthropicMessages as AnthropicMessages
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
from ._http import HttpResponse as HttpResponse
from ._http import Transport as Transport
from ._openai import GENERIC as GENERIC
from ._openai import LLAMA_CPP as LLAMA_CPP
from ._openai import LLAMA_CPP_PYTHON as LLAMA_CPP_PYTHON
from ._openai import OLLAMA as OLLAMA
from ._openai import OPENAI as OPENAI
from ._openai import PROFILES as PROFILES
from ._openai import VLLM as VLLM
from ._openai import OpenAIChat as OpenAIChat
from ._openai import OpenAIResponses as OpenAIResponses
from ._openai import Profile as Profile
from ._scripted import ScriptedProvider as ScriptedProvider
from ._scripted import ScriptExhausted as ScriptExhausted

__all__ = [
    "CHAOS_KINDS",
    "GENERIC",
    "LLAMA_CPP",
    "LLAMA_CPP_PYTHON",
    "OLLAMA",
    "OPENAI",
    "PROFILES",
    "VLLM",
    "AnthropicMessages",
    "ChaosProvider",
    "Frame",
    "HttpResponse",
    "OpenAIChat",
    "OpenAIResponses",
    "Profile",
    "Proposal",
    "Provider",
    "ScriptExhausted",
    "ScriptedProvider",
    "SseEvent",
    "Transport",
    "corrupt",
    "estimate_tokens",
    "render_prompt",
]
