"""The plugin's pipelines once configured: the current one, those stopping, and how they are flushed and stopped.

`flush` and `shutdown` are bounded (atexit handlers included, see `run_bounded`); a pipeline `configure` or `shutdown`
replaced stays listed (`_stopping`) while its shutdown may still be exporting, so that `flush` waits for it too. The
exit hook (`_flush_at_exit`) exports what is left within `ART_EXIT_FLUSH_TIMEOUT` and counts as dropped what it gave up
on; the after-fork hook (`_after_fork_in_child`) leaves a forked child no pipeline of its parent's.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from opentelemetry.sdk.trace import TracerProvider

from art_langgraph._bounded import Coalesced, run_bounded, spare_thread
from art_langgraph._checks import check_timeout
from art_langgraph._counts import ProcessLock, renew_after_fork
from art_langgraph._export_queue import Processor
from art_langgraph._settings import get_settings

__all__ = ["flush", "shutdown"]

_logger = logging.getLogger(__name__)

_INSTRUMENTATION_NAME = "art_langgraph"


_FLUSH_MILLIS = int(threading.TIMEOUT_MAX * 1000)
"""The timeout a flush gives the processors: as long as a thread can wait (each `flush` call bounds its own wait)."""


class _State:
    """The configured pipeline: the provider spans start on, and the processors that export them."""

    def __init__(self, provider: TracerProvider, processors: list[Processor]) -> None:
        self.provider = provider
        self.processors = processors
        self.tracer = provider.get_tracer(_INSTRUMENTATION_NAME)
        self.flushing = Coalesced(self.force_flush)
        """`force_flush` for `flush`, on one thread however many flushes wait behind an export a collector is slow to
        answer."""
        self.stopped = threading.Event()
        """Set once `shutdown` has ended (or raised)."""

    def force_flush(self) -> bool:
        """Export every ended span: through the provider's own processors (tests add some), then ours."""
        flushed = self.provider.force_flush(_FLUSH_MILLIS)
        return all([flushed, *(p.force_flush(_FLUSH_MILLIS) for p in self.processors)])

    def shutdown(self) -> None:
        """Shut the provider down, then export what our processors hold and stop them."""
        try:
            self.provider.shutdown()
            for processor in self.processors:
                processor.shutdown()
        finally:
            self.stopped.set()

    def unsent(self) -> int:
        """The spans our exporters have not sent yet: queued, or in a request not answered (one the SDK's shutdown,
        which waits 30 s for it, left behind)."""
        return sum(processor.counting.pending + processor.counting.sending for processor in self.processors)

    def give_up(self) -> int:
        """Count the spans our exporters have not sent yet (queued, or in a request not answered) as dropped, now;
        how many."""
        return sum(processor.counting.give_up() for processor in self.processors)


_lock = ProcessLock(reentrant=True)
"""Guards `_state`; reentrant, as `_current` configures a pipeline under it."""
_state: _State | None = None
_stopping: list[_State] = []
"""Pipelines `configure` or `shutdown` replaced, while their shutdown may still be exporting (their callers' waits are
bounded; the SDK waits 30 s for a stalled collector) or their exporters still hold spans (a request that shutdown left
unanswered): `flush` waits for their shutdown too, and the exit hook gives up on them as on the current one."""
_exit_hook_ran = False


def flush(timeout: float = 5.0) -> bool:
    """Export every finished span now, waiting at most `timeout` seconds.

    That includes the spans of a pipeline `configure` or `shutdown` stopped whose export is still under way (a slow
    collector). Calls made while a flush waits on the collector are served together, by one thread. It works from the
    application's own atexit handlers too (see `run_bounded`).

    Args:
        timeout: Upper bound on the wait, in seconds: 0 or more, `math.inf` to wait as long as a thread can.

    Returns:
        True if everything was handed to the exporters in time, False otherwise; a failed export never raises.

    Raises:
        ValueError: `timeout` is NaN or negative.
        TypeError: `timeout` is not a number (a bool is none).
    """
    timeout = check_timeout(timeout, "flush's timeout")
    started = time.monotonic()
    with _lock:
        state, stopping = _state, list(_stopping)
    flushed = state is None or state.flushing.run_bounded(timeout)
    return flushed and _wait_stopped(stopping, timeout - (time.monotonic() - started))


def _replace(state: _State | None) -> _State | None:
    """Make `state` the current pipeline (None: none, the next span configures one) and return the one it replaces,
    which joins the `_stopping` pipelines under the same lock (its shutdown is the caller's): a `flush` in between
    saw it in neither place and returned True with its spans still queued."""
    global _state, _stopping
    with _lock:
        old, _state = _state, state
        if old is not None:
            _stopping = [*(s for s in _stopping if not s.stopped.is_set() or s.unsent()), old]
    return old


def _wait_stopped(states: list[_State], timeout: float) -> bool:
    """Wait at most `timeout` seconds in all for the shutdown of each of `states` to end; whether every one did."""
    end = time.monotonic() + min(max(timeout, 0.0), threading.TIMEOUT_MAX)
    return all(state.stopped.wait(max(end - time.monotonic(), 0.0)) for state in states)


def shutdown(timeout: float = 5.0) -> None:
    """Flush and stop the pipeline (bounded, atexit handlers included); the next span configures a new one.

    Raises:
        ValueError: `timeout` is NaN or negative (the pipeline is kept).
        TypeError: `timeout` is not a number (a bool is none).
    """
    timeout = check_timeout(timeout, "shutdown's timeout")
    if (state := _replace(None)) is not None:
        run_bounded(state.shutdown, timeout)


def _flush_at_exit() -> None:
    """The exit hook: exports what is left, the current pipeline's and the stopping ones' (`_stopping`), waiting at
    most `ART_EXIT_FLUSH_TIMEOUT` seconds in all, and counts as dropped and logs the spans still unsent when it gave up
    (a failed shutdown is logged by `run_bounded`).

    The shutdowns it gave up on may still end while the process exits; they count none of those spans again, and one
    they deliver then stays counted.
    """
    global _exit_hook_ran, _stopping
    _exit_hook_ran = True
    if (state := _replace(None)) is None and not _stopping:
        return
    started = time.monotonic()
    timeout = get_settings().exit_flush_timeout
    if state is not None:
        run_bounded(state.shutdown, timeout)
    with _lock:
        stopping, _stopping = _stopping, []
    _wait_stopped(stopping, timeout - (time.monotonic() - started))
    # every pipeline's, those whose shutdown ended too: the SDK's ends after 30 s with a request still unanswered
    if lost := sum(old.give_up() for old in stopping):
        _logger.warning(
            "art_langgraph: %d spans were still unsent when ART_EXIT_FLUSH_TIMEOUT (%g s) ran out at exit; they are "
            "lost: raise ART_EXIT_FLUSH_TIMEOUT if the collector is slow to answer",
            lost,
            timeout,
        )


def _after_fork_in_child() -> None:
    """Give a forked child its own spare thread now, and its own pipeline at its first span (or span end).

    The parent's exporters hold the parent's HTTP connections, on which the child would write
    too, and count the spans queued in the parent, which the child's queues do not hold. The
    locks are new too, every `_counts.ProcessLock` (the pipeline's, the counts', the settings', the once-only
    warnings'): a thread of the parent may have held one (configuring at a first span, counting a loss, reading the
    settings), and in the child no thread would ever release it.
    """
    global _state, _stopping
    _state = None
    _stopping = []
    renew_after_fork()
    spare_thread.after_fork()


atexit.register(_flush_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
