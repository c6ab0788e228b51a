"""Each HTTP provider drives a run end to end over real loopback HTTP against the fake
server: the exact bodies are journaled, the conversation pairs every call with its result,
faults are provider failures (never the model's mistakes), and replay needs no network."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from interlock import (
    BreakerPolicy,
    Budgets,
    Machine,
    ProviderPolicy,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
    replay,
)
from interlock.core._events import ModelCalled, ProposalRejected, ProviderFailed
from interlock.events import expand_prompt
from interlock.providers import AnthropicMessages, OpenAIChat, OpenAIResponses
from interlock.stores import MemoryStore
from interlock.testing._fake import FakeLLM, Fault, Reply, open_fake_llm, scripted_brain


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def lookup(args: Lookup, ctx: ToolContext) -> dict[str, Any]:
    return {"order_id": args.order_id, "total": 40}


def shop() -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={
            "WORK": Worker(next=["COMPLETED"], tools=["lookup"], instructions="Look up the order.")
        },
        tools=[Tool("lookup", lookup, Lookup, read_only=True, description="Find an order")],
        provider_policy=ProviderPolicy(timeout=2.0, attempts=4, base=0.01, cap=0.05),
    )


LOOKUP = Reply(calls=[("lookup", '{"order_id": "o1"}')], usage=(120, 10, 100, 0))
BAD = Reply(calls=[("lookup", '{"order": "o1"}')])  # the schema refuses it
DONE = Reply(calls=[("transition", '{"next": "COMPLETED", "data": {"total": 40}}')])

PROVIDERS: dict[str, Callable[[FakeLLM], Any]] = {
    "chat": lambda fake: OpenAIChat(
        "gpt-test", base_url=fake.openai_base_url, api_key="sk-secret-1"
    ),
    "responses": lambda fake: OpenAIResponses(
        "gpt-test", base_url=fake.openai_base_url, api_key="sk-secret-1"
    ),
    "messages": lambda fake: AnthropicMessages(
        "claude-test", base_url=fake.anthropic_base_url, api_key="sk-secret-1"
    ),
    "chat-stream": lambda fake: OpenAIChat(
        "gpt-test", base_url=fake.openai_base_url, api_key="sk-secret-1", stream=True
    ),
    "responses-stream": lambda fake: OpenAIResponses(
        "gpt-test", base_url=fake.openai_base_url, api_key="sk-secret-1", stream=True
    ),
    "messages-stream": lambda fake: AnthropicMessages(
        "claude-test", base_url=fake.anthropic_base_url, api_key="sk-secret-1", stream=True
    ),
}


async def drive(kind: str, replies: list[Any], **options: Any) -> tuple[Any, MemoryStore, FakeLLM]:
    store = MemoryStore()
    async with open_fake_llm(scripted_brain(replies)) as fake:
        provider = PROVIDERS[kind](fake)
        for name, value in options.items():
            setattr(provider, name, value)
        async with provider, open_supervisor([shop()], store, provider=provider) as sup:
            handle = await sup.start_run("shop", {"order_id": "o1"}, run_id="r-1")
            with trio.fail_after(20):
                result = await handle.wait()
    return result, store, fake


@pytest.mark.parametrize("kind", list(PROVIDERS))
async def test_a_run_end_to_end_with_a_rejection_fed_back_and_replayed_offline(kind: str) -> None:
    result, store, fake = await drive(kind, [BAD, LOOKUP, DONE])
    assert (result.outcome, result.output) == ("completed", {"total": 40})
    events = await store.load("r-1")
    calls = [e for e in events if isinstance(e, ModelCalled)]
    assert len(calls) == 3
    assert len(fake.requests) == 3
    # the exact bodies: the request as the fake received it, the response as it was sent
    whole = ""
    for number, (event, request) in enumerate(zip(calls, fake.requests, strict=True)):
        whole = expand_prompt(calls[number - 1].seq if number else 0, whole, event)
        assert msgspec.json.decode(whole) == request.body
        assert isinstance(event.response, str)
        assert event.response
    # the rejection went back as the error result of the call it rejected
    rejected = next(e for e in events if isinstance(e, ProposalRejected))
    assert rejected.violations[0].code == "schema"
    second = msgspec.json.encode(fake.requests[1].body).decode()
    assert "order_id" in second
    assert "error" in second or "is_error" in second
    # the committed result went back with the call that made it
    third = msgspec.json.encode(fake.requests[2].body).decode()
    assert '\\"total\\":40' in third or '"total":40' in third
    # usage with the cached tokens
    assert (calls[1].usage.prompt, calls[1].usage.cached) == (120, 100)
    # the key is never journaled; the fake saw it only redacted
    assert b"sk-secret" not in msgspec.json.encode(events)
    assert all("sk-secret" not in str(r.headers) for r in fake.requests)
    # replay needs no network: the server is gone
    assert replay(events, shop()).ok


@pytest.mark.parametrize("kind", ["chat", "messages"])
@pytest.mark.parametrize(
    "fault",
    [
        Fault(status=429, retry_after=0.01),
        Fault(status=500),
        Fault(status=529),
        Fault(drop=True),
        Fault(truncate=True),
    ],
    ids=["429", "500", "529", "drop", "truncate"],
)
async def test_a_fault_is_a_provider_failure_then_retried(kind: str, fault: Fault) -> None:
    result, store, _ = await drive(kind, [fault, LOOKUP, DONE])
    assert result.outcome == "completed"
    events = await store.load("r-1")
    failed = [e for e in events if isinstance(e, ProviderFailed)]
    assert len(failed) == 1
    assert not [e for e in events if isinstance(e, ProposalRejected)]  # not the model's mistake
    if fault.retry_after is not None:
        assert failed[0].retry_after == pytest.approx(0.01)
    assert "sk-secret" not in failed[0].error


async def test_a_call_that_hangs_is_cut_at_the_timeout_and_retried() -> None:
    result, store, _ = await drive("chat", [Fault(hang=True), LOOKUP, DONE], timeout=0.3)
    assert result.outcome == "completed"
    failed = [e for e in await store.load("r-1") if isinstance(e, ProviderFailed)]
    assert len(failed) == 1


async def test_a_bad_key_escalates_at_once_naming_the_status() -> None:
    result, store, _ = await drive(
        "chat", [Fault(status=401, message="Incorrect API key provided")]
    )
    assert (result.outcome, result.reason) == ("escalated", "provider_unavailable")
    failed = [e for e in await store.load("r-1") if isinstance(e, ProviderFailed)]
    assert len(failed) == 1
    assert "401" in failed[0].error
    assert "Incorrect API key" in failed[0].error
    assert not failed[0].retryable


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (Reply(calls=[("lookup", {"order_id": "o1"})], arguments_as_object=True), "envelope"),
        (Reply(calls=[], tool_calls_empty=True), "envelope"),
        (Reply(text="Let me check that order for you."), "envelope"),
        (Reply(calls=[("lookup", '{"order_id": "o1"}')], finish="length"), "envelope"),
    ],
    ids=["arguments-object", "tool-calls-empty", "text", "length"],
)
async def test_quirks_are_rejections_of_the_strict_profile(reply: Reply, code: str) -> None:
    from interlock.providers import OPENAI

    result, store, _ = await drive("chat", [reply, LOOKUP, DONE], profile=OPENAI)
    assert result.outcome == "completed"
    rejected = [e for e in await store.load("r-1") if isinstance(e, ProposalRejected)]
    assert [v.code for e in rejected for v in e.violations] == [code]


async def test_the_generic_profile_takes_arguments_sent_as_an_object() -> None:
    from interlock.providers import GENERIC

    result, store, _ = await drive(
        "chat",
        [Reply(calls=[("lookup", {"order_id": "o1"})], arguments_as_object=True), DONE],
        profile=GENERIC,
    )
    assert result.outcome == "completed"
    assert not [e for e in await store.load("r-1") if isinstance(e, ProposalRejected)]


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_extra_calls_are_answered_as_not_run(kind: str) -> None:
    two = Reply(calls=[("lookup", '{"order_id": "o1"}'), ("lookup", '{"order_id": "o2"}')])
    result, store, fake = await drive(kind, [two, DONE])
    assert result.outcome == "completed"
    events = await store.load("r-1")
    first = next(e for e in events if isinstance(e, ModelCalled))
    assert first.extra_calls == (("lookup", '{"order_id": "o2"}'),)
    # the next request answers both calls (the fake's validation refuses one unanswered)
    text = msgspec.json.encode(fake.requests[1].body).decode()
    assert "one call per turn" in text


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from interlock.testing import Raw  # noqa: E402


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.binary(max_size=200), kind=st.sampled_from(["chat", "responses", "messages"]))
async def test_any_response_body_is_a_rejection_or_a_provider_failure(
    body: bytes, kind: str
) -> None:
    """Whatever a server answers with a 200, the run goes on: the body is journaled as a
    rejection (the model's answer could not be read as a call) or a provider failure."""
    result, store, _ = await drive(kind, [Raw(body=body), LOOKUP, DONE])
    assert result.outcome == "completed"
    events = await store.load("r-1")
    first = events[1]
    assert isinstance(first, ModelCalled | ProviderFailed)
    if isinstance(first, ModelCalled):
        assert isinstance(events[2], ProposalRejected)


@pytest.mark.parametrize(
    ("profile", "reply", "kind"),
    [
        (
            "llama.cpp",
            Reply(calls=[("lookup", '{"order_id": "o1"}')], markup_in_content=True),
            "chat",
        ),
        ("vllm", Reply(calls=[("lookup", '{"order_id": "o1"}')], finish="stop"), "chat"),
        ("ollama", Reply(calls=[("lookup", {"order_id": "o1"})], arguments_as_object=True), "chat"),
        (
            "ollama",
            Reply(
                calls=[("lookup", '{"order_id": "o1"}'), ("lookup", '{"order_id": "o2"}')],
                shared_index=True,
            ),
            "chat-stream",
        ),
    ],
    ids=["markup", "calls-with-stop", "arguments-object", "shared-index-stream"],
)
async def test_each_named_profile_takes_its_servers_quirk(
    profile: str, reply: Reply, kind: str
) -> None:
    from interlock.providers import PROFILES

    result, store, _ = await drive(kind, [reply, DONE], profile=PROFILES[profile])
    assert result.outcome == "completed"
    events = await store.load("r-1")
    assert not [e for e in events if isinstance(e, ProposalRejected)]
    first = next(e for e in events if isinstance(e, ModelCalled))
    assert first.raw.replace(" ", "") == '{"tool":"lookup","args":{"order_id":"o1"}}'
    if reply.shared_index:  # two calls on one index are two calls, not one merged
        assert first.extra_calls == (("lookup", '{"order_id": "o2"}'),)


async def test_the_fake_in_its_own_process_takes_a_brain_built_on_interlock_testing(
    tmp_path: Any,
) -> None:
    """`python -m interlock.testing._fake --brain mod:fn`: the brain's Reply (from
    interlock.testing) is the server's own class, not a copy in __main__."""
    import subprocess
    import sys

    (tmp_path / "brain.py").write_text(
        "from interlock.testing import Reply, tool_results_of\n"
        "def brain(api, body, headers):\n"
        "    if not tool_results_of(api, body):\n"
        "        return Reply(calls=[('lookup', '{\"order_id\": \"o1\"}')])\n"
        '    return Reply(calls=[(\'transition\', \'{"next": "COMPLETED", "data": {"total": 40}}\')])\n'
    )
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    server = subprocess.Popen(  # noqa: ASYNC220 (its stdout is read in a thread)
        [sys.executable, "-m", "interlock.testing._fake", "--brain", "brain:brain"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        url = await trio.to_thread.run_sync(server.stdout.readline)
        provider = OpenAIChat("m", base_url=url.strip() + "/v1")
        store = MemoryStore()
        async with provider, open_supervisor([shop()], store, provider=provider) as sup:
            with trio.fail_after(20):
                result = await (await sup.start_run("shop", {"order_id": "o1"})).wait()
        assert (result.outcome, result.output) == ("completed", {"total": 40})
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()


async def test_structured_output_in_one_state_and_tools_in_another() -> None:
    """OpenAIChat(output={"STATE": "json_schema"}): that state asks for structured output
    (the proposal is the message content, its schema sent as response_format); the others
    keep native tools."""
    two = Machine(
        "two",
        initial="FIND",
        states={
            "FIND": Worker(next=["ANSWER"], tools=["lookup"]),
            "ANSWER": Worker(next=["COMPLETED"]),
        },
        tools=[Tool("lookup", lookup, Lookup, read_only=True)],
    )
    replies = [
        Reply(calls=[("lookup", '{"order_id": "o1"}')]),
        Reply(calls=[("transition", '{"next": "ANSWER", "data": {}}')]),
        Reply(text='{"next": "COMPLETED", "data": {"answer": 40}}', finish="stop"),
    ]
    store = MemoryStore()
    async with open_fake_llm(scripted_brain(replies)) as fake:
        provider = OpenAIChat("m", base_url=fake.openai_base_url, output={"ANSWER": "json_schema"})
        async with provider, open_supervisor([two], store, provider=provider) as sup:
            result = await (await sup.start_run("two", run_id="r-1")).wait()
    assert (result.outcome, result.output) == ("completed", {"answer": 40})
    bodies = [r.body for r in fake.requests]
    assert "tools" in bodies[0]
    assert "response_format" not in bodies[0]
    assert bodies[2]["response_format"]["type"] == "json_schema"
    assert "tools" not in bodies[2]
    # each state's system message says how to answer there
    assert "Call exactly one tool per turn." in bodies[0]["messages"][0]["content"]
    system = bodies[2]["messages"][0]["content"]
    assert "Call exactly one tool" not in system
    assert "Answer each turn with one JSON object, as the response format's schema says" in system
    assert "with STATE one of COMPLETED." in system
    with pytest.raises(Exception, match="output must be 'tools' or 'json_schema'"):
        OpenAIChat("m", base_url=fake.openai_base_url, output={"ANSWER": "xml"})


def roomy() -> Machine:
    """The shop with room for many rejections in a row and megabytes of tokens."""
    return Machine(
        "shop",
        initial="WORK",
        states={"WORK": Worker(next=["COMPLETED"], tools=["lookup"])},
        tools=[Tool("lookup", lookup, Lookup, read_only=True)],
        breakers=BreakerPolicy(consecutive_failures=6),
        budgets=Budgets(tokens=10**9),
    )


USAGE = (10, 10, 0, 0)


def huge(fill: str) -> Reply:
    """A call of 1.1 MB: over the gate's cap (256 KiB), refused unread."""
    return Reply(calls=[("lookup", '{"order_id": "' + fill * 1_100_000 + '"}')], usage=USAGE)


async def requests_of(kind: str, replies: list[Reply]) -> list[bytes]:
    """The exact request bodies of a run of the roomy shop, as the fake received them."""
    replies = [*replies, Reply(calls=LOOKUP.calls, usage=USAGE), Reply(calls=DONE.calls)]
    async with open_fake_llm(scripted_brain(replies)) as fake:
        provider = PROVIDERS[kind](fake)
        async with provider, open_supervisor([roomy()], MemoryStore(), provider=provider) as sup:
            with trio.fail_after(20):
                result = await (await sup.start_run("shop", run_id="r-1")).wait()
    assert result.outcome == "completed"
    return [msgspec.json.encode(request.body) for request in fake.requests]


def calls_in(body: bytes) -> list[tuple[str, Any]]:
    """The calls of the conversation a request body holds, in any of the three APIs:
    ``(name, arguments)``, the arguments decoded (they are JSON in each shape)."""
    request = msgspec.json.decode(body)
    found: list[tuple[str, Any]] = []
    for item in request.get("messages") or request.get("input") or ():
        if item.get("type") == "function_call":  # Responses
            found.append((item["name"], msgspec.json.decode(item["arguments"])))
        for call in item.get("tool_calls") or ():  # Chat Completions
            function = call["function"]
            found.append((function["name"], msgspec.json.decode(function["arguments"])))
        content = item.get("content")
        for block in content if isinstance(content, list) else ():  # Messages
            if block.get("type") == "tool_use":
                found.append((block["name"], block["input"]))
    return found


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_a_refused_call_goes_back_as_an_excerpt_not_whole(kind: str) -> None:
    """A 1.1 MB call the gate refused goes back as a bounded excerpt of itself (its
    size, its start and end) beside the rejection, in every later request; an accepted
    call goes back as the model sent it (#32: each later request was 1.1 MB again)."""
    schema = Reply(calls=[("lookup", '{"order": "o1"}')], usage=USAGE)  # another mistake
    bodies = await requests_of(kind, [huge("x"), schema])
    assert len(bodies) == 4
    for body in bodies[1:]:
        assert len(body) < 20_000
    assert "over the cap of 262,144 bytes" in bodies[2].decode()  # the defect
    refused, small, accepted = calls_in(bodies[3])
    assert refused[1]["size_bytes"] == 1_100_016  # what the model sent
    assert refused[1]["start"].startswith('{"order_id": "xxx')
    assert refused[1]["end"].endswith('xxx"}')
    assert small == ("lookup", {"order": "o1"})  # a small rejected call goes back whole
    assert accepted == ("lookup", {"order_id": "o1"})


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_rejections_with_one_signature_go_back_as_one_summary(kind: str) -> None:
    """Three refused calls in a row with the same signature are one step of the
    conversation: the latest call, bounded, answered by the summary (#32)."""
    bodies = await requests_of(kind, [huge("x"), huge("y"), huge("z")])
    fourth = bodies[3]
    assert len(fourth) < 20_000
    assert fourth.decode().count("3 attempts rejected: proposal is 1,100,041 bytes") == 1
    [(_name, refused)] = calls_in(fourth)
    assert refused["start"].startswith('{"order_id": "zzz')


@pytest.mark.parametrize("kind", ["chat", "responses", "messages-stream"])
async def test_a_long_malformed_call_goes_back_with_where_its_json_breaks(kind: str) -> None:
    """Past the excerpt's limit, a rejected call goes back with the byte its JSON first
    breaks at and the text around it; the rejection counts that byte in the model's own
    arguments, not in interlock's wrapper (#32)."""
    arguments = '{"order_id": "' + "x" * 3000 + '", "qty": NaN}'
    at = arguments.index("NaN")
    bodies = await requests_of(kind, [Reply(calls=[("lookup", arguments)], usage=USAGE)])
    assert len(bodies[1]) < 20_000
    message = f"expected a value at byte {at} of args (in args.qty): 'NaN}}'"
    assert message in bodies[1].decode()
    [(_name, refused)] = calls_in(bodies[1])
    assert refused["defect_at_byte"] == at
    assert refused["near_defect"].endswith('xxx", "qty": NaN}')


@pytest.mark.parametrize("stream", [False, True])
async def test_a_structured_reply_cut_at_the_limit_names_its_json_defect(stream: bool) -> None:
    """A structured-output answer cut at the output limit is rejected naming what keeps
    its text from being JSON and where, counted in the model's own text (#32)."""
    one = Machine(
        "one",
        initial="ANSWER",
        states={"ANSWER": Worker(next=["COMPLETED"])},
        tools=[Tool("lookup", lookup, Lookup, read_only=True)],
    )
    cut = '{"next": "COMPLETED", "data": {"answer": [40, 4'
    replies = [
        Reply(text=cut, finish="length"),
        Reply(text='{"next": "COMPLETED", "data": {"answer": 40}}', finish="stop"),
    ]
    store = MemoryStore()
    async with open_fake_llm(scripted_brain(replies)) as fake:
        provider = OpenAIChat("m", base_url=fake.openai_base_url, output="json_schema")
        provider.stream = stream
        async with provider, open_supervisor([one], store, provider=provider) as sup:
            with trio.fail_after(20):
                result = await (await sup.start_run("one", run_id="r-1")).wait()
    assert result.outcome == "completed"
    rejected = next(e for e in await store.load("r-1") if isinstance(e, ProposalRejected))
    assert [v.message for v in rejected.violations] == [
        "the reply was cut at the output limit (finish_reason 'length') before it was whole; "
        f"proposal is cut off: the text ends at byte {len(cut)}, in data.answer[1], "
        "before the JSON is complete"
    ]


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_an_extra_call_goes_back_bounded_too(kind: str) -> None:
    """A second call in a turn is never run: past the limit it goes back as an excerpt,
    beside the first call, which was accepted and goes back whole (#32)."""
    big = '{"order_id": "' + "q" * 1_100_000 + '"}'
    two = Reply(calls=[("lookup", '{"order_id": "o1"}'), ("lookup", big)], usage=USAGE)
    bodies = await requests_of(kind, [two])
    assert len(bodies[1]) < 20_000
    first, extra = calls_in(bodies[1])[:2]
    assert first == ("lookup", {"order_id": "o1"})
    assert extra[1]["size_bytes"] == len(big)


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_a_refused_oversized_answer_is_journaled_once_and_bounded(
    kind: str, tmp_path: Path
) -> None:
    """A refused answer over the cap was journaled whole as the proposal and again in the
    response body that holds it: a 50 MB answer made a 100 MB journal (157.5 MB while the
    next request carried it too) (#33). Now the journal keeps one bounded excerpt, the
    size and the hash, 5 MB here: the journal file stays small whatever the size, the
    model is told what it would have been told, and replay decides the same refusal."""
    import hashlib

    from interlock.stores import open_sqlite_store

    size = 5_000_000
    arguments = '{"order_id": "' + "x" * size + '"}'
    whole = '{"tool":"lookup","args":' + arguments + "}"
    big = Reply(calls=[("lookup", arguments)], usage=USAGE)
    db = tmp_path / "j.db"
    store = await open_sqlite_store(str(db))
    replies = [big, Reply(calls=LOOKUP.calls, usage=USAGE), Reply(calls=DONE.calls)]
    async with open_fake_llm(scripted_brain(replies)) as fake:
        provider = PROVIDERS[kind](fake)
        async with provider, open_supervisor([roomy()], store, provider=provider) as sup:
            with trio.fail_after(20):
                result = await (await sup.start_run("shop", run_id="r-1")).wait()
    assert result.outcome == "completed"
    events = await store.load("r-1")
    await store.aclose()
    files = [trio.Path(f"{db}{suffix}") for suffix in ("", "-wal")]
    journal = sum([(await f.stat()).st_size for f in files if await f.exists()])
    assert journal < 256 * 1024  # it was over twice the answer's size
    called, rejected = events[1], events[2]
    assert isinstance(called, ModelCalled)
    assert isinstance(rejected, ProposalRejected)
    assert called.oversized
    assert (called.oversized.raw_bytes, called.oversized.raw_sha256) == (
        len(whole),
        hashlib.sha256(whole.encode()).hexdigest(),
    )
    assert called.oversized.response_bytes > size
    assert len(called.raw) + len(called.response or "") < 8192
    assert [v.message for v in rejected.violations] == [
        f"proposal is {len(whole):,} bytes, over the cap of 262,144 bytes in state 'WORK'; "
        "it was not read"
    ]
    # the model is told what it would have been told: the excerpt of the whole call
    [refused, *_] = calls_in(msgspec.json.encode(fake.requests[1].body))
    assert refused[1]["size_bytes"] == len(arguments)
    assert replay(events, roomy()).ok
