"""interlock: a deterministic runtime for LLM agent loops.

The model proposes; a deterministic gate verifies each proposal against the run's state
machine; only a verified action is committed to an append-only journal.

What an application imports from here:

Defining a machine
    Machine, Step, Worker, Tool, ToolContext, Call, Go, Reject, Budgets, BreakerPolicy,
    ProviderPolicy, RetryPolicy, ESCALATE, FAILED, RunView, ToolResult
What a tool's call comes to
    ToolError, RetryableToolError, Applied, NotApplied
Running machines
    App, open_supervisor, Supervisor, RunHandle, RunResult, enqueue_run, enqueue_runs,
    run_worker, WorkerControl, WorkerSummary, serve_metrics, Tracing, tracing_from_env
Replaying recorded runs
    replay, ReplayReport, RunReplay, Divergence
The errors an application catches (every one is in :mod:`interlock.errors`)
    InterlockError, MachineDefinitionError, ToolDefinitionError, InvalidInputs,
    UnknownMachine, RunNotFound, ProtocolError, NotEscalated, StoreError, StoreDamaged,
    LeaseLost, ProviderError, ReplayDivergence; and by what to do about them:
    StaleSeq, RunEnded, RunExists, OutOfTurn, NotExternal, RunLeased, InvalidRunId,
    MalformedMessage, JournalInconsistent, ConfigurationError, LifespanError, MissingExtra

And in their own modules: :mod:`interlock.events` (the journal's events),
:mod:`interlock.messages` (requests and verdicts), :mod:`interlock.errors`,
:mod:`interlock.metrics`, :mod:`interlock.stores`, :mod:`interlock.providers`,
:mod:`interlock.gateway` (the HTTP gateway), :mod:`interlock.protocol` (its wire format),
:mod:`interlock.client` (its clients) and :mod:`interlock.testing` (a fake LLM server).
"""

import typing as _typing

from ._version import __version__ as __version__
from .core._exceptions import (
    InterlockError,
    InvalidInputs,
    LeaseLost,
    MachineDefinitionError,
    NotEscalated,
    ProtocolError,
    ProviderError,
    ReplayDivergence,
    RunNotFound,
    StoreDamaged,
    StoreError,
    ToolDefinitionError,
    UnknownMachine,
)
from .core._machine import (
    ESCALATE,
    FAILED,
    BreakerPolicy,
    Budgets,
    Call,
    Go,
    Machine,
    ProviderPolicy,
    Step,
    Worker,
)
from .core._tools import (
    Applied,
    NotApplied,
    Reject,
    RetryableToolError,
    RetryPolicy,
    Tool,
    ToolContext,
    ToolError,
)
from .core._view import RunView, ToolResult
from .runtime._app import App
from .runtime._enqueue import enqueue_run, enqueue_runs
from .runtime._handle import RunHandle, RunResult
from .runtime._replay import Divergence, ReplayReport, RunReplay, replay
from .runtime._runtime import open_supervisor
from .runtime._supervisor import Supervisor
from .runtime._tracing import Tracing, tracing_from_env
from .runtime._worker import WorkerControl, WorkerSummary, run_worker

# isort: split
# errors: one class per decision a caller makes (#34); __all__ gets them at the end
from .core._exceptions import (
    ConfigurationError,
    InvalidRunId,
    JournalInconsistent,
    LifespanError,
    MalformedMessage,
    MissingExtra,
    NotExternal,
    OutOfTurn,
    RunEnded,
    RunExists,
    RunLeased,
    StaleSeq,
)

if _typing.TYPE_CHECKING:
    from .runtime._metrics import serve_metrics as serve_metrics

#: Public names loaded on first use: importing prometheus_client is slow at start-up.
_LAZY = ("serve_metrics",)

#: Where names that were public here once live now: each public module's own ``__all__``.
_HOMES = ("events", "messages", "errors", "metrics", "providers")


def _moved_to(name: str) -> str | None:
    import importlib

    for home in _HOMES:
        if name in importlib.import_module(f"interlock.{home}").__all__:
            return f"interlock.{home}"
    return None


#: Internals that were public once: what to use instead.
_INTERNAL = {
    "RunState": "read a run through RunView (Supervisor.view) or fold it with replay",
    "Decision": "the gate's verdict reaches you as a Verdict (Supervisor.submit, request)",
    "CircuitBoard": "read circuits with Supervisor.circuit_state() or the metrics",
    "verify": "verify proposals through a run: Supervisor.submit on an external run",
    "fold": "replay a journal with interlock.replay, or read live runs with Supervisor.view",
}


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        from .runtime import _metrics

        return getattr(_metrics, name)
    home = None if name.startswith("_") else _moved_to(name)
    if home is not None:
        raise AttributeError(
            f"interlock.{name} moved: import it from {home} (from {home} import {name})"
        )
    if name in _INTERNAL:
        raise AttributeError(
            f"interlock.{name} is internal (it holds mutable runtime state); {_INTERNAL[name]}"
        )
    raise AttributeError(f"module 'interlock' has no attribute {name!r}")


__all__ = [
    "ESCALATE",
    "FAILED",
    "App",
    "Applied",
    "BreakerPolicy",
    "Budgets",
    "Call",
    "Divergence",
    "Go",
    "InterlockError",
    "InvalidInputs",
    "LeaseLost",
    "Machine",
    "MachineDefinitionError",
    "NotApplied",
    "NotEscalated",
    "ProtocolError",
    "ProviderError",
    "ProviderPolicy",
    "Reject",
    "ReplayDivergence",
    "ReplayReport",
    "RetryPolicy",
    "RetryableToolError",
    "RunHandle",
    "RunNotFound",
    "RunReplay",
    "RunResult",
    "RunView",
    "Step",
    "StoreDamaged",
    "StoreError",
    "Supervisor",
    "Tool",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolResult",
    "Tracing",
    "UnknownMachine",
    "Worker",
    "WorkerControl",
    "WorkerSummary",
    "__version__",
    "enqueue_run",
    "enqueue_runs",
    "open_supervisor",
    "replay",
    "run_worker",
    "serve_metrics",
    "tracing_from_env",
]

# errors: the classes imported under the same comment above (#34)
__all__ += [
    "ConfigurationError",
    "InvalidRunId",
    "JournalInconsistent",
    "LifespanError",
    "MalformedMessage",
    "MissingExtra",
    "NotExternal",
    "OutOfTurn",
    "RunEnded",
    "RunExists",
    "RunLeased",
    "StaleSeq",
]
