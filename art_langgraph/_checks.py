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
        raise ValueError(f"{what} must be from 1 to {limit}, got {_shown(size)}")
    return int(size)


def check_timeout(timeout: float, what: str) -> float:
    """`timeout` as a float: a number of seconds (NumPy's too, `math.inf` included), 0 or more, not NaN, not a bool;
    an int past a float's range is `math.inf` (or below 0)."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(timeout).__name__}")
    seconds = _float_or_inf(timeout)  # no wait is as long as 10**400 seconds: it is one as long as it takes
    if math.isnan(seconds) or seconds < 0:
        shown = _shown(timeout)
        raise ValueError(f"{what} must be 0 or more seconds (math.inf to wait as long as it takes), got {shown}")
    return seconds


def _float_or_inf(number: numbers.Real) -> float:
    """`number` as a float; an int past a float's range (`float(10**400)` raises) as `math.inf` or `-math.inf`."""
    try:
        return float(number)
    except OverflowError:
        return math.inf if number > 0 else -math.inf


def _shown(number: numbers.Real) -> numbers.Real | float:
    """`number` for an error message: past a float's range, as inf or -inf (str() writes at most 4,300 digits)."""
    as_float = _float_or_inf(number)
    return as_float if math.isinf(as_float) else number
