"""Builders shared by the trainer_service tests: the tiny Llama, its trainer and groups, a service on a fake engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import get_peft_model_state_dict
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from collector.protocol import AckResponse, Batch, Group, ReleaseResponse, Sequence, Trajectory
from trainer_service.config import TrainerSettings
from trainer_service.distributed import TrainLauncher
from trainer_service.engine import VLLMEngine
from trainer_service.evaluation import Evaluator
from trainer_service.grpo_config import GRPOConfig
from trainer_service.service import TrainerService
from trainer_service.training import LoRATrainer

PROMPT = [1, 104, 2003, 42, 7, 311]
GOOD = [900, 901, 902, 2]
BAD = [1500, 1501, 2]


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # the default --max-model-len: `check_base_model` refuses one past it
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def save_tiny_model(path: Path) -> Path:
    """Write `tiny_model()` and a one-word tokenizer to `path`: a folder `LoRATrainer.load` reads."""
    tiny_model().save_pretrained(path)
    word_level = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>").save_pretrained(path)
    return path


def make_trainer(**overrides: object) -> LoRATrainer:
    # float32: the tests compare steps to float rounding; bf16 has its own test
    config = GRPOConfig(**{"learning_rate": 5e-3, "train_dtype": "float32", **overrides})  # type: ignore[arg-type]
    return LoRATrainer(tiny_model(), config, base_model="tiny-llama")


def seq_logprobs(trainer: LoRATrainer, ids: list[int]) -> list[float]:
    """Current policy log-probs of `ids` (what an engine sampling this policy reports)."""
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([ids], device=trainer.device)).logits[0]
    targets = torch.tensor(ids[1:], device=trainer.device)
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, targets[:, None])[:, 0].tolist()


def trajectory(trainer: LoRATrainer, completion: list[int], reward: float | None, tid: str) -> Trajectory:
    ids = PROMPT + completion
    lps = seq_logprobs(trainer, ids)
    logprobs: list[float | None] = [None] * len(PROMPT) + lps[len(PROMPT) - 1 :]
    mask = [0] * len(PROMPT) + [1] * len(completion)
    return Trajectory(
        id=tid,
        trace_id="0" * 32,
        group_id="g",
        sequences=[Sequence(token_ids=ids, logprobs=logprobs, assistant_mask=mask)],
        reward=reward,
    )


def group(trainer: LoRATrainer, rewards: tuple[float | None, float | None], gid: str = "g") -> Group:
    return Group(
        id=gid,
        trajectories=[trajectory(trainer, GOOD, rewards[0], f"{gid}-a"),
                      trajectory(trainer, BAD, rewards[1], f"{gid}-b")],
    )

def lora_params(trainer: LoRATrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def adapter_weights(trainer: LoRATrainer) -> dict[str, torch.Tensor]:
    """A copy of the adapter's weights (PEFT's state dict), in fp32 on the CPU."""
    state = get_peft_model_state_dict(trainer.model)
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def adapter_gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                before: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(norm of the difference between two adapters, norm of `want`'s move from `before`), over all their weights.

    Norms, not the largest element: AdamW moves each weight by about lr x sign(gradient), so a
    weight whose gradient is near 0 moves by what the order of float additions decides. Measured
    on a second GRPO step with KL, packed against one sequence per pass: largest element 2.6e-2 of
    the largest move, norm 2.9e-4 of the move's; a learning rate 1% higher gives 3.0e-2 and 1.0e-2.
    """
    assert got.keys() == want.keys()
    moved = sum(float((want[n] - before[n]).double().pow(2).sum()) for n in want) ** 0.5
    off = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want) ** 0.5
    return off, moved


def uneven_groups(trainer: LoRATrainer) -> list[Group]:
    """Three groups whose sequences differ in length, so packed rows mix lengths."""
    long_prompt = Group(id="g3", trajectories=[
        trajectory(trainer, GOOD + [903, 904, 905], 0.9, "g3-a"), trajectory(trainer, BAD[:1] + [2], 0.1, "g3-b")])
    return [group(trainer, (1.0, 0.0), "g1"), group(trainer, (0.2, 0.9), "g2"), long_prompt]


class FakeEngine:
    """Stands in for VLLMEngine: records loaded adapters."""

    served_name = "base-model"
    base_url = "http://fake"
    pid = None
    restarts = 0
    last_restart_reason = None
    next_restart_in = None
    pending_adapters: list[str] = []
    dtype = "float32"
    cpu_matmul_dtype = "float32"
    threads = None

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def healthy(self) -> bool:
        return True

    def ensure_running(self) -> bool:  # the service's watchdog calls it every 10 s
        return False

    def load_adapter(self, name: str, path: str | Path) -> None:
        self.adapters[name] = str(path)

    def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name)


class NoProcessVLLM(VLLMEngine):
    """The real engine (its lock, its adapter calls, its `stop`), with a `start` that runs no process: a test serves
    its port."""

    def start(self) -> None:
        pass


def make_service(tmp_path: Path, batches: list[Batch], acks: list[tuple[str, dict]], *,
                 evaluator: Evaluator | None = None, launcher: TrainLauncher | None = None,
                 trainer_factory: Callable[[], LoRATrainer] = make_trainer, ack_status: int = 200,
                 releases: list[tuple[str, dict]] | None = None, release_status: int = 200,
                 **settings_overrides: Any) -> TrainerService:
    """A service on the tiny Llama with a scripted collector (its published HTTP API, in process).

    The collector answers acks with `ack_status` (recorded in `acks` either way), and releases with
    `release_status` (recorded in `releases`; a 200 says group `g` is back in the pool).
    """
    releases = [] if releases is None else releases

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/release"):
            batch_id = request.url.path.split("/")[3]
            releases.append((batch_id, json.loads(request.content)))
            released = ReleaseResponse(batch_id=batch_id, returned=["g"], skipped=[], max_failed_attempts=3)
            return httpx.Response(release_status, json=released.model_dump())
        if request.url.path == "/v1/batches":
            batch = batches.pop(0) if batches else Batch(id="none", groups=[], lease_expires_at=0)
            return httpx.Response(200, json=batch.model_dump())
        if request.url.path == "/v1/groups":  # the trainer asks for the ready ones only, not the whole history
            if request.url.params.get_list("state") != ["ready"]:
                return httpx.Response(400, json={"error": {"message": "expected ?state=ready"}})
            ready = [{"id": g.id, "task": None, "size": 2, "expected": 2, "complete": 2, "rewarded": 2,
                      "state": "ready"}
                     for b in batches for g in b.groups]
            return httpx.Response(200, json=ready)
        batch_id, body = request.url.path.split("/")[3], json.loads(request.content)
        acks.append((batch_id, body))
        acked = AckResponse(batch_id=batch_id, groups=["g"], policy_step=body["policy_step"])
        return httpx.Response(ack_status, json=acked.model_dump())

    settings = TrainerSettings(**{"output_dir": tmp_path, "name": "agent", "wandb": "off", "base_model": "tiny-llama",
                                  **settings_overrides})
    service = TrainerService(settings, GRPOConfig(), FakeEngine(), trainer_factory,  # type: ignore[arg-type]
                             collector_transport=httpx.MockTransport(handle), evaluator=evaluator, launcher=launcher)
    service.start()
    return service
