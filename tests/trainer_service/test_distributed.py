"""Data-parallel steps in 2 `torchrun` workers (gloo on this CPU) against the in-process step.

The service trains through a real `TrainLauncher` (real processes, real all-reduce) on the tiny
random Llama, saved to a folder the workers load; the fake engine and mock collector are the
ones of `builders`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from collector.protocol import Batch, Group
from tests.trainer_service.builders import (
    BAD,
    GOOD,
    adapter_gap,
    adapter_weights,
    group,
    make_service,
    make_trainer,
    save_tiny_model,
    tiny_model,
    trajectory,
)
from trainer_service import distributed, durable
from trainer_service.checkpoint_folder import CheckpointWriteError
from trainer_service.config import TrainerSettings
from trainer_service.distributed import (
    DistributedStepError,
    TrainLauncher,
    _error_report,
    _run_worker,
    _worker_error,
)
from trainer_service.grpo_config import GRPOConfig
from trainer_service.protocol import ServiceError
from trainer_service.server import build_service
from trainer_service.training import LoRATrainer


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model()` (the weights `make_trainer` builds in memory) as a folder with a tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def batch_groups(trainer: LoRATrainer) -> list[Group]:
    """Three groups, six trajectories of two lengths: each rank gets three whole trajectories."""
    return [group(trainer, (1.0, 0.0), "g1"), group(trainer, (0.2, 0.9), "g2"), group(trainer, (0.0, 0.5), "g3")]


def three_trajectories(trainer: LoRATrainer) -> list[Group]:
    """One group of three trajectories of 14, 10 and 9 tokens: rank 0 trains the longest, rank 1 the other two, each
    trajectory weighing a third of the step (not a half of its rank's). Its SFT step trains one trajectory only,
    leaving rank 1 nothing."""
    return [Group(id="g", trajectories=[trajectory(trainer, GOOD + [903, 904, 905, 906], 0.5, "g-long"),
                                        trajectory(trainer, GOOD, 1.0, "g-a"), trajectory(trainer, BAD, 0.0, "g-b")])]


@pytest.mark.parametrize(("kind", "overrides", "make_groups"), [
    ("grpo", {"kl_coef": 0.05, "micro_batch_size": 2}, batch_groups), ("sft", {}, batch_groups),
    ("grpo", {}, three_trajectories), ("sft", {}, three_trajectories)],
    ids=["grpo-even", "sft-even", "grpo-uneven", "sft-fewer-than-ranks"])
async def test_two_processes_take_the_one_process_step(tmp_path: Path, base_dir: Path, kind: str,
                                                       overrides: dict[str, object],
                                                       make_groups: Callable[[LoRATrainer], list[Group]]) -> None:
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    launcher = TrainLauncher(2, str(base_dir), tmp_path / "train_workers.log", cpu_threads=1)
    service = make_service(tmp_path, batches, acks, launcher=launcher,
                           trainer_factory=lambda: make_trainer(**overrides))
    trainer = service.trainer
    assert trainer is not None
    groups = make_groups(trainer)
    trainer.step(groups)  # in process first: the workers must start from a trained adapter and AdamW state
    before = adapter_weights(trainer)
    reference = make_trainer(**overrides)
    reference.restore(trainer.snapshot())
    expected = reference.train(groups, kind)

    batches.append(Batch(id="b2", groups=groups, lease_expires_at=0))
    result = await service.train_once(kind=kind)

    assert result.step == 2 and result.model == "agent@2" and acks == [("b2", {"policy_step": 2})]
    assert service.engine.adapters["agent@2"] == str(tmp_path / "checkpoints" / "step-2")  # hot-loaded as in-process
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["promotion.json", "step-2"]
    manifest = json.loads((tmp_path / "checkpoints" / "step-2" / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["batch_id"] == "b2"
    off, moved = adapter_gap(adapter_weights(trainer), adapter_weights(reference), before)
    # Equal up to the order of float additions (a 1% learning-rate change is 1e-2 of the move).
    assert moved > 1e-3 and off < 1e-3 * moved, (off, moved)
    for key, value in expected.items():
        if not key.startswith("time/"):
            assert result.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert trainer.step_count == 2 and result.metrics["time/workers_s"] > 0
    await service.aclose()


async def test_a_failing_worker_is_a_readable_500_and_nothing_is_served(tmp_path: Path, base_dir: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(base_dir, broken)
    (broken / "model.safetensors").unlink()
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    releases: list[tuple[str, dict]] = []
    launcher = TrainLauncher(2, str(broken), tmp_path / "train_workers.log", cpu_threads=1)
    service = make_service(tmp_path, batches, acks, launcher=launcher, releases=releases)
    assert service.trainer is not None
    before = adapter_weights(service.trainer)
    batches.append(Batch(id="b1", groups=batch_groups(service.trainer), lease_expires_at=0))

    with pytest.raises(ServiceError) as info:
        await service.train_once()

    error = info.value.body.error
    assert info.value.status == 500 and error.code == "training_failed"
    assert "training worker rank" in error.message and "of 2 failed loading: OSError" in error.message, error.message
    assert "model.safetensors" in error.message and "train_workers.log" in error.message, error.message
    assert "Traceback" in (tmp_path / "train_workers.log").read_text()
    assert not (tmp_path / "checkpoints").exists() or list((tmp_path / "checkpoints").iterdir()) == []
    assert service.engine.adapters == {} and acks == [] and service.steps == []
    # the workers', not the data's
    assert [(batch_id, body["failed"]) for batch_id, body in releases] == [("b1", False)]
    assert service.trainer.step_count == 0
    assert all(torch.equal(v, before[k]) for k, v in adapter_weights(service.trainer).items())
    await service.aclose()


async def test_a_worker_failing_inside_the_step_blames_the_batch(tmp_path: Path) -> None:
    """Token ids inside the service's vocabulary but past the workers' (their base folder holds a model with a
    smaller one) pass the service's checks and fail in both workers: the release counts a failed attempt against
    the groups, and nothing is served."""
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    releases: list[tuple[str, dict]] = []
    workers_base = save_tiny_model(tmp_path / "smaller-vocabulary")
    smaller = tiny_model()
    smaller.resize_token_embeddings(1000)
    smaller.save_pretrained(workers_base)
    launcher = TrainLauncher(2, str(workers_base), tmp_path / "train_workers.log", cpu_threads=1)
    service = make_service(tmp_path, batches, acks, launcher=launcher, releases=releases)
    assert service.trainer is not None
    groups = batch_groups(service.trainer)
    for sampled in (t for g in groups for t in g.trajectories):
        sampled.sequences[0].token_ids[0] = 1000 + 7
    batches.append(Batch(id="b1", groups=groups, lease_expires_at=0))

    with pytest.raises(ServiceError) as info:
        await service.train_once()

    error = info.value.body.error
    assert info.value.status == 500 and "of 2 failed training: NothingTrainableError" in error.message, error.message
    assert [(batch_id, body["failed"]) for batch_id, body in releases] == [("b1", True)]
    assert service.engine.adapters == {} and acks == [] and service.trainer.step_count == 0
    await service.aclose()


async def test_a_step_past_its_timeout_is_stopped_whole(tmp_path: Path, base_dir: Path) -> None:
    """Every rank hangs (its chat template is a FIFO no one writes to): past the timeout, torchrun
    and both workers are killed, the step fails readably and nothing is served."""
    stuck = tmp_path / "template.jinja"
    os.mkfifo(stuck)
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    releases: list[tuple[str, dict]] = []
    launcher = TrainLauncher(2, str(base_dir), tmp_path / "train_workers.log", chat_template=str(stuck), cpu_threads=1,
                             timeout=30)
    service = make_service(tmp_path, batches, acks, launcher=launcher, releases=releases)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=batch_groups(service.trainer), lease_expires_at=0))

    step = asyncio.ensure_future(service.train_once())
    most = 0
    while not step.done():
        most = max(most, len(processes_mentioning(str(tmp_path))))
        await asyncio.sleep(0.2)
    with pytest.raises(ServiceError) as info:
        await step

    assert most == 3, "torchrun and its two workers should have been running"
    error = info.value.body.error
    assert info.value.status == 500 and error.code == "training_failed"
    assert "did not finish within 30 s" in error.message and "--train-step-timeout" in error.message, error.message
    assert processes_mentioning(str(tmp_path)) == []
    assert service.engine.adapters == {} and acks == [] and service.trainer.step_count == 0
    assert [(batch_id, body["failed"]) for batch_id, body in releases] == [("b1", False)]
    assert not (tmp_path / "checkpoints").exists() or list((tmp_path / "checkpoints").iterdir()) == []
    await service.aclose()


def processes_mentioning(text: str) -> list[int]:
    """Pids of running processes whose command line contains `text` (zombies have none)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def test_launcher_checks_its_process_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train_processes=1"):
        TrainLauncher(1, "model", tmp_path / "log")


async def test_build_service_wires_the_launcher(tmp_path: Path, base_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})  # train_threads=4 needs 4 cores
    settings = TrainerSettings(base_model=str(base_dir), output_dir=tmp_path, train_processes=2, train_threads=4,
                               wandb="off")
    service = build_service(settings, GRPOConfig())
    assert service.launcher == TrainLauncher(2, str(base_dir), tmp_path / "train_workers.log", cpu_threads=2,
                                             timeout=3600.0)
    single = build_service(settings.model_copy(update={"train_processes": 1}), GRPOConfig())
    assert single.launcher is None
    await service.aclose()
    await single.aclose()


def test_a_worker_report_says_whether_the_data_or_a_checkpoint_write_failed(tmp_path: Path) -> None:
    log = tmp_path / "train_workers.log"
    full = _error_report(0, "saving", CheckpointWriteError("SafetensorError: File too large (os error 27)"))
    stepped = _error_report(1, "training", IndexError("index out of range"))
    assert json.loads(json.dumps(full))["write_failed"] and not stepped["write_failed"]  # reports travel as JSON
    write = _worker_error([full], 2, log)
    assert isinstance(write, CheckpointWriteError)  # the service's 507, released as not failed
    assert "rank 0 of 2 failed saving: CheckpointWriteError: SafetensorError: File too large" in str(write)
    step = _worker_error([stepped], 2, log)
    assert isinstance(step, DistributedStepError) and step.data_fault and "IndexError" in str(step)


async def test_rank_0_unable_to_write_the_checkpoint_is_507_and_not_the_datas_fault(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: TrainLauncher, job: Path) -> None:  # the workers trained; rank 0's save hit a full disk
        raise _worker_error([_error_report(0, "saving", CheckpointWriteError("OSError: [Errno 28] No space left"))],
                            self.processes, self.log_path)

    monkeypatch.setattr(TrainLauncher, "_launch", full_disk)
    releases: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    launcher = TrainLauncher(2, "unused", tmp_path / "train_workers.log")
    service = make_service(tmp_path, batches, [], launcher=launcher, releases=releases)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=batch_groups(service.trainer), lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 507 and info.value.body.error.code == "checkpoint_write_failed"
    assert "rank 0 of 2 failed saving" in info.value.body.error.message
    assert [(batch_id, body["failed"]) for batch_id, body in releases] == [("b1", False)]
    assert service.steps == [] and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []
    await service.aclose()


async def test_rank_0_on_a_full_disk_names_the_fix_as_one_process_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: TrainLauncher, job: Path) -> None:  # the report reaches the launcher as JSON
        error = CheckpointWriteError("SafetensorError: ... No space left on device (os error 28)", errno.ENOSPC)
        report = json.loads(json.dumps(_error_report(0, "saving", error)))
        raise _worker_error([report], self.processes, self.log_path)

    monkeypatch.setattr(TrainLauncher, "_launch", full_disk)
    batches: list[Batch] = []
    launcher = TrainLauncher(2, "unused", tmp_path / "train_workers.log")
    service = make_service(tmp_path, batches, [], launcher=launcher)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=batch_groups(service.trainer), lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    # the errno stayed in rank 0: the 507 named no fix
    assert info.value.status == 507 and "rolled back; free disk space. Batch b1" in info.value.body.error.message
    await service.aclose()


async def test_the_workers_checkpoint_reaches_its_name_durably(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its files are flushed, then its folder renamed to `step-N`, then the rename flushed (the parent folder)."""
    def rank_0_saved(self: TrainLauncher, job: Path) -> None:
        shutil.copytree(job / "state", job / "checkpoint")  # as if trained and saved by rank 0

    flushed: list[Path] = []
    real_fsync = durable._fsync
    monkeypatch.setattr(TrainLauncher, "_launch", rank_0_saved)
    monkeypatch.setattr(durable, "_fsync", lambda path: (flushed.append(Path(path)), real_fsync(path)))
    service = make_service(tmp_path, [], [], launcher=TrainLauncher(2, "unused", tmp_path / "train_workers.log"))
    assert service.trainer is not None
    dest = service.store.path(1)
    service.launcher.step(service.trainer, Batch(id="b1", groups=batch_groups(service.trainer), lease_expires_at=0),
                          "grpo", dest)
    assert dest.is_dir() and flushed[-1] == dest.parent
    assert any(path.parent.name.startswith(".step-1.dist-") and path.name == "checkpoint" for path in flushed)
    await service.aclose()


@pytest.mark.parametrize("victim", ["service", "torchrun"])
def test_workers_die_with_the_service_or_torchrun(tmp_path: Path, victim: str) -> None:
    """A service (here a child running `TrainLauncher._launch`) or a torchrun killed with SIGKILL mid-step takes the
    step's workers with it; each worker, blocked reading its job description (a FIFO kept open, never written), would
    otherwise run on for good."""
    job = tmp_path / "job"
    job.mkdir()
    os.mkfifo(job / "job.json")
    service = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                                "from trainer_service.distributed import TrainLauncher; "
                                "TrainLauncher(2, 'unused', Path(sys.argv[1]) / 'log', timeout=600)._launch("
                                "Path(sys.argv[1]) / 'job')", str(tmp_path)])
    writer: int | None = None
    try:
        deadline = time.monotonic() + 240
        workers: list[int] = []
        while len(workers) < 2 or not all(reading(pid, job / "job.json") for pid in workers):
            assert time.monotonic() < deadline, "both workers should have opened their job description"
            if writer is None:
                with contextlib.suppress(OSError):  # ENXIO until a worker waits to read
                    writer = os.open(job / "job.json", os.O_WRONLY | os.O_NONBLOCK)
            workers = [pid for pid in processes_mentioning(str(job)) if "-m\0trainer_service.distributed" in
                       Path(f"/proc/{pid}/cmdline").read_text()]
            time.sleep(0.2)
        torchrun = [pid for pid in processes_mentioning(str(job)) if pid not in workers]
        assert len(torchrun) == 1, torchrun
        os.kill(service.pid if victim == "service" else torchrun[0], signal.SIGKILL)
        deadline = time.monotonic() + 90  # torchrun gives its workers 30 s after its SIGTERM
        while processes_mentioning(str(job)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(str(job)) == []
        assert service.wait(timeout=30) != 0
    finally:
        if writer is not None:
            os.close(writer)
        for pid in processes_mentioning(str(job)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        service.kill()
        service.wait()


def reading(pid: int, path: Path) -> bool:
    """Whether process `pid` holds `path` open."""
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def test_a_report_cut_short_leaves_the_readable_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun stops rank 1 while it writes its report, once rank 0 has failed: rank 0's error is the step's."""
    class Failed:
        def __init__(self, *args: object, **kwargs: object) -> None:
            (tmp_path / "error-rank0.json").write_text(json.dumps(_error_report(0, "training", IndexError("bad id"))))
            (tmp_path / "error-rank1.json").write_text('{"rank": 1, "ti')

        def wait(self, timeout: float | None = None) -> int:
            return 1

    monkeypatch.setattr(subprocess, "Popen", Failed)
    with pytest.raises(DistributedStepError, match="rank 0 of 2 failed training: IndexError: bad id") as info:
        TrainLauncher(2, "unused", tmp_path / "train_workers.log")._launch(tmp_path)
    assert info.value.data_fault


_RANK_1_FAILS = """
import os, signal, time
from pathlib import Path

def all_reduce(*args, **kwargs):
    reducing.touch()
    return real_all_reduce(*args, **kwargs)

def fail(self, items, loss_fn):
    while not reducing.exists():
        time.sleep(0.1)
    time.sleep(1)  # rank 0 waits in the all-reduce
    if os.environ["TEST_RANK_1_FAILS"] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does: no report
    raise IndexError("bad token id in rank 1's share")

if "RANK" in os.environ:  # a worker, not torchrun
    import torch.distributed as dist
    import trainer_service.training as training
    reducing = Path(os.environ["TEST_RANK_0_REDUCING"])
    if os.environ["RANK"] == "0":
        real_all_reduce = dist.all_reduce
        dist.all_reduce = all_reduce
    else:
        training.LoRATrainer._accumulate = fail
"""


@pytest.mark.parametrize("how", ["raises", "killed"])
def test_one_rank_failing_while_the_other_waits_in_the_all_reduce(tmp_path: Path, base_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Rank 1 fails in its share of the step while rank 0 waits for it in the all-reduce (a `sitecustomize` the
    workers import makes it so). Raising, rank 1's error is the step's, blamed on the batch, not rank 0's broken
    collective; killed without a report, rank 0's broken collective blames the workers, not the batch."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_RANK_1_FAILS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TEST_RANK_0_REDUCING", str(tmp_path / "rank-0-reducing"))
    monkeypatch.setenv("TEST_RANK_1_FAILS", how)
    trainer = make_trainer()
    launcher = TrainLauncher(2, str(base_dir), tmp_path / "train_workers.log", cpu_threads=1, timeout=300)
    batch = Batch(id="b1", groups=batch_groups(trainer), lease_expires_at=0)

    with pytest.raises(DistributedStepError) as info:
        launcher.step(trainer, batch, "grpo", tmp_path / "checkpoints" / "step-1")

    assert (tmp_path / "rank-0-reducing").exists()
    if how == "raises":
        assert "rank 1 of 2 failed training: IndexError: bad token id" in str(info.value), str(info.value)
        assert info.value.data_fault
    else:
        assert not info.value.data_fault, str(info.value)
    assert not (tmp_path / "checkpoints").exists() or list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize(("timeout", "collectives"), [(7200.0, timedelta(hours=2)), (None, None)])
def test_the_workers_collectives_wait_as_long_as_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          timeout: float | None, collectives: timedelta | None) -> None:
    """A rank waits in the all-reduce for the slowest one (a lopsided split: one long trajectory), so its process
    group waits as long as the step may run, not torch's default (30 min with gloo, 10 with NCCL); None keeps the
    default."""
    asked: list[timedelta | None] = []

    class Started(Exception):
        pass

    def init_process_group(backend: str, **kwargs: object) -> None:
        asked.append(kwargs.get("timeout"))  # type: ignore[arg-type]
        raise Started

    def rank_0(self: TrainLauncher, job: Path) -> None:  # the worker, in this process, up to its process group
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        _run_worker(job)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(distributed, "die_with_parent", lambda parent, sig: True)
    monkeypatch.setattr(TrainLauncher, "_launch", rank_0)
    trainer = make_trainer()
    launcher = TrainLauncher(2, "unused", tmp_path / "train_workers.log", timeout=timeout)
    with pytest.raises(Started):
        launcher.step(trainer, Batch(id="b1", groups=batch_groups(trainer), lease_expires_at=0), "grpo",
                      tmp_path / "checkpoints" / "step-1")
    assert asked == [collectives]


def test_the_workers_read_a_nan_or_infinite_reward_as_the_service_did(tmp_path: Path, base_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch reaches the workers with its NaN and infinite values: a NaN in `rewards` (written `null`) failed
    every worker's read of the batch, and a NaN training reward read as none counted it `unrewarded_trajectories`."""
    read: list[list[Group]] = []

    class Trained(Exception):
        pass

    def train(self: LoRATrainer, groups: list[Group], kind: str = "grpo") -> dict[str, float]:
        read.append(groups)
        raise Trained

    def rank_0(self: TrainLauncher, job: Path) -> None:  # the worker, in this process, up to its training
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        _run_worker(job)

    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: None)
    monkeypatch.setattr(distributed, "die_with_parent", lambda parent, sig: True)
    monkeypatch.setattr(TrainLauncher, "_launch", rank_0)
    monkeypatch.setattr(LoRATrainer, "train", train)
    trainer = make_trainer()
    groups = batch_groups(trainer)
    groups[0].trajectories[0].rewards = {"judge": float("nan")}
    groups[0].trajectories.append(trajectory(trainer, GOOD, float("inf"), "g1-inf"))
    groups[1].trajectories[0].reward = float("nan")
    launcher = TrainLauncher(2, str(base_dir), tmp_path / "train_workers.log")
    with pytest.raises(Trained):
        launcher.step(trainer, Batch(id="b1", groups=groups, lease_expires_at=0), "grpo",
                      tmp_path / "checkpoints" / "step-1")
    [got] = read
    assert math.isnan(got[0].trajectories[0].rewards["judge"])
    assert got[0].trajectories[2].reward == float("inf")
    assert got[1].trajectories[0].reward is not None and math.isnan(got[1].trajectories[0].reward)
    assert [t.reward for t in got[2].trajectories] == [t.reward for t in groups[2].trajectories]
