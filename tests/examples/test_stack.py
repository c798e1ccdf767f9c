"""examples/stack.py: the ports a stack's services are given, and that a service is stopped when its start fails."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from examples import stack
from examples.stack import free_ports


def test_free_ports_are_different_and_free() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16  # the trainer refuses an API port equal to its vLLM port
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_service_interrupted_while_starting_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    serve = tmp_path / "serve"
    serve.write_text("#!/bin/sh\nexec sleep 60\n")  # never answers, like vLLM still loading
    serve.chmod(0o755)
    started: list[subprocess.Popen[bytes]] = []

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(*args, **kwargs))
        return started[-1]

    def ctrl_c(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(stack, "_console_script", lambda name: str(serve))
    monkeypatch.setattr(stack, "subprocess", SimpleNamespace(**{**vars(subprocess), "Popen": popen}))
    monkeypatch.setattr(stack, "httpx", SimpleNamespace(get=ctrl_c, TransportError=httpx.TransportError))

    with pytest.raises(KeyboardInterrupt):
        stack.start_service("art-trainer", [], "http://127.0.0.1:9/health", "http://127.0.0.1:9", tmp_path / "log", 60)
    assert started and started[0].poll() is not None, "the child runs in its own session: Ctrl-C does not reach it"
