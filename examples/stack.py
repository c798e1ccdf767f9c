"""Start the collector and the trainer service as child processes, for demos and tests.

This is what a user does in two terminals (`art-collector serve`, `art-trainer serve`),
wrapped so a script can bring both up, wait until they answer, and stop them at the end.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from trainer_service.parent_death import launch_command

# The kernel hands a connection's local end, or a bind to port 0 (vLLM's internal ports), a port of this range; a port
# chosen below it stays free until the service started with it binds it, seconds later.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000  # ports below are where other programs' servers usually listen
_RANDOM = random.SystemRandom()  # not the `random` a seeded run replays: two such runs would pick the same ports


def free_port() -> int:
    """Return a TCP port on localhost that nothing listens on right now (see `free_ports`)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Return `count` different TCP ports on localhost that nothing is bound to right now, chosen at random below the
    kernel's range of ephemeral ports where there is room (Linux), else by the kernel (a bind to port 0): a port the
    kernel chose, once let go, could be given to a connection's local end before the service bound it, which then
    failed to start. Each is held until all are chosen: ports asked for one at a time may repeat, and the trainer
    refuses an API port equal to vLLM's."""
    try:
        lowest_ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        lowest_ephemeral = _LOWEST_PORT
    below = range(_LOWEST_PORT, lowest_ephemeral)
    candidates = iter(_RANDOM.sample(below, min(len(below), 100 * count)))
    with ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            candidate = next(candidates, 0)  # past the sample, the kernel chooses
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                if candidate == 0:  # no port left at all
                    raise
                continue  # taken
            ports.append(sock.getsockname()[1])
        return ports


@dataclass
class Service:
    """A running service and where it logs; `process` is None for one started elsewhere."""

    name: str
    url: str
    process: subprocess.Popen[bytes] | None
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        """Return the last lines of the service's log."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the service (SIGTERM, then SIGKILL) and its children, if we started it."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _console_script(name: str) -> str:
    """Find a console script next to this interpreter, else on PATH."""
    candidate = Path(sys.executable).with_name(name)
    found = str(candidate) if candidate.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed: run `pip install -e .` (or `make setup`).")
    return found


def start_service(
    name: str,
    args: Sequence[str],
    health_url: str,
    url: str,
    log: Path,
    timeout: float,
    env: dict[str, str] | None = None,
) -> Service:
    """Start `name serve ARGS` and wait until `health_url` answers 200; stop it again when the wait fails or is
    interrupted (Ctrl-C). The service runs in its own session (`Service.stop` signals its group) and gets SIGTERM
    when this process dies, however it dies (`parent_death`: a `timeout`/`kill` of the script, whose `finally`
    blocks never run, left the trainer and its vLLM running)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(
            launch_command([_console_script(name), "serve", *args]),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    service = Service(name, url, process, log)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {process.returncode} while starting (log: {log}):\n{service.log_tail()}"
                )
            try:
                if httpx.get(health_url, timeout=2.0).status_code == 200:
                    return service
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"{name} did not answer {health_url} within {timeout:.0f} s (log: {log}):\n{service.log_tail()}"
        )
    except BaseException:  # also Ctrl-C: the child runs in its own session, so nothing else would stop it
        service.stop()
        raise


@contextmanager
def running_stack(
    workdir: Path,
    *,
    name: str = "agent",
    base_model: str = "SmolLM2-135M-Instruct",
    trainer_args: Sequence[str] = (),
    collector_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[tuple[Service, Service]]:
    """Run a collector (SQLite in `workdir`) and a trainer (vLLM + LoRA GRPO) until exit.

    The collector gets `ART_TRAINER_URL` = this trainer's `/v1`, so its RULER judge (when
    `ART_COLLECTOR_JUDGE_AUTO` is on and no `ART_COLLECTOR_JUDGE_URL` is set) asks this trainer.
    """
    collector_port, trainer_port, vllm_port = free_ports(3)
    collector_url = f"http://127.0.0.1:{collector_port}"
    trainer_url = f"http://127.0.0.1:{trainer_port}"
    collector = start_service(
        "art-collector",
        ["--port", str(collector_port), "--db", f"sqlite:///{workdir / 'collector.db'}", *collector_args],
        f"{collector_url}/health",
        collector_url,
        workdir / "collector.log",
        timeout=60,
        env={"ART_TRAINER_URL": f"{trainer_url}/v1", **(env or {})},
    )
    try:
        trainer = start_service(
            "art-trainer",
            [
                "--port", str(trainer_port),
                "--vllm-port", str(vllm_port),
                "--collector", collector_url,
                "--base-model", base_model,
                "--name", name,
                "--output-dir", str(workdir / "trainer"),
                *trainer_args,
            ],
            f"{trainer_url}/v1/status",
            trainer_url,
            workdir / "trainer.log",
            timeout=600,
            env=env,
        )
        try:
            yield collector, trainer
        finally:
            trainer.stop()
    finally:
        collector.stop()
