"""A decode step that fills a bounded page pool (`max_pages`) in the middle of a layer's batched
decode steps (runtime/decode_batch.py) raises as the per-sequence path raises, and leaves the
store as that path leaves it: after the failed step, every sequence's counters, pages and pooled
tokens, and the steps of sequences started after the failed ones are released, are the bits of
a twin session whose layer never batches its decode steps."""

from __future__ import annotations

import pytest
import torch

import kvtopo
from kvtopo.runtime.page_pool import PoolExhausted

HQ, HKV, D = 8, 2, 32
SCALE = D**-0.5
PAGE = 8
LENGTHS = (70, 45, 20)  # 9 + 6 + 3 pages; 2, 3 and 4 free rows in the last ones
MAX_PAGES = 9 + 6 + 3


def _config():
    return kvtopo.Config.lossless(page_size=PAGE, prefill_chunk_size=512, max_pages=MAX_PAGES)


def _steps(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(len(LENGTHS), h, 1, D, generator=g) for h in (HQ, HKV, HKV)] for _ in range(count)]


def _state(cache):
    seqs = cache.sequences
    out = []
    for seq, e in sorted(seqs.items()):
        rows = [(cache.pool.keys[p.slot, :, : p.tokens].clone(), cache.pool.values[p.slot, :, : p.tokens].clone())
                for p in e.pages if p.slot is not None]
        out.append((seq, e.length, [(p.tokens, p.phase) for p in e.pages], rows))
    return out


def _assert_same(a, b):
    for x, y in zip(_state(a.layers["l"]), _state(b.layers["l"]), strict=True):
        assert x[:3] == y[:3]
        for (ka, va), (kb, vb) in zip(x[3], y[3], strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_full_pool_in_a_batched_decode_step_leaves_the_store_as_the_per_sequence_path():
    g = torch.Generator().manual_seed(0)
    prompts = [[torch.randn(h, n, D, generator=g) for h in (HQ, HKV, HKV)] for n in LENGTHS]
    with kvtopo.session(_config()) as batched, kvtopo.session(_config()) as twin:
        for s in (batched, twin):
            for b, prompt in enumerate(prompts):
                s.attend_sequence("l", b, *prompt, SCALE)
        twin.layers["l"].decode_batch_refused = 10**9
        failed = None
        for i, (q, k, v) in enumerate(_steps(6, seed=1)):
            outcome = []
            for s in (batched, twin):
                try:
                    outcome.append(s.attend("l", q, k, v, None, SCALE))
                except PoolExhausted:
                    outcome.append(None)
            assert (outcome[0] is None) == (outcome[1] is None), i
            if outcome[0] is None:
                failed = i
                break
            assert torch.equal(outcome[0], outcome[1])
        assert failed is not None and failed >= 2  # a batched step, past the first (per-sequence) one
        assert [batched.layers["l"].length(s) for s in range(3)] == [twin.layers["l"].length(s) for s in range(3)]
        _assert_same(batched, twin)
        # Every sequence of the failed call holds a chunk stored in part: released, the layer
        # takes new sequences, whose decode steps are batched again.
        g = torch.Generator().manual_seed(3)
        fresh = [[torch.randn(h, n, D, generator=g) for h in (HQ, HKV, HKV)] for n in (12, 5)]
        for s in (batched, twin):
            for seq in range(3):
                s.release(seq)
            for seq, prompt in zip((3, 4), fresh):
                s.attend_sequence("l", seq, *prompt, SCALE)
        for q, k, v in _steps(PAGE, seed=2):
            rows = torch.tensor([1, 2])
            out = batched.attend_sequences("l", [3, 4], q[rows], k[rows], v[rows], SCALE)
            ref = twin.attend_sequences("l", [3, 4], q[rows], k[rows], v[rows], SCALE)
            assert torch.equal(out, ref)
        _assert_same(batched, twin)
