"""vLLM-cpu borrows the training step's cores between steps: the shared count, the service's side, the plugin.

The engine side runs here in-process (`SharedThreadCount.apply` sets this process's torch
threads); the session engine of the real-vLLM tests runs it inside vLLM
(`test_serving_during_training.py` checks its thread count during and after a step).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_inproc_path
from vllm.v1.worker.cpu_worker import CPUWorker

from trainer_service import vllm_cpu_threads
from trainer_service.config import TrainerSettings
from trainer_service.core_lending import CoreLender
from trainer_service.engine import VLLMEngine
from trainer_service.vllm_cpu_threads import EngineThreads, SharedThreadCount, obeying, sleeping_while_training


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU machine with cores 4-7 usable and no binding of the user's."""
    monkeypatch.setattr(vllm_cpu_threads.os, "sched_getaffinity", lambda _pid: {7, 5, 4, 6})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)


def test_the_engine_side_switches_threads_when_asked_and_acknowledges(tmp_path: Path) -> None:
    service = SharedThreadCount.create(tmp_path / "threads", 2)
    engine = SharedThreadCount(tmp_path / "threads")  # the engine maps the same file
    assert (engine.wanted, engine.applied) == (2, 0)
    engine.apply()
    assert torch.get_num_threads() == 2 and service.applied == 2
    service.want(1)
    assert service.applied == 2, "the engine has not reached a model step yet"
    engine.apply()
    assert torch.get_num_threads() == 1 and service.applied == 1


def test_the_plugin_applies_the_count_before_each_model_step(tmp_path: Path) -> None:
    shared = SharedThreadCount.create(tmp_path / "threads", 1)
    seen: list[int] = []

    def execute_model(_worker: object, output: str) -> str:
        seen.append(torch.get_num_threads())
        return output

    wrapped = obeying(execute_model, shared)
    assert wrapped(object(), "step 1") == "step 1"
    shared.want(2)
    assert wrapped(object(), output="step 2") == "step 2"
    assert seen == [1, 2] and shared.applied == 2


def test_register_patches_the_cpu_worker_once_and_only_with_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original, original_wait = CPUWorker.execute_model, SpinCondition.wait
    monkeypatch.setattr(CPUWorker, "execute_model", original)  # undone after the test
    monkeypatch.setattr(SpinCondition, "wait", original_wait)
    monkeypatch.delenv(vllm_cpu_threads.THREADS_FILE_ENV, raising=False)
    vllm_cpu_threads.register()
    assert CPUWorker.execute_model is original
    SharedThreadCount.create(tmp_path / "threads", 1)
    monkeypatch.setenv(vllm_cpu_threads.THREADS_FILE_ENV, str(tmp_path / "threads"))
    vllm_cpu_threads.register()
    patched = CPUWorker.execute_model
    assert patched is not original and getattr(patched, "art_threads", False)
    waiting = SpinCondition.wait
    assert waiting is not original_wait and getattr(waiting, "art_threads", False)
    vllm_cpu_threads.register()
    assert CPUWorker.execute_model is patched and SpinCondition.wait is waiting
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "art_cpu_threads"]
    assert plugin.load() is vllm_cpu_threads.register


def test_from_settings_lends_every_core_but_the_steps(tmp_path: Path, four_cores: None) -> None:
    threads = EngineThreads.from_settings(TrainerSettings(train_threads=1), tmp_path / "threads")
    assert threads is not None
    assert (threads.cpus, threads.own, threads.idle) == ([4, 5, 6, 7], 3, 4)
    assert threads.environment() == {"VLLM_CPU_OMP_THREADS_BIND": "4,5,6,7",
                                     "ART_VLLM_CPU_THREADS_FILE": str(tmp_path / "threads")}
    assert threads.shared.wanted == 4, "the engine starts with every core"
    engine = VLLMEngine("model", "model", 8001, threads=threads)
    assert engine.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "4,5,6,7"

    fewer = EngineThreads.from_settings(TrainerSettings(train_threads=2, idle_vllm_threads=3), tmp_path / "t2")
    assert fewer is not None and (fewer.own, fewer.idle, fewer.shared.wanted) == (2, 3, 3)


def test_from_settings_leaves_vllm_its_binding_where_nothing_is_lent(
        tmp_path: Path, four_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "threads"
    assert EngineThreads.from_settings(TrainerSettings(train_threads=1, idle_vllm_threads=3), path) is None, \
        "idle_vllm_threads equal to the engine's own share (4 cores - 1): nothing lent"
    assert EngineThreads.from_settings(TrainerSettings(train_threads=2, idle_vllm_threads=2), path) is None
    assert EngineThreads.from_settings(TrainerSettings(train_threads=4), path) is None, "no core left to the engine"
    with pytest.raises(ValueError, match="idle_vllm_threads=5: this process may use 4 cores"):
        EngineThreads.from_settings(TrainerSettings(train_threads=1, idle_vllm_threads=5), path)
    # below the engine's own share it turned lending off, silently
    with pytest.raises(ValueError, match=r"idle_vllm_threads=2 is below vLLM's own 3 threads \(the 4 cores less "
                                         r"the step's 1\).* \(ART_TRAINER_IDLE_VLLM_THREADS\) to 3 to never lend"):
        TrainerSettings(train_threads=1, idle_vllm_threads=2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "4-5")
    assert EngineThreads.from_settings(TrainerSettings(train_threads=1), path) is None, "the user's binding wins"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineThreads.from_settings(TrainerSettings(train_threads=1), path) is None


def test_rejects_counts_outside_the_cores(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="own"):
        EngineThreads(tmp_path / "threads", [0, 1], own=2, idle=1)
    with pytest.raises(ValueError, match="cores"):
        EngineThreads(tmp_path / "threads", [0, 1], own=1, idle=3)


def test_shrink_waits_for_a_busy_engine_and_not_for_an_idle_one(tmp_path: Path) -> None:
    threads = EngineThreads(tmp_path / "threads", [0, 1], own=1, idle=2)
    engine = SharedThreadCount(tmp_path / "threads")
    engine.apply()

    assert threads.shared.may_spin
    assert threads.shrink(busy=lambda: False, timeout_s=5.0), "an idle engine switches at its next step"
    assert threads.shared.wanted == 1 and threads.shared.applied == 2
    assert not engine.may_spin, "while the step trains the engine sleeps between model steps"
    threads.grow()
    assert engine.may_spin and engine.wanted == 2

    timer = threading.Timer(0.3, engine.apply)  # the engine's next model step
    timer.start()
    started = time.monotonic()
    assert threads.shrink(busy=lambda: True, timeout_s=5.0)
    assert 0.25 <= time.monotonic() - started < 4.0 and threads.threads == 1
    timer.join()

    threads.grow()
    engine.apply()
    assert threads.threads == 2
    started = time.monotonic()
    assert not threads.shrink(busy=lambda: True, timeout_s=0.2), "an engine stuck in one step: the wait times out"
    assert time.monotonic() - started >= 0.2


def test_a_step_takes_the_engine_cores_back_and_returns_them(tmp_path: Path) -> None:
    threads = EngineThreads(tmp_path / "threads", [0, 1, 2], own=2, idle=3)
    lender = CoreLender(1, 1, handback_timeout_s=0.2, engine_threads=threads)
    with lender.lending():
        assert threads.shared.wanted == 2
    assert threads.shared.wanted == 3
    assert "engine_shrink_timeouts" not in lender.counters, "an idle engine is not waited for"

    async def busy_step() -> None:
        ticket = await lender.engine_request()  # a request in flight, and no engine to switch: the wait times out
        with lender.lending():
            assert threads.shared.wanted == 2
        ticket.close()

    asyncio.run(busy_step())
    assert lender.counters["engine_shrink_timeouts"] == 1
    assert threads.shared.wanted == 3


def test_a_reader_of_vllms_queue_sleeps_instead_of_spinning_while_a_step_trains(tmp_path: Path) -> None:
    service = SharedThreadCount.create(tmp_path / "threads", 2)
    wait = sleeping_while_training(SpinCondition.wait, SharedThreadCount(tmp_path / "threads"))
    context = zmq.Context()
    address = get_open_zmq_inproc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        reader.record_read()  # a model step just ended: vLLM's reader would spin for busy_loop_s (1 s)
        started = time.monotonic()
        wait(reader, timeout_ms=300)
        assert time.monotonic() - started < 0.1, "between steps it spins: one yield, back at once"
        service.let_spin(False)
        started = time.monotonic()
        wait(reader, timeout_ms=30)
        assert 0.025 <= time.monotonic() - started < 1.0, "during a step it sleeps until notified (here: timeout)"
        assert reader.busy_loop_s == 1, "vLLM's own setting is left as it was"
        for timeout_ms in (5000, None):  # vLLM's recheck interval, and its wait without a deadline
            started = time.monotonic()
            wait(reader, timeout_ms=timeout_ms)
            slept = time.monotonic() - started
            assert 0.04 <= slept < 1.0, f"a dropped notification costs at most ~50 ms, not {slept:.2f} s"
        writer.notify()  # a new model step
        assert reader.local_notify_socket.poll(1000), "the notification reached the reader's socket"
        wait(reader, timeout_ms=5000)
        assert not reader.local_notify_socket.poll(0), "the wait took the notification: it woke on it"
    finally:
        context.destroy(linger=0)
