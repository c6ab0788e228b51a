"""The gateway's streaming channel: length-prefixed msgpack frames on a TCP or Unix socket.

One persistent connection carries many requests at once (pipelined), for many runs: each
frame is a 4-byte big-endian length and a msgpack map. A request is
``{id, op, run_id?, body?}``: ``id`` is the caller's correlation id (an integer echoed in
the answer), ``op`` one of :data:`OPS`, ``body`` the same Struct as the HTTP API's request
body (``ProposalIn``, ``ResultIn``, ``RunCreate``, ``VerifyIn``). An answer is
``{id, body}`` or ``{id, problem}`` (``Problem``, as in problem+json). An answer with
``id`` nil concerns the connection, not a request: a frame that is not a request, or the
server's last frame before it closes the connection (a length it will not read, a frame
cut short by the end of the connection, a drain). A refused key is answered with the id of
the request that carried (or lacked) it, and the connection closes after it.

Requests of one run are handled one after another and answered in the order they came;
requests of different runs are handled concurrently, and the proposals of different runs
read together go to the service as one verify batch, so they are decided and journaled in
the same group commit; each verdict is sent as soon as its batch is durable. The server keeps at most ``max_in_flight`` requests of a
connection unanswered; past that it stops reading it (back-pressure through the socket,
never an unbounded queue).

Why frames on a socket and not a WebSocket: measured in benchmarks/gateway_channel.md,
the server spends 2.1-2.6 us of CPU per message on frames, 4.5-5.8 us on a WebSocket
carrying packs of frames, and 136-197 us on a WebSocket with one message per proposal
(hypercorn's trio worker). End to end over the real service on SQLite (the split in
benchmarks/RESULTS.md), an accepted proposal costs the server ~30-35 us of CPU: the journal
the largest part, then the decide path; the channel's own code (frames read and decoded,
answers encoded and written) is a few us of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import msgspec
import trio

from .._aio import Wakeup
from ..protocol import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_IN_FLIGHT,
    HEADER,
    OPS,
    ChannelHello,
    ChannelRequest,
    ChannelWelcome,
    FrameId,
    Problem,
    ProposalIn,
    ResultIn,
    RunCreate,
    VerifyIn,
)
from ._connections import BudgetListener, ConnectionBudget
from ._guard import RateLimiter, retry_after
from ._keys import KeyRing, Unauthorized, check_bind
from ._service import PROBLEMS, GatewayError, GatewayService

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._service import PrincipalLike

__all__ = ["serve_channel"]

log = logging.getLogger("interlock.gateway")

_READ: Final = 65536


class _Answer(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: int | None
    body: Any = None
    problem: Problem | None = None


class _IdOnly(msgspec.Struct):
    id: FrameId


_ENCODER = msgspec.msgpack.Encoder()
_ENCODE_INTO = _ENCODER.encode_into
_NO_LENGTH: Final = bytes(4)  # a frame's length, written once its body is
_DECODE_REQUEST = msgspec.msgpack.Decoder(ChannelRequest).decode
_DECODE_ID = msgspec.msgpack.Decoder(_IdOnly).decode
_BODIES: dict[str, Any] = {
    "hello": msgspec.msgpack.Decoder(ChannelHello | None).decode,
    "get_run": msgspec.msgpack.Decoder(None).decode,
    "create_run": msgspec.msgpack.Decoder(RunCreate).decode,
    "propose": msgspec.msgpack.Decoder(ProposalIn).decode,
    "report": msgspec.msgpack.Decoder(ResultIn).decode,
    "verify": msgspec.msgpack.Decoder(VerifyIn).decode,
}
_DECODE_PROPOSAL = _BODIES["propose"]
_NEEDS_RUN: Final = frozenset({"get_run", "propose", "report"})


def _problem(status: int, title: str, detail: str, slug: str | None = None) -> Problem:
    slug = slug or title.lower().replace(" ", "-")
    return Problem(type=PROBLEMS + slug, title=title, status=status, detail=detail)


_INTERNAL: Final = _problem(
    500,
    "Internal Server Error",
    "the gateway failed on this request (a bug; it is logged); retry, and report it if it persists",
)


def _bad_body(op: str, exc: Exception) -> GatewayError:
    return GatewayError(422, "Unprocessable Content", f"the body of op {op!r} is invalid: {exc}")


class _Batch:
    """Proposals of different runs, read together, for one worker to verify as a batch."""

    __slots__ = ("requests",)

    def __init__(self, requests: list[ChannelRequest]) -> None:
        self.requests = requests


class _Closing(Exception):
    """The connection must close, after this problem is sent."""

    def __init__(self, problem: Problem, request_id: int | None = None) -> None:
        super().__init__(problem.detail)
        self.problem = problem
        self.request_id = request_id


class _Connection:
    """One client connection: a reader, per-run workers and a writer."""

    def __init__(
        self,
        service: GatewayService,
        stream: trio.abc.Stream,
        keyring: KeyRing,
        max_in_flight: int,
        max_frame: int,
        send_timeout: float,
        rate_limiter: RateLimiter | None,
    ) -> None:
        self.service = service
        self.send_timeout = send_timeout
        self.rate_limiter = rate_limiter
        self.stream = stream
        self.keyring = keyring
        self.max_in_flight = max_in_flight
        self.max_frame = max_frame
        self.principal: PrincipalLike | None = (
            keyring.authenticate(None) if keyring.open else None  # type: ignore[assignment]
        )
        self.in_flight = 0
        self.runs: dict[str, deque[ChannelRequest]] = {}
        # runs (their ids), requests of no run and batches, waiting for a worker
        self.ready: deque[str | ChannelRequest | _Batch] = deque()
        # proposals of idle runs read together, verified as one batch (one group commit)
        self.batch: list[ChannelRequest] = []
        self.nursery: trio.Nursery | None = None
        self.idle: list[trio.lowlevel.Task] = []  # workers waiting for work
        self.out = bytearray()
        self.out_answers = 0  # answers in self.out whose slot frees once they are sent
        self.wake_writer = Wakeup()
        self.slot_freed = Wakeup()  # the reader, or serve() draining, waits on it
        self.broken = False
        self.closing = False
        self.stopping = False
        self.greeted = False
        self.trace: str | None = None  # the hello's traceparent (see ChannelHello)
        self.reading = trio.CancelScope()
        self.idle_timeout: float | None = None
        self.heard = False  # a first byte came
        self.silence = trio.CancelScope()  # waits for the first byte, then hangs up
        self.on_heard: Callable[[], object] | None = None

    def hang_up(self) -> None:
        """Close a connection that has sent nothing: no answer is owed."""
        self.reading.cancel()

    async def _hang_up_if_silent(self, seconds: float) -> None:
        with self.silence:
            await trio.sleep(seconds)
            log.info("channel: closing a connection that sent nothing in %g s", seconds)
            self.hang_up()

    def _heard(self) -> None:
        self.heard = True
        self.silence.cancel()
        if self.on_heard is not None:
            self.on_heard()

    def stop(self) -> None:
        """Take no more requests; answer those taken, say why, and close."""
        self.stopping = True
        self.reading.cancel()

    async def serve(self, idle_timeout: float | None = None) -> None:
        """Serve the connection; ``idle_timeout``: seconds it may stay silent before its
        first byte, or inside a frame, before it is closed (None: no limit)."""
        self.idle_timeout = idle_timeout
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._writer)
            if idle_timeout is not None:
                nursery.start_soon(self._hang_up_if_silent, idle_timeout)
            try:
                with self.reading:
                    await self._reader(nursery)
            except _Closing as closing:
                self._queue(_Answer(id=closing.request_id, problem=closing.problem), slot=False)
                log.info("channel: closing a connection: %s", closing.problem.detail)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.broken = True
            finally:
                self.silence.cancel()
            self._flush_batch()
            # NOTE: the requests already taken are finished (their effects may be journaled
            # by now) and answered, then the writer flushes; only then does the socket close.
            while (self.in_flight or self.out) and not self.broken:
                await self.slot_freed.wait()
            if self.stopping and not self.broken:
                self._queue(
                    _Answer(
                        id=None,
                        problem=_problem(
                            503,
                            "Service Unavailable",
                            "the gateway is shutting down; every request sent before this "
                            "was answered; reconnect and send the others again",
                        ),
                    ),
                    slot=False,
                )
                while self.out and not self.broken:
                    await self.slot_freed.wait()
            self.closing = True
            self.wake_writer.wake()
            idle, self.idle = self.idle, []
            for task in idle:
                trio.lowlevel.reschedule(task)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.stream.aclose()

    # -- reading --------------------------------------------------------------------

    async def _reader(self, nursery: trio.Nursery) -> None:
        # NOTE: frames are sliced out of each read as it came (one copy per frame); only
        # a frame cut across reads is gathered in ``partial`` until it is whole.
        partial = bytearray()
        max_frame = self.max_frame
        max_in_flight = self.max_in_flight
        unpack = HEADER.unpack_from
        take = self._take
        receive = self.stream.receive_some
        idle_timeout = self.idle_timeout
        while True:
            self._flush_batch()
            if partial and idle_timeout is not None:
                # NOTE: a frame begun must go on arriving: one left unfinished would hold
                # the connection (and its place in the budget) for ever. Only a read that
                # waits for the rest of a frame pays for the timer.
                data = b""
                with trio.move_on_after(idle_timeout) as waiting:
                    data = await receive(_READ)
                if waiting.cancelled_caught:
                    raise _Closing(
                        _problem(
                            408,
                            "Request Timeout",
                            f"a frame was begun and not finished within {idle_timeout:g} s "
                            f"({len(partial)} bytes of it were read); send each frame whole, "
                            "without pausing inside it",
                        )
                    )
            else:
                data = await receive(_READ)
            if not self.heard:
                self._heard()
            if not data:
                if partial:
                    raise _Closing(
                        _problem(
                            400,
                            "Bad Request",
                            f"the connection ended inside a frame ({len(partial)} bytes of it "
                            "were read); send whole frames: a 4-byte big-endian length, then "
                            "that many bytes of msgpack",
                        )
                    )
                return
            if partial:
                partial += data
                if len(partial) < 4:
                    continue
                (size,) = unpack(partial, 0)
                if size > max_frame or size == 0:
                    raise _Closing(self._bad_size(size))
                if len(partial) - 4 < size:
                    continue  # the frame is not whole yet
                data = bytes(partial)
                partial = bytearray()
            pos = 0
            while True:
                # the whole frames of data (see _take_frames); it stops at the frame
                # that would pass max_in_flight
                pos, status, size = _take_frames(self, data, pos, take, nursery)
                if status == _BAD_SIZE:
                    raise _Closing(self._bad_size(size))
                if status != _FULL:
                    break
                while self.in_flight >= max_in_flight:
                    # NOTE: back-pressure: stop reading until an answer is sent, so the
                    # client's socket fills and its writes wait
                    self._flush_batch()
                    await self.slot_freed.wait()
            if pos < len(data):
                partial += memoryview(data)[pos:]

    def _bad_size(self, size: int) -> Problem:
        if size == 0:
            return _problem(
                400,
                "Bad Request",
                "a frame announced 0 bytes; every frame holds a msgpack map "
                "{id, op, run_id?, body?}",
            )
        return _problem(
            413,
            "Content Too Large",
            f"a frame announced {size} bytes, the most is {self.max_frame}; send smaller "
            "frames (split a verify batch), or check that each frame starts with its "
            "4-byte big-endian length",
        )

    def _take(
        self, payload: bytes, nursery: trio.Nursery, request: ChannelRequest | None = None
    ) -> None:
        """Decode one frame (unless ``request`` is it, decoded) and hand it to its run's
        worker (or answer it at once)."""
        try:
            if request is None:
                request = _DECODE_REQUEST(payload)
        except msgspec.DecodeError as exc:
            request_id = self._id_of(payload)
            self._queue(
                _Answer(
                    id=request_id,
                    problem=_problem(
                        400 if request_id is None else 422,
                        "Bad Request" if request_id is None else "Unprocessable Content",
                        f"the frame is not a request: {exc}; send a msgpack map "
                        "{id: int, op: str, run_id?: str, body?: ...}",
                    ),
                ),
                slot=False,
            )
            return
        op = request.op
        if (
            op == "propose"
            and request.run_id
            and self.principal is not None
            and self.rate_limiter is None
        ):
            # NOTE: the common frame, taken as the general path below takes it (nothing
            # to refuse), with none of its checks (_take_frames takes it so too).
            self.in_flight += 1
            run_id = request.run_id
            queue = self.runs.get(run_id)
            if queue is not None:
                queue.append(request)
            else:
                self.runs[run_id] = deque()
                self.batch.append(request)
            return
        if op not in OPS:
            self._refuse(
                request,
                400,
                f"unknown op {op[:100]!r}; the ops are: {', '.join(OPS)}",
            )
            return
        if op == "hello":
            # NOTE: answered here, in order, so a client may pipeline its first requests
            # right behind its hello
            if self.greeted:
                self._queue(
                    _Answer(
                        id=request.id,
                        problem=_problem(
                            409,
                            "Conflict",
                            "this connection already said hello; the requests on it are "
                            "made with that key; open another connection for another key",
                        ),
                    ),
                    slot=False,
                )
                return
            try:
                welcome = self._hello(self._body(request))
            except GatewayError as exc:
                self._queue(_Answer(id=request.id, problem=exc.problem()), slot=False)
                return
            except _Closing as closing:
                closing.request_id = request.id
                raise
            self.greeted = True
            self._queue(_Answer(id=request.id, body=welcome), slot=False)
            return
        if self.principal is None:
            raise _Closing(
                _problem(
                    401,
                    "Unauthorized",
                    "this server needs an API key; send {op: 'hello', body: {key: <key>}} "
                    "as the first frame",
                ),
                request.id,
            )
        if op in _NEEDS_RUN and not request.run_id:
            self._refuse(request, 400, f"op {op!r} needs run_id: the run it is for")
            return
        limiter = self.rate_limiter
        if limiter is not None and self.principal is not None:
            wait = limiter.check(self.principal.name)
            if wait:
                seconds = retry_after(wait)
                problem = _problem(
                    429,
                    "Too many requests",
                    f"key {self.principal.name!r} is over its rate of {limiter.rate:g} "
                    f"requests per second; retry after {seconds} s, or send a verify batch",
                    slug="rate-limited",
                )
                self._queue(_Answer(id=request.id, problem=problem), slot=False)
                return
        key = request.run_id if op in _NEEDS_RUN else None
        if op == "create_run":
            # the run a pipelined create_run makes is the run its proposals name
            key = self._created_id(request)
        self.in_flight += 1
        if key is None:
            self._schedule(request, nursery)
            return
        queue = self.runs.get(key)
        if queue is not None:
            queue.append(request)  # its worker takes it after the run's earlier requests
            return
        if op == "propose":
            # the run is busy (its later requests queue) until the batch is answered
            self.runs[key] = deque()
            self.batch.append(request)
            return
        self.runs[key] = deque((request,))
        self._schedule(key, nursery)

    def _flush_batch(self) -> None:
        """Hand the proposals read together to one worker, as one batch."""
        batch = self.batch
        if not batch:
            return
        self.batch = []
        assert self.nursery is not None
        if len(batch) == 1:
            (request,) = batch
            assert request.run_id is not None
            # first: the run's requests read after it wait behind it
            self.runs[request.run_id].appendleft(request)
            self._schedule(request.run_id, self.nursery)
        else:
            self._schedule(_Batch(batch), self.nursery)

    def _schedule(self, item: str | ChannelRequest | _Batch, nursery: trio.Nursery) -> None:
        self.ready.append(item)
        if self.idle:
            trio.lowlevel.reschedule(self.idle.pop())
        else:
            nursery.start_soon(self._worker)

    @staticmethod
    def _id_of(payload: bytes) -> int | None:
        try:
            return _DECODE_ID(payload).id
        except (msgspec.DecodeError, TypeError):
            return None

    @staticmethod
    def _created_id(request: ChannelRequest) -> str | None:
        try:
            run_id = msgspec.msgpack.decode(request.body)
        except msgspec.DecodeError:
            return None
        if isinstance(run_id, dict):
            value = run_id.get("run_id")
            if isinstance(value, str):
                return value
        return None

    def _refuse(self, request: ChannelRequest, status: int, detail: str) -> None:
        title = "Bad Request" if status == 400 else "Unprocessable Content"
        self._queue(_Answer(id=request.id, problem=_problem(status, title, detail)), slot=False)

    # -- handling -------------------------------------------------------------------

    async def _worker(self) -> None:
        # NOTE: workers outlive their requests and wait for the next one: starting a
        # task per request cost a third of the channel's own CPU. There are never more
        # workers than requests once held at the same time (at most max_in_flight).
        ready = self.ready
        task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            with contextlib.suppress(ValueError):
                self.idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        while True:
            while not ready:
                if self.closing:
                    return
                self.idle.append(task)
                await trio.lowlevel.wait_task_rescheduled(abort)
            item = ready.popleft()
            if isinstance(item, str):
                queue = self.runs[item]
                try:
                    while queue:
                        await self._one(queue.popleft())
                finally:
                    del self.runs[item]
            elif isinstance(item, _Batch):
                await self._verify(item.requests)
            else:
                await self._one(item)

    async def _verify(self, requests: list[ChannelRequest]) -> None:
        """Answer proposals of many runs (one each) through one verify batch.

        NOTE: the service decides a batch in one task and waits for one durable write,
        where single proposals would take a task wake-up each; the answers are the same,
        and all of them go into the writer's buffer at once. The passes over the batch
        (bodies decoded, answers framed, runs released) are one loop each (see
        _take_bodies, _frame_verdicts, _release_runs).
        """
        taken: list[ChannelRequest] = []
        run_ids: list[str] = []
        bodies: list[ProposalIn] = []
        try:
            _take_bodies(requests, _DECODE_PROPOSAL, self._bad_proposal, taken, run_ids, bodies)
            if bodies:
                await self._verify_items(taken, run_ids, bodies)
        finally:
            # each run's later requests (read while the batch was decided) go on, in order
            _release_runs(requests, self.runs, self._reschedule)

    def _bad_proposal(self, request: ChannelRequest, exc: Exception) -> None:
        self._queue(_Answer(id=request.id, problem=_bad_body("propose", exc).problem()), slot=True)

    def _reschedule(self, run_id: str) -> None:
        self._schedule(run_id, self.nursery)  # type: ignore[arg-type]

    async def _verify_items(
        self, requests: list[ChannelRequest], run_ids: list[str], bodies: list[ProposalIn]
    ) -> None:
        """Verify ``bodies`` as one batch and queue each request's answer, in order."""
        try:
            verdicts = await self.service.verify_many(run_ids, bodies, self.principal, self.trace)
            if len(verdicts) != len(bodies):  # pragma: no cover - a bug in the service
                raise RuntimeError(f"{len(verdicts)} verdicts for {len(bodies)} proposals")
        except GatewayError as exc:
            self._queue_all([_Answer(id=r.id, problem=exc.problem()) for r in requests])
            return
        except Exception:  # a bug: answered, logged, and the connection goes on
            log.exception("channel: a batch of %d proposals failed", len(bodies))
            self._queue_all([_Answer(id=r.id, problem=_INTERNAL) for r in requests])
            return
        _frame_verdicts(self.out, requests, verdicts, self._put)
        self.out_answers += len(requests)
        self.wake_writer.wake()

    async def _one(self, request: ChannelRequest) -> None:
        try:
            body = await self._handle(request)
            answer = _Answer(id=request.id, body=body)
        except GatewayError as exc:
            answer = _Answer(id=request.id, problem=exc.problem())
        except Exception:  # a bug: answered, logged, and the connection goes on
            log.exception("channel: request %r (op %r) failed", request.id, request.op)
            answer = _Answer(id=request.id, problem=_INTERNAL)
        self._queue(answer, slot=True)

    @staticmethod
    def _body(request: ChannelRequest) -> Any:
        """The request's body as its op's Struct (None for get_run)."""
        op = request.op
        decode = _BODIES.get(op)
        if decode is None:
            return None
        try:
            return decode(request.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise _bad_body(op, exc) from None

    async def _handle(self, request: ChannelRequest) -> Any:
        op = request.op
        body = self._body(request)
        service = self.service
        principal = self.principal
        run_id = request.run_id or ""
        match op:
            case "propose":
                return await service.propose(run_id, body, principal, self.trace)
            case "report":
                return await service.report(run_id, body, principal)
            case "verify":
                return await service.verify_batch(body, principal, self.trace)
            case "create_run":
                run, _created = await service.create_run(body, principal, self.trace)
                return run
            case "get_run":
                return await service.get_run(run_id, principal)
        raise AssertionError(op)  # pragma: no cover - _take checks the op

    def _hello(self, hello: ChannelHello | None) -> ChannelWelcome:
        key = hello.key if hello is not None else None
        try:
            principal = self.keyring.authenticate(None if key is None else f"Bearer {key}")
        except Unauthorized as exc:
            raise _Closing(_problem(401, "Unauthorized", str(exc))) from None
        self.principal = principal  # type: ignore[assignment]
        self.trace = hello.traceparent if hello is not None else None
        return ChannelWelcome(
            principal=principal.name,
            max_in_flight=self.max_in_flight,
            max_frame=self.max_frame,
            ops=list(OPS),
        )

    # -- writing --------------------------------------------------------------------

    def _queue(self, answer: _Answer, *, slot: bool) -> None:
        self._put(answer)
        if slot:
            self.out_answers += 1
        self.wake_writer.wake()

    def _queue_all(self, answers: list[_Answer]) -> None:
        """Queue many answers, each of which frees a slot, with one wake-up of the writer."""
        put = self._put
        for answer in answers:
            put(answer)
        self.out_answers += len(answers)
        self.wake_writer.wake()

    def _put(self, answer: _Answer) -> None:
        """Frame ``answer`` into the writer's buffer: encoded in place, after its length."""
        out = self.out
        start = len(out)
        out += _NO_LENGTH
        try:
            _ENCODE_INTO(answer, out, -1)
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:  # pragma: no cover
            log.exception("channel: an answer could not be encoded")
            del out[start + 4 :]
            _ENCODE_INTO(
                _Answer(
                    id=answer.id,
                    problem=_problem(500, "Internal Server Error", f"unencodable answer: {exc}"),
                ),
                out,
                -1,
            )
        HEADER.pack_into(out, start, len(out) - start - 4)

    def _break(self) -> None:
        self.broken = True
        self.reading.cancel()

    async def _writer(self) -> None:
        while True:
            while not self.out:
                if self.closing:
                    return
                await self.wake_writer.wait()
            data, self.out = self.out, bytearray()
            freed, self.out_answers = self.out_answers, 0
            if not self.broken:
                try:
                    with trio.move_on_after(self.send_timeout) as timer:
                        await self.stream.send_all(data)
                    if timer.cancelled_caught:
                        log.info(
                            "channel: a client read no answer for %g s; closing it",
                            self.send_timeout,
                        )
                        self._break()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._break()  # the answers are dropped; the work goes on
            self.in_flight -= freed
            self.slot_freed.wake()


async def serve_channel(
    service: GatewayService,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    path: str | None = None,
    keyring: KeyRing | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    max_frame: int = DEFAULT_MAX_FRAME,
    send_timeout: float = 60.0,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    graceful_timeout: float = 10.0,
    rate_limiter: RateLimiter | None = None,
    connections: ConnectionBudget | None = None,
    first_frame_timeout: float | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the streaming channel over ``service`` until cancelled, or drained.

    Listens on ``host:port`` (TCP), or on the Unix socket ``path`` when given. Each
    connection is served in its own task: a broken or hostile client ends only its own
    connection. When ``shutdown_trigger()`` returns, the channel drains: it stops
    accepting, each connection stops reading, answers the requests it took, sends a 503
    problem frame (id nil) saying so, and closes; then this returns.

    Args:
      service: the gateway's service (``GatewayApp.service``, or one made over a running
        supervisor).
      host: the address to bind; without API keys only loopback is allowed.
      port: the TCP port; 0 picks a free one.
      path: a Unix socket to listen on instead of TCP (a stale socket file is replaced).
      keyring: the API keys; default ``KeyRing.from_env()``. With keys, a connection's
        first frame must be ``hello`` with a key.
      max_in_flight: the most requests of one connection held unanswered; past it the
        server stops reading that connection.
      max_frame: the largest frame accepted, in bytes; a larger one closes the
        connection with a 413 problem.
      send_timeout: seconds an answer may wait for a client that reads nothing before
        its connection is closed.
      shutdown_trigger: an async callable; when it returns, the channel drains.
      graceful_timeout: seconds the connections get to drain before they are cancelled.
      rate_limiter: counts every request frame against its key's rate (the HTTP guard's
        ``RateLimiter``, shared or its own); over it, a 429 problem. None: no limit.
      connections: the budget of connections held at once (shared with the HTTP server);
        a connection that has sent nothing yet gives way to a new one when it is full.
        None: no budget.
      first_frame_timeout: seconds a new connection may stay silent, or a frame begun may
        wait for its rest, before the connection is closed; None: no limit.
      task_status: receives the channel's address, ``tcp://HOST:PORT`` or
        ``unix:PATH``, once it listens (pass it to ``open_channel``).

    Raises:
      ValueError: a non-loopback ``host`` with no API key, limits below 1, or ``path``
        naming a file that is not a socket.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    if max_frame < 16:
        raise ValueError(f"max_frame must be at least 16 bytes, got {max_frame}")
    if not send_timeout > 0 or not graceful_timeout >= 0:
        raise ValueError(
            f"send_timeout must be > 0 and graceful_timeout >= 0 seconds, got "
            f"{send_timeout} and {graceful_timeout}"
        )
    keyring = KeyRing.from_env() if keyring is None else keyring
    listeners: list[trio.SocketListener]
    if path is not None:
        check_bind(f"unix:{path}", keyring)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise ValueError(
                    f"{path!r} exists and is not a socket; pass a path for the channel's "
                    "Unix socket that is free (or a stale socket)"
                )
            os.unlink(path)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(path)
        sock.listen(1024)
        listeners = [trio.SocketListener(sock)]
        address = f"unix:{path}"
    else:
        check_bind(host, keyring)
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        address = f"tcp://{shown}:{bound[1]}"

    if connections is not None:
        listeners = [BudgetListener(listener, connections) for listener in listeners]  # type: ignore[misc]
    budget = connections
    connections_open: set[_Connection] = set()
    draining = trio.Event()

    async def handle(stream: trio.SocketStream) -> None:
        connection = _Connection(
            service, stream, keyring, max_in_flight, max_frame, send_timeout, rate_limiter
        )
        connections_open.add(connection)
        if budget is not None:
            # NOTE: a connection that has said nothing may be a bare connect holding a
            # descriptor; it gives way first when the budget is full.
            budget.idle(connection, connection.hang_up)
            connection.on_heard = partial(budget.busy, connection)
        if draining.is_set():  # accepted just before the listeners closed
            connection.stop()
        try:
            await connection.serve(first_frame_timeout)
        except Exception:  # pragma: no cover - a bug must not end the other connections
            log.exception("channel: a connection failed")
        finally:
            connections_open.discard(connection)
            if budget is not None:
                budget.release(connection)

    log.info("interlock channel listening on %s", address)
    try:
        async with trio.open_nursery() as serving:
            async with trio.open_nursery() as accepting:
                await accepting.start(
                    partial(trio.serve_listeners, handle, listeners, handler_nursery=serving)
                )
                task_status.started(address)
                if shutdown_trigger is None:
                    await trio.sleep_forever()
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            for listener in listeners:
                await listener.aclose()
            draining.set()
            log.info("channel: draining %d connections", len(connections_open))
            for connection in list(connections_open):
                connection.stop()
            serving.cancel_scope.deadline = trio.current_time() + graceful_timeout
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


# -- a batch's passes --------------------------------------------------------------------

#: What _take_frames says: no whole frame left; the next frame would pass max_in_flight;
#: the next frame's length is 0 or past max_frame.
_DONE, _FULL, _BAD_SIZE = 0, 1, 2


def _take_frames(
    conn: _Connection,
    data: bytes,
    pos: int,
    take: Callable[..., None],
    nursery: trio.Nursery,
) -> tuple[int, int, int]:
    """Take the whole frames of ``data`` from ``pos`` on (``take``,
    :meth:`_Connection._take`, each): ``(pos, status, size)``, where ``pos`` is past the
    last frame taken and ``status`` says why it stopped (:data:`_DONE`, :data:`_FULL`, or
    :data:`_BAD_SIZE` with the length ``size`` the frame at ``pos`` announced).

    A proposal on a connection that said hello and has no rate limit (the common frame)
    is taken here as ``_take`` takes it, without its Python frame; ``take`` gets any
    other frame, with its request if it was decoded here."""
    end = len(data)
    max_frame = conn.max_frame
    unpack = HEADER.unpack_from
    decode = _DECODE_REQUEST
    fast = conn.principal is not None and conn.rate_limiter is None
    while end - pos >= 4:
        (size,) = unpack(data, pos)
        if size > max_frame or size == 0:
            return pos, _BAD_SIZE, size
        if end - pos - 4 < size:
            break
        if conn.in_flight >= conn.max_in_flight:
            return pos, _FULL, 0
        payload = data[pos + 4 : pos + 4 + size]
        pos += 4 + size
        if fast:
            try:
                request = decode(payload)
            except msgspec.DecodeError:
                take(payload, nursery)  # it answers the frame that is not a request
                continue
            run_id = request.run_id
            if request.op == "propose" and run_id:
                conn.in_flight += 1
                runs = conn.runs
                queue = runs.get(run_id)
                if queue is not None:
                    queue.append(request)
                else:
                    runs[run_id] = deque()
                    conn.batch.append(request)
                continue
            take(payload, nursery, request)
        else:
            take(payload, nursery)
            fast = conn.principal is not None and conn.rate_limiter is None  # (a hello)
    return pos, _DONE, 0


def _take_bodies(
    requests: list[ChannelRequest],
    decode: Callable[[Any], ProposalIn],
    refuse: Callable[[ChannelRequest, Exception], None],
    taken: list[ChannelRequest],
    run_ids: list[str],
    bodies: list[ProposalIn],
) -> None:
    """Decode each proposal's body: the request, its run and its body go to ``taken``,
    ``run_ids`` and ``bodies``; a body that is not a proposal to ``refuse``."""
    for request in requests:
        try:
            body = decode(request.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            refuse(request, exc)
            continue
        assert request.run_id is not None
        taken.append(request)
        run_ids.append(request.run_id)
        bodies.append(body)


def _frame_verdicts(
    out: bytearray,
    requests: list[ChannelRequest],
    verdicts: list[Any],
    put: Callable[[_Answer], None],
) -> None:
    """Each request's answer: its verdict, or the problem that says why it got none,
    framed into ``out`` as ``put`` (:meth:`_Connection._put`) frames one; an answer that
    cannot be encoded is left to ``put``, which says so."""
    # NOTE: _put, inline: a Python frame an answer fewer
    encode_into = _ENCODE_INTO
    pack_into = HEADER.pack_into
    for request, verdict in zip(requests, verdicts, strict=True):
        problem = verdict.problem
        if problem is not None:
            answer = _Answer(id=request.id, problem=problem)
        else:
            answer = _Answer(id=request.id, body=verdict)
        start = len(out)
        out += _NO_LENGTH
        try:
            encode_into(answer, out, -1)
        except (TypeError, OverflowError, msgspec.EncodeError):  # pragma: no cover
            del out[start:]
            put(answer)
            continue
        pack_into(out, start, len(out) - start - 4)


def _release_runs(
    requests: list[ChannelRequest],
    runs: dict[str, deque[ChannelRequest]],
    schedule: Callable[[str], None],
) -> None:
    """Each request's run goes on with its requests read meanwhile, or is idle again."""
    for request in requests:
        run_id = request.run_id
        assert run_id is not None
        if runs[run_id]:
            schedule(run_id)
        else:
            del runs[run_id]
