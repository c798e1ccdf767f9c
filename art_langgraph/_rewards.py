"""`reward` and `areward`: a reward for the rollout the caller runs inside, or for a finished one named by its rollout
id or trace id (POSTed to the collector, which keeps it even when the spans come later)."""

from __future__ import annotations

import re
import uuid

from langchain_core.runnables import RunnableConfig

from art_langgraph._collector_client import apost_reward, post_reward
from art_langgraph._graph_tracing import rollout_of_current_run
from art_langgraph._recorded_values import _check_name, _check_reward
from art_langgraph._rollout import Rollout, _current
from collector.protocol import DOT_SEGMENT_PROBLEM, has_dot_segment

__all__ = ["areward", "reward"]

_UUID_TEXT_LENGTH = 36
"""Characters of a UUID's text with its dashes (`str(run_id)`); rollout ids are 32 hex digits, never this long."""


def _rollout_key(rollout_id: str | uuid.UUID | None) -> str | None:
    """Rollout ids are hex strings; a `uuid.UUID` (a LangChain `run_id`) becomes its hex, and so does its text with
    dashes (`str(run_id)`, as an app stores it), which named no trajectory: the reward was kept, never applied. Any
    other id is sent as given: the collector keys a UUID's text in any form by its 32 lower-case hex digits, and any
    other id exactly as the spans' `art.rollout.id` carries it."""
    if isinstance(rollout_id, uuid.UUID):
        return rollout_id.hex
    if isinstance(rollout_id, str) and len(rollout_id) == _UUID_TEXT_LENGTH:
        try:
            return uuid.UUID(rollout_id).hex
        except ValueError:  # not a UUID's text: an id of its own
            return rollout_id
    return rollout_id


_TRACE_ID = re.compile(r"[0-9a-f]{32}")
"""A trace id as `Rollout.trace_id` writes it: 32 lower-case hex digits."""


def _checked_ids(rollout_id: str | uuid.UUID | None, trace_id: str | None) -> tuple[str | None, str | None]:
    """`reward`'s `rollout_id` as a rollout key (`_rollout_key`) and its `trace_id` as `Rollout.trace_id` writes it
    (the collector reads either case), each refused when the collector would refuse it (the POST failed only after
    the run, with its 422) or no rollout can have it (a trace id of zeros, a rollout id with a `.` segment)."""
    key = _rollout_key(rollout_id)
    if key is not None:
        _check_name(key, "reward's rollout_id")
        if not key:
            raise ValueError("reward's rollout_id must be a non-empty string (Rollout.id) or a run_id UUID")
        if has_dot_segment(key):  # the collector refuses such an id in a span: the reward would wait for it forever
            raise ValueError(f"reward's rollout_id {key[:40]!r} {DOT_SEGMENT_PROBLEM}, so no rollout has it")
    if trace_id is None:
        return key, None
    if not isinstance(trace_id, str):
        raise TypeError(f"reward's trace_id must be a string, got {type(trace_id).__name__}")
    trace = trace_id.strip().lower()
    if not _TRACE_ID.fullmatch(trace) or not int(trace, 16):
        raise ValueError(
            f"reward's trace_id must be 32 hex digits, not all zeros (Rollout.trace_id); got {trace_id[:40]!r}"
        )
    return key, trace


def _running_rollout(config: RunnableConfig | None) -> Rollout | None:
    """The rollout the caller runs inside: `rollout(...)`'s, or else that of the LangChain run it runs in or `config`
    names (a node of a graph run outside `rollout(...)`, which is a rollout of its own)."""
    return _current.get() or rollout_of_current_run(config)


def _target(rollout_id: str | None, trace_id: str | None, config: RunnableConfig | None) -> Rollout | None:
    current = _running_rollout(config)
    if rollout_id is None and trace_id is None:
        if current is None:
            raise RuntimeError(
                "reward() outside a rollout needs rollout_id= or trace_id= (a graph run's rollout id is "
                "its LangChain run id: pass config={'run_id': uuid} and reward(..., rollout_id=uuid)); "
                "on a thread or task of a node's own, pass the node's config: reward(..., config=config)"
            )
        return current
    if current is None or current._span is None:
        return None
    if rollout_id is not None:
        return current if current.id == rollout_id else None
    return current if current.trace_id == trace_id else None


def reward(
    value: float,
    *,
    name: str = "reward",
    rollout_id: str | uuid.UUID | None = None,
    trace_id: str | None = None,
    config: RunnableConfig | None = None,
) -> None:
    """Attach a reward to the current rollout, or to a finished one by rollout id or trace id.

    A reward may arrive hours after the run (a user's click): it is POSTed to the collector,
    which keeps it even when the spans come later.

    Args:
        value: A finite number.
        name: Reward name.
        rollout_id: Id of a finished rollout (`Rollout.id`, or the `run_id` UUID of a top-level
            graph run outside `rollout()`, or its text `str(run_id)`); the reward is POSTed to the collector.
        trace_id: Trace id (32 hex digits) of a finished rollout, when its id is unknown.
        config: The `config` of the graph node the reward is for, as a LangChain call takes it, where the node
            hands the work that calls `reward` to a thread or task of its own (a `ThreadPoolExecutor`,
            `loop.run_in_executor`), which carries neither its run nor its context.

    Raises:
        ValueError: `value` is NaN or infinite, `name` or `rollout_id` is refused as `rollout(...)`'s names are (empty
            too), or `trace_id` is not 32 hex digits (or all zeros).
        TypeError: `value` is not a real number, or `name`, `rollout_id` or `trace_id` is not a string (nor a UUID).
        RuntimeError: No `rollout_id`/`trace_id` and no current rollout.
        httpx.HTTPError: The collector could not take the reward.
    """
    value = _check_reward(value, name)
    key, trace_id = _checked_ids(rollout_id, trace_id)
    target = _target(key, trace_id, config)
    if target is not None:
        target.reward(value, name)
    else:
        post_reward(key, name, value, trace_id)


async def areward(
    value: float,
    *,
    name: str = "reward",
    rollout_id: str | uuid.UUID | None = None,
    trace_id: str | None = None,
    config: RunnableConfig | None = None,
) -> None:
    """Async `reward`: attach a reward to the current rollout, or to a finished one by id."""
    value = _check_reward(value, name)
    key, trace_id = _checked_ids(rollout_id, trace_id)
    target = _target(key, trace_id, config)
    if target is not None:
        await target.areward(value, name)
    else:
        await apost_reward(key, name, value, trace_id)
