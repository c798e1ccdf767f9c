"""Spans → trajectory: pure functions, no I/O.

A trajectory is identified by `art.rollout.id` (every span inside a rollout carries it) or,
for model calls outside any rollout, by its trace id. Its LLM spans, in start-time order,
become token sequences: a turn whose prompt starts with everything the previous sequence
holds (prompt and completion, token for token) extends that sequence; any other turn starts a
new one. Prompt tokens get mask 0 and no logprob, sampled tokens mask 1 and their logprob.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from art_langgraph import semconv as sc
from collector.otlp import SpanRecord
from collector.protocol import Sequence, Trajectory

__all__ = [
    "InvalidReward",
    "TrajectoryFacts",
    "assemble",
    "build_sequences",
    "facts",
    "is_llm",
    "span_rewards",
    "trajectory_key",
]

log = logging.getLogger(__name__)

_LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})


class InvalidReward(ValueError):
    """A reward event whose value is missing, not a number, or not finite."""


@dataclass(frozen=True)
class TrajectoryFacts:
    """What the store needs to know about a trajectory to place it in a group."""

    trace_id: str
    has_rollout_span: bool
    has_llm: bool
    group_key: str
    explicit_group: bool
    group_size: int | None
    task: str | None
    split: str


def trajectory_key(span: SpanRecord) -> tuple[str, bool]:
    """The trajectory a span belongs to: (`art.rollout.id`, True) or (trace id, False)."""
    rollout_id = span.attributes.get(sc.ROLLOUT_ID)
    if isinstance(rollout_id, str) and rollout_id:
        return rollout_id, True
    return span.trace_id, False


def is_llm(span: SpanRecord) -> bool:
    """True for a model call: `art.span.kind == "llm"` or a GenAI chat/completion span."""
    kind = span.attributes.get(sc.SPAN_KIND)
    if kind is not None:
        return kind == sc.SPAN_KIND_LLM
    return span.attributes.get(sc.GEN_AI_OPERATION_NAME) in _LLM_OPERATIONS


def span_rewards(span: SpanRecord) -> list[tuple[str, float]]:
    """The `art.reward` events of a rollout span as (name, value), in event order.

    Raises:
        InvalidReward: an event's value is missing, not a number, NaN or infinite.
    """
    if span.attributes.get(sc.SPAN_KIND) != sc.SPAN_KIND_ROLLOUT:
        return []
    rewards = []
    for event in span.events:
        if event.name != sc.REWARD_EVENT:
            continue
        name = event.attributes.get(sc.REWARD_NAME) or "reward"
        value = event.attributes.get(sc.REWARD_VALUE)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidReward(
                f"reward event {name!r} on span {span.span_id} has value {value!r}; it must be a finite number"
            )
        rewards.append((str(name), float(value)))
    return rewards


def _unique_sorted(spans: Iterable[SpanRecord]) -> list[SpanRecord]:
    """Drop duplicate span ids (first wins) and sort by start, end, id."""
    seen: dict[str, SpanRecord] = {}
    for span in spans:
        seen.setdefault(span.span_id, span)
    return sorted(seen.values(), key=lambda s: (s.start_ns, s.end_ns, s.span_id))


def _rollout_span(spans: list[SpanRecord]) -> SpanRecord | None:
    for span in spans:
        if span.attributes.get(sc.SPAN_KIND) == sc.SPAN_KIND_ROLLOUT:
            return span
    return None


def _first_attr(primary: SpanRecord | None, spans: list[SpanRecord], key: str) -> Any:
    """An attribute from the rollout span, else from the first span that has it."""
    if primary is not None and primary.attributes.get(key) is not None:
        return primary.attributes[key]
    for span in spans:
        if span.attributes.get(key) is not None:
            return span.attributes[key]
    return None


def facts(trajectory_id: str, spans: Iterable[SpanRecord]) -> TrajectoryFacts:
    """Summarise a trajectory's spans: identity, grouping key, task, split."""
    ordered = _unique_sorted(spans)
    if not ordered:
        raise ValueError(f"trajectory {trajectory_id!r} has no spans")
    rollout = _rollout_span(ordered)
    group = _first_attr(rollout, ordered, sc.GROUP)
    task = _first_attr(rollout, ordered, sc.TASK)
    size = _first_attr(rollout, ordered, sc.GROUP_SIZE)
    split = _first_attr(rollout, ordered, sc.SPLIT)
    group_key = str(group) if group else (str(task) if task else trajectory_id)
    return TrajectoryFacts(
        trace_id=(rollout or ordered[0]).trace_id,
        has_rollout_span=rollout is not None,
        has_llm=any(is_llm(span) for span in ordered),
        group_key=group_key,
        explicit_group=bool(group),
        group_size=int(size) if isinstance(size, int | float) and not isinstance(size, bool) and size > 0 else None,
        task=str(task) if task else None,
        split=str(split) if split else "train",
    )


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _turn(span: SpanRecord) -> tuple[list[int], list[int], list[float | None]] | None:
    """(prompt ids, completion ids, logprobs) of an LLM span, or None when not token-exact."""
    prompt = _int_list(span.attributes.get(sc.PROMPT_TOKEN_IDS))
    completion = _int_list(span.attributes.get(sc.COMPLETION_TOKEN_IDS))
    if prompt is None or completion is None:
        return None
    raw = span.attributes.get(sc.COMPLETION_LOGPROBS)
    if raw is None:
        logprobs: list[float | None] = [None] * len(completion)
    elif isinstance(raw, list) and len(raw) == len(completion):
        logprobs = [float(v) if isinstance(v, int | float) else None for v in raw]
    else:
        log.warning(
            "span %s: %s has %s entries for %d completion tokens; turn dropped",
            span.span_id,
            sc.COMPLETION_LOGPROBS,
            len(raw) if isinstance(raw, list) else type(raw).__name__,
            len(completion),
        )
        return None
    return prompt, completion, logprobs


def build_sequences(llm_spans: Iterable[SpanRecord]) -> tuple[list[Sequence], bool]:
    """Turn LLM spans into token sequences; returns (sequences, token_exact)."""
    sequences: list[Sequence] = []
    exact = True
    for span in _unique_sorted(llm_spans):
        turn = _turn(span)
        if turn is None:
            exact = False
            continue
        prompt, completion, logprobs = turn
        step = span.attributes.get(sc.POLICY_STEP)
        step = int(step) if isinstance(step, int | float) and not isinstance(step, bool) else None
        last = sequences[-1] if sequences else None
        if last is not None and last.token_ids and prompt[: len(last.token_ids)] == last.token_ids:
            tail = prompt[len(last.token_ids) :]
            last.token_ids += tail + completion
            last.logprobs += [None] * len(tail) + logprobs
            last.assistant_mask += [0] * len(tail) + [1] * len(completion)
            last.policy_step = step
        else:
            sequences.append(
                Sequence(
                    token_ids=prompt + completion,
                    logprobs=[None] * len(prompt) + logprobs,
                    assistant_mask=[0] * len(prompt) + [1] * len(completion),
                    policy_step=step,
                )
            )
    return sequences, exact


def _json_attr(span: SpanRecord, key: str, want: type) -> Any:
    """Parse a JSON-string attribute; a value of the wrong shape is logged and ignored."""
    raw = span.attributes.get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as exc:
        log.warning("span %s: attribute %s is not valid JSON (%s); ignored", span.span_id, key, exc)
        return None
    if not isinstance(value, want):
        log.warning("span %s: attribute %s is a %s, expected %s; ignored", span.span_id, key, type(value).__name__, want.__name__)
        return None
    return value


def assemble(
    trajectory_id: str,
    spans: Iterable[SpanRecord],
    *,
    group_id: str,
    complete: bool,
    reward_name: str,
    api_rewards: Mapping[str, float] | None = None,
) -> Trajectory:
    """Build a `Trajectory` from its spans, in any order, duplicates allowed.

    Args:
        trajectory_id: Rollout id, or trace id for calls outside a rollout.
        spans: Every span stored for the trajectory.
        group_id: The group the store placed the trajectory in.
        complete: Whether the trajectory is complete (decided by the store).
        reward_name: Which named reward becomes `Trajectory.reward`.
        api_rewards: Rewards posted by API; they override span events of the same name.
    """
    ordered = _unique_sorted(spans)
    summary = facts(trajectory_id, ordered)
    rollout = _rollout_span(ordered)
    llm = [span for span in ordered if is_llm(span)]
    sequences, exact = build_sequences(llm)

    rewards: dict[str, float] = {}
    if rollout is not None:
        rewards.update(span_rewards(rollout))
    rewards.update(api_rewards or {})

    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    model = None
    if llm:
        last = llm[-1]
        messages = list(_json_attr(last, sc.GEN_AI_INPUT_MESSAGES, list) or [])
        messages += _json_attr(last, sc.GEN_AI_OUTPUT_MESSAGES, list) or []
        tools = _json_attr(last, sc.GEN_AI_TOOL_DEFINITIONS, list) or []
        model = last.attributes.get(sc.GEN_AI_RESPONSE_MODEL) or last.attributes.get(sc.GEN_AI_REQUEST_MODEL)
    metadata = (_json_attr(rollout, sc.METADATA, dict) if rollout is not None else None) or {}

    return Trajectory(
        id=trajectory_id,
        trace_id=summary.trace_id,
        group_id=group_id,
        task=summary.task,
        split=summary.split,
        model=str(model) if model is not None else None,
        messages=messages,
        tools=tools,
        sequences=sequences,
        rewards=rewards,
        reward=rewards.get(reward_name),
        token_exact=exact,
        complete=complete,
        metadata=metadata,
    )
