"""Leases: which worker drives which run, and the fencing token that proves it.

Backend-neutral: the types and the argument checks every store with leases shares
(today the PostgreSQL store; see :class:`LeasingStore`).

A run's lease names its ``owner`` (a worker), an ``epoch`` and an expiry. Every claim
of a run gives it the next epoch, so the epoch only grows; an append carries the
owner and epoch it was decided under (its *fence*), and the store refuses the run's
events when that is no longer the run's lease. A worker that lost a lease therefore
cannot write for the run, whatever its own clock says.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from ..core._exceptions import LeaseLost

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Mapping, Sequence

    from ..core._events import Event

#: Seconds a lease lasts after a claim or a renewal, unless the worker says otherwise.
DEFAULT_TTL = 10.0

#: Runs one claim takes at most, unless the worker says otherwise.
DEFAULT_CLAIM_LIMIT = 100


class Lease(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One run's lease, as the store granted or renewed it."""

    run_id: str
    owner: str
    """The worker holding the run."""
    epoch: int
    """The fencing token: one more than the run's previous claim, never smaller."""
    expires: float
    """When the lease ends unless renewed: the database server's clock, in seconds
    since the Unix epoch (never the worker's clock; compare it with nothing local)."""
    sent: float | None = None
    """When the claim or renewal that granted it was sent to the server, on the
    granting process's trio clock (``trio.current_time()``), None if the store does not
    say: the lease lasts its ttl from a moment no earlier (the server's), so a process
    counts its ttl from here, not from when it asked for a connection."""


@runtime_checkable
class LeasingStore(Protocol):
    """What a store offers workers: claims, heartbeats, release and fenced appends."""

    async def claim(
        self,
        owner: str,
        *,
        limit: int = DEFAULT_CLAIM_LIMIT,
        ttl: float = DEFAULT_TTL,
        run_ids: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
    ) -> list[Lease]:
        """Lease up to ``limit`` claimable runs (or the named ``run_ids``) to ``owner``."""
        ...

    async def held_elsewhere(self, owner: str) -> list[Lease]:
        """The unfinished runs other owners hold unexpired leases of."""
        ...

    async def renew(self, owner: str, run_ids: Iterable[str], *, ttl: float) -> list[Lease]:
        """Extend the leases of ``run_ids`` that ``owner`` still holds."""
        ...

    async def release(self, owner: str, run_ids: Iterable[str]) -> None:
        """Give up the leases of ``run_ids`` that ``owner`` holds."""
        ...

    async def append_fenced(
        self,
        events: Sequence[Event],
        fence: Mapping[str, int],
        owner: str,
        *,
        ttl: float = DEFAULT_TTL,
        unfenced: Collection[str] = (),
    ) -> frozenset[str]:
        """Append the events of the runs whose lease is still ``(owner, fence[run])``
        (and of the ``unfenced`` runs, seq-checked only)."""
        ...


def check_owner(owner: object) -> str:
    """Return ``owner`` if it can name a worker.

    Raises:
      ValueError: it is not a non-empty string.
    """
    if not isinstance(owner, str) or not owner:
        raise ValueError(
            f"owner must be a non-empty string naming the worker (e.g. 'host:pid'), not {owner!r}"
        )
    return owner


def check_ttl(ttl: object) -> float:
    """Return ``ttl`` as seconds if it can be a lease's duration.

    Raises:
      ValueError: it is not a finite number of seconds above 0.
    """
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
        raise ValueError(f"ttl must be a finite number of seconds above 0, not {ttl!r}")
    if ttl <= 0:
        raise ValueError(f"ttl must be a finite number of seconds above 0, not {ttl!r}")
    return float(ttl)


def check_limit(limit: object) -> int:
    """Return ``limit`` if it can bound a claim.

    Raises:
      ValueError: it is not an integer of at least 1.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1 (runs per claim), not {limit!r}")
    return limit


def check_run_ids(run_ids: Iterable[str]) -> list[str]:
    """Return ``run_ids`` as a list without repeats, in their order.

    Raises:
      ValueError: it is a single string (a common slip for ``[run_id]``), or holds
        something other than strings.
    """
    if isinstance(run_ids, str):
        raise ValueError(f"run_ids must be a collection of run ids, not the string {run_ids!r}")
    ids = list(dict.fromkeys(run_ids))
    for run_id in ids:
        if not isinstance(run_id, str):
            raise ValueError(f"run_ids must hold run ids (strings), not {run_id!r}")
    return ids


def lease_lost(run_id: str, owner: str, epoch: int) -> LeaseLost:
    """The error a worker raises for a run whose fenced append the store refused."""
    return LeaseLost(
        f"run {run_id!r}: worker {owner!r} no longer holds its lease (epoch {epoch}); another "
        "worker claimed it, so this worker's events for it were not written; drop the run"
    )
