"""A tool-using LangGraph agent: it multiplies with a calculator tool, and learns to.

The agent is a ReAct loop: `chat_node` (the model with the calculator bound through
`bind_tools`) and LangGraph's `ToolNode`. The bundled SmolLM2-135M-Instruct cannot multiply
two- and three-digit numbers in its head; with three worked examples in the conversation it
calls the calculator in about a third of its replies and guesses (or invents a tool result)
in the rest. The reward pays most for the right product in the final answer, some for a
valid calculator call and a little for a short answer, so groups of attempts differ and GRPO
learns to call the tool and repeat its result.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable
from typing import Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolInvocationError

from art_langgraph import chat_node, init_chat_model

SYSTEM = "You are a math assistant. Always use the calculator tool for arithmetic."
"""System message; the worked examples below teach the format more than it does."""
WORKED_EXAMPLES = [(23, 47), (58, 16), (71, 34)]
"""Products shown in the conversation as complete tool-using exchanges (call, result, answer)."""
MAX_TOOL_ROUNDS = 1
"""Tool rounds per question; the model's reply after the last one ends the run."""
ANSWER_WEIGHT, CALL_WEIGHT, RIGHT_CALL_WEIGHT, BREVITY_WEIGHT = 0.5, 0.2, 0.1, 0.2
"""Reward parts: right final number, a calculator call that evaluates, whose value is the
product, and a short final answer. They sum to 1."""
SHORT_ANSWER_CHARS, LONG_ANSWER_CHARS = 12, 60
"""Final answers up to the first length earn the full brevity credit, from the second none."""

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class Problem(TypedDict):
    """One question: what is a*b?"""

    a: int
    b: int


class State(MessagesState):
    """Graph state: the conversation, and the product asked for."""

    a: int
    b: int


def evaluate(expression: str) -> int | float:
    """Evaluate `+ - * /` and parentheses over numbers; anything else, nesting too deep or a result too large for a
    float (inf, nan) raises ValueError."""

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))  # type: ignore[no-any-return]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))  # type: ignore[no-any-return]
        raise ValueError(f"unsupported element {ast.dump(node)[:40]!r}: use numbers, + - * / and parentheses")

    try:
        value = walk(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)
    except (SyntaxError, ZeroDivisionError, RecursionError, OverflowError) as error:  # `-` * 1000: 16 dash tokens
        raise ValueError(f"cannot evaluate {expression!r}: {error}") from error
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot evaluate {expression!r}: the result is too large")
    return value


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 347*29 and return the result."""
    value = evaluate(expression)
    return str(int(value)) if isinstance(value, int) or value.is_integer() else f"{value:.6g}"


def worked_example(a: int, b: int, index: int) -> list[AnyMessage]:
    """One complete exchange: question, calculator call, its result, the bare answer."""
    call_id = f"example_{index}"
    return [
        HumanMessage(f"What is {a}*{b}?"),
        AIMessage("", tool_calls=[{"name": "calculator", "args": {"expression": f"{a}*{b}"}, "id": call_id}]),
        ToolMessage(calculator.invoke({"expression": f"{a}*{b}"}), tool_call_id=call_id),
        AIMessage(str(a * b)),
    ]


def problems(count: int, seed: int) -> list[Problem]:
    """`count` products of a number in 12..999 and one in 12..99, reproducible by `seed`."""
    rng = random.Random(seed)
    return [Problem(a=rng.randint(12, 999), b=rng.randint(12, 99)) for _ in range(count)]


def build_agent(model: str = "agent@latest", *, max_tokens: int = 40, temperature: float = 1.0) -> CompiledStateGraph:
    """Compile the ReAct graph: ask → (calculator → ask) at most `MAX_TOOL_ROUNDS` times."""
    llm = init_chat_model(model, max_tokens=max_tokens, temperature=temperature)

    def ask(state: State) -> dict[str, list[AnyMessage]]:
        examples = [m for i, (a, b) in enumerate(WORKED_EXAMPLES) for m in worked_example(a, b, i)]
        return {"messages": [SystemMessage(SYSTEM), *examples, HumanMessage(f"What is {state['a']}*{state['b']}?")]}

    def route(state: State) -> str:
        last = state["messages"][-1]
        rounds = sum(isinstance(m, ToolMessage) for m in attempt(state["messages"]))
        return "tools" if isinstance(last, AIMessage) and last.tool_calls and rounds < MAX_TOOL_ROUNDS else "end"

    graph = StateGraph(State)
    graph.add_node("ask", ask)
    graph.add_node("agent", chat_node(llm, tools=[calculator]))
    graph.add_node("tools", ToolNode([calculator], handle_tool_errors=(ValueError, ToolInvocationError)))
    graph.add_edge(START, "ask")
    graph.add_edge("ask", "agent")
    graph.add_conditional_edges("agent", route, {"tools": "tools", "end": END})
    graph.add_edge("tools", "agent")
    return graph.compile()


def attempt(messages: list[AnyMessage]) -> list[AnyMessage]:
    """The messages after the last question: the agent's own turns and the tool results."""
    last_question = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
    return messages[last_question + 1 :]


def final_answer(messages: list[AnyMessage]) -> str:
    """The text of the agent's last reply, or "" when it ended on a tool call."""
    last = messages[-1]
    return "" if not isinstance(last, AIMessage) or last.tool_calls else str(last.content).strip()


def calculator_values(messages: list[AnyMessage]) -> list[int | float | None]:
    """The value of each calculator call the agent made (None where it could not be evaluated)."""
    values: list[int | float | None] = []
    for message in attempt(messages):
        for call in message.tool_calls if isinstance(message, AIMessage) else []:
            try:
                values.append(evaluate(str(call["args"]["expression"])) if call["name"] == "calculator" else None)
            except (KeyError, ValueError):
                values.append(None)
    return values


def states_number(text: str, number: int) -> bool:
    """True when `text` contains `number` (thousands separators allowed)."""
    return str(number) in (found.replace(",", "") for found in re.findall(r"\d[\d,]*", text))


def score(problem: Problem, output: State) -> float:
    """Reward in [0, 1]: 0.5 right final number, 0.2 a valid calculator call (+0.1 if its value
    is the product), up to 0.2 for a short final answer."""
    product = problem["a"] * problem["b"]
    answer = final_answer(output["messages"])
    values = calculator_values(output["messages"])
    span = LONG_ANSWER_CHARS - SHORT_ANSWER_CHARS
    brevity = min(1.0, max(0.0, (LONG_ANSWER_CHARS - len(answer)) / span)) if answer else 0.0
    return (
        ANSWER_WEIGHT * states_number(answer, product)
        + CALL_WEIGHT * any(v is not None for v in values)
        + RIGHT_CALL_WEIGHT * (product in values)
        + BREVITY_WEIGHT * brevity
    )


def describe(problem: Problem, output: State) -> str:
    """`a*b -> calculator({"expression": …}) -> 'answer'`, for before/after samples."""
    calls = [
        f"{call['name']}({json.dumps(call['args'])})"
        for m in attempt(output["messages"])
        if isinstance(m, AIMessage)
        for call in m.tool_calls
    ]
    return " -> ".join([f"{problem['a']}*{problem['b']}", *calls, repr(final_answer(output["messages"]))])
