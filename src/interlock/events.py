"""The journal's events: what a run's journal holds, one Struct per kind, and their codec.

Every run is the fold of its events (``run_started`` first); ``interlock show`` and
``interlock replay`` read them, and so can you::

    from interlock.events import ToolCommitted, decode_event

The wire format of each is fixed: a journal written by any earlier version decodes.
"""

from .core._breakers import BREAKERS
from .core._events import (
    BreakerTripped,
    Completed,
    Escalated,
    Event,
    Failed,
    IntentRecorded,
    JournalEvent,
    ModelCalled,
    Oversized,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    TokenUsage,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
    Violation,
    decode_event,
    encode_event,
    expand_prompt,
    hash_prompt,
    whole_prompts,
)

__all__ = [
    "BREAKERS",
    "BreakerTripped",
    "Completed",
    "Escalated",
    "Event",
    "Failed",
    "IntentRecorded",
    "JournalEvent",
    "ModelCalled",
    "Oversized",
    "ProposalRejected",
    "ProviderFailed",
    "Reconciled",
    "Resumed",
    "RunStarted",
    "StepProposed",
    "TokenUsage",
    "ToolCommitted",
    "ToolFailed",
    "ToolInDoubt",
    "Transitioned",
    "Violation",
    "decode_event",
    "encode_event",
    "expand_prompt",
    "hash_prompt",
    "whole_prompts",
]
