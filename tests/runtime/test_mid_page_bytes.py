"""What the budget plans a Mid page to cost (`MidSegment.page_nbytes`, read by `keep_count` and the
joint eviction plan before any page is encoded) is what appending it adds to the segment's held
bytes, row count for row count: for quantized and float Mid, projected or not, for an MLA latent
(values inside the keys: one row count per page, no values) and for head dims whose codes end
inside a byte."""

import pytest
import torch

from kvtopo.runtime.codecs import MidSegment, fit_bases
from kvtopo.runtime.policies import MidEncoding

HEADS = 2


def _segment(encoding, key_dim, value_dim, shared, seed=0):
    g = torch.Generator().manual_seed(seed)
    key_bases = value_bases = None
    if encoding.project:
        key_bases = fit_bases(torch.randn(HEADS, 64, key_dim, generator=g), 0.9)
        value_bases = None if shared else fit_bases(torch.randn(HEADS, 64, value_dim, generator=g), 0.9)
    return MidSegment(encoding, key_bases, value_bases, torch.float32, shared_value_dim=value_dim if shared else None)


ENCODINGS = [MidEncoding(evict=True, key_bits=b, value_bits=b) for b in (2, 4, 8)] + [
    MidEncoding(evict=True), MidEncoding(project=True, key_bits=4, value_bits=4), MidEncoding(project=True)]


@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: f"project{int(e.project)}-bits{e.key_bits}")
@pytest.mark.parametrize("key_dim, value_dim", [(16, 16), (5, 3), (6, 7)])
@pytest.mark.parametrize("shared", [False, True], ids=["values", "mla"])
def test_planned_page_bytes_are_what_appending_the_page_adds(encoding, key_dim, value_dim, shared):
    if shared:
        value_dim = min(value_dim, key_dim)
    mid = _segment(encoding, key_dim, value_dim, shared)
    g = torch.Generator().manual_seed(1)
    for tokens in (3, 0, 1, 8, 0, 2):
        planned = mid.page_nbytes(tokens, HEADS, key_dim, 0 if shared else value_dim)
        before = mid.nbytes
        keys = torch.randn(HEADS, tokens, key_dim, generator=g)
        mid.append_page(keys, None if shared else torch.randn(HEADS, tokens, value_dim, generator=g))
        assert mid.nbytes - before == planned, tokens
