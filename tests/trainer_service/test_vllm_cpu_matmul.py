"""bf16 products for a float32 vLLM-cpu engine (`trainer_service.vllm_cpu_matmul`), on vLLM's own
linear layers and its own CPU GEMM dispatch (`dispatch_cpu_unquantized_gemm`), without an engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.model_executor.layers import utils
from vllm.model_executor.layers.linear import ReplicatedLinear

from examples.stack import free_port
from trainer_service import vllm_cpu_matmul
from trainer_service.engine import VLLMEngine

pytestmark = pytest.mark.skipif(
    not vllm_cpu_matmul.cpu_multiplies_bf16(), reason="bf16 products want a CPU with AMX or AVX512-BF16"
)


@pytest.fixture(scope="module")
def vllm_context() -> Iterator[None]:
    """vLLM's layers read its config and tensor-parallel group: one process, gloo, torn down after."""
    port = free_port()
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`register()` with the variable set to bfloat16; vLLM's dispatch is put back afterwards."""
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm)
    monkeypatch.setenv(vllm_cpu_matmul.MATMUL_DTYPE_ENV, "bfloat16")
    vllm_cpu_matmul.register()
    yield


def linear_layer(bias: bool) -> tuple[ReplicatedLinear, torch.Tensor, torch.Tensor | None]:
    """A float32 vLLM linear layer with random weights, after loading (the dispatch has run)."""
    layer = ReplicatedLinear(96, 80, bias=bias, params_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(80, 96, generator=gen))
    weight = layer.weight.detach().clone()
    b = None
    if bias:
        layer.bias.data.copy_(torch.randn(80, generator=gen))
        b = layer.bias.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    return layer, weight, b


@pytest.mark.parametrize("bias", [False, True])
def test_a_float32_linear_layer_multiplies_in_bf16_and_answers_in_float32(vllm_context: None, patched: None,
                                                                         bias: bool) -> None:
    layer, weight, b = linear_layer(bias)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    exact = x @ weight.T + (b if b is not None else 0)
    # the product of the bf16-rounded operands, itself rounded to bf16, then the float32 bias
    bf16 = (x.bfloat16().double() @ weight.bfloat16().double().T).bfloat16().float() + (b if b is not None else 0)
    assert out.dtype == torch.float32
    assert (out - bf16).abs().max() <= 1e-2 * exact.abs().max()
    assert (out - exact).abs().max() > 1e-4  # not the float32 product
    assert layer.weight.numel() == 0  # vLLM drops a CPU layer's weight once its kernel holds it


def test_without_the_variable_vllms_float32_product_stays(vllm_context: None, monkeypatch: pytest.MonkeyPatch) -> None:
    original = utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setenv(vllm_cpu_matmul.MATMUL_DTYPE_ENV, "float32")
    vllm_cpu_matmul.register()
    assert utils.dispatch_cpu_unquantized_gemm is original
    layer, weight, _ = linear_layer(bias=False)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    assert torch.allclose(out, x @ weight.T, atol=1e-4)


def test_other_layers_go_to_vllms_dispatch() -> None:
    calls: list[torch.nn.Module] = []
    dispatch = vllm_cpu_matmul.bf16_linear_dispatch(lambda layer, remove: calls.append(layer), lambda _: False)
    head = torch.nn.Module()
    # e.g. the LM head: its logits stay float32
    head.weight = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    dispatch(head, False)
    assert calls == [head] and not hasattr(head, "cpu_linear")
    bf16 = torch.nn.Module()
    bf16.weight = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)  # a bf16 engine
    vllm_cpu_matmul.bf16_linear_dispatch(lambda layer, remove: calls.append(layer), lambda _: True)(bf16, True)
    assert calls == [head, bf16]


def test_register_patches_once_and_rejects_unknown_values(patched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    once = utils.dispatch_cpu_unquantized_gemm
    vllm_cpu_matmul.register()
    assert utils.dispatch_cpu_unquantized_gemm is once
    monkeypatch.setenv(vllm_cpu_matmul.MATMUL_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="ART_VLLM_CPU_MATMUL_DTYPE='fp8'"):
        vllm_cpu_matmul.register()


def test_the_setting_reaches_the_engine_through_its_environment() -> None:
    assert vllm_cpu_matmul.matmul_dtype("auto") == "bfloat16"  # this module only runs where the CPU multiplies bf16
    assert vllm_cpu_matmul.matmul_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="vllm_matmul_dtype='half'"):
        vllm_cpu_matmul.matmul_dtype("half")
    engine = VLLMEngine("model", "model", 8001, cpu_matmul_dtype="bfloat16")
    assert engine.environment()[vllm_cpu_matmul.MATMUL_DTYPE_ENV] == "bfloat16"
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "art_cpu_bf16_matmul"]
    assert plugin.load() is vllm_cpu_matmul.register
