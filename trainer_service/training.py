"""`LoRATrainer`: one GRPO step at a time on a PEFT LoRA adapter over a causal LM.

The pipeline of `step` follows the algorithm: select groups with a reward spread and
advantages (`batching`) → per-token log-probs (the sequences of a micro-batch packed into
one row, no padding) → policy loss (+ KL to the adapter-free base) → clip → AdamW.
`sft_step` runs the same loop with a negative log-likelihood loss on the best trajectory of
each group, and no KL term (`kl_coef` weighs GRPO steps only). The maths live in
`trainer_service.grpo`; this module only orchestrates and keeps state.

Run under `torch.distributed` (see `trainer_service.distributed`), each rank trains its share of
the step's trajectories and the gradients are summed over the ranks before clipping, so every
rank takes the step a single process would take on the whole batch.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from collector.protocol import Group
from trainer_service.batching import (
    NothingTrainableError,
    PreparedBatch,
    TrainItem,
    micro_batches,
    prepare_grpo,
    prepare_sft,
    shard_items,
)
from trainer_service.checkpoint_folder import read_checkpoint, write_checkpoint
from trainer_service.grpo import PolicyLossOutput
from trainer_service.grpo_config import GRPOConfig
from trainer_service.lora_forward import fuse_lora_forward
from trainer_service.packed_attention import (
    PACKED_ATTENTION,
    UnsupportedAttentionError,
    packing_keeps_sequences_apart,
    prefix_sharing_works,
)
from trainer_service.packed_pass import grpo_pass_loss, pass_logprobs, sft_pass_loss

__all__ = [
    "NothingTrainableError",
    "LoRATrainer",
    "NonFiniteStepError",
]

logger = logging.getLogger(__name__)

_PREPARE = {"grpo": prepare_grpo, "sft": prepare_sft}
_MICRO_BATCH_TOKENS = {"cuda": 8192, "cpu": 4096}
"""Tokens per pass when `micro_batch_tokens` is None, by device type (see its help)."""


class NonFiniteStepError(RuntimeError):
    """A step's loss, gradient norm or updated adapter is not finite.

    When the loss or the gradient norm is, the optimizer did not step and the adapter is unchanged. When the
    optimizer's step made the adapter weights non-finite, they stay so in this trainer: the caller rolls back with
    `restore` (the service does for every failed step), and the step counter has not moved.
    """


class LoRATrainer:
    """Trains a LoRA adapter with GRPO, one `step(groups)` at a time.

    Args:
        model: the base causal LM (loaded; cast to `config.train_dtype`; LoRA is added here).
        config: GRPO hyper-parameters.
        base_model: name recorded in checkpoint manifests.
        tokenizer: the model's tokenizer, used to re-tokenize trajectories that are not
            token-exact (None: such trajectories are skipped and counted).
    """

    def __init__(self, model: PreTrainedModel, config: GRPOConfig, base_model: str = "",
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.base_model = base_model or str(getattr(model.config, "name_or_path", ""))
        self.device = next(model.parameters()).device
        model.to(config.torch_dtype())  # the base weights; LoRA's are added in fp32 below
        checkpointing = config.gradient_checkpointing
        if checkpointing is None:
            checkpointing = self.device.type == "cuda"
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        if self.device.type == "cpu":
            own = model.config._attn_implementation
            try:
                model.set_attn_implementation(PACKED_ATTENTION)  # per-sequence attention in a packed row
                packing_keeps_sequences_apart(model)  # a forward: refused for a sliding window, soft-cap or sinks
            except ValueError as exc:  # a model without transformers' attention interface, or one art_packed refuses
                if isinstance(exc, UnsupportedAttentionError):
                    model.set_attn_implementation(own)
                logger.warning("%s keeps its own attention (%s): packed rows use its position_ids mask and "
                               "prompts are not shared", type(model).__name__, exc)
        self.model: PeftModel = get_peft_model(model, config.lora_config())
        fuse_lora_forward(self.model)  # the LoRA delta in the base dtype, added by the matmul (see the module)
        self.packs = packing_keeps_sequences_apart(self.model)
        self.shares_prefixes = self.packs and prefix_sharing_works(self.model)  # `art_packed` does (on a CPU)
        if not self.packs:
            logger.warning("%s attends across sequences packed into one row: training one sequence per forward "
                           "instead (correct, slower on a GPU)", type(model).__name__)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.step_count = 0
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def load(cls, path: str, config: GRPOConfig, base_model: str = "", chat_template: str | None = None,
             cpu_threads: int | None = None, device: str | None = None) -> LoRATrainer:
        """Load the base model and tokenizer from `path` and wrap them.

        The base weights take `config.torch_dtype()` (the LoRA weights stay fp32).
        `chat_template` (a Jinja file) replaces the tokenizer's template, so re-tokenized
        trajectories match what vLLM rendered. `cpu_threads` sets torch's intra-op threads on a
        CPU (keep them off vLLM's cores). `device` places the model (default `cuda` when present,
        else the CPU); the dtype follows the machine, so a CPU copy on a CUDA machine (the
        service's copy when the steps run in worker processes) stays bf16.
        """
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if cpu_threads is not None and not device.startswith("cuda"):
            torch.set_num_threads(cpu_threads)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype()).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if chat_template is not None:
            tokenizer.chat_template = Path(chat_template).read_text()
        return cls(model, config, base_model=base_model or path, tokenizer=tokenizer)

    def _pass_tokens(self) -> int:
        """Most tokens in one forward and backward pass: `micro_batch_tokens`, or the device's default."""
        return self.config.micro_batch_tokens or _MICRO_BATCH_TOKENS.get(self.device.type, _MICRO_BATCH_TOKENS["cpu"])

    def warm_up(self) -> float:
        """Forward and backward the largest passes a step can hold, on dummy tokens; return the seconds.

        One pass holds `micro_batch_tokens` (the device's default when None) in sequences of up
        to 128 tokens, every position trained; when `max_seq_len` is longer than that, a second
        pass holds one sequence of `max_seq_len` tokens (a step trains such a sequence in a pass
        of its own). So the warm-up needs at least the memory of any pass of a step.
        Run at start, it lets the steps find their memory already touched and their kernels
        already called: a process touching memory for the first time pays a page fault for each
        page, and on a VM whose host backs memory lazily (the project's CI VMs) each costs ~25 µs
        (4-7 s of system time per GB). There, a second step that trained more tokens than the
        first spent 32% of its time zeroing fresh pages (bench/README.md). Gradients are dropped:
        the adapter, optimizer and step counter are unchanged.
        """
        started = time.perf_counter()
        tokens, longest = self._pass_tokens(), self.config.max_seq_len
        length = max(2, min(128, longest, tokens))
        passes = [[length] * max(1, tokens // length)]
        if longest > tokens:
            passes.append([longest])
        vocab = self.model.get_input_embeddings().num_embeddings
        self.model.train()
        try:
            for lengths in passes:
                items = [TrainItem(token_ids=torch.randint(vocab, (n,), device=self.device),
                                   old_logprobs=torch.full((n - 1,), float("nan"), device=self.device),
                                   mask=torch.ones(n - 1, device=self.device), advantage=0.0, weight=1.0)
                         for n in lengths]
                self._logprobs(items).sum().backward()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    # --- step ---------------------------------------------------------------------------

    def prepare(self, groups: Iterable[Group], kind: str = "grpo") -> PreparedBatch:
        """Select, score, tokenize and weigh the items of a `kind` step (`grpo` or `sft`).

        Raises:
            NothingTrainableError: nothing in `groups` can train (see `step` and `sft_step`).
        """
        try:
            prepare = _PREPARE[kind]
        except KeyError:
            raise ValueError(f"unknown step kind {kind!r}; choose one of {sorted(_PREPARE)}") from None
        vocab_size = self.model.get_input_embeddings().num_embeddings
        return prepare(list(groups), self.config, self.device, self.tokenizer, vocab_size=vocab_size)

    def train(self, groups: Iterable[Group], kind: str = "grpo") -> dict[str, float]:
        """Run one step of `kind`: `grpo` (`step`) or `sft` (`sft_step`); return its metrics."""
        run = {"grpo": self.step, "sft": self.sft_step}.get(kind)
        if run is None:
            raise ValueError(f"unknown step kind {kind!r}; choose `grpo` or `sft`")
        return run(groups)

    def step(self, groups: Iterable[Group]) -> dict[str, float]:
        """Run one GRPO step on `groups` and return its metrics (slash keys).

        Raises:
            NothingTrainableError: no group has two trajectories with finite, different rewards
                and assistant tokens; the message counts why each group was skipped.
        """
        started = time.perf_counter()
        batch = self.prepare(groups, "grpo")
        sums = self._accumulate(batch.items, self._grpo_loss)
        metrics = self._finish(started, batch, sums)
        tokens, known = sums["tokens"], sums["known"]
        metrics["loss/policy"] = sums["policy"]
        metrics["loss/clip_fraction"] = sums["clipped"] / tokens
        if known:  # over the tokens with an engine log-prob; none has one when every trajectory was re-tokenized
            metrics["loss/ratio_mean"] = sums["ratio"] / known
            metrics["loss/logprob_gap"] = sums["gap"] / known
        if self.config.kl_coef > 0:
            metrics["loss/kl"] = sums["kl"] / tokens
            metrics["loss/total"] = sums["loss"]
        self.last_metrics = metrics
        return metrics

    def sft_step(self, groups: Iterable[Group]) -> dict[str, float]:
        """Run one supervised step on the best trajectory of each group (SFT warm start).

        The loss is the mean over trajectories of the mean negative log-likelihood of their
        assistant tokens, with no KL term whatever `kl_coef` (a warm start is meant to move the
        policy off the base toward the chosen answers; it records no `loss/kl`); the optimizer,
        checkpoints and step counter are the GRPO ones.

        Raises:
            NothingTrainableError: no group's best-rewarded trajectory has assistant tokens.
        """
        started = time.perf_counter()
        batch = self.prepare(groups, "sft")
        sums = self._accumulate(batch.items, sft_pass_loss)
        metrics = self._finish(started, batch, sums)
        metrics["loss/sft"] = sums["loss"]
        metrics["kind/sft"] = 1.0
        self.last_metrics = metrics
        return metrics

    def _grpo_loss(self, items: list[TrainItem], new: torch.Tensor) -> PolicyLossOutput:
        ref = None
        if self.config.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = self._logprobs(items)
        return grpo_pass_loss(self.config, items, new, ref)

    def _logprobs(self, items: list[TrainItem]) -> torch.Tensor:
        """The items' log-probs from one packed forward of the adapter's model (`pass_logprobs`)."""
        return pass_logprobs(self.model, items, packs=self.packs, shares_prefixes=self.shares_prefixes)

    def _accumulate(self, items: list[TrainItem],
                    loss_fn: Callable[[list[TrainItem], torch.Tensor], PolicyLossOutput]) -> dict[str, float]:
        """Forward and backward each micro-batch (`micro_batches`) as one packed pass, clip, step.

        The loss of a pass is computed on its items' tokens end to end (one call, not one per
        sequence), so a pass costs the same few operations however many sequences it holds.

        Under `torch.distributed` this rank trains its `shard_items` share, then `_sum_over_ranks`
        adds up the gradients and the metric sums, so clipping and AdamW see the whole batch.

        Raises:
            NonFiniteStepError: the loss or the gradient norm is NaN or infinite; the gradients are
                dropped and the optimizer does not step (every rank sees the same sums and raises). Or
                the optimizer's step made an adapter weight NaN or infinite: the step counter stays, the
                caller rolls back (`restore`).
        """
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            items = shard_items(items, dist.get_rank(), dist.get_world_size())
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", "policy", "tokens", "clipped", "ratio", "kl", "gap", "known"), 0.0)
        tokens = self._pass_tokens()
        for chunk in micro_batches(items, self.config.micro_batch_size, tokens):
            out = loss_fn(chunk, self._logprobs(chunk))
            out.loss.backward()
            sums["loss"] += float(out.loss.detach())
            sums["policy"] += out.policy
            sums["tokens"] += out.tokens
            sums["clipped"] += out.clipped_tokens
            sums["ratio"] += out.ratio_sum
            sums["kl"] += out.kl_sum
            sums["gap"] += out.gap_sum
            sums["known"] += out.known_tokens
        params = [p for p in self.model.parameters() if p.requires_grad]
        if distributed:
            self._sum_over_ranks(params, sums)
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
        sums["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not (math.isfinite(sums["loss"]) and math.isfinite(sums["grad_norm"])):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStepError(
                f"step {self.step_count + 1}: loss {sums['loss']} and gradient norm {sums['grad_norm']} must be "
                "finite (look for a learning rate too high, and on a GRPO step for extreme rewards or engine "
                "log-probs in the batch); the optimizer did not step "
                "and the adapter is unchanged"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not _all_finite(params):
            raise NonFiniteStepError(
                f"step {self.step_count + 1}: the optimizer's step made adapter weights NaN or infinite (loss "
                f"{sums['loss']}, gradient norm {sums['grad_norm']}, learning rate "
                f"{self.optimizer.param_groups[0]['lr']}); roll back with `restore` (the service does, nothing is "
                "saved or served)"
            )
        self.step_count += 1
        return sums

    def _sum_over_ranks(self, params: list[torch.nn.Parameter], sums: dict[str, float]) -> None:
        """All-reduce (sum) the gradients, as one flat buffer, and the metric sums over the ranks.

        An explicit all-reduce rather than DDP: a rank runs one forward and backward per
        sequence (no padding), several per step; one reduction after the last backward is all
        the step needs. Item weights were set over the whole batch, so the sum is the gradient a
        single process computes (up to the order of float additions).
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        _all_reduce(flat)
        for param, grad in zip(params, flat.split([p.numel() for p in params]), strict=True):
            param.grad = grad.view_as(param)
        keys = list(sums)
        totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=flat.device)
        _all_reduce(totals)
        sums.update(zip(keys, totals.tolist(), strict=True))

    def _finish(self, started: float, batch: PreparedBatch, sums: dict[str, float]) -> dict[str, float]:
        elapsed = time.perf_counter() - started
        all_tokens = sum(int(item.token_ids.numel()) for item in batch.items)
        return {
            "step": float(self.step_count),
            "grad/norm": sums["grad_norm"],
            "optim/lr": float(self.optimizer.param_groups[0]["lr"]),
            "data/sequences": float(len(batch.items)),
            "data/tokens": float(all_tokens),
            "data/assistant_tokens": sums["tokens"],
            "time/step_s": elapsed,
            "time/tokens_per_s": all_tokens / elapsed if elapsed > 0 else 0.0,
            **batch.stats,
        }

    def snapshot(self) -> dict[str, Any]:
        """Copy the adapter weights, optimizer state and step counter (LoRA-sized, cheap)."""
        return {
            "adapter": {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "step": self.step_count,
            "metrics": dict(self.last_metrics),
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Return to a `snapshot()`: used when a step's checkpoint could not be written."""
        set_peft_model_state_dict(self.model, snapshot["adapter"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.step_count = int(snapshot["step"])
        self.last_metrics = dict(snapshot["metrics"])

    # --- checkpoints --------------------------------------------------------------------

    def save(self, path: str | Path, *, batch_id: str | None = None, metrics: dict[str, float] | None = None) -> Path:
        """Write the adapter, optimizer state and `manifest.json` (step, base model, config, metrics, batch id) to
        `path`, atomically (`checkpoint_folder.write_checkpoint`, whose errors it raises)."""
        manifest = {
            "step": self.step_count,
            "base_model": self.base_model,
            "config": self.config.to_dict(),
            "metrics": metrics if metrics is not None else self.last_metrics,
            "batch_id": batch_id,
            "created_at": time.time(),
        }
        return write_checkpoint(Path(path), self.model, self.optimizer, manifest)

    def resume(self, path: str | Path) -> dict[str, Any]:
        """Load adapter weights, optimizer state and step from a checkpoint written by `save`.

        The optimizer's moments come from the checkpoint, its learning rate and weight decay from this trainer's
        config (`_apply_config_to_optimizer`): a run restarted with new values trains with them. A checkpoint without
        optimizer state (not one `save` wrote) leaves the optimizer fresh, with a warning.

        Returns:
            The checkpoint's manifest.
        """
        path = Path(path)
        manifest, optimizer_state = read_checkpoint(path, self.model)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
            self._apply_config_to_optimizer(path)
        else:
            logger.warning("%s has no optimizer state (optimizer.pt): AdamW starts afresh from its adapter", path)
        self.step_count = int(manifest["step"])
        self.last_metrics = dict(manifest.get("metrics") or {})
        return manifest

    def _apply_config_to_optimizer(self, source: Path) -> None:
        """Set every param group's hyper-parameters to the config's, logging those that differ from `source`'s.

        `load_state_dict` restores the saved groups' `lr` and `weight_decay` along with the moments.
        """
        wanted = {"lr": ("learning_rate", self.config.learning_rate),
                  "weight_decay": ("weight_decay", self.config.weight_decay)}
        changed: dict[str, tuple[float, float]] = {}
        for param_group in self.optimizer.param_groups:
            for key, (name, value) in wanted.items():
                if param_group[key] != value:
                    changed[name] = (param_group[key], value)
                param_group[key] = value
        if changed:
            logger.info("resumed the optimizer state of %s with this run's settings: %s", source,
                        ", ".join(f"{name} {saved:g} -> {value:g}" for name, (saved, value) in changed.items()))


def _all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` over the ranks in place; any failure is a `torch.distributed.DistError`.

    gloo raises a plain `RuntimeError` when a peer died or the collective timed out: raised as `DistError`, the
    launcher blames the workers, not the batch (`distributed._error_report`).
    """
    try:
        dist.all_reduce(tensor)
    except dist.DistError:
        raise
    except RuntimeError as exc:
        raise dist.DistError(f"all-reduce over the ranks failed: {exc}") from exc


def _all_finite(params: list[torch.nn.Parameter]) -> bool:
    """Whether every value of `params` is finite (one synchronisation, however many tensors)."""
    return bool(torch.stack([param.detach().isfinite().all() for param in params]).all())
