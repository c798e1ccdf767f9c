"""The `ART_*` environment variables the three components read, and the set ones that none of them reads.

pydantic-settings ignores a variable under a settings class's prefix that names no field, so a misspelled one
(`ART_TRAINER_LORA_RANK`; the field is `lora_r`) left the default in force without a word. Both services refuse to
start on such a variable (`exit_on_unknown_env`); the plugin, which does not own the app's environment, warns. The
names are one set across the components (`known_env_names`): their prefixes overlap (`ART_COLLECTOR_URL` is the
plugin's, under the collector's `ART_COLLECTOR_`), and one environment often serves several of them.

pydantic-settings matches names in any case (`art_collector_url` sets the plugin's `collector_url`), so the check
does too wherever it does (`_is_known_env_name`): `art_trainer_lora_rank` is as wrong as `ART_TRAINER_LORA_RANK`. A
variable read as spelled (`READ_DIRECTLY`, `GRPOConfig.from_env`) is known only in that spelling.

The settings classes are imported when the names are first needed, not with this module: the plugin imports it, and
reading the plugin's own settings should not load the services' settings modules.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import fields
from functools import cache
from typing import NamedTuple

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

__all__ = [
    "PREFIX", "SERVICE_PREFIXES", "EnvName", "dataclass_settings", "exit_on_unknown_env", "known_env_names",
    "settings_classes", "settings_env_names", "under_prefix", "unknown_env_names", "unknown_env_problem",
]

PREFIX = "ART_"
"""The project's prefix: the plugin reads `ART_<FIELD>`, the services `ART_COLLECTOR_*` and `ART_TRAINER_*`."""

READ_DIRECTLY = ("ART_HOME", "ART_ALLOCATOR_PRELOADED", "ART_VLLM_CPU_MATMUL_DTYPE", "ART_VLLM_CPU_THREADS_FILE")
"""Variables read without a settings class: the data folder (`collector.config.art_home`), and those the trainer
sets for itself run again (`trainer_service.allocator`) and for its vLLM engine (`vllm_cpu_matmul`,
`vllm_cpu_threads`)."""

SERVICE_PREFIXES = ("ART_COLLECTOR_", "ART_TRAINER_")
"""The services' own prefixes: an unknown variable under one of them stops a service; another unknown `ART_*` one
(the plugin's form, or another tool's variable that happens to start with `ART_`) is only warned about."""

TOOL_PREFIXES = ("ART_BENCH_", "ART_TEST_")
"""Variables of the repository's benches and test suite (`ART_BENCH_POSTGRES`, `ART_TEST_STACK`), not of a
component: never reported."""


class EnvName(NamedTuple):
    """One variable a settings field reads."""

    field: str
    """The field, e.g. `port`."""
    name: str
    """The variable, e.g. `ART_COLLECTOR_PORT`."""
    prefix: str | None
    """The class's prefix when `name` is prefix + field name, None for an alias."""


def settings_classes() -> tuple[type[BaseSettings], ...]:
    """The pydantic-settings classes of the three components."""
    from art_langgraph._settings import Settings
    from collector.config import CollectorSettings
    from collector.scoring_config import JudgeSettings, LangfuseSettings
    from trainer_service.config import TrainerSettings

    return Settings, CollectorSettings, JudgeSettings, LangfuseSettings, TrainerSettings


def dataclass_settings() -> dict[type, str]:
    """The settings dataclasses, each with the prefix its `from_env` puts before the upper-cased field name."""
    from trainer_service.grpo_config import GRPOConfig

    return {GRPOConfig: "ART_TRAINER_"}


def settings_env_names(cls: type[BaseSettings]) -> Iterator[EnvName]:
    """The variables each field of a pydantic-settings class is documented to read: its alias or alias choices, else
    env prefix + field name; upper-cased unless the class is case-sensitive."""
    prefix = cls.model_config.get("env_prefix", "")
    upper = not cls.model_config.get("case_sensitive", False)
    for field, info in cls.model_fields.items():
        alias = info.validation_alias or info.alias
        if isinstance(alias, AliasChoices):
            names = [choice for choice in alias.choices if isinstance(choice, str)]
        else:
            names = [alias] if isinstance(alias, str) else [prefix + field]
        for name in names:
            yield EnvName(field, name.upper() if upper else name, None if alias else prefix)


def _read_by_field_name(cls: type[BaseSettings]) -> Iterator[str]:
    """Prefix + field name of each field that pydantic-settings also reads under it besides its alias
    (`populate_by_name`), such as `ART_COLLECTOR_API_KEY`: the class refuses it with its own message, which a "no
    setting reads it" must not pre-empt, and it is never suggested."""
    if cls.model_config.get("populate_by_name"):
        prefix = cls.model_config.get("env_prefix", "")
        yield from ((prefix + field).upper() for field in cls.model_fields)


@cache
def _meant_env_names() -> frozenset[str]:
    """The variables meant to be set: every field's of every settings class and dataclass, and `READ_DIRECTLY`."""
    names = set(READ_DIRECTLY)
    for cls in settings_classes():
        names.update(var.name for var in settings_env_names(cls))
    for cls, prefix in dataclass_settings().items():
        names.update(prefix + f.name.upper() for f in fields(cls))
    return frozenset(names)


@cache
def known_env_names() -> frozenset[str]:
    """Every variable a component reads: those meant to be set, and those a settings class reads to refuse."""
    return _meant_env_names().union(*(_read_by_field_name(cls) for cls in settings_classes()))


@cache
def _any_case_env_names() -> frozenset[str]:
    """The upper-cased variables of the settings classes that pydantic-settings reads in any case (not
    `case_sensitive`), those read to be refused (`_read_by_field_name`) included."""
    classes = [cls for cls in settings_classes() if not cls.model_config.get("case_sensitive", False)]
    return frozenset(var.name for cls in classes for var in settings_env_names(cls)).union(
        *(_read_by_field_name(cls) for cls in classes))


def _is_known_env_name(name: str) -> bool:
    """Whether a component reads `name`: as spelled, or in any case where pydantic-settings reads it."""
    return name in known_env_names() or name.upper() in _any_case_env_names()


def under_prefix(name: str, prefixes: str | tuple[str, ...]) -> bool:
    """Whether `name` is under one of `prefixes` (upper case) in any case, as pydantic-settings matches a prefix."""
    return name.upper().startswith(prefixes)


def unknown_env_names(environ: Mapping[str, str]) -> list[str]:
    """The variables of `environ` under `PREFIX` (in any case) that no component reads (`TOOL_PREFIXES` aside),
    sorted."""
    candidates = sorted(name for name in environ
                        if under_prefix(name, PREFIX) and not under_prefix(name, TOOL_PREFIXES))
    return [name for name in candidates if not _is_known_env_name(name)] if candidates else []


def _suggestion(name: str) -> str:
    """` (did you mean X or Y?)` with the variables meant to be set closest to `name`, or nothing when none is close.
    The cutoff is above difflib's 0.6, which the long prefix every name shares reaches on its own."""
    ours = sorted(known for known in _meant_env_names() if known.startswith(PREFIX))
    near = difflib.get_close_matches(name.upper(), ours, n=2, cutoff=0.8)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def unknown_env_problem(environ: Mapping[str, str], *, under: tuple[str, ...] = (PREFIX,)) -> str | None:
    """One line naming each variable of `environ` under a prefix of `under` that no component reads, with the
    closest known names and the fix, or None when there is none."""
    unknown = [name for name in unknown_env_names(environ) if under_prefix(name, under)]
    if not unknown:
        return None
    is_, them = ("is", "it") if len(unknown) == 1 else ("are", "them")
    return (f"{', '.join(name + _suggestion(name) for name in unknown)} {is_} set, but no setting reads {them}: "
            f"rename or unset {them} (the README lists every {PREFIX}* variable)")


def exit_on_unknown_env(parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """Stop a service's command line as a bad setting does (`parser.error`: one line, exit status 2) when `environ`
    holds a variable under `SERVICE_PREFIXES` that no component reads (`unknown_env_problem`); warn on stderr first
    about another unknown `ART_*` one."""
    others = {name: value for name, value in environ.items() if not under_prefix(name, SERVICE_PREFIXES)}
    if notice := unknown_env_problem(others):
        print(f"{parser.prog}: warning: {notice}", file=sys.stderr)
    if problem := unknown_env_problem(environ, under=SERVICE_PREFIXES):
        parser.error(problem)
