"""The API's requests as :class:`Call` values, built once for both clients."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ..core._events import TokenUsage
from ..protocol import (
    AbortIn,
    EscalationOut,
    EscalationPage,
    EventPage,
    HealthOut,
    ProposalIn,
    ReadyOut,
    ResultIn,
    ResumeIn,
    RunCreate,
    RunOut,
    RunPage,
    Usage,
    VerdictOut,
    VerifyIn,
    VerifyItem,
    VerifyOut,
)
from ._common import Call, Mode, check_items, escalation_path, run_path

UsageLike = Usage | TokenUsage | Mapping[str, int]
"""Token counts: a :class:`Usage`, the runtime's ``TokenUsage``, or a mapping with the
keys ``prompt``, ``completion``, ``cached`` and ``reasoning``."""


def new_run_id() -> str:
    """A run id made by the client, so that creating a run is safe to retry."""
    return f"run-{uuid.uuid4().hex}"


def usage_of(usage: UsageLike | None) -> Usage | None:
    """``usage`` as the API's :class:`Usage`."""
    if usage is None or isinstance(usage, Usage):
        return usage
    if isinstance(usage, TokenUsage):
        return Usage(
            prompt=usage.prompt,
            completion=usage.completion,
            cached=usage.cached,
            reasoning=usage.reasoning,
        )
    try:
        return msgspec.convert(dict(usage), Usage)
    except (TypeError, ValueError, msgspec.ValidationError) as exc:
        raise ValueError(
            f"usage must be a Usage, a TokenUsage or a mapping of prompt, completion, "
            f"cached and reasoning to counts >= 0; got {usage!r} ({exc})"
        ) from None


def create_run(
    machine: str, inputs: Mapping[str, Any] | None, run_id: str | None, mode: Mode
) -> Call[RunOut]:
    if mode not in ("external", "hosted"):
        raise ValueError(f"mode must be 'external' or 'hosted', got {mode!r}")
    body = RunCreate(
        machine=machine, inputs=dict(inputs or {}), run_id=run_id or new_run_id(), mode=mode
    )
    # NOTE: the run id is always set, so a resend after a dropped connection finds the
    # run the first attempt created instead of starting a second one.
    return Call("POST", "/v1/runs", RunOut, body)


def get_run(run_id: str) -> Call[RunOut]:
    return Call("GET", run_path(run_id), RunOut)


def list_runs(
    state: str | None,
    machine: str | None,
    outcome: str | None,
    limit: int | None,
    cursor: str | None,
) -> Call[RunPage]:
    params = {
        name: str(value)
        for name, value in (
            ("state", state),
            ("machine", machine),
            ("outcome", outcome),
            ("limit", limit),
        )
        if value is not None
    }
    if cursor is not None:
        params["cursor"] = cursor
    return Call("GET", "/v1/runs", RunPage, params=params)


def events(run_id: str, after: int) -> Call[EventPage]:
    if after < 0:
        raise ValueError(f"after must be a seq >= 0, got {after}")
    return Call("GET", run_path(run_id, "events"), EventPage, params={"after": str(after)})


def propose(
    run_id: str,
    proposal: str,
    usage: UsageLike | None,
    expected_seq: int | None,
    model: str,
) -> Call[VerdictOut]:
    if not isinstance(proposal, str):
        raise TypeError(
            f"proposal must be the model's raw text (str), got {type(proposal).__name__}; "
            'send it as the model produced it, e.g. \'{"tool": "lookup", "args": {}}\''
        )
    body = ProposalIn(
        proposal=proposal, usage=usage_of(usage), expected_seq=expected_seq, model=model
    )
    return Call(
        "POST",
        run_path(run_id, "proposals"),
        VerdictOut,
        body,
        replayable=expected_seq is not None,
    )


def report(
    run_id: str,
    key: str,
    *,
    result: Any = None,
    error: str | None = None,
    retryable: bool = False,
    applied: bool | None = None,
    attempts: int = 1,
    latency: float = 0.0,
) -> Call[VerdictOut]:
    body = ResultIn(
        key=key,
        result=result,
        error=error,
        retryable=retryable,
        applied=applied,
        attempts=attempts,
        latency=latency,
    )
    # the key identifies the result: the server answers a resend with the recorded verdict
    return Call("POST", run_path(run_id, "results"), VerdictOut, body)


def verify(items: Iterable[VerifyItem | Mapping[str, Any]]) -> Call[VerifyOut]:
    batch = [
        item
        if isinstance(item, VerifyItem)
        else VerifyItem(
            run_id=item["run_id"],
            proposal=item["proposal"],
            usage=usage_of(item.get("usage")),
            expected_seq=item.get("expected_seq"),
            model=item.get("model", ""),
        )
        for item in check_items(items)
    ]
    return Call(
        "POST",
        "/v1/verify",
        VerifyOut,
        VerifyIn(items=batch),
        replayable=all(item.expected_seq is not None for item in batch),
    )


def escalations() -> Call[EscalationPage]:
    return Call("GET", "/v1/escalations", EscalationPage)


def escalation(run_id: str) -> Call[EscalationOut]:
    return Call("GET", escalation_path(run_id), EscalationOut)


def resume(run_id: str, by: str, note: str, payload: str | None, to: str | None) -> Call[RunOut]:
    if payload is not None and to is not None:
        raise ValueError("give payload or to, not both")
    body = ResumeIn(by=by, note=note, payload=payload, to=to)
    # the gateway answers a repeat of the resume done (the same to and payload) with the
    # run, and the other action or another resume with a 409 (interlock.core._escalation)
    return Call("POST", escalation_path(run_id, "resume"), RunOut, body)


def abort(run_id: str, by: str, note: str) -> Call[RunOut]:
    # the gateway answers a repeat of the abort with the failed run, an abort after a
    # resume with a 409
    return Call("POST", escalation_path(run_id, "abort"), RunOut, AbortIn(by=by, note=note))


def health() -> Call[HealthOut]:
    return Call("GET", "/healthz", HealthOut)


def ready() -> Call[ReadyOut]:
    return Call("GET", "/readyz", ReadyOut)
