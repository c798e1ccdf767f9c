"""Readers of span records that assembly and sequence building share: trajectory order, whole numbers, the rollout
key, and the warnings about a span's values, logged once."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from art_langgraph import semconv as sc
from collector.otlp import SpanRecord
from collector.protocol import MAX_COUNT, without_surrogates

__all__ = [
    "COUNTS", "WARNINGS_KEPT", "forget_warnings", "read_json", "rollout_key", "unique_sorted", "warn_once",
    "whole_number", "without_surrogates",
]

COUNTS = {sc.GROUP_SIZE: 1, sc.POLICY_STEP: 0}
"""Whole-number attributes and the least value each may take."""


def unique_sorted(spans: Iterable[SpanRecord]) -> list[SpanRecord]:
    """Drop duplicate spans, of one trace id and span id (first wins: a span id is unique within its trace only), and
    sort by start, end, span id, trace id."""
    seen: dict[tuple[str, str], SpanRecord] = {}
    for span in spans:
        seen.setdefault((span.trace_id, span.span_id), span)
    return sorted(seen.values(), key=lambda s: (s.start_ns, s.end_ns, s.span_id, s.trace_id))


def whole_number(value: Any, low: int) -> int | None:
    """`value` as an int when it is a whole number (an int, or a float such as 4.0) from `low` to `MAX_COUNT`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():  # also NaN and the infinities
        return None
    return int(value) if low <= value <= MAX_COUNT else None


_UUID = "[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UUID_TEXT = re.compile(rf"(?:urn:uuid:)?(?P<bare>{_UUID})|\{{(?P<braced>{_UUID})\}}", re.IGNORECASE | re.ASCII)
"""A UUID's text in any of its usual forms: 32 hex digits or 8-4-4-4-12 with dashes, bare, after `urn:uuid:` or in
braces, in either case (ASCII letters only)."""


def rollout_key(rollout_id: str) -> str:
    """The key the store gives a rollout id (`art.rollout.id`, a reward's `rollout_id`): a UUID's text in any of its
    forms (`_UUID_TEXT`: `123E4567-E89B-...`, `{...}`, `urn:uuid:...`) becomes its 32 lower-case hex digits, as the
    plugin writes its own ids (`uuid4().hex`) and sends a `uuid.UUID` (`reward(rollout_id=run_id)`), so that every form
    of one UUID names one trajectory; any other id is kept exactly as written."""
    found = _UUID_TEXT.fullmatch(rollout_id)
    return (found["bare"] or found["braced"]).replace("-", "").lower() if found else rollout_id


def read_json(text: str) -> Any:
    """`json.loads(text)` for a span's JSON-text attribute, raising `ValueError` for any text it cannot read: not JSON
    (`json.JSONDecodeError`), an integer past Python's 4300 digits, or nesting past the recursion limit (which
    `json.loads` raises as `RecursionError`). The span was stored as sent, so every read must survive such text.

    An escaped lone surrogate (`"\\udcff"`: plain ASCII, which OTLP carries) reads as U+FFFD, as export writes one
    in any other text: decoded as a surrogate, no answer holding it could be encoded (reads, and a lease whose groups
    stayed leased)."""
    try:
        value = json.loads(text)
        return without_surrogates(value) if _ESCAPED_SURROGATE.search(text) else value
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply to read") from exc


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate (`\\ud83d`): only text with one can read as a lone surrogate."""
WARNINGS_KEPT = 4096
"""How many distinct warnings `warn_once` remembers (the least recently logged are forgotten first)."""

_warned: OrderedDict[tuple[str, ...], None] = OrderedDict()
_warned_lock = threading.Lock()


def warn_once(logger: logging.Logger, message: str, *args: Any) -> None:
    """`logger.warning(message, *args)`, unless this process logged the same warning (message and arguments: the span
    or trajectory it names and what is wrong) among its last `WARNINGS_KEPT`: a trajectory is assembled on every read
    (the web page, `GET /v1/trajectories`, a lease), and one bad span would log its warning each time."""
    key = (logger.name, message, *map(str, args))
    with _warned_lock:
        if key in _warned:
            _warned.move_to_end(key)
            return
        _warned[key] = None
        if len(_warned) > WARNINGS_KEPT:
            _warned.popitem(last=False)
    logger.warning(message, *args)


def forget_warnings() -> None:
    """Forget the warnings `warn_once` logged, so each is logged again (tests that look for one)."""
    with _warned_lock:
        _warned.clear()
