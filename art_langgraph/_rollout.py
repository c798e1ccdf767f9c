"""Rollouts: one trajectory = one root span (`art.span.kind = "rollout"`) and a context var.

The current rollout lives in a `contextvars.ContextVar`, so it follows asyncio tasks and the
context copies LangGraph makes for sync nodes in its thread pool; every model span opened
inside reads its id from there.
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

from art_langgraph import semconv
from art_langgraph._checks import check_count
from art_langgraph._collector_client import apost_reward, post_reward
from art_langgraph._recorded_values import _check_name, _check_reward, _metadata_json
from art_langgraph._span_status import mark_ended_by
from art_langgraph._tracing import start_root_span
from collector.protocol import DOT_SEGMENT_PROBLEM, has_dot_segment

__all__ = ["Rollout", "current_rollout", "rollout"]

_logger = logging.getLogger(__name__)

_current: ContextVar[Rollout | None] = ContextVar("art_langgraph_rollout", default=None)
_warned_stepped_apart = False
"""Whether `Rollout._leave` has logged, once per process, a block stepped through several contexts."""


class Rollout:
    """One trajectory. Use as `with rollout(...) as r:` or `async with rollout(...) as r:`.

    Attributes:
        id: Rollout id (uuid4 hex), carried by every span inside as `art.rollout.id`.
        task: Task name (default grouping key).
        group: GRPO group id, if given.
        split: `train` or `val` (any string).
        metadata: Free-form metadata, exported as JSON as it was when the rollout was created.
        group_size: Expected number of rollouts in the group, if known.
    """

    def __init__(
        self,
        task: str,
        *,
        group: str | None = None,
        split: str = "train",
        metadata: dict[str, Any] | None = None,
        group_size: int | None = None,
        _id: str | None = None,
        _source: str = "rollout",
        _trace_id: int | None = None,
    ) -> None:
        if not task:
            raise ValueError("rollout(task) needs a non-empty task name")
        _check_name(task, "task")
        if group is not None:
            _check_name(group, "group")
        _check_name(split, "split", semconv.MAX_SPLIT_LENGTH)
        if group == "":  # the collector reads it as no group: the rollout joined every rollout of its task
            raise ValueError("rollout group must be a non-empty string; leave it out (None) to group by task")
        if split == "":  # the collector reads it as `train`
            raise ValueError("rollout split must be a non-empty string (an empty one would be stored as 'train')")
        key, what = (group, "group") if group else (task, "task (the group id without a group)")
        if has_dot_segment(key):
            raise ValueError(f"{what} {key[:40]!r} {DOT_SEGMENT_PROBLEM}")
        self.id = _id or uuid.uuid4().hex
        self._source = _source
        self._trace_id = _trace_id
        self.task = task
        self.group = group
        self.split = split
        self._metadata_json = _metadata_json(metadata)
        self.metadata = dict(metadata or {})
        self.group_size = check_count(group_size)
        self._span: Span | None = None
        self._ended = False
        self._tokens: tuple[Token[Rollout | None], object] | None = None

    @property
    def trace_id(self) -> str:
        """Trace id of the rollout span as 32 hex digits (available once entered)."""
        if self._span is None:
            raise RuntimeError("the rollout has not started; enter it with `with` first")
        return format(self._span.get_span_context().trace_id, "032x")

    def span_attributes(self) -> dict[str, Any]:
        """The `art.*` rollout attributes every span inside this rollout carries."""
        attrs: dict[str, Any] = {semconv.ROLLOUT_ID: self.id, semconv.TASK: self.task, semconv.SPLIT: self.split}
        if self.group is not None:
            attrs[semconv.GROUP] = self.group
        if self.group_size is not None:
            attrs[semconv.GROUP_SIZE] = self.group_size
        return attrs

    def reward(self, value: float, name: str = "reward") -> None:
        """Attach a reward: an `art.reward` event while running, a collector POST after.

        Args:
            value: A finite number.
            name: Reward name (the collector is told which name trains).

        Raises:
            ValueError: `value` is NaN or infinite, or `name` is empty.
            TypeError: `value` is not a number.
            RuntimeError: The rollout has not been entered (no trajectory would ever take the reward).
            httpx.HTTPError: After the rollout ended, the collector could not be reached.
        """
        value = self._checked(value, name)
        if self._span is not None and not self._ended:
            self._span.add_event(semconv.REWARD_EVENT, {semconv.REWARD_NAME: name, semconv.REWARD_VALUE: value})
        else:
            post_reward(self.id, name, value)

    async def areward(self, value: float, name: str = "reward") -> None:
        """Async `reward`: same checks; after the rollout ended, the POST does not block."""
        value = self._checked(value, name)
        if self._span is not None and not self._ended:
            self.reward(value, name)
        else:
            await apost_reward(self.id, name, value)

    def _checked(self, value: float, name: str) -> float:
        """`_check_reward`, and refuse a rollout not entered yet: its id would never name a trajectory."""
        value = _check_reward(value, name)
        if self._span is None:
            raise RuntimeError(f"rollout({self.task!r}) has not started; give its reward inside `with rollout(...)`")
        return value

    def _begin(self) -> Span:
        """Start the rollout span as a fresh root (in the trace given at creation, if any), without touching any context
        variable."""
        if self._span is not None:
            raise RuntimeError("a rollout can be entered only once; create a new one")
        attrs = {
            semconv.SPAN_KIND: semconv.SPAN_KIND_ROLLOUT,
            semconv.ROLLOUT_SOURCE: self._source,
            **self.span_attributes(),
        }
        if self._metadata_json is not None:
            attrs[semconv.METADATA] = self._metadata_json
        self._span = start_root_span(f"rollout {self.task}", attrs, self._trace_id)
        return self._span

    def _finish(self, exc: BaseException | None) -> None:
        """End the rollout span; an exception marks it ERROR, but not a consumer that stopped reading
        (`GeneratorExit`) nor a cancelled task (`mark_ended_by`)."""
        assert self._span is not None
        mark_ended_by(self._span, exc)
        self._ended = True
        self._span.end()

    def __enter__(self) -> Rollout:
        span = self._begin()
        token = _current.set(self)
        otel_token = otel_context.attach(trace.set_span_in_context(span))
        self._tokens = (token, otel_token)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish(exc)
        self._leave(exc)

    def _leave(self, exc: BaseException | None) -> None:
        """Undo what `__enter__` made current, if the block is left in the context it was entered in.

        It may be left in another one; nothing is undone there, and the span has ended all the same.
        Benign, and told apart by its `GeneratorExit`: an async generator that the event loop closes
        after its consumer went away runs its `finally` in a new task. Otherwise the block was stepped
        through several contexts (a sync generator under Starlette's `StreamingResponse` gets a copy
        per step), so model calls after the entering step were outside the rollout: logged once per
        process. A generator of that kind closed early (`GeneratorExit` too) goes unreported.
        """
        global _warned_stepped_apart
        assert self._tokens is not None
        token, otel_token = self._tokens
        try:
            _current.reset(token)
        except ValueError:  # "created in a different Context": not the context the block was entered in
            if not isinstance(exc, GeneratorExit) and not _warned_stepped_apart:
                _warned_stepped_apart = True
                _logger.warning(
                    "art_langgraph: rollout(%r) was left in another context than it was entered in, likely by a "
                    "generator stepped in a new copy of the context per step (as Starlette's StreamingResponse steps "
                    "a sync iterator): its model calls after the first step were not in the rollout. Use an async "
                    "generator (Starlette steps it in one task), or open the rollout around the whole response.",
                    self.task,
                )
            return
        otel_context.detach(otel_token)  # type: ignore[arg-type]

    async def __aenter__(self) -> Rollout:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


def rollout(
    task: str,
    *,
    group: str | None = None,
    split: str = "train",
    metadata: dict[str, Any] | None = None,
    group_size: int | None = None,
) -> Rollout:
    """Open one trajectory; use with `with` or `async with`.

    Args:
        task: Task name; trajectories of one task are compared when no group is given.
        group: GRPO group id shared by rollouts that answer the same input.
        split: `train` (leased for training) or `val` (any string).
        metadata: Free-form JSON-serialisable metadata.
        group_size: Number of rollouts expected in the group, when known.

    Returns:
        The rollout handle (`.id`, `.trace_id`, `.reward(...)`).

    Raises:
        ValueError: What the collector would reject with every span of the rollout: an empty task, a task or group
            over 256 characters, a split over 64, a NUL in any, a `group_size` out of 1 to 2**31 - 1; `metadata` that
            JSON cannot take (a circular reference, a NaN or infinity, NumPy's and a `Decimal`'s too, which the
            collector read as null: the error names where it is, as a value or a key); a task, group or split holding
            a surrogate, which export would send as U+FFFD, making names that differ only there one; an empty group or
            split, which the collector would read as no group, resp. as `train`.
        TypeError: A task, group or split that is not a string, a `group_size` that is not an integer, `metadata`
            that is not a mapping or has a key JSON cannot take (a NumPy `float32`, a `Decimal`: the error names where
            it is).
    """
    return Rollout(task, group=group, split=split, metadata=metadata, group_size=group_size)


def current_rollout() -> Rollout | None:
    """The rollout the caller runs inside, or None."""
    return _current.get()
