"""The ``interlock`` command line: demo, runs, show, escalations, resume, replay, check, serve."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import trio

from .._version import __version__
from ..core._escalation import answer_again, escalated_from, resume_targets
from ..core._events import (
    BreakerTripped,
    Completed,
    Escalated,
    Failed,
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
    event_to_builtins,
    whole_prompts,
)
from ..core._exceptions import (
    AppRefError,
    ConfigurationError,
    InterlockError,
    InternalError,
    InvalidInputs,
    JournalInconsistent,
    NoProvider,
    RunNotFound,
    StoreDamaged,
)
from ..core._hot_py import compact_failures
from ..core._hotpath import IMPLEMENTATION
from ..core._machine import Machine, Worker
from ..core._view import DECIDE_IMPLEMENTATION, fold, violation_signature
from ..core._wire import ONE_CALL
from ..demo._http import PROVIDER_KINDS
from ..demo._run import DEFAULT_DB, DEFAULT_RUNS, DemoConfig, build_app, run_demo
from ..demo.workflows import WORKFLOWS
from ..runtime._app import DEMO_REF, App, find_project, find_ref, load_app
from ..runtime._handle import run_result
from ..runtime._leasing import DEFAULT_TTL
from ..stores import OUTCOMES, RunRecord, Store
from ..stores._open import open_store, sqlite_path
from ..stores._sqlite import JournalHeld, hold_journal

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.table import Table

    from ..runtime._supervisor import Supervisor


_json = msgspec.json.Encoder(order="sorted")
#: How many runs ``interlock runs`` lists unless told otherwise (the newest).
RUNS_LIMIT = 50


class _Usage(InterlockError):
    """A command line that cannot work as written (exit 2, as argparse's own errors)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"interlock: error: {message}; see '{self.prog} --help'\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number between 0 and 1, got {text!r}"
        ) from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def _latency(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) / 1000 for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LOW,HIGH in milliseconds like 5,20; got {text!r}"
        ) from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 0 <= LOW <= HIGH; got {text!r}")
    return low, high


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be between 0 and 65535 (0: any free port), got {value}"
        )
    return value


def _seconds(text: str) -> float:
    """Seconds to wait: 0 or more, or ``inf`` for as long as it takes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds (e.g. 30 or inf), got {text!r}"
        ) from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds (inf: no limit), got {text}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (e.g. 0.5), got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return value


def _lease_ttl(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lease-ttl",
        type=_positive_seconds,
        default=DEFAULT_TTL,
        metavar="SECONDS",
        help="PostgreSQL: how long the leases this process takes last; heartbeats renew "
        f"them every third of it (default {DEFAULT_TTL:g})",
    )


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (a run's inputs)."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object like \'{{"order_id": "o-1"}}\', got {text!r} ({exc})'
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON object like \'{{"order_id": "o-1"}}\', got {type(value).__name__}'
        )
    return value


def _url(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected a SQLite path or postgresql:// DSN, got {text!r}"
        )
    return text


def _journal(parser: argparse.ArgumentParser, *, sub: bool = False) -> None:
    """``--db``; on a subcommand it overrides the one given before the subcommand."""
    parser.add_argument(
        "--db",
        type=_url,
        default=argparse.SUPPRESS if sub else None,
        help="journal: SQLite path or postgresql:// DSN (default the app's store, else "
        f"[tool.interlock] store in pyproject.toml, else {DEFAULT_DB})",
    )


def _app(parser: argparse.ArgumentParser, *, sub: bool = False, store: bool = False) -> None:
    what = "whose store to read (without --db)" if store else "whose machines to run"
    parser.add_argument(
        "--app",
        default=argparse.SUPPRESS if sub else None,
        metavar="REF",
        help=f"the application {what}: module:attribute or "
        "path/to/file.py:attribute (default $INTERLOCK_APP, else [tool.interlock] app in "
        f"pyproject.toml, else {DEMO_REF})",
    )


def _demo_options(parser: argparse.ArgumentParser, *, chaos: bool) -> None:
    """The built-in demo application's knobs (refused with any other application)."""
    parser.add_argument(
        "--effects", default=None, help="demo app: SQLite file of its downstream systems"
    )
    if not chaos:
        return
    parser.add_argument(
        "--chaos-rate",
        type=_rate,
        default=None,
        help="demo app: share of corrupted model answers (default 0.1)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="demo app: seed of the chaos dice (default 0)"
    )
    parser.add_argument(
        "--latency",
        type=_latency,
        default=None,
        help="demo app: simulated model latency LOW,HIGH in ms (default 5,20)",
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
    return parser


async def _close(store: Store) -> None:
    """Close ``store``, even when Ctrl-C has cancelled the command."""
    with trio.CancelScope(shield=True):
        await store.aclose()


def _print_json(document: Any) -> None:
    sys.stdout.write(_json.encode(document).decode() + "\n")


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


# -- demo -------------------------------------------------------------------------------


def _metrics_options(parser: argparse.ArgumentParser, runs: str) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"serve Prometheus metrics at http://127.0.0.1:PORT/metrics while {runs} execute "
        "(off by default; the documented port is 9464, 0 picks a free one)",
    )
    parser.add_argument(
        "--hold",
        action="store_true",
        help="with --metrics-port: keep serving /metrics after the runs finish, until Ctrl-C "
        "or SIGTERM",
    )


class _Metrics:
    """``--metrics-port``: the runtime's counters served while the runs execute, costed
    with the application's prices; ``--hold`` keeps serving them after."""

    def __init__(self, args: argparse.Namespace, prices: Mapping[str, tuple[float, float]]):
        from ..core._stats import RuntimeStats

        if args.hold and args.metrics_port is None:
            raise _Usage(
                "--hold keeps the metrics server open after the runs; pass --metrics-port too"
            )
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise _Usage(f"--metrics-port must be between 0 and 65535, got {args.metrics_port}")
        self.port: int | None = args.metrics_port
        self.hold: bool = args.hold
        self.prices = prices
        self.stats = RuntimeStats()
        self.supervisor: Supervisor | None = None
        self.server: Any = None
        self.url = ""

    def started(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def __enter__(self) -> _Metrics:
        if self.port is None:
            return self
        from prometheus_client import CollectorRegistry

        from ..runtime._metrics import RuntimeCollector, serve_metrics

        registry = CollectorRegistry()
        registry.register(
            RuntimeCollector(self.stats, supervisor=lambda: self.supervisor, prices=self.prices)
        )
        try:
            self.server = serve_metrics(registry, self.port)
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on 127.0.0.1:{self.port}: {exc.strerror or exc}; "
                "choose another --metrics-port"
            ) from None
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        sys.stderr.write(f"interlock: serving metrics at {self.url}\n")
        sys.stderr.flush()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    async def held(self) -> None:
        """With ``--hold``, serve until Ctrl-C or SIGTERM."""
        import signal

        if self.server is None or not self.hold:
            return
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            sys.stdout.flush()
            sys.stderr.write(
                f"interlock: runs finished; serving {self.url} until Ctrl-C or SIGTERM\n"
            )
            sys.stderr.flush()
            async for _ in signals:
                break


@contextlib.asynccontextmanager
async def _progress(metrics: _Metrics, runs: int, *, quiet: bool) -> AsyncIterator[None]:
    """On a terminal, a live line of the runs' progress on stderr while the block runs
    (read from ``metrics.supervisor`` once it is started); nothing when ``quiet``."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield
        return
    started = time.perf_counter()

    def progress() -> Table:
        table = Table.grid(padding=(0, 2))
        supervisor = metrics.supervisor
        if supervisor is None:
            table.add_row("starting...")
            return table
        stats = supervisor.statistics()
        elapsed = max(time.perf_counter() - started, 1e-9)
        finished = sum(stats.runs_finished.values())
        table.add_row(
            f"runs {finished}/{runs}",
            f"escalated {stats.runs_finished.get('escalated', 0)}",
            f"breaker trips {sum(stats.breaker_trips.values())}",
            f"tokens {stats.tokens:,}",
            f"verifications/s {stats.verifications / elapsed:,.0f}",
        )
        return table

    with Live(progress(), console=console, refresh_per_second=8, transient=True) as live:
        async with trio.open_nursery() as nursery:

            async def refresh() -> None:
                while True:
                    live.update(progress())
                    await trio.sleep(0.125)

            nursery.start_soon(refresh)
            yield
            nursery.cancel_scope.cancel()


async def _demo(args: argparse.Namespace) -> int:
    workflows = tuple(WORKFLOWS) if args.workflow == "all" else (args.workflow,)
    _journal_url(args, (DEMO_REF, DEFAULT_DB))
    config = DemoConfig(
        runs=args.runs,
        workflows=workflows,
        chaos_rate=args.chaos_rate,
        seed=args.seed,
        db=args.db,
        effects=args.effects,
        latency=args.latency,
        provider=args.provider,
        base_url=args.base_url,
        model=args.model,
        stream=args.stream,
        lease_ttl=args.lease_ttl,
    )
    if args.provider == "sim" and (args.base_url or args.model or args.stream):
        raise ConfigurationError(
            "--base-url, --model and --stream are for an HTTP --provider (openai, "
            "openai-responses, anthropic, fake-openai, fake-anthropic); the simulated model "
            "takes none"
        )
    metrics = _Metrics(args, build_app(config).prices)
    with metrics:
        async with _progress(metrics, config.runs, quiet=args.json):
            summary = await run_demo(config, stats=metrics.stats, on_start=metrics.started)
        if args.json:
            _print_json(summary)
        else:
            _print_summary(
                summary,
                f"interlock demo: {summary['runs']} runs in {summary['wall_seconds']} s "
                f"({summary['runs_per_second']} runs/s, hot path {summary['hotpath']})",
            )
        await metrics.held()
    return 0


def _print_summary(summary: dict[str, Any], title: str) -> None:
    from rich.table import Table

    workflows = summary["workflows"]
    names = list(workflows)
    outcomes = Table(title=title)
    for column in (
        "workflow",
        "runs",
        "completed",
        "escalated",
        "failed",
        "tokens",
        "verify p50 µs",
        "p99 µs",
    ):
        # the counts are never cut (see _print_table); the names fold
        outcomes.add_column(
            column,
            justify="left" if column == "workflow" else "right",
            no_wrap=column not in ("workflow", "verify p50 µs"),
            overflow="fold",
        )
    for name, row in workflows.items():
        counts = row["outcomes"]
        outcomes.add_row(
            name,
            str(row["runs"]),
            str(counts.get("completed", 0)),
            str(counts.get("escalated", 0)),
            str(counts.get("failed", 0)),
            f"{row['tokens']['total']:,}",
            f"{row['verification_us']['p50']:.1f}",
            f"{row['verification_us']['p99']:.1f}",
        )
    _print_table(outcomes)
    for heading, key in (
        ("escalations by reason", "escalation_reasons"),
        ("rejections by code", "rejections"),
        ("breaker trips by kind", "breaker_trips"),
    ):
        kinds = sorted({kind for row in workflows.values() for kind in row[key]})
        table = Table(title=heading)
        table.add_column("kind", no_wrap=True, overflow="fold")
        for name in names:
            table.add_column(name, justify="right", no_wrap=True, overflow="fold")
        for kind in kinds:
            table.add_row(kind, *(str(workflows[name][key].get(kind, 0)) for name in names))
        if not kinds:
            table.add_row("none", *("0" for _ in names))
        _print_table(table)
    effects = Table(title="side effects (counted by the downstream systems)")
    for column in ("workflow", "tool", "executions", "applied", "duplicates"):
        name = column in ("workflow", "tool")
        effects.add_column(
            column, justify="left" if name else "right", no_wrap=not name, overflow="fold"
        )
    for name, row in workflows.items():
        for tool, counts in row["side_effects"].items():
            effects.add_row(
                name,
                tool,
                str(counts["executions"]),
                str(counts["applied"]),
                str(counts["duplicates"]),
            )
    if summary["effects_db"]:
        _print_table(effects)
        sys.stdout.write(f"journal: {summary['db']}   side effects: {summary['effects_db']}\n")


# -- runs / show / escalations --------------------------------------------------------


def _record_json(record: RunRecord) -> dict[str, Any]:
    result: dict[str, Any] = msgspec.to_builtins(record)
    return result


#: The columns of a table that are never cut (besides its first, a run id).
_WHOLE = ("outcome", "events", "seq")


def _table(title: str, *columns: str) -> Table:
    """A table whose first column (a run id) and outcome, events and seq are never cut
    (see :func:`_print_table`); the other columns fold to make room."""
    from rich.table import Table

    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, overflow="fold", no_wrap=index == 0 or column in _WHOLE)
    return table


def _print_table(table: Table) -> None:
    """Print ``table``: a column that does not wrap (a run id, an outcome, a number) is
    as wide as its widest cell, however narrow the terminal, and the others fold to make
    room; piped, the table is as wide as it needs."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console()
    for column in table.columns:
        if column.no_wrap:
            column.min_width = max(
                Measurement.get(console, console.options, cell).maximum
                for cell in (column.header, *column.cells)
            )
    if not console.is_terminal:
        wide = console.options.update(max_width=1 << 16)
        console = Console(width=max(console.width, Measurement.get(console, wide, table).maximum))
    console.print(table)


async def _runs(args: argparse.Namespace) -> int:
    _journal_url(args)
    store = await _open_read(args)
    try:
        matching = await store.list_runs(
            machine=args.workflow, state=args.state, outcome=args.outcome
        )
    finally:
        await _close(store)
    records = matching[::-1] if args.all else matching[: -args.limit - 1 : -1]
    left_out = len(matching) - len(records)
    if args.json:
        _print_json(
            {
                "db": args.db,
                "count": len(records),
                "left_out": left_out,
                "runs": [_record_json(r) for r in records],
            }
        )
        return 0
    table = _table(
        f"{_count(len(records), 'run')} in {args.db}, newest first",
        *("run", "workflow", "state", "outcome", "events", "started", "reason"),
    )
    for r in records:
        table.add_row(
            r.run_id, r.machine, r.state, r.outcome, str(r.seq), _when(r.started), r.reason
        )
    if left_out:
        table.caption = f"{_count(left_out, 'older run')} left out; --limit N or --all shows more"
    _print_table(table)
    return 0


def _describe(event: Any) -> str:
    match event:
        case RunStarted(machine=machine, state=state, inputs=inputs):
            return f"started {machine} in {state} with {_short(inputs)}"
        case ModelCalled(model=model, raw=raw, usage=usage):
            tokens = f"({usage.prompt}+{usage.completion} tokens)"
            if event.error:  # a journal from before provider_failed
                return f"model {model} failed: {event.error} {tokens}"
            if event.defect:
                return f"model {model} answered what is not a proposal: {event.defect} {tokens}"
            return f"model {model} proposed {_short(raw)} {tokens}"
        case ProviderFailed(model=model, error=error, attempt=attempt, retry_in=retry_in):
            then = "gave up" if retry_in is None else f"asks again in {retry_in:g} s"
            return f"model {model} did not answer (failure {attempt} in a row): {error}; {then}"
        case ToolInDoubt(tool=tool, key=key, error=error):
            cause = "a crash" if event.after_crash else error
            return f"in doubt: {tool} key={key} may or may not have been applied ({cause})"
        case Reconciled(tool=tool, key=key, applied=applied, error=error):
            if applied is None:
                return f"reconcile of {tool} key={key} failed: {error}"
            return f"reconciled {tool} key={key}: " + ("applied" if applied else "not applied")
        case StepProposed(source=source, raw=raw):
            return f"{source} proposed {_short(raw)}"
        case ProposalRejected(violations=violations):
            return "rejected: " + "; ".join(
                f"[{v.code}] {v.message} -> {v.hint}" for v in violations
            )
        case IntentRecorded(tool=tool, args=args, key=key):
            line = f"intent {tool}({_short(args)}) key={key}"
            if event.next is not msgspec.UNSET:  # call and move: the move it makes on success
                data = event.data if event.data is not msgspec.UNSET else None
                line += f", then -> {event.next}" + (f" data {_short(data)}" if data else "")
            return line
        case ToolCommitted(tool=tool, result=result, attempts=attempts):
            how = (
                "as reconciled, not executed again" if event.reconciled else f"attempts {attempts}"
            )
            return f"committed {tool} -> {_short(result)} ({how})"
        case ToolFailed(tool=tool, error=error, attempts=attempts):
            if event.in_doubt is True:
                return f"failed {tool} in doubt: {error} (attempts {attempts})"
            return f"failed {tool}: {error} (attempts {attempts})"
        case Transitioned(src=src, dst=dst, reason=reason, delta=delta):
            extra = f" data {_short(delta)}" if delta else ""
            if event.delta_in_proposal:
                extra = " data: the proposal's (journaled once, above)"
            return f"{src} -> {dst} ({reason}){extra}"
        case BreakerTripped(breaker=breaker, detail=detail):
            return f"breaker {breaker} tripped: {detail}"
        case Escalated(reason=reason, detail=detail):
            return f"escalated ({reason}): {detail}"
        case Resumed(by=by, note=note, to=to):
            return f"resumed by {by}" + (f" to {to}" if to else "") + (f": {note}" if note else "")
        case Completed(output=output):
            if event.output_in_delta:
                return "completed with the transition's data"
            return f"completed with {_short(output)}"
        case Failed(reason=reason):
            return f"failed: {reason}"
    return repr(event)  # pragma: no cover - the union is closed


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else _json.encode(value).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _show(args: argparse.Namespace) -> int:
    _journal_url(args)
    store = await _open_read(args)
    try:
        record = await store.get_run(args.run_id)
        events = await store.load(args.run_id)
    finally:
        await _close(store)
    # Mark runs of identical rejections the way the model saw them (compacted).
    signatures = [
        violation_signature(e.violations) if isinstance(e, ProposalRejected) else 0 for e in events
    ]
    rejected = [i for i, e in enumerate(events) if isinstance(e, ProposalRejected)]
    groups: dict[int, tuple[int, int]] = {}
    only = [signatures[i] for i in rejected]
    for first, last, count in compact_failures(only):
        for position in range(first, last + 1):
            groups[rejected[position]] = (position - first + 1, count)
    if getattr(args, "conversation", False):
        return _print_conversation(args, events)
    if args.json:
        try:
            prompts = {event.seq: prompt for event, prompt in whole_prompts(events)}
        except ValueError as exc:
            raise JournalInconsistent(f"{args.db}: {exc}") from None
        timeline = []
        for i, event in enumerate(events):
            item = event_to_builtins(event)
            if event.seq in prompts:
                item["prompt_text"] = prompts[event.seq]  # whole, however it was journaled
            if i in groups and groups[i][1] > 1:
                item["compacted"] = {"position": groups[i][0], "of": groups[i][1]}
            timeline.append(item)
        _print_json({"run": _record_json(record), "events": timeline})
        return 0
    from rich.markup import escape

    title = f"run {record.run_id} ({record.machine}): {record.outcome} in {record.state}"
    if record.reason:
        title += f" - {record.reason}"
    table = _table(title, "seq", "time", "event", "what")
    for i, event in enumerate(events):
        kind = type(event).__struct_config__.tag
        mark = ""
        if i in groups and groups[i][1] > 1:
            mark = f" [compacted {groups[i][0]}/{groups[i][1]}]"
        # escape: a violation's "[code]" (and any text a model sent) is not Rich markup
        table.add_row(str(event.seq), _when(event.ts), f"{kind}{mark}", escape(_describe(event)))
    _print_table(table)
    return 0


def _print_conversation(args: argparse.Namespace, events: Sequence[Any]) -> int:
    """The request body of the run's last model call, as turns, and each call's answer."""
    try:
        calls = [(e, prompt) for e, prompt in whole_prompts(events) if isinstance(e.response, str)]
    except ValueError as exc:
        raise JournalInconsistent(f"{args.db}: {exc}") from None
    if not calls:
        raise ConfigurationError(
            f"run {args.run_id!r} has no model call with a journaled request and response (its "
            "provider is not an HTTP one); `interlock show RUN` prints its timeline"
        )
    last, request = calls[-1]
    try:
        body = json.loads(request)
    except ValueError:
        body = None
    lines = [f"model call at seq {last.seq} ({last.model}), {len(calls)} in the run:"]
    if isinstance(body, dict):
        lines.extend(_turns(body))
    else:
        lines.append(request)
    lines.append(f"answered: {_short(last.response, 2000)}")
    if last.envelope:
        lines.append(f"rejected before the gate: {last.envelope.message}")
    elif last.extra_calls:
        # several calls in one turn: the first is proposed, the others are answered as
        # not run; say which, and what came of the one that ran
        came = next(
            (
                _describe(e)
                for e in events
                if e.seq > last.seq
                and isinstance(e, ProposalRejected | IntentRecorded | ToolFailed | Transitioned)
            ),
            "nothing yet",
        )
        count = 1 + len(last.extra_calls)
        lines.append(f"answer call 1 of {count}, ran: {last.raw} -> {came}")
        lines.extend(
            f"answer call {number} of {count}, not run (one call per turn): {name}({arguments})"
            for number, (name, arguments) in enumerate(last.extra_calls, 2)
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _turns(body: dict[str, Any]) -> list[str]:
    """A request body of any of the three APIs as one line a turn; a turn of several
    calls as one line a call, each marked as run (with its result) or not run."""
    results = _results(body)
    out: list[str] = []
    for key in ("system", "instructions"):
        if isinstance(body.get(key), str):
            out.append(f"[system] {body[key]}")
    turn: list[tuple[str, str, str]] = []  # the Responses API's calls: one item each
    for message in body.get("messages") or body.get("input") or ():
        if not isinstance(message, dict):
            continue
        if message.get("type") == "function_call":
            turn.append(
                (str(message.get("call_id")), message.get("name"), message.get("arguments"))
            )
            continue
        if turn:
            out.extend(_call_lines(turn, results))
            turn = []
        role = message.get("role") or message.get("type", "?")
        content = message.get("content")
        calls: list[tuple[str, Any, Any]] = []
        if isinstance(content, list):
            parts = []
            for block in content:
                if not isinstance(block, dict):
                    continue
                kind = block.get("type")
                if kind == "tool_use":
                    calls.append(
                        (str(block.get("id")), block.get("name"), json.dumps(block.get("input")))
                    )
                elif kind == "tool_result":
                    error = " error" if block.get("is_error") else ""
                    parts.append(
                        f"result{error} of {block.get('tool_use_id')}: {block.get('content')}"
                    )
                else:
                    parts.append(str(block.get("text", "")))
            content = " | ".join(part for part in parts if part)
        for call in message.get("tool_calls") or ():
            function = call.get("function", {}) if isinstance(call, dict) else {}
            calls.append((str(call.get("id")), function.get("name"), function.get("arguments")))
        if message.get("type") == "function_call_output":
            role, content = f"result of {message.get('call_id')}", message.get("output")
        if role == "tool":
            role = f"result of {message.get('tool_call_id')}"
        if content or not calls:
            out.append(f"[{role}] {content}")
        out.extend(_call_lines(calls, results))
    out.extend(_call_lines(turn, results))
    tools = [
        t.get("name") or t.get("function", {}).get("name")
        for t in body.get("tools") or ()
        if isinstance(t, dict)
    ]
    if tools:
        out.append(f"[tools] {', '.join(str(t) for t in tools)}")
    return out


def _results(body: dict[str, Any]) -> dict[str, str]:
    """The text of each tool result in a request body, by the id of its call."""
    results: dict[str, str] = {}
    for message in body.get("messages") or body.get("input") or ():
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            results[str(message.get("tool_call_id"))] = str(message.get("content"))
        elif message.get("type") == "function_call_output":
            results[str(message.get("call_id"))] = str(message.get("output"))
        elif isinstance(message.get("content"), list):
            for block in message["content"]:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    results[str(block.get("tool_use_id"))] = str(block.get("content"))
    return results


def _call_lines(calls: Sequence[tuple[str, Any, Any]], results: Mapping[str, str]) -> list[str]:
    """The model's calls of one turn, a line each: of several, the one that ran (its
    result after it) and those answered as not run (one call per turn)."""
    if len(calls) == 1:
        ((id_, name, arguments),) = calls
        return [f"[assistant] call {name}({arguments}) id={id_}"]
    lines = []
    for number, (id_, name, arguments) in enumerate(calls, 1):
        result = results.get(id_)
        if result is not None and ONE_CALL in result:
            mark = "not run (one call per turn)"
            after = ""
        else:
            mark = "ran"
            after = f" -> {_short(result, 400)}" if result is not None else ""
        lines.append(
            f"[assistant] call {number} of {len(calls)}, {mark}: {name}({arguments}) "
            f"id={id_}{after}"
        )
    return lines


async def _escalations(args: argparse.Namespace) -> int:
    action = args.action or "list"
    if action in ("resume", "abort"):
        return await _operate(args, action)
    if action == "show":
        return await _show(args)
    _journal_url(args)
    store = await _open_read(args)
    try:
        records = await store.escalations()
        # where each may resume, by the machines of the app (as the gateway lists them)
        machines: dict[str, Machine] = {}
        if records:
            where, ref, base = find_ref(args.app)
            machines = dict(load_app(ref, where, base).machines)
        origins = [escalated_from(await store.load(r.run_id)) for r in records]
    finally:
        await _close(store)
    targets = [
        resume_targets(machines[r.machine], origin) if r.machine in machines and origin else []
        for r, origin in zip(records, origins, strict=True)
    ]
    if args.json:
        _print_json(
            {
                "db": args.db,
                "count": len(records),
                "escalations": [
                    {**_record_json(r), "from_state": origin, "targets": legal}
                    for r, origin, legal in zip(records, origins, targets, strict=True)
                ],
            }
        )
        return 0
    table = _table(
        f"{_count(len(records), 'escalated run')} in {args.db}",
        *("run", "workflow", "state", "reason", "detail", "since", "resume in"),
    )
    for r, legal in zip(records, targets, strict=True):
        table.add_row(
            r.run_id,
            r.machine,
            r.state,
            r.reason,
            _short(r.detail, 100),
            _when(r.updated),
            ", ".join(legal),
        )
    _print_table(table)
    return 0


def _operator(args: argparse.Namespace) -> str:
    import getpass

    if args.by:
        return str(args.by)
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "operator"


_DEMO_OPTIONS = ("effects", "chaos_rate", "seed", "latency")


def _journal_url(args: argparse.Namespace, app: tuple[str, str | None] | None = None) -> str:
    """The journal a command uses, found the one way every command finds it: ``--db``,
    else the store of the application (``app``: its name and store, or, if None, the one
    ``--app``, ``INTERLOCK_APP`` or ``[tool.interlock] app`` names), else ``store`` under
    ``[tool.interlock]`` in the nearest ``pyproject.toml``, else interlock.db.

    A relative path (the default's too) is read from the project's directory (that of the
    nearest pyproject.toml), so a command run anywhere in the project finds one journal. Sets ``args.db`` and ``args.db_from``; unless ``--db``
    named it, says which journal on stderr, in one line.
    """
    if args.db:
        args.db_from = "--db"
        return str(args.db)
    project = find_project()
    root = project[0].parent if project is not None else None
    if app is None:
        where, ref, base = find_ref(getattr(args, "app", None))
        if where != "the default":
            named = ref if where == "--app" else f"{ref} ({where})"
            app = (named, load_app(ref, where, base).store)
    store = project[1].get("store") if project is not None else None
    if app is not None and app[1]:
        url, origin = _in_project(app[1], root), f"the app {app[0]}"
    elif project is not None and store is not None:
        if not isinstance(store, str) or not store.strip():
            raise _Usage(
                f"{project[0]} [tool.interlock] store must be a SQLite path or postgresql:// "
                f"DSN, got {store!r}; fix it"
            )
        url, origin = _in_project(store, root), f"{project[0]} [tool.interlock] store"
    else:
        url, origin = _in_project(DEFAULT_DB, root), "the default"
    args.db, args.db_from = url, origin
    sys.stderr.write(f"journal: {_named_journal(url)} (from {origin})\n")
    sys.stderr.flush()
    return url


def _in_project(url: str, root: Path | None) -> str:
    """``url`` as :func:`open_store` takes it, a relative SQLite path read from ``root``."""
    path = sqlite_path(url)
    if path is None or root is None or os.path.isabs(os.path.expanduser(path)):
        return url
    if root == Path.cwd().resolve():
        return url  # as written: the messages that name it stay short
    return url[: len(url) - len(path)] + str(root / path)


def _named_journal(url: str) -> str:
    """The journal ``url`` in a message: an absolute SQLite URL, never a password."""
    path = sqlite_path(url)
    if path is not None:
        return "sqlite:///" + os.path.abspath(os.path.expanduser(path)).lstrip("/")
    if url == ":memory:":
        return "memory (nothing kept)"
    from urllib.parse import urlsplit  # not psycopg's parser: it may not be installed

    parts = urlsplit(url)
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    return parts._replace(netloc=netloc).geturl()


async def _open_read(args: argparse.Namespace) -> Store:
    """The journal of a command that only reads, opened read-only: a missing one is an
    error that names it, where it came from and how to name another; nothing is created."""
    path = sqlite_path(args.db)
    if path is not None and not await trio.Path(path).exists():
        raise _missing(path, getattr(args, "db_from", "--db"))
    return await open_store(args.db, readonly=True)


def _missing(path: str, origin: str) -> ConfigurationError:
    if origin == "--db":
        hint = "pass the path of an existing journal, or leave --db out for the app's store"
    else:
        hint = "pass --db PATH, or --app REF for the journal of that application's store"
    return ConfigurationError(
        f"journal {os.path.abspath(path)} does not exist (from {origin}); nothing was "
        f"created; {hint}"
    )


def _application(args: argparse.Namespace) -> tuple[App, str, str]:
    """The application a command runs, what names it (for errors), and its journal."""
    where, ref, base = find_ref(args.app)
    options = {k: getattr(args, k) for k in _DEMO_OPTIONS if getattr(args, k, None) is not None}
    if options and ref != DEMO_REF:
        flag = "--" + next(iter(options)).replace("_", "-")
        raise _Usage(
            f"{flag} tunes the built-in demo application, but {where} names {ref!r}; drop {flag}"
        )
    app = build_app(DemoConfig(**options)) if options else load_app(ref, where, base)
    named = ref if where == "--app" else f"{ref} ({where})"
    # The demo by default: no app was named, so no app's store either.
    return app, named, _journal_url(args, (named, app.store if where != "the default" else None))


def _require(app: App, named: str, records: Sequence[RunRecord], *, run: bool = True) -> None:
    """Refuse, in one line, runs of a machine the application does not have, or (to
    ``run`` them) has no provider for."""
    missing = Counter(r.machine for r in records if r.machine not in app.machines)
    if missing:
        machine, count = missing.most_common(1)[0]
        first = next(r.run_id for r in records if r.machine == machine)
        runs = f"run {first!r}" if count == 1 else f"{count} runs, e.g. {first!r}"
        raise ConfigurationError(
            f"the app {named} has no machine {machine!r} ({runs}); pass the application that "
            "defines it: --app module:attribute or --app path/to/file.py:attribute"
        )
    if not run:
        return
    for name in sorted({r.machine for r in records}):
        _has_provider(app, named, name)
    for record in records:
        if record.outcome == "running":
            _has_state(app, named, record, record.state, "is in state")


def _has_provider(app: App, named: str, name: str) -> None:
    """Refuse to run machine ``name`` if its worker states have no provider in ``app``."""
    mapping = app.provider if isinstance(app.provider, Mapping) else None
    provider = mapping.get(name) if mapping is not None else app.provider
    if provider is None and any(isinstance(s, Worker) for s in app.machines[name].states.values()):
        raise NoProvider(
            f"the app {named} has no provider for machine {name!r}, whose worker states "
            "need one; name an App with provider= (a bare Machine has none)"
        )


def _has_state(app: App, named: str, record: RunRecord, state: str, how: str) -> None:
    """Refuse to run ``record`` from ``state`` if its machine, changed since, has none."""
    machine = app.machines[record.machine]
    if state not in machine.states and not machine.is_terminal(state):
        raise ConfigurationError(
            f"run {record.run_id!r} {how} {state!r}, which machine {machine.name!r} of the app "
            f"{named} does not have (its states: {', '.join(machine.states)}); pass the app "
            "whose machine has it"
        )


async def _operate(args: argparse.Namespace, action: str) -> int:
    from ..runtime._runtime import open_supervisor

    if action == "resume" and args.payload is not None:
        try:
            msgspec.json.decode(args.payload)
        except msgspec.DecodeError as exc:
            raise ConfigurationError(
                f"--payload is not valid JSON ({exc}); pass one proposal like "
                '\'{"tool": "refund", "args": {...}}\' or \'{"next": "STATE"}\''
            ) from None
    app, named, db = _application(args)
    # Read-only first: a missing journal fails fast, creating nothing, and so does a run
    # of a machine the app does not have.
    store = await open_store(db, readonly=True)
    try:
        record = await store.get_run(args.run_id)
        _require(app, named, [record], run=False)
        events = await store.load(args.run_id)
        if record.outcome != "escalated":
            # out of the queue: a repeat of what an operator did is answered, anything
            # else refused, as the gateway and the supervisor decide it
            _, answer = answer_again(
                record.run_id,
                record.outcome,
                record.state,
                events,
                "resume" if action == "resume" else "abort",
                to=args.to if action == "resume" else None,
                payload=args.payload if action == "resume" else None,
            )
            result = run_result(fold(app.machines[record.machine], events))
            if args.json:
                _print_json({**msgspec.to_builtins(result), "repeated": answer})
            else:
                sys.stdout.write(answer + "\n")
            return 0
        # a provider only to drive a resumed hosted run: an abort, or the resume of an
        # external run (its caller drives it on), runs nothing here
        external = bool(events) and getattr(events[0], "external", False) is True
        _require(app, named, [record], run=action == "resume" and not external)
        if action == "resume" and not args.to:
            # where it escalated from: the state it resumes in (with --to, the one rule
            # decides, which takes any state of the machine if that one is gone)
            origin = escalated_from(events)
            if origin:
                _has_state(app, named, record, origin, "escalated from")
    finally:
        await _close(store)
    store = await open_store(db)
    try:
        async with (
            app.open(db, named),
            open_supervisor(list(app.machines.values()), store, provider=app.provider) as sup,
        ):
            if action == "abort":
                result = await sup.abort_escalated(args.run_id, by=_operator(args), note=args.note)
            else:
                handle = await sup.resume_escalated(
                    args.run_id,
                    by=_operator(args),
                    note=args.note,
                    to=args.to,
                    payload=args.payload,
                )
                if handle.external and not handle.done:
                    # no actor: its caller drives it on, so nothing here would end it
                    result = sup.result_of(args.run_id)
                else:
                    result = await handle.wait()
    finally:
        await _close(store)
    document = msgspec.to_builtins(result)
    if args.json:
        _print_json(document)
    else:
        line = f"run {result.run_id}: {result.outcome} in {result.state}"
        if result.outcome == "running":
            line += " (an external run: its caller drives it on)"
        sys.stdout.write(line + (f" ({result.reason})" if result.reason else "") + "\n")
    return 0


#: ``interlock run`` prints one line per run up to this many runs, else a summary.
RUN_LINES = 20


async def _run(args: argparse.Namespace) -> int:
    from ..demo._run import summarize_runs
    from ..runtime._runtime import open_supervisor

    app, named, db = _application(args)
    machine = _machine_of(app, named, args.machine)
    inputs = machine.check_inputs(args.inputs or {})  # refused before anything is opened
    _has_provider(app, named, machine.name)
    metrics = _Metrics(args, app.prices)
    handles = []
    started = time.perf_counter()
    with metrics:
        store = await open_store(db)
        try:
            async with (
                _progress(metrics, args.count, quiet=args.json),
                app.open(db, named),
                open_supervisor(
                    list(app.machines.values()), store, provider=app.provider, stats=metrics.stats
                ) as supervisor,
            ):
                metrics.started(supervisor)
                for _ in range(args.count):
                    handles.append(await supervisor.start_run(machine.name, inputs))
            results = [await handle.wait() for handle in handles]
        finally:
            await _close(store)
        summary = summarize_runs(
            results, metrics.stats, [machine.name], wall=time.perf_counter() - started, db=db
        )
        ended = all(r.outcome == "completed" for r in results)
        if args.json:
            _print_json({**summary, "results": [msgspec.to_builtins(r) for r in results]})
        elif len(results) <= RUN_LINES:
            for r in results:
                line = f"run {r.run_id}: {r.outcome} in {r.state}"
                sys.stdout.write(line + (f" ({r.reason})" if r.reason else "") + "\n")
        else:
            _print_summary(
                summary,
                f"interlock run: {_count(len(results), 'run')} of {machine.name} in "
                f"{summary['wall_seconds']} s ({summary['runs_per_second']} runs/s)",
            )
        await metrics.held()
    return 0 if ended else 1


def _machine_of(app: App, named: str, name: str) -> Machine:
    machine = app.machines.get(name)
    if machine is None:
        raise _Usage(
            f"the app {named} has no machine {name!r}; its machines: "
            + ", ".join(sorted(app.machines))
        )
    return machine


async def _enqueue(args: argparse.Namespace) -> int:
    from ..runtime._enqueue import enqueue_run, enqueue_runs

    app, named, db = _application(args)
    machine = _machine_of(app, named, args.machine)
    many = None
    if args.inputs_file is not None:
        if args.run_id is not None or args.inputs is not None:
            raise _Usage(
                "--inputs-file gives every run's inputs (one JSON object per line); drop "
                "--inputs and --run-id"
            )
        lines = await _inputs_lines(args.inputs_file)
        many = [inputs for _, inputs in lines]
    store = await open_store(db)
    try:
        if many is None:
            ids = [await enqueue_run(store, machine, args.inputs or {}, run_id=args.run_id)]
        else:
            try:
                ids = await enqueue_runs(store, machine, many)
            except InvalidInputs as exc:
                index = getattr(exc, "index", None)
                if index is None:
                    raise
                raise InvalidInputs(
                    f"--inputs-file {args.inputs_file}, line {lines[index][0]}: "
                    f"{exc.__cause__ or exc}; nothing was written"
                ) from None
    finally:
        await _close(store)
    if args.json:
        if many is None:
            _print_json({"run_id": ids[0], "machine": machine.name, "db": db})
        else:
            _print_json({"run_ids": ids, "machine": machine.name, "db": db})
    else:
        app_flag = f" --app {shlex.quote(args.app)}" if args.app else ""
        where = shlex.quote(db)
        them = "it" if many is None else "them"
        driver = (
            f"`interlock resume{app_flag} --db {where}` drives {them}"
            if sqlite_path(db) is not None
            else f"a worker (`interlock worker{app_flag} --db {where}`) or `interlock resume` "
            f"on it drives {them}"
        )
        what = f"run {ids[0]!r}" if many is None else _count(len(ids), "run")
        sys.stdout.write(f"enqueued {what} of {machine.name!r} in {db}; {driver}\n")
    return 0


async def _inputs_lines(path: str) -> list[tuple[int, dict[str, Any]]]:
    """The inputs of ``--inputs-file`` with their line numbers: one JSON object per line
    (``-``: stdin)."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = await trio.Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise _Usage(f"--inputs-file {path}: {exc.strerror or exc}") from None
    inputs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            inputs.append((number, _json_object(line)))
        except argparse.ArgumentTypeError as exc:
            raise _Usage(f"--inputs-file {path}, line {number}: {exc}") from None
    if not inputs:
        raise _Usage(f"--inputs-file {path} holds no inputs; write one JSON object per line")
    return inputs


async def _resume(args: argparse.Namespace) -> int:
    app, named, db = _application(args)
    path = sqlite_path(db)
    if path is None or not await trio.Path(path).exists():  # missing: refused read-only
        return await _resume_held(args, app, named, db)

    def waiting(held: JournalHeld) -> None:
        limit = "as long as it takes" if math.isinf(args.wait) else f"up to {args.wait:g} s"
        sys.stderr.write(f"interlock: journal {db} is held by {held.who}; waiting {limit}\n")
        sys.stderr.flush()

    # One writer per SQLite journal: held (or waited for) before the unfinished runs are
    # read, so a second resume resumes nothing twice and fails before it changes anything.
    async with hold_journal(path, wait=args.wait or 0.0, on_wait=waiting):
        return await _resume_held(args, app, named, db)


async def _resume_held(args: argparse.Namespace, app: App, named: str, db: str) -> int:
    from ..demo._run import resume_app, summarize_store

    metrics = _Metrics(args, app.prices)
    store = await open_store(db, readonly=True)  # a missing journal is an error, not a new one
    try:
        unfinished = await store.unfinished()
        _require(app, named, unfinished)
        if not unfinished:
            if args.json:
                _print_json(await summarize_store(store, list(app.machines), db=db))
            else:
                total = len(await store.list_runs())
                sys.stdout.write(
                    f"nothing to resume in {db}: {_count(total, 'run')}, none unfinished\n"
                )
            return 0
    finally:
        await _close(store)
    with metrics, _log_leases(lambda: "interlock resume"):
        summary = await resume_app(
            app,
            db,
            stats=metrics.stats,
            on_start=metrics.started,
            named=named,
            lease_ttl=args.lease_ttl,
            wait=args.wait,
        )
        if args.json:
            _print_json(summary)
        else:
            _print_summary(
                summary,
                f"interlock resume: {summary['resumed']} runs resumed in "
                f"{summary['wall_seconds']} s ({summary['runs_per_second']} runs/s, hot path "
                f"{summary['hotpath']}); {summary['runs']} runs in the journal",
            )
        await metrics.held()
    if summary["external"]:
        left = summary["external_runs"]
        sys.stderr.write(
            f"interlock: error: {_count(len(left), 'external run')} left running (e.g. "
            f"{left[0]!r}): a run started with external=True is driven by its caller "
            "(Supervisor.submit), which resumes it\n"
        )
        return 1
    return 0


def _what_if(refs: Sequence[str]) -> dict[str, tuple[str, Machine]]:
    """The machines ``--machine`` names, each REF as ``--app`` takes it, by name, with the
    REF that named each."""
    machines: dict[str, tuple[str, Machine]] = {}
    for ref in refs:
        for name, machine in load_app(ref, "--machine").machines.items():
            machines[name] = (ref, machine)
    return machines


async def _worker(args: argparse.Namespace) -> int:
    import signal

    from ..runtime._worker import WorkerControl, run_worker

    app, named, db = _application(args)
    if sqlite_path(db) is not None:
        raise _Usage(
            f"interlock worker needs a PostgreSQL journal (--db postgresql://...), where runs "
            f"are leased to workers; {db} is a SQLite journal, which one process drives: "
            "run `interlock resume` on it"
        )
    metrics = _Metrics(args, app.prices)
    control: WorkerControl | None = None
    name = args.owner or "?"

    def started(worker: WorkerControl) -> None:
        nonlocal control, name
        control = worker
        name = worker.owner
        metrics.started(worker.supervisor)
        assert worker.supervisor.leases is not None
        sys.stderr.write(
            f"interlock worker {name}: ready on {_where(db)} (lease ttl "
            f"{worker.supervisor.leases.ttl:g} s, up to {args.max_runs} runs)\n"
        )
        sys.stderr.flush()

    async def on_signals(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                if control is not None and not control.draining:
                    sys.stderr.write(
                        f"interlock worker {name}: {signal.Signals(signum).name}: draining "
                        f"(the steps in flight finish, then the leases are released)\n"
                    )
                    sys.stderr.flush()
                    control.drain()
                else:  # a second signal: stop now; the leases expire
                    nursery.cancel_scope.cancel()

    with _log_leases(lambda: f"interlock worker {name}"), metrics:
        async with trio.open_nursery() as nursery:
            await nursery.start(on_signals)
            summary = await run_worker(
                app,
                db,
                owner=args.owner,
                lease_ttl=args.lease_ttl,
                max_runs=args.max_runs,
                claim_batch=args.claim_batch,
                poll=args.poll,
                until_idle=args.until_idle,
                idle_wait=args.wait,
                drain_timeout=args.drain_timeout,
                stats=metrics.stats,
                on_start=started,
                named=named,
            )
            nursery.cancel_scope.cancel()
        await metrics.held()
    if args.json:
        _print_json(msgspec.to_builtins(summary))
    else:
        how = "drained" if summary.drained else "idle"
        sys.stdout.write(
            f"interlock worker {summary.owner}: {how} after {summary.wall_seconds} s; claimed "
            f"{summary.claimed}, finished {summary.finished} ({summary.completed} completed, "
            f"{summary.failed} failed, {summary.escalated} escalated), lost {summary.lost} "
            f"leases, released {summary.released}\n"
        )
    return 0


@contextlib.contextmanager
def _log_leases(prefix: Callable[[], str]) -> Iterator[None]:
    """Print the leases' and the worker's log lines (a lost lease, a claim that failed) on
    stderr, one line each, after ``prefix()``."""
    import logging

    class _Prefixed(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{prefix()}: {record.getMessage()}"

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Prefixed())
    loggers = [logging.getLogger(n) for n in ("interlock.leases", "interlock.worker")]
    loggers.append(logging.getLogger("interlock.supervisor"))
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, (level, propagate) in zip(loggers, saved, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


def _where(db: str) -> str:
    from ..stores._open import split_schema
    from ..stores._postgres import describe_dsn

    dsn, schema = split_schema(db)
    return f"{describe_dsn(dsn)} schema {schema}"


async def _replay(args: argparse.Namespace) -> int:
    from ..runtime._replay import replay

    if not args.all and not args.run_ids:
        raise _Usage("name the runs to replay, or pass --all")
    if args.workflow is not None and not args.all:
        raise _Usage("--workflow chooses among --all; pass --all too, or drop it")
    app, named, db = _application(args)
    what_if = _what_if(args.machine)
    overrides = [machine for _ref, machine in what_if.values()]
    machines = {**app.machines, **{m.name: m for m in overrides}}
    store = await _open_read(args)
    try:
        if args.all:
            records = await store.list_runs(machine=args.workflow)
        else:
            records = [await store.get_run(run_id) for run_id in dict.fromkeys(args.run_ids)]
        if args.workflow is not None and not records:
            raise ConfigurationError(
                f"no runs of workflow {args.workflow!r} in {db}; `interlock runs --db {db}` "
                "lists the runs and their workflows"
            )
        _require(App(list(machines.values())), named, records, run=False)
        used = sorted({r.machine for r in records})
        for name, (ref, _machine) in what_if.items():
            if records and name not in used:
                raise ConfigurationError(
                    f"--machine {ref!r} is machine {name!r}, which none of the runs replayed "
                    f"uses (their machines: {', '.join(used)}); name one of theirs"
                )
        journal = {r.run_id: await store.load(r.run_id) for r in records}
    finally:
        await _close(store)
    report = replay(journal, list(machines.values()))
    diverged = report.diverged
    if args.json:
        _print_json(
            {
                "db": db,
                "runs": len(report.runs),
                "reproduced": report.reproduced,
                "diverged": [msgspec.to_builtins(r) for r in diverged],
                "what_if": [m.name for m in overrides],
            }
        )
        return 0 if report.ok else 1
    sys.stdout.write(
        f"replayed {_count(len(report.runs), 'run')} from {db}: {report.reproduced} reproduced, "
        f"{len(diverged)} diverged"
        + (f" (what-if: {', '.join(m.name for m in overrides)})" if overrides else "")
        + "\n"
    )
    if diverged:
        from rich.markup import escape

        table = _table("first divergence per run", "run", "seq", "event", "expected", "got")
        for run in diverged:
            d = run.divergence
            assert d is not None
            table.add_row(run.run_id, str(d.seq), d.kind, escape(d.expected), escape(d.got))
        sys.stdout.flush()
        _print_table(table)
    return 0 if report.ok else 1


async def _check(args: argparse.Namespace) -> int:
    _journal_url(args)
    store = await _open_read(args)
    try:
        report = await store.check()
    finally:
        await _close(store)
    if args.json:
        _print_json(
            {
                "db": args.db,
                "ok": report.ok,
                "runs": report.runs,
                "events": report.events,
                "problems": [msgspec.to_builtins(p) for p in report.problems],
            }
        )
    elif report.ok:
        sys.stdout.write(
            f"ok: {_count(report.runs, 'run')}, {_count(report.events, 'event')}, no damage\n"
        )
    else:
        lines = [f"damaged: {_count(len(report.problems), 'problem')}"]
        lines += [f"  {problem.message}" for problem in report.problems]
        sys.stdout.write("\n".join(lines) + "\n")
    return 0 if report.ok else 1


async def _serve(args: argparse.Namespace) -> int:
    import dataclasses

    from ..gateway import serve_gateway
    from ..gateway._guard import Limits
    from ..gateway._keys import KeyRing

    app, named, db = _application(args)
    keyring = KeyRing.from_env()
    limits = Limits.from_env()
    if args.allow_origin:
        limits = dataclasses.replace(
            limits, allow_origins=(*limits.allow_origins, *args.allow_origin)
        )
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
            f"interlock serve: {server.url}{channel} (app {named}, journal {db}; {keys}); "
            "SIGTERM drains and stops\n"
        )
        sys.stdout.flush()
    sys.stdout.write("interlock serve: drained and stopped; every decided event is journaled\n")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _error(exc: BaseException, args: argparse.Namespace) -> str:
    """The one line an error ends a command with; damage points at ``interlock check``."""
    text = f"interlock: error: {exc}"
    if isinstance(exc, StoreDamaged):
        text += f" ('interlock check --db {args.db}' lists all the damage)"
    elif isinstance(exc, RunNotFound):
        text += f" in {args.db}; `interlock runs --db {shlex.quote(args.db)}` lists its runs"
    return text + "\n"


def _leaves(group: BaseExceptionGroup[BaseException]) -> Any:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


_COMMANDS = {
    "demo": _demo,
    "run": _run,
    "runs": _runs,
    "show": _show,
    "escalations": _escalations,
    "resume": _resume,
    "enqueue": _enqueue,
    "replay": _replay,
    "check": _check,
    "serve": _serve,
    "worker": _worker,
}


#: Seconds a command has, after Ctrl-C, to end cleanly before the process exits at once.
INTERRUPT_GRACE = 1.0


class _Stop:
    """Ctrl-C: cancel the command at once, so it stops at a checkpoint (its journal
    batches whole) and not wherever a KeyboardInterrupt would land, inside trio's own
    bookkeeping included; and if it has not ended :data:`INTERRUPT_GRACE` seconds later
    (or at a second Ctrl-C), exit 130 there, as a crash would leave things.

    Unwinding tens of thousands of runs takes trio seconds (a cancellation per task, and
    the exception groups that carry them); the journal needs none of it: every batch is
    one transaction, written whole or not at all, and what a resume would redo is only
    what no batch holds yet. The clock runs in a thread of its own, so a trio scheduler
    busy with those runs cannot hold it up.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import threading

        self.args = args
        self.interrupted = False
        self.said = threading.Lock()  # whoever takes it says "interrupted", once
        self._read, self._write = os.pipe()
        threading.Thread(target=self._clock, name="interlock-interrupt", daemon=True).start()

    def install(self, cancel: Callable[[], None]) -> Callable[[], None]:
        """Handle SIGINT (``cancel`` cancels the command); returns what restores it."""
        import signal

        token = trio.lowlevel.current_trio_token()

        def stop() -> None:
            self.interrupted = True
            cancel()

        def handler(_signum: int, _frame: object) -> None:
            # NOTE: a signal handler: only a write to a pipe and trio's signal-safe call
            os.write(self._write, b"!")
            token.run_sync_soon(stop, idempotent=True)

        previous = signal.signal(signal.SIGINT, handler)

        def restore() -> None:
            signal.signal(signal.SIGINT, previous)

        return restore

    def _clock(self) -> None:
        import select

        if os.read(self._read, 1) != b"!":
            return  # the command ended without a Ctrl-C
        ready, _, _ = select.select([self._read], [], [], INTERRUPT_GRACE)
        if ready and os.read(self._read, 1) != b"!":
            return  # the command ended cleanly in time
        if not self.said.acquire(blocking=False):
            return
        line = _interrupted_line(self.args)
        if os.isatty(2):  # a live progress display hid the cursor and holds a line
            line = "\r\x1b[2K\x1b[?25h" + line
        # NOTE: not sys.stdout.flush(): the main thread may hold stdout's lock, blocked
        # on a full pipe; what it printed whole is out already, line by line or at exit
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(130)

    def ended(self) -> bool:
        """The command ended: stop the clock; False if it is exiting the process already."""
        os.write(self._write, b"q")
        return self.said.acquire(blocking=False)


async def _command(args: argparse.Namespace, stop: _Stop) -> int:
    """Run the command; Ctrl-C cancels it (see :class:`_Stop`)."""
    code = 130
    async with trio.open_nursery() as nursery:
        # a worker drains on SIGINT and SIGTERM itself
        restore = stop.install(nursery.cancel_scope.cancel) if args.command != "worker" else None
        try:
            code = await _COMMANDS[args.command](args)
        finally:
            if restore is not None:
                restore()
        nursery.cancel_scope.cancel()
    if stop.interrupted:
        raise KeyboardInterrupt
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``interlock`` console script and ``python -m interlock``."""
    args = build_parser().parse_args(argv)
    stop = _Stop(args)
    try:
        return _main(args, stop)
    finally:
        stop.ended()


def _main(args: argparse.Namespace, stop: _Stop) -> int:
    try:
        return trio.run(_command, args, stop)
    except (AppRefError, _Usage, JournalHeld) as exc:
        sys.stderr.write(_error(exc, args))
        return 2
    except InternalError as exc:  # one line too; INTERLOCK_DEBUG=1 shows the traceback
        if os.environ.get("INTERLOCK_DEBUG"):
            raise
        sys.stderr.write(_error(exc, args).rstrip("\n") + " (INTERLOCK_DEBUG=1 shows where)\n")
        return 1
    except (InterlockError, ValueError, OSError) as exc:
        sys.stderr.write(_error(exc, args))
        return 1
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            return _interrupted(args, stop)
        expected = [e for e in leaves if isinstance(e, InterlockError | ValueError | OSError)]
        if not expected or len(expected) != len(leaves):
            raise
        sys.stderr.write(_error(expected[0], args))
        return 2 if isinstance(expected[0], AppRefError | _Usage | JournalHeld) else 1
    except KeyboardInterrupt:
        return _interrupted(args, stop)


def _interrupted(args: argparse.Namespace, stop: _Stop) -> int:
    """Ctrl-C: one line, not a traceback; every batch written so far is in the journal."""
    if not stop.ended():
        time.sleep(60)  # the clock is exiting the process, having said so
    sys.stderr.write(_interrupted_line(args))
    return 130


def _interrupted_line(args: argparse.Namespace) -> str:
    db = getattr(args, "db", None)
    app = f" --app {shlex.quote(args.app)}" if getattr(args, "app", None) else ""
    resume = (
        f"; `interlock resume --db {shlex.quote(db)}{app}` continues the unfinished runs"
        if db
        else ""
    )
    return f"interlock: interrupted{resume}\n"
