"""interlock's benchmark suite: ``python -m benchmarks [--quick] [--only NAME,...] [--out DIR]``.

Each ``bench_<name>.py`` module measures one thing and says what in its docstring; it
exposes ``NAME``, ``TITLE`` and ``run(quick, progress) -> dict``. The runner
(``__main__``) runs them, checks the figures against the performance goals of the
hot-path issue and writes ``RESULTS.md``, ``results.json`` and PNG charts. Nothing here
asserts on speed: the figures are reported, never tested.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent

#: The benchmarks in the order they run (cheap and in-process first).
ORDER = (
    "transition",
    "verify",
    "loop",
    "journal",
    "concurrency",
    "metrics",
    "providers",
    "instructions",
    "gateway",
    "scaleout",
    "peers",
)


def available() -> list[str]:
    """The names of the benchmarks this checkout can run.

    ``metrics`` needs both ``bench_metrics.py`` and the runtime's metrics collector
    (``interlock.runtime._metrics``); ``scaleout`` needs PostgreSQL (``INTERLOCK_PG_DSN``).
    """
    names = []
    for name in ORDER:
        if not (HERE / f"bench_{name}.py").exists():
            continue
        if name == "metrics" and importlib.util.find_spec("interlock.runtime._metrics") is None:
            continue
        if name == "scaleout" and not os.environ.get("INTERLOCK_PG_DSN"):
            continue
        names.append(name)
    return names


def load(name: str) -> ModuleType:
    """Import ``benchmarks.bench_<name>``."""
    return importlib.import_module(f"benchmarks.bench_{name}")


def run_section(name: str, quick: bool) -> dict[str, Any]:
    """Run one section with no progress display, its failure as a result, timed (what a
    worker process of the parallel quick run does)."""
    import time
    import traceback

    started = time.perf_counter()
    try:
        result: dict[str, Any] = load(name).run(quick, lambda description, fraction: None)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["seconds"] = time.perf_counter() - started
    return result
