"""Wire types of the collector's HTTP API, shared with the trainer service.

The trainer imports `Batch`, `Group`, `Trajectory` and `Sequence` from here; the collector
produces them. Every list that runs along a sequence (`token_ids`, `logprobs`,
`assistant_mask`) has the same length.
"""

from __future__ import annotations

import logging
import math
import re
from contextvars import ContextVar
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    Field,
    ModelWrapValidatorHandler,
    NonNegativeInt,
    StringConstraints,
    field_validator,
    model_validator,
)

log = logging.getLogger(__name__)

MAX_ID_LENGTH = 256
"""Longest rollout id, group, task, reward name or trainer name (the store's column width)."""
MAX_COUNT = 2**31 - 1
"""Largest group size or policy step (the store's INTEGER columns)."""
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
"""Header of `POST /v1/batches` that makes a retried lease request get the batch its first try leased."""
MIN_LEASE_SECONDS = 1.0
"""Shortest lease a trainer may take: a shorter one (`1e-300`) expires before its answer reaches the trainer, and
each of its groups counts a failed attempt."""
MAX_LEASE_SECONDS = 7 * 24 * 3600.0
"""Longest lease a trainer may take: a week."""

REWARD_SPREAD_TOLERANCE = 1e-12
"""Rewards of a group that differ by no more than this, relatively or absolutely, are equal: float rounding
(`0.1 + 0.2 + 0.3` against `0.3 + 0.2 + 0.1`) is no signal, yet scaled by the group's tiny std it would be one."""


_SURROGATE = re.compile(r"[\ud800-\udfff]")
"""A UTF-16 surrogate: in text `json.loads` made, one without its pair (it joins a pair into one character)."""


def without_surrogates(value: Any) -> Any:
    """`value` (as `json.loads` makes it) with each lone surrogate in its strings, keys too, as U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [without_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {without_surrogates(key): without_surrogates(item) for key, item in value.items()}
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""A control character (C0, DEL, C1) or a Unicode line or paragraph separator: each can break a log line."""


def has_reward_spread(rewards: list[float]) -> bool:
    """Whether a group's rewards differ beyond float rounding (`REWARD_SPREAD_TOLERANCE`): the rule by which the
    collector leases a group and the trainer trains it."""
    low, high = min(rewards), max(rewards)
    return not math.isclose(low, high, rel_tol=REWARD_SPREAD_TOLERANCE, abs_tol=REWARD_SPREAD_TOLERANCE)


Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_LENGTH, pattern=r"^[^\x00]*$")]
"""An id or a name as the store keeps it: 1 to 256 characters, no NUL."""


def has_dot_segment(value: str) -> bool:
    """Whether `value` has a `/`-separated part `.` or `..`: browsers and HTTP clients (httpx, requests) drop such a
    segment from a URL path, so no path route (`GET /v1/trajectories/{id}`) could reach an id holding one."""
    return any(part in (".", "..") for part in value.split("/"))


DOT_SEGMENT_PROBLEM = "has a path segment '.' or '..', which HTTP clients drop from a URL"
"""Why a span may not carry the id of a trajectory or a group with a `.` or `..` segment (`has_dot_segment`)."""

TraceId = Annotated[str, StringConstraints(strip_whitespace=True, to_lower=True, pattern=r"^[0-9a-fA-F]{32}$")]
"""An OpenTelemetry trace id: 32 hex digits of either case, kept in lower case as OTLP spans carry it (pydantic
matches the pattern before it lowers the case)."""


request_route: ContextVar[str] = ContextVar("request_route", default="(no request)")
"""The HTTP request being served, `POST /v1/batches` (the collector's app sets it), named by the warning of
`RequestBody`."""


class RequestBody(BaseModel):
    """A request body. Fields it does not know are ignored, as a newer client may send them, and logged once per
    request at WARNING with `request_route`: their names only, never their values."""

    @model_validator(mode="wrap")
    @classmethod
    def _log_unknown_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        body = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields) | {field.alias for field in cls.model_fields.values() if field.alias}
            if unknown := sorted(set(data) - known):
                log.warning("%s: request fields %s were present but ignored (unknown to %s)",
                            request_route.get(), unknown, cls.__name__)
        return body


class ErrorResponse(BaseModel):
    """The one error envelope every endpoint answers with on failure."""

    error: str = Field(description="Machine-readable error code, e.g. `not_found`.")
    message: str = Field(description="What went wrong and how to fix it.")


class Sequence(BaseModel):
    """One token sequence of a trajectory: consecutive turns that extend each other."""

    token_ids: list[int] = Field(description="Prompt and completion tokens, in order.")
    logprobs: list[float | None] = Field(
        description="Sampled log-probability for assistant tokens; None for prompt tokens."
    )
    assistant_mask: list[int] = Field(description="1 for tokens the model sampled, else 0.")
    policy_step: int | None = Field(default=None, description="Checkpoint step that sampled the last turn.")


class Drift(BaseModel):
    """A turn whose messages extend the previous turn's but whose prompt tokens do not.

    The chat template re-rendered earlier text differently from what the engine sampled
    (retokenization drift): the turn starts a new sequence instead of extending the last one.
    """

    span_id: str = Field(description="The LLM span of the drifting turn.")
    turn: int = Field(description="Index of the turn among the trajectory's LLM calls (0-based).")
    position: int = Field(description="First token index where the prompt leaves the previous sequence.")
    expected: list[int] = Field(description="The previous sequence's tokens from `position` on (at most 8).")
    got: list[int] = Field(description="The prompt's tokens from `position` on (at most 8).")


class Trajectory(BaseModel):
    """One attempt at a task: the messages, the exact token sequences and the rewards."""

    id: str = Field(description="Rollout id.")
    trace_id: str = Field(description="OpenTelemetry trace id (32 hex digits).")
    group_id: str = Field(description="GRPO group the trajectory belongs to.")
    task: str | None = None
    split: str = "train"
    model: str | None = Field(default=None, description="Response model of the last LLM call.")
    messages: list[dict[str, Any]] = Field(
        default_factory=list, description="Final conversation: last prompt plus its reply (OpenAI format)."
    )
    tools: list[dict[str, Any]] = Field(default_factory=list)
    sequences: list[Sequence] = Field(default_factory=list)
    rewards: dict[str, float] = Field(default_factory=dict, description="Every named reward.")
    reward: float | None = Field(default=None, description="The training reward (configured name).")
    token_exact: bool = Field(
        default=True,
        description="False when any turn lacks engine token ids (foreign GenAI spans): "
        "the trainer re-tokenizes `messages`.",
    )
    length_cut: list[NonNegativeInt] = Field(
        default_factory=list,
        description="Indices in `messages` of assistant replies cut by the token limit (finish reason `length`): "
        "the model did not end them, so re-tokenized they train no end-of-turn token.",
    )
    drift: list[Drift] = Field(default_factory=list, description="Turns with retokenization drift (see `Drift`).")
    complete: bool = Field(default=False, description="The rollout span has ended.")
    metadata: dict[str, Any] = Field(default_factory=dict)


class Group(BaseModel):
    """Trajectories of the same group, compared with each other by GRPO."""

    id: str
    task: str | None = None
    trajectories: list[Trajectory]


class BatchRequest(RequestBody):
    """Body of `POST /v1/batches`."""

    # strict: a bool or a string is refused, not read as a number (`true` as a lease of 1 s)
    max_groups: int = Field(default=8, ge=1, le=1024, strict=True, description="Most groups to lease.")
    min_groups: int = Field(
        default=1, ge=1, le=1024, strict=True,
        description="Lease nothing unless this many are ready; at most `max_groups`.",
    )
    lease_seconds: float = Field(
        default=900.0,
        ge=MIN_LEASE_SECONDS,
        le=MAX_LEASE_SECONDS,
        strict=True,
        description="Lease length, from 1 s to a week; expired leases return groups to the pool.",
    )
    trainer: Name | None = Field(default=None, description="Name of the trainer taking the lease (shown in the UI).")
    idempotency_key: Name | None = Field(
        default=None,
        exclude=True,
        description=f"The `{IDEMPOTENCY_KEY_HEADER}` header (or this field): a request sent again with the same key "
        "while its lease lasts gets the same batch, not a second lease; one key per lease, e.g. a random UUID.",
    )

    @field_validator("trainer")
    @classmethod
    def _loggable(cls, trainer: str | None) -> str | None:
        """Refuse a name with a control character or line separator: the name is logged as sent (a line break in it
        would forge log lines) and shown on the batch. `art-trainer` sends its `--name` (letters, digits, `_.-`)."""
        if trainer is not None and (found := _CONTROL.search(trainer)):
            raise ValueError(f"holds U+{ord(found.group()):04X}: a trainer's name is logged and shown as sent, so it "
                             "takes no control character or line separator")
        return trainer

    @model_validator(mode="after")
    def _satisfiable(self) -> BatchRequest:
        if self.min_groups > self.max_groups:
            raise ValueError(
                f"min_groups={self.min_groups} exceeds max_groups={self.max_groups}: no lease could ever hold them"
            )
        return self


class Batch(BaseModel):
    """A lease of ready groups to one trainer. Ack it when trained."""

    id: str
    groups: list[Group]
    lease_expires_at: float = Field(description="Unix time when the lease runs out.")


class AckRequest(RequestBody):
    """Body of `POST /v1/batches/{id}/ack`."""

    policy_step: int | None = Field(
        default=None, ge=0, le=MAX_COUNT, strict=True,
        description="Checkpoint step trained from this batch; a bool or a string is refused, not read as a number.",
    )


MAX_REASON_CHARS = 2000
"""Longest `ReleaseRequest.reason` the collector keeps; a longer one is cut to this length, ending in `…`."""


class ReleaseRequest(RequestBody):
    """Body of `POST /v1/batches/{id}/release`: the batch was not trained, and why."""

    reason: str = Field(
        min_length=1,
        description=f"What went wrong (the trainer's error), shown on the batch and on groups it gets skipped; "
        f"cut to {MAX_REASON_CHARS} characters.",
    )
    failed: bool = Field(
        default=True,
        description="True: the batch's data made the step fail, each group counts a failed attempt (see "
        "`ART_COLLECTOR_MAX_FAILED_ATTEMPTS`). False: the trainer itself failed (disk full, engine down): the "
        "groups go back uncounted.",
    )

    @field_validator("reason", mode="before")
    @classmethod
    def _storable(cls, reason: Any) -> Any:
        """The text as every backend stores it and every answer encodes it: a NUL (PostgreSQL's text holds none) and
        a lone surrogate (JSON's `"\\ud800"` reads as one, and no UTF-8 holds it) each become U+FFFD. A trainer's
        error text may hold either; refused, the release would leave the groups leased until the lease expires."""
        return without_surrogates(reason).replace("\x00", "\ufffd") if isinstance(reason, str) else reason

    @field_validator("reason")
    @classmethod
    def _bounded(cls, reason: str) -> str:
        return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 1] + "…"


class RewardIn(RequestBody):
    """Body of `POST /v1/rewards`: one named reward for one trajectory."""

    rollout_id: Name | None = Field(
        default=None,
        description="Trajectory id (a UUID's text in any form, dashed, braced, `urn:uuid:` or upper case, names the "
        "trajectory of its 32 lower-case hex digits, as in a span's `art.rollout.id`); or give trace_id.",
    )
    trace_id: TraceId | None = Field(
        default=None, description="Trace id (32 hex digits, either case), when the rollout id is unknown."
    )
    name: Name = "reward"
    value: float = Field(
        strict=True, description="A JSON number (an integer too); a bool or a string is refused, as in a span reward."
    )

    @field_validator("value")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("reward value must be a finite number (got NaN or infinity)")
        return value

    @field_validator("trace_id")
    @classmethod
    def _valid_trace(cls, value: str | None) -> str | None:
        if value is not None and not int(value, 16):  # OpenTelemetry's invalid trace id: no span carries it
            raise ValueError("trace_id must not be all zeros (OpenTelemetry's invalid trace id, which no span has)")
        return value


GroupState = Literal["open", "ready", "leased", "trained", "skipped", "expired"]
"""A group's state as the read API shows it (`open`, `ready` and the pool's `skipped` are computed for open groups)."""


class GroupStatus(BaseModel):
    """A group as shown by the read API."""

    id: str
    task: str | None
    size: int
    expected: int = Field(
        description="Trajectories the group waits for: its announced size (`art.group.size`), "
        "else the minimum group size."
    )
    complete: int
    rewarded: int
    state: GroupState
    reason: str | None = None
    failed_attempts: int = Field(
        default=0, description="Failed trainings of the group: releases as failed and expired leases."
    )


class BatchStatus(BaseModel):
    """A batch (a lease of groups to a trainer) as shown by the read API."""

    id: str
    trainer: str | None
    state: Literal["leased", "acked", "expired", "released"]
    created_at: float
    lease_expires_at: float
    acked_at: float | None
    policy_step: int | None
    groups: list[str] = Field(description="Ids of the leased groups, sorted.")
    reason: str | None = Field(
        default=None,
        description="Why the lease ended without an ack: the trainer's error (`released`) "
        "or `lease expired` (`expired`).",
    )


class RewardAccepted(BaseModel):
    """Answer of `POST /v1/rewards`: the stored reward, and whether its trajectory is known yet."""

    rollout_id: str | None = Field(description="The trajectory id as stored: a UUID's as its 32 lower-case hex digits.")
    trace_id: str | None
    name: str
    value: float
    trajectory_known: bool = Field(description="False: stored, and applied when the trajectory's spans arrive.")


class AckResponse(BaseModel):
    """Answer of `POST /v1/batches/{id}/ack`."""

    batch_id: str
    groups: list[str] = Field(description="Ids of the groups now marked trained.")
    policy_step: int | None = None


class ReleaseResponse(BaseModel):
    """Answer of `POST /v1/batches/{id}/release` (the same answer again for a batch released already)."""

    batch_id: str
    returned: list[str] = Field(
        description="Ids of the batch's groups that went back to the pool when the batch ended (released now, or its "
        "lease expired before), sorted; they can be leased again at once. A group emptied then (its trajectories were "
        "another instrumentation's calls, deleted as it returned) is in neither list: it is skipped."
    )
    skipped: list[str] = Field(
        description="Ids of the batch's groups that reached `max_failed_attempts` when the batch ended: skipped, "
        "never leased again automatically; sorted."
    )
    max_failed_attempts: int = Field(description="The collector's limit of failed attempts per group (0: no limit).")


class ReopenResponse(BaseModel):
    """Answer of `POST /v1/groups/{group_id}/reopen`: the group is `open` again, its failed attempts forgotten."""

    group_id: str
    previous_state: GroupState = Field(description="The state it was reopened from: `skipped` or `expired`.")
    previous_reason: str | None = Field(default=None, description="Why it was in that state.")
    failed_attempts: int = Field(description="The failed attempts it had counted, now reset to 0.")
