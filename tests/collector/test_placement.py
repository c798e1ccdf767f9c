"""Placement of an export's trajectories in group instances (`collector/placement.py`): the ids of new instances,
lookups that do not grow with the export's new groups, and only in the groups the export locked; the deletion of another
instrumentation's calls in the traces of rollouts, several at once (`collector/foreign_deletion.py`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import pytest
from sqlalchemy import event, select

from art_langgraph import semconv as sc
from collector import placement
from collector.config import CollectorSettings
from collector.foreign_deletion import FOREIGN_IN_ROLLOUT
from collector.protocol import BatchRequest, ReleaseRequest, RewardIn
from collector.schema import groups as group_rows
from collector.schema import trajectories as trajectory_rows
from collector.store import SqlStore
from tests.collector.pausing import WAIT, beside_a_save, lock_waited_for, pause_after
from tests.collector.span_builders import trajectory
from tests.collector.test_foreign import _openinference_llm, _ours


@pytest.mark.parametrize(("size", "others", "instances"), [
    # the j-th new instance of an export tries the key, then `key#n` from n = instances of the key so far + 1
    (2, ["g#2", "g#4"], [("g", 2), ("g#3", 2), ("g#5", 2), ("g#6", 1)]),
    # past the ids one per trajectory: looked up one at a time
    (1, ["g#2", "g#3", "g#4"], [("g", 1), ("g#5", 1), ("g#6", 1)]),
])
def test_new_instances_skip_the_ids_of_other_keys_groups_and_of_those_made_before(
    make_store, size: int, others: list[str], instances: list[tuple[str, int]]
) -> None:
    store = make_store()
    for n, key in enumerate(others):  # groups of keys that look like instances of `g`
        store.add_spans(trajectory(10 * (n + 1), f"other-{n}", group=key, size=1, reward=1.0))
    members = sum(count for _, count in instances)
    store.add_spans([span for n in range(members) for span in
                     trajectory(1000 + 10 * n, f"t{n}", group="g", size=size, reward=float(n))])
    assert sorted((g.id, g.size) for g in store.groups()) == sorted([*((key, 1) for key in others), *instances])


def test_a_key_whose_id_another_keys_instance_holds_numbers_its_instances_from_2(make_store) -> None:
    """Key `k#2` came after `k`'s second instance took the id `k#2`: its first instance was `k#2#1`, off the
    `key`, `key#2`, `key#3` ... scheme every other key follows."""
    store = make_store()
    for n, key in enumerate(["k", "k", "k#2", "k#2"]):
        store.add_spans(trajectory(10 * (n + 1), f"r{n}", group=key, size=1, reward=1.0))
    assert sorted(g.id for g in store.groups()) == ["k", "k#2", "k#2#2", "k#2#3"]


def _statements(make_store, groups: int) -> int:
    """Statements an export of `groups` rollouts, each in a new group of its own, sends."""
    store = make_store()
    sent: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda conn, cursor, statement, *_: sent.append(statement))
    store.add_spans([span for n in range(groups) for span in
                     trajectory(10 * (n + 1), f"r{n}", group=f"g{n}", size=2, reward=1.0)])
    return len(sent)


def test_an_export_of_more_new_groups_sends_no_more_statements(make_store) -> None:
    """The ids of new instances are looked up together, and the advisory locks of the export's trajectories and
    group keys taken in one statement per namespace (`Transactions.lock`)."""
    assert _statements(make_store, 30) == _statements(make_store, 3)


def _foreign_calls(store: SqlStore, trace: str, group: str, size: int) -> None:
    """A trajectory of another instrumentation's call in `trace`, in the group `group` of `size` members."""
    call = _openinference_llm(trace, 111, None, marked=False)
    store.add_spans([replace(call, attributes=call.attributes | {sc.GROUP: group, sc.GROUP_SIZE: size})])


def test_one_export_deletes_the_foreign_calls_of_several_traces_each_as_on_its_own(make_store, clock, caplog) -> None:
    """The rollouts of four traces come in one export: the foreign calls of two traces in group g, of one in h beside
    a member of a trace without rollout, and of one in the leased group l. g, emptied, is skipped; h's member left is
    dated; l's member is kept."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    a, b, c, d, e = (f"{n:032x}" for n in range(0xC1, 0xC6))
    for trace, group, size in ((a, "g", 5), (b, "g", 5), (c, "h", 5), (d, "h", 5), (e, "l", 1)):
        _foreign_calls(store, trace, group, size)
    store.add_rewards([RewardIn(trace_id=e, value=0.5)])
    clock.now += 1000  # idle past `idle_seconds`: complete
    assert [group.id for group in store.lease(BatchRequest(lease_seconds=100)).groups] == ["l"]
    clock.now += 1
    store.add_spans([span for n, trace in enumerate((a, b, c, e)) for span in _ours(f"r{n}", trace, 100)])

    assert sorted(t.id for t in store.trajectories()) == sorted(["r0", "r1", "r2", "r3", d, e])
    with store.engine.connect() as conn:
        states = dict(conn.execute(select(group_rows.c.id, group_rows.c.state)).all())
        dated = conn.execute(select(trajectory_rows.c.updated_at).where(trajectory_rows.c.id == d)).scalar_one()
    assert {key: states[key] for key in "ghl"} == {"g": "skipped", "h": "open", "l": "leased"}
    assert dated == clock.now
    assert f"trajectory {e}: {FOREIGN_IN_ROLLOUT}, kept: its group l is leased" in caplog.text


def _deletion_statements(make_store, traces: int) -> int:
    """Statements of an export of the rollouts of `traces` traces that delete the foreign calls stored in each."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    ids = [f"{0xD000 + n:032x}" for n in range(traces)]
    for trace in ids:
        _foreign_calls(store, trace, "g", 100)
    sent: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda conn, cursor, statement, *_: sent.append(statement))
    store.add_spans([span for n, trace in enumerate(ids) for span in _ours(f"r{n}", trace, 100)])
    statements = len(sent)
    assert [t.id for t in store.trajectories()] == sorted(f"r{n}" for n in range(traces))
    return statements


def test_an_export_deleting_more_foreign_calls_sends_no_more_statements(make_store) -> None:
    assert _deletion_statements(make_store, 20) == _deletion_statements(make_store, 2)


def test_a_deletion_of_several_foreign_calls_locks_them_and_the_members_left_in_id_order(make_store, caplog) -> None:
    """The save of the reward curve's policy steps (`PolicySteps.save`, in id order) held member B and was to update
    C; one export deleted the foreign calls of traces A and C of B's group. Had it taken C (deleting it) before waiting
    for B (dating the members left), each waited for the other: PostgreSQL aborted one as a deadlock."""
    store = make_store(min_group_size=3)
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: nothing runs beside the export")
    a, b, c = (f"{n:032x}" for n in range(0xE1, 0xE4))
    for trace in (c, b, a):  # C's row is the first in the table
        _foreign_calls(store, trace, "g", 3)
    ours = [span for n, trace in enumerate((a, c)) for span in _ours(f"r{n}", trace, 100)]
    added = beside_a_save(store.engine, [b, c], lambda: store.add_spans(ours))

    assert added == len(ours) and "deadlock" not in caplog.text
    assert [t.id for t in store.trajectories(group="g")] == [b]


def test_an_export_waits_for_no_group_reopened_after_it_locked_its_groups(
    db_url, clock, monkeypatch, caplog
) -> None:
    """An export of d in g locked g#2, the open instance of g it found (g was leased); a replica then gave g back, and
    a reward for members of g and g#2 locked g and waited for g#2. Had the export's placement locked g, reopened since,
    out of id order, each waited for the other: PostgreSQL aborted one as a deadlock. It skips a reopened group another
    transaction holds."""
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: nothing runs beside the export")
    store, replica = (SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2))
    store.setup()
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    batch = store.lease(BatchRequest()).id
    store.add_spans(trajectory(30, "c", reward=0.5))  # g is leased: in g#2
    locked, resume = pause_after(monkeypatch, store, "_changing_groups")
    with ThreadPoolExecutor(2) as executor:
        export = executor.submit(store.add_spans, trajectory(40, "d", reward=0.25))
        assert locked.wait(WAIT)
        replica.release(batch, ReleaseRequest(reason="trainer down", failed=False))
        rewards = [RewardIn(rollout_id="a", value=0.1), RewardIn(rollout_id="c", value=0.2)]
        reward = executor.submit(replica.add_rewards, rewards)
        assert lock_waited_for(store.engine), "the reward did not wait for the export's group"
        resume.set()
        export.result(WAIT)
        reward.result(WAIT)

    assert "deadlock" not in caplog.text
    assert [(t.id, t.group_id, t.reward) for t in store.trajectories()] == [
        ("a", "g", 0.1), ("b", "g", 0.0), ("c", "g#2", 0.2), ("d", "g#2", 0.25)]
    for each in (store, replica):
        each.close()


def _uncapped_g_leased(url: str, clock) -> tuple[SqlStore, SqlStore, str]:
    """Two stores on PostgreSQL database `url`, and the batch that leased g (a and b; explicit, no size: no cap)."""
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: nothing runs beside the export")
    store, replica = (SqlStore(CollectorSettings(db=url, min_group_size=2), clock=clock) for _ in range(2))
    store.setup()
    store.add_spans(trajectory(10, "a", reward=1.0, size=None) + trajectory(20, "b", reward=0.0, size=None))
    return store, replica, store.lease(BatchRequest()).id


def test_an_export_places_in_a_group_given_back_after_it_listed_its_groups(db_url, clock, monkeypatch) -> None:
    """g (an explicit group without a size: no cap) was leased when an export of d listed the groups it would change;
    a replica gave g back before the export locked them. d went to a new instance g#2 beside g, open with room and
    held by no one, and later trajectories went to g: d was left alone in g#2, to expire."""
    store, replica, batch = _uncapped_g_leased(db_url(), clock)
    listed, resume = pause_after(monkeypatch, placement, "groups_changed")
    with ThreadPoolExecutor(1) as executor:
        export = executor.submit(store.add_spans, trajectory(30, "d", reward=0.25, size=None))
        assert listed.wait(WAIT)
        replica.release(batch, ReleaseRequest(reason="trainer down", failed=False))
        resume.set()
        export.result(WAIT)

    store.add_spans(trajectory(40, "e", reward=0.75, size=None))
    assert [(t.id, t.group_id) for t in store.trajectories()] == [("a", "g"), ("b", "g"), ("d", "g"), ("e", "g")]
    for each in (store, replica):
        each.close()


@contextmanager
def _export_while_a_reward_holds(
    monkeypatch, store: SqlStore, replica: SqlStore, batch: str, spans: list, rollout_id: str
) -> Iterator[Future]:
    """Export `spans` through `store`, paused once it listed its groups; meanwhile `replica` gives `batch` back and a
    reward of `rollout_id` locks its group and holds it. Yields the export, resumed and placing while the reward
    holds; the reward lets go on exit, and both must then end."""
    listed, resume = pause_after(monkeypatch, placement, "groups_changed")
    holding, let_go = threading.Event(), threading.Event()

    def hold(conn) -> None:  # in the reward's transaction, once it locked the group
        holding.set()
        assert let_go.wait(WAIT)

    with ThreadPoolExecutor(2) as executor:
        export = executor.submit(store.add_spans, spans)
        assert listed.wait(WAIT)
        replica.release(batch, ReleaseRequest(reason="trainer down", failed=False))
        reward = executor.submit(replica.add_rewards, [RewardIn(rollout_id=rollout_id, value=0.5)], also=hold)
        assert holding.wait(WAIT)
        resume.set()
        try:
            yield export
        finally:
            let_go.set()
        export.result(WAIT)
        reward.result(WAIT)


def test_an_export_tries_again_when_a_reopened_group_is_held_a_moment(db_url, clock, monkeypatch, caplog) -> None:
    """g (explicit, no size) was given back after an export of d listed its groups, and a reward of a held g when the
    export placed: SKIP LOCKED passed it over, and d went alone to a new g#2 (later trajectories went to g). The
    export now tries again; its lock pass then waits for g in id order."""
    store, replica, batch = _uncapped_g_leased(db_url(), clock)
    d = trajectory(30, "d", reward=0.25, size=None)
    with _export_while_a_reward_holds(monkeypatch, store, replica, batch, d, rollout_id="a"):  # the reward holds g
        assert lock_waited_for(store.engine), "the export's second try did not wait for g"

    store.add_spans(trajectory(40, "e", reward=0.75, size=None))
    assert [(t.id, t.group_id) for t in store.trajectories()] == [("a", "g"), ("b", "g"), ("d", "g"), ("e", "g")]
    assert "reopened while the export placed), retry 1 of 7" in caplog.text and "deadlock" not in caplog.text
    for each in (store, replica):
        each.close()


@pytest.mark.parametrize("back", ["release", "expired lease", "reward", "reopen"])
def test_an_uncapped_group_back_in_the_pool_after_a_newer_instance_opened_takes_no_more(
    make_store, clock, back: str
) -> None:
    """g (explicit, no size: no cap) was out of the pool (leased, or skipped for no reward spread) when c named its
    key: c opened g#2. g came back (given back, reopened by a reward, reopened by hand); d went to g, the oldest open
    instance with room, and c was left alone in g#2, to expire. g, holding the min_group_size it needs, took its last
    member when g#2 opened: d joins c."""
    store = make_store(min_group_size=2, max_failed_attempts=1 if back == "reopen" else 3)
    spread = 1.0 if back == "reward" else 0.0  # no spread: the lease stores g skipped
    store.add_spans(trajectory(10, "a", reward=1.0, size=None) + trajectory(20, "b", reward=spread, size=None))
    batch = store.lease(BatchRequest(lease_seconds=60))
    assert [g.id for g in batch.groups] == ([] if back == "reward" else ["g"])
    clock.now += 1
    store.add_spans(trajectory(30, "c", reward=0.5, size=None))
    clock.now += 1
    if back == "release":
        store.release(batch.id, ReleaseRequest(reason="trainer down", failed=False))
    elif back == "expired lease":
        clock.now += 60
    elif back == "reward":  # a new reward puts a group skipped for its rewards back
        store.add_rewards([RewardIn(rollout_id="a", value=1.0)])
    else:  # failed at the limit (skipped), reopened by the operator
        store.release(batch.id, ReleaseRequest(reason="out of memory", failed=True))
        store.reopen("g")
    assert {g.id: g.state for g in store.groups()}["g"] != "leased"  # back in the pool (upkeep: the expired lease)
    clock.now += 1
    store.add_spans(trajectory(40, "d", reward=0.25, size=None))
    store.add_spans(trajectory(50, "e", reward=0.75, size=None))

    assert [(t.id, t.group_id) for t in store.trajectories()] == [
        ("a", "g"), ("b", "g"), ("c", "g#2"), ("d", "g#2"), ("e", "g#2")]
    assert {g.id: (g.size, g.expected) for g in store.groups()} == {"g": (2, 2), "g#2": (3, 2)}


def test_on_its_last_try_an_export_opens_no_third_instance_beside_a_held_newest_one(db_url, clock, monkeypatch) -> None:
    """g (explicit, no size) was followed by g#2; g#2 was given back after an export of d listed its groups, and held
    by a reward when the export placed, on its last try: SKIP LOCKED left g#2 out, yet it still made g followed, so d
    opened g#3, and every later trajectory of the key went there instead of to g#2. d goes to g, as before the rule."""
    store, replica, first = _uncapped_g_leased(db_url(), clock)
    clock.now += 1
    store.add_spans(trajectory(30, "c", reward=0.5, size=None) + trajectory(40, "e", reward=0.25, size=None))
    second = store.lease(BatchRequest()).id  # g#2
    store.release(first, ReleaseRequest(reason="trainer down", failed=False))  # g back, followed by g#2
    clock.now += 1
    monkeypatch.setattr(placement, "last_try", lambda: True)
    d = trajectory(50, "d", reward=0.75, size=None)
    with _export_while_a_reward_holds(monkeypatch, store, replica, second, d, rollout_id="c") as export:
        export.result(WAIT)  # while the reward holds g#2

    monkeypatch.undo()
    clock.now += 1
    store.add_spans(trajectory(60, "f", reward=0.1, size=None))
    assert [(t.id, t.group_id) for t in store.trajectories()] == [
        ("a", "g"), ("b", "g"), ("c", "g#2"), ("e", "g#2"), ("d", "g"), ("f", "g#2")]
    for each in (store, replica):
        each.close()


@pytest.mark.parametrize("size", [2, None])
def test_a_group_reopened_by_hand_after_it_expired_waiting_for_members_fills_before_its_newer_instance(
    make_store, clock, size: int | None
) -> None:
    """g expired waiting for its second member; c, naming its key meanwhile, opened g#2; the operator reopened g.
    Instances fill oldest first: d completes g, which trains, and e joins c in g#2. Without a size, g took nothing once
    g#2 opened (`groups.capacity`'s `followed`): d went to g#2, and g waited alone for a member that could never join,
    to expire again."""
    store = make_store(min_group_size=2, group_timeout_seconds=60)
    store.add_spans(trajectory(10, "a", reward=1.0, size=size))
    clock.now += 61
    assert store.lease(BatchRequest()).groups == []  # its upkeep expires g
    clock.now += 1
    store.add_spans(trajectory(20, "c", reward=0.5, size=size))
    assert store.reopen("g").previous_state == "expired"
    clock.now += 1
    store.add_spans(trajectory(30, "d", reward=0.0, size=size))
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["g"]
    store.add_spans(trajectory(40, "e", reward=0.25, size=size))
    clock.now += 61
    assert [g.id for g in store.lease(BatchRequest()).groups] == ["g#2"]

    assert [(t.id, t.group_id) for t in store.trajectories()] == [("a", "g"), ("c", "g#2"), ("d", "g"), ("e", "g#2")]
    assert {g.id: (g.state, g.size) for g in store.groups()} == {"g": ("leased", 2), "g#2": ("leased", 2)}


def test_a_new_member_after_the_timeout_finds_a_stale_instance_expired_as_a_read_would_have(make_store, clock) -> None:
    """Upkeep runs before reads: with no read since g went stale waiting for its third member, the export of c expires
    g before placing c (`placement._still_open`), and c opens g#2, as after a read; g, taking c instead, filled up and
    was leased with a member that came after its timeout. q, named without a size, is ready at 2 and stale: it waits
    for a trainer and takes the key's next trajectory."""
    store = make_store(min_group_size=2, group_timeout_seconds=100)
    store.add_spans(trajectory(10, "a", reward=1.0, size=3) + trajectory(20, "b", reward=0.0, size=3))
    store.add_spans(trajectory(40, "x", reward=1.0, group="q", size=None)
                    + trajectory(50, "y", reward=0.0, group="q", size=None))
    clock.now += 101  # no read since: nothing expired yet
    store.add_spans(trajectory(30, "c", reward=0.5, size=3) + trajectory(60, "z", reward=0.5, group="q", size=None))
    assert [(t.id, t.group_id) for t in store.trajectories()] == [
        ("a", "g"), ("b", "g"), ("x", "q"), ("y", "q"), ("c", "g#2"), ("z", "q")]
    assert {g.id: g.state for g in store.groups()} == {"g": "expired", "q": "ready", "g#2": "open"}
    assert [[t.id for t in g.trajectories] for g in store.lease(BatchRequest()).groups] == [["x", "y", "z"]]
