"""The model proxy: OpenAI- and Anthropic-compatible endpoints that verify the tool calls a
model returns against a run's machine before the application sees them (``interlock
proxy``), and LiteLLM's generic guardrail API for a LiteLLM proxy in front of a model."""

from ._litellm import GUARDRAIL_PATH
from ._proxy import DEFAULT_REASKS, KEY_HEADER, RUN_HEADER, Answer, ModelProxy, RunRefused
from ._serve import ModelProxyServer, serve_model_proxy

__all__ = [
    "DEFAULT_REASKS",
    "GUARDRAIL_PATH",
    "KEY_HEADER",
    "RUN_HEADER",
    "Answer",
    "ModelProxy",
    "ModelProxyServer",
    "RunRefused",
    "serve_model_proxy",
]
