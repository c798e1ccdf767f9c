"""What a launch of vLLM's process needs besides `subprocess.Popen`: its port held from each launch until the
engine stops (`PortHold`), and its log, rotated before a start appends (`rotate_log`) and read back for the errors
that quote it (`read_log_tail`)."""

from __future__ import annotations

import socket
import sys
from collections import deque
from pathlib import Path

from collector.listen import bind_address
from trainer_service.engine_errors import EngineError

__all__ = ["PortHold", "read_log_tail", "rotate_log"]

_LOG_ROTATE_BYTES = 64 * 2**20
"""A vLLM log larger than this at a (re)start is moved to `<log>.1` (replacing it): a crash loop, or restarts
over a long run, keep at most about twice this on disk (one vLLM's own output is not cut while it runs)."""


def rotate_log(log_path: Path) -> None:
    """Move the log `log_path` to `<log>.1` (replacing it) when it is over `_LOG_ROTATE_BYTES`, before a start
    appends."""
    if log_path.is_file() and log_path.stat().st_size > _LOG_ROTATE_BYTES:
        log_path.replace(log_path.with_name(f"{log_path.name}.1"))


def read_log_tail(log_path: Path, lines: int = 40) -> str:
    """Return the last `lines` lines of the vLLM log `log_path`."""
    if not log_path.is_file():
        return "(no log written)"
    with log_path.open("r", errors="replace") as handle:
        return "".join(deque(handle, maxlen=lines))


class PortHold:
    """vLLM's port, bound by the engine from each launch of vLLM until the engine stops (`hold`, `release`).

    Args:
        host: interface vLLM binds.
        port: port vLLM listens on.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._port_hold: socket.socket | None = None

    def hold(self) -> None:
        """Bind vLLM's port as vLLM's server binds it (`SO_REUSEADDR`), without listening, and keep it bound until
        `release` (the engine's `stop`): Linux lets vLLM bind it too (neither socket listened yet), while no
        connection's local end (our `/health` checks, many while vLLM loads) nor a program binding without
        `SO_REUSEADDR` takes the port during vLLM's start or between its restarts; bound only for a moment, it could be
        gone by the time vLLM bound it.
        Each launch binds anew, so a server that took the port meanwhile (one binding with `SO_REUSEADDR` can; it
        would answer our `/health` checks while vLLM loaded) is refused.

        Raises:
            EngineError: naming the port another process holds.
        """
        fix = "stop it, or give vLLM another --vllm-port"
        try:
            hold = bind_address(self.host, self.port, fix)
        except ValueError as exc:  # its cause is the OSError, whose reason the message keeps
            reason = exc.__cause__.strerror if isinstance(exc.__cause__, OSError) else None
            raise EngineError(f"vLLM's port {self.port} on {self.host} is in use by another process "
                              f"({reason or exc}); {fix}") from exc
        if sys.platform != "linux":  # where two unlistened sockets may not share a port, vLLM's bind would fail
            hold.close()
            return
        previous, self._port_hold = self._port_hold, hold
        if previous is not None:
            previous.close()

    def release(self) -> None:
        """Let the port go: once the engine stops, it is vLLM's, or no one's."""
        if self._port_hold is not None:
            self._port_hold.close()
            self._port_hold = None
