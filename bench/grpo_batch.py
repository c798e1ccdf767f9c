"""The training bench's batch, shared by the benches that sample or train it: 8 arithmetic prompts x 4 samples
x 64 completion tokens (EOS ignored), a seed per prompt, and its reward (partial credit for the sum, and for
brevity)."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import httpx

from collector.protocol import Group, Sequence, Trajectory

__all__ = ["COMPLETION_TOKENS", "PROMPTS", "SAMPLES", "problems", "question", "sample_batch", "score", "to_groups"]

PROMPTS = 8
SAMPLES = 4
COMPLETION_TOKENS = 64


def problems() -> list[tuple[int, int]]:
    rng = random.Random(0)
    return [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(PROMPTS)]


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}? Reply with only the number."


def score(text: str, a: int, b: int) -> float:
    """Partial credit: 0.6 for the right number, up to 0.4 for brevity."""
    numbers = re.findall(r"-?\d+", text)
    right = 0.6 if numbers and int(numbers[0]) == a + b else 0.0
    return right + 0.4 * max(0.0, 1.0 - len(text) / 200)


async def sample_batch(engine_url: str, model: str) -> list[tuple[tuple[int, int], dict[str, Any]]]:
    """The batch: each prompt's problem and vLLM's answer (4 seeded samples, EOS ignored, with logprobs)."""
    async with httpx.AsyncClient(base_url=engine_url, timeout=600) as client:
        async def one(seed: int, a: int, b: int) -> tuple[tuple[int, int], dict[str, Any]]:
            # A seed per prompt: every run samples the same completions, so the same groups have a
            # reward spread and runs of different code train the same batch.
            body = {"model": model, "messages": [{"role": "user", "content": question(a, b)}], "n": SAMPLES,
                    "max_tokens": COMPLETION_TOKENS, "ignore_eos": True, "temperature": 1.0, "logprobs": True,
                    "return_token_ids": True, "seed": seed}
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return (a, b), response.json()
        return await asyncio.gather(*(one(seed, a, b) for seed, (a, b) in enumerate(problems())))


def to_groups(answers: list[tuple[tuple[int, int], dict[str, Any]]]) -> list[Group]:
    groups = []
    for index, ((a, b), body) in enumerate(answers):
        prompt = list(body["prompt_token_ids"])
        trajectories = []
        for choice in body["choices"]:
            completion = list(choice["token_ids"])
            lps = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            trajectories.append(Trajectory(
                id=f"{index}-{choice['index']}", trace_id="0" * 32, group_id=str(index),
                sequences=[Sequence(token_ids=prompt + completion, logprobs=[None] * len(prompt) + lps,
                                    assistant_mask=[0] * len(prompt) + [1] * len(completion))],
                reward=score(choice["message"]["content"] or "", a, b)))
        groups.append(Group(id=str(index), trajectories=trajectories))
    return groups
