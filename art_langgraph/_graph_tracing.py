"""Graph node and tool spans, and one trajectory per top-level graph run, from LangChain callbacks.

A `GraphTracer` is added to every LangChain callback manager in the process (a configure hook,
like LangSmith's tracer), so no app code changes. It keeps a small table `run_id -> placement`
that says, for every running LangChain run, which span its children hang under and which
rollout they belong to. The table follows LangChain's own run tree (`parent_run_id`), not
context variables, so placement stays right across asyncio tasks, LangGraph's thread pool for
sync nodes, `Send` fan-out and subgraphs.

* A top-level run (no parent) inside `rollout(...)` hangs under that rollout's span; so does a run
  started inside a `rollout(...)` that a running graph's node opened (a nested rollout).
* A top-level run outside any rollout opens an implicit rollout: a `rollout` span whose id is
  the run's `run_id` in hex, task/group/split from `config["metadata"]` (`art.task`, ...) or
  the run's name. It ends when the run ends.
* A LangGraph node run (`name == metadata["langgraph_node"]`, tagged `graph:step:N`, not
  LangGraph's internal `__start__`) gets a `node` span; a tool run gets a `tool` span (a tool called
  on its own, not by a run, only inside `rollout(...)`). Other runs (sequences, lambdas, channel
  writes) get no span; their children hang under their nearest spanned ancestor.
"""

from __future__ import annotations

import hashlib
import json
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager
from langchain_core.messages import BaseMessage, ToolMessage
from langchain_core.runnables.config import RunnableConfig, ensure_config
from langchain_core.tracers.context import register_configure_hook
from langgraph.errors import GraphBubbleUp, ParentCommand
from opentelemetry import trace
from opentelemetry.trace import Span

from art_langgraph import semconv
from art_langgraph._checks import check_count
from art_langgraph._export_queue import _utf8_text
from art_langgraph._rollout import Rollout, current_rollout
from art_langgraph._settings import get_settings
from art_langgraph._span_status import mark_ended_by
from art_langgraph._tracing import get_tracer, span_name
from collector.protocol import has_dot_segment

__all__ = ["GraphTracer", "Placement", "current_run_id", "model_caller", "placement_of", "rollout_of_current_run"]

_logger = logging.getLogger(__name__)

_STEP_TAG = "graph:step:"
_MAX_RUNS = 100_000
"""Most runs tracked at once; beyond, new top-level runs are not traced (logged), memory stays bounded."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a run's children go: the span they hang under and the rollout they belong to."""

    parent: Span
    rollout: Rollout
    own_span: Span | None = None
    """The run's own span (node, tool, or implicit rollout), ended with the run."""
    implicit: bool = False
    """The run opened the rollout (a top-level run outside `rollout(...)`)."""


_runs: dict[UUID, Placement] = {}


def _active_placement() -> Placement | None:
    """The placement under the caller's `rollout(...)`, while it has been entered and has not ended."""
    current = current_rollout()
    if current is None or current._span is None or current._ended:
        return None
    return Placement(current._span, current)


def placement_of(run_id: UUID | None) -> Placement | None:
    """Where the children of a running LangChain run go, or None when the run is not tracked.

    A `rollout(...)` opened inside the run (in a graph node) takes the children started in it: it is
    current there, and the rollout the run belongs to is not.
    """
    placement = _runs.get(run_id) if run_id is not None else None
    if placement is None:
        return None
    nested = _active_placement()
    return placement if nested is None or nested.rollout is placement.rollout else nested


def current_run_id(config: RunnableConfig | None = None) -> UUID | None:
    """The LangChain run the caller's code runs in (a graph node, a sequence), from the config LangChain keeps
    current for it, or from `config` (a node's, handed with its work to a thread or task of its own), read as
    LangChain reads a call's config; None outside any run."""
    callbacks = ensure_config(config).get("callbacks")
    return callbacks.parent_run_id if isinstance(callbacks, BaseCallbackManager) else None


_model_caller: ContextVar[UUID | None] = ContextVar("art_langgraph_model_caller", default=None)
"""The run that called the `ARTChatModel` run LangChain started last in this context
(`GraphTracer.on_chat_model_start`); None before the first, or when that call had no caller."""


def model_caller() -> UUID | None:
    """The run that called the `ARTChatModel` run LangChain has just started in the caller's context, for a model's
    `_stream`, which LangChain calls without its run manager; else `current_run_id()`.

    LangChain starts the model's run, in the caller's context, right before it calls `_stream`, under the run the
    call's `config` names: not the run whose config is current where a node hands the call, with its `config`, to a
    thread or task of its own.
    """
    return _model_caller.get() or current_run_id()


def rollout_of_current_run(config: RunnableConfig | None = None) -> Rollout | None:
    """The rollout of the LangChain run the caller runs in (or `config` names: `current_run_id`), e.g. the implicit
    one of a graph run outside `rollout()`."""
    placement = placement_of(current_run_id(config))
    return placement.rollout if placement is not None else None


def _json(value: Any) -> str:
    """`value` as attribute text: a string as it is, else JSON (`str` of what JSON has no type for), or `repr` where
    JSON cannot hold it (a circular reference, a key that is not a string or number)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _config_group_size(size: Any) -> int | None:
    """The config's `art.group.size`: an integer from 1 to 2**31 - 1, or its decimal string; None when absent."""
    if isinstance(size, str) and size.strip().isdecimal():
        size = int(size)
    return check_count(size, f"config metadata {semconv.GROUP_SIZE!r}")


_DEFAULT_TASK = "graph"
"""The task of a top-level run outside `rollout(...)` with neither an `art.task` nor a name usable as one."""


def _task_of_name(name: str | None) -> str:
    """A run's name as its implicit rollout's task, made one `rollout(...)` takes: cut to `semconv.MAX_NAME_LENGTH`
    characters, each NUL or surrogate as U+FFFD, and `_DEFAULT_TASK` for a name that is empty or has a `.` or `..`
    segment. Names are LangChain's too (`RunnableParallel<key,...>`, past 256 characters with a few long keys), and a
    name refused lost the whole run's trajectory."""
    task = _utf8_text(str(name or "")).replace("\x00", "\ufffd")[: semconv.MAX_NAME_LENGTH]
    return task if task and not has_dot_segment(task) else _DEFAULT_TASK


def _trace_of_run(run_id: UUID) -> int:
    """The trace id of a graph run's implicit rollout: derived from its `run_id`, so that every part of a run resumed
    with that `run_id` is one trace, yet not the `run_id` itself, which is the rollout's id. The collector keys the
    calls of another instrumentation by their trace id (LangSmith's OpenTelemetry export makes the root run's id its
    trace id): a trace id equal to the rollout id gave them the rollout's key, and a resumed run lost its first part."""
    return int.from_bytes(hashlib.blake2b(run_id.bytes, digest_size=16, person=b"art-graph-trace").digest())


def _implicit_rollout(run_id: UUID, name: str | None, metadata: dict[str, Any]) -> Rollout:
    extra = metadata.get(semconv.METADATA)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"config metadata {semconv.METADATA!r} must be a dict, got {type(extra).__name__}")
    return Rollout(
        str(metadata.get(semconv.TASK) or _task_of_name(name)),
        group=str(metadata[semconv.GROUP]) if metadata.get(semconv.GROUP) else None,
        split=str(metadata.get(semconv.SPLIT) or "train"),
        metadata=extra,
        group_size=_config_group_size(metadata.get(semconv.GROUP_SIZE)),
        _id=run_id.hex,
        _source="graph",
        _trace_id=_trace_of_run(run_id),  # a run resumed with its `run_id` goes on in the same trace
    )


def _is_node(name: str | None, node: Any, tags: list[str] | None) -> bool:
    """A LangGraph node's own run; LangGraph's internal nodes (`__start__`) are left out."""
    return (
        isinstance(node, str)
        and name == node
        and not node.startswith("__")
        and any(t.startswith(_STEP_TAG) for t in tags or ())
    )


class GraphTracer(BaseCallbackHandler):
    """LangChain callback handler that records node and tool spans and places every run.

    It never raises into the app: LangChain logs handler errors (`raise_error = False`).
    `run_inline` keeps it on the caller's thread, so the table is updated before children start.
    """

    run_inline = True
    raise_error = False

    # --- chains: top-level runs and graph nodes -------------------------------------------

    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Place the run; open an implicit rollout (top level) or a node span (graph node)."""
        metadata = metadata or {}
        name = kwargs.get("name")
        if parent_run_id is None:
            self._start_top_level(run_id, name, metadata)
            return
        parent = placement_of(parent_run_id)
        if parent is None:
            return
        node = metadata.get("langgraph_node")
        if _is_node(name, node, tags):
            attrs = {
                semconv.SPAN_KIND: semconv.SPAN_KIND_NODE,
                semconv.NODE_NAME: str(node),
                **parent.rollout.span_attributes(),
            }
            if (step := metadata.get("langgraph_step")) is not None:
                attrs[semconv.NODE_STEP] = int(step)
            span = get_tracer().start_span(
                span_name("node", str(node)), context=trace.set_span_in_context(parent.parent), attributes=attrs
            )
            _runs[run_id] = Placement(span, parent.rollout, own_span=span)
        else:
            _runs[run_id] = Placement(parent.parent, parent.rollout)

    def _start_top_level(self, run_id: UUID, name: str | None, metadata: dict[str, Any]) -> None:
        if not get_settings().trace_graphs:
            return
        if len(_runs) >= _MAX_RUNS:
            _logger.warning("art_langgraph: %d runs in flight; run %s is not traced", len(_runs), run_id)
            return
        if (explicit := _active_placement()) is not None:
            _runs[run_id] = explicit
            return
        rollout = _implicit_rollout(run_id, name, metadata)
        span = rollout._begin()
        _runs[run_id] = Placement(span, rollout, own_span=span, implicit=True)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """End the run's span (node or implicit rollout) and forget it."""
        self._end(run_id, None)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """End the run's span with ERROR status (an interrupt is an event, not an error)."""
        self._end(run_id, error)

    # --- chat models ------------------------------------------------------------------------

    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Note the run that called an `ARTChatModel` (`model_caller`); its calls are recorded by the model itself."""
        if (metadata or {}).get(semconv.TRACED_RUN):
            _model_caller.set(parent_run_id)

    # --- tools ------------------------------------------------------------------------------

    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Open a `tool` span under the run that called the tool, or under the rollout of a tool called on its own."""
        if parent_run_id is None:
            parent = _active_placement() if get_settings().trace_graphs else None
        else:
            parent = placement_of(parent_run_id)
        if parent is None:
            return
        name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        attrs: dict[str, Any] = {
            semconv.SPAN_KIND: semconv.SPAN_KIND_TOOL,
            semconv.GEN_AI_OPERATION_NAME: "execute_tool",
            semconv.GEN_AI_TOOL_NAME: str(name),
            semconv.GEN_AI_TOOL_CALL_ARGUMENTS: _json(inputs if inputs is not None else input_str),
            **parent.rollout.span_attributes(),
        }
        if call_id := kwargs.get("tool_call_id"):
            attrs[semconv.GEN_AI_TOOL_CALL_ID] = str(call_id)
        span = get_tracer().start_span(
            span_name("execute_tool", str(name)), context=trace.set_span_in_context(parent.parent), attributes=attrs
        )
        _runs[run_id] = Placement(span, parent.rollout, own_span=span)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """Record the tool's result and end its span."""
        placement = _runs.get(run_id)
        try:
            if placement is not None and placement.own_span is not None:
                result = output.content if isinstance(output, ToolMessage) else output
                placement.own_span.set_attribute(semconv.GEN_AI_TOOL_CALL_RESULT, _json(result))
        finally:  # a result that cannot be recorded still ends the span (LangChain logs the error)
            self._end(run_id, None)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """End the tool span with ERROR status."""
        self._end(run_id, error)

    # --- shared -------------------------------------------------------------------------------

    @staticmethod
    def _end(run_id: UUID, error: BaseException | None) -> None:
        placement = _runs.pop(run_id, None)
        if placement is None or placement.own_span is None:
            return
        if placement.implicit:
            placement.rollout._finish(None if isinstance(error, GraphBubbleUp) else error)
            return
        span = placement.own_span
        if isinstance(error, GraphBubbleUp):  # neither kind is an error
            if not isinstance(error, ParentCommand):  # a pause; `Command(graph=Command.PARENT)` only routes the parent
                span.add_event(semconv.INTERRUPT_EVENT, {"exception.type": type(error).__name__})
        else:
            mark_ended_by(span, error)
        span.end()


_TRACER = GraphTracer()
_hook: ContextVar[GraphTracer | None] = ContextVar("art_langgraph_graph_tracer", default=_TRACER)
# The default value makes the hook active in every context and thread of the process.
register_configure_hook(_hook, inheritable=True)
