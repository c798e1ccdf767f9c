"""Automatic training: `min_groups`, `every`, `cron`, pause and resume, one step at a time."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from collector.protocol import Batch
from tests.trainer_service.builders import group, make_service
from trainer_service.config import TrainerSettings, parse_cron, parse_duration
from trainer_service.schedule import TrainingSchedule


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
