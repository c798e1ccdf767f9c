"""`LoRATrainer`: one GRPO step at a time on a PEFT LoRA adapter over a causal LM.

The pipeline of `step` follows the algorithm: select groups with a reward spread → advantages
→ per-token log-probs (one forward per sequence, no padding) → policy loss → clip → AdamW.
The maths live in `trainer_service.grpo`; this module only orchestrates and keeps state.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from collector.protocol import Group
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer_service.config import GRPOConfig
from trainer_service.grpo import group_advantages, policy_loss, token_logprobs, trajectory_token_weights

__all__ = ["MANIFEST", "NothingTrainableError", "LoRATrainer"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
"""Name of the checkpoint manifest written next to the adapter."""
_OPTIMIZER = "optimizer.pt"


class NothingTrainableError(ValueError):
    """No group of the batch carries a training signal."""


@dataclass
class _Item:
    """One sequence ready for the loss."""

    token_ids: torch.Tensor
    old_logprobs: torch.Tensor
    mask: torch.Tensor
    advantage: float
    weight: float


class LoRATrainer:
    """Trains a LoRA adapter with GRPO, one `step(groups)` at a time.

    Args:
        model: the base causal LM (loaded; LoRA is added here).
        config: GRPO hyper-parameters.
        base_model: name recorded in checkpoint manifests.
    """

    def __init__(self, model: PreTrainedModel, config: GRPOConfig, base_model: str = "") -> None:
        self.config = config
        self.base_model = base_model or str(getattr(model.config, "name_or_path", ""))
        self.device = next(model.parameters()).device
        checkpointing = config.gradient_checkpointing
        if checkpointing is None:
            checkpointing = self.device.type == "cuda"
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.target_modules),
            task_type="CAUSAL_LM",
            bias="none",
        )
        self.model: PeftModel = get_peft_model(model, lora)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.step_count = 0
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def load(cls, path: str, config: GRPOConfig, base_model: str = "") -> LoRATrainer:
        """Load the base model from `path` and wrap it.

        fp32 on a CPU (the engine serves fp32 too, so logprobs agree); bf16 with gradient
        checkpointing when CUDA is present.
        """
        if torch.cuda.is_available():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cls(model, config, base_model=base_model or path)

    # --- step ---------------------------------------------------------------------------

    def step(self, groups: Iterable[Group]) -> dict[str, float]:
        """Run one GRPO step on `groups` and return its metrics (slash keys).

        Raises:
            NothingTrainableError: no group has two rewarded trajectories with different rewards
                and assistant tokens; the message counts why each group was skipped.
        """
        started = time.perf_counter()
        items, stats = self._prepare(list(groups))
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = tokens = clipped = ratio_sum = 0.0
        pending: list[torch.Tensor] = []
        for index, item in enumerate(items):
            logits = self.model(input_ids=item.token_ids.unsqueeze(0)).logits[0]
            new = token_logprobs(logits, item.token_ids)
            out = policy_loss(
                cfg.loss,
                new,
                item.old_logprobs,
                item.advantage,
                item.mask,
                item.weight,
                epsilon=cfg.epsilon,
                epsilon_high=cfg.upper_epsilon,
            )
            pending.append(out.loss)
            loss_sum += float(out.loss.detach())
            tokens += out.tokens
            clipped += out.clipped_tokens
            ratio_sum += out.ratio_sum
            if len(pending) == cfg.micro_batch_size or index == len(items) - 1:
                torch.stack(pending).sum().backward()
                pending = []
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        elapsed = time.perf_counter() - started
        all_tokens = sum(int(item.token_ids.numel()) for item in items)
        metrics = {
            "step": float(self.step_count),
            "loss/policy": loss_sum,
            "loss/clip_fraction": clipped / tokens,
            "loss/ratio_mean": ratio_sum / tokens,
            "grad/norm": grad_norm,
            "optim/lr": float(self.optimizer.param_groups[0]["lr"]),
            "data/sequences": float(len(items)),
            "data/tokens": float(all_tokens),
            "data/assistant_tokens": tokens,
            "time/step_s": elapsed,
            "time/tokens_per_s": all_tokens / elapsed if elapsed > 0 else 0.0,
            **stats,
        }
        self.last_metrics = metrics
        return metrics

    def _prepare(self, groups: list[Group]) -> tuple[list[_Item], dict[str, float]]:
        """Select trainable groups and turn their sequences into tensors with advantages."""
        cfg = self.config
        skipped: Counter[str] = Counter()
        rewards_seen: list[float] = []
        per_traj: list[tuple[float, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = []
        truncated = missing_logprobs = trained_groups = 0
        for group in groups:
            rewarded = [t for t in group.trajectories if t.reward is not None]
            if len(rewarded) < len(group.trajectories):
                skipped["unrewarded_trajectories"] += len(group.trajectories) - len(rewarded)
            if len(rewarded) < 2:
                skipped["too_few_trajectories"] += 1
                continue
            rewards = torch.tensor([float(t.reward) for t in rewarded])  # type: ignore[arg-type]
            if float(rewards.max() - rewards.min()) == 0.0:
                skipped["no_reward_spread"] += 1
                continue
            advantages = group_advantages(rewards, scale=cfg.scale_rewards)
            group_items: list[tuple[float, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = []
            for trajectory, advantage in zip(rewarded, advantages.tolist(), strict=True):
                seqs = []
                for seq in trajectory.sequences:
                    n = len(seq.token_ids)
                    if not (len(seq.logprobs) == len(seq.assistant_mask) == n):
                        raise ValueError(
                            f"trajectory {trajectory.id}: token_ids ({n}), logprobs ({len(seq.logprobs)}) and "
                            f"assistant_mask ({len(seq.assistant_mask)}) must have the same length"
                        )
                    if n > cfg.max_seq_len:
                        truncated += 1
                        n = cfg.max_seq_len
                    ids = torch.tensor(seq.token_ids[:n], dtype=torch.long)
                    mask = torch.tensor(seq.assistant_mask[1:n], dtype=torch.float32)
                    old_values = seq.logprobs[1:n]
                    missing = [m > 0 and lp is None for lp, m in zip(old_values, mask.tolist(), strict=True)]
                    if any(missing):
                        # Without the engine's logprob the ratio is unknown; train those tokens on-policy.
                        missing_logprobs += sum(missing)
                    old = torch.tensor([float("nan") if lp is None else lp for lp in old_values])
                    if int(mask.sum()) > 0:
                        seqs.append((ids, old, mask))
                if seqs:
                    group_items.append((advantage, seqs))
                else:
                    skipped["no_assistant_tokens"] += 1
            if len(group_items) < 2:
                skipped["too_few_trajectories"] += 1
                continue
            rewards_seen.extend(rewards.tolist())
            per_traj.extend(group_items)
            trained_groups += 1
        if not per_traj:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "no groups given"
            raise NothingTrainableError(
                f"nothing to train in {len(groups)} group(s): {reasons}. A group needs at least two rewarded "
                "trajectories with different rewards and assistant tokens."
            )
        counts = [sum(int(m.sum()) for _, _, m in seqs) for _, seqs in per_traj]
        weights = trajectory_token_weights(counts)
        items = []
        for (advantage, seqs), weight in zip(per_traj, weights, strict=True):
            for ids, old, mask in seqs:
                items.append(_Item(ids.to(self.device), old.to(self.device), mask.to(self.device), advantage, weight))
        rewards_t = torch.tensor(rewards_seen)
        stats = {
            "data/groups": float(len(groups)),
            "data/groups_trained": float(trained_groups),
            "data/trajectories": float(len(per_traj)),
            "data/truncated_sequences": float(truncated),
            "data/missing_logprobs": float(missing_logprobs),
            "reward/mean": float(rewards_t.mean()),
            "reward/std": float(rewards_t.std(correction=0)),
            **{f"data/skipped/{k}": float(v) for k, v in sorted(skipped.items())},
        }
        return items, stats

    # --- checkpoints --------------------------------------------------------------------

    def save(self, path: str | Path, *, batch_id: str | None = None, metrics: dict[str, float] | None = None) -> Path:
        """Write the adapter, optimizer state and `manifest.json` to `path`, atomically.

        Everything goes to a temporary sibling folder first, which is renamed to `path`, so a
        crash never leaves a half-written checkpoint under the final name.

        Raises:
            FileExistsError: `path` exists already.
        """
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"checkpoint {path} exists already; remove it or choose another step folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            self.model.save_pretrained(tmp)
            torch.save(self.optimizer.state_dict(), tmp / _OPTIMIZER)
            manifest = {
                "step": self.step_count,
                "base_model": self.base_model,
                "config": self.config.to_dict(),
                "metrics": metrics if metrics is not None else self.last_metrics,
                "batch_id": batch_id,
                "created_at": time.time(),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def resume(self, path: str | Path) -> dict[str, Any]:
        """Load adapter weights, optimizer state and step from a checkpoint written by `save`.

        Returns:
            The checkpoint's manifest.
        """
        from safetensors.torch import load_file

        path = Path(path)
        manifest = json.loads((path / MANIFEST).read_text())
        state = load_file(str(path / "adapter_model.safetensors"), device=str(self.device))
        result = set_peft_model_state_dict(self.model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"checkpoint {path} does not match this adapter: unexpected keys {unexpected[:3]}...")
        optimizer_file = path / _OPTIMIZER
        if optimizer_file.is_file():
            self.optimizer.load_state_dict(torch.load(optimizer_file, map_location=self.device))
        self.step_count = int(manifest["step"])
        self.last_metrics = dict(manifest.get("metrics") or {})
        return manifest
