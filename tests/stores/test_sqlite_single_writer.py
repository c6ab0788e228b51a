"""One writer per SQLite journal, and the unfinished runs through their own index (#18).

Two ``interlock resume`` on one journal used to fail each other half-way (9 of 10 exited 1
and up to 2,650 of 3,000 runs were left unfinished). Now the first process that opens a
journal for writing holds ``<db>.lock`` (``flock``); a second is refused before it reads or
writes anything, with one line naming the holder (exit 2), or waits for it (``--wait``).
Real processes throughout: the demo killed mid-flight, two real resumes, a holder killed
with SIGKILL, read-only commands beside a holder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import hypothesis.strategies as st
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings

from interlock.core._events import Completed, Escalated, Failed, Resumed, RunStarted, Transitioned
from interlock.core._exceptions import IndexDamaged, StoreError
from interlock.stores import SQLiteStore, open_sqlite_store
from interlock.stores._base import RUNNING
from interlock.stores._sqlite import JournalHeld, hold_journal
from tests._cli import interlock
from tests.stores._old_schemas import as_version_4

#: A process that holds a journal for writing until its stdin closes, then exits 0.
HOLDER = """
import sys, trio
from interlock.stores import open_sqlite_store

async def main():
    store = await open_sqlite_store(sys.argv[1])
    print("held", flush=True)
    await trio.to_thread.run_sync(sys.stdin.read)
    await store.aclose()

trio.run(main)
"""


def start_holder(path: Path) -> subprocess.Popen[str]:
    """Start a process holding ``path`` for writing; return once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "held\n", proc.stderr.read() if proc.stderr else line
    return proc


def stop_holder(proc: subprocess.Popen[str]) -> str:
    """Let the holder go (close its stdin) and wait for it; return what it wrote to stderr."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    if not proc.stdin.closed:
        proc.stdin.close()
    proc.stdout.read()
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    proc.wait(timeout=60)
    return err


def holder_pid(path: Path) -> int | None:
    """The pid the journal's lock file names, if it names one."""
    try:
        return json.loads((Path(f"{path}.lock")).read_text() or "null")["pid"]
    except (OSError, TypeError, ValueError, KeyError):
        return None


def wait_until(predicate, what: str, timeout: float = 90.0) -> None:
    """Poll ``predicate`` until it holds (a bound for a hung process, not a speed check)."""
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, f"gave up waiting for {what}"
        time.sleep(0.02)


def runs_started(path: Path) -> int:
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as conn:
            row = conn.execute("SELECT value FROM meta WHERE name = 'runs'").fetchone()
    except sqlite3.Error:
        return 0
    return 0 if row is None else int(row[0])


def crashed_demo(path: Path, runs: int) -> None:
    """A demo SIGKILLed once all its ``runs`` started, so they are all left unfinished."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "interlock", "demo", "--db", str(path), "--runs", str(runs),
         "--latency", "2000,3000", "--chaos-rate", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: runs_started(path) == runs, f"{runs} runs started")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


async def terminal_events(path: Path) -> dict[str, list[str]]:
    """Each run's outcome events (completed, failed, escalated, resumed), in order."""
    async with await open_sqlite_store(path, readonly=True) as store:
        ends: dict[str, list[str]] = {}
        for record in await store.list_runs():
            events = await store.load(record.run_id)  # raises on a gap or a repeat
            assert [e.seq for e in events] == list(range(1, record.seq + 1))
            ends[record.run_id] = [
                type(e).__name__
                for e in events
                if isinstance(e, Completed | Failed | Escalated | Resumed)
            ]
        return ends


def resume(path: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "interlock", "resume", "--db", str(path),
         "--latency", "300,600", "--chaos-rate", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def holding_and_stopped(path: Path) -> subprocess.Popen[str]:
    """A resume that holds the journal, stopped (SIGSTOP) so that it keeps holding it
    whatever the machine's load, until the test lets it go on (SIGCONT)."""
    first = resume(path)
    wait_until(lambda: holder_pid(path) == first.pid, "the first resume to hold the journal")
    first.send_signal(signal.SIGSTOP)
    return first


async def unfinished_count(path: Path) -> int:
    """How many runs the crashed demo left unfinished: all, unless a run ended before the
    SIGKILL reached it (a loaded machine can take seconds to deliver it)."""
    async with await open_sqlite_store(path, readonly=True) as store:
        return len(await store.unfinished())


async def assert_every_run_finished_once(path: Path, runs: int) -> None:
    ends = await terminal_events(path)
    assert len(ends) == runs
    for run_id, outcomes in ends.items():
        # Ended once: one Completed or Failed, or one Escalated (in doubt) and no more.
        assert outcomes in (["Completed"], ["Failed"], ["Escalated"]), (run_id, outcomes)
    replayed = await trio.to_thread.run_sync(
        lambda: interlock("replay", "--all", "--db", str(path))
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    checked = await trio.to_thread.run_sync(lambda: interlock("check", "--db", str(path)))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.slow
async def test_a_second_resume_names_the_holder_and_nothing_is_lost(tmp_path: Path) -> None:
    """The case of the issue: two resumes at once. The second exits 2 at once with one
    line naming the first, having changed nothing; the first finishes every run once."""
    path = tmp_path / "j.db"
    await trio.to_thread.run_sync(crashed_demo, path, 24)
    left = await unfinished_count(path)
    assert left > 0
    with trio.fail_after(300):
        first = await trio.to_thread.run_sync(holding_and_stopped, path)
        try:
            before = path.read_bytes()
            second = await trio.to_thread.run_sync(
                lambda: interlock("resume", "--db", str(path), "--chaos-rate", "0")
            )
            assert path.read_bytes() == before  # the second changed nothing
        finally:
            first.send_signal(signal.SIGCONT)
        assert second.returncode == 2, second.stderr
        assert second.stdout == ""
        lines = second.stderr.splitlines()
        assert len(lines) == 1
        assert lines[0].startswith(
            f"interlock: error: journal {path} is held by pid {first.pid} (interlock resume, since "
        )
        assert lines[0].endswith("); wait for it to finish or stop it")
        out, err = await trio.to_thread.run_sync(lambda: first.communicate(timeout=240))
    assert first.returncode == 0, err
    assert f"interlock resume: {left} runs resumed" in out
    await assert_every_run_finished_once(path, 24)


@pytest.mark.slow
async def test_a_resume_told_to_wait_resumes_after_the_holder(tmp_path: Path) -> None:
    """``--wait``: the second says it waits, waits for the first, then finds nothing left
    and exits 0."""
    path = tmp_path / "j.db"
    await trio.to_thread.run_sync(crashed_demo, path, 12)
    left = await unfinished_count(path)
    assert left > 0
    with trio.fail_after(300):
        first = await trio.to_thread.run_sync(holding_and_stopped, path)
        try:
            second = resume(path, "--wait", "240")
            assert second.stderr is not None
            said = await trio.to_thread.run_sync(second.stderr.readline)
            assert said.startswith(
                f"interlock: journal {path} is held by pid {first.pid} (interlock resume, since "
            ), said
            assert said.endswith("); waiting up to 240 s\n"), said
            assert second.poll() is None  # waiting, while the first is stopped
        finally:
            first.send_signal(signal.SIGCONT)
        out1, err1 = await trio.to_thread.run_sync(lambda: first.communicate(timeout=240))
        out2, err2 = await trio.to_thread.run_sync(lambda: second.communicate(timeout=240))
    assert first.returncode == 0, err1
    assert f"interlock resume: {left} runs resumed" in out1
    assert second.returncode == 0, err2
    assert out2 == f"nothing to resume in {path}: 12 runs, none unfinished\n"
    await assert_every_run_finished_once(path, 12)


@pytest.mark.slow
async def test_a_resume_killed_with_sigkill_releases_the_journal_at_once(tmp_path: Path) -> None:
    """The kernel drops a dead holder's flock: the next resume needs no wait and no cleanup,
    and finishes what the killed one left, each run once."""
    path = tmp_path / "j.db"
    await trio.to_thread.run_sync(crashed_demo, path, 12)
    with trio.fail_after(300):
        first = await trio.to_thread.run_sync(holding_and_stopped, path)
        first.send_signal(signal.SIGKILL)  # stopped or not, it dies holding the journal
        await trio.to_thread.run_sync(lambda: first.communicate(timeout=60))
        # At once: a try that does not wait takes it.
        async with hold_journal(path):
            pass
        second = resume(path)
        out, err = await trio.to_thread.run_sync(lambda: second.communicate(timeout=240))
    assert second.returncode == 0, err
    # (all 12, unless the first ended one in the moment between taking the lock and its stop)
    assert re.search(r"interlock resume: \d+ runs resumed", out), out
    await assert_every_run_finished_once(path, 12)


async def test_read_only_commands_work_while_the_journal_is_held(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run("r-1", 1.0))
    holder = await trio.to_thread.run_sync(start_holder, path)
    try:
        for args in (["runs"], ["show", "r-1"], ["check"], ["escalations", "list"]):
            done = await trio.to_thread.run_sync(lambda a=args: interlock(*a, "--db", str(path)))
            assert done.returncode == 0, (args, done.stderr)
        done = await trio.to_thread.run_sync(lambda: interlock("runs", "--db", str(path)))
        assert "r-1" in done.stdout
        # ...and a writer is refused, naming the holder, having written nothing.
        before = path.read_bytes()
        for args in (["demo", "--runs", "2"], ["resume"]):
            done = await trio.to_thread.run_sync(lambda a=args: interlock(*a, "--db", str(path)))
            assert done.returncode == 2, (args, done.stderr)
            assert done.stderr.startswith(
                f"interlock: error: journal {path} is held by pid {holder.pid} (python"
            ), (args, done.stderr)
            assert done.stderr.count("\n") == 1, done.stderr
        with pytest.raises(JournalHeld) as info:
            await open_sqlite_store(path)
        assert info.value.holder["pid"] == holder.pid
        assert str(info.value).startswith(f"journal {path} is held by pid {holder.pid} (python")
        assert path.read_bytes() == before
        async with await open_sqlite_store(path, readonly=True) as store:
            assert [r.run_id for r in await store.list_runs()] == ["r-1"]
    finally:
        err = await trio.to_thread.run_sync(stop_holder, holder)
    assert holder.returncode == 0, err
    # Released: the journal opens for writing again.
    async with await open_sqlite_store(path) as store:
        await store.append(run("r-2", 2.0))


async def test_a_writer_told_to_wait_gives_up_after_the_wait(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The wait runs on trio's clock: here a mock clock that jumps whenever every task
    waits, so the seconds of waiting for a real holder take no time (only the polls of
    the lock, one per 50 ms of the clock, do)."""
    path = tmp_path / "j.db"
    holder = await trio.to_thread.run_sync(start_holder, path)
    try:
        with pytest.raises(JournalHeld, match=r"\(after waiting 2 s\); wait for it"):
            await open_sqlite_store(path, wait=2)
    finally:
        err = await trio.to_thread.run_sync(stop_holder, holder)
    assert holder.returncode == 0, err


async def test_a_writer_told_to_wait_gets_the_journal_when_the_holder_lets_go(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.db"
    holder = await trio.to_thread.run_sync(start_holder, path)
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                opened: list[SQLiteStore] = []

                async def waiter() -> None:
                    opened.append(await open_sqlite_store(path, wait=120))

                nursery.start_soon(waiter)
                assert holder.stdin is not None
                await trio.to_thread.run_sync(holder.stdin.close)  # the holder lets go
        async with opened[0] as store:
            await store.append(run("r-1", 1.0))
    finally:
        err = await trio.to_thread.run_sync(stop_holder, holder)
    assert holder.returncode == 0, err


async def test_stores_of_one_process_share_the_hold(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    first = await open_sqlite_store(path)
    second = await open_sqlite_store(path)
    async with hold_journal(path):
        pass
    await first.aclose()
    # Still held by the second: another process is refused.
    refused = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", HOLDER, str(path)],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    )
    assert refused.returncode == 1
    assert f"JournalHeld: journal {path} is held by pid {os.getpid()}" in refused.stderr
    await second.aclose()
    done = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-c", HOLDER, str(path)],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    )
    assert done.returncode == 0, done.stderr


async def test_bad_waits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^wait must be 0 or more seconds"):
        await open_sqlite_store(tmp_path / "j.db", wait=-1)
    assert not (tmp_path / "j.db").exists()
    done = await trio.to_thread.run_sync(
        lambda: interlock("resume", "--db", str(tmp_path / "j.db"), "--wait", "soon")
    )
    assert done.returncode == 2
    assert "--wait: expected seconds (e.g. 30 or inf), got 'soon'" in done.stderr


async def test_a_missing_directory_is_named_before_any_lock(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"directory .* does not exist; create it"):
        await open_sqlite_store(tmp_path / "nowhere" / "j.db")


# --- the index of unfinished runs --------------------------------------------------------


def run(run_id: str, ts: float, *, end: type | None = Completed) -> list:
    """A run's events: started, one transition, and ``end`` (None: left running)."""
    events = [
        RunStarted(run_id=run_id, seq=1, ts=ts, machine="m", state="A", inputs={}),
        Transitioned(run_id=run_id, seq=2, ts=ts, src="A", dst="B"),
    ]
    if end is Completed:
        events.append(Completed(run_id=run_id, seq=3, ts=ts, state="B", output=None))
    elif end is Failed:
        events.append(Failed(run_id=run_id, seq=3, ts=ts, state="B", reason="r"))
    elif end is Escalated:
        events.append(Escalated(run_id=run_id, seq=3, ts=ts, state="B", reason="x", detail="d"))
    return events


def plan(path: Path, sql: str) -> list[str]:
    with closing(sqlite3.connect(path)) as conn, conn:
        return [row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}")]


async def test_unfinished_runs_are_read_through_their_index(tmp_path: Path) -> None:
    from interlock.stores._sqlite import _SELECT_UNFINISHED

    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(
            [
                *run("done", 1.0),
                *run("open-2", 2.0, end=None),
                *run("failed", 3.0, end=Failed),
                *run("open-1", 0.5, end=None),
            ]
        )
        await store.append(run("parked", 4.0, end=Escalated))
        assert [r.run_id for r in await store.unfinished()] == ["open-1", "open-2"]
        # Completions leave the index; a resume comes back into it.
        await store.append([Completed(run_id="open-1", seq=3, ts=5.0, state="B", output=None)])
        await store.append([Resumed(run_id="parked", seq=4, ts=6.0, by="op", note="")])
        assert [r.run_id for r in await store.unfinished()] == ["open-2", "parked"]
        assert await store.unfinished() == [
            r for r in await store.list_runs() if r.outcome == RUNNING
        ]
    with closing(sqlite3.connect(path)) as conn, conn:
        indexed = conn.execute(
            "SELECT run_id FROM runs INDEXED BY runs_unfinished WHERE outcome = 'running'"
        ).fetchall()
        assert sorted(indexed) == [("open-2",), ("parked",)]
        assert conn.execute("SELECT value FROM meta WHERE name = 'running'").fetchone() == ("2",)
    [step] = plan(path, _SELECT_UNFINISHED)
    assert step.startswith("SCAN runs USING INDEX runs_unfinished"), step
    assert "TEMP B-TREE" not in step  # in the order it returns, no sort


async def test_a_version_3_journal_gets_the_index_when_opened_for_writing(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append([*run("a", 1.0), *run("b", 2.0, end=None), *run("c", 3.0, end=None)])
    # As version 3 wrote it: no index, no count (and chunks as version 4 kept them).
    with closing(sqlite3.connect(path)) as conn, conn:
        as_version_4(conn)
        conn.execute("DROP INDEX runs_unfinished")
        conn.execute("DELETE FROM meta WHERE name = 'running'")
        conn.execute("UPDATE meta SET value = '3' WHERE name = 'schema_version'")
    async with await open_sqlite_store(path, readonly=True) as store:
        assert (await store.pragmas())["schema_version"] == 3
        assert [r.run_id for r in await store.unfinished()] == ["b", "c"]  # every row read
    async with await open_sqlite_store(path) as store:
        assert (await store.pragmas())["schema_version"] == 6
        assert [r.run_id for r in await store.unfinished()] == ["b", "c"]
        await store.append([Failed(run_id="b", seq=3, ts=4.0, state="B", reason="r")])
        assert [r.run_id for r in await store.unfinished()] == ["c"]
        assert (await store.check()).ok
    [step] = plan(path, "SELECT run_id FROM runs WHERE outcome = 'running'")
    assert step.startswith("SCAN runs USING"), step
    assert "INDEX runs_unfinished" in step, step


async def test_a_row_the_index_lost_is_reported_not_skipped(tmp_path: Path) -> None:
    """An unfinished run changed behind the store's back leaves the index, but not the
    count: unfinished() says the index is damaged instead of leaving the run behind."""
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append([*run("a", 1.0, end=None), *run("b", 2.0, end=None)])
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE runs SET outcome = 'completed' WHERE run_id = 'a'")
    async with await open_sqlite_store(path, readonly=True) as store:
        with pytest.raises(IndexDamaged) as info:
            await store.unfinished()
        assert str(info.value) == (
            "runs index is damaged (the index of unfinished runs holds 1, but '2' runs are "
            "unfinished); the store was written outside interlock or its file is damaged; "
            "restore it from a backup"
        )
        assert not (await store.check()).ok  # the row fails its checksum


async def test_a_wrong_count_alone_is_a_problem_of_check(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await store.append(run("a", 1.0, end=None))
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE meta SET value = '7' WHERE name = 'running'")
    async with await open_sqlite_store(path, readonly=True) as store:
        [problem] = (await store.check()).problems
        assert problem.message == (
            f"{path}: the count of unfinished runs kept beside their index says '7', but 1 "
            "runs are unfinished; restore it from a backup"
        )
        with pytest.raises(IndexDamaged, match="holds 1, but '7' runs are unfinished"):
            await store.unfinished()


_ENDS = st.sampled_from(["complete", "fail", "escalate", "resume", "step"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script=st.lists(st.tuples(st.integers(0, 5), _ENDS), max_size=30),
    batch=st.integers(1, 6),
)
def test_the_index_holds_exactly_the_unfinished_runs(
    tmp_path_factory: pytest.TempPathFactory, script: list[tuple[int, str]], batch: int
) -> None:
    """Any mix of starts, steps, ends, escalations and resumes, in batches of any size
    (one batch may start and end a run): unfinished() is the running rows of the whole
    index, and the count kept beside it agrees."""
    path = tmp_path_factory.mktemp("prop") / "j.db"

    async def main() -> None:
        seqs: dict[str, int] = {}
        outcome: dict[str, str] = {}
        pending = []
        for number, action in script:
            run_id = f"r-{number}"
            seq = seqs.get(run_id, 0) + 1
            if seq == 1:
                pending.append(
                    RunStarted(run_id=run_id, seq=1, ts=float(number), machine="m", state="A")
                )
                outcome[run_id] = "running"
                seqs[run_id] = 1
                continue
            state = outcome[run_id]
            if action == "resume" and state == "escalated":
                event = Resumed(run_id=run_id, seq=seq, ts=9.0, by="op", note="")
                outcome[run_id] = "running"
            elif state != "running":
                continue  # ended: nothing more
            elif action == "complete":
                event = Completed(run_id=run_id, seq=seq, ts=9.0, state="A", output=None)
                outcome[run_id] = "completed"
            elif action == "fail":
                event = Failed(run_id=run_id, seq=seq, ts=9.0, state="A", reason="r")
                outcome[run_id] = "failed"
            elif action == "escalate":
                event = Escalated(run_id=run_id, seq=seq, ts=9.0, state="A", reason="x", detail="")
                outcome[run_id] = "escalated"
            else:
                event = Transitioned(run_id=run_id, seq=seq, ts=9.0, src="A", dst="A")
            pending.append(event)
            seqs[run_id] = seq
        async with await open_sqlite_store(path) as store:
            for i in range(0, len(pending), batch):
                await store.append(pending[i : i + batch])
            expected = sorted(
                (r for r, o in outcome.items() if o == "running"),
                key=lambda r: (float(r[2:]), r),
            )
            assert [r.run_id for r in await store.unfinished()] == expected
            assert await store.unfinished() == [
                r for r in await store.list_runs() if r.outcome == RUNNING
            ]
            assert (await store.check()).ok

    trio.run(main)


def test_json_of_the_holder_is_what_the_message_reads(tmp_path: Path) -> None:
    """The lock file says who holds the journal, as JSON a person or a script can read."""

    async def main() -> None:
        path = tmp_path / "j.db"
        async with await open_sqlite_store(path):
            holder = msgspec.json.decode(await trio.Path(f"{path}.lock").read_bytes())
            assert holder["pid"] == os.getpid()
            assert set(holder) == {"pid", "host", "command", "since"}
            assert holder["since"] <= time.time()
        assert await trio.Path(f"{path}.lock").read_bytes() == b""  # released: names nobody

    trio.run(main)
