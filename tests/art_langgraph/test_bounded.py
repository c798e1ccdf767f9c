"""`Coalesced` (`art_langgraph/_bounded.py`): each waiter gets the result of a run that started after it asked, and a
run that ends its thread leaves no later request unserved."""

from __future__ import annotations

import threading

import pytest

from art_langgraph._bounded import Coalesced

WAIT = 10.0


class _LateWaker(threading.Condition):
    """A condition whose first waiter, once woken, lets the lock go and goes on only when `late` is set: a thread
    the scheduler has not run yet, while the others go on."""

    def __init__(self) -> None:
        super().__init__()
        self.late = threading.Event()
        self._slow: int | None = None

    def wait(self, timeout: float | None = None) -> bool:
        if self._slow is None:
            self._slow = threading.get_ident()
        woke = super().wait(timeout)
        if threading.get_ident() == self._slow and not self.late.is_set():
            self.release()
            self.late.wait()
            self.acquire()
        return woke


def test_a_waiter_gets_the_result_of_the_run_that_served_it_not_of_a_later_one() -> None:
    """Run A, asked for by request 1, succeeded; run B, for request 2 (asked while A ran), failed, and ended before
    request 1's waiter woke: that waiter read the last run's result and returned False."""
    a_started, a_go = threading.Event(), threading.Event()
    results = iter([True, False])

    def call() -> bool:
        ok = next(results)
        if ok:  # run A: under way until request 2 is counted
            a_started.set()
            assert a_go.wait(WAIT)
        return ok

    coalesced = Coalesced(call)
    coalesced._changed = waker = _LateWaker()
    got: dict[int, bool] = {}
    first = threading.Thread(target=lambda: got.__setitem__(1, coalesced.run_bounded(WAIT)))
    first.start()
    assert a_started.wait(WAIT)
    second = threading.Thread(target=lambda: got.__setitem__(2, coalesced.run_bounded(WAIT)))
    second.start()
    while True:  # request 2 counted: B will serve it
        with waker:
            if coalesced._asked == 2:
                break
    a_go.set()
    second.join(WAIT)
    waker.late.set()
    first.join(WAIT)
    assert got == {1: True, 2: False}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit
def test_a_run_that_ends_its_thread_leaves_later_requests_a_run_of_their_own() -> None:
    """A call that raised what is no `Exception` (SystemExit, a green thread's exit) ended the serving thread with the
    flag that one serves still set: no later request started a run again, each waited out its timeout."""
    calls: list[int] = []

    def call() -> bool:
        calls.append(len(calls))
        if len(calls) == 1:
            raise SystemExit("the first run's")
        return True

    coalesced = Coalesced(call)
    assert not coalesced.run_bounded(0.5)
    assert coalesced.run_bounded(WAIT)
    assert calls == [0, 1]
