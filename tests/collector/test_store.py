"""The store contract: idempotent ingest, trajectory identity, group readiness, leases, acks."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from collector import assembly
from collector.errors import Conflict, InvalidRequest, NotFound
from collector.protocol import BatchRequest, RewardIn
from collector.schema import SCHEMA_VERSION
from tests.collector.span_builders import TRACE, llm, rollout, sid

OTHER_TRACE = "1" * 32


def _trajectory(n: int, rollout_id: str, *, reward: float | None, group: str = "g", size: int | None = 2, **kw):
    """A rollout span (ids n) and one LLM turn (ids n + 1) in a trace of its own."""
    trace = f"{n:032x}"
    rewards = {"reward": reward} if reward is not None else {}
    return [
        llm(n + 1, rollout=rollout_id, trace=trace, start=10, prompt=[1, 2], completion=[n], logprobs=[-1.0]),
        rollout(n, rollout_id, trace=trace, group=group, size=size, rewards=rewards, **kw),
    ]


def test_setup_is_idempotent_and_versioned(make_store) -> None:
    store = make_store()
    store.setup()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT max(version) FROM schema_version")).scalar() == SCHEMA_VERSION
        if store.engine.dialect.name == "sqlite" and store.engine.url.database:  # file-backed SQLite
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL


def test_duplicate_spans_are_ignored(make_store) -> None:
    store = make_store()
    spans = _trajectory(10, "r1", reward=1.0)
    assert store.add_spans(spans) == 2
    assert store.add_spans(spans + spans) == 0
    traj = store.trajectory("r1")
    assert traj is not None and traj.rewards == {"reward": 1.0}
    assert [s.token_ids for s in traj.sequences] == [[1, 2, 10]]


def test_children_before_rollout_span(make_store) -> None:
    store = make_store()
    child, root = _trajectory(10, "r1", reward=0.5)
    store.add_spans([child])
    early = store.trajectory("r1")
    assert early is not None and not early.complete and early.group_id == ""
    assert store.groups() == []
    store.add_spans([root])
    late = store.trajectory("r1")
    assert late is not None and late.complete and late.group_id == "g" and late.reward == 0.5


def test_reward_before_spans_applies_when_they_arrive(make_store) -> None:
    store = make_store()
    accepted = store.add_reward(RewardIn(rollout_id="r1", name="judge", value=0.25))
    assert not accepted.trajectory_known
    store.add_spans(_trajectory(10, "r1", reward=1.0))
    assert store.trajectory("r1").rewards == {"reward": 1.0, "judge": 0.25}
    assert store.add_reward(RewardIn(rollout_id="r1", value=0.0)).trajectory_known
    assert store.trajectory("r1").reward == 0.0  # API overrides the span event


def test_reward_needs_an_id(make_store) -> None:
    with pytest.raises(InvalidRequest):
        make_store().add_reward(RewardIn(value=1.0))


def test_lease_ack_and_never_again(make_store) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=0.0))
    assert [(g.id, g.state, g.size, g.complete, g.rewarded) for g in store.groups()] == [("g", "ready", 2, 2, 2)]
    batch = store.lease(BatchRequest(trainer="t1", lease_seconds=60))
    assert [g.id for g in batch.groups] == ["g"]
    assert sorted(t.id for t in batch.groups[0].trajectories) == ["a", "b"]
    assert batch.lease_expires_at == pytest.approx(1_000_060.0)
    assert store.lease(BatchRequest()).groups == []
    assert store.groups()[0].state == "leased"
    ack = store.ack(batch.id, policy_step=1)
    assert (ack.groups, ack.policy_step) == (["g"], 1)
    assert store.ack(batch.id, policy_step=1).groups == ["g"]  # idempotent
    assert store.groups()[0].state == "trained"
    assert store.lease(BatchRequest()).groups == []


def test_groups_by_state_read_only_groups_in_those_states(make_store) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=0.0))
    store.ack(store.lease(BatchRequest()).id, policy_step=1)  # g: trained
    store.add_spans(_trajectory(30, "c", group="h", reward=1.0) + _trajectory(40, "d", group="h", reward=0.0))
    store.add_spans(_trajectory(50, "e", group="i", reward=1.0))  # one of two: open
    assert [(g.id, g.state) for g in store.groups()] == [("g", "trained"), ("h", "ready"), ("i", "open")]
    assert [g.id for g in store.groups(states={"ready"})] == ["h"]
    assert [g.id for g in store.groups(states={"open", "trained"})] == ["g", "i"]
    assert store.groups(states={"leased"}) == []


def test_expired_lease_is_leased_again_and_old_ack_conflicts(make_store, clock) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=0.0))
    first = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 11
    assert store.groups()[0].state == "ready"
    second = store.lease(BatchRequest(lease_seconds=10))
    assert [g.id for g in second.groups] == ["g"]
    with pytest.raises(Conflict, match="leased again"):
        store.ack(first.id, policy_step=1)
    assert store.ack(second.id, policy_step=1).groups == ["g"]
    with pytest.raises(NotFound):
        store.ack("nope", policy_step=None)


def test_late_ack_is_accepted_when_not_leased_again(make_store, clock) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=0.0))
    batch = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 100
    assert store.ack(batch.id, policy_step=2).groups == ["g"]
    assert store.groups()[0].state == "trained"
    assert store.lease(BatchRequest()).groups == []


def test_batches_list_leases_newest_first(make_store, clock) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0, group="g1") + _trajectory(20, "b", reward=0.0, group="g1"))
    store.add_spans(_trajectory(30, "c", reward=1.0, group="g2") + _trajectory(40, "d", reward=0.0, group="g2"))
    assert store.batches() == []
    first = store.lease(BatchRequest(max_groups=1, trainer="t1", lease_seconds=10))
    store.ack(first.id, policy_step=3)
    clock.now += 1
    second = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 20
    listed = store.batches()
    assert [(b.id, b.state, b.groups) for b in listed] == [(second.id, "expired", ["g2"]), (first.id, "acked", ["g1"])]
    assert (listed[1].trainer, listed[1].policy_step, listed[1].acked_at) == ("t1", 3, 1_000_000.0)
    assert [b.id for b in store.batches(limit=1)] == [second.id]


def test_groups_show_the_size_they_wait_for(make_store) -> None:
    store = make_store(min_group_size=3)
    store.add_spans(_trajectory(10, "a", reward=1.0, group="sized", size=4)
                    + _trajectory(20, "b", reward=1.0, group="bare", size=None))
    assert sorted((g.id, g.size, g.expected) for g in store.groups()) == [("bare", 1, 3), ("sized", 1, 4)]


def test_zero_spread_is_skipped_unless_kept(make_store) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=1.0))
    assert store.lease(BatchRequest()).groups == []
    (group,) = store.groups()
    assert (group.state, group.reason) == ("skipped", "no reward spread")
    store.add_reward(RewardIn(rollout_id="b", value=0.5))  # a new reward reopens the group
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["g"]

    keep = make_store(keep_zero_spread=True)
    keep.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=1.0))
    assert [g.id for g in keep.lease(BatchRequest()).groups] == ["g"]


def test_group_waits_for_size_rewards_and_train_split(make_store) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0, size=3) + _trajectory(20, "b", reward=0.0, size=3))
    assert store.groups()[0].reason == "waiting for 1 more of 3 trajectories"
    store.add_spans(_trajectory(30, "c", reward=None, size=3))
    assert store.groups()[0].reason == "1 trajectories without reward 'reward'"
    assert store.lease(BatchRequest()).groups == []
    store.add_reward(RewardIn(rollout_id="c", value=0.5))
    assert [len(g.trajectories) for g in store.lease(BatchRequest()).groups] == [3]

    val = make_store()
    val.add_spans(_trajectory(10, "a", reward=1.0, split="val") + _trajectory(20, "b", reward=0.0, split="val"))
    assert val.lease(BatchRequest()).groups == []
    assert val.groups()[0].state == "open"


def test_min_and_max_groups(make_store) -> None:
    store = make_store()
    for i, group in enumerate(["g1", "g2", "g3"]):
        n = 100 * (i + 1)
        store.add_spans(_trajectory(n, f"{group}a", reward=1.0, group=group)
                        + _trajectory(n + 50, f"{group}b", reward=0.0, group=group))
    assert store.lease(BatchRequest(min_groups=4)).groups == []
    assert [g.id for g in store.lease(BatchRequest(max_groups=2)).groups] == ["g1", "g2"]
    assert [g.id for g in store.lease(BatchRequest(max_groups=2)).groups] == ["g3"]


def test_full_group_key_opens_a_new_instance(make_store) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=0.0)
                    + _trajectory(30, "c", reward=0.5))
    assert [(g.id, g.size) for g in store.groups()] == [("g", 2), ("g#2", 1)]
    assert store.trajectory("c").group_id == "g#2"
    assert [t.id for t in store.trajectories(group="g")] == ["a", "b", "c"]  # by key
    assert [t.id for t in store.trajectories(group="g#2")] == ["c"]  # by instance


def test_one_export_fills_instances_in_order(make_store) -> None:
    store = make_store()
    store.add_spans([span for n in range(5) for span in _trajectory(10 * (n + 1), f"t{n}", reward=float(n))])
    assert [(g.id, g.size) for g in store.groups()] == [("g", 2), ("g#2", 2), ("g#3", 1)]
    store.add_spans(_trajectory(60, "t5", reward=5.0))
    assert [(g.id, g.size) for g in store.groups()] == [("g", 2), ("g#2", 2), ("g#3", 2)]
    assert [t.id for t in store.trajectories(group="g#3")] == ["t4", "t5"]


def test_calls_outside_rollouts_group_by_task_and_complete_when_idle(make_store, clock) -> None:
    store = make_store(idle_seconds=60)
    store.add_spans([llm(1, rollout=None, trace=TRACE, task="t", start=1, prompt=[1], completion=[2])])
    store.add_spans([llm(2, rollout=None, trace=OTHER_TRACE, task="t", start=1, prompt=[1], completion=[3])])
    first = store.trajectory(TRACE)
    assert first is not None and (first.group_id, first.complete) == ("t", False)
    store.add_reward(RewardIn(trace_id=TRACE, value=1.0))
    store.add_reward(RewardIn(trace_id=OTHER_TRACE, value=0.0))
    assert store.lease(BatchRequest()).groups == []
    clock.now += 61
    assert all(t.complete for t in store.trajectories(task="t"))
    batch = store.lease(BatchRequest())
    assert [(g.id, sorted(t.reward for t in g.trajectories)) for g in batch.groups] == [("t", [0.0, 1.0])]


def test_spans_without_model_call_outside_rollouts_make_no_trajectory(make_store) -> None:
    store = make_store()
    span = llm(1, rollout=None, start=1, prompt=[1], completion=[2])
    span.attributes["art.span.kind"] = "node"
    store.add_spans([span])
    assert store.trajectories() == []


def test_filters(make_store) -> None:
    store = make_store()
    store.add_spans(_trajectory(10, "a", reward=1.0, task="x")
                    + _trajectory(20, "b", reward=1.0, group="h", split="val"))
    assert [t.id for t in store.trajectories(task="x")] == ["a"]
    assert [t.id for t in store.trajectories(split="val")] == ["b"]
    assert [t.id for t in store.trajectories(group="h", split="train")] == []
    assert store.trajectory("missing") is None


def test_invalid_reward_event_rejects_the_export(make_store) -> None:
    store = make_store()
    spans = _trajectory(10, "a", reward=1.0)
    spans[1].events[0].attributes["art.reward.value"] = float("nan")
    with pytest.raises(InvalidRequest, match="finite"):
        store.add_spans(spans)
    assert store.trajectories() == []


def test_concurrent_leases_from_two_stores_never_share_a_group(db_url, clock) -> None:
    """Two stores on one database (as two collector processes would be) lease disjoint groups."""
    from concurrent.futures import ThreadPoolExecutor

    from collector.config import CollectorSettings
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database cannot be shared by two stores")
    stores = [SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2)]
    for store in stores:
        store.setup()
    for i in range(12):
        n = 100 * (i + 1)
        stores[i % 2].add_spans(
            _trajectory(n, f"{i}a", reward=1.0, group=f"g{i}") + _trajectory(n + 50, f"{i}b", reward=0.0, group=f"g{i}")
        )
    with ThreadPoolExecutor(8) as pool:
        batches = list(pool.map(lambda k: stores[k % 2].lease(BatchRequest(max_groups=2)), range(8)))
    leased = [g.id for batch in batches for g in batch.groups]
    assert sorted(leased) == sorted(f"g{i}" for i in range(12))
    for store in stores:
        store.close()


def test_migration_from_version_1_keeps_rewards(db_url, clock) -> None:
    from sqlalchemy import inspect

    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.schema import MIGRATIONS, schema_version
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 1 left it, with a reward waiting for its spans
        schema_version.create(conn)
        MIGRATIONS[0](conn)
        conn.execute(schema_version.insert().values(version=1, applied_at=0.0))
        conn.execute(text("INSERT INTO rewards (rollout_id, name, value, source, created_at) "
                          "VALUES ('a', 'judge', 0.5, 'api', 1.0)"))
    assert "time_ns" not in {c["name"] for c in inspect(old).get_columns("rewards")}
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    with store.engine.connect() as conn:
        assert ([r[0] for r in conn.execute(text("SELECT version FROM schema_version ORDER BY version"))]
                == list(range(1, SCHEMA_VERSION + 1)))
    store.add_spans(_trajectory(10, "a", reward=1.0))
    assert store.trajectory("a").rewards == {"reward": 1.0, "judge": 0.5}
    store.close()


def test_migration_from_version_2_digests_stored_trajectories(db_url, clock) -> None:
    """Version 4 keeps a digest of each trajectory's spans; a late span of an older trajectory must find it."""
    import json

    from sqlalchemy import inspect

    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.schema import MIGRATIONS, groups, judge_runs, schema_version, spans, trajectories
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    child, root = _trajectory(10, "a", reward=None)
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 2 left it: rollout "a" in group "g", its LLM span still to come
        schema_version.create(conn)
        for version in (0, 1):
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version + 1, applied_at=0.0))
        judge_runs.create(conn)  # collectors before version 3 made the judges' tables on start
        conn.execute(spans.insert().values(
            span_id=root.span_id, trace_id=root.trace_id, trajectory_id="a", name=root.name, start_ns=root.start_ns,
            end_ns=root.end_ns, record=json.dumps(root.to_dict()), received_at=0.0,
        ))
        conn.execute(trajectories.insert().values(
            id="a", trace_id=root.trace_id, by_rollout=True, group_key="g", group_id="g", task=None, split="train",
            complete=True, created_at=0.0, updated_at=0.0,
        ))
        conn.execute(groups.insert().values(id="g", key="g", explicit=True, size_hint=2, state="open",
                                            created_at=0.0, updated_at=0.0))
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    assert ({"judge_runs", "judgements", "langfuse_pulled", "langfuse_pushed"}
            <= set(inspect(store.engine).get_table_names()))
    assert store.add_spans([child]) == 1
    migrated = store.trajectory("a")
    assert ((migrated.group_id, migrated.complete, [s.token_ids for s in migrated.sequences])
            == ("g", True, [[1, 2, 10]]))
    assert [(g.id, g.size, g.expected) for g in store.groups()] == [("g", 1, 2)]
    store.close()


def test_migration_from_version_4_keeps_groups_and_batches(db_url, clock) -> None:
    """Version 5 adds `groups.failed_attempts` and `batches.reason`; stored groups and leases keep working."""
    from sqlalchemy import inspect

    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.protocol import ReleaseRequest
    from collector.schema import MIGRATIONS, schema_version
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 4 left it, with an acked batch of a trained group
        schema_version.create(conn)
        for version in range(4):
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version + 1, applied_at=0.0))
        conn.execute(text(
            "INSERT INTO batches (id, trainer, state, created_at, lease_expires_at, acked_at, policy_step) "
            "VALUES ('old', 't', 'acked', 1.0, 2.0, 1.5, 7)"
        ))
        conn.execute(text(
            "INSERT INTO groups (id, key, task, explicit, size_hint, state, reason, batch_id, created_at, updated_at) "
            "VALUES ('t', 't', NULL, TRUE, 2, 'trained', NULL, 'old', 1.0, 1.0)"
        ))
        conn.execute(text("INSERT INTO batch_groups (batch_id, group_id) VALUES ('old', 't')"))
    assert "failed_attempts" not in {c["name"] for c in inspect(old).get_columns("groups")}
    assert "reason" not in {c["name"] for c in inspect(old).get_columns("batches")}
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT max(version) FROM schema_version")).scalar() == SCHEMA_VERSION == 5
        assert conn.execute(text("SELECT failed_attempts FROM groups WHERE id = 't'")).scalar() == 0
    [shown] = store.batches()
    assert (shown.id, shown.state, shown.policy_step, shown.groups, shown.reason) == ("old", "acked", 7, ["t"], None)
    store.add_spans(_trajectory(10, "a", reward=1.0) + _trajectory(20, "b", reward=0.0))  # groups made after it
    batch = store.lease(BatchRequest())
    assert store.release(batch.id, ReleaseRequest(reason="RuntimeError: x")).returned == ["g"]
    assert {g.id: g.failed_attempts for g in store.groups()} == {"g": 1}  # "t" has no trajectory: not listed
    store.close()


def test_weighted_training_reward(make_store) -> None:
    store = make_store(reward_weights={"correct": 1.0, "short": 0.5})
    store.add_spans(_trajectory(10, "a", reward=None) + _trajectory(20, "b", reward=None))
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
    store.add_spans(_trajectory(10, "a", reward=None) + _trajectory(20, "b", reward=None))
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


def test_stale_group_expires_with_its_reason(make_store, clock) -> None:
    store = make_store(group_timeout_seconds=100)
    store.add_spans(_trajectory(10, "a", reward=1.0, size=3) + _trajectory(20, "b", reward=0.0, size=3))
    store.add_spans(_trajectory(40, "x", reward=1.0, group="h") + _trajectory(50, "y", reward=0.0, group="h"))  # ready
    clock.now += 60
    store.add_spans([llm(12, rollout="a", trace=f"{10:032x}", start=20, prompt=[9], completion=[8])])  # activity
    clock.now += 60
    assert {g.id: g.state for g in store.groups()} == {"g": "open", "h": "ready"}
    clock.now += 41
    states = {g.id: (g.state, g.reason) for g in store.groups()}
    assert states["h"] == ("ready", None)  # a ready group waits for a trainer, it does not go stale
    assert states["g"] == ("expired",
                           "expired: no new span or reward for 100 s while waiting for 1 more of 3 trajectories")
    store.add_spans(_trajectory(30, "c", reward=0.5, size=3))
    assert store.trajectory("c").group_id == "g#2"  # the expired instance takes no one
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["h"]


def test_drift_is_reported_in_the_read_api(make_store) -> None:
    store = make_store()
    first = llm(11, start=10, prompt=[1, 2], completion=[3, 4], messages=[{"role": "user", "content": "q"}],
                output=[{"role": "assistant", "content": "a"}])
    drifted = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
               {"role": "user", "content": "more"}]
    second = llm(12, start=20, prompt=[1, 2, 3, 7, 5], completion=[6], messages=drifted,
                 output=[{"role": "assistant", "content": "b"}])
    store.add_spans([first, second, rollout(10, "r1", group="g")])
    traj = store.trajectory("r1")
    assert [s.token_ids for s in traj.sequences] == [[1, 2, 3, 4], [1, 2, 3, 7, 5, 6]]
    assert [(d.span_id, d.turn, d.position, d.expected, d.got) for d in traj.drift] == [(sid(12), 1, 3, [4], [7, 5])]


def _rich_spans() -> list:
    """Two rollouts of one group: merged and drifting turns, tools, reward events, a reward span."""
    from collector.otlp import SpanEvent, SpanRecord

    spans = []
    for k, rollout_id in enumerate(("a", "b")):
        trace, n = f"{k + 7:032x}", 100 * (k + 1)
        q = [{"role": "user", "content": f"q{k}"}]
        a = [{"role": "assistant", "content": "",
              "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
        t = [{"role": "tool", "tool_call_id": "c", "content": "5"}]
        spans += [
            llm(n + 1, rollout=rollout_id, trace=trace, start=10, prompt=[1, 2], completion=[3, k],
                messages=q, output=a),
            llm(n + 2, rollout=rollout_id, trace=trace, start=20, prompt=[1, 2, 3, k, 9], completion=[4],
                messages=q + a + t, output=[{"role": "assistant", "content": "5"}],
                tools=[{"type": "function", "function": {"name": "add"}}], model="agent@1"),
            llm(n + 3, rollout=rollout_id, trace=trace, start=30, prompt=[1, 2, 8], completion=[5],
                messages=q + a + t + [{"role": "assistant", "content": "5"}, {"role": "user", "content": "again"}]),
            rollout(n, rollout_id, trace=trace, group="g", size=2, task="sum",
                    rewards={"reward": float(k), "len": 1.0 + k}),
            SpanRecord(trace, sid(n + 4), sid(n), "score", 40, 90,
                       {"art.span.kind": "reward", "art.rollout.id": rollout_id},
                       [SpanEvent("art.reward", 60, {"art.reward.name": "len", "art.reward.value": 0.5 + k}),
                        SpanEvent("art.reward", 70, {"art.reward.name": "judge", "art.reward.value": 0.1})]),
        ]
    return spans


@pytest.mark.parametrize("seed", range(5))
def test_shuffled_and_duplicated_delivery_gives_the_same_trajectories(make_store, seed) -> None:
    import random

    spans = _rich_spans()
    reference = make_store()
    reference.add_spans(spans)
    expected = reference.trajectories()
    assert [(len(t.sequences), len(t.drift)) for t in expected] == [(2, 1), (2, 1)]
    assert expected[0].rewards == {"reward": 0.0, "len": 0.5, "judge": 0.1}  # the reward span is later than the event

    rng = random.Random(seed)
    delivery = spans * 3
    rng.shuffle(delivery)
    store = make_store()
    while delivery:
        cut = rng.randint(1, 4)
        store.add_spans(delivery[:cut])
        delivery = delivery[cut:]
    assert store.trajectories() == expected
    assert [(g.id, g.state, g.size) for g in store.groups()] == [("g", "ready", 2)]


def test_a_long_read_does_not_hold_up_ingest(make_store, db_url, monkeypatch: pytest.MonkeyPatch) -> None:
    """The web page and the Langfuse push assemble every trajectory; exports must not wait for them.

    SQLite in memory is left out: its one connection serves every thread, so reads and writes take turns there.
    """
    store = make_store()
    if str(store.engine.url) == "sqlite://":
        pytest.skip("SQLite in memory has one connection: reads and writes take turns")
    store.add_spans(_trajectory(10, "r1", reward=1.0))
    reading, finish = threading.Event(), threading.Event()
    real_assemble = assembly.assemble

    def slow_assemble(*args, **kwargs):
        reading.set()
        assert finish.wait(30), "the writer never let the reader finish"
        return real_assemble(*args, **kwargs)

    monkeypatch.setattr(assembly, "assemble", slow_assemble)
    reader = threading.Thread(target=store.trajectories)
    reader.start()
    assert reading.wait(30)
    writer = threading.Thread(target=store.add_spans, args=(_trajectory(20, "r2", reward=0.0),))
    writer.start()
    writer.join(10)
    stalled = writer.is_alive()
    finish.set()
    reader.join(30)
    writer.join(30)
    assert not stalled, "an export waited for a read to end"
    monkeypatch.setattr(assembly, "assemble", real_assemble)
    assert {t.id for t in store.trajectories()} == {"r1", "r2"}


def test_trajectories_page_newest_first_and_count(make_store, clock) -> None:
    store = make_store()
    for n, rollout_id in enumerate(["r1", "r2", "r3", "r4"]):
        clock.now += 1
        store.add_spans(_trajectory(10 * (n + 1), rollout_id, reward=float(n), group="g" if n < 2 else "h"))
    assert [t.id for t in store.trajectories()] == ["r1", "r2", "r3", "r4"]
    assert [t.id for t in store.trajectories(newest_first=True, limit=2, offset=1)] == ["r3", "r2"]
    assert [t.id for t in store.trajectories(group="h", newest_first=True, limit=5)] == ["r4", "r3"]
    assert [t.id for t in store.trajectories(offset=3)] == ["r4"]
    assert (store.count_trajectories(), store.count_trajectories(group="g"),
            store.count_trajectories(task="none")) == (4, 2, 0)


def _template_run(n: int, rollout_id: str, *, reward: float) -> list:
    """A prompt template invoked on its own: the plugin opens a rollout for the top-level run; no model call."""
    return [rollout(n, rollout_id, trace=f"{n:032x}", task="ChatPromptTemplate", rewards={"reward": reward})]


def test_a_trajectory_without_a_model_call_joins_no_group_until_one_arrives(make_store) -> None:
    store = make_store()
    store.add_spans(_template_run(10, "tmpl-a", reward=1.0) + _template_run(20, "tmpl-b", reward=0.0))
    shown = [(t.id, t.group_id, t.complete, t.reward) for t in store.trajectories()]
    assert shown == [("tmpl-a", "", True, 1.0), ("tmpl-b", "", True, 0.0)]  # still stored and listed
    assert store.count_trajectories() == 2
    assert store.groups() == []  # so never ready, leased or judged, although its rewards differ
    assert store.lease(BatchRequest()).groups == []
    # late turn
    store.add_spans([llm(21, rollout="tmpl-b", trace=f"{20:032x}", start=10, prompt=[1, 2], completion=[3])])
    assert [(t.id, t.group_id) for t in store.trajectories()] == [("tmpl-a", ""), ("tmpl-b", "ChatPromptTemplate")]
    assert [(g.id, g.size) for g in store.groups()] == [("ChatPromptTemplate", 1)]


def test_an_attempt_without_a_model_call_stays_in_the_group_the_app_named(make_store) -> None:
    store = make_store()
    # raised before the model
    failed = rollout(10, "try-0", trace=f"{10:032x}", group="q1", size=2, rewards={"reward": 0.0})
    answered = [rollout(20, "try-1", trace=f"{20:032x}", group="q1", size=2, rewards={"reward": 1.0}),
                llm(21, rollout="try-1", trace=f"{20:032x}", start=10, prompt=[1, 2], completion=[3])]
    store.add_spans([failed, *answered])
    assert [(t.id, t.group_id) for t in store.trajectories()] == [("try-0", "q1"), ("try-1", "q1")]
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["q1"]
