"""The bookkeeping of a `TrainerService` step besides training and its checkpoint: `StepBookkeeping` acks the step's
batch, writes its metrics, answers a step whose hot-load a shutdown gave up (`LoadGivenUp`, after the
`ShutdownGrace`) and deletes the checkpoint of a step vLLM could not load."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

from collector.protocol import Batch
from trainer_service.checkpoints import CheckpointStore
from trainer_service.collector_client import CollectorClient
from trainer_service.metrics import MetricsSink
from trainer_service.protocol import ServiceError
from trainer_service.stoppable import wait_unless_stopping

__all__ = ["SHUTDOWN_GRACE_S", "LoadGivenUp", "ShutdownGrace", "StepBookkeeping"]

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 3.0
"""Seconds after shutdown began that a running step's engine calls (its hot-load, the gate's eval, retention's unloads)
are still waited for: a vLLM that answers loads or unloads an adapter well within it (the step then ends as usual);
one that accepts and never answers held the shutdown for each call's whole timeout (120 s a load or an unload, 600 s
an eval), and `VLLMEngine.stop` only gives a call up once the step is over."""

_Result = TypeVar("_Result")


class ShutdownGrace:
    """The time a shutdown leaves a running step's engine calls: until `SHUTDOWN_GRACE_S` after it began, for all of
    them together; a call vLLM has not answered by then is given up, and none starts after.

    Args:
        began: set once shutdown began (by `begin`; the service's `closing`).
    """

    def __init__(self, began: threading.Event) -> None:
        self.began = began
        self._ends: float | None = None

    def begin(self) -> None:
        """Start the grace and set `began`; a second call changes nothing."""
        if self._ends is None:
            self._ends = time.monotonic() + SHUTDOWN_GRACE_S
        self.began.set()

    def left(self) -> float:
        """Seconds an engine call may still be waited for: all of `SHUTDOWN_GRACE_S` before shutdown began, what is
        left of it since (0 once it is over)."""
        ends = self._ends
        return SHUTDOWN_GRACE_S if ends is None else max(0.0, ends - time.monotonic())

    def call(self, call: Callable[[], _Result], name: str) -> Future[_Result]:
        """Run the engine call `call` in a thread named `name`; return its future once it is done, or not done once
        the grace is over: the call is then left to end on its own (`VLLMEngine.stop` gives it up), and is not started
        at all when the grace was over already."""
        if self.began.is_set() and self.left() == 0:
            return Future()  # never run, never done
        return wait_unless_stopping(call, self.began, name, grace=self.left())


class LoadGivenUp(Exception):
    """A step's hot-load given up for a shutdown (`ShutdownGrace`): its checkpoint `path` is whole on disk, its
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
                       "within %g s of the shutdown's start; the next start serves it", step, given_up.path,
                       SHUTDOWN_GRACE_S)
        ack_error = await self.ack(batch, step)
        metrics = {**given_up.metrics, "collector/ack_failed": float(ack_error is not None)}
        await self.record(step, metrics, batch, kind)
        acked = (f"its batch {batch.id} was acked" if ack_error is None else
                 f"its batch {batch.id} was not acked ({ack_error.body.error.message})")
        return ServiceError(503, "shutting_down", f"Step {step} is saved in {given_up.path} and {acked}, but it is "
                            f"not served: the service is shutting down and vLLM did not answer its hot-load within "
                            f"{SHUTDOWN_GRACE_S:g} s of the shutdown's start. The next start serves it as "
                            f"{self.model_name(step)}.",
                            type="server_error")

    def discard(self, step: int) -> None:
        """Delete the checkpoint of `step`, which vLLM could not load; a failure is logged with its path, so the
        engine's error stays the step's answer (a left `step-N` stops the next step's save, which names it)."""
        try:
            self.store.delete(step)
        except OSError:
            logger.exception("step %s: vLLM could not load it and its checkpoint %s could not be deleted; remove it "
                             "by hand", step, self.store.path(step))
