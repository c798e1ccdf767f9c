"""Lock order and counts of the trajectory and group rows, shared by the export's placement of trajectories in groups
(`placement`) and the deletion of another instrumentation's calls in rollouts' traces (`foreign_deletion`); and the
read of the stored spans of trajectories, shared by the store's reads (`store_reads`) and the reward curve (`curve`).

Functions over an open transaction.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from sqlalchemy import ColumnElement, Connection, func, select

from collector.engine import chunks
from collector.otlp import SpanRecord
from collector.schema import groups, spans, trajectories

__all__ = ["BYTE_ORDER", "counts", "group_order", "lock_trajectories", "spans_by_trajectory"]

BYTE_ORDER = "C"
"""The collation that row locks are taken in on PostgreSQL: ids by their bytes, as Python sorts them (UTF-8 keeps code
point order), so that a lock taken in id order by the database and one taken in Python's order (a chunk after another,
`PolicySteps.save`'s rows) agree whatever the database's own collation."""


def lock_trajectories(conn: Connection, condition: ColumnElement[bool]) -> None:
    """Hold the trajectory rows that match `condition` until the transaction ends: `FOR UPDATE`, in id order, on
    PostgreSQL (SQLite has one writer at a time). A statement that changes several rows takes them in the order it
    finds them; the curve's save (`PolicySteps.save`) takes them in id order, so one that changes several rows locks
    them so first, or each waited for the other (PostgreSQL aborted one as a deadlock, retried)."""
    if conn.dialect.name == "postgresql":
        query = select(trajectories.c.id).where(condition).order_by(trajectories.c.id.collate(BYTE_ORDER))
        conn.execute(query.with_for_update())


def group_order(conn: Connection) -> ColumnElement[str]:
    """Group ids in `BYTE_ORDER`, as every lock of several groups is taken (`pool.lock_groups`); SQLite has no such
    collation, and its own (BINARY) compares the bytes."""
    return groups.c.id.collate(BYTE_ORDER) if conn.dialect.name == "postgresql" else groups.c.id


def counts(conn: Connection, column: Any, values: list[str]) -> Counter[str]:
    """Rows per value of `column` (of `trajectories` or `groups`), among `values`."""
    found: Counter[str] = Counter()
    for chunk in chunks(values):
        found.update(dict(conn.execute(select(column, func.count()).where(column.in_(chunk)).group_by(column)).all()))
    return found


def spans_by_trajectory(conn: Connection, trajectory_ids: list[str]) -> dict[str, list[SpanRecord]]:
    """Every stored span of each trajectory of `trajectory_ids`, in no particular order: one read per chunk of ids
    (the caller keeps `trajectory_ids` to a chunk where memory matters)."""
    found: dict[str, list[SpanRecord]] = {trajectory_id: [] for trajectory_id in trajectory_ids}
    for chunk in chunks(list(found)):
        query = select(spans.c.trajectory_id, spans.c.record).where(spans.c.trajectory_id.in_(chunk))
        for trajectory_id, record in conn.execute(query):
            found[trajectory_id].append(SpanRecord.from_dict(json.loads(record)))
    return found
