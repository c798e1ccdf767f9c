"""`TrainerService`: the state and logic behind the HTTP layer.

It owns the vLLM engine, the LoRA trainer and the collector client; it names models
(`base`, `name@N`, `name@latest`) and runs one training step at a time:
pull batch → train → save `checkpoints/step-N` → hot-load `name@N` → ack → record metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from collector.protocol import AckRequest, Batch, BatchRequest

from trainer_service.config import GRPOConfig, TrainerSettings
from trainer_service.engine import EngineError, VLLMEngine
from trainer_service.protocol import EngineStatus, ServiceError, StatusResponse, TrainResponse
from trainer_service.training import MANIFEST, LoRATrainer, NothingTrainableError

__all__ = ["TrainerService", "served_base_name"]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


def served_base_name(base_model: str) -> str:
    """Name the base model is served under: the folder name for a local path, else as given."""
    if base_model.startswith((".", "/", "~")):
        return Path(base_model).expanduser().name
    return base_model


class TrainerService:
    """Serving and training state of one trainer service.

    Args:
        settings: service settings.
        grpo: GRPO hyper-parameters.
        engine: the vLLM supervisor (not started yet).
        trainer_factory: builds the `LoRATrainer` (called in a worker thread at start-up).
        collector_transport: httpx transport for the collector (tests inject a mock).
    """

    def __init__(
        self,
        settings: TrainerSettings,
        grpo: GRPOConfig,
        engine: VLLMEngine,
        trainer_factory: Callable[[], LoRATrainer],
        collector_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        grpo.check_against(settings)
        self.settings = settings
        self.grpo = grpo
        self.engine = engine
        self._trainer_factory = trainer_factory
        self.trainer: LoRATrainer | None = None
        self.base_name = engine.served_name
        self.steps: list[int] = []
        self.last_error: str | None = None
        self._lock = asyncio.Lock()
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.collector = httpx.AsyncClient(
            base_url=settings.collector, headers=headers, timeout=60.0, transport=collector_transport
        )

    # --- life cycle ---------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        """`output_dir/checkpoints`."""
        return self.settings.run_dir / "checkpoints"

    def start(self) -> None:
        """Start vLLM, build the trainer and resume from existing checkpoints (blocking)."""
        self.engine.start()
        self.trainer = self._trainer_factory()
        existing = self._existing_checkpoints()
        for step, path in existing:
            self.engine.load_adapter(self.model_name(step), path)
            self.steps.append(step)
        if existing:
            manifest = self.trainer.resume(existing[-1][1])
            logger.info("resumed from %s (step %s)", existing[-1][1], manifest["step"])

    def _existing_checkpoints(self) -> list[tuple[int, Path]]:
        if not self.checkpoint_dir.is_dir():
            return []
        found = []
        for path in self.checkpoint_dir.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / MANIFEST).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    async def aclose(self) -> None:
        """Stop the engine and close the collector client."""
        await self.collector.aclose()
        await asyncio.to_thread(self.engine.stop)

    # --- model names --------------------------------------------------------------------

    def model_name(self, step: int) -> str:
        """`name@step`."""
        return f"{self.settings.name}@{step}"

    @property
    def latest_model(self) -> str:
        """What `name@latest` (and plain `name`) resolve to: the newest checkpoint, else the base."""
        return self.model_name(self.steps[-1]) if self.steps else self.base_name

    def served_models(self) -> list[str]:
        """Every model name clients may request, base first and `name@latest` last."""
        return [self.base_name, *(self.model_name(s) for s in self.steps), f"{self.settings.name}@latest"]

    def resolve(self, model: str) -> str:
        """Map a requested model name to the engine's name.

        Raises:
            ServiceError: 404 `model_not_found` for an unknown name.
        """
        if model in (f"{self.settings.name}@latest", self.settings.name):
            return self.latest_model
        if model == self.base_name or model in self.engine.adapters:
            return model
        raise ServiceError(
            404,
            "model_not_found",
            f"The model `{model}` does not exist. Available: {', '.join(self.served_models())}.",
            type="not_found_error",
            param="model",
        )

    # --- training -----------------------------------------------------------------------

    async def train_once(self) -> TrainResponse:
        """Run one step now: pull a batch, train, checkpoint, hot-load, ack.

        Raises:
            ServiceError: 409 when a step runs already or the collector has nothing ready, 422
                when no group of the batch is trainable, 502 when the collector fails, 500 when
                training or loading fails.
        """
        if self._lock.locked():
            raise ServiceError(409, "training_in_progress", "A training step is running; wait for it to finish.")
        async with self._lock:
            try:
                return await self._train_locked()
            except ServiceError as exc:
                self.last_error = exc.body.error.message
                raise

    async def _train_locked(self) -> TrainResponse:
        batch = await self._lease()
        trainer = self.trainer
        if trainer is None:
            raise ServiceError(503, "not_ready", "The trainer is still starting; try again shortly.", type="server_error")
        step = trainer.step_count + 1
        try:
            metrics, path = await asyncio.to_thread(self._train_and_publish, trainer, batch, step)
        except NothingTrainableError as exc:
            # Such groups can never train; acking keeps them from coming back forever.
            await self._ack(batch.id, None)
            raise ServiceError(422, "nothing_trainable", f"{exc} Batch {batch.id} was acked without a step.") from exc
        except (EngineError, OSError, RuntimeError, ValueError) as exc:
            logger.exception("training step %s failed", step)
            raise ServiceError(
                500, "training_failed", f"Step {step} failed: {exc}. Batch {batch.id} was not acked; "
                "its lease will expire and the collector will offer it again.", type="server_error",
            ) from exc
        self.steps.append(step)
        await self._ack(batch.id, step)
        self.last_error = None
        self._record(step, batch.id, metrics)
        return TrainResponse(step=step, model=self.model_name(step), checkpoint=str(path), batch_id=batch.id,
                             metrics=metrics)

    def _train_and_publish(self, trainer: LoRATrainer, batch: Batch, step: int) -> tuple[dict[str, float], Path]:
        """Worker-thread part of a step: train, save, hot-load."""
        metrics = trainer.step(batch.groups)
        started = time.perf_counter()
        path = trainer.save(self.checkpoint_dir / f"step-{step}", batch_id=batch.id, metrics=metrics)
        self.engine.load_adapter(self.model_name(step), path)
        metrics["time/publish_s"] = time.perf_counter() - started
        return metrics, path

    async def _lease(self) -> Batch:
        request = BatchRequest(max_groups=self.settings.batch_groups, trainer=self.settings.name)
        try:
            response = await self.collector.post("/v1/batches", json=request.model_dump())
        except httpx.HTTPError as exc:
            raise ServiceError(502, "collector_unavailable",
                               f"The collector at {self.settings.collector} did not answer: {exc}. "
                               "Start it (`art-collector serve`) or point --collector at it.",
                               type="server_error") from exc
        if response.status_code != 200:
            raise ServiceError(502, "collector_error", f"The collector refused a batch lease: HTTP "
                               f"{response.status_code}: {response.text[:500]}", type="server_error")
        batch = Batch.model_validate(response.json())
        if not batch.groups:
            raise ServiceError(409, "no_batch_ready", "The collector has no rewarded group ready for training yet; "
                               "record more rollouts with rewards and try again.")
        return batch

    async def _ack(self, batch_id: str, step: int | None) -> None:
        try:
            response = await self.collector.post(f"/v1/batches/{batch_id}/ack",
                                                 json=AckRequest(policy_step=step).model_dump())
        except httpx.HTTPError as exc:
            raise ServiceError(502, "ack_failed", f"Could not ack batch {batch_id} (step {step} is saved and "
                               f"served): {exc}. Its groups will be offered again after the lease.",
                               type="server_error") from exc
        if response.status_code != 200:
            raise ServiceError(502, "ack_failed", f"The collector refused the ack of batch {batch_id} (step {step} "
                               f"is saved and served): HTTP {response.status_code}: {response.text[:300]}",
                               type="server_error")

    def _record(self, step: int, batch_id: str, metrics: dict[str, float]) -> None:
        """Append one line per step to `output_dir/metrics.jsonl` (the one metrics sink)."""
        path = self.settings.run_dir / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        line = {"step": step, "time": time.time(), "batch_id": batch_id, "model": self.model_name(step), **metrics}
        with path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    # --- status -------------------------------------------------------------------------

    async def status(self) -> StatusResponse:
        """Current step, models, last metrics and engine health."""
        healthy = await asyncio.to_thread(self.engine.healthy)
        trainer = self.trainer
        return StatusResponse(
            name=self.settings.name,
            base_model=self.base_name,
            step=self.steps[-1] if self.steps else 0,
            latest_model=self.latest_model,
            models=self.served_models(),
            training=self._lock.locked(),
            last_metrics=dict(trainer.last_metrics) if trainer else {},
            last_error=self.last_error,
            engine=EngineStatus(healthy=healthy, pid=self.engine.pid, restarts=self.engine.restarts,
                                url=self.engine.base_url),
        )

    async def watch_engine(self, interval: float = 10.0) -> None:
        """Forever: restart vLLM (re-loading adapters) when it dies. Run as a background task."""
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(self.engine.ensure_running)
            except EngineError:
                logger.exception("restarting vLLM failed; retrying in %.0f s", interval)
