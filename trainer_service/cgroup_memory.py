"""The memory limit of the cgroups this process runs in: the bound of a KV cache on a CPU in a container, a systemd
slice or a batch job, where the kernel kills a process past it instead of refusing its allocation."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CGROUP_ROOT", "MEMBERSHIP", "cgroup_memory_limit"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup file systems are mounted (in a container with its own cgroup namespace, its own cgroup's)."""
MEMBERSHIP = Path("/proc/self/cgroup")
"""The cgroups of this process, one `hierarchy:controllers:path` line per hierarchy (v2's: `0::path`)."""


def _limit_files(root: Path, membership: Path) -> list[Path]:
    """The memory limit files of the cgroups this process is in and of their parents, up to the mount roots: v2's
    `memory.max` under `root`, v1's `memory.limit_in_bytes` under `root/memory`, along the paths `membership` names
    (a limit on a parent bounds its children too)."""
    folders: list[tuple[Path, str, str]] = [(root, "/", "memory.max"), (root / "memory", "/", "memory.limit_in_bytes")]
    if membership.is_file():
        for line in membership.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                folders.append((root, path, "memory.max"))
            elif "memory" in controllers.split(","):
                folders.append((root / "memory", path, "memory.limit_in_bytes"))
    files = set()
    for mount, path, name in folders:
        folder = mount.joinpath(*(part for part in path.split("/") if part not in ("", ".", "..")))
        while True:
            files.add(folder / name)
            if folder == mount:
                break
            folder = folder.parent
    return sorted(files)


def cgroup_memory_limit(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> int | None:
    """The least memory limit, in bytes, of the cgroups this process is in (`membership`) and their parents, cgroup v2
    and v1 alike (`root`: where they are mounted); None where none is set (v2's `max`; v1 writes a number past any
    machine's memory instead) or none can be read (no cgroup file system, a file this process may not read)."""
    limits = []
    for path in _limit_files(root, membership):
        try:
            text = path.read_text().strip()
        except OSError:  # no such cgroup here (a path of another namespace), or not ours to read
            continue
        if text.isdecimal():
            limits.append(int(text))
    return min(limits, default=None)
