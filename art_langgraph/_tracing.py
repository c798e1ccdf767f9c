"""The plugin's own OpenTelemetry pipeline: a private tracer provider exporting OTLP/HTTP.

The provider is private so that an application's global tracer provider is never replaced.
Exports run in a background thread (`BatchSpanProcessor`); a collector that is down costs
log lines and counted drops, never an exception in the agent. A pipeline first needed at exit,
where no thread can start, holds its spans for the exit hook instead (`HeldProcessor`), and takes
the resource detected at import, where no detector can run (`_resource`). Flushing and stopping the pipelines, and
the exit and after-fork hooks, are `_pipelines`'s.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import requests
from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Span, Tracer

from art_langgraph import _pipelines
from art_langgraph._bounded import run_bounded, spare_thread
from art_langgraph._checks import check_count
from art_langgraph._collector_client import SendAuthorization
from art_langgraph._counts import DROPPED_SPANS
from art_langgraph._export_queue import CountingExporter, export_processors
from art_langgraph._pipelines import flush, shutdown
from art_langgraph._settings import TRACES_PATH, Settings, get_settings, update_settings

__all__ = [
    "configure",
    "dropped_spans",
    "flush",
    "get_tracer",
    "get_tracer_provider",
    "shutdown",
    "span_name",
    "start_root_span",
]

_logger = logging.getLogger(__name__)

_COMPRESSION_ENV = ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")


_CREDENTIAL_PROVIDER_ENV = (
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER",
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
)
_MakeExporter = Callable[[requests.Session | None], OTLPSpanExporter]


def _counting(name: str, make: _MakeExporter, settings: Settings, credentials: str) -> CountingExporter:
    """`make(session)`'s exporter, counted, its answers read (`CountingExporter.watch`, a refusal naming
    `credentials`) on a session of ours, except where a credential provider variable gives the exporter a session of
    its own, which ours would replace."""
    session = None if any(os.environ.get(v) for v in _CREDENTIAL_PROVIDER_ENV) else requests.Session()
    counting = CountingExporter(make(session), name, settings.max_export_bytes)
    if session is not None:
        counting.watch(session, credentials)
    return counting


_COLLECTOR_CREDENTIALS = (
    "ART_API_KEY (or configure(api_key=...)); with neither, the Authorization header of "
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS, or else OTEL_EXPORTER_OTLP_HEADERS"
)
"""What sets the `Authorization` header `_otlp_exporter` sends, and late rewards too (`collector_authorization`)."""


def _sending(authorization: str, session: requests.Session | None) -> dict[str, str]:
    """The exporter's headers that send `authorization`, which `session` (where the exporter is given ours) then sends
    as given (`SendAuthorization`): a netrc entry for the receiver's host, or a user and password in its URL, put
    Basic auth in its place."""
    if session is not None:
        session.auth = SendAuthorization(authorization)
    return {"Authorization": authorization}


def _otlp_exporter(settings: Settings, session: requests.Session | None) -> OTLPSpanExporter:
    endpoint = f"{settings.collector_url.rstrip('/')}{TRACES_PATH}" if settings.collector_url else None
    authorization = settings.collector_authorization
    headers = _sending(authorization, session) if authorization else None
    compression = None if any(os.environ.get(v) for v in _COMPRESSION_ENV) else Compression.Gzip
    # endpoint=None lets OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT decide (default localhost:4318).
    return OTLPSpanExporter(endpoint=endpoint, headers=headers, compression=compression, session=session)


LANGFUSE_DEFAULT_URL = "https://cloud.langfuse.com"
LANGFUSE_OTLP_PATH = "/api/public/otel/v1/traces"
"""Langfuse's OTLP/HTTP traces endpoint under its base URL."""
_LANGFUSE_CREDENTIALS = "LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY"
"""What sets the `Authorization` header `_langfuse_exporter` sends, in place of the OTLP headers variables' one."""


def _langfuse_exporter(session: requests.Session | None) -> OTLPSpanExporter:
    public, secret = os.environ.get("LANGFUSE_PUBLIC_KEY"), os.environ.get("LANGFUSE_SECRET_KEY")
    if not public or not secret:
        raise ValueError(
            "configure(langfuse=True) needs LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY in the environment "
            f"(and LANGFUSE_BASE_URL or LANGFUSE_HOST unless it is {LANGFUSE_DEFAULT_URL})."
        )
    base = os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST") or LANGFUSE_DEFAULT_URL
    token = base64.b64encode(f"{public}:{secret}".encode()).decode()
    return OTLPSpanExporter(
        endpoint=f"{base.rstrip('/')}{LANGFUSE_OTLP_PATH}",
        headers=_sending(f"Basic {token}", session),
        compression=Compression.Gzip,
        session=session,
    )


def _detect_resource() -> Resource:
    """What `Resource.create` finds now (SDK defaults, `OTEL_RESOURCE_ATTRIBUTES`); empty if imported at exit."""
    try:
        return Resource.create()
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        _logger.warning(
            "art_langgraph: imported at exit, where no resource detector can run; spans carry service.name alone"
        )
        return Resource.get_empty()


_DETECTED_AT_IMPORT = _detect_resource()
"""The detected resource, for a pipeline configured at exit, where `Resource.create`'s detector thread pool refuses
work (any Python version)."""


def _resource() -> Resource:
    """The spans' resource: the detected one with our `service.name`, the same whether configured at exit or before."""
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", "art-langgraph")}
    try:
        return Resource.create(attributes)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return _DETECTED_AT_IMPORT.merge(Resource(attributes))


_SPAN_LIMITS = SpanLimits(
    max_events=SpanLimits.UNSET,
    max_span_attributes=SpanLimits.UNSET,
    max_event_attributes=SpanLimits.UNSET,
    max_attribute_length=SpanLimits.UNSET,
    max_span_attribute_length=SpanLimits.UNSET,
)
"""No cut in what a span carries: the app's `OTEL_*_LIMIT` variables, meant for its own spans, would truncate the
messages' JSON (the collector could no longer read it), evict attributes and drop reward events."""


_root_trace_id: ContextVar[int | None] = ContextVar("art_langgraph_root_trace_id", default=None)
"""The trace id `start_root_span` asks of `_UnseededIds` for the root span it is starting; None for a random one."""


class _UnseededIds(IdGenerator):
    """Trace and span ids from the operating system's randomness, not Python's `random` (the SDK's default): an app
    that seeds `random` alike for each rollout (to replay a task) gave its rollouts the same ids, and the collector
    keeps one span per trace id and span id. A root span `start_root_span` starts in a given trace gets that
    trace's id."""

    def generate_span_id(self) -> int:
        return _nonzero(64)

    def generate_trace_id(self) -> int:
        return _root_trace_id.get() or _nonzero(128)


def _nonzero(bits: int) -> int:
    """A random nonzero integer of `bits` bits (zero is OpenTelemetry's invalid id)."""
    value = 0
    while value == 0:
        value = secrets.randbits(bits)
    return value


class _ToCurrentPipeline(SpanProcessor):
    """Every provider's way out: an ended span goes to the export processors current when it ends.

    A span started before `configure` was called again (a rollout in flight) ends after the
    pipeline it started on was shut down; the new pipeline exports it instead of it being lost.
    With no pipeline (a forked child, or after `shutdown()`), the span configures one, as a
    first span would. The hand-over holds the lock that replacing the pipeline takes: a span
    handed to the old one is in its queue before it is shut down (which exports the queue).
    """

    def on_end(self, span: ReadableSpan) -> None:
        with _pipelines._lock:
            for processor in (_pipelines._state or _current()).processors:
                processor.on_end(span)


_TO_CURRENT = _ToCurrentPipeline()


def configure(
    collector_url: str | None = None,
    trainer_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    langfuse: bool | None = None,
    max_queue_size: int | None = None,
) -> None:
    """Set up tracing and the default trainer endpoint; arguments override `ART_*` variables.

    Calling it again replaces the previous pipeline (which is flushed, bounded, and shut down);
    spans in flight then (a rollout still running) go out through the new one when they end.
    Without a call, the first span configures everything from the environment.

    Args:
        collector_url: Collector base URL; spans go to `{collector_url}/v1/traces`.
        trainer_url: OpenAI-compatible base URL of the trainer, used by new `ARTChatModel`s.
        model: Default model name for new `ARTChatModel`s.
        api_key: Bearer token for the trainer and the collector.
        langfuse: Also send every span, with the same trace id, to Langfuse's OTLP endpoint
            `{LANGFUSE_BASE_URL}/api/public/otel/v1/traces` (Basic auth from
            `LANGFUSE_PUBLIC_KEY` / `LANGFUSE_SECRET_KEY`; `LANGFUSE_HOST` is read too).
            `ART_LANGFUSE=true` does the same without code; `False` turns it off whatever
            `ART_LANGFUSE` says, None (the default) leaves it to `ART_LANGFUSE`.
        max_queue_size: Spans held per destination while waiting for export (default
            `ART_MAX_QUEUE_SIZE`, 2048); past it, spans are dropped, counted and logged.

    Raises:
        ValueError: `langfuse=True` without Langfuse keys in the environment, or `max_queue_size` out of 1 to
            `sys.maxsize`.
        TypeError: `max_queue_size` is not an integer (a bool or a float is no queue size).
    """
    check_count(max_queue_size, "configure's max_queue_size", sys.maxsize)
    settings = update_settings(
        collector_url=collector_url,
        trainer_url=trainer_url,
        model=model,
        api_key=api_key,
        langfuse=langfuse,
        max_queue_size=max_queue_size,
    )
    exporters = [
        _counting("collector", lambda session: _otlp_exporter(settings, session), settings, _COLLECTOR_CREDENTIALS)
    ]
    if settings.langfuse:
        exporters.append(_counting("langfuse", _langfuse_exporter, settings, _LANGFUSE_CREDENTIALS))
    provider = TracerProvider(
        resource=_resource(),
        # Every span is training data: neither OTEL_TRACES_SAMPLER nor a parent the app sampled out drops one.
        sampler=ALWAYS_ON,
        span_limits=_SPAN_LIMITS,
        id_generator=_UnseededIds(),
        shutdown_on_exit=False,  # our own exit hook (`_pipelines._flush_at_exit`) flushes with a bound
    )
    provider.add_span_processor(_TO_CURRENT)
    state = _pipelines._State(provider, export_processors(exporters, settings.max_queue_size))
    if (old := _pipelines._replace(state)) is not None:
        run_bounded(old.shutdown, timeout=5.0)


def _current() -> _pipelines._State:
    with _pipelines._lock:
        if _pipelines._state is None:
            if _pipelines._exit_hook_ran:
                _logger.warning(
                    "art_langgraph: tracing started after its exit hook ran (in an atexit handler registered before "
                    "`import art_langgraph`); those spans are exported only if that handler calls art_langgraph.flush()"
                )
            settings = get_settings()
            configure(
                collector_url=settings.collector_url,
                trainer_url=settings.trainer_url,
                model=settings.model,
                api_key=settings.api_key,
                langfuse=settings.langfuse,
                max_queue_size=settings.max_queue_size,
            )
        assert _pipelines._state is not None
        return _pipelines._state


def get_tracer_provider() -> TracerProvider:
    """Return the plugin's private tracer provider (configuring from env on first use).

    Tests add processors to it, e.g. a `SimpleSpanProcessor(InMemorySpanExporter())`.
    """
    return _current().provider


def get_tracer() -> Tracer:
    """Return the tracer all plugin spans are created with."""
    return _current().tracer


def start_root_span(name: str, attributes: dict[str, Any], trace_id: int | None = None) -> Span:
    """Start a span with no parent, whatever span the app has open: in the trace `trace_id` when it is given and
    nonzero (every part of a graph run resumed with its `run_id` is then one trace), else in a new random one."""
    token = _root_trace_id.set(trace_id)
    try:
        return get_tracer().start_span(name, context=otel_context.Context(), attributes=attributes)
    finally:
        _root_trace_id.reset(token)


def span_name(operation: str, name: str) -> str:
    """The name of a span of `operation` on `name` (a node, a tool, a model), each NUL in it as U+FFFD: the collector
    rejects a span whose name holds one (its store's text columns cannot hold it), which lost the node's or tool's
    span; the name's attribute (`art.node.name`, `gen_ai.tool.name`) keeps it as it is."""
    return f"{operation} {name}".replace("\x00", "\ufffd")


def dropped_spans() -> int:
    """Number of spans lost so far (queue full, export failed), by this pipeline and those replaced or shut down."""
    return DROPPED_SPANS.value


spare_thread.arm()
