"""Each bench script refuses a count below 1 in one line, before any set-up (an engine, a trainer, a model)."""

from __future__ import annotations

import importlib
import sys

import pytest

CASES = [
    ("token_logprobs", "--rows"),
    ("token_logprobs", "--vocab"),
    ("token_logprobs", "--rounds"),
    ("lora_sampling", "--rounds"),
    ("engine_dtype", "--steps"),
    ("serve_load", "--requests"),
    ("serve_load", "--max-tokens"),
    ("tracing_overhead", "--rounds"),
    ("tracing_overhead", "--max-tokens"),
    ("ingest", "--traces"),
    ("ingest", "--traces-per-export"),
    ("ingest", "--concurrency"),
    ("train_gpu", "--steps"),
    ("train_gpu", "--micro-batch-sizes"),
    ("sft_step", "--sequences"),
    ("sft_step", "--completion-tokens"),
    ("sft_step", "--steps"),
    ("sft_step", "--rounds"),
    ("train_throughput", "--rounds"),
]


@pytest.mark.parametrize(("script", "flag"), CASES)
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_count_below_one_is_refused_before_any_work(
    script: str, flag: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"bench.{script}")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", flag, value])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{script}.py: error: argument {flag}: must be at least 1, got {value}"
    )
