"""`make demo`: the whole loop on the embedded defaults, and proof that the agent improves.

Starts a collector (SQLite) and a trainer (vLLM + bundled SmolLM2 + LoRA GRPO), measures the
agent on held-out sums, then for each step runs groups of attempts through the LangGraph
agent (traced by `art_langgraph`), scores them in code, and asks the trainer for one GRPO
step, which hot-loads `agent@N` for the next round. Ends with a before/after comparison and
a reward-curve PNG. `--seeds 0 1 2` repeats it from the base model to show the spread.
"""

from __future__ import annotations

from examples.arithmetic.agent import Problem, State, build_agent, problems, score
from examples.experiment import Example, main


def describe(problem: Problem, output: State) -> str:
    """`a+b -> 'reply'`."""
    return f"{problem['a']}+{problem['b']} -> {output.get('reply', '')!r}"


EXAMPLE = Example(
    name="arithmetic",
    title="arithmetic agent: SmolLM2-135M, LoRA GRPO",
    build_agent=build_agent,
    inputs=problems,
    score=score,
    describe=describe,
    steps=8,
    groups=8,
    n=4,
    eval_size=24,
    learning_rate=2e-4,
)

if __name__ == "__main__":
    main(EXAMPLE, doc=__doc__)
