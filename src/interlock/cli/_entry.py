"""``interlock``'s entry point: parse, run the command under trio, exit codes, Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING

import trio

from ..core._exceptions import AppRefError, InterlockError, InternalError
from ..stores._sqlite import JournalHeld
from ._check import _check
from ._common import _error, _leaves, _Usage
from ._demo import _demo
from ._escalations import _escalations
from ._mcp import _mcp
from ._parser import build_parser
from ._proxy import _proxy
from ._replay import _replay
from ._run import _enqueue, _resume, _run
from ._serve import _console, _serve
from ._show import _runs, _show
from ._worker import _worker

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence


_COMMANDS = {
    "demo": _demo,
    "run": _run,
    "runs": _runs,
    "show": _show,
    "escalations": _escalations,
    "resume": _resume,
    "enqueue": _enqueue,
    "replay": _replay,
    "check": _check,
    "serve": _serve,
    "console": _console,
    "worker": _worker,
    "mcp": _mcp,
    "proxy": _proxy,
}


#: Seconds a command has, after Ctrl-C, to end cleanly before the process exits at once.
INTERRUPT_GRACE = 1.0


class _Stop:
    """Ctrl-C: cancel the command at once, so it stops at a checkpoint (its journal
    batches whole) and not wherever a KeyboardInterrupt would land, inside trio's own
    bookkeeping included; and if it has not ended :data:`INTERRUPT_GRACE` seconds later
    (or at a second Ctrl-C), exit 130 there, as a crash would leave things.

    Unwinding tens of thousands of runs takes trio seconds (a cancellation per task, and
    the exception groups that carry them); the journal needs none of it: every batch is
    one transaction, written whole or not at all, and what a resume would redo is only
    what no batch holds yet. The clock runs in a thread of its own, so a trio scheduler
    busy with those runs cannot hold it up.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import threading

        self.args = args
        self.interrupted = False
        self.said = threading.Lock()  # whoever takes it says "interrupted", once
        self._read, self._write = os.pipe()
        threading.Thread(target=self._clock, name="interlock-interrupt", daemon=True).start()

    def install(self, cancel: Callable[[], None]) -> Callable[[], None]:
        """Handle SIGINT (``cancel`` cancels the command); returns what restores it."""
        import signal

        token = trio.lowlevel.current_trio_token()

        def stop() -> None:
            self.interrupted = True
            cancel()

        def handler(_signum: int, _frame: object) -> None:
            # NOTE: a signal handler: only a write to a pipe and trio's signal-safe call
            os.write(self._write, b"!")
            token.run_sync_soon(stop, idempotent=True)

        previous = signal.signal(signal.SIGINT, handler)

        def restore() -> None:
            signal.signal(signal.SIGINT, previous)

        return restore

    def _clock(self) -> None:
        import select

        if os.read(self._read, 1) != b"!":
            return  # the command ended without a Ctrl-C
        ready, _, _ = select.select([self._read], [], [], INTERRUPT_GRACE)
        if ready and os.read(self._read, 1) != b"!":
            return  # the command ended cleanly in time
        if not self.said.acquire(blocking=False):
            return
        line = _interrupted_line(self.args)
        if os.isatty(2):  # a live progress display hid the cursor and holds a line
            line = "\r\x1b[2K\x1b[?25h" + line
        # NOTE: not sys.stdout.flush(): the main thread may hold stdout's lock, blocked
        # on a full pipe; what it printed whole is out already, line by line or at exit
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(130)

    def ended(self) -> bool:
        """The command ended: stop the clock; False if it is exiting the process already."""
        os.write(self._write, b"q")
        return self.said.acquire(blocking=False)


async def _command(args: argparse.Namespace, stop: _Stop) -> int:
    """Run the command; Ctrl-C cancels it (see :class:`_Stop`)."""
    code = 130
    async with trio.open_nursery() as nursery:
        # a worker (and an MCP proxy over HTTP) drains on SIGINT and SIGTERM itself
        drains = args.command in ("worker", "proxy") or (
            args.command == "mcp" and getattr(args, "http", None) is not None
        )
        restore = None if drains else stop.install(nursery.cancel_scope.cancel)
        try:
            code = await _COMMANDS[args.command](args)
        finally:
            if restore is not None:
                restore()
        nursery.cancel_scope.cancel()
    if stop.interrupted:
        raise KeyboardInterrupt
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``interlock`` console script and ``python -m interlock``."""
    args = build_parser().parse_args(argv)
    stop = _Stop(args)
    try:
        return _main(args, stop)
    finally:
        stop.ended()


def _main(args: argparse.Namespace, stop: _Stop) -> int:
    try:
        return trio.run(_command, args, stop)
    except (AppRefError, _Usage, JournalHeld) as exc:
        sys.stderr.write(_error(exc, args))
        return 2
    except InternalError as exc:  # one line too; INTERLOCK_DEBUG=1 shows the traceback
        if os.environ.get("INTERLOCK_DEBUG"):
            raise
        sys.stderr.write(_error(exc, args).rstrip("\n") + " (INTERLOCK_DEBUG=1 shows where)\n")
        return 1
    except (InterlockError, ValueError, OSError) as exc:
        sys.stderr.write(_error(exc, args))
        return 1
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            return _interrupted(args, stop)
        expected = [e for e in leaves if isinstance(e, InterlockError | ValueError | OSError)]
        if not expected or len(expected) != len(leaves):
            raise
        sys.stderr.write(_error(expected[0], args))
        return 2 if isinstance(expected[0], AppRefError | _Usage | JournalHeld) else 1
    except KeyboardInterrupt:
        return _interrupted(args, stop)


def _interrupted(args: argparse.Namespace, stop: _Stop) -> int:
    """Ctrl-C: one line, not a traceback; every batch written so far is in the journal."""
    if not stop.ended():
        time.sleep(60)  # the clock is exiting the process, having said so
    sys.stderr.write(_interrupted_line(args))
    return 130


def _interrupted_line(args: argparse.Namespace) -> str:
    db = getattr(args, "db", None)
    app = f" --app {shlex.quote(args.app)}" if getattr(args, "app", None) else ""
    resume = (
        f"; `interlock resume --db {shlex.quote(db)}{app}` continues the unfinished runs"
        if db
        else ""
    )
    return f"interlock: interrupted{resume}\n"
