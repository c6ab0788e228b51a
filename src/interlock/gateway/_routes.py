"""The gateway's route table: every route once, read by the router, the guard and the
OpenAPI document.

A :class:`Route` says what the app serves (method, path pattern, the :class:`GatewayApp`
method that answers it), what the guard enforces (the role, the limits class) and what
``GET /openapi.json`` documents (summary, request and response Structs of
:mod:`interlock.protocol`, status, query parameters). The app fails at import if a route
names a handler it lacks; the guard compiles the same table; the document is generated from
it, so a route cannot be served unguarded or undocumented.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from .._version import __version__
from ..protocol import (
    AbortIn,
    EscalationOut,
    EscalationPage,
    EventPage,
    HealthOut,
    Problem,
    ProposalIn,
    ReadyOut,
    ResultIn,
    ResumeIn,
    RunCreate,
    RunOut,
    RunPage,
    VerdictOut,
    VerifyIn,
    VerifyOut,
)
from ._keys import ROLES

__all__ = ["PAGES", "ROUTES", "WEBSOCKET", "Pages", "Query", "Route", "openapi_document"]

#: The method under which WebSocket routes appear in the route table.
WEBSOCKET: Final = "WEBSOCKET"

JSON: Final = "application/json"
MSGPACK: Final = "application/msgpack"
PROBLEM_JSON: Final = "application/problem+json"


@dataclass(frozen=True, slots=True)
class Query:
    """A query parameter of a route, as documented (the handler reads and checks it)."""

    name: str
    kind: Literal["string", "integer"]
    description: str
    minimum: int | None = None
    maximum: int | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """One route of the gateway.

    Attributes:
      method: ``GET``, ``POST``, ... or :data:`WEBSOCKET`; ``HEAD`` is served by ``GET``.
      path: the path pattern; a variable segment is named in braces (``/v1/runs/{id}``).
      role: the role a key needs (``agent``, ``reader``, ``operator``); ``None``: public.
      summary: one line for the OpenAPI document.
      handler: the :class:`GatewayApp` method that answers it; ``""`` for a route another
        app serves (the WebSocket channel).
      body: the request body's Struct, or None for no body.
      out: the answer's Struct (JSON or msgpack), or None when :attr:`produces` says what.
      produces: the media type of an answer that is not a Struct.
      status: the success status.
      retry_status: the status of an answer to a retry of a request that already took
        effect (documented with the same body), or None.
      query: the query parameters.
      limits: ``"request"``: the request timeout applies; ``"stream"``: the route stays
        open as long as the client wants (SSE, the channel), no timeout.
    """

    method: str
    path: str
    role: str | None
    summary: str
    handler: str = ""
    body: type[msgspec.Struct] | None = None
    out: type[msgspec.Struct] | None = None
    produces: str | None = None
    status: int = 200
    retry_status: int | None = None
    query: tuple[Query, ...] = ()
    limits: Literal["request", "stream"] = "request"

    def __post_init__(self) -> None:
        if not self.method or self.method != self.method.upper():
            raise ValueError(f"route {self.method} {self.path}: the method must be upper case")
        if not self.path.startswith("/"):
            raise ValueError(f"route {self.method} {self.path}: the path must start with '/'")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(
                f"route {self.method} {self.path}: role {self.role!r} is not one of "
                f"{', '.join(sorted(ROLES))} (or None for a public route)"
            )
        if self.limits not in ("request", "stream"):
            raise ValueError(
                f"route {self.method} {self.path}: limits must be 'request' or 'stream', "
                f"got {self.limits!r}"
            )

    @property
    def streaming(self) -> bool:
        """Whether the route is exempt from the request timeout."""
        return self.limits == "stream"

    @property
    def public(self) -> bool:
        """Whether the route needs no key."""
        return self.role is None


@dataclass(frozen=True, slots=True)
class Pages:
    """A tree of HTML pages under ``prefix``, served by an app of their own that signs its
    users in itself (a key in a cookie or the bearer header) and checks a token in each of
    its forms: the guard lets every request under ``prefix`` reach it without a key and
    takes its forms' content types; a path ending in ``stream_suffix`` is a live stream (no
    request timeout). Not in the OpenAPI document: pages are not the API.

    Attributes:
      prefix: the path the pages are under (``/console``: ``/console`` and ``/console/...``).
      summary: what they are, one line.
      stream_suffix: the ending of a path that streams (server-sent events).
    """

    prefix: str
    summary: str
    stream_suffix: str = "/live"

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ValueError(
                f"pages {self.prefix!r}: the prefix must start with '/' and not end with one"
            )

    def holds(self, path: str) -> bool:
        """Whether ``path`` is one of these pages."""
        return path == self.prefix or path.startswith(self.prefix + "/")


#: The page trees of the gateway: the operator console.
PAGES: Final[tuple[Pages, ...]] = (
    Pages("/console", "the operator console (gateway._console): runs, the queue, live pages"),
)


_LIMIT_RUNS = Query("limit", "integer", "runs per page (1-1000)", minimum=1, maximum=1000)

#: Every route of the gateway, in the order the OpenAPI document lists them.
ROUTES: Final[tuple[Route, ...]] = (
    Route(
        "POST",
        "/v1/runs",
        "agent",
        "Start a run",
        "create_run",
        body=RunCreate,
        out=RunOut,
        status=201,
        retry_status=200,
    ),
    Route(
        "GET",
        "/v1/runs",
        "reader",
        "List runs, oldest first",
        "list_runs",
        out=RunPage,
        query=(
            Query("state", "string", "only runs in this state"),
            Query("machine", "string", "only runs of this machine"),
            Query("outcome", "string", "running, completed, escalated or failed"),
            _LIMIT_RUNS,
            Query("cursor", "string", "the cursor of the previous page"),
        ),
    ),
    Route("GET", "/v1/runs/{id}", "reader", "A run", "get_run", out=RunOut),
    Route(
        "GET",
        "/v1/runs/{id}/events",
        "reader",
        "A run's journal events after a seq",
        "events",
        out=EventPage,
        query=(
            Query("after", "integer", "the seq to read after", minimum=0),
            Query("limit", "integer", "events per page (1-10000)", minimum=1, maximum=10000),
        ),
    ),
    Route(
        "GET",
        "/v1/runs/{id}/stream",
        "reader",
        "Server-Sent Events: one per journal event, id = seq (Last-Event-ID resumes)",
        "stream",
        produces="text/event-stream",
        query=(Query("after", "integer", "the seq to stream after", minimum=0),),
        limits="stream",
    ),
    Route(
        "POST",
        "/v1/runs/{id}/proposals",
        "agent",
        "Verify a proposal",
        "propose",
        body=ProposalIn,
        out=VerdictOut,
    ),
    Route(
        "POST",
        "/v1/runs/{id}/results",
        "agent",
        "Report a call's outcome",
        "report",
        body=ResultIn,
        out=VerdictOut,
    ),
    Route(
        "POST",
        "/v1/verify",
        "agent",
        "Verify a batch of proposals",
        "verify",
        body=VerifyIn,
        out=VerifyOut,
    ),
    Route(
        "GET",
        "/v1/escalations",
        "operator",
        "The escalation queue",
        "escalations",
        out=EscalationPage,
    ),
    Route(
        "GET",
        "/v1/escalations/{id}",
        "operator",
        "An escalated run",
        "escalation",
        out=EscalationOut,
    ),
    Route(
        "POST",
        "/v1/escalations/{id}/resume",
        "operator",
        "Resume an escalated run",
        "resume",
        body=ResumeIn,
        out=RunOut,
    ),
    Route(
        "POST",
        "/v1/escalations/{id}/abort",
        "operator",
        "Abort an escalated run",
        "abort",
        body=AbortIn,
        out=RunOut,
    ),
    Route("GET", "/healthz", None, "The process is up", "healthz", out=HealthOut),
    Route(
        "GET",
        "/readyz",
        None,
        "The store answers, the journal can be written and keeps up",
        "readyz",
        out=ReadyOut,
    ),
    Route("GET", "/metrics", "reader", "Prometheus metrics", "metrics", produces="text/plain"),
    Route(
        "GET",
        "/openapi.json",
        None,
        "This document",
        "openapi",
        produces=JSON,
    ),
    Route(WEBSOCKET, "/v1/channel", "agent", "The streaming channel", limits="stream"),
)


# -- the OpenAPI document -----------------------------------------------------------------


def _path_parameter(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1},
    }


def _parameter(query: Query) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": query.kind}
    if query.minimum is not None:
        schema["minimum"] = query.minimum
    if query.maximum is not None:
        schema["maximum"] = query.maximum
    return {
        "name": query.name,
        "in": "query",
        "required": False,
        "description": query.description,
        "schema": schema,
    }


def openapi_document(routes: tuple[Route, ...] = ROUTES) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway, generated from its route table.

    Every HTTP route of ``routes`` is an operation (a WebSocket route has no place in
    OpenAPI); request and response schemas are those of the Structs of
    :mod:`interlock.protocol` the table names.
    """
    http = [r for r in routes if r.method != WEBSOCKET]
    kinds: list[type] = [Problem]
    for route in http:
        for kind in (route.body, route.out):
            if kind is not None and kind not in kinds:
                kinds.append(kind)
    refs, components = msgspec.json.schema_components(
        kinds, ref_template="#/components/schemas/{name}"
    )
    ref = dict(zip(kinds, refs, strict=True))
    problem = {PROBLEM_JSON: {"schema": ref[Problem]}}
    paths: dict[str, dict[str, Any]] = {}
    for route in http:
        if route.out is not None:
            content: dict[str, Any] = {
                JSON: {"schema": ref[route.out]},
                MSGPACK: {"schema": ref[route.out]},
            }
        else:
            kind = "object" if route.produces == JSON else "string"
            content = {route.produces or "text/plain": {"schema": {"type": kind}}}
        responses: dict[str, Any] = {
            str(route.status): {"description": route.summary, "content": content},
            "4XX": {
                "description": "a problem: what was wrong and how to fix it",
                "content": problem,
            },
        }
        if route.out is not None:
            responses["503"] = {
                "description": "the journal is behind or the gateway is stopping; retry",
                "content": problem,
            }
        if route.retry_status is not None:
            responses[str(route.retry_status)] = {
                "description": "the answer already given to this request (a retry)",
                "content": content,
            }
        operation: dict[str, Any] = {"summary": route.summary, "responses": responses}
        parameters = [_path_parameter(n) for n in re.findall(r"\{(\w+)\}", route.path)]
        parameters += [_parameter(q) for q in route.query]
        if parameters:
            operation["parameters"] = parameters
        if route.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {
                    JSON: {"schema": ref[route.body]},
                    MSGPACK: {"schema": ref[route.body]},
                },
            }
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "interlock gateway",
            "version": __version__,
            "description": "Verify an agent's proposals against its run's state machine, "
            "journal the intent before the effect, and commit the result.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }
