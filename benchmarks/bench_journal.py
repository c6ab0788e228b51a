"""Journal throughput: events per second for append + flush, by store, durability and batch size.

The events are those of a real 20-step run of the benchmark machine (run_started, 20
model_called with their prompts, 19 intent_recorded and 19 tool_committed, transitioned,
completed: 61 events), cloned under fresh run ids and idempotency keys. They are appended
in batches of 1, 100, 1,000 and 10,000 events (each batch is what one supervisor turn
hands the store), each configuration into a fresh file:

- *SQLite store*: ``open_sqlite_store(path, synchronous=...)`` and ``await store.append(batch)``,
  the real group commit (encode + frame the events, one worker-thread hop, one
  ``BEGIN IMMEDIATE`` ... ``COMMIT`` that inserts the events and updates the runs index),
  with ``synchronous=FULL`` (an fsync per commit) and ``NORMAL`` (WAL synced at checkpoints);
- *plain file*: ``frame_events`` of the msgpack-encoded events, one ``write`` and one
  ``fsync`` per batch (and, for reference, the write without the fsync);
- *baseline*: SQLite with one ``INSERT`` per ``COMMIT`` (no batching), ``FULL`` and ``NORMAL``,
  through ``sqlite3`` directly on a table of the store's shape;
- *SQLite ceiling*: pre-encoded rows, one ``executemany`` per 1,000-row transaction, into a
  table of the store's shape with nothing else (no runs index, no checks): what SQLite
  itself manages on this machine, the most any store design with one row per event gets;
- the store again with *small* events: the same run made by a provider that records no
  prompt text, to show how much of the cost is the bytes of the prompts.

Slow configurations stop after a time budget; the figure is events written / seconds.
Also measured: encode + frame per event (``encode_rows``, what every store does first),
and ``frame_events`` alone, compiled against the pure twin.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from benchmarks._harness import Progress, no_progress, profile
from benchmarks._workload import TOTAL, build_machine, step_script
from interlock import open_supervisor
from interlock.events import Event, IntentRecorded, ToolCommitted, encode_event
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore, open_sqlite_store
from interlock.stores._base import encode_rows

NAME = "journal"
TITLE = "Journal throughput: SQLite group commit, a plain file, one commit per event"

BATCH_SIZES = (1, 100, 1_000, 10_000)
_EVENTS_DDL = """CREATE TABLE events (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, ts REAL NOT NULL,
    key TEXT, body BLOB NOT NULL, PRIMARY KEY (run_id, seq)) WITHOUT ROWID"""


def template_run(*, prompt_free: bool = False) -> list[Event]:
    """The journal of one real 20-step run of the benchmark machine.

    With ``prompt_free``, the provider records no prompt text (small model_called events).
    """
    from benchmarks.bench_loop import PromptFreeProvider

    machine = build_machine()
    script = step_script(20)
    store = MemoryStore()

    async def main() -> str:
        provider: Any = (
            PromptFreeProvider(script)
            if prompt_free
            else ScriptedProvider(lambda view: script[view.steps])
        )
        async with open_supervisor([machine], store, provider=provider) as supervisor:
            handle = await supervisor.start_run(machine.name, {"total": TOTAL}, run_id="template")
        await handle.wait()
        return handle.run_id

    run_id = trio.run(main)
    return list(trio.run(store.load, run_id))


def clone_events(template: list[Event], count: int) -> list[Event]:
    """``count`` events: copies of ``template`` under fresh run ids (and keys), run after run."""
    events: list[Event] = []
    replace = msgspec.structs.replace
    run = 0
    while len(events) < count:
        run_id = f"j{run:07d}"
        for event in template:
            if isinstance(event, IntentRecorded | ToolCommitted):
                key = f"{run_id}:{event.key.split(':', 1)[1]}"
                events.append(replace(event, run_id=run_id, key=key))
            else:
                events.append(replace(event, run_id=run_id))
        run += 1
    return events[:count]


def _batches(events: list[Event], size: int, limit: int) -> list[list[Event]]:
    """Whole runs only would be ideal; batches may split a run, which stores allow."""
    limit = min(limit, len(events))
    return [events[i : i + size] for i in range(0, limit, size)]


def _events_budget(size: int, quick: bool) -> int:
    if quick:
        return {1: 200, 100: 2_000, 1_000: 4_000, 10_000: 20_000}[size]
    return {1: 5_000, 100: 100_000, 1_000: 200_000, 10_000: 300_000}[size]


def sqlite_store(
    events: list[Event],
    size: int,
    synchronous: str,
    directory: Path,
    budget_s: float,
    limit: int,
    tag: str = "",
) -> dict[str, Any]:
    path = directory / f"store-{synchronous}-{size}{tag}.db"
    batches = _batches(events, size, limit)

    async def main() -> tuple[int, float]:
        store = await open_sqlite_store(path, synchronous=synchronous)
        written = 0
        started = time.perf_counter()
        try:
            for batch in batches:
                await store.append(batch)
                written += len(batch)
                if time.perf_counter() - started > budget_s:
                    break
            elapsed = time.perf_counter() - started
        finally:
            await store.aclose()
        return written, elapsed

    written, elapsed = trio.run(main)
    return {"events": written, "seconds": elapsed, "events_per_s": written / elapsed}


def plain_file(
    events: list[Event], size: int, directory: Path, budget_s: float, limit: int, fsync: bool
) -> dict[str, Any]:
    frame_events = importlib.import_module("interlock.core._hotpath").frame_events
    path = directory / f"journal-{size}-{'fsync' if fsync else 'nofsync'}.bin"
    batches = _batches(events, size, limit)
    written = 0
    with open(path, "ab", buffering=0) as file:
        started = time.perf_counter()
        for batch in batches:
            file.write(frame_events([encode_event(e) for e in batch]))
            if fsync:
                os.fsync(file.fileno())
            written += len(batch)
            if time.perf_counter() - started > budget_s:
                break
        elapsed = time.perf_counter() - started
    return {"events": written, "seconds": elapsed, "events_per_s": written / elapsed}


def sqlite_per_event(
    events: list[Event], synchronous: str, directory: Path, budget_s: float
) -> dict[str, Any]:
    """The baseline: one INSERT, one COMMIT per event, straight through sqlite3."""
    frame_event = importlib.import_module("interlock.core._hotpath").frame_event
    path = directory / f"per-event-{synchronous}.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute(_EVENTS_DDL)
    insert = "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)"
    written = 0
    started = time.perf_counter()
    for event in events:
        key = getattr(event, "key", None)
        tag = type(event).__struct_config__.tag
        conn.execute("BEGIN")
        conn.execute(
            insert, (event.run_id, event.seq, tag, event.ts, key, frame_event(encode_event(event)))
        )
        conn.execute("COMMIT")
        written += 1
        if written % 50 == 0 and time.perf_counter() - started > budget_s:
            break
    elapsed = time.perf_counter() - started
    conn.close()
    return {"events": written, "seconds": elapsed, "events_per_s": written / elapsed}


def encode_cost(events: list[Event]) -> dict[str, Any]:
    """Microseconds per event for encode + frame (``encode_rows``) and for framing alone."""
    sample = events[:20_000]
    started = time.perf_counter()
    encode_rows(sample)
    rows_us = (time.perf_counter() - started) / len(sample) * 1e6
    payloads = [encode_event(e) for e in sample]
    started = time.perf_counter()
    for event in sample:
        encode_event(event)
    encode_us = (time.perf_counter() - started) / len(sample) * 1e6
    framing = {}
    for label, module in (
        ("compiled", "interlock.core._hot"),
        ("pure Python", "interlock.core._hot_py"),
    ):
        frame_events = importlib.import_module(module).frame_events
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            frame_events(payloads)
            best = min(best, time.perf_counter() - started)
        framing[label] = best / len(payloads) * 1e6
    return {
        "encode_rows_us": rows_us,
        "encode_event_us": encode_us,
        "frame_events_us": framing,
        "mean_payload_bytes": sum(map(len, payloads)) / len(payloads),
    }


def sqlite_ceiling(
    events: list[Event], size: int, synchronous: str, directory: Path, tag: str
) -> dict[str, Any]:
    """Pre-encoded rows, one ``executemany`` per transaction, no runs index: SQLite alone."""
    rows = [_as_tuple(r) for r in encode_rows(events)]
    conn = sqlite3.connect(
        directory / f"ceiling-{synchronous}-{size}-{tag}.db", isolation_level=None
    )
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute(_EVENTS_DDL)
    started = time.perf_counter()
    for i in range(0, len(rows), size):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", rows[i : i + size])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return {"events": len(rows), "seconds": elapsed, "events_per_s": len(rows) / elapsed}


def _as_tuple(row: Any) -> tuple[Any, ...]:
    """A row of ``encode_rows`` as a plain tuple, whether it is a tuple or a Struct."""
    return row if isinstance(row, tuple) else msgspec.structs.astuple(row)


def profile_store_work(events: list[Event], directory: Path) -> Any:
    """Profile ``SQLiteStore.append`` (batches of 1,000, NORMAL), its worker thread included.

    The store hands its SQL to ``trio.to_thread.run_sync``, a thread cProfile does not
    see; while profiling, that function is swapped for one that runs the same callable
    on the calling thread, so the profile covers the whole append.
    """

    async def inline(fn: Any, *args: Any, **kwargs: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    async def main() -> None:
        store = await open_sqlite_store(directory / "profiled.db", synchronous="NORMAL")
        try:
            for i in range(0, len(events), 1_000):
                await store.append(events[i : i + 1_000])
        finally:
            await store.aclose()

    real = trio.to_thread.run_sync
    trio.to_thread.run_sync = inline  # type: ignore[assignment]
    try:
        return profile(lambda: trio.run(main), top=14)
    finally:
        trio.to_thread.run_sync = real


def store_cpu(quick: bool, directory: str) -> dict[str, Any]:
    """The SQLite store's CPU per event (benchmarks/sqlite_append): the batches a supervisor
    hands its store when 1,000 external runs of the gateway benchmark's machine each propose
    a transition per round (one group commit per round, ~2 events per run), and the same
    events one run's step per batch."""
    from benchmarks.sqlite_append import RUNS, capture, per_run, replay, starts

    rounds = 12 if quick else 60
    batches = capture(RUNS, rounds)
    first = starts(batches)
    # the starts and a sixth of the rounds warm the file up; the rest are measured
    gateway = replay(batches, first + (len(batches) - first) // 6, directory=directory)
    # one run's step per batch: the starts and 2 (quick) or 4 rounds warm up, 2 or 8 measured
    one_run = per_run(batches)[: RUNS * (5 if quick else 13)]
    single = replay(one_run, RUNS * (3 if quick else 5), directory=directory)
    return {
        "runs": RUNS,
        "rounds": rounds,
        "events_per_run": sum(map(len, batches[first:])) / (len(batches) - first) / RUNS,
        "gateway": gateway,
        "one_run": single,
    }


def run(quick: bool, progress: Progress = no_progress) -> dict[str, Any]:
    budget_s = 0.5 if quick else 2.0
    progress("recording template runs", 0.0)
    pool = 30_000 if quick else 300_000
    template = template_run()
    events = clone_events(template, pool)
    small = clone_events(template_run(prompt_free=True), pool // 2)
    plan: list[tuple[str, str, str, int]] = []
    for size in BATCH_SIZES:
        plan += [
            ("SQLite store", "real", "FULL", size),
            ("SQLite store", "real", "NORMAL", size),
            ("file, write + fsync", "real", "fsync", size),
            ("file, write only", "real", "none", size),
        ]
    plan += [
        ("SQLite, one insert per commit", "real", "FULL", 1),
        ("SQLite, one insert per commit", "real", "NORMAL", 1),
    ]
    for size in (1_000, 10_000):
        plan += [("SQLite store", "small", "FULL", size), ("SQLite store", "small", "NORMAL", size)]
    for mix in ("real", "small"):
        plan += [("SQLite ceiling", mix, "FULL", 1_000), ("SQLite ceiling", mix, "NORMAL", 1_000)]
    rows: list[dict[str, Any]] = []
    steps = len(plan) + 2
    with tempfile.TemporaryDirectory(prefix="interlock-bench-journal-") as tmp:
        directory = Path(tmp)
        for done, (store, mix, mode, size) in enumerate(plan):
            progress(f"{store} ({mix}) {mode} batch {size:,}", (done + 1) / steps)
            stream = events if mix == "real" else small
            limit = _events_budget(size, quick)
            if store == "SQLite store":
                result = sqlite_store(stream, size, mode, directory, budget_s, limit, f"-{mix}")
            elif store == "SQLite ceiling":
                ceiling_events = stream[: _events_budget(size, quick) // (2 if quick else 3)]
                result = sqlite_ceiling(ceiling_events, size, mode, directory, mix)
            elif store.startswith("file"):
                result = plain_file(stream, size, directory, budget_s, limit, mode == "fsync")
            else:
                result = sqlite_per_event(stream, mode, directory, budget_s)
            result.update(store=store, mix=mix, sync=mode, batch=size)
            rows.append(result)
        progress("encode + frame cost", (len(plan) + 1) / steps)
        encoding = encode_cost(events)
        encoding["small_payload_bytes"] = encode_cost(small[:5_000])["mean_payload_bytes"]
        progress("the SQLite store's CPU per event, at the gateway's batch shape", 1.0)
        shapes = store_cpu(quick, str(directory))
        progress("profiling the SQLite store's append", 1.0)
        prof = profile_store_work(events[: 20_000 if quick else 100_000], directory)
    return {
        "shapes": shapes,
        "template_events": len(template),
        "events_pool": len(events),
        "budget_s": budget_s,
        "rows": rows,
        "encoding": encoding,
        "profile": prof.rows,
        "profile_areas": prof.areas,
    }


def find(results: dict[str, Any], store: str, sync: str, batch: int) -> dict[str, Any] | None:
    for row in results["rows"]:
        if row["store"] == store and row["sync"] == sync and row["batch"] == batch:
            return row
    return None


def render(results: dict[str, Any]) -> str:
    from benchmarks._report import num, ratio, table

    baseline = find(results, "SQLite, one insert per commit", "FULL", 1)
    base = baseline["events_per_s"] if baseline else float("nan")
    body = [
        (
            row["store"],
            row.get("mix", "real"),
            row["sync"],
            f"{row['batch']:,}",
            f"{row['events']:,}",
            num(row["events_per_s"], 0),
            ratio(row["events_per_s"] / base),
        )
        for row in results["rows"]
    ]
    enc = results["encoding"]
    return "\n".join(
        [
            f"Events of a real 20-step run ({results['template_events']} events; mean msgpack payload "
            f"{enc['mean_payload_bytes']:,.0f} bytes, most of it the prompts model_called records), "
            "cloned under fresh run ids. *small* rows use the events of the same run made by a provider "
            f"that records no prompt (mean payload {enc.get('small_payload_bytes', float('nan')):,.0f} bytes). "
            f"Each configuration stops after {results['budget_s']:g} s. *SQLite ceiling* inserts "
            "pre-encoded rows with one `executemany` per transaction into a table of the store's shape "
            "and nothing else: what SQLite itself does on this machine.",
            "",
            table(
                [
                    "store",
                    "events",
                    "sync",
                    "batch",
                    "events written",
                    "events/s",
                    "× one insert per commit (FULL)",
                ],
                body,
            ),
            "",
            f"Encode + frame per event (`encode_rows`, the first thing every store does): "
            f"**{enc['encode_rows_us']:.2f} µs** (msgpack encoding alone {enc['encode_event_us']:.2f} µs; "
            f"`frame_events` compiled {enc['frame_events_us']['compiled']:.2f} µs, pure Python "
            f"{enc['frame_events_us']['pure Python']:.2f} µs per event).",
            *_shapes_text(results.get("shapes")),
        ]
    )


def _shapes_text(shapes: dict[str, Any] | None) -> list[str]:
    """The SQLite store's CPU per event at the gateway's batch shape and one run at a time."""
    if not shapes:
        return []

    def cpu(row: dict[str, Any]) -> str:
        total = row["encode_us"] + row["write_us"] + row["checkpoint_us"]
        return (
            f"**{total:.2f} µs** (grouping and encoding on the caller's thread "
            f"{row['encode_us']:.2f}, the writer's SQL {row['write_us']:.2f}, the checkpoint "
            f"thread {row['checkpoint_us']:.2f})"
        )

    return [
        "",
        f"The SQLite store's CPU per event (NORMAL; `benchmarks/sqlite_append.py`), at the "
        f"gateway's batch shape: {shapes['runs']:,} external runs each proposing a transition per "
        f"round, one group commit per round ({shapes['events_per_run']:.1f} events per run, "
        f"{shapes['rounds']} rounds): {cpu(shapes['gateway'])}; the same events one run's step "
        f"per batch: {cpu(shapes['one_run'])}.",
    ]
