"""The MCP proxy: an MCP server's tools, each ``tools/call`` verified against a run's
machine, keyed and journaled before it reaches the server (``interlock mcp``).

Needs the ``[mcp]`` extra (the official ``mcp`` SDK, which runs on trio).
"""

from ._config import MachineSpec, ReconcileSpec, build_machine, load_machine_file
from ._http import RUN_HEADER, McpHttpServer, serve_http
from ._proxy import KEY_META, RUN_META, McpRun, canonical_args
from ._serve import Upstream, connect_upstream, list_all_tools, proxy_server, serve_stdio

__all__ = [
    "KEY_META",
    "RUN_HEADER",
    "RUN_META",
    "MachineSpec",
    "McpHttpServer",
    "McpRun",
    "ReconcileSpec",
    "Upstream",
    "build_machine",
    "canonical_args",
    "connect_upstream",
    "list_all_tools",
    "load_machine_file",
    "proxy_server",
    "serve_http",
    "serve_stdio",
]
