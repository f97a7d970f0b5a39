"""A prefill chunk's attention to itself and to the stored history (`partial_dense`) runs in
blocks of query rows on CPU; the session's outputs and everything it stores must be the bits
that one block over all rows gives."""

import pytest
import torch

from kvtopo.kernels import compressed_attention
from kvtopo.kernels.compressed_attention import partial_dense
from kvtopo.kernels.reference import chunk_causal_mask


@pytest.mark.parametrize("t, history, softcap", [(300, 0, None), (200, 500, None), (129, 40, 30.0)])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "per-head rows", "per-head keys"])
def test_blocks_of_query_rows_give_the_bits_of_one_block(t, history, softcap, mask_kind, monkeypatch):
    g = torch.Generator().manual_seed(t + history)
    q = torch.randn(8, t, 16, generator=g) * 3
    k = torch.randn(2, history + t, 16, generator=g) * 2
    v = torch.randn(2, history + t, 12, generator=g)
    mask = {"causal": chunk_causal_mask(history, t), "none": None,
            "per-head rows": torch.rand(2, 1, t, history + t, generator=g) > 0.3,
            "per-head keys": torch.rand(2, 1, 1, history + t, generator=g) > 0.3}[mask_kind]
    monkeypatch.setattr(compressed_attention, "BLOCK_LOGITS", 1 << 15)  # several blocks, a ragged last one
    out, lse = partial_dense(q, k, v, 0.25, mask, softcap)
    monkeypatch.setattr(compressed_attention, "BLOCK_LOGITS", 1 << 40)  # one block
    ref_out, ref_lse = partial_dense(q, k, v, 0.25, mask, softcap)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
