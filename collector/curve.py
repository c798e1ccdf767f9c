"""What the reward curve needs of each trajectory, read without assembling the trajectories.

A trajectory's rewards come from the reward rows alone (`pool.rewards_of`), read on every call. Its policy step
comes out of its token sequences, so out of its spans: a trajectory's spans are only ever added while it exists (a
span's trace id and span id are its key, a retried export adds nothing; they are deleted with it), so `PolicySteps`
keeps each step with the number of spans it was computed from, in memory and in the trajectory's row
(`trajectories.policy_step` and `policy_step_spans`, so that a start reads them), and computes it again only for a
trajectory whose number of spans has changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import Connection, Select, bindparam, func, select

from art_langgraph import semconv as sc
from collector import pool
from collector.assembly import model_calls
from collector.engine import chunks
from collector.groups import TrainingReward
from collector.otlp import SpanRecord
from collector.protocol import Sequence
from collector.rows import spans_by_trajectory
from collector.schema import spans, trajectories
from collector.sequences import token_turn
from collector.spans import COUNTS, unique_sorted, whole_number

__all__ = ["ROWS", "CurveFacts", "PolicySteps", "StepOf", "curve_facts", "highest_step", "step_of"]

_STORED = (trajectories.c.created_at, trajectories.c.policy_step, trajectories.c.policy_step_spans)
# the spans are counted from the index of `(trajectory_id, trace_id)` alone, not from their rows (a count of `span_id`,
# not in it, read every row: 2-4x slower at 2,000 trajectories of 100 spans); `trace_id`, not `*`, which the outer join
# counts as 1 for a trajectory without spans
ROWS: Select[Any] = (
    select(trajectories.c.id, trajectories.c.trace_id, *_STORED, func.count(spans.c.trace_id).label("spans"))
    .select_from(trajectories.outerjoin(spans, spans.c.trajectory_id == trajectories.c.id))
    .group_by(trajectories.c.id, trajectories.c.trace_id, *_STORED)
)
"""Each trajectory's id, trace id, creation time, stored policy step (and the number of spans it was computed from)
and number of spans (filter it on `trajectories` columns)."""


def highest_step(sequences: Iterable[Sequence]) -> int | None:
    """The highest checkpoint step that sampled any of the sequences (None: unknown)."""
    steps = [s.policy_step for s in sequences if s.policy_step is not None]
    return max(steps) if steps else None


def step_of(records: Iterable[SpanRecord]) -> int | None:
    """The policy step of the trajectory of these spans, as `assembly.assemble` builds its sequences.

    Follows `sequences.build_sequences` for the steps alone: which turns are kept, and whether each extends the
    sequence before it (its prompt starts with that sequence's tokens) or starts one; not the messages, which only
    its drift reads (reading them took 60% of a step's time).
    """
    steps: list[int | None] = []  # of each sequence: the step of its last turn
    tokens: list[int] = []  # the last sequence's
    for span in model_calls(unique_sorted(records)):
        turn = token_turn(span)
        if turn is None:
            continue
        prompt, completion, _ = turn
        step = whole_number(span.attributes.get(sc.POLICY_STEP), COUNTS[sc.POLICY_STEP])
        if steps and tokens and prompt[: len(tokens)] == tokens:
            steps[-1] = step
        else:
            steps.append(step)
        tokens = prompt + completion
    known = [step for step in steps if step is not None]
    return max(known) if known else None


@dataclass(frozen=True)
class CurveFacts:
    """One trajectory as the reward curve sees it: as its assembled `Trajectory` has them."""

    policy_step: int | None
    reward: float | None
    """The training reward."""
    rewards: dict[str, float]


class StepOf(NamedTuple):
    """A trajectory's policy step and what it was computed from: its row and its number of spans."""

    created_at: float
    """Its row's: a row deleted and made again under the same id is another trajectory."""
    spans: int
    """How many spans it was computed from."""
    step: int | None


def _current(known: StepOf | None, row: dict[str, Any]) -> bool:
    """Whether `known` was computed from the spans `row` (`ROWS`) counts."""
    return known is not None and known.created_at == row["created_at"] and known.spans == row["spans"]


class PolicySteps:
    """The policy step of each trajectory read so far (and, since the last read of every one, still stored), with
    what it was computed from; and those computed that no `save` has stored yet."""

    def __init__(self) -> None:
        self._known: dict[str, StepOf] = {}
        self._unsaved: dict[str, StepOf] = {}

    def of(self, conn: Connection, rows: list[dict[str, Any]], *, every: bool) -> dict[str, int | None]:
        """The policy step of each trajectory, by id, of `rows` (`ROWS`' rows); those whose row or number of spans
        changed since they were last read take their row's step when it was stored from as many spans, else are
        computed from their spans (and kept for `save`). `every`: `rows` holds every trajectory stored, so the steps
        of the others (deleted since) are forgotten."""
        known: dict[str, StepOf] = {}
        created: dict[str, float] = {}  # of those to compute
        for row in rows:
            step = self._known.get(row["id"])  # a concurrent read may replace entries
            if not _current(step, row) and row["policy_step_spans"] == row["spans"]:
                step = self._known[row["id"]] = StepOf(row["created_at"], row["spans"], row["policy_step"])
            if _current(step, row):
                known[row["id"]] = step
            else:
                created[row["id"]] = row["created_at"]
        for chunk in chunks(list(created)):  # a chunk's spans at a time: all of them at once took 0.9 GB at 50,000
            # the spans read, not `rows`: a span stored in between counts too
            for tid, records in spans_by_trajectory(conn, chunk).items():
                computed = StepOf(created[tid], len(records), step_of(records))
                known[tid] = self._known[tid] = self._unsaved[tid] = computed
        if every:
            self._known = dict(known)  # a new dict: a concurrent read's entries go (computed again), none is torn
        return {tid: known_step.step for tid, known_step in known.items()}

    @property
    def unsaved(self) -> bool:
        """Whether steps were computed that no `save` has stored yet."""
        return bool(self._unsaved)

    def save(self, conn: Connection) -> None:
        """Store the steps that no save has stored yet in their trajectories' rows: in each row that is still the one
        read (created at the same time) and holds as many spans as the step was computed from. They are let go of once
        written, not before: a transaction aborted as a deadlock runs the save again (`Transactions.run`)."""
        unsaved = dict(self._unsaved)  # a copy: a concurrent read may add steps
        count = select(func.count()).where(spans.c.trajectory_id == trajectories.c.id).scalar_subquery()  # as `ROWS`
        update = (
            trajectories.update()
            .where(trajectories.c.id == bindparam("tid"), trajectories.c.created_at == bindparam("created"))
            .where(count == bindparam("count"))
            .values(policy_step=bindparam("step"), policy_step_spans=bindparam("count"))
        )
        rows = [
            {"tid": tid, "created": s.created_at, "count": s.spans, "step": s.step}  # in id order, as exports lock
            for tid, s in sorted(unsaved.items())
        ]
        for chunk in chunks(rows):
            conn.execute(update, chunk)
        for tid, step in unsaved.items():
            if self._unsaved.get(tid) is step:  # not one computed again meanwhile (nor let go of by another save)
                self._unsaved.pop(tid, None)


def curve_facts(
    conn: Connection, rows: Select[Any], steps: PolicySteps, training: TrainingReward, *, every: bool
) -> list[CurveFacts]:
    """`CurveFacts` of the trajectories `rows` (`ROWS`, filtered) selects, `training` their training reward;
    `every`: `rows` is not filtered (`PolicySteps.of`)."""
    found = [dict(row) for row in conn.execute(rows).mappings()]  # a plain dict: `RowMapping` lookups are slow
    named = pool.rewards_of(conn, found)
    step = steps.of(conn, found, every=every)
    return [CurveFacts(step[row["id"]], training.of(named[row["id"]]), named[row["id"]]) for row in found]
