"""Whether the kept checkpoints fit this start: trained on the same base model and LoRA shape and scale, with files
that can be read, checked before vLLM starts (a resume would fail once it ran, or train another policy silently).
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trainer_service.base_model import base_model_key
from trainer_service.checkpoint_folder import ADAPTER, ADAPTER_CONFIG, MANIFEST, OPTIMIZER

__all__ = ["CheckpointMismatchError", "check_compatible"]

_FLAGS = {"base_model": "--base-model", "lora_r": "--lora-r", "lora_alpha": "--lora-alpha",
          "target_modules": "--target-modules"}
"""Manifest fields a resumed checkpoint must match, and the flag that sets each."""


class CheckpointMismatchError(ValueError):
    """A kept checkpoint was trained on another base model, LoRA shape or LoRA scale (alpha) than the service now has,
    or one of its files (manifest, adapter, optimizer state) or the promotion state (`promotion.json`) cannot be
    read."""


def check_compatible(existing: Sequence[tuple[int, Path]], base_model: str, lora_r: int,
                     target_modules: Sequence[str], lora_alpha: int) -> None:
    """Check that every kept checkpoint (`existing`: step and folder, oldest first, as `CheckpointStore.existing`
    lists them) was trained on `base_model` (under any name of it: `base_model_key`) with this LoRA rank, modules and
    alpha, that its manifest records the step its folder is named for, and that its files can be read
    (`_check_files`).

    A resumed adapter trained with another alpha would be scaled by the new `lora_alpha / lora_r`: its
    next checkpoint would serve another policy than the one it was trained as.

    Raises:
        CheckpointMismatchError: names the first checkpoint that differs (or the file of it that cannot be
            read), what differs, and the fix.
    """
    wanted = {"base_model": base_model_key(base_model), "lora_r": lora_r, "lora_alpha": lora_alpha,
              "target_modules": sorted(target_modules)}
    for step, path in existing:
        try:
            recorded = _recorded(json.loads((path / MANIFEST).read_text()), step)
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep to decode
            raise _unreadable(path / MANIFEST, exc) from exc
        differ = [key for key in _FLAGS if recorded[key] != wanted[key]]
        if differ:
            found = ", ".join(f"{key} {recorded[key]!r} (now {wanted[key]!r})" for key in differ)
            flags = " ".join(f"{_FLAGS[key]} {_flag_value(recorded[key])}" for key in differ)
            raise CheckpointMismatchError(
                f"{path} was trained with {found}: its adapter does not fit these settings. Give another "
                f"--output-dir to start a new run, or start with {flags} to resume this one.")
        _check_files(path)
    if existing:
        _check_optimizer_fits(existing[-1][1])


def _check_files(path: Path) -> None:
    """Check from their headers that checkpoint `path`'s adapter, adapter config and optimizer state (when it has
    one) can be read: vLLM would refuse a damaged one, and the resume would stop once vLLM runs.

    Raises:
        CheckpointMismatchError: names the file and the fix.
    """
    file = path / ADAPTER
    try:
        with safe_open(str(file), framework="pt"):  # parses and checks the header; loads no weights
            pass
        file = path / ADAPTER_CONFIG
        if not isinstance(json.loads(file.read_text()), dict):
            raise ValueError("not a JSON object")
        file = path / OPTIMIZER
        if file.exists():  # none: the resume starts AdamW afresh
            zipfile.ZipFile(file).close()  # `torch.save`'s format: one cut short has no central directory
    except (OSError, ValueError, RecursionError, SafetensorError, zipfile.BadZipFile) as exc:
        raise _unreadable(file, exc) from exc


def _check_optimizer_fits(path: Path) -> None:
    """Check that the optimizer state of checkpoint `path` (the newest: the one the trainer resumes), when it has
    one, holds a moment for each weight of its adapter, shaped as that weight (read from the headers: the file
    is memory-mapped, no moment is read). One saved for another LoRA rank loaded silently and failed every
    step; one for other target modules failed the resume, once vLLM ran.

    Raises:
        CheckpointMismatchError: names the file, how it differs from the adapter and the fixes.
    """
    file = path / OPTIMIZER
    if not file.exists():
        return
    with safe_open(str(path / ADAPTER), framework="pt") as adapter:
        weights = Counter(tuple(adapter.get_slice(key).get_shape()) for key in adapter.keys())
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        count = sum(len(group["params"]) for group in state["param_groups"])
        moments = Counter(tuple(entry["exp_avg"].shape) for entry in state["state"].values() if "exp_avg" in entry)
    except (OSError, RuntimeError, pickle.UnpicklingError, KeyError, TypeError, AttributeError) as exc:
        raise _unreadable(file, exc) from exc  # not an optimizer's `state_dict`: the resume would fail
    if count != weights.total() or moments - weights:
        raise CheckpointMismatchError(
            f"{file} does not fit the adapter next to it: it holds the state of {count} weights shaped "
            f"{_shapes(moments)}, the adapter has {weights.total()} shaped {_shapes(weights)} (saved for another "
            f"--lora-r or --target-modules?). Delete it to resume {path.name} with a fresh AdamW, move {path} out "
            f"of {path.parent} to resume from the checkpoints before it, or give another --output-dir.")


def _unreadable(file: Path, exc: Exception) -> CheckpointMismatchError:
    """The error for a checkpoint file that cannot be read: names it, why, and the folder to move out."""
    return CheckpointMismatchError(
        f"{file} cannot be read ({exc}). Move {file.parent} out of {file.parent.parent} to resume from the "
        "checkpoints before it, or give another --output-dir to start a new run.")


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


def _shapes(counts: Counter[tuple[int, ...]]) -> str:
    """Tensor shapes and how many have each, as `8x64 (x14)`."""
    return ", ".join(f"{'x'.join(map(str, shape))} (x{n})" for shape, n in sorted(counts.items())) or "none"


def _flag_value(value: Any) -> str:
    """A manifest value as written on the command line (lists comma-separated)."""
    return ",".join(value) if isinstance(value, list) else str(value)
