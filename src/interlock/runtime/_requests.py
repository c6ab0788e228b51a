"""What happened to a run, as the request that tells the decider: the one place it is built.

The actor builds its requests here from what it saw (a provider's answer or failure, a
tool's result or exception, what ``reconcile`` found); replay builds them here from what
the journal recorded of the same. So a recorded run is decided again from the very
requests a live run would send, and no second copy of how a request is made can drift.

No trio and no I/O: the caller measures latencies and names the run's seq and key.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from ..core._events import TokenUsage, Violation, journalable
from ..core._exceptions import ProviderError, RequestRefused
from ..core._messages import Propose, Reconciliation, Report
from ..core._pacing import parse_retry_after
from ..core._tools import Applied, NotApplied, ToolError
from ..providers._base import Proposal

if TYPE_CHECKING:
    from ..core._tools import Tool

_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504, 529})


# -- the model --------------------------------------------------------------------------


def answered(run_id: str, seq: int, model: str, answer: Any, latency: float) -> Propose:
    """The proposal for what a provider returned, whatever it returned.

    A provider may return anything; only a :class:`Proposal` whose fields have their
    types is a proposal. Anything else is journaled as a defect of that answer, and
    the gate rejects it as ``malformed`` naming the type; the run goes on.
    """
    if not isinstance(answer, Proposal):
        return Propose(
            run_id=run_id,
            seq=seq,
            raw="",
            model=model,
            latency=latency,
            defect=f"the provider returned {type(answer).__name__}, not a Proposal",
        )
    raw, usage = answer.raw, answer.usage
    defect = ""
    if type(raw) is not str:
        defect = f"the provider's Proposal.raw is {type(raw).__name__}, not str"
        raw = ""
    if not (
        type(usage) is TokenUsage
        and type(usage.prompt) is int
        and type(usage.completion) is int
        and usage.prompt >= 0
        and usage.completion >= 0
    ):
        # the type, or the values of a TokenUsage: a foreign object's repr may raise
        shown = repr(usage) if type(usage) is TokenUsage else type(usage).__name__
        defect = defect or (
            f"the provider's Proposal.usage is {shown}, not a TokenUsage of two non-negative ints"
        )
        usage = TokenUsage()
    name, prompt = answer.model, answer.prompt
    response, envelope, extra = answer.response, answer.envelope, answer.extra_calls
    return Propose(
        run_id=run_id,
        seq=seq,
        raw=raw,
        model=name if type(name) is str and name else model,
        prompt=prompt if type(prompt) is str else "",
        usage=usage,
        latency=latency,
        defect=defect,
        response=response if type(response) is str else None,
        envelope=envelope if type(envelope) is Violation else None,
        extra_calls=extra if type(extra) is tuple else (),
    )


def unanswered(
    run_id: str,
    seq: int,
    model: str,
    error: str,
    latency: float,
    *,
    retryable: bool = True,
    retry_after: float | None = None,
    refused: bool = False,
) -> Propose:
    """The proposal for a model call that gave no answer: the provider raised (see
    :func:`provider_failure`), or its timeout or the run's deadline cut the wait."""
    return Propose(
        run_id=run_id,
        seq=seq,
        raw="",
        model=model,
        error=error,
        retryable=retryable,
        retry_after=retry_after,
        refused=refused,
        latency=latency,
    )


def provider_failure(exc: BaseException) -> tuple[bool, float | None, bool]:
    """Whether retrying a provider that raised ``exc`` can help, its Retry-After, and
    whether the server refused the request's shape."""
    if isinstance(exc, ProviderError):
        return exc.retryable, exc.retry_after, isinstance(exc, RequestRefused)
    status, after = _http_status(exc)
    if status is not None:
        return status in _RETRYABLE_STATUS or status >= 500, after, False
    return True, None, False  # anything else a provider raises: a failure to answer, retried


# -- tools --------------------------------------------------------------------------------


def returned(
    run_id: str, seq: int, key: str, tool: str, result: Any, attempts: int, latency: float
) -> Report:
    """The report of a call whose attempt ``attempts`` returned ``result``.

    A result the journal cannot hold is a failure, not retried, and applied (the call
    ran): for a tool that is not safe to repeat the call is then in doubt.
    """
    payload, problem = journalable(result, "result")
    if problem is not None:
        return failed(
            run_id,
            seq,
            key,
            f"tool {tool!r} returned a result that cannot be journaled: {problem}",
            retryable=False,
            applied=True,
            attempts=attempts,
            latency=latency,
        )
    return Report(
        run_id=run_id,
        seq=seq,
        key=key,
        ok=True,
        result=payload,
        attempts=attempts,
        latency=latency,
    )


def failed(
    run_id: str,
    seq: int,
    key: str,
    error: str,
    *,
    retryable: bool,
    applied: bool | None,
    attempts: int,
    latency: float,
) -> Report:
    """The report of a call whose last attempt failed with ``error``.

    ``applied``: False when the failure says the call was certainly not applied (the
    failure goes back to the model); None (unknown) or True leave a call of a tool that
    is not safe to repeat in doubt, and the decider reconciles or escalates it.
    """
    return Report(
        run_id=run_id,
        seq=seq,
        key=key,
        ok=False,
        error=error,
        retryable=retryable,
        applied=applied,
        attempts=attempts,
        latency=latency,
    )


def tool_failure(exc: BaseException, tool: Tool) -> tuple[bool, float | None, bool | None]:
    """Whether a failed attempt is worth retrying, its Retry-After, and whether it was applied."""
    if isinstance(exc, ToolError):
        return exc.retryable, exc.retry_after, exc.applied
    applied: bool | None = False if isinstance(exc, tool.not_applied) else None
    status, after = _http_status(exc)
    if status is not None:
        return status in _RETRYABLE_STATUS, after, applied
    return _transport_error(exc), None, applied


def reconciled(
    run_id: str,
    seq: int,
    key: str,
    applied: bool | None,
    latency: float,
    result: Any = None,
    error: str = "",
) -> Reconciliation:
    """The reconciliation of the call in doubt with ``key``: applied (with its
    ``result``), not applied, or unknown (None; ``error`` says why)."""
    return Reconciliation(
        run_id=run_id,
        seq=seq,
        key=key,
        applied=applied,
        result=result,
        error=error,
        latency=latency,
    )


def reconcile_found(found: Any) -> tuple[bool | None, Any, str]:
    """What a tool's ``reconcile`` returned, read: applied, the result, and the error
    when it is neither ``Applied(result)`` with a result the journal holds nor ``NotApplied``."""
    if found is NotApplied or isinstance(found, NotApplied):
        return False, None, ""
    if isinstance(found, Applied):
        payload, problem = journalable(found.result, "result")
        if problem is None:
            return True, payload, ""
        return None, None, f"reconcile returned a result that cannot be journaled: {problem}"
    return (
        None,
        None,
        f"reconcile returned {type(found).__name__}, not Applied(result) or NotApplied",
    )


# -- helpers ------------------------------------------------------------------------------


def _transport_error(exc: BaseException) -> bool:
    """A dropped or refused connection, or a timeout: worth retrying for a safe tool."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    httpx = sys.modules.get("httpx")  # only if the tool uses it: never imported for this
    return httpx is not None and isinstance(exc, httpx.TransportError)


def _http_status(exc: BaseException) -> tuple[int | None, float | None]:
    """The HTTP status an exception carries (httpx's ``HTTPStatusError`` and the SDKs'
    errors hold a ``response``), and the Retry-After its headers give."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if not isinstance(status, int):
        return None, None
    return status, _retry_after_header(getattr(response, "headers", None))


def _retry_after_header(headers: Any) -> float | None:
    """Seconds from a ``retry-after-ms`` or ``Retry-After`` header, read as the providers'
    transport reads them; None for headers of a shape it cannot read."""
    try:
        return parse_retry_after(headers, time.time())
    except (TypeError, AttributeError):
        return None


__all__ = [
    "answered",
    "failed",
    "provider_failure",
    "reconcile_found",
    "reconciled",
    "returned",
    "tool_failure",
    "unanswered",
]
