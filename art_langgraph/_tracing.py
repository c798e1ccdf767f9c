"""The plugin's own OpenTelemetry pipeline: a private tracer provider exporting OTLP/HTTP.

The provider is private so that an application's global tracer provider is never replaced.
Exports run in a background thread (`BatchSpanProcessor`); a collector that is down costs
log lines and counted drops, never an exception in the agent. A pipeline first needed at exit,
where no thread can start, holds its spans for the exit hook instead (`HeldProcessor`), and takes
the resource detected at import, where no detector can run (`_resource`).
"""

from __future__ import annotations

import atexit
import base64
import logging
import os
import secrets
import sys
import threading
import time
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

from art_langgraph._bounded import Coalesced, run_bounded, spare_thread
from art_langgraph._checks import check_count, check_timeout
from art_langgraph._counts import DROPPED_SPANS, ProcessLock, renew_after_fork
from art_langgraph._export_queue import CountingExporter, Processor, export_processors
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

_INSTRUMENTATION_NAME = "art_langgraph"
_COMPRESSION_ENV = ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")


_CREDENTIAL_PROVIDER_ENV = (
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER",
    "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
)
_MakeExporter = Callable[[requests.Session | None], OTLPSpanExporter]


def _counting(name: str, make: _MakeExporter, settings: Settings) -> CountingExporter:
    """`make(session)`'s exporter, counted, its answers read (`CountingExporter.watch`) on a session of ours, except
    where a credential provider variable gives the exporter a session of its own, which ours would replace."""
    session = None if any(os.environ.get(v) for v in _CREDENTIAL_PROVIDER_ENV) else requests.Session()
    counting = CountingExporter(make(session), name, settings.max_export_bytes)
    if session is not None:
        counting.watch(session)
    return counting


def _otlp_exporter(settings: Settings, session: requests.Session | None) -> OTLPSpanExporter:
    endpoint = f"{settings.collector_url.rstrip('/')}{TRACES_PATH}" if settings.collector_url else None
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
    compression = None if any(os.environ.get(v) for v in _COMPRESSION_ENV) else Compression.Gzip
    # endpoint=None lets OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT decide (default localhost:4318).
    return OTLPSpanExporter(endpoint=endpoint, headers=headers, compression=compression, session=session)


LANGFUSE_DEFAULT_URL = "https://cloud.langfuse.com"
LANGFUSE_OTLP_PATH = "/api/public/otel/v1/traces"
"""Langfuse's OTLP/HTTP traces endpoint under its base URL."""


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
        headers={"Authorization": f"Basic {token}"},
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
        with _lock:
            for processor in (_state or _current()).processors:
                processor.on_end(span)


_TO_CURRENT = _ToCurrentPipeline()


_FLUSH_MILLIS = int(threading.TIMEOUT_MAX * 1000)
"""The timeout a flush gives the processors: as long as a thread can wait (each `flush` call bounds its own wait)."""


class _State:
    """The configured pipeline: the provider spans start on, and the processors that export them."""

    def __init__(self, provider: TracerProvider, processors: list[Processor]) -> None:
        self.provider = provider
        self.processors = processors
        self.tracer = provider.get_tracer(_INSTRUMENTATION_NAME)
        self.flushing = Coalesced(self.force_flush)
        """`force_flush` for `flush`, on one thread however many flushes wait behind an export a collector is slow to
        answer."""
        self.stopped = threading.Event()
        """Set once `shutdown` has ended (or raised)."""

    def force_flush(self) -> bool:
        """Export every ended span: through the provider's own processors (tests add some), then ours."""
        flushed = self.provider.force_flush(_FLUSH_MILLIS)
        return all([flushed, *(p.force_flush(_FLUSH_MILLIS) for p in self.processors)])

    def shutdown(self) -> None:
        """Shut the provider down, then export what our processors hold and stop them."""
        try:
            self.provider.shutdown()
            for processor in self.processors:
                processor.shutdown()
        finally:
            self.stopped.set()

    def unsent(self) -> int:
        """The spans our exporters have not sent yet: queued, or in a request not answered (one the SDK's shutdown,
        which waits 30 s for it, left behind)."""
        return sum(processor.counting.pending + processor.counting.sending for processor in self.processors)

    def give_up(self) -> int:
        """Count the spans our exporters have not sent yet (queued, or in a request not answered) as dropped, now;
        how many."""
        return sum(processor.counting.give_up() for processor in self.processors)


_lock = ProcessLock(reentrant=True)
"""Guards `_state`; reentrant, as `_current` configures a pipeline under it."""
_state: _State | None = None
_stopping: list[_State] = []
"""Pipelines `configure` or `shutdown` replaced, while their shutdown may still be exporting (their callers' waits are
bounded; the SDK waits 30 s for a stalled collector) or their exporters still hold spans (a request that shutdown left
unanswered): `flush` waits for their shutdown too, and the exit hook gives up on them as on the current one."""
_exit_hook_ran = False


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
    global _state
    check_count(max_queue_size, "configure's max_queue_size", sys.maxsize)
    settings = update_settings(
        collector_url=collector_url,
        trainer_url=trainer_url,
        model=model,
        api_key=api_key,
        langfuse=langfuse,
        max_queue_size=max_queue_size,
    )
    exporters = [_counting("collector", lambda session: _otlp_exporter(settings, session), settings)]
    if settings.langfuse:
        exporters.append(_counting("langfuse", _langfuse_exporter, settings))
    provider = TracerProvider(
        resource=_resource(),
        # Every span is training data: neither OTEL_TRACES_SAMPLER nor a parent the app sampled out drops one.
        sampler=ALWAYS_ON,
        span_limits=_SPAN_LIMITS,
        id_generator=_UnseededIds(),
        shutdown_on_exit=False,  # our own exit hook (`_flush_at_exit`) flushes with a bound
    )
    provider.add_span_processor(_TO_CURRENT)
    state = _State(provider, export_processors(exporters, settings.max_queue_size))
    if (old := _replace(state)) is not None:
        run_bounded(old.shutdown, timeout=5.0)


def _current() -> _State:
    with _lock:
        if _state is None:
            if _exit_hook_ran:
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
        assert _state is not None
        return _state


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


def flush(timeout: float = 5.0) -> bool:
    """Export every finished span now, waiting at most `timeout` seconds.

    That includes the spans of a pipeline `configure` or `shutdown` stopped whose export is still under way (a slow
    collector). Calls made while a flush waits on the collector are served together, by one thread. It works from the
    application's own atexit handlers too (see `run_bounded`).

    Args:
        timeout: Upper bound on the wait, in seconds: 0 or more, `math.inf` to wait as long as a thread can.

    Returns:
        True if everything was handed to the exporters in time, False otherwise; a failed export never raises.

    Raises:
        ValueError: `timeout` is NaN or negative.
        TypeError: `timeout` is not a number (a bool is none).
    """
    timeout = check_timeout(timeout, "flush's timeout")
    started = time.monotonic()
    with _lock:
        state, stopping = _state, list(_stopping)
    flushed = state is None or state.flushing.run_bounded(timeout)
    return flushed and _wait_stopped(stopping, timeout - (time.monotonic() - started))


def _replace(state: _State | None) -> _State | None:
    """Make `state` the current pipeline (None: none, the next span configures one) and return the one it replaces,
    which joins the `_stopping` pipelines under the same lock (its shutdown is the caller's): a `flush` in between
    saw it in neither place and returned True with its spans still queued."""
    global _state, _stopping
    with _lock:
        old, _state = _state, state
        if old is not None:
            _stopping = [*(s for s in _stopping if not s.stopped.is_set() or s.unsent()), old]
    return old


def _wait_stopped(states: list[_State], timeout: float) -> bool:
    """Wait at most `timeout` seconds in all for the shutdown of each of `states` to end; whether every one did."""
    end = time.monotonic() + min(max(timeout, 0.0), threading.TIMEOUT_MAX)
    return all(state.stopped.wait(max(end - time.monotonic(), 0.0)) for state in states)


def shutdown(timeout: float = 5.0) -> None:
    """Flush and stop the pipeline (bounded, atexit handlers included); the next span configures a new one.

    Raises:
        ValueError: `timeout` is NaN or negative (the pipeline is kept).
        TypeError: `timeout` is not a number (a bool is none).
    """
    timeout = check_timeout(timeout, "shutdown's timeout")
    if (state := _replace(None)) is not None:
        run_bounded(state.shutdown, timeout)


def _flush_at_exit() -> None:
    """The exit hook: exports what is left, the current pipeline's and the stopping ones' (`_stopping`), waiting at
    most `ART_EXIT_FLUSH_TIMEOUT` seconds in all, and counts as dropped and logs the spans still unsent when it gave up
    (a failed shutdown is logged by `run_bounded`).

    The shutdowns it gave up on may still end while the process exits; they count none of those spans again, and one
    they deliver then stays counted.
    """
    global _exit_hook_ran, _stopping
    _exit_hook_ran = True
    if (state := _replace(None)) is None and not _stopping:
        return
    started = time.monotonic()
    timeout = get_settings().exit_flush_timeout
    if state is not None:
        run_bounded(state.shutdown, timeout)
    with _lock:
        stopping, _stopping = _stopping, []
    _wait_stopped(stopping, timeout - (time.monotonic() - started))
    # every pipeline's, those whose shutdown ended too: the SDK's ends after 30 s with a request still unanswered
    if lost := sum(old.give_up() for old in stopping):
        _logger.warning(
            "art_langgraph: %d spans were still unsent when ART_EXIT_FLUSH_TIMEOUT (%g s) ran out at exit; they are "
            "lost: raise ART_EXIT_FLUSH_TIMEOUT if the collector is slow to answer",
            lost,
            timeout,
        )


def _after_fork_in_child() -> None:
    """Give a forked child its own spare thread now, and its own pipeline at its first span (or span end).

    The parent's exporters hold the parent's HTTP connections, on which the child would write
    too, and count the spans queued in the parent, which the child's queues do not hold. The
    locks are new too, every `_counts.ProcessLock` (the pipeline's, the counts', the settings', the once-only
    warnings'): a thread of the parent may have held one (configuring at a first span, counting a loss, reading the
    settings), and in the child no thread would ever release it.
    """
    global _state, _stopping
    _state = None
    _stopping = []
    renew_after_fork()
    spare_thread.after_fork()


spare_thread.arm()
atexit.register(_flush_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
