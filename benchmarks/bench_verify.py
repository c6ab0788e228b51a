"""Proposal verification: microseconds per proposal for the full gate on a five-field tool
call plus one guard, from raw JSON bytes, with ~5% malformed inputs.

The proposal is ``{"tool": "refund", "args": {...}}`` with a pattern string
(``order_id``), a positive float (``amount``), an enum (``reason``), a bounded string
(``note``) and a list of 1-10 strings (``tags``); the guard refuses an amount above the
order total. 5% of the inputs are broken the ways models break them (a trailing comma, a
Markdown fence, a truncated object, prose around the JSON).

Compared, over the same inputs:

- *interlock, compiled*: ``interlock.verify(machine, run, raw, now, circuits)`` with the
  compiled hot path (this process);
- *interlock, pure Python*: the same call with ``INTERLOCK_NO_EXTENSIONS=1``, in a
  subprocess, since the hot-path selector is fixed at import;
- *pydantic v2 by hand*: ``Proposal.model_validate_json(raw)`` on strict models with the
  same constraints, then the guard, collecting ``errors()`` on a rejection;
- *msgspec decoding alone*: decoding the same bytes into one Struct with the same
  constraints, no guard, nothing else. This is the floor: parsing has to happen anyway;
- *decode + guard + repeat hash, nothing else*: what any gate with a Python guard and a
  repeat breaker must do per accepted call, written straight in one function: the gate's
  own single-pass decoder, the guard (given one ``RunView`` made in advance), and XXH64
  of the args' canonical encoding. No budgets, tables, breakers or ``Decision``: the
  floor of this design, measured so that the goal's 1.3x can be read against it;
- *the exact-reading scan alone*: ``scan_json(raw)``, which the gate runs on every
  proposal msgspec accepts (a key named twice is invisible to msgspec); it is part of
  the gate's figure, shown here on its own so that its share can be read.

Each figure is the mean of a batch of 1,000 proposals (p50 and p99 over batches, rounds
interleaved across implementations), and per-call p50/p99 from timing calls one at a
time (timer overhead subtracted), which shows the spread between accepted and rejected
inputs.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import msgspec
import pydantic
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from benchmarks._goals import MINIMAL_ROW
from benchmarks._harness import (
    Progress,
    child_main,
    no_progress,
    profile,
    quantile,
    run_child,
    summary,
    time_batches,
    time_each,
)
from benchmarks._workload import (
    ORDER_PATTERN,
    TOTAL,
    ProposalFloor,
    build_machine,
    guard_plain,
    proposals,
    run_state,
    within_total,
)
from interlock.core._breakers import CircuitBoard
from interlock.core._gate import verify

NAME = "verify"
TITLE = "Proposal verification: the full gate against pydantic and msgspec alone"

BATCH = 1_000
SCAN_ROW = "exact-reading scan alone (scan_json)"


class RefundArgsModel(BaseModel):
    """The tool's arguments as a strict pydantic v2 model."""

    model_config = ConfigDict(strict=True, extra="forbid")

    order_id: Annotated[str, StringConstraints(pattern=ORDER_PATTERN)]
    amount: Annotated[float, Field(gt=0)]
    reason: Literal["damaged", "late", "wrong_item", "not_received", "other"]
    note: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    tags: Annotated[list[str], Field(min_length=1, max_length=10)]


class ProposalModel(BaseModel):
    """The whole proposal as a strict pydantic v2 model."""

    model_config = ConfigDict(strict=True, extra="forbid")

    tool: Literal["refund"]
    args: RefundArgsModel


def pydantic_check(raw: bytes) -> tuple[bool, list[Any]]:
    """The hand-written pydantic version: validate, then the guard."""
    try:
        proposal = ProposalModel.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        return False, exc.errors(include_url=False)
    problem = guard_plain(proposal.args.amount, TOTAL)
    if problem is not None:
        return False, [problem]
    return True, []


_floor = msgspec.json.Decoder(ProposalFloor)


def msgspec_floor(raw: bytes) -> object:
    """Decoding alone: the same bytes into one constrained Struct."""
    try:
        return _floor.decode(raw)
    except msgspec.DecodeError as exc:
        return exc


def _minimal() -> Any:
    """The accepted path's irreducible work, without the gate around it (see the docstring)."""
    from interlock import RunView
    from interlock.core._gate import _plan
    from interlock.core._hotpath import hash64
    from interlock.core._view import canonical_encoder

    machine = build_machine()
    run = run_state(machine)
    plan = _plan(machine, run.state)
    decoder = plan.decoder
    assert decoder is not None, "the benchmark tool's schema is a Struct: one decoder"
    (call,) = plan.by_type.values()
    seed = call.seed
    encode = canonical_encoder.encode
    view = RunView(run)

    def minimal(raw: bytes) -> object:
        try:
            args = decoder.decode(raw).args
        except msgspec.DecodeError as exc:
            return exc
        rejected = within_total(args, view)
        if rejected is not None:
            return rejected
        return hash64(encode(args), seed)

    return minimal


def _gate() -> Any:
    machine = build_machine()
    run = run_state(machine)
    circuits = CircuitBoard()
    now = run.started_ts + 1.0

    def gate(raw: bytes) -> Any:
        return verify(machine, run, raw, now, circuits)

    return gate


def _batched(fn: Any) -> Any:
    def each(chunk: Any) -> None:
        for raw in chunk:
            fn(raw)

    return each


def measure(fns: dict[str, Any], items: list[bytes], rounds: int) -> dict[str, dict[str, Any]]:
    """Batch means and per-call figures of each of ``fns`` over ``items``, in microseconds.

    Rounds are interleaved across the functions, so a change of load on the host hits
    all of them alike and the ratios hold.
    """
    batches: dict[str, list[float]] = {label: [] for label in fns}
    calls: dict[str, list[float]] = {label: [] for label in fns}
    for round_ in range(rounds):
        for label, fn in fns.items():
            batches[label] += [ns / 1000 for ns in time_batches(_batched(fn), items, BATCH, 1)]
            if round_ == 0:
                calls[label] = [ns / 1000 for ns in time_each(fn, items, 1)]
    return {
        label: {
            "us": quantile(batches[label], 0.5),
            "batch": summary(batches[label]),
            "call": {"p50": quantile(calls[label], 0.5), "p99": quantile(calls[label], 0.99)},
            "calls_sample": _sample(calls[label]),
        }
        for label in fns
    }


def _sample(values: list[float], size: int = 400) -> list[float]:
    """Every n-th of the sorted values: enough for a chart, small enough for results.json."""
    ordered = sorted(values)
    step = max(1, len(ordered) // size)
    return ordered[::step]


def _child(config: dict[str, Any]) -> dict[str, Any]:
    from interlock.core import _hotpath

    items = proposals(config["count"])
    gate = _gate()
    measured = measure(
        {"gate": gate, "msgspec": msgspec_floor, "scan": _hotpath.scan_json},
        items,
        config["rounds"],
    )
    results: dict[str, Any] = {"implementation": _hotpath.IMPLEMENTATION, **measured}
    if config.get("profile"):
        prof = profile(lambda: [gate(raw) for raw in items], top=config["profile"])
        results["profile"] = prof.rows
        results["profile_areas"] = prof.areas
    return results


def _accepted_share(items: list[bytes]) -> float:
    gate = _gate()
    return sum(1 for raw in items if gate(raw).accepted) / len(items)


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    count = 2_000 if quick else 20_000
    rounds = 2 if quick else 5
    items = proposals(count)
    progress("compiled gate, pydantic and msgspec, interleaved", 0.0)
    from interlock.core import _hotpath

    measured = measure(
        {
            "interlock, compiled": _gate(),
            "pydantic v2 by hand": pydantic_check,
            "msgspec decoding alone": msgspec_floor,
            MINIMAL_ROW: _minimal(),
            SCAN_ROW: _hotpath.scan_json,
        },
        items,
        rounds,
    )
    progress("interlock gate, pure Python (subprocess)", 0.6)
    pure = run_child(
        "benchmarks.bench_verify",
        {"count": count, "rounds": max(1, rounds // 2), "profile": 14},
        env={"INTERLOCK_NO_EXTENSIONS": "1"},
    )
    progress("profiling the compiled gate", 0.9)
    gate = _gate()
    prof = profile(lambda: [gate(raw) for raw in items], top=14)
    if pure["implementation"] != "python":
        raise RuntimeError("the pure-Python child did not use the pure hot path")
    return {
        "proposals": count,
        "malformed_share": 0.05,
        "accepted_share": _accepted_share(items),
        "hot_path_in_process": _hotpath.IMPLEMENTATION,
        "rows": {
            "interlock, compiled": measured["interlock, compiled"],
            "interlock, pure Python": pure["gate"],
            "pydantic v2 by hand": measured["pydantic v2 by hand"],
            "msgspec decoding alone": measured["msgspec decoding alone"],
            MINIMAL_ROW: measured[MINIMAL_ROW],
            SCAN_ROW: measured[SCAN_ROW],
            "msgspec decoding alone (pure-Python child)": pure["msgspec"],
            f"{SCAN_ROW} (pure-Python child)": pure["scan"],
        },
        "profile": prof.rows,
        "profile_areas": prof.areas,
        "profile_pure": pure["profile"],
        "no_extensions_env": os.environ.get("INTERLOCK_NO_EXTENSIONS", ""),
    }


if __name__ == "__main__":
    child_main(_child)


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    rows = results["rows"]
    floor = rows["msgspec decoding alone"]["us"]
    pydantic_us = rows["pydantic v2 by hand"]["us"]
    body = []
    for label, row in rows.items():
        reference = (
            rows["msgspec decoding alone (pure-Python child)"]["us"] if "Python" in label else floor
        )
        body.append(
            (
                label,
                num(row["us"], 2),
                num(row["batch"]["p99"], 2),
                num(row["call"]["p50"], 2),
                num(row["call"]["p99"], 2),
                ratio(row["us"] / reference),
                ratio(pydantic_us / row["us"]),
            )
        )
    return "\n".join(
        [
            f"{results['proposals']:,} proposals, {results['malformed_share']:.0%} malformed, "
            f"{results['accepted_share']:.1%} accepted by the gate. Batch figures are means over "
            f"batches of {BATCH:,}; per-call figures time one call at a time. The pure-Python gate "
            "runs in a subprocess (`INTERLOCK_NO_EXTENSIONS=1`) and is compared with the msgspec "
            "floor measured in that same subprocess.",
            "",
            table(
                [
                    "implementation",
                    "µs/proposal p50",
                    "batch p99",
                    "per call p50",
                    "per call p99",
                    "× msgspec alone",
                    "pydantic ÷ this",
                ],
                body,
            ),
        ]
    )
