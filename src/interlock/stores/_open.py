"""Open a store from one URL-ish string, as the CLI and configuration give it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._memory import MemoryStore
from ._sqlite import open_sqlite_store

if TYPE_CHECKING:
    from ._base import Store

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_SQLITE_PREFIX = "sqlite:///"


async def open_store(url: str | None, *, readonly: bool = False) -> Store:
    """Open the store that ``url`` names.

    Args:
      url: ``None`` or ``":memory:"`` for a :class:`MemoryStore`;
        ``postgresql://...`` or ``postgres://...`` for a :class:`PostgresStore`
        (in the schema named by a ``schema=NAME`` query parameter, default
        ``interlock``; the parameter is not passed on to libpq); anything else is the path of a
        SQLite file, optionally written ``sqlite:///path`` (``sqlite:////abs/path``
        for an absolute one).
      readonly: open an existing SQLite file or PostgreSQL schema for reading
        only, creating nothing (what ``interlock runs --db`` uses, so a typo
        cannot create a database). A memory store ignores it.

    Raises:
      StoreError: the store cannot be opened; the message says why and how to fix it.
    """
    if url is None or url == ":memory:":
        return MemoryStore()
    if url.startswith(_POSTGRES_SCHEMES):
        from ._postgres import open_postgres_store  # psycopg is slow to import, and optional

        dsn, schema = split_schema(url)
        return await open_postgres_store(dsn, schema=schema, readonly=readonly)
    return await open_sqlite_store(url.removeprefix(_SQLITE_PREFIX), readonly=readonly)


def sqlite_path(url: str | None) -> str | None:
    """The SQLite file ``url`` names for :func:`open_store`, or None (memory, PostgreSQL)."""
    if url is None or url == ":memory:" or url.startswith(_POSTGRES_SCHEMES):
        return None
    return url.removeprefix(_SQLITE_PREFIX)


def split_schema(url: str) -> tuple[str, str]:
    """Take a ``schema=NAME`` query parameter out of a PostgreSQL URL."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = "interlock"
    kept = []
    for key, value in query:
        if key == "schema":
            schema = value
        else:
            kept.append((key, value))
    return urlunsplit(parts._replace(query=urlencode(kept))), schema
