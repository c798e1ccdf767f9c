"""`ARTChatModel` inside prebuilt agents and custom graphs, against the real trainer and vLLM.

Tool calls are parsed by vLLM's `hermes` tool parser from the bundled tool-aware chat template;
the model is steered to the call with guided decoding (see `steering.steer`).
"""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from art_langgraph import ARTChatModel, chat_node, semconv
from tests.art_langgraph.span_reading import spans_of
from tests.art_langgraph.steering import ADD_CALL, FINAL_ANSWER, STEERED_MAX_TOKENS, has_tool_result, steer


def assert_exact(message: AIMessage) -> None:
    art = message.response_metadata["art"]
    assert art["prompt_token_ids"] and art["completion_token_ids"]
    assert len(art["completion_token_ids"]) == len(art["logprobs"]) == message.usage_metadata["output_tokens"]
    assert len(art["prompt_token_ids"]) == message.usage_metadata["input_tokens"]


def test_bind_tools_auto_is_parsed_by_vllm(chat_model: ARTChatModel, add_tool, spans) -> None:
    msg = chat_model.bind_tools([add_tool], max_tokens=STEERED_MAX_TOKENS,
                                **steer(ADD_CALL)).invoke("What is 3+4? Use add.")
    assert msg.tool_calls == [{"name": "add", "args": {"a": 3, "b": 4}, "id": msg.tool_calls[0]["id"],
                               "type": "tool_call"}]
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    assert_exact(msg)
    (span,) = spans_of(spans, semconv.SPAN_KIND_LLM)
    (out,) = json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert out["tool_calls"][0]["function"]["name"] == "add"
    assert list(span.attributes[semconv.COMPLETION_TOKEN_IDS]) == msg.response_metadata["art"]["completion_token_ids"]


def test_template_renders_tool_turns_as_the_model_wrote_them(chat_model: ARTChatModel, add_tool, spans) -> None:
    """Turn 2's prompt holds turn 1's prompt token for token, then turn 1's call as text."""
    from transformers import AutoTokenizer

    from trainer_service.base_model import BUNDLED_MODEL, resolve_base_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(BUNDLED_MODEL))
    llm = chat_model.bind_tools([add_tool], max_tokens=STEERED_MAX_TOKENS)
    question = HumanMessage("What is 3+4? Use add.")
    first = llm.bind(**steer(ADD_CALL)).invoke([question])
    result = ToolMessage("7", tool_call_id=first.tool_calls[0]["id"])
    second = llm.bind(**steer(FINAL_ANSWER)).invoke([question, first, result])
    assert second.content == "The answer is 7."
    one, two = first.response_metadata["art"], second.response_metadata["art"]
    n = len(one["prompt_token_ids"])
    assert two["prompt_token_ids"][:n] == one["prompt_token_ids"]
    written = tokenizer.decode(one["completion_token_ids"])
    assert written.endswith("</tool_call><|im_end|>")
    rendered = tokenizer.decode(two["prompt_token_ids"][n:])
    assert rendered.startswith(written + "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>")
    # Token ids may still differ: guided decoding can sample a non-canonical split of the same
    # text (`<`, `tool`, `_`, ...), which re-tokenizing the history does not reproduce. The
    # collector then keeps the two turns as two exact sequences instead of merging them.


def test_create_react_agent(chat_model: ARTChatModel, add_tool, spans) -> None:
    from langgraph.prebuilt import create_react_agent

    def model(state, runtime):  # type: ignore[no-untyped-def]
        regex = FINAL_ANSWER if has_tool_result(state["messages"]) else ADD_CALL
        return chat_model.bind_tools([add_tool], max_tokens=STEERED_MAX_TOKENS, **steer(regex))

    agent = create_react_agent(model, [add_tool])
    out = agent.invoke({"messages": [("user", "What is 3+4?")]})
    kinds = [m.type for m in out["messages"]]
    assert kinds == ["human", "ai", "tool", "ai"]
    assert out["messages"][2].content == "7"
    assert out["messages"][3].content == "The answer is 7."
    for m in (out["messages"][1], out["messages"][3]):
        assert_exact(m)
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    (tool_span,) = spans_of(spans, semconv.SPAN_KIND_TOOL)
    assert tool_span.attributes[semconv.GEN_AI_TOOL_NAME] == "add"
    assert tool_span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "7"
    assert len(spans_of(spans, semconv.SPAN_KIND_LLM)) == 2
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {root.context.trace_id}


@pytest.mark.asyncio(loop_scope="session")
async def test_langchain_create_agent(chat_model: ARTChatModel, add_tool, spans) -> None:
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call

    @wrap_model_call
    async def steering(request, handler):  # type: ignore[no-untyped-def]
        regex = FINAL_ANSWER if has_tool_result(request.messages) else ADD_CALL
        settings = {**request.model_settings, "max_tokens": STEERED_MAX_TOKENS, **steer(regex)}
        return await handler(request.override(model_settings=settings))

    agent = create_agent(chat_model, [add_tool], middleware=[steering])
    out = await agent.ainvoke({"messages": [HumanMessage("What is 3+4?")]})
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool", "ai"]
    assert out["messages"][-1].content == "The answer is 7."
    assert len(spans_of(spans, semconv.SPAN_KIND_LLM)) == 2
    assert len(spans_of(spans, semconv.SPAN_KIND_ROLLOUT)) == 1


@pytest.mark.asyncio(loop_scope="session")
async def test_chat_node_with_tool_node(chat_model: ARTChatModel, add_tool, spans) -> None:
    builder = StateGraph(MessagesState)
    steered = chat_model.bind(max_tokens=STEERED_MAX_TOKENS, **steer(ADD_CALL))
    builder.add_node("agent", chat_node(steered, tools=[add_tool], system="You add numbers."))
    builder.add_node("tools", ToolNode([add_tool]))
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "tools")
    builder.add_edge("tools", END)
    graph = builder.compile()
    out = await graph.ainvoke({"messages": [HumanMessage("What is 3+4?")]})
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool"]
    assert out["messages"][2].content == "7"
    assert_exact(out["messages"][1])
    (llm,) = spans_of(spans, semconv.SPAN_KIND_LLM)
    sent = json.loads(llm.attributes[semconv.GEN_AI_INPUT_MESSAGES])
    assert sent[0] == {"role": "system", "content": "You add numbers."}
    assert json.loads(llm.attributes[semconv.GEN_AI_TOOL_DEFINITIONS])[0]["function"]["name"] == "add"
    nodes = {s.attributes[semconv.NODE_NAME]: s for s in spans_of(spans, semconv.SPAN_KIND_NODE)}
    assert set(nodes) == {"agent", "tools"}
    assert llm.parent.span_id == nodes["agent"].context.span_id
    (tool_span,) = spans_of(spans, semconv.SPAN_KIND_TOOL)
    assert tool_span.parent.span_id == nodes["tools"].context.span_id


def test_chat_node_default_model_and_missing_messages(monkeypatch, openai_url, served_model) -> None:
    monkeypatch.setenv("ART_TRAINER_URL", openai_url)
    monkeypatch.setenv("ART_MODEL", served_model)
    from art_langgraph import _settings

    monkeypatch.setattr(_settings, "_settings", None)
    node = chat_node(system="Be brief.")
    with pytest.raises(KeyError, match="messages"):
        node.invoke({"question": "hi"})
