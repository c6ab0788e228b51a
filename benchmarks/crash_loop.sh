#!/usr/bin/env bash
# A SIGKILL/resume loop of `interlock demo`: what crash recovery leaves to a human.
#
# Starts the demo (3,000 runs on SQLite), SIGKILLs it 2.5 s in, then starts `interlock resume`
# ten times, killing each 1.2-1.8 s in (a resume that finishes first simply ends), and resumes
# a last time to the end. Prints the outcomes, the escalations by reason, the calls found in
# doubt and how they were reconciled, and the duplicate side effects per downstream table.
#
#   bash benchmarks/crash_loop.sh [DIR]        # DIR defaults to a new temporary directory
#
# Set PYTHONPATH to measure another checkout's src/ (the README's figures compare the commit
# before reconcile with the one that added it).
set -euo pipefail
dir="${1:-$(mktemp -d)}"
mkdir -p "$dir" && cd "$dir" && rm -f j.db j.db-* j-effects.db*
python -m interlock demo --db j.db --runs 3000 >/dev/null 2>&1 & pid=$!
sleep 2.5; kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
for i in 1 2 3 4 5 6 7 8 9 10; do
  python -m interlock resume --db j.db >/dev/null 2>&1 & pid=$!
  sleep "1.$((i % 7 + 1))"; kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
done
python -m interlock resume --db j.db --json > final.json
python - <<'PY'
import collections, json

import trio

from interlock.stores import open_sqlite_store


async def main() -> None:
    store = await open_sqlite_store("j.db")
    records = await store.list_runs()
    print("runs", len(records), dict(collections.Counter(r.outcome for r in records)))
    reasons = collections.Counter(r.reason for r in records if r.outcome == "escalated")
    print("escalated by reason", dict(reasons))
    seen = collections.Counter()
    for record in records:
        for event in await store.load(record.run_id):
            kind = type(event).__name__
            if kind == "ToolInDoubt":
                seen[f"in doubt: {event.tool}"] += 1
            elif kind == "Reconciled":
                seen[f"reconciled: {event.tool} applied={event.applied}"] += 1
            elif kind == "ToolFailed" and event.error.startswith("in doubt"):
                seen[f"escalated in doubt: {event.tool}"] += 1
    for key, count in sorted(seen.items()):
        print(key, count)
    await store.aclose()


trio.run(main)
summary = json.load(open("final.json"))
print("duplicate side effects", {
    tool: counts["duplicates"]
    for row in summary["workflows"].values()
    for tool, counts in row["side_effects"].items()
})
PY
echo "journal: $dir/j.db"
