"""topo's scores stay finite, and its ranking meaningful, when a kv-head gives the tokens it ranks
nothing to tell apart: identical keys (a repeated token without a rotary embedding: the low-norm
prior's range is zero, and the window's credit ties). A NaN there would make
every page's joint allocation (`Policy.across_heads`, a max over heads) NaN, and the budget would be
handed out in page order instead of by score."""

import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import ScoreInputs, make_policy
from kvtopo.runtime.policies.topo import low_norm_prior, shares, topo_scores

HQ, HKV, D = 4, 2, 16


def test_a_head_of_identical_keys_gets_finite_tied_scores():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(HKV, 24, D, generator=g)
    keys[0] = keys[0, :1].expand(24, D)  # head 0: one key for every token (equal norms, tied credit)
    prior = low_norm_prior(keys)
    assert torch.equal(prior[0], torch.zeros(24)) and torch.isfinite(prior).all()
    assert torch.equal(shares(torch.zeros(2, 5)), torch.zeros(2, 5))  # nothing to share: no NaN
    scores = topo_scores(torch.randn(HQ, 8, D, generator=g), keys, D**-0.5, 4.0)
    assert torch.isfinite(scores).all()
    assert torch.equal(scores[0], scores[0, :1].expand(24))


def test_a_needle_one_head_reads_survives_beside_a_head_of_identical_keys():
    """Head 1 holds a needle the window's queries look for in a late Mid page; head 0's keys are all
    one vector. The needle must be kept (by score), not lost to an allocation in page order."""
    g = torch.Generator().manual_seed(1)
    n, needle = 200, 150
    direction = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    keys = torch.randn(HKV, n, D, generator=g) * 0.3
    keys[0] = torch.randn(D, generator=g)  # head 0: one key for every token
    keys[1, needle] = direction * 6.0
    values = torch.randn(HKV, n, D, generator=g)
    queries = torch.randn(HQ, n, D, generator=g) * 0.3
    queries[2:, -8:] = direction * 6.0  # head 1's query group, the window: looking for the needle
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=8, observation_window=8, target_ratio=4.0)
    cache = LayerCache(config, make_policy(config))
    cache.scale = D**-0.5
    cache.observe(0, queries, HKV)
    cache.append(0, keys, values)
    entry = cache.sequences[0]
    page = entry.pages[needle // 8]
    assert page.kept is not None and 0 < page.kept < 8  # in Mid, evicted in part
    assert sum(p.kept or 0 for p in entry.pages) < 0.5 * sum(p.tokens for p in entry.pages if p.kept is not None)
    stored = entry.mid.keys.decode()[:, 1]  # head 1's Mid keys (4-bit), [rows, D]
    assert (stored @ direction).max() > 4.0  # the needle's key is among them
