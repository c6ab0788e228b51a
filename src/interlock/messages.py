"""The messages between a run's actor (or an outside driver) and the supervisor: the
requests (:class:`Start`, :class:`Propose`, :class:`Report`, ...) and the answer,
:class:`Verdict`, with their codec for another process.
"""

from .core._messages import (
    Abort,
    Cancel,
    Escalate,
    Message,
    Propose,
    Reconciliation,
    Recover,
    Report,
    Request,
    Resume,
    Start,
    Sync,
    ToolCall,
    Verdict,
    decode_message,
    encode_message,
)

__all__ = [
    "Abort",
    "Cancel",
    "Escalate",
    "Message",
    "Propose",
    "Reconciliation",
    "Recover",
    "Report",
    "Request",
    "Resume",
    "Start",
    "Sync",
    "ToolCall",
    "Verdict",
    "decode_message",
    "encode_message",
]
