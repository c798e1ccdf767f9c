"""Train the email-search agent with RULER: held-out questions before, GRPO steps, after.

Starts its own collector (training on RULER: the loop has the collector's judge, the
trainer's base model, score each new group; its `ruler` scores are the reward) and trainer, like
`make demo`: `python -m examples.email_search.train` (`--seeds 0 1 2` repeats it from the
base model to show the spread). The held-out measure is the code check `agent.score`.
"""

from __future__ import annotations

from examples.email_search.agent import Task, build_agent, final_answer, inputs, score
from examples.experiment import Example, main

RUBRIC = """\
- The user asked one question about their emails; the search results in the context are the emails.
- The best answer states the exact fact the question asks for (a number, time, amount or code), copied from the \
email that matches the question, and nothing else.
- An answer with a fact from another email, an invented fact, or no fact scores low.
- Between equally correct answers, the shorter one scores higher."""

COLLECTOR_ENV = {
    "ART_COLLECTOR_REWARD_NAME": "ruler",
    "ART_COLLECTOR_JUDGE_MODEL": "SmolLM2-135M-Instruct",
    "ART_COLLECTOR_JUDGE_EXPLANATION_MAX_CHARS": "60",
    "ART_COLLECTOR_JUDGE_MAX_TOKENS": "512",
    "ART_COLLECTOR_JUDGE_ON_FAILURE": "zero",
}
"""The collector trains on the judge's `ruler` scores. The judge is the stack's trainer
(`examples.stack.running_stack` gives the collector `ART_TRAINER_URL`); the training loop asks
it to judge each new group (`POST /v1/groups/{id}/judge` with `RUBRIC`). `zero`: a judge
answer that cannot be used scores the group 0 (no spread: skipped) instead of a retry."""


def describe(task: Task, output: dict) -> str:
    """`question -> answer (want: fact)`."""
    return f"{task['question']} -> {final_answer(output)[:60]!r} (want {task['answer']})"


EXAMPLE = Example(
    name="email_search",
    title="email-search agent (RULER reward): SmolLM2-135M, LoRA GRPO",
    build_agent=build_agent,
    inputs=inputs,
    score=score,
    judged_by_collector=True,
    rubric=RUBRIC,
    collector_env=COLLECTOR_ENV,
    describe=describe,
    steps=6,
    groups=6,
    n=4,
    eval_size=12,
    learning_rate=2e-4,
)

if __name__ == "__main__":
    main(EXAMPLE, doc=__doc__)
