"""Schema and migrations (`collector/schema.py`): setup is idempotent; a database of an older version keeps its data."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from sqlalchemy import text

from art_langgraph import semconv as sc
from collector.otlp import SpanRecord
from collector.protocol import BatchRequest
from collector.schema import SCHEMA_VERSION
from tests.collector.span_builders import llm, trajectory


def test_setup_is_idempotent_and_versioned(make_store) -> None:
    store = make_store()
    store.setup()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT max(version) FROM schema_version")).scalar() == SCHEMA_VERSION
        if store.engine.dialect.name == "sqlite" and store.engine.url.database:  # file-backed SQLite
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL


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
    store.add_spans(trajectory(10, "a", reward=1.0))
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
    child, root = trajectory(10, "a", reward=None)
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 2 left it: rollout "a" in group "g", its LLM span still to come
        schema_version.create(conn)
        for version in (0, 1):
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version + 1, applied_at=0.0))
        judge_runs.create(conn)  # collectors before version 3 made the judges' tables on start
        conn.execute(text("ALTER TABLE judge_runs DROP COLUMN max_tokens"))  # as they had it: version 10 adds it
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
        assert conn.execute(text("SELECT max(version) FROM schema_version")).scalar() == SCHEMA_VERSION
        assert conn.execute(text("SELECT failed_attempts FROM groups WHERE id = 't'")).scalar() == 0
    [shown] = store.batches()
    assert (shown.id, shown.state, shown.policy_step, shown.groups, shown.reason) == ("old", "acked", 7, ["t"], None)
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))  # groups made after it
    batch = store.lease(BatchRequest())
    assert store.release(batch.id, ReleaseRequest(reason="RuntimeError: x")).returned == ["g"]
    assert {g.id: g.failed_attempts for g in store.groups()} == {"g": 1}  # "t" has no trajectory: not listed
    store.close()


def test_the_switch_to_wal_waits_for_another_connections_write(tmp_path) -> None:
    """SQLite answers `database is locked` to `PRAGMA journal_mode=WAL` at once, without its busy timeout, while another
    connection writes: a replica started beside another that was still migrating the same new file failed its start
    (1 of 60 four-replica starts). The switch waits for the write."""
    import sqlite3
    import threading

    from collector.engine import make_engine, use_wal

    path = tmp_path / "collector.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE t (x)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO t VALUES (1)")
    commit = threading.Timer(0.5, lambda: writer.execute("COMMIT"))
    commit.start()
    engine = make_engine(f"sqlite:///{path}")
    try:
        use_wal(engine)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        commit.join()
        writer.close()
        engine.dispose()


def test_collectors_starting_at_once_migrate_a_new_database_once(db_url, clock) -> None:
    """Replicas set up at the same moment on one empty database: each migration is applied once, none fails."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from collector.config import CollectorSettings
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database cannot be shared by two stores")
    stores = [SqlStore(CollectorSettings(db=url), clock=clock) for _ in range(4)]
    start = threading.Barrier(len(stores))

    def setup(store: SqlStore) -> None:
        start.wait()
        store.setup()

    with ThreadPoolExecutor(len(stores)) as pool:
        list(pool.map(setup, stores))  # re-raises a replica's failure
    with stores[0].engine.connect() as conn:
        assert ([r[0] for r in conn.execute(text("SELECT version FROM schema_version ORDER BY version"))]
                == list(range(1, SCHEMA_VERSION + 1)))
    for store in stores:
        store.close()


def test_a_database_with_another_applications_table_is_refused_and_left_as_it_was(db_url, clock) -> None:
    """A table of the same name was kept as it was (`create_all` checks first), then altered by version 2: the
    collector added columns to another application's `rewards` and started, answering 503 to every reward."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import DatabaseError

    from collector.config import CollectorSettings
    from collector.store import SqlStore

    store = SqlStore(CollectorSettings(db=db_url()), clock=clock)
    with store.engine.begin() as conn:
        conn.execute(text("CREATE TABLE rewards (who VARCHAR(20), amount INTEGER)"))
        conn.execute(text("INSERT INTO rewards VALUES ('ann', 3)"))
    with pytest.raises(DatabaseError, match="rewards"):
        store.setup()
    tables = inspect(store.engine)
    assert tables.get_table_names() == ["rewards"]  # not even `schema_version`: the migration is rolled back
    assert [c["name"] for c in tables.get_columns("rewards")] == ["who", "amount"]
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT who, amount FROM rewards")).all() == [("ann", 3)]
    store.close()


def test_migration_from_version_6_keeps_batches_and_takes_idempotency_keys(db_url, clock) -> None:
    """Version 7 adds `batches.idempotency_key`, unique: a lease stored before it has none, and keyed leases work."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import IntegrityError

    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.schema import MIGRATIONS, schema_version
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 6 left it, with a batch leased then
        schema_version.create(conn)
        for version in range(6):
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version + 1, applied_at=0.0))
        conn.execute(text("INSERT INTO batches (id, trainer, state, created_at, lease_expires_at) "
                          "VALUES ('old', 't', 'expired', 1.0, 2.0)"))
    assert "idempotency_key" not in {c["name"] for c in inspect(old).get_columns("batches")}
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT idempotency_key FROM batches WHERE id = 'old'")).one() == (None,)
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    batch = store.lease(BatchRequest(idempotency_key="k1"))
    assert store.lease(BatchRequest(idempotency_key="k1")).id == batch.id
    with pytest.raises(IntegrityError), store.engine.begin() as conn:  # one batch per key, whatever the code does
        conn.execute(text("UPDATE batches SET idempotency_key = 'k1' WHERE id = 'old'"))
    store.close()


def test_migration_from_version_7_keeps_leased_batches_and_their_acks(db_url, clock) -> None:
    """Version 8 adds the lease request's bounds and each group's members to `batches`: a batch leased before it has
    none, and its ack (on time, or late with its group unchanged) still works; a lease after it records them."""
    import json

    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.schema import MIGRATIONS, schema_version
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 7 left it: groups g (on time) and h (late) leased, 2 members
        schema_version.create(conn)
        for version in range(7):
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version + 1, applied_at=0.0))
        for batch, group, expires in (("on-time", "g", 1000100.0), ("late", "h", 999990.0)):
            conn.execute(text("INSERT INTO batches (id, trainer, state, created_at, lease_expires_at, idempotency_key) "
                              f"VALUES ('{batch}', 't', 'leased', 999980.0, {expires}, 'k-{batch}')"))
            conn.execute(text("INSERT INTO groups (id, key, task, explicit, size_hint, state, reason, batch_id, "
                              f"created_at, updated_at) VALUES ('{group}', '{group}', NULL, TRUE, 2, 'leased', NULL, "
                              f"'{batch}', 999970.0, 999980.0)"))
            conn.execute(text(f"INSERT INTO batch_groups (batch_id, group_id) VALUES ('{batch}', '{group}')"))
            for i, reward in enumerate((1.0, 0.0)):
                conn.execute(text("INSERT INTO trajectories (id, trace_id, by_rollout, group_key, group_id, task, "
                                  f"split, complete, created_at, updated_at) VALUES ('{group}{i}', '{i:032x}', TRUE, "
                                  f"'{group}', '{group}', NULL, 'train', TRUE, 999970.0, 999970.0)"))
                conn.execute(text("INSERT INTO rewards (rollout_id, name, value, source, created_at) "
                                  f"VALUES ('{group}{i}', 'reward', {reward}, 'api', 999970.0)"))
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT max_groups, min_groups, members FROM batches")).all() == [(None,) * 3] * 2
    assert store.ack("on-time", policy_step=1).groups == ["g"]
    assert store.ack("late", policy_step=2).groups == ["h"]  # expired (by the ack above), unchanged since
    assert {b.id: b.state for b in store.batches()} == {"on-time": "acked", "late": "acked"}
    assert {g.id: g.state for g in store.groups()} == {"g": "trained", "h": "trained"}
    store.add_spans(trajectory(10, "a", reward=1.0) + trajectory(20, "b", reward=0.0))
    batch = store.lease(BatchRequest(max_groups=4))
    with store.engine.connect() as conn:
        stored = conn.execute(text(f"SELECT max_groups, min_groups, members FROM batches WHERE id = '{batch.id}'"))
        max_groups, min_groups, members = stored.one()
    assert (max_groups, min_groups, json.loads(members)) == (4, 1, {"g#2": ["a", "b"]})
    store.close()


def test_migration_from_version_8_marks_orphaned_pushes_and_rewrites_score_versions(db_url, clock) -> None:
    """Version 9 marks the scores to delete in Langfuse (`langfuse_pushed.retract_at`): those pushed for trajectories
    deleted before it are marked, or they stayed there for good. It rewrites the pulled score versions as
    `score_version` does: one stored at another UTC offset compared as text out of time order (an edit an hour later
    sorted before it, never applied; an older version after it, applied over it), and one of a whole second without
    `.000000` before the same version rewritten (applied again)."""
    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.schema import MIGRATIONS, schema_version
    from collector.scoring_store import ScoringStore
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 8 left it: "gone" was deleted after its score was pushed
        schema_version.create(conn)
        for version in range(8):
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version + 1, applied_at=0.0))
        conn.execute(text("INSERT INTO trajectories (id, trace_id, by_rollout, group_key, group_id, task, split, "
                          f"complete, created_at, updated_at) VALUES ('kept', '{1:032x}', TRUE, 'g', 'g', NULL, "
                          "'train', TRUE, 1.0, 1.0)"))
        for trajectory_id in ("kept", "gone"):
            conn.execute(text("INSERT INTO langfuse_pushed (trajectory_id, name, value, score_id, pushed_at) "
                              f"VALUES ('{trajectory_id}', 'ruler', 0.5, 'score-{trajectory_id}', 1.0)"))
        for score_id, updated_at in (
            ("offset", "2026-01-01T11:00:00+02:00"), ("behind", "2026-01-01T08:00:00-01:00"),
            ("whole", "2026-01-01T09:00:00+00:00"), ("new", "2026-01-01T09:00:00.500000+00:00"),
        ):
            conn.execute(text("INSERT INTO langfuse_pulled (score_id, updated_at, trace_id, name, value, pulled_at) "
                              f"VALUES ('{score_id}', '{updated_at}', '{1:032x}', 'human', 0.5, 1.0)"))
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    scoring = ScoringStore(store.engine)
    assert [(row["trajectory_id"], row["score_id"]) for row in scoring.to_retract()] == [("gone", "score-gone")]
    assert scoring.pulled_versions(["offset", "behind", "whole", "new"]) == {
        "offset": "2026-01-01T09:00:00.000000+00:00", "behind": "2026-01-01T09:00:00.000000+00:00",
        "whole": "2026-01-01T09:00:00.000000+00:00", "new": "2026-01-01T09:00:00.500000+00:00",
    }
    pulled = [  # an edit an hour later claims its score; an older version, and the same one, claim none
        {"score_id": score_id, "updated_at": f"2026-01-01T{at}.000000+00:00", "trace_id": f"{1:032x}", "name": "human",
         "value": 0.1, "pulled_at": 2.0}
        for score_id, at in (("offset", "10:00:00"), ("behind", "08:30:00"), ("whole", "09:00:00"))
    ]
    with store.engine.begin() as conn:
        assert ScoringStore.mark_pulled(conn, pulled) == {"offset"}
    store.close()


def test_migration_from_version_9_keeps_judge_runs_with_max_tokens_unknown(db_url, clock) -> None:
    """Version 10 records each judge run's `max_tokens` (`judge_runs.max_tokens`); the runs before it keep theirs
    unknown (NULL), and a new run records its own."""
    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.schema import MIGRATIONS, schema_version
    from collector.scoring_store import ScoringStore
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    old = make_engine(url)
    with old.begin() as conn:  # a database as version 9 left it, with a run the judge cut at max_tokens
        schema_version.create(conn)
        for version in range(9):
            MIGRATIONS[version](conn)
            conn.execute(schema_version.insert().values(version=version + 1, applied_at=0.0))
        conn.execute(text("INSERT INTO judge_runs (group_id, state, attempts, error, model, trajectories, "
                          "distinct_count, started_at, finished_at) VALUES ('g', 'failed', 1, 'judge_truncated: cut', "
                          "'judge', 2, 2, 1.0, 2.0)"))
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    scoring = ScoringStore(store.engine)
    assert scoring.run("g") == {"group_id": "g", "state": "failed", "attempts": 1, "error": "judge_truncated: cut",
                                "model": "judge", "trajectories": 2, "distinct_count": 2, "started_at": 1.0,
                                "finished_at": 2.0, "next_try_at": None, "max_tokens": None}
    run = {**scoring.run("g"), "group_id": "h", "max_tokens": 64}
    assert scoring.claim_run(run, stale_before=0.0) and scoring.run("h")["max_tokens"] == 64
    store.close()


def _database_at(url: str, version: int) -> list[SpanRecord]:
    """Make the database at `url` as collector schema `version` left it, with trajectory "a" of two spans (returned),
    through the real migrations up to it."""
    import json

    from collector.engine import make_engine
    from collector.schema import MIGRATIONS, schema_version, spans, trajectories

    stored = trajectory(10, "a", reward=None)
    old = make_engine(url)
    with old.begin() as conn:
        schema_version.create(conn)
        for step in range(version):
            MIGRATIONS[step](conn)
            conn.execute(schema_version.insert().values(version=step + 1, applied_at=0.0))
        for record in stored:
            conn.execute(spans.insert().values(
                span_id=record.span_id, trace_id=record.trace_id, trajectory_id="a", name=record.name,
                start_ns=record.start_ns, end_ns=record.end_ns, record=json.dumps(record.to_dict()), received_at=0.0,
            ))
        conn.execute(trajectories.insert().values(
            id="a", trace_id=stored[0].trace_id, by_rollout=True, group_key="g", group_id="g", task=None,
            split="train", complete=True, created_at=0.0, updated_at=0.0,
        ))
    old.dispose()
    return stored


def test_migration_from_version_10_steps_the_stored_trajectories_on_the_next_curve_read(db_url, clock) -> None:
    """Version 11 stores each trajectory's policy step in its row (`trajectories.policy_step`, computed from
    `policy_step_spans` spans); the trajectories stored before it have none, and the next curve read computes and
    stores theirs."""
    from sqlalchemy import select

    from collector.config import CollectorSettings
    from collector.schema import trajectories
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    _database_at(url, 10)
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    stored = select(trajectories.c.policy_step, trajectories.c.policy_step_spans)
    with store.engine.connect() as conn:
        assert conn.execute(stored).all() == [(None, None)]
    assert [facts.policy_step for facts in store.curve_facts()] == [0]
    with store.engine.connect() as conn:
        assert conn.execute(stored).all() == [(0, 2)]
    store.close()


def test_migration_from_version_11_keys_spans_by_trace_and_span_id(db_url, clock) -> None:
    """Version 12 keys spans by (trace id, span id), the index of `trace_id` dropped (the key serves it): the spans
    stored before it keep their trajectories, an exporter's retry of them is still ignored, and another trace's span of
    a stored id is stored (before, it was refused)."""
    from sqlalchemy import inspect

    from collector.config import CollectorSettings
    from collector.engine import make_engine
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    stored = _database_at(url, 11)
    old = make_engine(url)
    assert inspect(old).get_pk_constraint("spans")["constrained_columns"] == ["span_id"]
    old.dispose()
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    found = inspect(store.engine)
    assert found.get_pk_constraint("spans")["constrained_columns"] == ["trace_id", "span_id"]
    # no index of `trace_id` alone (version 13 replaced the one of `trajectory_id`)
    assert [index["name"] for index in found.get_indexes("spans")] == ["ix_spans_trajectory_id_trace_id"]
    assert store.add_spans(stored) == 0  # a retry of the stored spans
    copy = [dataclasses.replace(record, trace_id="f" * 32, attributes={**record.attributes, sc.ROLLOUT_ID: "b"})
            for record in stored]
    assert store.add_spans(copy) == 2
    assert [[s.token_ids for s in store.trajectory(t).sequences] for t in ("a", "b")] == [[[1, 2, 10]], [[1, 2, 10]]]
    store.close()


def _indexes(url: str, table: str) -> list[tuple[str, list[str]]]:
    """Name and columns of each index of `table` (its key aside) in the database at `url`."""
    from sqlalchemy import inspect

    from collector.engine import make_engine

    engine = make_engine(url)
    try:
        return sorted((index["name"], index["column_names"]) for index in inspect(engine).get_indexes(table))
    finally:
        engine.dispose()


def _started_again_and_fresh(url: str, fresh_url: str, clock, versions: list, table: str, indexes: list) -> None:
    """A second start on the migrated database at `url` applies nothing (its `schema_version` rows stay `versions`)
    and leaves the `indexes` of `table`; a new database at `fresh_url` gets the same indexes."""
    from collector.config import CollectorSettings
    from collector.schema import migrate
    from collector.store import SqlStore

    again = SqlStore(CollectorSettings(db=url), clock=clock)
    assert migrate(again.engine) == SCHEMA_VERSION  # a second start: nothing to apply
    with again.engine.connect() as conn:
        assert conn.execute(text("SELECT version, applied_at FROM schema_version ORDER BY version")).all() == versions
    again.close()
    assert _indexes(url, table) == indexes
    fresh = SqlStore(CollectorSettings(db=fresh_url), clock=clock)
    fresh.setup()
    assert _indexes(fresh.engine.url.render_as_string(hide_password=False), table) == indexes
    fresh.close()


def test_migration_from_version_12_indexes_the_traces_of_each_trajectory(db_url, clock) -> None:
    """Version 13 replaces the index of `spans.trajectory_id` by one of (trajectory_id, trace_id), which covers the
    read of the traces a trajectory holds (`pool.rewards_of` in upkeep: every span row was read): the stored spans keep
    their trajectory, a reward by trace id still reaches it, a second start changes nothing, and a new database gets
    the same indexes."""
    from sqlalchemy import select

    from collector import pool
    from collector.config import CollectorSettings
    from collector.protocol import RewardIn
    from collector.schema import trajectories
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    stored = _database_at(url, 12)
    assert _indexes(url, "spans") == [("ix_spans_trajectory_id", ["trajectory_id"])]
    store = SqlStore(CollectorSettings(db=url), clock=clock)
    store.setup()
    migrated = [("ix_spans_trajectory_id_trace_id", ["trajectory_id", "trace_id"])]
    assert _indexes(url, "spans") == migrated
    with store.engine.connect() as conn:
        if conn.dialect.name == "sqlite":  # the lookup reads the index alone
            plan = conn.execute(text("EXPLAIN QUERY PLAN SELECT DISTINCT trajectory_id, trace_id FROM spans "
                                     "WHERE trajectory_id IN ('a', 'b')")).all()
            assert "USING COVERING INDEX ix_spans_trajectory_id_trace_id" in " ".join(row[-1] for row in plan)
        versions = conn.execute(text("SELECT version, applied_at FROM schema_version ORDER BY version")).all()
    assert [version for version, _ in versions] == list(range(1, SCHEMA_VERSION + 1))
    store.add_rewards([RewardIn(trace_id=stored[0].trace_id, name="judge", value=0.5)])
    with store.engine.connect() as conn:
        rows = list(conn.execute(select(trajectories)).mappings())
        assert pool.rewards_of(conn, rows) == {"a": {"judge": 0.5}}
    assert store.trajectory("a").rewards == {"judge": 0.5}
    store.close()
    _started_again_and_fresh(url, db_url(), clock, versions, "spans", migrated)


def test_migration_from_version_13_indexes_the_idle_trajectories(db_url, clock) -> None:
    """Version 14 adds the index of `trajectories (complete, by_rollout, updated_at)`, from which upkeep before every
    read finds the idle trajectories outside rollouts (`pool._idle`): it read every trajectory row (100,000 of them:
    8 to 16 ms a read here, on either backend). The stored trajectories keep their groups, a call outside
    rollouts still completes when idle, a second start changes nothing, and a new database gets the same indexes."""
    from sqlalchemy import select

    from collector import pool
    from collector.config import CollectorSettings
    from collector.schema import trajectories
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    _database_at(url, 13)
    before = [("ix_trajectories_group_id", ["group_id"]), ("ix_trajectories_task", ["task"]),
              ("ix_trajectories_trace_id", ["trace_id"])]
    assert _indexes(url, "trajectories") == before
    store = SqlStore(CollectorSettings(db=url, idle_seconds=60), clock=clock)
    store.setup()
    migrated = sorted([*before, ("ix_trajectories_complete_by_rollout_updated_at",
                                 ["complete", "by_rollout", "updated_at"])])
    assert _indexes(url, "trajectories") == migrated
    with store.engine.connect() as conn:
        if conn.dialect.name == "sqlite":  # the read of idle trajectories searches the index, no longer every row;
            # a lookup by id and `by_rollout` (an export's) still takes the key, not every rollout's row in the index
            idle = select(trajectories.c.id, trajectories.c.group_id).where(pool._idle(store.settings, clock.now))
            by_id = select(trajectories.c.id).where(trajectories.c.id.in_(["a", "b"]),
                                                    trajectories.c.by_rollout.is_(True))
            plans = [
                " ".join(row[-1] for row in conn.execute(text(
                    f"EXPLAIN QUERY PLAN {query.compile(conn, compile_kwargs={'literal_binds': True})}"
                )))
                for query in (idle, by_id)
            ]
            assert "SEARCH trajectories USING INDEX ix_trajectories_complete_by_rollout_updated_at" in plans[0]
            assert "sqlite_autoindex_trajectories_1" in plans[1]
        versions = conn.execute(text("SELECT version, applied_at FROM schema_version ORDER BY version")).all()
    assert [version for version, _ in versions] == list(range(1, SCHEMA_VERSION + 1))
    store.add_spans([llm(n, rollout=None, trace=f"{n:032x}", task="t", start=1, prompt=[1], completion=[n])
                     for n in (30, 40)])
    assert [(t.id, t.group_id, t.complete) for t in store.trajectories()] == [
        ("a", "g", True), (f"{30:032x}", "t", False), (f"{40:032x}", "t", False)]
    clock.now += 61
    assert [(t.id, t.complete) for t in store.trajectories(task="t")] == [(f"{30:032x}", True), (f"{40:032x}", True)]
    store.close()
    _started_again_and_fresh(url, db_url(), clock, versions, "trajectories", migrated)


def test_migration_from_version_14_keys_uuid_rollout_ids_by_their_hex_digits(db_url, clock) -> None:
    """Version 15 rewrites each rollout id stored as a UUID's text in another form (dashes, braces, `urn:uuid:`, upper
    case) as its 32 lower-case hex digits, as spans and rewards are keyed from then on: before, a reward by the hex
    digits (which `art_langgraph.reward` sends) never reached a trajectory whose spans wrote dashes. A collector of
    version 14 stored this database (ids as written). Its spans, rewards (a reward waiting for its spans too), the
    group keyed by such an id, a lease, judgements and pushed scores follow the new ids; two trajectories of one UUID
    in two forms merge (spans, digest, the first one's group; their judgements dropped to judge afresh, the second
    pushed score marked to delete); other ids stay as written; a second start changes nothing."""
    from collector import assembly, schema
    from collector import store as store_module
    from collector.config import CollectorSettings
    from collector.protocol import RewardIn
    from collector.scoring_store import ScoringStore
    from collector.store import SqlStore

    url = db_url()
    if url == "sqlite://":
        pytest.skip("an in-memory SQLite database does not outlive its engine")
    a, b = "123e4567-e89b-12d3-a456-426614174000", "A0B1C2D3-E4F5-4607-8819-2A3B4C5D6E7F"
    m, early = "9f8e7d6c-5b4a-4392-8170-fedcba987654", "0c1d2e3f-4a5b-4c6d-8e7f-0a1b2c3d4e5f"
    a_key, b_key, m_key, early_key = (uuid.UUID(value).hex for value in (a, b, m, early))
    braced = "{" + m + "}"
    settings = CollectorSettings(db=url, min_group_size=1, keep_zero_spread=True)
    ungrouped = {"group": None, "size": None}
    with pytest.MonkeyPatch.context() as version_14:  # the collector before version 15 kept every id as written
        version_14.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:14])
        version_14.setattr(schema, "SCHEMA_VERSION", 14)
        for module in (assembly, store_module):
            version_14.setattr(module, "rollout_key", lambda rollout_id: rollout_id, raising=False)
        store = SqlStore(settings, clock=clock)
        store.setup()
        store.add_spans(trajectory(10, a, reward=1.0, group="t") + trajectory(20, "r1", reward=0.0, group="t"))
        store.add_spans(trajectory(30, b, reward=0.5, **ungrouped))  # in the group keyed by its id
        store.add_rewards([RewardIn(rollout_id=a, name="api", value=0.3),  # the exact id, as README said to send
                           RewardIn(rollout_id="urn:uuid:" + early, name="early", value=0.4)])  # before its spans
        batch = store.lease(BatchRequest(max_groups=4))
        assert sorted(group.id for group in batch.groups) == sorted(["t", b])
        clock.now += 1
        store.add_spans(trajectory(40, braced, reward=0.2, **ungrouped))  # one UUID in two forms
        clock.now += 1
        store.add_spans(trajectory(50, m_key, reward=None, **ungrouped))
        scoring = ScoringStore(store.engine)
        judged = {"score": 0.5, "explanation": "fine", "block": 1, "created_at": 1.0}
        scoring.save_judgements("ruler", "t", [{**judged, "trajectory_id": a, "duplicate_of": None},
                                               {**judged, "trajectory_id": "r1", "duplicate_of": a}])
        scoring.save_judgements("ruler", braced, [{**judged, "trajectory_id": braced, "duplicate_of": None}])
        for group_id in ("t", braced):
            assert scoring.claim_run({"group_id": group_id, "state": "ok", "attempts": 1, "error": None, "model": "j",
                                      "trajectories": 1, "distinct_count": 1, "started_at": 1.0, "finished_at": 2.0,
                                      "next_try_at": None, "max_tokens": None}, stale_before=0.0)
        created = {row["id"]: row["created_at"] for row in scoring.read(ScoringStore.trajectory_rows)}
        scoring.mark_pushed([{"trajectory_id": tid, "name": "reward", "value": 0.5, "score_id": f"s-{tid}",
                              "pushed_at": 1.0, "created_at": created[tid]} for tid in (a, braced, m_key)], 0.0)
        assert sorted(t.id for t in store.trajectories()) == sorted([a, b, braced, m_key, "r1"])
        store.close()
    store = SqlStore(settings, clock=clock)
    store.setup()
    with store.engine.connect() as conn:
        versions = conn.execute(text("SELECT version, applied_at FROM schema_version ORDER BY version")).all()
        assert [version for version, _ in versions] == list(range(1, SCHEMA_VERSION + 1))
        assert sorted(conn.execute(text("SELECT DISTINCT trajectory_id FROM spans")).scalars()) == sorted(
            [a_key, b_key, m_key, "r1"])
        assert sorted(set(conn.execute(text("SELECT rollout_id FROM rewards")).scalars())) == sorted(
            [a_key, b_key, m_key, early_key, "r1"])
        assert sorted(conn.execute(text("SELECT id, key FROM groups")).all()) == sorted(
            [("t", "t"), (b_key, b_key), (m_key, m_key), (f"{m_key}#2", m_key)])  # the first of m's took its id
    assert sorted((t.id, t.group_id) for t in store.trajectories()) == sorted(
        [(a_key, "t"), ("r1", "t"), (b_key, b_key), (m_key, f"{m_key}#2")])
    merged = store.trajectory(m_key)
    assert sorted(s.token_ids for s in merged.sequences) == [[1, 2, 40], [1, 2, 50]]
    assert merged.rewards == {"reward": 0.2}
    rows = {row["id"]: row for row in scoring.read(ScoringStore.trajectory_rows)}
    assert rows[m_key]["created_at"] == created[braced] and rows[a_key]["created_at"] == created[a]
    assert store.ack(batch.id, 1).groups == sorted(["t", b_key])  # the lease taken before holds them as they were
    assert store.trajectory(a).rewards == {"reward": 1.0, "api": 0.3}
    assert store.add_reward(RewardIn(rollout_id=a_key, name="plugin", value=0.9)).trajectory_known
    assert store.trajectory(b).id == b_key
    assert {(row["trajectory_id"], row["duplicate_of"]) for row in scoring.judgements([a_key, "r1", m_key])[a_key]
            + scoring.judgements(["r1"])["r1"]} == {(a_key, None), ("r1", a_key)}
    assert scoring.judgements([m_key]) == {m_key: []} and set(scoring.runs()) == {"t"}
    pushed = scoring.read(ScoringStore.pushed_in)
    assert {key: record.score_id for key, record in pushed.items()} == {
        (a_key, "reward"): f"s-{a}", (m_key, "reward"): f"s-{m_key}"}
    assert [(row["trajectory_id"], row["score_id"]) for row in scoring.to_retract()] == [(braced, f"s-{braced}")]
    store.add_spans([llm(61, rollout=b, trace=f"{30:032x}", start=20, prompt=[1, 2, 30], completion=[7])])
    assert store.trajectory(b_key).group_id == b_key  # its group key is its id still: a later span leaves it there
    store.add_spans(trajectory(70, early, reward=None, group="u"))
    assert store.trajectory(early_key).rewards == {"early": 0.4}
    store.close()
    _started_again_and_fresh(url, db_url(), clock, versions, "rewards", _indexes(url, "rewards"))
