"""The operator console's pages on a large journal (issue 38).

``python -m benchmarks.console [--runs N | --db PATH [--in-place]] [--rounds R] [--write]``

A SQLite journal of N runs (default 100,000) is built once with the project's demo
(``interlock demo --runs N --db PATH --json``: completed, failed and some thousands of
escalated runs), or ``--db PATH`` reuses one already built; it is copied first (SQLite's
backup, a second or two) so the benchmark never opens another's journal for writing and
works while another process holds it, unless ``--in-place`` serves it as it is. Then
``interlock console --db PATH --port 0`` serves it in a subprocess with no API key (open,
loopback), and one httpx client (sync, keep-alive) times, once cold and then ``--rounds``
times warm, each of:

- baseline A, the floor: ``await store.list_runs()`` in this process, on the same journal
  opened read-only (``open_store(PATH, readonly=True)``): every row of the runs index read
  and checked, what the console's index costs to read;
- baseline B: the gateway's JSON API ``GET /v1/runs?limit=50``, which reads the whole
  index on every call;
- ``GET /console/runs`` (the first call reads the index; later ones are served from the
  console's cache, kept until this process writes the journal), filtered by
  ``outcome=escalated``, searched by a prefix of a real run id that matches about ten runs,
  and its last page;
- ``GET /console/escalations``, page 1 and the last page (20 runs a page, each a journal
  read for the state it escalated from);
- ``GET /console/runs/<id>`` (an escalated run from the middle of the queue) and its
  ``/replay``.

Each figure is wall time of the whole request (sent, answered, body read). The cold figure
is the first call of the process (the journal file itself is in the OS page cache: it was
just built or copied); the warm figure is the median of the ``--rounds`` calls after it.
Ratios are warm medians over baseline A's warm median, measured in the same run. Every
answer must be HTTP 200 (anything else is printed and the benchmark exits non-zero). The
console process's RSS (``/proc/PID/status``) is read right after it starts, before any
request, and again after all of them: what the cached index costs at N runs.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION = "## Operator console: page times and memory on a large journal (issue 38)"
#: Runs per page of the console's list and of its escalation queue (gateway/_console.py).
PAGE_SIZE = 50
QUEUE_PAGE_SIZE = 20


class Non200(Exception):
    """A request answered with another status than 200: a bug."""


def _build(runs: int, scratch: Path) -> tuple[Path, dict[str, Any], float]:
    """A fresh demo journal of ``runs`` runs, its ``--json`` summary and its wall time."""
    db = scratch / "interlock.db"
    started = time.perf_counter()
    command = [sys.executable, "-m", "interlock", "demo", "--runs", str(runs), "--db", str(db)]
    done = subprocess.run(
        [*command, "--json"],
        cwd=scratch,
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"interlock demo failed ({done.returncode}): {done.stderr[-2000:]}")
    return db, json.loads(done.stdout), took


def _copy(source: Path, scratch: Path) -> tuple[Path, float]:
    """A consistent copy of the SQLite journal ``source`` (its backup API), and its time."""
    if not source.is_file() or not os.access(source, os.R_OK):
        raise RuntimeError(f"journal {source} is missing or unreadable")
    target = scratch / "interlock.db"
    started = time.perf_counter()
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    try:
        dst = sqlite3.connect(target)
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()
    return target, time.perf_counter() - started


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid``, in KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def _start_console(db: Path, scratch: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """``interlock console`` serving ``db`` with no key; the process, its base URL and the
    seconds it took to print its line."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("INTERLOCK_API_KEY", "INTERLOCK_API_KEYS_FILE")
    }
    out, err = scratch / "console.out", scratch / "console.err"
    started = time.perf_counter()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "interlock", "console", "--db", str(db), "--port", "0"],
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=scratch,
        )
    try:
        while True:
            line = next(
                (x for x in out.read_text().splitlines() if x.startswith("interlock console:")),
                None,
            )
            if line is not None:
                url = line.split()[2]
                return proc, url.removesuffix("/console"), time.perf_counter() - started
            if proc.poll() is not None:
                raise RuntimeError(
                    f"interlock console exited ({proc.returncode}) before serving: "
                    f"{err.read_text()[-2000:]}"
                )
            if time.perf_counter() - started > 120:
                raise RuntimeError(f"interlock console printed no URL in 120 s: {err.read_text()}")
            time.sleep(0.05)
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # drains and stops
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(client: Any, path: str) -> tuple[float, str]:
    """One GET timed, its body read; a non-200 raises :class:`Non200`."""
    started = time.perf_counter()
    answer = client.get(path)
    took = time.perf_counter() - started
    if answer.status_code != 200:
        raise Non200(f"GET {path}: HTTP {answer.status_code}: {answer.text[:1000]}")
    return took, answer.text


def _pager(page: str) -> str:
    """What a page's pager or queue line says (``page 1 of 2,000 (100,000 runs)``)."""
    found = re.search(r"<span>(page \d[^<]*)</span>", page)
    waiting = re.search(r"<p>([\d,]+ runs? waiting)", page)
    said = [m.group(1) for m in (found, waiting) if m is not None]
    return html.unescape("; ".join(said))


def _replay_says(page: str) -> str:
    found = re.search(r'<div class="notice (?:ok|error)" role="status">(.*?)</div>', page)
    return html.unescape(re.sub(r"<[^>]+>", "", found.group(1))) if found else "(no verdict)"


def _prefix(ids: list[str], around: str) -> tuple[str, int]:
    """The prefix of ``around`` whose count of matching run ids is nearest ten (above one)."""
    best = (around, 1)
    for n in range(len(around) - 1, 0, -1):
        count = sum(1 for i in ids if i.startswith(around[:n]))
        if count > 1 and abs(count - 10) < abs(best[1] - 10):
            best = (around[:n], count)
        if count > 100:
            break
    return best


async def _measure(db: Path, base: str, rounds: int, pid: int) -> dict[str, Any]:
    import httpx

    from interlock.stores import open_store

    store = await open_store(str(db), readonly=True)
    took: dict[str, list[float]] = {}
    facts: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=base, timeout=600) as client:
            requests: list[tuple[str, str]] = []
            for round_ in range(rounds + 1):  # round 0: the cold calls
                started = time.perf_counter()
                records = await store.list_runs()
                took.setdefault("A", []).append(time.perf_counter() - started)
                if round_ == 0:
                    requests = _requests(records, facts)
                for name, path in requests:
                    elapsed, page = _get(client, path)
                    took.setdefault(name, []).append(elapsed)
                    if round_ == 0:
                        facts.setdefault("rss_after_cold", {})[name] = _status(pid)
                        facts.setdefault("bytes", {})[name] = len(page.encode())
                        facts.setdefault("says", {})[name] = (
                            _replay_says(page) if path.endswith("/replay") else _pager(page)
                        )
                print(
                    f"{'cold' if round_ == 0 else f'round {round_}'}: "
                    + ", ".join(f"{k} {v[-1] * 1e3:,.1f} ms" for k, v in took.items()),
                    file=sys.stderr,
                )
    finally:
        await store.aclose()
    return {"took": took, "facts": facts}


def _requests(records: list[Any], facts: dict[str, Any]) -> list[tuple[str, str]]:
    """The requests timed, as (name, path), chosen from the journal's own runs."""
    ids = [r.run_id for r in records]
    newest = sorted(records, key=lambda r: (r.started, r.run_id), reverse=True)
    queue = sorted(
        (r for r in records if r.outcome == "escalated"), key=lambda r: (r.updated, r.run_id)
    )
    if not queue:
        raise RuntimeError("the journal has no escalated run: the queue pages cannot be timed")
    prefix, matching = _prefix(ids, newest[len(newest) // 2].run_id)
    last_page = max(1, math.ceil(len(records) / PAGE_SIZE))
    last_queue = max(1, math.ceil(len(queue) / QUEUE_PAGE_SIZE))
    run = queue[len(queue) // 2]
    quoted = urllib.parse.quote(run.run_id, safe="")
    facts.update(
        runs=len(records),
        outcomes=dict(Counter(r.outcome for r in records)),
        prefix=prefix,
        prefix_matches=matching,
        last_page=last_page,
        last_queue_page=last_queue,
        run=run.run_id,
        run_events=run.seq,
    )
    return [
        ("B", "/v1/runs?limit=50"),
        ("runs", "/console/runs"),
        ("escalated", "/console/runs?outcome=escalated"),
        ("search", f"/console/runs?q={urllib.parse.quote(prefix, safe='')}"),
        ("last", f"/console/runs?page={last_page}"),
        ("queue", "/console/escalations"),
        ("queue_last", f"/console/escalations?page={last_queue}"),
        ("run", f"/console/runs/{quoted}"),
        ("replay", f"/console/runs/{quoted}/replay"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.console", description=__doc__)
    parser.add_argument(
        "--runs", type=int, default=100_000, help="runs of the demo journal built (100,000)"
    )
    parser.add_argument(
        "--db", type=Path, default=None, help="reuse this SQLite journal instead of building one"
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="serve --db itself, not a copy (it must not be held by another process)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="warm calls of each request (5)")
    parser.add_argument("--write", action="store_true", help=f"write the table into {RESULTS}")
    raw_argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw_argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.in_place and args.db is None:
        parser.error("--in-place needs --db")

    import trio

    started = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="interlock-console-bench-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        if args.db is None:
            db, summary, built = _build(args.runs, scratch)
            journal = (
                f"built in this run by `interlock demo --runs {args.runs} --json` "
                f"({built:.0f} s; outcomes {json.dumps(summary.get('outcomes'))})"
            )
        elif args.in_place:
            db = args.db.resolve()
            journal = f"`{db}` as it was, served in place"
        else:
            db, copied = _copy(args.db.resolve(), scratch)
            journal = f"a copy ({copied:.1f} s, SQLite's backup) of `{args.db.resolve()}`"
        size = db.stat().st_size
        proc, base, boot = _start_console(db, scratch)
        time.sleep(0.5)  # settled, and still no request
        rss_start = _status(proc.pid)
        print(f"console at {base} in {boot:.1f} s, RSS {rss_start} KiB", file=sys.stderr)
        measured = trio.run(_measure, db, base, args.rounds, proc.pid)
        rss_end = _status(proc.pid)
    except Non200 as exc:
        print(f"non-200 answer (a bug): {exc}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(scratch, ignore_errors=True)

    took, facts = measured["took"], measured["facts"]
    ms = {k: [x * 1e3 for x in v] for k, v in took.items()}
    cold = {k: v[0] for k, v in ms.items()}
    warm = {k: statistics.median(v[1:]) for k, v in ms.items()}
    floor = warm["A"]
    outcomes = facts["outcomes"]
    esc = outcomes.get("escalated", 0)
    says = facts["says"]
    labels = {
        "A": "baseline A: `await store.list_runs()` in process (read-only store)",
        "B": "baseline B: `GET /v1/runs?limit=50` (JSON API)",
        "runs": "`GET /console/runs`",
        "escalated": "`GET /console/runs?outcome=escalated`",
        "search": f"`GET /console/runs?q={facts['prefix']}` ({facts['prefix_matches']} runs)",
        "last": f"`GET /console/runs?page={facts['last_page']}` (the last)",
        "queue": "`GET /console/escalations` (page 1)",
        "queue_last": f"`GET /console/escalations?page={facts['last_queue_page']}` (the last)",
        "run": f"`GET /console/runs/<id>` (an escalated run, {facts['run_events']} events)",
        "replay": "`GET /console/runs/<id>/replay`",
    }
    rows = [
        f"| {labels[k]} | {cold[k]:,.1f} | {warm[k]:,.1f} | {warm[k] / floor:,.3f} |"
        for k in labels
    ]
    grew = rss_end["VmRSS"] - rss_start["VmRSS"]
    after_b, indexed = facts["rss_after_cold"]["B"], facts["rss_after_cold"]["runs"]
    cached = indexed["VmRSS"] - after_b["VmRSS"]

    def mib(kib: float, sign: str = "") -> str:
        return f"{kib / 1024:{sign},.1f} MiB"

    start_peak = ""
    if rss_start["VmHWM"] > 1.5 * rss_start["VmRSS"]:
        start_peak = (
            f" (its peak during start-up, VmHWM, {mib(rss_start['VmHWM'])}: the supervisor "
            "reads `store.escalations()` once at start for the pending-escalations gauge)"
        )
    command = " ".join(["python -m benchmarks.console", *map(shlex.quote, raw_argv)])
    raw = {
        "ms": {k: [round(x, 3) for x in v] for k, v in ms.items()},
        "rss_kib": {"start": rss_start, "end": rss_end},
        "rss_kib_after_each_cold_call": facts["rss_after_cold"],
        "bytes": facts["bytes"],
        "pages_say": says,
        "run": facts["run"],
        "console_start_s": round(boot, 2),
    }
    table = "\n".join(
        [
            SECTION,
            "",
            f"`{command}` ({time.time() - started:.0f} s, {time.strftime('%Y-%m-%d')}, "
            f"{os.cpu_count()} cores, shared host; Python {platform.python_version()}, SQLite "
            f"{sqlite3.sqlite_version}). Journal: {journal}; {size / 2**20:,.0f} MiB, "
            f"{facts['runs']:,} runs ({outcomes.get('completed', 0):,} completed, {esc:,} "
            f"escalated, {outcomes.get('failed', 0):,} failed, "
            f"{outcomes.get('running', 0):,} running). `interlock console --db PATH --port 0` "
            "serves it in a subprocess with no API key; one httpx client (sync, keep-alive) "
            "times each request once cold (the console process's first call; the file is in "
            f"the OS page cache) and then {args.rounds} time{'s' if args.rounds > 1 else ''} warm. Ratio: the warm median "
            "over baseline A's warm median, both measured in this run.",
            "",
            "| request | cold ms | warm median ms | ratio to baseline A |",
            "| :--- | ---: | ---: | ---: |",
            *rows,
            "",
            "The first console page pays the read of the whole runs index (what baseline A "
            "measures, plus sorting it); every later page (filtered, searched, the last) is "
            "served from the console's cached index but still walks all of it in Python (the "
            "filters, the counts by outcome, the machine and reason lists), so a warm page costs "
            "about the same whatever it shows, while the JSON API (baseline B) reads the index "
            "again on every call; a queue page reads the journal for its 20 runs and a run page "
            "for its one run only.",
            "",
            f"Memory of the console process (VmRSS): {mib(rss_start['VmRSS'])} right after "
            f"start, before any request{start_peak}; {mib(after_b['VmRSS'])} after the first "
            f"`/v1/runs` call; {mib(indexed['VmRSS'])} after the first `/console/runs` (the index "
            f"cached: {mib(cached, '+')}, about {cached * 1024 / facts['runs']:,.0f} bytes a run);"
            f" {mib(rss_end['VmRSS'])} after all the requests ({mib(grew, '+')} over the start;"
            f" peak VmHWM {mib(rss_end['VmHWM'])}).",
            "",
            f"What the pages said: the list `{says['runs']}`, the search `{says['search']}`, "
            f"the queue `{says['queue']}`, the replay of `{facts['run']}`: "
            f"`{says['replay']}`.",
            "",
            f"Raw figures: `{json.dumps(raw)}`",
        ]
    )
    print(table)
    if args.write:
        from benchmarks._results import write_section

        write_section(table, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
