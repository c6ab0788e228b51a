"""The operator console tests' application: a refund machine whose runs are external (the
tests drive them through the gateway's API, so no model is needed), and a copy of it with
a tighter guard, for the what-if replay.

    interlock serve --app tests/console_app.py:app --db console.db
"""

from __future__ import annotations

from typing import Any

import msgspec

from interlock import App, BreakerPolicy, Machine, Reject, Tool, Worker


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    cents: int


async def executed_by_the_caller(args: Any, ctx: Any) -> Any:  # external runs: never here
    raise AssertionError("an external run's tool is executed by its caller")


def _at_most(limit: int) -> Any:
    def guard(args: Refund, view: Any) -> Reject | None:
        if args.cents > limit:
            return Reject(
                f"cents {args.cents} is over the refund limit of {limit}",
                hint=f"refund at most {limit} cents",
                path="args.cents",
            )
        return None

    return guard


def refund_machine(limit: int = 10_000) -> Machine:
    return Machine(
        "refund",
        "REFUND",
        {
            "REFUND": Worker(next=["NOTIFY"], tools=["refund"], instructions="refund the order"),
            "NOTIFY": Worker(next=["COMPLETED"], instructions="tell the customer, then finish"),
        },
        tools=[Tool("refund", executed_by_the_caller, Refund, guards=[_at_most(limit)])],
        breakers=BreakerPolicy(consecutive_failures=3),
    )


app = App([refund_machine()])
#: The same machine with a refund limit of 100 cents: a what-if that recorded runs break.
strict = App([refund_machine(100)])
