"""Every exception interlock raises, one class per decision a caller makes about it.

:class:`InterlockError` is the root of what interlock refuses by design (a bad machine, an
unknown run, a damaged store, ...); :class:`InternalError` is a bug in interlock and stands
outside that tree. The ones an application usually catches are also in :mod:`interlock`.
"""

from .core._exceptions import (
    AppRefError,
    EscalationResolved,
    IllegalResumeTarget,
    IndexDamaged,
    InterlockError,
    InternalError,
    InvalidInputs,
    JournalCorrupt,
    LeaseLost,
    MachineDefinitionError,
    NoProvider,
    NotEscalated,
    PayloadRejected,
    ProviderError,
    ReplayDivergence,
    RequestRefused,
    RunNotFound,
    StoreDamaged,
    StoreError,
    ToolDefinitionError,
    UnknownMachine,
    UnknownState,
)
from .core._messages import ProtocolError

__all__ = [
    "AppRefError",
    "EscalationResolved",
    "IllegalResumeTarget",
    "IndexDamaged",
    "InterlockError",
    "InternalError",
    "InvalidInputs",
    "JournalCorrupt",
    "LeaseLost",
    "MachineDefinitionError",
    "NoProvider",
    "NotEscalated",
    "PayloadRejected",
    "ProtocolError",
    "ProviderError",
    "ReplayDivergence",
    "RequestRefused",
    "RunNotFound",
    "StoreDamaged",
    "StoreError",
    "ToolDefinitionError",
    "UnknownMachine",
    "UnknownState",
]
