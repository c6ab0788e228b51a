"""SQLite journals as earlier schema versions laid them out, made from current ones."""

from __future__ import annotations

import sqlite3

from interlock.stores import _sqlite


def as_version_4(conn: sqlite3.Connection) -> None:
    """Lay a version 5 journal out as version 4 did: chunks keyed by run and first seq,
    not chained, and no last chunk in the runs index (its version stays for the caller)."""
    conn.execute("DROP INDEX chunks_first")
    conn.execute("ALTER TABLE chunks RENAME TO chunks_v5")
    for statement in _sqlite._JOURNAL_V4:
        conn.execute(statement)
    conn.execute(
        "INSERT INTO chunks (run_id, first_seq, last_seq, body) "
        "SELECT run_id, first_seq, last_seq, body FROM chunks_v5 ORDER BY id"
    )
    conn.execute("DROP TABLE chunks_v5")
    conn.execute("ALTER TABLE runs DROP COLUMN chunk")
    conn.execute("UPDATE meta SET value = '4' WHERE name = 'schema_version'")
