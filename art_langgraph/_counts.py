"""Process-wide counts of what the plugin lost, safe to add to from any thread and renewed in a forked child.

A count's lock is a module-level lock: a thread of the parent may hold it when the process forks, and in the
child no thread would ever release it. The plugin's one after-fork hook (`_tracing`) calls `renew_after_fork`.
"""

from __future__ import annotations

import threading

__all__ = ["DROPPED_SPANS", "RECORDING_ERRORS", "ProcessCount", "renew_after_fork"]


class ProcessCount:
    """A number that threads add to under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    @property
    def value(self) -> int:
        """The count so far."""
        return self._value

    def add(self, n: int = 1) -> None:
        """Add `n` to the count."""
        with self._lock:
            self._value += n

    def after_fork(self) -> None:
        """In a forked child: count from 0 under a new lock (a thread of the parent may have held the old one)."""
        self._lock = threading.Lock()
        self._value = 0


DROPPED_SPANS = ProcessCount()
"""Spans that every `CountingExporter` of this process failed to deliver, replaced or shut-down pipelines' too."""
RECORDING_ERRORS = ProcessCount()
"""Errors caught while recording model calls (`_llm_span.recording_guard`)."""


def renew_after_fork() -> None:
    """In a forked child: every count starts from 0, under a lock of its own."""
    for count in (DROPPED_SPANS, RECORDING_ERRORS):
        count.after_fork()
