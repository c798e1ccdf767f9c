"""Checks of the numbers the public API takes, each refusing a user's mistake with one clear line."""

from __future__ import annotations

import math
import numbers

from art_langgraph import semconv

__all__ = ["check_count", "check_timeout"]


def check_count(size: int | None, what: str = "group_size", limit: int = semconv.MAX_COUNT) -> int | None:
    """`size` as an int (NumPy's too), a whole number from 1 to `limit`, or None (a bool is no count)."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {type(size).__name__}")
    if not 1 <= size <= limit:
        raise ValueError(f"{what} must be from 1 to {limit}, got {size}")
    return int(size)


def check_timeout(timeout: float, what: str) -> float:
    """`timeout` as a float: a number of seconds (NumPy's too, `math.inf` included), 0 or more, not NaN, not a bool;
    an int past a float's range is `math.inf` (or below 0)."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(timeout).__name__}")
    try:
        seconds = float(timeout)
    except OverflowError:  # `float(10**400)` raises: no wait is that long, so it is one as long as it takes
        seconds = math.inf if timeout > 0 else -math.inf
    if math.isnan(seconds) or seconds < 0:  # past a float's range, shown as -inf: str() writes at most 4,300 digits
        shown = seconds if math.isinf(seconds) else timeout
        raise ValueError(f"{what} must be 0 or more seconds (math.inf to wait as long as it takes), got {shown}")
    return seconds
