"""The async client, for trio (httpx.AsyncClient underneath)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Self, TypeVar

import httpx
import trio

from ..core._sse import SseParser
from ..protocol import (
    EscalationOut,
    EventOut,
    HealthOut,
    ReadyOut,
    RunOut,
    RunSummary,
    VerdictOut,
    VerifyItem,
    VerifyOut,
)
from . import _calls
from ._common import (
    ENDING_KINDS,
    TERMINAL_KINDS,
    TERMINAL_OUTCOMES,
    Call,
    ClientRetryPolicy,
    Codec,
    Format,
    GatewayProblem,
    GatewayUnavailable,
    Mode,
    api_key_from,
    base_headers,
    check_base_url,
    problem_from,
    read_answer,
    retry_wait,
    run_path,
    stream_event,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Mapping
    from types import TracebackType

    from ._calls import UsageLike

T = TypeVar("T")

#: Transport errors raised before the request left: resending them is always safe.
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


# unasync: async-only
async def _finish(response: httpx.Response, lines: AsyncIterator[str]) -> None:
    """Close a stream's response and run its line reader to its end.

    NOTE: httpx reads a body through a chain of async generators; one left suspended
    (the caller stopped early) is finalized by the garbage collector, which trio
    reports as a ResourceWarning. Resuming the chain after the close makes every one of
    them end now, with the close's error.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        await response.aclose()
        with contextlib.suppress(Exception):
            async for _ in lines:
                pass


# unasync: end
# unasync: sync-only
# def _finish(response: httpx.Response, lines: Iterator[str]) -> None:
#     """Close a stream's response: its line reader ends with it."""
#     response.close()
# unasync: end


class AsyncClient:
    """A client of an interlock gateway, for trio.

    Every method sends one request (``list_runs``, ``events`` and ``stream`` follow
    pages and reconnect as needed) and decodes the answer into the gateway's Structs
    (``interlock.gateway``'s ``RunOut``, ``VerdictOut``, ...). A problem answer raises
    :class:`GatewayProblem`.

    Retries: a request that gets no answer (the connection was refused or dropped, or
    it timed out) is sent again, the same bytes, up to ``retry.retries`` times with
    backoff, and so is one answered 429 or 503 with a ``Retry-After`` no longer than
    ``retry.cap``. Resending a mutating request is safe because the gateway recognises
    it: a run is created with a run id (the client makes one when you give none), a
    proposal carries ``expected_seq``, a result its key, a resume or an abort its
    operator and note, and the gateway answers a repeat with what it recorded the
    first time: never a second effect or a second intent. A proposal without
    ``expected_seq`` (and a batch with any such item) is resent only when the first
    attempt certainly never reached the server.

    Args:
      base_url: where the gateway listens, e.g. ``"http://127.0.0.1:8080"``.
      api_key: a bearer key; default ``INTERLOCK_API_KEY``, else none (a gateway
        open on loopback).
      timeout: seconds to wait for connecting and for each read (streams wait
        for events as long as they need).
      format: ``"json"`` or ``"msgpack"`` for request and response bodies.
      retry: how requests that got no answer are resent.
      http: an ``httpx.AsyncClient`` to send through instead of a new one (its
        base URL and headers are left alone; the caller closes it).

    Use it as ``async with AsyncClient(url) as client:``, or call :meth:`aclose`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        format: Format = "json",
        retry: ClientRetryPolicy | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.base_url = check_base_url(base_url)
        self._codec = Codec(format)
        self._headers = base_headers(api_key_from(api_key), self._codec)
        self._retry = retry if retry is not None else ClientRetryPolicy()
        self._timeout = timeout
        self._own = http is None
        self._http = http if http is not None else httpx.AsyncClient(timeout=timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (unless ``http=`` was given: its owner closes it)."""
        if self._own:
            await self._http.aclose()

    # -- runs -------------------------------------------------------------------------

    async def create_run(
        self,
        machine: str,
        inputs: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        mode: Mode = "external",
    ) -> RunOut:
        """Start a run of ``machine`` with ``inputs``.

        Args:
          machine: a machine of the gateway's application.
          inputs: the run's inputs (its machine's ``inputs`` schema applies).
          run_id: the run's id; the client makes one (``run-<uuid>``) when omitted.
          mode: ``"external"`` (you send the proposals and execute the tools) or
            ``"hosted"`` (the gateway's runtime drives the model and the tools).

        Returns:
          The run: its state, seq, allowed tools with their schemas, next states and
          the rendered context for the model.

        Raises:
          GatewayProblem: e.g. 404 for an unknown machine, 422 for bad inputs.
        """
        return await self._send(_calls.create_run(machine, inputs, run_id, mode))

    async def start_external(
        self, machine: str, inputs: Mapping[str, Any] | None = None, *, run_id: str | None = None
    ) -> AsyncExternalRun:
        """Start an external run and return an :class:`AsyncExternalRun` that drives it."""
        run = await self.create_run(machine, inputs, run_id=run_id, mode="external")
        return AsyncExternalRun(self, run)

    async def external(self, run_id: str) -> AsyncExternalRun:
        """An :class:`AsyncExternalRun` for an external run that exists (after a restart)."""
        return AsyncExternalRun(self, await self.get_run(run_id))

    async def get_run(self, run_id: str) -> RunOut:
        """The run ``run_id`` as it is now.

        Raises:
          GatewayProblem: 404 if no such run exists.
        """
        return await self._send(_calls.get_run(run_id))

    async def list_runs(
        self,
        *,
        state: str | None = None,
        machine: str | None = None,
        outcome: str | None = None,
        page_size: int | None = None,
    ) -> AsyncIterator[RunSummary]:
        """Every run that matches, oldest first, reading page after page by cursor.

        Args:
          state: only runs in this state.
          machine: only runs of this machine.
          outcome: only runs with this outcome (running, completed, escalated, failed).
          page_size: runs per request, 1 to 1,000 (the gateway's default, 100, when None).
        """
        cursor: str | None = None
        while True:
            page = await self._send(_calls.list_runs(state, machine, outcome, page_size, cursor))
            for run in page.runs:
                yield run
            if page.cursor is None or not page.runs:
                return
            cursor = page.cursor

    async def events(self, run_id: str, *, after: int = 0) -> list[EventOut]:
        """The run's journal events after seq ``after``, every page of them."""
        events: list[EventOut] = []
        while True:
            page = await self._send(_calls.events(run_id, after))
            events.extend(page.events)
            if not page.more or page.last_seq <= after:
                return events
            after = page.last_seq

    async def stream(
        self, run_id: str, *, last_event_id: int | None = None
    ) -> AsyncIterator[EventOut]:
        """The run's journal events as they are written (Server-Sent Events).

        Starts after seq ``last_event_id`` (from the first event when None) and ends
        after the run's ``completed`` or ``failed`` event (an escalated run is followed
        on: an operator may resume it). A dropped connection is resumed with
        ``Last-Event-ID`` (no event is missed or repeated), up to ``retry.retries``
        times in a row without an event in between. Leaving the loop early closes the
        connection only when the generator is closed: wrap it in
        ``contextlib.aclosing(...)``.

        Raises:
          GatewayProblem: e.g. 404 if no such run exists.
          GatewayUnavailable: the stream could not be resumed.
        """
        path = run_path(run_id, "stream")
        call = Call("GET", path, EventOut)
        last = last_event_id
        attempt = 0
        timeout = httpx.Timeout(self._timeout, read=None)
        while True:
            headers = {**self._headers, "Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
            cause: Exception | None = None
            try:
                async with self._http.stream(
                    "GET", self.base_url + path, headers=headers, timeout=timeout
                ) as response:
                    if response.status_code != 200:
                        content = await response.aread()
                        problem = problem_from(
                            call,
                            response.status_code,
                            response.headers,
                            content,
                            response.reason_phrase,
                        )
                        wait = retry_wait(self._retry, attempt + 1, problem)
                        if wait is None:
                            raise problem
                        attempt += 1
                        await trio.sleep(wait)
                        continue
                    parser = SseParser()
                    lines = response.aiter_lines()
                    try:
                        async for line in lines:
                            frame = parser.feed_line(line)
                            if frame is None:
                                continue
                            event = stream_event(call, frame)
                            if last is not None and event.seq <= last:
                                continue  # already seen (a server that resent)
                            last, attempt = event.seq, 0
                            yield event
                            if event.kind in ENDING_KINDS:
                                return
                    finally:
                        await _finish(response, lines)
                # NOTE: the gateway ended the stream before the run ended (it is shutting
                # down, say): resume it as after a drop, from the last event seen
                reason = "the gateway closed the stream before the run ended"
            except httpx.TransportError as exc:
                cause, reason = exc, f"{type(exc).__name__}: {exc}"
            attempt += 1
            if attempt > self._retry.retries:
                raise GatewayUnavailable("GET", path, attempt, reason) from cause
            await trio.sleep(self._retry.backoff(attempt))

    async def wait(self, run_id: str) -> RunOut:
        """Wait until the run is terminal (completed, escalated or failed) and return it.

        Watches the run's stream, so it costs one request however long the run takes.
        Bound the wait with ``trio.fail_after``/``trio.move_on_after``.
        """
        run = await self.get_run(run_id)
        idle = 0
        while run.outcome not in TERMINAL_OUTCOMES:
            seen = run.seq
            async with contextlib.aclosing(self.stream(run_id, last_event_id=run.seq)) as events:
                async for event in events:
                    if event.kind in TERMINAL_KINDS:
                        break
            run = await self.get_run(run_id)
            # a gateway that closes the stream with nothing new: back off, never spin
            idle = 0 if run.seq > seen else idle + 1
            if idle:
                await trio.sleep(self._retry.backoff(min(idle, 8)))
        return run

    # -- proposals and results --------------------------------------------------------

    async def propose(
        self,
        run_id: str,
        proposal: str,
        *,
        usage: UsageLike | None = None,
        expected_seq: int | None = None,
        model: str = "",
    ) -> VerdictOut:
        """Send the model's raw text for the gate to verify.

        Args:
          run_id: an external run.
          proposal: the model's answer, exactly as it produced it:
            ``{"tool": NAME, "args": {...}}`` or ``{"next": STATE, "data": {...}}``.
          usage: the tokens the model call used (counted into the run's budget).
          expected_seq: the run's seq as you last saw it (``RunOut.seq``,
            ``VerdictOut.seq``). With it the request is safe to resend, and a
            run another client advanced is refused with 409.
          model: the model's name, journaled with the call.

        Returns:
          The verdict: ``accepted`` or the ``violations``; for an accepted tool call
          ``key``, ``tool`` and ``args`` (the intent is durable already): execute the
          call with the key, then :meth:`report` it.

        Raises:
          GatewayProblem: 409 for a stale ``expected_seq``, 404 for an unknown run, ...
        """
        return await self._send(_calls.propose(run_id, proposal, usage, expected_seq, model))

    async def report(
        self,
        run_id: str,
        key: str,
        result: Any = None,
        *,
        attempts: int = 1,
        latency: float = 0.0,
    ) -> VerdictOut:
        """Report that the accepted call with idempotency ``key`` succeeded with ``result``.

        Reporting the same key again returns the recorded verdict (``replayed``), with
        the result recorded the first time.
        """
        return await self._send(
            _calls.report(run_id, key, result=result, attempts=attempts, latency=latency)
        )

    async def report_error(
        self,
        run_id: str,
        key: str,
        error: str,
        *,
        retryable: bool = False,
        applied: bool | None = None,
        attempts: int = 1,
        latency: float = 0.0,
    ) -> VerdictOut:
        """Report that the accepted call with idempotency ``key`` failed.

        Args:
          error: what went wrong, for the journal and the model.
          retryable: the failure was transient (a 429, a 5xx, a timeout).
          applied: ``False`` if the downstream certainly did not apply the call (the
            failure goes back to the model); ``None`` (unknown) or ``True`` leaves a
            call of a tool that is not safe to repeat in doubt: it is reconciled or
            escalated, never silently re-run.
        """
        return await self._send(
            _calls.report(
                run_id,
                key,
                error=error,
                retryable=retryable,
                applied=applied,
                attempts=attempts,
                latency=latency,
            )
        )

    async def verify(self, items: Iterable[VerifyItem | Mapping[str, Any]]) -> list[VerdictOut]:
        """Verify a batch of proposals of external runs, journaled in one group commit.

        Args:
          items: ``VerifyItem``s or mappings with ``run_id``, ``proposal`` and
            optionally ``usage``, ``expected_seq`` and ``model``.

        Returns:
          One verdict per item, in order; an item that got none has ``problem`` set.
        """
        out: VerifyOut = await self._send(_calls.verify(items))
        return out.verdicts

    # -- escalations ------------------------------------------------------------------

    async def escalations(self) -> list[EscalationOut]:
        """The runs waiting in the escalation queue."""
        return (await self._send(_calls.escalations())).escalations

    async def escalation(self, run_id: str) -> EscalationOut:
        """One escalated run: why it stopped and where it may be resumed."""
        return await self._send(_calls.escalation(run_id))

    async def resume(
        self,
        run_id: str,
        *,
        by: str,
        note: str = "",
        payload: str | None = None,
        to: str | None = None,
    ) -> RunOut:
        """Resume an escalated run: in ``to`` (default: where it escalated from), or with
        a corrected ``payload`` (a proposal, verified like any other)."""
        return await self._send(_calls.resume(run_id, by, note, payload, to))

    async def abort(self, run_id: str, *, by: str, note: str = "") -> RunOut:
        """End an escalated run in FAILED."""
        return await self._send(_calls.abort(run_id, by, note))

    # -- health -----------------------------------------------------------------------

    async def health(self) -> HealthOut:
        """``GET /healthz``: the gateway answers."""
        return await self._send(_calls.health())

    async def ready(self) -> ReadyOut:
        """``GET /readyz``: the store answers, the journal can be written and keeps up.

        Raises:
          GatewayProblem: 503 when the gateway is not ready.
        """
        return await self._send(_calls.ready())

    # -- sending ----------------------------------------------------------------------

    async def _send(self, call: Call[T]) -> T:
        content = None if call.body is None else self._codec.encode(call.body)
        headers = self._headers
        if content is not None:
            headers = {**headers, "Content-Type": self._codec.content_type}
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._http.request(
                    call.method,
                    self.base_url + call.path,
                    params=call.params,
                    content=content,
                    headers=headers,
                )
            except httpx.TransportError as exc:
                safe = call.replayable or isinstance(exc, NEVER_SENT)
                if attempt > self._retry.retries or not safe:
                    reason = f"{type(exc).__name__}: {exc}"
                    if not safe:
                        reason += (
                            "; not resent, since it may have reached the gateway and is not "
                            "safe to repeat (give expected_seq to make a proposal safe)"
                        )
                    raise GatewayUnavailable(call.method, call.path, attempt, reason) from exc
                await trio.sleep(self._retry.backoff(attempt))
                continue
            try:
                return read_answer(
                    call,
                    response.status_code,
                    response.headers,
                    response.content,
                    response.reason_phrase,
                )
            except GatewayProblem as problem:
                wait = retry_wait(self._retry, attempt, problem)
                if wait is None:
                    raise
                await trio.sleep(wait)


class AsyncExternalRun:
    """One external run, driven step by step; it keeps the run's seq for you.

    Each :meth:`propose` sends the seq of the last verdict as ``expected_seq``, so
    every request is safe to resend and a run another client advanced is refused
    (409) instead of decided twice::

        run = await client.start_external("refund", {"order_id": "ord-1"})
        while run.outcome == "running":
            context = (await run.refresh()).context  # state, tools, history: for the model
            verdict = await run.propose(model(context))
            if verdict.key:
                await run.report(verdict.key, my_tool(verdict.tool, verdict.args))

    Attributes:
      client: the client it sends through.
      id: the run's id.
      run: the run as last fetched (:meth:`refresh`).
      seq, state, outcome: as of the last answer.
    """

    def __init__(self, client: AsyncClient, run: RunOut) -> None:
        self.client = client
        self.id = run.id
        self.run = run
        self.seq = run.seq
        self.state = run.state
        self.outcome = run.outcome

    @property
    def context(self) -> str:
        """The rendered context for the model, as of the last :meth:`refresh` (a
        verdict does not carry it: refresh before asking the model again)."""
        return self.run.context

    def _track(self, verdict: VerdictOut) -> VerdictOut:
        self.seq, self.state, self.outcome = verdict.seq, verdict.state, verdict.outcome
        return verdict

    async def refresh(self) -> RunOut:
        """Fetch the run again (its context, tools, next states and seq)."""
        self.run = await self.client.get_run(self.id)
        self.seq, self.state, self.outcome = self.run.seq, self.run.state, self.run.outcome
        return self.run

    async def propose(
        self, proposal: str, *, usage: UsageLike | None = None, model: str = ""
    ) -> VerdictOut:
        """Send the model's raw text at the seq this object last saw; see
        :meth:`AsyncClient.propose`."""
        return self._track(
            await self.client.propose(
                self.id, proposal, usage=usage, expected_seq=self.seq, model=model
            )
        )

    async def report(self, key: str, result: Any = None, **kwargs: Any) -> VerdictOut:
        """Report a successful call; see :meth:`AsyncClient.report`."""
        return self._track(await self.client.report(self.id, key, result, **kwargs))

    async def report_error(self, key: str, error: str, **kwargs: Any) -> VerdictOut:
        """Report a failed call; see :meth:`AsyncClient.report_error`."""
        return self._track(await self.client.report_error(self.id, key, error, **kwargs))

    async def wait(self) -> RunOut:
        """Wait until the run is terminal; see :meth:`AsyncClient.wait`."""
        self.run = await self.client.wait(self.id)
        self.seq, self.state, self.outcome = self.run.seq, self.run.state, self.run.outcome
        return self.run
