"""``interlock run``, ``interlock enqueue`` and ``interlock resume``: start runs and finish them."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._exceptions import InvalidInputs
from ..stores._open import open_store, sqlite_path
from ..stores._sqlite import JournalHeld, hold_journal
from ._common import (
    _application,
    _close,
    _count,
    _has_provider,
    _json_object,
    _log_leases,
    _Metrics,
    _print_json,
    _print_summary,
    _progress,
    _require,
    _Usage,
)

if TYPE_CHECKING:
    from ..core._machine import Machine
    from ..runtime._app import App

    pass


#: ``interlock run`` prints one line per run up to this many runs, else a summary.
RUN_LINES = 20


async def _run(args: argparse.Namespace) -> int:
    from ..demo._run import summarize_runs
    from ..runtime._runtime import open_supervisor

    app, named, db = _application(args)
    machine = _machine_of(app, named, args.machine)
    inputs = machine.check_inputs(args.inputs or {})  # refused before anything is opened
    _has_provider(app, named, machine.name)
    metrics = _Metrics(args, app.prices)
    handles = []
    started = time.perf_counter()
    with metrics:
        store = await open_store(db)
        try:
            async with (
                _progress(metrics, args.count, quiet=args.json),
                app.open(db, named),
                open_supervisor(
                    list(app.machines.values()), store, provider=app.provider, stats=metrics.stats
                ) as supervisor,
            ):
                metrics.started(supervisor)
                for _ in range(args.count):
                    handles.append(await supervisor.start_run(machine.name, inputs))
            results = [await handle.wait() for handle in handles]
        finally:
            await _close(store)
        summary = summarize_runs(
            results, metrics.stats, [machine.name], wall=time.perf_counter() - started, db=db
        )
        ended = all(r.outcome == "completed" for r in results)
        if args.json:
            _print_json({**summary, "results": [msgspec.to_builtins(r) for r in results]})
        elif len(results) <= RUN_LINES:
            for r in results:
                line = f"run {r.run_id}: {r.outcome} in {r.state}"
                sys.stdout.write(line + (f" ({r.reason})" if r.reason else "") + "\n")
        else:
            _print_summary(
                summary,
                f"interlock run: {_count(len(results), 'run')} of {machine.name} in "
                f"{summary['wall_seconds']} s ({summary['runs_per_second']} runs/s)",
            )
        await metrics.held()
    return 0 if ended else 1


def _machine_of(app: App, named: str, name: str) -> Machine:
    machine = app.machines.get(name)
    if machine is None:
        raise _Usage(
            f"the app {named} has no machine {name!r}; its machines: "
            + ", ".join(sorted(app.machines))
        )
    return machine


async def _enqueue(args: argparse.Namespace) -> int:
    from ..runtime._enqueue import enqueue_run, enqueue_runs

    app, named, db = _application(args)
    machine = _machine_of(app, named, args.machine)
    many = None
    if args.inputs_file is not None:
        if args.run_id is not None or args.inputs is not None:
            raise _Usage(
                "--inputs-file gives every run's inputs (one JSON object per line); drop "
                "--inputs and --run-id"
            )
        lines = await _inputs_lines(args.inputs_file)
        many = [inputs for _, inputs in lines]
    store = await open_store(db)
    try:
        if many is None:
            ids = [await enqueue_run(store, machine, args.inputs or {}, run_id=args.run_id)]
        else:
            try:
                ids = await enqueue_runs(store, machine, many)
            except InvalidInputs as exc:
                index = getattr(exc, "index", None)
                if index is None:
                    raise
                raise InvalidInputs(
                    f"--inputs-file {args.inputs_file}, line {lines[index][0]}: "
                    f"{exc.__cause__ or exc}; nothing was written"
                ) from None
    finally:
        await _close(store)
    if args.json:
        if many is None:
            _print_json({"run_id": ids[0], "machine": machine.name, "db": db})
        else:
            _print_json({"run_ids": ids, "machine": machine.name, "db": db})
    else:
        app_flag = f" --app {shlex.quote(args.app)}" if args.app else ""
        where = shlex.quote(db)
        them = "it" if many is None else "them"
        driver = (
            f"`interlock resume{app_flag} --db {where}` drives {them}"
            if sqlite_path(db) is not None
            else f"a worker (`interlock worker{app_flag} --db {where}`) or `interlock resume` "
            f"on it drives {them}"
        )
        what = f"run {ids[0]!r}" if many is None else _count(len(ids), "run")
        sys.stdout.write(f"enqueued {what} of {machine.name!r} in {db}; {driver}\n")
    return 0


async def _inputs_lines(path: str) -> list[tuple[int, dict[str, Any]]]:
    """The inputs of ``--inputs-file`` with their line numbers: one JSON object per line
    (``-``: stdin)."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = await trio.Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise _Usage(f"--inputs-file {path}: {exc.strerror or exc}") from None
    inputs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            inputs.append((number, _json_object(line)))
        except argparse.ArgumentTypeError as exc:
            raise _Usage(f"--inputs-file {path}, line {number}: {exc}") from None
    if not inputs:
        raise _Usage(f"--inputs-file {path} holds no inputs; write one JSON object per line")
    return inputs


async def _resume(args: argparse.Namespace) -> int:
    app, named, db = _application(args)
    path = sqlite_path(db)
    if path is None or not await trio.Path(path).exists():  # missing: refused read-only
        return await _resume_held(args, app, named, db)

    def waiting(held: JournalHeld) -> None:
        limit = "as long as it takes" if math.isinf(args.wait) else f"up to {args.wait:g} s"
        sys.stderr.write(f"interlock: journal {db} is held by {held.who}; waiting {limit}\n")
        sys.stderr.flush()

    # One writer per SQLite journal: held (or waited for) before the unfinished runs are
    # read, so a second resume resumes nothing twice and fails before it changes anything.
    async with hold_journal(path, wait=args.wait or 0.0, on_wait=waiting):
        return await _resume_held(args, app, named, db)


async def _resume_held(args: argparse.Namespace, app: App, named: str, db: str) -> int:
    from ..demo._run import resume_app, summarize_store

    metrics = _Metrics(args, app.prices)
    store = await open_store(db, readonly=True)  # a missing journal is an error, not a new one
    try:
        unfinished = await store.unfinished()
        _require(app, named, unfinished)
        if not unfinished:
            if args.json:
                _print_json(await summarize_store(store, list(app.machines), db=db))
            else:
                total = len(await store.list_runs())
                sys.stdout.write(
                    f"nothing to resume in {db}: {_count(total, 'run')}, none unfinished\n"
                )
            return 0
    finally:
        await _close(store)
    with metrics, _log_leases(lambda: "interlock resume"):
        summary = await resume_app(
            app,
            db,
            stats=metrics.stats,
            on_start=metrics.started,
            named=named,
            lease_ttl=args.lease_ttl,
            wait=args.wait,
        )
        if args.json:
            _print_json(summary)
        else:
            _print_summary(
                summary,
                f"interlock resume: {summary['resumed']} runs resumed in "
                f"{summary['wall_seconds']} s ({summary['runs_per_second']} runs/s, hot path "
                f"{summary['hotpath']}); {summary['runs']} runs in the journal",
            )
        await metrics.held()
    if summary["external"]:
        left = summary["external_runs"]
        sys.stderr.write(
            f"interlock: error: {_count(len(left), 'external run')} left running (e.g. "
            f"{left[0]!r}): a run started with external=True is driven by its caller "
            "(Supervisor.submit), which resumes it\n"
        )
        return 1
    return 0
