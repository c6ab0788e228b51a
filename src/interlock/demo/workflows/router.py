"""The support router: INIT -> QUERY_DB -> FORMAT_RESPONSE -> DONE, or ESCALATE.

In INIT the model classifies the ticket and picks the next state from the
enumerated legal ones; an illegal pick is rejected. QUERY_DB is a step whose
write is keyed ``run_id:state`` in the ticket table, so a retried commit does
not write twice. FORMAT_RESPONSE is a model state that writes the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from ...core._machine import Call, Go, Machine, Step, Worker
from ...core._tools import Tool, ToolContext

if TYPE_CHECKING:
    import random

    from ...core._view import RunView
    from ._backend import Backend

NAME = "router"
CATEGORIES = ("billing", "technical", "account")


class Classified(msgspec.Struct, forbid_unknown_fields=True):
    category: Literal["billing", "technical", "account"]
    summary: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] = "ticket"


class Answer(msgspec.Struct, forbid_unknown_fields=True):
    response: Annotated[str, msgspec.Meta(min_length=1, max_length=2000)]


class RecordTicket(msgspec.Struct, forbid_unknown_fields=True):
    category: Literal["billing", "technical", "account"]
    summary: str


def query_db(view: RunView) -> Call | Go:
    ticket = view.last_result("record_ticket")
    if ticket is None:
        return Call(
            "record_ticket",
            {"category": view.data["category"], "summary": view.data.get("summary", "ticket")},
        )
    return Go("FORMAT_RESPONSE", {"ticket": ticket["ticket"]})


def build(backend: Backend) -> Machine:
    """The router machine, its DB write bound to ``backend``."""

    async def record_ticket(args: RecordTicket, ctx: ToolContext) -> dict[str, Any]:
        return await backend.record_ticket(
            f"{ctx.run_id}:{ctx.state}", ctx.key, ctx.run_id, args.category, args.summary
        )

    return Machine(
        NAME,
        initial="INIT",
        states={
            "INIT": Worker(
                next=["QUERY_DB", "ESCALATE"],
                instructions="Classify the ticket; move to QUERY_DB, or ESCALATE if it is abusive.",
                data=Classified,
            ),
            "QUERY_DB": Step(query_db, next=["FORMAT_RESPONSE"], tools=["record_ticket"]),
            "FORMAT_RESPONSE": Worker(
                next=["DONE", "ESCALATE"],
                instructions="Write the answer to the customer.",
                data=Answer,
            ),
        },
        tools=[
            Tool(
                "record_ticket", record_ticket, RecordTicket, "Record the ticket.", idempotent=True
            )
        ],
    )


def make_inputs(index: int, rng: random.Random) -> dict[str, Any]:
    category = rng.choice(CATEGORIES)
    return {"ticket": f"ticket {index}: a {category} question", "category": category}


def oracle(view: RunView) -> str:
    """A simulated model: classifies by the ticket's words, then answers."""
    if view.state == "INIT":
        return msgspec.json.encode(
            {
                "next": "QUERY_DB",
                "data": {
                    "category": view.inputs["category"],
                    "summary": view.inputs["ticket"][:60],
                },
            }
        ).decode()
    return msgspec.json.encode(
        {
            "next": "DONE",
            "data": {
                "response": f"Your {view.data['category']} ticket {view.data.get('ticket')} is open."
            },
        }
    ).decode()
