"""The ``interlock`` command line, run as a real process: demo, runs, show, escalations, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def interlock(*args, cwd=None):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "interlock", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "journal.db"
    done = interlock("demo", "--runs", "90", "--db", str(path), "--seed", "3", "--chaos-rate", "0.3", "--latency", "0,1", "--json")
    assert done.returncode == 0, done.stderr
    return path, json.loads(done.stdout)


def test_demo_json_has_stable_keys_and_consistent_counts(demo_db):
    _path, summary = demo_db
    assert summary["runs"] == 90
    assert set(summary) >= {"runs", "wall_seconds", "outcomes", "verification_us", "workflows", "hotpath", "db"}
    assert set(summary["workflows"]) == {"refund", "extraction", "router"}
    for name, row in summary["workflows"].items():
        assert row["runs"] == 30
        assert sum(row["outcomes"].values()) == 30
        assert set(row) >= {"outcomes", "states", "rejections", "breaker_trips", "tokens", "verification_us", "side_effects"}
        assert row["tokens"]["total"] == row["tokens"]["prompt"] + row["tokens"]["completion"] > 0
        assert row["verification_us"]["p50"] <= row["verification_us"]["p99"]
        for counts in row["side_effects"].values():
            assert counts["duplicates"] == 0, name
    assert sum(sum(r["rejections"].values()) for r in summary["workflows"].values()) > 0


def test_runs_lists_every_demo_run_and_filters(demo_db):
    path, summary = demo_db
    listed = json.loads(interlock("runs", "--db", str(path), "--json").stdout)
    assert listed["count"] == 90
    escalated = json.loads(interlock("runs", "--db", str(path), "--outcome", "escalated", "--json").stdout)
    expected = sum(r["outcomes"].get("escalated", 0) for r in summary["workflows"].values())
    assert escalated["count"] == expected
    refunds = json.loads(interlock("runs", "--db", str(path), "--workflow", "refund", "--json").stdout)
    assert {r["machine"] for r in refunds["runs"]} == {"refund"}
    assert refunds["count"] == 30


def test_show_prints_timeline_and_json(demo_db):
    path, _summary = demo_db
    listed = json.loads(interlock("runs", "--db", str(path), "--workflow", "refund", "--limit", "1", "--json").stdout)
    run_id = listed["runs"][0]["run_id"]
    shown = interlock("show", run_id, "--db", str(path), "--json")
    assert shown.returncode == 0
    document = json.loads(shown.stdout)
    assert document["run"]["run_id"] == run_id
    seqs = [e["seq"] for e in document["events"]]
    assert seqs == list(range(1, len(seqs) + 1))
    assert document["events"][0]["kind"] == "run_started"
    text = interlock("show", run_id, "--db", str(path))
    assert text.returncode == 0
    assert "run_started" in text.stdout


def test_escalations_lists_reasons(demo_db):
    path, _summary = demo_db
    queue = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)
    runs = json.loads(interlock("runs", "--db", str(path), "--outcome", "escalated", "--json").stdout)
    assert queue["count"] == runs["count"]
    assert all(item["reason"] for item in queue["escalations"])


def test_missing_database_is_one_line_error_and_creates_nothing(tmp_path):
    missing = tmp_path / "nope.db"
    done = interlock("runs", "--db", str(missing))
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("interlock: error: ")
    assert str(missing) in done.stderr
    assert "Traceback" not in done.stderr
    assert not missing.exists()


def test_unknown_run_is_one_line_error(demo_db):
    path, _summary = demo_db
    done = interlock("show", "no-such-run", "--db", str(path))
    assert done.returncode == 1
    assert done.stderr == "interlock: error: run 'no-such-run' not found\n"


def test_bad_flag_is_one_line_error():
    done = interlock("demo", "--chaos-rate", "2")
    assert done.returncode == 2
    assert done.stderr == (
        "interlock: error: argument --chaos-rate: must be between 0 and 1, got 2.0; "
        "see 'interlock demo --help'\n"
    )


def test_corrupt_database_is_one_line_error_and_untouched(tmp_path):
    bogus = tmp_path / "bogus.db"
    bogus.write_bytes(b"this is not a database" * 100)
    before = bogus.read_bytes()
    done = interlock("runs", "--db", str(bogus))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert str(bogus) in done.stderr
    assert bogus.read_bytes() == before


def test_version_names_the_hot_path():
    done = interlock("--version")
    assert done.returncode == 0
    assert done.stdout.startswith("interlock 0.")
    assert "hot path: " in done.stdout
