"""Measure an example: held-out score before and after training, over several seeds.

Every example declares an `Example` (its agent, inputs, reward and score) and calls
`main(EXAMPLE)`. For each seed this starts a fresh collector and trainer (so each seed trains
its own adapter from the base model), scores the agent on held-out inputs, optionally warms
it up with supervised steps on the best attempt of each group (`POST /v1/sft`, as in ART's
SFT-then-RL recipe), runs the GRPO steps, scores it again, and writes under
`--workdir`: `seed-K/` (the seed's services, emptied at start: the trainer would resume an
earlier run's checkpoints there), `seed-K/reward_curve.png`, `results.json` (every figure, per seed and summed
up) and `reward_curves.png` (all seeds in one plot).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import art_langgraph
from examples.stack import running_stack
from examples.training_loop import plot_curve, score_attempts, train_steps

EVAL_ATTEMPTS = 4
"""Attempts per held-out input; the held-out score is their mean."""
HELD_OUT_SEED = 10_000
"""Seed s is measured on `inputs(eval_size, HELD_OUT_SEED + s)`."""


@dataclass(frozen=True)
class Example:
    """What an example trains and how it is measured."""

    name: str
    """Task name of its rollouts and the default run folder `runs/<name>`."""
    title: str
    """Title of its plots."""
    build_agent: Callable[[], Any]
    """Compile the LangGraph app (it calls `agent@latest`)."""
    inputs: Callable[[int, int], Sequence[Any]]
    """`inputs(count, seed)`: `count` inputs drawn reproducibly from `seed`.

    Step k of seed s trains on `inputs(groups, 1000 * s + k + 1)`, one group each; the
    held-out inputs are `inputs(eval_size, HELD_OUT_SEED + s)`, never trained on (`parse_args` refuses a seed
    whose steps would reach them)."""
    score: Callable[[Any, Any], float]
    """`score(input, output)` in [0, 1]: the training reward, the curve and the held-out measure."""
    judged_by_collector: bool = False
    """True: the collector's RULER judge rewards the training groups; `score` only measures."""
    rubric: str | None = None
    """The judge's rubric for this task (with `judged_by_collector`)."""
    describe: Callable[[Any, Any], str] = repr
    """One line showing an input and the agent's output, for before/after samples."""
    sft_steps: int = 0
    """Supervised warm-start steps before GRPO: step k samples `groups` inputs
    (`inputs(groups, 100_000 + 1000 * seed + k)`), scores them, and `POST /v1/sft` trains
    on the best attempt of each group."""
    steps: int = 8
    groups: int = 8
    n: int = 4
    eval_size: int = 24
    learning_rate: float = 2e-4
    trainer_args: Sequence[str] = ()
    collector_args: Sequence[str] = ()
    collector_env: dict[str, str] = field(default_factory=dict)
    """Environment of the collector `run_seed` starts (e.g. `ART_COLLECTOR_REWARD_NAME=ruler`)."""


@dataclass
class SeedResult:
    """One seed's figures."""

    seed: int
    before: float
    after: float
    judge_runs: list[dict[str, Any]]
    """The collector's judge runs of the training groups (RULER examples)."""
    curve: list[float]
    """Mean training score of each GRPO step, sampled before the step trained."""
    sft_curve: list[float]
    """Mean score of each SFT step's samples (its targets are their best)."""
    sft_steps_trained: int
    train_seconds: float
    """SFT + GRPO steps, without service start-up and held-out scoring."""
    wall_seconds: float
    """Everything: start the services, score, train, score again."""
    steps_trained: int
    samples: list[tuple[str, str]] = field(default_factory=list)


async def held_out_score(example: Example, inputs: Sequence[Any]) -> tuple[float, list[str]]:
    """Mean score of `agent@latest` on held-out inputs (split `val`), and one sample per input."""
    outputs, _ = await score_attempts(
        example.build_agent(), inputs, example.score, n=EVAL_ATTEMPTS, task=example.name, split="val"
    )
    scores = [example.score(item, out) for item, attempts in zip(inputs, outputs) for out in attempts]
    return statistics.fmean(scores), [example.describe(item, attempts[0]) for item, attempts in zip(inputs, outputs)]


def input_seeds(seed: int, steps: int, sft_steps: int) -> tuple[range, range]:
    """The `inputs` seeds of a seed's GRPO steps and of its SFT steps, one per step (see `Example.inputs`)."""
    return (
        range(1000 * seed + 1, 1000 * seed + steps + 1),
        range(100_000 + 1000 * seed, 100_000 + 1000 * seed + sft_steps),
    )


async def train_seed(example: Example, seed: int, trainer_url: str, collector_url: str) -> SeedResult:
    """Score, warm up, train and score again against running services."""
    started = time.monotonic()
    held_out = example.inputs(example.eval_size, HELD_OUT_SEED + seed)
    grpo_seeds, sft_seeds = input_seeds(seed, example.steps, example.sft_steps)
    before, before_samples = await held_out_score(example, held_out)
    print(f"[{example.name} seed {seed}] held-out before training: {before:.3f}", flush=True)
    train_started = time.monotonic()
    sft = await train_steps(
        example.build_agent(),
        lambda step: example.inputs(example.groups, sft_seeds[step]),
        example.score,
        steps=example.sft_steps,
        n=example.n,
        task=example.name,
        trainer_url=trainer_url,
        endpoint="/v1/sft",
    )
    reports = await train_steps(
        example.build_agent(),
        lambda step: example.inputs(example.groups, grpo_seeds[step]),
        example.score,
        steps=example.steps,
        n=example.n,
        task=example.name,
        trainer_url=trainer_url,
        collector_url=collector_url if example.judged_by_collector else None,
        rubric=example.rubric,
    )
    train_seconds = time.monotonic() - train_started
    after, after_samples = await held_out_score(example, held_out)
    print(f"[{example.name} seed {seed}] held-out after training: {after:.3f}", flush=True)
    return SeedResult(
        seed=seed,
        before=before,
        after=after,
        judge_runs=[run for r in reports for run in r.judge_runs],
        curve=[r.reward for r in reports],
        sft_curve=[r.reward for r in sft],
        sft_steps_trained=sum(r.model is not None for r in sft),
        train_seconds=train_seconds,
        wall_seconds=time.monotonic() - started,
        steps_trained=sum(r.model is not None for r in reports),
        samples=list(zip(before_samples, after_samples))[:5],
    )


def fresh_folder(folder: Path) -> None:
    """Create `folder` empty, removing an earlier run's there (collector database, checkpoints, logs).

    The trainer resumes from the checkpoints it finds: a seed run over an earlier one would start
    from that run's adapter, not from the base model.
    """
    if folder.exists():
        print(f"removing the earlier run in {folder}", flush=True)
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def run_seed(example: Example, seed: int, workdir: Path) -> SeedResult:
    """Start a fresh collector and trainer under `workdir` (emptied first), train one seed, stop them."""
    started = time.monotonic()
    fresh_folder(workdir)
    print(
        f"[{example.name} seed {seed}] starting collector and trainer (logs in {workdir}); "
        "vLLM takes about a minute...",
        flush=True,
    )
    trainer_args = ["--learning-rate", str(example.learning_rate), *example.trainer_args]
    with running_stack(
        workdir, trainer_args=trainer_args, collector_args=example.collector_args, env=example.collector_env
    ) as (collector, trainer):
        art_langgraph.configure(collector_url=collector.url, trainer_url=f"{trainer.url}/v1", model="agent@latest")
        result = asyncio.run(train_seed(example, seed, trainer.url, collector.url))
        art_langgraph.flush()
    result.wall_seconds = time.monotonic() - started
    plot_curve(
        result.curve, result.before, result.after, workdir / "reward_curve.png", f"{example.title} (seed {seed})"
    )
    return result


def summarize(results: Sequence[SeedResult]) -> dict[str, float]:
    """Mean and spread (sample standard deviation; 0 for one seed) of before, after and the gain."""

    def spread(values: list[float]) -> float:
        return statistics.stdev(values) if len(values) > 1 else 0.0

    before, after = [r.before for r in results], [r.after for r in results]
    gain = [a - b for a, b in zip(after, before)]
    return {
        "before_mean": statistics.fmean(before),
        "before_std": spread(before),
        "after_mean": statistics.fmean(after),
        "after_std": spread(after),
        "gain_mean": statistics.fmean(gain),
        "gain_std": spread(gain),
        "train_minutes_mean": statistics.fmean(r.train_seconds for r in results) / 60,
        "wall_minutes_mean": statistics.fmean(r.wall_seconds for r in results) / 60,
    }


def plot_seeds(results: Sequence[SeedResult], path: Path, title: str) -> None:
    """All seeds' training curves and held-out before/after in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        (line,) = ax.plot(range(len(r.curve)), r.curve, marker=".", alpha=0.7, label=f"seed {r.seed}: training")
        ax.plot(
            [0, len(r.curve)],
            [r.before, r.after],
            linestyle="--",
            marker="s",
            color=line.get_color(),
            label=f"seed {r.seed}: held-out",
        )
    ax.set_xlabel("policy step")
    ax.set_ylabel("score (mean over attempts)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(example: Example, results: Sequence[SeedResult], workdir: Path) -> dict[str, Any]:
    """Write results.json (every figure, per seed and summed up) and reward_curves.png; return the summary."""
    summary = {
        "example": example.name,
        "steps": example.steps,
        "groups": example.groups,
        "n": example.n,
        "sft_steps": example.sft_steps,
        "eval_size": example.eval_size,
        "learning_rate": example.learning_rate,
        "seeds": [asdict(r) for r in results],
        **summarize(results),
    }
    (workdir / "results.json").write_text(json.dumps(summary, indent=2))
    plot_seeds(results, workdir / "reward_curves.png", example.title)
    return summary


def measure(example: Example, seeds: Sequence[int], workdir: Path) -> dict[str, Any]:
    """Train every seed from the base model; return the summary `write_results` wrote.

    The results are written again after each seed, so a run that fails or is stopped at a later seed keeps the figures
    of the seeds it finished.
    """
    if not seeds:
        raise ValueError("measure needs at least one seed")
    results: list[SeedResult] = []
    for seed in seeds:
        results.append(run_seed(example, seed, workdir / f"seed-{seed}"))
        summary = write_results(example, results, workdir)
    return summary


def report(summary: dict[str, Any]) -> str:
    """The before/after table a person reads at the end of a run."""
    lines = [f"=== {summary['example']}: held-out score ({EVAL_ATTEMPTS} attempts per input) ==="]
    for r in summary["seeds"]:
        lines.append(
            f"seed {r['seed']}: {r['before']:.3f} -> {r['after']:.3f}"
            f"  ({r['sft_steps_trained']} SFT + {r['steps_trained']} GRPO"
            f" steps trained, {r['train_seconds'] / 60:.1f} min training, {r['wall_seconds'] / 60:.1f} min in all)"
        )
        lines += [f"    before {old}\n    after  {new}" for old, new in r["samples"][:3]]
    lines.append(
        f"mean ± sd over {len(summary['seeds'])} seeds:"
        f" before {summary['before_mean']:.3f} ± {summary['before_std']:.3f},"
        f" after {summary['after_mean']:.3f} ± {summary['after_std']:.3f},"
        f" gain {summary['gain_mean']:+.3f} ± {summary['gain_std']:.3f}"
    )
    return "\n".join(lines)


def parse_args(example: Example, argv: Sequence[str] | None, doc: str | None) -> argparse.Namespace:
    """Command-line options shared by every example."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=example.steps, help=f"GRPO steps per seed (default: {example.steps})"
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=example.groups,
        help=f"inputs per step, one group each (default: {example.groups})",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=example.sft_steps,
        help=f"supervised warm-start steps before GRPO (default: {example.sft_steps})",
    )
    parser.add_argument(
        "--n",
        type=int,
        default=example.n,
        help=f"attempts per input, the group size; at least 2: GRPO learns from their differences "
        f"(default: {example.n})",
    )
    parser.add_argument(
        "--eval-size",
        type=int,
        default=example.eval_size,
        help=f"held-out inputs, {EVAL_ATTEMPTS} attempts each (default: {example.eval_size})",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=example.learning_rate,
        help=f"LoRA learning rate (default: {example.learning_rate})",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="seeds to train, each from the base model with its own services (default: 0)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs") / example.name,
        help=f"logs, checkpoints, results.json and PNGs; each seed-K folder in it is emptied at start "
        f"(default: runs/{example.name})",
    )
    args = parser.parse_args(argv)
    # Checked here: a bad value would otherwise fail only after the services started (vLLM: a minute) and an earlier
    # run's seed folders were emptied.
    for flag, value, least in (
        ("--steps", args.steps, 0),
        ("--sft-steps", args.sft_steps, 0),
        ("--groups", args.groups, 1),
        ("--n", args.n, 2),  # a group of one has no reward spread: no GRPO step would train
        ("--eval-size", args.eval_size, 1),
    ):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        parser.error(f"--learning-rate must be a positive finite number, got {args.learning_rate}")
    if len(set(args.seeds)) < len(args.seeds):
        seeds = " ".join(map(str, args.seeds))
        parser.error(f"--seeds names a seed twice ({seeds}): its second run would replace the first")
    for seed in args.seeds:
        if any(HELD_OUT_SEED + seed in drawn for drawn in input_seeds(seed, args.steps, args.sft_steps)):
            parser.error(f"--seeds {seed}: its training steps would reach its held-out inputs; pick another seed")
    problem = workdir_problem(args.workdir)
    if problem:
        parser.error(problem)
    return args


def workdir_problem(workdir: Path) -> str | None:
    """Why the run could not create its seed folders in `--workdir`, as a one-line error; None when it can."""
    existing = next(folder for folder in (workdir, *workdir.parents) if folder.exists())
    subject = f"--workdir {workdir}" if existing == workdir else f"--workdir {workdir} cannot be created: {existing}"
    if not existing.is_dir():
        return f"{subject} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{subject} is not writable"
    return None


def main(example: Example, argv: Sequence[str] | None = None, doc: str | None = None) -> dict[str, Any]:
    """Parse the shared options, measure every seed, print the table; return the results."""
    args = parse_args(example, argv, doc)
    configured = dataclasses.replace(
        example,
        steps=args.steps,
        sft_steps=args.sft_steps,
        groups=args.groups,
        n=args.n,
        eval_size=args.eval_size,
        learning_rate=args.learning_rate,
    )
    summary = measure(configured, args.seeds, args.workdir)
    print(report(summary))
    print(f"results: {args.workdir / 'results.json'}; curves: {args.workdir / 'reward_curves.png'}")
    return summary
