"""Rollouts: one trajectory = one root span (`art.span.kind = "rollout"`) and a context var.

The current rollout lives in a `contextvars.ContextVar`, so it follows asyncio tasks and the
context copies LangGraph makes for sync nodes in its thread pool; every model span opened
inside reads its id from there.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import re
import uuid
from collections.abc import Mapping
from contextvars import ContextVar, Token
from decimal import Decimal
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

from art_langgraph import semconv
from art_langgraph._checks import check_count
from art_langgraph._collector_client import apost_reward, post_reward
from art_langgraph._span_status import mark_ended_by
from art_langgraph._tracing import start_root_span
from collector.protocol import DOT_SEGMENT_PROBLEM, has_dot_segment

__all__ = ["Rollout", "areward", "current_rollout", "reward", "rollout"]

_logger = logging.getLogger(__name__)

_current: ContextVar[Rollout | None] = ContextVar("art_langgraph_rollout", default=None)
_warned_stepped_apart = False
"""Whether `Rollout._leave` has logged, once per process, a block stepped through several contexts."""


def _check_name(value: str, what: str, limit: int = semconv.MAX_NAME_LENGTH) -> None:
    """Refuse a name the collector would reject with its whole span: not a string, longer than `limit`, with a NUL;
    or one it could not keep apart from others: with a surrogate (bytes decoded with `surrogateescape`), which UTF-8
    cannot encode, so export sends it as U+FFFD (and `POST /v1/rewards` could not send it at all)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > limit or "\x00" in value:
        raise ValueError(
            f"{what} must be at most {limit} characters, without NUL; got {value[:40]!r} ({len(value)} characters)"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} must be text UTF-8 can encode: {value[:40]!r} holds the surrogate "
            f"{value[exc.start]!r} (sent as U+FFFD, names that differ only there would be one)"
        ) from None


def _check_reward(value: float, name: str) -> float:
    """`value` as a float: any real number (NumPy's too), not a bool, finite; `name` non-empty and storable."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward {name!r} must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int (or Fraction) beyond float's range
        raise ValueError(f"reward {name!r} must be finite, got a number beyond float's range") from None
    if not math.isfinite(value):
        raise ValueError(f"reward {name!r} must be finite, got {value}")
    _check_name(name, "reward name")
    if not name:
        raise ValueError("reward name must be a non-empty string")
    return value


def _metadata_json(metadata: Mapping[str, Any] | None) -> str | None:
    """`metadata` as the JSON the rollout span carries (a value JSON has no type for becomes its `str`); None if empty.

    Text is kept as it is, not escaped: a lone surrogate (bytes decoded with `surrogateescape`) stays one, so export
    sends it as U+FFFD as in every other attribute. Escaped (`"\\udcff"`), it passed export and reached the collector
    as a lone surrogate again once parsed, where no answer holding the trajectory could be encoded.

    Raises:
        TypeError: `metadata` is not a mapping, or has a key JSON cannot take (a NumPy number other than a `float64`, a
            `Decimal`, a tuple: no `str`, `int`, `float`, bool or None), named with where it is.
        ValueError: JSON cannot take it (a circular reference, a NaN or infinity as a value or a key, a float's,
            NumPy's or a `Decimal`'s: `NaN` is no JSON, which the collector read as null), named with where it is.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"rollout metadata must be a dict, got {type(metadata).__name__}")
    metadata = dict(metadata)  # json writes a mapping that is no dict as its `str`, which the collector ignored
    try:
        return json.dumps(metadata, default=_json_default, ensure_ascii=False, allow_nan=False) if metadata else None
    except (TypeError, ValueError) as exc:
        if (problem := _unencodable(metadata, "rollout metadata")) is not None:
            raise problem from None
        raise type(exc)(f"rollout metadata cannot be exported as JSON: {exc}") from exc


def _json_default(value: Any) -> Any:
    """A value JSON has no type for: a mapping that is no dict as an object (its `str` said nothing of its items, or
    was `<M object at 0x...>`), anything else as its `str`; refused if it is a NaN or infinity (a NumPy scalar, a
    `Decimal`), whose `str` (`'nan'`) would pass for text where a float's NaN is refused."""
    if isinstance(value, Mapping):
        return dict(value)
    if not _finite(value):
        raise ValueError(f"JSON has no NaN or infinity, got {value}")
    return str(value)


def _finite(value: Any) -> bool:
    """False for a NaN or an infinity: a float, a NumPy floating scalar (any real number that is not rational) or a
    `Decimal` (a signalling NaN too); True for any other value. Compared, not converted to float: a NumPy `longdouble`
    beyond float's range is finite."""
    if isinstance(value, Decimal):
        return value.is_finite()
    return not isinstance(value, numbers.Real) or isinstance(value, numbers.Rational) or -math.inf < value < math.inf


def _unencodable(value: Any, where: str, inside: frozenset[int] = frozenset()) -> TypeError | ValueError | None:
    """The error for the first thing in `value` that JSON cannot take, in the order encoding meets them (a key before
    its value), naming where it is and what to give instead: a key of a type JSON has no key for (`TypeError`,
    `['a'] has the key Decimal('1.5') (Decimal), ...`), a NaN or infinity (`ValueError`, `['a'][0] is nan: ...`,
    `['a'] has the key nan: ...`); None without one. A container met again inside itself (a circular reference) is not
    entered twice."""
    if not _finite(value):
        return ValueError(
            f"{where} is {value}: JSON has no NaN or infinity (the collector would read it as null); give "
            "a finite number, None or a string"
        )
    if id(value) in inside:
        return None
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        if isinstance(value, Mapping) and not (key is None or isinstance(key, str | int | float)):  # json's key types
            return TypeError(
                f"{where} has the key {key!r:.60} ({type(key).__name__}), which JSON cannot take as a key: "
                "give a str (str(key)), an int, a float, a bool or None"
            )
        if isinstance(value, Mapping) and not _finite(key):
            return ValueError(
                f"{where} has the key {key}: JSON has no NaN or infinity; give a string or a finite number as key"
            )
        if (found := _unencodable(item, f"{where}[{key!r}]", inside | {id(value)})) is not None:
            return found
    return None


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


_UUID_TEXT_LENGTH = 36
"""Characters of a UUID's text with its dashes (`str(run_id)`); rollout ids are 32 hex digits, never this long."""


def _rollout_key(rollout_id: str | uuid.UUID | None) -> str | None:
    """Rollout ids are hex strings; a `uuid.UUID` (a LangChain `run_id`) becomes its hex, and so does its text with
    dashes (`str(run_id)`, as an app stores it), which named no trajectory: the reward was kept, never applied. Any
    other id is sent as given: the collector keys a trajectory by the exact `art.rollout.id` its spans carry, which
    another tracer may write in upper case."""
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


def _running_rollout() -> Rollout | None:
    """The rollout the caller runs inside: `rollout(...)`'s, or else that of the LangChain run it runs in (a node of
    a graph run outside `rollout(...)`, which is a rollout of its own)."""
    from art_langgraph._graph_tracing import rollout_of_current_run  # it imports this module

    return _current.get() or rollout_of_current_run()


def _target(rollout_id: str | None, trace_id: str | None) -> Rollout | None:
    current = _running_rollout()
    if rollout_id is None and trace_id is None:
        if current is None:
            raise RuntimeError(
                "reward() outside a rollout needs rollout_id= or trace_id= (a graph run's rollout id is "
                "its LangChain run id: pass config={'run_id': uuid} and reward(..., rollout_id=uuid))"
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

    Raises:
        ValueError: `value` is NaN or infinite, `name` or `rollout_id` is refused as `rollout(...)`'s names are (empty
            too), or `trace_id` is not 32 hex digits (or all zeros).
        TypeError: `value` is not a real number, or `name`, `rollout_id` or `trace_id` is not a string (nor a UUID).
        RuntimeError: No `rollout_id`/`trace_id` and no current rollout.
        httpx.HTTPError: The collector could not take the reward.
    """
    value = _check_reward(value, name)
    key, trace_id = _checked_ids(rollout_id, trace_id)
    target = _target(key, trace_id)
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
) -> None:
    """Async `reward`: attach a reward to the current rollout, or to a finished one by id."""
    value = _check_reward(value, name)
    key, trace_id = _checked_ids(rollout_id, trace_id)
    target = _target(key, trace_id)
    if target is not None:
        await target.areward(value, name)
    else:
        await apost_reward(key, name, value, trace_id)
