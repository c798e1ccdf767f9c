"""Renames that survive a power loss: what a checkpoint or the promotion state holds reaches the disk before
its final name does.

A rename alone is atomic against a crash of the process, not of the machine: the kernel may write the new
name before the data, so after a power cut a checkpoint could be there with empty files. `durable_rename`
flushes the data first (`fsync` of every file and folder under the source), renames, then flushes the
parent folder so that the rename itself is on disk. Measured on this project's 2-core VM: 0.03-0.04 s for
60 MB (a bench-sized adapter with its optimizer state is about that).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["durable_rename"]


def durable_rename(source: Path, target: Path) -> None:
    """Rename `source` (a file, or a folder) to `target` once everything under it is on disk.

    Raises:
        OSError: a flush or the rename failed (e.g. a full disk). A folder is then still at `source`, not at
            `target` (a rename whose final flush failed is undone); a file's `target` holds the new content if
            only that last flush failed (the old one is gone by then).
    """
    folder = source.is_dir()
    for item in (*sorted(source.rglob("*")), source) if folder else (source,):
        _fsync(item)
    os.replace(source, target)
    try:
        _fsync(target.parent)
    except OSError:
        if folder:  # a checkpoint reported as not written must not be found (and served) under its name
            os.replace(target, source)
        raise


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
