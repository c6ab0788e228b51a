"""The workload every benchmark shares: a five-field tool with one guard, its machine, proposals.

The tool call has the five kinds of field the issue names (a pattern string, a positive
float, an enum, a bounded string and a list of 1-10 strings); its guard refuses a refund
above the order total the run was started with. The same schema is written three ways:
as the msgspec Struct the runtime compiles, as a pydantic v2 model (the hand-written
baseline) and as a msgspec Struct for the whole proposal (the decoding floor).
"""

from __future__ import annotations

import random
from typing import Annotated, Any, Literal

import msgspec

from interlock import Budgets, Machine, Reject, RunView, Tool, ToolContext, Worker
from interlock.core._view import RunState
from interlock.events import RunStarted

ORDER_PATTERN = r"^ORD-[0-9]{6}$"
REASONS = ("damaged", "late", "wrong_item", "not_received", "other")
TOTAL = 100.0
TOOL = "refund"
WORK = "WORK"


class RefundArgs(msgspec.Struct, forbid_unknown_fields=True):
    """The tool's arguments, as the runtime compiles them."""

    order_id: Annotated[str, msgspec.Meta(pattern=ORDER_PATTERN)]
    amount: Annotated[float, msgspec.Meta(gt=0)]
    reason: Literal["damaged", "late", "wrong_item", "not_received", "other"]
    note: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    tags: Annotated[list[str], msgspec.Meta(min_length=1, max_length=10)]


class ProposalFloor(msgspec.Struct, forbid_unknown_fields=True):
    """The whole proposal in one Struct: what msgspec alone decodes (the floor)."""

    tool: Literal["refund"]
    args: RefundArgs


def within_total(args: RefundArgs, view: RunView) -> Reject | None:
    """The guard: a refund may not exceed the order total the run started with."""
    total = view.inputs.get("total", TOTAL)
    if args.amount > total:
        return Reject(
            f"args.amount: {args.amount} exceeds the order total {total}",
            f"propose amount <= {total}",
            "args.amount",
        )
    return None


def guard_plain(amount: float, total: float = TOTAL) -> str | None:
    """The same guard for the hand-written baselines: a message, or None."""
    if amount > total:
        return f"args.amount: {amount} exceeds the order total {total}"
    return None


async def noop(args: Any, ctx: ToolContext) -> dict[str, bool]:
    """The no-op tool: returns at once."""
    return {"ok": True}


def build_tool() -> Tool:
    return Tool(TOOL, noop, args=RefundArgs, guards=(within_total,), idempotent=True)


def build_machine(name: str = "bench") -> Machine:
    """One worker state that may call the tool or finish; budgets high enough never to trip."""
    return Machine(
        name=name,
        initial=WORK,
        states={
            WORK: Worker(next=["DONE"], tools=[TOOL], instructions="refund the order, then finish")
        },
        tools=[build_tool()],
        budgets=Budgets(tokens=10**12, steps=10**6, deadline=10.0**9),
    )


def run_state(machine: Machine, run_id: str = "bench-run") -> RunState:
    """A run in the worker state, folded from its run_started event."""
    run = RunState(run_id, machine)
    run.apply(
        RunStarted(
            run_id=run_id, seq=1, ts=1.0, machine=machine.name, state=WORK, inputs={"total": TOTAL}
        )
    )
    return run


_encoder = msgspec.json.Encoder()


def call_args(rng: random.Random, step: int) -> dict[str, Any]:
    """Valid, distinct args for one call (distinct so the repeat breaker never trips)."""
    return {
        "order_id": f"ORD-{rng.randrange(10**6):06d}",
        "amount": round(rng.uniform(0.01, TOTAL), 2),
        "reason": REASONS[step % len(REASONS)],
        "note": f"step {step}: customer reports the parcel arrived {rng.choice(('crushed', 'wet', 'late'))}",
        "tags": [f"t{k}" for k in range(1 + step % 10)],
    }


def call_raw(args: dict[str, Any]) -> bytes:
    return _encoder.encode({"tool": TOOL, "args": args})


MALFORMED_KINDS = ("trailing_comma", "markdown_fence", "truncated", "prose")


def malform(raw: bytes, kind: str) -> bytes:
    """Break a valid proposal the ways models do in production."""
    if kind == "trailing_comma":
        return raw[:-2] + b",}}"
    if kind == "markdown_fence":
        return b"```json\n" + raw + b"\n```"
    if kind == "truncated":
        return raw[: len(raw) * 2 // 3]
    return b"Sure! Here is the call: " + raw


def proposals(count: int, malformed_share: float = 0.05, seed: int = 4) -> list[bytes]:
    """``count`` raw proposals, ``malformed_share`` of them broken, in a shuffled order."""
    rng = random.Random(seed)
    items = [call_raw(call_args(rng, i)) for i in range(count)]
    broken = rng.sample(range(count), round(count * malformed_share))
    for n, index in enumerate(broken):
        items[index] = malform(items[index], MALFORMED_KINDS[n % len(MALFORMED_KINDS)])
    return items


def step_script(steps: int, seed: int = 7) -> list[str]:
    """The raw outputs of one run: ``steps - 1`` tool calls, then a move to DONE."""
    rng = random.Random(seed)
    outputs = [call_raw(call_args(rng, i)).decode() for i in range(steps - 1)]
    outputs.append('{"next": "DONE"}')
    return outputs


def latency_ms(run_index: int, step: int) -> float:
    """The simulated model latency of one call, 5-20 ms, the same for every runtime compared."""
    mixed = (run_index * 2654435761 + step * 40503 + 12345) % 1000
    return 5.0 + 15.0 * mixed / 999
