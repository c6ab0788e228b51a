"""The model proxy: OpenAI-compatible endpoints that verify the tool calls a model returns
against a run's machine before the application sees them (``interlock proxy``)."""

from ._chat import KEY_HEADER, RUN_HEADER, Answer, ChatProxy
from ._serve import serve_model_proxy

__all__ = ["KEY_HEADER", "RUN_HEADER", "Answer", "ChatProxy", "serve_model_proxy"]
