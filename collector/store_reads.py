"""The collector store's reads: trajectories, groups, batches and curve facts out of the tables.

Functions over an open connection; `SqlStore`'s read methods run each in `SqlStore._read` (due maintenance first,
then a read-only transaction), and its lease assembles the groups it hands out with `leased_groups`. Sequences are
assembled here, on reading, from the stored spans (`collector.assembly`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, Select, case, func, or_, select

from collector import assembly, curve, pool
from collector.config import CollectorSettings
from collector.engine import chunks
from collector.groups import Decision, TrainingReward
from collector.otlp import SpanRecord
from collector.protocol import BatchStatus, Group, GroupState, GroupStatus, Trajectory
from collector.rows import spans_by_trajectory
from collector.schema import batch_groups, batches, groups, trajectories

__all__ = [
    "Listed", "Stamp", "assemble", "batch_statuses", "count_trajectories", "curve_facts", "group_statuses",
    "leased_groups", "open_decisions", "spans_of", "trajectory", "trajectories_matching",
]

_STORED_AS: dict[GroupState, frozenset[str]] = {
    "open": frozenset({"open"}), "ready": frozenset({"open"}), "skipped": frozenset({"open", "skipped"}),
    "leased": frozenset({"leased"}), "trained": frozenset({"trained"}), "expired": frozenset({"expired"}),
}
"""The stored states a group shown in each state can have: `ready`, `open` and `skipped` are decided for open
groups (`pool.decisions`), the others are stored as they are shown."""


def spans_of(conn: Connection, trajectory_id: str) -> list[SpanRecord]:
    """Every stored span of a trajectory, in no particular order."""
    return spans_by_trajectory(conn, [trajectory_id])[trajectory_id]


def assemble(conn: Connection, rows: list[Any], training: TrainingReward) -> list[Trajectory]:
    """The trajectories of trajectory `rows`, assembled from their spans and named rewards, a chunk of rows at a time:
    its spans in one read (`assembly.assemble` takes them in any order), its rewards by the traces of those spans."""
    out: list[Trajectory] = []
    for chunk in chunks(rows):
        held = spans_by_trajectory(conn, [row["id"] for row in chunk])
        traces = {trajectory_id: {span.trace_id for span in found} for trajectory_id, found in held.items()}
        named = pool.rewards_of(conn, chunk, traces=traces)
        out += [
            assembly.assemble(
                row["id"], held[row["id"]], group_id=row["group_id"] or "",
                complete=bool(row["complete"]), rewards=named[row["id"]], training=training,
            )
            for row in chunk
        ]
    return out


def leased_groups(conn: Connection, taken: list[Any], training: TrainingReward) -> list[Group]:
    """The groups of group rows `taken`, each with its trajectories (oldest first), assembled together (`assemble`)."""
    members = pool.group_members(conn, [g["id"] for g in taken])
    assembled = iter(assemble(conn, [row for g in taken for row in members[g["id"]]], training))
    return [
        Group(id=g["id"], task=g["task"], trajectories=[next(assembled) for _ in members[g["id"]]]) for g in taken
    ]


def trajectory(conn: Connection, trajectory_id: str, training: TrainingReward) -> Trajectory | None:
    """One assembled trajectory, or None."""
    row = conn.execute(select(trajectories).where(trajectories.c.id == trajectory_id)).mappings().first()
    return assemble(conn, [row], training)[0] if row else None


def _filtered(query: Select[Any], group: str | None, task: str | None, split: str | None) -> Select[Any]:
    """`query` kept to the trajectories matching every filter given (`group`: group id or group key)."""
    if group is not None:
        query = query.where(or_(trajectories.c.group_id == group, trajectories.c.group_key == group))
    if task is not None:
        query = query.where(trajectories.c.task == task)
    if split is not None:
        query = query.where(trajectories.c.split == split)
    return query


def trajectories_matching(
    conn: Connection, training: TrainingReward, *, group: str | None, task: str | None, split: str | None,
    newest_first: bool, limit: int | None, offset: int,
) -> list[Trajectory]:
    """`Store.trajectories`: the trajectories matching every filter given, oldest first (`newest_first`: the
    reverse); with `limit`, that many from `offset` on, the others not assembled."""
    order = (trajectories.c.created_at, trajectories.c.id)
    query = _filtered(select(trajectories), group, task, split)
    query = query.order_by(*(column.desc() for column in order) if newest_first else order).offset(offset).limit(limit)
    return assemble(conn, list(conn.execute(query).mappings()), training)


def count_trajectories(conn: Connection, *, group: str | None, task: str | None, split: str | None) -> int:
    """How many trajectories `trajectories_matching` would return with the same filters and no limit."""
    return conn.execute(_filtered(select(func.count()).select_from(trajectories), group, task, split)).scalar_one()


def curve_facts(
    conn: Connection, steps: curve.PolicySteps, training: TrainingReward, *, split: str | None
) -> list[curve.CurveFacts]:
    """Policy step and rewards of every trajectory (in `split`), without assembling them (`collector.curve`)."""
    return curve.curve_facts(conn, _filtered(curve.ROWS, None, None, split), steps, training, every=split is None)


Stamp = tuple[float, int | None, int, int]
"""What an open group's readiness is decided from, as its row and an index tell it: its `updated_at`, its `size_hint`,
its number of members and of complete ones (`group_statuses`)."""

Listed = dict[str, tuple[Stamp, Decision, int]]
"""The open groups a listing or a lease decided, by id: each with its `Stamp` then, its decision and its number of
members with the training reward (`group_statuses`, `open_decisions`)."""

_MEMBERS = select(func.count()).where(trajectories.c.group_id == groups.c.id).scalar_subquery().label("members")
_COMPLETE = (
    select(func.sum(case((trajectories.c.complete.is_(True), 1), else_=0)))
    .where(trajectories.c.group_id == groups.c.id).scalar_subquery().label("completed")
)
"""Each group's members, and its complete ones (a sum, not a count of `complete` ones: SQLite's planner took the index
of `complete` for that and read every complete trajectory per group), looked up in the index of
`trajectories.group_id` beside its row."""


def _stamp(group: Any) -> Stamp:
    """The `Stamp` of a group row read with `_MEMBERS` and `_COMPLETE`."""
    return group["updated_at"], group["size_hint"], group["members"], group["completed"]


def group_statuses(
    conn: Connection, settings: CollectorSettings, training: TrainingReward, states: Collection[GroupState] | None,
    limit: int | None, listed: Listed, now: float,
) -> tuple[list[GroupStatus], Listed | None]:
    """`Store.groups`: every non-empty group with its readiness (`ready` is computed, not stored); with `states`,
    only the groups in one of them, read from the rows stored in a state they can show (not the whole history);
    with `limit`, only the newest `limit` non-empty groups (of those rows), newest first.

    Also returns the open groups decided (`Listed`), for the next listing under the same `settings` and `training`
    (None when this one did not read every open group: a `limit`, or no state an open group shows). An open group of
    `listed` whose `Stamp` is unchanged is not decided again, nor its members and rewards read: every write that
    changes its members (complete, split) or their rewards marks it active (a new `updated_at`), but one that takes a
    member away (its count) or completes an idle one (upkeep: the count of complete ones). A group is remembered only
    once its `updated_at` is older than `now` (the store's time, before this read): a write dates its change after
    the group's last one, so the stamp of a group written again at a time the store's clock did not leave (a test's)
    is never the one remembered."""
    columns = (groups, _MEMBERS, _COMPLETE)
    query = select(*columns).order_by(groups.c.created_at, groups.c.id)
    if limit is not None:
        has_members = select(trajectories.c.id).where(trajectories.c.group_id == groups.c.id).exists()
        newest = (groups.c.created_at.desc(), groups.c.id.desc())
        query = select(*columns).where(has_members).order_by(*newest).limit(limit)
    stored = {stored for state in states for stored in _STORED_AS[state]} if states is not None else None
    if stored is not None:
        query = query.where(groups.c.state.in_(stored))
    every = [group for group in conn.execute(query).mappings() if group["members"]]
    known = _decided(conn, settings, training, every, listed)
    out = [_status(group, *known[group["id"]], settings) for group in every]
    every_open = limit is None and (stored is None or "open" in stored)
    return (out if states is None else [status for status in out if status.state in states]), (
        _remembered(every, known, now) if every_open else None
    )


def open_decisions(
    conn: Connection, settings: CollectorSettings, training: TrainingReward, listed: Listed, now: float
) -> tuple[list[Any], dict[str, Decision], Listed]:
    """Every open group's row (read with `_MEMBERS` and `_COMPLETE`, in no particular order) and decision, and the
    open groups decided (`Listed`), for the next listing or lease under the same `settings` and `training`. An open
    group of `listed` whose `Stamp` is unchanged is not decided again, nor its members and rewards read; one is
    remembered only once its `updated_at` is older than `now` (as `group_statuses` does)."""
    rows = list(conn.execute(select(groups, _MEMBERS, _COMPLETE).where(groups.c.state == "open")).mappings())
    known = _decided(conn, settings, training, rows, listed)
    return rows, {group["id"]: known[group["id"]][0] for group in rows}, _remembered(rows, known, now)


def _decided(
    conn: Connection, settings: CollectorSettings, training: TrainingReward, rows: list[Any], listed: Listed
) -> dict[str, tuple[Decision | None, int]]:
    """Of each group row of `rows` (read with `_MEMBERS` and `_COMPLETE`), by id: its decision (an open one's; None
    for others) and its number of members with the training reward. An open group of `listed` whose `Stamp` is
    unchanged has those it was listed with; the members and rewards of the others are read, and they decided."""
    known = {
        group["id"]: listed[group["id"]][1:]
        for group in rows
        if group["state"] == "open" and listed.get(group["id"], (None,))[0] == _stamp(group)
    }
    unknown = [group for group in rows if group["id"] not in known]
    members = pool.group_members(conn, [group["id"] for group in unknown])
    named = pool.rewards_of(conn, [row for found in members.values() for row in found])
    for group in unknown:
        found = members[group["id"]]
        decision = pool.decision(settings, group, found, named) if group["state"] == "open" else None
        known[group["id"]] = decision, sum(training.of(named[row["id"]]) is not None for row in found)
    return known


def _remembered(rows: list[Any], known: dict[str, tuple[Decision | None, int]], now: float) -> Listed:
    """The open groups of `rows` (read with `_MEMBERS` and `_COMPLETE`) to remember with what `_decided` found of
    them (`Listed`): those whose `updated_at` is older than `now` (see `group_statuses`)."""
    return {
        group["id"]: (_stamp(group), *known[group["id"]])
        for group in rows
        if group["state"] == "open" and group["updated_at"] < now
    }


def _status(group: Any, decision: Decision | None, rewarded: int, settings: CollectorSettings) -> GroupStatus:
    """A group's status from its row (read with `_MEMBERS` and `_COMPLETE`) and its members with the training reward;
    `decision`: an open one's."""
    state, reason = (decision.state, decision.reason) if decision is not None else (group["state"], group["reason"])
    return GroupStatus(
        id=group["id"], task=group["task"], size=group["members"], expected=pool.expected_size(group, settings),
        complete=group["completed"], rewarded=rewarded, state=state, reason=reason,
        failed_attempts=group["failed_attempts"],
    )


_BATCH_STATUS_COLUMNS = [
    batches.c[name] for name in ("id", "trainer", "state", "created_at", "lease_expires_at", "acked_at", "policy_step",
                                 "reason")
]
"""The columns of `batches` a `BatchStatus` shows (not the lease's recorded members and bounds)."""


def batch_statuses(conn: Connection, limit: int) -> list[BatchStatus]:
    """The latest `limit` batches (leases), newest first, with their group ids."""
    newest = select(*_BATCH_STATUS_COLUMNS).order_by(batches.c.created_at.desc(), batches.c.id).limit(limit)
    rows = list(conn.execute(newest).mappings())
    members: dict[str, list[str]] = {row["id"]: [] for row in rows}
    for chunk in chunks(list(members)):
        query = select(batch_groups.c.batch_id, batch_groups.c.group_id).where(batch_groups.c.batch_id.in_(chunk))
        for batch_id, group_id in conn.execute(query):
            members[batch_id].append(group_id)
    return [
        BatchStatus(
            id=row["id"], trainer=row["trainer"], state=row["state"], created_at=row["created_at"],
            lease_expires_at=row["lease_expires_at"], acked_at=row["acked_at"], policy_step=row["policy_step"],
            groups=sorted(members[row["id"]]), reason=row["reason"],
        )
        for row in rows
    ]
