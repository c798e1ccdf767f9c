"""The read API behind the web page (`collector/views.py`, routes under `/v1/view/`)."""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete

from art_langgraph import semconv as sc
from collector import assembly, curve, engine, rows
from collector.otlp import SpanRecord
from collector.protocol import RewardIn
from collector.read_protocol import CurvePoint
from collector.schema import spans, trajectories
from collector.store_base import Store
from collector.views import NO_MODEL_CALL, policy_step, reward_curve
from tests.collector import span_builders as sb
from tests.collector.seeding import QUESTION, group_spans, make_app, trace_id
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


def test_groups_are_the_newest_first_up_to_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`GET /v1/view/groups` had no limit: every group of the store, oldest first, on every load of the page. A
    group a trajectory left (its group key changed) is empty: not shown, and not counted in the limit."""
    app = make_app(tmp_path, monkeypatch)
    store = app.state.store
    for n in range(4):
        store.add_spans(group_spans(f"g{n}", ["7", "8"], rewards=[1.0, 0.0], first_span=1 + 100 * n))
    alone = sb.llm(901, rollout=None, trace=f"{900:032x}", start=10, prompt=[1], completion=[2], task="lonely")
    store.add_spans([alone])
    store.add_spans([replace(alone, span_id=sb.sid(902), start_ns=5, attributes={**alone.attributes, sc.GROUP: "g1"})])
    with TestClient(app) as client:
        listed = [g["id"] for g in client.get("/v1/view/groups").json()]
        assert listed == ["g1#2", "g3", "g2", "g1", "g0"] and "lonely" not in listed
        assert [g["id"] for g in client.get("/v1/view/groups", params={"limit": 2}).json()] == ["g1#2", "g3"]
        for bad in (0, 1001):
            assert_error(client.get("/v1/view/groups", params={"limit": bad}), 400, "invalid_request")


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


ODD_IDS = [".", "..", "a/../b", "./x", "q?x", "h#y", "p%2e%20c", "sp ace+plus&amp=1"]
"""Legal trajectory ids a URL path mangles: `.` and `..` are dot segments browsers and httpx remove, the rest hold
characters a URL gives a meaning to."""


def test_a_trajectory_with_any_legal_id_is_found_by_the_query_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`GET /v1/view/trajectories/{id}` can never be reached for an id `.` or `..` (the client drops the segment)."""
    app = make_app(tmp_path, monkeypatch)
    with monkeypatch.context() as before:  # a store written before ingest refused ids with a `.` or `..` segment
        before.setattr(assembly, "span_problem", lambda _: None)
        app.state.store.add_spans(sb.rollout_group({tid: 0.5 for tid in ODD_IDS}))
    with TestClient(app) as client:
        for tid in ODD_IDS:
            found = client.get("/v1/view/trajectory", params={"id": tid})
            assert found.status_code == 200 and found.json()["id"] == tid, tid
        assert_error(client.get("/v1/view/trajectory", params={"id": "nope"}), 404, "not_found")
        assert_error(client.get("/v1/view/trajectory"), 400, "invalid_request")


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


def test_the_reward_curve_assembles_no_trajectory_and_reads_the_spans_of_changed_ones_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The curve assembled every trajectory of the store on each load of the page (0.98 s at 2,000 trajectories,
    against 0.11 s for the list itself), and so without bound as the store grew."""
    app = make_app(tmp_path, monkeypatch)
    store = app.state.store
    store.add_spans(group_spans("a", ["7", "8"], rewards=[1.0, 0.0], steps=[0, 0]))
    store.add_spans(group_spans("b", ["7", "7"], rewards=[1.0, 0.5], steps=[1, 1], first_span=100))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the reward curve assembled a trajectory")

    read: list[str] = []
    step_of = curve.step_of

    def counted(records: list[SpanRecord]) -> int | None:
        read.extend({str(r.attributes[sc.ROLLOUT_ID]) for r in records})
        return step_of(records)

    monkeypatch.setattr(assembly, "assemble", refuse)
    monkeypatch.setattr(curve, "step_of", counted)

    def points() -> list[tuple[int, float, int]]:
        return [(p.policy_step, p.mean, p.count) for p in reward_curve(store)]

    assert points() == [(0, 0.5, 2), (1, 0.75, 2)] and sorted(read) == ["a-0", "a-1", "b-0", "b-1"]
    read.clear()
    assert points() == [(0, 0.5, 2), (1, 0.75, 2)] and read == []
    store.add_spans([sb.llm(900, rollout="a-0", trace=trace_id("a", 0), start=20, prompt=[9], completion=[9], step=5)])
    store.add_reward(RewardIn(rollout_id="b-1", value=0.0))
    assert points() == [(0, 0.0, 1), (1, 0.5, 2), (5, 1.0, 1)] and read == ["a-0"]


def test_the_reward_curve_forgets_the_steps_of_deleted_trajectories_once_it_reads_every_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PolicySteps` kept the step of every trajectory it ever read, also of those deleted since (a foreign
    trajectory `foreign_deletion` deletes), so without bound."""
    store = make_app(tmp_path, monkeypatch).state.store
    store.add_spans(group_spans("a", ["7", "8"], rewards=[1.0, 0.0], steps=[0, 0]))
    store.add_spans(group_spans("b", ["7", "7"], rewards=[1.0, 0.5], steps=[1, 1], first_span=100))
    assert len(store.curve_facts()) == 4
    everyone = set(store._steps._known)
    gone = sorted(everyone)[:2]
    with store.engine.begin() as conn:
        conn.execute(delete(spans).where(spans.c.trajectory_id.in_(gone)))
        conn.execute(delete(trajectories).where(trajectories.c.id.in_(gone)))
    assert store.curve_facts(split="test") == [] and set(store._steps._known) == everyone  # a split: others stay
    assert len(store.curve_facts()) == 2 and set(store._steps._known) == everyone - set(gone)


def test_the_reward_curve_holds_the_spans_of_one_chunk_of_trajectories_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first read (a restart, another replica) parsed the spans of every trajectory before computing any step:
    0.9 GB at 10,000 trajectories of 5 spans."""
    store = make_app(tmp_path, monkeypatch).state.store
    store.add_spans(group_spans("a", ["7", "8"], rewards=[1.0, 0.0], steps=[0, 0]))
    store.add_spans(group_spans("b", ["7", "7"], rewards=[1.0, 0.5], steps=[1, 1], first_span=100))
    monkeypatch.setattr(engine, "CHUNK", 2)
    held, most = [0], [0]
    parse, step_of = rows.SpanRecord.from_dict, curve.step_of

    class Counted(SpanRecord):
        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> SpanRecord:
            held[0] += 1
            most[0] = max(most[0], held[0])
            return parse(data)

    def counted(records: list[SpanRecord]) -> int | None:
        held[0] -= len(records)
        return step_of(records)

    monkeypatch.setattr(rows, "SpanRecord", Counted)  # the spans are read there (`rows.spans_by_trajectory`)
    monkeypatch.setattr(curve, "step_of", counted)
    assert [(p.policy_step, p.count) for p in reward_curve(store)] == [(0, 2), (1, 2)]
    assert held[0] == 0 and most[0] == 4  # two trajectories of two spans each


def assembled_curve(store: Store, name: str | None, split: str | None) -> list[CurvePoint]:
    """The reward curve as it was computed before `Store.curve_facts`: from every trajectory, assembled."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for t in store.trajectories(split=split):
        value = t.reward if name is None else t.rewards.get(name)
        step = policy_step(t)
        if value is not None and math.isfinite(value) and step is not None:
            by_step[step].append(value)
    return [
        CurvePoint(policy_step=step, mean=statistics.mean(v), count=len(v), min=min(v), max=max(v))
        for step, v in sorted(by_step.items())
    ]


def grow(rng: random.Random, store: Store, ids: list[str], *, added: int, touched: int, base: int) -> None:
    """Add `added` trajectories to the store and to `ids`, then new turns and rewards to `touched` random ones of
    `ids`: turns that extend the one before or start a sequence, a random step or none, some without token ids;
    rewards by span and by API, names repeated, values huge; every 7th trajectory keyed by trace id (span numbers
    from `base`)."""
    values = [0.0, 0.25, -1.0, 1e308, -1e308]
    ids.extend(f"t{n}" for n in range(len(ids), len(ids) + added))
    records: list[SpanRecord] = []
    for i, tid in enumerate(rng.sample(ids, k=touched)):
        number, first = int(tid[1:]), base + 100 * i
        trace, by_rollout = f"{number + 1:032x}", number % 7 != 0
        tokens = [1]
        for turn in range(rng.randint(0, 3)):
            prompt = tokens + [2] if rng.random() < 0.6 else [3, turn]
            completion = None if rng.random() < 0.1 else [4 + turn]
            records.append(sb.llm(first + turn, rollout=tid if by_rollout else None, trace=trace, start=base + turn,
                                  prompt=prompt, completion=completion, step=rng.choice([None, 0, 1, 2, 3])))
            tokens = prompt + (completion or [])
        if by_rollout and rng.random() < 0.8:
            named = {name: rng.choice(values) for name in rng.sample("ab", k=rng.randint(0, 2))}
            records.append(sb.rollout(first + 50, tid, trace=trace, split=rng.choice(["train", "test"]), rewards=named))
        for k in range(rng.randint(0, 2)):
            attrs = {sc.SPAN_KIND: sc.SPAN_KIND_REWARD, sc.REWARD_NAME: rng.choice("ab"),
                     sc.REWARD_VALUE: rng.choice(values), **({sc.ROLLOUT_ID: tid} if by_rollout else {})}
            at = rng.randint(0, 1000)
            records.append(SpanRecord(trace, sb.sid(first + 60 + k), None, "score", at, at, attrs))
    store.add_spans(records)
    for tid in rng.sample(ids, k=touched // 2):
        owner = {"rollout_id": tid} if int(tid[1:]) % 7 else {"trace_id": f"{int(tid[1:]) + 1:032x}"}
        store.add_reward(RewardIn(**owner, name=rng.choice(["a", "b", "reward"]), value=rng.choice(values)))


@pytest.mark.parametrize("training", [{}, {"reward_name": "a"}, {"reward_weights": {"a": 2.0, "b": 0.5}}])
def test_the_reward_curve_is_the_one_of_the_assembled_trajectories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, training: dict[str, Any]
) -> None:
    """The curve assembled every trajectory of the store on each load of the page; it reads the rewards and keeps
    each trajectory's policy step until its spans change. Same curve, on a random store, as it grows."""
    rng = random.Random(7)
    store = make_app(tmp_path, monkeypatch, **training).state.store
    ids: list[str] = []
    for n, (added, touched) in enumerate([(40, 40), (40, 60), (0, 30), (0, 0)]):  # the last: nothing changed
        grow(rng, store, ids, added=added, touched=touched, base=100_000 * (n + 1))
        for name in (None, "a", "b", "reward", "nothing"):
            for split in (None, "train", "test"):
                assert reward_curve(store, name=name, split=split) == assembled_curve(store, name, split)
    assert all(reward_curve(store, split=split) for split in ("train", "test"))
    if "reward_weights" in training:  # some weighted sums overflowed, and were left out
        assert any(t.reward is not None and not math.isfinite(t.reward) for t in store.trajectories())


def test_the_page_and_its_reads_need_no_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `ART_API_KEY` set, writes need it (`test_server.py`); the page only reads, and reads are open."""
    app = make_app(tmp_path, monkeypatch, api_key="sekret")
    app.state.store.add_spans(group_spans("a", ["7", "8"], rewards=[1.0, 0.0]))
    with TestClient(app) as client:
        for path in ["/ui/", "/ui/app.js", "/ui/style.css", "/v1/view/trajectories", "/v1/view/trajectories/a-0",
                     "/v1/view/groups", "/v1/view/batches", "/v1/view/reward-curve"]:
            assert client.get(path).status_code == 200, path
        assert_error(client.post("/v1/batches", json={}), 401, "unauthorized")


def test_the_page_revalidates_and_the_view_reads_are_never_stored(client: TestClient) -> None:
    """Neither had a Cache-Control: a browser could keep showing an old app.js after an upgrade, or old reads."""
    for path in ["/ui/", "/ui/app.js", "/ui/style.css"]:
        answer = client.get(path)
        assert answer.headers.get("cache-control") == "no-cache" and answer.headers.get("etag"), path
        again = client.get(path, headers={"if-none-match": answer.headers["etag"]})
        assert again.status_code == 304 and again.headers.get("cache-control") == "no-cache", path
    for path in ["/v1/view/trajectories", "/v1/view/trajectories/a-0", "/v1/view/trajectory?id=a-0",
                 "/v1/view/groups", "/v1/view/batches", "/v1/view/reward-curve"]:
        answer = client.get(path)
        assert answer.status_code == 200 and answer.headers.get("cache-control") == "no-store", path
