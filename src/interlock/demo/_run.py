"""The demo: many concurrent runs of the seed workflows against the chaos provider."""

from __future__ import annotations

import gc
import os
import random
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ..core._exceptions import LifespanError
from ..core._gate import ALREADY_COMMITTED
from ..core._hotpath import IMPLEMENTATION
from ..core._stats import LatencyHistogram, RuntimeStats
from ..providers import ChaosProvider, ScriptedProvider
from ..runtime._app import App
from ..runtime._leasing import DEFAULT_TTL, is_leasing
from ..runtime._runtime import open_supervisor
from ..runtime._supervisor import Supervisor
from ..stores._open import open_store
from .workflows import WORKFLOWS, Backend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from ..runtime._handle import RunResult
    from ..runtime._supervisor import Supervisor
    from ..stores import Store

#: Which side-effecting tools belong to which workflow, for the summary.
EFFECT_TOOLS = {
    "refund": ("refund", "send_email"),
    "extraction": ("write_entities",),
    "router": ("record_ticket",),
}
DEFAULT_DB = "interlock.db"
DEFAULT_RUNS = 1200


@dataclass
class DemoConfig:
    """What ``interlock demo`` runs.

    Attributes:
      runs: how many runs, spread round-robin over ``workflows``.
      workflows: names from :data:`interlock.demo.workflows.WORKFLOWS`.
      chaos_rate: the probability that a model answer is corrupted.
      seed: the seed of the inputs and of the chaos dice.
      db: the journal: a SQLite path, ``postgresql://...`` or ``:memory:``.
      effects: the SQLite file of the workflows' downstream systems (derived from ``db``).
      latency: ``(low, high)`` seconds of simulated model latency per call.
      provider: ``sim`` (the simulated model, in process), ``openai``,
        ``openai-responses`` or ``anthropic`` (a real or OpenAI-compatible server at
        ``base_url``, serving ``model``), or ``fake-openai`` / ``fake-anthropic`` (the
        local fake server on loopback, answering as the simulated model: the whole HTTP
        path, offline, with no key).
      base_url, model: the server and the model, for the HTTP providers.
      stream: ask the HTTP providers for Server-Sent Events.
    """

    runs: int = DEFAULT_RUNS
    workflows: Sequence[str] = ("refund", "extraction", "router")
    chaos_rate: float = 0.1
    seed: int = 0
    db: str = DEFAULT_DB
    effects: str | None = None
    latency: tuple[float, float] = (0.005, 0.02)
    run_prefix: str = field(default="")
    provider: str = "sim"
    base_url: str | None = None
    model: str | None = None
    stream: bool = False
    lease_ttl: float = DEFAULT_TTL

    def effects_path(self) -> str:
        return self.effects or effects_path(self.db)


def effects_path(db: str) -> str:
    """The demo's downstream systems beside the journal ``db``: ``X.db`` -> ``X-effects.db``."""
    if db == ":memory:":
        return ":memory:"
    if db.startswith(("postgresql://", "postgres://")):
        return "interlock-effects.db"
    root, ext = os.path.splitext(db.removeprefix("sqlite:///"))
    return f"{root}-effects{ext or '.db'}"


class _Effects:
    """The downstream systems as the demo's tools see them: the Backend its lifespan opened."""

    def __init__(self) -> None:
        self.backend: Backend | None = None

    def __getattr__(self, name: str) -> Any:
        if self.backend is None:
            raise LifespanError(
                "the demo's downstream systems are not open; enter the app's lifespan first"
            )
        return getattr(self.backend, name)


def build_machines(backend: Any, workflows: Sequence[str] = tuple(WORKFLOWS)) -> list[Any]:
    return [WORKFLOWS[name].build(backend) for name in workflows]


def build_app(config: DemoConfig | None = None) -> App:
    """The demo as an application: the seed workflows under the chaos provider.

    Its lifespan opens the downstream systems (``config.effects``, else beside the journal).
    """
    config = config if config is not None else DemoConfig()
    effects = _Effects()

    @asynccontextmanager
    async def lifespan(db: str) -> AsyncIterator[Backend]:
        backend = Backend(config.effects or effects_path(db))
        effects.backend = backend
        try:
            yield backend
        finally:
            effects.backend = None
            backend.close()

    from ..runtime._metrics import DEFAULT_PRICES  # the simulated model's prices

    return App(
        build_machines(effects, config.workflows),
        provider=build_providers(config),
        prices=DEFAULT_PRICES,
        store=DEFAULT_DB,
        lifespan=lifespan,
    )


def build_providers(config: DemoConfig) -> dict[str, Any]:
    """The provider of each workflow: the simulated model under chaos, or one HTTP
    provider shared by all (one connection pool)."""
    if config.provider != "sim":
        from ._http import make_provider

        shared = make_provider(
            config.provider, base_url=config.base_url, model=config.model, stream=config.stream
        )
        return dict.fromkeys(config.workflows, shared)
    return {
        name: ChaosProvider(
            ScriptedProvider(WORKFLOWS[name].oracle, model="sim-1"),
            rate=config.chaos_rate,
            seed=config.seed,
            latency=config.latency,
        )
        for name in config.workflows
    }


def _latency_us(latency: LatencyHistogram) -> dict[str, float]:
    return {
        "p50": round(latency.quantile(0.5) * 1e6, 2),
        "p99": round(latency.quantile(0.99) * 1e6, 2),
    }


def _workflow_row(
    name: str,
    ended: Sequence[tuple[str, str, str]],
    rejections: Counter[str],
    trips: Counter[str],
    prompt: int,
    completion: int,
    latency: LatencyHistogram,
    effects: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """One workflow's part of the summary; ``ended`` holds (outcome, state, reason) per run.

    ``side_effects`` counts what the downstream systems applied (``duplicates``: an
    effect applied twice in one run); ``repeats_refused`` the proposals the gate refused
    because the run had already committed the same side-effecting call.
    """
    return {
        "runs": len(ended),
        "outcomes": dict(sorted(Counter(o for o, _s, _r in ended).items())),
        "states": dict(sorted(Counter(s for _o, s, _r in ended).items())),
        "escalation_reasons": dict(
            sorted(Counter(r for o, _s, r in ended if o == "escalated").items())
        ),
        "rejections": dict(sorted(rejections.items())),
        "breaker_trips": dict(sorted(trips.items())),
        "tokens": {"prompt": prompt, "completion": completion, "total": prompt + completion},
        "verifications": latency.total,
        "verification_us": _latency_us(latency),
        "side_effects": {t: effects[t] for t in EFFECT_TOOLS.get(name, ()) if t in effects},
        "repeats_refused": rejections.get(ALREADY_COMMITTED, 0),
    }


def summarize(
    results: Sequence[RunResult],
    stats: RuntimeStats,
    backend: Backend,
    *,
    run_prefix: str | None,
    wall: float,
    config: DemoConfig,
) -> dict[str, Any]:
    """The demo's summary as one JSON-ready document with stable keys."""
    summary = summarize_runs(
        results,
        stats,
        config.workflows,
        wall=wall,
        db=config.db,
        effects=backend.counts(run_prefix),
    )
    summary.update(effects_db=config.effects_path(), chaos_rate=config.chaos_rate, seed=config.seed)
    return summary


def summarize_runs(
    results: Sequence[RunResult],
    stats: RuntimeStats,
    machines: Sequence[str],
    *,
    wall: float,
    db: str,
    effects: dict[str, dict[str, int]] | None = None,
) -> dict[str, Any]:
    """The summary of the runs this process drove (``results``), per machine, as one
    JSON-ready document with stable keys (``effects``: the demo's side effects by tool)."""
    per: dict[str, dict[str, Any]] = {}
    for name in machines:
        mine = [r for r in results if r.machine == name]
        rejections: Counter[str] = Counter()
        for (machine, outcome, code), count in stats.verdicts.items():
            if machine == name and outcome == "rejected":
                rejections[code] += count
        trips: Counter[str] = Counter()
        for (machine, breaker, _tool), count in stats.breaker_trips.items():
            if machine == name:
                trips[breaker] += count
        prompt = sum(
            c for (m, _s, _model, kind), c in stats.tokens.items() if m == name and kind == "prompt"
        )
        completion = sum(
            c
            for (m, _s, _model, kind), c in stats.tokens.items()
            if m == name and kind == "completion"
        )
        latency = stats.verify_latency.get(name, LatencyHistogram())
        ended = [(r.outcome, r.state, r.reason) for r in mine]
        per[name] = _workflow_row(
            name, ended, rejections, trips, prompt, completion, latency, effects or {}
        )
    overall = LatencyHistogram.merged(stats.verify_latency.values())
    return {
        "runs": len(results),
        "wall_seconds": round(wall, 3),
        "runs_per_second": round(len(results) / wall, 1) if wall else 0.0,
        "db": db,
        "effects_db": None,
        "hotpath": IMPLEMENTATION,
        "outcomes": dict(sorted(Counter(r.outcome for r in results).items())),
        "verification_us": _latency_us(overall),
        "workflows": per,
    }


async def run_demo(
    config: DemoConfig,
    *,
    stats: RuntimeStats | None = None,
    on_start: Callable[[Supervisor], None] | None = None,
    store: Store | None = None,
) -> dict[str, Any]:
    """Run the demo and return its summary (see :func:`summarize`).

    Args:
      config: what to run.
      stats: counters to update (pass one to scrape metrics while it runs).
      on_start: called with the supervisor once it runs (for progress displays).
      store: an open store to use instead of opening ``config.db``.
    """
    unknown = [w for w in config.workflows if w not in WORKFLOWS]
    if unknown:
        raise ValueError(
            f"unknown workflow {unknown[0]!r}; choose from {', '.join(WORKFLOWS)} or all"
        )
    stats = stats if stats is not None else RuntimeStats()
    app = build_app(config)
    assert app.lifespan is not None
    own_store = store is None
    store = store if store is not None else await open_store(config.db)
    prefix = config.run_prefix or f"d{int(time.time() * 1000):x}"
    rng = random.Random(config.seed)
    handles = []
    started = time.perf_counter()
    views: dict[str, Supervisor] = {}
    try:
        async with app.lifespan(config.db) as backend, _model_server(config, app, views):
            assert isinstance(backend, Backend)
            async with open_supervisor(
                list(app.machines.values()),
                store,
                provider=app.provider,
                stats=stats,
                lease_ttl=config.lease_ttl,
            ) as supervisor:
                views["supervisor"] = supervisor
                if on_start is not None:
                    on_start(supervisor)

                async def start(index: int, workflow: str, inputs: dict[str, Any]) -> None:
                    run_id = f"{workflow}-{prefix}-{index:06d}"
                    handles.append(await supervisor.start_run(workflow, inputs, run_id=run_id))

                async with trio.open_nursery() as nursery:
                    _start_all(nursery, start, config, rng)
                # Every run is started: its long-lived objects need no more collection passes.
                gc.collect()
                gc.freeze()
            gc.unfreeze()
            results = [await handle.wait() for handle in handles]
            wall = time.perf_counter() - started
            return summarize(results, stats, backend, run_prefix=prefix, wall=wall, config=config)
    finally:
        if own_store:
            with trio.CancelScope(shield=True):  # closed even when Ctrl-C cancelled the runs
                await store.aclose()


@asynccontextmanager
async def _model_server(
    config: DemoConfig, app: App, views: dict[str, Supervisor]
) -> AsyncIterator[None]:
    """For a fake provider, the local fake server for the length of the demo, answering
    as the workflows' oracles would; for any HTTP provider, its pool closed at the end."""
    providers = (
        {id(p): p for p in (app.provider or {}).values()} if isinstance(app.provider, dict) else {}
    )
    try:
        if not config.provider.startswith("fake-"):
            yield
            return
        from ..testing._fake import open_fake_llm
        from ._http import oracle_brain

        brain = oracle_brain(
            lambda run_id: views["supervisor"].view(run_id),
            {name: WORKFLOWS[name].oracle for name in config.workflows},
            chaos_rate=config.chaos_rate,
            seed=config.seed,
        )
        async with open_fake_llm(brain, record=False) as fake:
            for provider in providers.values():
                provider.base_url = (
                    fake.anthropic_base_url
                    if config.provider == "fake-anthropic"
                    else fake.openai_base_url
                )
            yield
    finally:
        for provider in providers.values():
            close = getattr(provider, "aclose", None)
            if close is not None:
                await close()


@trio.lowlevel.enable_ki_protection
def _start_all(
    nursery: trio.Nursery,
    start: Callable[[int, str, dict[str, Any]], Awaitable[None]],
    config: DemoConfig,
    rng: random.Random,
) -> None:
    """Spawn a start task per run. Ctrl-C waits for the next checkpoint: raised inside
    ``start_soon``, it would drop a coroutine never awaited (and Python would say so)."""
    for index in range(config.runs):
        workflow = config.workflows[index % len(config.workflows)]
        nursery.start_soon(start, index, workflow, WORKFLOWS[workflow].make_inputs(index, rng))


async def summarize_store(
    store: Store,
    machines: Sequence[str],
    effects: object = None,
    *,
    stats: RuntimeStats | None = None,
    wall: float = 0.0,
    db: str = "",
    resumed: int = 0,
) -> dict[str, Any]:
    """The summary of everything in the journal (every run, every process) per machine.

    Verification latency is not journaled, so it covers what ``stats`` saw in this process;
    side effects are counted when ``effects`` is the demo's downstream systems.
    """
    from ..core._events import BreakerTripped, ModelCalled, ProposalRejected

    records = await store.list_runs()
    counts = effects.counts() if isinstance(effects, Backend) else {}
    per: dict[str, dict[str, Any]] = {}
    for name in machines:
        mine = [r for r in records if r.machine == name]
        if not mine:
            continue
        rejections: Counter[str] = Counter()
        trips: Counter[str] = Counter()
        prompt = completion = 0
        for record in mine:
            for event in await store.load(record.run_id):
                if isinstance(event, ProposalRejected):
                    rejections.update(v.code for v in event.violations)
                elif isinstance(event, BreakerTripped):
                    trips[event.breaker] += 1
                elif isinstance(event, ModelCalled):
                    prompt += event.usage.prompt
                    completion += event.usage.completion
        latency = (stats.verify_latency.get(name) if stats else None) or LatencyHistogram()
        ended = [(r.outcome, r.state, r.reason) for r in mine]
        per[name] = _workflow_row(
            name, ended, rejections, trips, prompt, completion, latency, counts
        )
    overall = (
        LatencyHistogram.merged(stats.verify_latency.values()) if stats else LatencyHistogram()
    )
    return {
        "runs": len(records),
        "resumed": resumed,
        "wall_seconds": round(wall, 3),
        "runs_per_second": round(resumed / wall, 1) if wall else 0.0,
        "db": db,
        "effects_db": effects.path if isinstance(effects, Backend) else None,
        "hotpath": IMPLEMENTATION,
        "outcomes": dict(sorted(Counter(r.outcome for r in records).items())),
        "verification_us": _latency_us(overall),
        "workflows": per,
    }


async def resume_app(
    app: App,
    db: str,
    *,
    stats: RuntimeStats | None = None,
    on_start: Callable[[Supervisor], None] | None = None,
    named: str = "",
    lease_ttl: float = DEFAULT_TTL,
    wait: float | None = None,
) -> dict[str, Any]:
    """Resume every unfinished run in the journal ``db`` with ``app``'s machines, wait for
    all, and summarize the whole journal (see :func:`summarize_store`).

    On PostgreSQL the runs are leased: this claims what is claimable, as a worker that
    exits when idle (:func:`~interlock.run_worker` with ``until_idle``), waiting up to
    ``wait`` seconds (default ``lease_ttl`` + 2) for the runs other processes lease. Two
    resumes at once never drive one run twice.

    An external run (``start_run(..., external=True)``) is left to its caller, which
    drives it with ``Supervisor.submit``: the summary counts them under ``"external"``
    (their ids under ``"external_runs"``), still running.

    Args:
      app: the application whose machines, provider(s) and lifespan run the runs.
      db: the journal.
      stats: counters to update (pass one to scrape metrics while it runs).
      on_start: called with the supervisor once it runs (for metrics and progress).
      named: what names the app in an error of its lifespan (default its repr).
    """
    stats = stats if stats is not None else RuntimeStats()
    store = await open_store(db) if db != ":memory:" else await open_store(None)
    started = time.perf_counter()
    if is_leasing(store):
        await store.aclose()
        return await _resume_leased(
            app, db, stats=stats, on_start=on_start, named=named, lease_ttl=lease_ttl, wait=wait
        )
    try:
        external = [
            record.run_id
            for record in await store.unfinished()
            if record.machine in app.machines and _is_external(await store.load(record.run_id))
        ]
        async with app.open(db, named) as effects:
            async with open_supervisor(
                list(app.machines.values()), store, provider=app.provider, stats=stats
            ) as supervisor:
                if on_start is not None:
                    on_start(supervisor)
                handles = [
                    handle
                    for handle in await supervisor.resume_unfinished()
                    if handle.run_id not in external  # no actor: nothing here would end it
                ]
            for handle in handles:
                await handle.wait()  # raises what ended a run abnormally (a store error, say)
            summary = await summarize_store(
                store,
                list(app.machines),
                effects,
                stats=stats,
                wall=time.perf_counter() - started,
                db=db,
                resumed=len(handles),
            )
            return {**summary, "external": len(external), "external_runs": external}
    finally:
        with trio.CancelScope(shield=True):  # closed even when Ctrl-C cancelled the runs
            await store.aclose()


async def _resume_leased(
    app: App,
    db: str,
    *,
    stats: RuntimeStats,
    on_start: Callable[[Supervisor], None] | None,
    named: str,
    lease_ttl: float,
    wait: float | None,
) -> dict[str, Any]:
    """:func:`resume_app` on a journal with leases: a worker until idle, then the summary."""
    from ..runtime._worker import run_worker

    started = time.perf_counter()
    report = await run_worker(
        app,
        db,
        lease_ttl=lease_ttl,
        until_idle=True,
        idle_wait=wait,
        stats=stats,
        on_start=(lambda control: on_start(control.supervisor)) if on_start else None,
        named=named,
    )
    store = await open_store(db, readonly=True)
    try:
        async with app.open(db, named) as effects:
            summary = await summarize_store(
                store,
                list(app.machines),
                effects,
                stats=stats,
                wall=time.perf_counter() - started,
                db=db,
                resumed=report.claimed,
            )
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
    external = await _unfinished_external(db, app)
    return {
        **summary,
        "external": len(external),
        "external_runs": external,
        "leased_elsewhere": report.waited_for,
        "lost": report.lost,
    }


async def _unfinished_external(db: str, app: App) -> list[str]:
    store = await open_store(db, readonly=True)
    try:
        return [
            record.run_id
            for record in await store.unfinished()
            if record.machine in app.machines and _is_external(await store.load(record.run_id))
        ]
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


def _is_external(events: Sequence[object]) -> bool:
    """Whether a journal is of a run its caller drives (``start_run(external=True)``)."""
    return bool(events) and getattr(events[0], "external", False) is True
