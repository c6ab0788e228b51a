"""The three seed workflows: the refund agent, the extraction pipeline, the support router.

Each module has ``build(backend) -> Machine``, ``make_inputs(index, rng)`` for demo
runs and ``oracle(view) -> raw``, a simulated well-behaved model that the demo
wraps in a :class:`~interlock.providers.ChaosProvider`.
"""

from types import ModuleType

from . import extraction as extraction
from . import refund as refund
from . import router as router
from ._backend import Backend as Backend
from ._backend import order_total as order_total

WORKFLOWS: dict[str, ModuleType] = {"refund": refund, "extraction": extraction, "router": router}

__all__ = ["WORKFLOWS", "Backend", "extraction", "order_total", "refund", "router"]
