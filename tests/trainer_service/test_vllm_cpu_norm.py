"""art's C++ RMS norms for vLLM-cpu (`trainer_service.vllm_cpu_norm`), called through vLLM IR's dispatch
as vLLM's `RMSNorm` calls it, against vLLM's own PyTorch implementation (`native`)."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import torch
from vllm import ir
from vllm.config.kernel import IrOpPriorityConfig
from vllm.platforms import current_platform

from trainer_service import vllm_cpu_norm

PRIORITY = [vllm_cpu_norm.PROVIDER, "native"]


@pytest.fixture
def art_norms() -> Iterator[None]:
    """The plugin registered; vLLM's IR impls and the platform's default priority put back afterwards."""
    platform = type(current_platform)
    saved = vars(platform).get("get_default_ir_op_priority")
    vllm_cpu_norm.register()
    yield
    for name in vllm_cpu_norm.NORM_OPS:
        getattr(ir.ops, name).impls.pop(vllm_cpu_norm.PROVIDER, None)
    if saved is None:
        del platform.get_default_ir_op_priority
    else:
        platform.get_default_ir_op_priority = saved


def native(name: str):  # noqa: ANN201
    return getattr(ir.ops, name).impls["native"].impl_fn


def test_the_plugin_is_registered_under_vllms_entry_point() -> None:
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "art_cpu_norm"]
    assert plugin.load() is vllm_cpu_norm.register


def test_register_puts_the_kernels_first_in_the_cpu_default_once(art_norms: None) -> None:
    vllm_cpu_norm.register()  # vLLM may load a plugin more than once
    priority = current_platform.get_default_ir_op_priority(None)  # type: ignore[arg-type]
    assert isinstance(priority, IrOpPriorityConfig)
    assert priority.rms_norm == PRIORITY and priority.fused_add_rms_norm == PRIORITY
    assert priority.gelu_and_mul_sparse == ["native"]  # other ops as the platform had them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_equal_native_through_vllms_dispatch(art_norms: None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=gen).to(dtype)
    residual = torch.randn(7, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    with ir.ops.rms_norm.set_priority(PRIORITY), ir.ops.fused_add_rms_norm.set_priority(PRIORITY):
        assert ir.ops.rms_norm.dispatch(x, weight, 1e-5).provider == vllm_cpu_norm.PROVIDER
        torch.testing.assert_close(ir.ops.rms_norm(x, weight, 1e-5), native("rms_norm")(x, weight, 1e-5), **tolerance)
        want_out, want_residual = native("fused_add_rms_norm")(x.clone(), residual.clone(), weight, 1e-5)
        x_in, residual_in = x.clone(), residual.clone()
        out, new_residual = ir.ops.fused_add_rms_norm.maybe_inplace(x_in, residual_in, weight, 1e-5)
        assert out is x_in and new_residual is residual_in  # in place, as vLLM's GPU kernel
        torch.testing.assert_close(out, want_out, **tolerance)
        torch.testing.assert_close(new_residual, want_residual, **tolerance)


def test_inputs_the_kernels_would_misread_go_to_native(art_norms: None) -> None:
    wide = torch.randn(4, 64)
    strided = wide[:, :32]  # a view of every row's first half: the C++ kernel would read it as contiguous
    weight = torch.rand(32) + 0.5
    with ir.ops.rms_norm.set_priority(PRIORITY), ir.ops.fused_add_rms_norm.set_priority(PRIORITY):
        assert ir.ops.rms_norm.dispatch(strided, weight, 1e-5).provider == "native"
        torch.testing.assert_close(ir.ops.rms_norm(strided, weight, 1e-5), native("rms_norm")(strided, weight, 1e-5))
        for args in ((strided, torch.randn(4, 32), weight, 1e-5),  # strided input
                     (torch.randn(4, 32), strided, weight, 1e-5),  # strided residual
                     (torch.randn(4, 32), torch.randn(4, 32), weight.double(), 1e-5),  # another weight dtype
                     (torch.randn(4, 32), torch.randn(4, 32), weight, 1e-5, 16)):  # variance over 16 of 32
            assert ir.ops.fused_add_rms_norm.dispatch(*args).provider == "native"
        assert ir.ops.rms_norm.dispatch(torch.randn(4, 32).half(), weight.half(), 1e-5).provider == "native"
