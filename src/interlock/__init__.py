"""interlock: a deterministic runtime for LLM agent loops.

The model proposes; a deterministic gate verifies each proposal against the run's
state machine; only a verified action is committed to an append-only journal.
"""

import typing as _typing

from ._version import __version__ as __version__
from .core._breakers import BREAKERS as BREAKERS
from .core._events import (
    BreakerTripped as BreakerTripped,
)
from .core._events import (
    Completed as Completed,
)
from .core._events import (
    Escalated as Escalated,
)
from .core._events import (
    Event as Event,
)
from .core._events import (
    Failed as Failed,
)
from .core._events import (
    IntentRecorded as IntentRecorded,
)
from .core._events import (
    JournalEvent as JournalEvent,
)
from .core._events import (
    ModelCalled as ModelCalled,
)
from .core._events import Oversized as Oversized
from .core._events import (
    ProposalRejected as ProposalRejected,
)
from .core._events import ProviderFailed as ProviderFailed
from .core._events import Reconciled as Reconciled
from .core._events import (
    Resumed as Resumed,
)
from .core._events import (
    RunStarted as RunStarted,
)
from .core._events import (
    StepProposed as StepProposed,
)
from .core._events import (
    TokenUsage as TokenUsage,
)
from .core._events import (
    ToolCommitted as ToolCommitted,
)
from .core._events import (
    ToolFailed as ToolFailed,
)
from .core._events import ToolInDoubt as ToolInDoubt
from .core._events import (
    Transitioned as Transitioned,
)
from .core._events import (
    Violation as Violation,
)
from .core._events import (
    decode_event as decode_event,
)
from .core._events import (
    encode_event as encode_event,
)
from .core._events import (
    expand_prompt as expand_prompt,
)
from .core._events import (
    hash_prompt as hash_prompt,
)
from .core._events import (
    whole_prompts as whole_prompts,
)
from .core._exceptions import AppRefError as AppRefError
from .core._exceptions import EscalationResolved as EscalationResolved
from .core._exceptions import IllegalResumeTarget as IllegalResumeTarget
from .core._exceptions import IndexDamaged as IndexDamaged
from .core._exceptions import (
    InterlockError as InterlockError,
)
from .core._exceptions import (
    InternalError as InternalError,
)
from .core._exceptions import InvalidInputs as InvalidInputs
from .core._exceptions import (
    JournalCorrupt as JournalCorrupt,
)
from .core._exceptions import (
    LeaseLost as LeaseLost,
)
from .core._exceptions import (
    MachineDefinitionError as MachineDefinitionError,
)
from .core._exceptions import NoProvider as NoProvider
from .core._exceptions import NotEscalated as NotEscalated
from .core._exceptions import PayloadRejected as PayloadRejected
from .core._exceptions import (
    ProtocolError as ProtocolError,
)
from .core._exceptions import ProviderError as ProviderError
from .core._exceptions import (
    ReplayDivergence as ReplayDivergence,
)
from .core._exceptions import RequestRefused as RequestRefused
from .core._exceptions import (
    RunNotFound as RunNotFound,
)
from .core._exceptions import StoreDamaged as StoreDamaged
from .core._exceptions import (
    StoreError as StoreError,
)
from .core._exceptions import (
    ToolDefinitionError as ToolDefinitionError,
)
from .core._exceptions import UnknownMachine as UnknownMachine
from .core._exceptions import UnknownState as UnknownState
from .core._machine import (
    ESCALATE as ESCALATE,
)
from .core._machine import (
    FAILED as FAILED,
)
from .core._machine import (
    BreakerPolicy as BreakerPolicy,
)
from .core._machine import (
    Budgets as Budgets,
)
from .core._machine import (
    Call as Call,
)
from .core._machine import (
    Go as Go,
)
from .core._machine import (
    Machine as Machine,
)
from .core._machine import ProviderPolicy as ProviderPolicy
from .core._machine import (
    Step as Step,
)
from .core._machine import (
    Worker as Worker,
)
from .core._messages import Abort as Abort
from .core._messages import (
    Cancel as Cancel,
)
from .core._messages import (
    Message as Message,
)
from .core._messages import (
    Propose as Propose,
)
from .core._messages import Reconciliation as Reconciliation
from .core._messages import Recover as Recover
from .core._messages import (
    Report as Report,
)
from .core._messages import Request as Request
from .core._messages import Resume as Resume
from .core._messages import (
    Start as Start,
)
from .core._messages import Sync as Sync
from .core._messages import (
    ToolCall as ToolCall,
)
from .core._messages import (
    Verdict as Verdict,
)
from .core._messages import (
    decode_message as decode_message,
)
from .core._messages import (
    encode_message as encode_message,
)
from .core._stats import RuntimeStats as RuntimeStats
from .core._stats import SupervisorStatistics as SupervisorStatistics
from .core._tools import Applied as Applied
from .core._tools import NotApplied as NotApplied
from .core._tools import (
    Reject as Reject,
)
from .core._tools import (
    RetryableToolError as RetryableToolError,
)
from .core._tools import (
    RetryPolicy as RetryPolicy,
)
from .core._tools import (
    Tool as Tool,
)
from .core._tools import (
    ToolContext as ToolContext,
)
from .core._tools import ToolError as ToolError
from .core._view import Frame as Frame
from .core._view import RunView as RunView
from .core._view import ToolResult as ToolResult
from .runtime._app import App as App
from .runtime._enqueue import enqueue_run as enqueue_run
from .runtime._enqueue import enqueue_runs as enqueue_runs
from .runtime._handle import RunHandle as RunHandle
from .runtime._handle import RunResult as RunResult
from .runtime._replay import (
    Divergence as Divergence,
)
from .runtime._replay import (
    ReplayReport as ReplayReport,
)
from .runtime._replay import (
    RunReplay as RunReplay,
)
from .runtime._replay import (
    replay as replay,
)
from .runtime._runtime import open_supervisor as open_supervisor
from .runtime._supervisor import (
    Supervisor as Supervisor,
)
from .runtime._worker import WorkerControl as WorkerControl
from .runtime._worker import WorkerSummary as WorkerSummary
from .runtime._worker import run_worker as run_worker

if _typing.TYPE_CHECKING:
    from .runtime._metrics import RuntimeCollector as RuntimeCollector
    from .runtime._metrics import serve_metrics as serve_metrics

#: Public names loaded on first use: importing prometheus_client is slow at start-up.
_LAZY = ("RuntimeCollector", "serve_metrics")


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
    if name in _INTERNAL:
        raise AttributeError(
            f"interlock.{name} is internal (it holds mutable runtime state); {_INTERNAL[name]}"
        )
    raise AttributeError(f"module 'interlock' has no attribute {name!r}")


__all__ = [
    "BREAKERS",
    "ESCALATE",
    "FAILED",
    "Abort",
    "App",
    "AppRefError",
    "Applied",
    "BreakerPolicy",
    "BreakerTripped",
    "Budgets",
    "Call",
    "Cancel",
    "Completed",
    "Divergence",
    "Escalated",
    "EscalationResolved",
    "Event",
    "Failed",
    "Frame",
    "Go",
    "IllegalResumeTarget",
    "IndexDamaged",
    "IntentRecorded",
    "InterlockError",
    "InternalError",
    "InvalidInputs",
    "JournalCorrupt",
    "JournalEvent",
    "LeaseLost",
    "Machine",
    "MachineDefinitionError",
    "Message",
    "ModelCalled",
    "NoProvider",
    "NotApplied",
    "NotEscalated",
    "Oversized",
    "PayloadRejected",
    "ProposalRejected",
    "Propose",
    "ProtocolError",
    "ProviderError",
    "ProviderFailed",
    "ProviderPolicy",
    "Reconciled",
    "Reconciliation",
    "Recover",
    "Reject",
    "ReplayDivergence",
    "ReplayReport",
    "Report",
    "Request",
    "RequestRefused",
    "Resume",
    "Resumed",
    "RetryPolicy",
    "RetryableToolError",
    "RunHandle",
    "RunNotFound",
    "RunReplay",
    "RunResult",
    "RunStarted",
    "RunView",
    "RuntimeCollector",
    "RuntimeStats",
    "Start",
    "Step",
    "StepProposed",
    "StoreDamaged",
    "StoreError",
    "Supervisor",
    "SupervisorStatistics",
    "Sync",
    "TokenUsage",
    "Tool",
    "ToolCall",
    "ToolCommitted",
    "ToolContext",
    "ToolDefinitionError",
    "ToolError",
    "ToolFailed",
    "ToolInDoubt",
    "ToolResult",
    "Transitioned",
    "UnknownMachine",
    "UnknownState",
    "Verdict",
    "Violation",
    "Worker",
    "WorkerControl",
    "WorkerSummary",
    "__version__",
    "decode_event",
    "decode_message",
    "encode_event",
    "encode_message",
    "enqueue_run",
    "enqueue_runs",
    "expand_prompt",
    "hash_prompt",
    "open_supervisor",
    "replay",
    "run_worker",
    "serve_metrics",
    "whole_prompts",
]
