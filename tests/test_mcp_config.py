"""Machines for the MCP proxy declared in TOML, with CEL guards (#36)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from interlock import open_supervisor
from interlock.errors import ConfigurationError
from interlock.mcp._config import MachineSpec, build_machine, load_machine_file
from interlock.messages import Propose, Report

pytest.importorskip("cel_expr_python")


def _entity_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "The name of the entity"},
            "entityType": {"type": "string", "description": "The type of the entity"},
            "observations": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "entityType", "observations"],
    }


DRAFT7 = "http://json-schema.org/draft-07/schema#"

#: The npm memory server's tools (@modelcontextprotocol/server-memory 2026.8.31), as its
#: tools/list gives them (outputSchema and execution left out).
MEMORY_TOOLS: dict[str, dict[str, Any]] = {
    "create_entities": {
        "name": "create_entities",
        "description": "Create multiple new entities in the knowledge graph",
        "inputSchema": {
            "$schema": DRAFT7,
            "type": "object",
            "properties": {"entities": {"type": "array", "items": _entity_schema()}},
            "required": ["entities"],
        },
        "annotations": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False},
    },
    "create_relations": {
        "name": "create_relations",
        "description": "Create multiple new relations between entities in the knowledge graph",
        "inputSchema": {
            "$schema": DRAFT7,
            "type": "object",
            "properties": {
                "relations": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "from": {"type": "string"},
                            "to": {"type": "string"},
                            "relationType": {"type": "string"},
                        },
                        "required": ["from", "to", "relationType"],
                    },
                }
            },
            "required": ["relations"],
        },
        "annotations": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False},
    },
    "delete_entities": {
        "name": "delete_entities",
        "description": "Delete multiple entities and their associated relations",
        "inputSchema": {
            "$schema": DRAFT7,
            "type": "object",
            "properties": {"entityNames": {"type": "array", "items": {"type": "string"}}},
            "required": ["entityNames"],
        },
        "annotations": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": True},
    },
    "read_graph": {
        "name": "read_graph",
        "description": "Read the entire knowledge graph",
        "inputSchema": {"$schema": DRAFT7, "type": "object", "properties": {}},
        "annotations": {"readOnlyHint": True, "destructiveHint": False, "idempotentHint": True},
    },
}

MEMORY = """\
[machine]
name = "memory"
initial = "PLAN"
transition_tool = "transition"

[states.PLAN]
tools = ["read_graph", "create_entities"]
next = ["RELATE", "FAILED"]
instructions = "Create the people you were told about."

[states.RELATE]
tools = ["read_graph", "create_relations"]
next = ["CLEANUP", "COMPLETED"]

[states.CLEANUP]
tools = ["read_graph", "delete_entities"]
next = ["COMPLETED"]

[tools.read_graph]
kind = "read-only"

[tools.create_entities]
moves_to = "RELATE"
approval = true

[[tools.create_entities.guards]]
when = "size(args.entities) <= 3"
message = "at most 3 entities a call"
hint = "split the entities into calls of 3 or fewer"

[tools.create_relations]
guards = [
  "args.relations.all(r, history.exists(h, h.tool == 'create_entities' && h.args.entities.exists(e, e.name == r.from)))",
]

[tools.delete_entities]
kind = "neither"
guards = ["calls.create_entities >= 1"]

[tools.delete_entities.reconcile]
tool = "read_graph"
applied = "!result.entities.exists(e, e.name in args.entityNames)"

[budgets]
steps = 40

[breakers]
consecutive_failures = 4
circuit_cooldown = 10.5
"""


def write(tmp_path: Path, text: str, name: str = "memory.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def memory(tmp_path: Path) -> MachineSpec:
    return load_machine_file(write(tmp_path, MEMORY))


def test_a_full_file_builds_the_machine_it_declares(tmp_path: Path) -> None:
    spec = memory(tmp_path)
    machine = build_machine(spec, MEMORY_TOOLS)
    assert (machine.name, machine.initial) == ("memory", "PLAN")
    assert list(machine.states) == ["PLAN", "RELATE", "CLEANUP"]
    plan = machine.states["PLAN"]
    assert (tuple(plan.tools), tuple(plan.next)) == (
        ("read_graph", "create_entities"),
        ("RELATE", "FAILED"),
    )
    assert plan.instructions == "Create the people you were told about."
    # a state allowing a tool that moves the run verifies the call and its move together
    assert [s.call_and_move for s in machine.states.values()] == [True, False, False]  # type: ignore[union-attr]
    kinds = {t.name: (t.read_only, t.idempotent, len(t.guards)) for t in machine.tools}
    assert kinds == {
        "read_graph": (True, False, 0),
        "create_entities": (False, False, 1),
        "create_relations": (False, False, 1),
        # the upstream's idempotentHint is a hint: the file says "neither"
        "delete_entities": (False, False, 1),
    }
    described = machine.tool_by_name["read_graph"].description
    assert described == "Read the entire knowledge graph"
    assert (machine.budgets.steps, machine.budgets.tokens) == (40, 200_000)
    assert (machine.breakers.consecutive_failures, machine.breakers.circuit_cooldown) == (4, 10.5)
    assert (spec.moves_to("create_entities"), spec.moves_to("read_graph")) == ("RELATE", None)
    assert (spec.approval("create_entities"), spec.approval("delete_entities")) == (True, False)
    assert spec.reconcile("create_entities") is None
    assert spec.transition_tool == "transition"
    assert spec.transition_schema("RELATE")["properties"]["to"]["enum"] == ["CLEANUP", "COMPLETED"]


def test_reconcile_evaluates_its_expression_over_the_result(tmp_path: Path) -> None:
    reconcile = memory(tmp_path).reconcile("delete_entities")
    assert reconcile is not None
    assert reconcile.tool == "read_graph"
    graph = {"entities": [{"name": "bob"}], "relations": []}
    assert reconcile.applied(graph, {"entityNames": ["alice"]}, "r:CLEANUP:9") is True
    assert reconcile.applied(graph, {"entityNames": ["bob"]}, "r:CLEANUP:9") is False
    # a result it cannot read is "unknown", never an exception
    assert reconcile.evaluate({}, {"entityNames": ["bob"]}, "k") == (
        None,
        'Key not found in map : "entities"',
    )


def alice(*names: str) -> dict[str, Any]:
    return {"entities": [{"name": n, "entityType": "person", "observations": []} for n in names]}


def call(tool: str, args: dict[str, Any], **extra: Any) -> str:
    return json.dumps({"tool": tool, "args": args, **extra})


async def test_guards_pass_and_reject_in_an_external_run(tmp_path: Path) -> None:
    machine = build_machine(memory(tmp_path), MEMORY_TOOLS)
    async with open_supervisor([machine]) as sup:
        await sup.external.start("memory", run_id="m-1")
        seq = sup.view("m-1").seq
        four = await sup.external.submit(
            Propose(run_id="m-1", seq=seq, raw=call("create_entities", alice("a", "b", "c", "d")))
        )
        assert not four.accepted
        ((violation,),) = (four.violations,)
        assert (violation.code, violation.message, violation.hint) == (
            "guard",
            "create_entities: at most 3 entities a call",
            "split the entities into calls of 3 or fewer",
        )
        two = await sup.external.submit(
            Propose(
                run_id="m-1",
                seq=four.seq,
                raw=call("create_entities", alice("alice", "bob"), next="RELATE"),
            )
        )
        assert two.accepted
        assert two.execute is not None
        done = await sup.external.submit(
            Report(run_id="m-1", seq=two.seq, key=two.execute.key, ok=True, result=alice())
        )
        assert sup.view("m-1").state == "RELATE"  # moved when the call committed
        stranger = {"relations": [{"from": "carol", "to": "bob", "relationType": "knows"}]}
        bad = await sup.external.submit(
            Propose(run_id="m-1", seq=done.seq, raw=call("create_relations", stranger))
        )
        assert [(v.code, v.message) for v in bad.violations] == [
            (
                "guard",
                "create_relations: guard `args.relations.all(r, history.exists(h, h.tool == "
                "'create_entities' && h.args.entities.exists(e, e.name == r.from)))` is false",
            )
        ]
        assert bad.violations[0].hint.startswith("change the arguments so that `args.relations")
        known = {"relations": [{"from": "alice", "to": "bob", "relationType": "knows"}]}
        good = await sup.external.submit(
            Propose(run_id="m-1", seq=bad.seq, raw=call("create_relations", known))
        )
        assert good.accepted
        assert good.execute is not None
        related = await sup.external.submit(
            Report(run_id="m-1", seq=good.seq, key=good.execute.key, ok=True, result=known)
        )
        moved = await sup.external.submit(
            Propose(run_id="m-1", seq=related.seq, raw='{"next": "CLEANUP"}')
        )
        delete = call("delete_entities", {"entityNames": ["bob"]})
        cleanup = await sup.external.submit(Propose(run_id="m-1", seq=moved.seq, raw=delete))
        assert cleanup.accepted  # calls.create_entities is 1


async def test_a_guard_over_calls_counts_committed_calls(tmp_path: Path) -> None:
    machine = build_machine(memory(tmp_path), MEMORY_TOOLS)
    async with open_supervisor([machine]) as sup:
        await sup.external.start("memory", run_id="m-4")
        verdict = None
        for raw in ('{"next": "RELATE"}', '{"next": "CLEANUP"}'):
            verdict = await sup.external.submit(
                Propose(run_id="m-4", seq=sup.view("m-4").seq, raw=raw)
            )
            assert verdict.accepted
        delete = call("delete_entities", {"entityNames": ["bob"]})
        verdict = await sup.external.submit(
            Propose(run_id="m-4", seq=sup.view("m-4").seq, raw=delete)
        )
        assert [(v.code, v.message, v.hint) for v in verdict.violations] == [
            (
                "guard",
                "delete_entities: guard `calls.create_entities >= 1` is false",
                "change the arguments so that `calls.create_entities >= 1` holds",
            )
        ]


async def test_a_guard_that_cannot_be_evaluated_rejects(tmp_path: Path) -> None:
    text = MEMORY.replace('"size(args.entities) <= 3"', '"size(args.entities) <= inputs.limit"')
    machine = build_machine(load_machine_file(write(tmp_path, text)), MEMORY_TOOLS)
    async with open_supervisor([machine]) as sup:
        await sup.external.start("memory", run_id="m-2")  # no inputs: no limit
        verdict = await sup.external.submit(
            Propose(run_id="m-2", seq=sup.view("m-2").seq, raw=call("create_entities", alice("a")))
        )
        assert [(v.code, v.message) for v in verdict.violations] == [
            (
                "guard",
                "create_entities: guard `size(args.entities) <= inputs.limit` could not be "
                'evaluated: Key not found in map : "limit"',
            )
        ]
        await sup.external.start("memory", {"limit": "2"}, run_id="m-5")  # a string
        typed = await sup.external.submit(
            Propose(run_id="m-5", seq=sup.view("m-5").seq, raw=call("create_entities", alice("a")))
        )
        assert typed.violations[0].message == (
            "create_entities: guard `size(args.entities) <= inputs.limit` could not be "
            "evaluated: No matching overloads found : _<=_(int64, string)"
        )
        await sup.external.start("memory", {"limit": 2}, run_id="m-3")
        ok = await sup.external.submit(
            Propose(run_id="m-3", seq=sup.view("m-3").seq, raw=call("create_entities", alice("a")))
        )
        assert ok.accepted


# Each bad file: the edit made to MEMORY, and the whole error after "FILE: ".
BAD = [
    pytest.param(
        ("[machine]", "[machin]"),
        'machin: unknown key "machin"; allowed here: machine, states, tools, budgets, breakers',
        id="unknown-top-key",
    ),
    pytest.param(
        ('kind = "read-only"', 'kinds = "read-only"'),
        'tools.read_graph.kinds: unknown key "kinds"; allowed here: kind, moves_to, guards, '
        "result_guards, schema, approval, repeatable, reconcile, timeout",
        id="unknown-tool-key",
    ),
    pytest.param(
        ('next = ["CLEANUP", "COMPLETED"]', 'next = ["CLEANUP", "COMPLETD"]'),
        'states.RELATE.next: unknown state "COMPLETD"; the states are PLAN, RELATE, CLEANUP '
        "(or write COMPLETED/FAILED/ESCALATE)",
        id="unknown-state-in-next",
    ),
    pytest.param(
        ('kind = "read-only"', 'kind = "readonly"'),
        'tools.read_graph.kind: unknown kind "readonly"; write "read-only", "idempotent" or '
        '"neither"',
        id="bad-kind",
    ),
    pytest.param(
        ('kind = "read-only"', 'kind = "read-only"\ntimeout = 0'),
        "tools.read_graph.timeout: must be a positive number of seconds; got 0",
        id="zero-timeout",
    ),
    pytest.param(
        ('"calls.create_entities >= 1"', '"calls.create_entities >= "'),
        "tools.delete_entities.guards[0]: CEL error at line 1, column 26: Syntax error: "
        "mismatched input '<EOF>' expecting {'[', '{', '(', '.', '-', '!', 'true', 'false', "
        "'null', NUM_FLOAT, NUM_INT, NUM_UINT, STRING, BYTES, IDENTIFIER} in "
        '"calls.create_entities >= " (the variables are args, state, history, calls, inputs)',
        id="cel-syntax-error",
    ),
    pytest.param(
        ('when = "size(args.entities) <= 3"', 'when = "size(result) <= 3"'),
        "tools.create_entities.guards[0].when: CEL error at line 1, column 6: undeclared "
        "reference to 'result' (in container '') in \"size(result) <= 3\" (the variables are "
        "args, state, history, calls, inputs)",
        id="cel-unknown-variable",
    ),
    pytest.param(
        ('kind = "read-only"', 'kind = "read-only"\nresult_guards = ["size(history) > 0"]'),
        "tools.read_graph.result_guards[0]: CEL error at line 1, column 6: undeclared "
        "reference to 'history' (in container '') in \"size(history) > 0\" (the variables are "
        "result, args, state, inputs)",
        id="result-guard-unknown-variable",
    ),
    pytest.param(
        ('when = "size(args.entities) <= 3"', 'when = "size(args.entities)"'),
        "tools.create_entities.guards[0].when: the expression must be a bool; it is of type "
        'int in "size(args.entities)" (the variables are args, state, history, calls, inputs)',
        id="cel-not-a-bool",
    ),
    pytest.param(
        ('moves_to = "RELATE"', 'moves_to = "CLEANUP"'),
        "tools.create_entities.moves_to: state PLAN allows create_entities but cannot move to "
        '"CLEANUP"; add "CLEANUP" to states.PLAN.next',
        id="moves-to-not-a-next-state",
    ),
    pytest.param(
        ('moves_to = "RELATE"', 'moves_to = "RELAT"'),
        'tools.create_entities.moves_to: unknown state "RELAT"; the states are PLAN, RELATE, '
        "CLEANUP (or write COMPLETED/FAILED/ESCALATE)",
        id="moves-to-undeclared",
    ),
    pytest.param(
        ('next = ["CLEANUP", "COMPLETED"]', 'next = ["COMPLETED"]'),
        'states.CLEANUP: unreachable from the initial state "PLAN"; add "CLEANUP" to the next '
        "of a state that is reachable, or remove it",
        id="unreachable-state",
    ),
    pytest.param(
        ('initial = "PLAN"', 'initial = "PLAM"'),
        'machine.initial: unknown state "PLAM"; the states are PLAN, RELATE, CLEANUP',
        id="unknown-initial",
    ),
    pytest.param(
        ('tool = "read_graph"', 'tool = "create_relations"'),
        'tools.delete_entities.reconcile.tool: "create_relations" must be declared read-only '
        'to reconcile with it; add [tools.create_relations] kind = "read-only"',
        id="reconcile-with-a-tool-not-read-only",
    ),
    pytest.param(
        ("steps = 40", "steps = 0"),
        "budgets.steps: must be a whole number >= 1; got 0",
        id="bad-budget",
    ),
    pytest.param(
        ("consecutive_failures = 4", "consecutive_failure = 4"),
        'breakers.consecutive_failure: unknown key "consecutive_failure"; allowed here: '
        "consecutive_failures, repeats, circuit_failures, circuit_cooldown",
        id="unknown-breaker",
    ),
    pytest.param(
        ('next = ["COMPLETED"]\n', 'next = "COMPLETED"\n'),
        'states.CLEANUP.next: must be a list of state names; write ["COMPLETED"]',
        id="next-as-a-string",
    ),
    pytest.param(
        ("[states.CLEANUP]", "[states.COMPLETED]"),
        "states.COMPLETED: COMPLETED is a terminal state and takes no table; remove "
        "[states.COMPLETED]",
        id="terminal-state-table",
    ),
    pytest.param(
        ('kind = "neither"', 'kind = "idempotent"'),
        "tools.delete_entities.reconcile: delete_entities is idempotent: a call of it in doubt "
        'is simply retried; only a tool of kind "neither" is reconciled, so remove the reconcile',
        id="reconcile-of-a-tool-safe-to-repeat",
    ),
    pytest.param(
        ('tools = ["read_graph", "create_relations"]', 'tools = ["read_graph", "transition"]'),
        'states.RELATE.tools: "transition" is the transition tool, allowed in every state; '
        "remove it here",
        id="transition-tool-in-a-state",
    ),
    pytest.param(
        ("approval = true", 'approval = "yes"'),
        'tools.create_entities.approval: must be true or false; got "yes"',
        id="approval-not-a-bool",
    ),
    pytest.param(
        ('hint = "split', 'hints = "split'),
        'tools.create_entities.guards[0].hints: unknown key "hints"; allowed here: when, '
        "message, hint",
        id="unknown-guard-key",
    ),
    pytest.param(
        ('when = "size(args.entities) <= 3"\n', ""),
        'tools.create_entities.guards[0].when: missing; write when = "CEL expression"',
        id="guard-without-when",
    ),
    pytest.param(
        ('next = ["RELATE", "FAILED"]\n', ""),
        'states.PLAN.next: missing; write next = ["STATE", ...]',
        id="state-without-next",
    ),
    pytest.param(
        ('[tools.delete_entities.reconcile]\ntool = "read_graph"\n', ""),
        'tools.delete_entities.applied: unknown key "applied"; allowed here: kind, '
        "moves_to, guards, result_guards, schema, approval, repeatable, reconcile, timeout",
        id="reconcile-key-outside-its-table",
    ),
    pytest.param(
        ("[budgets]", "[budgets"),
        "line 44, column 9: invalid TOML: expected ']' at the end of a table declaration",
        id="toml-syntax-error",
    ),
]


@pytest.mark.parametrize(("edit", "error"), BAD)
def test_a_bad_file_is_refused_with_one_line_naming_the_key(
    tmp_path: Path, edit: tuple[str, str], error: str
) -> None:
    old, new = edit
    assert MEMORY.count(old) == 1
    path = write(tmp_path, MEMORY.replace(old, new))
    with pytest.raises(ConfigurationError) as info:
        load_machine_file(path)
    assert str(info.value) == f"{path}: {error}"
    assert "\n" not in str(info.value)


def test_a_tool_the_upstream_lacks_is_refused(tmp_path: Path) -> None:
    spec = memory(tmp_path)
    upstream = {k: v for k, v in MEMORY_TOOLS.items() if k != "create_relations"}
    with pytest.raises(ConfigurationError) as info:
        build_machine(spec, upstream)
    assert str(info.value) == (
        f'{spec.path}: states.RELATE.tools: tool "create_relations" is not among the '
        "upstream's tools: create_entities, delete_entities, read_graph"
    )


def test_an_upstream_schema_interlock_cannot_compile_asks_for_a_schema(tmp_path: Path) -> None:
    spec = memory(tmp_path)
    upstream = dict(MEMORY_TOOLS)
    upstream["delete_entities"] = {
        "inputSchema": {"type": "object", "allOf": [{"required": ["entityNames"]}]}
    }
    with pytest.raises(ConfigurationError) as info:
        build_machine(spec, upstream)
    message = str(info.value)
    assert message.startswith(
        f"{spec.path}: tools.delete_entities: the upstream's inputSchema of delete_entities "
        "cannot be compiled: JSON Schema keyword 'allOf' at args is not supported; use "
    )
    assert message.endswith(
        "; give the tool a schema in the file ([tools.delete_entities] schema = ...) "
        "using the keywords interlock supports"
    )
    # ... and with a schema in the file, it builds
    text = MEMORY.replace(
        '[tools.delete_entities]\nkind = "neither"\n',
        '[tools.delete_entities]\nkind = "neither"\nschema = \'{"type": "object", "properties": '
        '{"entityNames": {"type": "array", "items": {"type": "string"}, "maxItems": 2}}, '
        '"required": ["entityNames"], "additionalProperties": false}\'\n',
    )
    machine = build_machine(load_machine_file(write(tmp_path, text, "fixed.toml")), upstream)
    schema = machine.tool_by_name["delete_entities"].validator.json_schema()
    assert schema["properties"]["entityNames"]["maxItems"] == 2


def test_the_how_to_example_loads_and_builds(tmp_path: Path) -> None:
    doc = Path(__file__).parent.parent / "docs" / "how-to" / "mcp-machines.md"
    example = doc.read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    spec = load_machine_file(write(tmp_path, example, "example.toml"))
    machine = build_machine(spec, MEMORY_TOOLS)
    assert list(machine.states) == ["PLAN", "RELATE", "CLEANUP"]
    assert spec.reconcile("delete_entities") is not None


async def test_a_guard_that_is_not_a_bool_at_run_time_rejects(tmp_path: Path) -> None:
    # args.entities[0].name is of no type CEL knows before the call: accepted at load
    text = MEMORY.replace('"size(args.entities) <= 3"', '"args.entities[0].name"')
    machine = build_machine(load_machine_file(write(tmp_path, text)), MEMORY_TOOLS)
    async with open_supervisor([machine]) as sup:
        await sup.external.start("memory", run_id="m-6")
        verdict = await sup.external.submit(
            Propose(run_id="m-6", seq=sup.view("m-6").seq, raw=call("create_entities", alice("a")))
        )
        assert verdict.violations[0].message == (
            "create_entities: guard `args.entities[0].name` could not be evaluated: it gave "
            "string 'a', not a bool"
        )


async def test_a_guard_sees_the_state_and_the_inputs(tmp_path: Path) -> None:
    text = MEMORY.replace(
        '[tools.read_graph]\nkind = "read-only"\n',
        '[tools.read_graph]\nkind = "read-only"\nguards = [\'state == "PLAN" || inputs.who == "ana"\']\n',
    )
    machine = build_machine(load_machine_file(write(tmp_path, text)), MEMORY_TOOLS)
    read = call("read_graph", {})
    async with open_supervisor([machine]) as sup:
        for run_id, who, state, accepted in [
            ("r-1", "bo", "PLAN", True),
            ("r-2", "bo", "RELATE", False),
            ("r-3", "ana", "RELATE", True),
        ]:
            await sup.external.start("memory", {"who": who}, run_id=run_id)
            if state == "RELATE":
                await sup.external.submit(
                    Propose(run_id=run_id, seq=sup.view(run_id).seq, raw='{"next": "RELATE"}')
                )
            verdict = await sup.external.submit(
                Propose(run_id=run_id, seq=sup.view(run_id).seq, raw=read)
            )
            assert verdict.accepted is accepted, run_id


def test_a_file_schema_interlock_cannot_compile_is_refused(tmp_path: Path) -> None:
    text = MEMORY.replace(
        '[tools.read_graph]\nkind = "read-only"\n',
        '[tools.read_graph]\nkind = "read-only"\nschema = { type = "object", allOf = [] }\n',
    )
    path = write(tmp_path, text)
    with pytest.raises(ConfigurationError) as info:
        load_machine_file(path)
    assert str(info.value).startswith(
        f"{path}: tools.read_graph.schema: JSON Schema keyword 'allOf' at args is not "
        "supported; use $comment, $schema, additionalProperties, anyOf, "
    )


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigurationError) as info:
        load_machine_file(path)
    assert str(info.value) == (
        f"{path}: cannot read the file: [Errno 2] No such file or directory: {path!r}"
    )


#: A tool as a Python MCP server (the SDK's MCPServer, pydantic) lists it: nested models
#: are $defs named by $ref.
SHIP = {
    "description": "ship",
    "inputSchema": {
        "$defs": {
            "Addr": {
                "properties": {
                    "street": {"title": "Street", "type": "string"},
                    "zip": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                },
                "required": ["street"],
                "title": "Addr",
                "type": "object",
            }
        },
        "properties": {
            "to": {"$ref": "#/$defs/Addr", "description": "where to"},
            "count": {"default": 1, "title": "Count", "type": "integer"},
        },
        "required": ["to"],
        "title": "shipArguments",
        "type": "object",
    },
}

SHIP_FILE = """\
[machine]
name = "ship"
initial = "GO"

[states.GO]
tools = ["ship"]
next = ["COMPLETED"]
"""


def test_an_upstream_schema_naming_its_definitions_is_inlined(tmp_path: Path) -> None:
    machine = build_machine(load_machine_file(write(tmp_path, SHIP_FILE)), {"ship": SHIP})
    validator = machine.tool_by_name["ship"].validator
    assert validator.validate_json(b'{"to": {"street": "Main St"}}') == (
        {"to": {"street": "Main St", "zip": None}, "count": 1},
        (),
    )
    _, (violation,) = validator.validate_json(b'{"to": {"zip": "75001"}}')
    assert violation.message == "args.to: object missing required field `street`"
    assert validator.json_schema()["properties"]["to"]["description"] == "where to"


def test_a_recursive_upstream_schema_asks_for_a_schema(tmp_path: Path) -> None:
    spec = load_machine_file(write(tmp_path, SHIP_FILE))
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}
    recursive = {
        "inputSchema": {
            "type": "object",
            "$defs": {"Node": node},
            "properties": {"to": {"$ref": "#/$defs/Node"}},
        }
    }
    with pytest.raises(ConfigurationError) as info:
        build_machine(spec, {"ship": recursive})
    assert str(info.value) == (
        f"{spec.path}: tools.ship: the upstream's inputSchema of ship cannot be compiled: "
        "JSON Schema at args.properties.to.properties.next: $ref '#/$defs/Node' is recursive, "
        "which interlock's schema compiler cannot check; give the tool a schema in the file "
        "([tools.ship] schema = ...) using the keywords interlock supports"
    )
