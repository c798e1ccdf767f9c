"""The trainer's CUDA path on the tiny random Llama: bf16 weights, fp32 adapter, gradient
checkpointing, checkpoints that move between devices, and steps in NCCL workers.

CI has no GPU, so these are skipped there; on a GPU machine run
`pytest --noconftest tests/trainer_service/test_cuda.py` (no vLLM needed). bf16 rounds the
base model's activations, so where the CPU tests compare exactly these compare against the
size of the update.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from collector.protocol import Batch
from tests.trainer_service.builders import (
    BAD,
    GOOD,
    PROMPT,
    adapter_gap,
    adapter_weights,
    group,
    save_tiny_model,
    seq_logprobs,
    uneven_groups,
)
from trainer_service.distributed import TrainLauncher
from trainer_service.grpo_config import GRPOConfig
from trainer_service.training import LoRATrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def load(base_dir: Path, **overrides: object) -> LoRATrainer:
    return LoRATrainer.load(str(base_dir), GRPOConfig(**{"learning_rate": 2e-3, **overrides}))  # type: ignore[arg-type]



def completion_logprob(trainer: LoRATrainer, completion: list[int]) -> float:
    return sum(seq_logprobs(trainer, PROMPT + completion)[len(PROMPT) - 1 :])


def test_load_puts_bf16_weights_and_an_fp32_adapter_on_the_gpu(base_dir: Path) -> None:
    trainer = load(base_dir)
    assert trainer.device.type == "cuda"
    base = {p.dtype for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora = {p.dtype for n, p in trainer.model.named_parameters() if "lora_" in n}
    # bf16 base; PEFT keeps the adapter in fp32 so AdamW's small updates are not rounded away
    assert base == {torch.bfloat16} and lora == {torch.float32}
    assert trainer.model.base_model.model.is_gradient_checkpointing
    assert not load(base_dir, gradient_checkpointing=False).model.base_model.model.is_gradient_checkpointing


def test_steps_are_on_policy_and_learn_on_the_gpu(base_dir: Path) -> None:
    trainer = load(base_dir)
    good0, bad0 = completion_logprob(trainer, GOOD), completion_logprob(trainer, BAD)
    for _ in range(4):
        metrics = trainer.step([group(trainer, (1.0, 0.0))])  # logprobs from the policy itself
        # the step's forward (checkpointed, logits at assistant positions only) vs a plain eval
        # forward of the same bf16 weights
        assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=5e-2)
    assert torch.isfinite(torch.tensor(metrics["grad/norm"])) and metrics["grad/norm"] > 0
    good1, bad1 = completion_logprob(trainer, GOOD), completion_logprob(trainer, BAD)
    assert good1 > good0 + 0.5, (good0, good1)
    assert bad1 < bad0 - 0.5, (bad0, bad1)


def test_gradient_checkpointing_takes_the_same_step(base_dir: Path) -> None:
    plain, checkpointed = load(base_dir, gradient_checkpointing=False), load(base_dir, gradient_checkpointing=True)
    checkpointed.restore(plain.snapshot())  # the same LoRA initialisation
    groups = uneven_groups(plain)
    before = adapter_weights(plain)
    want = plain.step(groups)
    got = checkpointed.step(groups)
    off, moved = adapter_gap(adapter_weights(checkpointed), adapter_weights(plain), before)
    assert moved > 1e-4 and off < 1e-2 * moved, (off, moved)  # measured: identical
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-2, abs=1e-4)


def test_packed_micro_batches_take_the_one_sequence_step_on_the_gpu(base_dir: Path) -> None:
    packed, alone = load(base_dir, micro_batch_size=4), load(base_dir, micro_batch_size=1)
    assert packed.packs  # sdpa on CUDA keeps packed sequences apart
    packed.restore(alone.snapshot())
    groups = uneven_groups(alone)
    before = adapter_weights(alone)
    want, got = alone.step(groups), packed.step(groups)
    off, moved = adapter_gap(adapter_weights(packed), adapter_weights(alone), before)
    assert moved > 1e-4 and off < 0.1 * moved, (off, moved)  # bf16: other kernels, other rounding
    assert got["loss/ratio_mean"] == pytest.approx(want["loss/ratio_mean"], abs=2e-2)


def test_checkpoints_resume_on_the_gpu_and_on_the_cpu(base_dir: Path, tmp_path: Path) -> None:
    trainer = load(base_dir)
    trainer.sft_step([group(trainer, (1.0, 0.0))])
    trainer.step([group(trainer, (1.0, 0.0))])
    path = trainer.save(tmp_path / "step-2")

    on_gpu = load(base_dir)
    on_gpu.resume(path)
    state = next(iter(on_gpu.optimizer.state.values()))
    assert on_gpu.step_count == 2 and state["exp_avg"].device.type == "cuda"
    saved = adapter_weights(trainer)
    assert all(torch.equal(saved[n], v) for n, v in adapter_weights(on_gpu).items())

    # the service's copy when workers train: on the CPU, in bf16 like the workers
    on_cpu = LoRATrainer.load(str(base_dir), GRPOConfig(), device="cpu")
    on_cpu.resume(path)
    assert on_cpu.device.type == "cpu" and on_cpu.step_count == 2
    assert all(torch.equal(saved[n], v) for n, v in adapter_weights(on_cpu).items())


class _OneRankLauncher(TrainLauncher):
    """The service needs 2+ workers (1 trains in process); with one GPU, run the same worker
    code as a world of one over NCCL."""

    def __post_init__(self) -> None:
        pass


def test_nccl_workers_take_the_in_process_step(base_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # the workers' log then shows the NCCL communicator
    gpus = torch.cuda.device_count()
    launcher_type = TrainLauncher if gpus >= 2 else _OneRankLauncher
    launcher = launcher_type(gpus, str(base_dir), tmp_path / "train_workers.log")
    reference = load(base_dir, kl_coef=0.05, micro_batch_size=2)
    service_copy = LoRATrainer.load(str(base_dir), reference.config, device="cpu")
    reference.restore(service_copy.snapshot())  # the workers start from the service's adapter
    groups = [group(reference, rewards, f"g{i}") for i, rewards in enumerate(((1.0, 0.0), (0.2, 0.9), (0.0, 0.5)))]
    before = adapter_weights(reference)
    expected = reference.step(groups)

    metrics = launcher.step(service_copy, Batch(id="b1", groups=groups, lease_expires_at=0), "grpo",
                            tmp_path / "checkpoints" / "step-1")

    assert "NCCL INFO" in (tmp_path / "train_workers.log").read_text()
    assert (tmp_path / "checkpoints" / "step-1" / "manifest.json").is_file()
    assert service_copy.step_count == 1 and metrics["time/workers_s"] > 0
    off, moved = adapter_gap(adapter_weights(service_copy), adapter_weights(reference), before)
    assert moved > 1e-4 and off < 1e-2 * moved, (off, moved)
    for key in ("loss/policy", "loss/kl", "data/assistant_tokens"):
        assert metrics[key] == pytest.approx(expected[key], rel=2e-2, abs=1e-4), key
