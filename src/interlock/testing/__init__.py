"""Tools for testing an application without a real model: the fake LLM server.

``open_fake_llm(brain)`` serves OpenAI Chat Completions, OpenAI Responses and Anthropic
Messages on a loopback socket, in their exact wire formats (streaming included), answering
each request with what ``brain(api, body, headers)`` returns: a :class:`Reply` (the calls,
text, usage, and each documented quirk of OpenAI-compatible servers as a named flag), a
:class:`Fault` (429 with Retry-After, 500, 529, a hang, a dropped connection, a truncated
stream, an error inside a stream) or a :class:`Raw` body. Point a provider at it::

    async with open_fake_llm(scripted_brain([Reply(calls=[("lookup", '{"id": 7}')])])) as fake:
        model = OpenAIChat("m", base_url=fake.openai_base_url)
"""

from ._fake import API_PATHS as API_PATHS
from ._fake import Brain as Brain
from ._fake import FakeLLM as FakeLLM
from ._fake import Fault as Fault
from ._fake import Raw as Raw
from ._fake import RecordedRequest as RecordedRequest
from ._fake import Reply as Reply
from ._fake import ScriptedBrain as ScriptedBrain
from ._fake import open_fake_llm as open_fake_llm
from ._fake import render_body as render_body
from ._fake import scripted_brain as scripted_brain
from ._fake import serve_fake_llm as serve_fake_llm
from ._fake import tool_results_of as tool_results_of
from ._fake import tools_of as tools_of

__all__ = [
    "API_PATHS",
    "Brain",
    "FakeLLM",
    "Fault",
    "Raw",
    "RecordedRequest",
    "Reply",
    "ScriptedBrain",
    "open_fake_llm",
    "render_body",
    "scripted_brain",
    "serve_fake_llm",
    "tool_results_of",
    "tools_of",
]
