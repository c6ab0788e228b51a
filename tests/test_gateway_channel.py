"""The gateway's streaming channel over real sockets on loopback: length-prefixed msgpack
frames, a real Supervisor journaling to SQLite in tmp_path through GatewayService (#17)."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings

from interlock import Machine, Tool, Worker, open_supervisor, replay
from interlock.client._channel import ChannelProblem, open_channel
from interlock.gateway import GatewayService
from interlock.gateway._channel import OPS, serve_channel
from interlock.gateway._guard import RateLimiter
from interlock.gateway._keys import KeyRing, Principal, hash_key
from interlock.protocol import Problem, VerdictOut, VerifyItem
from interlock.stores import MemoryStore, open_sqlite_store

HEADER = struct.Struct(">I")


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    cents: int


async def never(args: Any, ctx: Any) -> Any:  # an external run's caller executes its tools
    raise AssertionError("an external run's tool is executed by its caller")


def shop() -> Machine:
    return Machine(
        "shop",
        "PAY",
        {"PAY": Worker(next=["COMPLETED"], tools=["charge"], instructions="charge, then finish")},
        tools=[Tool("charge", never, Charge, description="Charge the customer.")],
    )


CHARGE = '{"tool": "charge", "args": {"cents": 500}}'
DONE = '{"next": "COMPLETED", "data": {"receipt": "r-9"}}'
BAD = '{"tool": "charge", "args": {"cents": "five"}}'


class Answer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An answer frame as a client in any language reads it."""

    id: int | None
    body: Any = None
    problem: Problem | None = None


DECODE_ANSWER = msgspec.msgpack.Decoder(Answer).decode


def frame(message: Any) -> bytes:
    payload = msgspec.msgpack.encode(message)
    return HEADER.pack(len(payload)) + payload


async def read_answers(
    stream: trio.abc.ReceiveStream, count: int | None = None, buffer: bytearray | None = None
) -> list[Answer]:
    """Read answer frames until ``count`` of them (or, with None, until the server closes).

    Pass the same ``buffer`` to read on where an earlier call stopped.
    """
    buffer = bytearray() if buffer is None else buffer
    answers: list[Answer] = []
    while True:
        while len(buffer) >= 4 and (count is None or len(answers) < count):
            (size,) = HEADER.unpack_from(buffer)
            if len(buffer) < 4 + size:
                break
            answers.append(DECODE_ANSWER(bytes(buffer[4 : 4 + size])))
            del buffer[: 4 + size]
        if count is not None and len(answers) >= count:
            return answers
        data = await stream.receive_some(65536)
        if not data:
            assert not buffer, "the server closed inside a frame"
            return answers
        buffer += data


async def connect(url: str) -> trio.SocketStream:
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return await trio.open_tcp_stream(host, int(port))


@asynccontextmanager
async def served(store: Any, **options: Any) -> AsyncIterator[tuple[Any, GatewayService, str]]:
    """A supervisor over ``store``, its GatewayService, and the channel serving it."""
    async with open_supervisor([shop()], store) as sup:
        service = GatewayService(sup)
        options.setdefault("keyring", KeyRing())
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_channel, service, **options))
            yield sup, service, url
            nursery.cancel_scope.cancel()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[Any]:
    store = await open_sqlite_store(str(tmp_path / "journal.db"))
    try:
        yield store
    finally:
        await store.aclose()


async def test_an_external_run_is_driven_end_to_end_over_the_channel(sqlite_store: Any) -> None:
    with trio.fail_after(60):
        async with (
            served(sqlite_store) as (_sup, _service, url),
            open_channel(url) as channel,
        ):
            assert channel.welcome is not None
            assert channel.welcome.principal == "anonymous"
            run = await channel.create_run("shop", run_id="x-1")
            assert (run.state, run.mode, [t.name for t in run.tools]) == (
                "PAY",
                "external",
                ["charge"],
            )
            bad = await channel.propose("x-1", BAD, expected_seq=run.seq)
            assert not bad.accepted
            assert [(v.code, v.path) for v in bad.violations] == [("schema", "args.cents")]
            call = await channel.propose("x-1", CHARGE, expected_seq=bad.seq)
            assert (call.accepted, call.tool, call.args) == (True, "charge", {"cents": 500})
            assert call.key
            # the intent is durable before the verdict is sent
            kinds = [type(e).__name__ for e in await sqlite_store.load("x-1")]
            assert kinds[-1] == "IntentRecorded"
            # a retry of the same proposal at the same seq gets the recorded verdict
            again = await channel.propose("x-1", CHARGE, expected_seq=bad.seq)
            assert (again.replayed, again.key) == (True, call.key)
            done = await channel.report("x-1", call.key, {"charged": 500})
            assert done.accepted
            end = await channel.propose("x-1", DONE, expected_seq=done.seq)
            assert (end.outcome, end.state) == ("completed", "COMPLETED")
            final = await channel.get_run("x-1")
            assert (final.outcome, final.output) == ("completed", {"receipt": "r-9"})
            with pytest.raises(ChannelProblem, match=r"^409 Conflict: run 'x-1' is completed"):
                await channel.propose("x-1", CHARGE)
            with pytest.raises(ChannelProblem, match=r"^404 Not Found: run 'nope' not found"):
                await channel.get_run("nope")
    events = await sqlite_store.load("x-1")
    assert [type(e).__name__ for e in events].count("IntentRecorded") == 1
    assert replay(events, shop()).diverged == ()


async def test_many_runs_on_one_connection_share_group_commits(sqlite_store: Any) -> None:
    runs = 300
    with trio.fail_after(60):
        async with served(sqlite_store) as (sup, _service, url), open_channel(url) as channel:
            created = [None] * runs

            async def create(i: int) -> None:
                created[i] = await channel.create_run("shop", run_id=f"r-{i}")

            async with trio.open_nursery() as nursery:
                for i in range(runs):
                    nursery.start_soon(create, i)
            before = sup.statistics()
            verdicts: list[VerdictOut | None] = [None] * runs

            async def propose(i: int) -> None:
                verdicts[i] = await channel.propose(f"r-{i}", CHARGE, expected_seq=1)

            async with trio.open_nursery() as nursery:
                for i in range(runs):
                    nursery.start_soon(propose, i)
            after = sup.statistics()
    assert all(v is not None and v.accepted and v.key for v in verdicts)
    # each caller got its own run's verdict back over the one connection
    assert [v.run_id for v in verdicts if v is not None] == [f"r-{i}" for i in range(runs)]
    assert len({v.key for v in verdicts if v is not None}) == runs
    flushes = after.flushes - before.flushes
    # one journal write per proposal would be `runs` flushes; concurrent requests of
    # different runs on one connection are decided and written together
    assert 1 <= flushes <= runs // 4, flushes
    assert after.events - before.events >= runs


async def test_the_answers_of_one_run_come_in_order_and_its_requests_are_decided_in_order(
    sqlite_store: Any,
) -> None:
    runs = 40
    with trio.fail_after(60):
        async with served(sqlite_store) as (_sup, _service, url):
            stream = await connect(url)
            requests = []
            next_id = iter(range(1, 10_000))
            expected: dict[str, list[int]] = {}
            for i in range(runs):
                run_id = f"o-{i}"
                ids = [next(next_id) for _ in range(3)]
                expected[run_id] = ids
                requests += [
                    {
                        "id": ids[0],
                        "op": "create_run",
                        "body": {"machine": "shop", "mode": "external", "run_id": run_id},
                    },
                    {"id": ids[1], "op": "propose", "run_id": run_id, "body": {"proposal": BAD}},
                    {"id": ids[2], "op": "propose", "run_id": run_id, "body": {"proposal": CHARGE}},
                ]
            # interleave the runs: request k of every run, then request k+1 of every run
            interleaved = [requests[r * 3 + k] for k in range(3) for r in range(runs)]
            await stream.send_all(b"".join(frame(r) for r in interleaved))
            answers = await read_answers(stream, len(requests))
            await stream.aclose()
    by_id = {a.id: a for a in answers}
    assert len(by_id) == len(requests)
    position = {a.id: n for n, a in enumerate(answers)}
    for run_id, ids in expected.items():
        assert [position[i] for i in ids] == sorted(position[i] for i in ids), run_id
        created, rejected, accepted = (by_id[i] for i in ids)
        assert created.problem is None
        assert created.body["id"] == run_id
        assert rejected.body["accepted"] is False
        assert rejected.body["violations"][0]["code"] == "schema"
        assert accepted.body["accepted"] is True
        assert accepted.body["key"]
        assert rejected.body["seq"] < accepted.body["seq"]


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 17, 4096])
async def test_frames_cut_anywhere_across_reads_are_read_whole(cut: int) -> None:
    """However the bytes arrive (a header cut in two, a frame over many reads, several
    frames and the start of the next in one read), every request is read whole, once."""
    runs = 6
    requests: list[dict[str, Any]] = []
    for i in range(runs):
        run_id = f"cut-{i}"
        requests += [
            {
                "id": 3 * i + 1,
                "op": "create_run",
                "body": {"machine": "shop", "mode": "external", "run_id": run_id},
            },
            {"id": 3 * i + 2, "op": "propose", "run_id": run_id, "body": {"proposal": BAD}},
            {"id": 3 * i + 3, "op": "propose", "run_id": run_id, "body": {"proposal": CHARGE}},
        ]
    data = b"".join(frame(r) for r in requests)
    async with served(MemoryStore()) as (_sup, _service, url):
        with trio.fail_after(60):
            stream = await connect(url)
            for start in range(0, len(data), cut):
                await stream.send_all(data[start : start + cut])
                await trio.sleep(0.001)  # so the server reads this piece on its own
            answers = await read_answers(stream, len(requests))
            await stream.aclose()
    by_id = {a.id: a for a in answers}
    assert sorted(by_id) == [r["id"] for r in requests]
    for i in range(runs):
        created, rejected, accepted = (by_id[3 * i + k] for k in (1, 2, 3))
        assert created.problem is None
        assert created.body["id"] == f"cut-{i}"
        assert rejected.body["violations"][0]["code"] == "schema"
        assert accepted.body["accepted"] is True


async def test_a_connection_ending_inside_a_frame_is_told_how_much_was_read() -> None:
    async with served(MemoryStore()) as (_sup, _service, url):
        with trio.fail_after(60):
            stream = await connect(url)
            whole = frame({"id": 1, "op": "get_run", "run_id": "nope"})
            cut = frame({"id": 2, "op": "get_run", "run_id": "nope"})[:7]
            await stream.send_all(whole + cut)
            await stream.send_eof()
            answers = await read_answers(stream)
            await stream.aclose()
    # the closing problem is queued at once; the request read before it is answered too
    by_id = {a.id: a for a in answers}
    assert len(answers) == 2
    assert sorted(by_id, key=str) == [1, None]
    assert by_id[1].problem is not None
    assert by_id[1].problem.status == 404
    closing = by_id[None].problem
    assert closing is not None
    assert closing.status == 400
    assert closing.detail.startswith("the connection ended inside a frame (7 bytes of it")


async def test_back_pressure_holds_at_most_max_in_flight_requests_of_a_connection() -> None:
    limit = 16
    gate = trio.Event()
    entered = 0

    async with served(MemoryStore(), max_in_flight=limit) as (_sup, service, url):

        async def held_get_run(run_id: str, principal: Any = None) -> Any:
            nonlocal entered
            entered += 1
            await gate.wait()
            raise service_error(run_id)

        from interlock.gateway import GatewayError

        def service_error(run_id: str) -> Exception:
            return GatewayError(404, "Not Found", f"run {run_id!r} not found")

        service.get_run = held_get_run  # type: ignore[method-assign]
        total = 2_000
        with trio.fail_after(60):
            stream = await connect(url)
            await stream.send_all(
                b"".join(
                    frame({"id": i, "op": "get_run", "run_id": f"h-{i}"}) for i in range(total)
                )
            )
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert entered == limit  # the rest wait in the socket, not in a queue
            gate.set()
            answers = await read_answers(stream, total)
            await stream.aclose()
    assert entered == total
    assert {a.id for a in answers} == set(range(total))
    assert all(a.problem is not None and a.problem.status == 404 for a in answers)


async def test_an_oversized_frame_closes_the_connection_with_a_reason_and_only_it() -> None:
    async with served(MemoryStore(), max_frame=1024) as (_sup, _service, url):
        with trio.fail_after(60):
            other = await connect(url)
            stream = await connect(url)
            await stream.send_all(HEADER.pack(5000) + b"x" * 100)
            answers = await read_answers(stream)
            await stream.aclose()
            assert len(answers) == 1
            (closing,) = answers
            assert closing.id is None
            assert closing.problem is not None
            assert closing.problem.status == 413
            assert closing.problem.detail.startswith(
                "a frame announced 5000 bytes, the most is 1024"
            )
            # the other connection is served as before
            await other.send_all(frame({"id": 7, "op": "get_run", "run_id": "nope"}))
            (answer,) = await read_answers(other, 1)
            await other.aclose()
            assert answer.id == 7
            assert answer.problem is not None
            assert answer.problem.status == 404


async def test_an_undecodable_frame_gets_a_problem_and_the_connection_goes_on() -> None:
    async with served(MemoryStore()) as (_sup, _service, url):
        with trio.fail_after(60):
            stream = await connect(url)
            garbage = b"\xc1\xff\x00"
            await stream.send_all(
                HEADER.pack(len(garbage))
                + garbage
                + frame({"id": 3, "op": "fly"})
                + frame({"id": 4, "op": "propose", "run_id": "r", "body": {"proposal": 5}})
                + frame({"id": 5, "op": "get_run"})
                + frame({"id": 6, "op": "get_run", "run_id": "nope"})
            )
            answers = await read_answers(stream, 5)
            await stream.aclose()
    # answers of different requests may come in any order; match them by id
    by_id = {a.id: a for a in answers}
    first, fly, typed, no_run, found = (by_id[i] for i in (None, 3, 4, 5, 6))
    assert first.id is None
    assert first.problem is not None
    assert first.problem.status == 400
    assert first.problem.detail.startswith("the frame is not a request:")
    assert fly.id == 3
    assert fly.problem is not None
    assert fly.problem.detail == f"unknown op 'fly'; the ops are: {', '.join(OPS)}"
    assert typed.id == 4
    assert typed.problem is not None
    assert typed.problem.status == 422
    assert typed.problem.detail.startswith("the body of op 'propose' is invalid: Expected `str`")
    assert no_run.problem is not None
    assert no_run.problem.detail == "op 'get_run' needs run_id: the run it is for"
    assert found.id == 6
    assert found.problem is not None
    assert found.problem.status == 404


async def test_a_server_with_keys_needs_hello_with_a_key_first() -> None:
    key, watcher = "k-" + "x" * 40, "w-" + "y" * 40
    keyring = KeyRing(
        [
            (bytes.fromhex(hash_key(key)), Principal("bot", frozenset({"agent"}))),
            (bytes.fromhex(hash_key(watcher)), Principal("watcher", frozenset({"reader"}))),
        ]
    )
    async with served(MemoryStore(), keyring=keyring) as (_sup, _service, url):
        with trio.fail_after(60):
            with pytest.raises(ChannelProblem, match=r"^401 Unauthorized: the API key is not one"):
                async with open_channel(url, key="wrong"):
                    pass  # pragma: no cover
            stream = await connect(url)
            await stream.send_all(frame({"id": 1, "op": "get_run", "run_id": "x"}))
            (refused,) = await read_answers(stream)
            await stream.aclose()
            assert refused.id == 1
            assert refused.problem is not None
            assert refused.problem.status == 401
            async with open_channel(url, key=key) as channel:
                assert channel.welcome is not None
                assert channel.welcome.principal == "bot"
                run = await channel.create_run("shop", run_id="k-1")
                assert run.mode == "external"
                # one key a connection: the requests taken so far were made with it
                with pytest.raises(ChannelProblem, match=r"^409 Conflict: this connection already"):
                    await channel.request("hello", None, {"key": key}, dict)
            # the key's roles hold on the channel as over HTTP
            async with open_channel(url, key=watcher) as channel:
                assert (await channel.get_run("k-1")).id == "k-1"
                with pytest.raises(ChannelProblem, match=r"^403 Forbidden: key 'watcher' may not"):
                    await channel.propose("k-1", CHARGE, expected_seq=1)


async def test_verify_batches_over_the_channel(sqlite_store: Any) -> None:
    with trio.fail_after(60):
        async with served(sqlite_store) as (_sup, _service, url), open_channel(url) as channel:
            for i in range(5):
                await channel.create_run("shop", run_id=f"v-{i}")
            out = await channel.verify(
                [VerifyItem(run_id=f"v-{i}", proposal=CHARGE, expected_seq=1) for i in range(5)]
                + [VerifyItem(run_id="missing", proposal=CHARGE)]
            )
    assert [v.accepted for v in out.verdicts] == [True] * 5 + [False]
    assert out.verdicts[-1].problem is not None
    assert out.verdicts[-1].problem.status == 404


async def test_a_unix_socket_serves_the_same_channel(tmp_path: Path) -> None:
    path = str(tmp_path / "channel.sock")
    async with served(MemoryStore(), path=path) as (_sup, _service, url):
        assert url == f"unix:{path}"
        with trio.fail_after(60):
            async with open_channel(url) as channel:
                run = await channel.create_run("shop", run_id="u-1")
                verdict = await channel.propose("u-1", CHARGE, expected_seq=run.seq)
                assert verdict.accepted


def test_bad_arguments_are_refused_with_what_to_fix() -> None:
    with pytest.raises(ValueError, match=r"^channel url 'http://x:1' is not tcp://HOST:PORT"):
        open_channel("http://x:1")

    async def main() -> None:
        async with open_supervisor([shop()]) as sup:
            with pytest.raises(ValueError, match=r"^refusing to serve on '0.0.0.0' without"):
                await serve_channel(GatewayService(sup), host="0.0.0.0", keyring=KeyRing())
            with pytest.raises(ValueError, match=r"^max_in_flight must be at least 1, got 0"):
                await serve_channel(GatewayService(sup), max_in_flight=0)

    trio.run(main)


# -- fuzzing ----------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.one_of(
    msgpack_values,
    st.fixed_dictionaries(
        {},
        optional={
            "proposal": st.sampled_from([CHARGE, DONE, BAD, "", "{"]) | msgpack_values,
            "expected_seq": st.integers(min_value=-2, max_value=5) | msgpack_values,
            "machine": st.sampled_from(["shop", "nope"]) | msgpack_values,
            "mode": st.sampled_from(["external", "hosted"]) | msgpack_values,
            "run_id": st.sampled_from(["f-1", "f-2", ""]) | msgpack_values,
            "key": st.text(max_size=10) | msgpack_values,
            "items": st.lists(
                st.fixed_dictionaries(
                    {"run_id": st.sampled_from(["f-1", "f-2"]), "proposal": st.just(CHARGE)}
                ),
                max_size=3,
            )
            | msgpack_values,
            "usage": msgpack_values,
        },
    ),
)
requests = st.fixed_dictionaries(
    {
        "id": st.integers(min_value=0, max_value=2**63 - 1) | msgpack_values,
        "op": st.sampled_from(OPS) | st.text(max_size=8) | msgpack_values,
    },
    optional={
        "run_id": st.sampled_from(["f-1", "f-2", "nope", ""]) | msgpack_values,
        "body": bodies,
        "extra": msgpack_values,
    },
)
chunks = st.one_of(
    st.builds(frame, requests),
    st.builds(frame, msgpack_values),
    st.binary(max_size=64),
    st.builds(
        lambda n, tail: HEADER.pack(n) + tail, st.integers(0, 2**32 - 1), st.binary(max_size=16)
    ),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(sent=st.lists(chunks, min_size=1, max_size=8))
async def test_no_frame_crashes_the_server_and_each_is_answered_or_the_connection_closed(
    sent: list[bytes],
) -> None:
    async with served(MemoryStore(), max_frame=4096) as (_sup, _service, url):
        with trio.fail_after(60):
            async with open_channel(url) as channel:
                await channel.create_run("shop", run_id="f-1")
            stream = await connect(url)
            try:
                await stream.send_all(b"".join(sent))
                await stream.send_eof()
            except trio.BrokenResourceError:
                pass  # the server closed first (broken framing); it said why, below
            answers: list[Answer] = []
            try:
                answers = await read_answers(stream)
            except trio.BrokenResourceError:
                pass  # a reset after its closing frame
            finally:
                await stream.aclose()
            for answer in answers:
                problem = answer.problem
                assert problem is None or 400 <= problem.status < 500, problem
                if answer.id is None:
                    # a connection-level problem: an undecodable frame, or the last word
                    assert problem is not None
            # the server and its other connections live on
            async with open_channel(url) as channel:
                run = await channel.get_run("f-1")
                assert run.id == "f-1"


async def test_a_drain_answers_what_it_took_says_why_and_stops_accepting() -> None:
    stop = trio.Event()
    store = MemoryStore()
    runs = 200
    async with served(store, shutdown_trigger=stop.wait) as (_sup, _service, url):
        with trio.fail_after(60):
            async with open_channel(url) as channel:
                for i in range(runs):
                    await channel.create_run("shop", run_id=f"d-{i}")
            stream = await connect(url)
            await stream.send_all(
                b"".join(
                    frame(
                        {
                            "id": i,
                            "op": "propose",
                            "run_id": f"d-{i}",
                            "body": {"proposal": CHARGE, "expected_seq": 1},
                        }
                    )
                    for i in range(runs)
                )
            )
            buffer = bytearray()
            first = await read_answers(stream, 1, buffer)  # the server is at work
            stop.set()
            answers = first + await read_answers(stream, None, buffer)
            await stream.aclose()
            *answered, last = answers
            assert last.id is None
            assert last.problem is not None
            assert last.problem.status == 503
            assert last.problem.detail.startswith("the gateway is shutting down;")
            with pytest.raises(
                OSError, match=r"^all attempts to connect to 127\.0\.0\.1:\d+ failed$"
            ):
                await connect(url)
    # every answer sent is a verdict whose intent is in the journal
    assert answered
    for answer in answered:
        assert answer.problem is None
        key = answer.body["key"]
        events = await store.load(f"d-{answer.id}")
        assert [
            getattr(e, "key", None) for e in events if type(e).__name__ == "IntentRecorded"
        ] == [key]


async def test_a_client_that_reads_nothing_is_closed_after_send_timeout(
    tmp_path: Path, autojump_clock: Any
) -> None:
    path = str(tmp_path / "c.sock")
    total = 50_000
    async with served(MemoryStore(), path=path, send_timeout=5.0) as (_sup, _service, url):
        stream = await trio.open_unix_socket(path)
        flood = b"".join(
            frame({"id": i, "op": "get_run", "run_id": f"n-{i}"}) for i in range(total)
        )

        async def send() -> None:
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(flood)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await trio.sleep(30)  # virtual time: the server gives up after 5 s
            answers: list[Answer] = []
            with contextlib.suppress(trio.BrokenResourceError):
                answers = await read_answers(stream)
            nursery.cancel_scope.cancel()
        await stream.aclose()
        assert len(answers) < total  # it was cut off, not answered in full
        async with open_channel(url) as channel:  # and the server goes on
            with pytest.raises(ChannelProblem, match=r"^404 Not Found"):
                await channel.get_run("n-1")


async def test_a_rate_limiter_counts_each_request_frame_against_its_key() -> None:
    limiter = RateLimiter(1.0, 2, clock=lambda: 0.0)  # time stands still: 2 requests, then none
    async with served(MemoryStore(), rate_limiter=limiter) as (_sup, _service, url):
        with trio.fail_after(60):
            async with open_channel(url) as channel:
                await channel.create_run("shop", run_id="t-1")
                await channel.get_run("t-1")
                with pytest.raises(
                    ChannelProblem,
                    match=r"^429 Too many requests: key 'anonymous' is over its rate of 1 "
                    r"requests per second; retry after 1 s",
                ) as refused:
                    await channel.get_run("t-1")
    assert refused.value.problem.type.endswith("/rate-limited")


@pytest.mark.parametrize("runs", [1, 50])
async def test_proposals_read_together_are_batched_and_each_run_keeps_its_order(
    runs: int,
) -> None:
    store = MemoryStore()
    with trio.fail_after(60):
        async with served(store) as (_sup, _service, url):
            async with open_channel(url) as channel:
                for i in range(runs):
                    await channel.create_run("shop", run_id=f"b-{i}")
            stream = await connect(url)
            # per run: a rejected proposal, then the accepted one, then the report of its
            # call; all in one write, so they are read together
            frames = [
                {"id": 1000 + i, "op": "propose", "run_id": f"b-{i}", "body": {"proposal": BAD}}
                for i in range(runs)
            ] + [
                {"id": 2000 + i, "op": "propose", "run_id": f"b-{i}", "body": {"proposal": CHARGE}}
                for i in range(runs)
            ]
            await stream.send_all(b"".join(frame(f) for f in frames))
            answers = await read_answers(stream, len(frames))
            await stream.aclose()
    position = {a.id: n for n, a in enumerate(answers)}
    by_id = {a.id: a for a in answers}
    for i in range(runs):
        rejected, accepted = by_id[1000 + i], by_id[2000 + i]
        assert position[1000 + i] < position[2000 + i]
        assert rejected.body["accepted"] is False
        assert accepted.body["accepted"] is True
        assert accepted.body["seq"] > rejected.body["seq"]
        kinds = [type(e).__name__ for e in await store.load(f"b-{i}")]
        assert kinds.count("ProposalRejected") == 1
        assert kinds[-1] == "IntentRecorded"
