"""Tracing pipeline: private provider, OTLP/HTTP protobuf+gzip to the collector, never raises."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from pydantic import ValidationError

import art_langgraph
from art_langgraph import ARTChatModel, _pipelines, _tracing, rollout, semconv
from art_langgraph._export_queue import CountingExporter
from art_langgraph._settings import MAX_OTLP_REQUEST_BYTES, Settings, update_settings
from tests.art_langgraph.fake_engine import FakeEngine, completion_ids
from tests.art_langgraph.otlp_receiver import Receiver


def test_spans_reach_collector_as_gzip_protobuf(receivers) -> None:
    collector, _ = receivers
    art_langgraph.configure(collector_url=collector.url, api_key="k1")
    with rollout("export") as r:
        r.reward(1.0)
    assert art_langgraph.flush(timeout=10)
    path, headers, _ = collector.requests[-1]
    assert path == "/v1/traces"
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["content-encoding"] == "gzip"
    assert headers["authorization"] == "Bearer k1"
    (span,) = collector.spans()
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs[semconv.ROLLOUT_ID].string_value == r.id
    assert span.trace_id.hex() == r.trace_id
    assert span.events[0].name == semconv.REWARD_EVENT


@pytest.mark.parametrize(("given", "sent"), [(" k1\n", "Bearer k1"), ("  ", None)])
def test_the_key_is_sent_without_surrounding_whitespace(receivers, given: str, sent: str | None) -> None:
    """A key ending in a newline (`ART_API_KEY=$(cat key)`) made httpx refuse the header: every export failed."""
    collector, _ = receivers
    art_langgraph.configure(collector_url=collector.url, api_key=given)
    with rollout("export") as r:
        r.reward(1.0)
    assert art_langgraph.flush(timeout=10)
    path, headers, _ = collector.requests[-1]
    assert path == "/v1/traces" and headers.get("authorization") == sent


def test_a_key_that_is_not_ascii_is_refused(monkeypatch) -> None:
    """httpx refuses to send a header value that is not ASCII: every export and reward would have failed."""
    monkeypatch.setenv("ART_API_KEY", "clé")
    with pytest.raises(ValidationError, match="ART_API_KEY must be ASCII"):
        update_settings()


def test_global_tracer_provider_is_not_replaced(memory_tracing) -> None:
    before = trace.get_tracer_provider()
    memory_tracing.install()
    assert trace.get_tracer_provider() is before
    assert _tracing.get_tracer_provider() is not before


@pytest.fixture
def app_environment(memory_tracing, monkeypatch) -> Iterator:
    """`set(**variables)`: the app's `OTEL_*` settings (meant for its own provider), then the pipeline rebuilt."""

    def install(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        memory_tracing.install()

    yield install
    monkeypatch.undo()
    memory_tracing.install()


def test_the_apps_sampling_drops_no_span(memory_tracing, app_environment) -> None:
    """`OTEL_TRACES_SAMPLER` and a request span the app sampled out are the app's choice; training data keeps all."""
    app_environment(OTEL_TRACES_SAMPLER="always_off")
    app_tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("app")
    with app_tracer.start_as_current_span("GET /chat"):
        FakeEngine().chat_model().invoke("hi")  # a model call outside any rollout, in the app's trace
        with rollout("sampled"):
            pass
    kinds = sorted(s.attributes[semconv.SPAN_KIND] for s in memory_tracing.exporter.get_finished_spans())
    assert kinds == [semconv.SPAN_KIND_LLM, semconv.SPAN_KIND_ROLLOUT]


def test_rollouts_of_an_app_that_seeds_random_alike_get_their_own_ids(memory_tracing) -> None:
    """The SDK draws ids from `random`: an app seeding it alike per rollout (to replay a task) gave every rollout the
    same trace and span ids, and the collector keeps one span per id, so all but one rollout were lost."""
    memory_tracing.exporter.clear()
    for name in ("first", "second"):
        random.seed(7)
        with rollout(name):
            FakeEngine().chat_model().invoke("hi")
    finished = memory_tracing.exporter.get_finished_spans()
    assert len(finished) == 4
    assert len({s.context.span_id for s in finished}) == 4 and len({s.context.trace_id for s in finished}) == 2


def test_the_apps_span_limits_cut_nothing(memory_tracing, app_environment) -> None:
    """Limits the app sets for its spans would truncate the messages' JSON, evict attributes and drop rewards."""
    app_environment(
        OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT="8", OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT="2", OTEL_SPAN_EVENT_COUNT_LIMIT="1"
    )
    with rollout("limited") as run:
        FakeEngine().chat_model().invoke("a question longer than eight characters")
        run.reward(1.0, name="correct")
        run.reward(0.5, name="short")
    by_kind = {s.attributes[semconv.SPAN_KIND]: s for s in memory_tracing.exporter.get_finished_spans()}
    llm = by_kind[semconv.SPAN_KIND_LLM].attributes
    assert json.loads(llm[semconv.GEN_AI_INPUT_MESSAGES])[0]["content"] == "a question longer than eight characters"
    assert list(llm[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(0)
    assert len(by_kind[semconv.SPAN_KIND_ROLLOUT].events) == 2


def test_down_collector_never_raises(memory_tracing, dead_url, chat_model: ARTChatModel) -> None:
    art_langgraph.configure(collector_url=dead_url)
    try:
        dropped = _tracing.dropped_spans()
        with rollout("offline") as r:
            chat_model.invoke("Hello?")
            r.reward(1.0)
        start = time.monotonic()
        art_langgraph.flush(timeout=3)  # bounded even though every export fails
        assert time.monotonic() - start < 4
        deadline = time.monotonic() + 10
        while _tracing.dropped_spans() == dropped and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tracing.dropped_spans() >= dropped + 2
    finally:
        memory_tracing.install()


def test_flush_with_an_infinite_timeout_flushes(receivers) -> None:
    """`flush(timeout=math.inf)`, to wait as long as it takes, failed at once (an `OverflowError` logged, nothing
    exported, False); it waits as long as a thread can."""
    collector, _ = receivers
    art_langgraph.configure(collector_url=collector.url)
    with rollout("flushed"):
        pass
    assert art_langgraph.flush(timeout=math.inf)
    assert len(collector.spans()) == 1


def test_flush_with_a_timeout_past_a_floats_range_waits_as_with_an_infinite_one(receivers) -> None:
    """`flush(timeout=10**400)` raised an `OverflowError` (`float()` of an int past a float's range) that its
    docstring does not name; such a timeout is longer than any wait, as `math.inf` is."""
    collector, _ = receivers
    art_langgraph.configure(collector_url=collector.url)
    with rollout("flushed"):
        pass
    assert art_langgraph.flush(timeout=10**400)
    assert len(collector.spans()) == 1


def _held_until(answer: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every OTLP export waits for `answer` before it is sent: a collector that has not answered yet."""
    send = OTLPSpanExporter.export
    monkeypatch.setattr(OTLPSpanExporter, "export", lambda self, spans: answer.wait() and send(self, spans))


def _one_rollout_held(
    receivers: tuple[Receiver, Receiver], monkeypatch: pytest.MonkeyPatch
) -> tuple[Receiver, threading.Event]:
    """A pipeline to `receivers`' collector holding one ended rollout, `rollout stopped`, whose export waits for the
    event returned (`_held_until`); and that collector."""
    collector, _ = receivers
    answer = threading.Event()
    _held_until(answer, monkeypatch)
    art_langgraph.configure(collector_url=collector.url)
    with rollout("stopped"):
        pass
    return collector, answer


def _stop_pipeline(stop: str, collector_url: str) -> None:
    """Stop the pipeline as `stop` says: `shutdown` (waiting 0.1 s) or `configure` (a new one)."""
    if stop == "shutdown":
        art_langgraph.shutdown(timeout=0.1)
    else:
        art_langgraph.configure(collector_url=collector_url)


@pytest.mark.parametrize("stop", ["shutdown", "configure"])
def test_flush_waits_for_the_spans_of_a_pipeline_shutdown_or_configure_stopped(receivers, monkeypatch, stop) -> None:
    """`shutdown(timeout)` and `configure()` wait a bounded time for the pipeline they stop, whose export goes on when
    the collector is slow; `flush()` then flushed only the new pipeline and returned True with those spans unsent."""
    collector, answer = _one_rollout_held(receivers, monkeypatch)
    _stop_pipeline(stop, collector.url)
    assert not art_langgraph.flush(timeout=0.1)
    answer.set()
    assert art_langgraph.flush(timeout=10)
    assert [s.name for s in collector.spans()] == ["rollout stopped"]


def test_flushes_while_an_export_is_stuck_cost_one_thread(receivers, monkeypatch) -> None:
    """Each `flush(timeout)` ran the flush on a thread of its own, which waited behind the export a collector had not
    answered: an app that flushes after every request piled up a thread per request while the collector was down. The
    flushes asked for meanwhile are served together, by one run after the stuck one."""
    collector, _ = receivers
    answer = threading.Event()
    _held_until(answer, monkeypatch)
    art_langgraph.configure(collector_url=collector.url)
    before = set(threading.enumerate())
    for i in range(10):
        with rollout(f"request-{i}"):
            pass
        assert not art_langgraph.flush(timeout=0)
    flushing = [t for t in set(threading.enumerate()) - before if t.name == "art-langgraph-flush"]
    answer.set()
    assert len(flushing) == 1
    assert art_langgraph.flush(timeout=10)
    assert len(collector.spans()) == 10


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (math.nan, ValueError),
        (-1, ValueError),
        pytest.param(-(10**400), ValueError, id="-10**400"),
        pytest.param(-(10**5000), ValueError, id="-10**5000"),
        (True, TypeError),
        ("5", TypeError),
    ],
)
@pytest.mark.parametrize("call", ["flush", "shutdown"])
def test_a_timeout_that_is_no_wait_is_refused(memory_tracing, call: str, timeout: object, error: type) -> None:
    """`flush(math.nan)` returned False with a traceback logged from the export thread (`int(nan)`), `flush(-1)` gave
    up at once, and `shutdown` with either stopped the pipeline without waiting for its export; each is refused at
    the call, and the pipeline is kept (an int of more digits than `str` writes was refused by `str`, not the check)."""
    state = _pipelines._state
    with pytest.raises(error, match=f"{call}'s timeout must be"):
        getattr(art_langgraph, call)(timeout)
    assert _pipelines._state is state is not None


@pytest.mark.parametrize(("size", "error"), [(True, TypeError), (2.0, TypeError), ("8", TypeError), (0, ValueError)])
def test_configure_refuses_a_queue_size_that_is_no_count(memory_tracing, size: object, error: type) -> None:
    """`configure(max_queue_size=True)` was taken as a queue of 1 span (and 2.0 or "8" as whole numbers), as
    `gather(concurrency=True)` no longer is."""
    with pytest.raises(error, match="configure's max_queue_size must be"):
        art_langgraph.configure(collector_url=memory_tracing.collector_url, max_queue_size=size)  # type: ignore[arg-type]


def test_flush_is_bounded_and_exporter_errors_are_counted(memory_tracing) -> None:
    class Hanging(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            time.sleep(2)
            raise RuntimeError("exporter bug")

    counting = CountingExporter(Hanging(), "hanging", 1 << 20)
    _tracing.get_tracer_provider().add_span_processor(BatchSpanProcessor(counting))
    try:
        with rollout("slow"):
            pass
        start = time.monotonic()
        assert art_langgraph.flush(timeout=0.5) is False
        assert time.monotonic() - start < 1.5
        deadline = time.monotonic() + 15
        while counting.dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert counting.dropped == 1  # the exporter's exception was caught and counted
    finally:
        memory_tracing.install()  # replaces the provider that holds the hanging exporter


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_non_finite_exit_flush_timeout_is_refused(monkeypatch, value: str) -> None:
    """inf passed `ge=0`, and the exit hook's wait then raised OverflowError instead of flushing."""
    monkeypatch.setenv("ART_EXIT_FLUSH_TIMEOUT", value)
    with pytest.raises(ValidationError, match="exit_flush_timeout\n  Input should be a finite number"):
        update_settings()


def test_max_export_bytes_past_the_otlp_exporters_own_limit_is_refused(monkeypatch) -> None:
    """The OTLP exporter drops a request over 64 MiB unsent: with ART_MAX_EXPORT_BYTES=100 MiB a batch of 80 MiB
    was lost whole (counted, never sent), though the setting promised requests up to 100 MiB."""
    monkeypatch.setenv("ART_MAX_EXPORT_BYTES", str(MAX_OTLP_REQUEST_BYTES + 1))
    with pytest.raises(ValidationError, match="max_export_bytes\n  Input should be less than or equal to 67108864"):
        update_settings()
    monkeypatch.setenv("ART_MAX_EXPORT_BYTES", str(MAX_OTLP_REQUEST_BYTES))
    assert Settings().max_export_bytes == MAX_OTLP_REQUEST_BYTES


@pytest.mark.parametrize(
    ("variable", "value"), [("ART_COLLECTOR_URL", "localhost:4318"), ("ART_TRAINER_URL", "ftp://x")]
)
def test_a_url_that_is_not_http_is_refused(monkeypatch, variable: str, value: str) -> None:
    """`ART_COLLECTOR_URL=localhost:4318` (no scheme) was taken: every export failed ("No connection adapters"), each
    span dropped, and every late reward raised."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError, match=f"must be an http:// or https:// URL, got '{value}'"):
        update_settings()
    monkeypatch.setenv(variable, "HTTPS://collector.example:4318")
    assert Settings()


@pytest.mark.parametrize("value", ["http://", "https://:4318", "http:///v1"])
def test_a_url_without_a_host_is_refused(monkeypatch, value: str) -> None:
    """`configure(collector_url="http://")` was taken: every export failed ("No host supplied"), each span dropped,
    and every late reward raised."""
    for variable in ("ART_COLLECTOR_URL", "OTEL_EXPORTER_OTLP_ENDPOINT", "ART_TRAINER_URL"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(
        ValidationError,
        match=f"collector_url\n  Value error, must be an http:// or https:// URL with a host, got '{value}'",
    ):
        art_langgraph.configure(collector_url=value)
    with pytest.raises(
        ValidationError,
        match=f"trainer_url\n  Value error, must be an http:// or https:// URL with a host, got '{value}'",
    ):
        art_langgraph.configure(trainer_url=value)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", value)
    with pytest.raises(
        ValidationError,
        match=f"OTEL_EXPORTER_OTLP_ENDPOINT must be an http:// or https:// URL with a host, got '{value}'",
    ):
        Settings()


@pytest.mark.parametrize("stop", ["shutdown", "configure"])
def test_a_flush_at_any_step_of_a_stop_waits_for_the_stopped_pipelines_spans(receivers, monkeypatch, stop) -> None:
    """`configure()` and `shutdown()` detached the pipeline under the lock, then, once they had let it go, took it
    again to list the pipeline among those stopping: a flush in between saw it in neither place and returned True with
    its spans unsent. Here a flush runs each time the stopping thread lets the lock go."""
    collector, answer = _one_rollout_held(receivers, monkeypatch)
    lock, flushed, inside = _pipelines._lock, [], threading.local()

    class FlushingLock:
        """`_pipelines._lock`, flushing (bounded) each time the stopping thread lets it go."""

        def __enter__(self) -> None:
            lock.__enter__()
            inside.depth = getattr(inside, "depth", 0) + 1

        def __exit__(self, *exc_info: object) -> None:
            inside.depth -= 1
            lock.__exit__(*exc_info)
            if inside.depth == 0 and not getattr(inside, "flushing", False):
                inside.flushing = True
                flushed.append(art_langgraph.flush(timeout=0.1))
                inside.flushing = False

    monkeypatch.setattr(_pipelines, "_lock", FlushingLock())
    _stop_pipeline(stop, collector.url)
    monkeypatch.setattr(_pipelines, "_lock", lock)
    assert flushed and True not in flushed
    answer.set()
    assert art_langgraph.flush(timeout=10)
    assert [s.name for s in collector.spans()] == ["rollout stopped"]
