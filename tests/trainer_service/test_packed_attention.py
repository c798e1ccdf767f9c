"""`art_packed` attention: each sequence of a packed row sees only itself, as if run alone."""

from __future__ import annotations

import pytest
import torch

from tests.trainer_service.test_training import tiny_model
from trainer_service.packed_attention import PACKED_ATTENTION, packed_inputs

LENGTHS = [7, 12, 3, 9]


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 49152, (n,), generator=generator) for n in LENGTHS]


def test_a_packed_row_gives_each_sequence_its_logits_alone() -> None:
    model = tiny_model().eval()  # sdpa, 4 query heads over 2 key/value heads
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0)).logits[0] for s in sequences()]
        model.set_attn_implementation(PACKED_ATTENTION)
        row = torch.cat(sequences()).unsqueeze(0)
        packed = model(input_ids=row, use_cache=False, **packed_inputs(LENGTHS, row.device)).logits[0]
        unbounded = model(input_ids=sequences()[1].unsqueeze(0)).logits[0]  # no bounds: one sequence
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unbounded, alone[1], atol=1e-5, rtol=1e-5)
    # and the row is not one sequence: attending across the bounds changes the later sequences
    assert not torch.allclose(packed[LENGTHS[0]:], model(input_ids=row).logits[0][LENGTHS[0]:], atol=1e-3)


def test_gradients_stay_within_each_sequence() -> None:
    model = tiny_model()
    model.set_attn_implementation(PACKED_ATTENTION)
    embeddings = model.get_input_embeddings()(torch.cat(sequences())).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings.unsqueeze(0), use_cache=False,
                   **packed_inputs(LENGTHS, embeddings.device)).logits[0]
    logits[LENGTHS[0] : LENGTHS[0] + LENGTHS[1]].sum().backward()  # the second sequence's outputs only
    touched = embeddings.grad.abs().sum(-1) > 0
    assert touched[LENGTHS[0] : LENGTHS[0] + LENGTHS[1]].all() and touched.sum() == LENGTHS[1]


def test_a_padded_batch_is_refused() -> None:
    model = tiny_model()
    model.set_attn_implementation(PACKED_ATTENTION)
    with pytest.raises(ValueError, match="takes one unpadded row, got a batch of 2"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long))
