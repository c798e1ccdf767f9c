"""HTTP layer of the judges and the web page: an `APIRouter`, the static page, background jobs.

`install(app, store, auth)` is called by `create_app`. It adds the RULER routes
(`POST/GET /v1/groups/{id}/judge`), the Langfuse sync routes (`POST /v1/langfuse/sync` runs one, `GET` shows the
last), the read API under `/v1/view/` (never stored by a browser), the web page under `/ui/` (revalidated on each
load), and — in the app's lifespan — the automatic judge (`ART_COLLECTOR_JUDGE_AUTO`) and the scheduled Langfuse sync
(`ART_COLLECTOR_LANGFUSE_HOST`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Response
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

from collector import views
from collector.errors import NotFound
from collector.judging import GroupJudge, run_view
from collector.langfuse_sync import LangfuseSync
from collector.protocol import MAX_COUNT
from collector.read_protocol import (
    BatchView,
    CurvePoint,
    GroupView,
    Judgement,
    JudgeRequest,
    JudgeRun,
    LangfuseSyncResult,
    LangfuseSyncStatus,
    TrajectoryDetail,
    TrajectoryPage,
)
from collector.scoring_config import JudgeSettings, LangfuseSettings
from collector.scoring_store import ScoringStore
from collector.store import SqlStore

__all__ = ["Scoring", "install"]

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")


class _Revalidated(StaticFiles):
    """The page's files, each answer marked `no-cache`: a browser asks again (with the ETag) on every load, so it
    never runs an old app.js after an upgrade."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers["Cache-Control"] = "no-cache"
        return response


def _no_store(response: Response) -> None:
    """Mark a read of the page's API `no-store`: it changes as spans and rewards arrive."""
    response.headers["Cache-Control"] = "no-store"


@dataclass
class Scoring:
    """The judges of one app (kept on `app.state.scoring`)."""

    judge: GroupJudge
    langfuse: LangfuseSync | None
    scoring: ScoringStore
    langfuse_status: LangfuseSyncStatus = field(default_factory=LangfuseSyncStatus)
    """Replaced whole after each sync (`GET /v1/langfuse/sync`)."""
    job_errors: dict[str, int] = field(default_factory=dict)


async def _every(seconds: float, name: str, job: Callable[[], Any], scoring: Scoring) -> None:
    """Run blocking `job` in a thread every `seconds` (first after one interval); a failure is logged
    with its traceback and counted."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(job)
        except Exception:  # a background job must survive one bad round; counted and logged
            scoring.job_errors[name] = scoring.job_errors.get(name, 0) + 1
            log.exception("background job %s failed (%d failures so far)", name, scoring.job_errors[name])


def install(
    app: FastAPI,
    store: SqlStore,
    auth: Callable[..., None],
    *,
    judge_settings: JudgeSettings | None = None,
    langfuse_settings: LangfuseSettings | None = None,
) -> Scoring:
    """Add the judges, the read API and the web page to the collector's app.

    Args:
        app: The app built by `create_app` (its `state.settings` holds the collector settings).
        store: The app's store; the judges' tables go in the same database.
        auth: The dependency that guards write endpoints.
        judge_settings: RULER settings (default: from `ART_COLLECTOR_JUDGE_*`).
        langfuse_settings: Langfuse settings (default: from `ART_COLLECTOR_LANGFUSE_*` / `LANGFUSE_*`).
    """
    judge_settings = judge_settings or JudgeSettings()
    langfuse_settings = langfuse_settings or LangfuseSettings()
    scoring_store = ScoringStore(store.engine)  # its tables come with the store's schema (`collector.schema`)
    judge = GroupJudge(store, scoring_store, judge_settings)
    sync = LangfuseSync(store, scoring_store, langfuse_settings) if langfuse_settings.enabled else None
    state = Scoring(judge=judge, langfuse=sync, scoring=scoring_store)
    app.state.scoring = state

    syncing = threading.Lock()  # one sync at a time (as `LangfuseSync.sync`), so the statuses come in its order

    def configured() -> LangfuseSync:
        if sync is None:
            raise NotFound(
                "Langfuse is not configured: set ART_COLLECTOR_LANGFUSE_HOST and its keys",
                code="langfuse_not_configured",
            )
        return sync

    def run_sync() -> LangfuseSyncResult:
        """One sync, its outcome kept in `state.langfuse_status`; its error raised on."""
        langfuse = configured()
        with syncing:
            try:
                result = langfuse.sync()
            except Exception as exc:  # any failure is shown (`GET /v1/langfuse/sync`), and raised on
                state.langfuse_status = state.langfuse_status.model_copy(
                    update={"last_error": f"{type(exc).__name__}: {exc}", "last_error_at": langfuse.clock()}
                )
                raise
            state.langfuse_status = LangfuseSyncStatus(last_sync=result, last_sync_at=langfuse.clock())
        return result

    router = APIRouter()
    writes = [Depends(auth)]
    reads = [Depends(_no_store)]

    @router.post("/v1/groups/{group_id:path}/judge", dependencies=writes)
    def judge_group(group_id: str, body: JudgeRequest | None = None) -> JudgeRun:
        """Run the RULER judge on one group now (any state); scores become rewards named `ruler`. Answers this
        request's run as recorded, never `running` (another run may have claimed the group since; GET shows the
        latest); 409 `judge_running` while another run of the group has not finished, or when another run took the
        group over from this one, which outlived its claim and stored nothing."""
        return judge.judge(group_id, rubric=body.rubric if body else None)

    @router.get("/v1/groups/{group_id:path}/judge")
    def judge_status(group_id: str) -> JudgeRun:
        """The last judge run of a group, with its judgements."""
        row = scoring_store.run(group_id)
        if row is None:
            raise NotFound(f"group {group_id!r} has not been judged; POST /v1/groups/{{id}}/judge")
        members = [t.id for t in store.trajectories(group=group_id) if t.group_id == group_id]
        found = scoring_store.judgements(members)
        return run_view(
            row, [Judgement(**{k: r[k] for k in Judgement.model_fields}) for tid in members for r in found[tid]]
        )

    @router.post("/v1/langfuse/sync", dependencies=writes)
    def langfuse_sync() -> LangfuseSyncResult:
        """Pull Langfuse scores and push rewards now (502 when Langfuse fails, 404 when not configured)."""
        return run_sync()

    @router.get("/v1/langfuse/sync", dependencies=reads)
    def langfuse_sync_status() -> LangfuseSyncStatus:
        """The last Langfuse sync that succeeded, and the latest one's failure (404 when not configured)."""
        configured()
        return state.langfuse_status

    @router.get("/v1/view/trajectories", dependencies=reads)
    def view_trajectories(
        task: str | None = None,
        group: str | None = None,
        split: str | None = None,
        policy_step: int | None = None,
        reward_min: float | None = Query(default=None, allow_inf_nan=False),
        reward_max: float | None = Query(default=None, allow_inf_nan=False),
        limit: int = Query(default=100, ge=1, le=1000),
        offset: int = Query(default=0, ge=0, le=MAX_COUNT),
    ) -> TrajectoryPage:
        """Trajectory summaries, newest first, filtered by task, group, split, policy step and training reward."""
        return views.trajectory_page(
            store, task=task, group=group, split=split, policy_step_eq=policy_step,
            reward_min=reward_min, reward_max=reward_max, limit=limit, offset=offset,
        )

    @router.get("/v1/view/trajectories/{trajectory_id:path}", dependencies=reads)
    def view_trajectory(trajectory_id: str) -> TrajectoryDetail:
        """One trajectory: messages, tool calls, token counts, rewards, judge explanations."""
        return views.trajectory_detail(store, scoring_store, trajectory_id)

    @router.get("/v1/view/trajectory", dependencies=reads)
    def view_trajectory_by_query(trajectory_id: str = Query(alias="id", min_length=1)) -> TrajectoryDetail:
        """One trajectory by `?id=`: any id, `.` and `..` too, which no client keeps as a path segment."""
        return views.trajectory_detail(store, scoring_store, trajectory_id)

    @router.get("/v1/view/groups", dependencies=reads)
    def view_groups(limit: int = Query(default=100, ge=1, le=1000)) -> list[GroupView]:
        """The latest groups, newest first, with state, reason and last judge run."""
        return views.group_list(store, scoring_store, limit=limit)

    @router.get("/v1/view/batches", dependencies=reads)
    def view_batches(limit: int = Query(default=100, ge=1, le=1000)) -> list[BatchView]:
        """The latest batch leases, newest first."""
        return views.batch_list(store, limit=limit)

    @router.get("/v1/view/reward-curve", dependencies=reads)
    def view_reward_curve(name: str | None = None, split: str | None = None) -> list[CurvePoint]:
        """Mean reward per policy step (the training reward, or reward `name`)."""
        return views.reward_curve(store, name=name, split=split)

    @router.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.include_router(router)
    app.mount("/ui", _Revalidated(directory=STATIC, html=True), name="ui")

    previous = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(application: FastAPI) -> AsyncIterator[Any]:
        async with previous(application) as inner:
            tasks = []
            if judge_settings.auto:
                tasks.append(asyncio.create_task(_every(judge_settings.poll_seconds, "judge", judge.run_due, state)))
            if sync is not None:
                tasks.append(asyncio.create_task(_every(langfuse_settings.sync_seconds, "langfuse", run_sync, state)))
            try:
                yield inner
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                judge.close()

    app.router.lifespan_context = lifespan
    return state
