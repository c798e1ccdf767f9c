"""Rewards in the store: from the API, reward events and reward spans; before their spans; weighted sums; checks."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, func, select, text
from sqlalchemy.exc import DBAPIError

from collector import pool
from collector.errors import InvalidRequest
from collector.protocol import BatchRequest, ReleaseRequest, RewardIn
from collector.schema import rewards
from tests.collector.span_builders import llm, rollout, sid, trajectory


def test_reward_before_spans_applies_when_they_arrive(make_store) -> None:
    store = make_store()
    accepted = store.add_reward(RewardIn(rollout_id="r1", name="judge", value=0.25))
    assert not accepted.trajectory_known
    store.add_spans(trajectory(10, "r1", reward=1.0))
    assert store.trajectory("r1").rewards == {"reward": 1.0, "judge": 0.25}
    assert store.add_reward(RewardIn(rollout_id="r1", value=0.0)).trajectory_known
    assert store.trajectory("r1").reward == 0.0  # API overrides the span event


def test_a_uuid_rollout_id_in_any_form_rewards_one_trajectory(make_store) -> None:
    """A trajectory whose spans wrote a UUID rollout id with dashes (another tracer) is rewarded by its hex digits (as
    `art_langgraph.reward` sends a UUID) and by any other form, before and after its spans; every answer and read
    names it by its hex digits. Before, each form named a trajectory of its own, and only the spans' form reached it."""
    dashed = "123e4567-e89b-12d3-a456-426614174000"
    key = dashed.replace("-", "")
    store = make_store()
    early = store.add_reward(RewardIn(rollout_id="{" + dashed.upper() + "}", name="early", value=0.1))
    assert (early.rollout_id, early.trajectory_known) == (key, False)
    store.add_spans(trajectory(10, dashed, reward=1.0))
    late = store.add_rewards([RewardIn(rollout_id=key, name="hex", value=0.2),
                              RewardIn(rollout_id="urn:uuid:" + dashed, name="urn", value=0.3)])
    assert [(r.rollout_id, r.trajectory_known) for r in late] == [(key, True), (key, True)]
    assert [t.id for t in store.trajectories()] == [key]
    assert store.trajectory(dashed).rewards == {"reward": 1.0, "early": 0.1, "hex": 0.2, "urn": 0.3}
    assert store.trajectory(dashed.upper()).id == key
    not_uuid = dashed[:-1] + "g"  # any other id is as written
    assert store.add_reward(RewardIn(rollout_id=not_uuid, value=0.5)).rollout_id == not_uuid


def refuse_reward(engine: Engine, value: float) -> None:
    """Make the database refuse to store a reward of `value` ("disk full"), as a full disk or a lost connection
    fails a write."""
    if engine.dialect.name == "postgresql":
        statements = [
            "CREATE FUNCTION refuse_reward() RETURNS trigger AS $$ BEGIN IF NEW.value = "
            f"{value!r} THEN RAISE EXCEPTION 'disk full'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER refuse_reward BEFORE INSERT ON rewards FOR EACH ROW EXECUTE FUNCTION refuse_reward()",
        ]
    else:
        statements = [f"CREATE TRIGGER refuse_reward BEFORE INSERT ON rewards WHEN NEW.value = {value!r} "
                      "BEGIN SELECT RAISE(ABORT, 'disk full'); END"]
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))


def test_rewards_stored_together_apply_each_as_one_stored_alone(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=None))
    b_trace = f"{20:032x}"
    accepted = store.add_rewards(
        [RewardIn(rollout_id="a", name="judge", value=0.1), RewardIn(trace_id=b_trace, value=0.5),
         RewardIn(rollout_id="b", name="judge", value=0.2), RewardIn(rollout_id="a", name="judge", value=0.3)],
        score_ids=[None, "s1", None, None],
    )
    assert [(r.rollout_id, r.value, r.trajectory_known) for r in accepted] == [
        ("a", 0.1, True), (None, 0.5, False), ("b", 0.2, False), ("a", 0.3, True)
    ]
    assert store.trajectory("a").rewards == {"judge": 0.3}  # of two of one name, the later one
    store.add_spans(trajectory(20, "b", reward=None))  # b's rewards, by trace and by rollout id, wait for its spans
    assert store.trajectory("b").rewards == {"reward": 0.5, "judge": 0.2}
    assert store.withdraw_score("s1", None)  # the score id came with its reward
    assert store.trajectory("b").rewards == {"judge": 0.2}
    assert store.add_rewards([]) == []
    with pytest.raises(ValueError, match="1 score ids for 2 rewards"):
        store.add_rewards([RewardIn(rollout_id="a", value=1.0)] * 2, score_ids=["s2"])


def test_rewards_stored_together_reopen_a_group_skipped_for_its_rewards(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=1.0))
    assert [(g.state, g.reason) for g in store.groups()] == [("skipped", "no reward spread")]
    store.add_rewards([RewardIn(rollout_id="a", value=1.0), RewardIn(rollout_id="b", value=0.0)])
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["g"]


def test_rewards_stored_together_are_stored_all_or_none(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=None) + trajectory(20, "b", reward=None))
    both = [RewardIn(rollout_id="a", value=0.25), RewardIn(rollout_id="b", value=0.75)]
    with pytest.raises(InvalidRequest, match="needs `rollout_id` or `trace_id`"):
        store.add_rewards([both[0], RewardIn(value=1.0)])
    refuse_reward(store.engine, 0.75)
    with pytest.raises(DBAPIError, match="disk full"):  # a store error on the second reward
        store.add_rewards(both)
    assert [store.trajectory(rollout_id).rewards for rollout_id in "ab"] == [{}, {}]
    assert [(g.state, g.rewarded) for g in store.groups()] == [("open", 0)]


def test_reward_needs_an_id(make_store) -> None:
    with pytest.raises(InvalidRequest):
        make_store().add_reward(RewardIn(value=1.0))


def test_invalid_reward_event_rejects_the_export(make_store) -> None:
    store = make_store()
    spans = trajectory(10, "a", reward=1.0)
    spans[1].events[0].attributes["art.reward.value"] = float("nan")
    with pytest.raises(InvalidRequest, match="finite"):
        store.add_spans(spans)
    assert store.trajectories() == []


def test_weighted_training_reward(make_store) -> None:
    store = make_store(reward_weights={"correct": 1.0, "short": 0.5})
    store.add_spans(trajectory(10, "a", reward=None) + trajectory(20, "b", reward=None))
    for rollout_id, correct in (("a", 1.0), ("b", 0.0)):
        store.add_reward(RewardIn(rollout_id=rollout_id, name="correct", value=correct))
    (group,) = store.groups()
    assert ((group.state, group.rewarded, group.reason)
            == ("open", 0, "2 trajectories without reward 1*'correct' + 0.5*'short'"))
    store.add_reward(RewardIn(rollout_id="a", name="short", value=0.2))
    store.add_reward(RewardIn(rollout_id="b", name="short", value=1.0))
    (batch_group,) = store.lease(BatchRequest()).groups
    assert (sorted((t.id, t.reward, t.rewards["short"]) for t in batch_group.trajectories)
            == [("a", 1.1, 0.2), ("b", 0.5, 1.0)])


def test_reward_spans_attach_by_rollout_or_trace(make_store) -> None:
    from collector.otlp import SpanEvent, SpanRecord

    store = make_store()
    store.add_spans(trajectory(10, "a", reward=None) + trajectory(20, "b", reward=None))
    late = SpanRecord("f" * 32, sid(900), None, "score", 500, 600,
                      {"art.span.kind": "reward", "art.rollout.id": "a", "art.reward.value": 0.25})
    same_trace = SpanRecord(
        f"{20:032x}", sid(901), sid(20), "judge", 500, 600, {"art.span.kind": "reward"},
        [SpanEvent("art.reward", 550, {"art.reward.name": "reward", "art.reward.value": 0.75})],
    )
    store.add_spans([late, same_trace])
    assert (store.trajectory("a").reward, store.trajectory("b").reward) == (0.25, 0.75)
    assert [t.id for t in store.trajectories()] == ["a", "b"]  # reward spans make no trajectory of their own
    bad = SpanRecord("f" * 32, sid(902), None, "score", 1, 2,
                     {"art.span.kind": "reward", "art.rollout.id": "a", "art.reward.value": "high"})
    with pytest.raises(InvalidRequest, match="finite number"):
        store.add_spans([bad])


def test_a_reward_span_reopens_a_group_skipped_for_its_rewards_and_is_activity(make_store, clock) -> None:
    from collector.otlp import SpanRecord

    def judged(n: int, value: float, **attrs: str) -> SpanRecord:
        return SpanRecord(f"{20:032x}", sid(n), None, "judge", 500, 600,
                          {"art.span.kind": "reward", "art.reward.value": value, **attrs})

    for owner in ({"art.rollout.id": "b"}, {}):  # by rollout id, or by the rollout's trace
        store = make_store()
        store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=1.0))
        assert store.lease(BatchRequest()).groups == []
        assert [(g.state, g.reason) for g in store.groups()] == [("skipped", "no reward spread")]
        store.add_spans([judged(900, 0.0, **owner)])  # as a new reward by API does
        assert [g.id for g in store.lease(BatchRequest()).groups] == ["g"]

    store = make_store(group_timeout_seconds=100)
    store.add_spans(trajectory(10, "a", reward=1.0, size=3) + trajectory(20, "b", reward=None, size=3))
    clock.now += 90
    store.add_spans([judged(900, 0.0)])  # b's reward, by trace: activity that keeps the group from expiring
    clock.now += 20
    assert [(g.state, g.rewarded) for g in store.groups()] == [("open", 2)]


def test_a_reward_after_the_timeout_finds_its_group_as_a_read_would_have(make_store, clock) -> None:
    """Upkeep runs before reads: a reward, or a withdrawn score, to a group overdue for it, with no read since,
    expires the group first unless it is ready, as that read would have; b's reward does not keep g open for c to
    complete it. The ready h takes y's new reward and waits for a trainer."""
    expired = ("expired", "expired: no new span or reward for 100 s while waiting for 1 more of 3 trajectories")
    store = make_store(group_timeout_seconds=100)
    store.add_spans(trajectory(10, "a", reward=1.0, size=3) + trajectory(20, "b", reward=None, size=3))
    store.add_spans(trajectory(40, "x", reward=1.0, group="h") + trajectory(50, "y", reward=0.0, group="h"))
    clock.now += 101  # no read since: nothing expired yet
    store.add_rewards([RewardIn(rollout_id="b", value=0.0), RewardIn(rollout_id="y", value=0.5)])
    assert {g.id: (g.state, g.reason) for g in store.groups()} == {"g": expired, "h": ("ready", None)}
    store.add_spans(trajectory(30, "c", reward=0.5, size=3))
    assert store.trajectory("c").group_id == "g#2"
    assert [[t.reward for t in g.trajectories] for g in store.lease(BatchRequest()).groups] == [[1.0, 0.5]]

    scored = make_store(group_timeout_seconds=100)
    scored.add_spans(trajectory(10, "a", reward=None, size=3) + trajectory(20, "b", reward=0.0, size=3))
    scored.add_rewards([RewardIn(trace_id=f"{10:032x}", value=1.0)], score_ids=["s1"])
    clock.now += 101
    assert scored.withdraw_score("s1", None)  # its Langfuse score deleted
    assert [(g.state, g.reason) for g in scored.groups()] == [expired]


def test_a_withdrawn_score_takes_back_its_rewards_only_while_its_group_is_in_the_pool(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=None) + trajectory(20, "b", reward=None))
    a, b = f"{10:032x}", f"{20:032x}"
    store.add_reward(RewardIn(trace_id=a, value=0.2))  # by API
    store.add_reward(RewardIn(trace_id=a, value=0.9), score_id="s1")  # from a Langfuse score, later
    store.add_reward(RewardIn(trace_id=b, value=0.0), score_id="s2")
    assert store.withdraw_score("s1", None)
    assert store.trajectory("a").reward == 0.2  # the API reward holds again
    assert store.withdraw_score("s2", ("s3", RewardIn(trace_id=b, value=0.5)))  # s3: the next latest score
    assert store.trajectory("b").reward == 0.5
    store.add_reward(RewardIn(trace_id=b, value=0.7))
    assert store.withdraw_score("s4", ("s3", RewardIn(trace_id=b, value=0.5)))  # s3 has its reward: not again
    assert store.trajectory("b").reward == 0.7
    (group,) = store.lease(BatchRequest()).groups
    store.add_reward(RewardIn(trace_id=a, value=1.0), score_id="s5")
    assert not store.withdraw_score("s5", None)  # leased: the trainer may be training on it
    assert store.trajectory("a").reward == 1.0


def test_rewards_stored_together_share_their_transaction_with_the_callers_work(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=None))
    seen: list[int] = []

    def count_then_refuse(conn: Connection) -> None:
        seen.append(conn.execute(select(func.count()).select_from(rewards)).scalar_one())
        raise RuntimeError("claim lost")

    with pytest.raises(RuntimeError, match="claim lost"):
        store.add_rewards([RewardIn(rollout_id="a", value=0.5)], also=count_then_refuse)
    assert seen == [1]  # `also` ran after the reward was written, in its transaction ...
    assert store.trajectory("a").rewards == {}  # ... whose failure stored nothing
    store.add_rewards([RewardIn(trace_id=f"{10:032x}", value=0.5)], score_ids=["s1"])
    with pytest.raises(RuntimeError, match="claim lost"):
        store.withdraw_score("s1", None, also=count_then_refuse)
    assert seen == [1, 0]
    assert store.trajectory("a").rewards == {"reward": 0.5}  # the withdrawal was rolled back with it


def test_a_reward_by_trace_id_applies_to_each_trajectory_with_a_span_in_that_trace(make_store) -> None:
    store = make_store()
    first, resumed, later = f"{10:032x}", f"{30:032x}", f"{40:032x}"
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=1.0))
    # a's graph run resumed in a new trace: a model call of a there, while a's row names the trace of its rollout span
    store.add_spans([llm(31, rollout="a", trace=resumed, start=20, prompt=[1, 2], completion=[3])])
    assert store.lease(BatchRequest()).groups == []  # skipped: no reward spread
    assert store.add_reward(RewardIn(trace_id=resumed, value=0.0), score_id="s1").trajectory_known
    assert store.trajectory("a").rewards == {"reward": 0.0}  # and the group is back in the pool
    store.add_reward(RewardIn(trace_id=first, name="judge", value=0.5))
    store.add_reward(RewardIn(trace_id=resumed, name="judge", value=0.25))  # of one name, the later, by either trace
    # a rollout span of a that comes first in a's order makes a's row name a third trace: a's rewards stay
    store.add_spans([rollout(5, "a", trace=later, group="g", size=2)])
    assert store.trajectory("a").rewards == {"reward": 0.0, "judge": 0.25}
    batch = store.lease(BatchRequest())
    assert [{t.id: t.reward for t in g.trajectories} for g in batch.groups] == [{"a": 0.0, "b": 1.0}]
    assert not store.withdraw_score("s1", None)  # its trajectory's group is leased
    store.release(batch.id, ReleaseRequest(reason="vLLM down", failed=False))
    assert store.withdraw_score("s1", None)
    assert store.trajectory("a").rewards == {"reward": 1.0, "judge": 0.25}


def test_withdrawing_a_score_on_a_trace_of_many_rollouts_binds_no_list_of_them(make_store) -> None:
    """The withdrawal of a Langfuse score by trace id listed the ids of every trajectory with a span in the trace in
    each of its statements: 70,000 rollouts in one trace passed PostgreSQL's 65,535 parameters and failed it."""
    store = make_store(min_group_size=1)
    trace = f"{0x51:032x}"
    store.add_spans([rollout(n + 1, f"r{n}", trace=trace, group=f"g{n}", size=1) for n in range(600)])
    assert store.add_reward(RewardIn(trace_id=trace, name="judge", value=0.5), score_id="s1").trajectory_known
    bound: list[int] = []
    event.listen(store.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, parameters, *_: bound.append(len(parameters or ())))
    assert store.withdraw_score("s1", None)
    assert max(bound) < 600 and "judge" not in store.trajectory("r599").rewards


def _export_during(monkeypatch: pytest.MonkeyPatch, store: Any, spans: list[Any]) -> dict[str, Any]:
    """Make the next transaction that locks groups start an export of `spans` from another thread once it holds them
    (as another replica's, under READ COMMITTED), and give it 2 s to commit meanwhile; returns what that transaction
    locked first (`locked`), the groups it marked rewarded (`rewarded`), whether the export committed meanwhile
    (`inside`) and its thread (`export`), to join."""
    lock_groups, rewarded, touched = pool.lock_groups, pool.rewarded, {}

    def an_export_meanwhile(conn: Connection, group_ids: Any) -> None:
        group_ids = sorted(set(group_ids) - {None})
        lock_groups(conn, group_ids)
        if not touched:
            touched["locked"] = group_ids
            touched["export"] = threading.Thread(target=store.add_spans, args=(spans,))
            touched["export"].start()
            touched["export"].join(timeout=2)
            touched["inside"] = not touched["export"].is_alive()

    def noted(conn: Connection, group_ids: Any, now: float) -> None:
        touched.setdefault("rewarded", sorted(group_ids))  # the first transaction's, not the export's after it
        rewarded(conn, group_ids, now)

    monkeypatch.setattr(pool, "lock_groups", an_export_meanwhile)
    monkeypatch.setattr(pool, "rewarded", noted)
    return touched


def test_a_rollout_exported_in_the_trace_while_a_score_is_withdrawn_waits_for_the_withdrawal(
    make_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The withdrawal holds the locks an export in its trace takes: a rollout another replica exports meanwhile commits
    after it, so the withdrawal neither misses it nor touches its group out of the groups' id order."""
    store = make_store(min_group_size=1)
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: no export runs inside the withdrawal")
    trace = f"{0x52:032x}"
    store.add_spans([rollout(n + 1, f"r{n}", trace=trace, group=f"g{n}", size=1) for n in range(2)])
    store.add_reward(RewardIn(trace_id=trace, name="judge", value=0.5), score_id="s1")
    touched = _export_during(monkeypatch, store, [rollout(50, "late", trace=trace, group="g-late")])
    assert store.withdraw_score("s1", None)
    touched["export"].join(timeout=30)
    assert touched["locked"] == ["g0", "g1"] and touched["rewarded"] == ["g0", "g1"] and not touched["inside"]
    assert "judge" not in store.trajectory("late").rewards and store.trajectory("late").group_id == "g-late"


def test_an_export_placing_a_rewarded_trajectory_waits_for_the_reward(
    make_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reward by trace id holds the locks an export of the trace takes: an export placing one of its trajectories in
    a group (its rollout span arriving) commits after the reward, and marks that group changed itself."""
    store = make_store(min_group_size=2)
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: no export runs inside the reward")
    trace = f"{0x53:032x}"
    store.add_spans([llm(11, rollout="r", trace=trace, start=1, prompt=[1], completion=[2])])  # no rollout span yet
    assert store.trajectory("r").group_id == ""
    touched = _export_during(monkeypatch, store, [rollout(12, "r", trace=trace, group="ga")])
    assert store.add_reward(RewardIn(trace_id=trace, value=0.5)).trajectory_known
    touched["export"].join(timeout=30)
    assert touched["locked"] == [] and touched["rewarded"] == [] and not touched["inside"]
    assert store.trajectory("r").group_id == "ga" and store.trajectory("r").rewards == {"reward": 0.5}


def test_a_reward_racing_its_rollouts_export_shows_in_the_next_listing(
    make_store, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reward by rollout id read the rollout's groups before an export placing it committed: it applied, but marked
    no group changed, so the decision a listing remembered in between (before the reward) stood in every later one."""
    store = make_store()
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: no export commits inside the reward")
    store.add_spans(trajectory(10, "a", reward=1.0))
    read, go = threading.Event(), threading.Event()
    groups_of = pool.groups_of

    def paused(conn: Connection, trajectory_ids: list[str], trace_ids: list[str]) -> set[str]:
        found = groups_of(conn, trajectory_ids, trace_ids)
        if threading.current_thread().name == "reward":
            read.set()
            assert go.wait(30)
        return found

    monkeypatch.setattr(pool, "groups_of", paused)
    rewarding = threading.Thread(target=store.add_reward, args=(RewardIn(rollout_id="b", value=0.0),), name="reward")
    rewarding.start()
    assert read.wait(30)
    exporting = threading.Thread(target=store.add_spans, args=(trajectory(20, "b", reward=None),))
    exporting.start()
    exporting.join(timeout=2)
    clock.now += 1
    store.groups()  # remembers each open group's decision
    go.set()
    rewarding.join(timeout=30)
    exporting.join(timeout=30)
    clock.now += 1
    (group,) = store.groups()
    assert (group.id, group.state, group.size, group.rewarded) == ("g", "ready", 2, 2)
