"""Train the summarizer SFT-then-RL: held-out documents before, SFT warm start, GRPO steps, after.

Warm start (as in ART's SFT+RL recipe, here through the trainer's own path): the agent
writes 4 summaries of each of 8 documents, each scored; `POST /v1/sft` then trains one
supervised step on the best summary of each group (best-of-n self-distillation); twice
(`--sft-steps`). Then the usual GRPO steps.

Starts its own collector and trainer (like `make demo`): `python -m examples.summarizer.train`
(`--seeds 0 1 2` repeats it from the base model to show the spread).
"""

from __future__ import annotations

from examples.experiment import Example, main
from examples.summarizer.agent import State, build_agent, documents, score
from examples.summarizer.documents import Document


def describe(document: Document, output: State) -> str:
    """`facts -> 'summary'`."""
    facts = f"{document['person']}, {document['place']}, {document['year']}, {document['number']}"
    return f"[{facts}] -> {output.get('summary', '')!r}"


EXAMPLE = Example(
    name="summarizer",
    title="summarizer (SFT then GRPO): SmolLM2-135M, LoRA",
    build_agent=build_agent,
    inputs=documents,
    score=score,
    describe=describe,
    sft_steps=2,
    steps=8,
    groups=8,
    n=4,
    eval_size=16,
    learning_rate=2e-4,
)

if __name__ == "__main__":
    main(EXAMPLE, doc=__doc__)
