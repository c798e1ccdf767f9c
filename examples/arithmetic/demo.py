"""`make demo`: the whole loop on the embedded defaults, and proof that the agent improves.

Starts a collector (SQLite) and a trainer (vLLM + bundled SmolLM2 + LoRA GRPO), measures the
agent on held-out sums, then for each step runs groups of attempts through the LangGraph
agent (traced by `art_langgraph`), scores them in code, and asks the trainer for one GRPO
step, which hot-loads `agent@N` for the next round. Ends with a before/after comparison and
a reward-curve PNG.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from examples.arithmetic.agent import Problem, build_agent, is_correct, problems, score
from examples.training_loop import plot_curve, run_with_services, score_attempts, train_steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the demo."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps to run (default: 8)")
    parser.add_argument("--groups", type=int, default=8, help="problems per step, one group each (default: 8)")
    parser.add_argument("--n", type=int, default=4, help="attempts per problem, the group size (default: 4)")
    parser.add_argument("--eval-size", type=int, default=24, help="held-out problems, 4 attempts each (default: 24)")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="LoRA learning rate (default: 2e-4)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the problems (default: 0)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="logs, database, checkpoints and the PNG (default: runs/demo)")
    return parser.parse_args(argv)


async def evaluate(held_out: list[Problem]) -> tuple[float, float, list[str]]:
    """Mean reward and accuracy of `agent@latest` on held-out problems (split `val`, never trained on)."""
    outputs, rewards = await score_attempts(build_agent(), held_out, score, n=4, task="arithmetic", split="val")
    correct = [is_correct(p, o["reply"]) for p, attempts in zip(held_out, outputs) for o in attempts]
    samples = [f"{p['a']}+{p['b']} -> {attempts[0]['reply']!r}" for p, attempts in zip(held_out, outputs)]
    return statistics.fmean(rewards), statistics.fmean(correct), samples


async def run(args: argparse.Namespace, trainer_url: str) -> None:
    """Evaluate, train, evaluate again, and report."""
    held_out = problems(args.eval_size, seed=10_000 + args.seed)
    before, before_acc, before_samples = await evaluate(held_out)
    print(f"held-out before training: reward {before:.3f}, right sum {before_acc:.0%}", flush=True)
    reports = await train_steps(
        build_agent(),
        lambda step: problems(args.groups, seed=args.seed * 1000 + step + 1),
        score,
        steps=args.steps,
        n=args.n,
        task="arithmetic",
        trainer_url=trainer_url,
    )
    after, after_acc, after_samples = await evaluate(held_out)
    print("\n=== before -> after (held-out, 4 attempts per problem) ===")
    print(f"mean reward : {before:.3f} -> {after:.3f}")
    print(f"right sum   : {before_acc:.0%} -> {after_acc:.0%}")
    for old, new in list(zip(before_samples, after_samples))[:5]:
        print(f"  before {old}\n  after  {new}")
    png = args.workdir / "reward_curve.png"
    plot_curve([r.reward for r in reports], before, after, png, "arithmetic agent: SmolLM2-135M, LoRA GRPO")
    print(f"reward curve: {png}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `make demo`."""
    args = parse_args(argv)
    run_with_services(args.workdir, args.learning_rate, lambda trainer_url: run(args, trainer_url))


if __name__ == "__main__":
    main()
