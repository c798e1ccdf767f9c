"""The store contract (`SqlStore`, the `Store` interface): idempotent ingest in any order, trajectory identity, reads.

Rewards, groups, leases and migrations have modules of their own: `test_store_rewards.py`, `test_store_groups.py`,
`test_leases.py`, `test_schema.py`.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from sqlalchemy import event, text

from collector import assembly, pool
from collector.config import CollectorSettings
from collector.otlp import SpanRecord
from collector.protocol import BatchRequest, ReleaseRequest, RewardIn
from collector.store import SqlStore
from tests.collector.conftest import Clock
from tests.collector.pausing import beside_a_save, lock_waited_for
from tests.collector.span_builders import TRACE, llm, rollout, rollout_group, sid, trajectory


def test_duplicate_spans_are_ignored(make_store) -> None:
    store = make_store()
    spans = trajectory(10, "r1", reward=1.0)
    assert store.add_spans(spans) == 2
    assert store.add_spans(spans + spans) == 0
    traj = store.trajectory("r1")
    assert traj is not None and traj.rewards == {"reward": 1.0}
    assert [s.token_ids for s in traj.sequences] == [[1, 2, 10]]


_A, _B = "a" * 32, "b" * 32


def _reseeded(rollout_id: str, trace: str, *, extra: bool = False) -> list[SpanRecord]:
    """A rollout of an app that reseeds its span id generator alike for every rollout: the same span ids in every
    trace (`extra`: one more turn, of an id of its own)."""
    spans = [llm(1, rollout=rollout_id, trace=trace, start=5, prompt=[1], completion=[2]),
             rollout(2, rollout_id, trace=trace, group="g", size=2, rewards={"reward": 1.0})]
    more = [llm(3, rollout=rollout_id, trace=trace, start=20, prompt=[1, 2, 4], completion=[5])]
    return spans + more if extra else spans


def test_spans_of_other_traces_with_stored_span_ids_are_stored_too(make_store) -> None:
    """OpenTelemetry span ids are unique within a trace only (a span is its trace id and span id); the store keyed
    spans by span id alone and refused a second trace's spans with ids already stored, so an app that reseeds its id
    generator alike for every rollout lost every rollout's spans but the first's."""
    store = make_store()
    assert store.add_spans(_reseeded("a", _A)) == 2
    assert store.add_spans(_reseeded("b", _B, extra=True)) == 3
    assert store.add_spans(_reseeded("a", _A) + _reseeded("b", _B, extra=True)) == 0  # retries: duplicates, ignored
    a, b = store.trajectory("a"), store.trajectory("b")
    assert a is not None and b is not None and a.complete and b.complete
    assert [s.token_ids for s in a.sequences] == [[1, 2]] and [s.token_ids for s in b.sequences] == [[1, 2, 4, 5]]
    assert (a.rewards, b.rewards) == ({"reward": 1.0}, {"reward": 1.0})


def test_one_export_of_traces_that_share_span_ids_stores_each_trace_s_spans_once(make_store) -> None:
    """The export's own duplicates were told apart by span id alone: another trace's copy of an id counted as one."""
    store = make_store()
    assert store.add_spans(_reseeded("a", _A) + _reseeded("b", _B) + _reseeded("a", _A) + _reseeded("b", _B)) == 4
    assert [(t.id, [s.token_ids for s in t.sequences]) for t in store.trajectories()] == [
        ("a", [[1, 2]]), ("b", [[1, 2]])
    ]


def test_a_copy_of_a_trace_under_another_trace_id_in_the_same_rollout_keeps_both_copies(make_store) -> None:
    """A trace replayed under a new trace id with its rollout id: both traces' spans are the rollout's, as spans of
    another trace with other ids would be, whichever arrives first (before, the copy was refused)."""
    for order in ((_A, _B), (_B, _A)):
        store = make_store()
        for trace in order:
            assert store.add_spans(_reseeded("a", trace)) == 2
        traj = store.trajectory("a")
        assert traj is not None and [s.token_ids for s in traj.sequences] == [[1, 2], [1, 2]]


def test_an_export_beside_another_trace_s_uncommitted_spans_of_its_ids_waits_for_nothing(db_url, clock) -> None:
    """On PostgreSQL the second trace's insert waited for the first export's uncommitted rows of the same span ids,
    then was refused: now the spans are other rows, and it is stored while the first export is still open."""
    url = db_url()
    if not url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: exports do not race")
    first, second = (SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(2))
    first.setup()
    inserted, resume = threading.Event(), threading.Event()

    @event.listens_for(first.engine, "after_cursor_execute")
    def pause_after_the_insert(_conn, _cursor, statement, *_args) -> None:  # noqa: ANN001
        if statement.startswith("INSERT INTO spans") and not inserted.is_set():
            inserted.set()
            assert resume.wait(30)

    with ThreadPoolExecutor(2) as executor:
        stored = executor.submit(first.add_spans, _reseeded("a", _A))
        try:
            assert inserted.wait(30)
            assert executor.submit(second.add_spans, _reseeded("b", _B)).result(timeout=30) == 2
        finally:
            resume.set()
        assert stored.result() == 2
    assert [t.id for t in second.trajectories()] == ["a", "b"]
    for store in (first, second):
        store.close()


def _reward_holding_its_group(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch, reward: RewardIn
) -> tuple[threading.Event, threading.Thread]:
    """`reward` stored in a thread, paused once it holds its group's row: set the event to go on."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: nothing runs beside a transaction")
    holding, resume = threading.Event(), threading.Event()
    rewarded = pool.rewarded

    def paused(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        if not holding.is_set():  # the first caller only: the others go on
            holding.set()
            assert resume.wait(30)
        rewarded(*args, **kwargs)

    monkeypatch.setattr(pool, "rewarded", paused)
    holder = threading.Thread(target=store.add_reward, args=(reward,))
    holder.start()
    assert holding.wait(30)
    return resume, holder


def _in_turn(store: SqlStore, resume: threading.Event, holder: threading.Thread, *work) -> list:  # noqa: ANN002
    """Start each of `work` (callables) in a thread once those before it wait for a lock, behind the paused `holder`;
    then let `holder` go on. The results of `work`, in order."""
    with ThreadPoolExecutor(len(work)) as executor:
        futures = []
        for n, job in enumerate(work, start=1):
            futures.append(executor.submit(job))
            assert lock_waited_for(store.engine, n), f"{n} transactions never waited for a lock"
        resume.set()
        holder.join(30)
        return [future.result() for future in futures]


def test_a_withdrawn_score_locks_its_groups_in_the_order_rewards_do(make_store, monkeypatch, caplog) -> None:
    """A reward for two groups waited for a, held by another reward; the withdrawal of a score of both took b (first in
    the table) and waited for a too. Once a was free, the reward took it and waited for b: PostgreSQL aborted one as a
    deadlock, retried. Both lock groups in id order."""
    store = make_store()
    a, b = f"{10:032x}", f"{20:032x}"
    store.add_spans(trajectory(20, "b1", reward=None, group="b"))
    store.add_spans(trajectory(10, "a1", reward=None, group="a"))
    for trace in (b, a):  # a's row is the last in the table
        store.add_reward(RewardIn(trace_id=trace, value=0.5), score_id="s1")
    resume, holder = _reward_holding_its_group(store, monkeypatch, RewardIn(trace_id=a, value=0.1))
    both = [RewardIn(trace_id=a, value=0.2), RewardIn(trace_id=b, value=0.3)]
    stored, withdrawn = _in_turn(
        store, resume, holder, lambda: store.add_rewards(both), lambda: store.withdraw_score("s1", None)
    )

    assert "deadlock" not in caplog.text
    assert [reward.trajectory_known for reward in stored] == [True, True] and withdrawn
    assert (store.trajectory("a1").reward, store.trajectory("b1").reward) == (0.2, 0.3)


def test_upkeep_locks_the_groups_of_expired_leases_and_idle_trajectories_in_one_order(
    make_store, clock, monkeypatch, caplog
) -> None:
    """A reward for the idle trajectory of group a and for group z, leased by an expired batch, waited for a, held by
    another reward; a read's upkeep gave z back, holding it, and waited for a to complete its idle member. Once a was
    free, the reward took it and waited for z: PostgreSQL aborted one as a deadlock, retried. Upkeep locks the groups
    it changes in id order, as a reward does."""
    store = make_store(idle_seconds=60)
    idle = f"{41:032x}"
    store.add_spans([llm(41, rollout=None, trace=idle, start=10, prompt=[1], completion=[2], task="a")])
    store.add_spans(rollout_group({"z1": 1.0, "z2": 0.0}, group="z"))
    assert [group.id for group in store.lease(BatchRequest(lease_seconds=1)).groups] == ["z"]
    clock.now += 100  # the lease expired, a's trajectory idle
    resume, holder = _reward_holding_its_group(store, monkeypatch, RewardIn(trace_id=idle, value=0.1))
    both = [RewardIn(trace_id=idle, value=0.2), RewardIn(rollout_id="z1", value=0.5)]
    stored, read = _in_turn(store, resume, holder, lambda: store.add_rewards(both), store.groups)

    assert "deadlock" not in caplog.text
    assert [reward.trajectory_known for reward in stored] == [True, True]
    assert [(group.id, group.state, group.failed_attempts) for group in read] == [("a", "open", 0), ("z", "ready", 1)]
    assert store.trajectory(idle).complete and [batch.state for batch in store.batches()] == ["expired"]


@pytest.mark.parametrize("end", ["ack", "release"])
def test_the_end_of_a_lease_locks_its_groups_in_the_order_rewards_do(make_store, clock, monkeypatch, caplog,
                                                                     end: str) -> None:
    """A reward for both groups of a batch waited for a, held by another reward; the batch's ack (or release) took b
    (first in the table) and waited for a too. Once a was free, the reward took it and waited for b: PostgreSQL aborted
    one as a deadlock, retried. Both lock groups in id order."""
    store = make_store()
    store.add_spans(trajectory(10, "b1", reward=1.0, group="b") + trajectory(20, "b2", reward=0.0, group="b"))
    clock.now += 1
    store.add_spans(trajectory(30, "a1", reward=1.0, group="a") + trajectory(40, "a2", reward=0.0, group="a"))
    batch = store.lease(BatchRequest(max_groups=2))  # b, the older, is leased first: a's row is the last in the table
    resume, holder = _reward_holding_its_group(store, monkeypatch, RewardIn(rollout_id="a1", value=0.1))
    both = [RewardIn(rollout_id="a1", value=0.2), RewardIn(rollout_id="b1", value=0.3)]
    ending = {"ack": lambda: store.ack(batch.id, 1), "release": lambda: store.release(batch.id, ReleaseRequest(
        reason="out of memory", failed=False))}[end]
    stored, ended = _in_turn(store, resume, holder, lambda: store.add_rewards(both), ending)

    assert "deadlock" not in caplog.text
    assert [reward.trajectory_known for reward in stored] == [True, True] and ended.batch_id == batch.id
    state = {"ack": "trained", "release": "ready"}[end]
    assert sorted((group.id, group.state) for group in store.groups()) == [("a", state), ("b", state)]


def _a_reward_holding_group_a_of_two(
    store: SqlStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Thread, list[RewardIn]]:
    """Groups b, then a, of one member each (b1, a1), and a reward for a1 holding a's row (`_reward_holding_its_group`):
    the event that resumes it, its thread, and rewards for both members to send while it holds a."""
    store.add_spans(trajectory(10, "b1", reward=1.0, group="b"))
    clock.now += 1
    store.add_spans(trajectory(30, "a1", reward=1.0, group="a"))
    resume, holder = _reward_holding_its_group(store, monkeypatch, RewardIn(rollout_id="a1", value=0.1))
    return resume, holder, [RewardIn(rollout_id="a1", value=0.2), RewardIn(rollout_id="b1", value=0.3)]


def test_an_export_locks_the_open_groups_of_its_keys_in_the_order_rewards_do(make_store, clock, monkeypatch,
                                                                            caplog) -> None:
    """A reward for groups a and b waited for a, held by another reward; an export of new members of both took b (the
    older) and waited for a too. Once a was free, the reward took it and waited for b: PostgreSQL aborted one as a
    deadlock, retried. Both lock groups in id order."""
    store = make_store()
    resume, holder, both = _a_reward_holding_group_a_of_two(store, clock, monkeypatch)
    members = trajectory(20, "b2", reward=0.0, group="b") + trajectory(40, "a2", reward=0.0, group="a")
    stored, added = _in_turn(store, resume, holder, lambda: store.add_rewards(both), lambda: store.add_spans(members))

    assert "deadlock" not in caplog.text
    assert [reward.trajectory_known for reward in stored] == [True, True] and added == 4
    assert sorted((group.id, group.size) for group in store.groups()) == [("a", 2), ("b", 2)]


def test_an_export_locks_the_groups_of_its_members_and_of_its_keys_in_one_pass(make_store, clock, monkeypatch,
                                                                              caplog) -> None:
    """A reward for groups a and b waited for a, held by another reward; an export of a new turn of b's member and of a
    new member of a took b (its member's group) first, then waited for a (the open group of the new member's key). Once
    a was free, the reward took it and waited for b: PostgreSQL aborted one as a deadlock, retried. An export locks
    every group it changes in one pass, in id order."""
    store = make_store()
    resume, holder, both = _a_reward_holding_group_a_of_two(store, clock, monkeypatch)
    turn = llm(12, rollout="b1", trace=f"{10:032x}", start=30, prompt=[1, 2, 10], completion=[5], logprobs=[-1.0])
    export = [turn, *trajectory(40, "a2", reward=0.0, group="a")]
    stored, added = _in_turn(store, resume, holder, lambda: store.add_rewards(both), lambda: store.add_spans(export))

    assert "deadlock" not in caplog.text
    assert [reward.trajectory_known for reward in stored] == [True, True] and added == 3
    assert sorted((group.id, group.size) for group in store.groups()) == [("a", 2), ("b", 1)]


def test_a_withdrawn_score_locks_its_trajectories_in_the_order_the_curves_steps_are_saved(make_store, caplog) -> None:
    """The save of the reward curve's policy steps (`PolicySteps.save`, in id order) held r1 and was to update r2; the
    withdrawal of a score of their trace dated them in the table's order: it took r2 (first in the table), then waited
    for r1. Once the save went on to r2, each waited for the other: PostgreSQL aborted one as a deadlock. Both lock
    trajectories in id order."""
    store = make_store()
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: nothing runs beside a transaction")
    for n, rollout_id in ((20, "r2"), (10, "r1")):  # r2's row is the first in the table
        store.add_spans([llm(n + 1, rollout=rollout_id, start=10, prompt=[1], completion=[2]),
                         rollout(n, rollout_id, group="g", size=2)])
    store.add_reward(RewardIn(trace_id=TRACE, value=0.5), score_id="s1")
    withdrawn = beside_a_save(store.engine, ["r1", "r2"], lambda: store.withdraw_score("s1", None))

    assert withdrawn and "deadlock" not in caplog.text
    assert (store.trajectory("r1").reward, store.trajectory("r2").reward) == (None, None)


def test_children_before_rollout_span(make_store) -> None:
    store = make_store()
    child, root = trajectory(10, "r1", reward=0.5)
    store.add_spans([child])
    early = store.trajectory("r1")
    assert early is not None and not early.complete and early.group_id == ""
    assert store.groups() == []
    store.add_spans([root])
    late = store.trajectory("r1")
    assert late is not None and late.complete and late.group_id == "g" and late.reward == 0.5


def test_spans_without_model_call_outside_rollouts_make_no_trajectory(make_store) -> None:
    store = make_store()
    span = llm(1, rollout=None, start=1, prompt=[1], completion=[2])
    span.attributes["art.span.kind"] = "node"
    store.add_spans([span])
    assert store.trajectories() == []


def test_filters(make_store) -> None:
    store = make_store()
    store.add_spans(trajectory(10, "a", reward=1.0, task="x")
                    + trajectory(20, "b", reward=1.0, group="h", split="val"))
    assert [t.id for t in store.trajectories(task="x")] == ["a"]
    assert [t.id for t in store.trajectories(split="val")] == ["b"]
    assert [t.id for t in store.trajectories(group="h", split="train")] == []
    assert store.trajectory("missing") is None


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


def test_an_export_plans_its_lookups_for_their_keys(make_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg prepares a statement at its fifth run, and PostgreSQL then kept a plan made for any keys, costed for the
    tables as they were: prepared while they were small, an export's lookups of its keys went on scanning every row
    once they had grown (~40 ms for 125 keys among 20,000 groups). The engine's connections force a plan for the values
    (`plan_cache_mode`), so every export plans them for its keys."""
    store = make_store()
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite prepares no plan for later values")
    generic_plans = (  # of statements with parameters: one without has no values to plan for
        "SELECT coalesce(sum(generic_plans), 0) FROM pg_prepared_statements WHERE cardinality(parameter_types) > 0"
    )
    trajectory_rows, rewarded, counts = store._trajectory_rows, pool.rewarded, []

    def first_lookup(conn, ids):  # noqa: ANN001, ANN202
        counts.append(conn.execute(text(generic_plans)).scalar())
        return trajectory_rows(conn, ids)

    def last_change(conn, *args) -> None:  # noqa: ANN001, ANN002
        counts[-1] = conn.execute(text(generic_plans)).scalar() - counts[-1]
        rewarded(conn, *args)

    monkeypatch.setattr(store, "_trajectory_rows", first_lookup)
    monkeypatch.setattr(pool, "rewarded", last_change)
    for n in range(8):  # alike: one statement each for every lookup, prepared from the fifth export on
        assert store.add_spans(trajectory(10 * n + 10, f"r{n}", reward=1.0, group=f"g{n}", size=1)) == 2

    assert counts == [0] * 8, "generic plans used by the lookups of each export"
    assert [(group.id, group.size) for group in store.groups()] == [(f"g{n}", 1) for n in range(8)]


def test_a_server_before_postgresql_12_keeps_its_own_planning(make_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL 11 and older have no `plan_cache_mode`: setting it on each new connection failed every one, so the
    collector could not start there. Such a server is left to plan as it does; the store works on it."""
    monkeypatch.setattr(psycopg.ConnectionInfo, "server_version", property(lambda _info: 110022))
    store = make_store()
    if store.engine.dialect.name != "postgresql":
        pytest.skip("plan_cache_mode is PostgreSQL's")
    with store.engine.connect() as conn:
        assert conn.execute(text("SHOW plan_cache_mode")).scalar() == "auto"
    assert store.add_spans(trajectory(10, "r1", reward=1.0, group="g", size=1)) == 2
    assert [(group.id, group.size) for group in store.groups()] == [("g", 1)]


def test_a_long_read_does_not_hold_up_ingest(make_store, db_url, monkeypatch: pytest.MonkeyPatch) -> None:
    """The web page and the Langfuse push assemble every trajectory; exports must not wait for them.

    SQLite in memory is left out: its one connection serves every thread, so reads and writes take turns there.
    """
    store = make_store()
    if str(store.engine.url) == "sqlite://":
        pytest.skip("SQLite in memory has one connection: reads and writes take turns")
    store.add_spans(trajectory(10, "r1", reward=1.0))
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
    writer = threading.Thread(target=store.add_spans, args=(trajectory(20, "r2", reward=0.0),))
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
        store.add_spans(trajectory(10 * (n + 1), rollout_id, reward=float(n), group="g" if n < 2 else "h"))
    assert [t.id for t in store.trajectories()] == ["r1", "r2", "r3", "r4"]
    assert [t.id for t in store.trajectories(newest_first=True, limit=2, offset=1)] == ["r3", "r2"]
    assert [t.id for t in store.trajectories(group="h", newest_first=True, limit=5)] == ["r4", "r3"]
    assert [t.id for t in store.trajectories(offset=3)] == ["r4"]
    assert (store.count_trajectories(), store.count_trajectories(group="g"),
            store.count_trajectories(task="none")) == (4, 2, 0)


def _read_statements(make_store, members: int) -> tuple[int, int]:
    """Statements of a lease of two groups of `members` rollouts each, and of a read of their trajectories."""
    store = make_store()
    store.add_spans([
        span
        for g in (0, 1)
        for k in range(members)
        for span in trajectory(10 * (members * g + k + 1), f"r{g}-{k}", reward=float(k), group=f"g{g}", size=members)
    ])
    sent: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda conn, cursor, statement, *_: sent.append(statement))
    batch = store.lease(BatchRequest(max_groups=2))
    leased = len(sent)
    read = store.trajectories()
    assert [len(group.trajectories) for group in batch.groups] == [members] * 2 and len(read) == 2 * members
    return leased, len(sent) - leased


def test_a_lease_or_a_read_of_more_trajectories_sends_no_more_statements(make_store) -> None:
    """Their spans are read for all trajectories at once (per chunk), not one query per trajectory."""
    assert _read_statements(make_store, 12) == _read_statements(make_store, 2)
