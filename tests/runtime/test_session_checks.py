"""A session's safety checks that silently wrong results hide behind:

* an error in a call that stores several sequences' chunks (`attend_sequences`, a batch
  `attend`) leaves every one of them refused until released, not only the first;
* a mask tensor that passed the session's checks and is then changed in place is checked again
  (a bidirectional mask must raise, not be replaced by the causal one).
"""

import pytest
import torch

import kvtopo
from kvtopo.runtime.page_pool import PoolExhausted

HQ, HKV, D = 4, 2, 8
SCALE = D**-0.5


def _chunk(n, seed, batch):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, n, D, generator=g) for h in (HQ, HKV, HKV)]


def test_every_sequence_of_a_failed_batch_call_is_refused_until_released():
    """Two sequences' 20-token chunks in one batch call; the pool (5 pages of 8) holds the first
    sequence's 3 pages and not the second's: both sequences stay refused (the second is stored in
    part), and each goes on once released."""
    config = kvtopo.Config.lossless(page_size=8, max_pages=5)
    with kvtopo.session(config) as s:
        with pytest.raises(PoolExhausted):
            s.attend_sequences("l", [3, 9], *_chunk(20, seed=0, batch=2), SCALE)
        for seq in (3, 9):
            with pytest.raises(RuntimeError, match=r"hold a chunk stored in part"):
                s.attend_sequence("l", seq, *(x[0] for x in _chunk(1, seed=1, batch=1)), SCALE)
        for seq in (9, 3):
            s.release(seq)
            s.attend_sequence("l", seq, *(x[0] for x in _chunk(4, seed=2, batch=1)), SCALE)
            assert s.layers["l"].length(seq) == 4


def test_a_mask_changed_in_place_after_passing_is_checked_again():
    q, k, v = _chunk(6, seed=3, batch=1)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    with kvtopo.session(kvtopo.Config.lossless(page_size=8)) as s:
        s.attend("a", q, k, v, mask, SCALE, is_causal=False)  # a causal mask: what the session applies
        mask.fill_(True)  # now bidirectional: the session cannot honour it over a cached history
        with pytest.raises(ValueError, match="its mask shows key"):
            s.attend("b", q, k, v, mask, SCALE, is_causal=False)
