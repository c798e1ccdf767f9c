"""The examples' rewards and tools on edge cases a sampled reply can hit (no model: the functions themselves)."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from examples.arithmetic import agent as arithmetic
from examples.calculator import agent as calculator
from examples.email_search.agent import read_email


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
