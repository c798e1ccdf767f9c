"""`Backoff`: when an action that keeps failing may run again, doubling the wait after each failure in a row."""

from __future__ import annotations

import time

__all__ = ["Backoff"]


class Backoff:
    """When a failing action may run again: `first` seconds after the first failure in a row, twice as long
    after each further one, at most `longest`; a success ends the streak (`reset`).

    Args:
        first: seconds before the first retry.
        longest: the longest wait between two tries.
    """

    def __init__(self, first: float, longest: float) -> None:
        self.first = first
        self.longest = longest
        self.failures = 0
        """Failures in a row."""
        self.not_before = 0.0
        """`time.monotonic()` before which the action is not tried again."""

    def due(self) -> bool:
        """True when the action may run now."""
        return time.monotonic() >= self.not_before

    def failed(self) -> float:
        """Count a failure; return the seconds until the next try."""
        delay = min(self.first * 2 ** min(self.failures, 16), self.longest)
        self.failures += 1
        self.not_before = time.monotonic() + delay
        return delay

    def reset(self) -> None:
        """End the streak: the action may run now."""
        self.failures = 0
        self.not_before = 0.0
