"""README.md documents every environment variable, CLI flag and endpoint, and names none that is gone.

The names come from the code: the settings classes (every pydantic-settings class in the three packages,
plus `GRPOConfig`, which `GRPOConfig.from_env` reads), the argparse parsers of the console scripts in
pyproject.toml, and the routes of the two FastAPI apps. The README is organised by component, so each name
must appear in its component's section. The trainer's section states that each `--flag` overrides
`ART_TRAINER_<FLAG>`; a variable named that way counts as documented with its flag. The trainer package's
docstring, its map of modules, names each module that exists and no other.

The other way round, the README names nothing that is gone, and its values are the code's: each endpoint of its
endpoint tables is served (with the query parameters it names, and naming every one the route takes), each default
its tables give as a literal is the flag's or variable's default, each `make` target it names exists, and each step
metric a checkpoint records and each span attribute of the plugin's contract is listed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, fields
from functools import cache
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import ValidationError
from pydantic_settings import BaseSettings
from starlette.routing import Mount, Route

from collector import env_names
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
DATACLASS_SETTINGS: dict[type, str] = env_names.dataclass_settings()
"""Settings dataclasses and the prefix their `from_env` puts before the upper-cased field name."""
ENV_NAME = re.compile(r"ART_[A-Z0-9_]*[A-Z0-9]")
"""A project variable's name, matched whole against string constants of the code."""
DOC_ENV_NAME = re.compile(r"(?<!\w)ART_[A-Z0-9_]*[A-Z0-9](?![\w<*])")
"""A whole `ART_…` name in prose; `ART_TRAINER_<FLAG>` and `ART_*` are patterns, not names."""
DOC_ROUTE = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`?\s]*)")
"""An endpoint as the README writes it, `` `GET /v1/groups?state=` ``: method and path, without the query."""
DOC_ENDPOINT = re.compile(DOC_ROUTE.pattern + r"(\?[^`\s]*)?`")
"""An endpoint as the README writes it, with its query: `` `GET /v1/view/batches?limit=` ``."""
PATH_CONVERTER = re.compile(r"\{(\w+):\w+\}")
"""A path parameter with a converter, `{group_id:path}`; the docs write it `{group_id}`."""
DOC_DEFAULT = re.compile(r"`([^`$]+)`(?=$|[\s;(])")
"""A value a README table's `default` cell begins with, `` `4318` (OTLP/HTTP) ``; `` `$ART_HOME/…` `` names a
variable, not a value."""


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
    default: object
    """The parser's default: None or `argparse.SUPPRESS` where the settings give it."""


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
    """The variables each field of a pydantic-settings class reads (`collector.env_names.settings_env_names`)."""
    for var in env_names.settings_env_names(cls):
        yield EnvVar(var.name, f"{cls.__module__}.{cls.__qualname__}.{var.field}", var.prefix)


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
            yield from (Option(flag, action.dest, parser.prog, action.default) for flag in action.option_strings)


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


def fastapi_pages(app: FastAPI) -> set[str]:
    """`GET /path` of the pages FastAPI makes for the app: the OpenAPI schema, Swagger UI and ReDoc."""
    return {f"GET {url}" for url in (app.openapi_url, app.docs_url, app.redoc_url) if url}


def served(app: FastAPI) -> set[str]:
    """`METHOD /path` of all the app answers: its routes, FastAPI's pages, `GET` of each static mount's folder."""
    found = routes(app)
    for route in app.routes:
        if isinstance(route, Mount):
            found.add(f"GET {route.path}/")
        elif isinstance(route, Route) and not isinstance(route, APIRoute):
            found.update(f"{method} {route.path}" for method in route.methods or ())
    return found


def query_parameters(app: FastAPI) -> dict[str, set[str]]:
    """The query parameters of each `METHOD /path` of the app that takes some."""
    found: dict[str, set[str]] = {}
    for route in app.routes:
        if isinstance(route, APIRoute) and (names := {param.alias for param in route.dependant.query_params}):
            path = PATH_CONVERTER.sub(r"{\1}", route.path)
            found.update({f"{method} {path}": names for method in route.methods})
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
            if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
                continue  # a hidden folder: e.g. the virtual environment `bench/ingest.py` makes for Phoenix
            tree = ast.parse(path.read_text())
            exported = {id(node) for stmt in tree.body if isinstance(stmt, ast.Assign)
                        and any(isinstance(target, ast.Name) and target.id == "__all__" for target in stmt.targets)
                        for node in ast.walk(stmt.value)}
            names.update(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                         and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value)
                         and id(node) not in exported)
    return names


def table_rows(text: str) -> Iterator[tuple[list[str], list[str]]]:
    """Each body row of the Markdown tables in `text`, as (the table's header cells, the row's cells).

    Cells are split at `|` but not at an escaped `\\|`; the `| --- |` line under a header is no row.
    """
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if header is None:
            header = cells
        elif not all(set(cell) <= set("-: ") for cell in cells):
            yield header, cells


def flag_table_flags(text: str) -> set[str]:
    """The flags in the first column of the tables headed `| flag | …`."""
    return {flag for header, cells in table_rows(text) if header[0] == "flag"
            for flag in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", cells[0])}


def endpoint_rows(package: str) -> list[tuple[str, str]]:
    """(first cell, whole row) of each row of the tables headed `| endpoint |` in a package's README section."""
    return [(cells[0], " | ".join(cells)) for header, cells in table_rows(section(package)) if header[0] == "endpoint"]


def top_level_items(cell: str) -> list[str]:
    """`cell` split at its commas outside backticks and parentheses: `` `8`, `16`, all (q, v) `` is three items."""
    items: list[str] = []
    depth, quoted, start = 0, False, 0
    for at, char in enumerate(cell):
        if char == "`":
            quoted = not quoted
        elif not quoted and char in "()":
            depth += 1 if char == "(" else -1
        elif char == "," and not quoted and depth == 0:
            items.append(cell[start:at].strip())
            start = at + 1
    return [*items, cell[start:].strip()]


def documented_defaults(package: str) -> Iterator[tuple[str, str]]:
    """(flag or variable, the value its table row gives as default) in a package's README section.

    A row names its flags (else its variables) in the columns before `default`, asides in parentheses aside; with
    several names the cell lists their defaults in order, comma-separated (`` `8001`, `float32`, … ``), and a row whose
    count differs is not read. Only a default the cell begins with as one literal (`DOC_DEFAULT`) is a value.
    """
    for header, cells in table_rows(section(package)):
        if "default" not in header:
            continue
        at = header.index("default")
        named = re.sub(r"\([^)]*\)", "", " ".join(cells[:at]))
        names = re.findall(r"`(--[a-z0-9-]+)[^`]*`", named) or re.findall(r"`([A-Z][A-Z0-9_]*)`", named)
        items = [cells[at]] if len(names) == 1 else top_level_items(cells[at])
        if len(items) == len(names):
            yield from ((name, value[1]) for name, item in zip(names, items, strict=True)
                        if (value := DOC_DEFAULT.match(item)))


def field_default(cls: type, name: str) -> object:
    """The default of a field of a pydantic-settings class or a dataclass, its factory called."""
    if issubclass(cls, BaseSettings):
        return cls.model_fields[name].get_default(call_default_factory=True)
    field = next(field for field in fields(cls) if field.name == name)
    return field.default_factory() if field.default is MISSING else field.default


def variable_defaults() -> dict[str, object]:
    """The default of each variable of every settings class and settings dataclass."""
    found = {var.name: field_default(cls, var.field) for cls in settings_classes() for var in settings_env_vars(cls)}
    for cls, prefix in DATACLASS_SETTINGS.items():
        found.update({prefix + field.name.upper(): field_default(cls, field.name) for field in fields(cls)})
    return found


def flag_defaults(package: str) -> dict[str, object]:
    """The default of each flag of a package's console script: the parser's, else that of the settings field it sets."""
    from collector.config import CollectorSettings
    from trainer_service.config import TrainerSettings

    settings: dict[str, tuple[type, ...]] = {"collector": (CollectorSettings,),
                                             "trainer_service": (TrainerSettings, GRPOConfig)}
    parsers = console_parsers()
    found: dict[str, object] = {}
    for opt in options(parsers[package]) if package in parsers else ():
        if opt.default not in (None, argparse.SUPPRESS):
            found[opt.flag] = opt.default
        elif owner := next((cls for cls in settings[package] if opt.dest in field_names(cls)), None):
            found[opt.flag] = field_default(owner, opt.dest)
    return found


def field_names(cls: type) -> set[str]:
    """The field names of a pydantic-settings class or a dataclass."""
    return set(cls.model_fields) if issubclass(cls, BaseSettings) else {field.name for field in fields(cls)}


def same_default(documented: str, value: object) -> bool:
    """Whether the README's `documented` default is `value`: `true`/`false` for a bool, any spelling of a number
    (`1e-4`, `600` for 600.0), a list comma-separated."""
    if isinstance(value, bool):
        return documented == str(value).lower()
    if isinstance(value, int | float):
        try:
            return float(documented) == value
        except ValueError:
            return False
    if isinstance(value, list | tuple):
        return documented == ",".join(map(str, value))
    return documented == str(value)


def section_report(title: str, names_by_package: dict[str, list[str]]) -> str:
    """A failure message: the title, then each package's README section with its names."""
    lines = [title]
    for package, names in sorted(names_by_package.items()):
        lines.append(f"  README.md, section {SECTIONS.get(package, package)!r}:")
        lines += [f"    {name}" for name in names]
    return "\n".join(lines)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ART_* or LANGFUSE_* variable of the machine, in any case, reaches the settings the apps are built with."""
    for name in list(os.environ):
        if name.upper().startswith(("ART_", "LANGFUSE_")):
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
        app = build(tmp_path / package)
        undocumented = sorted((routes(app) | fastapi_pages(app)) - documented)
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


def test_every_checkpoint_metric_is_documented() -> None:
    """`--keep-best-metric` takes any metric a checkpoint records, and the README says it refuses every name it does
    not list: so each is listed (`advantage/mean|std|min|max` names four)."""
    from trainer_service.metrics import CHECKPOINT_METRICS

    text = re.sub(r"`(\w+/)(\w+(?:\|\w+)+)`", lambda m: " ".join(f"`{m[1]}{name}`" for name in m[2].split("|")),
                  section("trainer_service"))
    missing = sorted(name for name in CHECKPOINT_METRICS if "/" in name and not mentions(text, name))
    assert not missing, section_report("Step metrics missing from the README (add each to the metrics paragraph):",
                                       {"trainer_service": missing})


def test_documented_routes_exist(tmp_path: Path, clean_env: None) -> None:
    stale: dict[str, list[str]] = {}
    for package, build in APPS.items():
        named = {f"{method} {path}" for cell, _ in endpoint_rows(package)
                 for method, path, _ in DOC_ENDPOINT.findall(cell)}
        if gone := sorted(named - served(build(tmp_path / package))):
            stale[package] = [f"`{route}`" for route in gone]
    assert not stale, section_report("Endpoints in the README's endpoint tables that the app does not serve (renamed, "
                                     "removed, or another method?):", stale)


def test_every_query_parameter_is_documented_and_exists(tmp_path: Path, clean_env: None) -> None:
    wrong: dict[str, list[str]] = {}
    for package, build in APPS.items():
        taken = query_parameters(build(tmp_path / package))
        rows: dict[str, str] = {}
        wrong_here: list[str] = []
        for cell, row in endpoint_rows(package):
            for method, path, query in DOC_ENDPOINT.findall(cell):
                route = f"{method} {path}"
                rows[route] = rows.get(route, "") + row
                wrong_here += [f"`{route}` names `{name}=`, which it does not take"
                               for name in re.findall(r"[?&](\w+)=", query) if name not in taken.get(route, set())]
        wrong_here += [f"`{route}` takes `{name}=`, which no endpoint row of it names"
                       for route, names in sorted(taken.items()) for name in sorted(names)
                       if not re.search(rf"[?&]{name}=", rows.get(route, ""))]
        if wrong_here:
            wrong[package] = wrong_here
    assert not wrong, section_report("Query parameters the README's endpoint rows get wrong:", wrong)


def test_documented_defaults_match_the_code(clean_env: None) -> None:
    variables = variable_defaults()
    wrong: dict[str, list[str]] = {}
    for package in SECTIONS:
        code = {**variables, **flag_defaults(package)}
        wrong_here = [f"{name}: README `{documented}`, code {code[name]!r}"
                      for name, documented in documented_defaults(package)
                      if code.get(name) is not None and not same_default(documented, code[name])]
        if wrong_here:
            wrong[package] = wrong_here
    assert not wrong, section_report("Defaults in the README's tables that differ from the code's:", wrong)


def test_documented_make_targets_exist() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    named = set(re.findall(r"(?:`|\$ )make ([\w-]+)", README.read_text()))
    assert not named - targets, f"README.md names make targets the Makefile lacks: {sorted(named - targets)}"


def test_every_span_attribute_is_documented() -> None:
    """The span contract (`art_langgraph/semconv.py`) is a wire format: each attribute and event name it declares is in
    the plugin's section (`gen_ai.usage.*` names every `gen_ai.usage.…`)."""
    import art_langgraph.semconv as semconv

    text = section("art_langgraph")
    prefixes = tuple(re.findall(r"`([\w.]+\.)\*`", text))
    names = {value for name, value in vars(semconv).items()
             if name.isupper() and isinstance(value, str) and "." in value}  # not the kinds' values, `llm`, `node`…
    missing = sorted(name for name in names if not mentions(text, name) and not name.startswith(prefixes))
    assert not missing, section_report("Span attributes and events missing from the README (add each to the span "
                                       "contract):", {"art_langgraph": missing})


def sets_field(monkeypatch: pytest.MonkeyPatch, cls: type[BaseSettings], field: str, name: str) -> bool:
    """Whether the variable `name`, set, gives `cls`'s `field` a value (False when the class refuses it)."""
    monkeypatch.setenv(name, "read-me")
    try:
        return getattr(cls(), field) is not None
    except ValidationError:  # refused with the fix, as TrainerSettings refuses ART_TRAINER_API_KEY
        return False
    finally:
        monkeypatch.delenv(name)


def test_no_aliased_field_also_reads_its_prefixed_name(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    """With `populate_by_name`, pydantic-settings reads an aliased field from env prefix + field name, in any case, as
    well as from its alias; `settings_env_vars` lists the aliases only, so such a second name must be refused, not
    read, whether spelled upper- or lower-case."""
    read: list[str] = []
    for cls in settings_classes():
        documented = {var.name for var in settings_env_vars(cls)}
        prefix = cls.model_config.get("env_prefix", "")
        for field, info in cls.model_fields.items():
            name = (prefix + field).upper()
            if cls.model_config.get("populate_by_name") and (info.validation_alias or info.alias) \
                    and name not in documented:
                read.extend(f"{spelling} (sets {cls.__module__}.{cls.__qualname__}.{field})"
                            for spelling in (name, name.lower()) if sets_field(monkeypatch, cls, field, spelling))
    assert not read, "Settings read variables besides their documented alias (refuse each, as TrainerSettings " \
        "refuses ART_TRAINER_API_KEY):\n" + "\n".join(f"  {line}" for line in read)


def test_the_unknown_variable_check_takes_the_names_of_every_settings_class() -> None:
    """`collector.env_names` names the settings classes whose variables are known; a class added since is found here."""
    assert set(env_names.settings_classes()) == set(settings_classes())


def test_no_variable_the_docs_or_the_code_name_counts_as_unknown(monkeypatch: pytest.MonkeyPatch,
                                                                  clean_env: None) -> None:
    """Each `ART_*` variable of the docs, the settings and the code, all set at once: the services start with them
    (`exit_on_unknown_env`) and the plugin names none of them."""
    named = {name for doc in DOCS for name in DOC_ENV_NAME.findall(doc.read_text())}
    for name in named | code_env_names() | {var.name for var in env_vars()}:
        monkeypatch.setenv(name, "1")
    assert env_names.unknown_env_names(os.environ) == []
    env_names.exit_on_unknown_env(argparse.ArgumentParser(prog="art-collector"))
