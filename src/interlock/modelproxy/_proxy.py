"""The model proxy's steps, the same for each API it serves (``POST /v1/chat/completions``,
``POST /v1/responses``, ``POST /v1/messages``; each API's own words are in :mod:`._apis`).

An application written for the OpenAI or Anthropic SDK points its ``base_url`` at the
proxy. Each request is one step of a run of the machine (named by the ``Interlock-Run``
header, or started by the proxy, which names it in the response's header):

1. the result the application reports for the run's pending call (its tool result, whose
   call id is the call's idempotency key) is journaled as the commit;
2. the request goes upstream (never as a stream) with its tools narrowed to those the
   run's state allows;
3. the tool call the model returns is read with the provider's exact reader and verified
   by the gate. An accepted call reaches the application with its idempotency key as the
   call's id (and in the ``Interlock-Key`` header); a rejected one never does: the model is
   asked again, up to the re-asks, with the violation as the call's tool result, and past
   them the application gets the refusal as the assistant's text. A text answer (no call)
   passes through. A request that asked for a stream gets the decided answer as the API's
   own server-sent events.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._exceptions import (
    ConfigurationError,
    InterlockError,
    ProtocolError,
    ProviderError,
    RunNotFound,
)
from ..core._messages import Propose, Report, Verdict
from ..core._view import fold
from ..runtime._tracing import finish_reasons_of
from ._apis import API_PATHS, Api

if TYPE_CHECKING:
    from ..core._machine import Machine
    from ..core._wire import Read
    from ..providers._http import Transport
    from ..runtime._supervisor import Supervisor

#: ``gen_ai.provider.name`` of a model call, by the API the proxy spoke to the upstream.
_PROVIDER = {"chat": "openai", "responses": "openai", "messages": "anthropic"}

__all__ = ["DEFAULT_REASKS", "KEY_HEADER", "RUN_HEADER", "Answer", "ModelProxy", "RunRefused"]

log = logging.getLogger("interlock.proxy")

#: The header that names a request's run (and a response's).
RUN_HEADER = "interlock-run"
#: The response header that carries an accepted call's idempotency key.
KEY_HEADER = "interlock-key"
#: The most times a rejected call is asked again of the model before the refusal is
#: answered.
DEFAULT_REASKS = 2


class Answer(msgspec.Struct, frozen=True):
    """What the proxy answers: an HTTP status, headers and a JSON body, or the events of a
    stream (``events``, then ``body`` is empty)."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    events: tuple[bytes, ...] | None = None


class RunRefused(InterlockError):
    """A request's run cannot take it: the HTTP status, the message, the error's kind, and
    the run (when there is one)."""

    def __init__(self, status: int, message: str, kind: str, run_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.run_id = run_id


class ModelProxy:
    """The model proxy's steps for the APIs it serves, in front of ``transport`` (the
    upstream's base URL), each request a step of a run of ``machine``."""

    def __init__(
        self,
        supervisor: Supervisor,
        machine: Machine,
        transport: Transport,
        *,
        reasks: int = DEFAULT_REASKS,
        profile: str | None = None,
        transition: str | None = None,
        inputs: dict[str, Any] | None = None,
    ) -> None:
        if not (isinstance(reasks, int) and reasks >= 0):
            raise ConfigurationError(
                f"reasks must be a whole number >= 0 (how many times a rejected call is asked "
                f"again; 0 answers the refusal at once), not {reasks!r}"
            )
        self.supervisor = supervisor
        self.machine = machine
        self.transport = transport
        self.reasks = reasks
        #: the inputs each run the proxy starts is given
        self.inputs = dict(inputs or {})
        self.apis: dict[str, Api] = {
            path: cls(transport.base_url, profile) for path, cls in API_PATHS.items()
        }
        for api in self.apis.values():
            if transition is not None:
                api.reader.transition = transition
        # an Anthropic upstream's base URL has no /v1; an OpenAI one's ends in it
        self._messages_path = "/messages" if transport.base_url.endswith("/v1") else "/v1/messages"
        # the upstream's own id of each call handed on under its key, by run (a Responses
        # upstream that keeps the conversation knows the call by it)
        self._ids: dict[str, dict[str, str]] = {}
        # the model's own id of each call LiteLLM's guardrail let through, by run and key
        self.guard_ids: dict[str, dict[str, str]] = {}
        #: requests in flight by run, and when each run was last used (trio's clock)
        self.busy: dict[str, int] = {}
        self.last_used: dict[str, float] = {}

    def used(self, run_id: str) -> None:
        """A request of ``run_id`` is done."""
        left = self.busy.get(run_id, 1) - 1
        if left > 0:
            self.busy[run_id] = left
        else:
            self.busy.pop(run_id, None)
        self.last_used[run_id] = trio.current_time()

    async def forget(self, run_id: str) -> bool:
        """Drop this process's copy of ``run_id`` once its events are durable, if no
        request of it is in flight; its next request folds it again from the journal.
        Whether it was dropped."""
        external = self.supervisor.external
        run = external.get(run_id)
        if run is None:  # ended, or dropped already
            self.last_used.pop(run_id, None)
            return False
        if self.busy.get(run_id):
            return False
        await external.sync(run_id)
        if self.busy.get(run_id) or not external.forget(run_id, run):
            return False  # a request came meanwhile
        self.last_used.pop(run_id, None)
        self._ids.pop(run_id, None)
        self.guard_ids.pop(run_id, None)
        return True

    async def forget_idle(self, idle: float) -> None:
        """Forever: drop the copies of runs no request used for ``idle`` seconds (an
        application never says a conversation is over; the journal keeps every run)."""
        while True:
            await trio.sleep(min(idle / 2, 30.0))
            now = trio.current_time()
            for run_id, at in list(self.last_used.items()):
                if now - at >= idle and not self.busy.get(run_id):
                    try:
                        await self.forget(run_id)
                    except Exception:  # the journal failed: kept, tried again later
                        log.warning("interlock proxy: could not drop idle run %s", run_id)

    async def handle(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        """Answer one ``POST path`` whose body is ``body``."""
        api = self.apis[path]
        try:
            request = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            return _error(api, 400, f"the body is not JSON: {exc}", "invalid_request_error")
        problem = api.check(request)
        if problem is not None:
            return _error(api, 400, problem, "invalid_request_error")
        stream = request.get("stream") is True
        try:
            run_id = await self.open_run(headers.get(RUN_HEADER), headers.get("traceparent"))
        except RunRefused as refused:
            return _error(api, refused.status, refused.message, refused.kind, refused.run_id)
        self.busy[run_id] = self.busy.get(run_id, 0) + 1  # not forgotten while in use
        try:
            ended = await self._report(api, run_id, request)
            if ended is not None:
                return ended
            answer = await self._step(api, run_id, request, headers)
        except ProtocolError as exc:
            return _error(api, 409, f"interlock refused the request: {exc}", "conflict", run_id)
        finally:
            self.used(run_id)
        if stream and answer.status == 200:
            events = api.stream(msgspec.json.decode(answer.body), request)
            return Answer(200, b"", answer.headers, tuple(events))
        return answer

    async def open_run(self, named: str | None, trace: str | None = None) -> str:
        """The run a request names (``named``, its ``Interlock-Run`` header), held here: a
        run the journal does not know is started under that name, and none starts one.
        ``trace``: the request's ``traceparent``, which a run it starts continues (tracing on).

        Raises:
          RunRefused: the name is not a run name, or the run takes no more requests.
        """
        external = self.supervisor.external
        if named is None:
            handle = await external.start(
                self.machine.name,
                self.inputs,
                run_id=f"proxy-{secrets.token_hex(16)}-1",
                trace=trace,
            )
            return handle.run_id
        if external.get(named) is not None:
            return named
        store = self.supervisor.store
        try:
            record = await store.get_run(named)
        except RunNotFound:
            # the application names its own run (a framework that cannot read the
            # response's header sends the same name with every request): started here
            if not _RUN_NAME.match(named):
                raise RunRefused(
                    400,
                    f"the {RUN_HEADER} header {named[:80]!r} is not a run name: 1-128 "
                    "letters, digits, '_', '-', '.' or ':' (or send none, and the proxy "
                    "starts a run and names it in the response)",
                    "invalid_request_error",
                ) from None
            try:
                handle = await external.start(
                    self.machine.name, self.inputs, run_id=named, trace=trace
                )
            except ProtocolError as exc:
                if external.get(named) is not None:  # started by a request racing this one
                    return named
                raise RunRefused(409, f"interlock refused the run: {exc}", "conflict") from None
            return handle.run_id
        if record.machine == self.machine.name and record.outcome == "escalated":
            raise RunRefused(*_ended(named, record.outcome, record.state), named)
        if record.machine != self.machine.name or record.outcome != "running":
            raise RunRefused(
                409,
                f"run {named} is {record.outcome} in {record.state}: it takes no more "
                f"requests; send no {RUN_HEADER} header to start a new run",
                "conflict",
                named,
            )
        events = await store.load(named)
        external.hold(fold(self.machine, events), events)
        return named

    async def _report(self, api: Api, run_id: str, request: dict[str, Any]) -> Answer | None:
        """Journal the application's result for the run's pending call (its tool result,
        the call's key its id); an answer if the request lacks it or the run ended."""
        run = self.supervisor.external.get(run_id)
        pending = run.pending if run is not None else None
        if pending is None:
            return None
        found, content, failed = api.result(request, pending.key)
        if not found:
            return _error(
                api,
                409,
                f"run {run_id} waits for the result of its call of {pending.tool} (key "
                f"{pending.key}): send it as {api.how_to_report(pending.key)}",
                "conflict",
                run_id,
            )
        if failed:  # the application says the tool failed: the model hears it
            report = Report(
                run_id=run_id,
                key=pending.key,
                ok=False,
                error=content
                if isinstance(content, str)
                else msgspec.json.encode(content).decode(),
                applied=False,
            )
        else:
            report = Report(run_id=run_id, key=pending.key, ok=True, result=content)
        # decided now; written with the next proposal's batch, which is awaited before the
        # application hears anything (a run that ends waits here)
        [verdict] = self.supervisor.external.decide_many([report])
        if isinstance(verdict, Exception):
            raise verdict
        if verdict.outcome != "running":
            await self.supervisor.external.sync(run_id)
            self.supervisor.external.settle(run_id)
            self._ids.pop(run_id, None)
            return self._ended(api, run_id, verdict.outcome, verdict.state)
        return None

    async def _step(
        self, api: Api, run_id: str, request: dict[str, Any], headers: dict[str, str]
    ) -> Answer:
        reader = api.reader
        allowed = set(self.supervisor.view(run_id).allowed_tools)
        body = api.narrowed(api.upstream_ids(request, self._ids.get(run_id, {})), allowed)
        forwarded = {k: v for k, v in headers.items() if k in api.forwarded}
        tracing = self.supervisor.tracing
        if tracing is not None:  # the upstream's spans join the run's trace
            parent = tracing.traceparent(run_id)
            if parent:
                forwarded["traceparent"] = parent
        path = self._messages_path if api.name == "messages" else api.upstream_path
        for attempt in range(self.reasks + 1):
            shaped = api.shaped(body)
            sent = msgspec.json.encode(shaped)
            started = time.time_ns()
            try:
                response = await self.transport.post(path, sent, headers=forwarded)
            except ProviderError as exc:
                if tracing is not None:
                    tracing.chat(
                        run_id,
                        str(body.get("model") or ""),
                        started,
                        time.time_ns(),
                        error=str(exc),
                        provider=_PROVIDER[api.name],
                    )
                # a refusal of a request's shape that a profile flag fixes is named with it
                named = reader.refusal(exc, sent) or exc
                status = exc.status if exc.status is not None and exc.status >= 400 else 502
                message = str(named)
                if exc.status == 404:  # a base URL without /v1, or with one too many
                    message += (
                        f"; the upstream has no {self.transport.base_url}{path}: give "
                        "--upstream the base URL its SDK takes (an OpenAI-style one ends in "
                        "/v1, an Anthropic one does not)"
                    )
                answer = _error(api, status, message, "upstream_error", run_id)
                if exc.retry_after is not None:  # the SDKs wait as the upstream asked
                    wait = str(max(1, math.ceil(exc.retry_after)))
                    answer = Answer(status, answer.body, (*answer.headers, ("retry-after", wait)))
                return answer
            try:
                answer = msgspec.json.decode(response.body)
                calls = api.calls(answer)
            except (msgspec.DecodeError, AttributeError, TypeError, IndexError, KeyError):
                return _error(
                    api,
                    502,
                    f"the upstream's answer is not a {_WHAT[api.name]}: "
                    f"{response.body[:200].decode('utf-8', 'replace')!r}",
                    "upstream_error",
                    run_id,
                )
            if not calls:
                return Answer(200, response.body, ((RUN_HEADER, run_id),))  # text: as is
            try:
                read = reader.read(api.for_gate(answer))
            except ProviderError as exc:  # not the API's shape, for the exact reader
                return _error(api, 502, str(exc), "upstream_error", run_id)
            if tracing is not None:  # this request's verdict under its own span
                tracing.request(
                    run_id,
                    headers.get("traceparent"),
                    finish_reasons=finish_reasons_of(answer),
                    provider=_PROVIDER[api.name],
                )
            latency = (time.time_ns() - started) / 1e9
            verdict = await self.verify(run_id, read, str(answer.get("model") or ""), latency)
            if verdict.execute is not None:
                key = verdict.execute.key
                own = calls[0].get("call_id" if api.name == "responses" else "id")
                if api.name == "responses" and isinstance(own, str):
                    self._ids.setdefault(run_id, {})[key] = own
                return Answer(
                    200,
                    msgspec.json.encode(api.keyed(answer, key)),
                    ((RUN_HEADER, run_id), (KEY_HEADER, key)),
                )
            if verdict.outcome != "running":
                self._ids.pop(run_id, None)
                return self._ended(api, run_id, verdict.outcome, verdict.state)
            if verdict.accepted:  # a move with no call: what the model said, as is
                return Answer(200, response.body, ((RUN_HEADER, run_id),))
            why = "\n".join(
                f"{v.message}; {v.hint}" if v.hint else v.message for v in verdict.violations
            )
            if attempt == self.reasks:
                text = f"interlock refused the model's call: {why}"
                return Answer(
                    200, msgspec.json.encode(api.refused(answer, text)), ((RUN_HEADER, run_id),)
                )
            # ask again: the bad call, and the violation as its result (the application
            # never sees either)
            body = api.reask(body, answer, f"refused: {why}")
            allowed = set(self.supervisor.view(run_id).allowed_tools)
            body = api.narrowed(body, allowed)
        raise AssertionError("unreachable")

    async def verify(self, run_id: str, read: Read, model: str, latency: float = 0.0) -> Verdict:
        """The gate's verdict on the model's answer as a reader read it (``read``: the
        proposal's raw text, the usage, the envelope's violation, the extra calls),
        waiting for the journal only where it must: before the application hears of a call
        that may change something (it may execute it at once, so its intent is durable
        first), and when the run ends. A read-only call's intent is written with its
        commit, and a rejection with the next write."""
        raw, usage, envelope, extra = read
        propose = Propose(
            run_id=run_id,
            raw=raw,
            model=model,
            usage=usage,
            latency=latency,
            envelope=envelope,
            extra_calls=extra,
        )
        external = self.supervisor.external
        [verdict] = external.decide_many([propose])
        if isinstance(verdict, Exception):
            raise verdict
        execute = verdict.execute
        if verdict.outcome != "running":
            await external.sync(propose.run_id)
            external.settle(propose.run_id)
        elif execute is not None and not self.machine.tool_by_name[execute.tool].read_only:
            await external.sync(propose.run_id)
        return verdict

    def _ended(self, api: Api, run_id: str, outcome: str, state: str) -> Answer:
        return _error(api, *_ended(run_id, outcome, state), run_id)


def _ended(run_id: str, outcome: str, state: str) -> tuple[int, str, str]:
    """What a request of a run that ended (or escalated) is answered: status, message, kind."""
    if outcome == "escalated":
        return (
            409,
            f"run {run_id} is escalated and waits for an operator: `interlock escalations "
            f"resume {run_id}` resumes it; until then the model is not asked",
            "run_escalated",
        )
    return 409, f"run {run_id} has {outcome} in {state}", "run_ended"


_RUN_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_WHAT = {"chat": "chat completion", "responses": "Responses response", "messages": "message"}


def _error(api: Api, status: int, message: str, kind: str, run_id: str | None = None) -> Answer:
    headers = ((RUN_HEADER, run_id),) if run_id else ()
    return Answer(status, api.error(status, message, kind), headers)
