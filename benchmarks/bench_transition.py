"""Transition check: nanoseconds per ``Tables.check_transition(src, dst)`` call.

Three implementations answer the same 100,000 (src, dst) pairs drawn from a 16-state
machine (about half the pairs legal, half illegal, 2% naming no state at all):

- *compiled*: ``interlock.core._hot.Tables`` (the Cython bitmask tables);
- *pure Python*: ``interlock.core._hot_py.Tables``, the twin with the same results;
- *dict of sets*: what one would write without tables, ``dst in edges.get(src, ())``,
  as a function returning the same codes.

Each check is one Python-level call through a bound method (or function) in a plain
``for`` loop, which is what the gate pays. The same loop making a call that does nothing
is timed too, once into C (``operator.is_``, the baseline of the compiled method) and once
into Python (an empty ``def``, the baseline of the pure twin and the dict of sets):
subtracting it gives the cost of the check itself (*net*). Rounds are interleaved across
implementations; figures are per-batch means over batches of 1,000 pairs, p50 and p99
across batches.
"""

from __future__ import annotations

import importlib
import operator
import random
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._harness import Progress, no_progress, quantile, summary, time_batches

NAME = "transition"
TITLE = "Transition check: compiled tables against the pure twin and a dict of sets"

STATES = 16
BATCH = 1_000
OK, UNKNOWN_STATE, ILLEGAL = 0, 1, 2


def build_tables(seed: int = 16) -> tuple[list[str], list[int], dict[int, set[int]]]:
    rng = random.Random(seed)
    names = [f"S{i}" for i in range(STATES)]
    edges = [0] * STATES
    sets: dict[int, set[int]] = {i: set() for i in range(STATES)}
    for src in range(STATES):
        for dst in rng.sample(range(STATES), STATES // 2):
            edges[src] |= 1 << dst
            sets[src].add(dst)
    return names, edges, sets


def build_pairs(count: int, sets: dict[int, set[int]], seed: int = 5) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    pairs = []
    for i in range(count):
        src = rng.randrange(STATES)
        if i % 50 == 0:
            pairs.append((src, STATES + rng.randrange(4)))  # no such state
        elif rng.random() < 0.5:
            pairs.append((src, rng.choice(sorted(sets[src]))))
        else:
            pairs.append((src, rng.choice([d for d in range(STATES) if d not in sets[src]])))
    return pairs


def dict_of_sets(sets: dict[int, set[int]]) -> Callable[[int, int], int]:
    def check(src: int, dst: int) -> int:
        allowed = sets.get(src)
        if allowed is None or dst not in sets:
            return UNKNOWN_STATE
        return OK if dst in allowed else ILLEGAL

    return check


def _nothing(src: int, dst: int) -> int:
    return 0


def _loop(check: Callable[[int, int], int]) -> Callable[[Sequence[tuple[int, int]]], None]:
    def each(chunk: Sequence[tuple[int, int]]) -> None:
        for src, dst in chunk:
            check(src, dst)

    return each


#: The baselines: a loop making a call that does nothing, through C and through Python.
C_CALL = "empty loop, C call (operator.is_)"
PY_CALL = "empty loop, Python call (def f(a, b): return 0)"


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    count = 20_000 if quick else 100_000
    rounds = 3 if quick else 15
    names, edges, sets = build_tables()
    pairs = build_pairs(count, sets)
    compiled = importlib.import_module("interlock.core._hot").Tables(
        names, [], edges, [0] * STATES, 0
    )
    pure = importlib.import_module("interlock.core._hot_py").Tables(
        names, [], edges, [0] * STATES, 0
    )
    plain = dict_of_sets(sets)
    implementations: list[tuple[str, Callable[[int, int], Any]]] = [
        ("compiled", compiled.check_transition),
        ("pure Python", pure.check_transition),
        ("dict of sets", plain),
        (C_CALL, operator.is_),
        (PY_CALL, _nothing),
    ]
    for src, dst in pairs[:2000]:
        answers = {fn(src, dst) for label, fn in implementations[:3]}
        if len(answers) != 1:
            raise RuntimeError(f"implementations disagree on ({src}, {dst}): {answers}")
    samples: dict[str, list[float]] = {label: [] for label, _fn in implementations}
    # Interleaved rounds, so that a change of load on the host hits every implementation.
    for done in range(rounds):
        progress(f"round {done + 1} of {rounds}", done / rounds)
        for label, fn in implementations:
            samples[label] += time_batches(_loop(fn), pairs, BATCH, 1)
    rows: dict[str, Any] = {
        label: {"ns": quantile(values, 0.5), "batch": summary(values)}
        for label, values in samples.items()
    }
    baselines = {"compiled": C_CALL, "pure Python": PY_CALL, "dict of sets": PY_CALL}
    for label, baseline in baselines.items():
        rows[label]["net_ns"] = max(0.0, rows[label]["ns"] - rows[baseline]["ns"])
        rows[label]["baseline"] = baseline
    legal = sum(1 for src, dst in pairs if dst in sets.get(src, ()))
    return {
        "pairs": count,
        "legal_share": legal / count,
        "states": STATES,
        "rows": rows,
    }


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    rows = results["rows"]
    compiled = rows["compiled"]

    def net_ratio(row: dict[str, Any]) -> str:
        if "net_ns" not in row:
            return "–"
        if compiled["net_ns"] <= 0:
            return "compiled net below timer resolution"
        return ratio(row["net_ns"] / compiled["net_ns"])

    lines = [
        f"{results['pairs']:,} (src, dst) pairs on a {results['states']}-state machine, "
        f"{results['legal_share']:.0%} legal; batches of {BATCH:,}. *Net* subtracts the loop "
        "making a call that does nothing (into C for the compiled method, into Python for the "
        "others): the cost of the check itself.",
        "",
        table(
            [
                "implementation",
                "ns/check p50",
                "ns/check p99",
                "net ns",
                "× compiled (per call)",
                "× compiled (net)",
            ],
            [
                (
                    label,
                    num(row["ns"]),
                    num(row["batch"]["p99"]),
                    num(row.get("net_ns")),
                    ratio(row["ns"] / compiled["ns"]) if "net_ns" in row else "–",
                    net_ratio(row),
                )
                for label, row in rows.items()
            ],
        ),
    ]
    return "\n".join(lines)
