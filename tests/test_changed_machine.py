"""A journal recorded with one machine, resumed with a changed one: a state the machine no
longer has is refused with a typed error before anything is journaled."""

from __future__ import annotations

import msgspec
import pytest

from interlock import Machine, RetryPolicy, Tool, ToolContext, Worker, open_supervisor
from interlock.errors import UnknownState
from interlock.providers import ScriptedProvider
from interlock.stores import MemoryStore


class Args(msgspec.Struct):
    n: int


async def boom(args: Args, ctx: ToolContext) -> None:
    raise ConnectionResetError("down")


def machine(state: str) -> Machine:
    return Machine(
        "m",
        initial=state,
        states={state: Worker(next=["COMPLETED"], tools=["charge"])},
        tools=[Tool("charge", boom, Args, retry=RetryPolicy(attempts=1))],
    )


CALL = '{"tool": "charge", "args": {"n": 1}}'
DONE = '{"next": "COMPLETED"}'


async def escalated_in(store: MemoryStore, state: str) -> None:
    async with open_supervisor([machine(state)], store, provider=ScriptedProvider([CALL])) as sup:
        result = await (await sup.start_run("m", run_id="r-1")).wait()
    assert (result.outcome, result.reason) == ("escalated", "in_doubt_side_effect")


async def test_resuming_an_escalated_run_where_its_state_is_gone_is_refused() -> None:
    store = MemoryStore()
    await escalated_in(store, "TRIAGE")
    before = len(await store.load("r-1"))
    renamed = machine("SORT")
    async with open_supervisor([renamed], store, provider=ScriptedProvider([DONE])) as sup:
        with pytest.raises(
            UnknownState,
            match=r"escalated from state 'TRIAGE', which machine 'm' no longer has \(its states: SORT",
        ):
            await sup.resume_escalated("r-1", by="op")
        with pytest.raises(UnknownState, match=r"cannot resume in state 'NOWHERE'"):
            await sup.resume_escalated("r-1", by="op", to="NOWHERE")
        assert len(await store.load("r-1")) == before  # nothing journaled
        # a state the machine has is fine
        handle = await sup.resume_escalated("r-1", by="op", to="SORT")
        assert (await handle.wait()).outcome == "completed"


async def test_resuming_a_crashed_run_in_a_state_that_is_gone_is_refused_before_any_run() -> None:
    from interlock.core._events import RunStarted

    store = MemoryStore()
    await store.append(
        [RunStarted(run_id="r-2", seq=1, ts=1.0, machine="m", state="TRIAGE", inputs={})]
    )
    async with open_supervisor([machine("SORT")], store, provider=ScriptedProvider([DONE])) as sup:
        with pytest.raises(UnknownState, match=r"run 'r-2' is in state 'TRIAGE'"):
            await sup.resume_unfinished()
        assert len(sup) == 0


async def test_where_its_state_is_gone_a_run_may_resume_in_any_state_of_the_machine() -> None:
    """Regression (#32): the gateway listed the gone state as the only target (every
    resume there is refused), and a resume straight into a terminal state was taken,
    ending the run with no output; the targets are now the machine's states, and a
    terminal state is refused as anywhere else."""
    from interlock.core._escalation import resume_targets
    from interlock.errors import IllegalResumeTarget

    store = MemoryStore()
    await escalated_in(store, "TRIAGE")
    before = len(await store.load("r-1"))
    renamed = machine("SORT")
    assert resume_targets(renamed, "TRIAGE") == ["SORT"]
    async with open_supervisor([renamed], store, provider=ScriptedProvider([DONE])) as sup:
        with pytest.raises(
            IllegalResumeTarget,
            match=r"^cannot resume run 'r-1' in state 'COMPLETED'; it escalated from 'TRIAGE' "
            r"and may resume in: SORT$",
        ):
            await sup.resume_escalated("r-1", by="op", to="COMPLETED")
        assert len(await store.load("r-1")) == before  # nothing journaled
