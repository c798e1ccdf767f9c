"""How a lease begins (ready groups taken for one trainer) and ends: an ack (its groups are trained) or a release
(given back untrained, failures counted); and how an operator puts a group that was given up on back in the pool
(reopen).

Functions over an open transaction; `SqlStore` calls them. An expired lease ends in `pool.maintain`.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import Any

from sqlalchemy import Connection, select

from collector import pool, store_reads
from collector.config import CollectorSettings
from collector.engine import chunks
from collector.errors import Conflict, NotFound
from collector.groups import TrainingReward
from collector.protocol import (
    IDEMPOTENCY_KEY_HEADER,
    AckResponse,
    BatchRequest,
    ReleaseRequest,
    ReleaseResponse,
    ReopenResponse,
)
from collector.schema import batch_groups, batches, groups, trajectories

__all__ = ["REOPENABLE", "ack", "release", "reopen", "take"]

log = logging.getLogger(__name__)

_LEASE_SECONDS_TOLERANCE = 1e-3
"""Seconds a retry's `lease_seconds` may differ from the stored lease's length (`lease_expires_at - created_at`,
rounded as Unix times are)."""
_BOUNDS = ("max_groups", "min_groups")
"""The request's bounds on the groups leased, stored with the batch since schema version 8."""


def _age(group: Any) -> tuple[float, str]:
    """The order groups are leased in: oldest first, then by id."""
    return group["created_at"], group["id"]


def _differences(batch: Any, leased: int, request: BatchRequest) -> list[str]:
    """How `request` differs from the one that leased `batch` (`leased` groups): its `trainer`, `lease_seconds`,
    `max_groups` and `min_groups`; of a batch leased before schema version 8 (no bounds stored), only a bound the
    batch's size breaks."""
    found = []
    if batch["trainer"] != request.trainer:
        found.append(f"trainer {batch['trainer']!r}, not {request.trainer!r}")
    leased_for = batch["lease_expires_at"] - batch["created_at"]
    if not math.isclose(leased_for, request.lease_seconds, abs_tol=_LEASE_SECONDS_TOLERANCE):
        found.append(f"lease_seconds {leased_for:g}, not {request.lease_seconds:g}")
    if batch["max_groups"] is not None:
        found += [f"{bound} {batch[bound]}, not {getattr(request, bound)}" for bound in _BOUNDS
                  if batch[bound] != getattr(request, bound)]
    else:  # leased before schema version 8: only a bound the batch's size breaks shows
        if leased > request.max_groups:
            found.append(f"{leased} groups, more than max_groups {request.max_groups}")
        if leased < request.min_groups:
            found.append(f"{leased} groups, fewer than min_groups {request.min_groups}")
    return found


def _leased_before(conn: Connection, request: BatchRequest) -> tuple[str, float, list[Any]] | None:
    """The batch a request with `request`'s idempotency key leased, as `take` returns it; None when none did.

    Raises:
        Conflict: `idempotency_key_used`, that batch's lease ended (acked, released or expired);
            `idempotency_key_mismatch`, `request` differs from the one that leased it (`_differences`).
    """
    key = request.idempotency_key
    batch = conn.execute(select(batches).where(batches.c.idempotency_key == key)).mappings().first()
    if batch is None:
        return None
    if batch["state"] != "leased":
        raise Conflict(
            f"{IDEMPOTENCY_KEY_HEADER} {key!r} leased batch {batch['id']}, which is {batch['state']} now: its lease "
            "ended; send a new key to lease again",
            code="idempotency_key_used",
        )
    ids = list(conn.execute(select(batch_groups.c.group_id).where(batch_groups.c.batch_id == batch["id"])).scalars())
    if differences := _differences(batch, len(ids), request):
        raise Conflict(
            f"{IDEMPOTENCY_KEY_HEADER} {key!r} leased batch {batch['id']} for another request "
            f"({'; '.join(differences)}): send the same request again to get that batch, or a new key to lease again",
            code="idempotency_key_mismatch",
        )
    rows = list(conn.execute(select(groups).where(groups.c.id.in_(ids))).mappings()) if ids else []
    return batch["id"], batch["lease_expires_at"], sorted(rows, key=_age)


def _lock_oldest(conn: Connection, ids: list[str], limit: int) -> list[Any]:
    """Up to `limit` rows of the groups `ids` (oldest first) that are still open, oldest first, locked until the
    transaction ends; rows another transaction holds are skipped."""
    locked: list[Any] = []
    for chunk in chunks(ids):
        query = (
            select(groups).where(groups.c.id.in_(chunk), groups.c.state == "open")
            .order_by(groups.c.created_at, groups.c.id).limit(limit - len(locked))
            .with_for_update(skip_locked=True)
        )
        locked += conn.execute(query).mappings().all()
        if len(locked) >= limit:
            break
    return sorted(locked, key=_age)[:limit]


def _still_ready(conn: Connection, settings: CollectorSettings, ready: list[str], wanted: int) -> list[Any]:
    """Up to `wanted` of the groups `ready` (ids, oldest first), locked and still ready, oldest first.

    They were decided ready before their rows were locked: another replica may have committed a trajectory or a
    reward to one since, so each is decided again under its lock, and one no longer ready makes room for the next
    of `ready` (another read, only then).
    """
    taken: list[Any] = []
    left = ready
    while left and len(taken) < wanted:
        locked = _lock_oldest(conn, left, wanted - len(taken))
        if not locked:
            break
        again = pool.decisions(conn, settings, locked)
        taken += [g for g in locked if again[g["id"]].state == "ready"]
        tried = {g["id"] for g in locked}
        left = [group_id for group_id in left if group_id not in tried]
    return sorted(taken, key=_age)


def _member_ids(conn: Connection, group_ids: list[str]) -> dict[str, list[str]]:
    """The ids of each group's trajectories, sorted, by group id (ids only: no digests read)."""
    members: dict[str, list[str]] = {group_id: [] for group_id in group_ids}
    for chunk in chunks(group_ids):
        query = select(trajectories.c.group_id, trajectories.c.id).where(trajectories.c.group_id.in_(chunk))
        for group_id, trajectory_id in conn.execute(query):
            members[group_id].append(trajectory_id)
    return {group_id: sorted(ids) for group_id, ids in members.items()}


def take(
    conn: Connection, settings: CollectorSettings, request: BatchRequest, now: float, upkeep: pool.Upkeep,
    training: TrainingReward, listed: store_reads.Listed,
) -> tuple[str, float, list[Any], store_reads.Listed | None]:
    """Lease up to `request.max_groups` ready groups, oldest first: the batch id, when its lease expires, the group
    rows taken (none, and no batch stored, when fewer than `request.min_groups` are ready), and the open groups
    decided (`store_reads.Listed`, for the next listing or lease; None when none were). Open groups decided skipped
    on the way are stored so. Rows another transaction holds are passed over, so replicas on one PostgreSQL never
    lease a group twice. A request whose `idempotency_key` leased a batch before gets that batch again while its
    lease lasts (`_leased_before`; the caller holds the key's lock, `IDEMPOTENCY_LOCKS`). `upkeep`: the store's due
    maintenance, run first (`pool.Upkeep`: expired leases given back, stale groups expired).

    Every open group is decided first, unlocked, as a listing decides it (`store_reads.open_decisions`: one of
    `listed`, what the last listing or lease decided under `settings` and `training`, is not decided again while its
    `Stamp` is unchanged); those that look ready or skipped are decided again under their row locks.

    Raises:
        Conflict: `idempotency_key_used`, the lease of the batch that key leased ended; `idempotency_key_mismatch`,
            that batch was leased for a request with other parameters.
    """
    key = request.idempotency_key
    upkeep(conn, now)
    if key is not None and (before := _leased_before(conn, request)) is not None:
        return *before, None
    open_groups, decided, remembered = store_reads.open_decisions(conn, settings, training, listed, now)
    for chunk in chunks(sorted(group_id for group_id, decision in decided.items() if decision.state == "skipped")):
        # decided before their rows were locked, as the ready ones below: decide again under the lock, lest a
        # reward another replica committed since (one that gives the group its spread) be overwritten
        query = select(groups).where(groups.c.id.in_(chunk), groups.c.state == "open").with_for_update(skip_locked=True)
        for group_id, decision in pool.decisions(conn, settings, list(conn.execute(query).mappings())).items():
            if decision.state == "skipped":
                conn.execute(
                    groups.update().where(groups.c.id == group_id)
                    .values(state="skipped", reason=decision.reason, updated_at=now)
                )
    # oldest first across chunks too: rows come back in storage order, which on PostgreSQL puts a group last
    # once it is updated (back from an expired lease), so the first chunk need not hold the oldest
    ready = [g["id"] for g in sorted(open_groups, key=_age) if decided[g["id"]].state == "ready"]
    taken = _still_ready(conn, settings, ready, request.max_groups)
    batch_id, expires = uuid.uuid4().hex, now + request.lease_seconds
    if len(taken) < request.min_groups:  # nothing leased: no batch to store, none to expire later
        return batch_id, expires, [], remembered
    members = _member_ids(conn, [g["id"] for g in taken])
    conn.execute(
        batches.insert().values(
            id=batch_id, trainer=request.trainer, state="leased", created_at=now, lease_expires_at=expires,
            idempotency_key=key, max_groups=request.max_groups, min_groups=request.min_groups,
            members=json.dumps(members, sort_keys=True),
        )
    )
    for chunk in chunks(sorted(g["id"] for g in taken)):  # one statement of each per chunk, not per group (locked)
        leased = groups.update().where(groups.c.id.in_(chunk))
        conn.execute(leased.values(state="leased", batch_id=batch_id, reason=None, updated_at=now))
        conn.execute(batch_groups.insert().values([{"batch_id": batch_id, "group_id": group_id} for group_id in chunk]))
    return batch_id, expires, taken, remembered


def _locked_batch(conn: Connection, batch_id: str) -> tuple[Any, list[str]]:
    """The batch row, locked until the transaction ends (held already where `pool.maintain` locked it with the
    expired ones, in id order), and its group ids, sorted. Raises `NotFound`."""
    batch = conn.execute(select(batches).where(batches.c.id == batch_id).with_for_update()).mappings().first()
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}; lease one with POST /v1/batches")
    ids = sorted(conn.execute(select(batch_groups.c.group_id).where(batch_groups.c.batch_id == batch_id)).scalars())
    return batch, ids


def _changed_since(conn: Connection, group_ids: list[str], batch: Any) -> list[str]:
    """Groups of `group_ids`, sorted, that differ from what the lease `batch` held when taken: a trajectory joined,
    changed or was deleted after it (`foreign_deletion._delete_foreign` dates the members it leaves; a group it
    empties has none, and a leased group had some), left it for another group (its members are not those the batch
    recorded; a batch leased before schema version 8 recorded none), or a reward stored after it changed a member's
    rewards."""
    since = batch["created_at"]
    recorded = json.loads(batch["members"]) if batch["members"] is not None else None
    members = pool.group_members(conn, group_ids)
    rows = [row for found in members.values() for row in found]
    now, then = pool.rewards_of(conn, rows), pool.rewards_of(conn, rows, until=since)
    return sorted(
        group_id for group_id, found in members.items()
        if not found
        or (recorded is not None and sorted(row["id"] for row in found) != recorded.get(group_id))
        or any(row["updated_at"] > since or now[row["id"]] != then[row["id"]] for row in found)
    )


def ack(
    conn: Connection, settings: CollectorSettings, batch_id: str, policy_step: int | None, now: float,
    upkeep: pool.Upkeep,
) -> AckResponse:
    """Mark a batch's groups trained, recording `policy_step` as sent: steps need not grow from batch to batch (a
    trainer resumed from an older checkpoint, a new run, several trainers). Idempotent: the first ack stands, and an
    ack again answers it; one that claims another step is logged. `upkeep`: as `take`'s.

    Raises:
        NotFound: no such batch.
        Conflict: `lease_expired`, its lease expired and groups were leased again, or changed in the pool since;
            `batch_released`, the trainer released it.
    """
    upkeep(conn, now, acking=[batch_id])
    batch, ids = _locked_batch(conn, batch_id)
    if batch["state"] == "acked":
        if policy_step != batch["policy_step"]:
            log.warning("batch %s acked again with policy step %s; it stays acked with step %s, its first ack's",
                        batch_id, policy_step, batch["policy_step"])
        return AckResponse(batch_id=batch_id, groups=ids, policy_step=batch["policy_step"])
    if batch["state"] == "released":
        raise Conflict(
            f"batch {batch_id} was released ({batch['reason']}) and its groups went back to the pool; "
            "lease them again with POST /v1/batches",
            code="batch_released",
        )
    pool.lock_groups(conn, ids)  # in id order, as an export or a reward locks them
    rows = list(conn.execute(select(groups).where(groups.c.id.in_(ids))).mappings()) if ids else []
    lost = [g["id"] for g in rows if g["batch_id"] not in (None, batch_id)]  # leased or trained by another batch
    if lost:
        raise Conflict(
            f"the lease of batch {batch_id} expired and groups {', '.join(sorted(lost))} were leased again; "
            "discard this batch's update or lease with a longer lease_seconds",
            code="lease_expired",
        )
    # back in the pool since its lease expired (open, or skipped since: at the failed-attempts limit, or for its
    # rewards): the trainer saw them as they were when leased
    back = [g["id"] for g in rows if g["state"] != "leased"]
    changed = _changed_since(conn, back, batch)
    if changed:
        raise Conflict(
            f"the lease of batch {batch_id} expired and groups {', '.join(changed)} changed in the pool since it was "
            "taken (a trajectory or a reward arrived, a trajectory left for another group or was deleted): the pool "
            "keeps them as they are now; discard this batch's update or lease with a longer lease_seconds",
            code="lease_expired",
        )
    if ids:
        conn.execute(
            groups.update()
            .where(groups.c.id.in_(ids))
            .values(state="trained", batch_id=batch_id, reason=None, updated_at=now)
        )
    conn.execute(
        batches.update().where(batches.c.id == batch_id).values(state="acked", acked_at=now, policy_step=policy_step)
    )
    return AckResponse(batch_id=batch_id, groups=ids, policy_step=policy_step)


def release(
    conn: Connection, settings: CollectorSettings, batch_id: str, request: ReleaseRequest, now: float,
    upkeep: pool.Upkeep,
) -> ReleaseResponse:
    """Give a batch's groups back untrained, now (`pool.give_back`); the batch ends `released` with the reason
    (`ReleaseRequest.reason`: storable on every backend). `upkeep`: as `take`'s, told of the batch given back next,
    whose members' locks it takes before any row lock (`pool.maintain`'s `releasing`).

    Only the groups the batch still holds go back and count: after its lease expired (which counted them) none
    do, and a group leased again since is not touched. Releasing a released batch changes nothing and answers
    the same, unless a group was reopened or leased since: the answer reads the groups as they are now.

    Raises:
        NotFound: no such batch.
        Conflict: `batch_acked`, the batch was acked (its groups are trained).
    """
    upkeep(conn, now, releasing=[batch_id])
    batch, ids = _locked_batch(conn, batch_id)
    if batch["state"] == "acked":
        raise Conflict(
            f"batch {batch_id} was acked (policy step {batch['policy_step']}): its groups are trained and stay so",
            code="batch_acked",
        )
    if batch["state"] != "released":
        pool.give_back(conn, settings, [batch_id], failed=request.failed, error=request.reason, now=now)
        conn.execute(batches.update().where(batches.c.id == batch_id).values(state="released", reason=request.reason))
    # skipped with this batch: its failed attempts; skipped without it: emptied as foreign calls (`pool.give_back`)
    now_skipped = dict(conn.execute(
        select(groups.c.id, groups.c.batch_id).where(groups.c.id.in_(ids), groups.c.state == "skipped")
    ).all())
    return ReleaseResponse(
        batch_id=batch_id, returned=[gid for gid in ids if gid not in now_skipped],
        skipped=sorted(gid for gid, by in now_skipped.items() if by == batch_id),
        max_failed_attempts=settings.max_failed_attempts,
    )


REOPENABLE = ("skipped", "expired")
"""Stored states a group can be reopened from: the pool gave up on it (failed trainings, no activity, no reward
spread by the rules of earlier settings); from the others (`open`, `leased`, `trained`) it is in the pool or done."""


def _not_reopenable(conn: Connection, settings: CollectorSettings, row: Any) -> str | None:
    """Why a group in the pool or done cannot be reopened, in the state `GET /v1/groups` shows it in; None for one
    the pool gave up on. A group skipped for its rewards (no batch gave up on it) is in the pool, whether a lease
    stored it skipped or not: a new reward puts it back."""
    group_id, shown = row["id"], row["state"]
    if shown == "expired" or (shown == "skipped" and row["batch_id"] is not None):
        return None
    if shown in ("open", "skipped"):  # shown as decided now: open, ready, or skipped for its rewards
        decision = pool.decisions(conn, settings, [row])[group_id]
        if decision.state == "skipped":
            return (
                f"group {group_id} is skipped ({decision.reason}) but still in the pool: a new or changed reward "
                "puts it back by itself, ready once its rewards differ; reopen is for groups the pool gave up on"
            )
        if shown == "skipped":  # its rewards have a spread by today's settings: given up on by earlier ones
            return None
        shown = decision.state
    return f"group {group_id} is {shown}; only a group in {' or '.join(REOPENABLE)} can be reopened"


def reopen(conn: Connection, settings: CollectorSettings, group_id: str, now: float) -> ReopenResponse:
    """Put a skipped or expired group back in the pool with its failed attempts reset, e.g. once the trainer's
    bug that failed it is fixed; it is leased when it is ready, or skipped again if it still cannot train. The caller
    ends expired leases first, in a transaction of its own (`SqlStore.reopen`): this one locks the group's row alone.

    Raises:
        NotFound: no such group.
        Conflict: `group_not_reopenable`, the group is open, ready, leased or trained, or skipped for its rewards
            while still in the pool (a new reward puts it back).
    """
    row = conn.execute(select(groups).where(groups.c.id == group_id).with_for_update()).mappings().first()
    if row is None:
        raise NotFound(f"no group {group_id!r}; GET /v1/groups lists them")
    if (refused := _not_reopenable(conn, settings, row)) is not None:
        raise Conflict(refused, code="group_not_reopenable")
    conn.execute(
        groups.update().where(groups.c.id == group_id)
        .values(state="open", reason=None, batch_id=None, failed_attempts=0, updated_at=now)
    )
    log.info("group %s reopened from %s (%s; %d failed attempts forgotten)", group_id, row["state"], row["reason"],
             row["failed_attempts"])
    return ReopenResponse(group_id=group_id, previous_state=row["state"], previous_reason=row["reason"],
                          failed_attempts=row["failed_attempts"])
