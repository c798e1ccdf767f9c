"""The trainer's collector client: what a lease asks for, which acks and releases are tried again and what a failed
ack says."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from collector.protocol import MAX_LEASE_SECONDS, BatchRequest
from examples.stack import free_port
from tests.collector.seeding import group_spans
from tests.collector.server_helpers import collector_app
from tests.served import served
from trainer_service import collector_client
from trainer_service.collector_client import CollectorClient
from trainer_service.config import LEASE_MARGIN_S, TrainerSettings
from trainer_service.protocol import ServiceError


def client(handle: httpx.MockTransport | None, **settings: object) -> CollectorClient:
    return CollectorClient(TrainerSettings(name="agent", wandb="off", **settings), handle)  # type: ignore[arg-type]


async def test_a_lease_outlasts_the_step_timeout() -> None:
    requests: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        return httpx.Response(200, json={"id": "none", "groups": [], "lease_expires_at": 0})

    longest = MAX_LEASE_SECONDS - LEASE_MARGIN_S  # the longest timeout a lease can cover
    for timeout in (None, 120.0, longest):
        collector = client(httpx.MockTransport(handle), **({} if timeout is None else {"train_step_timeout": timeout}))
        with pytest.raises(ServiceError, match="no rewarded group ready"):
            await collector.lease(1)
        await collector.aclose()
    # not the collector's 900 s default: a step may run for train_step_timeout, then save, hot-load and ack
    assert [r["lease_seconds"] for r in requests] == [3600.0 + LEASE_MARGIN_S, 120.0 + LEASE_MARGIN_S,
                                                      MAX_LEASE_SECONDS]
    assert all(BatchRequest.model_validate(r).lease_seconds == r["lease_seconds"] for r in requests)  # all valid


@pytest.mark.parametrize(("step", "said"), [(3, "(step 3 is saved and served)"),
                                            (None, "(nothing in it can train, no step was taken)")])
async def test_a_refused_ack_says_what_was_done_with_the_batch(step: int | None, said: str) -> None:
    collector = client(httpx.MockTransport(lambda request: httpx.Response(409, text="lease_expired")))
    with pytest.raises(ServiceError) as info:
        await collector.ack("b1", step)
    message = info.value.body.error.message
    assert info.value.body.error.code == "ack_failed" and f"batch b1 {said}: HTTP 409" in message
    assert "step None" not in message
    await collector.aclose()


@pytest.mark.parametrize("answer", [httpx.Response(200, text="<html>login</html>"), httpx.Response(200, json={}),
                                    httpx.Response(200, json=[{"batch_id": "b1"}])])
async def test_an_ack_answered_with_something_that_is_not_an_ack_fails(answer: httpx.Response) -> None:
    # a proxy's page or another service at --collector: the batch is not acked, its groups come back after the lease
    collector = client(httpx.MockTransport(lambda request: answer))
    with pytest.raises(ServiceError) as info:
        await collector.ack("b1", 3)
    assert info.value.body.error.code == "ack_failed"
    assert "ack of batch b1 (step 3 is saved and served) with something that is not an ack" in (
        info.value.body.error.message)
    acked = {"batch_id": "b1", "groups": ["g"], "policy_step": 3}  # what the collector publishes is taken
    collector = client(httpx.MockTransport(lambda request: httpx.Response(200, json=acked)))
    await collector.ack("b1", 3)
    await collector.aclose()


def _failing_first(monkeypatch: pytest.MonkeyPatch, app: Any, call: str) -> Any:
    """The collector `app` (ASGI) whose first answer to `/{call}` is cut off mid-way and whose store's first `call`
    (`ack` or `release`) finds the database locked, which the collector answers 503 store_unavailable."""
    store = app.state.store
    busy, drops, real = [True], [True], getattr(store, call)

    def locked_once(*args: Any) -> Any:
        if busy and busy.pop():
            raise OperationalError("UPDATE batches", {}, Exception("database is locked"))
        return real(*args)

    monkeypatch.setattr(store, call, locked_once)

    async def dropping(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith(f"/{call}") and drops and drops.pop():
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"99")]})
            raise RuntimeError("the collector died mid-answer")  # uvicorn closes the connection
        await app(scope, receive, send)

    return dropping


def _tries_logged(caplog: pytest.LogCaptureFixture, what: str) -> None:
    tries = [r.getMessage() for r in caplog.records if r.name == collector_client.__name__]
    # the cut-off answer reads as an incomplete body or as a reset connection, as the close and the read meet
    assert len(tries) == 2 and ("RemoteProtocolError" in tries[0] or "ReadError" in tries[0])
    assert "try 1 of 4" in tries[0]
    assert f"{what} failed (HTTP 503; try 2 of 4)" in tries[1]


async def test_an_ack_meeting_a_dropped_connection_or_a_busy_store_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the real collector over real HTTP: its first ack answer is cut off, its second is the store's 503
    monkeypatch.setattr(collector_client, "_RETRY_FIRST_S", 0.01)
    app = collector_app(tmp_path)
    store = app.state.store
    store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    with served(_failing_first(monkeypatch, app, "ack"), lifespan="off") as url:
        collector = client(None, collector=url)
        batch = await collector.lease(1)
        with caplog.at_level(logging.WARNING, logger=collector_client.__name__):
            await collector.ack(batch.id, 1)
        await collector.aclose()
    assert [(g.id, g.state) for g in store.groups()] == [("sums", "trained")]  # not offered again: trained once
    assert [b.policy_step for b in store.batches()] == [1]
    _tries_logged(caplog, f"ack of batch {batch.id}")


def _lease_answer_lost_once(app: Any) -> Any:
    """The collector `app` (ASGI) whose first lease is made and committed, then its answer cut off."""
    lost = [True]

    async def losing(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/batches" and lost and lost.pop():
            async def unsent(message: dict) -> None:
                pass

            await app(scope, receive, unsent)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"99")]})
            raise RuntimeError("the collector died mid-answer")  # uvicorn closes the connection
        await app(scope, receive, send)

    return losing


async def test_a_lease_whose_answer_is_lost_is_tried_again_and_gets_the_batch_it_leased(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a second lease would have taken other groups while the first held these until it expired (a failed attempt)
    monkeypatch.setattr(collector_client, "_RETRY_FIRST_S", 0.01)
    app = collector_app(tmp_path)
    store = app.state.store
    store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    with served(_lease_answer_lost_once(app), lifespan="off") as url:
        collector = client(None, collector=url)
        with caplog.at_level(logging.WARNING, logger=collector_client.__name__):
            batch = await collector.lease(1)
        assert [(b.id, b.state, b.groups) for b in store.batches()] == [(batch.id, "leased", ["sums"])]
        await collector.ack(batch.id, 1)
        store.add_spans(group_spans("products", ["6", "9"], rewards=[0.0, 1.0], first_span=100))
        again = await collector.lease(1)  # a key of its own: the first's lease ended
        await collector.aclose()
    assert [g.id for g in batch.groups] == ["sums"] and [g.id for g in again.groups] == ["products"]
    tries = [r.getMessage() for r in caplog.records if r.name == collector_client.__name__]
    assert len(tries) == 1 and tries[0].startswith("lease failed (") and "try 1 of 4" in tries[0]


async def test_a_release_meeting_a_dropped_connection_or_a_busy_store_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # as the ack: a release left to its lease's expiry would have counted a failed attempt and skipped the group
    monkeypatch.setattr(collector_client, "_RETRY_FIRST_S", 0.01)
    app = collector_app(tmp_path, max_failed_attempts=1)
    store = app.state.store
    store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    with served(_failing_first(monkeypatch, app, "release"), lifespan="off") as url:
        collector = client(None, collector=url)
        batch = await collector.lease(1)
        with caplog.at_level(logging.WARNING, logger=collector_client.__name__):
            released = await collector.release(batch.id, "OSError: disk full", False)
        await collector.aclose()
    assert released.returned == ["sums"] and released.skipped == []
    assert [(g.id, g.state, g.failed_attempts) for g in store.groups()] == [("sums", "ready", 0)]
    assert [(b.state, b.reason) for b in store.batches()] == [("released", "OSError: disk full")]
    _tries_logged(caplog, f"release of batch {batch.id}")


_CALLS = {  # what each call sends, its error code and how its messages name the batch
    "ack": (lambda c: c.ack("b1", 3), "ack_failed", "ack batch b1 (step 3 is saved and served)",
            "the ack of batch b1 (step 3 is saved and served)"),
    "release": (lambda c: c.release("b1", "OSError: disk full", False), "release_failed", "release batch b1",
                "the release of batch b1"),
}


@pytest.mark.parametrize("call", _CALLS)
async def test_a_call_without_an_answer_is_tried_a_bounded_number_of_times(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    send, code, unanswered, refused = _CALLS[call]
    monkeypatch.setattr(collector_client, "_RETRY_FIRST_S", 0.01)
    collector = client(None, collector=f"http://127.0.0.1:{free_port()}")  # nothing listens: refused
    with pytest.raises(ServiceError) as info:
        await send(collector)
    assert info.value.body.error.code == code
    assert f"Could not {unanswered} in 4 tries: ConnectError" in info.value.body.error.message
    await collector.aclose()
    sent: list[str] = []
    collector = client(httpx.MockTransport(lambda request: sent.append(request.url.path) or httpx.Response(503)))
    with pytest.raises(ServiceError) as info:
        await send(collector)
    assert len(sent) == 4 and f"refused {refused} in 4 tries: HTTP 503" in info.value.body.error.message
    await collector.aclose()


@pytest.mark.parametrize("call", _CALLS)
@pytest.mark.parametrize("status", [400, 401, 404, 409, 500])
async def test_a_call_the_collector_refuses_is_not_tried_again(call: str, status: int) -> None:
    send, code, _, refused = _CALLS[call]
    sent: list[str] = []
    collector = client(httpx.MockTransport(lambda request: sent.append(request.url.path) or httpx.Response(status)))
    with pytest.raises(ServiceError) as info:
        await send(collector)
    assert info.value.body.error.code == code
    assert sent == [f"/v1/batches/b1/{call}"] and f"{refused}: HTTP {status}" in info.value.body.error.message
    await collector.aclose()


async def test_a_call_that_times_out_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # httpx's timeouts carry no message: "did not answer: ." told nothing of the wait
    monkeypatch.setattr(collector_client, "_TIMEOUT_S", 0.2)
    monkeypatch.setattr(collector_client, "_RETRY_FIRST_S", 0.01)

    async def slow(scope: dict, receive: Any, send: Any) -> None:
        await asyncio.sleep(2)

    with served(slow, lifespan="off") as url:
        collector = client(None, collector=url)
        with pytest.raises(ServiceError) as leased:
            await collector.lease(1)
        with pytest.raises(ServiceError) as acked:
            await collector.ack("b1", 3)
        await collector.aclose()
    leased_said = leased.value.body.error.message  # the lease is tried again too: its answer may hold a batch
    assert f"at {url} did not answer in 4 tries (ReadTimeout: no answer within 0.2 s)" in leased_said
    assert "in 4 tries: ReadTimeout: no answer within 0.2 s." in acked.value.body.error.message


async def test_the_collector_url_s_credentials_are_not_shown() -> None:
    # the message reaches the log and `GET /v1/status`'s queue_error
    port = free_port()  # nothing listens: refused
    collector = client(None, collector=f"http://trainer:topsecret@127.0.0.1:{port}/prefix")
    for call in (collector.ready_groups(), collector.lease(1)):
        with pytest.raises(ServiceError) as info:
            await call
        message = info.value.body.error.message
        assert f"The collector at http://127.0.0.1:{port}/prefix did not answer (ConnectError: " in message
        assert "topsecret" not in message and "trainer" not in message
    await collector.aclose()


_FIX_THE_KEY = ": set ART_API_KEY to the collector's ART_API_KEY and restart the trainer)"


@pytest.mark.parametrize(("key", "user", "said"), [
    (None, "", "(ART_API_KEY is not set and the collector requires one" + _FIX_THE_KEY),
    ("wrong", "", "(ART_API_KEY is not the collector's key" + _FIX_THE_KEY),
    ("sekret", "trainer:pw@", "(the user and password in --collector's URL are sent in place of ART_API_KEY: take "
     "them out of the URL)"),
])
async def test_a_refused_key_names_art_api_key(tmp_path: Path, key: str | None, user: str, said: str) -> None:
    app = collector_app(tmp_path, api_key="sekret")
    app.state.store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    with served(app, lifespan="off") as url:
        collector = client(None, collector=url.replace("//", f"//{user}"), **({"api_key": key} if key else {}))
        for call in (collector.lease(1), collector.ack("b1", 3), collector.release("b1", "OSError", False)):
            with pytest.raises(ServiceError) as info:
                await call
            assert "HTTP 401: " in info.value.body.error.message and said in info.value.body.error.message
        await collector.aclose()
    assert [(g.id, g.state) for g in app.state.store.groups()] == [("sums", "ready")]


_ANOTHER_VERSION = {"id": 3, "groups": "none", "lease_expires_at": "soon"}
"""What no version of the collector answers: every field of a batch, an ack and a list of groups is wrong."""


@pytest.mark.parametrize(("call", "said"), [
    (lambda c: c.lease(1), "is not a batch: id: Input should be a valid string; groups: Input should be a valid "
     "array; lease_expires_at: Input should be a valid number"),
    (lambda c: c.ack("b1", 3), "is not an ack: batch_id: Field required; groups: Input should be a valid array"),
    (lambda c: c.ready_groups(), "did not answer with groups: Input should be a valid array"),
])
async def test_an_answer_of_another_version_is_told_on_one_line(call: Any, said: str) -> None:
    collector = client(httpx.MockTransport(lambda request: httpx.Response(200, json=_ANOTHER_VERSION)))
    with pytest.raises(ServiceError) as info:
        await call(collector)
    message = info.value.body.error.message
    assert said in message and "\n" not in message and "pydantic.dev" not in message
    await collector.aclose()


def _renaming_the_lease_s_expiry(app: Any) -> Any:
    """The collector `app` (ASGI) answering leases as another version might: `lease_expires_at` named `expires`."""

    async def renaming(scope: dict, receive: Any, send: Any) -> None:
        async def renamed(message: dict) -> None:
            if scope["path"] == "/v1/batches" and message["type"] == "http.response.start":
                message = {**message, "headers": [h for h in message["headers"] if h[0] != b"content-length"]}
            elif scope["path"] == "/v1/batches" and message.get("body"):
                body = json.loads(message["body"])
                body["expires"] = body.pop("lease_expires_at")
                message = {**message, "body": json.dumps(body).encode()}
            await send(message)

        await app(scope, receive, renamed)

    return renaming


async def test_a_lease_answered_with_something_that_is_not_a_batch_is_released(tmp_path: Path) -> None:
    # left leased, the groups would wait for the lease (the step's timeout and 300 s) and count a failed attempt
    app = collector_app(tmp_path)
    store = app.state.store
    store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    with served(_renaming_the_lease_s_expiry(app), lifespan="off") as url:
        collector = client(None, collector=url)
        with pytest.raises(ServiceError) as info:
            await collector.lease(1)
        await collector.aclose()
    [batch] = store.batches()
    assert info.value.body.error.code == "collector_error"
    assert info.value.body.error.message.endswith(f"is not a batch: lease_expires_at: Field required; batch {batch.id} "
                                                  "was released (not as failed), its groups are back in the "
                                                  "collector's pool")
    assert (batch.state, batch.reason) == ("released", "the trainer could not read the lease: lease_expires_at: "
                                           "Field required")
    assert [(g.id, g.state, g.failed_attempts) for g in store.groups()] == [("sums", "ready", 0)]


async def test_a_lease_answered_with_json_nested_too_deep_to_read_is_a_collector_error() -> None:
    # reading it again to find a batch to release raised RecursionError: the step failed as `training_failed`
    nested = b'{"id": "b1", "groups": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    collector = client(httpx.MockTransport(lambda request: httpx.Response(200, content=nested)))
    with pytest.raises(ServiceError) as info:
        await collector.lease(1)
    assert info.value.body.error.code == "collector_error"
    assert "is not a batch: Invalid JSON: recursion limit exceeded" in info.value.body.error.message
    await collector.aclose()


async def test_a_lease_short_of_min_groups_says_how_many_it_waits_for(tmp_path: Path) -> None:
    # "no rewarded group ready" while GET /v1/status showed one ready: the step waits for --min-groups of them
    app = collector_app(tmp_path)
    app.state.store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    with served(app, lifespan="off") as url:
        collector = client(None, collector=url)
        with pytest.raises(ServiceError) as short:
            await collector.lease(2)
        await collector.lease(1)  # takes the one ready group
        with pytest.raises(ServiceError) as none:
            await collector.lease(1)
        await collector.aclose()
    assert short.value.body.error.code == none.value.body.error.code == "no_batch_ready"
    assert short.value.body.error.message.startswith("The collector has fewer than 2 rewarded groups ready for "
                                                     "training (--min-groups 2), so it leased none;")
    assert none.value.body.error.message.startswith("The collector has no rewarded group ready for training yet;")


async def test_an_ack_refused_as_its_lease_expired_names_the_flag_that_lengthens_the_lease(tmp_path: Path) -> None:
    # the collector's own advice, "lease with a longer lease_seconds", names no setting of the trainer
    app = collector_app(tmp_path)
    store = app.state.store
    now = [1_000_000.0]
    store.clock = lambda: now[0]
    store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    with served(app, lifespan="off") as url:
        slow, other = client(None, collector=url, train_step_timeout=60), client(None, collector=url)
        batch = await slow.lease(1)
        now[0] = batch.lease_expires_at + 1  # the step took longer than --train-step-timeout and the margin
        await other.ack((await other.lease(1)).id, 1)
        with pytest.raises(ServiceError) as info:
            await slow.ack(batch.id, 1)
        await slow.aclose()
        await other.aclose()
    message = info.value.body.error.message
    assert info.value.body.error.code == "ack_failed" and '"error":"lease_expired"' in message
    assert message.endswith(f"(the step outlasted its lease, --train-step-timeout plus {LEASE_MARGIN_S:g} s = "
                            f"{60 + LEASE_MARGIN_S:g} s: raise --train-step-timeout (ART_TRAINER_TRAIN_STEP_TIMEOUT) "
                            "above the longest step)")
