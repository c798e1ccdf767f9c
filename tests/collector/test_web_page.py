"""The collector's web page in headless Chromium (Debian's `chromium`, installed by `make system-deps`).

A real collector (uvicorn, SQLite) serves the page; Chromium loads it, runs its JavaScript
against the read API and dumps the resulting DOM, which must list the seeded trajectories
and, on a trajectory's page, show its messages and judge explanation.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import html
import json
import re
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from fastapi import Request, Response
from fastapi.responses import HTMLResponse

from art_langgraph import semconv as sc
from collector import assembly
from collector.langfuse_api import LangfuseSyncError
from collector.otlp import SpanEvent
from collector.read_protocol import LangfuseSyncResult
from examples.stack import free_port
from tests.collector import fake_langfuse
from tests.collector import span_builders as sb
from tests.collector.seeding import group_spans, make_app, trace_id
from tests.collector.test_langfuse_sync import app_for
from tests.collector.test_views import ODD_IDS
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
    assert 'id="langfuse"' not in listing and 'class="error"' not in listing  # Langfuse is not configured

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


def test_groups_page_shows_the_newest_hundred_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups page read every group of the store on each load; it asks for the newest 100 now."""
    app = make_app(tmp_path, monkeypatch)
    spans = [span for n in range(101) for span in group_spans(f"g{n:03d}", ["7"], rewards=[1.0], first_span=10 * n + 1)]
    app.state.store.add_spans(spans)
    with served_app(app) as url:
        page = html.unescape(chromium(f"{url}/ui/#/groups", tmp_path / "profile", "--dump-dom"))
    shown = re.findall(r'<a href="#/\?group=(g\d+)">', page)
    assert shown == [f"g{n:03d}" for n in range(100, 0, -1)]


def test_trajectory_page_shows_messages_whose_content_list_holds_odd_parts(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenAI-format messages are kept as recorded: a content list may hold a null, a plain string, or a part whose
    # text is no string (an object in one was shown as "[object Object]")
    app = make_app(tmp_path, monkeypatch)
    asked = [{"role": "user", "content": [None, "Plain part.", {"type": "text", "text": "What is 3 + 4?"},
                                          {"type": "text", "text": 7}, {"type": "text", "text": {"n": 1}}]}]
    app.state.store.add_spans([
        sb.llm(1, rollout="odd", start=10, prompt=[1, 2], completion=[3], messages=asked,
               output=[{"role": "assistant", "content": "7"}]),
        sb.rollout(2, "odd", group="g", size=1),
    ])
    with served_app(app) as url:
        page = html.unescape(chromium(f"{url}/ui/#/t/odd", tmp_path / "profile", "--dump-dom"))
    assert 'class="error"' not in page
    assert 'null\nPlain part.\nWhat is 3 + 4?\n7\n{"n":1}' in page


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


MEASURE_WIDTH = """<!doctype html><body><pre id="shown"></pre>
<iframe id="page" style="width: 900px; height: 600px; border: 0"></iframe><script>
const page = document.getElementById("page");
page.src = "/ui/" + location.hash;
setInterval(() => {
  const doc = page.contentDocument, app = doc && doc.getElementById("app");
  if (app && app.querySelector("table")) {
    const root = doc.documentElement;
    document.getElementById("shown").textContent = root.scrollWidth + " " + root.clientWidth;
  }
}, 20);
</script></body>"""
"""Shows `/ui/` + its own hash in a 900-pixel frame, and the frame's document width against the frame's."""


@pytest.mark.parametrize("view", ["#/", "#/t/long-0"])
def test_long_unbroken_text_wraps_instead_of_widening_the_page(view: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply, tool schema or task with no space in it (a URL, base64) made the page wider than the window."""
    app = make_app(tmp_path, monkeypatch)
    spans = group_spans("long", ["W" * 3000, "7"], rewards=[1.0, 0.0], task="T" * 200)
    spans[0].attributes[sc.GEN_AI_TOOL_DEFINITIONS] = json.dumps([{"name": "add", "description": "D" * 3000}])
    app.state.store.add_spans(spans)

    @app.get("/measure.html")
    def measure() -> HTMLResponse:
        return HTMLResponse(MEASURE_WIDTH)

    with served_app(app) as url:
        dom = chromium(f"{url}/measure.html{view}", tmp_path / "profile", "--dump-dom")
    match = re.search(r'<pre id="shown">(\d+) (\d+)</pre>', dom)
    assert match is not None, dom
    document_width, frame_width = int(match.group(1)), int(match.group(2))
    assert document_width <= frame_width


def test_the_list_links_to_the_older_trajectories_past_its_first_page(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The list showed the newest 100 trajectories and their total, with no way to reach the others."""
    app = make_app(tmp_path, monkeypatch)
    app.state.store.add_spans(group_spans("sums", ["7", "8", "9"], rewards=[1.0, 0.0, 0.5]))

    def shown(url: str) -> tuple[list[str], dict[str, str]]:
        dom = html.unescape(chromium(url, tmp_path / "profile", "--dump-dom"))
        return re.findall(r'data-id="([^"]+)"', dom), dict(re.findall(r'<a id="(newer|older)" href="([^"]+)"', dom))

    with served_app(app) as url:
        first, links = shown(f"{url}/ui/#/?limit=2&task=add")
        assert first == ["sums-2", "sums-1"] and set(links) == {"older"}
        rest, links = shown(f"{url}/ui/{links['older']}")
        assert rest == ["sums-0"] and set(links) == {"newer"}
        again, _ = shown(f"{url}/ui/{links['newer']}")
    assert again == first


def test_a_trajectory_with_any_legal_id_opens_from_the_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page read `/v1/view/trajectories/{id}`: for an id `.` or `..` the browser dropped the dot segment and
    showed a 404 (`no trajectory ''`, `Not Found`)."""
    app = make_app(tmp_path, monkeypatch)
    with monkeypatch.context() as before:  # a store written before ingest refused ids with a `.` or `..` segment
        before.setattr(assembly, "span_problem", lambda _: None)
        app.state.store.add_spans(sb.rollout_group({tid: 0.5 for tid in ODD_IDS}))
    with served_app(app) as url:
        listing = chromium(f"{url}/ui/#/", tmp_path / "profile", "--dump-dom")
        links = re.findall(r'<td><a href="(#/t/[^"]*)">', listing)
        assert len(links) == len(ODD_IDS)
        shown = []
        for link in links:
            page = html.unescape(chromium(f"{url}/ui/{html.unescape(link)}", tmp_path / "profile", "--dump-dom"))
            assert 'class="error"' not in page, link
            shown.extend(re.findall(r"<h2>Trajectory <code>(.*?)</code></h2>", page, re.S))
    assert sorted(shown) == sorted(ODD_IDS)


MEASURE_STEP_LABELS = """<!doctype html><body><pre id="shown"></pre>
<iframe id="page" src="/ui/#/" style="width: 1000px; height: 600px; border: 0"></iframe><script>
const page = document.getElementById("page");
setInterval(() => {
  const doc = page.contentDocument, curve = doc && doc.getElementById("reward-curve");
  if (!curve) return;
  const boxes = [...curve.querySelectorAll("text")].filter((t) => /^\\d+$/.test(t.textContent))
    .map((t) => t.getBoundingClientRect());
  let overlaps = 0;
  boxes.forEach((a, i) => boxes.slice(i + 1).forEach((b) => {
    if (a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom) overlaps += 1;
  }));
  document.getElementById("shown").textContent = boxes.length + " " + overlaps;
}, 20);
</script></body>"""
"""Loads the list in a frame and shows how many step labels its reward curve has, and how many pairs overlap."""


def test_the_reward_curve_step_labels_never_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every policy step had its label: with hundreds of steps they were drawn over each other."""
    app = make_app(tmp_path, monkeypatch)
    steps = list(range(400))
    app.state.store.add_spans(group_spans("long", ["7"] * len(steps), rewards=[0.5] * len(steps), steps=steps))

    @app.get("/measure.html")
    def measure() -> HTMLResponse:
        return HTMLResponse(MEASURE_STEP_LABELS)

    with served_app(app) as url:
        dom = chromium(f"{url}/measure.html", tmp_path / "profile", "--dump-dom")
    match = re.search(r'<pre id="shown">(\d+) (\d+)</pre>', dom)
    assert match is not None, dom
    labels, overlaps = int(match.group(1)), int(match.group(2))
    assert labels >= 4 and overlaps == 0


MARKUP = '<b class="injected">"\'</script>'
"""Recorded text that would add an element to the page, or leave an attribute, if it were not escaped."""


def test_recorded_text_is_shown_as_text_on_every_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, monkeypatch)
    group = f"g{MARKUP}"
    spans = group_spans(group, ["7", "8"], rewards=[1.0, 0.0], task=f"t{MARKUP}")
    for span in spans:
        if span.events:  # the rollout span: one more reward, under a name with markup
            span.events.append(SpanEvent(sc.REWARD_EVENT, 50, {sc.REWARD_NAME: f"r{MARKUP}", sc.REWARD_VALUE: 0.5}))
            span.attributes[sc.METADATA] = json.dumps({"note": MARKUP})
        else:
            span.attributes[sc.GEN_AI_RESPONSE_MODEL] = f"m{MARKUP}"
            span.attributes[sc.GEN_AI_INPUT_MESSAGES] = json.dumps([
                {"role": "user", "content": MARKUP},
                {"role": f"assistant{MARKUP}", "content": MARKUP, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": f"add{MARKUP}", "arguments": MARKUP}}]},
                {"role": "tool", "tool_call_id": f"c1{MARKUP}", "content": MARKUP},
            ])
            span.attributes[sc.GEN_AI_OUTPUT_MESSAGES] = json.dumps([{"role": "assistant", "content": MARKUP}])
    app.state.store.add_spans([*spans, *group_spans("plain", ["7", "8"], rewards=[1.0, 0.0], first_span=100)])
    app.state.scoring.scoring.save_judgements(
        f"ruler{MARKUP}", group, [{"trajectory_id": f"{group}-0", "score": 0.9, "explanation": MARKUP, "block": 1,
                                   "duplicate_of": f"{group}-1", "created_at": 0.0}]
    )
    with served_app(app) as url:
        batch = httpx.post(f"{url}/v1/batches", json={"trainer": f"tr{MARKUP}", "max_groups": 2}).json()
        httpx.post(f"{url}/v1/batches/{batch['id']}/release", json={"reason": MARKUP}).raise_for_status()
        views = ["#/", f"#/t/{quote(f'{group}-0', safe='')}", "#/groups", "#/batches"]
        doms = {view: chromium(f"{url}/ui/{view}", tmp_path / "profile", "--dump-dom") for view in views}
        group_link = re.search(r'<a href="(#/\?group=g[^"]+)"', doms["#/"])
        assert group_link is not None
        members = chromium(f"{url}/ui/{html.unescape(group_link.group(1))}", tmp_path / "profile", "--dump-dom")
    for view, dom in doms.items():
        assert '<b class="injected">' not in dom and MARKUP in html.unescape(dom), view
    detail = html.unescape(doms[views[1]])
    assert all(f"{name}{MARKUP}" in detail for name in ("t", "m", "r", "add", "c1", "ruler"))
    assert f"tr{MARKUP}" in html.unescape(doms["#/batches"])
    listed = sorted(html.unescape(tid) for tid in re.findall(r'data-id="([^"]+)"', members))
    assert listed == [f"{group}-0", f"{group}-1"]  # the group's link, built from an id with markup, filters by it


PLANT_A_HANDLER = """<!doctype html><body><pre id="shown">waiting</pre><iframe id="page" src="/ui/#/batches"></iframe>
<script>
const page = document.getElementById("page"), shown = document.getElementById("shown");
page.addEventListener("load", () => {
  page.contentDocument.body.insertAdjacentHTML("beforeend",
    '<img src="/missing.png" onerror="parent.document.getElementById(\\'shown\\').textContent = \\'ran\\'">');
  setTimeout(() => { if (shown.textContent === "waiting") shown.textContent = "blocked"; }, 1000);
});
</script></body>"""
"""Frames the page and adds markup with an inline handler to it, as an escaping slip would: shows whether it ran."""


def test_the_page_runs_only_its_own_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page was served with no Content-Security-Policy: one unescaped string would have run as script."""
    app = make_app(tmp_path, monkeypatch)

    @app.get("/plant.html")
    def plant() -> HTMLResponse:
        return HTMLResponse(PLANT_A_HANDLER)

    with served_app(app) as url:
        for path in ("/ui/", "/ui/app.js"):
            headers = httpx.get(f"{url}{path}").headers
            assert "script-src 'self'" in headers["content-security-policy"], path
            assert headers["x-content-type-options"] == "nosniff"
        assert "content-security-policy" not in httpx.get(f"{url}/docs").headers  # Swagger UI loads from a CDN
        dom = chromium(f"{url}/plant.html", tmp_path / "profile", "--dump-dom")
    match = re.search(r'<pre id="shown">(\w+)</pre>', dom)
    assert match is not None, dom
    assert match.group(1) == "blocked"


def langfuse_box(dom: str) -> str:
    """The Langfuse box of a page's DOM, still escaped."""
    match = re.search(r'<aside id="langfuse"[^>]*>(.*?)</aside>', dom, re.S)
    assert match is not None, dom
    return match.group(1)


def test_every_view_shows_the_last_langfuse_sync_and_its_latest_failure(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The page showed nothing of the Langfuse syncs: a schedule that kept failing showed only in the log."""
    with fake_langfuse.running(free_port()) as (langfuse_url, langfuse):
        app = app_for(tmp_path, monkeypatch, langfuse_url, ART_COLLECTOR_LANGFUSE_SCORE_NAMES="human")
        app.state.store.add_spans(group_spans("g", ["7", "8"]))
        langfuse.add_score("s0", "human", 0.5, trace_id=trace_id("g", 0))
        langfuse.add_score("late", "human", 0.25, trace_id="f" * 32)  # its trace has not arrived yet: unmatched

        def refused() -> LangfuseSyncResult:  # the error's text is Langfuse's answer, markup and all
            raise LangfuseSyncError(f"Langfuse GET /api/public/v3/scores answered 500: {MARKUP!r}")

        with served_app(app) as url:
            fresh = html.unescape(langfuse_box(chromium(f"{url}/ui/#/", tmp_path / "profile", "--dump-dom")))
            assert "no successful sync yet" in fresh and "warning" not in fresh

            counts = httpx.post(f"{url}/v1/langfuse/sync").json()
            assert (counts["pulled"], counts["applied"], counts["unmatched"]) == (2, 2, 1)
            synced = html.unescape(langfuse_box(chromium(f"{url}/ui/#/", tmp_path / "profile", "--dump-dom")))
            assert all(f"{name} {value}" in synced for name, value in counts.items() if name != "skipped")
            assert "warning" not in synced
            shown_at = re.search(r'<time datetime="([^"]+)"', synced)
            assert shown_at is not None, synced
            last_sync_at = httpx.get(f"{url}/v1/langfuse/sync").json()["last_sync_at"]
            assert abs(dt.datetime.fromisoformat(shown_at.group(1)).timestamp() - last_sync_at) < 1

            monkeypatch.setattr(app.state.scoring.langfuse, "sync", refused)
            assert httpx.post(f"{url}/v1/langfuse/sync").status_code == 502
            dom = chromium(f"{url}/ui/#/groups", tmp_path / "profile", "--dump-dom")
    assert 'id="groups"' in dom
    failed = langfuse_box(dom)
    assert '<b class="injected">' not in failed and 'class="warning"' in failed
    assert f"answered 500: {MARKUP!r}" in html.unescape(failed)
    assert "pulled 2" in html.unescape(failed)  # the last sync that succeeded is still shown
