"""What the collector's store remembers between transactions, so that unchanged groups are not decided again: the
stale groups its last upkeep kept (`pool.Kept`) and the open groups the last full decision of them decided
(`store_reads.Listed`: a listing of every open group, or a lease's own pass).

Each is remembered only once the transaction that decided it ended (a write's once committed: one that rolled back
is forgotten), for the settings (and training reward) it was decided under: others decide every group again.
`SqlStore` holds one `Memory`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

from sqlalchemy import Connection

from collector import pool, store_reads
from collector.config import CollectorSettings
from collector.groups import TrainingReward
from collector.transactions import Transactions

__all__ = ["Memory"]

T = TypeVar("T")


class Memory:
    """The store's remembered decisions, over its transactions `tx`; `settings` and `training` (the store's
    training reward): what it starts under, remembering nothing."""

    def __init__(self, tx: Transactions, settings: CollectorSettings, training: TrainingReward) -> None:
        self._tx = tx
        # the stale groups the last upkeep kept, with the settings it decided them under (`maintained`)
        self._kept: tuple[CollectorSettings, pool.Kept] = (settings, {})
        # the open groups the last decision of them all decided, with the settings and training reward it decided them
        # under (`listing`)
        self._listed: tuple[CollectorSettings, TrainingReward, store_reads.Listed] = (settings, training, {})

    def maintained(self, settings: CollectorSettings, work: Callable[[Connection, pool.Upkeep], T]) -> T:
        """`work(conn, upkeep)` in a write transaction, where `upkeep` (`pool.Upkeep`), which `work` runs first, is the
        due maintenance under `settings` (`pool.maintain`: expired leases, idle trajectories, stale groups). Its cost
        grows with what is due: the idle trajectories are read from an index (schema version 14), and a stale group
        the last upkeep kept (ready, waiting for a trainer) is not decided again while it is unchanged (`pool.Kept`:
        of each it reads only its `updated_at` and its number of members). The groups kept are remembered once the
        transaction committed (those of its last try: one that raised, rolled back, is forgotten), for the settings
        they were decided under: other settings decide every stale group again."""
        decided_under, kept = self._kept
        if decided_under is not settings:
            kept = {}
        found: list[pool.Kept] = []

        def upkeep(conn: Connection, now: float, *, releasing: Collection[str] = (),
                   acking: Collection[str] = ()) -> None:
            found.append(pool.maintain(conn, settings, now, self._tx.lock, releasing=releasing, acking=acking,
                                       kept=kept))

        def attempt(conn: Connection) -> T:
            found.clear()  # a try retried rolled back: what its upkeep kept is not stored
            return work(conn, upkeep)

        out = self._tx.run(attempt)
        if found:
            self._kept = (settings, found[-1])
        return out

    def listing(
        self, settings: CollectorSettings, training: TrainingReward,
        decide: Callable[[store_reads.Listed], tuple[T, store_reads.Listed | None]],
    ) -> T:
        """What `decide(listed)` answers, given the open groups the last decision of them all decided under `settings`
        and `training` (`store_reads.Listed`; none under others). It runs its own transaction, and returns with its
        answer the open groups it decided in all (None: not all of them); they are remembered once it returned (a
        write's once committed: one that raised is forgotten)."""
        under, under_training, listed = self._listed
        if under is not settings or under_training is not training:
            listed = {}
        out, decided = decide(listed)
        if decided is not None:
            self._listed = (settings, training, decided)
        return out
