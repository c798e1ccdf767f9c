"""The promotion gate's state on disk: `checkpoints/promotion.json` records the promoted step, every eval reward and
the last decision, written atomically.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from collector.config import validation_problem
from trainer_service.checkpoint_checks import CheckpointMismatchError
from trainer_service.durable import durable_rename
from trainer_service.protocol import PromotionDecision

__all__ = ["read_promotion", "write_promotion"]

_PROMOTION = "promotion.json"
_STEP_KEY = re.compile(r"0|[1-9][0-9]*")
"""A step as `write_promotion` writes it in `evals`' keys (0 is the base model)."""


def read_promotion(root: Path) -> dict[str, Any]:
    """The promotion state saved in `root` (`output_dir/checkpoints`): `{"latest": step or None, "evals": {step:
    reward}, "prompt_set": key of the prompts those rewards were measured on, "decision": PromotionDecision or None}`
    (`latest`, `evals` or `decision` left out: None, none, None).

    Raises:
        CheckpointMismatchError: `promotion.json` cannot be read, or is not such a state; names it and the fix.
    """
    path = root / _PROMOTION
    if not path.exists():  # one that is there but not a file cannot be read: named below, not ignored
        return {"latest": None, "evals": {}, "decision": None}
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("evals") or {}, dict):
            raise ValueError("not a JSON object whose `evals` is an object")
        latest = state.get("latest")
        if latest is not None and (isinstance(latest, bool) or not isinstance(latest, int)):
            raise ValueError(f"its `latest` is {latest!r}, not a step number or null")
        state["latest"] = latest  # left out (`{}`): the base model, as null (was a KeyError in the gate's restore)
        state["evals"] = _eval_rewards(state.get("evals") or {})
        decision = state.get("decision")
        state["decision"] = PromotionDecision.model_validate(decision) if decision else None
    # OverflowError: an eval reward too large for a float; RecursionError: JSON nested too deep (both were a
    # traceback at start)
    except (OSError, ValueError, OverflowError, RecursionError) as exc:
        detail = (f"its decision is not one: {'; '.join(validation_problem(error) for error in exc.errors())}"
                  if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}")
        raise CheckpointMismatchError(
            f"{path} cannot be read ({detail}). Move it out of {root} to start the "
            "promotion gate afresh (`name@latest` then serves the newest checkpoint, or with an eval set the "
            "base model until a step is promoted).") from exc
    return state


def write_promotion(root: Path, state: Mapping[str, Any]) -> None:
    """Save the promotion `state` in `root` (`output_dir/checkpoints`) atomically (write a temporary file, then
    `durable_rename` it)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{_PROMOTION}.tmp"
    body = {**state, "evals": {str(k): v for k, v in (state.get("evals") or {}).items()}}
    tmp.write_text(json.dumps(body, indent=2))
    durable_rename(tmp, root / _PROMOTION)


def _eval_rewards(evals: Mapping[str, Any]) -> dict[int, float]:
    """The eval rewards `promotion.json` records under `evals`, by step.

    Raises:
        ValueError: a key is not a step number as `write_promotion` writes it, or a reward not a finite JSON number
            (`true` and `"0.5"` are none; a NaN baseline promoted nothing); names which.
        OverflowError: a reward is an integer too large for a float.
    """
    rewards = {}
    for key, value in evals.items():
        if not _STEP_KEY.fullmatch(key):
            raise ValueError(f"its `evals` key {key!r} is not a step number")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"its `evals` reward of step {key} is {value!r}, not a number")
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(f"its `evals` reward of step {key} is {reward!r}, not a finite number")
        rewards[int(key)] = reward
    return rewards
