"""``RuntimeStats.count``'s cached label tuples: the tables it fills are those that building
each key afresh fills, and one machine's, state's or model's keys never land in another's."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from interlock.core._events import (
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    StepProposed,
    TokenUsage,
    Transitioned,
    Violation,
)
from interlock.core._messages import Propose
from interlock.metrics import RuntimeStats

MSG = Propose(run_id="r", seq=1, raw="{}")


def _machine(name: str) -> Any:
    return SimpleNamespace(name=name, tool_by_name={})


def _model_called(state: str, model: str, usage: TokenUsage, latency: float = 0.0) -> ModelCalled:
    return ModelCalled(
        run_id="r",
        seq=1,
        ts=0.0,
        state=state,
        model=model,
        prompt_hash="h",
        prompt="",
        raw="{}",
        usage=usage,
        latency=latency,
    )


def _moved(src: str, dst: str) -> Transitioned:
    return Transitioned(run_id="r", seq=2, ts=0.0, src=src, dst=dst)


def _reference(batches: list[tuple[str, list[Any]]]) -> dict[str, Any]:
    """The tables as ``count`` filled them before its keys were cached: each key built afresh."""
    tokens: defaultdict[tuple[str, ...], int] = defaultdict(int)
    calls: defaultdict[tuple[str, ...], int] = defaultdict(int)
    verdicts: defaultdict[tuple[str, ...], int] = defaultdict(int)
    transitions: defaultdict[tuple[str, ...], int] = defaultdict(int)
    latency: dict[str, list[float]] = {}
    for name, events in batches:
        proposed = False
        for event in events:
            if type(event) is ModelCalled:
                usage = event.usage
                tokens[(name, event.state, event.model, "prompt")] += usage.prompt
                tokens[(name, event.state, event.model, "completion")] += usage.completion
                if usage.cached:
                    tokens[(name, event.state, event.model, "cached")] += usage.cached
                if usage.reasoning:
                    tokens[(name, event.state, event.model, "reasoning")] += usage.reasoning
                calls[(name, event.model)] += 1
                latency.setdefault(event.model, []).append(event.latency)
                proposed = True
            elif type(event) in (IntentRecorded, Transitioned):
                if proposed:
                    verdicts[(name, "accepted", "")] += 1
                    proposed = False
                if type(event) is Transitioned:
                    transitions[(name, event.src, event.dst)] += 1
            elif type(event) is ProposalRejected:
                for violation in event.violations:
                    verdicts[(name, "rejected", violation.code)] += 1
                proposed = False
            elif type(event) is StepProposed:
                proposed = True
    return {
        "tokens": dict(tokens),
        "model_calls": dict(calls),
        "verdicts": dict(verdicts),
        "transitions": dict(transitions),
        "latency": latency,
    }


def _tables(stats: RuntimeStats) -> dict[str, Any]:
    return {
        "tokens": dict(stats.tokens),
        "model_calls": dict(stats.model_calls),
        "verdicts": dict(stats.verdicts),
        "transitions": dict(stats.transitions),
    }


def test_two_machines_states_and_models_keep_their_own_keys() -> None:
    stats = RuntimeStats()
    a, b = _machine("a"), _machine("b")
    batches = [
        (a, [_model_called("X", "m", TokenUsage(prompt=10, completion=2)), _moved("X", "Y")]),
        (b, [_model_called("X", "m", TokenUsage(prompt=100, cached=7)), _moved("X", "Y")]),
        (a, [_model_called("Y", "m", TokenUsage(completion=3, reasoning=1)), _moved("Y", "X")]),
        (a, [_model_called("X", "n", TokenUsage()), _moved("X", "Y")]),
        (a, [_model_called("X", "m", TokenUsage(prompt=5)), _moved("X", "Z")]),
    ]
    for machine, events in batches:
        stats.count(machine, MSG, events, 0)
    assert stats.tokens == {
        ("a", "X", "m", "prompt"): 15,
        ("a", "X", "m", "completion"): 2,
        ("b", "X", "m", "prompt"): 100,
        ("b", "X", "m", "completion"): 0,
        ("b", "X", "m", "cached"): 7,
        ("a", "Y", "m", "prompt"): 0,
        ("a", "Y", "m", "completion"): 3,
        ("a", "Y", "m", "reasoning"): 1,
        ("a", "X", "n", "prompt"): 0,
        ("a", "X", "n", "completion"): 0,
    }
    assert stats.model_calls == {("a", "m"): 3, ("b", "m"): 1, ("a", "n"): 1}
    assert stats.verdicts == {("a", "accepted", ""): 4, ("b", "accepted", ""): 1}
    assert stats.transitions == {
        ("a", "X", "Y"): 2,
        ("b", "X", "Y"): 1,
        ("a", "Y", "X"): 1,
        ("a", "X", "Z"): 1,
    }
    assert {model: h.total for model, h in stats.model_latency.items()} == {"m": 4, "n": 1}


NAMES = st.sampled_from(["a", "b"])
STATES = st.sampled_from(["X", "Y", "Z"])
USAGE = st.builds(
    TokenUsage,
    prompt=st.integers(0, 3),
    completion=st.integers(0, 3),
    cached=st.integers(0, 2),
    reasoning=st.integers(0, 2),
)
EVENTS = st.one_of(
    st.builds(
        _model_called, STATES, st.sampled_from(["m", "n"]), USAGE, st.sampled_from([0.0, 1e-3, 2.0])
    ),
    st.builds(_moved, STATES, STATES),
    st.builds(
        lambda state: IntentRecorded(
            run_id="r", seq=3, ts=0.0, state=state, tool="t", args={}, key="k"
        ),
        STATES,
    ),
    st.builds(lambda state: StepProposed(run_id="r", seq=3, ts=0.0, state=state, raw="{}"), STATES),
    st.builds(
        lambda codes: ProposalRejected(
            run_id="r",
            seq=3,
            ts=0.0,
            state="X",
            violations=tuple(Violation(code=c, path="$", message="", hint="") for c in codes),
        ),
        st.lists(st.sampled_from(["schema", "guard"]), max_size=2),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(NAMES, st.lists(EVENTS, max_size=5)), max_size=8), st.integers(0, 2))
def test_cached_keys_fill_the_tables_as_fresh_keys_do(
    batches: list[tuple[str, list[Any]]], lead: int
) -> None:
    stats = RuntimeStats()
    machines = {"a": _machine("a"), "b": _machine("b")}
    for name, events in batches:
        # a batch's earlier requests' events come first; count reads events[start:]
        prefix: list[Any] = [_moved("Q", "Q")] * lead
        stats.count(machines[name], MSG, prefix + events, lead)
    expected = _reference(batches)
    latency = expected.pop("latency")
    assert _tables(stats) == expected
    for model, samples in latency.items():
        histogram = stats.model_latency[model]
        assert histogram.total == len(samples)
        assert histogram.sum == sum(samples)
        reference = type(histogram)()
        for seconds in samples:
            reference.record(seconds)
        assert histogram.counts == reference.counts
    assert set(stats.model_latency) == set(latency)
