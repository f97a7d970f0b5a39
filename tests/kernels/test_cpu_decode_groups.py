"""The C decode kernel's general group-size path: query heads per kv-head G that neither divide 8
nor are a multiple of it, where padding each kv-head's lanes to 4 or 8 would add a block of 8
lanes (kernels/csrc/mid_decode.cpp ``run_splits``: Gp = G, so ``pick_dots`` takes
``DotsTable<0>``, each lane with its own kv-head offset).

tests/kernels/test_fast_cpu.py draws kv_heads in {1, 2, 3} and G in {1, 2, 3, 4, 6, 8}: every
such G = 3 or 6 is padded to 4 or 8, so the general path never runs there. Real models reach it
(Qwen2.5-7B: 28 query heads over 4 kv-heads, G = 7 with 8 kv-heads; G = 12; G = 5, 3 with
more kv-heads). Checked against float64 and against the torch fallback, at the tolerance
test_fast_cpu.py's fallback test uses."""

from __future__ import annotations

import pytest
import torch

from kvtopo.kernels import cpu_decode
from kvtopo.kernels.decode_reference import reference_decode

from segments import decode_on_threads, synthetic_segments

pytestmark = pytest.mark.skipif(not cpu_decode.c_kernel_available(), reason="the CPU decode kernel did not build here")


@pytest.mark.parametrize("kv_heads,group", [(3, 5), (5, 3), (2, 12), (8, 7)])
@pytest.mark.parametrize("projected", [True, False])
def test_general_group_size_matches_float64_and_fallback(kv_heads, group, projected, monkeypatch):
    segs = synthetic_segments(kv_heads=kv_heads, group=group, dk=64, dv=64, exact=5, recent_pages=1,
                              page_size=8, mid_page_rows=(8, 3, 0, 5) * 2, projected=projected,
                              seed=kv_heads * group)
    q = 3 * torch.randn(kv_heads * group, 64, generator=torch.Generator().manual_seed(group))
    out = decode_on_threads(q, segs, 0.125, 1)
    ref = reference_decode(q, segs, 0.125)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    monkeypatch.setattr(cpu_decode, "mid_kernel", lambda: None)
    slow = cpu_decode.cpu_decode_attention(q, segs, 0.125)
    torch.testing.assert_close(out, slow, rtol=1e-5, atol=1e-5 * slow.abs().max().item())
