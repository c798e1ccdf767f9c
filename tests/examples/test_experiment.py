"""The examples' measured runs start every seed from the base model, and refuse bad options before starting."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples import experiment
from examples.experiment import Example, fresh_folder


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
        (["--n", "0"], "--n must be at least 1, got 0"),
        (["--eval-size", "0"], "--eval-size must be at least 1, got 0"),
        (["--learning-rate", "0"], "--learning-rate must be positive, got 0.0"),
        (["--learning-rate", "nan"], "--learning-rate must be positive, got nan"),
        (["--seeds", "0", "1", "0"], "--seeds names a seed twice (0 1 0)"),
        (["--workdir", "pyproject.toml"], "--workdir pyproject.toml is a file, not a folder"),
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


def test_zero_steps_measure_the_base_model(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Example("toy", "toy", build_agent=lambda: None, inputs=lambda count, seed: [], score=lambda i, o: 0.0)
    args = experiment.parse_args(example, ["--steps", "0", "--seeds", "3", "4"], None)
    assert (args.steps, args.seeds) == (0, [3, 4])
