"""The collector's web page in headless Chromium (Debian's `chromium`, installed by `make system-deps`).

A real collector (uvicorn, SQLite) serves the page; Chromium loads it, runs its JavaScript
against the read API and dumps the resulting DOM, which must list the seeded trajectories
and, on a trajectory's page, show its messages and judge explanation.
"""

from __future__ import annotations

import asyncio
import html
import re
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import Request, Response
from fastapi.responses import HTMLResponse

from tests.collector import span_builders as sb
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


def test_trajectory_page_shows_messages_whose_content_list_holds_odd_parts(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenAI-format messages are kept as recorded: a content list may hold a null or a plain string
    app = make_app(tmp_path, monkeypatch)
    asked = [{"role": "user", "content": [None, "Plain part.", {"type": "text", "text": "What is 3 + 4?"}]}]
    app.state.store.add_spans([
        sb.llm(1, rollout="odd", start=10, prompt=[1, 2], completion=[3], messages=asked,
               output=[{"role": "assistant", "content": "7"}]),
        sb.rollout(2, "odd", group="g", size=1),
    ])
    with served_app(app) as url:
        page = html.unescape(chromium(f"{url}/ui/#/t/odd", tmp_path / "profile", "--dump-dom"))
    assert 'class="error"' not in page
    assert "null\nPlain part.\nWhat is 3 + 4?" in page


NAVIGATE_WHILE_LOADING = """<!doctype html><body><pre id="shown"></pre><iframe id="page" src="/ui/#/"></iframe><script>
const page = document.getElementById("page");
page.addEventListener("load", () => { page.contentWindow.location.hash = "#/groups"; });
setInterval(() => {
  const app = page.contentDocument && page.contentDocument.getElementById("app");
  if (app) document.getElementById("shown").textContent = page.contentWindow.location.hash + " " + app.innerHTML;
}, 20);
</script></body>"""
"""Opens the trajectory list, whose reward curve is slow, and goes to the groups before it has loaded."""


def test_a_view_still_loading_does_not_replace_the_one_navigated_to(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, monkeypatch)
    app.state.store.add_spans(group_spans("sums", ["7", "8"], rewards=[1.0, 0.0], steps=[0, 1]))

    @app.middleware("http")
    async def slow_curve(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path == "/v1/view/reward-curve":
            await asyncio.sleep(1.5)
        return await call_next(request)

    @app.get("/navigate.html")
    def navigate() -> HTMLResponse:
        return HTMLResponse(NAVIGATE_WHILE_LOADING)

    with served_app(app) as url:
        dom = chromium(f"{url}/navigate.html", tmp_path / "profile", "--dump-dom")
    match = re.search(r'<pre id="shown">(.*?)</pre>', dom, re.S)
    assert match is not None
    shown = html.unescape(match.group(1))
    assert shown.startswith("#/groups ")
    assert 'id="groups"' in shown and 'id="trajectories"' not in shown
