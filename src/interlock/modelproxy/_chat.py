"""The model proxy's OpenAI Chat Completions door: ``POST /v1/chat/completions``.

An application written for the OpenAI SDK points its ``base_url`` at the proxy. Each
request is one step of a run of the machine (named by the ``Interlock-Run`` header, or
started by the proxy, which names it in the response's header):

1. the result the application reports for the run's pending call (its ``tool`` message,
   whose ``tool_call_id`` is the call's idempotency key) is journaled as the commit;
2. the request goes upstream with its ``tools`` narrowed to those the run's state allows;
3. the tool call the model returns is read with the provider's exact reader and verified
   by the gate. An accepted call reaches the application with its idempotency key as the
   call's ``id`` (and in the ``Interlock-Key`` header); a rejected one never does: the
   model is asked again, up to the machine file's re-asks, with the violation as the
   call's tool result, and past them the application gets the refusal as the assistant's
   text. A text answer (no call) passes through.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import msgspec

from ..core._exceptions import (
    ConfigurationError,
    InterlockError,
    ProtocolError,
    ProviderError,
    RunNotFound,
)
from ..core._messages import Propose, Report
from ..core._view import fold
from ..providers import OpenAIChat

if TYPE_CHECKING:
    from ..core._machine import Machine
    from ..providers._http import Transport
    from ..runtime._supervisor import Supervisor

__all__ = ["KEY_HEADER", "RUN_HEADER", "Answer", "ChatProxy"]

#: The header that names a request's run (and a response's).
RUN_HEADER = "interlock-run"
#: The response header that carries an accepted call's idempotency key.
KEY_HEADER = "interlock-key"
#: The most times a rejected call is asked again of the model before the refusal is
#: answered.
DEFAULT_REASKS = 2


class Answer(msgspec.Struct, frozen=True):
    """What the proxy answers: an HTTP status, headers and a JSON body."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def _error(status: int, message: str, kind: str, run_id: str | None = None) -> Answer:
    body = msgspec.json.encode({"error": {"message": message, "type": kind, "code": kind}})
    headers = ((RUN_HEADER, run_id),) if run_id else ()
    return Answer(status, body, headers)


class ChatProxy:
    """``POST /v1/chat/completions`` in front of ``transport`` (the upstream's base URL,
    ending in ``/v1``), each request a step of a run of ``machine``."""

    def __init__(
        self,
        supervisor: Supervisor,
        machine: Machine,
        transport: Transport,
        *,
        reasks: int = DEFAULT_REASKS,
        profile: str | None = None,
        transition: str | None = None,
    ) -> None:
        if not (isinstance(reasks, int) and reasks >= 0):
            raise ConfigurationError(
                f"reasks must be a whole number >= 0 (how many times a rejected call is asked "
                f"again), not {reasks!r}"
            )
        self.supervisor = supervisor
        self.machine = machine
        self.transport = transport
        self.reasks = reasks
        self.reader = OpenAIChat("proxy", base_url=transport.base_url, profile=profile)
        if transition is not None:
            self.reader.transition = transition

    async def handle(self, body: bytes, headers: dict[str, str]) -> Answer:
        """Answer one ``POST /v1/chat/completions`` whose body is ``body``."""
        try:
            request = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            return _error(400, f"the body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            return _error(
                400,
                "the body must be a chat completion request with messages",
                "invalid_request_error",
            )
        if request.get("stream"):
            # NOTE: an SDK that asked for a stream cannot read a whole answer: say so
            return _error(
                400,
                "interlock proxy does not stream yet: send the request without stream=true "
                "(the whole answer comes once the gate has decided)",
                "invalid_request_error",
            )
        try:
            run_id = await self._run(headers.get(RUN_HEADER))
        except _Refused as refused:
            return refused.answer
        try:
            refused = await self._report(run_id, request["messages"])
            if refused is not None:
                return refused
            return await self._step(run_id, request, headers)
        except ProtocolError as exc:
            return _error(409, f"interlock refused the request: {exc}", "conflict", run_id)

    async def _run(self, named: str | None) -> str:
        external = self.supervisor.external
        if named is None:
            handle = await external.start(
                self.machine.name, {}, run_id=f"proxy-{secrets.token_hex(16)}-1"
            )
            return handle.run_id
        if external.get(named) is not None:
            return named
        store = self.supervisor.store
        try:
            record = await store.get_run(named)
        except RunNotFound:
            raise _Refused(
                _error(
                    404,
                    f"no run {named[:80]!r} here; send no {RUN_HEADER} header to start one",
                    "not_found",
                )
            ) from None
        if record.machine == self.machine.name and record.outcome == "escalated":
            raise _Refused(self._ended(named, record.outcome, record.state))
        if record.machine != self.machine.name or record.outcome != "running":
            raise _Refused(
                _error(
                    409,
                    f"run {named} is {record.outcome} in {record.state}: it takes no more "
                    f"requests; send no {RUN_HEADER} header to start a new run",
                    "conflict",
                    named,
                )
            )
        external.hold(fold(self.machine, await store.load(named)))
        return named

    async def _report(self, run_id: str, messages: list[Any]) -> Answer | None:
        """Journal the application's result for the run's pending call (its tool message,
        ``tool_call_id`` the call's key); an answer if the request lacks it."""
        run = self.supervisor.external.get(run_id)
        pending = run.pending if run is not None else None
        if pending is None:
            return None
        for message in reversed(messages):
            if (
                isinstance(message, dict)
                and message.get("role") == "tool"
                and message.get("tool_call_id") == pending.key
            ):
                content = message.get("content")
                report = Report(run_id=run_id, key=pending.key, ok=True, result=content)
                # decided now; written with the next proposal's batch, which is awaited
                # before the application hears anything (a run that ends waits here)
                [verdict] = self.supervisor.external.decide_many([report])
                if isinstance(verdict, Exception):
                    raise verdict
                if verdict.outcome != "running":
                    await self.supervisor.external.sync(run_id)
                    self.supervisor.external.settle(run_id)
                    return self._ended(run_id, verdict.outcome, verdict.state)
                return None
        return _error(
            409,
            f"run {run_id} waits for the result of its call of {pending.tool} (key "
            f"{pending.key}): send it as a tool message with tool_call_id {pending.key!r}",
            "conflict",
            run_id,
        )

    async def _step(self, run_id: str, request: dict[str, Any], headers: dict[str, str]) -> Answer:
        view = self.supervisor.view(run_id)
        allowed = set(view.allowed_tools)
        tools = [
            t
            for t in request.get("tools") or ()
            if isinstance(t, dict) and (t.get("function") or {}).get("name") in allowed
        ]
        messages = list(request["messages"])
        forwarded = {
            k: v for k, v in headers.items() if k in ("authorization", "openai-organization")
        }
        for attempt in range(self.reasks + 1):
            body = {**request, "messages": self._shaped(messages)}
            if tools:
                body["tools"] = tools
            else:
                body.pop("tools", None)
                body.pop("tool_choice", None)
            sent = msgspec.json.encode(body)
            try:
                response = await self.transport.post("/chat/completions", sent, headers=forwarded)
            except ProviderError as exc:
                # a refusal of a request's shape that a profile flag fixes is named with it
                named = self.reader.refusal(exc, sent) or exc
                status = exc.status if exc.status is not None and exc.status >= 400 else 502
                return _error(status, str(named), "upstream_error", run_id)
            try:
                completion = msgspec.json.decode(response.body)
                message = ((completion.get("choices") or [{}])[0]).get("message") or {}
            except (msgspec.DecodeError, AttributeError, TypeError, IndexError):
                return _error(
                    502,
                    "the upstream's answer is not a chat completion: "
                    f"{response.body[:200].decode('utf-8', 'replace')!r}",
                    "upstream_error",
                    run_id,
                )
            if not message.get("tool_calls"):
                return Answer(200, response.body, ((RUN_HEADER, run_id),))  # text: as is
            raw, usage, envelope, extra = self.reader.read(response.body)
            verdict = await self.supervisor.external.submit(
                Propose(
                    run_id=run_id,
                    raw=raw,
                    model=str(completion.get("model") or ""),
                    usage=usage,
                    envelope=envelope,
                    extra_calls=extra,
                )
            )
            if verdict.execute is not None:
                call = message["tool_calls"][0]
                call = {**call, "id": verdict.execute.key}
                choice = {**completion["choices"][0], "message": {**message, "tool_calls": [call]}}
                completion = {**completion, "choices": [choice]}
                return Answer(
                    200,
                    msgspec.json.encode(completion),
                    ((RUN_HEADER, run_id), (KEY_HEADER, verdict.execute.key)),
                )
            if verdict.outcome != "running":
                return self._ended(run_id, verdict.outcome, verdict.state)
            if verdict.accepted:  # a move with no call: what the model said, as is
                return Answer(200, response.body, ((RUN_HEADER, run_id),))
            why = "\n".join(
                f"{v.message}; {v.hint}" if v.hint else v.message for v in verdict.violations
            )
            if attempt == self.reasks:
                text = f"interlock refused the model's call: {why}"
                choice = {
                    **completion["choices"][0],
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
                return Answer(
                    200,
                    msgspec.json.encode({**completion, "choices": [choice]}),
                    ((RUN_HEADER, run_id),),
                )
            # ask again: the bad call, and the violation as its result (the application
            # never sees either)
            calls = message["tool_calls"]
            call_id = calls[0].get("id") or "call"
            messages += [
                {"role": "assistant", "content": None, "tool_calls": calls[:1]},
                {"role": "tool", "tool_call_id": call_id, "content": f"refused: {why}"},
            ]
            view = self.supervisor.view(run_id)
        raise AssertionError("unreachable")

    def _shaped(self, messages: list[Any]) -> list[Any]:
        """The conversation as the upstream's profile takes it: an assistant turn's empty
        content beside its tool calls as ``""`` where the server refuses null, and tool
        results as user messages where its template drops ``tool`` messages."""
        profile = self.reader.profile
        if profile.null_content and not profile.tool_results_as_user:
            return messages
        shaped = []
        for message in messages:
            if not isinstance(message, dict):
                shaped.append(message)
                continue
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls") and not profile.null_content:
                if message.get("content") is None:
                    message = {**message, "content": ""}
            elif role == "tool" and profile.tool_results_as_user:
                content = message.get("content")
                text = (
                    content if isinstance(content, str) else msgspec.json.encode(content).decode()
                )
                message = {
                    "role": "user",
                    "content": f"The result of call {message.get('tool_call_id')}: {text}",
                }
            shaped.append(message)
        return shaped

    def _ended(self, run_id: str, outcome: str, state: str) -> Answer:
        if outcome == "escalated":
            message = (
                f"run {run_id} is escalated and waits for an operator: `interlock escalations "
                f"resume {run_id}` resumes it; until then the model is not asked"
            )
            return _error(409, message, "run_escalated", run_id)
        return _error(409, f"run {run_id} has {outcome} in {state}", "run_ended", run_id)


class _Refused(InterlockError):
    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.body.decode())
        self.answer = answer
