"""`TrainerService`: the state and logic behind the HTTP layer.

It owns the vLLM engine, the LoRA trainer, the checkpoint folder and the collector client; it
names models (`base`, `name@N`, `name@latest`) and runs one step at a time:
lease a batch → train (GRPO or SFT; in `torchrun` workers with a `TrainLauncher`) → save
`checkpoints/step-N` → hot-load `name@N` → ack → promotion gate (eval) → retention (`Retention`) → metrics.
A step that fails, or whose checkpoint cannot be written or loaded, is rolled back in memory
and never served. One whose hot-load a shutdown gave up keeps its checkpoint for the next start; a shutdown waits for
the engine calls of a running step (hot-load, eval, unloads) only `SHUTDOWN_GRACE_S` (`ShutdownGrace`).
A step's ack, metrics record and unserved answer are `StepBookkeeping`'s (`step_bookkeeping`); `GET /v1/status` is
assembled by `service_status`.
"""

from __future__ import annotations

import asyncio
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
from trainer_service.failed_steps import blames_the_data, release_failed, write_fix
from trainer_service.grpo_config import GRPOConfig
from trainer_service.metrics import MetricsSink
from trainer_service.promotion import PromotionGate
from trainer_service.protocol import PromotionDecision, ServiceError, StatusResponse, TrainResponse
from trainer_service.retention import Retention
from trainer_service.schedule import TrainingSchedule
from trainer_service.service_status import NAMED_STEPS, assemble_status
from trainer_service.step_bookkeeping import LoadGivenUp, ShutdownGrace, StepBookkeeping
from trainer_service.training import LoRATrainer, NothingTrainableError

__all__ = ["TrainerService"]

logger = logging.getLogger(__name__)


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
        self.closing = threading.Event()
        """Set once shutdown began (`begin_shutdown`): no step starts, a running step's engine calls give up."""
        self.grace = ShutdownGrace(self.closing)
        """What a shutdown leaves a running step's engine calls (hot-load, eval, unloads)."""
        self.step_running = False
        """True while `train_once` runs a step: status's `training` (`aclose` holds `_lock` too, to stop)."""
        self.collector = CollectorClient(settings, collector_transport)
        evaluator = evaluator or build_evaluator(settings, self.collector.http, engine.base_url)
        self.gate = PromotionGate(settings, self.store, evaluator, self.model_name, lambda: self.base_name)
        self.retention = Retention(settings, self.store, engine, self.gate, self.model_name, self.counters,
                                   grace=self.grace)
        self.metrics = MetricsSink(settings.run_dir, wandb=settings.wandb, project=settings.wandb_project,
                                   run_name=settings.name, config={"settings": settings.model_dump(mode="json"),
                                                                   "grpo": grpo.to_dict()})
        self._bookkeeping = StepBookkeeping(self.collector, self.metrics, self.store, self.model_name, self.counters)
        self.schedule = TrainingSchedule(settings, self._scheduled_step, self.queue_depth, paused=lambda: self.paused)

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
        """Stop the schedule and refuse new steps; a running step finishes, but an engine call vLLM has not answered
        `SHUTDOWN_GRACE_S` after the first call of this is given up (`ShutdownGrace`): a hot-load (the step is then
        `StepBookkeeping.unserved`), the gate's eval (the step is then not promoted, `Evaluator.stop`), retention's
        unloads (the next start drops those checkpoints). Called as the server's shutdown begins (before it waits for
        open requests, a manual step among them), and by `aclose`."""
        self.schedule.shutdown()
        self.grace.begin()
        if self.gate.evaluator is not None:
            self.gate.evaluator.stop(self.grace.left())

    async def aclose(self) -> None:
        """Stop the schedule, let a running step finish, then stop the engine and close the clients and sinks.

        A step that runs (scheduled or manual) ends as usual: checkpoint, hot-load, ack, gate, metrics.
        Stopping under it would leave its batch leased and its metrics unwritten; no new step starts. Only its engine
        calls vLLM does not answer within `SHUTDOWN_GRACE_S` of the shutdown's start are given up (`begin_shutdown`):
        each held the shutdown for its whole timeout. The step's checkpoint stays for the next start to serve, and
        `promotion.json` holds a whole decision (a given-up eval promotes nothing).
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

    def newest_models(self) -> list[str]:
        """`name@N` of the newest `NAMED_STEPS` steps, oldest first."""
        return [self.model_name(step) for step in self.steps[-NAMED_STEPS:]]

    def _some_served_models(self) -> str:
        """The base, `name@latest` and the newest `NAMED_STEPS` steps, then how many more `GET /v1/models` lists."""
        newest = self.newest_models()
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
        if self.closing.is_set():
            raise ServiceError(503, "shutting_down", "The service is shutting down; no new step starts.",
                               type="server_error")
        if self.paused:
            raise ServiceError(409, "paused", "Training is paused; POST /v1/resume to train again.")
        if self._lock.locked():
            raise ServiceError(409, "training_in_progress", "A training step is running; wait for it to finish.")
        async with self._lock:
            self.step_running = True
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
                self.step_running = False
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
                               f"rolled back{write_fix(exc, self.store.path(step))}. {fate}",
                               type="server_error") from exc
        except LoadGivenUp as given_up:
            raise await self._bookkeeping.unserved(batch, step, kind, given_up) from given_up
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
        ack_error = await self._bookkeeping.ack(batch, step)
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
        await self._bookkeeping.record(step, metrics, batch, kind)
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
        loading = self.grace.call(lambda: self.engine.load_adapter(name, path), f"hot-load {name}")
        if not loading.done():  # left to end on its own, or never started: `VLLMEngine.stop` gives it up in turn
            raise LoadGivenUp(metrics, path)
        try:
            loading.result()
        except EngineError:
            trainer.restore(snapshot)
            self._bookkeeping.discard(step)
            raise
        metrics["time/publish_s"] = time.perf_counter() - started
        return metrics, path

    # --- status -------------------------------------------------------------------------

    async def status(self) -> StatusResponse:
        """Step, models, queue depth, schedule, promotion, last metrics and engine health (`assemble_status`)."""
        return await assemble_status(self)

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
