"""`decode_view.attend_cache_batch` is the decode step: one query token per sequence. A call with
more query tokens is refused before anything is read (its kernel would attend the first query
alone, or the queries without their causal order), and the one-token step equals float64
attention over the stored history plus the new token."""

import pytest
import torch

import kvtopo
from kvtopo.runtime import decode_view

HQ, HKV, D = 4, 2, 16
SCALE = D**-0.5


def _history(s, g, n=20):
    """Sequence 0 of layer "l" holds n tokens; their keys and values [Hkv, n, d]."""
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (HQ, HKV, HKV))
    s.attend("l", q, k, v, None, SCALE)
    return k[0], v[0]


def _config():
    return kvtopo.Config.lossless(page_size=8)


def test_more_than_one_query_token_is_refused():
    g = torch.Generator().manual_seed(0)
    with kvtopo.session(_config()) as s:
        _history(s, g)
        cache = s.layers["l"]
        q = torch.randn(1, HQ, 2, D, generator=g)
        k, v = torch.randn(1, HKV, 2, D, generator=g), torch.randn(1, HKV, 2, D, generator=g)
        with pytest.raises(ValueError, match="one query token"):
            decode_view.attend_cache_batch(cache, [0], q, k, v, SCALE)
        assert cache.length(0) == 20


def test_one_query_token_equals_float64_attention_over_history_and_itself():
    g = torch.Generator().manual_seed(1)
    with kvtopo.session(_config()) as s:
        keys, values = _history(s, g)
        q = torch.randn(1, HQ, 1, D, generator=g)
        k, v = torch.randn(1, HKV, 1, D, generator=g), torch.randn(1, HKV, 1, D, generator=g)
        out = decode_view.attend_cache_batch(s.layers["l"], [0], q, k, v, SCALE)
    kk = torch.cat([keys, k[0]], 1).double().repeat_interleave(HQ // HKV, 0)
    vv = torch.cat([values, v[0]], 1).double().repeat_interleave(HQ // HKV, 0)
    ref = torch.softmax(q[0].double() @ kk.transpose(-1, -2) * SCALE, -1) @ vv
    assert out.shape == (1, HQ, 1, D)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=0)
