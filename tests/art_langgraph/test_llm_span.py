"""`llm` spans against a vLLM-shaped fake engine (`fake_engine.py`): exact tokens on every path.

The fake engine's tokens are known in advance, so each test checks the recorded ids and logprobs
exactly: structured output streamed through `beta.chat.completions.stream`, `n > 1` streamed and
not, failed attempts, an engine that sends no token ids, and a result that cannot be recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import os
import uuid
from collections.abc import AsyncIterator
from functools import reduce
from typing import Any

import httpx
import openai
import pytest
from langgraph.graph import START, MessagesState, StateGraph
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pydantic import BaseModel

from art_langgraph import ARTChatModel, _llm_span, semconv
from tests.art_langgraph import fake_engine
from tests.art_langgraph.fake_engine import PROMPT_IDS, FakeEngine, completion_ids, logprobs, reply_text
from tests.art_langgraph.forking import run_child_of_held_lock

TOKEN_ATTRIBUTES = {semconv.PROMPT_TOKEN_IDS, semconv.COMPLETION_TOKEN_IDS, semconv.COMPLETION_LOGPROBS,
                    semconv.POLICY_STEP}


class Answer(BaseModel):
    answer: int


def llm_spans(spans: InMemorySpanExporter) -> list:
    return [s for s in spans.get_finished_spans() if s.attributes[semconv.SPAN_KIND] == semconv.SPAN_KIND_LLM]


def node_span(spans: InMemorySpanExporter) -> ReadableSpan:
    (span,) = [s for s in spans.get_finished_spans() if s.attributes[semconv.SPAN_KIND] == semconv.SPAN_KIND_NODE]
    return span


def assert_choice(span, choice: int) -> None:
    """The span records exactly what the fake engine sampled for choice `choice`."""
    assert list(span.attributes[semconv.PROMPT_TOKEN_IDS]) == PROMPT_IDS
    assert list(span.attributes[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(choice)
    assert list(span.attributes[semconv.COMPLETION_LOGPROBS]) == logprobs(choice)
    assert span.attributes[semconv.POLICY_STEP] == 7


def by_completion(spans: list) -> dict[int, object]:
    """Spans keyed by the choice whose ids they hold (choice i samples 10 + i first)."""
    return {s.attributes[semconv.COMPLETION_TOKEN_IDS][0] - 10: s for s in spans}


def merged(chunks: list[Any]) -> Any:
    """The stream's chunks added up, as a caller of `stream()` would."""
    return reduce(operator.add, chunks)


@pytest.mark.asyncio(loop_scope="session")
async def test_structured_output_stream_records_exact_tokens(spans) -> None:
    """`with_structured_output(...).stream()` goes through `beta.chat.completions.stream`, whose chunks come wrapped."""
    structured = FakeEngine().chat_model().with_structured_output(Answer)
    assert list(structured.stream("What is 1+2?"))[-1] == Answer(answer=3)
    assert [x async for x in structured.astream("What is 1+2?")][-1] == Answer(answer=3)
    for span in llm_spans(spans):
        assert_choice(span, 0)
        assert span.attributes[semconv.GEN_AI_RESPONSE_MODEL] == "agent@7"
        assert span.status.status_code is StatusCode.UNSET
    assert len(llm_spans(spans)) == 2


def test_raw_stream_with_response_format_carries_token_data(spans) -> None:
    chunks = list(FakeEngine().chat_model().bind(response_format=Answer).stream("What is 1+2?"))
    art = merged(chunks).response_metadata["art"]
    assert art == {
        "prompt_token_ids": PROMPT_IDS,
        "completion_token_ids": completion_ids(0),
        "logprobs": logprobs(0),
        "policy_step": 7,
    }
    (span,) = llm_spans(spans)
    assert_choice(span, 0)


def test_graph_streaming_messages_with_structured_output_in_a_node(spans) -> None:
    """`stream_mode="messages"` makes a node's `invoke` stream; structured output must still work."""
    model = FakeEngine().chat_model()

    def node(state: MessagesState) -> dict:
        return {"messages": [("ai", str(model.with_structured_output(Answer).invoke(state["messages"]).answer))]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", node)
    builder.add_edge(START, "answer")
    events = list(builder.compile().stream({"messages": [("user", "What is 1+2?")]}, stream_mode="messages"))
    assert events
    (span,) = llm_spans(spans)
    assert_choice(span, 0)
    assert span.parent.span_id == node_span(spans).context.span_id


@pytest.mark.asyncio(loop_scope="session")
async def test_stream_with_n_records_one_span_per_choice(spans) -> None:
    model = FakeEngine().chat_model(n=3)
    streamed = merged(list(model.stream("Say a word.")))
    assert streamed.response_metadata["art"]["prompt_token_ids"] == PROMPT_IDS  # sent with each choice, kept once
    [chunk async for chunk in model.astream("Say a word.")]
    got = llm_spans(spans)
    assert len(got) == 6
    for call in (got[:3], got[3:]):
        choices = by_completion(call)
        assert sorted(choices) == [0, 1, 2]
        for choice, span in choices.items():
            assert_choice(span, choice)
            (out,) = json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
            assert out["content"] == reply_text(choice)
            assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)


@pytest.mark.parametrize(
    ("call", "stream_mode"),
    [
        ("invoke", "values"),
        ("invoke", "messages"),  # the node's invoke streams (LangChain calls `_stream` without a run manager)
        ("stream", "values"),
    ],
)
def test_choice_spans_share_the_calls_parent_and_start(spans, call: str, stream_mode: str) -> None:
    """Each choice's span hangs where the call's does (the node), in its trace, from its start."""
    model = FakeEngine().chat_model(n=2)

    def agent(state: MessagesState) -> dict:
        reply = model.invoke(state["messages"]) if call == "invoke" else merged(list(model.stream(state["messages"])))
        return {"messages": [reply]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    list(builder.compile().stream({"messages": [("user", "hi")]}, stream_mode=stream_mode))
    node = node_span(spans)
    first, second = llm_spans(spans)
    for span in (first, second):
        assert span.parent.span_id == node.context.span_id
        assert span.context.trace_id == node.context.trace_id
        assert span.attributes[semconv.ROLLOUT_ID] == node.attributes[semconv.ROLLOUT_ID]
    assert first.start_time == second.start_time
    assert sorted(by_completion([first, second])) == [0, 1]


def test_failed_attempt_span_carries_error_type(spans) -> None:
    """A failed attempt sampled nothing: its span says why (`error.type`); the retry's span does not."""
    engine = FakeEngine(failures=1)
    reply = engine.chat_model(max_retries=0).with_retry(stop_after_attempt=2,
                                                        wait_exponential_jitter=False).invoke("hi")
    assert reply.response_metadata["art"]["completion_token_ids"] == completion_ids(0)
    failed, succeeded = llm_spans(spans)
    assert failed.attributes[semconv.ERROR_TYPE] == "OpenAIAPIError"  # LangChain's class for the engine's 500
    assert failed.status.status_code is StatusCode.ERROR
    assert semconv.ERROR_TYPE not in succeeded.attributes
    assert_choice(succeeded, 0)


def test_failed_stream_span_carries_error_type(spans) -> None:
    with pytest.raises(openai.InternalServerError) as raised:
        list(FakeEngine(failures=1).chat_model(max_retries=0).stream("hi"))
    (span,) = llm_spans(spans)
    assert span.attributes[semconv.ERROR_TYPE] == type(raised.value).__name__


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stream_with_n_that_fails_midway_marks_every_choice(spans) -> None:
    """The connection drops after two tokens of each choice: no choice's partial completion is a turn."""
    model = FakeEngine(stream_breaks_after=6).chat_model(n=2, max_retries=0)  # 2 role chunks, 2 tokens per choice
    with pytest.raises(openai.APIConnectionError):
        list(model.stream("hi"))
    with pytest.raises(openai.APIConnectionError):
        [chunk async for chunk in model.astream("hi")]
    got = llm_spans(spans)
    assert len(got) == 4
    for span in got:
        assert span.attributes[semconv.ERROR_TYPE] == "OpenAIConnectionError"  # LangChain's class
        assert span.status.status_code is StatusCode.ERROR
    assert sorted(len(s.attributes[semconv.COMPLETION_TOKEN_IDS]) for s in got) == [2, 2, 2, 2]


def assert_left_unfinished(span, read: int) -> None:
    """The span is of a choice its caller stopped reading after `read` tokens: those tokens, marked no turn."""
    assert list(span.attributes[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(0)[:read]
    assert semconv.GEN_AI_RESPONSE_FINISH_REASONS not in span.attributes
    assert span.attributes[semconv.ERROR_TYPE] == "GeneratorExit"
    assert span.status.status_code is StatusCode.ERROR


def assert_whole_turn(span, choice: int) -> None:
    assert_choice(span, choice)
    assert span.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert semconv.ERROR_TYPE not in span.attributes
    assert span.status.status_code is StatusCode.UNSET


async def closed_llm_spans(spans: InMemorySpanExporter, count: int) -> list:
    """The `llm` spans once `count` have ended: the event loop closes an abandoned async stream in a task of its own."""
    for _ in range(100):
        if len(got := llm_spans(spans)) >= count:
            return got
        await asyncio.sleep(0)
    raise AssertionError(f"{len(llm_spans(spans))} llm spans ended, not {count}")


def test_a_stream_the_caller_stops_reading_is_no_turn(spans) -> None:
    """A caller that breaks out of `stream()`, or closes it, left a span of the prefix it read (no end token, no
    finish reason) and no `error.type`: the collector took it for a whole turn. A stream read to its end is one."""
    model = FakeEngine().chat_model()
    for i, _ in enumerate(model.stream("hi")):
        if i == 1:  # the role chunk and the first token
            break
    stream = model.stream("hi")
    for _ in range(3):
        next(stream)
    stream.close()
    list(model.stream("hi"))
    broken, closed, whole = llm_spans(spans)
    assert_left_unfinished(broken, 1)
    assert_left_unfinished(closed, 2)
    assert_whole_turn(whole, 0)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_async_stream_closed_early_is_no_turn(spans) -> None:
    model = FakeEngine().chat_model()
    stream = model.astream("hi")
    for _ in range(3):
        await anext(stream)
    await stream.aclose()
    [chunk async for chunk in model.astream("hi")]
    closed, whole = await closed_llm_spans(spans, 2)
    assert_left_unfinished(closed, 2)
    assert_whole_turn(whole, 0)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stream_whose_task_is_cancelled_midway_is_no_turn(spans) -> None:
    """The app's task is cancelled while it works on a chunk (a timeout, the app leaving): the event loop closes the
    abandoned stream later, and its span held the prefix as a whole turn."""
    model = FakeEngine().chat_model()
    read = asyncio.Event()

    async def consume() -> None:
        async for _ in model.astream("hi"):
            read.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(consume())
    await read.wait()
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    (span,) = await closed_llm_spans(spans, 1)
    assert span.attributes[semconv.ERROR_TYPE] == "GeneratorExit"
    assert span.status.status_code is StatusCode.ERROR


def test_a_stream_left_after_a_choice_finished_keeps_that_choice(spans) -> None:
    """Each choice a stream left before its finish reason is no turn; one the engine finished is a whole turn (the
    caller needs no more chunks of it), as is a stream left only before its usage chunk."""
    for chunk in FakeEngine().chat_model().stream("hi"):  # the usage chunk comes last
        if chunk.response_metadata.get("finish_reason"):
            break
    for i, _ in enumerate(FakeEngine().chat_model(n=2).stream("hi")):
        if i == 6:  # two role chunks, then each choice's tokens in turn: choice 0 has finished, choice 1 has not
            break
    before_usage, finished, unfinished = llm_spans(spans)
    assert_whole_turn(before_usage, 0)
    assert_whole_turn(finished, 0)
    assert list(unfinished.attributes[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(1)[:2]
    assert unfinished.attributes[semconv.ERROR_TYPE] == "GeneratorExit"


class _HeldStream(httpx.AsyncByteStream):
    """The first `sent` events of a stream, then a wait: an engine still sampling the rest."""

    def __init__(self, events: list[str], sent: int, held: asyncio.Event) -> None:
        self._events, self._sent, self._held = events, sent, held

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self._events[: self._sent]:
            yield event.encode()
        self._held.set()
        await asyncio.sleep(60)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_task_cancelled_while_its_stream_waits_keeps_the_finished_choice(spans) -> None:
    """A task cancelled while its stream awaited the engine's next chunk marked every choice `CancelledError`, one the
    engine had finished too, which a stream closed at that point keeps as a whole turn. Only the unfinished one is no
    turn now."""
    engine, held = FakeEngine(), asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        events = engine._stream(json.loads(request.content))
        return httpx.Response(200, stream=_HeldStream(events, 7, held), headers={"content-type": "text/event-stream"})

    model = ARTChatModel(model="agent@latest", base_url="http://fake-engine/v1", api_key="test", n=2,
                         http_async_client=httpx.AsyncClient(transport=httpx.MockTransport(handle)))

    async def consume() -> None:
        async for _ in model.astream("hi"):
            pass

    task = asyncio.create_task(consume())
    await held.wait()  # two role chunks, then each choice's tokens in turn: choice 0 has finished, choice 1 has not
    task.cancel()
    await asyncio.wait([task])
    finished, unfinished = sorted(llm_spans(spans), key=lambda s: s.attributes[semconv.COMPLETION_TOKEN_IDS][0])
    assert_whole_turn(finished, 0)
    assert list(unfinished.attributes[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(1)[:2]
    assert unfinished.attributes[semconv.ERROR_TYPE] == "CancelledError"
    assert unfinished.status.status_code is StatusCode.ERROR


BROKEN_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "a=1, b=2"}}
"""A sampled tool call whose arguments are not JSON: LangChain makes it an invalid tool call."""


class BrokenToolCallEngine(FakeEngine):
    """The fake engine whose every reply is `BROKEN_CALL` (the tokens stay those of `completion_ids`)."""

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        response = super()._completion(body)
        for choice in response["choices"]:
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": [BROKEN_CALL]}
        return response

    def _stream(self, body: dict[str, Any]) -> list[str]:
        events = []
        for event in super()._stream(body):
            chunk = json.loads(event.removeprefix("data: ")) if event != "data: [DONE]\n\n" else None
            for choice in (chunk or {}).get("choices", []):
                if "role" not in choice["delta"]:  # the call goes out whole with the first token
                    first = choice["token_ids"] == completion_ids(choice["index"])[:1]
                    choice["delta"] = {"tool_calls": [{"index": 0, **BROKEN_CALL}]} if first else {}
            events.append(event if chunk is None else f"data: {json.dumps(chunk)}\n\n")
        return events


@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_tool_call_stays_in_the_output_message(spans, stream: bool) -> None:
    """A sampled call whose arguments do not parse is part of the reply (and of the next prompt): the span keeps it."""
    model = BrokenToolCallEngine().chat_model()
    reply = merged(list(model.stream("Add 1 and 2."))) if stream else model.invoke("Add 1 and 2.")
    assert [call["args"] for call in reply.invalid_tool_calls] == [BROKEN_CALL["function"]["arguments"]]
    (span,) = llm_spans(spans)
    (out,) = json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])
    assert out["tool_calls"] == [BROKEN_CALL]
    assert_choice(span, 0)


@pytest.mark.asyncio(loop_scope="session")
async def test_engine_without_token_ids_records_none_and_warns_once(spans, caplog) -> None:
    """An OpenAI-compatible engine that ignores `return_token_ids`: no token attributes, one warning per model."""
    name = f"other-engine-{uuid.uuid4().hex[:8]}"
    model = FakeEngine(model=name, token_ids=False).chat_model()
    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        replies = [model.invoke("hi"), merged(list(model.stream("hi"))), await model.ainvoke("hi")]
    assert all("art" not in reply.response_metadata for reply in replies)
    got = llm_spans(spans)
    assert len(got) == 3
    for span in got:
        assert not TOKEN_ATTRIBUTES & set(span.attributes)
        assert span.attributes[semconv.GEN_AI_RESPONSE_MODEL] == name
    warnings = [r for r in caplog.records if "returned no token ids" in r.getMessage()]
    assert len(warnings) == 1 and name in warnings[0].getMessage()


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_name_with_digits_int_refuses_keeps_the_token_data(spans, stream: bool) -> None:
    """`agent@²` passed `str.isdigit` and made `int` raise while reading the step: the call lost its token data, a
    streamed one its output messages too. It is a name of no checkpoint, so step 0."""
    model = FakeEngine(model="agent@²").chat_model()
    reply = merged(list(model.stream("hi"))) if stream else model.invoke("hi")
    assert reply.response_metadata["art"]["policy_step"] == 0
    (span,) = llm_spans(spans)
    assert list(span.attributes[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(0)
    assert span.attributes[semconv.POLICY_STEP] == 0
    assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == reply_text(0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("suffix", [str(semconv.MAX_COUNT + 1), "20250101120000", "9" * 5000])
def test_a_model_name_past_the_largest_step_is_step_zero(spans, stream: bool, suffix: str) -> None:
    """`name@N` with N past the largest step the collector stores (a date-stamped served name) made it reject every
    call's span, losing the turn; past 4300 digits, `int` raised and the call lost its token data. Step 0."""
    model = FakeEngine(model=f"agent@{suffix}").chat_model()
    reply = merged(list(model.stream("hi"))) if stream else model.invoke("hi")
    assert reply.response_metadata["art"]["policy_step"] == 0
    (span,) = llm_spans(spans)
    assert span.attributes[semconv.POLICY_STEP] == 0
    assert list(span.attributes[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(0)


def test_a_numeric_response_id_keeps_the_token_data(spans) -> None:
    """A server that answers `"id": 12345` (the OpenAI client does not check it) made recording the result raise: the
    app got its reply, but the span lost its output messages and token data, so the turn. The id is kept as text."""

    class NumericIds(FakeEngine):
        def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
            return {**super()._completion(body), "id": 12345}

    NumericIds().chat_model().invoke("hi")
    (span,) = llm_spans(spans)
    assert list(span.attributes[semconv.COMPLETION_TOKEN_IDS]) == completion_ids(0)
    assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == reply_text(0)
    assert span.attributes[semconv.GEN_AI_RESPONSE_ID] == "12345"


def test_a_model_name_with_a_nul_keeps_the_calls_span(spans) -> None:
    """The collector rejects a span whose name holds a NUL: `chat agent\\x00x` lost the call's span, so its turn. The
    span's name carries U+FFFD there; the requested model's attribute keeps the name as it was sent."""
    FakeEngine().chat_model().model_copy(update={"model_name": "agent\x00x"}).invoke("hi")
    (span,) = llm_spans(spans)
    assert span.name == "chat agent\ufffdx"
    assert span.attributes[semconv.GEN_AI_REQUEST_MODEL] == "agent\x00x"


@pytest.mark.parametrize("stream", [False, True])
def test_a_result_that_cannot_be_recorded_does_not_fail_the_call(spans, monkeypatch, caplog, stream: bool) -> None:
    """Engine data the recorder cannot read (a null logprob) is logged and counted; the app gets its reply."""
    monkeypatch.setattr(fake_engine, "logprobs", lambda choice: [None, None, None])
    model = FakeEngine().chat_model()
    before = _llm_span.recording_errors()
    with caplog.at_level(logging.ERROR, logger="art_langgraph"):
        reply = merged(list(model.stream("hi"))) if stream else model.invoke("hi")
    assert reply.content == reply_text(0)
    assert _llm_span.recording_errors() > before
    assert any(r.exc_info for r in caplog.records if "could not record" in r.getMessage())
    (span,) = llm_spans(spans)
    assert span.status.status_code is StatusCode.UNSET
    assert semconv.COMPLETION_TOKEN_IDS not in span.attributes


def test_a_stream_chunk_whose_token_data_cannot_be_read_leaves_the_call_without_token_data(spans, monkeypatch) -> None:
    """One unreadable chunk (a null logprob mid-stream): no token data (the rest would look exact), text in order."""
    monkeypatch.setattr(fake_engine, "logprobs", lambda choice: [-0.5, None, -1.5])
    before = _llm_span.recording_errors()

    reply = merged(list(FakeEngine().chat_model().stream("hi")))

    assert reply.content == reply_text(0)
    assert _llm_span.recording_errors() > before
    (span,) = llm_spans(spans)
    assert TOKEN_ATTRIBUTES.isdisjoint(span.attributes)
    assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == reply_text(0)  # in order


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_counts_a_recording_error_can_count_its_own() -> None:
    """A thread of the parent held the lock recording errors are counted under when the process forked: the child
    inherited it held, with no thread to release it, and hung at its first recording error."""
    out = run_child_of_held_lock("from art_langgraph import _counts, _llm_span", "_counts.RECORDING_ERRORS._lock", """
        with _llm_span.recording_guard("a child's call"):
            raise ValueError("unreadable")
        assert _llm_span.recording_errors() == 1
        """)
    assert out.returncode == 0, out.stderr
    assert "could not record a child's call" in out.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_warns_of_an_engine_without_ids_can_warn_of_its_own() -> None:
    """A thread of the parent held the lock of the once-per-model warning (an engine sent no token ids) when the
    process forked: the child inherited it held, and hung at the first call whose engine sent none."""
    out = run_child_of_held_lock("from art_langgraph import _token_data", "_token_data._warned_lock", """
        assert _token_data.choice_token_data({"model": "child-engine"}, {}) is None
        """)
    assert out.returncode == 0, out.stderr
    assert "the engine serving 'child-engine' returned no token ids" in out.stderr
