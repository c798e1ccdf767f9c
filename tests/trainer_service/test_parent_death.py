"""The parent-death launcher (`python -m trainer_service.parent_death`); the engine's test that a killed service
takes vLLM with it is in test_engine.py."""

from __future__ import annotations

import subprocess
import sys


def test_parent_death_launcher_refuses_bad_arguments() -> None:
    # In child processes: arming the signal in the test process would tie pytest to its parent.
    launcher = [sys.executable, "-m", "trainer_service.parent_death"]
    usage = subprocess.run([*launcher, "not-a-pid", "true"], capture_output=True, text=True)
    assert usage.returncode != 0 and "usage" in usage.stderr
    if sys.platform.startswith("linux"):  # a parent that is already gone: the command must not run
        gone = subprocess.run([*launcher, "999999999", "echo", "ran"], capture_output=True, text=True)
        assert gone.returncode != 0 and "ended before" in gone.stderr and "ran" not in gone.stdout
