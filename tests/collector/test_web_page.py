"""The collector's web page in headless Chromium (Debian's `chromium`, installed by `make system-deps`).

A real collector (uvicorn, SQLite) serves the page; Chromium loads it, runs its JavaScript
against the read API and dumps the resulting DOM, which must list the seeded trajectories
and, on a trajectory's page, show its messages and judge explanation.
"""

from __future__ import annotations

import html
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.collector.seeding import group_spans, make_app
from tests.served import served as served_app

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    app = make_app(tmp_path, monkeypatch)
    app.state.store.add_spans(group_spans("sums", ["7", "The answer is 8"], rewards=[1.0, 0.0], steps=[0, 1]))
    app.state.scoring.scoring.save_judgements(
        "ruler", "sums", [{"trajectory_id": "sums-0", "score": 0.9, "explanation": "Right sum, short reply.",
                           "block": 1, "duplicate_of": None, "created_at": 0.0}]
    )
    with served_app(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        yield url


def chromium(url: str, profile: Path, *extra: str) -> str:
    """Load `url` in headless Chromium, let its scripts and fetches finish, return stdout."""
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=10000",
    ]
    done = subprocess.run([CHROMIUM, *flags, *extra, url], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def test_page_lists_trajectories_and_shows_messages(served: str, tmp_path: Path) -> None:
    listing = html.unescape(chromium(f"{served}/ui/#/", tmp_path / "profile", "--dump-dom"))
    assert 'id="trajectories"' in listing
    assert 'data-id="sums-0"' in listing and 'data-id="sums-1"' in listing
    assert 'id="reward-curve"' in listing
    assert "[assistant] The answer is 8" in listing

    detail = html.unescape(chromium(f"{served}/ui/#/t/sums-0", tmp_path / "profile", "--dump-dom"))
    assert 'id="messages"' in detail
    assert "What is 3 + 4?" in detail and "You add numbers." in detail
    assert "Right sum, short reply." in detail
    assert "ruler 0.900" in detail

    shot = tmp_path / "page.png"
    chromium(f"{served}/ui/#/", tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,900")
    assert shot.stat().st_size > 10_000


def test_batches_page_shows_a_released_batch_and_its_reason(served: str, tmp_path: Path) -> None:
    batch = httpx.post(f"{served}/v1/batches", json={"trainer": "t1"}).json()
    assert [g["id"] for g in batch["groups"]] == ["sums"]
    released = httpx.post(f"{served}/v1/batches/{batch['id']}/release",
                          json={"reason": "NonFiniteStepError: loss is nan"})
    assert released.status_code == 200
    page = html.unescape(chromium(f"{served}/ui/#/batches", tmp_path / "profile", "--dump-dom"))
    assert 'id="batches"' in page and "<td>released</td>" in page
    assert "NonFiniteStepError: loss is nan" in page and batch["id"][:12] in page
