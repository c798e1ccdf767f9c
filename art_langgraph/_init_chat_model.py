"""`init_chat_model`: LangChain's signature, returning an `ARTChatModel` (or a configurable one).

LangChain's `init_chat_model(model, *, model_provider, configurable_fields, config_prefix,
**kwargs)` picks a provider class; here every model is served by the ART trainer through its
OpenAI API, so the provider must be `openai` or `art` (or absent). `configurable_fields` and
`config_prefix` behave as in LangChain: the model is built per call from
`config["configurable"]`, and `bind_tools` / `with_structured_output` are replayed on it.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.runnables import Runnable, RunnableConfig, ensure_config

from art_langgraph.chat_model import ARTChatModel
from art_langgraph.errors import UnsupportedOption

__all__ = ["ConfigurableARTChatModel", "init_chat_model"]

_PROVIDERS = (None, "openai", "art")
_LANGCHAIN_PROVIDERS = frozenset({
    "anthropic", "anthropic_bedrock", "azure_ai", "azure_openai", "baseten", "bedrock", "bedrock_converse",
    "bedrock_mantle_anthropic", "bedrock_mantle_openai", "cohere", "deepseek", "fireworks", "google_anthropic_vertex",
    "google_genai", "google_vertexai", "groq", "huggingface", "ibm", "langsmith", "litellm", "meta", "mistralai",
    "nvidia", "ollama", "openai", "openrouter", "perplexity", "together", "upstage", "xai",
})
"""The providers LangChain's `init_chat_model` (langchain 1.5) takes from a `provider:model` prefix;
a test keeps this list equal to LangChain's (the plugin does not depend on `langchain` itself)."""
_DECLARATIVE = ("bind_tools", "with_structured_output")


def _split_provider(model: str, model_provider: str | None) -> tuple[str, str | None]:
    """Take a `provider:` prefix off `model` as LangChain does: only a provider LangChain knows, or `art`.

    Any other colon belongs to the model's name (`mymodel:v2`). Unlike LangChain, a prefix equal
    to the given `model_provider` is taken off too.
    """
    prefix, _, rest = model.partition(":")
    if rest and (prefix in _LANGCHAIN_PROVIDERS or prefix == "art") and model_provider in (None, prefix):
        return rest, prefix
    return model, model_provider


def _build(model: str | None, model_provider: str | None, kwargs: dict[str, Any]) -> ARTChatModel:
    # As LangChain spells providers: lower-cased, `-` read as `_`, an empty one is none.
    model_provider = model_provider.replace("-", "_").lower() if model_provider else None
    if model:
        model, model_provider = _split_provider(model, model_provider)
    if model_provider not in _PROVIDERS:
        raise UnsupportedOption(
            f"model_provider={model_provider!r}",
            "ARTChatModel talks to the ART trainer's OpenAI-compatible API, which serves the model being "
            "trained; use model_provider='openai' (or none) and a served name such as 'agent@latest'",
        )
    if model is not None:
        kwargs = {**kwargs, "model": model}
    return ARTChatModel(**kwargs)


def init_chat_model(
    model: str | None = None,
    *,
    model_provider: str | None = None,
    configurable_fields: Literal["any"] | Sequence[str] | None = None,
    config_prefix: str | None = None,
    **kwargs: Any,
) -> ARTChatModel | ConfigurableARTChatModel:
    """Drop-in for LangChain's `init_chat_model`, serving from the ART trainer.

    Args:
        model: Served model name (`name@latest`, `name@step`, the base name); default
            `ART_MODEL`. An `openai:` or `art:` prefix is accepted and stripped; another provider
            LangChain knows (`anthropic:claude`) is refused; any other colon is part of the name
            (`mymodel:v2`), as in LangChain. Unlike LangChain, no model is not an error: the
            default model is used (and nothing is configurable unless `configurable_fields` says so).
        model_provider: `openai`, `art` or None (spelt as LangChain allows: `OpenAI`, or `""` for
            none); any other provider is refused.
        configurable_fields: Fields settable per call through `config["configurable"]`:
            `"any"` or a list such as `["model", "temperature"]`. With it, a
            `ConfigurableARTChatModel` is returned.
        config_prefix: Prefix of the configurable keys (`{prefix}_model`), as in LangChain; without
            `configurable_fields` it makes nothing configurable (a warning says so).
        **kwargs: `ARTChatModel` / `ChatOpenAI` arguments (`temperature`, `max_tokens`, `n`,
            `timeout`, `max_retries`, `base_url`, `api_key`, ...).

    Raises:
        UnsupportedOption: A provider other than `openai`/`art`, `use_responses_api=True`,
            `logprobs=False`, or a `cache` (each needs what this model cannot do; the message says why).
        TypeError: `model` is not a string (a model object is used directly, not passed here).
    """
    if model is not None and not isinstance(model, str):
        raise TypeError(
            f"init_chat_model takes the served model's name (such as 'agent@latest'), not a "
            f"{type(model).__name__}; use a model object you built directly instead"
        )
    if not configurable_fields:
        if config_prefix:  # LangChain's warning: a prefix alone makes nothing configurable
            warnings.warn(
                f"config_prefix={config_prefix!r} is set but no field is configurable; "
                "set configurable_fields=(...) to name the fields configurable under it",
                stacklevel=2,
            )
        return _build(model, model_provider, kwargs)
    defaults = {**kwargs, "model": model, "model_provider": model_provider}
    fields: Literal["any"] | tuple[str, ...] = "any" if configurable_fields == "any" else tuple(configurable_fields)
    _build(model, model_provider, kwargs)  # refuse what can never work now, not at the first call
    return ConfigurableARTChatModel(defaults, fields, config_prefix or "")


class ConfigurableARTChatModel(Runnable[LanguageModelInput, Any]):
    """An `ARTChatModel` built per call from `config["configurable"]` (LangChain's semantics).

    `bind_tools` and `with_structured_output` are recorded and replayed on the model built for each
    call (`bind(...)` is `Runnable.bind`: its arguments reach each call); `with_config(configurable=...)`
    fixes values for later calls. Any other public attribute (`model_name`, `get_num_tokens`, ...) is the
    default model's, as in LangChain.
    """

    def __init__(
        self,
        defaults: dict[str, Any],
        fields: Literal["any"] | tuple[str, ...],
        prefix: str,
        operations: tuple[tuple[str, tuple[Any, ...], dict[str, Any]], ...] = (),
    ) -> None:
        self._defaults = defaults
        self._fields = fields
        self._prefix = prefix + "_" if prefix and not prefix.endswith("_") else prefix
        self._operations = operations

    def _params(self, config: RunnableConfig | None) -> dict[str, Any]:
        configurable = ensure_config(config).get("configurable", {})
        params = {k[len(self._prefix) :]: v for k, v in configurable.items() if k.startswith(self._prefix)}
        if self._fields != "any":
            params = {k: v for k, v in params.items() if k in self._fields}
        return params

    def _model(self, config: RunnableConfig | None = None) -> Runnable[Any, Any]:
        params = {**self._defaults, **self._params(config)}
        model: Runnable[Any, Any] = _build(params.pop("model", None), params.pop("model_provider", None), params)
        for name, args, kwargs in self._operations:
            model = getattr(model, name)(*args, **kwargs)
        return model

    def __getattr__(self, name: str) -> Any:
        if name in _DECLARATIVE:

            def record(*args: Any, **kwargs: Any) -> ConfigurableARTChatModel:
                operations = (*self._operations, (name, args, kwargs))
                return ConfigurableARTChatModel(self._defaults, self._fields, self._prefix, operations)

            return record
        if not name.startswith("_") and hasattr(default := self._model(), name):
            return getattr(default, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def with_config(self, config: RunnableConfig | None = None, **kwargs: Any) -> ConfigurableARTChatModel:
        """Fix configurable values for later calls; other config keys bind as usual."""
        merged = RunnableConfig(**(config or {}), **kwargs)  # type: ignore[typeddict-item]
        rest = {k: v for k, v in merged.items() if k != "configurable"}
        operations = (*self._operations, ("with_config", (), {"config": rest})) if rest else self._operations
        return ConfigurableARTChatModel(
            {**self._defaults, **self._params(merged)}, self._fields, self._prefix, operations
        )

    def invoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        """Build the model for `config` and invoke it."""
        return self._model(config).invoke(input, config, **kwargs)

    async def ainvoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        """Build the model for `config` and await it."""
        return await self._model(config).ainvoke(input, config, **kwargs)

    def stream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        """Build the model for `config` and stream from it."""
        yield from self._model(config).stream(input, config, **kwargs)

    async def astream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """Build the model for `config` and stream from it asynchronously."""
        async for chunk in self._model(config).astream(input, config, **kwargs):
            yield chunk
