"""Applications: ``interlock.App`` and the CLI operating a user's own machine through
``--app``, as real processes, from a directory that is not the one holding the machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from interlock import App, InterlockError, Machine, Worker
from interlock.providers import ScriptedProvider
from tests._cli import interlock

BANK = textwrap.dedent(
    '''
    """A user's application: one machine that wires money, its model a script."""
    import os
    import sys
    from typing import Annotated

    import msgspec
    import trio

    from interlock import App, Machine, Tool, Worker, open_supervisor
    from interlock.providers import ScriptedProvider
    from interlock.stores import open_sqlite_store


    class Wire(msgspec.Struct, forbid_unknown_fields=True):
        amount: Annotated[int, msgspec.Meta(gt=0)]


    async def wire(args, ctx):
        await trio.sleep(float(os.environ.get("BANK_TOOL_SECONDS", "0")))
        return {"wired": args.amount}


    def oracle(view):
        if view.last_result("wire") is None:
            return '{"tool": "wire", "args": {"amount": %d}}' % view.inputs["amount"]
        return '{"next": "COMPLETED"}'


    machine = Machine(
        "bank",
        initial="PAY",
        states={"PAY": Worker(next=["COMPLETED"], tools=["wire"])},
        tools=[Tool("wire", wire, Wire, "Wire money.", idempotent=True)],
    )
    app = App(
        [machine], provider=ScriptedProvider(oracle, model="bank-1"), prices={"bank-1": (2.0, 10.0)}
    )
    not_an_app = 42
    stored = App([machine], provider=app.provider, store="bank.db")


    async def start(db, amounts):
        """Start one run per amount, say so once all are durable, then wait for a SIGKILL."""
        store = await open_sqlite_store(db)
        async with open_supervisor([machine], store, provider=app.provider) as supervisor:
            for i, amount in enumerate(amounts):
                await supervisor.start_run("bank", {"amount": amount}, run_id=f"bank-{i}")
            print("started", flush=True)
            await trio.sleep_forever()


    if __name__ == "__main__":
        trio.run(start, sys.argv[1], [int(a) for a in sys.argv[2:]])
    '''
)


@pytest.fixture(scope="module")
def crashed_once(tmp_path_factory):
    """The directory :func:`crashed` copies for each test: the app and its crashed journal
    are made once per module (a real process started and killed each time, 0.5 s of each of
    the 16 tests that use it)."""
    tmp_path = tmp_path_factory.mktemp("crashed")
    home = tmp_path / "project"
    home.mkdir()
    (home / "bank.py").write_text(BANK)
    db = tmp_path / "journal.db"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with subprocess.Popen(
        [sys.executable, str(home / "bank.py"), str(db), "5", "6", "7", "-1", "-2"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, BANK_TOOL_SECONDS="60"),
    ) as starter:
        try:
            assert starter.stdout.readline() == "started\n"
            listed = {}
            while sorted(listed.values()) != ["escalated"] * 2 + ["running"] * 3:
                done = interlock("runs", "--db", str(db), "--json", cwd=elsewhere)
                listed = {r["run_id"]: r["outcome"] for r in json.loads(done.stdout)["runs"]}
        finally:
            starter.send_signal(signal.SIGKILL)
    return tmp_path


@pytest.fixture
def crashed(crashed_once, tmp_path):
    """A user's app in its own directory and a journal of its runs, killed mid-run: three
    runs in doubt in the tool, two escalated (a negative amount, rejected three times).
    The test's own copy (the journal with its WAL and lock files as the kill left them)."""
    for path in crashed_once.iterdir():
        if path.is_dir():
            shutil.copytree(path, tmp_path / path.name)
        else:
            shutil.copy2(path, tmp_path / path.name)
    return tmp_path / "project" / "bank.py", tmp_path / "journal.db", tmp_path / "elsewhere"


def outcomes(db, cwd):
    done = interlock("runs", "--db", str(db), "--all", "--json", cwd=cwd)
    assert done.returncode == 0, done.stderr
    return {r["run_id"]: (r["outcome"], r["state"]) for r in json.loads(done.stdout)["runs"]}


def test_without_the_app_resume_names_the_missing_machine_and_touches_nothing(crashed):
    """Regression: ``resume`` exited 0 leaving every run of a user's machine running and
    created a stray X-effects.db; ``escalations resume|abort`` said 'not registered'."""
    _bank, db, cwd = crashed
    hint = "pass the application that defines it: --app module:attribute or --app path/to/file.py:attribute"
    before = db.read_bytes()
    done = interlock("resume", "--db", str(db), cwd=cwd)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "interlock: error: the app interlock.demo:app (the default) has no machine 'bank' "
        f"(3 runs, e.g. 'bank-0'); {hint}\n"
    )
    for action in ("resume", "abort"):
        done = interlock("escalations", action, "bank-3", "--db", str(db), cwd=cwd)
        assert (done.returncode, done.stdout) == (1, ""), action
        assert done.stderr == (
            "interlock: error: the app interlock.demo:app (the default) has no machine "
            f"'bank' (run 'bank-3'); {hint}\n"
        )
    done = interlock("replay", "--all", "--db", str(db), cwd=cwd)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "interlock: error: the app interlock.demo:app (the default) has no machine 'bank' "
        f"(5 runs, e.g. 'bank-0'); {hint}\n"
    )
    assert db.read_bytes() == before
    assert not list(db.parent.rglob("*effects*"))
    assert list(cwd.iterdir()) == []


def test_crash_resume_escalations_replay_and_check_through_app(crashed):
    bank, db, cwd = crashed
    app = f"{bank}:app"
    resumed = interlock("resume", "--db", str(db), "--app", app, "--json", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert (summary["resumed"], summary["runs"]) == (3, 5)
    assert summary["workflows"]["bank"]["escalation_reasons"] == {"consecutive_failures": 2}
    assert outcomes(db, cwd) == {
        "bank-0": ("completed", "COMPLETED"),
        "bank-1": ("completed", "COMPLETED"),
        "bank-2": ("completed", "COMPLETED"),
        "bank-3": ("escalated", "ESCALATE"),
        "bank-4": ("escalated", "ESCALATE"),
    }
    again = interlock("resume", "--db", str(db), "--app", app, cwd=cwd)
    assert (again.returncode, again.stdout) == (
        0,
        f"nothing to resume in {db}: 5 runs, none unfinished\n",
    )

    payload = '{"tool": "wire", "args": {"amount": 3}}'
    fixed = interlock(
        "escalations", "resume", "bank-3", "--payload", payload, "--by", "ada", "--app", app,
        "--db", str(db), "--json", cwd=cwd,
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["outcome"] == "completed"
    aborted = interlock(
        "escalations", "--db", str(db), "--app", app, "abort", "bank-4", "--by", "ada", "--note", "typo",
        cwd=cwd,
    )  # fmt: skip
    assert (aborted.returncode, aborted.stderr) == (0, "")
    assert aborted.stdout == "run bank-4: failed in FAILED (aborted by ada: typo)\n"
    assert outcomes(db, cwd)["bank-3"] == ("completed", "COMPLETED")
    shown = json.loads(interlock("show", "bank-3", "--db", str(db), "--json", cwd=cwd).stdout)
    wires = [e["result"] for e in shown["events"] if e["kind"] == "tool_committed"]
    assert wires == [{"wired": 3}]

    replayed = interlock("replay", "--all", "--db", str(db), "--app", app, "--json", cwd=cwd)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert json.loads(replayed.stdout)["reproduced"] == 5
    strict = cwd.parent / "strict.py"  # a what-if: the same machine, amounts of at most 4
    strict.write_text(
        BANK.replace("msgspec.Meta(gt=0)", "msgspec.Meta(gt=0, le=4)").replace(
            'if __name__ == "__main__"', "if False"
        )
    )
    what_if = interlock(
        "replay", "--all", "--db", str(db), "--app", app, "--machine", f"{strict}:machine",
        "--json", cwd=cwd,
    )  # fmt: skip
    assert what_if.returncode == 1
    document = json.loads(what_if.stdout)
    assert document["what_if"] == ["bank"]
    assert sorted(d["run_id"] for d in document["diverged"]) == ["bank-0", "bank-1", "bank-2"]
    checked = interlock("check", "--db", str(db), cwd=cwd)
    assert (checked.returncode, checked.stderr) == (0, "")
    assert checked.stdout.startswith("ok: 5 runs, ")


def test_app_named_by_environment_and_pyproject(crashed):
    bank, db, cwd = crashed
    by_env = interlock(
        "replay", "bank-0", "--db", str(db), cwd=cwd, env={"INTERLOCK_APP": f"{bank}:app"}
    )
    assert (by_env.returncode, by_env.stderr) == (0, "")
    assert by_env.stdout == f"replayed 1 run from {db}: 1 reproduced, 0 diverged\n"
    (cwd / "bank.py").write_text(BANK)  # module:attribute imports from the current directory
    (cwd / "pyproject.toml").write_text('[tool.interlock]\napp = "bank:machine"\n')
    bare = interlock("resume", "--db", str(db), cwd=cwd)
    assert (bare.returncode, bare.stdout) == (1, "")
    assert bare.stderr == (
        "interlock: error: the app bank:machine "
        f"({cwd / 'pyproject.toml'} [tool.interlock] app) has no provider for machine 'bank', "
        "whose worker states need one; name an App with provider= (a bare Machine has none)\n"
    )
    (cwd / "pyproject.toml").write_text('[tool.interlock]\napp = "bank:app"\n')
    sub = cwd / "sub"  # the nearest pyproject.toml is a parent's; the import is from the cwd
    sub.mkdir()
    (sub / "bank.py").write_text(BANK)
    done = interlock("resume", "--db", str(db), cwd=sub)
    assert done.returncode == 0, done.stderr
    assert set(outcomes(db, cwd).values()) == {
        ("completed", "COMPLETED"),
        ("escalated", "ESCALATE"),
    }


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("bank", "--app 'bank' must look like module:attribute or path/to/file.py:attribute"),
        (
            "nosuchmodule:app",
            "--app 'nosuchmodule:app': cannot import 'nosuchmodule': No module named "
            "'nosuchmodule'; run from the directory that holds it, or name the file: "
            "path/to/nosuchmodule.py:app",
        ),
        ("{bank}:nope", "--app '{bank}:nope': '{bank}' has no attribute 'nope'; name its App, "
         "Machine or list of Machines"),
        ("{bank}:not_an_app", "--app '{bank}:not_an_app' is an int, not an interlock App, Machine "
         "or list of Machines; point it at one"),
        ("{missing}:app", "--app '{missing}:app': no file '{missing}'; give the path of a Python file"),
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["resume"], "--app"),
        (["escalations", "resume", "r-1"], "--app"),
        (["escalations", "abort", "r-1"], "--app"),
        (["replay", "--all"], "--app"),
        (["replay", "--all"], "--machine"),  # regression: exit 1, unlike --app
    ],
)
def test_a_bad_app_reference_is_one_line_and_exit_2(tmp_path, ref, message, command, flag):
    bank = tmp_path / "bank.py"
    bank.write_text(BANK)
    names = {"bank": bank, "missing": tmp_path / "missing.py"}
    done = interlock(*command, flag, ref.format(**names), "--db", "x.db", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    expected = message.format(**names).replace("--app", flag)
    assert done.stderr == f"interlock: error: {expected}\n"
    assert not (tmp_path / "x.db").exists()


def test_a_module_that_raises_is_named(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no config')\n")
    done = interlock("replay", "--all", "--app", f"{broken}:app", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"interlock: error: --app '{broken}:app': importing it raised RuntimeError: no config; "
        "fix the module\n"
    )


def test_the_apps_store_is_the_default_journal(tmp_path):
    (tmp_path / "bank.py").write_text(BANK)
    done = interlock("resume", "--app", "bank:stored", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"journal: sqlite://{tmp_path / 'bank.db'} (from the app bank:stored)\n"
        "interlock: error: database bank.db does not exist\n"
    )
    assert not (tmp_path / "bank.db").exists()
    given = interlock("resume", "--app", "bank:stored", "--db", "bank2.db", cwd=tmp_path)
    assert given.stderr == "interlock: error: database bank2.db does not exist\n"


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["resume"], ["--chaos-rate", "0.5"]),
        (["resume"], ["--seed", "0"]),
        (["resume"], ["--latency", "1,2"]),
        (["resume"], ["--effects", "e.db"]),
        (["escalations", "resume", "r-1"], ["--effects", "e.db"]),
    ],
)
@pytest.mark.parametrize("named", ["--app", "INTERLOCK_APP", "pyproject"])
def test_demo_options_are_refused_for_another_app(tmp_path, command, option, named):
    (tmp_path / "bank.py").write_text(BANK)
    app, env = [], {}
    if named == "--app":
        app, where = ["--app", "bank:app"], "--app"
    elif named == "INTERLOCK_APP":
        env, where = {"INTERLOCK_APP": "bank:app"}, "INTERLOCK_APP"
    else:
        (tmp_path / "pyproject.toml").write_text('[tool.interlock]\napp = "bank:app"\n')
        where = f"{tmp_path / 'pyproject.toml'} [tool.interlock] app"
    done = interlock(*command, *app, *option, "--db", "x.db", cwd=tmp_path, env=env)
    assert (done.returncode, done.stdout) == (2, "")
    flag = option[0]
    assert done.stderr == (
        f"interlock: error: {flag} tunes the built-in demo application, but {where} names "
        f"'bank:app'; drop {flag}\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["bank.py", *(["pyproject.toml"] if named == "pyproject" else [])]
    )


def test_demo_options_tune_the_demo_app(tmp_path):
    """Named explicitly, the demo takes its options (and still refuses a missing journal)."""
    done = interlock(
        "resume", "--app", "interlock.demo:app", "--seed", "1", "--db", "x.db", cwd=tmp_path
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "interlock: error: database x.db does not exist\n"


def _machine(name):
    return Machine(name, initial="W", states={"W": Worker(next=["COMPLETED"])})


def test_app_validates_what_it_is_given():
    provider = ScriptedProvider([])
    app = App(_machine("a"), provider={"a": provider}, prices={"m": (1.0, 2)}, store="x.db")
    assert (list(app.machines), app.store, app.prices) == (["a"], "x.db", {"m": (1.0, 2)})
    for args, kwargs, message in (
        ([[]], {}, "App needs at least one Machine; pass App([machine, ...])"),
        ([["a"]], {}, "App machines must be Machines, got a str; pass App([machine, ...])"),
        (
            [[_machine("a"), _machine("a")]],
            {},
            "App has two machines named 'a'; give each machine its own name",
        ),
        (
            [[_machine("a")]],
            {"provider": {"b": provider}},
            "App provider is given for machine 'b', which the app does not have; its machines: a",
        ),
        (
            [[_machine("a")]],
            {"provider": "gpt"},
            "App provider must have an async propose(view), got a str",
        ),
        (
            [[_machine("a")]],
            {"prices": {"m": (1.0, -1)}},
            "App prices['m'] must be (prompt, completion) USD per million tokens, both at "
            "least 0; got (1.0, -1)",
        ),
        (
            [[_machine("a")]],
            {"store": ""},
            "App store must be a SQLite path or postgresql:// DSN, got ''",
        ),
        (
            [[_machine("a")]],
            {"lifespan": "db.open"},
            "App lifespan must be a function of the journal's URL returning an async context "
            "manager, got a str",
        ),
    ):
        with pytest.raises(InterlockError) as caught:
            App(*args, **kwargs)
        assert str(caught.value) == message


def _scrape(url):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _held(command, cwd):
    """Run ``command`` (with ``--metrics-port 0 --hold``) until its runs finish; return
    the scrape, its stdout and its exit code after SIGTERM."""
    with subprocess.Popen(
        [sys.executable, "-m", "interlock", *command, "--metrics-port", "0", "--hold", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    ) as process:
        try:
            serving = process.stderr.readline()
            assert serving.startswith("interlock: serving metrics at "), serving
            url = serving.split(" at ")[1].strip()
            finished = process.stderr.readline()
            assert finished == f"interlock: runs finished; serving {url} until Ctrl-C or SIGTERM\n"
            samples = _scrape(url)
        finally:
            process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (0, ""), err
    return samples, json.loads(out)


def test_resume_serves_metrics_costed_with_the_apps_prices(crashed):
    bank, db, cwd = crashed
    samples, summary = _held(["resume", "--db", str(db), "--app", f"{bank}:app"], cwd)
    assert summary["resumed"] == 3
    tokens = {
        labels["kind"]: value
        for (name, pairs), value in samples.items()
        for labels in [dict(pairs)]
        if name == "interlock_tokens_total" and labels["model"] == "bank-1"
    }
    assert tokens["prompt"] > 0
    assert tokens["completion"] > 0
    cost = samples[("interlock_cost_usd_total", (("machine", "bank"), ("model", "bank-1")))]
    assert cost == pytest.approx((tokens["prompt"] * 2.0 + tokens["completion"] * 10.0) / 1e6)
    finished = samples[
        ("interlock_runs_finished_total", (("machine", "bank"), ("outcome", "completed")))
    ]
    assert finished == 3


def test_demo_serves_metrics_costed_with_the_demo_apps_prices(tmp_path):
    import interlock.demo

    prices = interlock.demo.app.prices
    assert prices["chaos:sim-1"] == (3.0, 15.0)
    samples, summary = _held(
        ["demo", "--runs", "30", "--latency", "0,1", "--db", str(tmp_path / "d.db")], tmp_path
    )
    assert summary["runs"] == 30
    costed = 0
    for (name, pairs), value in samples.items():
        labels = dict(pairs)
        if name != "interlock_tokens_total":
            continue
        price = prices[labels["model"]][0 if labels["kind"] == "prompt" else 1]
        costed += value * price / 1e6
    cost = sum(v for (name, _), v in samples.items() if name == "interlock_cost_usd_total")
    assert costed > 0
    assert cost == pytest.approx(costed)


def test_hold_without_metrics_port_is_refused_before_anything_runs(crashed):
    bank, db, cwd = crashed
    before = db.read_bytes()
    done = interlock("resume", "--db", str(db), "--app", f"{bank}:app", "--hold", cwd=cwd)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "interlock: error: --hold keeps the metrics server open after the runs; pass "
        "--metrics-port too\n"
    )
    assert db.read_bytes() == before


def test_replay_refuses_what_would_replay_nothing_it_was_asked(crashed):
    bank, db, cwd = crashed
    app = f"{bank}:app"
    other = cwd.parent / "other.py"
    other.write_text(
        "from interlock import Machine, Worker\n"
        'other = Machine("other", initial="W", states={"W": Worker(next=["COMPLETED"])})\n'
    )
    for args, code, message in (
        (
            ["--all", "--machine", f"{other}:other"],
            1,
            f"--machine '{other}:other' is machine 'other', which none of the runs replayed "
            "uses (their machines: bank); name one of theirs",
        ),
        (
            ["bank-0", "--workflow", "bank"],
            2,
            "--workflow chooses among --all; pass --all too, or drop it",
        ),
        (
            ["--all", "--workflow", "bnak"],
            1,
            f"no runs of workflow 'bnak' in {db}; `interlock runs --db {db}` lists the runs "
            "and their workflows",
        ),
        ([], 2, "name the runs to replay, or pass --all"),
    ):
        done = interlock("replay", *args, "--app", app, "--db", str(db), cwd=cwd)
        assert (done.returncode, done.stdout) == (code, ""), args
        assert done.stderr == f"interlock: error: {message}\n"


def test_an_unknown_run_says_where_it_looked_and_how_to_list_them(crashed):
    bank, db, cwd = crashed
    hint = f"run 'nope' not found in {db}; `interlock runs --db {db}` lists its runs"
    for command in (
        ["show", "nope"],
        ["escalations", "show", "nope"],
        ["escalations", "resume", "nope", "--app", f"{bank}:app"],
        ["escalations", "abort", "nope", "--app", f"{bank}:app"],
        ["replay", "nope", "--app", f"{bank}:app"],
    ):
        done = interlock(*command, "--db", str(db), cwd=cwd)
        assert (done.returncode, done.stdout) == (1, ""), command
        assert done.stderr == f"interlock: error: {hint}\n", command


def test_piped_and_narrow_no_table_cuts_a_run_id_or_a_heading(crashed):
    bank, db, cwd = crashed
    app = f"{bank}:app"
    narrow = {"COLUMNS": "40"}
    resumed = interlock("resume", "--app", app, "--db", str(db), cwd=cwd, env=narrow)
    assert resumed.returncode == 0, resumed.stderr
    header = next(line for line in resumed.stdout.splitlines() if "workflow" in line)
    for heading in ("runs", "completed", "escalated", "failed", "tokens", "verify p50 µs"):
        assert f" {heading} ┃" in header, heading
    strict = cwd.parent / "strict.py"
    strict.write_text(BANK.replace("msgspec.Meta(gt=0)", "msgspec.Meta(gt=0, le=4)"))
    what_if = interlock(
        "replay", "--all", "--app", app, "--machine", f"{strict}:machine", "--db", str(db),
        cwd=cwd, env=narrow,
    )  # fmt: skip
    assert what_if.returncode == 1
    assert what_if.stdout.startswith(
        f"replayed 5 runs from {db}: 2 reproduced, 3 diverged (what-if: bank)\n"
    )
    rows = [line.split("│")[1].strip() for line in what_if.stdout.splitlines() if "│" in line]
    assert [row for row in rows if row] == ["bank-0", "bank-1", "bank-2"]


def test_ctrl_c_during_resume_says_how_to_continue_with_the_app(crashed):
    """The line named `interlock resume --db X` alone, which would use the demo app."""
    bank, db, cwd = crashed
    before = outcomes(db, cwd)
    command = ["resume", "--app", f"{bank}:app", "--db", str(db), "--metrics-port", "0"]
    with subprocess.Popen(
        [sys.executable, "-m", "interlock", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=dict(os.environ, BANK_TOOL_SECONDS="60"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as process:
        try:  # wait until the three runs are resumed (and in the tool, for a minute)
            url = process.stderr.readline().split(" at ")[1].strip()
            key = ("interlock_runs_in_flight", (("machine", "bank"), ("state", "PAY")))
            while _scrape(url).get(key) != 3:
                pass
        finally:
            process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert err == (
        f"interlock: interrupted; `interlock resume --db {db} --app {bank}:app` continues "
        "the unfinished runs\n"
    )
    assert outcomes(db, cwd) == before  # the runs still in the tool are still running


def test_a_machine_changed_since_the_crash_is_refused_not_crashed_on(crashed):
    """Regression: a state renamed between the crash and `resume` stopped every run with
    "a bug in interlock: KeyError: 'PAY'" and a traceback; `escalations resume` journaled
    the resume first, leaving the run running in a state its machine does not have."""
    _bank, db, cwd = crashed
    renamed = cwd.parent / "renamed.py"
    renamed.write_text(BANK.replace('"PAY"', '"SEND"'))
    before = db.read_bytes()
    fix = "(its states: SEND); pass the app whose machine has it"
    for command, message in (
        (["resume"], f"run 'bank-0' is in state 'PAY', which machine 'bank' of the app {renamed}:app does not have {fix}"),
        (["escalations", "resume", "bank-3"], f"run 'bank-3' escalated from 'PAY', which machine 'bank' of the app {renamed}:app does not have {fix}"),
    ):  # fmt: skip
        # (with --to SEND, a state it has, it resumes there: tests/test_escalation_parity.py)
        done = interlock(*command, "--app", f"{renamed}:app", "--db", str(db), cwd=cwd)
        assert (done.returncode, done.stdout) == (1, ""), command
        assert done.stderr == f"interlock: error: {message}\n"
    assert db.read_bytes() == before
    aborted = interlock("escalations", "abort", "bank-3", "--app", f"{renamed}:app", "--db", str(db), cwd=cwd)  # fmt: skip
    assert (aborted.returncode, aborted.stderr) == (0, "")  # an abort runs nothing


def test_resume_leaves_external_runs_to_their_caller_and_says_so(crashed):
    """Regression: `resume` waited forever on a run started with external=True."""
    bank, db, cwd = crashed
    starter = cwd.parent / "external.py"
    starter.write_text(
        textwrap.dedent(
            f"""
            import sys, trio
            sys.path.insert(0, {str(bank.parent)!r})
            from bank import machine
            from interlock import open_supervisor
            from interlock.stores import open_sqlite_store

            async def main():
                async with await open_sqlite_store({str(db)!r}) as store:
                    async with open_supervisor([machine], store) as supervisor:
                        await supervisor.start_run("bank", {{"amount": 1}}, run_id="ext-0", external=True)

            trio.run(main)
            """
        )
    )
    subprocess.run([sys.executable, str(starter)], check=True, timeout=60)
    done = interlock("resume", "--app", f"{bank}:app", "--db", str(db), "--json", cwd=cwd)
    assert done.returncode == 1
    summary = json.loads(done.stdout)
    assert (summary["resumed"], summary["external"], summary["external_runs"]) == (3, 1, ["ext-0"])
    assert done.stderr == (
        "interlock: error: 1 external run left running (e.g. 'ext-0'): a run started with "
        "external=True is driven by its caller (Supervisor.submit), which resumes it\n"
    )
    assert outcomes(db, cwd)["ext-0"] == ("running", "PAY")
    assert {outcomes(db, cwd)[f"bank-{i}"] for i in range(3)} == {("completed", "COMPLETED")}


@pytest.mark.parametrize("ref", ["bank.py:app", "bank:app"])
def test_pyprojects_app_is_read_from_its_directory(crashed, ref):
    """Regression: a relative REF in pyproject.toml was read from the current directory,
    so the project's app was found only from the directory holding the pyproject."""
    bank, db, _cwd = crashed
    (bank.parent / "pyproject.toml").write_text(f'[tool.interlock]\napp = "{ref}"\n')
    deep = bank.parent / "src" / "deep"
    deep.mkdir(parents=True)
    done = interlock("replay", "bank-0", "--db", str(db), cwd=deep)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"replayed 1 run from {db}: 1 reproduced, 0 diverged\n"


LIFESPANS = textwrap.dedent(
    """
    import contextlib, sys
    sys.path.insert(0, {home!r})
    from bank import machine, app as bank

    @contextlib.asynccontextmanager
    async def down(db):
        raise ConnectionError("ticket system unreachable")
        yield

    @contextlib.asynccontextmanager
    async def closing(db):
        yield
        raise OSError()

    async def undecorated(db):
        yield

    def app(lifespan):
        return type(bank)([machine], provider=bank.provider, lifespan=lifespan)

    opening, closes, bare = app(down), app(closing), app(undecorated)
    """
)


@pytest.mark.parametrize(
    ("attribute", "message"),
    [
        ("opening", "its lifespan raised ConnectionError: ticket system unreachable while "
         "opening; fix it"),
        ("closes", "its lifespan raised OSError while closing; fix it"),
        ("bare", "its lifespan returned an async_generator, not an async context manager; "
         "decorate it with @contextlib.asynccontextmanager"),
    ],
)  # fmt: skip
def test_an_apps_lifespan_that_fails_is_one_line(crashed, attribute, message):
    bank, db, cwd = crashed
    apps = cwd.parent / "lifespans.py"
    apps.write_text(LIFESPANS.format(home=str(bank.parent)))
    ref = f"{apps}:{attribute}"
    for command in (["resume"], ["escalations", "abort", "bank-3"]):
        done = interlock(*command, "--app", ref, "--db", str(db), cwd=cwd)
        assert (done.returncode, done.stdout) == (1, ""), command
        assert done.stderr == f"interlock: error: the app {ref}: {message}\n", command
