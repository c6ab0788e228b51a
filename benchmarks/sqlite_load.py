"""Reading a run back from the SQLite store: ``load`` and ``load_after``, µs per run.

1,000 runs of the gateway benchmark's machine, 31 chunks each (a start, then 30 batches of
one transition per run), appended through the store, then read back read-only with a warm
page cache: every run's whole journal (best of 3), and every run's last chunk
(``load_after``). Run it from two checkouts to compare store layouts:

    python -m benchmarks.sqlite_load
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import trio

from benchmarks import sqlite_append as sa
from interlock.stores import _sqlite


async def main(batches: list[list[Any]]) -> None:
    d = tempfile.mkdtemp()
    p = os.path.join(d, "j.db")
    store = await _sqlite.open_sqlite_store(p)
    for b in batches:
        await store.append(b)
    await store.aclose()
    store = await _sqlite.open_sqlite_store(p, readonly=True)
    ids = [r.run_id for r in await store.list_runs()]
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for i in ids:
            await store.load(i)
        best = min(best, time.perf_counter() - t)
    t = time.perf_counter()
    for i in ids:
        await store.load_after(i, 58)
    tail = time.perf_counter() - t
    print(
        f"schema {_sqlite.SCHEMA_VERSION}: load {best / len(ids) * 1e6:.0f} µs a run "
        f"(62 events in 31 chunks), load_after of its last chunk {tail / len(ids) * 1e6:.0f} µs",
    )
    await store.aclose()


if __name__ == "__main__":
    trio.run(main, sa.capture(1000, 30))  # 1,000 runs x 31 chunks
