"""Prometheus metrics: the runtime's counters (:class:`RuntimeStats`), a snapshot of them
(:class:`SupervisorStatistics`), the collector that exports them and a server for it.

Importing this module imports prometheus_client.
"""

from .core._stats import RuntimeStats, SupervisorStatistics
from .runtime._metrics import RuntimeCollector, serve_metrics

__all__ = [
    "RuntimeCollector",
    "RuntimeStats",
    "SupervisorStatistics",
    "serve_metrics",
]
