"""Tables of the judges, next to the store's: judge runs, judge explanations, Langfuse sync state.

They live in the store's database (same engine) but in their own `MetaData`, created by
`ScoringStore.setup()` (idempotent). The rewards themselves go through `Store.add_reward`;
these tables keep what a reward row cannot: the explanation, the judge run's outcome, and which
Langfuse scores were already pulled or pushed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Column, Engine, Float, Integer, MetaData, String, Table, Text, delete, select

from collector.engine import chunks

__all__ = ["ScoringStore"]

metadata = MetaData()

judge_runs = Table(
    "judge_runs",
    metadata,
    Column("group_id", String(300), primary_key=True),
    Column("state", String(16), nullable=False),  # running / ok / failed / skipped / zeroed
    Column("attempts", Integer, nullable=False),
    Column("error", Text),
    Column("model", String(256), nullable=False),
    Column("trajectories", Integer, nullable=False),
    Column("distinct_count", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("next_try_at", Float),  # `failed` under the retry policy: when to try again
)

judgements = Table(
    "judgements",
    metadata,
    Column("trajectory_id", String(256), primary_key=True),
    Column("name", String(256), primary_key=True),  # the reward name the judge wrote
    Column("group_id", String(300), nullable=False, index=True),
    Column("score", Float, nullable=False),
    Column("explanation", Text, nullable=False),
    Column("block", Integer),  # number of the trajectory block in the prompt; None when zeroed
    Column("duplicate_of", String(256)),  # judged once as this identical trajectory
    Column("created_at", Float, nullable=False),
)

langfuse_pulled = Table(
    "langfuse_pulled",
    metadata,
    Column("score_id", String(256), primary_key=True),
    Column("updated_at", String(64), nullable=False),
    Column("trace_id", String(64), nullable=False),
    Column("name", String(256), nullable=False),
    Column("value", Float, nullable=False),
    Column("pulled_at", Float, nullable=False),
)

langfuse_pushed = Table(
    "langfuse_pushed",
    metadata,
    Column("trajectory_id", String(256), primary_key=True),
    Column("name", String(256), primary_key=True),
    Column("value", Float, nullable=False),
    Column("score_id", String(64), nullable=False),
    Column("pushed_at", Float, nullable=False),
)


class ScoringStore:
    """Reads and writes the judges' tables on `engine` (the collector store's engine)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def setup(self) -> None:
        """Create the tables that do not exist yet."""
        metadata.create_all(self.engine)

    # --- judge runs ---------------------------------------------------------------------
    def run(self, group_id: str) -> dict[str, Any] | None:
        """The last judge run of a group, or None."""
        with self.engine.connect() as conn:
            row = conn.execute(select(judge_runs).where(judge_runs.c.group_id == group_id)).mappings().first()
        return dict(row) if row else None

    def runs(self, group_ids: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """Judge runs by group id (all of them, or those of `group_ids`)."""
        with self.engine.connect() as conn:
            if group_ids is None:
                rows = list(conn.execute(select(judge_runs)).mappings())
            else:
                rows = []
                for chunk in chunks(list(group_ids)):
                    rows += conn.execute(select(judge_runs).where(judge_runs.c.group_id.in_(chunk))).mappings()
        return {row["group_id"]: dict(row) for row in rows}

    def save_run(self, **values: Any) -> None:
        """Insert or replace the judge run of `values["group_id"]`."""
        with self.engine.begin() as conn:
            conn.execute(delete(judge_runs).where(judge_runs.c.group_id == values["group_id"]))
            conn.execute(judge_runs.insert().values(**values))

    def save_judgements(self, name: str, group_id: str, rows: list[dict[str, Any]]) -> None:
        """Replace the group's judgements under reward `name` with `rows` (trajectory_id, score, explanation, ...)."""
        with self.engine.begin() as conn:
            conn.execute(delete(judgements).where(judgements.c.group_id == group_id, judgements.c.name == name))
            if rows:
                conn.execute(judgements.insert(), [{"name": name, "group_id": group_id, **row} for row in rows])

    def judgements(self, trajectory_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Judgements by trajectory id."""
        out: dict[str, list[dict[str, Any]]] = {tid: [] for tid in trajectory_ids}
        with self.engine.connect() as conn:
            for chunk in chunks(trajectory_ids):
                for row in conn.execute(select(judgements).where(judgements.c.trajectory_id.in_(chunk))).mappings():
                    out[row["trajectory_id"]].append(dict(row))
        return out

    # --- Langfuse -----------------------------------------------------------------------
    def pulled_versions(self, score_ids: list[str]) -> dict[str, str]:
        """`updated_at` of the Langfuse scores already pulled, by score id."""
        out: dict[str, str] = {}
        with self.engine.connect() as conn:
            for chunk in chunks(score_ids):
                rows = conn.execute(select(langfuse_pulled.c.score_id, langfuse_pulled.c.updated_at).where(langfuse_pulled.c.score_id.in_(chunk)))
                out.update({score_id: updated for score_id, updated in rows})
        return out

    def mark_pulled(self, row: dict[str, Any]) -> None:
        """Remember a pulled Langfuse score (score_id, updated_at, trace_id, name, value, pulled_at)."""
        with self.engine.begin() as conn:
            conn.execute(delete(langfuse_pulled).where(langfuse_pulled.c.score_id == row["score_id"]))
            conn.execute(langfuse_pulled.insert().values(**row))

    def pushed(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(value, first push time) of what was pushed to Langfuse, by (trajectory id, reward name)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(langfuse_pushed.c.trajectory_id, langfuse_pushed.c.name, langfuse_pushed.c.value, langfuse_pushed.c.pushed_at)
            )
            return {(tid, name): (value, at) for tid, name, value, at in rows}

    def mark_pushed(self, rows: list[dict[str, Any]]) -> None:
        """Remember pushed scores (trajectory_id, name, value, score_id, pushed_at: the first push's time)."""
        if not rows:
            return
        with self.engine.begin() as conn:
            for row in rows:
                conn.execute(
                    delete(langfuse_pushed).where(
                        langfuse_pushed.c.trajectory_id == row["trajectory_id"], langfuse_pushed.c.name == row["name"]
                    )
                )
            conn.execute(langfuse_pushed.insert(), rows)
