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
