"""`size_bound` against the OpenTelemetry SDK's own protobuf encoder, and `size_bounded`'s cuts."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags, TraceState

from art_langgraph._export_size import REQUEST_BYTES, size_bound, size_bounded


def _spans() -> list[ReadableSpan]:
    """Spans with every kind of value the plugin records, at their widest encodings."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("size")
    values = [
        {"ids": [2**63 - 1, -1, 0] * 50, "logprobs": [-1e-300, 3.5] * 40},  # 10-byte varints, doubles
        {"json": '[{"role": "user", "content": "héllo ✓ 数"}]' * 30, "flag": True, "n": -(2**62)},
        {"names": ["tool", "ünïcode", ""] * 20, "steps": [True, False] * 9},
        {},
    ]
    with tracer.start_as_current_span("rollout ünïcode") as root:
        root.add_event("art.reward", {"name": "reward", "value": 0.25})
        root.set_status(Status(StatusCode.ERROR, "failed: ✗" * 20))
        for n, attrs in enumerate(values):
            link = [Link(root.get_span_context(), {"why": "x" * n})]
            with tracer.start_as_current_span(f"chat {n}", attributes=attrs, links=link):
                pass
    return list(exporter.get_finished_spans())


def test_size_bound_is_at_least_the_encoded_size() -> None:
    spans = _spans()
    for span in spans:
        alone = encode_spans([span]).ByteSize()
        assert alone <= size_bound(span) + REQUEST_BYTES
        assert size_bound(span) < 3 * alone + 400  # a bound, not a wild guess
    assert encode_spans(spans).ByteSize() <= sum(map(size_bound, spans)) + REQUEST_BYTES


def test_size_bound_counts_the_trace_state_of_the_span_and_its_links() -> None:
    """A span under an app's span with a long W3C `tracestate` (an incoming request's header) inherits it, and OTLP
    carries it on the span (and on links): uncounted, a request near the bound passed what the collector takes."""
    state = TraceState([(f"vendor{i}", "v" * 200) for i in range(32)])
    app_span = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(1), trace_state=state)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    context = trace.set_span_in_context(NonRecordingSpan(app_span))
    with provider.get_tracer("size").start_as_current_span("chat m", context=context, links=[Link(app_span)]):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_state == state
    assert encode_spans([span]).ByteSize() <= size_bound(span) + REQUEST_BYTES
    assert size_bound(span) >= 2 * len(state.to_header())  # the link's too, which OTLP defines a field for


def test_size_bounded_keeps_order_and_every_run_under_the_limit() -> None:
    spans = _spans() * 5
    limit = REQUEST_BYTES + 2 * max(map(size_bound, spans))
    runs = list(size_bounded(spans, limit))
    assert [span for run in runs for span in run] == spans
    assert len(runs) > 1
    assert all(REQUEST_BYTES + sum(map(size_bound, run)) <= limit for run in runs)
    assert all(encode_spans(run).ByteSize() <= limit for run in runs)
    assert [len(run) for run in size_bounded(spans, 1)] == [1] * len(spans)  # a span past the limit goes alone
    assert list(size_bounded([], limit)) == []
