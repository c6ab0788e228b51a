"""The benchmark runner works end to end in quick mode. Figures are never asserted here."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def expected_benchmarks() -> set[str]:
    """Every ``bench_<name>.py``; ``metrics`` only once the runtime has its collector,
    ``scaleout`` only with PostgreSQL."""
    names = {path.stem.removeprefix("bench_") for path in BENCHMARKS.glob("bench_*.py")}
    if importlib.util.find_spec("interlock.runtime._metrics") is None:
        names.discard("metrics")
    if not os.environ.get("INTERLOCK_PG_DSN"):
        names.discard("scaleout")
    return names


def run_benchmarks(
    *args: str, timeout: float = 120, **variables: str
) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks ARGS`` from the checkout, with the compiled hot path allowed."""
    env = dict(os.environ, COLUMNS="500", **variables)
    env.pop("INTERLOCK_NO_EXTENSIONS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class QuickRun(NamedTuple):
    """One ``python -m benchmarks --quick --out OUT``: what it did and where it wrote."""

    proc: subprocess.CompletedProcess[str]
    out: Path


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    """The quick run of every section, once for the tests that read it (each section's
    test reads its own section of it: running the scaleout and peers sections again on
    their own took as long again as they do here)."""
    out = tmp_path_factory.mktemp("quick")
    return QuickRun(run_benchmarks("--quick", "--out", str(out), timeout=600), out)


def quick_section(quick_run: QuickRun, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The quick run's results.json and its section ``name``, which ran without error."""
    results = json.loads((quick_run.out / "results.json").read_text(encoding="utf-8"))
    assert name in results["benchmarks"], quick_run.proc.stderr[-4000:]
    section = results["benchmarks"][name]
    assert "error" not in section, section.get("traceback")
    return results, section


@pytest.mark.slow
def test_quick_run_writes_every_section(quick_run: QuickRun) -> None:
    proc, tmp_path = quick_run
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


def test_quick_run_without_out_writes_to_a_scratch_directory(tmp_path: Path) -> None:
    """Smoke-run figures never replace the committed RESULTS.md and results.json."""
    committed = {name: (BENCHMARKS / name).read_bytes() for name in ("RESULTS.md", "results.json")}
    proc = run_benchmarks("--quick", "--only", "transition", TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    scratch = tmp_path / "interlock-benchmarks-quick"
    assert f"quick run: writing to {scratch}, not benchmarks/ (--out DIR to choose)" in proc.stderr
    written = json.loads((scratch / "results.json").read_text(encoding="utf-8"))
    assert written["meta"]["quick"] is True
    assert (scratch / "RESULTS.md").exists()
    assert {name: (BENCHMARKS / name).read_bytes() for name in committed} == committed


def _title_of(name: str) -> str:
    source = (BENCHMARKS / f"bench_{name}.py").read_text(encoding="utf-8")
    line = next(line for line in source.splitlines() if line.startswith("TITLE = "))
    title: str = ast.literal_eval(line.removeprefix("TITLE = "))
    return title


def test_unknown_benchmark_is_refused(tmp_path: Path) -> None:
    proc = run_benchmarks("--only", "nosuch", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "unknown benchmark 'nosuch'" in proc.stderr
    assert not (tmp_path / "RESULTS.md").exists()


def test_verification_floor_does_the_gates_work_on_every_proposal() -> None:
    """The floor row accepts exactly what the gate accepts, with the gate's repeat hash.

    A floor that skipped part of the work would understate it, and the report reads the
    1.3x goal against it.
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import bench_verify
    from benchmarks._workload import TOTAL, call_args, call_raw, proposals

    gate = bench_verify._gate()
    floor = bench_verify._minimal()
    over_total = {**call_args(random.Random(1), 3), "amount": TOTAL + 1}
    items = [*proposals(400), call_raw(over_total)]
    accepted = 0
    for raw in items:
        decision = gate(raw)
        got = floor(raw)
        if decision.accepted:
            accepted += 1
            assert got == decision.call_hash, raw
        else:
            assert not isinstance(got, int), raw
    assert 0 < accepted < len(items)


def test_render_rewrites_results_from_recorded_figures(tmp_path: Path) -> None:
    """``--render`` re-evaluates the goals from results.json alone; it runs nothing."""
    recorded = json.loads((BENCHMARKS / "results.json").read_text(encoding="utf-8"))
    recorded["goals"] = []
    (tmp_path / "results.json").write_text(json.dumps(recorded), encoding="utf-8")
    proc = run_benchmarks("--render", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rewritten = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert rewritten["goals"], "the goals were not evaluated again"
    assert rewritten["benchmarks"] == recorded["benchmarks"]
    markdown = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    assert "## Goals" in markdown
    assert f"none of the charts is in {tmp_path}" in markdown
    assert recorded["meta"]["date"] in markdown


def test_render_without_results_says_what_to_do(tmp_path: Path) -> None:
    proc = run_benchmarks("--render", "--out", str(tmp_path))
    assert proc.returncode == 2
    said = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
    assert "cannot render" in said
    assert "run the benchmarks first" in said
    assert not (tmp_path / "RESULTS.md").exists()


@pytest.mark.parametrize(
    "args",
    [("--merge",), ("--merge", "--only", "transition", "--quick"), ("--merge", "--render")],
)
def test_merge_needs_named_sections_of_a_full_run(tmp_path: Path, args: tuple[str, ...]) -> None:
    proc = run_benchmarks(*args, "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "--merge needs --only NAME,... and a full run (no --quick, no --render)" in proc.stderr
    assert not (tmp_path / "RESULTS.md").exists()


def test_merge_without_recorded_results_says_what_to_do(tmp_path: Path) -> None:
    proc = run_benchmarks("--merge", "--only", "transition", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 2
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"cannot merge into {tmp_path / 'results.json'}" in said
    assert "run the whole suite first" in said


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("INTERLOCK_PG_DSN"),
    reason="the scaleout benchmark needs PostgreSQL: set INTERLOCK_PG_DSN",
)
def test_quick_scaleout_drives_every_run_on_real_workers(quick_run: QuickRun) -> None:
    """The section's figures come from runs that really ended: every run completed under
    1, 2 and 4 workers, in batches; the killed worker's runs completed on the survivors."""
    results, section = quick_section(quick_run, "scaleout")
    rows = section["throughput"]
    assert sorted(row["workers"] for row in rows) == [1, 2, 4]
    for row in rows:
        assert row["outcomes"] == {"completed": row["runs"]}, row
        assert sum(row["claimed"]) == row["runs"], row
        assert row["lost"] == 0, row
        assert row["events"] == 15 * row["runs"], row  # 16 events a run, run_started enqueued
        assert row["events_per_transaction"] > 1, row
    assert [c["empty_claims"] for c in section["claims"]] == [50]
    (failover,) = section["failover"]
    assert failover["runs"] > 0, "the killed worker held no run"
    assert failover["outcomes"] == {"completed": 60}, failover
    assert [f["batch"] for f in section["fencing"]] == [1, 100, 1000]
    goal = next(g for g in results["goals"] if g["key"] == "pg_group_commit")
    assert goal["met"] is True
    assert "## Scale-out on PostgreSQL" in (quick_run.out / "RESULTS.md").read_text(
        encoding="utf-8"
    )


def _bench_peers():  # type: ignore[no-untyped-def]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import bench_peers

    return bench_peers


def test_quick_peers_compares_completed_runs_of_every_workload(quick_run: QuickRun) -> None:
    """The peers section measures every workload of issue 19 on runs that really ended,
    counts fsyncs and flushes per tool kind, and evaluates its goals."""
    results, section = quick_section(quick_run, "peers")
    peers = _bench_peers()
    memory = {row["label"]: row for row in section["memory"]}
    assert {peers.INTERLOCK, peers.PLAIN} <= set(memory)
    durable = {row["label"]: row for row in section["durable"]}
    assert [row["tool"] for row in section["durable"] if row["tool"]] == list(peers.TOOL_KINDS)
    if peers.HAVE_BURR:
        assert {peers.BURR, peers.BURR_EXPR, peers.BURR_ASYNC} <= set(memory)
        assert {peers.BURR_SQLITE, peers.BURR_SQLITE_WAL} <= set(durable)
        for label in (peers.BURR_SQLITE, peers.BURR_SQLITE_WAL):  # every step was persisted
            assert durable[label]["persisted"] == durable[label]["completed"] * peers.STEPS
    else:
        assert peers.NO_BURR in section["notes"]
    for row in section["durable"]:
        assert row["steps_per_s"] > 0, row
        if row["tool"]:  # interlock: the store flushed at least once per run
            assert row["flushes_per_step"] >= 1 / peers.STEPS, row
        if "fsyncs_per_step" in row:
            # NOTE: what is always true of a measurement: with synchronous=FULL each counted
            # child fsyncs at least once. The per-step figure is a difference of two counts and
            # is 0.0 when no extra flush falls in the larger run's window (a read-only tool's
            # steps share group commits), so it is only required to be a number. (issue 32)
            assert all(count >= 1 for count in row["fsyncs"]), row
            assert isinstance(row["fsyncs_per_step"], float), row
    if shutil.which("strace") is not None:  # a quick run counts the first row's
        assert "fsyncs_per_step" in section["durable"][0], section["durable"][0]
    rows = section["concurrency"]
    assert {(r["label"], r["runs"]) for r in rows} == {
        (label, n) for label in ("bare trio", "interlock") for n in (100, 300)
    }
    for row in rows:
        if row["label"] == "interlock":
            assert row["completed"] == row["runs"], row
    goals = {g["key"]: g for g in results["goals"] if g["bench"] == "peers"}
    assert set(goals) == {g.key for g in _goals() if g.bench == "peers"}
    assert goals["peers_memory_100k"]["met"] is None  # 100,000 runs are not run in quick mode
    markdown = (quick_run.out / "RESULTS.md").read_text(encoding="utf-8")
    assert f"## {_title_of('peers')}" in markdown
    assert section["git"]["commit"] in markdown


def _goals():  # type: ignore[no-untyped-def]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks._goals import GOALS

    return GOALS


def test_peers_merge_keeps_the_earlier_run_as_before() -> None:
    peers = _bench_peers()

    def section(commit: str, version: int = peers.WORKLOAD_VERSION) -> dict:  # type: ignore[type-arg]
        run = {"label": "", "quick": False, "workload_version": version, "git": {"commit": commit}}
        return {"runs": [run]}

    merged = peers.carry({}, section("aaa"))
    assert [r["label"] for r in merged["runs"]] == ["before"]
    again = peers.carry(merged, section("bbb"))
    assert [(r["label"], r["git"]["commit"]) for r in again["runs"]] == [
        ("before", "aaa"),
        ("after", "bbb"),
    ]
    assert again["git"]["commit"] == "bbb"  # the section's figures are the latest run's
    # a run of another version of the workload is not compared with: it is dropped
    stale = peers.carry({}, section("old", version=peers.WORKLOAD_VERSION - 1))
    fresh = peers.carry(stale, section("new"))
    assert [(r["label"], r["git"]["commit"]) for r in fresh["runs"]] == [("before", "new")]


def test_peers_burr_application_runs_the_same_twenty_steps() -> None:
    peers = _bench_peers()
    if not peers.HAVE_BURR:
        pytest.skip("burr is not installed: pip install apache-burr (the bench extra)")
    raws = peers._raws()
    action, _result, state = peers.burr_app(raws).run(halt_after=["done"])
    assert action.name == "done"
    assert state["step"] == peers.STEPS
    assert len(state["results"]) == peers.STEPS - 1
    assert state["moved"] == "DONE"
    assert peers.plain_run(raws) == {
        "step": peers.STEPS,
        "results": state["results"],
        "state": "DONE",
    }


def test_quick_mcp_proxy_benchmark_measures_every_call_both_ways() -> None:
    """``benchmarks.mcp_proxy`` end to end, briefly: real servers (mcp-server-time, the
    npm filesystem server) called directly, through a bare relay and through the proxy,
    and the proxy's own path in process; every row of both tables is filled. Figures are
    printed, never asserted (a shared host)."""
    pytest.importorskip("mcp", reason="the [mcp] extra is missing")
    pytest.importorskip("mcp_server_time", reason="mcp-server-time (PyPI) is in [test]")
    npm = Path(os.environ.get("INTERLOCK_CI_NPM", Path.home() / ".cache/interlock-ci/npm"))
    if not (npm / "node_modules/@modelcontextprotocol/server-filesystem").exists():
        if os.environ.get("CI"):
            pytest.fail("the npm filesystem server is missing in CI; .ci/run installs it")
        pytest.skip("the npm filesystem server is not installed (.ci/run installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.mcp_proxy", "--calls", "20", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| read-only", "| side"))]
    assert len(rows) == 4, done.stdout  # two calls, in both tables
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(c.endswith(" µs") for c in cells[1:-1]), row


def test_quick_model_proxy_benchmark_fills_its_row() -> None:
    """``benchmarks.model_proxy`` end to end, briefly (figures printed, never asserted)."""
    pytest.importorskip("hypercorn", reason="the [gateway] extra is missing")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.model_proxy", "--requests", "20", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "µs" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["whole", "stream"], rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(c.endswith(" µs") for c in cells[1:-1]), row
