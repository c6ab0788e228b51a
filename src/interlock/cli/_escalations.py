"""``interlock escalations``: list, resume and abort the runs waiting for an operator."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import msgspec

from ..core._escalation import answer_again, escalated_from, resume_targets
from ..core._exceptions import ConfigurationError, OperatorRefused
from ..core._view import fold
from ..runtime._app import find_ref, load_app
from ..runtime._handle import run_result
from ..stores import JournalHeld
from ..stores._open import open_store
from ._common import (
    _application,
    _close,
    _count,
    _has_state,
    _journal_url,
    _open_read,
    _print_json,
    _print_table,
    _record_json,
    _require,
    _short,
    _table,
    _when,
)
from ._show import _show

if TYPE_CHECKING:
    import argparse

    from ..core._machine import Machine


async def _escalations(args: argparse.Namespace) -> int:
    action = args.action or "list"
    if action in ("resume", "abort"):
        return await _operate(args, action)
    if action == "show":
        return await _show(args)
    _journal_url(args)
    store = await _open_read(args)
    try:
        records = await store.escalations()
        # where each may resume, by the machines of the app (as the gateway lists them)
        machines: dict[str, Machine] = {}
        if records:
            where, ref, base = find_ref(args.app)
            machines = dict(load_app(ref, where, base).machines)
        origins = [escalated_from(await store.load(r.run_id)) for r in records]
    finally:
        await _close(store)
    targets = [
        resume_targets(machines[r.machine], origin) if r.machine in machines and origin else []
        for r, origin in zip(records, origins, strict=True)
    ]
    if args.json:
        _print_json(
            {
                "db": args.db,
                "count": len(records),
                "escalations": [
                    {**_record_json(r), "from_state": origin, "targets": legal}
                    for r, origin, legal in zip(records, origins, targets, strict=True)
                ],
            }
        )
        return 0
    table = _table(
        f"{_count(len(records), 'escalated run')} in {args.db}",
        *("run", "workflow", "state", "reason", "detail", "since", "resume in"),
    )
    for r, legal in zip(records, targets, strict=True):
        table.add_row(
            r.run_id,
            r.machine,
            r.state,
            r.reason,
            _short(r.detail, 100),
            _when(r.updated),
            ", ".join(legal),
        )
    _print_table(table)
    return 0


def _operator(args: argparse.Namespace) -> str:
    import getpass

    if args.by:
        return str(args.by)
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "operator"


async def _operate(args: argparse.Namespace, action: str) -> int:
    from ..runtime._runtime import open_supervisor

    if action == "resume" and args.payload is not None:
        try:
            msgspec.json.decode(args.payload)
        except msgspec.DecodeError as exc:
            raise ConfigurationError(
                f"--payload is not valid JSON ({exc}); pass one proposal like "
                '\'{"tool": "refund", "args": {...}}\' or \'{"next": "STATE"}\''
            ) from None
    if (args.app or "").endswith(".toml"):  # an MCP machine file: its run pinned its tools
        from ._mcp import toml_application

        app, named, db = await toml_application(args)
    else:
        app, named, db = _application(args)
    # Read-only first: a missing journal fails fast, creating nothing, and so does a run
    # of a machine the app does not have.
    store = await open_store(db, readonly=True)
    try:
        record = await store.get_run(args.run_id)
        _require(app, named, [record], run=False)
        events = await store.load(args.run_id)
        if record.outcome != "escalated":
            # out of the queue: a repeat of what an operator did is answered, anything
            # else refused, as the gateway and the supervisor decide it
            _, answer = answer_again(
                record.run_id,
                record.outcome,
                record.state,
                events,
                "resume" if action == "resume" else "abort",
                to=args.to if action == "resume" else None,
                payload=args.payload if action == "resume" else None,
            )
            result = run_result(fold(app.machines[record.machine], events))
            if args.json:
                _print_json({**msgspec.to_builtins(result), "repeated": answer})
            else:
                sys.stdout.write(answer + "\n")
            return 0
        # a provider only to drive a resumed hosted run: an abort, or the resume of an
        # external run (its caller drives it on), runs nothing here
        external = bool(events) and getattr(events[0], "external", False) is True
        _require(app, named, [record], run=action == "resume" and not external)
        if action == "resume" and not args.to:
            # where it escalated from: the state it resumes in (with --to, the one rule
            # decides, which takes any state of the machine if that one is gone)
            origin = escalated_from(events)
            if origin:
                _has_state(app, named, record, origin, "escalated from")
    finally:
        await _close(store)
    try:
        store = await open_store(db)
    except JournalHeld as held:  # a live process serves it: hand the request over
        return await _hand_over(args, action, held)
    try:
        async with (
            app.open(db, named),
            open_supervisor(list(app.machines.values()), store, provider=app.provider) as sup,
        ):
            if action == "abort":
                result = await sup.abort_escalated(args.run_id, by=_operator(args), note=args.note)
            else:
                handle = await sup.resume_escalated(
                    args.run_id,
                    by=_operator(args),
                    note=args.note,
                    to=args.to,
                    payload=args.payload,
                )
                if handle.external and not handle.done:
                    # no actor: its caller drives it on, so nothing here would end it
                    result = sup.result_of(args.run_id)
                else:
                    result = await handle.wait()
    finally:
        await _close(store)
    _print_result(args, msgspec.to_builtins(result))
    return 0


def _print_result(args: argparse.Namespace, document: dict[str, Any]) -> None:
    if args.json:
        _print_json(document)
        return
    line = f"run {document['run_id']}: {document['outcome']} in {document['state']}"
    if document["outcome"] == "running":
        line += " (an external run: its caller drives it on)"
    reason = document.get("reason")
    sys.stdout.write(line + (f" ({reason})" if reason else "") + "\n")


async def _hand_over(args: argparse.Namespace, action: str, held: JournalHeld) -> int:
    """Hand an operator's request to the process that holds the SQLite journal (an
    ``interlock mcp`` proxy serves its inbox), and print its answer."""
    from ..runtime._operators import OperatorRequest, post_operator_request

    request = OperatorRequest(
        action=action,
        run_id=args.run_id,
        by=_operator(args),
        note=args.note,
        to=args.to if action == "resume" else None,
        payload=args.payload if action == "resume" else None,
    )
    answer = await post_operator_request(held.path, request, wait=args.wait)
    if answer is None:
        refused = JournalHeld(held.path, held.holder, 0.0)
        refused.args = (
            f"journal {held.path} is held by {held.who}, which took no operator request "
            f"within {args.wait:g} s (an `interlock mcp` proxy takes them; another process "
            "does not): stop it, then run this again",
        )
        raise refused
    if answer.error or answer.result is None:
        raise OperatorRefused(answer.error or "the process holding the journal did not say")
    _print_result(args, answer.result)
    return 0
