"""`Backoff`: the wait doubles with each failure in a row, up to the longest, and a success ends the streak."""

from __future__ import annotations

import time

import pytest

from trainer_service.backoff import Backoff


def test_the_wait_doubles_up_to_the_longest_and_reset_ends_the_streak() -> None:
    backoff = Backoff(first=10.0, longest=60.0)
    assert backoff.due() and backoff.failures == 0
    assert [backoff.failed() for _ in range(5)] == [10.0, 20.0, 40.0, 60.0, 60.0]
    assert backoff.failures == 5 and not backoff.due()
    assert backoff.not_before == pytest.approx(time.monotonic() + 60.0, abs=1.0)
    backoff.reset()
    assert backoff.due() and backoff.failures == 0
    assert backoff.failed() == 10.0


def test_a_long_streak_does_not_overflow() -> None:
    backoff = Backoff(first=1.0, longest=600.0)
    for _ in range(2000):
        backoff.failed()
    assert backoff.failed() == 600.0
