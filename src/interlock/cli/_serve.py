"""``interlock serve``: the verification gateway over HTTP."""

from __future__ import annotations

import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ._common import _application, _count, _tracing

if TYPE_CHECKING:
    import argparse


async def _serve(args: argparse.Namespace) -> int:
    import dataclasses

    from ..gateway._guard import Limits
    from ..gateway._keys import KeyRing

    app, named, db = _application(args)
    keyring = KeyRing.from_env()
    limits = Limits.from_env()
    if args.allow_origin:
        limits = dataclasses.replace(
            limits, allow_origins=(*limits.allow_origins, *args.allow_origin)
        )
    with _tracing(args, "interlock-gateway") as tracing:
        return await _serve_traced(args, app, named, db, keyring, limits, tracing)


async def _serve_traced(
    args: argparse.Namespace,
    app: Any,
    named: str,
    db: str,
    keyring: Any,
    limits: Any,
    tracing: Any,
) -> int:
    from ..gateway import serve_gateway

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            partial(
                serve_gateway,
                app,
                db=db,
                host=args.host,
                port=args.port,
                keyring=keyring,
                limits=limits,
                tracing=tracing,
                channel_port=args.channel_port,
                channel_path=args.channel_socket,
                handle_signals=True,
            )
        )
        keys = (
            "no API key: loopback only, every request has every role"
            if keyring.open
            else f"{_count(len(keyring), 'API key')}"
        )
        channel = f", channel {server.channel}" if server.channel else ""
        sys.stdout.write(
            f"interlock serve: {server.url}{channel} (app {named}, journal {db}; {keys}; "
            f"console {server.url}/console); "
            "SIGTERM drains and stops\n"
        )
        sys.stdout.flush()
    sys.stdout.write("interlock serve: drained and stopped; every decided event is journaled\n")
    return 0


async def _console(args: argparse.Namespace) -> int:
    """``interlock console``: the gateway over a journal, for its console: it drives no run
    on its own (the unfinished ones are left as they are), only the escalated runs an
    operator resumes from the page."""
    from ..gateway import serve_gateway
    from ..gateway._keys import KeyRing
    from ._common import _open_read

    app, named, db = _application(args)
    store = await _open_read(args)  # a missing journal is an error, and nothing is created
    await store.aclose()
    keyring = KeyRing.from_env()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            partial(
                serve_gateway,
                app,
                db=db,
                host=args.host,
                port=args.port,
                keyring=keyring,
                handle_signals=True,
                resume=False,
            )
        )
        keys = (
            "no API key: loopback only, every visitor may act"
            if keyring.open
            else f"{_count(len(keyring), 'API key')}: sign in with one"
        )
        sys.stdout.write(
            f"interlock console: {server.url}/console (app {named}, journal {db}; {keys}); "
            "Ctrl-C or SIGTERM stops it\n"
        )
        sys.stdout.flush()
    return 0
