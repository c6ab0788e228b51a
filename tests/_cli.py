"""The ``interlock`` command line run as a real process, for the tests that drive it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: As wide as no table needs to fold (the tests read whole lines).
COLUMNS = "200"


def interlock(
    *args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m interlock ARGS`` in ``cwd`` and return what it did (never raises on
    a non-zero exit: the tests assert the exit code and both streams)."""
    return subprocess.run(
        [sys.executable, "-m", "interlock", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": COLUMNS, **(env or {})},
        timeout=120,
        check=False,
    )
