"""The collector's storage interface: what the HTTP layer, the judges and the read views need from a store.

`Store` is the interface; `collector.store.SqlStore` implements it on SQLite and PostgreSQL, its reads in
`collector.store_reads`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from sqlalchemy import Connection

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

if TYPE_CHECKING:  # the interface does not load the implementation's modules
    from collector.curve import CurveFacts

__all__ = ["Store"]


class Store(ABC):
    """What the HTTP layer needs from storage.

    Implementations share its tests: `tests/collector/test_store*.py`, `test_leases.py` and `test_schema.py`.
    """

    @abstractmethod
    def setup(self) -> None:
        """Create or migrate the schema. Idempotent."""

    @abstractmethod
    def add_spans(self, records: list[SpanRecord]) -> int:
        """Store spans (duplicates ignored) and update their trajectories; returns how many were new.

        Raises:
            InvalidRequest: a span cannot be stored; nothing is stored.
        """

    @abstractmethod
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

    def add_reward(self, reward: RewardIn, *, score_id: str | None = None) -> RewardAccepted:
        """Store a reward posted by API (`score_id`: the Langfuse score it comes from); it applies now or when the
        trajectory's spans arrive. `add_rewards` of one reward."""
        return self.add_rewards([reward], score_ids=[score_id])[0]

    @abstractmethod
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

    @abstractmethod
    def lease(self, request: BatchRequest) -> Batch:
        """Lease ready groups to one trainer, atomically; an empty batch, not stored, when fewer than `min_groups`
        are ready."""

    @abstractmethod
    def ack(self, batch_id: str, policy_step: int | None) -> AckResponse:
        """Mark a batch's groups trained. Raises `NotFound`, or `Conflict` when they were re-leased, changed or
        released."""

    @abstractmethod
    def release(self, batch_id: str, request: ReleaseRequest) -> ReleaseResponse:
        """Give a batch's groups back untrained, counting a failed attempt when `request.failed`; idempotent.
        Raises `NotFound`, or `Conflict` when the batch was acked."""

    @abstractmethod
    def reopen(self, group_id: str) -> ReopenResponse:
        """Put a skipped or expired group back in the pool, its failed attempts reset. Raises `NotFound`, or
        `Conflict` when the group is open, ready, leased or trained, or skipped for its rewards while in the pool."""

    @abstractmethod
    def trajectory(self, trajectory_id: str) -> Trajectory | None:
        """One assembled trajectory, or None."""

    @abstractmethod
    def trajectories(self, *, group: str | None = None, task: str | None = None, split: str | None = None,
                     newest_first: bool = False, limit: int | None = None, offset: int = 0) -> list[Trajectory]:
        """Assembled trajectories matching every filter given (`group`: group id or group key), oldest first
        (`newest_first`: the reverse); with `limit`, that many from `offset` on, the others not assembled."""

    @abstractmethod
    def count_trajectories(self, *, group: str | None = None, task: str | None = None, split: str | None = None) -> int:
        """How many trajectories `trajectories` would return with the same filters and no limit."""

    @abstractmethod
    def curve_facts(self, *, split: str | None = None) -> list[CurveFacts]:
        """Policy step and rewards of every trajectory (in `split`), as assembled, without assembling them."""

    @abstractmethod
    def groups(self, states: Collection[GroupState] | None = None, *, limit: int | None = None) -> list[GroupStatus]:
        """Every non-empty group with its readiness; with `states`, only the groups in one of them; with `limit`,
        only the newest `limit` non-empty groups (of those `states` reads), newest first."""

    @abstractmethod
    def batches(self, *, limit: int = 100) -> list[BatchStatus]:
        """The latest `limit` batches (leases), newest first, with their group ids."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""
