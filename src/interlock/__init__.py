"""interlock: a deterministic runtime for LLM agent loops.

The model proposes; a deterministic gate verifies each proposal against the run's
state machine; only a verified action is committed to an append-only journal.
"""

import typing as _typing

from ._app import App as App
from ._breakers import BREAKERS as BREAKERS
from ._enqueue import enqueue_run as enqueue_run
from ._enqueue import enqueue_runs as enqueue_runs
from ._events import (
    BreakerTripped as BreakerTripped,
)
from ._events import (
    Completed as Completed,
)
from ._events import (
    Escalated as Escalated,
)
from ._events import (
    Event as Event,
)
from ._events import (
    Failed as Failed,
)
from ._events import (
    IntentRecorded as IntentRecorded,
)
from ._events import (
    JournalEvent as JournalEvent,
)
from ._events import (
    ModelCalled as ModelCalled,
)
from ._events import Oversized as Oversized
from ._events import (
    ProposalRejected as ProposalRejected,
)
from ._events import ProviderFailed as ProviderFailed
from ._events import Reconciled as Reconciled
from ._events import (
    Resumed as Resumed,
)
from ._events import (
    RunStarted as RunStarted,
)
from ._events import (
    StepProposed as StepProposed,
)
from ._events import (
    TokenUsage as TokenUsage,
)
from ._events import (
    ToolCommitted as ToolCommitted,
)
from ._events import (
    ToolFailed as ToolFailed,
)
from ._events import ToolInDoubt as ToolInDoubt
from ._events import (
    Transitioned as Transitioned,
)
from ._events import (
    Violation as Violation,
)
from ._events import (
    decode_event as decode_event,
)
from ._events import (
    encode_event as encode_event,
)
from ._events import (
    expand_prompt as expand_prompt,
)
from ._events import (
    hash_prompt as hash_prompt,
)
from ._events import (
    whole_prompts as whole_prompts,
)
from ._exceptions import AppRefError as AppRefError
from ._exceptions import EscalationResolved as EscalationResolved
from ._exceptions import IllegalResumeTarget as IllegalResumeTarget
from ._exceptions import IndexDamaged as IndexDamaged
from ._exceptions import (
    InterlockError as InterlockError,
)
from ._exceptions import (
    InternalError as InternalError,
)
from ._exceptions import InvalidInputs as InvalidInputs
from ._exceptions import (
    JournalCorrupt as JournalCorrupt,
)
from ._exceptions import (
    LeaseLost as LeaseLost,
)
from ._exceptions import (
    MachineDefinitionError as MachineDefinitionError,
)
from ._exceptions import NoProvider as NoProvider
from ._exceptions import NotEscalated as NotEscalated
from ._exceptions import PayloadRejected as PayloadRejected
from ._exceptions import (
    ProtocolError as ProtocolError,
)
from ._exceptions import ProviderError as ProviderError
from ._exceptions import (
    ReplayDivergence as ReplayDivergence,
)
from ._exceptions import RequestRefused as RequestRefused
from ._exceptions import (
    RunNotFound as RunNotFound,
)
from ._exceptions import StoreDamaged as StoreDamaged
from ._exceptions import (
    StoreError as StoreError,
)
from ._exceptions import (
    ToolDefinitionError as ToolDefinitionError,
)
from ._exceptions import UnknownMachine as UnknownMachine
from ._exceptions import UnknownState as UnknownState
from ._handle import RunHandle as RunHandle
from ._handle import RunResult as RunResult
from ._machine import (
    ESCALATE as ESCALATE,
)
from ._machine import (
    FAILED as FAILED,
)
from ._machine import (
    BreakerPolicy as BreakerPolicy,
)
from ._machine import (
    Budgets as Budgets,
)
from ._machine import (
    Call as Call,
)
from ._machine import (
    Go as Go,
)
from ._machine import (
    Machine as Machine,
)
from ._machine import ProviderPolicy as ProviderPolicy
from ._machine import (
    Step as Step,
)
from ._machine import (
    Worker as Worker,
)
from ._messages import Abort as Abort
from ._messages import (
    Cancel as Cancel,
)
from ._messages import (
    Message as Message,
)
from ._messages import (
    Propose as Propose,
)
from ._messages import Reconciliation as Reconciliation
from ._messages import Recover as Recover
from ._messages import (
    Report as Report,
)
from ._messages import Request as Request
from ._messages import Resume as Resume
from ._messages import (
    Start as Start,
)
from ._messages import Sync as Sync
from ._messages import (
    ToolCall as ToolCall,
)
from ._messages import (
    Verdict as Verdict,
)
from ._messages import (
    decode_message as decode_message,
)
from ._messages import (
    encode_message as encode_message,
)
from ._replay import (
    Divergence as Divergence,
)
from ._replay import (
    ReplayReport as ReplayReport,
)
from ._replay import (
    RunReplay as RunReplay,
)
from ._replay import (
    replay as replay,
)
from ._runtime import open_supervisor as open_supervisor
from ._stats import RuntimeStats as RuntimeStats
from ._stats import SupervisorStatistics as SupervisorStatistics
from ._supervisor import (
    Supervisor as Supervisor,
)
from ._tools import Applied as Applied
from ._tools import NotApplied as NotApplied
from ._tools import (
    Reject as Reject,
)
from ._tools import (
    RetryableToolError as RetryableToolError,
)
from ._tools import (
    RetryPolicy as RetryPolicy,
)
from ._tools import (
    Tool as Tool,
)
from ._tools import (
    ToolContext as ToolContext,
)
from ._tools import ToolError as ToolError
from ._version import __version__ as __version__
from ._view import Frame as Frame
from ._view import RunView as RunView
from ._view import ToolResult as ToolResult
from ._worker import WorkerControl as WorkerControl
from ._worker import WorkerSummary as WorkerSummary
from ._worker import run_worker as run_worker

if _typing.TYPE_CHECKING:
    from ._metrics import RuntimeCollector as RuntimeCollector
    from ._metrics import serve_metrics as serve_metrics

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
        from . import _metrics

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
