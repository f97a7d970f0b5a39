"""topo's successor shares need the query of each ranked token's predecessor. When a prefill
chunk holds none of them (every `predecessor_rows` entry is -1: the ranked tokens' predecessors
were stored with earlier chunks) and no earlier chunk left credit, the shares carry no
information: the scores are exactly those computed without predecessor queries, finite, and
still rank by the window's credit and the low-norm prior."""

import torch

from kvtopo.runtime.policies.topo import topo_scores


def _case(seed=0, heads=2, q_heads=4, n=24, dim=16):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, dim, generator=g)
    queries = torch.randn(q_heads, 4, dim, generator=g)
    predecessor_queries = torch.randn(q_heads, 10, dim, generator=g)
    return queries, keys, predecessor_queries


def test_no_held_predecessor_leaves_the_scores_as_without_predecessors():
    queries, keys, predecessor_queries = _case()
    rows = torch.full((keys.shape[1],), -1, dtype=torch.long)
    without = topo_scores(queries, keys, 0.25, 4.0)
    given = topo_scores(queries, keys, 0.25, 4.0, predecessor_queries=predecessor_queries, predecessor_rows=rows)
    assert torch.isfinite(given).all()
    torch.testing.assert_close(given, without, rtol=0, atol=0)


def test_an_all_nan_held_credit_is_no_credit_either():
    queries, keys, predecessor_queries = _case(seed=1)
    rows = torch.full((keys.shape[1],), -1, dtype=torch.long)
    held = torch.full(keys.shape[:2], float("nan"))
    without = topo_scores(queries, keys, 0.25, 4.0)
    given = topo_scores(queries, keys, 0.25, 4.0, predecessor_queries=predecessor_queries, predecessor_rows=rows,
                        held_credit=held)
    torch.testing.assert_close(given, without, rtol=0, atol=0)


def test_one_held_predecessor_makes_the_shares_count():
    queries, keys, predecessor_queries = _case(seed=2)
    rows = torch.full((keys.shape[1],), -1, dtype=torch.long)
    rows[7] = 3
    given = topo_scores(queries, keys, 0.25, 4.0, predecessor_queries=predecessor_queries, predecessor_rows=rows)
    assert torch.isfinite(given).all()
    assert not torch.equal(given, topo_scores(queries, keys, 0.25, 4.0))
