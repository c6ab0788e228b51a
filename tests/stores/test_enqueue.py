"""Runs created in the journal with nobody driving them, and driven by the next resume (#18),
in every store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from interlock import (
    InvalidInputs,
    Machine,
    ProtocolError,
    RunNotFound,
    Tool,
    Worker,
    enqueue_run,
    open_supervisor,
    replay,
)
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore, Store, open_sqlite_store


class Order(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


async def lookup(args: Any, ctx: Any) -> dict[str, Any]:
    return {"order_id": ctx.view.inputs["order_id"], "total": 40}


def orders() -> Machine:
    return Machine(
        "orders",
        "WORK",
        {"WORK": Worker(next=["COMPLETED"], tools=["lookup"])},
        tools=[Tool("lookup", lookup, read_only=True)],
        inputs=Order,
    )


def model() -> ScriptedProvider:
    return ScriptedProvider(
        lambda view: (
            '{"tool": "lookup", "args": {}}'
            if view.steps == 0
            else '{"next": "COMPLETED", "data": {"total": 40}}'
        )
    )


async def test_an_enqueued_run_waits_in_the_journal_until_a_resume_drives_it(
    store: Store,
) -> None:
    first = await enqueue_run(store, orders(), {"order_id": "o-1"}, run_id="q-1")
    second = await enqueue_run(store, orders(), {"order_id": "o-2"})
    assert first == "q-1"
    assert second.startswith("run-")
    assert len(second) == 20
    assert {r.run_id for r in await store.unfinished()} == {"q-1", second}
    assert [type(e).__name__ for e in await store.load("q-1")] == ["RunStarted"]
    async with open_supervisor([orders()], store, provider=model()) as sup:
        handles = await sup.resume_unfinished()
        results = {h.run_id: await h.wait() for h in handles}
    assert {r.outcome for r in results.values()} == {"completed"}
    assert set(results) == {"q-1", second}
    assert replay(await store.load("q-1"), orders()).diverged == ()
    assert await store.unfinished() == []


async def test_a_run_enqueued_by_another_process_is_resumed_from_its_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.db"
    async with await open_sqlite_store(path) as store:
        await enqueue_run(store, orders(), {"order_id": "o-1"}, run_id="q-1")
    async with (
        await open_sqlite_store(path) as store,
        open_supervisor([orders()], store, provider=model()) as sup,
    ):
        (handle,) = await sup.resume_unfinished()
        assert (await handle.wait()).outcome == "completed"


async def test_bad_inputs_or_a_taken_run_id_write_nothing() -> None:
    store = MemoryStore()
    with pytest.raises(InvalidInputs, match="unknown field `order`"):
        await enqueue_run(store, orders(), {"order": 1}, run_id="q-1")
    with pytest.raises(RunNotFound):
        await store.get_run("q-1")
    await enqueue_run(store, orders(), {"order_id": "o-1"}, run_id="q-1")
    with pytest.raises(
        ProtocolError, match=r"^run 'q-1' already exists in this journal; run ids must be unique"
    ):
        await enqueue_run(store, orders(), {"order_id": "o-9"}, run_id="q-1")
    with pytest.raises(ProtocolError, match="run_id must be a non-empty string"):
        await enqueue_run(store, orders(), {"order_id": "o-1"}, run_id="")
    assert len(await store.load("q-1")) == 1


async def test_many_runs_are_enqueued_in_one_write_or_none_are(store: Store) -> None:
    from interlock import enqueue_runs

    ids = await enqueue_runs(store, orders(), [{"order_id": f"o-{i}"} for i in range(50)])
    assert len(set(ids)) == 50
    assert all(run_id.startswith("run-") for run_id in ids)
    assert {r.run_id for r in await store.unfinished()} == set(ids)
    named = await enqueue_runs(
        store, orders(), [{"order_id": "a"}, {"order_id": "b"}], run_ids=["n-1", "n-2"]
    )
    assert named == ["n-1", "n-2"]
    before = len(await store.list_runs())
    with pytest.raises(InvalidInputs, match=r"^inputs\[1\]: .*nothing was written$") as info:
        await enqueue_runs(store, orders(), [{"order_id": "ok"}, {"order_id": 5}])
    assert info.value.index == 1  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError, match="run 'n-2' already exists"):
        await enqueue_runs(
            store, orders(), [{"order_id": "x"}, {"order_id": "y"}], run_ids=["n-3", "n-2"]
        )
    with pytest.raises(ProtocolError, match="'n-4' is given twice"):
        await enqueue_runs(store, orders(), [{"order_id": "x"}] * 2, run_ids=["n-4", "n-4"])
    with pytest.raises(ProtocolError, match="run_ids holds 1 ids for 2 inputs"):
        await enqueue_runs(store, orders(), [{"order_id": "x"}] * 2, run_ids=["n-5"])
    assert len(await store.list_runs()) == before  # nothing of the refused batches
    async with open_supervisor([orders()], store, provider=model()) as sup:
        handles = await sup.resume_unfinished()
        assert {(await h.wait()).outcome for h in handles} == {"completed"}
    assert len(handles) == 52
