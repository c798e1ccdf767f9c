"""Database schema of the collector (SQLAlchemy Core) and its versioned migrations.

The SQL is portable (SQLite and PostgreSQL). `MIGRATIONS[i]` moves the schema from version `i`
to `i + 1`; `migrate` applies the ones a database has not seen yet, each in its own
transaction, and records the version reached in `schema_version`.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    bindparam,
    exists,
    func,
    select,
    text,
)

from collector.assembly import FactsDigest
from collector.engine import chunks
from collector.otlp import SpanRecord
from collector.spans import rollout_key

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "SchemaTooNew",
    "batch_groups",
    "batches",
    "groups",
    "judge_runs",
    "judgements",
    "langfuse_pulled",
    "langfuse_pushed",
    "migrate",
    "rewards",
    "score_version",
    "spans",
    "trajectories",
]

metadata = MetaData()

schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("applied_at", Float, nullable=False),
)

spans = Table(
    "spans",
    metadata,
    # version 12: keyed by trace id and span id, as OpenTelemetry identifies a span (its id is unique within its trace
    # only); idempotent on exporter retries, which send both again. The key leads with the trace id, so version 12
    # dropped the index of `trace_id` alone
    Column("span_id", String(16), nullable=False),
    Column("trace_id", String(32), nullable=False),
    # rollout id (version 15: a UUID's text in any form as its 32 hex digits, `spans.rollout_key`), else trace id
    Column("trajectory_id", String(256), nullable=False),
    Column("name", Text, nullable=False),
    Column("start_ns", BigInteger, nullable=False),
    Column("end_ns", BigInteger, nullable=False),
    Column("record", Text, nullable=False),  # JSON of otlp.SpanRecord
    Column("received_at", Float, nullable=False),
    PrimaryKeyConstraint("trace_id", "span_id"),
    # version 13: the traces each trajectory holds are read from this index alone (`pool.rewards_of`), not from every
    # span row; it replaced the index of `trajectory_id` alone, whose lookups it serves
    Index("ix_spans_trajectory_id_trace_id", "trajectory_id", "trace_id"),
)

trajectories = Table(
    "trajectories",
    metadata,
    Column("id", String(256), primary_key=True),
    Column("trace_id", String(32), nullable=False, index=True),
    Column("by_rollout", Boolean, nullable=False),  # keyed by art.rollout.id (else by trace id)
    Column("group_key", String(256)),  # art.group, else task, else id; None until known
    Column("group_id", String(300), index=True),  # the group instance it was placed in
    Column("task", String(256), index=True),
    Column("split", String(64), nullable=False),
    Column("complete", Boolean, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    # version 4: JSON of `assembly.FactsDigest` of the spans stored so far, so that an export
    # updates the trajectory from its own spans without reading back the earlier ones
    Column("digest", Text),
    # version 11: the policy step of its spans (`curve.step_of`) and how many spans it was computed from (its spans
    # are only ever added while it exists), so that the reward curve after a start reads them instead of the spans
    Column("policy_step", Integer),
    Column("policy_step_spans", Integer),
    # version 14: upkeep finds the idle trajectories outside rollouts (`pool._idle`) in this index, not in every row;
    # led by `complete`, which no other read filters by (led by `by_rollout`, SQLite chose it over the key for the
    # export's lookups by id and `by_rollout`, and read the row of every rollout)
    Index("ix_trajectories_complete_by_rollout_updated_at", "complete", "by_rollout", "updated_at"),
)

rewards = Table(
    "rewards",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("rollout_id", String(256), index=True),
    Column("trace_id", String(32), index=True),
    Column("name", String(256), nullable=False),
    Column("value", Float, nullable=False),
    Column("source", String(32), nullable=False),  # "span" or "api"; api overrides span
    Column("created_at", Float, nullable=False),
    # version 2: the span a reward came from and its time there (orders span rewards by trace
    # time, not by arrival, so assembly does not depend on the order spans arrive in)
    Column("span_id", String(16)),
    Column("time_ns", BigInteger),
    # version 6: the Langfuse score a reward came from (a score deleted there takes its reward back)
    Column("score_id", String(256), index=True),
)

groups = Table(
    "groups",
    metadata,
    Column("id", String(300), primary_key=True),  # key, then key#2, key#3 ... for later instances
    Column("key", String(256), nullable=False, index=True),
    Column("task", String(256)),
    Column("explicit", Boolean, nullable=False),  # the key came from art.group
    Column("size_hint", Integer),  # art.group.size, when known
    Column("state", String(16), nullable=False, index=True),  # open / leased / trained / skipped / expired
    Column("reason", Text),
    # the batch that holds (leased), trained (trained) or gave up on (skipped after failed trainings) the group
    Column("batch_id", String(64)),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    # version 5: failed trainings of the group (a release as failed, or an expired lease)
    Column("failed_attempts", Integer, nullable=False, server_default="0"),
)

batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("trainer", String(256)),
    Column("state", String(16), nullable=False, index=True),  # leased / acked / expired / released
    Column("created_at", Float, nullable=False),
    Column("lease_expires_at", Float, nullable=False),
    Column("acked_at", Float),
    Column("policy_step", Integer),
    # version 5: why the lease ended without an ack (the trainer's error when released, or "lease expired")
    Column("reason", Text),
    # version 7: the `Idempotency-Key` of the lease request, when it sent one: its retry gets this batch again
    Column("idempotency_key", String(256), index=True, unique=True),
    # version 8: the lease request's bounds (a retry with its key must send the same) and the members of each group
    # when leased, JSON `{group_id: [trajectory ids, sorted]}` (a late ack compares them with the members now);
    # leases before it have none
    Column("max_groups", Integer),
    Column("min_groups", Integer),
    Column("members", Text),
)

batch_groups = Table(
    "batch_groups",
    metadata,
    Column("batch_id", String(64), ForeignKey("batches.id"), primary_key=True),
    Column("group_id", String(300), ForeignKey("groups.id"), primary_key=True),
)

# --- the judges' tables (version 3; read and written by `collector.scoring_store`) ---------
judge_runs = Table(
    "judge_runs",
    metadata,
    Column("group_id", String(300), primary_key=True),
    Column("state", String(16), nullable=False),  # running / ok / failed / skipped / zeroed
    Column("attempts", Integer, nullable=False),
    Column("error", Text),
    Column("model", String(256), nullable=False),
    Column("trajectories", Integer, nullable=False),
    Column("distinct_count", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("next_try_at", Float),  # `failed` under the retry policy: when to try again
    Column("max_tokens", Integer),  # the judge's `max_tokens` in the run (version 10); None: before it, unknown
)

judgements = Table(
    "judgements",
    metadata,
    Column("trajectory_id", String(256), primary_key=True),
    Column("name", String(256), primary_key=True),  # the reward name the judge wrote
    Column("group_id", String(300), nullable=False, index=True),
    Column("score", Float, nullable=False),
    Column("explanation", Text, nullable=False),
    Column("block", Integer),  # number of the trajectory block in the prompt; None when zeroed
    Column("duplicate_of", String(256)),  # judged once as this identical trajectory
    Column("created_at", Float, nullable=False),
)

langfuse_pulled = Table(
    "langfuse_pulled",
    metadata,
    Column("score_id", String(256), primary_key=True),
    Column("updated_at", String(64), nullable=False),
    Column("trace_id", String(64), nullable=False),
    Column("name", String(256), nullable=False),
    Column("value", Float, nullable=False),
    Column("pulled_at", Float, nullable=False),
)

langfuse_pushed = Table(
    "langfuse_pushed",
    metadata,
    Column("trajectory_id", String(256), primary_key=True),
    Column("name", String(256), primary_key=True),
    Column("value", Float, nullable=False),
    Column("score_id", String(64), nullable=False),
    Column("pushed_at", Float, nullable=False),
    # version 9: when the trajectory was deleted (`ScoringStore.retract_pushed`): the score is to be deleted in Langfuse
    Column("retract_at", Float, index=True),
)


def score_version(updated_at: dt.datetime) -> str:
    """A Langfuse score's `updatedAt` as stored in `langfuse_pulled.updated_at`: ISO 8601 in UTC with microseconds
    (`2026-01-01T09:00:00.500000+00:00`), whose string order is time order whatever offset and precision Langfuse
    wrote (version 9 rewrote the versions stored before in this form). A time without an offset is UTC, as Langfuse's
    times are."""
    utc = updated_at.replace(tzinfo=dt.UTC) if updated_at.tzinfo is None else updated_at.astimezone(dt.UTC)
    return utc.isoformat(timespec="microseconds")


def _v1(conn: Connection) -> None:
    """Version 1: spans, trajectories, rewards, groups, batches, batch membership."""
    old = MetaData()  # the tables as version 1 defined them, where later versions add columns or change keys
    spans_v1 = Table(  # keyed by span id alone until version 12
        "spans",
        old,
        Column("span_id", String(16), primary_key=True),
        Column("trace_id", String(32), nullable=False, index=True),
        Column("trajectory_id", String(256), nullable=False, index=True),
        Column("name", Text, nullable=False),
        Column("start_ns", BigInteger, nullable=False),
        Column("end_ns", BigInteger, nullable=False),
        Column("record", Text, nullable=False),
        Column("received_at", Float, nullable=False),
    )
    rewards_v1 = Table(
        "rewards",
        old,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("rollout_id", String(256), index=True),
        Column("trace_id", String(32), index=True),
        Column("name", String(256), nullable=False),
        Column("value", Float, nullable=False),
        Column("source", String(32), nullable=False),
        Column("created_at", Float, nullable=False),
    )
    trajectories_v1 = Table(
        "trajectories",
        old,
        Column("id", String(256), primary_key=True),
        Column("trace_id", String(32), nullable=False, index=True),
        Column("by_rollout", Boolean, nullable=False),
        Column("group_key", String(256)),
        Column("group_id", String(300), index=True),
        Column("task", String(256), index=True),
        Column("split", String(64), nullable=False),
        Column("complete", Boolean, nullable=False),
        Column("created_at", Float, nullable=False),
        Column("updated_at", Float, nullable=False),
    )
    groups_v1 = Table(
        "groups",
        old,
        Column("id", String(300), primary_key=True),
        Column("key", String(256), nullable=False, index=True),
        Column("task", String(256)),
        Column("explicit", Boolean, nullable=False),
        Column("size_hint", Integer),
        Column("state", String(16), nullable=False, index=True),
        Column("reason", Text),
        Column("batch_id", String(64)),
        Column("created_at", Float, nullable=False),
        Column("updated_at", Float, nullable=False),
    )
    batches_v1 = Table(
        "batches",
        old,
        Column("id", String(64), primary_key=True),
        Column("trainer", String(256)),
        Column("state", String(16), nullable=False, index=True),
        Column("created_at", Float, nullable=False),
        Column("lease_expires_at", Float, nullable=False),
        Column("acked_at", Float),
        Column("policy_step", Integer),
    )
    # No collector ever made these tables without recording version 1: one that exists belongs to another
    # application, whose database this is not (fail, change nothing, rather than alter its table or serve on it).
    old.create_all(conn, tables=[spans_v1, rewards_v1, trajectories_v1, groups_v1, batches_v1], checkfirst=False)
    metadata.create_all(conn, tables=[batch_groups], checkfirst=False)


_REWARDS_V2 = ("span_id", "time_ns")


def _add_columns(conn: Connection, table: Table, names: tuple[str, ...]) -> None:
    """Add the nullable columns `names` of `table`, typed as this module defines them."""
    for name in names:
        column_type = table.c[name].type.compile(dialect=conn.dialect)
        conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {name} {column_type}"))


def _v2(conn: Connection) -> None:
    """Version 2: `rewards.span_id` and `rewards.time_ns`."""
    _add_columns(conn, rewards, _REWARDS_V2)


def _v3(conn: Connection) -> None:
    """Version 3: the judges' tables (collectors before it created them on start, when missing)."""
    v3 = MetaData()
    judge_runs_v3 = Table(  # as version 3 defined it, before version 10 added `max_tokens`
        "judge_runs",
        v3,
        Column("group_id", String(300), primary_key=True),
        Column("state", String(16), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("error", Text),
        Column("model", String(256), nullable=False),
        Column("trajectories", Integer, nullable=False),
        Column("distinct_count", Integer, nullable=False),
        Column("started_at", Float, nullable=False),
        Column("finished_at", Float),
        Column("next_try_at", Float),
    )
    langfuse_pushed_v3 = Table(  # as version 3 defined it, before version 9 added `retract_at`
        "langfuse_pushed",
        v3,
        Column("trajectory_id", String(256), primary_key=True),
        Column("name", String(256), primary_key=True),
        Column("value", Float, nullable=False),
        Column("score_id", String(64), nullable=False),
        Column("pushed_at", Float, nullable=False),
    )
    metadata.create_all(conn, tables=[judgements, langfuse_pulled], checkfirst=True)
    judge_runs_v3.create(conn, checkfirst=True)
    langfuse_pushed_v3.create(conn, checkfirst=True)


def _v4(conn: Connection) -> None:
    """Version 4: `trajectories.digest`, filled in from the spans already stored."""
    column_type = trajectories.c.digest.type.compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE trajectories ADD COLUMN digest {column_type}"))
    for chunk in chunks(list(conn.execute(select(trajectories.c.id)).scalars())):
        digests = {trajectory_id: FactsDigest() for trajectory_id in chunk}
        rows = conn.execute(
            select(spans.c.trajectory_id, spans.c.record).where(spans.c.trajectory_id.in_(list(digests)))
        )
        for trajectory_id, record in rows:
            digests[trajectory_id].add([SpanRecord.from_dict(json.loads(record))])
        conn.execute(
            trajectories.update()
            .where(trajectories.c.id == bindparam("trajectory"))
            .values(digest=bindparam("digest")),
            [{"trajectory": trajectory_id, "digest": digest.to_json()} for trajectory_id, digest in digests.items()],
        )


def _v5(conn: Connection) -> None:
    """Version 5: `groups.failed_attempts` (0 for the groups already stored) and `batches.reason`."""
    attempts_type = groups.c.failed_attempts.type.compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE groups ADD COLUMN failed_attempts {attempts_type} NOT NULL DEFAULT 0"))
    _add_columns(conn, batches, ("reason",))


def _v6(conn: Connection) -> None:
    """Version 6: `rewards.score_id` (rewards pulled from Langfuse before it have none)."""
    _add_columns(conn, rewards, ("score_id",))
    conn.execute(text("CREATE INDEX ix_rewards_score_id ON rewards (score_id)"))


def _v7(conn: Connection) -> None:
    """Version 7: `batches.idempotency_key` (unique; leases before it have none)."""
    _add_columns(conn, batches, ("idempotency_key",))
    conn.execute(text("CREATE UNIQUE INDEX ix_batches_idempotency_key ON batches (idempotency_key)"))


_BATCHES_V8 = ("max_groups", "min_groups", "members")


def _v8(conn: Connection) -> None:
    """Version 8: `batches.max_groups`, `batches.min_groups` and `batches.members` (leases before it have none)."""
    _add_columns(conn, batches, _BATCHES_V8)


def _v9(conn: Connection) -> None:
    """Version 9: `langfuse_pushed.retract_at` (indexed), set on the records of scores pushed for trajectories deleted
    before it, so the next Langfuse sync deletes those scores there; and every `langfuse_pulled.updated_at` rewritten
    as `score_version` writes it (versions stored at another UTC offset, or a whole second without `.000000`, compared
    as text out of time order)."""
    _add_columns(conn, langfuse_pushed, ("retract_at",))
    conn.execute(text("CREATE INDEX ix_langfuse_pushed_retract_at ON langfuse_pushed (retract_at)"))
    gone = ~exists().where(trajectories.c.id == langfuse_pushed.c.trajectory_id)
    conn.execute(langfuse_pushed.update().where(gone).values(retract_at=time.time()))
    stored = conn.execute(select(langfuse_pulled.c.score_id, langfuse_pulled.c.updated_at)).all()
    changed = [
        {"score": score_id, "version": version} for score_id, updated_at in stored
        if (version := score_version(dt.datetime.fromisoformat(updated_at))) != updated_at
    ]
    for chunk in chunks(changed):
        conn.execute(
            langfuse_pulled.update().where(langfuse_pulled.c.score_id == bindparam("score"))
            .values(updated_at=bindparam("version")),
            chunk,
        )


def _v10(conn: Connection) -> None:
    """Version 10: `judge_runs.max_tokens` (runs before it have none: unknown), so that a group refused as too large
    for the judge's `max_tokens` is judged again once the setting is raised."""
    _add_columns(conn, judge_runs, ("max_tokens",))


def _v11(conn: Connection) -> None:
    """Version 11: `trajectories.policy_step` and `trajectories.policy_step_spans` (stored trajectories have none: the
    reward curve computes and stores them on its next read)."""
    _add_columns(conn, trajectories, ("policy_step", "policy_step_spans"))


def _v12(conn: Connection) -> None:
    """Version 12: `spans` keyed by (trace id, span id) instead of span id alone, so that spans of different traces
    with the same id are all stored (before it, the later trace's span was refused), and its index of `trace_id`
    (which the key now serves) dropped. The stored spans keep their rows: PostgreSQL swaps the primary key in place;
    SQLite, which cannot alter one, copies them into the table rebuilt."""
    conn.execute(text("DROP INDEX ix_spans_trace_id"))
    if conn.dialect.name == "postgresql":
        conn.execute(text("ALTER TABLE spans DROP CONSTRAINT spans_pkey, ADD PRIMARY KEY (trace_id, span_id)"))
        return
    spans_v12 = Table(  # as version 12 defined it, before version 13 replaced the index of `trajectory_id`
        "spans",
        MetaData(),
        Column("span_id", String(16), nullable=False),
        Column("trace_id", String(32), nullable=False),
        Column("trajectory_id", String(256), nullable=False, index=True),
        Column("name", Text, nullable=False),
        Column("start_ns", BigInteger, nullable=False),
        Column("end_ns", BigInteger, nullable=False),
        Column("record", Text, nullable=False),
        Column("received_at", Float, nullable=False),
        PrimaryKeyConstraint("trace_id", "span_id"),
    )
    conn.execute(text("ALTER TABLE spans RENAME TO spans_v11"))
    conn.execute(text("DROP INDEX ix_spans_trajectory_id"))  # it moved with the table, under its name
    spans_v12.create(conn)
    names = ", ".join(column.name for column in spans_v12.columns)
    conn.execute(text(f"INSERT INTO spans ({names}) SELECT {names} FROM spans_v11"))
    conn.execute(text("DROP TABLE spans_v11"))


def _v13(conn: Connection) -> None:
    """Version 13: the index of `spans (trajectory_id, trace_id)`, which covers the read of the traces a trajectory
    holds (`pool.rewards_of` in upkeep and in a late ack: from the index alone, not every span row), in place of the
    index of `trajectory_id` alone (it leads with that column, so it serves every lookup by trajectory)."""
    conn.execute(text("CREATE INDEX ix_spans_trajectory_id_trace_id ON spans (trajectory_id, trace_id)"))
    conn.execute(text("DROP INDEX ix_spans_trajectory_id"))


def _v14(conn: Connection) -> None:
    """Version 14: the index of `trajectories (complete, by_rollout, updated_at)`, from which upkeep reads the idle
    trajectories outside rollouts (`pool._idle`, before every read): it scanned every trajectory row. Led by
    `complete`, which only that read filters by, so no lookup by id and `by_rollout` takes it for the key's."""
    conn.execute(text(
        "CREATE INDEX ix_trajectories_complete_by_rollout_updated_at ON trajectories (complete, by_rollout, updated_at)"
    ))


def _rename(conn: Connection, renames: dict[str, list[str | None]], column: Column[str], *also: Column[Any]) -> None:
    """In each row whose `column` holds a key of `renames`, set `column` and then each of `also` to that key's values,
    in order: one statement for the table, which reads the renames from a temporary table, not one per renamed value
    (PostgreSQL plans each execution anew, `collector.engine`)."""
    if not renames:
        return
    names = [f"new_{i}" for i in range(1 + len(also))]
    columns = [Column("old", Text, primary_key=True), *(Column(name, Text) for name in names)]
    given = Table("v15_renames", MetaData(), *columns, prefixes=["TEMPORARY"])
    given.create(conn)
    for chunk in chunks(sorted(renames.items())):
        conn.execute(given.insert(), [{"old": old, **dict(zip(names, new, strict=True))} for old, new in chunk])
    conn.execute(column.table.update().where(column.in_(select(given.c.old))).values({
        target.name: select(given.c[name]).where(given.c.old == column).scalar_subquery()
        for target, name in zip((column, *also), names, strict=True)
    }))
    given.drop(conn)


def _rewrite(conn: Connection, column: Column[str], rename: Callable[[str], str]) -> None:
    """Set `column` to `rename(value)` in the rows of each stored value that `rename` changes."""
    values = conn.execute(select(column).where(column.is_not(None)).distinct()).scalars()
    _rename(conn, {value: [new] for value in values if (new := rename(value)) != value}, column)


def _rekey_groups(conn: Connection) -> dict[str, str]:
    """Version 15's groups: an instance whose key is the id of its one trajectory (no `art.group`, no task) and a UUID's
    text that `rollout_key` rewrites takes that key, and the id its instance would have had under it (the key, or
    `key#n` after it) unless another group has it (trajectories merged): then the first `key#n` free. The rows that
    name it follow (batch memberships, trajectories, judge runs and judgements); returns the new ids by old id."""
    fallback = conn.execute(
        select(groups.c.id, groups.c.key).where(groups.c.explicit.is_(False), groups.c.task.is_(None))
        .order_by(groups.c.created_at, groups.c.id)
    )
    moving = [(group_id, key) for group_id, key in fallback if rollout_key(key) != key]
    wanted = {old: rollout_key(key) + old[len(key):] for old, key in moving}
    in_use: dict[str, bool] = {}  # whether a group id is taken, as far as known
    for chunk in chunks(sorted(set(wanted.values()))):
        found = set(conn.execute(select(groups.c.id).where(groups.c.id.in_(chunk))).scalars())
        in_use.update({group_id: group_id in found for group_id in chunk})

    def taken(group_id: str) -> bool:
        if group_id not in in_use:
            in_use[group_id] = conn.execute(select(groups.c.id).where(groups.c.id == group_id)).first() is not None
        return in_use[group_id]

    new_ids: dict[str, str] = {}
    for old, key in moving:
        group_id, n = wanted[old], 2
        while taken(group_id):
            group_id, n = f"{rollout_key(key)}#{n}", n + 1
        in_use[group_id] = True
        new_ids[old] = group_id
    # a batch's membership references its group: taken out while the group's key changes, then put back
    held = []
    for chunk in chunks(sorted(new_ids)):
        membership = batch_groups.c.group_id.in_(chunk)
        held += [{"batch_id": batch_id, "group_id": new_ids[old]} for batch_id, old in
                 conn.execute(select(batch_groups.c.batch_id, batch_groups.c.group_id).where(membership))]
        conn.execute(batch_groups.delete().where(membership))
    _rename(conn, {old: [new_ids[old], rollout_key(key)] for old, key in moving}, groups.c.id, groups.c.key)
    for chunk in chunks(held):
        conn.execute(batch_groups.insert(), chunk)
    for column in (trajectories.c.group_id, judge_runs.c.group_id, judgements.c.group_id):
        _rewrite(conn, column, lambda group_id: new_ids.get(group_id, group_id))
    return new_ids


def _rekey_trajectories(conn: Connection, new_ids: dict[str, str], now: float) -> set[str]:
    """Version 15's trajectory rows: those of the ids `new_ids` rewrites, with the row of each new id where one is
    stored (a trajectory of its hex digits, or a trace of that id), become one row per new id; returns the ids of the
    rows merged (of the new ids that had several).

    One row is renamed only, its group key too where that was its id (`FactsDigest.facts` under the new id). Several
    merge as an export of all their spans under the new id would have made them: the row of the first placed in a
    group (created first; the others' groups lose them) is kept, with the digest of them all, created when the first
    was, changed now (a late ack of a lease that held one finds it changed), its policy step computed again on the
    next curve read; the others are deleted."""
    columns = (trajectories.c.id, trajectories.c.group_id, trajectories.c.group_key, trajectories.c.by_rollout,
               trajectories.c.complete, trajectories.c.created_at, trajectories.c.digest)
    found: dict[str, list[dict[str, Any]]] = {}
    for ids in (sorted(new_ids), sorted(set(new_ids.values()))):
        for chunk in chunks(ids):
            for row in conn.execute(select(*columns).where(trajectories.c.id.in_(chunk))).mappings():
                found.setdefault(new_ids.get(row["id"], row["id"]), []).append(dict(row))
    gone: list[str] = []
    renamed: dict[str, list[str | None]] = {}
    merged: list[dict[str, Any]] = []
    for key, rows in sorted(found.items()):
        rows.sort(key=lambda row: (row["created_at"], row["id"]))
        kept = next((row for row in rows if row["group_id"] is not None), rows[0])
        group_key = FactsDigest.from_json(kept["digest"]).facts(key).group_key if kept["group_key"] else None
        if len(rows) == 1:
            renamed[kept["id"]] = [key, group_key]
            continue
        gone += [row["id"] for row in rows if row is not kept]
        digest = FactsDigest()
        for row in rows:
            digest.merge(FactsDigest.from_json(row["digest"]))
        merged.append({
            "old": kept["id"], "new": key, "new_group_key": group_key,
            "new_by_rollout": any(row["by_rollout"] for row in rows),
            "new_complete": any(row["complete"] for row in rows), "new_created_at": rows[0]["created_at"],
            "new_digest": digest.to_json(),
        })
    _rename(conn, renamed, trajectories.c.id, trajectories.c.group_key)
    for chunk in chunks(sorted(gone)):  # first: the row of the new id itself may be one
        conn.execute(trajectories.delete().where(trajectories.c.id.in_(chunk)))
    statement = trajectories.update().where(trajectories.c.id == bindparam("old")).values(
        id=bindparam("new"), group_key=bindparam("new_group_key"), by_rollout=bindparam("new_by_rollout"),
        complete=bindparam("new_complete"), created_at=bindparam("new_created_at"), updated_at=now,
        digest=bindparam("new_digest"), policy_step=None, policy_step_spans=None,
    )
    for chunk in chunks(merged):
        conn.execute(statement, chunk)
    return {row["id"] for rows in found.values() if len(rows) > 1 for row in rows}


def _rekey_judgements(conn: Connection, new_ids: dict[str, str], merged: set[str]) -> None:
    """Version 15's judgements: those of merged trajectories are dropped with their groups' judge runs, so the judge
    scores the merged one afresh (as it does the members a deleted trajectory leaves); the others follow their
    trajectory's new id (`trajectory_id`, `duplicate_of`)."""
    for chunk in chunks(sorted(merged)):
        judged = judgements.c.trajectory_id.in_(chunk)
        runs = sorted(set(conn.execute(select(judgements.c.group_id).where(judged)).scalars()))
        conn.execute(judgements.delete().where(judged))
        for runs_chunk in chunks(runs):
            conn.execute(judge_runs.delete().where(judge_runs.c.group_id.in_(runs_chunk)))
    for column in (judgements.c.trajectory_id, judgements.c.duplicate_of):
        _rewrite(conn, column, lambda trajectory_id: new_ids.get(trajectory_id, trajectory_id))


def _rekey_pushed(conn: Connection, new_ids: dict[str, str], now: float) -> None:
    """Version 15's records of scores pushed to Langfuse: each follows its trajectory's new id and keeps its score
    (pushed again with the new id once its value changes); where that id has a record of the same name already
    (trajectories merged), it keeps the old id, which no trajectory has any more, marked to delete now. A record marked
    to delete already (a deleted trajectory's) keeps the old id too."""
    taken: set[tuple[str, str]] = set()
    for chunk in chunks(sorted(set(new_ids.values()))):
        query = select(langfuse_pushed.c.trajectory_id, langfuse_pushed.c.name)
        taken.update((tid, name) for tid, name in conn.execute(query.where(langfuse_pushed.c.trajectory_id.in_(chunk))))
    moved, retracted = [], []
    for chunk in chunks(sorted(new_ids)):
        query = select(langfuse_pushed.c.trajectory_id, langfuse_pushed.c.name).where(
            langfuse_pushed.c.trajectory_id.in_(chunk), langfuse_pushed.c.retract_at.is_(None)
        ).order_by(langfuse_pushed.c.trajectory_id, langfuse_pushed.c.name)
        for old, name in conn.execute(query):
            record = {"old": old, "old_name": name, "new": new_ids[old]}
            (retracted if (new_ids[old], name) in taken else moved).append(record)
            taken.add((new_ids[old], name))
    record = langfuse_pushed.c.trajectory_id == bindparam("old"), langfuse_pushed.c.name == bindparam("old_name")
    for rows, statement in ((moved, langfuse_pushed.update().where(*record).values(trajectory_id=bindparam("new"))),
                            (retracted, langfuse_pushed.update().where(*record).values(retract_at=now))):
        for chunk in chunks(rows):
            conn.execute(statement, chunk)


def _rewrite_members(conn: Connection, group_ids: dict[str, str], trajectory_ids: dict[str, str]) -> None:
    """Version 15's leases: the members each batch recorded (`batches.members`, `{group id: [trajectory ids]}`) under
    the groups' and trajectories' new ids (trajectories merged into one are listed once)."""
    if not group_ids and not trajectory_ids:
        return
    changed = []
    recorded = select(batches.c.id, batches.c.members).where(batches.c.members.is_not(None))
    for batch_id, members in conn.execute(recorded):
        before = json.loads(members)
        after = {group_ids.get(group, group): sorted({trajectory_ids.get(t, t) for t in ids})
                 for group, ids in before.items()}
        if after != before:
            changed.append({"batch": batch_id, "new": json.dumps(after, sort_keys=True)})
    statement = batches.update().where(batches.c.id == bindparam("batch")).values(members=bindparam("new"))
    for chunk in chunks(changed):
        conn.execute(statement, chunk)


def _v15(conn: Connection) -> None:
    """Version 15: every rollout id stored as a UUID's text in another form than its 32 lower-case hex digits (with
    dashes, in braces, after `urn:uuid:`, in upper case) rewritten as those digits, as `spans.rollout_key` keys spans
    and rewards from this version on: before it, a reward by the hex id (which `art_langgraph.reward` sends for a
    UUID) never reached a trajectory whose spans wrote the id with dashes. Any other id is left as written. Rewritten:
    the groups keyed by such an id (`_rekey_groups`), the trajectories (rows of one UUID in several forms merge,
    `_rekey_trajectories`), their spans and rewards, judgements, records of scores pushed to Langfuse and the members
    each lease recorded."""
    now = time.time()
    group_ids = _rekey_groups(conn)
    rollouts = conn.execute(select(trajectories.c.id).where(trajectories.c.by_rollout.is_(True))).scalars()
    new_ids = {old: new for old in rollouts if (new := rollout_key(old)) != old}
    merged = _rekey_trajectories(conn, new_ids, now)
    for column in (spans.c.trajectory_id, rewards.c.rollout_id):
        _rewrite(conn, column, rollout_key)
    _rekey_judgements(conn, new_ids, merged)
    _rekey_pushed(conn, new_ids, now)
    _rewrite_members(conn, group_ids, new_ids)


MIGRATIONS: list[Callable[[Connection], None]] = [
    _v1, _v2, _v3, _v4, _v5, _v6, _v7, _v8, _v9, _v10, _v11, _v12, _v13, _v14, _v15,
]
SCHEMA_VERSION = len(MIGRATIONS)


_MIGRATION_LOCK = 0x617274
"""PostgreSQL advisory-lock key (single-key space) held by the transaction that checks or applies a migration."""


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer collector: this one does not know its tables, and leaves them alone."""


def migrate(engine: Engine) -> int:
    """Bring the database to `SCHEMA_VERSION`; returns the version it was at before.

    Each migration runs in a transaction of its own that first takes the migration lock (PostgreSQL: an advisory
    lock; SQLite: the write lock of `BEGIN IMMEDIATE`) and reads the version again, so collectors that start at
    once on one database apply every migration once, and the others find it done.

    Raises:
        SchemaTooNew: the database is at a version above `SCHEMA_VERSION`.
    """
    before: int | None = None
    while True:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(select(func.pg_advisory_xact_lock(_MIGRATION_LOCK)))
            metadata.create_all(conn, tables=[schema_version])
            current = conn.execute(select(func.max(schema_version.c.version))).scalar() or 0
            before = current if before is None else before
            if current > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"database schema is version {current}, newer than this collector ({SCHEMA_VERSION}); "
                    "upgrade art-langgraph"
                )
            if current == SCHEMA_VERSION:
                return before
            MIGRATIONS[current](conn)
            conn.execute(schema_version.insert().values(version=current + 1, applied_at=time.time()))
