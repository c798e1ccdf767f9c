"""The trainer's collector client: what a lease asks for and what a failed ack says."""

from __future__ import annotations

import json

import httpx
import pytest

from collector.protocol import MAX_LEASE_SECONDS, BatchRequest
from trainer_service.collector_client import CollectorClient
from trainer_service.config import LEASE_MARGIN_S, TrainerSettings
from trainer_service.protocol import ServiceError


def client(handle: httpx.MockTransport, **settings: object) -> CollectorClient:
    return CollectorClient(TrainerSettings(name="agent", wandb="off", **settings), handle)  # type: ignore[arg-type]


async def test_a_lease_outlasts_the_step_timeout() -> None:
    requests: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        return httpx.Response(200, json={"id": "none", "groups": [], "lease_expires_at": 0})

    longest = MAX_LEASE_SECONDS - LEASE_MARGIN_S  # the longest timeout a lease can cover
    for timeout in (None, 120.0, longest):
        collector = client(httpx.MockTransport(handle), **({} if timeout is None else {"train_step_timeout": timeout}))
        with pytest.raises(ServiceError, match="no rewarded group ready"):
            await collector.lease(1)
        await collector.aclose()
    # not the collector's 900 s default: a step may run for train_step_timeout, then save, hot-load and ack
    assert [r["lease_seconds"] for r in requests] == [3600.0 + LEASE_MARGIN_S, 120.0 + LEASE_MARGIN_S,
                                                      MAX_LEASE_SECONDS]
    assert all(BatchRequest.model_validate(r).lease_seconds == r["lease_seconds"] for r in requests)  # all valid


@pytest.mark.parametrize(("step", "said"), [(3, "(step 3 is saved and served)"),
                                            (None, "(nothing in it can train, no step was taken)")])
async def test_a_refused_ack_says_what_was_done_with_the_batch(step: int | None, said: str) -> None:
    collector = client(httpx.MockTransport(lambda request: httpx.Response(409, text="lease_expired")))
    with pytest.raises(ServiceError) as info:
        await collector.ack("b1", step)
    message = info.value.body.error.message
    assert info.value.body.error.code == "ack_failed" and f"batch b1 {said}: HTTP 409" in message
    assert "step None" not in message
    await collector.aclose()


@pytest.mark.parametrize("answer", [httpx.Response(200, text="<html>login</html>"), httpx.Response(200, json={}),
                                    httpx.Response(200, json=[{"batch_id": "b1"}])])
async def test_an_ack_answered_with_something_that_is_not_an_ack_fails(answer: httpx.Response) -> None:
    # a proxy's page or another service at --collector: the batch is not acked, its groups come back after the lease
    collector = client(httpx.MockTransport(lambda request: answer))
    with pytest.raises(ServiceError) as info:
        await collector.ack("b1", 3)
    assert info.value.body.error.code == "ack_failed"
    assert "ack of batch b1 (step 3 is saved and served) with something that is not an ack" in (
        info.value.body.error.message)
    acked = {"batch_id": "b1", "groups": ["g"], "policy_step": 3}  # what the collector publishes is taken
    collector = client(httpx.MockTransport(lambda request: httpx.Response(200, json=acked)))
    await collector.ack("b1", 3)
    await collector.aclose()
