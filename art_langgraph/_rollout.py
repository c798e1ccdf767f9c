"""Rollouts: one trajectory = one root span (`art.span.kind = "rollout"`) and a context var.

The current rollout lives in a `contextvars.ContextVar`, so it follows asyncio tasks and the
context copies LangGraph makes for sync nodes in its thread pool; every model span opened
inside reads its id from there.
"""

from __future__ import annotations

import json
import math
import uuid
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from art_langgraph import semconv
from art_langgraph._collector_client import apost_reward, post_reward
from art_langgraph._tracing import get_tracer

__all__ = ["Rollout", "areward", "current_rollout", "reward", "rollout"]

_current: ContextVar[Rollout | None] = ContextVar("art_langgraph_rollout", default=None)


def _check_reward(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward {name!r} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward {name!r} must be finite, got {value}")
    if not name:
        raise ValueError("reward name must be a non-empty string")
    return value


class Rollout:
    """One trajectory. Use as `with rollout(...) as r:` or `async with rollout(...) as r:`.

    Attributes:
        id: Rollout id (uuid4 hex), carried by every span inside as `art.rollout.id`.
        task: Task name (default grouping key).
        group: GRPO group id, if given.
        split: `train` or `val` (any string).
        metadata: Free-form metadata, exported as JSON.
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
    ) -> None:
        if not task:
            raise ValueError("rollout(task) needs a non-empty task name")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.id = uuid.uuid4().hex
        self.task = task
        self.group = group
        self.split = split
        self.metadata = dict(metadata or {})
        self.group_size = group_size
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
            httpx.HTTPError: After the rollout ended, the collector could not be reached.
        """
        value = _check_reward(value, name)
        if self._span is not None and not self._ended:
            self._span.add_event(semconv.REWARD_EVENT, {semconv.REWARD_NAME: name, semconv.REWARD_VALUE: value})
        else:
            post_reward(self.id, name, value)

    async def areward(self, value: float, name: str = "reward") -> None:
        """Async `reward`: same checks; after the rollout ended, the POST does not block."""
        value = _check_reward(value, name)
        if self._span is not None and not self._ended:
            self.reward(value, name)
        else:
            await apost_reward(self.id, name, value)

    def __enter__(self) -> Rollout:
        if self._span is not None:
            raise RuntimeError("a rollout can be entered only once; create a new one")
        attrs = {semconv.SPAN_KIND: semconv.SPAN_KIND_ROLLOUT, **self.span_attributes()}
        if self.metadata:
            attrs[semconv.METADATA] = json.dumps(self.metadata, default=str)
        # A fresh root: each rollout is its own trace, whatever span the app has open.
        self._span = get_tracer().start_span(
            f"rollout {self.task}", context=otel_context.Context(), attributes=attrs
        )
        token = _current.set(self)
        otel_token = otel_context.attach(trace.set_span_in_context(self._span))
        self._tokens = (token, otel_token)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._span is not None and self._tokens is not None
        token, otel_token = self._tokens
        otel_context.detach(otel_token)  # type: ignore[arg-type]
        _current.reset(token)
        if exc is not None:
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self._ended = True
        self._span.end()

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
    """
    return Rollout(task, group=group, split=split, metadata=metadata, group_size=group_size)


def current_rollout() -> Rollout | None:
    """The rollout the caller runs inside, or None."""
    return _current.get()


def _target(rollout_id: str | None) -> Rollout | None:
    current = _current.get()
    if rollout_id is None:
        if current is None:
            raise RuntimeError("reward() outside a rollout needs rollout_id=")
        return current
    return current if current is not None and current.id == rollout_id else None


def reward(value: float, *, name: str = "reward", rollout_id: str | None = None) -> None:
    """Attach a reward to the current rollout, or to `rollout_id` after the fact.

    Args:
        value: A finite number.
        name: Reward name.
        rollout_id: Id of a finished rollout; the reward is POSTed to the collector.

    Raises:
        ValueError: `value` is NaN or infinite.
        RuntimeError: No `rollout_id` and no current rollout.
        httpx.HTTPError: The collector could not take the reward.
    """
    value = _check_reward(value, name)
    target = _target(rollout_id)
    if target is not None:
        target.reward(value, name)
    else:
        assert rollout_id is not None
        post_reward(rollout_id, name, value)


async def areward(value: float, *, name: str = "reward", rollout_id: str | None = None) -> None:
    """Async `reward`: attach a reward to the current rollout or to `rollout_id`."""
    value = _check_reward(value, name)
    target = _target(rollout_id)
    if target is not None:
        await target.areward(value, name)
    else:
        assert rollout_id is not None
        await apost_reward(rollout_id, name, value)
