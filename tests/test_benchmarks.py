"""The benchmark runner works end to end in quick mode. Figures are never asserted here."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def expected_benchmarks() -> set[str]:
    """Every ``bench_<name>.py``; ``metrics`` only once the runtime has its collector."""
    names = {path.stem.removeprefix("bench_") for path in BENCHMARKS.glob("bench_*.py")}
    if importlib.util.find_spec("interlock._metrics") is None:
        names.discard("metrics")
    return names


@pytest.mark.slow
def test_quick_run_writes_every_section(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("INTERLOCK_NO_EXTENSIONS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    expected = expected_benchmarks()
    assert set(results["meta"]["benchmarks"]) == expected
    assert set(results["benchmarks"]) == expected
    for name, section in results["benchmarks"].items():
        assert "error" not in section, f"{name}: {section.get('error')}"
    assert results["meta"]["quick"] is True
    assert results["meta"]["environment"]["hot_path"]["selected"] in ("compiled", "python")
    assert {goal["bench"] for goal in results["goals"]} <= expected
    assert results["goals"], "no goal was evaluated"

    markdown = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    assert "python -m benchmarks --quick --out" in markdown
    assert "## Goals" in markdown
    for name in expected:
        docstring_title = _title_of(name)
        assert f"## {docstring_title}" in markdown, f"no section for {name}"
    for chart in ("verify_latency.png", "concurrency.png"):
        if importlib.util.find_spec("matplotlib") is not None:
            assert (tmp_path / chart).stat().st_size > 0
            assert f"]({chart})" in markdown


def _title_of(name: str) -> str:
    source = (BENCHMARKS / f"bench_{name}.py").read_text(encoding="utf-8")
    line = next(line for line in source.splitlines() if line.startswith("TITLE = "))
    title: str = ast.literal_eval(line.removeprefix("TITLE = "))
    return title


def test_unknown_benchmark_is_refused(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "nosuch", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown benchmark 'nosuch'" in proc.stderr
    assert not (tmp_path / "RESULTS.md").exists()
