"""``interlock worker``: run a share of the journal's runs, leased."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import msgspec
import trio

from ..stores._open import sqlite_path
from ._common import _application, _log_leases, _Metrics, _print_json, _tracing, _Usage

if TYPE_CHECKING:
    import argparse


async def _worker(args: argparse.Namespace) -> int:
    import signal

    from ..runtime._worker import WorkerControl, run_worker

    app, named, db = _application(args)
    if sqlite_path(db) is not None:
        raise _Usage(
            f"interlock worker needs a PostgreSQL journal (--db postgresql://...), where runs "
            f"are leased to workers; {db} is a SQLite journal, which one process drives: "
            "run `interlock resume` on it"
        )
    metrics = _Metrics(args, app.prices)
    control: WorkerControl | None = None
    name = args.owner or "?"

    def started(worker: WorkerControl) -> None:
        nonlocal control, name
        control = worker
        name = worker.owner
        metrics.started(worker.supervisor)
        assert worker.supervisor.leases is not None
        sys.stderr.write(
            f"interlock worker {name}: ready on {_where(db)} (lease ttl "
            f"{worker.supervisor.leases.ttl:g} s, up to {args.max_runs} runs)\n"
        )
        sys.stderr.flush()

    async def on_signals(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                if control is not None and not control.draining:
                    sys.stderr.write(
                        f"interlock worker {name}: {signal.Signals(signum).name}: draining "
                        f"(the steps in flight finish, then the leases are released)\n"
                    )
                    sys.stderr.flush()
                    control.drain()
                else:  # a second signal: stop now; the leases expire
                    nursery.cancel_scope.cancel()

    with (
        _log_leases(lambda: f"interlock worker {name}"),
        metrics,
        _tracing(args, "interlock-worker") as tracing,
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(on_signals)
            summary = await run_worker(
                app,
                db,
                owner=args.owner,
                lease_ttl=args.lease_ttl,
                max_runs=args.max_runs,
                claim_batch=args.claim_batch,
                poll=args.poll,
                until_idle=args.until_idle,
                idle_wait=args.wait,
                drain_timeout=args.drain_timeout,
                stats=metrics.stats,
                on_start=started,
                named=named,
                tracing=tracing,
            )
            nursery.cancel_scope.cancel()
        await metrics.held()
    if args.json:
        _print_json(msgspec.to_builtins(summary))
    else:
        how = "drained" if summary.drained else "idle"
        sys.stdout.write(
            f"interlock worker {summary.owner}: {how} after {summary.wall_seconds} s; claimed "
            f"{summary.claimed}, finished {summary.finished} ({summary.completed} completed, "
            f"{summary.failed} failed, {summary.escalated} escalated), lost {summary.lost} "
            f"leases, released {summary.released}\n"
        )
    return 0


def _where(db: str) -> str:
    from ..stores._open import split_schema
    from ..stores._postgres import describe_dsn

    dsn, schema = split_schema(db)
    return f"{describe_dsn(dsn)} schema {schema}"
