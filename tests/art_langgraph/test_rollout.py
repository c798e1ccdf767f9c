"""Rollouts: ids on every span inside (graphs, threads, concurrent tasks), errors, generators (rewards:
test_rewards.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from types import MappingProxyType
from typing import TypedDict

import numpy as np
import pytest
from langgraph.graph import END, START, StateGraph
from starlette.responses import StreamingResponse

import art_langgraph
from art_langgraph import ARTChatModel, _rollout, reward, rollout, semconv
from collector import protocol
from tests.art_langgraph.fake_engine import FakeEngine
from tests.art_langgraph.span_reading import spans_of


class State(TypedDict, total=False):
    question: str
    first: str
    second: str


def two_step_graph(model: ARTChatModel, *, parallel: bool = False, sync: bool = False, threads: set[int] | None = None):
    """A real StateGraph with two LLM-calling nodes (sequential, or fanned out in parallel).

    Sync nodes add their thread's id to `threads` when given.
    """
    seen = threads if threads is not None else set()

    if sync:

        def first(state: State) -> State:
            seen.add(threading.get_ident())
            return {"first": model.invoke(state["question"]).content}

        def second(state: State) -> State:
            seen.add(threading.get_ident())
            return {"second": model.invoke(f"Rephrase: {state['question']}").content}
    else:

        async def first(state: State) -> State:  # type: ignore[misc]
            return {"first": (await model.ainvoke(state["question"])).content}

        async def second(state: State) -> State:  # type: ignore[misc]
            return {"second": (await model.ainvoke(f"Rephrase: {state['question']}")).content}

    g = StateGraph(State)
    g.add_node("first", first)
    g.add_node("second", second)
    if parallel:
        g.add_edge(START, "first")
        g.add_edge(START, "second")
        g.add_edge("first", END)
        g.add_edge("second", END)
    else:
        g.add_edge(START, "first")
        g.add_edge("first", "second")
        g.add_edge("second", END)
    return g.compile()


@pytest.mark.asyncio(loop_scope="session")
async def test_graph_in_rollout_tags_every_llm_span(chat_model: ARTChatModel, spans) -> None:
    graph = two_step_graph(chat_model)
    async with rollout("qa", group="g1", metadata={"k": 1}) as r:
        await graph.ainvoke({"question": "What is 2+2?"})
        r.reward(0.5)
        r.reward(1, name="format")
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    llm = spans_of(spans, semconv.SPAN_KIND_LLM)
    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    assert len(llm) == 2
    assert len(r.id) == 32 and len(r.trace_id) == 32
    assert root.attributes[semconv.ROLLOUT_ID] == r.id
    assert root.attributes[semconv.GROUP] == "g1"
    assert root.attributes[semconv.TASK] == "qa"
    assert root.attributes[semconv.SPLIT] == "train"
    assert json.loads(root.attributes[semconv.METADATA]) == {"k": 1}
    assert root.parent is None and format(root.context.trace_id, "032x") == r.trace_id
    for s in llm:
        assert s.attributes[semconv.ROLLOUT_ID] == r.id
        assert s.attributes[semconv.GROUP] == "g1"
        assert s.attributes[semconv.TASK] == "qa"
        assert s.context.trace_id == root.context.trace_id
        node = by_id[s.parent.span_id]  # model call -> its graph node -> the rollout
        assert node.attributes[semconv.SPAN_KIND] == semconv.SPAN_KIND_NODE
        assert node.parent.span_id == root.context.span_id
    rewards = [(e.attributes[semconv.REWARD_NAME], e.attributes[semconv.REWARD_VALUE]) for e in root.events]
    assert rewards == [("reward", 0.5), ("format", 1.0)]


def test_sync_graph_in_thread_pool_keeps_rollout_id(chat_model: ARTChatModel, spans) -> None:
    threads: set[int] = set()
    graph = two_step_graph(chat_model, parallel=True, sync=True, threads=threads)
    with rollout("qa-sync") as r:
        assert art_langgraph.current_rollout() is r
        graph.invoke({"question": "Name a fruit."})
    assert art_langgraph.current_rollout() is None
    llm = spans_of(spans, semconv.SPAN_KIND_LLM)
    assert len(llm) == 2
    assert {s.attributes[semconv.ROLLOUT_ID] for s in llm} == {r.id}
    assert threads - {threading.get_ident()}, "LangGraph ran no node in its thread pool"


def test_contextvar_follows_langchain_thread_pool(chat_model: ARTChatModel, spans) -> None:
    """`batch` runs each input in LangChain's context-copying thread pool."""
    main = threading.get_ident()
    with rollout("batch") as r:
        chat_model.batch(["A.", "B.", "C."], config={"max_concurrency": 3})
    llm = spans_of(spans, semconv.SPAN_KIND_LLM)
    assert len(llm) == 3 and {s.attributes[semconv.ROLLOUT_ID] for s in llm} == {r.id}
    assert threading.get_ident() == main


@pytest.mark.asyncio(loop_scope="session")
async def test_concurrent_rollouts_never_mix_ids(chat_model: ARTChatModel, spans) -> None:
    graph = two_step_graph(chat_model.bind(max_tokens=8))  # type: ignore[arg-type]

    async def one(i: int) -> tuple[str, str]:
        async with rollout("mix", group=f"g{i % 2}") as r:
            await graph.ainvoke({"question": f"Say the number {i}."})
            return r.id, r.trace_id

    ids = await asyncio.gather(*(one(i) for i in range(8)))
    assert len({rid for rid, _ in ids}) == 8
    trace_of = dict(ids)
    llm = spans_of(spans, semconv.SPAN_KIND_LLM)
    assert len(llm) == 16
    per_rollout: dict[str, int] = {}
    for s in llm:
        rid = s.attributes[semconv.ROLLOUT_ID]
        assert format(s.context.trace_id, "032x") == trace_of[rid]
        per_rollout[rid] = per_rollout.get(rid, 0) + 1
    assert per_rollout == {rid: 2 for rid, _ in ids}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"task": "t" * 257}, ValueError, "task must be at most 256"),
        ({"task": "a\x00b"}, ValueError, "without NUL"),
        ({"task": "t", "group": "g" * 257}, ValueError, "group must be at most 256"),
        ({"task": "t", "split": "s" * 65}, ValueError, "split must be at most 64"),
        ({"task": "t", "group": ".."}, ValueError, "group '..' has a path segment '.' or '..'"),
        ({"task": "runs/./a"}, ValueError, r"task \(the group id without a group\) 'runs/./a' has a path segment"),
        ({"task": "t", "group_size": 2.5}, TypeError, "group_size must be an integer"),
        ({"task": "t", "group_size": True}, TypeError, "group_size must be an integer"),
        ({"task": "t", "group_size": 2**31}, ValueError, "group_size must be from 1"),
        ({"task": "t", "group_size": 0}, ValueError, "group_size must be from 1"),
        ({"task": "t", "group_size": 10**5000}, ValueError, "group_size must be from 1 .*, got inf"),  # no str()
        ({"task": "t", "group_size": -(10**5000)}, ValueError, "group_size must be from 1 .*, got -inf"),
        ({"task": 5}, TypeError, "task must be a string, got int"),
        ({"task": "t", "group": 7}, TypeError, "group must be a string, got int"),
        ({"task": "t", "split": None}, TypeError, "split must be a string, got NoneType"),
        ({"task": "t", "metadata": "user=u1"}, TypeError, "rollout metadata must be a dict, got str"),
        ({"task": "t", "metadata": {(1, 2): "pair"}}, TypeError, r"metadata has the key \(1, 2\) \(tuple\), which"),
    ],
)
def test_rollout_refuses_what_the_collector_would_reject(kwargs: dict, error: type, match: str, spans) -> None:
    """The collector rejects every span of such a rollout (a partial success the exporter cannot see): the whole
    trajectory was lost, uncounted, with no error in the app."""
    with pytest.raises(error, match=match):
        rollout(**kwargs)


@pytest.mark.parametrize(
    ("field", "kwargs"), [("group", {"task": "t", "group": ""}), ("split", {"task": "t", "split": ""})]
)
def test_rollout_refuses_an_empty_group_or_split(field: str, kwargs: dict, spans) -> None:
    """The collector reads an empty `art.group` as none and an empty `art.split` as `train`: a rollout given
    `group=""` joined one group with every rollout of its task, one given `split=""` was leased for training."""
    with pytest.raises(ValueError, match=f"rollout {field} must be a non-empty string"):
        rollout(**kwargs)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("task", {"task": "caf\udce9"}),
        ("group", {"task": "t", "group": "g\udcff"}),
        ("split", {"task": "t", "split": "\ud83d"}),
    ],
)
def test_rollout_refuses_a_name_with_a_surrogate(field: str, kwargs: dict, spans) -> None:
    """Export sent each surrogate as U+FFFD, so groups (or tasks) that differ only there, `g\\udcff` and
    `g\\udcfe` (bytes decoded with `surrogateescape`), reached the collector as one group."""
    with pytest.raises(ValueError, match=rf"{field} must be text UTF-8 can encode: '.*' holds the surrogate '\\u"):
        rollout(**kwargs)


def test_rollout_takes_a_task_with_dot_segments_when_a_group_is_given(spans) -> None:
    """Only the group id travels in API paths: a task is checked for `.`/`..` segments only when it is the group id,
    and dots that are no whole segment are fine."""
    assert rollout("runs/../a", group="g").group == "g"
    assert rollout("v1.0/.hidden").task == "v1.0/.hidden"


def test_rollout_metadata_is_checked_when_the_rollout_is_made(spans) -> None:
    """JSON that cannot take the metadata failed only at `with`, with json's bare message; a value JSON has no type
    for is exported as its `str`, not dropped."""
    circular: dict = {}
    circular["self"] = circular
    with pytest.raises(ValueError, match="rollout metadata cannot be exported as JSON: Circular reference"):
        rollout("t", metadata=circular)
    with rollout(
        "t",
        metadata={"tags": {"a"}, "n": 1, "x": np.float32(0.5), "d": Decimal("1.5"), 2.5: "k", np.float64(0.25): "f"},
    ):
        pass
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    exported = {"tags": "{'a'}", "n": 1, "x": "0.5", "d": "1.5", "2.5": "k", "0.25": "f"}  # a float64 is a float
    assert json.loads(root.attributes[semconv.METADATA]) == exported


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        ({"a": float("nan")}, "['a'] is nan"),
        ({"b": {"c": [1.0, float("-inf")]}}, "['b']['c'][1] is -inf"),
        ({"t": (np.float64("inf"),)}, "['t'][0] is inf"),
        ({"f": [np.float32("nan")]}, "['f'][0] is nan"),
        ({"h": {"i": np.float16("-inf")}}, "['h']['i'] is -inf"),
        ({"d": Decimal("NaN")}, "['d'] is NaN"),
        ({"d": [1, Decimal("-Infinity")]}, "['d'][1] is -Infinity"),
        ({"d": Decimal("sNaN")}, "['d'] is sNaN"),
        ({"k": {float("nan"): 1}}, "['k'] has the key nan"),
        ({float("-inf"): 1, "b": float("nan")}, " has the key -inf"),
    ],
)
def test_rollout_refuses_metadata_holding_a_number_json_cannot_carry(metadata: dict, where: str, spans) -> None:
    """NaN and infinities were exported as `NaN`/`Infinity`, which is no JSON: the collector read them as null. Those of
    NumPy's other float types and `Decimal`'s went out as the text `nan`/`NaN` (their `str`), while a float's were
    refused; a NaN key was refused with json's bare "Out of range float values are not JSON compliant"."""
    with pytest.raises(ValueError, match=re.escape(f"rollout metadata{where}: JSON has no NaN or infinity")):
        rollout("t", metadata=metadata)


def test_rollout_says_a_metadata_key_json_cannot_take_is_one_even_beside_a_nan(spans) -> None:
    """A key that is no string came out as "rollout metadata['b'] is nan", a NaN met after it."""
    with pytest.raises(TypeError, match=re.escape("rollout metadata has the key ('k',) (tuple), which JSON cannot")):
        rollout("t", metadata={("k",): 1, "b": float("nan")})


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        ({np.float32(1.5): 1}, " has the key np.float32(1.5) (float32)"),
        ({"k": {Decimal("NaN"): 1}}, "['k'] has the key Decimal('NaN') (Decimal)"),
        ({"x": [{"y": 1}, {Decimal("1.5"): 2}]}, "['x'][1] has the key Decimal('1.5') (Decimal)"),
        ({"n": {np.int64(3): "c"}, "b": float("nan")}, "['n'] has the key np.int64(3) (int64)"),
    ],
)
def test_rollout_names_where_a_metadata_key_json_cannot_take_is(metadata: dict, where: str, spans) -> None:
    """A NumPy or `Decimal` key got json's bare "keys must be str, int, float, bool or None, not decimal.Decimal",
    naming neither the key nor where it is, while a value of those types (a NaN) was refused naming where."""
    with pytest.raises(TypeError, match=re.escape(f"rollout metadata{where}, which JSON cannot take as a key: give")):
        rollout("t", metadata=metadata)


def test_rollout_exports_metadata_given_as_a_mapping_as_an_object(spans) -> None:
    """A mapping that is no dict (a `MappingProxyType`) went out as the JSON text of its `str`, `"{'a': 1}"`: the
    collector ignored it, as metadata that is no object."""
    with rollout("t", metadata=MappingProxyType({"a": 1, "b": [2]})):
        pass
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert json.loads(root.attributes[semconv.METADATA]) == {"a": 1, "b": [2]}


def test_rollout_exports_a_mapping_inside_its_metadata_as_an_object(spans) -> None:
    """Only the metadata itself was made a dict: a mapping inside it that is no dict went out as its `str`, a string
    (`"{'user': 'u1'}"`, or `"<M object at 0x...>"` for a class of the app's), not as the object it holds."""
    with rollout("t", metadata={"ctx": MappingProxyType({"user": "u1", "n": [1]})}):
        pass
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert json.loads(root.attributes[semconv.METADATA]) == {"ctx": {"user": "u1", "n": [1]}}
    with pytest.raises(ValueError, match=r"rollout metadata\['ctx'\]\['x'\] is nan"):
        rollout("t", metadata={"ctx": MappingProxyType({"x": float("nan")})})

def test_rollout_takes_the_largest_names_the_collector_stores(spans) -> None:
    with rollout("t" * 256, group="g" * 256, split="s" * 64, group_size=np.int64(2**31 - 1)) as r:
        pass
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.attributes[semconv.GROUP_SIZE] == 2**31 - 1
    assert r.group_size == 2**31 - 1


def test_the_plugins_limits_are_the_collectors() -> None:
    """The plugin refuses what the collector would reject. `collector.protocol` keeps its own copy of the limits: the
    trainer imports it, and importing the plugin would add LangChain's 2.5 s to the trainer's start."""
    assert (semconv.MAX_NAME_LENGTH, semconv.MAX_COUNT) == (protocol.MAX_ID_LENGTH, protocol.MAX_COUNT)


def test_rollout_error_marks_span_and_propagates(spans) -> None:
    with pytest.raises(KeyError):
        with rollout("boom"):
            raise KeyError("x")
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.status.status_code.name == "ERROR"


def test_rollout_in_a_generator_closed_early_is_not_an_error(spans) -> None:
    """A consumer that stops reading a generator closes it (`GeneratorExit`): the rollout it runs ends without ERROR."""

    def events() -> Iterator[int]:
        with rollout("events"):
            yield 1
            yield 2

    stream = events()
    next(stream)
    stream.close()
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.status.status_code.name == "UNSET"
    assert root.events == ()


def test_rollout_left_in_another_context_still_ends(spans, caplog) -> None:
    """A streaming endpoint's rollout ends even when its consumer goes away mid-stream.

    The event loop then closes the abandoned async generator in a new task, so the `async with`
    block is left in another context than it was entered in.
    """

    async def events():  # type: ignore[no-untyped-def]
        async with rollout("events"):
            yield 1
            yield 2

    abandoned: list = []
    loop_errors: list[dict] = []

    async def read_one_event() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        abandoned.append(events())
        await abandoned[0].__anext__()

    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        asyncio.run(read_one_event())  # on its way out, asyncio.run closes the abandoned generator
    assert loop_errors == []
    assert _rollout_records(caplog) == []  # closed from outside after steps in one context: no warning
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    assert root.attributes[semconv.TASK] == "events"
    assert art_langgraph.current_rollout() is None


def stream_with_starlette(body: Iterator[str] | AsyncIterator[str]) -> None:
    """Serve `body` as Starlette's `StreamingResponse` does, to an ASGI 2.4 server that takes every chunk."""

    async def receive() -> dict:
        raise AssertionError("an ASGI 2.4 response does not listen for a disconnect")

    async def send(message: dict) -> None:
        pass

    asyncio.run(StreamingResponse(body)({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))


def test_sync_generator_stepped_in_a_context_copy_per_step_warns_once(spans, caplog, monkeypatch) -> None:
    """Starlette steps a sync iterator in a thread pool, in a copy of the context per step: the rollout the generator
    opened is not current in later steps, and their model calls are not in it. That cannot be fixed; it is logged
    once per process, with the fix."""
    monkeypatch.setattr(_rollout, "_warned_stepped_apart", False)
    model = FakeEngine().chat_model()

    def events() -> Iterator[str]:
        with rollout("sse"):
            for i in range(3):
                yield str(model.invoke(f"part {i}").content)

    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        for _ in range(2):
            stream_with_starlette(events())
    in_rollout = [semconv.ROLLOUT_ID in s.attributes for s in spans_of(spans, semconv.SPAN_KIND_LLM)]
    assert in_rollout == [True, False, False] * 2  # the limit the warning is about
    (warning,) = _rollout_records(caplog)
    assert warning.levelname == "WARNING"
    assert "rollout('sse')" in warning.getMessage() and "async generator" in warning.getMessage()


def test_async_generator_under_starlette_keeps_every_model_call_in_the_rollout(spans, caplog) -> None:
    """The fix the warning names: Starlette steps an async generator in one task, so in one context."""
    model = FakeEngine().chat_model()

    async def events() -> AsyncIterator[str]:
        async with rollout("sse"):
            for i in range(3):
                yield str((await model.ainvoke(f"part {i}")).content)

    with caplog.at_level(logging.WARNING, logger="art_langgraph"):
        stream_with_starlette(events())
    (root,) = spans_of(spans, semconv.SPAN_KIND_ROLLOUT)
    calls = spans_of(spans, semconv.SPAN_KIND_LLM)
    assert [s.attributes.get(semconv.ROLLOUT_ID) for s in calls] == [root.attributes[semconv.ROLLOUT_ID]] * 3
    assert _rollout_records(caplog) == []


def test_rollout_opened_in_a_node_owns_the_calls_and_runs_inside_it(spans) -> None:
    """A rollout nested in a graph node gets the model calls and the subgraph run made in it, as it gets the reward."""
    model = FakeEngine().chat_model()

    def ask(state: State) -> State:
        return {"first": model.invoke(state["question"]).content}

    sub = StateGraph(State)
    sub.add_node("ask", ask)
    sub.add_edge(START, "ask")
    sub.add_edge("ask", END)
    subgraph = sub.compile()
    inner_ids: list[str] = []

    def outer_node(state: State) -> State:
        with rollout("inner") as inner:
            inner_ids.append(inner.id)
            model.invoke(state["question"])
            subgraph.invoke(state)
            reward(1.0)
        return {"second": model.invoke(state["question"]).content}

    g = StateGraph(State)
    g.add_node("outer_node", outer_node)
    g.add_edge(START, "outer_node")
    g.add_edge("outer_node", END)
    g.compile(name="outer").invoke({"question": "q"})

    roots = {s.attributes[semconv.TASK]: s for s in spans_of(spans, semconv.SPAN_KIND_ROLLOUT)}
    inner, outer = roots["inner"], roots["outer"]
    assert inner.attributes[semconv.ROLLOUT_ID] == inner_ids[0] and inner.events[0].name == semconv.REWARD_EVENT
    llm = spans_of(spans, semconv.SPAN_KIND_LLM)
    in_inner = [s for s in llm if s.context.trace_id == inner.context.trace_id]
    in_outer = [s for s in llm if s.context.trace_id == outer.context.trace_id]
    assert len(in_inner) == 2 and len(in_outer) == 1
    assert {s.attributes[semconv.ROLLOUT_ID] for s in in_inner} == {inner_ids[0]}
    assert in_outer[0].attributes[semconv.ROLLOUT_ID] == outer.attributes[semconv.ROLLOUT_ID]
    (ask_node,) = [s for s in spans_of(spans, semconv.SPAN_KIND_NODE) if s.attributes[semconv.NODE_NAME] == "ask"]
    assert ask_node.attributes[semconv.ROLLOUT_ID] == inner_ids[0]
    assert ask_node.parent.span_id == inner.context.span_id


def _rollout_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What `_rollout` logged: an exporter of an earlier test that still retries a closed collector logs too."""
    return [record for record in caplog.records if record.name == _rollout.__name__]
