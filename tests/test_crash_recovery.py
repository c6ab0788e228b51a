"""Crash safety: a real demo process killed with SIGKILL at random points, then resumed.

Asserts, for SQLite and PostgreSQL: every run ends terminal; no committed event is lost
or duplicated; every side effect counted by the downstream systems (a separate SQLite
file) happened exactly once per key for idempotent tools and at most once for the
non-idempotent email, with every in-doubt email escalated and none silently re-run;
and every recorded run replays without divergence.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest
import trio

from interlock import Completed, Escalated, Failed, IntentRecorded, ToolCommitted, ToolFailed
from interlock.stores._open import open_store

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("INTERLOCK_CRASH_KILLS", "6"))
IDEMPOTENT = ("refund", "write_entities", "record_ticket")


def interlock(*args, **kwargs):
    return [sys.executable, "-m", "interlock", *args]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def journal_url(request, tmp_path):
    if request.param == "sqlite":
        yield str(tmp_path / "journal.db")
        return
    dsn = os.environ.get("INTERLOCK_PG_DSN")
    if not dsn:
        pytest.skip(
            "INTERLOCK_PG_DSN is not set; set it to a PostgreSQL DSN to run the PostgreSQL crash test"
        )
    schema = f"crash_{uuid.uuid4().hex[:12]}"
    separator = "&" if "?" in dsn else "?"
    yield f"{dsn}{separator}schema={schema}"
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def count_runs(url, where=""):
    """Runs in the journal now, read from outside the process under test (0 if none yet)."""
    try:
        if url.startswith("postgresql://"):
            import psycopg

            dsn, _, query = url.partition("?")
            schema = dict(part.split("=", 1) for part in query.split("&") if part)["schema"]
            with psycopg.connect(dsn, autocommit=True) as conn:
                return conn.execute(f'SELECT count(*) FROM "{schema}".runs {where}').fetchone()[0]
        db = sqlite3.connect(f"file:{url}?mode=ro", uri=True, timeout=1)
        try:
            return db.execute(f"SELECT count(*) FROM runs {where}").fetchone()[0]
        finally:
            db.close()
    except Exception:
        return 0


def kill_at_random(cmd, rng, url, window, *, finishing=False):
    """Start ``cmd``, wait until it made progress, then SIGKILL it within ``window`` seconds.

    Progress is new runs in the journal, or (``finishing``) fewer unfinished runs.

    Kills are timed by progress, not wall time, so a fast or a slow machine alike is
    killed mid-flight. Returns whether the process was still running when killed.
    """
    where = "WHERE outcome = 'running'" if finishing else ""

    def progressed(now, then):
        return now < then if finishing else now > then

    before = count_runs(url, where)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    give_up = time.monotonic() + 60
    while (
        proc.poll() is None
        and not progressed(count_runs(url, where), before)
        and time.monotonic() < give_up
    ):
        time.sleep(0.02)
    deadline = time.monotonic() + rng.uniform(0.0, window)
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    if not killed:
        assert proc.returncode == 0, err
    return killed


async def load_journal(url):
    store = await open_store(url, readonly=True)
    try:
        records = await store.list_runs()
        return records, {r.run_id: await store.load(r.run_id) for r in records}
    finally:
        await store.aclose()


def test_sigkill_then_resume_is_exactly_once(journal_url, tmp_path):
    effects = str(tmp_path / "effects.db")
    rng = random.Random(20261130)
    kills = 0
    for seed in range(KILLS):
        demo = interlock(
            "demo", "--runs", "300", "--db", journal_url, "--effects", effects,
            "--seed", str(seed), "--chaos-rate", "0.2", "--latency", "20,60", "--json",
        )  # fmt: skip
        kills += kill_at_random(demo, rng, journal_url, 0.4)
        if seed % 2:
            resume = interlock(
                "resume", "--db", journal_url, "--effects", effects, "--latency", "20,60", "--json"
            )
            kills += kill_at_random(resume, rng, journal_url, 0.3, finishing=True)
    final = subprocess.run(
        interlock("resume", "--db", journal_url, "--effects", effects, "--latency", "1,8", "--json"),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert final.returncode == 0, final.stderr
    summary = json.loads(final.stdout)
    assert kills >= KILLS, f"only {kills} kills landed mid-flight; nothing much was tested"

    records, journal = trio.run(load_journal, journal_url)
    assert records, "no run was ever journaled"
    stuck = [r.run_id for r in records if r.outcome == "running"]
    assert not stuck, [
        (run_id, [type(e).__name__ for e in journal[run_id][-4:]]) for run_id in stuck[:3]
    ]
    assert summary["runs"] == len(records)

    committed: Counter[str] = Counter()
    intents: dict[str, IntentRecorded] = {}
    in_doubt = []
    for run_id, events in journal.items():
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), run_id
        assert isinstance(events[-1], Completed | Escalated | Failed), (
            run_id,
            type(events[-1]).__name__,
        )
        for event in events:
            if isinstance(event, IntentRecorded):
                assert event.key not in intents, f"intent key {event.key} recorded twice"
                intents[event.key] = event
            elif isinstance(event, ToolCommitted):
                committed[event.key] += 1
            elif isinstance(event, ToolFailed) and event.error == "in doubt after a crash":
                in_doubt.append(event)
        if isinstance(events[-1], Escalated) and events[-1].reason == "in_doubt_side_effect":
            assert any(
                isinstance(e, ToolFailed) and e.error == "in doubt after a crash" for e in events
            )
    assert all(count == 1 for count in committed.values()), "a key was committed twice"

    db = sqlite3.connect(effects)
    try:
        executed = db.execute(
            "SELECT tool, key, COUNT(*) FROM executions GROUP BY tool, key"
        ).fetchall()
        for tool, key, _count in executed:
            assert key in intents, f"{tool} ran with key {key} but no intent was journaled first"
            assert intents[key].tool == tool
        payments = dict(db.execute("SELECT key, COUNT(*) FROM payments GROUP BY key").fetchall())
        assert all(count == 1 for count in payments.values())
        for key in committed:
            if intents[key].tool == "refund":
                assert payments.get(key) == 1, f"committed refund {key} has no payment"
        emails = dict(db.execute("SELECT key, COUNT(*) FROM emails GROUP BY key").fetchall())
        assert all(count == 1 for count in emails.values()), "an email was sent twice for one key"
        for event in in_doubt:
            assert event.tool == "send_email", "an idempotent tool was escalated as in doubt"
            assert committed[event.key] == 0
        entity_keys = db.execute(
            "SELECT key, idx, COUNT(*) FROM entities GROUP BY key, idx HAVING COUNT(*) > 1"
        ).fetchall()
        assert entity_keys == []
        tickets = db.execute(
            "SELECT db_key, COUNT(*) FROM tickets GROUP BY db_key HAVING COUNT(*) > 1"
        ).fetchall()
        assert tickets == []
        reexecuted = sum(c - 1 for tool, _k, c in executed if tool in IDEMPOTENT and c > 1)
    finally:
        db.close()

    replayed = subprocess.run(
        interlock("replay", "--all", "--db", journal_url, "--json"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = json.loads(replayed.stdout)
    assert replayed.returncode == 0, report["diverged"][:3]
    assert report["reproduced"] == len(records)
    print(
        f"\ncrash test ({journal_url.split('?')[0].rsplit('/', 1)[-1]}): kills={kills} runs={len(records)} "
        f"side_effects={sum(c for _t, _k, c in executed)} keys={len(executed)} "
        f"idempotent_reexecutions={reexecuted} in_doubt_escalations={len(in_doubt)} "
        f"outcomes={dict(Counter(r.outcome for r in records))}"
    )
