"""Bounded waits: run a call on another thread and wait for it at most so long, at exit too.

From Python 3.12 no thread can start once the interpreter is exiting (atexit handlers
included, the application's as well as the plugin's), yet a flush there must still be bounded.
Such calls run on a spare thread started beforehand: when the plugin is imported
(`spare_thread.arm()`), and again in a forked child (`spare_thread.after_fork()`). A call that many waits ask for
(a flush) runs on one thread at a time (`Coalesced`), however long a run is stuck.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["Coalesced", "run_bounded", "spare_thread"]

_logger = logging.getLogger(__name__)


def _run_logged(fn: Callable[[], object]) -> bool:
    """Call `fn()`; False when it returned False or raised (logged with the traceback)."""
    try:
        return fn() is not False
    except Exception:
        _logger.exception("art_langgraph: tracing flush/shutdown failed")
        return False


class _Job:
    """One call run on another thread, so that the caller's wait can be bounded."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._ok = False

    def run(self) -> None:
        """Call the function (errors are logged, see `_run_logged`) and wake the waiter."""
        self._ok = _run_logged(self._fn)
        self._done.set()

    def wait(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds (or `threading.TIMEOUT_MAX`, the longest a thread can wait, where that is
        less); True if the call finished in time and succeeded."""
        return self._done.wait(min(timeout, threading.TIMEOUT_MAX)) and self._ok


class _SpareThread:
    """A daemon thread, started before it is needed, that runs the calls no new thread can run."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """Start the thread, once per process; where none can start (at exit), log what that costs."""
        if self._thread is not None:
            return
        thread = threading.Thread(target=self._serve, name="art-langgraph-spare", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown" (Python 3.12+)
            _logger.warning("art_langgraph: no thread can start (the interpreter is exiting); spans made now are lost")
            return
        self._thread = thread

    def after_fork(self) -> None:
        """In a forked child, which has no copy of the thread: start the child's own."""
        self._thread = None
        self._jobs = queue.SimpleQueue()
        self.arm()

    def submit(self, job: _Job) -> bool:
        """Queue `job` for the thread (the caller bounds its wait with `job.wait`); False if there is none."""
        if self._thread is None:
            return False
        self._jobs.put(job)
        return True

    def _serve(self) -> None:
        while True:
            self._jobs.get().run()


spare_thread = _SpareThread()


def run_bounded(fn: Callable[[], object], timeout: float) -> bool:
    """Run `fn()` on another thread and wait at most `timeout` seconds.

    The thread is a new daemon thread or, while the interpreter is exiting, the spare thread.
    Errors `fn` raises are logged with their traceback, never raised.

    Returns:
        True if `fn()` finished in time and neither raised nor returned False.
    """
    job = _Job(fn)
    return _start(job) and job.wait(timeout)


def _start(job: _Job) -> bool:
    """Run `job` on a new daemon thread or, while the interpreter is exiting, the spare thread; False if on neither."""
    try:
        threading.Thread(target=job.run, name="art-langgraph-flush", daemon=True).start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown" (Python 3.12+)
        return spare_thread.submit(job)
    return True


class Coalesced:
    """A call that any number of threads ask for and wait on, bounded (a flush), run on one thread at a time.

    A request is served by the first run that starts after it; the requests made while a run is under way are served
    together by the next one. A run stuck for good (an export a stalled collector never answers) so holds one thread,
    where a thread per request (`run_bounded`) piled up behind it for as long as it was stuck.
    """

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._changed = threading.Condition()
        self._asked = 0
        """Requests so far."""
        self._served = 0
        """Requests served by a run that has ended: the first `_served` of them."""
        self._succeeded = 0
        """Requests served by a run that succeeded (see `_run_logged`): the first `_succeeded` of them. A waiter reads
        it, not the last run's result: a later run (for later requests) may have ended, and failed, before it woke."""
        self._running = False
        """Whether a thread is serving requests (`_serve`)."""

    def run_bounded(self, timeout: float) -> bool:
        """Ask for a run and wait at most `timeout` seconds (or `threading.TIMEOUT_MAX`) for one that started after
        this call to end. Errors the call raises are logged with their traceback, never raised.

        Returns:
            True if such a run ended in time and neither raised nor returned False.
        """
        with self._changed:
            self._asked += 1
            request = self._asked
            if not self._running:
                self._running = _start(_Job(self._serve))
                if not self._running:
                    return False
            served = self._changed.wait_for(lambda: self._served >= request, min(timeout, threading.TIMEOUT_MAX))
            return served and self._succeeded >= request

    def _serve(self) -> None:
        """Run the call until every request made so far is served, then end (a later request starts a new thread)."""
        while True:
            with self._changed:
                if self._served == self._asked:
                    self._running = False
                    return
                asked = self._asked
            try:
                ok = _run_logged(self._fn)
            except BaseException:  # SystemExit, a green thread's exit: this thread ends, a later request starts one
                with self._changed:
                    self._running = False
                raise
            with self._changed:
                self._served = asked
                if ok:
                    self._succeeded = asked
                self._changed.notify_all()
