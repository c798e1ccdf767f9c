"""Automatic training: `min_groups`, `every`, `cron`, pause and resume, one step at a time."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest
import tzlocal.unix
from apscheduler.triggers.interval import IntervalTrigger

from collector.protocol import Batch
from tests.trainer_service.builders import group, make_service
from trainer_service.config import TrainerSettings
from trainer_service.protocol import ServiceError
from trainer_service.schedule import TrainingSchedule
from trainer_service.schedule_text import parse_cron, parse_duration


async def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_min_groups_trains_when_enough_are_ready_and_pause_holds(tmp_path: Path) -> None:
    acks: list[tuple[str, dict]] = []
    batches: list[Batch] = []
    service = make_service(tmp_path, batches, acks, min_groups=2, poll_seconds=0.1)
    assert service.trainer is not None
    service.schedule.start()
    try:
        batches.append(Batch(id="one", groups=[group(service.trainer, (1.0, 0.0), "a")], lease_expires_at=0))
        await wait_for(lambda: service.schedule.counts["below_min_groups"] >= 2)
        assert acks == []  # one ready group is below min_groups=2
        batches[0].groups.append(group(service.trainer, (0.0, 1.0), "b"))
        await wait_for(lambda: service.schedule.counts["trained"] == 1)
        assert acks == [("one", {"policy_step": 1})]
        status = await service.status()
        assert status.schedule.triggers == ["min_groups=2 (poll 0.1s)"] and status.schedule.next_run is not None
        assert status.queue_depth == 0 and status.step == 1

        service.pause()
        batches.append(Batch(id="two", groups=[group(service.trainer, (1.0, 0.0), "c"),
                                               group(service.trainer, (0.0, 1.0), "d")], lease_expires_at=0))
        await wait_for(lambda: service.schedule.counts["paused"] >= 2)
        assert len(acks) == 1 and (await service.status()).schedule.paused
        # the service's pause reaches the poll itself, which asks the collector nothing (not the step, which refused)
        assert service.schedule.last_outcome.startswith("paused: min_groups: training is paused")
        assert (await service.status()).queue_depth == 2
        service.resume()
        await wait_for(lambda: service.schedule.counts["trained"] == 2)
        assert acks[1] == ("two", {"policy_step": 2})
    finally:
        await service.aclose()


async def test_every_skips_when_busy_and_counts_empty_queues(tmp_path: Path) -> None:
    acks: list[tuple[str, dict]] = []
    service = make_service(tmp_path, [], acks, every="0.1s")
    service.schedule.start()
    try:
        await wait_for(lambda: service.schedule.counts["no_batch_ready"] >= 1)
        async with service._lock:  # a step is running: the job is skipped, not queued
            await wait_for(lambda: service.schedule.counts["busy"] >= 1)
        assert acks == []
    finally:
        await service.aclose()


async def test_a_step_longer_than_the_period_warns_once_not_every_tick(caplog: pytest.LogCaptureFixture) -> None:
    """Each tick that found the step still running logged a warning: with `every 30s` and a 10-minute step, 20 per
    step (at `0.0001s`, 1,480 a second). Now the first skip in a row warns, the rest are counted and logged at INFO."""
    release = asyncio.Event()
    steps: list[str] = []

    async def slow(source: str, min_groups: int) -> None:
        steps.append(source)
        await release.wait()

    async def ready() -> int:
        return 1

    schedule = TrainingSchedule(TrainerSettings(every="1h"), slow, ready)  # the test fires the job itself
    caplog.set_level(logging.INFO, logger="trainer_service.schedule")
    for _ in range(4):
        await schedule._fire("every")
        await asyncio.sleep(0)
    busy = [r.levelno for r in caplog.records if "scheduled training: busy" in r.getMessage()]
    assert steps == ["every"] and schedule.counts["busy"] == 3  # one step, never two at once
    assert busy == [logging.WARNING, logging.INFO, logging.INFO]
    release.set()
    await wait_for(lambda: schedule.counts["trained"] == 1)
    await schedule._fire("every")  # a busy after another outcome warns again
    await schedule._fire("every")
    assert [r.levelno for r in caplog.records if "scheduled training: busy" in r.getMessage()][-1] == logging.WARNING
    await wait_for(lambda: schedule.counts["trained"] == 2)


async def test_polls_between_the_ticks_a_long_step_skips_do_not_make_each_warn(
        caplog: pytest.LogCaptureFixture) -> None:
    """With `--min-groups` and `--every` both set, a poll's outcome between two ticks that found the step running
    (`below_min_groups`, a collector that failed) ended the row of `busy`: every tick warned again, 20 warnings for a
    10-minute step at `every 30s`. Only an outcome of a step ends the row now."""
    release = asyncio.Event()
    answers: list[int | ServiceError] = [1, ServiceError(502, "collector_unavailable", "refused"), 1]

    async def slow(source: str, min_groups: int) -> None:
        await release.wait()

    async def ready() -> int:
        answer = answers.pop(0)
        if isinstance(answer, ServiceError):
            raise answer
        return answer

    schedule = TrainingSchedule(TrainerSettings(min_groups=4, every="1h"), slow, ready)  # the test fires the jobs
    caplog.set_level(logging.INFO, logger="trainer_service.schedule")
    await schedule._fire("every")
    await asyncio.sleep(0)
    for _ in range(3):  # three periods of the step, a poll before each tick
        await schedule._poll()
        await schedule._fire("every")
    busy = [r.levelno for r in caplog.records if "scheduled training: busy" in r.getMessage()]
    assert busy == [logging.WARNING, logging.INFO, logging.INFO] and schedule.counts["busy"] == 3
    assert schedule.counts["collector_unavailable"] == 1  # the poll's own failure still counts and warns
    release.set()
    await wait_for(lambda: schedule.counts["trained"] == 1)


@pytest.mark.parametrize("trigger", [{"every": "1h"}, {"cron": "0 3 * * *"}])
async def test_a_run_the_loop_reaches_late_fires_once_not_dropped(trigger: dict) -> None:
    """A run reached more than 1 s after its time (a busy loop, a suspended host, the wall clock stepped forward) was
    dropped by APScheduler's default grace time, logged as "missed" and counted nowhere: a daily cron lost its day.
    Now it fires once, late, however many runs fell in the gap."""
    steps: list[str] = []

    async def train(source: str, min_groups: int) -> None:
        steps.append(source)

    async def ready() -> int:
        return 1

    schedule = TrainingSchedule(TrainerSettings(**trigger), train, ready)
    schedule.start()
    try:
        assert schedule._scheduler is not None
        job = next(iter(trigger))
        schedule._scheduler.modify_job(job, next_run_time=datetime.now(UTC) - timedelta(days=3, minutes=30))
        await wait_for(lambda: steps != [], timeout=10)
        await wait_for(lambda: schedule.counts["trained"] == 1, timeout=10)
        next_run = schedule.next_run()
        assert steps == [job] and next_run is not None and next_run > datetime.now(UTC)
    finally:
        schedule.shutdown()


@pytest.mark.parametrize("trigger", [{"every": "0.1s"}, {"cron": "* * * * *"}, {"min_groups": 1, "poll_seconds": 0.1}])
async def test_after_a_missed_run_the_next_is_the_first_after_now_not_the_next_missed(trigger: dict) -> None:
    """APScheduler lists every missed run, one by one, before it coalesces them: after a 3-day suspend, 2.6 million
    of a `0.1s` interval, 3.4 s with the event loop held. Now the run after a missed one is the first after now."""
    async def train(source: str, min_groups: int) -> None:
        pass

    async def ready() -> int:
        return 0

    schedule = TrainingSchedule(TrainerSettings(**trigger), train, ready)
    schedule.start()
    try:
        assert schedule._scheduler is not None
        [job] = schedule._scheduler.get_jobs()
        now = datetime.now(UTC)
        next_run = job.trigger.get_next_fire_time(now - timedelta(days=3), now)
        assert now < next_run <= now + timedelta(minutes=1), (next_run, now)
    finally:
        schedule.shutdown()


async def test_interval_jobs_follow_the_wall_clock_stepped_back_and_cron_keeps_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """APScheduler keeps next runs in wall-clock time: stepped back an hour (NTP, a user), `every 0.1s` waited an hour.
    The clock APScheduler and the schedule read is stood in for."""
    import apscheduler.schedulers.base

    import trainer_service.schedule

    class SteppedClock(datetime):
        back = timedelta(0)

        @classmethod
        def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
            return datetime.now(tz) - cls.back

    monkeypatch.setattr(apscheduler.schedulers.base, "datetime", SteppedClock)
    monkeypatch.setattr(trainer_service.schedule, "datetime", SteppedClock)
    wall = SimpleNamespace(time=lambda: time.time() - SteppedClock.back.total_seconds(), monotonic=time.monotonic)
    monkeypatch.setattr(trainer_service.schedule, "time", wall)
    steps: list[str] = []

    async def train(source: str, min_groups: int) -> None:
        steps.append(source)

    async def ready() -> int:
        return 1

    schedule = TrainingSchedule(TrainerSettings(every="0.1s", cron="0 3 * * *"), train, ready)
    schedule.start()
    try:
        assert schedule._scheduler is not None
        await wait_for(lambda: len(steps) >= 1, timeout=10)
        cron = schedule._scheduler.get_job("cron").next_run_time
        SteppedClock.back = timedelta(hours=1)
        stepped = len(steps)
        await wait_for(lambda: len(steps) >= stepped + 3, timeout=10)
        assert schedule._scheduler.get_job("cron").next_run_time == cron and set(steps) == {"every"}
    finally:
        schedule.shutdown()


async def test_a_change_of_daylight_saving_time_is_no_clock_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The wall clock was read as local time: as daylight saving time ended (01:59:50 EDT, 20 s later 01:00:10 EST)
    the interval jobs were moved an hour back, though neither clock stepped. The clocks the schedule reads are stood
    in for, 20 s apart in both."""
    import trainer_service.schedule

    unix = {"now": datetime(2026, 11, 1, 5, 59, 50, tzinfo=UTC).timestamp()}

    class Clock(datetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
            return datetime.fromtimestamp(unix["now"], tz)

    monkeypatch.setenv("TZ", "America/New_York")
    monkeypatch.setattr(tzlocal.unix, "_cache_tz", None)  # tzlocal reads TZ once per process
    monkeypatch.setattr(trainer_service.schedule, "datetime", Clock)
    monkeypatch.setattr(trainer_service.schedule, "time", SimpleNamespace(time=lambda: unix["now"],
                                                                          monotonic=lambda: unix["now"]))

    async def train(source: str, min_groups: int) -> None:
        pass

    async def ready() -> int:
        return 0

    schedule = TrainingSchedule(TrainerSettings(every="1d"), train, ready)
    schedule.start()
    try:
        assert schedule._scheduler is not None and schedule._scheduler.timezone == ZoneInfo("America/New_York")
        schedule._scheduler._process_jobs()
        planned = schedule.next_run()
        unix["now"] += 20
        schedule._scheduler._process_jobs()
        assert schedule.next_run() == planned and "stepped back" not in caplog.text
    finally:
        schedule.shutdown()


async def test_times_across_a_change_of_daylight_saving_time_count_elapsed_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Aware times of one zone were added and compared by local time, which repeats an hour as daylight saving time
    ends and skips one as it starts: a clock step of an hour moved a job two hours back or not at all, `next_run`
    showed the later of two jobs, a deferred poll waited an hour too long, and a late job skipped a run still ahead."""
    import trainer_service.schedule

    monkeypatch.setenv("TZ", "America/New_York")
    monkeypatch.setattr(tzlocal.unix, "_cache_tz", None)  # tzlocal reads TZ once per process
    zone = ZoneInfo("America/New_York")

    def at(hour: int, minute: int, day: int = 1, month: int = 11) -> datetime:
        return datetime(2026, month, day, hour, minute, tzinfo=UTC).astimezone(zone)

    async def train(source: str, min_groups: int) -> None:
        pass

    async def ready() -> int:
        return 0

    schedule = TrainingSchedule(TrainerSettings(min_groups=1, poll_seconds=3600, every="1d", cron="0 3 * * *"),
                                train, ready)
    schedule.start()
    try:
        scheduler = schedule._scheduler
        assert scheduler is not None and scheduler.timezone == zone
        scheduler.pause()  # the times set here are past: none fires
        for planned in (at(6, 30), at(7, 30, day=8, month=3)):  # 01:30 EST (the repeated hour), 03:30 EDT
            scheduler.modify_job("every", next_run_time=planned)
            scheduler._move_interval_jobs(timedelta(hours=1))
            assert scheduler.get_job("every").next_run_time.timestamp() == planned.timestamp() - 3600

        scheduler.modify_job("every", next_run_time=at(6, 30))  # 01:30 EST
        scheduler.modify_job("cron", next_run_time=at(5, 45))  # 01:45 EDT, 45 minutes earlier
        scheduler.modify_job("min_groups", next_run_time=at(7, 0))
        next_run = schedule.next_run()
        assert next_run is not None and next_run.timestamp() == at(5, 45).timestamp()  # `==` compares local times

        class Clock(datetime):
            @classmethod
            def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
                return at(5, 55).astimezone(tz)  # 01:55 EDT

        monkeypatch.setattr(trainer_service.schedule, "datetime", Clock)
        schedule._defer_poll(600)
        assert scheduler.get_job("min_groups").next_run_time.timestamp() == at(6, 5).timestamp()

        every_two_hours = trainer_service.schedule._SkipMissed(IntervalTrigger(hours=2, start_date=at(4, 10)))
        after = every_two_hours.get_next_fire_time(at(4, 10), at(5, 50))  # 01:50 EDT; 01:10 EST is still ahead
        assert after is not None and after.timestamp() == at(6, 10).timestamp()
    finally:
        schedule.shutdown()


async def test_any_failure_of_a_scheduled_step_is_counted(tmp_path: Path) -> None:
    async def broken(source: str, min_groups: int) -> None:
        raise RuntimeError("a bug in the step")

    async def ready() -> int:
        return 1

    schedule = TrainingSchedule(TrainerSettings(output_dir=tmp_path, every="0.1s"), broken, ready)
    schedule.start()
    try:
        await wait_for(lambda: schedule.counts["failed"] >= 1)
        assert schedule.last_outcome is not None and "RuntimeError: a bug in the step" in schedule.last_outcome
    finally:
        schedule.shutdown()


async def test_a_failing_collector_is_polled_less_often_and_next_run_says_when(tmp_path: Path) -> None:
    """A collector that did not answer was asked again every `poll_seconds`, a warning each time; now each failure in
    a row doubles the wait (at most 10 minutes), the job is moved so `next_run` shows it, and an answer ends it."""
    answers: list[int | None] = [None, None, None, 0, None]  # None: the collector does not answer
    asked: list[datetime] = []
    trained: list[str] = []

    async def ready() -> int:
        asked.append(datetime.now(UTC))
        answer = answers.pop(0)
        if answer is None:
            raise ServiceError(502, "collector_unavailable", "connection refused", type="server_error")
        return answer

    async def train(source: str, min_groups: int) -> None:
        trained.append(source)

    schedule = TrainingSchedule(TrainerSettings(output_dir=tmp_path, min_groups=1, poll_seconds=60), train, ready)
    schedule.start()  # the first poll runs at once, the next ones here
    try:
        await wait_for(lambda: len(asked) == 1)
        for failures, wait in enumerate((60, 120, 240), start=1):
            if failures > 1:
                await schedule._poll()
            await wait_for(lambda failures=failures: schedule.counts["collector_unavailable"] == failures)
            next_run = schedule.next_run()
            assert next_run is not None and next_run >= asked[-1] + timedelta(seconds=wait)
            assert schedule.last_outcome == f"collector_unavailable: connection refused; next poll in {wait}s"
        await schedule._poll()  # an answer (nothing ready) ends the streak
        await schedule._poll()
        assert schedule.last_outcome == "collector_unavailable: connection refused; next poll in 60s"
        assert schedule.counts["below_min_groups"] == 1 and trained == []
    finally:
        schedule.shutdown()


async def test_stopping_while_a_poll_waits_for_the_collector_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """A stop while a `min_groups` poll waited for a slow collector logged APScheduler's ERROR "raised an exception"
    with a `CancelledError` traceback, and each tick while it waited warned "maximum number of running instances
    reached". Now the poll runs in its own task: the stop cancels it quietly and no step starts after it."""
    asked: list[int] = []
    trained: list[str] = []

    async def train(source: str, min_groups: int) -> None:
        trained.append(source)

    async def slow_collector() -> int:
        asked.append(1)
        await asyncio.Event().wait()  # never answers
        return 1

    schedule = TrainingSchedule(TrainerSettings(min_groups=1, poll_seconds=0.1), train, slow_collector)
    caplog.set_level(logging.INFO)
    schedule.start()
    await wait_for(lambda: len(asked) == 1)
    await asyncio.sleep(0.3)  # ticks while the poll still waits
    schedule.shutdown()
    await asyncio.sleep(0.1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert asked == [1] and trained == []


async def test_a_job_run_that_arrives_after_the_stop_starts_no_poll_and_no_step() -> None:
    """APScheduler submits a job's run as a task: one submitted just before `shutdown` ran after it and started a
    poll nothing cancelled (it then met the collector client `aclose` had closed), or a step."""
    asked: list[int] = []

    async def train(source: str, min_groups: int) -> None:
        raise AssertionError("no step after the stop")

    async def collector() -> int:
        asked.append(1)
        return 0

    schedule = TrainingSchedule(TrainerSettings(min_groups=1, poll_seconds=3600, every="1h"), train, collector)
    schedule.start()
    await wait_for(lambda: len(asked) == 1)  # the poll at start
    schedule.shutdown()
    await schedule._start_poll()  # the runs of ticks that came as it stopped
    await schedule._fire("every")
    await asyncio.sleep(0.05)
    assert asked == [1] and schedule.counts == {"below_min_groups": 1}


async def test_an_unexpected_error_of_a_poll_is_counted() -> None:
    async def train(source: str, min_groups: int) -> None:
        raise AssertionError("no step without an answer")

    async def broken_collector() -> int:
        raise RuntimeError("a bug in the poll")

    schedule = TrainingSchedule(TrainerSettings(min_groups=1), train, broken_collector)
    await schedule._poll()  # in its own task, nothing else would see it
    assert schedule.counts == {"failed": 1}
    assert schedule.last_outcome == "failed: min_groups poll: RuntimeError: a bug in the poll"


async def test_a_paused_min_groups_job_asks_the_collector_nothing_and_counts_paused() -> None:
    """Paused, the poll still asked the collector every `--poll-seconds` and counted its answers (`below_min_groups`,
    or a warning each time for a collector stopped while the trainer was paused), never `paused`."""
    asked: list[int] = []
    steps: list[str] = []
    paused = [True]

    async def train(source: str, min_groups: int) -> None:
        steps.append(source)

    async def collector() -> int:
        asked.append(1)
        return 3

    schedule = TrainingSchedule(TrainerSettings(min_groups=2), train, collector, paused=lambda: paused[0])
    await schedule._poll()
    await schedule._poll()
    assert asked == [] and steps == [] and schedule.counts == {"paused": 2}
    assert schedule.last_outcome == "paused: min_groups: training is paused; POST /v1/resume to train again"
    paused[0] = False  # resumed: the next poll asks and trains
    await schedule._poll()
    await wait_for(lambda: schedule.counts["trained"] == 1)
    assert asked == [1] and steps == ["min_groups"]


async def test_cron_reports_its_next_run(tmp_path: Path) -> None:
    service = make_service(tmp_path, [], [], cron="*/15 * * * *")
    service.schedule.start()
    try:
        next_run = service.schedule.next_run()
        assert next_run is not None and next_run.minute % 15 == 0
        assert (await service.status()).schedule.next_run == next_run.isoformat()
    finally:
        await service.aclose()


@pytest.mark.parametrize("every", ["366d", "1" + "0" * 400 + "s"])  # the second parses to inf
def test_an_interval_the_scheduler_cannot_take_is_refused(every: str) -> None:
    with pytest.raises(ValueError, match=r"is longer than the longest interval, 365d"):
        TrainerSettings(every=every)
    with pytest.raises(ValueError, match=r"poll_seconds\n  Input should be less than or equal to 31536000"):
        TrainerSettings(poll_seconds=366 * 86400)


@pytest.mark.parametrize("interval", ["0.000001", "0.09"])
def test_an_interval_shorter_than_the_shortest_is_refused(interval: str) -> None:
    """`--every 0.000001s` and `--poll-seconds 0.000001` were accepted; each wake-up of APScheduler lists every run
    missed since the last one, one per interval, before coalescing them, so the loop that also serves the proxy and
    `GET /v1/status` stalled longer at each wake-up (0.6, 0.8, 1.2, 1.7, 2.5 s) and never recovered."""
    with pytest.raises(ValueError, match=rf"every='{interval}s' is shorter than the shortest interval, 0.1s"):
        TrainerSettings(every=f"{interval}s")
    with pytest.raises(ValueError, match=r"poll_seconds\n  Input should be greater than or equal to 0.1"):
        TrainerSettings(min_groups=1, poll_seconds=float(interval))
    assert parse_duration("0.1s") == 0.1 and TrainerSettings(min_groups=1, poll_seconds=0.1).poll_seconds == 0.1


def test_bad_schedules_are_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match="write a positive number and a unit"):
        TrainerSettings(every="10 minutes")
    assert parse_duration("10m") == 600 and parse_duration("1.5h") == 5400
    assert parse_duration("365d") == 365 * 86400
    with pytest.raises(ValueError, match=r"has 2 fields; write five \(minute hour"):
        TrainerSettings(cron="every day")
    with pytest.raises(ValueError, match=r"has a bad field: .*maximum value \(59\)\. Ranges: minute 0-59"):
        TrainerSettings(cron="61 * * * *")
    with pytest.raises(ValueError, match=r"min_groups=9 exceeds batch_groups=8: .*ART_TRAINER_MIN_GROUPS"):
        TrainerSettings(min_groups=9)
    assert TrainerSettings(min_groups=4, batch_groups=4).min_groups == 4


@pytest.mark.parametrize(("line", "days"), [("0 9 * * 1", ["Mon"]), ("0 9 * * 0", ["Sun"]), ("0 9 * * 7", ["Sun"]),
                                            ("0 9 * * 1-5", ["Mon", "Tue", "Wed", "Thu", "Fri"]),
                                            ("0 9 * * */2", ["Sun", "Tue", "Thu", "Sat"]),
                                            ("0 9 * * 5-7", ["Sun", "Fri", "Sat"]),
                                            ("0 9 * * sat,SUN", ["Sun", "Sat"])])
def test_cron_days_of_week_count_from_sunday_as_in_crontab(line: str, days: list[str]) -> None:
    trigger = parse_cron(line)  # APScheduler 3's own numbers start at Monday: `1-5` fired Tuesday to Saturday
    trigger.timezone = UTC
    fired: list[str] = []
    at, end = datetime(2026, 1, 4, tzinfo=UTC), datetime(2026, 1, 11, tzinfo=UTC)
    while (at := trigger.get_next_fire_time(None, at)) < end:  # one week from a Sunday
        fired.append(at.strftime("%a"))
        at += timedelta(minutes=1)
    assert fired == days


def test_a_cron_line_that_never_fires_or_names_no_weekday_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cron='0 0 30 2 \*' never fires"):
        TrainerSettings(cron="0 0 30 2 *")  # was accepted: no next run, the trigger silently idle
    assert TrainerSettings(cron="0 0 29 2 *").cron == "0 0 29 2 *"  # a leap day fires
    for bad in ("8", "sat-sun", "*/0", "monday"):
        with pytest.raises(ValueError, match=rf"day of week '{re.escape(bad.lower())}' .*\(0 and 7: Sunday\)"):
            TrainerSettings(cron=f"0 9 * * {bad}")


@pytest.mark.parametrize(("nickname", "line"), [("@hourly", "0 * * * *"), ("@daily", "0 0 * * *"),
                                                ("@midnight", "0 0 * * *"), ("@weekly", "0 0 * * 0"),
                                                ("@monthly", "0 0 1 * *"), ("@yearly", "0 0 1 1 *"),
                                                ("@ANNUALLY", "0 0 1 1 *")])
def test_crontab_nicknames_fire_as_the_lines_they_stand_for(nickname: str, line: str) -> None:
    at = datetime(2026, 1, 4, 10, 7, tzinfo=UTC)  # was refused: "has 1 fields; write five"
    nick, full = parse_cron(nickname), parse_cron(line)
    nick.timezone = full.timezone = UTC
    assert nick.get_next_fire_time(None, at) == full.get_next_fire_time(None, at)
    assert TrainerSettings(cron=nickname).cron == nickname


def test_a_nickname_without_a_time_is_refused_with_the_ones_read() -> None:
    with pytest.raises(ValueError, match=r"cron='@reboot' has 1 fields; write five .* or one of @yearly, "):
        TrainerSettings(cron="@reboot")


@pytest.mark.parametrize("trigger", [{"cron": "0 * * * *"}, {"every": "10m"}, {"min_groups": 1}])
def test_a_time_zone_the_schedule_cannot_use_is_refused_at_parse(trigger: dict,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`--cron` with a bad `TZ` ended in a ZoneInfoNotFoundError traceback; `--every` and `--min-groups` were accepted
    and the scheduler failed only once vLLM had started."""
    monkeypatch.setenv("TZ", "Nowhere/Bogus")
    monkeypatch.setattr(tzlocal.unix, "_cache_tz", None)  # tzlocal reads TZ once per process
    with pytest.raises(ValueError, match=r"TZ='Nowhere/Bogus' is no time zone .* such as UTC or Europe/Berlin"):
        TrainerSettings(**trigger)
    assert TrainerSettings().every is None  # without a schedule the time zone is not read


@pytest.mark.parametrize("zone", ["/nowhere", "Europe/../UTC", "/etc"])
def test_a_time_zone_path_zoneinfo_refuses_is_refused_naming_tz(zone: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """zoneinfo refuses an absolute or unnormalized path with a ValueError, which passed the check as its own message
    (`ZoneInfo keys may not be absolute paths, got: /nowhere`), naming neither TZ nor the fix; a folder (`/etc`) ended
    the start with a traceback (IsADirectoryError)."""
    monkeypatch.setenv("TZ", zone)
    monkeypatch.setattr(tzlocal.unix, "_cache_tz", None)  # tzlocal reads TZ once per process
    with pytest.raises(ValueError, match=rf"TZ='{re.escape(zone)}' is no time zone .* such as UTC or Europe/Berlin"):
        TrainerSettings(every="10m")
