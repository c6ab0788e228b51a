"""Reading a response into a proposal: exact, never repaired (no network here; the HTTP
path is tests/test_providers_http.py). Bodies are written in each API's documented shape."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import (
    BreakerPolicy,
    Machine,
    MachineDefinitionError,
    ProviderError,
    Tool,
    ToolContext,
    Worker,
)
from interlock.core._wire import EXCERPT_LIMIT, excerpt, parse_raw, to_raw
from interlock.providers import AnthropicMessages, OpenAIChat, OpenAIResponses

URL = "http://127.0.0.1:9/v1"


def chat(profile: str = "openai", **options: Any) -> OpenAIChat:
    return OpenAIChat("m", base_url=URL, profile=profile, **options)


def completion(message: dict[str, Any], finish: str | None = "tool_calls", **usage: Any) -> bytes:
    return msgspec.json.encode(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
            ],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20, **usage},
        }
    )


def call(name: str, arguments: Any, cid: str = "call_1") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


ARGS = '{"order_id":  "o1" }'  # odd spacing: it must reach the gate unchanged


def test_a_tool_call_reaches_the_gate_byte_for_byte() -> None:
    raw, usage, violation, extra = chat().read(
        completion(
            {"content": None, "tool_calls": [call("lookup", ARGS)]},
            prompt_tokens_details={"cached_tokens": 64},
            completion_tokens_details={"reasoning_tokens": 5},
        )
    )
    assert raw == '{"tool":"lookup","args":{"order_id":  "o1" }}'
    assert violation is None
    assert extra == ()
    assert (usage.prompt, usage.completion, usage.cached, usage.reasoning) == (100, 20, 64, 5)


def test_a_transition_call_is_the_move_itself() -> None:
    raw, _, violation, _ = chat().read(
        completion({"tool_calls": [call("transition", '{"next": "DONE", "data": {"a": 1}}')]})
    )
    assert (raw, violation) == ('{"next": "DONE", "data": {"a": 1}}', None)
    # a transition whose arguments name a tool would run it without calling it: refused
    raw, _, violation, _ = chat().read(
        completion({"tool_calls": [call("transition", '{"tool": "refund", "args": {}}')]})
    )
    assert raw == ""
    assert violation is not None
    assert violation.code == "envelope"
    assert "name a tool" in violation.message


def test_duplicate_keys_are_left_for_the_gate_to_refuse() -> None:
    raw, _, violation, _ = chat().read(
        completion({"tool_calls": [call("lookup", '{"order_id": "a", "order_id": "b"}')]})
    )
    assert violation is None
    assert raw.count('"order_id"') == 2


def test_extra_calls_are_kept_and_only_the_first_is_proposed() -> None:
    raw, _, violation, extra = chat().read(
        completion({"tool_calls": [call("a", "{}"), call("b", '{"x":1}', "call_2")]})
    )
    assert raw == '{"tool":"a","args":{}}'
    assert violation is None
    assert extra == (("b", '{"x":1}'),)


@pytest.mark.parametrize(
    ("message", "finish", "words"),
    [
        ({"content": None, "tool_calls": []}, "tool_calls", "finish_reason is 'tool_calls' but"),
        ({"content": None}, "tool_calls", "finish_reason is 'tool_calls' but"),
        ({"content": "I will look it up."}, "stop", "text instead of a tool call: I will look"),
        (
            {"content": "sure", "tool_calls": [call("a", "{}")]},
            "tool_calls",
            "text and a tool call",
        ),
        ({"content": None, "refusal": "I can't help with that."}, "stop", "refused: I can't"),
        ({"tool_calls": [call("a", '{"x": "abc')]}, "length", "cut at the output limit"),
        ({"content": ""}, "stop", "the reply is empty"),
        ({"tool_calls": [call("a", "{}")]}, "stop", "finish_reason is 'stop'"),
        (
            {"tool_calls": [call("a", {"x": 1})]},
            "tool_calls",
            "arguments as an object, not the JSON string",
        ),
        (
            {"content": '<tool_call>{"name": "a", "arguments": {}}</tool_call>'},
            "stop",
            "text instead",
        ),
    ],
)
def test_envelope_faults_are_rejections_in_the_apis_words(
    message: dict[str, Any], finish: str, words: str
) -> None:
    raw, _, violation, _ = chat().read(completion(message, finish))
    assert raw == ""
    assert violation is not None
    assert violation.code == "envelope"
    assert words in violation.message
    assert violation.hint


def test_profiles_name_the_quirks_they_accept() -> None:
    generic = chat("generic")
    # arguments sent as an object: taken verbatim from the body, not re-serialised
    body = completion({"tool_calls": [call("a", "__ARGS__")]}).replace(b'"__ARGS__"', b'{"x" : 1}')
    assert generic.read(body)[:2][0] == '{"tool":"a","args":{"x" : 1}}'
    # calls with finish_reason "stop"
    assert generic.read(completion({"tool_calls": [call("a", "{}")]}, "stop"))[2] is None
    # a call written as markup in content
    markup = '<tool_call>{"name": "a", "arguments": {"k": 2}}</tool_call>'
    raw, _, violation, _ = generic.read(completion({"content": markup}, "stop"))
    assert (raw, violation) == ('{"tool":"a","args":{"k": 2}}', None)
    # and none of them makes an empty tool_calls a call
    assert generic.read(completion({"tool_calls": []}))[2] is not None
    with pytest.raises(Exception, match="unknown profile 'nope'; use one of openai, vllm"):
        chat("nope")


def test_a_body_that_is_not_a_completion_is_a_provider_failure_not_a_crash() -> None:
    with pytest.raises(ProviderError, match=r"not a chat completions response .*began '<html>"):
        chat().read(b"<html>502 Bad Gateway</html>")


def test_responses_api_function_calls() -> None:
    provider = OpenAIResponses("m", base_url=URL)
    body = msgspec.json.encode(
        {
            "id": "resp_1",
            "object": "response",
            "status": "completed",
            "output": [
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "lookup",
                    "arguments": ARGS,
                    "status": "completed",
                },
            ],
            "usage": {
                "input_tokens": 50,
                "output_tokens": 9,
                "input_tokens_details": {"cached_tokens": 10},
                "output_tokens_details": {"reasoning_tokens": 4},
            },
        }
    )
    raw, usage, violation, _ = provider.read(body)
    assert (raw, violation) == ('{"tool":"lookup","args":{"order_id":  "o1" }}', None)
    assert (usage.prompt, usage.completion, usage.cached, usage.reasoning) == (50, 9, 10, 4)
    incomplete = msgspec.json.encode(
        {
            "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [],
        }
    )
    violation = provider.read(incomplete)[2]
    assert violation is not None
    assert "incomplete (max_output_tokens)" in violation.message


def test_anthropic_input_is_taken_as_its_raw_json() -> None:
    provider = AnthropicMessages("claude", base_url="http://127.0.0.1:9")
    body = (
        b'{"id":"msg_1","type":"message","role":"assistant","model":"claude","content":['
        b'{"type":"tool_use","id":"toolu_1","name":"lookup","input":{"order_id" :"o1","n":1.50}}],'
        b'"stop_reason":"tool_use","usage":{"input_tokens":10,"output_tokens":3,'
        b'"cache_read_input_tokens":80,"cache_creation_input_tokens":5}}'
    )
    raw, usage, violation, _ = provider.read(body)
    assert raw == '{"tool":"lookup","args":{"order_id" :"o1","n":1.50}}'  # 1.50, not 1.5
    assert violation is None
    assert (usage.prompt, usage.completion, usage.cached) == (95, 3, 80)
    cut = body.replace(b'"tool_use","usage"', b'"max_tokens","usage"')
    violation = provider.read(cut)[2]
    assert violation is not None
    assert "stop_reason 'max_tokens'" in violation.message
    empty = b'{"content":[],"stop_reason":"tool_use"}'
    violation = provider.read(empty)[2]
    assert violation is not None
    assert "holds no tool_use block" in violation.message


def test_a_call_and_its_proposal_round_trip() -> None:
    for name, arguments in [("lookup", ARGS), ('we"ird', "{}"), ("transition", '{"next": "A"}')]:
        raw, violation = to_raw(name, arguments)
        assert violation is None
        assert parse_raw(raw, 7) == ("call_7", name, arguments)


def test_an_api_key_is_required_only_for_the_vendors_own_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(Exception, match=r"needs an API key .*pass api_key= or set OPENAI_API_KEY"):
        OpenAIChat("gpt-4o")
    OpenAIChat("llama3", base_url="http://127.0.0.1:11434/v1")  # a local server needs none
    provider = OpenAIChat("gpt-4o", api_key="sk-secret-123")
    assert "sk-secret" not in repr(provider)
    assert "sk-secret" not in repr(vars(provider).get("profile"))


class Args(msgspec.Struct):
    order_id: str
    note: str = ""


async def noop(args: Args, ctx: ToolContext) -> None:
    return None


def test_strict_mode_refuses_a_schema_it_cannot_take_when_the_machine_is_registered() -> None:
    from interlock import Supervisor
    from interlock.stores import MemoryStore

    machine = Machine(
        "m",
        initial="W",
        states={"W": Worker(next=["COMPLETED"], tools=["t"])},
        tools=[Tool("t", noop, Args)],
    )
    with pytest.raises(
        MachineDefinitionError,
        match=r"tool 't' of machine 'm' cannot be strict: .* optional properties \['note'\]",
    ):
        Supervisor([machine], MemoryStore(), provider=OpenAIChat("m", base_url=URL, strict=True))
    Supervisor([machine], MemoryStore(), provider=OpenAIChat("m", base_url=URL))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_arbitrary_bodies_never_crash_a_provider(body: bytes) -> None:
    for provider in (
        chat(),
        chat("generic"),
        OpenAIResponses("m", base_url=URL),
        AnthropicMessages("m", base_url="http://127.0.0.1:9"),
    ):
        try:
            raw, _usage, violation, _extra = provider.read(body)
        except ProviderError:
            continue
        assert isinstance(raw, str)
        assert violation is None or violation.code == "envelope"


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(JSONISH)
def test_arbitrary_json_never_crashes_a_provider(value: Any) -> None:
    body = msgspec.json.encode(value)
    for wrap in (
        lambda v: v,
        lambda v: {"choices": [{"message": v}]},
        lambda v: {"content": [v]},
        lambda v: {"output": [v]},
    ):
        data = msgspec.json.encode(wrap(value)) if wrap is not None else body
        for provider in (
            chat("generic"),
            OpenAIResponses("m", base_url=URL),
            AnthropicMessages("m", base_url="http://x"),
        ):
            with contextlib.suppress(ProviderError):
                provider.read(data)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from(["bad", "bad", "other", "lookup", "move", "text"]), min_size=1, max_size=14
    )
)
def test_the_conversation_kept_on_a_view_is_the_one_made_fresh(script: list[str]) -> None:
    """Whatever the history (repeated rejections compacting, commits, moves, replies with
    no call), the conversation a view keeps from call to call equals one made from
    scratch, and so does every request body."""
    from interlock.core._breakers import CircuitBoard
    from interlock.core._decider import decide, start
    from interlock.core._view import RunView
    from interlock.messages import Propose, Report, Start

    spec = Machine(
        "m",
        initial="W",
        states={"W": Worker(next=["W", "COMPLETED"], tools=["t"])},
        tools=[Tool("t", noop, Args)],
        breakers=BreakerPolicy(consecutive_failures=50, repeats=50),
    )
    events: list[Any] = []
    run, _ = start(spec, Start(run_id="r", machine="m"), 0.0, events)
    circuits = CircuitBoard()
    kept = RunView(run)
    provider = chat()
    raws = {
        "bad": ('{"tool":"t","args":{}}', None),
        "other": ('{"tool":"nope","args":{}}', None),
        "lookup": ('{"tool":"t","args":{"order_id":"o"}}', None),
        "move": ('{"next":"W"}', None),
        "text": ("", _envelope()),
    }
    for step in script:
        if run.terminal:
            break
        raw, violation = raws[step]
        msg = Propose(
            run_id="r",
            seq=run.seq,
            raw=raw,
            model="m",
            prompt="p",
            response="{}",
            envelope=violation,
        )
        verdict = decide(run, msg, 1.0, circuits, events)
        if verdict.execute is not None:
            decide(
                run,
                Report(run_id="r", seq=run.seq, key=verdict.execute.key, ok=True, result={"n": 1}),
                1.0,
                circuits,
                events,
            )
        specs = __import__("interlock.core._wire", fromlist=["tool_specs"]).tool_specs(kept)
        assert provider.request_body(kept, specs) == provider.request_body(RunView(run), specs)


def _envelope() -> Any:
    from interlock.core._wire import envelope

    return envelope("the model answered with text instead of a tool call: hi", "call a tool")


def _parse_raw_by_decoding(raw: str, seq: int) -> tuple[str, str, str] | None:
    """parse_raw as it was before its shortcut for plain names: the name always decoded."""
    from interlock.core._wire import _moving_call

    if not raw:
        return None
    call_id = f"call_{seq}"
    if raw.startswith('{"tool":'):
        at = raw.find(',"args":')
        if at > 0:
            try:
                name = msgspec.json.decode(raw[8:at])
            except msgspec.DecodeError:
                return _moving_call(call_id, raw)
            if isinstance(name, str):
                return (call_id, name, raw[at + 8 : -1])
        return None
    return (call_id, "transition", raw)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(max_size=12),
        st.sampled_from(['"a', 'a"', '"', '""', '"a"b"', '"a\\"b"', '"\\u0041"', ' "a"', '"\x01"']),
    ),
    st.sampled_from(["{}", '{"a":1}', "", "{"]),
)
def test_a_calls_name_is_read_as_decoding_it_would(name: str, args: str) -> None:
    quoted = msgspec.json.encode(name).decode() if not name.startswith(('"', " ")) else name
    for raw in (f'{{"tool":{quoted},"args":{args}}}', f'{{"tool":{name},"args":{args}}}'):
        assert parse_raw(raw, 3) == _parse_raw_by_decoding(raw, 3)


def test_a_body_follows_the_providers_settings_when_they_change() -> None:
    """The bytes after the conversation are kept per state; changing a setting the body
    shows (model, output limit, temperature, streaming) is seen by the next call."""
    from interlock.core._decider import start
    from interlock.core._view import RunView
    from interlock.core._wire import tool_specs
    from interlock.messages import Start

    spec = Machine(
        "m",
        initial="W",
        states={"W": Worker(next=["COMPLETED"], tools=["t"])},
        tools=[Tool("t", noop, Args)],
    )
    run, _ = start(spec, Start(run_id="r", machine="m"), 0.0, [])
    for make in (
        chat,
        lambda: OpenAIResponses("m", base_url=URL),
        lambda: AnthropicMessages("m", base_url="http://x"),
    ):
        provider = make()
        view = RunView(run)
        specs = tool_specs(view)
        provider.request_body(view, specs)
        changes = {"model": "other", "max_tokens": 77, "temperature": 0.5, "stream": True}
        for name, value in changes.items():
            setattr(provider, name, value)
            fresh = make()
            for done, set_value in list(changes.items())[: list(changes).index(name) + 1]:
                setattr(fresh, done, set_value)
            assert provider.request_body(view, specs) == fresh.request_body(RunView(run), specs)


def test_an_excerpt_is_bounded_json_and_cuts_no_character() -> None:
    """What goes back in place of a long rejected call: a JSON object (every API takes
    it as arguments) of a bounded size, the same for the same arguments (#32)."""
    short = '{"order_id": "o1", "qty": NaN}'
    assert excerpt(short) is short  # short enough: the model's own text
    long = '{"note": "' + "é" * 3000 + '", "qty": NaN}'
    shown = excerpt(long)
    assert shown == excerpt(long)
    assert len(shown.encode()) < 2 * EXCERPT_LIMIT
    fields = msgspec.json.decode(shown)
    assert fields["size_bytes"] == len(long.encode())
    assert fields["start"].startswith('{"note": "éé')  # whole characters only
    assert fields["end"].endswith('éé", "qty": NaN}')
    assert long.encode()[fields["defect_at_byte"] :].startswith(b"NaN")
    assert fields["near_defect"].endswith('é", "qty": NaN}')
    valid = '{"note": "' + "x" * 3000 + '"}'
    assert "defect_at_byte" not in msgspec.json.decode(excerpt(valid))
