"""A one-node LangGraph summarizer, and the reward that teaches it to be short and complete.

The agent reads a short document (`examples.summarizer.documents`) and writes a one-sentence
summary. The score multiplies coverage (the fraction of the four key facts the summary
states) by a length term (full credit up to `SHORT_WORDS` words, falling linearly to 0 at
twice that), so neither copying the document nor a vague one-liner scores well.
"""

from __future__ import annotations

from typing import TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from art_langgraph import init_chat_model
from examples.summarizer.documents import Document, documents, facts_covered

SHORT_WORDS = 20
"""Summaries up to this many words earn the full length term; at twice as many, none."""
INSTRUCTION = (
    "Summarize the text below in one sentence of at most {words} words. "
    "Keep the name, the place and the numbers.\n\nText: {text}"
)


class State(TypedDict, total=False):
    """Graph state: the document in (with its facts), the summary out."""

    text: str
    person: str
    place: str
    year: int
    number: int
    summary: str


def build_agent(model: str = "agent@latest", *, max_tokens: int = 48, temperature: float = 1.0) -> CompiledStateGraph:
    """Compile the agent graph: one node asks the model for the summary and stores it."""
    llm = init_chat_model(model, max_tokens=max_tokens, temperature=temperature)

    def summarize(state: State) -> State:
        prompt = INSTRUCTION.format(words=SHORT_WORDS, text=state["text"])
        message = llm.invoke([HumanMessage(prompt)])
        assert isinstance(message, AIMessage)
        return {"summary": str(message.content)}

    graph = StateGraph(State)
    graph.add_node("summarize", summarize)
    graph.add_edge(START, "summarize")
    graph.add_edge("summarize", END)
    return graph.compile()


def length_term(words: int) -> float:
    """1.0 up to `SHORT_WORDS` words, linearly down to 0.0 at `2 * SHORT_WORDS`."""
    return min(1.0, max(0.0, (2 * SHORT_WORDS - words) / SHORT_WORDS))


def score(document: Document, output: State) -> float:
    """Reward in [0, 1]: fraction of key facts stated × the length term."""
    summary = output.get("summary", "").strip()
    covered = facts_covered(document, summary)
    return sum(covered) / len(covered) * length_term(len(summary.split()))


__all__ = ["SHORT_WORDS", "State", "build_agent", "documents", "length_term", "score"]
