"""The token data a streamed reply's message carries (`response_metadata["art"]`), however LangChain or LangGraph
assembles that message from the stream's chunks: what `invoke` gives, against the vLLM-shaped fake engine.

`stream()`'s chunks added up (and `astream_events` v2, and `stream_mode="messages"`) merge each key's values with `+`,
which concatenates lists; `stream_events(version="v3")`, and a graph node's `invoke` under it, keep the last value of
each key instead (`dict.update`).
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Iterable
from functools import reduce
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from art_langgraph import ARTChatModel, semconv
from tests.art_langgraph.fake_engine import PROMPT_IDS, FakeEngine, completion_ids, logprobs
from tests.art_langgraph.span_reading import spans_of

INVOKED = {
    "prompt_token_ids": PROMPT_IDS,
    "completion_token_ids": completion_ids(0),
    "logprobs": logprobs(0),
    "policy_step": 7,
}
"""What `invoke` puts on its message: choice 0's token data, whole."""
INPUT = {"messages": [("user", "hi")]}


def span_token_data(spans: InMemorySpanExporter) -> list[dict[str, Any]]:
    """The token data each `llm` span recorded, as `response_metadata["art"]` holds it."""
    return [
        {
            "prompt_token_ids": list(span.attributes[semconv.PROMPT_TOKEN_IDS]),
            "completion_token_ids": list(span.attributes[semconv.COMPLETION_TOKEN_IDS]),
            "logprobs": list(span.attributes[semconv.COMPLETION_LOGPROBS]),
            "policy_step": span.attributes[semconv.POLICY_STEP],
        }
        for span in spans_of(spans, semconv.SPAN_KIND_LLM)
    ]


def merged(chunks: Iterable[Any]) -> Any:
    """The chunks added up, as a caller of `stream()` would."""
    return reduce(operator.add, chunks)


def invoking_graph(model: ARTChatModel) -> CompiledStateGraph:
    """A graph of one node that calls `model.invoke` (which streams when the graph is streamed)."""

    def agent(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    return builder.compile()


def stream_events_v3(model: ARTChatModel) -> BaseMessage:
    return model.stream_events("hi", version="v3").output


def graph_stream_events_v3(model: ARTChatModel) -> BaseMessage:
    run = invoking_graph(model).stream_events(INPUT, version="v3")
    for _ in run:
        pass
    return run.output["messages"][-1]


def graph_streaming_messages(model: ARTChatModel) -> BaseMessage:
    modes = invoking_graph(model).stream(INPUT, stream_mode=["messages", "values"])
    return [state for mode, state in modes if mode == "values"][-1]["messages"][-1]


async def astream_added_up(model: ARTChatModel) -> BaseMessage:
    return merged([chunk async for chunk in model.astream("hi")])


async def astream_events_v3(model: ARTChatModel) -> BaseMessage:
    return await (await model.astream_events("hi", version="v3"))


async def graph_astream_events_v3(model: ARTChatModel) -> BaseMessage:
    run = await invoking_graph(model).astream_events(INPUT, version="v3")
    return (await run.output())["messages"][-1]


async def graph_astream_events_v2(model: ARTChatModel) -> BaseMessage:
    ends = [
        event["data"]["output"]
        async for event in invoking_graph(model).astream_events(INPUT, version="v2")
        if event["event"] == "on_chat_model_end"
    ]
    (end,) = ends
    return end


SYNC_PATHS: dict[str, Callable[[ARTChatModel], BaseMessage]] = {
    "stream added up": lambda model: merged(model.stream("hi")),
    "stream_events v3": stream_events_v3,
    "graph stream_events v3": graph_stream_events_v3,
    "graph stream_mode messages": graph_streaming_messages,
}
ASYNC_PATHS: dict[str, Callable[[ARTChatModel], Awaitable[BaseMessage]]] = {
    "astream added up": astream_added_up,
    "astream_events v3": astream_events_v3,
    "graph astream_events v3": graph_astream_events_v3,
    "graph astream_events v2": graph_astream_events_v2,
}


@pytest.mark.parametrize("path", SYNC_PATHS)
def test_a_streamed_message_carries_what_invoke_gives(spans, path: str) -> None:
    """Each chunk carried its own part of the token data, so only `+` put them together: under `stream_events(version=
    "v3")` the message (a node's reply in the graph's state too) kept the last chunk's part alone, the last token's id
    and logprob, without the prompt's ids and the policy step, while the span had them all."""
    model = FakeEngine().chat_model()
    assert model.invoke("hi").response_metadata["art"] == INVOKED
    message = SYNC_PATHS[path](model)
    assert isinstance(message, AIMessage)
    assert message.response_metadata["art"] == INVOKED
    assert span_token_data(spans) == [INVOKED, INVOKED]


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("path", ASYNC_PATHS)
async def test_an_async_streamed_message_carries_what_ainvoke_gives(spans, path: str) -> None:
    model = FakeEngine().chat_model()
    assert (await model.ainvoke("hi")).response_metadata["art"] == INVOKED
    message = await ASYNC_PATHS[path](model)
    assert isinstance(message, AIMessage)
    assert message.response_metadata["art"] == INVOKED
    assert span_token_data(spans) == [INVOKED, INVOKED]


@pytest.mark.parametrize("path", ["stream added up", "stream_events v3"])
def test_a_streamed_message_of_several_choices_carries_the_first_ones(spans, path: str) -> None:
    """With `n=2`, LangChain merges both choices into one streamed message: its `art` held the two choices' ids
    interleaved (`[10, 11, 20, 21, 2, 3]`), which no choice sampled, yet looked token-exact. Now it is choice 0's, as
    `invoke`'s message is; each choice's span keeps its own."""
    model = FakeEngine().chat_model(n=2)
    assert model.invoke("hi").response_metadata["art"] == INVOKED
    assert SYNC_PATHS[path](model).response_metadata["art"] == INVOKED
    assert len(spans_of(spans, semconv.SPAN_KIND_LLM)) == 4


def test_a_stream_left_before_its_choice_finished_carries_no_token_data(spans) -> None:
    """A stream its caller leaves before the choice's finish reason is no turn (its span says `GeneratorExit`): its
    chunks carried the prefix's ids as if they were a reply's. Left after the finish reason, before the usage chunk,
    the choice is whole, on the message as in the span."""
    model = FakeEngine().chat_model()
    read = []
    for chunk in model.stream("hi"):
        read.append(chunk)
        if len(read) == 3:  # the role chunk and two of the three tokens
            break
    assert "art" not in merged(read).response_metadata
    read = []
    for chunk in model.stream("hi"):
        read.append(chunk)
        if chunk.response_metadata.get("finish_reason"):
            break
    assert merged(read).response_metadata["art"] == INVOKED
