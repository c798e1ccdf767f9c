"""Readers of span records that assembly and sequence building share: trajectory order and whole numbers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from art_langgraph import semconv as sc
from collector.otlp import SpanRecord
from collector.protocol import MAX_COUNT

__all__ = ["COUNTS", "unique_sorted", "whole_number"]

COUNTS = {sc.GROUP_SIZE: 1, sc.POLICY_STEP: 0}
"""Whole-number attributes and the least value each may take."""


def unique_sorted(spans: Iterable[SpanRecord]) -> list[SpanRecord]:
    """Drop duplicate span ids (first wins) and sort by start, end, id."""
    seen: dict[str, SpanRecord] = {}
    for span in spans:
        seen.setdefault(span.span_id, span)
    return sorted(seen.values(), key=lambda s: (s.start_ns, s.end_ns, s.span_id))


def whole_number(value: Any, low: int) -> int | None:
    """`value` as an int when it is a whole number (an int, or a float such as 4.0) from `low` to `MAX_COUNT`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():  # also NaN and the infinities
        return None
    return int(value) if low <= value <= MAX_COUNT else None
