"""TrainerService without vLLM: a fake engine, the tiny Llama trainer and a mock collector."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from collector.protocol import Batch
from tests.collector.seeding import group_spans, make_app
from tests.trainer_service.builders import FakeEngine, NoProcessVLLM, group, lora_params, make_service, make_trainer
from trainer_service.config import TrainerSettings
from trainer_service.engine_errors import EngineError
from trainer_service.grpo_config import GRPOConfig
from trainer_service.protocol import ServiceError, StatusResponse
from trainer_service.service import TrainerService
from trainer_service.training import LoRATrainer, NonFiniteStepError


async def test_train_once_publishes_and_names_models(tmp_path: Path) -> None:
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.resolve("agent@latest") == "base-model" and service.resolve("agent") == "base-model"
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 409 and info.value.body.error.code == "no_batch_ready"

    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    result = await service.train_once()
    assert result.model == "agent@1" and acks == [("b1", {"policy_step": 1})]
    assert service.resolve("agent@latest") == "agent@1"
    assert service.served_models() == ["base-model", "agent@1", "agent@latest"]
    with pytest.raises(ServiceError) as info:
        service.resolve("other")
    assert info.value.status == 404 and info.value.body.error.param == "model"
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["batch_id"] == "b1" and "loss/policy" in line
    status = await service.status()
    assert status.step == 1 and status.latest_model == "agent@1" and status.last_metrics["step"] == 1
    await service.aclose()

    # A restarted service resumes: checkpoints are re-served and the step count continues.
    restarted = make_service(tmp_path, [], [])
    assert restarted.served_models() == ["base-model", "agent@1", "agent@latest"]
    assert restarted.trainer is not None and restarted.trainer.step_count == 1
    await restarted.aclose()


async def test_an_unknown_model_names_the_newest_steps_not_thousands(tmp_path: Path) -> None:
    service = make_service(tmp_path, [], [])
    service.steps = [1, 2]
    with pytest.raises(ServiceError) as info:
        service.resolve("agent@0")
    assert info.value.body.error.message.endswith("Available: base-model, agent@latest, agent@1, agent@2.")
    service.steps = list(range(1, 3001))  # a run keeping every checkpoint
    with pytest.raises(ServiceError) as info:
        service.resolve("agent@0")
    assert info.value.body.error.message.endswith(
        "Available: base-model, agent@latest, agent@2996, agent@2997, agent@2998, agent@2999, agent@3000, "
        "... (2995 more; GET /v1/models lists them).")
    await service.aclose()


async def test_status_names_the_newest_steps_and_counts_them_all(tmp_path: Path) -> None:
    service = make_service(tmp_path, [], [])
    service.steps = list(range(1, 3001))  # a run keeping every checkpoint: its status named all 3002 models
    status = await service.status()
    assert status.models == ["base-model", *(f"agent@{step}" for step in range(2996, 3001)), "agent@latest"]
    assert status.checkpoints == list(range(2996, 3001)) and status.checkpoint_count == 3000
    service.steps = [1, 2]
    status = await service.status()
    assert status.models == service.served_models() and status.checkpoints == [1, 2] and status.checkpoint_count == 2
    await service.aclose()


async def test_status_shows_the_newest_eval_rewards_and_the_baseline_and_counts_them_all(tmp_path: Path) -> None:
    service = make_service(tmp_path, [], [])
    service.steps = list(range(1, 3001))
    service.gate.evals = {0: 0.5, **{step: step / 3000 for step in service.steps}}  # one per evaluated step
    service.gate.latest = 7  # the promoted step: later ones were kept but not promoted
    status = await service.status()
    assert status.eval_rewards == {step: step / 3000 for step in (7, 2996, 2997, 2998, 2999, 3000)}
    assert status.eval_reward_count == 3001
    service.gate.evals, service.gate.latest = {0: 0.5, 1: 0.6}, None
    status = await service.status()
    assert status.eval_rewards == {0: 0.5, 1: 0.6} and status.eval_reward_count == 2
    await service.aclose()


async def test_a_checkpoint_being_reloaded_is_503_not_404(tmp_path: Path) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    await service.train_once()
    service.engine.pending_adapters = list(service.engine.adapters)  # as during a restart of vLLM
    service.engine.adapters.clear()
    for model in ("agent@1", "agent@latest", "agent"):
        with pytest.raises(ServiceError) as info:
            service.resolve(model)
        assert info.value.status == 503 and info.value.body.error.code == "adapter_loading", model
        assert info.value.body.error.type == "server_error" and "agent@1" in info.value.body.error.message
    assert service.resolve("base-model") == "base-model"
    with pytest.raises(ServiceError) as info:
        service.resolve("agent@2")
    assert info.value.status == 404
    await service.aclose()


async def test_nothing_trainable_is_422_and_acked(tmp_path: Path) -> None:
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.trainer is not None
    batches.append(Batch(id="flat", groups=[group(service.trainer, (0.5, 0.5))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 422 and "no_reward_spread=1" in info.value.body.error.message
    assert acks == [("flat", {"policy_step": None})]
    assert service.steps == [] and service.last_error is not None
    await service.aclose()


async def test_failed_ack_still_gates_retains_and_records_the_step(tmp_path: Path) -> None:
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks, ack_status=500, keep_last=1)
    assert service.trainer is not None
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        with pytest.raises(ServiceError) as info:
            await service.train_once()
        assert info.value.status == 502 and info.value.body.error.code == "ack_failed"
        assert f"step {index} is saved and served" in info.value.body.error.message
    # The steps were served, so the gate, retention and metrics ran as for an acked step.
    assert acks == [("b1", {"policy_step": 1}), ("b2", {"policy_step": 2})]
    assert service.resolve("agent@latest") == "agent@2" and service.steps == [2]
    assert sorted(service.engine.adapters) == ["agent@2"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and all(line["collector/ack_failed"] == 1.0 for line in lines)
    status = await service.status()
    assert status.last_metrics["step"] == 2 and status.counters["ack_failures"] == 2
    assert status.last_error is not None and "ack of batch b2" in status.last_error
    await service.aclose()


async def test_a_restart_after_a_step_whose_metrics_line_was_never_written_shows_its_metrics(tmp_path: Path) -> None:
    """Killed between a step's checkpoint and its metrics line (e.g. while its promotion gate ran): status showed step
    2 beside step 1's metrics."""
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    for index in (1, 2):
        batches.append(Batch(id=f"b{index}", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        await service.train_once()
    await service.aclose()
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text(jsonl.read_text().splitlines(keepends=True)[0])  # step 2's line was never written
    restarted = make_service(tmp_path, [], [])
    status = await restarted.status()
    manifest = json.loads((tmp_path / "checkpoints" / "step-2" / "manifest.json").read_text())
    assert status.step == 2 and status.last_metrics["step"] == 2
    assert status.last_metrics["loss/policy"] == manifest["metrics"]["loss/policy"]
    await restarted.aclose()


def _nan_step(groups: Any, kind: str) -> dict[str, float]:
    raise NonFiniteStepError("loss is nan")


async def test_a_failed_step_releases_its_batch_and_the_next_step_gets_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = make_app(tmp_path, monkeypatch, max_failed_attempts=2)  # the real collector, in process
    collector.state.store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0]))
    settings = TrainerSettings(output_dir=tmp_path / "run", name="agent", wandb="off", base_model="tiny-llama")
    service = TrainerService(settings, GRPOConfig(), FakeEngine(), make_trainer,  # type: ignore[arg-type]
                             collector_transport=httpx.ASGITransport(app=collector))
    service.start()
    assert service.trainer is not None
    monkeypatch.setattr(service.trainer, "train", _nan_step)
    with pytest.raises(ServiceError) as first:
        await service.train_once()
    assert first.value.status == 500 and first.value.body.error.code == "training_failed"
    assert "loss is nan" in first.value.body.error.message
    assert "was released: groups sums are back in the collector's pool" in first.value.body.error.message
    [shown] = collector.state.store.groups()
    assert (shown.state, shown.failed_attempts) == ("ready", 1)  # counted: a training error is the data's
    [batch] = collector.state.store.batches()
    assert (batch.state, batch.reason) == ("released", "NonFiniteStepError: loss is nan")

    with pytest.raises(ServiceError) as second:  # leased again at once, not after the lease's 900 s
        await service.train_once()
    assert "reached the collector's limit of 2 failed attempts and are skipped" in second.value.body.error.message
    with pytest.raises(ServiceError) as third:
        await service.train_once()
    assert third.value.body.error.code == "no_batch_ready"
    # an empty queue is no failed step: status keeps the failure (an `--every` tick would have replaced it)
    assert service.last_error == second.value.body.error.message
    assert service.steps == [] and service.engine.adapters == {} and service.trainer.step_count == 0
    await service.aclose()


async def test_a_step_that_makes_the_adapter_non_finite_saves_and_serves_nothing(tmp_path: Path) -> None:
    releases: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], releases=releases)
    trainer = service.trainer
    assert trainer is not None
    before = lora_params(trainer)
    for param_group in trainer.optimizer.param_groups:  # an optimizer update that overflows
        param_group["lr"] = math.inf
    batches.append(Batch(id="b1", groups=[group(trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 500 and info.value.body.error.code == "training_failed"
    assert "NonFiniteStepError: step 1: the optimizer's step made adapter weights" in info.value.body.error.message
    assert [(batch_id, body["failed"]) for batch_id, body in releases] == [("b1", True)]
    assert service.steps == [] and service.engine.adapters == {} and not service.store.path(1).exists()
    assert trainer.step_count == 0 and all(torch.equal(before[n], p) for n, p in lora_params(trainer).items())
    await service.aclose()


async def test_a_failed_load_into_vllm_releases_without_counting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], releases=releases)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))

    def refuse(name: str, path: str | Path) -> None:
        raise EngineError("vLLM refused /v1/load_lora_adapter")

    monkeypatch.setattr(service.engine, "load_adapter", refuse)
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 500 and "Batch b1 was released" in info.value.body.error.message
    assert releases == [("b1", {"reason": "EngineError: vLLM refused /v1/load_lora_adapter", "failed": False})]
    assert service.steps == [] and list((tmp_path / "checkpoints").iterdir()) == []
    await service.aclose()


async def test_a_failed_load_whose_checkpoint_cannot_be_deleted_still_answers_the_engine_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))

    def refuse(name: str, path: str | Path) -> None:
        raise EngineError("vLLM refused /v1/load_lora_adapter")

    def cannot_delete(step: int) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(service.store.path(step)))

    monkeypatch.setattr(service.engine, "load_adapter", refuse)
    monkeypatch.setattr(service.store, "delete", cannot_delete)
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    # was a 507 saying the checkpoint "could not be written", from the cleanup's PermissionError
    assert info.value.status == 500 and "EngineError: vLLM refused" in info.value.body.error.message
    assert service.steps == [] and service.trainer.step_count == 0
    assert any(str(service.store.path(1)) in r.getMessage() and r.exc_info for r in caplog.records)
    await service.aclose()


async def test_a_step_failing_with_an_unexpected_error_still_releases_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], releases=releases)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))

    def missing_key(groups: Any, kind: str) -> dict[str, float]:
        raise KeyError("token_ids")

    monkeypatch.setattr(service.trainer, "train", missing_key)
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 500 and info.value.body.error.code == "training_failed"
    assert "Batch b1 was released" in info.value.body.error.message
    assert releases == [("b1", {"reason": "KeyError: 'token_ids'", "failed": True})]
    assert service.steps == [] and service.trainer.step_count == 0
    await service.aclose()


async def test_a_release_the_collector_refuses_is_counted_and_the_error_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [], releases=releases, release_status=500)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    monkeypatch.setattr(service.trainer, "train", _nan_step)
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    message = info.value.body.error.message
    assert info.value.status == 500 and info.value.body.error.code == "training_failed" and "loss is nan" in message
    assert "refused the release of batch b1: HTTP 500" in message and "its lease will expire" in message
    assert releases == [("b1", {"reason": "NonFiniteStepError: loss is nan", "failed": True})]
    assert (await service.status()).counters["release_failures"] == 1
    await service.aclose()


async def test_one_step_at_a_time(tmp_path: Path) -> None:
    service = make_service(tmp_path, [], [])
    async with service._lock:
        with pytest.raises(ServiceError) as info:
            await service.train_once()
    assert info.value.status == 409 and info.value.body.error.code == "training_in_progress"
    await service.aclose()


async def test_status_during_a_step_names_only_served_steps(tmp_path: Path) -> None:
    """A running step is not the status's `step` (nor its metrics) before it is served: this one is rolled back."""
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    trainer = service.trainer
    assert trainer is not None
    batches.append(Batch(id="b1", groups=[group(trainer, (1.0, 0.0))], lease_expires_at=0))
    saving, asked = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()

    def full_disk(path: Path, **kwargs: Any) -> Path:  # the optimizer has stepped; status is asked before the save
        loop.call_soon_threadsafe(saving.set)
        asked.wait(60)
        raise OSError(28, "No space left on device")

    trainer.save = full_disk  # type: ignore[method-assign]
    step = asyncio.create_task(service.train_once())
    await saving.wait()
    status = await service.status()
    asked.set()
    assert status.training and trainer.step_count == 1
    assert status.step == 0 and status.checkpoints == [] and status.last_metrics == {}
    with pytest.raises(ServiceError) as info:
        await step
    assert info.value.body.error.code == "checkpoint_write_failed" and (await service.status()).step == 0
    await service.aclose()


@pytest.mark.parametrize(("code", "fix"), [
    (errno.ENOSPC, "; free disk space."),
    (errno.EDQUOT, "; free disk space or raise the disk quota of the service's user."),
    (errno.EACCES, "; let the service's user write to {folder}."),
    (errno.EROFS, "; let the service's user write to {folder}."),
    (errno.EIO, "."),  # an error with no known fix: the writer's message names it
])
async def test_a_checkpoint_write_error_names_its_own_fix(tmp_path: Path, code: int, fix: str) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None

    def failing(path: Path, **kwargs: Any) -> Path:
        raise OSError(code, os.strerror(code))

    service.trainer.save = failing  # type: ignore[method-assign]
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    message = info.value.body.error.message
    assert info.value.status == 507 and os.strerror(code) in message
    assert f"and the trainer was rolled back{fix.format(folder=service.checkpoint_dir)} Batch b1" in message
    await service.aclose()


async def test_a_step_folder_left_behind_is_named_not_a_full_disk(tmp_path: Path) -> None:
    """A half-written `step-1` start-up could not remove (e.g. not ours to delete) stops step 1's save."""
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])
    assert service.trainer is not None
    (service.checkpoint_dir / "step-1").mkdir(parents=True)
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    message = info.value.body.error.message
    assert info.value.status == 507 and "exists already" in message and "disk space" not in message
    assert f"rolled back; remove {service.checkpoint_dir / 'step-1'} by hand." in message
    await service.aclose()


async def test_collector_down_is_502(tmp_path: Path) -> None:
    settings = TrainerSettings(output_dir=tmp_path, collector="http://127.0.0.1:9", wandb="off")
    service = TrainerService(settings, GRPOConfig(), FakeEngine(), make_trainer)  # type: ignore[arg-type]
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 503 and info.value.body.error.code == "not_ready"  # nothing leased before start
    service.start()
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 502 and "art-collector serve" in info.value.body.error.message
    status = await service.status()  # status still answers, and says why the queue is unknown
    assert status.queue_depth is None and status.queue_error and "did not answer" in status.queue_error
    await service.aclose()


async def test_watchdog_survives_any_error(tmp_path: Path) -> None:
    class Failing(FakeEngine):
        def ensure_running(self) -> bool:
            raise OSError("no more file descriptors")

    settings = TrainerSettings(output_dir=tmp_path, wandb="off")
    service = TrainerService(settings, GRPOConfig(), Failing(), make_trainer)  # type: ignore[arg-type]
    watchdog = asyncio.create_task(service.watch_engine(interval=0.01))
    await asyncio.sleep(0.2)
    assert not watchdog.done(), "the watchdog ended: vLLM would never be restarted again"
    assert service.counters["engine_supervision_errors"] >= 2
    watchdog.cancel()
    await service.aclose()


async def test_a_lease_answer_that_is_not_a_batch_is_a_502_naming_the_collector(tmp_path: Path) -> None:
    def collector(request: httpx.Request) -> httpx.Response:  # answers 200, but not with a batch
        return httpx.Response(200, json={"lease": "unexpected"})

    service = make_service(tmp_path, [], [])
    service.collector.http = httpx.AsyncClient(base_url="http://collector", transport=httpx.MockTransport(collector))
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 502 and info.value.body.error.code == "collector_error"
    assert "is not a batch" in info.value.body.error.message and service.last_error == info.value.body.error.message
    await service.aclose()


async def test_queue_depth_reads_only_ready_groups_and_names_a_malformed_answer(tmp_path: Path) -> None:
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, [])  # its collector refuses a /v1/groups without ?state=ready
    assert service.trainer is not None
    batches.append(Batch(id="b", groups=[group(service.trainer, (1.0, 0.0), "a")], lease_expires_at=0))
    assert (await service.status()).queue_depth == 1

    def malformed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"groups": "not a list"})

    service.collector.http = httpx.AsyncClient(base_url="http://collector", transport=httpx.MockTransport(malformed))
    status = await service.status()
    assert status.queue_depth is None and "did not answer with groups" in (status.queue_error or "")
    await service.aclose()


async def test_status_does_not_wait_for_a_collector_that_is_slow_to_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that took connections but did not answer held `GET /v1/status` for the collector's whole timeout
    (60 s); status now gives up on the queue depth and says why, as when the collector is down."""
    import trainer_service.service_status as status_module

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1.0)
        return httpx.Response(200, json=[])

    monkeypatch.setattr(status_module, "_STATUS_QUEUE_WAIT_S", 0.05)
    service = make_service(tmp_path, [], [])
    service.collector.http = httpx.AsyncClient(base_url="http://collector", transport=httpx.MockTransport(slow))
    status = await service.status()
    assert status.queue_depth is None
    assert status.queue_error == (f"The collector at {service.collector.shown_url} did not answer "
                                  "GET /v1/groups?state=ready within 0.05 s; the queue depth is unknown.")
    await service.aclose()


async def test_shutdown_lets_a_running_step_finish_and_starts_no_new_one(tmp_path: Path) -> None:
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks)
    assert service.trainer is not None
    batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
    stopped_after: list[list[tuple[str, dict]]] = []
    service.engine.stop = lambda: stopped_after.append(list(acks))  # type: ignore[method-assign]
    train_and_publish = service._train_and_publish

    def slow(*args: Any) -> Any:  # the step is still running when shutdown begins
        time.sleep(0.5)
        return train_and_publish(*args)

    service._train_and_publish = slow  # type: ignore[method-assign]
    step = asyncio.create_task(service.train_once())
    while not service._lock.locked():
        await asyncio.sleep(0.01)
    await service.aclose()
    assert (await step).step == 1 and (tmp_path / "checkpoints" / "step-1").is_dir()
    assert stopped_after == [[("b1", {"policy_step": 1})]]  # the engine stopped after the step was acked
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    with pytest.raises(ServiceError) as info:
        await service.train_once()
    assert info.value.status == 503 and info.value.body.error.code == "shutting_down"


def _hang(listener: socket.socket, asked: threading.Event) -> None:
    """A vLLM that takes a request and never answers: accept one connection of `listener`, set `asked` once an adapter
    load arrived on it, then read until the client leaves."""
    connection, _ = listener.accept()
    received = b""
    with connection:
        while chunk := connection.recv(4096):
            received += chunk
            if b"/v1/load_lora_adapter" in received:
                asked.set()


async def test_shutdown_gives_up_a_hot_load_vllm_never_answers_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """A step at its hot-load against a vLLM that accepts and never answers held `aclose` for the load's 120 s
    timeout (the engine's `stop` gives a load up, but only runs once the step is over); the step was then rolled back,
    its checkpoint deleted. Now the shutdown gives the load up: the checkpoint stays, unserved, acked, and the next
    start serves it."""
    acks: list[tuple[str, dict]] = []
    releases: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks, releases=releases)
    assert service.trainer is not None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        engine = NoProcessVLLM("tiny-llama", "base-model", listener.getsockname()[1], log_path=tmp_path / "vllm.log")
        service.engine = service.retention.engine = engine
        asked = threading.Event()
        threading.Thread(target=_hang, args=(listener, asked), daemon=True).start()
        batches.append(Batch(id="b1", groups=[group(service.trainer, (1.0, 0.0))], lease_expires_at=0))
        step = asyncio.create_task(service.train_once())
        assert await asyncio.to_thread(asked.wait, 60), "the step never asked vLLM to load its checkpoint"
        started = time.monotonic()
        await service.aclose()
        assert time.monotonic() - started < 10, "aclose waited for the hot-load's timeout"
    with pytest.raises(ServiceError) as info:
        await step
    message = info.value.body.error.message
    assert info.value.status == 503 and info.value.body.error.code == "shutting_down"
    assert message.startswith(f"Step 1 is saved in {tmp_path / 'checkpoints' / 'step-1'} and its batch b1 was acked, "
                              "but it is not served") and message.endswith("The next start serves it as agent@1.")
    assert service.steps == [] and engine.adapters == {} and service.resolve("agent@latest") == "base-model"
    assert acks == [("b1", {"policy_step": 1})] and releases == []  # trained into step 1: not to be trained again
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    restarted = make_service(tmp_path, [], [])
    assert restarted.served_models() == ["base-model", "agent@1", "agent@latest"]
    assert restarted.trainer is not None and restarted.trainer.step_count == 1
    await restarted.aclose()


async def test_status_while_the_service_stops_shows_no_step_and_asks_no_collector(tmp_path: Path) -> None:
    """`aclose` holds the step lock while it stops: status said `training: true` then, and raised RuntimeError (a
    500) once the collector's client was closed."""
    service = make_service(tmp_path, [], [])
    stopping, release = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()

    def slow_stop() -> None:  # vLLM takes seconds to stop; status is asked meanwhile
        loop.call_soon_threadsafe(stopping.set)
        release.wait(60)

    service.engine.stop = slow_stop  # type: ignore[method-assign]
    closing = asyncio.create_task(service.aclose())
    await stopping.wait()
    try:
        status = await service.status()
    finally:
        release.set()
        await closing
    assert not status.training and status.queue_depth is None
    assert status.queue_error == "The service is shutting down; the collector is not asked for the queue depth."
    assert "shutting down" in (StatusResponse.model_fields["queue_depth"].description or "")  # the schema says so


@pytest.mark.parametrize("warm_up", [True, False])
def test_start_warms_the_trainer_up_when_asked(tmp_path: Path, warm_up: bool) -> None:
    warmed: list[LoRATrainer] = []

    def factory() -> LoRATrainer:
        trainer = make_trainer()
        run = trainer.warm_up
        trainer.warm_up = lambda: warmed.append(trainer) or run()  # type: ignore[method-assign]
        return trainer

    service = make_service(tmp_path, [], [], trainer_factory=factory, warm_up=warm_up)
    assert warmed == ([service.trainer] if warm_up else [])
    assert service.trainer is not None and service.trainer.step_count == 0


def test_a_start_that_fails_after_vllm_started_stops_it(tmp_path: Path) -> None:
    class Engine(FakeEngine):
        running = False

        def start(self) -> None:
            self.running = True

        def stop(self) -> None:
            self.running = False

    def broken() -> LoRATrainer:
        raise MemoryError("the model does not fit")

    engine = Engine()
    settings = TrainerSettings(output_dir=tmp_path, wandb="off", base_model="tiny-llama")
    service = TrainerService(settings, GRPOConfig(), engine, broken)  # type: ignore[arg-type]
    with pytest.raises(MemoryError, match="does not fit"):
        service.start()
    assert not engine.running  # was left running, with its memory and port, behind a service that never started


async def test_a_client_that_fails_to_close_still_stops_the_engine(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine stopped last, after the clients and the metrics sink: one that raised left vLLM running."""
    service = make_service(tmp_path, [], [])
    stopped: list[bool] = []
    monkeypatch.setattr(service.engine, "stop", lambda timeout=30.0: stopped.append(True))

    async def refuse() -> None:
        raise RuntimeError("Event loop is closed")

    monkeypatch.setattr(service.collector, "aclose", refuse)
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        await service.aclose()
    assert stopped == [True]
