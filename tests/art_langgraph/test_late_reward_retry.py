"""Late rewards (`reward(..., rollout_id=...)` after the run) sent again when the collector may not have taken them:
its 503 `store_unavailable` (nothing stored, `Retry-After`), a 502/504, or no answer. Safe because the collector takes
the same reward twice as once, proven first against the real collector app on SQLite over real HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError

import art_langgraph
from art_langgraph import _collector_client
from collector import server
from collector.errors import InvalidRequest
from tests.art_langgraph.conftest import Send
from tests.art_langgraph.otlp_receiver import LocalServer
from tests.collector.seeding import group_spans, make_app, trace_id
from tests.served import served


@pytest.fixture
def collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory_tracing) -> Iterator[Any]:
    """The real collector app on a fresh SQLite file holding group `sums` (rollouts `sums-0`, `sums-1`, rewarded 1
    and 0 by their spans); the plugin is configured to post late rewards to it once it is served (`_serving`)."""
    app = make_app(tmp_path, monkeypatch)
    app.state.store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    monkeypatch.setattr(_collector_client, "_FIRST_WAIT_S", 0.01)
    try:
        yield app
    finally:
        memory_tracing.install()


@contextmanager
def _serving(app: Any) -> Iterator[str]:
    """Serve `app` (ASGI) over real HTTP and point the plugin's late rewards at it; yields its URL."""
    with served(app, lifespan="off") as url:
        art_langgraph.configure(collector_url=url)
        yield url


def _rewards(url: str, trajectory_id: str) -> dict[str, float]:
    return httpx.get(f"{url}/v1/trajectories/{trajectory_id}").raise_for_status().json()["rewards"]


def _store_failing(monkeypatch: pytest.MonkeyPatch, app: Any, *errors: Exception) -> list[str]:
    """Make the store's `add_reward` raise `errors` in turn, then store as it does: the collector maps each to its
    answer (an `OperationalError` to its 503 `store_unavailable` with `Retry-After`). Returns the outcomes, in order."""
    store, pending, seen = app.state.store, list(errors), []
    real = store.add_reward

    def failing(*args: Any, **kwargs: Any) -> Any:
        if pending:
            error = pending.pop(0)
            seen.append(type(error).__name__)
            raise error
        seen.append("stored")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "add_reward", failing)
    return seen


def _locked() -> OperationalError:
    return OperationalError("INSERT INTO rewards", {}, Exception("database is locked"))


def _tries_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == _collector_client.__name__ and r.levelno == logging.WARNING
    ]


# --- the collector takes the same reward twice as once ------------------------------------------------------------


@pytest.mark.parametrize("by", ["rollout_id", "trace_id"])
def test_the_collector_takes_the_same_reward_twice_as_once(collector: Any, by: str) -> None:
    """What makes a retry safe: a second identical `POST /v1/rewards` (its first answer lost) answers the same and
    changes nothing a reader sees (the trajectory's rewards, the group), nor what a late ack compares: an ack after the
    lease expired and the duplicate came still stands (a different value would be a change, 409 `lease_expired`)."""
    with _serving(collector) as url:
        body = {"name": "judge", "value": 0.5, by: "sums-0" if by == "rollout_id" else trace_id("sums", 0)}
        first = httpx.post(f"{url}/v1/rewards", json=body).raise_for_status().json()
        lease = httpx.post(f"{url}/v1/batches", json={"lease_seconds": 1}).raise_for_status().json()
        assert [g["id"] for g in lease["groups"]] == ["sums"]
        time.sleep(1.1)  # the lease expires: its late ack compares the group's rewards with those it leased
        seen = httpx.get(f"{url}/v1/trajectories/sums-0").json(), httpx.get(f"{url}/v1/groups").json()
        again = httpx.post(f"{url}/v1/rewards", json=body).raise_for_status().json()
        assert again == first and first["trajectory_known"] is True
        assert (httpx.get(f"{url}/v1/trajectories/sums-0").json(), httpx.get(f"{url}/v1/groups").json()) == seen
        assert seen[0]["rewards"] == {"reward": 1.0, "judge": 0.5}
        ack = httpx.post(f"{url}/v1/batches/{lease['id']}/ack", json={"policy_step": 1})
        assert ack.status_code == 200, ack.text


def test_a_different_value_is_a_change_the_duplicate_check_would_see(collector: Any) -> None:
    """The control of the test above: the same check sees a reward of another value."""
    with _serving(collector) as url:
        httpx.post(f"{url}/v1/rewards", json={"rollout_id": "sums-0", "name": "judge", "value": 0.5})
        seen = httpx.get(f"{url}/v1/trajectories/sums-0").json()
        httpx.post(f"{url}/v1/rewards", json={"rollout_id": "sums-0", "name": "judge", "value": 0.25})
        assert httpx.get(f"{url}/v1/trajectories/sums-0").json() != seen


# --- the client sends it again -------------------------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="session")
async def test_a_reward_the_store_could_not_take_is_sent_again_after_retry_after(
    collector: Any, send: Send, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The collector's 503 `store_unavailable` (a lock held too long: nothing stored, "try again", `Retry-After`)
    made `reward()` raise; now the reward waits the `Retry-After` the collector gave and is sent again, logged once."""
    monkeypatch.setattr(server, "STORE_RETRY_AFTER_S", 1)
    outcomes = _store_failing(monkeypatch, collector, _locked())
    with _serving(collector) as url:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=_collector_client.__name__):
            await send(0.5, rollout_id="sums-0", name="judge")
        waited = time.monotonic() - started
        assert outcomes == ["OperationalError", "stored"]
        assert _rewards(url, "sums-0") == {"reward": 1.0, "judge": 0.5}
    assert waited >= 1.0  # the Retry-After, not the 0.01 s backoff
    (logged,) = _tries_logged(caplog)
    assert "reward 'judge' of rollout sums-0" in logged and "HTTP 503" in logged and "database is locked" in logged
    assert "try 1 of 3" in logged and "trying again in 1 s" in logged


@pytest.mark.asyncio(loop_scope="session")
async def test_a_refusal_after_a_503_is_not_sent_again(
    collector: Any, send: Send, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4xx says the collector will not take this reward: it is raised at once, never sent again."""
    monkeypatch.setattr(server, "STORE_RETRY_AFTER_S", 0)
    outcomes = _store_failing(monkeypatch, collector, _locked(), InvalidRequest("refused for the test"))
    with _serving(collector):
        with pytest.raises(httpx.HTTPStatusError, match=r"400 Bad Request .*refused for the test.* \(2 tries\)"):
            await send(0.5, rollout_id="sums-0", name="judge")
    assert outcomes == ["OperationalError", "InvalidRequest"]
    assert len(_tries_logged(caplog)) == 1


@pytest.mark.asyncio(loop_scope="session")
async def test_a_store_down_on_every_try_raises_its_503_after_three_tries(
    collector: Any, send: Send, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Bounded: the third 503 is raised, with the collector's answer and the tries; each retry was logged once."""
    monkeypatch.setattr(server, "STORE_RETRY_AFTER_S", 0)
    outcomes = _store_failing(monkeypatch, collector, _locked(), _locked(), _locked(), _locked())
    with _serving(collector):
        with caplog.at_level(logging.WARNING, logger=_collector_client.__name__):
            with pytest.raises(
                httpx.HTTPStatusError, match=r"503 Service Unavailable .*store_unavailable.*\(3 tries\)"
            ):
                await send(0.5, rollout_id="sums-0", name="judge")
    assert outcomes == ["OperationalError"] * 3
    assert [("try 1 of 3" in m, "try 2 of 3" in m) for m in _tries_logged(caplog)] == [(True, False), (False, True)]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_retry_after_past_the_wait_budget_is_not_waited_for(
    collector: Any, send: Send, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `Retry-After` longer than a late reward waits in all (`_WAIT_BUDGET_S`) is not cut short (the collector asked
    for it) nor waited for: the 503 is raised at once, saying why."""
    monkeypatch.setattr(server, "STORE_RETRY_AFTER_S", 60)
    outcomes = _store_failing(monkeypatch, collector, _locked())
    with _serving(collector):
        started = time.monotonic()
        with pytest.raises(
            httpx.HTTPStatusError,
            match=r"503 .*not tried again: the collector asked to wait 60 s "
            r"\(Retry-After\), past the 10 s",
        ):
            await send(0.5, rollout_id="sums-0", name="judge")
        assert time.monotonic() - started < 5
    assert outcomes == ["OperationalError"]


class _Answering(LocalServer):
    """A stand-in collector answering each `POST` with the next of `answers` (status, `Retry-After` or None)."""

    def __init__(self, answers: list[tuple[int, str | None]]) -> None:
        pending = list(answers)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                status, retry_after = pending.pop(0)
                self.send_response(status)
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._serve(Handler)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_backoff_past_the_wait_budget_is_not_blamed_on_retry_after(
    memory_tracing, send: Send, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 whose `Retry-After` took most of the budget, then a 502 without one: the backoff's wait would pass the
    budget. The error said the collector asked for that wait (`Retry-After`), which its last answer did not."""
    monkeypatch.setattr(_collector_client, "_FIRST_WAIT_S", 0.05)
    monkeypatch.setattr(_collector_client, "_WAIT_BUDGET_S", 1.0)
    collector = _Answering([(503, "0.95"), (502, None)])
    art_langgraph.configure(collector_url=collector.url)
    try:
        with pytest.raises(httpx.HTTPStatusError) as raised:
            await send(0.5, rollout_id="sums-0", name="judge")
    finally:
        collector.close()
        memory_tracing.install()
    message = str(raised.value)
    assert message.startswith("the collector answered 502 Bad Gateway") and "(2 tries)" in message, message
    assert "Retry-After" not in message, message
    assert "not tried again: waiting 0.1 s more after 0.95 s would pass the 1 s a late reward waits in all" in message


def _first_answer_lost(app: Any, how: str) -> Any:
    """The collector `app` (ASGI) whose first `POST /v1/rewards` is stored and committed, then its answer lost: cut off
    (`cut`: the connection closes mid-answer) or late past the client's timeout (`late`)."""
    lost = [True]

    async def losing(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/rewards" and lost and lost.pop():

            async def unsent(message: dict) -> None:
                pass

            await app(scope, receive, unsent)  # stored and committed
            if how == "late":
                await asyncio.sleep(1.0)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"99")]})
            raise RuntimeError("the collector died mid-answer")  # uvicorn closes the connection
        await app(scope, receive, send)

    return losing


@pytest.mark.parametrize("how", ["cut", "late"])
@pytest.mark.asyncio(loop_scope="session")
async def test_a_reward_whose_answer_was_lost_is_sent_again_and_counts_once(
    collector: Any, send: Send, how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection reset, or a read timeout, once the request was sent: the reward may be stored (it is here), and
    sending it again is safe (the collector takes it twice as once): it is sent again and the call returns."""
    monkeypatch.setattr(_collector_client, "_TIMEOUT", httpx.Timeout(0.5))
    with _serving(_first_answer_lost(collector, how)) as url:
        with caplog.at_level(logging.WARNING, logger=_collector_client.__name__):
            await send(0.5, rollout_id="sums-0", name="judge")
        assert _rewards(url, "sums-0") == {"reward": 1.0, "judge": 0.5}
    (logged,) = _tries_logged(caplog)
    error = "ReadTimeout" if how == "late" else "RemoteProtocolError"
    assert error in logged and "try 1 of 3" in logged, logged


@pytest.mark.asyncio(loop_scope="session")
async def test_a_collector_down_is_tried_three_times_and_named(
    memory_tracing, dead_url: str, send: Send, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused connection never reached the collector: tried again, then raised naming the URL tried
    (`ART_COLLECTOR_URL`; httpx's `ConnectError` says only `Connection refused`) and the tries."""
    monkeypatch.setattr(_collector_client, "_FIRST_WAIT_S", 0.01)
    art_langgraph.configure(collector_url=dead_url)
    try:
        with caplog.at_level(logging.WARNING, logger=_collector_client.__name__):
            with pytest.raises(
                httpx.ConnectError,
                match=f"could not POST to the collector at {dead_url}/v1/rewards: "
                r".* \(3 tries\)",
            ):
                await send(1.0, rollout_id="r1")
    finally:
        memory_tracing.install()
    logged = _tries_logged(caplog)
    assert len(logged) == 2 and all("ConnectError" in m for m in logged), logged
