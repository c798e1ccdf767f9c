"""The collector's store: spans in, trajectories, groups and batch leases out.

`Store` is the interface; `SqlStore` implements it with SQLAlchemy Core, portable SQL with
dialect-specific locking (see `collector.transactions`): on SQLite (WAL, `synchronous=FULL`)
one writer at a time; on PostgreSQL concurrent transactions, advisory locks per trajectory
and group key, and leases that take group rows with `FOR UPDATE SKIP LOCKED`, so several
collector replicas on one database never lease a group twice. Every write method returns
only after its transaction committed.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from collector import assembly, pool
from collector.config import CollectorSettings
from collector.engine import chunks, make_engine
from collector.errors import Conflict, InvalidRequest, NotFound
from collector.groups import Decision, capacity
from collector.otlp import SpanRecord
from collector.protocol import AckResponse, Batch, BatchRequest, Group, GroupStatus, RewardAccepted, RewardIn, Trajectory
from collector.schema import batch_groups, batches, groups, migrate, rewards, spans, trajectories
from collector.transactions import GROUP_LOCKS, TRAJECTORY_LOCKS, Transactions

__all__ = ["SqlStore", "Store"]

log = logging.getLogger(__name__)


class Store(ABC):
    """What the HTTP layer needs from storage. Implementations share `tests/collector/test_store.py`."""

    @abstractmethod
    def setup(self) -> None:
        """Create or migrate the schema. Idempotent."""

    @abstractmethod
    def add_spans(self, records: list[SpanRecord]) -> int:
        """Store spans (duplicates ignored) and update their trajectories; returns how many were new."""

    @abstractmethod
    def add_reward(self, reward: RewardIn) -> RewardAccepted:
        """Store a reward posted by API; it applies now or when the trajectory's spans arrive."""

    @abstractmethod
    def lease(self, request: BatchRequest) -> Batch:
        """Lease ready groups to one trainer, atomically; an empty batch when none are ready."""

    @abstractmethod
    def ack(self, batch_id: str, policy_step: int | None) -> AckResponse:
        """Mark a batch's groups trained. Raises `NotFound`, or `Conflict` when they were re-leased."""

    @abstractmethod
    def trajectory(self, trajectory_id: str) -> Trajectory | None:
        """One assembled trajectory, or None."""

    @abstractmethod
    def trajectories(self, *, group: str | None = None, task: str | None = None, split: str | None = None) -> list[Trajectory]:
        """Assembled trajectories matching every filter given (`group`: group id or group key)."""

    @abstractmethod
    def groups(self) -> list[GroupStatus]:
        """Every non-empty group with its readiness."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""


class SqlStore(Store):
    """`Store` on SQLAlchemy Core. `clock` returns Unix time (injectable for tests)."""

    def __init__(self, settings: CollectorSettings, *, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.clock = clock
        self.engine = make_engine(settings.db)
        self.training = settings.training_reward
        self._tx = Transactions(self.engine)

    # --- plumbing -----------------------------------------------------------------------
    def _insert(self, table: Any) -> Any:
        return (postgresql if self._tx.postgres else sqlite).insert(table)

    def setup(self) -> None:
        """Create or migrate the schema. Idempotent."""
        before = migrate(self.engine)
        log.info("collector store %s ready (schema was version %d)", self.engine.url.render_as_string(), before)

    def close(self) -> None:
        """Release connections."""
        self.engine.dispose()

    # --- ingest -------------------------------------------------------------------------
    def add_spans(self, records: list[SpanRecord]) -> int:
        """Store spans (duplicates ignored) and update their trajectories; returns how many were new.

        Raises:
            InvalidRequest: a span has a problem (`assembly.span_problem`); nothing is stored.
        """
        unique = list({r.span_id: r for r in records}.values())
        for record in unique:
            if problem := assembly.span_problem(record):
                raise InvalidRequest(f"span {record.span_id}: {problem}", code="invalid_span")
        return self._tx.run(lambda conn: self._add_spans(conn, unique)) if unique else 0

    def _add_spans(self, conn: Connection, unique: list[SpanRecord]) -> int:
        now = self.clock()
        keys = sorted({assembly.trajectory_key(r) for r in unique})
        self._tx.lock(conn, TRAJECTORY_LOCKS, [key for key, _ in keys])
        rows = [
            {
                "span_id": r.span_id,
                "trace_id": r.trace_id,
                "trajectory_id": assembly.trajectory_key(r)[0],
                "name": r.name,
                "start_ns": r.start_ns,
                "end_ns": r.end_ns,
                "record": json.dumps(r.to_dict()),
                "received_at": now,
            }
            for r in unique
        ]
        insert = self._insert(spans).on_conflict_do_nothing(index_elements=["span_id"]).returning(spans.c.span_id)
        inserted = set(conn.execute(insert, rows).scalars())
        new = [r for r in unique if r.span_id in inserted]
        if not new:
            return 0
        reward_rows = [
            {
                "rollout_id": key if by_rollout else None, "trace_id": record.trace_id, "name": reward.name,
                "value": reward.value, "source": "span", "created_at": now, "span_id": record.span_id,
                "time_ns": reward.time_ns,
            }
            for record in new
            for key, by_rollout in [assembly.trajectory_key(record)]
            for reward in assembly.span_rewards(record)
        ]
        if reward_rows:
            conn.execute(rewards.insert(), reward_rows)
        changed = sorted({assembly.trajectory_key(r) for r in new})
        found = {key: assembly.facts(key, self._spans_of(conn, key)) for key, _ in changed}
        self._tx.lock(conn, GROUP_LOCKS, [f.group_key for f in found.values()])
        for key, by_rollout in changed:
            self._refresh_trajectory(conn, key, by_rollout, found[key], now)
        return len(new)

    def _spans_of(self, conn: Connection, trajectory_id: str) -> list[SpanRecord]:
        rows = conn.execute(select(spans.c.record).where(spans.c.trajectory_id == trajectory_id)).scalars()
        return [SpanRecord.from_dict(json.loads(row)) for row in rows]

    def _refresh_trajectory(
        self, conn: Connection, key: str, by_rollout: bool, facts: assembly.TrajectoryFacts, now: float
    ) -> None:
        """Update a trajectory row from its spans' facts; place it in a group once its key is known."""
        row = conn.execute(select(trajectories).where(trajectories.c.id == key)).mappings().first()
        if row is None and not by_rollout and not facts.has_llm:
            return  # spans outside any rollout become a trajectory only with a model call
        group_id = row["group_id"] if row else None
        key_known = facts.has_rollout_span or not by_rollout
        if key_known and (group_id is None or row["group_key"] != facts.group_key):
            current = conn.execute(select(groups.c.state).where(groups.c.id == group_id)).scalar() if group_id else None
            if current in (None, "open"):
                group_id = self._assign_group(conn, key, facts, now)
        values = {
            "trace_id": facts.trace_id,
            "group_key": facts.group_key if key_known else None,
            "group_id": group_id,
            "task": facts.task,
            "split": facts.split,
            "complete": facts.has_rollout_span if by_rollout else bool(row and row["complete"]),
            "updated_at": now,
        }
        if row is None:
            conn.execute(trajectories.insert().values(id=key, by_rollout=by_rollout, created_at=now, **values))
        else:
            conn.execute(trajectories.update().where(trajectories.c.id == key).values(**values))
        if group_id is not None:  # activity keeps an open group from expiring
            conn.execute(groups.update().where(groups.c.id == group_id, groups.c.state == "open").values(updated_at=now))

    def _assign_group(self, conn: Connection, trajectory_id: str, facts: assembly.TrajectoryFacts, now: float) -> str:
        """The open instance of the trajectory's group key with room left, else a new instance."""
        candidates = conn.execute(  # FOR UPDATE: wait for a lease of the group to commit, then re-check
            select(groups)
            .where(groups.c.key == facts.group_key, groups.c.state == "open")
            .order_by(groups.c.created_at, groups.c.id)
            .with_for_update()
        ).mappings().all()
        for group in candidates:
            hint = group["size_hint"] or facts.group_size
            cap = capacity(group["explicit"], hint, self.settings.min_group_size)
            members = conn.execute(
                select(func.count()).where(trajectories.c.group_id == group["id"], trajectories.c.id != trajectory_id)
            ).scalar_one()
            if cap is None or members < cap:
                if group["size_hint"] is None and facts.group_size is not None:
                    conn.execute(groups.update().where(groups.c.id == group["id"]).values(size_hint=facts.group_size))
                return str(group["id"])
        taken = conn.execute(select(func.count()).where(groups.c.key == facts.group_key)).scalar_one()
        group_id, n = facts.group_key, taken + 1
        while conn.execute(select(groups.c.id).where(groups.c.id == group_id)).first() is not None:
            group_id, n = f"{facts.group_key}#{n}", n + 1
        conn.execute(
            groups.insert().values(
                id=group_id, key=facts.group_key, task=facts.task, explicit=facts.explicit_group,
                size_hint=facts.group_size, state="open", created_at=now, updated_at=now,
            )
        )
        return group_id

    def add_reward(self, reward: RewardIn) -> RewardAccepted:
        """Store a reward posted by API; it applies now or when the trajectory's spans arrive."""
        if not reward.rollout_id and not reward.trace_id:
            raise InvalidRequest("a reward needs `rollout_id` or `trace_id`")
        known = self._tx.run(lambda conn: self._add_reward(conn, reward))
        return RewardAccepted(**reward.model_dump(), trajectory_known=known)

    def _add_reward(self, conn: Connection, reward: RewardIn) -> bool:
        now = self.clock()
        conn.execute(
            rewards.insert().values(
                rollout_id=reward.rollout_id or None, trace_id=reward.trace_id or None,
                name=reward.name, value=reward.value, source="api", created_at=now,
            )
        )
        match = trajectories.c.id == reward.rollout_id if reward.rollout_id else trajectories.c.trace_id == reward.trace_id
        group_ids = set(conn.execute(select(trajectories.c.group_id).where(match)).scalars()) - {None}
        if group_ids:  # a new reward may give a skipped group its spread back; it is activity too
            conn.execute(
                groups.update()
                .where(groups.c.id.in_(group_ids), groups.c.state.in_(("skipped", "open")))
                .values(state="open", reason=None, updated_at=now)
            )
        return conn.execute(select(func.count()).where(match)).scalar_one() > 0

    # --- reading ------------------------------------------------------------------------
    def _assemble(self, conn: Connection, rows: list[Any]) -> list[Trajectory]:
        named = pool.rewards_of(conn, rows)
        return [
            assembly.assemble(
                row["id"], self._spans_of(conn, row["id"]), group_id=row["group_id"] or "",
                complete=bool(row["complete"]), rewards=named[row["id"]], training=self.training,
            )
            for row in rows
        ]

    def _read(self, work: Callable[[Connection], Any]) -> Any:
        def run(conn: Connection) -> Any:
            pool.maintain(conn, self.settings, self.clock())
            return work(conn)

        return self._tx.run(run)

    def trajectory(self, trajectory_id: str) -> Trajectory | None:
        """One assembled trajectory, or None."""

        def work(conn: Connection) -> Trajectory | None:
            row = conn.execute(select(trajectories).where(trajectories.c.id == trajectory_id)).mappings().first()
            return self._assemble(conn, [row])[0] if row else None

        return self._read(work)

    def trajectories(self, *, group: str | None = None, task: str | None = None, split: str | None = None) -> list[Trajectory]:
        """Assembled trajectories matching every filter given (`group`: group id or group key)."""
        query = select(trajectories).order_by(trajectories.c.created_at, trajectories.c.id)
        if group is not None:
            query = query.where(or_(trajectories.c.group_id == group, trajectories.c.group_key == group))
        if task is not None:
            query = query.where(trajectories.c.task == task)
        if split is not None:
            query = query.where(trajectories.c.split == split)
        return self._read(lambda conn: self._assemble(conn, list(conn.execute(query).mappings())))

    def groups(self) -> list[GroupStatus]:
        """Every non-empty group with its readiness (`ready` is computed, not stored)."""

        def work(conn: Connection) -> tuple[list[Any], dict[str, list[Any]], dict[str, dict[str, float]], dict[str, Decision]]:
            every = list(conn.execute(select(groups).order_by(groups.c.created_at, groups.c.id)).mappings())
            members = pool.group_members(conn, [g["id"] for g in every])
            named = pool.rewards_of(conn, [row for rows in members.values() for row in rows])
            return every, members, named, pool.decisions(conn, self.settings, [g for g in every if g["state"] == "open"])

        every, members, named, decisions = self._read(work)
        out = []
        for group in every:
            rows = members[group["id"]]
            if not rows:
                continue
            state, reason = group["state"], group["reason"]
            if group["id"] in decisions:
                state, reason = decisions[group["id"]].state, decisions[group["id"]].reason
            out.append(
                GroupStatus(
                    id=group["id"], task=group["task"], size=len(rows), complete=sum(bool(r["complete"]) for r in rows),
                    rewarded=sum(self.training.of(named[r["id"]]) is not None for r in rows), state=state, reason=reason,
                )
            )
        return out

    # --- leases -------------------------------------------------------------------------
    def lease(self, request: BatchRequest) -> Batch:
        """Lease ready groups to one trainer, atomically; an empty batch when none are ready."""
        batch = self._tx.run(lambda conn: self._lease(conn, request))
        if batch.groups:
            log.info("leased %d groups to %s as batch %s", len(batch.groups), request.trainer or "a trainer", batch.id)
        return batch

    def _lease(self, conn: Connection, request: BatchRequest) -> Batch:
        now = self.clock()
        pool.maintain(conn, self.settings, now)
        open_groups = list(conn.execute(select(groups).where(groups.c.state == "open")).mappings())
        ready = []
        for group_id, decision in pool.decisions(conn, self.settings, open_groups).items():
            if decision.state == "skipped":
                conn.execute(
                    groups.update()
                    .where(groups.c.id == group_id, groups.c.state == "open")
                    .values(state="skipped", reason=decision.reason, updated_at=now)
                )
            elif decision.state == "ready":
                ready.append(group_id)
        taken: list[Any] = []
        for chunk in chunks(ready):  # lock what is still open; rows another lease holds are skipped
            query = (
                select(groups).where(groups.c.id.in_(chunk), groups.c.state == "open")
                .order_by(groups.c.created_at, groups.c.id).limit(request.max_groups - len(taken))
                .with_for_update(skip_locked=True)
            )
            taken += conn.execute(query).mappings().all()
            if len(taken) >= request.max_groups:
                break
        taken = sorted(taken, key=lambda g: (g["created_at"], g["id"]))[: request.max_groups]
        if len(taken) < request.min_groups:
            taken = []
        batch_id, expires = uuid.uuid4().hex, now + request.lease_seconds
        conn.execute(
            batches.insert().values(id=batch_id, trainer=request.trainer, state="leased", created_at=now, lease_expires_at=expires)
        )
        for group in taken:
            conn.execute(
                update(groups).where(groups.c.id == group["id"]).values(state="leased", batch_id=batch_id, reason=None, updated_at=now)
            )
            conn.execute(batch_groups.insert().values(batch_id=batch_id, group_id=group["id"]))
        members = pool.group_members(conn, [g["id"] for g in taken])
        out = [Group(id=g["id"], task=g["task"], trajectories=self._assemble(conn, members[g["id"]])) for g in taken]
        return Batch(id=batch_id, groups=out, lease_expires_at=expires)

    def ack(self, batch_id: str, policy_step: int | None) -> AckResponse:
        """Mark a batch's groups trained. Raises `NotFound`, or `Conflict` when they were re-leased."""
        return self._tx.run(lambda conn: self._ack(conn, batch_id, policy_step))

    def _ack(self, conn: Connection, batch_id: str, policy_step: int | None) -> AckResponse:
        now = self.clock()
        pool.maintain(conn, self.settings, now)
        batch = conn.execute(select(batches).where(batches.c.id == batch_id).with_for_update()).mappings().first()
        if batch is None:
            raise NotFound(f"no batch {batch_id!r}; lease one with POST /v1/batches")
        ids = sorted(conn.execute(select(batch_groups.c.group_id).where(batch_groups.c.batch_id == batch_id)).scalars())
        if batch["state"] == "acked":
            return AckResponse(batch_id=batch_id, groups=ids, policy_step=batch["policy_step"])
        rows = list(conn.execute(select(groups).where(groups.c.id.in_(ids)).with_for_update()).mappings()) if ids else []
        lost = [g["id"] for g in rows if not (g["state"] == "open" or g["batch_id"] == batch_id)]
        if lost:
            raise Conflict(
                f"the lease of batch {batch_id} expired and groups {', '.join(sorted(lost))} were leased again; "
                "discard this batch's update or lease with a longer lease_seconds",
                code="lease_expired",
            )
        if ids:
            conn.execute(
                groups.update().where(groups.c.id.in_(ids)).values(state="trained", batch_id=batch_id, reason=None, updated_at=now)
            )
        conn.execute(batches.update().where(batches.c.id == batch_id).values(state="acked", acked_at=now, policy_step=policy_step))
        return AckResponse(batch_id=batch_id, groups=ids, policy_step=policy_step)
