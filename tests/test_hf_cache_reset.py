"""`SessionCache.reset()` (what HF calls to drop a cache's history) forgets every sequence the
session stores and gives its pool slots back; the length it reports is 0 again."""

import torch

import kvtopo
from kvtopo.hf_cache import SessionCache


def test_reset_forgets_every_stored_sequence():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g), \
        torch.randn(2, 2, 20, 8, generator=g)
    with kvtopo.session(kvtopo.Config.lossless(page_size=8)) as s:
        s.attend("l", q, k, v, None, 0.35)
        cache = SessionCache(s)
        assert cache.get_seq_length() == 20
        cache.reset()
        assert cache.get_seq_length() == 0
        assert not s.layers["l"].sequences and s.layers["l"].pool.live_pages == 0
        out = s.attend("l", q[:1], k[:1], v[:1], None, 0.35)  # a batch of another size is taken again
    with kvtopo.session(kvtopo.Config.lossless(page_size=8)) as fresh:
        assert torch.equal(out, fresh.attend("l", q[:1], k[:1], v[:1], None, 0.35))
