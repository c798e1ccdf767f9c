"""Settings of the trainer service (`TrainerSettings`); the GRPO algorithm's are in grpo_config.py.

`TrainerSettings` reads `ART_TRAINER_*` environment variables (and `ART_API_KEY`); the
`art-trainer serve` flags override them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from collector.auth import configured_key, refuse_key_name
from collector.config import check_http_url
from collector.protocol import MAX_LEASE_SECONDS, BatchRequest
from trainer_service.base_model import BUNDLED_MODEL, served_base_name
from trainer_service.cgroup_memory import cgroup_memory_limit
from trainer_service.metrics import CHECKPOINT_METRICS, LOSS_METRICS, is_checkpoint_metric
from trainer_service.schedule_text import (
    DURATION_FORM,
    LONGEST_INTERVAL_S,
    SHORTEST_INTERVAL_S,
    check_schedule_timezone,
    duration_text,
    parse_cron,
    parse_duration,
)
from trainer_service.vllm_source import (
    flags_read_as,
    other_plugins,
    vllm_dtypes,
    vllm_lora_ranks,
    vllm_serve_flags,
    vllm_tool_parsers,
)

CPU_KV_BLOCK_SIZE = 32
"""vLLM-cpu's KV-cache block size unless set (`TrainerSettings.kv_block_size`): its attention kernels want
multiples of 32, and a smaller block lets the prefix cache reuse a shorter prompt."""

__all__ = ["LEASE_MARGIN_S", "TrainerSettings"]

_MOST_LEASED_GROUPS: int = BatchRequest.model_json_schema()["properties"]["max_groups"]["maximum"]
"""The most groups the collector leases at once (`BatchRequest.max_groups`), the bound of `batch_groups`: a larger
one was accepted at start and then every step's lease was refused."""

LEASE_MARGIN_S = 300.0
"""Seconds a batch's lease lasts beyond `train_step_timeout`: the checkpoint's save, its hot-load into vLLM (whose
adapter calls may take 120 s) and the ack come after training, before the ack ends the lease."""

_LONGEST_STEP_TIMEOUT_S = MAX_LEASE_SECONDS - LEASE_MARGIN_S
"""The longest `train_step_timeout`: its lease (`lease_seconds`) must fit the collector's longest."""

_SHORTEST_MODEL_LEN = 16
"""The shortest `max_model_len`."""

_PORTS = "1-65535"
"""The range of `port` and `vllm_port`, as their help says it."""

BUNDLED_TOOL_TEMPLATE = Path(__file__).parent / "templates" / "smollm2_tools.jinja"
"""SmolLM2's chat format with Hermes-style tool calls (`<tool_call>{json}</tool_call>`)."""

_OWNED_VLLM_FLAGS = {
    "--model": "--base-model", "--served-model-name": "--base-model", "--host": None, "--port": "--vllm-port",
    "--dtype": "--vllm-dtype", "--enable-lora": None, "--max-lora-rank": "--max-lora-rank",
    "--max-loras": "--max-loras", "--max-model-len": "--max-model-len", "--block-size": "--kv-block-size",
    "--tool-call-parser": "--tool-call-parser", "--enable-auto-tool-choice": "--tool-call-parser",
    "--chat-template": "--chat-template",
}
"""vLLM flags the service sets itself (`VLLMEngine.command`; the chat template and tool-call flags by
`tool_calling_args`: vLLM's template must be the one the trainer renders with), with the service's flag for each
(None: fixed)."""

_REFUSED_EMPTY = {
    "output_dir": ("is empty, which reads as the working folder; give a folder", " for runs/<name>"),
    "eval_file": ("is empty; give one", ""),
    "eval_split": ("is empty; give one", ""),
}
"""Settings an empty value is refused for: what the error says of it, and what leaving the setting out gives."""

_IGNORED_PLUGIN_CHARS = 3
"""vLLM (0.32) imports a `--tool-parser-plugin` file only if its value is longer than this (its launcher's
`len(args.tool_parser_plugin) > 3`): a shorter one is ignored, and registers no parser."""


def _vllm_arg_value(args: list[str], flag: str) -> str | None:
    """The value `args` give vLLM's `flag` last, as `--flag=V` or `--flag V`, by a prefix of it too and `_` for `-`,
    as vLLM reads it (`--max-cpu=2` set `--max-cpu-loras`); None where they do not set it."""
    value = None
    for index, arg in enumerate(args):
        name, equals, given = arg.partition("=")
        if len(name) > 2 and flag.startswith(name.replace("_", "-")):
            value = given if equals else (args[index + 1] if index + 1 < len(args) else None)
    return value


def _cuda_available() -> bool:
    """Whether torch sees CUDA (vLLM-cpu is then not used); torch is imported only when asked, as it is slow to."""
    import torch

    return torch.cuda.is_available()


_COVERS_VLLM = ("127.0.0.1", "localhost", "0.0.0.0", "::", "")
"""`host` values whose port is also taken by vLLM's listener on 127.0.0.1 (`VLLMEngine`), or (`::`, bound for IPv6
alone) whose clients on 127.0.0.1 would reach vLLM."""

_CUDA_IGNORED = {
    "kv_cache_gib": "only vLLM-cpu reads VLLM_CPU_KVCACHE_SPACE; size the GPU's cache with "
                    "--vllm-arg=--gpu-memory-utilization=F or --vllm-arg=--kv-cache-memory-bytes=N",
    "train_threads": "the step trains on the GPU, and the count sets torch's threads only for a step on a CPU",
    "idle_train_threads": "no core is lent to a step that trains on the GPU",
    "idle_vllm_threads": "it sizes vLLM-cpu's threads, and vLLM-cpu is not used",
}
"""CPU-only settings that do nothing with CUDA, and why (`TrainerSettings.ignored_with_cuda`)."""

_GATE_SETTINGS = ("eval_samples", "eval_max_prompts", "eval_max_tokens", "eval_temperature", "promotion_margin")
"""Settings only the promotion gate reads."""


class TrainerSettings(BaseSettings):
    """Service settings: where to listen, which model to serve, where the collector is."""

    # allow_inf_nan=False: every float setting must be finite (`inf` passes `gt=0`, and NaN fails it with a
    # misleading "greater than 0"); pydantic names the field and says "a finite number".
    model_config = SettingsConfigDict(env_prefix="ART_TRAINER_", extra="forbid", populate_by_name=True,
                                      allow_inf_nan=False, hide_input_in_errors=True)

    host: str = Field(default="127.0.0.1", description="Interface the OpenAI-compatible API listens on.")
    port: int = Field(default=8000, ge=1, le=65535, description=f"Port of the OpenAI-compatible API ({_PORTS}).")
    base_model: str = Field(
        default="SmolLM2-135M-Instruct",
        description="Base model: the bundled `SmolLM2-135M-Instruct`, a local model folder, or a hub name.",
    )
    name: str = Field(
        default="agent",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        max_length=255,
        description="Name of the trained model: checkpoints are served as `name@1`, `name@2`, ... and `name@latest`. "
        "Letters, digits, `_`, `.` and `-`, at most 255 of them: a file name's limit (`runs/<name>`), within the "
        "collector's for a trainer (256).",
    )
    collector: str = Field(default="http://localhost:4318",
                           description="Base address of the collector service, an http:// or https:// URL.")
    output_dir: Path | None = Field(
        default=None, description="Where checkpoints, metrics.jsonl and the vLLM log go (default `runs/<name>`)."
    )
    vllm_port: int = Field(default=8001, ge=1, le=65535,
                           description=f"Port of the vLLM engine (child process; {_PORTS}), not the API's `port`.")
    vllm_dtype: str = Field(
        default="float32",
        description="vLLM weight dtype (`--dtype`). float32 keeps small LoRA updates in the served policy; bfloat16 "
        "sampled 1.44x faster through an adapter on a 2-core AMX CPU but rounds them away: the arithmetic example "
        "gained +0.105 ± 0.030 with it against +0.256 ± 0.081 in float32 (3 seeds each; README, vLLM's precision). "
        "`--vllm-matmul-dtype` gets most of the speed without the loss.",
    )
    vllm_matmul_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Dtype of the linear layers' matrix products in a float32 engine on a CPU (vLLM plugin "
        "`art_cpu_bf16_matmul`, trainer_service/vllm_cpu_matmul.py): inputs and weights rounded to bf16 for the CPU's "
        "bf16 units (AMX or AVX512-BF16), the products back in float32; the residual stream, attention, LoRA and "
        "logits stay float32. `auto`: bfloat16 on a CPU with AMX or AVX512-BF16, float32 elsewhere.",
    )
    kv_cache_gib: int = Field(
        default=2, ge=1,
        description="KV cache size in whole GiB (`VLLM_CPU_KVCACHE_SPACE` on a CPU, which vLLM-cpu reads as an "
        "integer: a fraction stopped its start); at most the machine's memory, and the cgroup's limit where lower (a "
        "container's). vLLM-cpu only: with CUDA a value given logs a warning, and "
        "`--vllm-arg=--gpu-memory-utilization=F` sizes the cache.",
    )
    kv_block_size: int | None = Field(
        default=None, ge=1,
        description="Tokens per vLLM KV-cache block (`--block-size`), the unit of its prefix cache: only whole blocks "
        "of a prompt are reused. Default: 32 without CUDA (at most `max_model_len`), vLLM's own with it. vLLM-cpu's "
        "own default, 128, never caches a prompt shorter than that, so each of a group's samples computes it again; "
        "with 32 the bench's 8 prompts x 4 samples sampled 1.08-1.15x faster, ~700-token prompts 1.41x (README, "
        "vLLM's prefix cache). vLLM-cpu prefers multiples of 32; at most `max_model_len`.",
    )
    max_model_len: int = Field(default=2048, ge=_SHORTEST_MODEL_LEN, description="Longest sequence (prompt + "
                               f"completion) vLLM accepts, in tokens; at least {_SHORTEST_MODEL_LEN}.")
    max_lora_rank: int = Field(
        default=8, ge=1, description="Largest LoRA rank vLLM accepts; must be >= lora_r, and one of the ranks the "
        "installed vLLM takes (0.32: 1, 8, 16, 32, 64, 128, 256, 320, 512).",
    )
    max_loras: int = Field(default=4, ge=1, description="Adapters vLLM keeps active in one batch.")
    vllm_args: Annotated[list[str], NoDecode] = Field(  # JSON read by `_vllm_args_json`, which names the fix
        default_factory=list, description="Extra command-line arguments passed to vLLM as is.")
    chat_template: str | None = Field(
        default=None,
        description="Chat template file for vLLM (`--chat-template`). Default: the bundled tool-aware template "
        "(`trainer_service/templates/smollm2_tools.jinja`) for the bundled model, the model's own otherwise; "
        "`model` keeps the model's own.",
    )
    tool_call_parser: str | None = Field(
        default=None,
        description="vLLM tool-call parser (`--enable-auto-tool-choice --tool-call-parser`). Default: `hermes` for "
        "the bundled model (matching its bundled template), none otherwise; `none` turns tool parsing off.",
    )
    json_whitespace: Literal["compact", "any"] = Field(
        default="compact",
        description="Whitespace in structured (JSON-schema) outputs. `compact`: none between JSON tokens (vLLM's "
        "xgrammar backend with `disable_any_whitespace`); the bundled model as RULER judge otherwise filled "
        "max_tokens with newlines inside its JSON. `any`: vLLM's default, whitespace allowed.",
    )
    vllm_startup_timeout: float = Field(default=600.0, gt=0, description="Seconds to wait for vLLM to become healthy.")
    warm_up: bool = Field(
        default=True,
        description="At start, run dummy forwards and backwards as large as a step's largest passes "
        "(`LoRATrainer.warm_up`), so that steps find their memory touched and kernels loaded. Off: `--no-warm-up`.",
    )
    batch_groups: int = Field(
        default=8, ge=1, le=_MOST_LEASED_GROUPS,
        description="Most groups leased from the collector per training step; at most the collector's limit of a "
        f"lease, {_MOST_LEASED_GROUPS}.",
    )
    train_threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads of the training step (no effect with CUDA: a value given logs a warning). "
        "Default: the cores vLLM-cpu leaves free (`VLLM_CPU_NUM_OF_RESERVED_CPU`, vLLM's default 1): sharing vLLM's "
        "bound cores made a step 2.5-8x slower here. More than the cores this process may use is refused.",
    )
    idle_train_threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads of a training step while vLLM has no request in flight (one training process, no "
        "CUDA: with it a value given logs a warning): the engine's idle cores are lent to the step, which hands them "
        "back between two decoder layers before a request reaches vLLM (see trainer_service/core_lending.py). "
        "Default: every core this process may use. Set it to `train_threads` to never lend; a lower value, or more "
        "than those cores, is refused.",
    )
    idle_vllm_threads: int | None = Field(
        default=None, ge=1,
        description="vLLM-cpu's threads while no training step runs (no CUDA: with it a value given logs a "
        "warning): the step's cores are lent to the engine, which is bound to every core and runs only the cores the "
        "step leaves it while a step trains (see trainer_service/vllm_cpu_threads.py). Default: every core this "
        "process may use. Set it to the engine's own count (the cores minus `train_threads`) to never lend (a lower "
        "value is refused); a `VLLM_CPU_OMP_THREADS_BIND` in the environment also turns lending off and binds vLLM "
        "as it says.",
    )

    allocator: str = Field(
        default="auto",
        description="Memory allocator of the service, its vLLM engine and training workers: `auto` (TCMalloc where "
        "installed, Debian's libtcmalloc-minimal4, and no NVIDIA GPU is present), `system` (glibc), or the path of "
        "a shared library to preload. `art-trainer serve` runs itself again with it in `LD_PRELOAD`. TCMalloc keeps "
        "freed blocks for the next step: training steps 1.2-1.4x faster here, vLLM sampling 1.06x "
        "(trainer_service/allocator.py).",
    )
    train_processes: int = Field(
        default=1, ge=1,
        description="Data-parallel training processes per step. 1 trains in the service process; N > 1 runs each "
        "step in N `torchrun` workers (one GPU each with CUDA, nccl; gloo on a CPU, `train_threads` / N threads each, "
        "at least 1, and N at most the cores), whose summed gradients give the one-process step.",
    )
    train_step_timeout: float = Field(
        default=3600.0, gt=0, le=_LONGEST_STEP_TIMEOUT_S,
        description="With train_processes > 1: seconds one step's `torchrun` workers may take before all of them are "
        "killed and the step fails (a stuck rank or collective otherwise blocks training for good). Also sizes the "
        f"collector lease of every step, in one process too (this + {LEASE_MARGIN_S:g} s), so a batch is not offered "
        f"again while its step runs; at most {_LONGEST_STEP_TIMEOUT_S:g} s, the collector's longest lease (a week) "
        f"less {LEASE_MARGIN_S:g} s.",
    )

    def lease_seconds(self) -> float:
        """How long a step leases its batch from the collector: `train_step_timeout` + `LEASE_MARGIN_S`."""
        return self.train_step_timeout + LEASE_MARGIN_S

    def training_threads(self) -> int:
        """Threads for the training step on a CPU: `train_threads`, else the cores vLLM-cpu reserves.

        Raises:
            ValueError: `VLLM_CPU_NUM_OF_RESERVED_CPU` is not a whole number.
        """
        if self.train_threads is not None:
            return self.train_threads
        if _cuda_available():  # vLLM-cpu, which reads the variable, is not used; no step runs on the CPU
            return 1
        reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        try:
            return max(1, int(reserved))  # as vLLM reads it
        except ValueError:
            raise ValueError(f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved!r} is not a whole number of cores. Fix or unset "
                             "it, or set --train-threads (ART_TRAINER_TRAIN_THREADS).") from None

    def engine_block_size(self) -> int | None:
        """vLLM's `--block-size`: `kv_block_size`, else 32 without CUDA (at most `max_model_len`, as `kv_block_size`
        must be) and None (vLLM's default) with it."""
        if self.kv_block_size is not None:
            return self.kv_block_size
        return None if _cuda_available() else min(CPU_KV_BLOCK_SIZE, self.max_model_len)

    def lent_threads(self) -> int:
        """Threads for the training step while the engine idles: `idle_train_threads`, else every usable core."""
        if self.idle_train_threads is not None:
            return self.idle_train_threads
        return len(os.sched_getaffinity(0))

    def ignored_with_cuda(self) -> list[str]:
        """A warning for each CPU-only setting given (flag or environment) where CUDA makes it do nothing
        (`_CUDA_IGNORED`), naming its flag and variable; none without CUDA (`build_service` logs them)."""
        given = [name for name in _CUDA_IGNORED if name in self.model_fields_set]
        if not given or not _cuda_available():
            return []
        return [f"{name}={getattr(self, name)} (--{name.replace('_', '-')}, ART_TRAINER_{name.upper()}) does nothing "
                f"with CUDA: {_CUDA_IGNORED[name]}. Leave it out on a CUDA machine." for name in given]

    api_key: str | None = Field(
        default=None,
        validation_alias="ART_API_KEY",
        description="When set, every endpoint needs `Authorization: Bearer <key>` (env `ART_API_KEY`, the key the "
        "plugin sends to both services; like the collector's, it has no `ART_TRAINER_` variable); surrounding "
        "whitespace is dropped and a blank key counts as unset.",
    )
    # --- when it trains
    min_groups: int | None = Field(
        default=None, ge=1,
        description="Train whenever this many groups are ready at the collector (polled every `poll_seconds`); at most "
        "`batch_groups`, the most a step leases.",
    )
    every: str | None = Field(
        default=None, description=f"Train on an interval (a step when groups are ready): {DURATION_FORM}."
    )
    cron: str | None = Field(
        default=None, description="Train on a cron schedule (5 fields, e.g. `*/15 * * * *`, or `@hourly`, `@daily`, "
        "`@weekly`, ...), server local time (`TZ`, else /etc/localtime); days of week as in crontab (0 and 7: "
        "Sunday)."
    )
    poll_seconds: float = Field(
        default=15.0, ge=SHORTEST_INTERVAL_S, le=LONGEST_INTERVAL_S,
        description=f"How often `min_groups` asks the collector, in seconds: at least {SHORTEST_INTERVAL_S:g}, at most "
        f"{LONGEST_INTERVAL_S:.0f} ({duration_text(LONGEST_INTERVAL_S)}); only with `min_groups`."
    )
    # --- checkpoints
    keep_last: int | None = Field(
        default=None, ge=1, description="Keep this many newest checkpoints (plus the best and the promoted one); "
        "older ones are deleted and unloaded from vLLM. Default: every checkpoint is kept.",
    )
    keep_best_metric: str | None = Field(
        default=None, description="Also keep the checkpoint with the best value of this metric (with `keep_last`): "
        "`eval/reward` (with an eval set) or a metric each checkpoint records, e.g. `reward/mean`, `loss/policy`."
    )
    keep_best_mode: Literal["max", "min"] | None = Field(
        default=None, validate_default=True,
        description="Whether the best metric is the largest or smallest (of equal values, the newest step is kept). "
        "Default: `min` for a loss (`loss/policy`, `loss/kl`, `loss/total`, `loss/sft`), `max` otherwise.",
    )
    # --- promotion gate
    eval_file: Path | None = Field(
        default=None,
        description="JSONL eval set, one `{\"messages\": [...]}` chat prompt a line (other keys go to the reward).",
    )
    eval_split: str | None = Field(
        default=None, description="Take eval prompts from the collector's trajectories of this split (e.g. `val`)."
    )
    eval_reward: str | None = Field(
        default=None, description="Reward of an eval answer: `module:function(row, completion) -> float`."
    )
    eval_samples: int = Field(default=4, ge=1, description="Answers sampled per eval prompt.")
    eval_max_prompts: int = Field(default=32, ge=1, description="Most eval prompts used per evaluation.")
    eval_max_tokens: int = Field(default=64, ge=1, description="max_tokens of each eval answer; at most "
                                 "`max_model_len`.")
    eval_temperature: float = Field(default=1.0, ge=0, description="Sampling temperature of eval answers, 0 or more.")
    promotion_margin: float = Field(
        default=0.0, ge=0, description="`name@latest` moves to a new step unless its eval reward is below the "
        "promoted one's by more than this (0 or more).",
    )
    # --- metrics
    wandb: Literal["auto", "off"] = Field(
        default="auto",
        description="`auto`: log to Weights & Biases when `wandb` is installed (offline unless WANDB_MODE says "
        "otherwise).",
    )
    wandb_project: str = Field(default="art-langgraph", description="Weights & Biases project name.")

    @field_validator("collector")
    @classmethod
    def _check_collector(cls, value: str) -> str:
        """The collector's address must be an http(s) URL with a host: anything else fails every step."""
        return check_http_url(value, "http://localhost:4318")

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _vllm_args_json(cls, value: object) -> object:
        """`ART_TRAINER_VLLM_ARGS` is a JSON list: text that is not JSON stopped the start with pydantic-settings'
        "error parsing value for field", naming neither the variable nor the form it takes."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to read (was a traceback)
            raise ValueError(f"is not JSON ({exc}); ART_TRAINER_VLLM_ARGS is a JSON list of strings, e.g. "
                             "'[\"--enforce-eager\"]', or repeat --vllm-arg") from None

    @field_validator(*_REFUSED_EMPTY, mode="before")
    @classmethod
    def _refuse_empty(cls, value: object, info: ValidationInfo) -> object:
        """Refuse an empty folder or eval source (e.g. `ART_TRAINER_OUTPUT_DIR=`), naming its flag and variable: an
        empty `output_dir` read as `.` (checkpoints, metrics.jsonl and the vLLM log landed in the working folder,
        among its files), an empty `eval_file` too, and an empty `eval_split` turned the gate on for a split no
        trajectory has (every eval failed, nothing was promoted)."""
        if value != "":
            return value
        name = str(info.field_name)
        problem, unset = _REFUSED_EMPTY[name]
        raise ValueError(f"{problem}, or leave --{name.replace('_', '-')} (ART_TRAINER_{name.upper()}) out{unset}")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        """`.` and `..` name no folder of their own: the run folder `runs/<name>` was then `runs` itself or the
        working folder, where checkpoints, metrics.jsonl and the vLLM log landed among other files."""
        if value in (".", ".."):
            raise ValueError(f"makes the run folder runs/{value}, which is no folder of its own; give another --name "
                             "(ART_TRAINER_NAME)")
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _blank_key_is_unset(cls, value: object) -> object:
        """A blank key would lock every route (HTTP strips the header's whitespace): no key, as for the collector."""
        return configured_key(value)

    @field_validator("keep_best_mode")
    @classmethod
    def _mode_follows_the_metric(cls, value: str | None, info: ValidationInfo) -> str:
        """Unset, the mode follows `keep_best_metric`: a loss (`LOSS_METRICS`) is best at its smallest (`max` kept
        its highest)."""
        if value is not None:
            return value
        return "min" if info.data.get("keep_best_metric") in LOSS_METRICS else "max"

    @field_validator("vllm_dtype")
    @classmethod
    def _check_vllm_dtype(cls, value: str) -> str:
        """vLLM refused another dtype only once started, after the trainer had loaded the model."""
        dtypes = vllm_dtypes()
        if dtypes is not None and value.lower() not in dtypes:
            raise ValueError(f"vLLM takes only {', '.join(dtypes)} as --vllm-dtype (ART_TRAINER_VLLM_DTYPE); "
                             "float32 is the default")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _check_tool_call_parser(cls, value: str | None, info: ValidationInfo) -> str | None:
        """vLLM's launcher refused a parser it has not registered (`vllm_tool_parsers`) only once started; a
        `--tool-parser-plugin` among `vllm_args` that vLLM imports (longer than `_IGNORED_PLUGIN_CHARS`), or a vLLM
        general plugin of another package (vLLM loads it before the check), may register any name, so with one every
        name is taken. Names are compared as vLLM compares them, case and all (`NONE` is no `none`)."""
        parsers = vllm_tool_parsers()
        if value in (None, "none") or parsers is None or value in parsers:
            return value
        plugin = _vllm_arg_value(info.data.get("vllm_args", []), "--tool-parser-plugin")
        if (plugin is not None and len(plugin) > _IGNORED_PLUGIN_CHARS) or other_plugins():
            return value
        spelled = next((name for name in (*parsers, "none") if name.lower() == value.lower()), None)
        case = f" (names are case-sensitive: write {spelled!r})" if spelled else ""
        ignored = (f"; vLLM ignores --tool-parser-plugin={plugin!r}, as it imports only a value longer than "
                   f"{_IGNORED_PLUGIN_CHARS} characters" if plugin is not None else "")
        raise ValueError(f"vLLM has no tool-call parser {value!r}{case}; give one of {', '.join(parsers)}, none (no "
                         "tool parsing) as --tool-call-parser (ART_TRAINER_TOOL_CALL_PARSER), or register it with "
                         f"--vllm-arg=--tool-parser-plugin=<file>{ignored}")

    @field_validator("kv_cache_gib")
    @classmethod
    def _check_kv_cache_gib(cls, value: int) -> int:
        """vLLM-cpu refused a KV cache larger than the memory available only once started, after loading the model
        (100000 GiB was accepted here), or, in a container, one within the machine's memory but above its cgroups'
        limit (`cgroup_memory_limit`: the kernel killed it instead); with CUDA the value does nothing (a given one is
        warned of: `ignored_with_cuda`)."""
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limit = cgroup_memory_limit()
        memory = machine if limit is None else min(machine, limit)
        if value * 2**30 > memory and not _cuda_available():
            owner = ("this machine has" if memory == machine
                     else "the cgroups of this process (a container, a systemd slice, a batch job) may use")
            raise ValueError(f"{owner} {memory / 2**30:.1f} GiB of memory, less than that KV cache (vLLM-cpu "
                             "refuses one larger than the memory free at its start): lower --kv-cache-gib "
                             "(ART_TRAINER_KV_CACHE_GIB) or leave it out.")
        return value

    @field_validator("max_lora_rank")
    @classmethod
    def _check_max_lora_rank(cls, value: int) -> int:
        """vLLM takes only some ranks (`vllm_lora_ranks`), and refused another only at the end of its slow start."""
        ranks = vllm_lora_ranks()
        if ranks is not None and value not in ranks:
            raise ValueError(f"vLLM accepts only {', '.join(map(str, ranks))} as --max-lora-rank "
                             "(ART_TRAINER_MAX_LORA_RANK); set one of them, at least --lora-r.")
        return value

    def check_effective(self) -> None:
        """Refuse settings given (flag or environment) that nothing would read, so none is accepted and ignored: the
        promotion gate's tuning without an eval set, `poll_seconds` without `min_groups`, `keep_best_mode` without
        `keep_best_metric`, `keep_best_metric` without `keep_last` (or `eval/reward` without an eval set, or a name no
        checkpoint records: `metrics.is_checkpoint_metric`). The command line checks this; a caller that injects an
        evaluator need not.

        Raises:
            ValueError: names each such setting with its flag and variable, and what it needs.
        """
        given = self.model_fields_set
        unused: list[tuple[list[str], str]] = []
        gate = [name for name in _GATE_SETTINGS if name in given]
        if gate and self.eval_reward is None:
            unused.append((gate, "tune the promotion gate, which is off without an eval set (--eval-file or "
                                 "--eval-split, with --eval-reward)"))
        if "poll_seconds" in given and self.min_groups is None:
            unused.append((["poll_seconds"], "is how often --min-groups asks the collector, and --min-groups is unset"))
        if "keep_best_mode" in given and self.keep_best_metric is None:
            unused.append((["keep_best_mode"], "orders --keep-best-metric, which is unset"))
        if self.keep_best_metric is not None and self.keep_last is None:
            unused.append((["keep_best_metric"], "spares a checkpoint from --keep-last, which is unset (all are kept)"))
        if self.keep_best_metric == "eval/reward" and self.eval_reward is None:
            unused.append((["keep_best_metric"], "eval/reward is measured only with an eval set (--eval-file or "
                                                 "--eval-split, with --eval-reward)"))
        metric = self.keep_best_metric
        if metric is not None and metric != "eval/reward" and not is_checkpoint_metric(metric):  # a typo kept none
            names = ", ".join(sorted(CHECKPOINT_METRICS))
            unused.append((["keep_best_metric"], f"{metric!r} is no metric a checkpoint records: choose eval/reward "
                                                 f"(with an eval set), data/skipped/<reason> or one of {names}"))
        if unused:
            prefix = self.model_config.get("env_prefix", "")
            raise ValueError("; ".join(
                ", ".join(f"--{name.replace('_', '-')} ({prefix}{name.upper()})" for name in names) + f" {why}"
                for names, why in unused) + ". Set what they need or leave them out.")

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        refuse_key_name("ART_TRAINER_API_KEY")  # read until it was dropped: ignoring it would open the API
        if self.name == served_base_name(self.base_model):  # `name` resolves to name@latest: the base would be hidden
            raise ValueError(f"--name (ART_TRAINER_NAME) {self.name!r} is the name the base model is served under; "
                             "give the trained model another name")
        # vLLM reads a unique prefix of a flag as the flag (`--max-lora-r`); where its flags are unknown, ours stand in
        known = vllm_serve_flags() or frozenset({*_OWNED_VLLM_FLAGS, *(f"--no-{own[2:]}" for own in _OWNED_VLLM_FLAGS)})
        for arg in self.vllm_args:
            read_as = flags_read_as(arg, known) if arg.startswith("--") else ()
            flag = read_as[0].replace("--no-", "--", 1) if len(read_as) == 1 else None  # --no-enable-lora
            if flag in _OWNED_VLLM_FLAGS:
                own = _OWNED_VLLM_FLAGS[flag]
                fix = f"use the service's {own} instead" if own else "the service fixes it"
                raise ValueError(f"vllm_args sets {flag}, which the service sets itself (its checks and the trainer "
                                 f"rely on the value it passes): {fix}.")
        cpu_loras = _vllm_arg_value(self.vllm_args, "--max-cpu-loras")
        if cpu_loras is not None and cpu_loras.isdecimal() and int(cpu_loras) < self.max_loras:
            raise ValueError(f"vllm_args sets --max-cpu-loras={cpu_loras}, fewer than max_loras={self.max_loras}, "
                             "which vLLM refuses at the end of its start (its adapters in memory must hold a "
                             f"batch's). Raise that --vllm-arg (ART_TRAINER_VLLM_ARGS) to at least {self.max_loras}, "
                             f"lower --max-loras (ART_TRAINER_MAX_LORAS) to at most {cpu_loras}, or leave "
                             "--max-cpu-loras out (vLLM then takes --max-loras).")
        cores = len(os.sched_getaffinity(0))
        self._check_threads(cores)
        self._check_train_processes(cores)
        if self.kv_block_size is not None and self.kv_block_size > self.max_model_len:
            raise ValueError(f"kv_block_size={self.kv_block_size} is longer than max_model_len={self.max_model_len}: "
                             "no sequence fills such a block, and vLLM's prefix cache reuses whole blocks only. Lower "
                             "--kv-block-size (ART_TRAINER_KV_BLOCK_SIZE) to at most --max-model-len "
                             "(ART_TRAINER_MAX_MODEL_LEN), or leave it out.")
        if self.port == self.vllm_port and self.host in _COVERS_VLLM:
            clash = ("serves IPv6 alone: clients of 127.0.0.1 would reach vLLM, not the API" if self.host == "::"
                     else "includes: the API could not bind once vLLM has started")
            raise ValueError(f"port={self.port} is also vllm_port, and vLLM listens on 127.0.0.1:{self.vllm_port}, "
                             f"which host={self.host!r} {clash}. Give --port and --vllm-port different numbers.")
        if self.min_groups is not None or self.every is not None or self.cron is not None:
            check_schedule_timezone()
        if self.every is not None:
            parse_duration(self.every)
        if self.cron is not None:
            parse_cron(self.cron)
        if self.min_groups is not None and self.min_groups > self.batch_groups:
            raise ValueError(
                f"min_groups={self.min_groups} exceeds batch_groups={self.batch_groups}: a step leases at most "
                "batch_groups groups, so it would never reach min_groups and never train. Raise --batch-groups "
                "(ART_TRAINER_BATCH_GROUPS) to at least min_groups or lower --min-groups (ART_TRAINER_MIN_GROUPS)."
            )
        if self.eval_file is not None and self.eval_split is not None:
            raise ValueError("Set eval_file or eval_split, not both: they are two sources of eval prompts.")
        if (self.eval_file is not None or self.eval_split is not None) != (self.eval_reward is not None):
            raise ValueError("The promotion gate needs both eval prompts (--eval-file or --eval-split) and a reward "
                             "function (--eval-reward module:function); set both or neither.")
        if self.eval_reward is not None and ":" not in self.eval_reward:
            raise ValueError(f"eval_reward={self.eval_reward!r} must look like `module:function`.")
        if self.eval_reward is not None and self.eval_max_tokens > self.max_model_len:  # vLLM refused each eval answer
            raise ValueError(f"eval_max_tokens={self.eval_max_tokens} is more than max_model_len="
                             f"{self.max_model_len}: vLLM refuses a request for more tokens than that, so every "
                             "evaluation would fail and no step be promoted. Lower --eval-max-tokens "
                             "(ART_TRAINER_EVAL_MAX_TOKENS) or raise --max-model-len (ART_TRAINER_MAX_MODEL_LEN).")
        return self

    def _check_train_processes(self, cores: int) -> None:
        """Refuse more `torchrun` workers than visible CUDA devices, one each (it was found only as the service was
        built, and ended the start in a traceback), or on a CPU more than the `cores`, a thread at least each (1e20
        was accepted, and reached `torchrun` only at the first step, after vLLM's start)."""
        if self.train_processes < 2:
            return
        if _cuda_available():
            import torch

            if self.train_processes > torch.cuda.device_count():
                raise ValueError(f"train_processes={self.train_processes} but {torch.cuda.device_count()} CUDA "
                                 "device(s) are visible: lower --train-processes (ART_TRAINER_TRAIN_PROCESSES) or "
                                 "widen CUDA_VISIBLE_DEVICES.")
        elif self.train_processes > cores:
            raise ValueError(f"train_processes={self.train_processes}: this process may use {cores} cores, and each "
                             "worker takes one at least. Lower --train-processes (ART_TRAINER_TRAIN_PROCESSES) to at "
                             f"most {cores}.")

    def _check_threads(self, cores: int) -> None:
        """Refuse a thread count above the `cores` (oversubscribed, or a traceback once vLLM has started: torch takes
        no count past 2^31 - 1), an idle one below its side's own (it was raised to it, or turned lending off,
        silently), or a `VLLM_CPU_NUM_OF_RESERVED_CPU` sizing the step that leaves vLLM-cpu no core (it then
        reserves none; 1e20 passed the count check of the flags). With CUDA vLLM-cpu is not used and no core is lent:
        only the counts are checked (the variable's sizing refused a start it could not affect)."""
        for name in ("train_threads", "idle_train_threads", "idle_vllm_threads"):
            threads = getattr(self, name)
            if threads is not None and threads > cores:
                default = "the cores vLLM-cpu leaves free" if name == "train_threads" else "every core"
                raise ValueError(f"{name}={threads}: this process may use {cores} cores. Lower --"
                                 f"{name.replace('_', '-')} (ART_TRAINER_{name.upper()}) or leave it out ({default}).")
        if _cuda_available():
            return
        own = self.training_threads()
        if self.idle_train_threads is not None and self.idle_train_threads < own:
            raise ValueError(f"idle_train_threads={self.idle_train_threads} is below the step's own {own} threads "
                             "(--train-threads, else VLLM_CPU_NUM_OF_RESERVED_CPU), which it always has. Set "
                             f"--idle-train-threads (ART_TRAINER_IDLE_TRAIN_THREADS) to {own} to never lend, or leave "
                             "it out (every core).")
        if self.idle_vllm_threads is not None and self.idle_vllm_threads < cores - own:
            raise ValueError(f"idle_vllm_threads={self.idle_vllm_threads} is below vLLM's own {cores - own} threads "
                             f"(the {cores} cores less the step's {own}), which it always has. Set --idle-vllm-threads "
                             f"(ART_TRAINER_IDLE_VLLM_THREADS) to {cores - own} to never lend, or leave it out (every "
                             "core).")
        reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
        # the count vLLM reads (`own` is at least 1: 0 reserves none, and leaves vLLM a one-core machine's core)
        if self.train_threads is None and reserved is not None and int(reserved) >= cores:
            raise ValueError(f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved!r}: the cores vLLM-cpu reserves for the training "
                             f"step (its threads without --train-threads) must be fewer than the {cores} this process "
                             f"may use, or vLLM reserves none. Lower it below {cores}, unset it, or set "
                             "--train-threads (ART_TRAINER_TRAIN_THREADS).")

    @property
    def run_dir(self) -> Path:
        """The output folder: `output_dir`, or `runs/<name>` when unset."""
        return self.output_dir if self.output_dir is not None else Path("runs") / self.name

    def served_chat_template(self) -> str | None:
        """The chat template file vLLM renders with (the trainer re-tokenizes with it too); None: the model's own."""
        bundled = self.base_model.lower() == BUNDLED_MODEL.lower()
        template = self.chat_template or (str(BUNDLED_TOOL_TEMPLATE) if bundled else None)
        return template if template and template != "model" else None

    def tool_calling_args(self) -> list[str]:
        """vLLM flags for the chat template and tool-call parsing (see `chat_template`, `tool_call_parser`)."""
        bundled = self.base_model.lower() == BUNDLED_MODEL.lower()
        template = self.served_chat_template()
        parser = self.tool_call_parser or ("hermes" if bundled else None)
        args = ["--chat-template", template] if template else []
        if parser and parser != "none":
            args += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
        return args

    def structured_output_args(self) -> list[str]:
        """vLLM flags for structured outputs (see `json_whitespace`)."""
        if self.json_whitespace == "any":
            return []
        return ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
