"""The read API behind the web page (`collector/views.py`, routes under `/v1/view/`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from collector.protocol import RewardIn
from collector.views import NO_MODEL_CALL
from tests.collector import span_builders as sb
from tests.collector.seeding import QUESTION, group_spans, make_app
from tests.collector.server_helpers import assert_error


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    app = make_app(tmp_path, monkeypatch)
    store = app.state.store
    store.add_spans(group_spans("a", ["7", "8"], rewards=[1.0, 0.0], steps=[0, 0]))
    store.add_spans(group_spans("b", ["7", "7"], rewards=[1.0, 0.5], steps=[1, 1], first_span=100))
    store.add_spans(group_spans("c", ["x", "y"], rewards=[0.2, 0.4], steps=[2, 2], task="tools", tool_call=True,
                                first_span=200))
    with TestClient(app) as client:
        yield client


def ids(client: TestClient, **params: object) -> list[str]:
    return sorted(t["id"] for t in client.get("/v1/view/trajectories", params=params).json()["items"])


def test_filters(client: TestClient) -> None:
    assert len(ids(client)) == 6
    assert ids(client, task="tools") == ["c-0", "c-1"]
    assert ids(client, group="a") == ["a-0", "a-1"]
    assert ids(client, policy_step=1) == ["b-0", "b-1"]
    assert ids(client, reward_min=0.5) == ["a-0", "b-0", "b-1"]
    assert ids(client, reward_min=0.1, reward_max=0.45) == ["c-0", "c-1"]
    page = client.get("/v1/view/trajectories", params={"limit": 2, "offset": 1}).json()
    assert page["total"] == 6 and len(page["items"]) == 2
    every = [t["id"] for t in client.get("/v1/view/trajectories").json()["items"]]
    assert every == ["c-1", "c-0", "b-1", "b-0", "a-1", "a-0"]  # newest first
    assert [t["id"] for t in page["items"]] == every[1:3]
    # a reward filter assembles everything and cuts the page after; it must cut the same page
    filtered = client.get("/v1/view/trajectories", params={"reward_min": 0.0, "limit": 2, "offset": 1}).json()
    assert filtered == page
    tools = client.get("/v1/view/trajectories", params={"task": "tools", "limit": 1}).json()
    assert tools["total"] == 2 and [t["id"] for t in tools["items"]] == ["c-1"]


def test_an_offset_past_any_store_is_a_bad_request(client: TestClient) -> None:
    """An offset past SQLite's INTEGER was an OverflowError from the driver: a 500 `internal_error`."""
    too_far = client.get("/v1/view/trajectories", params={"offset": 2**64})
    assert too_far.status_code == 400 and too_far.json()["error"] == "invalid_request"
    assert client.get("/v1/view/trajectories", params={"offset": 2**31 - 1}).json() == {"total": 6, "items": []}


def test_summary_and_detail(client: TestClient) -> None:
    row = next(t for t in client.get("/v1/view/trajectories").json()["items"] if t["id"] == "a-1")
    assert ((row["reward"], row["policy_step"], row["messages"], row["tokens"], row["last_message"])
            == (0.0, 0, 3, 7, "[assistant] 8"))
    detail = client.get("/v1/view/trajectories/c-0").json()
    assert detail["tool_calls"] == 1
    assert detail["conversation"][-1]["tool_calls"][0]["function"]["name"] == "add"
    assert detail["sequences"] == [{"tokens": 7, "prompt_tokens": 4, "completion_tokens": 3, "policy_step": 2}]
    assert detail["judgements"] == []
    missing = client.get("/v1/view/trajectories/nope")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"


def test_groups_batches_and_reward_curve(client: TestClient) -> None:
    groups = {g["id"]: g for g in client.get("/v1/view/groups").json()}
    assert set(groups) == {"a", "b", "c"} and groups["a"]["state"] == "ready" and groups["a"]["judge"] is None
    batch = client.post("/v1/batches", json={"max_groups": 2, "trainer": "t1"}).json()
    client.post(f"/v1/batches/{batch['id']}/ack", json={"policy_step": 3})
    [shown] = client.get("/v1/view/batches").json()
    assert (shown["id"], shown["trainer"], shown["state"], shown["policy_step"]) == (batch["id"], "t1", "acked", 3)
    assert shown["groups"] == sorted(g["id"] for g in batch["groups"])
    curve = client.get("/v1/view/reward-curve").json()
    assert ([(p["policy_step"], p["mean"], p["count"]) for p in curve]
            == [(0, 0.5, 2), (1, 0.75, 2), (2, pytest.approx(0.3), 2)])
    assert client.get("/v1/view/reward-curve", params={"name": "nothing"}).json() == []


def test_home_redirects_to_the_page(client: TestClient) -> None:
    answer = client.get("/", follow_redirects=False)
    assert answer.status_code == 307 and answer.headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and '<script src="app.js">' in page.text
    assert client.get("/ui/app.js").status_code == 200


def test_a_trajectory_without_a_model_call_is_listed_with_why_it_has_no_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(tmp_path, monkeypatch)
    store = app.state.store
    store.add_spans(group_spans("a", ["7", "8"], rewards=[1.0, 0.0]))
    store.add_spans([sb.rollout(n, f"tmpl-{n}", trace=f"{n:032x}", task="ChatPromptTemplate") for n in (100, 200)])
    # no rollout span yet
    store.add_spans([sb.llm(301, rollout="open-1", trace=f"{300:032x}", start=10, prompt=[1], completion=[2])])
    with TestClient(app) as client:
        items = {t["id"]: t for t in client.get("/v1/view/trajectories").json()["items"]}
        assert {tid: (t["group_id"], t["ungrouped"]) for tid, t in items.items()} == {
            "a-0": ("a", None), "a-1": ("a", None),
            "tmpl-100": ("", NO_MODEL_CALL), "tmpl-200": ("", NO_MODEL_CALL),
            "open-1": ("", "not complete: its rollout span, which names its group, has not arrived"),
        }
        assert client.get("/v1/view/trajectories/tmpl-100").json()["ungrouped"] == NO_MODEL_CALL
        assert [g["id"] for g in client.get("/v1/view/groups").json()] == ["a"]
        assert app.state.scoring.judge.due_groups() == ["a"]  # the template runs are no group the judge could take


@pytest.mark.parametrize("bound", ["reward_min", "reward_max"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_reward_bound_that_is_not_finite_is_a_bad_request(client: TestClient, bound: str, value: str) -> None:
    """A NaN bound matched nothing: an empty page, as if no trajectory had such a reward."""
    assert_error(client.get("/v1/view/trajectories", params={bound: value}), 400, "invalid_request")


def test_a_trajectory_id_with_a_slash_is_found_by_both_read_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`GET /v1/trajectories/{id}` took no slash: a stored `math/add-0` was a 404 there, found under /v1/view/."""
    app = make_app(tmp_path, monkeypatch)
    app.state.store.add_spans(group_spans("math/add", ["7", "8"], rewards=[1.0, 0.0]))
    with TestClient(app) as client:
        assert client.get("/v1/trajectories/math%2Fadd-0").json()["id"] == "math/add-0"
        assert client.get("/v1/trajectories/math/add-1").json()["id"] == "math/add-1"
        assert client.get("/v1/view/trajectories/math%2Fadd-0").json()["id"] == "math/add-0"


def test_a_content_part_whose_text_is_not_a_string_is_shown_not_a_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored reply with content `[{"type": "text", "text": 7}]` made the list, the detail and the judge a 500
    (`TypeError` joining the parts): one accepted span broke the web page for every trajectory."""
    app = make_app(tmp_path, monkeypatch)
    reply = [{"role": "assistant", "content": [{"type": "text", "text": 7}, {"type": "text", "text": {"n": 1}}]}]
    app.state.store.add_spans([sb.llm(1, start=10, prompt=[1], completion=[2], messages=QUESTION, output=reply)])
    with TestClient(app) as client:
        [row] = client.get("/v1/view/trajectories").json()["items"]
        assert row["last_message"] == '[assistant] 7\n{"n": 1}'
        assert client.get("/v1/view/trajectories/r1").json()["last_message"] == row["last_message"]


def test_the_reward_curve_leaves_out_a_training_reward_that_is_not_finite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weighted training reward that overflowed to inf made its step's mean and max null (the page drew the step
    at 0), and finite rewards near the float limit overflowed the mean the same way."""
    app = make_app(tmp_path, monkeypatch, reward_weights={"a": 1.0, "b": 1.0})
    store = app.state.store
    store.add_spans(group_spans("g", ["7", "8", "9"], steps=[1, 1, 1]))
    for i, (a, b) in enumerate([(1e308, 1e308), (0.25, 0.5), (1e308, -1e308)]):
        store.add_reward(RewardIn(rollout_id=f"g-{i}", name="a", value=a))
        store.add_reward(RewardIn(rollout_id=f"g-{i}", name="b", value=b))
    with TestClient(app) as client:
        assert client.get("/v1/view/reward-curve").json() == [
            {"policy_step": 1, "mean": 0.375, "count": 2, "min": 0.0, "max": 0.75}
        ]
        [named] = client.get("/v1/view/reward-curve", params={"name": "a"}).json()
        assert named["mean"] == pytest.approx(1e308 / 3 * 2) and named["count"] == 3


def test_the_page_and_its_reads_need_no_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `ART_API_KEY` set, writes need it (`test_server.py`); the page only reads, and reads are open."""
    app = make_app(tmp_path, monkeypatch, api_key="sekret")
    app.state.store.add_spans(group_spans("a", ["7", "8"], rewards=[1.0, 0.0]))
    with TestClient(app) as client:
        for path in ["/ui/", "/ui/app.js", "/ui/style.css", "/v1/view/trajectories", "/v1/view/trajectories/a-0",
                     "/v1/view/groups", "/v1/view/batches", "/v1/view/reward-curve"]:
            assert client.get(path).status_code == 200, path
        assert_error(client.post("/v1/batches", json={}), 401, "unauthorized")
