"""`stop_group` on real process groups: a child and its own child, with and without SIGTERM handled."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_service.process_group import stop_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")

_GROUP = """
import signal, subprocess, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\\n"
                               "if sys.argv[1] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                               "print('ready', flush=True); time.sleep(600)",
                               "1" if "--ignore-term" in sys.argv else "0"],
                              stdout=subprocess.PIPE, text=True)
grandchild.stdout.readline()
print(grandchild.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start(*args: str) -> tuple[subprocess.Popen[bytes], int]:
    """A child leading its own group, and the pid of the grandchild it started (same group)."""
    proc = subprocess.Popen([sys.executable, "-c", _GROUP, *args], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


@pytest.mark.parametrize("ignores_term", [False, True], ids=["ends-on-sigterm", "ignores-sigterm"])
def test_stop_group_ends_every_process_of_the_group(ignores_term: bool, caplog: pytest.LogCaptureFixture) -> None:
    proc, grandchild = _start(*(["--ignore-term"] if ignores_term else []))
    try:
        assert running(grandchild)
        with caplog.at_level(logging.WARNING, logger="trainer_service.process_group"):
            assert stop_group(proc, timeout=1.0, kill_wait=10.0)
        assert proc.returncode == -(signal.SIGKILL if ignores_term else signal.SIGTERM)
        assert not running(grandchild), "the child's own child outlived the group's stop"
        assert ("ignored SIGTERM" in caplog.text) is ignores_term
    finally:
        if running(grandchild):
            subprocess.run(["kill", "-9", str(grandchild)], check=False)
        proc.kill()
        proc.wait()


def test_stop_group_of_a_child_gone_alone_still_stops_the_rest() -> None:
    """vLLM's engine core can outlive its API server: the group is stopped even when its leader has ended."""
    proc, grandchild = _start()
    try:
        proc.kill()
        proc.wait()
        assert running(grandchild)
        assert stop_group(proc, timeout=5.0, kill_wait=10.0)
        assert not running(grandchild)
    finally:
        if running(grandchild):
            subprocess.run(["kill", "-9", str(grandchild)], check=False)
