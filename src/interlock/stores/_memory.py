"""An in-memory store, for tests and throwaway runs. Nothing survives the process."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ..core._exceptions import RunNotFound, StoreError
from ._base import (
    RunRecord,
    Store,
    check_batch,
    decode_chunks,
    decode_chunks_after,
    encode_rows,
    index_updates,
    missing_index_row,
    missing_journal,
    select_runs,
)
from ._check import Checker, CheckReport

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..core._events import Event, JournalEvent


class MemoryStore(Store):
    """Keeps the framed journal and the runs index in dicts.

    Events go through the same encode/frame/decode path as the durable stores, so
    what a test sees is what SQLite would have returned. The index rows are the records
    themselves, with no bytes to damage, so they carry no checksum.
    """

    kind = "memory"

    def __init__(self) -> None:
        self._journal: dict[str, list[tuple[int, bytes]]] = {}
        self._runs: dict[str, RunRecord] = {}
        self._keys: set[str] = set()
        self._closed = False
        self.appends = 0

    async def append(self, events: Sequence[Event]) -> None:
        self.append_now(events)
        await trio.lowlevel.checkpoint()

    def immediate_append(self) -> Callable[[Sequence[Event]], None] | None:
        """:meth:`append_now`, unless a subclass changed what :meth:`append` does (a test's
        store that waits or fails): then the group commit goes through ``append``."""
        return self.append_now if type(self).append is MemoryStore.append else None

    def append_now(self, events: Sequence[Event]) -> None:
        """:meth:`append` with nothing to wait for: the group commit writes a run's
        proposal in its own task with it when no batch is being written (there is no
        flush to share, so no hop to the writer task is worth its cost)."""
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

    def _stored(self, run_id: str) -> tuple[list[tuple[int, bytes]], RunRecord]:
        """A run's frames and index row, or the error that says which is missing."""
        journal = self._journal.get(run_id)
        record = self._runs.get(run_id)
        if journal is None:
            if record is not None:
                raise missing_journal(run_id, record.seq)
            raise RunNotFound(run_id)
        if record is None:
            raise missing_index_row(run_id)
        return journal, record

    async def load(self, run_id: str) -> list[JournalEvent]:
        await trio.lowlevel.checkpoint()
        journal, record = self._stored(run_id)
        return decode_chunks(run_id, [(seq, seq, body) for seq, body in journal], record.seq)

    async def load_after(self, run_id: str, seq: int) -> list[JournalEvent]:
        """The events of ``run_id`` after seq ``seq`` (see :meth:`SQLiteStore.load_after`)."""
        await trio.lowlevel.checkpoint()
        journal, record = self._stored(run_id)
        rows = [(s, s, body) for s, body in journal if s > seq]
        return decode_chunks_after(run_id, rows, record.seq, seq)

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
        return select_runs(
            self._runs.values(), machine=machine, state=state, outcome=outcome, limit=limit
        )

    async def check(self) -> CheckReport:
        await trio.lowlevel.checkpoint()
        checker = Checker(self._runs, ())
        for run_id, journal in self._journal.items():
            checker.run(run_id, [(seq, seq, body) for seq, body in journal])
        return checker.report()

    async def aclose(self) -> None:
        self._closed = True
