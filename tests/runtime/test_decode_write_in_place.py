"""A batch's decode tokens stored as `Session._decode_batch` stores them (`LayerCache.write_in_place`
for the tokens that land in a page with room, the queries observed, `append` for the rest) leave
the store exactly as appending each token on its own would: the same
pages, phases, kept tokens, Mid rows, block tables, observation windows and bytes, and every
exact page holds the same keys and values. Sequences start at lengths on both sides of page
boundaries and of the first Mid page, so the steps cover writes into a page with room (the
batched copy), pages that open and move others (the lifecycle), a projected policy's refits
and a sequence that joins mid-run."""

from __future__ import annotations

import pytest
import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import make_policy

from store_walk import held_tensor_bytes

HQ, HKV, D = 4, 2, 16
P = 4
STARTS = (0, 3, 4, 5, 11, 23, 24, 40)  # tokens each sequence holds before the decode steps
STEPS = 13

CONFIGS = {
    "topo": dict(target_ratio=3.0),
    "topo-projected-refits": dict(key_energy=0.9, value_energy=0.9, refit_after=16, target_ratio=3.0),
    "kivi": dict(policy="kivi", target_ratio=None),
    "lossless": None,
}


def _cache(name):
    fields = CONFIGS[name]
    config = (kvtopo.Config.lossless(page_size=P) if fields is None else
              kvtopo.Config(page_size=P, sink_tokens=4, recent_tokens=8, observation_window=4, **fields))
    cache = LayerCache(config, make_policy(config))
    cache.scale = D ** -0.5
    return cache


def _state(cache, seq):
    entry = cache.sequences[seq]
    pages = [(p.phase, p.tokens, p.kept, p.slot is not None) for p in entry.pages]
    exact = [(cache.pool.keys[p.slot, :, : p.tokens], cache.pool.values[p.slot, :, : p.tokens])
             for p in entry.pages if p.slot is not None]
    mids = [m.attention_inputs() for m in entry.retired + ([entry.mid] if entry.mid is not None else [])]
    return pages, entry.length, entry.final_length, len(entry.block_table), exact, mids, entry.observation, \
        cache.sequence_nbytes(entry), cache.held_tokens(seq)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize("name", CONFIGS)
def test_batched_decode_append_equals_appends_one_by_one(name):
    batched, single = _cache(name), _cache(name)
    g = torch.Generator().manual_seed(0)
    seqs = list(range(len(STARTS)))
    for seq, start in zip(seqs, STARTS):
        if start:
            q, k, v = (torch.randn(h, start, D, generator=g) for h in (HQ, HKV, HKV))
            for cache in (batched, single):
                cache.observe(seq, q, HKV)
                cache.append(seq, k, v)
    fast_writes = 0
    for step in range(STEPS):
        live = seqs + ([len(seqs)] if step >= STEPS // 2 else [])  # a sequence joins halfway
        q, k, v = (torch.randn(len(live), h, 1, D, generator=g) for h in (HQ, HKV, HKV))
        for i, seq in enumerate(live):
            single.observe(seq, q[i], HKV)
            single.append(seq, k[i], v[i])
        pending = batched.write_in_place(live, k, v)
        for i, seq in enumerate(live):
            batched.observe(seq, q[i], HKV)
        for i in pending:
            batched.append(live[i], k[i], v[i])
        fast_writes += len(live) - len(pending)
        for seq in live:
            assert _same(_state(batched, seq), _state(single, seq)), (name, step, seq)
        assert held_tensor_bytes(batched) == held_tensor_bytes(single)
        assert sum(batched.nbytes().values()) == sum(single.nbytes().values())
    assert fast_writes > STEPS * len(STARTS) // 2, "most decode tokens land in a page with room"


def test_write_in_place_refuses_repeated_sequences():
    cache = _cache("topo")
    k = torch.randn(2, HKV, 1, D)
    with pytest.raises(ValueError, match="distinct sequence"):
        cache.write_in_place([0, 0], k, k)
