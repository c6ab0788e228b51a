"""What :meth:`Store.check` reports, and the checks every store shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ..core._events import IntentRecorded
from ..core._exceptions import IndexDamaged, JournalCorrupt
from ._base import (
    cut_short,
    index_updates,
    missing_index_row,
    missing_journal,
    read_chunks,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from ._base import RunRecord


class CheckProblem(msgspec.Struct, frozen=True, kw_only=True):
    """One piece of damage :meth:`Store.check` found."""

    run_id: str | None
    """The run it concerns, or None for the file as a whole (SQLite's own check)."""
    seq: int | None
    """The first seq it concerns, or None for a whole run or its index row."""
    message: str
    """What is wrong, as the error reading that part of the store would say it."""


class CheckReport(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`Store.check` read, and every problem it found."""

    runs: int
    """Runs found, in the journal or in the runs index."""
    events: int
    """Events the journal holds (by their seqs, damaged ones included)."""
    problems: tuple[CheckProblem, ...]

    @property
    def ok(self) -> bool:
        """Whether no damage was found."""
        return not self.problems


class Checker:
    """Checks one run at a time against a runs index read beforehand (sync: a store runs it
    in its worker thread, reading the journal run by run)."""

    def __init__(self, index: Mapping[str, RunRecord], damaged: Iterable[IndexDamaged]) -> None:
        """Start from the verified index rows and the rows that failed their checksum."""
        self.index = index
        self.problems = [CheckProblem(run_id=e.run_id, seq=None, message=str(e)) for e in damaged]
        self.damaged = {e.run_id for e in damaged if e.run_id is not None}
        self.journaled: set[str] = set()
        self.intact: set[str] = set()
        self.complete = True
        self.events = 0
        self.intents: set[tuple[str, str, int]] = set()
        """``(key, run_id, seq)`` of every intent in the intact journals."""

    def run(self, run_id: str, rows: list[tuple[int, int, bytes]]) -> None:
        """Check one run's journal (chunks in first_seq order) and its index row."""
        self.journaled.add(run_id)
        self.events += sum(last - first + 1 for first, last, _body in rows)
        events, damages = read_chunks(run_id, rows)
        self.problems += [CheckProblem(run_id=run_id, seq=seq, message=m) for seq, m in damages]
        if damages:
            return
        try:
            expected = index_updates(events, {})[run_id]
        except JournalCorrupt as exc:  # its first event is not run_started
            self.problem(run_id, 1, str(exc))
            return
        self.intact.add(run_id)
        self.intents.update((e.key, run_id, e.seq) for e in events if isinstance(e, IntentRecorded))
        record = self.index.get(run_id)
        if record is None:
            if run_id not in self.damaged:
                self.problem(run_id, None, str(missing_index_row(run_id)))
        elif record.seq > expected.seq:
            # The row is sound (it passed its checksum): the journal lost its last events.
            self.problem(run_id, expected.seq + 1, str(cut_short(run_id, expected.seq, record.seq)))
        elif record != expected:
            stored = msgspec.structs.asdict(record)
            derived = msgspec.structs.asdict(expected)
            what = ", ".join(
                f"{name} {stored[name]!r} where the journal says {derived[name]!r}"
                for name in stored
                if stored[name] != derived[name]
            )
            self.problem(run_id, None, str(IndexDamaged(run_id, what)))

    def problem(self, run_id: str | None, seq: int | None, message: str) -> None:
        """Add a problem a store found on its own."""
        self.problems.append(CheckProblem(run_id=run_id, seq=seq, message=message))

    def intents_table(self, rows: Iterable[tuple[Any, ...]], table: str) -> None:
        """Compare the stored idempotency keys ``(key, run_id, seq)`` with the intents of
        the intact journals (a damaged journal's intents are unknown)."""
        stored = {(row[0], row[1], row[2]) for row in rows if row[1] in self.intact}
        for key, run_id, seq in sorted(self.intents - stored, key=_by_run):
            self.problem(
                run_id,
                seq,
                f"{table} lacks idempotency key {key!r} of run {run_id!r} seq {seq}, so a "
                "second intent with that key would not be refused; restore it from a backup",
            )
        for key, run_id, seq in sorted(stored - self.intents, key=_by_run):
            self.problem(
                run_id,
                seq,
                f"{table} holds idempotency key {key!r} for run {run_id!r} seq {seq}, which "
                "the run's journal does not record; restore it from a backup",
            )

    def stopped(self, message: str) -> None:
        """Record why the store could not be read to its end (so no journal counts as missing)."""
        self.problem(None, None, message)
        self.complete = False

    def report(self) -> CheckReport:
        """The report, once every run of the journal was checked (or :meth:`stopped`)."""
        for run_id, record in self.index.items():
            if self.complete and run_id not in self.journaled:
                self.problem(run_id, None, str(missing_journal(run_id, record.seq)))
        runs = len(self.journaled | set(self.index) | self.damaged)
        return CheckReport(runs=runs, events=self.events, problems=tuple(self.problems))


def _by_run(intent: tuple[Any, ...]) -> tuple[Any, ...]:
    return intent[1], intent[2]
