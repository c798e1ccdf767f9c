"""Checkpoint folders on disk: how one is written and read, which exist, which to keep, and which one
`name@latest` serves.

A checkpoint is `checkpoints/step-N/` with the adapter, the optimizer state and
`manifest.json`; it is written under a temporary name and renamed (`write_checkpoint`), so a
folder without a manifest is never a checkpoint (leftovers of a crash are removed at start).
`promotion.json` next to the folders records the promoted step and every eval reward, written
atomically.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import pickle
import re
import shutil
import uuid
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, set_peft_model_state_dict
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open

from collector.config import validation_problem
from trainer_service.base_model import base_model_key
from trainer_service.durable import durable_rename
from trainer_service.protocol import PromotionDecision

__all__ = [
    "MANIFEST", "CheckpointMismatchError", "CheckpointStore", "CheckpointWriteError", "read_checkpoint",
    "select_kept", "write_checkpoint",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
"""Name of the checkpoint manifest written next to the adapter."""
_OPTIMIZER = "optimizer.pt"
_ADAPTER = "adapter_model.safetensors"
"""The adapter's weights as PEFT's `save_pretrained` names them."""
_ADAPTER_CONFIG = "adapter_config.json"
_STEP_DIR = re.compile(r"^step-([1-9]\d*)$")
"""A checkpoint folder's name: `step-N` as `CheckpointStore.path` writes it (no `step-02`; step 0 is the base model)."""
_PROMOTION = "promotion.json"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How a Rust `std::io::Error` names its errno in a message, e.g. safetensors' `SafetensorError` on a full disk:
"Error while serializing: I/O error: No space left on device (os error 28)"."""
_NEARLY_FULL_BYTES = 1 << 20
"""Free space (bytes an unprivileged user may still write) below which a file system counts as full when `torch.save`
fails on it: its `RuntimeError` names no errno ("unexpected pos ...")."""
_FLAGS = {"base_model": "--base-model", "lora_r": "--lora-r", "lora_alpha": "--lora-alpha",
          "target_modules": "--target-modules"}
"""Manifest fields a resumed checkpoint must match, and the flag that sets each."""


class CheckpointMismatchError(ValueError):
    """A kept checkpoint was trained on another base model, LoRA shape or LoRA scale (alpha) than the service now has,
    or one of its files (manifest, adapter, optimizer state) or the promotion state (`promotion.json`) cannot be
    read."""


class CheckpointWriteError(OSError):
    """A checkpoint folder could not be written (e.g. a full disk); nothing was left of it.

    Whatever the writer raised (an `OSError`, safetensors' `SafetensorError`, the `RuntimeError` of `torch.save`, or
    the ENOSPC `OSError` `_save_optimizer` makes of that on a full file system) is chained as `__cause__`; the message
    is its type and message. `errno` is the writer's where it names one (`_writer_errno`), so it survives the trip
    from a `--train-processes` rank as a number; else None.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.errno = code


def _writer_errno(exc: BaseException) -> int | None:
    """The errno of checkpoint writer error `exc`: an `OSError`'s own, or the one a Rust writer's message names
    (safetensors' `SafetensorError`); None where there is none (`torch.save`'s `RuntimeError` on a file system with
    room left, see `_save_optimizer`)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    named = _RUST_OS_ERROR.search(str(exc))
    return int(named.group(1)) if named else None


def write_checkpoint(path: Path, model: PeftModel, optimizer: torch.optim.Optimizer,
                     manifest: Mapping[str, Any]) -> Path:
    """Write `model`'s adapter (PEFT, safetensors), `optimizer`'s state and `manifest` to folder `path`, atomically.

    Everything goes to a temporary sibling folder first, which is renamed to `path` once it is
    on disk (`durable_rename`), so neither a crash nor a power loss leaves a half-written
    checkpoint under the final name.

    Raises:
        FileExistsError: `path` exists already.
        CheckpointWriteError: writing failed (the writer's error chained); nothing is left of the checkpoint.
    """
    if path.exists():
        raise FileExistsError(f"checkpoint {path} exists already; remove it or choose another step folder")
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        _save_optimizer(optimizer, tmp / _OPTIMIZER)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        durable_rename(tmp, path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception):
            raise CheckpointWriteError(f"{type(exc).__name__}: {exc}", _writer_errno(exc)) from exc
        raise
    return path


def _save_optimizer(optimizer: torch.optim.Optimizer, file: Path) -> None:
    """`torch.save` `optimizer`'s state to `file`.

    Raises:
        OSError: ENOSPC: `torch.save` failed on a file system with less than `_NEARLY_FULL_BYTES` free (its
            `RuntimeError`, which names no errno, chained and its message kept).
        RuntimeError: `torch.save` failed on a file system with room left, or whose free space cannot be read.
    """
    try:
        torch.save(optimizer.state_dict(), file)
    except RuntimeError as exc:
        free = _free_bytes(file.parent)
        if free is None or free >= _NEARLY_FULL_BYTES:
            raise
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free): torch.save: {exc}") from exc


def _free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged user may still write to `folder`'s file system; None (logged) when that cannot be read."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        logger.warning("cannot read the free space of %s", folder, exc_info=True)
        return None


def read_checkpoint(path: Path, model: PeftModel) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load the adapter weights of checkpoint `path` into `model`; return its manifest and optimizer state.

    The optimizer state (None when the folder has none) is mapped to `model`'s device.

    Raises:
        ValueError: the checkpoint's adapter has weights `model`'s adapter does not.
    """
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    manifest = json.loads((path / MANIFEST).read_text())
    result = set_peft_model_state_dict(model, load_file(str(path / _ADAPTER), device=str(device)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"checkpoint {path} does not match this adapter: unexpected keys {unexpected[:3]}...")
    optimizer_file = path / _OPTIMIZER
    optimizer = torch.load(optimizer_file, map_location=device) if optimizer_file.is_file() else None
    return manifest, optimizer


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
        """Check that every kept checkpoint was trained on `base_model` (under any name of it: `base_model_key`) with
        this LoRA rank, modules and alpha, that its manifest records the step its folder is named for, and that its
        files can be read (`_check_files`).

        A resumed adapter trained with another alpha would be scaled by the new `lora_alpha / lora_r`: its
        next checkpoint would serve another policy than the one it was trained as.

        Raises:
            CheckpointMismatchError: names the first checkpoint that differs (or the file of it that cannot be
                read), what differs, and the fix.
        """
        wanted = {"base_model": base_model_key(base_model), "lora_r": lora_r, "lora_alpha": lora_alpha,
                  "target_modules": sorted(target_modules)}
        existing = self.existing()
        for step, path in existing:
            try:
                recorded = _recorded(json.loads((path / MANIFEST).read_text()), step)
            except (OSError, ValueError) as exc:
                raise self._unreadable(path / MANIFEST, exc) from exc
            differ = [key for key in _FLAGS if recorded[key] != wanted[key]]
            if differ:
                found = ", ".join(f"{key} {recorded[key]!r} (now {wanted[key]!r})" for key in differ)
                flags = " ".join(f"{_FLAGS[key]} {_flag_value(recorded[key])}" for key in differ)
                raise CheckpointMismatchError(
                    f"{path} was trained with {found}: its adapter does not fit these settings. Give another "
                    f"--output-dir to start a new run, or start with {flags} to resume this one.")
            self._check_files(path)
        if existing:
            self._check_optimizer_fits(existing[-1][1])

    def _check_files(self, path: Path) -> None:
        """Check from their headers that checkpoint `path`'s adapter, adapter config and optimizer state (when it has
        one) can be read: vLLM would refuse a damaged one, and the resume would stop once vLLM runs.

        Raises:
            CheckpointMismatchError: names the file and the fix.
        """
        file = path / _ADAPTER
        try:
            with safe_open(str(file), framework="pt"):  # parses and checks the header; loads no weights
                pass
            file = path / _ADAPTER_CONFIG
            if not isinstance(json.loads(file.read_text()), dict):
                raise ValueError("not a JSON object")
            file = path / _OPTIMIZER
            if file.exists():  # none: the resume starts AdamW afresh
                zipfile.ZipFile(file).close()  # `torch.save`'s format: one cut short has no central directory
        except (OSError, ValueError, SafetensorError, zipfile.BadZipFile) as exc:
            raise self._unreadable(file, exc) from exc

    def _check_optimizer_fits(self, path: Path) -> None:
        """Check that the optimizer state of checkpoint `path` (the newest: the one the trainer resumes), when it has
        one, holds a moment for each weight of its adapter, shaped as that weight (read from the headers: the file
        is memory-mapped, no moment is read). One saved for another LoRA rank loaded silently and failed every
        step; one for other target modules failed the resume, once vLLM ran.

        Raises:
            CheckpointMismatchError: names the file, how it differs from the adapter and the fixes.
        """
        file = path / _OPTIMIZER
        if not file.exists():
            return
        with safe_open(str(path / _ADAPTER), framework="pt") as adapter:
            weights = Counter(tuple(adapter.get_slice(key).get_shape()) for key in adapter.keys())
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            count = sum(len(group["params"]) for group in state["param_groups"])
            moments = Counter(tuple(entry["exp_avg"].shape) for entry in state["state"].values() if "exp_avg" in entry)
        except (OSError, RuntimeError, pickle.UnpicklingError, KeyError, TypeError, AttributeError) as exc:
            raise self._unreadable(file, exc) from exc  # not an optimizer's `state_dict`: the resume would fail
        if count != weights.total() or moments - weights:
            raise CheckpointMismatchError(
                f"{file} does not fit the adapter next to it: it holds the state of {count} weights shaped "
                f"{_shapes(moments)}, the adapter has {weights.total()} shaped {_shapes(weights)} (saved for another "
                f"--lora-r or --target-modules?). Delete it to resume {path.name} with a fresh AdamW, move {path} out "
                f"of {self.root} to resume from the checkpoints before it, or give another --output-dir.")

    def _unreadable(self, file: Path, exc: Exception) -> CheckpointMismatchError:
        """The error for a checkpoint file that cannot be read: names it, why, and the folder to move out."""
        return CheckpointMismatchError(
            f"{file} cannot be read ({exc}). Move {file.parent} out of {self.root} to resume from the "
            "checkpoints before it, or give another --output-dir to start a new run.")

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics recorded in checkpoint `step`'s manifest.

        Raises:
            OSError: the manifest cannot be read (its folder was deleted).
            ValueError: it is not JSON, or not an object whose `metrics` is an object.
        """
        manifest = json.loads((self.path(step) / MANIFEST).read_text())
        metrics = manifest.get("metrics") if isinstance(manifest, dict) else []
        if not isinstance(metrics, dict | None):
            raise ValueError(f"{self.path(step) / MANIFEST} is not a JSON object whose `metrics` is an object")
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
        """The saved promotion state: `{"latest": step or None, "evals": {step: reward}, "prompt_set": key of the
        prompts those rewards were measured on, "decision": PromotionDecision or None}`.

        Raises:
            CheckpointMismatchError: `promotion.json` cannot be read, or is not such a state; names it and the fix.
        """
        path = self.root / _PROMOTION
        if not path.exists():  # one that is there but not a file cannot be read: named below, not ignored
            return {"latest": None, "evals": {}, "decision": None}
        try:
            state = json.loads(path.read_text())
            if not isinstance(state, dict) or not isinstance(state.get("evals") or {}, dict):
                raise ValueError("not a JSON object whose `evals` is an object")
            latest = state.get("latest")
            if latest is not None and (isinstance(latest, bool) or not isinstance(latest, int)):
                raise ValueError(f"its `latest` is {latest!r}, not a step number or null")
            state["evals"] = {int(k): float(v) for k, v in (state.get("evals") or {}).items()}
            if not all(math.isfinite(reward) for reward in state["evals"].values()):  # a NaN baseline promoted nothing
                raise ValueError("an eval reward in its `evals` is not a finite number")
            decision = state.get("decision")
            state["decision"] = PromotionDecision.model_validate(decision) if decision else None
        # TypeError: an eval reward that is not a number; OverflowError: one too large for a float; RecursionError:
        # JSON nested too deep (both were a traceback at start)
        except (OSError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            detail = (f"its decision is not one: {'; '.join(validation_problem(error) for error in exc.errors())}"
                      if isinstance(exc, ValidationError) else f"{type(exc).__name__}: {exc}")
            raise CheckpointMismatchError(
                f"{path} cannot be read ({detail}). Move it out of {self.root} to start the "
                "promotion gate afresh (`name@latest` then serves the newest checkpoint, or with an eval set the "
                "base model until a step is promoted).") from exc
        return state

    def write_promotion(self, state: Mapping[str, Any]) -> None:
        """Save the promotion state atomically (write a temporary file, then `durable_rename` it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{_PROMOTION}.tmp"
        body = {**state, "evals": {str(k): v for k, v in (state.get("evals") or {}).items()}}
        tmp.write_text(json.dumps(body, indent=2))
        durable_rename(tmp, self.root / _PROMOTION)


def _recorded(manifest: Any, step: int) -> dict[str, Any]:
    """The settings of `_FLAGS` that the manifest of checkpoint `step` records (`base_model` as `base_model_key`
    names it, `target_modules` sorted).

    Raises:
        ValueError: it is not a JSON object whose `config` is an object with a `target_modules` list of names, or
            its `step` is not `step` (the trainer resumes its step counter from it), its `metrics` (its last metrics)
            not an object, or it leaves one of those settings out (its adapter's fit could not be checked).
    """
    config = (manifest.get("config") or {}) if isinstance(manifest, dict) else None
    modules = config.get("target_modules", []) if isinstance(config, dict) else None
    if not isinstance(modules, list) or not all(isinstance(name, str) for name in modules):
        raise ValueError("not a JSON object whose `config` is an object with a `target_modules` list of names")
    if manifest.get("step") != step:
        raise ValueError(f"its `step` is {manifest.get('step')!r}, not {step} as its folder is named")
    if not isinstance(manifest.get("metrics"), dict | None):
        raise ValueError("its `metrics` is not an object")
    base_model = manifest.get("base_model")
    recorded = {"base_model": base_model_key(base_model) if isinstance(base_model, str) else base_model,
                "lora_r": config.get("lora_r"),
                "lora_alpha": config.get("lora_alpha"),
                "target_modules": sorted(modules) if "target_modules" in config else None}
    unrecorded = [key for key, value in recorded.items() if value is None]
    if unrecorded:
        raise ValueError(f"it records no {', '.join(unrecorded)}: whether its adapter fits cannot be checked")
    return recorded


def _has_manifest(path: Path) -> bool:
    """Whether checkpoint folder `path` has a manifest, readable or not: one that cannot be read stops the start
    (`check_compatible`); its folder is never removed as a leftover."""
    return (path / MANIFEST).exists() or (path / MANIFEST).is_symlink()


def _shapes(counts: Counter[tuple[int, ...]]) -> str:
    """Tensor shapes and how many have each, as `8x64 (x14)`."""
    return ", ".join(f"{'x'.join(map(str, shape))} (x{n})" for shape, n in sorted(counts.items())) or "none"


def _flag_value(value: Any) -> str:
    """A manifest value as written on the command line (lists comma-separated)."""
    return ",".join(value) if isinstance(value, list) else str(value)
