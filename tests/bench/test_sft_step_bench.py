"""`bench/sft_step.py` runs to the end on a small batch, and in float32 both sides train the same steps.

Its timings are not checked here (they belong in `make bench`); that art's `sft_step` and TRL's
`SFTTrainer` compute the same loss at every step, so the bench times the same work, is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sft_bench_trains_the_same_steps_as_trl_and_reports_the_ratios() -> None:
    done = subprocess.run(
        [sys.executable, "bench/sft_step.py", "--sequences", "3", "--completion-tokens", "6", "--steps", "2",
         "--rounds", "1", "--precision", "float32"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = re.search(r"loss of each step \(round 1\): art ([\d. ]+), TRL ([\d. ]+) \(largest gap", done.stdout)
    assert losses is not None, done.stdout
    art, trl = ([float(x) for x in group.split()] for group in losses.groups())
    assert len(art) == len(trl) == 2
    assert art[1] < art[0], "the first step did not lower the loss"
    assert max(abs(a - t) for a, t in zip(art, trl, strict=True)) < 2e-3  # printed to 4 decimals
    assert done.stdout.count("ratio (art / TRL tokens/s)") == 2  # the first step and the warm one
