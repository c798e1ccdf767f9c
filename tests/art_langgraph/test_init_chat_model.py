"""`init_chat_model`: LangChain's signature, configurable fields, and what it refuses."""

from __future__ import annotations

import inspect

import pytest
from langchain.chat_models import init_chat_model as langchain_init_chat_model

from art_langgraph import ARTChatModel, ConfigurableARTChatModel, UnsupportedOption, init_chat_model


def test_accepts_langchains_parameters() -> None:
    ours = inspect.signature(init_chat_model).parameters
    theirs = inspect.signature(langchain_init_chat_model).parameters
    assert list(ours) == list(theirs)
    assert all(ours[name].kind == theirs[name].kind for name in theirs)


def test_defaults_come_from_settings(monkeypatch) -> None:
    monkeypatch.setenv("ART_TRAINER_URL", "http://trainer.example:9000/v1")
    monkeypatch.setenv("ART_MODEL", "agent@7")
    monkeypatch.delenv("ART_API_KEY", raising=False)
    from art_langgraph import _settings

    monkeypatch.setattr(_settings, "_settings", None)
    model = init_chat_model()
    assert isinstance(model, ARTChatModel)
    assert model.model_name == "agent@7"
    assert model.openai_api_base == "http://trainer.example:9000/v1"
    assert model.openai_api_key.get_secret_value() == "EMPTY"
    assert init_chat_model("openai:other", api_key="k").model_name == "other"
    assert init_chat_model("agent@3", model_provider="art", temperature=0.2).temperature == 0.2


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (("x",), {"model_provider": "anthropic"}, "model_provider='anthropic'"),
        (("anthropic:claude",), {}, "model_provider='anthropic'"),
        (("x",), {"use_responses_api": True}, "use_responses_api"),
        (("x",), {"logprobs": False}, "logprobs=False"),
        (("x",), {"cache": True}, "cache"),
        (("x",), {"configurable_fields": ["model"], "model_provider": "google_genai"}, "google_genai"),
    ],
)
def test_refuses_what_it_cannot_honour(args, kwargs, needle: str) -> None:
    with pytest.raises(UnsupportedOption, match=needle) as info:
        init_chat_model(*args, **kwargs)
    assert info.value.code == "unsupported_option"
    assert "Hint:" in str(info.value)


@pytest.mark.parametrize(
    ("model", "model_provider", "name"),
    [
        ("mymodel:v2", None, "mymodel:v2"),  # not a provider: the colon is part of the name
        ("agent@3:beta", None, "agent@3:beta"),
        ("openai:agent@3", None, "agent@3"),
        ("art:agent@3", None, "agent@3"),
        ("art:agent@3", "art", "agent@3"),
        ("mymodel:v2", "openai", "mymodel:v2"),
    ],
)
def test_a_colon_names_a_provider_only_when_langchain_knows_it(model: str, model_provider, name: str) -> None:
    built = init_chat_model(model, model_provider=model_provider, base_url="http://127.0.0.1:9/v1")
    assert built.model_name == name


def test_known_providers_are_langchains() -> None:
    from langchain.chat_models.base import _BUILTIN_PROVIDERS

    from art_langgraph._init_chat_model import _LANGCHAIN_PROVIDERS

    assert _LANGCHAIN_PROVIDERS == set(_BUILTIN_PROVIDERS)


def test_bind_on_a_configurable_model_reaches_the_request(spans) -> None:
    """`bind` is `Runnable.bind` (not a replayed operation): its arguments reach each call."""
    from tests.art_langgraph.fake_engine import FakeEngine

    engine = FakeEngine()
    clients = {name: getattr(engine.chat_model(), name) for name in ("http_client", "http_async_client")}
    model = init_chat_model("agent@latest", configurable_fields=["temperature"], **clients)
    model.bind(max_tokens=5).invoke("hi", config={"configurable": {"temperature": 0.5}})
    (request,) = engine.requests
    assert (request["max_completion_tokens"], request["temperature"]) == (5, 0.5)


def test_configurable_fields_pick_the_model_per_call(openai_url: str, served_model: str, spans) -> None:
    from art_langgraph import semconv

    model = init_chat_model(
        served_model,
        configurable_fields=["model", "max_tokens"],
        config_prefix="agent",
        base_url=openai_url,
        max_tokens=3,
    )
    assert isinstance(model, ConfigurableARTChatModel)
    base = "SmolLM2-135M-Instruct"
    reply = model.invoke("hi", config={"configurable": {"agent_model": base, "agent_max_tokens": 2}})
    assert reply.usage_metadata["output_tokens"] <= 2
    assert reply.response_metadata["art"]["completion_token_ids"]
    default = model.invoke("hi")
    assert default.usage_metadata["output_tokens"] <= 3
    requested = [s.attributes[semconv.GEN_AI_REQUEST_MODEL] for s in spans.get_finished_spans()]
    assert requested == [base, served_model]
    # Not a configurable field: ignored like in LangChain (the prefix matches, the name does not).
    fixed = model.with_config(configurable={"agent_temperature": 2.0, "agent_model": base})
    built = fixed._model()
    assert built.model_name == base
    assert built.temperature is None


def test_configurable_model_replays_bind_tools(openai_url: str, served_model: str, add_tool) -> None:
    model = init_chat_model(configurable_fields="any", base_url=openai_url, model=served_model)
    bound = model.bind_tools([add_tool]).with_config(configurable={"temperature": 0.5})
    built = bound._model()
    assert built.kwargs["tools"][0]["function"]["name"] == "add"
    assert built.bound.temperature == 0.5


def test_a_configurable_model_shows_the_default_models_attributes() -> None:
    """As LangChain's configurable model does: code that reads `model_name` or counts tokens keeps working."""
    model = init_chat_model("agent@3", configurable_fields=["temperature"], base_url="http://127.0.0.1:9/v1")
    assert model.model_name == "agent@3"
    assert model.bind_tools([]).model_name == "agent@3"
    assert callable(model.get_num_tokens_from_messages)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = model.no_such_attribute


def test_a_prefix_without_configurable_fields_makes_nothing_configurable() -> None:
    """As in LangChain (which warns too): a prefix alone used to make every field, `base_url` too, settable per call."""
    with pytest.warns(UserWarning, match="config_prefix='agent'"):
        model = init_chat_model("agent@3", config_prefix="agent", base_url="http://127.0.0.1:9/v1")
    assert isinstance(model, ARTChatModel)
    assert isinstance(init_chat_model("agent@3", configurable_fields=[]), ARTChatModel)


@pytest.mark.parametrize("model_provider", ["OpenAI", "", "ART"])
def test_a_provider_spelt_as_langchain_allows_is_taken(model_provider: str) -> None:
    """LangChain lower-cases the provider (`-` read as `_`) and reads an empty one as none."""
    built = init_chat_model("agent@3", model_provider=model_provider, base_url="http://127.0.0.1:9/v1")
    assert built.model_name == "agent@3"
    configurable = init_chat_model("agent@3", model_provider=model_provider, configurable_fields=["temperature"])
    assert configurable._model().model_name == "agent@3"


def test_a_model_object_is_refused_with_a_type_error() -> None:
    """As in LangChain: `init_chat_model(llm)` says to use the model directly (not an `AttributeError`)."""
    with pytest.raises(TypeError, match="not a ARTChatModel; use a model object you built directly"):
        init_chat_model(ARTChatModel(model="agent@3"))  # type: ignore[arg-type]

