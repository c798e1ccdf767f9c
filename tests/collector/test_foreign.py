"""Model-call spans of other instrumentations become (not token-exact) trajectories.

The spans are made by the real OpenTelemetry SDK with the attribute names each convention
publishes (OpenTelemetry GenAI, OpenLLMetry's flattened `gen_ai.prompt.N.*`, OpenInference,
the Langfuse SDK's `langfuse.observation.*`), encoded by the SDK's OTLP encoder and posted to
the collector's `/v1/traces`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector.config import CollectorSettings
from collector.foreign import conversation, same_messages
from collector.server import create_app

TOOL = {"type": "function", "function": {"name": "add", "description": "", "parameters": {"type": "object"}}}
EXPECTED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "assistant", "content": "5"},
]


@pytest.fixture
def export(tmp_path: Path) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """Record one span with the SDK, post it as OTLP protobuf, return the trajectory of its trace."""
    client = TestClient(create_app(CollectorSettings(db=f"sqlite:///{tmp_path / 'c.db'}")))

    def run(attributes: dict[str, Any], name: str = "llm") -> dict[str, Any] | None:
        memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        with provider.get_tracer("agent").start_as_current_span("agent run"):
            with provider.get_tracer("instrumentation").start_as_current_span(name, attributes=attributes):
                pass
        provider.shutdown()
        spans = memory.get_finished_spans()
        body = encode_spans(spans).SerializeToString()
        assert client.post("/v1/traces", content=body, headers={"content-type": "application/x-protobuf"}).status_code == 200
        trace_id = f"{spans[0].context.trace_id:032x}"
        found = client.get(f"/v1/trajectories/{trace_id}")
        return found.json() if found.status_code == 200 else None

    return run


def _check(trajectory: dict[str, Any] | None, model: str, tools: bool = True) -> None:
    assert trajectory is not None
    assert trajectory["token_exact"] is False and trajectory["sequences"] == []
    assert trajectory["model"] == model
    assert same_messages(trajectory["messages"], EXPECTED), trajectory["messages"]
    assert trajectory["messages"] == EXPECTED
    assert trajectory["tools"] == ([TOOL] if tools else [])


def test_opentelemetry_gen_ai_structured_messages(export) -> None:
    parts_in = [
        {"role": "user", "parts": [{"type": "text", "content": "What is 2+3?"}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1", "name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "5"}]},
    ]
    parts_out = [{"role": "assistant", "parts": [{"type": "text", "content": "5"}], "finish_reason": "stop"}]
    trajectory = export({
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.response.model": "gpt-4o-mini-2024-07-18",
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "Be brief."}]),
        "gen_ai.input.messages": json.dumps(parts_in),
        "gen_ai.output.messages": json.dumps(parts_out),
        "gen_ai.tool.definitions": json.dumps([TOOL]),
    }, name="chat gpt-4o-mini")
    _check(trajectory, "gpt-4o-mini-2024-07-18")


def test_older_flattened_gen_ai_prompt_and_completion(export) -> None:
    trajectory = export({
        "llm.request.type": "chat",
        "gen_ai.system": "openai",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.prompt.0.role": "system",
        "gen_ai.prompt.0.content": "Be brief.",
        "gen_ai.prompt.1.role": "user",
        "gen_ai.prompt.1.content": "What is 2+3?",
        "gen_ai.prompt.2.role": "assistant",
        "gen_ai.prompt.2.tool_calls.0.id": "call_1",
        "gen_ai.prompt.2.tool_calls.0.name": "add",
        "gen_ai.prompt.2.tool_calls.0.arguments": '{"a": 2, "b": 3}',
        "gen_ai.prompt.3.role": "tool",
        "gen_ai.prompt.3.content": "5",
        "gen_ai.prompt.3.tool_call_id": "call_1",
        "gen_ai.completion.0.role": "assistant",
        "gen_ai.completion.0.content": "5",
        "gen_ai.completion.0.finish_reason": "stop",
        "llm.request.functions.0.name": "add",
        "llm.request.functions.0.description": "",
        "llm.request.functions.0.parameters": '{"type": "object"}',
    }, name="openai.chat")
    _check(trajectory, "gpt-4o-mini")


def test_openinference_llm_span(export) -> None:
    trajectory = export({
        "openinference.span.kind": "LLM",
        "llm.model_name": "gpt-4o-mini",
        "llm.input_messages.0.message.role": "system",
        "llm.input_messages.0.message.content": "Be brief.",
        "llm.input_messages.1.message.role": "user",
        "llm.input_messages.1.message.contents.0.message_content.type": "text",
        "llm.input_messages.1.message.contents.0.message_content.text": "What is 2+3?",
        "llm.input_messages.2.message.role": "assistant",
        "llm.input_messages.2.message.tool_calls.0.tool_call.id": "call_1",
        "llm.input_messages.2.message.tool_calls.0.tool_call.function.name": "add",
        "llm.input_messages.2.message.tool_calls.0.tool_call.function.arguments": '{"a": 2, "b": 3}',
        "llm.input_messages.3.message.role": "tool",
        "llm.input_messages.3.message.content": "5",
        "llm.input_messages.3.message.tool_call_id": "call_1",
        "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.content": "5",
        "llm.tools.0.tool.json_schema": json.dumps(TOOL),
        "input.value": "{}",
    }, name="ChatOpenAI")
    _check(trajectory, "gpt-4o-mini")


def test_langfuse_generation(export) -> None:
    sent = {"messages": EXPECTED[:4], "tools": [TOOL]}
    trajectory = export({
        "langfuse.observation.type": "generation",
        "langfuse.observation.model.name": "gpt-4o-mini",
        "langfuse.observation.input": json.dumps(sent),
        "langfuse.observation.output": json.dumps({"role": "assistant", "content": "5"}),
        "langfuse.observation.usage_details": json.dumps({"input": 30, "output": 1}),
    }, name="ChatOpenAI")
    _check(trajectory, "gpt-4o-mini")
    text = export({
        "langfuse.observation.type": "generation",
        "langfuse.observation.input": "What is 2+3?",
        "langfuse.observation.output": "5",
    })
    assert text is not None and text["messages"] == [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]


@pytest.mark.parametrize(
    "attributes",
    [
        {"openinference.span.kind": "CHAIN", "input.value": "x"},
        {"langfuse.observation.type": "span", "langfuse.observation.input": "x"},
        {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "add"},
    ],
)
def test_spans_that_are_not_model_calls_make_no_trajectory(export, attributes) -> None:
    assert export(attributes) is None


def test_conversation_ignores_malformed_values() -> None:
    broken = conversation({"gen_ai.operation.name": "chat", "gen_ai.input.messages": "{not json", "gen_ai.output.messages": "[1, 2]"})
    assert (broken.input, broken.output, broken.tools) == ([], [], [])
    clash = conversation({"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi", "gen_ai.prompt.0.content.x": "y"})
    assert clash.input == [{"role": "user", "content": "hi"}]
