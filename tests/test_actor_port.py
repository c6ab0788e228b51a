"""The actor's port: an actor needs nothing of the runtime but the methods of ActorPort.

Here the port is a small class of its own over the decider, not a Supervisor, and it
has no attribute but those methods: an actor that reached for the supervisor's run
table or a handle's internals would fail with AttributeError.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
import trio

from interlock import Machine, RunView, Tool, ToolContext, Worker
from interlock.core import _decider
from interlock.core._breakers import CircuitBoard
from interlock.core._events import Event
from interlock.core._messages import Request
from interlock.core._view import PyRunState, fold
from interlock.messages import Propose, Start, Sync, ToolCall, Verdict
from interlock.providers import ScriptedProvider, render_prompt
from interlock.runtime._actor import ActorPort, Driver, run_actor


class Args(msgspec.Struct, forbid_unknown_fields=True):
    n: int


SEEN: list[tuple[Args, str]] = []


async def double(args: Args, ctx: ToolContext) -> dict[str, int]:
    SEEN.append((args, ctx.key))
    return {"doubled": args.n * 2}


MACHINE = Machine(
    "calc",
    initial="WORK",
    states={"WORK": Worker(next=["COMPLETED"], tools=["double"])},
    tools=[Tool("double", double, Args, idempotent=True)],
)


class OwnPort:
    """An ActorPort that is not a supervisor: the decider, a list for a journal."""

    __slots__ = ("_circuits", "_run", "calls", "events", "timeouts")

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._run, _ = _decider.start(
            MACHINE, Start(run_id="r-1", machine="calc"), 0.0, self.events
        )
        self._circuits = CircuitBoard()
        self.calls: list[str] = []
        self.timeouts: list[float] = []

    def first(self) -> Verdict:
        return _decider.decide(self._run, _sync(), 0.0, self._circuits, [])

    async def request(self, msg: Request) -> Verdict:
        await trio.lowlevel.checkpoint()
        return self.submit_nowait(msg)

    async def propose(self, msg: Propose, *, lagging: bool = False) -> Verdict:
        return await self.request(msg)  # a list for a journal: always durable

    def submit_nowait(self, msg: Request) -> Verdict:
        self.calls.append(type(msg).__name__)
        return _decider.decide(self._run, msg, float(len(self.events)), self._circuits, self.events)

    def view(self, run_id: str) -> RunView:
        return RunView(self._run)

    def arm_deadline(self, driver: Driver) -> None:
        self.calls.append("arm_deadline")

    def arm_timeout(self, driver: Driver, seconds: float) -> int:
        self.timeouts.append(seconds)
        return len(self.timeouts)

    def call_args(self, run_id: str, call: ToolCall) -> Any:
        return self._run.validated

    def traceparent(self, run_id: str) -> str:
        return ""

    def lease_guard(self, run_id: str) -> None:
        return None  # not leased


def _sync() -> Sync:
    return Sync(run_id="r-1")


def test_the_port_is_the_protocol_and_nothing_more() -> None:
    members = {
        name
        for name, _ in inspect.getmembers(ActorPort)
        if not name.startswith("_") and name not in dir(object)
    }
    assert members == {
        "request", "propose", "submit_nowait", "view", "arm_deadline", "arm_timeout", "call_args",
        "lease_guard", "traceparent",
    }  # fmt: skip
    own = {name for name in dir(OwnPort) if not name.startswith("_")}
    assert members <= own


async def test_an_actor_drives_a_run_through_a_port_of_its_own() -> None:
    SEEN.clear()
    port = OwnPort()
    provider = ScriptedProvider(['{"tool": "double", "args": {"n": 21}}', '{"next": "COMPLETED"}'])
    driver = Driver("r-1")
    await run_actor(port, driver, port.first(), provider)
    assert [type(e).__name__ for e in port.events] == [
        "RunStarted", "ModelCalled", "IntentRecorded", "ToolCommitted", "ModelCalled",
        "Transitioned", "Completed",
    ]  # fmt: skip
    # the tool ran once, with the args the gate validated and the journaled key
    assert [(Args(21), "r-1:WORK:3")] == SEEN
    assert port.calls == ["arm_deadline", "Propose", "Report", "Propose"]
    # a timeout per model call and one for the tool; the scope was never cut
    assert len(port.timeouts) == 3
    assert not driver.scope.cancel_called
    # what was journaled folds back to the run the actor drove
    folded = fold(MACHINE, port.events)
    assert (folded.state, folded.output, folded.seq) == ("COMPLETED", None, 7)


async def test_rendering_a_prompt_leaves_the_run_as_it_was() -> None:
    port = OwnPort()
    port.submit_nowait(Propose(run_id="r-1", seq=1, raw="{", model="m", prompt="p"))
    run = port._run
    before = {name: repr(getattr(run, name)) for name in PyRunState.__slots__}
    view = port.view("r-1")
    first = render_prompt(view)
    assert render_prompt(view) == first  # from the view's memo the second time
    assert {name: repr(getattr(run, name)) for name in PyRunState.__slots__} == before
