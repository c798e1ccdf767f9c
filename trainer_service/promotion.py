"""The promotion gate: `name@latest` moves to a new checkpoint only if its eval reward holds up.

Without an eval set every new checkpoint is promoted. With one, the new checkpoint's mean eval
reward is compared with the promoted checkpoint's (the base model's, key 0, before any
promotion) on the same prompts: measured once and cached while the prompts, the reward function and
the sampling stay the same, again when they change (a collector split grows, a restart with another
`--eval-reward` or `--eval-samples`, `--eval-max-tokens`, `--eval-temperature`). Promoted when
`new >= current - margin`, equal up to float rounding included, else kept and served as `name@N`
but not as `name@latest`, with the reason recorded. A failed evaluation promotes nothing, also one whose evaluator
fails unexpectedly (logged with its traceback); both are counted (`eval_failures`). The eval reward of a step
retention drops goes with it, from `promotion.json` too (`keep_evals`). The state survives restarts in
`checkpoints/promotion.json`; without an eval set, a restart serves the newest kept step as latest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from trainer_service.checkpoints import CheckpointStore
from trainer_service.config import TrainerSettings
from trainer_service.evaluation import EvalError, Evaluator
from trainer_service.protocol import PromotionDecision, ServiceError

__all__ = ["PromotionGate"]

logger = logging.getLogger(__name__)


class PromotionGate:
    """Decides which checkpoint `name@latest` serves.

    Args:
        settings: `promotion_margin`.
        store: where the promotion state is saved.
        evaluator: scores a served model; None promotes every step.
        model_name: step → `name@step`.
        base_name: returns the base model's served name (eval of step 0).

    Raises:
        CheckpointMismatchError: the saved state (`promotion.json`, read here so a damaged one stops the service
            before anything starts) cannot be read.
    """

    def __init__(self, settings: TrainerSettings, store: CheckpointStore, evaluator: Evaluator | None,
                 model_name: Callable[[int], str], base_name: Callable[[], str]) -> None:
        self.margin = settings.promotion_margin
        self.store = store
        self.evaluator = evaluator
        self._model_name = model_name
        self._base_name = base_name
        self.latest: int | None = None
        """Promoted step (None: the base model)."""
        self.evals: dict[int, float] = {}
        """Mean eval reward per step on the prompts of `prompt_set`; 0 is the base model."""
        self.prompt_set: str | None = None
        """`Evaluator.key` of the prompts (and reward function and sampling) `evals` were measured with."""
        self.decision: PromotionDecision | None = None
        self.eval_failures = 0
        """Evaluations that failed since start, whatever failed (`EvalError` or the evaluator's own bug)."""
        self._saved = store.read_promotion()
        self._saved_steps = set(self._saved["evals"])
        """Steps whose eval reward `promotion.json` holds (as read at start, then as last written)."""

    def restore(self, steps: list[int]) -> None:
        """Reload the saved state for the kept `steps` (after a restart).

        Without an evaluator the newest kept step is latest (every step is promoted, also one whose
        gate a crash cut short); with one, the saved latest if it is kept, else the base model (with a
        warning when a saved latest is no longer kept): a step is never promoted unevaluated.
        """
        saved = self._saved
        self.evals = self._kept(saved["evals"], steps)  # `promotion.json` loses them in the start's `keep_evals`
        self.prompt_set = saved.get("prompt_set")
        if self.evaluator is None:
            self.latest = steps[-1] if steps else None
        else:
            self.latest = saved["latest"] if saved["latest"] in steps else None
            if saved["latest"] is not None and self.latest is None:
                logger.warning("the promoted step %s (%s) is no longer kept: `latest` serves %s until a step is "
                               "promoted", saved["latest"], self.store.root / "promotion.json", self._base_name())
        self.decision = saved["decision"]

    def keep_evals(self, steps: list[int]) -> None:
        """Forget the eval rewards of the steps not in `steps` (the kept checkpoints); the base model's (0) stays.

        Called by retention as it drops steps (at start too), so neither `GET /v1/status` nor `promotion.json` shows a
        reward of a checkpoint that is gone: the state is saved again when the file holds one (`latest` and the
        decision as they are).

        Raises:
            OSError: the state could not be saved (the rewards are forgotten all the same; a start ignores the rewards
                of steps that are gone).
        """
        self.evals = self._kept(self.evals, steps)
        if any(step not in self.evals for step in self._saved_steps):
            self._save(self.latest, self.decision)

    @staticmethod
    def _kept(evals: dict[int, float], steps: list[int]) -> dict[int, float]:
        """The rewards of `evals` of the base model (0) and of `steps`."""
        return {s: r for s, r in evals.items() if s == 0 or s in steps}

    def _save(self, latest: int | None, decision: PromotionDecision | None) -> None:
        """Write the state, with `latest` and `decision`, to `promotion.json` (atomically).

        Raises:
            OSError: it could not be written.
        """
        self.store.write_promotion({"latest": latest, "evals": self.evals, "prompt_set": self.prompt_set,
                                    "decision": decision.model_dump() if decision else None})
        self._saved_steps = set(self.evals)

    def _name(self, step: int) -> str:
        return self._base_name() if step == 0 else self._model_name(step)

    async def judge(self, step: int) -> PromotionDecision:
        """Evaluate the new checkpoint `step` (served already) and promote it or keep the current one.

        The decision is saved first; `latest` and `decision` change only once it is on disk.

        Raises:
            ServiceError: 507 `promotion_write_failed` when the state cannot be saved (`latest` stays).
        """
        if self.evaluator is None:
            decision = PromotionDecision(step=step, promoted=True,
                                         reason="no eval set configured: every step is promoted")
        else:
            decision = await self._gate(step, self.evaluator)
        latest = step if decision.promoted else self.latest
        try:
            self._save(latest, decision)
        except OSError as exc:
            logger.exception("the promotion state of step %s could not be saved", step)
            current = self._name(self.latest or 0)
            raise ServiceError(507, "promotion_write_failed", f"Step {step} is saved and served as "
                               f"{self._model_name(step)}, but the promotion state could not be written to "
                               f"{self.store.root}: {exc}. {current} stays latest; free disk space.",
                               type="server_error") from exc
        self.latest = latest
        self.decision = decision
        return decision

    async def _gate(self, step: int, evaluator: Evaluator) -> PromotionDecision:
        current = self.latest or 0
        try:
            rows = await evaluator.prompts()
            key = evaluator.key(rows)
            if key != self.prompt_set:  # other prompts or scoring: rewards measured before do not compare
                self.evals, self.prompt_set = {}, key
            new = await evaluator.evaluate(self._model_name(step), rows)
            self.evals[step] = new
            if current not in self.evals:
                self.evals[current] = await evaluator.evaluate(self._name(current), rows)
        except EvalError as exc:
            logger.warning("eval of step %s failed; not promoted: %s", step, exc)
            return self._eval_failed(step, str(exc))
        # anything else is the evaluator's bug: the step is served all the same, so it fails the eval, not the step
        # (was a 500 whose retention and metrics never ran); a cancellation is no Exception and stops the gate
        except Exception as exc:
            logger.exception("eval of step %s failed unexpectedly; not promoted", step)
            return self._eval_failed(step, f"{type(exc).__name__}: {exc}")
        baseline = self.evals[current]
        label = self._name(current)
        bar = baseline - self.margin
        if new >= bar or math.isclose(new, bar, rel_tol=1e-9, abs_tol=1e-12):  # 0.7 against 0.8 - 0.1 == 0.70...01
            reason = f"eval reward {new:.4f} vs {label}'s {baseline:.4f} (margin {self.margin:g}): promoted"
            return PromotionDecision(step=step, promoted=True, reason=reason, eval_reward=new, baseline_reward=baseline)
        reason = (f"eval reward {new:.4f} is below {label}'s {baseline:.4f} by more than the margin {self.margin:g}: "
                  f"kept as {self._model_name(step)}, not promoted")
        logger.warning("step %s not promoted: %s", step, reason)
        return PromotionDecision(step=step, promoted=False, reason=reason, eval_reward=new, baseline_reward=baseline)

    def _eval_failed(self, step: int, problem: str) -> PromotionDecision:
        """The decision on `step` whose evaluation failed with `problem`: not promoted; counted (`eval_failures`)."""
        self.eval_failures += 1
        return PromotionDecision(step=step, promoted=False, reason=f"eval failed, not promoted: {problem}",
                                 eval_reward=self.evals.get(step))

    async def aclose(self) -> None:
        """Close the evaluator's client."""
        if self.evaluator is not None:
            await self.evaluator.aclose()
