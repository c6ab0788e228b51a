"""The performance goals of the hot-path issue, as data, checked against one run's figures.

A goal is its text, its target, how it is measured and a short text on what would close a
miss. The texts quote no figures: every figure in the report is computed from the run's
results, so RESULTS.md is the only place figures live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks._harness import top_areas

Results = dict[str, Any]

#: bench_verify's row for the design's floor (decode + guard + repeat hash, nothing else).
MINIMAL_ROW = "decode + guard + repeat hash, nothing else"


@dataclass
class Outcome:
    measured: str
    met: bool | None
    """None: the benchmark did not run, or the configuration was not measured."""
    margin: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Goal:
    key: str
    text: str
    bench: str
    target: float
    how: str
    """Which rows of the benchmark are compared."""
    check: Callable[[Results, float], Outcome]
    closing: str = ""
    """What would close a miss, in a few sentences without figures."""
    profile: str = ""
    """The key of the profile (in the benchmark's results) that explains a miss;
    ``memory`` for the tracemalloc sites of the concurrency benchmark."""


def _missed_by(measured: float, target: float, *, lower_is_better: bool, unit: str = "") -> str:
    if lower_is_better:
        return f"{measured / target:.1f}× the target ({measured - target:+,.1f}{unit})"
    return f"{target / measured:.1f}× short ({measured:,.0f}{unit} of {target:,.0f}{unit})"


def _counted_row(results: Results, label: str) -> dict[str, Any] | None:
    """The instruction-count row of ``label``, if that section ran and counted it."""
    section = results.get("instructions") or {}
    row = next((r for r in section.get("rows", []) if r["label"] == label), None)
    return row if row is not None and row["ratio"] is not None else None


def _counted(results: Results, label: str) -> list[str]:
    """The note quoting the instruction count of ``label``, if that section ran."""
    row = _counted_row(results, label)
    if row is None:
        return []
    return [
        f"Counted in instructions (cachegrind, no timing noise): "
        f"{row['instructions'] / 1000:.1f}k per {row['unit']}, {row['ratio']:.2f}× {row['baseline']}."
    ]


def _areas(results: Results, bench: str) -> list[str]:
    areas = results[bench].get("profile_areas")
    return [f"Own time by area: {top_areas(areas)}."] if areas else []


def _transition_speed(results: Results, target: float) -> Outcome:
    ns = results["transition"]["rows"]["compiled"]["ns"]
    met = ns < target
    return Outcome(
        f"{ns:.0f} ns per check (one Python call)",
        met,
        "" if met else _missed_by(ns, target, lower_is_better=True, unit=" ns"),
    )


def _transition_ratio(results: Results, target: float) -> Outcome:
    from benchmarks.bench_transition import C_CALL

    rows = results["transition"]["rows"]
    per_call = rows["pure Python"]["ns"] / rows["compiled"]["ns"]
    compiled_net = rows["compiled"]["net_ns"]
    net = (
        f"{rows['pure Python']['net_ns'] / compiled_net:.0f}× net of the call"
        if compiled_net > 0
        else "the compiled check's net cost is below the timer's resolution"
    )
    met = per_call >= target
    return Outcome(
        f"{per_call:.1f}× per call; {net} ({rows[C_CALL]['ns']:.0f} ns for a C call doing nothing)",
        met,
        "" if met else f"{target / per_call:.1f}× short per call",
    )


def _verify_floor(results: Results, target: float) -> Outcome:
    rows = results["verify"]["rows"]
    gate = rows["interlock, compiled"]["us"]
    floor = rows["msgspec decoding alone"]["us"]
    value = gate / floor
    met = value <= target
    notes = _counted(results, "interlock gate (compiled)")
    minimal = rows.get(MINIMAL_ROW)
    if not met and minimal is not None:
        notes.append(
            f"The design's own floor ({MINIMAL_ROW}): {minimal['us']:.2f} µs, "
            f"{minimal['us'] / floor:.2f}× msgspec alone."
        )
    return Outcome(
        f"{gate:.2f} µs vs {floor:.2f} µs: {value:.2f}× msgspec alone",
        met,
        ""
        if met
        else f"{value / target:.1f}× over the {target}× allowance ({gate - target * floor:+.2f} µs per proposal)",
        notes + ([] if met else _areas(results, "verify")),
    )


def _verify_pydantic(results: Results, target: float) -> Outcome:
    rows = results["verify"]["rows"]
    gate = rows["interlock, compiled"]["us"]
    by_hand = rows["pydantic v2 by hand"]["us"]
    value = by_hand / gate
    met = value >= target * 0.9  # "about 3x": within 10%
    return Outcome(
        f"pydantic {by_hand:.2f} µs ÷ gate {gate:.2f} µs = {value:.2f}× "
        f"(msgspec alone is {by_hand / rows['msgspec decoding alone']['us']:.2f}× faster than pydantic)",
        met,
        "" if met else f"{target / value:.1f}× short of {target:.0f}×",
    )


def _loop(results: Results, target: float) -> Outcome:
    from benchmarks.bench_loop import find

    loop = results["loop"]
    value = find(loop, "interlock, concurrent")["us_per_step"]
    met = value < target
    both = find(loop, "interlock, concurrent, prompt-free provider, tuned gc")["us_per_step"]
    notes = _counted(results, "interlock loop, concurrent")
    if not met:
        prompt_free = find(loop, "interlock, concurrent, prompt-free provider")["us_per_step"]
        tuned = find(loop, "interlock, concurrent, tuned gc")["us_per_step"]
        plain = find(loop, "plain Python: msgspec parse + validate + append")["us_per_step"]
        notes.append(
            f"Variants: prompt-free provider {prompt_free:.0f} µs, tuned collector {tuned:.0f} µs, "
            f"both {both:.0f} µs; the plain loop {plain:.1f} µs."
        )
        switches = next((r for r in loop["rows"] if r.get("kind") == "floor"), None)
        if switches is not None:
            notes.append(
                f"Trio's scheduler alone (the same two task switches per step, nothing else): "
                f"{switches['us_per_step']:.1f} µs per step."
            )
        notes += _areas(results, "loop")
    return Outcome(
        f"{value:.0f} µs per step batched ({find(loop, 'interlock, sequential')['us_per_step']:.0f} µs "
        f"one run at a time; {both:.0f} µs with a prompt-free provider and the tuned collector)",
        met,
        "" if met else _missed_by(value, target, lower_is_better=True, unit=" µs"),
        notes,
    )


def _goal_size(results: Results) -> int:
    sizes = results["concurrency"]["sizes"]
    return 10_000 if 10_000 in sizes else sizes[-1]


def _concurrency(baseline: str) -> Callable[[Results, float], Outcome]:
    def check(results: Results, target: float) -> Outcome:
        from benchmarks.bench_concurrency import find

        conc = results["concurrency"]
        size = _goal_size(results)
        shipped = find(conc, "interlock", size)
        bare = find(conc, baseline, size)
        if shipped is None or bare is None:
            return Outcome("not measured at this size", None)
        value = shipped["wall_s"] / bare["wall_s"]
        met = value <= target
        notes = [
            f"CPU: {shipped['cpu_s']:.1f} s vs {bare['cpu_s']:.1f} s ({shipped['cpu_s'] / bare['cpu_s']:.1f}×)."
        ]
        if shipped["cpu_s"]:
            notes.append(
                f"The collector: {shipped['gc_s'] / shipped['cpu_s']:.0%} of the CPU time."
            )
        for label in ("interlock, tuned gc", "interlock, MemoryStore, tuned gc"):
            row = find(conc, label, size)
            if row is not None:
                notes.append(
                    f"{label}: {row['wall_s']:.1f} s wall ({row['wall_s'] / bare['wall_s']:.1f}× "
                    f"{baseline}), {row['cpu_s']:.1f} s CPU."
                )
        return Outcome(
            f"{size:,} runs: {shipped['wall_s']:.1f} s vs {baseline} {bare['wall_s']:.1f} s ({value:.1f}×)",
            met,
            "" if met else _margin(value, target, baseline),
            notes + ([] if met else _areas(results, "concurrency")),
        )

    return check


def _margin(value: float, target: float, baseline: str) -> str:
    if target == 1:
        return f"{value:.1f}× the {baseline} wall time"
    return f"{value / target:.1f}× over the {target}× allowance"


def _memory_sites(results: Results) -> list[dict[str, Any]]:
    memory = results["concurrency"].get("memory_profile") or {}
    return [
        {
            "function": site["site"],
            "calls": 0,
            "own_s": 0.0,
            "cum_s": 0.0,
            "own_share": site["share"],
        }
        for site in memory.get("sites", [])
    ]


def _memory(results: Results, target: float) -> Outcome:
    from benchmarks.bench_concurrency import find

    conc = results["concurrency"]
    sizes = conc["sizes"]
    size = 100_000 if 100_000 in sizes else sizes[-1]
    row = find(conc, "interlock, tuned gc", size) or find(conc, "interlock", size)
    if row is None:
        return Outcome("not measured", None)
    peak_gib = row["peak_rss_mib"] / 1024
    met = peak_gib < target if size == 100_000 else None
    return Outcome(
        f"{size:,} runs completed ({row.get('completed', '?'):,}): peak RSS {peak_gib:.2f} GiB, "
        f"{row['rss_per_run_kib']:.0f} KiB per run (the journal, "
        f"{row.get('journal_mib', 0) * 1024 / size:.0f} KiB per run, is in the SQLite file)",
        met,
        ""
        if met or met is None
        else f"{peak_gib / target:.1f}× the {target:.0f} GiB limit (+{peak_gib - target:.2f} GiB)",
    )


def _journal(sync: str) -> Callable[[Results, float], Outcome]:
    def check(results: Results, target: float) -> Outcome:
        rows = [
            r
            for r in results["journal"]["rows"]
            if r["store"] == "SQLite store" and r["sync"] == sync and r.get("mix", "real") == "real"
        ]
        best = max(rows, key=lambda r: r["events_per_s"])
        small = [
            r["events_per_s"]
            for r in results["journal"]["rows"]
            if r["store"] == "SQLite store" and r["sync"] == sync and r.get("mix") == "small"
        ]
        met = best["events_per_s"] >= target
        notes = [f"with small (prompt-free) events: {max(small):,.0f} events/s."] if small else []
        return Outcome(
            f"{best['events_per_s']:,.0f} events/s (best batch size: {best['batch']:,})",
            met,
            ""
            if met
            else _missed_by(best["events_per_s"], target, lower_is_better=False, unit="/s"),
            notes + ([] if met else _areas(results, "journal")),
        )

    return check


def _pg_group_commit(results: Results, target: float) -> Outcome:
    rows = results["scaleout"].get("throughput") or []
    if not rows:
        return Outcome("not measured", None)
    fewest = min(rows, key=lambda r: r["events_per_transaction"])
    value = fewest["events_per_transaction"]
    met = value > target
    return Outcome(
        f"{value:,.1f} events per transaction (the fewest, {fewest['workers']} worker(s))",
        met,
        "" if met else f"{value:,.2f} events per transaction: one commit per event",
    )


def _providers(results: Results, target: float) -> Outcome:
    from benchmarks.bench_providers import HTTP_CHAT, SIMULATED, find, split

    section = results["providers"]
    simulated = find(section, SIMULATED)
    http = find(section, HTTP_CHAT)
    if simulated is None or http is None:
        return Outcome("not measured", None)
    added = http["added_share"]
    met = added < target
    notes = [
        f"{row['label']}: {row['cpu_us_per_step']:.0f} µs per step, {row['added_share']:+.0%}."
        for row in section["rows"]
        if row["label"] not in (SIMULATED, http["label"])
    ]
    parts = split(section)
    if parts is not None:
        base = parts["simulated"]
        bodies = parts["bodies"]
        notes.append(
            f"Of the {parts['added']:.0f} µs added per step: the floor (the same bytes over a "
            f"bare keep-alive socket, no HTTP library) {parts['floor']:.0f} µs "
            f"({parts['floor'] / base:+.0%} on its own); the transport over that floor "
            f"{parts['transport']:.0f} µs ({parts['transport'] / base:+.0%}); the provider's own "
            f"code {parts['code']:.0f} µs ({parts['code'] / base:+.0%})"
            + (
                f"; journaling the exact bodies {bodies:.0f} µs ({bodies / base:+.0%})."
                if bodies == bodies
                else " (with the journaling of the exact bodies)."
            )
        )
    return Outcome(
        f"{http['runs']:,} runs: {http['cpu_us_per_step']:.0f} µs of CPU per step over HTTP vs "
        f"{simulated['cpu_us_per_step']:.0f} µs simulated ({added:+.0%})",
        met,
        ""
        if met
        else f"{added / target:.1f}× the allowance ({http['added_us_per_step']:+.0f} µs per step)",
        notes + ([] if met else _areas(results, "providers")),
    )


def _gateway_single(results: Results, target: float) -> Outcome:
    section = results["gateway"]
    share = section.get("share_of_ceiling_cpu")
    if share is None:
        return Outcome("not measured", None)
    met = share >= target
    return Outcome(
        f"{share:.2f} of hypercorn's bare ceiling per server CPU second "
        f"({section['share_of_ceiling']:.2f} in requests/s), {section['connections']} "
        "keep-alive connections",
        met,
        "" if met else _missed_by(share, target, lower_is_better=False),
        [f"Rounds (per CPU s): {', '.join(f'{r:.2f}' for r in section.get('ratios', []))}."]
        if section.get("ratios") and all(isinstance(r, float) for r in section["ratios"])
        else [],
    )


def _gateway_throughput(results: Results, target: float) -> Outcome:
    section = results["gateway"]
    rows = [r for r in section["rows"] if r.get("kind") in ("verify", "channel")]
    if not rows:
        return Outcome("not measured", None)
    best = max(rows, key=lambda r: r["items_per_server_cpu_s"])
    rate = best["items_per_server_cpu_s"]
    floor = next((r for r in section["rows"] if r.get("kind") == "inprocess"), None)
    met = rate >= target
    notes = []
    if floor is not None:
        notes.append(
            f"The same proposals through `Supervisor.submit` in process, no HTTP: "
            f"{floor['items_per_server_cpu_s']:,.0f} per CPU second; the best gateway path is "
            f"{rate / floor['items_per_server_cpu_s']:.2f} of that."
        )
    if section.get("split_note"):
        notes.append(section["split_note"])
    return Outcome(
        f"{rate:,.0f} verified, journaled proposals per server CPU second ({best['label']})",
        met,
        "" if met else _missed_by(rate, target, lower_is_better=False),
        notes + ([] if met else _areas(results, "gateway")),
    )


# -- the peers' workloads (issue 19) ---------------------------------------------------------


#: bench_peers' run length (imported lazily elsewhere; a constant here for the notes).
STEPS_PER_RUN = 20


def _peer_runs(results: Results) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The latest run of the peers section and the first one (``before``), if it differs."""
    section = results["peers"]
    runs = section.get("runs") or [section]
    return runs[-1], (runs[0] if len(runs) > 1 else None)


def _before(run: dict[str, Any] | None, text: str) -> list[str]:
    if run is None:
        return []
    return [f"Before ({run.get('label') or 'first run'}, `{run['git']['commit']}`): {text}."]


def _peers_memory_vs_burr(results: Results, target: float) -> Outcome:
    from benchmarks.bench_peers import BURR, CALL_AND_MOVE, INTERLOCK, PLAIN, find

    def figures(run: dict[str, Any]) -> tuple[float, float | None, float]:
        shipped = find(run["memory"], INTERLOCK)["us_per_step"]
        burr = find(run["memory"], BURR)
        plain = find(run["memory"], PLAIN)["us_per_step"]
        return shipped, burr["us_per_step"] if burr else None, plain

    run, first = _peer_runs(results)
    shipped, burr, plain = figures(run)
    if burr is None:
        return Outcome(
            f"{shipped:.0f} µs per step; Burr not measured (not installed)",
            None,
            notes=[f"Plain-Python loop: {plain:.1f} µs per step ({shipped / plain:.0f}×)."],
        )
    value = shipped / burr
    met = value <= target
    notes = [
        f"The plain-Python loop ratio this implies: at most {target * burr / plain:.0f}× the plain "
        f"loop's {plain:.1f} µs; interlock is at {shipped / plain:.0f}×, Burr at {burr / plain:.0f}×."
    ]
    moved = find(run["memory"], CALL_AND_MOVE)
    if moved is not None:
        notes.append(
            f"With call-and-move proposals (20 tool calls, the last moving to DONE): "
            f"{moved['us_per_step']:.0f} µs per step, {moved['us_per_step'] / burr:.2f}× Burr."
        )
    if first is not None:
        s0, b0, _p0 = figures(first)
        notes += _before(
            first, f"{s0:.0f} µs vs Burr {b0:.0f} µs, {s0 / b0:.2f}×" if b0 else f"{s0:.0f} µs"
        )
    if not met and run.get("profile_areas"):
        notes.append(f"Own time by area: {top_areas(run['profile_areas'])}.")
    return Outcome(
        f"{shipped:.0f} µs vs Burr {burr:.0f} µs per step: {value:.2f}× Burr",
        met,
        ""
        if met
        else f"{value / target:.1f}× over the {target}× allowance ({shipped - target * burr:+.0f} µs per step)",
        notes,
    )


def _peers_loop_target(results: Results, target: float) -> Outcome:
    from benchmarks.bench_peers import INTERLOCK, find

    run, first = _peer_runs(results)
    value = find(run["memory"], INTERLOCK)["us_per_step"]
    met = value <= target
    notes = []
    if first is not None:
        notes += _before(
            first, f"{find(first['memory'], INTERLOCK)['us_per_step']:.0f} µs per step"
        )
    return Outcome(
        f"{value:.0f} µs per step, one run at a time",
        met,
        "" if met else _missed_by(value, target, lower_is_better=True, unit=" µs"),
        notes,
    )


def _peers_fsyncs(results: Results, target: float) -> Outcome:
    run, first = _peer_runs(results)

    def per_kind(r: dict[str, Any]) -> dict[str, float | None]:
        return {row["tool"]: row.get("fsyncs_per_step") for row in r["durable"] if row["tool"]}

    kinds = per_kind(run)
    covered = {k: v for k, v in kinds.items() if k in ("read-only", "idempotent")}
    if not covered or any(v is None for v in covered.values()):
        return Outcome("fsyncs not counted (no strace)", None)
    worst = max(covered.values())
    met = worst <= target
    measured = "; ".join(f"{k} {v:.2f}" for k, v in kinds.items() if v is not None)
    notes = [
        "The store's flushes per step: "
        + "; ".join(
            f"{row['tool']} {row['flushes_per_step']:.2f}" for row in run["durable"] if row["tool"]
        )
        + "."
    ]
    notes.append(
        f"Per {STEPS_PER_RUN}-step run (the run's start is flushed once per run, not per step): "
        + "; ".join(
            f"{k} {v * STEPS_PER_RUN:.1f} fsyncs" for k, v in kinds.items() if v is not None
        )
        + "."
    )
    if first is not None:
        before = per_kind(first)
        notes += _before(
            first, "; ".join(f"{k} {v:.2f}" for k, v in before.items() if v is not None)
        )
    return Outcome(
        f"fsyncs per step: {measured}",
        met,
        "" if met else f"{worst:.2f} fsyncs per step, {worst / target:.1f}× the one allowed",
        notes,
    )


def _peers_durable_rate(results: Results, target: float) -> Outcome:
    from benchmarks.bench_peers import BURR_SQLITE, BURR_SQLITE_WAL, find

    run, first = _peer_runs(results)

    def burr_best(r: dict[str, Any]) -> dict[str, Any] | None:
        rows = [
            row
            for row in (find(r["durable"], BURR_SQLITE), find(r["durable"], BURR_SQLITE_WAL))
            if row
        ]
        return max(rows, key=lambda row: row["steps_per_s"]) if rows else None

    burr = burr_best(run)
    if burr is None:
        return Outcome("Burr not measured (not installed)", None)
    rows = [row for row in run["durable"] if row["tool"] in ("read-only", "idempotent")]
    slowest = min(rows, key=lambda r: r["steps_per_s"])
    value = slowest["steps_per_s"] / burr["steps_per_s"]
    met = value >= target
    notes = [
        f"{row['label']}: {row['steps_per_s']:,.0f} steps/s ({row['steps_per_s'] / burr['steps_per_s']:.2f}× "
        f"Burr's best), {row.get('fsyncs_per_step', float('nan')):.2f} fsyncs per step."
        for row in run["durable"]
        if row["tool"]
    ]
    notes += [
        f"{row['label']}: {row['steps_per_s']:,.0f} steps/s, "
        f"{row.get('fsyncs_per_step', float('nan')):.2f} fsyncs per step."
        for row in run["durable"]
        if not row["tool"]
    ]
    if first is not None:
        b = burr_best(first)
        notes += _before(
            first,
            "; ".join(f"{r['tool']} {r['steps_per_s']:,.0f}" for r in first["durable"] if r["tool"])
            + (f" steps/s vs Burr's best {b['steps_per_s']:,.0f}" if b else ""),
        )
    if not met and run.get("profile_durable_areas"):
        notes.append(
            f"Own time by area (idempotent tool): {top_areas(run['profile_durable_areas'])}."
        )
    return Outcome(
        f"{slowest['steps_per_s']:,.0f} steps/s ({slowest['tool']} tool, the slower of read-only and "
        f"idempotent) vs Burr {burr['steps_per_s']:,.0f} ({burr['label'].removeprefix('Burr, ')}): {value:.2f}×",
        met,
        ""
        if met
        else _missed_by(
            slowest["steps_per_s"], burr["steps_per_s"], lower_is_better=False, unit="/s"
        ),
        notes,
    )


def _peers_concurrency(results: Results, target: float) -> Outcome:
    from benchmarks.bench_peers import conc

    run, first = _peer_runs(results)
    size = 10_000 if conc(run, "interlock", 10_000) else min(r["runs"] for r in run["concurrency"])

    def ratio_at(r: dict[str, Any], n: int) -> float | None:
        shipped, bare = conc(r, "interlock", n), conc(r, "bare trio", n)
        return shipped["wall_s"] / bare["wall_s"] if shipped and bare else None

    value = ratio_at(run, size)
    if value is None:
        return Outcome("not measured", None)
    shipped, bare = conc(run, "interlock", size), conc(run, "bare trio", size)
    met = value <= target if size == 10_000 else None
    notes = [
        f"CPU: {shipped['cpu_s']:.1f} s vs {bare['cpu_s']:.1f} s ({shipped['cpu_s'] / bare['cpu_s']:.1f}×)."
    ]
    big = ratio_at(run, 100_000)
    if big is not None:
        notes.append(f"100,000 runs: {big:.2f}× bare trio's wall time.")
    if first is not None and ratio_at(first, size) is not None:
        notes += _before(first, f"{ratio_at(first, size):.2f}× at {size:,} runs")
    return Outcome(
        f"{size:,} runs: {shipped['wall_s']:.1f} s vs bare trio {bare['wall_s']:.1f} s ({value:.2f}×)",
        met,
        "" if met or met is None else _margin(value, target, "bare trio"),
        notes,
    )


def _peers_memory(results: Results, target: float) -> Outcome:
    from benchmarks.bench_peers import conc

    run, first = _peer_runs(results)
    row = conc(run, "interlock", 100_000)
    if row is None:
        return Outcome("100,000 runs not measured (quick run)", None)
    bare = conc(run, "bare trio", 100_000)
    gib = row["peak_rss_mib"] / 1024
    met = gib < target
    notes = (
        [
            f"Bare trio: {bare['peak_rss_mib'] / 1024:.2f} GiB ({gib * 1024 / bare['peak_rss_mib']:.1f}×)."
        ]
        if bare
        else []
    )
    if first is not None and conc(first, "interlock", 100_000):
        notes += _before(
            first, f"{conc(first, 'interlock', 100_000)['peak_rss_mib'] / 1024:.2f} GiB"
        )
    return Outcome(
        f"100,000 runs ({row.get('completed') or 0:,} completed): peak RSS {gib:.2f} GiB",
        met,
        "" if met else f"{gib / target:.2f}× the {target} GiB limit (+{gib - target:.2f} GiB)",
        notes,
    )


def _peers_instructions(results: Results, target: float) -> Outcome:
    from benchmarks.bench_peers import BURR, INTERLOCK, PLAIN, find

    run, first = _peer_runs(results)
    if not run["instructions"]:
        return Outcome("not counted (quick run, or no valgrind)", None)

    def text(r: dict[str, Any]) -> str:
        rows = {label: find(r["instructions"], label) for label in (INTERLOCK, BURR, PLAIN)}
        return ", ".join(
            f"{label} {row['per_step'] / 1000:.0f}k"
            for label, row in rows.items()
            if row is not None
        )

    notes = _before(first, text(first)) if first is not None and first["instructions"] else []
    return Outcome(f"instructions per step: {text(run)}", True, "", notes)


_TRANSITION_CLOSING = (
    "Per call, the ratio is bounded by the Python-level call into C (the empty C call row), not "
    "by the check; net of the call the compiled check is far ahead. A batch form checking a "
    "whole supervisor batch in one call would close it."
)
_VERIFY_CLOSING = (
    "The gate as a step runs it is compiled now (ext/_decide.pyx: budgets, the single-decode "
    "path, the guard, the canonical hash, the repeat count and the circuit in one call, the "
    "Python gate only for what it rejects). What is left over msgspec's decode is the guard, "
    "a Python function called with a `RunView`, the exact-reading scan and the args' "
    "canonical encoding and its hash: closing the rest needs guards that can be compiled "
    "(declared comparisons such as `amount <= inputs.total`)."
)
_LOOP_CLOSING = (
    "The decide path is compiled (ext/_decide.pyx: the run's typed state and its fold, the "
    "accepted call verified and its events built, the commit, the events encoded and framed), "
    "and a memory store's write happens in the run's own task. What remains is per-step "
    "machinery spread thin over Python functions of a few µs each: trio's scheduler (a "
    "checkpoint per proposal and per model call), the actor's loop (the model call's timeout "
    "entry, the tool's context and timeout), the provider's prompt rendering and hash, the "
    "stats counters and the store's bookkeeping. No single function is worth compiling alone; "
    "closing it needs the actor's loop compiled with them, or several steps of a run decided "
    "per task switch."
)
_CONCURRENCY_CLOSING = (
    "Every interlock row journals to a SQLite file, so the runtime's work includes the disk. "
    "Outside the collector, what remains is the loop goal's per-step work: a bare run wakes "
    "once per step, an interlock run twice (the model call, the verdict), and verifies and "
    "journals. It needs the loop goal's different shape."
)
_MEMORY_CLOSING = (
    "A run's live state (its task, the committed results, one history frame per step, the last "
    "whole prompt) grows with every step; for much longer runs, keep a bounded window in memory "
    "and read older entries from the journal."
)
_PROVIDERS_CLOSING = (
    "Not on loopback under trio: the floor row (the simulated provider plus one exchange of "
    "the very same bytes over a bare keep-alive socket, no HTTP library) alone adds several "
    "times the 10% allowance, in trio's wait for the socket (a park, an epoll registration "
    "and a wake per exchange), the kernel's loopback and the queue for the in-flight limit. "
    "Over that floor the notes split the rest three ways. The transport's share is its "
    "Python per exchange, spread thin (the response head's parse, the deadline, the idle "
    "check, the request head, the coroutine frames): only compiled code for the exchange "
    "would cut it much further. The provider's own code (the request body joined from parts "
    "kept on the view, the exact read) is a few dozen Python calls a step. Journaling the "
    "exact bodies is the journal's work (hashing, the delta against the previous request, "
    "encoding), not the provider's. Against a real API, whose calls take hundreds of "
    "milliseconds, the same microseconds are a far smaller share of a step."
)
_GATEWAY_CLOSING = (
    "The transport is not what is missing: batches and the channel run at nearly the rate "
    "of the same proposals submitted in process with no HTTP. The rest is the supervisor's "
    "own cost per proposal (the decide path, compiled now, the stats counters, the journal) "
    "and the gateway service's batch settling."
)
_GATEWAY_THROUGHPUT_CLOSING = (
    "Measured by parts (the split in the notes): the SQLite journal's writer thread (a "
    "chunk INSERT per run and batch, one row of pending index moves per batch, the COMMIT, "
    "the moves applied to the runs index every few seconds) and the checkpoint thread; on "
    "the main thread the decide path (ext/_decide.pyx: a batch decided by one compiled "
    "loop, its counters added up in C), each batch's encoding and framing, the gateway's "
    "own code (the service's loop and settling, the verdicts encoded) and hypercorn. Since "
    "schema version 6 the index is not updated per run and batch (the largest cost before: "
    "16 bound parameters an UPDATE); counted with cachegrind, the batch path went from "
    "131,792 to 85,261 instructions per proposal in the session that made it "
    "(benchmarks/gateway_instructions.md). What is left is spread thin: a chunk row per run "
    "and batch (a row per batch would need a new layout of the journal), the fold of each "
    "proposal into its run's state (history frames, data), and Python per proposal in the "
    "service's loops."
)
_JOURNAL_CLOSING = (
    "The store writes one row per run per batch and updates the runs index from each run's last "
    "event; the journal section compares it with the SQLite ceiling and one commit per event."
)
_PG_GROUP_COMMIT_CLOSING = (
    "Each worker's supervisor writes every step its runs took since the last flush in one "
    "fenced transaction; one event per transaction means it flushes per event: check that "
    "the journal writer batches on PostgreSQL as it does on SQLite."
)

_PEERS_MEMORY_CLOSING = (
    "One run at a time nothing is batched, so every step pays the whole per-step machinery: "
    "the decide path is compiled now (the twin row shows what that saved) and a memory "
    "store's write no longer hops to the writer task; what is left is spread thin (see the "
    "loop goal): trio's checkpoints, the actor's loop, the provider's prompt, the counters. "
    "A call that names its next state saves the model call of the move, which a scripted "
    "model does not show."
)
_PEERS_DURABLE_CLOSING = (
    "Each flush is one fsync with synchronous=FULL; the intent flushed before the tool runs is "
    "what a read-only or idempotent tool does not need (the issue's first part: its intent "
    "shares the flush of its commit, and the commit, the move and the next call's record "
    "share one)."
)
_PEERS_CONCURRENCY_CLOSING = (
    "As for the concurrency goals: the per-step work of a run (two wake-ups, the decide path, "
    "the journal) over bare trio's one sleep per step; the collector's share is in the "
    "concurrency section."
)

GOALS: tuple[Goal, ...] = (
    Goal(
        "transition_speed",
        "Transition check on the compiled tables under 100 ns",
        "transition",
        100,
        "the compiled check's ns per call",
        _transition_speed,
        _TRANSITION_CLOSING,
    ),
    Goal(
        "transition_ratio",
        "Transition check at least 5× faster than the pure twin",
        "transition",
        5,
        "pure twin ÷ compiled, ns per call",
        _transition_ratio,
        _TRANSITION_CLOSING,
    ),
    Goal(
        "verify_floor",
        "Full verification of the five-field call with a guard within 1.3× of msgspec decoding alone",
        "verify",
        1.3,
        "the compiled gate as a step runs it ÷ msgspec decoding alone, µs per proposal",
        _verify_floor,
        _VERIFY_CLOSING,
        "profile",
    ),
    Goal(
        "verify_pydantic",
        "…which is about 3× faster than the hand-written pydantic version",
        "verify",
        3,
        "pydantic v2 by hand ÷ the compiled gate as a step runs it, µs per proposal; within 10% counts",
        _verify_pydantic,
        _VERIFY_CLOSING,
        "profile",
    ),
    Goal(
        "loop",
        "Loop overhead under 20 µs per step, batched journal append included",
        "loop",
        20,
        "µs per step of concurrent runs against a scripted provider",
        _loop,
        _LOOP_CLOSING,
        "profile",
    ),
    Goal(
        "concurrency_trio",
        "10,000 concurrent runs (full loop): wall time no more than bare trio doing only the sleeps",
        "concurrency",
        1,
        "wall time of interlock ÷ bare trio at 10,000 runs",
        _concurrency("bare trio"),
        _CONCURRENCY_CLOSING,
        "profile",
    ),
    Goal(
        "concurrency_asyncio",
        "10,000 concurrent runs: within 1.5× of the same sleeps on bare asyncio",
        "concurrency",
        1.5,
        "wall time of interlock ÷ bare asyncio at 10,000 runs",
        _concurrency("bare asyncio"),
        _CONCURRENCY_CLOSING,
        "profile",
    ),
    Goal(
        "memory",
        "100,000 concurrent runs complete in one process with peak RSS under 2 GiB",
        "concurrency",
        2,
        "peak RSS in GiB of 100,000 concurrent runs",
        _memory,
        _MEMORY_CLOSING,
        "memory",
    ),
    Goal(
        "sqlite_normal",
        "SQLite group commit: at least 200,000 events/s with synchronous=NORMAL",
        "journal",
        200_000,
        "events/s of the SQLite store at its best batch size, a real run's events",
        _journal("NORMAL"),
        _JOURNAL_CLOSING,
        "profile",
    ),
    Goal(
        "sqlite_full",
        "SQLite group commit: at least 100,000 events/s with synchronous=FULL",
        "journal",
        100_000,
        "events/s of the SQLite store at its best batch size, a real run's events",
        _journal("FULL"),
        _JOURNAL_CLOSING,
        "profile",
    ),
    Goal(
        "providers",
        "The provider layer adds under 10% to a step's CPU (10,000 concurrent runs, loopback HTTP)",
        "providers",
        0.10,
        "CPU per step of the runtime process, OpenAIChat against the fake server ÷ the "
        "simulated provider answering the same proposals, minus one",
        _providers,
        _PROVIDERS_CLOSING,
        "profile",
    ),
    Goal(
        "gateway_single",
        "The gateway: single HTTP proposals at 0.7 of the server's bare ceiling or better",
        "gateway",
        0.7,
        "verified proposals per second of the gateway's CPU ÷ requests per second of "
        "hypercorn's CPU serving a bare endpoint, the same load generator",
        _gateway_single,
        _GATEWAY_CLOSING,
        "profile",
    ),
    Goal(
        "gateway_throughput",
        "The gateway: 50,000 verified, journaled proposals/s or more per core in batches and "
        "on the streaming channel",
        "gateway",
        50_000,
        "the best of POST /v1/verify batches and the channel, per second of server CPU",
        _gateway_throughput,
        _GATEWAY_THROUGHPUT_CLOSING,
        "profile",
    ),
    Goal(
        "pg_group_commit",
        "PostgreSQL group commit under workers: batches, not one row per event",
        "scaleout",
        1,
        "events the workers wrote ÷ the PostgreSQL transactions that wrote them (distinct "
        "xmin), the fewest of the throughput rows; more than one is met",
        _pg_group_commit,
        _PG_GROUP_COMMIT_CLOSING,
    ),
    Goal(
        "peers_memory",
        "Peers: one run at a time, in memory, at most 0.5× Burr's µs per step (the 20-step script)",
        "peers",
        0.5,
        "interlock's µs per step ÷ Burr's, in-memory state, one run at a time, same run",
        _peers_memory_vs_burr,
        _PEERS_MEMORY_CLOSING,
        "profile",
    ),
    Goal(
        "peers_loop_target",
        "Peers: one run at a time, in memory, at most 20 µs per step (the loop goal, the target)",
        "peers",
        20,
        "interlock's µs per step, one run at a time, MemoryStore",
        _peers_loop_target,
        _PEERS_MEMORY_CLOSING,
        "profile",
    ),
    Goal(
        "peers_fsyncs",
        "Peers: durable in SQLite (synchronous=FULL), at most one fsync per step for read-only "
        "and idempotent tools",
        "peers",
        1,
        "fsync + fdatasync calls (strace -f -c) per step, two sizes differenced",
        _peers_fsyncs,
        _PEERS_DURABLE_CLOSING,
        "profile_durable",
    ),
    Goal(
        "peers_durable_rate",
        "Peers: durable in SQLite (synchronous=FULL), at least Burr's steps/s with its SQLite persister",
        "peers",
        1,
        "interlock's steps/s (the slower of read-only and idempotent tools) ÷ Burr's with "
        "SQLitePersister, the faster of its two connections (rollback journal, WAL), "
        "synchronous=FULL, one run at a time",
        _peers_durable_rate,
        _PEERS_DURABLE_CLOSING,
        "profile_durable",
    ),
    Goal(
        "peers_concurrency",
        "Peers: 10,000 concurrent runs at most 1.3× bare trio's wall time",
        "peers",
        1.3,
        "wall time of interlock ÷ bare trio doing only the sleeps, 10,000 runs",
        _peers_concurrency,
        _PEERS_CONCURRENCY_CLOSING,
    ),
    Goal(
        "peers_memory_100k",
        "Peers: 100,000 concurrent runs under 1.5 GiB peak RSS",
        "peers",
        1.5,
        "peak RSS (VmHWM) in GiB of 100,000 concurrent runs",
        _peers_memory,
        _MEMORY_CLOSING,
    ),
    Goal(
        "peers_instructions",
        "Peers: instructions per step (cachegrind) reported before and after each change",
        "peers",
        0,
        "cachegrind I refs per step, one run at a time in memory, two sizes differenced",
        _peers_instructions,
    ),
)


def evaluate(results: Results) -> list[dict[str, Any]]:
    """Every goal whose benchmark ran, with its outcome, closing text and profile rows."""
    evaluated = []
    for goal in GOALS:
        if goal.bench not in results or "error" in results[goal.bench]:
            continue
        outcome = goal.check(results, goal.target)
        entry: dict[str, Any] = {
            "key": goal.key,
            "goal": goal.text,
            "bench": goal.bench,
            "target": goal.target,
            "how": goal.how,
            "measured": outcome.measured,
            "met": outcome.met,
            "margin": outcome.margin,
            "notes": outcome.notes,
        }
        if outcome.met is False:
            entry["closing"] = goal.closing
            if goal.profile == "memory":
                entry["profile"] = _memory_sites(results)
                entry["profile_label"] = "tracemalloc, live memory half-way through, top sites"
            elif goal.profile:
                entry["profile"] = results[goal.bench].get(goal.profile, [])
                entry["profile_label"] = "cProfile, own time, top functions"
        evaluated.append(entry)
    return evaluated
