"""Reads the schedule's settings as text: an `--every` duration, a `--cron` line; and checks the server time zone
they run on."""

from __future__ import annotations

import os
import re
from datetime import datetime
from zoneinfo import ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

__all__ = ["DURATION_FORM", "LONGEST_INTERVAL_S", "SHORTEST_INTERVAL_S", "check_schedule_timezone", "duration_text",
           "parse_cron", "parse_duration"]

LONGEST_INTERVAL_S = 365 * 86400.0
"""Longest `every` and `poll_seconds`, a year: a longer one is a typo, and past ~3e11 s (or at inf) the scheduler
failed to start the service (its next run would fall after year 9999)."""
SHORTEST_INTERVAL_S = 0.1
"""Shortest `every` and `poll_seconds`: each wake-up of APScheduler lists every run missed since the last one, one per
interval, before coalescing them; at a microsecond that stalled the event loop (proxy, status) longer each time."""

_UNITS = {"s": (1.0, "seconds"), "m": (60.0, "minutes"), "h": (3600.0, "hours"), "d": (86400.0, "days")}
"""The units of a duration: seconds and name of each."""
_DURATION = re.compile(rf"^\s*(\d+(?:\.\d+)?)\s*({'|'.join(_UNITS)})\s*$")


def duration_text(seconds: float) -> str:
    """`seconds` as a duration `parse_duration` reads, in the largest unit holding it whole: `0.1s`, `10m`, `365d`."""
    unit = next((unit for unit in reversed(_UNITS) if seconds % _UNITS[unit][0] == 0), "s")
    return f"{seconds / _UNITS[unit][0]:g}{unit}"


_NAMED_UNITS = [f"{unit} ({name})" for unit, (_, name) in _UNITS.items()]
DURATION_FORM = (f"a positive number and a unit, {', '.join(_NAMED_UNITS[:-1])} or {_NAMED_UNITS[-1]}, e.g. 30s, "
                 f"10m, 1.5h, 1d; at least {duration_text(SHORTEST_INTERVAL_S)}, at most "
                 f"{duration_text(LONGEST_INTERVAL_S)}")
"""What `parse_duration` reads, its units and bounds, as help and messages say it."""


def parse_duration(text: str) -> float:
    """Return the seconds of a duration such as `30s`, `10m`, `1.5h`, `1d`.

    Raises:
        ValueError: the text is not a positive number followed by s, m, h or d, or is shorter than
            `SHORTEST_INTERVAL_S` or longer than `LONGEST_INTERVAL_S`.
    """
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"every={text!r} is not a duration; write {DURATION_FORM}.")
    seconds = float(match.group(1)) * _UNITS[match.group(2)][0]
    if not seconds <= LONGEST_INTERVAL_S:  # also refuses inf, what a number of 309 digits or more parses to
        raise ValueError(f"every={text!r} is longer than the longest interval, {duration_text(LONGEST_INTERVAL_S)}.")
    if seconds < SHORTEST_INTERVAL_S:
        raise ValueError(f"every={text!r} is shorter than the shortest interval, {duration_text(SHORTEST_INTERVAL_S)}.")
    return seconds


_CRON_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
"""Crontab's day-of-week numbers 0-6 (7 is Sunday too); APScheduler 3 numbers them from Monday = 0, so
`parse_cron` hands it names."""
_CRON_DAY = f"({'|'.join(_CRON_DAYS)}|[0-7])"
_CRON_DAY_PART = re.compile(rf"^(?:\*|{_CRON_DAY}(?:-{_CRON_DAY})?)(?:/([1-9]\d*))?$")
"""One part of a day-of-week list: `*`, a day or a range of days, each with an optional `/step`."""


def _cron_day(token: str) -> int:
    return int(token) if token.isdigit() else _CRON_DAYS.index(token)


def _cron_weekdays(field: str) -> str:
    """A crontab day-of-week field as APScheduler day names: `1-5` → `mon,tue,wed,thu,fri`, `*/2` → `sun,tue,thu,sat`.

    Raises:
        ValueError: a part is not `*`, a day (0-7, sun-sat) or an ascending range of days, with an optional
            `/step`.
    """
    if field == "*":
        return field
    days: set[int] = set()
    for part in field.lower().split(","):
        match = _CRON_DAY_PART.match(part)
        if match is None:
            raise ValueError(f"day of week {part!r} is not `*`, a day (0-7, sun-sat) or a range of days, with an "
                             "optional /step")
        first, last, step = match.groups()
        low = 0 if first is None else _cron_day(first)
        high = 7 if first is None or (last is None and step) else _cron_day(last or first)
        if high < low:
            raise ValueError(f"day of week {part!r} is a range that runs backwards")
        days.update(day % 7 for day in range(low, high + 1, int(step or 1)))
    return ",".join(_CRON_DAYS[day] for day in sorted(days))


def check_schedule_timezone() -> None:
    """Refuse a server time zone the scheduler cannot read, which it looks up (`TZ`, else `/etc/localtime`) only once
    the service has started.

    Raises:
        ValueError: names `TZ` (or `/etc/localtime`) and the fix.
    """
    try:
        IntervalTrigger(weeks=1)  # resolves the local zone as the scheduler does
    # ValueError: a path zoneinfo refuses (`/x`, `a/../UTC`); OSError: one it cannot read (a folder, `TZ=/etc`)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        zone = os.environ.get("TZ")
        where = f"TZ={zone!r}" if zone is not None else "/etc/localtime"
        raise ValueError(f"{where} is no time zone the schedule can use (--min-groups, --every and --cron run on "
                         "server local time, and APScheduler reads only zone names): set TZ to a name such as UTC or "
                         "Europe/Berlin, or unset it.") from exc


_CRON_NICKNAMES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
                   "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}
"""Crontab's nicknames and the lines they stand for (`@reboot` names no time: refused)."""


def parse_cron(text: str) -> CronTrigger:
    """Return the trigger of a five-field crontab line such as `*/15 * * * *`, or a nickname such as `@hourly`
    (server local time).

    Day-of-week numbers read as in crontab (0 and 7: Sunday), not as APScheduler 3's (0: Monday).

    Raises:
        ValueError: the line does not have five fields, a field is out of range or unknown, or the line never
            fires (`0 0 30 2 *`).
    """
    fields = _CRON_NICKNAMES.get(text.strip().lower(), text).split()
    if len(fields) != 5:
        raise ValueError(f"cron={text!r} has {len(fields)} fields; write five (minute hour day-of-month month "
                         f"day-of-week), e.g. `*/15 * * * *`, or one of {', '.join(_CRON_NICKNAMES)}.")
    minute, hour, day, month, weekday = fields
    try:
        trigger = CronTrigger(minute=minute, hour=hour, day=day, month=month, day_of_week=_cron_weekdays(weekday))
    except ValueError as exc:
        raise ValueError(f"cron={text!r} has a bad field: {exc}. Ranges: minute 0-59, hour 0-23, day of month "
                         "1-31, month 1-12 or jan-dec, day of week 0-7 or sun-sat (0 and 7: Sunday).") from exc
    if trigger.get_next_fire_time(None, datetime.now(trigger.timezone)) is None:
        raise ValueError(f"cron={text!r} never fires: no date has that day of month in those months.")
    return trigger
