"""An external agent with the Python client, and a hosted run watched as it happens.

The external run: this script is the agent. It owns "the model" (a list of proposals
here; an LLM's raw answers in real life) and executes "the tools" itself; the gateway
verifies each proposal, issues the idempotency key and journals the intent before it
answers. The hosted run: the gateway's runtime drives the model and the tools, and the
script only watches the run's journal stream.

Run: python examples/external_agent.py [URL]
  With no URL it starts ``interlock serve --app interlock.demo:app`` on a free port with
  a temporary journal, and stops it (SIGTERM: it drains) at the end. Needs
  ``interlock[gateway,client]``. Exits 0 when the external run completed and the hosted
  one ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import trio

from interlock.client import AsyncClient
from interlock.protocol import RunOut

ORDER = "ord-100001"
ORDER_TOTAL = 120.0  # what "the orders database" below answers
CUSTOMER = "ada@example.com"


class Tools:
    """The downstream systems this agent calls: kept here, executed here."""

    def __init__(self) -> None:
        self.ledger: dict[str, float] = {}  # refunds by idempotency key
        self.outbox: list[str] = []

    def execute(self, tool: str, key: str, args: dict[str, object]) -> dict[str, object]:
        if tool == "lookup_order":
            return {"order_id": args["order_id"], "total": ORDER_TOTAL}
        if tool == "refund":  # idempotent by the key: executing it again pays nothing more
            amount = float(args["amount"])  # type: ignore[arg-type]
            self.ledger.setdefault(key, amount)
            return {"refund_id": f"rf-{len(self.ledger)}", "refunded": amount}
        if tool == "send_email":
            self.outbox.append(f"{key} {args['to']}")
            return {"message_id": f"m-{len(self.outbox)}"}
        raise ValueError(f"no tool {tool!r} here")


def refund(amount: float) -> str:
    """What "the model" proposes to refund: its raw text, as an LLM would write it."""
    return json.dumps(
        {
            "tool": "refund",
            "args": {"order_id": ORDER, "amount": amount, "currency": "USD", "reason": "damaged"},
        }
    )


async def external_run(client: AsyncClient, tools: Tools) -> RunOut:
    run = await client.start_external(
        "refund", {"order_id": ORDER, "customer": CUSTOMER, "requested": 150.0}
    )
    print(
        f"external run {run.id}: {run.outcome} in {run.state}, tools "
        f"{[t.name for t in run.run.tools]}, next {run.run.next}"
    )
    proposals = [
        json.dumps({"tool": "lookup_order", "args": {"order_id": ORDER}}),
        refund(150.0),  # more than the order's total: the guard rejects it
    ]
    amount = 150.0
    while run.outcome == "running":
        if proposals:
            text = proposals.pop(0)
        elif not tools.ledger:
            text = refund(amount)
        elif not tools.outbox:
            text = json.dumps(
                {
                    "tool": "send_email",
                    "args": {
                        "to": CUSTOMER,
                        "subject": "Your refund",
                        "lines": [f"We refunded {amount} USD."],
                    },
                }
            )
        else:
            text = json.dumps({"next": "COMPLETED", "data": {"answer": f"refunded {amount}"}})
        verdict = await run.propose(text)  # expected_seq is kept by the run object
        if not verdict.accepted:
            for v in verdict.violations:
                print(f"  rejected: {v.code} at {v.path}: {v.message}; hint: {v.hint}")
                if v.path == "args.amount" and "<=" in v.hint:
                    amount = float(v.hint.rsplit("<=", 1)[1])  # the agent takes the hint
            continue
        if verdict.key and verdict.tool and verdict.args is not None:
            result = tools.execute(verdict.tool, verdict.key, verdict.args)
            print(f"  {verdict.tool} accepted with key {verdict.key}; executed: {result}")
            await run.report(verdict.key, result)
            if verdict.tool == "refund":
                # a retry after a dropped connection sends the same result again: the
                # gateway answers with what it recorded and journals nothing new
                again = await client.report(run.id, verdict.key, result)
                print(f"  retried the refund's result: replayed={again.replayed}")
        else:
            print(f"  moved: {verdict.outcome} in {verdict.state}")
    return await client.get_run(run.id)


async def hosted_run(client: AsyncClient) -> RunOut:
    run = await client.create_run(
        "refund",
        {"order_id": "ord-100002", "customer": CUSTOMER, "requested": 50.0},
        mode="hosted",
    )
    print(f"hosted run {run.id}: the gateway's runtime drives it; its journal as it is written:")
    async with contextlib.aclosing(client.stream(run.id)) as events:
        async for event in events:
            print(f"  {event.seq:>3} {event.kind}")
            if event.kind in ("completed", "escalated", "failed"):
                break
    return await client.get_run(run.id)


async def main(url: str) -> int:
    tools = Tools()
    async with AsyncClient(url) as client:
        done = await external_run(client, tools)
        print(
            f"external run {done.id}: {done.outcome}, output {done.output}; "
            f"{len(tools.ledger)} refund, {len(tools.outbox)} email"
        )
        hosted = await hosted_run(client)
        print(f"hosted run {hosted.id}: {hosted.outcome} {hosted.output or hosted.reason}")
    # the demo's simulated model is corrupted at random (its chaos rate), so a hosted run
    # may also end escalated, with its reason: that is the runtime doing its job
    return 0 if done.outcome == "completed" and hosted.outcome != "running" else 1


@contextlib.contextmanager
def demo_gateway() -> Iterator[str]:
    """``interlock serve`` on the demo application, on a port it picks (``--port 0``)."""
    with tempfile.TemporaryDirectory() as work:
        command = [
            sys.executable, "-m", "interlock", "serve", "--app", "interlock.demo:app",
            "--db", os.path.join(work, "journal.db"), "--port", "0",
        ]  # fmt: skip
        server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            # its first line, once it listens: "interlock serve: http://127.0.0.1:PORT (...)"
            line = server.stdout.readline()
            if not line.startswith("interlock serve: http"):
                raise SystemExit(f"interlock serve did not start: {line or 'no output'}")
            url = line.split()[2]
            print(f"gateway: {url} (interlock serve --app interlock.demo:app)")
            yield url
        finally:
            server.terminate()  # SIGTERM: stop accepting, finish what is in flight, exit 0
            server.communicate(timeout=60)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(trio.run(main, sys.argv[1]))
    with demo_gateway() as gateway_url:
        sys.exit(trio.run(main, gateway_url))
