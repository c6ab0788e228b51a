"""One escalation rule for every door: the same journal, driven through the supervisor,
the command line and the gateway, gets the same decision for a repeated or conflicting
resume or abort, and the same list of resume targets (#32)."""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from interlock import open_supervisor
from interlock.errors import EscalationResolved, IllegalResumeTarget
from interlock.gateway import serve_gateway
from interlock.gateway._keys import KeyRing
from interlock.runtime._app import load_app
from interlock.stores import open_sqlite_store
from tests._cli import interlock

pytestmark = pytest.mark.slow

APP = """
import msgspec
from interlock import App, Machine, Tool, Worker
from interlock.providers import ScriptedProvider


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    cents: int


async def charge(args, ctx):
    return {"charged": args.cents}


def oracle(view):
    # rejected until an operator resumes the run, then it finishes
    if any(frame.kind == "resumed" for frame in view.history):
        return '{"next": "COMPLETED", "data": {"receipt": "r-9"}}'
    return '{"tool": "charge", "args": {"cents": "five"}}'


app = App(
    Machine(
        "shop",
        "PAY",
        {
            "PAY": Worker(next=["CHECK", "COMPLETED"], tools=["charge"]),
            "CHECK": Worker(next=["COMPLETED"]),
        },
        tools=[Tool("charge", charge, Charge)],
    ),
    provider=ScriptedProvider(oracle),
)
bare = app.machines["shop"]  # the machine alone: no provider
"""

#: The first operator request of each run, made before the journal is copied.
FIRST = {
    "r1": ("resume", {"by": "ops", "note": "checked"}),
    "r2": ("abort", {"by": "ops", "note": "duplicate"}),
    "r3": ("abort", {"by": "ops"}),
    "r4": ("resume", {"by": "ops"}),
    "r5": ("resume", {"by": "ops"}),
    "r6": ("resume", {"by": "ops", "to": "CHECK"}),
}

#: The second one, sent to each door on its own copy of that journal.
AGAIN = [
    ("r1", "resume", {"by": "ops", "note": "checked"}),  # a retry
    ("r1", "resume", {"by": "bob"}),  # the same resume, by someone else
    ("r2", "abort", {"by": "ops", "note": "duplicate"}),
    ("r2", "abort", {"by": "bob", "note": "stale"}),
    ("r3", "resume", {"by": "ops"}),  # resume after abort
    ("r4", "abort", {"by": "ops"}),  # abort after resume
    ("r5", "resume", {"by": "ops", "to": "CHECK"}),  # resumed in PAY, asked for CHECK
    ("r6", "resume", {"by": "ops"}),  # resumed in CHECK, asked for where it came from
    ("r6", "resume", {"by": "ops", "to": "CHECK"}),
]


@pytest.fixture
def app_ref(tmp_path: Path) -> str:
    path = tmp_path / "shopapp.py"
    path.write_text(textwrap.dedent(APP))
    return f"{path}:app"


async def escalate_all(db: Path, ref: str, runs: list[str]) -> None:
    app = load_app(ref)
    store = await open_sqlite_store(str(db))
    try:
        async with open_supervisor(
            list(app.machines.values()), store, provider=app.provider
        ) as sup:
            for run_id in runs:
                handle = await sup.start_run("shop", run_id=run_id)
                assert (await handle.wait()).outcome == "escalated"
    finally:
        await store.aclose()


async def by_supervisor(db: Path, ref: str, run_id: str, action: str, body: dict[str, Any]) -> Any:
    """What the supervisor does with one request: the run's result, or the refusal."""
    app = load_app(ref)
    store = await open_sqlite_store(str(db))
    try:
        async with open_supervisor(
            list(app.machines.values()), store, provider=app.provider
        ) as sup:
            try:
                if action == "abort":
                    return await sup.abort_escalated(
                        run_id, by=body["by"], note=body.get("note", "")
                    )
                handle = await sup.resume_escalated(
                    run_id, by=body["by"], note=body.get("note", ""), to=body.get("to")
                )
                return await handle.wait()
            except (EscalationResolved, IllegalResumeTarget) as exc:
                return exc
    finally:
        await store.aclose()


@asynccontextmanager
async def gateway(ref: str, db: Path) -> AsyncIterator[httpx.AsyncClient]:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_gateway, load_app(ref), db=str(db), port=0, keyring=KeyRing())
            )
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                yield client
            server.stop()


def cli(db: Path, ref: str, run_id: str, action: str, body: dict[str, Any]) -> Any:
    flags = ["--by", body["by"], "--note", body.get("note", "")]
    if "to" in body:
        flags += ["--to", body["to"]]
    return interlock("escalations", action, run_id, "--db", str(db), "--app", ref, *flags, "--json")


async def test_a_repeated_or_conflicting_resume_or_abort_is_decided_alike_everywhere(
    tmp_path: Path, app_ref: str
) -> None:
    """Regression (#32): a second resume or abort was refused by the command line ("not
    escalated", exit 1) but answered 200 by the gateway, which also took a resume after
    an abort for a retry of it and ignored the state a second resume asked for."""
    base = tmp_path / "base.db"
    await escalate_all(base, app_ref, list(FIRST))
    for run_id, (action, body) in FIRST.items():
        first = await by_supervisor(base, app_ref, run_id, action, body)
        assert not isinstance(first, Exception), first
    refused = []
    for number, (run_id, action, body) in enumerate(AGAIN):
        copies = {door: tmp_path / f"{door}-{number}.db" for door in ("sup", "cli", "gw")}
        for copy in copies.values():
            shutil.copy(base, copy)
        supervised = await by_supervisor(copies["sup"], app_ref, run_id, action, body)
        done = cli(copies["cli"], app_ref, run_id, action, body)
        async with gateway(app_ref, copies["gw"]) as client:
            answer = await client.post(f"/v1/escalations/{run_id}/{action}", json=body)
        case = (run_id, action, body)
        if isinstance(supervised, EscalationResolved):
            refused.append((run_id, action))
            message = str(supervised)
            assert done.returncode == 1, case
            assert done.stderr == f"interlock: error: {message}\n", case
            assert answer.status_code == 409, case
            assert answer.headers["content-type"] == "application/problem+json", case
            assert answer.json()["detail"] == message, case
        else:
            assert done.returncode == 0, (case, done.stderr)
            repeated = json.loads(done.stdout)
            assert answer.status_code == 200, (case, answer.text)
            run = answer.json()
            assert (repeated["state"], repeated["outcome"]) == (
                supervised.state,
                supervised.outcome,
            )
            assert (run["state"], run["outcome"]) == (supervised.state, supervised.outcome)
            assert repeated["repeated"].startswith(f"run {run_id!r} was already "), case
        # nothing was journaled by a second request, at any door
        for copy in copies.values():
            assert (await _seq(copy, run_id)) == (await _seq(base, run_id)), case
    assert refused == [
        ("r3", "resume"),
        ("r4", "abort"),
        ("r5", "resume"),
        ("r6", "resume"),
    ]


async def _seq(db: Path, run_id: str) -> int:
    store = await open_sqlite_store(str(db), readonly=True)
    try:
        return (await store.get_run(run_id)).seq
    finally:
        await store.aclose()


async def test_the_messages_name_what_was_done_by_whom_and_when(
    tmp_path: Path, app_ref: str
) -> None:
    """Regression (#32): a resume after an abort, and an abort after a resume, said only
    "not escalated"; the refusal now names what was done, by whom, when and at which seq."""
    db = tmp_path / "j.db"
    await escalate_all(db, app_ref, ["a", "b"])
    await by_supervisor(db, app_ref, "a", "abort", {"by": "ada", "note": "duplicate"})
    await by_supervisor(db, app_ref, "b", "resume", {"by": "ada"})
    late = cli(db, app_ref, "a", "resume", {"by": "bob"})
    assert late.returncode == 1
    assert late.stderr.startswith(
        "interlock: error: cannot resume run 'a': it was aborted by ada at "
    )
    assert late.stderr.endswith(
        " UTC with the note 'duplicate' (seq 11) and is failed in state 'FAILED' now; an aborted run stays "
        "ended: start a new run\n"
    )
    late = cli(db, app_ref, "b", "abort", {"by": "bob"})
    assert late.returncode == 1
    assert late.stderr.startswith(
        "interlock: error: cannot abort run 'b': it was resumed by ada at "
    )
    assert late.stderr.endswith(
        " UTC in state 'PAY' (seq 11) and is completed in state 'COMPLETED' now; only a run "
        "in the escalation queue can be aborted\n"
    )
    again = interlock("escalations", "abort", "a", "--db", str(db), "--app", app_ref)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("run 'a' was already aborted by ada at ")
    assert again.stdout.endswith(" (seq 11); it is failed in state 'FAILED' now\n")


async def test_the_resume_targets_are_listed_alike_and_are_the_ones_a_resume_takes(
    tmp_path: Path, app_ref: str
) -> None:
    """Regression (#32): the gateway listed COMPLETED (a terminal state, reached only
    through the gate) as a resume target that every resume then refused; the command
    line listed no targets at all."""
    db = tmp_path / "j.db"
    await escalate_all(db, app_ref, ["t"])
    listed = interlock("escalations", "list", "--db", str(db), "--app", app_ref, "--json")
    assert listed.returncode == 0, listed.stderr
    (item,) = json.loads(listed.stdout)["escalations"]
    assert (item["from_state"], item["targets"]) == ("PAY", ["PAY", "CHECK"])
    async with gateway(app_ref, db) as client:
        (one,) = (await client.get("/v1/escalations")).json()["escalations"]
        single = (await client.get("/v1/escalations/t")).json()
        assert (one["from_state"], one["targets"]) == ("PAY", ["PAY", "CHECK"])
        assert single["targets"] == one["targets"]
        refused = await client.post(
            "/v1/escalations/t/resume", json={"by": "ops", "to": "COMPLETED"}
        )
    assert refused.status_code == 422
    done = cli(db, app_ref, "t", "resume", {"by": "ops", "to": "COMPLETED"})
    assert done.returncode == 1
    message = (
        "cannot resume run 't' in state 'COMPLETED'; it escalated from 'PAY' and may resume "
        "in: PAY, CHECK"
    )
    assert done.stderr == f"interlock: error: {message}\n"
    assert refused.json()["detail"] == message
    table = interlock("escalations", "list", "--db", str(db), "--app", app_ref)
    assert "PAY, CHECK" in table.stdout


CHANGED = """
import msgspec
from interlock import App, Machine, RetryPolicy, Tool, Worker
from interlock.providers import ScriptedProvider


class Args(msgspec.Struct):
    n: int


async def boom(args, ctx):
    raise ConnectionResetError("down")


def machine(state):
    return Machine(
        "m",
        initial=state,
        states={state: Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", boom, Args, retry=RetryPolicy(attempts=1))],
    )


before = App(machine("TRIAGE"), provider=ScriptedProvider(['{"tool": "charge", "args": {"n": 1}}']))
after = App(machine("SORT"), provider=ScriptedProvider(['{"next": "COMPLETED"}']))
"""


async def test_where_its_state_is_gone_the_cli_resumes_in_a_target_the_gateway_lists(
    tmp_path: Path,
) -> None:
    """Regression (#32): with the state a run escalated from gone from the machine, the
    gateway listed that state as the only target, and the command line refused every
    resume (even ``--to`` a state the machine has, which the supervisor takes)."""
    (tmp_path / "changed.py").write_text(textwrap.dedent(CHANGED))
    db = tmp_path / "j.db"
    app = load_app(f"{tmp_path / 'changed.py'}:before")
    store = await open_sqlite_store(str(db))
    try:
        async with open_supervisor(
            list(app.machines.values()), store, provider=app.provider
        ) as sup:
            assert (await (await sup.start_run("m", run_id="r-1")).wait()).outcome == "escalated"
    finally:
        await store.aclose()
    ref = f"{tmp_path / 'changed.py'}:after"
    listed = interlock("escalations", "list", "--db", str(db), "--app", ref, "--json")
    (item,) = json.loads(listed.stdout)["escalations"]
    assert (item["from_state"], item["targets"]) == ("TRIAGE", ["SORT"])
    gw = tmp_path / "gw.db"
    shutil.copy(db, gw)
    async with gateway(ref, gw) as client:
        (one,) = (await client.get("/v1/escalations")).json()["escalations"]
        assert one["targets"] == ["SORT"]
        resumed = await client.post("/v1/escalations/r-1/resume", json={"by": "ops", "to": "SORT"})
        assert resumed.status_code == 200, resumed.text
    done = cli(db, ref, "r-1", "resume", {"by": "ops", "to": "SORT"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["outcome"] == "completed"


async def test_an_external_run_is_resumed_alike_by_the_cli_and_the_gateway(
    tmp_path: Path, app_ref: str
) -> None:
    """Regression (#32): ``escalations resume`` of a run started with external=True waited
    forever for the run to end (no actor drives it: its caller does), where the gateway
    answers with the run resumed."""
    from interlock.messages import Propose

    db = tmp_path / "j.db"
    app = load_app(app_ref)
    store = await open_sqlite_store(str(db))
    try:
        async with open_supervisor(list(app.machines.values()), store) as sup:
            await sup.start_run("shop", run_id="x", external=True)
            for _ in range(3):
                bad = '{"tool": "charge", "args": {"cents": "five"}}'
                verdict = await sup.submit(Propose(run_id="x", seq=sup.view("x").seq, raw=bad))
            assert verdict.outcome == "escalated"
    finally:
        await store.aclose()
    gw = tmp_path / "gw.db"
    shutil.copy(db, gw)
    async with gateway(app_ref, gw) as client:
        answers = [
            await client.post("/v1/escalations/x/resume", json={"by": "ops"}) for _ in range(2)
        ]
    assert [(a.status_code, a.json()["outcome"], a.json()["state"]) for a in answers] == [
        (200, "running", "PAY")
    ] * 2
    first = cli(db, app_ref, "x", "resume", {"by": "ops"})  # it waited (until its timeout)
    assert first.returncode == 0, first.stderr
    assert (json.loads(first.stdout)["outcome"], json.loads(first.stdout)["state"]) == (
        "running",
        "PAY",
    )
    again = cli(db, app_ref, "x", "resume", {"by": "ops"})
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["repeated"].startswith("run 'x' was already resumed by ops")


async def test_an_abort_needs_no_provider_at_either_door(tmp_path: Path, app_ref: str) -> None:
    """Regression (#32): ``escalations abort`` with an application that has no provider
    (a bare Machine) was refused ("has no provider"), where the gateway aborts: an abort
    runs nothing."""
    db = tmp_path / "j.db"
    await escalate_all(db, app_ref, ["b"])
    gw = tmp_path / "gw.db"
    shutil.copy(db, gw)
    bare = app_ref.replace(":app", ":bare")
    async with gateway(bare, gw) as client:
        answer = await client.post("/v1/escalations/b/abort", json={"by": "ops"})
    assert (answer.status_code, answer.json()["outcome"]) == (200, "failed")
    done = cli(db, bare, "b", "abort", {"by": "ops"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["outcome"] == "failed"
