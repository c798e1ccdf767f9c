"""`chat_node`: tools bound once, arguments bound before kept (no engine: the bound runnable is inspected)."""

from __future__ import annotations

import pytest
from langchain_core.tools import tool

from art_langgraph import chat_node
from art_langgraph._chat_node import _bind_tools
from tests.art_langgraph.fake_engine import FakeEngine


@tool
def search(query: str) -> str:
    """Search the web."""
    return query


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return expression


def tool_names(runnable) -> list[str]:  # type: ignore[no-untyped-def]
    return [t["function"]["name"] for t in runnable.kwargs["tools"]]


def test_tools_bind_and_earlier_arguments_stay() -> None:
    bound = _bind_tools(FakeEngine().chat_model().bind(max_tokens=5), [search])
    assert tool_names(bound) == ["search"]
    assert bound.kwargs["max_tokens"] == 5


def test_model_with_the_same_tools_bound_is_used_as_it_is() -> None:
    model = FakeEngine().chat_model().bind_tools([search, calculator], tool_choice="search")
    assert _bind_tools(model, [calculator, search]) is model


def test_model_with_other_tools_bound_is_refused() -> None:
    """`tools=` must not be dropped silently in favour of the model's own (LangGraph's
    `create_react_agent` refuses too)."""
    model = FakeEngine().chat_model().bind_tools([search])
    with pytest.raises(ValueError, match=r"\['search'\] bound but tools= gives \['calculator'\]"):
        chat_node(model, tools=[calculator])


@pytest.mark.parametrize("bind", [lambda m: m, lambda m: m.bind(max_tokens=3)], ids=["as is", "bound"])
def test_configurable_model_with_other_tools_recorded_is_refused(bind) -> None:  # type: ignore[no-untyped-def]
    """Its recorded `bind_tools` counts as bound tools (they were replaced by `tools=` silently)."""
    from art_langgraph import init_chat_model

    model = init_chat_model("agent@3", configurable_fields=["model"], base_url="http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match=r"\['search'\] bound but tools= gives \['calculator'\]"):
        chat_node(bind(model.bind_tools([search])), tools=[calculator])
    same = bind(model.bind_tools([search]))
    assert _bind_tools(same, [search]) is same


def test_configurable_model_gets_the_tools_and_keeps_bound_arguments() -> None:
    engine = FakeEngine()
    clients = {name: getattr(engine.chat_model(), name) for name in ("http_client", "http_async_client")}
    from art_langgraph import init_chat_model

    model = init_chat_model("agent@3", configurable_fields=["model"], base_url="http://fake-engine/v1", **clients)
    node = chat_node(model.bind(max_tokens=4), tools=[calculator])
    node.invoke({"messages": [("user", "hi")]}, config={"configurable": {"model": "agent@5"}})
    (request,) = engine.requests
    assert (request["model"], request["max_completion_tokens"]) == ("agent@5", 4)
    assert [t["function"]["name"] for t in request["tools"]] == ["calculator"]


def test_a_wrapper_that_cannot_bind_tools_is_refused_clearly() -> None:
    """`model.with_retry()` has no `bind_tools`: a `TypeError` that says what to do, not an `AttributeError`."""
    with pytest.raises(TypeError, match=r"a RunnableRetry has none; bind the tools before wrapping"):
        chat_node(FakeEngine().chat_model().with_retry(), tools=[search])
    node = chat_node(FakeEngine().chat_model().bind_tools([search]).with_retry())
    assert node.name == "chat_node"
