"""One way to find the journal for every command, and ``interlock run``: a new user's own
application in its own directory, outside the repository, driven as real processes (#32)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests._cli import interlock

OPS = textwrap.dedent(
    '''
    """A user's application, written from the README: one machine, its model a script."""
    from typing import Annotated

    import msgspec

    from interlock import App, Machine, Tool, Worker
    from interlock.providers import ScriptedProvider


    class Ship(msgspec.Struct, forbid_unknown_fields=True):
        order: str
        boxes: Annotated[int, msgspec.Meta(gt=0, le=10)]


    async def ship(args, ctx):
        return {"shipped": args.order, "boxes": args.boxes}


    def model(view):
        if view.last_result("ship") is None:
            args = {"order": view.inputs["order"], "boxes": view.inputs["boxes"]}
            return msgspec.json.encode({"tool": "ship", "args": args}).decode()
        return '{"next": "COMPLETED"}'


    shipping = Machine(
        "shipping",
        initial="SHIP",
        states={"SHIP": Worker(next=["COMPLETED"], tools=["ship"])},
        tools=[Tool("ship", ship, Ship, "Ship an order.", idempotent=True)],
    )
    provider = ScriptedProvider(model, model="script-1")
    app = App([shipping], provider=provider, store="ops.db")
    plain = App([shipping], provider=provider)
    '''
)
ORDER = '{"order": "o-1", "boxes": 2}'


@pytest.fixture
def project(tmp_path: Path) -> Path:
    home = tmp_path / "project"
    home.mkdir()
    (home / "ops.py").write_text(OPS)
    return home


def _said(home: Path, origin: str, db: str = "ops.db") -> str:
    return f"journal: sqlite://{home / db} (from {origin})\n"


def test_run_drives_the_apps_runs_to_the_end_and_the_read_commands_find_them(project):
    """Regression: ``runs``, ``show``, ``escalations`` and ``check`` with ``--app`` ignored
    the app's store ("database interlock.db does not exist")."""
    app = ("--app", "ops.py:app")
    done = interlock("run", *app, "shipping", "--inputs", ORDER, "--count", "3", cwd=project)
    assert (done.returncode, done.stderr) == (0, _said(project, "the app ops.py:app"))
    lines = done.stdout.splitlines()
    assert len(lines) == 3
    assert all(line.endswith(": completed in COMPLETED") for line in lines), lines
    ids = [line.split()[1].rstrip(":") for line in lines]

    listed = interlock("runs", *app, "--json", cwd=project)
    assert listed.stderr == _said(project, "the app ops.py:app")
    assert sorted(r["run_id"] for r in json.loads(listed.stdout)["runs"]) == sorted(ids)
    shown = interlock("show", ids[0], *app, "--json", cwd=project)
    assert json.loads(shown.stdout)["run"]["outcome"] == "completed"
    for command in (["escalations"], ["escalations", "list"], ["check"], ["replay", "--all"]):
        read = interlock(*command, *app, cwd=project)
        assert (read.returncode, read.stderr) == (0, _said(project, "the app ops.py:app")), command
    assert sorted(p.name for p in project.iterdir() if p.suffix == ".db") == ["ops.db"]


def test_run_exits_1_unless_every_run_completed_and_summarizes_many(project):
    escalated = interlock(
        "run", "--app", "ops.py:app", "shipping", "--inputs", '{"order": "o-2", "boxes": 20}',
        cwd=project,
    )  # fmt: skip
    assert escalated.returncode == 1, escalated.stderr
    assert escalated.stdout.endswith(": escalated in ESCALATE (consecutive_failures)\n")
    many = interlock(
        "run", "--app", "ops.py:app", "shipping", "--inputs", ORDER, "--count", "25", cwd=project
    )
    assert many.returncode == 0, many.stderr
    assert "interlock run: 25 runs of shipping in " in many.stdout
    document = interlock(
        "run", "--app", "ops.py:app", "shipping", "--inputs", ORDER, "--count", "2", "--json",
        cwd=project,
    )  # fmt: skip
    summary = json.loads(document.stdout)
    assert summary["outcomes"] == {"completed": 2}
    assert [r["outcome"] for r in summary["results"]] == ["completed"] * 2
    listed = json.loads(
        interlock("runs", "--app", "ops.py:app", "--all", "--json", cwd=project).stdout
    )
    assert listed["count"] == 28


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["nope"],
            "the app ops.py:app has no machine 'nope'; its machines: shipping",
        ),
        (
            ["shipping", "--inputs", '{"order": '],
            'argument --inputs: expected a JSON object like \'{"order_id": "o-1"}\', got '
            "'{\"order\": ' (Input data was truncated); see 'interlock run --help'",
        ),
        (
            ["shipping", "--inputs", "[1]"],
            'argument --inputs: expected a JSON object like \'{"order_id": "o-1"}\', got '
            "list; see 'interlock run --help'",
        ),
        (
            ["shipping", "--count", "0"],
            "argument --count: must be at least 1, got 0; see 'interlock run --help'",
        ),
    ],
)
def test_run_refuses_bad_input_in_one_line_and_creates_nothing(project, args, message):
    done = interlock("run", "--app", "ops.py:app", *args, cwd=project)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1] == f"interlock: error: {message}"
    assert sorted(p.name for p in project.iterdir()) == ["ops.py"]


@pytest.mark.parametrize(
    "command",
    [
        ["runs"],
        ["show", "run-1"],
        ["escalations"],
        ["escalations", "show", "run-1"],
        ["check"],
        ["replay", "--all"],
    ],
)
def test_a_read_command_on_a_missing_journal_says_where_it_came_from_and_creates_nothing(
    project, command
):
    done = interlock(*command, "--app", "ops.py:app", cwd=project)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == _said(project, "the app ops.py:app") + (
        f"interlock: error: journal {project / 'ops.db'} does not exist (from the app "
        "ops.py:app); nothing was created; pass --db PATH, or --app REF for the journal of "
        "that application's store\n"
    )
    given = interlock(*command, "--db", "typo.db", cwd=project)
    assert (given.returncode, given.stdout) == (1, "")
    assert given.stderr == (
        f"interlock: error: journal {project / 'typo.db'} does not exist (from --db); nothing "
        "was created; pass the path of an existing journal, or leave --db out for the app's "
        "store\n"
    )
    assert sorted(p.name for p in project.iterdir()) == ["ops.py"]


@pytest.mark.parametrize(
    ("table", "origin", "db"),
    [
        ('app = "ops.py:app"\n', "the app ops.py:app ({pyproject} [tool.interlock] app)", "ops.db"),
        (
            'app = "ops.py:plain"\nstore = "data/journal.db"\n',
            "{pyproject} [tool.interlock] store",
            "data/journal.db",
        ),
    ],
)
def test_enqueue_from_a_subdirectory_uses_the_projects_journal(project, table, origin, db):
    """Regression: ``enqueue`` from a subdirectory created a second journal there."""
    pyproject = project / "pyproject.toml"
    pyproject.write_text(f"[tool.interlock]\n{table}")
    (project / "data").mkdir()
    sub = project / "docs" / "notes"
    sub.mkdir(parents=True)
    origin = origin.format(pyproject=pyproject)
    made = interlock("enqueue", "shipping", "--inputs", ORDER, "--json", cwd=sub)
    assert made.returncode == 0, made.stderr
    assert made.stderr == _said(project, origin, db)
    assert (project / db).exists()
    assert list(sub.iterdir()) == []
    resumed = interlock("resume", "--json", cwd=sub)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed"] == 1
    listed = interlock("runs", "--json", cwd=project / "docs")
    assert listed.stderr == _said(project, origin, db)
    assert [r["outcome"] for r in json.loads(listed.stdout)["runs"]] == ["completed"]
    assert list(sub.iterdir()) == []
    here = interlock("runs", "--db", "here.db", cwd=sub)  # --db is read from where it is given
    assert here.returncode == 1
    assert list(sub.iterdir()) == []


def test_the_journal_line_never_shows_a_password(project):
    (project / "pg.py").write_text(
        "from ops import shipping, provider\n"
        "from interlock import App\n"
        "app = App([shipping], provider=provider, "
        "store='postgresql://bob:s3cret@127.0.0.1:1/ops?schema=x')\n"
    )
    done = interlock("runs", "--app", "pg.py:app", cwd=project)
    assert done.returncode == 1
    assert done.stderr.splitlines()[0] == (
        "journal: postgresql://bob@127.0.0.1:1/ops?schema=x (from the app pg.py:app)"
    )
    assert "s3cret" not in done.stderr


def test_the_default_journal_is_the_projects_from_any_of_its_directories(tmp_path):
    """The demo's journal (interlock.db) and the read commands' agree from anywhere in a
    project, as the app's and [tool.interlock] store do."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "mine"\n')
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ran = interlock("demo", "--runs", "3", "--latency", "0,0", "--json", cwd=tmp_path / "a")
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr == _said(tmp_path, "the app interlock.demo:app", "interlock.db")
    listed = interlock("runs", "--json", cwd=tmp_path / "b")
    assert listed.stderr == _said(tmp_path, "the default", "interlock.db")
    assert json.loads(listed.stdout)["count"] == 3
    assert list((tmp_path / "a").iterdir()) == list((tmp_path / "b").iterdir()) == []
