"""TCMalloc for the trainer service and its vLLM engine on a CPU (`TrainerSettings.allocator`).

A training step frees and allocates the same activation sizes thousands of times. glibc's malloc
hands large blocks back to the kernel on `free` and maps them afresh on the next `malloc`, so
every step faults its pages in again; TCMalloc keeps freed blocks for reuse. vLLM's CPU worker
asks for it too (it warns "libtcmalloc is not found in LD_PRELOAD" without it). Measured here on
the training bench's batch (bundled model, bf16, 2 threads, a fresh process each, alternating
twice): with huge pages on both, steps of 6.0 / 6.4 s (first), 3.4 / 3.6 s (second), 3.8 / 3.9 s
(third, other lengths) against 7.4 / 9.1, 4.5 / 4.9 and 4.1 / 4.3 s with glibc, 0.40 M page faults
against 0.50 M; without huge pages 4.2 / 4.3, 3.5 / 3.6 and 3.7 / 3.7 s alone, but in the bench's
step beside vLLM slower than with them (trainer_service/huge_pages.py stays on). jemalloc (its
default decay) was slower than glibc, 2.2 M faults. vLLM sampling the bench's batch: 5.59 against
5.93 s median (6 samplings each, engines alternating).

An allocator is chosen before a process starts (`LD_PRELOAD`), so `art-trainer serve` runs itself
again with it preloaded (`exec`: same process id, same arguments) before anything else; the
engine and `torchrun` workers inherit it. Not used with an NVIDIA GPU (`auto` there is the system
allocator: only measured on a CPU).
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PRELOADED_ENV", "allocator_library", "is_mapped", "loaded_allocator", "preload_allocator",
           "with_preload"]

logger = logging.getLogger(__name__)

TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
"""Libraries `auto` looks for, in order (Debian: `libtcmalloc-minimal4`)."""

PRELOADED_ENV = "ART_ALLOCATOR_PRELOADED"
"""Set on the process `preload_allocator` runs again, so a library the loader refused is not retried forever."""

NVIDIA_DRIVER = Path("/proc/driver/nvidia")
"""Present where an NVIDIA driver is loaded: `auto` then keeps the system allocator."""

_QUIET_LARGE_ALLOCS = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**40)}
"""TCMalloc prints a line for every allocation over 1 GiB by default (a long batch's logits)."""


def allocator_library(setting: str) -> str | None:
    """The library to preload for `setting`: `auto`, `system` or a path to a shared library.

    `auto` is TCMalloc where it is installed and the machine has no NVIDIA GPU, else None (the system
    allocator); `system` is None.

    Raises:
        ValueError: `setting` is a path that does not exist.
    """
    if setting == "system":
        return None
    if setting == "auto":
        if NVIDIA_DRIVER.exists():
            return None
        return next((name for name in map(ctypes.util.find_library, TCMALLOC_NAMES) if name), None)
    if not Path(setting).is_file():
        raise ValueError(f"allocator={setting!r}: no such library; give `auto`, `system` or the path of a shared "
                         "library such as /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    return setting


def is_mapped(library: str, pid: int | str = "self") -> bool:
    """Whether `library` (a name such as `libtcmalloc_minimal.so.4`, or a path) is mapped into process `pid`."""
    maps = Path(f"/proc/{pid}/maps")
    stem = Path(library).name.split(".so")[0]  # /proc lists the file the name points to: ...so.4.5.10
    return maps.exists() and f"/{stem}." in maps.read_text()


def _preloads(environ: Mapping[str, str]) -> list[str]:
    """The entries of `LD_PRELOAD` (the loader separates them by colons or spaces)."""
    return [entry for entry in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if entry]


def loaded_allocator() -> str | None:
    """The preloaded allocator this process runs (the `LD_PRELOAD` entry mapped into it), or None."""
    return next((entry for entry in _preloads(os.environ) if is_mapped(entry)), None)


def with_preload(environ: Mapping[str, str], library: str) -> dict[str, str]:
    """A copy of `environ` with `library` first in `LD_PRELOAD` (kept once) and TCMalloc's large-alloc lines off."""
    env = {**_QUIET_LARGE_ALLOCS, **environ}
    others = [entry for entry in _preloads(env) if entry != library]
    env["LD_PRELOAD"] = ":".join([library, *others])
    return env


def preload_allocator(setting: str) -> str | None:
    """Make this process run on the allocator `setting` names: return it if loaded, else run the process again.

    Call it first thing in a program's `main`, before threads or large allocations: the process is
    replaced (`os.execve` of `sys.orig_argv`) with the library first in `LD_PRELOAD`, before what the user
    preloaded. Returns the preloaded allocator this process runs on (with `system`, one the user preloaded:
    `loaded_allocator`), or None for the system allocator (also when the loader refused the library on the
    second run: logged, not retried).

    Raises:
        ValueError: `setting` is a path that does not exist.
    """
    library = allocator_library(setting)
    if library is None:
        return loaded_allocator()
    if is_mapped(library):  # not any library the user preloaded: libgomp there kept TCMalloc out
        return library
    if os.environ.get(PRELOADED_ENV) == library:
        logger.warning("allocator %s was preloaded but is not mapped into this process; using the system "
                       "allocator (see the loader's message above)", library)
        return None
    env = with_preload(os.environ, library)
    env[PRELOADED_ENV] = library
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
