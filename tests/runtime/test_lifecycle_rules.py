"""Lifecycle rules that hold for a config whatever the data: when projected bases are refitted
(`Lifecycle.next_refit`: at each doubling, never before `refit_after`), which byte budget binds
when both a ratio and a byte cap are set (the tighter), and how many query positions the
observation window holds for a wide query group (`observed_positions`)."""

import pytest
import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.lifecycle import budget_bytes, observed_positions
from kvtopo.runtime.policies import make_policy


def _cache(**fields) -> LayerCache:
    config = kvtopo.Config(**fields)
    cache = LayerCache(config, make_policy(config))
    cache.scale = 0.25
    return cache


def _kv(n, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -2, dim)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0]
    return ((torch.randn(heads, n, dim, generator=g) * spectrum) @ basis.T,
            (torch.randn(heads, n, dim, generator=g) * spectrum) @ basis)


@pytest.mark.parametrize("refit_after, fits", [
    (256, [128, 512, 1024]),  # first fit at 128 (Mid reached): the next at 2 x max(128, 256), then each doubling
    (64, [128, 256, 512, 1024]),  # refit_after below the first fit: each doubling of the fit
])
def test_bases_are_refitted_at_each_doubling_but_never_before_twice_refit_after(refit_after, fits):
    cache = _cache(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=None, key_energy=0.9,
                   value_energy=0.9, refit_after=refit_after)
    k, v = _kv(1024)
    started, mid = [], None
    for start in range(0, 1024, 64):
        cache.append(0, k[:, start:start + 64], v[:, start:start + 64])
        entry = cache.sequences[0]
        if entry.mid is not mid:
            mid = entry.mid
            started.append(start + 64)
    assert started == fits
    assert len(entry.retired) == len(fits) - 1


@pytest.mark.parametrize("ratio, cap, length", [(2.0, 10_000, 4096), (8.0, 10**9, 4096), (4.0, 5_000, 100)])
def test_budget_is_the_tighter_of_the_ratio_and_the_byte_cap(ratio, cap, length):
    fp16 = 2 * 2 * (16 + 16)
    config = kvtopo.Config(target_ratio=ratio, layer_budget_bytes=cap)
    assert budget_bytes(config, length, fp16) == min(length * fp16 / ratio, cap)
    assert budget_bytes(config.replace(layer_budget_bytes=None), length, fp16) == length * fp16 / ratio
    assert budget_bytes(config.replace(target_ratio=None), length, fp16) == cap
    assert budget_bytes(config.replace(target_ratio=None, layer_budget_bytes=None), length, fp16) is None


def test_a_store_with_a_loose_ratio_and_a_tight_cap_keeps_what_the_cap_alone_keeps():
    fields = dict(page_size=8, sink_tokens=8, recent_tokens=16, observation_window=8)
    k, v = _kv(400, seed=1)
    q = torch.randn(4, 400, 16, generator=torch.Generator().manual_seed(2))
    kept = {}
    for name, budget in {"both": dict(target_ratio=1.0, layer_budget_bytes=6_000),
                         "cap": dict(target_ratio=None, layer_budget_bytes=6_000),
                         "ratio": dict(target_ratio=1.0)}.items():
        cache = _cache(**fields, **budget)
        for start in range(0, 400, 100):
            cache.observe(0, q[:, start:start + 100], 2)
            cache.append(0, k[:, start:start + 100], v[:, start:start + 100])
        entry = cache.sequences[0]
        kept[name] = ([p.kept for p in entry.pages], cache.sequence_nbytes(entry))
    assert kept["both"] == kept["cap"]
    # At every length the ratio allows more (128 bytes a token at 1x, 12800 at 100 tokens) than the cap.
    assert kept["ratio"][1] > kept["cap"][1]


@pytest.mark.parametrize("window, q_heads, kv_heads, held", [
    (32, 8, 8, 32), (32, 64, 8, 32),  # groups of 1 and 8 query heads: the whole window
    (32, 16, 1, 16), (32, 128, 1, 2), (32, 128, 2, 4),  # wider groups: what a group of 8 costs
    (32, 4096, 1, 1), (5, 24, 1, 1),  # at least one position
])
def test_a_wide_query_group_holds_proportionally_fewer_positions(window, q_heads, kv_heads, held):
    assert observed_positions(window, q_heads, kv_heads) == held
    cache = _cache(page_size=8, sink_tokens=8, recent_tokens=16, observation_window=window)
    cache.observe(0, torch.randn(q_heads, 40, 4), kv_heads)
    assert cache.sequences[0].observation.shape == (q_heads, held, 4)
