"""The console tests' gateway: a real ``interlock serve`` process over loopback, with a
keys file of three keys (a reader, an operator, an agent), and runs journaled through the
API as an agent would (tests/console_app.py: external refund runs).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

APP = str(Path(__file__).with_name("console_app.py")) + ":app"
KEYS = {
    "reader": "read-key-" + "r" * 32,
    "oncall": "operator-key-" + "o" * 32,
    "agent": "agent-key-" + "a" * 32,
}
ROLES = {"reader": "reader", "oncall": "operator", "agent": "agent"}

#: Strings a model, a tool or a caller could send, meant to run script in a page.
HOSTILE = (
    "<script>window.__pwned = 1</script>",
    '"><img src=x onerror="window.__pwned = 2">',
    "'><svg onload=window.__pwned=3>",
    "javascript:window.__pwned=4",
)
BAD = '{"tool": "refund", "args": {"order_id": "o-1", "cents": "lots"}}'
GOOD = '{"tool": "refund", "args": {"order_id": "o-1", "cents": 250}}'
TOO_MUCH = '{"tool": "refund", "args": {"order_id": "o-1", "cents": 99999}}'


def keys_file(where: Path) -> Path:
    path = where / "keys.toml"
    path.write_text(
        "".join(
            f'[keys.{name}]\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
            f'roles = ["{ROLES[name]}"]\n\n'
            for name, key in KEYS.items()
        )
    )
    return path


class Gateway:
    """One ``interlock serve`` process (console included) on ``db``."""

    def __init__(self, db: str, where: Path, app: str = APP, keys: bool = True) -> None:
        env = {**os.environ}
        env.pop("INTERLOCK_API_KEY", None)
        if keys:
            env["INTERLOCK_API_KEYS_FILE"] = str(keys_file(where))
        else:
            env.pop("INTERLOCK_API_KEYS_FILE", None)
        self.log = where / "serve.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "interlock",
                    "serve",
                    "--app",
                    app,
                    "--db",
                    db,
                    "--port",
                    "0",
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("interlock serve: http://"), (line, self.log.read_text())
        self.url = line.split()[2]
        self.started: set[str] = set()
        self.agent = httpx.Client(
            base_url=self.url,
            timeout=60,
            headers={"authorization": f"Bearer {KEYS['agent']}"} if keys else {},
        )

    def client(self, who: str | None) -> httpx.Client:
        headers = {"authorization": f"Bearer {KEYS[who]}"} if who else {}
        return httpx.Client(base_url=self.url, timeout=60, headers=headers, follow_redirects=False)

    # -- runs, journaled as an agent would ---------------------------------------------

    def start(self, run_id: str, inputs: dict[str, Any] | None = None) -> None:
        answer = self.agent.post(
            "/v1/runs",
            json={
                "machine": "refund",
                "run_id": run_id,
                "mode": "external",
                "inputs": inputs or {},
            },
        )
        assert answer.status_code == 201, answer.text

    def propose(self, run_id: str, proposal: str) -> dict[str, Any]:
        answer = self.agent.post(f"/v1/runs/{run_id}/proposals", json={"proposal": proposal})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def escalated(self, run_id: str, *proposals: str) -> None:
        """A run escalated by three rejected proposals in a row (the breaker's limit)."""
        self.start(run_id, {"note": HOSTILE[0], "customer": HOSTILE[1]})
        for proposal in (*proposals, BAD, BAD, BAD)[:3]:
            verdict = self.propose(run_id, proposal)
        assert verdict["outcome"] == "escalated", verdict

    def completed(self, run_id: str, result: Any = "ok") -> None:
        self.start(run_id)
        verdict = self.propose(run_id, GOOD)
        assert verdict["accepted"]
        assert verdict["key"], verdict
        answer = self.agent.post(
            f"/v1/runs/{run_id}/results", json={"key": verdict["key"], "result": result}
        )
        assert answer.status_code == 200, answer.text
        self.propose(run_id, '{"next": "NOTIFY", "data": {"said": "' + "refunded" + '"}}')
        verdict = self.propose(run_id, '{"next": "COMPLETED"}')
        assert verdict["outcome"] == "completed", verdict

    def run(self, run_id: str) -> dict[str, Any]:
        answer = self.agent.get(f"/v1/runs/{run_id}")
        assert answer.status_code == 200, answer.text
        return answer.json()

    def events(self, run_id: str) -> list[dict[str, Any]]:
        answer = self.agent.get(f"/v1/runs/{run_id}/events")
        assert answer.status_code == 200, answer.text
        return answer.json()["events"]

    def close(self) -> None:
        self.agent.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
