"""Settings of the trainer service (`TrainerSettings`) and of the GRPO algorithm (`GRPOConfig`).

`TrainerSettings` reads `ART_TRAINER_*` environment variables (and `ART_API_KEY`); the
`art-trainer serve` flags override them. `GRPOConfig` is a plain dataclass: every field has a
help string, and `__post_init__` rejects inconsistent values with a message naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DEFAULT_TARGET_MODULES", "GRPOConfig", "TrainerSettings"]

DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""All attention and MLP projections of a Llama-style decoder."""


class TrainerSettings(BaseSettings):
    """Service settings: where to listen, which model to serve, where the collector is."""

    model_config = SettingsConfigDict(env_prefix="ART_TRAINER_", extra="forbid", populate_by_name=True)

    host: str = Field(default="127.0.0.1", description="Interface the OpenAI-compatible API listens on.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port of the OpenAI-compatible API.")
    base_model: str = Field(
        default="SmolLM2-135M-Instruct",
        description="Base model: the bundled `SmolLM2-135M-Instruct`, a local model folder, or a hub name.",
    )
    name: str = Field(
        default="agent",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="Name of the trained model: checkpoints are served as `name@1`, `name@2`, ... and `name@latest`.",
    )
    collector: str = Field(default="http://localhost:4318", description="Base address of the collector service.")
    output_dir: Path | None = Field(
        default=None, description="Where checkpoints, metrics.jsonl and the vLLM log go (default `runs/<name>`)."
    )
    vllm_port: int = Field(default=8001, ge=1, le=65535, description="Port of the vLLM engine (child process).")
    vllm_dtype: str = Field(
        default="float32",
        description="vLLM weight dtype. float32 keeps the engine's logprobs equal to the trainer's; bf16 rounds small LoRA updates away.",
    )
    kv_cache_gib: float = Field(default=2, gt=0, description="KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE` on a CPU).")
    max_model_len: int = Field(default=2048, ge=16, description="Longest sequence (prompt + completion) vLLM accepts.")
    max_lora_rank: int = Field(default=8, ge=1, description="Largest LoRA rank vLLM accepts; must be >= lora_r.")
    max_loras: int = Field(default=4, ge=1, description="Adapters vLLM keeps active in one batch.")
    vllm_args: list[str] = Field(default_factory=list, description="Extra command-line arguments passed to vLLM as is.")
    vllm_startup_timeout: float = Field(default=600.0, gt=0, description="Seconds to wait for vLLM to become healthy.")
    batch_groups: int = Field(default=8, ge=1, description="Most groups leased from the collector per training step.")
    api_key: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ART_API_KEY", "ART_TRAINER_API_KEY"),
        description="When set, every endpoint needs `Authorization: Bearer <key>` (env `ART_API_KEY`).",
    )

    @property
    def run_dir(self) -> Path:
        """The output folder: `output_dir`, or `runs/<name>` when unset."""
        return self.output_dir if self.output_dir is not None else Path("runs") / self.name


@dataclass
class GRPOConfig:
    """Hyper-parameters of one GRPO step with a LoRA adapter.

    Every field has a documented default; `__post_init__` validates them together.
    """

    learning_rate: float = field(
        default=1e-4,
        metadata={
            "help": "AdamW learning rate. ART uses 5e-6..1e-5 on large models; a 135M model with LoRA on "
            "this CPU learned nothing below 5e-5 in 20 steps and learned at 1e-4..2e-4 (DESIGN.md)."
        },
    )
    loss: Literal["ppo", "cispo"] = field(
        default="ppo",
        metadata={"help": "Policy loss: `ppo` (clipped importance ratio) or `cispo` (clipped, stop-gradient weight)."},
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range: the ratio is kept above 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip range (ratio below 1 + epsilon_high); None means epsilon."}
    )
    scale_rewards: bool = field(
        default=True, metadata={"help": "Divide advantages by the group's reward standard deviation."}
    )
    max_grad_norm: float | None = field(
        default=1.0, metadata={"help": "Clip the gradient's global norm to this value; None disables clipping."}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on the LoRA weights."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (vLLM's --max-lora-rank must be at least this)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale is alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        metadata={"help": "Module names that get LoRA adapters (default: all attention and MLP projections)."},
    )
    micro_batch_size: int = field(
        default=4,
        metadata={
            "help": "Sequences whose losses are summed before one backward pass. Each sequence still has its own "
            "forward (no padding); larger values trade memory for fewer backward calls."
        },
    )
    max_seq_len: int = field(
        default=2048, metadata={"help": "Longer sequences are cut to this many tokens (counted in the metrics)."}
    )
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Recompute activations in backward; None means on with CUDA, off on a CPU."}
    )

    def __post_init__(self) -> None:
        """Check the fields, alone and against each other."""
        from trainer_service.grpo import POLICY_LOSSES

        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"loss={self.loss!r} is not a known policy loss; choose one of {sorted(POLICY_LOSSES)}.")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be positive (try 1e-4 for a small model).")
        if not 0 < self.epsilon < 1:
            raise ValueError(f"epsilon={self.epsilon} must lie in (0, 1); 0.2 is the usual value.")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ValueError(f"epsilon_high={self.epsilon_high} must be positive, or None to reuse epsilon.")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be positive, or None to disable clipping.")
        if self.lora_r < 1:
            raise ValueError(f"lora_r={self.lora_r} must be at least 1.")
        if self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} must be positive (2 * lora_r is a common choice).")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout} must lie in [0, 1).")
        if not self.target_modules:
            raise ValueError("target_modules is empty: name at least one module, e.g. 'q_proj'.")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be at least 1.")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be at least 2 tokens.")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must not be negative.")

    @property
    def upper_epsilon(self) -> float:
        """The upper clip range: `epsilon_high`, or `epsilon` when that is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check_against(self, settings: TrainerSettings) -> None:
        """Check that the engine settings can serve adapters this config trains.

        Raises:
            ValueError: the LoRA rank exceeds vLLM's `max_lora_rank`.
        """
        if self.lora_r > settings.max_lora_rank:
            raise ValueError(
                f"lora_r={self.lora_r} exceeds max_lora_rank={settings.max_lora_rank}: vLLM could not load the "
                f"adapter. Raise --max-lora-rank to {self.lora_r} or lower --lora-r."
            )

    @staticmethod
    def help(name: str) -> str:
        """Return the help string of field `name`."""
        for f in fields(GRPOConfig):
            if f.name == name:
                return str(f.metadata.get("help", ""))
        raise KeyError(name)
