"""Wire messages and journal events: round trips, complete unions, and golden bytes.

``tests/data/events.msgpack`` pins the on-disk encoding of journal events: it holds
``GOLDEN_EVENTS`` (one event of each kind, with fixed values) as a msgpack array of the
bytes ``encode_event`` produced. If a change to the event format is deliberate, regenerate
it and say so in the changelog, since stored journals change with it::

    PYTHONPATH=src python tests/test_messages.py --regenerate
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import ProtocolError
from interlock.core import _events, _messages
from interlock.events import (
    BreakerTripped,
    Completed,
    Escalated,
    Event,
    Failed,
    IntentRecorded,
    JournalEvent,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    TokenUsage,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
    Violation,
    decode_event,
    encode_event,
)
from interlock.messages import (
    Cancel,
    Escalate,
    Message,
    Propose,
    Report,
    Start,
    ToolCall,
    Verdict,
    decode_message,
    encode_message,
)

GOLDEN = Path(__file__).parent / "data" / "events.msgpack"

# -- messages ------------------------------------------------------------------------------

VIOLATION = Violation(
    "guard", "args.amount", "args.amount: 150.0 exceeds 100.0", "propose amount <= 100.0"
)
MESSAGES: dict[str, Any] = {
    "Start": Start(run_id="r-1", machine="refund", inputs={"order": "o1", "items": [1, 2]}),
    "Propose": Propose(
        run_id="r-1",
        seq=4,
        raw='{"tool": "refund", "args": {"amount": 150}}',
        source="model",
        model="gpt-test",
        prompt="state: WORK",
        usage=TokenUsage(120, 14),
        latency=0.25,
        error="",
    ),
    "Report": Report(
        run_id="r-1",
        seq=5,
        key="r-1:WORK:5",
        ok=False,
        result={"partial": [1.5, None, True]},
        error="TimeoutError: downstream did not answer",
        retryable=True,
        attempts=3,
        latency=1.5,
    ),
    "Reconciliation": _messages.Reconciliation(
        run_id="r-1", seq=6, key="r-1:WORK:5", applied=True, result={"sent": True}, latency=0.5
    ),
    "Cancel": Cancel(run_id="r-1", seq=6, reason="the customer withdrew"),
    "Escalate": Escalate(
        run_id="r-1", seq=6, reason="definition_changed", detail="the server changed a tool"
    ),
    "Resume": _messages.Resume(
        run_id="r-1",
        seq=9,
        by="alice",
        note="checked by hand",
        to="WORK",
        payload='{"next": "DONE"}',
    ),
    "Abort": _messages.Abort(run_id="r-1", seq=9, by="bob", note="fraud"),
    "Recover": _messages.Recover(run_id="r-1", seq=0),
    "Sync": _messages.Sync(run_id="r-1", seq=4),
    "Verdict": Verdict(
        run_id="r-1",
        seq=7,
        accepted=False,
        state="WORK",
        outcome="running",
        violations=(VIOLATION,),
        execute=ToolCall("refund", {"order_id": "o1", "amount": 100.0}, "r-1:WORK:7"),
        result={"refunded": 100.0},
    ),
}


def _concrete_subclasses(base: type) -> set[type]:
    found: set[type] = set()
    for cls in base.__subclasses__():
        found.add(cls)
        found |= _concrete_subclasses(cls)
    return found


def test_message_union_is_complete() -> None:
    assert _concrete_subclasses(_messages.Msg) == set(typing.get_args(Message))


def test_event_union_is_complete() -> None:
    assert _concrete_subclasses(_events.Event) == set(typing.get_args(JournalEvent))


def test_every_message_has_a_sample() -> None:
    assert set(MESSAGES) == {cls.__name__ for cls in typing.get_args(Message)}


@pytest.mark.parametrize("json", [False, True], ids=["msgpack", "json"])
@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_message_round_trip(name: str, json: bool) -> None:
    msg = MESSAGES[name]
    data = encode_message(msg, json=json)
    assert isinstance(data, bytes)
    assert decode_message(data, json=json) == msg


def test_messages_carry_their_tags() -> None:
    tags = {cls.__name__: cls.__struct_config__.tag for cls in typing.get_args(Message)}
    assert tags == {
        "Start": "start",
        "Propose": "propose",
        "Report": "report",
        "Reconciliation": "reconciliation",
        "Cancel": "cancel",
        "Escalate": "escalate",
        "Resume": "resume",
        "Abort": "abort",
        "Recover": "recover",
        "Sync": "sync",
        "Verdict": "verdict",
    }
    assert msgspec.json.decode(encode_message(MESSAGES["Cancel"], json=True))["kind"] == "cancel"


@pytest.mark.parametrize(
    ("data", "json", "message"),
    [
        pytest.param(
            b"\xc1",
            False,
            "undecodable message: MessagePack data is malformed: invalid opcode '\\xc1' (byte 0)",
            id="msgpack-garbage",
        ),
        pytest.param(
            b"garbage",
            True,
            "undecodable message: JSON is malformed: invalid character (byte 0)",
            id="json-garbage",
        ),
        pytest.param(
            b'{"kind": "propose", "run_id": "r-1"',
            True,
            "undecodable message: Input data was truncated",
            id="json-truncated",
        ),
        pytest.param(
            msgspec.msgpack.encode({"kind": "nope", "run_id": "r-1"}),
            False,
            "undecodable message: Invalid value 'nope' - at `$.kind`",
            id="unknown-kind",
        ),
        pytest.param(
            b'{"kind": "propose", "run_id": "r-1"}',
            True,
            "undecodable message: Object missing required field `raw`",
            id="missing-field",
        ),
        pytest.param(
            b'{"kind": "propose", "run_id": "r-1", "seq": "3", "raw": ""}',
            True,
            "undecodable message: Expected `int`, got `str` - at `$.seq`",
            id="wrong-type",
        ),
        pytest.param(
            b"[]", True, "undecodable message: Expected `object`, got `array`", id="not-an-object"
        ),
        pytest.param(
            encode_event(RunStarted(run_id="r-1", seq=1, ts=0.0, machine="m", state="WORK")),
            False,
            "undecodable message: Invalid value 'run_started' - at `$.kind`",
            id="an-event",
        ),
    ],
)
def test_decode_message_raises_protocol_error(data: bytes, json: bool, message: str) -> None:
    with pytest.raises(ProtocolError, match=f"^{re.escape(message)}$") as info:
        decode_message(data, json=json)
    assert isinstance(info.value.__cause__, msgspec.DecodeError)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64), json=st.booleans())
def test_decode_message_raises_only_protocol_error(data: bytes, json: bool) -> None:
    try:
        msg = decode_message(data, json=json)
    except ProtocolError:
        return
    assert isinstance(msg, typing.get_args(Message))


# -- events ---------------------------------------------------------------------------------

TS = 1_700_000_000.25
GOLDEN_EVENTS: list[Event] = [
    RunStarted(run_id="r-1", seq=1, ts=TS, machine="refund", state="WORK", inputs={"order": "o1"}),
    ModelCalled(
        run_id="r-1",
        seq=2,
        ts=TS + 1,
        state="WORK",
        model="gpt-test",
        prompt_hash="0123456789abcdef0123456789abcdef",
        prompt="state: WORK",
        raw='{"tool": "refund", "args": {"order_id": "o1", "amount": 150}}',
        usage=TokenUsage(120, 14),
        latency=0.5,
        error="",
    ),
    ProposalRejected(run_id="r-1", seq=3, ts=TS + 1, state="WORK", violations=(VIOLATION,)),
    StepProposed(
        run_id="r-1",
        seq=4,
        ts=TS + 2,
        state="WORK",
        raw='{"tool": "refund", "args": {"order_id": "o1", "amount": 100}}',
        source="operator",
        error="",
    ),
    IntentRecorded(
        run_id="r-1",
        seq=5,
        ts=TS + 2,
        state="WORK",
        tool="refund",
        args={"order_id": "o1", "amount": 100.0},
        key="r-1:WORK:5",
    ),
    ToolCommitted(
        run_id="r-1",
        seq=6,
        ts=TS + 3,
        tool="refund",
        key="r-1:WORK:5",
        result={"refunded": 100.0},
        attempts=2,
        latency=0.125,
        reused=False,
    ),
    ToolFailed(
        run_id="r-1",
        seq=7,
        ts=TS + 4,
        tool="notify",
        key="r-1:WORK:7",
        error="timed out after 5 s",
        retryable=True,
        attempts=3,
        latency=15.0,
    ),
    BreakerTripped(
        run_id="r-1",
        seq=8,
        ts=TS + 4,
        breaker="repeat",
        state="WORK",
        value=3.0,
        limit=3.0,
        detail="notify({}) proposed 3 times",
        tool="notify",
    ),
    Transitioned(
        run_id="r-1",
        seq=9,
        ts=TS + 4,
        src="WORK",
        dst="ESCALATE",
        delta={"why": "repeat"},
        reason="breaker",
    ),
    Escalated(
        run_id="r-1",
        seq=10,
        ts=TS + 4,
        state="WORK",
        reason="repeat",
        detail="notify({}) proposed 3 times",
    ),
    Resumed(
        run_id="r-1", seq=11, ts=TS + 60, by="alice", note="fixed by hand", to="WORK", payload=""
    ),
    Completed(run_id="r-1", seq=12, ts=TS + 61, state="COMPLETED", output={"answer": "refunded"}),
    Failed(run_id="r-2", seq=2, ts=TS + 62, state="FAILED", reason="aborted by bob"),
]
#: What journals written before prompt deltas hold: every event above, and each
#: ``model_called`` with its prompt whole (the delta fields absent, so at their defaults).
GOLDEN_EVENTS_0_1 = list(GOLDEN_EVENTS)
# The first model call again, later in the run, with its prompt as a delta against it.
GOLDEN_EVENTS.append(
    msgspec.structs.replace(
        GOLDEN_EVENTS[1],
        seq=13,
        ts=TS + 62,
        prompt_hash="fedcba9876543210fedcba9876543210",
        prompt="\n  [12] resumed",
        raw='{"next": "COMPLETED"}',
        usage=TokenUsage(130, 6),
        latency=0.25,
        prompt_base=2,
        prompt_prefix=11,
    )
)
GOLDEN_0_1 = GOLDEN.with_name("events-0.1.0.msgpack")
#: What journals written before #14 hold: the events above, with none of its fields set.
GOLDEN_EVENTS_0_2 = list(GOLDEN_EVENTS)
GOLDEN_0_2 = GOLDEN.with_name("events-0.2.0.msgpack")
#: The kinds #14 added, and events of each (and of the fields it added to older kinds).
NEW_IN_0_3 = {"ProviderFailed", "ToolInDoubt", "Reconciled"}
GOLDEN_EVENTS += [
    ProviderFailed(
        run_id="r-3",
        seq=2,
        ts=TS + 70,
        state="WORK",
        model="gpt-test",
        error="provider raised ProviderError: 429 too many requests",
        attempt=2,
        retryable=True,
        retry_after=4.0,
        retry_in=4.0,
        latency=0.75,
    ),
    msgspec.structs.replace(
        GOLDEN_EVENTS[1],
        run_id="r-3",
        seq=3,
        raw="bad \\udcff byte",
        defect="the proposal holds U+DCFF at character 4 (byte offset 4): the invalid UTF-8 "
        "byte 0xFF, decoded with surrogateescape, which UTF-8 cannot encode",
    ),
    ToolInDoubt(
        run_id="r-3",
        seq=5,
        ts=TS + 71,
        tool="notify",
        key="r-3:WORK:4",
        error="timed out after 5 s",
        attempts=1,
        latency=5.0,
    ),
    Reconciled(run_id="r-3", seq=6, ts=TS + 72, tool="notify", key="r-3:WORK:4", applied=True),
    ToolCommitted(
        run_id="r-3",
        seq=7,
        ts=TS + 72,
        tool="notify",
        key="r-3:WORK:4",
        result={"sent": True},
        attempts=0,
        reconciled=True,
    ),
    Transitioned(
        run_id="r-3", seq=9, ts=TS + 73, src="WORK", dst="COMPLETED", delta_in_proposal=True
    ),
    Completed(run_id="r-3", seq=10, ts=TS + 73, state="COMPLETED", output_in_delta=True),
]


def golden_bytes() -> bytes:
    return msgspec.msgpack.encode([msgspec.Raw(encode_event(event)) for event in GOLDEN_EVENTS])


def test_golden_events_cover_every_kind() -> None:
    kinds = {type(e).__name__ for e in GOLDEN_EVENTS}
    assert kinds == {cls.__name__ for cls in typing.get_args(JournalEvent)}
    assert {type(e).__name__ for e in GOLDEN_EVENTS_0_1} == kinds - NEW_IN_0_3


def test_journals_from_before_provider_failures_still_decode() -> None:
    """Events written before the fields and kinds of #14 read as they did."""
    payloads = msgspec.msgpack.decode(GOLDEN_0_2.read_bytes(), type=list[msgspec.Raw])
    assert [decode_event(bytes(payload)) for payload in payloads] == GOLDEN_EVENTS_0_2


def test_events_carry_their_tags() -> None:
    tags = {cls.__name__: cls.__struct_config__.tag for cls in typing.get_args(JournalEvent)}
    assert tags == {
        "RunStarted": "run_started",
        "ModelCalled": "model_called",
        "StepProposed": "step_proposed",
        "ProposalRejected": "proposal_rejected",
        "Transitioned": "transitioned",
        "IntentRecorded": "intent_recorded",
        "ToolCommitted": "tool_committed",
        "ToolFailed": "tool_failed",
        "ToolInDoubt": "tool_in_doubt",
        "Reconciled": "reconciled",
        "ProviderFailed": "provider_failed",
        "BreakerTripped": "breaker_tripped",
        "Escalated": "escalated",
        "Resumed": "resumed",
        "Completed": "completed",
        "Failed": "failed",
    }


def test_golden_bytes_encode() -> None:
    assert golden_bytes() == GOLDEN.read_bytes()


def test_golden_bytes_decode() -> None:
    payloads = msgspec.msgpack.decode(GOLDEN.read_bytes(), type=list[msgspec.Raw])
    assert [decode_event(bytes(payload)) for payload in payloads] == GOLDEN_EVENTS


def test_journals_from_before_prompt_deltas_still_decode() -> None:
    payloads = msgspec.msgpack.decode(GOLDEN_0_1.read_bytes(), type=list[msgspec.Raw])
    events = [decode_event(bytes(payload)) for payload in payloads]
    assert events == GOLDEN_EVENTS_0_1
    called = events[1]
    assert isinstance(called, ModelCalled)
    assert (called.prompt_base, called.prompt_prefix, called.prompt_suffix) == (0, 0, 0)


@pytest.mark.parametrize("event", GOLDEN_EVENTS, ids=lambda e: type(e).__name__)
def test_event_round_trip(event: Event) -> None:
    assert decode_event(encode_event(event)) == event


def test_decode_event_rejects_a_message() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"^Invalid value 'cancel' - at `\$\.kind`$"):
        decode_event(encode_message(MESSAGES["Cancel"]))


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: PYTHONPATH=src python {sys.argv[0]} --regenerate")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_bytes(golden_bytes())
    print(f"wrote {len(GOLDEN_EVENTS)} events ({GOLDEN.stat().st_size} bytes) to {GOLDEN}")


def test_an_in_doubt_failure_of_an_old_journal_reads_as_the_structured_field() -> None:
    """Before ``ToolFailed.in_doubt``, the decider marked an escalation in doubt only in the
    text (the other fields at their defaults); such an event decodes with the field set
    and the text it wrapped. A failure that merely reads so is left alone: one the decider
    writes says ``in_doubt=False``, and an actor's report has attempts and a latency."""
    old = {"kind": "tool_failed", "run_id": "r-1", "seq": 7, "ts": TS, "tool": "mail", "key": "k"}
    old_fields = {"retryable": False, "attempts": 1, "latency": 0.0}
    escalated = decode_event(
        msgspec.msgpack.encode({**old, **old_fields, "error": "in doubt: boom"})
    )
    assert isinstance(escalated, ToolFailed)
    assert (escalated.error, escalated.in_doubt) == ("boom", True)
    crash = decode_event(msgspec.msgpack.encode({**old, "error": "in doubt after a crash"}))
    assert isinstance(crash, ToolFailed)
    assert (crash.error, crash.in_doubt) == ("in doubt after a crash", True)
    reported = {**old, "error": "in doubt: boom", "attempts": 2, "latency": 0.5}
    plain = decode_event(msgspec.msgpack.encode(reported))
    assert isinstance(plain, ToolFailed)
    assert (plain.error, plain.in_doubt) == ("in doubt: boom", msgspec.UNSET)
    new = ToolFailed(
        run_id="r-1", seq=7, ts=TS, tool="mail", key="k", error="in doubt: x", in_doubt=False
    )
    assert decode_event(encode_event(new)) == new
