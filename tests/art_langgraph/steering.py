"""Steering a small model to a tool call with vLLM's guided decoding (agent tests)."""

from __future__ import annotations

ADD_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 3, "b": 4\}\}\n</tool_call>'
"""A Hermes tool call the model is steered to emit (vLLM guided decoding with a regex); vLLM's
`hermes` parser, not the test, turns it into `tool_calls`."""
FINAL_ANSWER = r"The answer is 7\."
"""A final answer the model is steered to emit once the tool result is in the conversation."""


def steer(regex: str) -> dict:
    """Request kwargs that make vLLM's guided decoding emit text matching `regex`.

    A 135M model seldom calls tools on its own; steering keeps the agent tests deterministic
    while the engine still samples every token (ids and logprobs stay real).
    """
    return {"extra_body": {"structured_outputs": {"regex": regex}}}


def has_tool_result(messages: list) -> bool:
    """True once a tool message is in the conversation (the agent's second model turn)."""
    return any(getattr(m, "type", None) == "tool" for m in messages)


STEERED_MAX_TOKENS = 96
"""Room for a steered answer: guided decoding may spell the tool call in many small tokens
(`<`, `tool`, `_`, ...), and a call cut short is not parsed as one."""
