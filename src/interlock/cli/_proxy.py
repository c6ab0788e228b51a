"""``interlock proxy``: verify the tool calls a model returns before the application sees
them (see :mod:`interlock.modelproxy`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..core._exceptions import ConfigurationError, MissingExtra
from ..stores._open import open_store
from ._common import _close, _journal_url

if TYPE_CHECKING:
    import argparse


async def _proxy(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("hypercorn") is None:
        raise MissingExtra(
            "interlock proxy serves HTTP with hypercorn, which is not installed: "
            "pip install 'interlock[gateway]'"
        )
    from ..modelproxy import serve_model_proxy
    from ..providers._openai import PROFILES
    from ._mcp import _listen, _machine_source

    if args.profile is not None and args.profile not in PROFILES:
        raise ConfigurationError(
            f"unknown --profile {args.profile!r}; the profiles: {', '.join(PROFILES)}"
        )
    args.machine_file = None
    machine = _machine_source(args)
    host, port = _listen(args.listen)
    _journal_url(args)
    store = await open_store(args.db)
    try:
        await serve_model_proxy(
            machine,
            args.upstream,
            store,
            host=host,
            port=port,
            profile=args.profile,
            reasks=args.reasks,
            handle_signals=True,
        )
    finally:
        await _close(store)
    sys.stderr.write("interlock proxy: stopped\n")
    return 0


def add_parser(commands: Any, journal: Any, app: Any) -> None:
    """``interlock proxy``'s arguments."""
    proxy = commands.add_parser(
        "proxy",
        help="serve an OpenAI-compatible /v1/chat/completions in front of a model, every "
        "tool call it returns verified against a machine before the application sees it",
        description="Stand between an application on the OpenAI SDK and its model: point the "
        "SDK's base_url at the URL this prints.",
    )
    proxy.add_argument(
        "--upstream",
        required=True,
        metavar="URL",
        help="the model's OpenAI-compatible base URL, e.g. https://api.openai.com/v1",
    )
    app(proxy)
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
        default=2,
        metavar="N",
        help="how many times a rejected call is asked again of the model, the violation as "
        "its result, before the application gets the refusal as text (default 2)",
    )
