"""Traces in OpenTelemetry: a run, its model calls, its tools and the gate's verdicts as spans.

Off unless configured: nothing here is imported, and the supervisor calls nothing, until a
:class:`Tracing` is attached (``open_supervisor(..., tracing=)``, or the ``OTEL_*``
variables and ``--otel`` of the commands, through :func:`tracing_from_env`). It needs the
``interlock[otel]`` extra (the OpenTelemetry API and SDK and the OTLP exporters).

The spans are made from the journal as it is written (the supervisor's ``on_written``):
every door (a run in process, the gateway, the MCP proxy, the model proxy, a worker) writes
the same events, so every door traces the same way, and what a trace shows is what the
journal holds. Times are the events' own.

- **A run**: a span ``invoke_agent {machine}`` (``gen_ai.operation.name`` ``invoke_agent``)
  from its start, or its resume in this process, to its end or escalation. A run that is
  resumed (after a crash, an escalation, by another worker) gets a span of its own in the
  same trace, a child of the run's first span and linked to it: not one endless span. The
  first span's ``traceparent`` is journaled in ``run_started.trace``; the trace an incoming
  request carried (the gateway's ``traceparent`` header, an MCP request's ``_meta``, the
  model proxy's headers) is its parent.
- **A model call**: ``chat {model}`` with ``gen_ai.request.model``, ``gen_ai.usage.*`` and
  ``gen_ai.response.finish_reasons`` (when the journaled response says it).
- **A tool call**: ``execute_tool {tool}`` from its intent to its commit or failure, with
  ``gen_ai.tool.name`` and the idempotency key as ``gen_ai.tool.call.id``.
- **The gate**: each verdict an event ``interlock.verdict`` on the run's span
  (``interlock.verdict`` accepted or rejected, ``interlock.violation.codes``); breaker
  trips, calls in doubt, reconciliations, escalations and resumes are events too.

The GenAI semantic conventions followed are those of :data:`SEMCONV_VERSION` (still marked
Development); the ``interlock.*`` names are this module's own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..core._events import (
    BreakerTripped,
    Completed,
    Escalated,
    Failed,
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
)
from ..core._exceptions import MissingExtra
from ..core._messages import CLIENT_MODEL

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..core._events import Event

__all__ = [
    "SEMCONV_VERSION",
    "Tracing",
    "format_traceparent",
    "parse_traceparent",
    "tracing_from_env",
]

_log = logging.getLogger("interlock.tracing")

#: The version of the OpenTelemetry semantic conventions whose GenAI names are used.
SEMCONV_VERSION = "1.41.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
#: The requests awaiting their verdicts kept per run (see Tracing.request): more are
#: requests that got none (refused before the gate), the oldest forgotten first.
_CALLERS_KEPT = 16
#: The span queue of the exporters :func:`tracing_from_env` makes, unless
#: ``OTEL_BSP_MAX_QUEUE_SIZE`` says otherwise (the SDK's own default is 2,048).
BATCH_QUEUE = 65_536


def parse_traceparent(text: str | None) -> tuple[int, int, int] | None:
    """A W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``) as (trace id, span id,
    flags); None if it is absent or malformed (an all-zero id is malformed)."""
    if not text:
        return None
    parts = text.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    version, trace, span, flags = parts[:4]
    if (
        len(trace) != 32
        or len(span) != 16
        or len(flags) != 2
        or (version == "00" and len(parts) != 4)
    ):
        return None
    try:
        ids = int(trace, 16), int(span, 16), int(flags, 16)
    except ValueError:
        return None
    if not ids[0] or not ids[1]:
        return None
    return ids


def format_traceparent(trace_id: int, span_id: int, flags: int = 1) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


class _Run:
    """One run's spans in this process."""

    __slots__ = ("callers", "first", "machine", "pending", "span", "tools")

    def __init__(self, machine: str, span: Any, first: Any) -> None:
        self.machine = machine
        self.span = span
        self.first = first  # the SpanContext of the run's first span
        self.tools: dict[str, Any] = {}  # idempotency key -> the open execute_tool span
        self.pending: str | None = None  # the state of a proposal waiting for its verdict
        # The requests whose proposals are being decided (see Tracing.request), oldest
        # first: the run's seq when each came (its verdict's events come after it), the
        # caller's SpanContext or None, when it came (ns), and what the door read of the
        # model's answer (finish reasons, provider) for the model call's span.
        self.callers: list[tuple[int, Any, int, tuple[str, ...], str]] = []


class Tracing:
    """Spans of runs, from their journal events as they are written.

    Args:
      tracer_provider: an OpenTelemetry ``TracerProvider`` (the SDK's, with the exporters
        wanted); default the global one (``opentelemetry.trace.get_tracer_provider()``).
      provider_name: ``gen_ai.provider.name`` of the model calls (``openai``,
        ``anthropic``, ...), if one provider serves every run.
    """

    def __init__(
        self, tracer_provider: Any = None, *, provider_name: str = "", owned: bool = False
    ) -> None:
        try:
            from opentelemetry import trace
        except ImportError:
            raise MissingExtra(
                "tracing needs OpenTelemetry, which is not installed; install the otel "
                "extra: pip install 'interlock[otel]'"
            ) from None
        self._trace = trace
        provider = tracer_provider or trace.get_tracer_provider()
        self.tracer_provider = provider
        self.tracer = provider.get_tracer("interlock", __version__, schema_url=SCHEMA_URL)
        self.provider_name = provider_name
        self.runs: dict[str, _Run] = {}
        self._owned = owned  # made by tracing_from_env: shut down with this
        self._provider_for: Any = None  # the supervisor's, to name a machine's provider
        self._live: Any = None

    # -- what the supervisor calls ----------------------------------------------------

    def attach(self, supervisor: Any) -> None:
        """Trace every run ``supervisor`` writes from now on."""
        supervisor.tracing = self
        supervisor.on_written.append(self.written)
        self._provider_for = getattr(supervisor, "provider_for", None)
        external = getattr(supervisor, "external", None)
        self._live = getattr(external, "get", None)  # a live run's state (its seq)

    def request(
        self,
        run_id: str,
        traceparent: str | None,
        *,
        finish_reasons: Sequence[str] = (),
        provider: str = "",
    ) -> None:
        """A request of a door is about to have a proposal of run ``run_id`` decided:
        ``traceparent`` is the caller's (a gateway request's header, an MCP request's
        ``_meta``, a model proxy request's header; None or malformed: none).

        With one, the verdict is also a span ``verify {machine}`` under the caller's span,
        linked to the run's span, so the caller's trace shows the gate's decision on its
        own request, not only the trace of the request that started the run; and a tool
        call it accepts is traced under the caller's span when the caller's trace is
        another than the run's (linked to the run's span). ``finish_reasons`` and
        ``provider``: what the door read of the model's answer, for the ``chat`` span of
        the proposal's model call. Every request calls this, so a request with no
        ``traceparent`` clears an earlier one's. A failure of the tracing itself is
        logged: the request goes on untraced."""
        try:
            self._request(run_id, traceparent, finish_reasons, provider)
        except Exception:  # a trace must never cost a request
            _log.exception("tracing could not take a request of run %s", run_id)

    def _request(
        self,
        run_id: str,
        traceparent: str | None,
        finish_reasons: Sequence[str],
        provider: str,
    ) -> None:
        run = self.runs.get(run_id)
        if run is None:
            return
        ids = parse_traceparent(traceparent)
        held = self._live(run_id) if self._live is not None else None
        after = held.seq if held is not None else 0
        callers = run.callers
        if len(callers) >= _CALLERS_KEPT:  # requests that never got a verdict (refused)
            del callers[0]
        callers.append(
            (
                after,
                None if ids is None else self._remote(ids),
                time.time_ns(),
                tuple(finish_reasons),
                provider,
            )
        )

    @staticmethod
    def _caller(
        run: _Run, seq: int, *, take: bool
    ) -> tuple[int, Any, int, tuple[str, ...], str] | None:
        """The request whose proposal the event ``seq`` decides: the newest one that came
        before it (with ``take``, it and the older ones are done with)."""
        callers = run.callers
        found = None
        count = 0
        for entry in callers:
            if entry[0] >= seq:
                break
            found = entry
            count += 1
        if take and count:
            del callers[:count]
        return found

    def begin(self, run_id: str, machine: str, parent: str | None = None) -> str:
        """Start the first span of a new run (before its ``run_started`` is written) and
        return its ``traceparent``, to journal with the start; ``parent``: the caller's.
        A failure of the tracing itself is logged and the run starts untraced ('')."""
        try:
            return self._begin(run_id, machine, parent)
        except Exception:  # a trace must never cost a run
            _log.exception("tracing could not begin run %s", run_id)
            return ""

    def _begin(self, run_id: str, machine: str, parent: str | None) -> str:
        span = self.tracer.start_span(
            f"invoke_agent {machine}",
            context=self._context(parent),
            kind=self._trace.SpanKind.INTERNAL,
            attributes=self._run_attributes(run_id, machine),
        )
        context = span.get_span_context()
        self.runs[run_id] = _Run(machine, span, context)
        return format_traceparent(context.trace_id, context.span_id, int(context.trace_flags))

    def resumed(self, run_id: str, machine: str, first: str, *, why: str = "resumed") -> None:
        """A run this process takes up again (its journal read back): a new span in the
        run's trace, a child of and linked to its first span (``first``, the journaled
        ``traceparent``; a new trace if the run was started without tracing). A failure
        of the tracing itself is logged: the run goes on untraced here."""
        if run_id in self.runs:
            return
        try:
            self._resumed(run_id, machine, first, why)
        except Exception:  # a trace must never cost a run (nor a resume of many)
            _log.exception("tracing could not take up run %s", run_id)

    def _resumed(self, run_id: str, machine: str, first: str, why: str) -> None:
        parent = self._context(first)
        links = []
        ids = parse_traceparent(first)
        if ids is not None:
            links.append(self._trace.Link(self._remote(ids)))
        attributes = {**self._run_attributes(run_id, machine), "interlock.run.segment": why}
        span = self.tracer.start_span(
            f"invoke_agent {machine}", context=parent, links=links, attributes=attributes
        )
        self.runs[run_id] = _Run(
            machine, span, self._remote(ids) if ids else span.get_span_context()
        )

    def traceparent(self, run_id: str, key: str = "") -> str:
        """The ``traceparent`` of the run's span in this process, or of its tool call
        ``key``'s span when that is open ('' if none): what an upstream request made for
        the run (a model call, a tool call) carries."""
        run = self.runs.get(run_id)
        if run is None:
            return ""
        span = run.tools.get(key, run.span) if key else run.span
        context = span.get_span_context()
        return format_traceparent(context.trace_id, context.span_id, int(context.trace_flags))

    def written(self, events: Sequence[Event]) -> None:
        """The journal writer made ``events`` durable."""
        for event in events:
            try:
                self._event(event)
            except Exception:  # a trace must never cost a run
                _log.exception(
                    "tracing failed on %s event %s of run %s",
                    type(event).__name__,
                    event.seq,
                    event.run_id,
                )

    def close(self) -> None:
        """End the spans still open (a process stopping: its runs resume elsewhere)."""
        for run in self.runs.values():
            for span in run.tools.values():
                span.set_attribute("interlock.interrupted", True)
                span.end()
            run.span.set_attribute("interlock.interrupted", True)
            run.span.end()
        self.runs.clear()

    def shutdown(self) -> None:
        """End the spans still open and, for a tracer provider :func:`tracing_from_env`
        made, export what is left and stop it (a command's last step)."""
        self.close()
        if self._owned:
            self.tracer_provider.shutdown()

    # -- the events ------------------------------------------------------------------

    def _event(self, event: Event) -> None:
        run_id = event.run_id
        run = self.runs.get(run_id)
        if run is None:
            if isinstance(event, RunStarted):
                trace = event.trace if isinstance(event.trace, str) else ""
                self.resumed(run_id, event.machine, trace, why="started")
            else:
                return  # a run this process did not start or resume: not traced here
            run = self.runs[run_id]
        ts = int(event.ts * 1e9)
        span = run.span
        if isinstance(event, RunStarted):
            span.set_attribute("interlock.state", event.state)
            if event.external is True:
                span.set_attribute("interlock.run.external", True)
            return
        if isinstance(event, ModelCalled):
            if event.model != CLIENT_MODEL:  # an MCP client's call is not a model's
                self._chat(run, event)
            run.pending = None if event.error else event.state  # its proposal's verdict next
            return
        if isinstance(event, StepProposed):
            run.pending = event.state
            return
        if isinstance(event, ProposalRejected):
            verdict = {
                "interlock.verdict": "rejected",
                "interlock.violation.codes": [v.code for v in event.violations],
                "interlock.violation.paths": [v.path for v in event.violations],
                "interlock.state": event.state,
                "interlock.seq": event.seq,
            }
            span.add_event("interlock.verdict", verdict, timestamp=ts)
            self._verified(run_id, run, verdict, ts, event.seq)
            run.pending = None
            return
        caller = None
        if isinstance(event, Transitioned | IntentRecorded) and run.pending is not None:
            verdict = {
                "interlock.verdict": "accepted",
                "interlock.state": run.pending,
                "interlock.seq": event.seq,
            }
            span.add_event("interlock.verdict", verdict, timestamp=ts)
            caller = self._verified(run_id, run, verdict, ts, event.seq)
            run.pending = None
        if isinstance(event, IntentRecorded):
            parent, links = span, None
            if caller is not None and caller.trace_id != span.get_span_context().trace_id:
                # the caller's trace is another: the call is traced there, linked here
                parent = self._trace.NonRecordingSpan(caller)
                links = [self._trace.Link(span.get_span_context())]
            tool = self.tracer.start_span(
                f"execute_tool {event.tool}",
                context=self._trace.set_span_in_context(parent),
                links=links,
                start_time=ts,
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": event.tool,
                    "gen_ai.tool.call.id": event.key,
                    "gen_ai.conversation.id": run_id,
                    "interlock.idempotency_key": event.key,
                    "interlock.state": event.state,
                },
            )
            run.tools[event.key] = tool
            return
        if isinstance(event, Transitioned):
            span.set_attribute("interlock.state", event.dst)
            return
        if isinstance(event, ToolCommitted):
            tool = run.tools.pop(event.key, None)
            if tool is not None:
                tool.set_attribute("interlock.attempts", event.attempts)
                if event.reused:
                    tool.set_attribute("interlock.reused", True)
                if event.reconciled is True:
                    tool.set_attribute("interlock.reconciled", True)
                tool.end(end_time=ts)
            return
        if isinstance(event, ToolFailed | ToolInDoubt):
            tool = run.tools.get(event.key)
            target = tool if tool is not None else span
            name = (
                "interlock.in_doubt" if isinstance(event, ToolInDoubt) else "interlock.tool_failed"
            )
            target.add_event(
                name, {"interlock.error": event.error, "gen_ai.tool.name": event.tool}, timestamp=ts
            )
            if tool is not None and (isinstance(event, ToolFailed) and not event.retryable):
                tool.set_status(self._trace.Status(self._trace.StatusCode.ERROR, event.error[:200]))
                tool.set_attribute("error.type", "tool_failed")
                run.tools.pop(event.key).end(end_time=ts)
            return
        if isinstance(event, Reconciled):
            tool = run.tools.pop(event.key, None)
            attributes = {
                "gen_ai.tool.name": event.tool,
                "interlock.idempotency_key": event.key,
                "interlock.applied": str(event.applied).lower(),
            }
            (tool or span).add_event("interlock.reconciled", attributes, timestamp=ts)
            if tool is not None:
                tool.end(end_time=ts)
            return
        if isinstance(event, ProviderFailed):
            span.add_event(
                "interlock.provider_failed",
                {"interlock.error": event.error, "gen_ai.request.model": event.model},
                timestamp=ts,
            )
            return
        if isinstance(event, BreakerTripped):
            span.add_event(
                "interlock.breaker_tripped",
                {
                    "interlock.breaker": event.breaker,
                    "interlock.state": event.state,
                    "interlock.value": event.value,
                    "interlock.limit": event.limit,
                    "interlock.detail": event.detail,
                },
                timestamp=ts,
            )
            return
        if isinstance(event, Resumed):
            span.add_event(
                "interlock.resumed",
                {"interlock.by": event.by, "interlock.note": event.note, "interlock.to": event.to},
                timestamp=ts,
            )
            return
        if isinstance(event, Escalated):
            span.add_event(
                "interlock.escalated",
                {
                    "interlock.reason": event.reason,
                    "interlock.detail": event.detail,
                    "interlock.state": event.state,
                },
                timestamp=ts,
            )
            self._end(run_id, run, "escalated", ts)
            return
        if isinstance(event, Completed):
            self._end(run_id, run, "completed", ts)
            return
        if isinstance(event, Failed):
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, event.reason[:200]))
            span.set_attribute("error.type", "failed")
            self._end(run_id, run, "failed", ts)

    def _verified(self, run_id: str, run: _Run, verdict: dict[str, Any], ts: int, seq: int) -> Any:
        """The verdict (its event ``seq``) as a ``verify`` span under the caller's span,
        when the request that asked for it carried a trace (see :meth:`request`); the
        caller's SpanContext, or None."""
        if not run.callers:
            return None
        entry = self._caller(run, seq, take=True)
        if entry is None or entry[1] is None:
            return None
        caller, asked = entry[1], entry[2]
        attributes = {
            "interlock.run.id": run_id,
            "interlock.machine": run.machine,
            "gen_ai.conversation.id": run_id,
            **verdict,
        }
        checked = self.tracer.start_span(
            f"verify {run.machine}",
            context=self._trace.set_span_in_context(self._trace.NonRecordingSpan(caller)),
            kind=self._trace.SpanKind.INTERNAL,
            links=[self._trace.Link(run.span.get_span_context())],
            start_time=min(asked, ts),
            attributes=attributes,
        )
        checked.end(end_time=max(asked, ts))
        return caller

    def _end(self, run_id: str, run: _Run, outcome: str, ts: int) -> None:
        for tool in run.tools.values():
            tool.end(end_time=ts)
        run.span.set_attribute("interlock.outcome", outcome)
        run.span.end(end_time=ts)
        del self.runs[run_id]

    def _chat(self, run: _Run, event: ModelCalled) -> None:
        end = int(event.ts * 1e9)
        reasons = finish_reasons(event.response if isinstance(event.response, str) else "")
        entry = self._caller(run, event.seq, take=False) if run.callers else None
        if entry is not None:
            reasons = reasons or list(entry[3])
        provider = (entry[4] if entry is not None else "") or self.provider_name
        if not provider and self._provider_for is not None:
            provider = getattr(self._provider_for(run.machine), "gen_ai_provider", "")
        self.chat(
            event.run_id,
            event.model,
            end - int(max(event.latency, 0.0) * 1e9),
            end,
            input_tokens=event.usage.prompt,
            output_tokens=event.usage.completion,
            finish_reasons=reasons,
            error=event.error,
            state=event.state,
            provider=provider if isinstance(provider, str) else "",
        )

    def chat(
        self,
        run_id: str,
        model: str,
        start: int,
        end: int,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        finish_reasons: Sequence[str] = (),
        error: str = "",
        state: str = "",
        provider: str = "",
    ) -> None:
        """A model call of run ``run_id`` (from ``start`` to ``end``, ns since the epoch)
        as a ``chat {model}`` span under the run's: made from each ``model_called`` event,
        and by a door that calls the model itself (the model proxy)."""
        run = self.runs.get(run_id)
        if run is None:
            return
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": run_id,
        }
        if input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = input_tokens
        if output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = output_tokens
        if state:
            attributes["interlock.state"] = state
        if provider or self.provider_name:
            attributes["gen_ai.provider.name"] = provider or self.provider_name
        if finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = list(finish_reasons)
        span = self.tracer.start_span(
            f"chat {model}".strip(),
            context=self._trace.set_span_in_context(run.span),
            kind=self._trace.SpanKind.CLIENT,
            start_time=start,
            attributes=attributes,
        )
        if error:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error[:200]))
            span.set_attribute("error.type", "model_error")
        span.end(end_time=end)

    # -- contexts ----------------------------------------------------------------------

    def _remote(self, ids: tuple[int, int, int]) -> Any:
        trace = self._trace
        return trace.SpanContext(
            ids[0], ids[1], is_remote=True, trace_flags=trace.TraceFlags(ids[2] & 0xFF)
        )

    def _context(self, traceparent: str | None) -> Any:
        ids = parse_traceparent(traceparent)
        if ids is None:
            return self._trace.set_span_in_context(self._trace.INVALID_SPAN)
        return self._trace.set_span_in_context(self._trace.NonRecordingSpan(self._remote(ids)))

    @staticmethod
    def _run_attributes(run_id: str, machine: str) -> dict[str, Any]:
        return {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": machine,
            "gen_ai.conversation.id": run_id,
            "interlock.run.id": run_id,
            "interlock.machine": machine,
        }


def finish_reasons(response: str | bytes) -> list[str]:
    """The finish reasons a journaled provider response gives (OpenAI's ``finish_reason``,
    the Responses API's ``status``, Anthropic's ``stop_reason``)."""
    if not response or len(response) > 1_000_000:
        return []
    try:
        body = json.loads(response)
    except ValueError:
        return []
    return finish_reasons_of(body)


def finish_reasons_of(body: Any) -> list[str]:
    """:func:`finish_reasons` of a response already decoded."""
    if not isinstance(body, dict):
        return []
    if isinstance(body.get("choices"), list):
        return [
            str(c.get("finish_reason"))
            for c in body["choices"]
            if isinstance(c, dict) and c.get("finish_reason")
        ]
    for key in ("stop_reason", "status"):
        if isinstance(body.get(key), str):
            return [body[key]]
    return []


def tracing_from_env(
    environ: Mapping[str, str] | None = None, *, force: bool = False, service: str = "interlock"
) -> Tracing | None:
    """A :class:`Tracing` exporting over OTLP as the standard variables say, or None when
    tracing is not configured.

    On when ``force`` (the commands' ``--otel``), or ``OTEL_TRACES_EXPORTER`` names
    ``otlp``/``console`` (printed to stderr), or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``,
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); off when ``OTEL_SDK_DISABLED=true`` or
    ``OTEL_TRACES_EXPORTER=none``. ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` picks
    ``http/protobuf`` (the default) or ``grpc``; ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` name the service; the exporters read the rest (headers,
    timeouts, certificates) themselves.

    Raises:
      MissingExtra: tracing is asked for and ``interlock[otel]`` is not installed.
      ValueError: an exporter or protocol the variables name is not one of these.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = [
        e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()
    ]
    if exporters == ["none"]:
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not (force or exporters or endpoint):
        return None
    unknown = [e for e in exporters if e not in ("otlp", "console")]
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER names {unknown[0]!r}; interlock exports traces with "
            "'otlp' (and 'console' to print them), or 'none'"
        )
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise MissingExtra(
            "tracing is configured (OTEL_* or --otel) but OpenTelemetry is not installed; "
            "install the otel extra: pip install 'interlock[otel]'"
        ) from None
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)
    # NOTE: the processor's thread exports while trio's loop runs thousands of runs: with
    # the SDK's default queue (2,048 spans) a burst of runs lost up to 70% of its spans
    # (benchmarks/RESULTS.md, "Tracing"); a queue of 65,536 held every one
    queue = int(env.get("OTEL_BSP_MAX_QUEUE_SIZE") or BATCH_QUEUE)
    for exporter in exporters or ["otlp"]:
        if exporter == "console":
            # NOTE: to stderr, never stdout: a stdio MCP proxy's stdout is its protocol
            # channel (a span printed there broke its client's connection)
            provider.add_span_processor(
                BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr), max_queue_size=queue)
            )
            continue
        protocol = (
            (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf"
            )
            .strip()
            .lower()
        )
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        else:
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL is {protocol!r}; interlock exports OTLP over "
                "'http/protobuf' (the default) or 'grpc'"
            )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), max_queue_size=queue))
    return Tracing(provider, owned=True)
