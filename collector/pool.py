"""The pool of groups: members, named rewards, readiness, and upkeep (lease expiry, idle
trajectories, stale groups). Functions over an open transaction; `SqlStore` calls them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from sqlalchemy import ColumnElement, Connection, and_, func, or_, select

from collector import foreign_deletion, rows
from collector.config import CollectorSettings
from collector.engine import chunks
from collector.groups import Decision, Member, decide, merge_rewards
from collector.schema import batch_groups, batches, groups, rewards, spans, trajectories
from collector.transactions import GROUP_LOCKS, TRAJECTORY_LOCKS

__all__ = [
    "LEASE_EXPIRED", "Kept", "Lock", "Upkeep", "decision", "decisions", "expected_size", "give_back", "group_members",
    "groups_of", "holders", "lock_groups", "maintain", "maintain_groups", "rewarded", "rewards_of",
]

log = logging.getLogger(__name__)


def rewards_of(
    conn: Connection, rows: list[Any], *, until: float | None = None,
    traces: Mapping[str, AbstractSet[str]] | None = None,
) -> dict[str, dict[str, float]]:
    """Named rewards per trajectory row: those by its id (rollout id), and those by trace id alone (no rollout id
    given) of every trace it holds a span in (a rollout may be spread over traces); with `until`, only those stored
    by then; with `traces`, those traces per row id, as the caller read them with the spans (not read again; else read
    from the index of `spans (trajectory_id, trace_id)` alone, which covers the lookup: schema version 13). Of one
    name, an API reward wins over a span's, and then the later one (`merge_rewards`), whether it came by rollout id or
    by which of its traces."""
    by_id: dict[str, list[tuple[tuple[Any, ...], str, str, float]]] = {row["id"]: [] for row in rows}
    for chunk in chunks(rows):
        ids = [r["id"] for r in chunk]
        if traces is None:
            query = select(spans.c.trajectory_id, spans.c.trace_id).where(spans.c.trajectory_id.in_(ids)).distinct()
            held = [(trajectory_id, trace_id) for trajectory_id, trace_id in conn.execute(query)]
        else:
            held = [(trajectory_id, trace_id) for trajectory_id in ids for trace_id in traces[trajectory_id]]
        by_trace: dict[str, list[str]] = {}
        for trajectory_id, trace_id in held:
            by_trace.setdefault(trace_id, []).append(trajectory_id)
        by_traces = and_(rewards.c.rollout_id.is_(None), rewards.c.trace_id.in_(list(by_trace)))
        query = select(rewards).where(or_(rewards.c.rollout_id.in_(ids), by_traces))
        if until is not None:
            query = query.where(rewards.c.created_at <= until)
        for r in conn.execute(query).mappings():
            if r["source"] == "span":  # by time in the trace, so arrival order does not matter
                order: tuple[Any, ...] = (r["time_ns"] or 0, r["span_id"] or "", r["name"], r["id"])
            else:
                order = (r["id"],)
            for owner in [r["rollout_id"]] if r["rollout_id"] else by_trace[r["trace_id"]]:
                if owner in by_id:
                    by_id[owner].append((order, r["source"], r["name"], r["value"]))
    return {tid: merge_rewards(found) for tid, found in by_id.items()}


def rewarded(conn: Connection, group_ids: Collection[str], now: float) -> None:
    """New rewards arrived for members of the groups `group_ids`: those the caller found and locked for them (read
    again here, a group a trajectory joined since, by an export that committed in between, was updated unlocked, out
    of the groups' id order: a deadlock, retried; that export marked it active itself).

    Activity for their open groups; a group skipped for its rewards goes back to the pool, since a new reward may
    give it its spread back (not one skipped after failed trainings, which keeps the batch that gave up on it).
    Called for rewards by API and from spans alike.
    """
    reopened = or_(groups.c.state == "open", and_(groups.c.state == "skipped", groups.c.batch_id.is_(None)))
    for chunk in chunks(sorted(group_ids)):
        conn.execute(
            groups.update().where(groups.c.id.in_(chunk), reopened).values(state="open", reason=None, updated_at=now)
        )


def groups_of(conn: Connection, trajectory_ids: list[str], trace_ids: list[str]) -> set[str]:
    """Ids of the groups that hold the trajectories of `trajectory_ids`, and those holding a span in `trace_ids`."""
    ids = set(trajectory_ids).union(*holders(conn, trace_ids).values())
    group_ids: set[str] = set()
    for chunk in chunks(sorted(ids)):
        query = select(trajectories.c.group_id).where(
            trajectories.c.id.in_(chunk), trajectories.c.group_id.is_not(None)
        )
        group_ids.update(conn.execute(query).scalars())
    return group_ids


def holders(conn: Connection, trace_ids: Collection[str]) -> dict[str, set[str]]:
    """Per trace of `trace_ids` that has spans, the ids its spans are stored under (`spans.trajectory_id`: rollout
    ids, or the trace id outside any rollout): those of its trajectories, which a reward by trace id applies to, where
    they exist. A lookup by the spans' key (led by the trace id): a trajectory row names one of its traces only."""
    found: dict[str, set[str]] = {}
    for chunk in chunks(sorted(set(trace_ids))):
        query = select(spans.c.trace_id, spans.c.trajectory_id).where(spans.c.trace_id.in_(chunk)).distinct()
        for trace_id, trajectory_id in conn.execute(query):
            found.setdefault(trace_id, set()).add(trajectory_id)
    return found


def group_members(conn: Connection, group_ids: list[str]) -> dict[str, list[Any]]:
    """Trajectory rows of each group, oldest first."""
    members: dict[str, list[Any]] = {gid: [] for gid in group_ids}
    for chunk in chunks(group_ids):
        query = (
            select(trajectories)
            .where(trajectories.c.group_id.in_(chunk))
            .order_by(trajectories.c.created_at, trajectories.c.id)
        )
        for row in conn.execute(query).mappings():
            members[row["group_id"]].append(row)
    return members


def expected_size(group: Any, settings: CollectorSettings) -> int:
    """Trajectories a group row waits for: its announced size, else the minimum group size."""
    return group["size_hint"] or settings.min_group_size


def decision(
    settings: CollectorSettings, group: Any, rows: list[Any], named: Mapping[str, Mapping[str, float]]
) -> Decision:
    """Readiness of the open group row `group` from its members' rows `rows` and their named rewards (`rewards_of`)."""
    training = settings.training_reward
    ms = [Member(bool(r["complete"]), r["split"], training.of(named[r["id"]])) for r in rows]
    return decide(ms, expected_size(group, settings), reward_label=training.label,
                  keep_zero_spread=settings.keep_zero_spread)


def decisions(conn: Connection, settings: CollectorSettings, open_groups: list[Any]) -> dict[str, Decision]:
    """Readiness of each open group."""
    members = group_members(conn, [g["id"] for g in open_groups])
    named = rewards_of(conn, [row for rows in members.values() for row in rows])
    return {group["id"]: decision(settings, group, members[group["id"]], named) for group in open_groups}


Lock = Callable[[Connection, int, Iterable[str]], None]
"""`Transactions.lock` of the store: advisory locks held until the transaction ends (none needed on SQLite)."""


def _lock_returned_members(conn: Connection, lock: Lock, batch_ids: list[str]) -> None:
    """Take the advisory locks an export changing the trajectories outside any rollout in the groups `batch_ids` hold
    takes (`Transactions.lock`: their ids and traces, then their groups' keys), first in the transaction of a release
    or expiry, before any row lock: `give_back` may delete them (`foreign_deletion.forget_deferred_foreign`), and an
    export of their trace, or the judge's stale check (`ScoringStore.member_stamps_held`), must wait for that and see
    it. A leased group's members do not change, so these are the ones `give_back` finds."""
    found = []
    for chunk in chunks(sorted(batch_ids)):
        query = (
            select(trajectories.c.id, trajectories.c.trace_id, groups.c.key)
            .join(groups, groups.c.id == trajectories.c.group_id)
            .where(groups.c.state == "leased", groups.c.batch_id.in_(chunk), trajectories.c.by_rollout.is_(False))
        )
        found += conn.execute(query).all()
    lock(conn, TRAJECTORY_LOCKS, [name for row in found for name in (row.id, row.trace_id)])
    lock(conn, GROUP_LOCKS, [row.key for row in found])


LEASE_EXPIRED = "lease expired"
"""The reason of an expired batch, and the error its groups count."""


def give_back(
    conn: Connection, settings: CollectorSettings, batch_ids: list[str], *, failed: bool, error: str, now: float
) -> None:
    """Return the groups that `batch_ids` still hold to the pool.

    With `failed`, each counts a failed attempt, and one that reaches `settings.max_failed_attempts` is skipped
    instead (the reason says how often and `error`); it keeps the batch that gave up on it in `batch_id`, which
    tells it from a group skipped for its rewards: a new reward does not reopen it. The trajectories of another
    instrumentation's calls kept while the groups were leased are deleted then
    (`foreign_deletion.forget_deferred_foreign`), under the advisory locks the caller took first
    (`_lock_returned_members`). Their rows are locked in id order first (`lock_groups`).
    """
    held = and_(groups.c.state == "leased", groups.c.batch_id.in_(batch_ids))
    returned = _leased_by(conn, batch_ids)
    lock_groups(conn, returned)  # before the updates below lock them in the table's order
    limit = settings.max_failed_attempts
    if failed:
        conn.execute(groups.update().where(held).values(failed_attempts=groups.c.failed_attempts + 1))
    if failed and limit:
        spent = conn.execute(
            select(groups.c.id, groups.c.failed_attempts).where(held, groups.c.failed_attempts >= limit)
        ).all()
        for group_id, attempts in spent:
            reason = f"training failed {attempts} times; last: {error}"
            conn.execute(
                groups.update().where(groups.c.id == group_id).values(state="skipped", reason=reason, updated_at=now)
            )
            log.warning("group %s skipped, not leased again: %s", group_id, reason)
    conn.execute(groups.update().where(held).values(state="open", batch_id=None, updated_at=now))
    foreign_deletion.forget_deferred_foreign(conn, returned, now)


def lock_groups(conn: Connection, group_ids: Iterable[str | None]) -> None:
    """Hold the rows of the groups `group_ids` (a None is no group) until the transaction ends: `FOR UPDATE`, in id
    order (`rows.BYTE_ORDER`: across chunks too), on PostgreSQL (SQLite has one writer at a time). Every
    transaction that locks several groups takes them so (an export, a reward, a withdrawn score, upkeep), so none waits
    for another in a cycle (PostgreSQL aborted one as a deadlock)."""
    _lock_in_order(conn, groups.c.id, {group_id for group_id in group_ids if group_id is not None})


def _lock_batches(conn: Connection, batch_ids: Iterable[str]) -> None:
    """Hold the rows of the batches `batch_ids` until the transaction ends, as `lock_groups` holds groups: in one pass
    in id order, before any update of batches. An update of several (`UPDATE ... WHERE id IN`) locks them in the
    table's order, so a release or an ack that expired another batch before it locked its own waited for an upkeep
    that had locked its own first (PostgreSQL aborted one as a deadlock): every transaction takes them here, upkeep
    (`maintain`) with those the caller ends next."""
    _lock_in_order(conn, batches.c.id, set(batch_ids))


def _lock_in_order(conn: Connection, column: Any, ids: AbstractSet[str]) -> None:
    """`FOR UPDATE` the rows whose key `column` is one of `ids`, in id order (`rows.BYTE_ORDER`: across chunks
    too), on PostgreSQL (SQLite has one writer at a time)."""
    if conn.dialect.name != "postgresql":
        return
    for chunk in chunks(sorted(ids)):
        query = select(column).where(column.in_(chunk)).order_by(column.collate(rows.BYTE_ORDER))
        conn.execute(query.with_for_update())


def _leased_by(conn: Connection, batch_ids: list[str]) -> list[str]:
    """Ids of the groups that `batch_ids` hold."""
    found: list[str] = []
    for chunk in chunks(batch_ids):
        held = and_(groups.c.state == "leased", groups.c.batch_id.in_(chunk))
        found += conn.execute(select(groups.c.id).where(held)).scalars()
    return found


def _batch_groups(conn: Connection, batch_ids: list[str]) -> list[str]:
    """Ids of the groups `batch_ids` were leased with, whatever they hold now."""
    found: list[str] = []
    for chunk in chunks(batch_ids):
        found += conn.execute(select(batch_groups.c.group_id).where(batch_groups.c.batch_id.in_(chunk))).scalars()
    return found


def _idle(settings: CollectorSettings, now: float) -> ColumnElement[bool]:
    """The trajectories without rollout span that saw no new span for `settings.idle_seconds`: complete. Read from the
    index of `trajectories (complete, by_rollout, updated_at)` (schema version 14), not every trajectory row."""
    return and_(
        trajectories.c.by_rollout.is_(False),
        trajectories.c.complete.is_(False),
        trajectories.c.updated_at <= now - settings.idle_seconds,
    )


def _complete_idle(conn: Connection, idle: ColumnElement[bool], ids: list[str]) -> None:
    """Mark complete those of the trajectories `ids`, found `idle` (`_idle`), still idle under their rows' lock, taken
    in id order after their groups' (`lock_groups`): an export, and the deletion of another instrumentation's calls
    (`foreign_deletion._delete_foreign`), lock a group's row before they change its members."""
    for chunk in chunks(sorted(ids)):
        found = trajectories.c.id.in_(chunk)
        # still idle under the lock: an export that held a group may have added spans since
        rows.lock_trajectories(conn, and_(found, idle))
        conn.execute(trajectories.update().where(found, idle).values(complete=True))


def _stale(settings: CollectorSettings, now: float) -> ColumnElement[bool]:
    """The open groups that saw no new span or reward for `settings.group_timeout_seconds`."""
    return and_(groups.c.state == "open", groups.c.updated_at <= now - settings.group_timeout_seconds)


def _not_ready(conn: Connection, settings: CollectorSettings, stale: list[Any]) -> dict[str, Decision]:
    """The decision of each group of the rows `stale` that is not ready (still `open`), by group id."""
    return {group_id: decision for group_id, decision in decisions(conn, settings, stale).items()
            if decision.state == "open"}


def _expire(conn: Connection, settings: CollectorSettings, expiring: Mapping[str, Decision], now: float) -> None:
    """Expire the groups `expiring` (at most a chunk of them), each with what it was waiting for: one statement per
    reason, not per group."""
    timeout = settings.group_timeout_seconds
    by_reason: dict[str, list[str]] = {}
    for group_id in sorted(expiring):
        reason = f"expired: no new span or reward for {timeout:g} s while {expiring[group_id].reason}"
        by_reason.setdefault(reason, []).append(group_id)
    for reason, group_ids in by_reason.items():
        expire = groups.update().where(groups.c.id.in_(group_ids))
        conn.execute(expire.values(state="expired", reason=reason, updated_at=now))
        for group_id in group_ids:
            log.info("group %s %s", group_id, reason)


Kept = dict[str, tuple[float, int]]
"""The stale open groups that upkeep decided to keep (ready, or to be skipped by the next lease), by id, each with its
`updated_at` and its number of members then (`_expire_stale`)."""


def _stamps(conn: Connection, still: ColumnElement[bool]) -> Kept:
    """`updated_at` and number of members of each group that matches `still`: one read of their rows, their members
    counted in the index of `trajectories.group_id`."""
    members = select(func.count()).where(trajectories.c.group_id == groups.c.id).scalar_subquery()
    query = select(groups.c.id, groups.c.updated_at, members).where(still)
    return {group_id: (updated_at, count) for group_id, updated_at, count in conn.execute(query)}


def _expire_stale(conn: Connection, settings: CollectorSettings, now: float, kept: Kept) -> Kept:
    """Expire the open groups that saw no new span or reward for `settings.group_timeout_seconds` and are not ready;
    returns those kept (`Kept`).

    A group of `kept` (kept by an earlier upkeep under the same `settings`) whose `updated_at` and number of members
    are still those it was kept with is kept again undecided. Its decision reads its members (complete, split), their
    rewards and its size: every write that changes them marks it active (a new `updated_at`) but one that takes a
    member away (placed under another key, or deleted as another instrumentation's calls), which leaves it fewer;
    and completing idle members cannot make a kept group (its members all complete) not ready. So upkeep decides the
    groups gone stale or changed since, not every ready group waiting for a trainer.

    Their rows are locked only once decided, and those another transaction holds are skipped (an export or a reward
    changing one, which keeps it open; another replica's upkeep expiring it): upkeep, holding the groups it locked in
    id order before, waits for none here, so no cycle of waits runs through it; a group skipped and still stale
    expires on a later read."""
    still = _stale(settings, now)
    stamps = _stamps(conn, still)
    changed = sorted(group_id for group_id, stamp in stamps.items() if kept.get(group_id) != stamp)
    stale = [row for chunk in chunks(changed)
             for row in conn.execute(select(groups).where(groups.c.id.in_(chunk), still)).mappings()]
    decided = decisions(conn, settings, stale)
    expiring = {group_id: decision for group_id, decision in decided.items() if decision.state == "open"}
    for chunk in chunks(sorted(expiring)):
        # still stale: a span or reward another replica committed since keeps it open
        query = select(groups.c.id).where(groups.c.id.in_(chunk), still).order_by(groups.c.id)
        locked = conn.execute(query.with_for_update(skip_locked=True)).scalars().all()
        _expire(conn, settings, {group_id: expiring[group_id] for group_id in locked}, now)
    again = set(stamps).difference(changed).union(group_id for group_id in decided if group_id not in expiring)
    return {group_id: stamps[group_id] for group_id in again}


def maintain_groups(
    conn: Connection, settings: CollectorSettings, group_ids: Collection[str | None], now: float
) -> set[str]:
    """The upkeep due on the groups `group_ids` (a None is no group), which the caller holds (`lock_groups`) and is
    about to mark active (a trajectory, span or reward for them): done as `maintain` would have done it, had a read come
    when it fell due (upkeep runs before reads, not writes). Their idle members complete (`_idle`), then those of them
    that are stale and not ready expire, before the write counts as their activity: a reward or a span after the
    timeout kept a group open, to take its key's next trajectories, unless a read had expired it first. Only the groups
    a write marks active: one it does not keeps its time and expires on the next read, as it would have. Expired
    leases are left to `maintain`. Returns the ids of the trajectories completed."""
    ids = sorted({group_id for group_id in group_ids if group_id is not None})
    idle = _idle(settings, now)
    found: list[str] = []
    for chunk in chunks(ids):
        found += conn.execute(select(trajectories.c.id).where(trajectories.c.group_id.in_(chunk), idle)).scalars()
    _complete_idle(conn, idle, found)
    if settings.group_timeout_seconds > 0:
        stale = _stale(settings, now)
        for chunk in chunks(ids):  # rows the caller holds: none to skip, none changed by another since
            overdue = list(conn.execute(select(groups).where(groups.c.id.in_(chunk), stale)).mappings())
            _expire(conn, settings, _not_ready(conn, settings, overdue), now)
    return set(found)


def maintain(
    conn: Connection, settings: CollectorSettings, now: float, lock: Lock, *, releasing: Collection[str] = (),
    acking: Collection[str] = (), kept: Kept | None = None,
) -> Kept:
    """Return expired leases (a failed attempt for each group); complete idle trajectories without rollout span;
    expire stale groups, deciding again only those not `kept` unchanged by an earlier upkeep under `settings`
    (`_expire_stale`); returns the stale groups kept now (`Kept`), for the next upkeep once this transaction commits.
    First, before any row lock, the locks of the members given back are taken (`_lock_returned_members`), with those
    of `releasing`: the batches the caller gives back next in its transaction; then, in one pass in id order
    (`_lock_batches`), the rows of the expired batches, of `releasing` and of `acking` (the batch the caller acks
    next); then, in one pass in id order (`lock_groups`), the rows of the groups given back or holding an idle
    trajectory, with those of `releasing` and `acking` when there are any. A stale group is expired only when no other
    transaction holds it (`_expire_stale`)."""
    expired = sorted(
        conn.execute(
            select(batches.c.id).where(batches.c.state == "leased", batches.c.lease_expires_at <= now)
        ).scalars()
    )
    _lock_returned_members(conn, lock, sorted({*expired, *releasing}))
    _lock_batches(conn, [*expired, *releasing, *acking])
    for chunk in chunks(expired):
        # only batches still leased: another replica may have acked or released one since the select
        conn.execute(
            batches.update()
            .where(batches.c.id.in_(chunk), batches.c.state == "leased")
            .values(state="expired", reason=LEASE_EXPIRED)
        )
    idle = _idle(settings, now)
    found = conn.execute(select(trajectories.c.id, trajectories.c.group_id).where(idle)).all()
    changing = [*_leased_by(conn, expired), *(row.group_id for row in found)]
    if changing:  # the caller's groups too: locked after these, out of id order, they made a cycle of waits with an
        changing += _batch_groups(conn, [*releasing, *acking])  # export or reward locking both (a deadlock, retried)
    lock_groups(conn, changing)
    for chunk in chunks(expired):
        give_back(conn, settings, chunk, failed=True, error=LEASE_EXPIRED, now=now)
        log.warning("leases expired, groups back in the pool: batches %s", ", ".join(chunk))
    _complete_idle(conn, idle, [row.id for row in found])
    if settings.group_timeout_seconds > 0:
        return _expire_stale(conn, settings, now, kept or {})
    return {}


class Upkeep(Protocol):
    """`maintain` bound by the store to its settings, its locks and the stale groups its last upkeep kept (`Kept`),
    which it remembers once the transaction committed: what a lease, an ack or a release runs first
    (`leases.take`)."""

    def __call__(
        self, conn: Connection, now: float, *, releasing: Collection[str] = (), acking: Collection[str] = ()
    ) -> None:
        """Run `maintain` in `conn` at `now`, with the batches the caller gives back (`releasing`) or acks (`acking`)
        next."""
