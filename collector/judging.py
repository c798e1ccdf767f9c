"""Run the RULER judge on groups: on request, or automatically once a group is complete.

A run reads the group's trajectories from the store, sends the distinct ones to the judge,
and writes each score as a reward (`JudgeSettings.reward_name`, default `ruler`) through
`Store.add_reward`, with the explanation kept in `ScoringStore`. A failed run follows the
configured policy (`retry`, `skip`, `zero`) and its state and error show on the group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from collector.errors import NotFound
from collector.protocol import GroupState, RewardIn, Trajectory
from collector.read_protocol import JudgeRun, Judgement
from collector.ruler import (
    JudgeClient,
    JudgeError,
    Score,
    build_messages,
    dedupe,
    explanation_limit,
    parse_scores,
    response_format,
)
from collector.scoring_config import JudgeSettings
from collector.scoring_store import ScoringStore
from collector.store import Store

__all__ = ["GroupJudge", "run_view"]

log = logging.getLogger(__name__)

_IN_POOL: frozenset[GroupState] = frozenset({"open", "ready", "skipped"})
"""Group states a new reward can still matter in (a skipped group reopens on one)."""


def run_view(row: dict, judgements: list[Judgement] | None = None) -> JudgeRun:
    """A `judge_runs` row as a `JudgeRun`."""
    return JudgeRun(
        group_id=row["group_id"], state=row["state"], attempts=row["attempts"], error=row["error"], model=row["model"],
        trajectories=row["trajectories"], distinct=row["distinct_count"], started_at=row["started_at"],
        finished_at=row["finished_at"], next_try_at=row["next_try_at"], judgements=judgements or [],
    )


class GroupJudge:
    """Judges groups with one `JudgeClient`; one run per group at a time."""

    def __init__(
        self,
        store: Store,
        scoring: ScoringStore,
        settings: JudgeSettings,
        *,
        client: JudgeClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.scoring, self.settings = store, scoring, settings
        key = settings.api_key.get_secret_value() if settings.api_key else None
        self.client = client or JudgeClient(settings.url, settings.model, api_key=key, timeout=settings.timeout_seconds)
        self.clock = clock
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, group_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(group_id, threading.Lock())

    # --- one run ------------------------------------------------------------------------
    def judge(self, group_id: str, *, rubric: str | None = None) -> JudgeRun:
        """Judge one group now and store the scores; failures follow the configured policy.

        Raises:
            NotFound: the group does not exist or has no trajectories.
        """
        members = [t for t in self.store.trajectories(group=group_id) if t.group_id == group_id]
        if not members:
            raise NotFound(f"no group {group_id!r} with trajectories; see GET /v1/groups")
        with self._lock(group_id):
            return self._judge(group_id, members, rubric or self.settings.rubric)

    def _judge(self, group_id: str, members: list[Trajectory], rubric: str) -> JudgeRun:
        s = self.settings
        distinct, owner = dedupe([t.messages for t in members])
        started = self.clock()
        base = {"group_id": group_id, "model": s.model, "trajectories": len(members), "distinct_count": len(distinct), "started_at": started}
        self.scoring.save_run(**base, state="running", attempts=0, error=None, finished_at=None, next_try_at=None)
        tries = s.attempts if s.on_failure == "retry" else 1
        messages = build_messages(rubric, distinct)
        fmt = response_format(len(distinct), explanation_limit(len(distinct), s.max_tokens, s.explanation_max_chars))
        error: JudgeError | None = None
        for attempt in range(1, tries + 1):
            try:
                text = self.client.complete(messages, fmt, temperature=s.temperature, max_tokens=s.max_tokens)
                scores = parse_scores(text, len(distinct))
            except JudgeError as exc:
                error = exc
                log.warning("judge of group %s failed (try %d/%d): %s", group_id, attempt, tries, exc)
                if attempt < tries:
                    time.sleep(min(2.0 ** (attempt - 1), 10.0))
                continue
            rows = self._store_scores(group_id, members, owner, scores)
            self.scoring.save_run(**base, state="ok", attempts=attempt, error=None, finished_at=self.clock(), next_try_at=None)
            log.info("judged group %s: %d trajectories, %d distinct", group_id, len(members), len(distinct))
            return run_view(self.scoring.run(group_id) or {}, rows)
        assert error is not None
        message = f"{error.code}: {error}"
        now = self.clock()
        if s.on_failure == "zero":
            rows = self._store_zeros(group_id, members, message)
            self.scoring.save_run(**base, state="zeroed", attempts=tries, error=message, finished_at=now, next_try_at=None)
            return run_view(self.scoring.run(group_id) or {}, rows)
        state, next_try = ("failed", now + s.retry_seconds) if s.on_failure == "retry" else ("skipped", None)
        self.scoring.save_run(**base, state=state, attempts=tries, error=message, finished_at=now, next_try_at=next_try)
        return run_view(self.scoring.run(group_id) or {})

    def _store_scores(self, group_id: str, members: list[Trajectory], owner: list[int], scores: list[Score]) -> list[Judgement]:
        first: dict[int, str] = {}
        rows = []
        for trajectory, index in zip(members, owner, strict=True):
            score = scores[index]
            duplicate_of = first.setdefault(index, trajectory.id)
            rows.append(
                Judgement(
                    trajectory_id=trajectory.id, name=self.settings.reward_name, score=score.score, explanation=score.explanation,
                    block=score.block, duplicate_of=None if duplicate_of == trajectory.id else duplicate_of,
                )
            )
        self._write(group_id, rows)
        return rows

    def _store_zeros(self, group_id: str, members: list[Trajectory], message: str) -> list[Judgement]:
        rows = [
            Judgement(trajectory_id=t.id, name=self.settings.reward_name, score=0.0, explanation=f"judge failed, scored 0 by policy: {message}")
            for t in members
        ]
        self._write(group_id, rows)
        return rows

    def _write(self, group_id: str, rows: list[Judgement]) -> None:
        now = self.clock()
        self.scoring.save_judgements(
            self.settings.reward_name, group_id,
            [{**row.model_dump(exclude={"name"}), "created_at": now} for row in rows],
        )
        for row in rows:
            self.store.add_reward(RewardIn(rollout_id=row.trajectory_id, name=row.name, value=row.score))

    # --- automatic runs -----------------------------------------------------------------
    def due_groups(self) -> list[str]:
        """Groups in the pool (open, ready or skipped) whose trajectories are all complete and that
        reached their expected size, not judged yet, grown since their last finished run (a group
        without an announced size takes members as they come), or `failed` and due for another try."""
        complete = {
            g.id: g.size for g in self.store.groups(states=_IN_POOL)
            if g.size == g.complete and g.size >= g.expected
        }
        runs = self.scoring.runs(complete)
        now = self.clock()

        def due(group_id: str) -> bool:
            run = runs.get(group_id)
            if run is None:
                return True
            if run["state"] == "failed":
                return (run["next_try_at"] or 0) <= now
            return run["state"] != "running" and run["trajectories"] < complete[group_id]

        return [group_id for group_id in complete if due(group_id)]

    def run_due(self) -> list[JudgeRun]:
        """Judge every due group (see `due_groups`), one after the other."""
        return [self.judge(gid) for gid in self.due_groups()]

    def close(self) -> None:
        """Release the judge client."""
        self.client.close()

