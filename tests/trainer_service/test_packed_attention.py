"""`art_packed` attention: each sequence of a packed row sees only itself, as if run alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from tests.trainer_service.builders import tiny_model
from trainer_service import packed_attention
from trainer_service.packed_attention import (
    PACKED_ATTENTION,
    UnsupportedAttentionError,
    pack_row,
    packing_keeps_sequences_apart,
    prefix_sharing_works,
)

LENGTHS = [7, 12, 3, 9]


@pytest.fixture(autouse=True, params=[192, 8, 0, None],
                ids=["short-segments-batched", "some-batched", "none-batched", "float32-on-flash"])
def short_keys(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every test runs with all segments in one batched call, with some, with each segment alone (the tiny
    model is float32: here it runs on the math kernel as bf16 does), and with float32's own kernels."""
    if request.param is None:
        return 192
    monkeypatch.setattr(packed_attention, "_MATH_DTYPES", (torch.bfloat16, torch.float32))
    monkeypatch.setattr(packed_attention, "_SHORT_KEYS", request.param)
    return request.param


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 49152, (n,), generator=generator) for n in LENGTHS]


def test_a_packed_row_gives_each_sequence_its_logits_alone() -> None:
    model = tiny_model().eval()  # sdpa, 4 query heads over 2 key/value heads
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0)).logits[0] for s in sequences()]
        model.set_attn_implementation(PACKED_ATTENTION)
        layout = pack_row(sequences())
        row = layout.token_ids.unsqueeze(0)
        packed = model(input_ids=row, use_cache=False, **layout.inputs).logits[0]
        unbounded = model(input_ids=sequences()[1].unsqueeze(0)).logits[0]  # no bounds: one sequence
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unbounded, alone[1], atol=1e-5, rtol=1e-5)
    # and the row is not one sequence: attending across the bounds changes the later sequences
    assert not torch.allclose(packed[LENGTHS[0]:], model(input_ids=row).logits[0][LENGTHS[0]:], atol=1e-3)


def test_gradients_stay_within_each_sequence() -> None:
    model = tiny_model()
    model.set_attn_implementation(PACKED_ATTENTION)
    layout = pack_row(sequences())
    embeddings = model.get_input_embeddings()(layout.token_ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings.unsqueeze(0), use_cache=False, **layout.inputs).logits[0]
    logits[LENGTHS[0] : LENGTHS[0] + LENGTHS[1]].sum().backward()  # the second sequence's outputs only
    touched = embeddings.grad.abs().sum(-1) > 0
    assert touched[LENGTHS[0] : LENGTHS[0] + LENGTHS[1]].all() and touched.sum() == LENGTHS[1]


def test_a_padded_batch_is_refused() -> None:
    model = tiny_model()
    model.set_attn_implementation(PACKED_ATTENTION)
    with pytest.raises(ValueError, match="takes one unpadded row, got a batch of 2"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long))


def family() -> list[torch.Tensor]:
    """Three samples of one 6-token prompt (one identical to another), then a stranger."""
    prompt = torch.tensor([5, 17, 300, 4000, 12, 9])
    return [torch.cat([prompt, torch.tensor(tail)]) for tail in ([40, 41, 42], [50, 51], [40, 41, 42, 43])] + [
        torch.tensor([7, 8, 9, 10])]


def test_a_shared_prefix_is_held_once_and_each_continuation_sees_it() -> None:
    model = tiny_model().eval()
    sequences = family()
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0)).logits[0] for s in sequences]
        model.set_attn_implementation(PACKED_ATTENTION)
        layout = pack_row(sequences, shareable=[7, 6, 6, 3])  # the first may share 7 tokens, the others 6
        logits = model(input_ids=layout.token_ids.unsqueeze(0), use_cache=False, **layout.inputs).logits[0]
    assert layout.shared == [6, 6, 6, 0] and layout.token_ids.numel() == 6 + 3 + 2 + 4 + 4
    assert layout.inputs["art_prefix"] == [-1, 0, 0, 0, -1]
    for index, want in enumerate(alone):
        torch.testing.assert_close(logits[layout.own(index)], want[layout.shared[index] :], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[:6], alone[0][:6], atol=1e-5, rtol=1e-5)  # the prefix itself


def test_the_shared_prefix_gets_the_gradient_of_every_continuation() -> None:
    model = tiny_model()
    model.set_attn_implementation(PACKED_ATTENTION)
    embed = model.get_input_embeddings()
    sequences = family()[:3]

    def prompt_gradient(shareable: list[int]) -> torch.Tensor:
        """d(sum of every continuation's logits) / d(prompt embeddings), summed over the prompt's copies."""
        layout = pack_row(sequences, shareable)
        inputs = embed(layout.token_ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=inputs.unsqueeze(0), use_cache=False, **layout.inputs).logits[0]
        # each continuation's outputs past the prompt (a separate copy's own part starts with the prompt)
        sum(logits[layout.own(i)][6 - layout.shared[i] :].sum() for i in range(len(sequences))).backward()
        grad = inputs.grad
        assert grad is not None
        copies = [0] if layout.shared[0] else layout.starts
        return sum(grad[start : start + 6] for start in copies)

    torch.testing.assert_close(prompt_gradient([6, 6, 6]), prompt_gradient([0, 0, 0]), atol=1e-4, rtol=1e-4)


def test_continuations_are_not_separated_without_art_packed() -> None:
    model = tiny_model().eval()  # sdpa: positions that do not restart at 0 read as a new sequence
    sequences = family()[:2]
    layout = pack_row(sequences, [6, 6])
    with torch.no_grad():
        alone = model(input_ids=sequences[1].unsqueeze(0)).logits[0][6:]
        logits = model(input_ids=layout.token_ids.unsqueeze(0), use_cache=False, **layout.inputs).logits[0]
    assert not torch.allclose(logits[layout.starts[1]:], alone, atol=1e-3)


def test_bf16_rows_match_each_sequence_alone_short_and_long() -> None:
    # short segments take the plain-math kernel in bf16, long ones flash: both must agree with sdpa alone
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 49152, (30,), generator=generator)
    sequences = [torch.cat([prompt, torch.randint(0, 49152, (n,), generator=generator)]) for n in (20, 230)]
    sequences.append(torch.randint(0, 49152, (240,), generator=generator))
    model = tiny_model().to(torch.bfloat16).eval()
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0)).logits[0].float() for s in sequences]
        model.set_attn_implementation(PACKED_ATTENTION)
        layout = pack_row(sequences, [30, 30, 0])
        logits = model(input_ids=layout.token_ids.unsqueeze(0), use_cache=False, **layout.inputs).logits[0].float()
    assert layout.shared == [30, 30, 0]
    for index, want in enumerate(alone):
        got = logits[layout.own(index)]
        assert (got - want[layout.shared[index] :]).abs().max() <= 2e-2 * want.abs().max()


def test_the_batch_holds_the_short_segments_and_the_rest_run_alone(short_keys: int) -> None:
    layout = pack_row(family(), shareable=[7, 6, 6, 3])  # segments: prompt 6, then 3, 2 and 4 after it, stranger 4
    batch = layout.inputs["art_batch"]
    expected = {192: [0, 1, 2, 3, 4], 8: [0, 2, 4], 0: []}[short_keys]  # keys with the prompt: 6, 9, 8, 10, 4
    if not expected:
        assert batch is None
        return
    assert batch.segments == expected
    assert sorted(batch.gather.tolist()) == batch.gather.unique().tolist()  # every row position read once
    assert batch.gather.numel() == layout.token_ids.numel()


def test_bf16_batched_attention_gradients_match_float64_per_segment() -> None:
    # the batched short segments (two bf16 products, query heads stacked per key/value head) against
    # sdpa on each segment alone in float64: bf16's own rounding is the only difference allowed
    generator = torch.Generator().manual_seed(3)
    layout = pack_row(family(), shareable=[7, 6, 6, 3])
    rows, heads, kv_heads, dim = layout.token_ids.numel(), 6, 2, 16
    query, key, value = (torch.randn(1, n, rows, dim, generator=generator) for n in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(1, rows, heads, dim, generator=generator)

    def gradients(dtype: torch.dtype, batch: object) -> list[torch.Tensor]:
        leaves = [t.to(dtype).requires_grad_(True) for t in (query, key, value)]
        inputs = {**layout.inputs, "art_batch": batch}
        out, _ = packed_attention.packed_attention(torch.nn.Module(), *leaves, None, **inputs)
        out.backward(grad_out.to(dtype))
        return [leaf.grad.double() for leaf in leaves]

    want = gradients(torch.float64, None)  # each segment alone, float64 sdpa
    got = gradients(torch.bfloat16, layout.inputs["art_batch"])
    for g, w in zip(got, want, strict=True):
        assert (g - w).norm() <= 1e-2 * w.norm()


def test_prefix_sharing_needs_art_packed_attention() -> None:
    model = tiny_model()
    assert packing_keeps_sequences_apart(model) and not prefix_sharing_works(model)  # sdpa
    model.set_attn_implementation(PACKED_ATTENTION)
    assert prefix_sharing_works(model)


SHAPE = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize(("model", "asked"), [
    (lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=4)), "sliding_window"),
    (lambda: Gemma2ForCausalLM(Gemma2Config(**SHAPE)), "softcap")], ids=["sliding-window", "soft-cap"])
def test_an_attention_it_does_not_compute_is_refused(model: Callable[[], torch.nn.Module], asked: str) -> None:
    # run as plain causal attention, a 12-token sequence's logits were off by 0.42 (largest 0.66; window 4)
    net = model().eval()
    net.set_attn_implementation(PACKED_ATTENTION)
    with pytest.raises(UnsupportedAttentionError, match=f"does not compute .*{asked}"), torch.no_grad():
        net(input_ids=torch.arange(1, 13).unsqueeze(0), use_cache=False)
