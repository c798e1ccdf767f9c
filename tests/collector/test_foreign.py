"""Model-call spans of other instrumentations become (not token-exact) trajectories, unless
they describe calls the plugin recorded itself.

The spans are made by the real OpenTelemetry SDK with the attribute names each convention
publishes (OpenTelemetry GenAI, OpenLLMetry's flattened `gen_ai.prompt.N.*`, OpenInference,
the Langfuse SDK's `langfuse.observation.*`), encoded by the SDK's OTLP encoder and posted to
the collector's `/v1/traces`.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sqlalchemy import select, text

from art_langgraph import semconv as sc
from collector import foreign_deletion, store_reads
from collector.errors import Conflict
from collector.foreign import conversation, describes_art_call, finish_reason, same_messages
from collector.foreign_deletion import FOREIGN_IN_ROLLOUT
from collector.judging import GroupJudge
from collector.otlp import SpanRecord
from collector.protocol import Batch, BatchRequest, ReleaseRequest, RewardIn
from collector.schema import groups as group_rows
from collector.schema import spans as span_rows
from collector.scoring_config import JudgeSettings
from collector.scoring_store import INGEST_DELAY, ScoringStore
from collector.store import SqlStore
from tests.collector.conftest import Clock
from tests.collector.pausing import WAIT, beside_a_save, lock_waited_for, pause_after
from tests.collector.server_helpers import collector_app
from tests.collector.span_builders import llm, rollout, sid, to_request

TRACE_A, TRACE_B, TRACE_C, TRACE_D, TRACE_E = (f"{k:032x}" for k in range(0xA1, 0xA6))
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


def created_at(scoring: ScoringStore, trajectory_id: str) -> float:
    """When the stored trajectory `trajectory_id` was created, as the Langfuse push reads it (a record of a score pushed
    for it carries that time, `ScoringStore.mark_pushed`)."""
    return next(row["created_at"] for row in scoring.read(ScoringStore.trajectory_rows) if row["id"] == trajectory_id)


@pytest.fixture
def export(tmp_path: Path) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """Record one span with the SDK, post it as OTLP protobuf, return the trajectory of its trace."""
    client = TestClient(collector_app(tmp_path))

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
        assert client.post("/v1/traces", content=body,
                           headers={"content-type": "application/x-protobuf"}).status_code == 200
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
        {"role": "assistant",
         "parts": [{"type": "tool_call", "id": "call_1", "name": "add", "arguments": {"a": 2, "b": 3}}]},
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



def test_a_foreign_call_that_failed_is_no_turn(tmp_path: Path) -> None:
    """OpenInference marks a failed call by the span's status alone (ERROR, with an exception event; no
    `error.type`): it sampled nothing, so a run whose second call failed is its first call's conversation."""
    first = {"llm.input_messages.0.message.role": "user", "llm.input_messages.0.message.content": "What is 2+3?"}
    reply = {"llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "5"}
    second = {**first, "llm.input_messages.1.message.role": "assistant", "llm.input_messages.1.message.content": "5",
              "llm.input_messages.2.message.role": "user", "llm.input_messages.2.message.content": "And 5+5?"}
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("openinference")
    llm_span = {"openinference.span.kind": "LLM", "llm.model_name": "gpt-4o-mini"}
    with pytest.raises(TimeoutError), tracer.start_as_current_span("agent run"):
        with tracer.start_as_current_span("ChatOpenAI", attributes={**llm_span, **first, **reply}):
            pass
        with tracer.start_as_current_span("ChatOpenAI", attributes={**llm_span, **second}):
            raise TimeoutError("the model did not answer")
    provider.shutdown()
    spans = memory.get_finished_spans()
    assert spans[1].status.status_code is StatusCode.ERROR and "error.type" not in spans[1].attributes
    client = TestClient(collector_app(tmp_path))
    body = encode_spans(spans).SerializeToString()
    assert client.post("/v1/traces", content=body,
                       headers={"content-type": "application/x-protobuf"}).status_code == 200
    trajectory = client.get(f"/v1/trajectories/{spans[0].context.trace_id:032x}").json()
    assert trajectory["messages"] == [
        {"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}
    ]


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
    assert text is not None and text["messages"] == [{"role": "user", "content": "What is 2+3?"},
                                                     {"role": "assistant", "content": "5"}]


def _structured(reason: str) -> dict[str, Any]:
    return {"gen_ai.operation.name": "chat",
            "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "count"}]}]),
            "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "1, 2"}],
                                                   "finish_reason": reason}])}


def _openllmetry(reason: str) -> dict[str, Any]:
    return {"llm.request.type": "chat", "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "count",
            "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "1, 2",
            "gen_ai.completion.0.finish_reason": reason}


def _openinference(reason: str) -> dict[str, Any]:
    return {"openinference.span.kind": "LLM", "llm.finish_reason": reason,
            "llm.input_messages.0.message.role": "user", "llm.input_messages.0.message.content": "count",
            "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "1, 2"}


@pytest.mark.parametrize(("convention", "cut"), [
    (_structured, "length"),  # GenAI semconv: each output message's `finish_reason`
    (_openllmetry, "length"),  # OpenLLMetry's OpenAI instrumentation: the choice's `finish_reason`
    (_openllmetry, "max_tokens"),  # OpenLLMetry's Anthropic instrumentation: the response's `stop_reason`
    (_openinference, "length"),  # OpenInference: `llm.finish_reason`
])
def test_a_reply_the_token_limit_cut_is_listed_whichever_convention_says_so(export, convention, cut) -> None:
    """Foreign replies are re-tokenized, so `length_cut` is what keeps the trainer from training an end-of-turn
    token the model never sampled; it read only `gen_ai.response.finish_reasons`, which these spans lack."""
    for reason, listed in ((cut, [1]), ("stop", [])):
        trajectory = export(convention(reason))
        assert trajectory is not None and [m["content"] for m in trajectory["messages"]] == ["count", "1, 2"]
        assert trajectory["length_cut"] == listed, reason
    assert finish_reason({"gen_ai.completion.0.finish_reason": "MAX_TOKENS"}) == "length"  # Gemini's
    assert finish_reason({"gen_ai.operation.name": "chat", "gen_ai.output.messages": "{not json"}) is None


@pytest.mark.parametrize(
    "attributes",
    [
        {"openinference.span.kind": "CHAIN", "input.value": "x"},
        {"langfuse.observation.type": "span", "langfuse.observation.input": "x"},
        {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "add"},
        {"gen_ai.operation.name": ["chat"]},  # an array attribute is no name (it made the export a 500)
    ],
)
def test_spans_that_are_not_model_calls_make_no_trajectory(export, attributes) -> None:
    assert export(attributes) is None


def test_conversation_ignores_malformed_values() -> None:
    broken = conversation({"gen_ai.operation.name": "chat", "gen_ai.input.messages": "{not json",
                           "gen_ai.output.messages": "[1, 2]"})
    assert (broken.input, broken.output, broken.tools) == ([], [], [])
    clash = conversation({"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
                          "gen_ai.prompt.0.content.x": "y"})
    assert clash.input == [{"role": "user", "content": "hi"}]


def test_conversation_reads_parts_of_unexpected_shape_as_absent() -> None:
    """Values a convention never writes there (a string where an object belongs, a number for a
    list) are left out, not raised on: assembly runs when a batch is leased, so one such span
    would otherwise stop every lease."""
    openinference = conversation({
        "openinference.span.kind": "LLM",
        "llm.input_messages.0.message": "x",
        "llm.input_messages.1.message.role": "user",
        "llm.input_messages.1.message.content": "hi",
        "llm.input_messages.1.message.tool_calls.0.tool_call": "y",
        "llm.tools.0.tool": "z",
    })
    assert openinference.input == [
        {"role": "user", "content": ""},
        {"role": "user", "content": "hi",
         "tool_calls": [{"id": None, "type": "function", "function": {"name": None, "arguments": "{}"}}]},
    ]
    assert openinference.tools == []
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    gen_ai = conversation({"gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps([
        {"role": "user", "content": "hi", "tool_calls": 5},
        {"role": "assistant", "content": "", "tool_calls": ["add", call, {"function": "add"}]},
    ])})
    assert gen_ai.input == [{"role": "user", "content": "hi", "tool_calls": []},
                            {"role": "assistant", "content": "", "tool_calls": [call]}]
    # the calls read are compared as calls: a reply without them says something else
    assert same_messages(gen_ai.input, [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert not same_messages(gen_ai.input, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}])
    langfuse = conversation({"langfuse.observation.type": "generation",
                             "langfuse.observation.input": json.dumps({"messages": QUESTION, "tools": 5})})
    assert (langfuse.input, langfuse.tools) == (QUESTION, [])
    numbered = conversation({"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
                             "gen_ai.prompt.\u00b2.content": "x"})  # "²" is a digit that `int` refuses
    assert numbered.input == []


def test_openllmetry_content_parts_read_as_text() -> None:
    """OpenLLMetry writes a message's list of content parts as JSON text: the trainer got the JSON as the message."""
    parts = [{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
             {"type": "text", "text": "2+3?"}]
    talk = conversation({"llm.request.type": "chat", "gen_ai.prompt.0.role": "user",
                         "gen_ai.prompt.0.content": json.dumps(parts), "gen_ai.prompt.1.role": "user",
                         "gen_ai.prompt.1.content": "[1, 2]", "gen_ai.completion.0.content": "5"})
    assert talk.input == [{"role": "user", "content": "What is 2+3?"}, {"role": "user", "content": "[1, 2]"}]
    assert talk.output == [{"role": "assistant", "content": "5"}]



def test_a_conversation_missing_a_numbered_message_is_read_as_absent(caplog: pytest.LogCaptureFixture) -> None:
    """A flattened conversation that skips a number lacks a message: read as it is, it trained a reply on a prompt the
    model never saw."""
    flat = {"llm.request.type": "chat", "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "a",
            "gen_ai.prompt.2.role": "user", "gen_ai.prompt.2.content": "c",
            "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "x"}
    talk = conversation(flat, span_id="s1")
    assert (talk.input, talk.output) == ([], [])
    assert "span s1: gen_ai.prompt.1 is missing" in caplog.text
    huge = {**flat, "gen_ai.prompt.1.role": "user", "gen_ai.prompt.99999999999999999999.role": "user"}
    assert conversation(huge).input == []
    openinference = {"openinference.span.kind": "LLM", "llm.input_messages.0.message.role": "user",
                     "llm.input_messages.0.message.content": "a",
                     "llm.output_messages.0.message.role": "assistant",
                     "llm.output_messages.0.message.tool_calls.1.tool_call.function.name": "add"}
    assert conversation(openinference, span_id="s2").output == []
    assert "span s2: llm.output_messages.0.message.tool_calls.0 is missing" in caplog.text
    first_dropped = {"llm.request.type": "chat", "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "b"}
    assert conversation(first_dropped, span_id="s3").input == []
    assert "span s3: gen_ai.prompt.0 is missing" in caplog.text
    complete = {**flat, "gen_ai.prompt.1.role": "assistant", "gen_ai.prompt.1.content": "b"}
    assert [m["content"] for m in conversation(complete).input] == ["a", "b", "c"]


def _openllmetry_call(span: Any, turns: int) -> None:
    """The attributes of a chat call in the order OpenLLMetry's OpenAI instrumentation sets them."""
    span.set_attribute("llm.request.type", "chat")  # its `start_span` attributes
    for i in range(turns):
        span.set_attribute(f"gen_ai.prompt.{i}.role", "user")
        span.set_attribute(f"gen_ai.prompt.{i}.content", f"message {i}")
    span.set_attribute("gen_ai.completion.0.role", "assistant")
    span.set_attribute("gen_ai.completion.0.content", "done")


def _openinference_call(span: Any, turns: int) -> None:
    """The attributes of a chat call in the order OpenInference's LangChain tracer sets them (its `_update_span`)."""
    span.set_attribute("openinference.span.kind", "LLM")
    span.set_attributes({"input.value": "{}", "output.value": "{}"})
    for i in range(turns):
        span.set_attributes({f"llm.input_messages.{i}.message.role": "user",
                             f"llm.input_messages.{i}.message.content": f"message {i}"})
    span.set_attributes({"llm.output_messages.0.message.role": "assistant",
                         "llm.output_messages.0.message.content": "done", "llm.model_name": "gpt-4o-mini"})


@pytest.mark.parametrize(("call", "missing"), [(_openllmetry_call, "gen_ai.prompt.0"),
                                               (_openinference_call, "llm.input_messages.0")])
def test_a_long_call_whose_first_attributes_the_sdk_dropped_is_a_turn_without_messages(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, call: Callable[[Any, int], None], missing: str
) -> None:
    """The SDK keeps 128 attributes a span, dropping the oldest: a long conversation loses the attribute that marks a
    model call (`llm.request.type`, `openinference.span.kind`) and its first messages. The call is still the trace's
    last turn, its conversation absent (a warning says why), not left out so that an earlier call's shorter
    conversation stood for the run."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("instrumentation")
    with tracer.start_as_current_span("agent run"):
        for turns in (1, 70):
            with tracer.start_as_current_span("chat") as span:
                call(span, turns)
    provider.shutdown()
    spans = memory.get_finished_spans()
    assert spans[1].dropped_attributes > 0
    assert not {"llm.request.type", "openinference.span.kind"} & set(spans[1].attributes)
    client = TestClient(collector_app(tmp_path))
    assert client.post("/v1/traces", content=encode_spans(spans).SerializeToString(),
                       headers={"content-type": "application/x-protobuf"}).status_code == 200
    trajectory = client.get(f"/v1/trajectories/{spans[0].context.trace_id:032x}").json()
    assert trajectory["messages"] == []
    assert f"{missing} is missing" in caplog.text


def test_flattened_values_of_another_type_read_as_text() -> None:
    """A content that is an array or a number reached the trainer as it was (its chat template fails on a content that
    is no text, and the trajectory was skipped); a model name that is an array became the list's Python text."""
    flat = conversation({"gen_ai.request.model": ["gpt-4o", "x"], "gen_ai.response.model": 5,
                         "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": ["What is ", "2+3?"],
                         "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": 5})
    assert flat.input == [{"role": "user", "content": "What is 2+3?"}]
    assert flat.output == [{"role": "assistant", "content": "5"}]
    assert flat.model is None
    openinference = conversation({"openinference.span.kind": "LLM", "llm.model_name": "gpt-4o",
                                  "llm.input_messages.0.message.role": "user",
                                  "llm.input_messages.0.message.content": 2.5})
    assert (openinference.input, openinference.model) == ([{"role": "user", "content": "2.5"}], "gpt-4o")


def test_a_span_in_two_conventions_is_read_from_the_first_that_carries_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The conventions are read in the order the module lists them; one present without messages (JSON that does not
    parse, a numbered message missing) hid the conversation another one carried."""
    flat = {"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "What is 2+3?",
            "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "5"}
    expected = [{"role": "user", "content": "What is 2+3?"}], [{"role": "assistant", "content": "5"}]
    broken = conversation({"gen_ai.operation.name": "chat", "gen_ai.input.messages": "{not json", **flat})
    assert (broken.input, broken.output) == expected
    openinference = {"openinference.span.kind": "LLM", "llm.input_messages.0.message.role": "user",
                     "llm.input_messages.0.message.content": "What is 2+3?",
                     "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "6"}
    gap = {**flat, "gen_ai.prompt.2.role": "user"}
    assert conversation({**openinference, **gap}).output == [{"role": "assistant", "content": "6"}]
    caplog.clear()
    both = conversation({**openinference, **flat}, span_id="s1")
    assert (both.input, both.output) == expected
    assert "span s1: its OpenInference messages differ from its flattened gen_ai.prompt/completion ones" in caplog.text
    caplog.clear()
    conversation({**openinference, **flat, "llm.output_messages.0.message.content": "5"})
    assert "differ" not in caplog.text


def test_a_call_with_several_choices_ends_its_trajectory_with_the_first(export) -> None:
    """Each returned message of a call is one choice (a request's `n`): all of them followed the prompt as if the model
    had replied several times in a row, so the trainer re-tokenized the second as a reply to the first."""
    trajectory = export({"llm.request.type": "chat", "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
                         "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "hello",
                         "gen_ai.completion.1.role": "assistant", "gen_ai.completion.1.content": "hey"})
    assert trajectory is not None
    assert trajectory["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

# --- the app sends another instrumentation's spans of the same calls too -------------------------
#
# Attribute sets as the real instrumentations write them for an `ARTChatModel` call (recorded
# from `openinference-instrumentation-langchain` 0.1.80 and `langfuse` 5.0.4's CallbackHandler;
# tests/art_langgraph/test_coexistence.py runs both for real): the LangChain run metadata they
# copy carries `art.traced = true`.

QUESTION = [{"role": "user", "content": "hi"}]
REPLY = [{"role": "assistant", "content": "hey there!"}]


def _openinference_llm(trace: str, n: int, parent: str | None, *, marked: bool) -> SpanRecord:
    metadata = {"ls_provider": "openai", "ls_model_name": "agent@latest", "ls_model_type": "chat",
                "ls_integration": "langchain_chat_model", "langgraph_step": 1, "langgraph_node": "agent"}
    if marked:
        metadata[sc.TRACED_RUN] = True
    return SpanRecord(trace, sid(n), parent, "ARTChatModel" if marked else "ChatOpenAI", 12, 40, {
        "openinference.span.kind": "LLM",
        "input.value": json.dumps({"messages": [[{"lc": 1, "type": "constructor",
                                                  "kwargs": {"content": "hi", "type": "human"}}]]}),
        "input.mime_type": "application/json",
        "llm.input_messages.0.message.role": "user",
        "llm.input_messages.0.message.content": "hi",
        "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.content": "hey there!",
        "llm.invocation_parameters": json.dumps({"model": "agent@latest", "logprobs": True,
                                                 "_type": "art-chat" if marked else "openai-chat"}),
        "llm.provider": "openai",
        "llm.system": "openai",
        "llm.model_name": "agent@8",
        "llm.token_count.prompt": 31,
        "llm.token_count.completion": 3,
        "metadata": json.dumps(metadata),
    })


def _openinference_chain(trace: str, n: int, parent: str | None, name: str) -> SpanRecord:
    return SpanRecord(trace, sid(n), parent, name, 5, 50,
                      {"openinference.span.kind": "CHAIN", "input.value": "{}", "output.value": "{}"})


def _langfuse_generation(trace: str, n: int, parent: str | None) -> SpanRecord:
    return SpanRecord(trace, sid(n), parent, "ARTChatModel", 12, 40, {
        "langfuse.observation.type": "generation",
        "langfuse.observation.input": json.dumps(QUESTION),
        "langfuse.observation.output": json.dumps(REPLY[0]),
        "langfuse.observation.model.name": "agent@latest",
        "langfuse.observation.metadata.ls_provider": json.dumps("openai"),
        f"langfuse.observation.metadata.{sc.TRACED_RUN}": json.dumps(True),
    })


def _ours(rollout_id: str, trace: str, n: int) -> list[SpanRecord]:
    """One graph run as the plugin records it: rollout → node → llm."""
    node = SpanRecord(trace, sid(n + 1), sid(n), "node agent", 8, 45,
                      {sc.SPAN_KIND: sc.SPAN_KIND_NODE, sc.ROLLOUT_ID: rollout_id, sc.NODE_NAME: "agent"})
    call = llm(n + 2, rollout=rollout_id, trace=trace, start=11, prompt=[1, 2, 3], completion=[7, n, 9],
               messages=QUESTION, output=REPLY)
    call = replace(call, parent_span_id=node.span_id)
    return [rollout(n, rollout_id, trace=trace, task="chat", rewards={"reward": 1.0}), node, call]


def _deliver(client: TestClient, spans: list[SpanRecord], seed: int) -> None:
    """Post the spans, each twice, in a shuffled order and in exports of 1-4 spans."""
    rng = random.Random(seed)
    delivery = spans * 2
    rng.shuffle(delivery)
    while delivery:
        cut = rng.randint(1, 4)
        body = to_request(delivery[:cut]).SerializeToString()
        assert client.post("/v1/traces", content=body,
                           headers={"content-type": "application/x-protobuf"}).status_code == 200
        delivery = delivery[cut:]


@pytest.mark.parametrize("seed", range(4))
def test_foreign_spans_of_art_calls_make_no_trajectory_nor_turn(tmp_path: Path, seed: int) -> None:
    # `with rollout(...)`: OpenInference's spans are children of the rollout span (same trace).
    inside = _ours("r-inside", TRACE_A, 100)
    inside += [_openinference_chain(TRACE_A, 110, sid(100), "app"),
               _openinference_llm(TRACE_A, 111, sid(110), marked=True)]
    # A graph run outside `rollout()`: the foreign spans are a trace of their own.
    outside = _ours("r-graph", TRACE_B, 200)
    foreign_only = [_openinference_chain(TRACE_C, 300, None, "app"),
                    _openinference_llm(TRACE_C, 301, sid(300), marked=True),
                    _langfuse_generation(TRACE_D, 400, None)]
    # Control: an app that does not use `ARTChatModel` still makes a (not token-exact) trajectory.
    plain = [_openinference_chain(TRACE_E, 500, None, "app"), _openinference_llm(TRACE_E, 501, sid(500), marked=False)]
    client = TestClient(collector_app(tmp_path))
    _deliver(client, inside + outside + foreign_only + plain, seed)

    found = {t["id"]: t for t in client.get("/v1/trajectories").json()}
    assert sorted(found) == sorted(["r-inside", "r-graph", TRACE_E])
    for rollout_id, n in (("r-inside", 100), ("r-graph", 200)):
        trajectory = found[rollout_id]
        assert trajectory["token_exact"] is True
        assert [s["token_ids"] for s in trajectory["sequences"]] == [[1, 2, 3, 7, n, 9]]
        assert trajectory["messages"] == QUESTION + REPLY
        assert trajectory["complete"] is True and trajectory["rewards"] == {"reward": 1.0}
    assert found[TRACE_E]["token_exact"] is False and found[TRACE_E]["messages"] == QUESTION + REPLY


@pytest.mark.parametrize("seed", range(4))
def test_a_trace_with_an_llm_span_takes_no_foreign_turns(tmp_path: Path, seed: int) -> None:
    """A call outside any rollout, also traced by an OpenAI-client instrumentation (no run metadata)."""
    ours = llm(1, rollout=None, trace=TRACE_A, start=10, prompt=[1, 2], completion=[3], messages=QUESTION, output=REPLY)
    client_span = SpanRecord(TRACE_A, sid(2), ours.span_id, "chat agent@latest", 11, 19, {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "agent@latest",
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant",
                                               "parts": [{"type": "text", "content": "hey there!"}]}]),
    })
    client = TestClient(collector_app(tmp_path))
    _deliver(client, [ours, client_span], seed)

    (trajectory,) = client.get("/v1/trajectories").json()
    assert trajectory["id"] == TRACE_A
    assert trajectory["token_exact"] is True
    assert [s["token_ids"] for s in trajectory["sequences"]] == [[1, 2, 3]]
    assert trajectory["messages"] == QUESTION + REPLY


@pytest.mark.parametrize("order", ["foreign first", "ART first", "one export"])
def test_foreign_calls_in_a_rollouts_trace_make_no_trajectory(tmp_path: Path, order: str) -> None:
    """A tool inside a rollout calls another model through an instrumented OpenAI client: its spans, of the rollout's
    trace, made a trajectory of that trace, which a trace reward (a Langfuse score) rewarded and a trainer could train
    on, another model's text as our policy's. They are left out, in any order; the trace reward goes to the rollout."""
    ours = _ours("r1", TRACE_A, 100)
    theirs = [_openinference_chain(TRACE_A, 110, sid(101), "tool"), _openinference_llm(TRACE_A, 111, sid(110),
                                                                                       marked=False)]
    exports = {"foreign first": [theirs, ours], "ART first": [ours, theirs], "one export": [ours + theirs]}[order]
    client = TestClient(collector_app(tmp_path))
    for spans in exports:
        assert client.post("/v1/traces", content=to_request(spans).SerializeToString(),
                           headers={"content-type": "application/x-protobuf"}).status_code == 200
    assert client.post("/v1/rewards", json={"trace_id": TRACE_A, "name": "score", "value": 0.5}).status_code == 200

    (trajectory,) = client.get("/v1/trajectories").json()
    assert trajectory["id"] == "r1" and trajectory["token_exact"] is True
    assert trajectory["rewards"] == {"reward": 1.0, "score": 0.5}
    assert [group["id"] for group in client.get("/v1/groups").json()] == ["chat"]


@pytest.mark.parametrize("leased", [False, True])
def test_foreign_calls_stored_before_their_rollout_came_are_deleted_unless_leased(make_store, clock,
                                                                                    leased: bool) -> None:
    """The foreign calls came first and made a trajectory and a group; the rollout's spans delete them, in the
    rollout's first export or a later one. A group a trainer leased keeps its member, as any leased group does."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    store.add_spans([_openinference_chain(TRACE_A, 110, sid(101), "tool"),
                     _openinference_llm(TRACE_A, 111, sid(110), marked=False)])
    if leased:
        store.add_rewards([RewardIn(trace_id=TRACE_A, value=0.5)])
        clock.now += 1000  # idle past `idle_seconds`: the trace's trajectory is complete
        assert [group.id for group in store.lease(BatchRequest()).groups] == [TRACE_A]
    scoring = ScoringStore(store.engine)
    pushed = clock.now
    scoring.mark_pushed([{"trajectory_id": TRACE_A, "name": "ruler", "value": 0.5, "score_id": "s",
                          "pushed_at": pushed, "created_at": created_at(scoring, TRACE_A)}],
                        clock.now)  # its score pushed to Langfuse
    ours = _ours("r1", TRACE_A, 100)
    clock.now += 1
    store.add_spans(ours[1:])  # the rollout span comes later
    store.add_spans(ours[:1])

    assert sorted(t.id for t in store.trajectories()) == sorted(["r1", TRACE_A] if leased else ["r1"])
    # the score of a deleted trajectory is marked to delete in Langfuse, when it is deleted (not the leased one's),
    # due once Langfuse has ingested its push: `INGEST_DELAY` after the deletion
    due = [] if leased else [("s", clock.now + INGEST_DELAY)]
    assert [(row["score_id"], row["retract_at"]) for row in scoring.to_retract()] == due
    assert store.trajectory("r1").token_exact
    assert {group.id for group in store.groups()} == ({"chat", TRACE_A} if leased else {"chat"})
    assert {group.id for group in store.groups(["open", "ready", "leased"])} == {"chat"} | (
        {TRACE_A} if leased else set())


def test_a_deleted_foreign_trajectory_takes_its_scores_along(make_store, clock) -> None:
    """A judge scored the foreign calls' trajectory before the rollout came: its reward, explanation and run go with
    it, and neither its spans nor its reward come back as a trajectory's."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    scoring = ScoringStore(store.engine)
    store.add_spans([_openinference_chain(TRACE_A, 110, sid(101), "tool"),
                     _openinference_llm(TRACE_A, 111, sid(110), marked=False)])
    run = {"group_id": TRACE_A, "model": "judge", "trajectories": 1, "distinct_count": 1, "started_at": clock.now,
           "state": "running", "attempts": 0, "error": None, "finished_at": None, "next_try_at": None}
    assert scoring.claim_run(run, stale_before=0)
    scoring.save_judgements("ruler", TRACE_A, [{"trajectory_id": TRACE_A, "score": 0.3, "explanation": "meh",
                                                "block": 1, "duplicate_of": None, "created_at": clock.now}])
    store.add_rewards([RewardIn(rollout_id=TRACE_A, name="ruler", value=0.3)])
    store.add_spans(_ours("r1", TRACE_A, 100))

    assert scoring.run(TRACE_A) is None and scoring.judgements([TRACE_A]) == {TRACE_A: []}
    store.add_spans([_openinference_llm(TRACE_A, 112, sid(110), marked=False)])  # more of the tool's calls
    assert [t.id for t in store.trajectories()] == ["r1"] and len(store.curve_facts()) == 1
    # a call of ours outside the rollout, in its trace: a new trajectory of the trace id, with no reward of the old
    store.add_spans([llm(120, rollout=None, trace=TRACE_A, start=60, prompt=[1], completion=[2], messages=QUESTION,
                         output=REPLY)])
    assert store.trajectory(TRACE_A).rewards == {}


def test_a_deleted_foreign_trajectory_takes_its_spans_along_but_not_the_rollouts(make_store, clock) -> None:
    """The spans of a deleted foreign trajectory stayed in the store, read by nothing; the rollout's spans of the same
    trace (stored under the rollout id) stay."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    store.add_spans([_openinference_chain(TRACE_A, 110, sid(101), "tool"),
                     _openinference_llm(TRACE_A, 111, sid(110), marked=False)])
    store.add_spans([_openinference_chain(TRACE_B, 210, None, "tool"),
                     _openinference_llm(TRACE_B, 211, sid(210), marked=False)])  # a trace with no rollout: kept
    ours = _ours("r1", TRACE_A, 100)
    store.add_spans(ours)

    with store.engine.connect() as conn:
        stored = conn.execute(select(span_rows.c.trajectory_id, span_rows.c.span_id)).all()
    kept = [("r1", span.span_id) for span in ours] + [(TRACE_B, sid(210)), (TRACE_B, sid(211))]
    assert sorted(stored) == sorted(kept)
    assert sorted(t.id for t in store.trajectories()) == sorted(["r1", TRACE_B])
    assert store.trajectory("r1").token_exact


@pytest.mark.parametrize("order", ["ART first", "one export"])
def test_foreign_calls_that_come_with_or_after_their_rollout_leave_no_spans(make_store, clock, order: str) -> None:
    """Another instrumentation's calls in a rollout's trace that came with or after the rollout's spans made no
    trajectory, but their spans (and the tool's span before them, stored for a model call to come) stayed under the
    trace id, read by nothing. A later call of theirs is left out as well; a trace of foreign calls only keeps its."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    ours = _ours("r1", TRACE_A, 100)
    tool = _openinference_chain(TRACE_A, 110, sid(101), "tool")
    theirs = _openinference_llm(TRACE_A, 111, sid(110), marked=False)
    for spans in {"ART first": [ours, [tool], [theirs]], "one export": [ours + [tool, theirs]]}[order]:
        store.add_spans(spans)
    store.add_spans([_openinference_chain(TRACE_B, 210, None, "tool"),
                     _openinference_llm(TRACE_B, 211, sid(210), marked=False)])  # a trace with no rollout: kept
    store.add_spans([_openinference_llm(TRACE_A, 112, sid(110), marked=False)])  # more of the tool's calls

    with store.engine.connect() as conn:
        stored = conn.execute(select(span_rows.c.trajectory_id, span_rows.c.span_id)).all()
    kept = [("r1", span.span_id) for span in ours] + [(TRACE_B, sid(210)), (TRACE_B, sid(211))]
    assert sorted(stored) == sorted(kept)
    assert sorted(t.id for t in store.trajectories()) == sorted(["r1", TRACE_B]) and len(store.curve_facts()) == 2
    assert store.trajectory("r1").token_exact


@pytest.mark.parametrize("spread", ["rollout spans", "model calls"])
def test_foreign_calls_in_any_trace_of_a_rollout_spread_over_traces_stay_left_out(make_store, clock,
                                                                                    spread: str) -> None:
    """A rollout spread over two traces (a graph run resumed in a new trace): its row names one of them, the trace of
    its first rollout span, which a span of the rollout arriving later may change. A trace held another model's calls
    only as long as it was the row's: a retry of their export, after the row went back to the first trace, made a
    trajectory (and a group) of them again. Each trace that holds a span of the rollout holds it, even one of its
    model calls only."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    theirs = _openinference_llm(TRACE_B, 211, None, marked=False)
    store.add_spans([rollout(40, "r1", trace=TRACE_A, group="g", size=2),
                     llm(30, rollout="r1", trace=TRACE_A, start=1, prompt=[1], completion=[2])])
    if spread == "rollout spans":
        store.add_spans([theirs])
        store.add_spans([rollout(20, "r1", trace=TRACE_B, group="g", size=2)])  # deletes their trajectory
        store.add_spans([rollout(10, "r1", trace=TRACE_A, group="g", size=2)])  # the row's trace: back to TRACE_A
    else:
        store.add_spans([llm(50, rollout="r1", trace=TRACE_B, start=60, prompt=[1, 2, 3], completion=[4])])
    store.add_spans([theirs])  # an exporter's retry, or their first export

    assert store.trajectory("r1").trace_id == TRACE_A
    assert [t.id for t in store.trajectories()] == ["r1"]
    assert [group.id for group in store.groups()] == ["g"]
    with store.engine.connect() as conn:
        assert conn.execute(select(span_rows.c.span_id).where(span_rows.c.trajectory_id == TRACE_B)).all() == []


def _spread_rollout(store: SqlStore) -> None:
    """Rollout r1 (group "g") in TRACE_A, its row's trace: its first rollout span and a model call."""
    store.add_spans([rollout(1, "r1", trace=TRACE_A, group="g", size=2),
                     llm(3, rollout="r1", trace=TRACE_A, start=1, prompt=[1], completion=[2])])


@pytest.mark.parametrize("span", ["rollout span", "model call"])
@pytest.mark.parametrize("order", ["foreign first", "rollout's span first"])
def test_foreign_calls_in_a_later_trace_of_a_rollout_go_in_whichever_order_they_come(make_store, clock, order: str,
                                                                                      span: str) -> None:
    """A rollout spread over two traces names the first on its row (its first rollout span's). Another model's calls
    stored in the second before a span of the rollout came there stayed a trajectory, to judge and lease: the export
    of the rollout's span looked for them in the row's trace only. They are deleted then, as in the row's trace, or
    left out when they come after it."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    _spread_rollout(store)
    theirs = _openinference_llm(TRACE_B, 211, None, marked=False)
    ours = {"rollout span": rollout(20, "r1", trace=TRACE_B, group="g", size=2),
            "model call": llm(50, rollout="r1", trace=TRACE_B, start=60, prompt=[1, 2, 3], completion=[4])}[span]
    for spans in {"foreign first": [[theirs], [ours]], "rollout's span first": [[ours], [theirs]]}[order]:
        store.add_spans(spans)

    assert store.trajectory("r1").trace_id == TRACE_A
    assert [t.id for t in store.trajectories()] == ["r1"]
    assert [group.id for group in store.groups()] == ["g"]
    with store.engine.connect() as conn:
        assert conn.execute(select(span_rows.c.span_id).where(span_rows.c.trajectory_id == TRACE_B)).all() == []


def test_describes_art_call_reads_each_convention() -> None:
    assert describes_art_call(_openinference_llm(TRACE_A, 1, None, marked=True).attributes)
    assert not describes_art_call(_openinference_llm(TRACE_A, 1, None, marked=False).attributes)
    assert describes_art_call(_langfuse_generation(TRACE_A, 1, None).attributes)
    assert not describes_art_call({"metadata": "not json", f"langfuse.observation.metadata.{sc.TRACED_RUN}": "false"})
    assert not describes_art_call({"metadata": json.dumps({sc.TRACED_RUN: "yes"})})


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_read_sees_one_snapshot_while_an_export_deletes_a_trajectory_it_lists(
    make_store, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read listed the foreign calls' trajectory, then the rollout of its trace came and deleted it with its spans
    before the read got to them: every statement saw the last commit, and the read failed ("has no spans", a 500)."""
    store = make_store(min_group_size=1)
    store.add_spans([_openinference_llm(TRACE_A, 111, None, marked=False)])
    real_spans, came = store_reads.spans_by_trajectory, []

    def the_rollout_comes_meanwhile(conn: Any, trajectory_ids: list[str]) -> dict[str, list[SpanRecord]]:
        if not came:
            came.append(threading.Thread(target=store.add_spans, args=(_ours("r1", TRACE_A, 100),)))
            came[0].start()
            came[0].join(timeout=30)
        return real_spans(conn, trajectory_ids)

    monkeypatch.setattr(store_reads, "spans_by_trajectory", the_rollout_comes_meanwhile)
    assert [t.id for t in store.trajectories()] == [TRACE_A]  # as it was when the read began
    monkeypatch.undo()
    assert not came[0].is_alive() and [t.id for t in store.trajectories()] == ["r1"]


def _lease_foreign_group(store: SqlStore, clock: Clock, members: int) -> Batch:
    """Store `members` traces (TRACE_A, then TRACE_B) of foreign calls in group `g`, rewarded, complete them and lease
    `g` for 10 s; returns the batch."""
    for n, trace in enumerate((TRACE_A, TRACE_B)[:members]):
        call = _openinference_llm(trace, 111 + 10 * n, None, marked=False)
        store.add_spans([replace(call, attributes=call.attributes | {sc.GROUP: "g"})])
        store.add_rewards([RewardIn(trace_id=trace, value=0.5)])
    clock.now += 1000  # idle past `idle_seconds`: the traces' trajectories are complete
    batch = store.lease(BatchRequest(lease_seconds=10))
    assert [group.id for group in batch.groups] == ["g"]
    return batch


@pytest.mark.parametrize("members", [1, 2])
def test_a_late_ack_conflicts_when_a_member_was_deleted_since(make_store, clock, members: int) -> None:
    """The lease of a group expired; the rollout's spans then came and deleted a member made of foreign calls in its
    trace. The late ack looked only at the members left, found them as leased and marked the group trained: the
    trainer's update came from a trajectory the pool no longer has (another model's calls)."""
    store = make_store(min_group_size=members, keep_zero_spread=True)
    batch = _lease_foreign_group(store, clock, members)
    clock.now += 11
    assert [group.state for group in store.groups()] == ["ready"]  # the lease expired: back in the pool
    store.add_spans(_ours("r1", TRACE_A, 100))
    assert TRACE_A not in {t.id for t in store.trajectories()}
    with pytest.raises(Conflict, match="groups g changed in the pool") as raised:
        store.ack(batch.id, policy_step=1)
    assert raised.value.code == "lease_expired"
    states = {group.id: group.state for group in store.groups()}
    assert states.get("g") == ("open" if members == 2 else None)  # the member left waits for a second one


@pytest.mark.parametrize("end", ["released", "expired"])
@pytest.mark.parametrize("members", [1, 2])
def test_foreign_calls_kept_while_leased_are_deleted_when_their_group_returns_to_the_pool(
    make_store, clock, members: int, end: str
) -> None:
    """The rollout's spans came while the group of the foreign calls in its trace was leased, which kept them; the
    release (or expiry) of the lease put the group back in the pool, and the next lease took those calls again as a
    sample of our policy. They are deleted when the group returns, as placement deletes them: a group left empty is
    skipped, one with a member left waits for another."""
    store = make_store(min_group_size=members, keep_zero_spread=True)
    batch = _lease_foreign_group(store, clock, members)
    clock.now += 1
    store.add_spans(_ours("r1", TRACE_A, 100))
    assert TRACE_A in {t.id for t in store.trajectories()}  # kept: its group is leased

    if end == "released":
        answer = store.release(batch.id, ReleaseRequest(reason="vLLM down", failed=False))
        assert (answer.returned, answer.skipped) == ([] if members == 1 else ["g"], [])  # emptied: "returned" too
    else:
        clock.now += 10
    assert sorted(t.id for t in store.trajectories()) == sorted(["r1", TRACE_B][:members])
    with store.engine.connect() as conn:  # its spans went with it, not the rollout's
        assert TRACE_A not in set(conn.execute(select(span_rows.c.trajectory_id)).scalars())
    with store.engine.connect() as conn:
        query = select(group_rows.c.state, group_rows.c.reason).where(group_rows.c.id == "g")
        state, reason = conn.execute(query).one()
    assert state == ("skipped" if members == 1 else "open")
    assert (FOREIGN_IN_ROLLOUT in reason) if members == 1 else reason is None
    leased = store.lease(BatchRequest(max_groups=8)).groups
    # with 2 members: "g" and "chat" wait for a second member each
    assert [(group.id, [t.id for t in group.trajectories]) for group in leased] == [("chat", ["r1"])][:2 - members]


def _returning_paused(
    store: Any, clock: Any, monkeypatch: pytest.MonkeyPatch, end: str
) -> tuple[threading.Event, threading.Thread]:
    """Foreign calls of group "g" kept while it was leased (their rollout came then), and the release (or expiry) of
    the lease under way in a thread, paused once it deleted them, before it commits: set the event to go on."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: nothing runs beside the return")
    call = _openinference_llm(TRACE_A, 111, None, marked=False)
    store.add_spans([replace(call, attributes=call.attributes | {sc.GROUP: "g"})])
    store.add_rewards([RewardIn(trace_id=TRACE_A, value=0.5)])
    clock.now += 1000  # idle past `idle_seconds`: the trace's trajectory is complete
    batch = store.lease(BatchRequest(lease_seconds=10))
    clock.now += 1
    store.add_spans(_ours("r1", TRACE_A, 100))
    deleted, resume = pause_after(monkeypatch, foreign_deletion, "forget_deferred_foreign")
    if end == "released":
        giving_back = threading.Thread(target=store.release, args=(batch.id, ReleaseRequest(reason="x", failed=False)))
    else:
        clock.now += 10
        giving_back = threading.Thread(target=store.groups)  # a read returns the expired lease first
    giving_back.start()
    assert deleted.wait(WAIT)
    return resume, giving_back


def _our_call_outside_the_rollout() -> SpanRecord:
    return llm(120, rollout=None, trace=TRACE_A, start=60, prompt=[1], completion=[2], messages=QUESTION, output=REPLY)


@pytest.mark.parametrize("end", ["released", "expired"])
def test_an_export_of_the_trace_waits_for_the_return_that_deletes_its_foreign_calls(
    make_store, clock, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """A call of ours outside the rollout, in the trace of foreign calls kept while their group was leased, came as the
    release (or expiry) that deletes them ran: the export read their row, waited for the group's row, then updated the
    deleted row, and the call made no trajectory. The return holds the locks of the export, which reads after it."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    resume, giving_back = _returning_paused(store, clock, monkeypatch, end)
    exporting = threading.Thread(target=store.add_spans, args=([_our_call_outside_the_rollout()],))
    exporting.start()
    lock_waited_for(store.engine)
    resume.set()
    giving_back.join(WAIT)
    exporting.join(WAIT)

    assert sorted(t.id for t in store.trajectories()) == sorted(["r1", TRACE_A])
    mine = store.trajectory(TRACE_A)
    assert mine is not None and mine.token_exact and mine.messages == QUESTION + REPLY


class _OneScore:
    """A judge client that scores a single block 0.7."""

    def complete(self, messages: list[dict[str, Any]], fmt: dict[str, Any], *, temperature: float,
                 max_tokens: int) -> str:
        return json.dumps({"scores": {"1": {"explanation": "fine", "score": 0.7}}})

    def close(self) -> None:
        """Nothing to release."""


def test_a_judges_scores_wait_for_the_release_that_deletes_the_member_they_score(
    make_store, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge scored the foreign calls kept in a leased group as the release that deletes them ran: its stale check
    took the export's locks, which the release did not hold, and read the member still there; the scores were stored
    for the deleted id, and a later trajectory of that id took the judge's reward as its own. (An expiry holds the same
    locks; here the judge's own reads would return the expired lease and wait for the paused one.)"""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    resume, giving_back = _returning_paused(store, clock, monkeypatch, "released")
    judge = GroupJudge(store, ScoringStore(store.engine), JudgeSettings(), client=_OneScore(), clock=clock)
    store_rewards = store.add_rewards

    def waited_for(*args: Any, **kwargs: Any) -> Any:
        def resume_once_waited_for() -> None:
            lock_waited_for(store.engine)
            resume.set()

        threading.Thread(target=resume_once_waited_for, daemon=True).start()
        return store_rewards(*args, **kwargs)

    monkeypatch.setattr(store, "add_rewards", waited_for)
    run = judge.judge("g")
    giving_back.join(WAIT)
    monkeypatch.undo()

    assert run.state == "failed" and run.error.startswith("judge_stale")
    store.add_spans([_our_call_outside_the_rollout()])
    assert "ruler" not in store.trajectory(TRACE_A).rewards


def test_idle_completion_and_a_deletion_of_foreign_calls_lock_a_group_and_its_members_in_one_order(
    make_store, clock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The rollout's export held the row of the foreign calls' group and was about to delete them and date the members
    left; upkeep beside it completed the idle members first, then waited for the group's row to expire it as stale.
    Each waited for the other: PostgreSQL aborted one as a deadlock, retried. Upkeep locks a group before its members,
    as the export does."""
    store = make_store(min_group_size=3, group_timeout_seconds=500)
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: nothing runs beside the export")
    for n, trace in enumerate((TRACE_A, TRACE_B)):
        call = _openinference_llm(trace, 111 + 10 * n, None, marked=False)
        store.add_spans([replace(call, attributes=call.attributes | {sc.GROUP: "g"})])
    clock.now += 1000  # both members idle, their group stale
    holding, resume = threading.Event(), threading.Event()
    forget = foreign_deletion._forget_trajectories

    def paused(*args: Any, **kwargs: Any) -> None:
        if not holding.is_set():  # the first try only: a retry goes on
            holding.set()
            assert resume.wait(WAIT)
        forget(*args, **kwargs)

    monkeypatch.setattr(foreign_deletion, "_forget_trajectories", paused)
    exporting = threading.Thread(target=store.add_spans, args=(_ours("r1", TRACE_A, 100),))
    exporting.start()
    assert holding.wait(WAIT)
    reading = threading.Thread(target=store.groups)  # its upkeep first
    reading.start()
    lock_waited_for(store.engine)
    resume.set()
    exporting.join(WAIT)
    reading.join(WAIT)

    assert "deadlock" not in caplog.text
    assert sorted(t.id for t in store.trajectories()) == sorted(["r1", TRACE_B])


def test_a_deletion_of_foreign_calls_dates_the_members_left_in_the_order_the_curves_steps_are_saved(
    make_store, caplog: pytest.LogCaptureFixture
) -> None:
    """The save of the reward curve's policy steps (`PolicySteps.save`, in id order) held the row of member B and was
    to update C's; the rollout's export deleted the foreign calls of their group and dated the members left in the
    table's order: it took C (first in the table), then waited for B. Once the save went on to C, each waited for the
    other: PostgreSQL aborted one as a deadlock. Both lock trajectories in id order."""
    store = make_store(min_group_size=3)
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: nothing runs beside the export")
    for n, trace in enumerate((TRACE_C, TRACE_B, TRACE_A)):  # C's row is the first in the table
        call = _openinference_llm(trace, 111 + 10 * n, None, marked=False)
        store.add_spans([replace(call, attributes=call.attributes | {sc.GROUP: "g"})])
    added = beside_a_save(store.engine, [TRACE_B, TRACE_C], lambda: store.add_spans(_ours("r1", TRACE_A, 100)))

    assert added == 3 and "deadlock" not in caplog.text
    assert sorted(t.id for t in store.trajectories(group="g")) == [TRACE_B, TRACE_C]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_export_locks_the_open_instances_of_several_keys_in_byte_order_whatever_the_collation(make_store) -> None:
    """An export locks the open instances of its keys in its one pass over its groups (`pool.lock_groups`), in their
    bytes' order (`rows.BYTE_ORDER`, Python's sort) as every other lock of several groups, not in the database's
    collation: where the two differ ("B" < "a" by bytes, not by a linguistic collation), two exports could each wait
    for a group the other held. Here one holds "a": the export took "B" before it waits for "a"."""
    store = make_store(min_group_size=1)

    def call(n: int, key: str) -> list[SpanRecord]:
        trace = f"{n:032x}"
        return [rollout(10 * n + 1, f"r{n}", trace=trace, group=key),
                llm(10 * n + 2, rollout=f"r{n}", trace=trace, start=1, prompt=[1], completion=[2])]

    for n, key in enumerate(("a", "B"), start=1):
        store.add_spans(call(n, key))
    with store.engine.begin() as conn:  # a linguistic collation: "a" < "B"
        for table, column in (("batch_groups", "group_id"), ("groups", "id")):
            conn.execute(text(f'ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar(300) COLLATE "und-x-icu"'))
    with store.engine.connect() as holder, ThreadPoolExecutor(1) as executor:
        holder.execute(select(group_rows.c.id).where(group_rows.c.id == "a").with_for_update())
        added = executor.submit(store.add_spans, call(3, "a") + call(4, "B"))
        assert lock_waited_for(store.engine)
        with store.engine.connect() as probe:
            locked = probe.execute(text("SELECT id FROM groups WHERE id = 'B' FOR UPDATE SKIP LOCKED")).all() == []
        holder.rollback()
        assert added.result(WAIT) == 4
    assert locked
    assert [(t.id, t.group_id) for t in store.trajectories()] == [("r1", "a"), ("r2", "B"), ("r3", "a"), ("r4", "B")]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_export_locks_the_group_of_foreign_calls_in_a_later_trace_of_its_rollout_in_its_one_pass(
    make_store,
) -> None:
    """The export of a rollout's span to another trace than its row's deletes the foreign calls stored there: their
    group is locked in the export's one pass over its groups, in id order (`placement.groups_changed`), not after the
    others (the rollout's "g"), which a reward locking both in id order waits for in a cycle. Here one holds the
    foreign calls' group (its id before "g"): the export waits for it before it takes "g"."""
    store = make_store(min_group_size=1, keep_zero_spread=True)
    _spread_rollout(store)
    store.add_spans([_openinference_llm(TRACE_B, 211, None, marked=False)])
    assert store.trajectory(TRACE_B).group_id == TRACE_B < "g"
    with store.engine.connect() as holder, ThreadPoolExecutor(1) as executor:
        holder.execute(select(group_rows.c.id).where(group_rows.c.id == TRACE_B).with_for_update())
        added = executor.submit(store.add_spans, [rollout(20, "r1", trace=TRACE_B, group="g", size=2)])
        assert lock_waited_for(store.engine)
        with store.engine.connect() as probe:
            free = probe.execute(text("SELECT id FROM groups WHERE id = 'g' FOR UPDATE SKIP LOCKED")).all() != []
        holder.rollback()
        assert added.result(WAIT) == 1
    assert free
    assert [t.id for t in store.trajectories()] == ["r1"]
