"""Checkpoints: what is kept, resume after restart, and a full disk: nothing half-written is served."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from collector.protocol import Batch
from tests.trainer_service.builders import group, lora_params, make_service, make_trainer
from trainer_service.checkpoint_checks import CheckpointMismatchError
from trainer_service.checkpoints import CheckpointStore, select_kept
from trainer_service.protocol import ServiceError


def test_select_kept_last_best_and_protected() -> None:
    steps = [1, 2, 3, 4, 5]
    values = {1: 0.5, 2: 1.5, 3: 0.1, 4: float("nan"), 5: 0.3}
    assert select_kept(steps, values, keep_last=None) == set(steps)
    assert select_kept(steps, values, keep_last=2) == {2, 4, 5}
    assert select_kept(steps, values, keep_last=2, best_mode="min") == {3, 4, 5}
    assert select_kept(steps, values, keep_last=1, protect={1}) == {1, 2, 5}
    assert select_kept(steps, {}, keep_last=1) == {5}


@pytest.mark.parametrize("mode", ["max", "min"])
def test_of_equal_best_values_the_newest_step_is_kept_in_both_modes(mode: str) -> None:
    flat = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}  # a metric that does not move: no old step is kept forever
    assert select_kept([1, 2, 3, 4], flat, keep_last=1, best_mode=mode) == {4}
    tied = {1: 5.0, 2: 5.0, 3: 1.0 if mode == "max" else 9.0, 4: 1.0 if mode == "max" else 9.0}
    assert select_kept([1, 2, 3, 4], tied, keep_last=1, best_mode=mode) == {2, 4}


async def test_full_disk_serves_nothing_and_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acks: list[tuple[str, dict]] = []
    releases: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks, releases=releases)
    trainer = service.trainer
    assert trainer is not None
    before = lora_params(trainer)
    real_save = trainer.model.save_pretrained

    def disk_full(path: str | Path, **kwargs: object) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "adapter_model.safetensors").write_bytes(b"half")  # a partial write, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.model, "save_pretrained", disk_full)
    batches.append(Batch(id="b1", groups=[group(trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 507 and info.value.body.error.code == "checkpoint_write_failed"
    assert "No space left on device" in info.value.body.error.message
    assert "Batch b1 was released: groups g are back" in info.value.body.error.message
    assert releases == [("b1", {"reason": "CheckpointWriteError: OSError: [Errno 28] No space left on device",
                                "failed": False})]  # not the data's fault
    assert acks == [] and service.engine.adapters == {} and service.steps == []
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no half-written folder left behind
    assert trainer.step_count == 0 and all(torch.equal(before[n], p) for n, p in lora_params(trainer).items())
    assert (await service.status()).last_error is not None

    monkeypatch.setattr(trainer.model, "save_pretrained", real_save)  # space freed: the next step is step 1
    batches.append(Batch(id="b2", groups=[group(trainer, (1.0, 0.0))], lease_expires_at=0))
    result = await service.train_once()
    assert result.step == 1 and acks == [("b2", {"policy_step": 1})]
    await service.aclose()


async def test_a_full_disk_safetensors_reports_without_an_errno_still_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    trainer = service.trainer
    assert trainer is not None
    full = f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} (os error {errno.ENOSPC})"

    def disk_full(path: str | Path, **kwargs: object) -> None:  # safetensors' own words (see the real limit below)
        raise SafetensorError(full)

    monkeypatch.setattr(trainer.model, "save_pretrained", disk_full)
    batches.append(Batch(id="b1", groups=[group(trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    # the 507 named no fix: a `SafetensorError` is no `OSError`
    assert info.value.status == 507 and f"SafetensorError: {full}" in info.value.body.error.message
    assert "rolled back; free disk space. Batch b1" in info.value.body.error.message
    await service.aclose()


_TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 47232 vs 47120"
"""What `torch.save` raised when a real full file system (a 128 KiB tmpfs) cut off the optimizer state."""


@pytest.mark.parametrize(("free", "fix", "code"), [(4096, "; free disk space", errno.ENOSPC), (1 << 30, "", None)])
async def test_torch_save_on_a_full_disk_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int, fix: str, code: int | None
) -> None:
    """`torch.save` names no errno: a full file system (what is left free) makes its failure ENOSPC, not room left."""
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    trainer = service.trainer
    assert trainer is not None
    real_usage = shutil.disk_usage

    def disk_full(obj: object, file: io.BufferedWriter) -> None:
        file.write(b"PK half")  # a partial write, then the zip writer's check
        raise RuntimeError(_TORCH_FULL)

    def usage(path: str | Path) -> tuple[int, int, int]:  # what is left of the checkpoint folder's file system
        total, used, _ = real_usage(path)
        return type(real_usage(path))(total, used, free)

    monkeypatch.setattr(torch, "save", disk_full)
    monkeypatch.setattr(shutil, "disk_usage", usage)
    batches.append(Batch(id="b1", groups=[group(trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    message = info.value.body.error.message
    assert info.value.status == 507 and _TORCH_FULL in message  # the writer's own message is kept
    assert f"rolled back{fix}. Batch b1" in message and info.value.__cause__.errno == code
    assert list((tmp_path / "checkpoints").iterdir()) == []
    await service.aclose()


class _OverQuota(io.RawIOBase):
    """A file the user's disk quota stops after `limit` bytes: a write past it fails with EDQUOT."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.left -= len(data)
        if self.left < 0:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        return len(data)


async def test_torch_save_over_a_disk_quota_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `torch.save` past a quota, on a disk with room: its `RuntimeError` chains the EDQUOT of the write."""
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    trainer = service.trainer
    assert trainer is not None
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, file: real_save(obj, _OverQuota(2048)))
    batches.append(Batch(id="b1", groups=[group(trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    message = info.value.body.error.message
    assert info.value.status == 507 and f"{os.strerror(errno.EDQUOT)}: torch.save: " in message  # names the quota
    assert "unexpected pos" in message and "rolled back; free disk space or raise the disk quota" in message
    assert info.value.__cause__.errno == errno.EDQUOT and list((tmp_path / "checkpoints").iterdir()) == []
    await service.aclose()


_WRITE_LIMITED_STEPS = """
import asyncio, json, resource, signal, sys, tempfile
from pathlib import Path
from collector.protocol import Batch
from tests.trainer_service.builders import group, make_service, make_trainer
from trainer_service.protocol import ServiceError

async def main(root):
    releases, batches = [], []
    service = make_service(root / "run", batches, [], releases=releases)
    trained = make_trainer()  # unlimited: the sizes of the files of a checkpoint after a step
    trained.step([group(trained, (1.0, 0.0))])
    probe = trained.save(root / "probe")
    adapter, optimizer = ((probe / name).stat().st_size for name in ("adapter_model.safetensors", "optimizer.pt"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    outcomes = []
    # the adapter's file cannot be written (safetensors); then only the optimizer's can not (torch.save)
    for index, limit in enumerate((adapter // 2, (adapter + optimizer) // 2)):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            await service.train_once()
            outcomes.append({"status": 200})
        except ServiceError as exc:
            outcomes.append({"status": exc.status, "code": exc.body.error.code, "message": exc.body.error.message,
                             "cause": type(exc.__cause__.__cause__).__name__, "errno": exc.__cause__.errno})
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(json.dumps({"outcomes": outcomes, "releases": releases, "step": service.trainer.step_count,
                      "left": sorted(p.name for p in service.checkpoint_dir.iterdir())}))
    await service.aclose()

asyncio.run(main(Path(sys.argv[1])))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file-size limits")
def test_a_real_write_limit_is_507_and_not_the_datas_fault(tmp_path: Path) -> None:
    """The real savers on a real write failure (a file-size limit in a child process): safetensors raises its
    `SafetensorError`, `torch.save` a `RuntimeError` chaining the file's `OSError`; both are 507 and released not
    failed."""
    done = subprocess.run([sys.executable, "-c", _WRITE_LIMITED_STEPS, str(tmp_path)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert [(o["status"], o.get("code"), o.get("cause")) for o in result["outcomes"]] == [
        (507, "checkpoint_write_failed", "SafetensorError"), (507, "checkpoint_write_failed", "OSError")]
    assert "SafetensorError: " in result["outcomes"][0]["message"]  # the writer's own message is kept
    # safetensors names the errno in its message ("(os error 27)"), `torch.save`'s `RuntimeError` ("unexpected pos
    # ...") chains the failed write's `OSError` (it named none when given a path, and the disk has room)
    assert [o["errno"] for o in result["outcomes"]] == [errno.EFBIG, errno.EFBIG]
    assert [(batch_id, body["failed"]) for batch_id, body in result["releases"]] == [("b0", False), ("b1", False)]
    assert result["step"] == 0 and result["left"] == []  # rolled back, nothing half-written left


async def test_resume_refuses_checkpoints_of_another_base_model(tmp_path: Path) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()
    await service.aclose()
    with pytest.raises(CheckpointMismatchError) as info:
        make_service(tmp_path, [], [], base_model="SomeOther/Model-7B")
    message = str(info.value)
    assert str(tmp_path / "checkpoints" / "step-1") in message and "base_model 'tiny-llama'" in message
    assert "another --output-dir" in message and "--base-model tiny-llama" in message


def test_lora_shape_mismatch_names_the_checkpoint_and_the_flags(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    (tmp_path / "step-3").mkdir()
    config = {"lora_r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (tmp_path / "step-3" / "manifest.json").write_text(json.dumps({"step": 3, "base_model": "m", "config": config}))
    save_file({}, tmp_path / "step-3" / "adapter_model.safetensors")  # files that can be read: only the fit counts
    (tmp_path / "step-3" / "adapter_config.json").write_text("{}")
    store.check_compatible("m", 8, ["v_proj", "q_proj"], 16)  # the same modules in another order fit
    with pytest.raises(CheckpointMismatchError, match=r"step-3 was trained with lora_r 8 \(now 16\).*--lora-r 8"):
        store.check_compatible("m", 16, ["q_proj", "v_proj"], 16)
    with pytest.raises(CheckpointMismatchError, match=r"--target-modules q_proj,v_proj"):
        store.check_compatible("m", 8, ["q_proj"], 16)
    # another alpha fits the shapes but scales the resumed adapter by another alpha / r: refused too
    with pytest.raises(CheckpointMismatchError,
                       match=r"step-3 was trained with lora_alpha 16 \(now 32\).*--lora-alpha 16"):
        store.check_compatible("m", 8, ["q_proj", "v_proj"], 32)


def test_the_same_base_model_named_another_way_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--base-model` takes the bundled model's name in any case and a local folder by any path to it; a run trained
    under one of these names was refused under another, as if trained on another model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    root = tmp_path / "checkpoints"
    (root / "step-1").mkdir(parents=True)
    save_file({}, root / "step-1" / "adapter_model.safetensors")
    (root / "step-1" / "adapter_config.json").write_text("{}")
    config = {"lora_r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    store = CheckpointStore(root)
    for recorded, now in (("smollm2-135m-instruct", "SmolLM2-135M-Instruct"), ("./model", str(tmp_path / "model")),
                          ("model/", "model")):
        manifest = {"step": 1, "base_model": recorded, "config": config}
        (root / "step-1" / "manifest.json").write_text(json.dumps(manifest))
        store.check_compatible(now, 8, ["q_proj"], 16)
    with pytest.raises(CheckpointMismatchError, match=r"step-1 was trained with base_model '.*/model' \(now "
                                                      r"'SmolLM2-360M-Instruct'\).*--base-model .*/model"):
        store.check_compatible("SmolLM2-360M-Instruct", 8, ["q_proj"], 16)


def test_an_unreadable_manifest_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "manifest.json").write_text('{"step": 2, "base_mo')  # damaged on disk
    with pytest.raises(CheckpointMismatchError, match=r"step-2/manifest.json cannot be read .*Move .*step-2 out of"):
        CheckpointStore(tmp_path).check_compatible("m", 8, ["q_proj"], 16)


@pytest.mark.parametrize("manifest", ["[]", '{"step": 2, "config": [8]}', '{"config": {"target_modules": 7}}',
                                      '{"step": 2, "config": {"target_modules": [7]}}', '{"step": 2, "metrics": [1]}',
                                      "[" * 100_000])  # nested too deep to decode: was a RecursionError traceback
def test_a_manifest_that_is_json_of_another_shape_is_unreadable_not_a_traceback(tmp_path: Path,
                                                                                 manifest: str) -> None:
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "manifest.json").write_text(manifest)
    with pytest.raises(CheckpointMismatchError, match=r"step-2/manifest.json cannot be read .*Move .*step-2 out of"):
        CheckpointStore(tmp_path).check_compatible("m", 8, ["q_proj"], 16)


def test_a_manifest_that_is_not_a_file_stops_the_start_and_its_checkpoint_is_kept(tmp_path: Path) -> None:
    """Its folder was removed as a half-written one (the adapter and optimizer state with it) and the run resumed from
    the step before."""
    trainer = make_trainer()
    for step in (1, 2):
        trainer.step_count = step
        trainer.save(tmp_path / "checkpoints" / f"step-{step}")
    manifest = tmp_path / "checkpoints" / "step-2" / "manifest.json"
    manifest.unlink()
    manifest.mkdir()  # cannot be read, as a file without read permission for a user who is not root
    with pytest.raises(CheckpointMismatchError, match=r"step-2/manifest.json cannot be read .*Move .*step-2 out of"):
        make_service(tmp_path, [], [])
    assert CheckpointStore(tmp_path / "checkpoints").remove_partial() == []
    assert (tmp_path / "checkpoints" / "step-2" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(("name", "damage"), [
    ("adapter_model.safetensors", lambda path: path.write_bytes(path.read_bytes()[:1000])),
    ("adapter_model.safetensors", lambda path: path.write_bytes(b"")),
    ("adapter_model.safetensors", lambda path: path.unlink()),
    ("adapter_config.json", lambda path: path.write_text("garbage")),
    ("adapter_config.json", lambda path: path.write_text("[" * 100_000)),  # was a RecursionError traceback
    ("optimizer.pt", lambda path: path.write_bytes(path.read_bytes()[:1000])),
    ("optimizer.pt", lambda path: path.write_bytes(b"")),
])
def test_a_damaged_checkpoint_file_stops_the_start_before_vllm_naming_it(tmp_path: Path, name: str,
                                                                          damage: Callable[[Path], object]) -> None:
    """Each was found only once vLLM ran: a traceback of the resume (the newest step), or vLLM refusing the adapter
    (an older one; the stand-in engine registered it)."""
    trainer = make_trainer()
    for step in (1, 2):
        trainer.step_count = step
        trainer.save(tmp_path / "checkpoints" / f"step-{step}")
    damage(tmp_path / "checkpoints" / "step-1" / name)
    with pytest.raises(CheckpointMismatchError, match=rf"step-1/{name} cannot be read \(.+\)\. Move .*step-1 out of"):
        make_service(tmp_path, [], [])  # the constructor: `art-trainer serve` exits with status 2 before vLLM starts
    (tmp_path / "checkpoints" / "step-1").rename(tmp_path / "step-1")  # the fix the message gives
    service = make_service(tmp_path, [], [])
    assert service.steps == [2] and service.trainer is not None and service.trainer.step_count == 2


@pytest.mark.parametrize("other", [{"lora_r": 16}, {"target_modules": ["q_proj", "v_proj"]}])
def test_an_optimizer_state_saved_for_another_adapter_stops_the_start_before_vllm(tmp_path: Path,
                                                                                  other: dict[str, object]) -> None:
    """A readable optimizer.pt of another LoRA rank was loaded silently and every step failed after (AdamW's moments
    of another shape); one of other target modules failed the resume, once vLLM ran."""
    ours, theirs = make_trainer(), make_trainer(**other)
    for trainer, where in ((ours, tmp_path / "checkpoints" / "step-1"), (theirs, tmp_path / "other")):
        trainer.train([group(trainer, (1.0, 0.0))])  # a moment for every weight
        trainer.step_count = 1
        trainer.save(where)
    newest = tmp_path / "checkpoints" / "step-1"
    (tmp_path / "other" / "optimizer.pt").replace(newest / "optimizer.pt")
    with pytest.raises(CheckpointMismatchError, match=r"step-1/optimizer.pt does not fit the adapter next to it: it "
                                                      r"holds the state of \d+ weights shaped .*Delete it to resume "
                                                      r"step-1 with a fresh AdamW, move .*step-1 out of"):
        make_service(tmp_path, [], [])  # the constructor: `art-trainer serve` exits with status 2 before vLLM starts
    (newest / "optimizer.pt").unlink()  # the first fix the message gives
    service = make_service(tmp_path, [], [])
    assert service.trainer is not None and service.trainer.step_count == 1


def test_partial_folders_are_removed_at_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    (tmp_path / ".step-3.tmp-abcd").mkdir(parents=True)
    (tmp_path / "step-2").mkdir()  # no manifest: never a checkpoint
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "manifest.json").write_text(json.dumps({"step": 1}))
    assert sorted(store.remove_partial()) == [".step-3.tmp-abcd", "step-2"]
    assert [step for step, _ in store.existing()] == [1]


async def test_a_leftover_that_cannot_be_removed_is_logged_and_the_start_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    leftover = tmp_path / "checkpoints" / "step-4"
    leftover.mkdir(parents=True)  # a delete that failed halfway: no manifest, never a checkpoint
    (tmp_path / "checkpoints" / ".step-5.tmp-abcd").mkdir()
    rmtree = shutil.rmtree

    def rmtree_refuses_the_leftover(path: Path) -> None:
        if Path(path) == leftover:
            raise PermissionError(errno.EACCES, "Permission denied", str(leftover / "held"))
        rmtree(path)

    monkeypatch.setattr("trainer_service.checkpoints.shutil.rmtree", rmtree_refuses_the_leftover)
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.steps == [] and leftover.is_dir() and not (tmp_path / "checkpoints" / ".step-5.tmp-abcd").exists()
    errors = [record for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert f"{leftover} ([Errno 13] Permission denied" in errors[0].getMessage()
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    assert (await service.train_once()).step == 1 and service.steps == [1]  # it trains on as usual
    await service.aclose()


@pytest.mark.parametrize("manifest", [{"base_model": "m"}, {"step": 2, "base_model": "m"}])
def test_a_manifest_without_its_folders_step_stops_the_start(tmp_path: Path, manifest: dict) -> None:
    (tmp_path / "step-7").mkdir()  # no step (the trainer's step counter comes from it), or a copy of step-2
    (tmp_path / "step-7" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointMismatchError, match=r"step-7/manifest.json cannot be read \(its `step` is "
                                                      r"(None|2), not 7 .*Move .*step-7 out of"):
        CheckpointStore(tmp_path).check_compatible("m", 8, ["q_proj"], 16)


@pytest.mark.parametrize(("unrecorded", "trained_with"), [
    ("base_model", {}), ("lora_r", {"lora_r": 16}), ("lora_alpha", {"lora_alpha": 32}),
    ("target_modules", {"target_modules": ["q_proj", "v_proj"]}),
])
def test_a_manifest_that_does_not_record_what_its_adapter_fits_stops_the_start(tmp_path: Path, unrecorded: str,
                                                                              trained_with: dict) -> None:
    """Such a manifest was let through unchecked: an adapter of another rank failed the resume with torch's
    size-mismatch traceback once vLLM ran; one of another alpha, other modules or another base model was served."""
    trainer = make_trainer(**trained_with)
    trainer.step_count = 1
    path = trainer.save(tmp_path / "checkpoints" / "step-1")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop(unrecorded, None)
    manifest["config"].pop(unrecorded, None)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointMismatchError, match=rf"step-1/manifest.json cannot be read \(it records no "
                                                      rf"{unrecorded}\b.*\)\. Move .*step-1 out of"):
        make_service(tmp_path, [], [])


def test_only_folders_named_as_the_store_names_them_are_checkpoints(tmp_path: Path) -> None:
    for name, step in (("step-2", 2), ("step-02", 2), ("step-0", 0)):  # step 0 is the base model
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"step": step}))
    store = CheckpointStore(tmp_path)
    assert store.remove_partial() == [] and store.existing() == [(2, tmp_path / "step-2")]


def test_a_symlinked_checkpoint_is_deleted_with_its_folder_and_a_dangling_one_is_unlinked(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "checkpoints", tmp_path / "other-disk"
    for step in (1, 2):
        (elsewhere / f"step-{step}").mkdir(parents=True)
        (elsewhere / f"step-{step}" / "adapter_model.safetensors").write_bytes(b"weights")
        root.mkdir(exist_ok=True)
        (root / f"step-{step}").symlink_to(elsewhere / f"step-{step}")
    (elsewhere / "step-1" / "manifest.json").write_text(json.dumps({"step": 1}))
    store = CheckpointStore(root)
    assert store.remove_partial() == ["step-2"]  # no manifest: never a checkpoint; the link goes, not its folder
    assert not (root / "step-2").is_symlink() and (elsewhere / "step-2" / "adapter_model.safetensors").is_file()
    assert store.existing() == [(1, root / "step-1")]
    store.delete(1)  # retention frees the disk the checkpoint is on
    assert not (root / "step-1").is_symlink() and not (elsewhere / "step-1").exists()
    assert store.remove_partial() == [] and store.existing() == []


def test_a_dangling_step_link_is_removed_at_start_and_its_step_written_again(tmp_path: Path) -> None:
    """A `step-N` link whose folder is gone (`delete` cut off after the folder, the other disk not mounted) has no
    manifest, so it is no checkpoint; it was kept, and every later save of step N failed (507, `Not a directory`)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step-1").symlink_to(tmp_path / "other-disk" / "step-1")
    store = CheckpointStore(root)
    assert store.remove_partial() == ["step-1"] and not (root / "step-1").is_symlink()
    trainer = make_trainer()
    trainer.step_count = 1
    trainer.save(store.path(1))
    assert store.existing() == [(1, root / "step-1")] and not (tmp_path / "other-disk").exists()


async def test_adapter_vllm_refuses_is_rolled_back_and_removed(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_service.engine_errors import EngineError

    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.trainer is not None

    def refuse(name: str, path: str | Path) -> None:
        raise EngineError("vLLM refused /v1/load_lora_adapter: HTTP 400: LoRA rank 16 is greater than max_lora_rank 8")

    monkeypatch.setattr(service.engine, "load_adapter", refuse)
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 500 and "max_lora_rank" in info.value.body.error.message
    assert acks == [] and service.steps == [] and service.trainer.step_count == 0
    assert not (tmp_path / "checkpoints" / "step-1").exists()  # never left on disk to be served at restart
    await service.aclose()
