"""An email-search agent in the spirit of OpenPipe's ART·E, small enough for a 135M model.

The agent answers one question about a synthetic mailbox (`examples.email_search.mailbox`).
Two tools are bound through `bind_tools`: `search_emails(keywords)` (SQLite FTS5, BM25 order)
and `read_email(email_id)`. The bundled SmolLM2-135M never writes a tool call on its own (0 of
120 sampled replies over four prompts, one with a worked example conversation), so the graph
runs the first search itself, with the question as keywords, and hands the hits to the model;
the model may search or read further, at most `MAX_TURNS` model calls, and its last reply is the
answer. Training is rewarded by the collector's RULER judge; `score` is the code check used
to measure it (does the answer contain the fact?).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import InjectedState, ToolNode

from art_langgraph import chat_node, init_chat_model
from examples.email_search.mailbox import mailbox, questions

MAX_TURNS = 3
"""Most model calls per question (e.g. search, read, answer)."""
SYSTEM = "You answer questions about the user's emails. Reply with the answer only."


class Task(TypedDict):
    """One input: a question about the mailbox of `seed`, and the fact that answers it."""

    seed: int
    question: str
    answer: str
    email_id: int


class State(MessagesState):
    """Graph state: the conversation and which mailbox the tools search."""

    seed: int
    question: str


@tool(parse_docstring=True)
def search_emails(keywords: str, state: Annotated[dict[str, Any], InjectedState]) -> str:
    """Search the mailbox; returns the best matching emails as `id | from | subject | body` lines.

    Args:
        keywords: Words to look for, e.g. "meeting Dana".
    """
    box = mailbox(state["seed"])
    emails = [box.read(hit[0]) for hit in box.search(keywords)]
    return "\n".join(f"{e.id} | {e.sender} | {e.subject} | {e.body}" for e in emails if e) or "no emails found"


@tool(parse_docstring=True)
def read_email(email_id: int, state: Annotated[dict[str, Any], InjectedState]) -> str:
    """Read one email by its id (a number from search_emails).

    Args:
        email_id: The email's id.
    """
    email = mailbox(state["seed"]).read(email_id)
    return f"From: {email.sender}\nSubject: {email.subject}\n{email.body}" if email else f"no email with id {email_id}"


TOOLS = [search_emails, read_email]


def build_agent(model: str = "agent@latest", *, max_tokens: int = 40, temperature: float = 1.0) -> CompiledStateGraph:
    """Compile the agent: model ⇄ tools, at most `MAX_TURNS` model calls."""
    llm = init_chat_model(model, max_tokens=max_tokens, temperature=temperature)

    def ask(state: State) -> dict[str, Any]:
        hits = search_emails.invoke({"keywords": state["question"], "state": state})
        return {"messages": [HumanMessage(f"{state['question']}\n\nSearch results for your question:\n{hits}")]}

    def route(state: State) -> str:
        turns = sum(isinstance(m, AIMessage) for m in state["messages"])
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls and turns < MAX_TURNS else END

    graph = StateGraph(State)
    graph.add_node("ask", ask)
    graph.add_node("agent", chat_node(llm, tools=TOOLS, system=SYSTEM))
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "ask")
    graph.add_edge("ask", "agent")
    graph.add_conditional_edges("agent", route, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    return graph.compile()


def inputs(count: int, seed: int) -> list[Task]:
    """`count` questions, each about its own mailbox, reproducible by `seed`."""
    return [
        Task(seed=q.seed, question=q.question, answer=q.answer, email_id=q.email_id) for q in questions(count, seed)
    ]


def final_answer(output: dict[str, Any]) -> str:
    """The agent's last reply when it is an answer (not a tool call), else ''."""
    last = output["messages"][-1]
    return str(last.content) if isinstance(last, AIMessage) and not last.tool_calls else ""


def _words(text: str) -> str:
    """The text's words (letters and digits, a time such as 9:15 one word), lowercase, one space apart."""
    return " ".join(re.findall(r"[a-z0-9]+(?::[0-9]+)?", text.lower()))


def score(task: Task, output: dict[str, Any]) -> float:
    """1.0 when the final answer states the fact as a whole word (case and punctuation ignored: `$450.00` states
    `$450`, `19:15` does not state `9:15`, nor `123456` the order `12345`), else 0.0."""
    return float(f" {_words(task['answer'])} " in f" {_words(final_answer(output))} ")
