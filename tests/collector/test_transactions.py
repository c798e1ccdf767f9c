"""Advisory locks of `Transactions.lock` on a real PostgreSQL server: one statement, taken in ascending key order."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import Engine, create_engine, event, text

from collector.transactions import TRAJECTORY_LOCKS, RetryTransaction, Transactions, _key32, last_try
from tests.collector.pausing import WAIT, lock_waited_for
from tests.collector.services import PostgresServer

HELD = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :ns AND pid = pg_backend_pid()")


@pytest.fixture
def engine(postgres: PostgresServer) -> Iterator[Engine]:
    made = create_engine(postgres.create_database())
    yield made
    made.dispose()


def test_one_statement_takes_every_lock(engine: Engine) -> None:
    names = [f"trajectory-{n}" for n in range(300)]
    sent: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, statement, *_: sent.append(statement))
    with engine.begin() as conn:
        Transactions(engine).lock(conn, TRAJECTORY_LOCKS, [*names, *names[:10]])  # repeated names: one lock each
        assert len(sent) == 1
        assert conn.execute(HELD, {"ns": TRAJECTORY_LOCKS}).scalar_one() == len(names)
        Transactions(engine).lock(conn, TRAJECTORY_LOCKS, [])
        assert len(sent) == 2  # the count above; no names send nothing


def test_overlapping_locks_asked_for_in_other_orders_never_deadlock(engine: Engine) -> None:
    """A holds the lowest key; B asks for all three, highest first, and waits; A then asks for all three in yet
    another order. Taken in ascending key order, B waits for the lowest holding none of the others, and A goes on;
    had B taken a higher key first, A waited for it while B waited for A (PostgreSQL aborted one as a deadlock)."""
    low, middle, high = sorted((f"trajectory-{n}" for n in range(3)), key=_key32)
    tx = Transactions(engine)

    def lock_all() -> int:
        with engine.begin() as conn:
            tx.lock(conn, TRAJECTORY_LOCKS, [high, middle, low])
            return conn.execute(HELD, {"ns": TRAJECTORY_LOCKS}).scalar_one()

    with ThreadPoolExecutor(1) as executor:
        with engine.begin() as first:
            tx.lock(first, TRAJECTORY_LOCKS, [low])
            waiting = executor.submit(lock_all)
            assert lock_waited_for(engine), "the second transaction did not wait for the lowest key"
            tx.lock(first, TRAJECTORY_LOCKS, [middle, high, low])
            assert first.execute(HELD, {"ns": TRAJECTORY_LOCKS}).scalar_one() == 3
        assert waiting.result(WAIT) == 3


def test_work_that_asks_for_another_try_gets_it_and_the_last_try_is_told(engine: Engine, monkeypatch) -> None:
    """`RetryTransaction` rolls the work back and runs it again; on the last try `last_try()` says so, and the work
    goes on as it can (a RetryTransaction there would fail the caller)."""
    monkeypatch.setattr("collector.transactions.time.sleep", lambda seconds: None)
    tries: list[bool] = []

    def work(conn) -> int:
        conn.execute(text("CREATE TEMP TABLE IF NOT EXISTS t (n int) ON COMMIT DROP"))
        tries.append(last_try())
        if not last_try():
            raise RetryTransaction("not yet")
        return len(tries)

    assert Transactions(engine).run(work) == 8 and tries == [False] * 7 + [True]
    assert last_try()  # outside a transaction of `run`
