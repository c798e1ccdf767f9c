"""`GET /v1/status` of a `TrainerService` (`assemble_status`): its step, models, queue depth, schedule, promotion,
last metrics and engine health, naming only the newest `NAMED_STEPS` steps however many are kept."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from trainer_service.protocol import EngineStatus, ScheduleStatus, ServiceError, StatusResponse
from trainer_service.schedule import describe

if TYPE_CHECKING:
    from trainer_service.service import TrainerService

__all__ = ["NAMED_STEPS", "assemble_status"]

_STATUS_QUEUE_WAIT_S = 5.0
"""Longest `status` waits for the collector's queue depth: a collector that takes connections but does not answer
would hold `GET /v1/status` for the collector's whole timeout (60 s)."""

NAMED_STEPS = 5
"""How many of the newest `name@N` a 404 `model_not_found` and `GET /v1/status` (`models`, `checkpoints`) name: a run
keeping thousands of checkpoints would make their bodies huge; `GET /v1/models` lists them all."""


def _newest_evals(service: TrainerService) -> dict[int, float]:
    """Mean eval reward of the newest `NAMED_STEPS` evaluated steps and of the promoted one (the gate's
    baseline; 0: the base model), by step."""
    evals = service.gate.evals
    shown = set(sorted(evals)[-NAMED_STEPS:]) | ({service.gate.latest or 0} & evals.keys())
    return {step: evals[step] for step in sorted(shown)}


async def _status_queue_depth(service: TrainerService) -> tuple[int | None, str | None]:
    """The queue depth, or None and why it is unknown: the collector's error, no answer within
    `_STATUS_QUEUE_WAIT_S`, or a shutdown under way (`aclose` closes the collector's client)."""
    if service.closing.is_set():
        return None, "The service is shutting down; the collector is not asked for the queue depth."
    try:
        return await asyncio.wait_for(service.queue_depth(), _STATUS_QUEUE_WAIT_S), None
    except ServiceError as exc:
        return None, exc.body.error.message
    except TimeoutError:
        return None, (f"The collector at {service.collector.shown_url} did not answer GET /v1/groups?state=ready "
                      f"within {_STATUS_QUEUE_WAIT_S:g} s; the queue depth is unknown.")


async def assemble_status(service: TrainerService) -> StatusResponse:
    """Step, models, queue depth, schedule, promotion, last metrics and engine health.

    `training` is true while a step runs, not while `aclose` stops the service (`_status_queue_depth` says so
    in `queue_error` once shutdown began). `last_metrics` are those of `step`: the trainer's own while its gate
    runs (or after a restart that came before they were recorded), without `eval/reward` and `promotion/promoted`.
    """
    healthy = await asyncio.to_thread(service.engine.healthy)
    queue_depth, queue_error = await _status_queue_depth(service)
    trainer = service.trainer
    step = service.steps[-1] if service.steps else 0  # the newest served step: a running one counts once it is served
    last_metrics = service.metrics.last  # recorded once a step ended
    if last_metrics.get("step") != step:  # an older step's (the gate runs, or a restart came before the record)
        last_metrics = dict(trainer.last_metrics) if trainer and trainer.step_count == step else {}
    next_run = service.schedule.next_run()
    return StatusResponse(
        name=service.settings.name,
        base_model=service.base_name,
        step=step,
        latest_model=service.latest_model,
        models=[service.base_name, *service.newest_models(), f"{service.settings.name}@latest"],
        checkpoints=service.steps[-NAMED_STEPS:],
        checkpoint_count=len(service.steps),
        training=service.step_running,
        queue_depth=queue_depth,
        queue_error=queue_error,
        schedule=ScheduleStatus(triggers=describe(service.settings), paused=service.paused,
                                next_run=next_run.isoformat() if next_run else None,
                                counts=dict(service.schedule.counts), last_outcome=service.schedule.last_outcome),
        promotion=service.gate.decision,
        eval_rewards=_newest_evals(service),
        eval_reward_count=len(service.gate.evals),
        last_metrics=last_metrics,
        counters={**service.counters, **service.lender.counters, "metrics_sink_errors": service.metrics.sink_errors,
                  "eval_failures": service.gate.eval_failures},
        last_error=service.last_error,
        allocator=service.allocator,
        engine=EngineStatus(healthy=healthy, pid=service.engine.pid, restarts=service.engine.restarts,
                            last_restart_reason=service.engine.last_restart_reason,
                            next_restart_in_s=service.engine.next_restart_in,
                            pending_adapters=service.engine.pending_adapters,
                            url=service.engine.base_url, requests_in_flight=service.lender.in_flight,
                            training_threads=service.lender.threads, dtype=service.engine.dtype,
                            cpu_matmul_dtype=service.engine.cpu_matmul_dtype,
                            threads=service.engine.threads.threads if service.engine.threads else None),
    )
