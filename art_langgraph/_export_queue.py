"""The export side of the plugin's pipeline: bounded queues and an exporter that counts its losses.

`CountingExporter` wraps an OTLP exporter: it never raises, cuts requests under
`ART_MAX_EXPORT_BYTES`, sends text UTF-8 cannot encode with U+FFFD in its place (protobuf would refuse the whole
request), and counts what it failed to deliver, spans the receiver rejected included. Its processor is a
`BoundedProcessor` (a batch queue with a cap) or, where no thread can start, a `HeldProcessor`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Status
from opentelemetry.util.types import Attributes, AttributeValue

from art_langgraph._counts import DROPPED_SPANS
from art_langgraph._export_size import REQUEST_BYTES, size_bound, size_bounded

if TYPE_CHECKING:
    import requests

__all__ = [
    "BoundedProcessor",
    "CountingExporter",
    "HeldProcessor",
    "Processor",
    "export_processors",
]

_logger = logging.getLogger(__name__)

_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8_text(text: str) -> str:
    """`text` with each surrogate code point, which UTF-8 (so protobuf) cannot encode, replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def _utf8_value(value: AttributeValue) -> AttributeValue:
    if isinstance(value, str):
        return _utf8_text(value)
    if isinstance(value, Sequence) and value and isinstance(value[0], str):
        return tuple(_utf8_text(item) for item in value)  # type: ignore[arg-type]
    return value


def _utf8_attributes(attributes: Attributes) -> Mapping[str, AttributeValue]:
    return {_utf8_text(key): _utf8_value(value) for key, value in (attributes or {}).items()}


def _utf8_span(span: ReadableSpan) -> ReadableSpan:
    """A copy of `span` whose text UTF-8 can encode: a lone surrogate (bytes decoded with `surrogateescape`, a JSON
    `"\\udcff"`) in its name, attributes, events, links or status becomes U+FFFD."""
    status = span.status
    if status.description:
        status = Status(status.status_code, _utf8_text(status.description))
    return ReadableSpan(
        name=_utf8_text(span.name),
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=_utf8_attributes(span.attributes),
        events=[Event(_utf8_text(e.name), _utf8_attributes(e.attributes), e.timestamp) for e in span.events],
        links=[Link(link.context, _utf8_attributes(link.attributes)) for link in span.links],
        kind=span.kind,
        status=status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class CountingExporter(SpanExporter):
    """Delegates to an exporter, never raises, and counts the spans it failed to deliver."""

    def __init__(self, inner: SpanExporter, name: str, max_request_bytes: int) -> None:
        self._inner = inner
        self._name = name
        self._max_request_bytes = max_request_bytes
        self._lock = threading.Lock()
        self.dropped = 0
        self.pending = 0
        """Spans queued for this exporter and not yet handed to it (kept by its processor)."""
        self.sending = 0
        """Spans handed to this exporter whose request has not been answered yet."""
        self._gave_up = False
        """Set by `give_up`, which counted every unsent span as dropped: no later loss is counted again."""
        self._answer = threading.local()
        """What the calling thread's last request got (`watch`) that the inner exporter does not read: `redirect`, a
        3xx (which it takes for a delivery); `rejected`, an OTLP partial success."""
        self._credentials = ""
        """The settings that set the `Authorization` header the inner exporter sends, named when a receiver refuses it
        (given by `watch`, which alone reads the answers)."""

    def _drop(self, n: int, answered: int = 0) -> int:
        """Count `n` spans as dropped and `answered` spans as no longer sending, at once (so `give_up`, which counts
        what is queued or sending, never counts a span twice); after `give_up`, count nothing. Returns the drops so
        far."""
        with self._lock:
            self.sending -= answered
            counted = 0 if self._gave_up else n
            self.dropped += counted
            dropped = self.dropped
        DROPPED_SPANS.add(counted)
        return dropped

    def give_up(self) -> int:
        """Count every span not sent yet (queued, or in a request not answered) as dropped, now: the exit hook's bound
        ran out. An export that ends later counts none of them again. Returns how many were counted."""
        with self._lock:
            lost = 0 if self._gave_up else self.pending + self.sending
            self._gave_up = True
            self.dropped += lost
        DROPPED_SPANS.add(lost)
        return lost

    def watch(self, session: requests.Session, credentials: str) -> None:
        """Read the answers the inner exporter gets on `session`, which it leaves unread: the spans a 200 reports
        rejected (an OTLP partial success, not to be retried) or a 3xx leaves undelivered (it follows no redirect,
        yet takes one for a delivery) are counted as dropped and logged (by `_export_request`), and a 413 is logged
        with the setting that avoids it, a 401 or 403 with `credentials`, the settings that set the key it sent."""
        self._credentials = credentials
        session.hooks["response"].append(self._read_answer)

    def _read_answer(self, response: requests.Response, *args: object, **kwargs: object) -> None:
        if 300 <= response.status_code < 400:
            self._answer.redirect = response.status_code
        elif response.status_code == 413:
            _logger.warning(
                "art_langgraph: %s refused a request as too large (413); lower ART_MAX_EXPORT_BYTES (now %d) under "
                "its body limit (the collector's: ART_COLLECTOR_MAX_BODY_BYTES)", self._name, self._max_request_bytes,
            )
        elif response.status_code in (401, 403):
            _logger.warning(
                "art_langgraph: %s refused the spans as unauthorized (%d); check the key sent: %s",
                self._name, response.status_code, self._credentials,
            )
        elif response.status_code == 200 and "protobuf" in response.headers.get("Content-Type", ""):
            self._answer.rejected = self._partial_success(response.content)

    def _partial_success(self, answer: bytes) -> ExportTracePartialSuccess | None:
        """What an OTLP answer reports rejected; None, logged, when it cannot be read."""
        try:
            return ExportTraceServiceResponse.FromString(answer).partial_success
        except DecodeError as exc:  # a hook must not raise: the exporter would take the delivered spans as failed
            _logger.warning("art_langgraph: %s answered 200 with an unreadable OTLP body (%s)", self._name, exc)
            return None

    def admit(self, max_queue_size: int) -> bool:
        """Count one span queued for export, or, with `max_queue_size` already queued, dropped.

        A drop is logged for the first span and every 1000th. Returns whether the span was queued.
        """
        with self._lock:
            if self.pending < max_queue_size:
                self.pending += 1
                return True
            self.dropped += 1
            dropped = self.dropped
        DROPPED_SPANS.add(1)
        if dropped == 1 or dropped % 1000 == 0:
            _logger.warning(
                "art_langgraph: %s export queue full; dropping spans (%d dropped so far)", self._name, dropped
            )
        return False

    def drop_pending(self) -> None:
        """Count the spans still queued as dropped, and log them: their processor stopped without exporting them."""
        with self._lock:
            lost, self.pending = self.pending, 0
        if lost:
            self._drop(lost)
            _logger.warning("art_langgraph: %s export stopped with %d spans still queued; dropped", self._name, lost)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export `spans` in requests of at most `ART_MAX_EXPORT_BYTES` (`size_bounded`); FAILURE if any failed."""
        with self._lock:
            self.pending = max(0, self.pending - len(spans))
            self.sending += len(spans)
        unanswered = len(spans)
        try:
            results = []
            for part in self._requests(spans):
                self._warn_if_past_bound(part)
                results.append(self._export_request(part))
                unanswered -= len(part)
            return SpanExportResult.SUCCESS if all(results) else SpanExportResult.FAILURE
        finally:
            if unanswered:  # cutting the requests raised
                self._drop(0, answered=unanswered)

    def _warn_if_past_bound(self, part: Sequence[ReadableSpan]) -> None:
        if len(part) == 1 and (bound := size_bound(part[0]) + REQUEST_BYTES) > self._max_request_bytes:
            _logger.warning(
                "art_langgraph: a span of up to %d bytes is past ART_MAX_EXPORT_BYTES=%d; sent alone, %s may "
                "refuse it (raise its body limit, e.g. ART_COLLECTOR_MAX_BODY_BYTES, and this one)",
                bound, self._max_request_bytes, self._name,
            )

    def _requests(self, spans: Sequence[ReadableSpan]) -> list[Sequence[ReadableSpan]]:
        """`spans` cut into requests (`size_bounded`), any text UTF-8 cannot encode replaced first (`_utf8_span`).

        Sizing encodes every string a request carries, so it finds such text before protobuf, which would refuse
        the whole request.
        """
        try:
            return list(size_bounded(spans, self._max_request_bytes))
        except UnicodeEncodeError as exc:
            _logger.warning(
                "art_langgraph: spans for %s hold text that is not valid Unicode (%s); each such character is sent as "
                "U+FFFD", self._name, exc.reason,
            )
            return list(size_bounded([_utf8_span(span) for span in spans], self._max_request_bytes))

    def _export_request(self, spans: Sequence[ReadableSpan]) -> bool:
        """Send one request; True when it was delivered (spans the receiver reports rejected are counted and logged
        as dropped), else its spans are counted and logged as dropped."""
        self._answer.redirect = self._answer.rejected = None
        try:
            result = self._inner.export(spans)
        except Exception:  # an exporter must not raise; log with traceback and count
            _logger.exception("art_langgraph: %s exporter raised; dropped %d spans", self._name, len(spans))
            self._drop(len(spans), answered=len(spans))
            return False
        if result is not SpanExportResult.SUCCESS:
            dropped = self._drop(len(spans), answered=len(spans))
            _logger.warning(
                "art_langgraph: could not export %d spans to %s (%d dropped so far)", len(spans), self._name, dropped,
            )
            return False
        if self._answer.redirect is not None:
            self._drop(len(spans), answered=len(spans))
            _logger.warning(
                "art_langgraph: %s answered %d, a redirect, which is not followed; dropped %d spans: set its URL to "
                "the one it redirects to", self._name, self._answer.redirect, len(spans),
            )
            return False
        rejected = self._answer.rejected
        dropped = self._drop(rejected.rejected_spans if rejected else 0, answered=len(spans))
        if rejected and rejected.rejected_spans:
            _logger.warning(
                "art_langgraph: %s rejected %d spans: %s (%d dropped so far)",
                self._name, rejected.rejected_spans, rejected.error_message or "no reason given", dropped,
            )
        return True

    def shutdown(self) -> None:
        try:
            self._inner.shutdown()
        except Exception:
            _logger.exception("art_langgraph: %s exporter failed to shut down", self._name)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)




class BoundedProcessor(BatchSpanProcessor):
    """`BatchSpanProcessor` that refuses spans past `max_queue_size` and counts them as dropped.

    The SDK's processor would also drop them, with one warning per span; here the drop is
    counted on the exporter (so `dropped_spans()` sees it) and logged once per 1000.
    """

    def __init__(self, exporter: CountingExporter, max_queue_size: int) -> None:
        super().__init__(exporter, max_queue_size=max_queue_size, max_export_batch_size=min(512, max_queue_size))
        self.counting = exporter
        self._max = max_queue_size

    def on_end(self, span: ReadableSpan) -> None:
        if self.counting.admit(self._max):
            super().on_end(span)

    def shutdown(self) -> None:
        """Export what is queued, then count as dropped what is left: the SDK gives up after 30 s (a stalled
        collector) and leaves the rest of its queue unexported."""
        super().shutdown()
        self.counting.drop_pending()


class HeldProcessor(SpanProcessor):
    """Holds ended spans until flushed: the processor of a pipeline configured where no thread can start.

    That is at exit from Python 3.12 (a process's first span made in an atexit handler), where
    `BatchSpanProcessor` cannot start its worker. The plugin's exit hook, which runs after every
    atexit handler registered after `import art_langgraph`, or the app's `flush()`, exports the
    held spans through `run_bounded`, on the spare thread kept for exit.
    """

    def __init__(self, exporter: CountingExporter, max_queue_size: int) -> None:
        self.counting = exporter
        self._max = max_queue_size
        self._lock = threading.Lock()
        self._spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        if self.counting.admit(self._max):
            with self._lock:
                self._spans.append(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export the held spans in the calling thread (callers bound the wait with `run_bounded`)."""
        with self._lock:
            spans, self._spans = self._spans, []
        return not spans or self.counting.export(spans) is SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.force_flush()
        self.counting.shutdown()


Processor = BoundedProcessor | HeldProcessor


def export_processors(exporters: list[CountingExporter], max_queue_size: int) -> list[Processor]:
    """A batch processor per exporter or, where no thread can start (at exit, Python 3.12), a held one."""
    try:
        return [BoundedProcessor(exporter, max_queue_size) for exporter in exporters]
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        return [HeldProcessor(exporter, max_queue_size) for exporter in exporters]


