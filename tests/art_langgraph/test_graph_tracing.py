"""Node and tool spans, one trajectory per top-level graph run, placement under concurrency.

Real LangGraph graphs calling the real trainer (vLLM); spans land in an in-memory exporter,
and in the real collector where a test says so.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import operator
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Annotated, TypedDict

import httpx
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pydantic import BaseModel

import art_langgraph
from art_langgraph import ARTChatModel, _tracing, reward, rollout, semconv
from collector.assembly import span_problem, trajectory_key
from collector.otlp import decode_request


class Fan(TypedDict, total=False):
    tag: str
    branches: int
    answers: Annotated[list[str], operator.add]
    summary: str


def kinds(spans, kind: str) -> list:
    return [s for s in spans.get_finished_spans() if s.attributes.get(semconv.SPAN_KIND) == kind]


def fan_graph(llm: ARTChatModel):  # type: ignore[no-untyped-def]
    """START -> Send x branches -> `ask` (sync node: LangGraph's thread pool) -> `join` (async in ainvoke)."""

    def ask(state: Fan) -> Fan:
        reply = llm.invoke(f"Item {state['tag']}: say ok.")
        return {"answers": [reply.content]}

    def join_sync(state: Fan) -> Fan:
        return {"summary": llm.invoke(f"Item {state['tag']}: summarise.").content}

    async def join_async(state: Fan) -> Fan:
        reply = await llm.ainvoke(f"Item {state['tag']}: summarise.")
        return {"summary": reply.content}

    join = RunnableLambda(join_sync, afunc=join_async, name="join")

    def fan(state: Fan) -> list[Send]:
        return [Send("ask", {"tag": state["tag"]}) for _ in range(state.get("branches", 2))]

    builder = StateGraph(Fan)
    builder.add_node("ask", ask)
    builder.add_node("join", join)
    builder.add_conditional_edges(START, fan, ["ask"])
    builder.add_edge("ask", "join")
    builder.add_edge("join", END)
    return builder.compile(name="fan")


def tag_of(llm_span) -> str:  # type: ignore[no-untyped-def]
    text = llm_span.attributes[semconv.GEN_AI_INPUT_MESSAGES]
    return text.split("Item ", 1)[1].split(":", 1)[0]


def check_placement(spans, expected: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """Every LLM span sits in the rollout of its tag, under a node span of that same rollout."""
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    roots = {s.attributes[semconv.ROLLOUT_ID]: s for s in kinds(spans, semconv.SPAN_KIND_ROLLOUT)}
    for llm in kinds(spans, semconv.SPAN_KIND_LLM):
        rollout_id = llm.attributes[semconv.ROLLOUT_ID]
        assert rollout_id == expected[tag_of(llm)]
        parent = by_id[llm.parent.span_id]
        assert parent.attributes[semconv.SPAN_KIND] == semconv.SPAN_KIND_NODE
        assert parent.attributes[semconv.ROLLOUT_ID] == rollout_id
        assert llm.context.trace_id == roots[rollout_id].context.trace_id
        assert by_id[parent.parent.span_id] is roots[rollout_id]


@pytest.mark.asyncio(loop_scope="session")
async def test_each_top_level_run_is_one_trajectory_under_concurrency(chat_model: ARTChatModel, spans) -> None:
    graph = fan_graph(chat_model.bind(max_tokens=2))  # type: ignore[arg-type]
    runs = {str(i): uuid.uuid4() for i in range(8)}
    await asyncio.gather(
        *(
            graph.ainvoke({"tag": tag, "branches": 2}, config={"run_id": run_id, "metadata": {"art.group": "g1"}})
            for tag, run_id in runs.items()
        )
    )
    roots = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert sorted(r.attributes[semconv.ROLLOUT_ID] for r in roots) == sorted(u.hex for u in runs.values())
    for root in roots:
        assert root.parent is None
        assert root.attributes[semconv.ROLLOUT_SOURCE] == "graph"
        assert root.attributes[semconv.TASK] == "fan"
        assert root.attributes[semconv.GROUP] == "g1"
    assert len(kinds(spans, semconv.SPAN_KIND_LLM)) == 8 * 3
    assert len(kinds(spans, semconv.SPAN_KIND_NODE)) == 8 * 3
    check_placement(spans, {tag: run_id.hex for tag, run_id in runs.items()})


def test_explicit_rollouts_in_threads_own_their_graph_runs(chat_model: ARTChatModel, spans) -> None:
    graph = fan_graph(chat_model.bind(max_tokens=2))  # type: ignore[arg-type]

    def one(tag: str) -> str:
        with rollout("threads", group="g") as run:
            graph.invoke({"tag": tag, "branches": 2})
            return run.id

    with ThreadPoolExecutor(4) as pool:
        ids = dict(zip(map(str, range(6)), pool.map(one, map(str, range(6))), strict=True))
    roots = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert sorted(r.attributes[semconv.ROLLOUT_ID] for r in roots) == sorted(ids.values())
    assert {r.attributes[semconv.ROLLOUT_SOURCE] for r in roots} == {"rollout"}  # no implicit ones
    check_placement(spans, ids)


def test_subgraph_nodes_and_tools_nest(chat_model: ARTChatModel, add_tool, spans) -> None:
    class S(TypedDict, total=False):
        tag: str
        total: int

    def compute(state: S) -> S:
        chat_model.bind(max_tokens=2).invoke(f"Item {state['tag']}: ok?")
        return {"total": add_tool.invoke({"a": 3, "b": 4})}

    inner = StateGraph(S)
    inner.add_node("compute", compute)
    inner.add_edge(START, "compute")
    outer = StateGraph(S)
    outer.add_node("sub", inner.compile(name="inner"))
    outer.add_edge(START, "sub")
    out = outer.compile(name="outer").invoke({"tag": "x"})
    assert out["total"] == 7
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    nodes = {s.attributes[semconv.NODE_NAME]: s for s in kinds(spans, semconv.SPAN_KIND_NODE)}
    assert by_id[nodes["sub"].parent.span_id] is root
    assert by_id[nodes["compute"].parent.span_id] is nodes["sub"]
    (tool,) = kinds(spans, semconv.SPAN_KIND_TOOL)
    (llm,) = kinds(spans, semconv.SPAN_KIND_LLM)
    assert by_id[tool.parent.span_id] is nodes["compute"]
    assert by_id[llm.parent.span_id] is nodes["compute"]
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"a": 3, "b": 4}'
    assert ({s.attributes[semconv.ROLLOUT_ID] for s in spans.get_finished_spans()}
            == {root.attributes[semconv.ROLLOUT_ID]})


def test_interrupt_is_an_event_and_resume_is_a_new_run(chat_model: ARTChatModel, spans) -> None:
    class S(TypedDict, total=False):
        question: str
        approved: bool
        answer: str

    def review(state: S) -> S:
        return {"approved": interrupt({"question": state["question"]})}

    def answer(state: S) -> S:
        return {"answer": chat_model.bind(max_tokens=2).invoke(state["question"]).content}

    builder = StateGraph(S)
    builder.add_node("review", review)
    builder.add_node("answer", answer)
    builder.add_edge(START, "review")
    builder.add_edge("review", "answer")
    graph = builder.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    with rollout("approval") as run:
        paused = graph.invoke({"question": "Item q: ok?"}, config)
        assert "__interrupt__" in paused
        done = graph.invoke(Command(resume=True), config)
    assert done["approved"] is True
    review_spans = [s for s in kinds(spans, semconv.SPAN_KIND_NODE) if s.attributes[semconv.NODE_NAME] == "review"]
    assert [e.name for e in review_spans[0].events] == [semconv.INTERRUPT_EVENT]
    assert review_spans[0].status.is_ok
    (llm,) = kinds(spans, semconv.SPAN_KIND_LLM)
    assert llm.attributes[semconv.ROLLOUT_ID] == run.id  # both invocations: one trajectory


def test_a_run_resumed_with_its_run_id_is_the_same_trajectory(spans) -> None:
    """Resumed with the config that named its `run_id`, a graph run outside `rollout(...)` gets a second rollout span
    with the same id: the collector keys trajectories by that id, so both parts are one. Both parts are in one trace,
    whose id is derived from the `run_id`: the resumed part had a random trace of its own, and a reward by the trace
    id seen for it (a Langfuse score on it) named no trajectory, whose trace id is its first rollout span's. Not the
    `run_id` itself: the collector keys another instrumentation's calls by their trace id, which must not be the
    rollout's id (LangSmith's export makes the run id a trace id)."""

    def review(state: Steps) -> Steps:
        return {"done": [f"review {interrupt('ok?')}"]}

    builder = StateGraph(Steps)
    builder.add_node("review", review)
    builder.add_node("after", lambda state: {"done": ["after"]})
    builder.add_edge(START, "review")
    builder.add_edge("review", "after")
    graph = builder.compile(checkpointer=InMemorySaver())
    run_id = uuid.uuid4()
    config = {"configurable": {"thread_id": run_id.hex}, "run_id": run_id}
    assert "__interrupt__" in graph.invoke({}, config)
    assert graph.invoke(Command(resume="yes"), config)["done"] == ["review yes", "after"]
    first, second = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert first.context.trace_id == second.context.trace_id != run_id.int
    trace_id = format(first.context.trace_id, "032x")
    assert first.status.is_ok and second.status.is_ok
    decoded = decode_request(encode_spans(spans.get_finished_spans()).SerializeToString(), "application/x-protobuf")
    assert len(decoded.spans) == 5  # two rollouts; review paused, review again, after
    assert {trajectory_key(record) for record in decoded.spans} == {(run_id.hex, True)}
    assert {record.trace_id for record in decoded.spans} == {trace_id}


@pytest.mark.parametrize(("name", "task"), [
    ("g" * 300, "g" * semconv.MAX_NAME_LENGTH),
    ("a\x00b\udcff", "a\ufffdb\ufffd"),
    ("..", "graph"),
    ("tickets/../b", "graph"),
])
def test_a_run_whose_name_no_task_can_have_is_still_one_trajectory(spans, name: str, task: str) -> None:
    """Outside `rollout(...)`, the task defaults to the top-level run's name, which `rollout(...)`'s checks refused:
    a graph named so, or LangChain's `RunnableParallel<key,...>` past 256 characters, lost its whole trajectory (no
    rollout span, no node span, its model calls in traces of their own), with only LangChain's log of a callback
    error. The name is made a task the collector takes."""
    steps_graph().with_config(run_name=name).invoke({})
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.attributes[semconv.TASK] == task
    assert len(kinds(spans, semconv.SPAN_KIND_NODE)) == 2
    decoded = decode_request(encode_spans(spans.get_finished_spans()).SerializeToString(), "application/x-protobuf")
    assert [span_problem(record) for record in decoded.spans] == [None] * 3


def test_graph_tracing_can_be_turned_off(monkeypatch, chat_model: ARTChatModel, spans) -> None:
    from art_langgraph import _settings

    monkeypatch.setenv("ART_TRACE_GRAPHS", "false")
    monkeypatch.setattr(_settings, "_settings", None)
    fan_graph(chat_model.bind(max_tokens=2)).invoke({"tag": "off", "branches": 1})  # type: ignore[arg-type]
    assert kinds(spans, semconv.SPAN_KIND_ROLLOUT) == kinds(spans, semconv.SPAN_KIND_NODE) == []
    (llm,) = kinds(spans, semconv.SPAN_KIND_LLM)[:1]
    assert semconv.ROLLOUT_ID not in llm.attributes


def test_reward_later_by_run_id_or_trace_id(memory_tracing, chat_model: ARTChatModel, collector_service) -> None:
    """A graph run outside `rollout()` reaches the real collector; rewards arrive afterwards."""
    art_langgraph.configure(collector_url=collector_service.url)
    spans = InMemorySpanExporter()  # this provider is shut down below, and its exporters with it
    _tracing.get_tracer_provider().add_span_processor(SimpleSpanProcessor(spans))
    try:
        graph = fan_graph(chat_model.bind(max_tokens=2))  # type: ignore[arg-type]
        first, second = uuid.uuid4(), uuid.uuid4()
        graph.invoke({"tag": "a", "branches": 1}, config={"run_id": first})
        graph.invoke({"tag": "b", "branches": 1}, config={"run_id": second})
        assert art_langgraph.flush(timeout=10)
        second_trace = next(
            format(s.context.trace_id, "032x")
            for s in kinds(spans, semconv.SPAN_KIND_ROLLOUT)
            if s.attributes[semconv.ROLLOUT_ID] == second.hex
        )
        reward(0.25, rollout_id=first)  # the LangChain run id (a UUID) is the rollout id
        reward(0.75, trace_id=second_trace)
    finally:
        memory_tracing.install()
    for run_id, value in ((first, 0.25), (second, 0.75)):
        deadline = time.monotonic() + 10
        while True:
            response = httpx.get(f"{collector_service.url}/v1/trajectories/{run_id.hex}", timeout=10)
            if response.status_code == 200 and response.json()["rewards"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        body = response.json()
        assert body["rewards"] == {"reward": value}
        assert body["complete"] is True
        assert body["task"] == "fan"
        assert len(body["sequences"]) == 2  # `ask` and `join`: two different prompts


def test_reward_outside_rollout_without_id_says_how() -> None:
    with pytest.raises(RuntimeError, match="run_id"):
        reward(1.0)


class Scored(TypedDict, total=False):
    score: float


async def test_reward_in_a_node_of_a_graph_run_outside_rollout_goes_to_that_run(spans) -> None:
    """A graph run outside `rollout()` is a trajectory of its own; `reward()` in its nodes used to raise."""

    def judge(state: Scored) -> Scored:  # a sync node: LangGraph's thread pool under ainvoke
        reward(state["score"])
        return {}

    async def style(state: Scored) -> Scored:
        await art_langgraph.areward(state["score"] / 2, name="style")
        return {}

    builder = StateGraph(Scored)
    builder.add_node("judge", judge)
    builder.add_node("style", style)
    builder.add_edge(START, "judge")
    builder.add_edge("judge", "style")
    graph = builder.compile()
    scores = [0.25, 0.5, 1.0]
    await asyncio.gather(*(graph.ainvoke({"score": score}) for score in scores))

    rewards = sorted(
        tuple((e.attributes[semconv.REWARD_NAME], e.attributes[semconv.REWARD_VALUE]) for e in span.events)
        for span in kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    )
    assert rewards == sorted((("reward", score), ("style", score / 2)) for score in scores)
    with pytest.raises(RuntimeError, match="run_id"):  # outside the runs again
        reward(1.0)


def _reward_on_own_pool(state: Scored, config: RunnableConfig) -> Scored:
    with ThreadPoolExecutor(1) as pool:
        pool.submit(reward, state["score"], config=config).result()
    return {}


async def _reward_in_executor(state: Scored, config: RunnableConfig) -> Scored:
    # `run_in_executor` copies no context (`asyncio.to_thread` does)
    await asyncio.get_running_loop().run_in_executor(None, partial(reward, state["score"], config=config))
    return {}


async def _reward_in_task_of_another_context(state: Scored, config: RunnableConfig) -> Scored:
    await asyncio.create_task(art_langgraph.areward(state["score"], config=config), context=contextvars.Context())
    return {}


@pytest.mark.parametrize("node", [_reward_on_own_pool, _reward_in_executor, _reward_in_task_of_another_context])
async def test_a_reward_given_off_the_nodes_thread_or_task_goes_to_its_run_given_the_config(spans, node) -> None:
    """A node that hands its scoring to a thread or task of its own, which carries neither its run nor its context:
    `reward()` there found no current run and raised, and took no config to name it. Given the node's `config`, as a
    model call takes it, the reward goes to that node's run."""
    builder = StateGraph(Scored)
    builder.add_node("judge", node)
    builder.add_edge(START, "judge")
    graph = builder.compile()
    scores = [0.25, 0.5, 1.0]
    await asyncio.gather(*(graph.ainvoke({"score": score}) for score in scores))
    roots = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    rewards = sorted(tuple(e.attributes[semconv.REWARD_VALUE] for e in root.events) for root in roots)
    assert rewards == [(score,) for score in scores]
    with pytest.raises(RuntimeError, match=r"pass the node's config: reward\(\.\.\., config=config\)"):
        reward(1.0)


class Steps(TypedDict, total=False):
    done: Annotated[list[str], operator.add]


def steps_graph(fail_at: str | None = None):  # type: ignore[no-untyped-def]
    """START -> `one` -> `two` -> END, one update per node; the node named `fail_at` raises `ValueError`."""

    def step(name: str):  # type: ignore[no-untyped-def]
        def run(state: Steps) -> Steps:
            if name == fail_at:
                raise ValueError(f"{name} failed")
            return {"done": [name]}

        return run

    builder = StateGraph(Steps)
    builder.add_node("one", step("one"))
    builder.add_node("two", step("two"))
    builder.add_edge(START, "one")
    builder.add_edge("one", "two")
    builder.add_edge("two", END)
    return builder.compile()


def read_first_update(graph, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Break out of the graph's `stream()` (or `astream()`) after its first update, and close it as the loop would."""
    if mode == "sync":
        stream = graph.stream({})
        for _ in stream:
            break
        stream.close()  # what dropping it does in CPython; explicit, so that no test waits on the garbage collector
        return

    async def read() -> None:
        stream = graph.astream({})
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(read())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_graph_stream_stopped_early_is_not_an_error(spans, mode: str) -> None:
    """An app that stops reading a graph's stream closes it (`GeneratorExit`); its rollout used to end as ERROR."""
    read_first_update(steps_graph(), mode)
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.status.status_code is StatusCode.UNSET
    assert root.events == ()  # no exception recorded
    assert [s.attributes[semconv.NODE_NAME] for s in kinds(spans, semconv.SPAN_KIND_NODE)] == ["one"]


def test_a_node_cancelled_mid_run_is_not_an_error(spans) -> None:
    """Leaving `astream()` while a node runs cancels its task: the node span used to end ERROR "CancelledError"."""

    async def slow(state: Steps) -> Steps:
        get_stream_writer()("started")
        await asyncio.sleep(30)
        return {"done": ["slow"]}

    builder = StateGraph(Steps)
    builder.add_node("slow", slow)
    builder.add_edge(START, "slow")
    builder.add_edge("slow", END)
    graph = builder.compile()

    async def read() -> None:
        stream = graph.astream({}, stream_mode="custom")
        async for _ in stream:
            break
        await stream.aclose()

    started = time.monotonic()
    asyncio.run(read())
    assert time.monotonic() - started < 10  # the node was cancelled, not awaited
    (node,) = kinds(spans, semconv.SPAN_KIND_NODE)
    assert node.status.status_code is StatusCode.UNSET
    assert [(e.name, e.attributes["exception.type"]) for e in node.events] == [(semconv.CANCELLED_EVENT,
                                                                                "CancelledError")]
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.status.status_code is StatusCode.UNSET and root.events == ()


def test_a_rollout_cancelled_by_a_timeout_is_not_an_error(spans) -> None:
    async def run() -> None:
        async with rollout("slow"):
            await asyncio.sleep(30)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run(), timeout=0.2)

    asyncio.run(main())
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.status.status_code is StatusCode.UNSET
    assert [e.name for e in root.events] == [semconv.CANCELLED_EVENT]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_graph_stream_that_raises_is_an_error(spans, mode: str) -> None:
    with pytest.raises(ValueError, match="one failed"):
        read_first_update(steps_graph(fail_at="one"), mode)
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "ValueError: one failed"


def test_llm_span_outside_any_graph_has_no_rollout(chat_model: ARTChatModel, spans) -> None:
    chat_model.bind(max_tokens=2).invoke([HumanMessage("hi")])
    assert kinds(spans, semconv.SPAN_KIND_ROLLOUT) == []
    (llm,) = kinds(spans, semconv.SPAN_KIND_LLM)
    assert llm.parent is None and semconv.ROLLOUT_ID not in llm.attributes


def test_a_graph_runs_rollout_takes_art_metadata_from_its_config(spans) -> None:
    config = {"metadata": {semconv.TASK: "steps", semconv.GROUP: "g7", semconv.GROUP_SIZE: 3, semconv.SPLIT: "val",
                           semconv.METADATA: {"user": "u1"}}}
    steps_graph().invoke({}, config=config)
    steps_graph().invoke({})  # no metadata: the task is the graph's name, the split train, no group
    configured, bare = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert json.loads(configured.attributes[semconv.METADATA]) == {"user": "u1"}
    assert ({k: configured.attributes[k] for k in (semconv.TASK, semconv.GROUP, semconv.GROUP_SIZE, semconv.SPLIT)}
            == {semconv.TASK: "steps", semconv.GROUP: "g7", semconv.GROUP_SIZE: 3, semconv.SPLIT: "val"})
    assert (bare.attributes[semconv.TASK], bare.attributes[semconv.SPLIT]) == ("LangGraph", "train")
    assert semconv.GROUP not in bare.attributes and semconv.METADATA not in bare.attributes


def test_a_graph_runs_group_size_from_its_config_is_checked_not_truncated(spans, caplog) -> None:
    """`int()` made 2.7 a group of 2 and True a group of 1, and dropped 0; the run is now refused, logged by
    LangChain as every callback error is, as `rollout(group_size=...)` refuses it."""
    for size in (2.7, True, 0):
        steps_graph().invoke({}, config={"metadata": {semconv.GROUP_SIZE: size}})
    assert kinds(spans, semconv.SPAN_KIND_ROLLOUT) == []
    assert "config metadata 'art.group.size' must be an integer, got float" in caplog.text
    assert "config metadata 'art.group.size' must be from 1 to 2147483647, got 0" in caplog.text
    steps_graph().invoke({}, config={"metadata": {semconv.GROUP_SIZE: "4"}})  # a string of digits, as configs hold
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.attributes[semconv.GROUP_SIZE] == 4


def test_a_command_to_the_parent_graph_is_no_interrupt(spans) -> None:
    """A subgraph node that routes its parent (`Command(graph=Command.PARENT)`) did not pause the graph."""
    inner = StateGraph(Steps)
    inner.add_node("route", lambda state: Command(graph=Command.PARENT, goto="after", update={"done": ["route"]}))
    inner.add_edge(START, "route")
    builder = StateGraph(Steps)
    builder.add_node("sub", inner.compile(), destinations=("after",))
    builder.add_node("after", lambda state: {"done": ["after"]})
    builder.add_edge(START, "sub")
    assert builder.compile().invoke({})["done"] == ["route", "after"]
    nodes = kinds(spans, semconv.SPAN_KIND_NODE)
    assert sorted(s.attributes[semconv.NODE_NAME] for s in nodes) == ["after", "route", "sub"]
    for node in nodes:
        assert node.events == ()
        assert node.status.status_code is StatusCode.UNSET


def test_a_tool_called_on_its_own_in_a_rollout_gets_a_tool_span(add_tool, spans) -> None:
    """An agent loop written by hand (model, then tool, inside `rollout(...)`) records its tool calls too."""
    with rollout("by-hand") as run:
        add_tool.invoke({"name": "add", "args": {"a": 1, "b": 2}, "id": "call_1", "type": "tool_call"})
    add_tool.invoke({"a": 3, "b": 4})  # outside any rollout: no trajectory to belong to
    (tool,) = kinds(spans, semconv.SPAN_KIND_TOOL)
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert tool.parent.span_id == root.context.span_id
    assert tool.attributes[semconv.ROLLOUT_ID] == run.id
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_1"
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "3"


def test_a_node_and_a_tool_named_with_a_nul_keep_their_spans(spans) -> None:
    """The collector rejects a span whose name holds a NUL, so `node st\\x00ep` lost the node's span (and its tool's);
    the span names now carry U+FFFD there, and the name attributes keep the name as it is."""

    class Args(BaseModel):
        a: int

    echo = StructuredTool.from_function(lambda a: a, name="ec\x00ho", description="Echo a.", args_schema=Args)

    def step(state: Steps) -> Steps:
        echo.invoke({"a": 1})
        return {"done": ["step"]}

    builder = StateGraph(Steps)
    builder.add_node("st\x00ep", step)
    builder.add_edge(START, "st\x00ep")
    builder.compile().invoke({})
    (node,), (tool,) = kinds(spans, semconv.SPAN_KIND_NODE), kinds(spans, semconv.SPAN_KIND_TOOL)
    assert (node.name, tool.name) == ("node st\ufffdep", "execute_tool ec\ufffdho")
    assert (node.attributes[semconv.NODE_NAME], tool.attributes[semconv.GEN_AI_TOOL_NAME]) == ("st\x00ep", "ec\x00ho")
    body = encode_spans(spans.get_finished_spans()).SerializeToString()
    decoded = decode_request(body, "application/x-protobuf")
    assert len(decoded.spans) == 3 and not decoded.rejected
    assert [span_problem(record) for record in decoded.spans] == [None] * 3


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for this object")


def _circular() -> dict:
    loop: dict = {}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize("value", [_circular(), {(1, 2): "pair"}])
def test_a_tool_whose_arguments_and_result_json_cannot_hold_gets_them_as_repr(spans, value) -> None:
    """JSON's circular-reference error, or its error on a key that is not a string or number, left no tool span (in
    the arguments) or a span never ended (in the result)."""
    from langchain_core.tools import tool

    @tool
    def echo(x: object) -> object:
        """Return x."""
        return x

    with rollout("odd-values"):
        assert echo.invoke({"x": value}) is value
    (span,) = kinds(spans, semconv.SPAN_KIND_TOOL)
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] == repr({"x": value})
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == repr(value)


def test_a_tool_result_that_cannot_be_recorded_still_ends_its_span(spans) -> None:
    """The error is LangChain's to log (handlers do not raise into the app); the span ends without the result."""
    from langchain_core.tools import tool

    @tool
    def unprintable(x: int) -> object:
        """Return a value with no text."""
        return _Unprintable()

    with rollout("odd-result"):
        unprintable.invoke({"x": 1})
    (span,) = kinds(spans, semconv.SPAN_KIND_TOOL)
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"x": 1}'
    assert semconv.GEN_AI_TOOL_CALL_RESULT not in span.attributes


class Asked(TypedDict, total=False):
    question: str


@pytest.mark.parametrize("way", ["config", "context_pool"])
@pytest.mark.parametrize(("call", "stream_mode"), [("invoke", "values"), ("stream", "values"), ("invoke", "messages")])
def test_a_model_call_on_a_nodes_own_thread_pool_stays_in_its_run_the_documented_ways(
    spans, way: str, call: str, stream_mode: str
) -> None:
    """A plain `ThreadPoolExecutor` carries neither the node's run nor its context (the README says so); passing the
    node's `config`, or submitting through LangChain's `ContextThreadPoolExecutor`, keeps the call under the node.
    A streamed call too (`stream`, or `invoke` while the graph streams messages), which LangChain makes without
    telling the model its run: given only the config, it lost its rollout."""
    from langchain_core.runnables.config import ContextThreadPoolExecutor

    from tests.art_langgraph.fake_engine import FakeEngine

    model = FakeEngine().chat_model()

    def ask_model(question: str, *config: RunnableConfig) -> None:
        if call == "stream":
            list(model.stream(question, *config))
        else:
            model.invoke(question, *config)

    def ask(state: Asked, config) -> Asked:  # type: ignore[no-untyped-def]
        if way == "config":
            with ThreadPoolExecutor(1) as pool:
                pool.submit(ask_model, state["question"], config).result()
        else:
            with ContextThreadPoolExecutor(1) as pool:
                pool.submit(ask_model, state["question"]).result()
        return {}

    builder = StateGraph(Asked)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    list(builder.compile().stream({"question": "1+2?"}, stream_mode=stream_mode))
    (llm,) = kinds(spans, semconv.SPAN_KIND_LLM)
    (node,) = kinds(spans, semconv.SPAN_KIND_NODE)
    (root,) = kinds(spans, semconv.SPAN_KIND_ROLLOUT)
    assert llm.parent.span_id == node.context.span_id
    assert llm.attributes[semconv.ROLLOUT_ID] == root.attributes[semconv.ROLLOUT_ID]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_streamed_model_call_in_a_task_of_another_context_stays_in_its_run_given_the_config(spans) -> None:
    """An async node hands its streamed call, with its `config`, to a task that does not share its context (a worker
    started outside the run, say): the call stays under the node, as it does given to `ainvoke`."""
    from tests.art_langgraph.fake_engine import FakeEngine

    model = FakeEngine().chat_model()

    async def ask(state: Asked, config: RunnableConfig) -> Asked:
        async def stream() -> None:
            [chunk async for chunk in model.astream(state["question"], config)]

        await asyncio.create_task(stream(), context=contextvars.Context())
        return {}

    builder = StateGraph(Asked)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    await builder.compile().ainvoke({"question": "1+2?"})
    (llm,) = kinds(spans, semconv.SPAN_KIND_LLM)
    (node,) = kinds(spans, semconv.SPAN_KIND_NODE)
    assert llm.parent.span_id == node.context.span_id
    assert llm.attributes[semconv.ROLLOUT_ID] == node.attributes[semconv.ROLLOUT_ID]
