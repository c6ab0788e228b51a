"""What the commands share: argument types and options, journals and applications found and opened, tables, metrics, errors."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import trio

from ..core._exceptions import (
    ConfigurationError,
    InterlockError,
    NoProvider,
    RunNotFound,
    StoreDamaged,
)
from ..core._machine import Worker
from ..demo._run import DEFAULT_DB, DemoConfig, build_app
from ..runtime._app import DEMO_REF, App, find_project, find_ref, load_app
from ..runtime._leasing import DEFAULT_TTL
from ..stores._open import open_store, sqlite_path

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.table import Table

    from ..runtime._supervisor import Supervisor
    from ..stores import RunRecord, Store


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


async def _close(store: Store) -> None:
    """Close ``store``, even when Ctrl-C has cancelled the command."""
    with trio.CancelScope(shield=True):
        await store.aclose()


def _print_json(document: Any) -> None:
    sys.stdout.write(_json.encode(document).decode() + "\n")


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


# -- metrics and summaries (demo, run, resume, worker) ---------------------------------


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


# -- tables (runs, show, escalations) --------------------------------------------------


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


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else _json.encode(value).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


#: The ``--otel`` flag's help, the same on every command that has it.
OTEL_HELP = (
    "trace the runs in OpenTelemetry and export them over OTLP (needs interlock[otel]); the "
    "standard OTEL_* variables configure the exporter (OTEL_EXPORTER_OTLP_ENDPOINT, "
    "OTEL_EXPORTER_OTLP_PROTOCOL=grpc, ...), and setting them turns tracing on without it"
)


def _add_otel(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otel", action="store_true", help=OTEL_HELP)


@contextlib.contextmanager
def _tracing(args: argparse.Namespace, service: str) -> Iterator[Any]:
    """The command's tracing (``--otel`` or the OTEL_* variables), or None; at the end the
    spans still open are ended and what is left is exported."""
    from ..runtime._tracing import tracing_from_env

    try:
        tracing = tracing_from_env(force=getattr(args, "otel", False), service=service)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    try:
        yield tracing
    finally:
        if tracing is not None:
            tracing.shutdown()
