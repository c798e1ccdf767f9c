"""Export: Langfuse fan-out with the same trace ids, retries, bounded queue, flush at exit.

`Receiver` (tests/art_langgraph/otlp_receiver.py) is a local OTLP/HTTP endpoint. It stands in
for Langfuse's OTLP endpoint (`/api/public/otel/v1/traces`, Basic auth), which cannot run here,
and for a collector that fails or stalls.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

import art_langgraph
from art_langgraph import _tracing, rollout, semconv
from tests.art_langgraph.otlp_receiver import Receiver
from tests.collector.seeding import make_app
from tests.served import served


@pytest.fixture
def receivers(memory_tracing) -> Iterator[tuple[Receiver, Receiver]]:
    """(collector stand-in, Langfuse stand-in); the test pipeline is restored afterwards."""
    collector, langfuse = Receiver(), Receiver()
    try:
        yield collector, langfuse
    finally:
        collector.close()
        langfuse.close()
        memory_tracing.install()


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


REFUSE_THREADS_AT_EXIT = """
import atexit, threading
def refuse(self):
    raise RuntimeError("can't create new thread at interpreter shutdown")
atexit.register(setattr, threading.Thread, "start", refuse)  # runs before the plugin's hook (LIFO)
"""
"""What Python 3.12+ does at exit (`Thread.start()` raises from the first atexit handler on), on any version."""


@pytest.mark.parametrize("threads_at_exit", ["allowed", "refused"])
def test_spans_are_flushed_at_exit(receivers, threads_at_exit: str) -> None:
    collector, _ = receivers
    script = textwrap.dedent(
        f"""
        import art_langgraph
        art_langgraph.configure(collector_url={collector.url!r})
        with art_langgraph.rollout("at-exit") as run:
            print(run.id)
        # no flush(): the exit hook exports what is queued
        """
    )
    if threads_at_exit == "refused":
        script += REFUSE_THREADS_AT_EXIT
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert "Traceback" not in out.stderr, out.stderr
    (span,) = collector.spans()
    attrs = {a.key: a.value.string_value for a in span.attributes}
    assert attrs[semconv.ROLLOUT_ID] == out.stdout.strip()


@pytest.mark.parametrize("threads_at_exit", ["allowed", "refused"])
def test_first_span_made_in_an_atexit_handler_is_exported(receivers, threads_at_exit: str) -> None:
    """A process's first span may come from an atexit handler, where no thread pool (any version) or thread (3.12)
    can start: the pipeline then built holds the span for the plugin's exit hook, which runs after the handler."""
    collector, _ = receivers
    script = textwrap.dedent(
        """
        import atexit
        import art_langgraph

        def at_exit():
            with art_langgraph.rollout("first-at-exit") as run:
                print(run.id, flush=True)

        atexit.register(at_exit)
        """
    )
    if threads_at_exit == "refused":
        script += REFUSE_THREADS_AT_EXIT
    env = {**os.environ, "ART_COLLECTOR_URL": collector.url}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    (span,) = collector.spans()
    assert {a.key: a.value.string_value for a in span.attributes}[semconv.ROLLOUT_ID] == out.stdout.strip()
    ((_, _, request),) = collector.requests
    resource = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
    assert resource["service.name"] == "art-langgraph"


@pytest.mark.parametrize("threads_at_exit", ["allowed", "refused"])
def test_a_pipeline_configured_at_exit_has_the_same_resource(receivers, threads_at_exit: str) -> None:
    """`Resource.create` cannot run its detectors at exit: a pipeline first configured there used to send
    `service.name` alone, without the SDK's `telemetry.sdk.*` or `OTEL_RESOURCE_ATTRIBUTES`."""
    collector, _ = receivers
    script = textwrap.dedent(
        """
        import atexit
        import art_langgraph

        def at_exit():
            with art_langgraph.rollout("configured-at-exit"):
                pass

        atexit.register(at_exit)
        with art_langgraph.rollout("configured-before"):
            pass
        art_langgraph.shutdown(timeout=10)  # exports it; the span at exit configures a new pipeline
        """
    )
    if threads_at_exit == "refused":
        script += REFUSE_THREADS_AT_EXIT
    env = {**os.environ, "ART_COLLECTOR_URL": collector.url, "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    resources = {
        {a.key: a.value.string_value for a in span.attributes}[semconv.TASK]: {
            a.key: a.value.string_value for a in resource_spans.resource.attributes
        }
        for _, _, request in collector.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    }
    assert resources["configured-at-exit"] == resources["configured-before"]
    assert resources["configured-before"]["deployment.environment"] == "test"
    assert resources["configured-before"]["telemetry.sdk.language"] == "python"


@pytest.mark.parametrize("threads_at_exit", ["allowed", "refused"])
def test_spans_made_after_the_exit_hook_are_a_logged_loss(receivers, threads_at_exit: str) -> None:
    """An atexit handler registered before `import art_langgraph` runs after the plugin's exit hook: its spans are
    never exported. That must not raise, and is logged once, with the fix."""
    collector, _ = receivers
    script = textwrap.dedent(
        """
        import atexit

        def at_exit():
            for i in range(2):
                with art_langgraph.rollout(f"after-hook-{i}"):
                    pass

        atexit.register(at_exit)  # before the import: runs after the plugin's exit hook
        import art_langgraph
        """
    )
    if threads_at_exit == "refused":
        script += REFUSE_THREADS_AT_EXIT
    env = {**os.environ, "ART_COLLECTOR_URL": collector.url}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("after its exit hook ran") == 1, out.stderr
    assert "art_langgraph.flush()" in out.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_span_started_before_a_fork_and_ended_in_the_child_is_exported(receivers) -> None:
    """The child has no pipeline yet when the span ends: the span configures one, as a first span would."""
    collector, _ = receivers
    script = textwrap.dedent(
        f"""
        import os
        import art_langgraph
        from art_langgraph import _tracing
        art_langgraph.configure(collector_url={collector.url!r})
        span = _tracing.get_tracer().start_span("across-fork")
        pid = os.fork()
        if pid == 0:
            span.end()
            os._exit(0 if art_langgraph.flush(timeout=10) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's flush failed"
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [s.name for s in collector.spans()] == ["across-fork"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_exports_through_its_own_pipeline(receivers) -> None:
    """A child forked while the parent's spans wait in the export queue still has room for its own.

    The queue holds 8 spans; the parent leaves 7 queued (the batch waits for its schedule delay),
    and the child, whose queue does not hold the parent's, ends 2.
    """
    collector, _ = receivers
    script = textwrap.dedent(
        f"""
        import os
        import art_langgraph
        art_langgraph.configure(collector_url={collector.url!r}, max_queue_size=8)
        for i in range(7):
            with art_langgraph.rollout(f"parent-{{i}}"):
                pass
        pid = os.fork()
        if pid == 0:
            for i in range(2):
                with art_langgraph.rollout(f"child-{{i}}"):
                    pass
            os._exit(0 if art_langgraph.flush(timeout=10) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's flush failed"
        """
    )
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "60000"}  # nothing leaves the queue before the fork
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    tasks = sorted({a.key: a.value.string_value for a in s.attributes}[semconv.TASK] for s in collector.spans())
    assert tasks == ["child-0", "child-1", *(f"parent-{i}" for i in range(7))]


def test_exit_with_collector_down_is_bounded(dead_url) -> None:
    script = textwrap.dedent(
        f"""
        import time
        import art_langgraph
        art_langgraph.configure(collector_url={dead_url!r})
        with art_langgraph.rollout("down"):
            pass
        print(time.time())  # the program is done; what follows is the exit hook
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "ART_EXIT_FLUSH_TIMEOUT": "1"},
    )
    exit_seconds = time.time() - float(out.stdout.strip())
    assert exit_seconds < 5  # at most ~1 s of flushing, plus interpreter teardown


@pytest.mark.parametrize(("call", "returns"), [("flush", "True"), ("shutdown", "None")])
def test_flush_and_shutdown_from_an_atexit_handler(receivers, call: str, returns: str) -> None:
    """An application's own atexit handler may flush or shut down while threads are refused.

    The handler ends the process (`os._exit`) right after the call, so the span must have been
    exported by the call itself, not by the plugin's exit hook.
    """
    collector, _ = receivers
    script = textwrap.dedent(
        f"""
        import atexit, os
        import art_langgraph
        art_langgraph.configure(collector_url={collector.url!r})

        def at_exit():
            print(art_langgraph.{call}(timeout=10), flush=True)
            os._exit(0)

        atexit.register(at_exit)
        with art_langgraph.rollout("app-at-exit") as run:
            print(run.id, flush=True)
        """
    )
    script += REFUSE_THREADS_AT_EXIT
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert "Traceback" not in out.stderr, out.stderr
    rollout_id, result = out.stdout.split()
    assert result == returns
    (span,) = collector.spans()
    assert {a.key: a.value.string_value for a in span.attributes}[semconv.ROLLOUT_ID] == rollout_id
