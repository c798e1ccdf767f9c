"""A failed step's batch: which errors count against its groups, and what the collector did with it."""

from __future__ import annotations

from collector.protocol import ReleaseResponse
from trainer_service.distributed import DistributedStepError
from trainer_service.engine_errors import EngineError
from trainer_service.failed_steps import blames_the_data, describe_release
from trainer_service.training import NonFiniteStepError


def test_only_errors_of_the_step_itself_count_against_the_data() -> None:
    assert blames_the_data(NonFiniteStepError("loss is nan")) and blames_the_data(KeyError("token_ids"))
    assert not blames_the_data(EngineError("vLLM is down"))
    assert not blames_the_data(DistributedStepError("worker rank 1 of 2 failed loading: OSError: ..."))
    assert blames_the_data(DistributedStepError("worker rank 0 of 2 failed training: IndexError", data_fault=True))


def test_the_release_is_told_group_by_group() -> None:
    released = ReleaseResponse(batch_id="b7", returned=["g1", "g2"], skipped=["g3"], max_failed_attempts=3)
    told = describe_release(released)
    assert told == ("Batch b7 was released: groups g1, g2 are back in the collector's pool; groups g3 reached the "
                    "collector's limit of 3 failed attempts and are skipped (not leased again).")
    empty = describe_release(ReleaseResponse(batch_id="b8", returned=[], skipped=[], max_failed_attempts=0))
    assert empty == "Batch b8 was released: it held no group any more."
