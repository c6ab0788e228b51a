"""Ctrl-C ends a command promptly, however many runs it drives, and leaves a journal that
checks clean (#32): real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests._cli import interlock

#: An application whose lifespan never finishes closing (a pool that hangs on close).
HANGS = textwrap.dedent(
    """
    import contextlib

    import trio

    from interlock import App, Machine, Tool, Worker
    from interlock.providers import ScriptedProvider


    async def wait(args, ctx):
        await trio.sleep(3600)
        return {}


    @contextlib.asynccontextmanager
    async def lifespan(db):
        try:
            yield
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(3600)


    machine = Machine(
        "slow",
        initial="WAIT",
        states={"WAIT": Worker(next=["COMPLETED"], tools=["wait"])},
        tools=[Tool("wait", wait, {"type": "object"}, "Wait.", idempotent=True)],
    )
    app = App(
        [machine],
        provider=ScriptedProvider(lambda view: '{"tool": "wait", "args": {}}'),
        lifespan=lifespan,
    )
    """
)


def _start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "interlock", *args],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _interrupt(process: subprocess.Popen[str]) -> str:
    """Ctrl-C, then what the process said once it ended (30 s for it to end: it does; how
    fast is for the benchmarks). A process that does not end is killed."""
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=30)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_for_runs(db: Path, cwd: Path, process: subprocess.Popen[str]) -> None:
    """Until the journal holds a running run (not a timing: what the test waits for)."""
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up and process.poll() is None:
        if db.exists():
            listed = interlock("runs", "--db", str(db), "--outcome", "running", "--json", cwd=cwd)
            if listed.returncode == 0 and json.loads(listed.stdout)["count"]:
                return
        time.sleep(0.1)
    raise AssertionError("no run started")


def test_ctrl_c_ends_a_large_demo_and_its_journal_checks_clean(tmp_path):
    """Regression: Ctrl-C took about 10 s to end a demo of tens of thousands of runs,
    cancelling and unwinding each of them."""
    db = tmp_path / "j.db"
    process = _start("demo", "--runs", "30000", "--db", str(db), cwd=tmp_path)
    _wait_for_runs(db, tmp_path, process)
    err = _interrupt(process)
    assert process.returncode == 130
    assert err == (
        f"interlock: interrupted; `interlock resume --db {db}` continues the unfinished runs\n"
    )
    checked = interlock("check", "--db", str(db), cwd=tmp_path)
    assert (checked.returncode, checked.stderr) == (0, "")
    assert checked.stdout.startswith("ok: ")


def test_ctrl_c_ends_a_command_whose_cleanup_hangs(tmp_path):
    """A clean stop that does not end (here an app's lifespan that hangs while closing)
    no longer keeps the process alive after Ctrl-C: it exits 130, and what the journal
    holds is whole."""
    (tmp_path / "hangs.py").write_text(HANGS)
    db = tmp_path / "hangs.db"
    process = _start(
        "run", "--app", "hangs.py:app", "slow", "--count", "3", "--db", str(db), cwd=tmp_path
    )
    _wait_for_runs(db, tmp_path, process)
    err = _interrupt(process)
    assert process.returncode == 130
    assert err == (
        f"interlock: interrupted; `interlock resume --db {db} --app hangs.py:app` continues "
        "the unfinished runs\n"
    )
    checked = interlock("check", "--db", str(db), cwd=tmp_path)
    assert (checked.returncode, checked.stdout[:3]) == (0, "ok:"), checked.stderr
