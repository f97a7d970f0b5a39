"""Byte accounting when keys and values have different widths (dk != dv, e.g. MLA-like or
projected value heads): a pool page costs its key rows plus its value rows, and the layer's
accounting equals the bytes of the tensors it holds. Every existing accounting test uses dk == dv."""

import pytest
import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.page_pool import PagePool
from kvtopo.runtime.policies import make_policy
from store_walk import held_tensor_bytes


@pytest.mark.parametrize("key_dim, value_dim", [(8, 5), (3, 12)])
def test_a_pool_page_costs_its_key_and_value_rows(key_dim, value_dim):
    pool = PagePool(3, 4, key_dim, value_dim, torch.float32, torch.device("cpu"))
    slot = pool.allocate()
    hand = 3 * 4 * (key_dim + value_dim) * 4  # heads x page x (dk + dv) x float32
    assert pool.page_nbytes == hand == pool.keys[slot].nbytes + pool.values[slot].nbytes
    assert pool.nbytes == pool.capacity * hand


@pytest.mark.parametrize("config", [kvtopo.Config.lossless(page_size=4),
                                    kvtopo.Config(page_size=4, sink_tokens=4, recent_tokens=8, target_ratio=3.0,
                                                  observation_window=4)],
                         ids=["lossless", "topo"])
def test_layer_bytes_are_the_held_tensors_when_key_and_value_widths_differ(config):
    cache = LayerCache(config, make_policy(config))
    cache.scale = 0.25
    g = torch.Generator().manual_seed(0)
    for n in (13, 1, 1, 7, 20, 1):
        cache.observe(0, torch.randn(4, n, 8, generator=g), 2)
        cache.append(0, torch.randn(2, n, 8, generator=g), torch.randn(2, n, 4, generator=g))
        kinds = cache.nbytes()
        assert sum(kinds.values()) == held_tensor_bytes(cache)
        live = cache.pool.live_pages * (2 * 4 * (8 + 4) * 4)
        assert kinds["free"] == cache.pool.nbytes - live
