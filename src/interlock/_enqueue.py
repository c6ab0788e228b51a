"""Runs created in the journal with no process driving them: whoever resumes the journal next
(``interlock resume``, a supervisor's :meth:`~interlock.Supervisor.resume_unfinished`) drives
them, as it drives a run interrupted by a crash."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from . import _decider
from ._exceptions import ProtocolError, RunNotFound
from ._messages import Start

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._events import Event
    from ._machine import Machine
    from .stores import Store

__all__ = ["enqueue_run"]


async def enqueue_run(
    store: Store,
    machine: Machine,
    inputs: Mapping[str, Any] | None = None,
    *,
    run_id: str | None = None,
    clock: Callable[[], float] = time.time,
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

    Raises:
      InvalidInputs: the inputs break the machine's schema or cannot be journaled; nothing
        was written.
      ProtocolError: ``run_id`` is empty or already names a run in the store.
      StoreError: the event could not be written.
    """
    payload = machine.check_inputs(inputs)
    if run_id is None:
        run_id = f"run-{uuid.uuid4().hex[:16]}"
    elif not isinstance(run_id, str) or not run_id:
        raise ProtocolError(f"run_id must be a non-empty string, not {run_id!r}")
    try:
        await store.get_run(run_id)
    except RunNotFound:
        pass
    else:
        raise ProtocolError(
            f"run {run_id!r} already exists in this journal; run ids must be unique (omit "
            "run_id to have one generated)"
        )
    events: list[Event] = []
    _decider.start(
        machine, Start(run_id=run_id, machine=machine.name, inputs=payload), clock(), events
    )
    await store.append(events)
    return run_id
