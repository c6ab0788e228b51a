"""Type stub of the compiled decide path (ext/_decide.pyx); its twin is ``_view.PyRunState``
and ``_decider``'s own paths."""

from collections.abc import Callable
from typing import Any

from ._events import Event
from ._messages import Propose, Report, Request, Verdict
from ._stats import RuntimeStats
from ._view import PyRunState

class RunState(PyRunState): ...

class Collaborators:
    """What the compiled decide path calls of the pure modules (they import it, so it cannot
    import them): built once by ``interlock.core._decider``, naming each part, and given to
    :func:`install`. Every part is required; each is readable back."""

    # the fold (interlock.core._view)
    frame: Any  # _view.Frame
    in_frame: Callable[..., Any]  # _view.ToolResult._in_frame
    violation_signature: Callable[..., int]
    proposal_data: Callable[[str, int, str], dict[str, Any]]
    call_hash: Callable[[str, Any], int]  # _view._call_hash
    no_data: dict[str, Any]  # _view._NO_DATA, the shared empty data
    no_turns: list[Any]  # _view._NO_TURNS
    run_view: type[Any]  # _view.RunView
    canonical_encode: Callable[[Any], bytes]  # _view.canonical_encoder.encode
    # the twin's paths and helpers (interlock.core._decider)
    on_propose: Callable[..., Verdict]  # _decider._on_propose, for all it does not decide
    on_report: Callable[..., Verdict]  # _decider._on_report
    reject: Callable[..., Verdict]
    transition: Callable[..., None]
    is_fallback: Callable[[Any, str], bool]
    close: Callable[..., None]
    delta_by_reference: int  # _decider._DELTA_BY_REFERENCE
    # the gate's stages (interlock.core._gate) and the circuit board's type
    verify: Callable[..., Any]
    checked_call: Callable[..., Any]
    plan: Callable[[Any, str], Any]
    decision: type[Any]  # _gate.Decision
    envelope_decode: Callable[[bytes], Any]
    envelope: type[Any]  # _gate._Envelope
    move_data: Callable[..., tuple[Any, Any]]
    dict_decode: Callable[[Any], dict[str, Any]]
    circuit_board: type[Any]  # _breakers.CircuitBoard
    ok: int  # _gate.OK
    # where ``envelope`` holds next, tool and data (-1: read by name)
    env_next: int
    env_tool: int
    env_data: int

    def __init__(
        self,
        *,
        frame: Any,
        in_frame: Callable[..., Any],
        violation_signature: Callable[..., int],
        proposal_data: Callable[[str, int, str], dict[str, Any]],
        call_hash: Callable[[str, Any], int],
        no_data: dict[str, Any],
        no_turns: list[Any],
        run_view: type[Any],
        canonical_encode: Callable[[Any], bytes],
        short_json: int,
        on_propose: Callable[..., Verdict],
        on_report: Callable[..., Verdict],
        reject: Callable[..., Verdict],
        transition: Callable[..., None],
        is_fallback: Callable[[Any, str], bool],
        close: Callable[..., None],
        delta_by_reference: int,
        verify: Callable[..., Any],
        checked_call: Callable[..., Any],
        plan: Callable[[Any, str], Any],
        decision: type[Any],
        envelope_decode: Callable[[bytes], Any],
        envelope: type[Any],
        move_data: Callable[..., tuple[Any, Any]],
        dict_decode: Callable[[Any], dict[str, Any]],
        circuit_board: type[Any],
        ok: int,
    ) -> None: ...

def install(collaborators: Collaborators) -> None: ...
def installed() -> Collaborators | None: ...
def slot_offsets() -> dict[str, int]: ...
def on_propose(
    run: RunState, msg: Propose, now: float, circuits: Any, events: list[Event]
) -> Verdict: ...
def on_report(
    run: RunState, msg: Report, now: float, circuits: Any, events: list[Event]
) -> Verdict: ...
def decide_many(
    msgs: list[Request],
    events: list[Event],
    runs: dict[str, RunState],
    circuits: Any,
    clock: Callable[[], float],
    stats: RuntimeStats,
    propose: Callable[[Any, Propose, float, Any, list[Event]], Verdict],
    decide: Callable[[Request, list[Event]], Verdict],
    early: Callable[[Request, Verdict], int],
    contain: Callable[[Request, BaseException], Exception],
    find: Callable[[str], RunState],
) -> tuple[list[Verdict | Exception], bool]: ...
