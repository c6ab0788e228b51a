"""Call and move across a crash: a real process SIGKILLed after the downstream applied the
call and before it was reported. The next process completes the move without a second
model call: an idempotent call re-executed with its key, a reconciling one reconciled as
applied (not run again); the side effect happened once, and the journal replays."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import trio

from interlock import Machine, Tool, Worker, replay
from interlock.core._events import IntentRecorded, ModelCalled, ToolCommitted, Transitioned
from interlock.stores._open import open_store

CHILD = pathlib.Path(__file__).with_name("_call_and_move_child.py")


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHILD), *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def journal(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "journal.db")
        return
    dsn = os.environ.get("INTERLOCK_PG_DSN")
    if not dsn:
        pytest.skip("INTERLOCK_PG_DSN is not set; set it to a PostgreSQL DSN to run this on it")
    schema = f"cam_{uuid.uuid4().hex[:12]}"
    separator = "&" if "?" in dsn else "?"
    yield f"{dsn}{separator}schema={schema}"
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def _events(journal: str) -> list:
    store = await open_store(journal, readonly=True)
    try:
        return list(await store.load("r-1"))
    finally:
        await store.aclose()


def _machine(kind: str) -> Machine:
    """The child's machine, with tools replay must never run."""
    sys.path.insert(0, str(CHILD.parent))
    try:
        import _call_and_move_child as child
    finally:
        sys.path.pop(0)

    async def never(*args: object) -> None:
        raise AssertionError("replay ran a tool or a reconcile")

    tool = (
        Tool("charge", never, child.Charge, idempotent=True)
        if kind == "idempotent"
        else Tool("charge", never, child.Charge, reconcile=never)
    )
    return Machine(
        "pay",
        initial="WORK",
        states={
            "WORK": Worker(
                next=["COMPLETED"], tools=["charge"], data=child.Note, call_and_move=True
            )
        },
        tools=[tool],
    )


@pytest.mark.parametrize("kind", ["idempotent", "reconcile"])
def test_a_call_applied_before_a_kill_moves_once_in_the_next_process(
    tmp_path: pathlib.Path, journal: str, kind: str
) -> None:
    ledger = str(tmp_path / "ledger.db")
    first = _child(journal, ledger, kind, "first")
    assert first.returncode == -signal.SIGKILL, first.stderr
    events = trio.run(_events, journal)
    assert isinstance(events[-1], IntentRecorded)  # durable before the call, nothing after
    assert (events[-1].next, events[-1].data) == ("COMPLETED", {"charged": "o1"})
    second = _child(journal, ledger, kind, "second")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1]) == {
        "outcome": "completed",
        "output": {"charged": "o1"},
    }
    db = sqlite3.connect(ledger)
    assert db.execute("SELECT count(*) FROM applied").fetchone() == (1,)
    phases = [p for (p,) in db.execute("SELECT phase FROM attempts ORDER BY rowid")]
    # idempotent: executed again with the same key; reconcile: asked, not run again
    assert phases == (["first", "second"] if kind == "idempotent" else ["first"])
    events = trio.run(_events, journal)
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("ModelCalled") == 1  # the move needed no second model call
    commit = next(e for e in events if isinstance(e, ToolCommitted))
    moved = events[events.index(commit) + 1]
    assert isinstance(moved, Transitioned)
    assert (moved.dst, moved.reason, moved.delta) == ("COMPLETED", "call", {"charged": "o1"})
    assert (commit.reconciled is True) == (kind == "reconcile")
    assert not [e for e in events if isinstance(e, ModelCalled) and e.seq > commit.seq]
    assert replay(events, [_machine(kind)]).ok
