"""Pausing a store's transaction in a test, to run another beside it on PostgreSQL: a wrapped function that waits
once it returned, and a wait for a transaction that waits for a lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, text

T = TypeVar("T")

WAIT = 10.0
"""Seconds a test waits for another thread, or for a lock to be waited for, before it gives up."""


def pause_after(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> tuple[threading.Event, threading.Event]:
    """Wrap `owner.name` so that each call, once it returned, sets the first event and waits for the second: set that
    one to let the paused transaction go on (a retry, once it is set, goes on)."""
    done, resume = threading.Event(), threading.Event()
    wrapped = getattr(owner, name)

    def paused(*args: Any, **kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        done.set()
        assert resume.wait(WAIT), f"{name} paused for {WAIT:g} s: nothing let it go on"
        return result

    monkeypatch.setattr(owner, name, paused)
    return done, resume


def lock_waited_for(engine: Engine, waiting: int = 1) -> bool:
    """Whether `waiting` transactions on `engine`'s PostgreSQL database come to wait for a lock within `WAIT`
    seconds."""
    deadline = time.monotonic() + WAIT
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            if conn.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar_one() >= waiting:
                return True
            conn.rollback()
            time.sleep(0.01)
    return False


def beside_a_save(engine: Engine, ids: list[str], work: Callable[[], T]) -> T:
    """`work()`, run in a thread beside a transaction that updates the trajectory rows `ids` one at a time in that
    order, as the reward curve's save does (`PolicySteps.save`, in id order): the first row before `work` starts, the
    others once `work` waits for a lock; `work`'s result once that transaction committed."""
    saved = text("UPDATE trajectories SET policy_step = policy_step WHERE id = :tid")
    with ThreadPoolExecutor(1) as executor, engine.connect() as saving:
        with saving.begin():
            saving.execute(saved, {"tid": ids[0]})
            done = executor.submit(work)
            assert lock_waited_for(engine), "nothing waited for the save's row"
            for tid in ids[1:]:
                saving.execute(saved, {"tid": tid})
        return done.result(WAIT)
