"""`ARTChatModel`: LangChain's `ChatOpenAI`, pointed at the trainer, recording exact tokens.

Every call asks the engine for logprobs and token ids, keeps them on the returned message as
`response_metadata["art"]` (see `ArtTokenData`; absent when the engine sent no ids) and records
one `llm` span per choice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal
from uuid import UUID

from langchain_core.caches import BaseCache
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.messages.tool import InvalidToolCall, invalid_tool_call
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_openai import ChatOpenAI
from pydantic import Field, model_validator

from art_langgraph import semconv
from art_langgraph._graph_tracing import model_caller
from art_langgraph._llm_span import llm_span, recording_guard
from art_langgraph._settings import get_settings
from art_langgraph._token_data import (
    ART_METADATA_KEY,
    STREAM_PIECE_KEY,
    StreamPiece,
    choice_token_data,
    chunk_index,
    stream_piece,
    unreadable_piece,
)
from art_langgraph.errors import UnsupportedOption

__all__ = ["ARTChatModel"]

_ALIASES = {
    "model": ("model", "model_name"),
    "base_url": ("base_url", "openai_api_base"),
    "api_key": ("api_key", "openai_api_key"),
}


def _check_options(values: dict[str, Any]) -> None:
    """Refuse `ChatOpenAI` arguments this model cannot honour.

    Raises:
        UnsupportedOption: `use_responses_api=True`, `logprobs=False`, or a `cache`, also inside `model_kwargs` (which
            `ChatOpenAI` moves to its fields, with a warning).
    """
    extra = values.get("model_kwargs")
    if isinstance(extra, dict) and extra:
        _check_options({key: extra[key] for key in ("cache", "use_responses_api", "logprobs") if key in extra})
    if values.get("cache") not in (None, False):
        raise UnsupportedOption(
            "cache",
            "a cached reply samples nothing: its call would record no turn, and every rollout of a group would get "
            "the same reply; drop cache (ARTChatModel never reads LangChain's global cache either)",
        )
    if values.get("use_responses_api"):
        raise UnsupportedOption(
            "use_responses_api=True",
            "ARTChatModel needs the Chat Completions API, where vLLM returns exact token ids; drop use_responses_api",
        )
    if values.get("logprobs") is False:
        raise UnsupportedOption("logprobs=False", "training needs the sampled logprobs of every call; drop it")


def _parent(run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None) -> UUID | None:
    """The LangChain run that called the model (where its span hangs), if known.

    LangChain gives `_generate` its run manager but calls `_stream` without one; the caller is
    then the one the graph tracer saw the model's run start under (`model_caller`).
    """
    if run_manager is not None:
        return run_manager.parent_run_id
    return model_caller()


class ARTChatModel(ChatOpenAI):
    """A `ChatOpenAI` for the ART trainer service that records exact tokens and traces calls.

    Defaults come from `configure(...)` / `ART_TRAINER_URL`, `ART_MODEL`, `ART_API_KEY`
    (api key `"EMPTY"` when none). The returned `AIMessage.response_metadata["art"]` holds
    `prompt_token_ids`, `completion_token_ids`, `logprobs` and `policy_step` (no `"art"` when the
    engine ignores `return_token_ids`). A stream carries it, whole, on the chunk that finishes choice 0
    (`StreamTokens.add`), so a message assembled from the chunks holds what `invoke`'s does.
    """

    logprobs: bool | None = True
    stream_usage: bool | None = True
    use_responses_api: bool | None = False
    cache: BaseCache | bool | None = Field(default=False, exclude=True)
    """False: every call asks the engine, even with LangChain's global cache set (`set_llm_cache`) for other models."""

    def __init__(self, **kwargs: Any) -> None:
        """A `ChatOpenAI` built from `kwargs`, its arguments, for the trainer (defaults: `configure`, `ART_*`).

        Raises:
            UnsupportedOption: An argument this model cannot honour (`_check_options`). Refused here, before pydantic
                validates: a `ValueError` raised by a validator reaches the caller inside pydantic's
                `ValidationError`, which `except UnsupportedOption` misses (`model_validate` still refuses it so).
        """
        _check_options(kwargs)
        super().__init__(**kwargs)

    @model_validator(mode="before")
    @classmethod
    def _trainer_defaults(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        settings = get_settings()
        defaults = {
            "model": settings.model,
            "base_url": settings.trainer_url,
            "api_key": settings.api_key or "EMPTY",
        }
        values = dict(values)
        _check_options(values)
        values["cache"] = False  # an explicit None would read the global cache
        for key, names in _ALIASES.items():
            if not any(values.get(n) is not None for n in names):
                values[key] = defaults[key]
        return values

    @property
    def _llm_type(self) -> str:
        return "art-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangChain's run metadata for this call, marked `art.traced` (see `semconv.TRACED_RUN`)."""
        params = super()._get_ls_params(stop=stop, **kwargs)
        params[semconv.TRACED_RUN] = True  # type: ignore[literal-required]
        return params

    def with_structured_output(
        self,
        schema: Any = None,
        *,
        method: Literal["function_calling", "json_mode", "json_schema"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        tools: list | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """`ChatOpenAI.with_structured_output`; `function_calling` sends `strict: true` unless told otherwise.

        vLLM (0.32) constrains a forced tool call's arguments to the tool's schema only when the
        tool is `strict`; without it, only the call's envelope is guided and a small model writes
        arguments that do not parse. `strict=False` keeps the unconstrained behaviour.
        """
        if method == "function_calling" and strict is None:
            strict = True
        return super().with_structured_output(
            schema, method=method, include_raw=include_raw, strict=strict, tools=tools, **kwargs
        )

    def _get_request_payload(
        self,
        input_: LanguageModelInput,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> dict:
        payload = super()._get_request_payload(input_, stop=stop, **kwargs)
        payload["logprobs"] = True
        payload["extra_body"] = {**(payload.get("extra_body") or {}), "return_token_ids": True}
        return payload

    def _create_chat_result(self, response: Any, generation_info: dict | None = None) -> ChatResult:
        response_dict = response if isinstance(response, dict) else response.model_dump(warnings=False)
        cleaned, not_objects = _set_aside_non_object_arguments(response_dict)
        # The original object when nothing was set aside: structured output reads its `parsed`.
        result = super()._create_chat_result(cleaned if not_objects else response, generation_info)
        choices = response_dict.get("choices") or []
        for index, (generation, choice) in enumerate(zip(result.generations, choices, strict=False)):
            # ChatOpenAI shares one generation_info dict across choices; give each its own.
            generation.generation_info = dict(generation.generation_info or {})
            with recording_guard("a response's token data"):
                if (art := choice_token_data(response_dict, choice)) is not None:
                    generation.message.response_metadata[ART_METADATA_KEY] = art
            if isinstance(generation.message, AIMessage):
                generation.message.invalid_tool_calls.extend(not_objects.get(index, []))
        return result

    def _convert_chunk_to_generation_chunk(
        self,
        chunk: dict,
        default_chunk_class: type,
        base_generation_info: dict | None,
    ) -> ChatGenerationChunk | None:
        """LangChain's chunk, carrying the event's `StreamPiece` to the stream wrapper (`LLMSpan.add_chunk`)."""
        generation_chunk = super()._convert_chunk_to_generation_chunk(chunk, default_chunk_class, base_generation_info)
        # What is left when reading fails: the call's token data is incomplete, the chunk keeps its choice.
        piece: StreamPiece | None = unreadable_piece(None)
        with recording_guard("a stream chunk's token data"):
            piece = unreadable_piece(chunk_index(chunk))
            piece = stream_piece(chunk)
        if piece is None:
            return generation_chunk
        if generation_chunk is None:
            if piece["readable"] and piece["prompt_token_ids"] is None and piece["completion_token_ids"] is None:
                return None
            generation_chunk = ChatGenerationChunk(message=default_chunk_class(content=""))
        generation_chunk.message.response_metadata[STREAM_PIECE_KEY] = piece
        return generation_chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with llm_span(self._get_request_payload(messages, stop=stop, **kwargs), _parent(run_manager)) as span:
            result = super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)
            span.record_result(result)
            return result

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with llm_span(self._get_request_payload(messages, stop=stop, **kwargs), _parent(run_manager)) as span:
            result = await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kwargs)
            span.record_result(result)
            return result

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        with llm_span(self._get_request_payload(messages, stop=stop, **kwargs), _parent(run_manager)) as span:
            try:
                for chunk in super()._stream(messages, stop=stop, run_manager=run_manager, **kwargs):
                    yield span.add_chunk(chunk)
            finally:
                span.record_stream()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        with llm_span(self._get_request_payload(messages, stop=stop, **kwargs), _parent(run_manager)) as span:
            try:
                async for chunk in super()._astream(messages, stop=stop, run_manager=run_manager, **kwargs):
                    yield span.add_chunk(chunk)
            finally:
                span.record_stream()


def _set_aside_non_object_arguments(
    response: dict[str, Any],
) -> tuple[dict[str, Any], dict[int, list[InvalidToolCall]]]:
    """Take out the tool calls whose arguments are JSON but not an object (a sampled `[253]`).

    LangChain turns arguments that do not parse into `invalid_tool_calls` and reads falsy JSON
    (`null`, `[]`, `0`) as `{}`, but other valid JSON that is not an object makes `AIMessage` itself
    fail to build, which would end the whole graph run on one bad sample. Such calls become invalid
    tool calls of their choice's message instead (the token data, and so the trajectory, keep exactly
    what was sampled). Returns a copy of the response without them and, per choice index, the
    invalid calls.
    """
    set_aside: dict[int, list[InvalidToolCall]] = {}
    choices = []
    for index, choice in enumerate(response.get("choices") or []):
        message = choice.get("message") or {}
        kept = []
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            try:
                arguments = json.loads(function.get("arguments") or "{}", strict=False)
            except (json.JSONDecodeError, TypeError):
                arguments = {}  # LangChain reports arguments that do not parse (or are no string) itself
            if isinstance(arguments or {}, dict):
                kept.append(call)
                continue
            error = f"arguments of {function.get('name')!r} are JSON but not an object: {function.get('arguments')}"
            set_aside.setdefault(index, []).append(
                invalid_tool_call(name=function.get("name"), args=function.get("arguments"), id=call.get("id"),
                                  error=error)
            )
        if index in set_aside:
            choice = {**choice, "message": {**message, "tool_calls": kept or None}}
        choices.append(choice)
    return {**response, "choices": choices}, set_aside
