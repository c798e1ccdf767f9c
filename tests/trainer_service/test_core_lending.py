"""`CoreLender`: the step's torch threads follow the engine's requests; a request waits for the hand-back."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import torch

from tests.trainer_service.builders import make_trainer, uneven_groups
from trainer_service.config import TrainerSettings
from trainer_service.core_lending import CoreLender, call_between_layers


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_lends_only_inside_a_step_with_no_request() -> None:
    lender = CoreLender(1, 2, settle_s=0.0)
    lender.between_layers()
    assert lender.threads == 1, "no step runs: nothing is lent"
    with lender.lending():
        assert lender.threads == torch.get_num_threads() == 2
    assert lender.threads == torch.get_num_threads() == 1
    assert lender.counters == {"core_lends": 1, "core_handbacks": 1}


def test_a_step_that_raises_while_lent_hands_the_cores_back() -> None:
    """A failed step must not keep the engine's cores: the next request would wait for a hand-back that never comes."""
    async def scenario() -> None:
        lender = CoreLender(1, 2, settle_s=0.0, handback_timeout_s=5.0)
        with pytest.raises(RuntimeError, match="the step failed"), lender.lending():
            assert lender.threads == torch.get_num_threads() == 2
            raise RuntimeError("the step failed")
        assert lender.threads == torch.get_num_threads() == 1
        (await asyncio.wait_for(lender.engine_request(), 1.0)).close()
        assert lender.counters == {"core_lends": 1, "core_handbacks": 1}

    asyncio.run(scenario())


def test_a_step_on_an_idle_engine_takes_the_cores_at_once() -> None:
    async def scenario() -> None:
        lender = CoreLender(1, 2, settle_s=60.0)
        (await lender.engine_request()).close()  # the batch's last rollout, just answered
        with lender.lending():
            assert lender.threads == 2, "the settle held back the cores of a step begun on an idle engine"

    asyncio.run(scenario())


def test_a_step_begun_during_a_request_waits_the_settle_time_after_it() -> None:
    async def scenario() -> None:
        lender = CoreLender(1, 2, settle_s=0.2)
        ticket = await lender.engine_request()
        with lender.lending():
            assert lender.threads == 1, "lent while a request was in flight"
            ticket.close()
            lender.between_layers()
            assert lender.threads == 1, "lent before the engine was idle for settle_s"
            await asyncio.sleep(0.25)
            lender.between_layers()
            assert lender.threads == 2

    asyncio.run(scenario())


def test_a_request_takes_the_cores_back_and_they_return_after_the_settle_time() -> None:
    async def scenario() -> None:
        lender = CoreLender(1, 2, settle_s=0.2, handback_timeout_s=5.0)
        with lender.lending():
            lender.between_layers()
            assert lender.threads == 2

            waiting = asyncio.create_task(lender.engine_request())
            await asyncio.sleep(0.05)
            assert not waiting.done(), "the request went on while the step still held the engine's cores"
            assert lender.in_flight == 1
            lender.between_layers()  # the step reaches its next layer
            assert torch.get_num_threads() == 1
            ticket = await asyncio.wait_for(waiting, 1.0)

            await asyncio.sleep(0.25)
            lender.between_layers()
            assert lender.threads == 1, "lent while a request was in flight"
            ticket.close()
            ticket.close()  # idempotent
            assert lender.in_flight == 0
            lender.between_layers()
            assert lender.threads == 1, "lent again before the engine was idle for settle_s"
            await asyncio.sleep(0.25)
            lender.between_layers()
            assert lender.threads == 2

    asyncio.run(scenario())


def test_a_request_goes_on_after_the_handback_timeout() -> None:
    async def scenario() -> None:
        lender = CoreLender(1, 2, settle_s=0.0, handback_timeout_s=0.1)
        with lender.lending():
            started = time.monotonic()
            ticket = await lender.engine_request()  # the step never reaches a layer boundary
            assert 0.1 <= time.monotonic() - started < 2.0
            assert lender.counters["core_handback_timeouts"] == 1
            ticket.close()

    asyncio.run(scenario())


def test_a_request_cancelled_while_waiting_stops_counting() -> None:
    async def scenario() -> None:
        lender = CoreLender(1, 2, settle_s=0.0, handback_timeout_s=5.0)
        with lender.lending():
            waiting = asyncio.create_task(lender.engine_request())
            await asyncio.sleep(0.05)
            assert lender.in_flight == 1
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert lender.in_flight == 0

    asyncio.run(scenario())


def test_requests_between_steps_do_not_wait() -> None:
    async def scenario() -> None:
        lender = CoreLender(1, 2, settle_s=0.0, handback_timeout_s=5.0)
        started = time.monotonic()
        tickets = await asyncio.gather(*(lender.engine_request() for _ in range(100)))
        assert time.monotonic() - started < 1.0
        assert lender.in_flight == 100
        for ticket in tickets:
            ticket.close()
        assert lender.in_flight == 0

    asyncio.run(scenario())


def test_rejects_fewer_lent_threads_than_own() -> None:
    with pytest.raises(ValueError, match="own_threads"):
        CoreLender(2, 1)



def test_from_settings_lends_only_to_an_in_process_cpu_step_with_more_lent_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})  # more idle threads than cores: refused
    lent = CoreLender.from_settings(TrainerSettings(train_threads=1, idle_train_threads=3))
    assert (lent.own_threads, lent.lends) == (1, not torch.cuda.is_available())
    off = CoreLender.from_settings(TrainerSettings(train_threads=2, idle_train_threads=2))  # README: never lend
    assert (off.own_threads, off.idle_threads, off.lends) == (2, 2, False)
    in_workers = CoreLender.from_settings(TrainerSettings(train_threads=1, idle_train_threads=3), can_lend=False)
    assert not in_workers.lends


def test_idle_train_threads_below_the_steps_own_are_refused_naming_the_count_that_never_lends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """They were raised to the step's own count, silently: the step never lent, whatever the setting said."""
    with pytest.raises(ValueError, match=r"idle_train_threads=1 is below the step's own 2 threads .* Set "
                                         r"--idle-train-threads \(ART_TRAINER_IDLE_TRAIN_THREADS\) to 2 to never lend"):
        TrainerSettings(train_threads=2, idle_train_threads=1)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")  # the step's own threads unless --train-threads
    with pytest.raises(ValueError, match="idle_train_threads=2 is below the step's own 3 threads"):
        TrainerSettings(idle_train_threads=2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert CoreLender.from_settings(TrainerSettings(idle_train_threads=3)).idle_threads == 3


def test_between_layers_is_called_before_each_layer_both_ways_and_threads_may_change_there() -> None:
    trainer, reference = make_trainer(micro_batch_size=1), make_trainer(micro_batch_size=1)
    groups = uneven_groups(trainer)  # six sequences: six passes
    calls: list[int] = []

    def switch_threads() -> None:  # what CoreLender does there
        calls.append(1)
        torch.set_num_threads(1 + len(calls) % 2)

    call_between_layers(trainer.model, switch_threads)
    got = trainer.step(groups)  # `restore_threads` puts the threads back
    layers = trainer.model.get_base_model().config.num_hidden_layers
    assert len(calls) == 6 * 2 * layers  # each layer's forward and backward, in each pass
    want = reference.step(groups)
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-6)
    assert got["grad/norm"] == pytest.approx(want["grad/norm"], rel=1e-4)


def test_between_layers_needs_named_decoder_layers() -> None:
    trainer = make_trainer()
    trainer.model.get_base_model()._no_split_modules = []
    with pytest.raises(ValueError, match="no decoder layers"):
        call_between_layers(trainer.model, lambda: None)


def test_attach_lends_inside_the_step_only_when_the_lender_lends() -> None:
    for own, idle in ((1, 2), (2, 2)):
        trainer = make_trainer(micro_batch_size=1)
        torch.set_num_threads(own)  # as `LoRATrainer.load(cpu_threads=lender.own_threads)` does
        lender = CoreLender(own, idle, settle_s=0.0)
        lender.attach(trainer.model)
        threads_in_layers: list[int] = []
        trainer.model.get_base_model().model.layers[0].register_forward_pre_hook(
            lambda module, args: threads_in_layers.append(torch.get_num_threads()))
        with lender.lending():
            trainer.step(uneven_groups(trainer))
        assert threads_in_layers and set(threads_in_layers) == {idle}
        assert lender.counters["core_lends"] == (1 if idle > own else 0)
