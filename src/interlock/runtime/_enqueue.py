"""Runs created in the journal with no process driving them: whoever resumes the journal next
(``interlock resume``, a supervisor's :meth:`~interlock.Supervisor.resume_unfinished`) drives
them, as it drives a run interrupted by a crash."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from ..core import _decider
from ..core._exceptions import InvalidRunId, RunExists, RunNotFound
from ..core._messages import Start

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from ..core._events import Event
    from ..core._machine import Machine
    from ..stores import Store

__all__ = ["enqueue_run", "enqueue_runs"]


async def enqueue_run(
    store: Store,
    machine: Machine,
    inputs: Mapping[str, Any] | None = None,
    *,
    run_id: str | None = None,
    clock: Callable[[], float] = time.time,
    trace: str | None = None,
) -> str:
    """Create a run of ``machine`` in ``store`` and return its id, once its ``run_started``
    event is durable. Nothing drives it yet: the next process that resumes the journal
    (``interlock resume --app REF --db URL``, or :meth:`Supervisor.resume_unfinished`) runs
    it, with the provider of that process.

    Args:
      store: an open store (``open_sqlite_store``, ``open_postgres_store``, ``open_store``).
      machine: the run's machine; the process that resumes it must have one of that name.
      inputs: the run's inputs, checked against the machine's ``inputs`` schema.
      run_id: the run's id; a random one (``run-`` and 16 hex digits) if omitted.
      clock: the time recorded in the event.
      trace: a W3C ``traceparent`` to journal with the start (a request's that enqueued
        it): the spans of the process that drives the run continue it (tracing on there).

    Raises:
      InvalidInputs: the inputs break the machine's schema or cannot be journaled; nothing
        was written.
      InvalidRunId: ``run_id`` is empty or not a string.
      RunExists: ``run_id`` already names a run in the store.
      StoreError: the event could not be written.
    """
    payload = machine.check_inputs(inputs)
    if run_id is None:
        run_id = f"run-{uuid.uuid4().hex[:16]}"
    elif not isinstance(run_id, str) or not run_id:
        raise InvalidRunId(f"run_id must be a non-empty string, not {run_id!r}")
    try:
        await store.get_run(run_id)
    except RunNotFound:
        pass
    else:
        raise RunExists(
            f"run {run_id!r} already exists in this journal; run ids must be unique (omit "
            "run_id to have one generated)"
        )
    events: list[Event] = []
    _decider.start(
        machine,
        Start(run_id=run_id, machine=machine.name, inputs=payload, trace=trace or ""),
        clock(),
        events,
    )
    await store.append(events)
    return run_id


async def enqueue_runs(
    store: Store,
    machine: Machine,
    inputs: Iterable[Mapping[str, Any] | None],
    *,
    run_ids: Sequence[str] | None = None,
    clock: Callable[[], float] = time.time,
) -> list[str]:
    """Create many runs of ``machine`` in one write (one transaction) and return their ids,
    in order, once durable; see :func:`enqueue_run`. All or nothing: if any inputs are
    refused, or any run id is taken, nothing is written.

    Args:
      store: an open store.
      machine: the runs' machine.
      inputs: each run's inputs, checked against the machine's ``inputs`` schema.
      run_ids: the runs' ids, one per inputs; random ones if omitted.
      clock: the time recorded in the events.

    Raises:
      InvalidInputs: some inputs break the machine's schema (the message says which,
        counting from 0, and so does its ``index``); nothing was written.
      InvalidRunId: ``run_ids`` does not match ``inputs`` one to one, or repeats an id,
        or holds one that is not a non-empty string; nothing was written.
      RunExists: one of ``run_ids`` names a run already in the store; nothing was written.
      StoreError: the events could not be written.
    """
    from ..core._exceptions import InvalidInputs

    payloads = []
    for index, item in enumerate(inputs):
        try:
            payloads.append(machine.check_inputs(item))
        except InvalidInputs as exc:
            error = InvalidInputs(f"inputs[{index}]: {exc}; nothing was written")
            error.index = index  # type: ignore[attr-defined]
            raise error from exc
    if run_ids is None:
        ids = [f"run-{uuid.uuid4().hex[:16]}" for _ in payloads]
    else:
        ids = list(run_ids)
        if len(ids) != len(payloads):
            raise InvalidRunId(
                f"run_ids holds {len(ids)} ids for {len(payloads)} inputs; give one per inputs "
                "(or none, to have them generated)"
            )
        for run_id in ids:
            if not isinstance(run_id, str) or not run_id:
                raise InvalidRunId(f"run ids must be non-empty strings, not {run_id!r}")
        seen: set[str] = set()
        for run_id in ids:
            if run_id in seen:
                raise InvalidRunId(f"run id {run_id!r} is given twice; run ids must be unique")
            seen.add(run_id)
        for run_id in ids:
            try:
                await store.get_run(run_id)
            except RunNotFound:
                continue
            raise RunExists(
                f"run {run_id!r} already exists in this journal; run ids must be unique "
                "(omit run_ids to have them generated); nothing was written"
            )
    events: list[Event] = []
    now = clock()
    for run_id, payload in zip(ids, payloads, strict=True):
        _decider.start(
            machine, Start(run_id=run_id, machine=machine.name, inputs=payload), now, events
        )
    if events:
        await store.append(events)
    return ids
