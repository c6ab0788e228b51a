"""The extraction pipeline, seven states:

IDLE -> EXTRACTING -> VALIDATING -> (REPAIRING -> VALIDATING)* -> COMMITTING -> COMPLETED,
or ESCALATE once the repair budget is spent.

IDLE rejects an empty document (the run fails with the reason). EXTRACTING and
REPAIRING are model states with read-only tools. VALIDATING is a zero-model step
that checks the entities (required ids, category enum, confidence threshold) and
hands the structured error list to REPAIRING. COMMITTING writes the entities to a
SQLite table whose unique key includes the idempotency key.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from ...core._machine import Call, Go, Machine, Step, Worker
from ...core._tools import Tool, ToolContext

if TYPE_CHECKING:
    import random

    from ...core._view import RunView
    from ._backend import Backend

NAME = "extraction"
CATEGORIES = ("person", "organization", "location", "product")
MIN_CONFIDENCE = 0.7
MAX_REPAIRS = 2


class Entity(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    category: str
    confidence: float
    text: str = ""


class Extracted(msgspec.Struct, forbid_unknown_fields=True):
    entities: Annotated[list[Entity], msgspec.Meta(min_length=1, max_length=50)]


class LookupCategory(msgspec.Struct, forbid_unknown_fields=True):
    term: Annotated[str, msgspec.Meta(min_length=1, max_length=80)]


class WriteEntities(msgspec.Struct, forbid_unknown_fields=True):
    entities: list[Entity]


def idle(view: RunView) -> Go:
    document = str(view.inputs.get("document", ""))
    if not document.strip():
        return Go(
            "FAILED",
            {"reason": "document is empty; start the run with a non-empty 'document' input"},
        )
    return Go("EXTRACTING")


def validate(view: RunView) -> Go:
    entities = view.data.get("entities", [])
    errors = []
    for index, entity in enumerate(entities):
        if not str(entity.get("id", "")).strip():
            errors.append(
                {
                    "path": f"entities[{index}].id",
                    "message": "id is required",
                    "hint": "give every entity its id",
                }
            )
        if entity.get("category") not in CATEGORIES:
            errors.append(
                {
                    "path": f"entities[{index}].category",
                    "message": f"category {entity.get('category')!r} is not one of {', '.join(CATEGORIES)}",
                    "hint": f"use one of: {', '.join(CATEGORIES)}",
                }
            )
        if float(entity.get("confidence", 0)) < MIN_CONFIDENCE:
            errors.append(
                {
                    "path": f"entities[{index}].confidence",
                    "message": f"confidence {entity.get('confidence')} is below {MIN_CONFIDENCE}",
                    "hint": f"re-check the entity and report confidence >= {MIN_CONFIDENCE}, or drop it",
                }
            )
    repairs = int(view.data.get("repairs", 0))
    if not errors:
        return Go("COMMITTING", {"errors": []})
    if repairs >= MAX_REPAIRS:
        return Go(
            "ESCALATE", {"errors": errors, "reason": f"still invalid after {repairs} repairs"}
        )
    return Go("REPAIRING", {"errors": errors, "repairs": repairs + 1})


def commit(view: RunView) -> Call | Go:
    written = view.last_result("write_entities")
    if written is None:
        return Call("write_entities", {"entities": list(view.data["entities"])})
    return Go("COMPLETED", {"written": written["entities"]})


def build(backend: Backend) -> Machine:
    """The extraction machine, its write tool bound to ``backend``."""

    async def lookup_category(args: LookupCategory, ctx: ToolContext) -> dict[str, Any]:
        return {"term": args.term, "category": _category_of(args.term)}

    async def write_entities(args: WriteEntities, ctx: ToolContext) -> dict[str, Any]:
        return await backend.write_entities(ctx.key, ctx.run_id, msgspec.to_builtins(args.entities))

    return Machine(
        NAME,
        initial="IDLE",
        states={
            "IDLE": Step(idle, next=["EXTRACTING", "FAILED"]),
            "EXTRACTING": Worker(
                next=["VALIDATING"],
                tools=["lookup_category"],
                instructions="Extract every entity of the document with its id, category and confidence.",
                data=Extracted,
            ),
            "VALIDATING": Step(validate, next=["COMMITTING", "REPAIRING", "ESCALATE"]),
            "REPAIRING": Worker(
                next=["VALIDATING"],
                tools=["lookup_category"],
                instructions="Fix the entities so that every listed error is resolved.",
                data=Extracted,
            ),
            "COMMITTING": Step(commit, next=["COMPLETED"], tools=["write_entities"]),
        },
        tools=[
            Tool(
                "lookup_category",
                lookup_category,
                LookupCategory,
                "Look up a term's category.",
                read_only=True,
            ),
            Tool(
                "write_entities",
                write_entities,
                WriteEntities,
                "Store the entities.",
                idempotent=True,
            ),
        ],
    )


def _category_of(term: str) -> str:
    return CATEGORIES[zlib.crc32(term.encode()) % len(CATEGORIES)]


def make_inputs(index: int, rng: random.Random) -> dict[str, Any]:
    """A document naming 2-5 entities; one run in ten has an empty document."""
    if index % 10 == 9:
        return {"document": ""}
    terms = [f"term{index}-{j}" for j in range(rng.randint(2, 5))]
    return {
        "document": "Report mentioning " + ", ".join(terms) + ".",
        "terms": terms,
        "sloppy": rng.random() < 0.3,
    }


def oracle(view: RunView) -> str:
    """A simulated model: extracts every term; a sloppy run gets confidence wrong at first."""
    terms = view.inputs.get("terms", [])
    if (
        view.state == "EXTRACTING"
        and view.inputs.get("sloppy")
        and not view.results_of("lookup_category")
    ):
        return msgspec.json.encode({"tool": "lookup_category", "args": {"term": terms[0]}}).decode()
    first_pass = view.state == "EXTRACTING"
    entities = []
    for j, term in enumerate(terms):
        confidence = 0.5 if (first_pass and view.inputs.get("sloppy") and j == 0) else 0.9
        entities.append(
            {"id": f"e{j}", "category": _category_of(term), "confidence": confidence, "text": term}
        )
    return msgspec.json.encode({"next": "VALIDATING", "data": {"entities": entities}}).decode()
