"""The pure core: machines, tools, schemas, the gate, the decider, the run state and its
view, events and messages, breakers, and the compiled hot path.

Nothing here imports trio, reads a clock or does I/O: the runtime above passes in the time,
the circuits and the requests, and writes the events the decider makes. An import contract
(``.importlinter``) holds it so. Users import these names from :mod:`interlock` and
:mod:`interlock.events`; the modules here are private.
"""
