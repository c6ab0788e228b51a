"""``interlock check``: load an application and check its machines."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import msgspec

from ._common import _close, _count, _journal_url, _open_read, _print_json

if TYPE_CHECKING:
    import argparse


async def _check(args: argparse.Namespace) -> int:
    _journal_url(args)
    store = await _open_read(args)
    try:
        report = await store.check()
    finally:
        await _close(store)
    if args.json:
        _print_json(
            {
                "db": args.db,
                "ok": report.ok,
                "runs": report.runs,
                "events": report.events,
                "problems": [msgspec.to_builtins(p) for p in report.problems],
            }
        )
    elif report.ok:
        sys.stdout.write(
            f"ok: {_count(report.runs, 'run')}, {_count(report.events, 'event')}, no damage\n"
        )
    else:
        lines = [f"damaged: {_count(len(report.problems), 'problem')}"]
        lines += [f"  {problem.message}" for problem in report.problems]
        sys.stdout.write("\n".join(lines) + "\n")
    return 0 if report.ok else 1
