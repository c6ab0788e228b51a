"""An in-memory store, for tests and throwaway runs. Nothing survives the process."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from .._exceptions import RunNotFound, StoreError
from ._base import RunRecord, Store, check_batch, decode_body, encode_rows, index_updates

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._events import Event, JournalEvent


class MemoryStore(Store):
    """Keeps the framed journal and the runs index in dicts.

    Events go through the same encode/frame/decode path as the durable stores, so
    what a test sees is what SQLite would have returned.
    """

    kind = "memory"

    def __init__(self) -> None:
        self._journal: dict[str, list[tuple[int, bytes]]] = {}
        self._runs: dict[str, RunRecord] = {}
        self._keys: set[str] = set()
        self._closed = False
        self.appends = 0

    async def append(self, events: Sequence[Event]) -> None:
        if self._closed:
            raise StoreError("store is closed")
        rows = encode_rows(events)
        current = {e.run_id: self._runs[e.run_id] for e in events if e.run_id in self._runs}
        # NOTE: every check runs before the first write, so a rejected batch leaves
        # nothing behind (a bad seq late in the batch used to leave the rows before it).
        check_batch(events, {run_id: record.seq for run_id, record in current.items()})
        updates = index_updates(events, current)
        new_keys = [r[4] for r in rows if r[2] == "intent_recorded" and r[4] is not None]
        duplicate = next((k for k in new_keys if k in self._keys), None)
        if duplicate is not None:
            raise StoreError(
                f"idempotency key {duplicate!r} was already recorded; nothing was written"
            )
        for row in rows:
            self._journal.setdefault(row[0], []).append((row[1], row[5]))
        self._keys.update(new_keys)
        self.bytes_written += sum(len(row[5]) for row in rows)
        self._runs.update(updates)
        self.appends += 1
        await trio.lowlevel.checkpoint()

    async def load(self, run_id: str) -> list[JournalEvent]:
        await trio.lowlevel.checkpoint()
        journal = self._journal.get(run_id)
        if journal is None:
            raise RunNotFound(run_id)
        return [decode_body(run_id, seq, body) for seq, body in journal]

    async def get_run(self, run_id: str) -> RunRecord:
        await trio.lowlevel.checkpoint()
        try:
            return self._runs[run_id]
        except KeyError:
            raise RunNotFound(run_id) from None

    async def list_runs(
        self,
        *,
        machine: str | None = None,
        state: str | None = None,
        outcome: str | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        await trio.lowlevel.checkpoint()
        rows = [
            r
            for r in self._runs.values()
            if (machine is None or r.machine == machine)
            and (state is None or r.state == state)
            and (outcome is None or r.outcome == outcome)
        ]
        rows.sort(key=lambda r: (r.started, r.run_id))
        return rows if limit is None else rows[:limit]

    async def aclose(self) -> None:
        self._closed = True
