"""The Triton Mid kernel reads statistics through their addresses in one dtype per launch: float16
when *every* statistic of every Mid segment of the launch is float16 (as the store keeps them),
else all widened to float32. The store keeps float32 statistics for a page whose values pass
float16's range (kernels/quant.py), so one launch can meet both: the keys of one segment in
float32 and its values in float16, or a sequence's current Mid in float16 beside an earlier epoch
in float32. tests/kernels/test_triton_decode.py checks all-float16 against all-float32 only.
The interpreter set up by tests/kernels/triton_interpreter.py."""

from __future__ import annotations

from triton_interpreter import fresh_interpreter_run, in_process  # before anything imports triton

import dataclasses

import pytest
import torch

from kvtopo.kernels import triton_decode
from kvtopo.kernels.decode_reference import reference_decode

from segments import synthetic_segments

test_in_fresh_interpreter_process = fresh_interpreter_run(__file__)


def _stats(mid, dtypes):
    """mid with its (k_scale, k_offset, v_scale, v_offset) rounded to float16 and held as `dtypes`."""
    names = ("k_scale", "k_offset", "v_scale", "v_offset")
    return dataclasses.replace(mid, **{n: getattr(mid, n).half().to(d) for n, d in zip(names, dtypes)})


HALF, WIDE = torch.float16, torch.float32


@in_process
@pytest.mark.parametrize("projected", [True, False])
@pytest.mark.parametrize("mixed", ["keys-wide", "values-wide", "epoch-wide"])
def test_mixed_statistics_dtypes_in_one_launch(projected, mixed):
    common = dict(kv_heads=2, group=2, dk=32, dv=32, page_size=4, projected=projected)
    segs = synthetic_segments(**common, exact=2, recent_pages=0, mid_page_rows=(4, 3, 4), seed=1)
    earlier = synthetic_segments(**common, exact=0, recent_pages=0, mid_page_rows=(4, 1), seed=2).mid
    if mixed == "keys-wide":
        segs = dataclasses.replace(segs, mid=_stats(segs.mid, (WIDE, WIDE, HALF, HALF)))
    elif mixed == "values-wide":
        segs = dataclasses.replace(segs, mid=_stats(segs.mid, (HALF, HALF, WIDE, WIDE)))
    else:
        segs = dataclasses.replace(segs, mid=_stats(segs.mid, (HALF,) * 4), retired=(_stats(earlier, (WIDE,) * 4),))
    q = 3 * torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    out = triton_decode.triton_decode_attention(q, segs, 32**-0.5)
    assert torch.isfinite(out).all()
    ref = reference_decode(q, segs, 32**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the same values all held in float32: the same result, bit for bit
    wide = dataclasses.replace(segs, mid=_stats(segs.mid, (WIDE,) * 4),
                               retired=tuple(_stats(m, (WIDE,) * 4) for m in segs.retired))
    assert torch.equal(out, triton_decode.triton_decode_attention(q, wide, 32**-0.5))
