"""Triton decode of a batch whose segments are split along the tokens: each (entry, split) partial
is merged into its own sequence's row (``_as_rows``: entry e's S splits are rows e * S .. e * S +
S - 1 and all belong to sequence ``entries[e]``).

tests/kernels/test_triton_decode.py forces splits only for one sequence, and its batch test
runs one split per entry (interpreter-sized work fills ``_splits``' CPU target at once); on a GPU
a batch usually has several entries *and* several splits (the target is two programs per SM).
The interpreter set up by tests/kernels/triton_interpreter.py."""

from __future__ import annotations

from triton_interpreter import fresh_interpreter_run, in_process  # before anything imports triton

import dataclasses

import pytest
import torch

from kvtopo.kernels import cpu_decode, triton_decode
from kvtopo.kernels.decode_inputs import DecodeSegments
from kvtopo.kernels.decode_reference import reference_decode

from decode_bound import error_bound
from segments import synthetic_segments

test_in_fresh_interpreter_process = fresh_interpreter_run(__file__)


@in_process
@pytest.mark.parametrize("projected", [True, False])
def test_batch_with_several_splits_per_entry(projected, monkeypatch):
    """Three sequences of different histories (and one earlier Mid epoch: two Mid entries of one
    sequence), every launch forced to 3 splits: each row equals its own sequence's float64
    attention, and no row depends on the others."""
    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", 3)
    common = dict(kv_heads=1, group=2, dk=32, dv=32, page_size=4, projected=projected)
    segs = [synthetic_segments(**common, exact=40, recent_pages=3, mid_page_rows=(4, 3, 4, 4, 2) * 4, seed=1),
            synthetic_segments(**common, exact=3, recent_pages=1, mid_page_rows=(4, 1), seed=2),
            synthetic_segments(**common, exact=21, recent_pages=0, mid_page_rows=(4,) * 9, seed=3)]
    earlier = synthetic_segments(**common, exact=0, recent_pages=0, mid_page_rows=(4, 2, 4), seed=4).mid
    segs[1] = dataclasses.replace(segs[1], retired=(earlier,))
    q = 3 * torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(5))
    out = triton_decode.triton_decode_batch(q, segs, 32**-0.5)
    assert out.shape == (3, 2, 32) and torch.isfinite(out).all()
    for b, s in enumerate(segs):
        ref = reference_decode(q[b], s, 32**-0.5)
        err = (out[b].double() - ref).abs().max().item()
        assert err <= error_bound(q[b], s, 32**-0.5), (b, err)
        torch.testing.assert_close(out[b].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@in_process
def test_a_sequence_with_no_stored_tokens_reads_as_zeros(monkeypatch):
    """A batch row that no segment covers comes out zero (``_merge_rows``: -inf everywhere, weight
    0), as the CPU path's merge gives it, while the other rows keep their own attention."""
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", 2)
    seen = synthetic_segments(kv_heads=1, group=2, dk=32, dv=32, exact=20, recent_pages=1, page_size=4,
                              mid_page_rows=(4, 2), seed=6)
    q = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(7))
    out = triton_decode.triton_decode_batch(q, [seen, DecodeSegments()], 32**-0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(cpu_decode.cpu_decode_batch(q, [seen, DecodeSegments()], 32**-0.5)[1], out[1])
    ref = reference_decode(q[0], seen, 32**-0.5)
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
