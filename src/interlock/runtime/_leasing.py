"""A supervisor's leases on a store that has them (PostgreSQL): which runs it holds, at
which epoch, the fenced group commit, and the heartbeat that keeps them.

Every run a supervisor drives on such a store is leased to it: the runs it starts (the
lease is taken in the batch that starts them), the runs it claims (a worker, a resume)
and the runs an operator resumes through it. Each batch is appended with
:meth:`~interlock.stores.LeasingStore.append_fenced`, so the store refuses the events of
a run whose lease another process took meanwhile; only that run is dropped
(:class:`~interlock.LeaseLost`), the others of the batch commit. External runs are not
leased: their callers drive them through any gateway, and the seq check orders them.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING

import trio

from ..core._events import RunStarted
from ..core._exceptions import LeaseLost, StoreError
from ..stores._leases import DEFAULT_TTL, check_owner, check_ttl, lease_lost

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from ..core._events import Event
    from ..stores._leases import Lease, LeasingStore

__all__ = ["DEFAULT_TTL", "Leases", "default_owner"]

log = logging.getLogger("interlock.leases")

#: The share of a lease's ttl, from when its claim or renewal was sent, during which this
#: process takes it as surely still its own (the rest is margin for the clocks' drift).
#: Sent: when the statement went to the server (:attr:`~interlock.stores.Lease.sent`),
#: not when this process asked for a connection to send it on.
SURE = 0.8

#: The longest a heartbeat waits before retrying after the store failed.
_MAX_BACKOFF = 5.0


def default_owner() -> str:
    """A name for this process as a lease owner: ``host:pid:random`` (the random part
    tells two processes apart after a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def is_leasing(store: object) -> bool:
    """Whether ``store`` leases runs to its writers (a PostgreSQL store, schema 3)."""
    return getattr(store, "leasing", False) is True


class Leases:
    """The leases one supervisor holds, by run id, and the fenced append of its batches.

    Args:
      store: a store with leases.
      owner: this process's name in the leases table (see :func:`default_owner`).
      ttl: seconds each lease lasts after a claim or a heartbeat.
      is_external: whether a run is driven by its caller (those are not leased).
      lose: called with the runs dropped (a lost lease, a stale external run) and the
        error each one's requests get.
    """

    def __init__(
        self,
        store: LeasingStore,
        owner: str,
        ttl: float,
        *,
        is_external: Callable[[str], bool],
        lose: Callable[[dict[str, StoreError]], None],
    ) -> None:
        self.store = store
        self.owner = check_owner(owner)
        self.ttl = check_ttl(ttl)
        self.epochs: dict[str, int] = {}
        """The epoch of each run this process holds."""
        self.lost = 0
        """How many leases this process has lost (counted once per run and epoch)."""
        self.until: dict[str, float] = {}
        """Until when (trio's clock) each lease is surely still this process's: when the
        claim or renewal that granted it was sent, plus :data:`SURE` of the ttl."""
        self.ended: dict[str, float] = {}
        """Runs that ended escalated here, each with until when (``time.monotonic()``) its lease
        may still be held in the store. Such a lease is left to expire (an operator's
        resume needs none), unless this process exits first: then it is released with
        the rest (:meth:`releasable`), so the worker that claims the run once resumed
        does not wait it out."""
        self._scopes: dict[str, trio.CancelScope] = {}
        self._is_external = is_external
        self._lose = lose

    def __len__(self) -> int:
        return len(self.epochs)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self.epochs

    def hold(self, leases: Iterable[Lease], sent: float) -> None:
        """Record leases the store granted (a claim asked for at ``sent``, trio's clock,
        unless a lease says when it was sent)."""
        for lease in leases:
            self.epochs[lease.run_id] = lease.epoch
            self.ended.pop(lease.run_id, None)
            self._extend(lease.run_id, self._sure(lease, sent))

    def _sure(self, lease: Lease, asked: float) -> float:
        """Until when ``lease`` is surely still this process's: :data:`SURE` of the ttl
        from when its claim or renewal was sent (``asked``: when it was asked for, earlier,
        if the store does not say)."""
        sent = asked if lease.sent is None else max(asked, lease.sent)
        return sent + SURE * self.ttl

    def _extend(self, run_id: str, sure: float) -> None:
        self.until[run_id] = sure
        scope = self._scopes.get(run_id)
        if scope is not None:
            scope.deadline = sure

    def forget(self, run_id: str) -> int | None:
        """Stop holding ``run_id`` (it ended, or was dropped); returns its epoch."""
        self.until.pop(run_id, None)
        return self.epochs.pop(run_id, None)

    def end(self, run_id: str) -> None:
        """Stop holding ``run_id``, which ended escalated: its lease is released if this
        process exits before the lease expires (see :attr:`ended`)."""
        if self.forget(run_id) is not None:
            self.ended[run_id] = time.monotonic() + self.ttl

    def releasable(self) -> list[str]:
        """The runs whose leases an exit releases: those held, and those that ended
        escalated here whose leases have not expired yet."""
        self._prune_ended()
        return [*self.epochs, *self.ended]

    def _prune_ended(self) -> None:
        now = time.monotonic()
        for run_id in [run_id for run_id, until in self.ended.items() if until <= now]:
            del self.ended[run_id]

    # -- side effects only under a lease (the actor's guard) ------------------------

    def guard(self, run_id: str) -> Leases | None:
        """This, if ``run_id`` is leased here (its tool calls are then guarded), else None."""
        return self if run_id in self.epochs else None

    async def confirm(self, run_id: str, *, lapsed_only: bool = False) -> None:
        """Make sure this process still holds ``run_id``'s lease, renewing it now (with
        ``lapsed_only``, only if its sure time has passed: a stalled process).

        Raises:
          LeaseLost: another process took the run (it is dropped here).
          StoreError: the store could not say.
        """
        if lapsed_only and trio.current_time() < self.until.get(run_id, -math.inf):
            return
        epoch = self.epochs.get(run_id)
        if epoch is None:
            raise lease_lost(run_id, self.owner, 0)
        sent = trio.current_time()
        renewed = await self.store.renew(self.owner, [run_id], ttl=self.ttl)
        for lease in renewed:
            if lease.epoch == epoch and self.epochs.get(run_id) == epoch:
                self._extend(run_id, self._sure(lease, sent))
                return
        self._drop([run_id])
        raise lease_lost(run_id, self.owner, epoch)

    def epoch(self, run_id: str) -> int:
        """The epoch of ``run_id``'s lease here, 0 if it is not held."""
        return self.epochs.get(run_id, 0)

    def open_scope(self, run_id: str) -> trio.CancelScope:
        """A cancel scope for one side effect of ``run_id``, cancelled when its lease is no
        longer surely held (moved on by every renewal)."""
        scope = trio.CancelScope(deadline=self.until.get(run_id, -math.inf))
        self._scopes[run_id] = scope
        return scope

    def close_scope(self, run_id: str, scope: trio.CancelScope) -> None:
        if self._scopes.get(run_id) is scope:
            del self._scopes[run_id]

    async def append(self, events: Sequence[Event]) -> frozenset[str]:
        """Append one batch fenced by this process's leases; see the module.

        Returns:
          the runs refused: their leases are lost, none of their events written.
        """
        epochs = self.epochs
        fence: dict[str, int] = {}
        unfenced: list[str] = []
        started: list[str] = []
        unheld: set[str] = set()
        seen: set[str] = set()
        for event in events:
            run_id = event.run_id
            if run_id in seen:
                continue
            seen.add(run_id)
            epoch = epochs.get(run_id)
            if epoch is not None:
                fence[run_id] = epoch
            elif type(event) is RunStarted:
                if event.external is not True:
                    started.append(run_id)
            elif self._is_external(run_id):
                unfenced.append(run_id)
            else:  # a run this process does not hold: never written unfenced
                unheld.add(run_id)
        if unheld:
            events = [event for event in events if event.run_id not in unheld]
        sent = trio.current_time()
        refused = await self.store.append_fenced(
            events, fence, self.owner, ttl=self.ttl, unfenced=unfenced
        )
        for run_id in started:
            if run_id not in refused:
                epochs[run_id] = 1
                self._extend(run_id, sent + SURE * self.ttl)
        if refused and unfenced:
            stale = refused.intersection(unfenced)
            if stale:
                self._stale(stale)
                refused_leases = refused.difference(stale)
                if refused_leases:
                    self._drop(refused_leases)
            else:
                self._drop(refused)
        elif refused:
            self._drop(refused)
        if unheld:
            self._drop(unheld, held=False)
            refused = refused | unheld
        return refused

    def _stale(self, run_ids: Iterable[str]) -> None:
        """External runs another process advanced since this one loaded them: dropped here
        (the next request loads them afresh), not a lost lease."""
        self._lose(
            {
                run_id: StoreError(
                    f"run {run_id!r} was advanced by another process (another gateway) since "
                    "this one loaded it, so this batch's events for it were not written; read "
                    "the run again and retry"
                )
                for run_id in run_ids
            }
        )

    def _drop(self, run_ids: Iterable[str], *, held: bool = True) -> None:
        errors: dict[str, StoreError] = {}
        for run_id in run_ids:
            epoch = self.epochs.pop(run_id, None)
            self.until.pop(run_id, None)
            scope = self._scopes.get(run_id)
            if scope is not None:
                scope.cancel()  # a side effect in flight for a run this process lost
            if held:
                errors[run_id] = lease_lost(run_id, self.owner, epoch or 0)
                if epoch is not None:  # told once, whichever of a write and a heartbeat saw it
                    self.lost += 1
                    log.warning(
                        "lease lost for run %r (epoch %d): %s", run_id, epoch, errors[run_id]
                    )
            else:
                errors[run_id] = LeaseLost(
                    f"run {run_id!r}: {self.owner!r} holds no lease of it, so its events were "
                    "not written (a bug: every run a leased supervisor writes is claimed or "
                    "started by it); drop the run, and resume the journal to continue it"
                )
                log.error("%s", errors[run_id])
        self._lose(errors)

    async def claim(self, limit: int) -> list[Lease]:
        """Claim up to ``limit`` claimable runs, and hold them."""
        # Never the runs held here: one past its expiry is renewed by the heartbeat, not
        # claimed again (a second copy of a run this process drives).
        sent = trio.current_time()
        leases = await self.store.claim(
            self.owner, limit=limit, ttl=self.ttl, exclude=list(self.epochs)
        )
        self.hold(leases, sent)
        return leases

    async def take(self, run_ids: Sequence[str]) -> list[Lease]:
        """Claim the named runs (unless another process holds them), and hold them."""
        sent = trio.current_time()
        leases = await self.store.claim(self.owner, run_ids=run_ids, ttl=self.ttl)
        self.hold(leases, sent)
        return leases

    async def release(self, run_ids: Iterable[str]) -> None:
        """Give up the leases of ``run_ids``: claimable by any process at once."""
        ids = [
            run_id
            for run_id in run_ids
            if self.forget(run_id) is not None or self.ended.pop(run_id, None) is not None
        ]
        if ids:
            await self.store.release(self.owner, ids)

    async def renew(self, live: Callable[[str], bool]) -> None:
        """One heartbeat: renew the leases of the runs still ``live`` here, forget the
        others, and drop the runs whose leases another process took."""
        for run_id in [run_id for run_id in self.epochs if not live(run_id)]:
            self.forget(run_id)
        self._prune_ended()
        held = dict(self.epochs)
        if not held:
            return
        sent = trio.current_time()
        renewed = await self.store.renew(self.owner, list(held), ttl=self.ttl)
        kept = {lease.run_id for lease in renewed if lease.epoch == held[lease.run_id]}
        for lease in renewed:
            run_id = lease.run_id
            if run_id in kept and self.epochs.get(run_id) == held[run_id]:
                self._extend(run_id, self._sure(lease, sent))
        # A run claimed or released meanwhile (its epoch changed here) is not judged on
        # this answer; only one this process held all along and the store no longer does.
        gone = [
            run_id
            for run_id, epoch in held.items()
            if run_id not in kept and self.epochs.get(run_id) == epoch
        ]
        if gone:
            self._drop(gone)

    async def heartbeat(
        self,
        live: Callable[[str], bool],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Renew every ``ttl / 3`` seconds until cancelled; a failing store is retried
        with backoff (the leases stay this process's until another claims them).

        The period counts from when the last renewal began, not from when it returned:
        one slow to return (a loaded server, or a claim holding a row) does not push
        the next one later too."""
        task_status.started()
        period = self.ttl / 3
        backoff = min(period, 0.1)
        due = trio.current_time() + period
        while True:
            await trio.sleep_until(due)
            due = trio.current_time() + period
            try:
                await self.renew(live)
            except StoreError as exc:
                log.warning("lease heartbeat of %s failed: %s; retrying", self.owner, exc)
                while True:
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF)
                    try:
                        await self.renew(live)
                    except StoreError:
                        continue
                    break
                backoff = min(period, 0.1)
                due = trio.current_time() + period
