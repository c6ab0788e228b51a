"""``interlock proxy``: the model proxy served over HTTP (hypercorn on trio)."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import trio

from ..providers._http import Transport
from ..runtime._operators import serve_operator_requests
from ..runtime._runtime import open_supervisor
from ..stores import SQLiteStore
from ._apis import API_PATHS, ChatApi
from ._litellm import GUARDRAIL_PATH, guardrail
from ._proxy import DEFAULT_REASKS, Answer, ModelProxy, _error

if TYPE_CHECKING:
    from ..core._machine import Machine
    from ..runtime._tracing import Tracing
    from ..stores import Store

__all__ = ["ModelProxyServer", "serve_model_proxy"]

log = logging.getLogger("interlock.proxy")

#: Seconds a run no request used stays in memory (its journal stays whole).
DEFAULT_IDLE = 600.0

#: The largest request body served (a larger one is answered 413).
DEFAULT_MAX_BODY = 8 * 1024 * 1024


class ModelProxyServer:
    """A model proxy being served (what :func:`serve_model_proxy` hands ``task_status``)."""

    def __init__(self, url: str, stop: trio.Event, proxy: ModelProxy) -> None:
        self.proxy = proxy
        """The proxy's steps (its supervisor, the runs it holds)."""
        self.url = url
        """The base URL an OpenAI SDK application is given (``http://HOST:PORT/v1``)."""
        self.anthropic_url = url.removesuffix("/v1")
        """The base URL an Anthropic SDK application is given (``http://HOST:PORT``)."""
        self._stop = stop

    def stop(self) -> None:
        self._stop.set()


_PATHS = (*API_PATHS, GUARDRAIL_PATH)


def _app(proxy: ModelProxy, max_body: int) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        api = proxy.apis.get(path, proxy.apis[ChatApi.path])
        if path not in _PATHS:
            answer = _error(
                api, 404, f"no {path} here: POST one of {', '.join(_PATHS)}", "not_found"
            )
        elif scope["method"] != "POST":
            answer = _error(api, 405, f"POST {path}", "method_not_allowed")
        else:
            chunks: list[bytes] = []
            size = 0
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = bool(message.get("more_body"))
                if size > max_body:
                    break
            if size > max_body:
                answer = _error(
                    api, 413, f"the body is over {max_body} bytes", "invalid_request_error"
                )
            else:
                headers = {
                    k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
                }
                try:
                    if path == GUARDRAIL_PATH:
                        status, body = await guardrail(proxy, b"".join(chunks))
                        answer = Answer(status, body)
                    else:
                        answer = await proxy.handle(path, b"".join(chunks), headers)
                except Exception as exc:  # a bug: contained to this request, and said so
                    log.exception("interlock proxy: a bug answering a request")
                    answer = _error(api, 500, f"a bug in interlock: {exc!r}", "internal_error")
        extra = [(k.encode(), v.encode()) for k, v in answer.headers]
        body, kind = answer.body, b"application/json"
        if answer.events is not None:
            # the decided answer is whole: its events go in one write (a client reading
            # them sees the API's stream, and is not left a tail to drain after the last)
            body, kind = b"".join(answer.events), b"text/event-stream"
            extra.append((b"cache-control", b"no-cache"))
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [
                    (b"content-type", kind),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


async def serve_model_proxy(
    machine: Machine,
    upstream: str,
    store: Store,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    profile: str | None = None,
    reasks: int = DEFAULT_REASKS,
    max_body: int = DEFAULT_MAX_BODY,
    inputs: dict[str, Any] | None = None,
    idle: float = DEFAULT_IDLE,
    handle_signals: bool = False,
    tracing: Tracing | None = None,
    task_status: trio.TaskStatus[ModelProxyServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``POST /v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` (and
    LiteLLM's guardrail, ``POST /beta/litellm_basic_guardrail_api``) at
    ``http://HOST:PORT/v1`` in front of the API at ``upstream`` (its base URL, e.g.
    ``http://127.0.0.1:8000/v1``; an Anthropic one's, without ``/v1``, takes
    ``/v1/messages``),
    each request a step of a run of ``machine``, until stopped (:meth:`ModelProxyServer.stop`,
    or SIGTERM or SIGINT with ``handle_signals``: the requests in flight are answered
    first). A run no request used for ``idle`` seconds is dropped from memory (the
    journal keeps it; its next request reads it again). With ``tracing`` (OpenTelemetry,
    ``interlock[otel]``) each run is traced, continuing a ``traceparent`` header of the
    request that starts it, and each upstream request carries the run's."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    transport = Transport(upstream, timeout=600.0)
    async with open_supervisor([machine], store, tracing=tracing) as supervisor, transport:
        proxy = ModelProxy(
            supervisor, machine, transport, reasks=reasks, profile=profile, inputs=inputs
        )
        config = Config()
        config.bind = [f"{host}:{port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        stop = trio.Event()
        served = trio.Event()

        async def run_server(
            task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            try:
                await serve(
                    _app(proxy, max_body),
                    config,
                    shutdown_trigger=stop.wait,
                    task_status=task_status,
                )
            finally:
                served.set()

        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_on_signals, stop)
            nursery.start_soon(proxy.forget_idle, idle)
            if isinstance(store, SQLiteStore):  # operators resume runs through its inbox
                nursery.start_soon(serve_operator_requests, supervisor, store.path)
            binds: list[str] = await nursery.start(run_server)
            url = binds[0] + "/v1"
            print(
                f"interlock proxy: serving {url} (machine {machine.name!r}, upstream {upstream})",
                file=sys.stderr,
                flush=True,
            )
            task_status.started(ModelProxyServer(url, stop, proxy))
            await served.wait()  # the requests in flight answered
            nursery.cancel_scope.cancel()


async def _on_signals(stop: trio.Event) -> None:
    import signal

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()
            return
