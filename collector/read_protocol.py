"""Wire types of the judges (RULER, Langfuse) and of the read API behind the web page."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from collector.protocol import BatchStatus, GroupStatus, RequestBody

__all__ = [
    "BatchView",
    "CurvePoint",
    "JudgeRequest",
    "JudgeRun",
    "Judgement",
    "LangfuseSyncResult",
    "LangfuseSyncStatus",
    "SequenceView",
    "TrajectoryDetail",
    "TrajectoryPage",
    "TrajectorySummary",
    "GroupView",
]


class Judgement(BaseModel):
    """The judge's score and explanation for one trajectory."""

    trajectory_id: str
    name: str = Field(description="Reward name the judge wrote (default `ruler`).")
    score: float = Field(ge=0, le=1)
    explanation: str
    block: int | None = Field(
        default=None, description="Number of the trajectory's block in the judge prompt; None when zeroed."
    )
    duplicate_of: str | None = Field(
        default=None, description="Identical to this trajectory, which was judged in its place."
    )


class JudgeRequest(RequestBody):
    """Body of `POST /v1/groups/{id}/judge` (optional)."""

    rubric: str | None = Field(
        default=None, min_length=1, description="Rubric for this run (default: the configured one)."
    )

    @field_validator("rubric")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("rubric is blank; send one, or leave it out for the configured rubric")
        return value


class JudgeRun(BaseModel):
    """Outcome of the last judge run of a group."""

    group_id: str
    state: Literal["running", "ok", "failed", "skipped", "zeroed"] = Field(
        description="`running`: being judged (only read back, never the answer of a judge request); `ok`: scores "
        "stored; `failed`: retried later (retry policy), or once the group grows if the judge rejected the request "
        "(`next_try_at` empty); `skipped`: left unjudged; `zeroed`: all 0."
    )
    attempts: int
    error: str | None = None
    model: str
    trajectories: int
    distinct: int = Field(description="Distinct trajectories sent to the judge (identical ones are judged once).")
    started_at: float
    finished_at: float | None = None
    next_try_at: float | None = None
    max_tokens: int | None = Field(
        default=None, description="The judge's `max_tokens` in this run (none for a run recorded before schema "
        "version 10: unknown)."
    )
    judgements: list[Judgement] = Field(default_factory=list)


class LangfuseSyncResult(BaseModel):
    """What one Langfuse sync did."""

    pulled: int = Field(description="Numeric and boolean scores read from Langfuse.")
    applied: int = Field(description="New or changed scores stored as rewards.")
    unmatched: int = Field(description="Applied scores whose trace has no trajectory yet (they apply when it arrives).")
    ignored: int = Field(description="Scores that cannot be rewards (on a session, an experiment, a non-OTel trace; "
                         "with an id the store cannot hold: not UTF-8, over 256 characters, with a NUL).")
    withdrawn: int = Field(default=0, description="Pulled scores deleted in Langfuse since: their rewards taken back.")
    pushed: int = Field(description="Rewards sent to Langfuse as scores.")
    push_rejected: int = Field(default=0, description="Scores Langfuse rejected (HTTP 207).")
    retracted: int = Field(default=0, description="Scores pushed for trajectories deleted since (another "
                           "instrumentation's calls in a rollout's trace), deleted in Langfuse.")
    retract_refused: int = Field(default=0, description="Such scores Langfuse refused to delete for good (an HTTP 4xx "
                                 "other than 404, 408 and 429; logged): their records dropped, not tried again.")
    retract_failed: int = Field(default=0, description="Such scores Langfuse failed to delete for now (a 5xx, 408 or "
                                "429, no answer; logged): tried again after a growing delay (one minute to an hour), "
                                "the sync's other deletions left to the next sync.")
    skipped: bool = Field(default=False, description="True when another replica on the same PostgreSQL database was "
                          "syncing (logged): this sync did nothing, every count is 0. On SQLite, syncs are one at a "
                          "time per process only.")


class LangfuseSyncStatus(BaseModel):
    """This collector's Langfuse syncs since it started, the schedule's and `POST /v1/langfuse/sync`'s alike
    (`GET /v1/langfuse/sync`)."""

    last_sync: LangfuseSyncResult | None = Field(
        default=None, description="What the last sync that succeeded did; null until one has."
    )
    last_sync_at: float | None = Field(default=None, description="When it ended (Unix seconds).")
    last_error: str | None = Field(
        default=None, description="Why the latest sync failed, when it did (a failure of the schedule's is otherwise "
        "only logged): the error's type and message; null once a sync succeeds."
    )
    last_error_at: float | None = Field(default=None, description="When it failed (Unix seconds).")


class TrajectorySummary(BaseModel):
    """One row of the trajectory list."""

    id: str
    trace_id: str
    group_id: str
    task: str | None
    split: str
    model: str | None
    policy_step: int | None = Field(description="Highest checkpoint step that sampled a turn (0: base model).")
    reward: float | None
    rewards: dict[str, float]
    messages: int
    tokens: int
    complete: bool
    token_exact: bool
    ungrouped: str | None = Field(
        default=None,
        description="Why the trajectory is in no group (e.g. it made no model call), None when it is in one.",
    )
    last_message: str = Field(description="Start of the last message, for the list view.")


class TrajectoryPage(BaseModel):
    """A page of the trajectory list."""

    total: int
    items: list[TrajectorySummary]


class SequenceView(BaseModel):
    """Token counts of one sequence."""

    tokens: int
    prompt_tokens: int
    completion_tokens: int
    policy_step: int | None


class TrajectoryDetail(TrajectorySummary):
    """One trajectory as the web page shows it."""

    conversation: list[dict[str, Any]] = Field(description="Messages in OpenAI format, tool calls included.")
    tools: list[dict[str, Any]]
    tool_calls: int
    sequences: list[SequenceView]
    metadata: dict[str, Any]
    judgements: list[Judgement]


class GroupView(GroupStatus):
    """A group with its judge run."""

    judge: JudgeRun | None = None


class BatchView(BatchStatus):
    """A lease of groups to a trainer (`Store.batches`)."""


class CurvePoint(BaseModel):
    """Mean reward of the trajectories one checkpoint sampled."""

    policy_step: int
    mean: float
    count: int
    min: float
    max: float
