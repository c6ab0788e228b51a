"""Journal stores: in-memory, SQLite (the embedded default) and PostgreSQL."""

from ._base import (
    COMPLETED as COMPLETED,
)
from ._base import (
    ESCALATED as ESCALATED,
)
from ._base import (
    FAILED as FAILED,
)
from ._base import (
    OUTCOMES as OUTCOMES,
)
from ._base import (
    RUNNING as RUNNING,
)
from ._base import (
    RunRecord as RunRecord,
)
from ._base import (
    Store as Store,
)
from ._memory import MemoryStore as MemoryStore
from ._open import open_store as open_store
from ._postgres import PostgresStore as PostgresStore
from ._postgres import open_postgres_store as open_postgres_store
from ._sqlite import SQLiteStore as SQLiteStore
from ._sqlite import open_sqlite_store as open_sqlite_store

__all__ = [
    "COMPLETED",
    "ESCALATED",
    "FAILED",
    "OUTCOMES",
    "RUNNING",
    "MemoryStore",
    "PostgresStore",
    "RunRecord",
    "SQLiteStore",
    "Store",
    "open_postgres_store",
    "open_sqlite_store",
    "open_store",
]
