"""The collector's store: spans in, trajectories, groups and batch leases out.

This module holds the writes (spans, rewards, score withdrawals, leases, acks, releases, reopens) and the store's
plumbing; the reads are functions in `collector.store_reads`, which `SqlStore`'s read methods run in a read-only
transaction after due maintenance (`SqlStore._read`).

`SqlStore` implements the `Store` interface (`collector.store_base`) with SQLAlchemy Core,
portable SQL with dialect-specific locking (see `collector.transactions`): on SQLite (WAL,
`synchronous=FULL`) one writer at a time; on PostgreSQL concurrent transactions, advisory locks
per trajectory and group key, and leases that take group rows with `FOR UPDATE SKIP LOCKED`, so
several collector replicas on one database never lease a group twice. Every write method
returns only after its transaction committed.

Ingest costs work for the export's own spans, not for what is stored: the spans go in one
multi-row insert, each trajectory's grouping facts are updated from its digest
(`assembly.FactsDigest`, kept on its row) and the new spans, and `collector.placement` writes
the rows and places them in groups for the whole export; sequences are assembled on reading
(`store_reads.assemble`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sqlalchemy import Connection, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import OperationalError

from collector import assembly, curve, leases, placement, pool, rows, store_reads
from collector.config import CollectorSettings
from collector.engine import chunks, make_engine, use_wal
from collector.errors import InvalidRequest
from collector.groups import TrainingReward
from collector.otlp import SpanRecord
from collector.protocol import (
    AckResponse,
    Batch,
    BatchRequest,
    BatchStatus,
    GroupState,
    GroupStatus,
    ReleaseRequest,
    ReleaseResponse,
    ReopenResponse,
    RewardAccepted,
    RewardIn,
    Trajectory,
)
from collector.schema import groups, migrate, rewards, spans, trajectories
from collector.spans import rollout_key
from collector.store_base import Store
from collector.store_memory import Memory
from collector.transactions import GROUP_LOCKS, IDEMPOTENCY_LOCKS, TRAJECTORY_LOCKS, Transactions

__all__ = ["SqlStore"]

log = logging.getLogger(__name__)


def _key(span: SpanRecord) -> tuple[str, str]:
    """What identifies `span`, as OpenTelemetry does and the store keys it: its trace id and span id."""
    return span.trace_id, span.span_id


class SqlStore(Store):
    """`Store` on SQLAlchemy Core. `clock` returns Unix time (injectable for tests); without one, the store's time is
    the database server's on PostgreSQL, so that replicas on one database agree when a lease runs out whatever
    their machines' clocks say, and this machine's on SQLite."""

    def __init__(self, settings: CollectorSettings, *, clock: Callable[[], float] | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.engine = make_engine(settings.db)
        self.training = settings.training_reward
        self._tx = Transactions(self.engine)
        self._steps = curve.PolicySteps()
        self._memory = Memory(self._tx, settings, self.training)

    # --- plumbing -----------------------------------------------------------------------
    def _now(self, conn: Connection) -> float:
        """Unix time of the store (see the class): `clock`, else PostgreSQL's `clock_timestamp()`, else this
        machine's."""
        if self.clock is not None:
            return self.clock()
        if self._tx.postgres:
            return float(conn.execute(select(func.extract("epoch", func.clock_timestamp()))).scalar_one())
        return time.time()

    def _insert(self, table: Any) -> Any:
        return (postgresql if self._tx.postgres else sqlite).insert(table)

    def setup(self) -> None:
        """Create or migrate the schema. Idempotent."""
        before = migrate(self.engine)
        use_wal(self.engine)  # only now: a file `migrate` refused keeps its journal mode
        log.info("collector store %s ready (schema was version %d)", self.engine.url.render_as_string(), before)

    def close(self) -> None:
        """Release connections."""
        self.engine.dispose()

    # --- ingest -------------------------------------------------------------------------
    def add_spans(self, records: list[SpanRecord]) -> int:
        """Store spans (duplicates ignored: of one trace id and span id the first sent, in this export or an earlier
        one) and update their trajectories; returns how many were new.

        Raises:
            InvalidRequest: a span has a problem (`assembly.span_problem`); nothing is stored.
        """
        first: dict[tuple[str, str], SpanRecord] = {}
        for record in records:
            first.setdefault(_key(record), record)
        unique = list(first.values())
        for record in unique:
            if problem := assembly.span_problem(record):
                raise InvalidRequest(f"span {record.span_id}: {problem}", code="invalid_span")
        return self._tx.run(lambda conn: self._add_spans(conn, unique)) if unique else 0

    def _add_spans(self, conn: Connection, unique: list[SpanRecord]) -> int:
        """Insert the spans in one statement, then update each touched trajectory from its new spans only (`unique`:
        the first of an export's spans of each trace id and span id)."""
        keys = {_key(r): assembly.trajectory_key(r) for r in unique}
        # the trace ids too: an export of a rollout and one of another instrumentation's calls in its trace lock
        # different keys otherwise, and on PostgreSQL neither sees the other's rows (`foreign_deletion`)
        self._tx.lock(conn, TRAJECTORY_LOCKS, [key for key, _ in keys.values()] + [r.trace_id for r in unique])
        received = self._now(conn)
        rows = [
            {
                "span_id": r.span_id,
                "trace_id": r.trace_id,
                "trajectory_id": keys[_key(r)][0],
                "name": r.name,
                "start_ns": r.start_ns,
                "end_ns": r.end_ns,
                "record": json.dumps(r.to_dict(), separators=(",", ":")),
                "received_at": received,
            }
            # in key order: two exports that share spans (an exporter's retry beside its first try) wait on each
            # other's rows in one order on PostgreSQL, never in a cycle (a deadlock, then a retry)
            for r in sorted(unique, key=_key)
        ]
        insert = (
            self._insert(spans).on_conflict_do_nothing(index_elements=["trace_id", "span_id"])
            .returning(spans.c.trace_id, spans.c.span_id)
        )
        inserted = {(trace_id, span_id) for trace_id, span_id in conn.execute(insert, rows)}
        new = [r for r in unique if _key(r) in inserted]
        if not new:
            return 0
        reward_rows = [
            {
                "rollout_id": key if by_rollout else None, "trace_id": record.trace_id, "name": reward.name,
                "value": reward.value, "source": "span", "span_id": record.span_id, "time_ns": reward.time_ns,
            }
            for record in new
            for key, by_rollout in [keys[_key(record)]]
            for reward in assembly.span_rewards(record)
        ]
        added: dict[tuple[str, bool], list[SpanRecord]] = {}
        for record in new:
            added.setdefault(keys[_key(record)], []).append(record)
        existing = self._trajectory_rows(conn, [key for key, _ in added])
        digests = {}
        for (key, by_rollout), records in sorted(added.items()):
            row = existing.get(key)
            if row is not None:
                digest = assembly.FactsDigest.from_json(row["digest"])
                digest.add(records)
            elif by_rollout:  # a rollout's row is made with its first spans: there are no earlier ones
                digest = assembly.FactsDigest.of(records)
            elif any(assembly.is_llm(r) for r in records):  # the trace's earlier spans held no model call
                digest = assembly.FactsDigest.of(store_reads.spans_of(conn, key))
            else:
                continue  # spans outside any rollout become a trajectory only with a model call
            digests[key, by_rollout] = digest
        found = {trajectory: digest.facts(trajectory[0]) for trajectory, digest in digests.items()}
        rollout_traces = {record.trace_id for record in new if keys[_key(record)][1]}
        self._tx.lock(conn, GROUP_LOCKS, [f.group_key for f in found.values()])
        by_trace = [r["trace_id"] for r in reward_rows if not r["rollout_id"]]
        held = {row["group_id"] for row in existing.values()} | pool.groups_of(conn, [], by_trace)
        changed = placement.groups_changed(conn, found, digests, existing, rollout_traces)
        now = self._changing_groups(conn, held | changed)
        # the upkeep due on the groups it marks active, first, as a read would have done it (placement does that of the
        # instances it places in): a member it completed is complete in `existing` too
        for trajectory_id in pool.maintain_groups(conn, self.settings, held, now) & existing.keys():
            existing[trajectory_id] = {**existing[trajectory_id], "complete": True}
        if reward_rows:
            conn.execute(rewards.insert(), [{**row, "created_at": now} for row in reward_rows])
        placement.write_trajectories(
            conn, found, digests, existing, rollout_traces=rollout_traces, settings=self.settings, now=now,
        )
        # a trajectory new in this export is in an open group, marked active above: only older ones' groups may need
        # reopening (a reward per export's rollout would cost two statements for nothing)
        by_rollout = [r["rollout_id"] for r in reward_rows if r["rollout_id"] in existing]
        pool.rewarded(conn, pool.groups_of(conn, by_rollout, by_trace), now)  # placed under this export's locks
        return len(new)

    def _changing_groups(self, conn: Connection, group_ids: Collection[str | None]) -> float:
        """The store's time (`_now`) for a transaction about to change the members or rewards of `group_ids`, taken
        once it holds their rows (`pool.lock_groups`).

        A lease that holds one of them commits first, so the change is dated after the lease took the group and a late
        ack sees it (`leases._changed_since`); a lease that comes while they are held passes them over. Taken before,
        across a wait for a lock, the time can be older than a lease that never saw the change.
        """
        pool.lock_groups(conn, group_ids)
        return self._now(conn)

    def _trajectory_rows(self, conn: Connection, ids: list[str]) -> dict[str, Any]:
        """Trajectory rows by id, of those of `ids` that exist."""
        found = {}
        for chunk in chunks(sorted(ids)):
            found.update(
                {
                    row["id"]: row
                    for row in conn.execute(select(trajectories).where(trajectories.c.id.in_(chunk))).mappings()
                }
            )
        return found

    def add_rewards(
        self,
        rewards: Sequence[RewardIn],
        *,
        score_ids: Sequence[str | None] | None = None,
        before: Callable[[Connection], None] | None = None,
        also: Callable[[Connection], None] | None = None,
    ) -> list[RewardAccepted]:
        """Store rewards posted by API in one transaction: all of them, or none when one fails (`score_ids`: the
        Langfuse score each comes from, in order); each applies now or when its trajectory's spans arrive.
        `before(conn)` runs in that transaction first, before the rewards lock any row (a check that takes the
        advisory locks of `Transactions.lock` and raises to store nothing); `also(conn)` after the rewards (a
        caller's own rows, or a check that raises to store nothing).

        Raises:
            InvalidRequest: a reward has neither `rollout_id` nor `trace_id`; nothing is stored.
        """
        if score_ids is not None and len(score_ids) != len(rewards):
            raise ValueError(f"{len(score_ids)} score ids for {len(rewards)} rewards: give one per reward")
        if any(not reward.rollout_id and not reward.trace_id for reward in rewards):
            raise InvalidRequest("a reward needs `rollout_id` or `trace_id`")
        rewards = [  # keyed as spans key their trajectory, and answered so (`spans.rollout_key`)
            reward.model_copy(update={"rollout_id": rollout_key(reward.rollout_id)}) if reward.rollout_id else reward
            for reward in rewards
        ]
        items = list(zip(rewards, score_ids or [None] * len(rewards), strict=True))

        def work(conn: Connection) -> list[bool]:
            if before is not None:
                before(conn)
            known = self._add_rewards(conn, items) if items else []
            if also is not None:
                also(conn)
            return known

        known = self._tx.run(work)
        return [
            RewardAccepted(**reward.model_dump(), trajectory_known=found)
            for reward, found in zip(rewards, known, strict=True)
        ]

    def _add_rewards(self, conn: Connection, items: list[tuple[RewardIn, str | None]]) -> list[bool]:
        """Insert the rewards (each with its score id) in one statement, their groups held and marked rewarded;
        whether each one's trajectory is known."""
        by_rollout = [reward.rollout_id for reward, _ in items if reward.rollout_id]
        traces = [reward.trace_id or "" for reward, _ in items if not reward.rollout_id]
        # the locks an export of these trajectories takes (their ids, their traces): it commits before this transaction
        # reads their groups, or after it, so a reward never misses the group an export is placing its trajectory in
        # (the group would keep its `updated_at`, and a listing its decision from before the reward, `store_reads`)
        self._tx.lock(conn, TRAJECTORY_LOCKS, by_rollout + traces)
        holders = pool.holders(conn, traces)
        held = sorted(set().union(*holders.values()))  # of a trace: each trajectory holding a span in it
        member_groups = pool.groups_of(conn, by_rollout + held, [])
        now = self._changing_groups(conn, member_groups)
        pool.maintain_groups(conn, self.settings, member_groups, now)  # their due upkeep first, as a read would do it
        rows = [
            {
                "rollout_id": reward.rollout_id or None, "trace_id": reward.trace_id or None, "name": reward.name,
                "value": reward.value, "source": "api", "created_at": now, "score_id": score_id,
            }
            for reward, score_id in items
        ]
        conn.execute(rewards.insert(), rows)  # in order: of two rewards of one name, the later one wins
        pool.rewarded(conn, member_groups, now)
        known = self._existing(conn, by_rollout + held)
        return [
            reward.rollout_id in known if reward.rollout_id else not known.isdisjoint(holders.get(reward.trace_id, ()))
            for reward, _ in items
        ]

    @staticmethod
    def _existing(conn: Connection, ids: list[str]) -> set[str]:
        """The `ids` that a trajectory has."""
        found: set[str] = set()
        for chunk in chunks(sorted(set(ids))):
            found.update(conn.execute(select(trajectories.c.id).where(trajectories.c.id.in_(chunk))).scalars())
        return found

    def withdraw_score(
        self,
        score_id: str,
        successor: tuple[str, RewardIn] | None,
        *,
        also: Callable[[Connection], None] | None = None,
    ) -> bool:
        """Take back the rewards of a Langfuse score deleted there, then store `successor` (score id, reward: the
        latest remaining score of its trace and name) unless that score has a reward already; `also(conn)` runs in
        that transaction after them. False, changing nothing (`also` not run), while a group holding a trajectory
        it rewards is leased or trained."""
        return self._tx.run(lambda conn: self._withdraw_score(conn, score_id, successor, also))

    def _withdraw_score(
        self,
        conn: Connection,
        score_id: str,
        successor: tuple[str, RewardIn] | None,
        also: Callable[[Connection], None] | None,
    ) -> bool:
        traces = sorted(set(conn.execute(select(rewards.c.trace_id).where(rewards.c.score_id == score_id)).scalars()))
        # as a reward takes them (`_add_rewards`): an export in the traces commits before the withdrawal reads them, or
        # after it; the successor's, first too (namespaces in ascending order)
        successor_ids = [successor[1].rollout_id or successor[1].trace_id or ""] if successor else []
        self._tx.lock(conn, TRAJECTORY_LOCKS, [trace for trace in traces if trace] + successor_ids)
        # each trajectory with a span in them, read once (a subquery in each statement saw a rollout an export
        # committed in between, and locked its group last), then a chunk of them per statement: a list of them all
        # grew with the trace's rollouts, past PostgreSQL's 65,535 parameters
        held = sorted(set().union(*pool.holders(conn, traces).values()))
        member_groups = sorted(pool.groups_of(conn, held, []))
        pool.lock_groups(conn, member_groups)  # in id order, as a reward locks them
        states = [state for chunk in chunks(member_groups)
                  for state in conn.execute(select(groups.c.state).where(groups.c.id.in_(chunk))).scalars()]
        if any(state in ("leased", "trained") for state in states):
            return False
        now = self._now(conn)
        pool.maintain_groups(conn, self.settings, member_groups, now)  # their due upkeep first, as a read would do it
        conn.execute(delete(rewards).where(rewards.c.score_id == score_id))
        # a deleted reward leaves no row dated after a lease: mark its trajectories changed instead, lest the late ack
        # of a lease that held it find them as they were (`leases._changed_since`)
        for chunk in chunks(held):  # in id order across chunks too, as the curve's save locks them
            scored = trajectories.c.id.in_(chunk)
            rows.lock_trajectories(conn, scored)
            conn.execute(trajectories.update().where(scored).values(updated_at=now))
        pool.rewarded(conn, member_groups, now)
        if successor and conn.execute(select(rewards.c.id).where(rewards.c.score_id == successor[0])).first() is None:
            self._add_rewards(conn, [(successor[1], successor[0])])
        if also is not None:
            also(conn)
        return True

    # --- reading (`collector.store_reads`) -------------------------------------------------
    def _upkeep(self) -> None:
        """Due maintenance (`Memory.maintained`) in a short write transaction of its own, whose group locks end with
        it. A write does only the upkeep due on the groups it marks active, in its own transaction once it holds them
        (`pool.maintain_groups`); a lease, an ack and a release run it first in theirs."""
        self._memory.maintained(self.settings, lambda conn, upkeep: upkeep(conn, self._now(conn)))

    def _read(self, work: Callable[[Connection], Any]) -> Any:
        """`work(conn)` on the store as of now: due maintenance first (`_upkeep`), then `work` in a read-only
        transaction, which on SQLite does not hold up writers."""
        self._upkeep()
        return self._tx.read(work)

    def trajectory(self, trajectory_id: str) -> Trajectory | None:
        """One assembled trajectory, or None; a rollout id in any of a UUID's forms finds it (`spans.rollout_key`)."""
        return self._read(lambda conn: store_reads.trajectory(conn, rollout_key(trajectory_id), self.training))

    def trajectories(self, *, group: str | None = None, task: str | None = None, split: str | None = None,
                     newest_first: bool = False, limit: int | None = None, offset: int = 0) -> list[Trajectory]:
        """Assembled trajectories matching every filter given (`group`: group id or group key), oldest first
        (`newest_first`: the reverse); with `limit`, that many from `offset` on, the others not assembled."""
        return self._read(lambda conn: store_reads.trajectories_matching(
            conn, self.training, group=group, task=task, split=split, newest_first=newest_first, limit=limit,
            offset=offset,
        ))

    def count_trajectories(self, *, group: str | None = None, task: str | None = None, split: str | None = None) -> int:
        """How many trajectories `trajectories` would return with the same filters and no limit."""
        return self._read(lambda conn: store_reads.count_trajectories(conn, group=group, task=task, split=split))

    def curve_facts(self, *, split: str | None = None) -> list[curve.CurveFacts]:
        """Policy step and rewards of every trajectory (in `split`), without assembling them (`collector.curve`); the
        steps it computed are stored (`PolicySteps.save`): a store that cannot take them now (a full disk, a lock held
        too long) is logged, and the read answered; the next read tries again."""
        facts = self._read(lambda conn: store_reads.curve_facts(conn, self._steps, self.training, split=split))
        if self._steps.unsaved:
            try:
                self._tx.run(self._steps.save)
            except OperationalError:
                log.warning("the policy steps the reward curve computed could not be stored", exc_info=True)
        return facts

    def groups(self, states: Collection[GroupState] | None = None, *, limit: int | None = None) -> list[GroupStatus]:
        """Every non-empty group with its readiness (`ready` is computed, not stored); with `states`, only the
        groups in one of them, read from the rows stored in a state they can show (not the whole history); with
        `limit`, only the newest `limit` non-empty groups (of those rows), newest first.

        An open group the last listing of every open group decided is not decided again while unchanged
        (`store_reads.Listed`, remembered once the read ended, for the settings and training reward it was decided
        under: others decide every group again). A trainer's poll for ready groups costs what changed since the last,
        beside one read of the open groups' rows."""
        settings, training = self.settings, self.training
        return self._memory.listing(settings, training, lambda listed: self._read(
            lambda conn: store_reads.group_statuses(conn, settings, training, states, limit, listed, self._now(conn))
        ))

    def batches(self, *, limit: int = 100) -> list[BatchStatus]:
        """The latest `limit` batches (leases), newest first, with their group ids."""
        return self._read(lambda conn: store_reads.batch_statuses(conn, limit))

    # --- leases -------------------------------------------------------------------------
    def lease(self, request: BatchRequest) -> Batch:
        """Lease ready groups to one trainer, atomically; an empty batch, not stored, when fewer than `min_groups`
        are ready.

        Its first pass over the open groups decides only those changed since the last listing or lease decided them
        all (`Memory.listing`, remembered once the lease committed): a lease among many ready groups costs what
        changed, beside one read of the open groups' rows, and the groups it takes are decided again under their
        locks."""
        settings, training = self.settings, self.training
        batch = self._memory.listing(settings, training, lambda listed: self._memory.maintained(
            settings, lambda conn, upkeep: self._lease(conn, settings, training, request, upkeep, listed)
        ))
        if batch.groups:
            log.info("leased %d groups to %s as batch %s", len(batch.groups), request.trainer or "a trainer", batch.id)
        return batch

    def _lease(
        self, conn: Connection, settings: CollectorSettings, training: TrainingReward, request: BatchRequest,
        upkeep: pool.Upkeep, listed: store_reads.Listed,
    ) -> tuple[Batch, store_reads.Listed | None]:
        if request.idempotency_key is not None:
            self._tx.lock(conn, IDEMPOTENCY_LOCKS, [request.idempotency_key])
        batch_id, expires, taken, decided = leases.take(conn, settings, request, self._now(conn), upkeep, training,
                                                        listed)
        out = store_reads.leased_groups(conn, taken, training)
        return Batch(id=batch_id, groups=out, lease_expires_at=expires), decided

    def ack(self, batch_id: str, policy_step: int | None) -> AckResponse:
        """Mark a batch's groups trained. Raises `NotFound`, or `Conflict` when they were re-leased, changed or
        released."""
        settings = self.settings
        return self._memory.maintained(
            settings, lambda conn, upkeep: leases.ack(conn, settings, batch_id, policy_step, self._now(conn), upkeep)
        )

    def release(self, batch_id: str, request: ReleaseRequest) -> ReleaseResponse:
        """Give a batch's groups back untrained, counting a failed attempt when `request.failed`; idempotent.
        Raises `NotFound`, or `Conflict` when the batch was acked."""
        settings = self.settings
        released = self._memory.maintained(
            settings, lambda conn, upkeep: leases.release(conn, settings, batch_id, request, self._now(conn), upkeep)
        )
        log.info("batch %s released (%s): %d groups back in the pool, %d skipped", batch_id,
                 "failed" if request.failed else "not counted", len(released.returned), len(released.skipped))
        return released

    def reopen(self, group_id: str) -> ReopenResponse:
        """Put a skipped or expired group back in the pool, its failed attempts reset. Raises `NotFound`, or
        `Conflict` when the group is open, ready, leased or trained, or skipped for its rewards while in the pool.

        Expired leases end first, as `GET /v1/groups` shows them ended (`_upkeep`): in a transaction of their own, so
        that the reopen's holds no other group's row while it waits for its own (held in that order, against an
        export or a reward locking both in id order, PostgreSQL aborted one as a deadlock)."""
        self._upkeep()
        return self._tx.run(lambda conn: leases.reopen(conn, self.settings, group_id, self._now(conn)))
