"""Train the tic-tac-toe agent: held-out games before, GRPO steps, held-out games after.

Starts its own collector and trainer (like `make demo`): `python -m examples.tictactoe.train`
(`--seeds 0 1 2` repeats it from the base model to show the spread).
"""

from __future__ import annotations

from examples.experiment import Example, main
from examples.tictactoe.agent import Game, State, build_agent, games, score


def describe(game: Game, output: State) -> str:
    """`game N: outcome after M moves`."""
    return f"game {game['seed']}: {output.get('outcome')} after {output.get('moves', 0)} moves"


EXAMPLE = Example(
    name="tictactoe",
    title="tic-tac-toe agent: SmolLM2-135M, LoRA GRPO",
    build_agent=build_agent,
    inputs=games,
    score=score,
    describe=describe,
    steps=10,
    groups=8,
    n=4,
    eval_size=16,
    learning_rate=2e-4,
)

if __name__ == "__main__":
    main(EXAMPLE, doc=__doc__)
