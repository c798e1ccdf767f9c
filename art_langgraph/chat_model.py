"""`ARTChatModel`: LangChain's `ChatOpenAI`, pointed at the trainer, recording exact tokens.

Every call asks the engine for logprobs and token ids, keeps them on the returned message as
`response_metadata["art"]` (see `ArtTokenData`) and records one `llm` span.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal
from uuid import UUID

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.messages.tool import InvalidToolCall, invalid_tool_call
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_openai import ChatOpenAI
from pydantic import model_validator

from art_langgraph import semconv
from art_langgraph._llm_span import llm_span
from art_langgraph.errors import UnsupportedOption
from art_langgraph._settings import get_settings
from art_langgraph._token_data import ART_METADATA_KEY, chunk_token_data, choice_token_data, policy_step

__all__ = ["ARTChatModel", "check_options"]

_ALIASES = {
    "model": ("model", "model_name"),
    "base_url": ("base_url", "openai_api_base"),
    "api_key": ("api_key", "openai_api_key"),
}


def check_options(values: dict[str, Any]) -> None:
    """Refuse `ChatOpenAI` arguments this model cannot honour.

    Raises:
        UnsupportedOption: `use_responses_api=True` or `logprobs=False`.
    """
    if values.get("use_responses_api"):
        raise UnsupportedOption(
            "use_responses_api=True",
            "ARTChatModel needs the Chat Completions API, where vLLM returns exact token ids; drop use_responses_api",
        )
    if values.get("logprobs") is False:
        raise UnsupportedOption("logprobs=False", "training needs the sampled logprobs of every call; drop it")


def _parent(run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None) -> UUID | None:
    """The LangChain run that called the model (where its span hangs), if known."""
    return run_manager.parent_run_id if run_manager is not None else None


class _StreamTokens:
    """Gathers token data across stream chunks; puts `policy_step` on the first chunk only."""

    def __init__(self) -> None:
        self.aggregate: ChatGenerationChunk | None = None
        self._step_given = False

    def add(self, chunk: ChatGenerationChunk) -> ChatGenerationChunk:
        art = chunk.message.response_metadata.get(ART_METADATA_KEY)
        model = chunk.message.response_metadata.pop("_art_model", None)
        if art is not None:
            if model is not None and not self._step_given:
                art["policy_step"] = policy_step(model)
                self._step_given = True
        self.aggregate = chunk if self.aggregate is None else self.aggregate + chunk
        return chunk


class ARTChatModel(ChatOpenAI):
    """A `ChatOpenAI` for the ART trainer service that records exact tokens and traces calls.

    Defaults come from `configure(...)` / `ART_TRAINER_URL`, `ART_MODEL`, `ART_API_KEY`
    (api key `"EMPTY"` when none). The returned `AIMessage.response_metadata["art"]` holds
    `prompt_token_ids`, `completion_token_ids`, `logprobs` and `policy_step`.
    """

    logprobs: bool | None = True
    stream_usage: bool | None = True
    use_responses_api: bool | None = False

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
        check_options(values)
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
        for index, (generation, choice) in enumerate(zip(result.generations, response_dict.get("choices") or [], strict=False)):
            # ChatOpenAI shares one generation_info dict across choices; give each its own.
            generation.generation_info = dict(generation.generation_info or {})
            generation.message.response_metadata[ART_METADATA_KEY] = choice_token_data(response_dict, choice)
            if isinstance(generation.message, AIMessage):
                generation.message.invalid_tool_calls.extend(not_objects.get(index, []))
        return result

    def _convert_chunk_to_generation_chunk(
        self,
        chunk: dict,
        default_chunk_class: type,
        base_generation_info: dict | None,
    ) -> ChatGenerationChunk | None:
        generation_chunk = super()._convert_chunk_to_generation_chunk(chunk, default_chunk_class, base_generation_info)
        data = chunk_token_data(chunk)
        if generation_chunk is None:
            if not any(data.values()):
                return None
            generation_chunk = ChatGenerationChunk(message=default_chunk_class(content=""))
        generation_chunk.message.response_metadata[ART_METADATA_KEY] = data
        if model := chunk.get("model"):
            generation_chunk.message.response_metadata["_art_model"] = model
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
        tokens = _StreamTokens()
        with llm_span(self._get_request_payload(messages, stop=stop, **kwargs), _parent(run_manager)) as span:
            try:
                for chunk in super()._stream(messages, stop=stop, run_manager=run_manager, **kwargs):
                    yield tokens.add(chunk)
            finally:
                if tokens.aggregate is not None:
                    span.record_generation(tokens.aggregate)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        tokens = _StreamTokens()
        with llm_span(self._get_request_payload(messages, stop=stop, **kwargs), _parent(run_manager)) as span:
            try:
                async for chunk in super()._astream(messages, stop=stop, run_manager=run_manager, **kwargs):
                    yield tokens.add(chunk)
            finally:
                if tokens.aggregate is not None:
                    span.record_generation(tokens.aggregate)


def _set_aside_non_object_arguments(response: dict[str, Any]) -> tuple[dict[str, Any], dict[int, list[InvalidToolCall]]]:
    """Take out the tool calls whose arguments are JSON but not an object (a sampled `[253]`).

    LangChain turns arguments that do not parse into `invalid_tool_calls`, but valid JSON that is
    not an object makes `AIMessage` itself fail to build, which would end the whole graph run on
    one bad sample. Such calls become invalid tool calls of their choice's message instead (the
    token data, and so the trajectory, keep exactly what was sampled). Returns a copy of the
    response without them and, per choice index, the invalid calls.
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
            except json.JSONDecodeError:
                arguments = {}  # LangChain reports unparsable arguments itself
            if isinstance(arguments, dict):
                kept.append(call)
                continue
            error = f"arguments of {function.get('name')!r} are JSON but not an object: {function.get('arguments')}"
            set_aside.setdefault(index, []).append(
                invalid_tool_call(name=function.get("name"), args=function.get("arguments"), id=call.get("id"), error=error)
            )
        if index in set_aside:
            choice = {**choice, "message": {**message, "tool_calls": kept or None}}
        choices.append(choice)
    return {**response, "choices": choices}, set_aside
