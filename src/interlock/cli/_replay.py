"""``interlock replay``: re-fold a run's journal and diff it against the machines."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import msgspec

from ..core._exceptions import ConfigurationError
from ..runtime._app import App, load_app
from ._common import (
    _application,
    _close,
    _count,
    _open_read,
    _print_json,
    _print_table,
    _require,
    _table,
    _Usage,
)
from ._mcp import machine_file_for as _machine_file

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from ..core._machine import Machine


def _what_if(refs: Sequence[str]) -> dict[str, tuple[str, Machine]]:
    """The machines ``--machine`` names, each REF as ``--app`` takes it, by name, with the
    REF that named each."""
    machines: dict[str, tuple[str, Machine]] = {}
    for ref in refs:
        for name, machine in load_app(ref, "--machine").machines.items():
            machines[name] = (ref, machine)
    return machines


async def _replay(args: argparse.Namespace) -> int:
    from ..runtime._replay import replay

    if not args.all and not args.run_ids:
        raise _Usage("name the runs to replay, or pass --all")
    if args.workflow is not None and not args.all:
        raise _Usage("--workflow chooses among --all; pass --all too, or drop it")
    app, named, db = _application(args)
    files = [ref for ref in args.machine if ref.endswith(".toml")]  # MCP machine files
    what_if = _what_if([ref for ref in args.machine if not ref.endswith(".toml")])
    overrides = [machine for _ref, machine in what_if.values()]
    machines = {**app.machines, **{m.name: m for m in overrides}}
    store = await _open_read(args)
    try:
        if args.all:
            records = await store.list_runs(machine=args.workflow)
        else:
            records = [await store.get_run(run_id) for run_id in dict.fromkeys(args.run_ids)]
        if args.workflow is not None and not records:
            raise ConfigurationError(
                f"no runs of workflow {args.workflow!r} in {db}; `interlock runs --db {db}` "
                "lists the runs and their workflows"
            )
        for ref in files:
            machine = await _machine_file(ref, records, store)
            what_if[machine.name] = (ref, machine)
            machines[machine.name] = machine
        _require(App(list(machines.values())), named, records, run=False)
        used = sorted({r.machine for r in records})
        for name, (ref, _machine) in what_if.items():
            if records and name not in used:
                raise ConfigurationError(
                    f"--machine {ref!r} is machine {name!r}, which none of the runs replayed "
                    f"uses (their machines: {', '.join(used)}); name one of theirs"
                )
        journal = {r.run_id: await store.load(r.run_id) for r in records}
    finally:
        await _close(store)
    report = replay(journal, list(machines.values()))
    diverged = report.diverged
    if args.json:
        _print_json(
            {
                "db": db,
                "runs": len(report.runs),
                "reproduced": report.reproduced,
                "diverged": [msgspec.to_builtins(r) for r in diverged],
                "what_if": [m.name for m in overrides],
            }
        )
        return 0 if report.ok else 1
    sys.stdout.write(
        f"replayed {_count(len(report.runs), 'run')} from {db}: {report.reproduced} reproduced, "
        f"{len(diverged)} diverged"
        + (f" (what-if: {', '.join(m.name for m in overrides)})" if overrides else "")
        + "\n"
    )
    if diverged:
        from rich.markup import escape

        table = _table("first divergence per run", "run", "seq", "event", "expected", "got")
        for run in diverged:
            d = run.divergence
            assert d is not None
            table.add_row(run.run_id, str(d.seq), d.kind, escape(d.expected), escape(d.got))
        sys.stdout.flush()
        _print_table(table)
    return 0 if report.ok else 1
