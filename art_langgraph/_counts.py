"""Process-wide counts and locks of the plugin, safe to use from any thread and renewed in a forked child.

A module-level lock (a count's, the settings', a once-only warning's, the pipeline's) may be held by a thread of the
parent when the process forks, and in the child no thread would ever release it: the child would hang at its first
use. Each is a `ProcessLock`, which the plugin's one after-fork hook (`_pipelines`) renews through `renew_after_fork`.
"""

from __future__ import annotations

import threading

__all__ = ["DROPPED_SPANS", "RECORDING_ERRORS", "ProcessCount", "ProcessLock", "renew_after_fork"]

_RENEWED: list[ProcessLock | ProcessCount] = []
"""Every `ProcessLock` and `ProcessCount` made, in the order made: `renew_after_fork` renews each."""


class ProcessLock:
    """A module-level lock (`with lock:`) that a forked child gets anew; make each once, at import (it is kept for
    the life of the process).

    Args:
        reentrant: A thread that holds the lock may take it again (an `RLock`), e.g. to configure the pipeline it
            is about to use.
    """

    def __init__(self, *, reentrant: bool = False) -> None:
        self._new = threading.RLock if reentrant else threading.Lock
        self._lock = self._new()
        _RENEWED.append(self)

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()

    def after_fork(self) -> None:
        """In a forked child: a new, free lock of the same kind (a thread of the parent may have held the old one)."""
        self._lock = self._new()


class ProcessCount:
    """A number that threads add to under a lock; a forked child counts its own from 0. Make each once, at import."""

    def __init__(self) -> None:
        self._lock = ProcessLock()
        self._value = 0
        _RENEWED.append(self)

    @property
    def value(self) -> int:
        """The count so far."""
        return self._value

    def add(self, n: int = 1) -> None:
        """Add `n` to the count."""
        with self._lock:
            self._value += n

    def after_fork(self) -> None:
        """In a forked child: count from 0 (its lock is renewed with every `ProcessLock`)."""
        self._value = 0


DROPPED_SPANS = ProcessCount()
"""Spans that every `CountingExporter` of this process failed to deliver, replaced or shut-down pipelines' too."""
RECORDING_ERRORS = ProcessCount()
"""Errors caught while recording model calls (`_llm_span.recording_guard`)."""


def renew_after_fork() -> None:
    """In a forked child: every `ProcessLock` is new and free, and every count starts from 0."""
    for renewed in _RENEWED:
        renewed.after_fork()
