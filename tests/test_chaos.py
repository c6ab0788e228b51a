"""The chaos test (#14): 1,000 concurrent runs of the seed workflows on SQLite, where the
provider and the tools fail in every way tests/chaos_app.py knows, with two SIGKILLs and
resumes. The runtime must never crash, every run must end terminal, the downstream must
show no duplicate side effect, and every run must replay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from interlock import replay
from interlock.demo.workflows import Backend
from interlock.stores import open_sqlite_store

APP = Path(__file__).with_name("chaos_app.py")
RUNS = 1000
SEED = 7

pytestmark = pytest.mark.slow


def load_app() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_app", APP)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start(mode: str, db: Path, effects: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, str(APP), mode, str(db), str(effects), str(RUNS), str(SEED)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def events_in(db: Path) -> int:
    """Events journaled so far (0 before the file exists), read by a second connection."""
    import sqlite3

    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            # the runs index holds each run's last seq: their sum is the events journaled
            return int(conn.execute("SELECT COALESCE(SUM(seq), 0) FROM runs").fetchone()[0])
    except sqlite3.OperationalError:
        return 0  # the schema is not there yet


def kill_after(process: subprocess.Popen[bytes], db: Path, grown_by: int) -> None:
    """SIGKILL ``process`` once the journal has grown by ``grown_by`` events."""
    before = events_in(db)
    give_up = time.monotonic() + 60
    while events_in(db) < before + grown_by and process.poll() is None:
        assert time.monotonic() < give_up, "the chaos app made no progress"
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()[1].decode()[-2000:]
    process.send_signal(signal.SIGKILL)
    process.communicate()


async def journal(db: Path) -> tuple[list[Any], dict[str, list[Any]]]:
    store = await open_sqlite_store(str(db))
    try:
        records = await store.list_runs()
        return records, {r.run_id: await store.load(r.run_id) for r in records}
    finally:
        await store.aclose()


def _reissued_after_a_failure(runs: dict[str, list[Any]]) -> Counter[str]:
    """Per tool, the runs in which a call failed and the same call was made again."""
    reissued: Counter[str] = Counter()
    for events in runs.values():
        calls: dict[str, tuple[str, bytes]] = {}
        failed: set[tuple[str, bytes]] = set()
        again: set[str] = set()
        for event in events:
            if type(event).__name__ == "IntentRecorded":
                call = (event.tool, msgspec.json.encode(event.args, order="sorted"))
                if call in failed:
                    again.add(event.tool)
                calls[event.key] = call
            elif type(event).__name__ == "ToolFailed" and event.key in calls:
                failed.add(calls[event.key])
        reissued.update(again)
    return reissued


def test_chaos_with_two_crashes(tmp_path: Path) -> None:
    db, effects = tmp_path / "chaos.db", tmp_path / "chaos-effects.db"
    kill_after(start("run", db, effects), db, 3_000)
    unfinished_after_first = sum(r.outcome == "running" for r in trio.run(journal, db)[0])
    kill_after(start("resume", db, effects), db, 2_000)
    final = start("resume", db, effects)
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err.decode()[-3000:]

    records, runs = trio.run(journal, db)
    # every run was started and ended terminal, though two processes died under it
    assert len(records) == RUNS
    assert unfinished_after_first > 0
    assert Counter(r.outcome for r in records)["running"] == 0
    # 0 duplicate side effects, counted from the downstream tables themselves
    backend = Backend(str(effects))
    try:
        counts = backend.counts()
        spec = load_app().machines(backend, SEED)
    finally:
        backend.close()
    # (issue 32: an effect applied twice in one run, under one key or several). What is
    # not guaranteed (the README says so): an idempotent call whose attempts all failed,
    # one of them after the downstream applied it, goes back to its proposer, and the
    # same call made again gets a new key. Only such a call may be counted here.
    reissued = _reissued_after_a_failure(runs)
    for tool, c in counts.items():
        assert c["duplicates"] <= reissued[tool], (tool, c, reissued)
    assert counts["send_email"]["duplicates"] == 0  # not idempotent: in doubt, never reissued
    # every fault happened, and each became an explained outcome of its run
    kinds = Counter(type(e).__name__ for events in runs.values() for e in events)
    messages = " ".join(
        v.message
        for events in runs.values()
        for e in events
        if type(e).__name__ == "ProposalRejected"
        for v in e.violations
    )
    for found in (
        "the provider returned str",
        "the provider returned NoneType",
        "the provider returned bytes",
        "Proposal.raw is int",
        "a lone surrogate",
        "decoded with surrogateescape",
        "duplicate key",
        "over the cap of",
    ):
        assert found in messages, found
    failures = " ".join(
        e.error for events in runs.values() for e in events if type(e).__name__ == "ProviderFailed"
    )
    for found in ("RuntimeError", "ExceptionGroup", "timed out after", "429"):
        assert found in failures, found
    assert kinds["ToolInDoubt"] > 0
    assert kinds["Reconciled"] > 0
    # and replay reproduces every run, event for event
    report = replay(runs, spec)
    assert report.diverged == ()
