"""Each bench script refuses a bad argument (a count below 1, a service address, a database URL) in one line, before
any set-up (an engine, a trainer, a model)."""

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


def _refusal(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
             work: str) -> str:
    """The one-line error `script` exits with (code 2) for `argv`; `work`, the script's first step of real work,
    fails the test if it is reached."""
    module = importlib.import_module(f"bench.{script}")

    def started(*_: object, **__: object) -> None:
        pytest.fail(f"{script}.py {' '.join(argv)} started {work} instead of refusing its arguments")

    monkeypatch.setattr(module, work, started)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_a_negative_overlapped_step_count_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refusal("train_throughput", ["--overlapped-steps", "-1"], monkeypatch, capsys, "run_side")
    assert line == "train_throughput.py: error: argument --overlapped-steps: must be at least 0, got -1"


@pytest.mark.parametrize(("flag", "value", "problem"), [
    ("--idle-train-threads", "0", "idle_train_threads=0: Input should be greater than or equal to 1"),
    ("--idle-vllm-threads", "4096", "idle_vllm_threads=4096: this process may use"),
])
def test_idle_thread_counts_the_service_refuses_are_refused_before_a_round(
    flag: str, value: str, problem: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refusal("train_throughput", [flag, value, "--skip-trl"], monkeypatch, capsys, "run_side")
    assert line.startswith(f"train_throughput.py: error: {problem}")


@pytest.mark.parametrize(("script", "argv", "work"), [
    ("serve_load", ["--trainer", "localhost:8000"], "trainer"),
    ("tracing_overhead", ["--trainer", "localhost:8000", "--collector", "http://127.0.0.1:4318"], "measure"),
    ("tracing_overhead", ["--trainer", "http://127.0.0.1:8000", "--collector", "127.0.0.1:4318"], "measure"),
])
def test_a_service_address_without_http_is_refused(
    script: str, argv: list[str], work: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = argv[0] if not argv[1].startswith("http") else argv[2]
    line = _refusal(script, argv, monkeypatch, capsys, work)
    assert line.startswith(f"{script}.py: error: argument {flag}: needs http:// or https:// and a host")


@pytest.mark.parametrize(("script", "work"), [("ingest", "make_exports"), ("run_all", "run")])
def test_a_postgres_url_the_collector_cannot_open_is_refused_before_the_sqlite_run(
    script: str, work: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refusal(script, ["--postgres", "postgres-at-localhost"], monkeypatch, capsys, work)
    assert line.startswith(f"{script}.py: error: argument --postgres: db='postgres-at-localhost': not a database URL")


@pytest.mark.parametrize(("script", "work"), [
    ("engine_dtype", "resolve_base_model"), ("lora_sampling", "resolve_base_model"), ("train_throughput", "run_side"),
])
@pytest.mark.parametrize("value", ["0", "70000"])
def test_a_vllm_port_out_of_range_is_refused_before_any_work(
    script: str, work: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a plain int: 70000 failed once the engine started (an OverflowError from its port check)."""
    line = _refusal(script, ["--vllm-port", value], monkeypatch, capsys, work)
    assert line == f"{script}.py: error: argument --vllm-port: must be a port from 1 to 65535, got {value}"
