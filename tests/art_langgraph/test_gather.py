"""`gather`: n rollouts per input, one group per input, rewards from the callable."""

from __future__ import annotations

import asyncio
from typing import TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from art_langgraph import ARTChatModel, gather, gather_sync, semconv


class QA(TypedDict, total=False):
    question: str
    answer: str


def qa_graph(model: ARTChatModel):
    async def answer(state: QA) -> QA:
        return {"answer": (await model.ainvoke(state["question"])).content}

    g = StateGraph(QA)
    g.add_node("answer", answer)
    g.add_edge(START, "answer")
    g.add_edge("answer", END)
    return g.compile(name="qa")


@pytest.mark.asyncio(loop_scope="session")
async def test_gather_groups_n_rollouts_per_input(chat_model: ARTChatModel, spans) -> None:
    inputs = [{"question": "What is 1+1?"}, {"question": "What is 2+2?"}]

    async def score(inp: QA, out: QA) -> float:
        return float(len(out["answer"]) % 3)

    outputs = await gather(qa_graph(chat_model.bind(max_tokens=8)), inputs, n=3, reward=score, concurrency=4)
    assert [len(o) for o in outputs] == [3, 3]
    assert all(o["question"] == inp["question"] for inp, outs in zip(inputs, outputs) for o in outs)

    finished = spans.get_finished_spans()
    roots = [s for s in finished if s.attributes[semconv.SPAN_KIND] == semconv.SPAN_KIND_ROLLOUT]
    assert len(roots) == 6
    groups: dict[str, list] = {}
    for s in roots:
        groups.setdefault(s.attributes[semconv.GROUP], []).append(s)
        assert s.attributes[semconv.GROUP_SIZE] == 3
        assert s.attributes[semconv.TASK] == "qa"
        (event,) = s.events
        assert event.name == semconv.REWARD_EVENT and event.attributes[semconv.REWARD_VALUE] in (0.0, 1.0, 2.0)
    assert sorted(len(v) for v in groups.values()) == [3, 3]
    for members in groups.values():  # one input per group
        assert len({s.attributes[semconv.METADATA] for s in members}) == 1
    llm = [s for s in finished if s.attributes[semconv.SPAN_KIND] == semconv.SPAN_KIND_LLM]
    assert sorted(s.attributes[semconv.ROLLOUT_ID] for s in llm) == sorted(
        s.attributes[semconv.ROLLOUT_ID] for s in roots
    )


def test_gather_sync_with_sync_reward_and_split(spans) -> None:
    class Echo:
        name = "echo"

        async def ainvoke(self, inp: int) -> int:
            return inp * 2

    out = gather_sync(Echo(), [1, 2], n=2, reward=lambda i, o: o - i, split="val", progress=False)
    assert out == [[2, 2], [4, 4]]
    roots = spans.get_finished_spans()
    assert {s.attributes[semconv.SPLIT] for s in roots} == {"val"}
    assert sorted(s.events[0].attributes[semconv.REWARD_VALUE] for s in roots) == [1.0, 1.0, 2.0, 2.0]


@pytest.mark.asyncio(loop_scope="session")
async def test_gather_propagates_errors_and_validates(spans) -> None:
    class Boom:
        async def ainvoke(self, inp: int) -> int:
            raise RuntimeError("graph failed")

    with pytest.raises(RuntimeError, match="graph failed"):
        await gather(Boom(), [1], n=2, progress=False)
    with pytest.raises(ValueError, match="gather's n must be from 1 to 2147483647, got 0"):
        await gather(Boom(), [1], n=0)
    with pytest.raises(ValueError, match="gather's concurrency must be from 1 to 2147483647, got 0"):
        await gather(Boom(), [1], concurrency=0)


@pytest.mark.asyncio(loop_scope="session")
async def test_gather_checks_n_before_making_its_runs(spans) -> None:
    """`n` is every run's group size: a float n failed in `range`, one no group can hold made len(inputs) * n tasks
    first (2**31 per input) and only then failed in each."""

    class Echo:
        async def ainvoke(self, inp: int) -> int:
            return inp

    with pytest.raises(TypeError, match="gather's n must be an integer, got float"):
        await gather(Echo(), [1], n=2.5, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gather's n must be from 1 to 2147483647, got 2147483648"):
        await gather(Echo(), [], n=2**31, progress=False)
    assert spans.get_finished_spans() == ()


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("concurrency", [2.5, True, "2"])
async def test_gather_refuses_a_concurrency_that_is_no_integer(spans, concurrency) -> None:
    """A float was taken as it was (`Semaphore(2.5)` let 3 runs in at once), True as 1, a string failed in a
    comparison; each is now refused before any run starts."""

    class Echo:
        async def ainvoke(self, inp: int) -> int:
            return inp

    with pytest.raises(TypeError, match=f"gather's concurrency must be an integer, got {type(concurrency).__name__}"):
        await gather(Echo(), [1], n=2, concurrency=concurrency, progress=False)
    assert spans.get_finished_spans() == ()
    with pytest.raises(ValueError, match="gather's concurrency must be from 1 to 2147483647, got -1"):
        await gather(Echo(), [1], concurrency=-1, progress=False)


@pytest.mark.asyncio(loop_scope="session")
async def test_gather_failure_cancels_and_ends_every_other_run(spans) -> None:
    """The other members of the failing run's group stop too, and every rollout span has ended when it raises."""

    class FailsFirst:
        name = "flaky"

        def __init__(self) -> None:
            self.calls = 0
            self.finished = 0

        async def ainvoke(self, inp: int) -> int:
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(0.01)
                raise RuntimeError("graph failed")
            await asyncio.sleep(0.5)
            self.finished += 1
            return inp

    graph = FailsFirst()
    with pytest.raises(RuntimeError, match="graph failed"):
        await gather(graph, [1, 2], n=3, progress=False)
    roots = spans.get_finished_spans()
    assert len(roots) == 6
    assert sorted(s.status.status_code.name for s in roots) == ["ERROR"] + ["UNSET"] * 5
    assert sum(e.name == semconv.CANCELLED_EVENT for s in roots for e in s.events) == 5
    await asyncio.sleep(0.6)
    assert graph.finished == 0
