"""A training step that failed: whether its batch's data is to blame, and giving the batch back to the collector."""

from __future__ import annotations

import logging
from collections import Counter

from collector.protocol import Batch, ReleaseResponse
from trainer_service.collector_client import CollectorClient
from trainer_service.distributed import DistributedStepError
from trainer_service.engine_errors import EngineError
from trainer_service.protocol import ServiceError

__all__ = ["blames_the_data", "describe_release", "release_failed"]

logger = logging.getLogger(__name__)


def blames_the_data(error: Exception) -> bool:
    """Whether a step that failed with `error` counts a failed attempt against its batch's groups.

    Not when vLLM failed (`EngineError`) or the training workers did, rather than the step they ran
    (`DistributedStepError.data_fault`); a full disk never reaches here (it is released uncounted).
    Any other error came from training on this batch, so its groups are the likely cause.
    """
    if isinstance(error, EngineError):
        return False
    if isinstance(error, DistributedStepError):
        return error.data_fault
    return True


async def release_failed(collector: CollectorClient, batch: Batch, error: Exception, *, failed: bool,
                         counters: Counter[str]) -> str:
    """Give `batch` back to the collector after its step failed with `error` (`failed`: count it against the
    batch's groups); return what became of it, for the step's error message. A release the collector does not
    take is logged and counted (`release_failures`): the batch then comes back when its lease expires."""
    try:
        released = await collector.release(batch.id, f"{type(error).__name__}: {error}", failed)
    except ServiceError as exc:
        counters["release_failures"] += 1
        logger.error("batch %s could not be released: %s", batch.id, exc.body.error.message)
        return (f"{exc.body.error.message}; its lease will expire and the collector will offer it again "
                "(counting a failed attempt).")
    return describe_release(released)


def describe_release(released: ReleaseResponse) -> str:
    """What became of a released batch's groups, as a sentence of an error message."""
    fates = []
    if released.returned:
        fates.append(f"groups {', '.join(released.returned)} are back in the collector's pool")
    if released.skipped:
        fates.append(f"groups {', '.join(released.skipped)} reached the collector's limit of "
                     f"{released.max_failed_attempts} failed attempts and are skipped (not leased again)")
    return f"Batch {released.batch_id} was released: {'; '.join(fates) or 'it held no group any more'}."
