"""Transactions of the store: one writer at a time on SQLite, retries and advisory locks on PostgreSQL.

On SQLite every transaction starts with `BEGIN IMMEDIATE` (see `engine.make_engine`) and is
also serialised in-process. On PostgreSQL transactions run concurrently (several collector
replicas on one database); a transaction that PostgreSQL aborts as a deadlock victim or a
serialization failure is retried, and `lock` takes transaction-scoped advisory locks so that
two replicas never assemble the same trajectory or open the same group at once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from contextvars import ContextVar
from typing import TypeVar

from sqlalchemy import Connection, Engine, Integer, cast, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import StaticPool

from collector.engine import READ_ONLY

__all__ = [
    "GROUP_LOCKS", "IDEMPOTENCY_LOCKS", "LANGFUSE_SYNC_LOCK", "TRAJECTORY_LOCKS", "RetryTransaction", "Transactions",
    "last_try",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

IDEMPOTENCY_LOCKS = 0
"""Advisory-lock namespace of lease requests' idempotency keys: a retry sent while its first try still runs waits
for it and finds its batch (`leases.take`)."""
TRAJECTORY_LOCKS = 1
"""Advisory-lock namespace of trajectory ids. Namespaces are taken in ascending order."""
GROUP_LOCKS = 2
"""Advisory-lock namespace of group keys."""
LANGFUSE_SYNC_LOCK = 3
"""Advisory-lock namespace of the Langfuse sync's session-level lock (`LangfuseSync.sync`: one replica syncs at a
time), apart from the transaction-level ones above, which share PostgreSQL's advisory keys with it. It is only ever
tried (`pg_try_advisory_lock`), never waited for, so it takes no part in the ascending order."""

_RETRIED = {"40001": "serialization failure", "40P01": "deadlock"}
_ATTEMPTS = 8


class RetryTransaction(Exception):
    """Raised by a transaction's work that found its view of the rows outdated in a way a new try resolves (as
    PostgreSQL's serialization failures are): `Transactions.run` rolls back and runs it again, up to its tries; on
    the last (`last_try`) the work is to go on as it can instead."""


_LAST_TRY: ContextVar[bool] = ContextVar("last_try", default=True)


def last_try() -> bool:
    """Whether the transaction `Transactions.run` runs now is its last try (True outside one): no
    `RetryTransaction` then."""
    return _LAST_TRY.get()


def _key32(name: str) -> int:
    """A stable signed 32-bit number for a name (PostgreSQL's two-int advisory lock key)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big", signed=True)


class Transactions:
    """Runs functions in transactions on one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        # SQLite has one writer anyway; serialising in-process avoids busy waits.
        self._lock = None if self.postgres else threading.RLock()

    def run(self, work: Callable[[Connection], T]) -> T:
        """`work(conn)` in one transaction, committed before this returns; retried on PostgreSQL deadlocks and
        serialization failures, and on `RetryTransaction`."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                token = _LAST_TRY.set(attempt == _ATTEMPTS)
                try:
                    with self._lock or nullcontext(), self.engine.begin() as conn:
                        return work(conn)
                finally:
                    _LAST_TRY.reset(token)
            except (DBAPIError, RetryTransaction) as exc:
                state = getattr(getattr(exc, "orig", None), "sqlstate", None)
                reason = str(exc) if isinstance(exc, RetryTransaction) else _RETRIED.get(state)
                if reason is None or attempt == _ATTEMPTS:
                    raise
                log.warning("transaction aborted (%s), retry %d of %d", reason, attempt, _ATTEMPTS - 1)
                time.sleep(0.005 * 2**attempt)
        raise AssertionError("unreachable")

    def read(self, work: Callable[[Connection], T]) -> T:
        """`work(conn)` in a transaction that only reads.

        On a SQLite file it runs beside the writer, not after it: a deferred transaction (`READ_ONLY`) on a
        connection of its own, which in WAL mode sees the last commit and holds no write lock, so a long read
        (assembling every trajectory for the web page) does not stall exports. On PostgreSQL a read-only REPEATABLE
        READ transaction: every statement of `work` sees one snapshot (under READ COMMITTED an export that deleted a
        trajectory between the read of its row and of its spans made the read fail, "has no spans"), and a
        read-only one is never aborted as a serialization failure. SQLite in memory has one connection for every
        thread: as `run`.
        """
        if self.postgres:
            snapshot = {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
            with self.engine.connect().execution_options(**snapshot) as conn, conn.begin():
                return work(conn)
        if isinstance(self.engine.pool, StaticPool):
            return self.run(work)
        with self.engine.connect().execution_options(**{READ_ONLY: True}) as conn, conn.begin():
            return work(conn)

    def lock(self, conn: Connection, namespace: int, names: Iterable[str]) -> None:
        """Hold advisory locks on `names` until the transaction ends (PostgreSQL; SQLite needs none).

        Locks are taken in ascending key order, and callers take namespaces in ascending order,
        so two transactions never wait on each other in a cycle. One statement takes them all.
        """
        if not self.postgres:
            return
        keys = sorted({_key32(name) for name in names})
        if not keys:
            return
        key = func.unnest(cast(keys, ARRAY(Integer))).column_valued("key")
        # in ascending order: since 9.6 PostgreSQL computes a SELECT's output expressions after its sort when ORDER BY
        # does not reference them (the SELECT reference page, https://www.postgresql.org/docs/current/sql-select.html,
        # section "SELECT List"); the plan is a Result calling the function over a Sort of the keys
        conn.execute(select(func.pg_advisory_xact_lock(namespace, key)).order_by(key))
