"""The collector's store: spans in, trajectories, groups and batch leases out.

`Store` is the interface; `SqlStore` implements it with SQLAlchemy Core on SQLite (WAL,
`synchronous=FULL`, one writer at a time) or PostgreSQL (leases take rows with
`FOR UPDATE SKIP LOCKED`). Every write method returns only after its transaction committed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from sqlalchemy import Connection, and_, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from collector import assembly
from collector.config import CollectorSettings
from collector.engine import chunks, make_engine
from collector.errors import Conflict, InvalidRequest, NotFound
from collector.groups import Member, capacity, decide, merge_rewards
from collector.otlp import SpanRecord
from collector.protocol import AckResponse, Batch, BatchRequest, Group, GroupStatus, RewardAccepted, RewardIn, Trajectory
from collector.schema import batch_groups, batches, groups, migrate, rewards, spans, trajectories

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
        self._sqlite = self.engine.dialect.name == "sqlite"
        # SQLite has one writer anyway; serialising in-process avoids busy waits.
        self._lock = threading.RLock() if self._sqlite else None

    # --- plumbing -----------------------------------------------------------------------
    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self._lock or nullcontext(), self.engine.begin() as conn:
            yield conn

    def _insert(self, table: Any) -> Any:
        dialect = sqlite if self._sqlite else postgresql
        return dialect.insert(table)

    def setup(self) -> None:
        """Create or migrate the schema. Idempotent."""
        before = migrate(self.engine)
        log.info("collector store %s ready (schema was version %d)", self.engine.url.render_as_string(), before)

    def close(self) -> None:
        """Release connections."""
        self.engine.dispose()

    # --- ingest -------------------------------------------------------------------------
    def add_spans(self, records: list[SpanRecord]) -> int:
        """Store spans (duplicates ignored) and update their trajectories; returns how many were new."""
        unique = list({r.span_id: r for r in records}.values())
        for record in unique:
            try:
                assembly.span_rewards(record)
            except assembly.InvalidReward as exc:
                raise InvalidRequest(str(exc), code="invalid_reward") from exc
        with self._tx() as conn:
            now = self.clock()
            existing: set[str] = set()
            for chunk in chunks([r.span_id for r in unique]):
                existing |= set(conn.execute(select(spans.c.span_id).where(spans.c.span_id.in_(chunk))).scalars())
            new = [r for r in unique if r.span_id not in existing]
            if not new:
                return 0
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
                for r in new
            ]
            conn.execute(self._insert(spans).on_conflict_do_nothing(index_elements=["span_id"]), rows)
            for record in new:
                key, by_rollout = assembly.trajectory_key(record)
                for name, value in assembly.span_rewards(record):
                    conn.execute(
                        rewards.insert().values(
                            rollout_id=key if by_rollout else None, trace_id=record.trace_id,
                            name=name, value=value, source="span", created_at=now,
                        )
                    )
            for key, by_rollout in sorted({assembly.trajectory_key(r) for r in new}):
                self._refresh_trajectory(conn, key, by_rollout, now)
            return len(new)

    def _spans_of(self, conn: Connection, trajectory_id: str) -> list[SpanRecord]:
        rows = conn.execute(select(spans.c.record).where(spans.c.trajectory_id == trajectory_id)).scalars()
        return [SpanRecord.from_dict(json.loads(row)) for row in rows]

    def _refresh_trajectory(self, conn: Connection, key: str, by_rollout: bool, now: float) -> None:
        """Recompute a trajectory row from all its spans; place it in a group once its key is known."""
        facts = assembly.facts(key, self._spans_of(conn, key))
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

    def _assign_group(self, conn: Connection, trajectory_id: str, facts: assembly.TrajectoryFacts, now: float) -> str:
        """The open instance of the trajectory's group key with room left, else a new instance."""
        candidates = conn.execute(
            select(groups).where(groups.c.key == facts.group_key, groups.c.state == "open").order_by(groups.c.created_at)
        ).mappings()
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
        with self._tx() as conn:
            now = self.clock()
            conn.execute(
                rewards.insert().values(
                    rollout_id=reward.rollout_id or None, trace_id=reward.trace_id or None,
                    name=reward.name, value=reward.value, source="api", created_at=now,
                )
            )
            match = trajectories.c.id == reward.rollout_id if reward.rollout_id else trajectories.c.trace_id == reward.trace_id
            group_ids = set(conn.execute(select(trajectories.c.group_id).where(match)).scalars()) - {None}
            if group_ids:  # a new reward may give a skipped group its spread back
                conn.execute(
                    groups.update()
                    .where(groups.c.id.in_(group_ids), groups.c.state == "skipped")
                    .values(state="open", reason=None, updated_at=now)
                )
            known = conn.execute(select(func.count()).where(match)).scalar_one() > 0
        return RewardAccepted(**reward.model_dump(), trajectory_known=known)

    # --- reading ------------------------------------------------------------------------
    def _rewards_of(self, conn: Connection, rows: list[Any], *, source: str | None = None) -> dict[str, dict[str, float]]:
        """Named rewards per trajectory row (by rollout id, or by trace id when none was given)."""
        by_id: dict[str, list[tuple[int, str, str, float]]] = {row["id"]: [] for row in rows}
        by_trace: dict[str, list[str]] = {}
        for row in rows:
            by_trace.setdefault(row["trace_id"], []).append(row["id"])
        for chunk in chunks(rows):
            ids, traces = [r["id"] for r in chunk], [r["trace_id"] for r in chunk]
            query = select(rewards).where(
                or_(rewards.c.rollout_id.in_(ids), and_(rewards.c.rollout_id.is_(None), rewards.c.trace_id.in_(traces)))
            )
            if source is not None:
                query = query.where(rewards.c.source == source)
            for r in conn.execute(query).mappings():
                owners = [r["rollout_id"]] if r["rollout_id"] else by_trace.get(r["trace_id"], [])
                for owner in owners:
                    if owner in by_id:
                        by_id[owner].append((r["id"], r["source"], r["name"], r["value"]))
        return {tid: merge_rewards(found) for tid, found in by_id.items()}

    def _assemble(self, conn: Connection, rows: list[Any]) -> list[Trajectory]:
        api = self._rewards_of(conn, rows, source="api")
        return [
            assembly.assemble(
                row["id"], self._spans_of(conn, row["id"]), group_id=row["group_id"] or "",
                complete=bool(row["complete"]), reward_name=self.settings.reward_name, api_rewards=api[row["id"]],
            )
            for row in rows
        ]

    def _maintain(self, conn: Connection, now: float) -> None:
        """Return expired leases to the pool; complete idle trajectories that have no rollout span."""
        expired = list(
            conn.execute(select(batches.c.id).where(batches.c.state == "leased", batches.c.lease_expires_at <= now)).scalars()
        )
        for chunk in chunks(expired):
            conn.execute(batches.update().where(batches.c.id.in_(chunk)).values(state="expired"))
            conn.execute(
                groups.update()
                .where(groups.c.state == "leased", groups.c.batch_id.in_(chunk))
                .values(state="open", batch_id=None, updated_at=now)
            )
            log.warning("leases expired, groups back in the pool: batches %s", ", ".join(chunk))
        conn.execute(
            trajectories.update()
            .where(
                trajectories.c.by_rollout.is_(False),
                trajectories.c.complete.is_(False),
                trajectories.c.updated_at <= now - self.settings.idle_seconds,
            )
            .values(complete=True)
        )

    def trajectory(self, trajectory_id: str) -> Trajectory | None:
        """One assembled trajectory, or None."""
        with self._tx() as conn:
            self._maintain(conn, self.clock())
            row = conn.execute(select(trajectories).where(trajectories.c.id == trajectory_id)).mappings().first()
            return self._assemble(conn, [row])[0] if row else None

    def trajectories(self, *, group: str | None = None, task: str | None = None, split: str | None = None) -> list[Trajectory]:
        """Assembled trajectories matching every filter given (`group`: group id or group key)."""
        query = select(trajectories).order_by(trajectories.c.created_at, trajectories.c.id)
        if group is not None:
            query = query.where(or_(trajectories.c.group_id == group, trajectories.c.group_key == group))
        if task is not None:
            query = query.where(trajectories.c.task == task)
        if split is not None:
            query = query.where(trajectories.c.split == split)
        with self._tx() as conn:
            self._maintain(conn, self.clock())
            return self._assemble(conn, list(conn.execute(query).mappings()))

    def _group_members(self, conn: Connection, group_ids: list[str]) -> dict[str, list[Any]]:
        members: dict[str, list[Any]] = {gid: [] for gid in group_ids}
        for chunk in chunks(group_ids):
            query = select(trajectories).where(trajectories.c.group_id.in_(chunk)).order_by(trajectories.c.created_at)
            for row in conn.execute(query).mappings():
                members[row["group_id"]].append(row)
        return members

    def _decisions(self, conn: Connection, open_groups: list[Any]) -> dict[str, tuple[list[Any], list[Member], Any]]:
        """Members and readiness of each open group."""
        members = self._group_members(conn, [g["id"] for g in open_groups])
        all_rows = [row for rows in members.values() for row in rows]
        named = self._rewards_of(conn, all_rows)
        out = {}
        for group in open_groups:
            rows = members[group["id"]]
            ms = [Member(bool(r["complete"]), r["split"], named[r["id"]].get(self.settings.reward_name)) for r in rows]
            expected = group["size_hint"] or self.settings.min_group_size
            decision = decide(ms, expected, reward_name=self.settings.reward_name, keep_zero_spread=self.settings.keep_zero_spread)
            out[group["id"]] = (rows, ms, decision)
        return out

    def groups(self) -> list[GroupStatus]:
        """Every non-empty group with its readiness (`ready` is computed, not stored)."""
        with self._tx() as conn:
            self._maintain(conn, self.clock())
            every = list(conn.execute(select(groups).order_by(groups.c.created_at, groups.c.id)).mappings())
            members = self._group_members(conn, [g["id"] for g in every])
            named = self._rewards_of(conn, [row for rows in members.values() for row in rows])
            decisions = self._decisions(conn, [g for g in every if g["state"] == "open"])
        out = []
        for group in every:
            rows = members[group["id"]]
            if not rows:
                continue
            state, reason = group["state"], group["reason"]
            if group["id"] in decisions:
                decision = decisions[group["id"]][2]
                state, reason = decision.state, decision.reason
            out.append(
                GroupStatus(
                    id=group["id"], task=group["task"], size=len(rows), complete=sum(bool(r["complete"]) for r in rows),
                    rewarded=sum(self.settings.reward_name in named[r["id"]] for r in rows), state=state, reason=reason,
                )
            )
        return out

    # --- leases -------------------------------------------------------------------------
    def lease(self, request: BatchRequest) -> Batch:
        """Lease ready groups to one trainer, atomically; an empty batch when none are ready."""
        with self._tx() as conn:
            now = self.clock()
            self._maintain(conn, now)
            query = select(groups).where(groups.c.state == "open").order_by(groups.c.created_at, groups.c.id)
            open_groups = list(conn.execute(query.with_for_update(skip_locked=True)).mappings())
            decisions = self._decisions(conn, open_groups)
            ready = []
            for group in open_groups:
                decision = decisions[group["id"]][2]
                if decision.state == "skipped":
                    conn.execute(
                        groups.update().where(groups.c.id == group["id"]).values(state="skipped", reason=decision.reason, updated_at=now)
                    )
                elif decision.state == "ready":
                    ready.append(group)
            chosen = ready[: request.max_groups] if len(ready) >= request.min_groups else []
            batch_id = uuid.uuid4().hex
            expires = now + request.lease_seconds
            conn.execute(
                batches.insert().values(
                    id=batch_id, trainer=request.trainer, state="leased", created_at=now, lease_expires_at=expires
                )
            )
            leased = []
            for group in chosen:
                taken = conn.execute(
                    update(groups)
                    .where(groups.c.id == group["id"], groups.c.state == "open")
                    .values(state="leased", batch_id=batch_id, reason=None, updated_at=now)
                )
                if taken.rowcount == 1:
                    conn.execute(batch_groups.insert().values(batch_id=batch_id, group_id=group["id"]))
                    leased.append(group)
            members = self._group_members(conn, [g["id"] for g in leased])
            out = [
                Group(id=g["id"], task=g["task"], trajectories=self._assemble(conn, members[g["id"]])) for g in leased
            ]
        if out:
            log.info("leased %d groups to %s as batch %s", len(out), request.trainer or "a trainer", batch_id)
        return Batch(id=batch_id, groups=out, lease_expires_at=expires)

    def ack(self, batch_id: str, policy_step: int | None) -> AckResponse:
        """Mark a batch's groups trained. Raises `NotFound`, or `Conflict` when they were re-leased."""
        with self._tx() as conn:
            now = self.clock()
            self._maintain(conn, now)
            batch = conn.execute(select(batches).where(batches.c.id == batch_id)).mappings().first()
            if batch is None:
                raise NotFound(f"no batch {batch_id!r}; lease one with POST /v1/batches")
            ids = list(conn.execute(select(batch_groups.c.group_id).where(batch_groups.c.batch_id == batch_id)).scalars())
            if batch["state"] == "acked":
                return AckResponse(batch_id=batch_id, groups=ids, policy_step=batch["policy_step"])
            rows = list(conn.execute(select(groups).where(groups.c.id.in_(ids))).mappings()) if ids else []
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
            conn.execute(
                batches.update().where(batches.c.id == batch_id).values(state="acked", acked_at=now, policy_step=policy_step)
            )
        return AckResponse(batch_id=batch_id, groups=ids, policy_step=policy_step)
