"""One `llm` span per chat-model call: request attributes up front, result attributes at the end.

Recording never raises into the app (a call that succeeds with `ChatOpenAI` succeeds here): an
error while recording is logged with its traceback and counted (`recording_errors()`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_openai.chat_models.base import _convert_message_to_dict
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from art_langgraph import semconv
from art_langgraph._counts import RECORDING_ERRORS
from art_langgraph._graph_tracing import placement_of
from art_langgraph._rollout import current_rollout
from art_langgraph._token_data import ART_METADATA_KEY, STREAM_PIECE_KEY, ArtTokenData, StreamTokens
from art_langgraph._tracing import get_tracer, span_name

__all__ = ["LLMSpan", "llm_span", "recording_errors", "recording_guard"]

_logger = logging.getLogger(__name__)


def recording_errors() -> int:
    """Number of errors caught while recording model calls (each logged with its traceback)."""
    return RECORDING_ERRORS.value


@contextmanager
def recording_guard(what: str) -> Iterator[None]:
    """Log and count an error raised while recording `what`, instead of raising it into the app."""
    try:
        yield
    except Exception:
        RECORDING_ERRORS.add()
        _logger.exception("art_langgraph: could not record %s; the model call itself is unaffected", what)


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _add(left: ChatGenerationChunk | None, right: ChatGenerationChunk) -> ChatGenerationChunk:
    """`left + right`, or `right` when there is no `left` yet (a new chunk: neither is modified)."""
    return right if left is None else left + right


class LLMSpan:
    """The `llm` span of one call; each choice beyond the first gets a sibling span started alike."""

    def __init__(
        self, span: Span, name: str, parent: otel_context.Context, start_time: int, request_attributes: dict[str, Any]
    ) -> None:
        self.span = span
        self._name = name
        self._parent = parent
        self._start_time = start_time
        self._request_attributes = request_attributes
        self._tokens = StreamTokens()
        self._choices: dict[int, ChatGenerationChunk] = {}
        self._shared: ChatGenerationChunk | None = None
        """Stream chunks of no choice (the usage chunk, a structured stream's final completion)."""
        self._siblings: list[Span] = []
        """The spans of the choices beyond the first, ended with the call's span (`llm_span`)."""
        self._finished: list[Span] = []
        """The spans of the choices recorded with a finish reason: the engine sampled them to their end."""

    def spans(self) -> list[Span]:
        """Every span of the call: the first choice's, then one per further choice recorded so far."""
        return [self.span, *self._siblings]

    def unfinished(self) -> list[Span]:
        """The call's spans whose choice was not recorded with a finish reason (a stream left before its end)."""
        return [span for span in self.spans() if span not in self._finished]

    def record_result(self, result: ChatResult) -> None:
        """Record a `ChatResult`: one span per choice, with the token data on its message."""
        with recording_guard("a model call's result"):
            choices = [(g, g.message.response_metadata.get(ART_METADATA_KEY)) for g in result.generations]
            self._record_choices(choices, result.llm_output or {})

    def add_chunk(self, chunk: ChatGenerationChunk) -> ChatGenerationChunk:
        """Take in one stream chunk (kept per choice) and return it, with the call's token data if it finishes choice 0
        (`StreamTokens.add`).

        The chunk's `StreamPiece` (set by `ARTChatModel`'s chunk converter) is removed from it.
        """
        piece = chunk.message.response_metadata.pop(STREAM_PIECE_KEY, None)
        with recording_guard("a stream chunk"):
            if piece is not None and (art := self._tokens.add(piece)) is not None:
                chunk.message.response_metadata[ART_METADATA_KEY] = art
            if piece is None or piece["index"] is None:
                self._shared = _add(self._shared, chunk)
            else:
                self._choices[piece["index"]] = _add(self._choices.get(piece["index"]), chunk)
        return chunk

    def record_stream(self) -> None:
        """Record the chunks taken in: one span per choice."""
        with recording_guard("a streamed result"):
            streamed = self._streamed()
            self._record_choices([(streamed[i], self._tokens.token_data(i)) for i in sorted(streamed)], {})

    def _streamed(self) -> dict[int, ChatGenerationChunk]:
        """Each choice's streamed message, with the chunks of no choice added to every one."""
        if not self._choices:
            return {0: self._shared} if self._shared is not None else {}
        if self._shared is None:
            return self._choices
        return {i: chunk + self._shared for i, chunk in self._choices.items()}

    def _record_choices(self, choices: Sequence[tuple[ChatGeneration, ArtTokenData | None]],
                        llm_output: dict[str, Any]) -> None:
        for i, (generation, art) in enumerate(choices):
            span = self.span if i == 0 else self._sibling()
            _set_result(span, generation, art, llm_output)
            if _finish_reason(generation):
                self._finished.append(span)

    def _sibling(self) -> Span:
        """A span for another choice of the same call: same parent, name, request and start time."""
        span = get_tracer().start_span(
            self._name,
            context=self._parent,
            attributes=self._request_attributes,
            start_time=self._start_time,
        )
        self._siblings.append(span)
        return span


def _info(generation: ChatGeneration) -> dict[str, Any]:
    """What LangChain and the engine said of one choice: its generation info and its message's response metadata."""
    return {**(generation.generation_info or {}), **generation.message.response_metadata}


def _finish_reason(generation: ChatGeneration) -> Any:
    """Why the engine stopped sampling the choice (`stop`, `length`, ...); None while it has not."""
    return _info(generation).get("finish_reason")


def _set_result(span: Span, generation: ChatGeneration, art: ArtTokenData | None, llm_output: dict[str, Any]) -> None:
    """Set one choice's response attributes; token attributes only when the engine sent ids."""
    message = generation.message
    info = _info(generation)
    attrs: dict[str, Any] = {}
    if model := llm_output.get("model_name") or info.get("model_name"):
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = model
    # a server may answer a number (which failed the whole record: its token data too); LangChain's run ids are skipped
    response_id = str(llm_output.get("id") or message.id or "")
    if response_id and not response_id.startswith("lc_"):
        attrs[semconv.GEN_AI_RESPONSE_ID] = response_id
    if finish := _finish_reason(generation):
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [finish]
    if isinstance(message, AIMessage):
        if usage := message.usage_metadata:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = usage["input_tokens"]
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = usage["output_tokens"]
        # Invalid tool calls were sampled too (arguments that do not parse): the next prompt carries them.
        out = _convert_message_to_dict(AIMessage(
            content=message.content, tool_calls=message.tool_calls, invalid_tool_calls=message.invalid_tool_calls
        ))
        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = _json([out])
    if art is not None:
        attrs[semconv.PROMPT_TOKEN_IDS] = list(art["prompt_token_ids"])
        attrs[semconv.COMPLETION_TOKEN_IDS] = list(art["completion_token_ids"])
        attrs[semconv.COMPLETION_LOGPROBS] = [float(x) for x in art["logprobs"]]
        attrs[semconv.POLICY_STEP] = int(art["policy_step"])
    span.set_attributes(attrs)


@contextmanager
def llm_span(payload: dict[str, Any], parent_run_id: UUID | None = None) -> Iterator[LLMSpan]:
    """Open the `llm` span for a request payload; an exception marks it ERROR and propagates.

    The span hangs under the run that called the model (its node span, or the rollout span)
    when the graph tracer knows that run; otherwise under the current OpenTelemetry context,
    with the rollout of the current `rollout(...)`, if any. A failed call's spans (every choice's, a
    stream's partial choices included) also get `error.type` (`semconv.ERROR_TYPE`), the exception's
    class name: it sampled nothing to train on. So does each choice of a stream its caller stopped reading
    before the choice's finish reason came (a `break`, a closed generator, a task cancelled between chunks, whose
    generator is then closed): `GeneratorExit`, as its recorded tokens are a prefix, not a turn; a task cancelled
    while the stream awaits the engine marks so, with `CancelledError`, only the choices not finished either.

    Args:
        payload: The OpenAI request payload the chat model is about to send.
        parent_run_id: LangChain run id of the caller (`run_manager.parent_run_id`).
    """
    model = payload.get("model") or ""
    attrs: dict[str, Any] = {
        semconv.SPAN_KIND: semconv.SPAN_KIND_LLM,
        semconv.GEN_AI_OPERATION_NAME: "chat",
        semconv.GEN_AI_SYSTEM: "art",
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.GEN_AI_INPUT_MESSAGES: _json(payload.get("messages") or payload.get("input") or []),
    }
    if tools := payload.get("tools"):
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = _json(tools)
    parent = otel_context.get_current()
    if (placement := placement_of(parent_run_id)) is not None:
        attrs.update(placement.rollout.span_attributes())
        parent = trace.set_span_in_context(placement.parent)
    elif (current := current_rollout()) is not None:
        attrs.update(current.span_attributes())
    name, start_time = span_name("chat", model), time.time_ns()
    span = get_tracer().start_span(name, context=parent, attributes=attrs, start_time=start_time)
    call = LLMSpan(span, name, parent, start_time, attrs)
    try:
        yield call
    except (GeneratorExit, asyncio.CancelledError) as exc:  # the caller left: a choice it left unfinished is a prefix
        _mark_failed(
            call.unfinished(), exc, f"{type(exc).__name__}: the caller left the call before this choice finished"
        )
        raise
    except BaseException as exc:  # a failed stream recorded each choice's part: none is a turn
        _mark_failed(call.spans(), exc, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        for choice_span in call.spans():
            choice_span.end()


def _mark_failed(spans: Iterable[Span], exc: BaseException, description: str) -> None:
    """Mark each span a call that sampled no turn: the exception, `error.type` (its class name) and ERROR status."""
    for span in spans:
        span.record_exception(exc)
        span.set_attribute(semconv.ERROR_TYPE, type(exc).__name__)
        span.set_status(Status(StatusCode.ERROR, description))
