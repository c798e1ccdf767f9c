"""Data-parallel training steps in worker processes started by `torchrun`.

With `train_processes = N > 1` the service runs each step (GRPO or SFT) in N workers started as
`python -m torch.distributed.run --standalone --nproc-per-node N -m trainer_service.distributed JOB`.
torchrun rather than `accelerate launch`: it ships with torch (no other launcher, no config
file), sets `RANK` / `LOCAL_RANK` / `WORLD_SIZE`, picks a free rendezvous port itself
(`--standalone`, so several services on one machine do not collide) and stops every worker
as soon as one fails; `accelerate launch` runs the same launcher underneath for multi-GPU jobs.

One step (`TrainLauncher.step`):

1. The service's trainer checks the batch (a batch with nothing trainable fails before any
   process starts) and saves its state (adapter, optimizer, step) into a job folder next to the
   checkpoints, with the batch and the job description.
2. Each rank loads the base model (one GPU per rank with nccl; gloo on a CPU), resumes that
   state and runs `LoRATrainer.train`: it trains its share of the trajectories and the
   gradients are summed over the ranks (see `LoRATrainer._sum_over_ranks`), so every rank takes
   the step one process would take on the whole batch.
3. Rank 0 writes the checkpoint with `LoRATrainer.save`.
4. The service's trainer resumes from it and the folder is renamed to `checkpoints/step-N`;
   the service then hot-loads it as after an in-process step.

A failing worker leaves no checkpoint: `DistributedStepError` names its rank and error, says
whether the batch's data is to blame (`data_fault`: the error came from the step itself, as it
would have in one process, not from starting, loading, saving or the collectives), and the
job folder (named `.step-N.dist-*`, so a crash's leftover is removed at start) is deleted. So
does a step that outlives `timeout` (the workers' collectives wait as long, since a rank waits in
the all-reduce for the slowest one): torchrun is sent SIGTERM, on which it stops every worker.
torchrun dies with the service (`parent_death`) and each worker with torchrun (SIGKILL), so a
killed service or torchrun leaves no worker behind.
Rank 0 failing to write the checkpoint (a full disk) is a `CheckpointWriteError`, as in one process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from collector.protocol import Batch
from trainer_service.checkpoint_folder import CheckpointWriteError
from trainer_service.durable import durable_rename
from trainer_service.grpo_config import GRPOConfig
from trainer_service.parent_death import die_with_parent, launch_command
from trainer_service.training import LoRATrainer

__all__ = ["DistributedStepError", "TrainLauncher"]

_JOB = "job.json"
_BATCH = "batch.json"
_STATE = "state"
_OUTPUT = "checkpoint"
_ERROR = "error-rank{rank}.json"

logger = logging.getLogger(__name__)


class DistributedStepError(RuntimeError):
    """A training worker failed; no checkpoint of the step was written.

    `data_fault` is True only when the first failing worker failed inside `LoRATrainer.train` with
    an error of its own (not a collective's `torch.distributed.DistError`): the one-process step
    would have failed the same way on this batch. A timeout, a worker that died without a report,
    or a failure to start, load or save blames the workers, not the data.
    """

    def __init__(self, message: str, *, data_fault: bool = False) -> None:
        super().__init__(message)
        self.data_fault = data_fault


@dataclass(frozen=True)
class TrainLauncher:
    """Runs training steps in `processes` torchrun workers.

    Args:
        processes: number of workers (ranks); one GPU each when CUDA is present.
        model_path: local folder of the base model (what `LoRATrainer.load` reads).
        log_path: file the workers' output is appended to.
        chat_template: chat template file for re-tokenization (see `LoRATrainer.load`).
        cpu_threads: torch threads of each worker on a CPU.
        timeout: seconds one step's workers may run (start, load, step, save), and their collectives' timeout;
            None waits forever (the collectives keep torch's: 30 min with gloo, 10 with NCCL).
    """

    processes: int
    model_path: str
    log_path: Path
    chat_template: str | None = None
    cpu_threads: int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        """Check the number of workers (`TrainerSettings` checks it against the visible GPUs)."""
        if self.processes < 2:
            raise ValueError(f"train_processes={self.processes}: worker processes are for 2 or more; "
                             "1 trains in the service process.")

    def step(self, trainer: LoRATrainer, batch: Batch, kind: str, dest: Path) -> dict[str, float]:
        """Train one `kind` step (`grpo` or `sft`) on `batch` in the workers; write it to `dest`.

        On return `dest` is the checkpoint rank 0 wrote and `trainer` has resumed from it (same
        adapter, optimizer state and step counter as the workers).

        Returns:
            The step's metrics, plus `time/workers_s` (the workers' whole run: start, load, step, save).

        Raises:
            NothingTrainableError: nothing in the batch can train (no process is started).
            DistributedStepError: a worker failed; `dest` is not written and `trainer` is unchanged.
            OSError: the job folder or the checkpoint could not be written (`CheckpointWriteError` when a
                checkpoint writer failed, here or in rank 0).
        """
        trainer.prepare(batch.groups, kind)
        if dest.exists():
            raise FileExistsError(f"checkpoint {dest} exists already; remove it or choose another step folder")
        job = dest.with_name(f".{dest.name}.dist-{uuid.uuid4().hex[:8]}")
        job.mkdir(parents=True)
        try:
            trainer.save(job / _STATE)
            # Python's `json` keeps a NaN or infinite reward or log-prob (`NaN`, `Infinity`, read back as the
            # collector's answer was); `model_dump_json` wrote `null`, which failed the workers' read of `rewards`
            (job / _BATCH).write_text(json.dumps(batch.model_dump(mode="json")))
            (job / _JOB).write_text(json.dumps({
                "model_path": self.model_path, "base_model": trainer.base_model, "chat_template": self.chat_template,
                "cpu_threads": self.cpu_threads, "config": trainer.config.to_dict(), "kind": kind,
                "batch_id": batch.id, "timeout": self.timeout,
            }))
            started = time.perf_counter()
            self._launch(job)
            elapsed = time.perf_counter() - started
            manifest = trainer.resume(job / _OUTPUT)
            durable_rename(job / _OUTPUT, dest)
        finally:
            shutil.rmtree(job, ignore_errors=True)
        metrics = {**manifest["metrics"], "time/workers_s": elapsed}
        trainer.last_metrics = metrics
        return metrics

    def _launch(self, job: Path) -> None:
        """Run the workers on `job`; raise the first worker error (`_worker_error`)."""
        # Stopped with its workers when the service dies (a SIGKILL, the OOM killer): nothing else would stop them.
        command = launch_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={self.processes}", "--module", __name__, str(job)])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                # torchrun starts each worker in a session of its own and stops them all on SIGTERM.
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                raise DistributedStepError(
                    f"the {self.processes} training workers did not finish within {self.timeout:g} s (a stuck rank "
                    f"or a collective that never completes) and were stopped; see {self.log_path}, or raise "
                    "--train-step-timeout."
                ) from None
        if code == 0 and (job / _OUTPUT).is_dir():
            return
        reports = [report for path in sorted(job.glob(_ERROR.format(rank="*"))) if (report := _read_report(path))]
        if not reports:
            raise DistributedStepError(f"torchrun exited with status {code} and no worker reported an error; "
                                       f"see {self.log_path}.")
        raise _worker_error(reports, self.processes, self.log_path)


def _read_report(path: Path) -> dict[str, Any] | None:
    """A worker's error report (`_error_report`); None, logged, when it is cut short (torchrun stopped that worker,
    once another had failed, while it wrote it)."""
    try:
        return json.loads(path.read_text())
    except ValueError:
        logger.warning("unreadable training worker report %s (its worker was stopped while writing it)", path.name)
        return None


def _worker_error(reports: list[dict[str, Any]], processes: int,
                  log_path: Path) -> CheckpointWriteError | DistributedStepError:
    """The step's error from the workers' error reports (`_error_report`): the earliest one, a `CheckpointWriteError`
    when it could not write the checkpoint, else a `DistributedStepError` with its `data_fault`."""
    first = min(reports, key=lambda r: r["time"])
    message = (f"training worker rank {first['rank']} of {processes} failed {first['phase']}: {first['error']} "
               f"(traceback in {log_path})")
    if first["write_failed"]:
        return CheckpointWriteError(message, first["errno"])
    return DistributedStepError(message, data_fault=first["data_fault"])


def _error_report(rank: int, phase: str, error: Exception) -> dict[str, Any]:
    """What a failing worker writes for the launcher: its rank and phase, the error, whether the batch's data is to
    blame (it failed training, not in a collective) and whether a checkpoint write failed (and its errno)."""
    return {"rank": rank, "time": time.time(), "phase": phase, "error": f"{type(error).__name__}: {error}",
            "data_fault": phase == "training" and not isinstance(error, dist.DistError),
            "write_failed": isinstance(error, CheckpointWriteError),
            "errno": error.errno if isinstance(error, CheckpointWriteError) else None,
            "traceback": "".join(traceback.format_exception(error))}


def _run_worker(job: Path) -> None:
    """One rank of a step: load, resume, train its share, all-reduce; rank 0 saves the checkpoint."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    phase = "starting"
    try:
        # Each worker leads a session of its own: killed when torchrun dies without stopping it (SIGKILL).
        torchrun = os.getppid()
        if not die_with_parent(torchrun, signal.SIGKILL):
            raise RuntimeError(f"torchrun (process {torchrun}) ended before rank {rank} started")
        spec = json.loads((job / _JOB).read_text())
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        timeout = None if spec["timeout"] is None else timedelta(seconds=spec["timeout"])
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)  # collectives wait as long as the step
        phase = "loading"
        trainer = LoRATrainer.load(spec["model_path"], GRPOConfig(**spec["config"]), base_model=spec["base_model"],
                                   chat_template=spec["chat_template"], cpu_threads=spec["cpu_threads"],
                                   device=f"cuda:{local_rank}" if cuda else "cpu")
        trainer.resume(job / _STATE)
        groups = Batch.model_validate_json((job / _BATCH).read_text()).groups
        phase = "training"
        metrics = trainer.train(groups, spec["kind"])
        phase = "saving"
        if rank == 0:
            trainer.save(job / _OUTPUT, batch_id=spec["batch_id"], metrics=metrics)
    except Exception as exc:
        # Written before the group is torn down: its peers see the teardown as their collective failing, and the
        # launcher takes the earliest report for the step's error.
        (job / _ERROR.format(rank=rank)).write_text(json.dumps(_error_report(rank, phase, exc)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    _run_worker(Path(sys.argv[1]))
