"""Every PromQL query of the Grafana dashboard, evaluated by a real Prometheus server that
scrapes a real ``interlock demo --metrics-port ... --hold`` process."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

GRAFANA = Path(__file__).parent.parent / "grafana"
DASHBOARD = GRAFANA / "provisioning/dashboards/interlock/overview.json"
#: What Grafana would put in place of its variables.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m", "$machine": ".*"}
DEADLINE = 60.0
#: The demo the dashboard is read against. NOTE: with 5-20 ms of model latency 300 runs
#: end in under a second, before Prometheus's first scrape, and every rate() would be 0
#: and every quantile NaN; 100-200 ms keeps them in flight for a second or two, so
#: Prometheus (scraping every 0.5 s) scrapes them while they run and the panels show real
#: numbers.
DEMO = ["--runs", "300", "--latency", "100,200", "--chaos-rate", "0.3", "--seed", "1"]
#: Panels that must show a positive number once the demo has run.
BUSY = [
    'sum(rate(interlock_tokens_total{machine=~"$machine"}[$__rate_interval]))',
    'sum by (machine, model) (rate(interlock_model_calls_total{machine=~"$machine"}[$__rate_interval]))',
    'histogram_quantile(0.99, sum by (le) (rate(interlock_verification_seconds_bucket{machine=~"$machine"}[$__rate_interval])))',
    "histogram_quantile(0.5, sum by (le) (rate(interlock_journal_flush_seconds_bucket[$__rate_interval])))",
    "sum(rate(interlock_journal_events_total[$__rate_interval]))",
    "sum by (tool) (rate(interlock_tool_calls_total[$__rate_interval]))",
]


def _prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(
                "the prometheus binary is missing in CI; .ci/run installs it (apt-get install -y prometheus)"
            )
        pytest.skip(
            "the prometheus binary is not installed (apt-get install -y prometheus); CI runs this test"
        )
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _expressions(value)]
    if isinstance(node, list):
        return [e for value in node for e in _expressions(value)]
    return []


def _substitute(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def _scrape_config(metrics_port: int) -> str:
    shipped = (GRAFANA / "prometheus.yml").read_text()
    for old, new in (
        ("127.0.0.1:9464", f"127.0.0.1:{metrics_port}"),
        ("scrape_interval: 5s", "scrape_interval: 500ms"),
        ("scrape_timeout: 4s", "scrape_timeout: 500ms"),
    ):
        assert old in shipped, f"grafana/prometheus.yml no longer contains {old!r}"
        shipped = shipped.replace(old, new)
    return shipped


def _stop(process: subprocess.Popen[bytes] | None) -> int | None:
    if process is None:
        return None
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait(timeout=10)


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    prometheus = _prometheus()
    metrics_port, prometheus_port = _free_port(), _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(_scrape_config(metrics_port))
    demo_out = tmp_path / "demo.json"
    demo_err = tmp_path / "demo.stderr"
    prometheus_log = tmp_path / "prometheus.log"
    demo = server = None
    api = f"http://127.0.0.1:{prometheus_port}"
    try:
        with prometheus_log.open("wb") as log:
            server = subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prometheus_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + DEADLINE
        with httpx.Client(timeout=5) as client:

            def query(expr: str) -> dict[str, Any]:
                document: dict[str, Any] = client.get(
                    f"{api}/api/v1/query", params={"query": expr}
                ).json()
                return document

            def waiting(what: str) -> None:
                assert time.monotonic() < deadline, (
                    f"gave up waiting for {what} after {DEADLINE} s; demo: {demo_err.read_text()[-2000:]}; "
                    f"prometheus: {prometheus_log.read_text()[-2000:]}"
                )
                assert server.poll() is None, (
                    f"prometheus exited: {prometheus_log.read_text()[-2000:]}"
                )
                time.sleep(0.2)

            # Prometheus first, so that it scrapes while the runs execute and rates are real.
            # NOTE: it applies its targets a few seconds after start; wait for the first
            # (failed) scrape attempt, or the demo could be over before the first scrape.
            while True:
                waiting("prometheus to try the target")
                try:
                    targets = client.get(f"{api}/api/v1/targets").json()["data"]["activeTargets"]
                except (httpx.TransportError, ValueError, KeyError):
                    continue
                if targets and targets[0]["health"] != "unknown":
                    break
            where = ["--db", str(tmp_path / "journal.db"), "--metrics-port", str(metrics_port)]
            with demo_out.open("wb") as out, demo_err.open("wb") as err:
                demo = subprocess.Popen(
                    [sys.executable, "-m", "interlock", "demo", *DEMO, "--json", "--hold", *where],
                    stdout=out,
                    stderr=err,
                )

            # Then wait until the runs are over and the target has been scraped twice since
            # (so the latest samples are the final counts) and at least four times in all.
            def scrapes() -> int:
                result = query('count_over_time(interlock_build_info{job="interlock"}[1m])')
                return (
                    int(result["data"]["result"][0]["value"][1]) if result["data"]["result"] else 0
                )

            finished_at = None
            while True:
                waiting("scrapes of the demo")
                assert demo.poll() is None, f"the demo exited early: {demo_err.read_text()[-2000:]}"
                if "runs finished" not in demo_err.read_text():
                    continue
                if finished_at is None:
                    finished_at = scrapes()
                elif scrapes() >= max(4, finished_at + 2):
                    break

            # What Prometheus holds is what the demo counted.
            summary = json.loads(demo_out.read_text())
            tokens = sum(row["tokens"]["total"] for row in summary["workflows"].values())
            assert (
                float(query("sum(interlock_tokens_total)")["data"]["result"][0]["value"][1])
                == tokens
            )
            finished = query("sum(interlock_runs_finished_total)")["data"]["result"][0]["value"][1]
            assert float(finished) == 300

            expressions = _expressions(json.loads(DASHBOARD.read_text()))
            assert len(expressions) >= 30
            assert set(BUSY) <= set(expressions)
            failures = []
            for expr in expressions:
                document = query(_substitute(expr))
                if document.get("status") != "success" or not document["data"]["result"]:
                    failures.append((expr, document))
                    continue
                values = [float(item["value"][1]) for item in document["data"]["result"]]
                # Some value is a number (a quantile over an idle window is NaN), and the
                # panels that show the work the demo did show some.
                finite = any(math.isfinite(v) for v in values)
                busy = expr not in BUSY or any(v > 0 for v in values)
                if not (finite and busy):
                    failures.append((expr, document))
            assert failures == []
            # The machine variable's values come from the label API, not from a query.
            machines = client.get(
                f"{api}/api/v1/label/machine/values",
                params={"match[]": "interlock_runs_started_total"},
            ).json()
            assert sorted(machines["data"]) == ["extraction", "refund", "router"]
    finally:
        stopped = _stop(demo)
        _stop(server)
    # --hold ends cleanly on SIGTERM.
    assert stopped == 0, demo_err.read_text()[-2000:]
