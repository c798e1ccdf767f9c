"""README.md documents every environment variable, CLI flag and endpoint, and names none that is gone.

The names come from the code: the settings classes (every pydantic-settings class in the three packages,
plus `GRPOConfig`, which `GRPOConfig.from_env` reads), the argparse parsers of the console scripts in
pyproject.toml, and the routes of the two FastAPI apps. The README is organised by component, so each name
must appear in its component's section. The trainer's section states that each `--flag` overrides
`ART_TRAINER_<FLAG>`; a variable named that way counts as documented with its flag. The trainer package's
docstring, its map of modules, names each module that exists and no other.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from tests.collector.server_helpers import collector_app
from trainer_service.grpo_config import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted(ROOT.glob("*/README.md"))]
"""What the reverse checks read: the README and the folder READMEs beside it (bench/, examples/)."""
PACKAGES = ("art_langgraph", "collector", "trainer_service")
SECTIONS = {
    "art_langgraph": "## The plugin: `art_langgraph`",
    "collector": "## The collector: `art-collector serve`",
    "trainer_service": "## The trainer: `art-trainer serve`",
}
"""The README section that documents each package's variables, flags and endpoints."""
DATACLASS_SETTINGS: dict[type, str] = {GRPOConfig: "ART_TRAINER_"}
"""Settings dataclasses and the prefix their `from_env` puts before the upper-cased field name."""
ENV_NAME = re.compile(r"ART_[A-Z0-9_]*[A-Z0-9]")
"""A project variable's name, matched whole against string constants of the code."""
DOC_ENV_NAME = re.compile(r"(?<!\w)ART_[A-Z0-9_]*[A-Z0-9](?![\w<*])")
"""A whole `ART_…` name in prose; `ART_TRAINER_<FLAG>` and `ART_*` are patterns, not names."""
DOC_ROUTE = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`?\s]*)")
"""An endpoint as the README writes it, `` `GET /v1/groups?state=` ``: method and path, without the query."""
PATH_CONVERTER = re.compile(r"\{(\w+):\w+\}")
"""A path parameter with a converter, `{group_id:path}`; the docs write it `{group_id}`."""


@dataclass(frozen=True)
class EnvVar:
    """One environment variable a settings field reads."""

    name: str
    """The variable, e.g. `ART_COLLECTOR_PORT`."""
    owner: str
    """The field that reads it, `module.Class.field`."""
    prefix: str | None
    """The class's prefix when the name is prefix + field name (no alias), else None."""

    @property
    def package(self) -> str:
        """The top-level package the field belongs to."""
        return self.owner.split(".")[0]

    @property
    def field(self) -> str:
        """The field's name."""
        return self.owner.rsplit(".", 1)[1]


@dataclass(frozen=True)
class Option:
    """One option string of a console script's parser."""

    flag: str
    """The option string, e.g. `--port`."""
    dest: str
    """The attribute it sets (the settings field for the trainer's flags)."""
    prog: str
    """The (sub)command it belongs to, e.g. `art-trainer serve`."""


@cache
def section(package: str) -> str:
    """The README text of a package's section: from its `## ` heading to the next one."""
    heading = SECTIONS[package]
    text = README.read_text()
    assert heading in text.splitlines(), f"README.md has no heading {heading!r}; update SECTIONS in {__file__}"
    after = text.split(heading + "\n", 1)[1]
    return heading + "\n" + re.split(r"^## ", after, maxsplit=1, flags=re.MULTILINE)[0]


def mentions(text: str, name: str) -> bool:
    """Whether `name` occurs in `text` as a whole word (`--port` does not match `--vllm-port`)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def settings_classes() -> list[type[BaseSettings]]:
    """Every class the three packages derive directly from `BaseSettings` (found in the source, then imported)."""
    found: list[type[BaseSettings]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and any(ast.unparse(base) == "BaseSettings" for base in node.bases):
                    module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
                    found.append(getattr(module, node.name))
    return found


def settings_env_vars(cls: type[BaseSettings]) -> Iterator[EnvVar]:
    """The variables each field of a pydantic-settings class reads: its aliases, else env prefix + field name."""
    prefix = cls.model_config.get("env_prefix", "")
    upper = not cls.model_config.get("case_sensitive", False)
    for field, info in cls.model_fields.items():
        alias = info.validation_alias or info.alias
        if isinstance(alias, AliasChoices):
            names = [choice for choice in alias.choices if isinstance(choice, str)]
        else:
            names = [alias] if isinstance(alias, str) else [prefix + field]
        for name in names:
            yield EnvVar(name.upper() if upper else name, f"{cls.__module__}.{cls.__qualname__}.{field}",
                         None if alias else prefix)


def env_vars() -> list[EnvVar]:
    """Every variable of every settings class and settings dataclass."""
    found = [var for cls in settings_classes() for var in settings_env_vars(cls)]
    for cls, prefix in DATACLASS_SETTINGS.items():
        found += [EnvVar(prefix + f.name.upper(), f"{cls.__module__}.{cls.__qualname__}.{f.name}", prefix)
                  for f in fields(cls)]
    return found


def console_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of each console script in pyproject.toml, by package: `build_parser()` beside its `main`."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    parsers: dict[str, argparse.ArgumentParser] = {}
    for script, target in scripts.items():
        module = importlib.import_module(target.split(":")[0])
        assert hasattr(module, "build_parser"), f"{script}: {module.__name__} has no build_parser() for this test"
        parsers[module.__name__.split(".")[0]] = module.build_parser()
    return parsers


def options(parser: argparse.ArgumentParser) -> Iterator[Option]:
    """The option strings of a parser and its subcommands, without `--help` and `argparse.SUPPRESS`-ed ones."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from options(sub)
        elif not isinstance(action, argparse._HelpAction) and action.help is not argparse.SUPPRESS:
            yield from (Option(flag, action.dest, parser.prog) for flag in action.option_strings)


def commands(parser: argparse.ArgumentParser) -> Iterator[str]:
    """The full names of a parser's subcommands, e.g. `art-collector serve`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub.prog
                yield from commands(sub)


def routes(app: FastAPI) -> set[str]:
    """`METHOD /path` of each route the app declares, path parameters without their converter.

    FastAPI's own /docs, /redoc and /openapi.json routes and static mounts are not `APIRoute`s.
    """
    found: set[str] = set()
    for route in app.routes:
        if isinstance(route, APIRoute):
            path = PATH_CONVERTER.sub(r"{\1}", route.path)
            found.update(f"{method} {path}" for method in route.methods)
    return found


def flag_rule_documents(var: EnvVar, text: str, opts: list[Option]) -> bool:
    """Whether `text` states "`PREFIX<FLAG>`" and documents a flag that sets `var`'s field under that name."""
    if var.prefix is None or f"`{var.prefix}<FLAG>`" not in text:
        return False
    return any(opt.dest == var.field and var.prefix + opt.flag.lstrip("-").upper().replace("-", "_") == var.name
               and mentions(text, opt.flag) for opt in opts)


def code_env_names() -> set[str]:
    """Every string constant in the code that is a whole `ART_…` name: the variables the code reads or sets.

    The strings of `__all__` are Python names (`ART_METADATA_KEY`), not variables.
    """
    names: set[str] = set()
    for folder in (*PACKAGES, "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            exported = {id(node) for stmt in tree.body if isinstance(stmt, ast.Assign)
                        and any(isinstance(target, ast.Name) and target.id == "__all__" for target in stmt.targets)
                        for node in ast.walk(stmt.value)}
            names.update(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                         and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value)
                         and id(node) not in exported)
    return names


def flag_table_flags(text: str) -> set[str]:
    """The flags in the first column of the tables headed `| flag | …`."""
    found: set[str] = set()
    in_table = False
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            in_table = False
        elif cells[0] == "flag":
            in_table = True
        elif in_table:
            found.update(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", cells[0]))
    return found


def section_report(title: str, names_by_package: dict[str, list[str]]) -> str:
    """A failure message: the title, then each package's README section with its names."""
    lines = [title]
    for package, names in sorted(names_by_package.items()):
        lines.append(f"  README.md, section {SECTIONS.get(package, package)!r}:")
        lines += [f"    {name}" for name in names]
    return "\n".join(lines)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ART_* or LANGFUSE_* variable of the machine reaches the settings the apps are built with."""
    for name in list(os.environ):
        if name.startswith(("ART_", "LANGFUSE_")):
            monkeypatch.delenv(name)


def build_trainer_app(tmp_path: Path) -> FastAPI:
    """The trainer's app over a service with a fake engine (tests/trainer_service/builders.py); nothing starts."""
    from tests.trainer_service.builders import FakeEngine, make_trainer
    from trainer_service.config import TrainerSettings
    from trainer_service.server import create_app
    from trainer_service.service import TrainerService

    settings = TrainerSettings(output_dir=tmp_path, wandb="off", base_model="tiny-llama")
    service = TrainerService(settings, GRPOConfig(), FakeEngine(), make_trainer)  # type: ignore[arg-type]
    return create_app(service=service)


APPS: dict[str, Callable[[Path], FastAPI]] = {"collector": collector_app, "trainer_service": build_trainer_app}


def test_every_settings_variable_is_documented_in_its_section() -> None:
    parsers = console_parsers()
    missing: dict[str, list[str]] = {}
    for var in env_vars():
        text = section(var.package)
        opts = list(options(parsers[var.package])) if var.package in parsers else []
        if not mentions(text, var.name) and not flag_rule_documents(var, text, opts):
            missing.setdefault(var.package, []).append(f"{var.name}  (read by {var.owner})")
    assert not missing, section_report("Environment variables missing from the README (add each to its section's "
                                       "table, with default and meaning):", missing)


def test_every_cli_flag_and_command_is_documented_in_its_section() -> None:
    missing: dict[str, list[str]] = {}
    for package, parser in console_parsers().items():
        text = section(package)
        missing_here = [f"{opt.flag}  ({opt.prog}, sets {opt.dest})" for opt in options(parser)
                        if not mentions(text, opt.flag)]
        missing_here += [f"command `{command}`" for command in commands(parser) if command not in text]
        if missing_here:
            missing[package] = missing_here
    assert not missing, section_report("CLI flags missing from the README (add each to its section's flag table):",
                                       missing)


def test_every_route_is_documented_in_its_section(tmp_path: Path, clean_env: None) -> None:
    missing: dict[str, list[str]] = {}
    for package, build in APPS.items():
        documented = {f"{method} {path}" for method, path in DOC_ROUTE.findall(section(package))}
        undocumented = sorted(routes(build(tmp_path / package)) - documented)
        if undocumented:
            missing[package] = [f"`{route}`" for route in undocumented]
    assert not missing, section_report("Endpoints missing from the README (add each to its section's endpoint table, "
                                       "path parameters named as in the route):", missing)


def test_documented_variables_exist() -> None:
    known = {var.name for var in env_vars()} | code_env_names()
    stale = {doc.relative_to(ROOT).as_posix(): sorted(set(DOC_ENV_NAME.findall(doc.read_text())) - known)
             for doc in DOCS}
    stale = {doc: names for doc, names in stale.items() if names}
    assert not stale, "The docs name ART_* variables no settings field or code reads (renamed or removed?):\n" + \
        "\n".join(f"  {doc}: {', '.join(names)}" for doc, names in stale.items())


def test_documented_flags_exist() -> None:
    stale: dict[str, list[str]] = {}
    for package, parser in console_parsers().items():
        flags = {opt.flag for opt in options(parser)}
        if gone := sorted(flag_table_flags(section(package)) - flags):
            stale[package] = gone
    assert not stale, section_report("Flags in the README's flag tables that the CLI does not have (renamed or "
                                     "removed?):", stale)


def test_the_trainer_package_docstring_names_every_module() -> None:
    import trainer_service

    named = set(re.findall(r"`(\w+)`", trainer_service.__doc__ or ""))
    modules = {path.stem for path in (ROOT / "trainer_service").glob("*.py") if path.stem != "__init__"}
    assert not modules - named, f"trainer_service/__init__.py's module map leaves out {sorted(modules - named)}"
    gone = {name for name in named if name.islower() and name not in modules}  # class names are capitalised
    assert not gone, f"trainer_service/__init__.py names modules that do not exist: {sorted(gone)}"
