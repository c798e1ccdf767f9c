"""The RULER judge's run mechanics without a model: failure policies, automatic runs, auth.

The judge here is a real HTTP endpoint that is down (a closed port), so every call fails the
way an unreachable judge fails; scoring with a real model is in `test_ruler_vllm.py`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from art_langgraph import semconv as sc
from tests.collector.seeding import free_port, group_spans, make_app


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


def test_judge_unknown_group_is_404(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with TestClient(make_app(tmp_path, monkeypatch, env=down_judge("skip"))) as client:
        answer = client.post("/v1/groups/nope/judge")
        assert answer.status_code == 404 and answer.json()["error"] == "not_found"


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
