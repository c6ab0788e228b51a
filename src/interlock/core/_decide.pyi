"""Type stub of the compiled decide path (ext/_decide.pyx); its twin is ``_view.PyRunState``
and ``_decider``'s own paths."""

from collections.abc import Callable
from types import ModuleType
from typing import Any

from ._events import Event
from ._messages import Propose, Report, Request, Verdict
from ._view import PyRunState

class RunState(PyRunState): ...

def bind_view(namespace: ModuleType) -> None: ...
def bind_decider(namespace: Any, gate: ModuleType, breakers: ModuleType) -> None: ...
def on_propose(
    run: RunState, msg: Propose, now: float, circuits: Any, events: list[Event]
) -> Verdict: ...
def on_report(
    run: RunState, msg: Report, now: float, circuits: Any, events: list[Event]
) -> Verdict: ...
def decide_many(
    sup: Any, msgs: list[Request], events: list[Event]
) -> tuple[list[Verdict | Exception], bool]: ...
def encode_rows(
    events: list[Event],
    tags: dict[type[Event], str],
    keyed: frozenset[type[Event]],
    encode: Callable[[Any], bytes],
    frame: Callable[[bytes], bytes],
) -> list[tuple[str, int, str, float, str | None, bytes]]: ...
def group_batch(
    events: list[Event],
    encode: Callable[[Any], bytes],
    indexed: frozenset[type[Event]],
    changes: dict[type[Event], Callable[[Any], dict[str, str]]],
    slots: dict[str, int],
    frame_events: Callable[[list[bytes]], bytes],
) -> tuple[
    dict[str, list[Any]],
    list[str],
    bool,
    list[tuple[str, int, int, bytes]],
    list[tuple[str, str, int]],
    list[Event],
    bool,
    int,
]: ...
def move_runs(
    runs: dict[str, list[Any]],
    remembered: dict[str, tuple[Any, ...]],
    stored: dict[str, tuple[Any, ...]],
    starting: set[str],
    first_chunk: int,
    encode: Callable[[Any], bytes],
    crc32: Callable[[bytes], int],
    row_checksum: Callable[..., int],
    running_outcome: str,
) -> tuple[Any, ...] | None: ...
def accept_call(run: RunState, raw: bytes, now: float, circuits: Any) -> Any: ...
