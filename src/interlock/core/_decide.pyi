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
def bind_gateway(namespace: ModuleType) -> None: ...
def take_proposals(
    runs: dict[str, Any],
    answers: Any,
    run_ids: list[str],
    bodies: list[Any],
    principal: Any,
    submit: Callable[[list[Any]], list[Any]],
    refused: Callable[..., None],
    verdicts: list[Any],
    later: list[int],
    decided: list[tuple[int, Verdict, Any, int]],
) -> None: ...
def settle_from(
    decided: list[tuple[int, Verdict, Any, int]],
    at: int,
    verdicts: list[Any],
    runs: dict[str, Any],
    settle: Callable[[str], None],
    steps: dict[str, frozenset[str]],
    steps_of: Callable[[Any], frozenset[str]],
    reconciling: set[tuple[str, str]],
) -> int: ...
def bind_channel(namespace: ModuleType) -> None: ...
def take_bodies(
    requests: list[Any],
    decode: Callable[[Any], Any],
    refuse: Callable[[Any, Exception], None],
    taken: list[Any],
    run_ids: list[str],
    bodies: list[Any],
) -> None: ...
def frame_verdicts(
    out: bytearray, requests: list[Any], verdicts: list[Any], put: Callable[[Any], None]
) -> None: ...
def release_runs(
    requests: list[Any], runs: dict[str, Any], schedule: Callable[[str], None]
) -> None: ...
def take_frames(
    conn: Any, data: bytes, pos: int, take: Callable[[bytes, Any], None], nursery: Any
) -> tuple[int, int, int]: ...
