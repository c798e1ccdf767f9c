"""Hyper-parameters of the GRPO algorithm (`GRPOConfig`).

`GRPOConfig` is a plain dataclass: every field has a help string, `from_env` reads each one from
`ART_TRAINER_<FIELD>`, and `__post_init__` rejects inconsistent values with a message naming the fix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from trainer_service.metrics import KL_METRICS

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig

    from trainer_service.config import TrainerSettings

__all__ = ["DEFAULT_TARGET_MODULES", "OPTIONAL_FIELDS", "GRPOConfig", "split_modules"]

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


@dataclass(frozen=True)
class _Range:
    """The values the check of a numeric field takes (`GRPOConfig._check_ranges`), as its help states them: above
    `low`, or from it when `low_included`, and below `high` when one is set."""

    low: float
    low_included: bool = False
    high: float | None = None

    def takes(self, value: float) -> bool:
        """Whether `value` lies in the range."""
        above = value >= self.low if self.low_included else value > self.low
        return above and (self.high is None or value < self.high)

    def __str__(self) -> str:
        low = f"{'at least' if self.low_included else 'above'} {self.low:g}"
        return low if self.high is None else f"{low} and below {self.high:g}"


@dataclass
class GRPOConfig:
    """Hyper-parameters of one GRPO step with a LoRA adapter.

    Every field has a documented default; `__post_init__` validates them together.
    """

    learning_rate: float = field(
        default=1e-4,
        metadata={
            "help": "AdamW learning rate. ART uses 5e-6..1e-5 on large models; a 135M model with LoRA on "
            "this CPU learned nothing below 5e-5 in 20 steps and learned at 1e-4..2e-4.",
            "range": _Range(0),
        },
    )
    loss: Literal["ppo", "cispo"] = field(
        default="ppo",
        metadata={"help": "Policy loss: `ppo` (clipped importance ratio) or `cispo` (clipped, stop-gradient weight)."},
    )
    epsilon: float = field(
        default=0.2,
        metadata={
            "help": "Lower clip range of `ppo`: the ratio is clipped below at 1 - epsilon. `cispo` has no lower "
            "bound and uses epsilon only as the upper range when epsilon_high is None.",
            "range": _Range(0, high=1),
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clip range: `ppo` clips the ratio above at 1 + epsilon_high, `cispo` caps its weight "
            "at 1 + epsilon_high. None means epsilon (a cap of 1 + epsilon for both).",
            "range": _Range(0),
        },
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "`ppo` only (refused with `cispo`, whose weight is capped already): two-sided clipping. The "
            "unclipped ratio is capped at delta, so a token with a negative advantage whose ratio ran far above "
            "1 + epsilon_high costs at most delta * |A| (TRL's `delta`, INTELLECT-2: e.g. 3 or 4). Must be above "
            "1 + epsilon_high (1 + epsilon when that is None), or it would cap ratios the clip keeps. None: no cap, "
            "PPO as published."
        },
    )
    scale_rewards: bool = field(
        default=True, metadata={"help": "Divide advantages by the group's reward standard deviation."}
    )
    max_grad_norm: float | None = field(
        default=1.0, metadata={"help": "Clip the gradient's global norm to this value; None disables clipping.",
                               "range": _Range(0)}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on the LoRA weights.",
                                                       "range": _Range(0, low_included=True)})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (vLLM's --max-lora-rank must be at least this).",
                                             "range": _Range(1, low_included=True)})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale is alpha / r).", "range": _Range(0)})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input.",
                                                       "range": _Range(0, low_included=True, high=1)})
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        metadata={"help": "Module names that get LoRA adapters, at least one (default: all attention and MLP "
                  "projections)."},
    )
    micro_batch_size: int = field(
        default=64,
        metadata={
            "help": "Most sequences trained in one forward and backward pass, packed end to end into one row "
            "(attention stays within each sequence; no padding). On an H200, 32 sequences took 12.5 s one per pass "
            "and 0.44 s in one; on this CPU, 8 per pass made a bf16 step 1.3x faster than one per pass (measured).",
            "range": _Range(1, low_included=True),
        },
    )
    micro_batch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens packed into one pass (a longer sequence gets a pass of its own): bounds a pass's "
            "memory (about 1 MB per token for the bundled model in bf16 on a CPU: a step's peak 2.1 GB at 1024, "
            "3.7 GB at 4096). None means 8192 with CUDA and 4096 on a CPU (the bench's step on 2 threads: median "
            "5.9 s at 1024, 5.1 s at 2048 and at 4096, measured).",
            "range": _Range(2, low_included=True),
        },
    )
    train_dtype: Literal["auto", "float32", "bfloat16"] = field(
        default="auto",
        metadata={
            "help": "Dtype of the frozen base weights while training (the LoRA weights and the optimizer stay "
            "float32). `auto`: bfloat16 with CUDA and on a CPU that multiplies bf16 in hardware, with AMX or "
            "AVX512-BF16 (a step of the bundled model on 2 cores: 1.4x faster than float32 on an Intel Xeon with AMX, "
            "1.3x on an AMD EPYC with AVX512-BF16), float32 elsewhere."
        },
    )
    max_seq_len: int = field(
        default=2048,
        metadata={"help": "Longest sequence trained on, in tokens; `max_seq_len_policy` says what happens to longer "
                  "ones.", "range": _Range(2, low_included=True)},
    )
    max_seq_len_policy: Literal["truncate", "skip"] = field(
        default="truncate",
        metadata={"help": "Longer sequences are cut to max_seq_len (`truncate`) or left out (`skip`); both are "
                          "counted."},
    )
    importance_sampling: Literal["token", "sequence"] = field(
        default="token",
        metadata={
            "help": "Importance ratio per token, or one per sequence (exp of the mean token log-ratio, GSPO-style). "
            "A mean log-ratio stays near 0, so epsilon 0.2 rarely clips it; the GSPO paper uses 3e-4 / 4e-4."
        },
    )
    kl_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of a KL penalty to the base model on GRPO steps (the adapter disabled is the "
                  "reference; k3 estimator; SFT steps have none). 0 skips the reference forward.",
                  "range": _Range(0, low_included=True)},
    )
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Recompute activations in backward; None means on with CUDA, off on a CPU."}
    )

    def __post_init__(self) -> None:
        """Check the fields, alone and against each other."""
        from trainer_service.grpo import POLICY_LOSSES

        self._check_finite()
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"loss={self.loss!r} is not a known policy loss; choose one of {sorted(POLICY_LOSSES)}.")
        self._check_ranges()
        if self.delta is not None and self.loss != "ppo":
            raise ValueError(f"delta={self.delta} is PPO's two-sided clip; loss={self.loss!r} caps its weight at "
                             "1 + epsilon_high already: leave delta unset.")
        if self.delta is not None and not self.delta > 1 + self.upper_epsilon:
            raise ValueError(f"delta={self.delta} must exceed 1 + epsilon_high ({1 + self.upper_epsilon:g}), or it "
                             "would cap ratios the clip keeps; 3 or 4 is usual.")
        if not self.target_modules:
            raise ValueError("target_modules is empty: name at least one module, e.g. 'q_proj'.")
        if self.train_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"train_dtype={self.train_dtype!r}: choose `auto`, `float32` or `bfloat16`.")
        if self.importance_sampling not in ("token", "sequence"):
            raise ValueError(f"importance_sampling={self.importance_sampling!r}: choose `token` or `sequence`.")
        if self.max_seq_len_policy not in ("truncate", "skip"):
            raise ValueError(f"max_seq_len_policy={self.max_seq_len_policy!r}: choose `truncate` or `skip`.")

    def _check_finite(self) -> None:
        """Reject a NaN or infinite float field: range checks such as `x <= 0` let NaN pass, and one would poison
        the adapter at the first step.

        Raises:
            ValueError: names the first such field, its flag and its environment variable.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name}={value} must be a finite number (flag --{f.name.replace('_', '-')}, "
                                 f"env ART_TRAINER_{f.name.upper()}).")

    def _check_ranges(self) -> None:
        """Reject a numeric field outside the range its help states (its metadata's `range`); None passes, where a
        field takes it.

        Raises:
            ValueError: names the first such field, its range, its flag and its environment variable.
        """
        for f in fields(self):
            value, allowed = getattr(self, f.name), f.metadata.get("range")
            if allowed is not None and value is not None and not allowed.takes(value):
                none = ", or none" if f.name in OPTIONAL_FIELDS else ""
                raise ValueError(f"{f.name}={value} must be {allowed}{none} (flag --{f.name.replace('_', '-')}, "
                                 f"env ART_TRAINER_{f.name.upper()}; default {f.default}).")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GRPOConfig:
        """Build a config: `overrides` over `ART_TRAINER_<FIELD>` environment variables over defaults.

        Lists (`target_modules`) are comma-separated; booleans accept 1/0, true/false, yes/no;
        `none` sets an optional field to None.

        Raises:
            ValueError: a variable does not parse, or the values are inconsistent.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"ART_TRAINER_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse_env_value(f.name, raw, f.default if f.default is not MISSING else None)
        values.update(overrides)
        return cls(**values)

    @property
    def upper_epsilon(self) -> float:
        """The upper clip range: `epsilon_high`, or `epsilon` when that is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def lora_config(self) -> LoraConfig:
        """PEFT's `LoraConfig` for these LoRA fields: the adapter the trainer trains (and the benches give TRL)."""
        from peft import LoraConfig  # here, so reading settings does not import PEFT

        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=list(self.target_modules), task_type="CAUSAL_LM", bias="none")

    def torch_dtype(self) -> torch.dtype:
        """The base weights' dtype for `train_dtype` on this machine.

        `auto` is bf16 when CUDA is present and on a CPU with bf16 matrix products in hardware (AMX or
        AVX512-BF16: `cpu_multiplies_bf16`), float32 on other CPUs, where they are emulated and slower.
        """
        import torch  # here, so reading settings does not import torch

        from trainer_service.vllm_cpu_matmul import cpu_multiplies_bf16

        if self.train_dtype != "auto":
            return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.train_dtype]
        return torch.bfloat16 if torch.cuda.is_available() or cpu_multiplies_bf16() else torch.float32

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check_against(self, settings: TrainerSettings) -> None:
        """Check that the engine settings can serve adapters this config trains, and that its steps record the
        metric retention ranks checkpoints by.

        Raises:
            ValueError: the LoRA rank exceeds vLLM's `max_lora_rank`, or `keep_best_metric` is a KL metric
                (`metrics.KL_METRICS`) without a KL penalty.
        """
        if self.lora_r > settings.max_lora_rank:
            raise ValueError(
                f"lora_r={self.lora_r} exceeds max_lora_rank={settings.max_lora_rank}: vLLM could not load the "
                f"adapter. Raise --max-lora-rank to {self.lora_r} or lower --lora-r."
            )
        if settings.keep_best_metric in KL_METRICS and self.kl_coef == 0:  # no step records it: no best was kept
            raise ValueError(
                f"keep_best_metric={settings.keep_best_metric!r} is recorded only with a KL penalty, and kl_coef=0. "
                "Set --kl-coef (ART_TRAINER_KL_COEF) above 0 or choose another --keep-best-metric "
                "(ART_TRAINER_KEEP_BEST_METRIC)."
            )

    @staticmethod
    def help(name: str) -> str:
        """Return the help string of field `name`, which ends in the range its check takes, if any."""
        for f in fields(GRPOConfig):
            if f.name == name:
                allowed = f.metadata.get("range")
                return str(f.metadata.get("help", "")) + (f" Must be {allowed}." if allowed else "")
        raise KeyError(name)


def split_modules(text: str) -> list[str]:
    """`target_modules` from its comma-separated form (`--target-modules`, `ART_TRAINER_TARGET_MODULES`): each name
    stripped, empty ones dropped. A name kept with its space (`"q_proj, v_proj"`) matched no module, and PEFT left
    that projection without an adapter, silently."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _parse_env_value(name: str, raw: str, default: Any) -> Any:
    """Parse one `ART_TRAINER_<FIELD>` value by the type of the field's default."""
    text = raw.strip()
    try:
        if name == "target_modules":
            return split_modules(text)
        if text.lower() == "none" and name in OPTIONAL_FIELDS:
            return None
        if isinstance(default, bool) or name in ("scale_rewards", "gradient_checkpointing"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if (isinstance(default, int) and not isinstance(default, bool)) or name in _OPTIONAL_INT_FIELDS:
            return int(text)
        if isinstance(default, float) or name in OPTIONAL_FIELDS:
            return float(text)
        return text
    except ValueError as exc:
        raise ValueError(f"ART_TRAINER_{name.upper()}={raw!r} does not parse: {exc}.") from exc


_OPTIONAL_INT_FIELDS = {"micro_batch_tokens"}
OPTIONAL_FIELDS = {"epsilon_high", "delta", "max_grad_norm", "gradient_checkpointing", *_OPTIONAL_INT_FIELDS}
"""Fields that None turns off or leaves to the device: `none` sets it from a flag or `ART_TRAINER_<FIELD>`."""
