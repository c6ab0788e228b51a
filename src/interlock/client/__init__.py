"""Clients of the interlock gateway: async (trio) and sync, over HTTP; install ``interlock[client]``.

The answers are the Structs of :mod:`interlock.protocol`, decoded straight from JSON or
msgpack. A problem answer raises :class:`GatewayProblem`; no answer at all,
after the retries, :class:`GatewayUnavailable`. The streaming channel's client
(``open_channel``, ``ChannelClient``, ``ChannelProblem``) pipelines many calls on one
connection, for throughput.
"""

import typing as _typing

try:
    import httpx as _httpx  # noqa: F401 - the clients are built on it
except ImportError as _missing:
    raise ImportError(
        "interlock.client needs httpx, which is not installed; install the client extra: "
        "pip install 'interlock[client]'"
    ) from _missing

from ._async import AsyncClient as AsyncClient
from ._async import AsyncExternalRun as AsyncExternalRun
from ._common import ClientRetryPolicy as ClientRetryPolicy
from ._common import GatewayProblem as GatewayProblem
from ._common import GatewayUnavailable as GatewayUnavailable
from ._sync import Client as Client
from ._sync import ExternalRun as ExternalRun

if _typing.TYPE_CHECKING:
    from ._channel import ChannelClient as ChannelClient
    from ._channel import ChannelProblem as ChannelProblem
    from ._channel import open_channel as open_channel

#: Resolved on first use: the streaming channel's client imports trio.
_LAZY = ("ChannelClient", "ChannelProblem", "open_channel")


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        from . import _channel as _channel_client

        return getattr(_channel_client, name)
    raise AttributeError(f"module 'interlock.client' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "AsyncExternalRun",
    "ChannelClient",
    "ChannelProblem",
    "Client",
    "ClientRetryPolicy",
    "ExternalRun",
    "GatewayProblem",
    "GatewayUnavailable",
    "open_channel",
]
