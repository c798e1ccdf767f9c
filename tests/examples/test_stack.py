"""examples/stack.py: the ports a stack's services are given, and that a service is stopped when its start fails or
the script that started it dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from examples import stack
from examples.stack import free_port, free_ports


def test_free_ports_are_different_and_free() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16  # the trainer refuses an API port equal to its vLLM port
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_ports_are_chosen_below_the_kernels_ephemeral_range(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ports the kernel chose (a bind to port 0) could, once let go, be given to a connection's local end before the
    service bound them: the trainer's API port was, once, during its start (a CI run)."""
    held = free_port()
    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text(f"{held + 2}\t60999\n")
    monkeypatch.setattr(stack, "_EPHEMERAL_RANGE", ephemeral)
    monkeypatch.setattr(stack, "_LOWEST_PORT", held)
    with socket.create_server(("127.0.0.1", held)):
        assert free_ports(1) == [held + 1]  # the only one below the range that nothing holds
        ports = free_ports(3)  # the range has room for one: the kernel chooses the others
    assert held + 1 in ports and len(set(ports)) == 3
    ephemeral.unlink()  # not Linux: the kernel chooses
    assert len(set(free_ports(4))) == 4


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


@pytest.mark.parametrize(
    ("body", "timeout", "error", "message"),
    [
        ("echo 'port 8000 already in use' >&2; exit 3", 30, RuntimeError, "art-trainer exited with 3 while starting"),
        ("exec sleep 30", 2, TimeoutError, "art-trainer did not answer"),
    ],
    ids=["exits", "never-answers"],
)
def test_a_failed_start_names_the_log_to_read(
    body: str, timeout: float, error: type[Exception], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve = tmp_path / "serve"
    serve.write_text(f"#!/bin/sh\necho starting\n{body}\n")
    serve.chmod(0o755)
    monkeypatch.setattr(stack, "_console_script", lambda name: str(serve))
    log = tmp_path / "logs" / "trainer.log"

    with pytest.raises(error) as failed:
        stack.start_service("art-trainer", [], f"http://127.0.0.1:{free_ports(1)[0]}/", "", log, timeout)

    first_line = str(failed.value).splitlines()[0]
    assert first_line.startswith(message) and f"(log: {log})" in first_line
    assert "starting" in str(failed.value)  # and shows the log's tail


def test_a_service_stops_when_the_script_that_started_it_is_killed(tmp_path: Path) -> None:
    """The services run in their own sessions, so a `timeout` or `kill -9` of the example reached none of them."""
    port = free_ports(1)[0]
    serve = tmp_path / "fake-art-service"  # found on PATH, like an installed console script
    serve.write_text(f"#!/bin/sh\nexec {sys.executable} -m http.server --bind 127.0.0.1 {port}\n")
    serve.chmod(0o755)
    script = (
        "import sys; from pathlib import Path; from examples import stack\n"
        f"service = stack.start_service('fake-art-service', [], 'http://127.0.0.1:{port}/', '', Path(sys.argv[1]),"
        " 30)\n"
        "print(service.process.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(Path.cwd())}
    example = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "log")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env=env)
    assert example.stdout is not None
    service_pid = int(example.stdout.readline())
    example.kill()
    example.wait()
    deadline = time.monotonic() + 10
    while _running(service_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _running(service_pid):
        os.kill(service_pid, signal.SIGKILL)
        pytest.fail("the service outlived the script that started it")


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited one whose parent is gone is reaped by init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
