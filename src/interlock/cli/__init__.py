"""The ``interlock`` command line: one module per command or group of commands.

``_parser`` builds the argument parser, ``_entry`` runs a command (exit codes, Ctrl-C),
``_common`` holds what the commands share; ``_demo``, ``_run`` (run, enqueue, resume),
``_show`` (runs, show), ``_escalations``, ``_replay``, ``_check``, ``_serve`` and
``_worker`` are the commands.
"""

from ._entry import main as main

__all__ = ["main"]
