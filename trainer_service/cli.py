"""`art-trainer`: command line of the trainer service.

`art-trainer serve` starts vLLM with the base model, the LoRA trainer and the OpenAI-compatible
API. Flags override `ART_TRAINER_*` environment variables, which override the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import fcntl
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from collector.config import settings_error
from collector.env_names import exit_on_unknown_env
from collector.listen import bind_address, start_listening
from trainer_service.allocator import preload_allocator
from trainer_service.config import TrainerSettings
from trainer_service.grpo_config import OPTIONAL_FIELDS, GRPOConfig, split_modules
from trainer_service.huge_pages import enable_huge_pages
from trainer_service.vllm_source import flags_read_as, vllm_serve_flags

__all__ = ["build_parser", "check_vllm_args", "configure_logging", "main", "settings_from_args"]

# flag → TrainerSettings field (help text comes from the field's description)
_SETTINGS_FLAGS: dict[str, tuple[str, type]] = {
    "--host": ("host", str),
    "--port": ("port", int),
    "--base-model": ("base_model", str),
    "--name": ("name", str),
    "--collector": ("collector", str),
    "--output-dir": ("output_dir", str),
    "--vllm-port": ("vllm_port", int),
    "--vllm-dtype": ("vllm_dtype", str),
    "--vllm-matmul-dtype": ("vllm_matmul_dtype", str),
    "--kv-cache-gib": ("kv_cache_gib", int),
    "--kv-block-size": ("kv_block_size", int),
    "--max-model-len": ("max_model_len", int),
    "--max-lora-rank": ("max_lora_rank", int),
    "--max-loras": ("max_loras", int),
    "--vllm-startup-timeout": ("vllm_startup_timeout", float),
    "--chat-template": ("chat_template", str),
    "--tool-call-parser": ("tool_call_parser", str),
    "--json-whitespace": ("json_whitespace", str),
    "--batch-groups": ("batch_groups", int),
    "--train-threads": ("train_threads", int),
    "--idle-train-threads": ("idle_train_threads", int),
    "--idle-vllm-threads": ("idle_vllm_threads", int),
    "--allocator": ("allocator", str),
    "--train-processes": ("train_processes", int),
    "--train-step-timeout": ("train_step_timeout", float),
    "--min-groups": ("min_groups", int),
    "--every": ("every", str),
    "--cron": ("cron", str),
    "--poll-seconds": ("poll_seconds", float),
    "--keep-last": ("keep_last", int),
    "--keep-best-metric": ("keep_best_metric", str),
    "--keep-best-mode": ("keep_best_mode", str),
    "--eval-file": ("eval_file", str),
    "--eval-split": ("eval_split", str),
    "--eval-reward": ("eval_reward", str),
    "--eval-samples": ("eval_samples", int),
    "--eval-max-prompts": ("eval_max_prompts", int),
    "--eval-max-tokens": ("eval_max_tokens", int),
    "--eval-temperature": ("eval_temperature", float),
    "--promotion-margin": ("promotion_margin", float),
    "--wandb": ("wandb", str),
    "--wandb-project": ("wandb_project", str),
}
_CHOICES: dict[str, list[str]] = {
    "keep_best_mode": ["max", "min"],
    "json_whitespace": ["compact", "any"],
    "wandb": ["auto", "off"],
    "loss": ["ppo", "cispo"],
    "importance_sampling": ["token", "sequence"],
    "max_seq_len_policy": ["truncate", "skip"],
    "train_dtype": ["auto", "float32", "bfloat16"],
    "vllm_matmul_dtype": ["auto", "float32", "bfloat16"],
}

# flag → GRPOConfig field (help text comes from the field's metadata)
_GRPO_FLAGS: dict[str, tuple[str, type]] = {
    "--learning-rate": ("learning_rate", float),
    "--loss": ("loss", str),
    "--epsilon": ("epsilon", float),
    "--epsilon-high": ("epsilon_high", float),
    "--delta": ("delta", float),
    "--max-grad-norm": ("max_grad_norm", float),
    "--weight-decay": ("weight_decay", float),
    "--lora-r": ("lora_r", int),
    "--lora-alpha": ("lora_alpha", int),
    "--lora-dropout": ("lora_dropout", float),
    "--micro-batch-size": ("micro_batch_size", int),
    "--micro-batch-tokens": ("micro_batch_tokens", int),
    "--train-dtype": ("train_dtype", str),
    "--max-seq-len": ("max_seq_len", int),
    "--max-seq-len-policy": ("max_seq_len_policy", str),
    "--importance-sampling": ("importance_sampling", str),
    "--kl-coef": ("kl_coef", float),
}


_LOCK_FILE = "trainer.lock"
"""The run folder's lock (`_lock_run_dir`), holding the process id of the trainer that runs there."""


def _lock_run_dir(run_dir: Path) -> IO[str]:
    """Take the lock of `run_dir`, an advisory `flock` on its `trainer.lock` that lasts while the returned file is
    open, so it ends with this process however it ends (SIGKILL too); write this process id into it.

    Two trainers on one folder would both write `step-N` and `metrics.jsonl` and delete each other's checkpoints
    (retention, leftovers removed at start). Only the service takes it: its `torchrun` workers write where it says.

    Raises:
        OSError: another process holds the lock (the message names it), or the folder cannot be written.
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = (run_dir / _LOCK_FILE).open("a+")
    except OSError as exc:
        raise OSError(f"the run folder {run_dir} cannot be written ({exc}); give another --output-dir.") from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise OSError(f"the run folder {run_dir} is in use by another trainer (process {holder}): both would write "
                      "its checkpoints and metrics.jsonl and delete each other's checkpoints. Stop that one, or give "
                      "this one another --output-dir (or --name).") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
    except OSError as exc:  # a full disk: the lock is taken, its process id does not fit
        with contextlib.suppress(OSError):  # the same failure again: closing flushes what is still buffered
            handle.close()
        raise OSError(f"the run folder {run_dir} cannot be written ({exc}); free disk space or give another "
                      "--output-dir.") from exc
    return handle


def check_vllm_args(args: Sequence[str]) -> None:
    """Refuse a `--vllm-arg` flag the installed vLLM does not have (`vllm_serve_flags`), as vLLM's parser reads it:
    `_` as `-`, a `--flag.key` of a JSON flag by its `--flag`, and a unique prefix of a flag (`flags_read_as`); so is
    a prefix of several, which vLLM refuses as ambiguous. Values and short flags (`-tp`) are left to vLLM. Such a flag
    stopped vLLM ~10 s into its start, in a traceback ending its usage text.

    Raises:
        ValueError: names the flag and the closest flags vLLM has, or the flags an ambiguous prefix begins.
    """
    known = vllm_serve_flags() if any(arg.startswith("--") for arg in args) else None
    for arg in args if known else []:
        flag = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if not flag.startswith("--") or flag == "--":
            continue
        read_as = flags_read_as(flag, known)
        if len(read_as) > 1:
            shown = ", ".join(read_as[:4]) + (", ..." if len(read_as) > 4 else "")
            raise ValueError(f"--vllm-arg {arg}: {flag} begins {len(read_as)} flags of the installed vLLM ({shown}), "
                             "and vLLM refuses such an ambiguous prefix; write the whole flag.")
        if not read_as:
            negated = flag.startswith("--no-")  # a `--no-` form is suggested for one only
            near = difflib.get_close_matches(flag, sorted(own for own in known if own.startswith("--no-") == negated))
            hint = f"Did you mean {' or '.join(near)}? " if near else ""
            raise ValueError(f"--vllm-arg {arg}: the installed vLLM has no flag {flag}. {hint}It lists its flags with "
                             "`python -m vllm.entrypoints.openai.api_server --help`.")


def _or_none(kind: type) -> Callable[[str], Any]:
    """The argparse type of a GRPO flag that None turns off (`--max-grad-norm none`): `none`, or a `kind` value."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse's "invalid float value" names it
    return parse


def _flag_help(description: str, name: str, default: Any, takes_none: bool = False) -> str:
    """The help of the flag of setting `name`: its description, then its variable and its default. A None default
    is shown only for a flag that takes `none` (`takes_none`): no value of another flag gives None, and its
    description says what leaving it unset does (e.g. `Default: 32 without CUDA, ...`)."""
    said = [f"env ART_TRAINER_{name.upper()}"]
    if default is not None or takes_none:
        said.append(f"default: {default}{'; none for None' if takes_none else ''}")
    return f"{description} [{', '.join(said)}]"


def build_parser() -> argparse.ArgumentParser:
    """Return the `art-trainer` argument parser."""
    parser = argparse.ArgumentParser(
        prog="art-trainer",
        description="Serve a model with vLLM and train LoRA checkpoints on it with GRPO.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="Start vLLM, the trainer and the OpenAI-compatible API.",
        description="Serve the base model and its checkpoints (`NAME@N`, `NAME@latest`) through an "
        "OpenAI-compatible API, and train on batches from the collector on `POST /v1/train`. Every flag "
        "overrides its ART_TRAINER_* environment variable; ART_API_KEY sets the API key.",
    )
    service = serve.add_argument_group("service (env ART_TRAINER_<FIELD>)")
    for flag, (name, kind) in _SETTINGS_FLAGS.items():
        info = TrainerSettings.model_fields[name]
        # SUPPRESS: an absent flag leaves the attribute unset, so the environment decides.
        service.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, choices=_CHOICES.get(name),
                             help=_flag_help(str(info.description), name, info.default))
    service.add_argument(
        "--no-warm-up", dest="warm_up", action="store_false", default=argparse.SUPPRESS,
        help="Start without the trainer's warm-up passes; the first steps then pay for fresh memory. "
        "[env ART_TRAINER_WARM_UP=false]")
    service.add_argument(
        "--vllm-arg", dest="vllm_args", action="append", default=argparse.SUPPRESS, metavar="ARG",
        help="Extra argument passed to vLLM as is; repeat for several (e.g. --vllm-arg=--enforce-eager). "
        "[env ART_TRAINER_VLLM_ARGS, a JSON list]",
    )
    defaults = {f.name: f.default for f in fields(GRPOConfig)}
    checkpointing = _flag_help(f"{GRPOConfig.help('gradient_checkpointing')} Set it to true or false.",
                               "gradient_checkpointing", defaults["gradient_checkpointing"], takes_none=True)
    grpo = serve.add_argument_group(
        "GRPO (env ART_TRAINER_<FIELD>)", description=f"No flag sets gradient checkpointing, only its variable: "
        f"{checkpointing}")
    for flag, (name, kind) in _GRPO_FLAGS.items():
        optional = name in OPTIONAL_FIELDS
        grpo.add_argument(flag, dest=name, type=_or_none(kind) if optional else kind, default=argparse.SUPPRESS,
                          choices=_CHOICES.get(name), help=_flag_help(GRPOConfig.help(name), name, defaults[name],
                                                                      takes_none=optional))
    grpo.add_argument("--target-modules", dest="target_modules", type=split_modules,
                      default=argparse.SUPPRESS, help=f"{GRPOConfig.help('target_modules')} Comma-separated. "
                      "[env ART_TRAINER_TARGET_MODULES]")
    grpo.add_argument("--no-scale-rewards", dest="scale_rewards", action="store_false", default=argparse.SUPPRESS,
                      help="Do not divide advantages by the group's reward standard deviation. "
                      "[env ART_TRAINER_SCALE_REWARDS=false]")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="Log level of the service and uvicorn; a flag only, with no environment variable. "
                       "[default: %(default)s]")
    return parser


def settings_from_args(args: argparse.Namespace) -> tuple[TrainerSettings, GRPOConfig]:
    """Build the settings (flags over environment) and the GRPO config from parsed flags; refuse settings nothing
    would read (`TrainerSettings.check_effective`)."""
    overrides = {name: getattr(args, name) for name, _ in _SETTINGS_FLAGS.values() if hasattr(args, name)}
    for name in ("vllm_args", "warm_up"):  # flags outside `_SETTINGS_FLAGS`
        if hasattr(args, name):
            overrides[name] = getattr(args, name)
    settings = TrainerSettings(**overrides)
    settings.check_effective()
    check_vllm_args(settings.vllm_args)
    grpo_names = [name for name, _ in _GRPO_FLAGS.values()] + ["target_modules", "scale_rewards"]
    grpo = GRPOConfig.from_env(**{name: getattr(args, name) for name in grpo_names if hasattr(args, name)})
    grpo.check_against(settings)
    return settings, grpo


def configure_logging(level: str) -> None:
    """Log at `level` (`--log-level`). At any level but debug, APScheduler's two lines per job run ("Running job",
    "executed successfully": 12 a minute at the default `--poll-seconds`, while nothing is ready) are left out: the
    schedule logs each run's outcome itself."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level.upper() != "DEBUG":
        logging.getLogger("apscheduler.executors").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `art-trainer` console script.

    Called without `argv` (the console script, `python -m trainer_service.cli`), it first runs its own
    command line again on the `--allocator` library; with `argv` (in-process callers) it never does. A second
    `serve` on one run folder exits at start (`_lock_run_dir`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_on_unknown_env(parser)  # a misspelled ART_* variable, which the settings would ignore
    try:
        settings, grpo = settings_from_args(args)
    except ValidationError as exc:
        parser.error(settings_error(exc))
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(args.log_level)
    if argv is None:  # the console script: its own command line can run again; a caller's in-process argv cannot
        try:
            allocator = preload_allocator(settings.allocator)  # may exec this process again, before anything loads
        except ValueError as exc:
            parser.error(str(exc))
        logging.getLogger("trainer_service").info("memory allocator: %s", allocator or "system")
    fix = "free that port, or give another --port (ART_TRAINER_PORT) or --host (ART_TRAINER_HOST)."
    try:  # after the allocator's run again (which would drop it), before seconds of imports and vLLM's minutes
        sock = bind_address(settings.host, settings.port, fix)
    except ValueError as exc:
        parser.error(str(exc))
    enable_huge_pages()  # before the model loads: PyTorch reads it at its first large allocation

    from trainer_service.base_model import BaseModelError
    from trainer_service.checkpoint_checks import CheckpointMismatchError
    from trainer_service.engine_errors import EngineError
    from trainer_service.evaluation import EvalError
    from trainer_service.server import create_app, serve

    try:
        lock = _lock_run_dir(settings.run_dir)  # before anything reads or writes the run folder
    except OSError as exc:
        sock.close()
        parser.exit(2, f"art-trainer: error: {exc}\n")
    with sock, lock:  # released when `serve` returns (in-process callers), else when the process ends
        try:
            app = create_app(settings, grpo)
        except (BaseModelError, CheckpointMismatchError, EvalError) as exc:
            parser.exit(2, f"art-trainer: error: {exc}\n")
        service = app.state.service
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C until uvicorn's handlers
        try:  # vLLM and the trainer, before the port opens; in the app's lifespan uvicorn showed a traceback
            service.start()
        except (BaseModelError, CheckpointMismatchError, EngineError, EvalError, OSError) as exc:  # vLLM stopped
            parser.exit(2, f"art-trainer: error: {exc}\n")  # anything else (a bug) keeps its traceback
        finally:
            signal.signal(signal.SIGTERM, previous)
        try:
            start_listening(sock, fix)
        except ValueError as exc:
            asyncio.run(service.aclose())  # vLLM and the trainer's clients, as the app's shutdown stops them
            parser.exit(2, f"art-trainer: error: {exc}\n")
        serve(app, sock, log_level=args.log_level)


if __name__ == "__main__":
    main()
