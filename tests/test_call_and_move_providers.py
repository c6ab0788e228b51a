"""Call and move with the real providers, over loopback HTTP against the fake server: in a
``Worker(call_and_move=True)`` state each tool takes an optional ``next`` (and
``next_data``), so one model call both calls the tool and moves the run on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio

from interlock import (
    Machine,
    MachineDefinitionError,
    ProviderPolicy,
    Tool,
    ToolContext,
    ToolError,
    Worker,
    open_supervisor,
    replay,
)
from interlock.core._events import ModelCalled, ToolFailed, Transitioned
from interlock.core._view import RunState, RunView
from interlock.core._wire import check_machine, split_move, strict_schema, tool_specs
from interlock.providers import AnthropicMessages, OpenAIChat, OpenAIResponses
from interlock.stores import MemoryStore
from interlock.testing._fake import FakeLLM, Reply, open_fake_llm, scripted_brain, tools_of


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


class Total(msgspec.Struct, forbid_unknown_fields=True):
    total: int


async def lookup(args: Lookup, ctx: ToolContext) -> dict[str, Any]:
    if args.order_id == "bad":
        raise ToolError("no such order", retryable=False)
    return {"order_id": args.order_id, "total": 40}


def shop(*, data: Any = Total, moves: bool = True) -> Machine:
    return Machine(
        "shop",
        initial="WORK",
        states={
            "WORK": Worker(
                next=["COMPLETED"],
                tools=["lookup"],
                data=data,
                instructions="Look up the order, then finish.",
                call_and_move=moves,
            )
        },
        tools=[Tool("lookup", lookup, Lookup, read_only=True, description="Find an order")],
        provider_policy=ProviderPolicy(timeout=2.0, attempts=4, base=0.01, cap=0.05),
    )


PROVIDERS: dict[str, tuple[str, Callable[[FakeLLM], Any]]] = {
    "chat": ("chat", lambda f: OpenAIChat("gpt-test", base_url=f.openai_base_url, api_key="k")),
    "chat-strict": (
        "chat",
        lambda f: OpenAIChat("gpt-test", base_url=f.openai_base_url, api_key="k", strict=True),
    ),
    "responses": (
        "responses",
        lambda f: OpenAIResponses("gpt-test", base_url=f.openai_base_url, api_key="k"),
    ),
    "responses-strict": (
        "responses",
        lambda f: OpenAIResponses("gpt-test", base_url=f.openai_base_url, api_key="k", strict=True),
    ),
    "messages": (
        "messages",
        lambda f: AnthropicMessages("claude-test", base_url=f.anthropic_base_url, api_key="k"),
    ),
    "messages-stream": (
        "messages",
        lambda f: AnthropicMessages(
            "claude-test", base_url=f.anthropic_base_url, api_key="k", stream=True
        ),
    ),
}

MOVE = Reply(
    calls=[("lookup", '{"order_id": "o1", "next": "COMPLETED", "next_data": {"total": 40}}')]
)


async def drive(kind: str, replies: list[Any], spec: Machine | None = None) -> tuple[Any, Any, Any]:
    store = MemoryStore()
    spec = spec or shop()
    async with open_fake_llm(scripted_brain(replies)) as fake:
        provider = PROVIDERS[kind][1](fake)
        async with provider, open_supervisor([spec], store, provider=provider) as sup:
            handle = await sup.start_run("shop", {"order_id": "o1"}, run_id="r-1")
            with trio.fail_after(20):
                result = await handle.wait()
    return result, list(await store.load("r-1")), fake


@pytest.mark.parametrize("kind", list(PROVIDERS))
async def test_one_model_call_calls_the_tool_and_moves_on(kind: str) -> None:
    result, events, fake = await drive(kind, [MOVE])
    assert (result.outcome, result.output) == ("completed", {"total": 40})
    assert len(fake.requests) == 1
    assert len([e for e in events if isinstance(e, ModelCalled)]) == 1
    kinds = [type(e).__name__ for e in events]
    assert kinds[-4:] == ["IntentRecorded", "ToolCommitted", "Transitioned", "Completed"]
    # the tool offered the move: next, an enum of the legal next states, and the data
    api = PROVIDERS[kind][0]
    parameters = tools_of(api, fake.requests[0].body)["lookup"]
    move = parameters["properties"]["next"]
    enum = move["anyOf"][0]["enum"] if "anyOf" in move else move["enum"]
    assert enum == ["COMPLETED"]
    assert "next_data" in parameters["properties"]
    if kind.endswith("strict"):
        assert set(parameters["required"]) == {"order_id", "next", "next_data"}
        assert {"type": "null"} in move["anyOf"]
        strict_schema(parameters, "the offered tool")  # every property required, none extra
    else:
        assert parameters["required"] == ["order_id"]
    assert replay(events, shop()).ok  # no network: the server is gone


@pytest.mark.parametrize("kind", ["chat-strict", "responses-strict", "messages"])
async def test_a_call_that_leaves_next_null_or_out_is_a_plain_call(kind: str) -> None:
    arguments = (
        '{"order_id": "o1", "next": null, "next_data": null}'
        if kind.endswith("strict")
        else '{"order_id": "o1"}'
    )
    done = Reply(calls=[("transition", '{"next": "COMPLETED", "data": {"total": 40}}')])
    result, events, fake = await drive(kind, [Reply(calls=[("lookup", arguments)]), done])
    assert result.outcome == "completed"
    assert len(fake.requests) == 2
    reasons = [e.reason for e in events if isinstance(e, Transitioned)]
    assert reasons == ["proposal"]  # the move came from the transition call


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
async def test_a_failed_call_does_not_move_and_the_model_sees_the_failure(kind: str) -> None:
    fail = Reply(
        calls=[("lookup", '{"order_id": "bad", "next": "COMPLETED", "next_data": {"total": 1}}')]
    )
    result, events, fake = await drive(kind, [fail, MOVE])
    assert (result.outcome, result.output) == ("completed", {"total": 40})
    failed = [e for e in events if isinstance(e, ToolFailed)]
    assert len(failed) == 1
    after = events[events.index(failed[0]) + 1]
    assert isinstance(after, ModelCalled)  # no move between the failure and the next call
    # the second request shows the call as the model made it (its move included) and the error
    second = msgspec.json.encode(fake.requests[1].body).decode()
    assert "no such order" in second
    assert "bad" in second
    assert "next_data" in second
    assert replay(events, shop()).ok


async def test_a_bad_move_in_the_args_is_rejected_naming_next() -> None:
    wrong = Reply(
        calls=[("lookup", '{"order_id": "o1", "next": "WORK", "next_data": {"total": 1}}')]
    )
    bad_data = Reply(
        calls=[("lookup", '{"order_id": "o1", "next": "COMPLETED", "next_data": {"total": "x"}}')]
    )
    result, events, _ = await drive("chat", [wrong, bad_data, MOVE])
    assert result.outcome == "completed"
    rejected = [v for e in events if type(e).__name__ == "ProposalRejected" for v in e.violations]
    assert [(v.code, v.path) for v in rejected] == [
        ("illegal_transition", "next"),
        ("schema", "data.total"),
    ]
    assert [type(e).__name__ for e in events].count("IntentRecorded") == 1  # nothing ran before


def test_off_by_default_the_tools_are_as_before() -> None:
    spec = shop(moves=False)
    run = RunState("r-1", spec)
    run.state = "WORK"
    specs = tool_specs(RunView(run))
    lookup_spec = next(s for s in specs if s.name == "lookup")
    assert "next" not in lookup_spec.parameters["properties"]


def test_no_data_schema_offers_next_alone_and_a_clash_is_refused() -> None:
    run = RunState("r-1", shop(data=None))
    run.state = "WORK"
    params = next(s for s in tool_specs(RunView(run), strict=True) if s.name == "lookup").parameters
    assert set(params["properties"]) == {"order_id", "next"}

    class Clash(msgspec.Struct, forbid_unknown_fields=True):
        next: str

    async def clash(args: Clash, ctx: ToolContext) -> None:
        return None

    spec = Machine(
        "m",
        "A",
        {"A": Worker(next=["DONE"], tools=["clash"], call_and_move=True)},
        tools=[Tool("clash", clash, Clash)],
    )
    with pytest.raises(MachineDefinitionError, match="parameter named 'next'"):
        check_machine(spec, "transition", False)


def test_split_move_takes_the_move_out_of_the_args() -> None:
    raw = '{"tool":"lookup","args":{"order_id":"o1","next":"COMPLETED","next_data":{"total":4}}}'
    assert msgspec.json.decode(split_move(raw)) == {
        "tool": "lookup",
        "next": "COMPLETED",
        "data": {"total": 4},
        "args": {"order_id": "o1"},
    }
    null = '{"tool":"lookup","args":{"order_id":"o1","next":null,"next_data":null}}'
    assert msgspec.json.decode(split_move(null)) == {"tool": "lookup", "args": {"order_id": "o1"}}
    # a defect is left for the gate to name, in the model's own bytes
    twice = '{"tool":"lookup","args":{"order_id":"o1","next":"A","next":"B"}}'
    assert split_move(twice) == twice
    plain = '{"tool":"lookup","args":{"order_id":"o1"}}'
    assert split_move(plain) is plain


@pytest.mark.parametrize("form", ["in-args", "top-level"])
async def test_structured_output_takes_the_move_in_the_args_or_beside_them(form: str) -> None:
    """OpenAIChat(output="json_schema", strict=True): the proposal is the message content;
    the schema offers next and next_data in each tool's args, and a proposal with the move
    at the top level, as the prompt shows it, is taken as it is."""
    text = (
        '{"tool": "lookup", "args": {"order_id": "o1", "next": "COMPLETED", '
        '"next_data": {"total": 40}}}'
        if form == "in-args"
        else '{"tool": "lookup", "args": {"order_id": "o1"}, "next": "COMPLETED", '
        '"data": {"total": 40}}'
    )
    store = MemoryStore()
    async with open_fake_llm(scripted_brain([Reply(text=text, finish="stop")])) as fake:
        provider = OpenAIChat("m", base_url=fake.openai_base_url, output="json_schema", strict=True)
        async with provider, open_supervisor([shop()], store, provider=provider) as sup:
            with trio.fail_after(20):
                result = await (await sup.start_run("shop", run_id="r-1")).wait()
    assert (result.outcome, result.output) == ("completed", {"total": 40})
    assert len(fake.requests) == 1
    schema = fake.requests[0].body["response_format"]["json_schema"]["schema"]
    encoded = msgspec.json.encode(schema).decode()
    assert '"next_data"' in encoded
    assert "A tool call may also move on" in fake.requests[0].body["messages"][0]["content"]
