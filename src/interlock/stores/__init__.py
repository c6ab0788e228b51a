"""Journal stores: in-memory, SQLite (the embedded default) and PostgreSQL."""

import typing as _typing

from ..core._exceptions import IndexDamaged as IndexDamaged
from ._base import (
    OUTCOMES as OUTCOMES,
)
from ._base import (
    RunRecord as RunRecord,
)
from ._base import (
    Store as Store,
)
from ._check import CheckProblem as CheckProblem
from ._check import CheckReport as CheckReport
from ._leases import Lease as Lease
from ._leases import LeasingStore as LeasingStore
from ._memory import MemoryStore as MemoryStore
from ._open import open_store as open_store
from ._sqlite import JournalHeld as JournalHeld
from ._sqlite import SQLiteStore as SQLiteStore
from ._sqlite import hold_journal as hold_journal
from ._sqlite import open_sqlite_store as open_sqlite_store

if _typing.TYPE_CHECKING:
    from ._postgres import PostgresStore as PostgresStore
    from ._postgres import open_postgres_store as open_postgres_store

__all__ = [
    "OUTCOMES",
    "CheckProblem",
    "CheckReport",
    "IndexDamaged",
    "JournalHeld",
    "Lease",
    "LeasingStore",
    "MemoryStore",
    "PostgresStore",
    "RunRecord",
    "SQLiteStore",
    "Store",
    "hold_journal",
    "open_postgres_store",
    "open_sqlite_store",
    "open_store",
]


#: Names imported on first use: importing psycopg is slow, and every CLI command and
#: every SQLite-only program would otherwise pay for it (and it is an optional extra).
_LAZY = ("PostgresStore", "open_postgres_store")


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        from . import _postgres

        return getattr(_postgres, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
