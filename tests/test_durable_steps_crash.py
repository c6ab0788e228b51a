"""Fewer flushes, same guarantees (#19), under SIGKILL: a real process running runs that call
a read-only, an idempotent, a not idempotent and a reconciling tool in turn (its steps
answered before they are durable where that is harmless) is killed again and again, then
resumed to the end.

Asserts: every run ends; each key of the tool that is not idempotent was executed at most
once, and once if committed; each key of the reconciling one likewise; the idempotent tool
ran only under keys whose intent (with the same args) the journal holds, so a re-execution
is one with the same key; only the read-only tool ran calls the journal never recorded;
and ``interlock replay --all`` reproduces every run.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import trio

from interlock.events import Escalated, IntentRecorded, ToolCommitted
from interlock.stores import open_sqlite_store

pytestmark = pytest.mark.slow

APP = str(Path(__file__).with_name("durable_app.py"))
RUNS = 40
KILLS = 3


def executions(effects: Path) -> list[tuple[str, str, str]]:
    try:
        db = sqlite3.connect(f"file:{effects}?mode=ro", uri=True, timeout=5)
        try:
            return list(db.execute("SELECT tool, key, args FROM executions"))
        finally:
            db.close()
    except sqlite3.Error:
        return []


def start(mode: str, journal: Path, effects: Path, kill: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, APP, mode, str(journal), str(effects), str(RUNS), str(kill)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def journal_of(path: Path) -> dict[str, list]:
    store = await open_sqlite_store(str(path), readonly=True)
    try:
        return {r.run_id: await store.load(r.run_id) for r in await store.list_runs()}
    finally:
        await store.aclose()


def test_sigkill_mid_step_loses_nothing_of_exactly_once(tmp_path: Path) -> None:
    journal, effects = tmp_path / "journal.db", tmp_path / "effects.db"
    rng = random.Random(19)
    kills = 0
    for round_ in range(KILLS):
        proc = start("run" if round_ == 0 else "resume", journal, effects)
        target = len(executions(effects)) + rng.randint(1, 25)
        give_up = time.monotonic() + 60  # a hang guard, not a timing
        while proc.poll() is None and len(executions(effects)) < target:
            assert time.monotonic() < give_up, "the app made no progress in 60 s"
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.01))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        _, err = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGKILL), err
    # Then the process kills itself just after an execution, any tool's: a read-only
    # call that ran ahead of its intent, an idempotent one, one that is now in doubt.
    suicides = 0
    for _ in range(40):
        proc = start("resume", journal, effects, kill=0.03)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, -signal.SIGKILL), err
        if proc.returncode == 0:
            break
        suicides += 1
    final = start("resume", journal, effects)
    _, err = final.communicate(timeout=120)
    assert final.returncode == 0, err
    assert kills >= 2
    assert suicides >= 2

    runs = trio.run(journal_of, journal)
    assert len(runs) == RUNS
    intents: dict[str, IntentRecorded] = {}
    committed: set[str] = set()
    outcomes = Counter()
    for events in runs.values():
        last = events[-1]
        outcomes[type(last).__name__] += 1
        if type(last) is Escalated:
            # Only a call in doubt: of the tool that can neither repeat nor reconcile, or of
            # the reconciling one once a crash cut its reconcile too (its limit is one).
            assert last.reason == "in_doubt_side_effect"
            assert "tool 'send'" in last.detail or "reconciliations" in last.detail
        for event in events:
            if type(event) is IntentRecorded:
                intents[event.key] = event
            elif type(event) is ToolCommitted:
                committed.add(event.key)
    assert set(outcomes) <= {"Completed", "Escalated"}, outcomes

    ran: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for tool, key, args in executions(effects):
        ran[tool, key].append(json.loads(args))
    unrecorded = Counter()
    for (tool, key), calls in ran.items():
        intent = intents.get(key)
        if intent is None:
            # Only a read-only call may have run without its intent ever being durable.
            assert tool == "look", (tool, key)
            unrecorded[tool] += len(calls)
            continue
        assert intent.tool == tool
        assert all(args == intent.args for args in calls), (key, calls, intent.args)
        if tool in ("send", "charge"):
            assert len(calls) == 1, (tool, key, len(calls))
    for key in committed:
        intent = intents[key]
        assert (intent.tool, key) in ran, f"{key} committed but never executed"
    reexecuted = {
        tool: sum(len(c) - 1 for (t, _), c in ran.items() if t == tool and len(c) > 1)
        for tool in ("look", "put")
    }

    replayed = subprocess.run(
        [
            *(sys.executable, "-m", "interlock", "replay", "--all"),
            *("--db", str(journal), "--app", f"{APP}:machines", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = json.loads(replayed.stdout)
    assert replayed.returncode == 0, report.get("diverged", replayed.stderr)[:3]
    assert report["reproduced"] == RUNS
    print(
        f"\ndurable crash test: kills={kills}+{suicides} outcomes={dict(outcomes)} "
        f"executions={sum(map(len, ran.values()))} keys={len(ran)} "
        f"re-executed={reexecuted} read-only calls never journaled={unrecorded['look']}"
    )
