"""The bench scripts that can run against the session's stack run to the end with few rounds.

Their figures are not checked here (timing belongs in `make bench`); that they still run is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.stack import Service

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_tracing_overhead_runs_and_reports_every_ratio(collector_service: Service, trainer_service: Service) -> None:
    done = subprocess.run(
        [sys.executable, "bench/tracing_overhead.py", "--trainer", trainer_service.url,
         "--collector", collector_service.url, "--rounds", "2", "--max-tokens", "2"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("art vs openai+ids: wall") == 2  # the single-call and the agent-step comparisons
    assert "dropped: 0" in done.stdout
