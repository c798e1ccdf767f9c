"""Train the tic-tac-toe agent: held-out games before, GRPO steps, held-out games after.

Starts its own collector and trainer (like `make demo`): `python -m examples.tictactoe.train`.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

from examples.tictactoe.agent import Game, build_agent, games, score
from examples.training_loop import plot_curve, run_with_services, score_attempts, train_steps

TASK = "tictactoe"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps (default: 10)")
    parser.add_argument("--games", type=int, default=8, help="games per step, one group each (default: 8)")
    parser.add_argument("--n", type=int, default=4, help="attempts per game, the group size (default: 4)")
    parser.add_argument("--eval-games", type=int, default=16, help="held-out games, 4 attempts each (default: 16)")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="LoRA learning rate (default: 2e-4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the games (default: 0)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/tictactoe"), help="logs and the PNG (default: runs/tictactoe)")
    return parser.parse_args(argv)


async def evaluate(held_out: list[Game]) -> tuple[float, Counter[str]]:
    """Mean reward and outcome counts of `agent@latest` on held-out games (split `val`)."""
    outputs, rewards = await score_attempts(build_agent(), held_out, score, n=4, task=TASK, split="val")
    return statistics.fmean(rewards), Counter(o["outcome"] for attempts in outputs for o in attempts)


async def run(args: argparse.Namespace, trainer_url: str) -> None:
    """Evaluate, train, evaluate again, and report."""
    held_out = games(args.eval_games, seed=10_000 + args.seed)
    before, before_outcomes = await evaluate(held_out)
    print(f"held-out before: reward {before:.3f}, outcomes {dict(before_outcomes)}", flush=True)
    reports = await train_steps(
        build_agent(),
        lambda step: games(args.games, seed=args.seed * 1000 + step + 1),
        score,
        steps=args.steps,
        n=args.n,
        task=TASK,
        trainer_url=trainer_url,
    )
    after, after_outcomes = await evaluate(held_out)
    print(f"held-out after : reward {after:.3f}, outcomes {dict(after_outcomes)}")
    png = args.workdir / "reward_curve.png"
    plot_curve([r.reward for r in reports], before, after, png, "tic-tac-toe agent: SmolLM2-135M, LoRA GRPO")
    print(f"reward curve: {png}")


def main(argv: list[str] | None = None) -> None:
    """Start the services, train, report."""
    args = parse_args(argv)
    run_with_services(args.workdir, args.learning_rate, lambda trainer_url: run(args, trainer_url))


if __name__ == "__main__":
    main()
