"""The collect → score → train loop every example runs, written once.

Each step runs groups of attempts through the agent (traced by `art_langgraph`, scored in
code by `reward(input, output)`), flushes the spans to the collector and asks the trainer
for one GRPO step, which hot-loads `agent@N` for the next round.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import art_langgraph
from examples.stack import running_stack


@dataclass
class StepReport:
    """One step of the loop: the mean reward of its attempts and what training made of them."""

    reward: float
    model: str | None = None
    """The checkpoint the step published (`agent@N`); None when the step was skipped."""
    metrics: dict[str, float] = field(default_factory=dict)


async def score_attempts(
    graph: Any, inputs: Sequence[Any], reward: Callable[[Any, Any], float], *, n: int, task: str, split: str
) -> tuple[list[list[Any]], list[float]]:
    """Run `n` attempts per input as rollouts; return the outputs and every attempt's reward."""
    outputs = await art_langgraph.gather(graph, inputs, n=n, reward=reward, task=task, split=split)
    rewards = [reward(item, output) for item, attempts in zip(inputs, outputs) for output in attempts]
    return outputs, rewards


async def train_steps(
    graph: Any,
    make_inputs: Callable[[int], Sequence[Any]],
    reward: Callable[[Any, Any], float],
    *,
    steps: int,
    n: int,
    task: str,
    trainer_url: str,
) -> list[StepReport]:
    """Run `steps` GRPO steps on fresh inputs (`make_inputs(step)`); report each step."""
    reports: list[StepReport] = []
    async with httpx.AsyncClient(base_url=trainer_url, timeout=900) as client:
        for step in range(steps):
            started = time.monotonic()
            _, rewards = await score_attempts(graph, make_inputs(step), reward, n=n, task=task, split="train")
            report = StepReport(reward=statistics.fmean(rewards))
            reports.append(report)
            art_langgraph.flush()
            response = await client.post("/v1/train")
            if response.status_code in (409, 422):  # nothing ready / no group with reward spread
                print(f"step skipped: {response.json()['error']['message']}", flush=True)
                continue
            response.raise_for_status()
            result = response.json()
            report.model, report.metrics = result["model"], result["metrics"]
            metrics = result["metrics"]
            print(
                f"step {step + 1}/{steps}: reward {report.reward:.3f} | grad norm {metrics['grad/norm']:.3f}"
                f" | groups trained {metrics['data/groups_trained']:.0f}/{metrics['data/groups']:.0f}"
                f" | {time.monotonic() - started:.0f} s -> serving {result['model']}",
                flush=True,
            )
    return reports


def plot_curve(curve: list[float], before: float, after: float, path: Path, title: str) -> None:
    """Write the per-step training reward and the held-out before/after as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(curve)), curve, marker="o", label="training groups (mean reward)")
    ax.scatter([0, len(curve)], [before, after], color="tab:red", zorder=3, label="held-out (mean reward)")
    ax.set_xlabel("policy step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_with_services(
    workdir: Path, learning_rate: float, job: Callable[[str], Coroutine[Any, Any, None]]
) -> None:
    """Start a collector and a trainer under `workdir`, point the plugin at them, run `job(trainer_url)`."""
    workdir.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    print(f"starting collector and trainer (logs in {state}); vLLM takes about a minute to start...", flush=True)
    with running_stack(state, trainer_args=["--learning-rate", str(learning_rate)]) as (collector, trainer):
        art_langgraph.configure(collector_url=collector.url, trainer_url=f"{trainer.url}/v1", model="agent@latest")
        asyncio.run(job(trainer.url))
        art_langgraph.flush()
