"""``interlock mcp``: guard an MCP server's tools with a machine (see :mod:`interlock.mcp`)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from ..core._exceptions import ConfigurationError, MissingExtra
from ..stores._open import open_store
from ._common import _add_otel, _close, _journal_url, _Metrics, _tracing, _Usage

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from ..core._machine import Machine


def _machine_source(args: argparse.Namespace) -> Any:
    """A Machine (``--app``) or a builder from the upstream's tools (``--machine``)."""
    if args.machine_file is not None:
        from ..mcp._config import build_machine, load_machine_file

        spec = load_machine_file(args.machine_file)

        def build(tools: list[Any]) -> tuple[Machine, Any]:
            listed = {
                t.name: t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tools
            }
            return build_machine(spec, listed), spec

        return build
    from ..runtime._app import find_ref, load_app

    where, ref, base = find_ref(args.app)
    app = load_app(ref, where, base)
    machines = list(app.machines.values())
    if args.machine_name is not None:
        if args.machine_name not in app.machines:
            raise ConfigurationError(
                f"the app {ref} has no machine {args.machine_name!r}; its machines: "
                f"{', '.join(app.machines)}"
            )
        return app.machines[args.machine_name]
    if len(machines) != 1:
        raise ConfigurationError(
            f"the app {ref} has {len(machines)} machines ({', '.join(app.machines)}); name the "
            "one that guards this server with --machine-name NAME"
        )
    return machines[0]


async def machine_file_for(ref: str, records: Sequence[Any], store: Any) -> Machine:
    """The machine of an MCP machine file, built with the tool definitions its runs pinned
    when they started (replay needs no server)."""
    from ..mcp._config import build_machine, load_machine_file
    from ..mcp._proxy import PINNED_INPUT

    spec = load_machine_file(ref)
    for record in records:
        if record.machine == spec.name:
            first = (await store.load(record.run_id))[0]
            pinned = getattr(first, "inputs", {}).get(PINNED_INPUT)
            if pinned:
                return build_machine(spec, pinned)
    raise ConfigurationError(
        f"--machine {ref}: no run of machine {spec.name!r} in this journal pins its tools' "
        "definitions (runs started by interlock mcp do); replay runs of that machine"
    )


async def toml_application(args: argparse.Namespace) -> tuple[Any, str, str]:
    """``--app FILE.toml`` for a command on one run (``escalations resume|abort``): the app
    of the MCP machine file, built with the tools that run pinned."""
    from ..runtime._app import App
    from ..stores._open import open_store as _open

    named = args.app
    db = _journal_url(args, (named, None))
    store = await _open(db, readonly=True)
    try:
        record = await store.get_run(args.run_id)
        machine = await machine_file_for(named, [record], store)
    finally:
        await _close(store)
    return App([machine]), named, db


async def _mcp(args: argparse.Namespace) -> int:
    try:
        from ..mcp._http import TOKEN_ENV, serve_http
        from ..mcp._serve import Upstream, serve_stdio
    except ImportError as exc:  # pragma: no cover - the [mcp] extra is missing
        raise MissingExtra(
            f"interlock mcp needs the official MCP SDK ({exc}); pip install 'interlock[mcp]'"
        ) from None
    command = list(args.upstream)
    if command and command[0] == "--":
        command = command[1:]
    if bool(command) == bool(args.upstream_url):
        raise _Usage(
            "give the upstream MCP server either as a command after `--` (stdio) or as "
            "--upstream-url URL (Streamable HTTP), not both or neither"
        )
    if args.machine_file is None and args.app is None:
        raise _Usage(
            "interlock mcp needs the machine that guards the server: --machine FILE.toml (a "
            "machine file) or --app module:attribute (a Python application)"
        )
    listen = _listen(args.http) if args.http is not None else None
    if listen is not None and args.session is not None:
        raise _Usage(
            "--session names the one session of a stdio proxy; over --http each client's "
            "session is a run of its own"
        )
    upstream = Upstream(command, args.upstream_url)
    source = _machine_source(args)
    if args.machine_file is not None and args.db is None:
        args.app = None
    _journal_url(args, ("interlock mcp", None) if args.machine_file is not None else None)
    args.hold = False
    metrics = _Metrics(args, {})
    store = await open_store(args.db)
    try:
        with metrics, _tracing(args, "interlock-mcp") as tracing:
            started = metrics.started
            if tracing is not None:

                def started(supervisor: Any, first: Any = metrics.started) -> None:
                    first(supervisor)
                    tracing.attach(supervisor)

            if listen is not None:
                host, port = listen
                await serve_http(
                    source,
                    upstream,
                    store,
                    host=host,
                    port=port,
                    handle_signals=True,
                    token=os.environ.get(TOKEN_ENV) or None,
                    stats=metrics.stats,
                    on_supervisor=started,
                )
            else:
                await serve_stdio(
                    source,
                    upstream,
                    store,
                    session=args.session or "default",
                    stats=metrics.stats,
                    on_supervisor=started,
                )
    finally:
        await _close(store)
    sys.stderr.write(
        "interlock mcp: stopped\n" if listen else "interlock mcp: the client disconnected\n"
    )
    return 0


def _listen(value: str) -> tuple[str, int]:
    """``--http [HOST:]PORT``: where to listen (loopback unless HOST says otherwise)."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or int(port) > 65535:
        raise _Usage(f"--http takes [HOST:]PORT (0: any free port), not {value!r}")
    return host, int(port)


def add_parser(commands: Any, journal: Any, app: Any) -> None:
    """``interlock mcp``'s arguments."""
    import argparse

    mcp = commands.add_parser(
        "mcp",
        help="serve an MCP server's tools over stdio or HTTP, each tools/call verified against a "
        "machine, keyed and journaled before it reaches the server",
        description="Stand between an MCP client and an upstream MCP server: the client's "
        "configuration launches `interlock mcp ... -- COMMAND` in place of COMMAND, or, "
        "with --http, connects to the URL it prints.",
    )
    which = mcp.add_mutually_exclusive_group()
    which.add_argument(
        "--machine",
        dest="machine_file",
        metavar="FILE.toml",
        default=None,
        help="the machine file that guards the server (see the MCP how-to)",
    )
    app(mcp)
    mcp.add_argument(
        "--machine-name",
        default=None,
        metavar="NAME",
        help="with --app: the app's machine that guards the server (when it has several)",
    )
    journal(mcp)
    _add_otel(mcp)
    mcp.add_argument(
        "--session",
        default=None,
        metavar="NAME",
        help="the session's name (default 'default'): its runs are mcp-NAME-N, and a proxy "
        "started again picks up the session's unfinished or escalated run (stdio only)",
    )
    mcp.add_argument(
        "--http",
        default=None,
        metavar="[HOST:]PORT",
        help="serve MCP clients over Streamable HTTP at http://HOST:PORT/mcp instead of "
        "stdio (HOST 127.0.0.1 unless given; PORT 0 picks a free one, printed on stderr); "
        "each client session is a run of its own; with INTERLOCK_MCP_TOKEN set, a request "
        "without 'Authorization: Bearer TOKEN' is answered 401",
    )
    mcp.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the runtime's Prometheus metrics at http://127.0.0.1:PORT/metrics "
        "(the same families as every run: proposals, rejections, tool calls, breaker trips)",
    )
    mcp.add_argument(
        "--upstream-url",
        default=None,
        metavar="URL",
        help="reach the upstream over Streamable HTTP at URL instead of launching a command",
    )
    mcp.add_argument(
        "upstream",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND [ARG ...]",
        help="the upstream server's command line (stdio)",
    )
