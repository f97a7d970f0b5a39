"""The Triton decode kernels' online softmax where float32 exp would under- or overflow without
the running max (run by the Triton interpreter on CPU, set up by tests/kernels/triton_interpreter.py).

Shift-invariance hides a wrong running max on the suite's logits (|logit| < ~40): a running max
started at 0 instead of -inf, or replaced by each block's own max instead of the max so far,
gives the same softmax there, and fails only when every logit lies below exp's underflow (~-104)
or a later block of tokens lies ~88 below an earlier one (its rescale exp(m_old - m_new)
overflows). Exact tokens, Recent and (unprojected and projected) Mid codes, several blocks of 16
tokens and forced splits."""

from __future__ import annotations

from triton_interpreter import fresh_interpreter_run, in_process  # before anything imports triton

import pytest
import torch

from kvtopo.kernels import triton_decode
from kvtopo.kernels.decode_inputs import DecodeSegments, RecentCodes
from kvtopo.kernels.decode_reference import explicit_kv, reference_decode
from kvtopo.kernels.quant import quantize

from decode_bound import error_bound
from segments import concat_mids, unprojected_mid

test_in_fresh_interpreter_process = fresh_interpreter_run(__file__)


HEADS, GROUP, D, SHIFT = 1, 2, 32, 10.0


def _randn(seed: int, shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=g) + shift


def _check(q, segs, scale):
    out = triton_decode.triton_decode_attention(q, segs, scale)
    assert torch.isfinite(out).all()
    ref = reference_decode(q, segs, scale)
    assert (out.double() - ref).abs().max().item() <= error_bound(q, segs, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def _segments(shift: float, seed: int, recent_pages: int = 3, mid_rows=(8, 3, 8, 8, 8), exact: int = 40):
    """Exact tokens, Recent pages of 8 and an unprojected Mid whose keys carry a common offset
    of ~3 * shift per channel (values do not)."""
    randn = _randn(seed, shift)
    pages = [(quantize(3 * randn(HEADS, 8, D), 8, reduce_dim=1), quantize(randn(HEADS, 8, D) - shift, 8, reduce_dim=-1))
             for _ in range(recent_pages)]
    mid, _ = unprojected_mid(randn, HEADS, D, D, mid_rows, 4)
    return DecodeSegments(exact=(3 * randn(HEADS, exact, D), randn(HEADS, exact, D) - shift),
                          recent=RecentCodes.from_pages(pages, 8), mid=mid)


@in_process
@pytest.mark.parametrize("splits", [None, 2])
def test_every_logit_far_below_exp_underflow(splits, monkeypatch):
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", splits)
    segs = _segments(SHIFT, seed=0)
    q = -torch.ones(HEADS * GROUP, D) + 0.1 * torch.randn(HEADS * GROUP, D, generator=torch.Generator().manual_seed(1))
    scale = 0.125
    k = explicit_kv(segs)[0]
    assert (scale * q.double().reshape(HEADS, GROUP, D) @ k.transpose(1, 2)).max().item() < -105
    _check(q, segs, scale)


@in_process
@pytest.mark.parametrize("kind", ["exact", "recent", "mid"])
def test_later_blocks_far_below_the_first(kind, monkeypatch):
    """The first block (16 tokens) of a segment has logits ~+120, the later ones ~0: each later
    block's own max is ~120 below the running max. One split, so that one program runs every
    block (the interpreter's CPU target would give each block a split of its own)."""
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", 1)
    high = _segments(SHIFT, seed=2, recent_pages=2, mid_rows=(8, 8), exact=16)
    low = _segments(0.0, seed=3)
    if kind == "exact":
        segs = DecodeSegments(exact=tuple(torch.cat([a, b], 1) for a, b in zip(high.exact, low.exact)))
    elif kind == "recent":
        segs = DecodeSegments(recent=RecentCodes.concat([high.recent, low.recent]))
    else:
        segs = DecodeSegments(mid=concat_mids(high.mid, low.mid))
    q = torch.ones(HEADS * GROUP, D) + 0.1 * torch.randn(HEADS * GROUP, D, generator=torch.Generator().manual_seed(4))
    logits = 0.125 * q.double().reshape(HEADS, GROUP, D) @ explicit_kv(segs)[0].transpose(1, 2)
    assert logits[..., :16].min() > logits[..., 16:].max() + 90  # the first block far above the rest
    _check(q, segs, 0.125)
