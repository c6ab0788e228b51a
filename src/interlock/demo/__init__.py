"""The built-in demo application: the seed workflows (refund, extraction, router) under
the chaos provider, their downstream systems in a SQLite file beside the journal.

``interlock demo`` runs it; a command that needs machines uses it when no application is
named (``--app interlock.demo:app``).
"""

from ..runtime._app import App
from ._run import build_app

#: The demo with its defaults: chaos rate 0.1, seed 0, model latency 5-20 ms.
app: App = build_app()


__all__ = ["app"]
