"""Real services the collector tests start themselves: PostgreSQL and `art-collector serve`.

Ports come from 24400-24499. PostgreSQL is Debian's package (`make system-deps`), run from a
private data folder on a free port; as root, its programs run as the `postgres` user.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from examples.stack import free_port


class PostgresServer:
    """A throwaway PostgreSQL cluster: `start()`, `create_database()`, `stop()`."""

    def __init__(self) -> None:
        versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
        if not versions:
            raise RuntimeError("PostgreSQL is not installed: run `make system-deps` (Debian package `postgresql`)")
        self.bin = Path(versions[-1]).parent
        self.root = Path(tempfile.mkdtemp(prefix="art-collector-pg-"))
        self.data, self.log = self.root / "data", self.root / "postgres.log"
        self.port = 0
        self._databases = 0

    def _run(self, *args: str) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}{log}")

    def start(self) -> PostgresServer:
        """initdb, then start on a free port (fsync off: a test server, not a durable one)."""
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.port = free_port()
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        return self

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3) of a database on this server."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        self._databases += 1
        name = f"test_{self._databases}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server and delete its files."""
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class CollectorProcess:
    """`art-collector serve` as a child process, on a free port."""

    def __init__(self, db: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.db, self.log_path, self.env = db, log_path, env or {}
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> CollectorProcess:
        """Start and wait until `/health` answers."""
        self.port = free_port()
        command = [sys.executable, "-m", "collector.cli", "serve", "--port", str(self.port), "--db", self.db,
                   "--log-level", "warning"]
        env = {**os.environ, **self.env}
        env.pop("ART_API_KEY", None)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=Path(__file__).parents[2])
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"art-collector exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"art-collector did not answer in {timeout} s:\n{self.log_path.read_text()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """`kill -9`: no shutdown, no flush."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """Terminate gracefully (SIGTERM), then kill if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()
