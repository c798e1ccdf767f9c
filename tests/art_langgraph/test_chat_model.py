"""`ARTChatModel`: token ids on messages and in spans, every call style, errors."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.tools import tool
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pydantic import BaseModel

from art_langgraph import ARTChatModel, init_chat_model, semconv
from art_langgraph._token_data import policy_step


def llm_spans(spans: InMemorySpanExporter) -> list:
    return [s for s in spans.get_finished_spans() if s.attributes[semconv.SPAN_KIND] == semconv.SPAN_KIND_LLM]


def assert_matches(span, art: dict) -> None:
    """The span carries exactly the message's token data."""
    assert list(span.attributes[semconv.PROMPT_TOKEN_IDS]) == art["prompt_token_ids"]
    assert list(span.attributes[semconv.COMPLETION_TOKEN_IDS]) == art["completion_token_ids"]
    assert list(span.attributes[semconv.COMPLETION_LOGPROBS]) == art["logprobs"]
    assert span.attributes[semconv.POLICY_STEP] == art["policy_step"]


def test_invoke_records_token_ids_on_message_and_span(chat_model: ARTChatModel, spans, served_model) -> None:
    msg = chat_model.invoke("Say hi.")
    art = msg.response_metadata["art"]
    assert art["prompt_token_ids"] and art["completion_token_ids"]
    assert len(art["logprobs"]) == len(art["completion_token_ids"])
    assert all(lp <= 0.0 for lp in art["logprobs"])
    assert art["policy_step"] == 0
    (span,) = llm_spans(spans)
    assert_matches(span, art)
    attrs = span.attributes
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == "chat"
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == served_model
    assert attrs[semconv.GEN_AI_RESPONSE_MODEL] == served_model
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == len(art["prompt_token_ids"])
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == len(art["completion_token_ids"])
    assert json.loads(attrs[semconv.GEN_AI_INPUT_MESSAGES]) == [{"role": "user", "content": "Say hi."}]
    (out,) = json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert out == {"role": "assistant", "content": msg.content}
    assert semconv.ROLLOUT_ID not in attrs  # outside any rollout


@pytest.mark.asyncio(loop_scope="session")
async def test_ainvoke_and_batch(chat_model: ARTChatModel, spans) -> None:
    msg = await chat_model.ainvoke("One word.")
    msgs = chat_model.batch(["A.", "B."])
    got = llm_spans(spans)
    assert len(got) == 3
    by_ids = {tuple(s.attributes[semconv.COMPLETION_TOKEN_IDS]): s for s in got}
    for m in [msg, *msgs]:
        assert_matches(by_ids[tuple(m.response_metadata["art"]["completion_token_ids"])], m.response_metadata["art"])


def test_stream_gathers_token_ids_across_chunks(chat_model: ARTChatModel, spans) -> None:
    chunks = list(chat_model.stream("Count to five."))
    assert len(chunks) > 2
    total: AIMessageChunk = chunks[0]
    for c in chunks[1:]:
        total = total + c
    art = total.response_metadata["art"]
    assert len(art["completion_token_ids"]) == len(art["logprobs"]) == total.usage_metadata["output_tokens"]
    assert len(art["prompt_token_ids"]) == total.usage_metadata["input_tokens"]
    assert art["policy_step"] == 0
    (span,) = llm_spans(spans)
    assert_matches(span, art)
    assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == total.content


@pytest.mark.asyncio(loop_scope="session")
async def test_astream_gathers_token_ids(chat_model: ARTChatModel, spans) -> None:
    total = None
    async for c in chat_model.astream("Name a color."):
        total = c if total is None else total + c
    art = total.response_metadata["art"]
    assert art["completion_token_ids"] and len(art["completion_token_ids"]) == len(art["logprobs"])
    (span,) = llm_spans(spans)
    assert_matches(span, art)


def test_bind_tools_records_tool_definitions(chat_model: ARTChatModel, spans) -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    # The test server has no tool parser, so "auto" is refused; "none" still sends the tools.
    msg = chat_model.bind_tools([add], tool_choice="none").invoke("What is 2+3?")
    assert msg.response_metadata["art"]["completion_token_ids"]
    (span,) = llm_spans(spans)
    (tool_def,) = json.loads(span.attributes[semconv.GEN_AI_TOOL_DEFINITIONS])
    assert tool_def["function"]["name"] == "add"


def test_with_structured_output_keeps_working(chat_model: ARTChatModel, spans) -> None:
    class Answer(BaseModel):
        answer: int

    out = chat_model.with_structured_output(Answer, include_raw=True).invoke("What is 2+3? Reply in JSON.")
    assert isinstance(out["parsed"], Answer)
    (span,) = llm_spans(spans)
    assert_matches(span, out["raw"].response_metadata["art"])


def test_error_marks_span_and_reraises(spans, served_model, dead_url) -> None:
    model = ARTChatModel(model=served_model, base_url=f"{dead_url}/v1", max_retries=0)
    with pytest.raises(Exception, match="Connection"):
        model.invoke("hi")
    (span,) = llm_spans(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert semconv.COMPLETION_TOKEN_IDS not in span.attributes


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
    with pytest.raises(ValueError, match="model_provider"):
        init_chat_model("x", model_provider="anthropic")


@pytest.mark.parametrize(
    ("name", "step"), [("agent@12", 12), ("agent@latest", 0), ("agent", 0), (None, 0), ("a@b@3", 3)]
)
def test_policy_step(name: str | None, step: int) -> None:
    assert policy_step(name) == step
