"""A real LiteLLM proxy, configured with its generic guardrail pointing at interlock, in
front of a model (the fake LLM, for calls the test chooses): a returned call that breaks the
machine is blocked before the application sees it, one that keeps it passes, and the
result the application reports on the next request is journaled as the commit.

LiteLLM lives in a virtualenv of its own (its pins clash with the [test] extra's);
``.ci/run`` builds it at ``$INTERLOCK_CI_LITELLM`` (default
``/root/.cache/interlock-ci/litellm``)."""

from __future__ import annotations

import os
import socket
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

openai = pytest.importorskip("openai", reason="the openai SDK is in the [test] extra")
pytest.importorskip("hypercorn", reason="the [gateway] extra (hypercorn) is missing")

from interlock.modelproxy import RUN_HEADER, serve_model_proxy  # noqa: E402
from interlock.stores import open_sqlite_store  # noqa: E402
from interlock.testing import Reply, open_fake_llm, scripted_brain  # noqa: E402
from tests.test_model_proxy import LIMIT, MACHINE, REFUND_TOOLS, REFUNDS  # noqa: E402
from tests.test_real_model import llama_server  # noqa: E402, F401 - the fixture

VENV = Path(os.environ.get("INTERLOCK_CI_LITELLM", "/root/.cache/interlock-ci/litellm"))
LITELLM = VENV / "bin" / "litellm"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not LITELLM.exists(),
        reason=f"no LiteLLM proxy at {LITELLM}: .ci/run installs it (litellm[proxy] in a "
        "virtualenv of its own; set INTERLOCK_CI_LITELLM to another one)",
    ),
    pytest.mark.filterwarnings(
        r"ignore:Async generator '(openai|anthropic|httpx2|httpcore2)\.:ResourceWarning"
    ),
]

MASTER = "sk-interlock-test-" + "0" * 32
CONFIG = """
model_list:
  - model_name: shop-model
    litellm_params:
      model: openai/fake-model
      api_base: {upstream}
      api_key: sk-fake
general_settings:
  master_key: {master}
guardrails:
  - guardrail_name: interlock
    litellm_params:
      guardrail: generic_guardrail_api
      mode: [pre_call, post_call]
      api_base: {interlock}
      default_on: true
      extra_headers: ["{header}"]
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "charge",
            "parameters": {"type": "object", "properties": {"cents": {"type": "integer"}}},
        },
    }
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _start_litellm(tmp_path: Path, upstream: str, interlock: str) -> tuple[trio.Process, str]:
    port = _free_port()
    config = tmp_path / "litellm.yaml"
    config.write_text(
        CONFIG.format(upstream=upstream, interlock=interlock, header=RUN_HEADER, master=MASTER)
    )
    log = tmp_path / "litellm.log"
    with log.open("wb") as out:
        env = {**os.environ, "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}
        env.pop("DATABASE_URL", None)
        process = await trio.lowlevel.open_process(
            [
                str(LITELLM),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(url, process, log)
    except BaseException:
        await _stop(process)
        raise
    return process, url


async def _stop(process: trio.Process) -> None:
    process.terminate()
    with trio.move_on_after(30) as waited:
        await process.wait()
    if waited.cancelled_caught:
        process.kill()


async def _wait_ready(url: str, process: trio.Process, log: Path) -> None:
    import httpx

    async with httpx.AsyncClient() as http:
        for _ in range(1200):  # LiteLLM imports a great deal: up to 2 minutes here
            if process.poll() is not None:
                raise AssertionError((await trio.Path(log).read_text())[-4000:])
            try:
                if (await http.get(url + "/health/liveliness", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await trio.sleep(0.1)
    raise AssertionError(f"LiteLLM did not come up: {(await trio.Path(log).read_text())[-4000:]}")


async def test_a_litellm_proxy_blocks_a_call_that_breaks_the_machine_and_passes_one_that_keeps_it(
    tmp_path: Any,
) -> None:
    brain = scripted_brain(
        [
            Reply(calls=[("charge", '{"cents": 5000}')]),  # the guard refuses it
            Reply(calls=[("charge", '{"cents": 500}')]),
            Reply(text="charged 5 dollars"),
        ]
    )
    store = await open_sqlite_store(str(tmp_path / "g.db"))
    process = None
    try:
        async with open_fake_llm(brain) as fake, trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_model_proxy, MACHINE, fake.openai_base_url, store)
            )
            process, url = await _start_litellm(
                tmp_path,
                fake.openai_base_url,
                server.anthropic_url,  # the server's root
            )
            run = {RUN_HEADER: "shop-order-7"}  # the application names its conversation
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=60
            ) as client:
                messages: list[Any] = [{"role": "user", "content": "charge me 5 dollars"}]
                with pytest.raises(openai.APIStatusError) as blocked:
                    await client.chat.completions.create(
                        model="shop-model", messages=messages, tools=TOOLS, extra_headers=run
                    )
                assert "is over 1000" in str(blocked.value), blocked.value
                passed = await client.chat.completions.create(
                    model="shop-model", messages=messages, tools=TOOLS, extra_headers=run
                )
                (call,) = passed.choices[0].message.tool_calls
                assert call.function.arguments == '{"cents": 500}'
                messages += [
                    passed.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"charged": 500}'},
                ]
                final = await client.chat.completions.create(
                    model="shop-model", messages=messages, tools=TOOLS, extra_headers=run
                )
                assert final.choices[0].message.content == "charged 5 dollars"
            server.stop()
    finally:
        if process is not None:
            await _stop(process)
        await store.aclose()
    reader = await open_sqlite_store(str(tmp_path / "g.db"), readonly=True)
    try:
        events = await reader.load("shop-order-7")
    finally:
        await reader.aclose()
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("ProposalRejected") == 1, kinds
    committed = [e for e in events if type(e).__name__ == "ToolCommitted"]
    assert [e.result for e in committed] == ['{"charged": 500}'], kinds


async def test_a_litellm_proxy_in_front_of_the_real_model_never_lets_a_call_that_breaks_the_guard_through(
    llama_server: str,  # noqa: F811 - the real model test's fixture
    tmp_path: Any,
) -> None:
    """LiteLLM in front of the real local model (SmolLM2 behind llama-cpp-python), its
    guardrail calling interlock. What the gate must guarantee is asserted, not what the
    model answers: no call the application receives breaks the guard, and every block the
    application hears of is the gate's."""
    import json

    machine, tools = REFUNDS, REFUND_TOOLS
    received: list[Any] = []
    blocks: list[str] = []
    store = await open_sqlite_store(str(tmp_path / "real.db"))
    process = None
    try:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(serve_model_proxy, machine, llama_server, store))
            process, url = await _start_litellm(tmp_path, llama_server, server.anthropic_url)
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key=MASTER, max_retries=0, timeout=300
            ) as client:
                for n, amount in enumerate((150, 40)):
                    messages: list[Any] = [
                        {
                            "role": "system",
                            "content": "You answer by calling a tool. The customer of order "
                            f"o1 asks for a refund of {amount}. Call refund with order_id o1 "
                            f"and amount {amount}.",
                        },
                        {"role": "user", "content": f"Please refund {amount} on order o1."},
                    ]
                    try:
                        completion = await client.chat.completions.create(
                            model="shop-model",
                            messages=messages,
                            tools=tools,
                            tool_choice={"type": "function", "function": {"name": "refund"}},
                            max_tokens=96,
                            extra_headers={RUN_HEADER: f"real-{n}"},
                        )
                    except openai.APIStatusError as exc:
                        blocks.append(str(exc))
                        continue
                    received += completion.choices[0].message.tool_calls or []
            server.stop()
    finally:
        if process is not None:
            await _stop(process)
        await store.aclose()
    for call in received:  # the guarantee: nothing past the gate breaks the guard
        args = json.loads(call.function.arguments)
        assert 0 < args["amount"] <= LIMIT, call
    for block in blocks:  # and every refusal the application heard was the gate's
        assert "interlock refused the model's call" in block, block
    reader = await open_sqlite_store(str(tmp_path / "real.db"), readonly=True)
    try:
        runs = await reader.list_runs()
        kinds = [type(e).__name__ for r in runs for e in await reader.load(r.run_id)]
    finally:
        await reader.aclose()
    assert received or blocks, "the model proposed no call: the gate had no work"
    assert kinds.count("ProposalRejected") == len(blocks), kinds
    print(f"calls received: {len(received)}, blocked by the gate: {len(blocks)}")
