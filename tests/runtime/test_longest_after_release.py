"""`LayerCache.longest()` (read by every forward: `Session._check_continuation`, the HF cache's
continuation check) follows releases: releasing the longest sequence leaves the longest of the
others, releasing all leaves 0, so a fresh sequence is not judged as continuing stale tokens."""

import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import make_policy


def test_longest_is_the_longest_sequence_still_held():
    config = kvtopo.Config.lossless(page_size=4)
    cache = LayerCache(config, make_policy(config))
    for seq, n in ((0, 10), (1, 5), (2, 7)):
        cache.append(seq, torch.randn(2, n, 4), torch.randn(2, n, 4))
    assert cache.longest() == 10
    cache.release(0)
    assert cache.longest() == 7
    cache.release(2)
    assert cache.longest() == 5
    cache.release(1)
    assert cache.longest() == 0
    cache.append(3, torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    assert cache.longest() == 3
