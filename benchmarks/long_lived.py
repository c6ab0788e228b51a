"""Memory of a long-lived supervisor: resident set size as one supervisor runs many runs.

One ``open_supervisor`` on a SQLite journal (the journal is on disk, so what is measured is
the supervisor's own memory) runs ``--runs`` one-step runs, 1,000 at a time, and prints the
resident set size and the handles it still holds every 20,000 runs. A supervisor that keeps
nothing per finished run stays flat; one that keeps a handle per run grows with every run.

    python -m benchmarks.long_lived [--runs 100000]

Set PYTHONPATH to another checkout's src/ to compare (the README's figures compare the
commit before handles were released with the one that releases them).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import trio

from interlock import Machine, Worker, open_supervisor
from interlock.providers import ScriptedProvider
from interlock.stores import open_sqlite_store


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def measure(runs: int) -> list[tuple[int, float, int]]:
    spec = Machine("m", "W", {"W": Worker(next=["COMPLETED"])})
    provider = ScriptedProvider(lambda view: '{"next": "COMPLETED"}')  # keeps no per-run state
    marks = []
    with tempfile.TemporaryDirectory() as directory:
        store = await open_sqlite_store(os.path.join(directory, "journal.db"))
        try:
            async with open_supervisor([spec], store, provider=provider) as supervisor:
                for batch in range(runs // 1000):
                    handles = [
                        await supervisor.start_run("m", run_id=f"r-{batch}-{i}")
                        for i in range(1000)
                    ]
                    for handle in handles:
                        await handle.wait()
                    done = (batch + 1) * 1000
                    if done % 20_000 == 0:
                        marks.append((done, rss_mib(), len(supervisor.handles)))
        finally:
            await store.aclose()
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    args = parser.parse_args()
    marks = trio.run(measure, args.runs)
    print(f"{'runs':>8} {'RSS MiB':>8} {'handles':>8}")
    for done, rss, handles in marks:
        print(f"{done:>8,} {rss:>8.1f} {handles:>8,}")
    if len(marks) > 1:
        (first, low, _), (last, high, _) = marks[0], marks[-1]
        per_run = (high - low) * 2**20 / (last - first)
        print(f"growth: {per_run:.0f} bytes per run from {first:,} to {last:,} runs")


if __name__ == "__main__":
    main()
