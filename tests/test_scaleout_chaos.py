"""Scale-out chaos (#18): worker processes on the real PostgreSQL, killed, stopped, drained
and cut off from the server while they drive runs of tests/scaleout_app.py.

Every scenario ends with the same audit (tests/_scaleout.py): every run terminal and
finished exactly once, its seqs contiguous from 1, no side effect applied twice in the
downstream tables (no key of the non-idempotent ``charge`` or ``notify`` with two rows,
every committed call's key held exactly once), and ``interlock replay --all`` exit 0.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from tests import _scaleout as so

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def dsn() -> str:
    value = os.environ.get("INTERLOCK_PG_DSN")
    if not value:
        pytest.skip(
            "INTERLOCK_PG_DSN is not set; set it to a PostgreSQL DSN (trust auth) to run the "
            "scale-out chaos tests"
        )
    pytest.importorskip("psycopg", reason="the scale-out chaos tests need psycopg")
    return value


@pytest.fixture
def url(dsn: str) -> Iterator[str]:
    """A journal URL in a schema of this test's own (and its downstream beside it)."""
    schema = so.new_schema()
    yield so.journal_url(dsn, schema)
    so.drop_schemas(dsn, schema)


def test_the_audit_finds_each_planted_violation(url: str) -> None:
    so.drive_in_process(url, range(6))
    assert so.audit(url, runs=6) == []
    so.replay_all(url)

    def one(sql: str, *params: object) -> object:
        return so.query(url, sql, params)[0][0]

    charged = one("SELECT key FROM charges WHERE run_id = 'order-000000'")
    so.query(url, "INSERT INTO charges (key, run_id, amount) SELECT key, run_id, amount "
             "FROM charges WHERE key = %s RETURNING id", (charged,))  # fmt: skip
    so.query(url, "INSERT INTO executions (tool, key, run_id, attempt, pid) SELECT tool, key, "
             "run_id, 1, 0 FROM executions WHERE key = %s RETURNING id", (charged,))  # fmt: skip
    so.query(url, "DELETE FROM events WHERE run_id = 'order-000001' AND seq = 3 RETURNING seq")
    last = one("SELECT seq FROM runs WHERE run_id = 'order-000002'")
    so.query(url, "DELETE FROM events WHERE run_id = 'order-000002' AND seq = %s RETURNING seq",
             (last,))  # fmt: skip
    so.query(url, "UPDATE runs SET outcome = 'running', seq = seq - 1 "
             "WHERE run_id = 'order-000002' RETURNING seq")  # fmt: skip
    notified = one("SELECT key FROM notifications WHERE run_id = 'order-000003'")
    so.query(url, "DELETE FROM notifications WHERE key = %s RETURNING id", (notified,))
    so.query(url, "INSERT INTO charges (key, run_id, amount) "
             "VALUES ('order-999999:PAY:5', 'order-999999', 1) RETURNING id")  # fmt: skip
    last = one("SELECT seq FROM runs WHERE run_id = 'order-000004'")
    so.query(url, "INSERT INTO events SELECT run_id, seq + 1, kind, ts, key, body FROM events "
             "WHERE run_id = 'order-000004' AND seq = %s RETURNING seq", (last,))  # fmt: skip
    so.query(url, "UPDATE runs SET seq = seq + 1 WHERE run_id = 'order-000004' RETURNING seq")

    found = so.audit(url, runs=7)
    expected = {
        "runs": "the journal holds 6 runs, expected 7",
        "double charge": f"charges holds 2 rows of key {charged}",
        "double execution": f"charge key {charged} executed 2 times",
        "gap": "run order-000001: seqs not contiguous from 1: missing [3]",
        "not terminal": "run order-000002 is not terminal",
        "never finished": "run order-000002: finished 0 times",
        "lost effect": f"committed call notify key {notified} is held 0 times",
        "orphan effect": "charges holds key order-999999:PAY:5, for which no intent",
        "finished twice": "run order-000004: finished 2 times",
    }
    missed = {name: text for name, text in expected.items() if not any(text in f for f in found)}
    assert not missed, f"the audit missed {missed}; it found:\n" + "\n".join(found)
