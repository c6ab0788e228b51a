"""``interlock enqueue``: runs created in a journal with nothing driving them, then resumed (#18)."""

from __future__ import annotations

import json
from pathlib import Path

from tests._cli import interlock

ROUTER = '{"ticket": "my invoice is wrong", "category": "billing"}'
REFUND = '{"order_id": "ord-100000", "customer": "a@example.com", "requested": 50.0}'


def test_enqueued_runs_wait_until_resume_drives_them(tmp_path: Path) -> None:
    db = str(tmp_path / "q.db")
    first = interlock("enqueue", "router", "--db", db, "--run-id", "r-1", "--inputs", ROUTER)
    assert first.returncode == 0, first.stderr
    assert first.stdout == (
        f"enqueued run 'r-1' of 'router' in {db}; `interlock resume --db {db}` drives it\n"
    )
    second = interlock("enqueue", "refund", "--db", db, "--inputs", REFUND, "--json")
    assert second.returncode == 0, second.stderr
    made = json.loads(second.stdout)
    assert (made["machine"], made["db"]) == ("refund", db)
    listed = interlock("runs", "--db", db, "--json")
    assert {(r["run_id"], r["outcome"]) for r in json.loads(listed.stdout)["runs"]} == {
        ("r-1", "running"),
        (made["run_id"], "running"),
    }
    resumed = interlock("resume", "--db", db, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed"] == 2
    listed = interlock("runs", "--db", db, "--json")
    assert {r["outcome"] for r in json.loads(listed.stdout)["runs"]} == {"completed"}
    assert interlock("replay", "--all", "--db", db).returncode == 0


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    db = str(tmp_path / "q.db")
    assert interlock("enqueue", "router", "--db", db, "--run-id", "r-1").returncode == 0
    cases = [
        (
            ("enqueue", "nope"),
            2,
            "interlock: error: the app interlock.demo:app (the default) has "
            "no machine 'nope'; its machines: extraction, refund, router\n",
        ),
        (
            ("enqueue", "router", "--inputs", "[1]"),
            2,
            "interlock: error: argument --inputs: "
            'expected a JSON object like \'{"order_id": "o-1"}\', got list; see \'interlock '
            "enqueue --help'\n",
        ),
        (
            ("enqueue", "router", "--run-id", "r-1"),
            1,
            "interlock: error: run 'r-1' already "
            "exists in this journal; run ids must be unique (omit run_id to have one generated)\n",
        ),
    ]
    for args, code, said in cases:
        done = interlock(*args, "--db", db)
        assert (done.returncode, done.stderr) == (code, said), args
    listed = interlock("runs", "--db", db, "--json")
    assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == ["r-1"]


def test_an_inputs_file_enqueues_one_run_per_line_in_one_write(tmp_path: Path) -> None:
    db = str(tmp_path / "q.db")
    lines = tmp_path / "tickets.jsonl"
    lines.write_text(f"{ROUTER}\n\n{ROUTER}\n{ROUTER}\n")
    made = interlock("enqueue", "router", "--db", db, "--inputs-file", str(lines), "--json")
    assert made.returncode == 0, made.stderr
    ids = json.loads(made.stdout)["run_ids"]
    assert len(set(ids)) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{ROUTER}\n[1]\n")
    refused = interlock("enqueue", "router", "--db", db, "--inputs-file", str(bad))
    assert refused.returncode == 2
    assert refused.stderr == (
        f"interlock: error: --inputs-file {bad}, line 2: expected a JSON object like "
        '\'{"order_id": "o-1"}\', got list\n'
    )
    both = interlock("enqueue", "router", "--db", db, "--inputs-file", str(lines), "--run-id", "x")
    assert both.returncode == 2
    assert "drop --inputs and --run-id" in both.stderr
    listed = interlock("runs", "--db", db, "--json")
    assert sorted(r["run_id"] for r in json.loads(listed.stdout)["runs"]) == sorted(ids)
    resumed = interlock("resume", "--db", db, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed"] == 3
