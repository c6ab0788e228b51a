"""``interlock proxy``: verify the tool calls a model returns before the application sees
them (see :mod:`interlock.modelproxy`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..core._exceptions import ConfigurationError, MissingExtra
from ..stores._open import open_store
from ._common import _add_otel, _close, _journal_url, _tracing

if TYPE_CHECKING:
    import argparse


async def _proxy(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("hypercorn") is None:
        raise MissingExtra(
            "interlock proxy serves HTTP with hypercorn, which is not installed: "
            "pip install 'interlock[gateway]'"
        )
    from ..modelproxy import DEFAULT_REASKS, serve_model_proxy
    from ..providers._openai import PROFILES
    from ._mcp import _listen, _machine_source

    if args.profile is not None and args.profile not in PROFILES:
        raise ConfigurationError(
            f"unknown --profile {args.profile!r}; the profiles: {', '.join(PROFILES)}"
        )
    if args.reasks is not None and args.reasks < 0:
        raise ConfigurationError(
            f"--reasks {args.reasks}: give a whole number >= 0 (0 answers a refusal at once)"
        )
    inputs: dict[str, Any] = {}
    reasks = args.reasks
    if args.machine_file is not None:
        from ..mcp._config import build_machine, load_machine_file
        from ..mcp._proxy import PINNED_INPUT

        spec = load_machine_file(args.machine_file)
        # no upstream lists the tools: each is checked by the file's schema (else any
        # object) and guards; the runs pin that, so replay builds the same machine
        pinned: dict[str, Any] = {name: {} for name in spec.tools}
        machine = build_machine(spec, pinned)
        inputs = {PINNED_INPUT: pinned}
        if reasks is None:
            reasks = spec.reasks
        if args.db is None:
            args.app = None
        _journal_url(args, ("interlock proxy", None))
    else:
        machine = _machine_source(args)
        _journal_url(args)
    host, port = _listen(args.listen)
    store = await open_store(args.db)
    try:
        with _tracing(args, "interlock-proxy") as tracing:
            await serve_model_proxy(
                machine,
                args.upstream,
                store,
                host=host,
                port=port,
                profile=args.profile,
                reasks=DEFAULT_REASKS if reasks is None else reasks,
                inputs=inputs,
                handle_signals=True,
                tracing=tracing,
            )
    finally:
        await _close(store)
    sys.stderr.write("interlock proxy: stopped\n")
    return 0


def add_parser(commands: Any, journal: Any, app: Any) -> None:
    """``interlock proxy``'s arguments."""
    proxy = commands.add_parser(
        "proxy",
        help="serve OpenAI- and Anthropic-compatible endpoints in front of a model, every "
        "tool call it returns verified against a machine before the application sees it",
        description="Stand between an application on the OpenAI or Anthropic SDK and its "
        "model: point the SDK's base_url at the URL this prints. Serves POST "
        "/v1/chat/completions, /v1/responses, /v1/messages and LiteLLM's generic guardrail "
        "(/beta/litellm_basic_guardrail_api).",
    )
    _add_otel(proxy)
    proxy.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="the model's base URL, e.g. https://api.openai.com/v1 (an Anthropic one, "
        "https://api.anthropic.com, takes /v1/messages)",
    )
    which = proxy.add_mutually_exclusive_group()
    which.add_argument(
        "--machine",
        dest="machine_file",
        metavar="FILE.toml",
        default=None,
        help="the machine file that guards the model's calls (the MCP machines' format)",
    )
    app(which)
    proxy.add_argument(
        "--machine-name",
        default=None,
        metavar="NAME",
        help="the app's machine that guards the model's calls (when it has several)",
    )
    journal(proxy)
    proxy.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="[HOST:]PORT",
        help="where to serve (default 127.0.0.1:0, a free port printed on stderr)",
    )
    proxy.add_argument(
        "--profile",
        default=None,
        metavar="NAME",
        help="how the upstream departs from OpenAI's API: openai, vllm, ollama, llama.cpp, "
        "llama-cpp-python, generic (default: openai for api.openai.com, else generic)",
    )
    proxy.add_argument(
        "--reasks",
        type=int,
        default=None,
        metavar="N",
        help="how many times a rejected call is asked again of the model, the violation as "
        "its result, before the application gets the refusal as text (default: the machine "
        "file's reasks, else 2; 0 answers the refusal at once)",
    )
