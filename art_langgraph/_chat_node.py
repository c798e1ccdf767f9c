"""`chat_node`: a ready-made model-call node for `StateGraph(MessagesState)` graphs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AnyMessage, BaseMessage, SystemMessage
from langchain_core.runnables import Runnable, RunnableBinding, RunnableConfig, RunnableLambda
from langchain_core.utils.function_calling import convert_to_openai_tool

from art_langgraph._init_chat_model import ConfigurableARTChatModel, init_chat_model

__all__ = ["chat_node"]


def _messages(state: Any) -> list[AnyMessage]:
    messages = state.get("messages") if isinstance(state, dict) else getattr(state, "messages", None)
    if messages is None:
        raise KeyError("chat_node reads state['messages'] (a MessagesState graph); the state has no 'messages'")
    return list(messages)


def _tool_name(tool: Any) -> str:
    """The name a tool is offered to the model under (LangChain tool, function or OpenAI dict)."""
    return str(convert_to_openai_tool(tool)["function"]["name"])


def _tools_bound(llm: Runnable[Any, BaseMessage]) -> list[Any] | None:
    """The tools `llm` has bound already (a configurable model's: those its default model gets), or None."""
    if isinstance(llm, RunnableBinding):
        return llm.kwargs["tools"] if "tools" in llm.kwargs else _tools_bound(llm.bound)
    if isinstance(llm, ConfigurableARTChatModel):
        return _tools_bound(llm._model())
    return None


def _bind_tools(llm: Runnable[Any, BaseMessage], tools: list[Any]) -> Runnable[Any, BaseMessage]:
    """`bind_tools` that keeps arguments bound before (LangChain's drops them on a binding).

    A model that has tools bound already is used as it is when they are the same tools, and
    refused otherwise, as LangGraph's `create_react_agent` does.

    Raises:
        ValueError: `llm` has other tools bound than `tools`.
        TypeError: `llm` cannot bind tools (a wrapper such as `with_retry()` around the model).
    """
    if not hasattr(llm, "bind_tools"):
        raise TypeError(
            f"chat_node: tools= needs a model with bind_tools, and a {type(llm).__name__} has none; bind the tools "
            "before wrapping the model (chat_node(model.bind_tools([...]).with_retry())) and leave tools= out"
        )
    if (bound := _tools_bound(llm)) is not None:
        have, want = sorted(map(_tool_name, bound)), sorted(map(_tool_name, tools))
        if have != want:
            raise ValueError(
                f"chat_node: the model has the tools {have} bound but tools= gives {want}; give the tools once, "
                "either chat_node(model, tools=[...]) with a model without bound tools or "
                "chat_node(model.bind_tools([...]))"
            )
        return llm
    if not isinstance(llm, RunnableBinding) or not hasattr(llm.bound, "bind_tools"):
        return llm.bind_tools(tools)  # type: ignore[attr-defined,no-any-return]
    return llm.bound.bind_tools(tools).bind(**llm.kwargs).with_config(llm.config)  # type: ignore[no-any-return]


def chat_node(
    model: BaseChatModel | Runnable[Any, BaseMessage] | str | None = None,
    *,
    tools: Sequence[Any] | None = None,
    system: str | SystemMessage | None = None,
) -> RunnableLambda[Any, dict[str, list[BaseMessage]]]:
    """A graph node that calls the model on `state["messages"]` and returns its reply.

    `graph.add_node("agent", chat_node(tools=[search]))` gives a `StateGraph(MessagesState)`
    its model call; pair it with LangGraph's `ToolNode` to run the tool calls.

    Args:
        model: A chat model, a served model name, or None for `init_chat_model()` (the
            `ARTChatModel` from `ART_MODEL` / `configure`).
        tools: Tools to bind (`bind_tools`): LangChain tools, functions, or OpenAI tool dicts.
            Arguments already bound to `model` (`model.bind(max_tokens=...)`) are kept. A model
            with tools bound already (`model.bind_tools(...)`) is used as it is when they are the
            same tools, and refused (`ValueError`) when they differ, as in `create_react_agent`
            (a configurable model's recorded `bind_tools` counts too). A wrapper that cannot bind
            tools (`model.with_retry()`) is refused (`TypeError`): bind the tools before wrapping.
        system: System prompt put first when the messages do not start with one.

    Returns:
        A runnable node (sync and async) returning `{"messages": [reply]}`.

    Raises:
        ValueError: `model` has other tools bound than `tools`.
        TypeError: `tools` given with a model that cannot bind tools (`model.with_retry()`).
    """
    llm: Runnable[Any, BaseMessage]
    llm = init_chat_model(model) if model is None or isinstance(model, str) else model  # type: ignore[assignment]
    if tools:
        llm = _bind_tools(llm, list(tools))
    system_message = SystemMessage(system) if isinstance(system, str) else system

    def prompt(state: Any) -> list[AnyMessage]:
        messages = _messages(state)
        if system_message is not None and not (messages and isinstance(messages[0], SystemMessage)):
            messages = [system_message, *messages]
        return messages

    def call(state: Any, config: RunnableConfig) -> dict[str, list[BaseMessage]]:
        return {"messages": [llm.invoke(prompt(state), config)]}

    async def acall(state: Any, config: RunnableConfig) -> dict[str, list[BaseMessage]]:
        return {"messages": [await llm.ainvoke(prompt(state), config)]}

    return RunnableLambda(call, afunc=acall, name="chat_node")
