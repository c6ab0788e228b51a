"""Fixtures shared by the core runtime tests: a fresh in-memory store and a journal reader."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from interlock.events import Event
from interlock.stores import MemoryStore, Store

#: Fields that vary between runs of the same test (wall-clock latencies, prompt text and
#: token estimates); ``events_of`` leaves them out so tests compare what the run decided.
VOLATILE_FIELDS = frozenset(
    {
        "run_id",
        "seq",
        "ts",
        "latency",
        "prompt",
        "prompt_hash",
        "prompt_base",
        "prompt_prefix",
        "prompt_suffix",
        "usage",
    }
)

EventSummary = tuple[str, dict[str, Any]]

#: The bytecode cache of the processes the tests start, when PYTHONDONTWRITEBYTECODE is set.
_PYCACHE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """With PYTHONDONTWRITEBYTECODE set, every ``python -m interlock`` (or benchmark child,
    or valgrind'd child) the tests start compiles each module it imports from source again:
    about a third of such a process's CPU, and the suite starts well over a thousand. They
    share a bytecode cache instead, in a directory of this session's own (PYTHONPYCACHEPREFIX):
    still nothing is written beside the sources, which is what that variable asks for."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        _PYCACHE.append(tempfile.mkdtemp(prefix="interlock-tests-pycache-"))
        os.environ["PYTHONPYCACHEPREFIX"] = _PYCACHE[0]
        del os.environ["PYTHONDONTWRITEBYTECODE"]


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in _PYCACHE:
        shutil.rmtree(directory, ignore_errors=True)


def summarize(events: list[Event]) -> list[EventSummary]:
    """Return ``(class name, fields)`` for each event, without :data:`VOLATILE_FIELDS`.

    Also checks the journal's invariants: one run, seqs contiguous from 1.
    """
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len({e.run_id for e in events}) <= 1
    return [
        (
            type(e).__name__,
            {
                k: v
                for k, v in msgspec.structs.asdict(e).items()
                if k not in VOLATILE_FIELDS and v is not msgspec.UNSET  # absent: not written
            },
        )
        for e in events
    ]


async def _events_of(store: Store, run_id: str) -> list[EventSummary]:
    return summarize(await store.load(run_id))


@pytest.fixture
def memory_store() -> MemoryStore:
    """An empty in-memory store."""
    return MemoryStore()


@pytest.fixture
def events_of() -> Callable[[Store, str], Awaitable[list[EventSummary]]]:
    """``await events_of(store, run_id)``: the run's journal as ``(class name, fields)`` pairs."""
    return _events_of
