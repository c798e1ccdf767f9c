"""Leases: taking batches (`SqlStore.lease`, also from several stores on one database) and how a lease ends
(`collector/leases.py`, `pool.give_back`): acks, releases, failed attempts, expiry, acks after it, reopen."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import event

from collector import engine
from collector.config import CollectorSettings
from collector.errors import Conflict, NotFound
from collector.protocol import BatchRequest, ReleaseRequest, ReleaseResponse, ReopenResponse, RewardIn
from collector.store import SqlStore
from tests.collector.pausing import WAIT, lock_waited_for, pause_after
from tests.collector.span_builders import llm, rollout, trajectory

FAILED = ReleaseRequest(reason="NonFiniteStepError: loss is nan")


def _ready_group(store, group: str = "g", first: int = 10) -> None:
    """Two rewarded trajectories with different rewards: a group ready to lease."""
    store.add_spans(trajectory(first, f"{group}-a", reward=1.0, group=group)
                    + trajectory(first + 10, f"{group}-b", reward=0.0, group=group))


def _state(store, group: str = "g") -> tuple[str, str | None, int]:
    (shown,) = [g for g in store.groups() if g.id == group]
    return shown.state, shown.reason, shown.failed_attempts


def test_lease_ack_and_never_again(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
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


def test_expired_lease_is_leased_again_and_old_ack_conflicts(make_store, clock) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
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
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    batch = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 100
    assert store.ack(batch.id, policy_step=2).groups == ["g"]
    assert store.groups()[0].state == "trained"
    assert store.lease(BatchRequest()).groups == []


def test_late_ack_conflicts_when_the_group_changed_in_the_pool_since(make_store, clock) -> None:
    """Back in the pool after its lease expired, a group that gained a trajectory or a reward is not marked trained by
    the late ack of a batch that never held them: the next lease gets it as it is now."""
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0, size=None) + trajectory(20, "b", reward=0.0, size=None))
    _ready_group(store, "h", first=100)
    batches = [store.lease(BatchRequest(lease_seconds=10, max_groups=1)) for _ in range(2)]
    clock.now += 11
    assert [g.state for g in store.groups()] == ["ready", "ready"]
    store.add_spans(trajectory(30, "c", reward=0.5, size=None))  # joins g, open again
    store.add_reward(RewardIn(rollout_id="h-b", value=0.25))  # changes h
    for batch, group in zip(batches, ["g", "h"], strict=True):
        with pytest.raises(Conflict, match=f"groups {group} changed in the pool") as raised:
            store.ack(batch.id, policy_step=1)
        assert raised.value.code == "lease_expired"
    again = store.lease(BatchRequest())
    assert [[t.id for t in g.trajectories] for g in again.groups] == [["a", "b", "c"], ["h-a", "h-b"]]
    assert store.ack(again.id, policy_step=2).groups == ["g", "h"]


def test_late_ack_conflicts_when_a_member_left_the_group_for_another_since(make_store, clock) -> None:
    """Back in the pool after its lease expired, a group lost a member to another group (a rollout span that comes
    first in its trajectory names another `art.group`), its other members unchanged: the late ack marked it trained
    without the member the trainer trained on."""
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0, size=3) + trajectory(20, "b", reward=0.0, size=3)
                    + trajectory(30, "c", reward=0.5, size=3))
    batch = store.lease(BatchRequest(lease_seconds=10))
    assert [[t.id for t in g.trajectories] for g in batch.groups] == [["a", "b", "c"]]
    clock.now += 11
    assert _state(store)[0] == "ready"  # back in the pool: its members can be placed again
    store.add_spans([rollout(5, "c", trace=f"{30:032x}", group="h", size=3)])
    assert {g.id: (g.state, g.size) for g in store.groups()} == {"g": ("open", 2), "h": ("open", 1)}
    with pytest.raises(Conflict, match="groups g changed in the pool") as raised:
        store.ack(batch.id, policy_step=1)
    assert raised.value.code == "lease_expired"
    assert {g.id: g.state for g in store.groups()} == {"g": "open", "h": "open"}


def test_late_ack_conflicts_when_a_reward_it_held_was_withdrawn_in_the_pool_since(make_store, clock) -> None:
    """A Langfuse score deleted after the lease expired took its reward back without a row dated after the lease: the
    late ack found the rewards "as they were" and marked the group trained on a reward that no longer exists."""
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    store.add_reward(RewardIn(trace_id=f"{10:032x}", name="judge", value=0.5), score_id="s1")
    batch = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 11
    assert [g.state for g in store.groups()] == ["ready"]
    assert store.withdraw_score("s1", None)  # back in the pool: the withdrawal is taken
    with pytest.raises(Conflict, match="groups g changed in the pool") as raised:
        store.ack(batch.id, policy_step=1)
    assert raised.value.code == "lease_expired"
    assert [t.rewards for g in store.lease(BatchRequest()).groups for t in g.trajectories] == [{"reward": 1.0},
                                                                                             {"reward": 0.0}]


def test_late_ack_conflicts_when_a_group_its_expiry_skipped_changed_since(make_store, clock) -> None:
    """The expiry that skipped a group at the failed-attempts limit left it out of the pool; a reward it gained then
    was never seen by the trainer, yet the late ack marked it trained."""
    store = make_store(max_failed_attempts=1)
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    batch = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 11
    assert _state(store)[0] == "skipped"
    store.add_reward(RewardIn(rollout_id="b", value=0.5))
    with pytest.raises(Conflict, match="groups g changed in the pool") as raised:
        store.ack(batch.id, policy_step=1)
    assert raised.value.code == "lease_expired"
    assert _state(store) == ("skipped", "training failed 1 times; last: lease expired", 1)


def test_late_ack_of_a_group_skipped_for_its_rewards_since_says_it_changed_not_that_it_was_leased_again(
    make_store, clock
) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    batch = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 11
    store.add_reward(RewardIn(rollout_id="b", value=1.0))  # no spread: the next lease stores it skipped
    assert store.lease(BatchRequest()).groups == []
    assert _state(store)[:2] == ("skipped", "no reward spread")
    with pytest.raises(Conflict, match="groups g changed in the pool") as raised:
        store.ack(batch.id, policy_step=1)
    assert raised.value.code == "lease_expired"


def test_batches_list_leases_newest_first(make_store, clock) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0, group="g1") + trajectory(20, "b", reward=0.0, group="g1"))
    store.add_spans(trajectory(30, "c", reward=1.0, group="g2") + trajectory(40, "d", reward=0.0, group="g2"))
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


def test_acks_record_each_batch_s_policy_step_as_sent_lower_ones_and_none_included(make_store) -> None:
    """Steps need not grow from batch to batch: a trainer resumed from an older checkpoint, a new run (a fresh
    `--output-dir` counts from 1) and a second trainer on the same collector each count their own."""
    store = make_store()
    for i, group in enumerate(["g1", "g2", "g3"]):
        _ready_group(store, group, first=100 * (i + 1))
    steps = [10, 5, None]
    leased = [store.lease(BatchRequest(max_groups=1)) for _ in steps]
    assert [store.ack(batch.id, policy_step=step).policy_step for batch, step in zip(leased, steps)] == steps
    assert {b.id: b.policy_step for b in store.batches()} == {b.id: step for b, step in zip(leased, steps)}


def test_an_ack_again_with_another_step_answers_the_first_and_is_logged(make_store, caplog) -> None:
    """The first ack of a batch stands: an ack again (the same trainer's retry of an ack whose answer was lost)
    answers it; one that claims another step is logged, since another trainer process may have trained the batch."""
    store = make_store()
    _ready_group(store)
    batch = store.lease(BatchRequest())
    store.ack(batch.id, policy_step=10)
    with caplog.at_level("WARNING", logger="collector.leases"):
        assert store.ack(batch.id, policy_step=10).policy_step == 10
        assert caplog.records == []
        assert store.ack(batch.id, policy_step=3).policy_step == 10
        assert store.ack(batch.id, policy_step=None).policy_step == 10
    assert [r.getMessage() for r in caplog.records] == [
        f"batch {batch.id} acked again with policy step {step}; it stays acked with step 10, its first ack's"
        for step in (3, None)
    ]
    assert [b.policy_step for b in store.batches()] == [10]


def test_a_lease_sent_again_with_its_idempotency_key_gets_the_same_batch(make_store, clock) -> None:
    """A trainer whose lease answer was lost sends the request again with the same key: the batch it leased, not a
    second lease of other groups while the first holds its groups until it expires."""
    store = make_store()
    for i, group in enumerate(["g1", "g2", "g3"]):
        _ready_group(store, group, first=100 * (i + 1))
    first = store.lease(BatchRequest(max_groups=2, lease_seconds=60, idempotency_key="k1"))
    clock.now += 5
    again = store.lease(BatchRequest(max_groups=2, lease_seconds=60, idempotency_key="k1"))
    assert again == first and [g.id for g in again.groups] == ["g1", "g2"]
    assert again.lease_expires_at == pytest.approx(1_000_060.0)
    assert [(b.id, b.state) for b in store.batches()] == [(first.id, "leased")]
    other = store.lease(BatchRequest(max_groups=2, idempotency_key="k2"))  # a new key: a new lease
    assert [g.id for g in other.groups] == ["g3"]
    assert store.lease(BatchRequest(max_groups=2, lease_seconds=60, idempotency_key="k1")).id == first.id  # g3 leased


@pytest.mark.parametrize(("changed", "difference"), [
    ({"trainer": "b"}, "trainer 'a', not 'b'"),
    ({"lease_seconds": 900}, "lease_seconds 60, not 900"),
    ({"max_groups": 1}, "max_groups 2, not 1"),
    ({"min_groups": 3, "max_groups": 3}, "max_groups 2, not 3; min_groups 1, not 3"),
    ({"max_groups": 5}, "max_groups 2, not 5"),  # bounds the batch still meets
    ({"min_groups": 2}, "min_groups 1, not 2"),
])
def test_an_idempotency_key_sent_with_other_parameters_is_refused(
    make_store, clock, changed: dict[str, object], difference: str
) -> None:
    """A key reused for another request is a client bug: it got the first request's batch, whatever it asked."""
    store = make_store()
    for i, group in enumerate(["g1", "g2", "g3"]):
        _ready_group(store, group, first=100 * (i + 1))
    asked: dict[str, object] = {"max_groups": 2, "lease_seconds": 60, "trainer": "a"}
    first = store.lease(BatchRequest(**asked, idempotency_key="k1"))
    clock.now += 5
    with pytest.raises(Conflict, match=f"Idempotency-Key 'k1' leased batch {first.id} for another request "
                       f"\\({difference}\\): send the same request again") as info:
        store.lease(BatchRequest(**{**asked, **changed}, idempotency_key="k1"))
    assert info.value.code == "idempotency_key_mismatch"
    assert store.lease(BatchRequest(**asked, idempotency_key="k1")) == first
    assert [(b.id, b.state) for b in store.batches()] == [(first.id, "leased")]


@pytest.mark.parametrize(("changed", "difference"), [
    ({"max_groups": 5, "min_groups": 2}, None),
    ({"max_groups": 1}, "2 groups, more than max_groups 1"),
    ({"min_groups": 3, "max_groups": 3}, "2 groups, fewer than min_groups 3"),
])
def test_an_idempotency_key_of_a_batch_leased_before_its_bounds_were_stored_is_checked_by_its_size(
    make_store, changed: dict[str, object], difference: str | None
) -> None:
    """A batch leased before schema version 8 has no bounds stored: a retry is told apart only by a bound the
    batch's size breaks."""
    from sqlalchemy import text

    store = make_store()
    for i, group in enumerate(["g1", "g2", "g3"]):
        _ready_group(store, group, first=100 * (i + 1))
    first = store.lease(BatchRequest(max_groups=2, idempotency_key="k1"))
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE batches SET max_groups = NULL, min_groups = NULL, members = NULL"))
    retry = BatchRequest(**{"max_groups": 2, **changed}, idempotency_key="k1")
    if difference is None:
        assert store.lease(retry) == first
        return
    with pytest.raises(Conflict, match=f"for another request \\({difference}\\)") as info:
        store.lease(retry)
    assert info.value.code == "idempotency_key_mismatch"


@pytest.mark.parametrize("end", ["ack", "release", "expiry"])
def test_the_idempotency_key_of_a_lease_that_ended_is_refused(make_store, clock, end) -> None:
    store = make_store()
    _ready_group(store)
    batch = store.lease(BatchRequest(lease_seconds=10, idempotency_key="k1"))
    if end == "ack":
        store.ack(batch.id, policy_step=1)
    elif end == "release":
        store.release(batch.id, FAILED)
    else:
        clock.now += 11
    state = {"ack": "acked", "release": "released", "expiry": "expired"}[end]
    with pytest.raises(Conflict, match=f"Idempotency-Key 'k1' leased batch {batch.id}, which is {state} now") as info:
        store.lease(BatchRequest(idempotency_key="k1"))
    assert info.value.code == "idempotency_key_used"
    assert [b.id for b in store.batches()] == [batch.id]


def test_an_idempotency_key_whose_request_leased_nothing_leases_when_sent_again(make_store) -> None:
    """A lease of no group stores no batch, so its key is not spent: sent again, it leases what is ready now."""
    store = make_store()
    _ready_group(store, "g1")
    assert store.lease(BatchRequest(min_groups=2, max_groups=2, idempotency_key="k1")).groups == []
    _ready_group(store, "g2", first=100)
    assert [g.id for g in store.lease(BatchRequest(min_groups=2, max_groups=2, idempotency_key="k1")).groups] == [
        "g1", "g2"]


def test_a_lease_retried_while_its_first_request_still_runs_gets_its_batch(db_url, clock, monkeypatch) -> None:
    """The retry of a lease whose answer timed out can reach another replica while the first request still runs:
    it waits for it (the key's lock) and answers its batch, instead of leasing the groups itself."""
    from collector import store_reads
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: a retry runs after the first request")
    store, replica = (SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2))
    store.setup()
    _ready_group(store)
    decided, retried, answers = store_reads.open_decisions, ThreadPoolExecutor(1), []

    def decisions_while_a_retry_arrives(*args):
        monkeypatch.setattr(store_reads, "open_decisions", decided)
        answers.append(retried.submit(replica.lease, BatchRequest(idempotency_key="k1")))
        threading.Event().wait(0.5)  # time for the retry to lease the group itself, were it not held back
        return decided(*args)

    monkeypatch.setattr(store_reads, "open_decisions", decisions_while_a_retry_arrives)
    first = store.lease(BatchRequest(idempotency_key="k1"))
    again = answers[0].result(timeout=30)
    retried.shutdown()
    assert [g.id for g in first.groups] == ["g"] and again == first
    assert [b.id for b in store.batches()] == [first.id]
    for each in (store, replica):
        each.close()


def test_min_and_max_groups(make_store) -> None:
    store = make_store()
    for i, group in enumerate(["g1", "g2", "g3"]):
        n = 100 * (i + 1)
        store.add_spans(trajectory(n, f"{group}a", reward=1.0, group=group)
                        + trajectory(n + 50, f"{group}b", reward=0.0, group=group))
    assert store.lease(BatchRequest(min_groups=4)).groups == []
    assert [g.id for g in store.lease(BatchRequest(max_groups=2)).groups] == ["g1", "g2"]
    assert [g.id for g in store.lease(BatchRequest(max_groups=2)).groups] == ["g3"]


def test_the_oldest_group_is_leased_first_when_more_are_ready_than_one_query_holds(
    make_store, clock, monkeypatch
) -> None:
    """PostgreSQL returns a group updated since (back from an expired lease) after the others: when more groups are
    ready than one `IN` list takes, the first list held younger groups and the oldest waited."""
    monkeypatch.setattr(engine, "CHUNK", 2)
    store = make_store()
    for i, group in enumerate(["g1", "g2", "g3"]):
        n = 100 * (i + 1)
        store.add_spans(trajectory(n, f"{group}a", reward=1.0, group=group)
                        + trajectory(n + 50, f"{group}b", reward=0.0, group=group))
        clock.now += 1
    assert [g.id for g in store.lease(BatchRequest(max_groups=1, lease_seconds=10)).groups] == ["g1"]
    clock.now += 11
    assert [g.id for g in store.lease(BatchRequest(max_groups=1)).groups] == ["g1"]
    assert [g.id for g in store.lease(BatchRequest(max_groups=2)).groups] == ["g2", "g3"]


def test_concurrent_leases_from_two_stores_never_share_a_group(db_url, clock) -> None:
    """Two stores on one database (as two collector processes would be) lease disjoint groups."""
    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database cannot be shared by two stores")
    stores = [SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2)]
    for store in stores:
        store.setup()
    for i in range(12):
        n = 100 * (i + 1)
        stores[i % 2].add_spans(
            trajectory(n, f"{i}a", reward=1.0, group=f"g{i}") + trajectory(n + 50, f"{i}b", reward=0.0, group=f"g{i}")
        )
    with ThreadPoolExecutor(8) as pool:
        batches = list(pool.map(lambda k: stores[k % 2].lease(BatchRequest(max_groups=2)), range(8)))
    leased = [g.id for batch in batches for g in batch.groups]
    assert sorted(leased) == sorted(f"g{i}" for i in range(12))
    for store in stores:
        store.close()


def test_a_group_changed_by_another_replica_before_the_lease_locks_it_is_not_leased(
    db_url, clock, monkeypatch
) -> None:
    """A trajectory without reward joins a ready group after the lease decided it ready but before it locked its
    row: the lease decides again under the lock and leaves the group in the pool."""
    from collector import store_reads
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no other store commits inside a lease")
    store, replica = (SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2))
    store.setup()
    store.add_spans(trajectory(10, "a", reward=1.0, size=None) + trajectory(20, "b", reward=0.0, size=None))
    decided = store_reads.open_decisions

    def decisions_then_a_commit_elsewhere(*args):
        out = decided(*args)
        monkeypatch.setattr(store_reads, "open_decisions", decided)
        replica.add_spans(trajectory(30, "c", reward=None, size=None))
        return out

    monkeypatch.setattr(store_reads, "open_decisions", decisions_then_a_commit_elsewhere)
    assert store.lease(BatchRequest()).groups == []
    assert _state(store)[:2] == ("open", "1 trajectories without reward 'reward'")
    store.add_reward(RewardIn(rollout_id="c", value=0.5))
    assert [[t.id for t in g.trajectories] for g in store.lease(BatchRequest()).groups] == [["a", "b", "c"]]
    for each in (store, replica):
        each.close()


@pytest.mark.parametrize(("ready", "leased"), [(["g1", "g2"], []), (["g1", "g2", "g3"], ["g2", "g3"])])
def test_a_group_the_check_under_the_lock_drops_leaves_the_lease_to_the_next_ready_ones(
    db_url, clock, monkeypatch, ready: list[str], leased: list[str]
) -> None:
    """Groups are ready for `min_groups = max_groups = 2`; the oldest gains a trajectory without reward before the
    lease locks it. Deciding again under the lock drops it, and the lease takes the next ready group instead: with
    none left, too few for `min_groups`, it takes none and stores no batch."""
    from collector import store_reads
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no other store commits inside a lease")
    store, replica = (SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2))
    store.setup()
    for i, group in enumerate(ready):
        store.add_spans(trajectory(100 * i + 10, f"{group}a", reward=1.0, group=group, size=None)
                        + trajectory(100 * i + 20, f"{group}b", reward=0.0, group=group, size=None))
    decided = store_reads.open_decisions

    def decisions_then_a_commit_elsewhere(*args):
        out = decided(*args)
        monkeypatch.setattr(store_reads, "open_decisions", decided)
        replica.add_spans(trajectory(900, "g1c", reward=None, group="g1", size=None))
        return out

    monkeypatch.setattr(store_reads, "open_decisions", decisions_then_a_commit_elsewhere)
    assert [g.id for g in store.lease(BatchRequest(min_groups=2, max_groups=2)).groups] == leased
    assert len(store.batches()) == (1 if leased else 0)
    assert [_state(store, group)[0] for group in ready] == ["open", *("leased" if leased else "ready"
                                                                      for _ in ready[1:])]
    for each in (store, replica):
        each.close()


def test_a_released_batch_is_leased_again_at_once(make_store) -> None:
    store = make_store()
    _ready_group(store)
    batch = store.lease(BatchRequest(trainer="t1", lease_seconds=900))
    released = store.release(batch.id, FAILED)
    assert released == ReleaseResponse(batch_id=batch.id, returned=["g"], skipped=[], max_failed_attempts=3)
    assert _state(store) == ("ready", None, 1)
    again = store.lease(BatchRequest(lease_seconds=900))  # no waiting for the 900 s lease to run out
    assert [g.id for g in again.groups] == ["g"]
    shown = {b.id: (b.state, b.reason) for b in store.batches()}
    assert shown == {batch.id: ("released", FAILED.reason), again.id: ("leased", None)}
    assert store.ack(again.id, policy_step=1).groups == ["g"]
    assert _state(store) == ("trained", None, 1)  # trained is final; the count stays as history


def test_failed_releases_skip_a_group_at_the_limit_and_a_reward_does_not_reopen_it(make_store) -> None:
    store = make_store()
    _ready_group(store)
    _ready_group(store, "h", first=30)
    for attempt in (1, 2, 3):
        batch = store.lease(BatchRequest(max_groups=1))
        assert [g.id for g in batch.groups] == ["g"]  # the oldest group first, again and again
        released = store.release(batch.id, ReleaseRequest(reason=f"RuntimeError: attempt {attempt}"))
    assert (released.returned, released.skipped) == ([], ["g"])
    assert _state(store) == ("skipped", "training failed 3 times; last: RuntimeError: attempt 3", 3)
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["h"]  # g is never offered again
    store.add_reward(RewardIn(rollout_id="g-b", value=0.5))  # new rewards do not make the data trainable
    assert _state(store)[0::2] == ("skipped", 3)
    assert store.groups(states={"ready"}) == []


def test_a_release_as_not_failed_counts_nothing(make_store) -> None:
    store = make_store()
    _ready_group(store)
    for _ in range(4):
        batch = store.lease(BatchRequest())
        assert store.release(batch.id, ReleaseRequest(reason="OSError: No space left on device",
                                                      failed=False)).returned == ["g"]
    assert _state(store) == ("ready", None, 0)


def test_no_limit_never_gives_up(make_store) -> None:
    store = make_store(max_failed_attempts=0)
    _ready_group(store)
    for _ in range(5):
        released = store.release(store.lease(BatchRequest()).id, FAILED)
    assert (released.returned, released.skipped, released.max_failed_attempts) == (["g"], [], 0)
    assert _state(store) == ("ready", None, 5)


def test_expired_leases_count_and_skip_at_the_limit(make_store, clock) -> None:
    store = make_store(max_failed_attempts=2)
    _ready_group(store)
    first = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 11
    assert _state(store) == ("ready", None, 1)
    second = store.lease(BatchRequest(lease_seconds=10))  # say the trainer is killed mid-step again
    clock.now += 11
    assert _state(store) == ("skipped", "training failed 2 times; last: lease expired", 2)
    assert store.lease(BatchRequest()).groups == []
    shown = {b.id: (b.state, b.reason) for b in store.batches()}
    assert shown[first.id] == shown[second.id] == ("expired", "lease expired")
    # the trainer comes back and releases its batch: the expiry counted that attempt already
    late = store.release(second.id, FAILED)
    assert (late.returned, late.skipped) == ([], ["g"])
    assert _state(store)[2] == 2
    assert {b.id: b.state for b in store.batches()}[second.id] == "released"


def test_a_release_after_expiry_leaves_groups_leased_again_alone(make_store, clock) -> None:
    store = make_store()
    _ready_group(store)
    first = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 11
    second = store.lease(BatchRequest(lease_seconds=100))
    released = store.release(first.id, FAILED)
    assert released.returned == ["g"]  # it went back when the lease expired
    assert _state(store) == ("leased", None, 1)  # counted once, by the expiry; still the second batch's
    assert store.ack(second.id, policy_step=1).groups == ["g"]
    assert _state(store) == ("trained", None, 1)


def test_release_is_idempotent_and_conflicts_with_acks(make_store) -> None:
    store = make_store()
    _ready_group(store)
    _ready_group(store, "h", first=30)
    batch = store.lease(BatchRequest(max_groups=1))
    first = store.release(batch.id, FAILED)
    assert store.release(batch.id, ReleaseRequest(reason="again", failed=True)) == first
    assert _state(store)[2] == 1  # not counted twice
    assert {b.id: b.reason for b in store.batches()}[batch.id] == FAILED.reason
    with pytest.raises(Conflict) as released:
        store.ack(batch.id, policy_step=1)
    assert released.value.code == "batch_released" and "NonFiniteStepError" in released.value.message
    acked = store.lease(BatchRequest(max_groups=2))
    store.ack(acked.id, policy_step=1)
    with pytest.raises(Conflict) as trained:
        store.release(acked.id, FAILED)
    assert trained.value.code == "batch_acked"
    assert {g.id: g.state for g in store.groups()} == {"g": "trained", "h": "trained"}
    with pytest.raises(NotFound):
        store.release("nope", FAILED)


def test_a_release_whose_reason_holds_a_nul_character_or_a_lone_surrogate_gives_the_groups_back(make_store) -> None:
    """PostgreSQL's text holds no NUL, and no UTF-8 text a lone surrogate: a trainer's error text with one was refused
    (400) and its groups stayed leased until the lease expired; on SQLite a NUL was stored. Stored with U+FFFD in
    their place on every backend."""
    store = make_store(max_failed_attempts=1)
    _ready_group(store)
    batch = store.lease(BatchRequest())
    released = store.release(batch.id, ReleaseRequest(reason="UnicodeError: text\x00end\udcff"))
    assert (released.returned, released.skipped) == ([], ["g"])
    assert _state(store) == ("skipped", "training failed 1 times; last: UnicodeError: text\ufffdend\ufffd", 1)
    assert {b.id: b.reason for b in store.batches()}[batch.id] == "UnicodeError: text\ufffdend\ufffd"


def test_an_empty_lease_is_not_stored(make_store) -> None:
    """A poll that finds nothing ready leaves no batch behind to expire later, nor one to ack or release."""
    store = make_store()
    batch = store.lease(BatchRequest())
    assert batch.groups == [] and store.batches() == []
    with pytest.raises(NotFound):
        store.release(batch.id, FAILED)
    with pytest.raises(NotFound):
        store.ack(batch.id, None)


def test_a_long_reason_is_cut() -> None:
    request = ReleaseRequest(reason="x" * 5000)
    assert len(request.reason) == 2000 and request.reason.endswith("…")
    assert ReleaseRequest(reason="y" * 2000).reason == "y" * 2000


def test_reopen_puts_a_group_given_up_on_back_with_its_attempts_reset(make_store, clock) -> None:
    store = make_store(max_failed_attempts=1, group_timeout_seconds=60)
    _ready_group(store)
    store.release(store.lease(BatchRequest()).id, FAILED)
    assert _state(store) == ("skipped", f"training failed 1 times; last: {FAILED.reason}", 1)
    assert store.reopen("g") == ReopenResponse(
        group_id="g", previous_state="skipped", previous_reason=f"training failed 1 times; last: {FAILED.reason}",
        failed_attempts=1)
    assert _state(store) == ("ready", None, 0)
    batch = store.lease(BatchRequest())
    assert [g.id for g in batch.groups] == ["g"]
    with pytest.raises(Conflict) as leased:
        store.reopen("g")
    assert leased.value.code == "group_not_reopenable"
    store.release(batch.id, FAILED)  # it fails again: the limit counts from zero after a reopen
    assert _state(store)[0::2] == ("skipped", 1)

    store.add_spans(trajectory(50, "lone", reward=1.0, group="stale"))  # waits for a second member that never comes
    clock.now += 61
    store.lease(BatchRequest())  # the pool's upkeep expires it
    assert _state(store, "stale")[0] == "expired"
    assert store.reopen("stale").previous_state == "expired"
    assert _state(store, "stale")[0] == "open"  # a new timeout window; still waiting for its group
    with pytest.raises(NotFound):
        store.reopen("nope")


def test_reopen_ends_the_leases_that_expired_first(make_store, clock) -> None:
    """A lease that expired with no request since (its trainer is down) still held its group for reopen, which refused
    it as `leased`, while `GET /v1/groups`, which ends expired leases first, showed it skipped."""
    store = make_store(max_failed_attempts=1)
    _ready_group(store)
    store.lease(BatchRequest(lease_seconds=60))
    clock.now += 61
    assert store.reopen("g") == ReopenResponse(
        group_id="g", previous_state="skipped", previous_reason="training failed 1 times; last: lease expired",
        failed_attempts=1)
    assert _state(store) == ("ready", None, 0)


def test_reopen_holds_no_other_group_while_it_waits_for_its_own(db_url, clock, monkeypatch, caplog) -> None:
    """Reopen of g1 ended h's expired lease in the reopen's transaction, holding h's row, then waited for g1's, which
    a reward for members of g1 and h held (locked in id order) while it waited for h: each waited for the other, and
    PostgreSQL aborted one as a deadlock. Expired leases end in a transaction of their own, as a read's do."""
    from collector import pool
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: nothing runs beside the reopen")
    store, replica = (SqlStore(CollectorSettings(db=url, max_failed_attempts=1), clock=clock) for _ in range(2))
    store.setup()
    _ready_group(store, "g1")
    store.release(store.lease(BatchRequest()).id, FAILED)  # g1: skipped, reopenable
    _ready_group(store, "h", first=100)
    store.lease(BatchRequest(lease_seconds=60))  # h: leased, its trainer then down
    clock.now += 61
    ended, resume = pause_after(monkeypatch, pool, "maintain")
    with ThreadPoolExecutor(2) as executor:
        reopened = executor.submit(store.reopen, "g1")
        assert ended.wait(WAIT)
        rewards = [RewardIn(rollout_id="g1-a", value=0.5), RewardIn(rollout_id="h-a", value=0.5)]
        reward = executor.submit(replica.add_rewards, rewards)
        assert lock_waited_for(store.engine), "the reward did not wait for h, which the upkeep holds"
        resume.set()
        assert reopened.result(WAIT).previous_state == "skipped"
        reward.result(WAIT)

    assert "deadlock" not in caplog.text
    assert {g.id: g.state for g in store.groups()} == {"g1": "ready", "h": "skipped"}  # h: its one failed attempt
    for each in (store, replica):
        each.close()


def test_reopen_of_a_group_skipped_for_its_rewards_says_so_and_a_new_reward_puts_it_back(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "g-a", reward=1.0) + trajectory(20, "g-b", reward=1.0))
    assert _state(store) == ("skipped", "no reward spread", 0)
    with pytest.raises(Conflict) as refused:
        store.reopen("g")
    assert refused.value.code == "group_not_reopenable"
    assert refused.value.message == (
        "group g is skipped (no reward spread) but still in the pool: a new or changed reward puts it back by itself, "
        "ready once its rewards differ; reopen is for groups the pool gave up on"
    )
    assert store.lease(BatchRequest()).groups == []  # stores it skipped: still in the pool, still refused
    assert _state(store) == ("skipped", "no reward spread", 0)
    with pytest.raises(Conflict) as stored:
        store.reopen("g")
    assert (stored.value.code, stored.value.message) == (refused.value.code, refused.value.message)
    store.add_reward(RewardIn(rollout_id="g-b", value=0.0))
    assert _state(store) == ("ready", None, 0)
    with pytest.raises(Conflict) as ready:
        store.reopen("g")
    assert ready.value.message == "group g is ready; only a group in skipped or expired can be reopened"


def test_a_reward_from_another_replica_before_the_lease_stores_a_skip_keeps_the_group_in_the_pool(
    db_url, clock, monkeypatch
) -> None:
    """A reward that gives a group its spread is committed by another replica after the lease decided the group
    skipped for no spread but before it stored that: the lease decides again under the row lock and leaves it in
    the pool, to be leased next."""
    from collector import store_reads
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no other store commits inside a lease")
    store, replica = (SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2))
    store.setup()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=1.0))
    decided = store_reads.open_decisions

    def decisions_then_a_reward_elsewhere(*args):
        out = decided(*args)
        monkeypatch.setattr(store_reads, "open_decisions", decided)
        replica.add_reward(RewardIn(rollout_id="b", value=0.0))
        return out

    monkeypatch.setattr(store_reads, "open_decisions", decisions_then_a_reward_elsewhere)
    assert store.lease(BatchRequest()).groups == []
    assert _state(store) == ("ready", None, 0)
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["g"]
    for each in (store, replica):
        each.close()


class _PausedClock:
    """The clock of a replica that pauses right after its first reading of the time (as a process does for a lock
    wait, or a GC), until the test resumes it."""

    def __init__(self, clock) -> None:
        self.clock, self.read, self.resume = clock, threading.Event(), threading.Event()

    def __call__(self) -> float:
        now = self.clock()
        if not self.read.is_set():
            self.read.set()
            assert self.resume.wait(30)
        return now


def _paused_replica(db_url, clock):
    """A store on a fresh PostgreSQL database, set up, with a ready group `g`, and a replica on it with a
    `_PausedClock`."""
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no other store commits inside a lease")
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    paused = _PausedClock(clock)
    return store, SqlStore(CollectorSettings(db=url), clock=paused), paused


def test_a_late_ack_sees_an_export_dated_before_the_lease_but_committed_after_it(db_url, clock) -> None:
    """An export read the store's time first and then waited (for the trajectory's lock): the lease in between took
    the group without its spans, the export was dated before the lease, and the ack after the lease expired found the
    group unchanged and marked it trained."""
    store, replica, paused = _paused_replica(db_url, clock)
    late = [llm(30, rollout="a", trace=f"{10:032x}", start=20, prompt=[1, 2, 10], completion=[7], logprobs=[-1.0])]
    with ThreadPoolExecutor(1) as executor:
        export = executor.submit(replica.add_spans, late)
        assert paused.read.wait(30)
        clock.now += 1
        batch = store.lease(BatchRequest(lease_seconds=10))
        clock.now += 1
        paused.resume.set()
        assert export.result() == 1
    assert [g.id for g in batch.groups] == ["g"]
    clock.now += 20
    with pytest.raises(Conflict, match="groups g changed in the pool") as raised:
        store.ack(batch.id, policy_step=1)
    assert raised.value.code == "lease_expired"
    for each in (store, replica):
        each.close()


def test_a_lease_passes_over_a_group_whose_reward_another_replica_is_storing(db_url, clock) -> None:
    """A reward by API read the store's time before it locked anything: a lease in between took the group without
    the reward, which was then stored dated before the lease, so an ack after the lease expired marked the group
    trained on rewards it never had."""
    store, replica, paused = _paused_replica(db_url, clock)
    with ThreadPoolExecutor(1) as executor:
        posted = executor.submit(replica.add_reward, RewardIn(rollout_id="b", name="judge", value=0.5))
        assert paused.read.wait(30)
        clock.now += 1
        batch = store.lease(BatchRequest(lease_seconds=10))
        paused.resume.set()
        posted.result()
    assert batch.groups == []  # held by the replica: passed over, not taken without the reward
    (group,) = store.lease(BatchRequest()).groups
    assert [t.rewards for t in group.trajectories] == [{"reward": 1.0}, {"reward": 0.0, "judge": 0.5}]
    for each in (store, replica):
        each.close()


def test_a_group_skipped_for_its_rewards_by_earlier_settings_can_be_reopened(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "g-a", reward=1.0) + trajectory(20, "g-b", reward=1.0))
    assert store.lease(BatchRequest()).groups == []  # stores it skipped
    store.settings = store.settings.model_copy(update={"keep_zero_spread": True})  # restarted with it
    assert _state(store)[:2] == ("skipped", "no reward spread")  # the lease reads open groups only
    assert store.reopen("g").previous_reason == "no reward spread"
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["g"]


@pytest.mark.parametrize("end", ["release", "ack"])
def test_a_batch_ended_while_upkeep_expires_it_and_another_waits_for_neither(
    db_url, clock, monkeypatch, caplog, end: str
) -> None:
    """A release (or ack) of batch X expires an older lease Y first (`pool.maintain`), then locks X; upkeep on a
    replica, which finds both expired, waits for them meanwhile. Both take the batches' rows in id order before they
    update any, so the upkeep waits and no transaction is aborted as a deadlock (it updated X, then waited for Y)."""
    from collector import pool
    from tests.collector.pausing import lock_waited_for, pause_after
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no upkeep runs inside a release")
    store, replica = (SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2))
    store.setup()
    _ready_group(store, "g1", first=10)
    _ready_group(store, "g2", first=100)
    x = store.lease(BatchRequest(max_groups=1, lease_seconds=100)).id
    y = store.lease(BatchRequest(max_groups=1, lease_seconds=10)).id
    clock.now += 50
    maintained, resume = pause_after(monkeypatch, pool, "maintain")
    with ThreadPoolExecutor(2) as executor:
        ending = executor.submit(store.release, x, FAILED) if end == "release" else executor.submit(store.ack, x, 1)
        assert maintained.wait(30)  # Y expired, X not yet locked by the ending itself
        clock.now += 150
        upkeep = executor.submit(replica.batches)
        assert lock_waited_for(store.engine), "the upkeep did not wait for the ending's batches"
        resume.set()
        ending.result(30)
        shown = {b.id: b.state for b in upkeep.result(30)}
    assert shown == {x: "released" if end == "release" else "acked", y: "expired"}
    assert "deadlock" not in caplog.text
    for each in (store, replica):
        each.close()


def _lease_statements(make_store, count: int) -> int:
    """Statements sent by a lease of `count` ready groups."""
    store = make_store()
    for i in range(count):
        _ready_group(store, f"g{i}", first=100 * i + 10)
    sent: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda conn, cursor, statement, *_: sent.append(statement))
    assert len(store.lease(BatchRequest(max_groups=count)).groups) == count
    return len(sent)


def test_a_lease_of_more_groups_sends_no_more_statements(make_store) -> None:
    """The groups leased are updated and joined to their batch per chunk, not one statement each."""
    assert _lease_statements(make_store, 6) == _lease_statements(make_store, 2)


def test_an_ack_that_gives_back_an_expired_lease_locks_its_own_groups_in_the_same_pass(db_url, clock) -> None:
    """The ack's upkeep gave back an expired batch's group gb and held it; the ack then locked its own group ga (< gb)
    in a second statement. A transaction locking [ga, gb] in id order in between held ga and waited for gb, while the
    ack waited for ga: PostgreSQL aborted one as a deadlock (found by the fuzz)."""
    from collector import pool
    from tests.collector.pausing import lock_waited_for

    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: nothing locks beside the ack")
    settings = CollectorSettings(db=url, min_group_size=2)
    store = SqlStore(settings, clock=clock)
    store.setup()
    for n, group in ((100, "ga"), (300, "gb")):
        store.add_spans(trajectory(n, f"{group}1", reward=0.0, group=group, size=2)
                        + trajectory(n + 50, f"{group}2", reward=1.0, group=group, size=2))
    for _ in range(2):
        store.lease(BatchRequest(max_groups=1, lease_seconds=100))
    batches = {group: batch.id for batch in store.batches() for group in batch.groups}
    assert sorted(batches) == ["ga", "gb"]
    with store.engine.begin() as conn:  # gb's lease ran out
        conn.exec_driver_sql("UPDATE batches SET lease_expires_at = 0 WHERE id = %(b)s", {"b": batches["gb"]})
    failures: list[BaseException] = []
    with store.engine.connect() as ack, store.engine.connect() as other:
        with ack.begin():
            pool.maintain(ack, settings, clock(), store._tx.lock, acking=[batches["ga"]])  # gives gb back, holds it

            def lock_both() -> None:
                try:
                    with other.begin():
                        pool.lock_groups(other, ["ga", "gb"])  # an export or a reward: one pass in id order
                except Exception as exc:  # the deadlock, had the ack locked ga after gb
                    failures.append(exc)

            thread = threading.Thread(target=lock_both)
            thread.start()
            assert lock_waited_for(store.engine)
            try:
                pool.lock_groups(ack, ["ga"])  # leases.ack: its own batch's groups
            except Exception as exc:
                failures.append(exc)
        thread.join(10)
    assert failures == []
    store.close()
