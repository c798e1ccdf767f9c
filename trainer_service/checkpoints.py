"""The checkpoint folders of one run: which exist, which to keep, and how one goes.

A checkpoint is `checkpoints/step-N/` (`checkpoint_folder`: how one is written and read); a folder without a manifest
is never a checkpoint (leftovers of a crash are removed at start). Whether the kept ones fit this start is checked in
`checkpoint_checks`; `promotion.json` next to the folders (`promotion_state`) records the promoted step and every eval
reward.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer_service.checkpoint_checks import check_compatible
from trainer_service.checkpoint_folder import MANIFEST
from trainer_service.promotion_state import read_promotion, write_promotion

__all__ = ["CheckpointStore", "select_kept"]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-([1-9]\d*)$")
"""A checkpoint folder's name: `step-N` as `CheckpointStore.path` writes it (no `step-02`; step 0 is the base model)."""


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
        best_mode: `max` or `min`: which value is best; of equal best values the newest step is kept, in both modes.
        protect: steps always kept (the promoted one).
    """
    if keep_last is None:
        return set(steps)
    ordered = sorted(steps)
    kept = set(ordered[-keep_last:]) | (set(protect) & set(steps))
    candidates = [s for s in ordered if s in values and math.isfinite(values[s])]
    if candidates:
        sign = 1 if best_mode == "max" else -1
        kept.add(max(candidates, key=lambda s: (sign * values[s], s)))
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
        """Complete checkpoints (with a manifest, readable or not: `check_compatible` reads it), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and _has_manifest(path):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def remove_partial(self) -> list[str]:
        """Delete temporary folders a crashed save (or a failed delete) left behind; return their names.

        Such a folder has no manifest, so it is never a checkpoint: one that cannot be removed (e.g. a file in it is
        not ours to delete) is logged as an error naming it, and stays.
        """
        if not self.root.is_dir():
            return []
        removed = []
        for path in self.root.iterdir():
            temporary = path.name.startswith(".step-") and path.is_dir()
            unfinished = _STEP_DIR.match(path.name) and (path.is_dir() or path.is_symlink()) and not _has_manifest(path)
            if temporary or unfinished:  # a dangling `step-N` link too: it would stop step N's save (not a directory)
                try:
                    if path.is_symlink():  # the link only: what it points to was never written here
                        path.unlink()
                    else:
                        shutil.rmtree(path)
                except OSError as exc:
                    logger.error("could not remove the half-written checkpoint folder %s (%s); it is no checkpoint "
                                 "and stays: remove it by hand", path, exc)
                    continue
                removed.append(path.name)
        if removed:
            logger.warning("removed %d half-written checkpoint folder(s): %s", len(removed), ", ".join(removed))
        return removed

    def check_compatible(self, base_model: str, lora_r: int, target_modules: Sequence[str], lora_alpha: int) -> None:
        """Check that every kept checkpoint fits this start (`checkpoint_checks.check_compatible`).

        Raises:
            CheckpointMismatchError: names the first checkpoint that differs (or the file of it that cannot be
                read), what differs, and the fix.
        """
        check_compatible(self.existing(), base_model, lora_r, target_modules, lora_alpha)

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics recorded in checkpoint `step`'s manifest.

        Raises:
            OSError: the manifest cannot be read (its folder was deleted).
            ValueError: it is not JSON (or JSON nested too deep to decode), or not an object whose `metrics` is an
                object.
        """
        path = self.path(step) / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except RecursionError as exc:  # was a traceback in every step's retention
            raise ValueError(f"{path} is JSON nested too deep to decode") from exc
        metrics = manifest.get("metrics") if isinstance(manifest, dict) else []
        if not isinstance(metrics, dict | None):
            raise ValueError(f"{path} is not a JSON object whose `metrics` is an object")
        return dict(metrics or {})

    def delete(self, step: int) -> None:
        """Delete checkpoint `step` from disk (the manifest first, so a crash leaves no checkpoint).

        A `step-N` that is a symbolic link (a checkpoint moved to another disk) goes with the folder it points to.
        """
        path = self.path(step)
        folder = path.resolve()
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder)
        if path.is_symlink():
            path.unlink()

    # --- promotion state ------------------------------------------------------------------

    def read_promotion(self) -> dict[str, Any]:
        """The saved promotion state (`promotion_state.read_promotion`).

        Raises:
            CheckpointMismatchError: `promotion.json` cannot be read, or is not such a state; names it and the fix.
        """
        return read_promotion(self.root)

    def write_promotion(self, state: Mapping[str, Any]) -> None:
        """Save the promotion state atomically (`promotion_state.write_promotion`)."""
        write_promotion(self.root, state)


def _has_manifest(path: Path) -> bool:
    """Whether checkpoint folder `path` has a manifest, readable or not: one that cannot be read stops the start
    (`check_compatible`); its folder is never removed as a leftover."""
    return (path / MANIFEST).exists() or (path / MANIFEST).is_symlink()
