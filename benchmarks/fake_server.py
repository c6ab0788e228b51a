"""The fake LLM's own HTTP/1.1 server against hypercorn (ASGI on trio), per request.

Why ``interlock.testing._fake`` keeps a server loop of its own: it is the server of the
provider benchmarks, so its CPU is their noise floor. Both servers answer the same ~1 KB
chat completion; the providers' ``Transport`` drives each (200 concurrent tasks, 64 in
flight), client and server in ONE process, so the figure is client + server CPU per
request; the client's share is the same in both, the difference is the server's. Rounds
alternate the two servers; each pass is warmed by one untimed pass.

Run it: ``python -m benchmarks.fake_server`` prints one line per round.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import trio

from interlock.providers._http import Transport
from interlock.testing._fake import Reply, open_fake_llm

REQUESTS = 3000
CONCURRENCY = 200
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 160}]}).encode()
ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "y" * 800},
                "finish_reason": "stop",
            }
        ],
    }
).encode()


async def drive(base_url: str) -> tuple[float, float]:
    """Wall seconds and CPU seconds of REQUESTS posts (after one untimed pass)."""
    async with Transport(base_url, max_in_flight=64) as transport:

        async def one(count: int) -> None:
            for _ in range(count):
                response = await transport.post("/chat/completions", BODY)
                assert response.status == 200

        async def everyone() -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(CONCURRENCY):
                    nursery.start_soon(one, REQUESTS // CONCURRENCY)

        await everyone()
        wall, cpu = time.perf_counter(), time.process_time()
        await everyone()
        return time.perf_counter() - wall, time.process_time() - cpu


async def fake() -> tuple[float, float]:
    def brain(api: str, body: Any, headers: Any) -> Reply:
        return Reply(text="y" * 800)

    async with open_fake_llm(brain, record=False) as server:
        return await drive(server.openai_base_url)


async def hypercorn() -> tuple[float, float]:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": ANSWER})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        result = await drive(binds[0] + "/v1")
        nursery.cancel_scope.cancel()
    return result


def main() -> None:
    started = time.perf_counter()
    for round_ in range(3):
        rows = {name: trio.run(run) for name, run in (("fake", fake), ("hypercorn", hypercorn))}
        (fw, fc), (hw, hc) = rows["fake"], rows["hypercorn"]
        print(
            f"round {round_ + 1}: fake {REQUESTS / fw:,.0f} req/s, {fc / REQUESTS * 1e6:,.0f} µs "
            f"CPU/req; hypercorn {REQUESTS / hw:,.0f} req/s, {hc / REQUESTS * 1e6:,.0f} µs CPU/req; "
            f"hypercorn costs {hc / fc:.1f}x the CPU (client included)"
        )
    print(f"\n`python -m benchmarks.fake_server` ({time.perf_counter() - started:.0f} s)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
