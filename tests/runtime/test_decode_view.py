"""The decode step's view of a sequence's pages (``decode_view.decode_segments``) is kept between
steps and updated from the pages that can have changed; after any sequence of prefill chunks and
decode steps, with eviction, Mid epochs and released sequences, it equals the view built from
scratch by walking every page: the exact pages (in order, read in place from the pool) with the
step's new token, and the Recent pages' codes stacked in order."""

from __future__ import annotations

import random

import pytest
import torch

import kvtopo
from kvtopo.kernels.decode_inputs import RecentCodes
from kvtopo.runtime import decode_view

HQ, HKV, D = 4, 2, 16
SCALE = D**-0.5
CONFIGS = {
    "topo evicting": dict(target_ratio=4.0),
    "topo refits": dict(target_ratio=None, key_energy=0.9, value_energy=0.9, refit_after=64),
    "kivi": dict(policy="kivi", target_ratio=None),
}


def _from_scratch(cache, seq, k_new, v_new):
    """(exact keys, exact values, RecentCodes or None) by walking every page."""
    entry = cache.sequences[seq]
    exact = [p for p in entry.pages if p.slot is not None]
    keys = torch.cat([cache.pool.keys[p.slot, :, : p.tokens] for p in exact] + [k_new], 1)
    values = torch.cat([cache.pool.values[p.slot, :, : p.tokens] for p in exact] + [v_new], 1)
    recent = [(p.recent.keys, p.recent.values) for p in entry.pages if p.recent is not None]
    return keys, values, RecentCodes.from_pages(recent, cache.config.page_size) if recent else None


def _check(cache, seq, g):
    k_new, v_new = torch.randn(HKV, 1, D, generator=g), torch.randn(HKV, 1, D, generator=g)
    segs = decode_view.decode_segments(cache, seq, k_new, v_new)
    keys, values, recent = _from_scratch(cache, seq, k_new, v_new)
    exact = segs.exact_kv()
    assert torch.equal(exact[0], keys) and torch.equal(exact[1], values)
    # float32 CPU pools hand the exact pages over in place; the step's token comes alone
    assert segs.exact_pages is not None and torch.equal(segs.exact[0], k_new)
    assert (segs.recent is None) == (recent is None)
    if recent is not None:
        for field in ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset"):
            assert torch.equal(getattr(segs.recent, field), getattr(recent, field)), field


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_view_equals_a_rebuild(name, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=24, **CONFIGS[name])
    with kvtopo.session(config) as s:
        lengths = {}
        for _ in range(60):
            seq = rng.randrange(3)
            if seq in lengths and rng.random() < 0.05:  # released, then started again
                s.release(seq)
                del lengths[seq]
                continue
            tokens = 1 if seq in lengths and rng.random() < 0.8 else rng.choice([1, 5, 8, 13, 40])
            q = torch.randn(HQ, tokens, D, generator=g)
            k, v = torch.randn(HKV, tokens, D, generator=g), torch.randn(HKV, tokens, D, generator=g)
            s.attend_sequence("layer0", seq, q, k, v, SCALE)
            lengths[seq] = lengths.get(seq, 0) + tokens
            cache = s.layers["layer0"]
            for other in lengths:
                _check(cache, other, g)


def test_a_bfloat16_pool_is_read_in_place_by_the_kernel():
    """A bfloat16 session's exact pages go to the CPU kernel in place (16-bit codes, not widened
    into a copy), and the decode step equals the float64 reference over the same tokens."""
    from kvtopo.kernels.decode_reference import reference_decode
    from kvtopo.kernels.fast_decode import decode_attention

    g = torch.Generator().manual_seed(0)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        n = 70  # 4 full pages and a partial one
        q, k, v = (torch.randn(1, h, n, D, generator=g).bfloat16() for h in (HQ, HKV, HKV))
        s.attend("l", q, k, v, None, SCALE)
        cache = s.layers["l"]
        assert cache.pool.keys.dtype == torch.bfloat16
        k_new, v_new = (torch.randn(HKV, 1, D, generator=g).bfloat16() for _ in range(2))
        segs = decode_view.decode_segments(cache, 0, k_new, v_new)
        assert segs.exact_pages is not None and segs.exact_pages.keys.dtype == torch.bfloat16
        step_q = torch.randn(HQ, D, generator=g)
        out = decode_attention(step_q, segs, SCALE)
        ref = reference_decode(step_q, segs, SCALE)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
