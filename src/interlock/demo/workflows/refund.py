"""The refund agent: an Observe-Propose-Verify-Commit tool loop.

The model looks up the order, refunds, emails the customer and answers. The
``refund`` guard refuses any amount above the order total minus what this run has
already refunded, computed from the run's own history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from ...core._machine import Machine, Worker
from ...core._tools import Applied, NotApplied, Reject, Tool, ToolContext

if TYPE_CHECKING:
    import random

    from ...core._view import RunView
    from ._backend import Backend

NAME = "refund"


class LookupOrder(msgspec.Struct, forbid_unknown_fields=True):
    order_id: Annotated[str, msgspec.Meta(pattern=r"^ord-[0-9]{3,10}$")]


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    order_id: Annotated[str, msgspec.Meta(pattern=r"^ord-[0-9]{3,10}$")]
    amount: Annotated[float, msgspec.Meta(gt=0)]
    currency: Literal["USD", "EUR"]
    reason: Annotated[str, msgspec.Meta(min_length=3, max_length=200)]


class SendEmail(msgspec.Struct, forbid_unknown_fields=True):
    to: Annotated[str, msgspec.Meta(pattern=r"^[^@\s]+@[^@\s]+$")]
    subject: Annotated[str, msgspec.Meta(min_length=1, max_length=120)]
    lines: Annotated[list[str], msgspec.Meta(min_length=1, max_length=10)]


def refund_within_total(args: Refund, view: RunView) -> Reject | None:
    """A refund may not exceed the order total minus what was already refunded."""
    order = view.last_result("lookup_order")
    if order is None or order.get("order_id") != args.order_id:
        return Reject(
            f"args.order_id: order {args.order_id!r} has not been looked up in this run",
            f"call lookup_order with order_id {args.order_id!r} first",
            "args.order_id",
        )
    refunded = sum(
        r.args["amount"]
        for r in view.results_of("refund")
        if r.args.get("order_id") == args.order_id
    )
    remaining = round(order["total"] - refunded, 2)
    if args.amount > remaining:
        if refunded:
            message = (
                f"args.amount: {args.amount} exceeds the order total {order['total']} minus "
                f"{refunded} already refunded"
            )
        else:
            message = f"args.amount: {args.amount} exceeds the order total {order['total']}"
        return Reject(message, f"propose amount <= {remaining}", "args.amount")
    return None


def build(backend: Backend) -> Machine:
    """The refund machine, its tools bound to ``backend``."""

    async def lookup_order(args: LookupOrder, ctx: ToolContext) -> dict[str, Any]:
        return await backend.get_order(args.order_id)

    async def refund(args: Refund, ctx: ToolContext) -> dict[str, Any]:
        return await backend.refund(ctx.key, ctx.run_id, args.order_id, args.amount)

    async def send_email(args: SendEmail, ctx: ToolContext) -> dict[str, Any]:
        return await backend.send_email(ctx.key, ctx.run_id, args.to, args.subject)

    async def email_sent(key: str, args: SendEmail, ctx: ToolContext) -> Applied | NotApplied:
        # The email table is keyed by the idempotency key: ask it whether this one went out.
        sent = await backend.applied("send_email", key)
        return NotApplied() if sent is None else Applied(sent)

    return Machine(
        NAME,
        initial="WORK",
        states={
            "WORK": Worker(
                next=["COMPLETED", "ESCALATE"],
                tools=["lookup_order", "refund", "send_email"],
                instructions=(
                    "Handle the customer's refund request: look up the order, refund at most "
                    "what is left of its total, email the customer, then answer."
                ),
            )
        },
        tools=[
            Tool(
                "lookup_order",
                lookup_order,
                LookupOrder,
                "Fetch an order and its total.",
                read_only=True,
            ),
            Tool(
                "refund",
                refund,
                Refund,
                "Refund part or all of an order. Idempotent on the call's key.",
                guards=[refund_within_total],
                idempotent=True,
            ),
            Tool(
                "send_email",
                send_email,
                SendEmail,
                "Email the customer. Sends every time it runs.",
                reconcile=email_sent,
            ),
        ],
    )


def make_inputs(index: int, rng: random.Random) -> dict[str, Any]:
    """Inputs of demo run ``index``: about a third ask for more than the order total."""
    order_id = f"ord-{100000 + index}"
    return {
        "order_id": order_id,
        "customer": f"customer{index}@example.com",
        "requested": float(rng.choice([25, 50, 75, 150, 300])),
    }


def oracle(view: RunView) -> str:
    """A well-behaved simulated model: what a good model proposes next."""
    inputs = view.inputs
    order_id = inputs["order_id"]
    order = view.last_result("lookup_order")
    if order is None:
        return msgspec.json.encode(
            {"tool": "lookup_order", "args": {"order_id": order_id}}
        ).decode()
    refunds = view.results_of("refund")
    if not refunds:
        amount = inputs["requested"]
        for frame in view.history:
            for violation in frame.violations:
                if violation.path == "args.amount" and "<=" in violation.hint:
                    amount = float(violation.hint.rsplit("<=", 1)[1])
        return msgspec.json.encode(
            {
                "tool": "refund",
                "args": {
                    "order_id": order_id,
                    "amount": amount,
                    "currency": "USD",
                    "reason": "customer request",
                },
            }
        ).decode()
    if not view.results_of("send_email"):
        amount = refunds[-1].args["amount"]
        return msgspec.json.encode(
            {
                "tool": "send_email",
                "args": {
                    "to": inputs["customer"],
                    "subject": f"Your refund for {order_id}",
                    "lines": [f"We refunded {amount:.2f} USD.", "Thank you for your patience."],
                },
            }
        ).decode()
    total = sum(r.args["amount"] for r in refunds)
    return msgspec.json.encode(
        {"next": "COMPLETED", "data": {"answer": f"refunded {total:.2f} USD on {order_id}"}}
    ).decode()
