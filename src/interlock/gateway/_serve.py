"""Serving the gateway: hypercorn on trio, and a drain on SIGTERM.

:func:`create_app` builds the ASGI app (the API, guarded by keys and limits) over a
running supervisor, for embedding in a server of your own; :func:`serve_gateway` opens
the journal and the supervisor and serves the app until stopped. Stopping (SIGTERM, or
:meth:`GatewayServer.stop`) drains: it stops accepting, lets the requests in flight
finish, flushes the journal, and returns.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import TYPE_CHECKING

import trio

from ..core._exceptions import InterlockError, MissingExtra
from ..core._machine import Machine
from ..core._messages import Sync
from ..core._stats import RuntimeStats
from ..runtime._app import App, load_app
from ..runtime._runtime import open_supervisor
from ..stores import LeasingStore
from ._app import DEFAULT_MAX_BODY, ASGIApp, GatewayApp
from ._connections import ConnectionBudget, serve_http
from ._console import ConsoleApp
from ._guard import Limits, RunQuota, guarded
from ._keys import KeyRing, check_bind
from ._service import GatewayService

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..runtime._supervisor import Supervisor
    from ..runtime._tracing import Tracing

__all__ = ["GatewayServer", "create_app", "serve_gateway"]

log = logging.getLogger("interlock.gateway")


def create_app(
    supervisor: Supervisor | GatewayService,
    *,
    keyring: KeyRing | None = None,
    limits: Limits | None = None,
    prices: Mapping[str, tuple[float, float]] | None = None,
    websocket: ASGIApp | None = None,
    max_waiting: int = 20_000,
    console: bool = True,
) -> GatewayApp:
    """The gateway's ASGI app over a running supervisor (or a service made from one).

    Every HTTP request goes through the guard (keys, roles, body size, rate, timeouts)
    before the API answers it. Serve the app with any ASGI server that runs on trio
    (hypercorn's trio worker), inside the supervisor's ``async with`` block.

    Args:
      supervisor: the running supervisor (``async with open_supervisor(...)``), or a
        :class:`GatewayService` over one.
      keyring: the accepted API keys; default ``KeyRing.from_env()`` (``INTERLOCK_API_KEY``,
        ``INTERLOCK_API_KEYS_FILE``), open (no key needed) when neither is set.
      limits: body size, rate, runs in flight and request timeout; default
        ``Limits.from_env()`` (the ``INTERLOCK_GATEWAY_*`` variables, else the defaults).
      prices: USD per million tokens by model, for the cost metric.
      websocket: an ASGI app for WebSocket connections (refused without one).
      max_waiting: the most requests waiting on the journal before 503s.
      console: serve the operator console at ``/console`` (the same keys: a read role to
        look, the operator role to act).

    Returns:
      the app; ``app.asgi`` is the guarded ASGI callable to serve, ``app.drain()`` stops
      it taking work.
    """
    limits = Limits.from_env() if limits is None else limits
    keyring = KeyRing.from_env() if keyring is None else keyring
    if isinstance(supervisor, GatewayService):
        service = supervisor
    else:
        service = GatewayService(
            supervisor, max_waiting=max_waiting, quota=RunQuota(limits.runs_in_flight)
        )
    pages = ConsoleApp(service, keyring, prices) if console else None
    app = GatewayApp(
        service,
        prices=prices,
        max_body=max(limits.max_body, DEFAULT_MAX_BODY),
        websocket=websocket,
        console=pages,
    )
    app.asgi = guarded(app, keyring, limits)
    return app


class GatewayServer:
    """A gateway being served (what :func:`serve_gateway` hands ``task_status``).

    Attributes:
      url: where it listens, e.g. ``http://127.0.0.1:8080``.
      port: the TCP port (the one picked, for port 0).
      app: the :class:`GatewayApp`; ``app.service`` holds the supervisor.
      channel: the streaming channel's address, '' when it is not served.
    """

    def __init__(
        self,
        url: str,
        app: GatewayApp,
        stop: trio.Event,
        channel: str = "",
        connections: ConnectionBudget | None = None,
    ) -> None:
        self.url = url
        self.connections = connections
        """The connections held open (``open``, ``limit``, ``reaped``), HTTP and channel."""
        self.channel = channel
        """The streaming channel's address (``tcp://HOST:PORT`` or ``unix:PATH``), or ''."""
        self.port = int(url.rsplit(":", 1)[1])
        self.app = app
        self._stop = stop

    @property
    def supervisor(self) -> Supervisor:
        return self.app.service.supervisor

    def stop(self) -> None:
        """Drain and stop: as SIGTERM does."""
        self._stop.set()


async def serve_gateway(
    app_or_ref: App | Machine | Sequence[Machine] | str,
    *,
    db: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8080,
    keyring: KeyRing | None = None,
    limits: Limits | None = None,
    channel_port: int | None = None,
    channel_path: str | None = None,
    handle_signals: bool = False,
    graceful_timeout: float = 10.0,
    resume: bool = True,
    tracing: Tracing | None = None,
    task_status: trio.TaskStatus[GatewayServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an application's machines through the gateway until stopped, then drain.

    Opens the journal, enters the application's lifespan, starts a supervisor (resuming
    the unfinished hosted runs; external runs wait for their callers), and serves the API
    with hypercorn's trio worker. On :meth:`GatewayServer.stop` (or SIGTERM, with
    ``handle_signals``) it stops accepting, finishes the requests in flight (for up to
    ``graceful_timeout`` seconds), ends the event streams, flushes the journal, stops the
    hosted runs (each resumes from its journal next time), and returns.

    On PostgreSQL (a store with leases) the gateway is stateless: it resumes nothing,
    enqueues the hosted runs it is asked to start for workers (``interlock worker``) to
    drive, and folds each external run from the store when a request for it comes; any
    number of instances serve the same database (see :class:`GatewayService`).

    Args:
      app_or_ref: an :class:`~interlock.App`, a machine or machines, or a reference
        (``module:attribute`` or ``path/file.py:attribute``).
      db: the journal, a SQLite path or ``postgresql://`` DSN; default the app's store,
        else an in-memory one.
      host: the address to bind; without API keys only loopback is allowed.
      port: the TCP port; 0 picks a free one (read it from the GatewayServer).
      keyring: the API keys; default from the environment (see :func:`create_app`).
      limits: the gateway's limits.
      channel_port: also serve the streaming channel (length-prefixed msgpack frames, see
        ``gateway._channel``) on this TCP port of ``host`` (0: a free one), over the same
        service, keys and rate; None: no channel.
      channel_path: serve the channel on this Unix socket instead.
      handle_signals: drain on SIGTERM (the CLI sets it; needs the main thread).
      graceful_timeout: the seconds requests in flight get to finish when stopping.
      tracing: trace the runs in OpenTelemetry (``interlock[otel]``; see
        ``interlock.runtime._tracing``); None: off. A ``traceparent`` header on the request
        that starts a run is continued by the run's spans.
      resume: drive the unfinished hosted runs on from their journals (``interlock
        console`` serves a journal without doing so: it drives only what an operator resumes).
      task_status: receives the :class:`GatewayServer` once it listens.

    Raises:
      ValueError: a non-loopback ``host`` with no API key configured, or bad limits.
      AppRefError: ``app_or_ref`` names no application.
      StoreError: the journal cannot be opened.
      MissingExtra: hypercorn (the ``[gateway]`` extra) is not installed.
    """
    try:
        from hypercorn.config import Config
    except ImportError:
        raise MissingExtra(
            "the gateway needs hypercorn, which is not installed; install the gateway extra: "
            "pip install 'interlock[gateway]'"
        ) from None

    from ..stores import open_store

    app = _application(app_or_ref)
    keyring = KeyRing.from_env() if keyring is None else keyring
    limits = Limits.from_env() if limits is None else limits
    check_bind(host, keyring)
    budget = ConnectionBudget.within_descriptors(limits.max_connections)
    url = db or app.store
    store = await open_store(url)
    stats = RuntimeStats()
    # NOTE: on a store with leases (PostgreSQL), workers drive the hosted runs and any
    # instance the external ones: resuming them here would hold them here. (A PostgreSQL
    # schema older than the leases has one writer, as SQLite: it resumes.)
    workers = isinstance(store, LeasingStore) and getattr(store, "leasing", False) is True
    try:
        async with (
            app.open(url or ":memory:"),
            open_supervisor(
                list(app.machines.values()),
                store,
                provider=app.provider,
                resume=resume and not workers,
                stats=stats,
                tracing=tracing,
            ) as supervisor,
        ):
            gateway = create_app(supervisor, keyring=keyring, limits=limits, prices=app.prices)
            config = Config()
            config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
            config.graceful_timeout = graceful_timeout
            config.accesslog = None
            config.errorlog = logging.getLogger("hypercorn.error")
            # NOTE: a new connection gets idle_timeout for its first request, and one between
            # requests as long again; the budget closes the longest idle first when full.
            config.keep_alive_timeout = limits.idle_timeout
            # NOTE: hypercorn closes a connection after 1,000 requests by default; an agent
            # proposing over one keep-alive connection would reconnect every 1,000 steps.
            config.keep_alive_max_requests = 1_000_000
            stop = trio.Event()

            async def shutdown_trigger() -> None:
                await stop.wait()
                gateway.drain()

            served = trio.Event()

            async def run_server(
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                try:
                    await serve_http(
                        gateway.asgi,
                        config,
                        budget,
                        shutdown_trigger=shutdown_trigger,
                        task_status=task_status,
                    )
                finally:
                    served.set()

            async with trio.open_nursery() as nursery:
                if handle_signals:
                    nursery.start_soon(_on_sigterm, stop)
                try:
                    binds: list[str] = await nursery.start(run_server)
                except (OSError, BaseExceptionGroup) as exc:
                    raise _cannot_listen(exc, host, port) from None
                channel = ""
                channel_done = trio.Event()
                if channel_port is None and channel_path is None:
                    channel_done.set()
                else:
                    channel = await nursery.start(
                        _run_channel,
                        gateway,
                        host,
                        channel_port,
                        channel_path,
                        keyring,
                        limits,
                        stop,
                        graceful_timeout,
                        channel_done,
                        budget,
                    )
                server = GatewayServer(binds[0], gateway, stop, channel, budget)
                log.info("interlock gateway listening on %s", server.url)
                task_status.started(server)
                # hypercorn (and the channel) return once the requests in flight are
                # answered; then no request can add work, and the journal gets everything
                # decided so far.
                await served.wait()
                await channel_done.wait()
                await _flush(supervisor)
                nursery.cancel_scope.cancel()
            # NOTE: leaving open_supervisor would wait for every hosted run to end; a
            # drain stops them instead (their journals are whole; they resume next time).
            supervisor.cancel_actors()
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


async def _run_channel(
    gateway: GatewayApp,
    host: str,
    port: int | None,
    path: str | None,
    keyring: KeyRing,
    limits: Limits | None,
    stop: trio.Event,
    graceful_timeout: float,
    done: trio.Event,
    budget: ConnectionBudget,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    from ._channel import serve_channel

    limits = Limits.from_env() if limits is None else limits
    # NOTE: the per-key request rate is HTTP's: counted per frame it would cap the channel,
    # whose point is throughput, at the HTTP rate (1,000 frames/s by default). The channel
    # bounds each connection by its requests in flight instead (back-pressure).
    try:
        await serve_channel(
            gateway.service,
            host=host,
            port=port or 0,
            path=path,
            keyring=keyring,
            max_frame=limits.max_body,
            shutdown_trigger=stop.wait,
            graceful_timeout=graceful_timeout,
            connections=budget,
            first_frame_timeout=limits.idle_timeout,
            task_status=task_status,
        )
    finally:
        done.set()


def _cannot_listen(exc: BaseException, host: str, port: int) -> BaseException:
    """The error for a server that failed to start: one line when it could not bind."""
    found = exc
    while isinstance(found, BaseExceptionGroup) and len(found.exceptions) == 1:
        found = found.exceptions[0]
    if not isinstance(found, OSError):
        return exc
    return OSError(
        found.errno,
        f"cannot listen on {host} port {port}: {found.strerror or found}; choose another port "
        "(0 picks a free one)",
    )


async def _on_sigterm(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            log.info("SIGTERM: draining")
            stop.set()
            return


async def _flush(supervisor: Supervisor) -> None:
    """Wait until everything decided so far is in the journal."""
    live = next(iter(supervisor.external), None)
    # A Sync is answered after the batch that holds it is written, and that batch also
    # writes every event decided before it; an unknown run id is refused, but only after
    # that write.
    with contextlib.suppress(InterlockError, trio.ClosedResourceError):
        await supervisor.request(Sync(run_id=live or "interlock:drain"))


def _application(value: App | Machine | Sequence[Machine] | str) -> App:
    if isinstance(value, App):
        return value
    if isinstance(value, str):
        return load_app(value)
    if isinstance(value, Machine):
        return App(value)
    return App(list(value))
