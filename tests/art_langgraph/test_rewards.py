"""Rewards: validation (non-finite, types, NumPy), events on the rollout span, and rewards given after the fact,
posted to the collector."""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import numpy as np
import pytest

import art_langgraph
from art_langgraph import reward, rollout, semconv
from art_langgraph._collector_client import apost_reward, post_reward
from tests.art_langgraph.span_reading import spans_of
from tests.collector.seeding import make_app
from tests.served import served


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_reward_rejects_non_finite(bad: float, spans) -> None:
    with rollout("r") as r:
        with pytest.raises(ValueError, match="finite"):
            r.reward(bad)
        with pytest.raises(ValueError, match="finite"):
            reward(bad)
    with pytest.raises(ValueError, match="finite"):
        reward(bad, rollout_id="abc")


def test_reward_validation_misc(spans) -> None:
    with pytest.raises(RuntimeError, match="rollout_id"):
        reward(1.0)
    with rollout("r"):
        with pytest.raises(TypeError):
            reward("1")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            reward(1.0, name="")
    with pytest.raises(RuntimeError, match="entered only once"):
        r = rollout("twice")
        with r:
            with r:
                pass


@pytest.mark.parametrize("name", ["n" * 257, "a\x00b"])
def test_a_reward_name_the_collector_would_reject_is_refused(name: str, spans) -> None:
    """The collector rejects a rollout span with such a reward event, so one bad name lost the whole trajectory."""
    with rollout("r") as r:
        with pytest.raises(ValueError, match="reward name must be at most 256 characters, without NUL"):
            r.reward(1.0, name=name)
        with pytest.raises(ValueError, match="reward name must be at most 256"):
            reward(1.0, name=name)
        r.reward(1.0, name="n" * 256)
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert [e.attributes[semconv.REWARD_NAME] for e in root.events] == ["n" * 256]


@pytest.mark.parametrize(("ids", "error", "match"), [
    ({"rollout_id": 123}, TypeError, "reward's rollout_id must be a string, got int"),
    ({"rollout_id": b"ab"}, TypeError, "reward's rollout_id must be a string, got bytes"),
    ({"rollout_id": ""}, ValueError, "reward's rollout_id must be a non-empty string"),
    ({"rollout_id": "x" * 257}, ValueError, "reward's rollout_id must be at most 256 characters"),
    ({"rollout_id": "a\x00"}, ValueError, "reward's rollout_id must be at most 256 characters, without NUL"),
    ({"rollout_id": "a/../b"}, ValueError, "reward's rollout_id 'a/../b' has a path segment"),
    ({"trace_id": 123}, TypeError, "reward's trace_id must be a string, got int"),
    ({"trace_id": ""}, ValueError, "reward's trace_id must be 32 hex digits, not all zeros"),
    ({"trace_id": "zz"}, ValueError, "reward's trace_id must be 32 hex digits"),
    ({"trace_id": "0" * 32}, ValueError, "reward's trace_id must be 32 hex digits, not all zeros"),
    ({"trace_id": "a" * 33}, ValueError, "reward's trace_id must be 32 hex digits"),
])
@pytest.mark.asyncio(loop_scope="session")
async def test_a_rollout_or_trace_id_the_collector_would_refuse_is_refused_at_once(
        ids: dict, error: type[Exception], match: str, spans) -> None:
    """Such an id went to the collector, whose 422 (or a JSON encoding error, for bytes) came only once the run was
    over; an all-zero trace id was taken and named no trace, so the reward waited for its spans forever. The current
    rollout's trace id in upper case is the current rollout's (it was posted instead)."""
    with pytest.raises(error, match=re.escape(match)):
        reward(1.0, **ids)
    with pytest.raises(error, match=re.escape(match)):
        await art_langgraph.areward(1.0, **ids)
    with rollout("r") as r:
        reward(1.0, trace_id=f" {r.trace_id.upper()} ")  # the collector's form: either case, whitespace dropped
        reward(2.0, rollout_id=uuid.UUID(r.id))
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert [e.attributes[semconv.REWARD_VALUE] for e in root.events] == [1.0, 2.0]


def test_numpy_rewards_are_numbers(spans) -> None:
    """A reward computed with NumPy (`np.float32`, `np.int64`) counts; a NumPy bool does not, as a bool does not."""
    with rollout("np") as r:
        r.reward(np.float32(0.5))
        reward(np.int64(2), name="count")
        with pytest.raises(TypeError, match="must be a number"):
            reward(np.bool_(True))
        with pytest.raises(ValueError, match="finite"):
            reward(np.float32("nan"))
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert [(e.attributes[semconv.REWARD_NAME], e.attributes[semconv.REWARD_VALUE]) for e in root.events] == [
        ("reward", 0.5),
        ("count", 2.0),
    ]


def test_a_reward_out_of_floats_range_or_under_a_name_that_is_no_string_is_refused_clearly(spans) -> None:
    """An int too large for a float raised a bare `OverflowError`; a name that is no string, `len()`'s TypeError."""
    with rollout("r") as r:
        with pytest.raises(ValueError, match="reward 'big' must be finite, got a number beyond float's range"):
            r.reward(10**400, name="big")
        with pytest.raises(TypeError, match="reward name must be a string, got int"):
            reward(1.0, name=5)  # type: ignore[arg-type]
        r.reward(10**20, name="big")
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert [e.attributes[semconv.REWARD_VALUE] for e in root.events] == [1e20]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_reward_on_a_rollout_never_entered_is_refused(reward_server: list) -> None:
    """It was POSTed under the id of a rollout that never ran: a reward no trajectory would ever take."""
    never = rollout("never")
    with pytest.raises(RuntimeError, match=r"rollout\('never'\) has not started"):
        never.reward(1.0)
    with pytest.raises(RuntimeError, match="has not started"):
        await never.areward(1.0)
    assert reward_server == []


def test_module_reward_inside_rollout_is_an_event(spans) -> None:
    with rollout("r") as r:
        reward(0.25, name="judge")
        reward(2, rollout_id=r.id)
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert [(e.name, e.attributes[semconv.REWARD_VALUE]) for e in root.events] == [
        (semconv.REWARD_EVENT, 0.25),
        (semconv.REWARD_EVENT, 2.0),
    ]


class _Rewards(BaseHTTPRequestHandler):
    received: list[tuple[str, dict, str | None]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append((self.path, body, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _serving_rewards() -> Iterator[tuple[str, list]]:
    """A stand-in collector that records `POST /v1/rewards`: its URL and what it received."""
    server = HTTPServer(("127.0.0.1", 0), _Rewards)
    _Rewards.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", _Rewards.received
    finally:
        server.shutdown()


@pytest.fixture
def reward_server(memory_tracing) -> Iterator[list]:
    """The stand-in collector, configured as the collector; tracing is restored after."""
    with _serving_rewards() as (url, received):
        art_langgraph.configure(collector_url=url, api_key="sekret")
        try:
            yield received
        finally:
            memory_tracing.install()


def test_late_reward_follows_the_otlp_traces_endpoint(memory_tracing, monkeypatch) -> None:
    """With only `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set, rewards go to the collector the spans go to."""
    for name in ("ART_COLLECTOR_URL", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with _serving_rewards() as (url, received):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{url}/v1/traces/")
        art_langgraph.configure()
        try:
            reward(0.5, rollout_id="finished")
        finally:
            memory_tracing.install()
    assert [(path, body) for path, body, _ in received] == [
        ("/v1/rewards", {"rollout_id": "finished", "name": "reward", "value": 0.5})
    ]


def test_late_reward_goes_where_the_spans_go_after_the_environment_changes(
    memory_tracing, monkeypatch, dead_url: str
) -> None:
    """The span exporter reads `OTEL_EXPORTER_OTLP_ENDPOINT` once, at `configure`, as the settings read the headers
    variables; late rewards read the endpoint again at each reward: a variable changed later sent them to another
    collector than the spans, with the `Authorization` read for the first. Both follow it from the next `configure`."""
    for name in (
        "ART_COLLECTOR_URL",
        "ART_API_KEY",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    ):
        monkeypatch.delenv(name, raising=False)
    with _serving_rewards() as (url, received):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20key-of-this-collector")
        art_langgraph.configure()
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", dead_url)
        try:
            reward(0.5, rollout_id="finished")
        finally:
            memory_tracing.install()
    assert received == [
        ("/v1/rewards", {"rollout_id": "finished", "name": "reward", "value": 0.5}, "Bearer key-of-this-collector")
    ]


def test_reward_after_the_fact_posts_to_collector(reward_server: list) -> None:
    with rollout("late") as r:
        pass
    reward(0.75, rollout_id=r.id, name="judge")
    r.reward(1.0)  # the handle after exit also goes through the API
    assert reward_server == [
        ("/v1/rewards", {"rollout_id": r.id, "name": "judge", "value": 0.75}, "Bearer sekret"),
        ("/v1/rewards", {"rollout_id": r.id, "name": "reward", "value": 1.0}, "Bearer sekret"),
    ]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_run_id_given_as_its_text_names_its_rollout(reward_server: list) -> None:
    """A graph run's rollout id is its `run_id` in hex; an app that kept `str(run_id)` (with dashes) and rewarded by it
    posted that text, which named no trajectory: the collector kept the reward and never applied it."""
    run_id = uuid.uuid4()
    reward(0.5, rollout_id=str(run_id))
    await art_langgraph.areward(0.25, rollout_id=str(run_id).upper())
    reward(1.0, rollout_id="x" * 36)  # no UUID's text: an id of its own, sent as given
    reward(1.0, rollout_id="A" * 32)  # another tracer's id in upper case: sent as given (the collector lowers it)
    assert [body["rollout_id"] for _, body, _ in reward_server] == [run_id.hex, run_id.hex, "x" * 36, "A" * 32]


@pytest.mark.asyncio(loop_scope="session")
async def test_areward_after_the_fact(reward_server: list) -> None:
    async with rollout("late") as r:
        pass
    await art_langgraph.areward(0.5, rollout_id=r.id)
    assert reward_server == [("/v1/rewards", {"rollout_id": r.id, "name": "reward", "value": 0.5}, "Bearer sekret")]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_reward_name_with_a_surrogate_is_refused_on_either_path(reward_server: list) -> None:
    """Inside the rollout such a name was exported as U+FFFD, merging it with any name that differs only there; after
    it, httpx raised a bare `UnicodeEncodeError` encoding the body."""
    name = "x\udcff"
    refused = r"reward name must be text UTF-8 can encode: 'x\\udcff' holds the surrogate '\\udcff'"
    with rollout("r") as r:
        with pytest.raises(ValueError, match=refused):
            r.reward(1.0, name=name)
        with pytest.raises(ValueError, match=refused):
            reward(1.0, name=name)
    with pytest.raises(ValueError, match=refused):
        r.reward(1.0, name=name)
    with pytest.raises(ValueError, match=refused):
        reward(1.0, name=name, rollout_id=r.id)
    with pytest.raises(ValueError, match=refused):
        await art_langgraph.areward(1.0, name=name, rollout_id=r.id)
    assert reward_server == []


@pytest.mark.asyncio(loop_scope="session")
async def test_a_reward_the_collector_refuses_raises_with_its_reason(memory_tracing, tmp_path, monkeypatch) -> None:
    """The error said only "400 Bad Request": not which field the real collector refused, nor why. (`reward` refuses
    these ids itself now; its client is what shows a refusal of the collector's.)"""
    app = make_app(tmp_path, monkeypatch)
    try:
        with served(app) as url:
            art_langgraph.configure(collector_url=url)
            with pytest.raises(httpx.HTTPStatusError, match=r"400 Bad Request .*body\.trace_id: String should match"):
                post_reward(None, "reward", 1.0, trace_id="not-a-trace-id")
            with pytest.raises(httpx.HTTPStatusError, match=r"400 Bad Request .*body\.rollout_id: String should have"):
                await apost_reward("r" * 300, "reward", 1.0)
    finally:
        memory_tracing.install()
