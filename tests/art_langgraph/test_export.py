"""Export: Langfuse fan-out with the same trace ids, retries, bounded queue, requests under the body limit
(exit, atexit and fork: test_export_lifecycle.py).

`Receiver` (tests/art_langgraph/otlp_receiver.py) is a local OTLP/HTTP endpoint. It stands in
for Langfuse's OTLP endpoint (`/api/public/otel/v1/traces`, Basic auth), which cannot run here,
and for a collector that fails or stalls.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
import time

import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer

import art_langgraph
from art_langgraph import _pipelines, _tracing, rollout, semconv
from art_langgraph._export_queue import BoundedProcessor, CountingExporter, HeldProcessor
from tests.collector.seeding import make_app
from tests.served import served


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(predicate())


@pytest.mark.parametrize("base_var", ["LANGFUSE_BASE_URL", "LANGFUSE_HOST"])
def test_langfuse_fan_out_same_trace(receivers, monkeypatch, base_var: str) -> None:
    collector, langfuse = receivers
    monkeypatch.delenv("LANGFUSE_BASE_URL", raising=False)
    monkeypatch.delenv("LANGFUSE_HOST", raising=False)
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv(base_var, langfuse.url + "/")
    art_langgraph.configure(collector_url=collector.url, langfuse=True, api_key="collector-secret")
    with rollout("fan-out") as run:
        run.reward(1.0)
    assert art_langgraph.flush(timeout=10)
    ours_ = [
        (path, headers, s)
        for path, headers, request in langfuse.requests
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
        if s.trace_id.hex() == run.trace_id
    ]
    ((path, headers, theirs),) = ours_
    assert path == "/api/public/otel/v1/traces"
    assert headers["authorization"] == "Basic " + base64.b64encode(b"pk-lf-test:sk-lf-test").decode()
    # ART_API_KEY is the collector's alone (README): never in a request to Langfuse
    assert all("collector-secret" not in str(sent) for _, sent, _ in langfuse.requests)
    assert {sent["authorization"] for _, sent, _ in collector.requests} == {"Bearer collector-secret"}
    assert headers["content-encoding"] == "gzip"
    assert headers["content-type"] == "application/x-protobuf"
    (ours,) = collector.spans()
    assert theirs.trace_id.hex() == ours.trace_id.hex() == run.trace_id
    assert theirs.span_id == ours.span_id
    assert {a.key: a.value.string_value for a in theirs.attributes}[semconv.ROLLOUT_ID] == run.id


@pytest.mark.parametrize(("langfuse", "to_langfuse"), [(None, True), (False, False)])
def test_configure_langfuse_overrides_art_langfuse(receivers, monkeypatch, langfuse, to_langfuse: bool) -> None:
    """`ART_LANGFUSE=true` sends spans to Langfuse unless `configure(langfuse=False)` says otherwise."""
    collector, langfuse_receiver = receivers
    monkeypatch.setenv("ART_LANGFUSE", "true")
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv("LANGFUSE_BASE_URL", langfuse_receiver.url)
    art_langgraph.configure(collector_url=collector.url, langfuse=langfuse)
    with rollout("switch"):
        pass
    assert art_langgraph.flush(timeout=10)
    assert len(collector.spans()) == 1
    assert len(langfuse_receiver.spans()) == (1 if to_langfuse else 0)


def test_langfuse_without_keys_is_refused(monkeypatch, memory_tracing) -> None:
    monkeypatch.delenv("LANGFUSE_PUBLIC_KEY", raising=False)
    with pytest.raises(ValueError, match="LANGFUSE_PUBLIC_KEY"):
        art_langgraph.configure(langfuse=True)
    memory_tracing.install()


def test_failed_exports_are_retried_with_backoff(receivers, monkeypatch) -> None:
    collector, _ = receivers
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "10")  # the budget for all retries
    collector.fail_next = 2
    art_langgraph.configure(collector_url=collector.url)
    before = _tracing.dropped_spans()
    with rollout("retry"):
        pass
    assert art_langgraph.flush(timeout=15)
    assert collector.failures == 2
    assert len(collector.spans()) == 1
    assert _tracing.dropped_spans() == before


def test_spans_a_partial_success_rejects_are_counted_and_logged(receivers, monkeypatch, caplog) -> None:
    """A 200 whose OTLP `partial_success` reports spans rejected (the collector does, for spans it cannot read):
    those spans are lost, not to be retried (OTLP/HTTP spec); they went uncounted in `dropped_spans()` and unlogged."""
    collector, langfuse = receivers
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv("LANGFUSE_BASE_URL", langfuse.url)
    collector.reject = langfuse.reject = 1
    art_langgraph.configure(collector_url=collector.url, langfuse=True)
    dropped = art_langgraph.dropped_spans()
    with rollout("partly-rejected"):
        pass
    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        assert art_langgraph.flush(timeout=10)
    assert art_langgraph.dropped_spans() == dropped + 2
    assert len(collector.requests) == len(langfuse.requests) == 1  # not retried
    assert "collector rejected 1 spans: 1 spans rejected: no rollout id" in caplog.text
    assert "langfuse rejected 1 spans: 1 spans rejected: no rollout id" in caplog.text


@pytest.mark.parametrize(("status", "logged"), [
    # a proxy's body limit under `ART_MAX_EXPORT_BYTES`: the log said only "Request Entity Too Large"
    (413, "collector refused a request as too large (413); lower ART_MAX_EXPORT_BYTES"),
    # an ingress sending http:// on to https://: the exporter follows no redirect yet took it for a delivery, so every
    # span was lost, uncounted and unlogged
    (308, "collector answered 308, a redirect, which is not followed; dropped 1 spans"),
    # a key that differs from the collector's: the log said only "Failed to export span batch code: 401"
    (401, "collector refused the spans as unauthorized (401); check the key sent: ART_API_KEY"),
    (403, "collector refused the spans as unauthorized (403); check the key sent: ART_API_KEY"),
])
def test_spans_refused_as_too_large_or_redirected_are_counted_and_logged_with_the_fix(
        receivers, caplog, status: int, logged: str) -> None:
    """Neither answer is retried (OTLP/HTTP spec): the spans are counted dropped, the log names the setting to fix."""
    collector, _ = receivers
    collector.fail_next, collector.fail_status = 1, status
    art_langgraph.configure(collector_url=collector.url)
    dropped = art_langgraph.dropped_spans()
    with rollout(f"answered-{status}"):
        pass
    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        assert art_langgraph.flush(timeout=10)
    assert collector.failures == 1 and collector.requests == []  # not retried
    assert art_langgraph.dropped_spans() == dropped + 1
    assert logged in caplog.text


_GENERIC, _TRACES = "Authorization=Bearer generic", "Authorization=Bearer traces"


@pytest.mark.parametrize(("headers", "api_key", "sent"), [
    ({"OTEL_EXPORTER_OTLP_HEADERS": _GENERIC}, None, "Bearer generic"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": _GENERIC, "OTEL_EXPORTER_OTLP_TRACES_HEADERS": _TRACES}, None, "Bearer traces"),
    ({"OTEL_EXPORTER_OTLP_TRACES_HEADERS": _TRACES}, "ours", "Bearer ours"),
])
def test_an_unauthorized_answer_names_what_sets_the_key_sent(
        receivers, monkeypatch, caplog, headers: dict[str, str], api_key: str | None, sent: str) -> None:
    """With no `ART_API_KEY`, the collector's exporter sends the `Authorization` header of
    `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, where a user of OpenTelemetry puts it; its 401/403 hint named only
    `ART_API_KEY`. Langfuse's hint named the collector's key too, though its header comes from the Langfuse keys
    alone. Each exporter's hint now names exactly what sets the header it sent."""
    collector, langfuse = receivers
    monkeypatch.delenv("ART_API_KEY", raising=False)
    langfuse_env = {"LANGFUSE_PUBLIC_KEY": "pk", "LANGFUSE_SECRET_KEY": "sk", "LANGFUSE_BASE_URL": langfuse.url}
    for name, value in {**headers, **langfuse_env}.items():
        monkeypatch.setenv(name, value)
    collector.fail_next = langfuse.fail_next = 1
    collector.fail_status = langfuse.fail_status = 401
    art_langgraph.configure(collector_url=collector.url, api_key=api_key, langfuse=True)
    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        for task in ("refused", "accepted"):
            with rollout(task):
                pass
            assert art_langgraph.flush(timeout=10)
    assert [h["authorization"] for _, h, _ in collector.requests] == [sent]
    assert [h["authorization"] for _, h, _ in langfuse.requests] == [f"Basic {base64.b64encode(b'pk:sk').decode()}"]
    named = {
        message.partition(" refused")[0].removeprefix("art_langgraph: "): set(re.findall(
            r"[A-Z][A-Z0-9_]{3,}|configure\(api_key=\.\.\.\)", message.partition("check the key sent: ")[2]))
        for message in caplog.messages if "unauthorized (401)" in message
    }
    assert named == {
        "collector": {
            "ART_API_KEY", "configure(api_key=...)", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"
        },
        "langfuse": {"LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"},
    }


def test_text_that_utf8_cannot_encode_costs_no_span(receivers, caplog) -> None:
    """A lone surrogate (bytes decoded with `surrogateescape`, e.g. a file a tool read) in any span's text made
    protobuf refuse the whole batch: every span in it, the other rollouts' too, was lost, uncounted, and the exporter
    raised. Each such character is now sent as U+FFFD, the rest of the text as it was."""
    collector, _ = receivers
    art_langgraph.configure(collector_url=collector.url)
    dropped = art_langgraph.dropped_spans()
    bad = "caf\udce9 \ud83d"
    with rollout("clean"):
        pass
    with pytest.raises(ValueError), rollout("dirty"):
        span = _tracing.get_tracer().start_span(f"tool {bad}", attributes={"text": bad, "texts": ["ok", bad]})
        span.add_event(bad, {"text": bad})
        span.end()
        raise ValueError(bad)
    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        assert art_langgraph.flush(timeout=10)
    by_name = {s.name: s for s in collector.spans()}
    assert set(by_name) == {"rollout clean", "rollout dirty", "tool caf\ufffd \ufffd"}
    tool = by_name["tool caf\ufffd \ufffd"]
    attrs = {a.key: a.value for a in tool.attributes}
    assert attrs["text"].string_value == "caf\ufffd \ufffd"
    assert [v.string_value for v in attrs["texts"].array_value.values] == ["ok", "caf\ufffd \ufffd"]
    assert [e.name for e in tool.events] == ["caf\ufffd \ufffd"]
    assert by_name["rollout dirty"].status.message == "ValueError: caf\ufffd \ufffd"
    assert art_langgraph.dropped_spans() == dropped
    assert "not valid Unicode" in caplog.text


def test_a_lone_surrogate_in_rollout_metadata_is_sent_as_u_fffd_too(receivers) -> None:
    """Metadata was exported as ASCII JSON, a lone surrogate escaped (`"\\udcff"`): it passed the export's check and
    the collector parsed it back into one, after which no answer holding the trajectory (`POST /v1/batches`
    included) could be encoded. It now goes as U+FFFD, as in any other attribute."""
    collector, _ = receivers
    art_langgraph.configure(collector_url=collector.url)
    with rollout("t", metadata={"file": "caf\udce9", "caf\udce9": ["\ud83d"]}):
        pass
    assert art_langgraph.flush(timeout=10)
    (root,) = collector.spans()
    attrs = {a.key: a.value.string_value for a in root.attributes}
    assert json.loads(attrs[semconv.METADATA]) == {"file": "caf\ufffd", "caf\ufffd": ["\ufffd"]}


def test_configure_again_exports_spans_in_flight(receivers) -> None:
    """A rollout still running when `configure` is called again goes out through the new pipeline."""
    first, second = receivers
    art_langgraph.configure(collector_url=first.url)
    with rollout("in-flight") as run:
        art_langgraph.configure(collector_url=second.url)
        run.reward(1.0)
    assert art_langgraph.flush(timeout=10)
    assert first.spans() == []
    (span,) = second.spans()
    assert {a.key: a.value.string_value for a in span.attributes}[semconv.ROLLOUT_ID] == run.id
    assert [event.name for event in span.events] == [semconv.REWARD_EVENT]


def test_a_span_ending_while_configure_replaces_the_pipeline_is_exported(receivers) -> None:
    """A span that found the old pipeline current, and reached its queue only after `configure` had shut it down, was
    lost, uncounted (the SDK's processor ignores a span after shutdown at INFO level)."""
    first, second = receivers
    art_langgraph.configure(collector_url=first.url)
    dropped = art_langgraph.dropped_spans()
    handing, release = threading.Event(), threading.Event()

    class Pause(SpanProcessor):
        """Runs before the old pipeline's own processor: the span has found that pipeline current."""

        def on_end(self, span: ReadableSpan) -> None:
            handing.set()
            release.wait(10)

    old, pause = _pipelines._state, Pause()
    old.processors.insert(0, pause)  # type: ignore[union-attr]
    span = _tracing.get_tracer().start_span("racing")
    ending = threading.Thread(target=span.end)
    ending.start()
    assert handing.wait(10)
    replacing = threading.Thread(target=art_langgraph.configure, kwargs={"collector_url": second.url})
    replacing.start()
    replacing.join(timeout=2)  # unchecked: with the hand-over under the lock, `configure` waits for the span
    release.set()
    ending.join()
    replacing.join()
    old.processors.remove(pause)  # type: ignore[union-attr]  # no exporter: `_pipelines` counts what ours left unsent
    assert art_langgraph.flush(timeout=10)
    assert [s.name for s in first.spans() + second.spans()] == ["racing"]
    assert art_langgraph.dropped_spans() == dropped


def test_a_batch_past_the_collectors_body_limit_goes_out_in_several_requests(
    memory_tracing, tmp_path, monkeypatch
) -> None:
    """The real collector refuses a body past its limit with 413, which exporters do not retry: one batch of long
    `llm` spans used to be lost whole. Each request now stays under `ART_MAX_EXPORT_BYTES`."""
    app = make_app(tmp_path, monkeypatch, max_body_bytes=256 * 1024)
    monkeypatch.setenv("ART_MAX_EXPORT_BYTES", str(192 * 1024))
    prompt = list(range(100_000, 104_000))  # 4,000 prompt tokens: about 20 KiB a span
    dropped = art_langgraph.dropped_spans()
    try:
        with served(app) as url:
            art_langgraph.configure(collector_url=url)
            tracer = _tracing.get_tracer()
            for n in range(40):  # one batch of 80 spans, about 1 MiB
                with rollout("long", group=f"g{n}") as run:
                    attrs = {semconv.SPAN_KIND: semconv.SPAN_KIND_LLM, semconv.ROLLOUT_ID: run.id,
                             semconv.POLICY_STEP: 0, semconv.PROMPT_TOKEN_IDS: prompt,
                             semconv.COMPLETION_TOKEN_IDS: [7, 8], semconv.COMPLETION_LOGPROBS: [-0.5, -0.25]}
                    tracer.start_span("chat", attributes=attrs).end()
            assert art_langgraph.flush(timeout=30)
            assert art_langgraph.dropped_spans() == dropped
            stored = app.state.store.trajectories()
    finally:
        memory_tracing.install()
    assert len(stored) == 40
    assert all(t.complete and t.sequences[0].token_ids == [*prompt, 7, 8] for t in stored)


def test_bounded_queue_never_blocks_and_counts_drops(receivers) -> None:
    collector, _ = receivers
    collector.delay = 2.0  # a slow collector
    art_langgraph.configure(collector_url=collector.url, max_queue_size=10)
    dropped = _tracing.dropped_spans()
    start = time.monotonic()
    for i in range(200):
        with rollout(f"burst-{i}"):
            pass
    elapsed = time.monotonic() - start
    assert elapsed < 1.0, f"200 spans took {elapsed:.2f}s with a stalled collector"
    assert wait_for(lambda: _tracing.dropped_spans() - dropped >= 180, timeout=5)
    assert _tracing.dropped_spans() - dropped <= 190


def test_drops_stay_counted_after_shutdown_and_configure(memory_tracing, dead_url) -> None:
    """`dropped_spans()` is the process's losses so far: shutting a pipeline down or replacing it forgets none."""
    art_langgraph.configure(collector_url=dead_url)
    dropped = _tracing.dropped_spans()
    try:
        for _ in range(2):
            with rollout("lost"):
                pass
        art_langgraph.shutdown(timeout=5)  # the export fails: the collector is down
        assert _tracing.dropped_spans() == dropped + 2
        art_langgraph.configure(collector_url=dead_url)
        assert _tracing.dropped_spans() == dropped + 2
    finally:
        memory_tracing.install()


def end_span(tracer: Tracer, processor: SpanProcessor) -> None:
    """Start and end a span of `tracer` and hand it to `processor`, as its provider would when the span ends."""
    span = tracer.start_span("s")
    span.end()
    processor.on_end(span)  # type: ignore[arg-type]


def test_spans_the_processor_leaves_queued_at_shutdown_are_counted() -> None:
    """The SDK's processor waits 30 s for an export that stalls (a collector that does not answer), then stops with
    the rest of its queue unexported: those spans were lost and `dropped_spans()` did not count them."""
    started, release = threading.Event(), threading.Event()

    class Stalled(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            started.set()
            release.wait(60)
            return SpanExportResult.SUCCESS

    counting = CountingExporter(Stalled(), "stalled", 1 << 20)
    processor = BoundedProcessor(counting, max_queue_size=2)  # batches of 2
    tracer = TracerProvider().get_tracer("test")

    dropped = art_langgraph.dropped_spans()
    end_span(tracer, processor)
    end_span(tracer, processor)
    assert started.wait(10)  # the worker holds the first batch, stalled
    end_span(tracer, processor)  # queued behind it
    try:
        processor.shutdown()
        assert counting.dropped == 1
        assert art_langgraph.dropped_spans() == dropped + 1
    finally:
        release.set()


def partial_success(rejected: int) -> requests.Response:
    """A 200 whose OTLP body reports `rejected` spans rejected, as `CountingExporter.watch` reads it."""
    response = requests.Response()
    response.status_code = 200
    response.headers["Content-Type"] = "application/x-protobuf"
    body = ExportTraceServiceResponse(partial_success=ExportTracePartialSuccess(rejected_spans=rejected))
    response._content = body.SerializeToString()
    return response


@pytest.mark.parametrize("late", ["fails", "raises", "rejects", "delivers"])
def test_spans_given_up_on_at_exit_are_counted_once_whatever_the_late_export_does(late: str) -> None:
    """The exit hook gave up (`give_up`) on 2 spans in a request not answered and 1 queued; they were logged, never
    counted in `dropped_spans()`. Counted then, the export that ends after (a failure, an exception, a partial
    success already read, or a delivery) and the shutdown that exports the queued one count none again."""
    entered, release = threading.Event(), threading.Event()

    class Stuck(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            if late == "rejects":  # the answer came, and was read, before the exit hook gave up
                counting._read_answer(partial_success(len(spans)))
            entered.set()
            release.wait(60)
            if late == "raises":
                raise ConnectionError("reset")
            return SpanExportResult.FAILURE if late == "fails" else SpanExportResult.SUCCESS

    counting = CountingExporter(Stuck(), "stuck", 1 << 20)
    processor = HeldProcessor(counting, max_queue_size=10)
    tracer = TracerProvider().get_tracer("test")

    dropped = art_langgraph.dropped_spans()
    end_span(tracer, processor)
    end_span(tracer, processor)
    sending = threading.Thread(target=processor.force_flush)
    sending.start()
    try:
        assert entered.wait(10)  # the 2 spans' request is not answered
        end_span(tracer, processor)  # queued
        assert counting.give_up() == 3
    finally:
        release.set()
        sending.join()
    processor.shutdown()  # exports the queued span, as the shutdown given up on would
    assert counting.dropped == 3
    assert art_langgraph.dropped_spans() == dropped + 3
