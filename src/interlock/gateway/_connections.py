"""The gateway's connections: a budget of descriptors, and hypercorn's trio worker without
its pinned sockets.

Every connection costs the process a file descriptor until it is closed. Two things kept
them too long:

- hypercorn 0.18's trio worker (``hypercorn.trio.run.worker_serve``) keeps a connection's
  socket open until the connection's idle timer ends, even after the client has closed it:
  its connection task waits for the timer task before it closes the socket. So every
  connection, a bare connect included, held a descriptor for the whole
  ``keep_alive_timeout``. :func:`serve_http` serves with a connection that stops its idle
  timer once the client has gone.
- nothing bounded how many connections were held at once: past the process's
  ``RLIMIT_NOFILE``, accept fails (trio sleeps and retries) and the server answers no one
  until idle connections time out. :class:`ConnectionBudget` holds at most ``limit``
  connections (HTTP and the channel together, under the descriptor limit with room for the
  journal); when it is full, the connection idle for longest is closed to make room, and
  when none is idle, new connections wait in the listen backlog.
"""

from __future__ import annotations

import logging
import resource
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["DESCRIPTOR_RESERVE", "BudgetListener", "ConnectionBudget", "serve_http"]

log = logging.getLogger("interlock.gateway")

#: Descriptors kept for everything but connections: the journal, its WAL, the listeners,
#: logs, threads' pipes.
DESCRIPTOR_RESERVE = 64


class ConnectionBudget:
    """At most ``limit`` connections open at once; the longest idle gives way to a new one.

    A connection calls :meth:`idle` with a function that closes it when it has nothing in
    flight (an HTTP connection between requests, a channel connection before its first
    frame) and :meth:`busy` when it has; :meth:`release` when it is closed.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a connection budget needs a limit of at least 1, got {limit}")
        self.limit = limit
        #: connections open now, and the place each listener waiting to accept has taken
        self.open = 0
        #: connections closed to make room for new ones
        self.reaped = 0
        self._idle: dict[object, Callable[[], None]] = {}  # oldest first
        self._freed = trio.Event()

    @classmethod
    def within_descriptors(cls, limit: int) -> ConnectionBudget:
        """A budget of ``limit``, lowered to fit this process's ``RLIMIT_NOFILE``."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and limit > soft - DESCRIPTOR_RESERVE:
            fitted = max(1, soft - DESCRIPTOR_RESERVE)
            log.warning(
                "max_connections %d does not fit this process's limit of %d open files; "
                "holding at most %d connections (raise the limit with ulimit -n)",
                limit,
                soft,
                fitted,
            )
            limit = fitted
        return cls(limit)

    async def acquire(self) -> None:
        """Take a connection's place, closing the longest idle one if there is none."""
        while self.open >= self.limit:
            if self._idle:
                connection = next(iter(self._idle))
                self._idle.pop(connection)()
                self.reaped += 1
            if self._freed.is_set():
                self._freed = trio.Event()
            await self._freed.wait()
        self.open += 1

    def release(self, connection: object) -> None:
        """A connection's place is free: it is closed."""
        self._idle.pop(connection, None)
        self.open -= 1
        self._freed.set()

    def idle(self, connection: object, close: Callable[[], None]) -> None:
        """``connection`` has nothing in flight: ``close()`` may close it to make room."""
        self._idle[connection] = close

    def busy(self, connection: object) -> None:
        """``connection`` has work in flight: it must not be closed to make room."""
        self._idle.pop(connection, None)


class BudgetListener(trio.abc.Listener[trio.SocketStream]):
    """A listener that accepts only while the budget has room (or makes some)."""

    def __init__(self, listener: trio.SocketListener, budget: ConnectionBudget) -> None:
        self.listener = listener
        self.budget = budget

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.listener.socket

    async def accept(self) -> trio.SocketStream:
        await self.budget.acquire()
        try:
            return await self.listener.accept()
        except BaseException:
            self.budget.release(self)
            raise

    async def aclose(self) -> None:
        await self.listener.aclose()


def _server_class() -> type:
    from hypercorn.events import Updated
    from hypercorn.trio.tcp_server import TCPServer

    class _TCPServer(TCPServer):
        """hypercorn's connection, which closes once the client has gone and gives way to
        new connections while idle."""

        def __init__(self, budget: ConnectionBudget, *args: Any) -> None:
            super().__init__(*args)
            self._budget = budget
            self._ended = False  # the client closed its end, or reading failed
            self._waiting: trio.CancelScope | None = None

        async def run(self) -> None:
            try:
                await super().run()
            finally:
                self._budget.release(self)

        async def protocol_send(self, event: Any) -> None:
            if isinstance(event, Updated) and not event.idle:
                self._budget.busy(self)
            await super().protocol_send(event)

        async def _read_data(self) -> None:
            await super()._read_data()
            # NOTE: hypercorn closes the socket only after this connection's tasks end, its
            # idle timer among them; nothing more can come, so end the timer now.
            self._ended = True
            if self._waiting is not None:
                self._waiting.cancel()

        async def _idle_timeout(self) -> None:
            if not self._ended:
                with trio.move_on_after(self.config.keep_alive_timeout) as self._waiting:
                    self._budget.idle(self, self._waiting.cancel)
                    try:
                        await self.context.terminated.wait()
                    finally:
                        self._budget.busy(self)
                        self._waiting = None
            with trio.CancelScope(shield=True):
                await self._initiate_server_close()

    return _TCPServer


async def serve_http(
    app: Any,
    config: Any,
    budget: ConnectionBudget,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app as ``hypercorn.trio.serve`` does (plain TCP, HTTP/1.1 and h2c),
    with :class:`ConnectionBudget` and connections that let go of closed sockets.

    The same steps as hypercorn 0.18's ``worker_serve``: the lifespan, the listeners, a
    graceful stop when ``shutdown_trigger`` returns.
    """
    from hypercorn.trio.lifespan import Lifespan
    from hypercorn.trio.statsd import StatsdLogger
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

    tcp_server = _server_class()
    app = wrap_app(app, config.wsgi_max_body_size, None)
    config.set_statsd_logger_class(StatsdLogger)
    state: dict[str, Any] = {}
    lifespan = Lifespan(app, config, state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            if sockets.secure_sockets or sockets.quic_sockets:  # pragma: no cover
                raise ValueError("serve_http serves plain TCP; configure no certificate")
            listeners = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                listeners.append(BudgetListener(listener, budget))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            task_status.started(binds)
            handler = partial(tcp_server, budget, app, config, context, ConnectionState(state))
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners,
                            handler,
                            listeners,
                            handler_nursery=server_nursery,
                        )
                    )
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, others = error.split((ShutdownError, KeyboardInterrupt))
                if others is not None:
                    raise others from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
