"""Clients of the interlock gateway: async (trio) and sync, over HTTP; install ``interlock[client]``.

The answers are the gateway's own Structs (re-exported here), decoded straight from
JSON or msgpack. A problem answer raises :class:`GatewayProblem`; no answer at all,
after the retries, :class:`GatewayUnavailable`. The streaming channel's client
(``open_channel``, ``ChannelClient``, ``ChannelProblem``) is re-exported from
``interlock.gateway`` for throughput: many calls pipelined on one connection.
"""

import typing as _typing

try:
    import httpx as _httpx  # noqa: F401 - the clients are built on it
except ImportError as _missing:
    raise ImportError(
        "interlock.client needs httpx, which is not installed; install the client extra: "
        "pip install 'interlock[client]'"
    ) from _missing

from ..protocol import CallOut as CallOut
from ..protocol import EscalationOut as EscalationOut
from ..protocol import EventOut as EventOut
from ..protocol import ReadyOut as ReadyOut
from ..protocol import RunOut as RunOut
from ..protocol import RunSummary as RunSummary
from ..protocol import ToolSpec as ToolSpec
from ..protocol import Usage as Usage
from ..protocol import VerdictOut as VerdictOut
from ..protocol import VerifyItem as VerifyItem
from ..protocol import ViolationOut as ViolationOut
from ._async import AsyncClient as AsyncClient
from ._async import AsyncExternalRun as AsyncExternalRun
from ._common import GatewayProblem as GatewayProblem
from ._common import GatewayUnavailable as GatewayUnavailable
from ._common import RetryPolicy as RetryPolicy
from ._sync import Client as Client
from ._sync import ExternalRun as ExternalRun

#: Resolved on first use: the streaming channel's client lives with the channel.
_LAZY = ("ChannelClient", "ChannelProblem", "open_channel")


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        from . import _channel as _channel_client

        return getattr(_channel_client, name)
    raise AttributeError(f"module 'interlock.client' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "AsyncExternalRun",
    "CallOut",
    "ChannelClient",
    "ChannelProblem",
    "Client",
    "EscalationOut",
    "EventOut",
    "ExternalRun",
    "GatewayProblem",
    "GatewayUnavailable",
    "ReadyOut",
    "RetryPolicy",
    "RunOut",
    "RunSummary",
    "ToolSpec",
    "Usage",
    "VerdictOut",
    "VerifyItem",
    "ViolationOut",
    "open_channel",
]
