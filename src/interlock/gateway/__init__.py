"""The verification gateway: agents in any language verify and commit through HTTP.

``interlock serve --app REF`` serves it; :func:`create_app` gives the ASGI app for
embedding and :func:`serve_gateway` serves it with hypercorn on trio (and, asked, the
streaming channel, :func:`serve_channel`). :class:`KeyRing` and :class:`Limits` configure
its keys and limits. The request and
response bodies are the Structs of :mod:`interlock.protocol`.
"""

from ._app import GatewayApp
from ._channel import serve_channel
from ._guard import Limits
from ._keys import KeyRing, Principal
from ._routes import openapi_document
from ._serve import GatewayServer, create_app, serve_gateway
from ._service import GatewayError, GatewayService, PrincipalLike

__all__ = [
    "GatewayApp",
    "GatewayError",
    "GatewayServer",
    "GatewayService",
    "KeyRing",
    "Limits",
    "Principal",
    "PrincipalLike",
    "create_app",
    "openapi_document",
    "serve_channel",
    "serve_gateway",
]
