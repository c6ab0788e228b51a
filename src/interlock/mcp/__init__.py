"""The MCP proxy: an agent's MCP client talks to interlock, which verifies each tool call
against a state machine, journals it, and forwards it to the upstream MCP server.

A machine for the proxy is written in Python (``--app``) or declared in a TOML file
(``interlock.mcp._config``, described in ``docs/how-to/mcp-machines.md``).
"""
