"""`--allocator`: which library is preloaded, how the environment is built, and the process run again on it."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_service import allocator
from trainer_service.allocator import PRELOADED_ENV, allocator_library, with_preload

TCMALLOC = allocator_library("auto")
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="TCMalloc is not installed (make system-deps installs it)")


def test_system_is_no_library_and_a_path_must_exist(tmp_path: Path) -> None:
    assert allocator_library("system") is None
    library = tmp_path / "libmine.so"
    library.write_bytes(b"")
    assert allocator_library(str(library)) == str(library)
    with pytest.raises(ValueError, match="no such library"):
        allocator_library(str(tmp_path / "missing.so"))


def test_auto_is_tcmalloc_when_installed_and_no_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(allocator, "NVIDIA_DRIVER", tmp_path / "no-driver")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.4" if name == "tcmalloc" else None)
    assert allocator_library("auto") == "libtcmalloc.so.4"  # the full library where the minimal one is missing
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert allocator_library("auto") is None
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.4")
    assert allocator_library("auto") == "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(allocator, "NVIDIA_DRIVER", tmp_path)  # a driver: only measured on a CPU
    assert allocator_library("auto") is None


def test_with_preload_puts_the_library_first_once_and_quiets_large_allocs() -> None:
    env = with_preload({"LD_PRELOAD": "libgomp.so.1 libtc.so.4", "PATH": "/bin"}, "libtc.so.4")
    assert env["LD_PRELOAD"] == "libtc.so.4:libgomp.so.1" and env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 2**40
    kept = with_preload({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, "libtc.so.4")
    assert kept == {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5", "LD_PRELOAD": "libtc.so.4"}


PROBE = (
    "import os, sys\n"
    "from trainer_service.allocator import preload_allocator\n"
    "print('pid', os.getpid(), flush=True)\n"
    "print('runs on', preload_allocator(sys.argv[1]), flush=True)\n"
)


def run_probe(setting: str, preload: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", PRELOADED_ENV)}
    if preload is not None:
        env["LD_PRELOAD"] = preload
    return subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, env=env,
                          timeout=120, check=True)


@needs_tcmalloc
def test_the_process_runs_again_on_tcmalloc_with_its_pid_and_arguments() -> None:
    done = run_probe("auto")
    pids = [line for line in done.stdout.splitlines() if line.startswith("pid")]
    assert len(pids) == 2 and pids[0] == pids[1], done.stdout  # ran twice, as one process
    assert done.stdout.splitlines()[-1] == f"runs on {TCMALLOC}"
    system = run_probe("system").stdout.splitlines()
    assert len(system) == 2 and system[1] == "runs on None"  # ran once


@needs_tcmalloc
def test_a_library_the_user_preloaded_does_not_keep_the_allocator_out() -> None:
    # any LD_PRELOAD entry (libgomp, as vLLM-cpu's docs suggest) was taken for the allocator: TCMalloc never loaded
    done = run_probe("auto", preload="libm.so.6")
    assert done.stdout.splitlines()[-1] == f"runs on {TCMALLOC}"
    assert len([line for line in done.stdout.splitlines() if line.startswith("pid")]) == 2
    assert run_probe("system", preload="libm.so.6").stdout.splitlines()[-1] == "runs on libm.so.6"  # yours, kept

def test_a_library_the_loader_refuses_is_not_retried(tmp_path: Path) -> None:
    broken = tmp_path / "libbroken.so"
    broken.write_text("not an ELF file")
    done = run_probe(str(broken))
    assert done.stdout.splitlines()[-1] == "runs on None"
    assert len([line for line in done.stdout.splitlines() if line.startswith("pid")]) == 2
    assert "is not mapped into this process" in done.stderr


@needs_tcmalloc
def test_serve_reports_its_allocator_and_refuses_a_missing_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", PRELOADED_ENV)}
    serve = [sys.executable, "-m", "trainer_service.cli", "serve", "--base-model", str(tmp_path / "none")]
    done = subprocess.run(serve, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert f"memory allocator: {TCMALLOC}" in done.stderr
    done = subprocess.run([*serve, "--allocator", str(tmp_path / "missing.so")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2 and "no such library" in done.stderr
