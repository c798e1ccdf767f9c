"""pyproject.toml declares every package the trainer imports, not only those it happens to get through another."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN_PACKAGES = {"trainer_service", "collector", "art_langgraph"}


def imported_modules(package: Path) -> set[str]:
    """Top-level names of the modules that the files of `package` import (at module level or in a function)."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - OWN_PACKAGES - {"__future__"}


def normalized(requirement: str) -> str:
    """The distribution name of a requirement such as `psycopg[binary]>=3.2`, normalized (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


def test_every_package_the_trainer_imports_is_a_declared_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {normalized(r) for r in project["dependencies"]}
    declared |= {normalized(r) for extra in project["optional-dependencies"].values() for r in extra}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {module: distributions.get(module) for module in imported_modules(ROOT / "trainer_service")
                  if not {normalized(d) for d in distributions.get(module, [module])} & declared}
    assert not undeclared, f"imported by trainer_service/ but not in pyproject.toml: {undeclared}"
