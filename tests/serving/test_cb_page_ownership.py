"""`page_ownership_errors` (what the serving tests check after every engine step) reports each way
a pool can break page ownership; a checker that misses one would let a leak pass every test
that relies on it."""

import torch

import kvtopo
from kvtopo.runtime.session import Session
from kvtopo.serving.continuous_batching import page_ownership_errors


def _session():
    s = Session(kvtopo.Config.lossless(page_size=4))
    g = torch.Generator().manual_seed(0)
    with s:
        for seq, n in ((0, 10), (1, 6)):
            kv = torch.randn(2, n, 8, generator=g)
            s.attend_sequence("l", seq, torch.randn(4, n, 8, generator=g), kv, kv.clone(), 0.35)
    return s


def test_a_whole_store_has_no_errors():
    assert page_ownership_errors(_session()) == []


def test_a_leaked_slot_is_reported():
    s = _session()
    s.layers["l"].pool.allocate()  # live in the pool, in no block table
    errors = page_ownership_errors(s)
    assert len(errors) == 1 and "live slots" in errors[0], errors


def test_a_slot_in_two_block_tables_is_reported():
    s = _session()
    cache = s.layers["l"]
    cache.sequences[1].pages[0].slot = cache.sequences[0].pages[0].slot
    cache.sequences[1].slots_changed()
    errors = page_ownership_errors(s)
    assert any("block tables of sequences 0 and 1" in e for e in errors), errors
