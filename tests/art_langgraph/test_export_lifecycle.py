"""Export across a process's life: spans flushed at exit, made in atexit handlers or after the exit hook, across
a fork, and an exit with the collector down that stays bounded.

Each test runs a short Python program in a child process and reads what reached `Receiver`
(tests/art_langgraph/otlp_receiver.py), a local OTLP/HTTP endpoint standing in for the collector.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from art_langgraph import semconv

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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_holds_the_pipeline_lock_still_exports(receivers) -> None:
    """A thread configuring the pipeline at its first span holds the plugin's lock; a fork then left the child a
    lock no thread of its own would release, and its first span hung forever."""
    collector, _ = receivers
    script = textwrap.dedent(
        f"""
        import os, threading, time
        import art_langgraph
        from art_langgraph import _pipelines
        os.environ["ART_COLLECTOR_URL"] = {collector.url!r}
        held, release = threading.Event(), threading.Event()
        def configuring():
            with _pipelines._lock:
                held.set()
                release.wait()
        threading.Thread(target=configuring).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            with art_langgraph.rollout("child"):
                pass
            os._exit(0 if art_langgraph.flush(timeout=10) else 1)
        release.set()
        deadline = time.monotonic() + 20
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        if not done[0]:
            os.kill(pid, 9)
        assert done[0] and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung or its flush failed"
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [s.name for s in collector.spans()] == ["rollout child"]


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


_EXIT_LOSS_PROLOGUE = """
import atexit, threading
atexit.register(lambda: print(art_langgraph.dropped_spans()))  # registered first: runs after the exit hook
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
import art_langgraph
OTLPSpanExporter.export = lambda self, spans: threading.Event().wait()  # never answered
art_langgraph.configure(collector_url={url!r})
"""
"""What each exit-loss script runs first: a pipeline to `url` whose exports never get an answer, and an atexit
handler that prints `dropped_spans()` after the exit hook."""


def _assert_lost_at_exit(dead_url: str, body: str, lost: int) -> None:
    """Run `body` after `_EXIT_LOSS_PROLOGUE`, with `ART_EXIT_FLUSH_TIMEOUT=1`: the exit hook logs `lost` spans
    unsent, in one line with the setting to raise, and `dropped_spans()` read after it is `lost`."""
    script = _EXIT_LOSS_PROLOGUE.format(url=dead_url) + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ART_EXIT_FLUSH_TIMEOUT": "1"},
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("art_langgraph:")] == [
        f"art_langgraph: {lost} spans were still unsent when ART_EXIT_FLUSH_TIMEOUT (1 s) ran out at exit; they are "
        "lost: raise ART_EXIT_FLUSH_TIMEOUT if the collector is slow to answer"
    ]
    assert out.stdout.split() == [str(lost)]


def test_exit_that_runs_out_of_time_logs_how_many_spans_were_left_unsent(dead_url) -> None:
    """A collector that never answers: the exit hook gave up after ART_EXIT_FLUSH_TIMEOUT with a line that named no
    number. The 2 spans the stuck export holds and the 2 queued behind it are counted, with the setting to raise, and
    are in `dropped_spans()` for an atexit handler that runs after the hook (they were only logged)."""
    body = """
        for i in range(2):
            with art_langgraph.rollout(f"sending-{i}"):
                pass
        assert not art_langgraph.flush(timeout=0.5)  # the export of these 2 is now stuck
        for i in range(2):
            with art_langgraph.rollout(f"queued-{i}"):
                pass
        """
    _assert_lost_at_exit(dead_url, body, 4)


@pytest.mark.parametrize("stop", ["shutdown(timeout=0.5)", "configure()"])
def test_spans_a_pipeline_stopped_before_exit_left_unsent_are_counted_and_logged(dead_url, stop: str) -> None:
    """`shutdown(timeout)` and `configure()` wait a bounded time for the pipeline they stop, which a collector that
    does not answer outlasts; the exit hook, which saw no pipeline of its own, let its spans be lost with no count and
    no line."""
    body = f"""
        for i in range(2):
            with art_langgraph.rollout(f"stopped-{{i}}"):
                pass
        art_langgraph.{stop}  # gives up on the stuck export, which goes on
        """
    _assert_lost_at_exit(dead_url, body, 2)


@pytest.mark.parametrize("then", ["pass", "art_langgraph.configure()"])
def test_spans_a_stopped_pipeline_still_had_in_a_request_at_exit_are_counted_and_logged(dead_url, then: str) -> None:
    """The SDK's shutdown of a batch processor waits 30 s (0.2 s here) for the export under way, then ends with its
    request unanswered; the exit hook gave up only on pipelines whose shutdown had not ended (and a `configure()` since
    forgot those that had), so an app that exited later lost that request's spans with no count and no line (with
    OTEL_EXPORTER_OTLP_TIMEOUT past 30 s, say)."""
    body = f"""
        from opentelemetry.sdk._shared_internal import BatchProcessor
        join = BatchProcessor.shutdown
        BatchProcessor.shutdown = lambda self, timeout_millis=30000: join(self, 200)
        with art_langgraph.rollout("unanswered"):
            pass
        art_langgraph.shutdown(timeout=0.1)
        assert art_langgraph.flush(timeout=10)  # its shutdown ended, the request still unanswered
        {then}
        """
    _assert_lost_at_exit(dead_url, body, 1)


def test_a_wait_longer_than_a_thread_can_wait_still_flushes(receivers) -> None:
    """`flush(timeout=1e10)` and `ART_EXIT_FLUSH_TIMEOUT=1e10` are past `threading.TIMEOUT_MAX`: both raised
    `OverflowError` (the exit hook with a traceback, its spans unexported) instead of waiting as long as they may."""
    collector, _ = receivers
    script = textwrap.dedent(
        f"""
        import art_langgraph
        art_langgraph.configure(collector_url={collector.url!r})
        with art_langgraph.rollout("flushed"):
            pass
        print(art_langgraph.flush(timeout=1e10), flush=True)
        with art_langgraph.rollout("at-exit"):
            pass
        """
    )
    env = {**os.environ, "ART_EXIT_FLUSH_TIMEOUT": "1e10"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stdout.split() == ["True"]
    assert len(collector.spans()) == 2


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
