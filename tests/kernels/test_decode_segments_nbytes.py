"""``DecodeSegments.nbytes``: the bytes a decode step reads, as the decode benchmarks report them
(bench/decode_speed.py, bench/gpu_kernels.py divide them by the step's time).

Exact tokens read in place from the page pool (``PagedExact``) cost what the same tokens copied
out cost -- their keys *and* values, at the pool's dtype -- plus the slot table; pages of the pool
that the sequence does not hold, and the unused rows of its last page, are not read. Keys and
values of different widths and a bfloat16 pool make each term visible.
"""

from __future__ import annotations

import pytest
import torch

from kvtopo.kernels.decode_inputs import DecodeSegments, PagedExact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk, dv", [(32, 32), (64, 16), (16, 48)])
def test_paged_exact_tokens_count_keys_values_and_slots(dtype, dk, dv):
    heads, page, tokens = 3, 4, 10  # three pages, the last one half full
    g = torch.Generator().manual_seed(dk + dv)
    pool_k = torch.randn(7, heads, page, dk, generator=g).to(dtype)
    pool_v = torch.randn(7, heads, page, dv, generator=g).to(dtype)
    slots = torch.tensor([5, 0, 3], dtype=torch.int32)
    paged = DecodeSegments(exact_pages=PagedExact(pool_k, pool_v, slots, tokens))
    size = torch.finfo(dtype).bits // 8
    assert paged.nbytes == tokens * heads * (dk + dv) * size + slots.nbytes

    copied = DecodeSegments(exact=paged.exact_kv())  # the same tokens as explicit tensors
    assert copied.nbytes == tokens * heads * (dk + dv) * size
    assert paged.nbytes == copied.nbytes + slots.nbytes

    new = (torch.randn(heads, 1, dk).to(dtype), torch.randn(heads, 1, dv).to(dtype))  # the step's own token
    both = DecodeSegments(exact=new, exact_pages=paged.exact_pages)
    assert both.nbytes == paged.nbytes + heads * (dk + dv) * size
