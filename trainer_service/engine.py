"""`VLLMEngine`: starts vLLM's OpenAI server as a child process and keeps it alive.

The engine serves the base model under its name and every LoRA checkpoint hot-loaded with
`load_adapter`. When the child dies, `ensure_running` starts it again and re-loads the
adapters, in the order they were first loaded. vLLM runs in its own process group (stopped as
a whole) and gets SIGTERM if the service dies, even by SIGKILL (`parent_death`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import httpx

from trainer_service.parent_death import launch_command
from trainer_service.vllm_cpu_matmul import MATMUL_DTYPE_ENV
from trainer_service.vllm_cpu_threads import EngineThreads

__all__ = ["EngineError", "VLLMEngine"]

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """vLLM could not be started, died, or refused a request."""


class VLLMEngine:
    """Supervisor of one vLLM OpenAI-compatible server process.

    Args:
        model_path: local folder (or hub name) of the base model.
        served_name: model name the base model is served under.
        port: port vLLM listens on (on `host`).
        host: interface vLLM binds.
        dtype: weight dtype (`float32` keeps logprobs equal to the trainer's on a CPU).
        kv_cache_gib: KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`).
        block_size: tokens per KV-cache block (`--block-size`); None: vLLM's default.
        max_model_len: longest sequence.
        max_lora_rank: largest adapter rank.
        max_loras: adapters active in one batch.
        cpu_matmul_dtype: dtype of a float32 engine's linear-layer products on a CPU (`float32` or
            `bfloat16`, `ART_VLLM_CPU_MATMUL_DTYPE` for the `art_cpu_bf16_matmul` plugin).
        threads: on a CPU, the engine's thread count shared with the service (the `art_cpu_threads`
            plugin): bound to every core, lent the training step's between steps. None: vLLM's binding.
        extra_args: more vLLM command-line arguments.
        log_path: file receiving vLLM's stdout and stderr.
        startup_timeout: seconds to wait for `/health`.
    """

    def __init__(
        self,
        model_path: str,
        served_name: str,
        port: int,
        *,
        host: str = "127.0.0.1",
        dtype: str = "float32",
        kv_cache_gib: float = 2,
        block_size: int | None = None,
        max_model_len: int = 2048,
        max_lora_rank: int = 8,
        max_loras: int = 4,
        cpu_matmul_dtype: str = "float32",
        threads: EngineThreads | None = None,
        extra_args: list[str] | None = None,
        log_path: str | Path = "vllm.log",
        startup_timeout: float = 600.0,
    ) -> None:
        self.model_path = model_path
        self.served_name = served_name
        self.host = host
        self.port = port
        self.dtype = dtype
        self.kv_cache_gib = kv_cache_gib
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.cpu_matmul_dtype = cpu_matmul_dtype
        self.threads = threads
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.adapters: dict[str, str] = {}
        """Loaded adapters, name → folder, in load order."""
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()

    @property
    def base_url(self) -> str:
        """Address of the engine, e.g. `http://127.0.0.1:8001`."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the running child, if any."""
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """Return the command line that starts vLLM."""
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_path,
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--enable-lora",
            "--max-lora-rank", str(self.max_lora_rank),
            "--max-loras", str(self.max_loras),
            "--max-model-len", str(self.max_model_len),
            *(["--block-size", str(self.block_size)] if self.block_size is not None else []),
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        """Return the child's environment: ours plus runtime LoRA loading, the KV cache size, the CPU matmul dtype
        and thread binding."""
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env[MATMUL_DTYPE_ENV] = self.cpu_matmul_dtype
        if self.threads is not None:
            env.update(self.threads.environment())
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.kv_cache_gib:g}")
        return env

    def is_alive(self) -> bool:
        """True while the child process runs (it may still be starting)."""
        return self._proc is not None and self._proc.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        """True when the child runs and answers `/health` with 200."""
        if not self.is_alive():
            return False
        try:
            return httpx.get(f"{self.base_url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        """Return the last `lines` lines of the vLLM log."""
        if not self.log_path.is_file():
            return "(no log written)"
        with self.log_path.open("r", errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))

    def start(self) -> None:
        """Start vLLM and block until it is healthy.

        Raises:
            EngineError: the process exited or did not answer `/health` within the timeout;
                the message carries the end of its log.
        """
        with self._lock:
            if self.is_alive():
                raise EngineError(f"vLLM runs already (pid {self.pid}); call stop() first")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.log_path.open("ab")
            logger.info("starting vLLM: %s (log: %s)", " ".join(self.command()), self.log_path)
            try:
                self._proc = subprocess.Popen(
                    launch_command(self.command()),
                    stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True,
                )
            finally:
                log.close()
            self._wait_healthy()

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise EngineError(
                    f"vLLM exited with code {code} while starting. Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                logger.info("vLLM is healthy at %s (pid %s)", self.base_url, self.pid)
                return
            time.sleep(1.0)
        self.stop()
        raise EngineError(
            f"vLLM did not become healthy within {self.startup_timeout:.0f} s (raise vllm_startup_timeout on a "
            f"slow machine). Last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the child (SIGTERM to its process group, SIGKILL after `timeout`). Idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None or proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM (pid %s) ignored SIGTERM for %.0f s; killing it", proc.pid, timeout)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                proc.wait()

    def ensure_running(self) -> bool:
        """Restart vLLM if it died, re-loading every adapter. Returns True when it restarted."""
        with self._lock:
            if self._proc is None or self.is_alive():
                return False
            code = self._proc.poll()
            logger.error("vLLM died with code %s; restarting. Log tail:\n%s", code, self.log_tail(20))
            self._proc = None
            self.restarts += 1
            self.start()
            for name, path in list(self.adapters.items()):
                self._post_adapter("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            return True

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Hot-load the PEFT adapter folder `path` as model `name`.

        Raises:
            EngineError: vLLM refused the adapter (its message is included).
        """
        path = str(Path(path).resolve())
        with self._lock:
            self._post_adapter("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name` from vLLM."""
        with self._lock:
            self._post_adapter("/v1/unload_lora_adapter", {"lora_name": name})
            self.adapters.pop(name, None)

    def _post_adapter(self, route: str, body: dict[str, str]) -> None:
        try:
            response = httpx.post(f"{self.base_url}{route}", json=body, timeout=120.0)
        except httpx.HTTPError as exc:
            raise EngineError(f"vLLM at {self.base_url} did not answer {route}: {exc}") from exc
        if response.status_code != 200:
            raise EngineError(f"vLLM refused {route} for {body}: HTTP {response.status_code}: {response.text[:500]}")
