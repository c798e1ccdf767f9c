"""Spans → trajectory: pure functions, no I/O.

A trajectory is identified by `art.rollout.id` (every span inside a rollout carries it; a UUID's text in any form
as its 32 hex digits, `spans.rollout_key`) or, for model calls outside any rollout, by its trace id. Its LLM spans,
in start-time order, become token sequences (`collector.sequences`). Model calls of other instrumentations (see
`collector.foreign`) carry no token ids: their trajectories are not token-exact.

No model call counts twice when the app also sends another instrumentation's spans: a foreign
span of an `ARTChatModel` call (`foreign.describes_art_call`) is no model call at all, and a
trajectory that holds an `llm` span takes its turns from `llm` spans only (`model_calls`). Nor do another
instrumentation's calls in the trace of a rollout (a tool calling another model) make a trajectory of that trace
(`FactsDigest.foreign_only`; the store leaves them out in `collector.foreign_deletion`).

Rewards come from `art.reward` events on the rollout span and from reward spans
(`art.span.kind = reward`, with `art.reward.name` / `art.reward.value` attributes, and events).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from art_langgraph import semconv as sc
from collector import foreign
from collector.groups import TrainingReward
from collector.otlp import SpanRecord
from collector.protocol import DOT_SEGMENT_PROBLEM, MAX_COUNT, MAX_ID_LENGTH, Trajectory, has_dot_segment
from collector.sequences import build_sequences
from collector.spans import COUNTS, read_json, rollout_key, unique_sorted, warn_once, whole_number

__all__ = [
    "FactsDigest",
    "InvalidReward",
    "SpanReward",
    "TrajectoryFacts",
    "assemble",
    "facts",
    "is_llm",
    "model_calls",
    "span_problem",
    "span_rewards",
    "trajectory_key",
]

log = logging.getLogger(__name__)

_MAX_NS = 2**63 - 1


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
    """The trajectory a span belongs to: (`art.rollout.id` as the store keys it, `rollout_key`, True) or (trace id,
    False)."""
    rollout_id = span.attributes.get(sc.ROLLOUT_ID)
    if isinstance(rollout_id, str) and rollout_id:
        return rollout_key(rollout_id), True
    return span.trace_id, False


def is_llm(span: SpanRecord) -> bool:
    """True for a model call: an `llm` span, or a foreign model call not of an `ARTChatModel` call."""
    kind = span.attributes.get(sc.SPAN_KIND)
    if kind is not None:
        return kind == sc.SPAN_KIND_LLM
    return foreign.is_generation(span.attributes) and not foreign.describes_art_call(span.attributes)


def model_calls(spans: Iterable[SpanRecord]) -> list[SpanRecord]:
    """The spans that are a trajectory's turns: its `llm` spans, or, when it has none, its foreign model calls.

    A call that failed (`error.type` set, or the span's status ERROR: a retried attempt, a timeout) sampled nothing
    and is no turn.
    """
    calls = [span for span in spans if is_llm(span) and not span.failed and span.attributes.get(sc.ERROR_TYPE) is None]
    ours = [span for span in calls if span.attributes.get(sc.SPAN_KIND) == sc.SPAN_KIND_LLM]
    return ours or calls


@dataclass(frozen=True)
class SpanReward:
    """A reward a span carries; `time_ns` orders rewards of the same name (later wins)."""

    name: str
    value: float
    time_ns: int


def _reward(span: SpanRecord, name: Any, value: Any, time_ns: int) -> SpanReward:
    name = str(name) if name else "reward"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidReward(f"reward {name!r} on span {span.span_id} has value {value!r}; it must be a finite number")
    return SpanReward(name, float(value), time_ns)


def span_rewards(span: SpanRecord) -> list[SpanReward]:
    """Rewards of a rollout span (its `art.reward` events) or of a reward span (attributes and events).

    Raises:
        InvalidReward: a value is missing, not a number, NaN or infinite.
    """
    kind = span.attributes.get(sc.SPAN_KIND)
    if kind not in (sc.SPAN_KIND_ROLLOUT, sc.SPAN_KIND_REWARD):
        return []
    rewards = []
    if kind == sc.SPAN_KIND_REWARD and (sc.REWARD_VALUE in span.attributes or sc.REWARD_NAME in span.attributes):
        rewards.append(
            _reward(span, span.attributes.get(sc.REWARD_NAME), span.attributes.get(sc.REWARD_VALUE), span.end_ns)
        )
    for event in span.events:
        if event.name == sc.REWARD_EVENT:
            rewards.append(
                _reward(
                    span, event.attributes.get(sc.REWARD_NAME), event.attributes.get(sc.REWARD_VALUE), event.time_ns
                )
            )
    return rewards


def span_problem(span: SpanRecord) -> str | None:
    """Why the store must reject a span (an OTLP partial success), or None when it is fine."""
    if not (0 <= span.start_ns <= _MAX_NS and 0 <= span.end_ns <= _MAX_NS):
        return "timestamps beyond year 2262"
    limits = {
        sc.ROLLOUT_ID: MAX_ID_LENGTH,
        sc.GROUP: MAX_ID_LENGTH,
        sc.TASK: MAX_ID_LENGTH,
        sc.SPLIT: sc.MAX_SPLIT_LENGTH,
    }
    for key, limit in limits.items():
        value = span.attributes.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            return f"attribute {key} is a {type(value).__name__}; it must be a string"
        if len(value) > limit:
            return f"attribute {key} is longer than {limit} characters"
        if "\x00" in value:
            return f"attribute {key} contains a NUL character"
    # the ids the API's paths carry; without art.group, the task is the group id
    for key in (sc.ROLLOUT_ID, sc.GROUP) if span.attributes.get(sc.GROUP) else (sc.ROLLOUT_ID, sc.TASK):
        value = span.attributes.get(key)
        if value is not None and has_dot_segment(value):
            why = " (the group id, as the span has no art.group)" if key == sc.TASK else ""
            return f"attribute {key} {value[:40]!r}{why} {DOT_SEGMENT_PROBLEM}"
    if "\x00" in span.name:
        return "the span name contains a NUL character"
    for key, low in COUNTS.items():
        value = span.attributes.get(key)
        if value is not None and whole_number(value, low) is None:
            return f"attribute {key} is {value!r}; it must be a whole number from {low} to {MAX_COUNT}"
    try:
        rewards = span_rewards(span)
    except InvalidReward as exc:
        return str(exc)
    for reward in rewards:
        if reward.time_ns > _MAX_NS:  # the store keeps a reward's time in a 64-bit signed column
            return f"reward {reward.name[:40]!r} has a time beyond year 2262"
        if len(reward.name) > MAX_ID_LENGTH or "\x00" in reward.name:
            return f"reward name {reward.name[:40]!r}... is longer than {MAX_ID_LENGTH} characters or holds a NUL"
    return None


def _rollout_span(spans: list[SpanRecord]) -> SpanRecord | None:
    for span in spans:
        if span.attributes.get(sc.SPAN_KIND) == sc.SPAN_KIND_ROLLOUT:
            return span
    return None


_FACT_KEYS = (sc.GROUP, sc.TASK, sc.GROUP_SIZE, sc.SPLIT)
"""Attributes that place a trajectory in a group, read from the rollout span or the first span with them."""


def _order(span: SpanRecord) -> list[Any]:
    """A span's place in a trajectory: start, end, span id, trace id (the order of `spans.unique_sorted`: spans of
    two traces in one trajectory may share a span id)."""
    return [span.start_ns, span.end_ns, span.span_id, span.trace_id]


@dataclass
class FactsDigest:
    """What `TrajectoryFacts` need from a trajectory's spans, kept up to date span by span.

    Each part is a minimum by span order (`_order`) or an "any", so adding spans in any
    order, or the same span twice, gives the same digest; the store keeps it on the trajectory
    row, so an export costs work for its own spans only, not for every span stored before.
    """

    rollout: list[Any] | None = None
    """The first rollout span: its order (which ends with its trace id), and its non-None grouping attributes."""
    first: list[Any] | None = None
    """The first span: its order (which ends with its trace id)."""
    attrs: dict[str, list[Any]] = field(default_factory=dict)
    """Per grouping attribute, the first span that has it (not None): its order and the value (a digest stored
    before the order held the trace id has parts of 3 items, first on a tie)."""
    llm: bool = False
    """Some span is a model call."""
    ours: bool = False
    """Some span is an `llm` span (a model call of ours; `llm` without it: only other instrumentations' calls)."""

    @classmethod
    def of(cls, spans: Iterable[SpanRecord]) -> FactsDigest:
        """The digest of `spans`."""
        digest = cls()
        digest.add(spans)
        return digest

    def add(self, spans: Iterable[SpanRecord]) -> None:
        """Take `spans` into account."""
        for span in spans:
            order = _order(span)
            if self.first is None or order < self.first:
                self.first = order
            if span.attributes.get(sc.SPAN_KIND) == sc.SPAN_KIND_ROLLOUT and (
                self.rollout is None or order < self.rollout[:4]
            ):
                kept = {key: span.attributes[key] for key in _FACT_KEYS if span.attributes.get(key) is not None}
                self.rollout = [*order, kept]
            for key in _FACT_KEYS:
                if span.attributes.get(key) is not None and (key not in self.attrs or order < self.attrs[key][:-1]):
                    self.attrs[key] = [*order, span.attributes[key]]
            self.llm = self.llm or is_llm(span)
            self.ours = self.ours or span.attributes.get(sc.SPAN_KIND) == sc.SPAN_KIND_LLM

    def merge(self, other: FactsDigest) -> None:
        """Take into account the spans `other` saw (as `add` of them would)."""
        if other.first is not None and (self.first is None or other.first < self.first):
            self.first = other.first
        if other.rollout is not None and (self.rollout is None or other.rollout[:4] < self.rollout[:4]):
            self.rollout = other.rollout
        for key, part in other.attrs.items():
            if key not in self.attrs or part[:-1] < self.attrs[key][:-1]:
                self.attrs[key] = part
        self.llm = self.llm or other.llm
        self.ours = self.ours or other.ours

    @property
    def foreign_only(self) -> bool:
        """Its model calls are all other instrumentations' (it has some, none an `llm` span)."""
        return self.llm and not self.ours

    def to_json(self) -> str:
        """The digest as JSON (the store's `trajectories.digest` column)."""
        return json.dumps({"rollout": self.rollout, "first": self.first, "attrs": self.attrs, "llm": self.llm,
                           "ours": self.ours})

    @classmethod
    def from_json(cls, text: str) -> FactsDigest:
        """The inverse of `to_json`; a digest stored before `ours` was kept counts every model call as ours."""
        data = json.loads(text)
        return cls(rollout=data["rollout"], first=data["first"], attrs=data["attrs"], llm=data["llm"],
                   ours=data.get("ours", data["llm"]))

    def _value(self, key: str) -> Any:
        """An attribute from the rollout span, else from the first span that has it."""
        if self.rollout is not None and key in self.rollout[4]:
            return self.rollout[4][key]
        return self.attrs[key][-1] if key in self.attrs else None

    def facts(self, trajectory_id: str) -> TrajectoryFacts:
        """The facts of the trajectory whose spans this digest saw.

        Raises:
            ValueError: the digest saw no span.
        """
        if self.first is None:
            raise ValueError(f"trajectory {trajectory_id!r} has no spans")
        group, task, size, split = (self._value(key) for key in _FACT_KEYS)
        return TrajectoryFacts(
            trace_id=(self.rollout or self.first)[3],
            has_rollout_span=self.rollout is not None,
            has_llm=self.llm,
            group_key=str(group) if group else (str(task) if task else trajectory_id),
            explicit_group=bool(group),
            group_size=whole_number(size, COUNTS[sc.GROUP_SIZE]),
            task=str(task) if task else None,
            split=str(split) if split else "train",
        )


def facts(trajectory_id: str, spans: Iterable[SpanRecord]) -> TrajectoryFacts:
    """Summarise a trajectory's spans: identity, grouping key, task, split."""
    return FactsDigest.of(spans).facts(trajectory_id)


def _json_attr(span: SpanRecord, key: str, want: type) -> Any:
    """Parse a JSON-string attribute; a value of the wrong shape is logged and ignored."""
    raw = span.attributes.get(key)
    if raw is None:
        return None
    try:
        value = read_json(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        warn_once(log, "span %s: attribute %s is not valid JSON (%s); ignored", span.span_id, key, exc)
        return None
    if not isinstance(value, want):
        warn_once(log, "span %s: attribute %s is a %s, expected %s; ignored", span.span_id, key,
                  type(value).__name__, want.__name__)
        return None
    return value


def _length_cut(calls: list[SpanRecord], messages: list[dict[str, Any]]) -> list[int]:
    """Indices in `messages` of the replies the token limit cut: those of the calls whose first reply's finish
    reason (`foreign.finish_reason`, in any convention) is `length` and whose prompt and reply begin `messages`."""
    cut: set[int] = set()
    for span in calls:
        if foreign.finish_reason(span.attributes) != "length":
            continue
        talk = foreign.conversation(span.attributes, span_id=span.span_id)
        turn = talk.input + talk.output[:1]
        if talk.output and talk.output[0].get("role") == "assistant" and foreign.same_messages(
                messages[: len(turn)], turn):
            cut.add(len(talk.input))
    return sorted(cut)


MAX_NESTING = 200
"""Deepest nesting of lists and objects a trajectory's messages, tools or metadata may hold: no convention writes
near as much, and a response cannot encode much more (pydantic stops at about 255 levels, a batch included), so
deeper ones read as absent."""


def _nesting(value: Any) -> int:
    """How many levels of lists and objects nest in `value` (0: a scalar); iterative, for any depth."""
    depth, level = 0, [value]
    while containers := [item for item in level if isinstance(item, (list, dict))]:
        depth += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return depth


def _bounded(value: Any, empty: Any, what: str, trajectory_id: str) -> Any:
    """`value`, or `empty` with a warning when it nests deeper than `MAX_NESTING`."""
    if _nesting(value) <= MAX_NESTING:
        return value
    warn_once(log, "trajectory %s: its %s nest deeper than %d levels; read as absent", trajectory_id, what, MAX_NESTING)
    return empty


def assemble(
    trajectory_id: str,
    spans: Iterable[SpanRecord],
    *,
    group_id: str,
    complete: bool,
    rewards: Mapping[str, float],
    training: TrainingReward,
) -> Trajectory:
    """Build a `Trajectory` from its spans, in any order, duplicates allowed.

    Args:
        trajectory_id: Rollout id, or trace id for calls outside a rollout.
        spans: Every span stored for the trajectory.
        group_id: The group the store placed the trajectory in.
        complete: Whether the trajectory is complete (decided by the store).
        rewards: Its named rewards, from every source (see `groups.merge_rewards`).
        training: Which reward trains; becomes `Trajectory.reward`.
    """
    ordered = unique_sorted(spans)
    summary = facts(trajectory_id, ordered)
    rollout = _rollout_span(ordered)
    llm = model_calls(ordered)
    built = build_sequences(llm)

    talk = foreign.conversation(llm[-1].attributes, span_id=llm[-1].span_id) if llm else foreign.Conversation()
    metadata = (_json_attr(rollout, sc.METADATA, dict) if rollout is not None else None) or {}
    metadata = _bounded(metadata, {}, "metadata", trajectory_id)
    if len(talk.output) > 1:  # each returned message is one choice (a request's `n`), not a turn after the one before
        warn_once(log, "span %s: the call returned %d choices; the first ends the trajectory", llm[-1].span_id,
                    len(talk.output))
    messages = _bounded(talk.input + talk.output[:1], [], "messages", trajectory_id)
    return Trajectory(
        id=trajectory_id,
        trace_id=summary.trace_id,
        group_id=group_id,
        task=summary.task,
        split=summary.split,
        model=talk.model,
        messages=messages,
        tools=_bounded(talk.tools, [], "tools", trajectory_id),
        sequences=built.sequences,
        rewards=dict(rewards),
        reward=training.of(rewards),
        token_exact=built.token_exact,
        length_cut=_length_cut(llm, messages),
        drift=built.drift,
        complete=complete,
        metadata=metadata,
    )
