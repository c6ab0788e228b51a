"""``interlock check`` and how the other commands report damage, on real files damaged on
purpose: a flipped byte in a frame, a flipped byte in a runs-index row, a deleted event."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

PG_DSN = os.environ.get("INTERLOCK_PG_DSN", "")
RESTORE = (
    "the store was written outside interlock or a write was cut short; restore it from a backup"
)


def interlock(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlock", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        timeout=120,
        check=False,
    )


def query(path: Path, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        return conn.execute(statement, params).fetchall()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def hint(path: Path) -> str:
    return f" ('interlock check --db {path}' lists all the damage)\n"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo journal whose every run has finished, so ``resume`` has nothing to do."""
    path = tmp_path_factory.mktemp("check") / "journal.db"
    done = interlock("demo", "--runs", "6", "--db", str(path), "--latency", "0,1", "--json")
    assert done.returncode == 0, done.stderr
    # The demo's store closed its connection last, so the file holds everything (no -wal).
    assert not Path(f"{path}-wal").exists()
    return path


@pytest.fixture
def journal(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the demo journal to damage."""
    path = tmp_path / "journal.db"
    shutil.copyfile(pristine, path)
    return path


def test_an_intact_journal_checks_ok(journal: Path) -> None:
    [(events,)] = query(journal, "SELECT sum(last_seq - first_seq + 1) FROM chunks")
    before = digest(journal)
    done = interlock("check", "--db", str(journal))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"ok: 6 runs, {events:,} events, no damage\n"
    as_json = interlock("check", "--db", str(journal), "--json")
    assert as_json.returncode == 0
    assert json.loads(as_json.stdout) == {
        "db": str(journal),
        "ok": True,
        "runs": 6,
        "events": events,
        "problems": [],
    }
    assert digest(journal) == before


def test_a_flipped_byte_in_a_frame_is_reported_by_run_and_seq(journal: Path) -> None:
    [(run_id, first, body)] = query(
        journal,
        "SELECT run_id, first_seq, body FROM chunks WHERE last_seq > first_seq "
        "ORDER BY run_id, first_seq LIMIT 1",
    )
    assert isinstance(body, bytes)
    data = journal.read_bytes()
    assert data.count(body[:64]) == 1
    # A byte inside the payload of the chunk's first frame (12 bytes of header before it).
    flip(journal, data.index(body[:64]) + 20)
    message = f"journal of run {run_id!r} is corrupt (checksum mismatch) at seq {first}; {RESTORE}"
    before = digest(journal)
    done = interlock("check", "--db", str(journal))
    assert done.returncode == 1
    assert done.stdout == f"damaged: 1 problem\n  {message}\n"
    report = json.loads(interlock("check", "--db", str(journal), "--json").stdout)
    assert (report["ok"], report["problems"]) == (
        False,
        [{"run_id": run_id, "seq": first, "message": message}],
    )
    for command in (["show", str(run_id)], ["replay", "--all"], ["replay", str(run_id)]):
        failed = interlock(*command, "--db", str(journal))
        assert failed.returncode == 1, command
        assert failed.stderr == f"interlock: error: {message}" + hint(journal)
    assert digest(journal) == before


def runs_row(path: Path) -> tuple[str, int]:
    """The first run id of the runs index and the file offset of its row's outcome text."""
    [(run_id, outcome)] = query(path, "SELECT run_id, outcome FROM runs ORDER BY run_id LIMIT 1")
    [(root,)] = query(path, "SELECT rootpage FROM sqlite_master WHERE name = 'runs'")
    [(page_size,)] = query(path, "PRAGMA page_size")
    assert isinstance(run_id, str)
    assert isinstance(outcome, str)
    assert isinstance(root, int)
    assert isinstance(page_size, int)
    page = path.read_bytes()[(root - 1) * page_size : root * page_size]
    # A leaf holding every row; the run id occurs once in it, its outcome soon after.
    assert page[0] == 0x0A
    at = page.index(run_id.encode())
    assert page.count(run_id.encode()) == 1
    return run_id, (root - 1) * page_size + page.index(outcome.encode(), at)


def test_a_flipped_byte_in_a_runs_index_row_fails_every_command_naming_the_run(
    journal: Path,
) -> None:
    """Regression (#14): one flipped byte in the runs index made ``runs``, ``resume`` and
    ``replay --all`` skip a run or show a garbled outcome, all exiting 0."""
    run_id, offset = runs_row(journal)
    flip(journal, offset)
    message = (
        f"runs index row of run {run_id!r} is damaged (checksum mismatch); the store was "
        "written outside interlock or its file is damaged; restore it from a backup"
    )
    before = digest(journal)
    for command in (
        ["runs"],
        ["runs", "--outcome", "completed"],
        ["runs", "--json"],
        ["escalations"],
        ["show", run_id],
        ["replay", "--all"],
    ):
        failed = interlock(*command, "--db", str(journal))
        assert (failed.returncode, failed.stdout) == (1, ""), command
        assert failed.stderr == f"interlock: error: {message}" + hint(journal), command
    assert digest(journal) == before
    done = interlock("check", "--db", str(journal))
    assert done.returncode == 1
    assert done.stdout == f"damaged: 1 problem\n  {message}\n"
    assert digest(journal) == before
    resumed = interlock("resume", "--db", str(journal), "--latency", "0,1")
    assert resumed.returncode == 1
    assert resumed.stderr == f"interlock: error: {message}" + hint(journal)


def test_a_deleted_event_row_is_a_gap(journal: Path) -> None:
    # A run with at least three chunks: delete the middle one.
    [(run_id,)] = query(
        journal,
        "SELECT run_id FROM chunks GROUP BY run_id HAVING count(*) >= 3 ORDER BY run_id LIMIT 1",
    )
    chunks = query(
        journal,
        "SELECT first_seq, last_seq FROM chunks WHERE run_id = ? ORDER BY first_seq",
        (run_id,),
    )
    first, last = chunks[1]
    query(journal, "DELETE FROM chunks WHERE run_id = ? AND first_seq = ?", (run_id, first))
    assert isinstance(first, int)
    assert isinstance(last, int)
    message = (
        f"journal of run {run_id!r} is missing or repeating events: seq {last + 1} follows "
        f"seq {first - 1}; restore it from a backup"
    )
    done = interlock("check", "--db", str(journal), "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["problems"] == [{"run_id": run_id, "seq": first, "message": message}]
    shown = interlock("show", str(run_id), "--db", str(journal))
    assert shown.returncode == 1
    assert shown.stderr == f"interlock: error: {message}" + hint(journal)


def test_check_of_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    done = interlock("check", "--db", str(tmp_path / "typo.db"))
    assert done.returncode == 1
    assert done.stderr == (
        f"interlock: error: journal {tmp_path / 'typo.db'} does not exist (from --db); nothing "
        "was created; pass the path of an existing journal, or leave --db out for the app's "
        "store\n"
    )
    assert os.listdir(tmp_path) == []


@pytest.fixture
def pg_schema() -> Iterator[str]:
    name = f"interlock_test_{secrets.token_hex(6)}"
    yield name
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.mark.postgres
@pytest.mark.skipif(not PG_DSN, reason="INTERLOCK_PG_DSN is not set")
def test_check_works_on_postgresql(pg_schema: str) -> None:
    dsn = f"{PG_DSN}?schema={pg_schema}"
    done = interlock("demo", "--runs", "4", "--db", dsn, "--latency", "0,1", "--json")
    assert done.returncode == 0, done.stderr
    ok = interlock("check", "--db", dsn)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok: 4 runs, ")
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(pg_schema)))
        run_id, seq = conn.execute(
            "SELECT run_id, max(seq) FROM events GROUP BY run_id ORDER BY run_id LIMIT 1"
        ).fetchone()
        conn.execute(
            "UPDATE events SET body = overlay(body placing '\\xff'::bytea from 20 for 1) "
            "WHERE run_id = %s AND seq = 2",
            (run_id,),
        )
        conn.execute("UPDATE runs SET state = 'DONE' WHERE run_id = %s", (run_id,))
        conn.execute("DELETE FROM events WHERE run_id = %s AND seq = %s", (run_id, seq - 1))
    damaged = interlock("check", "--db", dsn, "--json")
    assert damaged.returncode == 1
    assert json.loads(damaged.stdout)["problems"] == [
        {
            "run_id": run_id,
            "seq": None,
            "message": f"runs index row of run {run_id!r} is damaged (checksum mismatch); the "
            "store was written outside interlock or its file is damaged; restore it from a backup",
        },
        {
            "run_id": run_id,
            "seq": 2,
            "message": f"journal of run {run_id!r} is corrupt (checksum mismatch) at seq 2; {RESTORE}",
        },
        {
            "run_id": run_id,
            "seq": seq - 1,
            "message": f"journal of run {run_id!r} is missing or repeating events: seq {seq} "
            f"follows seq {seq - 2}; restore it from a backup",
        },
    ]


WRITER = Path(__file__).with_name("_journal_writer.py")


@contextlib.contextmanager
def writer(path: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """tests/_journal_writer.py writing ``path`` until its stdin closes (or it is killed,
    at the latest on the way out)."""
    child = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield child
    finally:
        child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            assert pipe is not None
            pipe.close()


def committed_at(child: subprocess.Popen[str], number: int) -> int:
    """Read the writer's lines up to batch ``number``; the events committed by then."""
    assert child.stdout is not None
    for line in child.stdout:
        word, at, events = line.split()
        assert word == "batch", line
        if int(at) == number:
            return int(events)
    raise AssertionError(f"the writer stopped before batch {number}")


def checked_ok(path: Path, *, alone: bool = True) -> int:
    """``interlock check`` of ``path`` finds no damage; the events it read. ``alone`` (no
    writer left to checkpoint): it changed neither the file nor its -wal (SQLite may
    rebuild the -shm, its index of the -wal, as any reader does)."""
    files = [file for file in (path, Path(f"{path}-wal")) if file.exists() and alone]
    before = {file.name: digest(file) for file in files}
    done = interlock("check", "--db", str(path), "--json")
    assert (done.returncode, done.stderr) == (0, ""), done.stdout
    report = json.loads(done.stdout)
    assert (report["ok"], report["problems"]) == (True, [])
    assert {file.name: digest(file) for file in files} == before
    return int(report["events"])


#: The batches after which a writer is killed: moves pending, just applied, moved past by
#: runs that ended, at every point of the writer's cycle of five batches.
KILLED_AFTER = (1, 3, 6, 9, 14, 23, 37, 61)


@pytest.mark.slow
def test_a_journal_whose_writer_was_killed_checks_ok(tmp_path: Path) -> None:
    """Regression (#33): after a plain SIGKILL of its writer, check called a healthy
    journal damaged (index moves a run's end had moved past, counted twice) and said to
    restore a backup, while runs, replay and resume read it."""
    for number in KILLED_AFTER:
        path = tmp_path / f"killed-{number}" / "journal.db"
        path.parent.mkdir()
        with writer(path) as child:
            events = committed_at(child, number)
            child.kill()
            assert child.wait() == -signal.SIGKILL
        assert Path(f"{path}-wal").exists()
        # what was committed when the kill came, and perhaps a batch or two more
        assert checked_ok(path) >= events, number
        listed = interlock("runs", "--db", str(path), "--json")
        assert listed.returncode == 0, listed.stderr


def stopped(child: subprocess.Popen[str]) -> tuple[int, str]:
    """Close the writer's stdin and wait for it; its exit code and last line."""
    assert child.stdin is not None
    assert child.stdout is not None
    child.stdin.close()
    *_, last = child.stdout.read().splitlines()
    return child.wait(timeout=60), last


@pytest.mark.slow
def test_a_check_while_the_writer_writes_finds_no_damage_and_leaves_it_alone(
    tmp_path: Path,
) -> None:
    """Regression (#33): a check while a writer ran could call the journal damaged."""
    path = tmp_path / "journal.db"
    with writer(path) as child:
        for number in (10, 40, 90):
            events = committed_at(child, number)
            # the writer goes on meanwhile: it stops only once its stdin closes
            assert checked_ok(path, alone=False) >= events
        # unaffected: it writes on, then closes its store as ever
        committed_at(child, 120)
        code, last = stopped(child)
    assert code == 0
    word, events = last.split()
    assert word == "done"
    assert not Path(f"{path}-wal").exists()  # the writer checkpointed it whole at close
    assert checked_ok(path) == int(events)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs, mounted at a folder of ``tmp_path`` (root only)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("full", ["tmpfs", "max_page_count"])
def test_a_journal_whose_disk_filled_up_mid_run_checks_ok(
    full: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Regression (#33): after a disk-full mid-run, check called the journal damaged."""
    if full == "tmpfs":
        path = request.getfixturevalue("small_disk") / "journal.db"
        args: tuple[str, ...] = ()
    else:
        path = tmp_path / "journal.db"
        args = ("0", "200")  # a database file of 200 pages at most
    with writer(path, *args) as child:
        assert child.stdout is not None
        for line in child.stdout:
            word, events = line.split()[-2:]
            if word == "full":
                break
        else:
            raise AssertionError("the writer never filled the disk")
        # its failed batch wrote nothing; the writer is still there, then killed
        assert checked_ok(path, alone=False) == int(events)
        child.kill()
        assert child.wait() == -signal.SIGKILL
    assert checked_ok(path) == int(events)


@pytest.fixture
def killed(tmp_path: Path) -> tuple[Path, int]:
    """A journal whose writer was killed after 40 batches, its committed transactions
    still in the -wal (no checkpoint copied them in yet); and the events check reads in it."""
    path = tmp_path / "killed" / "journal.db"
    path.parent.mkdir()
    with writer(path) as child:
        committed_at(child, 40)
        child.kill()
        assert child.wait() == -signal.SIGKILL
    return path, checked_ok(path)


def copied(path: Path, to: Path) -> Path:
    """A copy of the journal and its -wal and -shm in the folder ``to``."""
    to.mkdir()
    for file in path.parent.glob(f"{path.name}*"):
        shutil.copyfile(file, to / file.name)
    return to / path.name


def lost_wal(path: Path, what: str, frames: int) -> str:
    return (
        f"{path}-wal {what}, but {path}-shm (SQLite's index of it) says it held {frames} "
        f"committed frames not yet copied into {path}: committed transactions are lost; "
        "restore the journal and its -wal from a backup"
    )


def shm_frames(path: Path) -> tuple[int, int]:
    """``(mxFrame, nBackfill)`` of the journal's -shm: its last committed frame in the -wal,
    and the frames a checkpoint copied into the file."""
    header = Path(f"{path}-shm").read_bytes()[:136]
    return int.from_bytes(header[16:20], sys.byteorder), int.from_bytes(
        header[96:100], sys.byteorder
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_committed_transactions_lost_with_the_wal_are_reported(
    how: str, killed: tuple[Path, int], tmp_path: Path
) -> None:
    """Regression (#33): a -wal deleted (or cut short) after a crash silently dropped the
    committed transactions in it; check must say so, not call the journal healthy."""
    original, events = killed
    last, backfilled = shm_frames(original)
    assert last > backfilled
    path = copied(original, tmp_path / how)
    wal = Path(f"{path}-wal")
    if how == "deleted":
        wal.unlink()
        what = "is missing"
    else:
        page = 8192 + 24
        with wal.open("r+b") as file:
            file.truncate(32 + page * (last - 1) + page // 2)
        what = f"holds {last - 1} whole frames of {last}"
    shm = digest(Path(f"{path}-shm"))
    done = interlock("check", "--db", str(path), "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["problems"][0] == {
        "run_id": None,
        "seq": None,
        "message": lost_wal(path, what, last - backfilled),
    }
    if how == "deleted":
        # read alone, the file keeps the -shm that says so, and no empty -wal appears:
        # the next check (or runs, show) reads the same
        assert digest(Path(f"{path}-shm")) == shm
        assert not wal.exists()
        again = interlock("check", "--db", str(path), "--json")
        assert json.loads(again.stdout)["problems"] == report["problems"]
    # the events really are gone: SQLite reads the file as of its last checkpoint
    [(left,)] = query(path, "SELECT sum(last_seq - first_seq + 1) FROM chunks")
    assert isinstance(left, int)
    assert left < events


@pytest.mark.slow
def test_a_flipped_byte_in_the_file_of_a_killed_writer_is_reported(
    killed: tuple[Path, int],
) -> None:
    """What a crash leaves is not damage, but damage beside it still is."""
    path, _events = killed
    data = path.read_bytes()
    wal = Path(f"{path}-wal").read_bytes()
    # a chunk in the file whose page no frame of the -wal holds again
    chunks = query(path, "SELECT run_id, first_seq, body FROM chunks ORDER BY id LIMIT 200")
    run_id, first, body = next(
        (run_id, first, body)
        for run_id, first, body in chunks
        if isinstance(body, bytes) and data.count(body[:64]) == 1 and body[:64] not in wal
    )
    assert isinstance(body, bytes)
    flip(path, data.index(body[:64]) + 20)
    done = interlock("check", "--db", str(path), "--json")
    assert done.returncode == 1
    assert json.loads(done.stdout)["problems"] == [
        {
            "run_id": run_id,
            "seq": first,
            "message": f"journal of run {run_id!r} is corrupt (checksum mismatch) at seq "
            f"{first}; {RESTORE}",
        }
    ]


#: Chunks (one per run per batch) the demo has committed when it is killed: past the
#: first seconds, when runs end with index moves of theirs still pending.
DEMO_KILLED_AT = (8_000, 11_000)


def chunks(path: Path) -> int:
    """The chunks committed so far, read as another process reads a journal being written."""
    if not path.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        try:
            return int(conn.execute("SELECT max(id) FROM chunks").fetchone()[0] or 0)
        except sqlite3.OperationalError:  # no tables yet
            return 0


@pytest.mark.slow
def test_a_demo_journal_killed_mid_run_checks_ok_and_resumes(tmp_path: Path) -> None:
    """Regression (#33): the demo SIGKILLed mid-run left journals that check called
    damaged, while runs, replay and resume read them; resumed, they check ok too."""
    for at in DEMO_KILLED_AT:
        path = tmp_path / f"demo-{at}" / "journal.db"
        path.parent.mkdir()
        command = ["demo", "--runs", "3000", "--latency", "0,1", "--db", str(path)]
        with subprocess.Popen(
            [sys.executable, "-m", "interlock", *command], stdout=subprocess.DEVNULL
        ) as child:
            # progress, not time: the chunks committed (the demo prints only at its end)
            while child.poll() is None:
                if chunks(path) >= at:
                    child.kill()
                    break
                time.sleep(0.02)
        assert child.returncode == -signal.SIGKILL, f"the demo ended before {at} chunks"
        events = checked_ok(path)
        assert interlock("runs", "--db", str(path)).returncode == 0
    resumed = interlock("resume", "--db", str(path), "--latency", "0,1", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert checked_ok(path) > events
    replayed = interlock("replay", "--all", "--db", str(path))
    assert replayed.returncode == 0, replayed.stdout
