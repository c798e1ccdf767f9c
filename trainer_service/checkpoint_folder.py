"""One checkpoint folder on disk: how it is written (atomically) and read back.

A checkpoint is a `step-N/` folder with the adapter (PEFT, safetensors), the optimizer state and `manifest.json`; it is
written under a temporary name and renamed (`write_checkpoint`), so a folder without a manifest is never a checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, set_peft_model_state_dict

from trainer_service.durable import durable_rename

__all__ = [
    "ADAPTER", "ADAPTER_CONFIG", "MANIFEST", "OPTIMIZER", "CheckpointWriteError", "read_checkpoint", "write_checkpoint",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
"""Name of the checkpoint manifest written next to the adapter."""
OPTIMIZER = "optimizer.pt"
"""The optimizer state as `torch.save` writes it (a zip file)."""
ADAPTER = "adapter_model.safetensors"
"""The adapter's weights as PEFT's `save_pretrained` names them."""
ADAPTER_CONFIG = "adapter_config.json"
"""The adapter's configuration as PEFT's `save_pretrained` names it."""
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How a Rust `std::io::Error` names its errno in a message, e.g. safetensors' `SafetensorError` on a full disk:
"Error while serializing: I/O error: No space left on device (os error 28)"."""
_NEARLY_FULL_BYTES = 1 << 20
"""Free space (bytes an unprivileged user may still write) below which a file system counts as full when `torch.save`
fails on it: its `RuntimeError` names no errno ("unexpected pos ...")."""


class CheckpointWriteError(OSError):
    """A checkpoint folder could not be written (e.g. a full disk); nothing was left of it.

    Whatever the writer raised (an `OSError`, safetensors' `SafetensorError`, the `RuntimeError` of `torch.save`, or
    the `OSError` `_save_optimizer` makes of that: the failed write's errno, else ENOSPC on a full file system) is
    chained as `__cause__`; the message is its type and message. `errno` is the writer's where it names one
    (`_writer_errno`), so it survives the trip from a `--train-processes` rank as a number; else None.
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
        _save_optimizer(optimizer, tmp / OPTIMIZER)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        durable_rename(tmp, path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception):
            raise CheckpointWriteError(f"{type(exc).__name__}: {exc}", _writer_errno(exc)) from exc
        raise
    return path


def _save_optimizer(optimizer: torch.optim.Optimizer, file: Path) -> None:
    """`torch.save` `optimizer`'s state to `file`, through a Python file so that a failed write's `OSError` (e.g.
    EDQUOT over a disk quota) reaches us: given a path, `torch.save` writes in C++ and its error names no errno.

    Raises:
        OSError: the errno of the failed write `torch.save`'s `RuntimeError` chains; else ENOSPC when it failed on a
            file system with less than `_NEARLY_FULL_BYTES` free (the `RuntimeError` chained and its message kept).
        RuntimeError: `torch.save` failed without a write error, on a file system with room left or whose free space
            cannot be read.
    """
    try:
        with file.open("wb") as stream:
            torch.save(optimizer.state_dict(), stream)
    except RuntimeError as exc:
        write = exc.__cause__ or exc.__context__  # the file's `OSError`, which `torch.save` raised its own over
        if isinstance(write, OSError) and write.errno is not None:
            raise OSError(write.errno, f"{os.strerror(write.errno)}: torch.save: {exc}") from exc
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
    result = set_peft_model_state_dict(model, load_file(str(path / ADAPTER), device=str(device)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"checkpoint {path} does not match this adapter: unexpected keys {unexpected[:3]}...")
    optimizer_file = path / OPTIMIZER
    optimizer = torch.load(optimizer_file, map_location=device) if optimizer_file.is_file() else None
    return manifest, optimizer
