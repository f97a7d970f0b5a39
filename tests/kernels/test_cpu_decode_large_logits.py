"""The C decode kernel's softmax shifts where float32 exp would under- or overflow.

Softmax is shift-invariant, so a kernel whose running max starts at 0 instead of -inf, or whose
split merge shifts by the first split's log-sum-exp instead of the largest, gives the same
result on the suite's logits (|logit| < ~40, exp stays in float32's range) and fails only where
every logit of a split lies below float32 exp's underflow (~-104: every weight 0, 0/0) or a
later split's log-sum-exp exceeds the first's by more than its overflow (~88: inf/inf). Large
logits are real (un-capped models with outlier channels, a query far from every stored key).
Both cases here: all phases (exact, Recent, unprojected Mid) with logits near -120, and a Mid
segment of several 1024-row splits whose later rows have logits ~120 above the first split's.
"""

from __future__ import annotations

import pytest
import torch

from kvtopo.kernels import cpu_decode
from kvtopo.kernels.decode_inputs import DecodeSegments, RecentCodes
from kvtopo.kernels.decode_reference import reference_decode
from kvtopo.kernels.quant import quantize

from decode_bound import error_bound
from segments import concat_mids, decode_on_threads, unprojected_mid

pytestmark = pytest.mark.skipif(not cpu_decode.c_kernel_available(), reason="the CPU decode kernel did not build here")

HEADS, GROUP, D, SHIFT = 2, 4, 64, 5.0


def _shifted(seed: int, shift: float):
    """randn whose every draw is moved by `shift` (keys built from it carry a large common offset)."""
    g = torch.Generator().manual_seed(seed)
    return lambda *s: torch.randn(*s, generator=g) + shift


def _check(q, segs, scale, threads):
    out = decode_on_threads(q, segs, scale, threads)
    assert torch.isfinite(out).all()
    ref = reference_decode(q, segs, scale)
    err = (out.double() - ref).abs().max().item()
    assert err <= error_bound(q, segs, scale), (err, error_bound(q, segs, scale))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("threads", [1, 2])
def test_every_logit_far_below_exp_underflow(threads):
    """Keys of every phase share a common offset of ~15 per channel; the query points against it:
    every logit is about -120, so exp(logit) is 0 in float32 unless shifted by the max."""
    randn = _shifted(0, SHIFT)
    mid, _ = unprojected_mid(randn, HEADS, D, D, (8, 3, 5, 8), 4)
    pages = [(quantize(3 * randn(HEADS, 8, D), 8, reduce_dim=1), quantize(randn(HEADS, 8, D) - SHIFT, 8, reduce_dim=-1))
             for _ in range(2)]
    recent = RecentCodes.from_pages(pages, 8)
    exact = (3 * randn(HEADS, 5, D), randn(HEADS, 5, D) - SHIFT)
    for segs in (DecodeSegments(exact=exact), DecodeSegments(recent=recent), DecodeSegments(mid=mid),
                 DecodeSegments(exact=exact, recent=recent, mid=mid)):
        q = -torch.ones(HEADS * GROUP, D) + 0.1 * torch.randn(HEADS * GROUP, D, generator=torch.Generator().manual_seed(1))
        logits_max = (0.125 * q.double().reshape(HEADS, GROUP, D) @ _keys(segs).transpose(1, 2)).max().item()
        assert logits_max < -105, logits_max  # every weight underflows without the shift
        _check(q, segs, 0.125, threads)


def _keys(segs):
    from kvtopo.kernels.decode_reference import explicit_kv

    return explicit_kv(segs)[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_later_split_far_above_the_first(threads):
    """A Mid segment of 2304 rows (three splits of <= 1024): rows from 1536 on have keys with a common
    offset, so the last split's log-sum-exp is ~120 above the first's."""
    plain, shifted = _shifted(2, 0.0), _shifted(3, SHIFT)
    low, _ = unprojected_mid(plain, HEADS, D, D, (8,) * 192, 4)
    high, _ = unprojected_mid(shifted, HEADS, D, D, (8,) * 96, 4)
    mid = concat_mids(low, high)
    assert mid.tokens == 2304
    q = torch.ones(HEADS * GROUP, D) + 0.1 * torch.randn(HEADS * GROUP, D, generator=torch.Generator().manual_seed(4))
    _check(q, DecodeSegments(mid=mid), 0.125, threads)
    exact = (torch.randn(HEADS, 3, D), torch.randn(HEADS, 3, D))
    _check(q, DecodeSegments(exact=exact, mid=mid), 0.125, threads)
