"""The collect → score → train loop every example runs, written once.

Each step runs groups of attempts through the agent (traced by `art_langgraph`, scored in
code by `score(input, output)` or by the collector's RULER judge), flushes the spans to the
collector and asks the trainer for one GRPO step, which hot-loads `agent@N` for the next round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import art_langgraph


@dataclass
class StepReport:
    """One step of the loop: the mean reward of its attempts and what training made of them."""

    reward: float
    model: str | None = None
    """The checkpoint the step published (`agent@N`); None when the step was skipped."""
    metrics: dict[str, float] = field(default_factory=dict)
    judge_runs: list[dict[str, Any]] = field(default_factory=list)
    """The collector's judge runs of the step's groups (RULER examples only)."""


async def score_attempts(
    graph: Any,
    inputs: Sequence[Any],
    score: Callable[[Any, Any], float],
    *,
    n: int,
    task: str,
    split: str,
    report: bool = True,
) -> tuple[list[list[Any]], list[float]]:
    """Run `n` attempts per input as rollouts; return the outputs and every attempt's score.

    With `report` the score is also each rollout's reward; without, the collector scores the
    groups itself (RULER) and the score only measures.
    """
    outputs = await art_langgraph.gather(graph, inputs, n=n, reward=score if report else None, task=task, split=split)
    scores = [score(item, output) for item, attempts in zip(inputs, outputs) for output in attempts]
    return outputs, scores


async def judge_groups(
    collector_url: str, task: str, judged: set[str], rubric: str | None = None
) -> list[dict[str, Any]]:
    """Ask the collector's RULER judge to score every train group of `task` not in `judged`.

    Each `POST /v1/groups/{id}/judge` returns once the group is judged; its scores become
    the group's `ruler` rewards. Returns the judge runs, and adds their groups to `judged`.
    """
    runs: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=collector_url, timeout=1800) as client:
        params = {"task": task, "split": "train"}
        trajectories = (await client.get("/v1/trajectories", params=params)).raise_for_status().json()
        for group in sorted({t["group_id"] for t in trajectories if t["group_id"]} - judged):  # "": in no group yet
            body = {"rubric": rubric} if rubric else None
            runs.append((await client.post(f"/v1/groups/{group}/judge", json=body)).raise_for_status().json())
            judged.add(group)
    return runs


async def train_steps(
    graph: Any,
    make_inputs: Callable[[int], Sequence[Any]],
    score: Callable[[Any, Any], float],
    *,
    steps: int,
    n: int,
    task: str,
    trainer_url: str,
    collector_url: str | None = None,
    rubric: str | None = None,
    endpoint: str = "/v1/train",
) -> list[StepReport]:
    """Run `steps` training steps on fresh inputs (`make_inputs(step)`); report each step.

    `score(input, output)` is the reward, reported with each rollout. With `collector_url`
    the collector's RULER judge scores the groups instead (with `rubric`, else its own): the
    loop has it judge each new group before asking for a step, and `score` only draws the
    curve. `endpoint` is `/v1/train` (GRPO) or
    `/v1/sft` (a supervised step on the best attempt of each group).
    """
    kind = "SFT" if endpoint == "/v1/sft" else "GRPO"
    reports: list[StepReport] = []
    judged: set[str] = set()
    async with httpx.AsyncClient(base_url=trainer_url, timeout=900) as client:
        for step in range(steps):
            started = time.monotonic()
            _, scores = await score_attempts(
                graph, make_inputs(step), score, n=n, task=task, split="train", report=collector_url is None
            )
            report = StepReport(reward=statistics.fmean(scores))
            reports.append(report)
            art_langgraph.flush()
            if collector_url is not None:
                report.judge_runs = await judge_groups(collector_url, task, judged, rubric)
            response = await client.post(endpoint)
            if response.status_code in (409, 422):  # nothing ready / no group to learn from
                print(f"{kind} step skipped: {response.json()['error']['message']}", flush=True)
                continue
            response.raise_for_status()
            result = response.json()
            report.model, report.metrics = result["model"], result["metrics"]
            metrics = result["metrics"]
            sft_loss = f" | loss {metrics['loss/sft']:.3f}" if "loss/sft" in metrics else ""  # GRPO's is ~0 on-policy
            print(
                f"{kind} step {step + 1}/{steps}: score {report.reward:.3f}{sft_loss}"
                f" | grad norm {metrics['grad/norm']:.3f}"
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
