"""The scale-out chaos tests' application (#18): a machine of your own, run by worker processes.

    interlock worker --app tests/scaleout_app.py:app --db 'postgresql://...?schema=S'

One machine, ``order``, takes an order through four kinds of tool:

    PLAN (model)    lookup  (read-only)  then  reserve (idempotent: dedupes by key itself)
    PAY (step)      charge  (NOT idempotent, no reconcile: a call in doubt escalates)
    NOTIFY (model)  notify  (not idempotent, with reconcile: it asks the downstream)
    -> COMPLETED

The model is simulated (a scripted oracle, 5-30 ms per call, deterministic per (run, seq)).
The downstream systems are PostgreSQL tables in a sibling schema of the journal's,
``<schema>_effects``, opened by the app's lifespan from the journal's own DSN:

    executions     one row per execution of a side-effecting tool, no unique constraint;
                   ``pid`` and ``epoch`` (the run's lease epoch) say which process did it
    charges        one row per charge, no unique constraint (a real payment API that is
                   not idempotent): a key with two rows is a double charge
    reservations   keyed by the idempotency key (the idempotent API dedupes)
    notifications  one row per message sent, no unique constraint; ``notify``'s reconcile
                   reads it

So a duplicated side effect is visible from outside the runtime, as two rows with one key.
"""

from __future__ import annotations

import os
import zlib
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
import trio

from interlock import (
    App,
    Applied,
    Budgets,
    Call,
    Go,
    Machine,
    NotApplied,
    ProviderPolicy,
    Reject,
    RetryableToolError,
    RetryPolicy,
    RunView,
    Step,
    Tool,
    ToolContext,
    Worker,
)
from interlock.providers import ScriptedProvider

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import psycopg

#: Seconds each side effect holds its answer back after it is applied, so that a kill or a
#: stop lands between the effect and its commit often (the call is then in doubt); a test
#: slows a process's runs down with ``SCALEOUT_EFFECT_DELAY=LOW,HIGH``.
EFFECT_DELAY = tuple(
    float(s) for s in os.environ.get("SCALEOUT_EFFECT_DELAY", "0.005,0.025").split(",")
)
#: Seconds each side effect takes before it reaches the downstream (its request in flight):
#: none by default; a test sets ``SCALEOUT_EFFECT_LEAD=LOW,HIGH`` to pause a process there.
EFFECT_LEAD = tuple(float(s) for s in os.environ.get("SCALEOUT_EFFECT_LEAD", "0,0").split(","))
#: Connections to the downstream per process.
POOL = 4

DOWNSTREAM = """
CREATE TABLE IF NOT EXISTS executions (
    id bigserial PRIMARY KEY, tool text NOT NULL, key text NOT NULL, run_id text NOT NULL,
    attempt int NOT NULL, pid int NOT NULL, epoch bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS charges (
    id bigserial PRIMARY KEY, key text NOT NULL, run_id text NOT NULL, amount numeric NOT NULL
);
CREATE TABLE IF NOT EXISTS reservations (
    key text PRIMARY KEY, run_id text NOT NULL, item text NOT NULL, qty int NOT NULL
);
CREATE TABLE IF NOT EXISTS notifications (
    id bigserial PRIMARY KEY, key text NOT NULL, run_id text NOT NULL, recipient text NOT NULL
);
CREATE TABLE IF NOT EXISTS notify_fence (key text PRIMARY KEY, epoch bigint NOT NULL);
"""


# -- the downstream systems -----------------------------------------------------------


def split_url(url: str) -> tuple[str, str]:
    """``(dsn, schema)`` of a journal URL ``postgresql://...?schema=S`` (default ``interlock``)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((value for key, value in query if key == "schema"), "interlock")
    kept = urlencode([(key, value) for key, value in query if key != "schema"])
    return urlunsplit(parts._replace(query=kept)), schema


def effects_schema(schema: str) -> str:
    """The schema of the downstream tables beside the journal's ``schema``."""
    return f"{schema}_effects"


class Downstream:
    """The downstream systems: a few psycopg connections, used from worker threads.

    A connection that cannot be opened means the call certainly was not applied (so even
    ``charge`` may retry); one that breaks mid-call leaves the call's effect unknown.
    """

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self._idle: list[psycopg.Connection[Any]] = []
        self._limit = trio.CapacityLimiter(POOL)

    def _connect(self) -> psycopg.Connection[Any]:
        import psycopg
        from psycopg import sql

        try:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3)
        except psycopg.OperationalError as exc:
            raise RetryableToolError(f"downstream unreachable: {exc}", applied=False) from exc
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        # A process frozen inside a downstream transaction (SIGSTOP between its INSERT and
        # its COMMIT) must not commit it seconds later, after another worker took the run
        # over and found the call not applied: the server ends a transaction left idle, as
        # a real downstream ends a frozen client's. Well inside the leases' ttl (2 s), so
        # the effect is gone before anyone can reconcile it.
        conn.execute("SET idle_in_transaction_session_timeout = '1s'")
        return conn

    def create(self) -> None:
        """Create the schema and tables (once, whichever process gets there first)."""
        from psycopg import sql

        conn = self._connect()
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self.schema,))
                conn.execute(
                    sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))
                )
                for statement in filter(str.strip, DOWNSTREAM.split(";")):
                    conn.execute(statement)
        finally:
            conn.close()

    async def run(self, statements: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run ``statements`` in one transaction; return each one's first row (or None)."""
        import psycopg

        def work() -> list[Any]:
            conn = self._idle.pop() if self._idle else self._connect()
            try:
                rows = []
                with conn.transaction():
                    for query, params in statements:
                        cursor = conn.execute(query, params)
                        rows.append(cursor.fetchone() if cursor.description else None)
            except psycopg.OperationalError as exc:
                conn.close()
                raise RetryableToolError(f"downstream connection lost: {exc}") from exc
            self._idle.append(conn)
            return rows

        async with self._limit:
            return await trio.to_thread.run_sync(work)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


class _Current:
    """The downstream the lifespan opened, as the tools see it."""

    downstream: Downstream | None = None

    def get(self) -> Downstream:
        if self.downstream is None:
            raise RuntimeError("the downstream is not open; enter the app's lifespan first")
        return self.downstream


current = _Current()


async def _effect_delay(key: str, delay: tuple[float, ...] = EFFECT_DELAY) -> None:
    low, high = delay
    if high > 0:
        await trio.sleep(low + (zlib.crc32(key.encode()) % 1000) / 1000 * (high - low))


def _execution(tool: str, ctx: ToolContext) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT INTO executions (tool, key, run_id, attempt, pid, epoch) "
        "VALUES (%s, %s, %s, %s, %s, %s)",
        (tool, ctx.key, ctx.run_id, ctx.attempt, os.getpid(), ctx.epoch),
    )


# -- the machine ----------------------------------------------------------------------


class OrderInputs(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    customer: str
    qty: Annotated[int, msgspec.Meta(ge=1, le=5)]


class Lookup(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str


class Reserve(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    qty: Annotated[int, msgspec.Meta(ge=1, le=5)]


class Charge(msgspec.Struct, forbid_unknown_fields=True):
    order_id: str
    amount: Annotated[float, msgspec.Meta(gt=0)]


class Notify(msgspec.Struct, forbid_unknown_fields=True):
    to: str
    text: str


def price(order_id: str) -> float:
    """The unit price of an order's item: a deterministic function of its id."""
    return float(10 + zlib.crc32(order_id.encode()) % 90)


async def lookup(args: Lookup, ctx: ToolContext) -> dict[str, Any]:
    await trio.lowlevel.checkpoint()
    return {
        "order_id": args.order_id,
        "item": f"sku-{args.order_id[-3:]}",
        "price": price(args.order_id),
    }


async def reserve(args: Reserve, ctx: ToolContext) -> dict[str, Any]:
    # Idempotent as the downstream is: the key is the reservation's primary key.
    await _effect_delay(ctx.key, EFFECT_LEAD)
    _, row = await current.get().run(
        [
            _execution("reserve", ctx),
            (
                "INSERT INTO reservations (key, run_id, item, qty) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (key) DO NOTHING RETURNING key",
                (ctx.key, ctx.run_id, f"sku-{args.order_id[-3:]}", args.qty),
            ),
        ]
    )
    await _effect_delay(ctx.key)
    return {"reservation": f"rs-{zlib.crc32(ctx.key.encode()):08x}", "new": row is not None}


async def charge(args: Charge, ctx: ToolContext) -> dict[str, Any]:
    # Not idempotent: every execution charges again.
    await _effect_delay(ctx.key, EFFECT_LEAD)
    _, row = await current.get().run(
        [
            _execution("charge", ctx),
            (
                "INSERT INTO charges (key, run_id, amount) VALUES (%s, %s, %s) RETURNING id",
                (ctx.key, ctx.run_id, args.amount),
            ),
        ]
    )
    await _effect_delay(ctx.key)
    return {"charge": int(row[0]), "amount": args.amount}


#: The fence of a notify key, as the leases page says a downstream keeps one: the highest
#: lease epoch that wrote or reconciled the key; a request of a lower epoch is refused.
#: Taken under the key's lock by the send and by the reconcile alike, so a request that
#: was already on its way when its process froze (its thread past the lease's deadline)
#: either lands before the reconcile looks, and is seen, or after, and is refused.
_FENCE = [
    ("SELECT pg_advisory_xact_lock(hashtext(%s))", ("notify",)),
    (
        "INSERT INTO notify_fence (key, epoch) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE "
        "SET epoch = EXCLUDED.epoch WHERE notify_fence.epoch <= EXCLUDED.epoch",
        (),
    ),
]


def _fenced(key: str, epoch: int) -> list[tuple[str, tuple[Any, ...]]]:
    lock, upsert = _FENCE
    return [(lock[0], (key,)), (upsert[0], (key, epoch))]


class Fenced(Exception):
    """The downstream refused a notify of a lease epoch older than the key's fence."""


async def notify(args: Notify, ctx: ToolContext) -> dict[str, Any]:
    # Not idempotent either, but the downstream can say whether a key went out (reconcile),
    # and it fences each key by the lease epoch (see _FENCE).
    await _effect_delay(ctx.key, EFFECT_LEAD)
    ours = "(SELECT epoch FROM notify_fence WHERE key = %s) = %s"
    *_, _execution_row, row = await current.get().run(
        [
            *_fenced(ctx.key, ctx.epoch),
            (
                "INSERT INTO executions (tool, key, run_id, attempt, pid, epoch) "
                f"SELECT 'notify', %s, %s, %s, %s, %s WHERE {ours} RETURNING id",
                (ctx.key, ctx.run_id, ctx.attempt, os.getpid(), ctx.epoch, ctx.key, ctx.epoch),
            ),
            (
                "INSERT INTO notifications (key, run_id, recipient) "
                f"SELECT %s, %s, %s WHERE {ours} RETURNING id",
                (ctx.key, ctx.run_id, args.to, ctx.key, ctx.epoch),
            ),
        ]
    )
    if row is None:
        raise Fenced(f"notify {ctx.key} at epoch {ctx.epoch}: a newer lease holds the key")
    await _effect_delay(ctx.key)
    return {"message": int(row[0])}


async def notified(key: str, args: Notify, ctx: ToolContext) -> Applied | NotApplied:
    *_, row = await current.get().run(
        [
            *_fenced(key, ctx.epoch),  # from here, an older epoch's send is refused
            ("SELECT id FROM notifications WHERE key = %s ORDER BY id LIMIT 1", (key,)),
        ]
    )
    return NotApplied() if row is None else Applied({"message": int(row[0])})


def charge_within_total(args: Charge, view: RunView) -> Reject | None:
    """A charge may not exceed the looked-up price times the quantity."""
    item = view.last_result("lookup")
    if item is None:
        return Reject("args: the order has not been looked up", "call lookup first")
    total = item["price"] * view.inputs["qty"]
    if args.amount > total:
        return Reject(
            f"args.amount: {args.amount} exceeds the order total {total}",
            f"propose amount <= {total}",
            "args.amount",
        )
    return None


def pay(view: RunView) -> Call | Go:
    """PAY, a deterministic step: charge the total once, then go on."""
    charged = view.last_result("charge")
    if charged is None:
        item = view.last_result("lookup")
        amount = item["price"] * view.inputs["qty"]
        return Call("charge", {"order_id": view.inputs["order_id"], "amount": amount})
    return Go("NOTIFY", {"charge": charged["charge"]})


def oracle(view: RunView) -> str:
    """The simulated model: what a good model proposes in PLAN and NOTIFY."""
    inputs = view.inputs

    def call(tool: str, args: dict[str, Any]) -> str:
        return msgspec.json.encode({"tool": tool, "args": args}).decode()

    if view.state == "PLAN":
        if view.last_result("lookup") is None:
            return call("lookup", {"order_id": inputs["order_id"]})
        if view.last_result("reserve") is None:
            return call("reserve", {"order_id": inputs["order_id"], "qty": inputs["qty"]})
        return '{"next": "PAY"}'
    if view.last_result("notify") is None:
        return call("notify", {"to": inputs["customer"], "text": f"order {inputs['order_id']}"})
    return msgspec.json.encode(
        {"next": "COMPLETED", "data": {"receipt": f"{inputs['order_id']} paid"}}
    ).decode()


def latency(view: RunView) -> float:
    """5 to 30 ms per model call, a function of (run, seq) only."""
    return 0.005 + (zlib.crc32(f"{view.run_id}:{view.seq}".encode()) % 26) / 1000


#: A downstream call that cannot connect is retried for about 6 s (a server restart).
DOWNSTREAM_RETRY = RetryPolicy(attempts=10, base=0.1, cap=1.0)

order = Machine(
    "order",
    initial="PLAN",
    states={
        "PLAN": Worker(
            next=["PAY"],
            tools=["lookup", "reserve"],
            instructions="Look the order up, reserve its quantity, then move to PAY.",
        ),
        "PAY": Step(pay, next=["NOTIFY"], tools=["charge"]),
        "NOTIFY": Worker(
            next=["COMPLETED"],
            tools=["notify"],
            instructions="Tell the customer the order is paid, then complete.",
        ),
    },
    tools=[
        Tool("lookup", lookup, Lookup, "The order's item and unit price.", read_only=True),
        Tool(
            "reserve",
            reserve,
            Reserve,
            "Reserve stock. Idempotent on the call's key.",
            idempotent=True,
            retry=DOWNSTREAM_RETRY,
            timeout=10.0,
        ),
        Tool(
            "charge",
            charge,
            Charge,
            "Charge the customer. Charges every time it runs.",
            guards=[charge_within_total],
            retry=DOWNSTREAM_RETRY,
            timeout=10.0,
        ),
        Tool(
            "notify",
            notify,
            Notify,
            "Message the customer. Sends every time it runs.",
            reconcile=notified,
            retry=DOWNSTREAM_RETRY,
            timeout=10.0,
        ),
    ],
    inputs=OrderInputs,
    budgets=Budgets(steps=40, deadline=600.0),
    provider_policy=ProviderPolicy(timeout=5.0, attempts=5, base=0.05, cap=0.5),
)


def make_inputs(index: int) -> dict[str, Any]:
    """The inputs of run ``index`` (the tests enqueue these)."""
    return {
        "order_id": f"ord-{index:06d}",
        "customer": f"c{index}@example.com",
        "qty": 1 + index % 3,
    }


@asynccontextmanager
async def lifespan(db: str) -> AsyncIterator[Downstream]:
    """Open the downstream systems beside the journal ``db`` (a PostgreSQL URL)."""
    if not db.startswith(("postgresql://", "postgres://")):
        raise RuntimeError(f"the scale-out app's downstream lives in PostgreSQL; got --db {db!r}")
    dsn, schema = split_url(db)
    downstream = Downstream(dsn, effects_schema(schema))
    await trio.to_thread.run_sync(downstream.create)
    current.downstream = downstream
    try:
        yield downstream
    finally:
        current.downstream = None
        downstream.close()


app = App(
    [order],
    provider=ScriptedProvider(oracle, model="sim-scaleout", latency=latency),
    lifespan=lifespan,
)
