"""LiteLLM's generic guardrail API (``POST /beta/litellm_basic_guardrail_api``): any LiteLLM
proxy calls interlock before a request goes to the model and after its answer comes back,
and interlock blocks a returned tool call that breaks the run's machine.

LiteLLM can block an answer but not rewrite it, so here, unlike the model proxy's own
endpoints, a call keeps the model's id (interlock keeps which key it stands for) and a
rejected call is blocked, not asked again: the application gets LiteLLM's error naming the
violation, and the gate's breakers count it.

The run: the ``interlock-run`` header of the application's request, which LiteLLM passes on
when the guardrail lists it in ``extra_headers``; the first request that names a run starts
it. A request without one is a run of its own (``litellm-<call id>``): its call is checked
against the machine's first state, with no state carried between requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ..core._events import TokenUsage
from ..core._exceptions import InterlockError
from ..core._messages import Report
from ..core._wire import judge_calls
from ._proxy import RUN_HEADER, RunRefused

if TYPE_CHECKING:
    from ._proxy import ModelProxy

__all__ = ["GUARDRAIL_PATH", "guardrail"]

#: Where LiteLLM's generic guardrail posts (its ``api_base`` plus this path).
GUARDRAIL_PATH = "/beta/litellm_basic_guardrail_api"

_NONE = msgspec.json.encode({"action": "NONE"})


def _blocked(reason: str) -> bytes:
    return msgspec.json.encode({"action": "BLOCKED", "blocked_reason": reason})


class _Problem(InterlockError):
    pass


async def guardrail(proxy: ModelProxy, body: bytes) -> tuple[int, bytes]:
    """Answer one guardrail request: ``(status, body)``."""
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return 400, _problem(f"the body is not JSON: {exc}")
    if not isinstance(request, dict) or request.get("input_type") not in ("request", "response"):
        return 400, _problem(
            "the body must be a LiteLLM generic guardrail request, with input_type "
            "'request' or 'response'"
        )
    headers = request.get("request_headers") or {}
    named = headers.get(RUN_HEADER) if isinstance(headers, dict) else None
    if named in (None, "", "[present]"):
        # LiteLLM shows a header it was not told to pass on as "[present]"
        call_id = request.get("litellm_call_id")
        if named == "[present]" or not isinstance(call_id, str):
            return 400, _problem(
                f"the request names no run: list {RUN_HEADER!r} in the guardrail's "
                "extra_headers in LiteLLM's config, so the application's header reaches "
                "interlock"
            )
        named = f"litellm-{call_id}"
    anonymous = str(named).startswith("litellm-")
    if anonymous and request["input_type"] == "request":
        return 200, _NONE  # a run of one call has no result to report yet
    try:
        trace = headers.get("traceparent") if isinstance(headers, dict) else None
        run_id = await proxy.open_run(str(named), trace if isinstance(trace, str) else None)
    except RunRefused as exc:
        return 200, _blocked(f"interlock: {exc.message}")
    proxy.busy[run_id] = proxy.busy.get(run_id, 0) + 1
    try:
        if request["input_type"] == "request":
            return 200, await _request(proxy, run_id, request)
        return 200, await _response(proxy, run_id, request)
    except _Problem as exc:
        return 200, _blocked(str(exc))
    finally:
        proxy.used(run_id)
        if anonymous and request["input_type"] == "response":
            # a run of one call: nothing comes back to it, so it is not kept in memory
            await proxy.forget(run_id)


def _problem(message: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error"}})


async def _request(proxy: ModelProxy, run_id: str, request: dict[str, Any]) -> bytes:
    """Before the model: journal the result the conversation reports for the run's
    pending call (by the model's id of it)."""
    external = proxy.supervisor.external
    run = external.get(run_id)
    pending = run.pending if run is not None else None
    if pending is None:
        return _NONE
    own = proxy.guard_ids.get(run_id, {}).get(pending.key, pending.key)
    for message in reversed(request.get("structured_messages") or ()):
        if (
            isinstance(message, dict)
            and message.get("role") == "tool"
            and message.get("tool_call_id") in (own, pending.key)
        ):
            report = Report(run_id=run_id, key=pending.key, ok=True, result=message.get("content"))
            verdict = await external.submit(report)
            if verdict.outcome != "running":
                await external.sync(run_id)
                external.settle(run_id)
                proxy.guard_ids.pop(run_id, None)
                if verdict.outcome == "escalated":
                    raise _Problem(f"interlock: run {run_id} is escalated")
            return _NONE
    raise _Problem(
        f"interlock: run {run_id} waits for the result of its call of {pending.tool} "
        f"(id {own}): send it as a tool message with tool_call_id {own!r}"
    )


async def _response(proxy: ModelProxy, run_id: str, request: dict[str, Any]) -> bytes:
    """After the model: verify the first call it returned; block it if the gate refuses."""
    calls: list[tuple[str, str]] = []
    ids: list[str | None] = []
    for call in request.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = msgspec.json.encode(arguments).decode()
        calls.append((function["name"], arguments))
        ids.append(call.get("id"))
    if not calls:
        return _NONE  # a text answer
    transition = proxy.apis["/v1/chat/completions"].reader.transition
    read = judge_calls(calls, "", TokenUsage(), transition)
    verdict = await proxy.verify(run_id, read, str(request.get("model") or ""))
    if verdict.execute is not None:
        own = ids[0]
        if isinstance(own, str):
            proxy.guard_ids.setdefault(run_id, {})[verdict.execute.key] = own
        return _NONE
    if verdict.outcome == "escalated":
        raise _Problem(
            f"interlock: run {run_id} is escalated and waits for an operator: `interlock "
            f"escalations resume {run_id}` resumes it"
        )
    if verdict.accepted:
        return _NONE
    why = "; ".join(f"{v.message} ({v.hint})" if v.hint else v.message for v in verdict.violations)
    return _blocked(f"interlock refused the model's call: {why}")
