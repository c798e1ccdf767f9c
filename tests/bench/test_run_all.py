"""`make bench`'s writer keeps RESULTS.md whole when `--only` runs overlap, and says where each section ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import run_all


def test_a_section_written_meanwhile_by_another_run_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "RESULTS.md"
    section_b = run_all.render(run_all.Section("b", "B", [sys.executable, "-c", ""]), "figures of b", 0, 1.0)
    # While section a runs, a second `--only b` run finishes and writes RESULTS.md with its section.
    write_b = f"import pathlib; pathlib.Path({str(results)!r}).write_text({section_b!r}); print('figures of a')"
    chosen = [
        run_all.Section("a", "A", [sys.executable, "-c", write_b]),
        run_all.Section("b", "B", [sys.executable, "-c", "raise SystemExit('not chosen')"]),
    ]
    monkeypatch.setattr(run_all, "RESULTS", results)
    monkeypatch.setattr(run_all, "sections", lambda seeds, postgres: chosen)
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--only", "a"])
    run_all.main()
    kept = run_all.kept_sections(results.read_text())
    assert list(kept) == ["a", "b"]
    assert "figures of a" in kept["a"] and "exit 0" in kept["a"]
    assert f", on {run_all.cpu_name()}, " in kept["a"], "each section names the CPU it ran on"
    assert "figures of b" in kept["b"]
