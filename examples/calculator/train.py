"""Train the calculator agent: held-out products before, GRPO steps, held-out products after.

The agent (a LangGraph ReAct loop with a calculator tool bound through `bind_tools`) learns
to call the tool and answer with its result. Starts its own collector and trainer (like
`make demo`): `python -m examples.calculator.train` (`--seeds 0 1 2` repeats it from the
base model to show the spread).
"""

from __future__ import annotations

from examples.calculator.agent import build_agent, describe, problems, score
from examples.experiment import Example, main

EXAMPLE = Example(
    name="calculator",
    title="calculator agent (tool calls): SmolLM2-135M, LoRA GRPO",
    build_agent=build_agent,
    inputs=problems,
    score=score,
    describe=describe,
    steps=6,
    groups=4,
    n=4,
    eval_size=8,
    learning_rate=2e-4,
)

if __name__ == "__main__":
    main(EXAMPLE, doc=__doc__)
