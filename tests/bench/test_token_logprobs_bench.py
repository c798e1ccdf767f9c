"""`bench/token_logprobs.py` runs to the end on small shapes and finds both implementations equal.

Its timings are not checked here (they belong in `make bench`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_token_logprobs_bench_agrees_with_trl_and_reports_the_ratio() -> None:
    done = subprocess.run(
        [sys.executable, "bench/token_logprobs.py", "--rows", "40", "--vocab", "300", "--rounds", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = re.search(r"values ([\d.e+-]+), gradient ([\d.e+-]+)", done.stdout)
    assert gaps is not None, done.stdout
    assert float(gaps[1]) < 1e-4 and float(gaps[2]) < 1e-2
    assert "ratio art / TRL (speed)" in done.stdout
