"""What the async and the sync client share: requests as data, encoding, problems, retries, SSE.

Each public method of a client builds a :class:`Call` here (the method, the path, the body
Struct, the type to decode the answer into, and whether resending it is safe); the two
clients only differ in how they send it.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar
from urllib.parse import quote, unquote

import msgspec

from .._version import __version__
from ..core._exceptions import InterlockError, RunNotFound
from ..core._pacing import backoff_delay, parse_retry_after
from ..protocol import PROBLEM_ERRORS, EventOut, ViolationOut

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ..core._sse import SseEvent

T = TypeVar("T")
P = TypeVar("P", bound=InterlockError)

_RNG = random.Random()

JSON = "application/json"
MSGPACK = "application/msgpack"
PROBLEM = "application/problem+json"

Format = Literal["json", "msgpack"]
Mode = Literal["external", "hosted"]

TERMINAL_OUTCOMES = frozenset({"completed", "escalated", "failed"})
"""A run with one of these outcomes waits for nothing but an operator."""

TERMINAL_KINDS = frozenset({"completed", "escalated", "failed"})
"""Journal events after which a run is terminal (until an operator resumes it)."""

ENDING_KINDS = frozenset({"completed", "failed"})
"""Journal events after which a run's stream ends: nothing can follow them."""


class GatewayProblem(InterlockError):
    """The gateway answered a request with a problem (``application/problem+json``).

    A problem whose type names an interlock exception (see
    :data:`interlock.protocol.PROBLEM_ERRORS`) is raised as that exception too: a stale
    proposal's problem is a :class:`GatewayProblem` and a
    :class:`~interlock.errors.StaleSeq`, so ``except StaleSeq`` catches it as it would
    from a supervisor in the same process.

    Attributes:
      status: the HTTP status (400, 401, 403, 404, 409, 413, 422, 429, 503, ...).
      title: the problem's short title.
      detail: what was wrong and how to fix it, in the server's words.
      type: the problem's type URI (``about:blank`` when the server gave none).
      violations: for a rejected payload, each ``ViolationOut(code, path, message, hint)``.
      retry_after: seconds the server asked to wait before trying again (429, 503), or None.
      method: the request's method.
      path: the request's path.
    """

    def __init__(
        self,
        status: int,
        title: str,
        detail: str = "",
        *,
        type: str = "about:blank",
        violations: tuple[ViolationOut, ...] = (),
        retry_after: float | None = None,
        method: str = "",
        path: str = "",
    ) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        self.type = type
        self.violations = violations
        self.retry_after = retry_after
        self.method = method
        self.path = path
        # NOTE: not super().__init__: with a leaf mixed in (problem_class), the next class
        # would be the leaf, whose own __init__ (RunNotFound's) takes other arguments.
        Exception.__init__(self, self._text())

    def _text(self) -> str:
        where = f"{self.method} {self.path}: " if self.method else ""
        text = f"{where}{self.status} {self.title}"
        if self.detail and self.detail != self.title:
            text += f": {self.detail}"
        for v in self.violations:
            text += f"\n  {v.code} at {v.path}: {v.message}" + (f"; {v.hint}" if v.hint else "")
        if self.retry_after is not None:
            text += f" (retry after {self.retry_after:g} s)"
        return text


class GatewayUnavailable(InterlockError, ConnectionError):
    """No answer from the gateway after every attempt (refused, dropped or timed out).

    The cause (an ``httpx.TransportError``) is chained as ``__cause__``.

    Attributes:
      attempts: how many times the request was sent.
      method: the request's method.
      path: the request's path.
    """

    def __init__(self, method: str, path: str, attempts: int, reason: str) -> None:
        self.method = method
        self.path = path
        self.attempts = attempts
        super().__init__(
            f"{method} {path}: no answer from the gateway after {attempts} "
            f"attempt{'s' if attempts != 1 else ''}: {reason}"
        )


class _ProblemBody(msgspec.Struct, kw_only=True):
    """The members of an ``application/problem+json`` body that the client reads.

    NOTE: msgspec reads these annotations at run time, so ViolationOut is imported so.
    """

    type: str = "about:blank"
    title: str = ""
    status: int = 0
    detail: str = ""
    violations: tuple[ViolationOut, ...] = ()


class ClientRetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How a client resends a request that got no answer, or a 429/503 that asked to wait.

    Not :class:`interlock.RetryPolicy` (how a run retries a tool); the waits come from the
    same backoff (:func:`interlock.core._pacing.backoff_delay`, with jitter).

    Attributes:
      retries: resends after the first attempt (0 turns retrying off).
      base: seconds before the first resend; doubled each time, with jitter.
      cap: the longest wait between two attempts, in seconds (a longer ``Retry-After``
        is not waited for: the problem is raised).
    """

    retries: int = 3
    base: float = 0.1
    cap: float = 10.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.base < 0 or self.cap < 0:
            raise ValueError(
                f"retries, base and cap must be >= 0, got retries={self.retries}, "
                f"base={self.base}, cap={self.cap}"
            )

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before resend number ``attempt`` (1 for the first resend)."""
        return backoff_delay(attempt, None, _RNG, base=self.base, cap=self.cap, jitter=True)


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request of the API, ready to send, and how to read its answer."""

    method: str
    path: str
    type: type[T]
    body: Any = None
    params: Mapping[str, str] | None = None
    replayable: bool = True
    """Resending is safe even if the first attempt reached the server: a GET, or a
    mutating request the server recognises when it sees it again (a proposal with its
    ``expected_seq``, a result with its key)."""


def run_path(run_id: str, *rest: str) -> str:
    """``/v1/runs/{run_id}/...`` with the id escaped."""
    return "/".join(["/v1/runs", quote(run_id, safe=""), *rest])


def escalation_path(run_id: str, *rest: str) -> str:
    """``/v1/escalations/{run_id}/...`` with the id escaped."""
    return "/".join(["/v1/escalations", quote(run_id, safe=""), *rest])


class Codec:
    """Encodes request bodies and decodes answers in JSON or msgpack."""

    def __init__(self, format: Format) -> None:
        if format not in ("json", "msgpack"):
            raise ValueError(f"format must be 'json' or 'msgpack', got {format!r}")
        self.format = format
        self.content_type = JSON if format == "json" else MSGPACK
        self._json = msgspec.json.Encoder()
        self._msgpack = msgspec.msgpack.Encoder()

    def encode(self, body: Any) -> bytes:
        """The request body in this codec's format."""
        return self._json.encode(body) if self.format == "json" else self._msgpack.encode(body)

    @staticmethod
    def decode(content: bytes, content_type: str, type: type[T]) -> T:
        """Decode an answer into ``type`` by the content type the server gave."""
        if content_type.split(";", 1)[0].strip().lower() == MSGPACK:
            return msgspec.msgpack.decode(content, type=type)
        return msgspec.json.decode(content, type=type)


def base_headers(api_key: str | None, codec: Codec) -> dict[str, str]:
    """Headers sent with every request."""
    headers = {
        "Accept": f"{codec.content_type}, {PROBLEM}",
        "User-Agent": f"interlock-client/{__version__}",
    }
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def api_key_from(api_key: str | None) -> str | None:
    """The key given, else ``INTERLOCK_API_KEY``, else None (a gateway open on loopback)."""
    if api_key is None:
        api_key = os.environ.get("INTERLOCK_API_KEY") or None
    if api_key is not None and (not api_key.strip() or any(c in api_key for c in "\r\n")):
        raise ValueError("api_key must be a non-empty token with no line breaks")
    return api_key


def check_base_url(base_url: str) -> str:
    """``base_url`` without a trailing slash; refuses anything that is not http(s)://host."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(
            f"base_url must start with http:// or https://, got {base_url!r}; "
            "e.g. 'http://127.0.0.1:8080'"
        )
    return base_url.rstrip("/")


_LEAVES: dict[tuple[type, type], type] = {}


def problem_class(base: type[P], type_uri: str) -> type[P]:
    """``base``, or for a problem type that names an exception, a subclass of ``base``
    and of that exception (made once, and kept)."""
    leaf = PROBLEM_ERRORS.get(type_uri.rpartition("/")[2])
    if leaf is None:
        return base
    cls = _LEAVES.get((base, leaf))
    if cls is None:
        doc = f"A {base.__name__} that is a {leaf.__name__}: see both."
        cls = type(leaf.__name__, (base, leaf), {"__module__": base.__module__, "__doc__": doc})
        _LEAVES[base, leaf] = cls
    return cls  # type: ignore[return-value]


def _run_id(path: str) -> str | None:
    parts = path.split("/")
    if len(parts) >= 4 and parts[1] == "v1" and parts[2] in ("runs", "escalations"):
        return unquote(parts[3])
    return None


def problem_from(
    call: Call[Any], status: int, headers: Mapping[str, str], content: bytes, reason: str = ""
) -> GatewayProblem:
    """The :class:`GatewayProblem` for a non-2xx answer, whatever its body holds; one
    that is also the exception its type names, where it names one."""
    retry_after = parse_retry_after(headers, time.time())
    try:
        body = Codec.decode(content, headers.get("content-type", ""), _ProblemBody)
    except (msgspec.DecodeError, msgspec.ValidationError):
        # not a problem document (a proxy's page, say): show what came back
        text = content.decode("utf-8", "replace").strip()
        detail = text if len(text) <= 300 else text[:297] + "..."
        return GatewayProblem(
            status,
            reason or "error",
            detail,
            retry_after=retry_after,
            method=call.method,
            path=call.path,
        )
    problem = problem_class(GatewayProblem, body.type)(
        status or body.status,
        body.title or reason or "error",
        body.detail,
        type=body.type,
        violations=body.violations,
        retry_after=retry_after,
        method=call.method,
        path=call.path,
    )
    if isinstance(problem, RunNotFound):
        problem.run_id = _run_id(call.path) or ""
    return problem


def read_answer(
    call: Call[T], status: int, headers: Mapping[str, str], content: bytes, reason: str = ""
) -> T:
    """Decode a 2xx answer into ``call.type``, or raise the problem.

    Raises:
      GatewayProblem: for a non-2xx status, or a 2xx body that is not the expected type.
    """
    if not 200 <= status < 300:
        raise problem_from(call, status, headers, content, reason)
    try:
        return Codec.decode(content, headers.get("content-type", ""), call.type)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise GatewayProblem(
            status,
            "unreadable answer",
            f"the answer is not a {getattr(call.type, '__name__', call.type)}: {exc}; "
            "is base_url an interlock gateway of the same version?",
            method=call.method,
            path=call.path,
        ) from exc


def retry_wait(policy: ClientRetryPolicy, attempt: int, problem: GatewayProblem) -> float | None:
    """Seconds to wait before resending after a 429 or 503, or None to raise it.

    Both mean the server refused the request before acting on it, so resending is
    safe for every request.
    """
    if problem.status not in (429, 503) or attempt > policy.retries:
        return None
    wait = problem.retry_after if problem.retry_after is not None else policy.backoff(attempt)
    return wait if wait <= policy.cap else None


def stream_event(call: Call[Any], frame: SseEvent) -> EventOut:
    """The journal event one SSE frame carries.

    Raises:
      GatewayProblem: the frame is a ``problem`` (the gateway ended the stream on an
        error), or its data is not an event.
    """
    content = frame.data.encode()
    if frame.event == "problem":
        raise problem_from(call, 0, {"content-type": PROBLEM}, content, "stream failed")
    try:
        return msgspec.json.decode(content, type=EventOut)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise GatewayProblem(
            200,
            "unreadable event",
            f"a stream frame is not a journal event: {exc}",
            method=call.method,
            path=call.path,
        ) from exc


def check_items(items: Iterable[Any]) -> list[Any]:
    """The items of a batch as a list; refuses an empty one."""
    items = list(items)
    if not items:
        raise ValueError("verify() needs at least one item")
    return items
