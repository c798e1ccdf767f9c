"""Langfuse sync through the real `langfuse` SDK against a local server.

No Langfuse server runs on this machine (it needs ClickHouse), so `fake_langfuse` serves
exactly the endpoints the sync uses — `GET /api/public/v3/scores` with cursor paging and
`POST /api/public/scores` — and `DELETE /api/public/scores/{scoreId}`, following Langfuse's
published API (the definition the SDK's client is generated from). Everything on the collector's
side is real: the SDK's HTTP client, the store, the sync's paging, mapping and bookkeeping.
"""

from __future__ import annotations

import base64
import datetime as dt
import email.utils
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from langfuse import __version__ as langfuse_version
from langfuse.api.core.api_error import ApiError
from sqlalchemy import Connection, Engine, select, text
from sqlalchemy.exc import DBAPIError

from collector import assembly, langfuse_api
from collector.config import CollectorSettings
from collector.langfuse_api import PAGE
from collector.langfuse_sync import LangfuseSync, LangfuseSyncError, make_client
from collector.protocol import RewardIn
from collector.schema import rewards
from collector.scoring_config import LangfuseSettings
from collector.scoring_store import INGEST_DELAY, ScoringStore
from collector.store import SqlStore
from examples.stack import free_port
from tests.collector import fake_langfuse
from tests.collector.conftest import Clock
from tests.collector.seeding import group_spans, make_app, trace_id
from tests.collector.span_builders import llm, sid
from tests.collector.test_foreign import TRACE_A, _openinference_chain, _openinference_llm, _ours, created_at
from tests.collector.test_store_rewards import refuse_reward


@pytest.fixture
def langfuse() -> Iterator[tuple[str, fake_langfuse.FakeLangfuse]]:
    with fake_langfuse.running(free_port()) as served:
        yield served


def sync_for(store: SqlStore, url: str, **fields: object) -> LangfuseSync:
    """The sync of `store` (any backend) with the stand-in at `url`, its settings given (other `LangfuseSettings`
    fields as keyword arguments), not read from the env."""
    settings = LangfuseSettings(host=url, public_key=fake_langfuse.PUBLIC, secret_key=fake_langfuse.SECRET, **fields)
    return LangfuseSync(store, ScoringStore(store.engine), settings)


def refuse_forgetting(engine: Engine) -> None:
    """Make the database refuse to delete a pulled score's record ("disk full"), as a full disk fails a write."""
    if engine.dialect.name == "postgresql":
        statements = [
            "CREATE FUNCTION refuse_forgetting() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'disk full'; END $$ "
            "LANGUAGE plpgsql",
            "CREATE TRIGGER refuse_forgetting BEFORE DELETE ON langfuse_pulled FOR EACH ROW "
            "EXECUTE FUNCTION refuse_forgetting()",
        ]
    else:
        statements = ["CREATE TRIGGER refuse_forgetting BEFORE DELETE ON langfuse_pulled "
                      "BEGIN SELECT RAISE(ABORT, 'disk full'); END"]
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))


def drop_trigger(engine: Engine, name: str, table: str) -> None:
    """The store error is over: drop the trigger `name` on `table` that made it."""
    with engine.begin() as conn:
        conn.execute(text(f"DROP TRIGGER {name}" + (f" ON {table}" if engine.dialect.name == "postgresql" else "")))


def app_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, **env: str) -> FastAPI:
    settings = {
        "ART_COLLECTOR_LANGFUSE_HOST": url,
        "LANGFUSE_PUBLIC_KEY": fake_langfuse.PUBLIC,
        "LANGFUSE_SECRET_KEY": fake_langfuse.SECRET,
        "ART_COLLECTOR_LANGFUSE_SYNC_SECONDS": "3600",  # the test triggers syncs itself
        **env,
    }
    return make_app(tmp_path, monkeypatch, env=settings, reward_name="human")


def test_pull_maps_annotation_scores_to_trajectories_by_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url, ART_COLLECTOR_LANGFUSE_SCORE_NAMES="human")
    app.state.store.add_spans(group_spans("g", [str(n) for n in range(130)]))
    for n in range(130):  # more than one page of 100
        server.add_score(f"s{n}", "human", n / 200, trace_id=trace_id("g", n))
    # a second later than g-0's first score: Langfuse keeps timestamps to the millisecond, so two scores made in the
    # same millisecond tie, and the one edited last would win
    server.add_score("obs", "human", True, trace_id=trace_id("g", 0), observation_id="o1", data_type="BOOLEAN",
                     timestamp=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))
    server.add_score("api", "human", 0.3, trace_id=trace_id("g", 1), source="API")  # not a human score
    server.add_score("other", "helpfulness", 0.3, trace_id=trace_id("g", 1))  # not a chosen name
    server.add_score("text", "human", "great", trace_id=trace_id("g", 2), data_type="TEXT")  # not read: no reward
    server.add_score("session", "human", 0.9, session_id="sess-1")
    server.add_score("old", "human", 0.9, trace_id=trace_id("g", 3),
                     timestamp=dt.datetime.now(dt.UTC) - dt.timedelta(days=30))
    server.add_score("late", "human", 0.25, trace_id="f" * 32)  # its trace has not arrived yet
    server.add_score("custom", "human", 0.5, trace_id="checkout-42")  # Langfuse takes any trace id; no span has it
    with TestClient(app) as client:
        result = client.post("/v1/langfuse/sync").json()
        # 132 usable scores on 131 (trace, name) pairs: g-0's two scores give one reward, the later one
        assert result == {"pulled": 134, "applied": 131, "unmatched": 1, "ignored": 2, "withdrawn": 0, "pushed": 0,
                          "push_rejected": 0, "retracted": 0, "retract_refused": 0, "retract_failed": 0,
                          "skipped": False}
        gets = [path for method, path in server.requests if method == "GET"]
        assert (len(gets) == 2 and "cursor=" in gets[1] and "source=ANNOTATION" in gets[0]
                and "fields=subject" in gets[0] and "dataType=NUMERIC%2CBOOLEAN" in gets[0])
        rewards = {t["id"]: t["rewards"] for t in client.get("/v1/trajectories", params={"group": "g"}).json()}
        assert rewards["g-0"]["human"] == 1.0  # the later observation-level boolean score
        assert rewards["g-1"] == {"human": 1 / 200}
        assert rewards["g-129"]["human"] == 129 / 200
        assert "helpfulness" not in rewards["g-1"]

        again = client.post("/v1/langfuse/sync").json()
        assert (again["pulled"], again["applied"]) == (134, 0)  # nothing new: nothing applied twice
        server.touch("s5", 0.99)  # a person corrects a score
        assert client.post("/v1/langfuse/sync").json()["applied"] == 1
        assert client.get("/v1/trajectories/g-5").json()["rewards"]["human"] == 0.99
        server.touch("s0", 0.01)  # a person edits g-0's older score: the later boolean one still holds
        assert client.post("/v1/langfuse/sync").json()["applied"] == 0
        assert client.get("/v1/trajectories/g-0").json()["rewards"]["human"] == 1.0


def test_an_edit_of_an_older_score_does_not_apply_the_unchanged_newer_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url)
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    now = dt.datetime.now(dt.UTC)
    server.add_score("older", "human", 0.1, trace_id=trace_id("g", 0), timestamp=now - dt.timedelta(hours=2))
    server.add_score("newer", "human", 0.9, trace_id=trace_id("g", 0), timestamp=now - dt.timedelta(hours=1))
    with TestClient(app) as client:
        assert client.post("/v1/langfuse/sync").json()["applied"] == 1
        client.post("/v1/rewards", json={"rollout_id": "g-0", "name": "human", "value": 0.5})  # given since
        server.touch("older", 0.2)
        assert client.post("/v1/langfuse/sync").json()["applied"] == 0
        assert client.get("/v1/trajectories/g-0").json()["rewards"]["human"] == 0.5
        server.touch("newer", 0.8)  # an edit of the latest score is applied
        assert client.post("/v1/langfuse/sync").json()["applied"] == 1
        assert client.get("/v1/trajectories/g-0").json()["rewards"]["human"] == 0.8


def test_a_score_deleted_in_langfuse_takes_its_reward_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url)
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    now = dt.datetime.now(dt.UTC)
    server.add_score("a", "human", 1.0, trace_id=trace_id("g", 0))
    server.add_score("b", "human", 0.0, trace_id=trace_id("g", 1))
    server.add_score("older", "human", 0.3, trace_id=trace_id("g", 1), timestamp=now - dt.timedelta(hours=2))
    with TestClient(app) as client:
        assert client.post("/v1/langfuse/sync").json()["applied"] == 2
        assert [g["state"] for g in client.get("/v1/groups").json()] == ["ready"]
        app.state.scoring.langfuse.client.scores.delete("a")  # a person withdraws the score (SDK → DELETE)
        server.scores["b"]["timestamp"] = "2000-01-01T00:00:00Z"  # b only left the lookback: it still holds
        result = client.post("/v1/langfuse/sync").json()
        assert (result["pulled"], result["withdrawn"]) == (1, 1)
        assert client.get("/v1/trajectories/g-0").json()["rewards"] == {}
        assert client.get("/v1/trajectories/g-1").json()["rewards"] == {"human": 0.0}
        assert [g["state"] for g in client.get("/v1/groups").json()] == ["open"]  # not trained on a withdrawn score
        assert client.post("/v1/langfuse/sync").json()["withdrawn"] == 0  # withdrawn once
        server.scores["b"]["timestamp"] = fake_langfuse._iso(now)
        app.state.scoring.langfuse.client.scores.delete("b")  # the older score of g-1 is the latest again
        assert client.post("/v1/langfuse/sync").json()["withdrawn"] == 1
        assert client.get("/v1/trajectories/g-1").json()["rewards"] == {"human": 0.3}
        assert ("DELETE", "/api/public/scores/b") in server.requests


def test_a_deleted_score_keeps_its_reward_while_its_group_is_leased_or_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url)
    app.state.store.add_spans(group_spans("g", ["7", "8"]) + group_spans("h", ["7", "8"], first_span=100))
    for group in ("g", "h"):
        server.add_score(f"{group}0", "human", 1.0, trace_id=trace_id(group, 0))
        server.add_score(f"{group}1", "human", 0.0, trace_id=trace_id(group, 1))
    with TestClient(app) as client:
        client.post("/v1/langfuse/sync")
        batch = client.post("/v1/batches", json={"max_groups": 2}).json()
        assert sorted(g["id"] for g in batch["groups"]) == ["g", "h"]
        del server.scores["g0"], server.scores["h0"]
        assert client.post("/v1/langfuse/sync").json()["withdrawn"] == 0  # the trainer has them now
        client.post(f"/v1/batches/{batch['id']}/release", json={"reason": "out of memory", "failed": False})
        assert client.post("/v1/langfuse/sync").json()["withdrawn"] == 2  # back in the pool: taken back
        assert client.get("/v1/trajectories/g-0").json()["rewards"] == {}
        server.add_score("h0", "human", 1.0, trace_id=trace_id("h", 0))
        client.post("/v1/langfuse/sync")
        batch = client.post("/v1/batches", json={"max_groups": 2}).json()
        client.post(f"/v1/batches/{batch['id']}/ack", json={"policy_step": 1})
        del server.scores["h0"]
        assert client.post("/v1/langfuse/sync").json()["withdrawn"] == 0  # trained: what it trained on stays
        assert client.get("/v1/trajectories/h-0").json()["rewards"] == {"human": 1.0}


def test_a_failed_page_applies_nothing_and_the_next_sync_applies_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    monkeypatch.setattr("collector.langfuse_api.FIRST_RETRY_WAIT", 0.0)  # no waits
    app = app_for(tmp_path, monkeypatch, url)
    app.state.store.add_spans(group_spans("g", [str(n) for n in range(130)]))
    for n in range(130):
        server.add_score(f"s{n}", "human", n / 200, trace_id=trace_id("g", n))
    server.failures = [429, None, 503, 503, 503]  # page 1 after one retry; page 2 fails all three tries
    with TestClient(app) as client:
        answer = client.post("/v1/langfuse/sync")
        assert answer.status_code == 502 and "503" in answer.json()["message"]
        assert client.get("/v1/trajectories/g-0").json()["rewards"] == {}  # nothing half-applied, nothing marked
        assert server.failures == [] and client.post("/v1/langfuse/sync").json()["applied"] == 130
        assert client.get("/v1/trajectories/g-129").json()["rewards"] == {"human": 129 / 200}


def test_a_langfuse_that_keeps_answering_429_fails_the_sync_within_its_timeout(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """The SDK retried a 429 twice on its own, each time after its `Retry-After` (up to a minute) whatever
    `timeout_seconds`: a sync hung up to two minutes past it. A retry whose wait would end past the call's deadline is
    not made: the sync fails at once, after one request (the next sync asks again)."""
    url, server = langfuse
    sync = sync_for(make_store(), url, timeout_seconds=2)
    server.failures, server.retry_after = [429] * 3, "3"
    with pytest.raises(LangfuseSyncError, match="answered 429"):
        sync.sync()
    assert [method for method, _ in server.requests] == ["GET"]


def test_a_retry_whose_wait_ran_past_the_deadline_is_not_made(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait that ran late (a busy process) left the retry a timeout below 0, which httpx refused with a ValueError
    that escaped the sync (a 500, no Langfuse status); the call now fails with Langfuse's last answer."""
    url, server = langfuse
    sync = sync_for(make_store(), url, timeout_seconds=2)
    server.failures, server.retry_after = [503] * 3, "1"
    late = SimpleNamespace(monotonic=time.monotonic, time=time.time, sleep=lambda seconds: time.sleep(seconds + 1.5))
    monkeypatch.setattr(langfuse_api, "time", late)
    with pytest.raises(LangfuseSyncError, match="answered 503"):
        sync.sync()
    assert [method for method, _ in server.requests] == ["GET"]


def test_a_429_whose_retry_after_fits_the_timeout_is_asked_again_after_it(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """Within the call's deadline a 429 or 5xx is asked again (at most twice), after Langfuse's `Retry-After`."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    store.add_spans(group_spans("g", ["7"]))
    server.add_score("s0", "human", 0.5, trace_id=trace_id("g", 0))
    server.failures, server.retry_after = [429, 503], "0"
    assert sync_for(store, url).sync().applied == 1
    assert [method for method, _ in server.requests] == ["GET"] * 3


def test_a_store_error_mid_pull_applies_no_score_twice(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A store error on the 111th reward left the 110 before it stored but not marked pulled: the next sync applied
    them again, over the API rewards given since."""
    url, server = langfuse
    store = make_store()
    store.add_spans(group_spans("g", [str(n) for n in range(130)]))
    now = dt.datetime.now(dt.UTC)
    for n in range(130):  # s0 the oldest: applied first
        server.add_score(f"s{n}", "human", (n + 1) / 1000, trace_id=trace_id("g", n),
                         timestamp=now - dt.timedelta(minutes=130 - n))
    sync = sync_for(store, url)
    refuse_reward(store.engine, 0.111)  # s110's
    with pytest.raises(DBAPIError, match="disk full"):
        sync.sync()
    assert store.trajectory("g-0").rewards == {"human": 0.001} and store.trajectory("g-110").rewards == {}
    for n in (0, 120):  # after s0 was applied; before s120 was
        store.add_reward(RewardIn(rollout_id=f"g-{n}", name="human", value=0.5))
    drop_trigger(store.engine, "refuse_reward", "rewards")
    assert sync.sync().applied == 30  # what the failed sync did not store, once
    assert store.trajectory("g-0").rewards == {"human": 0.5}  # newer than s0's reward: it holds
    assert [store.trajectory(f"g-{n}").rewards for n in (110, 120)] == [{"human": 0.111}, {"human": 0.121}]
    assert sync.sync().applied == 0


def test_a_store_error_on_a_withdrawal_takes_nothing_back_until_a_sync_records_it(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A deleted score's rewards were taken back in one transaction and its record dropped in another: a store error
    on the second left the score withdrawn but recorded as pulled, and a failed sync that had changed the rewards."""
    url, server = langfuse
    store = make_store()
    store.add_spans(group_spans("g", ["7", "8"]))
    server.add_score("a", "human", 1.0, trace_id=trace_id("g", 0))
    server.add_score("b", "human", 0.0, trace_id=trace_id("g", 1))
    sync = sync_for(store, url)
    assert sync.sync().applied == 2
    del server.scores["a"]
    refuse_forgetting(store.engine)
    with pytest.raises(DBAPIError, match="disk full"):
        sync.sync()
    assert store.trajectory("g-0").rewards == {"human": 1.0}  # neither its reward nor its record went
    drop_trigger(store.engine, "refuse_forgetting", "langfuse_pulled")
    assert sync.sync().withdrawn == 1
    assert store.trajectory("g-0").rewards == {}
    assert [row["score_id"] for row in sync.scoring.pulled_since(0)] == ["b"]  # and its record with them
    assert sync.sync().withdrawn == 0


def replicas(db_url, clock, url: str) -> tuple[LangfuseSync, LangfuseSync]:
    """The syncs of two collector replicas on one fresh database (skips an in-memory one: it cannot be shared)."""
    db = db_url()
    if db == "sqlite://":
        pytest.skip("an in-memory SQLite database cannot be shared by two stores")
    stores = [SqlStore(CollectorSettings(db=db), clock=clock) for _ in range(2)]
    stores[0].setup()
    return sync_for(stores[0], url), sync_for(stores[1], url)


def rewards_of_score(engine: Engine, score_id: str) -> int:
    """How many reward rows a Langfuse score gave."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM rewards WHERE score_id = :id"), {"id": score_id}).scalar_one()


def test_a_score_two_replicas_pull_at_once_is_applied_once(
    db_url, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """Both replicas read the pulled versions before either stored its rewards: the second applied the score again,
    over the API reward given between their syncs."""
    url, server = langfuse
    first, second = replicas(db_url, clock, url)
    first.store.add_spans(group_spans("g", ["7", "8"]))
    server.add_score("s", "human", 0.9, trace_id=trace_id("g", 0))
    server.add_score("t", "human", 0.1, trace_id=trace_id("g", 1))  # the first replica does not see it
    read = second.scoring.pulled_versions

    def the_other_replica_syncs_meanwhile(score_ids: list[str]) -> dict[str, str]:
        seen = read(score_ids)
        hidden = server.scores.pop("t")
        assert first.sync().applied == 1
        server.scores["t"] = hidden
        clock.now += 1
        first.store.add_reward(RewardIn(rollout_id="g-0", name="human", value=0.5))  # given since
        clock.now += 1
        return seen

    second.scoring.pulled_versions = the_other_replica_syncs_meanwhile
    result = second.pull()  # its pull alone: on PostgreSQL a sync holds off the other's (`test_a_sync_while_...`)
    assert first.store.trajectory("g-0").rewards == {"human": 0.5}
    assert first.store.trajectory("g-1").rewards == {"human": 0.1}
    assert result.applied == 1  # t only: s was applied by the other replica
    assert rewards_of_score(first.store.engine, "s") == 1
    del second.scoring.pulled_versions
    assert [sync.sync().applied for sync in (first, second)] == [0, 0]
    for sync in (first, second):
        sync.store.close()


def test_a_replica_that_listed_a_score_before_its_edit_does_not_store_the_older_version(
    db_url, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A replica's listing older than another's sync: its version of the score differed from the one marked, so it
    was stored, over the edit and over the API reward given since."""
    url, server = langfuse
    first, second = replicas(db_url, clock, url)
    first.store.add_spans(group_spans("g", ["7", "8"]))
    server.add_score("s", "human", 0.9, trace_id=trace_id("g", 0))
    read = second.scoring.pulled_versions

    def the_score_is_edited_and_the_other_replica_syncs(score_ids: list[str]) -> dict[str, str]:
        seen = read(score_ids)
        server.touch("s", 0.7)
        assert first.sync().applied == 1
        clock.now += 1
        first.store.add_reward(RewardIn(rollout_id="g-0", name="human", value=0.5))  # given since
        clock.now += 1
        return seen

    second.scoring.pulled_versions = the_score_is_edited_and_the_other_replica_syncs
    result = second.pull()  # its pull alone: on PostgreSQL a sync holds off the other's (`test_a_sync_while_...`)
    assert first.store.trajectory("g-0").rewards == {"human": 0.5}
    assert result.applied == 0
    assert [row["value"] for row in first.scoring.pulled_since(0)] == [0.7]
    del second.scoring.pulled_versions
    assert [sync.sync().applied for sync in (first, second)] == [0, 0]  # both now list the edit, applied once
    for sync in (first, second):
        sync.store.close()


def test_a_score_a_replica_is_storing_is_not_applied_again_by_another(
    db_url, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A replica syncing while another's transaction (the score's reward and mark) was still open stored the score's
    reward a second time."""
    url, server = langfuse
    first, second = replicas(db_url, clock, url)
    if first.store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: the second sync runs after the first")
    first.store.add_spans(group_spans("g", ["7", "8"]))
    server.add_score("s", "human", 0.9, trace_id=trace_id("g", 0))
    mark, other, answers = first.scoring.mark_pulled, ThreadPoolExecutor(1), []

    def the_other_replica_syncs_meanwhile(conn: Connection, rows: list[dict]) -> set[str]:
        marked = mark(conn, rows)
        answers.append(other.submit(second.pull))  # its pull alone: its sync would be skipped (`test_a_sync_...`)
        threading.Event().wait(0.5)  # time for the other sync to store the score too, were it not held back
        return marked

    first.scoring.mark_pulled = the_other_replica_syncs_meanwhile
    assert first.sync().applied == 1
    assert answers[0].result(timeout=30).applied == 0
    other.shutdown()
    assert rewards_of_score(first.store.engine, "s") == 1
    assert first.store.trajectory("g-0").rewards == {"human": 0.9}
    for sync in (first, second):
        sync.store.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_sync_while_another_replicas_runs_is_skipped(
    db_url, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture
) -> None:
    """Two replicas syncing at once could push one score under two ids: one push read the record of a deleted
    trajectory's score, and sent a later trajectory's reward under its id, while the other's deletion of that score
    dropped the record. A sync while another replica's runs is skipped."""
    url, server = langfuse
    first, second = replicas(db_url, clock, url)
    first.store.add_spans(group_spans("g", ["7"]))
    server.add_score("s", "human", 0.9, trace_id=trace_id("g", 0))
    list_scores, answers = server.list_scores, []

    def the_other_replica_syncs_meanwhile(query: dict[str, list[str]]) -> tuple[int, object]:
        server.list_scores = list_scores  # once: during the first's sync
        answers.append(second.sync())
        return list_scores(query)

    server.list_scores = the_other_replica_syncs_meanwhile
    caplog.set_level("INFO", logger="collector.langfuse_sync")
    assert first.sync().applied == 1
    assert [(answer.skipped, answer.pulled) for answer in answers] == [(True, 0)]
    assert [method for method, _ in server.requests] == ["GET"]  # the first's only
    assert "Langfuse sync skipped: another replica is syncing the same database" in caplog.text
    later = second.sync()  # the lock went with the first's sync
    assert (later.skipped, later.pulled, later.applied) == (False, 1, 0)
    for sync in (first, second):
        sync.store.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_sync_whose_lock_connection_is_lost_keeps_its_work_and_says_so(
    db_url, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture
) -> None:
    """The one-replica lock's connection idles while the sync runs; lost (a server's `idle_session_timeout`, a
    restart), the unlock raised after the sync had stored its work: a 503 "nothing was stored" for a sync that was."""
    url, server = langfuse
    first, _ = replicas(db_url, clock, url)
    first.store.add_spans(group_spans("g", ["7"]))
    server.add_score("s", "human", 0.9, trace_id=trace_id("g", 0))
    list_scores = server.list_scores
    holder = text("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND classid = 3 "
                  "AND objid = 0 AND objsubid = 2")

    def the_lock_holder_is_lost_meanwhile(query: dict[str, list[str]]) -> tuple[int, object]:
        with first.store.engine.connect() as conn:
            assert conn.execute(holder).scalars().all() == [True]
        return list_scores(query)

    server.list_scores = the_lock_holder_is_lost_meanwhile
    assert first.sync().applied == 1
    assert first.store.trajectory("g-0").rewards == {"human": 0.9}
    assert "holding the Langfuse sync's one-replica lock was lost during the sync" in caplog.text
    server.list_scores = list_scores
    assert first.sync().skipped is False  # the next sync takes the lock again
    first.store.close()


def test_push_sends_rewards_once_and_updates_changed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url, ART_COLLECTOR_LANGFUSE_PUSH_NAMES="reward")
    app.state.store.add_spans(group_spans("g", ["7", "8"], rewards=[1.0, 0.0]))
    with TestClient(app) as client:
        assert client.post("/v1/langfuse/sync").json()["pushed"] == 2
        sent = {s["traceId"]: s for s in server.created.values()}
        assert {trace_id("g", 0), trace_id("g", 1)} == set(sent)
        first = sent[trace_id("g", 0)]
        assert (first["name"], first["value"], first["dataType"], first["source"]) == ("reward", 1.0, "NUMERIC", "API")
        assert first["metadata"] == {"art.rollout.id": "g-0", "art.group": "g"}
        assert client.post("/v1/langfuse/sync").json()["pushed"] == 0
        client.post("/v1/rewards", json={"rollout_id": "g-0", "name": "reward", "value": 0.5})
        assert client.post("/v1/langfuse/sync").json()["pushed"] == 1
        assert len(server.created) == 2  # the same score, updated in place
        update, = server.of_id(first["id"])
        assert (update["timestamp"], update["value"]) == (first["timestamp"], 0.5)


def test_a_push_assembles_no_trajectory_and_sends_only_what_changed(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each push assembled every trajectory of the store (their spans read and parsed) to compare its rewards with the
    records of the scores pushed, whether anything had changed or not: 2-3.4 s a sync at 10,000 trajectories of two
    spans each on SQLite (4-5.6 s on PostgreSQL), against 0.2-0.9 s (about 1 s) without. It reads the rewards from
    their rows and still sends every change, however it came: a reward by rollout or by trace, a trajectory's span in
    a trace with a reward of its own, a reward pulled from Langfuse and withdrawn there, and a push whose answer was
    lost, sent again under the same id and timestamp by a collector started since; nothing unchanged twice."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    settings = {"push_names": "reward"}
    sync = sync_for(store, url, **settings)
    sync.clock = clock
    store.add_spans(group_spans("g", ["7", "8"], rewards=[1.0, 0.0]))
    sync.scoring.save_judgements("reward", "g", [{"trajectory_id": "g-0", "score": 1.0, "explanation": "right",
                                                  "block": 1, "duplicate_of": None, "created_at": clock.now}])

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the push assembled a trajectory")

    monkeypatch.setattr(assembly, "assemble", refuse)

    def sent() -> dict[str, tuple[str, float, str | None]]:
        """The scores Langfuse holds, by rollout id: (id, value, comment); one per score id and timestamp."""
        assert len({(s["id"], s["timestamp"]) for s in server.created.values()}) == len(server.created)
        return {s["metadata"]["art.rollout.id"]: (s["id"], s["value"], s.get("comment"))
                for s in server.created.values()}

    assert sync.sync().pushed == 2
    first = sent()
    assert {rid: value for rid, (_, value, _) in first.items()} == {"g-0": 1.0, "g-1": 0.0}
    assert first["g-0"][2] == "right" and first["g-1"][2] is None
    assert sync.sync().pushed == 0
    store.add_reward(RewardIn(trace_id=trace_id("g", 1), name="reward", value=0.7))  # a reward by trace
    assert sync.sync().pushed == 1 and sent()["g-1"] == (first["g-1"][0], 0.7, None)
    other = "ab" * 16
    store.add_reward(RewardIn(trace_id=other, name="reward", value=0.2))  # no trajectory holds that trace yet
    assert sync.sync().pushed == 0
    store.add_spans([llm(50, rollout="g-0", trace=other, start=40, prompt=[1, 2], completion=[5])])
    assert sync.sync().pushed == 1 and sent()["g-0"] == (first["g-0"][0], 0.2, "right")
    server.add_score("human", "reward", 0.9, trace_id=trace_id("g", 1))  # a person's score of the same name
    result = sync.sync()
    assert (result.applied, result.pushed) == (1, 1) and sent()["g-1"][1] == 0.9
    server.delete("human")  # the person withdraws it: the reward by trace holds again
    clock.now += 1
    result = sync.sync()
    assert (result.withdrawn, result.pushed) == (1, 1) and sent()["g-1"][1] == 0.7
    store.add_reward(RewardIn(rollout_id="g-1", name="reward", value=0.4))
    _answers_lost(sync)
    with pytest.raises(LangfuseSyncError, match="unreachable"):
        sync.sync()
    assert sent()["g-1"][1] == 0.4 and sync.scoring.read(ScoringStore.pushed_in)[("g-1", "reward")].value == 0.7
    clock.now += 86400
    restarted = sync_for(store, url, **settings)  # a collector started since, on the same database
    restarted.clock = clock
    assert (restarted.sync().pushed, restarted.sync().pushed) == (1, 0)
    assert sent() == {"g-0": (first["g-0"][0], 0.2, "right"), "g-1": (first["g-1"][0], 0.4, None)}
    monkeypatch.undo()
    assert {t.id: t.rewards for t in store.trajectories()} == {"g-0": {"reward": 0.2}, "g-1": {"reward": 0.4}}


def _answers_lost(sync: LangfuseSync) -> Callable[..., object]:
    """Make Langfuse take `sync`'s pushes while their answers never come back (a timeout, a connection cut); returns
    the client's own `scores.create`, to put back."""
    create = sync.client.scores.create

    def taken_answer_lost(**kwargs: object) -> object:
        create(**kwargs)
        raise httpx.ReadTimeout("timed out")

    sync.client.scores.create = taken_answer_lost
    return create


@pytest.mark.parametrize("value", [1.0, 0.5], ids=["unchanged", "edited"])
def test_a_score_whose_push_lost_its_answer_stays_one_score_when_pushed_again_days_later(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], value: float
) -> None:
    """Langfuse keeps a score by its id, name and the date of its timestamp (`fake_langfuse`). A push whose answer was
    lost is not recorded as pushed, and the next push, a day later, sent the score again with that day's timestamp:
    Langfuse held two (the edited reward's new value beside the old one). Every push of a score has its trajectory's
    creation as timestamp, so it updates the one score, a day or forty later."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="reward")
    sync.clock = clock
    store.add_spans(group_spans("g", ["7"], rewards=[1.0]))
    create = _answers_lost(sync)
    with pytest.raises(LangfuseSyncError, match="unreachable"):
        sync.sync()
    assert sync.scoring.read(ScoringStore.pushed_in) == {} and [s["value"] for s in server.created.values()] == [1.0]
    sync.client.scores.create = create
    clock.now += 86400
    store.add_reward(RewardIn(rollout_id="g-0", name="reward", value=value))
    assert sync.sync().pushed == 1
    assert [s["value"] for s in server.created.values()] == [value]
    score_id = next(iter(server.created.values()))["id"]
    clock.now += 40 * 86400
    store.add_reward(RewardIn(rollout_id="g-0", name="reward", value=0.25))
    assert sync.sync().pushed == 1
    assert [(s["id"], s["value"]) for s in server.created.values()] == [(score_id, 0.25)]


def test_a_score_langfuse_rejects_is_not_recorded_as_pushed_and_sent_again_later(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture
) -> None:
    """A score Langfuse rejected in a 207 was recorded as pushed with the chunk's others: never sent again until its
    value changed. Only the accepted ones are recorded (a 207 names no score: the batch is sent again a score at a
    time); a rejected one is sent again after a delay that doubles (a minute, two, ...), or at once when its value
    changes, and each rejected value is logged once."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="reward")
    sync.clock = clock
    store.add_spans(group_spans("g", ["7", "8", "9"], rewards=[1.0, 0.0, 0.5]))
    server.refused_traces = {trace_id("g", 1): "score rejected by validation"}
    result = sync.sync()
    assert (result.pushed, result.push_rejected) == (3, 1)
    assert set(sync.scoring.read(ScoringStore.pushed_in)) == {("g-0", "reward"), ("g-2", "reward")}
    assert sorted(s["metadata"]["art.rollout.id"] for s in server.created.values()) == ["g-0", "g-2"]
    assert [method for method, _ in server.requests].count("POST") == 4  # the batch, then each score alone
    tries = []
    for _ in range(4):  # a sync a minute, Langfuse still rejecting it
        clock.now += 60
        tries.append(sync.sync().push_rejected)
    assert tries == [1, 0, 1, 0]  # after 1 then 2 minutes
    store.add_reward(RewardIn(rollout_id="g-1", name="reward", value=0.25))  # a changed value is sent at once
    assert sync.sync().push_rejected == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "validation" in r.getMessage()]
    assert len(warned) == 2 and "= 0.0 of trajectory g-1" in warned[0] and "= 0.25 of" in warned[1]
    server.refused_traces = {}  # Langfuse accepts it now
    clock.now += 60
    assert (sync.sync().pushed, sync.sync().pushed) == (1, 0)
    assert sync.scoring.read(ScoringStore.pushed_in)[("g-1", "reward")].value == 0.25


def test_a_score_this_store_pushed_is_not_pulled_back_as_a_reward(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """With the API among the pulled sources, the scores the sync pushed (source API) came back in the next pull as
    rewards by trace id: a trajectory's reward given again to every trajectory with a span in its trace."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="reward", sources="API,ANNOTATION")
    store.add_spans(group_spans("g", ["7"], rewards=[1.0]))
    assert sync.sync().pushed == 1
    score, = server.created.values()  # Langfuse lists a pushed score as any other of source API
    server.add_score(score["id"], "reward", score["value"], trace_id=score["traceId"], source="API")
    server.add_score("human", "reward", 0.5, trace_id=score["traceId"], source="API")  # another client's
    result = sync.sync()
    assert (result.pulled, result.applied, result.ignored) == (2, 1, 1)
    with store.engine.connect() as conn:
        by_trace = select(rewards.c.value).where(rewards.c.trace_id == score["traceId"], rewards.c.rollout_id.is_(None))
        assert conn.execute(by_trace).scalars().all() == [0.5]


def test_a_score_pushed_for_a_trajectory_deleted_since_is_deleted_in_langfuse(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A judge's reward of another instrumentation's calls was pushed; the rollout of their trace came and deleted
    their trajectory. Its score stayed in Langfuse, on the rollout's trace, and its push record in the store; the sync
    that deleted it there said so only in its log, not in its result (`retracted`)."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    store.add_spans([_openinference_chain(TRACE_A, 110, sid(101), "tool"),
                     _openinference_llm(TRACE_A, 111, sid(110), marked=False)])
    store.add_spans(group_spans("g", ["7"]))  # a trajectory that stays: its score too
    store.add_rewards([RewardIn(rollout_id=TRACE_A, name="ruler", value=0.3),
                       RewardIn(rollout_id="g-0", name="ruler", value=0.6)])
    first = sync.sync()
    assert (first.pushed, first.retracted) == (2, 0)
    foreign = {s["metadata"]["art.rollout.id"]: s["id"] for s in server.created.values()}[TRACE_A]

    store.add_spans(_ours("r1", TRACE_A, 100))  # deletes the foreign calls' trajectory
    assert [t.id for t in store.trajectories() if t.trace_id == TRACE_A] == ["r1"]
    clock.now += INGEST_DELAY  # Langfuse has ingested the push: its deletion is due
    second = sync.sync()
    assert (second.pushed, second.retracted) == (0, 1)
    assert ("DELETE", f"/api/public/scores/{foreign}") in server.requests
    assert [s["metadata"]["art.rollout.id"] for s in server.created.values()] == ["g-0"]
    assert set(sync.scoring.read(ScoringStore.pushed_in)) == {("g-0", "ruler")}
    server.requests.clear()
    assert sync.sync().retracted == 0
    assert [method for method, _ in server.requests] == ["GET"]  # deleted once


def _pushed_then_orphaned(
    store: SqlStore, sync: LangfuseSync, server: fake_langfuse.FakeLangfuse, clock: Clock, ahead: float = 0.0
) -> str:
    """Push a judge's `ruler` of the foreign calls' trajectory (TRACE_A) and of `g-0`, then delete the former (the
    rollout of its trace comes), and let `clock` (the store's) run to when its score's deletion is due
    (`INGEST_DELAY`); returns the id of its score in Langfuse. The trajectories are stored, and their scores pushed,
    with `clock` `ahead` seconds ahead of the deletion's."""
    clock.now += ahead
    store.add_spans([_openinference_chain(TRACE_A, 110, sid(101), "tool"),
                     _openinference_llm(TRACE_A, 111, sid(110), marked=False)])
    store.add_spans(group_spans("g", ["7"]))
    store.add_rewards([RewardIn(rollout_id=TRACE_A, name="ruler", value=0.3),
                       RewardIn(rollout_id="g-0", name="ruler", value=0.6)])
    assert sync.sync().pushed == 2
    foreign = {s["metadata"]["art.rollout.id"]: s["id"] for s in server.created.values()}[TRACE_A]
    clock.now -= ahead
    store.add_spans(_ours("r1", TRACE_A, 100))
    clock.now += INGEST_DELAY
    return foreign


def failing_deletions(sync: LangfuseSync, failure: Exception) -> list[str]:
    """Make Langfuse fail every deletion of a score with `failure`; returns the list of the score ids asked for."""
    asked: list[str] = []

    def failing(score_id: str, **kwargs: object) -> object:
        asked.append(score_id)
        raise failure

    sync.client.scores.delete = failing
    return asked


@pytest.mark.parametrize("failure", [
    ApiError(status_code=500, body={"message": "Internal Server Error"}),
    ApiError(status_code=429, body={"message": "Too Many Requests"}),
    ApiError(status_code=408, body={"message": "Request Timeout"}),
    httpx.ConnectError("connection refused"),  # an outage
])
def test_a_deletion_langfuse_fails_for_now_is_tried_again_later_and_blocks_no_push(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture,
    failure: Exception,
) -> None:
    """The failed deletion of a pushed score raised out of the sync: every later sync failed there (502), after the
    pull, and pushed nothing again. Then each sync asked again and warned, however long Langfuse kept failing: it is
    tried again after a delay that grows with each failure."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    foreign = _pushed_then_orphaned(store, sync, server, clock)
    delete = sync.client.scores.delete
    asked = failing_deletions(sync, failure)
    store.add_reward(RewardIn(rollout_id="g-0", name="ruler", value=0.9))  # a changed reward to push
    result = sync.sync()
    assert (result.retracted, result.retract_refused, result.retract_failed) == (0, 0, 1)
    assert [s["value"] for s in server.created.values()] == [0.3, 0.9]  # pushed all the same
    # first tried `INGEST_DELAY` (5 minutes) after the push: the score's age
    assert f"Langfuse score {foreign} of deleted trajectory {TRACE_A} not deleted (tried again in 300 s)" in caplog.text
    assert "LANGFUSE_ENABLE_SCORES_V3_API" not in caplog.text
    tries = []
    for _ in range(15):  # a sync a minute
        clock.now += 60
        tries.append(sync.sync().retract_failed)
    assert tries == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]  # after 5 then 10 minutes (the score's age)
    assert asked == [foreign] * 3 and [row["score_id"] for row in sync.scoring.to_retract()] == [foreign]

    sync.client.scores.delete = delete  # Langfuse deletes again
    clock.now += 1200
    result = sync.sync()
    assert (result.retracted, result.retract_failed) == (1, 0)
    assert [s["metadata"]["art.rollout.id"] for s in server.created.values()] == ["g-0"]
    assert set(sync.scoring.read(ScoringStore.pushed_in)) == {("g-0", "ruler")} and sync.scoring.to_retract() == []


def test_the_retry_delay_grows_though_the_score_was_pushed_at_a_time_ahead_of_the_clock(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """The delay is as long as the age of the score's timestamp: a score whose trajectory a replica with a clock a day
    ahead stored and pushed (or this machine, before its clock moved back) had a negative age, and the delay stayed
    at its least (a minute) however long Langfuse kept failing. The age counts from the first failure then, and the
    delay grows as for any score."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    foreign = _pushed_then_orphaned(store, sync, server, clock, ahead=86400.0)  # then the clock moved back a day
    asked = failing_deletions(sync, ApiError(status_code=503, body={"message": "Service Unavailable"}))
    tries = []
    for _ in range(9):  # a sync a minute
        tries.append(sync.sync().retract_failed)
        clock.now += 60
    assert tries == [1, 1, 1, 0, 1, 0, 0, 0, 1]  # at once, after 1 minute (the least), 1, 2 then 4
    assert asked == [foreign] * 5


@pytest.mark.parametrize(("retry_after", "delay"), [
    ("2400", 2400.0),
    ("date", 2400.0),  # an HTTP date 40 minutes ahead
    ("86400", 3600.0),  # Langfuse Cloud's daily limit of deletions: an hour at most
    ("10", 300.0),  # sooner than the growing delay: that holds
    ("soon", 300.0),  # no delay: the growing one holds
])
def test_a_deletion_langfuse_rate_limits_is_tried_again_no_sooner_than_its_retry_after(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], retry_after: str, delay: float
) -> None:
    """A 429's (or 503's) `Retry-After` was ignored: the deletion was tried again after the growing delay (here the
    score's age, 5 minutes), sooner than Langfuse asked. It waits as long as Langfuse asks, within an hour."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    _pushed_then_orphaned(store, sync, server, clock)
    header = email.utils.formatdate(clock.now + 2400, usegmt=True) if retry_after == "date" else retry_after
    failing_deletions(sync, ApiError(status_code=429, headers={"Retry-After": header}, body={"message": "Too Many"}))
    assert sync.sync().retract_failed == 1
    assert [row["retract_at"] for row in sync.scoring.to_retract()] == [clock.now + delay]


@pytest.mark.parametrize("status", [400, 401, 403, 405])
def test_a_deletion_langfuse_refuses_is_given_up_once(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    """A server that refuses every deletion (a key not allowed to delete, a proxy without the method) was asked again,
    with a warning, on every sync for good: the refusal is final, logged once and counted, and the record dropped."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    foreign = _pushed_then_orphaned(store, sync, server, clock)
    asked = failing_deletions(sync, ApiError(status_code=status, body={"message": "no"}))
    result = sync.sync()
    assert (result.retracted, result.retract_refused, result.retract_failed) == (0, 1, 0)
    assert f"Langfuse score {foreign} of deleted trajectory {TRACE_A} not deleted, and not tried again" in caplog.text
    for _ in range(3):
        clock.now += 3600
        result = sync.sync()
        assert (result.retracted, result.retract_refused, result.retract_failed) == (0, 0, 0)
    assert asked == [foreign] and sync.scoring.to_retract() == []
    assert set(sync.scoring.read(ScoringStore.pushed_in)) == {("g-0", "ruler")}


def test_a_score_langfuse_no_longer_has_counts_as_deleted(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """Langfuse before version 3 answered 404 to the deletion of a score it did not have (a person deleted it): it
    was taken for a failure and asked again on every sync."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    foreign = _pushed_then_orphaned(store, sync, server, clock)
    asked = failing_deletions(sync, ApiError(status_code=404, body={"message": "Score not found within authorized "
                                                                     "project"}))
    assert (sync.sync().retracted, sync.sync().retracted) == (1, 0)
    assert asked == [foreign] and sync.scoring.to_retract() == []


@pytest.mark.parametrize("body", ["<html><h1>404 Not Found</h1><hr>nginx</html>", {"message": "not found"}],
                         ids=["html", "json"])
def test_a_404_that_is_not_langfuses_does_not_count_as_deleted(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture,
    body: object,
) -> None:
    """A proxy in front of Langfuse that answers 404 to DELETE (a route for GET only) took every deletion for done:
    the records dropped without a word, the scores left in Langfuse. Only Langfuse's own 404 (its message) says the
    score is gone; another is a refusal: logged with what to check, counted, given up."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    foreign = _pushed_then_orphaned(store, sync, server, clock)
    asked = failing_deletions(sync, ApiError(status_code=404, body=body))
    result = sync.sync()
    assert (result.retracted, result.retract_refused, result.retract_failed) == (0, 1, 0)
    assert f"Langfuse score {foreign} of deleted trajectory {TRACE_A} not deleted, and not tried again" in caplog.text
    assert "does a proxy in front of it pass DELETE /api/public/scores/{scoreId} on?" in caplog.text
    assert asked == [foreign]


def test_a_failure_for_now_leaves_the_other_deletions_to_the_next_sync(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """Langfuse down mid-retract: each marked score waited for its own timeout, one after another, in one sync. The
    first failure ends the sync's deletions; the next sync goes on with the others, the failed one after its delay."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    store.add_spans(group_spans("g", ["7", "8", "9"]))
    store.add_rewards([RewardIn(rollout_id=f"g-{n}", name="ruler", value=0.5) for n in range(3)])
    assert sync.sync().pushed == 3
    with store.engine.begin() as conn:  # their trajectories deleted, their scores marked at once
        for n in range(3):
            ScoringStore.retract_pushed(conn, [f"g-{n}"], clock.now)
    clock.now += INGEST_DELAY  # Langfuse has ingested the push: the deletions are due
    sync = sync_for(store, url)  # pushing nothing (the trajectories are still there)
    sync.clock = clock
    delete = sync.client.scores.delete
    asked = failing_deletions(sync, httpx.ConnectError("connection refused"))
    result = sync.sync()
    assert (result.retracted, result.retract_failed) == (0, 1) and len(asked) == 1
    sync.client.scores.delete = delete
    result = sync.sync()
    assert (result.retracted, result.retract_failed) == (2, 0)  # the failed one waits for its delay
    assert [row["score_id"] for row in sync.scoring.to_retract()] == asked
    clock.now += INGEST_DELAY  # the failed one's delay: its age
    assert sync.sync().retracted == 1 and server.created == {}


def test_more_marked_scores_than_a_page_are_all_deleted_by_one_sync(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """The marked records are read a page at a time (not all at once); one sync goes through every page."""
    url, server = langfuse
    store = make_store()
    sync = sync_for(store, url)
    sync.clock = clock
    rows = [{"trajectory_id": f"gone-{n}", "name": "ruler", "value": 0.5, "score_id": f"score-{n}",
             "pushed_at": clock.now, "created_at": clock.now} for n in range(PAGE + 30)]
    sync.scoring.mark_pushed(rows, clock.now)  # their trajectories are gone: marked
    result = sync.sync()
    assert (result.retracted, result.retract_failed) == (PAGE + 30, 0)
    deleted = sorted(path.rsplit("/", 1)[1] for method, path in server.requests if method == "DELETE")
    assert deleted == sorted(row["score_id"] for row in rows) and sync.scoring.to_retract() == []


def test_a_deleted_trajectorys_score_is_deleted_though_its_id_is_written_again(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A call of ours outside the rollout, in the trace of the deleted foreign calls, made a trajectory of the same id
    (the trace id) before the next sync: the sync took the deleted one's score for the new one's, and it stayed in
    Langfuse for good. It is deleted; the new trajectory's own score, pushed later, had the same score id, so that
    Langfuse, which queues deletions, could apply the deletion after the push and delete it: its id is another."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    foreign = _pushed_then_orphaned(store, sync, server, clock)
    clock.now += 60  # a later export
    store.add_spans([llm(130, rollout=None, trace=TRACE_A, start=30, prompt=[1, 2], completion=[5])])
    assert store.trajectory(TRACE_A).rewards == {}
    queued: list[str] = []
    sync.client.scores.delete = lambda score_id, **kwargs: queued.append(score_id)  # accepted, applied later
    assert sync.sync().retracted == 1 and queued == [foreign]

    clock.now += 60
    store.add_reward(RewardIn(rollout_id=TRACE_A, name="ruler", value=0.8))  # the new trajectory's own
    server.requests.clear()
    result = sync.sync()
    assert (result.retracted, result.pushed) == (0, 1)
    assert [method for method, _ in server.requests] == ["GET", "POST"]
    for score_id in queued:  # Langfuse applies the queued deletion after the push
        server.delete(score_id)
    assert [(s["metadata"]["art.rollout.id"], s["value"]) for s in server.created.values()] == [
        ("g-0", 0.6), (TRACE_A, 0.8)
    ]
    assert sync.scoring.to_retract() == []


@pytest.mark.parametrize("value", [0.3, 0.8])
def test_a_later_trajectory_of_a_deleted_ones_id_pushes_its_score_once_the_deleted_ones_is_deleted(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], value: float
) -> None:
    """The new trajectory of the deleted one's id has a reward of the same name by the next sync: the sync deletes the
    deleted one's score and sends the new one's, under another id, by the sync after (the record of the deleted one's
    holds its id until then), as new (even at the same value)."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    foreign = _pushed_then_orphaned(store, sync, server, clock)
    clock.now += 60
    store.add_spans([llm(130, rollout=None, trace=TRACE_A, start=30, prompt=[1, 2], completion=[5])])
    store.add_reward(RewardIn(rollout_id=TRACE_A, name="ruler", value=value))
    server.requests.clear()
    result = sync.sync()
    assert (result.pushed, result.retracted) == (0, 1)
    assert [method for method, _ in server.requests] == ["GET", "DELETE"] and server.of_id(foreign) == []
    result = sync.sync()
    assert (result.pushed, result.retracted) == (1, 0)
    ours = {s["id"]: s["value"] for s in server.created.values() if s["metadata"]["art.rollout.id"] == TRACE_A}
    assert list(ours.values()) == [value] and foreign not in ours
    record = sync.scoring.read(ScoringStore.pushed_in)[(TRACE_A, "ruler")]
    assert sync.scoring.to_retract() == [] and (record.value, record.score_id) == (value, next(iter(ours)))


def test_a_score_pushed_before_its_id_changed_keeps_it(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A record of a score pushed under an id derived otherwise (an earlier collector's) keeps its id: a changed
    reward updates that score in Langfuse, no second one."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    store.add_spans(group_spans("g", ["7"]))
    store.add_reward(RewardIn(rollout_id="g-0", name="ruler", value=0.5))
    sync.scoring.mark_pushed([{"trajectory_id": "g-0", "name": "ruler", "value": 0.5, "score_id": "earlier",
                               "pushed_at": clock.now, "created_at": created_at(sync.scoring, "g-0")}], clock.now)
    store.add_reward(RewardIn(rollout_id="g-0", name="ruler", value=0.7))
    assert sync.sync().pushed == 1
    assert [(s["id"], s["value"]) for s in server.created.values()] == [("earlier", 0.7)]


def _foreign_calls_judged(store: SqlStore) -> None:
    """Store the trajectory of another instrumentation's calls in TRACE_A, with a judge's `ruler` of 0.3."""
    store.add_spans([_openinference_chain(TRACE_A, 110, sid(101), "tool"),
                     _openinference_llm(TRACE_A, 111, sid(110), marked=False)])
    store.add_rewards([RewardIn(rollout_id=TRACE_A, name="ruler", value=0.3)])


def test_a_score_pushed_while_its_trajectory_is_deleted_is_deleted(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """The push read the trajectories, then the rollout of the foreign calls' trace deleted theirs before the push
    was recorded: the record of the score sent for the deleted trajectory must stay marked to delete it (once
    Langfuse has ingested the push)."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    _foreign_calls_judged(store)
    create = sync.client.scores.create

    def the_rollout_comes_meanwhile(**kwargs: object) -> object:
        store.add_spans(_ours("r1", TRACE_A, 100))
        return create(**kwargs)

    sync.client.scores.create = the_rollout_comes_meanwhile
    result = sync.sync()
    assert (result.pushed, result.retracted) == (1, 0) and len(server.created) == 1
    clock.now += INGEST_DELAY
    assert sync.sync().retracted == 1
    assert server.created == {} and sync.scoring.read(ScoringStore.pushed_in) == {} and sync.scoring.to_retract() == []


def _ingested_later(sync: LangfuseSync, server: fake_langfuse.FakeLangfuse,
                    meanwhile: Callable[[], object] = lambda: None) -> tuple[Callable[..., object], dict[str, Any]]:
    """Make `sync`'s pushes accepted but not yet ingested (Langfuse's worker applies them later): the scores sent are
    held in the dict returned, not in `server.created`; `meanwhile` runs while each push is in flight. Returns the
    client's own `scores.create` too, to put back."""
    create, ingesting = sync.client.scores.create, {}

    def accepted_not_ingested(**kwargs: object) -> object:
        meanwhile()
        answer = create(**kwargs)
        ingesting.update(server.created)
        server.created.clear()
        return answer

    sync.client.scores.create = accepted_not_ingested
    return create, ingesting


def test_a_score_pushed_while_its_trajectory_is_deleted_is_deleted_once_langfuse_has_it(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """Langfuse ingests a push asynchronously (its worker, within about a minute) and may apply a deletion that comes
    first to nothing: the score pushed for a trajectory deleted while the push was in flight was deleted by the same
    sync, milliseconds after its push, and stayed in Langfuse for good. Its deletion waits `INGEST_DELAY`."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    _foreign_calls_judged(store)
    create, ingesting = _ingested_later(sync, server, lambda: store.add_spans(_ours("r1", TRACE_A, 100)))
    sync.sync()  # the rollout comes while the push is in flight
    server.created.update(ingesting)  # Langfuse ingests the push
    sync.client.scores.create = create
    clock.now += INGEST_DELAY
    sync.sync()
    assert server.created == {} and sync.scoring.read(ScoringStore.pushed_in) == {} and sync.scoring.to_retract() == []


def test_a_score_pushed_just_before_its_trajectory_is_deleted_is_deleted_once_langfuse_has_it(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """The trajectory was deleted a second after its score's push was recorded, and a sync (`POST /v1/langfuse/sync`)
    came a second later: the deletion went out two seconds after the push, Langfuse could apply it before ingesting
    the push, and the score stayed for good. It waits `INGEST_DELAY` after the push, as for a push in flight."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    _foreign_calls_judged(store)
    create, ingesting = _ingested_later(sync, server)
    assert sync.sync().pushed == 1
    sync.client.scores.create = create
    clock.now += 1
    store.add_spans(_ours("r1", TRACE_A, 100))  # deletes the foreign calls' trajectory
    clock.now += 1
    assert sync.sync().retracted == 0  # not yet
    server.created.update(ingesting)  # Langfuse ingests the push
    clock.now += INGEST_DELAY
    assert sync.sync().retracted == 1
    assert server.created == {} and sync.scoring.read(ScoringStore.pushed_in) == {} and sync.scoring.to_retract() == []


def test_a_score_pushed_again_just_before_its_trajectory_is_deleted_is_deleted_once_langfuse_has_it_again(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A changed reward pushes its score again, under the same id, and Langfuse ingests that push anew: the deletion
    waited `INGEST_DELAY` after the score's first push only, so it went out seconds after the second push, Langfuse
    could apply it before ingesting that push, and the score came back for good."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    _foreign_calls_judged(store)
    assert sync.sync().pushed == 1  # ingested at once
    clock.now += INGEST_DELAY - 10
    store.add_rewards([RewardIn(rollout_id=TRACE_A, name="ruler", value=0.9)])  # the judge changes its reward
    create, ingesting = _ingested_later(sync, server)
    assert sync.sync().pushed == 1
    sync.client.scores.create = create
    clock.now += 1
    store.add_spans(_ours("r1", TRACE_A, 100))  # deletes the foreign calls' trajectory
    clock.now += 10  # past `INGEST_DELAY` after the first push, seconds after the second
    assert sync.sync().retracted == 0  # not yet
    server.created.update(ingesting)  # Langfuse ingests the second push
    clock.now += INGEST_DELAY
    assert sync.sync().retracted == 1
    assert server.created == {} and sync.scoring.read(ScoringStore.pushed_in) == {} and sync.scoring.to_retract() == []


def test_a_score_pushed_while_its_trajectory_is_deleted_and_created_again_is_deleted(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """While the push's request was in flight, the rollout of the foreign calls' trace deleted theirs and a call of
    ours outside the rollout made a trajectory of the same id: the record of the deleted one's score was taken for
    the new one's, and that score stayed in Langfuse for good. It is deleted; the new one's own score goes under
    another id."""
    url, server = langfuse
    store = make_store(min_group_size=1)
    sync = sync_for(store, url, push_names="ruler")
    sync.clock = clock
    _foreign_calls_judged(store)
    create = sync.client.scores.create

    def deleted_and_created_again_meanwhile(**kwargs: object) -> object:
        store.add_spans(_ours("r1", TRACE_A, 100))
        clock.now += 60  # a later export
        store.add_spans([llm(130, rollout=None, trace=TRACE_A, start=30, prompt=[1, 2], completion=[5])])
        return create(**kwargs)

    sync.client.scores.create = deleted_and_created_again_meanwhile
    result = sync.sync()
    assert (result.pushed, result.retracted) == (1, 0)
    clock.now += INGEST_DELAY
    assert sync.sync().retracted == 1
    assert server.created == {} and sync.scoring.read(ScoringStore.pushed_in) == {} and sync.scoring.to_retract() == []
    sync.client.scores.create = create
    store.add_reward(RewardIn(rollout_id=TRACE_A, name="ruler", value=0.8))  # the new trajectory's own
    assert sync.sync().pushed == 1
    assert [(s["metadata"]["art.rollout.id"], s["value"]) for s in server.created.values()] == [(TRACE_A, 0.8)]


@pytest.mark.parametrize(("listed", "applied"), [
    ("2026-01-01T11:00:00+02:00", False),  # the same version (09:00 UTC), at another offset
    ("2026-01-01T10:00:00.5+02:00", False),  # an older version (08:00:00.5 UTC)
    ("2026-01-01T08:00:00.5-01:00", True),  # a newer one (09:00:00.5 UTC)
    ("2026-01-01T08:59:59.999Z", False),
    ("2026-01-01T09:00:00.001Z", True),
])
def test_score_versions_are_ordered_by_time_whatever_offset_and_precision_langfuse_writes(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], listed: str, applied: bool
) -> None:
    """Versions (`updatedAt`) were compared as they were written: one at another UTC offset sorted by its local time,
    so the same or an older version of a pulled score was applied again, over the reward given since. (Versions
    stored before: `test_schema.test_migration_from_version_8_marks_orphaned_pushes_and_rewrites_score_versions`.)"""
    url, server = langfuse
    store = make_store()
    sync = sync_for(store, url)
    store.add_spans(group_spans("g", ["7"]))
    server.add_score("s", "human", 0.9, trace_id=trace_id("g", 0))
    server.scores["s"]["updatedAt"] = "2026-01-01T09:00:00.000Z"
    assert sync.sync().applied == 1
    clock.now += 1
    store.add_reward(RewardIn(rollout_id="g-0", name="human", value=0.5))  # given since: only an edit overrides it
    clock.now += 1
    server.scores["s"]["updatedAt"] = listed
    assert sync.sync().applied == int(applied)
    assert store.trajectory("g-0").rewards == {"human": 0.9 if applied else 0.5}


def _sync_status(client: TestClient, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """`GET /v1/langfuse/sync`'s answer once `until` holds of it (the schedule's syncs run meanwhile), within 10 s."""
    deadline = time.monotonic() + 10
    while True:
        answer = client.get("/v1/langfuse/sync")
        assert answer.status_code == 200 and answer.headers["cache-control"] == "no-store", answer.text
        if until(answer.json()) or time.monotonic() > deadline:
            return answer.json()
        time.sleep(0.05)


def test_the_last_sync_and_the_latest_failure_are_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """The failure of the latest sync was kept (`Scoring.last_sync_error`), and the last sync's counts, but nothing
    read them: a schedule that kept failing (a key that lost its rights, Langfuse down) showed only in the log.
    `GET /v1/langfuse/sync` shows the last sync that succeeded and, until another succeeds, the latest failure."""
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url, ART_COLLECTOR_LANGFUSE_SYNC_SECONDS="0.2")
    app.state.store.add_spans(group_spans("g", ["7"]))
    server.add_score("s", "human", 0.5, trace_id=trace_id("g", 0))
    list_scores = server.list_scores
    server.list_scores = lambda query: (403, {"message": "Forbidden"})  # a key not allowed to read scores
    with TestClient(app) as client:  # the lifespan starts the schedule
        failed = _sync_status(client, lambda status: status["last_error"] is not None)
        assert failed["last_sync"] is None and failed["last_sync_at"] is None
        assert failed["last_error"].startswith("LangfuseSyncError: Langfuse GET /api/public/v3/scores answered 403")
        assert "allowed to read and write scores" in failed["last_error"]
        assert isinstance(failed["last_error_at"], float)
        server.list_scores = list_scores
        done = _sync_status(client, lambda status: status["last_error"] is None)
        assert done["last_sync"]["pulled"] == 1 and done["last_sync_at"] >= failed["last_error_at"]
        assert client.get("/v1/trajectories/g-0").json()["rewards"] == {"human": 0.5}
        server.list_scores = lambda query: (403, {"message": "Forbidden"})
        assert client.post("/v1/langfuse/sync").status_code == 502  # a sync asked for fails the same way
        shown = client.get("/v1/langfuse/sync").json()
        assert "answered 403" in shown["last_error"] and shown["last_error_at"] >= done["last_sync_at"]
        assert shown["last_sync"]["pulled"] == 1  # the last one that succeeded, still


def test_scheduled_sync_runs_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url, ART_COLLECTOR_LANGFUSE_SYNC_SECONDS="0.2")
    server.add_score("s", "human", 0.5, trace_id=trace_id("g", 0))
    with TestClient(app) as client:  # the lifespan starts the schedule
        status = _sync_status(client, lambda status: status["last_sync"] is not None)
        assert status["last_sync"]["applied"] == 1


def test_wrong_keys_answer_502_naming_langfuse_and_the_key_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url, LANGFUSE_SECRET_KEY="wrong")
    with TestClient(app) as client:
        answer = client.post("/v1/langfuse/sync")
        assert answer.status_code == 502
        message = answer.json()["message"]
        assert answer.json()["error"] == "langfuse_error" and "401" in message
        assert "ART_COLLECTOR_LANGFUSE_SECRET_KEY" in message
        assert len(server.requests) == 1  # a refused key is not asked again within the sync


def test_an_unreachable_langfuse_is_named_without_the_password_of_its_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A host with a password (the key pair as `https://pk:sk@host`, which httpx sends as Basic auth): the error of
    a sync that cannot reach it, answered and logged, named it whole."""
    app = app_for(tmp_path, monkeypatch, f"http://pk-lf-test:hunter2@127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING), TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/v1/langfuse/sync")
    assert answer.status_code == 502 and answer.json()["error"] == "langfuse_unreachable"
    assert "unreachable at http://pk-lf-test:***@127.0.0.1:" in answer.json()["message"]
    assert "hunter2" not in answer.text and "hunter2" not in caplog.text


def test_a_langfuse_timeout_past_a_week_is_refused_and_a_week_works() -> None:
    """A timeout of 1e10 s (for "none") made every call an `OverflowError` inside httpx, no `LangfuseSyncError`: every
    sync failed with a 500, as the judge's calls did before its timeout was bounded."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="less than or equal to 604800"):
        LangfuseSettings(timeout_seconds=1e10)
    week = LangfuseSettings(host=f"http://127.0.0.1:{free_port()}", public_key=fake_langfuse.PUBLIC,
                            secret_key=fake_langfuse.SECRET, timeout_seconds=7 * 24 * 3600)
    with pytest.raises(LangfuseSyncError) as caught:
        langfuse_api.LangfuseCalls(make_client(week), week).scores(limit=1)
    assert caught.value.code == "langfuse_unreachable"


def test_a_self_hosted_langfuse_without_the_v3_scores_api_is_named_in_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    server.v3_enabled = False  # self-hosted Langfuse started without LANGFUSE_ENABLE_SCORES_V3_API=true
    app = app_for(tmp_path, monkeypatch, url)
    with TestClient(app) as client:
        answer = client.post("/v1/langfuse/sync")
        assert answer.status_code == 502 and answer.json()["error"] == "langfuse_error"
        assert "404" in answer.json()["message"] and "LANGFUSE_ENABLE_SCORES_V3_API=true" in answer.json()["message"]


def test_only_numeric_and_boolean_scores_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    url, server = langfuse
    app = app_for(tmp_path, monkeypatch, url)
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    server.add_score("n", "human", 0.5, trace_id=trace_id("g", 0))
    server.add_score("b", "human", False, trace_id=trace_id("g", 1), data_type="BOOLEAN")
    server.add_score("c", "human", "good", trace_id=trace_id("g", 1), data_type="CATEGORICAL")
    server.add_score("r", "human", "x", trace_id=trace_id("g", 0), data_type="RANKING")  # a type this SDK predates
    with TestClient(app) as client:
        result = client.post("/v1/langfuse/sync").json()  # the other types cannot hold up the sync
        assert (result["pulled"], result["applied"], result["ignored"]) == (2, 2, 0)
        assert client.get("/v1/trajectories/g-0").json()["rewards"] == {"human": 0.5}
        assert client.get("/v1/trajectories/g-1").json()["rewards"] == {"human": 0.0}


@pytest.mark.parametrize("value", [None, "x"], ids=["null", "text"])
def test_a_score_the_sdks_model_rejects_is_ignored_and_the_rest_of_its_page_pulled(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture,
    value: object,
) -> None:
    """A NUMERIC score whose value is null (as JavaScript's JSON writes a NaN), which the SDK's model of a score
    rejects: the whole page failed on every sync (502), and no other score of it was ever pulled. That score is ignored
    (logged, counted), and never taken for one deleted in Langfuse; the page's others are read with the SDK's model."""
    url, server = langfuse
    store = make_store()
    store.add_spans(group_spans("g", ["7", "8"]))
    sync = sync_for(store, url)
    server.add_score("fine", "human", 0.25, trace_id=trace_id("g", 1))
    assert sync.sync().applied == 1
    server.add_score("odd", "human", value, trace_id=trace_id("g", 0))
    server.add_score("later", "human", 0.75, trace_id=trace_id("g", 0))
    server.touch("fine", value)  # a pulled score turns unreadable: still Langfuse's
    result = sync.sync()
    assert (result.pulled, result.applied, result.ignored, result.withdrawn) == (3, 1, 2, 0)
    assert store.trajectory("g-0").rewards == {"human": 0.75} and store.trajectory("g-1").rewards == {"human": 0.25}
    assert "Langfuse score odd does not fit Langfuse's API definition (NUMERIC.value: Input should" in caplog.text
    caplog.clear()
    assert (sync.sync().withdrawn, sync.sync().ignored) == (0, 2)
    assert "Langfuse score odd" not in caplog.text  # logged once, not on every sync of the lookback


def test_a_rejected_score_without_an_id_is_counted_and_said_so(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listed item the SDK's model rejects for want of an id was left out of `pulled` and `ignored` and logged as
    `Langfuse score None`."""
    url, server = langfuse
    store = make_store()
    store.add_spans(group_spans("g", ["7"]))
    sync = sync_for(store, url)
    server.add_score("fine", "human", 0.25, trace_id=trace_id("g", 0))
    get = sync.api._get

    def with_an_item_without_id(path: str, params: dict[str, object], options: object) -> object:
        body = get(path, params, options)
        body["data"].append({"dataType": "NUMERIC", "name": "human", "value": 0.5})
        return body

    monkeypatch.setattr(sync.api, "_get", with_an_item_without_id)
    result = sync.sync()
    assert (result.pulled, result.applied, result.ignored) == (2, 1, 1)
    assert "Langfuse score without an id does not fit Langfuse's API definition" in caplog.text


@pytest.mark.parametrize("odd", ["s" * 257, "score-\ud800", "score-\x00"], ids=["too-long", "lone-surrogate", "nul"])
def test_a_score_whose_id_the_store_cannot_hold_is_ignored(
    make_store, clock, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture, odd: str
) -> None:
    """Langfuse takes any score id a client sends, and JSON can carry a lone surrogate: the store's error on such a
    score's record (longer than its column, not UTF-8) failed every pull while the score was in the lookback, and
    applied no other score (PostgreSQL: one with a NUL too). It is ignored, as a score on a non-OpenTelemetry trace
    is."""
    url, server = langfuse
    store = make_store()
    store.add_spans(group_spans("g", ["7", "8"]))
    sync = sync_for(store, url)
    server.add_score(odd, "human", 0.5, trace_id=trace_id("g", 0))
    server.add_score("fine", "human", 0.25, trace_id=trace_id("g", 1))
    result = sync.sync()
    assert (result.pulled, result.applied, result.ignored) == (2, 1, 1)
    assert store.trajectory("g-0").rewards == {} and store.trajectory("g-1").rewards == {"human": 0.25}
    assert "its id is no UTF-8 text of at most 256 characters with no NUL; ignored" in caplog.text
    assert sync.sync().withdrawn == 0


def test_a_score_on_a_trace_id_of_odd_case_or_length_is_applied_or_ignored_and_said_once(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse], caplog: pytest.LogCaptureFixture
) -> None:
    """Langfuse takes any trace id: one in upper case is the OpenTelemetry trace's; one a digit short is no
    OpenTelemetry one, ignored, and said once: every sync pulls the whole lookback again, and warned of it each time
    (a sync a minute, for the week of the lookback)."""
    url, server = langfuse
    store = make_store()
    store.add_spans(group_spans("g", ["7"]))
    sync = sync_for(store, url)
    server.add_score("upper", "human", 0.5, trace_id=trace_id("g", 0).upper())
    server.add_score("short", "human", 0.25, trace_id=trace_id("g", 0)[:-1])
    results = [sync.sync(), sync.sync()]
    assert [(r.pulled, r.applied, r.ignored) for r in results] == [(2, 1, 1), (2, 0, 1)]
    assert store.trajectory("g-0").rewards == {"human": 0.5}
    assert caplog.text.count("Langfuse score short cannot be a reward") == 1


@pytest.mark.parametrize("body", [{"items": []}, {"data": [], "meta": {"cursor": 5}}, ["not", "a", "page"]])
def test_an_answer_the_sdk_cannot_read_is_502_naming_langfuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, langfuse: tuple[str, fake_langfuse.FakeLangfuse], body: object
) -> None:
    url, server = langfuse
    server.list_scores = lambda query: (200, body)  # a proxy's page: no page of scores
    app = app_for(tmp_path, monkeypatch, url)
    with TestClient(app) as client:
        answer = client.post("/v1/langfuse/sync")
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"] == "langfuse_error" and "does not define" in answer.json()["message"]
        assert client.get("/v1/langfuse/sync").json()["last_error"].startswith(
            "LangfuseSyncError: Langfuse GET /api/public/v3/scores answered something its API does not define"
        )


def test_a_listing_that_answers_an_earlier_pages_cursor_again_fails_the_pull(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """A proxy that caches by path answers every page with the first, cursor and all: the pull asked for the same page
    forever, holding the sync's lock, its scores growing. It fails at the cursor's second coming, naming Langfuse."""
    url, server = langfuse
    store = make_store()
    sync = sync_for(store, url)
    for n in range(PAGE + 1):
        server.add_score(f"s{n}", "human", 0.5, trace_id=trace_id("g", n))
    list_scores, answers = server.list_scores, []

    def cached(query: dict[str, list[str]]) -> tuple[int, Any]:
        if len(answers) == 10:  # a pull that never notices ends all the same: the last page, no cursor
            return 200, {"data": [], "meta": {"limit": PAGE}}
        answers.append(answers[0] if answers else list_scores(query))
        return answers[-1]

    server.list_scores = cached
    with pytest.raises(LangfuseSyncError, match="answered the cursor of an earlier page again"):
        sync.sync()
    assert len(answers) == 2  # the first page, then the first again: its cursor again
    server.list_scores = list_scores
    assert sync.sync().pulled == PAGE + 1


def test_an_sdk_without_the_http_client_the_sync_reads_through_is_refused_naming_its_version(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """The sync reads scores through a private attribute of the SDK's client (no public call gives a page without the
    SDK's model of it): an SDK that dropped it failed every sync with an `AttributeError` deep in the pull. The sync
    is refused where it is made, naming the installed SDK's version."""
    url, _ = langfuse
    store = make_store()
    settings = LangfuseSettings(host=url, public_key=fake_langfuse.PUBLIC, secret_key=fake_langfuse.SECRET)
    client = make_client(settings)
    del client._client_wrapper
    with pytest.raises(LangfuseSyncError, match=f"langfuse SDK {langfuse_version} has no HTTP client") as refused:
        LangfuseSync(store, ScoringStore(store.engine), settings, client=client)
    assert refused.value.code == "langfuse_sdk_unsupported"


def test_the_stand_in_lists_newest_first_with_langfuse_time_format(
    langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    _, server = langfuse
    start = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    server.add_score("whole", "human", 1.0, trace_id="a" * 32, timestamp=start)
    server.add_score("later", "human", 1.0, trace_id="a" * 32, timestamp=start + dt.timedelta(microseconds=678_901))
    status, body = server.list_scores({})
    assert status == 200 and [s["id"] for s in body["data"]] == ["later", "whole"]
    assert [s["timestamp"] for s in body["data"]] == ["2026-01-02T03:04:05.678Z", "2026-01-02T03:04:05.000Z"]


def _score(timestamp: str | None, name: str = "reward", value: float = 1.0) -> dict[str, Any]:
    """A score as the collector pushes it, of id `s`."""
    score = {"id": "s", "traceId": "a" * 32, "name": name, "value": value, "dataType": "NUMERIC", "source": "API"}
    return score if timestamp is None else {**score, "timestamp": timestamp}


def test_the_stand_in_keeps_a_score_sent_again_on_another_date_or_name_beside_the_first(
    langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """It kept one score per id: one sent again under the same id on another date replaced the first, where Langfuse
    keeps both, so a test of the push could not see a duplicate."""
    _, server = langfuse
    assert server.create_scores([_score("2026-01-02T03:04:05.000Z")])[0] == 202
    server.create_scores([_score("2026-01-02T23:59:59.999+00:00", value=0.5)])  # the same day in UTC: replaced
    assert [(s["timestamp"], s["value"]) for s in server.of_id("s")] == [("2026-01-02T23:59:59.999+00:00", 0.5)]
    server.create_scores([_score("2026-01-03T00:30:00+01:00", value=0.25)])  # 23:30 UTC on the 2nd: replaced
    server.create_scores([_score("2026-01-03T00:00:00Z", value=0.75)])  # the next day: another score
    server.create_scores([_score("2026-01-02T03:04:05Z", name="other")])  # another name: another score
    assert sorted((s["name"], s["value"]) for s in server.of_id("s")) == [("other", 1.0), ("reward", 0.25),
                                                                          ("reward", 0.75)]
    server.create_scores([_score(None, value=0.1)])  # no timestamp: the time of the request
    today = [s for s in server.of_id("s") if s["value"] == 0.1]
    assert len(today) == 1 and fake_langfuse.score_key(today[0])[2] == dt.datetime.now(dt.UTC).date()
    status, body = server.create_scores([_score("yesterday")])
    assert (status, body["rejected"]) == (207, 1)
    server.delete("s")
    assert server.created == {}


def test_the_stand_in_pages_by_timestamp_and_id_as_langfuse_does(
    langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """Its cursor was an offset: a score added between two pages shifted the next page, which listed a score of the
    first again. Langfuse's cursor holds the page's last (timestamp, id), and the next page starts below it."""
    _, server = langfuse
    start = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    for score_id, seconds in (("a", 2), ("c", 1), ("b", 1), ("d", 0)):  # b and c tie: the greater id first
        server.add_score(score_id, "human", 1.0, trace_id="a" * 32, timestamp=start + dt.timedelta(seconds=seconds))
    status, first = server.list_scores({"limit": ["2"]})
    assert status == 200 and [s["id"] for s in first["data"]] == ["a", "c"]
    cursor = first["meta"]["cursor"]
    assert json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))) == {
        "v": 1, "lastTimestamp": "2026-01-02T03:04:06.000Z", "lastId": "c"}
    server.add_score("new", "human", 1.0, trace_id="a" * 32, timestamp=start + dt.timedelta(seconds=3))
    _, second = server.list_scores({"limit": ["2"], "cursor": [cursor]})
    assert [s["id"] for s in second["data"]] == ["b", "d"] and "cursor" not in second["meta"]


@pytest.mark.parametrize(("query", "message"), [
    ({"limit": ["abc"]}, "Invalid request data"),
    ({"limit": ["0"]}, "Invalid request data"),
    ({"limit": ["101"]}, "Invalid request data"),
    ({"limit": ["1.5"]}, "Invalid request data"),
    ({"limit": [""]}, "Invalid request data"),
    ({"cursor": ["!not base64 json"]}, "Invalid cursor format"),
    ({"cursor": [base64.urlsafe_b64encode(b'{"offset": 2}').decode()]}, "Invalid request data"),
    ({"cursor": [base64.urlsafe_b64encode(b'{"v": 1, "lastTimestamp": "soon", "lastId": "a"}').decode()]},
     "Invalid request data"),
])
def test_the_stand_in_answers_400_to_a_limit_or_cursor_langfuse_refuses(
    langfuse: tuple[str, fake_langfuse.FakeLangfuse], query: dict[str, list[str]], message: str
) -> None:
    """It raised on a limit that is no integer and on a cursor it did not make (the request got no answer), and took a
    cursor of another shape as its own; Langfuse answers 400."""
    _, server = langfuse
    server.add_score("a", "human", 1.0, trace_id="a" * 32)
    status, body = server.list_scores(query)
    assert (status, body["message"]) == (400, message)


def test_a_page_shorter_than_its_limit_with_a_cursor_is_not_the_last(
    make_store, langfuse: tuple[str, fake_langfuse.FakeLangfuse]
) -> None:
    """Langfuse drops from a page the scores it cannot convert, after paging: such a page comes shorter than its limit,
    with a cursor, and the pull goes on to the next."""
    url, server = langfuse
    store = make_store()
    sync = sync_for(store, url)
    for n in range(PAGE + 50):
        server.add_score(f"s{n:03}", "human", 0.5, trace_id=trace_id("g", n))
    server.dropped = {f"s{n:03}" for n in range(PAGE + 50 - 30, PAGE + 50)}  # 30 of the first page (the newest)
    assert sync.sync().pulled == PAGE + 20
    assert [method for method, _ in server.requests] == ["GET", "GET"]


def test_sync_without_langfuse_configured_is_404(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with TestClient(make_app(tmp_path, monkeypatch)) as client:
        for answer in (client.post("/v1/langfuse/sync"), client.get("/v1/langfuse/sync")):
            assert answer.status_code == 404 and answer.json()["error"] == "langfuse_not_configured"


def test_langfuse_host_prefers_base_url_as_the_sdk_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Langfuse SDK reads LANGFUSE_BASE_URL before its older LANGFUSE_HOST, and so does the
    # plugin; the collector must sync with the same server the traces went to.
    from collector.scoring_config import LangfuseSettings

    monkeypatch.delenv("ART_COLLECTOR_LANGFUSE_HOST", raising=False)
    monkeypatch.setenv("LANGFUSE_HOST", "http://legacy.example:3000")
    monkeypatch.setenv("LANGFUSE_BASE_URL", "http://current.example:3000")
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    assert LangfuseSettings().host == "http://current.example:3000"
    monkeypatch.setenv("ART_COLLECTOR_LANGFUSE_HOST", "http://own.example:3000")
    assert LangfuseSettings().host == "http://own.example:3000"


def test_a_lookback_past_any_date_is_refused_when_the_settings_are_read() -> None:
    from pydantic import ValidationError

    from collector.scoring_config import LangfuseSettings

    assert LangfuseSettings(lookback_hours=24 * 365 * 100).lookback_hours == 876_000  # a century back still syncs
    with pytest.raises(ValidationError, match="lookback_hours"):
        LangfuseSettings(lookback_hours=1e8)  # 11,000 years: year -9382, every sync would fail with a 500


def test_a_score_source_langfuse_does_not_have_is_refused_when_the_settings_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`HUMAN` (for `ANNOTATION`) pulled nothing, silently: the listing's `source` filter matched no score."""
    from pydantic import ValidationError

    from collector.scoring_config import LangfuseSettings

    monkeypatch.setenv("ART_COLLECTOR_LANGFUSE_SOURCES", "annotation,eval")
    assert LangfuseSettings().sources == ["ANNOTATION", "EVAL"]  # as Langfuse names them
    monkeypatch.setenv("ART_COLLECTOR_LANGFUSE_SOURCES", "ANNOTATION,HUMAN")
    with pytest.raises(ValidationError, match="unknown score source HUMAN: Langfuse's are ANNOTATION, API, EVAL"):
        LangfuseSettings()
