"""`gather`: run a compiled graph n times per input, each run one rollout of the input's group."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from art_langgraph._checks import check_count
from art_langgraph._rollout import rollout

__all__ = ["RewardFn", "gather", "gather_sync"]

RewardFn = Callable[[Any, Any], float | Awaitable[float]]
"""`reward(input, output)` → a number, sync or async."""


async def gather(
    graph: Any,
    inputs: Sequence[Any],
    *,
    n: int = 4,
    reward: RewardFn | None = None,
    concurrency: int = 8,
    task: str | None = None,
    split: str = "train",
    progress: bool = True,
) -> list[list[Any]]:
    """Run `graph.ainvoke(input)` n times per input, each inside its own rollout.

    The n rollouts of one input share a fresh group id (`group_size=n`), so the collector
    compares them with each other (GRPO).

    Args:
        graph: A compiled LangGraph graph (anything with `ainvoke`).
        inputs: Graph inputs.
        n: Rollouts per input.
        reward: `reward(input, output)`, sync or async; its number is the rollout's reward.
        concurrency: Most runs in flight at once.
        task: Task name of every rollout; default the graph's `name`.
        split: `train` or `val`.
        progress: Show a tqdm progress bar.

    Returns:
        The outputs, one list of n per input, in input order.

    Raises:
        ValueError: `n` or `concurrency` out of 1 to 2**31 - 1.
        TypeError: `n` or `concurrency` is not an integer (a float, a bool).
        Exception: The first error a run or the reward function raised (that rollout's span
            is marked ERROR); the other runs are cancelled and have ended when it is raised.
    """
    check_count(n, "gather's n")  # each run's group_size; checked before len(inputs) * n tasks exist
    # a float let more runs in than it says (`Semaphore(2.5)` lets 3 in at once), and a bool is no count
    semaphore = asyncio.Semaphore(check_count(concurrency, "gather's concurrency"))
    task_name = task or getattr(graph, "name", None) or "default"
    bar = tqdm(total=len(inputs) * n, desc=f"gather {task_name}", disable=not progress)

    async def one(index: int, item: Any, group: str) -> Any:
        async with semaphore:
            async with rollout(
                task_name, group=group, split=split, group_size=n, metadata={"input_index": index}
            ) as run:
                output = await graph.ainvoke(item)
                if reward is not None:
                    value = reward(item, output)
                    if inspect.isawaitable(value):
                        value = await value
                    run.reward(value)  # type: ignore[arg-type]
            bar.update(1)
            return output

    groups = [uuid.uuid4().hex for _ in inputs]
    tasks = [asyncio.ensure_future(one(i, item, groups[i])) for i, item in enumerate(inputs) for _ in range(n)]
    try:
        outputs = await asyncio.gather(*tasks)
    except BaseException:
        # Every other run is cancelled and awaited, so none goes on in the background and every
        # rollout span has ended (and can be flushed) when the error reaches the caller.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        bar.close()
    return [outputs[i * n : (i + 1) * n] for i in range(len(inputs))]


def gather_sync(graph: Any, inputs: Sequence[Any], **kwargs: Any) -> list[list[Any]]:
    """Sync `gather` for scripts: runs it in a new event loop (not inside a running one).

    Raises:
        RuntimeError: Called from inside a running event loop (await `gather` there).
    """
    return asyncio.run(gather(graph, inputs, **kwargs))
