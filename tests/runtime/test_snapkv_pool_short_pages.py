"""SnapKV's max-pooling (`max_pool_tokens`) on short pages of every length: the kernel is the
largest odd width that fits the page (at most the requested one), centred on each token and
clipped at the page's ends, and the output keeps one score per token. Checked against a plain
Python loop for lengths 1..20, odd and even, where the short odd lengths (3, 5, 7) shrink the
kernel to the page itself."""

import pytest
import torch

from kvtopo.runtime.policies.snapkv import POOL_KERNEL, max_pool_tokens


def _reference(score: torch.Tensor, kernel: int) -> torch.Tensor:
    n = score.shape[-1]
    width = min(kernel, n if n % 2 else n - 1)
    half = max(width, 1) // 2
    out = torch.empty_like(score, dtype=torch.float64)
    for h in range(score.shape[0]):
        for t in range(n):
            out[h, t] = max(float(x) for x in score[h, max(0, t - half): t + half + 1])
    return out


@pytest.mark.parametrize("n", range(1, 21))
@pytest.mark.parametrize("kernel", [POOL_KERNEL, 5, 3])
def test_pooled_scores_match_a_clipped_centred_window(n, kernel):
    g = torch.Generator().manual_seed(100 * n + kernel)
    score = torch.rand(2, n, generator=g)
    pooled = max_pool_tokens(score, kernel)
    assert pooled.shape == score.shape
    torch.testing.assert_close(pooled.double(), _reference(score, kernel), rtol=0, atol=0)


def test_a_short_odd_page_spreads_its_peak_to_every_token():
    # 5 tokens, 7-token kernel: the kernel shrinks to 5, so the middle token's peak reaches the
    # whole page and the pooled page keeps its 5 scores.
    assert max_pool_tokens(torch.tensor([[0.0, 0, 9, 0, 0]]), 7).tolist() == [[9, 9, 9, 9, 9]]
    # 3 tokens: a 3-wide kernel.
    assert max_pool_tokens(torch.tensor([[1.0, 0, 0]]), 7).tolist() == [[1, 1, 0]]
