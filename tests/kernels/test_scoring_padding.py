"""``expfree_scores(..., num_queries=n)``: the window's rows past n are padding (an exported
compressor's fixed window, export/compressor.py) and get no say, in every query head of a group.

The export tests always pass ``num_queries = W`` (no padding), so nothing else checks that the
padding mask covers exactly rows >= n, nor that it is laid out per query head of the group
(rows of kv-head h are ``g * W + w``)."""

from __future__ import annotations

import pytest
import torch

from kvtopo.kernels.scoring import DEFAULT_MARGIN, expfree_scores


def _scores_float64(q, k, scale, num_queries):
    """float64 loops over query heads and the first `num_queries` window rows only."""
    kv_heads, n = k.shape[:2]
    groups = q.shape[0] // kv_heads
    expected = torch.zeros(kv_heads, n, dtype=torch.float64)
    for h in range(q.shape[0]):
        for w in range(num_queries):
            logits = scale * k[h // groups].double() @ q[h, w].double()
            expected[h // groups] += torch.relu(logits - logits.max() + DEFAULT_MARGIN)
    return expected


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("num_queries", [1, 4, 7])
@pytest.mark.parametrize("as_tensor", [False, True])  # an int, or a 0-d tensor (an exported graph's input)
def test_padding_rows_get_no_say(groups, num_queries, as_tensor):
    g = torch.Generator().manual_seed(groups * 10 + num_queries)
    kv_heads, w, n, d, scale = 2, 8, 23, 16, 0.4
    q = 3 * torch.randn(kv_heads * groups, w, d, generator=g)
    k = torch.randn(kv_heads, n, d, generator=g)
    # The padding rows point at other tokens than the real ones: counting any of them shows.
    q[:, num_queries:] = -q[:, num_queries:] * 5
    count = torch.tensor(num_queries) if as_tensor else num_queries
    got = expfree_scores(q, k, scale, num_queries=count)
    torch.testing.assert_close(got.double(), _scores_float64(q, k, scale, num_queries), rtol=1e-5, atol=1e-5)
    if num_queries < w:
        # the same as dropping the padding rows from the window
        torch.testing.assert_close(got, expfree_scores(q[:, :num_queries].contiguous(), k, scale), rtol=1e-6, atol=1e-6)


def test_full_window_equals_no_mask():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 5, 8, generator=g), torch.randn(2, 11, 8, generator=g)
    assert torch.equal(expfree_scores(q, k, 0.3, num_queries=5), expfree_scores(q, k, 0.3))
