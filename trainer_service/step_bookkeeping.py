"""The bookkeeping of a `TrainerService` step besides training and its checkpoint: `StepBookkeeping` acks the step's
batch, writes its metrics, answers a step whose hot-load a shutdown gave up (`LoadGivenUp`, after
`HOT_LOAD_GRACE_S`) and deletes the checkpoint of a step vLLM could not load."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from collector.protocol import Batch
from trainer_service.checkpoints import CheckpointStore
from trainer_service.collector_client import CollectorClient
from trainer_service.metrics import MetricsSink
from trainer_service.protocol import ServiceError

__all__ = ["HOT_LOAD_GRACE_S", "LoadGivenUp", "StepBookkeeping"]

logger = logging.getLogger(__name__)

HOT_LOAD_GRACE_S = 3.0
"""Seconds a running step's hot-load is still waited for once shutdown began: a vLLM that answers loads an adapter
well within it (the step then ends as usual); one that accepts and never answers held the shutdown for the load's
whole timeout (120 s), and `VLLMEngine.stop` only gives a load up once the step is over."""


class LoadGivenUp(Exception):
    """A step's hot-load given up for a shutdown (`HOT_LOAD_GRACE_S`): its checkpoint `path` is whole on disk, its
    `metrics` not recorded yet."""

    def __init__(self, metrics: dict[str, float], path: Path) -> None:
        super().__init__(f"the hot-load of {path} was given up for a shutdown")
        self.metrics = metrics
        self.path = path


class StepBookkeeping:
    """Acks, metrics records, unserved answers and discarded checkpoints of a service's steps.

    Args:
        collector: the collector's client (acks).
        metrics: the metrics sinks.
        store: the run's checkpoint folders.
        model_name: step → `name@step`.
        counters: the service's counters (`ack_failures`, `metrics_write_errors`).
    """

    def __init__(self, collector: CollectorClient, metrics: MetricsSink, store: CheckpointStore,
                 model_name: Callable[[int], str], counters: Counter[str]) -> None:
        self.collector = collector
        self.metrics = metrics
        self.store = store
        self.model_name = model_name
        self.counters = counters

    async def ack(self, batch: Batch, step: int) -> ServiceError | None:
        """Ack `batch` as trained into `step`; a refusal is logged, counted (`ack_failures`) and returned."""
        try:
            await self.collector.ack(batch.id, step)
        except ServiceError as exc:
            self.counters["ack_failures"] += 1
            logger.error("step %s is saved but its batch was not acked: %s", step, exc)
            return exc
        return None

    async def record(self, step: int, metrics: dict[str, float], batch: Batch, kind: str) -> None:
        """Write the `metrics` of `step`; a failure is logged and counted (`metrics_write_errors`)."""
        try:
            await asyncio.to_thread(self.metrics.emit, step, metrics, batch_id=batch.id, model=self.model_name(step),
                                    kind=kind)
        except OSError:
            self.counters["metrics_write_errors"] += 1
            logger.exception("metrics of step %s could not be written", step)

    async def unserved(self, batch: Batch, step: int, kind: str, given_up: LoadGivenUp) -> ServiceError:
        """The answer of `step`, saved but not served: a shutdown gave its hot-load up. The trainer keeps the step and
        the batch is acked, as the next start serves and resumes from the checkpoint (training the batch again would
        train it twice); its metrics are recorded. Neither the gate nor retention runs (the next start's does)."""
        logger.warning("step %s is saved in %s but not served: shutting down, vLLM did not answer its hot-load "
                       "within %g s; the next start serves it", step, given_up.path, HOT_LOAD_GRACE_S)
        ack_error = await self.ack(batch, step)
        metrics = {**given_up.metrics, "collector/ack_failed": float(ack_error is not None)}
        await self.record(step, metrics, batch, kind)
        acked = (f"its batch {batch.id} was acked" if ack_error is None else
                 f"its batch {batch.id} was not acked ({ack_error.body.error.message})")
        return ServiceError(503, "shutting_down", f"Step {step} is saved in {given_up.path} and {acked}, but it is "
                            f"not served: the service is shutting down and vLLM did not answer its hot-load within "
                            f"{HOT_LOAD_GRACE_S:g} s. The next start serves it as {self.model_name(step)}.",
                            type="server_error")

    def discard(self, step: int) -> None:
        """Delete the checkpoint of `step`, which vLLM could not load; a failure is logged with its path, so the
        engine's error stays the step's answer (a left `step-N` stops the next step's save, which names it)."""
        try:
            self.store.delete(step)
        except OSError:
            logger.exception("step %s: vLLM could not load it and its checkpoint %s could not be deleted; remove it "
                             "by hand", step, self.store.path(step))
