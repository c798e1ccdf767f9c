"""Checkpoint retention: at start and after each step, drop the checkpoints the policy no longer keeps.

The policy (`TrainerSettings.keep_last`, `keep_best_metric`, `keep_best_mode`; `select_kept`) keeps
the newest steps, the best by a named metric (a manifest metric, or the promotion gate's eval
reward), the promoted step and the newest. A dropped step stops being served before its folder
goes: it leaves the served list, is unloaded from vLLM, then deleted; the gate forgets its eval reward (in
`promotion.json` too). An unload a shutdown's grace gives up (`ShutdownGrace`) leaves the step served and its folder
kept: the next start drops it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from trainer_service.checkpoint_folder import MANIFEST
from trainer_service.checkpoints import CheckpointStore, select_kept
from trainer_service.config import TrainerSettings
from trainer_service.engine import VLLMEngine
from trainer_service.engine_errors import EngineError
from trainer_service.promotion import PromotionGate
from trainer_service.step_bookkeeping import ShutdownGrace

__all__ = ["Retention"]

logger = logging.getLogger(__name__)


_SFT_REWARDS_BEFORE = ("reward/mean", "reward/std")
"""Metrics an SFT step recorded, before it recorded `reward/chosen_mean`, as those of the chosen trajectories only."""


def _comparable(metrics: dict[str, Any]) -> dict[str, Any]:
    """A manifest's `metrics` without those that meant something else when it was written: an SFT step's `reward/mean`
    and `reward/std` before `reward/chosen_mean` existed were the best trajectories' (they made an old warm start
    the best by `reward/mean` after a resume)."""
    if metrics.get("kind/sft") and "reward/chosen_mean" not in metrics:
        return {name: value for name, value in metrics.items() if name not in _SFT_REWARDS_BEFORE}
    return metrics


class Retention:
    """Applies the retention policy to a service's served steps.

    Args:
        settings: `keep_last`, `keep_best_metric`, `keep_best_mode`.
        store: the checkpoint folders and their manifests.
        engine: the vLLM engine the dropped steps are unloaded from.
        gate: the promotion gate (its promoted step is kept; its eval rewards can be the metric).
        model_name: step → `name@step`.
        counters: the service's counters (`retention_errors`, `checkpoints_deleted`, `promotion_write_errors`).
        grace: the service's shutdown grace, which bounds the wait for each unload (default: one never begun).
    """

    def __init__(self, settings: TrainerSettings, store: CheckpointStore, engine: VLLMEngine, gate: PromotionGate,
                 model_name: Callable[[int], str], counters: Counter[str], *,
                 grace: ShutdownGrace | None = None) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.gate = gate
        self.model_name = model_name
        self.counters = counters
        self.grace = grace or ShutdownGrace(threading.Event())

    async def apply(self, steps: list[int]) -> None:
        """Drop from `steps` (the served steps, changed in place) the checkpoints the policy no longer keeps.

        A dropped step leaves `steps` first, so `/v1/models` never lists a name being removed; then
        it is unloaded from vLLM and its folder deleted. A step vLLM cannot unload is served again
        and kept for the next step's retention; so is one whose unload a shutdown gave up (`ShutdownGrace`), which
        the next start drops; a folder that cannot be deleted is logged and counted.
        The gate forgets the eval rewards of the steps no longer served (`_keep_evals`).
        Run under the service's step lock.
        """
        dropped = await asyncio.to_thread(self.drops, list(steps))
        for step in dropped:
            steps.remove(step)
        still_loaded = await asyncio.to_thread(self._remove, dropped)
        steps.extend(still_loaded)
        steps.sort()
        self._keep_evals(steps)

    def drops(self, steps: list[int]) -> list[int]:
        """The steps of `steps` the policy drops (reads the manifests' metrics).

        A step whose manifest cannot be read (its folder deleted by hand) has no value of the metric: logged and
        counted as `retention_errors`, it is kept or dropped as the newest steps are; so has one whose manifest records
        the metric as an integer too large for a float, and an SFT step's `reward/*` recorded in the meaning it had
        before `reward/chosen_mean` (`_comparable`).
        """
        s = self.settings
        values: dict[int, float] = {}
        if s.keep_best_metric is not None:
            for step in steps:
                try:
                    recorded = self.store.metrics(step)
                except (OSError, ValueError):
                    self.counters["retention_errors"] += 1
                    logger.exception("the metrics of %s cannot be read; it cannot be the best by %s",
                                     self.model_name(step), s.keep_best_metric)
                    recorded = {}
                merged = {**_comparable(recorded),
                          **({"eval/reward": self.gate.evals[step]} if step in self.gate.evals else {})}
                if isinstance(merged.get(s.keep_best_metric), int | float):
                    try:
                        values[step] = float(merged[s.keep_best_metric])
                    except OverflowError:  # an integer past a float's range: was a traceback in every retention
                        self.counters["retention_errors"] += 1
                        logger.error("%s records %s as an integer too large for a float; it cannot be the best",
                                     self.model_name(step), s.keep_best_metric)
        protect = {step for step in (self.gate.latest, steps[-1] if steps else None) if step is not None}
        kept = select_kept(steps, values, keep_last=s.keep_last, best_mode=s.keep_best_mode, protect=protect)
        return [step for step in steps if step not in kept]

    def prune(self, steps: list[int]) -> list[int]:
        """At start, before any checkpoint is loaded into vLLM: delete the folders of the steps of `steps` (the kept
        checkpoints, oldest first) the policy drops; return the steps it keeps. Run after the promotion gate's
        `restore`, so the promoted step is kept; the gate forgets the eval rewards of the dropped ones (a restart
        showed them in `GET /v1/status` until the next step)."""
        dropped = self.drops(steps)
        for step in dropped:
            self._delete(step)
        kept = [step for step in steps if step not in dropped]
        self._keep_evals(kept)
        return kept

    def _keep_evals(self, steps: list[int]) -> None:
        """Let the gate forget the eval rewards of the steps not in `steps` (`PromotionGate.keep_evals`); a
        `promotion.json` that cannot be saved without them is logged and counted as `promotion_write_errors`."""
        try:
            self.gate.keep_evals(steps)
        except OSError:
            self.counters["promotion_write_errors"] += 1
            logger.exception("the promotion state could not be saved without the eval rewards of the dropped "
                             "checkpoints; %s names them until it is saved again (a start ignores them)",
                             self.store.root / "promotion.json")

    def _remove(self, steps: list[int]) -> list[int]:
        """Unload each step from vLLM, then delete its folder; return the steps vLLM could not unload, or did not
        within a shutdown's grace."""
        still_loaded = []
        for step in steps:
            name = self.model_name(step)
            unloading = self.grace.call(functools.partial(self.engine.unload_adapter, name), f"unload {name}")
            if not unloading.done():  # left to end on its own, or never started: `VLLMEngine.stop` gives it up
                logger.warning("%s was not unloaded: the service is shutting down and vLLM did not answer within "
                               "the shutdown's grace; its checkpoint stays, and the next start drops it", name)
                still_loaded.append(step)
                continue
            try:
                unloading.result()
            except EngineError:
                self.counters["retention_errors"] += 1
                logger.exception("could not unload %s; keeping it served for now", name)
                still_loaded.append(step)
                continue
            self._delete(step)
        return still_loaded

    def _delete(self, step: int) -> None:
        """Delete the folder of `step`, no longer served; a failure is logged and counted as `retention_errors`."""
        try:
            self.store.delete(step)
        except OSError:
            self.counters["retention_errors"] += 1
            logger.exception("%s is no longer served; its folder %s %s", self.model_name(step),
                             self.store.path(step), self._left_behind(step))
            return
        self.counters["checkpoints_deleted"] += 1
        logger.info("retention: deleted checkpoint step %s", step)

    def _left_behind(self, step: int) -> str:
        """What a failed delete of `step` left, as the next start sees it: a checkpoint still (its manifest is
        there, as `CheckpointStore.existing` checks: a link counts), which its retention (`prune`) drops again, or a
        leftover it removes (`remove_partial`).
        Raises nothing: it runs in the handler of the failed delete."""
        if os.path.lexists(self.store.path(step) / MANIFEST):
            return "could not be deleted: the next start tries again"
        return "was deleted in part: the rest is removed at the next start"
