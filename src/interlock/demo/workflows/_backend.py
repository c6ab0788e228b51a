"""The demo workflows' downstream systems: payments, email, an entity table, a ticket DB.

All live in one SQLite file (or ``:memory:``) so tests and the crash test can count
every side effect from outside the runtime: each execution of a side-effecting tool
adds one row to ``executions``, whatever the tool then decides to do.
"""

from __future__ import annotations

import sqlite3
import zlib
from typing import Any

import trio

_SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    tool TEXT NOT NULL, key TEXT NOT NULL, run_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS payments (
    key TEXT PRIMARY KEY, run_id TEXT NOT NULL, order_id TEXT NOT NULL, amount REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS emails (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL, run_id TEXT NOT NULL, recipient TEXT NOT NULL, subject TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS entities (
    key TEXT NOT NULL, idx INTEGER NOT NULL, run_id TEXT NOT NULL,
    entity_id TEXT NOT NULL, category TEXT NOT NULL, confidence REAL NOT NULL,
    PRIMARY KEY (key, idx)
);
CREATE TABLE IF NOT EXISTS tickets (
    db_key TEXT PRIMARY KEY, run_id TEXT NOT NULL, category TEXT NOT NULL, summary TEXT NOT NULL
);
"""


#: Per tool: the effects applied, and how many distinct ones per run (a run's effect and
#: its twin under another key count once), for the runs whose id is LIKE the parameter.
_APPLIED = {
    "refund": (
        "SELECT COUNT(*), COUNT(DISTINCT run_id || char(0) || order_id || char(0) || amount) "
        "FROM payments WHERE run_id LIKE ?"
    ),
    "send_email": (
        "SELECT COUNT(*), COUNT(DISTINCT run_id || char(0) || recipient || char(0) || subject) "
        "FROM emails WHERE run_id LIKE ?"
    ),
    "write_entities": (
        "SELECT COUNT(*), COUNT(DISTINCT run_id || char(0) || batch) FROM ("
        " SELECT run_id, group_concat(entity_id || char(1) || category || char(1) || confidence,"
        " char(2)) AS batch"
        " FROM (SELECT * FROM entities WHERE run_id LIKE ? ORDER BY key, idx)"
        " GROUP BY key)"
    ),
    "record_ticket": (
        "SELECT COUNT(*), COUNT(DISTINCT run_id || char(0) || category || char(0) || summary) "
        "FROM tickets WHERE run_id LIKE ?"
    ),
}


def order_total(order_id: str) -> float:
    """The total of a demo order: a deterministic function of its id (20.00 to 219.00)."""
    return float(20 + zlib.crc32(order_id.encode()) % 200)


class Backend:
    """The demo's downstream systems in one SQLite database.

    Args:
      path: a file path, or ``":memory:"`` for tests.
    """

    def __init__(self, path: str = ":memory:") -> None:
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(_SCHEMA)
        self._lock = trio.Lock()

    def close(self) -> None:
        self._db.close()

    async def _write(self, statements: list[tuple[str, tuple[Any, ...]]]) -> list[int]:
        def work() -> list[int]:
            counts = []
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    counts.append(self._db.execute(sql, params).rowcount)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return counts

        async with self._lock:
            return await trio.to_thread.run_sync(work)

    def _execution(self, tool: str, key: str, run_id: str) -> tuple[str, tuple[Any, ...]]:
        return ("INSERT INTO executions (tool, key, run_id) VALUES (?, ?, ?)", (tool, key, run_id))

    async def get_order(self, order_id: str) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        return {"order_id": order_id, "total": order_total(order_id), "currency": "USD"}

    async def refund(self, key: str, run_id: str, order_id: str, amount: float) -> dict[str, Any]:
        """Idempotent: a second call with the same key changes nothing."""
        _, inserted = await self._write(
            [
                self._execution("refund", key, run_id),
                (
                    "INSERT OR IGNORE INTO payments (key, run_id, order_id, amount) VALUES (?, ?, ?, ?)",
                    (key, run_id, order_id, amount),
                ),
            ]
        )
        return {
            "refund_id": f"rf-{zlib.crc32(key.encode()):08x}",
            "amount": amount,
            "new": inserted == 1,
        }

    async def send_email(
        self, key: str, run_id: str, recipient: str, subject: str
    ) -> dict[str, Any]:
        """Not idempotent: every call sends another email."""
        await self._write(
            [
                self._execution("send_email", key, run_id),
                (
                    "INSERT INTO emails (key, run_id, recipient, subject) VALUES (?, ?, ?, ?)",
                    (key, run_id, recipient, subject),
                ),
            ]
        )
        return {"sent": True, "to": recipient}

    async def write_entities(
        self, key: str, run_id: str, entities: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Idempotent: the idempotency key is part of the table's unique key."""
        statements = [self._execution("write_entities", key, run_id)]
        for idx, entity in enumerate(entities):
            statements.append(
                (
                    "INSERT OR IGNORE INTO entities (key, idx, run_id, entity_id, category, confidence) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (key, idx, run_id, entity["id"], entity["category"], entity["confidence"]),
                )
            )
        counts = await self._write(statements)
        return {"written": sum(counts[1:]), "entities": len(entities)}

    async def record_ticket(
        self, db_key: str, key: str, run_id: str, category: str, summary: str
    ) -> dict[str, Any]:
        """Idempotent on ``db_key`` (``run_id:state``): a retried commit does not write twice."""
        _, inserted = await self._write(
            [
                self._execution("record_ticket", key, run_id),
                (
                    "INSERT OR IGNORE INTO tickets (db_key, run_id, category, summary) VALUES (?, ?, ?, ?)",
                    (db_key, run_id, category, summary),
                ),
            ]
        )
        return {"ticket": f"t-{zlib.crc32(db_key.encode()):08x}", "new": inserted == 1}

    async def applied(self, tool: str, key: str) -> dict[str, Any] | None:
        """What the downstream recorded for the call of ``tool`` with idempotency ``key``:
        the result that call returned, or None if it was never applied.

        Every table is keyed by the idempotency key (the ticket table by ``run_id:state``,
        the key's first two parts), so a call in doubt can be reconciled.
        """

        def read() -> dict[str, Any] | None:
            db = self._db
            if tool == "refund":
                row = db.execute("SELECT amount FROM payments WHERE key = ?", (key,)).fetchone()
                if row is None:
                    return None
                refund_id = f"rf-{zlib.crc32(key.encode()):08x}"
                return {"refund_id": refund_id, "amount": row[0], "new": True}
            if tool == "send_email":
                row = db.execute(
                    "SELECT recipient FROM emails WHERE key = ? ORDER BY id LIMIT 1", (key,)
                ).fetchone()
                return None if row is None else {"sent": True, "to": row[0]}
            if tool == "write_entities":
                (written,) = db.execute(
                    "SELECT COUNT(*) FROM entities WHERE key = ?", (key,)
                ).fetchone()
                return None if not written else {"written": written, "entities": written}
            if tool == "record_ticket":
                db_key = key.rsplit(":", 1)[0]
                row = db.execute("SELECT 1 FROM tickets WHERE db_key = ?", (db_key,)).fetchone()
                if row is None:
                    return None
                return {"ticket": f"t-{zlib.crc32(db_key.encode()):08x}", "new": True}
            raise ValueError(
                f"tool {tool!r} has no table here; known: refund, send_email, "
                "write_entities, record_ticket"
            )

        async with self._lock:
            return await trio.to_thread.run_sync(read)

    def counts(self, batch: str | None = None) -> dict[str, dict[str, int]]:
        """Side effects as the downstream systems saw them, per tool.

        ``executions``: times the tool ran; ``keys``: distinct idempotency keys;
        ``applied``: rows the effect left (payments, emails, entity batches, tickets);
        ``duplicates``: effects applied more than once in one run, the same one again
        (the same order and amount refunded, the same email to the same customer, the
        same entities, the same ticket), under one key or several: each run's effects
        beyond one of each. Must be 0.
        ``batch`` limits the counts to runs whose id contains ``-batch-``.
        """
        db = self._db
        like = f"%-{batch}-%" if batch else "%"
        result: dict[str, dict[str, int]] = {}
        for tool in _APPLIED:
            executions, keys = db.execute(
                "SELECT COUNT(*), COUNT(DISTINCT key) FROM executions WHERE tool = ? AND run_id LIKE ?",
                (tool, like),
            ).fetchone()
            applied, distinct = db.execute(_APPLIED[tool], (like,)).fetchone()
            result[tool] = {
                "executions": executions,
                "keys": keys,
                "applied": applied,
                "duplicates": applied - distinct,
            }
        return result
