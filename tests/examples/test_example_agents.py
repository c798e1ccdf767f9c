"""The examples' rewards and tools on edge cases a sampled reply can hit (no model: the functions themselves)."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from examples.arithmetic import agent as arithmetic
from examples.calculator import agent as calculator
from examples.email_search import agent as email_search
from examples.email_search.agent import read_email
from examples.summarizer.documents import facts_covered


@pytest.mark.parametrize(("reply", "reward"), [("48", 1.0), ("", 0.0), ("  \n", 0.0), ("5", 0.4)])
def test_arithmetic_pays_no_brevity_for_an_empty_reply(reply: str, reward: float) -> None:
    assert arithmetic.score({"a": 19, "b": 29}, {"reply": reply}) == pytest.approx(reward)


def test_a_calculator_call_nested_too_deep_is_invalid_not_a_crash() -> None:
    expression = "-" * 1024 + "1"  # 16 tokens of SmolLM2's 64-dash token
    with pytest.raises(ValueError, match="cannot evaluate"):
        calculator.evaluate(expression)
    call = AIMessage("", tool_calls=[{"name": "calculator", "args": {"expression": expression}, "id": "1"}])
    messages = [HumanMessage("What is 347*29?"), call, ToolMessage("error", tool_call_id="1"), AIMessage("10063")]
    assert calculator.score({"a": 347, "b": 29}, {"messages": messages}) == pytest.approx(0.7)  # no valid call


@pytest.mark.parametrize("email_id", [0, -1, 31, 2**63, 10**30])
def test_read_email_of_an_id_no_email_has_says_so(email_id: int) -> None:
    assert read_email.invoke({"email_id": email_id, "state": {"seed": 5}}) == f"no email with id {email_id}"


@pytest.mark.parametrize("expression", ["9" * 400 + "*1.5", "1e308*10", "1e308*10-1e308*10", "1e400"])
def test_a_calculator_result_too_large_for_a_float_is_an_error_not_inf(expression: str) -> None:
    with pytest.raises(ValueError, match="cannot evaluate"):
        calculator.evaluate(expression)
    call = AIMessage("", tool_calls=[{"name": "calculator", "args": {"expression": expression}, "id": "1"}])
    messages = [HumanMessage("What is 12*12?"), call, ToolMessage("error", tool_call_id="1"), AIMessage("144")]
    assert calculator.score({"a": 12, "b": 12}, {"messages": messages}) == pytest.approx(0.7)  # no valid call


def test_the_calculator_tool_states_a_product_too_large_for_a_float() -> None:
    assert calculator.calculator.invoke({"expression": "9" * 200 + "*" + "9" * 200}) == str(int("9" * 200) ** 2)


@pytest.mark.parametrize(
    ("extra", "covered"),
    [("9" * 5000, [True, True, False, False]), ("in 02012, 0317 loaves", [True, True, True, True])],
)
def test_summary_numbers_are_read_as_written(extra: str, covered: list[bool]) -> None:
    document = {"text": "", "person": "Ines Novak", "place": "Porto", "year": 2012, "number": 317}
    assert facts_covered(document, f"Novak, Porto: {extra}") == covered  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("answer", "reply", "reward"),
    [
        ("9:15", "At 9:15.", 1.0),
        ("9:15", "9:15am", 1.0),
        ("9:15", "19:15", 0.0),
        ("12345", "Order number 12345, shipped", 1.0),
        ("12345", "123456", 0.0),
        ("$450", "The total is $450.00", 1.0),
        ("$450", "$4,500", 0.0),
        ("A1B2C3", "code:a1b2c3", 1.0),
        ("A1B2C3", "", 0.0),
    ],
)
def test_email_search_credits_the_fact_only_as_a_whole_word(answer: str, reply: str, reward: float) -> None:
    task = {"seed": 1, "question": "?", "answer": answer, "email_id": 1}
    assert email_search.score(task, {"messages": [AIMessage(reply)]}) == reward  # type: ignore[arg-type]
