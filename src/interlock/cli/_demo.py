"""``interlock demo``: the refund demo, against a fake model or a real one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core._exceptions import ConfigurationError
from ..demo._run import DEFAULT_DB, DemoConfig, build_app, run_demo
from ..demo.workflows import WORKFLOWS
from ..runtime._app import DEMO_REF
from ._common import _journal_url, _Metrics, _print_json, _print_summary, _progress

if TYPE_CHECKING:
    import argparse


async def _demo(args: argparse.Namespace) -> int:
    workflows = tuple(WORKFLOWS) if args.workflow == "all" else (args.workflow,)
    _journal_url(args, (DEMO_REF, DEFAULT_DB))
    config = DemoConfig(
        runs=args.runs,
        workflows=workflows,
        chaos_rate=args.chaos_rate,
        seed=args.seed,
        db=args.db,
        effects=args.effects,
        latency=args.latency,
        provider=args.provider,
        base_url=args.base_url,
        model=args.model,
        stream=args.stream,
        lease_ttl=args.lease_ttl,
    )
    if args.provider == "sim" and (args.base_url or args.model or args.stream):
        raise ConfigurationError(
            "--base-url, --model and --stream are for an HTTP --provider (openai, "
            "openai-responses, anthropic, fake-openai, fake-anthropic); the simulated model "
            "takes none"
        )
    metrics = _Metrics(args, build_app(config).prices)
    with metrics:
        async with _progress(metrics, config.runs, quiet=args.json):
            summary = await run_demo(config, stats=metrics.stats, on_start=metrics.started)
        if args.json:
            _print_json(summary)
        else:
            _print_summary(
                summary,
                f"interlock demo: {summary['runs']} runs in {summary['wall_seconds']} s "
                f"({summary['runs_per_second']} runs/s, hot path {summary['hotpath']})",
            )
        await metrics.held()
    return 0
