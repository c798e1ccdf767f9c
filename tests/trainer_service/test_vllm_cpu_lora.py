"""art's LoRA ops for vLLM-cpu (`trainer_service.vllm_cpu_lora`), driven through vLLM's own
punica wrapper (`PunicaWrapperCPU`) the way vLLM's LoRA layers call it, against the meaning vLLM
documents: each token gets `x @ A[slot].T * scale @ B[slot].T` added, a token at slot -1 nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from trainer_service import vllm_cpu_lora

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
RANK, HIDDEN, SLICES, SCALE = 4, 16, (6, 10), 2.0
LORA_IDS = [11, 12, 13]  # every slot holds an adapter: slot 2 is also what index -1 would pick by indexing


WRAPPER_METHODS = ("update_metadata", "add_lora_linear")


@pytest.fixture
def vllm_native_ops() -> Iterator[dict[str, Any]]:
    """vLLM's own ops; whatever a test patches is put back afterwards."""
    wrapper = punica_cpu.PunicaWrapperCPU
    saved = {(module, name): getattr(module, name) for module in (lora_ops, punica_cpu) for name in OPS}
    saved.update({(wrapper, name): vars(wrapper).get(name, getattr(wrapper, name)) for name in WRAPPER_METHODS})
    yield {name: getattr(lora_ops, name) for name in OPS}
    for (owner, name), op in saved.items():
        setattr(owner, name, op)


@pytest.fixture
def art_ops(vllm_native_ops: dict[str, Any]) -> None:
    vllm_cpu_lora.register()


def adapters(seed: int = 0) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Stacked A and B per output slice, as vLLM's LoRA layers hold them: (slots, 1, out, in)."""
    gen = torch.Generator().manual_seed(seed)
    a = tuple(torch.randn(len(LORA_IDS), 1, RANK, HIDDEN, generator=gen) for _ in SLICES)
    b = tuple(torch.randn(len(LORA_IDS), 1, size, RANK, generator=gen) for size in SLICES)
    return a, b


def expected(y: torch.Tensor, x: torch.Tensor, slots: list[int], a: tuple[torch.Tensor, ...],
             b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """vLLM's documented meaning, one token at a time."""
    out = y.clone()
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        offset = 0
        for a_s, b_s, size in zip(a, b, SLICES, strict=True):
            out[row, offset : offset + size] += (x[row] @ a_s[slot, 0].T * SCALE) @ b_s[slot, 0].T
            offset += size
    return out


def apply(token_lora_ids: list[int], request_lora_ids: list[int], prefill: bool,
          wrapper: punica_cpu.PunicaWrapperCPU | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `add_lora_linear` through vLLM's CPU punica wrapper (a new one by default); returns (result, expected)."""
    wrapper = wrapper or punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=8, device="cpu")
    mapping = LoRAMapping(tuple(token_lora_ids), tuple(request_lora_ids), is_prefill=prefill)
    wrapper.update_metadata(mapping, list(LORA_IDS), len(LORA_IDS), vocab_size=32)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(token_lora_ids), HIDDEN, generator=gen)
    y = torch.randn(len(token_lora_ids), sum(SLICES), generator=gen)
    a, b = adapters()
    slots = [LORA_IDS.index(i) if i > 0 else -1 for i in token_lora_ids]
    want = expected(y, x, slots, a, b)
    wrapper.add_lora_linear(y, x, a, b, SCALE, SLICES)
    return y, want


def test_vllm_cpu_runs_a_lora_engine_eagerly() -> None:
    """The ops branch on the step's adapter slot in Python, which holds only while vLLM-cpu runs the model
    eagerly with LoRA. A once-traced graph keeps what it saw when traced: forced to compile with LoRA
    (DYNAMO_TRACE_ONCE, vLLM's own punica ops), vLLM 0.32 sampled a non-zero adapter's batch token for
    token as the base model's (32 of 32 completions, against 3 of 32 eager). Should a vLLM upgrade compile
    LoRA engines on the CPU, this fails before an engine silently serves the base model under an adapter's name."""
    from vllm.config import CompilationMode
    from vllm.engine.arg_utils import EngineArgs

    from trainer_service.base_model import BUNDLED_MODEL, resolve_base_model

    def mode(lora: bool) -> CompilationMode:
        args = EngineArgs(model=resolve_base_model(BUNDLED_MODEL), enable_lora=lora, max_lora_rank=8,
                          max_model_len=512, dtype="float32")
        return args.create_engine_config().compilation_config.mode

    assert mode(lora=True) == CompilationMode.NONE
    assert mode(lora=False) != CompilationMode.NONE  # the check sees compilation where vLLM-cpu does compile


def test_the_plugin_is_registered_under_vllms_entry_point() -> None:
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "art_cpu_lora"]
    assert plugin.load() is vllm_cpu_lora.register


def test_register_routes_vllms_cpu_punica_ops_through_ours(art_ops: None) -> None:
    vllm_cpu_lora.register()  # vLLM may load a plugin more than once
    for name in OPS:
        assert getattr(punica_cpu, name) is getattr(vllm_cpu_lora, name)
        assert getattr(lora_ops, name) is getattr(vllm_cpu_lora, name)
    for name in WRAPPER_METHODS:  # wrapped once, not twice
        method = getattr(punica_cpu.PunicaWrapperCPU, name)
        assert method.art_lora and not getattr(method.__closure__[0].cell_contents, "art_lora", False)


@pytest.mark.parametrize(
    ("tokens", "requests", "prefill"),
    [
        ([12, 12, 12, 12], [12, 12, 12, 12], False),  # one policy's samples: one matmul per projection
        ([11, 0, 13, 13, 12, 0], [11, 0, 13, 13, 12, 0], False),  # adapters mixed with the base model
        ([0, 0, 0], [0, 0, 0], False),  # base model only, every slot full
        ([11, 11, 11, 0, 0, 13, 13, 13, 13], [11, 0, 13], True),  # prefill: tokens of three requests
    ],
    ids=["decode-one-adapter", "decode-mixed", "decode-base-only", "prefill-mixed"],
)
def test_each_token_gets_its_own_adapter_and_base_tokens_none(
    art_ops: None, tokens: list[int], requests: list[int], prefill: bool
) -> None:
    result, want = apply(tokens, requests, prefill)
    torch.testing.assert_close(result, want)


def test_a_step_with_one_adapter_skips_the_ops_and_a_new_mapping_is_seen(
    art_ops: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=8, device="cpu")
    calls = []
    for module in (lora_ops, punica_cpu):  # the ops vLLM's own path calls (decode, prefill), counted
        for name in OPS:
            op = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _op=op, _name=name, **k: (calls.append(_name), _op(*a, **k)))
    for tokens, slot, through_ops in (([12] * 5, 1, False), ([0] * 3, -1, False), ([11, 12, 0], None, True),
                                      ([13] * 4, 2, False)):
        calls.clear()
        result, want = apply(tokens, tokens, prefill=True, wrapper=wrapper)
        torch.testing.assert_close(result, want)
        assert wrapper.art_slot == slot
        assert bool(calls) == through_ops, (tokens, calls)


@pytest.mark.parametrize("add_inputs", [True, False])
def test_the_ops_equal_vllms_where_both_mean_the_same(vllm_native_ops: dict[str, Any], add_inputs: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 2, 2, 1, 0])  # no -1: vLLM's ops and ours agree on what to compute
    a, b = adapters()
    x = torch.randn(5, HIDDEN, generator=gen)
    shrunk = {}
    for label, shrink in (("vllm", vllm_native_ops["bgmv_shrink"]), ("art", vllm_cpu_lora.bgmv_shrink)):
        shrunk[label] = torch.zeros(5, RANK)
        shrink(x, a[0], shrunk[label], slots, SCALE)
    torch.testing.assert_close(shrunk["art"], shrunk["vllm"])

    base = torch.randn(5, sum(SLICES), generator=gen)
    expanded = {}
    for label, ops in (("vllm", vllm_native_ops), ("art", vars(vllm_cpu_lora))):
        whole = base.clone()
        ops["bgmv_expand"](shrunk[label], b[1], whole, slots, add_inputs)
        sliced = base.clone()
        ops["bgmv_expand_slice"](shrunk[label], b[0], sliced, slots, SLICES[1], SLICES[0], add_inputs)
        expanded[label] = (whole, sliced)
    torch.testing.assert_close(expanded["art"], expanded["vllm"])


def test_lora_matmul_says_when_no_row_has_an_adapter() -> None:
    weights = torch.ones(2, 1, RANK, HIDDEN)
    assert vllm_cpu_lora.lora_matmul(torch.ones(3, HIDDEN), weights, torch.tensor([-1, -1, -1]), torch.float32) is None
    out = vllm_cpu_lora.lora_matmul(torch.ones(3, HIDDEN), weights, torch.tensor([-1, 1, -1]), torch.float32)
    assert out is not None
    torch.testing.assert_close(out, torch.tensor([[0.0] * RANK, [float(HIDDEN)] * RANK, [0.0] * RANK]))


def test_one_adapters_fused_matrices_are_kept_until_vllm_writes_the_layer(
    art_ops: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = []
    fuse = vllm_cpu_lora.fuse_adapter
    monkeypatch.setattr(vllm_cpu_lora, "fuse_adapter", lambda *a: (builds.append(a[2]), fuse(*a))[1])
    wrapper = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=8, device="cpu")
    tokens = [12] * 4  # slot 1
    wrapper.update_metadata(LoRAMapping(tuple(tokens), tuple(tokens), is_prefill=False), list(LORA_IDS),
                            len(LORA_IDS), vocab_size=32)
    a, b = adapters()
    gen = torch.Generator().manual_seed(4)

    def step() -> None:
        x = torch.randn(len(tokens), HIDDEN, generator=gen)
        y = torch.randn(len(tokens), sum(SLICES), generator=gen)
        want = expected(y, x, [1] * len(tokens), a, b)
        wrapper.add_lora_linear(y, x, a, b, SCALE, SLICES)
        torch.testing.assert_close(y, want)

    step()
    step()
    assert len(builds) == 1  # the second step reused the first one's matrices
    a[0][1, 0].copy_(torch.randn(RANK, HIDDEN, generator=gen))  # vLLM's set_lora: a new adapter in slot 1
    b[1][1, 0].copy_(torch.randn(SLICES[1], RANK, generator=gen))
    step()
    assert len(builds) == 2
    for stacked in (*a, *b):  # vLLM's reset_lora
        stacked[1] = 0
    step()
    wrapper.add_lora_linear(torch.zeros(4, sum(SLICES)), torch.ones(4, HIDDEN), a, b, 0.5, SLICES)  # another scale
    assert builds == [SCALE, SCALE, SCALE, 0.5]


def test_inference_tensors_are_fused_on_every_call(art_ops: None) -> None:
    with torch.inference_mode():  # no version counters to tell a write by
        result, want = apply([12] * 3, [12] * 3, prefill=False)
    torch.testing.assert_close(result, want)


def test_fuse_adapter_says_when_the_slices_do_not_match_b() -> None:
    a, b = adapters()
    with pytest.raises(ValueError, match=r"B matrices of \[6, 10\] rows for output slices \[6, 9\]"):
        vllm_cpu_lora.fuse_adapter([w[0, 0] for w in a], [w[0, 0] for w in b], SCALE, (6, 9), torch.float32)
