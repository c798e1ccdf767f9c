"""`ARTChatModel`: token ids on messages and in spans, every call style, errors."""

from __future__ import annotations

import json

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.globals import set_llm_cache
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_core.outputs import ChatResult
from langchain_core.tools import tool
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pydantic import BaseModel, ValidationError

from art_langgraph import ARTChatModel, UnsupportedOption, semconv
from art_langgraph._token_data import policy_step
from tests.art_langgraph.fake_engine import FakeEngine


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
    (span,) = llm_spans(spans)
    assert_matches(span, art)
    attrs = span.attributes
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == "chat"
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == served_model
    # The trainer answers with the model that served the call (a checkpoint or the base).
    assert attrs[semconv.GEN_AI_RESPONSE_MODEL] == msg.response_metadata["model_name"]
    assert art["policy_step"] == policy_step(msg.response_metadata["model_name"])
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
    assert art["policy_step"] == policy_step(total.response_metadata["model_name"])
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

    msg = chat_model.bind_tools([add], tool_choice="none").invoke("What is 2+3?")
    assert msg.response_metadata["art"]["completion_token_ids"]
    assert msg.tool_calls == []
    (span,) = llm_spans(spans)
    (tool_def,) = json.loads(span.attributes[semconv.GEN_AI_TOOL_DEFINITIONS])
    assert tool_def["function"]["name"] == "add"


def test_with_structured_output_uses_guided_decoding(chat_model: ARTChatModel, spans) -> None:
    """The default method (`json_schema`) becomes vLLM guided decoding: the reply always parses."""

    class Answer(BaseModel):
        answer: int

    structured = chat_model.model_copy(update={"max_tokens": 24}).with_structured_output(Answer, include_raw=True)
    out = structured.invoke("What is 2+3?")
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], Answer)
    (span,) = llm_spans(spans)
    assert_matches(span, out["raw"].response_metadata["art"])


def test_with_structured_output_function_calling_is_a_strict_guided_tool_call(chat_model: ARTChatModel, spans) -> None:
    """`function_calling` forces a tool call; `strict` (the default here) makes vLLM guide its arguments.

    vLLM 0.32 constrains only the call's envelope of a non-strict tool: the model then writes
    arguments that do not parse (a JSON-schema-like blob, cut at `max_tokens`).
    """

    class Answer(BaseModel):
        answer: int

    structured = chat_model.model_copy(update={"max_tokens": 64, "temperature": 0.0}).with_structured_output(
        Answer, method="function_calling", include_raw=True
    )
    out = structured.invoke("What is 2+3?")
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], Answer)
    (call,) = out["raw"].tool_calls
    assert call["name"] == "Answer" and call["args"] == out["parsed"].model_dump()
    (span,) = llm_spans(spans)
    (tool_def,) = json.loads(span.attributes[semconv.GEN_AI_TOOL_DEFINITIONS])
    assert tool_def["function"]["strict"] is True
    assert_matches(span, out["raw"].response_metadata["art"])


def test_with_structured_output_keeps_an_explicit_strict(chat_model: ARTChatModel) -> None:
    class Answer(BaseModel):
        answer: int

    for strict in (False, True):
        bound = chat_model.with_structured_output(Answer, method="function_calling", strict=strict).first
        (tool_def,) = bound.kwargs["tools"]
        assert tool_def["function"].get("strict", False) is strict


def test_n_greater_than_one_gives_one_span_per_choice(chat_model: ARTChatModel, spans) -> None:
    result = chat_model.model_copy(update={"n": 3, "max_tokens": 4}).generate([[HumanMessage("Say a word.")]])
    generations = result.generations[0]
    assert len(generations) == 3
    got = llm_spans(spans)
    assert len(got) == 3
    by_ids = {tuple(s.attributes[semconv.COMPLETION_TOKEN_IDS]): s for s in got}
    prompts = {tuple(s.attributes[semconv.PROMPT_TOKEN_IDS]) for s in got}
    assert len(prompts) == 1  # the same prompt, three samples
    for g in generations:
        assert_matches(by_ids[tuple(g.message.response_metadata["art"]["completion_token_ids"])],
                       g.message.response_metadata["art"])


def test_timeout_marks_span_and_raises(openai_url: str, served_model: str, spans) -> None:
    import openai

    slow = ARTChatModel(model=served_model, base_url=openai_url, timeout=0.001, max_retries=0, max_tokens=200)
    with pytest.raises(openai.APITimeoutError):
        slow.invoke("Write a long story.")
    (span,) = llm_spans(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert "Timeout" in span.status.description


def test_with_retry_records_every_attempt(spans, served_model, dead_url) -> None:
    import openai

    model = ARTChatModel(model=served_model, base_url=f"{dead_url}/v1", max_retries=1, timeout=2)
    retrying = model.with_retry(stop_after_attempt=3, wait_exponential_jitter=False)
    with pytest.raises(openai.APIConnectionError):
        retrying.invoke("hi")
    got = llm_spans(spans)
    assert len(got) == 3  # the client's own retry (max_retries=1) stays inside one span
    assert all(s.status.status_code is StatusCode.ERROR for s in got)


def test_error_marks_span_and_reraises(spans, served_model, dead_url) -> None:
    model = ARTChatModel(model=served_model, base_url=f"{dead_url}/v1", max_retries=0)
    with pytest.raises(Exception, match="Connection"):
        model.invoke("hi")
    (span,) = llm_spans(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert semconv.COMPLETION_TOKEN_IDS not in span.attributes


@pytest.mark.parametrize(
    ("name", "step"), [("agent@12", 12), ("agent@latest", 0), ("agent", 0), (None, 0), ("a@b@3", 3), ("agent@²", 0),
     ("agent@١٢", 0)]
)
def test_policy_step(name: str | None, step: int) -> None:
    assert policy_step(name) == step


def test_tool_call_arguments_that_are_not_an_object_become_invalid_tool_calls() -> None:
    """A sampled `{"name": "calculator", "arguments": [253]}` must not end the graph run."""
    model = ARTChatModel(model="agent@latest", base_url="http://127.0.0.1:9/v1", api_key="EMPTY")
    good = {"id": "call-1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}
    bad = {"id": "call-2", "type": "function", "function": {"name": "calculator", "arguments": "[253]"}}
    response = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "agent@3",
        "prompt_token_ids": [1, 2],
        "choices": [
            {"index": 0, "finish_reason": "tool_calls", "token_ids": [5, 6],
             "message": {"role": "assistant", "content": None, "tool_calls": [good, bad]}},
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    }

    (generation,) = model._create_chat_result(response).generations
    message = generation.message

    assert [call["args"] for call in message.tool_calls] == [{"expression": "2*3"}]
    (invalid,) = message.invalid_tool_calls
    assert (invalid["name"], invalid["args"], invalid["id"]) == ("calculator", "[253]", "call-2")
    assert "not an object" in invalid["error"]
    art = message.response_metadata["art"]
    assert art["completion_token_ids"] == [5, 6] and art["prompt_token_ids"] == [1, 2]


def _one_tool_call_result(arguments: object) -> ChatResult:
    """`ARTChatModel`'s result for a response whose one choice calls `ping` with `arguments`."""
    model = ARTChatModel(model="agent@latest", base_url="http://127.0.0.1:9/v1", api_key="EMPTY")
    call = {"id": "call-1", "type": "function", "function": {"name": "ping", "arguments": arguments}}
    return model._create_chat_result({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "agent@3",
        "choices": [{"index": 0, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
    })


@pytest.mark.parametrize("arguments", ["null", "[]", "0", "false"])
def test_tool_call_arguments_chat_openai_reads_as_empty_stay_a_tool_call(arguments: str) -> None:
    """Falsy JSON arguments are `{}` to `ChatOpenAI` (a tool without parameters): the same call here."""
    (generation,) = _one_tool_call_result(arguments).generations

    assert [(c["name"], c["args"]) for c in generation.message.tool_calls] == [("ping", {})]
    assert generation.message.invalid_tool_calls == []


def test_tool_call_arguments_that_are_no_string_fail_as_in_chat_openai() -> None:
    """Arguments sent as an object, not a JSON string: `ChatOpenAI`'s `ValidationError`, not a `TypeError` of ours."""
    with pytest.raises(ValidationError, match="invalid_tool_calls"):
        _one_tool_call_result({"a": 1})


@pytest.mark.asyncio(loop_scope="session")
async def test_a_global_llm_cache_does_not_answer_for_the_model(spans) -> None:
    """An app that sets LangChain's global cache (for its other models) made every repeated prompt a cache hit: the
    engine sampled nothing, the call recorded no span (its rollout had no turn), and every rollout of a group got the
    same reply."""
    engine = FakeEngine()
    model = engine.chat_model()
    set_llm_cache(InMemoryCache())
    try:
        model.invoke("hi")
        model.invoke("hi")
        await model.ainvoke("hi")
    finally:
        set_llm_cache(None)
    assert len(engine.requests) == 3
    assert len(llm_spans(spans)) == 3


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ({"cache": True}, "cache"),  # a cached reply samples nothing: a call that silently records no turn
        ({"cache": InMemoryCache()}, "cache"),
        ({"use_responses_api": True}, "use_responses_api=True"),
        ({"logprobs": False}, "logprobs=False"),
        ({"model_kwargs": {"logprobs": False}}, "logprobs=False"),  # ChatOpenAI moves it to the field, and warns
        ({"model_kwargs": {"use_responses_api": True}}, "use_responses_api=True"),
        ({"model_kwargs": {"cache": True}}, "cache"),
    ],
)
def test_a_refused_option_raises_unsupported_option_from_the_constructor(option: dict, needle: str) -> None:
    """`ARTChatModel(cache=True)` raised pydantic's `ValidationError`, the refusal inside it, which the
    `except UnsupportedOption` the README documents did not catch (`init_chat_model` raised `UnsupportedOption`
    itself). A model built from a dict (`model_validate`) is refused the pydantic way, with the same message."""
    with pytest.raises(UnsupportedOption, match=rf"^\[unsupported_option\] {needle}\. Hint: ") as raised:
        ARTChatModel(model="agent@latest", base_url="http://127.0.0.1:9/v1", api_key="EMPTY", **option)
    assert raised.value.code == "unsupported_option"
    with pytest.raises(ValidationError, match=rf"\[unsupported_option\] {needle}\. Hint: "):
        ARTChatModel.model_validate({"model": "agent@latest", **option})
