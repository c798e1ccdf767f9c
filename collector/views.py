"""The read API behind the web page: trajectory list and detail, groups, batches, reward curve.

Built on `Store.trajectories` / `Store.groups` / `Store.batches` plus the judges' tables
(`ScoringStore`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from collector.curve import highest_step
from collector.errors import NotFound
from collector.judging import run_view
from collector.protocol import Trajectory
from collector.read_protocol import (
    BatchView,
    CurvePoint,
    GroupView,
    Judgement,
    SequenceView,
    TrajectoryDetail,
    TrajectoryPage,
    TrajectorySummary,
)
from collector.ruler import render_message
from collector.scoring_store import ScoringStore
from collector.store_base import Store

__all__ = [
    "NO_MODEL_CALL",
    "batch_list",
    "group_list",
    "policy_step",
    "reward_curve",
    "trajectory_detail",
    "trajectory_page",
    "ungrouped",
]


def policy_step(trajectory: Trajectory) -> int | None:
    """The highest checkpoint step that sampled any of the trajectory's turns (None: unknown)."""
    return highest_step(trajectory.sequences)


NO_MODEL_CALL = "no model call: kept out of groups, leases and the judge"
"""Why a complete trajectory is in no group: the store groups every other complete one
(`placement.write_trajectories`)."""


def ungrouped(t: Trajectory) -> str | None:
    """Why a trajectory is in no group, or None when it is in one."""
    if t.group_id:
        return None
    return NO_MODEL_CALL if t.complete else "not complete: its rollout span, which names its group, has not arrived"


def _summary(t: Trajectory) -> dict[str, Any]:
    last = render_message(t.messages[-1]) if t.messages else ""
    return {
        "id": t.id, "trace_id": t.trace_id, "group_id": t.group_id, "task": t.task, "split": t.split, "model": t.model,
        "policy_step": policy_step(t), "reward": t.reward, "rewards": t.rewards, "messages": len(t.messages),
        "tokens": sum(len(s.token_ids) for s in t.sequences), "complete": t.complete, "token_exact": t.token_exact,
        "ungrouped": ungrouped(t), "last_message": last[:200],
    }


def trajectory_page(
    store: Store,
    *,
    task: str | None = None,
    group: str | None = None,
    split: str | None = None,
    policy_step_eq: int | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    limit: int = 100,
    offset: int = 0,
) -> TrajectoryPage:
    """Trajectories matching every filter (reward filters apply to the training reward), newest first.

    Without a policy-step or reward filter, only the page's trajectories are assembled; those filters need every
    trajectory assembled, as the training reward and the step come out of the spans and rewards.
    """
    if policy_step_eq is None and reward_min is None and reward_max is None:
        page = store.trajectories(group=group, task=task, split=split, newest_first=True, limit=limit, offset=offset)
        total = store.count_trajectories(group=group, task=task, split=split)
        return TrajectoryPage(total=total, items=[TrajectorySummary(**_summary(t)) for t in page])
    found = store.trajectories(group=group, task=task, split=split)
    if policy_step_eq is not None:
        found = [t for t in found if policy_step(t) == policy_step_eq]
    if reward_min is not None:
        found = [t for t in found if t.reward is not None and t.reward >= reward_min]
    if reward_max is not None:
        found = [t for t in found if t.reward is not None and t.reward <= reward_max]
    found.reverse()
    return TrajectoryPage(
        total=len(found), items=[TrajectorySummary(**_summary(t)) for t in found[offset : offset + limit]]
    )


def _judgements(scoring: ScoringStore, trajectory_id: str) -> list[Judgement]:
    rows = scoring.judgements([trajectory_id])[trajectory_id]
    return [Judgement(**{k: row[k] for k in Judgement.model_fields}) for row in rows]


def trajectory_detail(store: Store, scoring: ScoringStore, trajectory_id: str) -> TrajectoryDetail:
    """One trajectory with messages, tool calls, token counts, rewards and judge explanations.

    Raises:
        NotFound: no such trajectory.
    """
    t = store.trajectory(trajectory_id)
    if t is None:
        raise NotFound(f"no trajectory {trajectory_id!r}; list them with GET /v1/view/trajectories")
    sequences = [
        SequenceView(
            tokens=len(s.token_ids), completion_tokens=sum(s.assistant_mask),
            prompt_tokens=len(s.token_ids) - sum(s.assistant_mask), policy_step=s.policy_step,
        )
        for s in t.sequences
    ]
    tool_calls = sum(len(m.get("tool_calls") or []) for m in t.messages)
    return TrajectoryDetail(
        **_summary(t), conversation=t.messages, tools=t.tools, tool_calls=tool_calls, sequences=sequences,
        metadata=t.metadata, judgements=_judgements(scoring, t.id),
    )


def group_list(store: Store, scoring: ScoringStore, *, limit: int = 100) -> list[GroupView]:
    """The newest `limit` groups, newest first, with their state and their last judge run."""
    statuses = store.groups(limit=limit)
    runs = scoring.runs([g.id for g in statuses])
    return [
        GroupView(**g.model_dump(), judge=run_view(runs[g.id]) if g.id in runs else None) for g in statuses
    ]


def batch_list(store: Store, *, limit: int = 100) -> list[BatchView]:
    """The latest batches (leases), newest first, with their group ids."""
    return [BatchView(**b.model_dump()) for b in store.batches(limit=limit)]


def reward_curve(store: Store, *, name: str | None = None, split: str | None = None) -> list[CurvePoint]:
    """Mean reward (the training reward, or reward `name`) of the trajectories each policy step sampled.

    A training reward that is not finite (a weighted sum that overflowed: its group is skipped) is left out; the mean
    is exact, so finite rewards near the float limit do not overflow it. No trajectory is assembled
    (`Store.curve_facts`).
    """
    by_step: dict[int, list[float]] = defaultdict(list)
    for t in store.curve_facts(split=split):
        value = t.reward if name is None else t.rewards.get(name)
        step = t.policy_step
        if value is not None and math.isfinite(value) and step is not None:
            by_step[step].append(value)
    return [
        CurvePoint(policy_step=step, mean=statistics.mean(v), count=len(v), min=min(v), max=max(v))
        for step, v in sorted(by_step.items())
    ]

