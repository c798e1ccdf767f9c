"""Reading the spans a test's in-memory exporter (the `spans` fixture) received."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from art_langgraph import semconv


def spans_of(spans: InMemorySpanExporter, kind: str) -> list[ReadableSpan]:
    """The finished spans of one `art.span.kind` (`semconv.SPAN_KIND_*`), in the order they ended."""
    return [s for s in spans.get_finished_spans() if (s.attributes or {}).get(semconv.SPAN_KIND) == kind]
