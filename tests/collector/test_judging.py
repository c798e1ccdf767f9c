"""The RULER judge's run mechanics without a model: failure policies, automatic runs, auth, and
one run per group across collector replicas.

The judge here is a real HTTP endpoint that is down (a closed port), so every call fails the
way an unreachable judge fails, or, for races between replicas, a client that answers only
when the test releases it; scoring with a real model is in `test_ruler_vllm.py`.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import gzip
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from art_langgraph import semconv as sc
from collector import placement, store_reads
from collector.config import CollectorSettings
from collector.errors import Conflict
from collector.judge_client import JudgeClient
from collector.judging import GroupJudge, claim_seconds
from collector.ruler import JudgeError, response_format
from collector.schema import judge_runs
from collector.scoring_config import JudgeSettings
from collector.scoring_store import ScoringStore
from collector.store import SqlStore
from examples.stack import free_port
from tests.collector import span_builders as sb
from tests.collector.conftest import Clock
from tests.collector.pausing import lock_waited_for, pause_after
from tests.collector.seeding import group_spans, make_app, trace_id
from tests.collector.test_foreign import TRACE_A, _openinference_chain, _openinference_llm, _ours
from tests.collector.test_store_rewards import refuse_reward


def down_judge(policy: str, **extra: str) -> dict[str, str]:
    return {
        "ART_COLLECTOR_JUDGE_URL": f"http://127.0.0.1:{free_port()}/v1",
        "ART_COLLECTOR_JUDGE_ON_FAILURE": policy,
        "ART_COLLECTOR_JUDGE_TIMEOUT_SECONDS": "2",
        **extra,
    }


def test_retry_policy_tries_again_then_shows_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_ATTEMPTS="2"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    with TestClient(app) as client:
        run = client.post("/v1/groups/g/judge").json()
        assert (run["state"], run["attempts"]) == ("failed", 2)
        assert run["error"].startswith("judge_unreachable")
        assert run["next_try_at"] > run["finished_at"]
        assert all("ruler" not in t["rewards"] for t in client.get("/v1/trajectories", params={"group": "g"}).json())
        group = client.get("/v1/view/groups").json()[0]
        assert group["judge"]["state"] == "failed" and "judge_unreachable" in group["judge"]["error"]


def test_skip_policy_leaves_the_group_unjudged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip", ART_COLLECTOR_JUDGE_ATTEMPTS="5"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    with TestClient(app) as client:
        run = client.post("/v1/groups/g/judge").json()
        assert (run["state"], run["attempts"], run["next_try_at"]) == ("skipped", 1, None)
        assert client.get("/v1/groups/g/judge").json()["state"] == "skipped"
        assert app.state.scoring.judge.due_groups() == []


def test_zero_policy_scores_every_trajectory_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("zero"), reward_name="ruler")
    app.state.store.add_spans(group_spans("g", ["7", "8", "9"]))
    with TestClient(app) as client:
        run = client.post("/v1/groups/g/judge").json()
        assert run["state"] == "zeroed"
        assert [j["score"] for j in run["judgements"]] == [0.0, 0.0, 0.0]
        trajectories = client.get("/v1/trajectories", params={"group": "g"}).json()
        assert [t["rewards"]["ruler"] for t in trajectories] == [0.0, 0.0, 0.0]
        detail = client.get("/v1/view/trajectories/g-1").json()
        assert "judge failed" in detail["judgements"][0]["explanation"]
        assert client.get("/v1/groups").json()[0]["state"] == "skipped"  # all equal: no GRPO signal


def test_automatic_judge_runs_once_a_group_is_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = down_judge("skip", ART_COLLECTOR_JUDGE_AUTO="true", ART_COLLECTOR_JUDGE_POLL_SECONDS="0.1")
    app = make_app(tmp_path, monkeypatch, env=env)
    store = app.state.store
    with TestClient(app) as client:
        spans = group_spans("g", ["7", "8"])
        store.add_spans(spans[:3])  # member 0 ended, member 1 still running: not complete
        time.sleep(0.5)
        assert client.get("/v1/view/groups").json()[0]["judge"] is None
        store.add_spans(spans[3:])  # member 1's rollout span ends it
        deadline = time.monotonic() + 10
        # The run shows as `running` first; wait for it to settle.
        while time.monotonic() < deadline:
            judge = client.get("/v1/view/groups").json()[0]["judge"]
            if judge is not None and judge["state"] != "running":
                break
            time.sleep(0.1)
        assert judge is not None and judge["state"] == "skipped"


def test_a_judge_run_shows_the_max_tokens_it_ran_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run records its `max_tokens` (a cut answer is judged again once they are raised): the API shows them."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip", ART_COLLECTOR_JUDGE_MAX_TOKENS="777"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    with TestClient(app) as client:
        assert client.post("/v1/groups/g/judge").json()["max_tokens"] == 777
        assert client.get("/v1/groups/g/judge").json()["max_tokens"] == 777
        assert client.get("/v1/view/groups").json()[0]["judge"]["max_tokens"] == 777


def test_due_groups_wait_for_the_announced_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip"))
    spans = group_spans("g", ["7", "8", "9"])
    app.state.store.add_spans(spans[:4])  # two of three members, each complete
    judge = app.state.scoring.judge
    assert judge.due_groups() == []
    app.state.store.add_spans(spans[4:])
    assert judge.due_groups() == ["g"]


def test_a_group_that_grew_after_its_run_is_due_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group keyed by `art.group` alone has no size: a member that comes after the judge ran needs a score too."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip"))
    spans = group_spans("g", ["7", "8", "9"])
    for span in spans:
        span.attributes.pop(sc.GROUP_SIZE, None)
    app.state.store.add_spans(spans[:4])
    judge = app.state.scoring.judge
    assert judge.due_groups() == ["g"]
    assert judge.judge("g").trajectories == 2
    assert judge.due_groups() == []
    app.state.store.add_spans(spans[4:])
    assert judge.due_groups() == ["g"]
    assert judge.judge("g").trajectories == 3
    assert judge.due_groups() == []


def _judged_by(judge: GroupJudge, answer: Callable[[dict[str, Any]], httpx.Response]) -> list[dict[str, Any]]:
    """Make `judge`'s client talk to a judge that answers each request with `answer(its body)`; the bodies it gets."""
    bodies: list[dict[str, Any]] = []

    def chat(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return answer(bodies[-1])

    assert isinstance(judge.client, JudgeClient)
    judge.client._http = httpx.Client(transport=httpx.MockTransport(chat))
    return bodies


def _answering(judge: GroupJudge, status: int) -> list[dict[str, Any]]:
    """Make `judge`'s client talk to a judge that answers every call with HTTP `status`; the bodies it gets."""
    return _judged_by(judge, lambda body: httpx.Response(
        status, json={"object": "error", "message": "maximum context length is 2048 tokens"}))


def test_an_answer_past_max_answer_bytes_fails_the_run_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A judge's body was read whole into memory, however large; the cap is `ART_COLLECTOR_JUDGE_MAX_ANSWER_BYTES`."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip", ART_COLLECTOR_JUDGE_MAX_ANSWER_BYTES="2048"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    _judged_by(judge, lambda body: httpx.Response(200, content=b" " * 2049))
    run = judge.judge("g")
    assert run.state == "skipped"
    assert run.error is not None and run.error.startswith("judge_http_error: ")
    assert "with a body past 2048 bytes, left unread (ART_COLLECTOR_JUDGE_MAX_ANSWER_BYTES)" in run.error


def test_a_request_the_judge_rejects_is_not_sent_again_until_the_group_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """A group too long for the judge's context never gets scores: asking again every `RETRY_SECONDS` only spends."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry"))
    spans = group_spans("g", ["7", "8", "9"])
    for span in spans:
        span.attributes.pop(sc.GROUP_SIZE, None)
    app.state.store.add_spans(spans[:4])
    judge = app.state.scoring.judge
    judge.clock = clock
    calls = _answering(judge, 400)
    [run] = judge.run_due()
    assert (run.state, run.attempts, run.next_try_at, len(calls)) == ("failed", 1, None, 1)
    assert run.error.startswith("judge_rejected") and "maximum context length" in run.error
    assert run.error.endswith("not retried until the group grows")
    clock.now += 100 * judge.settings.retry_seconds
    assert judge.due_groups() == [] and judge.run_due() == [] and len(calls) == 1
    app.state.store.add_spans(spans[4:])
    assert judge.due_groups() == ["g"]


def _rejecting_the_rubric(judge: GroupJudge, rubric: str) -> list[dict[str, Any]]:
    """Make `judge`'s client talk to a judge that rejects (400) every prompt with `rubric` and scores the others (two
    blocks, 1 and 0); the request bodies it gets."""
    def answer(body: dict[str, Any]) -> httpx.Response:
        if rubric in body["messages"][0]["content"]:
            return httpx.Response(400, json={"object": "error", "message": "maximum context length is 2048 tokens"})
        content = json.dumps({"scores": {"1": {"explanation": "x", "score": 1}, "2": {"explanation": "y", "score": 0}}})
        return httpx.Response(200, json={"choices": [{"message": {"content": content}, "finish_reason": "stop"}]})

    return _judged_by(judge, answer)


@pytest.mark.parametrize("policy", ["retry", "skip", "zero"])
def test_a_request_whose_rubric_the_judge_rejects_leaves_the_group_to_the_automatic_judge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock, policy: str
) -> None:
    """The rejected run was the group's last one, `failed` with no `next_try_at` (or `skipped`, or zeroed): the
    automatic judge never judged the group with the configured rubric until it grew."""
    app = make_app(tmp_path, monkeypatch, env=down_judge(policy))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.clock = clock
    bodies = _rejecting_the_rubric(judge, "Only haikus win.")
    run = judge.judge("g", rubric="Only haikus win.")
    assert (run.state, run.judgements, run.next_try_at) == ("failed", [], run.finished_at)
    assert run.error.startswith("judge_rejected") and "the request's rubric" in run.error
    assert all("ruler" not in t.rewards for t in app.state.store.trajectories(group="g"))
    assert judge.due_groups() == ["g"]
    [again] = judge.run_due()
    assert (again.state, [j.score for j in again.judgements], len(bodies)) == ("ok", [1.0, 0.0], 2)
    assert judge.settings.rubric.strip() in bodies[1]["messages"][0]["content"]


def test_a_request_with_the_configured_rubric_the_judge_rejects_waits_for_the_group_to_grow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    _rejecting_the_rubric(judge, judge.settings.rubric.strip())
    run = judge.judge("g", rubric=f"  {judge.settings.rubric}\n")
    assert (run.state, run.next_try_at) == ("failed", None) and run.error.endswith("not retried until the group grows")
    assert judge.due_groups() == []


def _truncating(judge: GroupJudge) -> list[dict[str, Any]]:
    """Make `judge`'s client talk to a judge whose every answer is cut at `max_tokens`; the request bodies it gets."""
    return _judged_by(judge, lambda body: httpx.Response(200, json={
        "choices": [{"message": {"content": '{"scores": {"1": {"expl'}, "finish_reason": "length"}]}))


def test_a_group_whose_scores_alone_are_cut_at_max_tokens_is_not_judged_again_and_says_what_to_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """Past `scores_only_tokens` no explanation fits, and an answer of scores alone cut at `max_tokens` is cut again:
    it was tried `ATTEMPTS` times and again every `RETRY_SECONDS`, for ever."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_MAX_TOKENS="32"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.clock = clock
    bodies = _truncating(judge)
    [run] = judge.run_due()
    explanation = bodies[0]["response_format"]["json_schema"]["schema"]["properties"]["scores"]["properties"]["1"]
    assert explanation["properties"]["explanation"]["maxLength"] == 0  # scores alone
    assert (run.state, run.attempts, run.next_try_at, len(bodies)) == ("failed", 1, None, 1)
    assert run.error.startswith("judge_truncated")
    assert "the scores alone of 2 trajectories take up to" in run.error
    assert "raise ART_COLLECTOR_JUDGE_MAX_TOKENS" in run.error
    clock.now += 100 * judge.settings.retry_seconds
    assert judge.due_groups() == [] and len(bodies) == 1


@pytest.mark.parametrize("policy", ["retry", "skip", "zero"])
def test_a_group_cut_at_max_tokens_is_judged_again_once_they_are_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock, policy: str
) -> None:
    """Raising `MAX_TOKENS` and restarting left a group refused as too large unjudged until it grew or a request
    came: the run's `max_tokens` was not recorded. A run recorded before schema version 10 (none) stays as it was."""
    app = make_app(tmp_path, monkeypatch, env=down_judge(policy, ART_COLLECTOR_JUDGE_MAX_TOKENS="32"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.clock = clock
    _truncating(judge)
    [run] = judge.run_due()
    assert run.error.startswith("judge_truncated") and judge.scoring.run("g")["max_tokens"] == 32
    if policy == "retry":
        assert run.error.endswith("not retried until the group grows or the judge's max_tokens is raised")
    restarted = [GroupJudge(judge.store, judge.scoring, judge.settings.model_copy(update={"max_tokens": tokens}),
                            clock=clock) for tokens in (32, 64)]
    assert [j.due_groups() for j in restarted] == [[], ["g"]]
    bodies = _truncating(restarted[1])
    [run] = restarted[1].run_due()  # cut again at 64: due once they are raised again
    assert [body["max_tokens"] for body in bodies] == [64] and run.error.startswith("judge_truncated")
    assert restarted[1].due_groups() == [] and judge.scoring.run("g")["max_tokens"] == 64
    with judge.store.engine.begin() as conn:
        conn.execute(judge_runs.update().values(max_tokens=None))
    unknown = GroupJudge(judge.store, judge.scoring, judge.settings.model_copy(update={"max_tokens": 128}), clock=clock)
    assert unknown.due_groups() == []


def test_an_answer_cut_after_its_whole_json_is_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A judge cut at `max_tokens` just after the JSON's last `}` (before its end-of-text) had written every score: the
    run failed `judge_truncated` and its group was tried again, or zeroed, or skipped, by the policy."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("zero", ART_COLLECTOR_JUDGE_EXPLANATION_MAX_CHARS="4"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    scores = {"1": {"explanation": "right", "score": 1}, "2": {"explanation": "no", "score": 0}}
    content = json.dumps({"scores": scores})
    _judged_by(judge, lambda body: httpx.Response(200, json={
        "choices": [{"message": {"content": content}, "finish_reason": "length"}]}))
    run = judge.judge("g")
    assert (run.state, run.error) == ("ok", None)
    assert [(j.score, j.explanation) for j in run.judgements] == [(1.0, "rig\u2026"), (0.0, "no")]
    assert [t.rewards["ruler"] for t in app.state.store.trajectories(group="g")] == [1.0, 0.0]


def test_an_answer_cut_short_of_a_score_is_still_truncated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    content = json.dumps({"scores": {"1": {"explanation": "right", "score": 1}}})
    _judged_by(judge, lambda body: httpx.Response(200, json={
        "choices": [{"message": {"content": content}, "finish_reason": "length"}]}))
    run = judge.judge("g")
    assert run.state == "skipped" and run.error is not None and run.error.startswith("judge_truncated")


def test_a_compressed_rejection_is_not_sent_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A judge's 413 compressed anyway (asked for none) was `judge_http_error`: sent `ATTEMPTS` times, and again every
    `RETRY_SECONDS`, though the same request never succeeds."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_ATTEMPTS="3"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    body = gzip.compress(b'{"object": "error", "message": "maximum context length is 2048 tokens"}')
    bodies = _judged_by(judge, lambda _: httpx.Response(413, content=body, headers={"Content-Encoding": "gzip"}))
    run = judge.judge("g")
    assert (run.state, run.attempts, run.next_try_at, len(bodies)) == ("failed", 1, None, 1)
    assert run.error is not None and run.error.startswith("judge_rejected") and "compressed as 'gzip'" in run.error


def test_an_answer_cut_with_room_for_explanations_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """A judge that wrote past the schema's explanation length (OpenAI ignores `maxLength`) may fit another time."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_ATTEMPTS="2"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.clock = clock
    bodies = _truncating(judge)
    [run] = judge.run_due()
    assert (run.state, run.attempts, len(bodies)) == ("failed", 2, 2)
    assert run.next_try_at == clock.now + judge.settings.retry_seconds
    assert run.error.startswith("judge_truncated") and "scores alone" not in run.error


@pytest.mark.parametrize("status", [429, 503])
def test_a_judge_error_that_may_pass_is_tried_again_after_retry_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock, status: int
) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_ATTEMPTS="1"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.clock = clock
    calls = _answering(judge, status)
    [run] = judge.run_due()
    assert (run.state, run.next_try_at) == ("failed", clock.now + judge.settings.retry_seconds)
    assert run.error.startswith("judge_http_error")
    assert judge.due_groups() == []
    clock.now += judge.settings.retry_seconds
    assert [again.state for again in judge.run_due()] == ["failed"] and len(calls) == 2


def _waiting(judge: GroupJudge, clock: Clock) -> list[float]:
    """Make `judge` wait between tries on `clock`, each wait moving it on, instead of sleeping; the waits, in order."""
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds

    judge.sleep = wait
    return waits


def _busy_then_scoring(judge: GroupJudge, retry_after: list[str]) -> list[dict[str, Any]]:
    """Make `judge`'s client talk to a judge that answers 429 with each `Retry-After` of `retry_after` in turn, then
    scores two blocks (1 and 0); the request bodies it gets."""
    busy = iter(retry_after)

    def answer(body: dict[str, Any]) -> httpx.Response:
        if (header := next(busy, None)) is not None:
            return httpx.Response(429, headers={"Retry-After": header}, json={"error": {"message": "rate limited"}})
        content = json.dumps({"scores": {"1": {"explanation": "x", "score": 1}, "2": {"explanation": "y", "score": 0}}})
        return httpx.Response(200, json={"choices": [{"message": {"content": content}, "finish_reason": "stop"}]})

    return _judged_by(judge, answer)


@pytest.mark.parametrize(("first", "waited"), [
    (lambda: "7", 7.0),
    (lambda: "10", 10.0),  # the longest wait between two tries
    (lambda: email.utils.formatdate(time.time() + 9, usegmt=True), pytest.approx(8.5, abs=1.0)),
], ids=["seconds", "longest", "date"])
def test_a_judge_asking_to_retry_after_a_while_is_tried_again_no_sooner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock, first: Callable[[], str], waited: float
) -> None:
    """A 429's (or 503's) `Retry-After` was ignored: the next try came after the run's own back-off (1 s, then 2 s),
    asked for another 429. Now it comes no sooner than the judge asked, or than the back-off where that is longer
    (a `Retry-After` of 0 before the second retry); the run still ends within its claim."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_ATTEMPTS="3"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.clock = clock
    bodies = _busy_then_scoring(judge, [first(), "0"])
    waits = _waiting(judge, clock)
    run = judge.judge("g")
    assert (run.state, run.attempts, len(bodies), waits) == ("ok", 3, 3, [waited, 2.0])
    assert run.finished_at - run.started_at < claim_seconds(judge.settings) - 60


@pytest.mark.parametrize(("asks", "due_in"), [
    (lambda: "11", 60.0),  # RETRY_SECONDS, the longer
    (lambda: "3600", 3600.0),
    (lambda: email.utils.formatdate(time.time() + 3600, usegmt=True), pytest.approx(3600, abs=5)),
    (lambda: "9" * 30, 86_400.0),  # at most a day
], ids=["seconds", "an hour", "a date in an hour", "past a day"])
def test_a_judge_asking_to_wait_longer_than_a_run_waits_fails_the_run_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock, asks: Callable[[], str], due_in: float
) -> None:
    """A `Retry-After` past the longest wait between two tries (10 s, which `claim_seconds` allows after each try) is
    not waited for, nor ignored by trying again sooner: the run fails at once saying what the judge asked, and its
    group is due again after `RETRY_SECONDS` or the wait asked, whichever is longer, at most a day (it was due again
    after `RETRY_SECONDS` alone: the automatic judge kept asking a judge that had said to wait an hour)."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_ATTEMPTS="3"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.clock = clock
    retry_after = asks()
    bodies = _busy_then_scoring(judge, [retry_after] * 3)
    waits = _waiting(judge, clock)
    [run] = judge.run_due()
    assert (run.state, run.attempts, len(bodies), waits) == ("failed", 1, 1, [])
    assert judge.settings.retry_seconds == 60 and run.next_try_at - clock.now == due_in
    assert run.error.startswith("judge_http_error: judge http://127.0.0.1:")
    assert f"answered 429 with Retry-After {retry_after!r}: " in run.error
    assert re.search(r"; not tried again in this run: the judge asked to wait (11|3\d{3}(\.\d+)?|1e\+30) s, more "
                     r"than the 10 s a run waits between two tries; the group is due again after ART_COLLECTOR_JUDGE_"
                     r"RETRY_SECONDS or the wait asked, whichever is longer \(at most 86400 s\)$", run.error)


def test_judge_unknown_group_is_404(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with TestClient(make_app(tmp_path, monkeypatch, env=down_judge("skip"))) as client:
        answer = client.post("/v1/groups/nope/judge")
        assert answer.status_code == 404 and answer.json()["error"] == "not_found"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("reward_name", "r" * 257, "at most 256 characters"),  # every run failed after the judge call
        ("reward_name", "a\x00b", "should match pattern"),
        ("model", "m" * 257, "at most 256 characters"),  # PostgreSQL refused every run's claim
        ("rubric", " \n ", "rubric is blank"),  # the judge was sent no rubric at all
    ],
)
def test_judge_settings_the_store_cannot_hold_or_a_blank_rubric_are_refused(field: str, value: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        JudgeSettings(**{field: value})


def test_a_judge_timeout_past_a_week_is_refused_and_a_week_works() -> None:
    """A timeout of 1e10 s (for "none") made every judge call an OverflowError inside httpx: each run failed
    unexpectedly, a 500 on request."""
    with pytest.raises(ValidationError, match="less than or equal to 604800"):
        JudgeSettings(timeout_seconds=1e10)
    week = JudgeSettings(timeout_seconds=7 * 24 * 3600)
    client = JudgeClient(f"http://127.0.0.1:{free_port()}/v1", week.model, timeout=week.timeout_seconds)
    with pytest.raises(JudgeError) as caught:
        client.complete([{"role": "user", "content": "q"}], response_format(1), temperature=0, max_tokens=64)
    assert caught.value.code == "judge_unreachable"


def test_a_blank_rubric_in_the_request_is_400_and_judges_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    with TestClient(app) as client:
        answer = client.post("/v1/groups/g/judge", json={"rubric": "  \n "})
        assert answer.status_code == 400 and "rubric is blank" in answer.json()["message"]
        assert client.get("/v1/groups/g/judge").status_code == 404


def test_judge_run_needs_the_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**down_judge("skip"), "ART_API_KEY": "s3cret"}
    app = make_app(tmp_path, monkeypatch, env=env)
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    with TestClient(app) as client:
        assert client.post("/v1/groups/g/judge").status_code == 401
        assert client.post("/v1/langfuse/sync").status_code == 401
        ok = client.post("/v1/groups/g/judge", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["state"] == "skipped"
        assert client.get("/v1/view/groups").status_code == 200  # reads stay open


@pytest.mark.parametrize(
    ("env", "sent"),
    [
        ({"ART_API_KEY": " k3y\n"}, "Bearer k3y"),  # an illegal header value: every judge call failed
        ({"ART_COLLECTOR_JUDGE_API_KEY": "\tj-k3y ", "ART_API_KEY": "other"}, "Bearer j-k3y"),
        ({"ART_COLLECTOR_JUDGE_API_KEY": "  "}, None),  # blank is none, as the services read `ART_API_KEY`
    ],
)
def test_the_judge_key_is_read_as_the_services_read_art_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], sent: str | None
) -> None:
    app = make_app(tmp_path, monkeypatch, env={**down_judge("skip"), **env})
    client = app.state.scoring.judge.client
    assert isinstance(client, JudgeClient)
    assert client._http.headers.get("authorization") == sent


def test_a_run_of_an_unreachable_judge_hides_the_password_of_its_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The judge's URL with a password (a proxy's Basic auth): the run's error, which reads show without a key, and
    the log named it whole."""
    env = down_judge("skip", ART_COLLECTOR_JUDGE_URL=f"http://judge:hunter2@127.0.0.1:{free_port()}/v1")
    app = make_app(tmp_path, monkeypatch, env=env)
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    with caplog.at_level(logging.WARNING), TestClient(app) as client:
        assert client.post("/v1/groups/g/judge").json()["state"] == "skipped"
        error = client.get("/v1/groups/g/judge").json()["error"]
    assert error.startswith("judge_unreachable: judge http://judge:***@127.0.0.1:")
    assert "hunter2" not in error and "hunter2" not in caplog.text


def test_a_judge_key_that_is_not_ascii_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No HTTP client sends it: the app failed to build with a bare `UnicodeEncodeError` from inside httpx."""
    with pytest.raises(ValidationError, match="ART_COLLECTOR_JUDGE_API_KEY.*must be ASCII"):
        make_app(tmp_path, monkeypatch, env={**down_judge("skip"), "ART_COLLECTOR_JUDGE_API_KEY": "cl\u00e9"})


def test_a_judge_reward_named_like_a_code_reward_overrides_it_as_an_api_reward_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(tmp_path, monkeypatch, env={**down_judge("skip"), "ART_COLLECTOR_JUDGE_REWARD_NAME": "reward"})
    app.state.store.add_spans(group_spans("g", ["7", "8"], rewards=[1.0, 0.0]))  # the app's code rewards
    app.state.scoring.judge.client = HeldJudge(released=True, scores=(0.25, 0.75))
    with TestClient(app) as client:
        assert client.post("/v1/groups/g/judge").json()["state"] == "ok"
        rewards = [t["rewards"]["reward"] for t in client.get("/v1/trajectories", params={"group": "g"}).json()]
        assert rewards == [0.25, 0.75]
        client.post("/v1/rewards", json={"rollout_id": "g-0", "name": "reward", "value": 0.5})
        assert client.get("/v1/view/trajectories/g-0").json()["rewards"]["reward"] == 0.5


# --- one run per group across replicas ----------------------------------------------------
WAIT = 10.0
"""Longest a test waits for a thread or an event."""


class HeldJudge:
    """A judge client that answers (two blocks, `scores`, default 1 and 0) once `release` is set; counts its calls."""

    def __init__(self, *, released: bool = False, scores: tuple[float, float] = (1.0, 0.0)) -> None:
        self.scores = scores
        self.calls = 0
        self.waiting = threading.Event()
        self.release = threading.Event()
        if released:
            self.release.set()
        self._count = threading.Lock()

    def complete(self, messages: list[dict[str, Any]], fmt: dict[str, Any], *, temperature: float,
                 max_tokens: int) -> str:
        with self._count:
            self.calls += 1
        self.waiting.set()
        if not self.release.wait(WAIT):
            raise AssertionError("the test never released the judge")
        return json.dumps({"scores": {"1": {"explanation": "right", "score": self.scores[0]},
                                      "2": {"explanation": "wrong", "score": self.scores[1]}}})

    def close(self) -> None:
        """Nothing to release."""


class SyncedScoring(ScoringStore):
    """A `ScoringStore` whose `runs` returns only once every replica has read them: all see the same groups due."""

    def __init__(self, engine: Engine, barrier: threading.Barrier) -> None:
        super().__init__(engine)
        self.barrier = barrier

    def runs(self, group_ids: Any = None) -> dict[str, dict[str, Any]]:
        found = super().runs(group_ids)
        self.barrier.wait(WAIT)
        return found


@pytest.fixture(params=["sqlite-file", "postgresql"])
def shared_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One database that several collector replicas share."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres").create_database()
    return f"sqlite:///{tmp_path / 'collector.db'}"


@pytest.fixture
def replica_stores(shared_db: str, clock: Clock) -> Iterator[list[SqlStore]]:
    """The stores of two collector replicas on `shared_db` (two engines), group `g` seeded: two different answers."""
    stores = [SqlStore(CollectorSettings(db=shared_db), clock=clock) for _ in range(2)]
    for store in stores:
        store.setup()
    stores[0].add_spans(group_spans("g", ["7", "8"]))
    yield stores
    for store in stores:
        store.close()


def _race(contenders: list[Any]) -> tuple[queue.Queue[Any], list[threading.Thread]]:
    """Run each callable in a thread of its own, all started at once; their results (or errors) go to the queue."""
    results: queue.Queue[Any] = queue.Queue()
    start = threading.Barrier(len(contenders))

    def run(contender: Any) -> None:
        start.wait(WAIT)
        try:
            results.put(contender())
        except Exception as exc:  # the test asserts on it
            results.put(exc)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in contenders]
    for thread in threads:
        thread.start()
    return results, threads


def _race_held(client: HeldJudge, contenders: list[Any]) -> tuple[Any, Any]:
    """Race `contenders` while `client` holds its one judge call; return (the loser's outcome, the winner's).

    The loser ends while the winner's call is still held, and the judge is called once in all.
    """
    try:
        results, threads = _race(contenders)
        lost = results.get(timeout=WAIT)
        assert client.calls == 1
    finally:
        client.release.set()
    won = results.get(timeout=WAIT)
    for thread in threads:
        thread.join(WAIT)
    assert client.calls == 1
    return lost, won


def test_replicas_judging_automatically_call_the_judge_once(replica_stores: list[SqlStore], clock: Clock) -> None:
    client = HeldJudge()
    both_read = threading.Barrier(2)
    judges = [
        GroupJudge(store, SyncedScoring(store.engine, both_read), JudgeSettings(auto=True), client=client, clock=clock)
        for store in replica_stores
    ]
    lost, won = _race_held(client, [judge.run_due for judge in judges])
    assert lost == []  # the replica that lost the claim judged nothing and raised nothing
    assert [(run.group_id, run.state, run.attempts) for run in won] == [("g", "ok", 1)]
    after = GroupJudge(replica_stores[1], ScoringStore(replica_stores[1].engine), JudgeSettings(auto=True),
                       client=client, clock=clock)
    assert after.scoring.run("g")["state"] == "ok" and after.due_groups() == []


@pytest.mark.parametrize("judged_before", [False, True])
def test_a_group_another_replica_judged_since_it_was_found_due_is_not_judged_again(
    replica_stores: list[SqlStore], clock: Clock, judged_before: bool
) -> None:
    """Replica B finds g and h due and is held judging g; meanwhile A judges h. B then leaves h alone: it judged h a
    second time (a second judge call, its scores over A's), whether h had no run before or was due again."""
    replica_stores[0].add_spans(group_spans("h", ["7", "8"], first_span=100))
    late, quick = HeldJudge(), HeldJudge(released=True, scores=(0.25, 0.75))
    a, b = (
        GroupJudge(store, ScoringStore(store.engine), JudgeSettings(auto=True, attempts=1), client=client, clock=clock)
        for store, client in zip(replica_stores, [quick, late], strict=True)
    )
    if judged_before:  # h's last run failed and is due again
        a.client = HeldJudge(released=True, scores=(2.0, 0.0))
        assert a.judge("h").state == "failed"
        a.client, clock.now = quick, clock.now + a.settings.retry_seconds
    assert b.due_groups() == ["g", "h"]
    try:
        results, threads = _race([b.run_due])
        assert late.waiting.wait(WAIT)  # b holds g, h is next on its list
        clock.now += 1
        assert [(run.group_id, run.state) for run in a.run_due()] == [("h", "ok")]
    finally:
        late.release.set()
    assert [(run.group_id, run.state) for run in results.get(timeout=WAIT)] == [("g", "ok")]
    threads[0].join(WAIT)
    assert (late.calls, quick.calls) == (1, 1)
    assert [replica_stores[1].trajectory(f"h-{i}").rewards["ruler"] for i in range(2)] == [0.25, 0.75]


def test_an_explanation_with_a_nul_character_is_stored(replica_stores: list[SqlStore], clock: Clock) -> None:
    """PostgreSQL text holds no NUL: storing the judge's `\\u0000` failed the run, on every retry alike."""

    class Nul(HeldJudge):
        def complete(self, *args: Any, **kwargs: Any) -> str:
            return super().complete(*args, **kwargs).replace("right", "ri\\u0000ght")

    judge = GroupJudge(replica_stores[0], ScoringStore(replica_stores[0].engine), JudgeSettings(),
                       client=Nul(released=True), clock=clock)
    run = judge.judge("g")
    assert (run.state, [j.explanation for j in run.judgements]) == ("ok", ["right", "wrong"])
    assert judge.scoring.judgements(["g-0"])["g-0"][0]["explanation"] == "right"


def test_a_judge_request_racing_another_replica_gets_409_not_a_second_run(
    replica_stores: list[SqlStore], clock: Clock
) -> None:
    client = HeldJudge()
    judges = [GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=client, clock=clock)
              for store in replica_stores]
    lost, won = _race_held(client, [lambda judge=judge: judge.judge("g") for judge in judges])
    assert isinstance(lost, Conflict) and lost.code == "judge_running" and lost.status == 409
    assert "its run is running" in lost.message
    assert (won.state, [j.score for j in won.judgements]) == ("ok", [1.0, 0.0])


def test_a_409_says_what_the_claim_saw_though_the_other_run_ends_before_the_answer(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal read the other run back after its claim failed: that run, ended in between, made a 409 that said
    `its run is ok`, refusing as if it were running."""
    held = HeldJudge()
    first, second = (GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=held, clock=clock)
                     for store in replica_stores)
    claim = second.scoring.claim_run
    try:
        results, threads = _race([lambda: first.judge("g")])
        assert held.waiting.wait(WAIT)

        def refused_then_other_ends(*args: Any, **kwargs: Any) -> bool:
            claimed = claim(*args, **kwargs)
            held.release.set()
            assert results.get(timeout=WAIT).state == "ok"  # the other run ends before the answer is written
            return claimed

        monkeypatch.setattr(second.scoring, "claim_run", refused_then_other_ends)
        with pytest.raises(Conflict) as refused:
            second.judge("g")
    finally:
        held.release.set()
    threads[0].join(WAIT)
    assert refused.value.code == "judge_running" and "its run is running" in refused.value.message
    assert "it is no longer running" in refused.value.message
    assert held.calls == 1


def test_a_refused_claim_says_when_the_running_run_started(replica_stores: list[SqlStore], clock: Clock) -> None:
    """The 409 said another run held the group, not since when: a run stuck for hours looked like one just begun."""
    held = HeldJudge()
    first, second = (GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=held, clock=clock)
                     for store in replica_stores)
    started = clock.now
    try:
        results, threads = _race([lambda: first.judge("g")])
        assert held.waiting.wait(WAIT)
        clock.now += 42
        with pytest.raises(Conflict) as refused:
            second.judge("g")
    finally:
        held.release.set()
    assert results.get(timeout=WAIT).state == "ok"
    threads[0].join(WAIT)
    when = dt.datetime.fromtimestamp(started, tz=dt.UTC).isoformat(timespec="seconds")
    assert f"running run started at {when}, 42 s ago" in refused.value.message


def test_the_judge_endpoint_answers_409_while_another_replica_judges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(tmp_path, monkeypatch, env=down_judge("skip"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    # a second replica on the same file
    other = SqlStore(CollectorSettings(db=f"sqlite:///{tmp_path / 'collector.db'}"))
    client = HeldJudge()
    judge = GroupJudge(other, ScoringStore(other.engine), JudgeSettings(), client=client)
    try:
        results, _ = _race([lambda: judge.judge("g")])
        assert client.waiting.wait(WAIT)
        with TestClient(app) as http:
            answer = http.post("/v1/groups/g/judge")
            assert answer.status_code == 409
            assert answer.json()["error"] == "judge_running" and "its run is running" in answer.json()["message"]
            assert http.get("/v1/groups/g/judge").json()["state"] == "running"
            client.release.set()
            assert results.get(timeout=WAIT).state == "ok"
            assert http.get("/v1/groups/g/judge").json()["state"] == "ok"
    finally:
        client.release.set()
        other.close()
    assert client.calls == 1


def test_a_run_that_outlives_its_claim_is_taken_over_and_records_nothing(
    replica_stores: list[SqlStore], clock: Clock
) -> None:
    stuck, fresh = HeldJudge(), HeldJudge(released=True, scores=(0.0, 1.0))
    first, second = (
        GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=client, clock=clock)
        for store, client in zip(replica_stores, [stuck, fresh], strict=True)
    )
    try:
        results, threads = _race([lambda: first.judge("g")])
        assert stuck.waiting.wait(WAIT)
        assert second.due_groups() == []
        clock.now += claim_seconds(second.settings) + 1  # the first run's judge hangs past its claim
        assert second.due_groups() == ["g"]
        taken = second.judge("g")
        assert (taken.state, taken.started_at, fresh.calls) == ("ok", clock.now, 1)
    finally:
        stuck.release.set()
    lost = results.get(timeout=WAIT)  # told so, not answered with the other run as its own
    assert isinstance(lost, Conflict) and lost.code == "judge_running" and "outlived its claim" in lost.message
    threads[0].join(WAIT)
    run = second.scoring.run("g")
    assert (run["state"], run["started_at"]) == ("ok", clock.now)  # the stale run did not overwrite the new one
    # nor its scores: the rewards and explanations are the new run's
    assert [replica_stores[1].trajectory(f"g-{i}").rewards["ruler"] for i in range(2)] == [0.0, 1.0]
    found = second.scoring.judgements(["g-0", "g-1"])
    assert [row["score"] for tid in ("g-0", "g-1") for row in found[tid]] == [0.0, 1.0]


def test_a_run_that_fails_unexpectedly_frees_its_group(replica_stores: list[SqlStore], clock: Clock) -> None:
    class Broken(HeldJudge):
        def complete(self, *args: Any, **kwargs: Any) -> str:
            raise RuntimeError("judge client bug")

    judge = GroupJudge(replica_stores[0], ScoringStore(replica_stores[0].engine), JudgeSettings(),
                       client=Broken(), clock=clock)
    with pytest.raises(RuntimeError, match="judge client bug"):
        judge.judge("g")
    run = judge.scoring.run("g")
    assert (run["state"], run["error"]) == ("failed", "RuntimeError: judge client bug")
    assert run["next_try_at"] == clock.now + judge.settings.retry_seconds
    judge.client = HeldJudge(released=True)
    assert judge.judge("g").state == "ok"  # no 409: the failed run holds the group no longer


def test_a_store_error_on_a_reward_leaves_the_former_scores_and_the_run_failed(
    replica_stores: list[SqlStore], clock: Clock
) -> None:
    """A store error on the second reward (a full disk, a lost connection) left the first new reward beside the
    former second one, with the new explanations of both, until the retry: a trainer could lease the mix."""
    store = replica_stores[0]
    judge = GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=HeldJudge(released=True),
                       clock=clock)
    assert judge.judge("g").state == "ok"
    refuse_reward(store.engine, 0.75)
    judge.client = HeldJudge(released=True, scores=(0.25, 0.75))
    with pytest.raises(DBAPIError, match="disk full"):
        judge.judge("g")
    run = judge.scoring.run("g")
    assert run["state"] == "failed" and "disk full" in run["error"]
    assert [store.trajectory(f"g-{i}").rewards["ruler"] for i in range(2)] == [1.0, 0.0]
    found = judge.scoring.judgements(["g-0", "g-1"])
    assert [(row["score"], row["explanation"]) for tid in ("g-0", "g-1") for row in found[tid]] == [
        (1.0, "right"), (0.0, "wrong")
    ]


def test_a_run_taken_over_as_it_stores_its_scores_stores_none(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run checked its claim before it stored its scores, outside their transaction: taken over as stale in
    between, it wrote its rewards over those of the run that took the group over."""
    first, second = (
        GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=HeldJudge(released=True, scores=scores),
                   clock=clock)
        for store, scores in zip(replica_stores, [(1.0, 0.0), (0.0, 1.0)], strict=True)
    )
    store_rewards = first.store.add_rewards

    def taken_over_first(*args: Any, **kwargs: Any) -> Any:
        clock.now += claim_seconds(second.settings) + 1  # the first run's judge answered past its claim
        assert second.judge("g").state == "ok"
        return store_rewards(*args, **kwargs)

    monkeypatch.setattr(first.store, "add_rewards", taken_over_first)
    with caplog.at_level(logging.WARNING, logger="collector.judging"), pytest.raises(Conflict) as lost:
        first.judge("g")
    assert lost.value.code == "judge_running" and "stored nothing" in lost.value.message
    assert [replica_stores[1].trajectory(f"g-{i}").rewards["ruler"] for i in range(2)] == [0.0, 1.0]
    assert "outlived its claim" in caplog.text
    found = second.scoring.judgements(["g-0", "g-1"])
    assert [row["score"] for tid in ("g-0", "g-1") for row in found[tid]] == [0.0, 1.0]


@pytest.mark.parametrize("answer", ["scores", "out of range"])
def test_a_run_answers_its_own_outcome_though_another_run_claims_the_group_as_it_ends(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    """A run read the group's run back once it had recorded its own: another run that claimed the group in between
    (a request, a replica finding the group grown) made it answer `running`, the other run's, with its own
    judgements."""
    held = HeldJudge()
    quick = HeldJudge(released=True, scores=(1.0, 0.0) if answer == "scores" else (2.0, 0.0))
    first, second = (
        GroupJudge(store, ScoringStore(store.engine), JudgeSettings(attempts=1), client=client, clock=clock)
        for store, client in zip(replica_stores, [quick, held], strict=True)
    )
    ends, name = (first.store, "add_rewards") if answer == "scores" else (first.scoring, "finish_run")
    end = getattr(ends, name)
    other: list[queue.Queue[Any]] = []

    def then_claimed(*args: Any, **kwargs: Any) -> Any:
        ended = end(*args, **kwargs)
        clock.now += 1
        other.append(_race([lambda: second.judge("g")])[0])
        assert held.waiting.wait(WAIT)  # the second run holds the group
        return ended

    monkeypatch.setattr(ends, name, then_claimed)
    started = clock.now
    try:
        run = first.judge("g")
        assert second.scoring.run("g")["state"] == "running"
    finally:
        held.release.set()
    expected = ("ok", [1.0, 0.0]) if answer == "scores" else ("failed", [])
    assert (run.state, run.started_at, [j.score for j in run.judgements]) == (expected[0], started, expected[1])
    assert other[0].get(timeout=WAIT).state == "ok"


def test_a_store_error_on_the_explanations_leaves_the_former_rewards(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explanations and the outcome were written after the rewards' transaction: a store error there left every
    new reward beside the former explanations."""
    store = replica_stores[0]
    judge = GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=HeldJudge(released=True),
                       clock=clock)
    assert judge.judge("g").state == "ok"

    def disk_full(*args: Any) -> None:
        raise OperationalError("INSERT INTO judgements", {}, OSError("disk full"))

    monkeypatch.setattr(judge.scoring, "_replace_judgements", disk_full)
    judge.client = HeldJudge(released=True, scores=(0.25, 0.75))
    with pytest.raises(OperationalError, match="disk full"):
        judge.judge("g")
    run = judge.scoring.run("g")
    assert run["state"] == "failed" and "disk full" in run["error"]
    assert [store.trajectory(f"g-{i}").rewards["ruler"] for i in range(2)] == [1.0, 0.0]
    found = judge.scoring.judgements(["g-0", "g-1"])
    assert [row["score"] for tid in ("g-0", "g-1") for row in found[tid]] == [1.0, 0.0]


def test_a_group_whose_run_fails_unexpectedly_does_not_hold_up_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """One group's bug or store error is logged and shows on that group; the groups due after it are still judged,
    even when it is due again on every poll (`RETRY_SECONDS` shorter than `POLL_SECONDS`)."""

    class BrokenOnBad(HeldJudge):
        def complete(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
            if "BAD" in json.dumps(messages):
                raise KeyError("content")
            return super().complete(messages, *args, **kwargs)

    app = make_app(tmp_path, monkeypatch, env=down_judge("retry", ART_COLLECTOR_JUDGE_RETRY_SECONDS="1"))
    app.state.store.add_spans(group_spans("a", ["BAD", "BAD!"]))
    app.state.store.add_spans(group_spans("b", ["7", "8"], first_span=100))
    judge = app.state.scoring.judge
    judge.clock = clock
    judge.client = BrokenOnBad(released=True)
    assert judge.due_groups() == ["a", "b"]  # the broken group comes first
    with caplog.at_level(logging.ERROR, logger="collector.judging"):
        assert [(run.group_id, run.state) for run in judge.run_due()] == [("b", "ok")]
    [record] = caplog.records
    assert "group a" in record.getMessage() and record.exc_info is not None and record.exc_info[0] is KeyError
    failed = judge.scoring.run("a")
    assert (failed["state"], failed["error"]) == ("failed", "KeyError: 'content'")
    clock.now += judge.settings.retry_seconds
    assert judge.due_groups() == ["a"] and judge.run_due() == []  # due again, failing again, raising nothing


def test_an_answer_python_cannot_read_as_a_number_follows_the_failure_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A score of 10**400 overflows a float: it is a bad answer like any other, not a crash of the judging loop."""

    class Overflowing(HeldJudge):
        def complete(self, *args: Any, **kwargs: Any) -> str:
            return json.dumps({"scores": {"1": {"explanation": "x", "score": 10**400},
                                          "2": {"explanation": "y", "score": 0}}})

    app = make_app(tmp_path, monkeypatch, env=down_judge("zero"))
    app.state.store.add_spans(group_spans("g", ["7", "8"]))
    judge = app.state.scoring.judge
    judge.client = Overflowing()
    [run] = judge.run_due()
    assert (run.state, run.attempts) == ("zeroed", 1) and run.error.startswith("judge_bad_scores")
    assert [j.score for j in run.judgements] == [0.0, 0.0]


def _late_turn(spans: list[Any]) -> list[Any]:
    """A model call of member 0 that arrives late: its messages end with another answer."""
    return [sb.llm(5, rollout="g-0", trace=trace_id("g", 0), start=20, prompt=[1, 2, 3, 4, 5, 6, 7, 8], completion=[9],
                   output=[{"role": "assistant", "content": "99"}])]


@pytest.mark.parametrize(("change", "members"), [(_late_turn, 3), (lambda spans: spans[4:], 3)],
                         ids=["a member got more messages", "a member came"])
def test_an_answer_to_a_group_that_changed_meanwhile_is_not_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, members: int
) -> None:
    """The judge scored the trajectories it was shown; stored on the group as it became, the scores judged content
    gone, and the group was never judged again."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry"))
    spans = group_spans("g", ["7", "8", "9"])
    for span in spans:
        span.attributes.pop(sc.GROUP_SIZE, None)
    app.state.store.add_spans(spans[:4])
    judge = app.state.scoring.judge
    judge.client = client = HeldJudge()
    try:
        results, _ = _race([lambda: judge.judge("g")])
        assert client.waiting.wait(WAIT)
        app.state.store.add_spans(change(spans))
    finally:
        client.release.set()
    run = results.get(timeout=WAIT)
    assert (run.state, run.judgements) == ("failed", []) and run.error.startswith("judge_stale")
    assert all("ruler" not in t.rewards for t in app.state.store.trajectories(group="g"))
    assert run.next_try_at == run.finished_at and judge.due_groups() == ["g"]


def _foreign_calls() -> list[Any]:
    """Another instrumentation's model call in trace `TRACE_A`: a trajectory and group `TRACE_A` until its rollout
    comes."""
    return [_openinference_chain(TRACE_A, 110, sb.sid(101), "tool"),
            _openinference_llm(TRACE_A, 111, sb.sid(110), marked=False)]


class RolloutComes(HeldJudge):
    """A judge client during whose call the rollout of `_foreign_calls` comes: their trajectory is deleted, and with it
    its group and the group's run; it scores the one trajectory it was shown."""

    def __init__(self, store: SqlStore) -> None:
        super().__init__(released=True)
        self.store = store

    def complete(self, *args: Any, **kwargs: Any) -> str:
        self.store.add_spans(_ours("r1", TRACE_A, 100))
        return json.dumps({"scores": {"1": {"explanation": "x", "score": 0.5}}})


def test_a_group_deleted_while_it_is_judged_is_404_and_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trajectory of another instrumentation's calls is deleted, its group's run with it, when its rollout's spans
    come: judged meanwhile, the run failed reading its own outcome back (KeyError, a 500)."""
    app = make_app(tmp_path, monkeypatch, env=down_judge("retry"), min_group_size=1, keep_zero_spread=True)
    store = app.state.store
    store.add_spans(_foreign_calls())
    app.state.scoring.judge.client = RolloutComes(store)
    with TestClient(app) as client:
        answer = client.post(f"/v1/groups/{TRACE_A}/judge")
        assert answer.status_code == 404 and answer.json()["error"] == "group_deleted", answer.text
        assert client.get(f"/v1/groups/{TRACE_A}/judge").status_code == 404
    assert [t.id for t in store.trajectories()] == ["r1"] and store.trajectory("r1").rewards == {"reward": 1.0}


def test_the_automatic_judge_leaves_a_group_deleted_mid_run_without_a_failure(
    make_store: Any, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's KeyError was logged as an unexpected failure, with its traceback."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    store.add_spans(_foreign_calls())
    clock.now += 1000  # idle: the trajectory is complete, its group due
    judge = GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=RolloutComes(store), clock=clock)
    assert judge.due_groups() == [TRACE_A]
    with caplog.at_level(logging.INFO, logger="collector.judging"):
        assert judge.run_due() == []
    assert "was deleted while it was judged" in caplog.text
    assert all(record.exc_info is None for record in caplog.records)
    assert judge.scoring.run(TRACE_A) is None and TRACE_A not in judge.due_groups()


def test_a_group_that_changes_between_the_stale_check_and_the_scores_is_judge_stale(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group was read again before the scores' transaction began: a member's late turn committed in between (by
    another replica here) slipped through, and the scores of what the judge was shown were stored."""
    judge = GroupJudge(replica_stores[0], ScoringStore(replica_stores[0].engine), JudgeSettings(),
                       client=HeldJudge(released=True), clock=clock)
    store_rewards = judge.store.add_rewards

    def changed_first(*args: Any, **kwargs: Any) -> Any:
        replica_stores[1].add_spans(_late_turn([]))
        return store_rewards(*args, **kwargs)

    monkeypatch.setattr(judge.store, "add_rewards", changed_first)
    run = judge.judge("g")
    assert (run.state, run.judgements) == ("failed", []) and run.error.startswith("judge_stale")
    assert all("ruler" not in t.rewards for t in replica_stores[1].trajectories(group="g"))
    assert judge.scoring.judgements(["g-0", "g-1"]) == {"g-0": [], "g-1": []}


def test_an_explanation_past_the_schemas_max_length_is_stored_cut(replica_stores: list[SqlStore], clock: Clock) -> None:
    """A judge that ignores `maxLength` (OpenAI does) had its explanations stored whole, however long."""
    class Wordy(HeldJudge):
        def complete(self, messages: list[dict[str, Any]], fmt: dict[str, Any], **kwargs: Any) -> str:
            explanation = fmt["json_schema"]["schema"]["properties"]["scores"]["properties"]["1"]["properties"][
                "explanation"]
            assert explanation["maxLength"] == 12
            return json.dumps({"scores": {"1": {"explanation": "right " * 100, "score": 1},
                                          "2": {"explanation": "wrong", "score": 0}}})

    store = replica_stores[0]
    judge = GroupJudge(store, ScoringStore(store.engine), JudgeSettings(explanation_max_chars=12), client=Wordy(),
                       clock=clock)
    run = judge.judge("g")
    assert [j.explanation for j in run.judgements] == ["right right\u2026", "wrong"]
    found = judge.scoring.judgements(["g-0", "g-1"])
    assert [row["explanation"] for tid in ("g-0", "g-1") for row in found[tid]] == ["right right\u2026", "wrong"]


def _unsized(group: str) -> list[Any]:
    """Spans of a group of three members without `art.group.size` (so a third may join it), apart from group `g`'s."""
    spans = group_spans(group, ["7", "8", "9"], first_span=100)
    for span in spans:
        span.attributes.pop(sc.GROUP_SIZE, None)
    return spans


@pytest.mark.parametrize(("group", "change"), [("g", lambda: _late_turn([])), ("h", lambda: _unsized("h")[4:])],
                         ids=["a member got more messages", "a member came"])
def test_an_export_in_flight_as_the_scores_are_written_is_waited_for_and_seen(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch, group: str, change: Any
) -> None:
    """Read again in the scores' transaction without the export's locks, the group missed an export of another replica
    that had changed it and not committed yet: the scores were stored once it committed."""
    if replica_stores[0].engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: an export in flight holds up the scores' whole transaction")
    replica_stores[0].add_spans(_unsized("h")[:4])
    judge = GroupJudge(replica_stores[0], ScoringStore(replica_stores[0].engine), JudgeSettings(),
                       client=HeldJudge(released=True), clock=clock)
    written, resume = pause_after(monkeypatch, placement, "write_trajectories")

    def resume_once_waited_for() -> None:
        lock_waited_for(replica_stores[1].engine)
        resume.set()

    store_rewards = judge.store.add_rewards

    def export_in_flight(*args: Any, **kwargs: Any) -> Any:
        threading.Thread(target=replica_stores[1].add_spans, args=(change(),), daemon=True).start()
        assert written.wait(WAIT)
        threading.Thread(target=resume_once_waited_for, daemon=True).start()
        return store_rewards(*args, **kwargs)

    monkeypatch.setattr(judge.store, "add_rewards", export_in_flight)
    run = judge.judge(group)
    assert (run.state, run.judgements) == ("failed", []) and run.error.startswith("judge_stale")
    members = replica_stores[1].trajectories(group=group)
    assert all("ruler" not in t.rewards for t in members)
    assert [t.messages[-1]["content"] for t in members] == (["99", "8"] if group == "g" else ["7", "8", "9"])


def test_the_scores_transaction_assembles_no_trajectory(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stale check assembled the whole group in the scores' transaction: on SQLite it held the write lock for
    seconds with large groups, every export waiting. It compares a stamp per member instead."""
    judge = GroupJudge(replica_stores[0], ScoringStore(replica_stores[0].engine), JudgeSettings(),
                       client=HeldJudge(released=True), clock=clock)
    in_scores, assembled = threading.Event(), []
    assemble, store_rewards = store_reads.assemble, judge.store.add_rewards

    def recorded(conn: Any, rows: list[Any], training: Any) -> Any:
        if in_scores.is_set():
            assembled.extend(row["id"] for row in rows)
        return assemble(conn, rows, training)

    def scores(*args: Any, **kwargs: Any) -> Any:
        in_scores.set()
        try:
            return store_rewards(*args, **kwargs)
        finally:
            in_scores.clear()

    monkeypatch.setattr(store_reads, "assemble", recorded)
    monkeypatch.setattr(judge.store, "add_rewards", scores)
    run = judge.judge("g")
    assert run.state == "ok" and [j.score for j in run.judgements] == [1.0, 0.0]
    assert assembled == []


def test_a_group_that_changes_right_after_the_judge_reads_it_is_judge_stale(
    replica_stores: list[SqlStore], clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the scores' transaction compares is read before the members the judge is shown: a member's late turn
    committed right after they were read is seen."""
    judge = GroupJudge(replica_stores[0], ScoringStore(replica_stores[0].engine), JudgeSettings(),
                       client=HeldJudge(released=True), clock=clock)
    members = judge._members

    def changed_after(group_id: str) -> Any:
        found = members(group_id)
        replica_stores[1].add_spans(_late_turn([]))
        return found

    monkeypatch.setattr(judge, "_members", changed_after)
    run = judge.judge("g")
    assert (run.state, run.judgements) == ("failed", []) and run.error.startswith("judge_stale")
    assert all("ruler" not in t.rewards for t in replica_stores[1].trajectories(group="g"))
