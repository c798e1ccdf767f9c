"""One `llm` span per chat-model call: request attributes up front, result attributes at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_openai.chat_models.base import _convert_message_to_dict
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from art_langgraph import semconv
from art_langgraph._graph_tracing import placement_of
from art_langgraph._rollout import current_rollout
from art_langgraph._token_data import ART_METADATA_KEY
from art_langgraph._tracing import get_tracer

__all__ = ["LLMSpan", "llm_span"]


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


class LLMSpan:
    """Records a call's result on its span (and on sibling spans for choices beyond the first)."""

    def __init__(self, span: Span, request_attributes: dict[str, Any]) -> None:
        self.span = span
        self._request_attributes = request_attributes

    def record_result(self, result: ChatResult) -> None:
        """Set response attributes from a `ChatResult`; choice i>0 gets a sibling span."""
        llm_output = result.llm_output or {}
        for i, generation in enumerate(result.generations):
            if i == 0:
                self._record_generation(self.span, generation, llm_output)
                continue
            extra = get_tracer().start_span(self.span.name, attributes=self._request_attributes)  # type: ignore[attr-defined]
            self._record_generation(extra, generation, llm_output)
            extra.end()

    def record_generation(self, generation: ChatGeneration) -> None:
        """Set response attributes from one (possibly aggregated streamed) generation."""
        self._record_generation(self.span, generation, {})

    @staticmethod
    def _record_generation(span: Span, generation: ChatGeneration, llm_output: dict[str, Any]) -> None:
        message = generation.message
        info = {**(generation.generation_info or {}), **message.response_metadata}
        attrs: dict[str, Any] = {}
        if model := llm_output.get("model_name") or info.get("model_name"):
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = model
        response_id = llm_output.get("id") or message.id
        if response_id and not response_id.startswith("lc_"):  # skip LangChain's run ids
            attrs[semconv.GEN_AI_RESPONSE_ID] = response_id
        if finish := info.get("finish_reason"):
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [finish]
        if isinstance(message, AIMessage):
            if usage := message.usage_metadata:
                attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = usage["input_tokens"]
                attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = usage["output_tokens"]
            out = _convert_message_to_dict(AIMessage(content=message.content, tool_calls=message.tool_calls))
            attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = _json([out])
        if art := info.get(ART_METADATA_KEY):
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
    with the rollout of the current `rollout(...)`, if any.

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
    context = None
    if (placement := placement_of(parent_run_id)) is not None:
        attrs.update(placement.rollout.span_attributes())
        context = trace.set_span_in_context(placement.parent)
    elif (current := current_rollout()) is not None:
        attrs.update(current.span_attributes())
    span = get_tracer().start_span(f"chat {model}", context=context, attributes=attrs)
    try:
        yield LLMSpan(span, attrs)
    except GeneratorExit:  # a consumer stopped reading a stream: not an error
        raise
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()
