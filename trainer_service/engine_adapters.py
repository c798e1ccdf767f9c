"""`AdapterRegistry`: the LoRA adapters a `VLLMEngine` serves, in the order they were first loaded.

It hot-loads and unloads them through vLLM's adapter endpoints (`vllm_lora_api`) and keeps those a restart of vLLM
left pending until `load_pending` re-loads them (the engine's `ensure_running` calls it). It shares the engine's lock
(no load runs during a start, restart or stop) and its stop event (a load under way gives up).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from trainer_service.backoff import Backoff
from trainer_service.engine_errors import EngineError
from trainer_service.vllm_lora_api import load_lora, unload_lora

__all__ = ["AdapterRegistry"]

logger = logging.getLogger(__name__)


class AdapterRegistry:
    """Adapters loaded into one vLLM, name → folder, and those a restart of vLLM left pending.

    Args:
        base_url: address of the engine, e.g. `http://127.0.0.1:8001`.
        lock: the engine's lock, held by each load and unload.
        stopping: the engine's stop event: once set, a load under way gives up and no pending one is tried.
        adapter_retry: the engine's wait before pending adapters vLLM refused are tried again.
    """

    def __init__(self, base_url: str, lock: threading.RLock, stopping: threading.Event,
                 adapter_retry: Backoff) -> None:
        self.base_url = base_url
        self._lock = lock
        self._stopping = stopping
        self._adapter_retry = adapter_retry
        self._registered: dict[str, str] = {}
        self._pending: set[str] = set()

    # The two views below take no lock (a restart holds it for minutes, and the proxy resolves names
    # on its event loop); copying a dict or a set is atomic, so each sees one consistent state.

    @property
    def adapters(self) -> dict[str, str]:
        """Adapters vLLM serves, name → folder, in load order (pending ones left out)."""
        registered, pending = dict(self._registered), set(self._pending)
        return {name: path for name, path in registered.items() if name not in pending}

    @property
    def pending_adapters(self) -> list[str]:
        """Adapters loaded once that vLLM does not serve since a restart; `ensure_running` retries them."""
        registered, pending = dict(self._registered), set(self._pending)
        return [name for name in registered if name in pending]

    def mark_pending(self) -> None:
        """Mark every adapter pending: vLLM restarts, and serves none of them until `load_pending` re-loads it."""
        self._pending = set(self._registered)

    def load_pending(self) -> None:
        """Load every pending adapter, in load order; those vLLM refuses stay pending (retried after `_adapter_retry`).
        Once `stop` was called, the rest stay pending: a load under way is given up, and logged.

        Raises:
            EngineError: naming each adapter that failed and why.
        """
        failures: list[str] = []
        for name in self.pending_adapters:
            if self._stopping.is_set():  # `stop` waits for the lock: each load may take minutes of a hung vLLM
                return
            try:  # vLLM may have it already (False): a load that timed out on our side can still have completed
                load_lora(self.base_url, name, self._registered[name], self._stopping)
            except EngineError as exc:
                if self._stopping.is_set():  # given up for `stop`, or vLLM stopped under it: no retry follows
                    logger.warning(
                        "adapter %s was not re-loaded: %s; %d adapter(s) stay pending", name, exc, len(self._pending)
                    )
                    return
                failures.append(f"{name}: {exc}")
                continue
            self._pending.discard(name)
        if failures:
            raise EngineError(f"vLLM did not re-load {len(failures)} adapter(s); they are not served and are "
                              f"retried in {self._adapter_retry.failed():.0f} s:\n" + "\n".join(failures))
        self._adapter_retry.reset()

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Hot-load the PEFT adapter folder `path` as model `name`.

        When vLLM has the name already (an earlier load whose answer we did not get, maybe of other
        weights in that folder), it is unloaded and loaded again, so vLLM serves what `path` holds now.

        Raises:
            EngineError: vLLM refused the adapter (its message is included).
        """
        path = str(Path(path).resolve())
        with self._lock:
            if not load_lora(self.base_url, name, path, self._stopping):
                unload_lora(self.base_url, name, self._stopping)
                if not load_lora(self.base_url, name, path, self._stopping):
                    raise EngineError(f"vLLM still serves adapter {name!r} after unloading it; not re-loaded")
            self._registered[name] = path
            self._pending.discard(name)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name` from vLLM; vLLM not having it (a pending adapter may or may not be loaded) is fine."""
        with self._lock:
            unload_lora(self.base_url, name, self._stopping)
            self._pending.discard(name)
            self._registered.pop(name, None)
