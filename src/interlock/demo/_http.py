"""The demo over real HTTP: its workflows driven through OpenAIChat or AnthropicMessages,
against a real or OpenAI-compatible server, or against the local fake server, which then
answers as the workflows' simulated model would (so the whole HTTP path runs offline).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import msgspec

from ..core._exceptions import ConfigurationError
from ..providers._chaos import CHAOS_KINDS, corrupt
from ..testing._fake import Reply

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ..core._view import RunView
    from ..providers import Provider

#: The header that carries the run id to the fake server (the fake's brain reads it).
RUN_HEADER = "x-interlock-run"

#: The kinds of ``--provider``.
PROVIDER_KINDS = (
    "sim",
    "openai",
    "openai-responses",
    "anthropic",
    "fake-openai",
    "fake-openai-responses",
    "fake-anthropic",
)


def make_provider(
    kind: str, *, base_url: str | None, model: str | None, stream: bool = False
) -> Provider:
    """The provider ``--provider KIND`` names (not ``sim``, the built-in simulated model).

    Raises:
      ConfigurationError: an unknown kind, or no model named for a real server.
    """
    from ..providers import AnthropicMessages, OpenAIChat, OpenAIResponses

    fake = kind.startswith("fake-")
    if not fake and not model:
        raise ConfigurationError(
            f"--provider {kind} needs --model NAME (the model the server serves, e.g. gpt-4.1-mini "
            "or llama3.1)"
        )
    options: dict[str, Any] = {"stream": stream, "max_in_flight": 256}
    if fake:
        options["run_header"] = RUN_HEADER
        options["api_key"] = "fake-key"
    if kind in ("openai", "fake-openai"):
        return OpenAIChat(model or "fake-sim", base_url=base_url, **options)
    if kind in ("openai-responses", "fake-openai-responses"):
        return OpenAIResponses(model or "fake-sim", base_url=base_url, **options)
    if kind in ("anthropic", "fake-anthropic"):
        return AnthropicMessages(model or "fake-sim", base_url=base_url, **options)
    raise ConfigurationError(f"unknown --provider {kind!r}; use one of {', '.join(PROVIDER_KINDS)}")


def oracle_brain(
    view_of: Callable[[str], RunView],
    oracles: Mapping[str, Callable[[RunView], str]],
    *,
    chaos_rate: float = 0.0,
    seed: int = 0,
) -> Callable[[str, dict[str, Any], Mapping[str, str]], Reply]:
    """A brain for the fake server: what the run's workflow oracle proposes next, as a
    native tool call, corrupted at ``chaos_rate`` as the demo's chaos provider would."""

    def brain(api: str, body: dict[str, Any], headers: Mapping[str, str]) -> Reply:
        run_id = headers.get(RUN_HEADER, "")
        view = view_of(run_id)
        raw = oracles[view.machine](view)
        rng = random.Random(f"{seed}:{run_id}:{view.seq}")
        if chaos_rate and rng.random() < chaos_rate:
            raw = corrupt(raw, rng.choice(CHAOS_KINDS), view, rng)
        return as_reply(raw)

    return brain


def as_reply(raw: str) -> Reply:
    """A proposal as a model would send it through native tools."""
    try:
        proposal = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return Reply(text=raw)  # a malformed proposal: text instead of a call
    if isinstance(proposal, dict) and isinstance(proposal.get("tool"), str):
        args = proposal.get("args", {})
        return Reply(calls=[(proposal["tool"], msgspec.json.encode(args).decode())])
    if isinstance(proposal, dict) and "next" in proposal:
        return Reply(calls=[("transition", raw)])
    return Reply(text=raw)
