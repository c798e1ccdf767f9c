"""`TrainerService`: the state and logic behind the HTTP layer.

It owns the vLLM engine, the LoRA trainer, the checkpoint folder and the collector client; it
names models (`base`, `name@N`, `name@latest`) and runs one step at a time:
lease a batch → train (GRPO or SFT; in `torchrun` workers with a `TrainLauncher`) → save
`checkpoints/step-N` → hot-load `name@N` → ack → promotion gate (eval) → retention (`Retention`) → metrics.
A step that fails, or whose checkpoint cannot be written or loaded, is rolled back in memory
and never served. One whose hot-load a shutdown gave up keeps its checkpoint for the next start.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from collector.protocol import Batch
from trainer_service.allocator import loaded_allocator
from trainer_service.checkpoints import CheckpointStore
from trainer_service.collector_client import CollectorClient
from trainer_service.config import TrainerSettings
from trainer_service.core_lending import CoreLender
from trainer_service.distributed import TrainLauncher
from trainer_service.engine import VLLMEngine
from trainer_service.engine_errors import EngineError
from trainer_service.evaluation import Evaluator, build_evaluator
from trainer_service.failed_steps import blames_the_data, release_failed
from trainer_service.grpo_config import GRPOConfig
from trainer_service.metrics import MetricsSink
from trainer_service.promotion import PromotionGate
from trainer_service.protocol import (
    EngineStatus,
    PromotionDecision,
    ScheduleStatus,
    ServiceError,
    StatusResponse,
    TrainResponse,
)
from trainer_service.retention import Retention
from trainer_service.schedule import TrainingSchedule, describe
from trainer_service.stoppable import wait_unless_stopping
from trainer_service.training import LoRATrainer, NothingTrainableError

__all__ = ["TrainerService"]

logger = logging.getLogger(__name__)

_STATUS_QUEUE_WAIT_S = 5.0
"""Longest `status` waits for the collector's queue depth: a collector that takes connections but does not answer
would hold `GET /v1/status` for the collector's whole timeout (60 s)."""

_NAMED_STEPS = 5
"""How many of the newest `name@N` a 404 `model_not_found` and `GET /v1/status` (`models`, `checkpoints`) name: a run
keeping thousands of checkpoints would make their bodies huge; `GET /v1/models` lists them all."""

_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})

_HOT_LOAD_GRACE_S = 3.0
"""Seconds a running step's hot-load is still waited for once shutdown began: a vLLM that answers loads an adapter
well within it (the step then ends as usual); one that accepts and never answers held the shutdown for the load's
whole timeout (120 s), and `VLLMEngine.stop` only gives a load up once the step is over."""


class _LoadGivenUp(Exception):
    """A step's hot-load given up for a shutdown (`_HOT_LOAD_GRACE_S`): its checkpoint `path` is whole on disk, its
    `metrics` not recorded yet."""

    def __init__(self, metrics: dict[str, float], path: Path) -> None:
        super().__init__(f"the hot-load of {path} was given up for a shutdown")
        self.metrics = metrics
        self.path = path


def _write_fix(exc: OSError, path: Path) -> str:
    """The fix a 507 names for checkpoint folder `path` that could not be written, from the errno of `exc` (a
    `CheckpointWriteError` carries its writer's, safetensors' and a `--train-processes` rank's too) or of the `OSError`
    it chains: "; free disk space" only for a full disk (also `torch.save` failing on a nearly full file system,
    see `checkpoint_folder._save_optimizer`), with "or raise the disk quota" for a quota; "" for an error without a
    known errno (the writer's message, kept in the 507, names the cause)."""
    error = exc
    while error.errno is None and isinstance(error.__cause__, OSError):
        error = error.__cause__
    if isinstance(error, FileExistsError):  # a half-written `step-N` start-up could not remove (the log says why)
        return f"; remove {path} by hand"
    if error.errno == errno.EDQUOT:
        return "; free disk space or raise the disk quota of the service's user"
    if error.errno == errno.ENOSPC:
        return "; free disk space"
    if error.errno in _NOT_WRITABLE:
        return f"; let the service's user write to {path.parent}"
    return ""


class TrainerService:
    """Serving and training state of one trainer service.

    Args:
        settings: service settings.
        grpo: GRPO hyper-parameters.
        engine: the vLLM supervisor (not started yet).
        trainer_factory: builds the `LoRATrainer` (called in a worker thread at start-up).
        collector_transport: httpx transport for the collector (tests inject a mock).
        evaluator: the promotion gate's evaluator; built from the settings when None and an
            eval set is configured.
        launcher: runs each step in data-parallel worker processes; None trains in this process.
        lender: counts the requests the proxy sends to vLLM (`lender.engine_request`) and lends
            the engine's idle cores to the step (`CoreLender`); default: counts them, lends nothing.

    Raises:
        CheckpointMismatchError: a kept checkpoint was trained on another base model, LoRA shape or alpha, or a
            manifest or `promotion.json` cannot be read (checked here, before anything starts).
    """

    def __init__(
        self,
        settings: TrainerSettings,
        grpo: GRPOConfig,
        engine: VLLMEngine,
        trainer_factory: Callable[[], LoRATrainer],
        collector_transport: httpx.AsyncBaseTransport | None = None,
        evaluator: Evaluator | None = None,
        launcher: TrainLauncher | None = None,
        lender: CoreLender | None = None,
    ) -> None:
        grpo.check_against(settings)
        self.settings = settings
        self.grpo = grpo
        self.engine = engine
        self._trainer_factory = trainer_factory
        self.launcher = launcher
        self.lender = lender or CoreLender(1, 1)
        self.trainer: LoRATrainer | None = None
        self.base_name = engine.served_name
        self.store = CheckpointStore(settings.run_dir / "checkpoints")
        self.store.check_compatible(settings.base_model, grpo.lora_r, grpo.target_modules, grpo.lora_alpha)
        self.steps: list[int] = []
        self.last_error: str | None = None
        self.paused = False
        self.counters: Counter[str] = Counter()
        self.allocator = loaded_allocator() or "system"
        self._lock = asyncio.Lock()
        self._closing = threading.Event()
        """Set once shutdown began (`begin_shutdown`): no step starts, a running step's hot-load gives up."""
        self._step_running = False
        """True while `train_once` runs a step: status's `training` (`aclose` holds `_lock` too, to stop)."""
        self.collector = CollectorClient(settings, collector_transport)
        evaluator = evaluator or build_evaluator(settings, self.collector.http, engine.base_url)
        self.gate = PromotionGate(settings, self.store, evaluator, self.model_name, lambda: self.base_name)
        self.retention = Retention(settings, self.store, engine, self.gate, self.model_name, self.counters)
        self.metrics = MetricsSink(settings.run_dir, wandb=settings.wandb, project=settings.wandb_project,
                                   run_name=settings.name, config={"settings": settings.model_dump(mode="json"),
                                                                   "grpo": grpo.to_dict()})
        self.schedule = TrainingSchedule(settings, self._scheduled_step, self.queue_depth)

    # --- life cycle ---------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        """`output_dir/checkpoints`."""
        return self.store.root

    def start(self) -> None:
        """Start vLLM, build the trainer and resume from kept checkpoints (blocking).

        `name@latest` returns to the promoted step; retention drops the checkpoints the policy (perhaps changed
        since) no longer keeps (`Retention.prune`); every other one is re-registered as `name@N`; the trainer resumes
        the newest (step counter, adapter, optimizer). With `settings.warm_up`, the trainer first runs
        `LoRATrainer.warm_up`, lent the idle engine's cores.
        When anything fails, vLLM's start included (Ctrl-C while it loads), vLLM is stopped before the error is
        raised: no engine is left running (with its memory and port) behind a service that did not start.
        """
        try:
            self.engine.start()
            self.trainer = self._trainer_factory()
            if self.settings.warm_up and self.launcher is None:  # worker processes hold their own memory
                with self.lender.lending():
                    logger.info("trainer warmed up in %.1f s", self.trainer.warm_up())
            self.store.remove_partial()
            existing = [step for step, _ in self.store.existing()]
            self.gate.restore(existing)
            for step in self.retention.prune(existing):  # the promoted step is kept; a dropped one is never loaded
                self.engine.load_adapter(self.model_name(step), self.store.path(step))
                self.steps.append(step)
            if self.steps:
                newest = self.store.path(self.steps[-1])
                manifest = self.trainer.resume(newest)
                logger.info("resumed from %s (step %s)", newest, manifest["step"])
        except BaseException:
            self.engine.stop()
            raise

    def begin_shutdown(self) -> None:
        """Stop the schedule and refuse new steps; a running step finishes, but a hot-load vLLM has not answered
        `_HOT_LOAD_GRACE_S` after this is given up (`_unserved`). Called as the server's shutdown begins (before it
        waits for open requests, a manual step among them), and by `aclose`."""
        self.schedule.shutdown()
        self._closing.set()

    async def aclose(self) -> None:
        """Stop the schedule, let a running step finish, then stop the engine and close the clients and sinks.

        A step that runs (scheduled or manual) ends as usual: checkpoint, hot-load, ack, gate, metrics.
        Stopping under it would leave its batch leased and its metrics unwritten; no new step starts. Only a
        hot-load vLLM does not answer within `_HOT_LOAD_GRACE_S` is given up (`begin_shutdown`): it held the
        shutdown for its whole timeout, and the step's checkpoint stays for the next start to serve.
        """
        self.begin_shutdown()
        if self._lock.locked():
            logger.info("shutting down: waiting for the running training step to finish")
        async with self._lock:
            try:
                await self.gate.aclose()
                await self.collector.aclose()
                await asyncio.to_thread(self.metrics.close)
            finally:  # a client or sink that fails to close leaves no vLLM running (its memory, its port)
                await asyncio.to_thread(self.engine.stop)

    # --- model names --------------------------------------------------------------------

    def model_name(self, step: int) -> str:
        """`name@step`."""
        return f"{self.settings.name}@{step}"

    @property
    def latest_model(self) -> str:
        """What `name@latest` (and plain `name`) resolve to: the promoted checkpoint, else the base."""
        latest = self.gate.latest
        return self.model_name(latest) if latest is not None else self.base_name

    def served_models(self) -> list[str]:
        """Every model name clients may request, base first and `name@latest` last."""
        return [self.base_name, *(self.model_name(s) for s in self.steps), f"{self.settings.name}@latest"]

    def _newest_models(self) -> list[str]:
        """`name@N` of the newest `_NAMED_STEPS` steps, oldest first."""
        return [self.model_name(step) for step in self.steps[-_NAMED_STEPS:]]

    def _some_served_models(self) -> str:
        """The base, `name@latest` and the newest `_NAMED_STEPS` steps, then how many more `GET /v1/models` lists."""
        newest = self._newest_models()
        named = ", ".join([self.base_name, f"{self.settings.name}@latest", *newest])
        more = len(self.steps) - len(newest)
        return f"{named}, ... ({more} more; GET /v1/models lists them)" if more else named

    def resolve(self, model: str) -> str:
        """Map a requested model name to the engine's name.

        Raises:
            ServiceError: 503 `adapter_loading` for a checkpoint vLLM is re-loading (after a restart of vLLM,
                or refused since; OpenAI clients retry a 503), 404 `model_not_found` for an unknown name.
        """
        latest = model in (f"{self.settings.name}@latest", self.settings.name)
        target = self.latest_model if latest else model
        if target in self.engine.pending_adapters:
            raise ServiceError(503, "adapter_loading", f"The model `{target}` is being re-loaded into vLLM after "
                               "a restart of vLLM; retry shortly (GET /v1/status shows engine.pending_adapters).",
                               type="server_error")
        if latest or target == self.base_name or target in self.engine.adapters:
            return target
        raise ServiceError(
            404,
            "model_not_found",
            f"The model `{model}` does not exist. Available: {self._some_served_models()}.",
            type="not_found_error",
            param="model",
        )

    # --- control ------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop every step (scheduled and manual) from starting; a running step finishes."""
        self.paused = True

    def resume(self) -> None:
        """Allow steps again."""
        self.paused = False

    async def queue_depth(self) -> int:
        """Groups ready for training at the collector (`CollectorClient.ready_groups`)."""
        return await self.collector.ready_groups()

    # --- training -----------------------------------------------------------------------

    async def train_once(self, *, kind: str = "grpo", min_groups: int = 1, source: str = "manual") -> TrainResponse:
        """Run one step now: lease a batch, train, checkpoint, hot-load, ack, gate, retain.

        Args:
            kind: `grpo`, or `sft` (supervised on the best trajectory of each group).
            min_groups: lease nothing unless this many groups are ready.
            source: what asked for the step (`manual`, `min_groups`, `every`, `cron`), logged.

        Raises:
            ServiceError: 409 when paused, when a step runs already or the collector has nothing
                ready; 503 when the service is shutting down; 422 when no group of the batch is
                trainable; 502 when the collector fails or refuses the ack of a served step; 507
                when the checkpoint or the promotion state cannot be written; 500 `training_failed`
                when training or loading fails, or for any other error. A batch whose step failed,
                whatever the error, is released to the collector (counted as a failed attempt of its
                groups unless `blames_the_data` says the disk, vLLM or the worker processes failed).
        """
        if self._closing.is_set():
            raise ServiceError(503, "shutting_down", "The service is shutting down; no new step starts.",
                               type="server_error")
        if self.paused:
            raise ServiceError(409, "paused", "Training is paused; POST /v1/resume to train again.")
        if self._lock.locked():
            raise ServiceError(409, "training_in_progress", "A training step is running; wait for it to finish.")
        async with self._lock:
            self._step_running = True
            try:
                result = await self._train_locked(kind, min_groups)
            except ServiceError as exc:
                if exc.body.error.code != "no_batch_ready":  # nothing to train is no failed step: keep the last one's
                    self.last_error = exc.body.error.message
                raise
            except Exception as exc:
                logger.exception("training step (%s, %s) failed unexpectedly", kind, source)
                error = ServiceError(500, "training_failed", f"The training step failed unexpectedly: "
                                     f"{type(exc).__name__}: {str(exc)[:500]}. The service log has the traceback.",
                                     type="server_error")
                self.last_error = error.body.error.message
                raise error from exc
            finally:
                self._step_running = False
        logger.info("step %s (%s, %s) -> %s; latest: %s", result.step, kind, source, result.model, result.latest_model)
        return result

    async def _scheduled_step(self, source: str, min_groups: int) -> TrainResponse:
        return await self.train_once(min_groups=min_groups, source=source)

    async def _train_locked(self, kind: str, min_groups: int) -> TrainResponse:
        trainer = self.trainer
        if trainer is None:
            raise ServiceError(503, "not_ready", "The trainer is still starting; try again shortly.",
                               type="server_error")
        batch = await self.collector.lease(min_groups)
        step = trainer.step_count + 1
        try:
            metrics, path = await asyncio.to_thread(self._train_and_publish, trainer, batch, step, kind)
        except NothingTrainableError as exc:
            # Such groups can never train; acking keeps them from coming back forever.
            await self.collector.ack(batch.id, None)
            raise ServiceError(422, "nothing_trainable", f"{exc} Batch {batch.id} was acked without a step.") from exc
        except OSError as exc:  # `CheckpointWriteError` from any writer, or the launcher's job folder
            logger.exception("checkpoint of step %s could not be written", step)
            fate = await release_failed(self.collector, batch, exc, failed=False, counters=self.counters)
            raise ServiceError(507, "checkpoint_write_failed", f"Step {step} trained but its checkpoint could not "
                               f"be written to {self.checkpoint_dir}: {exc}. Nothing was served and the trainer was "
                               f"rolled back{_write_fix(exc, self.store.path(step))}. {fate}",
                               type="server_error") from exc
        except _LoadGivenUp as given_up:
            raise await self._unserved(batch, step, kind, given_up) from given_up
        except Exception as exc:
            logger.exception("training step %s failed", step)
            fate = await release_failed(self.collector, batch, exc, failed=blames_the_data(exc),
                                        counters=self.counters)
            raise ServiceError(500, "training_failed", f"Step {step} failed: {type(exc).__name__}: {exc}. {fate}",
                               type="server_error") from exc
        self.steps.append(step)
        # The step is served from here on: gate, retention and metrics run whatever the ack and the
        # gate's save do; their failures are reported once the step's bookkeeping is done.
        deferred: list[ServiceError] = []
        ack_error = await self._ack(batch, step)
        if ack_error is not None:
            deferred.append(ack_error)
        metrics["collector/ack_failed"] = float(bool(deferred))
        decision: PromotionDecision | None = None
        try:
            decision = await self.gate.judge(step)
        except ServiceError as exc:
            deferred.append(exc)
            self.counters["promotion_write_errors"] += 1
        if step in self.gate.evals:
            metrics["eval/reward"] = self.gate.evals[step]
        metrics["promotion/promoted"] = float(self.gate.latest == step)
        await self.retention.apply(self.steps)
        await self._record(step, metrics, batch, kind)
        if decision is None or deferred:  # no decision only when the gate could not save it (deferred)
            raise deferred[0]
        self.last_error = None
        return TrainResponse(step=step, model=self.model_name(step), checkpoint=str(path), batch_id=batch.id,
                             kind=kind, latest_model=self.latest_model, promotion=decision, metrics=metrics)

    def _train_and_publish(self, trainer: LoRATrainer, batch: Batch, step: int,
                           kind: str) -> tuple[dict[str, float], Path]:
        """Worker-thread part of a step: train, save, hot-load; roll back if any of them fails."""
        snapshot = trainer.snapshot()
        path = self.store.path(step)
        try:
            if self.launcher is not None:
                with self.lender.lending():  # lends nothing to the workers; takes the engine's borrowed cores back
                    metrics = self.launcher.step(trainer, batch, kind, path)  # rank 0 saved the checkpoint
                started = time.perf_counter()
            else:
                with self.lender.lending():
                    metrics = trainer.train(batch.groups, kind)
                started = time.perf_counter()
                trainer.save(path, batch_id=batch.id, metrics=metrics)
        except Exception:
            trainer.restore(snapshot)
            raise
        name = self.model_name(step)
        loading = wait_unless_stopping(lambda: self.engine.load_adapter(name, path), self._closing, f"hot-load {name}",
                                       grace=_HOT_LOAD_GRACE_S)
        if not loading.done():  # left to end on its own: `VLLMEngine.stop` gives it up in turn
            raise _LoadGivenUp(metrics, path)
        try:
            loading.result()
        except EngineError:
            trainer.restore(snapshot)
            self._discard(step)
            raise
        metrics["time/publish_s"] = time.perf_counter() - started
        return metrics, path

    async def _ack(self, batch: Batch, step: int) -> ServiceError | None:
        """Ack `batch` as trained into `step`; a refusal is logged, counted (`ack_failures`) and returned."""
        try:
            await self.collector.ack(batch.id, step)
        except ServiceError as exc:
            self.counters["ack_failures"] += 1
            logger.error("step %s is saved but its batch was not acked: %s", step, exc)
            return exc
        return None

    async def _record(self, step: int, metrics: dict[str, float], batch: Batch, kind: str) -> None:
        """Write the `metrics` of `step`; a failure is logged and counted (`metrics_write_errors`)."""
        try:
            await asyncio.to_thread(self.metrics.emit, step, metrics, batch_id=batch.id, model=self.model_name(step),
                                    kind=kind)
        except OSError:
            self.counters["metrics_write_errors"] += 1
            logger.exception("metrics of step %s could not be written", step)

    async def _unserved(self, batch: Batch, step: int, kind: str, given_up: _LoadGivenUp) -> ServiceError:
        """The answer of `step`, saved but not served: a shutdown gave its hot-load up. The trainer keeps the step and
        the batch is acked, as the next start serves and resumes from the checkpoint (training the batch again would
        train it twice); its metrics are recorded. Neither the gate nor retention runs (the next start's does)."""
        logger.warning("step %s is saved in %s but not served: shutting down, vLLM did not answer its hot-load "
                       "within %g s; the next start serves it", step, given_up.path, _HOT_LOAD_GRACE_S)
        ack_error = await self._ack(batch, step)
        metrics = {**given_up.metrics, "collector/ack_failed": float(ack_error is not None)}
        await self._record(step, metrics, batch, kind)
        acked = (f"its batch {batch.id} was acked" if ack_error is None else
                 f"its batch {batch.id} was not acked ({ack_error.body.error.message})")
        return ServiceError(503, "shutting_down", f"Step {step} is saved in {given_up.path} and {acked}, but it is "
                            f"not served: the service is shutting down and vLLM did not answer its hot-load within "
                            f"{_HOT_LOAD_GRACE_S:g} s. The next start serves it as {self.model_name(step)}.",
                            type="server_error")

    def _discard(self, step: int) -> None:
        """Delete the checkpoint of `step`, which vLLM could not load; a failure is logged with its path, so the
        engine's error stays the step's answer (a left `step-N` stops the next step's save, which names it)."""
        try:
            self.store.delete(step)
        except OSError:
            logger.exception("step %s: vLLM could not load it and its checkpoint %s could not be deleted; remove it "
                             "by hand", step, self.store.path(step))

    # --- status -------------------------------------------------------------------------

    def _newest_evals(self) -> dict[int, float]:
        """Mean eval reward of the newest `_NAMED_STEPS` evaluated steps and of the promoted one (the gate's
        baseline; 0: the base model), by step."""
        evals = self.gate.evals
        shown = set(sorted(evals)[-_NAMED_STEPS:]) | ({self.gate.latest or 0} & evals.keys())
        return {step: evals[step] for step in sorted(shown)}

    async def _status_queue_depth(self) -> tuple[int | None, str | None]:
        """The queue depth, or None and why it is unknown: the collector's error, no answer within
        `_STATUS_QUEUE_WAIT_S`, or a shutdown under way (`aclose` closes the collector's client)."""
        if self._closing.is_set():
            return None, "The service is shutting down; the collector is not asked for the queue depth."
        try:
            return await asyncio.wait_for(self.queue_depth(), _STATUS_QUEUE_WAIT_S), None
        except ServiceError as exc:
            return None, exc.body.error.message
        except TimeoutError:
            return None, (f"The collector at {self.collector.shown_url} did not answer GET /v1/groups?state=ready "
                          f"within {_STATUS_QUEUE_WAIT_S:g} s; the queue depth is unknown.")

    async def status(self) -> StatusResponse:
        """Step, models, queue depth, schedule, promotion, last metrics and engine health.

        `training` is true while a step runs, not while `aclose` stops the service (`_status_queue_depth` says so
        in `queue_error` once shutdown began). `last_metrics` are those of `step`: the trainer's own while its gate
        runs (or after a restart that came before they were recorded), without `eval/reward` and `promotion/promoted`.
        """
        healthy = await asyncio.to_thread(self.engine.healthy)
        queue_depth, queue_error = await self._status_queue_depth()
        trainer = self.trainer
        step = self.steps[-1] if self.steps else 0  # the newest served step: a running one counts once it is served
        last_metrics = self.metrics.last  # recorded once a step ended
        if last_metrics.get("step") != step:  # an older step's (the gate runs, or a restart came before the record)
            last_metrics = dict(trainer.last_metrics) if trainer and trainer.step_count == step else {}
        next_run = self.schedule.next_run()
        return StatusResponse(
            name=self.settings.name,
            base_model=self.base_name,
            step=step,
            latest_model=self.latest_model,
            models=[self.base_name, *self._newest_models(), f"{self.settings.name}@latest"],
            checkpoints=self.steps[-_NAMED_STEPS:],
            checkpoint_count=len(self.steps),
            training=self._step_running,
            queue_depth=queue_depth,
            queue_error=queue_error,
            schedule=ScheduleStatus(triggers=describe(self.settings), paused=self.paused,
                                    next_run=next_run.isoformat() if next_run else None,
                                    counts=dict(self.schedule.counts), last_outcome=self.schedule.last_outcome),
            promotion=self.gate.decision,
            eval_rewards=self._newest_evals(),
            eval_reward_count=len(self.gate.evals),
            last_metrics=last_metrics,
            counters={**self.counters, **self.lender.counters, "metrics_sink_errors": self.metrics.sink_errors,
                      "eval_failures": self.gate.eval_failures},
            last_error=self.last_error,
            allocator=self.allocator,
            engine=EngineStatus(healthy=healthy, pid=self.engine.pid, restarts=self.engine.restarts,
                                last_restart_reason=self.engine.last_restart_reason,
                                next_restart_in_s=self.engine.next_restart_in,
                                pending_adapters=self.engine.pending_adapters,
                                url=self.engine.base_url, requests_in_flight=self.lender.in_flight,
                                training_threads=self.lender.threads, dtype=self.engine.dtype,
                                cpu_matmul_dtype=self.engine.cpu_matmul_dtype,
                                threads=self.engine.threads.threads if self.engine.threads else None),
        )

    async def watch_engine(self, interval: float = 10.0) -> None:
        """Forever, every `interval` seconds: `engine.ensure_running` (restart vLLM when it died or stopped
        answering `/health`, re-load adapters). Run as a background task; a failure is logged, counted
        (`engine_supervision_errors`) and tried again at the next check, so supervision never stops."""
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(self.engine.ensure_running)
            except Exception:  # any error escaping this loop would end supervision for good; logged and counted
                self.counters["engine_supervision_errors"] += 1
                logger.exception("keeping vLLM serving failed; trying again in %.0f s", interval)
