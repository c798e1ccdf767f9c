"""An app already traced by Langfuse's LangChain `CallbackHandler` keeps its traces; ours stay apart.

The Langfuse SDK (real, `langfuse` package) exports to a local `Receiver` standing in for the
Langfuse server's OTLP endpoint, which cannot run here. The rule this checks: only the spans
this plugin makes carry `art.*` attributes and reach the collector, so the same model call is
never turned into two trajectories.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from langchain_core.messages import HumanMessage
from langgraph.graph import START, MessagesState, StateGraph

from art_langgraph import ARTChatModel, chat_node, semconv
from tests.art_langgraph.otlp_receiver import Receiver


@pytest.fixture
def langfuse_app(monkeypatch) -> Iterator[tuple[object, Receiver]]:
    receiver = Receiver()
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-app")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-app")
    monkeypatch.setenv("LANGFUSE_BASE_URL", receiver.url)
    monkeypatch.setenv("LANGFUSE_HOST", receiver.url)
    from langfuse import Langfuse

    client = Langfuse(public_key="pk-lf-app", secret_key="sk-lf-app", base_url=receiver.url)
    try:
        yield client, receiver
    finally:
        client.shutdown()
        receiver.close()


def test_langfuse_callback_handler_and_art_spans_do_not_mix(langfuse_app, chat_model: ARTChatModel, spans) -> None:
    from langfuse.langchain import CallbackHandler

    client, receiver = langfuse_app
    builder = StateGraph(MessagesState)
    builder.add_node("agent", chat_node(chat_model.bind(max_tokens=3)))
    builder.add_edge(START, "agent")
    graph = builder.compile(name="app")
    graph.invoke({"messages": [HumanMessage("hi")]}, config={"callbacks": [CallbackHandler(public_key="pk-lf-app")]})
    client.flush()

    ours = spans.get_finished_spans()
    assert sorted(s.attributes[semconv.SPAN_KIND] for s in ours) == ["llm", "node", "rollout"]
    theirs = receiver.spans()
    assert theirs, "the app's Langfuse tracing kept working"
    assert not any(a.key.startswith("art.") for s in theirs for a in s.attributes)
    assert {s.span_id for s in theirs}.isdisjoint({s.context.span_id.to_bytes(8, "big") for s in ours})
    assert all(path == "/api/public/otel/v1/traces" for path, _, _ in receiver.requests)
