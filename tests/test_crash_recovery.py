"""Crash safety: a real demo process killed with SIGKILL mid-flight, then resumed.

Each side effect of the demo answers only a while after it is applied, and each kill
lands in that window, just after the downstream executed a refund (idempotent) or an
email (not): so every kill leaves calls in doubt, applied but not committed, whatever
the machine's speed.

Asserts, for SQLite and PostgreSQL: every run ends terminal; no committed event is lost
or duplicated; every side effect counted by the downstream systems (a separate SQLite
file) happened exactly once per key for idempotent tools and at most once for the
non-idempotent email; every call in doubt at a kill ended re-run (a safe tool), reconciled
or escalated as in doubt, and an applied refund in doubt was re-run with its key and paid
once; and every recorded run replays without divergence.
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

from interlock.events import Completed, Escalated, Failed, IntentRecorded, ToolCommitted, ToolFailed
from interlock.stores._open import open_store

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("INTERLOCK_CRASH_KILLS", "6"))
IDEMPOTENT = ("refund", "write_entities", "record_ticket")
SAFE = (*IDEMPOTENT, "lookup_order", "lookup_category")  # idempotent or read-only


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


#: Seconds each side-effecting call of the demo holds its answer back once its effect is
#: applied: the call stays in doubt (intent durable, no commit) that long, a window that
#: the kill below cannot miss.
SLOW_WRITE = 1.0
#: ``python -c SLOW_CLI ARGS`` is ``interlock ARGS`` with every side effect SLOW_WRITE slower.
SLOW_CLI = f"""
import runpy
import trio
from interlock.demo.workflows import Backend

def slow(effect):
    async def slowed(self, *args):
        result = await effect(self, *args)
        await trio.sleep({SLOW_WRITE})
        return result
    return slowed

for name in ("refund", "send_email", "write_entities", "record_ticket"):
    setattr(Backend, name, slow(getattr(Backend, name)))
runpy.run_module("interlock", run_name="__main__", alter_sys=True)
"""


def slow_interlock(*args):
    return [sys.executable, "-c", SLOW_CLI, *args]


def executions(effects):
    """How many times the downstream has executed each ``(tool, key)`` (none before it exists)."""
    try:
        db = sqlite3.connect(f"file:{effects}?mode=ro", uri=True, timeout=1)
        try:
            rows = db.execute("SELECT tool, key, COUNT(*) FROM executions GROUP BY tool, key")
            return Counter({(tool, key): count for tool, key, count in rows})
        finally:
            db.close()
    except sqlite3.Error:
        return Counter()


def kill_in_doubt(cmd, rng, effects, tool, spread):
    """Start ``cmd`` and SIGKILL it just after it has executed ``tool`` 1 to ``spread`` more times.

    The latest execution is then applied but, held back SLOW_WRITE seconds, not committed:
    the kill leaves at least one call of ``tool`` in doubt, whatever the machine's speed.
    Returns whether the process was still running when killed.
    """

    def count():
        return sum(n for (name, _key), n in executions(effects).items() if name == tool)

    target = count() + rng.randint(1, spread)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    give_up = time.monotonic() + 60
    while proc.poll() is None and count() < target and time.monotonic() < give_up:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, SLOW_WRITE / 5))
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    if not killed:
        assert proc.returncode == 0, err
    return killed


async def in_doubt_now(url):
    """The calls in doubt in the journal now: intents without an outcome, by key."""
    store = await open_store(url, readonly=True)
    try:
        pending = {}
        for record in await store.unfinished():
            for event in await store.load(record.run_id):
                if isinstance(event, IntentRecorded):
                    pending[event.key] = event
                elif isinstance(event, ToolCommitted | ToolFailed):
                    pending.pop(event.key, None)
        return pending
    finally:
        await store.aclose()


async def load_journal(url):
    store = await open_store(url, readonly=True)
    try:
        records = await store.list_runs()
        return records, {r.run_id: await store.load(r.run_id) for r in records}
    finally:
        await store.aclose()


#: PostgreSQL: the processes that are killed lease their runs for 2 s, not the default 10:
#: the process after each kill waits for the dead one's leases to expire, up to 2 s, not 10.
KILLED_LEASE = ("--lease-ttl", "2")


def test_sigkill_then_resume_is_exactly_once(journal_url, tmp_path):
    effects = str(tmp_path / "effects.db")
    leases = KILLED_LEASE if journal_url.startswith("postgresql") else ()
    rng = random.Random(20261130)
    kills = 0
    doubted: dict[str, IntentRecorded] = {}  # every call in doubt at the moment of a kill
    applied: dict[str, set[str]] = {"refund": set(), "send_email": set()}  # ... and applied

    def kill(cmd, spread):
        # Kills alternate between a refund (idempotent) and an email (not) left in doubt.
        nonlocal kills
        tool = ("refund", "send_email")[kills % 2]
        if not kill_in_doubt(cmd, rng, effects, tool, spread):
            return
        kills += 1
        now = trio.run(in_doubt_now, journal_url)
        ran = executions(effects)
        landed = {key for key, e in now.items() if e.tool == tool and ran[(tool, key)]}
        assert landed, f"kill {kills} left no applied {tool} in doubt; in doubt: {sorted(now)[:5]}"
        doubted.update(now)
        applied[tool] |= landed

    for seed in range(KILLS):
        kill(
            slow_interlock(
                "demo", "--runs", "150", "--db", journal_url, "--effects", effects,
                "--seed", str(seed), "--chaos-rate", "0.2", "--latency", "20,60", "--json",
                *leases,
            ),
            30,
        )  # fmt: skip
        if seed % 2:
            kill(
                slow_interlock(
                    "resume", "--db", journal_url, "--effects", effects, "--latency", "20,60",
                    "--json", *leases,
                ),
                10,
            )  # fmt: skip
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

    ran = executions(effects)
    for tool, key in ran:
        assert key in intents, f"{tool} ran with key {key} but no intent was journaled first"
        assert intents[key].tool == tool
    db = sqlite3.connect(effects)
    try:
        payments = dict(db.execute("SELECT key, COUNT(*) FROM payments GROUP BY key").fetchall())
        emails = dict(db.execute("SELECT key, COUNT(*) FROM emails GROUP BY key").fetchall())
        entity_keys = db.execute(
            "SELECT key, idx, COUNT(*) FROM entities GROUP BY key, idx HAVING COUNT(*) > 1"
        ).fetchall()
        tickets = db.execute(
            "SELECT db_key, COUNT(*) FROM tickets GROUP BY db_key HAVING COUNT(*) > 1"
        ).fetchall()
    finally:
        db.close()
    assert all(count == 1 for count in payments.values())
    for key in committed:
        if intents[key].tool == "refund":
            assert payments.get(key) == 1, f"committed refund {key} has no payment"
    assert all(count == 1 for count in emails.values()), "an email was sent twice for one key"
    for event in in_doubt:
        assert event.tool == "send_email", "an idempotent tool was escalated as in doubt"
        assert committed[event.key] == 0
    assert entity_keys == []
    assert tickets == []

    # Every call a kill left in doubt ended re-run (a safe tool), reconciled (committed
    # once, executed at most once) or escalated as in doubt; none ran twice unless safe.
    for key, intent in doubted.items():
        events = journal[intent.run_id]
        if intent.tool not in SAFE:
            assert ran[(intent.tool, key)] <= 1, f"{intent.tool} {key} ran again after a crash"
        if committed[key]:
            continue
        assert intent.tool not in SAFE, f"{intent.tool} {key} was in doubt and never re-run"
        assert any(isinstance(e, ToolFailed) and e.key == key for e in events), key
        assert (type(events[-1]), events[-1].reason) == (Escalated, "in_doubt_side_effect"), key
    # The kills left applied refunds and emails in doubt: each refund was re-run and paid
    # once; each email was sent once (reconciled, or escalated; never sent again).
    refunds, sent = applied["refund"], applied["send_email"]
    assert refunds
    assert sent
    assert {key: (ran[("refund", key)] > 1, payments.get(key)) for key in refunds} == dict.fromkeys(
        refunds, (True, 1)
    )
    assert {key: (ran[("send_email", key)], emails.get(key)) for key in sent} == dict.fromkeys(
        sent, (1, 1)
    )
    reexecuted = sum(c - 1 for (tool, _key), c in ran.items() if tool in IDEMPOTENT and c > 1)

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
        f"side_effects={sum(ran.values())} keys={len(ran)} in_doubt_at_kills={len(doubted)} "
        f"idempotent_reexecutions={reexecuted} in_doubt_escalations={len(in_doubt)} "
        f"outcomes={dict(Counter(r.outcome for r in records))}"
    )
