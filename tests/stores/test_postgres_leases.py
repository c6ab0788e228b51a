"""Leases and fenced appends in the PostgreSQL store (issue #18): claims, heartbeats,
release, the fence, the indexes of unfinished runs, and the upgrade to schema version 3.

Every test runs against the real server of INTERLOCK_PG_DSN, each in a fresh schema;
"another worker" is another store object, so another connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql

import interlock
from interlock.core._events import (
    Completed,
    Escalated,
    IntentRecorded,
    Resumed,
    RunStarted,
    Transitioned,
)
from interlock.core._exceptions import LeaseLost, StoreError
from interlock.stores import PostgresStore, open_postgres_store
from interlock.stores import _postgres as _pg
from interlock.stores._leases import Lease, LeasingStore, lease_lost

from .conftest import PG_DSN, PG_SKIP_REASON

pytestmark = [pytest.mark.postgres, pytest.mark.skipif(not PG_DSN, reason=PG_SKIP_REASON)]


@pytest.fixture
def schema() -> Iterator[str]:
    """A schema name nobody uses yet; dropped after the test."""
    name = f"interlock_test_{secrets.token_hex(6)}"
    yield name
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@contextlib.asynccontextmanager
async def workers(schema: str, count: int) -> AsyncIterator[list[PostgresStore]]:
    """``count`` store objects (connections) on one schema, as workers would open it."""
    stores = []
    try:
        for _ in range(count):
            stores.append(await open_postgres_store(PG_DSN, schema=schema))
        yield stores
    finally:
        with trio.CancelScope(shield=True):
            for store in stores:
                await store.aclose()


@contextlib.contextmanager
def raw(schema: str, *, autocommit: bool = True) -> Iterator[psycopg.Connection[Any]]:
    """A connection behind the stores' back, its search_path the schema."""
    with psycopg.connect(PG_DSN, autocommit=autocommit) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        if not autocommit:
            conn.commit()
        yield conn


def expire(schema: str, *run_ids: str) -> None:
    """Make the leases of ``run_ids`` expire now, as a worker stopped past its ttl would
    let them: owner and epoch stay."""
    with raw(schema) as conn:
        conn.execute(
            "UPDATE leases SET expires = now() - interval '1 second' "
            "WHERE run_id = ANY(%s::text[])",
            (list(run_ids),),
        )


def started(run_id: str, *, external: bool = False) -> RunStarted:
    if external:
        return RunStarted(run_id=run_id, seq=1, ts=1.0, machine="m", state="A", external=True)
    return RunStarted(run_id=run_id, seq=1, ts=1.0, machine="m", state="A")


def step(run_id: str, seq: int, note: str = "") -> Transitioned:
    """An event that records who wrote it (``note``) in its delta."""
    return Transitioned(run_id=run_id, seq=seq, ts=float(seq), src="A", dst="A", delta={"by": note})


def done(run_id: str, seq: int) -> Completed:
    return Completed(run_id=run_id, seq=seq, ts=float(seq), state="DONE")


def wait_for_lock(observer: psycopg.Connection[Any], pid: int, timeout: float = 60.0) -> None:
    """Return once backend ``pid`` waits for a lock. Another backend's state can only be
    polled; the timeout bounds a hang (the caller's trio.fail_after cannot stop this
    thread), it checks no speed."""
    query = "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'"
    give_up = time.monotonic() + timeout
    while not observer.execute(query, (pid,)).fetchone():
        assert time.monotonic() < give_up, f"backend {pid} never waited for a lock"
        time.sleep(0.005)


def never_waits(
    observer: psycopg.Connection[Any], pid: int, done: Any, timeout: float = 60.0
) -> str | None:
    """Watch backend ``pid`` until ``done()``: None if it never waited for a lock
    meanwhile, else the lock it waited for. The timeout bounds a hang, it checks no
    speed."""
    query = (
        "SELECT a.wait_event, l.mode FROM pg_stat_activity a "
        "LEFT JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted "
        "WHERE a.pid = %s AND a.wait_event_type = 'Lock'"
    )
    give_up = time.monotonic() + timeout
    while not done():
        row = observer.execute(query, (pid,)).fetchone()
        if row is not None:
            return f"{row[0]} ({row[1]})"
        assert time.monotonic() < give_up, "the statement never finished"
        time.sleep(0.002)
    return None


class Held:
    """A fenced append's transaction held open: set as the store's ``_after_fence_check``,
    it is called once the lease rows are locked and checked, and waits (in the store's
    thread) until the test sets ``go_on``."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.go_on = threading.Event()

    def __call__(self) -> None:
        self.inside.set()
        assert self.go_on.wait(60), "the test never let the append go on"

    async def entered(self) -> bool:
        """Wait until the append is inside its transaction (a hang guard, no speed)."""
        return await trio.to_thread.run_sync(self.inside.wait, 60)


async def seqs(store: PostgresStore, run_id: str) -> list[int]:
    return [event.seq for event in await store.load(run_id)]


async def test_the_store_offers_leases() -> None:
    assert issubclass(PostgresStore, LeasingStore)
    error = lease_lost("r-1", "w-1", 3)
    assert isinstance(error, LeaseLost)
    assert isinstance(error, StoreError)
    assert str(error) == (
        "run 'r-1': worker 'w-1' no longer holds its lease (epoch 3); another worker claimed "
        "it, so this worker's events for it were not written; drop the run"
    )


async def test_concurrent_claims_hand_each_run_to_one_worker(schema: str) -> None:
    """1,000 enqueued runs (started with no worker), 4 workers claiming at once in small
    batches until nothing is left: each run is claimed exactly once, at epoch 1."""
    runs = [f"r-{i:04d}" for i in range(1000)]
    claimed: dict[str, list[Lease]] = {}
    async with workers(schema, 4) as stores:
        for at in range(0, len(runs), 250):
            await stores[0].append([started(run_id) for run_id in runs[at : at + 250]])

        async def worker(store: PostgresStore, owner: str) -> None:
            got = claimed.setdefault(owner, [])
            while leases := await store.claim(owner, limit=23, ttl=60.0):
                got.extend(leases)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for n, store in enumerate(stores):
                    nursery.start_soon(worker, store, f"w-{n}")
        everyone = [lease for leases in claimed.values() for lease in leases]
        assert sorted(lease.run_id for lease in everyone) == runs
        assert {lease.epoch for lease in everyone} == {1}
        for owner, leases in claimed.items():
            assert {lease.owner for lease in leases} <= {owner}
        # Nothing is claimable while those leases last.
        assert await stores[1].claim("w-9") == []


_CLAIMER = """
import json, sys, trio
from interlock.stores import open_postgres_store

async def main(dsn, schema, owner):
    async with await open_postgres_store(dsn, schema=schema) as store:
        print("ready", flush=True)
        sys.stdin.readline()
        got = []
        while leases := await store.claim(owner, limit=10, ttl=600.0):
            got += [[lease.run_id, lease.epoch, lease.owner] for lease in leases]
        print(json.dumps(got), flush=True)

trio.run(main, *sys.argv[1:])
"""


async def test_two_processes_claiming_at_once_take_each_run_once(schema: str) -> None:
    runs = [f"r-{i:04d}" for i in range(1000)]
    async with workers(schema, 1) as (a,):
        await a.append([started(run_id) for run_id in runs])
    source = os.path.dirname(os.path.dirname(interlock.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    claimed: list[list[Any]] = []
    with trio.fail_after(60):
        procs = [
            await trio.lowlevel.open_process(
                [sys.executable, "-c", _CLAIMER, PG_DSN, schema, f"p-{n}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            for n in range(2)
        ]
        try:
            lines = [_LineReader(proc) for proc in procs]
            for reader in lines:
                assert await reader.line() == "ready"
            for proc in procs:  # both go at once
                assert proc.stdin is not None
                await proc.stdin.send_all(b"go\n")
            for reader in lines:
                claimed += json.loads(await reader.line())
            for proc in procs:
                assert await proc.wait() == 0
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
    assert sorted(run_id for run_id, _epoch, _owner in claimed) == runs
    assert {epoch for _run_id, epoch, _owner in claimed} == {1}
    assert {owner for _run_id, _epoch, owner in claimed} <= {"p-0", "p-1"}


class _LineReader:
    """Lines from a child's stdout."""

    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdout is not None
        self._stream = proc.stdout
        self._buffer = b""

    async def line(self) -> str:
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some()
            if not chunk:
                raise AssertionError(f"the child ended before a line: {self._buffer!r}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


async def test_the_epoch_grows_on_every_claim(schema: str) -> None:
    async with workers(schema, 2) as (a, b):
        await a.append([started("r-1")])
        epochs = []
        for n in range(6):
            store, owner = (a, "w-a") if n % 2 == 0 else (b, "w-b")
            [lease] = await store.claim(owner, ttl=60.0)
            assert (lease.run_id, lease.owner) == ("r-1", owner)
            epochs.append(lease.epoch)
            # Given up by release, or lost by expiry: either way the next claim raises it.
            if n % 3 == 0:
                await store.release(owner, ["r-1"])
            else:
                expire(schema, "r-1")
        assert epochs == [1, 2, 3, 4, 5, 6]


async def test_an_expired_lease_taken_over_refuses_only_that_run(schema: str) -> None:
    async with workers(schema, 2) as (a, b):
        # Worker a creates two runs: it holds them at epoch 1 at once.
        assert await a.append_fenced([started("r-1"), started("r-2")], {}, "w-a") == frozenset()
        assert await b.claim("w-b") == []
        expire(schema, "r-1")
        [taken] = await b.claim("w-b", ttl=60.0)
        assert (taken.run_id, taken.owner, taken.epoch) == ("r-1", "w-b", 2)
        # Worker a, unaware, appends a batch for both: r-1 is refused, r-2 commits.
        refused = await a.append_fenced(
            [step("r-1", 2, "w-a"), step("r-2", 2, "w-a"), done("r-2", 3)],
            {"r-1": 1, "r-2": 1},
            "w-a",
        )
        assert refused == frozenset({"r-1"})
        assert await seqs(a, "r-1") == [1]
        assert await seqs(a, "r-2") == [1, 2, 3]
        assert (await a.get_run("r-2")).outcome == "completed"
        assert (await a.get_run("r-1")).seq == 1
        # The new owner goes on from where the journal is.
        assert await b.append_fenced([step("r-1", 2, "w-b")], {"r-1": 2}, "w-b") == frozenset()
        assert [e.delta for e in await b.load("r-1") if isinstance(e, Transitioned)] == [
            {"by": "w-b"}
        ]
        # A batch of refused runs only writes nothing, and is no error.
        assert await a.append_fenced([step("r-1", 3, "w-a")], {"r-1": 1}, "w-a") == {"r-1"}
        assert await seqs(a, "r-1") == [1, 2]
        assert (await a.check()).ok


async def test_a_worker_that_reclaims_its_own_run_fences_out_its_old_epoch(schema: str) -> None:
    """(issue 33) The fence checks the epoch, not only the owner. A worker whose lease
    expired claims its own run again (or an operator's process takes it by name): it holds
    it at a new epoch, and an append decided under the old one (a batch from before the
    reclaim, still in flight) is refused, writing nothing, though its owner is the same."""
    async with workers(schema, 1) as (a,):
        assert await a.append_fenced([started("r-1")], {}, "w-a") == frozenset()
        expire(schema, "r-1")
        [lease] = await a.claim("w-a", ttl=60.0)
        assert (lease.run_id, lease.owner, lease.epoch) == ("r-1", "w-a", 2)
        assert await a.append_fenced([step("r-1", 2, "epoch 1")], {"r-1": 1}, "w-a") == {"r-1"}
        assert await seqs(a, "r-1") == [1]
        assert (await a.get_run("r-1")).seq == 1
        [lease] = await a.claim("w-a", run_ids=["r-1"], ttl=60.0)  # by name: epoch 3
        assert (lease.owner, lease.epoch) == ("w-a", 3)
        for stale in (1, 2):
            refused = await a.append_fenced(
                [step("r-1", 2, f"epoch {stale}")], {"r-1": stale}, "w-a"
            )
            assert refused == {"r-1"}
        assert await seqs(a, "r-1") == [1]
        # At the epoch it holds, the same owner writes.
        assert await a.append_fenced([step("r-1", 2, "epoch 3")], {"r-1": 3}, "w-a") == frozenset()
        assert [e.delta for e in await a.load("r-1") if isinstance(e, Transitioned)] == [
            {"by": "epoch 3"}
        ]
        assert (await a.check()).ok


async def test_a_claim_during_a_fenced_append_skips_the_run(schema: str) -> None:
    """The takeover runs on another connection while the append's transaction is open
    (its lease rows checked, nothing committed): the lease row is locked, so the claim skips
    it; once the append commits, the next claim takes it and the old owner is refused."""
    hold = Held()

    async with workers(schema, 2) as (a, b):
        await a.append_fenced([started("r-1"), started("r-2")], {}, "w-a")
        expire(schema, "r-1", "r-2")  # both claimable: the worker stopped past its ttl
        a._after_fence_check = hold
        outcome: list[frozenset[str]] = []

        async def append() -> None:
            outcome.append(await a.append_fenced([step("r-1", 2, "w-a")], {"r-1": 1}, "w-a"))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append)
                assert await hold.entered()
                # r-1 is locked by the open append: skipped. r-2 is not: taken.
                taken = await b.claim("w-b", ttl=60.0)
                hold.go_on.set()
        assert [(lease.run_id, lease.epoch) for lease in taken] == [("r-2", 2)]
        assert outcome == [frozenset()]
        assert await seqs(b, "r-1") == [1, 2]
        a._after_fence_check = None
        [lease] = await b.claim("w-b", ttl=60.0)
        assert (lease.run_id, lease.epoch) == ("r-1", 2)
        assert await a.append_fenced([step("r-1", 3, "w-a")], {"r-1": 1}, "w-a") == {"r-1"}
        assert await seqs(b, "r-1") == [1, 2]


async def test_a_fenced_append_during_a_claim_waits_then_is_refused(schema: str) -> None:
    """The other order: the takeover's transaction has locked and raised the lease but not
    committed; the append's check waits for it (the row lock), then sees the new epoch."""
    async with workers(schema, 1) as (a,):
        await a.append_fenced([started("r-1")], {}, "w-a")
        expire(schema, "r-1")
        assert a._conn is not None
        pid = a._conn.info.backend_pid
        with raw(schema, autocommit=False) as takeover, raw(schema) as observer:
            # The store's own claim statement, in a transaction held open.
            [(run_id, owner, epoch, _)] = takeover.execute(
                _pg._CLAIM, ("w-b", 60.0, [], 10), prepare=False
            ).fetchall()
            assert (run_id, owner, epoch) == ("r-1", "w-b", 2)
            outcome: list[frozenset[str]] = []

            async def append() -> None:
                outcome.append(await a.append_fenced([step("r-1", 2, "w-a")], {"r-1": 1}, "w-a"))

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(append)
                    # Wait until the append's backend is blocked on the lease row's lock.
                    await trio.to_thread.run_sync(wait_for_lock, observer, pid)
                    assert outcome == []
                    await trio.to_thread.run_sync(takeover.commit)
        assert outcome == [frozenset({"r-1"})]
        assert await seqs(a, "r-1") == [1]


async def test_two_workers_each_stale_on_the_others_run_do_not_deadlock(schema: str) -> None:
    """Worker a holds r-a and still thinks it holds r-b; worker b the other way round.
    Both append a batch for both runs at once, each completing its own (which updates the
    run's lease row, that the other's fence has locked). Neither waits for the other (a
    shared lock upgraded to update a run's lease row would deadlock the two): b commits
    while a's transaction is still open, then a; each is refused the other's run."""
    hold = Held()

    async with workers(schema, 3) as (a, b, c):
        await c.append([started("r-a"), started("r-b")])
        leases = {lease.run_id: lease.epoch for lease in await a.claim("w-a", ttl=600.0)}
        assert leases == {"r-a": 1, "r-b": 1}
        expire(schema, "r-b")
        [lease] = await b.claim("w-b", ttl=600.0)
        assert (lease.run_id, lease.epoch) == ("r-b", 2)
        stale_b = {"r-a": 1, "r-b": 2}  # b believes it holds r-a too (as a did it once)
        a._after_fence_check = hold
        assert b._conn is not None
        pid_b = b._conn.info.backend_pid
        results: dict[str, frozenset[str]] = {}

        async def append(store: PostgresStore, owner: str, fence: dict[str, int]) -> None:
            mine = "r-a" if owner == "w-a" else "r-b"
            other = "r-b" if owner == "w-a" else "r-a"
            results[owner] = await store.append_fenced(
                [done(mine, 2), step(other, 2, owner)], fence, owner
            )

        with trio.fail_after(60), raw(schema) as observer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append, a, "w-a", leases)
                assert await hold.entered()
                nursery.start_soon(append, b, "w-b", stale_b)
                blocked = await trio.to_thread.run_sync(
                    never_waits, observer, pid_b, lambda: "w-b" in results
                )
                hold.go_on.set()
        assert blocked is None, "b's append waited for a's open transaction"
        assert results == {"w-a": frozenset({"r-b"}), "w-b": frozenset({"r-a"})}
        assert [type(e).__name__ for e in await c.load("r-a")] == ["RunStarted", "Completed"]
        assert [type(e).__name__ for e in await c.load("r-b")] == ["RunStarted", "Completed"]


async def test_a_renewal_does_not_wait_for_a_fenced_batch(schema: str) -> None:
    """Issue 33: a worker's heartbeat renewed its leases with a statement that waited for
    the lease rows its own open batch had locked, so at a 2 s ttl a slow batch cut calls
    as stalled. With the batch's transaction held open (its fence checked, its events not
    committed), a renewal of the batch's run, on the store's other connection, returns
    without waiting for a lock; and a claim by another worker still skips the run."""
    hold = Held()

    async with workers(schema, 2) as (a, b):
        await a.append_fenced([started("r-1")], {}, "w-a", ttl=60.0)
        await a.renew("w-a", ["r-1"], ttl=60.0)  # opens the renewals' connection
        assert a._renewals is not None
        pid = a._renewals.info.backend_pid
        expire(schema, "r-1")  # expired but unclaimed: still a's, and claimable
        a._after_fence_check = hold
        outcome: list[frozenset[str]] = []
        renewed: list[list[Lease]] = []

        async def append() -> None:
            outcome.append(await a.append_fenced([step("r-1", 2, "w-a")], {"r-1": 1}, "w-a"))

        async def renew() -> None:
            renewed.append(await a.renew("w-a", ["r-1"], ttl=60.0))

        with trio.fail_after(60), raw(schema) as observer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append)
                assert await hold.entered()
                assert await b.claim("w-b", ttl=60.0) == []  # the fence's lock: skipped
                nursery.start_soon(renew)
                blocked = await trio.to_thread.run_sync(
                    never_waits, observer, pid, lambda: bool(renewed)
                )
                hold.go_on.set()
        assert blocked is None, f"the renewal waited for the open batch: {blocked}"
        assert [(lease.run_id, lease.owner, lease.epoch) for lease in renewed[0]] == [
            ("r-1", "w-a", 1)
        ]
        assert outcome == [frozenset()]
        assert await seqs(b, "r-1") == [1, 2]
        assert await b.claim("w-b", ttl=60.0) == []  # renewed: no longer expired


async def test_racing_workers_never_both_write_a_run(schema: str) -> None:
    """Two workers steal one run back and forth as fast as they can, each appending with
    the epoch of its claim after reading the run's seq. A stale write that got past the
    fence would show as a seq conflict (a StoreError) or as an epoch going back along the
    journal; neither may happen, and the journal stays contiguous."""
    rounds = 40
    async with workers(schema, 3) as (a, b, c):
        await c.append([started("r-1")])
        committed: dict[str, int] = {"w-a": 0, "w-b": 0}

        async def worker(store: PostgresStore, owner: str) -> None:
            for _ in range(rounds):
                leases = await store.claim(owner, ttl=60.0)
                if not leases:
                    await trio.lowlevel.checkpoint()
                    continue
                [lease] = leases
                # Let the other one take it at once: the lease is expired, epoch kept.
                await trio.to_thread.run_sync(expire, schema, "r-1")
                seq = (await store.get_run("r-1")).seq
                refused = await store.append_fenced(
                    [step("r-1", seq + 1, f"{owner}:{lease.epoch}")], {"r-1": lease.epoch}, owner
                )
                if not refused:
                    committed[owner] += 1

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(worker, a, "w-a")
                nursery.start_soon(worker, b, "w-b")
        events = await c.load("r-1")
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        epochs = [int(e.delta["by"].split(":")[1]) for e in events if isinstance(e, Transitioned)]
        assert epochs == sorted(epochs)
        assert len(epochs) == sum(committed.values()) > 0
        assert (await c.check()).ok


async def test_renew_extends_held_leases_and_omits_lost_ones(schema: str) -> None:
    async with workers(schema, 2) as (a, b):
        await a.append([started("r-1"), started("r-2"), started("r-3")])
        leases = {lease.run_id: lease for lease in await a.claim("w-a", ttl=5.0)}
        assert sorted(leases) == ["r-1", "r-2", "r-3"]
        expire(schema, "r-1", "r-2")
        [stolen] = await b.claim("w-b", limit=1, ttl=60.0)
        assert stolen.run_id == "r-1"
        # r-2 expired but nobody took it: still a's, same epoch. r-1 is lost.
        renewed = await a.renew("w-a", ["r-1", "r-2", "r-3", "r-9"], ttl=600.0)
        assert [(lease.run_id, lease.epoch) for lease in renewed] == [("r-2", 1), ("r-3", 1)]
        for lease in renewed:
            assert lease.owner == "w-a"
            assert lease.expires > leases[lease.run_id].expires
        assert await b.claim("w-b") == []  # renewed: not claimable
        assert await a.renew("w-a", [], ttl=1.0) == []


async def test_a_renewal_does_not_wait_for_the_journals_connection(schema: str) -> None:
    """A heartbeat's renewal is answered while the store's journal connection is busy
    inside a batch write (issue 33: it queued behind the batch writes, seconds under load,
    and the leases' sure time ran out). Each lease says when its renewal was sent: once
    the renewal had a connection, not when it was asked for."""
    hold = Held()

    async with workers(schema, 1) as (a,):
        await a.append_fenced([started("r-1"), started("r-2")], {}, "w-a", ttl=600.0)
        a._after_fence_check = hold
        renewed: list[Lease] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.append_fenced, [step("r-1", 2)], {"r-1": 1}, "w-a")
                assert await hold.entered()
                asked = trio.current_time()
                renewed = await a.renew("w-a", ["r-2"], ttl=600.0)  # the batch is still open
                answered = trio.current_time()
                hold.go_on.set()
        [lease] = renewed
        assert (lease.run_id, lease.epoch) == ("r-2", 1)
        assert lease.sent is not None
        assert asked <= lease.sent <= answered
        assert await seqs(a, "r-1") == [1, 2]


async def test_release_gives_leases_up(schema: str) -> None:
    async with workers(schema, 2) as (a, b):
        await a.append([started("r-1"), started("r-2")])
        assert len(await a.claim("w-a", ttl=600.0)) == 2
        await b.release("w-b", ["r-1", "r-2"])  # not b's: nothing happens
        assert await b.claim("w-b") == []
        await a.release("w-a", ["r-1"])
        assert [lease.run_id for lease in await a.renew("w-a", ["r-1", "r-2"], ttl=600.0)] == [
            "r-2"
        ]
        # Released: a's fenced appends for it are refused even before anyone claims it.
        assert await a.append_fenced([step("r-1", 2)], {"r-1": 1}, "w-a") == {"r-1"}
        [lease] = await b.claim("w-b", ttl=600.0)
        assert (lease.run_id, lease.owner, lease.epoch) == ("r-1", "w-b", 2)
        await a.release("w-a", [])


async def test_what_is_claimable(schema: str) -> None:
    """Only unfinished runs the runtime drives: not external runs, not terminal or escalated
    ones; a resumed run is claimable again; a run a worker creates is its own."""
    async with workers(schema, 2) as (a, b):
        await a.append(
            [
                started("ext", external=True),
                started("done"),
                done("done", 2),
                started("parked"),
                Escalated(run_id="parked", seq=2, ts=2.0, state="A", reason="breaker", detail="d"),
                started("queued"),
            ]
        )
        await a.append_fenced([started("mine")], {}, "w-a", ttl=600.0)
        assert [lease.run_id for lease in await b.claim("w-b", ttl=600.0)] == ["queued"]
        await a.append([Resumed(run_id="parked", seq=3, ts=3.0, by="ops")])
        assert [lease.run_id for lease in await b.claim("w-b", ttl=600.0)] == ["parked"]
        assert await b.claim("w-b") == []
        unfinished = [record.run_id for record in await a.unfinished()]
        assert sorted(unfinished) == ["ext", "mine", "parked", "queued"]


async def test_the_unfinished_index_follows_commits_and_completions(schema: str) -> None:
    async with workers(schema, 1) as (a,):
        runs = [f"r-{i}" for i in range(6)]
        await a.append([started(run_id) for run_id in runs])
        assert [r.run_id for r in await a.unfinished()] == runs
        leases = {lease.run_id: lease.epoch for lease in await a.claim("w-a", ttl=600.0)}
        await a.append_fenced(
            [step("r-0", 2), done("r-0", 3), done("r-1", 2), step("r-2", 2)], leases, "w-a"
        )
        await a.append(
            [
                Escalated(run_id="r-3", seq=2, ts=2.0, state="A", reason="breaker", detail=""),
                done("r-4", 2),
            ]
        )
        assert [r.run_id for r in await a.unfinished()] == ["r-2", "r-5"]
        assert [r.run_id for r in await a.list_runs(outcome="running")] == ["r-2", "r-5"]
        await a.append([Resumed(run_id="r-3", seq=3, ts=3.0, by="ops")])
        assert [r.run_id for r in await a.unfinished()] == ["r-2", "r-3", "r-5"]


async def test_claims_and_recovery_read_only_the_unfinished_runs(schema: str) -> None:
    """With 5,000 finished runs and 10 unfinished, the planner reads the partial indexes
    (the plans of the store's own statements, on analyzed tables, nothing forced)."""
    async with workers(schema, 1) as (a,):
        finished = [f"f-{i:04d}" for i in range(5000)]
        await a.append([e for run_id in finished for e in (started(run_id), done(run_id, 2))])
        await a.append([started(f"u-{i}") for i in range(10)])
        with raw(schema) as conn:
            conn.execute("ANALYZE")
            plans = {
                name: "\n".join(row[0] for row in conn.execute("EXPLAIN " + query))
                for name, query in [
                    ("unfinished", _pg._SELECT_UNFINISHED),
                    (
                        "claim",  # owner, ttl, the runs held already (excluded), limit
                        _pg._CLAIM.replace("%s", "'w'", 1)
                        .replace("%s", "10", 1)
                        .replace("%s", "'{u-1,u-2}'", 1)
                        .replace("%s", "10"),
                    ),
                ]
            }
        assert "runs_unfinished" in plans["unfinished"], plans["unfinished"]
        assert "leases_claim" in plans["unfinished"], plans["unfinished"]
        assert "Seq Scan" not in plans["unfinished"], plans["unfinished"]
        assert "Index Scan using leases_claim" in plans["claim"], plans["claim"]
        assert "Sort" not in plans["claim"], plans["claim"]
        assert len(await a.claim("w-a", limit=100, exclude=["u-1"])) == 9
        assert [r.run_id for r in await a.unfinished()] == [f"u-{i}" for i in range(10)]


async def test_a_damaged_outcome_of_an_unfinished_run_is_still_reported(schema: str) -> None:
    """The leases keep their own copy of which runs are unfinished: a runs row whose
    outcome was changed behind the store's back is still read, and fails its checksum."""
    from interlock.stores import IndexDamaged

    async with workers(schema, 1) as (a,):
        await a.append([started("r-1"), started("r-2")])
        with raw(schema) as conn:
            conn.execute("UPDATE runs SET outcome = 'completed' WHERE run_id = 'r-1'")
        with pytest.raises(IndexDamaged, match=r"^runs index row of run 'r-1' is damaged"):
            await a.unfinished()


async def test_check_compares_the_leases_with_the_runs_index(schema: str) -> None:
    from interlock.stores import CheckProblem as Problem

    async with workers(schema, 1) as (a,):
        await a.append([started("r-1"), started("r-2"), started("r-3"), done("r-3", 2)])
        await a.claim("w-a")
        assert (await a.check()).ok
        with raw(schema) as conn:
            conn.execute("DELETE FROM leases WHERE run_id = 'r-1'")
            conn.execute("UPDATE leases SET live = false WHERE run_id = 'r-2'")
            conn.execute("INSERT INTO leases (run_id, live) VALUES ('r-9', true)")
        assert (await a.check()).problems == (
            Problem(
                run_id="r-1",
                seq=None,
                message="run 'r-1' has no lease row, so no worker would claim it; restore it "
                "from a backup",
            ),
            Problem(
                run_id="r-2",
                seq=None,
                message="the lease row of run 'r-2' says the run is finished, but its "
                "runs-index row says running; restore it from a backup",
            ),
            Problem(
                run_id="r-9",
                seq=None,
                message="the leases table holds a lease of run 'r-9', which the runs index "
                "does not hold; restore it from a backup",
            ),
        )


async def test_fenced_appends_keep_the_append_invariants(schema: str) -> None:
    async with workers(schema, 1) as (a,):
        await a.append_fenced([started("r-1"), started("r-2")], {}, "w-a")
        fence = {"r-1": 1, "r-2": 1}
        intent = IntentRecorded(
            run_id="r-1", seq=2, ts=2.0, state="A", tool="pay", args={}, key="k-1"
        )
        await a.append_fenced([intent], fence, "w-a")
        again = IntentRecorded(
            run_id="r-2", seq=2, ts=2.0, state="A", tool="pay", args={}, key="k-1"
        )
        with pytest.raises(StoreError, match=r"^idempotency key 'k-1' was already recorded"):
            await a.append_fenced([step("r-1", 3), again], fence, "w-a")
        assert await seqs(a, "r-1") == [1, 2]
        assert await seqs(a, "r-2") == [1]
        with pytest.raises(StoreError, match=r"cannot append seq 4"):
            await a.append_fenced([step("r-1", 4)], fence, "w-a")
        with pytest.raises(StoreError, match=r"^run 'r-1' already exists"):
            await a.append_fenced([started("r-1")], {}, "w-a")
        assert (await a.check()).ok


async def test_bad_arguments_are_refused_with_what_to_do(schema: str) -> None:
    async with workers(schema, 1) as (a,):
        await a.append([started("r-1")])
        with pytest.raises(ValueError, match=r"^owner must be a non-empty string naming"):
            await a.claim("")
        with pytest.raises(ValueError, match=r"^ttl must be a finite number of seconds above 0"):
            await a.claim("w", ttl=0)
        with pytest.raises(ValueError, match=r"^ttl must be a finite number"):
            await a.renew("w", ["r-1"], ttl=float("nan"))
        with pytest.raises(ValueError, match=r"^limit must be an integer of at least 1"):
            await a.claim("w", limit=0)
        with pytest.raises(ValueError, match=r"^run_ids must be a collection of run ids, not"):
            await a.release("w", "r-1")
        with pytest.raises(
            ValueError,
            match=r"^run 'r-1' has no epoch in fence, and the batch does not start it; pass "
            r"the epoch of its lease",
        ):
            await a.append_fenced([step("r-1", 2)], {}, "w")
        assert await seqs(a, "r-1") == [1]


async def test_a_readonly_store_refuses_leases(schema: str) -> None:
    async with workers(schema, 1) as (a,):
        await a.append([started("r-1")])
    async with await open_postgres_store(PG_DSN, schema=schema, readonly=True) as store:
        assert isinstance(store, PostgresStore)
        with pytest.raises(
            StoreError, match=r"is read-only; open it without readonly=True to claim"
        ):
            await store.claim("w")
        with pytest.raises(StoreError, match=r"to append_fenced$"):
            await store.append_fenced([step("r-1", 2)], {"r-1": 1}, "w")
        assert [r.run_id for r in await store.unfinished()] == ["r-1"]


async def test_a_version_2_schema_is_upgraded_with_a_lease_for_every_run(schema: str) -> None:
    async with workers(schema, 1) as (a,):
        await a.append(
            [started("r-1"), started("ext", external=True), started("r-2"), done("r-2", 2)]
        )
    # Back to version 2: no leases, no index of unfinished runs.
    with raw(schema) as conn:
        conn.execute("DROP TABLE leases")
        conn.execute("DROP INDEX runs_unfinished")
        conn.execute("UPDATE meta SET value = '2' WHERE name = 'schema_version'")
    async with await open_postgres_store(PG_DSN, schema=schema, readonly=True) as store:
        assert [r.run_id for r in await store.unfinished()] == ["ext", "r-1"]
        assert (await store.check()).ok
    async with workers(schema, 1) as (a,):
        assert [r.run_id for r in await a.unfinished()] == ["ext", "r-1"]
        [lease] = await a.claim("w-a", ttl=60.0)
        assert (lease.run_id, lease.epoch) == ("r-1", 1)
        await a.append_fenced([step("r-1", 2)], {"r-1": 1}, "w-a")
        await a.append([Resumed(run_id="r-2", seq=3, ts=3.0, by="ops")])
        assert [lease.run_id for lease in await a.claim("w-a")] == ["r-2"]
    with raw(schema) as conn:
        version = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
        rows = conn.execute("SELECT run_id, live, external FROM leases ORDER BY run_id").fetchall()
        indexes = {
            row[0]
            for row in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = %s", (schema,)
            )
        }
    assert version == ("3",)
    assert rows == [("ext", True, True), ("r-1", True, False), ("r-2", True, False)]
    assert {"runs_unfinished", "leases_claim"} <= indexes


_RUNS = ("r-0", "r-1")
_OWNERS = ("w-a", "w-b")
_OPS = st.lists(
    st.sampled_from(
        [("claim", owner, "") for owner in _OWNERS]
        + [("expire", "", run_id) for run_id in _RUNS]
        + [
            (op, owner, run_id)
            for op in ("append", "renew", "release")
            for owner in _OWNERS
            for run_id in _RUNS
        ]
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
@example(ops=[("claim", "w-a", ""), ("release", "w-a", "r-0"), ("append", "w-a", "r-0")])
@example(
    ops=[
        ("claim", "w-a", ""),
        ("expire", "", "r-1"),
        ("claim", "w-b", ""),
        ("append", "w-a", "r-1"),
        ("renew", "w-a", "r-1"),
        ("append", "w-b", "r-1"),
    ]
)
async def test_leases_follow_the_model(ops: list[tuple[str, str, str]]) -> None:
    """Any sequence of claims, expiries, renewals, releases and fenced appends by two
    workers does what a model of the leases says: claims take exactly the runs free or
    expired and raise their epoch; an append commits exactly when the worker's epoch is
    the run's and it is the owner; a renewal keeps exactly the leases still held."""
    schema = f"interlock_test_{secrets.token_hex(6)}"
    # The model: run -> [owner or None, epoch, expired], each worker's belief, seqs.
    lease: dict[str, list[Any]] = {run_id: [None, 0, True] for run_id in _RUNS}
    belief: dict[str, dict[str, int]] = {owner: {} for owner in _OWNERS}
    seq = dict.fromkeys(_RUNS, 1)
    try:
        async with workers(schema, 2) as stores:
            store = dict(zip(_OWNERS, stores, strict=True))
            await stores[0].append([started(run_id) for run_id in _RUNS])
            for op, owner, run_id in ops:
                if op == "claim":
                    got = await store[owner].claim(owner, ttl=600.0)
                    free = [r for r in _RUNS if lease[r][2]]
                    assert [g.run_id for g in got] == free
                    for g in got:
                        lease[g.run_id] = [owner, lease[g.run_id][1] + 1, False]
                        assert (g.owner, g.epoch) == (owner, lease[g.run_id][1])
                        belief[owner][g.run_id] = g.epoch
                elif op == "expire":
                    await trio.to_thread.run_sync(expire, schema, run_id)
                    lease[run_id][2] = True
                elif op == "append" and run_id in belief[owner]:
                    epoch = belief[owner][run_id]
                    refused = await store[owner].append_fenced(
                        [step(run_id, seq[run_id] + 1, owner)], {run_id: epoch}, owner
                    )
                    held = lease[run_id][0] == owner and lease[run_id][1] == epoch
                    assert refused == (frozenset() if held else {run_id})
                    seq[run_id] += held
                elif op == "renew":
                    got = await store[owner].renew(owner, [run_id], ttl=600.0)
                    held = lease[run_id][0] == owner
                    assert [(g.run_id, g.epoch) for g in got] == (
                        [(run_id, lease[run_id][1])] if held else []
                    )
                    if held:
                        lease[run_id][2] = False
                elif op == "release":
                    await store[owner].release(owner, [run_id])
                    if lease[run_id][0] == owner:
                        lease[run_id] = [None, lease[run_id][1], True]
            for run_id in _RUNS:
                assert (await stores[1].get_run(run_id)).seq == seq[run_id]
            assert (await stores[1].check()).ok
            with raw(schema) as conn:
                rows = conn.execute("SELECT run_id, owner, epoch FROM leases ORDER BY run_id")
                assert [tuple(row) for row in rows] == [
                    (run_id, lease[run_id][0], lease[run_id][1]) for run_id in _RUNS
                ]
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
