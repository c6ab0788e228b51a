"""The SQLite store's CPU per appended event, at the gateway's batch shape and one run at a time.

The batches are real ones: external runs of the gateway benchmark's machine (bench_gateway),
each proposing its next transition, decided by a supervisor in process on a store that only
records what it is handed (no SQLite). Two shapes:

- *gateway*: ``runs`` runs, every round one proposal per run decided with ``submit_nowait``
  and one group commit for the round: what a POST /v1/verify batch or a busy channel hands
  the store (about ``runs`` runs × 2-3 events per batch);
- *per run*: the same proposals appended one run's step at a time (a batch of one run's
  events), as a run driven alone, or bench_peers' durable rows, hands them.

Each shape is then replayed into a fresh SQLite store, calling the store's writer-thread
function (``_append_sync``) directly on the main thread, so its CPU is timed alone
(``time.thread_time``); the batch's encoding and grouping (``_Batch``), which runs on the
caller's thread, is timed apart; the checkpoint thread's CPU is read from /proc.

    python -m benchmarks.sqlite_append [--runs 1000] [--rounds 60] [--synchronous NORMAL]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import uuid
from typing import Any

import trio

from benchmarks.bench_gateway import build_machine, transition
from interlock import open_supervisor
from interlock.core._messages import Sync
from interlock.messages import Propose
from interlock.stores import MemoryStore, _sqlite

#: Runs per batch at the gateway's shape (a POST /v1/verify batch of 1,000).
RUNS = 1000


class Recorder(MemoryStore):
    """A memory store that keeps every batch it is handed, and never writes inline."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[Any]] = []

    def immediate_append(self) -> None:  # type: ignore[override]
        return None

    async def append(self, events: Any) -> None:
        self.batches.append(list(events))
        await super().append(events)


def capture(runs: int, rounds: int) -> list[list[Any]]:
    """The batches a supervisor hands its store: run starts, then ``rounds`` of one
    transition per run, one group commit per round."""
    store = Recorder()

    async def main() -> None:
        async with open_supervisor([build_machine()], store) as sup:
            # run ids as the gateway benchmark makes them (18 characters)
            ids = [f"g-{uuid.UUID(int=i).hex[-16:]}" for i in range(runs)]
            async with trio.open_nursery() as nursery:
                for run_id in ids:
                    nursery.start_soon(
                        lambda r: sup.start_run("cycle", run_id=r, external=True), run_id
                    )
            where = {r: (sup.view(r).state, sup.view(r).seq) for r in ids}
            for n in range(rounds):
                verdicts = [
                    sup.submit_nowait(
                        Propose(run_id=r, seq=where[r][1], raw=transition(where[r][0], n))
                    )
                    for r in ids
                ]
                await sup.request(Sync(run_id=ids[0]))
                for r, v in zip(ids, verdicts, strict=True):
                    assert v.accepted, v
                    where[r] = (v.state, v.seq)

    trio.run(main)
    return store.batches


def starts(batches: list[list[Any]]) -> int:
    """How many of the captured batches start the runs (before the first round)."""
    return next(
        i for i, b in enumerate(batches) if all(type(e).__name__ != "RunStarted" for e in b)
    )


def per_run(batches: list[list[Any]]) -> list[list[Any]]:
    """The same events, one batch per run per round."""
    out: list[list[Any]] = []
    for batch in batches:
        runs: dict[str, list[Any]] = {}
        for event in batch:
            runs.setdefault(event.run_id, []).append(event)
        out.extend(runs.values())
    return out


def store_module(revision: str = "") -> Any:
    """The SQLite store's module: this checkout's, or (``revision``) the one of that commit,
    loaded beside it (``interlock.stores._sqlite_at_<revision>``), for a before/after in one run."""
    if not revision:
        return _sqlite
    import importlib.util
    import subprocess
    import sys

    name = f"interlock.stores._sqlite_at_{revision.replace('~', '_').replace('^', '_')}"
    source = subprocess.run(
        ["git", "show", f"{revision}:src/interlock/stores/_sqlite.py"],
        check=True,
        capture_output=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="sqlite-at-"), "_sqlite.py")
    with open(path, "wb") as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "interlock.stores"
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def replay(
    batches: list[list[Any]],
    warm: int,
    synchronous: str = "NORMAL",
    directory: str = "",
    module: Any = _sqlite,
) -> dict[str, float]:
    """Append ``batches`` into a fresh store; the figures of those after the first ``warm``."""

    async def main() -> dict[str, float]:
        with tempfile.TemporaryDirectory(dir=directory or None) as tmp:
            store = await module.open_sqlite_store(
                os.path.join(tmp, "j.db"), synchronous=synchronous
            )
            try:
                conn = store._conn
                assert conn is not None
                for batch in batches[:warm]:
                    await store.append(batch)
                # name the checkpoint thread so /proc shows it
                ck = store._checkpointer
                events = sum(len(b) for b in batches[warm:])
                encode = write = 0.0
                cpu = time.thread_time
                ck0 = _ckpt_cpu(ck)
                wall0 = time.perf_counter()
                for batch in batches[warm:]:
                    t0 = cpu()
                    prepared = module._Batch(batch)
                    t1 = cpu()
                    store._append_sync(conn, prepared)
                    t2 = cpu()
                    encode += t1 - t0
                    write += t2 - t1
                    if ck is not None:
                        ck.wrote(prepared.size, len(prepared.chunks))
                wall = time.perf_counter() - wall0
                await trio.sleep(0.3)  # let a checkpoint in flight finish
                ckpt = _ckpt_cpu(ck) - ck0
                size = os.stat(os.path.join(tmp, "j.db")).st_size
            finally:
                await store.aclose()
        return {
            "events": events,
            "encode_us": encode / events * 1e6,
            "write_us": write / events * 1e6,
            "checkpoint_us": ckpt / events * 1e6,
            "wall_us": wall / events * 1e6,
            "db_mib": size / 2**20,
        }

    return trio.run(main)


def _ckpt_cpu(ck: Any) -> float:
    """CPU seconds the store's checkpoint thread has used."""
    if ck is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(ck._thread.ident))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--synchronous", default="NORMAL")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shape", default="gateway,per-run")
    parser.add_argument(
        "--against", default="", help="a git revision whose store to measure in turns with this one"
    )
    args = parser.parse_args()
    modules = {"now": _sqlite}
    if args.against:
        modules[args.against] = store_module(args.against)
    batches = capture(args.runs, args.rounds)
    first = starts(batches)
    sizes = [len(b) for b in batches[first:]]
    print(
        f"captured {len(batches)} batches; after the starts: {len(sizes)} batches of "
        f"{min(sizes)}..{max(sizes)} events, {sum(sizes) / len(sizes) / args.runs:.2f} per run"
    )
    shapes = {"gateway": batches, "per-run": per_run(batches)}
    for shape in args.shape.split(","):
        rows = shapes[shape]
        warm = first + (len(rows) - first) // 6 if shape == "gateway" else len(rows) // 6
        if shape == "per-run":
            rows = rows[: warm + 20_000]
        for _ in range(args.repeat):
            for label, module in modules.items():
                r = replay(rows, warm, args.synchronous, module=module)
                print(
                    f"{label:8} {shape:8} {args.synchronous:6} events {r['events']:>7,}  encode "
                    f"{r['encode_us']:.2f} µs  write {r['write_us']:.2f} µs  checkpoint "
                    f"{r['checkpoint_us']:.2f} µs  wall {r['wall_us']:.2f} µs  db {r['db_mib']:.1f} MiB"
                )


if __name__ == "__main__":
    threading.current_thread().name = "main"
    main()
