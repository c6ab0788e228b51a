"""The runtime: the supervisor and its run table, the journal writer, the actor, the
watchdog, leases, replay, workers and applications.

It drives the pure core (:mod:`interlock.core`) under trio and writes what the core decides
to a store (:mod:`interlock.stores`). Users import these names from :mod:`interlock`.
"""
