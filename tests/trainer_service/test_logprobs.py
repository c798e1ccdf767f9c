"""`token_logprobs` against `log_softmax` + gather: values, gradients, dtypes, blocks."""

from __future__ import annotations

import pytest
import torch

from trainer_service import logprobs
from trainer_service.logprobs import token_logprobs


def reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]).squeeze(1)


@pytest.fixture(params=[1 << 20, 24], ids=["one-block", "blocks-of-3-rows"])
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logprobs, "_BLOCK_ELEMENTS", request.param)


def test_values_and_gradient_equal_log_softmax_in_float64(block: None) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 8, (7,), generator=gen)
    # float64 in, float32 out: compare the values at float32 precision, the gradient exactly by gradcheck
    torch.testing.assert_close(token_logprobs(logits, targets), reference(logits, targets).float())
    weights = torch.randn(7, dtype=torch.float64, generator=gen)
    fn = lambda x: (logprobs._TokenLogprobs.apply(x, targets).double() * weights).sum()  # noqa: E731
    # the op returns float32, so its float64 gradcheck holds to float32 precision
    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-3, atol=1e-4, rtol=1e-3)


def test_bf16_logits_match_the_float32_reference_and_get_a_bf16_gradient(block: None) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 50, generator=gen) * 4).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 50, (9,), generator=gen)
    weights = torch.randn(9, generator=gen)
    values = token_logprobs(logits, targets)
    (values * weights).sum().backward()
    assert values.dtype == torch.float32 and logits.grad is not None and logits.grad.dtype == torch.bfloat16
    wide = logits.detach().float().requires_grad_(True)
    want = reference(wide, targets)
    (want * weights).sum().backward()
    torch.testing.assert_close(values, want)
    assert wide.grad is not None
    torch.testing.assert_close(logits.grad.float(), wide.grad, atol=1e-2, rtol=1e-2)  # bf16 rounding of the gradient
    # each row's gradient sums to 0 (softmax minus one-hot, times the row's weight)
    torch.testing.assert_close(wide.grad.sum(-1), torch.zeros(9), atol=1e-6, rtol=0)


def test_float32_logits_are_left_as_they_were_by_the_backward(block: None) -> None:
    logits = torch.randn(5, 6, requires_grad=True)
    before = logits.detach().clone()
    token_logprobs(logits, torch.tensor([0, 1, 2, 3, 4])).sum().backward()
    assert torch.equal(logits.detach(), before)


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"logits \[rows, vocab\] and targets \[rows\]"):
        token_logprobs(torch.zeros(1, 3, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="got \\(3, 5\\) and \\(2,\\)"):
        token_logprobs(torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))
