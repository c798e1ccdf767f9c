"""One SFT step: art-trainer's `sft_step` (the SFT warm start, `POST /v1/sft`) vs TRL's `SFTTrainer`.

The trainer runs its supervised step through its own packed loop rather than TRL's `SFTTrainer`;
this measures that choice on the same work. Same model (the bundled SmolLM2-135M-Instruct), same
LoRA (r=8, alpha=16, dropout 0, all attention and MLP projections), same optimizer (AdamW, learning
rate 1e-4 held constant, no weight decay, gradient norm clipped to 1), one optimizer step per step,
the loss on completion tokens only, and the same token ids: `--sequences` chat-templated prompts
(the training bench's arithmetic questions), each followed by `--completion-tokens` tokens drawn
at random from the vocabulary, seeded (a step's cost does not depend on what the tokens say). Art
gets them as groups of one rewarded trajectory (`sft_step` trains the best of each group), TRL as a
pre-tokenized dataset with a `completion_mask` column, in one batch. Every completion has the same
length, so both losses are the mean negative log-likelihood of the completion tokens (art's: the
mean over trajectories of each one's mean; TRL's: the mean over the batch's tokens), and each
step's loss must agree up to the rounding of each side's precision: the largest gap is printed.

Each side runs in its default precision here, as in `train_throughput.py` (TRL `bf16=True`
autocast, art `train_dtype=auto`: bf16 base weights on a CPU with AMX or AVX512-BF16; `--precision
float32` runs both in fp32, where the losses agree to float rounding), on every
core (no vLLM runs), in a fresh process each round on the service's allocator (`--allocator`),
alternating art and TRL `--rounds` times. Art warms up first, as `art-trainer serve` does at start
(not timed). `--steps` steps are timed on each side: the first (TRL's cold) and the later, warm
ones; printed: medians over the rounds, tokens/s and the ratios.

    PYTHONPATH=. .venv/bin/python bench/sft_step.py [--sequences 32] [--completion-tokens 64] [--steps 3]
                                                    [--rounds 3] [--precision default|float32] [--allocator auto]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.grpo_batch import question
from bench.options import positive_int
from bench.train_throughput import StepClock, run_side
from collector.protocol import Group, Sequence, Trajectory
from trainer_service.allocator import allocator_library, loaded_allocator
from trainer_service.base_model import BUNDLED_MODEL, resolve_base_model
from trainer_service.grpo_config import GRPOConfig
from trainer_service.huge_pages import enable_huge_pages
from trainer_service.training import LoRATrainer

LEARNING_RATE = 1e-4


def sft_batch(tokenizer: Any, sequences: int, completion_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Each sequence's token ids (a templated question, then random tokens) and its completion mask."""
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    vocabulary = [token for token in range(len(tokenizer)) if token not in special]
    batch = []
    for _ in range(sequences):
        messages = [{"role": "user", "content": question(rng.randint(10, 99), rng.randint(10, 99))}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        completion = rng.choices(vocabulary, k=completion_tokens)
        batch.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    return batch


def run_ours(model_path: str, batch: list[tuple[list[int], list[int]]], steps: int, dtype: str) -> dict[str, Any]:
    """Art's `sft_step` `steps` times on `batch` in `dtype` (`auto` or `float32`), after the service's warm-up."""
    trainer = LoRATrainer.load(model_path, GRPOConfig(learning_rate=LEARNING_RATE, train_dtype=dtype),  # type: ignore[arg-type]
                               cpu_threads=os.cpu_count() or 1)
    warm_up_s = trainer.warm_up()
    groups = [Group(id=str(index), trajectories=[Trajectory(
        id=str(index), trace_id="0" * 32, group_id=str(index), reward=1.0,
        sequences=[Sequence(token_ids=ids, logprobs=[0.0 if trained else None for trained in mask],
                            assistant_mask=mask)])])
              for index, (ids, mask) in enumerate(batch)]
    times, losses = [], []
    for _ in range(steps):
        started = time.perf_counter()
        metrics = trainer.sft_step(groups)
        times.append(time.perf_counter() - started)
        losses.append(metrics["loss/sft"])
    return {"step_s": times, "loss": losses, "warm_up_s": warm_up_s}


def run_trl(model_path: str, batch: list[tuple[list[int], list[int]]], steps: int, workdir: Path,
            bf16: bool) -> dict[str, Any]:
    """TRL's `SFTTrainer`, `steps` optimizer steps, each on the whole `batch` in one batch (bf16 autocast or fp32)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    dataset = Dataset.from_dict({"input_ids": [ids for ids, _ in batch], "completion_mask": [m for _, m in batch]})
    args = SFTConfig(output_dir=str(workdir / "trl"), per_device_train_batch_size=len(batch),
                     gradient_accumulation_steps=1, max_steps=steps, learning_rate=LEARNING_RATE,
                     lr_scheduler_type="constant", use_cpu=True,
                     bf16=bf16, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                     completion_only_loss=True, max_length=None)
    lora = GRPOConfig().lora_config()  # art's LoRA: r=8, alpha 16, every projection
    ends: list[float] = []
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset, peft_config=lora,
                         callbacks=[StepClock(ends)])
    started = time.perf_counter()
    trainer.train()
    if len(ends) != steps:
        raise RuntimeError(f"TRL ran {len(ends)} steps; expected {steps}")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"step_s": [end - begin for begin, end in itertools.pairwise([started, *ends])], "loss": losses}


def report(ours: list[dict[str, Any]], trl: list[dict[str, Any]], tokens: int, trained: int, steps: int) -> None:
    """Medians over the rounds per step kind, tokens/s, ratios, and each step's loss on both sides."""
    print(f"batch: {tokens} tokens a step ({trained} of them completion tokens, which carry the loss); "
          f"allocator {ours[0]['allocator']}; medians of {len(ours)} rounds, each side in a fresh process")
    print(f"art's warm-up (as the service starts, not timed): {statistics.median(r['warm_up_s'] for r in ours):.1f} s")
    kinds = [("step 1, a fresh trainer's first", [0])]
    if steps > 1:
        kinds.append((f"steps 2-{steps}, warm" if steps > 2 else "step 2, warm", list(range(1, steps))))
    for label, indexes in kinds:
        art_s = statistics.median(r["step_s"][i] for r in ours for i in indexes)
        trl_s = statistics.median(r["step_s"][i] for r in trl for i in indexes)
        print(f"== {label}")
        print(f"art-trainer sft_step : {art_s:.2f} s ({tokens / art_s:.0f} tok/s)")
        print(f"TRL SFTTrainer       : {trl_s:.2f} s ({tokens / trl_s:.0f} tok/s)")
        rounds = [statistics.median(t["step_s"][i] for i in indexes)
                  / statistics.median(a["step_s"][i] for i in indexes) for a, t in zip(ours, trl, strict=True)]
        print(f"  ratio (art / TRL tokens/s): {trl_s / art_s:.2f}x; in each round: "
              + " ".join(f"{ratio:.2f}x" for ratio in rounds))
    art_loss, trl_loss = ours[0]["loss"], trl[0]["loss"]
    gap = max(abs(a - t) for a, t in zip(art_loss, trl_loss, strict=True))
    print(f"loss of each step (round 1): art {' '.join(f'{x:.4f}' for x in art_loss)}, TRL "
          f"{' '.join(f'{x:.4f}' for x in trl_loss)} (largest gap {gap:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=positive_int, default=32,
                        help="sequences a step trains (the best trajectory of as many groups)")
    parser.add_argument("--completion-tokens", type=positive_int, default=64, help="completion tokens of each sequence")
    parser.add_argument("--steps", type=positive_int, default=3,
                        help="steps timed on each side: the first, then warm ones")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="alternating rounds of art and TRL, each side in a fresh process; figures are medians")
    parser.add_argument("--precision", choices=["default", "float32"], default="default",
                        help="default: each side's default here (TRL bf16 autocast; art bf16 base weights where the "
                        "CPU has AMX or AVX512-BF16, else fp32); float32: both in fp32, where the losses agree closely")
    parser.add_argument("--allocator", default="auto",
                        help="memory allocator of both sides, as `art-trainer serve --allocator` (auto: TCMalloc "
                        "where installed)")
    parser.add_argument("--worker", choices=["art", "trl"], help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from transformers import AutoTokenizer

        enable_huge_pages()  # as `art-trainer serve` does; TRL's process gets them as well
        model_path = resolve_base_model(BUNDLED_MODEL)
        torch.manual_seed(0)
        batch = sft_batch(AutoTokenizer.from_pretrained(model_path), args.sequences, args.completion_tokens)
        result = (run_ours(model_path, batch, args.steps, "auto" if args.precision == "default" else "float32")
                  if args.worker == "art"
                  else run_trl(model_path, batch, args.steps, args.worker_out.parent, args.precision == "default"))
        result["tokens"] = sum(len(ids) for ids, _ in batch)
        args.worker_out.write_text(json.dumps({**result, "allocator": loaded_allocator() or "system"}))
        return
    try:
        library = allocator_library(args.allocator)
    except ValueError as exc:
        parser.error(str(exc))
    ours: list[dict[str, Any]] = []
    trl: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sft-bench-") as tmp:
        for round_ in range(args.rounds):
            ours.append(run_side("art", library, Path(tmp) / f"art-{round_}.json", __file__))
            trl.append(run_side("trl", library, Path(tmp) / f"trl-{round_}.json", __file__))
            print(f"round {round_ + 1}/{args.rounds}: art " + ", ".join(f"{s:.2f}" for s in ours[-1]["step_s"])
                  + " s; TRL " + ", ".join(f"{s:.2f}" for s in trl[-1]["step_s"]) + " s", flush=True)
    report(ours, trl, ours[0]["tokens"], args.sequences * args.completion_tokens, args.steps)


if __name__ == "__main__":
    main()
