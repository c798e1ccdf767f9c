"""Each example runs a short version of its training loop against the session's services."""

from __future__ import annotations

import httpx
import pytest

import art_langgraph
from examples.arithmetic import agent as arithmetic
from examples.stack import Service
from examples.tictactoe import agent as tictactoe
from examples.training_loop import train_steps

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

EXAMPLES = {
    "arithmetic": (arithmetic.build_agent, lambda step: arithmetic.problems(4, seed=step), arithmetic.score),
    "tictactoe": (tictactoe.build_agent, lambda step: tictactoe.games(6, seed=step), tictactoe.score),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
async def test_one_training_step(name: str, collector_service: Service, trainer_service: Service) -> None:
    build, make_inputs, score = EXAMPLES[name]
    art_langgraph.configure(collector_url=collector_service.url, trainer_url=f"{trainer_service.url}/v1")
    before = httpx.get(f"{trainer_service.url}/v1/status").raise_for_status().json()["step"]

    (report,) = await train_steps(
        build(), make_inputs, score, steps=1, n=4, task=f"test-{name}", trainer_url=trainer_service.url
    )

    assert 0.0 <= report.reward <= 1.0
    assert report.model == f"agent@{before + 1}"
    assert report.metrics["data/groups_trained"] >= 1
    assert report.metrics["data/tokens"] > 0 and report.metrics["grad/norm"] > 0
