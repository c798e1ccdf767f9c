"""Tests for `art_langgraph._counts`: the plugin's process-wide locks and counts."""

from __future__ import annotations

import os

import pytest

from tests.art_langgraph.forking import run_child_of_held_lock


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_reentrant_lock_held_by_a_thread_at_fork_is_free_and_still_reentrant_in_the_child() -> None:
    """The pipeline's lock is taken again by the thread that holds it (a first span configures the pipeline under
    it): a forked child must get it free, and reentrant still, or the child hangs."""
    imports = "from art_langgraph import _counts\nlock = _counts.ProcessLock(reentrant=True)"
    out = run_child_of_held_lock(imports, "lock", """
        with lock:
            with lock:
                pass
        """)
    assert out.returncode == 0, out.stderr
