"""`interlock demo --provider ...`: the seed workflows over real HTTP, offline against the
fake server, as real processes; and the flags' mistakes, each one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


#: ``python -c FAST_RETRIES ARGS`` is ``interlock ARGS`` with every wait of the provider
#: policy a hundredth as long: the demo's machines wait 1, 2, 4 and 8 s (jittered) between
#: the five calls that fail before a run escalates, 7.5 to 15 s of the test asleep.
FAST_RETRIES = """
import runpy
from interlock import ProviderPolicy

delay = ProviderPolicy.delay
ProviderPolicy.delay = lambda self, *args: delay(self, *args) / 100
runpy.run_module("interlock", run_name="__main__", alter_sys=True)
"""


def interlock(
    *args: str, cwd: Path, run: tuple[str, ...] = ("-m", "interlock")
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *run, *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--provider", "fake-openai"],
        ["--provider", "fake-openai-responses"],
        ["--provider", "fake-anthropic", "--stream"],
    ],
    ids=["fake-openai", "fake-openai-responses", "fake-anthropic-stream"],
)
def test_the_demo_runs_the_seed_workflows_through_http_offline(
    tmp_path: Path, flags: list[str]
) -> None:
    done = interlock("demo", *flags, "--runs", "30", "--db", "j.db", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["runs"] == 30
    assert summary["outcomes"].get("completed", 0) >= 20
    # every side effect happened once
    for workflow in summary["workflows"].values():
        for counts in workflow["side_effects"].values():
            assert counts.get("duplicates", 0) == 0
    # each model call journaled its exact request and response bodies: replay is offline
    replayed = interlock("replay", "--all", "--db", "j.db", cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "30 reproduced, 0 diverged" in replayed.stdout
    # the conversation as the model saw it at the run's last call
    listed = interlock("runs", "--db", "j.db", "--limit", "1", "--json", cwd=tmp_path)
    run_id = json.loads(listed.stdout)["runs"][0]["run_id"]
    shown = interlock("show", run_id, "--db", "j.db", "--conversation", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("model call at seq ")
    assert "[system] You drive one run of the state machine" in shown.stdout
    assert "answered: " in shown.stdout


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--provider", "openai"], "--provider openai needs --model NAME"),
        (["--model", "gpt-4.1"], "--base-url, --model and --stream are for an HTTP --provider"),
        (["--provider", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_a_wrong_provider_flag_is_one_line(tmp_path: Path, flags: list[str], words: str) -> None:
    done = interlock("demo", *flags, "--runs", "3", "--db", "j.db", cwd=tmp_path)
    assert done.returncode != 0
    assert words in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 3


def test_a_real_server_that_is_not_there_escalates_the_runs_saying_so(tmp_path: Path) -> None:
    done = interlock(
        "demo", "--provider", "openai", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
        "--runs", "3", "--db", "j.db", "--json", cwd=tmp_path, run=("-c", FAST_RETRIES),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["outcomes"] == {"escalated": 3}
    shown = interlock("escalations", "list", "--db", "j.db", cwd=tmp_path)
    assert "provider_unavailable" in shown.stdout
