"""A Mid epoch with no rows left reads as nothing, on the CPU kernel and on the Triton kernels:
a batch row whose only stored segment is such an epoch comes out zero (no finite log-sum-exp),
and it changes nothing for the rows beside it.

Every split of an empty segment writes log-sum-exp -inf; the kernels' merges must then give the
row weight 0 rather than exp(-inf - -inf) = nan (the C kernel's ``merge_splits``, then
``merge_parts``; Triton's ``_merge_rows``). Rows with no segment at all never reach those
merges, and the runtime drops empty epochs before decoding (runtime/decode_view.py), so only a
segment that is present but empty exercises them.
"""

from __future__ import annotations

from triton_interpreter import fresh_interpreter_run, in_process  # before anything imports triton

import pytest
import torch

from kvtopo.kernels import cpu_decode, triton_decode
from kvtopo.kernels.decode_inputs import DecodeSegments
from kvtopo.kernels.decode_reference import reference_decode

from segments import synthetic_segments

test_in_fresh_interpreter_process = fresh_interpreter_run(__file__)

CASE = dict(kv_heads=2, group=2, dk=32, dv=32, exact=5, recent_pages=1, page_size=4, mid_page_rows=(4, 2, 3))
SCALE = 32**-0.5


def _batch(projected: bool):
    seen = synthetic_segments(**CASE, projected=projected, seed=1)
    empty_epoch = synthetic_segments(**CASE, projected=projected, seed=2).mid.rows(0, 0)
    assert empty_epoch.tokens == 0
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(3))
    return q, [seen, DecodeSegments(retired=(empty_epoch,))], seen


def _check(out, q, seen):
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = reference_decode(q[0], seen, SCALE)
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.skipif(not cpu_decode.c_kernel_available(), reason="the CPU decode kernel did not build here")
@pytest.mark.parametrize("projected", [True, False])
def test_cpu_kernel(projected):
    q, segs, seen = _batch(projected)
    _check(cpu_decode.cpu_decode_batch(q, segs, SCALE), q, seen)


@in_process
@pytest.mark.parametrize("projected", [True, False])
@pytest.mark.parametrize("splits", [None, 2])
def test_triton_kernels(projected, splits, monkeypatch):
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", splits)
    q, segs, seen = _batch(projected)
    _check(triton_decode.triton_decode_batch(q, segs, SCALE), q, seen)
