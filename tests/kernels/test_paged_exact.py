"""The CPU kernel reads exact tokens in place from a layer's page pool (``PagedExact``: pool
slots in token order, every page full but the last): the same attention as those tokens copied
out (``exact_kv``), against float64, for pages in any slot order, a partly filled last page,
value and key widths that differ, and beside Recent and Mid segments; slots outside the pool are
refused by the kernel, never read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtopo.kernels.cpu_decode import c_kernel_available, cpu_decode_batch
from kvtopo.kernels.decode_inputs import DecodeSegments, PagedExact
from kvtopo.kernels.decode_reference import reference_decode

from segments import synthetic_segments

pytestmark = pytest.mark.skipif(not c_kernel_available(), reason="the CPU decode kernel did not build here")


def _paged(heads, page, dk, dv, slots, tokens, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    capacity = max(slots) + 2
    pool_k, pool_v = torch.randn(capacity, heads, page, dk, generator=g), torch.randn(capacity, heads, page, dv, generator=g)
    return PagedExact(pool_k.to(dtype), pool_v.to(dtype), torch.tensor(slots, dtype=torch.int32), tokens)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("heads,group,dk,dv,slots,tokens", [
    (2, 4, 32, 32, [7, 2, 5], 10),  # last page partly filled, slots out of order
    (1, 8, 64, 16, [0], 3),  # one partial page; values narrower than keys
    (3, 3, 16, 16, [4, 1, 6, 0, 9, 3], 24),  # full pages only
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_exact_equals_the_tokens_copied_out(heads, group, dk, dv, slots, tokens, dtype):
    """float32 pools are read as 32-bit codes, bfloat16 pools as 16-bit ones (no widening copy)."""
    page = 4
    pages = _paged(heads, page, dk, dv, slots, tokens, seed=tokens, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    new = (torch.randn(heads, 1, dk, generator=g).to(dtype), torch.randn(heads, 1, dv, generator=g).to(dtype))
    q = torch.randn(2, heads * group, dk, generator=g)
    paged = DecodeSegments(exact=new, exact_pages=pages)
    copied = DecodeSegments(exact=paged.exact_kv())
    assert copied.exact[0].shape[1] == tokens + 1
    out = cpu_decode_batch(q, [paged, copied], 0.2)
    ref = torch.stack([reference_decode(q[b], copied, 0.2) for b in range(2)])
    assert _rel(out, ref) < 1e-5
    # Row by row the paged sequence computes what the copied one does (same query, same tokens).
    same_q = cpu_decode_batch(q[:1].expand(2, -1, -1).contiguous(), [paged, copied], 0.2)
    assert torch.allclose(same_q[0], same_q[1], atol=1e-6, rtol=1e-5)


def test_paged_exact_beside_recent_and_mid_segments():
    """A store's step: paged exact pages + the new token, Recent codes and Mid codes, in a batch
    with a sequence whose exact tokens are explicit."""
    stored = synthetic_segments(kv_heads=2, group=4, dk=32, dv=32, exact=0, recent_pages=2, page_size=4,
                                mid_page_rows=(4, 1, 3) * 5, seed=3)
    pages = _paged(2, 4, 32, 32, [3, 0], 6, seed=4)
    g = torch.Generator().manual_seed(5)
    new = (torch.randn(2, 1, 32, generator=g), torch.randn(2, 1, 32, generator=g))
    paged = dataclasses.replace(stored, exact=new, exact_pages=pages)
    explicit = synthetic_segments(kv_heads=2, group=4, dk=32, dv=32, exact=5, recent_pages=1, page_size=4,
                                  mid_page_rows=(2,) * 7, seed=6)
    q = torch.randn(2, 8, 32, generator=g)
    out = cpu_decode_batch(q, [paged, explicit], 0.25)
    for b, segs in enumerate((paged, explicit)):
        assert _rel(out[b], reference_decode(q[b], segs, 0.25)) < 1e-5


def test_slots_outside_the_pool_are_refused():
    pages = _paged(1, 4, 16, 16, [0, 1], 6, seed=0)
    outside = dataclasses.replace(pages, slots=torch.tensor([0, pages.keys.shape[0]], dtype=torch.int32))
    q = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_decode_batch(q, [DecodeSegments(exact_pages=outside)], 0.25)
    too_many = dataclasses.replace(pages, tokens=9)  # 2 pages of 4 cannot hold 9 tokens
    with pytest.raises(RuntimeError, match="do not fit their pages"):
        cpu_decode_batch(q, [DecodeSegments(exact_pages=too_many)], 0.25)
