"""An app already traced by Langfuse's LangChain `CallbackHandler` or OpenInference keeps its traces;
the collector still makes exactly one trajectory per rollout.

The rule (see `art_langgraph.semconv`): `ARTChatModel` marks its LangChain runs with the metadata
`art.traced = true`; instrumentations that copy run metadata carry the mark onto their span of
the call, and the collector leaves such spans out of trajectories.

The Langfuse SDK (real, `langfuse` package) exports to a local `Receiver` standing in for the
Langfuse server's OTLP endpoint, which cannot run here. OpenInference
(`openinference-instrumentation-langchain`, real) exports to the session's collector.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from langchain_core.messages import HumanMessage
from langgraph.graph import START, MessagesState, StateGraph
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import art_langgraph
from art_langgraph import ARTChatModel, _tracing, chat_node, semconv
from collector import assembly
from collector.otlp import decode_request
from tests.art_langgraph.otlp_receiver import Receiver


def one_node_graph(model: ARTChatModel, name: str):
    builder = StateGraph(MessagesState)
    builder.add_node("agent", chat_node(model))
    builder.add_edge(START, "agent")
    return builder.compile(name=name)


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
    graph = one_node_graph(chat_model.bind(max_tokens=3), "app")
    graph.invoke({"messages": [HumanMessage("hi")]}, config={"callbacks": [CallbackHandler(public_key="pk-lf-app")]})
    client.flush()

    ours = spans.get_finished_spans()
    assert sorted(s.attributes[semconv.SPAN_KIND] for s in ours) == ["llm", "node", "rollout"]
    theirs = receiver.spans()
    assert theirs, "the app's Langfuse tracing kept working"
    assert not any(a.key.startswith("art.") for s in theirs for a in s.attributes)
    assert {s.span_id for s in theirs}.isdisjoint({s.context.span_id.to_bytes(8, "big") for s in ours})
    assert all(path == "/api/public/otel/v1/traces" for path, _, _ in receiver.requests)
    # Sent to the collector as well, Langfuse's generation would be no model call of any trajectory.
    records = [r for _, _, request in receiver.requests
               for r in decode_request(request.SerializeToString(), "application/x-protobuf").spans]
    (generation,) = [r for r in records if r.attributes.get("langfuse.observation.type") == "generation"]
    assert generation.attributes[f"langfuse.observation.metadata.{semconv.TRACED_RUN}"] == "true"
    assert not any(assembly.is_llm(r) for r in records)


@pytest.fixture
def openinference_app(collector_service) -> Iterator[InMemorySpanExporter]:
    """`LangChainInstrumentor` on the app's own provider, exporting to the collector (and memory)."""
    from openinference.instrumentation.langchain import LangChainInstrumentor

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "app"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{collector_service.url}/v1/traces")))
    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield memory
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


def _hex(number: int, digits: int) -> str:
    return format(number, f"0{digits}x")


def test_openinference_app_gets_exact_spans_and_one_trajectory_per_rollout(
    openinference_app: InMemorySpanExporter, memory_tracing, chat_model: ARTChatModel, collector_service
) -> None:
    task = f"oi-{uuid.uuid4().hex[:8]}"
    graph = one_node_graph(chat_model.bind(max_tokens=3), task)
    art_langgraph.configure(collector_url=collector_service.url)
    ours = InMemorySpanExporter()  # this provider is shut down below, and its exporters with it
    _tracing.get_tracer_provider().add_span_processor(SimpleSpanProcessor(ours))
    try:
        with art_langgraph.rollout(task) as inside:  # OpenInference's spans join the rollout's trace
            replies = {inside.id: graph.invoke({"messages": [HumanMessage("hi")]})["messages"][-1]}
        run_id = uuid.uuid4()  # a graph run outside rollout(): OpenInference's spans are a trace of their own
        replies[run_id.hex] = graph.invoke({"messages": [HumanMessage("hello")]},
                                           config={"run_id": run_id})["messages"][-1]
        assert art_langgraph.flush(timeout=10)
    finally:
        memory_tracing.install()

    finished = ours.get_finished_spans()
    for rollout_id, reply in replies.items():
        mine = {s.attributes[semconv.SPAN_KIND]: s for s in finished
                if s.attributes.get(semconv.ROLLOUT_ID) == rollout_id}
        assert sorted(mine) == ["llm", "node", "rollout"]
        root, node, call = mine["rollout"], mine["node"], mine["llm"]
        assert (root.parent is None and node.parent.span_id == root.context.span_id
                and call.parent.span_id == node.context.span_id)
        assert len({s.context.trace_id for s in mine.values()}) == 1
        art = reply.response_metadata["art"]
        assert list(call.attributes[semconv.PROMPT_TOKEN_IDS]) == art["prompt_token_ids"]
        assert list(call.attributes[semconv.COMPLETION_TOKEN_IDS]) == art["completion_token_ids"]
        assert list(call.attributes[semconv.COMPLETION_LOGPROBS]) == pytest.approx(art["logprobs"])
        assert all(key.startswith(("art.", "gen_ai.")) for s in mine.values()
                   for key in s.attributes), "nothing of OpenInference's"

    theirs = openinference_app.get_finished_spans()
    calls = [s for s in theirs if s.attributes.get("openinference.span.kind") == "LLM"]
    assert len(calls) == 2, "the instrumentor still sees every model call"
    assert ({s.attributes["llm.output_messages.0.message.content"] for s in calls}
            == {r.content for r in replies.values()})
    assert all(f'"{semconv.TRACED_RUN}": true' in s.attributes["metadata"] for s in calls)
    their_traces = {_hex(s.context.trace_id, 32) for s in theirs}
    assert inside.trace_id in their_traces and len(their_traces) == 2

    found = httpx.get(f"{collector_service.url}/v1/trajectories", params={"task": task}, timeout=10).json()
    assert sorted(t["id"] for t in found) == sorted(replies)
    for trajectory in found:
        art = replies[trajectory["id"]].response_metadata["art"]
        assert trajectory["token_exact"] is True
        assert ([s["token_ids"] for s in trajectory["sequences"]]
                == [art["prompt_token_ids"] + art["completion_token_ids"]])
    for trace_id in their_traces:  # no trajectory of OpenInference's traces
        assert httpx.get(f"{collector_service.url}/v1/trajectories/{trace_id}", timeout=10).status_code == 404
