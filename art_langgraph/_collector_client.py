"""Small HTTP client for the collector's non-OTLP endpoints (rewards given after the fact)."""

from __future__ import annotations

import httpx

from art_langgraph._settings import get_settings

__all__ = ["apost_reward", "post_reward"]

_TIMEOUT = httpx.Timeout(10.0)


def _request(
    rollout_id: str | None, name: str, value: float, trace_id: str | None
) -> tuple[str, dict[str, str], dict[str, object]]:
    settings = get_settings()
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    body: dict[str, object] = {"name": name, "value": value}
    if rollout_id is not None:
        body["rollout_id"] = rollout_id
    if trace_id is not None:
        body["trace_id"] = trace_id
    return f"{settings.collector_base_url}/v1/rewards", headers, body


def _raise_for_status(response: httpx.Response) -> None:
    """`raise_for_status`, with the collector's answer (its error envelope names what it refused) in the message."""
    if not response.is_success:
        raise httpx.HTTPStatusError(
            f"the collector answered {response.status_code} {response.reason_phrase} to POST {response.url}: "
            f"{response.text[:1000]}",
            request=response.request,
            response=response,
        )


def _naming_the_collector(exc: httpx.TransportError, url: str) -> httpx.TransportError:
    """`exc` as its own type, its message naming the URL it could not reach (httpx's says only `Connection refused`)."""
    return type(exc)(f"could not POST to the collector at {url}: {exc}", request=exc.request)


def post_reward(rollout_id: str | None, name: str, value: float, trace_id: str | None = None) -> None:
    """Send one reward for a finished rollout (by rollout id or trace id) to `POST {collector}/v1/rewards`.

    Raises:
        httpx.HTTPError: The collector is unreachable or answered with an error status.
    """
    url, headers, body = _request(rollout_id, name, value, trace_id)
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=_TIMEOUT)
    except httpx.TransportError as exc:
        raise _naming_the_collector(exc, url) from exc
    _raise_for_status(response)


async def apost_reward(rollout_id: str | None, name: str, value: float, trace_id: str | None = None) -> None:
    """Async `post_reward`: send one reward for a finished rollout to the collector.

    Raises:
        httpx.HTTPError: The collector is unreachable or answered with an error status.
    """
    url, headers, body = _request(rollout_id, name, value, trace_id)
    async with httpx.AsyncClient(timeout=_TIMEOUT) as client:
        try:
            response = await client.post(url, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise _naming_the_collector(exc, url) from exc
    _raise_for_status(response)
