"""The peers' workloads (issue 19): interlock against Apache Burr and a plain-Python loop, as
ratios measured in one run, and the concurrency and instruction figures of the same goals.

1. *One run at a time, in memory*: a 20-step run (19 calls of the five-field no-op tool of
   ``_workload``, then a move to DONE), one run after another, µs per step (wall ÷ runs × 20):

   - *interlock*: ``open_supervisor`` with a ``ScriptedProvider`` and a ``MemoryStore``
     (``bench_loop``'s sequential case);
   - *Burr*: the same 20 raw outputs as a Burr application built the way Burr's own counter
     example builds a loop (one ``@action`` that loops on itself through
     ``expr("step < 19")``, then a ``default`` transition to a final action), in-memory state
     only: no tracker, no persister, no hooks. Each step decodes and validates its raw output
     with msgspec into the same Struct interlock compiles, runs the same guard, calls the
     no-op tool and writes its result into the state; ``app.run(halt_after=["done"])``,
     synchronous (Burr's fastest path). The same with ``async`` actions on asyncio is a
     second row;
   - *plain Python*: the same per-step work in a ``for`` loop with a dict for the state.

2. *Durable, one run at a time*: the same runs with every step durable in SQLite with
   ``synchronous=FULL`` before the next step starts: interlock's ``open_sqlite_store(...,
   synchronous="FULL")`` with the tool declared read-only, idempotent or neither; Burr with
   its ``SQLitePersister`` (``with_state_persister``: one INSERT and commit after every step)
   on its own connection (SQLite's default rollback journal) and on a WAL connection, both
   ``PRAGMA synchronous=FULL``. Steps/s from a run without tracing; fsyncs per step from a
   second run under ``strace -f -c -e trace=fsync,fdatasync`` at two sizes, differenced (so
   opening the database cancels out); for interlock also the store's flushes per step
   (``Supervisor.statistics().flushes``).

3. *Concurrent runs*: ``bench_concurrency``'s workload and child (10 steps of 5-20 ms
   simulated latency per run, a SQLite journal): interlock and bare trio doing only the
   sleeps at 10,000 and 100,000 runs; wall time and peak RSS (``VmHWM``).

4. *Instructions per step* (valgrind cachegrind, as ``bench_instructions`` counts): the
   in-memory one-run-at-a-time case of interlock, Burr and the plain loop, each at two sizes,
   differenced.

Each measurement runs in a fresh subprocess; the timed cases three times, interleaved, and
the median is kept. Burr rows are skipped with a note when ``burr`` is not importable
(``pip install apache-burr``). When the runtime accepts a tool call that names the state to
move to (``{"tool", "args", "next"}``), a row runs the same 20 tool calls with the last one
moving to DONE (20 model calls, no separate move).
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

from benchmarks._harness import (
    ROOT,
    Progress,
    child_env,
    child_main,
    no_progress,
    profile,
    run_child,
)
from benchmarks._workload import (
    TOOL,
    TOTAL,
    WORK,
    ProposalFloor,
    RefundArgs,
    call_args,
    call_raw,
    guard_plain,
    noop,
    step_script,
    within_total,
)

NAME = "peers"
TITLE = "The peers' workloads: interlock against Apache Burr and a plain-Python loop"

STEPS = 20
TOOL_KINDS = ("read-only", "idempotent", "not idempotent")
INTERLOCK = "interlock"
CALL_AND_MOVE = "interlock, call-and-move proposals"
TWIN = "interlock, the decide path's pure-Python twin"
BURR = "Burr, in-memory state (sync)"
BURR_EXPR = "Burr, in-memory state (sync), expr condition as in its counter example"
BURR_ASYNC = "Burr, in-memory state (async actions, asyncio)"
#: Changes when the workload changes: ``carry`` keeps earlier runs of the same version only.
WORKLOAD_VERSION = 2
PLAIN = "plain-Python loop"
BURR_SQLITE = "Burr, SQLitePersister (its own connection: rollback journal)"
BURR_SQLITE_WAL = "Burr, SQLitePersister on a WAL connection"

HAVE_BURR = importlib.util.find_spec("burr") is not None
NO_BURR = "burr is not installed (`pip install apache-burr`, in the bench extra): Burr rows skipped"


# -- the work of one step, shared by Burr and the plain loop -----------------------------

_decoder = msgspec.json.Decoder(ProposalFloor)


def _raws() -> list[bytes]:
    return [r.encode() for r in step_script(STEPS)]


def noop_sync(args: Any) -> dict[str, bool]:
    """The no-op tool, called synchronously."""
    return {"ok": True}


def _decide(raw: bytes) -> Any:
    """Parse + validate the raw output into the Struct interlock compiles, and the guard."""
    if raw.startswith(b'{"next"'):
        return msgspec.json.decode(raw)["next"]
    call = _decoder.decode(raw)
    reason = guard_plain(call.args.amount)
    if reason is not None:
        raise ValueError(reason)
    return call


def plain_run(raws: list[bytes]) -> dict[str, Any]:
    """One run in a for loop: decide, call the tool, update the state."""
    state: dict[str, Any] = {"step": 0, "results": [], "state": WORK}
    for raw in raws:
        decided = _decide(raw)
        if isinstance(decided, str):
            state["state"] = decided
        else:
            state["results"].append(noop_sync(decided.args))
        state["step"] += 1
    return state


def burr_graph(raws: list[bytes], *, asynchronous: bool = False, condition: str = "lmda") -> Any:
    """The 20-step script as a Burr graph (Burr's counter-example shape), built once.

    ``condition``: ``lmda``, a Python function of the state (``Condition.lmda``), or
    ``expr``, the counter example's ``expr("step < 19")`` (parsed and evaluated as an
    expression at every transition, several times slower).
    """
    from burr.core import Condition, State, default, expr
    from burr.core.action import action
    from burr.core.graph import GraphBuilder

    last = len(raws) - 1

    if asynchronous:

        @action(reads=["step", "results"], writes=["step", "results"])
        async def work(state: State) -> tuple[dict, State]:
            call = _decide(raws[state["step"]])
            result = await _noop_async(call.args)
            return result, state.update(step=state["step"] + 1).append(results=result)

        @action(reads=["step"], writes=["step", "moved"])
        async def done(state: State) -> tuple[dict, State]:
            moved = _decide(raws[state["step"]])
            return {"moved": moved}, state.update(step=state["step"] + 1, moved=moved)

    else:

        @action(reads=["step", "results"], writes=["step", "results"])
        def work(state: State) -> tuple[dict, State]:
            call = _decide(raws[state["step"]])
            result = noop_sync(call.args)
            return result, state.update(step=state["step"] + 1).append(results=result)

        @action(reads=["step"], writes=["step", "moved"])
        def done(state: State) -> tuple[dict, State]:
            moved = _decide(raws[state["step"]])
            return {"moved": moved}, state.update(step=state["step"] + 1, moved=moved)

    def more(state: State) -> bool:
        return bool(state["step"] < last)

    again = Condition.lmda(more, ["step"]) if condition == "lmda" else expr(f"step < {last}")
    return (
        GraphBuilder()
        .with_actions(work=work, done=done)
        .with_transitions(("work", "work", again), ("work", "done", default))
        .build()
    )


def burr_app(
    raws: list[bytes],
    *,
    asynchronous: bool = False,
    persister: Any = None,
    graph: Any = None,
    app_id: str | None = None,
) -> Any:
    """One run of the script: a Burr application over ``graph`` (built here if not given)."""
    from burr.core import ApplicationBuilder

    builder = (
        ApplicationBuilder()
        .with_graph(graph if graph is not None else burr_graph(raws, asynchronous=asynchronous))
        .with_state(step=0, results=[], moved="")
        .with_entrypoint("work")
    )
    if app_id is not None:
        builder = builder.with_identifiers(app_id=app_id)
    if persister is not None:
        builder = builder.with_state_persister(persister)
    return builder.build()


async def _noop_async(args: Any) -> dict[str, bool]:
    return {"ok": True}


# -- interlock --------------------------------------------------------------------------


def _machine(tool_kind: str, deadline: float = 10.0**9, call_and_move: bool = False) -> Any:
    from interlock import Budgets, Machine, Tool, Worker

    tool = Tool(
        TOOL,
        noop,
        args=RefundArgs,
        guards=(within_total,),
        idempotent=tool_kind == "idempotent",
        read_only=tool_kind == "read-only",
    )
    return Machine(
        name="peers",
        initial=WORK,
        states={
            WORK: Worker(
                next=["DONE"],
                tools=[TOOL],
                instructions="refund the order, then finish",
                # only where it is asked for: a tree without the option has no such field
                **({"call_and_move": True} if call_and_move else {}),
            )
        },
        tools=[tool],
        budgets=Budgets(tokens=10**12, steps=10**6, deadline=deadline),
    )


def call_and_move_script(steps: int = STEPS, seed: int = 7) -> list[str]:
    """``steps`` tool calls, the last one naming DONE as the state to move to."""
    import random

    rng = random.Random(seed)
    outputs = [call_raw(call_args(rng, i)).decode() for i in range(steps)]
    last = msgspec.json.decode(outputs[-1])
    outputs[-1] = msgspec.json.encode({**last, "next": "DONE"}).decode()
    return outputs


def interlock_runs(
    runs: int,
    *,
    store: str = "memory",
    tool_kind: str = "idempotent",
    script: str = "move",
    deadline: float = 10.0**9,
) -> dict[str, Any]:
    """``runs`` 20-step runs one after another; wall and CPU seconds, flushes, outcomes."""
    import trio

    from interlock import RunView, open_supervisor
    from interlock.providers import ScriptedProvider
    from interlock.stores import MemoryStore, open_sqlite_store

    machine = _machine(tool_kind, deadline, call_and_move=script != "move")
    outputs = step_script(STEPS) if script == "move" else call_and_move_script()

    def oracle(view: RunView) -> str:
        return outputs[view.steps]

    provider = ScriptedProvider(oracle)
    directory = tempfile.TemporaryDirectory(prefix="interlock-peers-")
    out: dict[str, Any] = {}

    async def main() -> None:
        journal: Any = MemoryStore()
        if store == "sqlite":
            journal = await open_sqlite_store(f"{directory.name}/j.db", synchronous="FULL")
        outcomes: dict[str, int] = {}
        async with open_supervisor([machine], journal, provider=provider) as supervisor:
            started = time.perf_counter()
            cpu = time.process_time()
            for i in range(runs):
                handle = await supervisor.start_run(machine.name, {"total": TOTAL}, run_id=f"r{i}")
                result = await handle.wait()
                outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
            out["wall_s"] = time.perf_counter() - started
            out["cpu_s"] = time.process_time() - cpu
        stats = supervisor.statistics()
        out.update(outcomes=outcomes, flushes=stats.flushes, events=stats.events)
        if store == "sqlite":
            await journal.aclose()

    trio.run(main)
    directory.cleanup()
    return out


# -- Burr -------------------------------------------------------------------------------


def burr_runs(
    runs: int, *, asynchronous: bool = False, sqlite: str = "", condition: str = "lmda"
) -> dict[str, Any]:
    raws = _raws()
    graph = burr_graph(raws, asynchronous=asynchronous, condition=condition)
    persister = None
    directory = tempfile.TemporaryDirectory(prefix="burr-peers-")
    if sqlite:
        import sqlite3

        from burr.core.persistence import SQLitePersister

        path = f"{directory.name}/burr.db"
        connection = sqlite3.connect(path)
        if sqlite == "wal":
            connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=FULL")
        persister = SQLitePersister(path, connection=connection)
        persister.initialize()
    final = 0
    started = time.perf_counter()
    cpu = time.process_time()
    for i in range(runs):
        app = burr_app(raws, persister=persister, graph=graph, app_id=f"r{i}")
        if asynchronous:
            _action, _result, state = asyncio.run(app.arun(halt_after=["done"]))
        else:
            _action, _result, state = app.run(halt_after=["done"])
        final += state["step"] == STEPS
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    persisted = None
    if persister is not None:  # every step was saved: one row per action
        (persisted,) = persister.connection.execute("SELECT count(*) FROM burr_state").fetchone()
        persister.connection.close()
    directory.cleanup()
    return {"wall_s": wall, "cpu_s": cpu, "completed": final, "persisted": persisted}


def plain_runs(runs: int) -> dict[str, Any]:
    raws = _raws()
    completed = 0
    started = time.perf_counter()
    cpu = time.process_time()
    for _ in range(runs):
        completed += plain_run(raws)["step"] == STEPS
    return {
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu,
        "completed": completed,
    }


# -- children ---------------------------------------------------------------------------


def use_decide_twin() -> bool:
    """Run this process's steps on the pure-Python run state and decide path (the twin of
    ext/_decide.pyx), the rest of the runtime as it is; False where there is no compiled
    one to switch from."""
    from interlock.core import _decider, _view

    if _view.DECIDE_IMPLEMENTATION != "compiled":
        return False
    _view.RunState = _decider.RunState = _view.PyRunState  # type: ignore[misc]
    _decider._propose = _decider.propose = _decider._on_propose
    _decider._report = _decider._on_report
    return True


def _measure(config: dict[str, Any]) -> dict[str, Any]:
    kind, runs = config["kind"], config["runs"]
    if config.get("decide") == "python" and not use_decide_twin():
        raise RuntimeError("the decide path is not compiled here: no twin to compare with")
    if kind == "interlock":
        return interlock_runs(
            runs,
            store=config.get("store", "memory"),
            tool_kind=config.get("tool", "idempotent"),
            script=config.get("script", "move"),
            deadline=config.get("deadline", 10.0**9),
        )
    if kind == "burr":
        return burr_runs(
            runs,
            asynchronous=config.get("async", False),
            sqlite=config.get("sqlite", ""),
            condition=config.get("condition", "lmda"),
        )
    return plain_runs(runs)


def _child(config: dict[str, Any]) -> dict[str, Any]:
    gc.collect()
    if config.get("warmup"):
        _measure({**config, "runs": config["warmup"]})
    if config.get("profile"):
        prof = profile(lambda: _measure(config), top=config["profile"])
        return {"profile": prof.rows, "profile_areas": prof.areas}
    return _measure(config)


_STRACE_CALLS = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(fsync|fdatasync)\s*$")


def _child_under(tool: list[str], config: dict[str, Any], timeout: float) -> str:
    """Run this module's child for ``config`` under ``tool`` (strace, valgrind); its stderr.

    Raises:
      RuntimeError: the child failed; the message holds the end of its stderr.
    """
    child = [sys.executable, "-m", "benchmarks.bench_peers", "--child"]
    proc = subprocess.run(
        [*tool, *child, msgspec.json.encode(config).decode()],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tool[0]} on {config} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stderr


def count_fsyncs(strace: str, config: dict[str, Any]) -> int:
    """fsync + fdatasync calls of a child (all its threads) running ``config``."""
    with tempfile.NamedTemporaryFile(prefix="peers-strace-", suffix=".txt") as summary:
        command = [strace, "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", summary.name]
        _child_under(command, config, timeout=600)
        with open(summary.name, encoding="utf-8") as file:
            text = file.read()
    matches = (_STRACE_CALLS.match(line) for line in text.splitlines())
    return sum(int(match.group(1)) for match in matches if match)


_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def count_instructions(valgrind: str, config: dict[str, Any]) -> int:
    """Instructions (cachegrind's ``I refs``) of a child running ``config``."""
    command = [valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    stderr = _child_under(command, config, timeout=1200)
    match = _REFS.search(stderr)
    if match is None:
        raise RuntimeError(f"valgrind on {config} printed no instruction count: {stderr[-800:]}")
    return int(match.group(1).replace(",", ""))


# -- the benchmark ----------------------------------------------------------------------


def _git() -> dict[str, Any]:
    """The checkout of the interlock measured: the one imported, which is not this
    benchmarks checkout when ``PYTHONPATH`` points at a worktree's ``src`` (see peers.md)."""
    import interlock

    tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(interlock.__file__))))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=tree, capture_output=True, text=True, check=False
        ).stdout.strip()

    exported = os.path.join(tree, ".commit")  # a tree exported with git archive (peers.md)
    if os.path.exists(exported):
        with open(exported, encoding="utf-8") as file:
            commit, _, subject = file.read().strip().partition(" ")
        return {"tree": tree, "commit": commit[:12], "subject": subject[:100], "dirty_src": False}
    return {
        "tree": tree,
        "commit": git("rev-parse", "--short=12", "HEAD"),
        "subject": git("log", "-1", "--format=%s")[:100],
        "dirty_src": bool(git("status", "--porcelain", "--", "src")),
    }


def _median(samples: list[dict[str, Any]], key: str) -> dict[str, Any]:
    ordered = sorted(samples, key=lambda r: r[key])
    row = dict(ordered[len(ordered) // 2])
    row["range"] = [ordered[0][key], ordered[-1][key]]
    row["repeats"] = len(ordered)
    return row


def _check_completed(label: str, runs: int, result: dict[str, Any]) -> None:
    """A figure counts only if every run of it went through all its steps."""
    done = (
        result.get("outcomes", {}).get("completed", 0)
        if "outcomes" in result
        else result["completed"]
    )
    if done != runs or ("outcomes" in result and len(result["outcomes"]) != 1):
        raise RuntimeError(f"{label}: {done} of {runs} runs completed ({result})")


def _supports_call_and_move() -> bool:
    try:
        result = run_child(
            "benchmarks.bench_peers",
            {"kind": "interlock", "runs": 1, "script": "call-and-move", "deadline": 2.0},
            timeout=60,
        )
    except (RuntimeError, subprocess.TimeoutExpired):
        return False
    return result.get("outcomes") == {"completed": 1}


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    repeats = 1 if quick else 3
    seq_runs = {
        "interlock": 5 if quick else 200,
        "burr": 5 if quick else 300,
        "plain": 50 if quick else 20_000,
    }
    durable_runs = 3 if quick else 40
    notes: list[str] = [] if HAVE_BURR else [NO_BURR]
    started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    total_phases = 5

    # 1. in memory, one run at a time
    progress("in memory, one run at a time", 0 / total_phases)
    memory_plan: list[tuple[str, dict[str, Any]]] = [
        (INTERLOCK, {"kind": "interlock", "runs": seq_runs["interlock"], "warmup": 2}),
        (PLAIN, {"kind": "plain", "runs": seq_runs["plain"], "warmup": 10}),
    ]
    if _supports_call_and_move():
        memory_plan.insert(
            1,
            (
                CALL_AND_MOVE,
                {
                    "kind": "interlock",
                    "runs": seq_runs["interlock"],
                    "warmup": 2,
                    "script": "call-and-move",
                },
            ),
        )
    else:
        notes.append(
            "This tree does not accept a tool call naming the state to move to "
            '(`{"tool", "args", "next"}`): no call-and-move row.'
        )
    if importlib.import_module("interlock.core._view").DECIDE_IMPLEMENTATION == "compiled":
        memory_plan.insert(
            1,
            (
                TWIN,
                {
                    "kind": "interlock",
                    "runs": seq_runs["interlock"],
                    "warmup": 2,
                    "decide": "python",
                },
            ),
        )
    if HAVE_BURR:
        memory_plan.insert(1, (BURR, {"kind": "burr", "runs": seq_runs["burr"], "warmup": 5}))
        memory_plan.insert(
            2,
            (
                BURR_EXPR,
                {"kind": "burr", "runs": seq_runs["burr"], "warmup": 5, "condition": "expr"},
            ),
        )
        memory_plan.insert(
            3,
            (BURR_ASYNC, {"kind": "burr", "runs": seq_runs["burr"], "warmup": 5, "async": True}),
        )
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in memory_plan}
    for _rep in range(repeats):
        for label, config in memory_plan:
            result = run_child("benchmarks.bench_peers", config)
            result["us_per_step"] = result["wall_s"] / (config["runs"] * STEPS) * 1e6
            result["cpu_us_per_step"] = result["cpu_s"] / (config["runs"] * STEPS) * 1e6
            result["runs"] = config["runs"]
            if "flushes" in result:
                result["flushes_per_step"] = result["flushes"] / (config["runs"] * STEPS)
            _check_completed(label, config["runs"], result)
            samples[label].append(result)
    memory_rows = [
        {"label": label, **_median(samples[label], "us_per_step")} for label, _ in memory_plan
    ]

    # 2. durable, one run at a time
    progress("durable in SQLite (synchronous=FULL)", 1 / total_phases)
    durable_plan: list[tuple[str, str, dict[str, Any]]] = [
        (f"interlock, {kind} tool", kind, {"kind": "interlock", "store": "sqlite", "tool": kind})
        for kind in TOOL_KINDS
    ]
    if HAVE_BURR:
        durable_plan += [
            (BURR_SQLITE, "", {"kind": "burr", "sqlite": "default"}),
            (BURR_SQLITE_WAL, "", {"kind": "burr", "sqlite": "wal"}),
        ]
    dsamples: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in durable_plan}
    for _rep in range(repeats):
        for label, _kind, config in durable_plan:
            result = run_child(
                "benchmarks.bench_peers", {**config, "runs": durable_runs, "warmup": 1}
            )
            steps = durable_runs * STEPS
            result["steps_per_s"] = steps / result["wall_s"]
            if "flushes" in result:
                result["flushes_per_step"] = result["flushes"] / steps
            _check_completed(label, durable_runs, result)
            dsamples[label].append(result)
    durable_rows = []
    strace = shutil.which("strace")
    small, large = (1, 2) if quick else (2, 12)
    for label, kind, config in durable_plan:
        row = {"label": label, "tool": kind, **_median(dsamples[label], "steps_per_s")}
        row["steps_per_s_range"] = row.pop("range")
        # NOTE: a quick run counts the first row's only: each count runs two children under
        # strace, which took most of the quick run's time when every row was counted
        if strace is not None and not (quick and durable_rows):
            low = count_fsyncs(strace, {**config, "runs": small})
            high = count_fsyncs(strace, {**config, "runs": large})
            row["fsyncs_per_step"] = (high - low) / ((large - small) * STEPS)
            # the raw counts too: the difference can be 0 (or below) when the larger run's
            # group commits happen to cover its extra steps, but each run fsyncs at least once
            row["fsyncs"] = [low, high]
        durable_rows.append(row)
    if strace is None:
        notes.append(
            "strace is not installed: fsyncs per step not counted (the store's flushes are)"
        )
    elif quick:
        notes.append("quick run: fsyncs per step counted for the first durable row only")

    # 3. concurrent runs (bench_concurrency's workload and child)
    progress("concurrent runs", 2 / total_phases)
    sizes = (100, 300) if quick else (10_000, 100_000)
    concurrency_rows = []
    for size in sizes:
        for label, runtime in (("bare trio", "trio"), ("interlock", "interlock")):
            progress(f"concurrent: {label}, {size:,} runs", 2 / total_phases)
            result = run_child(
                "benchmarks.bench_concurrency",
                {"runtime": runtime, "runs": size, "steps": 10, "gc": "default"},
                timeout=1800,
            )
            concurrency_rows.append(
                {
                    "label": label,
                    "runs": size,
                    **{
                        k: result.get(k)
                        for k in ("wall_s", "cpu_s", "gc_s", "peak_rss_mib", "completed", "flushes")
                    },
                }
            )

    # 4. instructions per step
    progress("instructions per step (cachegrind)", 3 / total_phases)
    valgrind = shutil.which("valgrind")
    instruction_rows = []
    if quick:
        notes.append("quick run: cachegrind not run (each count starts an interpreter under it)")
    elif valgrind is None:
        notes.append("valgrind is not installed: instructions per step not counted")
    else:
        plan = [
            (INTERLOCK, {"kind": "interlock"}, (5, 25)),
            (PLAIN, {"kind": "plain"}, (200, 2_000)),
        ]
        if importlib.import_module("interlock.core._view").DECIDE_IMPLEMENTATION == "compiled":
            plan.insert(1, (TWIN, {"kind": "interlock", "decide": "python"}, (5, 25)))
        if HAVE_BURR:
            plan.insert(1, (BURR, {"kind": "burr"}, (10, 50)))
        for label, config, (lo, hi) in plan:
            low = count_instructions(valgrind, {**config, "runs": lo})
            high = count_instructions(valgrind, {**config, "runs": hi})
            instruction_rows.append(
                {"label": label, "runs": [lo, hi], "per_step": (high - low) / ((hi - lo) * STEPS)}
            )

    # 5. profiles of the interlock cases (cProfile, own time)
    progress("profiles", 4 / total_phases)
    prof_memory = run_child(
        "benchmarks.bench_peers",
        {"kind": "interlock", "runs": seq_runs["interlock"] // 2 or 2, "warmup": 1, "profile": 14},
    )
    prof_durable = run_child(
        "benchmarks.bench_peers",
        {
            "kind": "interlock",
            "store": "sqlite",
            "tool": "idempotent",
            "runs": durable_runs // 2 or 2,
            "warmup": 1,
            "profile": 14,
        },
    )
    current = {
        "label": os.environ.get("PEERS_LABEL", ""),
        "workload_version": WORKLOAD_VERSION,
        "date": started_at,
        "git": _git(),
        "quick": quick,
        "memory": memory_rows,
        "durable": durable_rows,
        "durable_runs": durable_runs,
        "concurrency": concurrency_rows,
        "instructions": instruction_rows,
        "profile": prof_memory["profile"],
        "profile_areas": prof_memory["profile_areas"],
        "profile_durable": prof_durable["profile"],
        "profile_durable_areas": prof_durable["profile_areas"],
        "notes": notes,
    }
    return {"steps": STEPS, "runs": [current], **current}


def carry(previous: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """On ``--merge``: keep the earlier runs of this section beside the new one (before/after).

    The new run is labelled by ``PEERS_LABEL`` or, without it, ``before`` when it is the
    first and ``after`` otherwise; at most the four latest runs are kept.
    """
    earlier = [
        r
        for r in previous.get("runs", [])
        if not r.get("quick") and r.get("workload_version") == WORKLOAD_VERSION
    ]
    latest = dict(new["runs"][-1])
    latest["label"] = latest["label"] or ("after" if earlier else "before")
    history = [*earlier, latest][-4:]
    return {**new, **latest, "runs": history}


# -- lookups for the goals and the report --------------------------------------------------


def find(rows: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["label"] == label), None)


def conc(run: dict[str, Any], label: str, size: int) -> dict[str, Any] | None:
    return next((r for r in run["concurrency"] if r["label"] == label and r["runs"] == size), None)


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    runs = results.get("runs") or [results]
    parts = [
        "The peers' workloads of issue 19, each ratio within one run (see `benchmarks/peers.md` and "
        "this module's docstring). A step is one model call (interlock) or one action (Burr): 19 "
        "calls of the no-op tool, then a move to DONE, one run at a time.",
    ]
    for run in runs:
        git = run.get("git", {})
        head = (
            f"**{run.get('label') or 'this run'}**: checkout `{git.get('commit', '?')}` "
            f"({git.get('subject', '')}){' with uncommitted src/' if git.get('dirty_src') else ''}, "
            f"{run.get('date', '')}"
        )
        parts += ["", head, ""]
        burr = find(run["memory"], BURR)
        plain = find(run["memory"], PLAIN)
        body = [
            (
                row["label"],
                f"{row['runs']:,}",
                num(row["us_per_step"]),
                f"{num(row['range'][0])}–{num(row['range'][1])}",
                num(row["cpu_us_per_step"]),
                ratio(row["us_per_step"] / burr["us_per_step"]) if burr else "–",
                ratio(row["us_per_step"] / plain["us_per_step"]) if plain else "–",
                num(row["flushes"] / (row["runs"] * STEPS), 2) if "flushes" in row else "–",
            )
            for row in run["memory"]
        ]
        parts.append(
            table(
                [
                    "in memory",
                    "runs",
                    "µs/step (median)",
                    "range",
                    "CPU µs/step",
                    "× Burr",
                    "× plain loop",
                    "store flushes/step",
                ],
                body,
            )
        )
        bs = find(run["durable"], BURR_SQLITE)
        body = [
            (
                row["label"],
                num(row["steps_per_s"], 0),
                f"{num(row['steps_per_s_range'][0], 0)}–{num(row['steps_per_s_range'][1], 0)}",
                ratio(row["steps_per_s"] / bs["steps_per_s"]) if bs else "–",
                num(row.get("fsyncs_per_step"), 2),
                num(row.get("flushes_per_step"), 2),
            )
            for row in run["durable"]
        ]
        parts += [
            "",
            table(
                [
                    f"durable, SQLite synchronous=FULL ({run['durable_runs']} runs)",
                    "steps/s (median)",
                    "range",
                    "× Burr's persister",
                    "fsyncs/step (strace)",
                    "store flushes/step",
                ],
                body,
            ),
        ]
        body = []
        for row in run["concurrency"]:
            bare = conc(run, "bare trio", row["runs"])
            body.append(
                (
                    f"{row['runs']:,}",
                    row["label"],
                    num(row["wall_s"], 2),
                    ratio(row["wall_s"] / bare["wall_s"]) if bare else "–",
                    num(row["cpu_s"], 2),
                    num(row["peak_rss_mib"], 0),
                    ratio(row["peak_rss_mib"] / bare["peak_rss_mib"]) if bare else "–",
                )
            )
        parts += [
            "",
            table(
                [
                    "concurrent runs",
                    "configuration",
                    "wall s",
                    "× bare trio",
                    "CPU s",
                    "peak RSS MiB",
                    "RSS × bare trio",
                ],
                body,
            ),
        ]
        if run["instructions"]:
            base = find(run["instructions"], PLAIN)
            parts += [
                "",
                table(
                    [
                        "instructions (cachegrind)",
                        "runs counted",
                        "thousand per step",
                        "× plain loop",
                    ],
                    [
                        (
                            r["label"],
                            f"{r['runs'][0]:,} → {r['runs'][1]:,}",
                            num(r["per_step"] / 1000),
                            ratio(r["per_step"] / base["per_step"]) if base else "–",
                        )
                        for r in run["instructions"]
                    ],
                ),
            ]
        if run.get("profile_areas"):
            from benchmarks._harness import top_areas

            parts += [
                "",
                f"Own time by area, in memory: {top_areas(run['profile_areas'])}; durable (idempotent "
                f"tool): {top_areas(run['profile_durable_areas'])}.",
            ]
        parts += [f"- {note}" for note in run.get("notes", [])]
    return "\n".join(parts)


if __name__ == "__main__":
    child_main(_child)
