"""A one-node LangGraph agent that answers sums, and the reward that teaches it to.

The base SmolLM2-135M-Instruct states the right sum in about a quarter of its replies and
rambles in most. The reward pays for the right number and for a short reply, so every group
of attempts has spread to learn from, and a few GRPO steps visibly move the policy.
"""

from __future__ import annotations

import random
import re
from typing import TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from art_langgraph import init_chat_model

SHORT_REPLY_CHARS = 16
"""Replies up to this many characters earn the full brevity credit."""
LONG_REPLY_CHARS = 80
"""Replies of this many characters or more earn no brevity credit."""


class Problem(TypedDict):
    """One task: add two numbers."""

    a: int
    b: int


class State(TypedDict, total=False):
    """Graph state: the problem in, the reply out."""

    a: int
    b: int
    reply: str


def problems(count: int, seed: int) -> list[Problem]:
    """Return `count` random sums of two numbers in 1..30, reproducible by `seed`."""
    rng = random.Random(seed)
    return [Problem(a=rng.randint(1, 30), b=rng.randint(1, 30)) for _ in range(count)]


def build_agent(model: str = "agent@latest", *, max_tokens: int = 24, temperature: float = 1.0) -> CompiledStateGraph:
    """Compile the agent graph: one node asks the model and stores its reply."""
    llm = init_chat_model(model, max_tokens=max_tokens, temperature=temperature)

    def answer(state: State) -> State:
        question = f"What is {state['a']}+{state['b']}? Reply with only the number."
        message = llm.invoke([HumanMessage(question)])
        assert isinstance(message, AIMessage)
        return {"reply": str(message.content)}

    graph = StateGraph(State)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile()


def is_correct(problem: Problem, reply: str) -> bool:
    """True when the reply states the right sum as a number."""
    return str(problem["a"] + problem["b"]) in re.findall(r"-?\d+", reply)


def score(problem: Problem, output: State) -> float:
    """Reward in [0, 1]: 0.6 for the right number, up to 0.4 for a short reply (none for an empty one)."""
    reply = output.get("reply", "").strip()
    span = LONG_REPLY_CHARS - SHORT_REPLY_CHARS
    brevity = min(1.0, max(0.0, (LONG_REPLY_CHARS - len(reply)) / span)) if reply else 0.0
    return 0.6 * is_correct(problem, reply) + 0.4 * brevity
