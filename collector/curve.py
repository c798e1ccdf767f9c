"""What the reward curve needs of each trajectory, read without assembling the trajectories.

A trajectory's rewards come from the reward rows alone (`pool.rewards_of`), read on every call. Its policy step
comes out of its token sequences, so out of its spans: a trajectory's spans are only ever added (the span id is the
key, a retried export adds nothing), so `PolicySteps` keeps each step with the number of spans it was computed from
and computes it again only for a trajectory whose number of spans has changed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Select, func, select

from collector import pool
from collector.assembly import model_calls
from collector.engine import chunks
from collector.groups import TrainingReward
from collector.otlp import SpanRecord
from collector.protocol import Sequence
from collector.schema import spans, trajectories
from collector.sequences import build_sequences
from collector.spans import unique_sorted

__all__ = ["ROWS", "CurveFacts", "PolicySteps", "curve_facts", "highest_step", "step_of"]

ROWS: Select[Any] = (
    select(trajectories.c.id, trajectories.c.trace_id, func.count(spans.c.span_id).label("spans"))
    .select_from(trajectories.outerjoin(spans, spans.c.trajectory_id == trajectories.c.id))
    .group_by(trajectories.c.id, trajectories.c.trace_id)
)
"""Each trajectory's id, trace id and number of spans (filter it on `trajectories` columns)."""


def highest_step(sequences: Iterable[Sequence]) -> int | None:
    """The highest checkpoint step that sampled any of the sequences (None: unknown)."""
    steps = [s.policy_step for s in sequences if s.policy_step is not None]
    return max(steps) if steps else None


def step_of(records: Iterable[SpanRecord]) -> int | None:
    """The policy step of the trajectory of these spans, as `assembly.assemble` builds its sequences."""
    return highest_step(build_sequences(model_calls(unique_sorted(records))).sequences)


@dataclass(frozen=True)
class CurveFacts:
    """One trajectory as the reward curve sees it: as its assembled `Trajectory` has them."""

    policy_step: int | None
    reward: float | None
    """The training reward."""
    rewards: dict[str, float]


class PolicySteps:
    """The policy step of each trajectory read so far (and, since the last read of every one, still stored), with
    the number of spans it was computed from."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, int | None]] = {}

    def of(self, conn: Connection, counts: Mapping[str, int], *, every: bool) -> dict[str, int | None]:
        """The policy step of each trajectory, by id, from `counts` (its number of spans stored); those whose
        number changed since they were last read are computed from their spans. `every`: `counts` holds every
        trajectory stored, so the steps of the others (deleted since) are forgotten."""
        known = {tid: self._known.get(tid, (-1, None)) for tid in counts}  # a concurrent read may replace entries
        stale = [tid for tid, count in counts.items() if known[tid][0] != count]
        for chunk in chunks(stale):  # a chunk's spans at a time: all of them at once took 0.9 GB at 50,000 spans
            found: dict[str, list[SpanRecord]] = {tid: [] for tid in chunk}
            query = select(spans.c.trajectory_id, spans.c.record).where(spans.c.trajectory_id.in_(chunk))
            for trajectory_id, record in conn.execute(query):
                found[trajectory_id].append(SpanRecord.from_dict(json.loads(record)))
            for tid, records in found.items():  # the spans read, not `counts`: a span stored in between counts too
                known[tid] = self._known[tid] = (len(records), step_of(records))
        if every:
            self._known = dict(known)  # a new dict: a concurrent read's entries go (computed again), none is torn
        return {tid: step for tid, (_, step) in known.items()}


def curve_facts(
    conn: Connection, rows: Select[Any], steps: PolicySteps, training: TrainingReward, *, every: bool
) -> list[CurveFacts]:
    """`CurveFacts` of the trajectories `rows` (`ROWS`, filtered) selects, `training` their training reward;
    `every`: `rows` is not filtered (`PolicySteps.of`)."""
    found = [dict(row) for row in conn.execute(rows).mappings()]  # a plain dict: `RowMapping` lookups are slow
    named = pool.rewards_of(conn, found)
    step = steps.of(conn, {row["id"]: row["spans"] for row in found}, every=every)
    return [CurveFacts(step[row["id"]], training.of(named[row["id"]]), named[row["id"]]) for row in found]
