"""`make demo`: the whole loop on the embedded defaults, and proof that the agent improves.

Starts a collector (SQLite) and a trainer (vLLM + bundled SmolLM2 + LoRA GRPO), measures the
agent on held-out sums, then for each step runs groups of attempts through the LangGraph
agent (traced by `art_langgraph`), scores them in code, and asks the trainer for one GRPO
step, which hot-loads `agent@N` for the next round. Ends with a before/after comparison and
a reward-curve PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import art_langgraph
from examples.arithmetic.agent import Problem, build_agent, is_correct, problems, score
from examples.stack import running_stack


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


async def evaluate(model: str, held_out: list[Problem], label: str) -> tuple[float, float, list[str]]:
    """Mean reward and accuracy of `model` on held-out problems (split `val`, never trained on)."""
    agent = build_agent(model)
    outputs = await art_langgraph.gather(agent, held_out, n=4, reward=score, task="arithmetic", split="val")
    rewards, correct, samples = [], [], []
    for problem, attempts in zip(held_out, outputs):
        for output in attempts:
            rewards.append(score(problem, output))
            correct.append(is_correct(problem, output["reply"]))
        samples.append(f"{problem['a']}+{problem['b']} -> {attempts[0]['reply']!r}")
    return statistics.fmean(rewards), statistics.fmean(correct), samples


def plot(curve: list[float], before: float, after: float, path: Path) -> None:
    """Write the per-step training reward and the held-out before/after as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(curve)), curve, marker="o", label="training groups (mean reward)")
    ax.scatter([0, len(curve)], [before, after], color="tab:red", zorder=3, label="held-out (mean reward)")
    ax.set_xlabel("policy step")
    ax.set_ylabel("reward")
    ax.set_title("arithmetic agent: SmolLM2-135M, LoRA GRPO")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def train(args: argparse.Namespace, trainer_url: str) -> list[float]:
    """Run the collect → score → train loop; return the mean training reward per step."""
    agent = build_agent("agent@latest")
    curve = []
    async with httpx.AsyncClient(base_url=trainer_url, timeout=600) as client:
        for step in range(args.steps):
            batch = problems(args.groups, seed=args.seed * 1000 + step + 1)
            started = time.monotonic()
            outputs = await art_langgraph.gather(
                agent, batch, n=args.n, reward=score, task="arithmetic"
            )
            rewards = [score(p, o) for p, attempts in zip(batch, outputs) for o in attempts]
            curve.append(statistics.fmean(rewards))
            art_langgraph.flush()
            response = await client.post("/v1/train")
            if response.status_code in (409, 422):  # nothing ready / no group with reward spread
                print(f"step skipped: {response.json()['error']['message']}", flush=True)
                continue
            response.raise_for_status()
            result = response.json()
            metrics = result["metrics"]
            print(
                f"step {result['step']}/{args.steps}: reward {curve[-1]:.3f} | grad norm {metrics['grad/norm']:.3f}"
                f" | groups trained {metrics['data/groups_trained']:.0f}/{metrics['data/groups']:.0f}"
                f" | {time.monotonic() - started:.0f} s -> serving {result['model']}",
                flush=True,
            )
    return curve


async def run(args: argparse.Namespace, trainer_url: str) -> None:
    """Evaluate, train, evaluate again, and report."""
    held_out = problems(args.eval_size, seed=10_000 + args.seed)
    before, before_acc, before_samples = await evaluate("agent@latest", held_out, "held-out, base model")
    print(f"held-out before training: reward {before:.3f}, right sum {before_acc:.0%}", flush=True)
    curve = await train(args, trainer_url)
    after, after_acc, after_samples = await evaluate("agent@latest", held_out, "held-out, trained")
    print("\n=== before -> after (held-out, 4 attempts per problem) ===")
    print(f"mean reward : {before:.3f} -> {after:.3f}")
    print(f"right sum   : {before_acc:.0%} -> {after_acc:.0%}")
    for old, new in list(zip(before_samples, after_samples))[:5]:
        print(f"  before {old}\n  after  {new}")
    png = args.workdir / "reward_curve.png"
    plot(curve, before, after, png)
    print(f"reward curve: {png}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `make demo`."""
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    print(f"starting collector and trainer (logs in {state}); vLLM takes about a minute to start...", flush=True)
    trainer_args = ["--learning-rate", str(args.learning_rate)]
    with running_stack(state, trainer_args=trainer_args) as (collector, trainer):
        art_langgraph.configure(collector_url=collector.url, trainer_url=f"{trainer.url}/v1", model="agent@latest")
        asyncio.run(run(args, trainer.url))
        art_langgraph.flush()


if __name__ == "__main__":
    main()
