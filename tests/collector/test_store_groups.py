"""Groups in the store: placement in instances (`collector/placement.py`), readiness (`collector/groups.py`) and
upkeep of the pool (`collector/pool.py`: idle trajectories, stale groups), read through `Store.groups`."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from collector.protocol import BatchRequest, ReleaseRequest, RewardIn
from tests.collector.span_builders import TRACE, llm, rollout, trajectory

OTHER_TRACE = "1" * 32


def test_groups_by_state_read_only_groups_in_those_states(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    store.ack(store.lease(BatchRequest()).id, policy_step=1)  # g: trained
    store.add_spans(trajectory(30, "c", group="h", reward=1.0) + trajectory(40, "d", group="h", reward=0.0))
    store.add_spans(trajectory(50, "e", group="i", reward=1.0))  # one of two: open
    assert [(g.id, g.state) for g in store.groups()] == [("g", "trained"), ("h", "ready"), ("i", "open")]
    assert [g.id for g in store.groups(states={"ready"})] == ["h"]
    assert [g.id for g in store.groups(states={"open", "trained"})] == ["g", "i"]
    assert store.groups(states={"leased"}) == []


def test_groups_show_the_size_they_wait_for(make_store) -> None:
    store = make_store(min_group_size=3)
    store.add_spans(trajectory(10, "a", reward=1.0, group="sized", size=4)
                    + trajectory(20, "b", reward=1.0, group="bare", size=None))
    assert sorted((g.id, g.size, g.expected) for g in store.groups()) == [("bare", 1, 3), ("sized", 1, 4)]


def test_zero_spread_is_skipped_unless_kept(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=1.0))
    assert store.lease(BatchRequest()).groups == []
    (group,) = store.groups()
    assert (group.state, group.reason) == ("skipped", "no reward spread")
    store.add_reward(RewardIn(rollout_id="b", value=0.5))  # a new reward reopens the group
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["g"]

    keep = make_store(keep_zero_spread=True)
    keep.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=1.0))
    assert [g.id for g in keep.lease(BatchRequest()).groups] == ["g"]


def test_a_weighted_training_reward_that_overflows_is_never_leased(make_store) -> None:
    store = make_store(reward_weights={"a": 10.0, "b": -10.0})
    store.add_spans(trajectory(10, "x", reward=None) + trajectory(20, "y", reward=None))
    for rollout_id, value in (("x", 1e308), ("y", 0.0)):  # x: 10 * 1e308 - 10 * 1e308 is inf - inf, NaN
        for name in ("a", "b"):
            store.add_reward(RewardIn(rollout_id=rollout_id, name=name, value=value))
    assert store.lease(BatchRequest()).groups == []
    (group,) = store.groups()
    assert (group.state, group.reason) == ("skipped", "1 trajectories with reward 10*'a' + -10*'b' not finite")
    for name, value in (("a", 1.0), ("b", 0.0)):  # new rewards reopen the group
        store.add_reward(RewardIn(rollout_id="x", name=name, value=value))
    assert [[t.reward for t in g.trajectories] for g in store.lease(BatchRequest()).groups] == [[10.0, 0.0]]


def test_group_waits_for_size_rewards_and_train_split(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0, size=3) + trajectory(20, "b", reward=0.0, size=3))
    assert store.groups()[0].reason == "waiting for 1 more of 3 trajectories"
    store.add_spans(trajectory(30, "c", reward=None, size=3))
    assert store.groups()[0].reason == "1 trajectories without reward 'reward'"
    assert store.lease(BatchRequest()).groups == []
    store.add_reward(RewardIn(rollout_id="c", value=0.5))
    assert [len(g.trajectories) for g in store.lease(BatchRequest()).groups] == [3]

    val = make_store()
    val.add_spans(trajectory(10, "a", reward=1.0, split="val") + trajectory(20, "b", reward=0.0, split="val"))
    assert val.lease(BatchRequest()).groups == []
    assert val.groups()[0].state == "open"


def test_full_group_key_opens_a_new_instance(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0)
                    + trajectory(30, "c", reward=0.5))
    assert [(g.id, g.size) for g in store.groups()] == [("g", 2), ("g#2", 1)]
    assert store.trajectory("c").group_id == "g#2"
    assert [t.id for t in store.trajectories(group="g")] == ["a", "b", "c"]  # by key
    assert [t.id for t in store.trajectories(group="g#2")] == ["c"]  # by instance


def test_one_export_fills_instances_in_order(make_store) -> None:
    store = make_store()
    store.add_spans([span for n in range(5) for span in trajectory(10 * (n + 1), f"t{n}", reward=float(n))])
    assert [(g.id, g.size) for g in store.groups()] == [("g", 2), ("g#2", 2), ("g#3", 1)]
    store.add_spans(trajectory(60, "t5", reward=5.0))
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


def test_stale_group_expires_with_its_reason(make_store, clock) -> None:
    store = make_store(group_timeout_seconds=100)
    store.add_spans(trajectory(10, "a", reward=1.0, size=3) + trajectory(20, "b", reward=0.0, size=3))
    store.add_spans(trajectory(40, "x", reward=1.0, group="h") + trajectory(50, "y", reward=0.0, group="h"))  # ready
    clock.now += 60
    store.add_spans([llm(12, rollout="a", trace=f"{10:032x}", start=20, prompt=[9], completion=[8])])  # activity
    clock.now += 60
    assert {g.id: g.state for g in store.groups()} == {"g": "open", "h": "ready"}
    clock.now += 41
    states = {g.id: (g.state, g.reason) for g in store.groups()}
    assert states["h"] == ("ready", None)  # a ready group waits for a trainer, it does not go stale
    assert states["g"] == ("expired",
                           "expired: no new span or reward for 100 s while waiting for 1 more of 3 trajectories")
    store.add_spans(trajectory(30, "c", reward=0.5, size=3))
    assert store.trajectory("c").group_id == "g#2"  # the expired instance takes no one
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["h"]


def test_a_span_after_the_timeout_finds_its_group_as_a_read_would_have(make_store, clock) -> None:
    """Upkeep runs before reads: an export to groups overdue for it, with no read since, does their upkeep first. g,
    waiting for its third member, expires before a's late turn can count as activity, so c opens g#2 instead of
    completing g; t's calls outside rollouts, idle, complete (the late one's too), and t, ready then, waits for a
    trainer."""
    store = make_store(idle_seconds=60, group_timeout_seconds=100)
    store.add_spans(trajectory(10, "a", reward=1.0, size=3) + trajectory(20, "b", reward=0.0, size=3))
    store.add_spans([llm(n, rollout=None, trace=f"{n:032x}", task="t", start=1, prompt=[1], completion=[n])
                     for n in (30, 40)])
    for n, value in ((30, 1.0), (40, 0.0)):
        store.add_reward(RewardIn(trace_id=f"{n:032x}", value=value))
    clock.now += 101  # no read since: nothing expired or completed yet
    store.add_spans([llm(12, rollout="a", trace=f"{10:032x}", start=20, prompt=[9], completion=[8]),
                     llm(31, rollout=None, trace=f"{30:032x}", task="t", start=5, prompt=[1, 30, 2], completion=[3])])
    assert {g.id: (g.state, g.reason) for g in store.groups()} == {
        "g": ("expired", "expired: no new span or reward for 100 s while waiting for 1 more of 3 trajectories"),
        "t": ("ready", None),
    }
    assert store.trajectory(f"{30:032x}").complete
    store.add_spans(trajectory(50, "c", reward=0.5, size=3))
    assert store.trajectory("c").group_id == "g#2"
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["t"]


def test_a_burst_of_stale_groups_expires_in_one_update_per_reason(make_store, clock) -> None:
    """Idle calls outside rollouts in groups gone stale together: upkeep completes them and expires the groups, one
    `UPDATE groups` per distinct reason (a burst of thousands of groups took a statement each)."""
    store = make_store(idle_seconds=60, group_timeout_seconds=100)
    calls = [("t0", 1), ("t1", 1), ("t2", 1), ("t3", 2), ("t4", 2)]  # task, calls: waiting, or all unrewarded
    store.add_spans([llm(10 * i + k + 1, rollout=None, trace=f"{10 * i + k + 1:032x}", task=task, start=1,
                         prompt=[1], completion=[2]) for i, (task, n) in enumerate(calls) for k in range(n)])
    updates: list[str] = []

    @event.listens_for(store.engine, "before_cursor_execute")
    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.startswith("UPDATE groups"):
            updates.append(statement)

    clock.now += 101
    states = {g.id: (g.state, g.reason) for g in store.groups()}
    waiting = ("expired", "expired: no new span or reward for 100 s while waiting for 1 more of 2 trajectories")
    unrewarded = ("expired", "expired: no new span or reward for 100 s while 2 trajectories without reward 'reward'")
    assert states == {"t0": waiting, "t1": waiting, "t2": waiting, "t3": unrewarded, "t4": unrewarded}
    assert all(t.complete for t in store.trajectories())
    assert len(updates) == 2


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


def test_evaluation_runs_of_a_task_form_groups_of_their_own(make_store) -> None:
    def run(n: int, rollout_id: str, reward: float, split: str) -> list:
        trace = f"{n:032x}"
        return [llm(n + 1, rollout=rollout_id, trace=trace, start=10, prompt=[1, 2], completion=[n]),
                rollout(n, rollout_id, trace=trace, task="arith", split=split, rewards={"reward": reward})]

    store = make_store()
    for spans in (run(10, "t1", 1.0, "train"), run(20, "v1", 0.0, "val"), run(30, "t2", 0.0, "train"),
                  run(40, "v2", 1.0, "val")):
        store.add_spans(spans)
    assert [(t.id, t.group_id) for t in store.trajectories()] == [
        ("t1", "arith"), ("t2", "arith"), ("v1", "arith#2"), ("v2", "arith#2")]
    assert [(g.id, [t.id for t in g.trajectories]) for g in store.lease(BatchRequest()).groups] == [
        ("arith", ["t1", "t2"])]
    # a group the app names holds what the app put in it
    named = make_store()
    named.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0, split="val"))
    assert [(g.id, g.size, g.reason) for g in named.groups()] == [("g", 2, "split val: only train groups are leased")]


def test_a_span_from_another_replica_before_the_upkeep_stores_an_expiry_keeps_the_group_open(
    db_url, clock, monkeypatch
) -> None:
    """The member a stale group waited for is committed by another replica after the upkeep decided the group
    expired but before it stored that, in a transaction that took its time before the deadline (one after it expires
    the group itself, `pool.maintain_groups`): the group got a span, so it does not expire, and the lease takes it."""
    from collector import pool
    from collector.config import CollectorSettings
    from collector.store import SqlStore

    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no other store commits inside the upkeep")
    settings = CollectorSettings(db=url, group_timeout_seconds=60)
    store, replica = SqlStore(settings, clock=clock), SqlStore(settings, clock=lambda: clock.now - 2)
    store.setup()
    store.add_spans(trajectory(10, "a", reward=1.0))  # waits for its second member
    clock.now += 61
    decided = pool.decisions

    def decisions_then_a_span_elsewhere(conn, settings, open_groups):
        out = decided(conn, settings, open_groups)
        if open_groups:
            monkeypatch.setattr(pool, "decisions", decided)
            replica.add_spans(trajectory(20, "b", reward=0.0))
        return out

    monkeypatch.setattr(pool, "decisions", decisions_then_a_span_elsewhere)
    assert [[t.id for t in g.trajectories] for g in store.lease(BatchRequest()).groups] == [["a", "b"]]
    for each in (store, replica):
        each.close()


def test_upkeep_decides_again_only_the_stale_groups_changed_since_it_kept_them(make_store, clock, monkeypatch) -> None:
    """Upkeep before every read decided every stale group again, each ready one waiting for a trainer too (2,000 of
    them: 0.2 to 0.5 s a read on SQLite, 0.6 to 0.8 s on PostgreSQL here). One it kept is decided again once changed:
    a reward marks it active; a member taken away (a late span gives its trace another task) leaves it fewer members,
    and the group, no longer ready, expires as before."""
    from collector import pool

    store = make_store(idle_seconds=60, group_timeout_seconds=100)
    store.add_spans([llm(n, rollout=None, trace=f"{n:032x}", task="t", start=5, prompt=[1], completion=[n])
                     for n in (10, 20)])
    for n, value in ((10, 1.0), (20, 0.0)):
        store.add_reward(RewardIn(trace_id=f"{n:032x}", value=value))
    store.add_spans(trajectory(40, "x", reward=1.0, group="h") + trajectory(50, "y", reward=0.0, group="h"))
    decide = pool.decisions
    decided: list[str] = []

    def recorded(conn, settings, open_groups):
        decided.extend(group["id"] for group in open_groups)
        return decide(conn, settings, open_groups)

    monkeypatch.setattr(pool, "decisions", recorded)
    clock.now += 101
    store.count_trajectories()  # a read that decides no group itself: only its upkeep does
    assert sorted(decided) == ["h", "t"]  # both stale and ready: kept
    decided.clear()
    store.count_trajectories()
    assert decided == []
    store.add_reward(RewardIn(rollout_id="x", name="judge", value=0.5))
    clock.now += 101
    decided.clear()
    store.count_trajectories()
    assert decided == ["h"]
    store.add_spans([llm(11, rollout=None, trace=f"{10:032x}", task="u", start=1, prompt=[1], completion=[9])])
    decided.clear()
    store.count_trajectories()
    assert decided == ["t"]
    monkeypatch.setattr(pool, "decisions", decide)
    assert {g.id: (g.state, g.reason) for g in store.groups()} == {
        "h": ("ready", None),
        "t": ("expired", "expired: no new span or reward for 100 s while waiting for 1 more of 2 trajectories"),
        "u": ("open", "waiting for 1 more of 2 trajectories"),
    }


def test_a_stale_group_kept_under_other_settings_is_decided_again(make_store, clock) -> None:
    store = make_store(group_timeout_seconds=100)
    store.add_spans(trajectory(10, "a", reward=1.0, size=None) + trajectory(20, "b", reward=0.0, size=None))
    clock.now += 101
    assert [(g.id, g.state) for g in store.groups()] == [("g", "ready")]
    store.settings = store.settings.model_copy(update={"min_group_size": 3})  # restarted with it
    assert [(g.id, g.state, g.reason) for g in store.groups()] == [
        ("g", "expired", "expired: no new span or reward for 100 s while waiting for 1 more of 3 trajectories")
    ]


def _listed(store) -> dict[str, tuple[str, str | None, int, int, int]]:
    """Each group's state, reason, size, complete and rewarded members, as `Store.groups` lists them."""
    return {g.id: (g.state, g.reason, g.size, g.complete, g.rewarded) for g in store.groups()}


def _calls(n: int, *, task: str) -> list:
    """Calls outside rollouts in a trace of their own each (traces n, n + 1, ...), grouped by `task`."""
    return [llm(n + k, rollout=None, trace=f"{n + k:032x}", task=task, start=5, prompt=[1], completion=[n + k])
            for k in range(2)]


def test_a_listing_decides_again_only_the_open_groups_changed_since_the_last(make_store, clock, monkeypatch) -> None:
    """Every listing read every open group's members and rewards, and decided each (a trainer's poll of 2,000 ready
    groups: 0.5 s on SQLite, 1 s on PostgreSQL here). The next one reads those of the groups changed since only."""
    from collector import pool

    store = make_store()
    for n, group in enumerate(("g", "h")):
        store.add_spans(trajectory(100 * n + 10, f"{group}a", reward=1.0, group=group)
                        + trajectory(100 * n + 20, f"{group}b", reward=0.0, group=group))
    read = pool.group_members
    members_read: list[list[str]] = []

    def recorded(conn, group_ids):
        members_read.append(sorted(group_ids))
        return read(conn, group_ids)

    monkeypatch.setattr(pool, "group_members", recorded)
    clock.now += 1
    assert [g.id for g in store.groups(states={"ready"})] == ["g", "h"]
    members_read.clear()
    assert [g.id for g in store.groups(states={"ready"})] == ["g", "h"]
    assert not any(members_read)
    store.add_reward(RewardIn(rollout_id="hb", value=1.0))
    members_read.clear()
    assert [g.id for g in store.groups(states={"ready"})] == ["g"]
    assert [ids for ids in members_read if ids] == [["h"]]


def test_a_reward_after_a_listing_shows_in_the_next(make_store, clock) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=None))
    clock.now += 1
    assert _listed(store) == {"g": ("open", "1 trajectories without reward 'reward'", 2, 2, 1)}
    clock.now += 1
    store.add_reward(RewardIn(rollout_id="b", value=0.0))
    assert _listed(store) == {"g": ("ready", None, 2, 2, 2)}


def test_a_reward_at_the_time_of_the_listing_shows_in_the_next(make_store) -> None:
    """The store's clock (here a test's) has not moved between the listing and the reward: the group's `updated_at`
    is the same after the reward, and only its being as new as the listing keeps the listing's decision from being
    taken for the next one's."""
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    assert _listed(store) == {"g": ("ready", None, 2, 2, 2)}
    store.add_reward(RewardIn(rollout_id="b", value=1.0))
    assert _listed(store) == {"g": ("skipped", "no reward spread", 2, 2, 2)}


def test_members_completed_by_upkeep_after_a_listing_show_in_the_next(make_store, clock) -> None:
    """Upkeep completes idle calls outside rollouts without marking their group active: the next listing shows them
    complete, and the group ready."""
    store = make_store(idle_seconds=60)
    store.add_spans(_calls(10, task="t"))
    for n, value in ((10, 1.0), (11, 0.0)):
        store.add_reward(RewardIn(trace_id=f"{n:032x}", value=value))
    clock.now += 1
    assert _listed(store) == {"t": ("open", "2 trajectories not complete", 2, 0, 2)}
    clock.now += 60
    assert _listed(store) == {"t": ("ready", None, 2, 2, 2)}


def test_a_member_taken_away_after_a_listing_shows_in_the_next(make_store, clock) -> None:
    """A late span gives a call's trace another task: the call leaves its group for another, which changes neither
    the group's `updated_at` nor its number of complete members (none); the next listing shows it one member short."""
    store = make_store()
    store.add_spans(_calls(10, task="t"))
    clock.now += 1
    assert _listed(store) == {"t": ("open", "2 trajectories not complete", 2, 0, 0)}
    clock.now += 1
    store.add_spans([llm(20, rollout=None, trace=f"{10:032x}", task="u", start=1, prompt=[1], completion=[9])])
    assert _listed(store) == {
        "t": ("open", "waiting for 1 more of 2 trajectories", 1, 0, 0),
        "u": ("open", "waiting for 1 more of 2 trajectories", 1, 0, 0),
    }


def test_a_group_expired_after_a_listing_shows_expired_in_the_next(make_store, clock) -> None:
    store = make_store(group_timeout_seconds=100)
    store.add_spans(trajectory(10, "a", reward=1.0))
    clock.now += 1
    assert _listed(store) == {"g": ("open", "waiting for 1 more of 2 trajectories", 1, 1, 1)}
    clock.now += 100
    assert _listed(store) == {
        "g": ("expired", "expired: no new span or reward for 100 s while waiting for 1 more of 2 trajectories", 1, 1, 1)
    }


def test_a_reward_while_leased_shows_once_the_group_is_given_back(make_store, clock) -> None:
    """A reward for a leased group's member leaves the group's row as it is (`pool.rewarded`); given back, the group
    is listed as its rewards are now, not as the listing before its lease saw it."""
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    clock.now += 1
    assert _listed(store) == {"g": ("ready", None, 2, 2, 2)}
    clock.now += 1
    batch = store.lease(BatchRequest())
    store.add_reward(RewardIn(rollout_id="b", value=1.0))
    clock.now += 1
    store.release(batch.id, ReleaseRequest(reason="engine down", failed=False))
    assert _listed(store) == {"g": ("skipped", "no reward spread", 2, 2, 2)}


def test_settings_changed_after_a_listing_decide_the_next(make_store, clock) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=1.0))
    clock.now += 1
    assert _listed(store) == {"g": ("skipped", "no reward spread", 2, 2, 2)}
    store.settings = store.settings.model_copy(update={"keep_zero_spread": True})  # restarted with it
    assert _listed(store) == {"g": ("ready", None, 2, 2, 2)}


@pytest.mark.parametrize("end", ["ack", "release"])
def test_a_lease_and_its_end_decide_again_no_stale_group_kept_unchanged(make_store, clock, monkeypatch, end) -> None:
    """A lease, an ack and a release run upkeep first: each decided every stale ready group again (2,000 of them:
    0.2 s an ack or a release on SQLite, 0.4 to 0.6 s on PostgreSQL here), as reads' upkeep did before it kept them.
    Now they keep those the last upkeep kept, unchanged, and the lease decides each open group once (its own pass)."""
    store = make_store(group_timeout_seconds=100)
    for n, group in enumerate(("g1", "g2", "g3")):
        store.add_spans(trajectory(100 * n + 10, f"{group}a", reward=1.0, group=group)
                        + trajectory(100 * n + 20, f"{group}b", reward=0.0, group=group))
    clock.now += 101
    store.count_trajectories()  # its upkeep keeps the three, stale and ready
    decided = _decisions_recorded(monkeypatch)
    batch = store.lease(BatchRequest(max_groups=1))
    assert decided == ["g1", "g2", "g3", "g1"]  # the lease's own pass (no listing before it), then under the lock
    decided.clear()
    if end == "ack":
        store.ack(batch.id, policy_step=1)
    else:
        store.release(batch.id, ReleaseRequest(reason="engine down", failed=False))
    assert decided == []  # g1 is given back after the upkeep, dated now: not stale
    decided.clear()
    store.count_trajectories()
    assert decided == []
    monkeypatch.undo()
    shown = {"g1": "trained" if end == "ack" else "ready", "g2": "ready", "g3": "ready"}
    assert {g.id: g.state for g in store.groups()} == shown


def _decisions_recorded(monkeypatch) -> list[str]:
    """The ids of the groups decided from now on (`pool.decision`, which every decision of an open group runs), in
    order, one entry per decision."""
    from collector import pool

    decide = pool.decision
    decided: list[str] = []

    def recorded(settings, group, rows, named):
        decided.append(group["id"])
        return decide(settings, group, rows, named)

    monkeypatch.setattr(pool, "decision", recorded)
    return decided


def test_a_lease_decides_first_only_the_open_groups_changed_since_the_last_listing_or_lease(
    make_store, clock, monkeypatch
) -> None:
    """A lease's first pass decided every open group, unlocked (2,000 ready groups: 0.2 s a lease on SQLite, 0.6 s
    on PostgreSQL here), the listing before it having decided them already. Now it decides only those changed since
    the last listing or lease decided them all; those it takes or skips it decides again under their locks, as
    before."""
    store = make_store()
    for n, group in enumerate(("g1", "g2", "g3", "g4", "g5")):
        store.add_spans(trajectory(100 * n + 10, f"{group}a", reward=1.0, group=group)
                        + trajectory(100 * n + 20, f"{group}b", reward=0.0, group=group))
    clock.now += 1
    assert [g.id for g in store.groups(states={"ready"})] == ["g1", "g2", "g3", "g4", "g5"]
    store.add_reward(RewardIn(rollout_id="g2b", value=1.0))  # no spread left: to be skipped
    store.add_reward(RewardIn(rollout_id="g5b", value=0.5))  # changed, still ready
    clock.now += 1
    decided = _decisions_recorded(monkeypatch)
    batch = store.lease(BatchRequest(max_groups=2))
    assert [g.id for g in batch.groups] == ["g1", "g3"]
    # the first pass (the two changed), then under the locks: g2 skipped, g1 and g3 taken
    assert sorted(decided[:2]) == ["g2", "g5"]
    assert decided[2:] == ["g2", "g1", "g3"]
    clock.now += 1
    decided.clear()
    assert [g.id for g in store.lease(BatchRequest(max_groups=1)).groups] == ["g4"]
    assert decided == ["g4"]  # g5 as the last lease decided it, unchanged: only the one taken, under its lock
    decided.clear()
    assert {g.id: (g.state, g.reason) for g in store.groups()} == {
        "g1": ("leased", None), "g2": ("skipped", "no reward spread"), "g3": ("leased", None), "g4": ("leased", None),
        "g5": ("ready", None),
    }
    assert decided == []


def test_a_reward_at_the_time_of_a_lease_shows_in_the_next_listing(make_store, clock) -> None:
    """The store's clock (here a test's) has not moved between a lease that decided a group changed at its time and
    a reward after it: the group's `updated_at` is the same, and only its being as new as the lease keeps the lease's
    decision from being taken for the listing's."""
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    clock.now += 1
    store.add_reward(RewardIn(rollout_id="b", value=0.5))
    assert store.lease(BatchRequest(min_groups=2)).groups == []  # g decided ready, and not taken
    store.add_reward(RewardIn(rollout_id="b", value=1.0))
    assert _listed(store) == {"g": ("skipped", "no reward spread", 2, 2, 2)}
