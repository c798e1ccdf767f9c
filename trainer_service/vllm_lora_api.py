"""vLLM's runtime LoRA endpoints (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): load and unload an adapter by name.

vLLM answers loading a name it serves, and unloading one it does not, with an error; both are
expected when a request timed out on our side but completed in vLLM, so each call says which it
got instead of raising. Any other refusal raises `EngineError` with vLLM's answer. A request in
flight is given up once the caller's `stopping` event is set (`VLLMEngine.stop`), instead of
holding the engine's lock up to `_TIMEOUT` for a vLLM that no longer answers; the engine's
health check waits the same way (`wait_unless_stopping`).
"""

from __future__ import annotations

import threading

import httpx

from trainer_service.engine_errors import EngineError
from trainer_service.stoppable import wait_unless_stopping

__all__ = ["load_lora", "unload_lora"]

_ALREADY_LOADED = (400, "The lora adapter '{}' has already been loaded")
"""vLLM's answer to loading a name it serves (`_check_load_lora_adapter_request` in its models/serving.py)."""

_NOT_FOUND = (404, "The lora adapter '{}' cannot be found")
"""vLLM's answer to unloading a name it does not serve (`_check_unload_lora_adapter_request`, same module)."""

_TIMEOUT = 120.0
"""Seconds one request may wait for vLLM's answer (a load reads the adapter's weights)."""


def load_lora(base_url: str, name: str, path: str, stopping: threading.Event) -> bool:
    """Load the adapter folder `path` as model `name`; False when vLLM serves that name already.

    Raises:
        EngineError: vLLM did not answer, refused the adapter (its message is included), or `stopping` was set
            before it answered.
    """
    body = {"lora_name": name, "lora_path": path}
    return _post(base_url, "/v1/load_lora_adapter", body, _ALREADY_LOADED, stopping)


def unload_lora(base_url: str, name: str, stopping: threading.Event) -> bool:
    """Unload adapter `name`; False when vLLM does not serve it.

    Raises:
        EngineError: vLLM did not answer, refused with another answer, or `stopping` was set before it answered.
    """
    return _post(base_url, "/v1/unload_lora_adapter", {"lora_name": name}, _NOT_FOUND, stopping)


def _post(base_url: str, route: str, body: dict[str, str], accept: tuple[int, str], stopping: threading.Event) -> bool:
    """POST `body` to vLLM's `route`: True when vLLM did it, False on the `accept`ed answer (HTTP status,
    message with `{}` for the adapter's name); given up once `stopping` is set (`wait_unless_stopping`)."""
    url = f"{base_url}{route}"
    answer = wait_unless_stopping(lambda: httpx.post(url, json=body, timeout=_TIMEOUT), stopping, f"POST {route}")
    if not answer.done():
        raise EngineError(
            f"gave up waiting for vLLM's answer to {route} for {body['lora_name']!r}: the engine is stopping"
        )
    try:
        response = answer.result()
    except httpx.HTTPError as exc:
        raise EngineError(f"vLLM at {base_url} did not answer {route}: {exc}") from exc
    if response.status_code == 200:
        return True
    status, message = accept
    if response.status_code == status and message.format(body["lora_name"]) in response.text:
        return False
    raise EngineError(f"vLLM refused {route} for {body}: HTTP {response.status_code}: {response.text[:500]}")
