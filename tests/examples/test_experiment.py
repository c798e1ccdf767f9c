"""The examples' measured runs start every seed from the base model."""

from __future__ import annotations

from pathlib import Path

from examples.experiment import fresh_folder


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
