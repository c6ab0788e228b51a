"""The gateway's batch intake and settling, compiled (``interlock.core._decide.take_proposals``
and ``settle_from``), against their pure-Python twins in ``interlock.gateway._service``.

Hypothesis writes the batches: items of live external runs at their seq, of hosted runs,
of runs not live here, at a stale seq or none, repeats of a recorded answer, a run named
twice, usage reported or not, a key allowed some machines only; and the verdicts to settle:
moves, calls, calls to reconcile, runs that ended or reached a step state. Both get copies
of the same runs and answers, and must leave the same results: the proposals handed to
the decide step (in the same groups), the verdicts and problems, the items left for
later, the answers remembered (in order), the runs settled, the calls to reconcile.
"""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from types import ModuleType
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlock import Go, Machine, Step, Worker
from interlock.core._messages import ToolCall, Verdict

if os.environ.get("INTERLOCK_NO_EXTENSIONS"):
    pytest.skip(
        "INTERLOCK_NO_EXTENSIONS is set: there is no compiled batch path to compare",
        allow_module_level=True,
    )
try:
    compiled: ModuleType = importlib.import_module("interlock.core._decide")
except ImportError as exc:
    pytest.skip(
        f"interlock.core._decide cannot be imported ({exc}); "
        "build it with `python setup.py build_ext --inplace`",
        allow_module_level=True,
    )

from interlock.gateway import _service
from interlock.protocol import ProposalIn, Usage

pytestmark = pytest.mark.c_extension

MACHINES = {
    name: Machine(
        name,
        "A",
        {
            "A": Worker(next=["B", "CHECK", "DONE"], tools=[]),
            "B": Worker(next=["A", "DONE"], tools=[]),
            "CHECK": Step(lambda view: Go("DONE", {}), next=["DONE"]),
        },
    )
    for name in ("m1", "m2")
}
RUN_IDS = [f"r{i}" for i in range(6)]
PROPOSALS = ['{"next":"B"}', '{"next":"A"}']


class Principal:
    """A key that may propose for the machines in ``machines`` only."""

    name = "k"

    def __init__(self, machines: frozenset[str]) -> None:
        self.machines = machines

    def allows(self, role: str, machine: str | None = None) -> bool:
        return role == "agent" and machine in self.machines


run_specs = st.lists(
    st.tuples(
        st.sampled_from(sorted(MACHINES)),
        st.integers(0, 3),  # seq
        st.booleans(),  # external
        st.sampled_from(["A", "B", "CHECK", "DONE"]),
        st.booleans(),  # closed
        st.booleans(),  # a call pending
    ),
    min_size=len(RUN_IDS),
    max_size=len(RUN_IDS),
)


def make_runs(specs: list[tuple[Any, ...]], live: list[bool]) -> dict[str, Any]:
    runs = {}
    for run_id, (machine, seq, external, state, closed, pending), here in zip(
        RUN_IDS, specs, live, strict=True
    ):
        if not here:
            continue
        run = compiled.RunState(run_id, MACHINES[machine])
        run.seq, run.external, run.state, run.closed = seq, external, state, closed
        run.pending = "a call" if pending else None
        runs[run_id] = run
    return runs


items = st.lists(
    st.tuples(
        st.sampled_from(RUN_IDS),
        st.sampled_from(PROPOSALS),
        st.one_of(st.none(), st.integers(0, 4)),
        st.one_of(st.none(), st.builds(Usage, prompt=st.integers(0, 9))),
        st.sampled_from(["", "gpt"]),
    ),
    max_size=12,
)
recorded = st.dictionaries(
    st.sampled_from(RUN_IDS), st.tuples(st.integers(0, 4), st.sampled_from(PROPOSALS))
)
principals = st.one_of(
    st.none(), st.sets(st.sampled_from(sorted(MACHINES))).map(lambda m: Principal(frozenset(m)))
)


def answer_view(answer: Any) -> Any:
    if answer is None:
        return None
    return (answer.seq, answer.proposal, answer.settled, answer.verdict, answer.error)


def take(
    impl: Any,
    runs: dict[str, Any],
    answers: OrderedDict[str, Any],
    bodies: list[tuple[str, ProposalIn]],
    principal: Any,
) -> dict[str, Any]:
    groups: list[Any] = []
    verdicts: list[Any] = [None] * len(bodies)
    later: list[int] = []
    decided: list[Any] = []
    refusals: list[Any] = []

    def submit(msgs: list[Any]) -> list[Any]:
        # every group is decided before the next one is taken: a copy of each; a proposal
        # for r5 is refused (its run's error), the others get a verdict
        groups.append([msgspec.structs.asdict(m) for m in msgs])
        return [
            ValueError(f"refused {m.run_id}")
            if m.run_id == "r5"
            else Verdict(
                run_id=m.run_id, seq=m.seq + 1, accepted=True, state="B", outcome="running"
            )
            for m in msgs
        ]

    def refused(taken: list[Any], at: int, error: Exception, verdicts_: list[Any]) -> None:
        assert verdicts_ is verdicts
        index, run_id, answer, before = taken[at]
        refusals.append((at, index, run_id, answer_view(answer), before, str(error)))
        verdicts[index] = f"refused: {error}"

    impl(
        runs,
        answers,
        [run_id for run_id, _ in bodies],
        [body for _, body in bodies],
        principal,
        submit,
        refused,
        verdicts,
        later,
        decided,
    )
    decided = [(i, v, answer_view(a), before) for i, v, a, before in decided]
    return {
        "groups": groups,
        "refusals": refusals,
        "verdicts": [
            v if v is None or isinstance(v, str) else msgspec.structs.asdict(v) for v in verdicts
        ],
        "later": later,
        "decided": decided,
        "answers": [(run_id, answer_view(a)) for run_id, a in answers.items()],
    }


def recorded_answers(known: dict[str, tuple[int, str]]) -> OrderedDict[str, Any]:
    return OrderedDict((run_id, _service._Answer(seq, p)) for run_id, (seq, p) in known.items())


@settings(max_examples=300, deadline=None)
@given(
    specs=run_specs,
    live=st.lists(st.booleans(), min_size=len(RUN_IDS), max_size=len(RUN_IDS)),
    batch=items,
    known=recorded,
    principal=principals,
)
def test_the_compiled_intake_takes_a_batch_as_its_twin_does(
    specs: list[tuple[Any, ...]],
    live: list[bool],
    batch: list[tuple[Any, ...]],
    known: dict[str, tuple[int, str]],
    principal: Any,
) -> None:
    bodies = [
        (run_id, ProposalIn(proposal=p, expected_seq=seq, usage=usage, model=model))
        for run_id, p, seq, usage, model in batch
    ]
    results = [
        take(impl, make_runs(specs, live), recorded_answers(known), bodies, principal)
        for impl in (compiled.take_proposals, _service._take_proposals_py)
    ]
    assert results[0] == results[1]


def test_the_intake_decides_a_runs_second_proposal_after_its_first() -> None:
    """A run named twice in a batch: the first group is decided before the second is taken."""
    runs = make_runs([("m1", 1, True, "A", False, False)] * len(RUN_IDS), [True] * len(RUN_IDS))
    bodies = [
        ("r0", ProposalIn(proposal=PROPOSALS[0], expected_seq=1)),
        ("r1", ProposalIn(proposal=PROPOSALS[0])),
        ("r0", ProposalIn(proposal=PROPOSALS[1])),
        ("r9", ProposalIn(proposal=PROPOSALS[1])),
    ]
    for impl in (compiled.take_proposals, _service._take_proposals_py):
        got = take(impl, dict(runs), OrderedDict(), bodies, None)
        assert [[m["run_id"] for m in group] for group in got["groups"]] == [["r0", "r1"], ["r0"]]
        assert [entry[0] for entry in got["decided"]] == [0, 1, 2]
        assert got["later"] == [3]  # not live here
        assert got["answers"] == [("r0", (1, PROPOSALS[0], False, None, None))]


verdicts_to_settle = st.lists(
    st.tuples(
        st.sampled_from(RUN_IDS),
        st.sampled_from(["move", "call", "reconcile", "refused"]),
        st.booleans(),  # an answer waits
    ),
    max_size=10,
)


def settle(impl: Any, runs: dict[str, Any], entries: list[tuple[Any, ...]]) -> dict[str, Any]:
    decided = []
    answers = []
    for index, (run_id, kind, waits) in enumerate(entries):
        call = ToolCall("lookup", {"order_id": "o"}, f"{run_id}:A:{index}")
        verdict = Verdict(
            run_id=run_id,
            seq=index,
            accepted=kind != "refused",
            state="B",
            outcome="running",
            execute=call if kind == "call" else None,
            reconcile=call if kind == "reconcile" else None,
        )
        answer = _service._Answer(index, "p") if waits else None
        answers.append(answer)
        decided.append((index, verdict, answer, index - 1))
    verdicts: list[Any] = [None] * len(entries)
    settled: list[str] = []
    reconciling: set[tuple[str, str]] = set()
    steps: dict[str, frozenset[str]] = {}

    def settle_run(run_id: str) -> None:
        settled.append(run_id)
        runs.pop(run_id, None)

    def steps_of(machine: Machine) -> frozenset[str]:
        steps[machine.name] = frozenset({"CHECK"})
        return steps[machine.name]

    stops = []
    at = 0
    while True:
        at = impl(decided, at, verdicts, runs, settle_run, steps, steps_of, reconciling)
        if at >= len(decided):
            break
        stops.append(at)
        at += 1
    return {
        "stops": stops,
        "verdicts": [None if v is None else msgspec.structs.asdict(v) for v in verdicts],
        "settled": settled,
        "reconciling": sorted(reconciling),
        "answers": [answer_view(a) for a in answers],
    }


@settings(max_examples=300, deadline=None)
@given(
    specs=run_specs,
    live=st.lists(st.booleans(), min_size=len(RUN_IDS), max_size=len(RUN_IDS)),
    entries=verdicts_to_settle,
)
def test_the_compiled_settling_answers_a_batch_as_its_twin_does(
    specs: list[tuple[Any, ...]], live: list[bool], entries: list[tuple[Any, ...]]
) -> None:
    results = [
        settle(impl, make_runs(specs, live), entries)
        for impl in (compiled.settle_from, _service._settle_from_py)
    ]
    assert results[0] == results[1]


def test_settling_stops_at_a_run_that_reached_a_step_state() -> None:
    specs = [("m1", 1, True, "CHECK", False, False), ("m1", 1, True, "DONE", True, False)]
    specs += [("m2", 1, True, "B", False, False)] * (len(RUN_IDS) - 2)
    entries = [("r2", "move", True), ("r0", "move", True), ("r1", "move", False)]
    for impl in (compiled.settle_from, _service._settle_from_py):
        got = settle(impl, make_runs(specs, [True] * len(RUN_IDS)), entries)
        assert got["stops"] == [1]  # r0 is in its step state: the caller runs its steps
        assert got["settled"] == ["r1"]  # r1 ended: it leaves the registry
        assert got["verdicts"][1] is None
        assert got["verdicts"][0]["state"] == "B"
        assert got["answers"][0][2] is True
        assert got["answers"][1][2] is False


# -- the channel's passes over a batch ------------------------------------------------------

from collections import deque  # noqa: E402

from interlock.gateway import _channel  # noqa: E402
from interlock.protocol import Problem, VerdictOut  # noqa: E402


def framer(out: bytearray) -> Any:
    """What _Connection._put does: one answer framed into ``out``."""

    def put(answer: Any) -> None:
        start = len(out)
        out.extend(bytes(4))
        _channel._ENCODE_INTO(answer, out, -1)
        _channel.HEADER.pack_into(out, start, len(out) - start - 4)

    return put


ids = st.one_of(
    st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]),
    st.integers(0, 2**63 - 1),
)
verdicts_out = st.builds(
    VerdictOut,
    run_id=st.text(max_size=40),
    accepted=st.booleans(),
    outcome=st.sampled_from(["running", "completed", ""]),
    state=st.text(max_size=20),
    seq=st.integers(-1, 2**40),
    key=st.one_of(st.none(), st.text(max_size=10)),
    args=st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63))),
    retry_in=st.floats(allow_nan=False),
    problem=st.one_of(
        st.none(),
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


@settings(max_examples=300, deadline=None)
@given(answers=st.lists(st.tuples(ids, verdicts_out), max_size=8), before=st.binary(max_size=20))
def test_the_compiled_framing_writes_the_bytes_its_twin_writes(
    answers: list[tuple[int, VerdictOut]], before: bytes
) -> None:
    requests = [_channel.ChannelRequest(id=i, op="propose", run_id="r") for i, _ in answers]
    verdicts = [v for _, v in answers]
    outs = []
    for impl in (compiled.frame_verdicts, _channel._frame_verdicts_py):
        out = bytearray(before)
        impl(out, requests, verdicts, framer(out))
        outs.append(bytes(out))
    assert outs[0] == outs[1]
    # and they read back as the answers: {id, body} or {id, problem}
    payloads, pos = [], len(before)
    while pos < len(outs[0]):
        (size,) = _channel.HEADER.unpack_from(outs[0], pos)
        payloads.append(msgspec.msgpack.decode(outs[0][pos + 4 : pos + 4 + size]))
        pos += 4 + size
    assert [p["id"] for p in payloads] == [i for i, _ in answers]


def test_the_compiled_passes_take_and_release_a_batch_as_their_twins_do() -> None:
    good = msgspec.msgpack.encode({"proposal": '{"next":"B"}', "expected_seq": 3})
    requests = [
        _channel.ChannelRequest(id=1, op="propose", run_id="a", body=msgspec.Raw(good)),
        _channel.ChannelRequest(id=2, op="propose", run_id="b", body=msgspec.Raw(b"\x01")),
        _channel.ChannelRequest(id=3, op="propose", run_id="c", body=msgspec.Raw(b"\xc1")),
        _channel.ChannelRequest(id=4, op="propose", run_id="d", body=msgspec.Raw(good)),
    ]
    results = []
    for take_bodies, release in (
        (compiled.take_bodies, compiled.release_runs),
        (_channel._take_bodies_py, _channel._release_runs_py),
    ):
        taken: list[Any] = []
        run_ids: list[str] = []
        bodies: list[Any] = []
        refused: list[Any] = []

        def refuse(request: Any, exc: Exception, refused: list[Any] = refused) -> None:
            refused.append((request.id, type(exc).__name__, str(exc)))

        take_bodies(
            requests,
            _channel._DECODE_PROPOSAL,
            refuse,
            taken,
            run_ids,
            bodies,
        )
        runs: dict[str, Any] = {
            "a": deque(),
            "b": deque([requests[0]]),
            "c": deque(),
            "d": deque(["x"]),
        }
        scheduled: list[str] = []
        release(requests, runs, scheduled.append)
        results.append(([r.id for r in taken], run_ids, bodies, refused, sorted(runs), scheduled))
    assert results[0] == results[1]
    taken_ids, run_ids, bodies, refused, left, scheduled = results[0]
    assert taken_ids == [1, 4]
    assert run_ids == ["a", "d"]
    assert [r[0] for r in refused] == [2, 3]
    assert left == ["b", "d"]
    assert scheduled == ["b", "d"]


class Keyring:
    """A server with no keys: every connection is the anonymous principal at once."""

    open = True

    def __init__(self, keys: bool) -> None:
        self.open = not keys

    def authenticate(self, header: str | None) -> Any:
        return Principal(frozenset(MACHINES))


class Nursery:
    def __init__(self) -> None:
        self.started: list[str] = []

    def start_soon(self, fn: Any, *args: Any) -> None:
        self.started.append(fn.__name__)


def frame(body: bytes) -> bytes:
    return _channel.HEADER.pack(len(body)) + body


def request_frame(i: int, op: str, run_id: str | None, body: Any = None) -> bytes:
    return frame(
        msgspec.msgpack.encode(
            {"id": i, "op": op, **({"run_id": run_id} if run_id is not None else {}), "body": body}
        )
    )


frames = st.lists(
    st.one_of(
        st.builds(
            request_frame,
            st.integers(0, 99),
            st.sampled_from(["propose", "propose", "propose", "get_run", "nope", "report"]),
            st.one_of(st.none(), st.sampled_from(["", "r1", "r2", "r3"])),
            st.just({"proposal": '{"next":"B"}'}),
        ),
        st.binary(min_size=1, max_size=6).map(frame),  # not a request
        st.just(b"\x00\x00\x00\x00"),  # a length of 0
        st.just(b"\x7f\x00\x00\x00"),  # a length past max_frame
    ),
    max_size=12,
).map(b"".join)


def connection(keys: bool, max_in_flight: int) -> Any:
    return _channel._Connection(
        None,  # type: ignore[arg-type]  (no frame here reaches the service)
        None,  # type: ignore[arg-type]
        Keyring(keys),  # type: ignore[arg-type]
        max_in_flight,
        1 << 16,
        1.0,
        None,
    )


def connection_state(conn: Any) -> Any:
    return (
        {run_id: [r.id for r in queue] for run_id, queue in conn.runs.items()},
        [r.id for r in conn.batch],
        conn.in_flight,
        bytes(conn.out),
        [getattr(item, "id", item) for item in conn.ready],
    )


@settings(max_examples=300, deadline=None)
@given(
    data=frames,
    cut=st.integers(0, 40),
    keys=st.booleans(),
    max_in_flight=st.integers(1, 6),
)
def test_the_compiled_reader_takes_frames_as_its_twin_does(
    data: bytes, cut: int, keys: bool, max_in_flight: int
) -> None:
    data = data[: len(data) - cut] if cut < len(data) else data  # a frame cut short, at times
    results = []
    for impl in (compiled.take_frames, _channel._take_frames_py):
        conn, nursery = connection(keys, max_in_flight), Nursery()
        steps = []
        pos, status = 0, _channel._FULL
        while status == _channel._FULL:
            try:
                pos, status, size = impl(conn, data, pos, conn._take, nursery)
            except _channel._Closing as closing:  # a frame before the key's hello
                steps.append(("closing", closing.problem.status, closing.request_id))
                break
            steps.append((pos, status, size))
            if status == _channel._FULL:
                conn.in_flight = 0  # the answers went out: the reader goes on
        results.append((steps, connection_state(conn), nursery.started))
    assert results[0] == results[1]
