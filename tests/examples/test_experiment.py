"""The examples' measured runs start every seed from the base model, and refuse bad options before starting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples import experiment
from examples.experiment import Example, SeedResult, fresh_folder


def test_a_seed_folder_from_an_earlier_run_is_emptied(tmp_path: Path) -> None:
    seed = tmp_path / "seed-0"
    (seed / "trainer" / "checkpoints" / "step-8").mkdir(parents=True)  # what the trainer would resume
    (seed / "collector.db").write_text("earlier groups")
    (tmp_path / "results.json").write_text("{}")

    fresh_folder(seed)

    assert seed.is_dir() and not any(seed.iterdir())
    assert (tmp_path / "results.json").exists()  # only the seed's own folder goes


def test_a_new_seed_folder_is_created(tmp_path: Path) -> None:
    fresh_folder(tmp_path / "runs" / "seed-1")
    assert (tmp_path / "runs" / "seed-1").is_dir()


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--steps", "-1"], "--steps must be at least 0, got -1"),
        (["--sft-steps", "-2"], "--sft-steps must be at least 0, got -2"),
        (["--groups", "0"], "--groups must be at least 1, got 0"),
        (["--n", "1"], "--n must be at least 2, got 1"),
        (["--eval-size", "0"], "--eval-size must be at least 1, got 0"),
        (["--learning-rate", "0"], "--learning-rate must be a positive finite number, got 0.0"),
        (["--learning-rate", "nan"], "--learning-rate must be a positive finite number, got nan"),
        (["--learning-rate", "inf"], "--learning-rate must be a positive finite number, got inf"),
        (["--seeds", "0", "1", "0"], "--seeds names a seed twice (0 1 0)"),
        (["--seeds", "0", "10", "--steps", "10"], "--seeds 10: its training steps would reach its held-out inputs"),
        (["--seeds", "-91", "--sft-steps", "910"], "--seeds -91: its training steps would reach its held-out inputs"),
        (["--workdir", "pyproject.toml"], "--workdir pyproject.toml is a file, not a folder"),
        (["--workdir", "pyproject.toml/a"], "--workdir pyproject.toml/a cannot be created: pyproject.toml is a file"),
    ],
)
def test_a_bad_option_is_refused_before_any_service_starts(
    argv: list[str], error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Example("toy", "toy", build_agent=lambda: None, inputs=lambda count, seed: [], score=lambda i, o: 0.0)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "runs" / "toy" / "seed-0").mkdir(parents=True)  # an earlier run, which must survive
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(experiment, "measure", lambda *args: pytest.fail("started a run"))

    with pytest.raises(SystemExit) as exited:
        experiment.main(example, argv)

    assert exited.value.code == 2
    assert f"error: {error}" in capsys.readouterr().err.strip().splitlines()[-1]
    assert (tmp_path / "runs" / "toy" / "seed-0").is_dir()


def test_a_workdir_that_cannot_be_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Example("toy", "toy", build_agent=lambda: None, inputs=lambda count, seed: [], score=lambda i, o: 0.0)
    monkeypatch.setattr(experiment.os, "access", lambda path, mode: Path(path) != tmp_path)  # root writes anywhere

    with pytest.raises(SystemExit):
        experiment.parse_args(example, ["--workdir", str(tmp_path / "runs")], None)

    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(f"--workdir {tmp_path / 'runs'} cannot be created: {tmp_path} is not writable")


def test_zero_steps_measure_the_base_model(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Example("toy", "toy", build_agent=lambda: None, inputs=lambda count, seed: [], score=lambda i, o: 0.0)
    args = experiment.parse_args(example, ["--steps", "0", "--seeds", "3", "4"], None)
    assert (args.steps, args.seeds) == (0, [3, 4])


def test_a_seed_whose_steps_stop_short_of_its_held_out_inputs_is_accepted() -> None:
    example = Example("toy", "toy", build_agent=lambda: None, inputs=lambda count, seed: [], score=lambda i, o: 0.0)
    args = experiment.parse_args(example, ["--seeds", "10", "--steps", "9", "--sft-steps", "2"], None)
    assert (args.seeds, args.steps) == ([10], 9)  # step 10 of seed 10 would draw seed 10010's inputs


def test_a_run_that_fails_at_a_later_seed_keeps_the_results_of_the_seeds_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = Example("toy", "toy", build_agent=lambda: None, inputs=lambda count, seed: [], score=lambda i, o: 0.0)

    def run_seed(example: Example, seed: int, workdir: Path) -> SeedResult:
        if seed == 2:
            raise RuntimeError("art-trainer exited with 1 while starting")
        return SeedResult(seed, 0.25, 0.5, [], [0.3], [], 0, 60.0, 90.0, 1)

    monkeypatch.setattr(experiment, "run_seed", run_seed)
    with pytest.raises(RuntimeError):
        experiment.measure(example, [0, 1, 2], tmp_path)

    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["seed"] for r in results["seeds"]] == [0, 1] and results["gain_mean"] == pytest.approx(0.25)
    assert (tmp_path / "reward_curves.png").stat().st_size > 0
