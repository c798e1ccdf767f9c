"""Checkpoint folders on disk: which exist, which to keep, and which one `name@latest` serves.

A checkpoint is `checkpoints/step-N/` with the adapter, the optimizer state and
`manifest.json`; it is written under a temporary name and renamed, so a folder without a
manifest is never a checkpoint (leftovers of a crash are removed at start). `promotion.json`
next to the folders records the promoted step and every eval reward, written atomically.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer_service.training import MANIFEST

__all__ = ["CheckpointStore", "select_kept"]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PROMOTION = "promotion.json"


def select_kept(
    steps: list[int],
    values: Mapping[int, float],
    *,
    keep_last: int | None,
    best_mode: str = "max",
    protect: set[int] | frozenset[int] = frozenset(),
) -> set[int]:
    """Return the steps to keep: the newest `keep_last`, the best by `values`, and `protect`.

    Args:
        steps: existing checkpoint steps.
        values: the named metric per step (steps without a finite value cannot be the best).
        keep_last: how many newest steps to keep; None keeps all.
        best_mode: `max` or `min`: which value is best.
        protect: steps always kept (the promoted one).
    """
    if keep_last is None:
        return set(steps)
    ordered = sorted(steps)
    kept = set(ordered[-keep_last:]) | (set(protect) & set(steps))
    candidates = [s for s in ordered if s in values and math.isfinite(values[s])]
    if candidates:
        pick = max if best_mode == "max" else min
        kept.add(pick(candidates, key=lambda s: (values[s], s)))
    return kept


class CheckpointStore:
    """The checkpoint folder of one run.

    Args:
        root: `output_dir/checkpoints`.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, step: int) -> Path:
        """Folder of checkpoint `step`."""
        return self.root / f"step-{step}"

    def existing(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (with a manifest), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / MANIFEST).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def remove_partial(self) -> list[str]:
        """Delete temporary folders a crashed save left behind; return their names."""
        if not self.root.is_dir():
            return []
        removed = []
        for path in self.root.iterdir():
            if path.is_dir() and (path.name.startswith(".step-") or (_STEP_DIR.match(path.name)
                                                                     and not (path / MANIFEST).is_file())):
                shutil.rmtree(path)
                removed.append(path.name)
        if removed:
            logger.warning("removed %d half-written checkpoint folder(s): %s", len(removed), ", ".join(removed))
        return removed

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics recorded in checkpoint `step`'s manifest."""
        manifest = json.loads((self.path(step) / MANIFEST).read_text())
        return dict(manifest.get("metrics") or {})

    def delete(self, step: int) -> None:
        """Delete checkpoint `step` from disk (the manifest first, so a crash leaves no checkpoint)."""
        path = self.path(step)
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path)

    # --- promotion state ------------------------------------------------------------------

    def read_promotion(self) -> dict[str, Any]:
        """The saved promotion state: `{"latest": step or None, "evals": {step: reward}, "decision": ...}`."""
        path = self.root / _PROMOTION
        if not path.is_file():
            return {"latest": None, "evals": {}, "decision": None}
        state = json.loads(path.read_text())
        state["evals"] = {int(k): float(v) for k, v in (state.get("evals") or {}).items()}
        return state

    def write_promotion(self, state: Mapping[str, Any]) -> None:
        """Save the promotion state atomically (write a temporary file, then rename)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{_PROMOTION}.tmp"
        body = {**state, "evals": {str(k): v for k, v in (state.get("evals") or {}).items()}}
        tmp.write_text(json.dumps(body, indent=2))
        os.replace(tmp, self.root / _PROMOTION)
