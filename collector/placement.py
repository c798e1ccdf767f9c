"""Trajectory rows and their group instances, written for a whole export at once.

Functions over an open transaction; `SqlStore` calls them with the trajectory ids and group
keys locked. Placement reads the open instances of every key involved, their member counts
and the instances taken so far in a few queries, places each trajectory in memory, then
writes new instances and trajectory rows in one statement each: the cost grows with the
export, not with one round trip per trajectory. Another instrumentation's calls in rollouts' traces make no
trajectory (`foreign_deletion`), and the order row locks are taken in is `rows`'s.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from sqlalchemy import Connection, bindparam, func, or_, select

from collector import pool
from collector.assembly import FactsDigest, TrajectoryFacts
from collector.config import CollectorSettings
from collector.engine import chunks
from collector.foreign_deletion import without_foreign_calls_in_rollouts
from collector.groups import capacity
from collector.rows import counts
from collector.schema import groups, trajectories
from collector.transactions import RetryTransaction, last_try

__all__ = ["groups_changed", "place", "write_trajectories"]

log = logging.getLogger(__name__)


def _open_instances(conn: Connection, keys: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Open group instances per key of `keys`, oldest first. The export locked them, with every other group it
    changes, in one pass in id order (`groups_changed`), so a concurrent lease committed first. One opened since (given
    back, or reopened by a reward) is locked here only when no other transaction holds it (`SKIP LOCKED` never waits):
    waiting for it, out of id order, made a cycle of waits with a reward locking it and one the export held (a
    deadlock, retried); left out when free, a trajectory went to a new instance beside a reopened one with room. One
    another transaction holds has the export tried again (`RetryTransaction`), whose lock pass waits for it in id
    order; on the last try it is left out."""
    found: dict[str, list[dict[str, Any]]] = {key: [] for key in keys}
    for chunk in chunks(keys):
        query = select(groups).where(groups.c.key.in_(chunk), groups.c.state == "open")
        taken = list(conn.execute(query.with_for_update(skip_locked=True)).mappings())
        if conn.dialect.name == "postgresql" and not last_try():  # SQLite: one writer, nothing is held by another
            held = set(conn.execute(select(groups.c.id).where(query.whereclause)).scalars()) - {g["id"] for g in taken}
            if held:  # reopened since, and held a moment by a reward: the next try's lock pass waits for it in order
                raise RetryTransaction(f"open group {sorted(held)[0]!r} reopened while the export placed")
        for row in taken:
            found[row["key"]].append(dict(row))
    for instances in found.values():
        instances.sort(key=lambda group: (group["created_at"], group["id"]))
    return found


def groups_changed(
    conn: Connection,
    found: dict[tuple[str, bool], TrajectoryFacts],
    digests: dict[tuple[str, bool], FactsDigest],
    existing: dict[str, Any],
    rollout_traces: set[str],
) -> set[str]:
    """Ids of the groups that `write_trajectories` may change besides those of `existing`'s rows: the open instances
    of the keys it may place a trajectory under (`_open_instances`), and the groups of the trajectories of another
    instrumentation's calls stored in the traces of the export's rollout spans (`rollout_traces`,
    `foreign_deletion._delete_foreign`).
    The caller locks them with the others it changes, in one pass in id order (`pool.lock_groups`), before
    `write_trajectories` locks any: locked there, after those, they made a cycle of waits with a reward locking them
    all in id order."""
    found, _ = _one_row_per_id(found, digests)
    keys = sorted({facts.group_key for (key, by_rollout), facts in found.items()
                   if _may_move(existing.get(key), facts, by_rollout)})
    changed: set[str] = set()
    for chunk in chunks(keys):
        # the state is filtered here: in the query it made this lookup about 4 times slower on PostgreSQL (5,000 groups)
        query = select(groups.c.id, groups.c.state).where(groups.c.key.in_(chunk))
        changed.update(group_id for group_id, state in conn.execute(query) if state == "open")
    for chunk in chunks(sorted(rollout_traces - {key for key, _ in found})):
        foreign = trajectories.c.id.in_(chunk), trajectories.c.by_rollout.is_(False)
        changed.update(conn.execute(select(trajectories.c.group_id).where(*foreign)).scalars())
    return changed - {None}


def _may_move(row: Any, facts: TrajectoryFacts, by_rollout: bool) -> bool:
    """Whether a trajectory of an export, stored as `row` (None: new), is to be placed in a group of its key
    (`write_trajectories`; unless the group it is in is leased or trained, which keeps its members)."""
    key_known = facts.has_rollout_span or not by_rollout
    return (
        key_known
        and (facts.has_llm or facts.explicit_group)
        and (row is None or row["group_id"] is None or row["group_key"] != facts.group_key)
    )


def _members(conn: Connection, group_ids: list[str]) -> tuple[Counter[str], dict[str, set[str]]]:
    """Trajectories in each group of `group_ids`, and their splits (for the groups that have any)."""
    counts: Counter[str] = Counter()
    splits: dict[str, set[str]] = {}
    for chunk in chunks(group_ids):
        query = (
            select(trajectories.c.group_id, trajectories.c.split, func.count())
            .where(trajectories.c.group_id.in_(chunk)).group_by(trajectories.c.group_id, trajectories.c.split)
        )
        for group_id, split, n in conn.execute(query):
            counts[group_id] += n
            splits.setdefault(group_id, set()).add(split)
    return counts, splits


def _still_open(conn: Connection, settings: CollectorSettings, group: dict[str, Any], now: float) -> bool:
    """Whether the open instance `group` (a row of `_open_instances`), about to take a trajectory, is open still once
    the upkeep due on it is done (`pool.maintain_groups`), as a read would have done it: one that got no span or
    reward for `settings.group_timeout_seconds` and is not ready expires first, and takes none. Decided once: one open
    still takes the trajectory, activity dated `now` (`write_trajectories`), as `group` then says."""
    timeout = settings.group_timeout_seconds
    if group["state"] == "open" and timeout > 0 and group["updated_at"] <= now - timeout:
        pool.maintain_groups(conn, settings, [group["id"]], now)
        group["state"] = conn.execute(select(groups.c.state).where(groups.c.id == group["id"])).scalar_one()
        group["updated_at"] = now
    return group["state"] == "open"


def place(
    conn: Connection, wanted: list[tuple[str, TrajectoryFacts]], *, settings: CollectorSettings, now: float
) -> dict[str, str]:
    """The group instance of each trajectory in `wanted` (id, facts), by trajectory id.

    Each goes to the oldest open instance of its group key with room left (see
    `groups.capacity`: an explicit group without a size has none past `min_group_size` once a newer
    instance of its key opened), else to a new instance: the key, then `key#2`, `key#3` ... An instance
    the collector formed (by task or trace, not `art.group`) holds trajectories of one split, so
    evaluation runs of a task never hold up its training. A trajectory here is in no instance of
    its key yet (it has no group, or one of another key). An instance overdue for expiry expires first
    (`_still_open`), as a read would have expired it.
    """
    min_group_size = settings.min_group_size
    keys = sorted({facts.group_key for _, facts in wanted})
    instances = _open_instances(conn, keys)
    members, splits = _members(conn, [g["id"] for found in instances.values() for g in found])
    taken = counts(conn, groups.c.key, keys)
    newest = _newest(conn, instances)
    in_use = _ids_in_use(conn, Counter(facts.group_key for _, facts in wanted), taken)
    placed: dict[str, str] = {}
    hints: dict[str, int] = {}
    created: list[dict[str, Any]] = []
    for trajectory_id, facts in wanted:
        for group in instances[facts.group_key]:
            followed = group["created_at"] < newest.get(facts.group_key, group["created_at"])
            cap = capacity(group["explicit"], group["size_hint"] or facts.group_size, min_group_size, followed=followed)
            other_split = not group["explicit"] and splits.get(group["id"], {facts.split}) != {facts.split}
            room = (cap is None or members[group["id"]] < cap) and not other_split
            if room and _still_open(conn, settings, group, now):  # the upkeep due on it, only once it has room
                if group["size_hint"] is None and facts.group_size is not None:
                    group["size_hint"] = hints[group["id"]] = facts.group_size
                break
        else:
            group = _new_instance(conn, facts, _first_suffix(taken[facts.group_key]), in_use, now)
            taken[facts.group_key] += 1
            created.append(group)
            instances[facts.group_key] = sorted(
                [*instances[facts.group_key], group], key=lambda g: (g["created_at"], g["id"])
            )
        members[group["id"]] += 1
        splits.setdefault(group["id"], set()).add(facts.split)
        placed[trajectory_id] = group["id"]
    if created:
        conn.execute(groups.insert(), created)
    hinted = [{"group": gid, "hint": hint} for gid, hint in hints.items() if gid not in {g["id"] for g in created}]
    if hinted:
        conn.execute(
            groups.update().where(groups.c.id == bindparam("group")).values(size_hint=bindparam("hint")), hinted
        )
    return placed


def _newest(conn: Connection, instances: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """When the newest instance of each key (in any state) was created, for the keys with an open explicit instance
    without a size in `instances` (`_open_instances`): an instance created after that one opened while it was out of
    the pool (`groups.capacity`'s `followed`). By creation time, as `_open_instances` orders instances: one created at
    the same time counts as no newer. Only these keys are read: the read visits every instance of a key, and an
    implicit key (a task's) has one per few trajectories. An open instance `_open_instances` left out (held by another
    transaction on the export's last try) counts as none: it would leave every instance of its key in `instances`
    followed, and the export opened yet another beside it, the newest from then on."""
    keys = [key for key, found in instances.items() if any(g["explicit"] and g["size_hint"] is None for g in found)]
    newest: dict[str, float] = {}
    for chunk in chunks(sorted(keys)):
        taken = [g["id"] for key in chunk for g in instances[key]]
        query = select(groups.c.key, func.max(groups.c.created_at)).where(
            groups.c.key.in_(chunk), or_(groups.c.state != "open", groups.c.id.in_(taken))
        )
        newest.update(dict(conn.execute(query.group_by(groups.c.key)).all()))
    return newest


def _first_suffix(instances: int) -> int:
    """The first `n` of `key#n` a new instance of a key with `instances` so far tries: the next, from 2 on (the first
    instance is the key itself, taken by another key's instance when a new key's is `#2`, say)."""
    return max(2, instances + 1)


def _ids_in_use(conn: Connection, wanted: Counter[str], taken: Counter[str]) -> dict[str, bool]:
    """Whether each id that `place` may give a new instance first is a group's: per key of `wanted` (trajectories to
    place per key), the key and `key#n` for n past the key's instances `taken`, one per trajectory, in one query per
    chunk; `_new_instance` looks up any other id it comes to (those ids were taken)."""
    ids = sorted({*wanted, *(f"{key}#{_first_suffix(taken[key]) + i}" for key, n in wanted.items() for i in range(n))})
    in_use = dict.fromkeys(ids, False)
    for chunk in chunks(ids):
        in_use.update(dict.fromkeys(conn.execute(select(groups.c.id).where(groups.c.id.in_(chunk))).scalars(), True))
    return in_use


def _new_instance(
    conn: Connection, facts: TrajectoryFacts, n: int, in_use: dict[str, bool], now: float
) -> dict[str, Any]:
    """A new open instance of the facts' group key: the key itself, else the first free `key#n`. `in_use`: whether an
    id is taken (a group's, or an instance's made before in the export), as far as known; updated."""
    group_id = facts.group_key
    while _id_taken(conn, group_id, in_use):
        group_id, n = f"{facts.group_key}#{n}", n + 1
    in_use[group_id] = True
    return {
        "id": group_id, "key": facts.group_key, "task": facts.task, "explicit": facts.explicit_group,
        "size_hint": facts.group_size, "state": "open", "reason": None, "batch_id": None,
        "created_at": now, "updated_at": now,
    }


def _id_taken(conn: Connection, group_id: str, in_use: dict[str, bool]) -> bool:
    """Whether `group_id` is taken: as `in_use` says, else looked up (and noted there)."""
    if group_id not in in_use:
        in_use[group_id] = conn.execute(select(groups.c.id).where(groups.c.id == group_id)).first() is not None
    return in_use[group_id]


def _one_row_per_id(
    found: dict[tuple[str, bool], TrajectoryFacts], digests: dict[tuple[str, bool], FactsDigest]
) -> tuple[dict[tuple[str, bool], TrajectoryFacts], dict[tuple[str, bool], FactsDigest]]:
    """`found` and `digests` with one entry per trajectory id.

    A rollout id that is also the id of a trace of model calls outside any rollout names one row (and one set of
    spans): the rollout's trajectory, from both digests.
    """
    shared = {key for key, by_rollout in found if by_rollout and (key, False) in found}
    if not shared:
        return found, digests
    found, digests = dict(found), dict(digests)
    for key in sorted(shared):
        merged = FactsDigest.from_json(digests[key, True].to_json())  # a copy: the caller's digest stays as it was
        merged.merge(digests.pop((key, False)))
        del found[key, False]
        digests[key, True], found[key, True] = merged, merged.facts(key)
    return found, digests


def write_trajectories(
    conn: Connection,
    found: dict[tuple[str, bool], TrajectoryFacts],
    digests: dict[tuple[str, bool], FactsDigest],
    existing: dict[str, Any],
    *,
    rollout_traces: set[str],
    settings: CollectorSettings,
    now: float,
) -> None:
    """Write the rows of an export's trajectories and place each in a group once its group key is known.

    A trajectory without a model call (`TrajectoryFacts.has_llm`) in no group the app named, such as a prompt
    template run on its own (the plugin gives every top-level run a rollout), has nothing to train on or judge
    and joins no group. One in a group the app named (`art.group`), e.g. an attempt that failed before calling the
    model, stays its member: the app counted it, and its reward belongs beside the others'.
    Nor does another instrumentation's model calls in a rollout's trace make a trajectory
    (`without_foreign_calls_in_rollouts`).

    Args:
        conn: The export's transaction.
        found: Facts of each trajectory the export touched, by (id, keyed by rollout id).
        digests: The digests the facts came from, stored with the rows.
        existing: Their rows as they were before the export (absent: new).
        rollout_traces: The trace ids of the export's spans of rollouts (keyed by rollout id).
        settings: The collector's settings (group sizes, timeouts: `place`).
        now: The export's time.
    """
    found, digests = _one_row_per_id(found, digests)
    found, digests = without_foreign_calls_in_rollouts(conn, found, digests, existing, rollout_traces, now)
    wanted = []
    for (key, by_rollout), facts in found.items():
        row = existing.get(key)
        if _may_move(row, facts, by_rollout):
            current = (
                conn.execute(select(groups.c.state).where(groups.c.id == row["group_id"])).scalar()
                if row and row["group_id"]
                else None
            )
            if current in (None, "open"):  # a leased or trained group keeps its members
                wanted.append((key, facts))
    placed = place(conn, wanted, settings=settings, now=now)
    inserts, updates = [], []
    for (key, by_rollout), facts in found.items():
        row = existing.get(key)
        key_known = facts.has_rollout_span or not by_rollout
        values = {
            "trace_id": facts.trace_id,
            "group_key": facts.group_key if key_known else None,
            "group_id": placed.get(key, row["group_id"] if row else None),
            "task": facts.task,
            "split": facts.split,
            "complete": facts.has_rollout_span if by_rollout else bool(row and row["complete"]),
            "updated_at": now,
            "digest": digests[key, by_rollout].to_json(),
        }
        if row is None:
            inserts.append({"id": key, "by_rollout": by_rollout, "created_at": now, **values})
        else:
            updates.append({"trajectory": key, **values})
    if inserts:
        conn.execute(trajectories.insert(), inserts)
    if updates:
        columns = {name: bindparam(name) for name in updates[0] if name != "trajectory"}
        conn.execute(trajectories.update().where(trajectories.c.id == bindparam("trajectory")).values(columns), updates)
    active = sorted({v["group_id"] for v in inserts + updates} - {None})
    for chunk in chunks(active):  # activity keeps an open group from expiring
        conn.execute(groups.update().where(groups.c.id.in_(chunk), groups.c.state == "open").values(updated_at=now))
