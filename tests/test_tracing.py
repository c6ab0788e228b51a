"""Traces in OpenTelemetry, read back with the SDK's in-memory exporter: the span tree of a
run with a rejection and a tool call; an escalation and its resume; a process stopped
mid-run and the run resumed by another (one trace, a span per part, linked); and an
incoming trace continued. The OTLP export over the wire: tests/test_tracing_otlp.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from interlock import Machine, Tool, Worker, open_supervisor
from interlock.providers import ScriptedProvider
from interlock.runtime._tracing import (
    Tracing,
    finish_reasons,
    format_traceparent,
    parse_traceparent,
    tracing_from_env,
)
from interlock.stores import open_sqlite_store

BAD = '{"tool": "refund", "args": {"order_id": "o-1", "cents": "lots"}}'
REFUND = '{"tool": "refund", "args": {"order_id": "o-1", "cents": 250}}'
DONE = '{"next": "COMPLETED", "data": {"said": "refunded"}}'


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    cents: int


def machine(refund: Any) -> Machine:
    return Machine(
        "refund",
        "WORK",
        {"WORK": Worker(next=["COMPLETED"], tools=["refund"])},
        tools=[Tool("refund", refund, Refund, idempotent=True)],
    )


async def refunded(args: Refund, ctx: Any) -> Any:
    return {"refunded": args.cents, "key": ctx.key}


@pytest.fixture
def exporter() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield Tracing(provider, provider_name="openai"), spans
    provider.shutdown()


def by_name(spans: Any, prefix: str) -> list[Any]:
    return [s for s in spans if s.name.startswith(prefix)]


def events_named(span: Any, name: str) -> list[Any]:
    return [e for e in span.events if e.name == name]


async def test_a_run_with_a_rejection_and_a_tool_call_is_one_tree(
    exporter: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, spans = exporter
    provider = ScriptedProvider([BAD, REFUND, DONE], model="gpt-test")
    async with open_supervisor([machine(refunded)], provider=provider, tracing=tracing) as sup:
        handle = await sup.start_run("refund", run_id="r-1")
        assert (await handle.wait()).outcome == "completed"
    finished = spans.get_finished_spans()
    (run,) = by_name(finished, "invoke_agent refund")
    chats = by_name(finished, "chat gpt-test")
    (tool,) = by_name(finished, "execute_tool refund")
    assert len(chats) == 3
    for child in (*chats, tool):
        assert child.context.trace_id == run.context.trace_id
        assert child.parent.span_id == run.context.span_id
    assert run.parent is None  # no incoming trace: the run's span is the root
    attributes = run.attributes
    assert attributes["gen_ai.operation.name"] == "invoke_agent"
    assert attributes["gen_ai.agent.name"] == "refund"
    assert attributes["gen_ai.conversation.id"] == "r-1"
    assert attributes["interlock.outcome"] == "completed"
    chat = chats[0].attributes
    assert chat["gen_ai.operation.name"] == "chat"
    assert chat["gen_ai.request.model"] == "gpt-test"
    assert chat["gen_ai.provider.name"] == "openai"
    assert "gen_ai.usage.input_tokens" in chat
    assert tool.attributes["gen_ai.tool.name"] == "refund"
    assert tool.attributes["gen_ai.tool.call.id"].startswith("r-1:")
    assert tool.start_time <= tool.end_time
    verdicts = events_named(run, "interlock.verdict")
    assert [v.attributes["interlock.verdict"] for v in verdicts] == [
        "rejected",
        "accepted",
        "accepted",
    ]
    assert list(verdicts[0].attributes["interlock.violation.codes"]) == ["schema"]
    # the journal holds the run's first span: a later part of the run joins its trace
    store = sup.store
    (started, *_) = await store.load("r-1")
    ids = parse_traceparent(started.trace)
    assert ids is not None
    assert ids[:2] == (run.context.trace_id, run.context.span_id)


async def test_an_escalation_ends_the_span_and_the_resume_joins_the_trace(
    exporter: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, spans = exporter
    provider = ScriptedProvider({"r-2": [BAD, BAD, BAD, REFUND, DONE]})
    async with open_supervisor([machine(refunded)], provider=provider, tracing=tracing) as sup:
        handle = await sup.start_run("refund", run_id="r-2")
        assert (await handle.wait()).outcome == "escalated"
        (first,) = by_name(spans.get_finished_spans(), "invoke_agent")
        assert first.attributes["interlock.outcome"] == "escalated"
        (tripped,) = events_named(first, "interlock.breaker_tripped")
        assert tripped.attributes["interlock.breaker"] == "consecutive_failures"
        (escalated,) = events_named(first, "interlock.escalated")
        assert escalated.attributes["interlock.reason"] == "consecutive_failures"
        resumed = await sup.resume_escalated("r-2", by="ana", note="try again")
        assert (await resumed.wait()).outcome == "completed"
    runs = by_name(spans.get_finished_spans(), "invoke_agent")
    assert len(runs) == 2
    second = runs[1]
    assert second.context.trace_id == first.context.trace_id
    assert second.parent.span_id == first.context.span_id
    assert [link.context.span_id for link in second.links] == [first.context.span_id]
    (note,) = events_named(second, "interlock.resumed")
    assert note.attributes["interlock.by"] == "ana"
    assert second.attributes["interlock.outcome"] == "completed"


async def test_a_run_stopped_mid_tool_and_resumed_elsewhere_is_one_trace(
    exporter: tuple[Tracing, InMemorySpanExporter], tmp_path: Path
) -> None:
    tracing, spans = exporter
    db = str(tmp_path / "journal.db")
    entered = trio.Event()

    async def hangs(args: Refund, ctx: Any) -> Any:
        entered.set()
        await trio.sleep_forever()

    store = await open_sqlite_store(db)
    try:
        async with open_supervisor(
            [machine(hangs)], store, provider=ScriptedProvider([REFUND]), tracing=tracing
        ) as sup:
            await sup.start_run("refund", run_id="r-3")
            await entered.wait()
            sup.cancel_actors()  # the process stops mid-tool (the tool is idempotent)
    finally:
        await store.aclose()
    # the stopped part: its span ended as interrupted, the tool's too
    (first,) = by_name(spans.get_finished_spans(), "invoke_agent")
    assert first.attributes["interlock.interrupted"] is True
    second_tracing = Tracing(tracing.tracer_provider)
    store = await open_sqlite_store(db)
    try:
        async with open_supervisor(
            [machine(refunded)],
            store,
            provider=ScriptedProvider([DONE]),
            resume=True,
            tracing=second_tracing,
        ) as sup:
            await sup.handles["r-3"].wait()
    finally:
        await store.aclose()
    runs = by_name(spans.get_finished_spans(), "invoke_agent")
    assert len(runs) == 2
    second = runs[1]
    assert second.context.trace_id == first.context.trace_id
    assert second.parent.span_id == first.context.span_id
    assert second.attributes["interlock.outcome"] == "completed"
    tools = by_name(spans.get_finished_spans(), "execute_tool refund")
    assert {t.context.trace_id for t in tools} == {first.context.trace_id}


async def test_an_incoming_trace_is_continued(
    exporter: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, spans = exporter
    caller = format_traceparent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)
    async with open_supervisor(
        [machine(refunded)], provider=ScriptedProvider([REFUND, DONE]), tracing=tracing
    ) as sup:
        handle = await sup.start_run("refund", run_id="r-4", trace=caller)
        await handle.wait()
    (run,) = by_name(spans.get_finished_spans(), "invoke_agent")
    assert run.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert run.parent.span_id == 0x00F067AA0BA902B7
    assert run.parent.is_remote


async def test_without_tracing_nothing_is_journaled_or_traced() -> None:
    async with open_supervisor(
        [machine(refunded)], provider=ScriptedProvider([REFUND, DONE])
    ) as sup:
        assert sup.tracing is None
        await (await sup.start_run("refund", run_id="r-5")).wait()
        (started, *_) = await sup.store.load("r-5")
    assert started.trace is msgspec.UNSET
    assert b"trace" not in msgspec.msgpack.encode(started)


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        (
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1),
        ),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
        ("00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("garbage", None),
        ("", None),
    ],
)
def test_traceparents_are_read_strictly(text: str, ids: Any) -> None:
    assert parse_traceparent(text) == ids


def test_tracing_is_off_unless_configured() -> None:
    assert tracing_from_env({}) is None
    assert tracing_from_env({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}) is None
    assert tracing_from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    made = [
        tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}),
        tracing_from_env({}, force=True),
        tracing_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}),
    ]
    for tracing in made:
        assert tracing is not None
        tracing.shutdown()  # its exporter's connections closed
    with pytest.raises(ValueError, match="'http/protobuf'"):
        tracing_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "smoke"})
    with pytest.raises(ValueError, match="'otlp'"):
        tracing_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_finish_reasons_are_read_from_each_api_s_answer() -> None:
    assert finish_reasons('{"choices": [{"finish_reason": "tool_calls"}]}') == ["tool_calls"]
    assert finish_reasons('{"stop_reason": "tool_use"}') == ["tool_use"]
    assert finish_reasons('{"status": "completed", "output": []}') == ["completed"]
    assert finish_reasons("not json") == []
    assert finish_reasons("[1, 2]") == []


async def test_show_names_the_trace_of_a_traced_run(
    exporter: tuple[Tracing, InMemorySpanExporter], tmp_path: Path
) -> None:
    import subprocess
    import sys

    tracing, spans = exporter
    db = str(tmp_path / "journal.db")
    store = await open_sqlite_store(db)
    try:
        async with open_supervisor(
            [machine(refunded)], store, provider=ScriptedProvider([REFUND, DONE]), tracing=tracing
        ) as sup:
            await (await sup.start_run("refund", run_id="r-6")).wait()
    finally:
        await store.aclose()
    (run,) = by_name(spans.get_finished_spans(), "invoke_agent")
    shown = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "interlock", "show", "r-6", "--db", db],
            capture_output=True,
            text=True,
            env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"},
            check=True,
        )
    )
    assert f"trace {run.context.trace_id:032x}" in shown.stdout


async def test_an_http_provider_s_requests_carry_the_run_s_trace_and_name_it(
    exporter: tuple[Tracing, InMemorySpanExporter],
) -> None:
    """An HTTP provider's requests carry the run's traceparent; and the chat spans name the
    provider (gen_ai.provider.name from the run's provider, OpenAIChat: openai, when the
    Tracing was given none) and the finish reasons of the journaled response."""
    from interlock.providers import OpenAIChat
    from interlock.testing import Reply, open_fake_llm, scripted_brain

    configured, spans = exporter
    tracing = Tracing(configured.tracer_provider)  # no provider_name
    brain = scripted_brain(
        [
            Reply(calls=[("refund", '{"order_id": "o-1", "cents": 5}')]),
            Reply(calls=[("transition", '{"next": "COMPLETED"}')]),
        ]
    )
    async with open_fake_llm(brain) as fake:
        provider = OpenAIChat("fake", base_url=fake.openai_base_url, api_key="k")
        async with (
            provider,
            open_supervisor([machine(refunded)], provider=provider, tracing=tracing) as sup,
        ):
            await (await sup.start_run("refund", run_id="r-7")).wait()
        sent = [r.headers.get("traceparent", "") for r in fake.requests]
    (run,) = by_name(spans.get_finished_spans(), "invoke_agent")
    assert len(sent) >= 2
    for parent in sent:
        ids = parse_traceparent(parent)
        assert ids is not None
        assert ids[:2] == (run.context.trace_id, run.context.span_id)
    chats = by_name(spans.get_finished_spans(), "chat ")
    assert len(chats) == 2
    for chat in chats:
        assert chat.attributes["gen_ai.provider.name"] == "openai"
        assert list(chat.attributes["gen_ai.response.finish_reasons"]) == ["tool_calls"]


async def test_each_request_s_verdict_is_traced_under_that_request_s_span(
    exporter: tuple[Tracing, InMemorySpanExporter],
) -> None:
    """A door tells the tracing of each request before its proposal is decided
    (Tracing.request). The verdict events are traced when they are durable, which may be
    after the next request came: each verdict still goes under its own request's span
    (matched by the run's seq), a request with no traceparent gets no verify span, and
    the requests that never got a verdict are forgotten."""
    from interlock.core._messages import Propose

    tracing, spans = exporter
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    first, second = (format_traceparent(trace_id, span) for span in (0xA1, 0xB2))
    async with open_supervisor([machine(refunded)], tracing=tracing) as sup:
        start = format_traceparent(trace_id, 0x00F067AA0BA902B7)
        await sup.external.start("refund", run_id="r-9", trace=start)
        tracing.request("r-9", first)
        [refused] = sup.external.decide_many([Propose(run_id="r-9", raw=BAD)])
        tracing.request("r-9", second)  # before the first verdict was written
        [accepted] = sup.external.decide_many([Propose(run_id="r-9", raw=REFUND)])
        assert not isinstance(refused, Exception)
        assert not refused.accepted
        assert not isinstance(accepted, Exception)
        assert accepted.execute is not None
        await sup.external.sync("r-9")
        for _ in range(40):  # refused before the gate: never a verdict
            tracing.request("r-9", first)
        assert len(tracing.runs["r-9"].callers) == 16
    checks = by_name(spans.get_finished_spans(), "verify refund")
    assert [(c.parent.span_id, c.attributes["interlock.verdict"]) for c in checks] == [
        (0xA1, "rejected"),
        (0xB2, "accepted"),
    ]
    assert list(checks[0].attributes["interlock.violation.codes"]) == ["schema"]
    (run,) = by_name(spans.get_finished_spans(), "invoke_agent")
    for check in checks:
        assert check.context.trace_id == trace_id
        assert [link.context.span_id for link in check.links] == [run.context.span_id]
    (tool,) = by_name(spans.get_finished_spans(), "execute_tool")
    assert tool.parent.span_id == run.context.span_id  # the same trace: under the run


async def test_a_tracer_that_fails_costs_no_run() -> None:
    import logging

    said: list[str] = []

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    # NOTE: a handler of its own: the suite's other tests change the interlock loggers'
    # propagation (the CLI's), so caplog may hear nothing
    logger = logging.getLogger("interlock.tracing")
    heard = Heard(logging.ERROR)
    logger.addHandler(heard)
    disabled, logger.disabled = logger.disabled, False  # (a dictConfig may have disabled it)

    class Broken:
        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the exporter's library is broken")

    class BrokenProvider:
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            return Broken()

    tracing = Tracing(BrokenProvider())
    async with open_supervisor(
        [machine(refunded)], provider=ScriptedProvider([REFUND, DONE]), tracing=tracing
    ) as sup:
        result = await (await sup.start_run("refund", run_id="r-8")).wait()
        (started, *_) = await sup.store.load("r-8")
    logger.removeHandler(heard)
    assert result.outcome == "completed"
    assert started.trace is msgspec.UNSET  # started untraced
    assert "tracing could not begin run r-8" in said

    # a door's request with a tracing that fails is answered untraced, and said so
    working = Tracing(TracerProvider())
    async with open_supervisor([machine(refunded)], tracing=working) as sup:
        await sup.external.start("refund", run_id="r-9")

        def broken(run_id: str) -> Any:
            raise RuntimeError("the run table is broken")

        working._live = broken
        logger.addHandler(heard)
        try:
            working.request("r-9", format_traceparent(1, 2))  # does not raise
        finally:
            logger.removeHandler(heard)
            logger.disabled = disabled
    assert "tracing could not take a request of run r-9" in said


async def test_the_channel_s_hello_carries_the_trace_of_its_runs_and_verdicts(
    exporter: tuple[Tracing, InMemorySpanExporter],
) -> None:
    """The gateway's msgpack channel has no HTTP headers: a connection's ``traceparent``
    comes in its hello. The runs it creates continue it, and each verdict on its
    proposals (single ones, taken in a batch, and a verify op) is a span under it; a
    connection with none starts its runs' traces afresh and has no verify spans."""
    from functools import partial

    from interlock.client._channel import open_channel
    from interlock.gateway import GatewayService
    from interlock.gateway._channel import serve_channel
    from interlock.gateway._keys import KeyRing
    from interlock.protocol import VerifyItem

    tracing, spans = exporter
    trace_id, hello_span = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    async with open_supervisor([machine(refunded)], tracing=tracing) as sup:
        service = GatewayService(sup)
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_channel, service, keyring=KeyRing()))
            caller = format_traceparent(trace_id, hello_span)
            async with open_channel(url, traceparent=caller) as channel:
                run = await channel.create_run("refund", run_id="ch-1", mode="external")
                refused = await channel.propose("ch-1", BAD, run.seq)
                assert not refused.accepted
                accepted = (
                    await channel.verify(
                        [VerifyItem(run_id="ch-1", proposal=REFUND, expected_seq=refused.seq)]
                    )
                ).verdicts[0]
                assert accepted.accepted
            async with open_channel(url) as channel:
                await channel.create_run("refund", run_id="ch-2", mode="external")
                assert not (await channel.propose("ch-2", BAD)).accepted
            nursery.cancel_scope.cancel()
    finished = spans.get_finished_spans()
    runs = {s.attributes["interlock.run.id"]: s for s in by_name(finished, "invoke_agent")}
    assert runs["ch-1"].context.trace_id == trace_id
    assert runs["ch-1"].parent.span_id == hello_span
    assert runs["ch-2"].context.trace_id != trace_id
    assert runs["ch-2"].parent is None
    checks = by_name(finished, "verify refund")
    assert [
        (c.attributes["interlock.run.id"], c.attributes["interlock.verdict"]) for c in checks
    ] == [
        ("ch-1", "rejected"),
        ("ch-1", "accepted"),
    ]
    assert all(c.parent.span_id == hello_span for c in checks)
