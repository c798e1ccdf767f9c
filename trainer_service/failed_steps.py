"""A training step that failed: whether its batch's data is to blame, giving the batch back to the collector, and the
fix a 507 names for a checkpoint that could not be written (`write_fix`)."""

from __future__ import annotations

import errno
import logging
from collections import Counter
from pathlib import Path

from collector.protocol import Batch, ReleaseResponse
from trainer_service.collector_client import CollectorClient
from trainer_service.distributed import DistributedStepError
from trainer_service.engine_errors import EngineError
from trainer_service.protocol import ServiceError

__all__ = ["blames_the_data", "describe_release", "release_failed", "write_fix"]

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


_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def write_fix(exc: OSError, path: Path) -> str:
    """The fix a 507 names for checkpoint folder `path` that could not be written, from the errno of `exc` (a
    `CheckpointWriteError` carries its writer's, safetensors' and a `--train-processes` rank's too) or of the `OSError`
    it chains: "; free disk space" only for a full disk (also `torch.save` failing on a nearly full file system,
    see `checkpoint_folder._save_optimizer`), with "or raise the disk quota" for a quota; "" for an error without a
    known errno (the writer's message, kept in the 507, names the cause)."""
    error = exc
    while error.errno is None and isinstance(error.__cause__, OSError):
        error = error.__cause__
    if isinstance(error, FileExistsError):  # a half-written `step-N` start-up could not remove (the log says why)
        return f"; remove {path} by hand"
    if error.errno == errno.EDQUOT:
        return "; free disk space or raise the disk quota of the service's user"
    if error.errno == errno.ENOSPC:
        return "; free disk space"
    if error.errno in _NOT_WRITABLE:
        return f"; let the service's user write to {path.parent}"
    return ""
