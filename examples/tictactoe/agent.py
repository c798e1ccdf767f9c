"""A multi-turn LangGraph game agent: tic-tac-toe against a scripted opponent.

The agent plays X. Each turn it sees the board in the same growing conversation and replies
with a cell number; a scripted opponent (random legal moves, seeded per game) answers. The
reward is the outcome, with partial credit for legal moves so a small model has a gradient
before it ever wins: a legal game is worth far more than an illegal reply.
"""

from __future__ import annotations

import random
import re
from typing import Literal, TypedDict

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from art_langgraph import init_chat_model

Outcome = Literal["playing", "win", "loss", "draw", "illegal"]
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
RULES = "Tic-tac-toe. You are X, I am O. Cells are numbered 1 to 9, left to right, top to bottom."


class Game(TypedDict):
    """One game: the seed of the opponent's moves."""

    seed: int


class State(TypedDict, total=False):
    """Graph state: board, conversation, outcome."""

    seed: int
    board: list[str]
    messages: list[BaseMessage]
    moves: int
    outcome: Outcome


def render(board: list[str]) -> str:
    """The board as three rows, free cells shown by their number."""
    cells = [mark if mark != " " else str(i + 1) for i, mark in enumerate(board)]
    return "\n".join(" ".join(cells[row * 3 : row * 3 + 3]) for row in range(3))


def winner(board: list[str]) -> str | None:
    """`X` or `O` when that player holds a line, else None."""
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def outcome_after(board: list[str]) -> Outcome:
    """The game's state after a move."""
    mark = winner(board)
    if mark is not None:
        return "win" if mark == "X" else "loss"
    return "draw" if " " not in board else "playing"


def parse_move(reply: str, board: list[str]) -> int | None:
    """The cell index (0-8) the reply names, or None when it names no free cell."""
    found = re.search(r"[1-9]", reply)
    if found is None:
        return None
    cell = int(found.group()) - 1
    return cell if board[cell] == " " else None


def build_agent(model: str = "agent@latest", *, temperature: float = 1.0) -> CompiledStateGraph:
    """Compile the game graph: agent and opponent alternate until the game ends."""
    llm = init_chat_model(model, max_tokens=6, temperature=temperature)

    def start(state: State) -> State:
        return {"board": [" "] * 9, "messages": [], "moves": 0, "outcome": "playing"}

    def agent(state: State) -> State:
        board = list(state["board"])
        free = ", ".join(str(i + 1) for i, mark in enumerate(board) if mark == " ")
        intro = f"{RULES}\n" if not state["messages"] else ""
        prompt = f"{intro}Board:\n{render(board)}\nFree cells: {free}. Pick one. Answer with just one digit."
        messages = [*state["messages"], HumanMessage(prompt)]
        reply = llm.invoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        cell = parse_move(str(reply.content), board)
        if cell is None:
            return {"messages": messages, "outcome": "illegal"}
        board[cell] = "X"
        return {"messages": messages, "board": board, "moves": state["moves"] + 1, "outcome": outcome_after(board)}

    def opponent(state: State) -> State:
        board = list(state["board"])
        rng = random.Random(state["seed"] * 31 + state["moves"])
        board[rng.choice([i for i, mark in enumerate(board) if mark == " "])] = "O"
        return {"board": board, "outcome": outcome_after(board)}

    def next_after(state: State) -> str:
        return "continue" if state["outcome"] == "playing" else "end"

    graph = StateGraph(State)
    graph.add_node("start", start)
    graph.add_node("agent", agent)
    graph.add_node("opponent", opponent)
    graph.add_edge(START, "start")
    graph.add_edge("start", "agent")
    graph.add_conditional_edges("agent", next_after, {"continue": "opponent", "end": END})
    graph.add_conditional_edges("opponent", next_after, {"continue": "agent", "end": END})
    return graph.compile()


def games(count: int, seed: int) -> list[Game]:
    """`count` games with reproducible opponents."""
    rng = random.Random(seed)
    return [Game(seed=rng.randrange(1_000_000)) for _ in range(count)]


def score(game: Game, output: State) -> float:
    """Win 1.0, draw 0.7, loss 0.4; an illegal reply ends the game at 0.1 per legal move made."""
    outcome = output["outcome"]
    if outcome == "illegal":
        return 0.1 * output["moves"]
    return {"win": 1.0, "draw": 0.7, "loss": 0.4}[outcome]
