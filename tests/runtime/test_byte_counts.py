"""The store's byte accounting is kept as pages change (`PageBytes`), not walked per call: after
random appends (prefill chunks and decode steps), evictions into Mid, sliding-window drops and
releases of interleaved sequences, it equals a walk of every page from scratch, for the layer
(`nbytes`), each sequence (`sequence_nbytes`, also inside an append while a page is opening,
where the lifecycle sizes evictions by it) and the tokens each sequence holds."""

import random

import pytest
import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.phases import Phase
from kvtopo.runtime.policies import make_policy

from store_walk import held_tensor_bytes

HQ, HKV, DIM = 4, 2, 16


def walked_page_nbytes(cache, page) -> int:
    if page.slot is not None or page.phase is Phase.TERMINAL:
        return cache.pool.page_nbytes
    return page.recent.nbytes if page.recent is not None else 0


def walked_metadata(entry) -> int:
    mass = sum(p.mass.nbytes for p in entry.pages if p.mass is not None)
    observation = entry.observation.nbytes if entry.observation is not None else 0
    return entry.block_table.nbytes + observation + mass


def walked_sequence_nbytes(cache, entry) -> int:
    epochs = entry.retired + ([entry.mid] if entry.mid is not None else [])
    return (sum(walked_page_nbytes(cache, p) for p in entry.pages) + sum(m.nbytes for m in epochs)
            + walked_metadata(entry))


def walked_nbytes(cache) -> dict[str, int]:
    kinds = {phase.value: 0 for phase in Phase} | {"free": 0, "metadata": 0}
    for entry in cache.sequences.values():
        for page in entry.pages:
            kinds[page.phase.value] += walked_page_nbytes(cache, page)
        for mid in entry.retired + ([entry.mid] if entry.mid is not None else []):
            bases = sum(b.nbytes for b in (mid.key_bases, mid.value_bases) if b is not None)
            kinds["mid"] += mid.nbytes - bases
            kinds["metadata"] += bases
        kinds["metadata"] += walked_metadata(entry)
    if cache.pool is not None:
        kinds["free"] = cache.pool.nbytes - cache.pool.live_pages * cache.pool.page_nbytes
    return kinds


def walked_held_tokens(entry) -> int:
    evicted = sum(p.tokens - p.kept for p in entry.pages if p.kept is not None)
    return entry.length - entry.dropped - evicted


def check(cache) -> None:
    assert cache.nbytes() == walked_nbytes(cache)
    assert sum(cache.nbytes().values()) == held_tensor_bytes(cache)
    for seq, entry in cache.sequences.items():
        assert cache.sequence_nbytes(entry) == walked_sequence_nbytes(cache, entry)
        assert cache.held_tokens(seq) == walked_held_tokens(entry)


def checked_mid_append(monkeypatch) -> list[int]:
    """Check every `sequence_nbytes` call against the walk (the lifecycle calls it inside appends)."""
    calls = []
    counted = LayerCache.sequence_nbytes

    def checked(cache, entry):
        calls.append(1)
        assert counted(cache, entry) == walked_sequence_nbytes(cache, entry)
        return counted(cache, entry)

    monkeypatch.setattr(LayerCache, "sequence_nbytes", checked)
    return calls


@pytest.mark.parametrize("fields", [
    dict(),  # topo: Recent codes, Mid rows ranked per append
    dict(eviction_scope="page", refit_after=16),
    dict(policy="h2o"),  # attention mass on unsettled pages
    dict(policy="kivi"),
    dict(policy="streaming"),
    dict(key_energy=0.9, value_energy=0.9, refit_after=16),  # projected Mid, epochs refitted
    dict(protected_spans=((20, 45),)),
])
def test_counts_equal_a_walk_after_random_appends_evictions_and_releases(fields, monkeypatch):
    calls = checked_mid_append(monkeypatch)
    rng = random.Random(0)
    config = kvtopo.Config(page_size=4, sink_tokens=4, recent_tokens=8, target_ratio=3.0, observation_window=4,
                           **fields)
    live, next_seq = [], 0
    with kvtopo.session(config) as s:
        for step in range(120):
            if live and rng.random() < 0.1:
                s.release(live.pop(rng.randrange(len(live))))
            else:
                if not live or rng.random() < 0.15:
                    live.append(next_seq)
                    next_seq += 1
                seq = rng.choice(live)
                n = rng.choice([1, 1, 1, 3, 9, 26])
                g = torch.Generator().manual_seed(step)
                q, k, v = (torch.randn(h, n, DIM, generator=g) for h in (HQ, HKV, HKV))
                s.attend_sequence("l", seq, q, k, v, 0.25)
            check(s.layers["l"])
    assert calls, "the lifecycle sized some eviction by sequence_nbytes"


def test_window_drops_are_counted():
    config = kvtopo.Config.lossless(page_size=4)
    cache = LayerCache(config, make_policy(config), window=10)
    rng = random.Random(1)
    for step in range(80):
        seq = rng.randrange(3)
        if rng.random() < 0.1:
            cache.release(seq)
        else:
            n = rng.choice([1, 1, 5, 13])
            cache.append(seq, torch.randn(HKV, n, DIM), torch.randn(HKV, n, DIM))
        check(cache)
    assert any(entry.dropped for entry in cache.sequences.values())
