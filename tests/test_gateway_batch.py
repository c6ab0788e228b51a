"""The passes over a gateway batch: the service's intake (``_take_proposals``) and
settling (``_settle_from``), and the channel's (bodies decoded, answers framed, runs
released, frames taken). Each is one Python loop, the same in both modes."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import Go, Machine, Step, Worker
from interlock.core._messages import ToolCall, Verdict
from interlock.core._view import RunState
from interlock.gateway import _channel, _service
from interlock.protocol import Problem, ProposalIn, VerdictOut

MACHINE = Machine(
    "m1",
    "A",
    {
        "A": Worker(next=["B", "CHECK", "DONE"], tools=[]),
        "B": Worker(next=["A", "DONE"], tools=[]),
        "CHECK": Step(lambda view: Go("DONE", {}), next=["DONE"]),
    },
)
PROPOSALS = ['{"next":"B"}', '{"next":"A"}']


def make_run(run_id: str, seq: int, state: str, *, closed: bool = False) -> Any:
    run = RunState(run_id, MACHINE)
    run.seq, run.external, run.state, run.closed = seq, True, state, closed
    return run


def answer_view(answer: Any) -> Any:
    if answer is None:
        return None
    return (answer.seq, answer.proposal, answer.settled, answer.verdict, answer.error)


def test_the_intake_decides_a_runs_second_proposal_after_its_first() -> None:
    """A run named twice in a batch: the first group is decided before the second is
    taken; a run not live here is left for later; a refused proposal gets its problem."""
    runs = {run_id: make_run(run_id, 1, "A") for run_id in ("r0", "r1", "r5")}
    bodies = [
        ("r0", ProposalIn(proposal=PROPOSALS[0], expected_seq=1)),
        ("r1", ProposalIn(proposal=PROPOSALS[0])),
        ("r0", ProposalIn(proposal=PROPOSALS[1])),
        ("r9", ProposalIn(proposal=PROPOSALS[1])),
        ("r5", ProposalIn(proposal=PROPOSALS[1])),
    ]
    groups: list[list[str]] = []
    refusals: list[tuple[int, str, str]] = []
    verdicts: list[Any] = [None] * len(bodies)
    later: list[int] = []
    decided: list[Any] = []
    answers: OrderedDict[str, Any] = OrderedDict()

    def submit(msgs: list[Any]) -> list[Any]:
        groups.append([m.run_id for m in msgs])
        return [
            ValueError(f"refused {m.run_id}")
            if m.run_id == "r5"
            else Verdict(run_id=m.run_id, seq=2, accepted=True, state="B", outcome="running")
            for m in msgs
        ]

    def refused(taken: list[Any], at: int, error: Exception, verdicts_: list[Any]) -> None:
        index, run_id, _, _ = taken[at]
        refusals.append((index, run_id, str(error)))
        verdicts_[index] = "refused"

    _service._take_proposals(
        runs.get,
        answers,
        [run_id for run_id, _ in bodies],
        [body for _, body in bodies],
        None,
        submit,
        refused,
        verdicts,
        later,
        decided,
    )
    assert groups == [["r0", "r1"], ["r0", "r5"]]
    assert [entry[0] for entry in decided] == [0, 1, 2]
    assert later == [3]  # not live here
    assert refusals == [(4, "r5", "refused r5")]
    assert verdicts[4] == "refused"
    assert [(run_id, answer_view(a)) for run_id, a in answers.items()] == [
        ("r0", (1, PROPOSALS[0], False, None, None))
    ]


def test_settling_stops_at_a_run_that_reached_a_step_state() -> None:
    runs = {
        "r0": make_run("r0", 1, "CHECK"),
        "r1": make_run("r1", 1, "DONE", closed=True),
        "r2": make_run("r2", 1, "B"),
    }
    entries = [("r2", True), ("r0", True), ("r1", False)]
    decided = []
    answers = []
    for index, (run_id, waits) in enumerate(entries):
        verdict = Verdict(run_id=run_id, seq=index, accepted=True, state="B", outcome="running")
        answer = _service._Answer(index, "p") if waits else None
        answers.append(answer)
        decided.append((index, verdict, answer, index - 1))
    verdicts: list[Any] = [None] * len(entries)
    settled: list[str] = []
    steps: dict[str, frozenset[str]] = {}

    def settle_run(run_id: str) -> None:
        settled.append(run_id)
        runs.pop(run_id, None)

    def steps_of(machine: Machine) -> frozenset[str]:
        steps[machine.name] = frozenset({"CHECK"})
        return steps[machine.name]

    reconciling: set[tuple[str, str]] = set()
    at = _service._settle_from(
        decided, 0, verdicts, runs.get, settle_run, steps, steps_of, reconciling
    )
    assert at == 1  # r0 is in its step state: the caller runs its steps
    assert verdicts[0].state == "B"
    assert verdicts[1] is None
    assert answers[0].settled
    assert not answers[1].settled
    at = _service._settle_from(
        decided, at + 1, verdicts, runs.get, settle_run, steps, steps_of, reconciling
    )
    assert at == len(decided)
    assert settled == ["r1"]  # r1 ended: it leaves the registry
    assert verdicts[2] is not None


def test_settling_notes_the_calls_to_reconcile() -> None:
    call = ToolCall("lookup", {"order_id": "o"}, "r2:A:0")
    verdict = Verdict(
        run_id="r2", seq=2, accepted=False, state="A", outcome="running", reconcile=call
    )
    verdicts: list[Any] = [None]
    reconciling: set[tuple[str, str]] = set()
    at = _service._settle_from(
        [(0, verdict, None, 1)],
        0,
        verdicts,
        {"r2": make_run("r2", 2, "A")}.get,
        lambda run_id: None,
        {},
        lambda machine: frozenset(),
        reconciling,
    )
    assert at == 1
    assert reconciling == {("r2", "r2:A:0")}
    assert verdicts[0].reconcile.key == "r2:A:0"


# -- the channel's passes over a batch ------------------------------------------------------


def framer(out: bytearray) -> Any:
    """What _Connection._put does: one answer framed into ``out``."""

    def put(answer: Any) -> None:
        start = len(out)
        out.extend(bytes(4))
        _channel._ENCODE_INTO(answer, out, -1)
        _channel.HEADER.pack_into(out, start, len(out) - start - 4)

    return put


verdicts_out = st.builds(
    VerdictOut,
    run_id=st.text(max_size=40),
    accepted=st.booleans(),
    outcome=st.sampled_from(["running", "completed", ""]),
    state=st.text(max_size=20),
    seq=st.integers(-1, 2**40),
    problem=st.one_of(
        st.none(),
        st.builds(
            Problem,
            type=st.just("t"),
            title=st.just("T"),
            status=st.just(409),
            detail=st.text(max_size=20),
        ),
    ),
)


@settings(max_examples=100, deadline=None)
@given(
    answers=st.lists(st.tuples(st.integers(0, 2**63 - 1), verdicts_out), max_size=8),
    before=st.binary(max_size=20),
)
def test_framing_writes_each_answer_after_what_the_buffer_held(
    answers: list[tuple[int, VerdictOut]], before: bytes
) -> None:
    requests = [_channel.ChannelRequest(id=i, op="propose", run_id="r") for i, _ in answers]
    out = bytearray(before)
    _channel._frame_verdicts(out, requests, [v for _, v in answers], framer(out))
    assert bytes(out[: len(before)]) == before
    payloads, pos = [], len(before)
    while pos < len(out):
        (size,) = _channel.HEADER.unpack_from(out, pos)
        payloads.append(msgspec.msgpack.decode(out[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    assert [p["id"] for p in payloads] == [i for i, _ in answers]
    for payload, (_, verdict) in zip(payloads, answers, strict=True):
        if verdict.problem is not None:
            assert payload["problem"]["detail"] == verdict.problem.detail
            assert "body" not in payload
        else:
            assert payload["body"]["run_id"] == verdict.run_id


def test_the_passes_take_and_release_a_batch() -> None:
    good = msgspec.msgpack.encode({"proposal": '{"next":"B"}', "expected_seq": 3})
    requests = [
        _channel.ChannelRequest(id=1, op="propose", run_id="a", body=msgspec.Raw(good)),
        _channel.ChannelRequest(id=2, op="propose", run_id="b", body=msgspec.Raw(b"\x01")),
        _channel.ChannelRequest(id=3, op="propose", run_id="c", body=msgspec.Raw(b"\xc1")),
        _channel.ChannelRequest(id=4, op="propose", run_id="d", body=msgspec.Raw(good)),
    ]
    taken: list[Any] = []
    run_ids: list[str] = []
    bodies: list[Any] = []
    refused: list[Any] = []
    _channel._take_bodies(
        requests,
        _channel._DECODE_PROPOSAL,
        lambda request, exc: refused.append(request.id),
        taken,
        run_ids,
        bodies,
    )
    assert [r.id for r in taken] == [1, 4]
    assert run_ids == ["a", "d"]
    assert [b.expected_seq for b in bodies] == [3, 3]
    assert refused == [2, 3]
    runs: dict[str, Any] = {
        "a": deque(),
        "b": deque([requests[0]]),
        "c": deque(),
        "d": deque(["x"]),
    }
    scheduled: list[str] = []
    _channel._release_runs(requests, runs, scheduled.append)
    assert sorted(runs) == ["b", "d"]  # idle again: a and c
    assert scheduled == ["b", "d"]  # requests read meanwhile: they go on


def test_the_reader_takes_whole_frames_up_to_its_limits() -> None:
    class Conn:
        max_frame = 64
        max_in_flight = 2
        in_flight = 0
        principal = None  # no hello yet: every frame goes to take
        rate_limiter = None

    conn = Conn()
    taken: list[bytes] = []

    def take(body: bytes, nursery: Any) -> None:
        taken.append(body)
        conn.in_flight += 1

    def frame(body: bytes) -> bytes:
        return _channel.HEADER.pack(len(body)) + body

    data = frame(b"one") + frame(b"two") + frame(b"three") + frame(b"fo")[:4]
    pos, status, _ = _channel._take_frames(conn, data, 0, take, None)  # type: ignore[arg-type]
    assert (status, taken) == (_channel._FULL, [b"one", b"two"])
    conn.in_flight = 0
    pos, status, _ = _channel._take_frames(conn, data, pos, take, None)  # type: ignore[arg-type]
    assert (status, taken[-1]) == (_channel._DONE, b"three")
    assert pos == len(data) - 4  # the frame cut short waits for the rest
    bad = _channel.HEADER.pack(65) + bytes(65)
    assert _channel._take_frames(conn, bad, 0, take, None) == (0, _channel._BAD_SIZE, 65)  # type: ignore[arg-type]
    empty = _channel.HEADER.pack(0)
    assert _channel._take_frames(conn, empty, 0, take, None) == (0, _channel._BAD_SIZE, 0)  # type: ignore[arg-type]


def test_the_reader_takes_a_proposal_itself_once_the_connection_said_hello() -> None:
    class Conn:
        max_frame = 1024
        max_in_flight = 10
        in_flight = 0
        principal = object()
        rate_limiter = None

        def __init__(self) -> None:
            self.runs: dict[str, Any] = {"busy": deque()}
            self.batch: list[Any] = []

    conn = Conn()
    taken: list[tuple[bytes, Any]] = []

    def take(body: bytes, nursery: Any, request: Any = None) -> None:
        taken.append((body, request))
        conn.in_flight += 1

    def frame(**request: Any) -> bytes:
        body = msgspec.msgpack.encode(request)
        return _channel.HEADER.pack(len(body)) + body

    data = (
        frame(id=1, op="propose", run_id="a", body={})
        + frame(id=2, op="propose", run_id="busy", body={})
        + frame(id=3, op="get_run", run_id="a")
        + _channel.HEADER.pack(1)
        + b"\xc1"  # not msgpack
    )
    pos, status, _ = _channel._take_frames(conn, data, 0, take, None)  # type: ignore[arg-type]
    assert (pos, status) == (len(data), _channel._DONE)
    assert [r.id for r in conn.batch] == [1]  # a run's first proposal: the batch
    assert [r.id for r in conn.runs["busy"]] == [2]  # behind the run's earlier request
    assert list(conn.runs["a"]) == []
    assert [(r.id if r is not None else body) for body, r in taken] == [3, b"\xc1"]
    assert conn.in_flight == 4
