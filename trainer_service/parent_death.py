"""`python -m trainer_service.parent_death PARENT_PID COMMAND [ARG ...]`: run COMMAND, stopped when its parent dies.

vLLM runs in its own session so that `VLLMEngine.stop` can signal its whole process group. That
also means nothing stops it when the trainer service is killed with SIGKILL (by a user or by the
kernel's out-of-memory killer): the orphaned vLLM keeps its memory and its port, and the next
trainer cannot start. This launcher asks Linux to send SIGTERM when its parent dies
(`prctl(PR_SET_PDEATHSIG)`, which survives `exec`), checks that PARENT_PID did not die before
that, and replaces itself with COMMAND, which keeps the launcher's pid.

Linux sends the signal when the parent *thread* that started the process ends, so start it
from a thread that lives as long as the service (the service's executor threads do). On other
systems COMMAND runs without the guard.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "launch_command", "main"]

_PR_SET_PDEATHSIG = 1


def launch_command(command: list[str]) -> list[str]:
    """COMMAND wrapped so that it gets SIGTERM when this process dies."""
    return [sys.executable, "-m", "trainer_service.parent_death", str(os.getpid()), *command]


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGTERM) -> bool:
    """Have Linux send `sig` to this process when its parent dies (nothing on other systems).

    Returns:
        False when `parent` is no longer this process's parent (it died before the signal was armed).

    Raises:
        OSError: `prctl(PR_SET_PDEATHSIG)` failed.
    """
    if not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> None:
    """Arm the parent-death signal, then exec the command."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not args[0].isdigit():
        raise SystemExit("usage: python -m trainer_service.parent_death PARENT_PID COMMAND [ARG ...]")
    parent, command = int(args[0]), args[1:]
    if not die_with_parent(parent):
        raise SystemExit(f"parent process {parent} ended before {command[0]} started")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
