"""Stop a child that leads its own process group, with every process of the group.

`VLLMEngine` starts vLLM in its own session so that it can stop the whole group: vLLM's engine
core process may outlive its API server and keep the port and the memory, so stopping means
waiting until no process of the group runs, not only the child. Zombies do not count.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["stop_group"]

logger = logging.getLogger(__name__)


def stop_group(proc: subprocess.Popen[bytes], timeout: float, kill_wait: float) -> bool:
    """Stop every process of `proc`'s group (`proc` leads it): SIGTERM, then SIGKILL after `timeout` seconds.

    Returns:
        True once no process of the group runs (`proc` reaped); False when one still runs `kill_wait`
        seconds after SIGKILL.
    """
    pgid = proc.pid
    if _wait_group(proc, 0.0):
        return True
    _signal_group(pgid, signal.SIGTERM)
    if _wait_group(proc, timeout):
        return True
    logger.warning("process group %s ignored SIGTERM for %.0f s; killing it", pgid, timeout)
    _signal_group(pgid, signal.SIGKILL)
    return _wait_group(proc, kill_wait)


def _group_runs(pgid: int) -> bool:
    """True while a process of group `pgid` runs. Zombies do not count: they hold no memory or port, and an
    orphan's zombie stays until its new parent reaps it (which a container's init may never do)."""
    if not sys.platform.startswith("linux"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    with os.scandir("/proc") as entries:  # closed also when a process of the group is found at once
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:  # the raw process name (any bytes, cut at 15) sits in parentheses before the fields
                state, _ppid, group = Path(entry.path, "stat").read_bytes().rsplit(b")", 1)[1].split()[:3]
                in_group = int(group) == pgid
            except (OSError, ValueError, IndexError):  # it ended while we looked, is hidden from us, or reads oddly
                continue
            if in_group and state != b"Z":
                return True
    return False


def _wait_group(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to `timeout` seconds until no process of `proc`'s group runs, reaping `proc`; True once none does."""
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()
        if not _group_runs(proc.pid):
            proc.poll()  # the leader is a zombie or reaped by now: this reaps it
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to process group `pgid`; a group that ended meanwhile is fine."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
