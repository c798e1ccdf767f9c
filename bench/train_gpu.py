"""The training part of one GRPO step on a CUDA GPU: art's `LoRATrainer` vs TRL's `GRPOTrainer`.

The GPU counterpart of `train_throughput.py`'s training part (a GPU machine here has no vLLM and
no model downloads, so the whole step is not compared). Same model (SmolLM2-135M's shape and
tokenizer, random bf16 weights: speed does not depend on the values), same LoRA (r=8, alpha=16,
every attention and MLP projection), same batch shape (8 prompts x 4 samples x 64 completion
tokens, EOS ignored), rewards drawn at random per sample so every group has a spread, no KL,
gradient checkpointing on and off for both. Art trains completions sampled once with
`transformers` `generate` (not timed); TRL samples its own each step and its generation time
is subtracted from its step. Art packs each micro-batch's sequences into one row: timed at its
default size (64 sequences with CUDA: here the whole batch in one pass) and at
`--micro-batch-sizes` (1: one sequence per pass, the trainer before packing), on one trainer. Each side
runs one warm-up step, then `--steps` timed steps; printed: the median step time, tokens/s
(batch tokens / time), peak GPU memory, and the ratio to TRL.

    PYTHONPATH=. python bench/train_gpu.py --model-dir DIR [--steps 3] [--skip-trl] [--micro-batch-sizes 4 1]
                                           [--gradient-checkpointing both]

DIR holds `config.json` and the tokenizer files of the model to shape (default: the bundled
SmolLM2-135M-Instruct folder in the art cache, where it has been prepared).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from bench.options import positive_int
from collector.config import art_home
from collector.protocol import Group, Sequence, Trajectory
from trainer_service.base_model import BUNDLED_MODEL
from trainer_service.grpo_config import GRPOConfig
from trainer_service.training import LoRATrainer

PROMPTS = 8
SAMPLES = 4
COMPLETION_TOKENS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def questions() -> list[str]:
    rng = random.Random(0)
    return [f"What is {rng.randint(10, 99)}+{rng.randint(10, 99)}? Reply with only the number."
            for _ in range(PROMPTS)]


def random_model(model_dir: Path, target: Path) -> Path:
    """Save a model of `model_dir`'s shape with random bf16 weights, and its tokenizer, to `target`."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, target / name)
    return target


def sampled_groups(trainer: LoRATrainer, rewards: random.Random) -> list[Group]:
    """PROMPTS groups of SAMPLES completions sampled from the policy, with its own logprobs."""
    tokenizer = trainer.tokenizer
    assert tokenizer is not None
    model = trainer.model
    model.eval()
    groups = []
    for index, question in enumerate(questions()):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_dict=False)
        ids = torch.tensor([prompt] * SAMPLES, device=trainer.device)
        with torch.no_grad():
            torch.manual_seed(index)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 max_new_tokens=COMPLETION_TOKENS, min_new_tokens=COMPLETION_TOKENS,
                                 pad_token_id=tokenizer.eos_token_id)
            logits = model(input_ids=out).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, out[:, 1:, None])[..., 0]
        trajectories = []
        for sample in range(SAMPLES):
            tokens = out[sample].tolist()
            lps: list[float | None] = [None] * len(prompt) + logprobs[sample, len(prompt) - 1 :].tolist()
            mask = [0] * len(prompt) + [1] * COMPLETION_TOKENS
            trajectories.append(Trajectory(
                id=f"{index}-{sample}", trace_id="0" * 32, group_id=str(index), reward=rewards.random(),
                sequences=[Sequence(token_ids=tokens, logprobs=lps, assistant_mask=mask)],
            ))
        groups.append(Group(id=str(index), trajectories=trajectories))
    return groups


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def run_ours(model_path: Path, steps: int, checkpointing: bool, micro_batch_sizes: list[int | None]
             ) -> dict[int | None, dict[str, float]]:
    """Median step time and peak memory of art's trainer at each micro-batch size (one trainer)."""
    config = GRPOConfig(learning_rate=1e-4, gradient_checkpointing=checkpointing)
    trainer = LoRATrainer.load(str(model_path), config, device="cuda")
    groups = sampled_groups(trainer, random.Random(0))
    tokens = sum(len(s.token_ids) for g in groups for t in g.trajectories for s in t.sequences)
    trainer.step(groups)  # warm-up
    results = {}
    for size in micro_batch_sizes:
        trainer.config = dataclasses.replace(config, micro_batch_size=size)
        torch.cuda.reset_peak_memory_stats()
        times = [timed(partial(trainer.step, groups)) for _ in range(steps)]
        results[size] = {"step_s": statistics.median(times), "tokens": tokens,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del trainer
    torch.cuda.empty_cache()
    return results


class _StepClock(TrainerCallback):
    """Wall time of each optimizer step of a `transformers` Trainer (the GPU synchronized)."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.ends: list[float] = []

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        torch.cuda.synchronize()
        self.begins.append(time.perf_counter())

    def on_step_end(self, *_: Any, **__: Any) -> None:
        torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def run_trl(model_path: Path, workdir: Path, steps: int, checkpointing: bool) -> dict[str, float]:
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    rewards = random.Random(0)

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [rewards.random() for _ in completions]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions()]})
    args = TRLConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, max_completion_length=COMPLETION_TOKENS, max_steps=1 + steps, learning_rate=1e-4,
        beta=0.0, bf16=True, gradient_checkpointing=checkpointing, report_to=[], logging_strategy="no",
        disable_tqdm=True, save_strategy="no",
        generation_kwargs={"min_new_tokens": COMPLETION_TOKENS}, seed=0, shuffle_dataset=False,
        model_init_kwargs={"dtype": torch.bfloat16},
    )
    lora = GRPOConfig().lora_config()  # art's LoRA: r=8, alpha 16, every projection
    clock = _StepClock()
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=reward, args=args, train_dataset=dataset,
                          peft_config=lora, callbacks=[clock])
    generate_times: list[float] = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **k: Any) -> Any:
        torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            torch.cuda.synchronize()
            generate_times.append(time.perf_counter() - started)

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign]
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    step_times = [end - begin - gen for begin, end, gen in zip(clock.begins, clock.ends, generate_times, strict=True)]
    result = {"step_s": statistics.median(step_times[1:]), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del trainer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=art_home() / "models" / BUNDLED_MODEL,
                        help="folder with config.json and tokenizer files of the model to shape (weights not read)")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per side, after one warm-up step")
    parser.add_argument("--skip-trl", action="store_true", help="only time art's trainer")
    parser.add_argument("--micro-batch-sizes", type=positive_int, nargs="*", default=[4, 1],
                        help="art's micro-batch sizes to time besides the default, with checkpointing on; "
                        "1 is one sequence per pass, the trainer before packing")
    parser.add_argument("--gradient-checkpointing", choices=["on", "off", "both"], default="both",
                        help="time both sides with gradient checkpointing on, off, or both")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; on a CPU run bench/train_throughput.py")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir / 'config.json'} not found: pass --model-dir")
    print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"batch {PROMPTS} prompts x {SAMPLES} samples x {COMPLETION_TOKENS} completion tokens")
    with tempfile.TemporaryDirectory(prefix="train-gpu-") as tmp:
        model_path = random_model(args.model_dir, Path(tmp) / "model")
        for checkpointing in {"on": [True], "off": [False], "both": [True, False]}[args.gradient_checkpointing]:
            label = f"gradient checkpointing {'on ' if checkpointing else 'off'}"
            trl = None if args.skip_trl else run_trl(model_path, Path(tmp), args.steps, checkpointing)
            if trl is not None:
                print(f"{label} | TRL                     : {trl['step_s'] * 1000:7.1f} ms, "
                      f"peak {trl['peak_gib']:.2f} GiB",
                      flush=True)
            sizes = [None, *args.micro_batch_sizes] if checkpointing else [None]
            for size, ours in run_ours(model_path, args.steps, checkpointing, sizes).items():
                ratio = f" | ratio (art / TRL tokens/s) {trl['step_s'] / ours['step_s']:.2f}x" if trl else ""
                name = "default" if size is None else f"{size:7d}"
                print(f"{label} | art micro-batch {name} : {ours['step_s'] * 1000:7.1f} ms "
                      f"({ours['tokens'] / ours['step_s']:6.0f} tok/s), peak {ours['peak_gib']:.2f} GiB{ratio}",
                      flush=True)


if __name__ == "__main__":
    main()
