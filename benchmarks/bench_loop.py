"""Loop overhead: microseconds per step of a 20-step run through the real supervisor.

Each run makes 20 model calls with an instant ``ScriptedProvider`` (no latency): 19 calls
of the five-field tool (verified by the gate, its intent journaled, the no-op tool
executed, its result reported and committed) and a final move to DONE. The journal is a
``MemoryStore`` (encode + frame + index per batch, no disk). A step is one model call
and everything that follows from it; the figure is wall time / (runs x 20).

Measured:

- *sequential*: one run at a time, so every request is its own batch (latency per step);
- *concurrent*: many runs at once, so the supervisor decides and journals whole batches
  (throughput per step, where batching shows);
- each configuration in a fresh subprocess, three times with the configurations
  interleaved; the table shows the median and the range;
- both again with a provider written in the benchmark that returns the scripted output
  without rendering a prompt (so the cost of ``render_prompt`` and of journaling the prompt
  text can be told apart from the loop itself), and with the tuned collector of
  ``bench_concurrency`` (``gc.freeze()`` after start-up, higher thresholds);
- *trio's scheduler alone*: the same number of tasks, each making per step the two task
  switches an interlock step makes (a checkpoint, as the provider does; then parking until
  a server task, woken once per batch, reschedules every parked task, as the supervisor
  sends verdicts) and nothing else: the floor of the loop's shape, whatever runs inside it;
- *plain Python*: the same 20 raw outputs handled by a bare loop: parse + validate (msgspec
  into the same Struct), the guard, and an append to a list; and the same with the
  standard library's ``json`` and hand-written checks.
"""

from __future__ import annotations

import gc
import json
import re
import time
from typing import Any

import msgspec
import trio

from benchmarks._harness import Progress, child_main, no_progress, profile, quantile, run_child
from benchmarks._workload import (
    REASONS,
    TOTAL,
    ProposalFloor,
    build_machine,
    guard_plain,
    step_script,
)
from interlock import RunView, open_supervisor
from interlock.events import TokenUsage
from interlock.providers import Proposal, ScriptedProvider
from interlock.runtime._runtime import GC_THRESHOLD
from interlock.stores import MemoryStore

NAME = "loop"
TITLE = "Loop overhead per step, against a plain-Python loop"

STEPS = 20
TUNED_THRESHOLD = GC_THRESHOLD  # what open_supervisor sets


class PromptFreeProvider:
    """Returns the scripted output at once, without rendering (or journaling) a prompt."""

    model = "prompt-free"

    def __init__(self, script: list[str]) -> None:
        self._script = script

    async def propose(self, view: RunView) -> Proposal:
        await trio.lowlevel.checkpoint()
        return Proposal(raw=self._script[view.steps], usage=TokenUsage(100, 20), model=self.model)


def _provider(kind: str, script: list[str]) -> Any:
    if kind == "prompt-free":
        return PromptFreeProvider(script)
    return ScriptedProvider(lambda view: script[view.steps])


def measure_runtime(
    runs: int, concurrent: bool, provider_kind: str, tuned: bool, profile_top: int = 0
) -> dict[str, Any]:
    """Run ``runs`` 20-step runs; return wall and CPU microseconds per step.

    With ``profile_top``, the runs go under cProfile and the result holds its top rows.
    """
    machine = build_machine()
    script = step_script(STEPS)
    provider = _provider(provider_kind, script)
    store = MemoryStore()
    run_seconds: list[float] = []

    async def one(supervisor: Any, index: int) -> None:
        started = time.perf_counter()
        handle = await supervisor.start_run(machine.name, {"total": TOTAL}, run_id=f"r{index}")
        result = await handle.wait()
        assert result.outcome == "completed", result
        run_seconds.append(time.perf_counter() - started)

    async def main() -> None:
        async with open_supervisor([machine], store, provider=provider) as supervisor:
            if concurrent:
                async with trio.open_nursery() as nursery:
                    for i in range(runs):
                        nursery.start_soon(one, supervisor, i)
                    if tuned:
                        gc.freeze()
            else:
                for i in range(runs):
                    await one(supervisor, i)
        stats = supervisor.statistics()
        extra["events_per_flush"] = stats.events / max(1, stats.flushes)

    extra: dict[str, Any] = {}
    old_threshold = gc.get_threshold()
    gc.collect()
    if tuned:
        gc.set_threshold(*TUNED_THRESHOLD)
        gc.freeze()
    try:
        cpu = time.process_time()
        wall = time.perf_counter()
        if profile_top:
            prof = profile(lambda: trio.run(main), top=profile_top)
            extra["profile"] = prof.rows
            extra["profile_areas"] = prof.areas
            extra["profile_calls"] = prof.calls
        else:
            trio.run(main)
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
    finally:
        gc.set_threshold(*old_threshold)
        gc.unfreeze()
    steps = runs * STEPS
    per_step = [s / STEPS * 1e6 for s in run_seconds]
    return {
        "runs": runs,
        "us_per_step": wall / steps * 1e6,
        "cpu_us_per_step": cpu / steps * 1e6,
        "run_us_per_step_p50": quantile(per_step, 0.5),
        "run_us_per_step_p99": quantile(per_step, 0.99),
        **extra,
    }


# -- the plain-Python loops ---------------------------------------------------------------

_floor_decoder = msgspec.json.Decoder(ProposalFloor)
_ORDER = re.compile(r"^ORD-[0-9]{6}$")


def plain_msgspec(raws: list[bytes]) -> list[Any]:
    """Parse + validate with msgspec, run the guard, append to a list."""
    journal: list[Any] = []
    for step, raw in enumerate(raws):
        try:
            call = _floor_decoder.decode(raw)
        except msgspec.DecodeError:
            if raw.startswith(b'{"next"'):
                journal.append((step, "DONE"))
                continue
            raise
        if guard_plain(call.args.amount) is None:
            journal.append((step, call))
    return journal


def plain_json(raws: list[bytes]) -> list[Any]:
    """Parse with ``json.loads``, validate by hand, run the guard, append to a list."""
    journal: list[Any] = []
    for step, raw in enumerate(raws):
        data = json.loads(raw)
        if "next" in data:
            journal.append((step, data["next"]))
            continue
        args = data["args"]
        ok = (
            data.get("tool") == "refund"
            and set(args) == {"order_id", "amount", "reason", "note", "tags"}
            and isinstance(args["order_id"], str)
            and _ORDER.match(args["order_id"]) is not None
            and isinstance(args["amount"], float)
            and args["amount"] > 0
            and args["reason"] in REASONS
            and isinstance(args["note"], str)
            and 1 <= len(args["note"]) <= 200
            and isinstance(args["tags"], list)
            and 1 <= len(args["tags"]) <= 10
            and all(isinstance(t, str) for t in args["tags"])
        )
        if ok and guard_plain(args["amount"]) is None:
            journal.append((step, args))
    return journal


def measure_plain(fn: Any, runs: int) -> dict[str, Any]:
    raws = [r.encode() for r in step_script(STEPS)]
    gc.collect()
    cpu = time.process_time()
    wall = time.perf_counter()
    for _ in range(runs):
        fn(raws)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    return {
        "runs": runs,
        "us_per_step": wall / (runs * STEPS) * 1e6,
        "cpu_us_per_step": cpu / (runs * STEPS) * 1e6,
    }


#: The label of the scheduler-floor row.
SWITCHES = "bare trio: the loop's two task switches per step, nothing else"


def measure_switches(runs: int) -> dict[str, Any]:
    """Per step: a checkpoint, then park until a batching server task reschedules the task."""
    queue: list[Any] = []
    idle: list[Any] = [None]

    def abort(_: Any) -> trio.lowlevel.Abort:
        return trio.lowlevel.Abort.SUCCEEDED

    async def server() -> None:
        while True:
            if queue:
                await trio.lowlevel.checkpoint()
            else:
                idle[0] = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(abort)
            batch = queue[:]
            queue.clear()
            for task in batch:
                trio.lowlevel.reschedule(task)

    async def one() -> None:
        for _ in range(STEPS):
            await trio.lowlevel.checkpoint()  # the provider's
            queue.append(trio.lowlevel.current_task())
            waiting = idle[0]
            if waiting is not None:
                idle[0] = None
                trio.lowlevel.reschedule(waiting)
            await trio.lowlevel.wait_task_rescheduled(abort)  # the verdict's

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server)
            async with trio.open_nursery() as runs_nursery:
                for _ in range(runs):
                    runs_nursery.start_soon(one)
            nursery.cancel_scope.cancel()

    gc.collect()
    cpu = time.process_time()
    wall = time.perf_counter()
    trio.run(main)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    steps = runs * STEPS
    return {
        "runs": runs,
        "us_per_step": wall / steps * 1e6,
        "cpu_us_per_step": cpu / steps * 1e6,
    }


def _child(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("switches"):
        return measure_switches(config["runs"])
    return measure_runtime(
        config["runs"],
        config["concurrent"],
        config["provider"],
        config["tuned"],
        profile_top=config.get("profile", 0),
    )


PLAN: tuple[tuple[str, bool, str, bool], ...] = (
    ("interlock, sequential", False, "scripted", False),
    ("interlock, concurrent", True, "scripted", False),
    ("interlock, concurrent, tuned gc", True, "scripted", True),
    ("interlock, sequential, prompt-free provider", False, "prompt-free", False),
    ("interlock, concurrent, prompt-free provider", True, "prompt-free", False),
    ("interlock, concurrent, prompt-free provider, tuned gc", True, "prompt-free", True),
)


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    sequential_runs = 10 if quick else 100
    concurrent_runs = 50 if quick else 500
    repeats = 1 if quick else 3
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in PLAN}
    samples[SWITCHES] = []
    total = repeats * (len(PLAN) + 1) + 2
    # Each measurement in a fresh process (the collector's work depends on everything
    # else alive in the process), repeated with the configurations interleaved.
    for rep in range(repeats):
        for done, (label, concurrent, provider_kind, tuned) in enumerate(PLAN):
            progress(f"{label} ({rep + 1}/{repeats})", (rep * len(PLAN) + done) / total)
            config = {
                "runs": concurrent_runs if concurrent else sequential_runs,
                "concurrent": concurrent,
                "provider": provider_kind,
                "tuned": tuned,
            }
            samples[label].append(run_child("benchmarks.bench_loop", config))
        progress(f"{SWITCHES} ({rep + 1}/{repeats})", (rep * (len(PLAN) + 1) + len(PLAN)) / total)
        samples[SWITCHES].append(
            run_child("benchmarks.bench_loop", {"switches": True, "runs": concurrent_runs})
        )
    rows = [
        _median_row(
            samples[label], label, "concurrent" if concurrent else "sequential", "interlock"
        )
        for label, concurrent, _provider_kind, _tuned in PLAN
    ]
    rows.append(_median_row(samples[SWITCHES], SWITCHES, "concurrent", "floor"))
    progress("plain-Python loops", (total - 2) / total)
    plain_runs = 2_000 if quick else 50_000
    for label, fn in (
        ("plain Python: msgspec parse + validate + append", plain_msgspec),
        ("plain Python: json + hand checks + append", plain_json),
    ):
        row = measure_plain(fn, plain_runs)
        row.update(label=label, mode="sequential", kind="plain", repeats=1)
        rows.append(row)
    progress("profiling concurrent runs", (total - 1) / total)
    profiled = run_child(
        "benchmarks.bench_loop",
        {
            "runs": concurrent_runs,
            "concurrent": True,
            "provider": "scripted",
            "tuned": False,
            "profile": 16,
        },
    )
    return {
        "steps": STEPS,
        "rows": rows,
        "profile": profiled["profile"],
        "profile_areas": profiled["profile_areas"],
        "profile_runs": concurrent_runs,
        "calls_per_step": profiled["profile_calls"] / (concurrent_runs * STEPS),
    }


def _median_row(samples: list[dict[str, Any]], label: str, mode: str, kind: str) -> dict[str, Any]:
    """The median of fresh-process repetitions, with their range."""
    ordered = sorted(samples, key=lambda r: r["us_per_step"])
    row = dict(ordered[len(ordered) // 2])
    row.update(
        label=label,
        mode=mode,
        kind=kind,
        repeats=len(ordered),
        us_per_step_min=ordered[0]["us_per_step"],
        us_per_step_max=ordered[-1]["us_per_step"],
    )
    return row


def find(results: dict[str, Any], label: str) -> dict[str, Any]:
    return next(row for row in results["rows"] if row["label"] == label)


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    plain = find(results, "plain Python: msgspec parse + validate + append")["us_per_step"]
    body = []
    for row in results["rows"]:
        body.append(
            (
                row["label"],
                f"{row['runs']:,}",
                num(row["us_per_step"]),
                f"{num(row['us_per_step_min'])}–{num(row['us_per_step_max'])}"
                if row["kind"] != "plain"
                else "–",
                num(row["cpu_us_per_step"]),
                num(row["run_us_per_step_p50"])
                if row["kind"] == "interlock" and row["mode"] == "sequential"
                else "–",
                num(row["run_us_per_step_p99"])
                if row["kind"] == "interlock" and row["mode"] == "sequential"
                else "–",
                num(row.get("events_per_flush")),
                ratio(row["us_per_step"] / plain),
            )
        )
    return "\n".join(
        [
            f"A run is {results['steps']} model calls (19 verified tool calls + a move to DONE) with an "
            "instant provider and a no-op tool, through the real supervisor and a MemoryStore. "
            "µs/step = wall time ÷ (runs × 20), the median of the repetitions (each in a fresh "
            "process); per-run p50/p99 are over the runs of the sequential case.",
            "",
            table(
                [
                    "configuration",
                    "runs",
                    "µs/step (wall, median)",
                    "range",
                    "CPU µs/step",
                    "per-run p50",
                    "per-run p99",
                    "events per flush",
                    "× plain msgspec loop",
                ],
                body,
            ),
        ]
    )


if __name__ == "__main__":
    child_main(_child)
