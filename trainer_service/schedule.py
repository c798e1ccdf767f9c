"""When the trainer trains by itself: when N groups are ready, on an interval, or on a cron schedule.

APScheduler's `AsyncIOScheduler` fires the jobs; each job calls `TrainerService.train_once`,
which runs one step at a time: a job starts the step in its own task and returns, and a job that
finds a step running is skipped and counted (`busy`), never queued behind it. Pausing stops every
automatic and manual step until resumed, and the `min_groups` polls with them. A poll that finds the collector
failing waits twice as long after each further failure in a row (`Backoff`), at most 10 minutes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.interval import IntervalTrigger

from trainer_service.backoff import Backoff
from trainer_service.config import TrainerSettings
from trainer_service.protocol import ServiceError
from trainer_service.schedule_text import parse_cron, parse_duration

__all__ = ["TrainingSchedule", "describe"]

logger = logging.getLogger(__name__)

_LONGEST_POLL_BACKOFF_S = 600.0
"""Longest wait between two polls of a collector that keeps failing (`poll_seconds` when that is longer)."""

TrainFn = Callable[[str, int], Awaitable[object]]
"""`(source, min_groups) -> result`: runs one step (raises `ServiceError` when it cannot; any other
exception counts as `failed`)."""
QueueFn = Callable[[], Awaitable[int]]
"""Returns the number of groups ready at the collector."""
PausedFn = Callable[[], bool]
"""True while steps are paused (`POST /v1/pause`)."""

_JOB_DEFAULTS = {"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
"""Every job: one instance at a time, and a run reached late (a busy loop, a suspended host, the wall clock stepped
forward) fires once, however many runs fell in the gap. APScheduler's default grace of 1 s dropped such a run: a daily
`--cron` lost its day."""


def _shifted(at: datetime, by: timedelta) -> datetime:
    """`at` plus `by` of elapsed time, in `at`'s time zone. `at + by` adds to the local time: across a change of
    daylight saving time it was an hour off (01:30 EST less an hour gave 00:30 EDT, two hours earlier)."""
    return (at.astimezone(UTC) + by).astimezone(at.tzinfo)


def _earliest(times: list[datetime]) -> datetime:
    """The earliest of `times` (aware datetimes of one time zone compare by local time, which repeats an hour as
    daylight saving time ends: 01:30 EST came before 01:45 EDT)."""
    return min(times, key=datetime.timestamp)


class _SkipMissed(BaseTrigger):
    """`trigger`, whose runs missed by more than one period go from the first missed one straight to the first after
    now. APScheduler lists every missed run before it coalesces them: after a 3-day suspend, the 2.6 million runs of a
    `0.1s` interval held the event loop for 3.4 s and 140 MiB, and the time grew with the gap."""

    def __init__(self, trigger: BaseTrigger) -> None:
        self.trigger = trigger

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
        """The trigger's next run after `previous_fire_time`, or, when that one is missed too, its first after `now`."""
        after = self.trigger.get_next_fire_time(previous_fire_time, now)
        if after is not None and after.timestamp() <= now.timestamp():  # as instants, not local times: `_earliest`
            return self.trigger.get_next_fire_time(now, now)
        return after

    def __str__(self) -> str:
        return str(self.trigger)


class _Scheduler(AsyncIOScheduler):
    """APScheduler's asyncio scheduler, whose interval jobs (`every`, `min_groups`) follow the wall clock stepped back.

    APScheduler keeps each next run in wall-clock time: stepped back an hour, an interval job waited an hour. Its
    timer runs on the loop's monotonic clock, so it still wakes when the run was due; each wake-up compares how far
    both clocks went since the last one and moves the interval jobs back by the step. `cron` keeps the wall clock.
    """

    _INTERVAL_JOBS = ("every", "min_groups")
    _CLOCK_STEP_S = 1.0
    """Least gap between the two clocks taken for a step (NTP slews the wall clock by far less between wake-ups)."""

    _last_clocks: tuple[float, float] | None = None
    """The wall clock (Unix time, not the local time: a change of daylight saving time is no step) and the monotonic
    clock at the last wake-up."""

    def _process_jobs(self) -> float | None:
        clocks = time.time(), time.monotonic()
        if self._last_clocks is not None:
            back = (clocks[1] - self._last_clocks[1]) - (clocks[0] - self._last_clocks[0])
            if back > self._CLOCK_STEP_S:
                self._move_interval_jobs(timedelta(seconds=back))
        self._last_clocks = clocks
        return super()._process_jobs()

    def _move_interval_jobs(self, back: timedelta) -> None:
        logger.warning("scheduled training: the wall clock stepped back %s; the interval jobs follow it", back)
        for job in self.get_jobs():
            if job.id in self._INTERVAL_JOBS and job.next_run_time is not None:
                self.modify_job(job.id, next_run_time=_shifted(job.next_run_time, -back))


def describe(settings: TrainerSettings) -> list[str]:
    """Readable list of the configured triggers, e.g. `["min_groups=4 (poll 15s)", "every 10m"]`."""
    triggers = []
    if settings.min_groups is not None:
        triggers.append(f"min_groups={settings.min_groups} (poll {settings.poll_seconds:g}s)")
    if settings.every is not None:
        triggers.append(f"every {settings.every}")
    if settings.cron is not None:
        triggers.append(f"cron {settings.cron}")
    return triggers


class TrainingSchedule:
    """The automatic triggers of one trainer service.

    Args:
        settings: `min_groups`, `every`, `cron`, `poll_seconds`.
        train: runs one step.
        queue_depth: counts ready groups at the collector.
        paused: whether steps are paused; while they are, a `min_groups` poll asks the collector nothing and counts
            `paused`, as a fired `every` or `cron` job does (None: never paused).
    """

    def __init__(self, settings: TrainerSettings, train: TrainFn, queue_depth: QueueFn,
                 paused: PausedFn | None = None) -> None:
        self.settings = settings
        self._train = train
        self._queue_depth = queue_depth
        self._paused = paused
        self.counts: Counter[str] = Counter()
        """Outcome of each fired job: `trained`, `no_batch_ready`, `busy`, `paused`, `below_min_groups`, `failed`, or
        the error code of a step or of a poll the collector failed (`collector_unavailable`, ...)."""
        self.last_outcome: str | None = None
        self._busy_warned = False
        """A `busy` warned since the last outcome of a step: the rest of that row are logged at INFO."""
        self._scheduler: AsyncIOScheduler | None = None
        self._running: asyncio.Task[None] | None = None
        self._polling: asyncio.Task[None] | None = None
        self._stopped = False
        self._poll_backoff = Backoff(settings.poll_seconds, max(settings.poll_seconds, _LONGEST_POLL_BACKOFF_S))

    @property
    def active(self) -> bool:
        """True when some trigger is configured."""
        return bool(describe(self.settings))

    def start(self) -> None:
        """Add the configured jobs and start the scheduler (call inside the running event loop)."""
        if not self.active:
            return
        scheduler = _Scheduler(job_defaults=_JOB_DEFAULTS)
        s = self.settings
        if s.min_groups is not None:
            scheduler.add_job(self._start_poll, _SkipMissed(IntervalTrigger(seconds=s.poll_seconds)), id="min_groups",
                              next_run_time=datetime.now(scheduler.timezone))
        if s.every is not None:
            scheduler.add_job(self._fire, _SkipMissed(IntervalTrigger(seconds=parse_duration(s.every))), args=["every"],
                              id="every")
        if s.cron is not None:
            scheduler.add_job(self._fire, _SkipMissed(parse_cron(s.cron)), args=["cron"], id="cron")
        scheduler.start()
        self._scheduler = scheduler

    def shutdown(self) -> None:
        """Stop the scheduler: no job fires again, and a poll waiting for the collector is cancelled. A step already
        running is left to finish (`TrainerService.aclose` waits for it). Idempotent."""
        scheduler, self._scheduler, self._stopped = self._scheduler, None, True
        if scheduler is not None:
            scheduler.shutdown(wait=False)
        if self._polling is not None:
            self._polling.cancel()

    def next_run(self) -> datetime | None:
        """When the next job fires (None without triggers)."""
        if self._scheduler is None:
            return None
        times = [job.next_run_time for job in self._scheduler.get_jobs() if job.next_run_time is not None]
        return _earliest(times) if times else None

    async def _start_poll(self) -> None:
        """The `min_groups` job: poll in its own task, so the job returns at once and a stop cancels a poll waiting
        for a slow collector quietly (APScheduler logged its cancel as the job's error, and each tick meanwhile as
        skipped); a tick that finds the last poll still waiting leaves it be."""
        if self._stopped:  # a run of the job on its way as the scheduler stopped: no poll after `shutdown`
            return
        if self._polling is not None and not self._polling.done():
            logger.info("scheduled training: the last poll still waits for the collector; no new one")
            return
        self._polling = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        """Train when the collector has enough ready groups."""
        if self._paused is not None and self._paused():  # its step would be refused: nothing to ask the collector
            self._note("paused", "min_groups: training is paused; POST /v1/resume to train again", poll=True)
            return
        wanted = self.settings.min_groups or 1
        try:
            ready = await self._queue_depth()
        except ServiceError as exc:
            delay = self._poll_backoff.failed()
            self._defer_poll(delay)
            self._note(exc.body.error.code or "collector_unavailable", f"{exc.body.error.message}; next poll in "
                       f"{delay:g}s", poll=True)
            return
        except Exception as exc:  # runs in its own task: nothing else would see it
            self._note("failed", f"min_groups poll: {type(exc).__name__}: {exc}", exc, poll=True)
            return
        self._poll_backoff.reset()
        if ready < wanted:
            self._note("below_min_groups", f"{ready} of {wanted} groups ready", poll=True)
            return
        await self._fire("min_groups")

    def _defer_poll(self, delay: float) -> None:
        """Move the `min_groups` job's next run to `delay` seconds from now (then every `poll_seconds` again)."""
        if self._scheduler is not None:
            at = _shifted(datetime.now(self._scheduler.timezone), timedelta(seconds=delay))
            self._scheduler.modify_job("min_groups", next_run_time=at)

    async def _fire(self, source: str) -> None:
        """Start a step in its own task, so the job returns at once and the next one can report `busy`; none once
        stopped (a run of the job on its way as the scheduler stopped)."""
        if self._stopped:
            return
        if self._running is not None and not self._running.done():
            self._note("busy", f"{source}: a scheduled step is still running")
            return
        self._running = asyncio.create_task(self._step(source))

    async def _step(self, source: str) -> None:
        try:
            await self._train(source, self.settings.min_groups or 1)
        except ServiceError as exc:
            code = exc.body.error.code or "failed"
            outcome = {"training_in_progress": "busy"}.get(code, code)
            self._note(outcome, exc.body.error.message)
            return
        except Exception as exc:  # runs in its own task: nothing else would see it
            self._note("failed", f"{source}: {type(exc).__name__}: {exc}", exc)
            return
        self._note("trained", source)

    def _note(self, outcome: str, detail: str, exc: BaseException | None = None, *, poll: bool = False) -> None:
        """Count and log an outcome. A `busy` right after another warns only once (one step outlasting the period):
        the row ends with the outcome of a step, not with a poll's (`poll`: `below_min_groups`, a failed poll), which
        with `min_groups` and `every` or `cron` both set comes between the ticks."""
        again = outcome == "busy" and self._busy_warned
        if not poll:  # a step's outcome: `busy` starts or goes on with a row, any other ends it
            self._busy_warned = outcome == "busy"
        self.counts[outcome] += 1
        self.last_outcome = f"{outcome}: {detail}"
        quiet = ("trained", "below_min_groups", "no_batch_ready", "paused")
        level = logging.INFO if outcome in quiet or again else logging.WARNING
        logger.log(level, "scheduled training: %s (%s)", outcome, detail, exc_info=exc)
