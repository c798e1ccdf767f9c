"""Export batches cut to a size the receiver takes.

The batch processor hands the exporter up to 512 spans at once, and an `llm` span carries its
prompt's token ids: at 8,000 prompt tokens a span encodes to about 90 KiB, so one batch can pass
the collector's body limit (`ART_COLLECTOR_MAX_BODY_BYTES`, 20 MiB), which answers 413, and the
exporter does not retry a 413: the whole batch would be lost. `size_bounded` cuts a batch into
requests of at most `ART_MAX_EXPORT_BYTES`, by an upper bound on each span's OTLP protobuf size,
computed without encoding.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext

__all__ = ["REQUEST_BYTES", "size_bound", "size_bounded"]

_SCALAR_BYTES = 14
"""Most bytes of one bool, int or float in an `AnyValue` (array element or attribute value): the
element's tag and length, the value's tag, and a varint of up to 10 bytes (a double: 8)."""
_STRING_BYTES = 8
"""Bytes of a string's `AnyValue` beyond its UTF-8 text: tags and length prefixes."""
_ATTRIBUTE_BYTES = 8
"""Bytes of a `KeyValue` beyond its key's text and its value: tags and length prefixes."""
_SPAN_BYTES = 160
"""Most bytes of a span without its name, attributes and trace state: ids, times, kind, status, tags and lengths."""
REQUEST_BYTES = 4096
"""Room left in every request for what is not a span: the resource and the instrumentation scope."""


def _value_bound(value: object) -> int:
    if isinstance(value, str):
        return _STRING_BYTES + len(value.encode())
    if isinstance(value, bytes):
        return _STRING_BYTES + len(value)
    if isinstance(value, Sequence):  # OpenTelemetry sequences are homogeneous: strings, or scalars
        if value and isinstance(value[0], str):
            return _STRING_BYTES + sum(_STRING_BYTES + len(item.encode()) for item in value)
        return _STRING_BYTES + _SCALAR_BYTES * len(value)
    return _SCALAR_BYTES


def _attributes_bound(attributes: Mapping[str, object] | None) -> int:
    return sum(_ATTRIBUTE_BYTES + len(key.encode()) + _value_bound(value) for key, value in (attributes or {}).items())


def _trace_state_bound(context: SpanContext | None) -> int:
    """Bytes of the W3C trace state a span or link carries (its `key=value` entries joined by commas): up to 32 entries
    of up to 256-character values, which an app's incoming `tracestate` header hands to every span under it."""
    if context is None or not context.trace_state:
        return 0
    entries = context.trace_state.items()
    return _STRING_BYTES + sum(len(key.encode()) + len(value.encode()) + 2 for key, value in entries)


def size_bound(span: ReadableSpan) -> int:
    """An upper bound on the bytes `span` takes in an OTLP protobuf export request."""
    total = _SPAN_BYTES + len(span.name.encode()) + _attributes_bound(span.attributes)
    total += _trace_state_bound(span.context)
    total += sum(_SPAN_BYTES + len(e.name.encode()) + _attributes_bound(e.attributes) for e in span.events)
    total += sum(_SPAN_BYTES + _attributes_bound(link.attributes) + _trace_state_bound(link.context)
                 for link in span.links)
    if span.status.description:
        total += len(span.status.description.encode())
    return total


def size_bounded(spans: Sequence[ReadableSpan], limit: int) -> Iterator[Sequence[ReadableSpan]]:
    """`spans` in order, in runs whose requests take at most `limit` bytes; a span larger alone is a run of one."""
    start, size = 0, REQUEST_BYTES
    for index, span in enumerate(spans):
        bound = size_bound(span)
        if index > start and size + bound > limit:
            yield spans[start:index]
            start, size = index, REQUEST_BYTES
        size += bound
    if start < len(spans):
        yield spans[start:]
