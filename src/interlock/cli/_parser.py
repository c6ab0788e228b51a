"""The ``interlock`` argument parser: every command and option."""

from __future__ import annotations

import argparse

from .._version import __version__
from ..core._hotpath import IMPLEMENTATION
from ..core._view import DECIDE_IMPLEMENTATION
from ..demo._http import PROVIDER_KINDS
from ..demo._run import DEFAULT_DB, DEFAULT_RUNS
from ..demo.workflows import WORKFLOWS
from ..stores import OUTCOMES
from ._common import (
    RUNS_LIMIT,
    _add_otel,
    _app,
    _demo_options,
    _journal,
    _json_object,
    _latency,
    _lease_ttl,
    _metrics_options,
    _Parser,
    _port,
    _positive_int,
    _positive_seconds,
    _rate,
    _seconds,
    _url,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="interlock",
        description="A deterministic runtime for LLM agent loops: propose, verify, commit, replay.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=(
            f"interlock {__version__} (hot path: {IMPLEMENTATION}, "
            f"decide path: {DECIDE_IMPLEMENTATION})"
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = commands.add_parser(
        "demo", help="run many concurrent runs of the seed workflows under chaos"
    )
    demo.add_argument(
        "--runs",
        type=_positive_int,
        default=DEFAULT_RUNS,
        help=f"number of runs (default {DEFAULT_RUNS})",
    )
    demo.add_argument(
        "--workflow",
        choices=[*WORKFLOWS, "all"],
        default="all",
        help="which workflow to run (default all)",
    )
    demo.add_argument(
        "--chaos-rate",
        type=_rate,
        default=0.1,
        help="share of corrupted model answers (default 0.1)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of inputs and chaos (default 0)")
    _lease_ttl(demo)
    demo.add_argument(
        "--db",
        type=_url,
        default=None,
        help=f"journal: SQLite path or postgresql:// DSN (default {DEFAULT_DB}, the demo's store)",
    )
    demo.add_argument(
        "--effects", default=None, help="SQLite file of the demo's downstream systems"
    )
    demo.add_argument(
        "--latency",
        type=_latency,
        default=(0.005, 0.02),
        help="simulated model latency LOW,HIGH in ms (default 5,20)",
    )
    demo.add_argument(
        "--provider",
        choices=PROVIDER_KINDS,
        default="sim",
        help="the model: sim (simulated, in process; default), openai, openai-responses or "
        "anthropic (a real or OpenAI-compatible server: --base-url, --model), fake-openai, "
        "fake-openai-responses or fake-anthropic (a local fake server speaking that API: the "
        "whole HTTP path, offline)",
    )
    demo.add_argument(
        "--base-url",
        default=None,
        help="the server of --provider openai|openai-responses|anthropic (default the vendor's; "
        "e.g. http://127.0.0.1:11434/v1 for Ollama)",
    )
    demo.add_argument("--model", default=None, help="the model name, for a real server")
    demo.add_argument(
        "--stream", action="store_true", help="HTTP providers: read Server-Sent Events"
    )
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    _metrics_options(demo, "the runs")

    runs = commands.add_parser("runs", help="list runs in a journal, newest first")
    _journal(runs)
    _app(runs, store=True)
    runs.add_argument("--state", default=None, help="only runs in this state")
    runs.add_argument("--workflow", default=None, help="only runs of this workflow (machine)")
    runs.add_argument(
        "--outcome", choices=OUTCOMES, default=None, help="only runs with this outcome"
    )
    shown_runs = runs.add_mutually_exclusive_group()
    shown_runs.add_argument(
        "--limit",
        type=_positive_int,
        default=RUNS_LIMIT,
        help=f"at most this many runs, the newest (default {RUNS_LIMIT})",
    )
    shown_runs.add_argument("--all", action="store_true", help="every matching run")
    runs.add_argument("--json", action="store_true", help="print as JSON")

    show = commands.add_parser("show", help="print one run's timeline")
    show.add_argument("run_id", metavar="RUN")
    _journal(show)
    _app(show, store=True)
    show.add_argument("--json", action="store_true", help="print as JSON")
    show.add_argument(
        "--conversation",
        action="store_true",
        help="print the conversation as the model saw it at its last call (HTTP providers), "
        "and what it answered",
    )

    escalations = commands.add_parser(
        "escalations", help="work the escalation queue: list, show, resume, abort"
    )
    _journal(escalations)
    escalations.add_argument("--json", action="store_true", help="print as JSON")
    _app(escalations)
    actions = escalations.add_subparsers(dest="action", parser_class=_Parser)
    listing = actions.add_parser(
        "list", help="list escalated runs with their reasons (the default)"
    )
    shown = actions.add_parser("show", help="print an escalated run's reason and timeline")
    shown.add_argument("run_id", metavar="ID")
    resumed = actions.add_parser("resume", help="resume an escalated run through the gate")
    resumed.add_argument("run_id", metavar="ID")
    target = resumed.add_mutually_exclusive_group()
    target.add_argument(
        "--payload", default=None, help="a corrected proposal (JSON), verified like any other"
    )
    target.add_argument(
        "--to",
        default=None,
        help="resume in this state (where it escalated from, or a legal next one)",
    )
    aborted = actions.add_parser("abort", help="end an escalated run (it moves to FAILED)")
    aborted.add_argument("run_id", metavar="ID")
    for action in (resumed, aborted):
        action.add_argument("--note", default="", help="why (journaled)")
        action.add_argument("--by", default=None, help="who (journaled; default: $USER)")
        action.add_argument(
            "--wait",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help=(
                "when an `interlock mcp` proxy holds the SQLite journal, how long to wait "
                "for it to take the request (default 10)"
            ),
        )
        _app(action, sub=True)
    _demo_options(resumed, chaos=False)
    for action in (listing, shown):
        _app(action, sub=True, store=True)
    for action in (listing, shown, resumed, aborted):
        _journal(action, sub=True)
        action.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print as JSON"
        )

    run = commands.add_parser(
        "run",
        help="start runs of one of the application's machines and drive them to the end here",
    )
    run.add_argument(
        "machine", metavar="MACHINE", help="the machine of the runs (one of the app's)"
    )
    run.add_argument(
        "--inputs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="the runs' inputs, a JSON object (default {})",
    )
    run.add_argument(
        "--count",
        type=_positive_int,
        default=1,
        metavar="N",
        help="how many runs of MACHINE with these inputs (default 1)",
    )
    _app(run)
    _journal(run)
    _metrics_options(run, "the runs")
    run.add_argument(
        "--json", action="store_true", help="print every run's outcome and a summary as JSON"
    )

    enqueue = commands.add_parser(
        "enqueue",
        help="create a run in the journal with nothing driving it: the next resume (or worker) runs it",
    )
    enqueue.add_argument("machine", help="the machine of the run (one of the app's)")
    enqueue.add_argument(
        "--inputs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="the run's inputs, a JSON object (default {})",
    )
    enqueue.add_argument("--run-id", default=None, help="the run's id (default: a random one)")
    enqueue.add_argument(
        "--inputs-file",
        default=None,
        metavar="PATH",
        help="create one run per line of PATH, each line the run's inputs as a JSON object "
        "('-': stdin), all in one write (ids generated)",
    )
    _journal(enqueue)
    _app(enqueue)
    enqueue.add_argument("--json", action="store_true", help="print the run as one JSON document")
    resume = commands.add_parser(
        "resume", help="resume every unfinished run in a journal after a crash"
    )
    _journal(resume)
    _app(resume)
    _demo_options(resume, chaos=True)
    _metrics_options(resume, "the resumed runs")
    resume.add_argument(
        "--json", action="store_true", help="print the summary as one JSON document"
    )
    resume.add_argument(
        "--wait",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="SQLite: if another process holds the journal, wait up to SECONDS for it to "
        "finish, then resume what is still unfinished (default 0: name it and exit 2). "
        "PostgreSQL: wait up to SECONDS for the runs other processes lease (default the "
        "lease ttl + 2 s, by when a crashed process's leases have expired)",
    )
    _lease_ttl(resume)

    worker = commands.add_parser(
        "worker",
        help="PostgreSQL: claim runs from the journal and drive them, beside any number of "
        "other workers (SIGTERM drains and exits 0)",
    )
    _app(worker)
    _journal(worker)
    _demo_options(worker, chaos=True)
    _lease_ttl(worker)
    worker.add_argument(
        "--max-runs",
        type=_positive_int,
        default=1000,
        metavar="N",
        help="the most runs driven at once (default 1000)",
    )
    worker.add_argument(
        "--claim-batch",
        type=_positive_int,
        default=100,
        metavar="N",
        help="the most runs taken per claim (default 100)",
    )
    worker.add_argument(
        "--poll",
        type=_positive_seconds,
        default=0.5,
        metavar="SECONDS",
        help="how often an idle worker looks for claimable runs (default 0.5)",
    )
    worker.add_argument(
        "--owner",
        default=None,
        metavar="NAME",
        help="the worker's name in the leases table (default host:pid:random)",
    )
    worker.add_argument(
        "--until-idle",
        action="store_true",
        help="exit 0 once nothing is claimable and no run is driven here (after waiting up "
        "to --wait for runs other processes lease)",
    )
    worker.add_argument(
        "--wait",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="with --until-idle: how long to wait for runs other processes lease (default "
        "the lease ttl + 2 s: a crashed process's leases expire by then)",
    )
    worker.add_argument(
        "--drain-timeout",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long the steps in flight get to finish (default 30)",
    )
    _metrics_options(worker, "the worker's runs")
    worker.add_argument(
        "--json", action="store_true", help="print the summary as one JSON document at exit"
    )
    _add_otel(worker)

    replay = commands.add_parser(
        "replay", help="replay recorded runs offline and report divergences"
    )
    replay.add_argument("run_ids", metavar="RUN", nargs="*", help="runs to replay")
    replay.add_argument("--all", action="store_true", help="replay every run in the journal")
    replay.add_argument("--workflow", default=None, help="with --all: only runs of this workflow")
    _app(replay)
    replay.add_argument(
        "--machine",
        action="append",
        default=[],
        metavar="REF",
        help="replay against this machine instead of the app's (what-if); module:attribute "
        "or path/to/file.py:attribute; repeatable",
    )
    _journal(replay)
    replay.add_argument("--json", action="store_true", help="print the report as JSON")

    check = commands.add_parser(
        "check",
        help="check a journal for damage: every frame's checksum, each run's seqs, the runs "
        "index against the journal (and SQLite's own integrity check); writes nothing",
    )
    _journal(check)
    _app(check, store=True)
    check.add_argument("--json", action="store_true", help="print the report as JSON")

    serve = commands.add_parser(
        "serve",
        help="serve the verification gateway: an HTTP API to start, drive and watch the "
        "application's runs (SIGTERM drains and exits 0)",
    )
    _app(serve)
    _journal(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to bind (default 127.0.0.1; another needs INTERLOCK_API_KEY or "
        "INTERLOCK_API_KEYS_FILE)",
    )
    serve.add_argument(
        "--port", type=_port, default=8080, help="the TCP port (default 8080; 0: any free port)"
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages of this origin (e.g. https://console.example.com) call the API "
        "(CORS; repeatable; also INTERLOCK_GATEWAY_ALLOW_ORIGINS); requests from pages of any "
        "other origin get 403",
    )
    _add_otel(serve)
    streaming = serve.add_mutually_exclusive_group()
    streaming.add_argument(
        "--channel-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="also serve the streaming channel (pipelined msgpack frames) on this TCP port "
        "of --host (0: any free port)",
    )
    streaming.add_argument(
        "--channel-socket",
        default=None,
        metavar="PATH",
        help="also serve the streaming channel on this Unix socket",
    )
    console = commands.add_parser(
        "console",
        help="serve the operator console for a journal: a web page of its runs, their "
        "timelines and the escalation queue (resume, abort, replay), at /console; the "
        "gateway serves it too (interlock serve)",
    )
    _app(console)
    _journal(console)
    console.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to bind (default 127.0.0.1; another needs INTERLOCK_API_KEY or "
        "INTERLOCK_API_KEYS_FILE: an operator key to act, a read key to look)",
    )
    console.add_argument(
        "--port", type=_port, default=8080, help="the TCP port (default 8080; 0: any free port)"
    )
    from ._mcp import add_parser as _mcp_parser

    _mcp_parser(commands, _journal, _app)
    from ._proxy import add_parser as _proxy_parser

    _proxy_parser(commands, _journal, _app)
    return parser
