"""Reading an HTTP `Retry-After` header, which the judge and Langfuse may both send with a 429 or 503."""

from __future__ import annotations

import datetime as dt
import email.utils


def seconds_asked(value: str | None, now: float) -> float | None:
    """The seconds a `Retry-After` header's `value` asks to wait from `now` (Unix seconds), as RFC 9110 writes it:
    delay-seconds (a whole number), or an HTTP-date in any of its three forms (the date less `now`, 0 once past);
    None without the header, or with one of neither form (a negative or fractional number, a date no clock holds)."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a field past a C long, e.g. hour 10**20
        return None
    return max(0.0, (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp() - now)  # asctime: GMT
