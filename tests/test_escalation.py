"""The escalation rule on its own (interlock.core._escalation): what a second resume or abort
of a run out of the queue gets, whoever sends it through whichever door (#32)."""

from __future__ import annotations

import pytest

from interlock import NotEscalated
from interlock.core._escalation import answer_again, resolution
from interlock.errors import EscalationResolved
from interlock.events import Escalated, Resumed, RunStarted

PAYLOAD = '{"tool": "charge", "args": {"cents": 5}}'
WHEN = 1796256000.0  # 2026-12-03 00:00:00 UTC


def journal(*answers: Resumed) -> list[object]:
    return [
        RunStarted(run_id="r", seq=1, ts=1.0, machine="m", state="PAY", inputs={}),
        Escalated(run_id="r", seq=2, ts=2.0, state="PAY", reason="consecutive_failures", detail=""),
        *answers,
    ]


def resumed(**fields: object) -> Resumed:
    values: dict[str, object] = {"run_id": "r", "seq": 3, "ts": WHEN, "by": "ada", "to": "PAY"}
    return Resumed(**{**values, **fields})  # type: ignore[arg-type]


def test_a_resume_with_the_same_payload_is_a_repeat_whoever_sends_it() -> None:
    events = journal(resumed(payload=PAYLOAD))
    done, message = answer_again("r", "running", "PAY", events, "resume", payload=PAYLOAD)
    assert (done.action, done.by, done.to, done.payload) == ("resume", "ada", "PAY", PAYLOAD)
    assert message == (
        "run 'r' was already resumed by ada at 2026-12-03 00:00:00 UTC in state 'PAY' with "
        f"the payload {PAYLOAD} (seq 3); it is running in state 'PAY' now"
    )
    answer_again("r", "running", "PAY", events, "resume", to="PAY", payload=PAYLOAD)


@pytest.mark.parametrize(
    ("to", "payload", "asked"),
    [
        (None, '{"next": "COMPLETED"}', "with another payload"),
        (None, None, "without a payload"),
        ("CHECK", PAYLOAD, "in state 'CHECK'"),
    ],
)
def test_a_resume_elsewhere_or_with_another_payload_is_refused(
    to: str | None, payload: str | None, asked: str
) -> None:
    events = journal(resumed(payload=PAYLOAD))
    with pytest.raises(EscalationResolved) as refused:
        answer_again("r", "running", "PAY", events, "resume", to=to, payload=payload)
    assert str(refused.value).startswith(f"cannot resume run 'r' {asked}: it was already resumed")
    assert refused.value.done.seq == 3


def test_the_last_escalation_is_the_one_answered() -> None:
    """A run resumed, escalated again and still waiting: no operator answered this one."""
    again = Escalated(run_id="r", seq=4, ts=4.0, state="PAY", reason="repeat", detail="")
    assert resolution(journal(resumed(), again)) is None
    assert resolution([*journal(resumed()), again, resumed(seq=5, to="FAILED")]).action == "abort"  # type: ignore[union-attr]


def test_a_run_no_operator_took_out_of_the_queue_is_not_escalated() -> None:
    with pytest.raises(
        NotEscalated, match=r"^run 'r' is not escalated; it is running in state 'PAY'$"
    ):
        answer_again("r", "running", "PAY", journal()[:1], "abort")
