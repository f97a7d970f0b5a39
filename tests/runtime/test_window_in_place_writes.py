"""`LayerCache.write_in_place` (the decode fast path's one indexed copy) must leave a sliding-window
layer as `append` leaves it: every token that slides out of the window frees its page. The session
does not route windowed layers there today, so nothing else pins it; checked against the hand rule
(a full page is released once its last token is before `length - window + 1`) and against appends."""

import pytest
import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import make_policy

P, WINDOW, HKV, D = 4, 7, 2, 8  # pages leave this window between page openings (window 6 would align them)


def _dropped_by_hand(length: int) -> int:
    pages = -(-length // P)
    first_visible = length - WINDOW + 1
    return P * max(0, min(pages - 1, first_visible // P))


@pytest.mark.parametrize("prompt", [3, 9])
def test_in_place_decode_writes_on_a_windowed_layer_drop_what_appends_drop(prompt):
    config = kvtopo.Config.lossless(page_size=P)
    fast, plain = (LayerCache(config, make_policy(config), window=WINDOW) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(HKV, 30, D, generator=g), torch.randn(HKV, 30, D, generator=g)
    for cache in (fast, plain):
        cache.append(0, k[:, :prompt], v[:, :prompt])
    for t in range(prompt, 30):
        step_k, step_v = k[:, t:t + 1], v[:, t:t + 1]
        for i in fast.write_in_place([0], step_k[None], step_v[None]):
            fast.append(0, step_k, step_v)
        plain.append(0, step_k, step_v)
        assert fast.first_held(0) == plain.first_held(0) == _dropped_by_hand(t + 1), t
        assert fast.pool.live_pages == plain.pool.live_pages
        held = fast.segments(0).exact
        start = fast.first_held(0)
        assert torch.equal(held[0], k[:, start:t + 1]) and torch.equal(held[1], v[:, start:t + 1])
