"""`durable_rename`: everything under the source is flushed to disk before the rename, the rename after."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from trainer_service.durable import durable_rename


def record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Record each fsync (by the path its descriptor names) and each rename, in order."""
    events: list[tuple[str, ...]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(descriptor: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def recording_replace(source: str | Path, target: str | Path) -> None:
        events.append(("rename", str(source), str(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    return events


def test_a_folder_is_on_disk_before_its_name_and_its_name_after(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = tmp_path / ".step-1.tmp", tmp_path / "step-1"
    (source / "adapter").mkdir(parents=True)
    (source / "adapter" / "weights.bin").write_bytes(b"w" * 1000)
    (source / "manifest.json").write_text("{}")
    events = record(monkeypatch)
    durable_rename(source, target)
    rename = events.index(("rename", str(source), str(target)))
    before = {event[1] for event in events[:rename]}
    assert before == {str(source), str(source / "adapter"), str(source / "adapter" / "weights.bin"),
                      str(source / "manifest.json")}
    assert events[rename + 1:] == [("fsync", str(tmp_path))]
    assert (target / "adapter" / "weights.bin").read_bytes() == b"w" * 1000 and not source.exists()


def test_a_file_replaces_its_target_once_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = tmp_path / ".state.tmp", tmp_path / "state.json"
    target.write_text("old")
    source.write_text("new")
    events = record(monkeypatch)
    durable_rename(source, target)
    assert events == [("fsync", str(source)), ("rename", str(source), str(target)), ("fsync", str(tmp_path))]
    assert target.read_text() == "new"


def test_a_failed_flush_renames_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = tmp_path / ".state.tmp", tmp_path / "state.json"
    source.write_text("new")

    def full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        durable_rename(source, target)
    assert not target.exists() and source.read_text() == "new"


def test_a_folder_whose_last_flush_fails_is_not_left_under_its_name(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = tmp_path / ".step-1.tmp", tmp_path / "step-1"
    source.mkdir()
    (source / "manifest.json").write_text("{}")
    fsync = os.fsync

    def parent_fails(descriptor: int) -> None:  # everything flushes, then the rename's own flush fails
        if os.readlink(f"/proc/self/fd/{descriptor}") == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", parent_fails)
    with pytest.raises(OSError, match="Input/output error"):
        durable_rename(source, target)
    # was left at step-1 while the caller rolled the step back: the next step hit FileExistsError, a restart served it
    assert not target.exists() and (source / "manifest.json").read_text() == "{}"
