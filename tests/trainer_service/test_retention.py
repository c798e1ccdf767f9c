"""Checkpoint retention through the service: dropped steps stop being served, then their folders go."""

from __future__ import annotations

import errno
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from collector.protocol import Batch
from tests.trainer_service.builders import FakeEngine, group, lora_params, make_service
from trainer_service.evaluation import Evaluator
from trainer_service.retention import Retention


async def test_retention_deletes_unloads_and_restart_restores(tmp_path: Path) -> None:
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks, keep_last=2, keep_best_metric="reward/mean")
    assert service.trainer is not None
    # reward/mean per step: 0.5, 1.5 (the best), 0.1, 0.2, 0.3
    for index, top in enumerate((1.0, 3.0, 0.2, 0.4, 0.6), 1):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (top, 0.0))], lease_expires_at=0))
        await service.train_once()
    assert service.steps == [2, 4, 5]
    assert sorted(service.engine.adapters) == ["agent@2", "agent@4", "agent@5"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["step-2", "step-4", "step-5"]
    assert service.served_models() == ["base-model", "agent@2", "agent@4", "agent@5", "agent@latest"]
    status = await service.status()
    assert status.checkpoints == [2, 4, 5] and status.counters["checkpoints_deleted"] == 2
    saved = lora_params(service.trainer)
    optimizer_state = service.trainer.optimizer.state_dict()["state"]
    await service.aclose()

    restarted = make_service(tmp_path, [], [], keep_last=2, keep_best_metric="reward/mean")
    assert restarted.trainer is not None and restarted.trainer.step_count == 5
    assert sorted(restarted.engine.adapters) == ["agent@2", "agent@4", "agent@5"]
    assert restarted.resolve("agent@latest") == "agent@5"
    assert all(torch.equal(saved[n], p) for n, p in lora_params(restarted.trainer).items())
    restored = restarted.trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(optimizer_state[k]["exp_avg"], restored[k]["exp_avg"]) for k in optimizer_state)
    await restarted.aclose()


async def test_retention_stops_serving_before_it_deletes_and_counts_a_failed_delete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], keep_last=1)
    assert service.trainer is not None
    listed: list[list[str]] = []

    def delete_fails(step: int) -> None:
        listed.append([service.resolve(name) for name in service.served_models()])  # GET /v1/models meanwhile
        raise PermissionError(errno.EACCES, "Permission denied", str(service.store.path(step)))

    monkeypatch.setattr(service.store, "delete", delete_fails)
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        await service.train_once()  # the failed delete does not fail the step
    assert listed == [["base-model", "agent@2", "agent@2"]]  # step 1 was no longer listed while it was deleted
    assert service.steps == [2] and sorted(service.engine.adapters) == ["agent@2"]
    status = await service.status()
    assert status.counters["retention_errors"] == 1 and "checkpoints_deleted" not in status.counters
    assert status.last_error is None
    await service.aclose()


async def test_a_checkpoint_folder_deleted_by_hand_is_not_the_best_and_fails_no_step(tmp_path: Path) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], keep_last=2, keep_best_metric="reward/mean")
    assert service.trainer is not None
    for index, top in enumerate((1.0, 3.0, 0.2), 1):  # step 2 is the best
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (top, 0.0))], lease_expires_at=0))
        await service.train_once()
    shutil.rmtree(tmp_path / "checkpoints" / "step-2")  # disk space freed by hand while the service runs
    batches.append(Batch(id="b4", groups=[group(service.trainer, (0.4, 0.0))], lease_expires_at=0))
    result = await service.train_once()  # served, and reported as such
    assert result.step == 4 and service.steps == [3, 4] and sorted(service.engine.adapters) == ["agent@3", "agent@4"]
    assert service.counters["retention_errors"] >= 1
    await service.aclose()


@pytest.mark.parametrize("damage", ["nested too deep", "metric too large for a float"])
async def test_a_manifest_damaged_while_the_service_runs_fails_no_step_and_retention_goes_on(
        tmp_path: Path, damage: str) -> None:
    """Each was a traceback in every later step's retention (RecursionError, OverflowError): the steps answered 500
    though served, and no checkpoint was deleted any more."""
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], keep_last=1, keep_best_metric="reward/mean")
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()
    manifest = tmp_path / "checkpoints" / "step-1" / "manifest.json"
    if damage == "nested too deep":
        manifest.write_text("[" * 100_000)
    else:
        recorded = json.loads(manifest.read_text())
        recorded["metrics"]["reward/mean"] = 10**400
        manifest.write_text(json.dumps(recorded))
    for index in (2, 3):  # equal rewards: the newest is the best
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        assert (await service.train_once()).step == index
    assert service.steps == [3] and sorted(service.engine.adapters) == ["agent@3"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["step-3"]
    assert service.counters["retention_errors"] == 1  # step 1's metric, read once: it could not be the best
    await service.aclose()


async def test_a_delete_that_fails_halfway_says_what_is_left_and_the_next_start_removes_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], keep_last=1)
    assert service.trainer is not None

    def rmtree_fails_halfway(path: Path) -> None:  # the manifest is gone already; one file will not go
        (path / "adapter_config.json").unlink()
        raise PermissionError(errno.EACCES, "Permission denied", str(path / "adapter_model.safetensors"))

    monkeypatch.setattr("trainer_service.checkpoints.shutil.rmtree", rmtree_fails_halfway)
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        await service.train_once()
    assert service.steps == [2] and service.counters["retention_errors"] == 1
    assert "the next start tries again" not in caplog.text  # its manifest is gone: no checkpoint
    assert "agent@1 is no longer served; its folder" in caplog.text
    assert "was deleted in part: the rest is removed at the next start" in caplog.text
    await service.aclose()
    monkeypatch.undo()  # the permission problem is fixed before the restart

    restarted = make_service(tmp_path, [], [], keep_last=1)
    assert restarted.steps == [2] and sorted(restarted.engine.adapters) == ["agent@2"]
    assert not (tmp_path / "checkpoints" / "step-1").exists()
    await restarted.aclose()


async def test_a_delete_that_removes_nothing_says_the_next_start_deletes_the_checkpoint_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], keep_last=1)
    assert service.trainer is not None

    unlink = Path.unlink

    def unlink_fails(self: Path, missing_ok: bool = False) -> None:
        if self == tmp_path / "checkpoints" / "step-1" / "manifest.json":  # it stays: step-1 is still a checkpoint
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink_fails)
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        await service.train_once()
    monkeypatch.undo()
    assert service.steps == [2] and (tmp_path / "checkpoints" / "step-1" / "manifest.json").exists()
    assert "agent@1 is no longer served; its folder" in caplog.text
    assert "could not be deleted: the next start tries again" in caplog.text
    await service.aclose()

    restarted = make_service(tmp_path, [], [], keep_last=1)
    assert restarted.steps == [2] and not (tmp_path / "checkpoints" / "step-1").exists()  # never served again
    await restarted.aclose()


async def test_a_restart_with_a_smaller_keep_last_drops_the_old_steps_before_loading_them_but_the_promoted_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])  # every checkpoint kept
    assert service.trainer is not None
    for index in (1, 2, 3, 4):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        await service.train_once()
    await service.aclose()
    service.store.write_promotion({"latest": 2, "evals": {2: 0.9, 3: 0.1}, "prompt_set": None, "decision": None})
    loaded: list[str] = []
    load_adapter = FakeEngine.load_adapter

    def recorded_load(engine: FakeEngine, name: str, path: str | Path) -> None:
        loaded.append(name)
        load_adapter(engine, name, path)

    async def no_rows() -> list[dict[str, Any]]:
        return []

    monkeypatch.setattr(FakeEngine, "load_adapter", recorded_load)
    gated = Evaluator(no_rows, lambda row, completion: 0.0, "http://engine")  # the saved promoted step counts
    restarted = make_service(tmp_path, [], [], evaluator=gated, keep_last=1)
    assert loaded == ["agent@2", "agent@4"] and restarted.steps == [2, 4]  # steps 1 and 3 were never loaded
    assert restarted.served_models() == ["base-model", "agent@2", "agent@4", "agent@latest"]
    assert restarted.resolve("agent@latest") == "agent@2"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["step-2", "step-4"]
    assert restarted.counters["checkpoints_deleted"] == 2
    assert restarted.trainer is not None and restarted.trainer.step_count == 4  # resumed from the newest
    status = await restarted.status()
    # step 3's reward was shown (and counted) until the next step, its checkpoint deleted at start
    assert status.eval_rewards == {2: 0.9} and status.eval_reward_count == 1
    saved = json.loads((tmp_path / "checkpoints" / "promotion.json").read_text())
    assert saved["evals"] == {"2": 0.9} and saved["latest"] == 2  # held step 3's until the next step's gate
    await restarted.aclose()



async def test_an_sft_step_written_before_reward_chosen_mean_is_not_the_best_by_reward_mean(tmp_path: Path) -> None:
    """An SFT step's `reward/mean` was its chosen (best) trajectories' before `reward/chosen_mean` was recorded: such a
    manifest, read after a resume, won `--keep-best-metric reward/mean` over better GRPO steps and was kept for good."""
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])  # every checkpoint kept
    assert service.trainer is not None
    for index, top in enumerate((1.0, 3.0, 2.0), 1):  # reward/mean 0.5, 1.5, 1.0
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (top, 0.0))], lease_expires_at=0))
        await service.train_once()
    settings = service.settings.model_copy(update={"keep_last": 1, "keep_best_metric": "reward/mean"})
    retention = Retention(settings, service.store, service.engine, service.gate, service.model_name, Counter())
    manifest_path = tmp_path / "checkpoints" / "step-1" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["metrics"] |= {"kind/sft": 1.0, "reward/mean": 9.0}  # an old warm start: the best trajectories' mean
    manifest_path.write_text(json.dumps(manifest))
    assert retention.drops([1, 2, 3]) == [1]  # the best GRPO step (2) and the newest are kept
    manifest["metrics"]["reward/chosen_mean"] = 9.0  # recorded since: reward/mean means what a GRPO step's does
    manifest_path.write_text(json.dumps(manifest))
    assert retention.drops([1, 2, 3]) == [2]
    await service.aclose()
