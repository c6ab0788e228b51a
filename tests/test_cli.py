"""The ``interlock`` command line, run as a real process: demo, runs, show, escalations, errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests._cli import interlock


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "journal.db"
    done = interlock(
        "demo",
        "--runs",
        "90",
        "--db",
        str(path),
        "--seed",
        "3",
        "--chaos-rate",
        "0.3",
        "--latency",
        "0,1",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    return path, json.loads(done.stdout)


def test_demo_json_has_stable_keys_and_consistent_counts(demo_db):
    _path, summary = demo_db
    assert summary["runs"] == 90
    assert set(summary) >= {
        "runs",
        "wall_seconds",
        "outcomes",
        "verification_us",
        "workflows",
        "hotpath",
        "db",
    }
    assert set(summary["workflows"]) == {"refund", "extraction", "router"}
    for name, row in summary["workflows"].items():
        assert row["runs"] == 30
        assert sum(row["outcomes"].values()) == 30
        assert set(row) >= {
            "outcomes",
            "states",
            "rejections",
            "breaker_trips",
            "tokens",
            "verification_us",
            "side_effects",
        }
        assert row["tokens"]["total"] == row["tokens"]["prompt"] + row["tokens"]["completion"] > 0
        assert row["verification_us"]["p50"] <= row["verification_us"]["p99"]
        for counts in row["side_effects"].values():
            assert counts["duplicates"] == 0, name
    assert sum(sum(r["rejections"].values()) for r in summary["workflows"].values()) > 0


def test_runs_lists_every_demo_run_and_filters(demo_db):
    path, summary = demo_db
    listed = json.loads(interlock("runs", "--db", str(path), "--all", "--json").stdout)
    assert (listed["count"], listed["left_out"]) == (90, 0)
    escalated = json.loads(
        interlock("runs", "--db", str(path), "--outcome", "escalated", "--all", "--json").stdout
    )
    expected = sum(r["outcomes"].get("escalated", 0) for r in summary["workflows"].values())
    assert escalated["count"] == expected
    refunds = json.loads(
        interlock("runs", "--db", str(path), "--workflow", "refund", "--json").stdout
    )
    assert {r["machine"] for r in refunds["runs"]} == {"refund"}
    assert refunds["count"] == 30


def test_runs_shows_the_newest_50_and_says_how_many_it_left_out(demo_db):
    """Regression: ``runs`` printed every run of a 20,000-run journal (no default limit)."""
    path, _summary = demo_db
    every = json.loads(interlock("runs", "--db", str(path), "--all", "--json").stdout)["runs"]
    assert [r["started"] for r in every] == sorted((r["started"] for r in every), reverse=True)
    default = json.loads(interlock("runs", "--db", str(path), "--json").stdout)
    assert (default["count"], default["left_out"]) == (50, 40)
    assert default["runs"] == every[:50]
    three = json.loads(interlock("runs", "--db", str(path), "--limit", "3", "--json").stdout)
    assert (three["runs"], three["left_out"]) == (every[:3], 87)
    text = interlock("runs", "--db", str(path), "--limit", "3")
    assert text.returncode == 0
    assert text.stdout.rstrip().endswith("87 older runs left out; --limit N or --all shows more")


def test_tables_never_cut_run_ids_even_narrow_or_piped(demo_db):
    """Regression: tables cut run ids at 80 columns or when piped (``refund-d…``)."""
    path, _summary = demo_db
    ids = [
        r["run_id"]
        for r in json.loads(interlock("runs", "--db", str(path), "--all", "--json").stdout)["runs"]
    ]
    queue = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)["escalations"]
    for columns in ("40", "80"):
        env = {"COLUMNS": columns}
        listed = interlock("runs", "--db", str(path), "--all", env=env).stdout
        assert [i for i in ids if i not in listed] == [], columns
        escalated = interlock("escalations", "list", "--db", str(path), env=env).stdout
        assert [e["run_id"] for e in queue if e["run_id"] not in escalated] == [], columns


def _on_a_terminal(*args, columns="80"):
    """What ``interlock ARGS`` shows on a terminal this wide (FORCE_COLOR: rich takes the
    pipe for one), its colours taken out."""
    import re

    done = interlock(*args, env={"COLUMNS": columns, "FORCE_COLOR": "1"})
    assert done.returncode == 0, done.stderr
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)


def test_tables_on_an_80_column_terminal_keep_run_ids_and_outcomes_whole(demo_db, tmp_path):
    """Regression (#32): at 80 columns the runs table cut generated run ids, dropped the
    reason column and cut the outcome to "comple"; the demo's summary cut its headers."""
    path, _summary = demo_db
    runs = json.loads(interlock("runs", "--db", str(path), "--all", "--json").stdout)["runs"]
    listed = _on_a_terminal("runs", "--db", str(path), "--all").splitlines()
    assert max(len(line) for line in listed) <= 80
    for run in runs:
        rows = [line for line in listed if f" {run['run_id']} " in line]
        assert len(rows) == 1, run["run_id"]
        assert f" {run['outcome']} " in rows[0], (run, rows[0])
    queue = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)
    escalated = _on_a_terminal("escalations", "list", "--db", str(path))
    assert max(len(line) for line in escalated.splitlines()) <= 80
    assert [e["run_id"] for e in queue["escalations"] if f" {e['run_id']} " not in escalated] == []
    summary = _on_a_terminal("demo", "--runs", "6", "--db", str(tmp_path / "d.db"))
    header = next(line for line in summary.splitlines() if "completed" in line)
    assert [
        w for w in ("workflow", "runs", "completed", "escalated", "failed") if w not in header
    ] == []


def test_db_and_json_after_the_subcommand(demo_db):
    """Regression: ``escalations list --db journal.db`` (as the README writes it) failed,
    and ``escalations --json show ID`` ignored --json."""
    path, _summary = demo_db
    before = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)
    after = interlock("escalations", "list", "--db", str(path), "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) == before
    run_id = before["escalations"][0]["run_id"]
    for args in (
        ("escalations", "--json", "show", run_id, "--db", str(path)),
        ("escalations", "--db", "elsewhere.db", "show", run_id, "--db", str(path), "--json"),
    ):
        shown = interlock(*args)
        assert shown.returncode == 0, (args, shown.stderr)
        assert json.loads(shown.stdout)["run"]["run_id"] == run_id


def test_show_prints_timeline_and_json(demo_db):
    path, _summary = demo_db
    listed = json.loads(
        interlock(
            "runs", "--db", str(path), "--workflow", "refund", "--limit", "1", "--json"
        ).stdout
    )
    run_id = listed["runs"][0]["run_id"]
    shown = interlock("show", run_id, "--db", str(path), "--json")
    assert shown.returncode == 0
    document = json.loads(shown.stdout)
    assert document["run"]["run_id"] == run_id
    seqs = [e["seq"] for e in document["events"]]
    assert seqs == list(range(1, len(seqs) + 1))
    assert document["events"][0]["kind"] == "run_started"
    # Each model call carries its whole prompt, rebuilt from the journaled delta and checked.
    calls = [e for e in document["events"] if e["kind"] == "model_called"]
    assert len(calls) >= 2
    assert any(c["prompt_base"] for c in calls)  # later prompts are journaled as deltas
    for call in calls:
        whole = call["prompt_text"]
        assert hashlib.sha256(whole.encode()).hexdigest()[:32] == call["prompt_hash"]
        assert whole.startswith("machine: refund\nstate: ")
        assert len(whole) >= len(call["prompt"])
    text = interlock("show", run_id, "--db", str(path))
    assert text.returncode == 0
    assert "run_started" in text.stdout


def test_escalations_lists_reasons(demo_db):
    path, _summary = demo_db
    queue = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)
    runs = json.loads(
        interlock("runs", "--db", str(path), "--outcome", "escalated", "--json").stdout
    )
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
    assert done.stderr == (
        f"interlock: error: run 'no-such-run' not found in {path}; "
        f"`interlock runs --db {path}` lists its runs\n"
    )


def test_bad_flag_is_one_line_error():
    done = interlock("demo", "--chaos-rate", "2")
    assert done.returncode == 2
    assert done.stderr == (
        "interlock: error: argument --chaos-rate: must be between 0 and 1, got 2.0; "
        "see 'interlock demo --help'\n"
    )


@pytest.mark.parametrize(
    "command", [["demo"], ["runs"], ["show", "r"], ["escalations", "list"], ["resume"], ["check"]]
)
def test_an_empty_db_is_one_line_error(tmp_path, command):
    """Regression: it read "database  does not exist"."""
    done = interlock(*command, "--db", "", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    prog = " ".join(["interlock", *(c for c in command if c != "r")])
    assert done.stderr == (
        "interlock: error: argument --db: expected a SQLite path or postgresql:// DSN, "
        f"got ''; see '{prog} --help'\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_corrupt_database_is_one_line_error_and_untouched(tmp_path):
    bogus = tmp_path / "bogus.db"
    bogus.write_bytes(b"this is not a database" * 100)
    before = bogus.read_bytes()
    done = interlock("runs", "--db", str(bogus))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert str(bogus) in done.stderr
    assert bogus.read_bytes() == before


def test_version_names_the_hot_path_and_the_decide_path():
    from interlock.core._hotpath import IMPLEMENTATION
    from interlock.core._view import DECIDE_IMPLEMENTATION

    done = interlock("--version")
    assert done.returncode == 0
    assert done.stdout.startswith("interlock 0.")
    assert f"(hot path: {IMPLEMENTATION}, decide path: {DECIDE_IMPLEMENTATION})" in done.stdout


def _digest(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def escalated_db(tmp_path):
    # Every model answer corrupted: each run is rejected three times in a row and escalates.
    path = tmp_path / "esc.db"
    done = interlock(
        "demo", "--runs", "3", "--workflow", "refund", "--db", str(path), "--chaos-rate", "1",
        "--seed", "5", "--latency", "0,1", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    queue = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)
    assert [item["reason"] for item in queue["escalations"]] == ["consecutive_failures"] * 3
    return path, queue["escalations"][0]["run_id"]


def test_summary_breaks_escalations_down_by_reason(tmp_path):
    """Regression: after a crash the summary showed "322 escalated" beside 6 breaker trips,
    with no breakdown of the escalation reasons."""
    path = tmp_path / "esc.db"
    done = interlock(
        "demo", "--runs", "3", "--workflow", "refund", "--db", str(path), "--chaos-rate", "1",
        "--latency", "0,1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [" ".join(line.strip("│ ").split()) for line in done.stdout.splitlines()]
    at = lines.index("escalations by reason")
    assert "consecutive_failures │ 3" in lines[at + 1 : at + 6]
    nothing = interlock("resume", "--db", str(path))
    assert (nothing.returncode, nothing.stderr) == (0, "")
    assert nothing.stdout == f"nothing to resume in {path}: 3 runs, none unfinished\n"


def test_malformed_payload_is_refused_and_store_unchanged(escalated_db):
    path, run_id = escalated_db
    before = _digest(path)
    done = interlock(
        "escalations", "--db", str(path), "resume", run_id, "--payload", '{"tool": "refund",}'
    )
    assert done.returncode == 1
    assert done.stderr == (
        "interlock: error: --payload is not valid JSON (JSON is malformed: trailing comma in object "
        '(byte 18)); pass one proposal like \'{"tool": "refund", "args": {...}}\' or \'{"next": "STATE"}\'\n'
    )
    rejected = interlock(
        "escalations",
        "--db",
        str(path),
        "resume",
        run_id,
        "--payload",
        '{"tool": "refund", "args": {"amount": "10"}}',
    )
    assert rejected.returncode == 1
    assert rejected.stderr.startswith(
        f"interlock: error: payload for run '{run_id}' was rejected: [schema] "
    )
    assert rejected.stderr.count("\n") == 1
    illegal = interlock("escalations", "--db", str(path), "resume", run_id, "--to", "COMPLETED")
    assert illegal.returncode == 1
    assert illegal.stderr == (
        f"interlock: error: cannot resume run '{run_id}' in state 'COMPLETED'; it escalated from 'WORK' "
        "and may resume in: WORK\n"
    )
    assert _digest(path) == before
    record = json.loads(interlock("show", run_id, "--db", str(path), "--json").stdout)["run"]
    assert record["outcome"] == "escalated"


def test_escalation_resume_and_abort_are_journaled(escalated_db):
    path, run_id = escalated_db
    queue = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)["escalations"]
    shown = interlock("escalations", "--db", str(path), "show", run_id, "--json")
    assert json.loads(shown.stdout)["run"]["reason"] == queue[0]["reason"]
    resumed = interlock(
        "escalations",
        "--db",
        str(path),
        "resume",
        run_id,
        "--note",
        "checked",
        "--by",
        "ada",
        "--json",
    )
    assert resumed.returncode == 0, resumed.stderr
    outcome = json.loads(resumed.stdout)
    assert outcome["run_id"] == run_id
    events = json.loads(interlock("show", run_id, "--db", str(path), "--json").stdout)["events"]
    resumes = [e for e in events if e["kind"] == "resumed"]
    assert resumes[0]["by"] == "ada"
    assert resumes[0]["note"] == "checked"
    other = queue[1]["run_id"]
    aborted = interlock(
        "escalations", "--db", str(path), "abort", other, "--note", "duplicate", "--by", "ada",
        "--json",
    )  # fmt: skip
    assert aborted.returncode == 0, aborted.stderr
    ended = json.loads(aborted.stdout)
    assert (ended["run_id"], ended["outcome"], ended["state"], ended["reason"]) == (
        other,
        "failed",
        "FAILED",
        "aborted by ada: duplicate",
    )
    events = json.loads(interlock("show", other, "--db", str(path), "--json").stdout)["events"]
    assert [e["kind"] for e in events[-3:]] == ["resumed", "transitioned", "failed"]
    assert (events[-3]["by"], events[-3]["note"], events[-3]["to"]) == (
        "ada",
        "duplicate",
        "FAILED",
    )
    # a repeat is answered with what was done, and journals nothing (#32)
    again = interlock("escalations", "--db", str(path), "abort", other)
    assert (again.returncode, again.stderr) == (0, "")
    assert again.stdout.startswith(f"run '{other}' was already aborted by ada at ")
    assert again.stdout.endswith(
        f" UTC with the note 'duplicate' (seq {events[-3]['seq']}); it is failed in state "
        "'FAILED' now\n"
    )
    late = interlock("escalations", "--db", str(path), "resume", other)
    assert late.returncode == 1
    assert late.stderr.startswith(f"interlock: error: cannot resume run '{other}': it was ")
    left = json.loads(interlock("escalations", "--db", str(path), "--json").stdout)
    assert other not in {item["run_id"] for item in left["escalations"]}
    assert queue[2]["run_id"] in {item["run_id"] for item in left["escalations"]}
    replayed = interlock("replay", "--all", "--db", str(path), "--json")
    assert replayed.returncode == 0, replayed.stdout
    missing = interlock("escalations", "--db", str(path), "resume", "no-such-run")
    assert missing.returncode == 1
    assert missing.stderr == (
        f"interlock: error: run 'no-such-run' not found in {path}; "
        f"`interlock runs --db {path}` lists its runs\n"
    )


def test_truncated_database_is_one_line_error_and_untouched(tmp_path):
    path = tmp_path / "t.db"
    done = interlock("demo", "--runs", "30", "--db", str(path), "--latency", "0,1", "--json")
    assert done.returncode == 0, done.stderr
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    snapshot = _digest(path)
    for args in (("runs",), ("resume",), ("replay", "--all"), ("escalations",)):
        result = interlock(*args, "--db", str(path))
        assert result.returncode == 1, args
        assert result.stderr.startswith("interlock: error: "), (args, result.stderr)
        assert result.stderr.count("\n") == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert _digest(path) == snapshot


def test_corrupt_event_is_reported_by_show_and_replay(tmp_path):
    import sqlite3

    path = tmp_path / "c.db"
    done = interlock("demo", "--runs", "6", "--db", str(path), "--latency", "0,1", "--json")
    assert done.returncode == 0, done.stderr
    db = sqlite3.connect(path)
    # The third event of the first run, inside its chunk (one row per run per batch of frames).
    run_id, first, body = db.execute(
        "SELECT run_id, first_seq, body FROM chunks WHERE first_seq <= 3 AND last_seq >= 3 ORDER BY run_id LIMIT 1"
    ).fetchone()
    seq, end = first, 0
    while True:  # frame: [length u32 LE][~length u32 LE][crc32 u32 LE][payload]
        end += 12 + int.from_bytes(body[end : end + 4], "little")
        if seq == 3:
            break
        seq += 1
    flipped = bytearray(body)
    flipped[end - 1] ^= 0x55
    db.execute(
        "UPDATE chunks SET body = ? WHERE run_id = ? AND first_seq = ?",
        (bytes(flipped), run_id, first),
    )
    db.commit()
    db.close()
    snapshot = _digest(path)
    shown = interlock("show", run_id, "--db", str(path))
    assert shown.returncode == 1
    assert shown.stderr.startswith(
        f"interlock: error: journal of run '{run_id}' is corrupt (checksum mismatch) at seq {seq}"
    )
    replayed = interlock("replay", run_id, "--db", str(path))
    assert replayed.returncode == 1
    assert replayed.stderr == shown.stderr
    assert _digest(path) == snapshot


def test_show_tells_provider_failures_doubt_and_reconciliation(tmp_path):
    """show names what #14 journals: a provider failure, a call in doubt and how it was
    reconciled, and a rejection's code in brackets (not eaten as terminal markup)."""
    import trio

    from interlock import (
        Applied,
        Machine,
        ProviderError,
        ProviderPolicy,
        Tool,
        Worker,
        open_supervisor,
    )
    from interlock.providers import Proposal
    from interlock.stores import open_sqlite_store

    applied = {}

    async def wire(args, ctx):
        applied[ctx.key] = {"wired": True}
        raise ConnectionResetError("dropped after the write")

    async def wired(key, args, ctx):
        return Applied(applied[key])

    class Model:
        model = "m-1"

        def __init__(self):
            self.answers = [
                ProviderError("503 upstream", status=503),
                "{",
                '{"tool": "wire", "args": {}}',
            ]

        async def propose(self, view):
            await trio.lowlevel.checkpoint()
            answer = self.answers.pop(0) if self.answers else '{"next": "COMPLETED"}'
            if isinstance(answer, Exception):
                raise answer
            return Proposal(answer)

    spec = Machine(
        "bank",
        initial="PAY",
        states={"PAY": Worker(next=["COMPLETED"], tools=["wire"])},
        tools=[Tool("wire", wire, reconcile=wired)],
        provider_policy=ProviderPolicy(base=0.01, cap=0.01),
    )
    db = tmp_path / "bank.db"

    async def main():
        store = await open_sqlite_store(str(db))
        async with open_supervisor([spec], store, provider=Model()) as sup:
            await (await sup.start_run("bank", run_id="b-1")).wait()
        await store.aclose()

    trio.run(main)
    shown = interlock("show", "b-1", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    for expected in (
        "model m-1 did not answer (failure 1 in a row): provider raised ProviderError: 503",
        "rejected: [malformed] proposal is cut off",
        "in doubt: wire key=b-1:PAY:",
        "reconciled wire key=b-1:PAY:",
        "(as reconciled, not executed again)",
    ):
        assert expected in text, expected


@pytest.mark.parametrize("after", [0.0, 0.2, 0.5, 1.0])
def test_ctrl_c_during_the_demo_is_one_line_not_a_traceback(tmp_path, after):
    """Ctrl-C during `demo` printed a 55-line traceback (#15); then, one time in two, a
    TrioInternalError, a coroutine never awaited, or no exit at all (a KeyboardInterrupt
    raised inside trio's bookkeeping): now Ctrl-C cancels the command at a checkpoint."""
    import signal
    import time

    db = tmp_path / "j.db"
    process = subprocess.Popen(
        [sys.executable, "-m", "interlock", "demo", "--db", str(db), "--runs", "20000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    give_up = time.monotonic() + 60
    while not db.exists() and time.monotonic() < give_up:  # not a timing: wait for the journal
        time.sleep(0.05)
    time.sleep(after)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert err == (
        f"interlock: interrupted; `interlock resume --db {db}` continues the unfinished runs\n"
    )


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
def test_show_conversation_shows_every_call_of_a_turn_and_which_one_ran(tmp_path, kind):
    """Regression (#32): of a turn of parallel calls, ``show --conversation`` printed only
    the last call (OpenAI Chat), which was never run, and hid the one that ran."""
    import msgspec
    import trio

    from interlock import Machine, Tool, Worker, open_supervisor
    from interlock.providers import AnthropicMessages, OpenAIChat, OpenAIResponses
    from interlock.stores import open_sqlite_store
    from interlock.testing._fake import Reply, open_fake_llm, scripted_brain

    class Lookup(msgspec.Struct, forbid_unknown_fields=True):
        order_id: str

    async def lookup(args, ctx):
        return {"order_id": args.order_id, "total": 40}

    shop = Machine(
        "shop",
        "WORK",
        {"WORK": Worker(next=["COMPLETED"], tools=["lookup"])},
        tools=[Tool("lookup", lookup, Lookup, read_only=True)],
    )
    replies = [
        Reply(calls=[("lookup", '{"order_id": "o1"}'), ("lookup", '{"order_id": "o2"}')]),
        Reply(
            calls=[
                ("transition", '{"next": "COMPLETED", "data": {"total": 40}}'),
                ("lookup", '{"order_id": "o3"}'),
            ]
        ),
    ]
    path = tmp_path / "j.db"

    async def run():
        store = await open_sqlite_store(str(path))
        async with open_fake_llm(scripted_brain(replies)) as fake:
            provider = {
                "chat": lambda: OpenAIChat("m", base_url=fake.openai_base_url),
                "responses": lambda: OpenAIResponses("m", base_url=fake.openai_base_url),
                "messages": lambda: AnthropicMessages("m", base_url=fake.anthropic_base_url),
            }[kind]()
            async with provider, open_supervisor([shop], store, provider=provider) as sup:
                handle = await sup.start_run("shop", {"order_id": "o1"}, run_id="r-1")
                assert (await handle.wait()).outcome == "completed"
        await store.aclose()

    trio.run(run)
    shown = interlock("show", "r-1", "--db", str(path), "--conversation")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    # the turn before: both calls, the one that ran with its result
    ran = [line for line in lines if line.startswith("[assistant] call 1 of 2, ran: ")]
    assert len(ran) == 1, shown.stdout
    assert ran[0].startswith('[assistant] call 1 of 2, ran: lookup({"order_id": "o1"}) id=')
    assert ran[0].endswith(' -> {"order_id":"o1","total":40}')
    skipped = [line for line in lines if line.startswith("[assistant] call 2 of 2, ")]
    assert len(skipped) == 1, shown.stdout
    assert skipped[0].startswith(
        '[assistant] call 2 of 2, not run (one call per turn): lookup({"order_id": "o2"}) id='
    )
    # the last answer: both calls, the one that ran with what came of it
    assert lines[-2:] == [
        'answer call 1 of 2, ran: {"next": "COMPLETED", "data": {"total": 40}} -> '
        'WORK -> COMPLETED (proposal) data {"total":40}',
        'answer call 2 of 2, not run (one call per turn): lookup({"order_id": "o3"})',
    ]


def test_show_conversation_formats_the_console_s_parse_of_a_messages_body():
    """``show --conversation`` and the console read a request body with one parser
    (core._conversation): a system prompt given as blocks, a turn's text blocks joined
    on one line, a failed tool result marked, and a result given as blocks shown as its
    text (it was printed as a Python list)."""
    from interlock.cli._show import _turns

    body = {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "refund o-1"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "u1", "name": "refund", "input": {"id": "o-1"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "u1",
                        "is_error": True,
                        "content": [{"type": "text", "text": "declined"}],
                    }
                ],
            },
        ],
        "tools": [{"name": "refund"}],
    }
    assert _turns(body) == [
        "[system] be brief",
        "[user] refund o-1",
        "[assistant] checking",
        '[assistant] call refund({"id": "o-1"}) id=u1',
        "[user] result (error) of u1: declined",
        "[tools] refund",
    ]
